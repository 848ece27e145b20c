# gpu_env.sh - sourced by the scripts/gpu_*.sh runners on the GPU machine: BUILD (default build-dev) and OUT (default
# ./gpu_out, created), the library path, the NVRTC library when the loader does not find it, and the kernel cache
# directory /tmp/kvattn_cache_$1.
BUILD=${BUILD:-build-dev}
OUT=${OUT:-$PWD/gpu_out}
mkdir -p "$OUT"
export LD_LIBRARY_PATH="$PWD/$BUILD:${LD_LIBRARY_PATH:-}:/usr/local/cuda/lib64"
export KVATTN_CACHE_DIR=/tmp/kvattn_cache_$1
export PYTHONUNBUFFERED=1
p=$(ls /usr/local/cuda/lib64/libnvrtc.so.1[23] 2>/dev/null | head -1); [ -n "$p" ] && export KVATTN_NVRTC_PATH=$p
