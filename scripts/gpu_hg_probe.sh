#!/usr/bin/env bash
# gpu_hg_probe.sh - interleaved A/Bs of head-group plan settings on D3 (GQA 32/4) and D1 16 x 4k: heads per item, workers
# per SM, L2 promotion, the tensor-core kernel instead. Carry ["build-dev"].
set -u
source "$(dirname "$0")/gpu_env.sh" hgprobe
nvidia-smi --query-gpu=name --format=csv,noheader
B=$BUILD/kva_bench_decode
R=${HP_ROWS:-D3 GQA 32/4|16 x 4096}
for x in ${HP_ENVS:-KVATTN_CUDA_DECODE_HG=0 KVATTN_BENCH_HG_HEADS=2 KVATTN_BENCH_HG_HEADS=2,KVATTN_BENCH_HG_PER_SM=1 \
          KVATTN_BENCH_HG_L2_PROMO=0 KVATTN_BENCH_HG_L2_PROMO=1 KVATTN_BENCH_HG_L2_PROMO=2 \
          KVATTN_CUDA_DECODE_HG=1,KVATTN_BENCH_HG_HEADS=2 KVATTN_CUDA_DECODE_HG=1,KVATTN_BENCH_HG_HEADS=2,KVATTN_BENCH_HG_PER_SM=1}; do
    timeout 120 "$B" --only "$R" --ab-only "$R" --ab-env "$x" --iters 30 2>&1 | grep -E "^A/B" | sort -u | sed 's/(medians.*//'
done
