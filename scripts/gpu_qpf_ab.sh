#!/usr/bin/env bash
# gpu_qpf_ab.sh - the next item's q rows prefetched into L2 during the current item (tensor-core and head-group decode
# kernels): interleaved A/Bs against the kernels without it (KVATTN_BENCH_TC_EXP=2048) on the D4 rows (each worker
# runs several items) and D1 rows, then the GPU tests that run both kernels. Run on the GPU machine, carry ["build-dev"].
set -u
source "$(dirname "$0")/gpu_env.sh" qpf
B=$BUILD/kva_bench_decode
nvidia-smi --query-gpu=name --format=csv,noheader
ab() { "$B" "$@" 2>&1 | grep -E "^A/B|^D4 load" | sort -u; }
rc=0
t() { local name=$1 limit=$2; shift 2; local t0=$(date +%s)
      timeout $limit "$@" > "$OUT/$name.log" 2>&1; local r=$?; [ $r -ne 0 ] && rc=1
      echo "$name: rc $r, $(( $(date +%s) - t0 )) s: $(grep -E "passed|ERROR SUMMARY" "$OUT/$name.log" | tail -2 | tr '\n' ' ')"
      grep -m3 FAIL "$OUT/$name.log"; }
echo "== A = q prefetch (default), B = none (TC_EXP=2048); positive: the prefetch is slower"
ab --only "D4" --ab-only "D4" --ab-env KVATTN_BENCH_TC_EXP=2048 --iters 40
echo "== tensor-core kernel for every row (KVATTN_CUDA_DECODE_HG=0)"
KVATTN_CUDA_DECODE_HG=0 ab --only "D4" --ab-only "32k|zipf|[512" --ab-env KVATTN_BENCH_TC_EXP=2048 --iters 40
echo "== D1"
ab --only "D1" --ab-only "1 x 32768|16 x 1024|16 x 4096|64 x 1024|64 x 4096|128 x 2048|256 x 2048" \
   --ab-env KVATTN_BENCH_TC_EXP=2048 --iters 40
if [ "${QPF_TESTS:-1}" != 0 ]; then
    echo "== tests"
    t ops_decode 150 "$BUILD/tests/test_ops" --backend cuda --suite decode
    t ops_decode_hg 150 env KVATTN_CUDA_DECODE_HG=1 "$BUILD/tests/test_ops" --backend cuda --suite decode
    t ops_split 100 "$BUILD/tests/test_ops" --backend cuda --suite split
    t fuzz31_hg 150 env KVATTN_CUDA_DECODE_HG=1 KVA_TEST_PDL=1 "$BUILD/tests/test_ops" --backend cuda --suite fuzz --seed 31 --count 200
    t selftest 100 "$BUILD/kva_cuda_selftest" --quick
fi
exit $rc
