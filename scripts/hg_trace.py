#!/usr/bin/env python3
"""hg_trace.py - sums up a head-group kernel trace (kva_decode_hg.cuh built with KVA_HG_TRACE; bench_decode.c --trace
with KVATTN_BENCH_TRACE_HG=1 and KVA_BENCH_TRACE_DIR writes hgtrace_*.csv: per CTA, 512 slots).

usage: hg_trace.py FILE.csv STAGES PARTS STAGE_BYTES [--np PRODUCERS] [--cta N]

Slots (see the kernel): 0 SM clock at start, 1 global timer at start, 2 / 3 clock and timer at the consumers' end, 4 SM
id, 5 subtiles of the worker, 6 clock after the prologue; subtile c < 80 at 8 + 6 c: producer before its empty wait,
after it, after the fault word and expect_tx arrival, after the copies' issue; head / slot 0's consumer after its full
wait, at its release. Times in ns (SM clock / GHz from the
CTA's own clock and timer spans).
"""
import statistics as st
import sys


def med(v):
    return st.median(v) if v else float("nan")


def main():
    a = sys.argv[1:]
    if len(a) < 4:
        print(__doc__)
        return 2
    fn, S, P, SB = a[0], int(a[1]), int(a[2]), int(a[3])
    show = int(a[a.index("--cta") + 1]) if "--cta" in a else -1
    NP = int(a[a.index("--np") + 1]) if "--np" in a else 1
    rows = []
    for line in open(fn):
        f = [int(x) for x in line.strip().split(",")]
        rows.append((f[0], f[1:]))
    per = {k: [] for k in ("issue_gap", "p_flag_arrive", "p_copies", "p_loop", "prod_wait", "issue_to_cons", "cons_busy", "cons_idle", "rel_to_reissue",
                           "prologue", "first_data", "rate_gbs", "span_us", "tail_us")}
    g0 = min(t[1] for _, t in rows if t[1])
    gend = max(t[3] for _, t in rows if t[3])
    for b, t in rows:
        if not t[1] or not t[3] or t[3] <= t[1]:
            continue
        ghz = (t[2] - t[0]) / (t[3] - t[1])
        n = min(t[5], 80)
        ns = lambda x: x / ghz
        P0 = [t[8 + 6 * c] for c in range(n)]
        P1 = [t[9 + 6 * c] for c in range(n)]
        P2 = [t[10 + 6 * c] for c in range(n)]
        P3 = [t[11 + 6 * c] for c in range(n)]
        C0 = [t[12 + 6 * c] for c in range(n)]
        C1 = [t[13 + 6 * c] for c in range(n)]
        per["prologue"].append(ns(t[6] - t[0]))
        per["span_us"].append((t[3] - t[1]) / 1e3)
        per["tail_us"].append((gend - t[3]) / 1e3)
        if n and C0[0]:
            per["first_data"].append(ns(C0[0] - t[0]))
        per["rate_gbs"].append(t[5] * SB / (t[3] - t[1]))
        lo = S if n > 2 * S else 1
        v = {k: [] for k in per}
        for c in range(lo, n):
            if P1[c] and P1[c - 1]:
                v["issue_gap"].append(ns(P1[c] - P1[c - 1]))
            if P1[c] and P0[c]:
                v["prod_wait"].append(ns(P1[c] - P0[c]))
            if P2[c] and P1[c]:
                v["p_flag_arrive"].append(ns(P2[c] - P1[c]))
            if P3[c] and P2[c]:
                v["p_copies"].append(ns(P3[c] - P2[c]))
            if c + NP < n and P0[c + NP] and P3[c]:
                v["p_loop"].append(ns(P0[c + NP] - P3[c]))
            if C0[c] and P1[c]:
                v["issue_to_cons"].append(ns(C0[c] - P1[c]))
            if C1[c] and C0[c]:
                v["cons_busy"].append(ns(C1[c] - C0[c]))
            if c >= P and C0[c] and C1[c - P]:
                v["cons_idle"].append(ns(C0[c] - C1[c - P]))
            if c + S < n and P1[c + S] and C1[c]:
                v["rel_to_reissue"].append(ns(P1[c + S] - C1[c]))
        for k in ("issue_gap", "p_flag_arrive", "p_copies", "p_loop", "prod_wait", "issue_to_cons", "cons_busy", "cons_idle", "rel_to_reissue"):
            if v[k]:
                per[k].append(med(v[k]))
        if b == show:
            print(f"CTA {b} (SM {t[4]}), {t[5]} subtiles, {ghz:.2f} GHz; ns since start: c P0 P1 P2 P3 C0 C1")
            for c in range(min(n, 2 * S + 4)):
                print(f"  {c:3d} " + " ".join(f"{ns(x - t[0]) if x else float('nan'):8.0f}" for x in
                                             (P0[c], P1[c], P2[c], P3[c], C0[c], C1[c])))
    print(f"{fn}: {len(per['span_us'])} CTAs, kernel span {(gend - g0) / 1e3:.2f} us; stages {S}, parts {P}, "
          f"{SB} B a stage")
    for k, u in (("span_us", "us"), ("tail_us", "us (end of the last CTA - this CTA's end)"), ("rate_gbs", "GB/s"),
                 ("prologue", "ns"), ("first_data", "ns (start -> slot 0's first full wait)"),
                 ("issue_gap", "ns between issues"), ("prod_wait", "ns producer waits on empty"),
                 ("p_flag_arrive", "ns fault word + expect_tx"), ("p_copies", "ns issuing the copies"),
                 ("p_loop", "ns copies issued -> the producer's next subtile"),
                 ("issue_to_cons", "ns issue -> consumer has the stage"), ("cons_busy", "ns a stage's compute"),
                 ("cons_idle", "ns consumer waits for data"), ("rel_to_reissue", "ns release -> the slot refilled")):
        x = sorted(per[k])
        if x:
            print(f"  {k:15s} median {med(x):9.1f}  p10 {x[len(x) // 10]:9.1f}  p90 {x[9 * len(x) // 10]:9.1f}  {u}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
