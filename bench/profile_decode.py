#!/usr/bin/env python3
"""profile_decode.py - what kernels a decode call launches, for kvattn and the SDPA peers, from the CUPTI trace.

For each shape (GQA 32/8, D 128, bf16, page 16 for kvattn; contiguous K/V for SDPA), eager and CUDA-graph calls,
cold (a 512 MB overwrite before each call) and warm (back-to-back calls), it records with torch.profiler every
kernel the call launches: name, grid, block, registers, shared memory, and the median kernel duration; per call the
median span from the first kernel's start to the last kernel's end, and for warm runs the median start-to-start
interval of consecutive calls (what one call costs in a loop). Durations are CUPTI's, not events: they leave out the
launch latency before the first kernel.

    PYTHONPATH=python KVATTN_LIBRARY=build-dev/libkvattn.so python3 bench/profile_decode.py [--shapes 1x1024,16x4096]

Prints one table per call kind; diagnostic only (the benchmark numbers are kva_bench_decode's and peers_decode.py's).
"""
import argparse
import json
import os
import statistics
import sys
import tempfile


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", default="1x1024,16x1024,16x4096,1x32768")
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--peers", default="cudnn,flash", help="comma list of cudnn, flash (empty: none)")
    ap.add_argument("--flush", choices=("fill", "read"), default="fill",
                    help="cold calls: fill = overwrite 512 MB (dirty L2), read = a reduction reads it (clean L2)")
    args = ap.parse_args()

    import torch
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel
    import kvattn
    from peers_decode import graphed  # bench/ is the script's directory, first on sys.path

    dev = torch.device("cuda")
    hq, hkv, d, ps = 32, 8, 128, 16
    flush = torch.empty(512 << 20, dtype=torch.uint8, device=dev)
    flush64 = flush.view(torch.int64)
    sink = torch.zeros(1, dtype=torch.int64, device=dev)
    print("device:", torch.cuda.get_device_name(0), "torch", torch.__version__, "cuDNN", torch.backends.cudnn.version())

    def profile(fn, iters, cold):
        """kernels of `iters` calls of fn; returns a list of calls, each a list of kernel dicts (flush excluded)."""
        from torch.profiler import profile as tprof, ProfilerActivity
        for _ in range(3):
            fn()
        torch.cuda.synchronize()
        marker = torch.empty(1, device=dev)
        with tprof(activities=[ProfilerActivity.CUDA]) as prof:
            for i in range(iters):
                if cold and args.flush == "read":
                    marker.fill_(float(i))  # a read flush's kernel is not a fill: a marker before it starts a skip
                    torch.sum(flush64, dim=0, keepdim=True, out=sink)
                elif cold:
                    flush.fill_(i & 0xFF)
                marker.fill_(float(i))  # call separator (a tiny fill kernel)
                fn()
            torch.cuda.synchronize()
        fd, path = tempfile.mkstemp(suffix=".json")
        os.close(fd)
        prof.export_chrome_trace(path)
        ev = json.load(open(path))
        os.unlink(path)
        ks = [e for e in ev.get("traceEvents", []) if e.get("cat") == "kernel"]
        ks.sort(key=lambda e: e["ts"])
        calls, cur = [], None
        nmark = 0
        for e in ks:
            a = e.get("args", {})
            grid = tuple(a.get("grid", []))
            name = e["name"]
            if grid and (("fill" in name.lower() or "Fill" in name) and (grid == (1, 1, 1) or cold and grid[0] > 1000)):
                if grid == (1, 1, 1):  # the marker: a new call starts (read flush: every other marker starts the flush)
                    nmark += 1
                    if cold and args.flush == "read" and nmark % 2 == 1:
                        cur = None
                    else:
                        cur = []
                        calls.append(cur)
                continue
            if cur is None:
                continue
            cur.append({"name": name, "grid": grid, "block": tuple(a.get("block", [])),
                        "regs": a.get("registers per thread", "?"), "smem": a.get("shared memory", "?"),
                        "ts": float(e["ts"]), "dur": float(e["dur"])})
        return [c for c in calls if c]

    def summarize(label, calls):
        if not calls:
            print("%-34s no kernels recorded" % label)
            return
        n = statistics.mode(len(c) for c in calls)
        calls = [c for c in calls if len(c) == n]
        spans = [c[-1]["ts"] + c[-1]["dur"] - c[0]["ts"] for c in calls]
        s2s = [calls[i + 1][0]["ts"] - calls[i][0]["ts"] for i in range(len(calls) - 1)]
        print("%-34s %d kernel(s)/call; span median %.2f us (min %.2f)%s" % (
            label, n, statistics.median(spans), min(spans),
            "; start-to-start median %.2f us" % statistics.median(s2s) if s2s else ""))
        for j in range(n):
            k = calls[0][j]
            durs = [c[j]["dur"] for c in calls]
            gap = [c[j]["ts"] - (c[j - 1]["ts"] + c[j - 1]["dur"]) for c in calls] if j else None
            nm = k["name"]
            if len(nm) > 90:
                nm = nm[:87] + "..."
            print("    k%d %-90s grid %-14s block %-12s regs %-4s smem %-6s dur %.2f us%s" % (
                j, nm, "x".join(map(str, k["grid"])), "x".join(map(str, k["block"])), k["regs"], k["smem"],
                statistics.median(durs), " (gap before %.2f us)" % statistics.median(gap) if gap else ""))

    peers = [p for p in args.peers.split(",") if p]
    for shp in args.shapes.split(","):
        B, L = (int(x) for x in shp.split("x"))
        print("\n==== %d x %d (GQA %d/%d, D %d, bf16) ====" % (B, L, hq, hkv, d))
        torch.manual_seed(0)
        # kvattn, paged
        npg = (L + ps - 1) // ps
        total = B * npg
        indptr = torch.arange(0, total + 1, npg, dtype=torch.int32, device=dev)
        indices = torch.randperm(total, device=dev).to(torch.int32)
        last = torch.full((B,), L - (npg - 1) * ps, dtype=torch.int32, device=dev)
        kc = torch.randn(total, 2, ps, hkv, d, device=dev, dtype=torch.bfloat16)
        q = torch.randn(B, hq, d, device=dev, dtype=torch.bfloat16)
        out = torch.empty_like(q)
        wsb = torch.empty(256 << 20, dtype=torch.uint8, device=dev)
        for graph in (False, True):
            w = kvattn.BatchDecodeWithPagedKVCacheWrapper(
                wsb, "NHD", use_cuda_graph=graph,
                paged_kv_indptr_buffer=torch.empty_like(indptr) if graph else None,
                paged_kv_indices_buffer=torch.empty_like(indices) if graph else None,
                paged_kv_last_page_len_buffer=torch.empty_like(last) if graph else None)
            w.plan(indptr.cpu(), indices, last.cpu(), hq, hkv, d, ps, q_data_type=torch.bfloat16,
                   kv_data_type=torch.bfloat16, num_pages=total)
            fn = lambda: w.run(q, kc, out=out)
            if graph:
                fn = graphed(fn)
            tag = "graph" if graph else "eager"
            try:
                info = w.plan_info()
                print("kvattn %s plan: %s" % (tag, info))
            except Exception:
                pass
            summarize("kvattn %s cold" % tag, profile(fn, args.iters, True))
            summarize("kvattn %s warm" % tag, profile(fn, args.iters, False))
        del kc, wsb
        # SDPA, contiguous
        qs = torch.randn(B, hq, 1, d, device=dev, dtype=torch.bfloat16)
        k = torch.randn(B, hkv, L, d, device=dev, dtype=torch.bfloat16)
        v = torch.randn(B, hkv, L, d, device=dev, dtype=torch.bfloat16)
        for key in peers:
            be = {"cudnn": SDPBackend.CUDNN_ATTENTION, "flash": SDPBackend.FLASH_ATTENTION}[key]

            def call(be=be):
                with sdpa_kernel([be]):
                    return F.scaled_dot_product_attention(qs, k, v, enable_gqa=True)
            try:
                for graph in (False, True):
                    fn = graphed(call) if graph else call
                    tag = "graph" if graph else "eager"
                    summarize("%s %s cold" % (key, tag), profile(fn, args.iters, True))
                    summarize("%s %s warm" % (key, tag), profile(fn, args.iters, False))
            except Exception as e:
                print("%s: %s" % (key, str(e).splitlines()[0][:100]))
        del qs, k, v
        torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    sys.exit(main())
