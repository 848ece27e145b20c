#!/usr/bin/env python3
"""v1_interleaved.py - WORKLOADS V1 (batch 16, 16 heads, D 128, bf16; causal, causal + soft cap 30, causal + ALiBi,
sliding window 1024; seq 2k and 8k) with kvattn and its peers timed in alternating rounds inside one process.

Why: a GPU under sustained tensor-core load heats up and lowers its clocks, and the separate benchmark programs
(kva_bench_prefill first, peers_prefill.py after it) measure each side at a different point of that drift; calls of
this project have seen the same kernel vary by ~5 % between processes. Here every round times kvattn, then
FlexAttention (and cuDNN SDPA on the plain causal rows) back to back on the same shapes, and the medians are taken
over all rounds, so drift hits every side alike.

kvattn runs through its Python API (BatchPrefillWithRaggedKVCacheWrapper, NHD ragged K/V, plan once, run timed);
FlexAttention as in peers_prefill.py (torch.compile'd flex_attention with a block mask; soft cap and ALiBi as
score_mod, the standard ALiBi slopes, which are kvattn's defaults). Cold L2 (a 512 MB buffer is overwritten before
every timed call), CUDA events. TFLOP/s use kva_bench_prefill's FLOP count (causal L^2 / 2 per head, exact pairs for
the window).

    PYTHONPATH=python KVATTN_LIBRARY=build-dev/libkvattn.so python3 bench/v1_interleaved.py [--rounds 5] [--iters 10]
        [--seq 2048,8192] [--out FILE.md] [--sleep-cycles N] [--alternate rounds|calls]
"""
import argparse
import datetime
import math
import os
import statistics

import torch

import kvattn

B, H, D = 16, 16, 128
WINDOW = 1024


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--seq", default="2048,8192")
    ap.add_argument("--only", default="", help="'|'-separated substrings of the case names")
    ap.add_argument("--out", default=None)
    ap.add_argument("--sleep-cycles", type=int, default=1 << 21,
                    help="GPU sleep before each timed call (0: none, the GPU stays under load)")
    ap.add_argument("--alternate", choices=("rounds", "calls"), default="rounds",
                    help="rounds: --iters calls of one side, then the other; calls: the sides alternate call by call")
    args = ap.parse_args()

    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    flex = torch.compile(flex_attention, dynamic=False)
    dev = torch.device("cuda")
    flush = torch.empty(512 << 20, dtype=torch.uint8, device=dev)
    ws = torch.empty(512 << 20, dtype=torch.uint8, device=dev)

    def time_cold(fn, iters):
        s = torch.cuda.Event(enable_timing=True)
        e = torch.cuda.Event(enable_timing=True)
        ts = []
        for i in range(iters):
            flush.fill_(i & 0xFF)
            # the GPU sleeps (untimed) while the host prepares the call: a side's host overhead (Python wrapper,
            # torch.compile guards) stays out of the events. With --sleep-cycles 0 the host may fall behind the GPU
            # instead (untimed either way: the events bracket the GPU work only)
            if args.sleep_cycles > 0:
                torch.cuda._sleep(args.sleep_cycles)
            s.record()
            fn()
            e.record()
            e.synchronize()
            ts.append(s.elapsed_time(e) * 1000.0)
        return ts

    n2 = 2 ** int(math.floor(math.log2(H)))
    slopes = torch.tensor([2.0 ** (-8.0 * (h + 1) / n2) for h in range(n2)], device=dev, dtype=torch.float32)

    cases = []
    for L in [int(x) for x in args.seq.split(",")]:
        for name, softcap, alibi, window in (("causal", 0.0, False, -1), ("causal softcap 30", 30.0, False, -1),
                                             ("causal alibi", 0.0, True, -1), ("sliding window 1024", 0.0, False, WINDOW)):
            tag = "V1 %s %d x %d" % (name, B, L)
            if args.only and not any(s in tag for s in args.only.split("|")):
                continue
            cases.append((tag, L, softcap, alibi, window))

    rows = []
    for tag, L, softcap, alibi, window in cases:
        torch.manual_seed(0)
        # kvattn: ragged NHD [tokens, heads, D]; the peers: [B, H, L, D] (same values)
        q4 = torch.randn(B, H, L, D, device=dev, dtype=torch.bfloat16)
        k4 = torch.randn(B, H, L, D, device=dev, dtype=torch.bfloat16)
        v4 = torch.randn(B, H, L, D, device=dev, dtype=torch.bfloat16)
        qn = q4.transpose(1, 2).reshape(B * L, H, D).contiguous()
        kn = k4.transpose(1, 2).reshape(B * L, H, D).contiguous()
        vn = v4.transpose(1, 2).reshape(B * L, H, D).contiguous()
        indptr = torch.arange(0, (B + 1) * L, L, dtype=torch.int32)
        w = kvattn.BatchPrefillWithRaggedKVCacheWrapper(ws, "NHD")
        w.plan(indptr, indptr, H, H, D, causal=True, pos_encoding_mode="ALIBI" if alibi else "NONE",
               window_left=window, logits_soft_cap=softcap if softcap > 0 else None, q_data_type=torch.bfloat16)

        def kcall():
            return w.run(qn, kn, vn)

        def causal_mask(b, h, q_idx, kv_idx):
            return q_idx >= kv_idx

        def window_mask(b, h, q_idx, kv_idx):
            return (q_idx >= kv_idx) & (q_idx - kv_idx <= WINDOW)

        bm = create_block_mask(window_mask if window >= 0 else causal_mask, B=None, H=None, Q_LEN=L, KV_LEN=L,
                               device=dev)
        sm = None
        if softcap > 0:
            def sm(score, b, h, q_idx, kv_idx):
                return softcap * torch.tanh(score / softcap)
        elif alibi:
            def sm(score, b, h, q_idx, kv_idx):
                return score + slopes[h] * (kv_idx - q_idx)

        def fcall():
            return flex(q4, k4, v4, score_mod=sm, block_mask=bm)

        plain = softcap == 0 and not alibi and window < 0

        def ccall():
            with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
                return torch.nn.functional.scaled_dot_product_attention(q4, k4, v4, is_causal=True)

        # accuracy cross-check of the two sides on this data (bf16 outputs; a gross mismatch means a wrong setup)
        ok = kcall().reshape(B, L, H, D).transpose(1, 2).float()
        of = fcall().float()
        err = ((ok - of).norm() / of.norm()).item()
        del ok, of
        for fn in (kcall, fcall) + ((ccall,) if plain else ()):  # warm-up (compiles, plans, module loads)
            time_cold(fn, 2)
        tk, tf, tc = [], [], []
        for r in range(args.rounds):
            if args.alternate == "rounds":
                tk += time_cold(kcall, args.iters)
                tf += time_cold(fcall, args.iters)
                if plain:
                    tc += time_cold(ccall, args.iters)
            else:  # call by call: both sides see the same clocks and temperature
                for i in range(args.iters):
                    tk += time_cold(kcall, 1)
                    tf += time_cold(fcall, 1)
                    if plain:
                        tc += time_cold(ccall, 1)
        if window >= 0:
            pairs = sum(min(i + 1, WINDOW + 1) for i in range(L))
        else:
            pairs = L * L / 2
        flops = 4.0 * D * H * B * pairs
        mk, mf = statistics.median(tk), statistics.median(tf)
        mc = statistics.median(tc) if tc else None
        tfl = lambda us: flops / (us * 1e-6) / 1e12
        # spread: the rounds' own medians of kvattn / Flex
        per_round = []
        for r in range(args.rounds):
            a = statistics.median(tk[r * args.iters:(r + 1) * args.iters])
            b = statistics.median(tf[r * args.iters:(r + 1) * args.iters])
            per_round.append(b / a)
        rows.append((tag, tfl(mk), tfl(mf), tfl(mc) if mc else None, mf / mk, min(per_round), max(per_round), err))
        print("%-34s kvattn %7.1f  Flex %7.1f  cuDNN %7s  kvattn/Flex %.3fx (rounds %.3f-%.3f)  rel.diff %.1e" % (
            tag, tfl(mk), tfl(mf), "%.1f" % tfl(mc) if mc else "-", mf / mk, min(per_round), max(per_round), err),
            flush=True)
        del q4, k4, v4, qn, kn, vn, w, bm
        torch.cuda.empty_cache()

    lines = ["# V1 with kvattn and FlexAttention timed in alternating rounds", ""]
    lines.append("device: %s; torch %s; date %s; commit %s; %d rounds x %d cold-L2 calls per side, medians; "
                 "sides alternate by %s; GPU sleep before each call: %d cycles" % (
                     torch.cuda.get_device_name(0), torch.__version__, datetime.date.today().isoformat(),
                     os.environ.get("KVA_COMMIT", "unknown"), args.rounds, args.iters,
                     "call" if args.alternate == "calls" else "round", args.sleep_cycles))
    lines.append("")
    lines.append("| workload | kvattn TFLOP/s | FlexAttention | cuDNN SDPA | kvattn / Flex | per-round range | "
                 "rel. diff kvattn vs Flex |")
    lines.append("|---|---:|---:|---:|---:|---|---:|")
    for tag, a, b, c, ratio, lo, hi, err in rows:
        lines.append("| %s | %.1f | %.1f | %s | %.2fx | %.2f-%.2fx | %.1e |" % (
            tag, a, b, "%.1f" % c if c else "-", ratio, lo, hi, err))
    text = "\n".join(lines) + "\n"
    if args.out:
        with open(args.out, "w") as f:
            f.write(text)
    print(text)


if __name__ == "__main__":
    main()
