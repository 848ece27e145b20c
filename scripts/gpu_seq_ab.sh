#!/usr/bin/env bash
# gpu_seq_ab.sh - sequential A/B of kva_bench_decode on the GPU machine: PAIRS pairs of whole benchmark runs, arm A
# then arm B, each arm in its own process with its own environment, then the per-row medians of the runs.
# For calls of a few microseconds this is the measurement to use (the interleaved --ab-env A/B is not reliable there:
# bench/results/small_calls_h100_2026-11-22_session14.md, section 5).
#
#   bash scripts/gpu_seq_ab.sh NAME 'VAR=x ...' 'VAR=y ...' PAIRS 'ONLY' [kva_bench_decode args...]
#
# An arm's environment may be '' (the default). Rows are kva_bench_decode's CSV rows (graph rows give a cold and a
# "(warm)" row). CSVs go to $OUT/seq_ab_NAME_{A,B}_i.csv, the table to $OUT/seq_ab_NAME.md and stdout.
set -u
name=$1 envA=$2 envB=$3 pairs=$4 only=$5
shift 5
source "$(dirname "$0")/gpu_env.sh" "seqab_$name"
for i in $(seq 1 "$pairs"); do
    for arm in A B; do
        if [ $arm = A ]; then e=$envA; else e=$envB; fi
        env $e "$BUILD/kva_bench_decode" --only "$only" --csv "$OUT/seq_ab_${name}_${arm}_$i.csv" "$@" \
            > "$OUT/seq_ab_${name}_${arm}_$i.log" 2>&1 || echo "run $arm $i failed: $(tail -3 "$OUT/seq_ab_${name}_${arm}_$i.log")"
    done
done
python3 - "$OUT" "$name" "$pairs" "$envA" "$envB" <<'EOF' | tee "$OUT/seq_ab_$name.md"
import csv, statistics, sys
out, name, pairs, ea, eb = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4], sys.argv[5]
runs = {"A": {}, "B": {}}
order = []
for arm in "AB":
    for i in range(1, pairs + 1):
        try:
            rows = list(csv.DictReader(open(f"{out}/seq_ab_{name}_{arm}_{i}.csv")))
        except OSError:
            continue
        for r in rows:
            k = (r["group"], r["name"], r["label"])
            if k not in order:
                order.append(k)
            runs[arm].setdefault(k, []).append(float(r["kvattn_us"]))
print(f"sequential A/B '{name}': A = [{ea or 'default'}], B = [{eb or 'default'}], {pairs} pairs, us per call")
print()
print("| group | row | shape | A runs | B runs | A median | B median | B vs A |")
print("|---|---|---|---|---|---:|---:|---:|")
for k in order:
    a, b = runs["A"].get(k, []), runs["B"].get(k, [])
    if not a or not b:
        continue
    ma, mb = statistics.median(a), statistics.median(b)
    print(f"| {k[0]} | {k[1]} | {k[2]} | {' / '.join(f'{x:.1f}' for x in a)} | {' / '.join(f'{x:.1f}' for x in b)} "
          f"| {ma:.2f} | {mb:.2f} | {100.0 * (mb - ma) / ma:+.1f} % |")
EOF
