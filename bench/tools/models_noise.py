"""The models suite's noise floor: each model timed against an identical
copy of itself (both untouched), as the suite times torch against cunorm.
A speedup away from 1.00 here is the suite's spread, not cunorm.
PYTHONPATH=. python bench/tools/models_noise.py [filter,...]"""
import copy
import sys

import torch

from cunorm.bench import _models

only = sys.argv[1] if len(sys.argv) > 1 else "vit,convnext,bert,resnet50"
for label, build in _models.models(quick=False):
    if not any(part in label for part in only.split(",")):
        continue
    model, make_input = build()
    torch.manual_seed(0)
    a = model.cuda()
    b = copy.deepcopy(a)
    for mode in ("eval bf16 autocast", "train fp32", "train bf16 autocast"):
        ms = _models._time({"a": _models._step(a, make_input, mode, False),
                            "b": _models._step(b, make_input, mode, False)}, 20)
        print(f"{label:40s} {mode:22s} {ms['a']:7.2f} {ms['b']:7.2f}  'speedup' {ms['a'] / ms['b']:.3f}", flush=True)
    del model, a, b
    torch.cuda.empty_cache()
