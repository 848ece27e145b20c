#!/usr/bin/env bash
# gpu_pdl_ab.sh - the opt-in KVATTN_CUDA_PDL_MERGE experiment on the GPU machine (branch pdl-merge): correctness under
# both settings, sanitizers, then sequential A/Bs against the default (fused merge) and against the plain merge kernel.
#     bash scripts/gpu_pdl_ab.sh        # carry ["build-dev"]; results under $OUT
set -u
source "$(dirname "$0")/gpu_env.sh" pdl
export KVA_TEST_BACKEND=cuda
echo "== page-index batches for items of any length (KVATTN_BENCH_TC_EXP=64; main's next step, docs/kernels/decode.md)"
KVATTN_BENCH_TC_EXP=64 timeout 300 "$BUILD/tests/test_ops" --backend cuda --suite long 2>&1 | tail -1
for v in 1 2; do
    echo "== KVATTN_CUDA_PDL_MERGE=$v: tests"
    for s in decode split long; do
        KVATTN_CUDA_PDL_MERGE=$v timeout 120 "$BUILD/tests/test_ops" --backend cuda --suite $s 2>&1 | tail -1
    done
    KVATTN_CUDA_PDL_MERGE=$v timeout 120 "$BUILD/kva_cuda_selftest" 2>&1 | tail -1
    KVATTN_CUDA_PDL_MERGE=$v timeout 120 compute-sanitizer --tool memcheck "$BUILD/kva_cuda_selftest" --quick 2>&1 | tail -1
    KVATTN_CUDA_PDL_MERGE=$v timeout 120 compute-sanitizer --tool racecheck "$BUILD/kva_cuda_selftest" --quick 2>&1 | tail -1
done
S="$(dirname "$0")/gpu_seq_ab.sh"
bash "$S" pdl1 '' 'KVATTN_CUDA_PDL_MERGE=1' 3 'D7|X7' --extra --no-bounds-check-ab 0 2>&1 | grep "^|\|^seq"
bash "$S" nofused '' 'KVATTN_BENCH_NO_FUSED_MERGE=1' 3 'D7|X7' --extra --no-bounds-check-ab 0 2>&1 | grep "^|\|^seq"
bash "$S" pdl2 '' 'KVATTN_CUDA_PDL_MERGE=2' 2 'D1|D4|D6' --no-bounds-check-ab 0 2>&1 | grep "^|\|^seq"
