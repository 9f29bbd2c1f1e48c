"""What do dependent launches save? Calls of several launches (the
modulated backwards, GroupNorm forward and backward, BatchNorm in
training) and calls of one (row forwards and backwards, the gated and
float32-stream backwards), bf16, each timed (GPU time under the busy
fill, the median of 40 calls) in processes that alternate Programs built
with dependent launches ("on") and without ("off",
``cunorm._engine.launches.dependent_launch = False``). It checks that
every output and gradient is bitwise the same in both builds.

    PYTHONPATH=. python bench/tools/dependent_launch.py OUT_DIR [--runs 3] [--only PREFIX,...]

A process of one build: ``... dependent_launch.py OUT_DIR --build on|off``.
"""
import argparse
import collections
import os
import subprocess
import sys

EPS = 1e-6


def _cases(torch, ct):
    """name -> a function running the call (a backward: its recorded
    forward's torch.autograd.grad)."""
    bf = torch.bfloat16

    def t(*shape, dtype=bf):
        return torch.randn(*shape, device="cuda", dtype=dtype)

    def grad_fn(f, inputs, grads):
        leaves = [a.detach().requires_grad_() for a in inputs]
        out = f(*leaves)
        outs = list(out) if isinstance(out, tuple) else [out]
        return lambda: torch.autograd.grad(outs, leaves, grads[:len(outs)], retain_graph=True)

    cases = {}
    for tokens, hidden in ((4096, 4096), (32768, 1024)):
        x, w = t(tokens, hidden), t(hidden)
        cases[f"rms_fwd {tokens}x{hidden}"] = lambda x=x, w=w: (ct.rms_norm(x, w, eps=EPS),)
    for tokens, hidden in ((4096, 1152), (4096, 4096), (65536, 1024)):
        x, w, b, dy = t(tokens, hidden), t(hidden), t(hidden), t(tokens, hidden)
        cases[f"rms_bwd {tokens}x{hidden}"] = grad_fn(lambda x, w: ct.rms_norm(x, w, eps=EPS), (x, w), (dy,))
        cases[f"ln_bwd {tokens}x{hidden}"] = grad_fn(lambda x, w, b: ct.layer_norm(x, w, b, eps=EPS), (x, w, b), (dy,))
    for tokens, hidden in ((4096, 1152), (4096, 3072), (32768, 3072)):
        batch = 8
        shape = (batch, tokens // batch, hidden)
        x, r, dy, dh, z = (t(*shape) for _ in range(5))
        shift, scale, gate = (t(batch, 1, hidden) * 0.5 for _ in range(3))
        w = t(hidden)
        cases[f"adaln {tokens}x{hidden}"] = grad_fn(
            lambda x, r, sh, sc, g: ct.layer_norm(x, residual=r, shift=sh, scale=sc, residual_gate=g, eps=EPS),
            (x, r, shift, scale, gate), (dy, dh))
        cases[f"rms_mod {tokens}x{hidden}"] = grad_fn(
            lambda x, w, sh, sc: ct.rms_norm(x, w, shift=sh, scale=sc, eps=EPS), (x, w, shift, scale), (dy,))
        cases[f"gated {tokens}x{hidden}"] = grad_fn(
            lambda x, z, w: ct.rms_norm(x, w, gate=z, eps=EPS), (x, z, w), (dy,))
        cases[f"res32 {tokens}x{hidden}"] = grad_fn(
            lambda x, r, w: ct.rms_norm(x, w, residual=r, eps=EPS), (x, r.float(), w), (dy, dh.float()))
    for shape in ((8, 512, 64, 64), (16, 320, 64, 64), (2, 1280, 32, 32)):
        x, w, b, dy = t(*shape), t(shape[1]), t(shape[1]), t(*shape)
        cases[f"gn_fwd {shape}"] = lambda x=x, w=w, b=b: (ct.group_norm(x, 32, w, b, eps=EPS),)
        cases[f"gn_bwd {shape}"] = grad_fn(lambda x, w, b: ct.group_norm(x, 32, w, b, eps=EPS), (x, w, b), (dy,))
    x, w, b, dy = t(32, 256, 28, 28), t(256), t(256), t(32, 256, 28, 28)
    cases["bn_train_fwd (32,256,28,28)"] = lambda: (ct.batch_norm(x, w, b, training=True, eps=1e-5),)
    cases["bn_bwd (32,256,28,28)"] = grad_fn(lambda x, w, b: ct.batch_norm(x, w, b, training=True, eps=1e-5),
                                             (x, w, b), (dy,))
    return cases


def run_build(build: str, out: str, only) -> None:
    """One process of one build: times every case, saves its results."""
    import torch

    import cunorm.torch as ct
    from cunorm._engine import launches
    from cunorm.bench._timing import time_gpu

    launches.dependent_launch = build == "on"
    torch.manual_seed(0)  # (the same data in both builds)
    results = {}
    for name, fn in _cases(torch, ct).items():
        if only and not any(name.startswith(prefix) for prefix in only):
            continue
        results[name] = [a.detach().cpu() for a in fn()]
        ms, lo, hi = time_gpu(fn, reps=40)
        print(f"{build} {name} | {ms * 1e3:.2f} {lo * 1e3:.2f} {hi * 1e3:.2f}", flush=True)
    torch.save(results, os.path.join(out, f"results_{build}.pt"))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--only", default="")
    ap.add_argument("--build", choices=("on", "off"))
    args = ap.parse_args()
    only = [p for p in args.only.split(",") if p]
    os.makedirs(args.out, exist_ok=True)
    if args.build:
        run_build(args.build, args.out, only)
        return
    medians = collections.defaultdict(lambda: collections.defaultdict(list))
    for _ in range(args.runs):
        for build in ("off", "on"):
            cmd = [sys.executable, __file__, args.out, "--build", build, "--only", args.only]
            lines = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout.splitlines()
            for line in lines:
                head, _, times = line.partition(" | ")
                name = head.split(" ", 1)[1]
                medians[name][build].append(float(times.split()[0]))
    import torch

    got = {build: torch.load(os.path.join(args.out, f"results_{build}.pt")) for build in ("off", "on")}
    differ = [name for name, off in got["off"].items()
              if not all(torch.equal(a, b) for a, b in zip(off, got["on"][name]))]
    print("| call | plain (medians, us) | dependent | speedup (least) |\n|---|---|---|---|")
    for name, by in medians.items():
        off, on = sorted(by["off"]), sorted(by["on"])
        print(f"| {name} | {', '.join(f'{v:.1f}' for v in off)} | {', '.join(f'{v:.1f}' for v in on)} | "
              f"{off[0] / on[0]:.3f}x |")
    print("bitwise the same in both builds" if not differ else f"DIFFERENT: {differ}")
    if differ:
        sys.exit(1)


if __name__ == "__main__":
    main()
