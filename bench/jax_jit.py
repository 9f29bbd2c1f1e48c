"""cunorm.jax inside jax.jit against XLA's own fusion of the jax.numpy
formulation, in one run: forward, and forward+backward (jax.grad of the sum
of y * dy over x and the parameters). Per call: wall clock over a loop of
jitted calls, synchronized at the end (what a JAX user measures), the best
of three loops. Issue 25's cases.

PYTHONPATH=. python bench/jax_jit.py   (on the GPU machine)"""
import os
import time

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

import cunorm.jax as cj  # noqa: E402


def per_call(fn, *args, loops=3, calls=50):
    jax.block_until_ready(fn(*args))
    best = float("inf")
    for _ in range(loops):
        t = time.perf_counter()
        for _ in range(calls):
            out = fn(*args)
        jax.block_until_ready(out)
        best = min(best, (time.perf_counter() - t) / calls)
    return best * 1e3


def rms_jnp(x, w, b):
    xf = x.astype(jnp.float32)
    return (xf * jax.lax.rsqrt(jnp.mean(xf * xf, -1, keepdims=True) + 1e-6) * w).astype(x.dtype)


def ln_jnp(x, w, b):
    xf = x.astype(jnp.float32)
    m = jnp.mean(xf, -1, keepdims=True)
    v = jnp.mean(jnp.square(xf - m), -1, keepdims=True)
    return ((xf - m) * jax.lax.rsqrt(v + 1e-6) * w + b).astype(x.dtype)


def gn_jnp(x, w, b):  # NHWC, 32 groups
    n, hh, ww, c = x.shape
    g = x.astype(jnp.float32).reshape(n, hh * ww, 32, c // 32)
    m = jnp.mean(g, (1, 3), keepdims=True)
    v = jnp.mean(jnp.square(g - m), (1, 3), keepdims=True)
    return (((g - m) * jax.lax.rsqrt(v + 1e-6)).reshape(x.shape) * w + b).astype(x.dtype)


CASES = [
    ("rms_norm", (32768, 4096), lambda x, w, b: cj.rms_norm(x, w, eps=1e-6), rms_jnp),
    ("rms_norm", (4096, 32768), lambda x, w, b: cj.rms_norm(x, w, eps=1e-6), rms_jnp),
    ("layer_norm", (32768, 4096), lambda x, w, b: cj.layer_norm(x, w, b, eps=1e-6), ln_jnp),
    ("layer_norm", (4096, 32768), lambda x, w, b: cj.layer_norm(x, w, b, eps=1e-6), ln_jnp),
    ("group_norm NHWC", (8, 64, 64, 320), lambda x, w, b: cj.group_norm(x, 32, w, b, eps=1e-6, channel_axis=-1),
     gn_jnp),
]


def main():
    print(f"jax {jax.__version__}, {jax.devices()[0].device_kind}; bf16 x, float32 parameters; ms per call")
    print("| op | shape | cunorm fwd | XLA fwd | cunorm fwd+bwd | XLA fwd+bwd |")
    print("|---|---|---|---|---|---|")
    key = jax.random.key(0)
    for name, shape, ours, theirs in CASES:
        kx, kd, kw = jax.random.split(jax.random.fold_in(key, hash(shape) % 1000), 3)
        x = jax.random.normal(kx, shape, jnp.bfloat16)
        dy = jax.random.normal(kd, shape, jnp.bfloat16)
        w = 1 + 0.1 * jax.random.normal(kw, shape[-1:], jnp.float32)
        b = jnp.zeros(shape[-1:], jnp.float32)
        row = []
        for f in (ours, theirs):
            row.append(per_call(jax.jit(f), x, w, b))
        for f in (ours, theirs):
            g = jax.jit(jax.grad(lambda x, w, b, f=f: jnp.sum((f(x, w, b) * dy).astype(jnp.float32)), (0, 1, 2)))
            row.append(per_call(g, x, w, b))
        print(f"| {name} | {shape} | " + " | ".join(f"{t:.3f}" for t in (row[0], row[1], row[2], row[3])) + " |")


if __name__ == "__main__":
    main()
