"""Kernel launches as XLA custom calls: what cunorm/jax/_jit.py lowers its
primitives to.

Each launch of a call's Program (the same dispatch, the same builders:
row_norms.build_rows, channel_norms.build_channels, gradients.build_rows_grad,
gradients.build_channel_grad, recorded by launches.LaunchRecorder) becomes one
custom call of jaxlib's "triton_kernel_call" target: the kernel as PTX from
NVRTC, its grid, its 1-D block and shared memory, its scalar arguments
baked in, its pointer arguments bound to the call's operands and then its
results, in order (why every kernel lists the pointers it reads before those
it writes: cunorm/_engine/declarations.py). XLA allocates every buffer, workspaces
included (a zeroed workspace is zeroed by the call), and launches the
kernels on its own stream; the compiled program holds them like any other
op. Launches that wait on other blocks are not used here (the cooperative
backward's grid sums give way to column_sum; the channel stream walk to
the three launches), since XLA's launches cannot be cooperative.

The GPU the launches are planned for is the process's, or the architecture
named with set_lowering_target (cunorm/_engine/targets.py).

Private API used, and so the supported versions (SUPPORTED_JAX):
``jax._src.lib.gpu_triton`` (the TritonKernel/TritonKernelCall wrappers and
their proto) and ``jax._src.interpreters.mlir.custom_call``.
"""
from __future__ import annotations

import dataclasses
import functools
import zlib

import numpy as np

import jax
from jax._src.interpreters import mlir
from jax._src.lib.mlir import ir

from .._engine import launches, loader, targets
from .._engine.declarations import POINTER_KINDS

#: the jax versions this lowering is tested with: [first, past the last)
SUPPORTED_JAX = ((0, 10), (0, 12))
#: the alignment XLA gives every buffer it hands a custom call, at least
#: (checked by jaxlib at each launch)
BUFFER_ALIGN = 16
_SCALAR_KIND = {"i32": "i32", "i64": "i64", "f32": "fp32", "f64": "fp64"}


def check_jax_version(version: str = jax.__version__) -> None:
    parts = tuple(int(p) for p in version.split(".")[:2])
    low, high = SUPPORTED_JAX
    if not low <= parts < high:
        raise RuntimeError(f"cunorm inside jax.jit needs jax {low[0]}.{low[1]} to {high[0]}.{high[1] - 1}.x (its "
                           f"custom-call lowering uses jaxlib internals), got jax {version}; call cunorm.jax on "
                           f"concrete arrays outside jit instead")


def _gpu_triton():
    try:
        from jax._src.lib import gpu_triton
    except ImportError:  # pragma: no cover (a jaxlib without its GPU kernels)
        gpu_triton = None
    if not hasattr(gpu_triton, "TritonKernel"):  # (the module is there without the CUDA plugin, empty)
        raise RuntimeError("cunorm inside jax.jit needs jax's CUDA plugin, which provides the custom-call target "
                           "triton_kernel_call: pip install 'jax[cuda12]' (or 'jax[cuda13]'); lowering on a host "
                           "without a GPU needs only the plugin, jax-cuda12-plugin of jax's version")
    return gpu_triton


# --- the target GPU -----------------------------------------------------------------


#: the architecture named with set_lowering_target, as target() returns it; None: the process's GPU
_named_target = None


def set_lowering_target(arch=None, *, sm_count: int | None = None, l2_bytes: int | None = None):
    """Lower for ``arch`` ("sm_80", "sm_86", "sm_89", "sm_90", or the compute
    capability as an int) instead of this process's GPU: what lowering
    and jax.export on a host without the GPU need. The dispatch plans for
    the architecture's reference part (cunorm/_engine/targets.py), whose
    multiprocessor count and L2 size ``sm_count`` and ``l2_bytes``
    replace; persistent grids are capped by the occupancy the compiler's
    resource report gives for that architecture. None: back to the
    process's GPU. Returns the Target now in force (None for the GPU).
    A change clears jax's caches: what jax lowered or compiled before was
    planned for the other target."""
    global _named_target
    if arch is None:
        if sm_count is not None or l2_bytes is not None:
            raise ValueError("sm_count and l2_bytes describe a named target: pass arch too")
        chosen, named = None, None
    else:
        chosen = targets.named(arch, sm_count=sm_count, l2_bytes=l2_bytes)
        named = (targets.device_id(chosen), chosen.device, chosen.arch)
    if named != _named_target:
        _named_target = named
        jax.clear_caches()
    return chosen


def target():
    """(device id, dispatch_rows.Device, compute capability) the lowering plans
    for: the architecture set_lowering_target named, else the process's
    first GPU (a jit program runs on GPUs of one model)."""
    named = _named_target
    return named if named is not None else _gpu_target()


@functools.lru_cache(maxsize=1)
def _gpu_target():
    if loader.gpu_name() is None:
        raise RuntimeError("cunorm.jax: lowering for CUDA needs the GPU the program will run on, and this process "
                           "sees none. Name it first: cunorm.jax.set_lowering_target('sm_90') (or 'sm_80', "
                           "'sm_86', 'sm_89'; docs/jax.md, 'Lowering without a GPU')")
    device = launches.device_info(0)
    return 0, device, device.compute_capability


@functools.lru_cache(maxsize=512)
def kernel_ptx(family: str, expression: str, arch: int) -> tuple[str, str]:
    """(PTX, lowered name) of one instantiation, from NVRTC for compute_<arch>."""
    from cupy_backends.cuda.libs import nvrtc

    prog = nvrtc.createProgram(loader.source(family), f"{family}.cu", [], [])
    try:
        nvrtc.addNameExpression(prog, expression)
        try:
            nvrtc.compileProgram(prog, [f"--gpu-architecture=compute_{arch}", *loader.OPTIONS, "-ftz=true"])
        except nvrtc.NVRTCError as err:
            raise RuntimeError(f"NVRTC failed on {family}.cu:\n{nvrtc.getProgramLog(prog)}") from err
        ptx = nvrtc.getPTX(prog)
        ptx = ptx.decode() if isinstance(ptx, bytes) else ptx
        return ptx.rstrip("\x00"), nvrtc.getLoweredName(prog, expression)
    finally:
        nvrtc.destroyProgram(prog)


# --- recorded launches as custom calls ---------------------------------------------


@dataclasses.dataclass
class CustomCall:
    """One launch as a custom call: ``params`` each ("array", bytes_to_zero)
    or ("scalar", value, kind); operands and results by slot name; results'
    (shape, dtype); ``aliases`` {operand index: result index} (io pointers)."""

    launch: launches.RecordedLaunch
    params: list
    operands: list
    results: list
    result_types: list
    aliases: dict


def plan_calls(recorder: launches.LaunchRecorder, inputs, outputs: dict) -> list[CustomCall]:
    """The custom calls of a recorded Program. ``inputs``: the slot names the
    caller supplies; ``outputs``: {slot: (shape, dtype)} of what it wants
    back. An ``out`` pointer bound to an input slot is one the kernel never
    writes (the builders pass x for absent arrays): passed null. Pure
    Python (tested on the CPU)."""
    names = recorder.slots + tuple(f"workspace{i}" for i in range(len(recorder.workspaces)))
    written = set(inputs)
    calls = []
    for launch in recorder.launches:
        params, operands, results, types, aliased = [], [], [], [], []
        for name, kind in launch.kernel.signature:
            value = launch.args[name]
            if kind not in POINTER_KINDS:
                params.append(("scalar", value, _SCALAR_KIND[kind]))
                continue
            if value is None:
                params.append(("scalar", 0, "i64"))
                continue
            if value.offset:
                raise RuntimeError(f"{launch.kernel.expression}: {name} points {value.offset} bytes into a buffer, "
                                   f"which a custom call cannot pass")
            slot = names[value.index]
            if kind in ("in", "io"):
                if slot not in written:
                    raise RuntimeError(f"{launch.kernel.expression} reads {slot} before anything wrote it")
                operands.append(slot)
                params.append(("array", 0))
                if kind == "io":
                    aliased.append((len(operands) - 1, slot))
                continue
            if slot in inputs:  # never written (see above)
                params.append(("scalar", 0, "i64"))
                continue
            if slot in written:
                raise RuntimeError(f"{launch.kernel.expression} writes {slot}, which an earlier launch wrote")
            zero = 0
            if slot in outputs:
                types.append(outputs[slot])
            else:
                nbytes, zeroed = recorder.workspaces[names.index(slot) - len(recorder.slots)]
                types.append(((nbytes,), np.dtype(np.uint8)))
                zero = nbytes if zeroed else 0
            results.append(slot)
            params.append(("array", zero))
            written.add(slot)
        # io results last: the pointers bind to the operands, then to the
        # results in order, so the aliases must follow every written result
        aliases = {}
        for operand, slot in aliased:
            aliases[operand] = len(results)
            results.append(slot)
            types.append(inputs[slot] if isinstance(inputs, dict) else outputs[slot])
        calls.append(CustomCall(launch, params, operands, results, types, aliases))
    missing = set(outputs) - written
    if missing:
        raise RuntimeError(f"no launch writes {sorted(missing)}")
    return calls


def backend_config(call: CustomCall, arch: int) -> bytes:
    """The zlib-compressed TritonAnyKernelCall proto of one call."""
    tl = _gpu_triton()
    launch = call.launch
    ptx, lowered = kernel_ptx(launch.kernel.family, launch.kernel.expression, arch)
    kernel = tl.TritonKernel(lowered, launch.threads // 32, 1, launch.shared, ptx, "", arch)
    params = [tl.create_array_parameter(p[1], BUFFER_ALIGN) if p[0] == "array" else
              tl.create_scalar_parameter(p[1], p[2]) for p in call.params]
    kcall = tl.TritonKernelCall(kernel, *launch.grid, params)
    return zlib.compress(kcall.to_proto(launch.kernel.name, b""))


def _ir_type(shape, dtype):
    return ir.RankedTensorType.get(shape, mlir.dtype_to_ir_type(np.dtype(dtype)))


def emit(recorder, values: dict, outputs: dict, arch: int) -> dict:
    """Lower a recorded Program: ``values`` {slot: ir.Value} of the inputs
    (with their (shape, dtype) in ``values_types``), ``outputs`` {slot:
    (shape, dtype)}; returns {slot: ir.Value} of every output."""
    env = dict(values)
    inputs = {slot: (tuple(ir.RankedTensorType(v.type).shape), None) for slot, v in values.items()}
    for call in plan_calls(recorder, inputs, outputs):
        operands = [env[s] for s in call.operands]
        types = [_ir_type(shape, dtype) if dtype is not None else env[slot].type
                 for slot, (shape, dtype) in zip(call.results, call.result_types)]
        layouts = lambda ts: [list(reversed(range(len(ir.RankedTensorType(t).shape)))) for t in ts]  # noqa: E731
        op = mlir.custom_call("triton_kernel_call", result_types=types, operands=operands,
                              backend_config=backend_config(call, arch), api_version=2,
                              operand_layouts=layouts([v.type for v in operands]), result_layouts=layouts(types),
                              operand_output_aliases=call.aliases or None, has_side_effect=False)
        for slot, value in zip(call.results, op.results):
            env[slot] = value
    return {slot: env[slot] for slot in outputs}
