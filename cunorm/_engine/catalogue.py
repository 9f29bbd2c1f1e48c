"""The catalogue: every kernel instantiation the dispatch can pick, for the
precompile step and CI's compile check (derived from the declarations in
cunorm/_engine/declarations.py and the choices of cunorm/_engine/dispatch_*.py)."""
from __future__ import annotations

import functools
from dataclasses import replace

from . import dtypes, plans, quantize, tuning
from . import declarations as K
from .dispatch_rows import (CACHE_BYTES_STRIDED, MAX_VECS_PER_THREAD, NORMS, VECS_PER_THREAD_CHOICES, RowShape,
                            cache_fits, is_heavy, next_pow2, norm_info, power_norm_name, row_threads)
from .dispatch_grad import (GATE_INPUT, GATE_OUTPUT, GRAD_CACHED_MAX_THREADS, GRAD_NORMS, GRAD_STRIDED_MAX_CPT,
                            _vpt_choices, column_sum_width, grad_cached_bounds, grad_cached_cluster_shapes,
                            grad_cached_multi_row_bounds, grad_cached_shape, grad_onchip_items,
                            grad_onchip_max_elements, gated_max_vpt, grad_onchip_shapes, grad_policy,
                            strided_grad_cache_bytes, MOD_GATE, MOD_SCALE, OUT_GATE, OUT_SCALE, OUT_SHIFT,
                            modulated_shapes)
from .dispatch_channels import (CHANNEL_NORM, CHANNELS_FIRST, CHANNELS_LAST, CHANNELS_LAST_GROUPED,
                                CHANNELS_LAST_PAIRED, ONCHIP_MAX_GROUP_BYTES_16BIT, ONCHIP_SHAPES, onchip_items)
from .declarations import Kernel


def _vector_widths(dtype) -> list[int]:
    """Elements a vector access may move: up to 16 bytes."""
    return [v for v in (1, 2, 4, 8) if v * dtype.itemsize <= 16]


def _strided_grad_cpts(vec: int, itemsize: int) -> list[int]:
    """strided_grad_cached's reduced indices a thread at this vector width."""
    return [c for c in (1, 2, 4, GRAD_STRIDED_MAX_CPT) if 2 * c * vec * itemsize <= strided_grad_cache_bytes(itemsize)]


#: the general-p Lp norm CI compiles (any other p compiles on first use)
REPRESENTATIVE_POWER = 3.0


def all_kernels(norms=None) -> list[Kernel]:
    """Every template instantiation that ``choose`` can return without an
    override, for the precompile step and CI's compile check (rows_resident,
    which only an override reaches, is resident_kernels()). The general-p
    norm is represented by p = REPRESENTATIVE_POWER."""
    if norms is None:
        norms = (*NORMS, power_norm_name(REPRESENTATIVE_POWER))
    out, tiles_applies = [], set()
    for norm in norms:
        info = norm_info(norm)
        policy = info.policy
        residuals = (False, True) if info.residual else (False,)
        for dtype in dtypes.SUPPORTED:
            t = dtypes.KERNEL_TYPE[dtype]
            params = sorted({dtypes.KERNEL_TYPE[dtype], dtypes.KERNEL_TYPE[dtypes.accumulation(dtype)]})
            affine = [(dtypes.NO_PARAMS, 0)] + [(p, f) for f in info.flags if f for p in params]
            for vec in _vector_widths(dtype):
                vec_bytes = vec * dtype.itemsize
                for residual in residuals:
                    out.append(K.ROWS_SPLIT_PARTIAL(policy, t, K.row_load(t, residual), vec))
                    if vec == _vector_widths(dtype)[0]:  # (no vector width in its arguments)
                        out.append(K.ROWS_SPLIT_FINALIZE(policy, t, K.row_load(t, residual)))
                for p, flags in affine:
                    for residual in residuals:
                        load = K.row_load(t, residual)
                        common = (policy, t, K.affine_store(p, flags, t), load, vec)
                        # y in x's type; float32 too for LayerNorm of 16-bit x (autocast's output)
                        outputs = [t] + (["float"] if norm == "ln" and dtype.itemsize == 2 and not residual else [])
                        reach = cached_reach(RowShape(vec_bytes, residual, is_heavy(norm, dtype), lean=not residual))
                        for vpt in VECS_PER_THREAD_CHOICES:
                            for y in outputs:
                                cached = (policy, t, K.affine_store(p, flags, y), load, vec, vpt)
                                for block_per_row in (False, True):
                                    if (vpt, block_per_row) in reach:
                                        out.append(K.ROWS_CACHED(*cached, block_per_row))
                        out.append(K.ROWS_UNCACHED(*common))
                        out.append(K.ROWS_SPLIT_APPLY(*common))
                        tiles_apply = K.ROWS_SPLIT_APPLY_TILES(*common[1:])  # (no norm: one for all norms)
                        if tiles_apply not in tiles_applies:
                            tiles_applies.add(tiles_apply)
                            out.append(tiles_apply)
                    for cpt in (0,) + VECS_PER_THREAD_CHOICES:
                        if cpt * vec_bytes <= CACHE_BYTES_STRIDED:
                            out.append(K.STRIDED_NORM(policy, t, K.affine_store(p, flags, t), vec, cpt))
    for dtype in dtypes.SUPPORTED:
        for vec in _vector_widths(dtype):
            out.append(K.RESIDUAL_ADD(dtypes.KERNEL_TYPE[dtype], vec))
    # (each once: the dtypes that share an accumulation type share its kernels)
    return list(dict.fromkeys(out + channel_kernels() + backward_kernels() + gated_grad_kernels() +
                              wide_grad_kernels() + modulated_grad_kernels()))


@functools.lru_cache(maxsize=None)
def cached_reach(shape: RowShape) -> frozenset[tuple[int, bool]]:
    """The (vectors a thread, a block per row) rows_cached takes under each
    architecture's tuning for rows of any length (dispatch_rows.row_threads
    over every row rows_cached can hold: at most 1024 threads of
    MAX_VECS_PER_THREAD vectors). A block per row of one vector a thread,
    for one, is never picked: the target is 4 or more."""
    out = set()
    for tune in _tunings():
        for n_vec in range(1, 1024 * MAX_VECS_PER_THREAD + 1):
            threads = row_threads(shape, n_vec, tune)
            if cache_fits(shape, n_vec, threads):
                out.add((next_pow2(-(-n_vec // threads)), threads > 32))
    return frozenset(out)


def resident_kernels() -> list[Kernel]:
    """rows_resident's instantiations (the resident tier: an override
    only, never the dispatch's pick) for RMSNorm and LayerNorm, the norms
    of its experiments."""
    out = []
    for norm in [n for n in NORMS if norm_info(n).residual]:
        info = norm_info(norm)
        for dtype in dtypes.SUPPORTED:
            t = dtypes.KERNEL_TYPE[dtype]
            params = sorted({dtypes.KERNEL_TYPE[dtype], dtypes.KERNEL_TYPE[dtypes.accumulation(dtype)]})
            affine = [(dtypes.NO_PARAMS, 0)] + [(p, f) for f in info.flags if f for p in params]
            for vec in _vector_widths(dtype):
                for p, flags in affine:
                    for residual in (False, True):
                        out.append(K.ROWS_RESIDENT(info.policy, t, K.affine_store(p, flags, t), K.row_load(t, residual),
                                                   vec, cooperative=True))
    return out


def channel_kernels() -> list[Kernel]:
    """Every instantiation of the channel family."""
    out = [K.CHANNEL_FROM_RUNNING(a) for a in ("float", "double")]
    for dtype in dtypes.SUPPORTED:
        t = dtypes.KERNEL_TYPE[dtype]
        params = sorted({t, dtypes.KERNEL_TYPE[dtypes.accumulation(dtype)]})
        affine = [(dtypes.NO_PARAMS, 0)] + [(p, f) for f in (1, 2, 3) for p in params]
        for layout in (CHANNELS_FIRST, CHANNELS_LAST, CHANNELS_LAST_GROUPED, CHANNELS_LAST_PAIRED):
            if layout != CHANNELS_LAST_PAIRED:  # (paired partials take the grouped finalize)
                out.append(K.CHANNEL_FINALIZE(CHANNEL_NORM, t, layout))
            for vec in _vector_widths(dtype):
                if layout == CHANNELS_LAST_PAIRED and vec == 1:  # (a vector of one never straddles)
                    continue
                out.append(K.CHANNEL_PARTIAL(CHANNEL_NORM, t, vec, layout))
                for p, flags in affine:
                    for y in [t] + (["float"] if dtype.itemsize == 2 else []):  # (float32 y: autocast's GroupNorm)
                        out.append(K.CHANNEL_APPLY(t, K.affine_store(p, flags, y), vec, layout))
        for p, flags in affine:  # channel_stream: channels-first, 16-byte vectors
            for y in [t] + (["float"] if dtype.itemsize == 2 else []):
                out.append(K.CHANNEL_STREAM(CHANNEL_NORM, t, K.affine_store(p, flags, y), 16 // dtype.itemsize,
                                            persistent=True))
        out += onchip_kernels(dtype, t, affine)
    return out


def onchip_kernels(dtype, t, affine) -> list[Kernel]:
    """channel_onchip's instantiations for one data type (onchip_shape's
    shapes; 16-bit data only those of groups up to
    ONCHIP_MAX_GROUP_BYTES_16BIT); clustered ones for sm_90 and later."""
    out = []
    for threads, elements, cluster in ONCHIP_SHAPES:
        if dtype.itemsize == 2 and threads * elements * cluster * 2 > ONCHIP_MAX_GROUP_BYTES_16BIT:
            continue  # (the shapes are in increasing capacity: smaller ones hold every group it takes)
        for vec in _vector_widths(dtype):
            items = onchip_items(dtype.itemsize, vec, threads, elements, cluster)
            for last in (False, True):
                for p, flags in affine:
                    for y in [t] + (["float"] if dtype.itemsize == 2 else []):
                        out.append(K.CHANNEL_ONCHIP(t, K.affine_store(p, flags, y), vec, last, threads, items,
                                                    cluster))
    return out


def statistics_only_kernels() -> list[Kernel]:
    """rows_cached without y (dispatch_rows.statistics_only: NoStore) for
    every cached RMSNorm and LayerNorm instantiation. Only jit's lowering
    takes them, compiling its own PTX, so precompile leaves them out; the
    compile check covers their representative set."""
    policies = {norm_info(norm).policy for norm in ("rms", "ln")}
    out = {}
    for k in all_kernels():
        if k.name == "rows_cached" and k.template_args[0] in policies:
            args = k.template_args
            kernel = K.ROWS_CACHED(*args[:2], K.NO_STORE, *args[3:])
            out[kernel.expression] = kernel
    return list(out.values())


def quantized_kernels() -> list[Kernel]:
    """rows_cached and rows_uncached with the quantizing store (quantize=)
    for each of their RMSNorm and LayerNorm instantiations of 16- and 32-bit
    data, each format, scaling and group size. They compile on first use
    (an option, as the epilogue's others): precompile leaves them out; the
    compile check covers their representative set."""
    policies = {norm_info(norm).policy for norm in ("rms", "ln")}
    decls = {"rows_cached": K.ROWS_CACHED, "rows_uncached": K.ROWS_UNCACHED}
    out = {}
    for k in all_kernels():
        args = k.template_args
        if k.name not in decls or args[0] not in policies or args[1] == "double" or args[2].args[2] != args[1]:
            continue
        params, flags, _ = args[2].args
        vec = args[4]
        for fmt in quantize.FORMATS.values():
            for scaling in (quantize.STATIC, quantize.ROW, quantize.ROW_BOUNDED):
                # a group's lanes within a warp (dispatch_rows.group_lanes)
                groups = [0] + [g for g in quantize.GROUPS if scaling != quantize.STATIC and g // vec <= 32]
                for group in groups:
                    store = K.quant_store(params, flags, fmt.kernel_type, scaling, group)
                    kernel = decls[k.name](*args[:2], store, *args[3:])
                    out[kernel.expression] = kernel
    return list(out.values())


def conditioned_kernels() -> list[Kernel]:
    """rows_cached with per-row operands (per-head weights, a modulation, a
    gated residual), the gated RMSNorm's gate and the float32 residual
    stream, as the dispatch picks
    them for RMSNorm and LayerNorm over every dtype, the row lengths it
    takes (powers of two, 16 elements to the register budget) and each
    flag set, under each architecture's tuning. They compile on first use: precompile
    leaves them out; the compile check covers them."""
    from . import plans
    from .dispatch_rows import Device, choose

    gate_flags = [plans.FLAG_GATE, plans.FLAG_GATE | plans.FLAG_GATE_INPUT,
                  plans.FLAG_GATE | plans.FLAG_ROUND_NORMALIZED,
                  plans.FLAG_GATE | plans.FLAG_GATE_INPUT | plans.FLAG_ROUND_NORMALIZED]
    row_flags = [plans.FLAG_PARAM_ROWS | plans.FLAG_SHIFT | plans.FLAG_SCALE, plans.FLAG_SHIFT | plans.FLAG_SCALE,
                 plans.FLAG_SHIFT | plans.FLAG_SCALE | plans.FLAG_RESIDUAL_GATE, plans.FLAG_RESIDUAL_GATE,
                 plans.FLAG_PARAM_ROWS]
    out = {}
    for arch in tuning.BY_ARCH:
        device = Device(sm_count=132, compute_capability=arch, max_shared_per_block=227 * 1024,
                        l2_bytes=50 * 1024 * 1024)
        for norm in ("rms", "ln"):
            for dtype in (dtypes.float16, dtypes.bfloat16, dtypes.float32, dtypes.float64):
                wide = [plans.FLAG_WIDE_RESIDUAL] if dtype.itemsize == 2 else []
                for extra in row_flags + wide + (gate_flags if norm == "rms" else []):
                    residual = bool(extra & (plans.FLAG_RESIDUAL_GATE | plans.FLAG_WIDE_RESIDUAL))
                    for params in ([plans.FLAG_WEIGHT] if norm == "rms" else [plans.PARAM_FLAGS]) + [0]:
                        flags = extra | params
                        if not flags & (plans.OPERAND_FLAGS | plans.FLAG_GATE | plans.FLAG_WIDE_RESIDUAL):
                            continue
                        pdtype = dtype if flags & plans.OPERAND_FLAGS else None
                        for log in range(4, 16):
                            n = 1 << log
                            plan = plans.make_plan(norm, dtype, pdtype, flags, residual, (4096, n), (n, 1), 1, 1, 0,
                                                   0, 0, 0, 0, 0, None, None, (1, 1, 1), (0, 0, 0), 0)
                            launch = choose(plan, device)
                            if launch is not None:
                                kernel = launch.steps[0].kernel
                                out[kernel.expression] = kernel
    return list(out.values())


def modulated_grad_kernels() -> list[Kernel]:
    """The fused modulated backward's kernels (modulated_grad.py) for
    RMSNorm and LayerNorm over every dtype and vector width, each vectors
    a thread the plan takes, parameters (stored with the modulation) in
    the data's and the accumulation dtype, every set of parameters the
    norm takes, every modulation (shift alone, scale, the gate, scale and
    the gate); modulated_grad_sums for each with the gradients it writes
    (shift's where there is one)."""
    out = []
    tunes = _tunings()
    for dtype in dtypes.SUPPORTED:
        acc = dtypes.accumulation(dtype)
        a, t = dtypes.KERNEL_TYPE[acc], dtypes.KERNEL_TYPE[dtype]
        for p in sorted({t, a}):
            for norm in ("rms", "ln"):
                grad = grad_policy(norm, a)
                for flags in norm_info(norm).flags:
                    for modf in (0, MOD_SCALE, MOD_GATE, MOD_SCALE | MOD_GATE):
                        given = (OUT_SCALE if modf & MOD_SCALE else 0) | (OUT_GATE if modf & MOD_GATE else 0)
                        for outs in sorted({given | OUT_SHIFT} | ({given} if given else set())):
                            for columns in sorted({1, column_sum_width(a, 0)}):
                                out.append(K.MODULATED_GRAD_SUMS(a, p, flags, modf, outs, columns))
                        for vec in _vector_widths(dtype):
                            for tune in tunes:
                                for shape in sorted(modulated_shapes(vec, dtype.itemsize, bool(modf & MOD_GATE),
                                                                     tune)):
                                    out.append(K.ROWS_GRAD_MODULATED(grad, t, p, flags, modf, vec, *shape,
                                                                     persistent=True))
    return list(dict.fromkeys(out))


@functools.lru_cache(maxsize=None)
def _block_threads(vec: int, itemsize: int, vpt: int, tune: tuning.Tuning, max_vpt: int = 8) -> tuple[int, ...]:
    """The block sizes whose launch bounds (grad_cached_bounds) one
    rows_grad_cached block of ``vpt`` vectors a thread runs under, over
    every row length: the preferred block's always; the largest block's
    only where grad_cached_shape gives some row past the preferred block
    ``vpt``. A row that no vector count holds in the preferred block is
    longer than it at the most vectors a thread, so where the preferred
    block is half the largest or more only that count reaches the largest."""
    target = tune.grad_cached_target_threads
    lengths = range(target + 1, GRAD_CACHED_MAX_THREADS * max_vpt + 1)
    shapes = (grad_cached_shape(n_vec, vec, itemsize, tune, 1, max_vpt) for n_vec in lengths)
    past = {shape[1] for shape in filter(None, shapes) if shape[0] > target}
    return (target,) + ((GRAD_CACHED_MAX_THREADS,) if vpt in past else ())


def _tunings() -> list[tuning.Tuning]:
    """The distinct Tunings of the architectures cunorm plans for: the
    catalogue holds what the dispatch picks under each."""
    return list({replace(t, name=""): t for t in tuning.BY_ARCH.values()}.values())


def gated_grad_kernels() -> list[Kernel]:
    """The gated RMSNorm's backward (rows_grad_gated): rows_grad_cached's
    shapes for each gate placement, with and without a weight."""
    out = []
    tunes = _tunings()
    for dtype in dtypes.SUPPORTED:
        a, t = dtypes.KERNEL_TYPE[dtypes.accumulation(dtype)], dtypes.KERNEL_TYPE[dtype]
        grad = grad_policy("rms", a)
        for p, flags in [(dtypes.NO_PARAMS, 0)] + [(p, plans.FLAG_WEIGHT) for p in sorted({t, a})]:
            for gate in (GATE_OUTPUT, GATE_INPUT):
                for vec in _vector_widths(dtype):
                    most = gated_max_vpt(vec, dtype.itemsize)
                    for vpt in [v for v in _vpt_choices(vec, dtype.itemsize) if v <= most]:
                        for tune in tunes:
                            for threads in _block_threads(vec, dtype.itemsize, vpt, tune, most):
                                out.append(K.ROWS_GRAD_GATED(grad, t, p, flags, gate, vec, vpt,
                                                             *grad_cached_bounds(threads, vpt, tune), 0,
                                                             cooperative=flags != 0, persistent=True))
                            if vpt == 1:
                                out.append(K.ROWS_GRAD_GATED(grad, t, p, flags, gate, vec, vpt,
                                                             *grad_cached_multi_row_bounds(tune), 1,
                                                             cooperative=flags != 0, persistent=True))
    return list(dict.fromkeys(out))


def wide_grad_kernels() -> list[Kernel]:
    """The float32 residual stream's backward (rows_grad_wide, 16-bit dy
    over float32 h): rows_grad_cached's shapes for 32-bit data."""
    out = []
    tunes = _tunings()
    a = dtypes.KERNEL_TYPE[dtypes.float32]
    for dtype in [d for d in dtypes.SUPPORTED if d.itemsize == 2]:
        t = dtypes.KERNEL_TYPE[dtype]
        for norm in ("rms", "ln"):
            grad = grad_policy(norm, a)
            affine = [(dtypes.NO_PARAMS, 0)] + [(p, f) for f in norm_info(norm).flags if f for p in sorted({t, a})]
            for p, flags in affine:
                for vec in _vector_widths(dtype):
                    for vpt in _vpt_choices(vec, 4):
                        for tune in tunes:
                            for threads in _block_threads(vec, 4, vpt, tune):
                                out.append(K.ROWS_GRAD_WIDE(grad, t, p, flags, vec, vpt,
                                                            *grad_cached_bounds(threads, vpt, tune), 0,
                                                            cooperative=flags != 0, persistent=True))
                            if vpt == 1:
                                out.append(K.ROWS_GRAD_WIDE(grad, t, p, flags, vec, vpt,
                                                            *grad_cached_multi_row_bounds(tune), 1,
                                                            cooperative=flags != 0, persistent=True))
    return list(dict.fromkeys(out))


def backward_kernels() -> list[Kernel]:
    """Every instantiation the backward dispatch can pick under any
    architecture's Tuning (the general-p norm represented by
    REPRESENTATIVE_POWER)."""
    out = []
    tunes = _tunings()
    for dtype in dtypes.SUPPORTED:
        acc = dtypes.accumulation(dtype)
        a, t = dtypes.KERNEL_TYPE[acc], dtypes.KERNEL_TYPE[dtype]
        params = sorted({t, a})
        for p in params:
            for columns in sorted({1, column_sum_width(a, 0)}):
                out.append(K.COLUMN_SUM(a, p, columns))
        for norm in (*GRAD_NORMS, power_norm_name(REPRESENTATIVE_POWER)):
            grad = grad_policy(norm, a)
            affine = [(dtypes.NO_PARAMS, 0)] + [(p, f) for f in norm_info(norm).flags if f for p in params]
            out.append(K.ROWS_GRAD_FINALIZE(grad, a))
            out.append(K.ROWS_GRAD_FINALIZE_WIDE(grad, a))
            for vec in _vector_widths(dtype):
                for p, flags in affine:
                    for vpt in _vpt_choices(vec, dtype.itemsize):
                        for tune in tunes:
                            for threads in _block_threads(vec, dtype.itemsize, vpt, tune):
                                out.append(K.ROWS_GRAD_CACHED(grad, t, p, flags, vec, vpt,
                                                              *grad_cached_bounds(threads, vpt, tune), 0,
                                                              cooperative=flags != 0, persistent=True))
                            if vpt == 1:  # (rows shorter than a block: several a block)
                                out.append(K.ROWS_GRAD_CACHED(grad, t, p, flags, vec, vpt,
                                                              *grad_cached_multi_row_bounds(tune), 1,
                                                              cooperative=flags != 0, persistent=True))
                    for bounds in sorted({(vpt, cluster, *grad_cached_bounds(threads, vpt, tune)) for tune in tunes
                                          for vpt, cluster, threads in grad_cached_cluster_shapes(vec, dtype.itemsize,
                                                                                                  tune)}):
                        vpt, cluster, most, fewest = bounds
                        out.append(K.ROWS_GRAD_CLUSTER(grad, t, p, flags, vec, vpt, most, fewest, cluster,
                                                       persistent=True))
                    out.append(K.ROWS_GRAD_CHUNKS(grad, t, p, flags, vec))
                    out.append(K.ROWS_GRAD_SUMS(grad, t, p, flags, vec))
                    for strided in (False, True):
                        out.append(K.ROWS_GRAD_APPLY(grad, t, p, flags, vec, strided))
                    for cpt in _strided_grad_cpts(vec, dtype.itemsize):
                        out.append(K.STRIDED_GRAD_CACHED(grad, t, p, flags, vec, cpt))
        out.append(K.CHANNEL_GRAD_COMBINE(a))
        out.append(K.CHANNEL_SYNC_COMBINE(a))
        out.append(K.CHANNEL_SYNC_COUNT(a))
        onchip_most = max(grad_onchip_max_elements(dtype.itemsize, tune) for tune in tunes)
        for p, flags in [(dtypes.NO_PARAMS, 0)] + [(p, f) for f in (1, 2, 3) for p in params]:
            for training in (False, True):
                out.append(K.CHANNEL_GRAD_FINALIZE(a, p, flags, training))
                for vec in _vector_widths(dtype):
                    held = 0  # the most elements the shapes before hold: a shape past the limit is never taken
                    for threads, elements, cluster in grad_onchip_shapes(dtype.itemsize):
                        if held >= onchip_most:
                            break
                        items = grad_onchip_items(dtype.itemsize, vec, threads, elements)
                        out.append(K.CHANNEL_GRAD_ONCHIP(t, p, flags, vec, training, threads, items, cluster))
                        held = max(held, threads * items * cluster * vec)
        for vec in _vector_widths(dtype):
            for last in (False, True):
                out.append(K.CHANNEL_GRAD_SUMS(t, vec, last))
                out.append(K.CHANNEL_GRAD_APPLY(t, vec, last))
    return out


def _numbers(args):
    """The int template arguments, a stage's own included."""
    for a in args:
        if isinstance(a, K.Stage):
            yield from _numbers(a.args)
        elif type(a) is int:
            yield a


def representative_kernels(kernels=None) -> list[Kernel]:
    """A subset of ``kernels`` (default: all_kernels()) that compiles every
    kernel declaration for every data type, and every norm policy for every
    data type: per group, the instantiation with the most work per thread
    (the product of its numeric template arguments, a stage's among them:
    vector width, vectors per thread, the store's flags), where register
    pressure and spills show first. The
    quick compile check without a GPU (``python -m cunorm``) and CI's check
    for the second architecture compile these; ``check --all`` and CI's
    first architecture compile everything."""
    kernels = all_kernels() if kernels is None else list(kernels)
    data_types = set(dtypes.KERNEL_TYPE.values())
    heaviest: dict[tuple, tuple[int, int]] = {}
    for i, k in enumerate(kernels):
        args = k.template_args
        data = next((a for a in args if a in data_types), None)
        work = 1
        for a in _numbers(args):
            if a > 0:
                work *= a
        groups = [(k.name, data)]
        if args and isinstance(args[0], str) and args[0] not in data_types:  # a norm or gradient policy
            groups.append((args[0], data))
        for group in groups:
            if group not in heaviest or work > heaviest[group][0]:
                heaviest[group] = (work, i)
    chosen = sorted({i for _, i in heaviest.values()})
    return [kernels[i] for i in chosen]
