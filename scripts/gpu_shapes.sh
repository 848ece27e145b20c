#!/usr/bin/env bash
# gpu_shapes.sh - decode off the WORKLOADS.md grid: group sizes, head dims, page sizes, fp8 e5m2, MQA/MHA, one
# request of 32-64k, beside torch SDPA (cuDNN, flash) in the same run. Rows are kva_bench_decode's "XS" group
# (KVATTN_BENCH_SHAPES="HQ/HKV:BxL[:dD][:pP][:e4m3|:e5m2],..."); SHAPES overrides the default list. HND=1 reads the
# pools as HND; AB="VAR=VALUE" also times every row on a second context created with VAR set, interleaved launch by
# launch (kva_bench_decode --ab-env). Writes $OUT/shapes.csv and $OUT/shapes.md (the table, printed last).
set -u
cd "$(dirname "$0")/.."
source scripts/gpu_env.sh shapes
DEF="8/8:32x2048,16/8:32x2048,40/8:32x2048,56/8:32x2048,64/8:32x2048,128/8:32x2048,32/1:64x4096,32/32:8x4096"
DEF="$DEF,64/8:1x65536,40/8:1x32768,32/8:32x4096:d64,32/8:32x2048:d256,32/8:32x2048:p1,32/8:32x2048:p3"
DEF="$DEF,32/8:32x2048:p64,32/8:32x4096:e5m2,56/8:64x8192,128/8:64x4096,64/8:128x2048"
export KVATTN_BENCH_SHAPES="${SHAPES:-$DEF}"
[ "${HND:-0}" = 1 ] && export KVATTN_BENCH_LAYOUT_HND=1
nvidia-smi --query-gpu=name,clocks.max.sm,clocks.max.mem --format=csv,noheader
ABARGS=()
[ -n "${AB:-}" ] && ABARGS=(--ab-env "$AB" --ab-only XS)
timeout 300 "$BUILD/kva_bench_decode" --only XS "${ABARGS[@]}" --csv "$OUT/shapes.csv" ||
    echo "kva_bench_decode failed rc=$?"
timeout 240 python3 bench/peers_decode.py --csv "$OUT/shapes.csv" --out "$OUT/shapes.md" > "$OUT/peers.log" 2>&1 ||
    { echo "peers_decode.py failed rc=$?"; tail -20 "$OUT/peers.log"; }
cat "$OUT/shapes.md"
