#!/usr/bin/env bash
# What limits the fused backward (kernels_cu/backward_sm90_fused.cu) at its benchmark point (bf16,
# d = 128, B = 4, H = 16, N = 4096, not causal): ncu's speed of light, pipe utilisation and
# warp-state statistics, and the SASS lines with the most stall samples (bench/ncu_top_stalls.py).
# Writes $OUT/fused_backward.txt.
set -u
OUT=${OUT:-/tmp}
export PYTHONPATH=$PWD CUPY_CACHE_DIR=${CUPY_CACHE_DIR:-/tmp/cuflash_cupy_cache}
timeout 240 ncu -k regex:attention_backward_fused_tma --launch-skip 1 --launch-count 1 \
  --section SpeedOfLight --section ComputeWorkloadAnalysis --section WarpStateStats \
  --section SourceCounters --section MemoryWorkloadAnalysis -f -o "$OUT/fused_backward" \
  python bench/profile_attention.py --backward --calls 2 --head-dim 128 > "$OUT/ncu_fused.log" 2>&1
{
  ncu --import "$OUT/fused_backward.ncu-rep" --page details --section SpeedOfLight \
    --section ComputeWorkloadAnalysis --section WarpStateStats --section MemoryWorkloadAnalysis
  ncu --import "$OUT/fused_backward.ncu-rep" --page source --csv --print-source sass > "$OUT/sass_fused.csv"
  python bench/ncu_top_stalls.py "$OUT/sass_fused.csv" --top 30
} > "$OUT/fused_backward.txt" 2>&1
rm -f "$OUT/sass_fused.csv" "$OUT/fused_backward.ncu-rep"
tail -5 "$OUT/ncu_fused.log"
