#!/usr/bin/env bash
# Where the sm_90 forward's time goes: ncu's pipe use (the MUFU is the XU pipe), warp states,
# instruction mix and the SASS lines with the most stall samples (bench/ncu_top_stalls.py) of one
# attention_forward_tma launch of bench/profile_attention.py (bf16, B = 4, H = 16, N = 4k).
#
#   bash bench/ncu_forward.sh LABEL [TREE] [profile_attention.py args...]
#
# TREE (default .): the checkout whose cuflash runs (an .ab/ variant tree, say). Writes
# $OUT/ncu_forward_LABEL.txt, and with KEEP_CSV=1 the source page of every SASS line (each stall
# reason's samples) as $OUT/forward_LABEL.csv.gz. Skips the first two launches (compile, warm-up).
set -u
LABEL=$1
TREE=${2:-.}
shift 2 || shift $#
OUT=${OUT:-/tmp}
BENCH=$(cd "$(dirname "$0")" && pwd)
export CUPY_CACHE_DIR=${CUPY_CACHE_DIR:-/tmp/cuflash_cupy_cache}
REPORT="$OUT/forward_$LABEL"
(TREE=$(cd "$TREE" && pwd) && CUFLASH_TREE=$TREE timeout 240 ncu -k regex:attention_forward_tma --launch-skip 2 \
  --launch-count 1 --section SpeedOfLight --section ComputeWorkloadAnalysis \
  --section WarpStateStats --section InstructionStats --section SourceCounters -f -o "$REPORT" \
  python "$BENCH/profile_attention.py" --calls 3 "$@") > "$OUT/ncu_forward_$LABEL.log" 2>&1
{
  ncu --import "$REPORT.ncu-rep" --page details
  ncu --import "$REPORT.ncu-rep" --page source --csv --print-source sass > "$REPORT.csv"
  python "$BENCH/ncu_top_stalls.py" "$REPORT.csv" --top 30
} > "$OUT/ncu_forward_$LABEL.txt" 2>&1
if [[ ${KEEP_CSV:-0} == 1 ]]; then gzip -f "$REPORT.csv"; else rm -f "$REPORT.csv"; fi
