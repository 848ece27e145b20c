#!/usr/bin/env bash
# gpu_sanitize_extra.sh - compute-sanitizer tools beyond gpu_check.sh's memcheck / racecheck matrix, on the GPU
# machine (carry build-dev, as for gpu_check.sh):
#   initcheck  (device memory read before anything wrote it: workspace partials, plan regions, pools)
#   synccheck  (barrier and warp-synchronous misuse)
#   memcheck   over whole test_ops suites (decode, split; default and head-group kernels) and test_errors
# Each step has its own time limit; a summary is printed last. Results under $OUT (or ./gpu_out).
set -u
BUILD=${BUILD:-build-dev}
[ -x "$BUILD/kva_cuda_selftest" ] || BUILD=build-cuda
OUT=${OUT:-$PWD/gpu_out}
mkdir -p "$OUT"
export LD_LIBRARY_PATH="$PWD/$BUILD:$PWD/$BUILD/tests:${LD_LIBRARY_PATH:-}:/usr/local/cuda/lib64"
export KVATTN_CACHE_DIR="${KVATTN_CACHE_DIR:-/tmp/kvattn_cache_$$}"
SUMMARY=()
step() { # name limit cmd...
    local name=$1 limit=$2; shift 2
    local t0=$(date +%s) log="$OUT/san_$(echo "$name" | tr -c 'A-Za-z0-9_' '_').log"
    timeout --kill-after=10 "$limit" "$@" > "$log" 2>&1
    local rc=$? dt=$(( $(date +%s) - t0 ))
    echo "== $name (rc $rc, ${dt}s)"
    grep -E "ERROR SUMMARY|passed, [0-9]+ failed" "$log" | tail -3
    if [ $rc -eq 0 ]; then SUMMARY+=("PASS  $name (${dt}s)")
    elif [ $rc -eq 124 ] || [ $rc -eq 137 ]; then SUMMARY+=("TIME  $name (limit ${limit}s)")
    else SUMMARY+=("FAIL  $name (rc $rc, ${dt}s)"); grep -m 20 -E "=========" "$log"; fi
}
CS="compute-sanitizer --error-exitcode 99 --print-limit 20"
step "initcheck selftest --quick" 150 $CS --tool initcheck "$BUILD/kva_cuda_selftest" --quick
step "synccheck selftest --quick" 150 $CS --tool synccheck "$BUILD/kva_cuda_selftest" --quick
step "initcheck test_ops (20 cases)" 120 $CS --tool initcheck "$BUILD/tests/test_ops" --backend cuda --count 20
step "initcheck test_errors" 120 $CS --tool initcheck "$BUILD/tests/test_errors" --backend cuda
step "synccheck test_variants ops" 150 $CS --tool synccheck "$BUILD/tests/test_variants" --backend cuda --suite ops
step "memcheck test_ops split" 150 $CS --tool memcheck "$BUILD/tests/test_ops" --backend cuda --suite split
step "memcheck test_ops decode [head groups]" 110 env KVATTN_CUDA_DECODE_HG=1 $CS --tool memcheck \
    "$BUILD/tests/test_ops" --backend cuda --suite decode
echo
echo "==== summary ===="
printf '%s\n' "${SUMMARY[@]}"
