#!/usr/bin/env python3
"""decode_interleaved.py - batch decode (WORKLOADS D1/D3 shapes: bf16, D 128, page 16, scattered pages) with kvattn
and cuDNN SDPA timed in alternating rounds inside one process, under each of several L2 flushes.

Why: the decode table (kva_bench_decode, then peers_decode.py in a second process) times the two sides minutes apart
and flushes the L2 differently (cudaMemsetAsync in C, torch's fill_ kernel in Python). A memory-bound call that
starts under a dirty L2 pays for the write-back of the flush, and the sides may pay differently for different
flushes; clocks and HBM state drift between processes. Here both sides see the same flush before every timed call,
the rounds alternate (kvattn, cuDNN, kvattn, ...), and the medians are over all rounds.

Flushes (a 512 MB buffer before every timed call):
  fill    torch's fill_ kernel writes it (peers_decode.py's flush; the L2 is left full of dirty lines)
  memset  cudaMemsetAsync writes it (kva_bench_decode's flush)
  read    a reduction reads it (the L2 is left full of clean lines)
  rotate  no flush: each side rotates over copies of its inputs (q and the KV pool; q, K and V for cuDNN), enough
          copies that >= 512 MB of that side's reads separate two uses of one copy (WORKLOADS.md's other cold-L2
          method: the L2 holds the clean lines of the copies read before, as in a model's decode step)

kvattn runs through its Python API (BatchDecodeWithPagedKVCacheWrapper, NHD, pages a random permutation of the
pool, plan once, run timed without PDL); cuDNN through torch SDPA on contiguous [B, H_kv, L, D] K/V (enable_gqa).
A GPU sleep before each timed call keeps the host's Python overhead out of the events.

    PYTHONPATH=python KVATTN_LIBRARY=build-dev/libkvattn.so python3 bench/decode_interleaved.py \
        [--shapes 16x4096,64x8192] [--flush fill,memset,read,rotate] [--rounds 5] [--iters 10] [--out FILE.md]
"""
import argparse
import ctypes
import datetime
import os
import statistics
import sys

import torch

import kvattn

DEFAULT_SHAPES = "16x1024,16x4096,64x1024,64x4096,64x8192,128x2048,256x2048,64x8192/4"


def load_cudart():
    """The CUDA runtime torch loaded (for cudaMemsetAsync on torch's stream)."""
    with open("/proc/self/maps") as f:
        for line in f:
            path = line.split()[-1]
            if "libcudart.so" in os.path.basename(path):
                lib = ctypes.CDLL(path)
                lib.cudaMemsetAsync.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_size_t, ctypes.c_void_p]
                lib.cudaMemsetAsync.restype = ctypes.c_int
                return lib
    return None


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", default=DEFAULT_SHAPES,
                    help="BxL[/Hkv] comma-separated (H_q 32, H_kv 8 unless /Hkv is given)")
    ap.add_argument("--flush", default="fill,memset,read")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--page-size", type=int, default=16)
    ap.add_argument("--sleep-cycles", type=int, default=1 << 20)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()

    from torch.nn.attention import SDPBackend, sdpa_kernel
    import torch.nn.functional as F

    dev = torch.device("cuda")
    name = torch.cuda.get_device_name(0)
    hbm = 4.8 if "H200" in name else 3.35 if "H100" in name else 0.0
    flush = torch.empty(512 << 20, dtype=torch.uint8, device=dev)
    flush64 = flush.view(torch.int64)
    cudart = load_cudart()
    flushes = [f for f in args.flush.split(",") if f]
    if "memset" in flushes and cudart is None:
        print("decode_interleaved.py: libcudart not found in the process; dropping the memset flush", file=sys.stderr)
        flushes.remove("memset")
    sink = torch.zeros(1, dtype=torch.int64, device=dev)

    def do_flush(mode, i):
        if mode == "fill":
            flush.fill_(i & 0xFF)
        elif mode == "memset":
            rc = cudart.cudaMemsetAsync(ctypes.c_void_p(flush.data_ptr()), i & 0xFF, flush.numel(),
                                        ctypes.c_void_p(torch.cuda.current_stream().cuda_stream))
            if rc != 0:
                raise RuntimeError("cudaMemsetAsync: error %d" % rc)
        elif mode == "read":
            torch.sum(flush64, dim=0, keepdim=True, out=sink)
        else:
            raise ValueError("unknown flush %r" % mode)

    def time_cold(fn, mode, iters, ncopies):
        s = torch.cuda.Event(enable_timing=True)
        e = torch.cuda.Event(enable_timing=True)
        ts = []
        for i in range(iters):
            if mode == "rotate":
                time_cold.copy = (time_cold.copy + 1) % ncopies
            else:
                do_flush(mode, i)
            if args.sleep_cycles > 0:
                torch.cuda._sleep(args.sleep_cycles)
            s.record()
            fn(time_cold.copy if mode == "rotate" else 0)
            e.record()
            e.synchronize()
            ts.append(s.elapsed_time(e) * 1000.0)
        return ts

    time_cold.copy = 0
    ps = args.page_size
    hq, d = 32, 128
    ws = torch.empty(256 << 20, dtype=torch.uint8, device=dev)
    gen = torch.Generator(device="cpu").manual_seed(1234)
    results = []
    for shape in [x for x in args.shapes.split(",") if x]:
        hkv = 8
        if "/" in shape:
            shape, h = shape.split("/")
            hkv = int(h)
        B, L = (int(x) for x in shape.split("x"))
        tag = "%d x %d (GQA %d/%d)" % (B, L, hq, hkv)
        nb = (L + ps - 1) // ps
        total = B * nb
        kv_bytes = 2.0 * B * L * hkv * d * 2
        # copies for the rotate flush: >= 512 MB of one side's reads between two uses of a copy
        ncopies = max(2, -(-(512 << 20) // int(kv_bytes)) + 1) if "rotate" in flushes else 1
        # kvattn: paged NHD cache [pages, 2, ps, hkv, d], pages scattered over the pool
        caches = [torch.randn(total, 2, ps, hkv, d, device=dev, dtype=torch.bfloat16) for _ in range(ncopies)]
        indices = torch.randperm(total, generator=gen).to(torch.int32).to(dev)
        indptr = torch.arange(0, (B + 1) * nb, nb, dtype=torch.int32)
        last = torch.full((B,), L - (nb - 1) * ps, dtype=torch.int32)
        qps = [torch.randn(B, hq, d, device=dev, dtype=torch.bfloat16) for _ in range(ncopies)]
        outp = torch.empty_like(qps[0])
        w = kvattn.BatchDecodeWithPagedKVCacheWrapper(ws, "NHD")
        w.plan(indptr, indices, last, hq, hkv, d, ps, q_data_type=torch.bfloat16, kv_data_type=torch.bfloat16)

        def run_kva(j=0):
            w.run(qps[j], caches[j], out=outp, enable_pdl=False)

        # cuDNN SDPA: contiguous K/V
        qs = [torch.randn(B, hq, 1, d, device=dev, dtype=torch.bfloat16) for _ in range(ncopies)]
        ks = [torch.randn(B, hkv, L, d, device=dev, dtype=torch.bfloat16) for _ in range(ncopies)]
        vs = [torch.randn(B, hkv, L, d, device=dev, dtype=torch.bfloat16) for _ in range(ncopies)]

        def run_cudnn(j=0):
            with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
                F.scaled_dot_product_attention(qs[j], ks[j], vs[j], enable_gqa=True)

        sides = (("kvattn", run_kva), ("cudnn", run_cudnn))
        for _, fn in sides:  # warm up (plans, handles, module loads)
            for _ in range(3):
                fn()
        torch.cuda.synchronize()
        for mode in flushes:
            ts = {s: [] for s, _ in sides}
            for r in range(args.rounds):
                order = sides if r % 2 == 0 else sides[::-1]
                for sname, fn in order:
                    ts[sname] += time_cold(fn, mode, args.iters, ncopies)
            med = {s: statistics.median(v) for s, v in ts.items()}
            res = dict(shape=tag, mb=kv_bytes / 1e6, flush=mode if mode != "rotate" else "rotate %d" % ncopies, kva=med["kvattn"], cudnn=med["cudnn"],
                       kva_spread=(min(ts["kvattn"]), max(ts["kvattn"])), n=len(ts["kvattn"]))
            results.append(res)
            print("%-26s flush %-6s kvattn %8.1f us  cuDNN %8.1f us  kvattn vs cuDNN %.3fx  (%.1f %% HBM)" % (
                tag, mode, med["kvattn"], med["cudnn"], med["cudnn"] / med["kvattn"],
                100.0 * kv_bytes / (med["kvattn"] * 1e-6) / (hbm * 1e12) if hbm else 0.0), flush=True)
        del caches, qs, ks, vs, qps, outp, w
        torch.cuda.empty_cache()

    lines = ["# Batch decode, kvattn and cuDNN SDPA interleaved in one process, by L2 flush", "",
             "device: %s (nominal HBM %.2f TB/s); torch %s; cuDNN %s; date %s; commit %s" % (
                 name, hbm, torch.__version__, torch.backends.cudnn.version(),
                 datetime.datetime.now().strftime("%Y-%m-%d %H:%M"), os.environ.get("KVA_COMMIT", "?")),
             "bf16, D 128, page %d (kvattn: scattered pages; cuDNN: contiguous K/V); %d rounds x %d cold calls per "
             "side, sides alternating; medians; ratio = cuDNN time / kvattn time (> 1: kvattn faster)" % (
                 ps, args.rounds, args.iters), "",
             "| shape | MB | flush | kvattn us | %HBM | cuDNN us | kvattn vs cuDNN |", "|---|---:|---|---:|---:|---:|---:|"]
    for r in results:
        pct = 100.0 * r["mb"] * 1e6 / (r["kva"] * 1e-6) / (hbm * 1e12) if hbm else 0.0
        lines.append("| %s | %.1f | %s | %.1f | %.1f | %.1f | %.3fx |" % (
            r["shape"], r["mb"], r["flush"], r["kva"], pct, r["cudnn"], r["cudnn"] / r["kva"]))
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text)


if __name__ == "__main__":
    main()
