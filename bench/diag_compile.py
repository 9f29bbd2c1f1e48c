"""torch.compile over cunorm's layers: graph breaks (dynamo's explain) in
models after replace_norms, and the host time of one registered operator
call from a compiled graph against torch's own layer compiled.
PYTHONPATH=. python bench/diag_compile.py"""
import copy

import torch
from _timing import per_call

import cunorm.torch as ct


def explain(label, model, make_input, train):
    model = ct.replace_norms(copy.deepcopy(model)).cuda().train(train)
    x = make_input()
    torch._dynamo.reset()
    with torch.autocast("cuda", dtype=torch.bfloat16), torch.set_grad_enabled(train):
        e = torch._dynamo.explain(model)(x)
    print(f"{label} {'train' if train else 'eval'}: graphs {e.graph_count}, breaks {e.graph_break_count}", flush=True)
    for reason in e.break_reasons[:5]:
        print("   ", str(reason.reason)[:300])


def main():
    import timm
    import transformers

    for name, batch in (("vit_small_patch16_224", 2), ("convnext_tiny", 2), ("resnet50", 2)):
        m = timm.create_model(name, pretrained=False)
        for train in (False, True):
            explain(name, m, lambda: torch.randn(batch, 3, 224, 224, device="cuda"), train)
    cfg = transformers.LlamaConfig(hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
                                   num_key_value_heads=2, vocab_size=1000)
    m = transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa")
    explain("llama", m, lambda: torch.randint(0, 1000, (2, 16), device="cuda"), False)

    x = torch.randn(8, 768, device="cuda", dtype=torch.bfloat16)
    for label, layer in (("LayerNorm(768)", torch.nn.LayerNorm(768)), ("BatchNorm2d(64) eval", None)):
        if layer is None:
            x = torch.randn(2, 64, 8, 8, device="cuda", dtype=torch.bfloat16)
            layer = torch.nn.BatchNorm2d(64).eval()
        theirs = layer.cuda().to(x.dtype)
        ours = ct.replace_norms(copy.deepcopy(theirs))
        torch._dynamo.reset()
        with torch.no_grad():
            for who, mod in (("torch", theirs), ("cunorm", ours)):
                f = torch.compile(mod)
                print(f"{label} compiled, {who}: {per_call(lambda: f(x)):.1f} us a call; eager "
                      f"{per_call(lambda: mod(x)):.1f} us", flush=True)
    w = torch.randn(768, device="cuda", dtype=torch.bfloat16)
    x = torch.randn(8, 768, device="cuda", dtype=torch.bfloat16)
    with torch.no_grad():
        print(f"torch.ops.cunorm.layer_norm eager: "
              f"{per_call(lambda: torch.ops.cunorm.layer_norm(x, w, w, None, [-1], 1e-5, False, 0)):.1f} us a call")


if __name__ == "__main__":
    main()
