"""python -m cunorm bench: the suites' cases, the report files and the
no-GPU exit on the CPU; one quick case end to end on the GPU."""
import csv
import json
import math

import pytest

from cunorm import bench
from cunorm.__main__ import main as cli_main
from conftest import HAS_GPU


def test_suites_cover_the_issue():
    kb = bench.cases(("kernelbench",))
    assert [c.name.split()[0] for c in kb[:8]] == [str(p) for p in range(33, 41)]
    # the real activations of issue 24: ResNet-50's BatchNorm (fp32, bf16, train and eval), a UNet's
    # GroupNorm(32) in bf16 both layouts, style-transfer InstanceNorm
    real = kb[8:]
    bn = {(c.args[1], c.args[2], "eval" in c.args[5]) for c in real if c.args[0] == "batch_norm"}
    assert bn == {(s, d, e) for s in bench.RESNET_BN for d in ("float32", "bfloat16") for e in (False, True)}
    gn = {(c.args[1], c.args[4]) for c in real if c.args[0] == "group_norm"}
    assert gn == {(s, 1) for s in bench.UNET_GN} | {((s[0], *s[2:], s[1]), -1) for s in bench.UNET_GN}
    assert all(c.args[3] == 32 and c.args[2] == "bfloat16" for c in real if c.args[0] == "group_norm")
    assert {c.args[1] for c in real if c.args[0] == "instance_norm"} == set(bench.STYLE_IN)
    assert {c.args[1] for c in bench.cases(("backward",)) if c.args[0] == "batch"} >= {(64, 256, 56, 56)}
    # problems at their full shapes (ops.md)
    shapes = {c.name.split()[0]: c.args[1] for c in kb}
    assert shapes["35"] == (112, 64, 512, 512) and shapes["33"] == (64, 64, 512, 512)
    assert shapes["38"] == (32768, 65535) and shapes["40"] == (16, 64, 256, 256)
    llm = bench.cases(("llm",))
    hidden = {c.args[1][1] for c in llm}
    assert hidden == set(bench.LLM_HIDDEN) and min(hidden) == 1024 and max(hidden) == 32768
    assert {c.args[2] for c in llm} == {"bfloat16", "float16", "float32"}
    assert {c.args[5] for c in llm} == {False, True}
    assert {c.op for c in bench.cases(("sweep",))} >= {"rms_norm", "layer_norm", "group_norm", "instance_norm",
                                                       "batch_norm", "normalize", "frobenius_normalize"}
    assert len(bench.cases(("backward",))) >= 4
    assert bench.cases(("host",)) == []  # its rows come from _host.host_rows


def test_torch_compile_columns_compile_each_case_static(monkeypatch):
    """The torch.compile columns compile every case afresh with static
    shapes: one function compiled over many shapes would otherwise time a
    dynamic-shape kernel from the second case on (and eager past dynamo's
    recompile limit)."""
    torch = pytest.importorskip("torch")
    from pathlib import Path
    from cunorm.bench import _timing

    calls = []
    monkeypatch.setattr(torch._dynamo, "reset", lambda: calls.append("reset"))
    monkeypatch.setattr(torch, "compile", lambda fn, **kw: calls.append(kw) or fn)
    fn = _timing.compile_static(len)
    assert fn is len and calls == ["reset", {"dynamic": False}]
    root = Path(bench.__file__).parent
    for path in sorted(root.glob("_*cases.py")) + sorted((root.parents[1] / "bench").glob("*.py")):
        for line in path.read_text().splitlines():
            if "torch.compile(" in line and not line.lstrip().startswith("#"):
                assert "dynamic=False" in line, f"{path.name}: {line.strip()}"


def test_quick_shapes_are_smaller():
    for suite in set(bench.SUITES) - {"host", "models", "jax"}:  # (suites without per-case shapes)
        full = sum(c.x_bytes for c in bench.cases((suite,)))
        quick = sum(c.x_bytes for c in bench.cases((suite,), quick=True))
        assert quick < full / 10, suite
    # every quick case is small enough for a minute's run
    assert max(c.x_bytes for c in bench.cases(bench.SUITES, quick=True)) <= 300 << 20


def test_sweep_shapes_hold_their_size():
    for c in bench.cases(("sweep",)):
        assert c.x_bytes == math.prod(c.args[1]) * 4, c.name


def test_unknown_suite():
    with pytest.raises(ValueError, match="unknown suite"):
        bench.cases(("nope",))


def _fake_result():
    meta = {"gpu": "Test GPU", "driver": "1.0", "date": "2026-11-21", "commit": "abc1234", "quick": True,
            "suites": ["kernelbench", "sweep"], "copy_gbps": 4000.0, "versions": {"cunorm": "0"}}
    rows = [
        {"suite": "kernelbench", "case": "35 group_norm(8)", "series": "group_norm", "tier": "channels",
         "shape": [4, 64, 512, 512], "dtype": "float32", "bytes": 1 << 28, "ms": 0.1, "ms_min": 0.09,
         "ms_max": 0.12, "gbps": 2684.0, "floor_pct": 67.1, "torch_ms": 0.2, "torch_speedup": 2.0,
         "max_rel_err": 1e-6},
        {"suite": "kernelbench", "case": "38 mean_abs_normalize", "series": "x", "skipped": "needs about 90 GiB"},
    ] + [{"suite": "sweep", "case": f"rms_norm {n}", "series": "rms_norm", "bytes": n, "ms": n / 3e9,
          "ms_min": n / 3e9, "ms_max": n / 3e9, "gbps": 3000.0, "floor_pct": 75.0, "torch_ms": n / 1e9}
         for n in (1 << 20, 1 << 24)]
    return {"meta": meta, "cases": rows}


def test_report_files(tmp_path):
    result = _fake_result()
    paths = bench.write_results(result, tmp_path)
    names = {p.name for p in paths}
    assert {"results.json", "results.csv", "results.md"} <= names
    assert json.loads((tmp_path / "results.json").read_text())["meta"]["gpu"] == "Test GPU"
    with open(tmp_path / "results.csv") as fh:
        lines = list(csv.reader(fh))
    assert "Test GPU" in lines[0][0] and "abc1234" in lines[0][0]
    assert lines[1] == list(bench.COLUMNS) and len(lines) == 2 + len(result["cases"])
    table = bench.format_table(result)
    assert "Test GPU" in table and "4000 GB/s" in table and "skipped: needs about 90 GiB" in table
    assert "2.00" in table  # the speed-up over torch eager
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return
    assert {"sweep.png", "speedup.png"} <= names
    assert (tmp_path / "sweep.png").read_bytes()[:4] == b"\x89PNG"


def test_plot_from_saved_run(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    saved = tmp_path / "results.json"
    saved.write_text(json.dumps(_fake_result()))
    assert cli_main(["bench", "--plot", str(saved), "--out", str(tmp_path / "plots")]) == 0
    assert (tmp_path / "plots" / "sweep.png").exists()


def test_the_jax_suite_has_the_issue_cases_and_its_table():
    from cunorm.bench import _jax

    full = {(op, shape) for op, shape, _, _ in _jax.cases()}
    assert full == {("rms_norm", (32768, 4096)), ("rms_norm", (4096, 32768)), ("layer_norm", (32768, 4096)),
                    ("layer_norm", (4096, 32768)), ("group_norm(32) NHWC", (8, 64, 64, 320))}
    quick = [math.prod(shape) for _, shape, _, _ in _jax.cases(quick=True)]
    assert len(quick) == len(full) and sum(quick) < sum(math.prod(s) for _, s in full) / 4
    result = _fake_result()
    result["jax"] = [{"op": "rms_norm", "shape": "(8, 8)", "cunorm_fwd_ms": 0.2, "xla_fwd_ms": 0.3, "fwd_speedup": 1.5,
                      "fwd_floor_pct": 70.0, "cunorm_train_ms": 0.5, "xla_train_ms": 0.5, "train_speedup": 1.0,
                      "cunorm_read_ms": 0.6, "xla_read_ms": 0.75, "read_speedup": 1.25, "agreement": 3e-3},
                     {"op": "layer_norm", "shape": "(8, 8)", "skipped": "ImportError: no jax"}]
    for markdown in (False, True):
        table = bench.format_table(result, markdown=markdown)
        assert "XLA fwd ms" in table and "1.50" in table and "skipped: ImportError: no jax" in table
        assert "y read: cunorm ms" in table and "1.25" in table


@pytest.mark.skipif(HAS_GPU, reason="checks the no-GPU path")
def test_no_gpu_exits_2(capsys):
    assert cli_main(["bench", "--quick"]) == bench.NO_GPU_EXIT == 2
    out = capsys.readouterr().out
    assert "No CUDA GPU" in out and "representative set" in out and "check --all" in out


@pytest.mark.gpu
def test_quick_case_end_to_end(tmp_path):
    result = bench.run(("llm",), quick=True, only="rms_norm bf16 1024x1024", progress=False)
    (row,) = [r for r in result["cases"] if r["case"] == "rms_norm bf16 1024x1024"]
    assert result["meta"]["copy_gbps"] > 100
    assert row["ms"] > 0 and row["ms_min"] <= row["ms"] <= row["ms_max"]
    assert 0 < row["floor_pct"] < 150 and row["max_rel_err"] < 1e-2
    assert not math.isnan(row["max_rel_err"])
    bench.write_results(result, tmp_path)
    assert (tmp_path / "results.csv").exists()


@pytest.mark.parametrize("command,says", [("check", "--jobs"), ("precompile", "CuPy's disk cache")])
def test_each_command_has_its_own_help(command, says, capsys):
    """``python -m cunorm COMMAND --help`` prints that command's usage and
    options, not the top-level help."""
    with pytest.raises(SystemExit) as exit_:
        cli_main([command, "--help"])
    assert exit_.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith(f"usage: python -m cunorm {command}") and says in out


def test_sass_mix_reads_nsight_computes_source_page(capsys, monkeypatch):
    """bench/tools/sass_mix.py: opcodes with their predicates stripped,
    counts with thousands separators, the all-samples stall columns only."""
    import importlib.util
    import sys
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "bench" / "tools" / "sass_mix.py"
    spec = importlib.util.spec_from_file_location("sass_mix", path)
    sass_mix = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "sass_mix", sass_mix)  # (its dataclass looks itself up there)
    spec.loader.exec_module(sass_mix)
    header = ('"Address","Source","Instructions Executed","stall_long_sb","stall_wait",'
              '"stall_long_sb (Not Issued)"')
    text = "\n".join([
        '"Kernel Name","k1",',
        header,
        '"0x0","LDG.E.128 R4, desc[UR6][R2.64]","1,000","30","10","99"',
        '"0x10","@!P0  FFMA R1, R2, R3, R4","3,000","0","20","99"',
        '"0x20","FFMA R1, R2, R3, R4","1,000","20","20","99"',
        '"Kernel Name","k2",',
        header,
        '"0x0","EXIT","5","0","0","0"',
    ]).splitlines()
    kernels = sass_mix.read_kernels(text)
    assert [k.name for k in kernels] == ["k1", "k2"]
    total, ops, stalls = sass_mix.mix(kernels[0])
    assert total == 5000 and ops == {"FFMA": 4000, "LDG": 1000}
    assert stalls == {"long_sb": 50, "wait": 50}
    sass_mix.report(kernels, "k1")
    out = capsys.readouterr().out
    assert "== k1" in out and "k2" not in out and "FFMA 80.0%" in out and "long_sb 50.0%" in out
