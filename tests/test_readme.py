"""The docs say what is true: the README quotes every public op's
signature as inspect gives it and names every module of the package in its
layout; docs/performance.md holds the tables of the saved benchmark of
record."""
import inspect
from pathlib import Path

import cunorm

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()


def test_every_public_signature_is_quoted_exactly():
    for name in cunorm.__all__:
        fn = getattr(cunorm, name)
        if not inspect.isfunction(fn) or name == "precompile":
            continue
        assert f"`{name}{inspect.signature(fn)}`" in README, name


def test_the_layout_names_every_module():
    layout = README[README.index("## Layout"):README.index("## Documentation")]
    package = ROOT / "cunorm"
    for path in sorted(package.glob("*.py")):
        assert path.name in layout, path.name
    for sub in ("_interop", "_engine", "torch", "jax", "bench", "kernels"):
        assert f"{sub}/" in layout
        for path in sorted((package / sub).glob("*.py")) + sorted((package / sub).glob("*.cu")):
            if path.name != "__init__.py" or sub in ("torch", "jax", "bench"):
                assert path.name in layout, path.name


def test_performance_md_holds_the_record_tables():
    """docs/performance.md's tables of the benchmark of record are
    bench/record_tables.py's output for docs/bench/record.json, exactly."""
    import importlib.util
    import json

    spec = importlib.util.spec_from_file_location("record_tables", ROOT / "bench" / "record_tables.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    record = json.loads((ROOT / "docs" / "bench" / "record.json").read_text())
    assert module.block(record) in (ROOT / "docs" / "performance.md").read_text()
