#!/usr/bin/env bash
# gpu_fault_ab.sh - session 40's head-group fault-word change on the GPU machine in one call: A/B of the kept form
# against the per-stage shared atomics (KVATTN_BENCH_HG_EXP=8) on D1-D3 and row-slot shapes (row slots at any size),
# then the CUDA selftest (faults in head groups and row slots), test_ops decode with head groups, and
# compute-sanitizer racecheck / memcheck over the selftest. STEPS="ab tests san" (default all).
set -u
cd "$(dirname "$0")/.."
source scripts/gpu_env.sh fab
export LD_LIBRARY_PATH="$PWD/$BUILD/tests:$LD_LIBRARY_PATH"
STEPS=${STEPS:-ab tests san}
STEP_PREFIX=fab # step(): scripts/gpu_env.sh
nvidia-smi --query-gpu=name,clocks.max.sm,clocks.max.mem --format=csv,noheader
if [[ " $STEPS " == *" ab "* ]]; then
    export KVATTN_BENCH_SHAPES="${SHAPES:-128/8:32x2048,32/1:64x4096,128/8:64x4096,32/1:1x32768,48/4:16x1024,64/4:32x4096}"
    export KVATTN_BENCH_HG_RS_MAX_MB=${RS_MAX_MB:-1000000}
    timeout 300 stdbuf -oL "$BUILD/kva_bench_decode" --only "${ONLY:-D1|D2|D3|XS}" --ab-env "${AB:-KVATTN_BENCH_HG_EXP=8}" \
        --ab-only "${ONLY:-D1|D2|D3|XS}" --csv "$OUT/ab.csv" > "$OUT/ab.log" 2>&1 || echo "kva_bench_decode rc=$?"
    grep "^A/B" "$OUT/ab.log" | sed 's/(medians.*//'
fi
if [[ " $STEPS " == *" tests "* ]]; then
    step "selftest --quick" 200 "$BUILD/kva_cuda_selftest" --quick
    step "test_ops decode [HG=1]" 200 env KVATTN_CUDA_DECODE_HG=1 "$BUILD/tests/test_ops" --backend cuda --suite decode
fi
if [[ " $STEPS " == *" san "* ]]; then
    step "racecheck selftest --quick" 200 compute-sanitizer --tool racecheck --racecheck-report hazard \
        --error-exitcode 99 --print-limit 20 "$BUILD/kva_cuda_selftest" --quick
    step "memcheck selftest --quick" 200 compute-sanitizer --tool memcheck --error-exitcode 99 --print-limit 20 \
        "$BUILD/kva_cuda_selftest" --quick
fi
echo "==== summary ===="
printf '%s\n' "${SUM[@]}"
