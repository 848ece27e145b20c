#!/usr/bin/env bash
# gpu_pdl_ab.sh - on the GPU machine (carry ["build-dev"]; results under $OUT):
#   tests: the long suite with page-index batches for items of any length (KVATTN_BENCH_TC_EXP=64, the kernels built
#          through NVRTC without the TC_PB_MAXB limit), then the opt-in KVATTN_CUDA_PDL_MERGE merge kernel under
#          programmatic dependent launch: test suites, selftest, memcheck and racecheck
#   ab:    sequential A/Bs: PDL=1 against the default (fused merge) on the small graph calls, PDL=2 on D1, and the
#          unlimited page-index batches (TC_EXP=64) on D1 and D6
set -u
source "$(dirname "$0")/gpu_env.sh" pdl
export KVA_TEST_BACKEND=cuda
T0=$(date +%s)
step() { # limit name cmd...
    local limit=$1 name=$2; shift 2
    local t=$(date +%s)
    timeout --kill-after=5 "$limit" "$@" > "$OUT/$name.log" 2>&1
    echo "[$(( $(date +%s) - T0 )) s] rc $? ($(( $(date +%s) - t )) s) $name: $(tail -1 "$OUT/$name.log")"
}
case "${1:-tests}" in
tests)
    step 240 long_tcexp64 env KVATTN_BENCH_TC_EXP=64 "$BUILD/tests/test_ops" --backend cuda --suite long
    step 120 decode_pdl2 env KVATTN_CUDA_PDL_MERGE=2 "$BUILD/tests/test_ops" --backend cuda --suite decode
    step 100 split_pdl2 env KVATTN_CUDA_PDL_MERGE=2 "$BUILD/tests/test_ops" --backend cuda --suite split
    step 60 selftest_pdl1 env KVATTN_CUDA_PDL_MERGE=1 "$BUILD/kva_cuda_selftest"
    step 90 memcheck_pdl2 env KVATTN_CUDA_PDL_MERGE=2 compute-sanitizer --tool memcheck --error-exitcode 99 \
        "$BUILD/kva_cuda_selftest" --quick
    step 90 racecheck_pdl2 env KVATTN_CUDA_PDL_MERGE=2 compute-sanitizer --tool racecheck --racecheck-report hazard \
        --error-exitcode 99 "$BUILD/kva_cuda_selftest" --quick
    ;;
ab)
    S="$(dirname "$0")/gpu_seq_ab.sh"
    bash "$S" pdl1 '' 'KVATTN_CUDA_PDL_MERGE=1' 3 'D7|X7' --extra --no-bounds-check-ab 0 2>&1 | grep "^|\|^seq"
    echo "[$(( $(date +%s) - T0 )) s]"
    bash "$S" tc64 '' 'KVATTN_BENCH_TC_EXP=64' 2 'D1|D6' --no-bounds-check-ab 0 2>&1 | grep "^|\|^seq"
    echo "[$(( $(date +%s) - T0 )) s]"
    bash "$S" pdl2 '' 'KVATTN_CUDA_PDL_MERGE=2' 2 'D1' --no-bounds-check-ab 0 2>&1 | grep "^|\|^seq"
    echo "[$(( $(date +%s) - T0 )) s]"
    ;;
esac
