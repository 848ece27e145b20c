#!/usr/bin/env bash
# gpu_prefill.sh - the tensor-core prefill family on the GPU machine in one call: correctness against the CPU
# backend (--check), compute-sanitizer on a small shape, the P1-P5/V1 benchmark, A/B runs (mma.sync mainloop:
# PREFILL_AB=0 skips; Hopper mainloop without TMA: PREFILL_TMA_AB=0 skips; PREFILL_EXP="64": the benchmark again
# with each KVATTN_BENCH_PF_EXP value, --only "$EXP_ONLY" when set, e.g. "V1|P3") and the peers (SDPA,
# FlexAttention). PREFILL_SAN=0 skips the sanitizers.
set -u
. "$(dirname "$0")/gpu_env.sh" pf
export KVA_COMMIT=$(git rev-parse --short HEAD 2>/dev/null)
echo "== prefill --check"
timeout 200 "$BUILD/kva_bench_prefill" --check 2>&1 | tail -30; echo "rc=$?"
if [ "${PREFILL_SAN:-1}" != 0 ]; then
  echo "== memcheck (quick check)"
  timeout 150 compute-sanitizer --tool memcheck --error-exitcode 99 --print-limit 10 "$BUILD/kva_bench_prefill" --check --quick 2>&1 | tail -6
  echo "== racecheck (quick check)"
  timeout 150 compute-sanitizer --tool racecheck --racecheck-report hazard --print-limit 10 "$BUILD/kva_bench_prefill" --check --quick 2>&1 | tail -4
fi
echo "== prefill benchmark"
timeout 150 "$BUILD/kva_bench_prefill" --csv "$OUT/kvattn_prefill.csv" 2>&1 | tail -30
if [ "${PREFILL_AB:-1}" != 0 ]; then
  echo "== prefill benchmark, mma.sync mainloop on sm_90 too (KVATTN_BENCH_NO_WGMMA=1, A/B)"
  KVATTN_BENCH_NO_WGMMA=1 timeout 150 "$BUILD/kva_bench_prefill" --csv "$OUT/kvattn_prefill_mma.csv" 2>&1 | tail -30
fi
if [ "${PREFILL_TMA_AB:-1}" != 0 ]; then
  echo "== prefill benchmark, Hopper mainloop without TMA (KVATTN_BENCH_NO_TMA=1, A/B)"
  KVATTN_BENCH_NO_TMA=1 timeout 150 "$BUILD/kva_bench_prefill" --csv "$OUT/kvattn_prefill_notma.csv" 2>&1 | tail -30
fi
for x in ${PREFILL_EXP:-}; do
  echo "== prefill benchmark, KVATTN_BENCH_PF_EXP=$x (A/B)"
  KVATTN_BENCH_PF_EXP=$x timeout 150 "$BUILD/kva_bench_prefill" ${EXP_ONLY:+--only "$EXP_ONLY"} --csv "$OUT/kvattn_prefill_exp$x.csv" 2>&1 | tail -30
done
echo "== peers"
timeout 200 python3 bench/peers_prefill.py --csv "$OUT/kvattn_prefill.csv" --out "$OUT/bench_prefill.md" 2>&1 | tail -40
