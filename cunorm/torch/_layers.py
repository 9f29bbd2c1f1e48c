"""cunorm's drop-in torch.nn norm layers, and the forwards they share with
the timm and transformers layers that replace_norms swaps in
(cunorm/torch/_zoo.py).

The layers subclass their torch.nn counterparts and replace only
``forward``: constructor arguments, parameters, buffers, ``state_dict`` keys
and ``repr`` are torch's own. Each replaced class names the class it
replaces (``_cunorm_original``), whose forward runs instead of cunorm's
where that is faster (``runs_original``): under dynamo's tracing
(torch.compile), and under eager autograd for small inputs when the
original is one fused torch op. Otherwise, under eager autograd, the
RMSNorm, LayerNorm, GroupNorm and BatchNorm forwards enter their
autograd.Function (cunorm/torch/_autograd.py) directly, and in inference
they call the engine (cunorm/_engine/calls.py), which takes the launch
cache, each call noting its launcher in the module's trace for the memo. A forward with
an ``activation`` runs it in the kernel's epilogue in inference, and as
torch's op after the norm where autograd records (cunorm.torch.rms_norm
says why).
"""
from __future__ import annotations

import math

import torch
from torch import Tensor

from .._engine import calls, plans
from .._interop import torch as _adapter
from . import _functions
from ._autograd import channel_norm_apply, eager_autograd, needs_grad, row_norm_apply

is_compiling = torch.compiler.is_compiling
_grad_enabled = torch.is_grad_enabled

#: Under eager autograd a replaced layer whose original is one fused torch
#: op (``_cunorm_fused_original``) runs that op for inputs of fewer
#: elements: there a training step is host-bound, and cunorm's
#: autograd.Function and launches cost ~100-300 us more host time a step
#: than torch's op (its GPU time is smaller, but the GPU waits). Single
#: call of a step, H100 (docs/notes/models.md, "The crossover"):
#: cunorm lost below 2**24 elements in every case measured, and won from
#: ~2**25 on most (BatchNorm2d bf16 (32,64,112,112) 635 against 1383 us).
EAGER_AUTOGRAD_MIN_ELEMENTS = 1 << 24


def runs_original(module, x: Tensor) -> bool:
    """Whether the replaced layer ``module`` runs the forward of the class
    it replaces: under dynamo's tracing always (inductor generates the norm
    and fuses it with its neighbours, where cunorm's operator would be an
    opaque call of ~110 us of dispatch; docs/notes/models.md),
    and under eager autograd below EAGER_AUTOGRAD_MIN_ELEMENTS when the
    original is one fused torch op (a norm written as several torch ops,
    as transformers' RMSNorms are, is slower than cunorm's at every size)."""
    if is_compiling():
        return True
    if not module._cunorm_fused_original or not _grad_enabled() or x.numel() >= EAGER_AUTOGRAD_MIN_ELEMENTS:
        return False
    if x.requires_grad:
        return True
    # (the module's own parameters, read from its dict: inference pays no attribute lookup)
    return any(p is not None and p.requires_grad for p in module._parameters.values())


def original_forward(module, x: Tensor) -> Tensor:
    return module._cunorm_original.forward(module, x)


# --- the layers' memo -----------------------------------------------------------------------------------------------

#: The input signatures a replaced layer keeps a launcher for (a model calls
#: each layer with one or a few shapes; past that the memo starts over).
MEMO_SIGNATURES = 8

_autocast_on = torch.is_autocast_enabled
#: the key of a module's trace while its memoized forward runs: the list the
#: engine notes each launcher the forward's calls ran or stored in
#: (cunorm/_engine/calls.py, ``trace``)
TRACE = "_cunorm_trace"


def _memo_key(x: Tensor, tag: int):
    # what the launcher depends on that comes from x, autocast (which
    # decides the output dtype of LayerNorm and GroupNorm), and which of the
    # module's memoized functions (``tag``) ran it
    return x.dtype, x.shape, x.stride(), x.get_device(), x.data_ptr() & 15, _autocast_on("cuda"), tag


def memo_run(module, x: Tensor, tag: int = 0):
    """The result of the launcher this layer's memoized function ``tag``
    kept for x's signature, or None where it kept none or the call must take
    the forward: autograd records it through the module's tensors, or one of
    them was replaced, moved or cast since (each is checked by pointer and
    dtype). Outside dynamo's tracing, for an x autograd does not record
    (memoized checks both first)."""
    memo = module.__dict__.get("_cunorm_memo")
    if not memo:
        return None
    try:  # (_memo_key's, inline: this is every call in inference)
        entry = memo.get((x.dtype, x.shape, x.stride(), x.get_device(), x.data_ptr() & 15, _autocast_on("cuda"), tag))
    except (AttributeError, RuntimeError):  # not a strided tensor
        return None
    if entry is None:
        return None
    launch, sources = entry
    grad = _grad_enabled()
    args = []
    for store, name, pointer, dtype in sources:
        if store is None:
            args.append(None)
            continue
        t = module.__dict__[store].get(name)
        if t is None or t.data_ptr() != pointer or t.dtype is not dtype or (grad and t.requires_grad):
            return None
        args.append(t)
    return launch(x, *args)


def _memo_fill(module, x: Tensor, found, y, tag: int = 0) -> None:
    """Keep the launcher that computed ``y = forward(x)`` in the module's
    memo, when it ran over x itself and the module's own parameters and
    buffers and returned y as the forward did (a forward that copied or
    cast x, or changed the result, keeps nothing)."""
    launch, inputs, results = found
    if results is not y or inputs[0] is not x:
        return
    sources = []
    for t in inputs[1:]:
        if t is None:
            sources.append((None, None, 0, None))
            continue
        for store in ("_parameters", "_buffers"):
            name = next((k for k, v in module.__dict__[store].items() if v is t), None)
            if name is not None:
                sources.append((store, name, t.data_ptr(), t.dtype))
                break
        else:
            return  # (a tensor of the forward's own: a cast copy)
    memo = module.__dict__.get("_cunorm_memo")
    if memo is None or len(memo) >= MEMO_SIGNATURES:
        memo = module.__dict__["_cunorm_memo"] = {}
    memo[_memo_key(x, tag)] = (launch, tuple(sources))


def memoized(forward, pure=None, tag: int = 0):
    """A replaced layer's ``forward`` through its memo: a call whose input
    signature the layer has seen runs the launcher that call ran, without
    the forward's routing, checks and the launch cache's signature of the
    parameters (the layers' host time inside a model;
    docs/notes/models.md, "The layers' memo"). ``pure(module)``: whether the
    forward does nothing beyond the launch in the module's present mode
    (BatchNorm in training updates its counter: not pure); None for
    always. ``tag``: which of a module's memoized functions this is (a
    forward memoizing views of x inside keeps them apart: 0 for the
    class's forward). The memo is cleared when an attribute of the module
    is set (``memo_setattr``)."""

    def memo_forward(self, x: Tensor) -> Tensor:
        if is_compiling():
            return forward(self, x)  # (traced: never memoized)
        if _grad_enabled() and getattr(x, "requires_grad", False):  # recorded by autograd: never memoized
            if tag == 0 and self._cunorm_fused_original and x.numel() < EAGER_AUTOGRAD_MIN_ELEMENTS:
                # runs_original's answer without the forward's frames (x is the layer's input)
                return self._cunorm_original.forward(self, x)
            return forward(self, x)
        y = memo_run(self, x, tag)
        if y is not None:
            return y
        if pure is not None and not pure(self):
            return forward(self, x)
        state = self.__dict__
        outer, trace = state.get(TRACE), []
        state[TRACE] = trace
        try:
            y = forward(self, x)
        finally:
            if outer is None:
                state.pop(TRACE, None)
            else:
                state[TRACE] = outer
        if trace:
            _memo_fill(self, x, trace[-1], y, tag)
        return y

    memo_forward.__name__, memo_forward.__qualname__ = forward.__name__, forward.__qualname__
    memo_forward.__doc__, memo_forward.__wrapped__ = forward.__doc__, forward
    return memo_forward


def memo_setattr(self, name: str, value) -> None:
    """A replaced layer's ``__setattr__``: the original's, and the memo
    cleared (an eps, a mode or an activation may have changed)."""
    self.__dict__.pop("_cunorm_memo", None)
    self._cunorm_original.__setattr__(self, name, value)


def memo_getstate(self) -> dict:
    """A replaced layer's state for pickle and deepcopy: its own, less the
    memo (launchers are bound to this process and these tensors)."""
    state = self.__dict__.copy()
    state.pop("_cunorm_memo", None)
    return state


def not_updating_running(module) -> bool:
    """Whether a BatchNorm or InstanceNorm forward is its launch alone: not
    so in training with running buffers (they and the counter are updated),
    which the memo does not take."""
    return not (module.training and module.track_running_stats)


def with_memo(cls: type, forward, pure=None, memoize: bool = True) -> None:
    """Give a replacement class its forward, memoized unless ``memoize`` is
    False (a forward that memoizes a view of x inside), and the memo's
    __setattr__ and __getstate__."""
    cls.forward = memoized(forward, pure) if memoize else forward
    cls.__setattr__ = memo_setattr
    cls.__getstate__ = memo_getstate


def trailing_axes(normalized_shape):
    """The axes a layer's normalized_shape names: -1 for one (an int keys the
    launch cache without a walk over a tuple), else the trailing ones."""
    n = len(normalized_shape)
    return -1 if n == 1 else tuple(range(-n, 0))


def default_rms_eps(dtype) -> float:
    # torch's rms_norm takes the epsilon of its compute type (float32 for the
    # 16-bit dtypes), which is cunorm's accumulation dtype too.
    return torch.finfo(_adapter.ACCUMULATION[dtype]).eps


def rms_forward(module, x: Tensor, axis, eps, *, activation=None, weight_offset=0, rounding="output") -> Tensor:
    """rms_norm of x by ``module.weight`` (None when the layer has none)."""
    if runs_original(module, x):
        return original_forward(module, x)
    return rms_cunorm(module, x, axis, eps, activation=activation, weight_offset=weight_offset, rounding=rounding)


def rms_cunorm(module, x: Tensor, axis, eps, *, activation=None, weight_offset=0, rounding="output") -> Tensor:
    """rms_forward's computation by cunorm (runs_original answered)."""
    weight = module.weight  # (a parameter: each read goes through Module.__getattr__)
    if copies_rows(x, axis):
        x = x.contiguous()
    if activation is None and not weight_offset and eager_autograd(x, weight):
        return row_norm_apply(x, weight, None, None, "rms", axis, eps, rounding)[0]
    epilogue = plans.rms_epilogue(weight_offset, rounding, activation, weight is not None)
    return calls.rows("rms", x, weight, None, None, axis, eps, False, None, None, epilogue=epilogue,
                      route=lambda: _functions.rms_norm(x, weight, axis=axis, eps=eps, weight_offset=weight_offset,
                                                        rounding=rounding, activation=activation),
                      trace=module.__dict__.get(TRACE))


_LOW_PRECISION = (torch.float16, torch.bfloat16)


def autocast_float32(x: Tensor, memory_format=torch.preserve_format) -> Tensor:
    """x as torch's CUDA autocast hands it to layer_norm and group_norm, ops
    it runs in float32: a 16-bit x becomes float32 (and so does the result,
    as the replaced layer's) while autocast is on; in ``memory_format``
    when it is converted."""
    if x.dtype in _LOW_PRECISION and _autocast_on("cuda"):
        return x.to(torch.float32, memory_format=memory_format)
    return x


def float32_in_one_pass(x: Tensor, *params) -> bool:
    """Whether the kernel reads a 16-bit x as it is and writes the float32
    that autocast's layer_norm and group_norm return: under autocast, in
    inference. Where autograd records, x is cast first (the backward
    kernels take x and dy of one dtype)."""
    return x.dtype in _LOW_PRECISION and _autocast_on("cuda") and not needs_grad(x, *params)


def copies_rows(x: Tensor, axis) -> bool:
    """Whether a row norm over x's last axis takes a contiguous copy of x
    first: its last axis is not unit-stride (a permuted view, as timm's
    ConvNeXt blocks normalize). torch's layer_norm copies it too; cunorm's
    kernels would, on the general path every call (outside the launch
    cache; docs/notes/models.md)."""
    return axis == -1 and x.dim() > 0 and x.stride(-1) != 1 and x.shape[-1] != 1


def layer_forward(module, x: Tensor, axis, *, activation=None) -> Tensor:
    """layer_norm of x with the module's weight, bias and eps (in float32
    under autocast, as torch's F.layer_norm)."""
    if runs_original(module, x):
        return original_forward(module, x)
    return layer_cunorm(module, x, axis, activation=activation)


def layer_cunorm(module, x: Tensor, axis, *, activation=None) -> Tensor:
    """layer_forward's computation by cunorm (runs_original answered)."""
    weight, bias = module.weight, module.bias
    copies = copies_rows(x, axis)
    if float32_in_one_pass(x, weight, bias):
        return calls.layer_norm_float32(x.contiguous() if copies else x, weight, bias, axis=axis, eps=module.eps,
                                        activation=activation, trace=module.__dict__.get(TRACE))
    if copies:  # (the copy and autocast's cast one pass)
        x = autocast_float32(x, torch.contiguous_format).contiguous()
    else:
        x = autocast_float32(x)
    if activation is None and eager_autograd(x, weight, bias):
        return row_norm_apply(x, weight, bias, None, "ln", axis, module.eps, "output")[0]
    eps = module.eps
    return calls.rows("ln", x, weight, bias, None, axis, eps, False, None, None,
                      epilogue=plans.activation_flags(activation),
                      route=lambda: _functions.layer_norm(x, weight, bias, axis=axis, eps=eps, activation=activation),
                      trace=module.__dict__.get(TRACE))


def group_forward(module, x: Tensor, *, activation=None) -> Tensor:
    """group_norm of x (N, C, *) with a torch.nn.GroupNorm's attributes (in
    float32 under autocast, as torch's F.group_norm)."""
    if runs_original(module, x):
        return original_forward(module, x)
    weight, bias = module.weight, module.bias
    if float32_in_one_pass(x, weight, bias):
        return calls.group_norm_float32(x, module.num_groups, weight, bias, eps=module.eps, activation=activation,
                                        trace=module.__dict__.get(TRACE))
    x = autocast_float32(x)
    if activation is None and eager_autograd(x, weight, bias):
        return channel_norm_apply(x, weight, bias, None, None, "group", module.num_groups, True, 0.1, module.eps,
                                  1)[0]
    return _group(module, x, weight, bias, module.num_groups, module.eps, activation)


def _group(module, x, weight, bias, num_groups, eps, activation):
    """group_norm of x through the engine, routed to cunorm.torch's function
    where autograd or dynamo must see it, the launcher noted in the module's
    trace."""
    return calls.channels("group", x, num_groups, weight, bias, None, None, True, 0.1, eps, 1, False, None,
                          epilogue=plans.activation_flags(activation),
                          route=lambda: _functions.group_norm(x, num_groups, weight, bias, eps=eps,
                                                              activation=activation),
                          trace=module.__dict__.get(TRACE))


def _batch(module, x, weight, bias, running_mean, running_var, training, momentum, eps, activation):
    """batch_norm of x (channels first) through the engine, as _group."""
    return calls.channels("batch", x, None, weight, bias, running_mean, running_var, training, momentum, eps, 1,
                          False, None, epilogue=plans.activation_flags(activation),
                          route=lambda: _functions.batch_norm(x, weight, bias, running_mean=running_mean,
                                                              running_var=running_var, training=training,
                                                              momentum=momentum, eps=eps, activation=activation),
                          trace=module.__dict__.get(TRACE))


def _instance(module, x, return_stats: bool):
    """instance_norm of x with the module's parameters and eps, as _group."""
    weight, bias, eps = module.weight, module.bias, module.eps
    return calls.channels("instance", x, None, weight, bias, None, None, True, 0.1, eps, 1, return_stats, None,
                          route=lambda: _functions.instance_norm(x, weight, bias, eps=eps, return_stats=return_stats),
                          trace=module.__dict__.get(TRACE))


def statistics_dtype_running(module, x: Tensor, running_mean: Tensor, running_var: Tensor):
    """Eval mode's running buffers in the statistics' dtype (float32 for
    16-bit x): a model cast to bfloat16 has bfloat16 buffers, which
    batch_norm would copy to float32 on every call, outside the launch cache
    (303 us of host time a call against 37 us). The copies are kept on the
    module and made again when a buffer is replaced or written (its pointer
    or version changes)."""
    acc = _adapter.ACCUMULATION.get(x.dtype)
    if acc is None or running_mean.dtype not in _adapter.ACCUMULATION or running_var.dtype not in _adapter.ACCUMULATION:
        return running_mean, running_var  # (batch_norm's checks say what is wrong)
    if running_mean.dtype == acc and running_var.dtype == acc:
        return running_mean, running_var
    key = (acc, running_mean.data_ptr(), running_mean._version, running_var.data_ptr(), running_var._version)
    kept = module.__dict__.get("_cunorm_running")
    if kept is None or kept[0] != key:
        kept = (key, running_mean.to(acc), running_var.to(acc))
        module.__dict__["_cunorm_running"] = kept
    return kept[1], kept[2]


def batch_forward(module, x: Tensor, *, activation=None) -> Tensor:
    """torch's _BatchNorm.forward (momentum=None's cumulative average and
    num_batches_tracked included), with the normalization cunorm's."""
    if runs_original(module, x):
        return original_forward(module, x)
    weight, bias = module.weight, module.bias
    module._check_input_dim(x)
    factor = 0.0 if module.momentum is None else module.momentum
    if module.training and module.track_running_stats and module.num_batches_tracked is not None:
        module.num_batches_tracked.add_(1)
        factor = 1.0 / float(module.num_batches_tracked) if module.momentum is None else module.momentum
    training = module.training or (module.running_mean is None and module.running_var is None)
    keep = not module.training or module.track_running_stats
    running_mean, running_var = (module.running_mean, module.running_var) if keep else (None, None)
    if not training:
        running_mean, running_var = statistics_dtype_running(module, x, running_mean, running_var)
    if activation is None and eager_autograd(x, weight, bias):
        return channel_norm_apply(x, weight, bias, running_mean, running_var, "batch", None, training, factor,
                                  module.eps, 1)[0]
    return _batch(module, x, weight, bias, running_mean, running_var, training, factor, module.eps, activation)



def instance_forward(module, x: Tensor) -> Tensor:
    """torch's _InstanceNorm.forward with the normalization cunorm's. With
    ``track_running_stats=True`` in training, the running buffers are
    updated as torch updates them, from cunorm's float32 statistics (the
    variance recovered from rstd: relative error ~1e-7 of var + eps)."""
    if runs_original(module, x):
        return original_forward(module, x)
    module._check_input_dim(x)
    if x.dim() == module._get_no_batch_dim():  # unbatched (C, *spatial), as torch allows
        return instance_forward(module, x.unsqueeze(0)).squeeze(0)
    use_input_stats = module.training or not module.track_running_stats
    if not use_input_stats:
        running_mean, running_var = statistics_dtype_running(module, x, module.running_mean, module.running_var)
        return _batch(module, x, module.weight, module.bias, running_mean, running_var, False, 0.1, module.eps, None)
    if not (module.track_running_stats and module.running_mean is not None):
        return _instance(module, x, False)
    y, mean, rstd = _instance(module, x, True)
    momentum = module.momentum if module.momentum is not None else 0.0
    n = math.prod(x.shape[2:])
    with torch.no_grad():
        var = (rstd.double().pow(-2) - module.eps).clamp_min(0) * (n / max(n - 1, 1))
        module.running_mean.mul_(1 - momentum).add_(mean.mean(0).to(module.running_mean.dtype), alpha=momentum)
        module.running_var.mul_(1 - momentum).add_(var.mean(0).to(module.running_var.dtype), alpha=momentum)
    return y


class RMSNorm(torch.nn.RMSNorm):
    """``torch.nn.RMSNorm`` computed by cunorm (same arguments, parameters and
    state_dict). ``eps=None`` means torch's default, the machine epsilon of
    float32 (float64 for float64 input)."""

    def forward(self, x: Tensor) -> Tensor:
        eps = self.eps if self.eps is not None else default_rms_eps(x.dtype)
        return rms_forward(self, x, trailing_axes(self.normalized_shape), eps)


class LayerNorm(torch.nn.LayerNorm):
    """``torch.nn.LayerNorm`` computed by cunorm (same arguments, parameters and state_dict)."""

    def forward(self, x: Tensor) -> Tensor:
        return layer_forward(self, x, trailing_axes(self.normalized_shape))


class GroupNorm(torch.nn.GroupNorm):
    """``torch.nn.GroupNorm`` computed by cunorm (same arguments, parameters and state_dict); x (N, C, *),
    channels_last tensors run as they are."""

    def forward(self, x: Tensor) -> Tensor:
        return group_forward(self, x)


class InstanceNorm1d(torch.nn.InstanceNorm1d):
    """``torch.nn.InstanceNorm1d`` computed by cunorm (as InstanceNorm2d)."""

    def forward(self, x: Tensor) -> Tensor:
        return instance_forward(self, x)


class InstanceNorm2d(torch.nn.InstanceNorm2d):
    """``torch.nn.InstanceNorm2d`` computed by cunorm (same arguments, parameters, buffers and state_dict),
    running statistics included (see instance_forward)."""

    def forward(self, x: Tensor) -> Tensor:
        return instance_forward(self, x)


class InstanceNorm3d(torch.nn.InstanceNorm3d):
    """``torch.nn.InstanceNorm3d`` computed by cunorm (as InstanceNorm2d)."""

    def forward(self, x: Tensor) -> Tensor:
        return instance_forward(self, x)


class BatchNorm1d(torch.nn.BatchNorm1d):
    """``torch.nn.BatchNorm1d`` computed by cunorm, x (N, C) or (N, C, L) (as BatchNorm2d)."""

    def forward(self, x: Tensor) -> Tensor:
        return batch_forward(self, x)


class BatchNorm2d(torch.nn.BatchNorm2d):
    """``torch.nn.BatchNorm2d`` computed by cunorm (same arguments, parameters, buffers and state_dict),
    including ``momentum=None`` (the cumulative average) and ``num_batches_tracked``."""

    def forward(self, x: Tensor) -> Tensor:
        return batch_forward(self, x)


class BatchNorm3d(torch.nn.BatchNorm3d):
    """``torch.nn.BatchNorm3d`` computed by cunorm (as BatchNorm2d)."""

    def forward(self, x: Tensor) -> Tensor:
        return batch_forward(self, x)


#: torch.nn's norm layers and cunorm's subclass computing each
TORCH_LAYERS = {torch.nn.RMSNorm: RMSNorm, torch.nn.LayerNorm: LayerNorm, torch.nn.GroupNorm: GroupNorm,
                torch.nn.InstanceNorm1d: InstanceNorm1d, torch.nn.InstanceNorm2d: InstanceNorm2d,
                torch.nn.InstanceNorm3d: InstanceNorm3d, torch.nn.BatchNorm1d: BatchNorm1d,
                torch.nn.BatchNorm2d: BatchNorm2d, torch.nn.BatchNorm3d: BatchNorm3d}
for _original, _layer in TORCH_LAYERS.items():
    _layer.__module__ = "cunorm.torch"  # where they are public (and found by pickle)
    _layer._cunorm_original = _original  # whose forward runs_original runs
    _layer._cunorm_fused_original = True  # torch's forward: one fused op
    with_memo(_layer, _layer.forward, None if _layer in (RMSNorm, LayerNorm, GroupNorm) else not_updating_running)
del _original, _layer
