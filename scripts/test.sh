#!/usr/bin/env bash
# Build kvattn into build/ and run every test: the C suite (CTest), then the Python tests when python/tests
# exists. Exits non-zero on any failure.
#
# Environment: KVA_CUDA=AUTO|ON|OFF (default AUTO: build the CUDA backend when the toolkit is found),
#              BUILD_DIR (default build), CMAKE_BUILD_TYPE (default Release), JOBS (default: CPU count),
#              CTEST_ARGS (extra ctest arguments, e.g. "-j2" or "-R planner").
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
# shellcheck disable=SC2086
(cd "$BUILD_DIR" && ctest --output-on-failure ${CTEST_ARGS:-}) || failed+=("ctest")

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
if [ "${#failed[@]}" -gt 0 ]; then
    echo "== FAILED: ${failed[*]}"
    exit 1
fi
echo "== all tests passed"
