"""The quantize= sweep: rms_norm of bf16 x with an FP8 (e4m3fn) output,
scaled per row ("row") and per group of 128 (scales column-major, padded
for TMA: "group"), and layer_norm of bf16 x with a residual, scaled per row
("ln_residual": its 16384-wide rows take rows_uncached's sweeps), against
torch.compile of the same ops (the norm in float32, then max|y| / 448 over
the row or group, floored, and the cast), at the hidden sizes and token
counts of LLM inference. GPU time (busy fill: the GPU's time alone), one
call with L2 flushed first (host time inside, as users see it), floor% of
copy bandwidth measured in the same run (x and the residual read, h
written, one byte written per element of q, the parameters and the
scales), the plain bf16-out norm beside it, the share of FP8 codes equal
to torch.compile's, and host time per cached call at decode size with what
one more output tensor costs torch on this host.

    PYTHONPATH=. python bench/quantize.py OUT.json [row|group|ln_residual ...]
"""
import json
import sys
import time

import torch

import cunorm
from cunorm.bench._timing import time_gpu

EPS = 1e-6
DEVICE = "cuda"


def gpu_time(fn):
    """Median ms of fn's GPU time, the GPU kept busy by a fill before each
    call so its launches are queued before the GPU reaches them."""
    return time_gpu(fn)[0]


_FLUSH = None


def cold_time(fn, reps=10):
    """Median of single calls, L2 flushed before each."""
    global _FLUSH
    if _FLUSH is None:
        _FLUSH = torch.empty(256 << 20, dtype=torch.uint8, device=DEVICE)
    times = []
    for _ in range(reps):
        _FLUSH.zero_()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize()
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return sorted(times)[len(times) // 2]


def copy_bandwidth():
    """GB/s of a 1 GiB device-to-device copy (bytes read and written)."""
    src = torch.empty(1 << 30, dtype=torch.uint8, device=DEVICE)
    dst = torch.empty_like(src)
    return 2 * src.numel() / gpu_time(lambda: dst.copy_(src)) / 1e6


GROUP = 128
#: each mode: the op, whether a residual is fused, quantize='s keywords
MODES = {"row": ("rms", False, {}),
         "group": ("rms", False, {"quant_group": GROUP, "quant_scale_layout": "column_major_tma"}),
         "ln_residual": ("ln", True, {})}
HIDDEN = {"rms": (2048, 4096, 7168, 8192, 16384), "ln": (2048, 4096, 8192, 16384)}


def torch_quantized(x, w, b, r, group=None):
    """The reference: (q, scales[, h]) as torch ops."""
    h = x if r is None else x + r
    if b is None:
        y = torch.nn.functional.rms_norm(h.float(), (x.shape[-1],), w.float(), EPS)
    else:
        y = torch.nn.functional.layer_norm(h.float(), (x.shape[-1],), w.float(), b.float(), EPS)
    if group:
        y = y.unflatten(-1, (-1, group))
    scale = (y.abs().amax(-1, keepdim=True) / 448.0).clamp(min=1.0 / (448.0 * 512.0))
    q = (y / scale).clamp(-448.0, 448.0).to(torch.float8_e4m3fn)
    q, scale = (q.flatten(-2), scale[..., 0]) if group else (q, scale)
    return (q, scale) if r is None else (q, scale, h)


def main(out_path, modes):
    # every shape of every mode compiled with static shapes (past the default
    # limit dynamo would run the rest eagerly; a recompile would otherwise
    # mark the changed sizes dynamic)
    for name in ("recompile_limit", "cache_size_limit"):
        if hasattr(torch._dynamo.config, name):
            setattr(torch._dynamo.config, name, 256)
    copy_gbps = copy_bandwidth()
    compiled = torch.compile(torch_quantized, dynamic=False)
    results = {"gpu": torch.cuda.get_device_name(), "copy_gbps": copy_gbps, "cases": []}
    print(f"{results['gpu']}: copy {copy_gbps:.0f} GB/s")
    with torch.no_grad():
        for mode in modes:
            sweep(results, mode, compiled, copy_gbps)
        host_time(results)
    with open(out_path, "w") as f:
        json.dump(results, f, indent=1)


def sweep(results, mode, compiled, copy_gbps):
    op, residual, kwargs = MODES[mode]
    group = kwargs.get("quant_group")
    fn = cunorm.rms_norm if op == "rms" else cunorm.layer_norm
    for n in HIDDEN[op]:
        for tokens in (1, 64, 4096, 32768):
            x = torch.randn(tokens, n, device=DEVICE, dtype=torch.bfloat16)
            w = torch.rand(n, device=DEVICE, dtype=torch.bfloat16) + 0.5
            b = torch.randn(n, device=DEVICE, dtype=torch.bfloat16) if op == "ln" else None
            r = torch.randn(tokens, n, device=DEVICE, dtype=torch.bfloat16) if residual else None
            params = (w,) if b is None else (w, b)
            ours = lambda: fn(x, *params, eps=EPS, residual=r, quantize="float8_e4m3fn", **kwargs)  # noqa: E731
            theirs = lambda: compiled(x, w, b, r, group)  # noqa: E731
            q = ours()[0]
            agree = (q.float() == theirs()[0].float()).float().mean().item()
            scales = tokens * (n // group if group else 1)
            element_bytes = 2 + 1 + (4 if residual else 0)  # x read, q written (r read, h written)
            floor_ms = (tokens * n * element_bytes + 2 * n * len(params) + 4 * scales) / copy_gbps / 1e6
            case = {"mode": mode, "tokens": tokens, "n": n, "ms": gpu_time(ours), "cold_ms": cold_time(ours),
                    "plain_ms": gpu_time(lambda: fn(x, *params, eps=EPS, residual=r)),
                    "compile_ms": gpu_time(theirs), "compile_cold_ms": cold_time(theirs), "agree": agree}
            case["floor_pct"] = 100 * floor_ms / case["ms"]
            case["cold_floor_pct"] = 100 * floor_ms / case["cold_ms"]
            results["cases"].append(case)
            print(f"{mode:11s} {tokens:6d} x {n:<6d} {case['ms'] * 1e3:8.1f} us ({case['floor_pct']:5.1f}%), cold "
                  f"{case['cold_ms'] * 1e3:8.1f} us ({case['cold_floor_pct']:5.1f}%); plain "
                  f"{case['plain_ms'] * 1e3:8.1f}; torch.compile {case['compile_ms'] * 1e3:8.1f}, cold "
                  f"{case['compile_cold_ms'] * 1e3:8.1f}; codes equal {agree:.5f}", flush=True)


def host_time(results):
    """us per cached call at 1x4096 (loops of 2000, best of three), and
    what torch's allocation of one more output costs (new_empty, as the
    launch cache allocates q and the scales)."""
    x = torch.randn(1, 4096, device=DEVICE, dtype=torch.bfloat16)
    w = torch.rand(4096, device=DEVICE, dtype=torch.bfloat16)
    calls = (("plain", lambda: cunorm.rms_norm(x, w)),
             ("quantized", lambda: cunorm.rms_norm(x, w, quantize="float8_e4m3fn")),
             ("group", lambda: cunorm.rms_norm(x, w, quantize="float8_e4m3fn", quant_group=GROUP)),
             ("new_empty", lambda: x.new_empty((1, 1), dtype=torch.float32)))
    for name, fn in calls:
        for _ in range(200):
            fn()
        best = float("inf")
        for _ in range(3):
            torch.cuda.synchronize()
            start = time.perf_counter()
            for _ in range(2000):
                fn()
            torch.cuda.synchronize()
            best = min(best, (time.perf_counter() - start) / 2000 * 1e6)
        results[f"host_us_{name}"] = best
        print(f"host time per call, 1x4096, {name}: {best:.1f} us")


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2:] or list(MODES))
