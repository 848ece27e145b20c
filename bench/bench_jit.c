/*
 * bench_jit.c - workload H2: first-use compile time of a new user variant with a cold cache, and the load time of
 * the same variant from a warm cache (docs/variants.md). Targets: cold <= 10 s, hit <= 5 ms.
 *
 *   bench_jit [--reps N] [--backend cpu|cuda|all] [--variant sink|sigmoid]
 *
 * Rows (median and max over N repetitions; every cold repetition uses a fresh cache directory, so nothing is
 * shared between them):
 *   cpu create           kva_variant_create on a CPU context: the host C compiler builds the shared object (cold);
 *                        the object is found in the cache and dlopen'ed (hit)
 *   nvrtc hook check     the create-time NVRTC check of the hooks (no GPU; cold compile, hit = cache marker)
 *   nvrtc prefill kernel the variant's tensor-core prefill kernel (mma.sync) for sm_90a, bf16, head dim 128, tile 128
 *                        (no GPU: cold NVRTC compile into the cache; hit = the cubin read back)
 *   nvrtc decode kernel  the variant's decode kernel for sm_90a, bf16, head dim 128, tile 4 (no GPU: cold NVRTC
 *                        compile into the cache; hit = the cubin read back from the cache)
 *   cuda create + plan   (with a CUDA device) kva_variant_create and the first decode plan on a CUDA context
 *                        (cold: check + kernel compile; hit: a new context on the warm cache, module load included)
 * Prints a markdown table. Exits non-zero on any error.
 */
#define _POSIX_C_SOURCE 200809L
#include <dirent.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "kvattn.h"
#if defined(KVA_BENCH_NVRTC)
#include "cuda_internal.h"
#endif
#if defined(KVA_BENCH_CUDART)
#include <cuda_runtime_api.h>
#endif

#define KV(call)                                                                                    \
    do {                                                                                            \
        kva_status s_ = (call);                                                                     \
        if (s_ != KVA_OK) {                                                                         \
            fprintf(stderr, "kvattn error %s at %s:%d: %s\n", kva_status_string(s_), __FILE__, __LINE__, \
                    kva_last_error_message());                                                      \
            exit(1);                                                                                \
        }                                                                                           \
    } while (0)

static double now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec + 1e-9 * (double)t.tv_nsec;
}

static int cmp_d(const void* a, const void* b) {
    double x = *(const double*)a, y = *(const double*)b;
    return x < y ? -1 : x > y;
}

static void stats(double* v, int n, double* med, double* mx) {
    qsort(v, (size_t)n, sizeof *v, cmp_d);
    *med = n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
    *mx = v[n - 1];
}

static void rm_tree(const char* dir) {
    DIR* d = opendir(dir);
    if (!d) return;
    struct dirent* e;
    while ((e = readdir(d)) != NULL) {
        if (!strcmp(e->d_name, ".") || !strcmp(e->d_name, "..")) continue;
        char p[1200];
        snprintf(p, sizeof p, "%s/%s", dir, e->d_name);
        unlink(p);
    }
    closedir(d);
    rmdir(dir);
}

static const char* sink_src =
    "KVA_HOOK float kva_output_transform(const kva_vparams* p, float o, float lse, int batch, int qo_head, int q_pos,\n"
    "                                    int dim) {\n"
    "    (void)batch, (void)q_pos, (void)dim;\n"
    "    return o / (1.0f + expf(p->t[0][qo_head] - lse * 0.69314718055994531f));\n"
    "}\n";
static const char* sigmoid_src =
    "KVA_HOOK float kva_logits_transform(const kva_vparams* p, float logit, int batch, int qo_head, int kv_head,\n"
    "                                    int q_pos, int kv_pos) {\n"
    "    (void)batch, (void)qo_head, (void)kv_head, (void)q_pos, (void)kv_pos;\n"
    "    return 1.0f / (1.0f + expf(-(p->s[0] * logit + p->s[1])));\n"
    "}\n";

static int use_sigmoid;

static void spec_of(kva_variant_spec* s, const char* src) {
    kva_variant_spec_init(s);
    s->name = use_sigmoid ? "bench_sigmoid" : "bench_sink";
    s->source = src;
    s->hooks = use_sigmoid ? KVA_VARIANT_LOGITS_TRANSFORM : KVA_VARIANT_OUTPUT_TRANSFORM;
    s->use_softmax = use_sigmoid ? 0 : 1;
    s->num_scalar_params = use_sigmoid ? 2 : 0;
    s->num_tensor_params = use_sigmoid ? 0 : 1;
}

/* a source no earlier run compiled: the example plus a comment naming the run */
static char* fresh_source(int rep) {
    const char* base = use_sigmoid ? sigmoid_src : sink_src;
    char* s = (char*)malloc(strlen(base) + 96);
    sprintf(s, "%s/* bench_jit run %ld.%d.%.0f */\n", base, (long)getpid(), rep, now() * 1e6);
    return s;
}

static void row(const char* what, double* cold, double* hit, int n) {
    double cm, cx, hm, hx;
    stats(cold, n, &cm, &cx);
    stats(hit, n, &hm, &hx);
    printf("| %-22s | %8.3f | %8.3f | %8.3f | %8.3f | %s |\n", what, cm, cx, hm * 1e3, hx * 1e3,
           cm <= 10.0 && hm <= 5e-3 ? "yes" : "NO");
}

static void bench_cpu(int reps) {
    double* cold = (double*)calloc((size_t)reps, sizeof(double));
    double* hit = (double*)calloc((size_t)reps, sizeof(double));
    for (int r = 0; r < reps; ++r) {
        char dir[] = "/tmp/kvattn-bench-jit-XXXXXX";
        if (!mkdtemp(dir)) {
            perror("mkdtemp");
            exit(1);
        }
        kva_context_options o;
        kva_context_options_init(&o);
        o.backend = KVA_BACKEND_CPU;
        o.num_threads = 1;
        o.jit_cache_dir = dir;
        kva_context* ctx;
        KV(kva_context_create(&o, &ctx));
        char* src = fresh_source(r);
        kva_variant_spec s;
        spec_of(&s, src);
        kva_variant* v;
        double t0 = now();
        KV(kva_variant_create(ctx, &s, &v));
        cold[r] = now() - t0;
        KV(kva_variant_destroy(v));
        t0 = now();
        KV(kva_variant_create(ctx, &s, &v));
        hit[r] = now() - t0;
        KV(kva_variant_destroy(v));
        kva_context_destroy(ctx);
        free(src);
        rm_tree(dir);
    }
    row("cpu create (cc)", cold, hit, reps);
    free(cold);
    free(hit);
}

#if defined(KVA_BENCH_NVRTC)
/* a key's NVRTC compile into the cache at dir (must miss), then the same key again (must hit), in seconds */
static void time_kernel(const char* dir, const kva__kkey* key, const char* what, double* cold, double* hit) {
    for (int pass = 0; pass < 2; ++pass) {
        void* cubin = NULL;
        size_t size = 0;
        int was_hit = 0;
        const double t0 = now();
        KV(kva__jit_cached(NULL, dir, key, "sm_90a", &cubin, &size, &was_hit));
        *(pass ? hit : cold) = now() - t0;
        free(cubin);
        if ((was_hit != 0) != pass) {
            fprintf(stderr, "bench_jit: the %s kernel's %s compile %s the cache\n", what, pass ? "second" : "cold",
                    pass ? "missed" : "hit");
            exit(1);
        }
    }
}

static void bench_nvrtc(int reps) {
    double* ccold = (double*)calloc((size_t)reps, sizeof(double));
    double* chit = (double*)calloc((size_t)reps, sizeof(double));
    double* kcold = (double*)calloc((size_t)reps, sizeof(double));
    double* khit = (double*)calloc((size_t)reps, sizeof(double));
    double* pcold = (double*)calloc((size_t)reps, sizeof(double));
    double* phit = (double*)calloc((size_t)reps, sizeof(double));
    for (int r = 0; r < reps; ++r) {
        char dir[] = "/tmp/kvattn-bench-jit-XXXXXX";
        if (!mkdtemp(dir)) {
            perror("mkdtemp");
            exit(1);
        }
        char* src = fresh_source(r);
        kva_variant v;
        memset(&v, 0, sizeof v);
        v.magic = KVA__VARIANT_MAGIC;
        snprintf(v.name, sizeof v.name, "%s", use_sigmoid ? "bench_sigmoid" : "bench_sink");
        v.source = src;
        v.hooks = use_sigmoid ? KVA_VARIANT_LOGITS_TRANSFORM : KVA_VARIANT_OUTPUT_TRANSFORM;
        v.use_softmax = use_sigmoid ? 0 : 1;
        v.hash = kva__fnv(KVA__FNV_SEED, src, strlen(src));
        v.cuda_src = kva__cuda_variant_source(&v, 0);
        v.cuda_src_pf = kva__cuda_variant_source(&v, 2);
        double t0 = now();
        KV(kva__cuda_variant_check_compile(&v, "sm_90a", dir));
        ccold[r] = now() - t0;
        t0 = now();
        KV(kva__cuda_variant_check_compile(&v, "sm_90a", dir));
        chit[r] = now() - t0;
        kva_attention_desc d;
        kva_attention_desc_init(&d, 32, 8, 128, KVA_DTYPE_BF16);
        d.variant = &v;
        kva__kchoice c;
        KV(kva__cuda_select(&d, KVA_OP_BATCH_DECODE, 0, 4, &c));
        time_kernel(dir, &c.key, "decode", &kcold[r], &khit[r]);
        /* the tensor-core prefill kernel of the same variant (paged prefill, tile 128) */
        KV(kva__cuda_select(&d, KVA_OP_BATCH_PREFILL_PAGED, 0, 512, &c));
        time_kernel(dir, &c.key, "prefill", &pcold[r], &phit[r]);
        free(v.cuda_src);
        free(v.cuda_src_pf);
        free(src);
        rm_tree(dir);
    }
    row("nvrtc hook check", ccold, chit, reps);
    row("nvrtc decode kernel", kcold, khit, reps);
    row("nvrtc prefill kernel", pcold, phit, reps);
    free(pcold);
    free(phit);
    free(ccold);
    free(chit);
    free(kcold);
    free(khit);
}
#endif

#if defined(KVA_BENCH_CUDART)
/* With a CUDA device: create + first decode plan on a cold cache; then a new context on the warm cache. */
static int bench_cuda_device(int reps) {
    kva_context_options o;
    kva_context_options_init(&o);
    o.backend = KVA_BACKEND_CUDA;
    kva_context* probe = NULL;
    if (kva_context_create(&o, &probe) != KVA_OK) return 0;
    kva_context_destroy(probe);
    double* cold = (double*)calloc((size_t)reps, sizeof(double));
    double* hit = (double*)calloc((size_t)reps, sizeof(double));
    enum { B = 4, PS = 16 };
    int32_t indptr[B + 1] = {0, 1, 2, 3, 4}, last[B] = {16, 16, 16, 16}, idx[B] = {0, 1, 2, 3};
    kva_plan_params pp;
    kva_plan_params_init(&pp);
    pp.batch_size = B;
    pp.kv_indptr = indptr;
    pp.kv_last_page_len = last;
    pp.page_size = PS;
    pp.num_pages = B;
    pp.kv_indices = idx;
    for (int r = 0; r < reps; ++r) {
        char dir[] = "/tmp/kvattn-bench-jit-XXXXXX";
        if (!mkdtemp(dir)) {
            perror("mkdtemp");
            exit(1);
        }
        o.jit_cache_dir = dir;
        char* src = fresh_source(r);
        for (int pass = 0; pass < 2; ++pass) {
            kva_context* ctx;
            KV(kva_context_create(&o, &ctx)); /* outside the timing: device setup */
            kva_variant_spec s;
            spec_of(&s, src);
            kva_attention_desc d;
            kva_attention_desc_init(&d, 32, 8, 128, KVA_DTYPE_BF16);
            size_t db = 0, hb = 0;
            double t0 = now();
            kva_variant* v;
            KV(kva_variant_create(ctx, &s, &v));
            d.variant = v;
            KV(kva_plan_workspace_size(ctx, &d, KVA_OP_BATCH_DECODE, &pp, &db, &hb));
            double t1 = now();
            /* the workspace is allocated outside the timing; the plan compiles (or loads) the kernel */
            void* dev = NULL;
            void* host = NULL;
            {
                if (cudaMalloc(&dev, db) != cudaSuccess || cudaMallocHost(&host, hb ? hb : 256) != cudaSuccess) {
                    fprintf(stderr, "bench_jit: cudaMalloc failed\n");
                    exit(1);
                }
                kva_workspace ws;
                memset(&ws, 0, sizeof ws);
                ws.device = dev;
                ws.device_bytes = db;
                ws.host = host;
                ws.host_bytes = hb ? hb : 256;
                kva_plan plan;
                double t2 = now();
                KV(kva_batch_decode_plan(ctx, &d, &pp, &ws, &plan, NULL));
                double t3 = now();
                (pass ? hit : cold)[r] = (t1 - t0) + (t3 - t2);
                cudaFree(dev);
                cudaFreeHost(host);
            }
            KV(kva_variant_destroy(v));
            kva_context_destroy(ctx);
        }
        free(src);
        rm_tree(dir);
    }
    row("cuda create + plan", cold, hit, reps);
    free(cold);
    free(hit);
    return 1;
}
#endif

int main(int argc, char** argv) {
    int reps = 5;
    const char* backend = "all";
    for (int i = 1; i < argc; ++i) {
        if (!strcmp(argv[i], "--reps") && i + 1 < argc) reps = atoi(argv[++i]);
        else if (!strcmp(argv[i], "--backend") && i + 1 < argc) backend = argv[++i];
        else if (!strcmp(argv[i], "--variant") && i + 1 < argc) use_sigmoid = !strcmp(argv[++i], "sigmoid");
        else {
            printf("usage: %s [--reps N] [--backend cpu|cuda|all] [--variant sink|sigmoid]\n", argv[0]);
            return strcmp(argv[i], "--help") ? 2 : 0;
        }
    }
    if (reps < 1) reps = 1;
    printf("H2: first use of a new variant (%s), cold cache vs warm cache; %d repetitions\n\n",
           use_sigmoid ? "FlashSigmoid" : "attention sink", reps);
    printf("| %-22s | %8s | %8s | %8s | %8s | %s |\n", "path", "cold s", "cold max", "hit ms", "hit max", "target");
    printf("|%s|---------:|---------:|---------:|---------:|--------|\n", "------------------------");
    if (!strcmp(backend, "cpu") || !strcmp(backend, "all")) bench_cpu(reps);
#if defined(KVA_BENCH_NVRTC)
    if (!strcmp(backend, "cuda") || !strcmp(backend, "all")) bench_nvrtc(reps);
#endif
    if (!strcmp(backend, "cuda") || !strcmp(backend, "all")) {
#if defined(KVA_BENCH_CUDART)
        if (!bench_cuda_device(reps)) printf("(no CUDA device: the create + plan row needs one)\n");
#else
        printf("(built without the CUDA runtime: no create + plan row)\n");
#endif
    }
    return 0;
}
