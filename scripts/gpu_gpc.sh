#!/usr/bin/env bash
# gpu_gpc.sh - GPC membership and per-SM streaming times (tools/gpc_probe), then per-CTA traces of D1 16 x 4k and
# 1 x 128k (kva_bench_decode --trace: SM id and global-timer start / end per CTA) to set the decode kernels' CTA ends
# beside the GPC groups. Outputs under $OUT (gpc_probe.txt, t16x4k_*/, t1x128k/). Carry ["build-dev"].
set -u
source "$(dirname "$0")/gpu_env.sh" gpc
nvidia-smi --query-gpu=name --format=csv,noheader
timeout 120 "$BUILD/tools/gpc_probe" 7 | tee "$OUT/gpc_probe.txt"
B=$BUILD/kva_bench_decode
for i in 1 2; do
    mkdir -p "$OUT/t16x4k_$i"
    KVA_BENCH_TRACE_DIR="$OUT/t16x4k_$i" timeout 120 "$B" --only "16 x 4096" --trace "16 x 4096" --no-bounds-check-ab 0 2>&1 | grep "^\[cold"
done
mkdir -p "$OUT/t1x128k"
KVA_BENCH_TRACE_DIR="$OUT/t1x128k" timeout 120 "$B" --only "1 x 131072" --trace "1 x 131072" --no-bounds-check-ab 0 2>&1 | grep "^\[cold"
ls -R "$OUT" | head -20
