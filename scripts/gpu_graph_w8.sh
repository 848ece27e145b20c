#!/usr/bin/env bash
# gpu_graph_w8.sh - graph-mode decode plans on one worker per SM with the 8-warp kernel (session 20), one call:
# the tests that run graph-mode plans (test_ops decode and split, selftest, python), sanitizers on the selftest,
# a sequential A/B of the D7 rows against KVATTN_BENCH_TC_WARPS=4 (graph plans as before: 264 workers of 4 warps),
# then the decode table with peers (-> $OUT/bench_decode.md).
set -u
source "$(dirname "$0")/gpu_env.sh" gw8
B=$BUILD
export LD_LIBRARY_PATH="$PWD/$B/tests:$LD_LIBRARY_PATH"
nvidia-smi --query-gpu=name --format=csv,noheader
t0=$(date +%s)
for suite in decode split; do
    timeout 120 "$B/tests/test_ops" --backend cuda --suite $suite > "$OUT/ops_$suite.log" 2>&1
    echo "test_ops $suite rc=$? $(tail -1 "$OUT/ops_$suite.log")"
done
timeout 120 "$B/kva_cuda_selftest" --verbose > "$OUT/selftest.log" 2>&1
echo "selftest rc=$? $(tail -1 "$OUT/selftest.log")"; grep -E "FAIL|  graph:|pdl graph" "$OUT/selftest.log" | head
timeout 200 env PYTHONPATH="$PWD/python" KVATTN_LIBRARY="$PWD/$B/libkvattn.so" python3 -m pytest -q -x python/tests \
    > "$OUT/py.log" 2>&1; echo "python rc=$? $(tail -1 "$OUT/py.log")"
timeout 150 compute-sanitizer --tool memcheck --error-exitcode 99 --print-limit 20 "$B/kva_cuda_selftest" --quick \
    > "$OUT/memcheck.log" 2>&1; echo "memcheck rc=$? $(tail -1 "$OUT/memcheck.log")"
timeout 150 compute-sanitizer --tool racecheck --racecheck-report hazard --error-exitcode 99 --print-limit 20 \
    "$B/kva_cuda_selftest" --quick > "$OUT/racecheck.log" 2>&1; echo "racecheck rc=$? $(tail -1 "$OUT/racecheck.log")"
echo "tests done at $(( $(date +%s) - t0 )) s"
timeout 150 bash scripts/gpu_seq_ab.sh gw8 'KVATTN_BENCH_TC_WARPS=4' '' 2 D7 > /dev/null 2>&1; echo "seq ab rc=$?"
cat "$OUT/seq_ab_gw8.md"
GPU_CHECK_TESTS=0 GPU_CHECK_SANITIZE=0 timeout 200 bash scripts/gpu_check.sh > /dev/null 2>&1; echo "table rc=$?"
echo "done at $(( $(date +%s) - t0 )) s"
cat "$OUT/bench_decode.md"
