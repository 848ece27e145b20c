#!/usr/bin/env bash
# Set up, build and run kvattn's main job (build/apps/kvattn_serve) with its default options.
# Extra arguments are passed to kvattn_serve (see ./build/apps/kvattn_serve --help).
#
# Installs the build tools with apt-get when they are missing (cmake, gcc, make), configures build/
# (KVA_CUDA=AUTO|ON|OFF, default AUTO), builds the library and the app, and runs it.
set -euo pipefail
cd "$(dirname "$0")/.."

missing=()
command -v cmake >/dev/null 2>&1 || missing+=(cmake)
{ command -v cc >/dev/null 2>&1 || command -v gcc >/dev/null 2>&1; } || missing+=(gcc libc6-dev)
command -v make >/dev/null 2>&1 || missing+=(make)
if [ "${#missing[@]}" -gt 0 ]; then
    echo "installing build tools: ${missing[*]}" >&2
    SUDO=""
    if [ "$(id -u)" -ne 0 ]; then SUDO="sudo"; fi
    $SUDO env DEBIAN_FRONTEND=noninteractive apt-get update -qq >&2
    $SUDO env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${missing[@]}" >&2
fi

BUILD_DIR=${BUILD_DIR:-build}
JOBS=${JOBS:-$(nproc 2>/dev/null || echo 2)}
# Build output goes to stderr: stdout carries only the app's result table.
cmake -S . -B "$BUILD_DIR" -DKVA_CUDA="${KVA_CUDA:-AUTO}" -DCMAKE_BUILD_TYPE="${CMAKE_BUILD_TYPE:-Release}" >&2
cmake --build "$BUILD_DIR" -j "$JOBS" --target kvattn_serve >&2
exec "./$BUILD_DIR/apps/kvattn_serve" "$@"
