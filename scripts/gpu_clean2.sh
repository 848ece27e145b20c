#!/usr/bin/env bash
# gpu_clean2.sh - clean-L2 (read flush) probes: kvattn vs cuDNN interleaved per kvattn setting (one process each; the
# cuDNN column is that process's reference), and kvattn traces under the read flush per setting. Carry ["build-dev"].
set -u
source "$(dirname "$0")/gpu_env.sh" clean2
nvidia-smi --query-gpu=name --format=csv,noheader
B=$BUILD/kva_bench_decode
export PYTHONPATH=python KVATTN_LIBRARY=$BUILD/libkvattn.so
SH=${CL_SHAPES:-1x1024,1x4096,16x1024,16x4096,1x32768}
for cfg in ${CL_CFGS:-default KVATTN_BENCH_TC_WARPS=4}; do
    e=""; [ $cfg != default ] && e=$cfg
    env $e timeout 150 python3 bench/decode_interleaved.py --shapes $SH --flush ${CL_FLUSH:-read} --rounds 4 \
        --out "$OUT/inter_${cfg//=/_}.md" > "$OUT/inter_${cfg//=/_}.log" 2>&1; echo "interleaved $cfg: rc $?"
    env $e KVATTN_BENCH_FLUSH=read timeout 100 "$B" --only "${CL_TRACE:-16 x 1024|16 x 4096}" \
        --trace "${CL_TRACE:-16 x 1024|16 x 4096}" --no-bounds-check-ab 0 > "$OUT/bench_${cfg//=/_}.log" 2>&1
    echo "== $cfg"; grep -E "^D1|^\[cold|^  us since" "$OUT/bench_${cfg//=/_}.log" | head -12
    grep "^| [0-9]" "$OUT/inter_${cfg//=/_}.md"
done
