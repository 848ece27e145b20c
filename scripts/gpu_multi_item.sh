#!/usr/bin/env bash
# gpu_multi_item.sh - the multi-item tests (several work items per worker): the selftest (fault in a 300-request
# batch, with and without split KV), test_ops' device-only multi-item cases, racecheck of a small multi-item case.
# Carry ["build-dev"].
set -u
source "$(dirname "$0")/gpu_env.sh" multi
export LD_LIBRARY_PATH="$PWD/$BUILD/tests:$LD_LIBRARY_PATH"
nvidia-smi --query-gpu=name --format=csv,noheader
rc=0
t() { local name=$1 limit=$2; shift 2; local t0=$(date +%s)
      timeout $limit "$@" > "$OUT/$name.log" 2>&1; local r=$?; [ $r -ne 0 ] && rc=1
      echo "$name: rc $r, $(( $(date +%s) - t0 )) s: $(grep -E "passed|ERROR SUMMARY" "$OUT/$name.log" | tail -2 | tr '\n' ' ')"
      grep -m3 -E "FAIL|Race|Hazard" "$OUT/$name.log"; }
t selftest ${MI_LIMIT:-60} "$BUILD/kva_cuda_selftest" --quick
t case300 ${MI_LIMIT:-60} "$BUILD/tests/test_ops" --backend cuda --case \
    "op=decode B=300 kv=700 hq=32 hkv=8 dqk=128 dvo=128 qt=bf16 kvt=bf16 ot=bf16 ps=16 empty=10 lse=1"
t racecheck_small ${MI_LIMIT:-60} compute-sanitizer --tool racecheck --racecheck-report hazard --error-exitcode 99 \
    --print-limit 20 "$BUILD/tests/test_ops" --backend cuda --case \
    "op=decode B=140 kv=40 hq=4 hkv=2 dqk=64 dvo=64 qt=bf16 kvt=bf16 ot=bf16 ps=16 lse=1"
exit $rc
