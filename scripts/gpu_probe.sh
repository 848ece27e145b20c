#!/usr/bin/env bash
# gpu_probe.sh - decode bandwidth probes on the GPU machine in one call (build-dev carried):
#   1. tools/hbm_read: the read ceiling of contiguous, NHD-paged, HND-paged and whole-page patterns
#   2. kva_bench_decode A/B of the same plan on NHD vs HND pools (PROBE_SHAPES) and per-CTA traces (TRACE_SHAPES)
set -u
source scripts/gpu_env.sh probe
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,temperature.gpu,power.draw --format=csv,noheader || true
[ -x "$BUILD/tools/hbm_read" ] && timeout 120 "$BUILD/tools/hbm_read" ${HBM_MB:-134.2 1073.7 2147.5}
SH=${PROBE_SHAPES:-1 x 32768|16 x 4096|64 x 8192|256 x 2048}
timeout 240 "$BUILD/kva_bench_decode" --only "$SH" --ab-layout --ab-only "$SH" ${TRACE_SHAPES:+--trace "$TRACE_SHAPES"} \
    --csv "$OUT/probe.csv"
