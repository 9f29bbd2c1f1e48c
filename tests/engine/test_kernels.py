"""The kernel declarations (cunorm/_engine/declarations.py) against the .cu sources:
every __global__ kernel is declared, with its template parameters and its
arguments' names and kinds as the C++ writes them (CPU only)."""
from __future__ import annotations

import re

import pytest

from cunorm._engine import declarations
from cunorm._engine.loader import KERNEL_DIR


def _split_top(text: str) -> list[str]:
    """Split on commas outside <> and ()."""
    parts, depth, current = [], 0, []
    for ch in text:
        if ch in "<(":
            depth += 1
        elif ch in ">)":
            depth -= 1
        if ch == "," and depth == 0:
            parts.append("".join(current).strip())
            current = []
        else:
            current.append(ch)
    if "".join(current).strip():
        parts.append("".join(current).strip())
    return parts


def _balanced(text: str, start: int, open_ch: str, close_ch: str) -> tuple[str, int]:
    """The text inside the bracket opening at text[start], and the index after it."""
    depth = 0
    for i in range(start, len(text)):
        if text[i] == open_ch:
            depth += 1
        elif text[i] == close_ch:
            depth -= 1
            if depth == 0:
                return text[start + 1 : i], i + 1
    raise ValueError("unbalanced")


def _kind(ctype: str) -> str:
    """An argument's kind as the C++ writes it: a pointer is "in" where it
    points to const, "out" (or "io": the declaration says which) where not."""
    words = ctype.replace("__restrict__", " ").replace("*", " * ").split()
    if "*" in words:
        pointee_const = "const" in words and words.index("const") < words.index("*")
        return "in" if pointee_const else "out"
    ctype = " ".join(w for w in words if w != "const")
    if ctype == "long long":
        return "i64"
    if ctype == "int":
        return "i32"
    if ctype in ("A", "typename AccOf<T>::type"):
        return "acc"
    raise AssertionError(f"an argument type the declarations do not know: {ctype!r}")


def parse_kernels(source: str) -> dict[str, tuple[tuple[str, ...], tuple[tuple[str, str], ...]]]:
    """name -> (template parameter names, ((arg, kind), ...)) of each __global__."""
    source = re.sub(r"//[^\n]*", "", source)
    found = {}
    for match in re.finditer(r"__global__", source):
        head = source.rfind("\ntemplate", 0, match.start()) + 1  # a kernel's template starts its line
        template, _ = _balanced(source, source.index("<", head), "<", ">")
        tparams = tuple(re.findall(r"(\w+)\s*$", p)[0] for p in _split_top(template))
        # the kernel's name: the identifier before the first '(' after the
        # launch bounds' balanced parentheses (and the cluster size's)
        rest = match.end()
        bounds = source.index("__launch_bounds__", rest)
        _, after_bounds = _balanced(source, source.index("(", bounds), "(", ")")
        cluster = re.compile(r"\s*CUNORM_CLUSTER_DIMS\s*\(").match(source, after_bounds)
        if cluster:  # the cluster-size attribute of a clustered kernel
            _, after_bounds = _balanced(source, cluster.end() - 1, "(", ")")
        name_match = re.compile(r"\s*(\w+)\s*\(").match(source, after_bounds)
        name = name_match.group(1)
        params, _ = _balanced(source, name_match.end() - 1, "(", ")")
        args = []
        for p in _split_top(params):
            arg = re.findall(r"(\w+)\s*$", p)[0]
            args.append((arg, _kind(p[: p.rindex(arg)])))
        found[name] = (tparams, tuple(args))
    return found


def _all_sources():
    out = {}
    for path in sorted(KERNEL_DIR.glob("*.cu")):
        for name, sig in parse_kernels(path.read_text()).items():
            out[name] = (path.stem, *sig)
    return out


SOURCES = _all_sources()


def test_every_kernel_is_declared_once():
    declared = [d.name for d in declarations.DECLARATIONS]
    assert len(declared) == len(set(declared))
    assert sorted(declared) == sorted(SOURCES)


@pytest.mark.parametrize("decl", declarations.DECLARATIONS, ids=lambda d: d.name)
def test_declaration_matches_the_source(decl):
    family, template, args = SOURCES[decl.name]
    assert decl.family == family
    assert decl.template == template
    # "io" (updated in place) is a non-const pointer the declaration names so
    assert tuple((n, "out" if k == "io" else k) for n, k in decl.args) == args


@pytest.mark.parametrize("decl", declarations.DECLARATIONS, ids=lambda d: d.name)
def test_pointers_read_come_before_pointers_written(decl):
    """XLA's custom call binds the pointer arguments to its operands, then to
    its results, in order (cunorm/jax/_jit.py)."""
    kinds = [k for _, k in decl.args if k in declarations.POINTER_KINDS]
    first_out = kinds.index("out") if "out" in kinds else len(kinds)
    assert all(k == "out" for k in kinds[first_out:]), decl.args


def test_the_parser_sees_a_changed_signature():
    src = ("template <class T, int VEC>\n__global__ void __launch_bounds__(256, 4)\n"
           "residual_add(const T* __restrict__ x, const T* __restrict__ r, T* __restrict__ h, int n_vec) {}")
    (tparams, args), = parse_kernels(src).values()
    assert tparams == ("T", "VEC")
    assert args[-1] == ("n_vec", "i32") != declarations.RESIDUAL_ADD.args[-1]
    assert args[:3] == (("x", "in"), ("r", "in"), ("h", "out")) == declarations.RESIDUAL_ADD.args[:3]


def test_instantiation_resolves_the_accumulation_kind():
    k32 = declarations.RESIDUAL_ADD("float", 4)
    assert k32.expression == "cunorm::residual_add<float, 4>"
    k64 = declarations.ROWS_GRAD_FINALIZE("cunorm::RmsGrad<double>", "double")
    assert dict(k64.signature)["eps"] == "f64"
    store = declarations.affine_store("float", 1, "cunorm::bf16_t")
    load = declarations.row_load("cunorm::bf16_t", False)
    kernel = declarations.ROWS_CACHED("cunorm::RmsNorm", "cunorm::bf16_t", store, load, 8, 4, True)
    assert dict(kernel.signature)["eps"] == "f32"
    assert kernel.expression == ("cunorm::rows_cached<cunorm::RmsNorm, cunorm::bf16_t, "
                                 "cunorm::AffineStore<float, 1, cunorm::bf16_t>, cunorm::XLoad<cunorm::bf16_t>, 8, 4, "
                                 "true>")


@pytest.mark.parametrize("bad", ["float; }", "x\ny", 1.5, None, "a\"b"])
def test_template_arguments_from_closed_sets_only(bad):
    with pytest.raises(TypeError):
        declarations.RESIDUAL_ADD(bad, 4)
    with pytest.raises(TypeError):  # a stage's own arguments too
        declarations.ROWS_SPLIT_PARTIAL("cunorm::RmsNorm", "float", declarations.row_load(bad, False), 4)


def test_every_kernel_first_waits_for_the_grid_before_it():
    """A Program launches its later steps as programmatic dependent launches
    (cunorm/_engine/launches.py), which is safe only because every kernel's
    first statement waits for the grid before it (grid_dependency_sync)."""
    for path in sorted(KERNEL_DIR.glob("*.cu")):
        source = re.sub(r"//[^\n]*", "", path.read_text())
        starts = [source.index("{", m.end()) for m in re.finditer(r"__global__", source)]
        assert starts, path.name
        for start in starts:
            first = source[start + 1:].lstrip()
            assert first.startswith("grid_dependency_sync();"), f"{path.name}: {first[:60]!r}"
