#!/usr/bin/env bash
# gpu_start_trace.sh - where the decode kernel's first microseconds go: per-CTA trace medians (header, first subtile,
# pages fetched, K/V issued, first data, ...) of D1 16 x 4k, 16 x 1k, 1 x 1k and 1 x 32k under the memset flush (dirty L2,
# code evicted), the read flush (clean L2; the flush is a kvattn decode call, so the kernel code stays warm) and warm
# (no flush). Carry ["build-dev"].
set -u
source "$(dirname "$0")/gpu_env.sh" starttrace
B=$BUILD/kva_bench_decode
nvidia-smi --query-gpu=name --format=csv,noheader
for r in "16 x 4096" "16 x 1024" "1 x 1024" "1 x 32768"; do
    for fl in memset read; do
        echo "== $r, flush $fl"
        KVATTN_BENCH_FLUSH=$fl timeout 120 "$B" --only "D1 GQA 32/8" --trace "$r" --no-bounds-check-ab 0 2>&1 | grep -A2 "^\[cold\|^\[warm" | grep -v "^--"
    done
done
