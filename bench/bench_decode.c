/*
 * bench_decode.c - kvattn batch decode on the GPU over ../shared/WORKLOADS.md D1-D7.
 *
 * Cold L2 (a 512 MB buffer is overwritten before every timed launch), CUDA events around each launch,
 * median of --iters (default 30) after 3 warm-ups; plan() is outside the timing and reported separately.
 * Bytes = sum_i kv_i * H_kv * (D_qk + D_vo) * bytes(kv) + q + o bytes. Bandwidth against the nominal HBM of
 * the device (H100 3.35 TB/s, H200 4.8 TB/s, else --hbm or the memory clock x bus width).
 *
 * Output: one line per workload on stdout, and with --csv FILE a CSV that bench/peers_decode.py reads to run
 * the peers on the same shapes (the KV lengths of every request are in the CSV).
 *
 * Bounds check (--bounds-check, on by default; --no-bounds-check-ab 0 turns it off): D1 64 x 8k and D5 (page 16
 * and 1) are also timed with a second context whose kernels are built without the page-index check
 * (KVATTN_BENCH_NO_BOUNDS_CHECK=1, NVRTC), interleaving the two plans launch by launch; the cost is reported as
 * (checked - unchecked) / unchecked of the medians.
 *
 * usage: kva_bench_decode [--iters N] [--csv FILE] [--only 'A|B' (substrings of name, group or shape)] [--quick]
 *                         [--no-bounds-check-ab 0|1] [--ab-env VAR[=VALUE]] [--ab-only 'A|B'] [--ab-layout] [--trace 'A|B']
 *                         [--extra] (small eager "X1" and graph "X7" shapes, only with this flag)
 * --ab-env: the A/B's second arm is a context created with VAR set; --ab-layout: the second arm runs the same plan
 * on the same pools read as HND (no second context).
 * Probes (environment): KVATTN_BENCH_PAGE_SIZE=N pools of N-token pages (KVATTN_BENCH_PAGES_SEQ=1: each request's pages
 * in pool order), KVATTN_BENCH_LAYOUT_HND=1 HND pools, KVATTN_BENCH_FIXED_SPLIT=N eager plans with KV chunks of N tokens,
 * KVATTN_BENCH_FLUSH=read a flush that reads 537 MB (a kvattn decode call; clean L2) instead of writing 512 MB,
 * KVATTN_BENCH_SHAPES="HQ/HKV:BxL[:dD][:pP][:e4m3|:e5m2],..." extra rows (group XS).
 * bench/decode_interleaved.py times kvattn and cuDNN in one process under either flush.
 */
#define _POSIX_C_SOURCE 200809L
#include <cuda_runtime_api.h>
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "bench_util.h"
#include "kvattn.h"


typedef struct wl {
    char name[64];
    char label[96];
    int hq, hkv, d;
    kva_dtype kv;
    int page_size;
    int batch;
    int* lens;
    int graph;  /* D7: time graph replays */
    int layers; /* D7 "32 layers" rows: one graph of this many calls on separate K/V pools, timed per call */
    int pdl;    /* kva_run_args.enable_pdl (D7 "32 layers, PDL" rows; KVATTN_BENCH_PDL=1: every row) */
    int mixed;  /* "32 layers" rows (group MX): each layer runs an fp8-KV call of the same shape (another kernel) first */
    char group[16];
} wl;


static wl* wls;
static int nwl, capwl;

static wl* add(const char* group, const char* name, int hq, int hkv, int d, kva_dtype kv, int ps, int batch) {
    if (nwl == capwl) {
        capwl = capwl ? 2 * capwl : 64;
        wls = (wl*)realloc(wls, sizeof(wl) * (size_t)capwl);
    }
    wl* w = &wls[nwl++];
    memset(w, 0, sizeof *w);
    snprintf(w->group, sizeof w->group, "%s", group);
    snprintf(w->name, sizeof w->name, "%s", name);
    w->hq = hq;
    w->hkv = hkv;
    w->d = d;
    w->kv = kv;
    w->page_size = ps;
    w->batch = batch;
    w->lens = (int*)calloc((size_t)batch, sizeof(int));
    return w;
}
static void uniform(wl* w, int len) {
    for (int i = 0; i < w->batch; ++i) w->lens[i] = len;
    snprintf(w->label, sizeof w->label, "%d x %d", w->batch, len);
}

static void build_workloads(int quick, int extra) {
    static const int d1[][2] = {{1, 1024},  {1, 4096},  {1, 32768}, {1, 131072}, {16, 1024}, {16, 4096},
                                {64, 1024}, {64, 4096}, {64, 8192}, {128, 2048}, {256, 2048}};
    for (size_t i = 0; i < sizeof d1 / sizeof d1[0]; ++i) {
        if (quick && d1[i][1] * d1[i][0] > 300000) continue;
        wl* w = add("D1", "D1 GQA 32/8", 32, 8, 128, KVA_DTYPE_BF16, 16, d1[i][0]);
        uniform(w, d1[i][1]);
    }
    wl* w = add("D2", "D2 MHA 32/32", 32, 32, 128, KVA_DTYPE_BF16, 16, 16);
    uniform(w, 8192);
    w = add("D2", "D2 MHA 32/32", 32, 32, 128, KVA_DTYPE_BF16, 16, 64);
    uniform(w, 2048);
    w = add("D3", "D3 GQA 32/4", 32, 4, 128, KVA_DTYPE_BF16, 16, 64);
    uniform(w, 1024);
    if (!quick) {
        w = add("D3", "D3 GQA 32/4", 32, 4, 128, KVA_DTYPE_BF16, 16, 64);
        uniform(w, 8192);
    }
    /* D4 ragged, each followed by the equal-length batch of the same bytes */
    rng = 1;
    w = add("D4", "D4 uniform[512,1024]", 32, 8, 128, KVA_DTYPE_BF16, 16, 16);
    for (int i = 0; i < 16; ++i) w->lens[i] = 512 + (int)(xs() % 513);
    snprintf(w->label, sizeof w->label, "16 ragged");
    /* Zipf-skewed, exponent 1.2, seed 1, scaled to mean 1024 */
    w = add("D4", "D4 zipf s=1.2 mean 1024", 32, 8, 128, KVA_DTYPE_BF16, 16, 16);
    {
        double raw[16], sum = 0;
        for (int i = 0; i < 16; ++i) {
            /* inverse-CDF sample of a bounded Pareto-like tail: rank weights k^-1.2 shuffled by the seed */
            int k = 1 + (int)(xs() % 64);
            raw[i] = pow((double)k, -1.2);
            sum += raw[i];
        }
        for (int i = 0; i < 16; ++i) {
            int l = (int)llround(raw[i] / sum * 16 * 1024);
            w->lens[i] = l < 1 ? 1 : l;
        }
    }
    snprintf(w->label, sizeof w->label, "16 zipf");
    w = add("D4", "D4 1x32k + 63x512", 32, 8, 128, KVA_DTYPE_BF16, 16, 64);
    w->lens[0] = 32768;
    for (int i = 1; i < 64; ++i) w->lens[i] = 512;
    snprintf(w->label, sizeof w->label, "64 skewed");
    if (!quick) {
        w = add("D4", "D4 uniform[4096,16384]", 32, 8, 128, KVA_DTYPE_BF16, 16, 128);
        for (int i = 0; i < 128; ++i) w->lens[i] = 4096 + (int)(xs() % (16384 - 4096 + 1));
        snprintf(w->label, sizeof w->label, "128 ragged");
    }
    /* equal-length twins of the D4 cases */
    int n4 = nwl;
    for (int i = 0; i < n4; ++i) {
        if (strcmp(wls[i].group, "D4") != 0) continue;
        long long tot = 0;
        for (int b = 0; b < wls[i].batch; ++b) tot += wls[i].lens[b];
        char nm[64];
        snprintf(nm, sizeof nm, "D4eq %s", wls[i].name + 3);
        wl* e = add("D4eq", nm, 32, 8, 128, KVA_DTYPE_BF16, 16, wls[i].batch);
        uniform(e, (int)(tot / wls[i].batch));
    }
    w = add("D5", "D5 page 16", 32, 8, 128, KVA_DTYPE_BF16, 16, 64);
    uniform(w, 4096);
    w = add("D5", "D5 page 1", 32, 8, 128, KVA_DTYPE_BF16, 1, 64);
    uniform(w, 4096);
    w = add("D6", "D6 fp8 e4m3", 32, 8, 128, KVA_DTYPE_E4M3, 16, 64);
    uniform(w, 4096);
    w = add("D6", "D6 fp8 e4m3", 32, 8, 128, KVA_DTYPE_E4M3, 16, 1);
    uniform(w, 32768);
    w = add("D7", "D7 graph replay", 32, 8, 128, KVA_DTYPE_BF16, 16, 1);
    uniform(w, 1024);
    w->graph = 1;
    w = add("D7", "D7 graph replay", 32, 8, 128, KVA_DTYPE_BF16, 16, 16);
    uniform(w, 1024);
    w->graph = 1;
    /* a decode step's attention layers in one graph: 32 calls of the same plan, each on its own K/V pools (a
       layer's cache: 32 x 4.2 MB at 1 x 1k, more than the L2), time per layer */
    for (int b = 1; b <= 16; b += 15) {
        w = add("D7", "D7 graph, 32 layers", 32, 8, 128, KVA_DTYPE_BF16, 16, b);
        uniform(w, 1024);
        w->graph = 1;
        w->layers = 32;
    }
    /* the same with programmatic dependent launch (kva_run_args.enable_pdl): each call's CTAs start while the
       previous call finishes (the SDPA peers have no such switch) */
    for (int b = 1; b <= 16; b += 15) {
        w = add("D7", "D7 graph, 32 layers, PDL", 32, 8, 128, KVA_DTYPE_BF16, 16, b);
        uniform(w, 1024);
        w->graph = 1;
        w->layers = 32;
        w->pdl = 1;
    }
    /* a decode step where other kernels run between the attention calls: each layer first runs an fp8-KV call of
       the same shape (a different kernel), so the measured kernel's code is no longer the last one the SMs ran;
       time per layer = both calls (kvattn only) */
    for (int pdl = 0; pdl <= 1; ++pdl) {
        w = add("MX", pdl ? "D7 32 layers + fp8 call, PDL" : "D7 32 layers + fp8 call", 32, 8, 128, KVA_DTYPE_BF16,
                16, 1);
        uniform(w, 1024);
        w->graph = 1;
        w->layers = 32;
        w->pdl = pdl;
        w->mixed = 1;
    }
    if (extra) { /* --extra: head dims 256 (GQA 16/8, "X8") and 64 (GQA 64/8, "X6"), the shapes of several 256- and
                    64-dim models, with 16-bit and fp8 KV */
        static const int x8[][2] = {{1, 1024}, {1, 4096}, {4, 1024}, {16, 1024}, {1, 32768}, {16, 4096}, {64, 4096}};
        static const char* const xn[2][2][2] = {{{"X6 d64 GQA 64/8", "X6 d64 fp8 e4m3 GQA 64/8"},
                                                  {"X6 graph d64 GQA 64/8", "X6 graph d64 fp8 e4m3 GQA 64/8"}},
                                                 {{"X8 d256 GQA 16/8", "X8 d256 fp8 e4m3 GQA 16/8"},
                                                  {"X8 graph d256 GQA 16/8", "X8 graph d256 fp8 e4m3 GQA 16/8"}}};
        for (int x = 0; x < 2; ++x) {
            const int d = x ? 256 : 64, hq = x ? 16 : 64;
            for (int f = 0; f < 2; ++f)
                for (size_t i = 0; i < sizeof x8 / sizeof x8[0]; ++i) {
                    w = add(x ? "X8" : "X6", xn[x][0][f], hq, 8, d, f ? KVA_DTYPE_E4M3 : KVA_DTYPE_BF16, 16, x8[i][0]);
                    uniform(w, x8[i][1]);
                }
            for (int f = 0; f < 2; ++f) { /* and one graph-replayed small call of each */
                w = add(x ? "X8" : "X6", xn[x][1][f], hq, 8, d, f ? KVA_DTYPE_E4M3 : KVA_DTYPE_BF16, 16, 1);
                uniform(w, 1024);
                w->graph = 1;
            }
        }
    }
    {
        /* KVATTN_BENCH_SHAPES="HQ/HKV:BxL[:dD][:pP][:e4m3|:e5m2],..." (probe): extra rows, group "XS"; head dim D
           (default 128), page size P (default 16), KV dtype (default bf16) */
        const char* xs = getenv("KVATTN_BENCH_SHAPES");
        char buf[1024];
        snprintf(buf, sizeof buf, "%s", xs ? xs : "");
        char* save = NULL;
        for (char* t = strtok_r(buf, ",", &save); t; t = strtok_r(NULL, ",", &save)) {
            int hq = 0, hk = 0, b = 0, l = 0, d = 128, ps = 16, n = 0;
            kva_dtype kv = KVA_DTYPE_BF16;
            int ok = sscanf(t, "%d/%d:%dx%d%n", &hq, &hk, &b, &l, &n) == 4 && hq > 0 && hk > 0 && hq % hk == 0 &&
                     b > 0 && l > 0;
            for (const char* o = t + n; ok && *o;) {
                int m = 0;
                if (*o++ != ':') ok = 0;
                else if (sscanf(o, "d%d%n", &d, &m) == 1 || sscanf(o, "p%d%n", &ps, &m) == 1) o += m;
                else if (!strncmp(o, "e4m3", 4)) { kv = KVA_DTYPE_E4M3; o += 4; }
                else if (!strncmp(o, "e5m2", 4)) { kv = KVA_DTYPE_E5M2; o += 4; }
                else ok = 0;
            }
            if (!ok || d <= 0 || ps <= 0) {
                fprintf(stderr, "KVATTN_BENCH_SHAPES: skipping '%s'\n", t);
                continue;
            }
            char nm[64];
            snprintf(nm, sizeof nm, "XS GQA %d/%d d%d p%d %s", hq, hk, d, ps, kva_dtype_name(kv));
            w = add("XS", nm, hq, hk, d, kv, ps, b);
            uniform(w, l);
        }
    }
    if (extra) { /* --extra: small GQA 32/8 shapes around the planner's shortest chunk, eager ("X1") and graph ("X7") */
        static const int xs_[][2] = {{1, 256}, {1, 512}, {1, 2048}, {1, 8192}, {2, 1024}, {4, 1024}, {8, 512}, {2, 2048}};
        for (int gph = 0; gph < 2; ++gph)
            for (size_t i = 0; i < sizeof xs_ / sizeof xs_[0]; ++i) {
                w = add(gph ? "X7" : "X1", gph ? "X7 graph GQA 32/8" : "X1 GQA 32/8", 32, 8, 128, KVA_DTYPE_BF16, 16,
                        xs_[i][0]);
                uniform(w, xs_[i][1]);
                w->graph = gph;
            }
    }
}


/* --only "A|B|...": any alternative is a substring of the name, group or shape */
static int matches(const char* only, const wl* w) {
    char buf[256];
    snprintf(buf, sizeof buf, "%s", only);
    for (char* tok = strtok(buf, "|"); tok; tok = strtok(NULL, "|"))
        if (strstr(w->name, tok) || strstr(w->group, tok) || strstr(w->label, tok)) return 1;
    return 0;
}

/* one workload's device buffers and plan */
typedef struct wl_run {
    void *k, *v, *q, *o, *lse;
    size_t pool_bytes;
    int* dind;
    kva_workspace ws;
    kva_plan plan;
    kva_run_args a;
    double bytes;
    float plan_us;
} wl_run;

static void wl_setup(kva_context* ctx, const wl* w, void* dsrc, size_t src_bytes, cudaStream_t s, wl_run* R,
                     const wl_run* share) {
    const int B = w->batch, HQ = w->hq, HK = w->hkv, D = w->d;
    /* KVATTN_BENCH_PAGE_SIZE=N (probe): every workload's pools with pages of N tokens (with KVATTN_BENCH_PAGES_SEQ=1
       and KVATTN_BENCH_LAYOUT_HND=1 and N >= the longest request, each head's K and V are one contiguous block, as
       the SDPA peers' [B, H, L, D] tensors are) */
    const char* pse = getenv("KVATTN_BENCH_PAGE_SIZE");
    const int ps = pse && atoi(pse) > 0 ? atoi(pse) : w->page_size;
    const size_t kes = kva_dtype_size(w->kv);
    memset(R, 0, sizeof *R);
    int* indptr = (int*)calloc((size_t)B + 1, sizeof(int));
    int* last = (int*)calloc((size_t)B, sizeof(int));
    long long tokens = 0;
    for (int b = 0; b < B; ++b) {
        int np = (w->lens[b] + ps - 1) / ps;
        indptr[b + 1] = indptr[b] + np;
        last[b] = w->lens[b] - (np - 1) * ps;
        tokens += w->lens[b];
    }
    const int64_t npages = indptr[B];
    if (share) { /* same pools and page table (another context's plan of the same workload) */
        R->k = share->k, R->v = share->v, R->q = share->q, R->o = share->o, R->lse = share->lse, R->dind = share->dind;
    } else {
        int* indices = (int*)malloc(sizeof(int) * (size_t)(npages > 0 ? npages : 1));
        for (int64_t i = 0; i < npages; ++i) indices[i] = (int)i;
        /* scattered pages; KVATTN_BENCH_PAGES_SEQ=1 (probe): each request's pages in pool order */
        const char* seq = getenv("KVATTN_BENCH_PAGES_SEQ");
        const int scatter = !(seq && seq[0] == '1');
        for (int64_t i = npages - 1; scatter && i > 0; --i) {
            int64_t j = (int64_t)(xs() % (uint64_t)(i + 1));
            int t = indices[i];
            indices[i] = indices[j];
            indices[j] = t;
        }
        const size_t pool_bytes = (size_t)npages * ps * HK * D * kes;
        R->pool_bytes = pool_bytes;
        CU(cudaMalloc(&R->k, pool_bytes));
        CU(cudaMalloc(&R->v, pool_bytes));
        for (size_t off = 0; off < pool_bytes; off += src_bytes) {
            size_t n = pool_bytes - off < src_bytes ? pool_bytes - off : src_bytes;
            CU(cudaMemcpy((char*)R->k + off, dsrc, n, cudaMemcpyDeviceToDevice));
            CU(cudaMemcpy((char*)R->v + off, (char*)dsrc + (src_bytes - n) / 2 / 16 * 16, n, cudaMemcpyDeviceToDevice));
        }
        if (kes == 1) { /* keep fp8 finite: bytes of bf16 randoms include NaN patterns; use fixed finite bytes */
            CU(cudaMemset(R->k, 0x11, pool_bytes));
            CU(cudaMemset(R->v, 0x22, pool_bytes));
        }
        CU(cudaMalloc(&R->q, (size_t)B * HQ * D * 2));
        CU(cudaMalloc(&R->o, (size_t)B * HQ * D * 2));
        CU(cudaMalloc(&R->lse, (size_t)B * HQ * 4));
        CU(cudaMemcpy(R->q, dsrc, (size_t)B * HQ * D * 2, cudaMemcpyDeviceToDevice));
        CU(cudaMalloc((void**)&R->dind, sizeof(int) * (size_t)(npages > 0 ? npages : 1)));
        CU(cudaMemcpy(R->dind, indices, sizeof(int) * (size_t)npages, cudaMemcpyHostToDevice));
        free(indices);
    }

    kva_attention_desc d;
    kva_attention_desc_init(&d, HQ, HK, D, KVA_DTYPE_BF16);
    d.kv_dtype = w->kv;
    kva_plan_params pp;
    kva_plan_params_init(&pp);
    pp.batch_size = B;
    pp.kv_indptr = indptr;
    pp.kv_last_page_len = last;
    pp.page_size = ps;
    pp.num_pages = npages;
    if (w->graph) {
        pp.graph_mode = 1;
        pp.max_batch_size = B;
    } else {
        /* KVATTN_BENCH_FIXED_SPLIT=N (probe): eager plans with KV chunks of N tokens (fixed_split_size) */
        const char* fs = getenv("KVATTN_BENCH_FIXED_SPLIT");
        if (fs && atoi(fs) > 0) pp.fixed_split_size = atoi(fs);
    }
    size_t db = 0, hb = 0;
    if (w->graph) KV(kva_workspace_bound(ctx, &d, KVA_OP_BATCH_DECODE, B, B, &db, &hb));
    else KV(kva_plan_workspace_size(ctx, &d, KVA_OP_BATCH_DECODE, &pp, &db, &hb));
    R->plan_us = bench_plan_median_us(ctx, &d, KVA_OP_BATCH_DECODE, &pp, db, hb, &R->ws, &R->plan, s);
    kva_run_args_init(&R->a);
    R->a.q = kva_tensor_make(R->q, KVA_DTYPE_BF16, 3, B, HQ, D, 0);
    R->a.o = kva_tensor_make(R->o, KVA_DTYPE_BF16, 3, B, HQ, D, 0);
    R->a.lse = kva_tensor_make(R->lse, KVA_DTYPE_F32, 2, B, HQ, 0, 0);
    {
        /* KVATTN_BENCH_LAYOUT_HND=1 (probe): the pools read as HND (a head's rows of a page as one block) */
        const char* hnd = getenv("KVATTN_BENCH_LAYOUT_HND");
        const kva_layout lay = hnd && hnd[0] == '1' ? KVA_LAYOUT_HND : KVA_LAYOUT_NHD;
        KV(kva_paged_kv_init(&R->a.paged, R->k, R->v, w->kv, lay, npages, ps, HK, D, D));
    }
    R->a.paged.indices = R->dind;
    R->a.stream = s;
    {
        const char* pe = getenv("KVATTN_BENCH_PDL");
        R->a.enable_pdl = w->pdl || (pe && pe[0] == '1');
    }
    R->bytes = (double)tokens * HK * 2 * D * kes + (double)B * HQ * D * 2 * 2;
    free(indptr);
    free(last);
}

static void wl_free(wl_run* R, int owns_buffers) {
    if (owns_buffers) {
        cudaFree(R->k);
        cudaFree(R->v);
        cudaFree(R->q);
        cudaFree(R->o);
        cudaFree(R->lse);
        cudaFree(R->dind);
    }
    cudaFree(R->ws.device);
    cudaFreeHost(R->ws.host);
}

static void* g_flush;
static size_t g_flush_bytes;
static cudaEvent_t g_e0, g_e1;
/* KVATTN_BENCH_FLUSH=read (probe): the flush before each timed call reads 537 MB (a decode call of 32 x 4096 on its own
   pools, through g_flush_ctx) instead of writing 512 MB, so the call starts under an L2 full of clean lines (the state
   after a layer's weight-reading GEMMs) rather than dirty ones that must be written back first */
static kva_context* g_flush_ctx;
static wl_run g_flush_run;
static int g_flush_read;

/* one cold-L2 timed launch (graph replay when exec != NULL), microseconds */
static float time_once(kva_context* ctx, wl_run* R, cudaGraphExec_t exec, cudaStream_t s, int it) {
    if (g_flush_read) {
        g_flush_run.a.stream = s;
        KV(kva_run(g_flush_ctx, &g_flush_run.plan, &g_flush_run.ws, &g_flush_run.a));
    } else {
        CU(cudaMemsetAsync(g_flush, it & 0xff, g_flush_bytes, s));
    }
    CU(cudaEventRecord(g_e0, s));
    if (exec) CU(cudaGraphLaunch(exec, s));
    else KV(kva_run(ctx, &R->plan, &R->ws, &R->a));
    CU(cudaEventRecord(g_e1, s));
    CU(cudaEventSynchronize(g_e1));
    float ms = 0;
    CU(cudaEventElapsedTime(&ms, g_e0, g_e1));
    return ms * 1000.0f;
}

static void csv_row(FILE* f, const wl* w, const char* name, const wl_run* R, double t_us) {
    if (!f) return;
    /* name and label are quoted: names hold commas ("D4 uniform[512,1024]") */
    fprintf(f, "%s,\"%s\",\"%s\",%d,%d,%d,%s,%d,%d,%.0f,%.2f,%.1f,", w->group, name, w->label, w->hq, w->hkv, w->d,
            kva_dtype_name(w->kv), w->page_size, w->batch, R->bytes, t_us, (double)R->plan_us);
    for (int b = 0; b < w->batch; ++b) fprintf(f, "%s%d", b ? ";" : "", w->lens[b]);
    fprintf(f, "\n");
    fflush(f);
}

/* one kva_run captured into a CUDA graph (D7 rows) */
static void capture_run(kva_context* ctx, wl_run* R, cudaStream_t s, cudaGraph_t* graph, cudaGraphExec_t* exec) {
    CU(cudaStreamSynchronize(s));
    CU(cudaStreamBeginCapture(s, cudaStreamCaptureModeThreadLocal));
    KV(kva_run(ctx, &R->plan, &R->ws, &R->a));
    CU(cudaStreamEndCapture(s, graph));
    CU(cudaGraphInstantiate(exec, *graph, 0));
}

/* D7 "32 layers" rows: L kva_run calls of one plan captured into one graph, call l on its own copy of the K/V pools
   (pools[2 (l - 1)], pools[2 (l - 1) + 1] for l >= 1; freed by the caller), as a decode step runs its layers */
static void capture_layers(kva_context* ctx, wl_run* R, int L, cudaStream_t s, cudaGraph_t* graph,
                           cudaGraphExec_t* exec, void** pools, const wl_run* other) {
    for (int l = 0; l < 2 * (L - 1); ++l) {
        CU(cudaMalloc(&pools[l], R->pool_bytes));
        CU(cudaMemcpy(pools[l], (l & 1) ? R->v : R->k, R->pool_bytes, cudaMemcpyDeviceToDevice));
    }
    CU(cudaStreamSynchronize(s));
    CU(cudaStreamBeginCapture(s, cudaStreamCaptureModeThreadLocal));
    for (int l = 0; l < L; ++l) {
        kva_run_args a = R->a;
        if (l > 0) {
            a.paged.k_data = pools[2 * (l - 1)];
            a.paged.v_data = pools[2 * (l - 1) + 1];
        }
        if (other) KV(kva_run(ctx, &other->plan, &other->ws, &other->a)); /* MX rows: another kernel first */
        KV(kva_run(ctx, &R->plan, &R->ws, &a));
    }
    CU(cudaStreamEndCapture(s, graph));
    CU(cudaGraphInstantiate(exec, *graph, 0));
}

/* Kernel timeline of one cold launch (tensor-core kernel built with KVA_TC_TRACE through NVRTC): per CTA, the SM
   clock at points of its first item (see kva_decode_tc.cuh) and the global timer at start and end. */
static void trace_workload(const kva_context_options* opt, const wl* w, const wl_run* R, void* dsrc, size_t src_bytes,
                           cudaStream_t s, const struct cudaDeviceProp* prop) {
    /* KVATTN_BENCH_TRACE_HG=1: the head-group kernel's trace (kva_decode_hg.cuh, KVA_HG_TRACE: 512 slots per CTA,
       written raw to KVA_BENCH_TRACE_DIR and summed up by scripts/hg_trace.py) */
    const char* thg = getenv("KVATTN_BENCH_TRACE_HG");
    const int hgt = thg && thg[0] == '1';
    const int nslot = hgt ? 512 : 16, maxw = 4096;
    unsigned long long* dtr = NULL;
    /* 16 slots per CTA, then one SM id per CTA (at grid * 16 + CTA) */
    CU(cudaMalloc((void**)&dtr, sizeof(unsigned long long) * (nslot + 1) * maxw));
    char buf[64];
    snprintf(buf, sizeof buf, "%p", (void*)dtr);
    setenv("KVATTN_BENCH_TRACE_PTR", buf, 1);
    kva_context_options o2 = *opt;
    o2.log_level = KVA_LOG_ERROR;
    kva_context* ctx = NULL;
    kva_status st = kva_context_create(&o2, &ctx);
    unsetenv("KVATTN_BENCH_TRACE_PTR");
    if (st != KVA_OK) {
        printf("trace: no context (%s)\n", kva_last_error_message());
        cudaFree(dtr);
        return;
    }
    wl_run T;
    wl_setup(ctx, w, dsrc, src_bytes, s, &T, R);
    /* the plan's workers = the kernel's grid (the SM ids follow the grid's 16 slots per CTA) */
    kva_plan_info pinfo;
    kva_plan_get_info(&T.plan, &pinfo);
    const int W = pinfo.num_workers > 0 ? pinfo.num_workers : kva_context_num_workers(ctx);
    unsigned long long* h = (unsigned long long*)calloc((size_t)(nslot + 1) * maxw, sizeof *h);
    (void)prop;
    /* D7 workloads: the graph-mode plan, replayed from a captured graph as the timed rows do */
    cudaGraph_t graph = NULL;
    cudaGraphExec_t exec = NULL;
    if (w->graph) capture_run(ctx, &T, s, &graph, &exec);
    for (int rep = 0; rep < 5; ++rep) {
        /* reps 0-2 warm up; rep 3: cold L2 (flushed), as timed; rep 4: right after rep 3, no flush (warm caches) */
        CU(cudaMemsetAsync(dtr, 0, sizeof(unsigned long long) * (nslot + 1) * maxw, s));
        float us;
        if (rep < 4) {
            us = time_once(ctx, &T, exec, s, rep);
        } else {
            CU(cudaEventRecord(g_e0, s));
            if (exec) CU(cudaGraphLaunch(exec, s));
            else KV(kva_run(ctx, &T.plan, &T.ws, &T.a));
            CU(cudaEventRecord(g_e1, s));
            CU(cudaEventSynchronize(g_e1));
            float ms = 0;
            CU(cudaEventElapsedTime(&ms, g_e0, g_e1));
            us = ms * 1000.0f;
        }
        if (rep < 3) continue;
        printf("%s", rep == 3 ? "[cold L2] " : "[warm, no flush] ");
        CU(cudaMemcpy(h, dtr, sizeof(unsigned long long) * (nslot + 1) * (W < maxw ? W : maxw), cudaMemcpyDeviceToHost));
        if (hgt) {
            const char* tdir = getenv("KVA_BENCH_TRACE_DIR");
            unsigned long long g0 = ~0ull, g1 = 0;
            int nw = 0;
            const int wn = W < maxw ? W : maxw;
            for (int b = 0; b < wn; ++b) {
                const unsigned long long* t = h + (size_t)b * nslot;
                if (!t[1]) continue;
                nw++;
                if (t[1] < g0) g0 = t[1];
                if (t[3] > g1) g1 = t[3];
            }
            printf("trace %s %s: event %.1f us; kernel span %.2f us (global timer), %d CTAs traced\n", w->name, w->label,
                   us, nw ? (g1 - g0) / 1e3 : 0.0, nw);
            if (tdir) {
                char fn[512];
                snprintf(fn, sizeof fn, "%s/hgtrace_%s_%d_%d_%d_%s.csv", tdir, w->name, w->batch, w->lens[0], w->hkv,
                         rep == 3 ? "cold" : "warm");
                for (char* q = fn + strlen(tdir) + 1; *q; ++q)
                    if (*q == ' ' || *q == '/' || *q == ':') *q = '_';
                FILE* f = fopen(fn, "w");
                if (f) {
                    for (int b = 0; b < wn; ++b) {
                        const unsigned long long* t = h + (size_t)b * nslot;
                        fprintf(f, "%d", b);
                        for (int i = 0; i < nslot; ++i) fprintf(f, ",%llu", t[i]);
                        fprintf(f, "\n");
                    }
                    fclose(f);
                }
            }
            continue;
        }
        const char* tdir = getenv("KVA_BENCH_TRACE_DIR");
        if (tdir && rep == 3) { /* raw per-CTA trace (SM clock slots, global timer start/end) */
            char fn[512];
            snprintf(fn, sizeof fn, "%s/trace_%d_%d_%d.csv", tdir, w->batch, w->lens[0], w->hkv);
            FILE* f = fopen(fn, "w");
            if (f) {
                fprintf(f, "cta");
                for (int i = 0; i < nslot; ++i) fprintf(f, ",s%d", i);
                fprintf(f, ",smid\n");
                const int wn = W < maxw ? W : maxw;
                for (int b = 0; b < wn; ++b) {
                    fprintf(f, "%d", b);
                    for (int i = 0; i < nslot; ++i) fprintf(f, ",%llu", h[(size_t)b * nslot + i]);
                    fprintf(f, ",%llu\n", h[(size_t)wn * nslot + b]);
                }
                fclose(f);
            }
        }
        /* SM clock: cycles / ns of the longest CTA (clock64 and the global timer over the same span) */
        double ghz = 1.98;
        {
            unsigned long long best = 0;
            for (int b = 0; b < W && b < maxw; ++b) {
                const unsigned long long* t = h + (size_t)b * nslot;
                if (t[15] > t[14] && t[10] > t[0] && t[15] - t[14] > best && t[15] - t[14] > 2000) {
                    best = t[15] - t[14];
                    ghz = (double)(t[10] - t[0]) / (double)(t[15] - t[14]);
                }
            }
        }
        unsigned long long g0 = ~0ull, gstart_max = 0, gend = 0;
        int nwork = 0;
        for (int b = 0; b < W && b < maxw; ++b) {
            const unsigned long long* t = h + (size_t)b * nslot;
            if (!t[14]) continue;
            if (t[14] < g0) g0 = t[14];
            if (t[14] > gstart_max) gstart_max = t[14];
            if (t[15] > gend) gend = t[15];
            if (t[5]) nwork++;
        }
        printf("trace %s %s: event %.1f us; kernel span %.2f us (global timer), CTA starts spread %.2f us; %d CTAs "
               "with work; SM clock %.2f GHz\n",
               w->name, w->label, us, (gend - g0) / 1e3, (gstart_max - g0) / 1e3, nwork, ghz);
        static const char* names[] = {"",         "header", "1st subtile", "KV issued", "KV data", "computed",
                                      "CTA sync", "written", "atomic",   "merged",    "end",     "pages fetched",
                                      "row 0 out", "merge load"};
        static const int order[] = {1, 2, 11, 3, 4, 5, 6, 12, 7, 8, 13, 9, 10};
        printf("  us since the CTA's start (median / max over CTAs with work):");
        for (int oi = 0; oi < 13; ++oi) {
            const int i = order[oi];
            double v[4096];
            int n = 0;
            for (int b = 0; b < W && b < maxw; ++b) {
                const unsigned long long* t = h + (size_t)b * nslot;
                if (!t[5] || !t[i] || !t[0]) continue;
                v[n++] = (double)(t[i] - t[0]) / (ghz * 1e3);
            }
            if (!n) continue;
            for (int a = 1; a < n; ++a) /* insertion sort (small) */
                for (int c = a; c > 0 && v[c] < v[c - 1]; --c) {
                    double x = v[c];
                    v[c] = v[c - 1];
                    v[c - 1] = x;
                }
            printf(" %s %.2f/%.2f;", names[i], v[n / 2], v[n - 1]);
        }
        printf("\n");
        /* when did the CTAs with work start, relative to the first CTA */
        double smax = 0;
        for (int b = 0; b < W && b < maxw; ++b) {
            const unsigned long long* t = h + (size_t)b * nslot;
            if (t[5] && t[14] && (t[14] - g0) / 1e3 > smax) smax = (t[14] - g0) / 1e3;
        }
        printf("  last CTA with work started %.2f us after the first CTA\n", smax);
    }
    free(h);
    if (exec) cudaGraphExecDestroy(exec);
    if (graph) cudaGraphDestroy(graph);
    wl_free(&T, 0);
    kva_context_destroy(ctx);
    cudaFree(dtr);
}

int main(int argc, char** argv) {
    int iters = 30, quick = 0, bc_ab = 1, extra = 0;
    const char* ab_env = "KVATTN_BENCH_NO_BOUNDS_CHECK";
    const char* ab_only = NULL;
    int ab_layout = 0; /* --ab-layout: the A/B's second arm runs the same plan on the same pools read as HND */
    const char* trace_only = NULL;
    const char* csv = NULL;
    const char* only = NULL;
    double hbm_override = 0;
    for (int i = 1; i < argc; ++i) {
        if (!strcmp(argv[i], "--iters") && i + 1 < argc) iters = atoi(argv[++i]);
        else if (!strcmp(argv[i], "--csv") && i + 1 < argc) csv = argv[++i];
        else if (!strcmp(argv[i], "--only") && i + 1 < argc) only = argv[++i];
        else if (!strcmp(argv[i], "--hbm") && i + 1 < argc) hbm_override = atof(argv[++i]);
        else if (!strcmp(argv[i], "--no-bounds-check-ab") && i + 1 < argc) bc_ab = atoi(argv[++i]);
        else if (!strcmp(argv[i], "--ab-env") && i + 1 < argc) ab_env = argv[++i];
        else if (!strcmp(argv[i], "--ab-only") && i + 1 < argc) ab_only = argv[++i];
        else if (!strcmp(argv[i], "--ab-layout")) ab_layout = 1;
        else if (!strcmp(argv[i], "--trace") && i + 1 < argc) trace_only = argv[++i];
        else if (!strcmp(argv[i], "--quick")) quick = 1;
        else if (!strcmp(argv[i], "--extra")) extra = 1;
        else {
            fprintf(stderr,
                    "usage: %s [--iters N] [--csv FILE] [--only SUBSTR] [--hbm TB/s] [--quick] "
                    "[--no-bounds-check-ab 0|1] [--ab-env VAR] [--ab-only 'A|B'] [--ab-layout] [--trace 'A|B'] [--extra]\n",
                    argv[0]);
            return 2;
        }
    }
    if (iters < 5) iters = 5;
    build_workloads(quick, extra);

    struct cudaDeviceProp prop;
    CU(cudaGetDeviceProperties(&prop, 0));
    double hbm = hbm_override;
    if (hbm <= 0) {
        if (strstr(prop.name, "H200")) hbm = 4.8;
        else if (strstr(prop.name, "H100")) hbm = 3.35;
        else {
            int clk = 0, bus = 0;
            cudaDeviceGetAttribute(&clk, cudaDevAttrMemoryClockRate, 0);
            cudaDeviceGetAttribute(&bus, cudaDevAttrGlobalMemoryBusWidth, 0);
            hbm = 2.0 * clk * 1e3 * (bus / 8.0) / 1e12;
        }
    }
    printf("device: %s, %d SMs, L2 %d MB, nominal HBM %.2f TB/s; kvattn %s\n", prop.name, prop.multiProcessorCount,
           prop.l2CacheSize >> 20, hbm, kva_version_string());

    kva_context_options opt;
    kva_context_options_init(&opt);
    opt.backend = KVA_BACKEND_CUDA;
    kva_context* ctx = NULL;
    KV(kva_context_create(&opt, &ctx));
    printf("kvattn workers: %d\n", kva_context_num_workers(ctx));
    kva_context* ctx_nochk = NULL;
    if (bc_ab && !ab_layout) { /* kernels without the page-index check, for the A/B cost of the check (benchmark only) */
        /* --ab-env "VAR[=VALUE][,VAR2[=VALUE2]...]": every variable set while the B context is created */
        char ab_list[512];
        snprintf(ab_list, sizeof ab_list, "%s", ab_env);
        char* names[8];
        int nn = 0;
        char* save = NULL;
        for (char* t = strtok_r(ab_list, ",", &save); t && nn < 8; t = strtok_r(NULL, ",", &save)) {
            char* eq = strchr(t, '=');
            const char* ab_val = "1";
            if (eq) {
                *eq = '\0';
                ab_val = eq + 1;
            }
            setenv(t, ab_val, 1);
            names[nn++] = t;
        }
        kva_context_options o2 = opt;
        o2.log_level = KVA_LOG_ERROR;
        if (kva_context_create(&o2, &ctx_nochk) != KVA_OK) ctx_nochk = NULL;
        for (int i = 0; i < nn; ++i) unsetenv(names[i]);
    }

    /* L2 flush buffer */
    g_flush_bytes = (size_t)512 << 20;
    CU(cudaMalloc(&g_flush, g_flush_bytes));
    /* one random source buffer replicated into pools */
    const size_t src_bytes = (size_t)64 << 20;
    uint16_t* hsrc = (uint16_t*)malloc(src_bytes);
    for (size_t i = 0; i < src_bytes / 2; ++i) hsrc[i] = f2bf((float)(unif() * 2 - 1));
    void* dsrc;
    CU(cudaMalloc(&dsrc, src_bytes));
    CU(cudaMemcpy(dsrc, hsrc, src_bytes, cudaMemcpyHostToDevice));
    free(hsrc);

    cudaStream_t s;
    CU(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
    CU(cudaEventCreate(&g_e0));
    CU(cudaEventCreate(&g_e1));
    {
        const char* fm = getenv("KVATTN_BENCH_FLUSH");
        if (fm && !strcmp(fm, "read")) {
            wl fw; /* not in the timed list */
            memset(&fw, 0, sizeof fw);
            fw.hq = 32, fw.hkv = 8, fw.d = 128, fw.kv = KVA_DTYPE_BF16, fw.page_size = 16, fw.batch = 32;
            fw.lens = (int*)calloc((size_t)fw.batch, sizeof(int));
            uniform(&fw, 4096);
            g_flush_ctx = ctx;
            wl_setup(ctx, &fw, dsrc, src_bytes, s, &g_flush_run, NULL);
            free(fw.lens);
            g_flush_read = 1;
            printf("L2 flush: a decode call reading %.0f MB before each timed call (KVATTN_BENCH_FLUSH=read)\n",
                   g_flush_run.bytes / 1e6);
        }
    }
    FILE* fcsv = csv ? fopen(csv, "w") : NULL;
    if (fcsv) fprintf(fcsv, "group,name,label,hq,hkv,d,kv_dtype,page_size,batch,bytes,kvattn_us,plan_us,lens\n");
    printf("%-28s %-12s %10s %10s %8s %8s %9s\n", "workload", "shape", "time_us", "TB/s", "%HBM", "plan_us", "bytes");
    enum { MAX_AB_LINES = 128 }; /* A/B rows beyond this many are still run and printed, not repeated at the end */
    char bc_lines[MAX_AB_LINES][320];
    char bc_line[320];
    int nbc = 0;

    for (int wi = 0; wi < nwl; ++wi) {
        wl* w = &wls[wi];
        if (only && !matches(only, w)) continue;
        wl_run R;
        wl_setup(ctx, w, dsrc, src_bytes, s, &R, NULL);
        float* times = (float*)malloc(sizeof(float) * (size_t)iters);
        cudaGraphExec_t exec = NULL;
        cudaGraph_t graph = NULL;
        const int L = w->layers > 1 ? w->layers : 1;
        void** lpools = L > 1 ? (void**)calloc((size_t)(2 * L), sizeof(void*)) : NULL;
        wl_run R2;
        if (w->mixed) { /* the fp8-KV twin whose call runs before each layer's */
            wl w2 = *w;
            w2.kv = KVA_DTYPE_E4M3;
            wl_setup(ctx, &w2, dsrc, src_bytes, s, &R2, NULL);
        }
        if (L > 1) capture_layers(ctx, &R, L, s, &graph, &exec, lpools, w->mixed ? &R2 : NULL);
        else if (w->graph) capture_run(ctx, &R, s, &graph, &exec);
        for (int it = -3; it < iters; ++it) {
            float t = time_once(ctx, &R, exec, s, it);
            if (it >= 0) times[it] = t / (float)L;
        }
        qsort(times, (size_t)iters, sizeof(float), cmp_f);
        const double t_us = times[iters / 2];
        const double tbs = R.bytes / (t_us * 1e-6) / 1e12;
        printf("%-28s %-12s %10.1f %10.3f %7.1f%% %8.1f %9.3g\n", w->name, w->label, t_us, tbs, 100.0 * tbs / hbm,
               (double)R.plan_us, R.bytes);
        csv_row(fcsv, w, w->name, &R, t_us);
        if (w->graph) { /* back-to-back replays, warm L2: the per-call cost in a captured decode step */
            const int reps = 200;
            CU(cudaEventRecord(g_e0, s));
            for (int r = 0; r < reps; ++r) CU(cudaGraphLaunch(exec, s));
            CU(cudaEventRecord(g_e1, s));
            CU(cudaEventSynchronize(g_e1));
            float ms = 0;
            CU(cudaEventElapsedTime(&ms, g_e0, g_e1));
            const double warm_us = ms * 1000.0 / reps / L;
            printf("%-28s %-12s %10.1f us per %s, back to back (warm L2)\n", L > 1 ? "D7 32 layers (warm)" :
                   "D7 graph replay (warm)", w->label, warm_us, L > 1 ? "layer" : "replay");
            char nm[128];
            snprintf(nm, sizeof nm, "%s (warm)", w->name);
            csv_row(fcsv, w, nm, &R, warm_us);
            cudaGraphExecDestroy(exec);
            cudaGraphDestroy(graph);
            for (int l = 0; lpools && l < 2 * (L - 1); ++l) cudaFree(lpools[l]);
            free(lpools);
        }
        /* bounds-check A/B: D1 64 x 8k, D5 page 16 and page 1 */
        /* (D7 rows: eager launches of the graph-mode plan) */
        const int bc_this = (ctx_nochk || (bc_ab && ab_layout)) &&
                            (ab_only ? matches(ab_only, w)
                                     : ((!strcmp(w->group, "D1") && w->batch == 64 && w->lens[0] == 8192) ||
                                        !strcmp(w->group, "D5")));
        const int is_bc = !ab_layout && !strcmp(ab_env, "KVATTN_BENCH_NO_BOUNDS_CHECK");
        if (bc_this) {
            wl_run N;
            kva_context* cb = ab_layout ? ctx : ctx_nochk;
            wl_setup(cb, w, dsrc, src_bytes, s, &N, &R);
            if (ab_layout) { /* same pools and page table read as HND [page][head][token][dim] */
                const int64_t np = R.a.paged.num_pages;
                KV(kva_paged_kv_init(&N.a.paged, N.k, N.v, w->kv, KVA_LAYOUT_HND, np, w->page_size, w->hkv, w->d, w->d));
                N.a.paged.indices = N.dind;
            }
            const int n2 = iters < 40 ? 40 : iters;
            float* ta = (float*)malloc(sizeof(float) * (size_t)n2);
            float* tb = (float*)malloc(sizeof(float) * (size_t)n2);
            for (int it = -3; it < n2; ++it) {
                float x = time_once(ctx, &R, NULL, s, it);
                float y = time_once(cb, &N, NULL, s, it + 7);
                if (it >= 0) {
                    ta[it] = x;
                    tb[it] = y;
                }
            }
            qsort(ta, (size_t)n2, sizeof(float), cmp_f);
            qsort(tb, (size_t)n2, sizeof(float), cmp_f);
            const double a_us = ta[n2 / 2], b_us = tb[n2 / 2];
            if (is_bc)
                snprintf(bc_line, sizeof bc_line,
                         "bounds check: %-22s %-10s checked %8.1f us, unchecked %8.1f us: cost %+.2f%% (medians of %d "
                         "interleaved cold launches)",
                         w->name, w->label, a_us, b_us, 100.0 * (a_us - b_us) / b_us, n2);
            else
                snprintf(bc_line, sizeof bc_line,
                         "A/B %s: %-22s %-10s default %8.1f us, with it %8.1f us: default is %+.2f%% (medians of %d "
                         "interleaved cold launches)",
                         ab_layout ? "HND layout" : ab_env, w->name, w->label, a_us, b_us, 100.0 * (a_us - b_us) / b_us, n2);
            printf("%s\n", bc_line);
            if (nbc < MAX_AB_LINES) memcpy(bc_lines[nbc++], bc_line, sizeof bc_line);
            char nm[128];
            snprintf(nm, sizeof nm, "%s [no bounds check]", w->name);
            wl bw = *w;
            snprintf(bw.group, sizeof bw.group, "BC");
            if (is_bc) {
                csv_row(fcsv, &bw, nm, &N, b_us);
                snprintf(nm, sizeof nm, "%s [bounds check, A/B]", w->name);
                csv_row(fcsv, &bw, nm, &R, a_us);
            }
            free(ta);
            free(tb);
            wl_free(&N, 0);
        }
        if (trace_only && matches(trace_only, w)) trace_workload(&opt, w, &R, dsrc, src_bytes, s, &prop);
        fflush(stdout);
        free(times);
        wl_free(&R, 1);
        if (w->mixed) wl_free(&R2, 1);
    }
    /* measured read ceiling: a device-to-device copy of 2 GB (read + write) */
    {
        size_t nb = (size_t)1 << 30;
        void *a, *b;
        if (cudaMalloc(&a, nb) == cudaSuccess && cudaMalloc(&b, nb) == cudaSuccess) {
            float best = 1e30f;
            for (int i = 0; i < 5; ++i) {
                CU(cudaEventRecord(g_e0, s));
                CU(cudaMemcpyAsync(b, a, nb, cudaMemcpyDeviceToDevice, s));
                CU(cudaEventRecord(g_e1, s));
                CU(cudaEventSynchronize(g_e1));
                float ms;
                CU(cudaEventElapsedTime(&ms, g_e0, g_e1));
                if (ms < best) best = ms;
            }
            printf("device copy ceiling: %.3f TB/s (read + write of 1 GiB)\n", 2.0 * nb / (best * 1e-3) / 1e12);
            cudaFree(a);
            cudaFree(b);
        }
    }
    for (int i = 0; i < nbc; ++i) printf("%s\n", bc_lines[i]);
    if (fcsv) fclose(fcsv);
    if (ctx_nochk) kva_context_destroy(ctx_nochk);
    kva_context_destroy(ctx);
    return 0;
}
