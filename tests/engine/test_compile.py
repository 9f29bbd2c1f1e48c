"""The kernels compile with NVRTC, with no local-memory spill (CPU: no GPU
needed). The default run compiles a representative set (every kernel and
every norm for every dtype, each at its most work a thread) for sm_80 and
sm_90, most of that run's 3 minutes on 2 cores. The full check, every
instantiation for sm_90, is marked ``full_compile`` and left out of the
default run (about 11 minutes on 2 cores): ``python -m pytest -m full_compile`` runs it, as CI
does, one test per kernel declaration so a run shows its progress, all of
them compiling in one pool of processes. ``python -m cunorm check --all``
compiles everything for both architectures.

The results are kept in build/compile-record (loader.CompileRecord, keyed
by NVRTC's version, the options and each family's source), so the full
check does not compile again what the default run compiled, and a second
run compiles only the families whose sources changed."""
import concurrent.futures
import functools
import os
import re
from pathlib import Path

import pytest

from cunorm._engine import catalogue, dispatch_grad, dispatch_rows, dtypes, declarations, loader

RECORD = loader.CompileRecord(Path(__file__).resolve().parents[2] / "build" / "compile-record")


@functools.lru_cache(maxsize=None)
def _all():
    return tuple(catalogue.all_kernels())


def _assert_compiled(arch, kernels, results):
    compiled = [r for r in results if not r.get("helper")]
    assert len(compiled) == len(kernels)
    spilled = [r for r in results if r.get("stack") or r.get("spill_stores") or r.get("spill_loads")]
    assert not spilled, f"{len(spilled)} kernels or their callees use local memory on {arch}, e.g. {spilled[:3]}"
    assert all(0 < r["registers"] <= 255 for r in compiled)


def _check(arch, kernels):
    _assert_compiled(arch, kernels, loader.compile_offline(arch, kernels, record=RECORD))


@pytest.fixture(scope="module")
def full_compile(request):
    """Every selected declaration's sm_90 instantiations the record does not
    hold, submitted at once to one pool (each test waits for its own, so
    no test waits on a half-idle pool's last batch): declaration name ->
    (kernels, [(family, future)])."""
    selected = [item.callspec.params["name"] for item in request.session.items
                if getattr(item, "originalname", None) == "test_every_instantiation_compiles_for_sm_90_without_spills"]
    jobs = os.cpu_count() or 1
    pool = concurrent.futures.ProcessPoolExecutor(max_workers=jobs)
    pending = {}
    for name in selected:
        kernels = [k for k in _all() if k.name == name]
        _, missing = RECORD.lookup("sm_90", kernels)
        pending[name] = (kernels, [(batch[0], pool.submit(loader.compile_batch, *batch))
                                   for batch in loader.offline_batches("sm_90", missing, jobs)])
    yield pending
    pool.shutdown(cancel_futures=True)


#: the declarations the catalogue instantiates (rows_resident, reached by an override only, is
#: test_resident_rows_compile_without_spills's)
CATALOGUED = [d.name for d in declarations.DECLARATIONS if d is not declarations.ROWS_RESIDENT]


@pytest.mark.full_compile
@pytest.mark.parametrize("name", CATALOGUED)
def test_every_instantiation_compiles_for_sm_90_without_spills(name, full_compile):
    kernels, batches = full_compile[name]
    assert kernels, f"the catalogue has no instantiation of {name}"
    for family, future in batches:
        RECORD.add("sm_90", family, future.result())
    found, missing = RECORD.lookup("sm_90", kernels)
    assert not missing
    _assert_compiled("sm_90", kernels, found)


def test_statistics_only_rows_compile_without_spills():
    """rows_cached without y (jit's unread y), its representative set, both
    architectures."""
    kernels = catalogue.representative_kernels(catalogue.statistics_only_kernels())
    assert len(kernels) >= 8 and all(k.template_args[2] == declarations.NO_STORE for k in kernels)
    _check("sm_90", kernels)
    _check("sm_80", kernels)


def test_quantized_rows_compile_without_spills():
    """rows_cached and rows_uncached with the quantizing store (quantize=),
    their representative set, both architectures (sm_80 converts to FP8 in
    software)."""
    # the most work a thread per kernel, norm, data type, load, block shape, format's conversion and
    # scaling (group scales: bounded or not alike, one fminf apart): the register pressure of forming
    # the row's scale shows at the most vectors a thread (rows_cached); rows_uncached's sweeps hold a
    # batch whatever the scaling (its heaviest: the row's scale under a bound, the widest vectors)
    heaviest = {}
    for k in catalogue.quantized_kernels():
        policy, t, store, load, vec, *cached = k.template_args
        vpt, block = cached or (0, None)
        params, flags, quantized, scaling, group_size = store.args
        group = (k.name, policy, t, load.name, block, quantized == "signed char",
                 -1 if group_size else scaling if cached else None, bool(group_size))
        work = (vpt, vec, flags, params == "float", scaling)
        if group not in heaviest or work > heaviest[group][0]:
            heaviest[group] = (work, k)
    kernels = [k for _, k in heaviest.values()]
    assert len(kernels) >= 150 and {k.name for k in kernels} == {"rows_cached", "rows_uncached"}
    _check("sm_90", kernels)
    _check("sm_80", kernels)


def test_conditioned_and_gated_rows_compile_without_spills():
    """rows_cached with per-row operands and the gate z, every
    instantiation the dispatch picks, for sm_90; the heaviest of each
    store, data type and block shape for sm_80."""
    kernels = catalogue.conditioned_kernels()
    stores = {k.template_args[2].args[1] for k in kernels}
    assert len(kernels) >= 100 and all(k.name == "rows_cached" for k in kernels)
    assert {s & 0x3f80 for s in stores} >= {0x80, 0x300, 0x380, 0x800, 0x1800}
    _check("sm_90", kernels)
    heaviest = {}
    for k in kernels:
        policy, t, store, load, vec, vpt, block = k.template_args
        group = (policy, t, store.args[1], load.name, block)
        if group not in heaviest or (vpt, vec) > heaviest[group][0]:
            heaviest[group] = ((vpt, vec), k)
    _check("sm_80", [k for _, k in heaviest.values()])


def test_resident_rows_compile_without_spills():
    """rows_resident (the resident tier, which only an override reaches, so
    outside the catalogue): the widest vector and the most parameters of
    each norm, data type and load, for sm_90."""
    heaviest = {}
    for k in catalogue.resident_kernels():
        policy, t, store, load, vec = k.template_args
        params, flags, _ = store.args
        group = (policy, t, load.name)
        work = (vec, flags, params == "float")
        if group not in heaviest or work > heaviest[group][0]:
            heaviest[group] = (work, k)
    kernels = [k for _, k in heaviest.values()]
    assert len(kernels) == 16 and {k.name for k in kernels} == {"rows_resident"}
    _check("sm_90", kernels)


@pytest.mark.parametrize("arch", [80, 90])
def test_the_float32_residual_backward_compiles_without_spills(arch):
    """rows_grad_wide (float32 h and dh in registers beside 16-bit dy): the
    heaviest parameters of each norm and block shape at 16-byte vectors."""
    heaviest = {}
    for k in catalogue.wide_grad_kernels():
        grad, t, p, flags, vec, vpt, most, fewest, multi = k.template_args
        if t == "cunorm::bf16_t" and vec == 8:
            group = (grad, vpt, most, fewest, multi)
            if group not in heaviest or (flags, p == "float") > heaviest[group][0]:
                heaviest[group] = ((flags, p == "float"), k)
    kernels = [k for _, k in heaviest.values()]
    assert len(kernels) >= 8
    _check(f"sm_{arch}", kernels)


@pytest.mark.parametrize("arch", [80, 90])
def test_representative_set_compiles_without_spills(arch):
    _check(f"sm_{arch}", catalogue.representative_kernels([k for k in _all() if k.min_arch <= arch]))


def test_representative_set_covers_every_kernel_norm_and_dtype():
    chosen = catalogue.representative_kernels(_all())
    assert len(chosen) < len(_all()) / 20
    types = set(dtypes.KERNEL_TYPE.values())
    want = {(k.name, next((a for a in k.template_args if a in types), None)) for k in _all()}
    assert {(k.name, next((a for a in k.template_args if a in types), None)) for k in chosen} == want
    policies = {(k.template_args[0], k.template_args[1]) for k in _all()
                if k.template_args and isinstance(k.template_args[0], str) and k.template_args[0] not in types}
    assert {(k.template_args[0], k.template_args[1]) for k in chosen
            if k.template_args and isinstance(k.template_args[0], str) and k.template_args[0] not in types} == policies
    # the heaviest of its group: rows_cached of float16 RMSNorm at 16-byte vectors and the most vectors per thread
    rms = [k for k in chosen if k.name == "rows_cached" and k.template_args[:2] == ("cunorm::RmsNorm", "cunorm::half_t")]
    assert rms and rms[0].template_args[4] == 8 and rms[0].template_args[5] == max(dispatch_rows.VECS_PER_THREAD_CHOICES)


def test_source_inlines_every_header():
    for family in ("rows", "rows_streamed", "strided", "backward", "backward_streamed", "channels",
                   "channel_stream"):
        src = loader.source(family)
        assert not re.search(r'#\s*include\s+"', src)
        for header in ("common.cuh", "norms.cuh", "reduce.cuh"):
            body = (loader.KERNEL_DIR / header).read_text()
            # a distinctive line of each header appears in the compiled source
            line = next(l for l in body.splitlines() if l.startswith("struct") or "__device__" in l)
            assert line in src, (family, header)


def test_compile_error_is_reported():
    bad = [dispatch_rows.Kernel("rows", "cunorm::rows_cached<cunorm::RmsNorm, int, int, 3, 1, true>")]
    with pytest.raises(RuntimeError, match="NVRTC failed"):
        loader.compile_offline("sm_90", bad)


def test_strided_backward_at_its_cache_budget_compiles_without_spills_for_sm_80():
    """strided_grad_cached holding the most x and dy its budget allows (the
    sm_90 check is the full compile's); sm_80's ptxas spilled float64's
    LayerNorm at twice the budget."""
    kernels = []
    for k in catalogue.backward_kernels():
        if k.name != "strided_grad_cached":
            continue
        grad, t, p, flags, vec, cpt = k.template_args
        itemsize = {"double": 8, "float": 4}.get(t, 2)
        if 2 * cpt * vec * itemsize == dispatch_grad.strided_grad_cache_bytes(itemsize):
            kernels.append(k)
    assert len(kernels) >= 100
    _check("sm_80", kernels)


def test_modulated_backward_compiles_without_spills():
    """The fused modulated backward's kernels (catalogue.modulated_grad_kernels)
    for sm_80, where registers run out first: of each norm, dtype,
    parameter dtype, modulation, vector width and register bound the one
    with the most parameters and vectors a thread, and the heaviest
    modulated_grad_sums of each dtype and column width (-m full_compile
    compiles them all for sm_90)."""
    kernels = catalogue.modulated_grad_kernels()
    assert len(kernels) >= 1000 and {k.name for k in kernels} == {"rows_grad_modulated", "modulated_grad_sums"}
    heaviest = {}
    for k in kernels:
        if k.name == "rows_grad_modulated":
            grad, t, p, flags, modf, vec, vpt, max_threads, min_blocks = k.template_args
            # (3 blocks of 256 allow the fewest registers; 2 of 256 and 1 of 512 both 128)
            key = (grad, t, p, modf, vec, min_blocks == 3)
            if key not in heaviest or (flags, vpt) > heaviest[key][0]:
                heaviest[key] = ((flags, vpt), k)
    # modulated_grad_sums (a tile of column sums, 255 registers allowed): of each accumulation and
    # parameter dtype and column width, the one with the most parameters, modulation and outputs
    sums = {}
    for k in kernels:
        if k.name == "modulated_grad_sums":
            a, p, flags, modf, outs, columns = k.template_args
            if (a, p, columns) not in sums or (flags, modf, outs) > sums[(a, p, columns)][0]:
                sums[(a, p, columns)] = ((flags, modf, outs), k)
    _check("sm_80", [k for _, k in heaviest.values()] + [k for _, k in sums.values()])


def test_offline_batches_cover_each_kernel_once_in_small_batches():
    kernels = [k for k in _all() if k.name in ("rows_cached", "residual_add", "channel_from_running")]
    for jobs in (1, 2, 3):
        batches = loader.offline_batches("sm_90", kernels, jobs)
        assert sorted(e for _, expressions, _ in batches for e in expressions) == sorted(k.expression for k in kernels)
        assert all(0 < len(b[1]) <= loader.OFFLINE_BATCH and b[2] == "sm_90" for b in batches)
        rows = [b for b in batches if b[0] == "rows"]
        assert len(rows) % jobs == 0  # (as many batches a process, where a family has enough)
    assert len(loader.offline_batches("sm_90", [k for k in _all() if k.name == "channel_from_running"], 8)) == 2


def test_the_compile_record_answers_what_it_holds_for_the_same_sources(tmp_path, monkeypatch):
    """compile_offline with a record: what was compiled (and the helpers
    its batch reported) comes back without compiling; another architecture
    or a changed source compiles again."""
    compiled = []

    def compile_batch(family, expressions, arch):
        compiled.extend(expressions)
        return ([{"expression": e, "registers": 40 + len(compiled)} for e in expressions]
                + [{"expression": "_helper", "registers": 8, "helper": True}])

    monkeypatch.setattr(loader, "compile_batch", compile_batch)
    kernels = [k for k in _all() if k.name == "residual_add"][:5]
    record = loader.CompileRecord(tmp_path)
    first = loader.compile_offline("sm_90", kernels, jobs=1, record=record)
    assert sorted(compiled) == sorted(k.expression for k in kernels)
    compiled.clear()
    again = loader.compile_offline("sm_90", kernels[:3], jobs=1, record=record)
    assert compiled == []
    kept = {r["expression"]: r["registers"] for r in first if not r.get("helper")}
    assert {r["expression"]: r["registers"] for r in again if not r.get("helper")} == {
        k.expression: kept[k.expression] for k in kernels[:3]}
    assert [r["expression"] for r in again if r.get("helper")] == ["_helper"]
    loader.compile_offline("sm_80", kernels[:1], jobs=1, record=record)
    assert compiled == [kernels[0].expression]
    compiled.clear()
    monkeypatch.setattr(loader.CompileRecord, "_key", staticmethod(lambda family: "another source"))
    loader.compile_offline("sm_90", kernels[:2], jobs=1, record=record)
    assert sorted(compiled) == sorted(k.expression for k in kernels[:2])
