#!/usr/bin/env bash
# gpu_wg.sh - the Hopper prefill mainloop on the GPU machine: --check against the CPU backend (optionally a filter),
# then an A/B of the prefill benchmark with the warpgroup-MMA mainloop (default on sm_90) and the mma.sync one
# (KVATTN_BENCH_NO_WGMMA=1). env: WG_CHECK=0 skips the check, WG_ONLY=substr filters both, WG_BENCH=0 skips the A/B,
# WG_SAN=1 adds memcheck + racecheck on --check --quick.
set -u
BUILD=${BUILD:-build-dev}
export LD_LIBRARY_PATH="$PWD/$BUILD:${LD_LIBRARY_PATH:-}:/usr/local/cuda/lib64"
export KVATTN_CACHE_DIR=/tmp/kvattn_cache_wg
p=$(ls /usr/local/cuda/lib64/libnvrtc.so.1[23] 2>/dev/null | head -1); [ -n "$p" ] && export KVATTN_NVRTC_PATH=$p
ONLY=${WG_ONLY:-}
if [ "${WG_CHECK:-1}" != 0 ]; then
  echo "== check (wgmma)"
  timeout 240 "$BUILD/kva_bench_prefill" --check ${ONLY:+--only "$ONLY"} 2>&1 | grep -v "^  " | tail -40
fi
if [ "${WG_SAN:-0}" != 0 ]; then
  echo "== memcheck"
  timeout 200 compute-sanitizer --tool memcheck --error-exitcode 99 --print-limit 10 "$BUILD/kva_bench_prefill" --check --quick 2>&1 | tail -5
  echo "== racecheck"
  timeout 200 compute-sanitizer --tool racecheck --racecheck-report hazard --print-limit 10 "$BUILD/kva_bench_prefill" --check --quick 2>&1 | tail -4
fi
if [ "${WG_BENCH:-1}" != 0 ]; then
  echo "== bench wgmma"
  timeout 150 "$BUILD/kva_bench_prefill" ${ONLY:+--only "$ONLY"} 2>&1 | tail -30
  echo "== bench mma.sync"
  KVATTN_BENCH_NO_WGMMA=1 timeout 150 "$BUILD/kva_bench_prefill" ${ONLY:+--only "$ONLY"} 2>&1 | tail -30
fi
