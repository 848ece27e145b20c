/*
 * bench_prefill.c - kvattn batch prefill / append on the GPU: ../shared/WORKLOADS.md P1-P5 and V1, and a smoke
 * check of the CUDA backend against the CPU backend.
 *
 * Timing: cold L2 (a 512 MB buffer is overwritten before every timed launch), CUDA events around each run, median of
 * --iters (default 30) after 3 warm-ups; plan() is outside the timing and reported separately (median of 15).
 * FLOPs: non-causal 2 * sum(qo_i * kv_i) * H_q * (D_qk + D_vo); causal (bottom-right) the trapezoid
 * sum((2 * kv_i - qo_i) * qo_i) * H_q * (D_qk + D_vo) (WORKLOADS.md); sliding window: 2 * (visible pairs) * H_q *
 * (D_qk + D_vo) with the pairs counted exactly. No lse is requested while timing (the peers return none either).
 *
 * --check: small shapes over every variant, group sizes 1-16 (3, 5, 7 included), page sizes 1, 3, 16, head dims
 * 64/128/256, f16/bf16 (and e4m3 / e5m2 KV), paged / ragged / decode, forced split-KV, appends (qo < kv), NHD and
 * HND, compared element by element with the CPU backend (fp32), plus a fault injection (one page index out of
 * range: that request gets o = 0 and lse = -inf, the others are unaffected, kva_read_faults reports it).
 * Exit status 1 if any check fails; prints "N passed, N failed" last.
 *
 * --interleave: the selected workloads of each group are set up together and timed call by call in turn (a GPU under
 * sustained load drifts in clock and power; without it a group's first row runs on a GPU that idled during set-up).
 *
 * usage: kva_bench_prefill [--check] [--iters N] [--csv FILE] [--only 'A|B' (substrings)] [--quick] [--seed S]
 *                          [--interleave]
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


/* ---------------------------------------------------------------------------------------------- */
/* RNG and 16-bit conversions                                                                      */

static float gauss(void) {
    double u = unif(), v = unif();
    if (u < 1e-300) u = 1e-300;
    return (float)(sqrt(-2.0 * log(u)) * cos(6.283185307179586 * v));
}
static uint16_t f2h(float f) { /* round to nearest even, no NaN inputs here */
    uint32_t u;
    memcpy(&u, &f, 4);
    uint32_t sign = (u >> 16) & 0x8000u;
    int32_t e = (int32_t)((u >> 23) & 0xff) - 127 + 15;
    uint32_t m = u & 0x7fffffu;
    if (e >= 31) return (uint16_t)(sign | 0x7c00u);
    if (e <= 0) {
        if (e < -10) return (uint16_t)sign;
        m |= 0x800000u;
        uint32_t sh = (uint32_t)(14 - e);
        uint32_t r = m >> sh, rem = m & ((1u << sh) - 1), half = 1u << (sh - 1);
        if (rem > half || (rem == half && (r & 1))) r++;
        return (uint16_t)(sign | r);
    }
    uint32_t r = ((uint32_t)e << 10) | (m >> 13), rem = m & 0x1fffu;
    if (rem > 0x1000u || (rem == 0x1000u && (r & 1))) r++;
    return (uint16_t)(sign | r);
}
static float h2f(uint16_t h) {
    uint32_t sign = (uint32_t)(h & 0x8000u) << 16, e = (h >> 10) & 0x1f, m = h & 0x3ffu, u;
    if (e == 0) {
        if (m == 0) u = sign;
        else {
            e = 127 - 15 + 1;
            while (!(m & 0x400u)) {
                m <<= 1;
                e--;
            }
            u = sign | (e << 23) | ((m & 0x3ffu) << 13);
        }
    } else if (e == 31) u = sign | 0x7f800000u | (m << 13);
    else u = sign | ((e + 127 - 15) << 23) | (m << 13);
    float f;
    memcpy(&f, &u, 4);
    return f;
}
/* fp8 from a float via the nearest value of a small table walk (exact enough for test data in [-4, 4]) */
static uint8_t f2fp8(float f, int e4m3) {
    uint8_t best = 0;
    float bd = 1e30f;
    for (int b = 0; b < 256; ++b) {
        int s = b >> 7, e, m;
        float v;
        if (e4m3) {
            e = (b >> 3) & 15;
            m = b & 7;
            if (e == 15 && m == 7) continue;
            v = e ? ldexpf(1.0f + m / 8.0f, e - 7) : ldexpf(m / 8.0f, -6);
        } else {
            e = (b >> 2) & 31;
            m = b & 3;
            if (e == 31) continue;
            v = e ? ldexpf(1.0f + m / 4.0f, e - 15) : ldexpf(m / 4.0f, -14);
        }
        if (s) v = -v;
        float dd = fabsf(v - f);
        if (dd < bd) {
            bd = dd;
            best = (uint8_t)b;
        }
    }
    return best;
}


/* ---------------------------------------------------------------------------------------------- */
/* Workloads                                                                                       */

typedef enum { MK_NONE = 0, MK_CAUSAL = 1 } mask_kind;

typedef struct wl {
    char group[8];
    char name[64];
    char label[64];
    int hq, hkv, d;
    int batch;
    int* qo;       /* query rows per request */
    int* kv;       /* KV tokens per request */
    int causal;
    int window;    /* window_left, -1 = none */
    float softcap; /* 0 = none */
    int alibi;
    int page_size; /* 0 = ragged K/V */
} wl;

static wl* wls;
static int nwl, capwl;

static wl* add(const char* group, const char* name, int hq, int hkv, int d, int batch, int causal, int ps) {
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
    w->batch = batch;
    w->causal = causal;
    w->window = -1;
    w->page_size = ps;
    w->qo = (int*)calloc((size_t)batch, sizeof(int));
    w->kv = (int*)calloc((size_t)batch, sizeof(int));
    return w;
}
static void uniform(wl* w, int qo, int kv) {
    for (int i = 0; i < w->batch; ++i) {
        w->qo[i] = qo;
        w->kv[i] = kv;
    }
    if (qo == kv) snprintf(w->label, sizeof w->label, "%d x %d", w->batch, qo);
    else snprintf(w->label, sizeof w->label, "%d x %d/%d", w->batch, qo, kv);
}

static void build_workloads(int quick) {
    static const int p1[][2] = {{16, 1024}, {4, 4096}, {1, 16384}};
    for (int i = 0; i < 3; ++i) uniform(add("P1", "P1 causal GQA 32/8", 32, 8, 128, p1[i][0], 1, 0), p1[i][1], p1[i][1]);
    uniform(add("P1", "P1 causal MHA 32/32", 32, 32, 128, 4, 1, 0), 4096, 4096);
    uniform(add("P1", "P1 non-causal MHA 32/32", 32, 32, 128, 4, 0, 0), 4096, 4096);
    /* P2 ragged causal: batch 16, lengths uniform in [512, 2048], seed 1 */
    rng = 1;
    wl* w = add("P2", "P2 ragged causal GQA 32/8", 32, 8, 128, 16, 1, 0);
    for (int i = 0; i < 16; ++i) w->qo[i] = w->kv[i] = 512 + (int)(xs() % 1537);
    snprintf(w->label, sizeof w->label, "16 ragged");
    /* P3 paged vs ragged on P1 4 x 4k */
    uniform(add("P3", "P3 ragged", 32, 8, 128, 4, 1, 0), 4096, 4096);
    uniform(add("P3", "P3 paged ps16", 32, 8, 128, 4, 1, 16), 4096, 4096);
    uniform(add("P3", "P3 paged ps1", 32, 8, 128, 4, 1, 1), 4096, 4096);
    uniform(add("P3", "P3 paged ps128", 32, 8, 128, 4, 1, 128), 4096, 4096); /* one TMA box per column block */
    /* P4 append: q 128 / 256 onto kv 1k, 8k, 32k (KV includes the new tokens), batch 16, paged 16 */
    static const int p4q[] = {128, 256}, p4k[] = {1024, 8192, 32768};
    for (int a = 0; a < 2; ++a)
        for (int b = 0; b < 3; ++b) {
            if (quick && p4k[b] > 8192) continue;
            uniform(add("P4", "P4 append GQA 32/8", 32, 8, 128, 16, 1, 16), p4q[a], p4k[b]);
        }
    /* P5 head dims 64 and 256 at hidden size 4096 */
    uniform(add("P5", "P5 D64 GQA 64/16", 64, 16, 64, 4, 1, 0), 4096, 4096);
    uniform(add("P5", "P5 D256 GQA 16/4", 16, 4, 256, 4, 1, 0), 4096, 4096);
    /* V1 variants: batch 16, heads 16, D 128, seq 2k / 8k */
    static const int vs[] = {2048, 8192};
    for (int i = 0; i < 2; ++i) {
        if (quick && vs[i] > 2048) continue;
        uniform(add("V1", "V1 causal", 16, 16, 128, 16, 1, 0), vs[i], vs[i]);
        w = add("V1", "V1 causal softcap 30", 16, 16, 128, 16, 1, 0);
        uniform(w, vs[i], vs[i]);
        w->softcap = 30.0f;
        w = add("V1", "V1 causal alibi", 16, 16, 128, 16, 1, 0);
        uniform(w, vs[i], vs[i]);
        w->alibi = 1;
        w = add("V1", "V1 sliding window 1024", 16, 16, 128, 16, 1, 0);
        uniform(w, vs[i], vs[i]);
        w->window = 1024; /* keys j with q_pos - 1024 <= j <= q_pos (FlexAttention: q - k <= 1024) */
    }
}

static double flops_of(const wl* w) {
    double pairs2 = 0; /* 2 * visible pairs */
    for (int b = 0; b < w->batch; ++b) {
        const double qo = w->qo[b], kv = w->kv[b];
        if (!w->causal) pairs2 += 2.0 * qo * kv;
        else if (w->window < 0) pairs2 += (2.0 * kv - qo) * qo; /* the trapezoid of WORKLOADS.md */
        else {
            double n = 0;
            for (int i = 0; i < w->qo[b]; ++i) {
                long long qp = (long long)w->kv[b] - w->qo[b] + i;
                long long lo = qp - w->window < 0 ? 0 : qp - w->window;
                n += (double)(qp - lo + 1);
            }
            pairs2 += 2.0 * n;
        }
    }
    return pairs2 * w->hq * (2.0 * w->d);
}

/* ---------------------------------------------------------------------------------------------- */
/* Timing                                                                                          */

/* --only "A|B|...": any alternative is a substring of the first or the second string (b may be NULL) */
static int only_match(const char* only, const char* a, const char* b) {
    if (!only) return 1;
    const char* p = only;
    for (;;) {
        const char* bar = strchr(p, '|');
        const size_t n = bar ? (size_t)(bar - p) : strlen(p);
        char alt[128];
        if (n > 0 && n < sizeof alt) {
            memcpy(alt, p, n);
            alt[n] = '\0';
            if (strstr(a, alt) || (b && strstr(b, alt))) return 1;
        }
        if (!bar) return 0;
        p = bar + 1;
    }
}

/* One workload set up for timing: buffers, plan, run arguments. */
typedef struct pf_run {
    wl* w;
    void *k, *v, *q, *o;
    int* dind;
    kva_workspace ws;
    kva_plan plan;
    kva_plan_info info;
    kva_run_args a;
    float plan_us; /* median of 15 plans */
    float* times;  /* iters timed calls */
} pf_run;

static void pf_setup(kva_context* ctx, wl* w, const void* dsrc, size_t src_bytes, cudaStream_t s, int iters, pf_run* R) {
    memset(R, 0, sizeof *R);
    R->w = w;
    const int B = w->batch, HQ = w->hq, HK = w->hkv, D = w->d, ps = w->page_size;
    int* qo_indptr = (int*)calloc((size_t)B + 1, sizeof(int));
    int* kv_indptr = (int*)calloc((size_t)B + 1, sizeof(int));
    int* last = (int*)calloc((size_t)B, sizeof(int));
    long long rows = 0, tokens = 0;
    for (int b = 0; b < B; ++b) {
        qo_indptr[b + 1] = qo_indptr[b] + w->qo[b];
        rows += w->qo[b];
        tokens += w->kv[b];
        if (ps > 0) {
            int np = (w->kv[b] + ps - 1) / ps;
            kv_indptr[b + 1] = kv_indptr[b] + np;
            last[b] = w->kv[b] - (np - 1) * ps;
        } else {
            kv_indptr[b + 1] = kv_indptr[b] + w->kv[b];
        }
    }
    const int64_t npages = ps > 0 ? kv_indptr[B] : 0;
    const size_t kv_elems = ps > 0 ? (size_t)npages * ps * HK * D : (size_t)tokens * HK * D;
    CU(cudaMalloc(&R->k, kv_elems * 2));
    CU(cudaMalloc(&R->v, kv_elems * 2));
    CU(cudaMalloc(&R->q, (size_t)rows * HQ * D * 2));
    CU(cudaMalloc(&R->o, (size_t)rows * HQ * D * 2));
    void* bufs[3] = {R->k, R->v, R->q};
    size_t sizes[3] = {kv_elems * 2, kv_elems * 2, (size_t)rows * HQ * D * 2};
    for (int t = 0; t < 3; ++t)
        for (size_t off = 0; off < sizes[t]; off += src_bytes) {
            size_t n = sizes[t] - off < src_bytes ? sizes[t] - off : src_bytes;
            size_t so = ((size_t)(t * 7919 + off / src_bytes * 104729) * 16) % (src_bytes - n + 16) / 16 * 16;
            if (so + n > src_bytes) so = 0;
            CU(cudaMemcpy((char*)bufs[t] + off, (const char*)dsrc + so, n, cudaMemcpyDeviceToDevice));
        }
    if (ps > 0) {
        int* indices = (int*)malloc(sizeof(int) * (size_t)npages);
        for (int64_t i = 0; i < npages; ++i) indices[i] = (int)i;
        /* KVATTN_BENCH_PAGES_SEQ=1 (A/B): pages in order, the pool laid out like ragged K/V */
        const char* seq = getenv("KVATTN_BENCH_PAGES_SEQ");
        const int scatter = !(seq && seq[0] == '1' && seq[1] == '\0');
        for (int64_t i = npages - 1; scatter && i > 0; --i) { /* scattered pages */
            int64_t j = (int64_t)(xs() % (uint64_t)(i + 1));
            int t = indices[i];
            indices[i] = indices[j];
            indices[j] = t;
        }
        CU(cudaMalloc((void**)&R->dind, sizeof(int) * (size_t)npages));
        CU(cudaMemcpy(R->dind, indices, sizeof(int) * (size_t)npages, cudaMemcpyHostToDevice));
        free(indices);
    }
    kva_attention_desc d;
    kva_attention_desc_init(&d, HQ, HK, D, KVA_DTYPE_BF16);
    d.mask_mode = w->causal ? KVA_MASK_CAUSAL : KVA_MASK_NONE;
    d.window_left = w->window;
    d.logits_soft_cap = w->softcap;
    if (w->alibi) d.pos_encoding = KVA_POS_ALIBI;
    const kva_op op = ps > 0 ? KVA_OP_BATCH_PREFILL_PAGED : KVA_OP_BATCH_PREFILL_RAGGED;
    kva_plan_params pp;
    kva_plan_params_init(&pp);
    pp.batch_size = B;
    pp.qo_indptr = qo_indptr;
    pp.kv_indptr = kv_indptr;
    if (ps > 0) {
        pp.kv_last_page_len = last;
        pp.page_size = ps;
        pp.num_pages = npages;
    }
    size_t db = 0, hb = 0;
    KV(kva_plan_workspace_size(ctx, &d, op, &pp, &db, &hb));
    R->plan_us = bench_plan_median_us(ctx, &d, op, &pp, db, hb, &R->ws, &R->plan, s);
    KV(kva_plan_get_info(&R->plan, &R->info));
    kva_run_args_init(&R->a);
    R->a.q = kva_tensor_make(R->q, KVA_DTYPE_BF16, 3, rows, HQ, D, 0);
    R->a.o = kva_tensor_make(R->o, KVA_DTYPE_BF16, 3, rows, HQ, D, 0);
    if (ps > 0) {
        KV(kva_paged_kv_init(&R->a.paged, R->k, R->v, KVA_DTYPE_BF16, KVA_LAYOUT_NHD, npages, ps, HK, D, D));
        R->a.paged.indices = R->dind;
    } else {
        R->a.k = kva_tensor_make(R->k, KVA_DTYPE_BF16, 3, tokens, HK, D, 0);
        R->a.v = kva_tensor_make(R->v, KVA_DTYPE_BF16, 3, tokens, HK, D, 0);
    }
    R->a.stream = s;
    R->times = (float*)malloc(sizeof(float) * (size_t)iters);
    free(qo_indptr);
    free(kv_indptr);
    free(last);
}

/* one cold-L2 call (the flush buffer overwritten first), CUDA events; returns microseconds */
static float pf_time_once(kva_context* ctx, pf_run* R, void* flush, size_t flush_bytes, int it, cudaStream_t s,
                          cudaEvent_t e0, cudaEvent_t e1) {
    CU(cudaMemsetAsync(flush, it & 0xff, flush_bytes, s));
    CU(cudaEventRecord(e0, s));
    KV(kva_run(ctx, &R->plan, &R->ws, &R->a));
    CU(cudaEventRecord(e1, s));
    CU(cudaEventSynchronize(e1));
    float ms = 0;
    CU(cudaEventElapsedTime(&ms, e0, e1));
    return ms * 1000.0f;
}

/* the median, the output line and the CSV row; frees the run */
static void pf_report(kva_context* ctx, pf_run* R, int iters, FILE* fcsv, cudaStream_t s) {
    wl* w = R->w;
    kva_fault_report fr;
    KV(kva_read_faults(ctx, &R->ws, &fr, s));
    if (fr.faulted) printf("  (unexpected device fault report: request %d page %lld)\n", fr.request, (long long)fr.page_index);
    qsort(R->times, (size_t)iters, sizeof(float), cmp_f);
    const double t_us = R->times[iters / 2];
    const double fl = flops_of(w);
    const double tf = fl / (t_us * 1e-6) / 1e12;
    printf("%-28s %-14s %10.1f %9.1f %8.1f %6d %7d\n", w->name, w->label, t_us, tf, (double)R->plan_us, R->info.tile_q,
           R->info.num_work_items);
    if (fcsv) {
        fprintf(fcsv, "%s,%s,%s,%d,%d,%d,%d,%d,%d,%g,%d,%d,%.0f,%.2f,%.2f,%.1f,%d,", w->group, w->name, w->label, w->hq,
                w->hkv, w->d, w->batch, w->causal, w->window, (double)w->softcap, w->alibi, w->page_size, fl, t_us, tf,
                (double)R->plan_us, R->info.tile_q);
        for (int b = 0; b < w->batch; ++b) fprintf(fcsv, "%s%d", b ? ";" : "", w->qo[b]);
        fprintf(fcsv, ",");
        for (int b = 0; b < w->batch; ++b) fprintf(fcsv, "%s%d", b ? ";" : "", w->kv[b]);
        fprintf(fcsv, "\n");
        fflush(fcsv);
    }
    fflush(stdout);
    free(R->times);
    cudaFree(R->k);
    cudaFree(R->v);
    cudaFree(R->q);
    cudaFree(R->o);
    if (R->dind) cudaFree(R->dind);
    cudaFree(R->ws.device);
    cudaFreeHost(R->ws.host);
}

/* interleave != 0: the selected workloads of one group (P1, P3, V1, ...) are set up together and timed call by call
   in turn, so that the GPU's clock and power drift under sustained load hits each of them alike (a group's first
   workload otherwise runs after the idle set-up time and the later ones on a hotter GPU) */
static int run_bench(int iters, const char* csv, const char* only, int quick, int interleave) {
    build_workloads(quick);
    struct cudaDeviceProp prop;
    CU(cudaGetDeviceProperties(&prop, 0));
    int rt = 0, drv = 0;
    cudaRuntimeGetVersion(&rt);
    cudaDriverGetVersion(&drv);
    printf("device: %s, %d SMs, L2 %d MB, CUDA runtime %d, driver %d; kvattn %s\n", prop.name, prop.multiProcessorCount,
           prop.l2CacheSize >> 20, rt, drv, kva_version_string());
    kva_context_options opt;
    kva_context_options_init(&opt);
    opt.backend = KVA_BACKEND_CUDA;
    kva_context* ctx = NULL;
    KV(kva_context_create(&opt, &ctx));
    printf("kvattn workers: %d%s\n", kva_context_num_workers(ctx),
           interleave ? "; each group's workloads timed call by call in turn" : "");

    const size_t flush_bytes = (size_t)512 << 20;
    void* flush;
    CU(cudaMalloc(&flush, flush_bytes));
    /* a 64 MB source of bf16 normals, tiled into every tensor (the values only need to be realistic) */
    const size_t src_bytes = (size_t)64 << 20;
    uint16_t* hsrc = (uint16_t*)malloc(src_bytes);
    rng = 12345;
    for (size_t i = 0; i < src_bytes / 2; ++i) hsrc[i] = f2bf(gauss());
    void* dsrc;
    CU(cudaMalloc(&dsrc, src_bytes));
    CU(cudaMemcpy(dsrc, hsrc, src_bytes, cudaMemcpyHostToDevice));
    free(hsrc);
    cudaStream_t s;
    CU(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
    cudaEvent_t e0, e1;
    CU(cudaEventCreate(&e0));
    CU(cudaEventCreate(&e1));
    FILE* fcsv = csv ? fopen(csv, "w") : NULL;
    if (fcsv)
        fprintf(fcsv, "group,name,label,hq,hkv,d,batch,causal,window,softcap,alibi,page_size,flops,kvattn_us,tflops,"
                      "plan_us,tile_q,qo_lens,kv_lens\n");
    printf("%-28s %-14s %10s %9s %8s %6s %7s\n", "workload", "shape", "time_us", "TFLOP/s", "plan_us", "tile", "items");

    pf_run* runs = (pf_run*)calloc((size_t)nwl, sizeof(pf_run));
    for (int wi = 0; wi < nwl;) {
        /* the batch timed together: one workload, or (interleave) the selected ones of this group */
        int n = 0, wj = wi;
        for (; wj < nwl && (wj == wi || (interleave && !strcmp(wls[wj].group, wls[wi].group))); ++wj)
            if (only_match(only, wls[wj].name, wls[wj].group)) pf_setup(ctx, &wls[wj], dsrc, src_bytes, s, iters, &runs[n++]);
        for (int it = -3; it < iters; ++it)
            for (int r = 0; r < n; ++r) {
                const float t = pf_time_once(ctx, &runs[r], flush, flush_bytes, it, s, e0, e1);
                if (it >= 0) runs[r].times[it] = t;
            }
        for (int r = 0; r < n; ++r) pf_report(ctx, &runs[r], iters, fcsv, s);
        wi = wj;
    }
    free(runs);
    if (fcsv) fclose(fcsv);
    cudaFree(flush);
    cudaFree(dsrc);
    kva_context_destroy(ctx);
    return 0;
}

/* ---------------------------------------------------------------------------------------------- */
/* Smoke check: CUDA backend vs CPU backend                                                        */

static int npass, nfail;
#define CHECK(cond, ...)                                \
    do {                                                \
        if (cond) npass++;                              \
        else {                                          \
            nfail++;                                    \
            printf("FAIL: ");                           \
            printf(__VA_ARGS__);                        \
            printf("\n");                               \
        }                                               \
    } while (0)

typedef struct ccase {
    const char* tag;
    kva_op op;
    int hq, hkv, d;
    kva_dtype qt, kt, ot;
    int batch;
    const int* qo; /* NULL for decode (one row each) */
    const int* kv;
    int page_size; /* paged ops */
    int hnd;
    kva_mask_mode mask;
    int window;
    float softcap;
    kva_pos_encoding pos;
    int sigmoid;
    int fixed_split; /* > 0: force split-KV partials */
    int fault_req;   /* >= 0: poison one page index of this request */
} ccase;

static float load16(const uint16_t* p, size_t i, kva_dtype t) { return t == KVA_DTYPE_BF16 ? bf2f(p[i]) : h2f(p[i]); }

/* one comparison; returns 1 if ok */
static int check_case(kva_context* gpu, kva_context* cpu, const ccase* c) {
    const int B = c->batch, HQ = c->hq, HK = c->hkv, D = c->d;
    const int paged = c->op != KVA_OP_BATCH_PREFILL_RAGGED;
    const int ps = paged ? c->page_size : 1;
    int* qo_indptr = (int*)calloc((size_t)B + 1, sizeof(int));
    int* kv_indptr = (int*)calloc((size_t)B + 1, sizeof(int));
    int* last = (int*)calloc((size_t)B, sizeof(int));
    long long rows = 0, tokens = 0;
    int64_t mask_bits = 0;
    for (int b = 0; b < B; ++b) {
        const int qo = c->op == KVA_OP_BATCH_DECODE ? 1 : c->qo[b];
        qo_indptr[b + 1] = qo_indptr[b] + qo;
        rows += qo;
        tokens += c->kv[b];
        if (paged) {
            int np = (c->kv[b] + ps - 1) / ps;
            kv_indptr[b + 1] = kv_indptr[b] + np;
            last[b] = np > 0 ? c->kv[b] - (np - 1) * ps : 0;
        } else {
            kv_indptr[b + 1] = kv_indptr[b] + c->kv[b];
        }
        mask_bits += ((int64_t)qo * c->kv[b] + 7) / 8 * 8;
    }
    const int64_t npages = paged ? kv_indptr[B] + 3 : 0; /* a few spare pages */
    const size_t kes = kva_dtype_size(c->kt), qes = 2, oes = kva_dtype_size(c->ot);
    const size_t kv_elems = paged ? (size_t)npages * ps * HK * D : (size_t)tokens * HK * D;
    uint8_t* hk = (uint8_t*)malloc(kv_elems * kes + 16);
    uint8_t* hv = (uint8_t*)malloc(kv_elems * kes + 16);
    uint16_t* hq = (uint16_t*)malloc((size_t)rows * HQ * D * qes + 16);
    for (size_t i = 0; i < kv_elems; ++i) {
        float a = gauss(), b = gauss();
        if (kes == 1) {
            hk[i] = f2fp8(a, c->kt == KVA_DTYPE_E4M3);
            hv[i] = f2fp8(b, c->kt == KVA_DTYPE_E4M3);
        } else {
            uint16_t x = c->kt == KVA_DTYPE_BF16 ? f2bf(a) : f2h(a), y = c->kt == KVA_DTYPE_BF16 ? f2bf(b) : f2h(b);
            memcpy(hk + 2 * i, &x, 2);
            memcpy(hv + 2 * i, &y, 2);
        }
    }
    for (size_t i = 0; i < (size_t)rows * HQ * D; ++i) hq[i] = c->qt == KVA_DTYPE_BF16 ? f2bf(gauss()) : f2h(gauss());
    int* indices = NULL;
    if (paged) {
        indices = (int*)malloc(sizeof(int) * (size_t)(kv_indptr[B] + 1));
        for (int i = 0; i < kv_indptr[B]; ++i) indices[i] = (int)((i * 7 + 3) % npages); /* scattered, in range */
        /* make them a permutation-like scatter without repeats where possible */
        for (int i = 0; i < kv_indptr[B]; ++i) indices[i] = i;
        for (int i = kv_indptr[B] - 1; i > 0; --i) {
            int j = (int)(xs() % (uint64_t)(i + 1));
            int t = indices[i];
            indices[i] = indices[j];
            indices[j] = t;
        }
    }
    uint8_t* mask = NULL;
    if (c->mask == KVA_MASK_CUSTOM) {
        mask = (uint8_t*)calloc((size_t)(mask_bits / 8 + 1), 1);
        for (int64_t i = 0; i < mask_bits / 8; ++i) mask[i] = (uint8_t)(xs() & 0xff) | (uint8_t)(xs() & 0x11);
    }
    kva_attention_desc d;
    kva_attention_desc_init(&d, HQ, HK, D, c->qt);
    d.kv_dtype = c->kt;
    d.o_dtype = c->ot;
    d.mask_mode = c->mask;
    d.window_left = c->window;
    d.logits_soft_cap = c->softcap;
    d.pos_encoding = c->pos;
    if (c->sigmoid) {
        d.score_mode = KVA_SCORE_SIGMOID;
        d.sigmoid_bias = -1.5f;
    }
    kva_plan_params pp;
    kva_plan_params_init(&pp);
    pp.batch_size = B;
    pp.qo_indptr = c->op == KVA_OP_BATCH_DECODE ? NULL : qo_indptr;
    pp.kv_indptr = kv_indptr;
    if (paged) {
        pp.kv_last_page_len = last;
        pp.page_size = ps;
        pp.num_pages = npages;
    }
    pp.fixed_split_size = c->fixed_split;
    /* out[2] (sigmoid only): the CPU backend's output with |v| for v, i.e. sum_j p_j |v_j| per element: the scale
       of an unnormalised sum, to which the tensor cores' 16-bit P rounding error is proportional */
    float* out[3] = {NULL, NULL, NULL};
    float* lse[3] = {NULL, NULL, NULL};
    kva_plan_info info[3];
    memset(info, 0, sizeof info);
    kva_fault_report fr;
    memset(&fr, 0, sizeof fr);
    int ok = 1;
    void* hv_abs = NULL;
    if (c->sigmoid) {
        hv_abs = malloc(kv_elems * kes + 16);
        memcpy(hv_abs, hv, kv_elems * kes);
        for (size_t i = 0; i < kv_elems; ++i) { /* clear the sign bit of every element */
            unsigned char* b = (unsigned char*)hv_abs + i * kes + (kes - 1);
            *b &= 0x7f;
        }
    }
    for (int be = 0; be < (c->sigmoid ? 3 : 2); ++be) {
        kva_context* ctx = be == 0 ? gpu : cpu;
        const int dev = be == 0;
        size_t db = 0, hb = 0;
        kva_status st = kva_plan_workspace_size(ctx, &d, c->op, &pp, &db, &hb);
        if (st != KVA_OK) {
            CHECK(0, "%s: workspace size on %s: %s", c->tag, dev ? "cuda" : "cpu", kva_last_error_message());
            ok = 0;
            break;
        }
        kva_workspace ws;
        memset(&ws, 0, sizeof ws);
        ws.device_bytes = db;
        ws.host_bytes = hb;
        void *k, *v, *q, *o, *l, *ind = NULL, *mk = NULL;
        const size_t kb = kv_elems * kes, qb = (size_t)rows * HQ * D * qes, ob = (size_t)rows * HQ * D * oes,
                     lb = (size_t)rows * HQ * 4;
        if (dev) {
            CU(cudaMalloc(&ws.device, db > 0 ? db : 256));
            CU(cudaMallocHost(&ws.host, hb > 0 ? hb : 256));
            CU(cudaMalloc(&k, kb + 16));
            CU(cudaMalloc(&v, kb + 16));
            CU(cudaMalloc(&q, qb + 16));
            CU(cudaMalloc(&o, ob + 16));
            CU(cudaMalloc(&l, lb + 16));
            CU(cudaMemcpy(k, hk, kb, cudaMemcpyHostToDevice));
            CU(cudaMemcpy(v, hv, kb, cudaMemcpyHostToDevice));
            CU(cudaMemcpy(q, hq, qb, cudaMemcpyHostToDevice));
            CU(cudaMemset(o, 0xff, ob)); /* NaN poison: unwritten outputs fail */
            CU(cudaMemset(l, 0xff, lb));
            if (paged) {
                CU(cudaMalloc(&ind, sizeof(int) * (size_t)(kv_indptr[B] + 1)));
                CU(cudaMemcpy(ind, indices, sizeof(int) * (size_t)(kv_indptr[B] + 1), cudaMemcpyHostToDevice));
            }
            if (mask) {
                CU(cudaMalloc(&mk, (size_t)(mask_bits / 8 + 1)));
                CU(cudaMemcpy(mk, mask, (size_t)(mask_bits / 8 + 1), cudaMemcpyHostToDevice));
            }
        } else {
            ws.device = aligned_alloc(256, (db + 255) / 256 * 256 + 256);
            ws.host = NULL;
            k = hk;
            v = be == 2 ? hv_abs : hv;
            q = hq;
            o = malloc(ob + 16);
            l = malloc(lb + 16);
            memset(o, 0xff, ob);
            memset(l, 0xff, lb);
            ind = indices;
            mk = mask;
        }
        if (dev && c->fault_req >= 0 && paged) { /* poison the request's last page on the device copy only */
            int bad = (int)npages + 1000;
            CU(cudaMemcpy((int*)ind + kv_indptr[c->fault_req + 1] - 1, &bad, sizeof bad, cudaMemcpyHostToDevice));
        }
        kva_plan plan;
        st = kva_plan_make(ctx, &d, c->op, &pp, &ws, &plan, NULL);
        if (st != KVA_OK) {
            CHECK(0, "%s: plan on %s: %s", c->tag, dev ? "cuda" : "cpu", kva_last_error_message());
            ok = 0;
        } else {
            kva_plan_get_info(&plan, &info[be]);
            kva_run_args a;
            kva_run_args_init(&a);
            a.q = kva_tensor_make(q, c->qt, 3, rows, HQ, D, 0);
            a.o = kva_tensor_make(o, c->ot, 3, rows, HQ, D, 0);
            if (!c->sigmoid) a.lse = kva_tensor_make(l, KVA_DTYPE_F32, 2, rows, HQ, 0, 0);
            if (paged) {
                KV(kva_paged_kv_init(&a.paged, k, v, c->kt, c->hnd ? KVA_LAYOUT_HND : KVA_LAYOUT_NHD, npages, ps, HK, D, D));
                a.paged.indices = (const int32_t*)ind;
            } else {
                a.k = kva_tensor_make(k, c->kt, 3, tokens, HK, D, 0);
                a.v = kva_tensor_make(v, c->kt, 3, tokens, HK, D, 0);
            }
            a.custom_mask = (const uint8_t*)mk;
            a.custom_mask_bytes = mask ? mask_bits / 8 : 0;
            if (kes == 1) {
                a.k_scale = 0.75f;
                a.v_scale = 1.25f;
            }
            st = kva_run(ctx, &plan, &ws, &a);
            if (st != KVA_OK) {
                CHECK(0, "%s: run on %s: %s", c->tag, dev ? "cuda" : "cpu", kva_last_error_message());
                ok = 0;
            }
            if (dev) {
                CU(cudaDeviceSynchronize());
                KV(kva_read_faults(ctx, &ws, &fr, NULL));
            }
            out[be] = (float*)malloc(sizeof(float) * (size_t)rows * HQ * D);
            lse[be] = (float*)malloc(sizeof(float) * (size_t)rows * HQ);
            void* ho = malloc(ob);
            if (dev) {
                CU(cudaMemcpy(ho, o, ob, cudaMemcpyDeviceToHost));
                CU(cudaMemcpy(lse[be], l, lb, cudaMemcpyDeviceToHost));
            } else {
                memcpy(ho, o, ob);
                memcpy(lse[be], l, lb);
            }
            for (size_t i = 0; i < (size_t)rows * HQ * D; ++i)
                out[be][i] = c->ot == KVA_DTYPE_F32 ? ((float*)ho)[i] : load16((const uint16_t*)ho, i, c->ot);
            free(ho);
        }
        if (dev) {
            cudaFree(ws.device);
            cudaFreeHost(ws.host);
            cudaFree(k);
            cudaFree(v);
            cudaFree(q);
            cudaFree(o);
            cudaFree(l);
            if (ind) cudaFree(ind);
            if (mk) cudaFree(mk);
        } else {
            free(ws.device);
            free(o);
            free(l);
        }
        if (!ok) break;
    }
    if (ok) {
        /* tolerance: the output dtype's rounding plus the 16-bit P and (converted) K/V of the tensor cores */
        const double atol = (c->ot == KVA_DTYPE_BF16 || c->qt == KVA_DTYPE_BF16 || c->kt == KVA_DTYPE_BF16) ? 2.5e-2 : 6e-3;
        const double rtol = 2e-2;
        double maxerr = 0, maxlse = 0;
        long long bad = 0, nan = 0;
        for (long long r = 0; r < rows; ++r) {
            int req = 0;
            while (req + 1 <= B && qo_indptr[req + 1] <= r) ++req;
            const int faulted_req = c->fault_req >= 0 && req == c->fault_req;
            for (int h = 0; h < HQ; ++h) {
                for (int e = 0; e < D; ++e) {
                    const size_t i = ((size_t)r * HQ + h) * D + e;
                    const double g = out[0][i], w = faulted_req ? 0.0 : out[1][i];
                    if (g != g) nan++;
                    const double err = fabs(g - w);
                    if (err > maxerr) maxerr = err;
                    /* sigmoid: + the 16-bit P rounding (2^-9 relative for bf16, 2^-11 f16) over the unnormalised
                       sum, bounded with 4x margin by scale * sum_j p_j |v_j| */
                    const double pscale = (c->qt == KVA_DTYPE_BF16 || c->kt == KVA_DTYPE_BF16) ? 1.0 / 128 : 1.0 / 512;
                    const double stol = out[2] && !faulted_req ? pscale * fabs(out[2][i]) : 0.0;
                    if (!(err <= atol + rtol * fabs(w) + stol)) bad++;
                }
                if (!c->sigmoid) {
                    const size_t i = (size_t)r * HQ + h;
                    const double g = lse[0][i], w = faulted_req ? -INFINITY : lse[1][i];
                    if (isinf(w) || isinf(g)) {
                        if (!(isinf(w) && isinf(g) && (w < 0) == (g < 0))) bad++;
                    } else {
                        const double err = fabs(g - w);
                        if (err > maxlse) maxlse = err;
                        if (!(err <= 2e-2 + 1e-3 * fabs(w))) bad++;
                    }
                }
            }
        }
        CHECK(bad == 0 && nan == 0,
              "%s: %lld mismatches, %lld NaN (max |o err| %.3g, max |lse err| %.3g; GPU tile_q %d items %d partials %d)",
              c->tag, bad, nan, maxerr, maxlse, info[0].tile_q, info[0].num_work_items, info[0].num_partials);
        if (c->fault_req >= 0) {
            CHECK(fr.faulted && fr.request == c->fault_req, "%s: fault report faulted=%d request=%d (expected %d)", c->tag,
                  fr.faulted, fr.request, c->fault_req);
        } else {
            CHECK(!fr.faulted, "%s: unexpected fault report (request %d)", c->tag, fr.request);
        }
        printf("  %-58s max|do| %.2e max|dlse| %.2e  tile %3d items %4d partials %3d\n", c->tag, maxerr, maxlse,
               info[0].tile_q, info[0].num_work_items, info[0].num_partials);
    }
    for (int be = 0; be < 3; ++be) {
        free(out[be]);
        free(lse[be]);
    }
    free(hv_abs);
    free(hk);
    free(hv);
    free(hq);
    free(indices);
    free(mask);
    free(qo_indptr);
    free(kv_indptr);
    free(last);
    return ok;
}

static int run_check(const char* only) {
    kva_context_options opt;
    kva_context_options_init(&opt);
    opt.backend = KVA_BACKEND_CUDA;
    kva_context* gpu = NULL;
    KV(kva_context_create(&opt, &gpu));
    opt.backend = KVA_BACKEND_CPU;
    kva_context* cpu = NULL;
    KV(kva_context_create(&opt, &cpu));
    rng = 777;

    static const int qo_a[] = {37, 1, 130, 64, 5, 300, 17, 2};
    static const int kv_a[] = {37, 50, 130, 700, 400, 300, 33, 1000}; /* qo <= kv: prefill and appends */
    static const int qo_long[] = {520, 3};
    static const int kv_long[] = {1300, 2100};
    char tag[160];
    ccase c;
#define BASE(op_, hq_, hkv_, d_, t_)                                                                 \
    do {                                                                                            \
        memset(&c, 0, sizeof c);                                                                    \
        c.op = (op_);                                                                               \
        c.hq = (hq_);                                                                               \
        c.hkv = (hkv_);                                                                             \
        c.d = (d_);                                                                                 \
        c.qt = c.kt = c.ot = (t_);                                                                  \
        c.batch = 8;                                                                                \
        c.qo = qo_a;                                                                                \
        c.kv = kv_a;                                                                                \
        c.page_size = 16;                                                                           \
        c.mask = KVA_MASK_CAUSAL;                                                                   \
        c.window = -1;                                                                              \
        c.pos = KVA_POS_NONE;                                                                       \
        c.fault_req = -1;                                                                           \
        c.tag = tag;                                                                                \
    } while (0)
#define RUN()                                                              \
    do {                                                                   \
        if (only_match(only, tag, NULL)) check_case(gpu, cpu, &c);         \
    } while (0)

    /* group sizes x page sizes x ops, causal, bf16, D 128 */
    static const int groups[] = {1, 2, 3, 4, 5, 7, 8, 16};
    static const int pss[] = {1, 3, 16};
    for (int gi = 0; gi < 8; ++gi)
        for (int pi = 0; pi < 3; ++pi)
            for (int op = 1; op <= 2; ++op) {
                if (op == 2 && pi > 0) continue;
                BASE((kva_op)op, 2 * groups[gi], 2, 128, KVA_DTYPE_BF16);
                c.page_size = pss[pi];
                snprintf(tag, sizeof tag, "%s g%d ps%d causal bf16 D128", op == 1 ? "paged" : "ragged", groups[gi],
                         op == 1 ? pss[pi] : 0);
                RUN();
            }
    /* head dims x dtypes x tiles (short and long queries) */
    static const int dims[] = {64, 128, 256};
    static const kva_dtype dts[] = {KVA_DTYPE_BF16, KVA_DTYPE_F16};
    for (int di = 0; di < 3; ++di)
        for (int ti = 0; ti < 2; ++ti)
            for (int lg = 0; lg < 2; ++lg) {
                BASE(KVA_OP_BATCH_PREFILL_PAGED, 8, 2, dims[di], dts[ti]);
                if (lg) {
                    c.batch = 2;
                    c.qo = qo_long;
                    c.kv = kv_long;
                }
                snprintf(tag, sizeof tag, "paged g4 D%d %s %s", dims[di], ti ? "f16" : "bf16", lg ? "long" : "short");
                RUN();
            }
    /* page sizes of the Hopper kernel's per-page TMA copies (16-128 dividing 128, multiples of 128), long queries
       (128-row tiles); split chunks that start on and off a page boundary (off: those items' tiles take cp.async);
       HND; page sizes 8, 4, 2, 1, 24 (cp.async only) */
    static const int tps[] = {8, 32, 64, 128, 256, 4, 2, 1, 24};
    for (int pi = 0; pi < 9; ++pi)
        for (int v = 0; v < 3; ++v) {
            BASE(KVA_OP_BATCH_PREFILL_PAGED, 8, 2, 128, KVA_DTYPE_BF16);
            c.batch = 2;
            c.qo = qo_long;
            c.kv = kv_long;
            c.page_size = tps[pi];
            if (v == 1) c.fixed_split = tps[pi] * 3 > 600 ? 640 : 136;
            if (v == 2) c.hnd = 1;
            snprintf(tag, sizeof tag, "paged g4 ps%d long%s", tps[pi],
                     v == 1 ? (c.fixed_split == 640 ? ", split 640" : ", split 136") : v == 2 ? ", HND" : "");
            RUN();
        }
    /* variants */
    for (int var = 0; var < 12; ++var) {
        BASE(KVA_OP_BATCH_PREFILL_PAGED, 12, 4, 128, KVA_DTYPE_BF16);
        const char* vn = "";
        switch (var) {
        case 0: c.mask = KVA_MASK_NONE; vn = "no mask"; break;
        case 1: c.mask = KVA_MASK_CUSTOM; vn = "custom mask"; break;
        case 2: c.window = 40; vn = "causal + window 40"; break;
        case 3: c.mask = KVA_MASK_NONE; c.window = 100; vn = "window 100 only"; break;
        case 4: c.softcap = 30.0f; vn = "soft cap 30"; break;
        case 5: c.pos = KVA_POS_ALIBI; vn = "alibi"; break;
        case 6: c.pos = KVA_POS_ROPE_LLAMA; vn = "rope"; break;
        case 7: c.sigmoid = 1; vn = "sigmoid"; break;
        case 8: c.sigmoid = 1; c.mask = KVA_MASK_CUSTOM; vn = "sigmoid + custom"; break;
        case 9: c.softcap = 20.0f; c.pos = KVA_POS_ALIBI; c.window = 64; vn = "cap + alibi + window"; break;
        case 10: c.hnd = 1; vn = "HND layout"; break;
        case 11: c.ot = KVA_DTYPE_F32; c.pos = KVA_POS_ROPE_LLAMA; vn = "f32 out + rope"; break;
        }
        snprintf(tag, sizeof tag, "paged g3 D128 bf16 %s", vn);
        RUN();
        c.fixed_split = 64;
        snprintf(tag, sizeof tag, "paged g3 D128 bf16 %s, split 64", vn);
        RUN();
    }
    /* fp8 KV, mixed dtypes, ragged variants */
    for (int var = 0; var < 6; ++var) {
        BASE(KVA_OP_BATCH_PREFILL_PAGED, 14, 2, 128, KVA_DTYPE_BF16);
        const char* vn = "";
        switch (var) {
        case 0: c.kt = KVA_DTYPE_E4M3; vn = "e4m3 KV"; break;
        case 1: c.kt = KVA_DTYPE_E5M2; c.qt = c.ot = KVA_DTYPE_F16; vn = "e5m2 KV f16"; break;
        case 2: c.kt = KVA_DTYPE_E4M3; c.pos = KVA_POS_ROPE_LLAMA; vn = "e4m3 KV + rope"; break;
        case 3: c.kt = KVA_DTYPE_F16; vn = "bf16 q, f16 KV"; break;
        case 4: c.op = KVA_OP_BATCH_PREFILL_RAGGED; c.pos = KVA_POS_ROPE_LLAMA; vn = "ragged rope"; break;
        case 5: c.op = KVA_OP_BATCH_PREFILL_RAGGED; c.mask = KVA_MASK_CUSTOM; c.fixed_split = 96; vn = "ragged custom split"; break;
        }
        snprintf(tag, sizeof tag, "g7 D128 %s", vn);
        RUN();
    }
    /* decode with large groups (tensor-core path when the backend picks it) and small ones */
    static const int dg[] = {3, 5, 7, 8, 16};
    for (int gi = 0; gi < 5; ++gi)
        for (int pi = 0; pi < 3; ++pi) {
            BASE(KVA_OP_BATCH_DECODE, 2 * dg[gi], 2, 128, KVA_DTYPE_BF16);
            c.mask = KVA_MASK_NONE;
            c.page_size = pss[pi];
            snprintf(tag, sizeof tag, "decode g%d ps%d", dg[gi], pss[pi]);
            RUN();
        }
    /* fault injection: request 3's last page out of range */
    BASE(KVA_OP_BATCH_PREFILL_PAGED, 8, 2, 128, KVA_DTYPE_BF16);
    c.fault_req = 3;
    snprintf(tag, sizeof tag, "fault injection (request 3)");
    RUN();
    c.fixed_split = 128;
    snprintf(tag, sizeof tag, "fault injection (request 3), split 128");
    RUN();
    kva_context_destroy(gpu);
    kva_context_destroy(cpu);
    printf("%d passed, %d failed\n", npass, nfail);
    return nfail ? 1 : 0;
#undef BASE
#undef RUN
}

int main(int argc, char** argv) {
    int iters = 30, quick = 0, check = 0, interleave = 0;
    const char* csv = NULL;
    const char* only = NULL;
    for (int i = 1; i < argc; ++i) {
        if (!strcmp(argv[i], "--iters") && i + 1 < argc) iters = atoi(argv[++i]);
        else if (!strcmp(argv[i], "--csv") && i + 1 < argc) csv = argv[++i];
        else if (!strcmp(argv[i], "--only") && i + 1 < argc) only = argv[++i];
        else if (!strcmp(argv[i], "--seed") && i + 1 < argc) rng = strtoull(argv[++i], NULL, 10) | 1;
        else if (!strcmp(argv[i], "--quick")) quick = 1;
        else if (!strcmp(argv[i], "--interleave")) interleave = 1;
        else if (!strcmp(argv[i], "--check")) check = 1;
        else {
            fprintf(stderr, "usage: %s [--check] [--iters N] [--csv FILE] [--only 'A|B' (substrings)] [--quick] [--seed S] [--interleave]\n", argv[0]);
            return 2;
        }
    }
    if (iters < 5) iters = 5;
    if (check) return run_check(only);
    return run_bench(iters, csv, only, quick, interleave);
}
