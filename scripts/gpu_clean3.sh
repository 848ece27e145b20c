#!/usr/bin/env bash
# gpu_clean3.sh - kvattn under the clean-L2 flush (KVATTN_BENCH_FLUSH=read) by pool layout and page order: NHD / HND,
# scattered / sequential pages, page 16 / 64; and the dirty flush for reference. Carry ["build-dev"].
set -u
source "$(dirname "$0")/gpu_env.sh" clean3
nvidia-smi --query-gpu=name --format=csv,noheader
B=$BUILD/kva_bench_decode
ROWS=${CL_ROWS:-D1 GQA 32/8}
for fl in read ""; do
  for cfg in default KVATTN_BENCH_LAYOUT_HND=1 KVATTN_BENCH_PAGES_SEQ=1 "KVATTN_BENCH_LAYOUT_HND=1 KVATTN_BENCH_PAGES_SEQ=1" \
             "KVATTN_BENCH_PAGE_SIZE=64 KVATTN_BENCH_LAYOUT_HND=1" ${CL_EXTRA:-}; do
    e=""; [ "$cfg" != default ] && e=$cfg
    echo "== flush ${fl:-memset}: $cfg"
    env $e KVATTN_BENCH_FLUSH=$fl timeout 60 "$B" --only "$ROWS" --no-bounds-check-ab 0 --quick 2>&1 | grep -E "^D1" | \
        grep -E "${CL_GREP:-16 x 1024|16 x 4096|64 x 1024|1 x 32768}"
  done
done
