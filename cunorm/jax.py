"""cunorm for JAX: the ops on eager JAX GPU arrays.

Each function is the array-level op of the same name (``cunorm.rms_norm``
etc.; the same arguments without ``out=``) for JAX arrays: x and the
parameters go in zero-copy through DLPack, the results come back as JAX
arrays over the kernels' output buffers (zero-copy too), and no JAX buffer
is ever written (BatchNorm's running buffers, which are updated in place,
must be CuPy or torch arrays).

Eager arrays only. Inside ``jax.jit`` (or ``vmap``, ``grad``) the values are
tracers with no buffer behind them, and cunorm's kernels are not XLA
operations: a traced value raises a TypeError saying so. Call cunorm between
jitted functions, on their concrete results.
"""
from __future__ import annotations

import functools

import jax

from . import norms

__all__ = ["rms_norm", "layer_norm", "normalize", "mean_abs_normalize", "frobenius_normalize", "group_norm",
           "instance_norm", "batch_norm"]


def _eager(op):
    @functools.wraps(op)
    def run(x, *args, **kwargs):
        if "out" in kwargs:
            raise TypeError(f"cunorm.jax.{op.__name__} has no out=: JAX arrays are immutable (use the result)")
        if not isinstance(x, jax.Array):
            raise TypeError(f"cunorm.jax.{op.__name__}: x must be a JAX array, got "
                            f"{type(x).__module__}.{type(x).__qualname__} (cunorm.{op.__name__} takes any array)")
        return op(x, *args, **kwargs)

    run.__doc__ = f"``cunorm.{op.__name__}`` on eager JAX arrays (no ``out=``).\n\n" + (op.__doc__ or "")
    return run


rms_norm = _eager(norms.rms_norm)
layer_norm = _eager(norms.layer_norm)
normalize = _eager(norms.normalize)
mean_abs_normalize = _eager(norms.mean_abs_normalize)
frobenius_normalize = _eager(norms.frobenius_normalize)
group_norm = _eager(norms.group_norm)
instance_norm = _eager(norms.instance_norm)
batch_norm = _eager(norms.batch_norm)
