#!/usr/bin/env bash
# One call on the GPU machine: compile the kernels, run the GPU tests and the sanitizers, run the
# benchmark. Full logs go to $OUT (logs.tar.gz beside the summary); a short summary is printed last.
#
#   bash bench/device_run.sh [MODES] [extra pytest args...]
#   MODES, comma-separated (default tests,sanitize,bench):
#     smoke     first, a few calls of every TMA bucket against the reference (test_hopper.py's
#               path test; $SMOKE_TESTS: other pytest arguments), within $SMOKE_TIMEOUT (default
#               180 s): if it fails or hangs, nothing else runs, so that a broken kernel costs a
#               minute rather than the whole call
#     fwd       bench/probe_forward.py: the forward alone against the checkouts in $FWD_BASELINES
#               (default $BASELINE where it exists) and SDPA flash and cuDNN, with explicit tiles
#               and loops, softcap and ALiBi rows
#     tests     the test suite (the GPU tests run here; HYPOTHESIS_PROFILE=gpu draws 200 examples)
#     sanitize  compute-sanitizer memcheck (every head-dim bucket), racecheck and synccheck (the
#               TMA kernels' buckets and one mma.sync bucket), and the 192-row TMA forward tiles;
#               beside the tests, after the timed runs
#     bench     bench/bench_attention.py, $BENCH_ARGS (default --quick)
#     ab        the benchmark against the checkout in $BASELINE (default .ab/base: see
#               docs/perf/NOTES.md, "A/B against an earlier commit"), $AB_ARGS
#     mods      bench/bench_score_mods.py: windows, softcap, ALiBi against dense, FlexAttention
#               and JAX's cuDNN attention, $MODS_ARGS
#     jax       cuflash.jax: host overhead and a training step against jax.nn.dot_product_attention
#               (bench/bench_jax.py), with XLA's default flags and with custom calls in CUDA
#               graphs; the command-buffer check (bench/jax_command_buffer.py); with JAX_FFI=1
#               also the typed-FFI alternative (bench/jax_ffi_ctypes.py)
#     varlen    bench/bench_varlen.py: a packed batch of 64k tokens against dense 4k, SDPA on jagged
#               nested tensors and padded SDPA, $VARLEN_ARGS
#     kvcache   bench/bench_kvcache.py: decoding over KV caches against the copy bandwidth and SDPA,
#               chunked prefill against the forward, $KVCACHE_ARGS
#     ring      bench/bench_ring.py under torchrun, one process per GPU (weak scaling of ring
#               attention; the multi-GPU kinds), $RING_ARGS
#     fp8       bench/probe_fp8_forward.py: the FP8 forward against the bf16 forward and SDPA
#               cuDNN, and its error against the reference, $FP8_ARGS (default: causal rows too)
#   TESTS narrows the tests mode to some paths (default: tests)
#   PRECOMPILE=0 skips compiling every instance first (kernels then compile on first use); the
#   precompile lists the instances whose runtime binary uses local memory (exit 3 if any);
#   PRECOMPILE_ARGS narrows it (e.g. "--features 8 9 10 11 12 13 14 15": the packed instances;
#   "--family forward decode decode_combine append gather pack_offsets": what the KV cache runs)
#   SANITIZE_CASES=dense|varlen|kvcache|fp8|softcap|all (default all): which calls the sanitizers
#   run (softcap: the 16-bit softcap-alone calls of dense only, bfloat16's rows pinned at the cap,
#   at $SANITIZE_HEAD_DIMS or 64, 128, 256); SANITIZE_HEAD_DIMS narrows the dense calls to these
#   head dims (every tool on each)
#
# Runs from the source tree (PYTHONPATH=.) on the machine's own packages.
set -uo pipefail
cd "$(dirname "$0")/.."
MODE=${1:-tests,sanitize,bench}
has() { [[ ",$MODE," == *",$1,"* ]]; }
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

if [[ ${COLD:-1} == 1 ]] && has tests; then
  # First-call compile time of single configurations, each alone and from an empty cache.
  CUPY_CACHE_DIR=/tmp/cuflash_cold_cache $PY -m cuflash.precompile --jobs 1 --dtype bfloat16 float32 \
    --head-dim 64 128 256 > "$LOGS/compile_cold.log" 2>&1
  say "cold compile, one process: $(tail -1 "$LOGS/compile_cold.log")"
  head -3 "$LOGS/compile_cold.log" | tee -a "$SUMMARY"
fi
# Every instance into the cache, in parallel (later steps only load binaries); with
# $BASELINE_PRECOMPILE_ARGS, also the --baseline checkout's instances that those select.
if [[ -n ${BASELINE_PRECOMPILE_ARGS:-} && -d ${BASELINE:-.ab/base} ]]; then
  (cd "${BASELINE:-.ab/base}" && PYTHONPATH=$PWD $PY -m cuflash.precompile --jobs 16 \
    $BASELINE_PRECOMPILE_ARGS) > "$LOGS/precompile_baseline.log" 2>&1
  say "baseline precompile exit $?: $(tail -1 "$LOGS/precompile_baseline.log")"
fi
if [[ ${PRECOMPILE:-1} == 1 ]]; then
  $PY -m cuflash.precompile --jobs 16 ${PRECOMPILE_ARGS:-} > "$LOGS/precompile.log" 2>&1
  say "precompile exit $?: $(tail -1 "$LOGS/precompile.log")"
fi

if has smoke; then
  timeout ${SMOKE_TIMEOUT:-180} $PY -m pytest -x -q -p no:cacheprovider \
    ${SMOKE_TESTS:-tests/gpu/test_hopper.py -k aligned_calls} > "$LOGS/smoke.log" 2>&1
  status=$?
  say "smoke exit $status: $(tail -1 "$LOGS/smoke.log")"
  if [[ $status != 0 ]]; then
    cp "$LOGS/smoke.log" "$OUT/smoke.log"
    tail -40 "$LOGS/smoke.log"
    exit 1
  fi
fi

# The timed runs first, on a quiet GPU.
if has fwd; then
  base=${BASELINE:-.ab/base}
  bases=${FWD_BASELINES:-$([[ -d $base ]] && echo "$base")}
  timeout ${FWD_TIMEOUT:-240} $PY bench/probe_forward.py ${FWD_ARGS:-} \
    ${bases:+--baseline $bases} --out "$OUT" > "$LOGS/fwd.log" 2>"$LOGS/fwd.err"
  say "probe_forward exit $?"
  cat "$LOGS/fwd.log" >> "$SUMMARY"
  tail -5 "$LOGS/fwd.err" >> "$SUMMARY"
fi
if has ab; then
  timeout ${AB_TIMEOUT:-300} $PY bench/bench_attention.py ${AB_ARGS:---quick --head-dim 64 96 128 256} \
    --baseline "${BASELINE:-.ab/base}" --out "$OUT/ab" > "$LOGS/ab.log" 2>"$LOGS/ab.err"
  say "ab exit $?"
  cat "$OUT/ab/bench_table.txt" >> "$SUMMARY" 2>/dev/null
fi

if has mods; then
  timeout ${MODS_TIMEOUT:-400} $PY bench/bench_score_mods.py ${MODS_ARGS:-} --out "$OUT/mods" \
    > "$LOGS/mods.log" 2>"$LOGS/mods.err"
  say "mods exit $?"
  cat "$OUT/mods/score_mods_table.txt" >> "$SUMMARY" 2>/dev/null
fi

if has jax; then
  # XLA's default flags, then flags that put custom calls into CUDA graphs (command buffers)
  GRAPH_FLAGS="--xla_gpu_enable_command_buffer=FUSION,CUBLAS,CUBLASLT,CUSTOM_CALL,CUDNN --xla_gpu_graph_min_graph_size=1"
  timeout ${JAX_TIMEOUT:-200} $PY bench/bench_jax.py ${JAX_ARGS:-} --out "$OUT/jax" \
    > "$LOGS/jax.log" 2>"$LOGS/jax.err"
  say "bench_jax exit $?"
  cat "$OUT/jax/jax_table.txt" >> "$SUMMARY" 2>/dev/null
  XLA_FLAGS=$GRAPH_FLAGS timeout ${JAX_TIMEOUT:-200} $PY bench/bench_jax.py ${JAX_ARGS:-} \
    --out "$OUT/jax_graphs" > "$LOGS/jax_graphs.log" 2>"$LOGS/jax_graphs.err"
  say "bench_jax with XLA_FLAGS=$GRAPH_FLAGS exit $?"
  cat "$OUT/jax_graphs/jax_table.txt" >> "$SUMMARY" 2>/dev/null
  if [[ ${JAX_FFI:-0} == 1 ]]; then
    OUT=$OUT/jax timeout 120 $PY bench/jax_ffi_ctypes.py > "$LOGS/jax_ffi.log" 2>&1
    say "jax_ffi_ctypes exit $?"
    tail -12 "$LOGS/jax_ffi.log" >> "$SUMMARY"
  fi
  for flag in "" --graph-flags; do
    timeout 120 $PY bench/jax_command_buffer.py $flag --out "$OUT/jax" > "$LOGS/jax_cmdbuf$flag.log" 2>&1
    say "jax_command_buffer $flag exit $?"
    tail -3 "$LOGS/jax_cmdbuf$flag.log" >> "$SUMMARY"
  done
fi

if has varlen; then
  timeout ${VARLEN_TIMEOUT:-400} $PY bench/bench_varlen.py ${VARLEN_ARGS:-} --out "$OUT/varlen" \
    > "$LOGS/varlen.log" 2>"$LOGS/varlen.err"
  say "bench_varlen exit $?"
  tail -30 "$LOGS/varlen.log" >> "$SUMMARY"
fi

if has kvcache; then
  timeout ${KVCACHE_TIMEOUT:-300} $PY bench/bench_kvcache.py ${KVCACHE_ARGS:-} --out "$OUT/kvcache" \
    > "$LOGS/kvcache.log" 2>"$LOGS/kvcache.err"
  say "bench_kvcache exit $?"
  cat "$OUT/kvcache/kvcache_table.txt" >> "$SUMMARY" 2>/dev/null
fi

if has ring; then
  GPUS=$(nvidia-smi -L | wc -l)
  timeout ${RING_TIMEOUT:-400} $PY -m torch.distributed.run --nproc_per_node "$GPUS" \
    bench/bench_ring.py ${RING_ARGS:-} --out "$OUT/ring" > "$LOGS/ring.log" 2>"$LOGS/ring.err"
  say "bench_ring on $GPUS GPUs exit $?"
  cat "$OUT/ring/ring_table.txt" >> "$SUMMARY" 2>/dev/null
fi

if has fp8; then
  timeout ${FP8_TIMEOUT:-300} $PY bench/probe_fp8_forward.py ${FP8_ARGS:---causal} --out "$OUT" \
    > "$LOGS/fp8.log" 2>"$LOGS/fp8.err"
  say "probe_fp8_forward exit $?"
  cat "$LOGS/fp8.log" >> "$SUMMARY"
  tail -5 "$LOGS/fp8.err" >> "$SUMMARY"
fi

if has bench; then
  timeout ${BENCH_TIMEOUT:-300} $PY bench/bench_attention.py ${BENCH_ARGS:---quick} --out "$OUT" \
    > "$LOGS/bench.log" 2>"$LOGS/bench.err"
  say "bench exit $?"
  cat "$OUT/bench_table.txt" >> "$SUMMARY" 2>/dev/null
fi

sanitize_all() {
  sanitize() {  # name, tool, case arguments...
    local name=$1 tool=$2
    shift 2
    timeout ${SANITIZE_TIMEOUT:-400} compute-sanitizer --tool "$tool" --error-exitcode 9 \
      $PY tests/gpu/sanitize_cases.py "$@" > "$LOGS/sanitize_$name.log" 2>&1
    echo "compute-sanitizer $name exit $?: $(grep -E 'ERROR SUMMARY|RACECHECK SUMMARY|sanitize cases' "$LOGS/sanitize_$name.log" | tr '\n' ' ')" \
      >> "$LOGS/sanitize_summary.txt"
  }
  # two streams side by side. memcheck: every head-dim bucket; racecheck and synccheck: the TMA
  # kernels' buckets (40 -> 64, 128, 256) and one mma.sync bucket (200); and the TMA forward with
  # three consumer warpgroups (192-row tiles, taken from 2048 rows on): its O staging tile and
  # TMA stores (docs/perf/NOTES.md, v9)
  local cases=${SANITIZE_CASES:-all}
  if [[ $cases == all || $cases == dense ]]; then
    if [[ -n ${SANITIZE_HEAD_DIMS:-} ]]; then  # these head dims only, every tool
      sanitize memcheck memcheck --head-dim $SANITIZE_HEAD_DIMS &
      sanitize racecheck racecheck --head-dim $SANITIZE_HEAD_DIMS
      sanitize synccheck synccheck --head-dim $SANITIZE_HEAD_DIMS
    else
      (
        sanitize memcheck memcheck --all-buckets
        sanitize memcheck_192 memcheck --head-dim 40 --forward-tiles 192,128,2
        sanitize memcheck_fused256 memcheck --head-dim 256 --backward fused
      ) &
      sanitize racecheck racecheck --head-dim 40 128 200 256
      sanitize synccheck synccheck --head-dim 40 128 200 256
      sanitize racecheck_192 racecheck --head-dim 40 --forward-tiles 192,128,2
      # the fused backward under every mask it serves at d = 256 (the library takes it for
      # causal calls from 4096 rows only: these cases are smaller)
      sanitize racecheck_fused256 racecheck --head-dim 256 --backward fused
    fi
  fi
  if [[ $cases == softcap ]]; then
    local dims=${SANITIZE_HEAD_DIMS:-64 128 256}
    sanitize memcheck_softcap memcheck --cases softcap --head-dim $dims &
    sanitize racecheck_softcap racecheck --cases softcap --head-dim $dims
    sanitize synccheck_softcap synccheck --cases softcap --head-dim $dims
  fi
  # packed calls (well-formed, and malformed offsets on trust): the mma (40, 200) and wgmma (128)
  # kernels with the sequence lookups
  if [[ $cases == all || $cases == kvcache ]]; then
    sanitize memcheck_kvcache memcheck --cases kvcache --head-dim 40 128 200 &
    sanitize racecheck_kvcache racecheck --cases kvcache --head-dim 40 128
  fi
  if [[ $cases == all || $cases == varlen ]]; then
    sanitize memcheck_varlen memcheck --cases varlen --head-dim 40 128 200 &
    sanitize racecheck_varlen racecheck --cases varlen --head-dim 40 128
  fi
  # the FP8 forward (sm_90): its head dims, masks, descale factors and V^T pass
  if [[ $cases == all || $cases == fp8 ]]; then
    sanitize memcheck_fp8 memcheck --cases fp8 &
    sanitize racecheck_fp8 racecheck --cases fp8
  fi
  wait
}
# The sanitizers (mostly host-bound instrumentation) run beside the test suite.
if has sanitize; then
  sanitize_all &
  SANITIZE_PID=$!
fi

if has tests; then
  # -v and straight into $OUT: a call that ends at its time limit still brings back the name and
  # outcome of every test that ran (a -q log in the archive left only dots, and the archive
  # itself was cut)
  HYPOTHESIS_PROFILE=${HYPOTHESIS_PROFILE:-gpu} timeout ${TEST_TIMEOUT:-420} $PY -m pytest ${TESTS:-tests} -v \
    -p no:cacheprovider --deselect tests/test_compile.py::test_all_kernels_compile_for_sm80_and_sm90a_without_spills \
    --junitxml "$LOGS/junit.xml" "$@" > "$OUT/tests.log" 2>&1
  say "pytest exit $?: $(grep -E '^=+ .*(passed|failed).* =+$' "$OUT/tests.log" | tail -1)"
  sed -n '/cuflash GPU errors/,/^$/p' "$OUT/tests.log" | tee -a "$SUMMARY"
  grep -E "^(FAILED|ERROR)" "$OUT/tests.log" | head -20 | tee -a "$SUMMARY"
fi

if has sanitize; then
  wait $SANITIZE_PID
  cat "$LOGS/sanitize_summary.txt" | tee -a "$SUMMARY"
fi



echo "================ summary ================"
cat "$SUMMARY"
