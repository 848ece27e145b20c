#!/usr/bin/env bash
# gpu_trace_sm.sh - per-CTA traces (tensor-core decode kernel; SM id, start / first data / computed / end) of D1 16 x 4k
# (twice: is the set of fast SMs stable?), D4 1 x 32k + 63 x 512 and its equal-length twin. CSVs under $OUT.
# Carry ["build-dev"].
set -u
source "$(dirname "$0")/gpu_env.sh" tracesm
B=$BUILD/kva_bench_decode
nvidia-smi --query-gpu=name --format=csv,noheader
for i in 1 2; do mkdir -p $OUT/r$i; KVA_BENCH_TRACE_DIR=$OUT/r$i "$B" --only "16 x 4096" --trace "16 x 4096" --no-bounds-check-ab 0 2>&1 | grep "^\[cold"; done
mkdir -p $OUT/d4; KVATTN_CUDA_DECODE_HG=0 KVA_BENCH_TRACE_DIR=$OUT/d4 "$B" --only "32k + 63" --trace "32k + 63" --no-bounds-check-ab 0 2>&1 | grep "^\[cold"
mkdir -p $OUT/d4b; KVATTN_BENCH_TC_EXP=2 KVATTN_CUDA_DECODE_HG=0 KVA_BENCH_TRACE_DIR=$OUT/d4b "$B" --only "32k + 63" --trace "32k + 63" --no-bounds-check-ab 0 2>&1 | grep "^\[cold"
mkdir -p $OUT/w8; KVATTN_BENCH_TC_WARPS=8 KVA_BENCH_TRACE_DIR=$OUT/w8 "$B" --only "16 x 4096" --trace "16 x 4096" --no-bounds-check-ab 0 2>&1 | grep "^\[cold"
ls -R $OUT | head
