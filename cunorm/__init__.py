"""cunorm: fused CUDA normalization kernels for CuPy, torch and JAX arrays."""
from __future__ import annotations

__version__ = "0.1.0"

from .norms import (batch_norm, frobenius_normalize, group_norm, instance_norm, layer_norm, mean_abs_normalize,
                    normalize, rms_norm)
from .backward import (batch_norm_backward, frobenius_normalize_backward, group_norm_backward, instance_norm_backward,
                       layer_norm_backward, mean_abs_normalize_backward, normalize_backward, rms_norm_backward)
from ._engine.loader import precompile  # noqa: E402
from . import reference  # noqa: E402

__all__ = ["rms_norm", "layer_norm", "normalize", "mean_abs_normalize", "frobenius_normalize", "group_norm",
           "instance_norm", "batch_norm", "rms_norm_backward", "layer_norm_backward", "normalize_backward",
           "mean_abs_normalize_backward", "frobenius_normalize_backward", "group_norm_backward",
           "instance_norm_backward", "batch_norm_backward", "precompile", "reference", "__version__"]
