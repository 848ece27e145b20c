#!/usr/bin/env bash
# gpu_prefill_prof.sh - development profile of the prefill family on the GPU machine in one call: the planner's
# locality order against LPT (KVATTN_BENCH_PLAN_LPT=1) on the prefill benchmark, Nsight Compute on the Hopper
# kernel (V1 causal 8k: speed of light, memory, warp states, per-SASS-instruction stall samples), and optionally
# the decode per-CTA trace of one shape (DECODE_TRACE='1 x 32768').
set -u
BUILD=${BUILD:-build-dev}
OUT=${OUT:-$PWD/gpu_out}
mkdir -p "$OUT"
export LD_LIBRARY_PATH="$PWD/$BUILD:${LD_LIBRARY_PATH:-}:/usr/local/cuda/lib64"
export KVATTN_CACHE_DIR=/tmp/kvattn_cache_prof
p=$(ls /usr/local/cuda/lib64/libnvrtc.so.1[23] 2>/dev/null | head -1); [ -n "$p" ] && export KVATTN_NVRTC_PATH=$p
ONLY=${PROF_ONLY:-}
if [ "${PROF_CHECK:-1}" != 0 ]; then
  echo "== prefill --check"
  timeout 200 "$BUILD/kva_bench_prefill" --check 2>&1 | tail -4
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
if [ "${PROF_NCU:-1}" != 0 ] && [ -n "$NCU" ]; then
  for mode in loc lpt; do
    env_lpt=""; [ $mode = lpt ] && env_lpt=1
    echo "== ncu ($mode): V1 causal 8k, Hopper kernel"
    KVATTN_BENCH_PLAN_LPT=$env_lpt timeout 240 "$NCU" --kernel-name regex:kva_pfw --launch-skip 26 --launch-count 1 \
      --section SpeedOfLight --section MemoryWorkloadAnalysis --section WarpStateStats --section SourceCounters \
      --section ComputeWorkloadAnalysis --import-source no -o "$OUT/ncu_$mode" -f \
      "$BUILD/kva_bench_prefill" --only "V1 causal" --iters 3 > "$OUT/ncu_${mode}_run.txt" 2>&1
    tail -3 "$OUT/ncu_${mode}_run.txt"
    "$NCU" --import "$OUT/ncu_$mode.ncu-rep" --print-units base --page details 2>&1 | \
      grep -E "Kernel|Duration|Throughput|Hit Rate|Busy|Issued|Stall|Warp Cycles|Active Warps|Eligible|Executed Ipc|Pipe" | head -60
    if [ $mode = loc ]; then
      "$NCU" --import "$OUT/ncu_$mode.ncu-rep" --page source --csv --print-source sass > "$OUT/ncu_loc_source.csv" 2>"$OUT/ncu_src_err.txt" || true
      head -c 600 "$OUT/ncu_src_err.txt"; wc -l "$OUT/ncu_loc_source.csv"
    fi
  done
fi
if [ -n "${DECODE_TRACE:-}" ]; then
  echo "== decode trace: $DECODE_TRACE"
  KVA_BENCH_TRACE_DIR="$OUT" timeout 120 "$BUILD/kva_bench_decode" --only "$DECODE_TRACE" --trace "$DECODE_TRACE" 2>&1 | tail -20
fi
