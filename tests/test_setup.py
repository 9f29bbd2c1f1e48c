"""A newcomer's first commands (CPU): the GPU detection of the test suite,
``cunorm.precompile()`` and ``python -m cunorm`` without a GPU."""
import re
import subprocess

import pytest

import conftest
import cunorm
from cunorm import __main__ as cli
from cunorm._engine import catalogue, loader
from conftest import HAS_GPU


def _no_device(monkeypatch):
    import cupy

    def fail():
        raise cupy.cuda.runtime.CUDARuntimeError(35)  # cudaErrorInsufficientDriver

    monkeypatch.setattr(cupy.cuda.runtime, "getDeviceCount", fail)
    monkeypatch.delenv("CUNORM_TEST_CPU_ONLY", raising=False)


def test_gpu_present_but_unusable_stops_the_suite(monkeypatch):
    _no_device(monkeypatch)
    monkeypatch.setattr(conftest, "_nvidia_gpu_present", lambda: True)
    with pytest.raises(pytest.UsageError, match="GPU is present but CuPy cannot use it"):
        conftest._gpu_available()
    monkeypatch.setenv("CUNORM_TEST_CPU_ONLY", "1")
    assert conftest._gpu_available() is False


def test_no_gpu_skips_the_gpu_tests(monkeypatch):
    _no_device(monkeypatch)
    monkeypatch.setattr(conftest, "_nvidia_gpu_present", lambda: False)
    assert conftest._gpu_available() is False


@pytest.mark.skipif(HAS_GPU, reason="checks the no-GPU path")
def test_precompile_without_gpu_says_so_and_starts_nothing(monkeypatch):
    def no_process(*args, **kwargs):
        raise AssertionError("precompile started a process without a GPU")

    monkeypatch.setattr(subprocess, "Popen", no_process)
    with pytest.raises(RuntimeError, match="no CUDA GPU found.*python -m cunorm check"):
        cunorm.precompile(jobs=4)


def test_precompile_worker_reads_its_share(monkeypatch):
    got = []
    monkeypatch.setattr(loader, "get_function", lambda family, expression, cooperative: got.append(
        (family, expression, cooperative)))
    kernels = catalogue.representative_kernels()[:5]
    lines = [f"{k.family} {int(k.cooperative)} {k.expression}" for k in kernels] + [""]
    assert loader._compile_share(lines) == len(kernels)
    assert got == [(k.family, k.expression, k.cooperative) for k in kernels]


@pytest.mark.skipif(HAS_GPU, reason="checks the no-GPU path")
@pytest.mark.parametrize("everything", [False, True])
def test_check_without_gpu_compiles_the_representative_set(monkeypatch, capsys, everything):
    asked = []

    def compile_offline(arch, kernels, jobs=None, progress=None):
        asked.append((arch, len(kernels), jobs))
        if progress:
            progress(len(kernels), len(kernels))
        return [{"expression": k.expression, "registers": 32} for k in kernels]

    monkeypatch.setattr(loader, "compile_offline", compile_offline)
    assert cli.main(["check", "--jobs", "3"] + (["--all"] if everything else [])) == 0
    kernels = catalogue.all_kernels()
    sm80 = [k for k in kernels if k.min_arch <= 80]  # (no thread-block clusters)
    assert len(sm80) < len(kernels)
    n80, n90 = (len(ks if everything else catalogue.representative_kernels(ks)) for ks in (sm80, kernels))
    assert asked == [("sm_80", n80, 3), ("sm_90", n90, 3)]
    out = capsys.readouterr().out
    assert "No CUDA GPU found" in out and f"sm_90: {n90} kernels" in out
    assert ("check --all" in out) != everything


@pytest.mark.parametrize("front,extra", [("torch", "cunorm[torch]"), ("jax", "cunorm[jax]")])
def test_a_front_end_without_its_framework_names_the_extra(monkeypatch, front, extra):
    """``import cunorm.torch`` (cunorm.jax) where torch (jax) is not
    installed: ModuleNotFoundError naming the extra to install."""
    import importlib
    import sys

    monkeypatch.setitem(sys.modules, front, None)  # (import of it then fails as if not installed)
    monkeypatch.delitem(sys.modules, f"cunorm.{front}", raising=False)
    with pytest.raises(ModuleNotFoundError, match=rf"cunorm\.{front} needs .* pip install '{re.escape(extra)}'"):
        importlib.import_module(f"cunorm.{front}")


def test_bench_plot_without_matplotlib_fails_with_the_extra(monkeypatch, tmp_path, capsys):
    import json
    import sys

    from cunorm import bench

    monkeypatch.setitem(sys.modules, "matplotlib", None)
    saved = tmp_path / "results.json"
    saved.write_text(json.dumps({"meta": {"gpu": "Test", "date": "d", "commit": "c", "copy_gbps": 1.0},
                                 "cases": []}))
    assert cli.main(["bench", "--plot", str(saved), "--out", str(tmp_path / "plots")]) == bench.NO_PLOT_EXIT != 0
    assert "pip install 'cunorm[bench]'" in capsys.readouterr().err


@pytest.mark.parametrize("jobs", ["0", "-1", "two"])
def test_check_refuses_a_bad_job_count_up_front(jobs, capsys):
    with pytest.raises(SystemExit) as exit_:
        cli.main(["check", "--jobs", jobs])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert "--jobs" in err and ("at least 1" in err or "whole number" in err)


def test_bench_help_is_plain_text(capsys):
    with pytest.raises(SystemExit):
        cli.main(["bench", "--help"])
    out = capsys.readouterr().out
    assert "``" not in out and "about 30 s" in out and "kernelbench:" in out
