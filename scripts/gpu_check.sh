#!/usr/bin/env bash
# gpu_check.sh - the GPU suite and the decode benchmark in one call, on the GPU machine.
#
# Run from the repository root with the build directory (compiled elsewhere with -DKVA_CUDA=ON) carried. build-cuda
# itself is larger than the 64 MB a `run` call carries; scripts/sync_build_dev.sh copies what this script runs
# into build-dev (about 20 MB), the default when present:
#     cmake --build build-cuda -j2 && SYNC_LEAN=1 bash scripts/sync_build_dev.sh     # here
#     bash scripts/gpu_check.sh            # on the GPU machine, carry ["build-dev"]; results under $OUT (or ./gpu_out)
# With no build carried (a fresh clone on a GPU machine) it configures and builds build-cuda first (step 0).
# Steps (each with its own time limit; the whole script stays under ~8 minutes):
#   1. device, driver, toolkit and torch versions
#   2. the test suite binaries with KVA_TEST_BACKEND=cuda, then kva_cuda_selftest (graph replay after re-plan,
#      fault injection, variants) and the NVRTC covering set
#   3. compute-sanitizer memcheck and racecheck on a small matrix
#   4. kva_bench_decode on WORKLOADS.md D1-D7, then bench/peers_decode.py (torch SDPA cuDNN/flash, FlashInfer)
#      -> $OUT/bench_decode.md, and bench/decode_interleaved.py (D1 batch >= 16 and D3 against cuDNN in one process,
#      dirty and clean L2; GPU_CHECK_INTERLEAVED=0 skips it) -> $OUT/decode_interleaved.md; the tables are printed last
# GPU_CHECK_TESTS=0 / GPU_CHECK_SANITIZE=0 / GPU_CHECK_BENCH=0 skip steps 2 / 3 / 4 (e.g. two calls, one for the
# tests and sanitizers and one for the benchmark, each well inside a call's time limit). Within step 2,
# GPU_CHECK_OPS=0 skips the test_ops suites and GPU_CHECK_REST=0 everything else (the whole of step 2 takes more than
# the 10 minutes of one call: run the two halves in two calls; on an H200 the test_ops half alone reached the long
# suite at ~9 minutes in session 36, so GPU_CHECK_SUITES="..." picks the plain-CUDA test_ops suites of one call, e.g.
# GPU_CHECK_SUITES=long in a call of its own; default: decode split merge append single prefill ragged fuzz edge long ref).
set -u
if [ -z "${BUILD:-}" ]; then
    if [ -x build-dev/kva_cuda_selftest ]; then BUILD=build-dev; else BUILD=build-cuda; fi
fi
OUT=${OUT:-$PWD/gpu_out}
mkdir -p "$OUT"
LOG="$OUT/gpu_check.log"
: > "$LOG"
exec > >(tee -a "$LOG") 2>&1
START=$(date +%s)
export PYTHONUNBUFFERED=1
export LD_LIBRARY_PATH="$PWD/$BUILD:$PWD/$BUILD/tests:${LD_LIBRARY_PATH:-}:/usr/local/cuda/lib64"
export KVATTN_CACHE_DIR="${KVATTN_CACHE_DIR:-/tmp/kvattn_cache_$$}"
SUMMARY=()
note() { SUMMARY+=("$1"); }
section() { echo; echo "==== $* ($(( $(date +%s) - START )) s) ===="; }
run_step() { # name timeout tail_lines(0 = all) cmd...
    local name=$1 limit=$2 keep=$3; shift 3
    local t0=$(date +%s) tmp="$OUT/.step_$$.txt"
    timeout --kill-after=10 "$limit" "$@" > "$tmp" 2>&1
    local rc=$?
    if [ "$keep" -gt 0 ]; then tail -n "$keep" "$tmp"; else cat "$tmp"; fi
    cat "$tmp" >> "$OUT/steps_full.log"
    rm -f "$tmp"
    local dt=$(( $(date +%s) - t0 ))
    if [ $rc -eq 0 ]; then note "PASS  $name (${dt}s)"; elif [ $rc -eq 124 ] || [ $rc -eq 137 ]; then note "TIME  $name (limit ${limit}s)"; else note "FAIL  $name (rc $rc, ${dt}s)"; fi
    return 0
}

section "1. device and versions"
nvidia-smi || true
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm,clocks.max.mem,driver_version --format=csv || true
(command -v nvcc >/dev/null && nvcc --version | tail -2) || echo "nvcc: not on PATH"
python3 -c "import torch; print('torch', torch.__version__, 'CUDA', torch.version.cuda, 'cuDNN', torch.backends.cudnn.version(), torch.cuda.get_device_name(0))" || true
python3 -c "import flashinfer; print('flashinfer', flashinfer.__version__)" 2>/dev/null || echo "flashinfer: not importable"
# KVA_COMMIT given by the caller wins (the device copy's git metadata can be stale)
if [ -n "${KVA_COMMIT:-}" ]; then echo "commit (given): $KVA_COMMIT"; export KVA_COMMIT
else git rev-parse --short HEAD 2>/dev/null && export KVA_COMMIT=$(git rev-parse --short HEAD 2>/dev/null); fi
if [ ! -x "$BUILD/kva_cuda_selftest" ]; then
    # nothing carried: build here (GPU_CHECK_BUILD=0 refuses instead). All cores; the prebuilt kernels for sm_80 and
    # sm_90a take most of it. A carried build saves the device time.
    if [ "${GPU_CHECK_BUILD:-1}" = 0 ]; then
        echo "no $BUILD/kva_cuda_selftest: build with cmake -S . -B $BUILD -DKVA_CUDA=ON and carry $BUILD"
        exit 2
    fi
    section "0. build ($BUILD, no build carried)"
    if ! { cmake -S . -B "$BUILD" -DKVA_CUDA=ON -DCMAKE_BUILD_TYPE=Release > "$OUT/build.log" 2>&1 &&
           cmake --build "$BUILD" -j "$(nproc)" >> "$OUT/build.log" 2>&1; }; then
        tail -40 "$OUT/build.log"
        echo "build failed (log: $OUT/build.log)"
        exit 2
    fi
    echo "built $BUILD in $(( $(date +%s) - START )) s"
fi
# NVRTC for variants outside the prebuilt set
if ! ldconfig -p 2>/dev/null | grep -q 'libnvrtc.so.1[23] '; then
    for p in /usr/local/cuda/lib64/libnvrtc.so.13 /usr/local/cuda/lib64/libnvrtc.so.12 \
             $(python3 -c "import nvidia.cuda_nvrtc, os; d=os.path.dirname(nvidia.cuda_nvrtc.__file__); print(d + '/lib/libnvrtc.so.13', d + '/lib/libnvrtc.so.12')" 2>/dev/null); do
        if [ -f "$p" ]; then export KVATTN_NVRTC_PATH="$p"; break; fi
    done
    echo "KVATTN_NVRTC_PATH=${KVATTN_NVRTC_PATH:-unset}"
fi

if [ "${GPU_CHECK_TESTS:-1}" = 1 ]; then
section "2a. test suite with KVA_TEST_BACKEND=cuda"
export KVA_TEST_BACKEND=cuda
if [ "${GPU_CHECK_OPS:-1}" = 1 ] && [ -x "$BUILD/tests/test_ops" ]; then
    for suite in ${GPU_CHECK_SUITES:-decode split merge append single prefill ragged fuzz edge long ref}; do
        echo "--- test_ops --suite $suite"
        limit=75
        [ "$suite" = fuzz ] && limit=420   # many distinct variants: NVRTC compiles the ones outside the AOT set (cold cache)
        [ "$suite" = long ] && limit=360   # requests of up to 64k tokens and device-only calls of 270 MB; the float64
                                           # reference runs on the host (about 4 minutes on an H200 machine)
        run_step "test_ops $suite [cuda]" $limit 25 "$BUILD/tests/test_ops" --backend cuda --suite "$suite"
    done
fi
if [ "${GPU_CHECK_OPS:-1}" = 1 ] && [ -x "$BUILD/tests/test_ops" ]; then
    # the head-group decode kernel wherever it is supported (the default takes it only for calls of >= 256 MB)
    for suite in decode split fuzz; do
        echo "--- test_ops --suite $suite, KVATTN_CUDA_DECODE_HG=1"
        run_step "test_ops $suite [cuda, head groups]" 200 10 env KVATTN_CUDA_DECODE_HG=1 "$BUILD/tests/test_ops" \
            --backend cuda --suite "$suite"
    done
fi
if [ "${GPU_CHECK_OPS:-1}" = 1 ] && [ -x "$BUILD/tests/test_ops" ]; then
    # every run with programmatic dependent launch (kva_run_args.enable_pdl): decode, prefill, ragged, variants
    for suite in fuzz split; do
        echo "--- test_ops --suite $suite, KVA_TEST_PDL=1"
        run_step "test_ops $suite [cuda, PDL]" 200 5 env KVA_TEST_PDL=1 "$BUILD/tests/test_ops" --backend cuda \
            --suite "$suite"
    done
fi
if [ "${GPU_CHECK_OPS:-1}" = 1 ] && [ -x "$BUILD/tests/test_ops" ]; then
    # the tensor-core decode kernel's cluster combine (opt-in: KVATTN_CUDA_CLUSTER=8; sm_90 only, a no-op elsewhere)
    for suite in decode split; do
        echo "--- test_ops --suite $suite, KVATTN_CUDA_CLUSTER=8"
        run_step "test_ops $suite [cuda, clusters]" 150 5 env KVATTN_CUDA_CLUSTER=8 "$BUILD/tests/test_ops" \
            --backend cuda --suite "$suite"
    done
    run_step "kva_cuda_selftest [clusters]" 120 5 env KVATTN_CUDA_CLUSTER=8 "$BUILD/kva_cuda_selftest"
fi
if [ "${GPU_CHECK_REST:-1}" = 1 ]; then
for t in test_errors test_mutate test_api test_formats test_variants; do
    if [ -x "$BUILD/tests/$t" ]; then
        echo "--- $t"
        # test_variants: 300 s. On a fresh machine it compiles about 59 user-variant kernels through NVRTC (65-72 s on
        # the H100 machine; 60 s timed out in sessions 13 and 15). Line-buffered output shows how far it got.
        limit=60
        extra=()
        # test_mutate: 2000 cases take ~10 s once the kernels are cached, but on a fresh machine its prefill, CUDA-core
        # and f32 cases compile kernels outside the prebuilt set through NVRTC (more than 160 s on an H200, session 39)
        [ $t = test_mutate ] && limit=400
        if [ $t = test_variants ]; then
            limit=300
            extra=(--verbose)
            # if it is still running after 60 s: every thread's state and kernel wait channel, into the log
            ( sleep 60; for pid in $(pgrep -f "$BUILD/tests/test_variants"); do
                  echo "test_variants still running after 60 s (pid $pid):"
                  for tk in /proc/$pid/task/*; do
                      echo "  task ${tk##*/}: state $(awk '{print $3}' $tk/stat 2>/dev/null) wchan $(cat $tk/wchan 2>/dev/null) $(cat $tk/comm 2>/dev/null)"
                  done
              done ) &
        fi
        run_step "$t [cuda]" $limit 25 stdbuf -oL "$BUILD/tests/$t" --backend cuda "${extra[@]}"
    fi
done
unset KVA_TEST_BACKEND
if [ -d python/tests ] && [ -f "$BUILD/libkvattn.so" ]; then
    echo "--- python tests (torch on the GPU, NumPy on the CPU backend)"
    run_step "python tests [cuda+cpu]" 240 15 env PYTHONPATH="$PWD/python" KVATTN_LIBRARY="$PWD/$BUILD/libkvattn.so" \
        python3 -m pytest -q -x python/tests
fi

section "2b. CUDA selftest (decode matrix, prefill, graph replay after re-plan, faults, append, merges)"
run_step "kva_cuda_selftest" 120 0 "$BUILD/kva_cuda_selftest" --verbose
NGPU=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU ' || true)
if [ "${NGPU:-0}" -ge 2 ]; then
    # a context and buffers on device 1, the decode matrix's calls made with device 0 current (python/tests ran
    # test_second_device_while_current_is_first above)
    run_step "kva_cuda_selftest --device 1 [caller on device 0]" 120 5 "$BUILD/kva_cuda_selftest" --device 1
fi

section "2c. NVRTC: covering set of kernel variants (sm_80, sm_90a), spill check"
if [ -x "$BUILD/kva_cuda_jit_test" ]; then run_step "kva_cuda_jit_test" 120 20 "$BUILD/kva_cuda_jit_test"; fi
if [ -x "$BUILD/kva_cuda_variant_jit_test" ]; then run_step "kva_cuda_variant_jit_test" 120 20 "$BUILD/kva_cuda_variant_jit_test"; fi
fi # GPU_CHECK_REST
fi

section "3. compute-sanitizer"
if [ "${GPU_CHECK_SANITIZE:-1}" != 1 ]; then
    note "SKIP  compute-sanitizer (GPU_CHECK_SANITIZE=0)"
elif [ $(( $(date +%s) - START )) -gt 300 ]; then
    note "SKIP  compute-sanitizer (time budget: keep the benchmark inside the call)"
elif command -v compute-sanitizer >/dev/null; then
    run_step "memcheck selftest --quick" 150 30 compute-sanitizer --tool memcheck --error-exitcode 99 --print-limit 20 \
        "$BUILD/kva_cuda_selftest" --quick
    run_step "racecheck selftest --quick" 150 30 compute-sanitizer --tool racecheck --racecheck-report hazard \
        --error-exitcode 99 --print-limit 20 "$BUILD/kva_cuda_selftest" --quick
    run_step "memcheck selftest --quick [clusters]" 150 10 env KVATTN_CUDA_CLUSTER=8 compute-sanitizer --tool memcheck \
        --error-exitcode 99 --print-limit 20 "$BUILD/kva_cuda_selftest" --quick
    if [ -x "$BUILD/tests/test_variants" ]; then
        run_step "memcheck test_variants ops" 200 10 compute-sanitizer --tool memcheck --error-exitcode 99 \
            --print-limit 20 "$BUILD/tests/test_variants" --backend cuda --suite ops
        run_step "racecheck test_variants ops" 300 10 compute-sanitizer --tool racecheck --racecheck-report hazard \
            --error-exitcode 99 --print-limit 20 "$BUILD/tests/test_variants" --backend cuda --suite ops
    fi
    if [ -x "$BUILD/tests/test_ops" ]; then
        run_step "memcheck test_ops (20 cases)" 120 20 compute-sanitizer --tool memcheck \
            --error-exitcode 99 --print-limit 20 "$BUILD/tests/test_ops" --backend cuda --count 20
        # the head-group kernel's cp.async producers (pages of 1 and 3 tokens) and its TMA one (page 16); row slots
        # (groups of 12 to 32 over one KV head)
        for c in "op=decode B=3 kv=300 hq=32 hkv=8 dqk=128 dvo=128 qt=bf16 kvt=bf16 ot=bf16 ps=1" \
                 "op=decode B=4 kv=200 hq=16 hkv=4 dqk=64 dvo=64 qt=f16 kvt=f16 ot=f32 ps=3 layout=HND empty=25" \
                 "op=decode B=2 kv=500 hq=40 hkv=8 dqk=128 dvo=128 qt=bf16 kvt=e4m3 ot=bf16 ps=16" \
                 "op=decode B=3 kv=300 hq=32 hkv=1 dqk=128 dvo=128 qt=bf16 kvt=bf16 ot=bf16 ps=16" \
                 "op=decode B=2 kv=200 hq=24 hkv=2 dqk=64 dvo=64 qt=f16 kvt=f16 ot=f16 ps=3 layout=HND empty=25" \
                 "op=decode B=2 kv=400 hq=20 hkv=1 dqk=128 dvo=128 qt=bf16 kvt=e5m2 ot=f32 ps=16"; do
            for tool in memcheck racecheck; do
                extra=(); [ $tool = racecheck ] && extra=(--racecheck-report hazard)
                run_step "$tool test_ops [head groups] ${c#op=decode }" 90 3 env KVATTN_CUDA_DECODE_HG=1 \
                    compute-sanitizer --tool $tool "${extra[@]}" --error-exitcode 99 --print-limit 20 \
                    "$BUILD/tests/test_ops" --backend cuda --case "$c"
            done
        done
    fi
else
    note "SKIP  compute-sanitizer (not on PATH)"
fi

if [ "${GPU_CHECK_BENCH:-1}" = 1 ]; then
section "4. decode benchmark (D1-D7) and peers"
run_step "kva_bench_decode" 200 0 "$BUILD/kva_bench_decode" --csv "$OUT/kvattn_decode.csv"
fi
if [ "${GPU_CHECK_BENCH:-1}" = 1 ] && [ -s "$OUT/kvattn_decode.csv" ]; then
    run_step "peers_decode.py" 200 5 python3 bench/peers_decode.py --csv "$OUT/kvattn_decode.csv" \
        --out "$OUT/bench_decode.md"
fi
if [ "${GPU_CHECK_BENCH:-1}" = 1 ] && [ "${GPU_CHECK_INTERLEAVED:-1}" = 1 ] && [ -x "$BUILD/libkvattn.so" ]; then
    # the D1 batch >= 16 rows and D3 with kvattn and cuDNN in one process (alternating rounds, the same flush), under
    # the dirty (memset) and the clean (read) L2 flush and with rotated input copies: the table's separate processes
    # drift by about 1 %
    run_step "decode_interleaved.py" 300 0 env PYTHONPATH=python KVATTN_LIBRARY="$BUILD/libkvattn.so" python3 \
        bench/decode_interleaved.py --shapes 16x1024,16x4096,64x1024,64x4096,64x8192,128x2048,256x2048,64x8192/4 \
        --flush memset,read,rotate --rounds 5 --out "$OUT/decode_interleaved.md"
fi

if [ -x "$BUILD/bench/bench_plan" ]; then
    section "5. plan() host time (H1) on this host"
    run_step "bench_plan cuda" 120 0 "$BUILD/bench/bench_plan" --backend cuda --ops decode,append --min-time 0.1
    run_step "bench_plan cpu W=132,264 no indices" 120 0 "$BUILD/bench/bench_plan" --threads 132,264 --ops decode --no-indices --min-time 0.1
fi

section "summary"
for s in "${SUMMARY[@]}"; do echo "$s"; done
echo "total $(( $(date +%s) - START )) s; log: $LOG"
if [ -s "$OUT/decode_interleaved.md" ]; then
    echo
    cat "$OUT/decode_interleaved.md"
fi
if [ -s "$OUT/bench_decode.md" ]; then
    echo
    cat "$OUT/bench_decode.md"
fi
