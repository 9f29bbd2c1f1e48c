"""The package's shape: the layers docs/design.md describes, read from the
code. Imports are read from every module's syntax tree, those inside
functions included."""
import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent / "cunorm"

#: the front ends and the layers above them: the engine imports none of them
ABOVE_ENGINE = ("cunorm.torch", "cunorm.jax", "cunorm.norms", "cunorm.backward", "cunorm.bench", "cunorm.__main__")
#: the public array layer, which routes to the front ends: they never import it
PUBLIC = ("cunorm.norms", "cunorm.backward")


def _name(path: Path) -> str:
    parts = list(path.relative_to(ROOT.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _modules() -> dict[str, Path]:
    return {_name(p): p for p in ROOT.rglob("*.py")}


def _imports(name: str, path: Path, modules) -> set[str]:
    """The cunorm modules ``name`` imports (a name imported from a package
    counts as that submodule where it is one)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            for a in node.names:
                full = f"{target}.{a.name}"
                found.add(full if full in modules else target)
    return {m for m in found if m in modules and m != name}


def _graph():
    modules = _modules()
    return {name: _imports(name, path, modules) for name, path in modules.items()}


def _within(name: str, prefixes) -> bool:
    return any(name == p or name.startswith(p + ".") for p in prefixes)


def test_no_import_cycle():
    graph = _graph()
    state, stack, cycles = {}, [], []

    def visit(v):
        state[v] = 1
        stack.append(v)
        for w in sorted(graph[v]):
            if state.get(w) == 1:
                cycles.append(stack[stack.index(w):] + [w])
            elif w not in state:
                visit(w)
        stack.pop()
        state[v] = 2

    for v in sorted(graph):
        if v not in state:
            visit(v)
    assert not cycles, f"import cycles: {cycles}"


def test_the_engine_imports_no_front_end():
    graph = _graph()
    wrong = {m: sorted(i for i in imports if _within(i, ABOVE_ENGINE))
             for m, imports in graph.items() if _within(m, ("cunorm._engine", "cunorm._interop"))}
    assert not {m: i for m, i in wrong.items() if i}


def test_the_front_ends_do_not_import_the_public_layer():
    graph = _graph()
    wrong = {m: sorted(i for i in imports if _within(i, PUBLIC))
             for m, imports in graph.items() if _within(m, ("cunorm.torch",))}
    assert not {m: i for m, i in wrong.items() if i}


@pytest.mark.parametrize("suffix, most", [(".py", 600), (".cu", 800)])
def test_module_sizes(suffix, most):
    sizes = {str(p.relative_to(ROOT.parent)): len(p.read_text().splitlines()) for p in ROOT.rglob(f"*{suffix}")}
    assert sizes and not {p: n for p, n in sizes.items() if n > most}


_DIARY = re.compile(r"\b20\d\d-[01]\d-[0-3]\d\b|\b[Ii]ssues? #?\d+|\b(?=[0-9a-f]*[a-f])(?=[0-9a-f]*\d)[0-9a-f]{7,40}\b")


def test_no_dates_hashes_or_issue_numbers_in_the_code():
    """Comments say the rule and point to the docs; the docs hold dates and
    runs (hex literals, 0x..., are numbers, not hashes)."""
    found = []
    for p in list(ROOT.rglob("*.py")) + list(ROOT.rglob("*.cu")) + list(ROOT.rglob("*.cuh")):
        for i, line in enumerate(p.read_text().splitlines(), 1):
            for m in _DIARY.finditer(line):
                if not line[max(0, m.start() - 2):m.start()].endswith("0x"):
                    found.append(f"{p.relative_to(ROOT.parent)}:{i}: {m.group(0)}")
    assert not found
