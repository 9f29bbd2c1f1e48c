#!/usr/bin/env bash
# One call on the GPU machine: the GPU test suite, then the benchmark.
# Usage (device tool, from the repo root):  bash bench/device_run.sh [--tune] [--no-compile]
# STAGES picks among "precompile" (every kernel, ahead of time, into a fresh
# cache: an honest time), "tests", "sanitize" (compute-sanitizer's four tools
# over every kernel, bench/tools/sanitize.sh), "bench" and "jax" (`python -m cunorm
# bench --suite jax`: cunorm.jax inside jax.jit against XLA's fusions)
# (default: all five; run them in separate calls within one lease and give
# the calls the same CUPY_CACHE_DIR, so the later reuse the kernels). The
# tests stage took about 9 minutes on an H100 without a precompile (3954
# tests, 3 workers): TESTS names the files or node ids it runs (default
# "tests"), so it can be split across two 10-minute calls.
# Writes under $OUT: gpu.txt, precompile.txt, check.txt, pytest-huge.log, pytest.log (pytest-serial.log),
# sanitize-*.log, bench.json, bench.md, bench.log, jax.md.
set -u -o pipefail
OUT=${OUT:-/tmp/cunorm-out}
mkdir -p "$OUT"
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
export CUPY_CACHE_DIR=${CUPY_CACHE_DIR:-$(mktemp -d)}
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.mem --format=csv | tee "$OUT/gpu.txt"
python3 -c "import cupy, torch, jax, numpy; print('cupy', cupy.__version__, 'torch', torch.__version__, 'jax', jax.__version__, 'numpy', numpy.__version__)" | tee -a "$OUT/gpu.txt"
STAGES=${STAGES:-precompile tests sanitize bench jax}
tests_rc=0 sanitize_rc=0 bench_rc=0 jax_rc=0
if [[ $STAGES == *precompile* ]]; then
  python3 -m cunorm precompile 2>&1 | tail -2 | tee "$OUT/precompile.txt"
fi
if [[ $STAGES == *tests* ]]; then
  python3 -m cunorm check 2>&1 | tee "$OUT/check.txt"
  # XLA's default allocator keeps what a jax test took; the workers share the GPU
  export XLA_PYTHON_CLIENT_ALLOCATOR=platform
  # The GPU tests plus the CPU tests that need no NVRTC offline compile.
  # The tests marked huge (tens of GB each) run alone first; the rest in
  # parallel, workers by GPU memory (a test process held up to 43 GB, and
  # parallel workers exhausted an 80 GB GPU together); whatever fails there runs again in one process by node id,
  # and that pass's verdict is the suite's (a real failure fails again).
  mem_mib=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits | head -1)
  workers=${PYTEST_WORKERS:-$(( mem_mib > 120000 ? 8 : 3 ))}
  tests=${TESTS:-tests}
  # shellcheck disable=SC2086
  python3 -m pytest -q -m huge $tests --ignore=tests/engine/test_compile.py 2>&1 | tee "$OUT/pytest-huge.log" | tail -3
  huge_rc=${PIPESTATUS[0]}
  [[ $huge_rc == 5 ]] && huge_rc=0  # none collected
  # shellcheck disable=SC2086
  python3 -m pytest -q -n "$workers" -m "not huge" $tests --ignore=tests/engine/test_compile.py 2>&1 \
    | tee "$OUT/pytest.log" | tail -25
  tests_rc=${PIPESTATUS[0]}
  if [[ $tests_rc != 0 ]]; then
    mapfile -t failed < <(grep '^FAILED ' "$OUT/pytest.log" | sed 's/^FAILED //; s/ - .*$//')
    if (( ${#failed[@]} > 0 )); then
      echo "== the ${#failed[@]} failures again, one process (pytest-serial.log)"
      python3 -m pytest -q "${failed[@]}" 2>&1 | tee "$OUT/pytest-serial.log" | tail -25
      tests_rc=${PIPESTATUS[0]}
    fi
  fi
  tests_rc=$(( tests_rc || huge_rc ))
  unset XLA_PYTHON_CLIENT_ALLOCATOR
fi
if [[ $STAGES == *sanitize* ]]; then
  bash bench/tools/sanitize.sh
  sanitize_rc=$?
fi
if [[ $STAGES == *bench* ]]; then
  python3 bench/bench.py --out "$OUT" "$@" 2>&1 | tee "$OUT/bench.log" | tail -40
  bench_rc=${PIPESTATUS[0]}
fi
if [[ $STAGES == *jax* ]]; then
  python3 -m cunorm bench --suite jax --no-progress --out "$(mktemp -d)/jax" 2>&1 | tee "$OUT/jax.md"
  jax_rc=${PIPESTATUS[0]}
fi
echo "pytest rc=$tests_rc sanitize rc=$sanitize_rc bench rc=$bench_rc jax rc=$jax_rc"
exit $(( tests_rc || sanitize_rc || bench_rc || jax_rc ))
