#!/usr/bin/env bash
# ncu of the packed backward kernels (dQ, dK/dV): the long-tailed batch and 16 x 4096 packed, against
# dense 16 x 4096 (bf16, d = 128): duration, throughput, DRAM bytes. Writes $OUT/ncu.txt.
set -u; OUT=${OUT:-/tmp}
export PYTHONPATH=$PWD CUPY_CACHE_DIR=/tmp/cuflash_cupy_cache
python -m cuflash.precompile --jobs 16 --dtype bfloat16 --head-dim 128 --features 0 8 > $OUT/pre.txt 2>&1; tail -1 $OUT/pre.txt
for a in "--long-tailed --causal" "--long-tailed" "--packed --batch 16 --causal" "--batch 16 --causal"; do
  echo "=== $a" | tee -a $OUT/ncu.txt
  timeout 120 ncu -k regex:"attention_backward_(dq|dkdv)" --launch-skip 2 --launch-count 2 --section SpeedOfLight --metrics dram__bytes_read.sum,dram__bytes_write.sum,smsp__cycles_active.avg python bench/profile_attention.py $a --backward --calls 2 --head-dim 128 >> $OUT/ncu.txt 2>&1
done
grep -E "^===|attention_backward|Duration|dram__bytes|Compute \(SM\) Throughput|Memory Throughput" $OUT/ncu.txt
