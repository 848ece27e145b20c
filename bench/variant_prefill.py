"""variant_prefill.py - prefill with a user variant on the GPU: the tensor-core kernel (variants without query / key
transforms) against the CUDA-core kernel (the same variant plus an identity query transform, which keeps it there)
and against kvattn's built-in attention of the same shape.

    PYTHONPATH=python KVATTN_LIBRARY=build-dev/libkvattn.so python3 bench/variant_prefill.py [--len 4096] [--csv F]

Single request, causal, bf16, GQA 32/8, head dim 128 (the P1 shape at batch 1). Cold L2 (a 512 MB buffer is
overwritten before every timed call), CUDA events, median of --iters calls after 3 warm-ups. TFLOP/s from the causal
FLOP count (qo = kv = L: L^2 H_q (D_qk + D_vo)). Prints one markdown table.
"""

import argparse
import os
import statistics
import sys

import torch

import kvattn

HERE = os.path.dirname(os.path.abspath(__file__))
EX = os.path.join(HERE, "..", "examples", "variants")

IDENTITY_Q = """
KVA_HOOK float kva_query_transform(const kva_vparams* p, float q, int batch, int qo_head, int q_pos, int dim) {
    (void)p, (void)batch, (void)qo_head, (void)q_pos, (void)dim;
    return q;
}
"""


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--len", type=int, default=4096)
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--csv", default=None)
    args = ap.parse_args()
    dev = torch.device("cuda")
    L, HQ, HK, D = args.len, 32, 8, 128
    g = torch.Generator(device=dev).manual_seed(7)
    q = torch.randn(L, HQ, D, device=dev, dtype=torch.bfloat16, generator=g)
    k = torch.randn(L, HK, D, device=dev, dtype=torch.bfloat16, generator=g)
    v = torch.randn(L, HK, D, device=dev, dtype=torch.bfloat16, generator=g)
    sink_t = torch.randn(HQ, device=dev, dtype=torch.float32, generator=g)
    flush = torch.empty(512 << 20, dtype=torch.uint8, device=dev)
    flops = float(L) * L * HQ * (D + D)

    sink_src = open(os.path.join(EX, "attention_sink.c")).read()
    sig_src = open(os.path.join(EX, "flash_sigmoid.c")).read()
    sink = kvattn.Variant(sink_src, ["output"], num_tensors=1, name="bench_sink")
    sink_cc = kvattn.Variant(sink_src + IDENTITY_Q, ["output", "query"], num_tensors=1, name="bench_sink_q")
    sig = kvattn.Variant(sig_src, ["logits"], use_softmax=False, num_scalars=2, name="bench_sigmoid")
    sig_cc = kvattn.Variant(sig_src + IDENTITY_Q, ["logits", "query"], use_softmax=False, num_scalars=2,
                            name="bench_sigmoid_q")
    sig_scal = [1.0 / D ** 0.5, -1.0]

    cases = [
        ("built-in causal softmax", "Hopper / mma.sync mainloop", dict()),
        ("attention sink (output)", "tensor-core (mma.sync)", dict(variant=sink, variant_tensors=[sink_t])),
        ("attention sink + identity q", "CUDA-core", dict(variant=sink_cc, variant_tensors=[sink_t])),
        ("flash sigmoid (logits)", "tensor-core (mma.sync)", dict(variant=sig, variant_scalars=sig_scal)),
        ("flash sigmoid + identity q", "CUDA-core", dict(variant=sig_cc, variant_scalars=sig_scal)),
    ]
    rows = []
    outs = {}
    for name, path, kw in cases:
        def call():
            return kvattn.single_prefill_with_kv_cache(q, k, v, causal=True, **kw)
        for _ in range(3):
            o = call()
        torch.cuda.synchronize()
        outs[name] = o.float()
        times = []
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        for _ in range(args.iters):
            flush.fill_(1)
            e0.record()
            call()
            e1.record()
            torch.cuda.synchronize()
            times.append(e0.elapsed_time(e1) * 1e3)
        us = statistics.median(times)
        rows.append((name, path, us, flops / us * 1e-6))
    # the two routes of one variant must agree (same math, different kernels)
    for a, b in (("attention sink (output)", "attention sink + identity q"),
                 ("flash sigmoid (logits)", "flash sigmoid + identity q")):
        d = (outs[a] - outs[b]).abs().max().item()
        print("max |o(%s) - o(%s)| = %.3e" % (a, b, d))
    print("device: %s; torch %s; L = %d, GQA %d/%d, head dim %d, bf16, causal; cold L2, median of %d" %
          (torch.cuda.get_device_name(), torch.__version__, L, HQ, HK, D, args.iters))
    print()
    print("| case | kernel | time us | TFLOP/s |")
    print("|---|---|---:|---:|")
    for r in rows:
        print("| %s | %s | %.1f | %.1f |" % r)
    if args.csv:
        with open(args.csv, "w") as f:
            f.write("case,kernel,us,tflops\n")
            for r in rows:
                f.write("%s,%s,%.2f,%.2f\n" % r)
    for vv in (sink, sink_cc, sig, sig_cc):
        vv.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
