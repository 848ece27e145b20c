#!/usr/bin/env bash
# gpu_fp8_hg.sh - fp8 KV in the head-group decode kernel: the selftest (head-group matrix with fp8 cases, fault
# injection), optionally the sanitizers and test_ops with head groups everywhere (FP8_HG_FULL=1), then the
# interleaved A/B of the D6 rows and the 16-bit rows they sit beside against KVATTN_CUDA_DECODE_HG=0.
set -u
source "$(dirname "$0")/gpu_env.sh" fp8hg
rc=0
echo "== selftest"
"$BUILD/kva_cuda_selftest" > "$OUT/selftest.log" 2>&1 || { rc=1; echo "SELFTEST FAILED"; }
grep -i "fail\|passed\|head-group" "$OUT/selftest.log" | tail -8
if [ "${FP8_HG_FULL:-0}" = 1 ]; then
    for tool in memcheck racecheck; do
        compute-sanitizer --tool $tool --error-exitcode 99 --print-limit 20 "$BUILD/kva_cuda_selftest" --quick \
            > "$OUT/$tool.log" 2>&1 && echo "PASS $tool selftest --quick" || { rc=1; echo "FAIL $tool"; tail -20 "$OUT/$tool.log"; }
    done
    for suite in decode split fuzz; do
        KVA_TEST_BACKEND=cuda KVATTN_CUDA_DECODE_HG=1 timeout 300 "$BUILD/tests/test_ops" --backend cuda --suite $suite \
            > "$OUT/ops_$suite.log" 2>&1 && echo "PASS test_ops $suite [head groups] $(tail -1 "$OUT/ops_$suite.log")" \
            || { rc=1; echo "FAIL test_ops $suite"; tail -20 "$OUT/ops_$suite.log"; }
    done
fi
echo "== bench: default vs KVATTN_CUDA_DECODE_HG=0 (interleaved)"
"$BUILD/kva_bench_decode" --only 'D6|D1 GQA 32/8' --ab-only 'D6|64 x 4096|64 x 8192' --ab-env KVATTN_CUDA_DECODE_HG=0 \
    --csv "$OUT/bench.csv" 2>&1 | grep -v "^$" | tail -24
exit $rc
