#!/usr/bin/env bash
# sync_build_dev.sh - copy what the GPU machine runs (library, benchmark, selftest, test binaries, the sm_90a
# fatbin for SASS dumps) from build-cuda into build-dev, small enough to carry with the `run` tool.
set -e
cd "$(dirname "$0")/.."
rm -rf build-dev
mkdir -p build-dev/tests build-dev/kva_cuda_gen
cp -a build-cuda/libkvattn.so* build-cuda/kva_bench_decode build-cuda/kva_cuda_selftest build-cuda/kva_cuda_jit_test build-dev/
cp -a build-cuda/tests/test_ops build-cuda/tests/test_errors build-cuda/tests/test_mutate build-cuda/tests/test_api build-cuda/tests/test_formats build-dev/tests/
[ -x build-cuda/tests/test_variants ] && cp -a build-cuda/tests/test_variants build-dev/tests/ || true
mkdir -p build-dev/bench build-dev/apps
cp -a build-cuda/bench/bench_plan build-dev/bench/ 2>/dev/null || true
cp -a build-cuda/bench/bench_jit build-dev/bench/ 2>/dev/null || true
cp -a build-cuda/apps/kvattn_serve build-dev/apps/ 2>/dev/null || true
for f in kva_bench_prefill bench_prefill kva_cuda_prefill_jit_test kva_bench_formats kva_cuda_variant_jit_test; do
    [ -x build-cuda/$f ] && cp -a build-cuda/$f build-dev/ || true
done
cp build-cuda/kva_cuda_gen/kva_aot_sm90a.fatbin build-dev/kva_cuda_gen/
[ -x build-cuda/tools/hbm_read ] && mkdir -p build-dev/tools && cp -a build-cuda/tools/hbm_read build-dev/tools/ || true
[ -x build-cuda/tools/cluster_probe ] && mkdir -p build-dev/tools && cp -a build-cuda/tools/cluster_probe build-dev/tools/ || true
[ -x build-cuda/tools/gpc_probe ] && mkdir -p build-dev/tools && cp -a build-cuda/tools/gpc_probe build-dev/tools/ || true
[ -x build-cuda/tools/hg_decode ] && mkdir -p build-dev/tools && cp -a build-cuda/tools/hg_decode build-dev/tools/ || true
# SYNC_LEAN=1: only what gpu_check.sh and gpu_probe.sh run (the carry limit is 64 MB with the source tree; the full
# copy passed 60 MB once the 8-warp decode kernels joined the prebuilt set)
if [ "${SYNC_LEAN:-0}" = 1 ]; then
    rm -f build-dev/kva_cuda_prefill_jit_test build-dev/kva_bench_formats build-dev/kva_bench_prefill \
        build-dev/bench_prefill build-dev/bench/bench_jit
fi
du -sh build-dev
