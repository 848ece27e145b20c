#!/usr/bin/env bash
# gpu_d4_probe.sh - what makes D4's skewed batch (1 x 32k + 63 x 512) slower than equal lengths with the same bytes:
# interleaved A/Bs of (1) the tensor-core kernel without its item epilogue (KVATTN_BENCH_TC_EXP=1024, timing only:
# no CTA barrier, combine, write or merge at an item's end), (2) the HND layout (each head's page rows one block)
# against NHD, on both D4 rows. Run on the GPU machine, carry ["build-dev"].
set -u
source "$(dirname "$0")/gpu_env.sh" d4probe
B=$BUILD/kva_bench_decode
nvidia-smi --query-gpu=name --format=csv,noheader
ab() { "$B" "$@" 2>&1 | grep -E "^A/B|^D4 load" | sort -u; }
echo "== tensor-core kernel (KVATTN_CUDA_DECODE_HG=0), A = default, B = no item epilogue (TC_EXP=1024)"
KVATTN_CUDA_DECODE_HG=0 ab --only "D4" --ab-only "32k" --ab-env KVATTN_BENCH_TC_EXP=1024 --iters 40
echo "== tensor-core kernel, A = NHD, B = HND (same plan)"
KVATTN_CUDA_DECODE_HG=0 ab --only "D4" --ab-only "32k" --ab-layout --iters 40
echo "== default kernels, A = NHD, B = HND (same plan)"
ab --only "D4" --ab-only "32k" --ab-layout --iters 40
echo "== default kernels, HND pools throughout"
KVATTN_BENCH_LAYOUT_HND=1 "$B" --only "D4" --no-bounds-check-ab 0 --iters 40 2>&1 | grep -E "^D4 load"
