/*
 * bench_plan - host time of kva_plan_make (WORKLOADS.md H1).
 *
 * For batch sizes {1, 64, 256, 1024}, KV lengths uniform in [512, 4096] (seeded), page size 16,
 * GQA 32/8, head dim 128, f16: times kva_plan_make for
 *   decode   (KVA_OP_BATCH_DECODE, one query row per request),
 *   append   (KVA_OP_BATCH_PREFILL_PAGED, 128 query rows per request onto its KV),
 *   prefill  (KVA_OP_BATCH_PREFILL_PAGED, causal, query length = KV length),
 * with the page table's host copy passed (so plan validates every page index, as a careful engine would).
 * Each case is warmed up, then repeated until both a minimum count and a minimum time are reached; every
 * repetition is timed on its own with clock_gettime(CLOCK_MONOTONIC); median and p90 are printed.
 *
 * kva_plan_make balances over the context's workers W. On the CPU backend W is the thread count, so the
 * default --threads list "0,132,264" gives the machine's default and the worker counts of a 132-SM GPU
 * with 1 and 2 CTAs per SM (the contexts then start that many idle threads; plan does not use them).
 * --backend cuda times plan for a CUDA context instead (its W; workspace from cudaMalloc/cudaMallocHost
 * through a dlopen'ed CUDA runtime; the time includes enqueueing the work list's async copy).
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <errno.h>
#include <getopt.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "kvattn.h"

static void kva_fail(const char* call, kva_status st) {
    fprintf(stderr, "bench_plan: error: %s failed: %s: %s\n", call, kva_status_string(st), kva_last_error_message());
    exit(1);
}

#define KVA_CHECK(call)                          \
    do {                                         \
        kva_status st_ = (call);                 \
        if (st_ != KVA_OK) kva_fail(#call, st_); \
    } while (0)

static void* xmalloc(size_t bytes) {
    void* p = malloc(bytes ? bytes : 1);
    if (!p) {
        fprintf(stderr, "bench_plan: error: out of memory (%zu bytes)\n", bytes);
        exit(1);
    }
    return p;
}

static void* aligned_buffer(size_t bytes) {
    size_t n = (bytes + 255) / 256 * 256;
    void* p = aligned_alloc(256, n ? n : 256);
    if (!p) {
        fprintf(stderr, "bench_plan: error: out of memory (%zu bytes)\n", bytes);
        exit(1);
    }
    memset(p, 0, n ? n : 256);
    return p;
}

/* CUDA backend: the workspace must be device memory (cudaMalloc) plus a page-locked host staging buffer
   (cudaMallocHost); the CUDA runtime is loaded with dlopen so this program needs no CUDA at build time. */
typedef int (*cuda_alloc_fn)(void**, size_t);
typedef int (*cuda_free_fn)(void*);
typedef int (*cuda_sync_fn)(void);
static struct {
    void* lib;
    cuda_alloc_fn malloc_, malloc_host;
    cuda_free_fn free_, free_host;
    cuda_sync_fn sync;
} g_cuda;

static void* cuda_sym(const char* name) {
    void* p = dlsym(g_cuda.lib, name);
    if (!p) {
        fprintf(stderr, "bench_plan: error: CUDA runtime symbol %s not found\n", name);
        exit(1);
    }
    return p;
}

static void cuda_load(void) {
    static const char* names[] = {"libcudart.so", "libcudart.so.13", "libcudart.so.12"};
    for (size_t i = 0; i < sizeof(names) / sizeof(names[0]) && !g_cuda.lib; i++)
        g_cuda.lib = dlopen(names[i], RTLD_NOW | RTLD_LOCAL);
    if (!g_cuda.lib) {
        fprintf(stderr, "bench_plan: error: the CUDA backend needs libcudart: %s\n", dlerror());
        exit(1);
    }
    void* p;
    p = cuda_sym("cudaMalloc");            memcpy(&g_cuda.malloc_, &p, sizeof p);
    p = cuda_sym("cudaMallocHost");        memcpy(&g_cuda.malloc_host, &p, sizeof p);
    p = cuda_sym("cudaFree");              memcpy(&g_cuda.free_, &p, sizeof p);
    p = cuda_sym("cudaFreeHost");          memcpy(&g_cuda.free_host, &p, sizeof p);
    p = cuda_sym("cudaDeviceSynchronize"); memcpy(&g_cuda.sync, &p, sizeof p);
}

static void* ws_alloc(int cuda, int host, size_t bytes) {
    if (!cuda) return aligned_buffer(bytes);
    void* p = NULL;
    int err = host ? g_cuda.malloc_host(&p, bytes ? bytes : 256) : g_cuda.malloc_(&p, bytes ? bytes : 256);
    if (err) {
        fprintf(stderr, "bench_plan: error: %s(%zu) failed with CUDA error %d\n", host ? "cudaMallocHost" : "cudaMalloc",
                bytes, err);
        exit(1);
    }
    return p;
}

static void ws_free(int cuda, int host, void* p) {
    if (!p) return;
    if (!cuda) free(p);
    else if (host) g_cuda.free_host(p);
    else g_cuda.free_(p);
}

static double now_sec(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

static uint64_t splitmix64(uint64_t* x) {
    uint64_t z = (*x += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}

static int cmp_double(const void* x, const void* y) {
    double a = *(const double*)x, b = *(const double*)y;
    return a < b ? -1 : a > b;
}

static double sorted_pct(const double* s, int n, double p) { /* nearest rank */
    int k = (int)((p / 100.0) * n + 0.999999) - 1;
    if (k < 0) k = 0;
    if (k >= n) k = n - 1;
    return s[k];
}

typedef enum { OP_DECODE = 0, OP_APPEND = 1, OP_PREFILL = 2 } bench_op;
static const char* op_names[] = {"decode", "append", "prefill"};

typedef struct options {
    int threads[16];
    int num_threads;
    int ops[3];
    int batches[16];
    int num_batches;
    double min_time;
    int min_reps, max_reps, warmup;
    uint64_t seed;
    int no_indices;
    int fixed_split;
    kva_backend backend;
} options;

static void usage(FILE* f) {
    fprintf(f,
            "usage: bench_plan [options]\n"
            "Host time of kva_plan_make: GQA 32/8, D 128, f16, page 16, KV lengths uniform in [512, 4096].\n"
            "  --backend B        cpu | cuda | auto (default cpu)\n"
            "  --threads LIST     CPU worker counts, comma separated; 0 = the default (default 0,132,264);\n"
            "                     ignored by the CUDA backend (its W is the persistent grid)\n"
            "  --ops LIST         decode,append,prefill (default all)\n"
            "  --batches LIST     batch sizes (default 1,64,256,1024)\n"
            "  --min-time S       seconds of timed repetitions per case at least (default 0.2)\n"
            "  --min-reps N       timed repetitions at least (default 50)\n"
            "  --max-reps N       timed repetitions at most (default 20000)\n"
            "  --warmup N         untimed repetitions first (default 10)\n"
            "  --seed N           seed of the lengths and page tables (default 1)\n"
            "  --no-indices       do not pass the page table's host copy (skips index validation)\n"
            "  --fixed-split N    plan with fixed_split_size N (default 0: balanced split)\n"
            "  -h, --help         this text\n");
}

static int parse_list(const char* s, int* out, int cap, const char* what) {
    int n = 0;
    const char* p = s;
    while (*p) {
        char* end;
        errno = 0;
        long v = strtol(p, &end, 10);
        if (end == p || errno || v < 0 || v > (1 << 24) || n == cap) {
            fprintf(stderr, "bench_plan: error: bad %s list '%s'\n", what, s);
            exit(1);
        }
        out[n++] = (int)v;
        p = end;
        if (*p == ',') p++;
        else if (*p) {
            fprintf(stderr, "bench_plan: error: bad %s list '%s'\n", what, s);
            exit(1);
        }
    }
    return n;
}

static void parse_args(int argc, char** argv, options* o) {
    memset(o, 0, sizeof *o);
    o->num_threads = parse_list("0,132,264", o->threads, 16, "threads");
    o->ops[0] = o->ops[1] = o->ops[2] = 1;
    o->num_batches = parse_list("1,64,256,1024", o->batches, 16, "batches");
    o->min_time = 0.2;
    o->min_reps = 50;
    o->max_reps = 20000;
    o->warmup = 10;
    o->seed = 1;
    o->backend = KVA_BACKEND_CPU;
    enum { O_BACKEND = 255, O_THREADS = 256, O_OPS, O_BATCHES, O_MIN_TIME, O_MIN_REPS, O_MAX_REPS, O_WARMUP, O_SEED, O_NO_INDICES, O_FIXED };
    static const struct option opts[] = {
        {"backend", required_argument, 0, O_BACKEND},
        {"threads", required_argument, 0, O_THREADS},   {"ops", required_argument, 0, O_OPS},
        {"batches", required_argument, 0, O_BATCHES},   {"min-time", required_argument, 0, O_MIN_TIME},
        {"min-reps", required_argument, 0, O_MIN_REPS}, {"max-reps", required_argument, 0, O_MAX_REPS},
        {"warmup", required_argument, 0, O_WARMUP},     {"seed", required_argument, 0, O_SEED},
        {"no-indices", no_argument, 0, O_NO_INDICES},   {"fixed-split", required_argument, 0, O_FIXED},
        {"help", no_argument, 0, 'h'},                  {0, 0, 0, 0},
    };
    int ch;
    while ((ch = getopt_long(argc, argv, "h", opts, NULL)) != -1) {
        switch (ch) {
            case O_BACKEND:
                if (!strcmp(optarg, "cpu")) o->backend = KVA_BACKEND_CPU;
                else if (!strcmp(optarg, "cuda")) o->backend = KVA_BACKEND_CUDA;
                else if (!strcmp(optarg, "auto")) o->backend = KVA_BACKEND_AUTO;
                else {
                    fprintf(stderr, "bench_plan: error: --backend: expected cpu, cuda or auto\n");
                    exit(1);
                }
                break;
            case O_THREADS: o->num_threads = parse_list(optarg, o->threads, 16, "threads"); break;
            case O_OPS: {
                o->ops[0] = o->ops[1] = o->ops[2] = 0;
                char buf[256];
                snprintf(buf, sizeof buf, "%s", optarg);
                for (char* t = strtok(buf, ","); t; t = strtok(NULL, ",")) {
                    int found = 0;
                    for (int i = 0; i < 3; i++)
                        if (!strcmp(t, op_names[i])) o->ops[i] = found = 1;
                    if (!found) {
                        fprintf(stderr, "bench_plan: error: unknown op '%s'\n", t);
                        exit(1);
                    }
                }
                break;
            }
            case O_BATCHES: o->num_batches = parse_list(optarg, o->batches, 16, "batches"); break;
            case O_MIN_TIME: o->min_time = atof(optarg); break;
            case O_MIN_REPS: o->min_reps = atoi(optarg); break;
            case O_MAX_REPS: o->max_reps = atoi(optarg); break;
            case O_WARMUP: o->warmup = atoi(optarg); break;
            case O_SEED: o->seed = strtoull(optarg, NULL, 10); break;
            case O_NO_INDICES: o->no_indices = 1; break;
            case O_FIXED: o->fixed_split = atoi(optarg); break;
            case 'h': usage(stdout); exit(0);
            default: usage(stderr); exit(1);
        }
    }
    if (optind < argc) {
        fprintf(stderr, "bench_plan: error: unexpected argument '%s'\n", argv[optind]);
        exit(1);
    }
    if (o->min_reps < 1) o->min_reps = 1;
    if (o->max_reps < o->min_reps) o->max_reps = o->min_reps;
    for (int i = 0; i < o->num_batches; i++)
        if (o->batches[i] < 1) {
            fprintf(stderr, "bench_plan: error: batch sizes must be >= 1\n");
            exit(1);
        }
}

int main(int argc, char** argv) {
    options opt;
    parse_args(argc, argv, &opt);
    const int heads_q = 32, heads_kv = 8, head_dim = 128, page_size = 16, kv_min = 512, kv_max = 4096;

    printf("## bench_plan: kva_plan_make host time (kvattn %s)\n\n", kva_version_string());
    printf("GQA %d/%d, D %d, f16, page %d, KV lengths uniform in [%d, %d], seed %llu, page-table host copy %s, "
           "fixed split %d; median and p90 of >= %d repetitions and >= %.2f s per case.\n\n",
           heads_q, heads_kv, head_dim, page_size, kv_min, kv_max, (unsigned long long)opt.seed,
           opt.no_indices ? "not passed" : "passed (validated)", opt.fixed_split, opt.min_reps, opt.min_time);
    printf("| backend | workers W | op | batch | KV tokens | q rows | tile_q | kv chunk | work items | merges | "
           "median us | p90 us | reps |\n");
    printf("|---|---|---|---|---|---|---|---|---|---|---|---|---|\n");
    fflush(stdout);

    int max_batch = 0;
    for (int i = 0; i < opt.num_batches; i++)
        if (opt.batches[i] > max_batch) max_batch = opt.batches[i];
    int32_t* kv_len = (int32_t*)xmalloc((size_t)max_batch * sizeof(int32_t));
    int32_t* kv_indptr = (int32_t*)xmalloc(((size_t)max_batch + 1) * sizeof(int32_t));
    int32_t* qo_indptr = (int32_t*)xmalloc(((size_t)max_batch + 1) * sizeof(int32_t));
    int32_t* last = (int32_t*)xmalloc((size_t)max_batch * sizeof(int32_t));
    int64_t max_pages = (int64_t)max_batch * ((kv_max + page_size - 1) / page_size);
    int32_t* indices = (int32_t*)xmalloc((size_t)max_pages * sizeof(int32_t));
    double* samples = (double*)xmalloc((size_t)opt.max_reps * sizeof(double));

    for (int ti = 0; ti < opt.num_threads; ti++) {
        kva_context_options co;
        kva_context_options_init(&co);
        co.backend = opt.backend;
        co.num_threads = opt.threads[ti];
        kva_context* ctx = NULL;
        KVA_CHECK(kva_context_create(&co, &ctx));
        int workers = kva_context_num_workers(ctx);
        int cuda = kva_context_backend(ctx) == KVA_BACKEND_CUDA;
        if (cuda && !g_cuda.lib) cuda_load();
        if (cuda && ti > 0) { /* the thread count does not apply: one pass */
            KVA_CHECK(kva_context_destroy(ctx));
            break;
        }

        for (int op = 0; op < 3; op++) {
            if (!opt.ops[op]) continue;
            kva_attention_desc desc;
            kva_attention_desc_init(&desc, heads_q, heads_kv, head_dim, KVA_DTYPE_F16);
            if (op == OP_PREFILL || op == OP_APPEND) desc.mask_mode = KVA_MASK_CAUSAL;
            kva_op kop = op == OP_DECODE ? KVA_OP_BATCH_DECODE : KVA_OP_BATCH_PREFILL_PAGED;

            for (int bi = 0; bi < opt.num_batches; bi++) {
                int B = opt.batches[bi];
                /* the same lengths for every op and worker count of a batch size */
                uint64_t st = opt.seed * 1000003ull + (uint64_t)B;
                int64_t total_kv = 0;
                kv_indptr[0] = qo_indptr[0] = 0;
                for (int i = 0; i < B; i++) {
                    kv_len[i] = kv_min + (int32_t)(splitmix64(&st) % (uint64_t)(kv_max - kv_min + 1));
                    total_kv += kv_len[i];
                    int32_t pages = (kv_len[i] + page_size - 1) / page_size;
                    kv_indptr[i + 1] = kv_indptr[i] + pages;
                    last[i] = (kv_len[i] - 1) % page_size + 1;
                    int32_t qo = op == OP_DECODE ? 1 : op == OP_APPEND ? 128 : kv_len[i];
                    qo_indptr[i + 1] = qo_indptr[i] + qo;
                }
                int64_t num_pages = kv_indptr[B];
                /* a scattered page table: a random permutation of the pool */
                for (int64_t p = 0; p < num_pages; p++) indices[p] = (int32_t)p;
                for (int64_t p = num_pages - 1; p > 0; p--) {
                    int64_t j = (int64_t)(splitmix64(&st) % (uint64_t)(p + 1));
                    int32_t t = indices[p];
                    indices[p] = indices[j];
                    indices[j] = t;
                }
                kva_plan_params pp;
                kva_plan_params_init(&pp);
                pp.batch_size = B;
                pp.qo_indptr = op == OP_DECODE ? NULL : qo_indptr;
                pp.kv_indptr = kv_indptr;
                pp.kv_last_page_len = last;
                pp.page_size = page_size;
                pp.num_pages = num_pages;
                pp.kv_indices = opt.no_indices ? NULL : indices;
                pp.fixed_split_size = opt.fixed_split;

                size_t dev_bytes = 0, host_bytes = 0;
                KVA_CHECK(kva_plan_workspace_size(ctx, &desc, kop, &pp, &dev_bytes, &host_bytes));
                kva_workspace ws;
                memset(&ws, 0, sizeof ws);
                ws.device = ws_alloc(cuda, 0, dev_bytes);
                ws.device_bytes = dev_bytes;
                ws.host = host_bytes ? ws_alloc(cuda, 1, host_bytes) : NULL;
                ws.host_bytes = host_bytes;
                kva_plan plan;
                for (int r = 0; r < opt.warmup; r++) KVA_CHECK(kva_plan_make(ctx, &desc, kop, &pp, &ws, &plan, NULL));
                int reps = 0;
                double t_begin = now_sec();
                while (reps < opt.max_reps && (reps < opt.min_reps || now_sec() - t_begin < opt.min_time)) {
                    double t0 = now_sec();
                    kva_status s = kva_plan_make(ctx, &desc, kop, &pp, &ws, &plan, NULL);
                    double t1 = now_sec();
                    if (s != KVA_OK) kva_fail("kva_plan_make", s);
                    samples[reps++] = (t1 - t0) * 1e6;
                }
                qsort(samples, (size_t)reps, sizeof(double), cmp_double);
                kva_plan_info info;
                KVA_CHECK(kva_plan_get_info(&plan, &info));
                printf("| %s | %d%s | %s | %d | %lld | %lld | %d | %d | %d | %d | %.1f | %.1f | %d |\n", cuda ? "cuda" : "cpu",
                       workers, opt.threads[ti] == 0 ? " (default)" : "", op_names[op], B, (long long)total_kv,
                       (long long)info.total_qo_rows, info.tile_q, info.kv_chunk_size, info.num_work_items,
                       info.num_merge_tasks, sorted_pct(samples, reps, 50), sorted_pct(samples, reps, 90), reps);
                fflush(stdout);
                if (cuda) g_cuda.sync(); /* the last plan's copy must finish before the workspace goes */
                ws_free(cuda, 0, ws.device);
                ws_free(cuda, 1, ws.host);
            }
        }
        KVA_CHECK(kva_context_destroy(ctx));
    }
    free(kv_len);
    free(kv_indptr);
    free(qo_indptr);
    free(last);
    free(indices);
    free(samples);
    return 0;
}
