"""The float dtypes cunorm computes in, and their names in the kernels."""
from __future__ import annotations

import ml_dtypes
import numpy as np

bfloat16 = np.dtype(ml_dtypes.bfloat16)
float16 = np.dtype(np.float16)
float32 = np.dtype(np.float32)
float64 = np.dtype(np.float64)

#: storage dtype -> C++ type in cunorm/kernels/common.cuh
KERNEL_TYPE = {
    float16: "cunorm::half_t",
    bfloat16: "cunorm::bf16_t",
    float32: "float",
    float64: "double",
}
SUPPORTED = tuple(KERNEL_TYPE)
SUPPORTED_NAMES = "float16, bfloat16, float32 or float64"
NO_PARAMS = "cunorm::none_t"


def accumulation(dtype: np.dtype) -> np.dtype:
    """float32 statistics for 16- and 32-bit data, float64 for float64."""
    return float64 if dtype == float64 else float32


def param_storage(x_dtype: np.dtype, dtypes) -> np.dtype:
    """The one dtype the affine parameters (weight, bias) are handed to the
    kernel in.

    The kernels read them either in x's dtype or in the accumulation dtype
    (e.g. float32 weights with bfloat16 x). Parameters that are all x's dtype,
    or all the accumulation dtype, are used as they are; any other mix is
    cast to the accumulation dtype first (a small copy of the parameters,
    never of x).
    """
    kinds = set(dtypes)
    if len(kinds) == 1:
        (only,) = kinds
        if only == x_dtype or only == accumulation(x_dtype):
            return only
    return accumulation(x_dtype)
