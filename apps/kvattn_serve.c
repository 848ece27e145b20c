/*
 * kvattn_serve - kvattn's main job: a serving-like attention workload.
 *
 * A synthetic request trace (seeded; prompt and output lengths lognormal, i.e. long-tailed; exponential
 * inter-arrival times) is served with continuous batching over a paged KV pool:
 *
 *   every step:
 *     admit   waiting requests (FCFS) while the batch, the prefill token budget and the pool allow it;
 *             a request is admitted only if the free pages cover its prompt now and everything the running
 *             requests may still grow into (so decode never runs out of pages; requests wait instead)
 *     plan    one prefill plan (new requests, causal) and one decode plan (running requests), shared by
 *             every layer of the step
 *     layers  for each layer: append the new K/V (prompt tokens / one token per running request) into the
 *             layer's pages with kva_append_paged_kv_cache, then run prefill and decode attention
 *     retire  requests that produced all their output tokens; their pages go back to the free list
 *
 * Every `--check-every` steps a few (request, head) rows of one layer are recomputed in float64 from the
 * pool contents through the page table and compared with kvattn's o and lse (base 2), and as many appended K/V
 * rows are looked up in the pages their request owns (byte-equal to the appended row).
 *
 * --page-table csr (default) describes the batch in FlashInfer's CSR form (kv_indptr, kv_indices,
 * kv_last_page_len) and appends by (request, position); --page-table block in vLLM's form: a block table
 * [batch, max pages per request] with per-request lengths (kv_seq_lens, block_table_stride; the rows' unused
 * entries hold -1) and an append by slot (page * page_size + offset of each new token).
 *
 * The pool is one allocation per run: [layer][page][K|V][page_size][heads][dim] (NHD) or
 * [layer][page][K|V][heads][page_size][dim] (HND); each layer is described to kvattn by a kva_paged_kv
 * with explicit strides (K and V of a page are interleaved, as in a [num_pages, 2, ...] cache).
 *
 * Host memory is backend memory for the CPU backend. For the CUDA backend the app loads the CUDA runtime
 * (libcudart) with dlopen for cudaMalloc/cudaMemcpy; kvattn itself needs nothing from the app.
 *
 * Exit status: 0 on success; 1 on any kvattn error (its message is printed), a failed numerical check, or
 * bad options.
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <errno.h>
#include <getopt.h>
#include <math.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "kvattn.h"

/* ---------------------------------------------------------------------------------------------- */
/* Failure handling                                                                                */

static void fatal(const char* fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    fputs("kvattn_serve: error: ", stderr);
    vfprintf(stderr, fmt, ap);
    fputc('\n', stderr);
    va_end(ap);
    exit(1);
}

static void kva_fail(const char* call, kva_status st) {
    fatal("%s failed: %s: %s", call, kva_status_string(st), kva_last_error_message());
}

#define KVA_CHECK(call)                              \
    do {                                             \
        kva_status st_ = (call);                     \
        if (st_ != KVA_OK) kva_fail(#call, st_);     \
    } while (0)

static void* xmalloc(size_t bytes) {
    void* p = malloc(bytes ? bytes : 1);
    if (!p) fatal("out of host memory (%zu bytes)", bytes);
    return p;
}

static void* xcalloc(size_t n, size_t size) {
    void* p = calloc(n ? n : 1, size ? size : 1);
    if (!p) fatal("out of host memory (%zu x %zu bytes)", n, size);
    return p;
}

static double now_sec(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

/* ---------------------------------------------------------------------------------------------- */
/* Seeded random numbers: splitmix64 to seed xoshiro256**                                          */

typedef struct rng {
    uint64_t s[4];
} rng;

static uint64_t splitmix64(uint64_t* x) {
    uint64_t z = (*x += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}

static void rng_seed(rng* r, uint64_t seed) {
    uint64_t x = seed;
    for (int i = 0; i < 4; i++) r->s[i] = splitmix64(&x);
}

static inline uint64_t rotl64(uint64_t x, int k) { return (x << k) | (x >> (64 - k)); }

static inline uint64_t rng_next(rng* r) {
    uint64_t* s = r->s;
    uint64_t result = rotl64(s[1] * 5, 7) * 9;
    uint64_t t = s[1] << 17;
    s[2] ^= s[0];
    s[3] ^= s[1];
    s[1] ^= s[2];
    s[0] ^= s[3];
    s[2] ^= t;
    s[3] = rotl64(s[3], 45);
    return result;
}

static double rng_uniform(rng* r) { return (double)(rng_next(r) >> 11) * 0x1.0p-53; } /* [0, 1) */

static int64_t rng_below(rng* r, int64_t n) { return n <= 1 ? 0 : (int64_t)(rng_uniform(r) * (double)n); }

static double rng_normal(rng* r) { /* Box-Muller */
    double u1 = 1.0 - rng_uniform(r); /* (0, 1] */
    double u2 = rng_uniform(r);
    return sqrt(-2.0 * log(u1)) * cos(6.283185307179586 * u2);
}

/* Cheap approximately normal value (Irwin-Hall sum of four 16-bit uniforms), unit variance. */
static inline float rng_fast_normal(rng* r) {
    uint64_t x = rng_next(r);
    uint32_t s = (uint32_t)(x & 0xffff) + (uint32_t)((x >> 16) & 0xffff) + (uint32_t)((x >> 32) & 0xffff) +
                 (uint32_t)(x >> 48);
    return ((float)s * (1.0f / 65536.0f) - 2.0f + 0.5f / 65536.0f * 4.0f) * 1.7320508f;
}

/* ---------------------------------------------------------------------------------------------- */
/* Number formats: f16, bf16, fp8 e4m3 (OCP fn) and e5m2, encoded with round-to-nearest-even        */

static uint16_t f32_to_f16(float f) {
    uint32_t x;
    memcpy(&x, &f, 4);
    uint32_t sign = (x >> 16) & 0x8000u;
    uint32_t ax = x & 0x7fffffffu;
    if (ax >= 0x7f800000u) return (uint16_t)(sign | (ax > 0x7f800000u ? 0x7e00u : 0x7c00u));
    if (ax >= 0x47800000u) return (uint16_t)(sign | 0x7c00u); /* >= 65536: inf */
    if (ax < 0x38800000u) {                                     /* below 2^-14: subnormal half */
        float a;
        memcpy(&a, &ax, 4);
        uint32_t m = (uint32_t)lrintf(a * 16777216.0f); /* exact scaling, RNE rounding; 1024 = min normal */
        return (uint16_t)(sign | m);
    }
    uint32_t h = ((((ax >> 23) - 127u + 15u)) << 10) | ((ax & 0x7fffffu) >> 13);
    uint32_t rem = ax & 0x1fffu;
    if (rem > 0x1000u || (rem == 0x1000u && (h & 1u))) h++; /* may carry into the exponent: correct */
    return (uint16_t)(sign | h);
}

static uint16_t f32_to_bf16(float f) {
    uint32_t x;
    memcpy(&x, &f, 4);
    if ((x & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((x >> 16) | 0x40u);
    x += 0x7fffu + ((x >> 16) & 1u);
    return (uint16_t)(x >> 16);
}

/* fp8 with mbits mantissa bits (3: e4m3fn, 2: e5m2); saturates to the largest finite value. */
static uint8_t f32_to_fp8(float f, int mbits) {
    int ebits = 7 - mbits;
    int bias = (1 << (ebits - 1)) - 1;
    uint32_t maxbits = mbits == 3 ? 0x7eu : 0x7bu; /* 448 and 57344 */
    uint8_t sign = signbit(f) ? 0x80 : 0;
    if (isnan(f)) return (uint8_t)(sign | 0x7f);
    double a = fabs((double)f);
    int emin = 1 - bias;
    if (a < ldexp(1.0, emin)) {
        double q = nearbyint(a * ldexp(1.0, mbits - emin)); /* units of the subnormal step */
        return (uint8_t)(sign | (uint32_t)q);              /* q == 2^mbits encodes the smallest normal */
    }
    int k;
    double fr = frexp(a, &k); /* a = fr * 2^k, fr in [0.5, 1) */
    int e = k - 1;
    double q = nearbyint((fr * 2.0 - 1.0) * (double)(1 << mbits));
    if (q >= (double)(1 << mbits)) {
        q = 0;
        e++;
    }
    int field = e + bias;
    uint32_t bits = field > 31 ? 0xffu : (((uint32_t)field << mbits) | (uint32_t)q);
    if (bits > maxbits) bits = maxbits;
    return (uint8_t)(sign | bits);
}

/* Generic minifloat decode (f16: 10/5, e4m3: 3/4, e5m2: 2/5). */
static double decode_minifloat(uint32_t bits, int mbits, int ebits, int fn_style) {
    int bias = (1 << (ebits - 1)) - 1;
    uint32_t sign = (bits >> (mbits + ebits)) & 1u;
    uint32_t field = (bits >> mbits) & ((1u << ebits) - 1u);
    uint32_t m = bits & ((1u << mbits) - 1u);
    double v;
    if (fn_style && field == (1u << ebits) - 1u && m == (1u << mbits) - 1u) {
        v = NAN;
    } else if (!fn_style && field == (1u << ebits) - 1u) {
        v = m ? NAN : INFINITY;
    } else if (field == 0) {
        v = ldexp((double)m, 1 - bias - mbits);
    } else {
        v = ldexp((double)((1u << mbits) + m), (int)field - bias - mbits);
    }
    return sign ? -v : v;
}

static float g_f16_table[65536];
static float g_e4m3_table[256];
static float g_e5m2_table[256];

static void init_format_tables(void) {
    for (uint32_t i = 0; i < 65536; i++) g_f16_table[i] = (float)decode_minifloat(i, 10, 5, 0);
    for (uint32_t i = 0; i < 256; i++) {
        g_e4m3_table[i] = (float)decode_minifloat(i, 3, 4, 1);
        g_e5m2_table[i] = (float)decode_minifloat(i, 2, 5, 0);
    }
}

static inline double load_elem(const void* base, kva_dtype dt, int64_t i) {
    switch (dt) {
        case KVA_DTYPE_F32: return ((const float*)base)[i];
        case KVA_DTYPE_F16: return g_f16_table[((const uint16_t*)base)[i]];
        case KVA_DTYPE_BF16: {
            uint32_t x = (uint32_t)((const uint16_t*)base)[i] << 16;
            float f;
            memcpy(&f, &x, 4);
            return f;
        }
        case KVA_DTYPE_E4M3: return g_e4m3_table[((const uint8_t*)base)[i]];
        case KVA_DTYPE_E5M2: return g_e5m2_table[((const uint8_t*)base)[i]];
        default: return NAN;
    }
}

/* n random values (approximately N(0,1), times 1/scale) in dtype dt. */
static void fill_random(void* dst, kva_dtype dt, int64_t n, rng* r, float inv_scale) {
    switch (dt) {
        case KVA_DTYPE_F32: {
            float* p = (float*)dst;
            for (int64_t i = 0; i < n; i++) p[i] = rng_fast_normal(r) * inv_scale;
            break;
        }
        case KVA_DTYPE_F16: {
            uint16_t* p = (uint16_t*)dst;
            for (int64_t i = 0; i < n; i++) p[i] = f32_to_f16(rng_fast_normal(r) * inv_scale);
            break;
        }
        case KVA_DTYPE_BF16: {
            uint16_t* p = (uint16_t*)dst;
            for (int64_t i = 0; i < n; i++) p[i] = f32_to_bf16(rng_fast_normal(r) * inv_scale);
            break;
        }
        case KVA_DTYPE_E4M3:
        case KVA_DTYPE_E5M2: {
            uint8_t* p = (uint8_t*)dst;
            int mbits = dt == KVA_DTYPE_E4M3 ? 3 : 2;
            for (int64_t i = 0; i < n; i++) p[i] = f32_to_fp8(rng_fast_normal(r) * inv_scale, mbits);
            break;
        }
        default: fatal("fill_random: unexpected dtype %d", (int)dt);
    }
}

/* ---------------------------------------------------------------------------------------------- */
/* Backend memory: host memory for the CPU backend, cudaMalloc'ed memory (runtime loaded with dlopen) */

typedef int (*cuda_malloc_fn)(void**, size_t);
typedef int (*cuda_free_fn)(void*);
typedef int (*cuda_memcpy_fn)(void*, const void*, size_t, int);
typedef int (*cuda_sync_fn)(void);
typedef int (*cuda_set_device_fn)(int);
typedef const char* (*cuda_error_string_fn)(int);

static struct {
    int enabled;
    void* lib;
    cuda_malloc_fn malloc_;
    cuda_free_fn free_;
    cuda_malloc_fn malloc_host;
    cuda_free_fn free_host;
    cuda_memcpy_fn memcpy_;
    cuda_sync_fn sync;
    cuda_set_device_fn set_device;
    cuda_error_string_fn error_string;
} g_cuda;

enum { CUDA_MEMCPY_H2D = 1, CUDA_MEMCPY_D2H = 2 };

static void* cuda_sym(const char* name) {
    void* p = dlsym(g_cuda.lib, name);
    if (!p) fatal("CUDA runtime: symbol %s not found", name);
    return p;
}

static void cuda_check(int err, const char* what) {
    if (err != 0) fatal("%s failed: CUDA error %d (%s)", what, err, g_cuda.error_string ? g_cuda.error_string(err) : "?");
}

static void cuda_load(int device) {
    static const char* names[] = {"libcudart.so", "libcudart.so.13", "libcudart.so.12", "libcudart.so.11.0"};
    for (size_t i = 0; i < sizeof(names) / sizeof(names[0]) && !g_cuda.lib; i++)
        g_cuda.lib = dlopen(names[i], RTLD_NOW | RTLD_LOCAL);
    if (!g_cuda.lib) fatal("the CUDA backend was selected but libcudart could not be loaded: %s", dlerror());
    /* POSIX guarantees that object and function pointers convert through dlsym's void*. */
    void* p;
    p = cuda_sym("cudaMalloc");            memcpy(&g_cuda.malloc_, &p, sizeof p);
    p = cuda_sym("cudaFree");              memcpy(&g_cuda.free_, &p, sizeof p);
    p = cuda_sym("cudaMallocHost");        memcpy(&g_cuda.malloc_host, &p, sizeof p);
    p = cuda_sym("cudaFreeHost");          memcpy(&g_cuda.free_host, &p, sizeof p);
    p = cuda_sym("cudaMemcpy");            memcpy(&g_cuda.memcpy_, &p, sizeof p);
    p = cuda_sym("cudaDeviceSynchronize"); memcpy(&g_cuda.sync, &p, sizeof p);
    p = cuda_sym("cudaSetDevice");         memcpy(&g_cuda.set_device, &p, sizeof p);
    p = cuda_sym("cudaGetErrorString");    memcpy(&g_cuda.error_string, &p, sizeof p);
    cuda_check(g_cuda.set_device(device), "cudaSetDevice");
    g_cuda.enabled = 1;
}

static size_t round_up(size_t x, size_t a) { return (x + a - 1) / a * a; }

static void* host_alloc(size_t bytes) { /* 256-byte aligned host memory */
    void* p = aligned_alloc(256, round_up(bytes ? bytes : 1, 256));
    if (!p) fatal("out of host memory (%zu bytes)", bytes);
    return p;
}

static void* pinned_alloc(size_t bytes) {
    if (!g_cuda.enabled) return host_alloc(bytes);
    void* p = NULL;
    cuda_check(g_cuda.malloc_host(&p, bytes ? bytes : 1), "cudaMallocHost");
    return p;
}

static void pinned_free(void* p) {
    if (!p) return;
    if (g_cuda.enabled) g_cuda.free_host(p);
    else free(p);
}

static void* dev_alloc(size_t bytes) {
    if (!g_cuda.enabled) return host_alloc(bytes);
    void* p = NULL;
    cuda_check(g_cuda.malloc_(&p, bytes ? bytes : 1), "cudaMalloc");
    return p;
}

static void dev_free(void* p) {
    if (!p) return;
    if (g_cuda.enabled) g_cuda.free_(p);
    else free(p);
}

static void h2d(void* dst, const void* src, size_t bytes) {
    if (bytes == 0 || dst == src) return;
    if (g_cuda.enabled) cuda_check(g_cuda.memcpy_(dst, src, bytes, CUDA_MEMCPY_H2D), "cudaMemcpy H2D");
    else memcpy(dst, src, bytes);
}

static void d2h(void* dst, const void* src, size_t bytes) {
    if (bytes == 0 || dst == src) return;
    if (g_cuda.enabled) cuda_check(g_cuda.memcpy_(dst, src, bytes, CUDA_MEMCPY_D2H), "cudaMemcpy D2H");
    else memcpy(dst, src, bytes);
}

static void dev_sync(void) {
    if (g_cuda.enabled) cuda_check(g_cuda.sync(), "cudaDeviceSynchronize");
}

/* A host buffer with its backend twin (the same memory on the CPU backend). */
typedef struct buf {
    void* h;
    void* d;
} buf;

static buf buf_alloc(size_t bytes) {
    buf b;
    b.h = host_alloc(bytes);
    b.d = g_cuda.enabled ? dev_alloc(bytes) : b.h;
    return b;
}

static void buf_free(buf* b) {
    if (b->d != b->h) dev_free(b->d);
    free(b->h);
    b->h = b->d = NULL;
}

/* ---------------------------------------------------------------------------------------------- */
/* Options                                                                                         */

typedef struct config {
    int heads_q, heads_kv, head_dim, layers, page_size;
    kva_dtype dtype, kv_dtype;
    kva_layout layout;
    int max_batch, requests, steps, pool_pages;
    uint64_t seed;
    kva_backend backend;
    int threads, check_every, check_samples, progress_every;
    int max_prefill_tokens;
    double prompt_median, prompt_sigma, output_median, output_sigma;
    int max_prompt, max_output;
    double arrival_interval;
    double tolerance;
    int pdl; /* kva_run_args.enable_pdl */
    int block_table; /* --page-table block: block tables + sequence lengths, append by slot */
} config;

static void config_defaults(config* c) {
    memset(c, 0, sizeof *c);
    c->heads_q = 32;
    c->heads_kv = 8;
    c->head_dim = 128;
    c->layers = 4;
    c->page_size = 16;
    c->dtype = KVA_DTYPE_F16;
    c->kv_dtype = (kva_dtype)-1; /* = dtype */
    c->layout = KVA_LAYOUT_NHD;
    c->max_batch = 32;
    c->requests = 96;
    c->steps = 0;
    c->pool_pages = 640;
    c->seed = 1;
    c->backend = KVA_BACKEND_AUTO;
    c->threads = 0;
    c->check_every = 16;
    c->check_samples = 4;
    c->progress_every = 25;
    c->max_prefill_tokens = 2048;
    c->prompt_median = 160;
    c->prompt_sigma = 0.8;
    c->output_median = 64;
    c->output_sigma = 0.8;
    c->max_prompt = 1024;
    c->max_output = 512;
    c->arrival_interval = 1.0;
    c->tolerance = 0;
    c->pdl = 0;
}

static void usage(FILE* f) {
    config d;
    config_defaults(&d);
    fprintf(f,
            "usage: kvattn_serve [options]\n"
            "Serving-like attention workload on kvattn: continuous batching over a seeded synthetic trace,\n"
            "paged KV pool, batched prefill (causal) and decode per step for every layer, sampled float64 check.\n"
            "\nModel:\n"
            "  --heads-q N           query heads (default %d)\n"
            "  --heads-kv N          KV heads (default %d)\n"
            "  --head-dim N          head dimension (default %d)\n"
            "  --layers N            layers (default %d)\n"
            "  --dtype T             q/o dtype: f16 | bf16 | f32 (default f16)\n"
            "  --kv-dtype T          KV dtype: f16 | bf16 | f32 | e4m3 | e5m2 (default: --dtype)\n"
            "\nKV pool:\n"
            "  --page-size N         tokens per page (default %d)\n"
            "  --pool-pages N        pages in the pool, per layer (default %d)\n"
            "  --layout L            nhd | hnd (default nhd)\n"
            "  --page-table F        csr: kv_indptr / kv_indices / kv_last_page_len, append by (request, position);\n"
            "                        block: a block table [batch, max pages per request] and sequence lengths\n"
            "                        (kv_seq_lens, block_table_stride), append by slot (vLLM's slot mapping)\n"
            "                        (default csr)\n"
            "\nScheduler and trace:\n"
            "  --max-batch N         running requests at most (default %d)\n"
            "  --max-prefill-tokens N  prompt tokens admitted per step at most (default %d)\n"
            "  --requests N          requests in the trace (default %d)\n"
            "  --steps N             stop after N steps (default 0: when every request finished)\n"
            "  --prompt-median X     lognormal prompt length: median (default %g)\n"
            "  --prompt-sigma X      ... and sigma of log (default %g)\n"
            "  --max-prompt N        prompt length cap (default %d)\n"
            "  --output-median X     lognormal output length: median (default %g)\n"
            "  --output-sigma X      ... and sigma of log (default %g)\n"
            "  --max-output N        output length cap (default %d)\n"
            "  --arrival-interval X  mean steps between arrivals, exponential; 0 = all at step 0 (default %g)\n"
            "  --seed N              seed of the trace and of every tensor (default %llu)\n"
            "\nRun:\n"
            "  --backend B           auto | cpu | cuda (default auto: CUDA when usable, else CPU)\n"
            "  --threads N           CPU backend worker threads (default 0: all online CPUs)\n"
            "  --check-every N       sampled float64 check every N steps, 0 = never (default %d)\n"
            "  --check-samples N     (request, head) rows per check and op (default %d)\n"
            "  --tolerance X         max allowed error relative to max(1,|ref|) (default: by o dtype)\n"
            "  --progress-every N    progress line to stderr every N steps, 0 = none (default %d)\n"
            "  --pdl 0|1             attention with programmatic dependent launch (CUDA, compute capability 9.0+;\n"
            "                        kva_run_args.enable_pdl; default 0: this loop synchronises around every call\n"
            "                        to time it, so there is nothing to overlap; 1 checks the launch path)\n"
            "  -h, --help            this text\n",
            d.heads_q, d.heads_kv, d.head_dim, d.layers, d.page_size, d.pool_pages, d.max_batch,
            d.max_prefill_tokens, d.requests, d.prompt_median, d.prompt_sigma, d.max_prompt, d.output_median,
            d.output_sigma, d.max_output, d.arrival_interval, (unsigned long long)d.seed, d.check_every,
            d.check_samples, d.progress_every);
}

static long parse_long(const char* opt, const char* s, long lo, long hi) {
    char* end = NULL;
    errno = 0;
    long v = strtol(s, &end, 10);
    if (errno || !end || *end || end == s || v < lo || v > hi) fatal("--%s: expected an integer in [%ld, %ld], got '%s'", opt, lo, hi, s);
    return v;
}

static double parse_double(const char* opt, const char* s, double lo, double hi) {
    char* end = NULL;
    errno = 0;
    double v = strtod(s, &end);
    if (errno || !end || *end || end == s || !(v >= lo && v <= hi)) fatal("--%s: expected a number in [%g, %g], got '%s'", opt, lo, hi, s);
    return v;
}

static kva_dtype parse_dtype(const char* opt, const char* s, int allow_fp8) {
    if (!strcmp(s, "f16") || !strcmp(s, "fp16") || !strcmp(s, "half")) return KVA_DTYPE_F16;
    if (!strcmp(s, "bf16")) return KVA_DTYPE_BF16;
    if (!strcmp(s, "f32") || !strcmp(s, "fp32") || !strcmp(s, "float")) return KVA_DTYPE_F32;
    if (allow_fp8 && (!strcmp(s, "e4m3") || !strcmp(s, "fp8") || !strcmp(s, "fp8_e4m3"))) return KVA_DTYPE_E4M3;
    if (allow_fp8 && (!strcmp(s, "e5m2") || !strcmp(s, "fp8_e5m2"))) return KVA_DTYPE_E5M2;
    fatal("--%s: unknown dtype '%s' (expected f16, bf16, f32%s)", opt, s, allow_fp8 ? ", e4m3, e5m2" : "");
    return KVA_DTYPE_F32;
}

static void parse_args(int argc, char** argv, config* c) {
    enum {
        O_HEADS_Q = 256, O_HEADS_KV, O_HEAD_DIM, O_LAYERS, O_PAGE_SIZE, O_DTYPE, O_KV_DTYPE, O_LAYOUT, O_MAX_BATCH,
        O_REQUESTS, O_STEPS, O_POOL_PAGES, O_SEED, O_BACKEND, O_THREADS, O_CHECK_EVERY, O_CHECK_SAMPLES,
        O_PROGRESS, O_MAX_PREFILL, O_PROMPT_MEDIAN, O_PROMPT_SIGMA, O_OUTPUT_MEDIAN, O_OUTPUT_SIGMA, O_MAX_PROMPT,
        O_MAX_OUTPUT, O_ARRIVAL, O_TOLERANCE, O_PDL, O_PAGE_TABLE
    };
    static const struct option opts[] = {
        {"heads-q", required_argument, 0, O_HEADS_Q},
        {"heads-kv", required_argument, 0, O_HEADS_KV},
        {"head-dim", required_argument, 0, O_HEAD_DIM},
        {"layers", required_argument, 0, O_LAYERS},
        {"page-size", required_argument, 0, O_PAGE_SIZE},
        {"dtype", required_argument, 0, O_DTYPE},
        {"kv-dtype", required_argument, 0, O_KV_DTYPE},
        {"layout", required_argument, 0, O_LAYOUT},
        {"max-batch", required_argument, 0, O_MAX_BATCH},
        {"requests", required_argument, 0, O_REQUESTS},
        {"steps", required_argument, 0, O_STEPS},
        {"pool-pages", required_argument, 0, O_POOL_PAGES},
        {"seed", required_argument, 0, O_SEED},
        {"backend", required_argument, 0, O_BACKEND},
        {"threads", required_argument, 0, O_THREADS},
        {"check-every", required_argument, 0, O_CHECK_EVERY},
        {"check-samples", required_argument, 0, O_CHECK_SAMPLES},
        {"progress-every", required_argument, 0, O_PROGRESS},
        {"max-prefill-tokens", required_argument, 0, O_MAX_PREFILL},
        {"prompt-median", required_argument, 0, O_PROMPT_MEDIAN},
        {"prompt-sigma", required_argument, 0, O_PROMPT_SIGMA},
        {"output-median", required_argument, 0, O_OUTPUT_MEDIAN},
        {"output-sigma", required_argument, 0, O_OUTPUT_SIGMA},
        {"max-prompt", required_argument, 0, O_MAX_PROMPT},
        {"max-output", required_argument, 0, O_MAX_OUTPUT},
        {"arrival-interval", required_argument, 0, O_ARRIVAL},
        {"tolerance", required_argument, 0, O_TOLERANCE},
        {"pdl", required_argument, 0, O_PDL},
        {"page-table", required_argument, 0, O_PAGE_TABLE},
        {"help", no_argument, 0, 'h'},
        {0, 0, 0, 0},
    };
    int ch;
    while ((ch = getopt_long(argc, argv, "h", opts, NULL)) != -1) {
        const char* name = "";
        for (const struct option* o = opts; o->name; o++)
            if (o->val == ch) name = o->name;
        switch (ch) {
            case O_HEADS_Q: c->heads_q = (int)parse_long(name, optarg, 1, 1024); break;
            case O_HEADS_KV: c->heads_kv = (int)parse_long(name, optarg, 1, 1024); break;
            case O_HEAD_DIM: c->head_dim = (int)parse_long(name, optarg, 1, 1024); break;
            case O_LAYERS: c->layers = (int)parse_long(name, optarg, 1, 1024); break;
            case O_PAGE_SIZE: c->page_size = (int)parse_long(name, optarg, 1, 65536); break;
            case O_DTYPE: c->dtype = parse_dtype(name, optarg, 0); break;
            case O_KV_DTYPE: c->kv_dtype = parse_dtype(name, optarg, 1); break;
            case O_LAYOUT:
                if (!strcmp(optarg, "nhd") || !strcmp(optarg, "NHD")) c->layout = KVA_LAYOUT_NHD;
                else if (!strcmp(optarg, "hnd") || !strcmp(optarg, "HND")) c->layout = KVA_LAYOUT_HND;
                else fatal("--layout: expected nhd or hnd, got '%s'", optarg);
                break;
            case O_MAX_BATCH: c->max_batch = (int)parse_long(name, optarg, 1, 1 << 20); break;
            case O_REQUESTS: c->requests = (int)parse_long(name, optarg, 1, 1 << 24); break;
            case O_STEPS: c->steps = (int)parse_long(name, optarg, 0, 1 << 30); break;
            case O_POOL_PAGES: c->pool_pages = (int)parse_long(name, optarg, 1, 1 << 30); break;
            case O_SEED: c->seed = (uint64_t)parse_long(name, optarg, 0, 0x7fffffffffffffffL); break;
            case O_BACKEND:
                if (!strcmp(optarg, "auto")) c->backend = KVA_BACKEND_AUTO;
                else if (!strcmp(optarg, "cpu")) c->backend = KVA_BACKEND_CPU;
                else if (!strcmp(optarg, "cuda")) c->backend = KVA_BACKEND_CUDA;
                else fatal("--backend: expected auto, cpu or cuda, got '%s'", optarg);
                break;
            case O_THREADS: c->threads = (int)parse_long(name, optarg, 0, 4096); break;
            case O_CHECK_EVERY: c->check_every = (int)parse_long(name, optarg, 0, 1 << 30); break;
            case O_CHECK_SAMPLES: c->check_samples = (int)parse_long(name, optarg, 1, 1024); break;
            case O_PROGRESS: c->progress_every = (int)parse_long(name, optarg, 0, 1 << 30); break;
            case O_MAX_PREFILL: c->max_prefill_tokens = (int)parse_long(name, optarg, 1, 1 << 24); break;
            case O_PROMPT_MEDIAN: c->prompt_median = parse_double(name, optarg, 1, 1e7); break;
            case O_PROMPT_SIGMA: c->prompt_sigma = parse_double(name, optarg, 0, 10); break;
            case O_OUTPUT_MEDIAN: c->output_median = parse_double(name, optarg, 1, 1e7); break;
            case O_OUTPUT_SIGMA: c->output_sigma = parse_double(name, optarg, 0, 10); break;
            case O_MAX_PROMPT: c->max_prompt = (int)parse_long(name, optarg, 1, 1 << 24); break;
            case O_MAX_OUTPUT: c->max_output = (int)parse_long(name, optarg, 1, 1 << 24); break;
            case O_ARRIVAL: c->arrival_interval = parse_double(name, optarg, 0, 1e6); break;
            case O_TOLERANCE: c->tolerance = parse_double(name, optarg, 0, 1e6); break;
            case O_PDL: c->pdl = (int)parse_long(name, optarg, 0, 1); break;
            case O_PAGE_TABLE:
                if (!strcmp(optarg, "csr")) c->block_table = 0;
                else if (!strcmp(optarg, "block")) c->block_table = 1;
                else fatal("--page-table: expected csr or block, got '%s'", optarg);
                break;
            case 'h': usage(stdout); exit(0);
            default: usage(stderr); exit(1);
        }
    }
    if (optind < argc) fatal("unexpected argument '%s' (see --help)", argv[optind]);
    if ((int)c->kv_dtype < 0) c->kv_dtype = c->dtype;
    if (c->heads_q % c->heads_kv != 0) fatal("--heads-q (%d) must be a multiple of --heads-kv (%d)", c->heads_q, c->heads_kv);
    if (c->max_prefill_tokens < c->max_prompt) c->max_prefill_tokens = c->max_prompt; /* any prompt fits a step */
    int64_t max_tokens = (int64_t)c->max_prompt + c->max_output - 1;
    int64_t max_pages = (max_tokens + c->page_size - 1) / c->page_size;
    if (max_pages > c->pool_pages)
        fatal("--pool-pages %d cannot hold the longest possible request (%lld tokens = %lld pages of %d); "
              "raise --pool-pages or lower --max-prompt/--max-output", c->pool_pages, (long long)max_tokens,
              (long long)max_pages, c->page_size);
    if (c->tolerance == 0) {
        /* Compared with a float64 reference over the same stored (already rounded) q/K/V, the only errors
           are fp32 accumulation and the final rounding of o: half an ulp of 1 is 6e-8 (f32), 4.9e-4 (f16),
           3.9e-3 (bf16). The tolerances leave a margin of ~4x for accumulation order and fast exp. */
        c->tolerance = c->dtype == KVA_DTYPE_F32 ? 1e-4 : c->dtype == KVA_DTYPE_F16 ? 2e-3 : 1.6e-2;
    }
}

/* ---------------------------------------------------------------------------------------------- */
/* Requests, pages, batches                                                                        */

enum { REQ_WAITING = 0, REQ_RUNNING = 1, REQ_DONE = 2 };

typedef struct request {
    int id;
    int arrival_step;
    int prompt_len;
    int output_len;
    int generated;   /* output tokens produced so far (prefill produces the first) */
    int kv_len;      /* tokens in the cache */
    int state;
    int num_pages;
    int max_pages;   /* pages at the end: ceil((prompt + output - 1) / page_size) */
    int32_t* pages;  /* page table of the request, host */
    int admit_step;
    int finish_step;
} request;

typedef struct page_pool {
    int32_t* free_list; /* stack of free page ids */
    int num_free;
    int num_pages;
} page_pool;

static int32_t pool_take(page_pool* p) {
    if (p->num_free == 0) fatal("internal: page pool exhausted despite admission reservation");
    return p->free_list[--p->num_free];
}

static void pool_give(page_pool* p, int32_t page) { p->free_list[p->num_free++] = page; }

/* One op's batch for a step: page table, append inputs, q/o/lse, workspace and plan. */
typedef struct batch {
    kva_op op;
    kva_attention_desc desc;
    int cap_batch;
    int64_t cap_rows;  /* query rows = appended tokens (prefill: prompt tokens; decode: one per request) */
    int64_t cap_pages; /* page-table entries */
    int size;
    int64_t rows;
    int64_t num_entries;
    request** reqs;
    int32_t* qo_indptr; /* host only (plan input) */
    buf kv_indptr, kv_indices, last_page_len, batch_indices, positions;
    int32_t bt_stride; /* --page-table block: entries per block-table row (kv_indices holds the table) */
    int32_t* seq_lens; /* ... host [cap_batch] */
    buf slots;         /* ... int64 [cap_rows]: page * page_size + offset of each appended token */
    buf append_k, append_v, q, o, lse;
    kva_workspace ws;
    kva_plan plan;
} batch;

typedef struct app {
    config cfg;
    kva_context* ctx;
    kva_backend backend;
    int workers;
    size_t q_bytes, kv_bytes; /* element sizes */
    int group;
    float k_scale, v_scale;
    /* pool: [layer][page][2][page_size][heads][dim] (NHD) or [layer][page][2][heads][page_size][dim] */
    void* pool;
    int64_t page_elems;  /* elements of one page block (K and V) */
    int64_t layer_elems; /* elements of one layer */
    page_pool pages;
    request* reqs;
    batch prefill, decode;
    rng data_rng;
    /* check scratch */
    void* page_scratch;
    double* scores;
    void* row_scratch;
    /* check results */
    double max_err_o, max_err_lse;
    int64_t checks;
    int check_failed;
} app;

static void batch_init(app* a, batch* b, kva_op op, int cap_batch, int64_t cap_rows, int64_t cap_pages) {
    const config* c = &a->cfg;
    memset(b, 0, sizeof *b);
    b->op = op;
    b->cap_batch = cap_batch;
    b->cap_rows = cap_rows;
    b->cap_pages = cap_pages;
    kva_attention_desc_init(&b->desc, c->heads_q, c->heads_kv, c->head_dim, c->dtype);
    b->desc.kv_dtype = c->kv_dtype;
    b->desc.mask_mode = op == KVA_OP_BATCH_PREFILL_PAGED ? KVA_MASK_CAUSAL : KVA_MASK_NONE;
    KVA_CHECK(kva_attention_desc_check(a->ctx, &b->desc));
    b->reqs = (request**)xcalloc((size_t)cap_batch, sizeof(request*));
    b->qo_indptr = (int32_t*)xcalloc((size_t)cap_batch + 1, sizeof(int32_t));
    b->kv_indptr = buf_alloc(((size_t)cap_batch + 1) * sizeof(int32_t));
    b->kv_indices = buf_alloc((size_t)cap_pages * sizeof(int32_t));
    b->last_page_len = buf_alloc((size_t)cap_batch * sizeof(int32_t));
    b->batch_indices = buf_alloc((size_t)cap_rows * sizeof(int32_t));
    b->positions = buf_alloc((size_t)cap_rows * sizeof(int32_t));
    if (c->block_table) {
        /* a row holds the longest possible request */
        const int64_t max_tokens = (int64_t)c->max_prompt + c->max_output - 1;
        b->bt_stride = (int32_t)((max_tokens + c->page_size - 1) / c->page_size);
        if ((int64_t)cap_batch * b->bt_stride > INT32_MAX) fatal("--page-table block: the block table is too large");
        b->cap_pages = (int64_t)cap_batch * b->bt_stride;
        buf_free(&b->kv_indices);
        b->kv_indices = buf_alloc((size_t)b->cap_pages * sizeof(int32_t));
        b->seq_lens = (int32_t*)xcalloc((size_t)cap_batch, sizeof(int32_t));
        b->slots = buf_alloc((size_t)cap_rows * sizeof(int64_t));
    }
    size_t kv_row = (size_t)c->heads_kv * (size_t)c->head_dim * a->kv_bytes;
    size_t q_row = (size_t)c->heads_q * (size_t)c->head_dim * a->q_bytes;
    b->append_k = buf_alloc((size_t)cap_rows * kv_row);
    b->append_v = buf_alloc((size_t)cap_rows * kv_row);
    b->q = buf_alloc((size_t)cap_rows * q_row);
    b->o = buf_alloc((size_t)cap_rows * q_row);
    b->lse = buf_alloc((size_t)cap_rows * (size_t)c->heads_q * sizeof(float));
    /* Worst-case workspace for every batch this op can see, so plan never reports WORKSPACE_TOO_SMALL. */
    size_t dev_bytes = 0, host_bytes = 0;
    KVA_CHECK(kva_workspace_bound(a->ctx, &b->desc, op, cap_batch, cap_rows, &dev_bytes, &host_bytes));
    b->ws.device = dev_alloc(dev_bytes);
    b->ws.device_bytes = dev_bytes;
    b->ws.host = host_bytes ? pinned_alloc(host_bytes) : NULL;
    b->ws.host_bytes = host_bytes;
}

static void batch_free(batch* b) {
    free(b->reqs);
    free(b->qo_indptr);
    buf_free(&b->kv_indptr);
    buf_free(&b->kv_indices);
    buf_free(&b->last_page_len);
    buf_free(&b->batch_indices);
    buf_free(&b->positions);
    free(b->seq_lens);
    if (b->slots.h) buf_free(&b->slots);
    buf_free(&b->append_k);
    buf_free(&b->append_v);
    buf_free(&b->q);
    buf_free(&b->o);
    buf_free(&b->lse);
    dev_free(b->ws.device);
    pinned_free(b->ws.host);
}

/* Fill the host page table and append inputs of the batch from its requests (whose kv_len already counts
   the tokens appended this step: `new_tokens[i]` of them, at the end) and copy them to the backend. */
static void batch_build(app* a, batch* b, const int* new_tokens) {
    int32_t* indptr = (int32_t*)b->kv_indptr.h;
    int32_t* indices = (int32_t*)b->kv_indices.h;
    int32_t* last = (int32_t*)b->last_page_len.h;
    int32_t* bidx = (int32_t*)b->batch_indices.h;
    int32_t* pos = (int32_t*)b->positions.h;
    int ps = a->cfg.page_size;
    int64_t e = 0, rows = 0;
    indptr[0] = 0;
    b->qo_indptr[0] = 0;
    int64_t* slots = (int64_t*)b->slots.h;
    for (int i = 0; i < b->size; i++) {
        const request* r = b->reqs[i];
        if (b->bt_stride) { /* block-table row i: the request's pages, then -1 (never read) */
            if (r->num_pages > b->bt_stride) fatal("internal: request %d outgrows its block-table row", r->id);
            int32_t* row = indices + (int64_t)i * b->bt_stride;
            for (int p = 0; p < b->bt_stride; p++) row[p] = p < r->num_pages ? r->pages[p] : -1;
            b->seq_lens[i] = r->kv_len;
            e = (int64_t)(i + 1) * b->bt_stride;
        } else {
            for (int p = 0; p < r->num_pages; p++) indices[e++] = r->pages[p];
            indptr[i + 1] = (int32_t)e;
            last[i] = r->kv_len == 0 ? 0 : (r->kv_len - 1) % ps + 1;
        }
        for (int t = r->kv_len - new_tokens[i]; t < r->kv_len; t++) {
            bidx[rows] = i;
            pos[rows] = t;
            if (slots) slots[rows] = (int64_t)r->pages[t / ps] * ps + t % ps;
            rows++;
        }
        b->qo_indptr[i + 1] = (int32_t)rows;
    }
    if (e > b->cap_pages || rows > b->cap_rows) fatal("internal: batch capacity exceeded");
    b->num_entries = e;
    b->rows = rows;
    if (b->bt_stride) {
        h2d(b->kv_indices.d, indices, (size_t)e * sizeof(int32_t));
        h2d(b->slots.d, slots, (size_t)rows * sizeof(int64_t));
        return;
    }
    h2d(b->kv_indptr.d, indptr, ((size_t)b->size + 1) * sizeof(int32_t));
    h2d(b->kv_indices.d, indices, (size_t)e * sizeof(int32_t));
    h2d(b->last_page_len.d, last, (size_t)b->size * sizeof(int32_t));
    h2d(b->batch_indices.d, bidx, (size_t)rows * sizeof(int32_t));
    h2d(b->positions.d, pos, (size_t)rows * sizeof(int32_t));
}

static void batch_plan(app* a, batch* b) {
    kva_plan_params pp;
    kva_plan_params_init(&pp);
    pp.batch_size = b->size;
    pp.qo_indptr = b->op == KVA_OP_BATCH_DECODE ? NULL : b->qo_indptr;
    pp.kv_indptr = (const int32_t*)b->kv_indptr.h;
    pp.kv_last_page_len = (const int32_t*)b->last_page_len.h;
    pp.page_size = a->cfg.page_size;
    pp.num_pages = a->cfg.pool_pages;
    pp.kv_indices = (const int32_t*)b->kv_indices.h;
    if (b->bt_stride) {
        pp.kv_indptr = NULL;
        pp.kv_last_page_len = NULL;
        pp.kv_seq_lens = b->seq_lens;
        pp.block_table_stride = b->bt_stride;
    }
    if (b->op == KVA_OP_BATCH_DECODE)
        KVA_CHECK(kva_batch_decode_plan(a->ctx, &b->desc, &pp, &b->ws, &b->plan, NULL));
    else
        KVA_CHECK(kva_batch_prefill_paged_plan(a->ctx, &b->desc, &pp, &b->ws, &b->plan, NULL));
}

static kva_paged_kv layer_paged(const app* a, const batch* b, int layer) {
    const config* c = &a->cfg;
    kva_paged_kv p;
    memset(&p, 0, sizeof p);
    int64_t half = (int64_t)c->page_size * c->heads_kv * c->head_dim; /* elements of K (or V) in a page */
    char* base = (char*)a->pool + (size_t)((int64_t)layer * a->layer_elems) * a->kv_bytes;
    p.k_data = base;
    p.v_data = base + (size_t)half * a->kv_bytes;
    p.dtype = c->kv_dtype;
    p.num_pages = c->pool_pages;
    p.page_size = c->page_size;
    p.num_heads = c->heads_kv;
    p.head_dim_qk = c->head_dim;
    p.head_dim_vo = c->head_dim;
    p.k_stride_page = p.v_stride_page = a->page_elems;
    if (c->layout == KVA_LAYOUT_NHD) {
        p.k_stride_token = p.v_stride_token = (int64_t)c->heads_kv * c->head_dim;
        p.k_stride_head = p.v_stride_head = c->head_dim;
    } else {
        p.k_stride_token = p.v_stride_token = c->head_dim;
        p.k_stride_head = p.v_stride_head = (int64_t)c->page_size * c->head_dim;
    }
    p.indices = (const int32_t*)b->kv_indices.d;
    if (!b->bt_stride) { /* (the block-table form has neither: the plan holds the lengths) */
        p.indptr = (const int32_t*)b->kv_indptr.d;
        p.last_page_len = (const int32_t*)b->last_page_len.d;
    }
    p.num_indices = b->cap_pages; /* the table buffer's length: bounds every indptr range */
    return p;
}

/* Fresh random q rows and new K/V rows of the batch for one layer (not timed). */
static void batch_fill_inputs(app* a, batch* b) {
    const config* c = &a->cfg;
    int64_t n = b->rows * c->heads_kv * c->head_dim;
    fill_random(b->append_k.h, c->kv_dtype, n, &a->data_rng, 1.0f / a->k_scale);
    fill_random(b->append_v.h, c->kv_dtype, n, &a->data_rng, 1.0f / a->v_scale);
    h2d(b->append_k.d, b->append_k.h, (size_t)n * a->kv_bytes);
    h2d(b->append_v.d, b->append_v.h, (size_t)n * a->kv_bytes);
    int64_t nq = b->rows * c->heads_q * c->head_dim;
    fill_random(b->q.h, c->dtype, nq, &a->data_rng, 1.0f);
    h2d(b->q.d, b->q.h, (size_t)nq * a->q_bytes);
}

/* Append the batch's new K/V rows into the layer's pages. */
static void batch_append(app* a, batch* b, const kva_paged_kv* paged) {
    const config* c = &a->cfg;
    kva_tensor ak = kva_tensor_make(b->append_k.d, c->kv_dtype, 3, b->rows, c->heads_kv, c->head_dim, 0);
    kva_tensor av = kva_tensor_make(b->append_v.d, c->kv_dtype, 3, b->rows, c->heads_kv, c->head_dim, 0);
    if (b->bt_stride)
        KVA_CHECK(kva_append_paged_kv_cache_by_slot(a->ctx, &ak, &av, (const int64_t*)b->slots.d, b->rows, paged, NULL));
    else
        KVA_CHECK(kva_append_paged_kv_cache(a->ctx, &ak, &av, (const int32_t*)b->batch_indices.d,
                                            (const int32_t*)b->positions.d, b->rows, paged, b->size, NULL));
}

static void batch_run(app* a, batch* b, const kva_paged_kv* paged) {
    const config* c = &a->cfg;
    kva_run_args ra;
    kva_run_args_init(&ra);
    ra.q = kva_tensor_make(b->q.d, c->dtype, 3, b->rows, c->heads_q, c->head_dim, 0);
    ra.o = kva_tensor_make(b->o.d, c->dtype, 3, b->rows, c->heads_q, c->head_dim, 0);
    ra.lse = kva_tensor_make(b->lse.d, KVA_DTYPE_F32, 2, b->rows, c->heads_q, 0, 0);
    ra.paged = *paged;
    ra.k_scale = a->k_scale;
    ra.v_scale = a->v_scale;
    ra.enable_pdl = c->pdl;
    if (b->op == KVA_OP_BATCH_DECODE) KVA_CHECK(kva_batch_decode_run(a->ctx, &b->plan, &b->ws, &ra));
    else KVA_CHECK(kva_batch_prefill_paged_run(a->ctx, &b->plan, &b->ws, &ra));
}

/* ---------------------------------------------------------------------------------------------- */
/* Float64 reference for one (request, query row, query head), read from the pool through the page table */

static void check_row(app* a, batch* b, int layer, int bi, int64_t qrow, int qh) {
    const config* c = &a->cfg;
    const request* r = b->reqs[bi];
    int D = c->head_dim, ps = c->page_size, kvh = qh / a->group;
    int64_t qo_len = b->qo_indptr[bi + 1] - b->qo_indptr[bi];
    int64_t i = qrow - b->qo_indptr[bi];                  /* row within the request */
    int64_t q_pos = (int64_t)r->kv_len - qo_len + i;       /* bottom-right aligned */
    int64_t visible = b->desc.mask_mode == KVA_MASK_CAUSAL ? q_pos + 1 : r->kv_len;
    double sm_scale = 1.0 / sqrt((double)D);
    const char* layer_base = (const char*)a->pool + (size_t)((int64_t)layer * a->layer_elems) * a->kv_bytes;
    int64_t half = (int64_t)ps * c->heads_kv * D;
    int64_t tok_stride = c->layout == KVA_LAYOUT_NHD ? (int64_t)c->heads_kv * D : D;
    int64_t head_stride = c->layout == KVA_LAYOUT_NHD ? D : (int64_t)ps * D;
    /* q row (host copy) */
    const void* qh_base = b->q.h;
    int64_t q_off = (qrow * c->heads_q + qh) * D;
    /* pass 1: logits */
    double m = -INFINITY;
    int64_t loaded_page = -1;
    for (int64_t j = 0; j < visible; j++) {
        int64_t pi = j / ps, t = j % ps;
        if (pi != loaded_page) {
            d2h(a->page_scratch, layer_base + (size_t)((int64_t)r->pages[pi] * a->page_elems) * a->kv_bytes,
                (size_t)a->page_elems * a->kv_bytes);
            loaded_page = pi;
        }
        int64_t k_off = t * tok_stride + kvh * head_stride;
        double dot = 0;
        for (int d = 0; d < D; d++) dot += load_elem(qh_base, c->dtype, q_off + d) * load_elem(a->page_scratch, c->kv_dtype, k_off + d);
        double x = sm_scale * dot * a->k_scale;
        a->scores[j] = x;
        if (x > m) m = x;
    }
    /* pass 2: softmax-weighted V (V rows reloaded page by page) */
    double* acc = (double*)a->row_scratch;
    for (int d = 0; d < D; d++) acc[d] = 0;
    double denom = 0;
    loaded_page = -1;
    for (int64_t j = 0; j < visible; j++) {
        int64_t pi = j / ps, t = j % ps;
        if (pi != loaded_page) {
            d2h(a->page_scratch, layer_base + (size_t)((int64_t)r->pages[pi] * a->page_elems) * a->kv_bytes,
                (size_t)a->page_elems * a->kv_bytes);
            loaded_page = pi;
        }
        double w = exp(a->scores[j] - m);
        denom += w;
        int64_t v_off = half + t * tok_stride + kvh * head_stride;
        for (int d = 0; d < D; d++) acc[d] += w * load_elem(a->page_scratch, c->kv_dtype, v_off + d) * a->v_scale;
    }
    double lse_ref = visible > 0 ? (m + log(denom)) / log(2.0) : -INFINITY;
    /* kvattn's output */
    size_t orow_bytes = (size_t)D * a->q_bytes;
    char orow[4096 * 4];
    if (orow_bytes > sizeof orow) fatal("head dim too large for the check");
    d2h(orow, (const char*)b->o.d + (size_t)(qrow * c->heads_q + qh) * orow_bytes, orow_bytes);
    float lse_got;
    d2h(&lse_got, (const float*)b->lse.d + qrow * c->heads_q + qh, sizeof(float));
    double err_o = 0;
    for (int d = 0; d < D; d++) {
        double ref = visible > 0 ? acc[d] / denom : 0.0;
        double got = load_elem(orow, c->dtype, d);
        double e = fabs(got - ref) / fmax(1.0, fabs(ref));
        if (!(e <= err_o)) err_o = isnan(e) ? INFINITY : fmax(err_o, e);
    }
    double err_lse;
    if (visible == 0) err_lse = isinf(lse_got) && lse_got < 0 ? 0 : INFINITY;
    else {
        err_lse = fabs((double)lse_got - lse_ref) / fmax(1.0, fabs(lse_ref));
        if (isnan(err_lse)) err_lse = INFINITY;
    }
    a->checks++;
    if (err_o > a->max_err_o) a->max_err_o = err_o;
    if (err_lse > a->max_err_lse) a->max_err_lse = err_lse;
    double lse_tol = 1e-4 * 10; /* lse is f32 in every mode: ~1e-6 relative expected */
    if (err_o > a->cfg.tolerance || err_lse > lse_tol) {
        if (!a->check_failed)
            fprintf(stderr,
                    "kvattn_serve: CHECK FAILED: %s layer %d request %d (batch row %d) query row %lld head %d "
                    "kv_len %d: o error %.3g (tol %.3g), lse %.6f vs reference %.6f\n",
                    b->op == KVA_OP_BATCH_DECODE ? "decode" : "prefill", layer, r->id, bi, (long long)i, qh,
                    r->kv_len, err_o, a->cfg.tolerance, (double)lse_got, lse_ref);
        a->check_failed = 1;
    }
}

/* The appended K/V row `row` of the batch where the request's pages say it belongs (bytes equal to the source) */
static void check_appended(app* a, batch* b, int layer, int64_t row) {
    const config* c = &a->cfg;
    const int bi = ((const int32_t*)b->batch_indices.h)[row], t = ((const int32_t*)b->positions.h)[row];
    const request* r = b->reqs[bi];
    const int ps = c->page_size;
    const char* layer_base = (const char*)a->pool + (size_t)((int64_t)layer * a->layer_elems) * a->kv_bytes;
    d2h(a->page_scratch, layer_base + (size_t)((int64_t)r->pages[t / ps] * a->page_elems) * a->kv_bytes,
        (size_t)a->page_elems * a->kv_bytes);
    const int64_t half = (int64_t)ps * c->heads_kv * c->head_dim;
    const int64_t tok_stride = c->layout == KVA_LAYOUT_NHD ? (int64_t)c->heads_kv * c->head_dim : c->head_dim;
    const int64_t head_stride = c->layout == KVA_LAYOUT_NHD ? c->head_dim : (int64_t)ps * c->head_dim;
    const size_t hb = (size_t)c->head_dim * a->kv_bytes;
    for (int h = 0; h < c->heads_kv; h++)
        for (int kv = 0; kv < 2; kv++) {
            const char* got = (const char*)a->page_scratch +
                              (size_t)((kv ? half : 0) + (int64_t)(t % ps) * tok_stride + h * head_stride) * a->kv_bytes;
            const char* src = (const char*)(kv ? b->append_v.h : b->append_k.h) + ((size_t)row * c->heads_kv + h) * hb;
            if (memcmp(got, src, hb) != 0) {
                if (!a->check_failed)
                    fprintf(stderr,
                            "kvattn_serve: CHECK FAILED: %s layer %d request %d: the appended %s row of position %d "
                            "(head %d) is not in page %d at offset %d\n",
                            b->op == KVA_OP_BATCH_DECODE ? "decode" : "prefill", layer, r->id, kv ? "V" : "K", t, h,
                            r->pages[t / ps], t % ps);
                a->check_failed = 1;
                return;
            }
        }
}

static void check_batch(app* a, batch* b, int layer, rng* r) {
    if (b->size == 0) return;
    for (int s = 0; s < a->cfg.check_samples; s++) check_appended(a, b, layer, rng_below(r, b->rows));
    for (int s = 0; s < a->cfg.check_samples; s++) {
        int64_t qrow = rng_below(r, b->rows);
        int bi = 0;
        while (b->qo_indptr[bi + 1] <= qrow) bi++;
        /* in prefill, also look at each request's last row (the one that sees every key) now and then */
        if (b->op != KVA_OP_BATCH_DECODE && (s & 1)) qrow = b->qo_indptr[bi + 1] - 1;
        check_row(a, b, layer, bi, qrow, (int)rng_below(r, a->cfg.heads_q));
    }
}

/* ---------------------------------------------------------------------------------------------- */
/* Trace                                                                                           */

static void make_trace(app* a) {
    const config* c = &a->cfg;
    rng r;
    rng_seed(&r, c->seed * 0x100000001b3ull + 17);
    a->reqs = (request*)xcalloc((size_t)c->requests, sizeof(request));
    double t = 0;
    for (int i = 0; i < c->requests; i++) {
        request* q = &a->reqs[i];
        q->id = i;
        if (c->arrival_interval > 0 && i > 0) t += -c->arrival_interval * log(1.0 - rng_uniform(&r));
        q->arrival_step = (int)t;
        double p = c->prompt_median * exp(c->prompt_sigma * rng_normal(&r));
        double o = c->output_median * exp(c->output_sigma * rng_normal(&r));
        q->prompt_len = (int)fmin(fmax(round(p), 1), c->max_prompt);
        q->output_len = (int)fmin(fmax(round(o), 1), c->max_output);
        int total = q->prompt_len + q->output_len - 1;
        q->max_pages = (total + c->page_size - 1) / c->page_size;
        q->pages = (int32_t*)xcalloc((size_t)q->max_pages, sizeof(int32_t));
        q->state = REQ_WAITING;
        q->admit_step = q->finish_step = -1;
    }
}

static void request_grow(app* a, request* r, int tokens) {
    int ps = a->cfg.page_size;
    int need = (r->kv_len + tokens + ps - 1) / ps;
    if (need > r->max_pages) fatal("internal: request %d outgrows its page budget", r->id);
    while (r->num_pages < need) r->pages[r->num_pages++] = pool_take(&a->pages);
    r->kv_len += tokens;
}

static void request_finish(app* a, request* r, int step) {
    for (int p = 0; p < r->num_pages; p++) pool_give(&a->pages, r->pages[p]);
    r->num_pages = 0;
    r->state = REQ_DONE;
    r->finish_step = step;
}

/* ---------------------------------------------------------------------------------------------- */
/* Statistics                                                                                      */

static int cmp_double(const void* x, const void* y) {
    double a = *(const double*)x, b = *(const double*)y;
    return a < b ? -1 : a > b;
}

static double percentile(const double* v, int n, double p) { /* nearest rank on a sorted copy */
    if (n <= 0) return 0;
    double* s = (double*)xmalloc((size_t)n * sizeof(double));
    memcpy(s, v, (size_t)n * sizeof(double));
    qsort(s, (size_t)n, sizeof(double), cmp_double);
    int k = (int)ceil(p / 100.0 * n) - 1;
    if (k < 0) k = 0;
    if (k >= n) k = n - 1;
    double r = s[k];
    free(s);
    return r;
}

static double mean_of(const double* v, int n) {
    double s = 0;
    for (int i = 0; i < n; i++) s += v[i];
    return n ? s / n : 0;
}

typedef struct totals {
    int64_t prefill_tokens, decode_tokens, prefill_requests;
    double prefill_flops, decode_bytes; /* over every layer */
    double t_prefill_run, t_decode_run, t_append, t_plan, t_check;
} totals;

/* ---------------------------------------------------------------------------------------------- */

static const char* backend_name(kva_backend b) {
    return b == KVA_BACKEND_CUDA ? "cuda" : b == KVA_BACKEND_CPU ? "cpu" : "auto";
}

int main(int argc, char** argv) {
    app A;
    memset(&A, 0, sizeof A);
    app* a = &A;
    config_defaults(&a->cfg);
    parse_args(argc, argv, &a->cfg);
    const config* c = &a->cfg;
    init_format_tables();
    double t_start = now_sec();

    /* context */
    kva_context_options co;
    kva_context_options_init(&co);
    co.backend = c->backend;
    co.num_threads = c->threads;
    KVA_CHECK(kva_context_create(&co, &a->ctx));
    a->backend = kva_context_backend(a->ctx);
    a->workers = kva_context_num_workers(a->ctx);
    if (a->backend == KVA_BACKEND_CUDA) cuda_load(co.device);

    a->q_bytes = kva_dtype_size(c->dtype);
    a->kv_bytes = kva_dtype_size(c->kv_dtype);
    a->group = c->heads_q / c->heads_kv;
    int fp8 = c->kv_dtype == KVA_DTYPE_E4M3 || c->kv_dtype == KVA_DTYPE_E5M2;
    a->k_scale = fp8 ? 0.5f : 1.0f; /* fp8 stores x / scale; the kernels multiply back */
    a->v_scale = fp8 ? 0.25f : 1.0f;

    /* pool */
    a->page_elems = 2 * (int64_t)c->page_size * c->heads_kv * c->head_dim;
    a->layer_elems = a->page_elems * c->pool_pages;
    size_t pool_bytes = (size_t)(a->layer_elems * c->layers) * a->kv_bytes;
    a->pool = dev_alloc(pool_bytes);
    a->pages.num_pages = c->pool_pages;
    a->pages.free_list = (int32_t*)xmalloc((size_t)c->pool_pages * sizeof(int32_t));
    {   /* shuffled free list: page tables are scattered like in a long-running server */
        rng pr;
        rng_seed(&pr, c->seed ^ 0x5eed0f9a6e5ull);
        for (int i = 0; i < c->pool_pages; i++) a->pages.free_list[i] = i;
        for (int i = c->pool_pages - 1; i > 0; i--) {
            int j = (int)rng_below(&pr, i + 1);
            int32_t t = a->pages.free_list[i];
            a->pages.free_list[i] = a->pages.free_list[j];
            a->pages.free_list[j] = t;
        }
        a->pages.num_free = c->pool_pages;
    }
    rng_seed(&a->data_rng, c->seed * 31 + 7);

    make_trace(a);
    int64_t max_kv = 0, sum_prompt = 0, sum_output = 0;
    for (int i = 0; i < c->requests; i++) {
        sum_prompt += a->reqs[i].prompt_len;
        sum_output += a->reqs[i].output_len;
        int64_t t = a->reqs[i].prompt_len + a->reqs[i].output_len - 1;
        if (t > max_kv) max_kv = t;
    }

    batch_init(a, &a->prefill, KVA_OP_BATCH_PREFILL_PAGED, c->max_batch, c->max_prefill_tokens, c->pool_pages);
    batch_init(a, &a->decode, KVA_OP_BATCH_DECODE, c->max_batch, c->max_batch, c->pool_pages);
    a->page_scratch = xmalloc((size_t)a->page_elems * a->kv_bytes);
    a->scores = (double*)xmalloc((size_t)(max_kv + 1) * sizeof(double));
    a->row_scratch = xmalloc((size_t)c->head_dim * sizeof(double));

    fprintf(stderr,
            "kvattn_serve: kvattn %s, backend %s (%d workers); %d/%d heads, D %d, %d layers, q/o %s, kv %s, "
            "page %d %s, pool %d pages/layer (%.1f MB total)\n",
            kva_version_string(), backend_name(a->backend), a->workers, c->heads_q, c->heads_kv, c->head_dim,
            c->layers, kva_dtype_name(c->dtype), kva_dtype_name(c->kv_dtype), c->page_size,
            c->layout == KVA_LAYOUT_NHD ? "NHD" : "HND", c->pool_pages, (double)pool_bytes / 1e6);
    fprintf(stderr,
            "kvattn_serve: trace seed %llu: %d requests, prompt tokens %lld (lognormal median %g sigma %g, cap %d), "
            "output tokens %lld (median %g sigma %g, cap %d), longest request %lld tokens\n",
            (unsigned long long)c->seed, c->requests, (long long)sum_prompt, c->prompt_median, c->prompt_sigma,
            c->max_prompt, (long long)sum_output, c->output_median, c->output_sigma, c->max_output,
            (long long)max_kv);

    /* scheduler state */
    request** running = (request**)xcalloc((size_t)c->max_batch, sizeof(request*));
    int num_running = 0, next_waiting = 0, finished = 0;
    int step_cap = 1024, steps = 0;
    double* step_attn = (double*)xmalloc((size_t)step_cap * sizeof(double));
    double* step_plan = (double*)xmalloc((size_t)step_cap * sizeof(double));
    int* new_tokens = (int*)xcalloc((size_t)c->max_batch, sizeof(int));
    totals T;
    memset(&T, 0, sizeof T);
    rng check_rng;
    rng_seed(&check_rng, c->seed + 99);
    int sim_step = 0;       /* trace clock (arrivals) */
    int64_t max_pages_used = 0, max_running = 0;
    int64_t waits_pool = 0, waits_batch = 0; /* steps in which an arrived request could not be admitted */

    while (finished < c->requests && (c->steps == 0 || steps < c->steps)) {
        /* nothing to do until the next arrival: fast-forward the trace clock */
        if (num_running == 0 && next_waiting < c->requests && a->reqs[next_waiting].arrival_step > sim_step)
            sim_step = a->reqs[next_waiting].arrival_step;

        /* 1. decode batch: requests already running (each appends the token produced last step) */
        batch* pb = &a->prefill;
        batch* db = &a->decode;
        db->size = 0;
        for (int i = 0; i < num_running; i++) {
            request* r = running[i];
            request_grow(a, r, 1);
            db->reqs[db->size] = r;
            new_tokens[db->size] = 1;
            db->size++;
        }
        if (db->size) batch_build(a, db, new_tokens);

        /* 2. admission (FCFS): batch slots, prefill token budget, pages for the prompt now plus the growth
              every admitted request may still need */
        int64_t reserved = 0;
        for (int i = 0; i < num_running; i++) reserved += running[i]->max_pages - running[i]->num_pages;
        pb->size = 0;
        int64_t prefill_tokens = 0;
        while (next_waiting < c->requests) {
            request* r = &a->reqs[next_waiting];
            if (r->arrival_step > sim_step) break;
            if (num_running + pb->size >= c->max_batch) {
                waits_batch++;
                break;
            }
            if (prefill_tokens + r->prompt_len > c->max_prefill_tokens) break;
            if ((int64_t)a->pages.num_free - reserved < r->max_pages) { /* the pool is full: wait */
                waits_pool++;
                break;
            }
            request_grow(a, r, r->prompt_len);
            reserved += r->max_pages - r->num_pages;
            r->state = REQ_RUNNING;
            r->admit_step = steps;
            prefill_tokens += r->prompt_len;
            pb->reqs[pb->size] = r;
            new_tokens[pb->size] = r->prompt_len;
            pb->size++;
            next_waiting++;
        }
        if (pb->size) batch_build(a, pb, new_tokens);
        if (pb->size == 0 && db->size == 0) fatal("internal: scheduler made no progress at step %d", steps);

        /* 3. plans: once per step, shared by every layer */
        double t0 = now_sec();
        if (pb->size) batch_plan(a, pb);
        if (db->size) batch_plan(a, db);
        double t_plan = now_sec() - t0;

        /* 4. layers */
        int check_layer = -1;
        if (c->check_every > 0 && steps % c->check_every == 0) check_layer = (int)rng_below(&check_rng, c->layers);
        double t_attn = 0;
        for (int l = 0; l < c->layers; l++) {
            if (pb->size) {
                kva_paged_kv pg = layer_paged(a, pb, l);
                batch_fill_inputs(a, pb);
                dev_sync();
                double s0 = now_sec();
                batch_append(a, pb, &pg);
                dev_sync();
                double s1 = now_sec();
                batch_run(a, pb, &pg);
                dev_sync();
                double s2 = now_sec();
                T.t_append += s1 - s0;
                T.t_prefill_run += s2 - s1;
                t_attn += s2 - s1;
                if (l == check_layer) {
                    double s3 = now_sec();
                    check_batch(a, pb, l, &check_rng);
                    T.t_check += now_sec() - s3;
                }
            }
            if (db->size) {
                kva_paged_kv pg = layer_paged(a, db, l);
                batch_fill_inputs(a, db);
                dev_sync();
                double s0 = now_sec();
                batch_append(a, db, &pg);
                dev_sync();
                double s1 = now_sec();
                batch_run(a, db, &pg);
                dev_sync();
                double s2 = now_sec();
                T.t_append += s1 - s0;
                T.t_decode_run += s2 - s1;
                t_attn += s2 - s1;
                if (l == check_layer) {
                    double s3 = now_sec();
                    check_batch(a, db, l, &check_rng);
                    T.t_check += now_sec() - s3;
                }
            }
        }
        if (a->check_failed) break;

        /* accounting (per layer quantities times layers) */
        int D = c->head_dim;
        for (int i = 0; i < pb->size; i++) {
            double p = pb->reqs[i]->prompt_len;
            /* causal, qo = kv: sum((2*kv - qo) * qo) * H_q * (D_qk + D_vo) */
            T.prefill_flops += p * p * c->heads_q * (2.0 * D) * c->layers;
        }
        T.prefill_tokens += prefill_tokens;
        T.prefill_requests += pb->size;
        for (int i = 0; i < db->size; i++)
            T.decode_bytes += (double)db->reqs[i]->kv_len * c->heads_kv * (2.0 * D) * (double)a->kv_bytes * c->layers;
        T.decode_bytes += (double)db->size * c->heads_q * D * 2.0 * (double)a->q_bytes * c->layers; /* q and o */
        T.decode_tokens += db->size;
        T.t_plan += t_plan;

        /* 5. retire and update the running set */
        int n = 0;
        for (int i = 0; i < num_running; i++) {
            request* r = running[i];
            r->generated++;
            if (r->generated >= r->output_len) {
                request_finish(a, r, steps);
                finished++;
            } else {
                running[n++] = r;
            }
        }
        for (int i = 0; i < pb->size; i++) {
            request* r = pb->reqs[i];
            r->generated = 1; /* the prefill produces the first output token */
            if (r->generated >= r->output_len) {
                request_finish(a, r, steps);
                finished++;
            } else {
                running[n++] = r;
            }
        }
        num_running = n;
        int64_t used = c->pool_pages - a->pages.num_free;
        if (used > max_pages_used) max_pages_used = used;
        if (num_running > max_running) max_running = num_running;

        if (steps == step_cap) {
            step_cap *= 2;
            step_attn = (double*)realloc(step_attn, (size_t)step_cap * sizeof(double));
            step_plan = (double*)realloc(step_plan, (size_t)step_cap * sizeof(double));
            if (!step_attn || !step_plan) fatal("out of host memory");
        }
        step_attn[steps] = t_attn;
        step_plan[steps] = t_plan;
        steps++;
        sim_step++;

        if (c->progress_every > 0 && steps % c->progress_every == 0) {
            int waiting = 0;
            for (int i = next_waiting; i < c->requests; i++)
                if (a->reqs[i].arrival_step <= sim_step) waiting++;
            fprintf(stderr,
                    "step %5d  running %3d  waiting %3d  finished %4d/%d  pages %5lld/%d  prefill %4d tok  "
                    "decode %3d  attn %8.2f ms  plan %7.1f us  %.1f s\n",
                    steps, num_running, waiting, finished, c->requests, (long long)used, c->pool_pages,
                    (int)prefill_tokens, db->size, t_attn * 1e3, t_plan * 1e6, now_sec() - t_start);
        }
    }
    double wall = now_sec() - t_start;

    /* ------------------------------------------------------------------------------------------ */
    /* report                                                                                      */
    double attn_mean = mean_of(step_attn, steps), attn_p50 = percentile(step_attn, steps, 50),
           attn_p99 = percentile(step_attn, steps, 99);
    double plan_mean = mean_of(step_plan, steps), plan_p50 = percentile(step_plan, steps, 50),
           plan_p99 = percentile(step_plan, steps, 99);
    printf("\n## kvattn_serve results\n\n");
    printf("| metric | value |\n|---|---|\n");
    printf("| kvattn | %s, backend %s, %d workers |\n", kva_version_string(), backend_name(a->backend), a->workers);
    printf("| model | %d q heads / %d kv heads, head dim %d, %d layers, q/o %s, kv %s%s |\n", c->heads_q,
           c->heads_kv, c->head_dim, c->layers, kva_dtype_name(c->dtype), kva_dtype_name(c->kv_dtype),
           fp8 ? " (k_scale 0.5, v_scale 0.25)" : "");
    printf("| KV pool | %d pages x %d tokens per layer, %s, %.1f MB, peak %lld pages used; page table %s |\n",
           c->pool_pages, c->page_size, c->layout == KVA_LAYOUT_NHD ? "NHD" : "HND", (double)pool_bytes / 1e6,
           (long long)max_pages_used,
           c->block_table ? "block table + sequence lengths, append by slot" : "CSR, append by (request, position)");
    printf("| trace | seed %llu, %d requests, max batch %d (peak %lld running) |\n", (unsigned long long)c->seed,
           c->requests, c->max_batch, (long long)max_running);
    printf("| steps | %d (an arrived request waited: %lld steps for pages, %lld for a batch slot) |\n", steps,
           (long long)waits_pool, (long long)waits_batch);
    printf("| requests finished | %d / %d |\n", finished, c->requests);
    printf("| prefill tokens | %lld (%lld requests) |\n", (long long)T.prefill_tokens, (long long)T.prefill_requests);
    printf("| decode tokens | %lld |\n", (long long)T.decode_tokens);
    printf("| prefill throughput | %.0f tokens/s (attention of all %d layers) |\n",
           T.t_prefill_run > 0 ? (double)T.prefill_tokens / T.t_prefill_run : 0.0, c->layers);
    printf("| decode throughput | %.0f tokens/s (attention of all %d layers) |\n",
           T.t_decode_run > 0 ? (double)T.decode_tokens / T.t_decode_run : 0.0, c->layers);
    printf("| attention time per step | mean %.3f ms, p50 %.3f ms, p99 %.3f ms |\n", attn_mean * 1e3,
           attn_p50 * 1e3, attn_p99 * 1e3);
    printf("| plan time per step (prefill + decode) | mean %.1f us, p50 %.1f us, p99 %.1f us |\n", plan_mean * 1e6,
           plan_p50 * 1e6, plan_p99 * 1e6);
    printf("| KV append time | %.3f s total |\n", T.t_append);
    printf("| decode bandwidth | %.2f GB/s (KV + q + o bytes / decode attention time) |\n",
           T.t_decode_run > 0 ? T.decode_bytes / T.t_decode_run / 1e9 : 0.0);
    printf("| prefill FLOP rate | %.2f GFLOP/s (causal FLOPs / prefill attention time) |\n",
           T.t_prefill_run > 0 ? T.prefill_flops / T.t_prefill_run / 1e9 : 0.0);
    if (c->check_every > 0)
        printf("| sampled check vs float64 | %lld rows, max error o %.3g (tol %.3g), lse %.3g (tol 1e-3); as many "
               "appended K/V rows found in their pages %s |\n",
               (long long)a->checks, a->max_err_o, c->tolerance, a->max_err_lse, a->check_failed ? "FAILED" : "ok");
    else
        printf("| sampled check vs float64 | off |\n");
    printf("| wall time | %.2f s (attention %.2f s, append %.2f s, plan %.3f s, check %.2f s) |\n", wall,
           T.t_prefill_run + T.t_decode_run, T.t_append, T.t_plan, T.t_check);

    /* cleanup */
    batch_free(&a->prefill);
    batch_free(&a->decode);
    for (int i = 0; i < c->requests; i++) free(a->reqs[i].pages);
    free(a->reqs);
    free(a->pages.free_list);
    free(a->page_scratch);
    free(a->scores);
    free(a->row_scratch);
    free(running);
    free(new_tokens);
    free(step_attn);
    free(step_plan);
    dev_free(a->pool);
    kva_context_destroy(a->ctx);
    if (a->check_failed) {
        fprintf(stderr, "kvattn_serve: error: the sampled float64 check failed (see above)\n");
        return 1;
    }
    if (c->check_every > 0 && a->checks == 0) fprintf(stderr, "kvattn_serve: warning: no row was checked\n");
    return 0;
}
