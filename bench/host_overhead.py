#!/usr/bin/env python3
"""host_overhead.py - host time per call of kvattn's Python wrappers (torch CUDA tensors, tiny shapes, so the GPU
never holds the host back), beside torch SDPA as a yardstick. Eager mode; under CUDA graphs none of it is paid.

    PYTHONPATH=python KVATTN_LIBRARY=build-dev/libkvattn.so python3 bench/host_overhead.py [--calls 2000] [--profile]
"""
import argparse
import time

import torch

import kvattn


def per_call(fn, calls):
    for _ in range(50):
        fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) / calls * 1e6


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--calls", type=int, default=2000)
    ap.add_argument("--profile", action="store_true", help="also print cProfile's top functions of the decode run")
    args = ap.parse_args()
    dev = torch.device("cuda")
    H, D, L = 4, 128, 16
    ws = torch.empty(128 << 20, dtype=torch.uint8, device=dev)
    indptr = torch.tensor([0, L], dtype=torch.int32)
    q = torch.randn(L, H, D, device=dev, dtype=torch.bfloat16)
    k, v = q.clone(), q.clone()
    rag = kvattn.BatchPrefillWithRaggedKVCacheWrapper(ws, "NHD")
    rag.plan(indptr, indptr, H, H, D, causal=True, q_data_type=torch.bfloat16)
    out = torch.empty_like(q)
    # paged decode, batch 1, 16 tokens, page size 16
    kc = torch.randn(4, 2, 16, H, D, device=dev, dtype=torch.bfloat16)
    dec = kvattn.BatchDecodeWithPagedKVCacheWrapper(torch.empty(128 << 20, dtype=torch.uint8, device=dev), "NHD")
    dec.plan(torch.tensor([0, 1], dtype=torch.int32), torch.tensor([0], dtype=torch.int32),
             torch.tensor([16], dtype=torch.int32), H, H, D, 16, q_data_type=torch.bfloat16)
    qd = torch.randn(1, H, D, device=dev, dtype=torch.bfloat16)
    q4 = q.transpose(0, 1).unsqueeze(0).contiguous()
    # a decode step's per-layer calls besides run: one appended token for each of 16 requests, and a merge of two
    # attention states (cascade / SGLang-style prefix + extend)
    B = 16
    pool = torch.randn(2 * B, 2, 16, H, D, device=dev, dtype=torch.bfloat16)
    ap_k = torch.randn(B, H, D, device=dev, dtype=torch.bfloat16)
    ap_v = torch.randn(B, H, D, device=dev, dtype=torch.bfloat16)
    ap_bi = torch.arange(B, dtype=torch.int32, device=dev)
    ap_pos = torch.full((B,), 20, dtype=torch.int32, device=dev)
    ap_idx = torch.arange(2 * B, dtype=torch.int32, device=dev)
    ap_indptr = torch.arange(0, 2 * B + 1, 2, dtype=torch.int32, device=dev)
    ap_last = torch.full((B,), 5, dtype=torch.int32, device=dev)
    m_v = torch.randn(L, H, D, device=dev, dtype=torch.bfloat16)
    m_s = torch.randn(L, H, device=dev, dtype=torch.float32)
    m_v2, m_s2 = m_v.clone(), m_s.clone()
    rows = [
        ("kvattn append_paged_kv_cache (16 tokens)", lambda: kvattn.append_paged_kv_cache(
            ap_k, ap_v, ap_bi, ap_pos, pool, ap_idx, ap_indptr, ap_last)),
        ("kvattn merge_state", lambda: kvattn.merge_state(m_v, m_s, m_v2, m_s2)),
        ("kvattn merge_state_in_place", lambda: kvattn.merge_state_in_place(m_v, m_s, m_v2, m_s2)),
        ("kvattn ragged prefill run (new out)", lambda: rag.run(q, k, v)),
        ("kvattn ragged prefill run (out=)", lambda: rag.run(q, k, v, out=out)),
        ("kvattn paged decode run", lambda: dec.run(qd, kc)),
        ("torch SDPA (yardstick)", lambda: torch.nn.functional.scaled_dot_product_attention(q4, q4, q4, is_causal=True)),
    ]
    # the C call alone: the arguments of one decode run captured, then kva_run called with them directly
    from kvattn import _ffi
    lib = _ffi.lib()
    real = lib.kva_run
    seen = []

    def spy(*a):
        seen.append(a)
        return real(*a)

    lib.kva_run = spy
    try:
        dec.run(qd, kc)
    finally:
        lib.kva_run = real
    if seen:
        captured = seen[0]
        rows.append(("C kva_run alone (decode, ctypes call)", lambda: real(*captured)))
    print("host time per call, eager, %d calls (%s)" % (args.calls, torch.cuda.get_device_name(0)))
    for name, fn in rows:
        print("%-40s %8.1f us" % (name, per_call(fn, args.calls)))
    if args.profile:
        import cProfile
        import pstats
        for name, fn in rows[:6]:
            print("\n--- cProfile: %s, %d calls" % (name, args.calls))
            prof = cProfile.Profile()
            prof.enable()
            for _ in range(args.calls):
                fn()
            prof.disable()
            torch.cuda.synchronize()
            pstats.Stats(prof).sort_stats("tottime").print_stats(22)


if __name__ == "__main__":
    main()
