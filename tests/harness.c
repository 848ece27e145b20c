/*
 * harness.c - see harness.h.
 */
#include "harness.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#ifdef KVA_TEST_CUDA
#include <cuda_runtime_api.h>
#endif

h_options h_opt;
int h_npass, h_nfail, h_nskip;

/* ---------------------------------------------------------------------------------------------- */
/* Options and counting                                                                            */

static void h_usage(const char* program) {
    fprintf(stderr,
            "usage: %s [--backend cpu|cuda] [--case \"<case line>\"] [--seed N] [--count N] [--suite NAME]\n"
            "          [--threads N] [--verbose]\n"
            "  KVA_TEST_BACKEND=cpu|cuda selects the backend too (the flag wins).\n",
            program);
}

static int h_set_backend(const char* s) {
    if (strcmp(s, "cpu") == 0) {
        h_opt.backend = KVA_BACKEND_CPU;
        h_opt.backend_name = "cpu";
        return 1;
    }
    if (strcmp(s, "cuda") == 0) {
        h_opt.backend = KVA_BACKEND_CUDA;
        h_opt.backend_name = "cuda";
        return 1;
    }
    return 0;
}

void h_init(int argc, char** argv, const char* program) {
    memset(&h_opt, 0, sizeof h_opt);
    h_opt.count = -1;
    h_opt.seed = 1;
    h_set_backend("cpu");
    const char* env = getenv("KVA_TEST_BACKEND");
    if (env && *env && !h_set_backend(env)) {
        fprintf(stderr, "%s: KVA_TEST_BACKEND=%s is not cpu or cuda\n", program, env);
        exit(2);
    }
    for (int i = 1; i < argc; ++i) {
        const char* a = argv[i];
        const char* val = i + 1 < argc ? argv[i + 1] : NULL;
        if (strcmp(a, "--verbose") == 0 || strcmp(a, "-v") == 0) {
            h_opt.verbose = 1;
            continue;
        }
        if (!val) {
            h_usage(program);
            exit(2);
        }
        if (strcmp(a, "--backend") == 0) {
            if (!h_set_backend(val)) {
                h_usage(program);
                exit(2);
            }
        } else if (strcmp(a, "--case") == 0) {
            h_opt.case_str = val;
        } else if (strcmp(a, "--seed") == 0) {
            h_opt.seed = strtoull(val, NULL, 0);
        } else if (strcmp(a, "--count") == 0) {
            h_opt.count = atoi(val);
        } else if (strcmp(a, "--suite") == 0) {
            h_opt.suite = val;
        } else if (strcmp(a, "--threads") == 0) {
            h_opt.threads = atoi(val);
        } else {
            h_usage(program);
            exit(2);
        }
        ++i;
    }
#ifndef KVA_TEST_CUDA
    if (h_opt.backend == KVA_BACKEND_CUDA) {
        fprintf(stderr, "%s: built without KVA_TEST_CUDA: cannot allocate device memory for the cuda backend\n",
                program);
        exit(2);
    }
#endif
    setvbuf(stdout, NULL, _IOLBF, 0);
}

int h_finish(void) {
    h_contexts_destroy();
    if (h_nskip) printf("(%d cases skipped on the %s backend)\n", h_nskip, h_opt.backend_name);
    printf("%d passed, %d failed\n", h_npass, h_nfail);
    fflush(stdout);
    return h_nfail == 0 ? 0 : 1;
}

void h_pass(void) { ++h_npass; }

void h_failf(const char* file, int line, const char* fmt, ...) {
    ++h_nfail;
    va_list ap;
    va_start(ap, fmt);
    printf("FAIL %s:%d: ", file, line);
    vprintf(fmt, ap);
    printf("\n");
    va_end(ap);
}

int h_check(int cond, const char* file, int line, const char* fmt, ...) {
    if (cond) {
        ++h_npass;
        return 1;
    }
    ++h_nfail;
    va_list ap;
    va_start(ap, fmt);
    printf("FAIL %s:%d: ", file, line);
    vprintf(fmt, ap);
    printf("\n");
    va_end(ap);
    return 0;
}

void h_note(const char* file, int line, const char* fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    printf("  %s:%d: ", file, line);
    vprintf(fmt, ap);
    printf("\n");
    va_end(ap);
}

void h_logf(const char* fmt, ...) {
    if (!h_opt.verbose) return;
    va_list ap;
    va_start(ap, fmt);
    vprintf(fmt, ap);
    va_end(ap);
}

/* ---------------------------------------------------------------------------------------------- */
/* Backend stride rules                                                                            */

int h_backend_device(void) { return h_opt.backend != KVA_BACKEND_CPU; }

int64_t h_stride_quantum(kva_dtype dtype) {
    if (!h_backend_device()) return 1;
    int64_t es = (int64_t)ref_dtype_size(dtype);
    return es > 0 && es < 16 ? 16 / es : 1;
}

int64_t h_round_pad(int64_t pad, kva_dtype dtype) {
    int64_t q = h_stride_quantum(dtype);
    return pad <= 0 ? pad : (pad + q - 1) / q * q;
}

/* ---------------------------------------------------------------------------------------------- */
/* RNG                                                                                             */

static uint64_t h_splitmix(uint64_t* x) {
    uint64_t z = (*x += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}

void h_rng_seed(h_rng* r, uint64_t seed) {
    uint64_t x = seed;
    for (int i = 0; i < 4; ++i) r->s[i] = h_splitmix(&x);
}

static uint64_t h_rotl(uint64_t x, int k) { return (x << k) | (x >> (64 - k)); }

uint64_t h_rng_u64(h_rng* r) {
    uint64_t* s = r->s;
    uint64_t result = h_rotl(s[1] * 5, 7) * 9;
    uint64_t t = s[1] << 17;
    s[2] ^= s[0];
    s[3] ^= s[1];
    s[1] ^= s[2];
    s[0] ^= s[3];
    s[2] ^= t;
    s[3] = h_rotl(s[3], 45);
    return result;
}

int64_t h_rng_range(h_rng* r, int64_t lo, int64_t hi) {
    if (hi <= lo) return lo;
    uint64_t span = (uint64_t)(hi - lo) + 1;
    return lo + (int64_t)(h_rng_u64(r) % span);
}

double h_rng_uniform(h_rng* r) { return (double)(h_rng_u64(r) >> 11) * (1.0 / 9007199254740992.0); }

double h_rng_normalish(h_rng* r) {
    for (;;) {
        double u1 = h_rng_uniform(r), u2 = h_rng_uniform(r);
        if (u1 <= 0) continue;
        double x = sqrt(-2.0 * log(u1)) * cos(6.283185307179586 * u2);
        if (fabs(x) >= 0.02) return x;
    }
}

void h_rng_shuffle_i32(h_rng* r, int32_t* a, int64_t n) {
    for (int64_t i = n - 1; i > 0; --i) {
        int64_t j = h_rng_range(r, 0, i);
        int32_t t = a[i];
        a[i] = a[j];
        a[j] = t;
    }
}

/* ---------------------------------------------------------------------------------------------- */
/* Backend memory                                                                                  */

static size_t h_round256(size_t n) { return (n + 255) / 256 * 256; }

int harness_backend_is_device(void) { return h_opt.backend == KVA_BACKEND_CUDA; }

void* harness_backend_alloc(size_t bytes) {
#ifdef KVA_TEST_CUDA
    if (harness_backend_is_device()) {
        void* p = NULL;
        if (cudaMalloc(&p, bytes ? bytes : 1) != cudaSuccess) return NULL; /* 256-byte aligned */
        return p;
    }
#endif
    return aligned_alloc(256, h_round256(bytes ? bytes : 1));
}

void harness_backend_free(void* p) {
    if (!p) return;
#ifdef KVA_TEST_CUDA
    if (harness_backend_is_device()) {
        cudaFree(p);
        return;
    }
#endif
    free(p);
}

void harness_backend_copy(void* dst, const void* src, size_t bytes, int dir) {
    if (!bytes || dst == src) return;
#ifdef KVA_TEST_CUDA
    if (harness_backend_is_device()) {
        /* synchronous copies on the legacy default stream: they order after the library's launches */
        cudaError_t e = cudaMemcpy(dst, src, bytes, dir == H_H2D ? cudaMemcpyHostToDevice : cudaMemcpyDeviceToHost);
        if (e != cudaSuccess) {
            printf("FATAL: cudaMemcpy: %s\n", cudaGetErrorString(e));
            exit(3);
        }
        return;
    }
#endif
    (void)dir;
    memcpy(dst, src, bytes);
}

void* harness_host_pinned_alloc(size_t bytes) {
#ifdef KVA_TEST_CUDA
    if (harness_backend_is_device()) {
        void* p = NULL;
        if (cudaMallocHost(&p, bytes ? bytes : 1) != cudaSuccess) return NULL;
        return p;
    }
#endif
    return aligned_alloc(256, h_round256(bytes ? bytes : 1));
}

void harness_host_pinned_free(void* p) {
    if (!p) return;
#ifdef KVA_TEST_CUDA
    if (harness_backend_is_device()) {
        cudaFreeHost(p);
        return;
    }
#endif
    free(p);
}

/* ---------------------------------------------------------------------------------------------- */
/* Guarded buffers                                                                                 */

static size_t h_buf_total(const h_buf* b) { return H_GUARD_BYTES + h_round256(b->bytes) + H_GUARD_BYTES; }

h_buf h_buf_alloc(kva_dtype dtype, size_t elems) {
    h_buf b;
    memset(&b, 0, sizeof b);
    b.dtype = dtype;
    b.elems = elems;
    b.bytes = elems * ref_dtype_size(dtype);
    size_t total = h_buf_total(&b);
    b.host = (unsigned char*)aligned_alloc(256, total);
    if (!b.host) {
        printf("FATAL: out of host memory (%zu bytes)\n", total);
        exit(3);
    }
    /* guard bytes everywhere outside the payload (also the rounding tail) */
    memset(b.host, H_GUARD_BYTE, total);
    memset(b.host + H_GUARD_BYTES, 0, b.bytes);
    if (harness_backend_is_device()) {
        b.dev = (unsigned char*)harness_backend_alloc(total);
        if (!b.dev) {
            printf("FATAL: out of backend memory (%zu bytes)\n", total);
            exit(3);
        }
        harness_backend_copy(b.dev, b.host, total, H_H2D);
    } else {
        b.dev = b.host;
    }
    return b;
}

void h_buf_free(h_buf* b) {
    if (b->dev && b->dev != b->host) harness_backend_free(b->dev);
    free(b->host);
    memset(b, 0, sizeof *b);
}

void* h_buf_hp(const h_buf* b) { return b->host + H_GUARD_BYTES; }
void* h_buf_dp(const h_buf* b) { return b->dev + H_GUARD_BYTES; }

void h_buf_upload(h_buf* b) {
    if (b->dev != b->host) harness_backend_copy(b->dev, b->host, h_buf_total(b), H_H2D);
}

void h_buf_download(h_buf* b) {
    if (b->dev != b->host) harness_backend_copy(b->host, b->dev, h_buf_total(b), H_D2H);
}

void h_buf_poison(h_buf* b) {
    for (size_t i = 0; i < b->elems; ++i) ref_store_nan(b->dtype, h_buf_hp(b), i);
}

int h_buf_guards_ok(const h_buf* b) {
    size_t total = h_buf_total(b);
    for (size_t i = 0; i < H_GUARD_BYTES; ++i)
        if (b->host[i] != H_GUARD_BYTE) return 0;
    for (size_t i = H_GUARD_BYTES + b->bytes; i < total; ++i)
        if (b->host[i] != H_GUARD_BYTE) return 0;
    return 1;
}

int h_buf_elem_is_poison(const h_buf* b, size_t i) {
    unsigned char tmp[8];
    size_t es = ref_dtype_size(b->dtype);
    ref_store_nan(b->dtype, tmp, 0);
    return memcmp((const unsigned char*)h_buf_hp(b) + i * es, tmp, es) == 0;
}

double h_buf_get(const h_buf* b, size_t i) { return ref_decode(b->dtype, h_buf_hp(b), i); }
double h_buf_set(h_buf* b, size_t i, double x) { return ref_encode(b->dtype, h_buf_hp(b), i, x); }

/* ---------------------------------------------------------------------------------------------- */
/* Contexts and workspaces                                                                         */

#define H_MAX_CTX 16
static struct {
    int threads;
    kva_context* ctx;
} h_ctx_cache[H_MAX_CTX];
static int h_nctx;

kva_context* h_context(int num_threads) {
    if (h_opt.threads > 0) num_threads = h_opt.threads;
    if (num_threads <= 0) num_threads = 3;
    if (h_opt.backend != KVA_BACKEND_CPU) num_threads = 0; /* one context per device */
    for (int i = 0; i < h_nctx; ++i)
        if (h_ctx_cache[i].threads == num_threads) return h_ctx_cache[i].ctx;
    kva_context_options o;
    kva_context_options_init(&o);
    o.backend = h_opt.backend;
    o.num_threads = num_threads;
    kva_context* ctx = NULL;
    kva_status st = kva_context_create(&o, &ctx);
    if (st != KVA_OK || !ctx) {
        printf("FATAL: kva_context_create(%s, %d threads): %s: %s\n", h_opt.backend_name, num_threads,
               kva_status_string(st), kva_last_error_message());
        printf("%d passed, %d failed\n", h_npass, h_nfail + 1);
        exit(1);
    }
    if (h_nctx == H_MAX_CTX) { /* evict the oldest */
        kva_context_destroy(h_ctx_cache[0].ctx);
        memmove(&h_ctx_cache[0], &h_ctx_cache[1], sizeof h_ctx_cache[0] * (H_MAX_CTX - 1));
        --h_nctx;
    }
    h_ctx_cache[h_nctx].threads = num_threads;
    h_ctx_cache[h_nctx].ctx = ctx;
    ++h_nctx;
    return ctx;
}

void h_contexts_destroy(void) {
    for (int i = 0; i < h_nctx; ++i) kva_context_destroy(h_ctx_cache[i].ctx);
    h_nctx = 0;
}

void h_ws_alloc(h_ws* w, size_t device_bytes, size_t host_bytes) {
    memset(w, 0, sizeof *w);
    w->dev = h_buf_alloc(KVA_DTYPE_U8, device_bytes);
    /* fill the workspace with garbage: the planner must not rely on zeroed memory */
    memset(h_buf_hp(&w->dev), 0x5c, device_bytes);
    h_buf_upload(&w->dev);
    if (host_bytes) {
        w->host = harness_host_pinned_alloc(host_bytes);
        memset(w->host, 0x3b, host_bytes);
    }
    w->host_bytes = host_bytes;
    w->ws.device = h_buf_dp(&w->dev);
    w->ws.device_bytes = device_bytes;
    w->ws.host = w->host;
    w->ws.host_bytes = host_bytes;
}

void h_ws_free(h_ws* w) {
    h_buf_free(&w->dev);
    harness_host_pinned_free(w->host);
    memset(w, 0, sizeof *w);
}

/* ---------------------------------------------------------------------------------------------- */
/* Tolerances                                                                                      */

/*
 * Per-element tolerance: |got - ref| <= atol * scale + rtol * |ref|, where ref is the float64 reference on
 * the same (already rounded) inputs and scale = sum_j w_j |v_j| (about 1 for softmax outputs of unit-size values;
 * it grows with the unnormalised sums of sigmoid mode and shrinks with small values, e.g. a v_scale of 0.01: every
 * error of an attention output, P rounded before P.V, the f32 accumulation and rescaling, is proportional to it, so
 * it has no floor of 1, which let outputs of small values be 30 % off). The floor 1e-4 covers the absolute spacing
 * of f16 subnormals; a row with no visible key (scale 0, ref 0) must be exactly 0.
 *
 *   dtype       atol     rtol     why
 *   f32         1e-4     1e-4     fp32 accumulation over up to 64k keys (the CPU backend stays near 1e-6)
 *   f16         2e-3     4e-3     output rounding (2^-11 relative) plus P rounded to f16 before P.V on GPUs
 *   bf16        1e-2     1.6e-2   output rounding (2^-8 relative) plus P rounded to bf16 on GPUs
 *   e4m3, e5m2  as f16            the fp8 values are exact in the reference; GPUs widen them to f16
 *   lse (f32, base 2): 2e-3 abs + 1e-4 rel
 *
 * An output's tolerance is the loosest entry among the dtypes it went through (q, KV, o). NaN never passes;
 * an infinite reference (lse = -inf of an empty row) must be matched exactly.
 */
static h_tol h_tol_of(kva_dtype t) {
    switch (t) {
    case KVA_DTYPE_F32: return (h_tol){1e-4, 1e-4};
    case KVA_DTYPE_F16: return (h_tol){2e-3, 4e-3};
    case KVA_DTYPE_BF16: return (h_tol){1e-2, 1.6e-2};
    case KVA_DTYPE_E4M3:
    case KVA_DTYPE_E5M2: return (h_tol){2e-3, 4e-3};
    default: return (h_tol){1e-4, 1e-4};
    }
}

h_tol h_tol_out(kva_dtype o_dtype, kva_dtype q_dtype, kva_dtype kv_dtype) {
    h_tol a = h_tol_of(o_dtype), b = h_tol_of(q_dtype), c = h_tol_of(kv_dtype);
    h_tol t = a;
    if (b.atol > t.atol) t.atol = b.atol;
    if (c.atol > t.atol) t.atol = c.atol;
    if (b.rtol > t.rtol) t.rtol = b.rtol;
    if (c.rtol > t.rtol) t.rtol = c.rtol;
    return t;
}

h_tol h_tol_lse(void) { return (h_tol){2e-3, 1e-4}; }

int h_close(double got, double ref, h_tol t, double scale) {
    if (isnan(got) || isnan(ref)) return 0;
    if (isinf(ref) || isinf(got)) return got == ref;
    if (scale > 0 && scale < 1e-4) scale = 1e-4;
    return fabs(got - ref) <= t.atol * scale + t.rtol * fabs(ref);
}

/* ---------------------------------------------------------------------------------------------- */
/* Cases                                                                                           */

static const char* const h_op_names[H_OP_COUNT_] = {"decode", "prefill", "ragged", "single_decode",
                                                    "single_prefill", "merge", "merge_in_place", "merge_states",
                                                    "append"};

const char* h_op_name(h_op op) { return (unsigned)op < H_OP_COUNT_ ? h_op_names[op] : "?"; }

const char* h_dtype_str(kva_dtype t) {
    switch (t) {
    case KVA_DTYPE_F32: return "f32";
    case KVA_DTYPE_F16: return "f16";
    case KVA_DTYPE_BF16: return "bf16";
    case KVA_DTYPE_E4M3: return "e4m3";
    case KVA_DTYPE_E5M2: return "e5m2";
    case KVA_DTYPE_I32: return "i32";
    case KVA_DTYPE_U8: return "u8";
    }
    return "?";
}

int h_dtype_parse(const char* s, kva_dtype* t) {
    static const kva_dtype all[] = {KVA_DTYPE_F32, KVA_DTYPE_F16, KVA_DTYPE_BF16, KVA_DTYPE_E4M3, KVA_DTYPE_E5M2};
    for (size_t i = 0; i < sizeof all / sizeof all[0]; ++i)
        if (strcmp(s, h_dtype_str(all[i])) == 0) {
            *t = all[i];
            return 1;
        }
    return 0;
}

void h_case_default(h_case* c, h_op op) {
    memset(c, 0, sizeof *c);
    c->op = op;
    c->batch = 3;
    c->max_qo = 8;
    c->max_kv = 64;
    c->hq = 4;
    c->hkv = 2;
    c->dqk = 64;
    c->dvo = 64;
    c->q_dt = KVA_DTYPE_F16;
    c->kv_dt = KVA_DTYPE_F16;
    c->o_dt = KVA_DTYPE_F16;
    c->page_size = 16;
    c->layout = KVA_LAYOUT_NHD;
    c->mask = KVA_MASK_NONE;
    c->window = -1;
    c->rope_scale = 1.0f;
    c->rope_theta = 1e4f;
    c->score = KVA_SCORE_SOFTMAX;
    c->lse = 1;
    c->threads = 3;
    c->k_scale = 1.0f;
    c->v_scale = 1.0f;
    c->kv_amp = 1.0f;
    c->hidx = 1;
    c->seed = 1;
    if (op == H_OP_DECODE || op == H_OP_SINGLE_DECODE) c->max_qo = 1;
    if (op == H_OP_SINGLE_DECODE || op == H_OP_SINGLE_PREFILL) c->batch = 1;
}

enum { HF_INT, HF_FLOAT, HF_U64, HF_DTYPE, HF_OP, HF_LAYOUT, HF_MASK, HF_POS, HF_SCORE };

typedef struct h_field {
    const char* key;
    int type;
    size_t off;
} h_field;

#define HFLD(k, t, m) {k, t, offsetof(h_case, m)}
static const h_field h_fields[] = {
    HFLD("op", HF_OP, op),
    HFLD("B", HF_INT, batch),
    HFLD("qo", HF_INT, max_qo),
    HFLD("kv", HF_INT, max_kv),
    HFLD("empty", HF_INT, empty_pct),
    HFLD("eqkv", HF_INT, equal_kv),
    HFLD("zqo", HF_INT, zero_qo_pct),
    HFLD("lqo", HF_INT, long_qo_pct),
    HFLD("hq", HF_INT, hq),
    HFLD("hkv", HF_INT, hkv),
    HFLD("dqk", HF_INT, dqk),
    HFLD("dvo", HF_INT, dvo),
    HFLD("qt", HF_DTYPE, q_dt),
    HFLD("kvt", HF_DTYPE, kv_dt),
    HFLD("ot", HF_DTYPE, o_dt),
    HFLD("ps", HF_INT, page_size),
    HFLD("layout", HF_LAYOUT, layout),
    HFLD("mask", HF_MASK, mask),
    HFLD("win", HF_INT, window),
    HFLD("cap", HF_FLOAT, cap),
    HFLD("scale", HF_FLOAT, scale),
    HFLD("pos", HF_POS, pos),
    HFLD("rs", HF_FLOAT, rope_scale),
    HFLD("rt", HF_FLOAT, rope_theta),
    HFLD("slopes", HF_INT, custom_slopes),
    HFLD("score", HF_SCORE, score),
    HFLD("sb", HF_FLOAT, sig_bias),
    HFLD("lse", HF_INT, lse),
    HFLD("fsplit", HF_INT, fixed_split),
    HFLD("nosplit", HF_INT, no_split),
    HFLD("graph", HF_INT, graph),
    HFLD("scratch", HF_INT, scratch),
    HFLD("thr", HF_INT, threads),
    HFLD("qpad", HF_INT, qpad),
    HFLD("opad", HF_INT, opad),
    HFLD("pool", HF_INT, pool),
    HFLD("ks", HF_FLOAT, k_scale),
    HFLD("vs", HF_FLOAT, v_scale),
    HFLD("amp", HF_FLOAT, kv_amp),
    HFLD("api", HF_INT, api),
    HFLD("hidx", HF_INT, hidx),
    HFLD("alias", HF_INT, alias),
    HFLD("bt", HF_INT, bt),
    HFLD("seed", HF_U64, seed),
};
#define H_NFIELDS (sizeof h_fields / sizeof h_fields[0])

static const char* const h_mask_names[] = {"none", "causal", "custom"};
static const char* const h_pos_names[] = {"none", "rope", "alibi"};
static const char* const h_score_names[] = {"softmax", "sigmoid"};
static const char* const h_layout_names[] = {"NHD", "HND"};

char* h_case_format(const h_case* c, char* buf, size_t size) {
    size_t n = 0;
    buf[0] = 0;
    for (size_t i = 0; i < H_NFIELDS && n < size; ++i) {
        const h_field* f = &h_fields[i];
        const char* p = (const char*)c + f->off;
        const char* sep = i ? " " : "";
        int w = 0;
        switch (f->type) {
        case HF_INT: w = snprintf(buf + n, size - n, "%s%s=%d", sep, f->key, (int)*(const int32_t*)p); break;
        case HF_FLOAT: w = snprintf(buf + n, size - n, "%s%s=%.9g", sep, f->key, (double)*(const float*)p); break;
        case HF_U64:
            w = snprintf(buf + n, size - n, "%s%s=%llu", sep, f->key, (unsigned long long)*(const uint64_t*)p);
            break;
        case HF_DTYPE: w = snprintf(buf + n, size - n, "%s%s=%s", sep, f->key, h_dtype_str(*(const kva_dtype*)p)); break;
        case HF_OP: w = snprintf(buf + n, size - n, "%s%s=%s", sep, f->key, h_op_name(*(const h_op*)p)); break;
        case HF_LAYOUT: w = snprintf(buf + n, size - n, "%s%s=%s", sep, f->key, h_layout_names[*(const int*)p & 1]); break;
        case HF_MASK: w = snprintf(buf + n, size - n, "%s%s=%s", sep, f->key, h_mask_names[*(const int*)p % 3]); break;
        case HF_POS: w = snprintf(buf + n, size - n, "%s%s=%s", sep, f->key, h_pos_names[*(const int*)p % 3]); break;
        case HF_SCORE: w = snprintf(buf + n, size - n, "%s%s=%s", sep, f->key, h_score_names[*(const int*)p & 1]); break;
        }
        if (w < 0) break;
        n += (size_t)w;
    }
    return buf;
}

static int h_name_index(const char* s, const char* const* names, int n) {
    for (int i = 0; i < n; ++i)
        if (strcmp(s, names[i]) == 0) return i;
    return -1;
}

int h_case_parse(const char* s, h_case* c, char* err, size_t err_size) {
    /* first find op= to start from that op's defaults */
    const char* opk = strstr(s, "op=");
    if (!opk) {
        snprintf(err, err_size, "case has no op=");
        return 0;
    }
    char opname[64];
    sscanf(opk + 3, "%63[^ ]", opname);
    int op = h_name_index(opname, h_op_names, H_OP_COUNT_);
    if (op < 0) {
        snprintf(err, err_size, "unknown op '%s'", opname);
        return 0;
    }
    h_case_default(c, (h_op)op);
    const char* p = s;
    while (*p) {
        while (*p == ' ' || *p == '\t') ++p;
        if (!*p) break;
        char tok[128];
        size_t n = 0;
        while (p[n] && p[n] != ' ' && p[n] != '\t' && n < sizeof tok - 1) ++n;
        memcpy(tok, p, n);
        tok[n] = 0;
        p += n;
        char* eq = strchr(tok, '=');
        if (!eq) {
            snprintf(err, err_size, "token '%s' is not key=value", tok);
            return 0;
        }
        *eq = 0;
        const char* key = tok;
        const char* val = eq + 1;
        const h_field* f = NULL;
        for (size_t i = 0; i < H_NFIELDS; ++i)
            if (strcmp(h_fields[i].key, key) == 0) f = &h_fields[i];
        if (!f) {
            snprintf(err, err_size, "unknown key '%s'", key);
            return 0;
        }
        char* q = (char*)c + f->off;
        int idx;
        switch (f->type) {
        case HF_INT: *(int32_t*)q = (int32_t)strtol(val, NULL, 0); break;
        case HF_FLOAT: *(float*)q = strtof(val, NULL); break;
        case HF_U64: *(uint64_t*)q = strtoull(val, NULL, 0); break;
        case HF_DTYPE:
            if (!h_dtype_parse(val, (kva_dtype*)q)) {
                snprintf(err, err_size, "bad dtype '%s'", val);
                return 0;
            }
            break;
        case HF_OP: break; /* handled above */
        case HF_LAYOUT:
        case HF_MASK:
        case HF_POS:
        case HF_SCORE: {
            const char* const* names = f->type == HF_LAYOUT ? h_layout_names
                                       : f->type == HF_MASK ? h_mask_names
                                       : f->type == HF_POS  ? h_pos_names
                                                            : h_score_names;
            int nn = f->type == HF_LAYOUT || f->type == HF_SCORE ? 2 : 3;
            idx = h_name_index(val, names, nn);
            if (idx < 0) {
                snprintf(err, err_size, "bad value '%s' for %s", val, key);
                return 0;
            }
            *(int*)q = idx;
            break;
        }
        }
    }
    return 1;
}

static int h_is_fp8(kva_dtype t) { return t == KVA_DTYPE_E4M3 || t == KVA_DTYPE_E5M2; }

void h_case_fixup(h_case* c) {
    if (c->batch < 0) c->batch = 0;
    if (c->hkv < 1) c->hkv = 1;
    if (c->hq < c->hkv) c->hq = c->hkv;
    if (c->hq % c->hkv) c->hq = c->hkv * (c->hq / c->hkv);
    if (c->dqk < 1) c->dqk = 1;
    if (c->dvo < 1) c->dvo = 1;
    if (c->page_size < 1) c->page_size = 1;
    if (c->max_kv < 0) c->max_kv = 0;
    if (c->max_qo < 0) c->max_qo = 0;
    if (h_is_fp8(c->q_dt)) c->q_dt = KVA_DTYPE_F16;
    if (h_is_fp8(c->o_dt)) c->o_dt = KVA_DTYPE_F16;
    if (c->window < -1) c->window = -1;
    if (c->threads < 1) c->threads = 1;
    if (c->pool == 1 && c->dqk != c->dvo) c->pool = 2;
    if (c->pos == KVA_POS_ROPE_LLAMA && (c->dqk & 1)) c->pos = KVA_POS_NONE;
    if (!(c->kv_amp > 0.0f)) c->kv_amp = 1.0f;
    switch (c->op) {
    case H_OP_DECODE:
        c->max_qo = 1;
        c->zero_qo_pct = 0;
        c->long_qo_pct = 0;
        /* batch decode takes no custom mask (plan: KVA_ERR_UNSUPPORTED, pinned in test_errors) */
        if (c->mask == KVA_MASK_CUSTOM) c->mask = KVA_MASK_NONE;
        break;
    case H_OP_SINGLE_DECODE:
        c->max_qo = 1;
        /* fallthrough */
    case H_OP_SINGLE_PREFILL:
        c->batch = 1;
        c->graph = 0;
        c->scratch = 0;
        c->empty_pct = 0;
        c->zero_qo_pct = 0;
        c->hidx = 0;
        if (c->max_kv < 1) c->max_kv = 1;
        if (c->max_qo < 1) c->max_qo = 1;
        break;
    case H_OP_MERGE:
    case H_OP_MERGE_IN_PLACE:
    case H_OP_MERGE_STATES:
        c->hkv = 1;
        c->q_dt = c->o_dt;
        break;
    default: break;
    }
    if (c->score == KVA_SCORE_SIGMOID && c->op <= H_OP_SINGLE_PREFILL) c->lse = 0;
    /* attention q/o rows: a device backend takes 16-byte multiples only (an odd padding there is pinned as
       KVA_ERR_ALIGNMENT in test_errors); merges and append take any stride on every backend */
    if (c->op <= H_OP_SINGLE_PREFILL) {
        c->qpad = (int32_t)h_round_pad(c->qpad, c->q_dt);
        c->opad = (int32_t)h_round_pad(c->opad, c->o_dt);
    }
    if (c->op == H_OP_RAGGED) c->hidx = 0;
    if (c->op != H_OP_DECODE && c->op != H_OP_PREFILL && c->op != H_OP_APPEND)
        c->bt = 0; /* the block-table form of paged batch ops; append: the slot form */
    /* graph mode with fixed_split_size is refused by plan (KVA_ERR_UNSUPPORTED, pinned in test_errors) */
    if (c->graph) c->fixed_split = 0;
}

static int h_pick(h_rng* r, const int* a, int n) { return a[h_rng_range(r, 0, n - 1)]; }

void h_case_random(h_case* c, h_op op, h_rng* r) {
    static const int groups[] = {1, 2, 3, 4, 5, 7, 8, 6, 16};
    static const int dims_cpu[] = {64, 128, 256, 80, 32};
    static const int dims_gpu[] = {64, 128, 256};
    static const int pss[] = {1, 3, 16, 16, 5, 32, 64, 128};
    static const kva_dtype qdts[] = {KVA_DTYPE_F32, KVA_DTYPE_F16, KVA_DTYPE_BF16};
    static const kva_dtype kvdts[] = {KVA_DTYPE_F32, KVA_DTYPE_F16, KVA_DTYPE_BF16, KVA_DTYPE_E4M3, KVA_DTYPE_E5M2};
    /* what the CUDA backend implements (q f16/bf16, KV f16/bf16/fp8; o any float): fuzz cases it would only skip
       are not drawn there (the same number of draws, so the CPU stream is unchanged) */
    static const kva_dtype qdts_gpu[] = {KVA_DTYPE_F16, KVA_DTYPE_BF16};
    static const kva_dtype kvdts_gpu[] = {KVA_DTYPE_F16, KVA_DTYPE_BF16, KVA_DTYPE_E4M3, KVA_DTYPE_E5M2};
    h_case_default(c, op);
    c->seed = h_rng_u64(r) >> 16;
    c->batch = (int32_t)h_rng_range(r, 1, 6);
    c->max_kv = (int32_t)h_rng_range(r, 1, h_rng_range(r, 0, 3) == 0 ? 700 : 200);
    c->max_qo = (int32_t)h_rng_range(r, 1, 24);
    c->empty_pct = h_rng_range(r, 0, 3) == 0 ? 25 : 0;
    c->zero_qo_pct = h_rng_range(r, 0, 4) == 0 ? 20 : 0;
    c->hkv = (int32_t)h_rng_range(r, 1, 3);
    c->hq = c->hkv * h_pick(r, groups, 9);
    int cpu = h_opt.backend == KVA_BACKEND_CPU;
    c->dqk = cpu ? h_pick(r, dims_cpu, 5) : h_pick(r, dims_gpu, 3);
    c->dvo = h_rng_range(r, 0, 5) == 0 && cpu ? h_pick(r, dims_cpu, 5) : c->dqk;
    c->q_dt = cpu ? qdts[h_rng_range(r, 0, 2)] : qdts_gpu[h_rng_range(r, 0, 1)];
    c->o_dt = h_rng_range(r, 0, 1) ? c->q_dt : qdts[h_rng_range(r, 0, 2)];
    c->kv_dt = h_rng_range(r, 0, 1) ? c->q_dt : cpu ? kvdts[h_rng_range(r, 0, 4)] : kvdts_gpu[h_rng_range(r, 0, 3)];
    c->page_size = h_pick(r, pss, 8);
    c->layout = h_rng_range(r, 0, 1) ? KVA_LAYOUT_HND : KVA_LAYOUT_NHD;
    int64_t m = h_rng_range(r, 0, 5);
    c->mask = m < 3 ? KVA_MASK_NONE : m < 5 ? KVA_MASK_CAUSAL : KVA_MASK_CUSTOM;
    c->window = h_rng_range(r, 0, 4) == 0 ? (int32_t)h_rng_range(r, 0, c->max_kv) : -1;
    c->cap = h_rng_range(r, 0, 4) == 0 ? (h_rng_range(r, 0, 1) ? 30.0f : 2.5f) : 0.0f;
    c->scale = h_rng_range(r, 0, 4) == 0 ? (float)(0.05 + 0.2 * h_rng_uniform(r)) : 0.0f;
    m = h_rng_range(r, 0, 5);
    c->pos = m < 4 ? KVA_POS_NONE : m == 4 ? KVA_POS_ROPE_LLAMA : KVA_POS_ALIBI;
    if (c->pos == KVA_POS_ROPE_LLAMA && h_rng_range(r, 0, 2) == 0) {
        c->rope_scale = 2.0f;
        c->rope_theta = 5e5f;
    }
    c->custom_slopes = c->pos == KVA_POS_ALIBI && h_rng_range(r, 0, 1);
    c->score = h_rng_range(r, 0, 6) == 0 ? KVA_SCORE_SIGMOID : KVA_SCORE_SOFTMAX;
    c->sig_bias = c->score == KVA_SCORE_SIGMOID ? (float)(h_rng_uniform(r) * 4 - 2) : 0.0f;
    c->lse = (int32_t)h_rng_range(r, 0, 1);
    m = h_rng_range(r, 0, 5);
    c->fixed_split = m == 0 ? 16 : m == 1 ? (int32_t)h_rng_range(r, 1, 200) : 0;
    c->no_split = h_rng_range(r, 0, 9) == 0;
    c->graph = (op == H_OP_DECODE || op == H_OP_PREFILL || op == H_OP_RAGGED) && h_rng_range(r, 0, 5) == 0;
    static const int thr[] = {1, 2, 3, 4, 8, 13};
    c->threads = h_pick(r, thr, 6);
    c->qpad = h_rng_range(r, 0, 3) == 0 ? (int32_t)h_rng_range(r, 1, 40) : 0;
    c->opad = h_rng_range(r, 0, 3) == 0 ? (int32_t)h_rng_range(r, 1, 40) : 0;
    c->pool = (int32_t)h_rng_range(r, 0, 2);
    c->k_scale = (float)(0.25 + 1.75 * h_rng_uniform(r));
    c->v_scale = (float)(0.25 + 1.75 * h_rng_uniform(r));
    c->api = (int32_t)h_rng_range(r, 0, 1);
    c->hidx = (int32_t)h_rng_range(r, 0, 1);
    c->alias = (int32_t)h_rng_range(r, 0, 2);
    if (op == H_OP_MERGE || op == H_OP_MERGE_IN_PLACE || op == H_OP_MERGE_STATES) {
        c->batch = (int32_t)h_rng_range(r, 1, 40);
        c->hq = (int32_t)h_rng_range(r, 1, 16);
        c->dvo = cpu ? (int32_t)h_rng_range(r, 1, 300) : h_pick(r, dims_gpu, 3);
        c->max_qo = (int32_t)h_rng_range(r, 0, 9);
        c->mask = h_rng_range(r, 0, 1) ? KVA_MASK_CUSTOM : KVA_MASK_NONE;
    }
    if (op == H_OP_APPEND) c->max_qo = (int32_t)h_rng_range(r, 1, 40);
    /* from the seed, not the stream (the cases drawn after this one stay as they were) */
    c->scratch = (op == H_OP_DECODE || op == H_OP_PREFILL || op == H_OP_RAGGED) && (c->seed >> 5) % 3 == 0;
    c->bt = (op == H_OP_DECODE || op == H_OP_PREFILL || op == H_OP_APPEND) && (c->seed >> 13) % 4 == 0;
    /* more query rows than keys (a causal mask leaves the first rows without a key: o = 0, lse = -inf) */
    c->long_qo_pct = (op == H_OP_PREFILL || op == H_OP_RAGGED || op == H_OP_SINGLE_PREFILL) && (c->seed >> 9) % 5 == 0 ? 30 : 0;
    /* the KV scales apply to every KV dtype (kvattn.h); 16/32-bit KV keeps scale 1 on half the cases, the serving
       default. fp8 KV near saturation: values up to the format's largest, scales of about 1 / amplitude */
    if (!h_is_fp8(c->kv_dt) && (c->seed >> 11) % 2 == 0) c->k_scale = c->v_scale = 1.0f;
    if (op <= H_OP_SINGLE_PREFILL && h_is_fp8(c->kv_dt) && (c->seed >> 12) % 4 == 0) {
        c->kv_amp = c->kv_dt == KVA_DTYPE_E4M3 ? 240.0f : 24000.0f;
        c->k_scale /= c->kv_amp;
        c->v_scale /= c->kv_amp;
    }
    /* keep the float64 reference cheap: work ~ B * qo * kv * hq * (dqk + dvo) */
    for (;;) {
        double qo = op == H_OP_DECODE || op == H_OP_SINGLE_DECODE ? 1 : c->max_qo;
        double work = (double)c->batch * qo * c->max_kv * c->hq * (c->dqk + c->dvo);
        if (work <= 3e7 || c->max_kv <= 8) break;
        c->max_kv = c->max_kv * 2 / 3;
        if (c->max_qo > 4) c->max_qo = c->max_qo * 2 / 3;
    }
    h_case_fixup(c);
}
