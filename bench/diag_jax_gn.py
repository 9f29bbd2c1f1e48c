"""GroupNorm(32) NHWC bf16 (8,64,64,320) inside jax.jit: wall per call over
long loops (500 calls, best and median of 7), cunorm's tiles exact (default)
and of a power of two (forced), and XLA's fusion, interleaved; plus the
wall time of one call after an idle gap (block_until_ready)."""
import statistics
import sys
import time

sys.path.insert(0, ".")
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

import cunorm.jax as cj  # noqa: E402
from cunorm import _dispatch_channels  # noqa: E402
from cunorm.bench._jax import _jnp_gn_nhwc  # noqa: E402

walk = _dispatch_channels.channels_last_walk


def loops(fn, args, calls=500, reps=7):
    jax.block_until_ready(fn(*args))
    out = []
    for _ in range(reps):
        start = time.perf_counter()
        for _ in range(calls):
            r = fn(*args)
        jax.block_until_ready(r)
        out.append((time.perf_counter() - start) / calls * 1e3)
    return min(out), statistics.median(out)


def single(fn, args, reps=20):
    jax.block_until_ready(fn(*args))
    out = []
    for _ in range(reps):
        time.sleep(0.002)
        start = time.perf_counter()
        jax.block_until_ready(fn(*args))
        out.append((time.perf_counter() - start) * 1e3)
    return min(out), statistics.median(out)


k = jax.random.split(jax.random.key(0), 3)
x = jax.random.normal(k[0], (8, 64, 64, 320), jnp.bfloat16)
w = 1 + 0.1 * jax.random.normal(k[1], (320,), jnp.float32)
b = 0.1 * jax.random.normal(k[2], (320,), jnp.float32)
ours = lambda x, w, b: cj.group_norm(x, 32, w, b, eps=1e-6, channel_axis=-1)  # noqa: E731
fns = {"cunorm exact": jax.jit(ours), "xla": jax.jit(_jnp_gn_nhwc(jax, jnp))}
_dispatch_channels.channels_last_walk = lambda plan, override: walk(plan, {**override, "exact_tile": False})
from cunorm import _channels  # noqa: E402
for v in vars(_channels).values():
    if callable(getattr(v, "cache_clear", None)):
        v.cache_clear()
# a new trace (another eps), lowered with power-of-two tiles
fns["cunorm pow2"] = jax.jit(lambda x, w, b: cj.group_norm(x, 32, w, b, eps=1.0000001e-6, channel_axis=-1))
jax.block_until_ready(fns["cunorm pow2"](x, w, b))
_dispatch_channels.channels_last_walk = walk
for rnd in range(2):
    for name, fn in fns.items():
        lo, med = loops(fn, (x, w, b))
        s_lo, s_med = single(fn, (x, w, b))
        print(f"round {rnd} {name:14s} loop best {lo:.4f} median {med:.4f} ms; single call best {s_lo:.4f} "
              f"median {s_med:.4f} ms", flush=True)
print(jax.jit(ours).lower(x, w, b).as_text().count("triton_kernel_call"), "custom calls")
