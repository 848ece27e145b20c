#!/usr/bin/env bash
# gpu_pdl.sh - programmatic dependent launch (kva_run_args.enable_pdl) on the GPU machine, one call:
#   1. kva_cuda_selftest (with its PDL chains: eager and graph-mode plans, head groups, the merge kernel)
#   2. negative control: the chains with the tensor-core kernel built without its griddepcontrol.wait
#      (KVATTN_BENCH_TC_EXP=64): they must fail, which shows that the chain test can catch a missing wait
#   3. compute-sanitizer memcheck and racecheck on the PDL chains; test_errors on the CUDA backend
#   4. sequential A/B of the D7 rows, default against KVATTN_BENCH_PDL=1 (3 pairs), then one D7 run with the peers
#      (SDPA cuDNN / flash) of the same run -> $OUT/bench_d7.md
set -u
source "$(dirname "$0")/gpu_env.sh" pdl
B=$BUILD
nvidia-smi --query-gpu=name,clocks.max.sm,driver_version --format=csv,noheader
t0=$(date +%s)
step() { echo; echo "== $* ($(( $(date +%s) - t0 )) s)"; }
step "1. selftest"
timeout 240 "$B/kva_cuda_selftest" --verbose > "$OUT/selftest.log" 2>&1; echo "rc=$?"
grep -E "pdl|FAIL|passed" "$OUT/selftest.log" | tail -25
step "2. negative control: no wait in the tensor-core kernel (the chains must fail)"
KVATTN_BENCH_TC_EXP=64 timeout 120 "$B/kva_cuda_selftest" --pdl-only > "$OUT/selftest_nowait.log" 2>&1; echo "rc=$?"
grep -E "FAIL|passed" "$OUT/selftest_nowait.log" | head -8
step "3. sanitizers on the PDL chains, test_errors"
timeout 150 compute-sanitizer --tool memcheck --error-exitcode 99 --print-limit 20 "$B/kva_cuda_selftest" --quick \
    --pdl-only > "$OUT/memcheck.log" 2>&1; echo "memcheck rc=$?"; tail -2 "$OUT/memcheck.log"
timeout 150 compute-sanitizer --tool racecheck --racecheck-report hazard --error-exitcode 99 --print-limit 20 \
    "$B/kva_cuda_selftest" --quick --pdl-only > "$OUT/racecheck.log" 2>&1; echo "racecheck rc=$?"; tail -2 "$OUT/racecheck.log"
LD_LIBRARY_PATH="$PWD/$B/tests:$LD_LIBRARY_PATH" timeout 60 "$B/tests/test_errors" --backend cuda > "$OUT/test_errors.log" 2>&1
echo "test_errors rc=$?"; tail -1 "$OUT/test_errors.log"
step "4. D7: sequential A/B of KVATTN_BENCH_PDL, then the peers"
timeout 300 bash scripts/gpu_seq_ab.sh pdl '' 'KVATTN_BENCH_PDL=1' 3 D7 > /dev/null 2>&1; echo "seq ab rc=$?"
timeout 60 "$B/kva_bench_decode" --only D7 --csv "$OUT/d7.csv" > "$OUT/d7.log" 2>&1; echo "bench rc=$?"
timeout 120 python3 bench/peers_decode.py --csv "$OUT/d7.csv" --out "$OUT/bench_d7.md" > "$OUT/peers.log" 2>&1
echo "peers rc=$?"
step "done"
cat "$OUT/seq_ab_pdl.md"
cat "$OUT/bench_d7.md"
