"""The README says what is true of the code: every public op's signature
as inspect gives it, and every module of the package in its layout."""
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
    for sub in ("_interop", "kernels", "bench"):
        assert f"{sub}/" in layout
    for path in sorted((package / "_interop").glob("*.py")):
        if path.name != "__init__.py":
            assert path.name in layout, path.name
