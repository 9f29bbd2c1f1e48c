"""How fast are the conditioned norms' forwards? DiT's adaLN-Zero step,
``h = residual + gate * x; y = LayerNorm(h) * (1 + scale) + shift`` (no
affine; shift, scale and gate per sample, (B, 1, H)), the modulated
RMSNorm with a weight, and the gated RMSNorm with a weight
(``norm(x) * w * silu(z)``; ``norm(x * silu(z)) * w`` over 8 groups of the
row, Mamba-2's; over heads of 128, Qwen3-Next's), and the RMSNorm of a
float32 residual stream (``h = x + r`` with r and h float32, y bf16), bf16, against torch eager
and torch.compile of the same formula, at DiT-XL's hidden 1152, Flux's
3072, 4096 and 8192, from 1 to 32768 tokens (batch 8 from 4096 tokens on).
GPU time (busy fill), one call with L2 flushed (cold), floor% of copy
bandwidth measured in the same run, counting x, the residual and z read, h
and y written, and the per-sample arrays once.

    PYTHONPATH=. python bench/conditioned.py OUT.json [TOKENS]

TOKENS: the token counts to run, comma-separated (default 1,4096,32768).
"""
import json
import sys

import torch

import cunorm
from cunorm.bench._timing import compile_static, copy_bandwidth, time_gpu, time_single

EPS = 1e-6
TOKENS = (1, 4096, 32768)
_FLUSH = torch.empty(256 << 20, dtype=torch.float32, device="cuda")


def cold(fn, reps=10):
    """Median ms of single calls, L2 flushed before each."""
    def flushed():
        _FLUSH.zero_()
        torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        flushed()
        times.append(time_single(fn, reps=1, warmup=0))
    return sorted(times)[len(times) // 2]


def adaln_torch(x, r, shift, scale, gate):
    h = r + gate * x
    y = torch.nn.functional.layer_norm(h.float(), h.shape[-1:], eps=EPS) * (1 + scale.float()) + shift.float()
    return y.to(x.dtype), h


def rms_mod_torch(x, w, shift, scale):
    xf = x.float()
    y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + EPS) * w
    return (y * (1 + scale.float()) + shift.float()).to(x.dtype)


def _rms(h, groups=1):
    g = h.unflatten(-1, (groups, -1))
    return (g * torch.rsqrt(g.pow(2).mean(-1, keepdim=True) + EPS)).flatten(-2)


def gated_torch(x, z, w):
    return (_rms(x.float()) * w.float() * torch.nn.functional.silu(z.float())).to(x.dtype)


def gated_groups_torch(x, z, w):
    return (_rms(x.float() * torch.nn.functional.silu(z.float()), 8) * w.float()).to(x.dtype)


def rms_res32_torch(x, r, w):
    h = x.float() + r
    return (_rms(h) * w.float()).to(x.dtype), h


def main(out, token_counts=TOKENS):
    copy = copy_bandwidth()
    rows = []
    for hidden in (1152, 3072, 4096, 8192):
        for tokens in token_counts:
            compiled = {name: compile_static(fn) for name, fn in (
                ("adaln", adaln_torch), ("rms_mod", rms_mod_torch), ("gated", gated_torch),
                ("gated_groups", gated_groups_torch), ("rms_res32", rms_res32_torch))}
            batch = 1 if tokens == 1 else 8
            shape = (batch, tokens // batch, hidden)
            g = torch.Generator(device="cuda").manual_seed(0)
            x, r = (torch.randn(shape, device="cuda", generator=g, dtype=torch.bfloat16) for _ in range(2))
            shift, scale, gate = (torch.randn(batch, 1, hidden, device="cuda", generator=g,
                                              dtype=torch.bfloat16) * 0.5 for _ in range(3))
            w = torch.randn(hidden, device="cuda", generator=g, dtype=torch.bfloat16)
            z = torch.randn(shape, device="cuda", generator=g, dtype=torch.bfloat16)
            heads, zh, wh = x.unflatten(-1, (-1, 128)), z.unflatten(-1, (-1, 128)), w[:128]
            r32 = r.float() * 8
            per_sample = 3 * batch * hidden * 2
            cases = {
                "adaln": (lambda: cunorm.layer_norm(x, residual=r, shift=shift, scale=scale, residual_gate=gate,
                                                    eps=EPS),
                          lambda: adaln_torch(x, r, shift, scale, gate),
                          lambda: compiled["adaln"](x, r, shift, scale, gate), 4 * x.numel() * 2 + per_sample),
                "rms_mod": (lambda: cunorm.rms_norm(x, w, shift=shift, scale=scale, eps=EPS),
                            lambda: rms_mod_torch(x, w, shift, scale),
                            lambda: compiled["rms_mod"](x, w, shift, scale), 2 * x.numel() * 2 + per_sample),
                "gated": (lambda: cunorm.rms_norm(x, w, gate=z, eps=EPS), lambda: gated_torch(x, z, w),
                          lambda: compiled["gated"](x, z, w), 3 * x.numel() * 2 + hidden * 2),
                "gated_groups": (lambda: cunorm.rms_norm(x, w, gate=z, norm_before_gate=False,
                                                         group_size=hidden // 8, eps=EPS),
                                 lambda: gated_groups_torch(x, z, w), lambda: compiled["gated_groups"](x, z, w),
                                 3 * x.numel() * 2 + hidden * 2),
                "rms_res32": (lambda: cunorm.rms_norm(x, w, residual=r32, eps=EPS), lambda: rms_res32_torch(x, r32, w),
                              lambda: compiled["rms_res32"](x, r32, w), 12 * x.numel() + hidden * 2),
                "gated_heads": (lambda: cunorm.rms_norm(heads, wh, gate=zh, eps=EPS),
                                lambda: gated_torch(heads, zh, wh), lambda: compiled["gated"](heads, zh, wh),
                                3 * x.numel() * 2 + 256),
            }
            for name, (ours, eager, comp, nbytes) in cases.items():
                want = eager()
                got = ours()
                y, y_want = (got[0], want[0]) if isinstance(got, tuple) else (got, want)
                err = float((y.float() - y_want.float()).abs().max() / y_want.float().abs().max())
                row = {"case": name, "shape": list(shape), "hidden": hidden, "tokens": tokens, "max_rel_err": err}
                for label, fn in (("cunorm", ours), ("eager", eager), ("compile", comp)):
                    row[f"{label}_gpu_ms"] = time_gpu(fn)[0]
                    row[f"{label}_cold_ms"] = cold(fn)
                row["floor_pct"] = 100 * nbytes / (row["cunorm_gpu_ms"] * 1e-3) / 1e9 / copy
                row["cold_floor_pct"] = 100 * nbytes / (row["cunorm_cold_ms"] * 1e-3) / 1e9 / copy
                rows.append(row)
                print(f"{name:8s} {str(shape):18s} gpu {row['cunorm_gpu_ms']*1e3:8.1f} us ({row['floor_pct']:5.1f}%) "
                      f"eager {row['eager_gpu_ms']*1e3:8.1f} compile {row['compile_gpu_ms']*1e3:8.1f} | cold "
                      f"{row['cunorm_cold_ms']*1e3:8.1f} eager {row['eager_cold_ms']*1e3:8.1f} compile "
                      f"{row['compile_cold_ms']*1e3:8.1f} | err {err:.1e}", flush=True)
    with open(out, "w") as f:
        json.dump({"gpu": torch.cuda.get_device_name(), "copy_gbps": copy, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "conditioned.json",
         tuple(int(t) for t in sys.argv[2].split(",")) if len(sys.argv) > 2 else TOKENS)
