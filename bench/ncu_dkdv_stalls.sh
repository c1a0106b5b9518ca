#!/usr/bin/env bash
# Where the packed dK/dV kernel loses to the dense one on equal lengths (16 x 4096, causal, bf16,
# d = 128): ncu's warp-state statistics and the SASS lines with the most stall samples of each
# (bench/ncu_top_stalls.py). Writes $OUT/dkdv_{packed,dense}.txt.
set -u
OUT=${OUT:-/tmp}
export PYTHONPATH=$PWD CUPY_CACHE_DIR=${CUPY_CACHE_DIR:-/tmp/cuflash_cupy_cache}
python -m cuflash.precompile --jobs 16 --dtype bfloat16 --head-dim 128 --features 0 8 > /dev/null 2>&1
for kind in packed dense; do
  flag=$([[ $kind == packed ]] && echo --packed)
  timeout 200 ncu -k regex:attention_backward_dkdv --launch-skip 1 --launch-count 1 \
    --section WarpStateStats --section SourceCounters --section SpeedOfLight -f -o "$OUT/dkdv_$kind" \
    python bench/profile_attention.py $flag --batch 16 --causal --backward --calls 2 --head-dim 128 \
    > "$OUT/ncu_$kind.log" 2>&1
  {
    ncu --import "$OUT/dkdv_$kind.ncu-rep" --page details --section WarpStateStats --section SpeedOfLight
    ncu --import "$OUT/dkdv_$kind.ncu-rep" --page source --csv --print-source sass > "$OUT/sass_$kind.csv"
    python bench/ncu_top_stalls.py "$OUT/sass_$kind.csv" --top 25
  } > "$OUT/dkdv_$kind.txt" 2>&1
  rm -f "$OUT/sass_$kind.csv"
done
