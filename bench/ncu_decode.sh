#!/usr/bin/env bash
# Where a decoding block's time per key tile goes (issue 18): ncu's instruction statistics, pipe
# use and warp states of attention_decode at B = 8, 8k keys (4 splits), and the SASS lines with the
# most stall samples with their executed counts (bench/ncu_top_stalls.py). Writes
# $OUT/ncu_decode.txt. The regex also matches the combine, which each call launches after the
# decoding kernel: skipping 4 launches profiles the third call's decoding kernel.
set -u
OUT=${OUT:-/tmp}
export PYTHONPATH=$PWD CUPY_CACHE_DIR=${CUPY_CACHE_DIR:-/tmp/cuflash_cupy_cache}
timeout 200 ncu -k regex:attention_decode --launch-skip 4 --launch-count 1 \
  --section WarpStateStats --section SourceCounters --section SpeedOfLight \
  --section InstructionStats --section ComputeWorkloadAnalysis -f -o "$OUT/decode" \
  python bench/profile_decode.py --batch 8 --keys 8192 --calls 5 > "$OUT/ncu_decode.log" 2>&1
{
  ncu --import "$OUT/decode.ncu-rep" --page details
  ncu --import "$OUT/decode.ncu-rep" --page source --csv --print-source sass > "$OUT/sass_decode.csv"
  python bench/ncu_top_stalls.py "$OUT/sass_decode.csv" --top 40
} > "$OUT/ncu_decode.txt" 2>&1
rm -f "$OUT/sass_decode.csv"
