#!/usr/bin/env bash
# compute-sanitizer's memcheck, racecheck, initcheck and synccheck over one
# call of every kernel, forward and backward (bench/tools/sanitize_calls.py).
# Usage (GPU machine, repo root; bench/device_run.sh runs it as its
# "sanitize" stage):  bash bench/tools/sanitize.sh
# Writes $OUT/sanitize-TOOL.log and prints each tool's error summary; exits
# non-zero when any tool reports an error or the calls fail.
set -u -o pipefail
OUT=${OUT:-/tmp/cunorm-out}
mkdir -p "$OUT"
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
rc=0
for tool in memcheck racecheck initcheck synccheck; do
  start=$SECONDS
  compute-sanitizer --tool "$tool" --error-exitcode 99 --print-limit 20 python3 bench/tools/sanitize_calls.py \
    > "$OUT/sanitize-$tool.log" 2>&1
  tool_rc=$?
  summary=$(grep -h "ERROR SUMMARY\|RACECHECK SUMMARY" "$OUT/sanitize-$tool.log" | tail -1)
  echo "$tool: exit $tool_rc, ${summary:-no summary line}, $(( SECONDS - start )) s"
  if [[ $tool_rc != 0 ]]; then
    grep -m 12 "=========\|not reached\|Error" "$OUT/sanitize-$tool.log"
    rc=1
  fi
done
grep -h "kernels reached" "$OUT/sanitize-memcheck.log" | cut -c1-200
exit $rc
