#!/usr/bin/env bash
# gpu_hg_trace.sh - per-stage timelines of the head-group kernel on the GPU machine (kva_decode_hg.cuh built with
# KVA_HG_TRACE at plan time): bench_decode.c --trace over the SHAPES rows (KVATTN_BENCH_SHAPES syntax) with
# KVATTN_BENCH_TRACE_HG=1, raw per-CTA slots in $OUT/hgtrace_*.csv, summed up by scripts/hg_trace.py (STAGES PARTS
# STAGE_BYTES PRODUCERS per row: SPEC, "file-substring:S:P:SB:NP" entries), once per EXPS entry (KVATTN_BENCH_HG_EXP
# values; 0 = none). Then, for each AB entry, an interleaved A/B over ABSHAPES: arm A built at plan time with KVATTN_BENCH_HG_EXP=
# ABASE (no experiment bit), arm B with the entry's value.
set -u
cd "$(dirname "$0")/.."
source scripts/gpu_env.sh hgtrace
nvidia-smi --query-gpu=name,clocks.max.sm,clocks.max.mem --format=csv,noheader
SPEC=${SPEC:-"32_1_:20:4:8192:2 16_1_:16:8:8192:2 32_8_:6:2:32768:1"}
for e in ${EXPS:-0}; do
    mkdir -p "$OUT/tr$e"
    echo "==== trace, KVATTN_BENCH_HG_EXP=$e"
    KVATTN_BENCH_HG_EXP=$e KVATTN_BENCH_SHAPES="${SHAPES:-32/1:64x4096,16/1:64x4096}" KVATTN_BENCH_TRACE_HG=1 \
        KVA_BENCH_TRACE_DIR="$OUT/tr$e" timeout 200 stdbuf -oL "$BUILD/kva_bench_decode" --iters 5 --only XS \
        --no-bounds-check-ab 0 --trace XS > "$OUT/tr$e/hgtrace.log" 2>&1 || echo "kva_bench_decode rc=$?"
    grep -E "^trace" "$OUT/tr$e/hgtrace.log" | grep cold
    for f in "$OUT/tr$e"/hgtrace_*_cold.csv; do
        for s in $SPEC; do
            IFS=: read -r sub S P SB np <<< "$s"
            case "$(basename "$f")" in *"$sub"*) python3 scripts/hg_trace.py "$f" "$S" "$P" "$SB" --np $np \
                --cta ${CTA:--1} | grep -v "p10 *nan"; break;; esac
        done
    done
done
for b in ${AB:-}; do
    echo "==== A/B KVATTN_BENCH_HG_EXP ${ABASE:-64} vs $b"
    KVATTN_BENCH_HG_EXP=${ABASE:-64} KVATTN_BENCH_SHAPES="${ABSHAPES:-32/1:64x4096}" timeout 300 stdbuf -oL \
        "$BUILD/kva_bench_decode" --iters 5 --only XS --ab-env KVATTN_BENCH_HG_EXP=$b --ab-only XS \
        > "$OUT/ab_$b.log" 2>&1 || echo "kva_bench_decode rc=$?"
    grep "^A/B" "$OUT/ab_$b.log" | sed 's/(medians.*//; s/KVATTN_BENCH_//'
done
