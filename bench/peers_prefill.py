#!/usr/bin/env python3
"""peers_prefill.py - the prefill peers on the shapes kva_bench_prefill measured, and the combined results table.

Reads the CSV written by `kva_bench_prefill --csv FILE` (one row per workload with every request's query and KV
length and the variant) and times, in the same process and on the same GPU, with bf16 inputs:
  * PyTorch scaled_dot_product_attention with the cuDNN backend and with the flash backend (FA2), on contiguous
    K/V: q [B, Hq, L, D], k/v [B, Hkv, L, D], enable_gqa=True. Causal with qo == kv uses is_causal=True; appends
    (qo < kv) use the bottom-right causal bias torch.nn.attention.bias.causal_lower_right, kvattn's convention.
    Ragged batches (P2) run one SDPA call per request inside one timed span (SDPA has no ragged batch; noted).
    Paged rows (P3) are timed on contiguous K/V (the peers have no paged layout; noted). Soft cap, ALiBi and
    sliding window have no flash/cuDNN SDPA form: n/a there.
  * FlexAttention (torch.compile'd flex_attention) for the V1 rows: causal (block mask), causal + soft cap 30
    (score_mod), causal + ALiBi (score_mod with the standard slopes), sliding window 1024 (block mask,
    q - k <= 1024 and causal).
Cold L2 (a 512 MB buffer is overwritten before every timed call), CUDA events, median of --iters after warm-ups.
TFLOP/s use the FLOP count of the CSV (kvattn's: causal trapezoid, exact pairs for the window).
Writes a markdown table (device, versions, commit, then one row per workload) to --out and to stdout.
"""
import argparse
import csv
import datetime
import math
import os
import statistics
import subprocess


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--csv", required=True, help="CSV from kva_bench_prefill --csv")
    ap.add_argument("--out", default=None, help="markdown output file")
    ap.add_argument("--iters", type=int, default=30)
    ap.add_argument("--no-flex", action="store_true", help="skip FlexAttention (no torch.compile)")
    args = ap.parse_args()

    rows = list(csv.DictReader(open(args.csv)))
    import torch
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    try:
        from torch.nn.attention.bias import causal_lower_right
    except Exception:  # pragma: no cover - old torch
        causal_lower_right = None
    flex = None
    create_block_mask = None
    if not args.no_flex:
        try:
            from torch.nn.attention.flex_attention import create_block_mask, flex_attention

            flex = torch.compile(flex_attention, dynamic=False)
        except Exception as e:  # pragma: no cover - depends on the install
            print("FlexAttention unavailable: %s" % e)

    dev = torch.device("cuda")
    name = torch.cuda.get_device_name(0)
    flush = torch.empty(512 << 20, dtype=torch.uint8, device=dev)

    def time_cold(fn, iters, warm=3):
        s = torch.cuda.Event(enable_timing=True)
        e = torch.cuda.Event(enable_timing=True)
        ts = []
        for i in range(iters + warm):
            flush.fill_(i & 0xFF)
            s.record()
            fn()
            e.record()
            e.synchronize()
            if i >= warm:
                ts.append(s.elapsed_time(e) * 1000.0)
        return statistics.median(ts)

    def alibi_slopes(n):
        n2 = 2 ** int(math.floor(math.log2(n)))
        sl = [2.0 ** (-8.0 * (h + 1) / n2) for h in range(n2)]
        sl += [2.0 ** (-4.0 * (2 * (h - n2) + 1) / n2) for h in range(n2, n)]
        return torch.tensor(sl, device=dev, dtype=torch.float32)

    results = []
    for r in rows:
        B, hq, hkv, d = int(r["batch"]), int(r["hq"]), int(r["hkv"]), int(r["d"])
        qo = [int(x) for x in r["qo_lens"].split(";")]
        kv = [int(x) for x in r["kv_lens"].split(";")]
        causal, window, softcap, alibi = int(r["causal"]), int(r["window"]), float(r["softcap"]), int(r["alibi"])
        ps = int(r["page_size"])
        flops = float(r["flops"])
        res = {"row": r, "cudnn": None, "flash": None, "flex": None, "note": ""}
        uniform = len(set(qo)) == 1 and len(set(kv)) == 1
        plain = softcap == 0 and not alibi and window < 0
        torch.manual_seed(0)
        if ps > 0:
            res["note"] += "peers on contiguous K/V; "
        try:
            if uniform:
                L, S = qo[0], kv[0]
                q = torch.randn(B, hq, L, d, device=dev, dtype=torch.bfloat16)
                k = torch.randn(B, hkv, S, d, device=dev, dtype=torch.bfloat16)
                v = torch.randn(B, hkv, S, d, device=dev, dtype=torch.bfloat16)
                if plain:
                    bias = None
                    if causal and L != S:
                        bias = causal_lower_right(L, S) if causal_lower_right else None
                    for key, be in (("cudnn", SDPBackend.CUDNN_ATTENTION), ("flash", SDPBackend.FLASH_ATTENTION)):
                        try:
                            if causal and L != S:
                                if bias is None:
                                    raise RuntimeError("no causal_lower_right")

                                def call(be=be):
                                    with sdpa_kernel([be]):
                                        return F.scaled_dot_product_attention(q, k, v, attn_mask=bias, enable_gqa=True)
                            else:

                                def call(be=be):
                                    with sdpa_kernel([be]):
                                        return F.scaled_dot_product_attention(q, k, v, is_causal=bool(causal),
                                                                              enable_gqa=True)
                            res[key] = time_cold(call, args.iters)
                        except Exception as e:
                            res["note"] += "%s: %s; " % (key, str(e).splitlines()[0][:50])
                else:
                    res["note"] += "SDPA: no fused form of this variant; "
                if flex is not None and r["group"] == "V1":
                    try:
                        kx = k if hkv == hq else k.repeat_interleave(hq // hkv, dim=1)
                        vx = v if hkv == hq else v.repeat_interleave(hq // hkv, dim=1)
                        off = S - L

                        def causal_mask(b, h, q_idx, kv_idx):
                            return q_idx + off >= kv_idx

                        def window_mask(b, h, q_idx, kv_idx):
                            return (q_idx + off >= kv_idx) & (q_idx + off - kv_idx <= window)

                        mm = window_mask if window >= 0 else causal_mask
                        bm = create_block_mask(mm, B=None, H=None, Q_LEN=L, KV_LEN=S, device=dev)
                        sm = None
                        if softcap > 0:
                            cap = softcap

                            def sm(score, b, h, q_idx, kv_idx):
                                return cap * torch.tanh(score / cap)
                        elif alibi:
                            slopes = alibi_slopes(hq)

                            def sm(score, b, h, q_idx, kv_idx):
                                return score + slopes[h] * (kv_idx - q_idx - off)

                        def fcall():
                            return flex(q, kx, vx, score_mod=sm, block_mask=bm)

                        fcall()
                        torch.cuda.synchronize()
                        res["flex"] = time_cold(fcall, args.iters)
                    except Exception as e:
                        res["note"] += "flex: %s; " % str(e).splitlines()[0][:60]
                del q, k, v
            else:
                # ragged: one SDPA call per request in one timed span
                if plain:
                    qs = [torch.randn(1, hq, a, d, device=dev, dtype=torch.bfloat16) for a in qo]
                    ks = [torch.randn(1, hkv, b, d, device=dev, dtype=torch.bfloat16) for b in kv]
                    vs = [torch.randn(1, hkv, b, d, device=dev, dtype=torch.bfloat16) for b in kv]
                    res["note"] += "SDPA per request (ragged); "
                    for key, be in (("cudnn", SDPBackend.CUDNN_ATTENTION), ("flash", SDPBackend.FLASH_ATTENTION)):
                        try:
                            def call(be=be):
                                with sdpa_kernel([be]):
                                    for a, b, c in zip(qs, ks, vs):
                                        F.scaled_dot_product_attention(a, b, c, is_causal=bool(causal), enable_gqa=True)
                            res[key] = time_cold(call, args.iters)
                        except Exception as e:
                            res["note"] += "%s: %s; " % (key, str(e).splitlines()[0][:50])
                    del qs, ks, vs
        except torch.OutOfMemoryError:
            res["note"] += "OOM; "
        results.append(res)
        torch.cuda.empty_cache()

    commit = os.environ.get("KVA_COMMIT", "")
    if not commit:
        try:
            commit = subprocess.check_output(["git", "rev-parse", "--short", "HEAD"],
                                             stderr=subprocess.DEVNULL).decode().strip()
        except Exception:
            commit = "unknown"

    def tf(us, flops):
        return None if not us else flops / (us * 1e-6) / 1e12

    def fmt(x, f="%.1f"):
        return "-" if x is None else f % x

    lines = ["# kvattn batch prefill vs peers", ""]
    lines.append("device: %s; torch %s (CUDA %s); cuDNN %s; date %s; commit %s" % (
        name, torch.__version__, torch.version.cuda, torch.backends.cudnn.version(),
        datetime.date.today().isoformat(), commit))
    lines.append("cold L2, CUDA events, median of %d; TFLOP/s from kvattn's FLOP count (causal trapezoid)" % args.iters)
    lines.append("")
    lines.append("| workload | shape | kvattn TFLOP/s | cuDNN SDPA | flash SDPA (FA2) | FlexAttention | kvattn / FA2 | "
                 "kvattn / Flex | plan us | tile | notes |")
    lines.append("|---|---|---|---|---|---|---|---|---|---|---|")
    for res in results:
        r = res["row"]
        fl = float(r["flops"])
        k_tf = float(r["tflops"])
        c_tf, f_tf, x_tf = tf(res["cudnn"], fl), tf(res["flash"], fl), tf(res["flex"], fl)
        lines.append("| %s | %s | %.1f | %s | %s | %s | %s | %s | %s | %s | %s |" % (
            r["name"], r["label"], k_tf, fmt(c_tf), fmt(f_tf), fmt(x_tf),
            fmt(k_tf / f_tf if f_tf else None, "%.2fx"), fmt(k_tf / x_tf if x_tf else None, "%.2fx"),
            r["plan_us"], r["tile_q"], res["note"].strip()))
    text = "\n".join(lines) + "\n"
    if args.out:
        with open(args.out, "w") as f:
            f.write(text)
    print(text)


if __name__ == "__main__":
    main()
