#!/usr/bin/env bash
# gpu_clean_l2.sh - decode under a clean L2 (the flush reads 512 MB instead of writing it) against the default dirty
# flush: kvattn and cuDNN interleaved in one process (bench/decode_interleaved.py), the kernels each side launches
# (bench/profile_decode.py --flush read) and kvattn's per-CTA traces under both flushes (KVATTN_BENCH_FLUSH=read).
# Run on the GPU machine, carry ["build-dev"]; every part's output goes to $OUT.
set -u
source "$(dirname "$0")/gpu_env.sh" cleanl2
nvidia-smi --query-gpu=name --format=csv,noheader
B=$BUILD/kva_bench_decode
export PYTHONPATH=python KVATTN_LIBRARY=$BUILD/libkvattn.so
SH=${CL_SHAPES:-1x1024,1x4096,16x1024,16x4096,64x1024,1x32768}
timeout 200 python3 bench/decode_interleaved.py --shapes $SH --flush read,memset --rounds 6 \
    --out "$OUT/interleaved.md" > "$OUT/interleaved.log" 2>&1; echo "interleaved: rc $?"
timeout 150 python3 bench/profile_decode.py --flush read --shapes ${CL_PROF:-1x1024,16x1024,16x4096} --peers cudnn \
    > "$OUT/profile_read.log" 2>&1; echo "profile: rc $?"
for f in memset read; do
    mkdir -p $OUT/tr_$f
    fl=""; [ $f = read ] && fl=read
    KVATTN_BENCH_FLUSH=$fl KVA_BENCH_TRACE_DIR=$OUT/tr_$f timeout 150 "$B" --only "${CL_TRACE:-D1 GQA}" \
        --trace "${CL_TRACE_ROWS:-16 x 1024|16 x 4096|1 x 1024}" --no-bounds-check-ab 0 > "$OUT/bench_$f.log" 2>&1
    echo "bench $f: rc $?"
done
for f in memset read; do echo "== flush $f"; grep -E "^D1|^\[cold|^  us since|L2 flush" "$OUT/bench_$f.log"; done
grep -E "cold|k[0-9] " "$OUT/profile_read.log" | cut -c1-60,150-
grep "^|" "$OUT/interleaved.md"
