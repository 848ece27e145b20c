#!/usr/bin/env bash
# gpu_16x4k_probe.sh - D1 16 x 4k (268 MB, 128 per-head units: the tensor-core kernel with split KV and fused merges):
# interleaved A/Bs of the plan's shape (head groups, no split, 8 warps) and a per-CTA trace. Carry ["build-dev"].
set -u
source "$(dirname "$0")/gpu_env.sh" p16x4k
B=$BUILD/kva_bench_decode
nvidia-smi --query-gpu=name --format=csv,noheader
ab() { "$B" "$@" 2>&1 | grep -E "^A/B|^kvattn workers" | sort -u; }
R="16 x 4096"
echo "== default vs head groups"; ab --only "$R" --ab-only "$R" --ab-env KVATTN_CUDA_DECODE_HG=1 --iters 40
echo "== default vs 8 warps"; ab --only "$R" --ab-only "$R" --ab-env KVATTN_BENCH_TC_WARPS=8 --iters 40
echo "== default vs 4 warps"; ab --only "$R" --ab-only "$R" --ab-env KVATTN_BENCH_TC_WARPS=4 --iters 40
for fs in 4096 2048 1024; do
  echo "== fixed split $fs: 4 vs 8 warps"; KVATTN_BENCH_FIXED_SPLIT=$fs ab --only "$R" --ab-only "$R" --ab-env KVATTN_BENCH_TC_WARPS=8 --iters 40
done
echo "== 64 x 1024 (same bytes) default vs tensor-core"; ab --only "64 x 1024" --ab-only "64 x 1024" --ab-env KVATTN_CUDA_DECODE_HG=0 --iters 40
echo "== trace"
KVA_BENCH_TRACE_DIR=$OUT "$B" --only "$R" --trace "$R" --no-bounds-check-ab 0 2>&1 | grep -A3 "^trace\|cold L2\]" | head -30
mkdir -p $OUT/tc; KVATTN_CUDA_DECODE_HG=0 KVA_BENCH_TRACE_DIR=$OUT/tc "$B" --only "64 x 1024" --trace "64 x 1024" --no-bounds-check-ab 0 2>&1 | grep -A3 "^trace\|cold L2\]" | head -12
