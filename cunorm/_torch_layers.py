"""cunorm's drop-in torch.nn norm layers, and the forwards they share with
the timm and transformers layers that replace_norms swaps in
(cunorm/_torch_zoo.py).

The layers subclass their torch.nn counterparts and replace only
``forward``: constructor arguments, parameters, buffers, ``state_dict`` keys
and ``repr`` are torch's own. Each replaced class names the class it
replaces (``_cunorm_original``), whose forward runs instead of cunorm's
where that is faster (``runs_original``): under dynamo's tracing
(torch.compile), and under eager autograd for small inputs when the
original is one fused torch op. Otherwise, under eager autograd, the
RMSNorm, LayerNorm, GroupNorm and BatchNorm forwards enter their
autograd.Function (cunorm/_torch_autograd.py) directly, and in inference
they call the array-level ops, which take the launch cache. A forward with
an ``activation`` runs it in the kernel's epilogue in inference, and as
torch's op after the norm where autograd records (cunorm.torch.rms_norm
says why).
"""
from __future__ import annotations

import math

import torch
from torch import Tensor

from . import norms
from ._interop import torch as _adapter
from ._torch_autograd import channel_norm_apply, eager_autograd, needs_grad, row_norm_apply

is_compiling = torch.compiler.is_compiling
_grad_enabled = torch.is_grad_enabled

#: Under eager autograd a replaced layer whose original is one fused torch
#: op (``_cunorm_fused_original``) runs that op for inputs of fewer
#: elements: there a training step is host-bound, and cunorm's
#: autograd.Function and launches cost ~100-300 us more host time a step
#: than torch's op (its GPU time is smaller, but the GPU waits). Single
#: call of a step, H100, 2026-11-24 (docs/performance.md, "Routing"):
#: cunorm lost below 2**24 elements in every case measured, and won from
#: ~2**25 on most (BatchNorm2d bf16 (32,64,112,112) 635 against 1383 us).
EAGER_AUTOGRAD_MIN_ELEMENTS = 1 << 24


def runs_original(module, x: Tensor) -> bool:
    """Whether the replaced layer ``module`` runs the forward of the class
    it replaces: under dynamo's tracing always (inductor generates the norm
    and fuses it with its neighbours, where cunorm's operator would be an
    opaque call of ~110 us of dispatch; docs/performance.md, "Routing"),
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
    return norms.rms_norm(x, weight, axis=axis, eps=eps, weight_offset=weight_offset, rounding=rounding,
                          activation=activation)


_LOW_PRECISION = (torch.float16, torch.bfloat16)
_autocast_on = torch.is_autocast_enabled


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
    cache; docs/performance.md, "Routing")."""
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
        return norms._layer_norm_float32(x.contiguous() if copies else x, weight, bias, axis=axis, eps=module.eps,
                                         activation=activation)
    if copies:  # (the copy and autocast's cast one pass)
        x = autocast_float32(x, torch.contiguous_format).contiguous()
    else:
        x = autocast_float32(x)
    if activation is None and eager_autograd(x, weight, bias):
        return row_norm_apply(x, weight, bias, None, "ln", axis, module.eps, "output")[0]
    return norms.layer_norm(x, weight, bias, axis=axis, eps=module.eps, activation=activation)


def group_forward(module, x: Tensor, *, activation=None) -> Tensor:
    """group_norm of x (N, C, *) with a torch.nn.GroupNorm's attributes (in
    float32 under autocast, as torch's F.group_norm)."""
    if runs_original(module, x):
        return original_forward(module, x)
    weight, bias = module.weight, module.bias
    if float32_in_one_pass(x, weight, bias):
        return norms._group_norm_float32(x, module.num_groups, weight, bias, eps=module.eps, activation=activation)
    x = autocast_float32(x)
    if activation is None and eager_autograd(x, weight, bias):
        return channel_norm_apply(x, weight, bias, None, None, "group", module.num_groups, True, 0.1, module.eps,
                                  1)[0]
    return norms.group_norm(x, module.num_groups, weight, bias, eps=module.eps, activation=activation)


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
    return norms.batch_norm(x, weight, bias, running_mean=running_mean, running_var=running_var, training=training,
                            momentum=factor, eps=module.eps, activation=activation)


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
        return norms.batch_norm(x, module.weight, module.bias, running_mean=running_mean,
                                running_var=running_var, training=False, eps=module.eps)
    if not (module.track_running_stats and module.running_mean is not None):
        return norms.instance_norm(x, module.weight, module.bias, eps=module.eps)
    y, mean, rstd = norms.instance_norm(x, module.weight, module.bias, eps=module.eps, return_stats=True)
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
del _original, _layer
