/*
 * bench_formats.c - kva_bench_formats: the composable-format workloads of the benchmark plan on the CUDA backend.
 *
 *   C1 cascade: MHA 32 heads, D 128, page 16, bf16; a shared prefix of {1k, 8k, 32k} tokens, a unique suffix of
 *      128 tokens per request, batch {16, 64, 256}, one decode step. Two-level cascade (level 0: the prefix, all
 *      rows in one group; level 1: each request's suffix) against flat batch decode over the concatenated page
 *      tables (the prefix pages are shared through the tables, no copies).
 *   C2 block sparsity (Quest-like): batch-1 decode, heads 32/32, D 128, bf16, block 16; seq {4k, 8k, 16k, 32k};
 *      a page budget of {64, 128, 256, 512} pages chosen at random (sorted, always with the last page). kvattn
 *      BSR (M = 1, R = 1, C = 16) against kvattn dense decode over the whole sequence. The torch peers (SDPA and
 *      FlexAttention with a block mask) are in bench/peers_formats.py.
 *
 * Every case also checks the composed result against the plain op over the same keys (cascade vs flat decode; BSR
 * vs batch decode over the selected pages) and prints the largest difference. Times: cold L2 (a 512 MB memset
 * before every timed call), CUDA events, median of --iters runs after 3 warm-up runs.
 *
 *   kva_bench_formats [--only c1|c2] [--iters N] [--quick] [--csv FILE]
 */
#define _POSIX_C_SOURCE 200809L
#include <math.h>
#include <string.h>

#include "bench_util.h"

static void* g_flush;
static size_t g_flush_bytes;
static cudaEvent_t g_e0, g_e1;
static int g_iters = 30;

/* Median time (us) of a body run on stream s with a cold L2. */
#define TIME_US(out_us, s, body)                                                      \
    do {                                                                              \
        float* t_ = (float*)malloc(sizeof(float) * (size_t)g_iters);                  \
        for (int it_ = -3; it_ < g_iters; ++it_) {                                    \
            CU(cudaMemsetAsync(g_flush, it_ & 0xff, g_flush_bytes, (s)));             \
            CU(cudaEventRecord(g_e0, (s)));                                           \
            body;                                                                     \
            CU(cudaEventRecord(g_e1, (s)));                                           \
            CU(cudaEventSynchronize(g_e1));                                           \
            float ms_;                                                                \
            CU(cudaEventElapsedTime(&ms_, g_e0, g_e1));                               \
            if (it_ >= 0) t_[it_] = ms_;                                              \
        }                                                                             \
        qsort(t_, (size_t)g_iters, sizeof(float), cmp_f);                             \
        (out_us) = 1000.0 * t_[g_iters / 2];                                          \
        free(t_);                                                                     \
    } while (0)

/* Fill n bytes of device memory with random bf16 values in [-1, 1). */
static void fill_random_bf16(void* dst, size_t bytes) {
    static void* src = NULL;
    static const size_t src_bytes = (size_t)32 << 20;
    if (!src) {
        uint16_t* h = (uint16_t*)malloc(src_bytes);
        for (size_t i = 0; i < src_bytes / 2; ++i) h[i] = f2bf((float)(unif() * 2 - 1));
        CU(cudaMalloc(&src, src_bytes));
        CU(cudaMemcpy(src, h, src_bytes, cudaMemcpyHostToDevice));
        free(h);
    }
    for (size_t off = 0; off < bytes; off += src_bytes) {
        size_t n = bytes - off < src_bytes ? bytes - off : src_bytes;
        /* rotate the source a little per chunk so that chunks differ */
        size_t shift = ((off / src_bytes) * 4096) % (src_bytes / 2);
        shift &= ~(size_t)1;
        size_t n1 = n < src_bytes - shift ? n : src_bytes - shift;
        CU(cudaMemcpy((char*)dst + off, (char*)src + shift, n1, cudaMemcpyDeviceToDevice));
        if (n1 < n) CU(cudaMemcpy((char*)dst + off + n1, src, n - n1, cudaMemcpyDeviceToDevice));
    }
}

/* Largest |a - b| of two bf16 device arrays of n elements (and the largest |b|). */
static double max_diff_bf16(const void* a, const void* b, size_t n, double* max_ref) {
    uint16_t* ha = (uint16_t*)malloc(n * 2);
    uint16_t* hb = (uint16_t*)malloc(n * 2);
    CU(cudaMemcpy(ha, a, n * 2, cudaMemcpyDeviceToHost));
    CU(cudaMemcpy(hb, b, n * 2, cudaMemcpyDeviceToHost));
    double m = 0, r = 0;
    for (size_t i = 0; i < n; ++i) {
        double x = bf2f(ha[i]), y = bf2f(hb[i]);
        double d = fabs(x - y);
        if (!(d <= m)) m = d; /* NaN propagates */
        if (fabs(y) > r) r = fabs(y);
    }
    free(ha);
    free(hb);
    if (max_ref) *max_ref = r;
    return m;
}

typedef struct dev_ws {
    kva_workspace ws;
} dev_ws;

static void ws_alloc(dev_ws* w, size_t dev, size_t host) {
    memset(w, 0, sizeof *w);
    if (dev) CU(cudaMalloc(&w->ws.device, dev));
    if (host) CU(cudaMallocHost(&w->ws.host, host));
    w->ws.device_bytes = dev;
    w->ws.host_bytes = host;
}
static void ws_free(dev_ws* w) {
    if (w->ws.device) CU(cudaFree(w->ws.device));
    if (w->ws.host) CU(cudaFreeHost(w->ws.host));
    memset(w, 0, sizeof *w);
}

static int32_t* dev_i32(const int32_t* h, size_t n) {
    int32_t* d = NULL;
    CU(cudaMalloc((void**)&d, n * sizeof(int32_t) + 4));
    if (n) CU(cudaMemcpy(d, h, n * sizeof(int32_t), cudaMemcpyHostToDevice));
    return d;
}

/* ---------------------------------------------------------------------------------------------- */
/* C1 cascade                                                                                      */

static void run_c1(kva_context* ctx, cudaStream_t s, int64_t prefix, int32_t batch, FILE* csv) {
    const int32_t H = 32, D = 128, ps = 16, suffix = 128;
    const int64_t pre_pages = prefix / ps, suf_pages = suffix / ps;
    const int64_t pages = pre_pages + (int64_t)batch * suf_pages;
    const size_t page_elems = (size_t)ps * H * D;
    void *kp, *vp, *q, *o_flat, *o_casc;
    CU(cudaMalloc(&kp, (size_t)pages * page_elems * 2));
    CU(cudaMalloc(&vp, (size_t)pages * page_elems * 2));
    CU(cudaMalloc(&q, (size_t)batch * H * D * 2));
    CU(cudaMalloc(&o_flat, (size_t)batch * H * D * 2));
    CU(cudaMalloc(&o_casc, (size_t)batch * H * D * 2));
    fill_random_bf16(kp, (size_t)pages * page_elems * 2);
    fill_random_bf16(vp, (size_t)pages * page_elems * 2);
    fill_random_bf16(q, (size_t)batch * H * D * 2);
    /* page ids: prefix pages at random places in the pool, then the suffix pages */
    int32_t* perm = (int32_t*)malloc(sizeof(int32_t) * (size_t)pages);
    for (int64_t i = 0; i < pages; ++i) perm[i] = (int32_t)i;
    for (int64_t i = pages - 1; i > 0; --i) {
        int64_t j = (int64_t)(xs() % (uint64_t)(i + 1));
        int32_t t = perm[i];
        perm[i] = perm[j];
        perm[j] = t;
    }
    const int32_t* pre = perm;
    const int32_t* suf = perm + pre_pages;

    kva_attention_desc desc;
    kva_attention_desc_init(&desc, H, H, D, KVA_DTYPE_BF16);
    kva_paged_kv pk;
    KV(kva_paged_kv_init(&pk, kp, vp, KVA_DTYPE_BF16, KVA_LAYOUT_NHD, pages, ps, H, D, D));

    /* flat decode */
    const int64_t per_req = pre_pages + suf_pages;
    int32_t* f_indptr = (int32_t*)malloc(sizeof(int32_t) * (size_t)(batch + 1));
    int32_t* f_lpl = (int32_t*)malloc(sizeof(int32_t) * (size_t)batch);
    int32_t* f_idx = (int32_t*)malloc(sizeof(int32_t) * (size_t)(batch * per_req));
    for (int32_t b = 0; b < batch; ++b) {
        f_indptr[b] = (int32_t)(b * per_req);
        f_lpl[b] = ps;
        memcpy(f_idx + b * per_req, pre, sizeof(int32_t) * (size_t)pre_pages);
        memcpy(f_idx + b * per_req + pre_pages, suf + b * suf_pages, sizeof(int32_t) * (size_t)suf_pages);
    }
    f_indptr[batch] = (int32_t)(batch * per_req);
    int32_t* d_fidx = dev_i32(f_idx, (size_t)(batch * per_req));
    kva_plan_params pp;
    kva_plan_params_init(&pp);
    pp.batch_size = batch;
    pp.kv_indptr = f_indptr;
    pp.kv_last_page_len = f_lpl;
    pp.page_size = ps;
    pp.num_pages = pages;
    size_t db = 0, hb = 0;
    KV(kva_plan_workspace_size(ctx, &desc, KVA_OP_BATCH_DECODE, &pp, &db, &hb));
    dev_ws wf;
    ws_alloc(&wf, db, hb);
    kva_plan fplan;
    double t0 = now_s();
    KV(kva_batch_decode_plan(ctx, &desc, &pp, &wf.ws, &fplan, s));
    const double flat_plan_us = (now_s() - t0) * 1e6;
    kva_run_args ra;
    kva_run_args_init(&ra);
    ra.q = kva_tensor_make(q, KVA_DTYPE_BF16, 3, batch, H, D, 0);
    ra.o = kva_tensor_make(o_flat, KVA_DTYPE_BF16, 3, batch, H, D, 0);
    ra.paged = pk;
    ra.paged.indices = d_fidx;
    ra.stream = s;

    /* cascade: level 0 = the prefix for all rows, level 1 = each request's suffix */
    int32_t c0_qo[2] = {0, batch}, c0_kv[2] = {0, (int32_t)pre_pages}, c0_lpl[1] = {ps};
    int32_t* c1_qo = (int32_t*)malloc(sizeof(int32_t) * (size_t)(batch + 1));
    int32_t* c1_kv = (int32_t*)malloc(sizeof(int32_t) * (size_t)(batch + 1));
    for (int32_t b = 0; b <= batch; ++b) {
        c1_qo[b] = b;
        c1_kv[b] = (int32_t)(b * suf_pages);
    }
    kva_cascade_params cp;
    kva_cascade_params_init(&cp);
    cp.num_levels = 2;
    cp.page_size = ps;
    cp.num_pages = pages;
    cp.levels[0].batch_size = 1;
    cp.levels[0].qo_indptr = c0_qo;
    cp.levels[0].kv_indptr = c0_kv;
    cp.levels[0].kv_last_page_len = c0_lpl;
    cp.levels[0].kv_indices = pre;
    cp.levels[1].batch_size = batch;
    cp.levels[1].qo_indptr = c1_qo;
    cp.levels[1].kv_indptr = c1_kv;
    cp.levels[1].kv_last_page_len = f_lpl;
    cp.levels[1].kv_indices = suf;
    KV(kva_cascade_workspace_size(ctx, &desc, &cp, &db, &hb));
    dev_ws wc;
    ws_alloc(&wc, db, hb);
    kva_cascade_plan cplan;
    t0 = now_s();
    KV(kva_cascade_plan_make(ctx, &desc, &cp, &wc.ws, &cplan, s));
    const double casc_plan_us = (now_s() - t0) * 1e6;
    int32_t* d_pre = dev_i32(pre, (size_t)pre_pages);
    int32_t* d_suf = dev_i32(suf, (size_t)(batch * suf_pages));
    kva_cascade_run_args ca;
    kva_cascade_run_args_init(&ca);
    ca.q = ra.q;
    ca.o = kva_tensor_make(o_casc, KVA_DTYPE_BF16, 3, batch, H, D, 0);
    ca.paged = pk;
    ca.kv_indices[0] = d_pre;
    ca.kv_indices[1] = d_suf;
    ca.stream = s;

    double flat_us, casc_us;
    TIME_US(flat_us, s, KV(kva_batch_decode_run(ctx, &fplan, &wf.ws, &ra)));
    TIME_US(casc_us, s, KV(kva_cascade_run(ctx, &cplan, &wc.ws, &ca)));
    CU(cudaStreamSynchronize(s));
    kva_fault_report fr;
    KV(kva_read_faults(ctx, &wf.ws, &fr, s));
    int faulted = fr.faulted;
    KV(kva_cascade_read_faults(ctx, &cplan, &wc.ws, &fr, s));
    faulted |= fr.faulted;
    double ref_max = 0;
    const double diff = max_diff_bf16(o_casc, o_flat, (size_t)batch * H * D, &ref_max);
    const double flat_bytes = (double)batch * (double)(prefix + suffix) * H * D * 2 * 2;
    printf("C1 prefix %6lld batch %4d | flat %10.1f us (%5.2f TB/s logical) | cascade %9.1f us | speedup %6.2fx | "
           "plan %.0f / %.0f us | max|casc-flat| %.2e (|o| <= %.2f)%s\n",
           (long long)prefix, batch, flat_us, flat_bytes / flat_us * 1e-6, casc_us, flat_us / casc_us, flat_plan_us,
           casc_plan_us, diff, ref_max, faulted ? " FAULT" : "");
    if (csv)
        fprintf(csv, "C1,%lld,%d,%.2f,%.2f,,%.3f,%.3e\n", (long long)prefix, batch, flat_us, casc_us, flat_us / casc_us,
                diff);
    fflush(stdout);
    if (!(diff <= 0.02) || faulted) {
        fprintf(stderr, "C1: cascade differs from flat decode (%.3e) or faulted\n", diff);
        exit(1);
    }
    ws_free(&wf);
    ws_free(&wc);
    CU(cudaFree(kp));
    CU(cudaFree(vp));
    CU(cudaFree(q));
    CU(cudaFree(o_flat));
    CU(cudaFree(o_casc));
    CU(cudaFree(d_fidx));
    CU(cudaFree(d_pre));
    CU(cudaFree(d_suf));
    free(perm);
    free(f_indptr);
    free(f_lpl);
    free(f_idx);
    free(c1_qo);
    free(c1_kv);
}

/* ---------------------------------------------------------------------------------------------- */
/* C2 block sparsity                                                                               */

static void run_c2(kva_context* ctx, cudaStream_t s, int64_t seq, int32_t budget, FILE* csv) {
    const int32_t H = 32, D = 128, C = 16;
    const int64_t nb = seq / C;
    if (budget > nb) return;
    void *k, *v, *q, *o_bsr, *o_sel, *o_dense;
    const size_t kv_bytes = (size_t)seq * H * D * 2;
    CU(cudaMalloc(&k, kv_bytes));
    CU(cudaMalloc(&v, kv_bytes));
    CU(cudaMalloc(&q, (size_t)H * D * 2));
    CU(cudaMalloc(&o_bsr, (size_t)H * D * 2));
    CU(cudaMalloc(&o_sel, (size_t)H * D * 2));
    CU(cudaMalloc(&o_dense, (size_t)H * D * 2));
    fill_random_bf16(k, kv_bytes);
    fill_random_bf16(v, kv_bytes);
    fill_random_bf16(q, (size_t)H * D * 2);
    /* selection: the last block plus budget - 1 others, sorted */
    uint8_t* taken = (uint8_t*)calloc((size_t)nb, 1);
    taken[nb - 1] = 1;
    for (int32_t n = 1; n < budget;) {
        int64_t j = (int64_t)(xs() % (uint64_t)(nb - 1));
        if (!taken[j]) {
            taken[j] = 1;
            ++n;
        }
    }
    int32_t* sel = (int32_t*)malloc(sizeof(int32_t) * (size_t)budget);
    int32_t* all = (int32_t*)malloc(sizeof(int32_t) * (size_t)nb);
    for (int64_t j = 0, n = 0; j < nb; ++j) {
        all[j] = (int32_t)j;
        if (taken[j]) sel[n++] = (int32_t)j;
    }
    int32_t* d_sel = dev_i32(sel, (size_t)budget);
    int32_t* d_all = dev_i32(all, (size_t)nb);

    kva_attention_desc desc;
    kva_attention_desc_init(&desc, H, H, D, KVA_DTYPE_BF16);
    /* BSR: one block row of one query row */
    int32_t indptr[2] = {0, budget};
    kva_bsr_params bp;
    kva_bsr_params_init(&bp);
    bp.num_qo_rows = 1;
    bp.num_kv_rows = seq;
    bp.block_rows = 1;
    bp.block_cols = C;
    bp.indptr = indptr;
    bp.indices = sel;
    size_t db = 0, hb = 0;
    KV(kva_bsr_workspace_size(ctx, &desc, &bp, &db, &hb));
    dev_ws wb;
    ws_alloc(&wb, db, hb);
    kva_bsr_plan bplan;
    double t0 = now_s();
    KV(kva_bsr_plan_make(ctx, &desc, &bp, &wb.ws, &bplan, s));
    const double bsr_plan_us = (now_s() - t0) * 1e6;
    kva_bsr_run_args ba;
    kva_bsr_run_args_init(&ba);
    ba.q = kva_tensor_make(q, KVA_DTYPE_BF16, 3, 1, H, D, 0);
    ba.k = kva_tensor_make(k, KVA_DTYPE_BF16, 3, seq, H, D, 0);
    ba.v = kva_tensor_make(v, KVA_DTYPE_BF16, 3, seq, H, D, 0);
    ba.o = kva_tensor_make(o_bsr, KVA_DTYPE_BF16, 3, 1, H, D, 0);
    ba.indices = d_sel;
    ba.stream = s;

    /* decode over the selected pages (same keys; the check) and over all pages (dense) */
    kva_paged_kv pk;
    KV(kva_paged_kv_init(&pk, k, v, KVA_DTYPE_BF16, KVA_LAYOUT_NHD, nb, C, H, D, D));
    int32_t sel_ip[2] = {0, budget}, all_ip[2] = {0, (int32_t)nb}, lpl[1] = {C};
    kva_plan_params pp;
    kva_plan_params_init(&pp);
    pp.batch_size = 1;
    pp.kv_last_page_len = lpl;
    pp.page_size = C;
    pp.num_pages = nb;
    pp.kv_indptr = sel_ip;
    KV(kva_plan_workspace_size(ctx, &desc, KVA_OP_BATCH_DECODE, &pp, &db, &hb));
    dev_ws ws_sel;
    ws_alloc(&ws_sel, db, hb);
    kva_plan psel;
    KV(kva_batch_decode_plan(ctx, &desc, &pp, &ws_sel.ws, &psel, s));
    pp.kv_indptr = all_ip;
    KV(kva_plan_workspace_size(ctx, &desc, KVA_OP_BATCH_DECODE, &pp, &db, &hb));
    dev_ws ws_all;
    ws_alloc(&ws_all, db, hb);
    kva_plan pall;
    KV(kva_batch_decode_plan(ctx, &desc, &pp, &ws_all.ws, &pall, s));
    kva_run_args ra;
    kva_run_args_init(&ra);
    ra.q = ba.q;
    ra.paged = pk;
    ra.stream = s;
    kva_run_args rs = ra, rd = ra;
    rs.o = kva_tensor_make(o_sel, KVA_DTYPE_BF16, 3, 1, H, D, 0);
    rs.paged.indices = d_sel;
    rd.o = kva_tensor_make(o_dense, KVA_DTYPE_BF16, 3, 1, H, D, 0);
    rd.paged.indices = d_all;

    double bsr_us, sel_us, dense_us;
    TIME_US(bsr_us, s, KV(kva_bsr_run(ctx, &bplan, &wb.ws, &ba)));
    TIME_US(sel_us, s, KV(kva_batch_decode_run(ctx, &psel, &ws_sel.ws, &rs)));
    TIME_US(dense_us, s, KV(kva_batch_decode_run(ctx, &pall, &ws_all.ws, &rd)));
    CU(cudaStreamSynchronize(s));
    double ref_max = 0;
    const double diff = max_diff_bf16(o_bsr, o_sel, (size_t)H * D, &ref_max);
    const double bytes = (double)budget * C * H * D * 2 * 2;
    printf("C2 seq %6lld budget %4d | bsr %8.1f us (%5.2f TB/s) | decode(selected pages) %8.1f us | dense decode "
           "%8.1f us | dense/bsr %5.2fx | plan %.0f us | max|bsr-sel| %.2e (|o| <= %.2f)\n",
           (long long)seq, budget, bsr_us, bytes / bsr_us * 1e-6, sel_us, dense_us, dense_us / bsr_us, bsr_plan_us,
           diff, ref_max);
    if (csv)
        fprintf(csv, "C2,%lld,%d,%.2f,%.2f,%.2f,%.3f,%.3e\n", (long long)seq, budget, bsr_us, sel_us, dense_us,
                dense_us / bsr_us, diff);
    fflush(stdout);
    if (!(diff <= 0.02)) {
        fprintf(stderr, "C2: BSR differs from decode over the same pages (%.3e)\n", diff);
        exit(1);
    }
    ws_free(&wb);
    ws_free(&ws_sel);
    ws_free(&ws_all);
    CU(cudaFree(k));
    CU(cudaFree(v));
    CU(cudaFree(q));
    CU(cudaFree(o_bsr));
    CU(cudaFree(o_sel));
    CU(cudaFree(o_dense));
    CU(cudaFree(d_sel));
    CU(cudaFree(d_all));
    free(taken);
    free(sel);
    free(all);
}

int main(int argc, char** argv) {
    const char* only = NULL;
    const char* csv_path = NULL;
    int quick = 0;
    for (int i = 1; i < argc; ++i) {
        if (strcmp(argv[i], "--only") == 0 && i + 1 < argc) only = argv[++i];
        else if (strcmp(argv[i], "--iters") == 0 && i + 1 < argc) g_iters = atoi(argv[++i]);
        else if (strcmp(argv[i], "--csv") == 0 && i + 1 < argc) csv_path = argv[++i];
        else if (strcmp(argv[i], "--quick") == 0) quick = 1;
        else {
            printf("usage: %s [--only c1|c2] [--iters N] [--quick] [--csv FILE]\n", argv[0]);
            return strcmp(argv[i], "--help") == 0 ? 0 : 2;
        }
    }
    if (g_iters < 1) g_iters = 1;
    kva_context_options opt;
    kva_context_options_init(&opt);
    opt.backend = KVA_BACKEND_CUDA;
    kva_context* ctx = NULL;
    KV(kva_context_create(&opt, &ctx));
    struct cudaDeviceProp prop;
    CU(cudaGetDeviceProperties(&prop, 0));
    printf("device: %s (%d SMs), kvattn %s, iters %d, cold L2\n", prop.name, prop.multiProcessorCount, kva_version_string(),
           g_iters);
    g_flush_bytes = (size_t)512 << 20;
    CU(cudaMalloc(&g_flush, g_flush_bytes));
    CU(cudaEventCreate(&g_e0));
    CU(cudaEventCreate(&g_e1));
    cudaStream_t s;
    CU(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
    FILE* csv = csv_path ? fopen(csv_path, "w") : NULL;
    if (csv) fprintf(csv, "workload,a,b,t1_us,t2_us,t3_us,ratio,max_diff\n");
    if (!only || strcmp(only, "c1") == 0) {
        static const int64_t prefixes[3] = {1024, 8192, 32768};
        static const int32_t batches[3] = {16, 64, 256};
        for (int pi = 0; pi < 3; ++pi)
            for (int bi = 0; bi < 3; ++bi) {
                if (quick && !((pi == 1 && bi == 1) || (pi == 2 && bi == 2))) continue;
                run_c1(ctx, s, prefixes[pi], batches[bi], csv);
            }
    }
    if (!only || strcmp(only, "c2") == 0) {
        static const int64_t seqs[4] = {4096, 8192, 16384, 32768};
        static const int32_t budgets[4] = {64, 128, 256, 512};
        for (int si = 0; si < 4; ++si)
            for (int bi = 0; bi < 4; ++bi) {
                if (quick && !(bi == 2 && (si == 0 || si == 3))) continue;
                run_c2(ctx, s, seqs[si], budgets[bi], csv);
            }
    }
    if (csv) fclose(csv);
    KV(kva_context_destroy(ctx));
    return 0;
}
