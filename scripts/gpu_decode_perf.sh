#!/usr/bin/env bash
# gpu_decode_perf.sh - decode-kernel work loop on the GPU machine in one call (narrower than gpu_check.sh):
#   1. kva_cuda_selftest (decode matrix, prefill through the decode kernel, graph replay, faults) and the
#      test_ops suites that run the decode kernel (decode, split, prefill, ragged) on the CUDA backend
#   2. kva_bench_decode (subset via ONLY=..., default all) -> $OUT/kvattn_decode.csv (+ bounds-check A/B)
#   3. peers (PEERS=1): bench/peers_decode.py -> $OUT/bench_decode.md
#   4. ncu on one shape (NCU_SHAPE, default "64 x 8192"; NCU=0 skips) -> $OUT/ncu.txt
#   5. SASS of the main prebuilt kernel (SASS=1) -> $OUT/sass_tc.txt
#   6. compute-sanitizer memcheck / racecheck on kva_cuda_selftest --quick (MEMCHECK=1, RACECHECK=1)
# Run from the repository root with build-cuda carried:  bash scripts/gpu_decode_perf.sh
set -u
BUILD=${BUILD:-build-cuda}
OUT=${OUT:-$PWD/gpu_out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
export LD_LIBRARY_PATH="$PWD/$BUILD:$PWD/$BUILD/tests:${LD_LIBRARY_PATH:-}:/usr/local/cuda/lib64"
export KVATTN_CACHE_DIR="${KVATTN_CACHE_DIR:-/tmp/kvattn_cache_$$}"
START=$(date +%s)
SUMMARY=()
t() { echo "$(( $(date +%s) - START ))"; }
step() { # name limit cmd... (output to the log and the console tail)
    local name=$1 limit=$2; shift 2
    echo "==== $name ($(t) s)"
    timeout --kill-after=5 "$limit" "$@" > "$OUT/step.txt" 2>&1
    local rc=$?
    cat "$OUT/step.txt" >> "$OUT/perf.log"
    tail -n "${TAIL:-15}" "$OUT/step.txt"
    SUMMARY+=("rc=$rc  $name")
}
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,clocks.max.sm,temperature.gpu,power.draw --format=csv,noheader || true
if ! ldconfig -p 2>/dev/null | grep -q 'libnvrtc.so.1[23] '; then
    for p in /usr/local/cuda/lib64/libnvrtc.so.13 /usr/local/cuda/lib64/libnvrtc.so.12 \
             $(python3 -c "import nvidia.cuda_nvrtc, os; d=os.path.dirname(nvidia.cuda_nvrtc.__file__); print(d + '/lib/libnvrtc.so.13', d + '/lib/libnvrtc.so.12')" 2>/dev/null); do
        if [ -f "$p" ]; then export KVATTN_NVRTC_PATH="$p"; break; fi
    done
fi
if [ "${TESTS:-1}" = 1 ]; then
    if [ "${SELFTEST:-1}" = 1 ]; then
        TAIL=40 step "kva_cuda_selftest" "${SELFTEST_LIMIT:-150}" "$BUILD/kva_cuda_selftest" ${SELFTEST_ARGS:-}
    fi
    for suite in ${SUITES:-decode split}; do
        TAIL=6 step "test_ops --suite $suite [cuda]" "${SUITE_LIMIT:-90}" "$BUILD/tests/test_ops" --backend cuda --suite "$suite"
    done
fi
if [ "${BENCH:-1}" = 1 ]; then
    TAIL=80 step "kva_bench_decode" "${BENCH_LIMIT:-150}" "$BUILD/kva_bench_decode" --csv "$OUT/kvattn_decode.csv" \
        ${ONLY:+--only "$ONLY"} ${BENCH_ARGS:-}
fi
if [ "${PEERS:-0}" = 1 ] && [ -s "$OUT/kvattn_decode.csv" ]; then
    TAIL=60 step "peers_decode.py" "${PEERS_LIMIT:-150}" python3 bench/peers_decode.py --csv "$OUT/kvattn_decode.csv" \
        --out "$OUT/bench_decode.md"
fi
if [ "${NCU:-1}" = 1 ] && command -v ncu >/dev/null; then
    TAIL=120 step "ncu ${NCU_SHAPE:-64 x 8192}" "${NCU_LIMIT:-120}" ncu --clock-control none --kernel-name regex:'kva_(tc|dec)' \
        --launch-skip 2 --launch-count 1 --section SpeedOfLight --section MemoryWorkloadAnalysis \
        --section Occupancy --section WarpStateStats --section SchedulerStats --section LaunchStats \
        "$BUILD/kva_bench_decode" --iters 5 --no-bounds-check-ab 0 --only "${NCU_SHAPE:-64 x 8192}"
    cp "$OUT/step.txt" "$OUT/ncu_${NCU_TAG:-main}.txt"
fi
if [ "${SASS:-0}" = 1 ] && command -v cuobjdump >/dev/null; then
    cuobjdump -sass -fun "${SASS_FUN:-kva_tc_d128_qbf16_kvbf16_obf16_r4}" "$BUILD/kva_cuda_gen/kva_aot_sm90a.fatbin" \
        > "$OUT/sass_tc.txt" 2>&1
    echo "SASS: $(wc -l < "$OUT/sass_tc.txt") lines -> sass_tc.txt"
fi
if [ "${MEMCHECK:-0}" = 1 ]; then
    TAIL=12 step "memcheck selftest --quick" "${MEMCHECK_LIMIT:-150}" compute-sanitizer --tool memcheck \
        --error-exitcode 99 --print-limit 20 "$BUILD/kva_cuda_selftest" --quick
fi
if [ "${RACECHECK:-0}" = 1 ]; then
    TAIL=12 step "racecheck selftest --quick" "${MEMCHECK_LIMIT:-150}" compute-sanitizer --tool racecheck \
        --racecheck-report hazard --error-exitcode 99 --print-limit 20 "$BUILD/kva_cuda_selftest" --quick
fi
echo "==== summary ($(t) s)"
for s in "${SUMMARY[@]}"; do echo "$s"; done
rm -f "$OUT/step.txt"
