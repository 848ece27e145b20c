#!/usr/bin/env bash
# gpu_rs.sh - the head-group kernel's row slots (GQA groups of 9 to 32 over one KV head) on the GPU machine, in one
# call: the benchmark, then test_ops' decode suite (default, and KVATTN_CUDA_DECODE_HG=1: row slots for every call in
# scope), the selftest (faults in row slots), a fuzz run with head groups + PDL, racecheck over the selftest, memcheck and
# racecheck on row-slot cases. The benchmark: every row of SHAPES with row
# slots taken at any size (KVATTN_BENCH_HG_RS_MAX_MB) against the attention kernel (AB arm KVATTN_BENCH_HG_RS=0),
# interleaved, and cuDNN / flash SDPA in the same run (first). Steps: STEPS="bench tests san" (default all; HG1=0 skips
# the decode suite with KVATTN_CUDA_DECODE_HG=1).
set -u
cd "$(dirname "$0")/.."
source scripts/gpu_env.sh rs
export LD_LIBRARY_PATH="$PWD/$BUILD/tests:$LD_LIBRARY_PATH"
T="$BUILD/tests/test_ops"
STEPS=${STEPS:-bench tests san}
STEP_PREFIX=rs # step(): scripts/gpu_env.sh
nvidia-smi --query-gpu=name,clocks.max.sm,clocks.max.mem --format=csv,noheader
if [[ " $STEPS " == *" bench "* ]]; then
    S="16/1:64x4096,32/1:64x4096,32/1:8x4096,32/1:1x32768,32/1:1x131072,48/4:16x1024,128/8:1x1024,128/8:1x32768"
    S="$S,40/2:32x4096,64/4:32x4096,96/4:32x2048,128/8:32x2048,128/8:64x4096,128/8:128x2048,32/1:64x4096:d64"
    S="$S,32/1:64x4096:e4m3,128/8:32x2048:p1"
    export KVATTN_BENCH_SHAPES="${SHAPES:-$S}"
    export KVATTN_BENCH_HG_RS_MAX_MB=${RS_MAX_MB:-1000000}
    timeout 400 "$BUILD/kva_bench_decode" --only XS --ab-env "${AB:-KVATTN_BENCH_HG_RS=0}" --ab-only XS \
        --csv "$OUT/shapes.csv" > "$OUT/bench.log" 2>&1 || echo "kva_bench_decode rc=$?"
    grep "^A/B" "$OUT/bench.log" | sed 's/(medians.*//' 
    timeout 240 python3 bench/peers_decode.py --csv "$OUT/shapes.csv" --out "$OUT/shapes.md" > "$OUT/peers.log" 2>&1 ||
        { echo "peers_decode.py failed rc=$?"; tail -20 "$OUT/peers.log"; }
fi
if [[ " $STEPS " == *" tests "* ]]; then
    step "test_ops decode" 240 "$T" --backend cuda --suite decode
    [ "${HG1:-1}" = 1 ] && step "test_ops decode [HG=1]" 240 env KVATTN_CUDA_DECODE_HG=1 "$T" --backend cuda --suite decode
    step "selftest --quick" 200 "$BUILD/kva_cuda_selftest" --quick
    step "test_ops split" 200 "$T" --backend cuda --suite split
    step "fuzz seed ${SEED:-4001} [HG=1 PDL]" 300 env KVATTN_CUDA_DECODE_HG=1 KVA_TEST_PDL=1 "$T" --backend cuda \
        --suite fuzz --seed "${SEED:-4001}" --count "${COUNT:-300}"
fi
if [[ " $STEPS " == *" san "* ]]; then
    CASES=("op=decode B=5 kv=1200 hq=18 hkv=2 dqk=128 dvo=128 qt=bf16 kvt=bf16 ot=bf16 ps=16 lse=1"
        "op=decode B=40 kv=900 hq=20 hkv=1 dqk=64 dvo=64 qt=bf16 kvt=bf16 ot=bf16 ps=1"
        "op=decode B=7 kv=1500 hq=17 hkv=1 dqk=128 dvo=128 qt=f16 kvt=e5m2 ot=f16 ps=16 ks=0.9 vs=1.1 lse=1"
        "op=decode B=2 kv=6000 hq=30 hkv=1 dqk=128 dvo=128 qt=bf16 kvt=e4m3 ot=bf16 ps=16 ks=0.7 vs=1.3 empty=20")
    step "racecheck selftest --quick" 200 compute-sanitizer --tool racecheck --racecheck-report hazard \
        --error-exitcode 99 --print-limit 20 "$BUILD/kva_cuda_selftest" --quick
    for tool in memcheck racecheck; do
        for cs in "${CASES[@]}"; do
            step "$tool: $cs" 120 compute-sanitizer --tool $tool --error-exitcode 99 --print-limit 20 "$T" \
                --backend cuda --case "$cs"
        done
    done
fi
echo "==== summary ===="
printf '%s\n' "${SUM[@]}"
[ -f "$OUT/shapes.md" ] && cat "$OUT/shapes.md"
