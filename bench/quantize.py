"""The quantize= sweep: rms_norm of bf16 x with an FP8 (e4m3fn) output,
scaled per row and per group of 128 (scales column-major, padded for TMA),
against torch.compile of the same ops (RMSNorm in float32, then max|y| /
448 over the row or group, floored, and the cast), at the hidden sizes and
token counts of LLM inference. GPU time (back-to-back calls), one call with
L2 flushed first, floor% of copy bandwidth measured in the same run (x
read, one byte written per element, the weight and the scales), the plain
bf16-out rms_norm beside it, the share of FP8 codes equal to
torch.compile's, and host time per cached call at decode size.

    PYTHONPATH=. python bench/quantize.py OUT.json [row|group ...]
"""
import json
import sys
import time

import torch

import cunorm

EPS = 1e-6
DEVICE = "cuda"


def gpu_time(fn, reps=30):
    fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / reps


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
    return 2 * src.numel() / gpu_time(lambda: dst.copy_(src), 10) / 1e6


GROUP = 128
#: quantize='s keywords of each mode
MODES = {"row": {}, "group": {"quant_group": GROUP, "quant_scale_layout": "column_major_tma"}}


def torch_quantized(x, w, group=None):
    y = torch.nn.functional.rms_norm(x.float(), (x.shape[-1],), w.float(), EPS)
    if group:
        y = y.unflatten(-1, (-1, group))
    scale = (y.abs().amax(-1, keepdim=True) / 448.0).clamp(min=1.0 / (448.0 * 512.0))
    q = (y / scale).clamp(-448.0, 448.0).to(torch.float8_e4m3fn)
    return (q.flatten(-2), scale[..., 0]) if group else (q, scale)


def main(out_path, modes):
    copy_gbps = copy_bandwidth()
    compiled = torch.compile(torch_quantized)
    results = {"gpu": torch.cuda.get_device_name(), "copy_gbps": copy_gbps, "cases": []}
    print(f"{results['gpu']}: copy {copy_gbps:.0f} GB/s")
    with torch.no_grad():
        for mode in modes:
            sweep(results, mode, compiled, copy_gbps)
        host_time(results)
    with open(out_path, "w") as f:
        json.dump(results, f, indent=1)


def sweep(results, mode, compiled, copy_gbps):
    group = MODES[mode].get("quant_group")
    for n in (2048, 4096, 7168, 8192, 16384):
        for tokens in (1, 64, 4096, 32768):
            x = torch.randn(tokens, n, device=DEVICE, dtype=torch.bfloat16)
            w = torch.rand(n, device=DEVICE, dtype=torch.bfloat16) + 0.5
            ours = lambda: cunorm.rms_norm(x, w, eps=EPS, quantize="float8_e4m3fn", **MODES[mode])  # noqa: E731
            theirs = lambda: compiled(x, w, group)  # noqa: E731
            q, _ = ours()
            agree = (q.float() == theirs()[0].float()).float().mean().item()
            scales = tokens * (n // group if group else 1)
            floor_ms = (tokens * n * 3 + 2 * n + 4 * scales) / copy_gbps / 1e6
            case = {"mode": mode, "tokens": tokens, "n": n, "ms": gpu_time(ours), "cold_ms": cold_time(ours),
                    "plain_ms": gpu_time(lambda: cunorm.rms_norm(x, w, eps=EPS)),
                    "compile_ms": gpu_time(theirs), "compile_cold_ms": cold_time(theirs), "agree": agree}
            case["floor_pct"] = 100 * floor_ms / case["ms"]
            case["cold_floor_pct"] = 100 * floor_ms / case["cold_ms"]
            results["cases"].append(case)
            print(f"{mode:5s} {tokens:6d} x {n:<6d} {case['ms'] * 1e3:8.1f} us ({case['floor_pct']:5.1f}%), cold "
                  f"{case['cold_ms'] * 1e3:8.1f} us ({case['cold_floor_pct']:5.1f}%); plain "
                  f"{case['plain_ms'] * 1e3:8.1f}; torch.compile {case['compile_ms'] * 1e3:8.1f}, cold "
                  f"{case['compile_cold_ms'] * 1e3:8.1f}; codes equal {agree:.5f}", flush=True)


def host_time(results):
    x = torch.randn(1, 4096, device=DEVICE, dtype=torch.bfloat16)
    w = torch.rand(4096, device=DEVICE, dtype=torch.bfloat16)
    for name, fn in (("plain", lambda: cunorm.rms_norm(x, w)),
                     ("quantized", lambda: cunorm.rms_norm(x, w, quantize="float8_e4m3fn")),
                     ("group", lambda: cunorm.rms_norm(x, w, quantize="float8_e4m3fn", quant_group=GROUP))):
        for _ in range(200):
            fn()
        torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(2000):
            fn()
        torch.cuda.synchronize()
        results[f"host_us_{name}"] = (time.perf_counter() - start) / 2000 * 1e6
        print(f"host time per call, 1x4096, {name}: {results[f'host_us_{name}']:.1f} us")


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2:] or list(MODES))
