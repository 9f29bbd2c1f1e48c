"""How fast are the conditioned norms' backwards? DiT's adaLN-Zero step,
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
and the per-sample arrays once; beside it the floor% of a bare copy of
the same bytes timed the same way (the bound at that size: at 4096 tokens
a kernel's launch and ramp weigh). And the gated RMSNorm with a weight over
whole rows (``norm(x) * w * silu(z)``, Qwen3-Next's form; ``norm(x *
silu(z)) * w``, Mamba-2's with one group), over heads of 128
(Qwen3-Next's) and over 8 groups with a weight a group (Mamba-2's with
ngroups 8, the gate before the norm), counting dy, x and z read and dx and dz written: cunorm's
fused route (GatedRowNorm in eager; under torch.compile the conditioned
operator and rms_norm_gated_backward) against torch eager and
torch.compile of the formula. And the float32 residual stream (bf16 x, a
float32 residual, RMSNorm with a weight; y in bf16, h float32 returned,
dh in float32), counting dy, h and dh read, dx (bf16) and the residual's
gradient (float32) written: WideRowNorm in eager, under torch.compile the
plain operator and rms_norm_float32_residual_backward.

    PYTHONPATH=. python bench/conditioned_backward.py OUT.json [CASE,...]
"""
import json
import sys

import torch
import torch._functorch.config

import cunorm.torch as ct
from cunorm.bench._timing import compile_static, copy_bandwidth, time_gpu

# the forward bench's formulas, cold-call timing and EPS (bench/ is on the path when run as a script)
from conditioned import (EPS, _rms, adaln_torch, cold, gated_groups_torch, gated_torch, rms_mod_torch,  # noqa: E402
                         rms_res32_torch)

# (the backward is timed repeatedly on one recorded graph: retain_graph, which
# torch.compile's donated buffers refuse)
torch._functorch.config.donated_buffer = False


def adaln_cunorm(x, r, shift, scale, gate):
    return ct.layer_norm(x, residual=r, shift=shift, scale=scale, residual_gate=gate, eps=EPS)


def rms_mod_cunorm(x, w, shift, scale):
    return ct.rms_norm(x, w, shift=shift, scale=scale, eps=EPS)


def gated_input_torch(x, z, w):
    return (_rms(x.float() * torch.nn.functional.silu(z.float())) * w.float()).to(x.dtype)


def gated_cunorm(x, z, w):
    return ct.rms_norm(x, w, gate=z, eps=EPS)


def gated_input_cunorm(x, z, w):
    return ct.rms_norm(x, w, gate=z, norm_before_gate=False, eps=EPS)


def gated_groups_cunorm(x, z, w):
    return ct.rms_norm(x, w, gate=z, norm_before_gate=False, group_size=x.shape[-1] // 8, eps=EPS)


def rms_res32_cunorm(x, r, w):
    return ct.rms_norm(x, w, residual=r, eps=EPS)


def _heads(fn):
    """fn over heads of 128: x and z viewed as (..., hidden / 128, 128), a weight of 128."""
    return lambda x, z, w: fn(x.unflatten(-1, (-1, 128)), z.unflatten(-1, (-1, 128)), w).flatten(-2)


FUSED = {"adaln": "ModulatedRowNorm", "rms_mod": "ModulatedRowNorm", "gated": "GatedRowNorm",
         "gated_input": "GatedRowNorm", "gated_heads": "GatedRowNorm", "gated_groups": "GatedRowNorm",
         "res32": "WideRowNorm"}


def _backward(forward, inputs, grads):
    """A function running the backward of forward(*inputs) (recorded once,
    kept) with the output gradients ``grads``."""
    leaves = [a.detach().requires_grad_() for a in inputs]
    out = forward(*leaves)
    outs = list(out) if isinstance(out, tuple) else [out]
    return lambda: torch.autograd.grad(outs, leaves, grads[:len(outs)], retain_graph=True), outs, leaves


def main(out, only=None):
    copy = copy_bandwidth()
    rows = []
    formulas = {"adaln": (adaln_cunorm, adaln_torch), "rms_mod": (rms_mod_cunorm, rms_mod_torch),
                "gated": (gated_cunorm, gated_torch), "gated_input": (gated_input_cunorm, gated_input_torch),
                "gated_heads": (_heads(gated_cunorm), _heads(gated_torch)),
                "gated_groups": (gated_groups_cunorm, gated_groups_torch), "res32": (rms_res32_cunorm, rms_res32_torch)}
    names = [n for n in formulas if only is None or n in only]
    for hidden in (1152, 3072, 4096, 8192):
        for tokens in (4096, 32768):
            batch = 8
            shape = (batch, tokens // batch, hidden)
            g = torch.Generator(device="cuda").manual_seed(0)
            x, r, dy, dh, z = (torch.randn(shape, device="cuda", generator=g, dtype=torch.bfloat16)
                               for _ in range(5))
            shift, scale, gate = (torch.randn(batch, 1, hidden, device="cuda", generator=g,
                                              dtype=torch.bfloat16) * 0.5 for _ in range(3))
            w = torch.randn(hidden, device="cuda", generator=g, dtype=torch.bfloat16)
            w_head = w[:128].clone()
            r32, dh32 = r.float() * 8, dh.float()
            per_sample = batch * hidden * 2  # (one array of them)
            cases = {  # name: (inputs, output gradients, bytes counted)
                "adaln": ((x, r, shift, scale, gate), (dy, dh), 6 * x.numel() * 2 + 5 * per_sample),
                "rms_mod": ((x, w, shift, scale), (dy,), 3 * x.numel() * 2 + 4 * per_sample),
                "gated": ((x, z, w), (dy,), 5 * x.numel() * 2 + 2 * hidden * 2),
                "gated_input": ((x, z, w), (dy,), 5 * x.numel() * 2 + 2 * hidden * 2),
                "gated_heads": ((x, z, w_head), (dy,), 5 * x.numel() * 2 + 2 * 128 * 2),
                "gated_groups": ((x, z, w), (dy,), 5 * x.numel() * 2 + 2 * hidden * 2),
                "res32": ((x, r32, w), (dy, dh32), 16 * x.numel() + 2 * hidden * 2),
            }
            for name in names:
                inputs, grads, nbytes = cases[name]
                ours, theirs = formulas[name]
                fns = {"cunorm": ours, "eager": theirs, "compile": compile_static(theirs),
                       "cunorm_compile": compile_static(ours)}
                runs = {label: _backward(fn, inputs, grads) for label, fn in fns.items()}
                got, want = runs["cunorm"][0](), runs["eager"][0]()
                node = runs["cunorm"][1][0].grad_fn
                while "View" in type(node).__name__:  # (the heads' flatten)
                    node = node.next_functions[0][0]
                assert FUSED[name] in type(node).__name__, type(node).__name__
                err = max(float((a.float() - b.float()).abs().max() / b.float().abs().max().clamp_min(1e-30))
                          for a, b in zip(got, want))
                row = {"case": name, "shape": list(shape), "hidden": hidden, "tokens": tokens, "max_rel_err": err}
                # (the compiled graph calls the same kernels: its gradients are the eager route's)
                row["compiled_equal"] = all(torch.equal(a, b) for a, b in zip(runs["cunorm_compile"][0](), got))
                for label, (fn, _, _) in runs.items():
                    row[f"{label}_gpu_ms"] = time_gpu(fn)[0]
                    row[f"{label}_cold_ms"] = cold(fn)
                row["floor_pct"] = 100 * nbytes / (row["cunorm_gpu_ms"] * 1e-3) / 1e9 / copy
                # the bound at this size: a bare copy of the same bytes, timed the same way
                src = torch.empty(nbytes // 2, dtype=torch.uint8, device="cuda")
                dst = torch.empty_like(src)
                row["copy_gpu_ms"] = time_gpu(lambda: dst.copy_(src))[0]
                row["copy_floor_pct"] = 100 * nbytes / (row["copy_gpu_ms"] * 1e-3) / 1e9 / copy
                del src, dst
                rows.append(row)
                compiled = f"compiled {row['cunorm_compile_gpu_ms']*1e3:8.1f} "
                print(f"{name:11s} {str(shape):18s} gpu {row['cunorm_gpu_ms']*1e3:8.1f} us ({row['floor_pct']:5.1f}%; "
                      f"copy {row['copy_floor_pct']:5.1f}%) "
                      f"{compiled}eager {row['eager_gpu_ms']*1e3:8.1f} compile {row['compile_gpu_ms']*1e3:8.1f} | "
                      f"cold {row['cunorm_cold_ms']*1e3:8.1f} eager {row['eager_cold_ms']*1e3:8.1f} compile "
                      f"{row['compile_cold_ms']*1e3:8.1f} | err {err:.1e}", flush=True)
                del runs
    with open(out, "w") as f:
        json.dump({"gpu": torch.cuda.get_device_name(), "copy_gbps": copy, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "conditioned_backward.json",
         sys.argv[2].split(",") if len(sys.argv) > 2 else None)
