#!/usr/bin/env bash
# gpu_pf_ab.sh - prefill A/B on the GPU machine in one call: --check (and, PF_SAN=1, memcheck / racecheck on the
# quick matrix), then the benchmark rounds ROUNDS times over the settings in AB ("name:ENV=VALUE,..." entries; "base:"
# is the build as is), interleaved round by round so that drift hits every side alike, --only "$ONLY".
set -u
. "$(dirname "$0")/gpu_env.sh" pfab
T0=$(date +%s)
el() { echo "[$(( $(date +%s) - T0 )) s] $*"; }
if [ "${PF_CHECK:-1}" != 0 ]; then
  el "== prefill --check"
  timeout 240 "$BUILD/kva_bench_prefill" --check 2>&1 | tail -8
fi
if [ "${PF_SAN:-0}" != 0 ]; then
  el "== memcheck (quick check)"
  timeout 200 compute-sanitizer --tool memcheck --error-exitcode 99 --print-limit 10 "$BUILD/kva_bench_prefill" --check --quick 2>&1 | tail -4
  el "== racecheck (quick check)"
  timeout 200 compute-sanitizer --tool racecheck --racecheck-report hazard --print-limit 10 "$BUILD/kva_bench_prefill" --check --quick 2>&1 | tail -4
fi
for r in $(seq 1 "${ROUNDS:-1}"); do
  for e in ${AB:-base:}; do
    name=${e%%:*}; envs=${e#*:}
    el "== round $r: $name ($envs)"
    env $(echo "$envs" | tr ',' ' ') timeout 200 "$BUILD/kva_bench_prefill" ${ONLY:+--only "$ONLY"} ${ITERS:+--iters "$ITERS"} \
      --csv "$OUT/ab_${name}_r$r.csv" 2>&1 | grep -E "^[PV][0-9]"
  done
done
el "done"
