#!/usr/bin/env bash
# gpu_formats.sh - the composable formats on the GPU machine in one call: test_formats on the CUDA backend (BSR,
# variable BSR, cascade, fuzz), compute-sanitizer memcheck / racecheck on a few small cases, the C1/C2 benchmark
# (kva_bench_formats) and, when torch is importable, the C2 peers (bench/peers_formats.py) and the torch tests of
# the block-sparse wrappers. Environment: BUILD (default build-dev), OUT (default ./gpu_out), FORMATS_TESTS=0,
# FORMATS_SANITIZE=0, FORMATS_BENCH=0, FORMATS_PEERS=0 to skip parts; FORMATS_BENCH_ARGS (e.g. "--quick").
set -u
. "$(dirname "$0")/gpu_env.sh" fmt
commit=$(git rev-parse --short HEAD 2>/dev/null)
summary=()
if [ "${FORMATS_TESTS:-1}" != 0 ]; then
    echo "== test_formats (cuda)"
    for suite in bsr vbsr cascade fuzz; do
        timeout 300 "$BUILD/tests/test_formats" --backend cuda --suite "$suite" > "$OUT/test_formats_$suite.log" 2>&1
        rc=$?
        tail -3 "$OUT/test_formats_$suite.log"
        summary+=("test_formats $suite (cuda): rc=$rc $(tail -1 "$OUT/test_formats_$suite.log")")
    done
fi
if [ "${FORMATS_SANITIZE:-1}" != 0 ]; then
    cases=("bsr M=40 N=64 R=16 C=16 density=50 causal=1 emask=1 hq=8 hkv=2 dqk=128 dvo=128 q=bf16 kv=bf16 o=bf16 seed=5"
           "vbsr M=40 N=90 mb=4 nb=6 density=60 causal=1 hq=8 hkv=2 dqk=128 dvo=128 q=f16 kv=f16 o=f16 seed=6"
           "cascade levels=3 batch=6 append=1 ps=16 maxkv=60 maxqo=5 causal=1 lse=1 hq=8 hkv=2 dqk=128 dvo=128 q=f16 kv=f16 o=f16 seed=7")
    for tool in memcheck racecheck; do
        for c in "${cases[@]}"; do
            echo "== $tool: $c"
            extra=""; [ $tool = racecheck ] && extra="--racecheck-report hazard"
            timeout 200 compute-sanitizer --tool $tool $extra --error-exitcode 99 --print-limit 10 \
                "$BUILD/tests/test_formats" --backend cuda --case "$c" > "$OUT/san_$tool.log" 2>&1
            rc=$?
            tail -3 "$OUT/san_$tool.log"
            summary+=("$tool ${c%% *}: rc=$rc $(grep -E 'ERROR SUMMARY|RACECHECK SUMMARY' "$OUT/san_$tool.log" | tail -1)")
        done
    done
fi
if [ "${FORMATS_BENCH:-1}" != 0 ]; then
    echo "== kva_bench_formats"
    timeout 400 "$BUILD/kva_bench_formats" ${FORMATS_BENCH_ARGS:-} --csv "$OUT/formats.csv" 2>&1 | tee "$OUT/bench_formats.log"
    summary+=("kva_bench_formats: rc=${PIPESTATUS[0]}")
fi
if [ "${FORMATS_PYTEST:-1}" != 0 ] && python3 -c 'import torch, pytest' 2>/dev/null; then
    echo "== python tests of the block-sparse wrappers (torch CUDA + NumPy)"
    PYTHONPATH=$PWD/python KVATTN_LIBRARY=$PWD/$BUILD/libkvattn.so timeout 300 python3 -m pytest -q \
        python/tests/test_sparse_torch.py python/tests/test_sparse_variable.py python/tests/test_sparse.py \
        > "$OUT/pytest_sparse.log" 2>&1
    rc=$?
    tail -15 "$OUT/pytest_sparse.log"
    summary+=("pytest sparse (torch cuda): rc=$rc $(tail -1 "$OUT/pytest_sparse.log")")
fi
if [ "${FORMATS_PEERS:-1}" != 0 ] && [ -f bench/peers_formats.py ] && python3 -c 'import torch' 2>/dev/null; then
    echo "== peers_formats.py"
    KVATTN_LIBRARY=$PWD/$BUILD/libkvattn.so PYTHONPATH=$PWD/python timeout 480 python3 bench/peers_formats.py \
        ${FORMATS_PEERS_ARGS:-} --out "$OUT/peers_formats.md" --csv "$OUT/peers_formats.csv" 2>&1 | tail -60
    summary+=("peers_formats.py: rc=${PIPESTATUS[0]}")
fi
echo "== summary (commit $commit, $(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -1))"
printf '%s\n' "${summary[@]}"
