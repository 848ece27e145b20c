#!/usr/bin/env bash
# gpu_fp8_tune.sh - fp8-KV decode settings: D6 1 x 32k on the 8-warp tensor-core kernel (one CTA per SM) against the
# default plan (sequential pairs), and D6 64 x 4k in head groups of 2 instead of 4 and with the other L2 promotion
# (interleaved).
set -u
source "$(dirname "$0")/gpu_env.sh" fp8tune
bash "$(dirname "$0")/gpu_seq_ab.sh" fp8w8 '' 'KVATTN_CUDA_CTAS_PER_SM=1 KVATTN_BENCH_TC_WARPS=8' 3 'D6'
B=$BUILD/kva_bench_decode
$B --only 'D6' --ab-only '64 x 4096' --ab-env KVATTN_BENCH_HG_HEADS=2 2>&1 | grep "A/B" | sort -u
promo=0; nvidia-smi --query-gpu=name --format=csv,noheader | grep -q H200 && promo=2
$B --only 'D6' --ab-only '64 x 4096' --ab-env KVATTN_BENCH_HG_L2_PROMO=$promo 2>&1 | grep "A/B" | sort -u
