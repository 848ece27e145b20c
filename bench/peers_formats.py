#!/usr/bin/env python3
"""peers_formats.py - workloads C2 (Quest-like block-sparse decode) and C1 (cascade) of /work/shared/WORKLOADS.md on
one GPU: kvattn through its Python package (torch CUDA tensors) next to its peers, in one process.

C2: batch-1 decode, MHA 32/32, D 128, bf16, seq in {4k, 8k, 16k, 32k}, page budget in {64, 128, 256, 512} pages of
16 tokens. The budget's pages are drawn at random per (seq, budget), the same for every head, sorted, and always
include the last page (the decode token's). Budgets larger than the sequence's page count are skipped.
  * dense SDPA (cuDNN and flash backends) over the whole sequence: q [1, 32, 1, 128], contiguous k/v
    [1, 32, seq, 128] (what the sparse methods save against);
  * FlexAttention (torch.compile'd flex_attention, when importable) with a BlockMask built from the page
    selection: KV block 16 (the page); q length 1 inside a larger q block. The first block-size configuration
    that compiles and matches the reference is used and named in the notes (falls back to KV block 128 with the
    page mask applied inside blocks if block 16 does not compile);
  * kvattn BlockSparseAttentionWrapper: M = 1, R = 1, C = 16, indices = the selected pages, k/v [seq, 32, 128]
    (NHD); plan() outside the timing (its host time is reported separately).
  kvattn's and Flex's outputs are checked against SDPA with the equivalent boolean mask [1, 1, 1, seq] (max abs
  error reported).
C1: cascade, MHA 32/32, D 128, page 16, shared prefix in {1k, 8k, 32k}, unique suffix 128, batch in {16, 64, 256},
one decode token per request: kvattn MultiLevelCascadeAttentionWrapper (2 levels: the shared prefix, then each
request's suffix) vs kvattn BatchDecodeWithPagedKVCacheWrapper flat over the concatenated page tables (the
prefix pages are shared through the page tables, not copied). Max abs difference of the two outputs reported.

Timing: cold L2 (a --flush-mb buffer is overwritten before every timed call), CUDA events around the call,
median of --iters after 3 warm-up calls. Ratios are speedups: (peer time) / (kvattn time), > 1 = kvattn faster.
Every case runs inside try/except: an error is printed and noted, and the script goes on.

Run from the repository root on the GPU machine, with a CUDA build of libkvattn.so:
  KVATTN_LIBRARY=build-cuda/libkvattn.so python3 bench/peers_formats.py --out bench/results/formats_<gpu>.md
"""
import argparse
import datetime
import os
import statistics
import subprocess
import sys
import time
import traceback
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

SEQS = [4096, 8192, 16384, 32768]
BUDGETS = [64, 128, 256, 512]
PREFIXES = [1024, 8192, 32768]
BATCHES = [16, 64, 256]
QUICK = dict(seqs=[4096, 32768], budgets=[64, 512], prefixes=[8192], batches=[64])

PAGE = 16
HEADS = 32
HEAD_DIM = 128
SUFFIX = 128


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=None, help="write the report here (markdown; CSV if the name ends in .csv)")
    ap.add_argument("--csv", default=None, help="also write every measured row as CSV here")
    ap.add_argument("--iters", type=int, default=30, help="timed calls per case (median; default 30)")
    ap.add_argument("--quick", action="store_true", help="a small subset: C2 seq {4k, 32k} x budget {64, 512}, "
                    "C1 prefix 8k x batch 64")
    ap.add_argument("--no-flex", action="store_true", help="skip FlexAttention (no torch.compile)")
    ap.add_argument("--no-c1", action="store_true", help="skip the cascade workload")
    ap.add_argument("--no-c2", action="store_true", help="skip the block-sparse workload")
    ap.add_argument("--seed", type=int, default=0, help="seed of the page selections and inputs (default 0)")
    ap.add_argument("--flush-mb", type=int, default=512, help="L2 flush buffer in MB (default 512)")
    ap.add_argument("--lib", default=None, help="libkvattn.so to load (default: $KVATTN_LIBRARY, else "
                    "build-cuda/libkvattn.so when present, else the package's own lookup)")
    return ap.parse_args(argv)


def short(e):
    s = str(e).strip().splitlines()
    return "%s: %s" % (type(e).__name__, (s[0] if s else "")[:120])


class Bench:
    def __init__(self, args):
        import torch

        self.torch = torch
        self.args = args
        self.dev = torch.device("cuda")
        self.flush = torch.empty(args.flush_mb << 20, dtype=torch.uint8, device=self.dev)

    def time_cold(self, fn, warm=3):
        torch = self.torch
        s = torch.cuda.Event(enable_timing=True)
        e = torch.cuda.Event(enable_timing=True)
        ts = []
        for i in range(self.args.iters + warm):
            self.flush.fill_(i & 0xFF)
            s.record()
            fn()
            e.record()
            e.synchronize()
            if i >= warm:
                ts.append(s.elapsed_time(e) * 1000.0)
        return statistics.median(ts)

    @staticmethod
    def host_time(fn, reps=5):
        ts = []
        for _ in range(reps):
            t0 = time.perf_counter()
            fn()
            ts.append((time.perf_counter() - t0) * 1e6)
        return statistics.median(ts)


# --------------------------------------------------------------------------------------------------
# C2: Quest-like block-sparse decode


def c2(b, kvattn, flex, create_block_mask, seqs, budgets):
    torch = b.torch
    F = torch.nn.functional
    from torch.nn.attention import SDPBackend, sdpa_kernel

    H, D = HEADS, HEAD_DIM
    rows = []
    gen = torch.Generator(device="cpu").manual_seed(b.args.seed)
    for S in seqs:
        npages = S // PAGE
        dense = {"cudnn": None, "flash": None, "note": ""}
        try:
            q4 = torch.randn(1, H, 1, D, generator=gen).to(b.dev, torch.bfloat16)  # SDPA / Flex layout
            k4 = torch.randn(1, H, S, D, generator=gen).to(b.dev, torch.bfloat16)
            v4 = torch.randn(1, H, S, D, generator=gen).to(b.dev, torch.bfloat16)
            # kvattn: the same values as a token-major (NHD) cache, its own memory
            qk = q4[0].transpose(0, 1).contiguous()  # [1, H, D]
            kk = k4[0].transpose(0, 1).contiguous()  # [S, H, D]
            vk = v4[0].transpose(0, 1).contiguous()
        except Exception as e:
            print("C2 seq %d: allocating inputs failed: %s" % (S, short(e)), flush=True)
            for B_ in budgets:
                rows.append(dict(seq=S, budget=B_, note="inputs: " + short(e)))
            continue
        for key, be in (("cudnn", SDPBackend.CUDNN_ATTENTION), ("flash", SDPBackend.FLASH_ATTENTION)):
            try:
                def call(be=be):
                    with sdpa_kernel([be]):
                        return F.scaled_dot_product_attention(q4, k4, v4)
                dense[key] = b.time_cold(call)
            except Exception as e:
                dense["note"] += "dense %s: %s; " % (key, short(e))
                print("C2 seq %d dense %s: %s" % (S, key, short(e)), flush=True)
        flex_cfg = None  # the configuration that worked at this seq (kept for every budget)
        flex_tried = False
        for budget in budgets:
            r = dict(seq=S, budget=budget, cudnn=dense["cudnn"], flash=dense["flash"], flex=None, kvattn=None,
                     kvattn_err=None, flex_err=None, plan_us=None, note=dense["note"])
            if budget > npages:
                r["note"] += "budget > %d pages: skipped; " % npages
                rows.append(r)
                continue
            try:
                perm = torch.randperm(npages - 1, generator=gen)[: budget - 1]
                sel = torch.sort(torch.cat([perm, torch.tensor([npages - 1])]))[0].to(torch.int32)
                page_vis = torch.zeros(npages, dtype=torch.bool)
                page_vis[sel.long()] = True
                page_vis = page_vis.to(b.dev)
                tok_mask = page_vis.repeat_interleave(PAGE)[None, None, None, :]  # [1, 1, 1, S]
                ref = F.scaled_dot_product_attention(q4.float(), k4.float(), v4.float(), attn_mask=tok_mask)
                ref = ref[0].transpose(0, 1)  # [1, H, D]
            except Exception as e:
                r["note"] += "selection/reference: %s; " % short(e)
                print("C2 seq %d budget %d: %s" % (S, budget, short(e)), flush=True)
                rows.append(r)
                continue
            # ---- kvattn ----
            try:
                ws = torch.empty(128 << 20, dtype=torch.uint8, device=b.dev)
                w = kvattn.BlockSparseAttentionWrapper(ws)
                indptr = torch.tensor([0, budget], dtype=torch.int32)

                def plan():
                    w.plan(indptr, sel, 1, S, 1, PAGE, H, H, D, q_data_type=torch.bfloat16,
                           kv_data_type=torch.bfloat16, o_data_type=torch.bfloat16)
                plan()
                r["plan_us"] = b.host_time(plan)
                out = torch.empty(1, H, D, dtype=torch.bfloat16, device=b.dev)
                w.run(qk, kk, vk, out=out)
                torch.cuda.synchronize()
                r["kvattn_err"] = (out.float() - ref).abs().max().item()
                r["kvattn"] = b.time_cold(lambda: w.run(qk, kk, vk, out=out))
            except Exception as e:
                r["note"] += "kvattn: %s; " % short(e)
                print("C2 seq %d budget %d kvattn: %s" % (S, budget, short(e)), flush=True)
            # ---- FlexAttention ----
            if flex is not None and not (flex_tried and flex_cfg is None):
                configs = [flex_cfg] if flex_cfg else [
                    ("q128/kv16", (128, PAGE), None),
                    ("q16/kv16 BLOCK_M=BLOCK_N=16", (16, PAGE), {"BLOCK_M": 16, "BLOCK_N": 16}),
                    ("q128/kv128 (page mask inside blocks)", (128, 128), None),
                ]
                errs = []
                for cfg in configs:
                    name, bs, kopt = cfg
                    try:
                        pv = page_vis

                        def mask_mod(bb, hh, q_idx, kv_idx):
                            return pv[kv_idx // PAGE]
                        bm = create_block_mask(mask_mod, B=None, H=None, Q_LEN=1, KV_LEN=S, device=b.dev,
                                               BLOCK_SIZE=bs)

                        def fcall(bm=bm, kopt=kopt):
                            return flex(q4, k4, v4, block_mask=bm, kernel_options=kopt)
                        o = fcall()  # compiles on the first use of a shape (outside the timing)
                        torch.cuda.synchronize()
                        err = (o[0].transpose(0, 1).float() - ref).abs().max().item()
                        if not err < 0.05:
                            raise RuntimeError("output differs from the masked reference (max err %g)" % err)
                        r["flex_err"] = err
                        r["flex"] = b.time_cold(fcall)
                        if cfg is not flex_cfg:
                            flex_cfg = cfg
                        r["note"] += "flex %s; " % name
                        break
                    except Exception as e:
                        errs.append("%s: %s" % (name, short(e)))
                        print("C2 seq %d budget %d flex %s: %s" % (S, budget, name, short(e)), flush=True)
                flex_tried = True
                if r["flex"] is None:
                    r["note"] += "flex failed (%s); " % " | ".join(errs)
            rows.append(r)
            print("C2 seq %5d budget %3d: cudnn %s flash %s flex %s kvattn %s us" % (
                S, budget, fmt(r["cudnn"]), fmt(r["flash"]), fmt(r["flex"]), fmt(r["kvattn"])), flush=True)
        del q4, k4, v4, qk, kk, vk
        torch.cuda.empty_cache()
    return rows


# --------------------------------------------------------------------------------------------------
# C1: cascade vs flat decode


def c1(b, kvattn, prefixes, batches):
    torch = b.torch
    H, D = HEADS, HEAD_DIM
    rows = []
    gen = torch.Generator(device="cpu").manual_seed(b.args.seed + 1)
    for P in prefixes:
        for B in batches:
            r = dict(prefix=P, batch=B, cascade=None, flat=None, err=None, plan_cascade_us=None, plan_flat_us=None,
                     note="")
            try:
                np_pre, np_suf = P // PAGE, SUFFIX // PAGE
                num_pages = np_pre + B * np_suf
                order = torch.randperm(num_pages, generator=gen).to(torch.int32)
                pre, suf = order[:np_pre], order[np_pre:].view(B, np_suf)
                cache = torch.randn(num_pages, 2, PAGE, H, D, generator=gen).to(b.dev, torch.bfloat16)
                q = torch.randn(B, H, D, generator=gen).to(b.dev, torch.bfloat16)
                full = torch.ones(1, dtype=torch.int32) * PAGE
                # flat: every request's table is the shared prefix pages, then its own suffix pages
                f_indptr = torch.arange(B + 1, dtype=torch.int32) * (np_pre + np_suf)
                f_indices = torch.cat([torch.cat([pre, suf[i]]) for i in range(B)])
                f_last = full.repeat(B)
                flat = kvattn.BatchDecodeWithPagedKVCacheWrapper(
                    torch.empty(256 << 20, dtype=torch.uint8, device=b.dev), "NHD")

                def plan_flat():
                    flat.plan(f_indptr, f_indices, f_last, H, H, D, PAGE, q_data_type=torch.bfloat16,
                              kv_data_type=torch.bfloat16, num_pages=num_pages)
                try:
                    plan_flat()
                except kvattn.WorkspaceTooSmallError as e:  # a larger workspace, once
                    flat.reset_workspace_buffer(torch.empty(e.needed_bytes, dtype=torch.uint8, device=b.dev))
                    plan_flat()
                r["plan_flat_us"] = b.host_time(plan_flat)
                casc = kvattn.MultiLevelCascadeAttentionWrapper(
                    2, torch.empty(512 << 20, dtype=torch.uint8, device=b.dev), "NHD")
                qo = [torch.tensor([0, B], dtype=torch.int32), torch.arange(B + 1, dtype=torch.int32)]
                kv_indptr = [torch.tensor([0, np_pre], dtype=torch.int32),
                             torch.arange(B + 1, dtype=torch.int32) * np_suf]
                kv_indices = [pre, suf.reshape(-1)]
                kv_last = [full, full.repeat(B)]

                def plan_casc():
                    casc.plan(qo, kv_indptr, kv_indices, kv_last, H, H, D, PAGE, q_data_type=torch.bfloat16,
                              kv_data_type=torch.bfloat16)
                try:
                    plan_casc()
                except kvattn.WorkspaceTooSmallError as e:  # the workspace is split evenly between the 2 levels
                    casc.reset_workspace_buffer(torch.empty(2 * e.needed_bytes + 512, dtype=torch.uint8,
                                                            device=b.dev))
                    plan_casc()
                r["plan_cascade_us"] = b.host_time(plan_casc)
                of = flat.run(q, cache)
                oc = casc.run(q, cache)
                torch.cuda.synchronize()
                r["err"] = (of.float() - oc.float()).abs().max().item()
                r["flat"] = b.time_cold(lambda: flat.run(q, cache))
                r["cascade"] = b.time_cold(lambda: casc.run(q, cache))
                del cache, q, flat, casc
            except Exception as e:
                r["note"] += short(e)
                print("C1 prefix %d batch %d: %s" % (P, B, short(e)), flush=True)
                if os.environ.get("KVA_BENCH_TRACE"):
                    traceback.print_exc()
            rows.append(r)
            print("C1 prefix %5d batch %3d: cascade %s flat %s us" % (P, B, fmt(r["cascade"]), fmt(r["flat"])),
                  flush=True)
            torch.cuda.empty_cache()
    return rows


# --------------------------------------------------------------------------------------------------
# Report


def fmt(x, f="%.1f"):
    return "-" if x is None else f % x


def ratio(peer, mine):
    return "%.2fx" % (peer / mine) if peer and mine else "-"


def report(b, c2_rows, c1_rows, versions):
    lines = ["# kvattn composable formats (C1 cascade, C2 block-sparse decode) vs peers", ""]
    lines += versions
    lines.append("cold L2 (%d MB overwrite before each call), CUDA events, median of %d; ratios = peer time / kvattn "
                 "time (> 1: kvattn faster)" % (b.args.flush_mb, b.args.iters))
    lines.append("")
    csv_rows = []
    if c2_rows:
        lines.append("## C2: Quest-like block-sparse decode (batch 1, MHA 32/32, D 128, bf16, page 16)")
        lines.append("")
        lines.append("| seq | budget pages | dense cuDNN us | dense flash us | Flex us | kvattn us | kvattn GB/s | "
                     "vs dense-best | vs Flex | kvattn max err | Flex max err | plan us | notes |")
        lines.append("|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|")
        for r in c2_rows:
            dense = [x for x in (r.get("cudnn"), r.get("flash")) if x]
            best = min(dense) if dense else None
            k = r.get("kvattn")
            gbs = (r["budget"] * PAGE * HEADS * HEAD_DIM * 2 * 2 / (k * 1e-6) / 1e9) if k else None
            lines.append("| %d | %d | %s | %s | %s | %s | %s | %s | %s | %s | %s | %s | %s |" % (
                r["seq"], r["budget"], fmt(r.get("cudnn")), fmt(r.get("flash")), fmt(r.get("flex")), fmt(k),
                fmt(gbs, "%.0f"), ratio(best, k), ratio(r.get("flex"), k), fmt(r.get("kvattn_err"), "%.2e"),
                fmt(r.get("flex_err"), "%.2e"), fmt(r.get("plan_us")), r.get("note", "").strip()))
            csv_rows.append(("C2", r["seq"], r["budget"], "", "", r.get("cudnn"), r.get("flash"), r.get("flex"), k,
                             "", "", r.get("kvattn_err"), r.get("note", "").strip()))
        lines.append("")
    if c1_rows:
        lines.append("## C1: cascade (MHA 32/32, D 128, page 16, suffix %d, one decode token per request)" % SUFFIX)
        lines.append("")
        lines.append("| shared prefix | batch | cascade us | flat decode us | cascade speedup (flat / cascade) | "
                     "max diff | plan cascade us | plan flat us | notes |")
        lines.append("|---:|---:|---:|---:|---:|---:|---:|---:|---|")
        for r in c1_rows:
            lines.append("| %d | %d | %s | %s | %s | %s | %s | %s | %s |" % (
                r["prefix"], r["batch"], fmt(r["cascade"]), fmt(r["flat"]), ratio(r["flat"], r["cascade"]),
                fmt(r["err"], "%.2e"), fmt(r["plan_cascade_us"]), fmt(r["plan_flat_us"]), r["note"].strip()))
            csv_rows.append(("C1", "", "", r["prefix"], r["batch"], "", "", "", "", r["cascade"], r["flat"], r["err"],
                             r["note"].strip()))
        lines.append("")
    header = ("workload,seq,budget,prefix,batch,dense_cudnn_us,dense_flash_us,flex_us,kvattn_bsr_us,"
              "kvattn_cascade_us,kvattn_flat_us,max_err,note")
    def cell(x):
        if x is None or x == "":
            return ""
        if isinstance(x, float):
            return "%.4g" % x
        if isinstance(x, str):
            return '"%s"' % x.replace('"', "'")
        return str(x)
    csv_text = header + "\n" + "".join(",".join(cell(x) for x in row) + "\n" for row in csv_rows)
    return "\n".join(lines) + "\n", csv_text


def main(argv=None):
    args = parse_args(argv)
    if args.lib:
        os.environ["KVATTN_LIBRARY"] = os.path.abspath(args.lib)
    elif "KVATTN_LIBRARY" not in os.environ and (REPO / "build-cuda" / "libkvattn.so").exists():
        os.environ["KVATTN_LIBRARY"] = str(REPO / "build-cuda" / "libkvattn.so")
    sys.path.insert(0, str(REPO / "python"))
    import torch
    import kvattn

    if not torch.cuda.is_available():
        print("peers_formats.py: needs a CUDA GPU (torch.cuda.is_available() is False)", file=sys.stderr)
        return 2
    seqs, budgets, prefixes, batches = SEQS, BUDGETS, PREFIXES, BATCHES
    if args.quick:
        seqs, budgets, prefixes, batches = QUICK["seqs"], QUICK["budgets"], QUICK["prefixes"], QUICK["batches"]
    b = Bench(args)

    flex = create_block_mask = None
    flex_note = "not run (--no-flex)"
    if not args.no_flex and not args.no_c2:
        try:
            import torch._dynamo

            for name in ("cache_size_limit", "recompile_limit"):
                if hasattr(torch._dynamo.config, name):
                    setattr(torch._dynamo.config, name, 64)
            from torch.nn.attention.flex_attention import create_block_mask, flex_attention

            flex = torch.compile(flex_attention, dynamic=False)
            flex_note = "compiled flex_attention"
        except Exception as e:
            flex_note = "not importable (%s)" % short(e)
            print("FlexAttention unavailable: %s" % short(e), flush=True)

    commit = os.environ.get("KVA_COMMIT", "")
    if not commit:
        try:
            commit = subprocess.check_output(["git", "-C", str(REPO), "rev-parse", "--short", "HEAD"],
                                             stderr=subprocess.DEVNULL).decode().strip()
        except Exception:
            commit = "unknown"
    try:
        kv_version = kvattn.__version__
    except Exception:
        kv_version = "?"
    versions = [
        "device: %s; torch %s (CUDA %s); cuDNN %s; FlexAttention: %s" % (
            torch.cuda.get_device_name(0), torch.__version__, torch.version.cuda, torch.backends.cudnn.version(),
            flex_note),
        "kvattn %s (library %s); commit %s; date %s" % (
            kv_version, os.environ.get("KVATTN_LIBRARY", "package default"), commit,
            datetime.datetime.now().strftime("%Y-%m-%d %H:%M")),
    ]
    for v in versions:
        print(v, flush=True)
    # preflight: the library must run block-sparse attention on this GPU
    try:
        ws = torch.empty(16 << 20, dtype=torch.uint8, device="cuda")
        w = kvattn.BlockSparseAttentionWrapper(ws)
        w.plan(torch.tensor([0, 1], dtype=torch.int32), torch.tensor([0], dtype=torch.int32), 1, 16, 1, 16, 8, 8,
               128, q_data_type=torch.bfloat16, o_data_type=torch.bfloat16)
        x = torch.randn(16, 8, 128, device="cuda", dtype=torch.bfloat16)
        w.run(x[:1], x, x)
        torch.cuda.synchronize()
    except Exception as e:
        print("WARNING: kvattn preflight failed (%s); kvattn columns will be empty" % short(e), flush=True)

    c2_rows, c1_rows = [], []
    if not args.no_c2:
        c2_rows = c2(b, kvattn, flex, create_block_mask, seqs, budgets)
    if not args.no_c1:
        c1_rows = c1(b, kvattn, prefixes, batches)
    text, csv_text = report(b, c2_rows, c1_rows, versions)
    sys.stdout.write("\n" + text)
    if args.out:
        with open(args.out, "w") as fh:
            fh.write(csv_text if args.out.endswith(".csv") else text)
    if args.csv:
        with open(args.csv, "w") as fh:
            fh.write(csv_text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
