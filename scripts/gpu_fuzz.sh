#!/usr/bin/env bash
# gpu_fuzz.sh - test_ops' fuzz suite on the CUDA backend over extra seeds (the GPU check runs seed 1): for each seed
# the default context, then head groups wherever in scope (KVATTN_CUDA_DECODE_HG=1) with programmatic dependent
# launch (KVA_TEST_PDL=1). A failing case prints its seed and case string, which replays it (test_ops --case).
#   bash scripts/gpu_fuzz.sh [SEED ...]        (default seeds 11 12 13; COUNT=800 cases per run)
set -u
source "$(dirname "$0")/gpu_env.sh" fuzz
export LD_LIBRARY_PATH="$PWD/$BUILD/tests:$LD_LIBRARY_PATH"
seeds=("$@")
[ ${#seeds[@]} -eq 0 ] && seeds=(11 12 13)
rc=0
for seed in "${seeds[@]}"; do
    for mode in default hg+pdl; do
        if [ $mode = default ]; then e=(); else e=(KVATTN_CUDA_DECODE_HG=1 KVA_TEST_PDL=1); fi
        t0=$(date +%s)
        env "${e[@]}" timeout 400 "$BUILD/tests/test_ops" --backend cuda --suite fuzz --seed "$seed" \
            --count "${COUNT:-800}" > "$OUT/fuzz_${seed}_$mode.log" 2>&1
        r=$?
        [ $r -ne 0 ] && rc=1
        echo "fuzz seed $seed [$mode]: rc $r, $(( $(date +%s) - t0 )) s: $(tail -1 "$OUT/fuzz_${seed}_$mode.log")"
        grep -E "FAIL" "$OUT/fuzz_${seed}_$mode.log" | head -5
    done
done
exit $rc
