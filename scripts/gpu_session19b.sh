source scripts/gpu_env.sh s19b
export KVA_TEST_BACKEND=cuda
for s in decode long; do echo "$s: $(timeout 200 $BUILD/tests/test_ops --backend cuda --suite $s 2>&1 | grep -v '^ok' | tail -4)"; done
echo "decode HG: $(KVATTN_CUDA_DECODE_HG=1 timeout 100 $BUILD/tests/test_ops --backend cuda --suite decode 2>&1 | tail -3)"
S=scripts/gpu_seq_ab.sh
R='D3|128 x 2048|256 x 2048|64 x 4096|64 x 8192'
bash $S hg2 '' 'KVATTN_BENCH_HG_HEADS=2' 3 "$R" --no-bounds-check-ab 0 2>&1 | grep "^|\|^seq"
bash $S tc '' 'KVATTN_CUDA_DECODE_HG=0' 3 "$R" --no-bounds-check-ab 0 2>&1 | grep "^|\|^seq"
bash $S hg1h2 '' 'KVATTN_CUDA_DECODE_HG=1 KVATTN_BENCH_HG_HEADS=2' 3 '16 x 4096|16 x 1024' --no-bounds-check-ab 0 2>&1 | grep "^|\|^seq"
