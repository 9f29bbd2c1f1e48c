"""The benchmark's host suite: wall clock per cached call for decode-sized
inputs, cunorm beside torch's own op or layer in the same process."""
from __future__ import annotations

import contextlib

import cupy

import cunorm
from ._cases import make_inputs
from ._timing import _per_call_us, torch


def host_rows(n_calls: int = 2000) -> list[dict]:
    """The host suite: wall clock per call, cunorm against torch's own op or
    layer on the same input in the same process. Each row: what was called,
    cunorm's us and torch's us (None where torch has no counterpart)."""
    rows = []
    x, w, _, _ = make_inputs("rms_norm", (1, 4096), "bfloat16", -1, "w", False)
    sync = cupy.cuda.runtime.deviceSynchronize
    y = cupy.empty_like(x)
    rows.append({"case": "rms_norm 1x4096 bf16 +w, CuPy arrays",
                 "us": _per_call_us(lambda: cunorm.rms_norm(x, w), n_calls, sync), "torch_us": None})
    rows.append({"case": "rms_norm 1x4096 bf16 +w, CuPy arrays, out= (the general path)",
                 "us": _per_call_us(lambda: cunorm.rms_norm(x, w, out=y), n_calls, sync), "torch_us": None})
    if torch is None:
        return rows
    from .. import torch as cunorm_torch

    sync = torch.cuda.synchronize
    F = torch.nn.functional
    dev = "cuda"
    bf16 = torch.bfloat16

    def pair(label, ours, theirs, grad=False, autocast=False):
        """Three rounds of cunorm then torch, the least of each: a host
        whose speed drifts over seconds favours neither."""
        context = contextlib.nullcontext() if grad else torch.no_grad()
        cast = torch.autocast("cuda", dtype=bf16) if autocast else contextlib.nullcontext()
        us = torch_us = float("inf")
        with context, cast:
            for _ in range(3):
                us = min(us, _per_call_us(ours, n_calls, sync))
                torch_us = min(torch_us, _per_call_us(theirs, n_calls, sync))
        rows.append({"case": label, "us": us, "torch_us": torch_us})

    xt = torch.randn(1, 4096, device=dev, dtype=bf16)
    wt = torch.randn(4096, device=dev, dtype=bf16)
    bt = torch.randn(4096, device=dev, dtype=bf16)
    pair("rms_norm 1x4096 bf16 +w, torch tensors (F.rms_norm)", lambda: cunorm.rms_norm(xt, wt),
         lambda: F.rms_norm(xt, (4096,), wt, eps=1e-5))
    pair("layer_norm 1x4096 bf16 +w+b, torch tensors (F.layer_norm)", lambda: cunorm.layer_norm(xt, wt, bt),
         lambda: F.layer_norm(xt, (4096,), wt, bt, eps=1e-5))
    theirs = torch.nn.RMSNorm(4096, eps=1e-5, device=dev, dtype=bf16)
    ours = cunorm_torch.replace_norms(torch.nn.RMSNorm(4096, eps=1e-5, device=dev, dtype=bf16))
    pair("RMSNorm(4096) layer, 1x4096 bf16, no_grad", lambda: ours(xt), lambda: theirs(xt))
    theirs32 = torch.nn.RMSNorm(4096, eps=1e-5, device=dev)
    ours32 = cunorm_torch.replace_norms(torch.nn.RMSNorm(4096, eps=1e-5, device=dev))
    pair("RMSNorm(4096) fp32 weight, bf16 1x4096 under autocast", lambda: ours32(xt), lambda: theirs32(xt),
         autocast=True)
    ln_theirs = torch.nn.LayerNorm(768, device=dev)
    ln_ours = cunorm_torch.replace_norms(torch.nn.LayerNorm(768, device=dev))
    act = torch.randn(4, 512, 768, device=dev)
    pair("LayerNorm(768) layer, (4,512,768) fp32, no_grad", lambda: ln_ours(act), lambda: ln_theirs(act))
    act16 = act.to(bf16)
    pair("LayerNorm(768) fp32 params, (4,512,768) bf16 under autocast", lambda: ln_ours(act16),
         lambda: ln_theirs(act16), autocast=True)
    bn_theirs = torch.nn.BatchNorm2d(64, device=dev).eval()
    bn_ours = cunorm_torch.replace_norms(torch.nn.BatchNorm2d(64, device=dev).eval())
    img = torch.randn(1, 64, 8, 8, device=dev)
    pair("BatchNorm2d(64) eval, (1,64,8,8) fp32, no_grad", lambda: bn_ours(img), lambda: bn_theirs(img))
    gn_theirs = torch.nn.GroupNorm(8, 64, device=dev)
    gn_ours = cunorm_torch.replace_norms(torch.nn.GroupNorm(8, 64, device=dev))
    pair("GroupNorm(8, 64), (1,64,8,8) fp32, no_grad", lambda: gn_ours(img), lambda: gn_theirs(img))
    xg = torch.randn(1, 4096, device=dev, dtype=bf16, requires_grad=True)
    dy = torch.randn_like(xg)

    def step(layer):
        def run():
            y = layer(xg)
            y.backward(dy)
        return run

    pair("RMSNorm(4096) training step (forward + backward), 1x4096 bf16", step(ours), step(theirs), grad=True)
    img_g = img.clone().requires_grad_()
    dimg = torch.randn_like(img)
    bn_train_theirs = torch.nn.BatchNorm2d(64, device=dev)
    bn_train_ours = cunorm_torch.replace_norms(torch.nn.BatchNorm2d(64, device=dev))

    def bn_step(layer):
        def run():
            layer(img_g).backward(dimg)
        return run

    pair("BatchNorm2d(64) training step, (1,64,8,8) fp32", bn_step(bn_train_ours), bn_step(bn_train_theirs),
         grad=True)
    for r in rows:
        if r.get("torch_us"):
            r["ratio"] = r["us"] / r["torch_us"]
    return rows
