#!/usr/bin/env python3
"""peers_decode.py - the decode peers on the shapes kva_bench_decode measured, and the combined results table.

Reads the CSV written by `kva_bench_decode --csv FILE` (one row per workload, with every request's KV length)
and times, in the same process and on the same GPU:
  * PyTorch scaled_dot_product_attention, cuDNN backend and flash backend, on contiguous K/V
    (q [B, Hq, 1, D], k/v [B, Hkv, L, D], enable_gqa=True); uniform-length bf16 workloads only (SDPA has no
    ragged or fp8 decode); D7 rows are timed as CUDA-graph replays;
  * FlashInfer BatchDecodeWithPagedKVCacheWrapper on the same paged shapes, when `import flashinfer` works.
Cold L2 (a 512 MB buffer is overwritten before every timed call), CUDA events, median of --iters.
Writes a markdown table (device, date, commit, then one row per workload) to --out and to stdout, table last.
"""
import argparse
import csv
import datetime
import os
import statistics
import subprocess
import sys


def graphed(fn):
    """fn captured into a CUDA graph (after one eager warm-up call); returns the graph's replay."""
    import torch
    fn()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    return g.replay


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--csv", required=True, help="CSV from kva_bench_decode --csv")
    ap.add_argument("--out", default=None, help="markdown output file")
    ap.add_argument("--iters", type=int, default=30)
    ap.add_argument("--hbm", type=float, default=0.0, help="nominal HBM TB/s (default: from the device name)")
    args = ap.parse_args()

    rows = list(csv.DictReader(open(args.csv)))
    import torch
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    dev = torch.device("cuda")
    name = torch.cuda.get_device_name(0)
    hbm = args.hbm or (4.8 if "H200" in name else 3.35 if "H100" in name else 0.0)
    flush = torch.empty(512 << 20, dtype=torch.uint8, device=dev)
    try:
        import flashinfer  # noqa: F401
        have_fi = True
        fi_version = getattr(flashinfer, "__version__", "?")
    except Exception as e:  # pragma: no cover - depends on the machine
        have_fi = False
        fi_version = "not importable (%s)" % type(e).__name__

    def time_cold(fn, iters):
        s = torch.cuda.Event(enable_timing=True)
        e = torch.cuda.Event(enable_timing=True)
        ts = []
        for i in range(iters + 3):
            flush.fill_(i & 0xFF)
            s.record()
            fn()
            e.record()
            e.synchronize()
            if i >= 3:
                ts.append(s.elapsed_time(e) * 1000.0)
        return statistics.median(ts)

    def warm_replay(fn, reps=200):
        s = torch.cuda.Event(enable_timing=True)
        e = torch.cuda.Event(enable_timing=True)
        fn()
        s.record()
        for _ in range(reps):
            fn()
        e.record()
        e.synchronize()
        return s.elapsed_time(e) * 1000.0 / reps

    results = []
    for r in rows:
        res = {"row": r, "cudnn": None, "flash": None, "fi": None, "note": ""}
        try:
            B, hq, hkv, d, ps = int(r["batch"]), int(r["hq"]), int(r["hkv"]), int(r["d"]), int(r["page_size"])
            lens = [int(x) for x in r["lens"].split(";")]
            float(r["kvattn_us"]), float(r["bytes"])
        except (ValueError, KeyError, TypeError, AttributeError) as e:
            print("peers_decode.py: skipping a malformed CSV row (%s): %r" % (e, r), file=sys.stderr)
            continue
        kvdt = r["kv_dtype"]
        is_graph = r["group"] == "D7"
        warm = "(warm)" in r["name"]
        # "D7 graph, 32 layers": one graph of 32 calls, each on its own K/V (a decode step's layers), per-call time
        layers = 32 if "32 layers" in r["name"] else 1
        uniform = len(set(lens)) == 1
        if r["group"] in ("BC", "MX"):  # bounds-check A/B rows, mixed-kernel decode steps: kvattn only
            results.append(res)
            continue
        torch.manual_seed(0)
        # ---- SDPA on contiguous K/V ----
        if uniform and kvdt == "bf16":
            L = lens[0]
            try:
                q = torch.randn(B, hq, 1, d, device=dev, dtype=torch.bfloat16)
                ks = [torch.randn(B, hkv, L, d, device=dev, dtype=torch.bfloat16) for _ in range(layers)]
                vs = [torch.randn(B, hkv, L, d, device=dev, dtype=torch.bfloat16) for _ in range(layers)]
                for key, be in (("cudnn", SDPBackend.CUDNN_ATTENTION), ("flash", SDPBackend.FLASH_ATTENTION)):
                    try:
                        def call(be=be):
                            with sdpa_kernel([be]):
                                for k, v in zip(ks, vs):
                                    out = F.scaled_dot_product_attention(q, k, v, enable_gqa=True)
                                return out
                        fn = graphed(call) if is_graph else call
                        res[key] = (warm_replay(fn) if warm else time_cold(fn, args.iters)) / layers
                    except Exception as e:
                        res["note"] += "%s: %s; " % (key, str(e).splitlines()[0][:60])
                del q, ks, vs
            except torch.OutOfMemoryError:
                res["note"] += "SDPA OOM; "
        elif not uniform:
            res["note"] += "SDPA: ragged n/a; "
        else:
            res["note"] += "SDPA: fp8 KV n/a; "
        # ---- FlashInfer on the paged shapes ----
        if have_fi:
            try:
                import flashinfer
                npg = [(l + ps - 1) // ps for l in lens]
                indptr = torch.tensor([0] + list(__import__("itertools").accumulate(npg)), dtype=torch.int32, device=dev)
                total = int(indptr[-1].item())
                indices = torch.randperm(total, device=dev).to(torch.int32)
                last = torch.tensor([l - (n - 1) * ps for l, n in zip(lens, npg)], dtype=torch.int32, device=dev)
                kdt = torch.float8_e4m3fn if kvdt == "e4m3" else torch.bfloat16
                kcs = [torch.randn(total, 2, ps, hkv, d, device=dev, dtype=torch.bfloat16).to(kdt)
                       for _ in range(layers)]
                q = torch.randn(B, hq, d, device=dev, dtype=torch.bfloat16)
                wsb = torch.empty(256 << 20, dtype=torch.uint8, device=dev)
                w = flashinfer.BatchDecodeWithPagedKVCacheWrapper(wsb, "NHD", use_cuda_graph=is_graph,
                                                                  paged_kv_indptr_buffer=indptr if is_graph else None,
                                                                  paged_kv_indices_buffer=indices if is_graph else None,
                                                                  paged_kv_last_page_len_buffer=last if is_graph else None)
                w.plan(indptr, indices, last, hq, hkv, d, ps, q_data_type=torch.bfloat16, kv_data_type=kdt)
                def fcall():
                    for kc in kcs:
                        out = w.run(q, kc)
                    return out
                fn = graphed(fcall) if is_graph else fcall
                res["fi"] = (warm_replay(fn) if warm else time_cold(fn, args.iters)) / layers
                del kcs, q, wsb
            except Exception as e:
                res["note"] += "FlashInfer: %s; " % str(e).splitlines()[0][:80]
        results.append(res)
        torch.cuda.empty_cache()

    commit = os.environ.get("KVA_COMMIT", "")
    if not commit:
        try:
            commit = subprocess.check_output(["git", "rev-parse", "--short", "HEAD"], stderr=subprocess.DEVNULL).decode().strip()
        except Exception:
            commit = "unknown"
    lines = []
    lines.append("# kvattn batch decode vs peers")
    lines.append("")
    lines.append("device: %s (nominal HBM %.2f TB/s); torch %s (CUDA %s); cuDNN %s; FlashInfer %s" % (
        name, hbm, torch.__version__, torch.version.cuda, torch.backends.cudnn.version(), fi_version))
    lines.append("date: %s; commit: %s; cold L2 (512 MB overwrite before each call), CUDA events, median of %d" % (
        datetime.datetime.now().strftime("%Y-%m-%d %H:%M"), commit, args.iters))
    lines.append("D7 rows: CUDA-graph replay (cold: one replay after a flush; warm: back-to-back replays); "
                 "'32 layers': one graph of 32 calls, each on its own K/V, time per call")
    lines.append("")
    # D4 load balance: ragged vs equal lengths of the same bytes
    eq = {r["row"]["name"].replace("D4eq ", "D4 "): float(r["row"]["kvattn_us"]) for r in results if r["row"]["group"] == "D4eq"}
    bal = []
    for res in results:
        r = res["row"]
        if r["group"] == "D4" and r["name"] in eq:
            bal.append("%s: ragged %.1f us vs equal %.1f us (%.2fx)" % (r["name"], float(r["kvattn_us"]), eq[r["name"]],
                                                                        float(r["kvattn_us"]) / eq[r["name"]]))
    if bal:
        lines.append("D4 load balance (time ragged / time equal lengths, same bytes): " + "; ".join(bal))
        lines.append("")
    bc = [res for res in results if res["row"]["group"] == "BC"]
    if bc:
        lines.append("Bounds check (kernels built with / without the page-index check, interleaved cold launches):")
        for k in range(0, len(bc) - 1, 2):
            a, b = bc[k]["row"], bc[k + 1]["row"]
            nochk, chk = (a, b) if "no bounds check" in a["name"] else (b, a)
            tn, tc = float(nochk["kvattn_us"]), float(chk["kvattn_us"])
            lines.append("- %s (%s): checked %.1f us, unchecked %.1f us: cost %+.2f%%" % (
                chk["name"].split(" [")[0], chk["label"], tc, tn, 100.0 * (tc - tn) / tn))
        lines.append("")

    def f1(x):
        return "%.1f" % x if x is not None else "-"

    def ratio(ref, x):
        return "%.2fx" % (ref / x) if ref and x else "-"

    lines.append("Ratios are speed relative to cuDNN SDPA in this run (cuDNN time / time; > 1 is faster than cuDNN).")
    lines.append("")
    lines.append("| workload | shape | MB | kvattn us | kvattn TB/s | %HBM | cuDNN us | cuDNN TB/s | flash us | "
                 "FlashInfer us | kvattn vs cuDNN | flash vs cuDNN | FlashInfer vs cuDNN | notes |")
    lines.append("|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|")
    for res in results:
        r = res["row"]
        if r["group"] == "BC":
            continue
        t = float(r["kvattn_us"])
        by = float(r["bytes"])
        tbs = by / (t * 1e-6) / 1e12
        pct = "%.1f" % (100.0 * tbs / hbm) if hbm else "?"
        ctbs = "%.3f" % (by / (res["cudnn"] * 1e-6) / 1e12) if res["cudnn"] else "-"
        lines.append("| %s | %s | %.1f | %.1f | %.3f | %s | %s | %s | %s | %s | %s | %s | %s | %s |" % (
            r["name"], r["label"], by / 1e6, t, tbs, pct, f1(res["cudnn"]), ctbs, f1(res["flash"]), f1(res["fi"]),
            ratio(res["cudnn"], t), ratio(res["cudnn"], res["flash"]), ratio(res["cudnn"], res["fi"]),
            res["note"].strip()))
    text = "\n".join(lines) + "\n"
    if args.out:
        with open(args.out, "w") as fh:
            fh.write(text)
    sys.stdout.write(text)


if __name__ == "__main__":
    main()
