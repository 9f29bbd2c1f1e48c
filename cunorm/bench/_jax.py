"""The jax suite: cunorm.jax inside ``jax.jit`` against XLA's own fusion of
the same op written in ``jax.numpy``, in one run (bf16 x,
float32 parameters).

Per case: forward, forward+backward (``jax.grad`` of the sum of y * dy
over x and the parameters: y itself is never read, so both sides skip
writing it) and forward+backward of a loss that reads y (the sum of y * y *
dy, as a next layer would: XLA fuses y into the loss, cunorm writes it),
each a jitted function. Time per call: wall
clock over a loop of calls synchronized at the end (what a JAX user
measures; XLA's launch overhead inside), 300 calls, the best of five loops. GB/s and
floor% of the forward: x read and y written (the fewest bytes) over that
time, against the run's copy bandwidth. Agreement: the max difference of
cunorm's forward from XLA's, over the max of XLA's, both from bf16 x (their
roundings differ by about one bf16 ulp).
"""
from __future__ import annotations

import os
import time

TITLES = ["op", "shape", "cunorm fwd ms", "XLA fwd ms", "fwd x XLA", "fwd floor%", "cunorm fwd+bwd ms",
          "XLA fwd+bwd ms", "fwd+bwd x XLA", "y read: cunorm ms", "XLA ms", "x XLA", "agreement"]


def _jnp_rms(jax, jnp):
    def f(x, w, b):
        xf = x.astype(jnp.float32)
        return (xf * jax.lax.rsqrt(jnp.mean(xf * xf, -1, keepdims=True) + 1e-6) * w).astype(x.dtype)
    return f


def _jnp_ln(jax, jnp):
    def f(x, w, b):
        xf = x.astype(jnp.float32)
        m = jnp.mean(xf, -1, keepdims=True)
        v = jnp.mean(jnp.square(xf - m), -1, keepdims=True)
        return ((xf - m) * jax.lax.rsqrt(v + 1e-6) * w + b).astype(x.dtype)
    return f


def _jnp_gn_nhwc(jax, jnp, groups=32):
    def f(x, w, b):
        n, h, wd, c = x.shape
        g = x.astype(jnp.float32).reshape(n, h * wd, groups, c // groups)
        m = jnp.mean(g, (1, 3), keepdims=True)
        v = jnp.mean(jnp.square(g - m), (1, 3), keepdims=True)
        return (((g - m) * jax.lax.rsqrt(v + 1e-6)).reshape(x.shape) * w + b).astype(x.dtype)
    return f


def cases(quick: bool = False) -> list[tuple]:
    """(op, shape, cunorm's f(cj), XLA's f(jax, jnp)) of each case."""
    tokens, hidden, long_rows = (4096, 4096, 32768) if quick else (32768, 4096, 32768)
    few = 512 if quick else 4096
    image = (2, 64, 64, 320) if quick else (8, 64, 64, 320)
    return [
        ("rms_norm", (tokens, hidden), lambda cj: lambda x, w, b: cj.rms_norm(x, w, eps=1e-6), _jnp_rms),
        ("rms_norm", (few, long_rows), lambda cj: lambda x, w, b: cj.rms_norm(x, w, eps=1e-6), _jnp_rms),
        ("layer_norm", (tokens, hidden), lambda cj: lambda x, w, b: cj.layer_norm(x, w, b, eps=1e-6), _jnp_ln),
        ("layer_norm", (few, long_rows), lambda cj: lambda x, w, b: cj.layer_norm(x, w, b, eps=1e-6), _jnp_ln),
        ("group_norm(32) NHWC", image,
         lambda cj: lambda x, w, b: cj.group_norm(x, 32, w, b, eps=1e-6, channel_axis=-1), _jnp_gn_nhwc),
    ]


def _per_call_ms(jax, fn, args, calls: int) -> float:
    jax.block_until_ready(fn(*args))
    best = float("inf")
    for _ in range(5):
        start = time.perf_counter()
        for _ in range(calls):
            out = fn(*args)
        jax.block_until_ready(out)
        best = min(best, (time.perf_counter() - start) / calls)
    return best * 1e3


def rows(quick: bool = False, only: str = "", copy_gbps: float | None = None) -> list[dict]:
    """One row per case: cunorm's and XLA's ms, forward, forward+backward
    and forward+backward with y read."""
    os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
    try:
        import jax
        import jax.numpy as jnp

        import cunorm.jax as cj
    except ImportError as err:
        return [{"op": "jax", "shape": "", "skipped": str(err)}]
    # (loops of 50 calls swung the GroupNorm forward from 0.071 to 0.110 ms
    # across runs of one commit; 500 calls: 0.064-0.068)
    calls = 10 if quick else 300
    key = jax.random.key(0)
    out = []
    for i, (op, shape, ours, theirs) in enumerate(cases(quick)):
        if only not in f"{op} {shape}":
            continue
        row = {"op": op, "shape": str(shape)}
        try:
            kx, kd, kw, kb = jax.random.split(jax.random.fold_in(key, i), 4)
            x = jax.random.normal(kx, shape, jnp.bfloat16)
            dy = jax.random.normal(kd, shape, jnp.bfloat16)
            w = 1 + 0.1 * jax.random.normal(kw, shape[-1:], jnp.float32)
            b = 0.1 * jax.random.normal(kb, shape[-1:], jnp.float32)
            fs = {"cunorm": ours(cj), "xla": theirs(jax, jnp)}
            for name, f in fs.items():
                row[f"{name}_fwd_ms"] = _per_call_ms(jax, jax.jit(f), (x, w, b), calls)
                grad = jax.jit(jax.grad(lambda x, w, b, f=f: jnp.sum((f(x, w, b) * dy).astype(jnp.float32)),
                                        (0, 1, 2)))
                row[f"{name}_train_ms"] = _per_call_ms(jax, grad, (x, w, b), calls)
                read = jax.jit(jax.grad(lambda x, w, b, f=f: jnp.sum((jnp.square(f(x, w, b)) * dy).astype(
                    jnp.float32)), (0, 1, 2)))
                row[f"{name}_read_ms"] = _per_call_ms(jax, read, (x, w, b), calls)
            y, want = (jax.jit(f)(x, w, b).astype(jnp.float32) for f in fs.values())
            row["agreement"] = float(jnp.max(jnp.abs(y - want)) / jnp.max(jnp.abs(want)))
            row["fwd_speedup"] = row["xla_fwd_ms"] / row["cunorm_fwd_ms"]
            row["train_speedup"] = row["xla_train_ms"] / row["cunorm_train_ms"]
            row["read_speedup"] = row["xla_read_ms"] / row["cunorm_read_ms"]
            if copy_gbps:
                gbps = 2 * x.size * x.dtype.itemsize / row["cunorm_fwd_ms"] / 1e6
                row["fwd_floor_pct"] = 100 * gbps / copy_gbps
        except Exception as err:  # noqa: BLE001  (a row says what failed; the suite goes on)
            row["skipped"] = f"{type(err).__name__}: {err}"[:300]
        out.append(row)
    return out


def format_rows(rows_: list[dict]) -> list[list[str]]:
    table = []
    for r in rows_:
        if r.get("skipped"):
            table.append([r["op"], r["shape"], "skipped: " + r["skipped"]] + [""] * (len(TITLES) - 3))
            continue
        floor = r.get("fwd_floor_pct")
        table.append([r["op"], r["shape"], f"{r['cunorm_fwd_ms']:.3f}", f"{r['xla_fwd_ms']:.3f}",
                      f"{r['fwd_speedup']:.2f}", "" if floor is None else f"{floor:.1f}",
                      f"{r['cunorm_train_ms']:.3f}", f"{r['xla_train_ms']:.3f}", f"{r['train_speedup']:.2f}",
                      f"{r['cunorm_read_ms']:.3f}", f"{r['xla_read_ms']:.3f}", f"{r['read_speedup']:.2f}",
                      f"{r['agreement']:.1e}"])
    return table
