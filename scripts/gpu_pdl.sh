#!/usr/bin/env bash
# gpu_pdl.sh - programmatic dependent launch (kva_run_args.enable_pdl) on the GPU machine, one call:
#   1. kva_cuda_selftest --pdl-only (PDL chains: eager and graph-mode plans), also with clusters (KVATTN_CUDA_CLUSTER=8)
#   2. negative control: the chains with the tensor-core kernel built without its griddepcontrol.wait
#      (KVATTN_BENCH_TC_EXP=64): they must fail, which shows that the chain test can catch a missing wait
#   3. compute-sanitizer memcheck and racecheck on the PDL chains (default and clusters)
#   4. sequential A/Bs: D7 rows default against KVATTN_CUDA_CLUSTER=8 (the PDL rows with clusters), D1 rows default
#      against KVATTN_BENCH_PDL=1 (eager calls after the L2 flush kernel)
#   5. PDL_TABLE=1: the whole decode table with peers (gpu_check.sh, benchmark only) -> $OUT/bench_decode.md
set -u
source "$(dirname "$0")/gpu_env.sh" pdl
B=$BUILD
nvidia-smi --query-gpu=name,clocks.max.sm,driver_version --format=csv,noheader
t0=$(date +%s)
step() { echo; echo "== $* ($(( $(date +%s) - t0 )) s)"; }
step "1. PDL chains (default, clusters)"
timeout 120 "$B/kva_cuda_selftest" --pdl-only --verbose > "$OUT/selftest_pdl.log" 2>&1; echo "rc=$?"
grep -E "pdl [a-z]|FAIL|passed" "$OUT/selftest_pdl.log"
KVATTN_CUDA_CLUSTER=8 timeout 120 "$B/kva_cuda_selftest" --pdl-only --verbose > "$OUT/selftest_pdl_cl.log" 2>&1
echo "clusters rc=$?"; grep -E "pdl [a-z]|FAIL|passed" "$OUT/selftest_pdl_cl.log"
step "2. negative control: no wait in the tensor-core kernel (the chains must fail)"
KVATTN_BENCH_TC_EXP=64 timeout 120 "$B/kva_cuda_selftest" --pdl-only > "$OUT/selftest_nowait.log" 2>&1; echo "rc=$?"
grep -E "FAIL|passed" "$OUT/selftest_nowait.log" | cut -c1-160 | head -8
step "3. sanitizers on the PDL chains"
for cl in 0 8; do
    KVATTN_CUDA_CLUSTER=$cl timeout 150 compute-sanitizer --tool memcheck --error-exitcode 99 --print-limit 20 \
        "$B/kva_cuda_selftest" --quick --pdl-only > "$OUT/memcheck_$cl.log" 2>&1
    echo "memcheck (clusters $cl) rc=$?"; tail -1 "$OUT/memcheck_$cl.log"
    KVATTN_CUDA_CLUSTER=$cl timeout 150 compute-sanitizer --tool racecheck --racecheck-report hazard --error-exitcode 99 \
        --print-limit 20 "$B/kva_cuda_selftest" --quick --pdl-only > "$OUT/racecheck_$cl.log" 2>&1
    echo "racecheck (clusters $cl) rc=$?"; tail -1 "$OUT/racecheck_$cl.log"
done
step "4. sequential A/Bs"
timeout 200 bash scripts/gpu_seq_ab.sh pdl_cl '' 'KVATTN_CUDA_CLUSTER=8' 3 D7 > /dev/null 2>&1; echo "rc=$?"
cat "$OUT/seq_ab_pdl_cl.md"
timeout 240 bash scripts/gpu_seq_ab.sh pdl_d1 '' 'KVATTN_BENCH_PDL=1' 2 D1 > /dev/null 2>&1; echo "rc=$?"
cat "$OUT/seq_ab_pdl_d1.md"
if [ "${PDL_TABLE:-0}" = 1 ]; then
    step "5. decode table with peers"
    GPU_CHECK_TESTS=0 GPU_CHECK_SANITIZE=0 timeout 280 bash scripts/gpu_check.sh > /dev/null 2>&1; echo "rc=$?"
    cat "$OUT/bench_decode.md"
fi
step "done"
