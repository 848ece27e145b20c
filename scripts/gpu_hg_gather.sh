#!/usr/bin/env bash
# gpu_hg_gather.sh - the head-group decode kernel's cp.async producer for page sizes that are not multiples of 16
# ("_ga"): interleaved A/B against the tensor-core kernel (KVATTN_CUDA_DECODE_HG=0) on D5 page 1 and pools of 3-token
# pages, then test_ops (decode with head groups wherever in scope, split, fuzz with head groups and PDL), the selftest,
# and memcheck / racecheck of three page-1/3/5 decode cases on head groups. Run on the GPU machine, carry ["build-dev"].
set -u
source "$(dirname "$0")/gpu_env.sh" hgga
export LD_LIBRARY_PATH="$PWD/$BUILD/tests:$LD_LIBRARY_PATH"
B=$BUILD/kva_bench_decode
nvidia-smi --query-gpu=name --format=csv,noheader
ab() { "$B" "$@" --ab-env KVATTN_CUDA_DECODE_HG=0 2>&1 | grep "^A/B" | sort -u; }
rc=0
t() { local name=$1 limit=$2; shift 2; local t0=$(date +%s)
      timeout $limit "$@" > "$OUT/$name.log" 2>&1; local r=$?; [ $r -ne 0 ] && rc=1
      echo "$name: rc $r, $(( $(date +%s) - t0 )) s: $(grep -E "passed|ERROR SUMMARY" "$OUT/$name.log" | tail -2 | tr '\n' ' ')"
      grep -m3 FAIL "$OUT/$name.log"; }
cases=("op=decode B=3 kv=300 hq=32 hkv=8 dqk=128 dvo=128 qt=bf16 kvt=bf16 ot=bf16 ps=1"
       "op=decode B=4 kv=200 hq=16 hkv=4 dqk=64 dvo=64 qt=f16 kvt=f16 ot=f32 ps=3 layout=HND empty=25"
       "op=decode B=2 kv=500 hq=40 hkv=8 dqk=128 dvo=128 qt=bf16 kvt=e4m3 ot=bf16 ps=5 ks=0.75 vs=1.5")
for i in 0 1 2; do t quick_hg_case$i 60 env KVATTN_CUDA_DECODE_HG=1 "$BUILD/tests/test_ops" --backend cuda --case "${cases[$i]}"; done
if [ "${HGGA_AB:-1}" != 0 ]; then
    echo "== A/B (positive: head groups slower than the tensor-core kernel)"
    ab --only "D5" --ab-only "D5"
    ab --only "D5 page 1" --ab-only "D5 page 1"
    KVATTN_BENCH_PAGE_SIZE=3 ab --only "D1 GQA 32/8" --ab-only "64 x 4096|64 x 8192"
fi
[ "${HGGA_TESTS:-1}" = 0 ] && exit $rc
echo "== tests"
t ops_decode_hg 150 env KVATTN_CUDA_DECODE_HG=1 "$BUILD/tests/test_ops" --backend cuda --suite decode
t ops_split 100 "$BUILD/tests/test_ops" --backend cuda --suite split
t fuzz30_hg 150 env KVATTN_CUDA_DECODE_HG=1 KVA_TEST_PDL=1 "$BUILD/tests/test_ops" --backend cuda --suite fuzz --seed 30 --count 200
t selftest 100 "$BUILD/kva_cuda_selftest" --quick
t selftest_hg 100 env KVATTN_CUDA_DECODE_HG=1 "$BUILD/kva_cuda_selftest" --quick
for tool in memcheck racecheck; do
    extra=(); [ $tool = racecheck ] && extra=(--racecheck-report hazard)
    for i in 0 1 2; do
        t ${tool}_hg_case$i 90 env KVATTN_CUDA_DECODE_HG=1 compute-sanitizer --tool $tool "${extra[@]}" --error-exitcode 99 \
            --print-limit 20 "$BUILD/tests/test_ops" --backend cuda --case "${cases[$i]}"
    done
done
exit $rc
