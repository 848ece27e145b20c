#!/usr/bin/env bash
# gpu_d4_probe.sh - what makes D4's skewed batch (1 x 32k + 63 x 512) slower than equal lengths with the same bytes, on
# the tensor-core kernel (KVATTN_CUDA_DECODE_HG=0): interleaved A/Bs of timing-only builds (KVATTN_BENCH_TC_EXP bits:
# 1024 no item epilogue, 2048 every item's q from the first item's rows (in L2), 4096 per-lane page-index loads instead
# of batches), and traces of the second item. Run on the GPU machine, carry ["build-dev"].
set -u
source "$(dirname "$0")/gpu_env.sh" d4probe
B=$BUILD/kva_bench_decode
nvidia-smi --query-gpu=name --format=csv,noheader
ab() { "$B" "$@" 2>&1 | grep -E "^A/B" | sort -u; }
export KVATTN_CUDA_DECODE_HG=0
for x in ${D4_EXPS:-4096}; do
    echo "== A = default, B = TC_EXP=$x"
    ab --only "D4" --ab-only "D4" --ab-env KVATTN_BENCH_TC_EXP=$x --iters 40
done
for x in 2 2050; do
    mkdir -p $OUT/t$x; KVATTN_BENCH_TC_EXP=$x KVA_BENCH_TRACE_DIR=$OUT/t$x "$B" --only "32k + 63" --trace "32k + 63" \
        --no-bounds-check-ab 0 2>&1 | grep "^\[cold"
done
