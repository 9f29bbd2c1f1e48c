"""replace_norms and its registry: which norm layers of torch.nn, timm and
Hugging Face transformers cunorm computes, and with which options.

A layer is replaced only where cunorm computes its formula (the same
statistics, the same rounding points, the same activation), by changing
the module's class to a subclass of its own class whose ``forward`` is
cunorm's: parameters, buffers, hooks, ``state_dict`` and training mode stay
the module's. Classes are recognized by their module and name, so neither
library is imported here: a model holding their layers has imported them.
Anything else whose class name says it is a norm is left alone, with the
reason in the report.
"""
from __future__ import annotations

import re
import threading
from dataclasses import dataclass, field
from typing import Callable, Optional

import torch
from torch import Tensor

from . import _functions
from ._layers import (TORCH_LAYERS, batch_forward, group_forward, layer_cunorm, layer_forward, memoized,
                      not_updating_running, original_forward, rms_cunorm, rms_forward, runs_original, trailing_axes,
                      with_memo)

# --- the activations a norm layer may end with ----------------------------------------------------------------------


def activation_of(module) -> tuple[Optional[str], Optional[str]]:
    """(activation name for the epilogue, None) for a known activation
    module (None for identity), else (None, the reason it is not fused)."""
    kind = type(module)
    if kind in (torch.nn.Identity,):
        return None, None
    if kind is torch.nn.ReLU:
        return "relu", None
    if kind is torch.nn.SiLU:
        return "silu", None
    if kind is torch.nn.GELU:
        return ("gelu" if module.approximate == "none" else "gelu_tanh"), None
    timm_kind = _TIMM_ACTIVATIONS.get((kind.__module__, kind.__qualname__))
    if timm_kind is not None:
        return timm_kind, None
    return None, f"its activation {kind.__qualname__} is not one the epilogue computes (relu, silu, gelu, gelu_tanh)"


_TIMM_ACTIVATIONS = {("timm.layers.activations", "GELU"): "gelu", ("timm.layers.activations", "GELUTanh"): "gelu_tanh",
                     ("timm.layers.activations", "Swish"): "silu"}


def _act_and_drop(module) -> tuple[Optional[str], Optional[str]]:
    """timm's norm-act layers: (activation, None), or (None, reason) where
    the layer's drop or activation is not one cunorm fuses."""
    drop = getattr(module, "drop", None)
    if drop is not None and type(drop) is not torch.nn.Identity:
        return None, f"its drop layer {type(drop).__qualname__} runs between the norm and the activation"
    return activation_of(getattr(module, "act", torch.nn.Identity()))


# --- the forwards ---------------------------------------------------------------------------------------------------
# Each is the replacement class's forward; ``original`` is the class it
# replaces, whose forward runs where cunorm's formula would differ at run
# time (a dtype combination whose result dtype is not x's).


def _timm_layer_norm(self, x: Tensor) -> Tensor:
    return layer_forward(self, x, trailing_axes(self.normalized_shape), activation=self._cunorm_activation)


def _nhwc_layer_norm(self, nhwc: Tensor) -> Tensor:
    return layer_cunorm(self, nhwc, -1, activation=self._cunorm_activation)


# (the memo keyed by the view; tags keep the functions memoizing views apart)
_nhwc_layer_norm_memoized = memoized(_nhwc_layer_norm, tag=1)


def _timm_layer_norm_2d(self, x: Tensor) -> Tensor:
    """A LayerNorm over the channels of NCHW, through timm's NHWC view as
    timm computes it: the result is channels-last in memory, as the
    original's, which the convolutions after it read fastest (the strided
    kernel over axis 1 gave NCHW, and ConvNeXt's depthwise convolutions
    then ran a slow kernel; docs/notes/models.md)."""
    if runs_original(self, x):
        return original_forward(self, x)
    return _nhwc_layer_norm_memoized(self, x.permute(0, 2, 3, 1)).permute(0, 3, 1, 2)


def _timm_rms_norm(self, x: Tensor) -> Tensor:
    return rms_forward(self, x, trailing_axes(self.normalized_shape), self.eps, activation=self._cunorm_activation)


def _nhwc_rms_norm(self, nhwc: Tensor) -> Tensor:
    return rms_cunorm(self, nhwc, -1, self.eps, activation=self._cunorm_activation)


def _nchw_rms_norm(self, x: Tensor) -> Tensor:
    return rms_cunorm(self, x, 1, self.eps, activation=self._cunorm_activation)


_nhwc_rms_norm_memoized = memoized(_nhwc_rms_norm, tag=2)
_nchw_rms_norm_memoized = memoized(_nchw_rms_norm, tag=3)


def _timm_rms_norm_2d(self, x: Tensor) -> Tensor:
    """An RMSNorm over the channels of NCHW; a channels-last x through its
    NHWC view, where the channels are rows (the result keeps x's layout,
    as the original's elementwise formula does)."""
    if runs_original(self, x):
        return original_forward(self, x)
    if x.dim() == 4 and x.stride(1) == 1 and x.shape[1] > 1:
        nhwc = x.permute(0, 2, 3, 1)
        if nhwc.is_contiguous():
            return _nhwc_rms_norm_memoized(self, nhwc).permute(0, 3, 1, 2)
    return _nchw_rms_norm_memoized(self, x)


def _timm_group_norm(self, x: Tensor) -> Tensor:
    return group_forward(self, x, activation=self._cunorm_activation)


def _timm_batch_norm(self, x: Tensor) -> Tensor:
    return batch_forward(self, x, activation=self._cunorm_activation)


def _hf_llama_rms(self, x: Tensor) -> Tensor:
    """x normalized in float32, rounded to x's dtype, times the weight in the
    promoted dtype: rounding="normalized" where that dtype is x's."""
    if torch.promote_types(self.weight.dtype, x.dtype) != x.dtype:
        return original_forward(self, x)
    return rms_forward(self, x, -1, self.variance_epsilon, rounding="normalized")


def _hf_t5_rms(self, x: Tensor) -> Tensor:
    """T5: as Llama when the weight has x's dtype (it rounds to the weight's
    16-bit dtype otherwise)."""
    if self.weight.dtype != x.dtype:
        return original_forward(self, x)
    return rms_forward(self, x, -1, self.variance_epsilon, rounding="normalized")


def _hf_olmo2_rms(self, x: Tensor) -> Tensor:  # (weight * normalized) in float32, rounded once
    return rms_forward(self, x, -1, self.variance_epsilon)


def _hf_gemma_rms(self, x: Tensor) -> Tensor:  # times (1 + weight) in float32, rounded once
    return rms_forward(self, x, -1, self.eps, weight_offset=1)


def _gated_as_cunorm(self, x: Tensor, gate) -> bool:
    """Whether cunorm computes a gated RMSNorm's call: a gate of x's shape
    and dtype, a result in x's dtype (the weight's promotion with x is
    x's dtype), outside dynamo's tracing (inductor fuses the original)."""
    return (gate is not None and not torch.compiler.is_compiling() and gate.dtype == x.dtype
            and gate.shape == x.shape and torch.promote_types(self.weight.dtype, x.dtype) == x.dtype)


def _hf_qwen3_next_gated(self, x: Tensor, gate=None) -> Tensor:
    """Qwen3-Next: x normalized in float32, rounded to x's dtype, times the
    weight (rounded again), times silu(gate) in float32, rounded once more."""
    if not _gated_as_cunorm(self, x, gate):
        return self._cunorm_original.forward(self, x, gate)
    return _functions.rms_norm(x, self.weight, eps=self.variance_epsilon, rounding="normalized", gate=gate)


def _hf_mamba2_gated(self, x: Tensor, gate=None) -> Tensor:
    """Mamba-2: x * silu(gate) in float32 normalized, rounded to x's dtype,
    times the weight."""
    if gate is None:
        return _hf_llama_rms(self, x)
    if not _gated_as_cunorm(self, x, gate):
        return self._cunorm_original.forward(self, x, gate)
    return _functions.rms_norm(x, self.weight, eps=self.variance_epsilon, rounding="normalized", gate=gate,
                               norm_before_gate=False)


# --- the registry ---------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Rule:
    """How cunorm computes one class of norm layer."""

    forward: Callable
    fuses_act: bool = False  # a timm norm-act layer: its act (and drop) must be fusable
    fast_norm: bool = False  # a timm layer with a _fast_norm switch (left alone when on)
    fused_original: bool = True  # the original's norm is one fused torch op (_torch_layers.runs_original)
    pure: Optional[Callable] = None  # when the forward is its launch alone (_torch_layers.memoized); None: always
    memo: bool = True  # the forward memoized on x (False: it runs the launch on a view of x, memoized inside)


_TIMM_NORM = "timm.layers.norm"
_TIMM_NORM_ACT = "timm.layers.norm_act"
RULES: dict[tuple[str, str], Rule] = {
    (_TIMM_NORM, "LayerNorm"): Rule(_timm_layer_norm, fast_norm=True),
    (_TIMM_NORM, "LayerNormFp32"): Rule(_timm_layer_norm),
    (_TIMM_NORM, "LayerNorm2d"): Rule(_timm_layer_norm_2d, fast_norm=True, memo=False),
    (_TIMM_NORM, "LayerNorm2dFp32"): Rule(_timm_layer_norm_2d, memo=False),
    (_TIMM_NORM, "RmsNorm"): Rule(_timm_rms_norm, fast_norm=True, fused_original=False),
    (_TIMM_NORM, "RmsNormFp32"): Rule(_timm_rms_norm, fused_original=False),
    (_TIMM_NORM, "RmsNorm2d"): Rule(_timm_rms_norm_2d, fast_norm=True, fused_original=False, memo=False),
    (_TIMM_NORM, "RmsNorm2dFp32"): Rule(_timm_rms_norm_2d, fused_original=False, memo=False),
    (_TIMM_NORM, "GroupNorm"): Rule(_timm_group_norm, fast_norm=True),
    (_TIMM_NORM, "GroupNorm1"): Rule(_timm_group_norm, fast_norm=True),
    (_TIMM_NORM_ACT, "BatchNormAct2d"): Rule(_timm_batch_norm, fuses_act=True, pure=not_updating_running),
    (_TIMM_NORM_ACT, "GroupNormAct"): Rule(_timm_group_norm, fuses_act=True, fast_norm=True),
    (_TIMM_NORM_ACT, "GroupNorm1Act"): Rule(_timm_group_norm, fuses_act=True, fast_norm=True),
    (_TIMM_NORM_ACT, "LayerNormAct"): Rule(_timm_layer_norm, fuses_act=True, fast_norm=True),
    (_TIMM_NORM_ACT, "LayerNormActFp32"): Rule(_timm_layer_norm, fuses_act=True),
    (_TIMM_NORM_ACT, "LayerNormAct2d"): Rule(_timm_layer_norm_2d, fuses_act=True, fast_norm=True, memo=False),
    (_TIMM_NORM_ACT, "LayerNormAct2dFp32"): Rule(_timm_layer_norm_2d, fuses_act=True, memo=False),
    (_TIMM_NORM_ACT, "RmsNormAct"): Rule(_timm_rms_norm, fuses_act=True, fast_norm=True, fused_original=False),
    (_TIMM_NORM_ACT, "RmsNormActFp32"): Rule(_timm_rms_norm, fuses_act=True, fused_original=False),
    (_TIMM_NORM_ACT, "RmsNormAct2d"): Rule(_timm_rms_norm_2d, fuses_act=True, fast_norm=True, fused_original=False,
                                           memo=False),
    (_TIMM_NORM_ACT, "RmsNormAct2dFp32"): Rule(_timm_rms_norm_2d, fuses_act=True, fused_original=False, memo=False),
}


def _hf(family: str, name: str, forward) -> None:
    RULES[(f"transformers.models.{family}.modeling_{family}", name)] = Rule(forward, fused_original=False)


for _family, _name in (("llama", "LlamaRMSNorm"), ("mistral", "MistralRMSNorm"), ("mixtral", "MixtralRMSNorm"),
                       ("qwen2", "Qwen2RMSNorm"), ("qwen2_moe", "Qwen2MoeRMSNorm"), ("qwen3", "Qwen3RMSNorm"),
                       ("qwen3_moe", "Qwen3MoeRMSNorm"), ("phi3", "Phi3RMSNorm"),
                       ("deepseek_v2", "DeepseekV2RMSNorm"), ("deepseek_v3", "DeepseekV3RMSNorm")):
    _hf(_family, _name, _hf_llama_rms)
for _family, _name in (("gemma", "GemmaRMSNorm"), ("gemma2", "Gemma2RMSNorm"), ("gemma3", "Gemma3RMSNorm")):
    _hf(_family, _name, _hf_gemma_rms)
_hf("olmo2", "Olmo2RMSNorm", _hf_olmo2_rms)
# (the gated norms take (x, gate): no memo, which keys x alone)
RULES[("transformers.models.qwen3_next.modeling_qwen3_next", "Qwen3NextRMSNormGated")] = Rule(
    _hf_qwen3_next_gated, fused_original=False, memo=False)
RULES[("transformers.models.mamba2.modeling_mamba2", "MambaRMSNormGated")] = Rule(
    _hf_mamba2_gated, fused_original=False, memo=False)
_hf("t5", "T5LayerNorm", _hf_t5_rms)
_hf("mt5", "MT5LayerNorm", _hf_t5_rms)
del _family, _name


def rule_for(cls) -> Optional[Rule]:
    return RULES.get((cls.__module__, cls.__qualname__))


# --- replacement classes --------------------------------------------------------------------------------------------

_replacements: dict[type, type] = {}  # one entry per replaced class (bounded by the registry)
_lock = threading.Lock()


def _replacement(cls, rule: Rule) -> type:
    """The subclass of ``cls`` computing with cunorm (made once per class)."""
    with _lock:
        made = _replacements.get(cls)
        if made is None:
            made = type(cls.__name__, (cls,), {"_cunorm_original": cls, "_cunorm_fused_original": rule.fused_original,
                                               "_cunorm_activation": None, "__module__": __name__,
                                               "__doc__": f"{cls.__module__}.{cls.__qualname__} computed by cunorm."})
            with_memo(made, rule.forward, rule.pure, memoize=rule.memo)
            _replacements[cls] = made
        return made


def is_replacement(cls) -> bool:
    return cls in TORCH_LAYERS.values() or "_cunorm_original" in cls.__dict__


# --- replace_norms --------------------------------------------------------------------------------------------------


@dataclass
class NormReport:
    """What replace_norms did: ``replaced`` maps each replaced module's
    name (as ``model.named_modules()`` gives it; "" for the model itself) to
    its class, ``left`` each norm-like module left alone to the reason."""

    replaced: dict[str, str] = field(default_factory=dict)
    left: dict[str, str] = field(default_factory=dict)

    def __str__(self) -> str:
        lines = [f"cunorm.torch.replace_norms: {len(self.replaced)} replaced, {len(self.left)} left alone"]
        counts: dict[str, int] = {}
        for cls in self.replaced.values():
            counts[cls] = counts.get(cls, 0) + 1
        lines += [f"  replaced {n} x {cls}" for cls, n in sorted(counts.items())]
        lines += [f"  left {name or '(model)'}: {reason}" for name, reason in self.left.items()]
        return "\n".join(lines)


_NORM_NAME = re.compile(r"norm", re.IGNORECASE)


def _norm_like(module) -> bool:
    """A module that looks like a norm layer: its class name says so and
    none of its children holds parameters (a block around a norm does)."""
    if not _NORM_NAME.search(type(module).__name__):
        return False
    return not any(True for child in module.children() for _ in child.parameters())


def _torch_base(cls) -> Optional[type]:
    for base in TORCH_LAYERS:
        if issubclass(cls, base):
            return base
    return None


def decide(module) -> tuple[Optional[type], Optional[str]]:
    """(replacement class, None), or (None, why not) for a norm-like module,
    or (None, None) for a module that is not a norm layer. Pure: changes
    nothing (the activation a replacement fuses is set by replace_norms)."""
    cls = type(module)
    if is_replacement(cls):
        return None, None
    torch_layer = TORCH_LAYERS.get(cls)
    if torch_layer is not None:
        return torch_layer, None
    rule = rule_for(cls)
    if rule is None:
        base = _torch_base(cls)
        if base is not None:
            return None, f"a subclass of torch.nn.{base.__name__} whose forward cunorm does not know"
        if _norm_like(module):
            return None, "a norm layer whose formula cunorm does not know"
        return None, None
    if rule.fast_norm and getattr(module, "_fast_norm", False):
        return None, "timm's fast_norm mode is on (it computes in the autocast dtype)"
    if rule.fuses_act:
        _, reason = _act_and_drop(module)
        if reason is not None:
            return None, reason
    return _replacement(cls, rule), None


def replace_norms(model: torch.nn.Module, *, report: bool = False):
    """Make the norm layers of ``model`` (``model`` itself included) compute
    with cunorm, in place; return ``model``, or with ``report=True`` a
    :class:`NormReport` of what was replaced and what was left and why.

    Replaced: torch.nn's RMSNorm, LayerNorm, GroupNorm, InstanceNorm1d/2d/3d
    and BatchNorm1d/2d/3d; timm's LayerNorm, LayerNorm2d, RmsNorm,
    RmsNorm2d, GroupNorm, GroupNorm1 (and their Fp32 forms), and its
    norm-act layers BatchNormAct2d, GroupNormAct, GroupNorm1Act,
    LayerNormAct, LayerNormAct2d, RmsNormAct, RmsNormAct2d (the activation
    fused into the kernel: ReLU, SiLU, GELU, GELU tanh, identity);
    transformers' RMSNorms of Llama, Mistral, Mixtral, Qwen2, Qwen2-MoE,
    Qwen3 (its per-head q/k norms too), Qwen3-MoE, Phi-3, DeepSeek-V2/V3
    (their rounding: ``rounding="normalized"``), Gemma 1/2/3 (``1 +
    weight``), OLMo2, and T5's and mT5's T5LayerNorm; the gated RMSNorms
    of Qwen3-Next (Qwen3NextRMSNormGated) and Mamba-2 (MambaRMSNormGated),
    through ``gate=``. The modules stay the
    same objects (an optimizer built before keeps working); only their class
    becomes a cunorm subclass of it. Subclasses of these whose forward may
    differ, and norms of other formulas, are left alone.
    """
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    found = NormReport()
    for name, module in model.named_modules():
        replacement, reason = decide(module)
        if replacement is not None:
            rule = rule_for(type(module))
            if rule is not None and rule.fuses_act:
                module._cunorm_activation = _act_and_drop(module)[0]
            module.__class__ = replacement
        if is_replacement(type(module)):
            cls = type(module)
            original = cls.__dict__.get("_cunorm_original") or next(b for b, c in TORCH_LAYERS.items() if c is cls)
            found.replaced[name] = f"{original.__module__}.{original.__qualname__}"
        elif reason is not None:
            found.left[name] = reason
    return found if report else model
