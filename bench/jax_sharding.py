"""Does cunorm keep its speed inside a jit program sharded over two GPUs?

x of (32768, hidden) sharded by rows over two GPUs, ``jax.jit`` of
cunorm.jax's rms_norm and layer_norm (forward, and ``jax.grad`` of
``sum(y * dy)``), against the same call unsharded on one GPU over one
shard's rows (what each GPU does: the target is within 10% of it) and
XLA's own formula sharded alike. Also reports whether the compiled
program gathers. Milliseconds per call: loops of 300 calls, best of five.

Usage (a machine with two GPUs): ``PYTHONPATH=. python3 bench/jax_sharding.py [OUT.json]``
"""
import json
import os
import sys

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P  # noqa: E402

import cunorm.jax as cj  # noqa: E402

from cunorm.bench._jax import _jnp_ln, _jnp_rms, _per_call_ms  # noqa: E402  (the jax suite's timing and XLA's formulas)

CALLS = 300  # a loop's calls; the best of five loops

OPS = {
    "rms_norm": (lambda x, w, b: cj.rms_norm(x, w, eps=1e-6), _jnp_rms(jax, jnp)),
    "layer_norm": (lambda x, w, b: cj.layer_norm(x, w, b, eps=1e-6), _jnp_ln(jax, jnp)),
}


def per_call_ms(f, *args):
    return _per_call_ms(jax, f, args, CALLS)


def grad_of(f):
    return jax.grad(lambda x, w, b, dy: jnp.sum(f(x, w, b).astype(jnp.float32) * dy), argnums=(0, 1, 2))


def gathers(f, *args):
    text = jax.jit(f).lower(*args).compile().as_text()
    return "all-gather(" in text or "all-gather-start(" in text


def main():
    gpus = [d for d in jax.devices() if d.platform == "gpu"]
    assert len(gpus) >= 2, f"needs two GPUs, JAX sees {len(gpus)}"
    mesh = Mesh(np.array(gpus[:2]), ("d",))
    rows_sharded, whole = NamedSharding(mesh, P("d")), NamedSharding(mesh, P())
    rng = np.random.default_rng(0)
    results = []
    for hidden in (4096, 8192):
        tokens = 32768
        x = rng.standard_normal((tokens, hidden)).astype(jnp.bfloat16)
        dy = rng.standard_normal((tokens, hidden)).astype(np.float32)
        w, b = (rng.standard_normal(hidden).astype(np.float32) for _ in range(2))
        sharded = [jax.device_put(x, rows_sharded), jax.device_put(w, whole), jax.device_put(b, whole)]
        dy_sharded = jax.device_put(dy, rows_sharded)
        shard = [jax.device_put(a, gpus[0]) for a in (x[: tokens // 2], w, b)]
        dy_shard = jax.device_put(dy[: tokens // 2], gpus[0])
        for name, (ours, xla) in OPS.items():
            for direction in ("forward", "forward+backward"):
                if direction == "forward":
                    f, g, extra, extra_shard = ours, xla, (), ()
                else:
                    f, g, extra, extra_shard = grad_of(ours), grad_of(xla), (dy_sharded,), (dy_shard,)
                row = {"op": name, "shape": [tokens, hidden], "dtype": "bfloat16", "direction": direction,
                       "cunorm_sharded_ms": per_call_ms(jax.jit(f), *sharded, *extra),
                       "cunorm_one_shard_ms": per_call_ms(jax.jit(f), *shard, *extra_shard),
                       "xla_sharded_ms": per_call_ms(jax.jit(g), *sharded, *extra),
                       "cunorm_gathers": gathers(f, *sharded, *extra)}
                row["sharded_over_one_shard"] = row["cunorm_sharded_ms"] / row["cunorm_one_shard_ms"]
                results.append(row)
                print(f"{name} {tokens}x{hidden} {direction}: sharded {row['cunorm_sharded_ms']:.3f} ms, one "
                      f"shard {row['cunorm_one_shard_ms']:.3f} ms ({row['sharded_over_one_shard']:.3f}x), XLA "
                      f"sharded {row['xla_sharded_ms']:.3f} ms, gathers: {row['cunorm_gathers']}", flush=True)
    if len(sys.argv) > 1:
        with open(sys.argv[1], "w") as f:
            json.dump({"gpus": [d.device_kind for d in gpus[:2]], "jax": jax.__version__, "results": results}, f,
                      indent=1)


if __name__ == "__main__":
    main()
