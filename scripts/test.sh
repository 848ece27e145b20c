#!/usr/bin/env bash
# Build kvattn into build/ and run every test: the C suite (CTest), then the Python tests when python/tests
# exists, then the quick C suites again under ASan + UBSan (CPU backend, build-asan/). Exits non-zero on any failure.
#
# Environment: KVA_CUDA=AUTO|ON|OFF (default AUTO: build the CUDA backend when the toolkit is found),
#              BUILD_DIR (default build), CMAKE_BUILD_TYPE (default Release), JOBS (default: CPU count),
#              CTEST_ARGS (extra ctest arguments, e.g. "-j2" or "-R planner"), KVA_SANITIZE=0 (skip the
#              sanitizer stage).
set -euo pipefail
cd "$(dirname "$0")/.."

BUILD_DIR=${BUILD_DIR:-build}
KVA_CUDA=${KVA_CUDA:-AUTO}
JOBS=${JOBS:-$(nproc 2>/dev/null || echo 2)}

echo "== configure ($BUILD_DIR, KVA_CUDA=$KVA_CUDA)"
cmake -S . -B "$BUILD_DIR" -DKVA_CUDA="$KVA_CUDA" -DCMAKE_BUILD_TYPE="${CMAKE_BUILD_TYPE:-Release}"
echo "== build"
cmake --build "$BUILD_DIR" -j "$JOBS"

echo "== ctest"
failed=()
# cuda_nvrtc_variants (the covering set) runs the same checks as cuda_nvrtc_all_variants over a subset of its kernel
# variants: when both are registered, the default run skips the subset (~6 min of NVRTC on 2 cores). CTEST_ARGS
# replaces this default.
default_args=""
if [ -f "$BUILD_DIR/CTestTestfile.cmake" ] && (cd "$BUILD_DIR" && ctest -N -R '^cuda_nvrtc_all_variants$' 2>/dev/null |
        grep -q 'Total Tests: 1'); then
    default_args="-E ^cuda_nvrtc_variants\$"
fi
# shellcheck disable=SC2086
(cd "$BUILD_DIR" && ctest --output-on-failure ${CTEST_ARGS:-$default_args}) || failed+=("ctest")

if [ -d python/tests ]; then
    echo "== python tests"
    if ! python3 -c 'import numpy, pytest' 2>/dev/null; then
        echo "installing numpy and pytest with pip"
        python3 -m pip install --quiet numpy pytest ||
            python3 -m pip install --quiet --break-system-packages numpy pytest
    fi
    # The package is used from the source tree against the library just built.
    export PYTHONPATH="$PWD/python${PYTHONPATH:+:$PYTHONPATH}"
    export KVATTN_LIBRARY="$PWD/$BUILD_DIR/libkvattn.so"
    rc=0
    python3 -m pytest -q python/tests || rc=$?
    if [ "$rc" -eq 5 ]; then
        echo "python/tests: no tests collected"
    elif [ "$rc" -ne 0 ]; then
        failed+=("python tests")
    fi
fi
# AddressSanitizer + UndefinedBehaviorSanitizer build of the CPU backend (and the core it shares with CUDA), leak
# checks on: the C tests but the long suites (fuzz, long, generic kernels: those ran above, unsanitized).
# KVA_SANITIZE=0 skips it; it is skipped with a note where the compiler cannot link a sanitized program.
if [ "${KVA_SANITIZE:-1}" != "0" ]; then
    SAN_DIR="${BUILD_DIR}-asan"
    SAN_FLAGS="-fsanitize=address,undefined -fno-omit-frame-pointer -fno-sanitize-recover=undefined"
    if echo 'int main(void){return 0;}' | ${CC:-cc} $SAN_FLAGS -x c - -o /tmp/kva_san_probe_$$ 2>/dev/null; then
        rm -f /tmp/kva_san_probe_$$
        echo "== sanitizers (ASan + UBSan, CPU backend, $SAN_DIR)"
        mkdir -p "$SAN_DIR"
        if cmake -S . -B "$SAN_DIR" -DKVA_CUDA=OFF -DCMAKE_BUILD_TYPE=Debug -DCMAKE_C_FLAGS="$SAN_FLAGS" \
                -DCMAKE_EXE_LINKER_FLAGS="-fsanitize=address,undefined" \
                -DCMAKE_SHARED_LINKER_FLAGS="-fsanitize=address,undefined" > "$SAN_DIR/configure.log" 2>&1 &&
            cmake --build "$SAN_DIR" -j "$JOBS" > "$SAN_DIR/build.log" 2>&1; then
            (cd "$SAN_DIR" && ASAN_OPTIONS=detect_leaks=1:halt_on_error=1 UBSAN_OPTIONS=print_stacktrace=1 \
                ctest --output-on-failure -j "$JOBS" \
                    -E '^(ops_fuzz|ops_long|ops_cpu_generic_kernels|formats_fuzz|header_c11|header_cxx11|exports|install_consumer)$') ||
                failed+=("sanitizers")
        else
            echo "sanitizer build failed: see $SAN_DIR/configure.log and $SAN_DIR/build.log"
            tail -20 "$SAN_DIR/build.log" 2>/dev/null || true
            failed+=("sanitizer build")
        fi
    else
        echo "== sanitizers: skipped (${CC:-cc} cannot link -fsanitize=address,undefined)"
    fi
fi
if [ "${#failed[@]}" -gt 0 ]; then
    echo "== FAILED: ${failed[*]}"
    exit 1
fi
echo "== all tests passed"
