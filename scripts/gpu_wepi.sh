#!/usr/bin/env bash
# gpu_wepi.sh - the tensor-core decode kernel's per-warp item epilogue (every item but a worker's last): interleaved
# A/Bs against CTA barriers for every item (KVATTN_BENCH_TC_EXP=8192), test_ops cases with several items per worker
# (WEPI_SUITES=1: the decode, long, split and fuzz suites too), the selftest, and compute-sanitizer memcheck /
# racecheck of a small multi-item case. Carry ["build-dev"].
set -u
source "$(dirname "$0")/gpu_env.sh" wepi
export LD_LIBRARY_PATH="$PWD/$BUILD/tests:$LD_LIBRARY_PATH"
B=$BUILD/kva_bench_decode
nvidia-smi --query-gpu=name --format=csv,noheader
ab() { "$B" "$@" 2>&1 | grep -E "^A/B" | sort -u; }
rc=0
t() { local name=$1 limit=$2; shift 2; local t0=$(date +%s)
      timeout $limit "$@" > "$OUT/$name.log" 2>&1; local r=$?; [ $r -ne 0 ] && rc=1
      echo "$name: rc $r, $(( $(date +%s) - t0 )) s: $(grep -E "passed|ERROR SUMMARY" "$OUT/$name.log" | tail -2 | tr '\n' ' ')"
      grep -m3 FAIL "$OUT/$name.log"; }
cases=("op=decode B=200 kv=64 hq=32 hkv=8 dqk=128 dvo=128 qt=bf16 kvt=bf16 ot=bf16 ps=16 empty=10 lse=1"
       "op=decode B=40 kv=3000 hq=32 hkv=8 dqk=128 dvo=128 qt=f16 kvt=f16 ot=f16 ps=3 lse=1"
       "op=decode B=48 kv=400 hq=20 hkv=4 dqk=64 dvo=64 qt=bf16 kvt=bf16 ot=f32 ps=16 layout=HND"
       "op=decode B=300 kv=700 hq=32 hkv=8 dqk=128 dvo=128 qt=bf16 kvt=bf16 ot=bf16 ps=16 empty=10 lse=1"
       "op=decode B=100 kv=4000 hq=16 hkv=4 dqk=64 dvo=64 qt=f16 kvt=f16 ot=f16 ps=5 lse=1"
       "op=decode B=64 kv=2000 hq=40 hkv=8 dqk=256 dvo=256 qt=bf16 kvt=bf16 ot=f32 ps=16 layout=HND")
small="op=decode B=140 kv=40 hq=4 hkv=2 dqk=64 dvo=64 qt=bf16 kvt=bf16 ot=bf16 ps=16 lse=1"
if [ "${WEPI_AB:-1}" != 0 ]; then
    echo "== A = per-warp item epilogue (default), B = CTA barriers for every item (TC_EXP=8192); positive: default slower"
    { ab --only "D4" --ab-only "D4" --ab-env KVATTN_BENCH_TC_EXP=8192 --iters 40
      KVATTN_CUDA_DECODE_HG=0 ab --only "D4eq" --ab-only "D4eq" --ab-env KVATTN_BENCH_TC_EXP=8192 --iters 40
      ab --only "D1|D7" --ab-only "1 x 1024|1 x 32768|16 x 1024|16 x 4096|D7" --ab-env KVATTN_BENCH_TC_EXP=8192 --iters 40
    } 2>&1 | tee "$OUT/ab.txt"
fi
[ "${WEPI_TESTS:-1}" = 0 ] && exit $rc
echo "== tests"
for i in 0 1 2; do t case$i 60 "$BUILD/tests/test_ops" --backend cuda --case "${cases[$i]}"; done
t selftest 200 "$BUILD/kva_cuda_selftest" --quick
if [ "${WEPI_SUITES:-0}" != 0 ]; then
    t ops_decode 300 "$BUILD/tests/test_ops" --backend cuda --suite decode
    t ops_long 300 "$BUILD/tests/test_ops" --backend cuda --suite long
    t ops_split 120 "$BUILD/tests/test_ops" --backend cuda --suite split
    t fuzz32_pdl 200 env KVA_TEST_PDL=1 "$BUILD/tests/test_ops" --backend cuda --suite fuzz --seed 32 --count 300
fi
for tool in memcheck racecheck; do
    extra=(); [ $tool = racecheck ] && extra=(--racecheck-report hazard)
    t ${tool}_small ${WEPI_SAN_LIMIT:-90} compute-sanitizer --tool $tool "${extra[@]}" --error-exitcode 99 \
        --print-limit 20 "$BUILD/tests/test_ops" --backend cuda --case "$small"
done
for i in 3 4 5; do t case$i 90 "$BUILD/tests/test_ops" --backend cuda --case "${cases[$i]}"; done
exit $rc
