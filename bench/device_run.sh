#!/usr/bin/env bash
# One call on the GPU machine: compile the kernels, run the GPU tests and the sanitizers, run the
# benchmark. Full logs go to $OUT; a short summary is printed last.
#
#   bash bench/device_run.sh [MODES] [extra pytest args...]
#   MODES: comma-separated from sass, store, tests, sanitize, overhead, sweep, ab, tiles, items, bench
#   (default: all but sweep, ab, tiles and items; ab: the causal forward with start- against
#   end-aligned row blocks; tiles: the TMA forward's tile candidates, probe_sm90.py --sweep-tma;
#   NOTES v8; items: per-item and per-key-tile cost of the forward, probe_sm90.py --item-costs,
#   NOTES v9)
#
# Runs from the source tree (PYTHONPATH=.) on the machine's own packages.
set -uo pipefail
cd "$(dirname "$0")/.."
MODE=${1:-tests,sanitize,overhead,bench}
has() { [[ ",$MODE," == *",$1,"* ]]; }
SWEEP_ARGS=${SWEEP_ARGS:-}
shift || true
export OUT=${OUT:-/tmp/cuflash_out}
mkdir -p "$OUT"
# Only a few files come back from the device: detailed logs go to $LOGS and travel as one archive.
LOGS=$(mktemp -d)
trap 'tar czf "$OUT/logs.tar.gz" -C "$LOGS" . 2>/dev/null' EXIT
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
export CUPY_CACHE_DIR=${CUPY_CACHE_DIR:-/tmp/cuflash_cupy_cache}
PY=${PYTHON:-python3}
SUMMARY=$OUT/summary.txt
: > "$SUMMARY"
say() { echo "$*" | tee -a "$SUMMARY"; }

nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.max.sm --format=csv,noheader \
  | tee "$OUT/gpu.txt"
$PY -c "import cupy, torch; print('cupy', cupy.__version__, 'torch', torch.__version__)" | tee -a "$OUT/gpu.txt"

if [[ ${COLD:-1} == 1 ]] && (has tests || has sanitize); then
  # First-call compile time of single configurations, each alone and from an empty cache.
  rm -rf "$CUPY_CACHE_DIR"
  CUPY_CACHE_DIR=/tmp/cuflash_cold_cache $PY -m cuflash.precompile --jobs 1 --dtype bfloat16 float32 \
    --head-dim 64 128 256 > "$LOGS/compile_cold.log" 2>&1
  say "cold compile, one process: $(tail -1 "$LOGS/compile_cold.log")"
  head -3 "$LOGS/compile_cold.log" | tee -a "$SUMMARY"
  # Warm the cache for every instance in parallel.
fi
if has store || has tests || has sanitize || has sweep || has ab || has tiles || has items ||
  has bench; then
  $PY -m cuflash.precompile --jobs 16 > "$LOGS/precompile.log" 2>&1
  say "precompile: $(tail -1 "$LOGS/precompile.log")"
fi

if has sass; then
  # The TMA forward's machine code: stmatrix (STSM) and TMA stores (UTMASTG) where O is staged,
  # register-stored O (STG) where it is not; per instance (bf16).
  $PY -c "
from cuflash import _kernels, compile_check as cc
specs = [s for s in _kernels.all_specs('sm_90a')
         if s.source == 'forward_sm90_tma.cu' and s.dtype == 'bfloat16']
print(cc.translation_unit('forward_sm90_tma.cu', specs))" > "$LOGS/sass_unit.cu"
  nvcc -cubin -arch=sm_90a -std=c++17 -O3 -o "$LOGS/fwd.cubin" "$LOGS/sass_unit.cu" \
    && cuobjdump -sass "$LOGS/fwd.cubin" > "$LOGS/fwd.sass"
  awk '/Function :/{f=$3} /STSM|UTMASTG|UTMALDG|STG\.E/{for(i=1;i<=NF;i++) if($i ~ /^(STSM|UTMASTG|UTMALDG|STG)/){split($i,a,".");c[f" "a[1]]++}}
       END{for(k in c) print "sass:", c[k], k}' "$LOGS/fwd.sass" | sort -k3 | tee -a "$SUMMARY"
fi

if has store; then
  # Which TMA stores of the forward's O tile the hardware accepts (bench/tma_store_probe.py)
  timeout 240 $PY bench/tma_store_probe.py > "$LOGS/store.log" 2>&1
  say "store probe exit $?"
  grep -E '^tma store' "$LOGS/store.log" | tee -a "$SUMMARY" >/dev/null
fi

if has tests; then
  HYPOTHESIS_PROFILE=${HYPOTHESIS_PROFILE:-gpu} timeout ${TEST_TIMEOUT:-420} $PY -m pytest tests -q \
    -p no:cacheprovider --deselect tests/test_compile.py::test_all_kernels_compile_for_sm80_and_sm90a_without_spills \
    --junitxml "$LOGS/junit.xml" "$@" > "$LOGS/tests.log" 2>&1
  say "pytest exit $?: $(grep -E '^[0-9]+ (passed|failed)|passed|failed' "$LOGS/tests.log" | tail -1)"
  sed -n '/cuflash GPU errors/,/^$/p' "$LOGS/tests.log" | tee -a "$SUMMARY"
  grep -E "^(FAILED|ERROR)" "$LOGS/tests.log" | head -20 | tee -a "$SUMMARY"
fi

if has items; then
  timeout ${ITEMS_TIMEOUT:-200} $PY bench/probe_sm90.py --item-costs --head-dim 64 128 256 \
    --seq ${ITEMS_SEQ:-2048 4096 16384} > "$LOGS/items.log" 2>&1
  say "items exit $?"
  grep -E '^items:' "$LOGS/items.log" | tee -a "$SUMMARY" >/dev/null
  cp "$LOGS/items.log" "$OUT/items.log"
fi

if has sanitize; then
  for tool in memcheck racecheck synccheck; do
    # memcheck: every head-dim bucket; racecheck, synccheck: the TMA kernels' buckets (40 -> 64,
    # 128, 256) and one mma.sync bucket (200)
    args="--head-dim 40 128 200 256"
    [[ $tool == memcheck ]] && args="--all-buckets"
    timeout 300 compute-sanitizer --tool $tool --error-exitcode 9 $PY tests/gpu/sanitize_cases.py $args \
      > "$LOGS/sanitize_$tool.log" 2>&1
    say "compute-sanitizer $tool exit $?: $(grep -E 'ERROR SUMMARY|RACECHECK SUMMARY|sanitize cases' "$LOGS/sanitize_$tool.log" | tr '\n' ' ')"
  done
  # The TMA forward with three consumer warpgroups (192-row tiles, taken from 2048 rows on): its
  # O staging tile and TMA stores (NOTES v9) under memcheck and racecheck.
  for tool in memcheck racecheck; do
    timeout 200 compute-sanitizer --tool $tool --error-exitcode 9 $PY tests/gpu/sanitize_cases.py \
      --head-dim 40 --forward-tiles 64:192,128,2 > "$LOGS/sanitize_${tool}_192.log" 2>&1
    say "compute-sanitizer $tool (192-row forward tiles) exit $?: $(grep -E 'ERROR SUMMARY|RACECHECK SUMMARY|sanitize cases' "$LOGS/sanitize_${tool}_192.log" | tr '\n' ' ')"
  done
  # The TMA forward whose consumers take turns at the tensor cores (named barriers): synccheck.
  timeout 200 compute-sanitizer --tool synccheck --error-exitcode 9 $PY tests/gpu/sanitize_cases.py \
    --head-dim 40 128 256 --forward-tiles 64:192,128,2,1 128:128,128,2,1 256:128,64,2,1 \
    > "$LOGS/sanitize_synccheck_turns.log" 2>&1
  say "compute-sanitizer synccheck (tensor-core turns) exit $?: $(grep -E 'ERROR SUMMARY|sanitize cases' "$LOGS/sanitize_synccheck_turns.log" | tr '\n' ' ')"
fi

if has overhead; then
  $PY bench/overhead_probe.py > "$LOGS/overhead.log" 2>&1
  say "overhead: $(head -2 "$LOGS/overhead.log" | tr '\n' ' ')"
fi

if has sweep; then
  timeout 400 $PY bench/sweep_tiles.py $SWEEP_ARGS > "$LOGS/sweep.log" 2>&1
  say "sweep exit $?"
  sed -n '/^sweep /,$p' "$LOGS/sweep.log" | tee -a "$SUMMARY" >/dev/null
fi

if has ab; then
  timeout ${AB_TIMEOUT:-300} $PY bench/probe_sm90.py --ab-causal-layout --head-dim 64 128 256 \
    --seq ${AB_SEQ:-1024 2048 4096 8192 16384} > "$LOGS/ab.log" 2>&1
  say "ab exit $?: $(grep 'ab correctness' "$LOGS/ab.log")"
  grep -E '^ab:' "$LOGS/ab.log" | tee -a "$SUMMARY" >/dev/null
  cp "$LOGS/ab.log" "$OUT/ab.log"
fi

if has tiles; then
  timeout ${TILES_TIMEOUT:-400} $PY bench/probe_sm90.py --sweep-tma --seq ${TILES_SEQ:-1024 4096 16384} \
    > "$LOGS/tiles.log" 2>&1
  say "tiles exit $?"
  # The consumers taking turns at the tensor cores (fourth field), in a call of their own: a
  # schedule that hangs loses only these rows.
  timeout ${TILES_TIMEOUT:-400} $PY bench/probe_sm90.py --sweep-tma 64:128,128,2,1 64:192,128,2,1 \
    128:128,128,2,1 256:128,64,2,1 --seq ${TILES_SEQ:-1024 4096 16384} >> "$LOGS/tiles.log" 2>&1
  say "tiles (turns) exit $?"
  grep -E '^(sweep|tma maps)' "$LOGS/tiles.log" | tee -a "$SUMMARY" >/dev/null
  cp "$LOGS/tiles.log" "$OUT/tiles.log"
fi

if has bench; then
  timeout ${BENCH_TIMEOUT:-300} $PY bench/bench_attention.py ${BENCH_ARGS:---quick} --out "$OUT" \
    > "$LOGS/bench.log" 2>"$LOGS/bench.err"
  say "bench exit $?"
  cat "$OUT/bench_table.txt" >> "$SUMMARY" 2>/dev/null
fi

echo "================ summary ================"
cat "$SUMMARY"
