"""cunorm: fused CUDA normalization kernels for CuPy, torch and JAX arrays."""
from __future__ import annotations

__version__ = "0.1.0"

from .norms import batch_norm, group_norm, instance_norm, layer_norm, rms_norm  # noqa: E402
from ._loader import precompile  # noqa: E402
from . import reference  # noqa: E402

__all__ = ["rms_norm", "layer_norm", "group_norm", "instance_norm", "batch_norm", "precompile", "reference", "__version__"]
