"""The table of ops: each public op, forward and gradient, described once.

An Op names its family (the row or the channel pipeline), its norm policy,
the arrays it takes and their roles (x; parameters over the normalized
axes or per channel; the residual; BatchNorm's running buffers), the
statistics ``return_stats`` adds, the epilogue's options it accepts, its
default eps, its float64 reference forward and backward, and the operators
it runs as where a framework registers operators (cunorm.torch): their
arguments in order, each named by its role in ARGUMENTS. The front ends
derive their registrations from this table: cunorm.torch builds each
operator's schema, implementation, fake and autograd formula from it
(cunorm/torch/_operators.py).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from .. import reference

#: the default eps of the normalizing ops, added to the statistic ...
DEFAULT_EPS = 1e-5
#: ... and of the Lp family, the least norm divided by (torch's F.normalize)
LP_EPS = 1e-12

#: every argument an operator may take, by name: what it is
ARGUMENTS = {
    # arrays
    "x": "array",                      # the input (the forward's h for a backward)
    "dy": "array",                     # the gradient of y
    "mean": "array",                   # a statistic the forward returned
    "rstd": "array",
    "weight": "optional array",        # affine parameters
    "bias": "optional array",
    "residual": "optional array",      # h = x + residual, normalized and returned
    "dh": "optional array",            # the gradient that reached the returned h
    "running_mean": "optional array",  # BatchNorm's running estimates
    "running_var": "optional array",
    "shift": "optional array",          # adaLN's modulation, y = affine * (1 + scale) + shift
    "scale": "optional array",
    "residual_gate": "optional array",  # h = residual + residual_gate * x
    "gate": "optional array",           # the gated RMSNorm's z
    "gated_x": "optional array",        # the x residual_gate scaled (a modulated backward's)
    # scalars
    "axes": "ints",                    # the normalized axes (empty: every axis)
    "eps": "float",
    "return_stats": "bool",
    "epilogue": "int",                 # the epilogue's FLAGS bits (plans.py)
    "norm": "name",                    # a norm policy's name (the Lp family, the channel backward)
    "num_groups": "int",
    "channel_axis": "int",
    "training": "bool",
    "momentum": "float",
    "norm_before_gate": "bool",        # the gated RMSNorm's order (norm(x) * w * silu(z), else norm(x * silu(z)) * w)
}


@dataclass(frozen=True)
class Operator:
    """A registered operator: its name and arguments in order (ARGUMENTS).
    ``single``: it returns one array (else a list: y, then h, then the
    statistics, then BatchNorm's updated running buffers)."""

    name: str
    arguments: tuple[str, ...]
    single: bool = False


@dataclass(frozen=True)
class Op:
    """One public op (``cunorm.<name>``).

    family: "rows" (over adjacent axes) or "channels" (GroupNorm,
        InstanceNorm, BatchNorm over NCHW / NHWC activations).
    norm: the forward's policy name; None where a scalar picks it (p).
    params: the affine parameters it takes, in order.
    residual: it takes ``residual=`` (h = x + residual, returned after y).
    running: it takes BatchNorm's running buffers.
    statistics: what ``return_stats=True`` appends, in order.
    options: the epilogue's options it accepts (``weight_offset``,
        ``rounding``, ``activation``).
    eps: the default eps.
    reference, reference_backward: the float64 NumPy definitions.
    forward, backward: the operators it runs as (ops of one family may
        share one: the Lp family's, the channel norms' backward).
    per_sample: its statistic groups lie within one sample (False:
        BatchNorm's, which span the batch and every position).
    conditioned: the per-row operands it takes (conditioning.py): adaLN's
        ``shift`` and ``scale``, the gated residual's ``residual_gate``,
        the gated RMSNorm's ``gate`` (and per-head parameters, which every
        op with parameters over rows takes through their shape).
    conditioned_operators: the forward operator that takes them and the
        backward operator of its modulated forms (modulated_grad.py); the
        forward's autograd formula refuses the forms its backward operators
        do not take (the front ends compose those where autograd records).
    gated_backward: the backward operator of the conditioned forward's
        gated form (gate= over rows, gated_grad.py), which its autograd
        formula calls in place of the modulated one.
    wide_backward: the backward operator of the plain forward with a
        float32 residual under 16-bit x (the float32 residual stream,
        wide_grad.py), which its autograd formula calls in place of the
        plain one: [dx, dresidual, dweight?, dbias?].
    """

    name: str
    family: str
    norm: str | None
    params: tuple[str, ...]
    residual: bool
    running: bool
    statistics: tuple[str, ...]
    options: tuple[str, ...]
    eps: float
    reference: Callable
    reference_backward: Callable
    forward: Operator
    backward: Operator
    per_sample: bool = True
    conditioned: tuple[str, ...] = ()
    conditioned_operators: tuple[Operator, Operator] | None = None
    gated_backward: Operator | None = None
    wide_backward: Operator | None = None

    @property
    def pairs(self) -> tuple[tuple[Operator, Operator], ...]:
        """Its (forward, backward) operators: the plain pair, then the
        conditioned pair where it has one."""
        return ((self.forward, self.backward),) + ((self.conditioned_operators,) if self.conditioned_operators else ())

    @property
    def groups(self) -> bool:
        """Whether it takes a group count (GroupNorm's num_groups)."""
        return "num_groups" in self.forward.arguments


_ROWS_BACKWARD = ("dy", "x")
_CONDITIONED = ("shift", "scale", "residual_gate")
_MODULATED_BACKWARD = ("dh",) + _CONDITIONED + ("gated_x", "axes")
_CONDITIONED_FORWARD = ("axes", "eps", "return_stats", "epilogue")
_CHANNELS = ("eps", "channel_axis", "return_stats", "epilogue")
_NORMALIZE = Operator("normalize", ("x", "norm", "axes", "eps"), single=True)
_NORMALIZE_BACKWARD = Operator("normalize_backward", ("dy", "x", "norm", "axes", "eps"), single=True)
_CHANNEL_BACKWARD = Operator("channel_norm_backward", ("dy", "x", "mean", "rstd", "norm", "num_groups", "weight",
                                                       "bias", "training", "eps", "channel_axis"))

OPS = {op.name: op for op in (
    Op("rms_norm", "rows", "rms", ("weight",), True, False, ("rstd",), ("weight_offset", "rounding", "activation"),
       DEFAULT_EPS, reference.rms_norm, reference.rms_norm_backward,
       Operator("rms_norm", ("x", "weight", "residual", "axes", "eps", "return_stats", "epilogue")),
       Operator("rms_norm_backward", _ROWS_BACKWARD + ("rstd", "weight", "dh", "axes")),
       conditioned=_CONDITIONED + ("gate",),
       conditioned_operators=(
           Operator("rms_norm_conditioned", ("x", "weight", "residual") + _CONDITIONED + ("gate",)
                    + _CONDITIONED_FORWARD),
           Operator("rms_norm_modulated_backward", _ROWS_BACKWARD + ("rstd", "weight") + _MODULATED_BACKWARD)),
       gated_backward=Operator("rms_norm_gated_backward",
                               _ROWS_BACKWARD + ("rstd", "weight", "gate", "norm_before_gate", "axes")),
       wide_backward=Operator("rms_norm_float32_residual_backward",
                              _ROWS_BACKWARD + ("rstd", "weight", "dh", "axes"))),
    Op("layer_norm", "rows", "ln", ("weight", "bias"), True, False, ("mean", "rstd"), ("activation",),
       DEFAULT_EPS, reference.layer_norm, reference.layer_norm_backward,
       Operator("layer_norm", ("x", "weight", "bias", "residual", "axes", "eps", "return_stats", "epilogue")),
       Operator("layer_norm_backward", _ROWS_BACKWARD + ("mean", "rstd", "weight", "bias", "dh", "axes")),
       conditioned=_CONDITIONED,
       conditioned_operators=(
           Operator("layer_norm_conditioned", ("x", "weight", "bias", "residual") + _CONDITIONED
                    + _CONDITIONED_FORWARD),
           Operator("layer_norm_modulated_backward", _ROWS_BACKWARD + ("mean", "rstd", "weight", "bias")
                    + _MODULATED_BACKWARD)),
       wide_backward=Operator("layer_norm_float32_residual_backward",
                              _ROWS_BACKWARD + ("mean", "rstd", "weight", "bias", "dh", "axes"))),
    Op("normalize", "rows", None, (), False, False, (), (), LP_EPS, reference.normalize,
       reference.normalize_backward, _NORMALIZE, _NORMALIZE_BACKWARD),
    Op("mean_abs_normalize", "rows", "mean_abs", (), False, False, (), (), LP_EPS, reference.mean_abs_normalize,
       reference.normalize_backward, _NORMALIZE, _NORMALIZE_BACKWARD),
    Op("frobenius_normalize", "rows", "l2", (), False, False, (), (), LP_EPS, reference.frobenius_normalize,
       reference.normalize_backward, _NORMALIZE, _NORMALIZE_BACKWARD),
    Op("group_norm", "channels", "group", ("weight", "bias"), False, False, ("mean", "rstd"), ("activation",),
       DEFAULT_EPS, reference.group_norm, reference.group_norm_backward,
       Operator("group_norm", ("x", "num_groups", "weight", "bias") + _CHANNELS), _CHANNEL_BACKWARD),
    Op("instance_norm", "channels", "instance", ("weight", "bias"), False, False, ("mean", "rstd"), ("activation",),
       DEFAULT_EPS, reference.instance_norm, reference.instance_norm_backward,
       Operator("instance_norm", ("x", "weight", "bias") + _CHANNELS), _CHANNEL_BACKWARD),
    Op("batch_norm", "channels", "batch", ("weight", "bias"), False, True, ("mean", "rstd"), ("activation",),
       DEFAULT_EPS, reference.batch_norm, reference.batch_norm_backward,
       Operator("batch_norm", ("x", "weight", "bias", "running_mean", "running_var", "training", "momentum")
                + _CHANNELS), _CHANNEL_BACKWARD, per_sample=False),
)}

#: the op of each norm policy that has one op of its own (the Lp family's
#: policies other than mean_abs are all normalize's)
BY_NORM = {op.norm: op for op in OPS.values() if op.norm is not None and op.name != "frobenius_normalize"}


def statistics_of(norm: str) -> tuple[str, ...]:
    """The statistics a norm policy's forward returns with return_stats."""
    op = BY_NORM.get(norm)
    return () if op is None else op.statistics


def params_of(norm: str) -> tuple[str, ...]:
    """The affine parameters a norm policy's op takes (its backward returns
    their gradients after dx)."""
    op = BY_NORM.get(norm)
    return () if op is None else op.params


def operators() -> dict[str, Operator]:
    """Every operator of the table, forward and backward, by name (each once)."""
    found = {}
    for op in OPS.values():
        extra = [o for o in (op.gated_backward, op.wide_backward) if o is not None]
        for operator in [o for pair in op.pairs for o in pair] + extra:
            found.setdefault(operator.name, operator)
    return found
