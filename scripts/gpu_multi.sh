#!/usr/bin/env bash
# gpu_multi.sh - the second-device checks on a machine with two or more GPUs (run call of kind nvidia-h100-x2 or
# nvidia-h200-x2, carry ["build-dev"]): kvattn contexts on device 1 used while device 0 is the caller's current
# device (kva_cuda_selftest --device 1: decode matrix, faults, graph replay after re-plan, PDL chains, head groups;
# test_torch's cuda:1 decode / prefill / graph test), memcheck of the quick selftest on device 1, and a context on
# each device running concurrently from two processes. Prints a PASS/FAIL summary last; exits non-zero on a failure.
set -u
BUILD=${BUILD:-build-dev}
OUT=${OUT:-$PWD/gpu_out}
mkdir -p "$OUT"
export LD_LIBRARY_PATH="$PWD/$BUILD:$PWD/$BUILD/tests:${LD_LIBRARY_PATH:-}:/usr/local/cuda/lib64"
export KVATTN_CACHE_DIR="${KVATTN_CACHE_DIR:-/tmp/kvattn_cache_$$}"
nvidia-smi -L
NGPU=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU ' || true)
if [ "${NGPU:-0}" -lt 2 ]; then echo "gpu_multi.sh: needs two GPUs (found ${NGPU:-0})"; exit 2; fi
SUMMARY=()
fail=0
step() { # name cmd...
    local name=$1; shift
    local t0=$(date +%s)
    "$@" > "$OUT/step.txt" 2>&1
    local rc=$?
    tail -n 8 "$OUT/step.txt"; cat "$OUT/step.txt" >> "$OUT/gpu_multi_full.log"
    if [ $rc -eq 0 ]; then SUMMARY+=("PASS  $name ($(( $(date +%s) - t0 ))s)"); else SUMMARY+=("FAIL  $name (rc $rc)"); fail=1; fi
}
step "selftest --device 1, calls with device 0 current" timeout 300 "$BUILD/kva_cuda_selftest" --device 1
step "selftest --device 0, calls with device 1 current" timeout 300 "$BUILD/kva_cuda_selftest" --quick --device 0 --caller-device 1
step "memcheck selftest --quick --device 1" timeout 300 compute-sanitizer --tool memcheck --error-exitcode 99 \
    --print-limit 20 "$BUILD/kva_cuda_selftest" --quick --device 1
step "two processes, one per device" bash -c "
    \"$BUILD/kva_cuda_selftest\" --quick --device 0 > \"$OUT/p0.txt\" 2>&1 & a=\$!
    \"$BUILD/kva_cuda_selftest\" --quick --device 1 > \"$OUT/p1.txt\" 2>&1 & b=\$!
    wait \$a; ra=\$?; wait \$b; rb=\$?; tail -n 1 \"$OUT/p0.txt\" \"$OUT/p1.txt\"; [ \$ra -eq 0 ] && [ \$rb -eq 0 ]"
if python3 -c 'import torch' 2>/dev/null; then
    step "test_torch second device" env PYTHONPATH="$PWD/python" KVATTN_LIBRARY="$PWD/$BUILD/libkvattn.so" \
        timeout 300 python3 -m pytest -q -x python/tests/test_torch.py -k "second_device or graph or pdl"
fi
echo
echo "==== gpu_multi summary ===="
printf '%s\n' "${SUMMARY[@]}"
exit $fail
