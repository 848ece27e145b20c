#!/usr/bin/env bash
# gpu_fp8_w8.sh - fp8 KV on the 8-warp tensor-core kernel (one CTA per SM): the selftest, test_ops decode / split /
# fuzz on the CUDA backend, memcheck of the quick selftest, then sequential pairs of the fp8 rows (D6, and the D7
# step whose layers each run an fp8 call) against KVATTN_BENCH_TC_WARPS=4 (which plans fp8 as before).
set -u
source "$(dirname "$0")/gpu_env.sh" fp8w8
rc=0
"$BUILD/kva_cuda_selftest" > "$OUT/selftest.log" 2>&1 && echo "PASS selftest $(tail -1 "$OUT/selftest.log")" || { rc=1; echo FAIL selftest; grep -i fail "$OUT/selftest.log" | head; }
for suite in decode split fuzz; do
    KVA_TEST_BACKEND=cuda timeout 400 "$BUILD/tests/test_ops" --backend cuda --suite $suite > "$OUT/ops_$suite.log" 2>&1 \
        && echo "PASS test_ops $suite $(tail -1 "$OUT/ops_$suite.log")" || { rc=1; echo "FAIL test_ops $suite"; tail -20 "$OUT/ops_$suite.log"; }
done
compute-sanitizer --tool memcheck --error-exitcode 99 --print-limit 20 "$BUILD/kva_cuda_selftest" --quick \
    > "$OUT/memcheck.log" 2>&1 && echo "PASS memcheck selftest --quick" || { rc=1; echo FAIL memcheck; tail -20 "$OUT/memcheck.log"; }
bash "$(dirname "$0")/gpu_seq_ab.sh" fp8w8 '' 'KVATTN_BENCH_TC_WARPS=4' 3 'D6|MX'
exit $rc
