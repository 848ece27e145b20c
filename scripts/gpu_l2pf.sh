#!/usr/bin/env bash
# gpu_l2pf.sh - A/B of the tensor-core decode kernel's K/V copies with a 256-byte L2 fetch (KVATTN_BENCH_TC_EXP=8192,
# .L2::256B): interleaved cold launches under the dirty flush (kva_bench_decode), and kvattn vs cuDNN in one process
# under the clean flush per setting (bench/decode_interleaved.py). Carry ["build-dev"].
set -u
source "$(dirname "$0")/gpu_env.sh" l2pf
nvidia-smi --query-gpu=name --format=csv,noheader
B=$BUILD/kva_bench_decode
export PYTHONPATH=python KVATTN_LIBRARY=$BUILD/libkvattn.so
X=${PF_ENV:-KVATTN_BENCH_TC_EXP=8192}
timeout 300 "$B" --only "${PF_ROWS:-D1|D3 GQA 32/4}" --ab-only "${PF_ROWS:-D1|D3 GQA 32/4}" --ab-env $X --iters 30 \
    > "$OUT/ab.log" 2>&1; echo "ab: rc $?"
grep -E "^A/B" "$OUT/ab.log" | sort -u | sed 's/(medians.*//'
for cfg in default $X; do
    e=""; [ $cfg != default ] && e=$cfg
    env $e timeout 150 python3 bench/decode_interleaved.py --shapes ${PF_SHAPES:-1x1024,16x1024,16x4096,1x32768,64x4096} \
        --flush read --rounds 4 --out "$OUT/inter_${cfg//=/_}.md" > "$OUT/inter_${cfg//=/_}.log" 2>&1
    echo "== clean L2, $cfg: rc $?"; grep "^| [0-9]" "$OUT/inter_${cfg//=/_}.md"
done
