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
# step NAME LIMIT CMD...: run CMD under a time limit (cut to end by STEP_DEADLINE where set) into $OUT/<prefix>_NAME.log ($STEP_PREFIX, default "step"), print
# its pass line (or its failures) and add "rc N  NAME (Ts)" to the SUM array, which the caller prints last
SUM=()
step() {
    local name=$1 limit=$2; shift 2
    # STEP_DEADLINE=S: no step starts after S seconds of the script (its logs still get packed and returned)
    if [ -n "${STEP_DEADLINE:-}" ] && [ "$SECONDS" -ge "$STEP_DEADLINE" ]; then
        echo "== $name: skipped (past STEP_DEADLINE=$STEP_DEADLINE s)"; SUM+=("skip  $name"); return
    fi
    [ -n "${STEP_DEADLINE:-}" ] && [ $((SECONDS + limit)) -gt "$STEP_DEADLINE" ] && limit=$((STEP_DEADLINE - SECONDS + 5))
    local t0=$(date +%s) log="$OUT/${STEP_PREFIX:-step}_$(echo "$name" | tr -c 'A-Za-z0-9_' '_').log"
    timeout --kill-after=10 "$limit" "$@" > "$log" 2>&1
    local rc=$? dt=$(( $(date +%s) - t0 ))
    echo "== $name (rc $rc, ${dt}s): $(grep -E "passed|ERROR SUMMARY" "$log" | tail -1)"
    [ $rc -ne 0 ] && grep -m 12 -E "FAIL|replay|=========" "$log"
    SUM+=("rc $rc  $name (${dt}s)")
}
