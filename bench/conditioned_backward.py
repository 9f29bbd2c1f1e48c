"""How fast are the modulated norms' backwards? DiT's adaLN-Zero step,
``h = residual + gate * x; y = LayerNorm(h) * (1 + scale) + shift`` (no
affine; shift, scale and gate per sample, (B, 1, H); h returned, its
gradient dh flowing on), and the modulated RMSNorm with a weight (shift
and scale per sample), bf16, hidden 1152-8192, 4096 and 32768 tokens in
batches of 8: the backward alone (``torch.autograd.grad`` of the recorded
forward, with dy and dh given) of cunorm.torch's fused route, eager and
under torch.compile (the registered operators), against torch eager and
torch.compile of the same formula. GPU time (busy fill), one
call with L2 flushed (cold), floor% of copy bandwidth measured in the
same run, counting dy, h, x and dh read, dx and the residual's gradient
written (adaLN-Zero; the modulated RMSNorm: dy and x read, dx written),
and the per-sample arrays once.

    PYTHONPATH=. python bench/conditioned_backward.py OUT.json
"""
import json
import sys

import torch
import torch._functorch.config

import cunorm.torch as ct
from cunorm.bench._timing import compile_static, copy_bandwidth, time_gpu

# the forward bench's formulas, cold-call timing and EPS (bench/ is on the path when run as a script)
from conditioned import EPS, adaln_torch, cold, rms_mod_torch  # noqa: E402

# (the backward is timed repeatedly on one recorded graph: retain_graph, which
# torch.compile's donated buffers refuse)
torch._functorch.config.donated_buffer = False


def adaln_cunorm(x, r, shift, scale, gate):
    return ct.layer_norm(x, residual=r, shift=shift, scale=scale, residual_gate=gate, eps=EPS)


def rms_mod_cunorm(x, w, shift, scale):
    return ct.rms_norm(x, w, shift=shift, scale=scale, eps=EPS)


def _backward(forward, inputs, grads):
    """A function running the backward of forward(*inputs) (recorded once,
    kept) with the output gradients ``grads``."""
    leaves = [a.detach().requires_grad_() for a in inputs]
    out = forward(*leaves)
    outs = list(out) if isinstance(out, tuple) else [out]
    return lambda: torch.autograd.grad(outs, leaves, grads[:len(outs)], retain_graph=True), outs, leaves


def main(out):
    copy = copy_bandwidth()
    rows = []
    for hidden in (1152, 3072, 4096, 8192):
        for tokens in (4096, 32768):
            compiled = {name: compile_static(fn) for name, fn in (
                ("adaln", adaln_torch), ("rms_mod", rms_mod_torch), ("adaln_cunorm", adaln_cunorm),
                ("rms_mod_cunorm", rms_mod_cunorm))}
            batch = 8
            shape = (batch, tokens // batch, hidden)
            g = torch.Generator(device="cuda").manual_seed(0)
            x, r, dy, dh = (torch.randn(shape, device="cuda", generator=g, dtype=torch.bfloat16) for _ in range(4))
            shift, scale, gate = (torch.randn(batch, 1, hidden, device="cuda", generator=g,
                                              dtype=torch.bfloat16) * 0.5 for _ in range(3))
            w = torch.randn(hidden, device="cuda", generator=g, dtype=torch.bfloat16)
            per_sample = batch * hidden * 2  # (one array of them)
            cases = {
                "adaln": ((adaln_cunorm, compiled["adaln_cunorm"], adaln_torch, compiled["adaln"]),
                          (x, r, shift, scale, gate), (dy, dh), 6 * x.numel() * 2 + 5 * per_sample),
                "rms_mod": ((rms_mod_cunorm, compiled["rms_mod_cunorm"], rms_mod_torch, compiled["rms_mod"]),
                            (x, w, shift, scale), (dy,), 3 * x.numel() * 2 + 4 * per_sample),
            }
            for name, (fns, inputs, grads, nbytes) in cases.items():
                labels = ("cunorm", "cunorm_compile", "eager", "compile")
                runs = {label: _backward(fn, inputs, grads) for label, fn in zip(labels, fns)}
                got, want = runs["cunorm"][0](), runs["eager"][0]()
                assert "ModulatedRowNorm" in type(runs["cunorm"][1][0].grad_fn).__name__
                err = max(float((a.float() - b.float()).abs().max() / b.float().abs().max().clamp_min(1e-30))
                          for a, b in zip(got, want))
                # (the compiled graph calls the same kernels: its gradients are the eager route's)
                same = all(torch.equal(a, b) for a, b in zip(runs["cunorm_compile"][0](), got))
                row = {"case": name, "shape": list(shape), "hidden": hidden, "tokens": tokens, "max_rel_err": err,
                       "compiled_equal": same}
                for label, (fn, _, _) in runs.items():
                    row[f"{label}_gpu_ms"] = time_gpu(fn)[0]
                    row[f"{label}_cold_ms"] = cold(fn)
                row["floor_pct"] = 100 * nbytes / (row["cunorm_gpu_ms"] * 1e-3) / 1e9 / copy
                rows.append(row)
                print(f"{name:8s} {str(shape):18s} gpu {row['cunorm_gpu_ms']*1e3:8.1f} us ({row['floor_pct']:5.1f}%) "
                      f"compiled {row['cunorm_compile_gpu_ms']*1e3:8.1f} eager {row['eager_gpu_ms']*1e3:8.1f} "
                      f"compile {row['compile_gpu_ms']*1e3:8.1f} | cold {row['cunorm_cold_ms']*1e3:8.1f} compiled "
                      f"{row['cunorm_compile_cold_ms']*1e3:8.1f} eager {row['eager_cold_ms']*1e3:8.1f} compile "
                      f"{row['compile_cold_ms']*1e3:8.1f} | err {err:.1e} same {same}", flush=True)
                del runs
    with open(out, "w") as f:
        json.dump({"gpu": torch.cuda.get_device_name(), "copy_gbps": copy, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "conditioned_backward.json")
