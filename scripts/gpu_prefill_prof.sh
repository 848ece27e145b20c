#!/usr/bin/env bash
# gpu_prefill_prof.sh - development profile of the prefill family on the GPU machine in one call: the planner's
# locality order against LPT (KVATTN_BENCH_PLAN_LPT=1) on the prefill benchmark, Nsight Compute on the Hopper
# kernel (V1 causal 8k: speed of light, memory, warp states, per-SASS-instruction stall samples), and optionally
# the decode per-CTA trace of one shape (DECODE_TRACE='1 x 32768').
set -u
. "$(dirname "$0")/gpu_env.sh" prof
ONLY=${PROF_ONLY:-}
if [ "${PROF_CHECK:-1}" != 0 ]; then
  echo "== prefill --check"
  timeout 200 "$BUILD/kva_bench_prefill" --check 2>&1 | grep -E "FAIL|passed|failed" | tail -8
fi
if [ -n "${PROF_EXP:-}" ]; then # timing experiments compiled into the prefill kernels (KVP_EXP; results not valid)
  for x in 0 $PROF_EXP; do
    echo "== prefill benchmark, KVATTN_BENCH_PF_EXP=$x, --only '${EXP_ONLY:-V1 causal}'"
    KVATTN_BENCH_PF_EXP=$x timeout 200 "$BUILD/kva_bench_prefill" --only "${EXP_ONLY:-V1 causal}" 2>&1 | grep -E "^(P|V)[0-9]"
  done
fi
if [ "${PROF_AB:-1}" != 0 ]; then
  for rep in 1 2; do
    echo "== prefill benchmark, locality order (rep $rep)"
    timeout 150 "$BUILD/kva_bench_prefill" ${ONLY:+--only "$ONLY"} --csv "$OUT/pf_loc_$rep.csv" 2>&1 | tail -30
    echo "== prefill benchmark, LPT order (KVATTN_BENCH_PLAN_LPT=1, rep $rep)"
    KVATTN_BENCH_PLAN_LPT=1 timeout 150 "$BUILD/kva_bench_prefill" ${ONLY:+--only "$ONLY"} --csv "$OUT/pf_lpt_$rep.csv" 2>&1 | tail -30
  done
fi
NCU=$(command -v ncu || ls /usr/local/cuda/bin/ncu 2>/dev/null | head -1)
# PROF_NCU: "name:launch-skip ..." over the pfw launches of `kva_bench_prefill --only "V1 causal" --iters 5`
# (8 launches per workload: causal 2k, soft cap 2k, ALiBi 2k, causal 8k, soft cap 8k, ALiBi 8k)
if [ "${PROF_NCU:-causal8k:26}" != 0 ] && [ -n "$NCU" ]; then
  for spec in ${PROF_NCU:-causal8k:26}; do
    name=${spec%%:*}; skip=${spec##*:}
    echo "== ncu $name (pfw launch $skip of --only 'V1 causal')"
    timeout 240 "$NCU" --kernel-name regex:kva_pfw --launch-skip "$skip" --launch-count 1 \
      --section SpeedOfLight --section MemoryWorkloadAnalysis --section WarpStateStats --section SourceCounters \
      --section ComputeWorkloadAnalysis --import-source no -o "$OUT/ncu_$name" -f \
      "$BUILD/kva_bench_prefill" --only "V1 causal" --iters 5 > "$OUT/ncu_${name}_run.txt" 2>&1
    "$NCU" --import "$OUT/ncu_$name.ncu-rep" --print-units base --page details 2>&1 | \
      grep -E "Duration|Throughput|Hit Rate|Issue Slots|Warp Cycles Per Issued|Pipe" | head -20
    "$NCU" --import "$OUT/ncu_$name.ncu-rep" --page source --csv --print-source sass > "$OUT/ncu_${name}_source.csv" 2>/dev/null || true
    rm -f "$OUT/ncu_$name.ncu-rep" "$OUT/ncu_${name}_run.txt"
  done
fi
if [ -n "${DECODE_TRACE:-}" ]; then
  echo "== decode trace: $DECODE_TRACE"
  KVA_BENCH_TRACE_DIR="$OUT" timeout 120 "$BUILD/kva_bench_decode" --only "$DECODE_TRACE" --trace "$DECODE_TRACE" 2>&1 | tail -20
fi
