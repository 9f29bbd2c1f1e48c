"""Probe for issue 25: cunorm kernels inside jax.jit with no build step.

A kernel is compiled to PTX by NVRTC (a virtual architecture, so NVRTC
emits PTX), wrapped in jaxlib's TritonKernel and TritonKernelCall
(jax._src.lib.gpu_triton, the target jax-triton uses) and lowered as the
custom call "triton_kernel_call" (API version 2, the proto zlib-compressed
as backend_config). Array parameters bind to the custom call's buffers in
order, operands then results; other pointer arguments are passed as null
(64-bit zero). Checks residual_add and RMSNorm's rows_cached (no weight:
its pointer arguments are x then y) against jax.numpy inside jit, composed
twice in one jitted function, and times both per call.

PYTHONPATH=. python bench/probe_jax_jit.py   (on the GPU machine)"""
import os
os.environ["XLA_PYTHON_CLIENT_PREALLOCATE"] = "false"
import sys
import time
import zlib

sys.path.insert(0, ".")
import numpy as np
import jax, jax.numpy as jnp
from jax._src.lib import gpu_triton as tl
from jax._src.interpreters import mlir
from jax._src import core
from jax._src.lib.mlir import ir
try:
    from jax.extend.core import Primitive
except ImportError:
    from jax.core import Primitive
from cunorm import _kernels as K, _loader, _ops
from cupy_backends.cuda.libs import nvrtc

reg = getattr(tl._cuda_triton, "registrations", None)
print("registrations:", reg() if callable(reg) else [n for n in dir(tl._cuda_triton) if not n.startswith("__")])

def ptx_of(kernel, arch="compute_90"):
    prog = nvrtc.createProgram(_loader.source(kernel.family), f"{kernel.family}.cu", [], [])
    try:
        nvrtc.addNameExpression(prog, kernel.expression)
        nvrtc.compileProgram(prog, [f"--gpu-architecture={arch}", "-std=c++17", "-ftz=true"])
        ptx = nvrtc.getPTX(prog)
        ptx = ptx.decode() if isinstance(ptx, bytes) else ptx
        return ptx.rstrip("\x00"), nvrtc.getLoweredName(prog, kernel.expression)
    finally:
        nvrtc.destroyProgram(prog)

def make_kernel(name, threads, shared, ptx, cc):
    errs = []
    for args in ((name, threads // 32, 1, shared, ptx, "", cc),):
        try:
            return tl.TritonKernel(*args)
        except TypeError as e:
            errs.append(str(e)[:200])
    raise TypeError(errs)

KIND = {"i32": "i32", "i64": "i64", "f32": "fp32", "f64": "fp64"}

def custom_call(ctx, operands, kernel, grid, block, shared, scalars, arrays, name, api):
    ptx, lowered = ptx_of(kernel)
    print("ptx bytes", len(ptx), "proto bytes (compressed) follow")
    tk = make_kernel(lowered, block, shared, ptx, 90)
    params = []
    for arg, kind in kernel.signature:
        if kind == "ptr":
            params.append(tl.create_array_parameter(0, 0) if arg in arrays else tl.create_scalar_parameter(0, "i64"))
        else:
            params.append(tl.create_scalar_parameter(scalars[arg], KIND[kind]))
    call = tl.TritonKernelCall(tk, grid[0], grid[1] if len(grid) > 1 else 1, grid[2] if len(grid) > 2 else 1, params)
    proto = zlib.compress(call.to_proto(name, b""))
    print("  proto", len(proto))
    layouts = lambda avals: [list(reversed(range(a.ndim))) for a in avals]
    results = [ir.RankedTensorType.get(a.shape, mlir.dtype_to_ir_type(a.dtype)) for a in ctx.avals_out]
    kw = dict(result_types=results, operands=list(operands),
              operand_layouts=layouts(ctx.avals_in), result_layouts=layouts(ctx.avals_out))
    if api == 2:
        return mlir.custom_call("triton_kernel_call", backend_config=proto, api_version=2, **kw).results
    # (API version 4 needs the FFI target, triton_kernel_call_ffi: not tried)
    return mlir.custom_call("triton_kernel_call", backend_config={"opaque": ir.StringAttr.get(proto)}, api_version=4,
                            **kw).results

API = int(os.environ.get("API", "2"))

# 1. residual_add: h = x + r
add_p = Primitive("cunorm_spike_add")
add_p.def_abstract_eval(lambda x, r: core.ShapedArray(x.shape, x.dtype))
def add_lower(ctx, x, r):
    n = int(np.prod(ctx.avals_in[0].shape)); vec = 4
    kern = K.RESIDUAL_ADD("float", vec)
    grid = (min(-(-n // vec // 256), 65535),)
    return custom_call(ctx, (x, r), kern, grid, 256, 0, {"n_vec": n // vec}, {"x", "r", "h"}, "cunorm_add", API)
mlir.register_lowering(add_p, add_lower, platform="cuda")

x = jax.random.normal(jax.random.key(0), (1024, 1024), jnp.float32)
r = jax.random.normal(jax.random.key(1), (1024, 1024), jnp.float32)
try:
    h = jax.jit(lambda a, b: add_p.bind(a, b))(x, r)
    print("residual_add in jit: max err", float(jnp.max(jnp.abs(h - (x + r)))))
except Exception as e:
    print("residual_add FAILED:", repr(e)[:1500])

# 2. rms_norm rows (no weight): x -> y via the dispatch's launch
def rms_launch(shape, dtype):
    key = ("rms", np.dtype(dtype), None, 0, False, shape, (shape[1], 1), 1, 1, 0, 0, 0, 0, 0, 0, None, 0)
    return _ops._plan_and_choose(key, None)

rms_p = Primitive("cunorm_spike_rms")
rms_p.def_abstract_eval(lambda x: core.ShapedArray(x.shape, x.dtype))
def rms_lower(ctx, x):
    aval = ctx.avals_in[0]
    plan, launch = rms_launch(aval.shape, aval.dtype)
    step = launch.steps[0]
    print("rms launch:", launch.tier, step.kernel.expression, step.grid, step.block, step.shared_bytes)
    scalars = {"rows": plan.outer, "n": plan.reduced, "x_row_stride": plan.outer_stride, "eps": 1e-6,
               "threads_per_row": getattr(launch, "threads_per_row", 0), "stash_vecs": getattr(launch, "stash_vecs", 0)}
    assert len(step.block) == 1 or all(b == 1 for b in step.block[1:]), step.block
    return custom_call(ctx, (x,), step.kernel, step.grid, step.block[0], step.shared_bytes, scalars, {"x", "y"},
                       "cunorm_rms", API)
mlir.register_lowering(rms_p, rms_lower, platform="cuda")

def ref_rms(x):
    xf = x.astype(jnp.float32)
    return (xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + 1e-6)).astype(x.dtype)

for shape in ((1, 4096), (64, 4096), (4096, 4096), (32768, 4096)):
    xb = jax.random.normal(jax.random.key(2), shape, jnp.bfloat16)
    try:
        f = jax.jit(lambda a: rms_p.bind(a))
        y = f(xb)
        g = jax.jit(ref_rms)
        yr = g(xb)
        err = float(jnp.max(jnp.abs(y.astype(jnp.float32) - yr.astype(jnp.float32))))
        for fn, tag in ((f, "cunorm in jit"), (g, "jnp in jit")):
            fn(xb).block_until_ready()
            t = time.perf_counter()
            for _ in range(200):
                out = fn(xb)
            out.block_until_ready()
            print(shape, tag, f"{(time.perf_counter() - t) / 200 * 1e3:.3f} ms", "err", err)
        # inside a bigger jitted function, twice
        two = jax.jit(lambda a: rms_p.bind(rms_p.bind(a) * 2))
        want = ref_rms(ref_rms(xb) * 2).astype(jnp.float32)
        print("composed:", float(jnp.max(jnp.abs(two(xb).astype(jnp.float32) - want))))
    except Exception as e:
        print("rms FAILED:", repr(e)[:1500])
