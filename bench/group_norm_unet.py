"""GroupNorm(32) on a diffusion UNet's shapes, bf16 with weight and bias, with
and without a fused SiLU, x channels-last (torch's channels_last memory) and
channels-first: cunorm.torch against torch eager and torch.compile (each
case compiled afresh, static shapes) of F.silu(F.group_norm(...)), GPU time
(busy fill) in us, the walk cunorm took, and cunorm's largest error against
torch in float32, relative to the output's largest magnitude.

PYTHONPATH=. python bench/group_norm_unet.py [--only TEXT]"""
import argparse

import torch
import torch.nn.functional as F

import cunorm.torch as ct
from cunorm._engine import channel_norms, plans
from cunorm._interop.torch import to_cupy
from cunorm.bench._timing import compile_static, copy_bandwidth, time_gpu

EPS = 1e-5
#: (N, C, H, W), with SiLU
CASES = [((16, 320, 64, 64), True), ((8, 320, 64, 64), False), ((8, 512, 128, 128), False),
         ((8, 512, 128, 128), True), ((8, 640, 32, 32), False), ((8, 1280, 16, 16), False),
         ((2, 1280, 32, 32), True)]


def walk_of(x, w, b, silu):
    """The walk cunorm's dispatch takes for the call."""
    call = channel_norms.ChannelCall("group", to_cupy(x), num_groups=32, weight=to_cupy(w), bias=to_cupy(b),
                                     eps=EPS, channel_axis=1, epilogue=plans.activation_flags("silu") if silu else 0)
    return channel_norms.execute(call, *channel_norms.prepare(call))[0]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--only", default="")
    args = ap.parse_args()
    torch.manual_seed(0)
    print(f"copy {copy_bandwidth():.0f} GB/s\n")
    print("| x | walk | cunorm | torch.compile | torch eager | max rel err |")
    print("|---|---|---|---|---|---|")
    for shape, silu in CASES:
        for last in (True, False):
            name = f"{shape}{' +SiLU' if silu else ''}, {'channels-last' if last else 'channels-first'}"
            if args.only not in name:
                continue
            x = torch.randn(*shape, device="cuda", dtype=torch.bfloat16)
            if last:
                x = x.to(memory_format=torch.channels_last)
            w, b = (torch.randn(shape[1], device="cuda", dtype=torch.bfloat16) for _ in range(2))

            def formula(x, w, b):
                y = F.group_norm(x, 32, w, b, EPS)
                return F.silu(y) if silu else y

            def ours():
                return ct.group_norm(x, 32, w, b, eps=EPS, activation="silu" if silu else None)

            compiled = compile_static(formula)
            want = formula(x.float(), w.float(), b.float())
            err = ((ours().float() - want).abs().max() / want.abs().max()).item()
            times = [time_gpu(fn, reps=30)[0] * 1e3
                     for fn in (ours, lambda: compiled(x, w, b), lambda: formula(x, w, b))]
            print(f"| {name} | {walk_of(x, w, b, silu)} | " + " | ".join(f"{t:.1f}" for t in times) +
                  f" | {err:.1e} |", flush=True)


if __name__ == "__main__":
    main()
