"""The ``cunorm`` torch library: how each registered operator is defined
(schema, kernel, fake implementation, autograd formula).

The operators are defined on a ``torch.library.Library`` directly rather
than through ``torch.library.custom_op``, whose dispatch wraps every call
in an output-aliasing check and a second Python wrapper, and gives an
operator without an autograd formula a Python autograd kernel that
redispatches: a compiled backward took 15-25 us more host time a call
that way (docs/notes/host-time.md, "The registered operators").
What custom_op gives that matters here is kept: the kernel runs with
dynamo disabled (a frame of it is never traced), and an operator without
an autograd formula refuses a call that autograd would record instead of
letting torch's fallback pass a gradient of nothing through it. The
kernels never return an input or a view of one (each output is allocated
by the call), which is what the aliasing check checks.
"""
from __future__ import annotations

import torch
from torch import Tensor

from ._autograd import once_differentiable

NAMESPACE = "cunorm"
LIBRARY = torch.library.Library(NAMESPACE, "FRAGMENT")

_RECORDED = ("cunorm::{name} has no gradient (a backward operator, or an inference-only one): it was called with "
             "grad enabled on a tensor that requires grad. Call it under torch.no_grad(), or on detached tensors.")


def _refusing_recorded(name: str, kernel):
    """kernel, refusing a call whose outputs autograd would record (the
    autograd fallback would give them a gradient of nothing)."""

    def call(*args):
        if torch.is_grad_enabled() and any(isinstance(a, Tensor) and a.requires_grad for a in args):
            raise RuntimeError(_RECORDED.format(name=name))
        return kernel(*args)

    return call


def define(name: str, schema: str, kernel, fake, backward=None, setup_context=None) -> None:
    """Define ``torch.ops.cunorm.<name>``: ``schema`` its arguments and
    returns ("(Tensor x, ...) -> Tensor[]"), ``kernel`` and ``fake`` its
    implementations (positional arguments in schema order), and with
    ``backward`` its autograd formula (run under torch's
    once_differentiable where the backward itself records, so a double
    backward raises); without one, a call autograd would record raises."""
    LIBRARY.define(name + schema)
    if backward is None:
        kernel = _refusing_recorded(name, kernel)
    # (every device: a CPU tensor reaches the engine, whose TypeError names what came)
    LIBRARY.impl(name, torch._disable_dynamo(kernel), "CompositeExplicitAutograd")
    qualname = f"{NAMESPACE}::{name}"
    torch.library.register_fake(qualname, fake, lib=LIBRARY)
    if backward is not None:
        torch.library.register_autograd(qualname, once_differentiable(backward), setup_context=setup_context,
                                        lib=LIBRARY)
