#!/usr/bin/env bash
# gpu_fp8_probe.sh - where fp8-KV decode (D6) loses bandwidth: the same plan read as NHD and HND (interleaved),
# sequential arms with one CTA per SM (4 and 8 warps), and the 16-bit tensor-core kernel's rate at the same shapes
# (head groups off) for comparison.
set -u
source "$(dirname "$0")/gpu_env.sh" fp8probe
B=$BUILD/kva_bench_decode
echo "== D6 and D1 64 x 4k, NHD vs HND (same plan, interleaved)"
$B --only 'D6|D1 GQA 32/8' --ab-only 'D6|64 x 4096' --ab-layout 2>&1 | grep -v "^$" | tail -40
echo "== D1 64 x 4k / 16 x 4k: head groups off (tensor-core kernel) vs default, interleaved"
$B --only '64 x 4096|16 x 4096' --ab-env KVATTN_CUDA_DECODE_HG=0 2>&1 | grep -v "^$" | tail -30
echo "== D6 sequential arms"
bash "$(dirname "$0")/gpu_seq_ab.sh" w8 '' 'KVATTN_CUDA_CTAS_PER_SM=1 KVATTN_CUDA_TC_WARPS=8' 3 'D6'
bash "$(dirname "$0")/gpu_seq_ab.sh" w4one '' 'KVATTN_CUDA_CTAS_PER_SM=1' 2 'D6'
