"""The models suite: whole timm and Hugging Face models (built from configs,
random weights, no downloads) and a diffusion-style GroupNorm + SiLU block
stack, each timed untouched and after ``cunorm.torch.replace_norms``.

Modes: eval forward in float32 and under bf16 autocast; one training step
(forward, backward) in float32 and under bf16 autocast; with torch.compile,
the autocast eval forward and training step of both. A mode's time is the
median of CUDA-event timings of one call each, after warm-up; the two
versions of a model run alternately so drift favours neither. The share of
the untouched model's time spent in its norm layers says what norms can
give at most: 1 - time(the model with those layers made identities) /
time(the model) (a norm written as several elementwise ops, as
transformers' RMSNorms are, has no kernel of its own to profile).
"""
from __future__ import annotations

import contextlib
import copy
import statistics

MODES = ("eval fp32", "eval bf16 autocast", "train fp32", "train bf16 autocast")
COMPILE_MODES = ("eval bf16 autocast", "train bf16 autocast")


def _timm(name, batch, size=224):
    def build():
        import timm
        import torch

        model = timm.create_model(name, pretrained=False)
        return model, lambda: torch.randn(batch, 3, size, size, device="cuda")
    return build


def _hf(family, batch, seq, **config):
    def build():
        import torch
        import transformers

        if family == "bert":
            model = transformers.BertModel(transformers.BertConfig(**config))
        else:
            cls = {"llama": transformers.LlamaConfig, "qwen2": transformers.Qwen2Config}[family]
            model = transformers.AutoModelForCausalLM.from_config(cls(**config), attn_implementation="sdpa")
        vocab = config["vocab_size"]

        class Wrapped(torch.nn.Module):
            def __init__(self, inner):
                super().__init__()
                self.inner = inner

            def forward(self, ids):
                out = self.inner(input_ids=ids)
                return out.logits if hasattr(out, "logits") else out.last_hidden_state

        return Wrapped(model), lambda: torch.randint(0, vocab, (batch, seq), device="cuda")
    return build


def _unet(batch, channels, size, blocks):
    def build():
        import torch

        class ResBlock(torch.nn.Module):
            def __init__(self, c):
                super().__init__()
                self.norm1, self.norm2 = torch.nn.GroupNorm(32, c), torch.nn.GroupNorm(32, c)
                self.conv1 = torch.nn.Conv2d(c, c, 3, padding=1)
                self.conv2 = torch.nn.Conv2d(c, c, 3, padding=1)

            def forward(self, x):
                h = self.conv1(torch.nn.functional.silu(self.norm1(x)))
                return x + self.conv2(torch.nn.functional.silu(self.norm2(h)))

        model = torch.nn.Sequential(*[ResBlock(channels) for _ in range(blocks)])
        return model, lambda: torch.randn(batch, channels, size, size, device="cuda")
    return build


def models(quick: bool) -> list[tuple[str, object]]:
    """(label, builder) of each model of the suite."""
    if quick:
        return [("timm resnet50 b8", _timm("resnet50", 8)),
                ("transformers llama 2L h512 b2x128", _hf("llama", 2, 128, hidden_size=512, intermediate_size=1024,
                                                          num_hidden_layers=2, num_attention_heads=8,
                                                          num_key_value_heads=4, vocab_size=1000))]
    llm = dict(num_hidden_layers=4, vocab_size=32000)
    return [("timm resnet50 b32", _timm("resnet50", 32)),
            ("timm convnext_tiny b32", _timm("convnext_tiny", 32)),
            ("timm vit_small_patch16_224 b64", _timm("vit_small_patch16_224", 64)),
            ("timm resnetv2_50x1_bit b16", _timm("resnetv2_50x1_bit", 16)),
            ("transformers llama 4L h1024 b4x512", _hf("llama", 4, 512, hidden_size=1024, intermediate_size=2816,
                                                       num_attention_heads=16, num_key_value_heads=8, **llm)),
            ("transformers qwen2 4L h896 b4x512", _hf("qwen2", 4, 512, hidden_size=896, intermediate_size=4864,
                                                      num_attention_heads=14, num_key_value_heads=2, **llm)),
            ("transformers bert 4L h768 b8x512", _hf("bert", 8, 512, hidden_size=768, intermediate_size=3072,
                                                     num_hidden_layers=4, num_attention_heads=12, vocab_size=30522)),
            ("unet GroupNorm(32)+SiLU blocks (8,320,64,64)", _unet(8, 320, 64, 4))]


def _step(model, make_input, mode, compiled):
    """A function running one call of ``mode`` on ``model``."""
    import torch

    train = mode.startswith("train")
    model.train(train)
    cast = torch.autocast("cuda", dtype=torch.bfloat16) if "autocast" in mode else contextlib.nullcontext()
    x = make_input()
    fn = torch.compile(model) if compiled else model
    if not train:
        def run():
            with torch.no_grad(), cast:
                fn(x)
        return run
    params = [p for p in model.parameters() if p.requires_grad]

    def run():
        with cast:
            out = fn(x)
        out.float().square().mean().backward()
        for p in params:
            p.grad = None
    return run


def _time(runs: dict, repeats: int) -> dict:
    """Median ms of one call of each function, called alternately."""
    import torch

    for fn in runs.values():  # warm-up (compiles, autotunes, allocator)
        for _ in range(3):
            fn()
    torch.cuda.synchronize()
    times = {k: [] for k in runs}
    for _ in range(repeats):
        for k, fn in runs.items():
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times[k].append(start.elapsed_time(end))
    return {k: statistics.median(v) for k, v in times.items()}


def without_norms(model, replaced_names):
    """A copy of ``model`` whose replaced norm layers are identities."""
    import torch

    bare = copy.deepcopy(model)
    for name in replaced_names:
        if not name:
            continue
        parent_name, _, child = name.rpartition(".")
        parent = bare.get_submodule(parent_name) if parent_name else bare
        setattr(parent, child, torch.nn.Identity())
    return bare


def rows(quick: bool = False, with_compile: bool = True, only: str = "") -> list[dict]:
    """One row per (model, mode, compiled): torch's and cunorm's ms, the
    speedup, the norm kernels' share of the untouched model's time, what
    replace_norms replaced. ``only``: the rows whose "model mode" contains
    this text (or one of its comma-separated parts)."""
    import torch

    from .. import torch as cunorm_torch

    repeats = 5 if quick else 20
    out = []
    for label, build in models(quick):
        modes = [(m, False) for m in MODES] + ([(m, True) for m in COMPILE_MODES] if with_compile else [])
        modes = [(m, c) for m, c in modes
                 if any(part in f"{label} {m}{' compiled' if c else ''}" for part in only.split(","))]
        if not modes:
            continue
        try:
            model, make_input = build()
        except ImportError as err:  # timm or transformers not installed
            out.append({"model": label, "mode": "", "skipped": str(err)})
            continue
        torch.manual_seed(0)
        theirs = model.cuda()
        ours = copy.deepcopy(theirs)
        report = cunorm_torch.replace_norms(ours, report=True)
        bare = without_norms(theirs, report.replaced)
        for mode, compiled in modes:
            row = {"model": label, "mode": mode + (" compiled" if compiled else ""),
                   "replaced": len(report.replaced), "left": len(report.left)}
            try:
                runs = {"torch": _step(theirs, make_input, mode, compiled),
                        "cunorm": _step(ours, make_input, mode, compiled)}
                if not compiled:
                    runs["no norms"] = _step(bare, make_input, mode, compiled)
                ms = _time(runs, repeats)
                row.update(torch_ms=ms["torch"], cunorm_ms=ms["cunorm"], speedup=ms["torch"] / ms["cunorm"])
                if not compiled:
                    row["norm_share"] = max(0.0, 1 - ms["no norms"] / ms["torch"])
            except Exception as err:  # noqa: BLE001  (a row says what failed; the suite goes on)
                row["skipped"] = f"{type(err).__name__}: {err}"[:300]
            out.append(row)
            torch.cuda.empty_cache()
        del model, theirs, ours, bare
        torch.cuda.empty_cache()
    return out


def format_rows(rows_: list[dict]) -> list[list[str]]:
    table = []
    for r in rows_:
        if r.get("skipped"):
            table.append([r["model"], r.get("mode", ""), "skipped: " + r["skipped"], "", "", "", ""])
            continue
        share = r.get("norm_share")
        table.append([r["model"], r["mode"], f"{r['torch_ms']:.2f}", f"{r['cunorm_ms']:.2f}", f"{r['speedup']:.2f}",
                      "" if share is None else f"{100 * share:.1f}", f"{r['replaced']}/{r['left']}"])
    return table


TITLES = ["model", "mode", "torch ms", "cunorm ms", "speedup", "norm share %", "replaced/left"]
