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
 * usage: kva_bench_decode [--iters N] [--csv FILE] [--only SUBSTR] [--quick]
 */
#define _POSIX_C_SOURCE 200809L
#include <cuda_runtime_api.h>
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "kvattn.h"

#define CU(call)                                                                                    \
    do {                                                                                            \
        cudaError_t e_ = (call);                                                                    \
        if (e_ != cudaSuccess) {                                                                    \
            fprintf(stderr, "CUDA error %s at %s:%d: %s\n", cudaGetErrorName(e_), __FILE__, __LINE__, #call); \
            exit(1);                                                                                \
        }                                                                                           \
    } while (0)
#define KV(call)                                                                                    \
    do {                                                                                            \
        kva_status s_ = (call);                                                                     \
        if (s_ != KVA_OK) {                                                                         \
            fprintf(stderr, "kvattn error %s at %s:%d: %s\n", kva_status_string(s_), __FILE__, __LINE__, \
                    kva_last_error_message());                                                      \
            exit(1);                                                                                \
        }                                                                                           \
    } while (0)

typedef struct wl {
    char name[64];
    char label[96];
    int hq, hkv, d;
    kva_dtype kv;
    int page_size;
    int batch;
    int* lens;
    int graph; /* D7: time graph replays */
    char group[16];
} wl;

static uint64_t rng = 88172645463325252ull;
static uint64_t xs(void) {
    rng ^= rng << 13;
    rng ^= rng >> 7;
    rng ^= rng << 17;
    return rng;
}
static double unif(void) { return (double)(xs() >> 11) / 9007199254740992.0; }

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

static void build_workloads(int quick) {
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
}

static int cmp_f(const void* a, const void* b) {
    float x = *(const float*)a, y = *(const float*)b;
    return x < y ? -1 : x > y;
}
static double now_s(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec + t.tv_nsec * 1e-9;
}

int main(int argc, char** argv) {
    int iters = 30, quick = 0;
    const char* csv = NULL;
    const char* only = NULL;
    double hbm_override = 0;
    for (int i = 1; i < argc; ++i) {
        if (!strcmp(argv[i], "--iters") && i + 1 < argc) iters = atoi(argv[++i]);
        else if (!strcmp(argv[i], "--csv") && i + 1 < argc) csv = argv[++i];
        else if (!strcmp(argv[i], "--only") && i + 1 < argc) only = argv[++i];
        else if (!strcmp(argv[i], "--hbm") && i + 1 < argc) hbm_override = atof(argv[++i]);
        else if (!strcmp(argv[i], "--quick")) quick = 1;
        else {
            fprintf(stderr, "usage: %s [--iters N] [--csv FILE] [--only SUBSTR] [--hbm TB/s] [--quick]\n", argv[0]);
            return 2;
        }
    }
    if (iters < 5) iters = 5;
    build_workloads(quick);

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

    /* L2 flush buffer */
    const size_t flush_bytes = (size_t)512 << 20;
    void* flush;
    CU(cudaMalloc(&flush, flush_bytes));
    /* one random source buffer replicated into pools */
    const size_t src_bytes = (size_t)64 << 20;
    uint16_t* hsrc = (uint16_t*)malloc(src_bytes);
    for (size_t i = 0; i < src_bytes / 2; ++i) {
        float f = (float)(unif() * 2 - 1);
        uint32_t u;
        memcpy(&u, &f, 4);
        hsrc[i] = (uint16_t)((u + 0x7fff + ((u >> 16) & 1)) >> 16);
    }
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
    if (fcsv) fprintf(fcsv, "group,name,label,hq,hkv,d,kv_dtype,page_size,batch,bytes,kvattn_us,plan_us,lens\n");
    printf("%-28s %-12s %10s %10s %8s %8s %9s\n", "workload", "shape", "time_us", "TB/s", "%HBM", "plan_us", "bytes");

    for (int wi = 0; wi < nwl; ++wi) {
        wl* w = &wls[wi];
        if (only && !strstr(w->name, only) && !strstr(w->group, only)) continue;
        const int B = w->batch, HQ = w->hq, HK = w->hkv, D = w->d, ps = w->page_size;
        const size_t kes = kva_dtype_size(w->kv);
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
        int* indices = (int*)malloc(sizeof(int) * (size_t)npages);
        for (int64_t i = 0; i < npages; ++i) indices[i] = (int)i;
        for (int64_t i = npages - 1; i > 0; --i) { /* scattered pages */
            int64_t j = (int64_t)(xs() % (uint64_t)(i + 1));
            int t = indices[i];
            indices[i] = indices[j];
            indices[j] = t;
        }
        const size_t pool_bytes = (size_t)npages * ps * HK * D * kes;
        void *k, *v, *q, *o, *lse;
        int* dind;
        CU(cudaMalloc(&k, pool_bytes));
        CU(cudaMalloc(&v, pool_bytes));
        for (size_t off = 0; off < pool_bytes; off += src_bytes) {
            size_t n = pool_bytes - off < src_bytes ? pool_bytes - off : src_bytes;
            CU(cudaMemcpy((char*)k + off, dsrc, n, cudaMemcpyDeviceToDevice));
            CU(cudaMemcpy((char*)v + off, (char*)dsrc + (src_bytes - n) / 2 / 16 * 16, n, cudaMemcpyDeviceToDevice));
        }
        if (kes == 1) { /* keep fp8 finite: bytes of bf16 randoms include NaN patterns; clear the top bit pairs */
            CU(cudaMemset(k, 0x11, pool_bytes));
            CU(cudaMemset(v, 0x22, pool_bytes));
        }
        CU(cudaMalloc(&q, (size_t)B * HQ * D * 2));
        CU(cudaMalloc(&o, (size_t)B * HQ * D * 2));
        CU(cudaMalloc(&lse, (size_t)B * HQ * 4));
        CU(cudaMemcpy(q, dsrc, (size_t)B * HQ * D * 2, cudaMemcpyDeviceToDevice));
        CU(cudaMalloc((void**)&dind, sizeof(int) * (size_t)npages));
        CU(cudaMemcpy(dind, indices, sizeof(int) * (size_t)npages, cudaMemcpyHostToDevice));

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
        }
        size_t db = 0, hb = 0;
        if (w->graph) KV(kva_workspace_bound(ctx, &d, KVA_OP_BATCH_DECODE, B, B, &db, &hb));
        else KV(kva_plan_workspace_size(ctx, &d, KVA_OP_BATCH_DECODE, &pp, &db, &hb));
        kva_workspace ws;
        memset(&ws, 0, sizeof ws);
        ws.device_bytes = db;
        ws.host_bytes = hb;
        CU(cudaMalloc(&ws.device, db));
        CU(cudaMallocHost(&ws.host, hb));
        kva_plan plan;
        /* plan time (host) */
        float pt[15];
        for (int i = 0; i < 15; ++i) {
            double t0 = now_s();
            KV(kva_plan_make(ctx, &d, KVA_OP_BATCH_DECODE, &pp, &ws, &plan, s));
            pt[i] = (float)((now_s() - t0) * 1e6);
        }
        qsort(pt, 15, sizeof(float), cmp_f);
        kva_run_args a;
        kva_run_args_init(&a);
        a.q = kva_tensor_make(q, KVA_DTYPE_BF16, 3, B, HQ, D, 0);
        a.o = kva_tensor_make(o, KVA_DTYPE_BF16, 3, B, HQ, D, 0);
        a.lse = kva_tensor_make(lse, KVA_DTYPE_F32, 2, B, HQ, 0, 0);
        KV(kva_paged_kv_init(&a.paged, k, v, w->kv, KVA_LAYOUT_NHD, npages, ps, HK, D, D));
        a.paged.indices = dind;
        a.stream = s;

        const double bytes = (double)tokens * HK * 2 * D * kes + (double)B * HQ * D * 2 * 2;
        float* times = (float*)malloc(sizeof(float) * (size_t)iters);
        cudaGraphExec_t exec = NULL;
        cudaGraph_t graph = NULL;
        if (w->graph) {
            CU(cudaStreamSynchronize(s));
            CU(cudaStreamBeginCapture(s, cudaStreamCaptureModeThreadLocal));
            KV(kva_run(ctx, &plan, &ws, &a));
            CU(cudaStreamEndCapture(s, &graph));
            CU(cudaGraphInstantiate(&exec, graph, 0));
        }
        for (int it = -3; it < iters; ++it) {
            CU(cudaMemsetAsync(flush, it & 0xff, flush_bytes, s));
            CU(cudaEventRecord(e0, s));
            if (w->graph) CU(cudaGraphLaunch(exec, s));
            else KV(kva_run(ctx, &plan, &ws, &a));
            CU(cudaEventRecord(e1, s));
            CU(cudaEventSynchronize(e1));
            float ms = 0;
            CU(cudaEventElapsedTime(&ms, e0, e1));
            if (it >= 0) times[it] = ms * 1000.0f;
        }
        qsort(times, (size_t)iters, sizeof(float), cmp_f);
        const double t_us = times[iters / 2];
        const double tbs = bytes / (t_us * 1e-6) / 1e12;
        const char* nm = w->name;
        printf("%-28s %-12s %10.1f %10.3f %7.1f%% %8.1f %9.3g\n", nm, w->label, t_us, tbs, 100.0 * tbs / hbm,
               (double)pt[7], bytes);
        double warm_us = 0;
        if (w->graph) { /* back-to-back replays, warm L2: the per-call cost in a captured decode step */
            const int reps = 200;
            CU(cudaEventRecord(e0, s));
            for (int r = 0; r < reps; ++r) CU(cudaGraphLaunch(exec, s));
            CU(cudaEventRecord(e1, s));
            CU(cudaEventSynchronize(e1));
            float ms = 0;
            CU(cudaEventElapsedTime(&ms, e0, e1));
            warm_us = ms * 1000.0 / reps;
            printf("%-28s %-12s %10.1f us per replay, back to back (warm L2)\n", "D7 graph replay (warm)", w->label,
                   warm_us);
            cudaGraphExecDestroy(exec);
            cudaGraphDestroy(graph);
        }
        if (fcsv) {
            fprintf(fcsv, "%s,%s,%s,%d,%d,%d,%s,%d,%d,%.0f,%.2f,%.1f,", w->group, nm, w->label, HQ, HK, D,
                    kva_dtype_name(w->kv), ps, B, bytes, t_us, (double)pt[7]);
            for (int b = 0; b < B; ++b) fprintf(fcsv, "%s%d", b ? ";" : "", w->lens[b]);
            fprintf(fcsv, "\n");
            if (w->graph) {
                fprintf(fcsv, "%s,%s (warm),%s,%d,%d,%d,%s,%d,%d,%.0f,%.2f,%.1f,", w->group, nm, w->label, HQ, HK, D,
                        kva_dtype_name(w->kv), ps, B, bytes, warm_us, (double)pt[7]);
                for (int b = 0; b < B; ++b) fprintf(fcsv, "%s%d", b ? ";" : "", w->lens[b]);
                fprintf(fcsv, "\n");
            }
            fflush(fcsv);
        }
        fflush(stdout);
        free(times);
        cudaFree(k);
        cudaFree(v);
        cudaFree(q);
        cudaFree(o);
        cudaFree(lse);
        cudaFree(dind);
        cudaFree(ws.device);
        cudaFreeHost(ws.host);
        free(indptr);
        free(last);
        free(indices);
    }
    /* measured read ceiling: a device-to-device copy of 2 GB (read + write) */
    {
        size_t nb = (size_t)1 << 30;
        void *a, *b;
        if (cudaMalloc(&a, nb) == cudaSuccess && cudaMalloc(&b, nb) == cudaSuccess) {
            float best = 1e30f;
            for (int i = 0; i < 5; ++i) {
                CU(cudaEventRecord(e0, s));
                CU(cudaMemcpyAsync(b, a, nb, cudaMemcpyDeviceToDevice, s));
                CU(cudaEventRecord(e1, s));
                CU(cudaEventSynchronize(e1));
                float ms;
                CU(cudaEventElapsedTime(&ms, e0, e1));
                if (ms < best) best = ms;
            }
            printf("device copy ceiling: %.3f TB/s (read + write of 1 GiB)\n", 2.0 * nb / (best * 1e-3) / 1e12);
            cudaFree(a);
            cudaFree(b);
        }
    }
    if (fcsv) fclose(fcsv);
    kva_context_destroy(ctx);
    return 0;
}
