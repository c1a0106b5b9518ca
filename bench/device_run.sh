#!/usr/bin/env bash
# One call on the GPU machine: compile the kernels, run the GPU tests and the sanitizers, run the
# benchmark. Full logs go to $OUT; a short summary is printed last.
#
#   bash bench/device_run.sh [all|tests|bench|sanitize] [extra pytest args...]
#
# Runs from the source tree (PYTHONPATH=.) on the machine's own packages.
set -uo pipefail
cd "$(dirname "$0")/.."
MODE=${1:-all}
shift || true
export OUT=${OUT:-/tmp/cuflash_out}
mkdir -p "$OUT"
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
export CUPY_CACHE_DIR=${CUPY_CACHE_DIR:-/tmp/cuflash_cupy_cache}
PY=${PYTHON:-python3}
SUMMARY=$OUT/summary.txt
: > "$SUMMARY"
say() { echo "$*" | tee -a "$SUMMARY"; }

nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.max.sm --format=csv,noheader \
  | tee "$OUT/gpu.txt"
$PY -c "import cupy, torch; print('cupy', cupy.__version__, 'torch', torch.__version__)" | tee -a "$OUT/gpu.txt"

if [[ $MODE == all || $MODE == tests || $MODE == sanitize ]]; then
  # First-call compile time of single configurations, each alone and from an empty cache.
  rm -rf "$CUPY_CACHE_DIR"
  CUPY_CACHE_DIR=/tmp/cuflash_cold_cache $PY -m cuflash.precompile --jobs 1 --dtype bfloat16 float32 \
    --head-dim 64 128 256 > "$OUT/compile_cold.log" 2>&1
  say "cold compile, one process: $(tail -1 "$OUT/compile_cold.log")"
  head -3 "$OUT/compile_cold.log" | tee -a "$SUMMARY"
  # Warm the cache for every instance in parallel.
  $PY -m cuflash.precompile --jobs 16 > "$OUT/precompile.log" 2>&1
  say "precompile: $(tail -1 "$OUT/precompile.log")"
fi

if [[ $MODE == all || $MODE == tests ]]; then
  HYPOTHESIS_PROFILE=${HYPOTHESIS_PROFILE:-gpu} timeout ${TEST_TIMEOUT:-420} $PY -m pytest tests -q \
    -p no:cacheprovider --deselect tests/test_compile.py::test_all_kernels_compile_for_sm80_and_sm90a_without_spills \
    --junitxml "$OUT/junit.xml" "$@" > "$OUT/tests.log" 2>&1
  say "pytest exit $?: $(grep -E '^[0-9]+ (passed|failed)|passed|failed' "$OUT/tests.log" | tail -1)"
  sed -n '/cuflash GPU error ratios/,/^$/p' "$OUT/tests.log" | tee -a "$SUMMARY"
  grep -E "^(FAILED|ERROR)" "$OUT/tests.log" | head -20 | tee -a "$SUMMARY"
fi

if [[ $MODE == all || $MODE == sanitize ]]; then
  for tool in memcheck racecheck synccheck; do
    args=""
    [[ $tool == memcheck ]] && args="--all-buckets"
    timeout 300 compute-sanitizer --tool $tool --error-exitcode 9 $PY tests/gpu/sanitize_cases.py $args \
      > "$OUT/sanitize_$tool.log" 2>&1
    say "compute-sanitizer $tool exit $?: $(grep -E 'ERROR SUMMARY|sanitize cases' "$OUT/sanitize_$tool.log" | tr '\n' ' ')"
  done
fi

if [[ $MODE == all || $MODE == bench ]]; then
  timeout ${BENCH_TIMEOUT:-300} $PY bench/bench_attention.py ${BENCH_ARGS:---quick} --out "$OUT" \
    > "$OUT/bench.log" 2>"$OUT/bench.err"
  say "bench exit $?"
  cat "$OUT/bench_table.txt" >> "$SUMMARY" 2>/dev/null
fi

echo "================ summary ================"
cat "$SUMMARY"
