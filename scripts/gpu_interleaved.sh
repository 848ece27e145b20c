#!/usr/bin/env bash
# gpu_interleaved.sh - kvattn against cuDNN SDPA in one process by L2 flush (bench/decode_interleaved.py), the selftest,
# and the D4 page-index threshold A/B (KVATTN_BENCH_TC_EXP=8192) on the default kernels and on the tensor-core kernel.
# Run on the GPU machine, carry ["build-dev"]; every part's output goes to $OUT.
set -u
source "$(dirname "$0")/gpu_env.sh" inter
nvidia-smi --query-gpu=name,clocks.max.sm,clocks.max.mem --format=csv,noheader
B=$BUILD/kva_bench_decode
timeout 90 "$BUILD/kva_cuda_selftest" --quick > "$OUT/selftest.log" 2>&1
echo "selftest: rc $? $(grep -E "passed" "$OUT/selftest.log" | tail -1)"; grep -m3 FAIL "$OUT/selftest.log"
PYTHONPATH=python KVATTN_LIBRARY=$BUILD/libkvattn.so timeout ${INTER_LIMIT:-240} python3 bench/decode_interleaved.py \
    --out "$OUT/interleaved.md" ${INTER_ARGS:-} > "$OUT/interleaved.log" 2>&1
echo "interleaved: rc $?"
ab() { timeout 150 "$B" "$@" 2>&1 | grep -E "^A/B" | sort -u; }
for hg in default 0; do
    echo "== D4, kernels: $hg; A = default, B = TC_EXP=8192 (page-index batches from 12 subtiles per warp)"
    if [ $hg = default ]; then ab --only "D4" --ab-only "D4" --ab-env KVATTN_BENCH_TC_EXP=8192 --iters 40
    else KVATTN_CUDA_DECODE_HG=0 ab --only "D4" --ab-only "D4" --ab-env KVATTN_BENCH_TC_EXP=8192 --iters 40; fi
done > "$OUT/d4_ab.log"
cat "$OUT/d4_ab.log"
tail -25 "$OUT/interleaved.log"
