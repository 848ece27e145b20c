#!/usr/bin/env bash
# gpu_fp8_conv.sh - fp8 K/V conversions and the row-slot split rule for groups over 16, on the GPU machine in one call.
#   tests: test_ops decode (e5m2 pairs by a byte permute in every decode kernel), decode with head groups wherever
#          supported, e4m3 cases through the bit form (KVATTN_BENCH_HG_EXP=17), the selftest, the Python suite (torch
#          CUDA: re-plans straight into the plan memory).
#   f8:    interleaved A/B on fp8 head-group calls, both arms built at plan time (KVATTN_BENCH_HG_EXP=16 for A):
#          B = 17, e4m3 by the bit form (value / 256, 4 integer ops a pair instead of one cvt);
#          B = 18, e5m2 by cvt (the form before the byte permute).
#   rs:    interleaved A/B of KVATTN_BENCH_RS_MULTI_GROUP=32 (at most 32 chunks per unit for groups of 17-32 with two
#          or more split units) and of KVATTN_BENCH_RS_MULTI_SPLIT=0 (the rule off) on batch-1 / small-batch shapes.
# STEPS (default "tests f8 rs"). Logs: $OUT/logs.tgz.
set -u
cd "$(dirname "$0")/.."
source scripts/gpu_env.sh f8conv
export LD_LIBRARY_PATH="$PWD/$BUILD/tests:$LD_LIBRARY_PATH"
T="$BUILD/tests/test_ops"
STEPS=${STEPS:-tests f8 rs}
STEP_PREFIX=f8
nvidia-smi --query-gpu=name,clocks.max.sm,clocks.max.mem --format=csv,noheader
pack_logs() {
    (cd "$OUT" && ls | grep -v -E '^(logs\.tgz)$' > .pack && [ -s .pack ] && tar czf logs.tgz -T .pack &&
        xargs rm -f < .pack; rm -f .pack)
}
trap 'echo "stopped: packing the logs"; pack_logs; exit 124' TERM INT
ab() { # ab NAME SHAPES ARM...: one interleaved A/B per arm on SHAPES
    local name=$1 shapes=$2; shift 2
    for arm in "$@"; do
        local log="$OUT/ab_${name}_$(echo "$arm" | tr -c 'A-Za-z0-9_' '_').log"
        echo "== $name: B = $arm"
        KVATTN_BENCH_SHAPES="$shapes" timeout 240 "$BUILD/kva_bench_decode" --only XS --ab-env "$arm" --ab-only XS \
            > "$log" 2>&1 || echo "kva_bench_decode rc=$?"
        grep "^A/B" "$log" | sed 's/(medians.*//'
    done
}
if [[ " $STEPS " == *" tests "* ]]; then
    step "test_ops decode" 240 "$T" --backend cuda --suite decode
    step "test_ops decode [HG=1]" 240 env KVATTN_CUDA_DECODE_HG=1 "$T" --backend cuda --suite decode
    for cs in "op=decode B=4 kv=1200 hq=32 hkv=8 dqk=128 dvo=128 qt=bf16 kvt=e4m3 ot=bf16 ps=16 amp=300 ks=0.003 vs=0.004 lse=1" \
        "op=decode B=6 kv=3000 hq=64 hkv=4 dqk=128 dvo=128 qt=bf16 kvt=e4m3 ot=bf16 ps=32 ks=0.6 vs=1.4 lse=1" \
        "op=decode B=2 kv=20000 hq=30 hkv=1 dqk=128 dvo=128 qt=bf16 kvt=e4m3 ot=bf16 ps=16 ks=0.7 vs=1.3" \
        "op=decode B=3 kv=5000 hq=32 hkv=8 dqk=128 dvo=128 qt=f16 kvt=e4m3 ot=f32 ps=16 layout=HND ks=1.5 vs=0.5 lse=1"; do
        step "e4m3 bit form [HG=1 HG_EXP=17]: $cs" 60 env KVATTN_CUDA_DECODE_HG=1 KVATTN_BENCH_HG_EXP=17 "$T" \
            --backend cuda --case "$cs"
    done
    step "selftest --quick" 200 "$BUILD/kva_cuda_selftest" --quick
    step "python tests [cuda+cpu]" 300 env PYTHONPATH="$PWD/python" KVATTN_LIBRARY="$PWD/$BUILD/libkvattn.so" \
        python3 -m pytest -q -x python/tests
fi
if [[ " $STEPS " == *" f8 "* ]]; then
    export KVATTN_BENCH_HG_EXP=16 # A: the head-group kernel as it is, built at plan time like the B arms
    ab f8_e4m3 "32/8:64x4096:e4m3,32/8:32x4096:e4m3,32/8:128x2048:e4m3" KVATTN_BENCH_HG_EXP=17
    ab f8_e5m2 "32/8:64x4096:e5m2,32/8:32x4096:e5m2,32/8:128x2048:e5m2" KVATTN_BENCH_HG_EXP=18
    unset KVATTN_BENCH_HG_EXP
fi
if [[ " $STEPS " == *" rs "* ]]; then
    ab rs_group "40/2:1x32768,48/2:1x32768,64/2:1x32768,64/2:1x65536,48/2:1x16384,40/2:2x32768" \
        KVATTN_BENCH_RS_MULTI_GROUP=32
    ab rs_multi "24/2:1x32768,20/2:1x32768,16/1:2x32768,12/1:2x65536,24/2:1x16384" KVATTN_BENCH_RS_MULTI_SPLIT=0
fi
echo "==== summary ===="
printf '%s\n' "${SUM[@]}"
pack_logs
