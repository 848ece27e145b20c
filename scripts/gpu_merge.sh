#!/usr/bin/env bash
# gpu_merge.sh - the split-KV merge kernel's warp per (task, row) over the grid (kva_merge_partials with row_units,
# KVATTN_BENCH_MERGE_ROWS=1) on the GPU machine, in one call. bench: for each arm of ARMS (default: the separate merge
# kernel as it is (a CTA per task), then with a warp per (task, row) at the planner's row-slot split cap of 32 chunks
# and at caps of 64 and 128, and a CTA per (task, row) (KVATTN_BENCH_MERGE_ROWS=2) at 128) an interleaved A/B against the default plan (fused merge) on SHAPES (batch-1 and
# small-batch GQA groups of 9 to 32, where a split unit's g rows are merged; 32/8 for the tensor-core kernel), then
# cuDNN / flash SDPA on the same shapes. tests: test_ops split / decode / prefill / ragged through the separate merge
# kernel with row units (KVATTN_BENCH_NO_FUSED_MERGE=1 KVATTN_BENCH_MERGE_ROWS=1), decode with row slots for every call
# in scope, the selftest, fuzz runs with PDL; the default split and decode suites (the decode suite, prefill and the
# fuzz draws include page tables in block-table form, bt=1, which have not run on a GPU before). san: memcheck and racecheck on split cases
# through the merge kernel. dtests / dsan: the default plans' suites, fuzz, and sanitizers on row-merge cases.
# Steps: STEPS="bench tests san" (default; also dtests dsan, rtests: split / decode and a 4-unit row-slot case). The logs end in $OUT/logs.tgz (PACK=0: loose).
set -u
cd "$(dirname "$0")/.."
source scripts/gpu_env.sh merge
export LD_LIBRARY_PATH="$PWD/$BUILD/tests:$LD_LIBRARY_PATH"
T="$BUILD/tests/test_ops"
# the run tool brings back at most 8 files: the logs go into one archive (PACK=0 keeps them loose), also when the
# script is stopped (SIGTERM / SIGINT from a time limit)
pack_logs() {
    if [ "${PACK:-1}" = 1 ]; then
        (cd "$OUT" && ls | grep -v -E '^(logs\.tgz|shapes\.md|shapes\.csv)$' > .pack && [ -s .pack ] &&
            tar czf logs.tgz -T .pack && xargs rm -f < .pack; rm -f .pack)
    fi
}
trap 'echo "stopped: packing the logs"; pack_logs; exit 124' TERM INT
STEPS=${STEPS:-bench tests san}
STEP_PREFIX=merge # step(): scripts/gpu_env.sh
nvidia-smi --query-gpu=name,clocks.max.sm,clocks.max.mem --format=csv,noheader
NF=KVATTN_BENCH_NO_FUSED_MERGE=1,KVATTN_BENCH_MERGE_ROWS=1
NFE="KVATTN_BENCH_NO_FUSED_MERGE=1 KVATTN_BENCH_MERGE_ROWS=1"
# sanitizer cases: a row-merge decode (MQA, 1 unit x 64 partials of 32 rows) and an append by slot
CASE_RM="op=decode B=2 kv=40000 hq=32 hkv=1 dqk=128 dvo=128 qt=bf16 kvt=bf16 ot=bf16 ps=16 lse=1"
CASE_AP="op=append B=5 qo=20 kv=100 empty=20 hkv=2 dqk=64 dvo=64 kvt=f16 ps=3 layout=HND pool=1 bt=1 seed=1028"
if [[ " $STEPS " == *" tests "* ]]; then
    step "test_ops split" 200 "$T" --backend cuda --suite split
    step "test_ops decode" 240 "$T" --backend cuda --suite decode # (with the block-table cases, bt=1)
    step "test_ops split [no fused]" 200 env $NFE "$T" --backend cuda --suite split
    step "test_ops decode [no fused]" 240 env $NFE "$T" --backend cuda --suite decode
    step "test_ops decode [HG=1 no fused]" 240 env $NFE KVATTN_CUDA_DECODE_HG=1 "$T" --backend cuda --suite decode
    step "test_ops decode [merge rows 2]" 240 env KVATTN_BENCH_NO_FUSED_MERGE=1 KVATTN_BENCH_MERGE_ROWS=2 "$T" \
        --backend cuda --suite decode
    step "test_ops split [merge rows 2]" 200 env KVATTN_BENCH_NO_FUSED_MERGE=1 KVATTN_BENCH_MERGE_ROWS=2 "$T" \
        --backend cuda --suite split
    step "test_ops prefill [merge rows]" 300 env $NFE "$T" --backend cuda --suite prefill
    step "test_ops ragged [merge rows]" 200 env $NFE "$T" --backend cuda --suite ragged
    step "selftest --quick" 200 "$BUILD/kva_cuda_selftest" --quick
    step "python block tables (torch CUDA)" 200 env PYTHONPATH=python KVATTN_LIBRARY="$PWD/$BUILD/libkvattn.so" \
        python3 -m pytest -q python/tests/test_torch.py python/tests/test_batch_decode.py -k "block_tables"
    step "fuzz seed ${SEED:-4101} [no fused, PDL]" 300 env $NFE KVA_TEST_PDL=1 "$T" --backend cuda \
        --suite fuzz --seed "${SEED:-4101}" --count "${COUNT:-300}"
    step "fuzz seed ${SEED:-4102} [HG=1 no fused, PDL]" 300 env $NFE KVATTN_CUDA_DECODE_HG=1 KVA_TEST_PDL=1 "$T" \
        --backend cuda --suite fuzz --seed "${SEED:-4102}" --count "${COUNT:-300}"
fi
if [[ " $STEPS " == *" mini "* ]]; then # the least device time: the append kernel's slot form, the error suite, split
    step "test_ops append (with the slot form, bt=1)" 40 "$T" --backend cuda --suite append
    step "test_errors" 40 "$BUILD/tests/test_errors" --backend cuda
    step "test_mutate append (both forms)" 30 "$BUILD/tests/test_mutate" --backend cuda --suite append --seed 43 --count 300
    step "memcheck: $CASE_AP" 30 compute-sanitizer --tool memcheck --error-exitcode 99 --print-limit 20 "$T" --backend cuda --case "$CASE_AP"
    step "test_ops split" 60 "$T" --backend cuda --suite split
    step "memcheck: $CASE_RM" 60 compute-sanitizer --tool memcheck --error-exitcode 99 --print-limit 20 "$T" --backend cuda --case "$CASE_RM"
    step "test_mutate decode (with block tables)" 60 "$BUILD/tests/test_mutate" --backend cuda --suite decode --seed 44 --count 150
fi
if [[ " $STEPS " == *" quick "* ]]; then # the essentials in little device time: append by slot, the error suite, split,
    # the sanitizers on a row-merge decode (MQA 1 unit x 64 partials of 32 rows) and on an append by slot, decode
    step "test_ops append (with the slot form, bt=1)" 60 "$T" --backend cuda --suite append
    step "test_errors" 60 "$BUILD/tests/test_errors" --backend cuda
    step "test_ops split" 60 "$T" --backend cuda --suite split
    step "memcheck: $CASE_RM" 60 compute-sanitizer --tool memcheck --error-exitcode 99 --print-limit 20 "$T" --backend cuda --case "$CASE_RM"
    step "racecheck: $CASE_RM" 60 compute-sanitizer --tool racecheck --error-exitcode 99 --print-limit 20 "$T" --backend cuda --case "$CASE_RM"
    step "memcheck: $CASE_AP" 40 compute-sanitizer --tool memcheck --error-exitcode 99 --print-limit 20 "$T" --backend cuda --case "$CASE_AP"
    step "test_mutate append (both forms)" 40 "$BUILD/tests/test_mutate" --backend cuda --suite append --seed 43 --count 600
    step "test_mutate decode (with block tables)" 90 "$BUILD/tests/test_mutate" --backend cuda --suite decode --seed 44 --count 250
    step "test_mutate prefill (with block tables)" 90 "$BUILD/tests/test_mutate" --backend cuda --suite prefill --seed 45 --count 250
    step "test_ops decode" 120 "$T" --backend cuda --suite decode
    step "kvattn_serve --page-table block (CUDA)" 60 "$BUILD/apps/kvattn_serve" --backend cuda --requests 48 \
        --layers 2 --check-every 1 --progress-every 0 --page-table block
fi
if [[ " $STEPS " == *" dtests "* ]]; then # the default plans (row-slot plans of large merge tasks: the row merge)
    if [ "${DTESTS_SUITES:-1}" = 1 ]; then # DTESTS_SUITES=0: without split / decode (already run on these kernels)
        step "test_ops split" 200 "$T" --backend cuda --suite split
        step "test_ops decode" 240 "$T" --backend cuda --suite decode
    fi
    step "test_ops append (with the slot form, bt=1)" 120 "$T" --backend cuda --suite append
    step "test_errors" 200 "$BUILD/tests/test_errors" --backend cuda
    step "test_mutate append (both forms)" 120 "$BUILD/tests/test_mutate" --backend cuda --suite append --seed 43 \
        --count 1500
    step "python append by slot (torch CUDA)" 200 env PYTHONPATH=python KVATTN_LIBRARY="$PWD/$BUILD/libkvattn.so" \
        python3 -m pytest -q python/tests/test_torch.py -k "slot or append"
fi
if [[ " $STEPS " == *" rtests "* ]]; then # the planner's row-slot chunk rounding (33 -> 32 chunks per unit)
    CASE_R4="op=decode B=1 kv=32768 hq=48 hkv=4 dqk=128 dvo=128 qt=bf16 kvt=bf16 ot=bf16 ps=16 lse=1"
    step "test_ops split" 200 "$T" --backend cuda --suite split
    step "test_ops decode" 240 "$T" --backend cuda --suite decode
    step "test_ops: $CASE_R4" 30 "$T" --backend cuda --case "$CASE_R4"
    step "memcheck: $CASE_R4" 60 compute-sanitizer --tool memcheck --error-exitcode 99 --print-limit 20 "$T" --backend cuda --case "$CASE_R4"
fi
if [[ " $STEPS " == *" dsan "* ]]; then
    DCASES=("$CASE_RM"
        "op=decode B=1 kv=30000 hq=24 hkv=2 dqk=128 dvo=128 qt=f16 kvt=f16 ot=f16 ps=16 lse=1"
        "$CASE_AP")
    for tool in memcheck racecheck; do
        for cs in "${DCASES[@]}"; do
            step "$tool: $cs" 90 compute-sanitizer --tool $tool --error-exitcode 99 --print-limit 20 "$T" --backend cuda \
                --case "$cs"
        done
    done
fi
if [[ " $STEPS " == *" dtests "* ]]; then # (after the sanitizers)
    step "selftest --quick" 200 "$BUILD/kva_cuda_selftest" --quick
    step "fuzz seed ${SEED:-4103} [PDL]" 120 env KVA_TEST_PDL=1 "$T" --backend cuda --suite fuzz --seed "${SEED:-4103}" \
        --count "${COUNT:-150}"
fi
if [[ " $STEPS " == *" san "* ]]; then
    CASES=("op=decode B=2 kv=40000 hq=32 hkv=1 dqk=128 dvo=128 qt=bf16 kvt=bf16 ot=bf16 ps=16 lse=1"
        "op=decode B=3 kv=9000 hq=20 hkv=2 dqk=64 dvo=64 qt=f16 kvt=f16 ot=f16 ps=3 lse=1 empty=1"
        "op=decode B=4 kv=3000 hq=32 hkv=8 dqk=256 dvo=256 qt=bf16 kvt=bf16 ot=bf16 ps=16 lse=1"
        "op=prefill B=3 qo=64 kv=2000 hq=8 hkv=2 dqk=128 dvo=128 qt=bf16 kvt=bf16 ot=bf16 mask=causal ps=16 fsplit=256 lse=1")
    for tool in memcheck racecheck; do
        for cs in "${CASES[@]}"; do
            step "$tool [no fused]: $cs" 150 env $NFE compute-sanitizer --tool $tool --error-exitcode 99 --print-limit 20 \
                "$T" --backend cuda --case "$cs"
        done
        step "$tool [merge rows 2]: ${CASES[0]}" 150 env KVATTN_BENCH_NO_FUSED_MERGE=1 KVATTN_BENCH_MERGE_ROWS=2 \
            KVATTN_BENCH_RS_SPLIT=128 compute-sanitizer --tool $tool --error-exitcode 99 --print-limit 20 "$T" \
            --backend cuda --case "${CASES[0]}"
    done
fi
if [[ " $STEPS " == *" bench "* ]] && { [ -z "${STEP_DEADLINE:-}" ] || [ "$SECONDS" -lt "$STEP_DEADLINE" ]; }; then
    # (last: the tests and sanitizers come first)
    S="32/1:1x8192,32/1:1x32768,32/1:1x131072,32/1:4x32768,64/2:1x65536,128/8:1x32768,16/1:4x16384,16/1:1x32768"
    S="$S,32/8:1x32768,32/8:1x131072"
    export KVATTN_BENCH_SHAPES="${SHAPES:-$S}"
    NF2=KVATTN_BENCH_NO_FUSED_MERGE=1,KVATTN_BENCH_MERGE_ROWS=2
    DEF_ARMS="KVATTN_BENCH_NO_FUSED_MERGE=1 $NF $NF,KVATTN_BENCH_RS_SPLIT=64 $NF,KVATTN_BENCH_RS_SPLIT=128"
    ARMS=${ARMS:-"$DEF_ARMS $NF2,KVATTN_BENCH_RS_SPLIT=128"}
    i=0
    for arm in $ARMS; do
        i=$((i + 1))
        echo "== arm $i: B = $arm"
        csv=""; [ $i = 1 ] && csv="--csv $OUT/shapes.csv"
        timeout 300 "$BUILD/kva_bench_decode" --only XS --ab-env "$arm" --ab-only XS $csv > "$OUT/bench_$i.log" 2>&1 ||
            echo "kva_bench_decode rc=$?"
        grep "^A/B" "$OUT/bench_$i.log" | sed 's/(medians.*//'
    done
    # PEERS=0: the A/B arms only (no cuDNN / flash SDPA on the shapes)
    [ "${PEERS:-1}" = 1 ] &&
        { timeout 240 python3 bench/peers_decode.py --csv "$OUT/shapes.csv" --out "$OUT/shapes.md" > "$OUT/peers.log" 2>&1 ||
            { echo "peers_decode.py failed rc=$?"; tail -20 "$OUT/peers.log"; }; }
fi
echo "==== summary ===="
printf '%s\n' "${SUM[@]}"
[ -f "$OUT/shapes.md" ] && cat "$OUT/shapes.md"
pack_logs
