#!/usr/bin/env bash
# gpu_ncu_probe.sh - ncu on one decode kernel launch of kva_bench_decode (GPU machine): the warp-state and memory
# sections, and the per-instruction SASS source counters (stall reasons) as CSV.
#
#   bash scripts/gpu_ncu_probe.sh NAME KERNEL_REGEX LAUNCH_SKIP [kva_bench_decode args...]
#
# Writes $OUT/ncu_NAME.txt (details page) and $OUT/ncu_NAME_source.csv (SASS with per-instruction counters).
set -u
name=$1 regex=$2 skip=$3
shift 3
source "$(dirname "$0")/gpu_env.sh" "ncu_$name"
NCU=$(command -v ncu || ls /usr/local/cuda/bin/ncu 2>/dev/null | head -1)
[ -n "$NCU" ] || { echo "no ncu"; exit 1; }
timeout 300 "$NCU" --clock-control none --kernel-name "regex:$regex" --launch-skip "$skip" --launch-count 1 \
    --section SpeedOfLight --section MemoryWorkloadAnalysis --section WarpStateStats --section SourceCounters \
    --section LaunchStats --section Occupancy --import-source no -o "$OUT/ncu_$name" -f \
    "$BUILD/kva_bench_decode" --iters 5 --no-bounds-check-ab 0 "$@" > "$OUT/ncu_${name}_run.txt" 2>&1
"$NCU" --import "$OUT/ncu_$name.ncu-rep" --print-units base --page details > "$OUT/ncu_$name.txt" 2>&1
"$NCU" --import "$OUT/ncu_$name.ncu-rep" --page source --csv --print-source sass > "$OUT/ncu_${name}_source.csv" 2>/dev/null
grep -E "Function Name|Grid Size|Block Size|Duration|DRAM Throughput|Memory Throughput|Warp Cycles Per Issued|Issued Ipc|Registers|Stall|Achieved Occupancy" \
    "$OUT/ncu_$name.txt" | head -40
rm -f "$OUT/ncu_$name.ncu-rep"
