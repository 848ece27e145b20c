#!/usr/bin/env bash
# gpu_fp8_dims.sh - fp8 KV at head dims 256 and 64 on the tensor-core decode kernel: the selftest (d256 / d64 fp8
# cases on 4 and 8 warps), memcheck and racecheck on the quick selftest, test_ops decode and fuzz on the CUDA backend,
# then the interleaved A/B of the --extra X8 / X6 rows (GQA 16/8 at head dim 256, 64/8 at 64) against
# KVATTN_BENCH_FP8_CC=1 (the CUDA-core kernel, the earlier choice) and of the 8-warp form against
# KVATTN_BENCH_TC_WARPS=4 (SAN_TOOLS="" skips the sanitizers, HG16=0 the 16 x 4k probe, ONLY="X6" narrows the rows).
set -u
source "$(dirname "$0")/gpu_env.sh" fp8d256
rc=0
echo "== selftest"
"$BUILD/kva_cuda_selftest" > "$OUT/selftest.log" 2>&1 || { rc=1; echo "SELFTEST FAILED"; grep -i fail "$OUT/selftest.log" | head; }
grep -i "d256\|passed" "$OUT/selftest.log" | tail -8
for tool in ${SAN_TOOLS-memcheck racecheck}; do
    compute-sanitizer --tool $tool --error-exitcode 99 --print-limit 20 "$BUILD/kva_cuda_selftest" --quick \
        > "$OUT/$tool.log" 2>&1 && echo "PASS $tool selftest --quick ($(tail -1 "$OUT/$tool.log"))" \
        || { rc=1; echo "FAIL $tool"; tail -20 "$OUT/$tool.log"; }
done
for suite in decode fuzz; do
    KVA_TEST_BACKEND=cuda timeout 400 "$BUILD/tests/test_ops" --backend cuda --suite $suite \
        > "$OUT/ops_$suite.log" 2>&1 && echo "PASS test_ops $suite $(tail -1 "$OUT/ops_$suite.log")" \
        || { rc=1; echo "FAIL test_ops $suite"; grep -i "fail" "$OUT/ops_$suite.log" | head -20; tail -3 "$OUT/ops_$suite.log"; }
done
echo "== bench: tensor-core kernel vs KVATTN_BENCH_FP8_CC=1 (interleaved)"
"$BUILD/kva_bench_decode" --extra --only "${ONLY:-X8|X6}" --ab-only 'fp8' --ab-env KVATTN_BENCH_FP8_CC=1 \
    --csv "$OUT/bench_cc.csv" 2>&1 | grep -v "^$" | tail -40
echo "== bench: 8 warps vs KVATTN_BENCH_TC_WARPS=4 (interleaved)"
"$BUILD/kva_bench_decode" --extra --only "${ONLY_W8:-X8 d256 fp8|X6 d64 fp8}" --ab-only '1 x 32768' --ab-env KVATTN_BENCH_TC_WARPS=4 \
    --csv "$OUT/bench_w8.csv" 2>&1 | grep -v "^$" | tail -8
if [ "${HG16:-1}" = 1 ]; then
    echo "== probe: D1 16 x 4k on head groups of 2 heads, one CTA per SM / of 4 heads, against the default (interleaved)"
    "$BUILD/kva_bench_decode" --only '16 x 4096' --ab-only '16 x 4096' \
        --ab-env 'KVATTN_CUDA_DECODE_HG=1,KVATTN_BENCH_HG_HEADS=2,KVATTN_BENCH_HG_PER_SM=1' 2>&1 | grep -v "^$" | tail -4
    "$BUILD/kva_bench_decode" --only '16 x 4096' --ab-only '16 x 4096' --ab-env 'KVATTN_CUDA_DECODE_HG=1' 2>&1 \
        | grep -v "^$" | tail -4
fi
exit $rc
