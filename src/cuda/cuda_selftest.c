/*
 * cuda_selftest.c - GPU tests of the CUDA backend that the shared harness does not cover, with an independent
 * float64 reference:
 *   decode   paged decode over a matrix of group sizes, page sizes, layouts, dtypes, head dims, variants,
 *            empty / one-token / long (split-KV) requests;
 *   prefill  small multi-row paged and ragged prefill (causal), through the same kernel;
 *   bsr graph  a block-sparse run captured in graph mode, another pattern re-planned into the same workspace and
 *            buffers, replayed: equals a plain run of the new pattern;
 *   graph    plan (graph mode) -> capture run -> re-plan with other lengths (and other splits) into the same
 *            workspace -> replay -> equals the reference and, bit for bit, an eager run of the new plan (a plan of
 *            the step outside graph mode, with its own split, matches the reference);
 *   fault    an out-of-range page index (too large, negative) in one request, with and without split-KV:
 *            that request's rows are o = 0, lse = -inf, the others match the reference, kva_read_faults reports
 *            the request and the index, and the next read is clean;
 *   capture  plan during capture -> KVA_ERR_CAPTURE_ACTIVE;
 *   pdl      chains of calls where each reads the previous one's output, with programmatic dependent launch (eager and
 *            in a graph; tensor-core, head-group and merge kernels): equal to the chain without it, bit for bit;
 *   append / merge_state / merge_states small checks;
 *   threads  six host threads plan and run different problems at once, four in one fresh context, two in contexts
 *            they create at the same moment, each on its own stream and workspace.
 * Usage: kva_cuda_selftest [--quick] [--verbose] [--cpu] [--pdl-only] [--device N [--caller-device M]] (--cpu: the
 * same checks on the CPU backend, which validates this file's reference; no GPU needed; --pdl-only: only the default
 * context's PDL chains; --device: the context and buffers on device N, the decode matrix's kvattn calls made while
 * device M (default 0) is the runtime's current device).
 * Prints "N passed, N failed" last.
 */
#define _POSIX_C_SOURCE 200809L
#include <cuda_runtime_api.h>
#include <math.h>
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/time.h>
#include <unistd.h>

#include "kvattn.h"

static int npass, nfail, verbose, quick, pdl_only;

#define CHECK(cond, ...)                                \
    do {                                                \
        if (cond) {                                     \
            npass++;                                    \
        } else {                                        \
            nfail++;                                    \
            printf("FAIL %s:%d: ", __FILE__, __LINE__); \
            printf(__VA_ARGS__);                        \
            printf("\n");                               \
        }                                               \
    } while (0)

#define CU(call)                                                                                      \
    do {                                                                                              \
        cudaError_t e_ = (call);                                                                      \
        if (e_ != cudaSuccess) {                                                                      \
            printf("CUDA error %s at %s:%d: %s\n", cudaGetErrorName(e_), __FILE__, __LINE__, #call);  \
            printf("%d passed, %d failed\n", npass, nfail + 1);                                       \
            exit(1);                                                                                  \
        }                                                                                             \
    } while (0)

/* ---------------------------------------------------------------------------------------------- */
/* Backend memory: device memory, or host memory with --cpu (checks the reference against the CPU backend) */

static int cpu_mode;
static int hg_device; /* compute capability 9.0: head-group decode plans are possible */
static int hg_ctx;    /* the context under test was created with KVATTN_CUDA_DECODE_HG=1 */
static void* dalloc(size_t n) {
    void* p = NULL;
    if (cpu_mode) {
        p = aligned_alloc(256, (n + 255) / 256 * 256 + 256);
        if (!p) exit(1);
        return p;
    }
    CU(cudaMalloc(&p, n));
    return p;
}
static void dfree(void* p) {
    if (cpu_mode) free(p);
    else cudaFree(p);
}
static void dput(void* dst, const void* src, size_t n) {
    if (cpu_mode) memcpy(dst, src, n);
    else CU(cudaMemcpy(dst, src, n, cudaMemcpyHostToDevice));
}
static void dget(void* dst, const void* src, size_t n) {
    if (cpu_mode) memcpy(dst, src, n);
    else CU(cudaMemcpy(dst, src, n, cudaMemcpyDeviceToHost));
}
static void dset(void* p, int v, size_t n) {
    if (cpu_mode) memset(p, v, n);
    else CU(cudaMemset(p, v, n));
}
static void dsync(void) {
    if (!cpu_mode) CU(cudaDeviceSynchronize());
}

/* --device N: the context (kva_context_options.device) and every buffer on device N. The decode matrix then calls
   kva_plan_make, kva_run and kva_read_faults while the runtime's current device is --caller-device M (default 0 for
   N > 0), as a serving engine's thread for another device may: kvattn must use its own device's context and stream
   and leave the caller's current device as it was. */
static int data_dev = -1, call_dev = -1;
static void to_call(void) {
    if (call_dev >= 0) CU(cudaSetDevice(call_dev));
}
static void to_data(const char* name) {
    if (call_dev < 0) return;
    int cur = -1;
    CU(cudaGetDevice(&cur));
    CHECK(cur == call_dev, "%s: the caller's current device changed from %d to %d", name, call_dev, cur);
    CU(cudaSetDevice(data_dev));
}

/* ---------------------------------------------------------------------------------------------- */
/* RNG and dtypes                                                                                  */

static uint64_t rng_s = 0x9e3779b97f4a7c15ull;
static uint64_t rnd(void) {
    uint64_t z = (rng_s += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}
static int rint_range(int lo, int hi) { return lo + (int)(rnd() % (uint64_t)(hi - lo + 1)); }
static double runif(void) { return (double)(rnd() >> 11) / 9007199254740992.0; }

static double dec_f16(uint16_t h) {
    int s = h >> 15, e = (h >> 10) & 31, m = h & 1023;
    double v = e == 0 ? ldexp(m, -24) : (e == 31 ? (m ? NAN : INFINITY) : ldexp(1024 + m, e - 25));
    return s ? -v : v;
}
static double dec_bf16(uint16_t h) {
    uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}
static double dec_e4m3(uint8_t b) {
    int s = b >> 7, e = (b >> 3) & 15, m = b & 7;
    double v = (e == 15 && m == 7) ? NAN : (e == 0 ? ldexp(m, -9) : ldexp(8 + m, e - 10));
    return s ? -v : v;
}
static double dec_e5m2(uint8_t b) { return dec_f16((uint16_t)(b << 8)); }
static uint16_t enc_bf16(double x) {
    float f = (float)x;
    uint32_t u;
    memcpy(&u, &f, 4);
    u += 0x7fff + ((u >> 16) & 1);
    return (uint16_t)(u >> 16);
}
static uint16_t enc_f16(double x) { /* for |x| in [2^-14, 65504] or 0; round to nearest even */
    if (x == 0) return 0;
    uint16_t s = x < 0 ? 0x8000 : 0;
    double a = fabs(x);
    int e;
    double fr = frexp(a, &e); /* a = fr * 2^e, fr in [0.5, 1) */
    int E = e - 1 + 15;
    if (E < 1) return s; /* flush tiny */
    double mant = (fr * 2 - 1) * 1024;
    double r = nearbyint(mant);
    int m = (int)r;
    if (m == 1024) {
        m = 0;
        E++;
    }
    if (E >= 31) return (uint16_t)(s | 0x7c00);
    return (uint16_t)(s | (E << 10) | m);
}
static size_t dsize(kva_dtype t) { return t == KVA_DTYPE_F32 ? 4 : (t == KVA_DTYPE_F16 || t == KVA_DTYPE_BF16 ? 2 : 1); }
/* a random value of dtype, returning the decoded value and storing the bits at p */
static double rand_val(kva_dtype t, void* p, double scale) {
    switch (t) {
    case KVA_DTYPE_BF16: {
        uint16_t h = enc_bf16((runif() * 2 - 1) * scale);
        memcpy(p, &h, 2);
        return dec_bf16(h);
    }
    case KVA_DTYPE_F16: {
        uint16_t h = enc_f16((runif() * 2 - 1) * scale);
        memcpy(p, &h, 2);
        return dec_f16(h);
    }
    case KVA_DTYPE_E4M3: { /* exponents 4..8: |x| in [2^-3, 2^2) */
        uint8_t b = (uint8_t)((rnd() & 1) << 7 | rint_range(4, 8) << 3 | rint_range(0, 7));
        *(uint8_t*)p = b;
        return dec_e4m3(b);
    }
    case KVA_DTYPE_E5M2: {
        uint8_t b = (uint8_t)((rnd() & 1) << 7 | rint_range(12, 16) << 2 | rint_range(0, 3));
        *(uint8_t*)p = b;
        return dec_e5m2(b);
    }
    default: {
        float f = (float)((runif() * 2 - 1) * scale);
        memcpy(p, &f, 4);
        return f;
    }
    }
}
static double get_val(kva_dtype t, const void* base, size_t i) {
    const unsigned char* p = (const unsigned char*)base + i * dsize(t);
    uint16_t h;
    switch (t) {
    case KVA_DTYPE_BF16: memcpy(&h, p, 2); return dec_bf16(h);
    case KVA_DTYPE_F16: memcpy(&h, p, 2); return dec_f16(h);
    case KVA_DTYPE_E4M3: return dec_e4m3(*p);
    case KVA_DTYPE_E5M2: return dec_e5m2(*p);
    default: {
        float f;
        memcpy(&f, p, 4);
        return f;
    }
    }
}
static double tol_of(kva_dtype t) { return t == KVA_DTYPE_BF16 ? 1.6e-2 : (t == KVA_DTYPE_F32 ? 1e-4 : 4e-3); }

/* ---------------------------------------------------------------------------------------------- */
/* One attention problem                                                                           */

typedef struct prob {
    kva_attention_desc d;
    kva_op op;
    int B;
    int page_size;
    kva_layout layout;
    int* qo_len;
    int* kv_len;
    /* host data */
    int* qo_indptr;  /* [B+1] */
    int* kv_indptr;  /* pages (paged) or tokens (ragged) [B+1] */
    int* last_len;   /* [B] */
    int* indices;    /* page table */
    int64_t num_pages;
    int total_rows;
    int64_t total_entries;
    unsigned char *hq, *hk, *hv; /* q rows; K/V pool (paged) or ragged tensors */
    double *kd, *vd;             /* logical K/V per request token: [sum kv][hkv][D] */
    int64_t* kv_off;             /* first logical token of request b */
    double *ref_o, *ref_lse;     /* [rows][hq][D], [rows][hq] */
    float k_scale, v_scale;
    /* device */
    void *q, *o, *lse, *k, *v;
    int *dind;
    int64_t k_sp, k_st, k_sh; /* strides (elements) */
} prob;

static void ref_compute(prob* P, const float* slopes) {
    const kva_attention_desc* d = &P->d;
    const int D = d->head_dim_qk, g = d->num_qo_heads / d->num_kv_heads, HQ = d->num_qo_heads, HK = d->num_kv_heads;
    const double scale = d->sm_scale > 0 ? d->sm_scale : 1.0 / sqrt((double)D);
    P->ref_o = (double*)calloc((size_t)P->total_rows * HQ * D + 1, sizeof(double));
    P->ref_lse = (double*)calloc((size_t)P->total_rows * HQ + 1, sizeof(double));
    double* x = NULL;
    for (int b = 0; b < P->B; ++b) {
        const int L = P->kv_len[b], QL = P->qo_len[b];
        x = (double*)realloc(x, sizeof(double) * (size_t)(L + 1));
        for (int i = 0; i < QL; ++i) {
            const int row = P->qo_indptr[b] + i;
            const int64_t qpos = (int64_t)L - QL + i;
            for (int h = 0; h < HQ; ++h) {
                const int kh = h / g;
                double qv[256];
                for (int e = 0; e < D; ++e) qv[e] = get_val(d->q_dtype, P->hq, ((size_t)row * HQ + h) * D + e);
                if (d->pos_encoding == KVA_POS_ROPE_LLAMA) {
                    double r[256];
                    for (int f = 0; f < D / 2; ++f) {
                        double w = pow((double)d->rope_theta, -2.0 * f / D) / d->rope_scale;
                        double c = cos(qpos * w), s = sin(qpos * w);
                        r[f] = qv[f] * c - qv[f + D / 2] * s;
                        r[f + D / 2] = qv[f + D / 2] * c + qv[f] * s;
                    }
                    memcpy(qv, r, sizeof(double) * D);
                }
                double m = -INFINITY;
                for (int j = 0; j < L; ++j) {
                    const double* kr = P->kd + ((size_t)(P->kv_off[b] + j) * HK + kh) * D;
                    double kv[256];
                    memcpy(kv, kr, sizeof(double) * D);
                    if (d->pos_encoding == KVA_POS_ROPE_LLAMA) {
                        for (int f = 0; f < D / 2; ++f) {
                            double w = pow((double)d->rope_theta, -2.0 * f / D) / d->rope_scale;
                            double c = cos(j * w), s = sin(j * w);
                            kv[f] = kr[f] * c - kr[f + D / 2] * s;
                            kv[f + D / 2] = kr[f + D / 2] * c + kr[f] * s;
                        }
                    }
                    double dot = 0;
                    for (int e = 0; e < D; ++e) dot += qv[e] * kv[e];
                    double xx = scale * P->k_scale * dot;
                    if (d->pos_encoding == KVA_POS_ALIBI) xx += slopes[h] * (double)(j - qpos);
                    if (d->logits_soft_cap > 0) xx = d->logits_soft_cap * tanh(xx / d->logits_soft_cap);
                    int vis = 1;
                    if (d->mask_mode == KVA_MASK_CAUSAL && j > qpos) vis = 0;
                    if (d->window_left >= 0 && j < qpos - d->window_left) vis = 0;
                    x[j] = vis ? xx : -INFINITY;
                    if (x[j] > m) m = x[j];
                }
                double* o = P->ref_o + ((size_t)row * HQ + h) * D;
                double den = 0;
                for (int j = 0; j < L; ++j) {
                    if (x[j] == -INFINITY) continue;
                    double w = d->score_mode == KVA_SCORE_SIGMOID ? 1.0 / (1.0 + exp(-(x[j] + d->sigmoid_bias)))
                                                                  : exp(x[j] - m);
                    den += w;
                    const double* vr = P->vd + ((size_t)(P->kv_off[b] + j) * HK + kh) * D;
                    for (int e = 0; e < D; ++e) o[e] += w * vr[e] * P->v_scale;
                }
                if (d->score_mode == KVA_SCORE_SIGMOID) {
                    P->ref_lse[(size_t)row * HQ + h] = 0;
                } else if (den > 0) {
                    for (int e = 0; e < D; ++e) o[e] /= den;
                    P->ref_lse[(size_t)row * HQ + h] = (m + log(den)) / log(2.0);
                } else {
                    P->ref_lse[(size_t)row * HQ + h] = -INFINITY;
                }
            }
        }
    }
    free(x);
}

/* Build the host data of a problem. kv lengths and qo lengths given. */
static void prob_build(prob* P) {
    const kva_attention_desc* d = &P->d;
    const int D = d->head_dim_qk, HQ = d->num_qo_heads, HK = d->num_kv_heads;
    const size_t kes = dsize(d->kv_dtype), qes = dsize(d->q_dtype);
    P->qo_indptr = (int*)calloc((size_t)P->B + 1, sizeof(int));
    P->kv_indptr = (int*)calloc((size_t)P->B + 1, sizeof(int));
    P->last_len = (int*)calloc((size_t)P->B + 1, sizeof(int));
    P->kv_off = (int64_t*)calloc((size_t)P->B + 1, sizeof(int64_t));
    int64_t tok = 0;
    for (int b = 0; b < P->B; ++b) {
        P->qo_indptr[b + 1] = P->qo_indptr[b] + P->qo_len[b];
        P->kv_off[b] = tok;
        tok += P->kv_len[b];
        if (P->op == KVA_OP_BATCH_PREFILL_RAGGED) {
            P->kv_indptr[b + 1] = P->kv_indptr[b] + P->kv_len[b];
        } else {
            int np = (P->kv_len[b] + P->page_size - 1) / P->page_size;
            P->kv_indptr[b + 1] = P->kv_indptr[b] + np;
            P->last_len[b] = np ? P->kv_len[b] - (np - 1) * P->page_size : 0;
        }
    }
    P->kv_off[P->B] = tok;
    P->total_rows = P->qo_indptr[P->B];
    P->total_entries = P->kv_indptr[P->B];
    P->kd = (double*)malloc(sizeof(double) * (size_t)(tok * HK * D + 1));
    P->vd = (double*)malloc(sizeof(double) * (size_t)(tok * HK * D + 1));
    P->hq = (unsigned char*)malloc((size_t)P->total_rows * HQ * D * qes + 16);
    for (size_t i = 0; i < (size_t)P->total_rows * HQ * D; ++i) rand_val(d->q_dtype, P->hq + i * qes, 1.0);
    if (P->op == KVA_OP_BATCH_PREFILL_RAGGED) {
        P->hk = (unsigned char*)malloc((size_t)tok * HK * D * kes + 16);
        P->hv = (unsigned char*)malloc((size_t)tok * HK * D * kes + 16);
        for (int64_t i = 0; i < tok * HK * D; ++i) {
            P->kd[i] = rand_val(d->kv_dtype, P->hk + i * kes, 1.0);
            P->vd[i] = rand_val(d->kv_dtype, P->hv + i * kes, 1.0);
        }
        P->k_sp = 0;
        P->k_st = (int64_t)HK * D;
        P->k_sh = D;
        return;
    }
    /* paged: pool with 3 spare pages, pages of each request scattered */
    P->num_pages = P->total_entries + 3;
    P->indices = (int*)malloc(sizeof(int) * (size_t)(P->total_entries + 1));
    int* perm = (int*)malloc(sizeof(int) * (size_t)P->num_pages);
    for (int64_t i = 0; i < P->num_pages; ++i) perm[i] = (int)i;
    for (int64_t i = P->num_pages - 1; i > 0; --i) {
        int64_t j = (int64_t)(rnd() % (uint64_t)(i + 1));
        int t = perm[i];
        perm[i] = perm[j];
        perm[j] = t;
    }
    for (int64_t i = 0; i < P->total_entries; ++i) P->indices[i] = perm[i];
    free(perm);
    const int ps = P->page_size;
    if (P->layout == KVA_LAYOUT_NHD) {
        P->k_st = (int64_t)HK * D;
        P->k_sh = D;
    } else {
        P->k_sh = (int64_t)ps * D;
        P->k_st = D;
    }
    P->k_sp = (int64_t)ps * HK * D;
    size_t pool = (size_t)P->num_pages * ps * HK * D;
    P->hk = (unsigned char*)malloc(pool * kes + 16);
    P->hv = (unsigned char*)malloc(pool * kes + 16);
    /* poison everything (NaN-ish bytes) so unused slots would show */
    memset(P->hk, 0x7f, pool * kes);
    memset(P->hv, 0x7f, pool * kes);
    if (kes == 2) {
        for (size_t i = 0; i < pool; ++i) {
            uint16_t nan16 = d->kv_dtype == KVA_DTYPE_BF16 ? 0x7fc1 : 0x7e01;
            memcpy(P->hk + 2 * i, &nan16, 2);
            memcpy(P->hv + 2 * i, &nan16, 2);
        }
    }
    for (int b = 0; b < P->B; ++b)
        for (int j = 0; j < P->kv_len[b]; ++j) {
            int page = P->indices[P->kv_indptr[b] + j / ps], slot = j % ps;
            for (int h = 0; h < HK; ++h)
                for (int e = 0; e < D; ++e) {
                    size_t at = (size_t)page * P->k_sp + (size_t)slot * P->k_st + (size_t)h * P->k_sh + e;
                    size_t li = ((size_t)(P->kv_off[b] + j) * HK + h) * D + e;
                    P->kd[li] = rand_val(d->kv_dtype, P->hk + at * kes, 1.0);
                    P->vd[li] = rand_val(d->kv_dtype, P->hv + at * kes, 1.0);
                }
        }
}

static void prob_upload(prob* P) {
    const kva_attention_desc* d = &P->d;
    const int D = d->head_dim_qk, HQ = d->num_qo_heads, HK = d->num_kv_heads;
    size_t qb = (size_t)P->total_rows * HQ * D * dsize(d->q_dtype);
    size_t ob = (size_t)P->total_rows * HQ * D * dsize(d->o_dtype);
    P->q = dalloc(qb + 256);
    P->o = dalloc(ob + 256);
    P->lse = dalloc((size_t)P->total_rows * HQ * 4 + 256);
    dput(P->q, P->hq, qb);
    size_t kb;
    if (P->op == KVA_OP_BATCH_PREFILL_RAGGED) kb = (size_t)P->kv_off[P->B] * HK * D * dsize(d->kv_dtype);
    else kb = (size_t)P->num_pages * P->page_size * HK * D * dsize(d->kv_dtype);
    P->k = dalloc(kb + 256);
    P->v = dalloc(kb + 256);
    dput(P->k, P->hk, kb);
    dput(P->v, P->hv, kb);
    P->dind = (int*)dalloc(sizeof(int) * (size_t)(P->total_entries + 1));
    if (P->indices && P->total_entries)
        dput(P->dind, P->indices, sizeof(int) * (size_t)P->total_entries);
}

static void prob_free(prob* P) {
    dfree(P->q);
    dfree(P->o);
    dfree(P->lse);
    dfree(P->k);
    dfree(P->v);
    dfree(P->dind);
    free(P->qo_indptr);
    free(P->kv_indptr);
    free(P->last_len);
    free(P->kv_off);
    free(P->indices);
    free(P->hq);
    free(P->hk);
    free(P->hv);
    free(P->kd);
    free(P->vd);
    free(P->ref_o);
    free(P->ref_lse);
    free(P->qo_len);
    free(P->kv_len);
}

static void fill_params(const prob* P, kva_plan_params* pp) {
    kva_plan_params_init(pp);
    pp->batch_size = P->B;
    pp->qo_indptr = P->op == KVA_OP_BATCH_DECODE ? NULL : P->qo_indptr;
    pp->kv_indptr = P->kv_indptr;
    pp->kv_last_page_len = P->last_len;
    pp->page_size = P->page_size;
    pp->num_pages = P->num_pages;
}

static void fill_args(const prob* P, kva_run_args* a, void* stream, const float* dslopes) {
    const kva_attention_desc* d = &P->d;
    const int D = d->head_dim_qk, HQ = d->num_qo_heads, HK = d->num_kv_heads;
    kva_run_args_init(a);
    a->q = kva_tensor_make(P->q, d->q_dtype, 3, P->total_rows, HQ, D, 0);
    a->o = kva_tensor_make(P->o, d->o_dtype, 3, P->total_rows, HQ, D, 0);
    if (d->score_mode != KVA_SCORE_SIGMOID) a->lse = kva_tensor_make(P->lse, KVA_DTYPE_F32, 2, P->total_rows, HQ, 0, 0);
    if (P->op == KVA_OP_BATCH_PREFILL_RAGGED) {
        a->k = kva_tensor_make(P->k, d->kv_dtype, 3, P->kv_off[P->B], HK, D, 0);
        a->v = kva_tensor_make(P->v, d->kv_dtype, 3, P->kv_off[P->B], HK, D, 0);
    } else {
        kva_paged_kv_init(&a->paged, P->k, P->v, d->kv_dtype, P->layout, P->num_pages, P->page_size, HK, D, D);
        a->paged.indices = P->dind;
    }
    a->k_scale = P->k_scale;
    a->v_scale = P->v_scale;
    a->alibi_slopes = dslopes;
    a->stream = stream;
}

/* Compare device outputs with the reference; rows of requests in `zero_reqs` (bitmask of request ids < 64)
   must be o = 0, lse = -inf. Returns the number of mismatches. */
static int compare(const prob* P, const char* what, uint64_t zero_reqs) {
    const kva_attention_desc* d = &P->d;
    const int D = d->head_dim_qk, HQ = d->num_qo_heads;
    size_t n = (size_t)P->total_rows * HQ * D;
    unsigned char* ho = (unsigned char*)malloc(n * dsize(d->o_dtype) + 16);
    float* hl = (float*)malloc((size_t)P->total_rows * HQ * 4 + 16);
    dget(ho, P->o, n * dsize(d->o_dtype));
    dget(hl, P->lse, (size_t)P->total_rows * HQ * 4);
    double tol = tol_of(d->o_dtype);
    if (tol_of(d->q_dtype) > tol) tol = tol_of(d->q_dtype);
    if (d->kv_dtype == KVA_DTYPE_BF16) tol = 1.6e-2;
    int bad = 0;
    double worst = 0;
    for (int b = 0; b < P->B; ++b) {
        const int z = b < 64 && ((zero_reqs >> b) & 1);
        for (int i = 0; i < P->qo_len[b]; ++i) {
            int row = P->qo_indptr[b] + i;
            for (int h = 0; h < HQ; ++h) {
                double scale = 1;
                if (d->score_mode == KVA_SCORE_SIGMOID) {
                    for (int e = 0; e < D; ++e) {
                        double r = fabs(P->ref_o[((size_t)row * HQ + h) * D + e]);
                        if (r > scale) scale = r;
                    }
                }
                for (int e = 0; e < D; ++e) {
                    size_t at = ((size_t)row * HQ + h) * D + e;
                    double got = get_val(d->o_dtype, ho, at);
                    double ref = z ? 0.0 : P->ref_o[at];
                    double err = fabs(got - ref);
                    double lim = tol * scale + tol * fabs(ref);
                    if (!(err <= lim)) {
                        if (bad < 5)
                            printf("  %s: req %d row %d head %d dim %d: got %.6g want %.6g\n", what, b, row, h, e,
                                   got, ref);
                        bad++;
                    }
                    if (err > worst && err == err) worst = err;
                }
                if (d->score_mode != KVA_SCORE_SIGMOID) {
                    double got = hl[(size_t)row * HQ + h];
                    double ref = z ? -INFINITY : P->ref_lse[(size_t)row * HQ + h];
                    int ok = isinf(ref) ? got == ref : fabs(got - ref) <= 2e-3 + 1e-4 * fabs(ref);
                    if (!ok) {
                        if (bad < 5)
                            printf("  %s: req %d row %d head %d: lse got %.6g want %.6g\n", what, b, row, h, got, ref);
                        bad++;
                    }
                }
            }
        }
    }
    if (verbose) printf("  %s: max |err| %.3g\n", what, worst);
    free(ho);
    free(hl);
    return bad;
}

typedef struct ws_t {
    kva_workspace w;
} ws_t;

static void ws_alloc(kva_context* ctx, const kva_attention_desc* d, kva_op op, const kva_plan_params* pp, ws_t* W,
                     int graph_bound_batch, int64_t graph_bound_rows) {
    size_t db = 0, hb = 0;
    kva_status st;
    if (graph_bound_batch > 0) st = kva_workspace_bound(ctx, d, op, graph_bound_batch, graph_bound_rows, &db, &hb);
    else st = kva_plan_workspace_size(ctx, d, op, pp, &db, &hb);
    if (st != KVA_OK) printf("  workspace size: %s\n", kva_last_error_message());
    memset(W, 0, sizeof *W);
    W->w.device_bytes = db + 256;
    W->w.host_bytes = hb + 256;
    W->w.device = dalloc(W->w.device_bytes);
    if (cpu_mode) W->w.host = dalloc(W->w.host_bytes);
    else CU(cudaMallocHost(&W->w.host, W->w.host_bytes));
}
static void ws_free(ws_t* W) {
    dfree(W->w.device);
    if (cpu_mode) dfree(W->w.host);
    else cudaFreeHost(W->w.host);
}

/* ---------------------------------------------------------------------------------------------- */

typedef struct tcase {
    const char* name;
    kva_op op;
    int hq, hkv, D;
    kva_dtype qt, kt, ot;
    int page_size;
    kva_layout layout;
    int B, min_kv, max_kv, max_qo;
    int empty_every; /* every n-th request empty (0 = none) */
    kva_pos_encoding pos;
    float cap;
    int window;
    kva_score_mode score;
    kva_mask_mode mask;
    int long_kv; /* one request of this length (split-KV) */
    int fixed_split, no_split;
    int plan_no_pool; /* plan with num_pages = 0 and no host page table (the pool size known at run only) */
    int expect_hg; /* the plan must take the head-group kernel (kv_head_group > 1) on a device of compute capability 9.0 */
} tcase;

static void init_prob(prob* P, const tcase* c) {
    memset(P, 0, sizeof *P);
    kva_attention_desc_init(&P->d, c->hq, c->hkv, c->D, c->qt);
    P->d.kv_dtype = c->kt;
    P->d.o_dtype = c->ot;
    P->d.pos_encoding = c->pos;
    P->d.logits_soft_cap = c->cap;
    P->d.window_left = c->window;
    P->d.score_mode = c->score;
    P->d.sigmoid_bias = c->score == KVA_SCORE_SIGMOID ? -1.5f : 0.0f;
    P->d.mask_mode = c->mask;
    if (c->pos == KVA_POS_ROPE_LLAMA) {
        P->d.rope_theta = 5e5f;
        P->d.rope_scale = 2.0f;
    }
    P->op = c->op;
    P->B = c->B;
    P->page_size = c->page_size;
    P->layout = c->layout;
    P->k_scale = (c->kt == KVA_DTYPE_E4M3 || c->kt == KVA_DTYPE_E5M2) ? 0.75f : 1.0f;
    P->v_scale = (c->kt == KVA_DTYPE_E4M3 || c->kt == KVA_DTYPE_E5M2) ? 1.25f : 1.0f;
    P->qo_len = (int*)calloc((size_t)c->B + 1, sizeof(int));
    P->kv_len = (int*)calloc((size_t)c->B + 1, sizeof(int));
    for (int b = 0; b < c->B; ++b) {
        P->qo_len[b] = c->op == KVA_OP_BATCH_DECODE ? 1 : rint_range(1, c->max_qo);
        P->kv_len[b] = rint_range(c->min_kv, c->max_kv);
        if (c->empty_every && b % c->empty_every == 1) P->kv_len[b] = 0;
        if (c->op != KVA_OP_BATCH_DECODE && P->kv_len[b] < P->qo_len[b] && c->mask == KVA_MASK_CAUSAL)
            P->kv_len[b] = P->qo_len[b];
    }
    if (c->long_kv) P->kv_len[0] = c->long_kv;
    if (quick) /* small problems for compute-sanitizer */
        for (int b = 0; b < c->B; ++b)
            if (P->kv_len[b] > 2000) P->kv_len[b] = 2000;
}

static void run_case(kva_context* ctx, const tcase* c) {
    prob P;
    init_prob(&P, c);
    prob_build(&P);
    float* slopes = (float*)malloc(sizeof(float) * (size_t)c->hq);
    kva_alibi_slopes(c->hq, slopes);
    ref_compute(&P, slopes);
    prob_upload(&P);
    kva_plan_params pp;
    fill_params(&P, &pp);
    pp.fixed_split_size = c->fixed_split;
    pp.disable_split_kv = c->no_split;
    if (c->plan_no_pool) {
        pp.num_pages = 0;
        pp.kv_indices = NULL;
    }
    ws_t W;
    ws_alloc(ctx, &P.d, c->op, &pp, &W, 0, 0);
    kva_plan plan;
    to_call();
    kva_status st = kva_plan_make(ctx, &P.d, c->op, &pp, &W.w, &plan, NULL);
    to_data(c->name);
    if (st == KVA_ERR_UNSUPPORTED) {
        printf("  %s: unsupported (%s)\n", c->name, kva_last_error_message());
    } else {
        CHECK(st == KVA_OK, "%s: plan: %s", c->name, kva_last_error_message());
        if (st == KVA_OK) {
            kva_run_args a;
            fill_args(&P, &a, NULL, NULL);
            dset(P.o, 0xff, (size_t)P.total_rows * c->hq * c->D * dsize(c->ot));
            to_call();
            st = kva_run(ctx, &plan, &W.w, &a);
            to_data(c->name);
            CHECK(st == KVA_OK, "%s: run: %s", c->name, kva_last_error_message());
            dsync();
            kva_plan_info info;
            kva_plan_get_info(&plan, &info);
            if (c->expect_hg && hg_device)
                CHECK(info.kv_head_group > 1, "%s: the plan should read KV heads in groups (kv_head_group %d)",
                      c->name, info.kv_head_group);
            int bad = compare(&P, c->name, 0);
            CHECK(bad == 0, "%s: %d mismatches (items %d, merges %d, tile %d, chunk %d)", c->name, bad,
                  info.num_work_items, info.num_merge_tasks, info.tile_q, info.kv_chunk_size);
            kva_fault_report fr;
            to_call();
            st = kva_read_faults(ctx, &W.w, &fr, NULL);
            to_data(c->name);
            CHECK(st == KVA_OK && !fr.faulted, "%s: no faults expected", c->name);
            if (verbose)
                printf("  %s: ok (%d items, %d merges, tile %d, chunk %d, heads per item %d)\n", c->name,
                       info.num_work_items, info.num_merge_tasks, info.tile_q, info.kv_chunk_size, info.kv_head_group);
        }
    }
    ws_free(&W);
    free(slopes);
    prob_free(&P);
}

static tcase base_case(const char* name) {
    tcase c;
    memset(&c, 0, sizeof c);
    c.name = name;
    c.op = KVA_OP_BATCH_DECODE;
    c.hq = 32;
    c.hkv = 8;
    c.D = 128;
    c.qt = c.kt = c.ot = KVA_DTYPE_BF16;
    c.page_size = 16;
    c.layout = KVA_LAYOUT_NHD;
    c.B = 6;
    c.min_kv = 1;
    c.max_kv = 700;
    c.max_qo = 1;
    c.window = -1;
    c.score = KVA_SCORE_SOFTMAX;
    c.mask = KVA_MASK_NONE;
    return c;
}

static void test_decode_matrix(kva_context* ctx) {
    tcase cs[64];
    int n = 0;
    tcase c;
    c = base_case("gqa32/8 bf16 p16 nhd");
    cs[n++] = c;
    c = base_case("mha f16 d64 p1 hnd");
    c.hq = 8, c.hkv = 8, c.D = 64, c.qt = c.kt = c.ot = KVA_DTYPE_F16, c.page_size = 1, c.layout = KVA_LAYOUT_HND;
    cs[n++] = c;
    c = base_case("g5 bf16 d256 p3 e4m3");
    c.hq = 10, c.hkv = 2, c.D = 256, c.kt = KVA_DTYPE_E4M3, c.page_size = 3;
    cs[n++] = c;
    c = base_case("g7 f16 p16 e5m2 o=f32");
    c.hq = 14, c.hkv = 2, c.qt = KVA_DTYPE_F16, c.kt = KVA_DTYPE_E5M2, c.ot = KVA_DTYPE_F32;
    cs[n++] = c;
    c = base_case("g2 f16 hnd p3 empties");
    c.hq = 4, c.hkv = 2, c.qt = c.kt = c.ot = KVA_DTYPE_F16, c.page_size = 3, c.layout = KVA_LAYOUT_HND,
    c.empty_every = 3;
    cs[n++] = c;
    c = base_case("g8 bf16 d64 p16 e4m3 window"); /* fp8 at head dim 64: 64-byte rows in 128-byte shared slots */
    c.hq = 16, c.hkv = 2, c.D = 64, c.kt = KVA_DTYPE_E4M3, c.window = 200;
    cs[n++] = c;
    c = base_case("g8 bf16 long split");
    c.hq = 16, c.hkv = 2, c.B = 3, c.long_kv = quick ? 3000 : 20000;
    cs[n++] = c;
    c = base_case("g16 bf16 (two tiles)");
    c.hq = 32, c.hkv = 2;
    cs[n++] = c;
    /* fp8 KV on the 8-warp kernel: an eager plan of more than 1024 K/V rows per SM and one unit per SM (quick: the
       lengths are capped, so it runs the 4-warp form) */
    c = base_case("gqa32/8 bf16 e4m3 1 x 24k (8 warps)");
    c.kt = KVA_DTYPE_E4M3, c.B = 1, c.long_kv = 24000;
    cs[n++] = c;
    c = base_case("g4 f16 e5m2 o=f32 2 x 20k (8 warps)");
    c.hq = 16, c.hkv = 4, c.qt = KVA_DTYPE_F16, c.kt = KVA_DTYPE_E5M2, c.ot = KVA_DTYPE_F32, c.B = 2, c.min_kv = 19000,
    c.max_kv = 20000;
    cs[n++] = c;
    c = base_case("g2 f16 d64 e5m2 1 x 24k (8 warps)");
    c.hq = 16, c.hkv = 8, c.D = 64, c.qt = c.ot = KVA_DTYPE_F16, c.kt = KVA_DTYPE_E5M2, c.B = 1, c.long_kv = 24000;
    cs[n++] = c;
    c = base_case("g2 bf16 d256 e4m3 1 x 20k (8 warps)");
    c.hq = 16, c.hkv = 8, c.D = 256, c.kt = KVA_DTYPE_E4M3, c.B = 1, c.long_kv = 20000;
    cs[n++] = c;
    c = base_case("g12 f16 p16 (tiles of 6)");
    c.hq = 24, c.hkv = 2, c.qt = c.kt = c.ot = KVA_DTYPE_F16;
    cs[n++] = c;
    c = base_case("len 1 only");
    c.min_kv = 1, c.max_kv = 1;
    cs[n++] = c;
    c = base_case("rope");
    c.pos = KVA_POS_ROPE_LLAMA, c.max_kv = 2000;
    cs[n++] = c;
    c = base_case("rope f16 d64 e4m3");
    c.pos = KVA_POS_ROPE_LLAMA, c.D = 64, c.qt = c.ot = KVA_DTYPE_F16, c.kt = KVA_DTYPE_E4M3;
    cs[n++] = c;
    c = base_case("alibi");
    c.pos = KVA_POS_ALIBI;
    cs[n++] = c;
    c = base_case("softcap 30");
    c.cap = 30.0f;
    cs[n++] = c;
    c = base_case("window 100");
    c.window = 100;
    cs[n++] = c;
    c = base_case("sigmoid");
    c.score = KVA_SCORE_SIGMOID;
    cs[n++] = c;
    c = base_case("fixed split 256");
    c.fixed_split = 256, c.max_kv = 1500;
    cs[n++] = c;
    c = base_case("no split long");
    c.no_split = 1, c.long_kv = 5000;
    cs[n++] = c;
    c = base_case("prefill paged causal");
    c.op = KVA_OP_BATCH_PREFILL_PAGED, c.mask = KVA_MASK_CAUSAL, c.max_qo = 9, c.max_kv = 300, c.hq = 8, c.hkv = 2;
    cs[n++] = c;
    c = base_case("prefill ragged causal window");
    c.op = KVA_OP_BATCH_PREFILL_RAGGED, c.mask = KVA_MASK_CAUSAL, c.max_qo = 5, c.max_kv = 300, c.window = 40;
    cs[n++] = c;
    c = base_case("prefill ragged noncausal g1");
    c.op = KVA_OP_BATCH_PREFILL_RAGGED, c.hq = 4, c.hkv = 4, c.max_qo = 3, c.max_kv = 200;
    cs[n++] = c;
    int limit = quick ? 7 : n;
    for (int i = 0; i < limit; ++i) run_case(ctx, &cs[i]);
}

/* Threads: several host threads plan and run at once, each on its own stream and workspace, in a context that is
   fresh when they start (so they load their kernels concurrently) and, for two of them, in contexts they create
   themselves at the same moment. Problems are built and checked on the main thread (the reference and the RNG are
   not thread-safe); each thread plans and runs its problem `iters` times, a different problem per thread (other
   kernels: dtypes, head dims, page sizes, group sizes, split-KV, prefill). */
typedef struct thr_job {
    kva_context* ctx; /* shared context, or NULL: the thread creates its own */
    const kva_context_options* opt;
    prob P;
    kva_plan_params pp;
    ws_t W;
    int iters;
    kva_status st;
    char msg[200];
} thr_job;

static void* thr_main(void* arg) {
    thr_job* j = (thr_job*)arg;
    kva_context* ctx = j->ctx;
    cudaStream_t s = NULL;
    j->st = KVA_OK;
    if (call_dev >= 0 || data_dev >= 0) cudaSetDevice(call_dev >= 0 ? call_dev : data_dev);
    if (!ctx && (j->st = kva_context_create(j->opt, &ctx)) != KVA_OK) goto out;
    if (data_dev >= 0) cudaSetDevice(data_dev);
    if (cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking) != cudaSuccess) {
        j->st = KVA_ERR_BACKEND;
        snprintf(j->msg, sizeof j->msg, "cudaStreamCreate failed");
        goto out;
    }
    for (int it = 0; it < j->iters && j->st == KVA_OK; ++it) {
        kva_plan plan;
        j->st = kva_plan_make(ctx, &j->P.d, j->P.op, &j->pp, &j->W.w, &plan, s);
        if (j->st != KVA_OK) break;
        kva_run_args a;
        fill_args(&j->P, &a, s, NULL);
        j->st = kva_run(ctx, &plan, &j->W.w, &a);
        if (j->st == KVA_OK && cudaStreamSynchronize(s) != cudaSuccess) {
            j->st = KVA_ERR_BACKEND;
            snprintf(j->msg, sizeof j->msg, "cudaStreamSynchronize failed");
            break;
        }
    }
out:
    if (j->st != KVA_OK && !j->msg[0]) snprintf(j->msg, sizeof j->msg, "%s", kva_last_error_message());
    if (s) cudaStreamDestroy(s);
    if (!j->ctx && ctx) kva_context_destroy(ctx);
    return NULL;
}

static void test_threads(const kva_context_options* opt) {
    enum { NT = 6 };
    tcase cs[NT];
    cs[0] = base_case("thread: gqa32/8 bf16 p16");
    cs[1] = base_case("thread: g5 f16 d256 p3 e4m3 hnd");
    cs[1].hq = 10, cs[1].hkv = 2, cs[1].D = 256, cs[1].qt = cs[1].ot = KVA_DTYPE_F16, cs[1].kt = KVA_DTYPE_E4M3;
    cs[1].page_size = 3, cs[1].layout = KVA_LAYOUT_HND;
    cs[2] = base_case("thread: g8 bf16 long split");
    cs[2].hq = 16, cs[2].hkv = 2, cs[2].B = 3, cs[2].long_kv = quick ? 3000 : 12000;
    cs[3] = base_case("thread: prefill paged causal");
    cs[3].op = KVA_OP_BATCH_PREFILL_PAGED, cs[3].mask = KVA_MASK_CAUSAL, cs[3].max_qo = 9, cs[3].max_kv = 300;
    cs[3].hq = 8, cs[3].hkv = 2;
    cs[4] = base_case("thread (own context): mha f16 d64 p1");
    cs[4].hq = 8, cs[4].hkv = 8, cs[4].D = 64, cs[4].qt = cs[4].kt = cs[4].ot = KVA_DTYPE_F16, cs[4].page_size = 1;
    cs[5] = base_case("thread (own context): g7 bf16 e5m2 o=f32");
    cs[5].hq = 14, cs[5].hkv = 2, cs[5].kt = KVA_DTYPE_E5M2, cs[5].ot = KVA_DTYPE_F32;
    kva_context* shared = NULL;
    kva_status st = kva_context_create(opt, &shared);
    CHECK(st == KVA_OK, "threads: context: %s", kva_last_error_message());
    if (st != KVA_OK) return;
    static thr_job jobs[NT];
    pthread_t th[NT];
    int started[NT];
    for (int i = 0; i < NT; ++i) {
        thr_job* j = &jobs[i];
        memset(j, 0, sizeof *j);
        j->ctx = i < 4 ? shared : NULL;
        j->opt = opt;
        j->iters = quick ? 2 : 6;
        init_prob(&j->P, &cs[i]);
        prob_build(&j->P);
        ref_compute(&j->P, NULL);
        prob_upload(&j->P);
        fill_params(&j->P, &j->pp);
        ws_alloc(shared, &j->P.d, cs[i].op, &j->pp, &j->W, 0, 0);
        dset(j->P.o, 0xff, (size_t)j->P.total_rows * cs[i].hq * cs[i].D * dsize(cs[i].ot));
    }
    for (int i = 0; i < NT; ++i) started[i] = pthread_create(&th[i], NULL, thr_main, &jobs[i]) == 0;
    for (int i = 0; i < NT; ++i)
        if (started[i]) pthread_join(th[i], NULL);
    dsync();
    for (int i = 0; i < NT; ++i) {
        thr_job* j = &jobs[i];
        CHECK(started[i], "%s: pthread_create failed", cs[i].name);
        CHECK(j->st == KVA_OK, "%s: %s: %s", cs[i].name, kva_status_string(j->st), j->msg);
        if (started[i] && j->st == KVA_OK) {
            int bad = compare(&j->P, cs[i].name, 0);
            CHECK(bad == 0, "%s: %d mismatches after %d plan + run rounds on its own thread", cs[i].name, bad,
                  j->iters);
            if (verbose) printf("  %s: ok\n", cs[i].name);
        }
        ws_free(&j->W);
        prob_free(&j->P);
    }
    kva_context_destroy(shared);
}

/* The head-group decode kernel (kva_decode_hg.cuh), in a context created with KVATTN_CUDA_DECODE_HG=1 (every batch
   decode plan in its scope takes it): group sizes 1-8, 2 and 4 heads per item, page sizes 16, 32, 48 (TMA) and 1, 3,
   5, 8, 17 (cp.async producers), NHD and HND,
   f16 / bf16 with every output dtype, head dims 64 and 128, empty and one-token requests, unaligned chunk starts
   (sliding window), split KV with the fused merge (and with the merge kernel: nofused). Cases outside its scope
   must still plan and match (fixed split: batch-invariant mode keeps one head per item). */
static void test_decode_hg(kva_context* ctx, int nofused) {
    tcase cs[32];
    int n = 0;
    tcase c;
    c = base_case("hg gqa32/8 bf16 p16 nhd");
    c.expect_hg = 1, c.B = 9, c.max_kv = 1500;
    cs[n++] = c;
    c = base_case("hg g8 bf16 long split");
    c.hq = 16, c.hkv = 2, c.B = 3, c.long_kv = quick ? 3000 : 20000, c.expect_hg = 1;
    cs[n++] = c;
    /* fp8 KV (head dim 128) under 16-bit q, with k / v scales (prob: 0.75 / 1.25) */
    c = base_case("hg gqa32/8 bf16 q e4m3 p16 nhd");
    c.kt = KVA_DTYPE_E4M3, c.B = 9, c.max_kv = 1500, c.expect_hg = 1;
    cs[n++] = c;
    c = base_case("hg g5 f16 q e5m2 p32 hnd o=f32 long split");
    c.hq = 10, c.hkv = 2, c.qt = KVA_DTYPE_F16, c.kt = KVA_DTYPE_E5M2, c.ot = KVA_DTYPE_F32, c.page_size = 32,
    c.layout = KVA_LAYOUT_HND, c.B = 3, c.long_kv = quick ? 3000 : 12000, c.expect_hg = 1;
    cs[n++] = c;
    /* pages of other than 16k tokens: the cp.async producers ("_ga") */
    c = base_case("hg gqa32/8 bf16 p1 long split");
    c.page_size = 1, c.B = 5, c.max_kv = quick ? 300 : 900, c.long_kv = quick ? 1200 : 9000, c.expect_hg = 1;
    cs[n++] = c;
    if (!nofused) {
        c = base_case("hg g4 bf16 q e4m3 p3 hnd window empties");
        c.kt = KVA_DTYPE_E4M3, c.page_size = 3, c.layout = KVA_LAYOUT_HND, c.window = 77, c.empty_every = 4,
        c.max_kv = quick ? 400 : 1000, c.expect_hg = 1;
        cs[n++] = c;
        c = base_case("hg g2 bf16 q e4m3 p48 window empties");
        c.hq = 4, c.hkv = 2, c.kt = KVA_DTYPE_E4M3, c.page_size = 48, c.window = 100, c.empty_every = 3,
        c.max_kv = 1200, c.expect_hg = 1;
        cs[n++] = c;
        c = base_case("hg g1 f16 q e4m3 o=bf16 len 1..40");
        c.hq = 8, c.hkv = 8, c.qt = KVA_DTYPE_F16, c.kt = KVA_DTYPE_E4M3, c.ot = KVA_DTYPE_BF16, c.min_kv = 1,
        c.max_kv = 40, c.expect_hg = 1;
        cs[n++] = c;
    }
    if (!nofused) {
        c = base_case("hg mha f16 d64 p32 hnd o=f32");
        c.hq = 8, c.hkv = 8, c.D = 64, c.qt = c.kt = KVA_DTYPE_F16, c.ot = KVA_DTYPE_F32, c.page_size = 32,
        c.layout = KVA_LAYOUT_HND, c.expect_hg = 1;
        cs[n++] = c;
        c = base_case("hg g5 bf16 p16 o=f16");
        c.hq = 10, c.hkv = 2, c.ot = KVA_DTYPE_F16, c.expect_hg = 1;
        cs[n++] = c;
        c = base_case("hg g7 f16 p48 hnd");
        c.hq = 14, c.hkv = 2, c.qt = c.kt = c.ot = KVA_DTYPE_F16, c.page_size = 48, c.layout = KVA_LAYOUT_HND,
        c.expect_hg = 1;
        cs[n++] = c;
        c = base_case("hg g2 f16 p16 empties");
        c.hq = 4, c.hkv = 2, c.qt = c.kt = c.ot = KVA_DTYPE_F16, c.empty_every = 3, c.expect_hg = 1;
        cs[n++] = c;
        c = base_case("hg g3 bf16 d64 hnd h8");
        c.hq = 24, c.hkv = 8, c.D = 64, c.layout = KVA_LAYOUT_HND, c.expect_hg = 1;
        cs[n++] = c;
        c = base_case("hg len 1 only");
        c.min_kv = 1, c.max_kv = 1, c.expect_hg = 1;
        cs[n++] = c;
        c = base_case("hg window 100");
        c.window = 100, c.max_kv = 1200, c.expect_hg = 1;
        cs[n++] = c;
        c = base_case("hg causal g1 d128 long");
        c.hq = 4, c.hkv = 4, c.mask = KVA_MASK_CAUSAL, c.long_kv = quick ? 2500 : 9000, c.expect_hg = 1;
        cs[n++] = c;
        c = base_case("hg no split long");
        c.no_split = 1, c.long_kv = 5000, c.expect_hg = 1;
        cs[n++] = c;
        c = base_case("hg pool size at run only");
        c.plan_no_pool = 1, c.expect_hg = 1;
        cs[n++] = c;
        c = base_case("hg every request empty");
        c.min_kv = 0, c.max_kv = 0, c.expect_hg = 1;
        cs[n++] = c;
        c = base_case("hg scope: fixed split 256");
        c.fixed_split = 256, c.max_kv = 1500;
        cs[n++] = c;
        c = base_case("hg page 8");
        c.page_size = 8, c.expect_hg = 1;
        cs[n++] = c;
        c = base_case("hg g5 f16 d64 p5 o=f32 len 1..40");
        c.hq = 10, c.hkv = 2, c.D = 64, c.qt = c.kt = KVA_DTYPE_F16, c.ot = KVA_DTYPE_F32, c.page_size = 5,
        c.min_kv = 1, c.max_kv = 40, c.expect_hg = 1;
        cs[n++] = c;
        c = base_case("hg g8 bf16 p17 hnd long split");
        c.hq = 16, c.hkv = 2, c.page_size = 17, c.layout = KVA_LAYOUT_HND, c.B = 3, c.long_kv = quick ? 3000 : 15000,
        c.expect_hg = 1;
        cs[n++] = c;
        c = base_case("hg scope: softcap");
        c.cap = 30.0f;
        cs[n++] = c;
    }
    int limit = quick ? (n < 10 ? n : 10) : n;
    for (int i = 0; i < limit; ++i) run_case(ctx, &cs[i]);
}

/* ---------------------------------------------------------------------------------------------- */

static void test_graph(kva_context* ctx) {
    tcase c = base_case("graph");
    c.B = 8;
    c.max_kv = 3000;
    prob A, Bp;
    init_prob(&A, &c);
    prob_build(&A);
    /* the second step: same batch bound, other lengths (one long request forces a split), same pool */
    init_prob(&Bp, &c);
    Bp.B = 5;
    for (int b = 0; b < 5; ++b) Bp.kv_len[b] = b == 0 ? (quick ? 2000 : 9000) : rint_range(1, 200);
    prob_build(&Bp);
    ref_compute(&Bp, NULL);
    prob_upload(&A);
    prob_upload(&Bp);

    cudaStream_t s;
    CU(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
    /* Step A (captured): A's lengths over B's pool (A's page table points at B's pages) */
    kva_plan_params pp;
    fill_params(&A, &pp);
    pp.num_pages = Bp.num_pages;
    pp.graph_mode = 1;
    pp.max_batch_size = 8;
    ws_t W;
    ws_alloc(ctx, &A.d, KVA_OP_BATCH_DECODE, &pp, &W, 8, 8);
    kva_plan plan;
    kva_status st = kva_plan_make(ctx, &A.d, KVA_OP_BATCH_DECODE, &pp, &W.w, &plan, s);
    CHECK(st == KVA_OK, "graph: plan A: %s", kva_last_error_message());
    /* the captured run's tensors: q/o/lse of the bound (8 rows), B's pool, a page table buffer for either step */
    kva_run_args a;
    fill_args(&Bp, &a, s, NULL);
    void *q8, *o8, *l8;
    const int HQ = c.hq, D = c.D;
    CU(cudaMalloc(&q8, (size_t)8 * HQ * D * 2));
    CU(cudaMalloc(&o8, (size_t)8 * HQ * D * 2));
    CU(cudaMalloc(&l8, (size_t)8 * HQ * 4));
    CU(cudaMemset(q8, 0, (size_t)8 * HQ * D * 2));
    CU(cudaMemcpy(q8, Bp.q, (size_t)5 * HQ * D * 2, cudaMemcpyDeviceToDevice));
    a.q = kva_tensor_make(q8, c.qt, 3, 8, HQ, D, 0);
    a.o = kva_tensor_make(o8, c.ot, 3, 8, HQ, D, 0);
    a.lse = kva_tensor_make(l8, KVA_DTYPE_F32, 2, 8, HQ, 0, 0);
    /* A's page table refers to pages of A's pool; B's pool has at least as many pages? make indices valid */
    int* ind8;
    int64_t nent = A.total_entries > Bp.total_entries ? A.total_entries : Bp.total_entries;
    CU(cudaMalloc((void**)&ind8, sizeof(int) * (size_t)(nent + 1)));
    int* hind = (int*)calloc((size_t)nent + 1, sizeof(int));
    for (int64_t i = 0; i < A.total_entries; ++i) hind[i] = (int)(i % Bp.num_pages);
    CU(cudaMemcpy(ind8, hind, sizeof(int) * (size_t)nent, cudaMemcpyHostToDevice));
    a.paged.indices = ind8;
    CU(cudaStreamSynchronize(s));

    cudaGraph_t graph;
    cudaGraphExec_t exec;
    CU(cudaStreamBeginCapture(s, cudaStreamCaptureModeThreadLocal));
    st = kva_run(ctx, &plan, &W.w, &a);
    CHECK(st == KVA_OK, "graph: run under capture: %s", kva_last_error_message());
    /* planning during capture is refused */
    kva_plan plan2;
    kva_status st2 = kva_plan_make(ctx, &A.d, KVA_OP_BATCH_DECODE, &pp, &W.w, &plan2, s);
    CHECK(st2 == KVA_ERR_CAPTURE_ACTIVE, "graph: plan during capture returns KVA_ERR_CAPTURE_ACTIVE (got %s)",
          kva_status_string(st2));
    CU(cudaStreamEndCapture(s, &graph));
    CU(cudaGraphInstantiate(&exec, graph, 0));
    CU(cudaGraphLaunch(exec, s)); /* replay of plan A (just must not fault) */
    CU(cudaStreamSynchronize(s));

    /* re-plan with B's lengths into the same workspace, replay */
    kva_plan_params pb;
    fill_params(&Bp, &pb);
    pb.graph_mode = 1;
    pb.max_batch_size = 8;
    kva_plan planB;
    st = kva_plan_make(ctx, &Bp.d, KVA_OP_BATCH_DECODE, &pb, &W.w, &planB, s);
    CHECK(st == KVA_OK, "graph: plan B: %s", kva_last_error_message());
    kva_plan_info ib;
    kva_plan_get_info(&planB, &ib);
    CHECK(ib.num_merge_tasks > 0, "graph: plan B splits KV (merges %d)", ib.num_merge_tasks);
    for (int64_t i = 0; i < Bp.total_entries; ++i) hind[i] = Bp.indices[i];
    CU(cudaMemcpyAsync(ind8, hind, sizeof(int) * (size_t)Bp.total_entries, cudaMemcpyHostToDevice, s));
    CU(cudaMemsetAsync(o8, 0xff, (size_t)8 * HQ * D * 2, s));
    CU(cudaGraphLaunch(exec, s));
    CU(cudaStreamSynchronize(s));
    /* compare rows 0..4 of o8 with the reference of B: copy them into B's o/lse */
    CU(cudaMemcpy(Bp.o, o8, (size_t)5 * HQ * D * 2, cudaMemcpyDeviceToDevice));
    CU(cudaMemcpy(Bp.lse, l8, (size_t)5 * HQ * 4, cudaMemcpyDeviceToDevice));
    int bad = compare(&Bp, "graph replay", 0);
    CHECK(bad == 0, "graph: replay after re-plan matches the reference (%d mismatches)", bad);

    /* the same graph-mode plan run without the graph must give the same bits */
    unsigned char* g1 = (unsigned char*)malloc((size_t)5 * HQ * D * 2);
    unsigned char* g2 = (unsigned char*)malloc((size_t)5 * HQ * D * 2);
    CU(cudaMemcpy(g1, o8, (size_t)5 * HQ * D * 2, cudaMemcpyDeviceToHost));
    CU(cudaMemsetAsync(o8, 0xff, (size_t)8 * HQ * D * 2, s));
    kva_run_args a5 = a; /* the same buffers as the captured run, at plan B's 5 rows */
    a5.q.shape[0] = a5.o.shape[0] = a5.lse.shape[0] = 5;
    st = kva_run(ctx, &planB, &W.w, &a5);
    CHECK(st == KVA_OK, "graph: eager run of the graph-mode plan: %s", kva_last_error_message());
    CU(cudaStreamSynchronize(s));
    CU(cudaMemcpy(g2, o8, (size_t)5 * HQ * D * 2, cudaMemcpyDeviceToHost));
    CHECK(memcmp(g1, g2, (size_t)5 * HQ * D * 2) == 0, "graph replay and an eager run of its plan agree bitwise");
    /* and a plan of the same step outside graph mode (its own split) matches the reference */
    kva_plan_params pn;
    fill_params(&Bp, &pn);
    ws_t W2;
    ws_alloc(ctx, &Bp.d, KVA_OP_BATCH_DECODE, &pn, &W2, 0, 0);
    kva_plan planN;
    st = kva_plan_make(ctx, &Bp.d, KVA_OP_BATCH_DECODE, &pn, &W2.w, &planN, NULL);
    CHECK(st == KVA_OK, "graph: non-graph plan B: %s", kva_last_error_message());
    kva_run_args an;
    fill_args(&Bp, &an, NULL, NULL);
    an.paged.indices = Bp.dind;
    st = kva_run(ctx, &planN, &W2.w, &an);
    CHECK(st == KVA_OK, "graph: non-graph run: %s", kva_last_error_message());
    CU(cudaDeviceSynchronize());
    bad = compare(&Bp, "non-graph", 0);
    CHECK(bad == 0, "graph: non-graph run of B matches the reference");
    if (verbose) {
        kva_plan_info in;
        kva_plan_get_info(&planN, &in);
        printf("  graph: graph-mode plan %d workers, chunk %d; non-graph plan %d workers, chunk %d\n", ib.num_workers,
               ib.kv_chunk_size, in.num_workers, in.kv_chunk_size);
    }
    free(g1);
    free(g2);
    free(hind);
    ws_free(&W2);
    cudaGraphExecDestroy(exec);
    cudaGraphDestroy(graph);
    cudaFree(q8);
    cudaFree(o8);
    cudaFree(l8);
    cudaFree(ind8);
    ws_free(&W);
    cudaStreamDestroy(s);
    prob_free(&A);
    prob_free(&Bp);
}

/* ---------------------------------------------------------------------------------------------- */
/* Programmatic dependent launch (kva_run_args.enable_pdl): a chain of NC decode calls of one plan and workspace where
   call i reads call i-1's output as its q (x[i] = attn(x[i-1])), run back to back on one stream. Call i's CTAs may
   start while call i-1 still runs; they must read q, the page table and the plan's merge counters only after it
   completed. The chain with enable_pdl = 1 (eager, then captured into a CUDA graph and replayed) must equal the
   chain without it bit for bit, and stage 1 must match the float64 reference. The outputs are poisoned (NaN) before
   each chain, so a call that read its q early reads NaN. graph: plan in graph mode (264 CTAs of 4 warps; idle CTAs
   exit at once and make room for the next call's CTAs); else an eager plan. */
#define PDL_NC 6
static void test_pdl(kva_context* ctx, const char* tag, int graph_plan, int batch, int long_kv) {
    tcase c = base_case("pdl");
    c.B = batch;
    c.max_kv = 900;
    c.long_kv = quick && long_kv > 1800 ? 1800 : long_kv; /* split KV: the fused merge's counters (or the merge
                                                             kernel, or a cluster combine) in the chain */
    prob P;
    init_prob(&P, &c);
    prob_build(&P);
    ref_compute(&P, NULL);
    prob_upload(&P);
    const int HQ = c.hq, D = c.D, R = P.total_rows;
    const size_t xb = (size_t)R * HQ * D * 2, lb = (size_t)R * HQ * 4;
    void* x[PDL_NC + 1];
    void* l[PDL_NC + 1];
    x[0] = P.q;
    l[0] = NULL;
    for (int i = 1; i <= PDL_NC; ++i) {
        x[i] = dalloc(xb + 256);
        l[i] = dalloc(lb + 256);
    }
    kva_plan_params pp;
    fill_params(&P, &pp);
    if (graph_plan) {
        pp.graph_mode = 1;
        pp.max_batch_size = c.B;
    }
    ws_t W;
    ws_alloc(ctx, &P.d, KVA_OP_BATCH_DECODE, &pp, &W, graph_plan ? c.B : 0, graph_plan ? c.B : 0);
    cudaStream_t s = NULL;
    if (!cpu_mode) CU(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
    kva_plan plan;
    kva_status st = kva_plan_make(ctx, &P.d, KVA_OP_BATCH_DECODE, &pp, &W.w, &plan, s);
    CHECK(st == KVA_OK, "pdl %s: plan: %s", tag, kva_last_error_message());
    kva_plan_info info;
    kva_plan_get_info(&plan, &info);
    unsigned char* want = (unsigned char*)malloc((PDL_NC + 1) * (xb + lb));
    unsigned char* got = (unsigned char*)malloc(xb + lb);
    /* three chains: 0 without PDL (the expected bits), 1 with PDL, 2 with PDL captured into a graph and replayed */
    for (int mode = 0; mode < 3 && st == KVA_OK; ++mode) {
        if (mode == 2 && cpu_mode) break;
        for (int i = 1; i <= PDL_NC; ++i) {
            dset(x[i], 0xff, xb); /* NaN */
            dset(l[i], 0xff, lb);
        }
        cudaGraph_t graph = NULL;
        cudaGraphExec_t exec = NULL;
        if (mode == 2) CU(cudaStreamBeginCapture(s, cudaStreamCaptureModeThreadLocal));
        for (int i = 1; i <= PDL_NC && st == KVA_OK; ++i) {
            kva_run_args a;
            fill_args(&P, &a, s, NULL);
            a.q = kva_tensor_make(x[i - 1], c.qt, 3, R, HQ, D, 0);
            a.o = kva_tensor_make(x[i], c.ot, 3, R, HQ, D, 0);
            a.lse = kva_tensor_make(l[i], KVA_DTYPE_F32, 2, R, HQ, 0, 0);
            a.enable_pdl = mode > 0;
            st = kva_run(ctx, &plan, &W.w, &a);
            CHECK(st == KVA_OK, "pdl %s: run %d of chain %d: %s", tag, i, mode, kva_last_error_message());
        }
        if (mode == 2) {
            CU(cudaStreamEndCapture(s, &graph));
            CU(cudaGraphInstantiate(&exec, graph, 0));
            for (int i = 1; i <= PDL_NC; ++i) { /* the capture ran nothing: poison again, replay twice */
                CU(cudaMemsetAsync(x[i], 0xff, xb, s));
                CU(cudaMemsetAsync(l[i], 0xff, lb, s));
            }
            CU(cudaGraphLaunch(exec, s));
            CU(cudaGraphLaunch(exec, s));
        }
        if (!cpu_mode) CU(cudaStreamSynchronize(s));
        int diff = 0;
        for (int i = 1; i <= PDL_NC; ++i) {
            unsigned char* dst = mode == 0 ? want + (size_t)i * (xb + lb) : got;
            dget(dst, x[i], xb);
            dget(dst + xb, l[i], lb);
            if (mode > 0 && memcmp(dst, want + (size_t)i * (xb + lb), xb + lb) != 0) diff = diff ? diff : i;
        }
        if (mode > 0)
            CHECK(diff == 0, "pdl %s: the chain %s equals the chain without PDL bit for bit (first differing call %d; "
                  "%d items, %d merges, %d workers)", tag, mode == 1 ? "with PDL" : "with PDL in a graph", diff,
                  info.num_work_items, info.num_merge_tasks, info.num_workers);
        if (mode == 1) { /* stage 1 against the float64 reference */
            void *o0 = P.o, *l0 = P.lse;
            P.o = x[1];
            P.lse = l[1];
            const int bad = compare(&P, "pdl stage 1", 0);
            P.o = o0;
            P.lse = l0;
            CHECK(bad == 0, "pdl %s: stage 1 matches the reference (%d mismatches)", tag, bad);
        }
        if (exec) cudaGraphExecDestroy(exec);
        if (graph) cudaGraphDestroy(graph);
    }
    if (verbose)
        printf("  pdl %s: %d calls per chain, %d items, %d merges, %d workers\n", tag, PDL_NC, info.num_work_items,
               info.num_merge_tasks, info.num_workers);
    free(want);
    free(got);
    for (int i = 1; i <= PDL_NC; ++i) {
        dfree(x[i]);
        dfree(l[i]);
    }
    if (s) cudaStreamDestroy(s);
    ws_free(&W);
    prob_free(&P);
}

/* ---------------------------------------------------------------------------------------------- */

/* many: 300 requests, several work items per worker (the kernels' item boundaries: epilogue, next item's q and page
   indices; the bad request's item is then neither a worker's only nor, mostly, its last) */
/* hkv: KV heads of the case (0: base_case's 8; 1 or 2: GQA groups of 32 or 16, which the head-group kernel runs in row
   slots) */
static void test_fault(kva_context* ctx, int split, int negative, int kt, int many, int hkv) {
    tcase c = base_case("fault");
    c.kt = kt;
    if (hkv) c.hkv = hkv;
    c.B = many ? 300 : 5;
    c.max_kv = 600;
    prob P;
    init_prob(&P, &c);
    P.kv_len[2] = split ? (many ? 20000 : quick ? 2000 : 6000) : 500; /* many: long enough to be split */
    prob_build(&P);
    ref_compute(&P, NULL);
    /* corrupt one page entry of request 2 (device copy only; the host copy is not given to plan) */
    int entry = P.kv_indptr[2] + (P.kv_indptr[3] - P.kv_indptr[2]) / 2;
    int badval = negative ? -7 : (int)P.num_pages + 5;
    int saved = P.indices[entry];
    P.indices[entry] = badval;
    prob_upload(&P);
    P.indices[entry] = saved;
    kva_plan_params pp;
    fill_params(&P, &pp);
    ws_t W;
    ws_alloc(ctx, &P.d, KVA_OP_BATCH_DECODE, &pp, &W, 0, 0);
    kva_plan plan;
    kva_status st = kva_plan_make(ctx, &P.d, KVA_OP_BATCH_DECODE, &pp, &W.w, &plan, NULL);
    CHECK(st == KVA_OK, "fault: plan: %s", kva_last_error_message());
    kva_plan_info info;
    kva_plan_get_info(&plan, &info);
    if (split) CHECK(info.num_merge_tasks > 0, "fault: the long request is split (%d merges)", info.num_merge_tasks);
    if (many)
        CHECK(info.num_work_items >= 2 * info.num_workers, "fault: several items per worker (%d items, %d workers)",
              info.num_work_items, info.num_workers);
    if (hg_ctx && hg_device && !hkv)
        CHECK(info.kv_head_group > 1, "fault: the plan reads KV heads in groups (kv_head_group %d)", info.kv_head_group);
    if (hg_ctx && hg_device && hkv)
        CHECK(info.kv_head_group == 1 && info.tile_q == c.hq / c.hkv, "fault: row slots (kv_head_group %d, tile_q %d)",
              info.kv_head_group, info.tile_q);
    kva_run_args a;
    fill_args(&P, &a, NULL, NULL);
    st = kva_run(ctx, &plan, &W.w, &a);
    CHECK(st == KVA_OK, "fault: run: %s", kva_last_error_message());
    CU(cudaDeviceSynchronize());
    int bad = compare(&P, split ? "fault (split)" : "fault", (uint64_t)1 << 2);
    CHECK(bad == 0, "fault: request 2 zeroed, others correct (%d mismatches, split %d, negative %d)", bad, split,
          negative);
    kva_fault_report fr;
    st = kva_read_faults(ctx, &W.w, &fr, NULL);
    CHECK(st == KVA_OK && fr.faulted && fr.request == 2 && fr.page_index == badval,
          "fault: report faulted %d request %d page %lld (want 2, %d)", fr.faulted, fr.request,
          (long long)fr.page_index, badval);
    st = kva_read_faults(ctx, &W.w, &fr, NULL);
    CHECK(st == KVA_OK && !fr.faulted, "fault: the report is cleared by reading it");
    /* run again: same outcome, deterministic */
    st = kva_run(ctx, &plan, &W.w, &a);
    CU(cudaDeviceSynchronize());
    bad = compare(&P, "fault again", (uint64_t)1 << 2);
    CHECK(st == KVA_OK && bad == 0, "fault: second run identical");
    ws_free(&W);
    prob_free(&P);
}

/* ---------------------------------------------------------------------------------------------- */

static void test_append_and_merge(kva_context* ctx) {
    /* append: 3 requests, page size 4, NHD bf16, 2 heads, D 64; append 5 tokens at given positions */
    const int HK = 2, D = 64, ps = 4, NP = 10;
    size_t pool = (size_t)NP * ps * HK * D;
    uint16_t* hk = (uint16_t*)calloc(pool, 2);
    void *dk, *dv;
    dk = dalloc(pool * 2);
    dv = dalloc(pool * 2);
    dset(dk, 0, pool * 2);
    dset(dv, 0, pool * 2);
    int indptr[4] = {0, 2, 3, 6}, last[3] = {3, 4, 1}, indices[6] = {7, 2, 9, 0, 4, 5};
    int bidx[6] = {0, 0, 1, 2, 2, 1}, pos[6] = {4, 6, 3, 8, 0, 4 /* out of range: request 1 has 4 tokens */};
    int *d_indptr, *d_last, *d_ind, *d_b, *d_p;
    d_indptr = (int*)dalloc(sizeof indptr);
    d_last = (int*)dalloc(sizeof last);
    d_ind = (int*)dalloc(sizeof indices);
    d_b = (int*)dalloc(sizeof bidx);
    d_p = (int*)dalloc(sizeof pos);
    dput(d_indptr, indptr, sizeof indptr);
    dput(d_last, last, sizeof last);
    dput(d_ind, indices, sizeof indices);
    dput(d_b, bidx, sizeof bidx);
    dput(d_p, pos, sizeof pos);
    const int nnz = 6;
    uint16_t* ak = (uint16_t*)malloc((size_t)nnz * HK * D * 2);
    for (int i = 0; i < nnz * HK * D; ++i) ak[i] = enc_bf16(i * 0.001 + 0.5);
    void *dak, *dav;
    dak = dalloc((size_t)nnz * HK * D * 2);
    dav = dalloc((size_t)nnz * HK * D * 2);
    dput(dak, ak, (size_t)nnz * HK * D * 2);
    dput(dav, ak, (size_t)nnz * HK * D * 2);
    kva_tensor tk = kva_tensor_make(dak, KVA_DTYPE_BF16, 3, nnz, HK, D, 0);
    kva_tensor tv = kva_tensor_make(dav, KVA_DTYPE_BF16, 3, nnz, HK, D, 0);
    kva_paged_kv pk;
    kva_paged_kv_init(&pk, dk, dv, KVA_DTYPE_BF16, KVA_LAYOUT_NHD, NP, ps, HK, D, D);
    pk.indices = d_ind;
    pk.indptr = d_indptr;
    pk.last_page_len = d_last;
    kva_fault_report fr;
    kva_workspace nows;
    memset(&nows, 0, sizeof nows);
    kva_read_faults(ctx, &nows, &fr, NULL); /* clear */
    /* the 5 valid tokens */
    tk.shape[0] = tv.shape[0] = nnz - 1;
    kva_status st = kva_append_paged_kv_cache(ctx, &tk, &tv, d_b, d_p, nnz - 1, &pk, 3, NULL);
    CHECK(st == KVA_OK, "append: %s", kva_last_error_message());
    dsync();
    dget(hk, dk, pool * 2);
    int bad = 0;
    for (int i = 0; i < nnz - 1; ++i) {
        int b = bidx[i], p = pos[i];
        int page = indices[indptr[b] + p / ps], slot = p % ps;
        for (int h = 0; h < HK; ++h)
            for (int e = 0; e < D; ++e)
                if (hk[(((size_t)page * ps + slot) * HK + h) * D + e] != ak[((size_t)i * HK + h) * D + e]) bad++;
    }
    CHECK(bad == 0, "append: %d wrong elements", bad);
    /* token 5 alone: position 4 is outside request 1 (4 tokens) */
    kva_tensor tk1 = kva_tensor_make((uint16_t*)dak + 5 * HK * D, KVA_DTYPE_BF16, 3, 1, HK, D, 0);
    kva_tensor tv1 = kva_tensor_make((uint16_t*)dav + 5 * HK * D, KVA_DTYPE_BF16, 3, 1, HK, D, 0);
    st = kva_append_paged_kv_cache(ctx, &tk1, &tv1, d_b + 5, d_p + 5, 1, &pk, 3, NULL);
    if (cpu_mode) {
        CHECK(st == KVA_ERR_PAGE_INDEX_OUT_OF_RANGE, "append (cpu): out-of-range token refused (%s)",
              kva_status_string(st));
    } else {
        CHECK(st == KVA_OK, "append: %s", kva_last_error_message());
        st = kva_read_faults(ctx, &nows, &fr, NULL);
        CHECK(st == KVA_OK && fr.faulted && fr.request == 0,
              "append: the out-of-range token is reported (faulted %d, token %d)", fr.faulted, fr.request);
    }
    uint16_t* hk2 = (uint16_t*)malloc(pool * 2);
    dget(hk2, dk, pool * 2);
    CHECK(memcmp(hk, hk2, pool * 2) == 0, "append: the out-of-range token wrote nothing");
    free(hk2);
    dfree(dk);
    dfree(dv);
    dfree(d_indptr);
    dfree(d_last);
    dfree(d_ind);
    dfree(d_b);
    dfree(d_p);
    dfree(dak);
    dfree(dav);
    free(ak);
    free(hk);

    /* merge_states: 3 rows with 2, 0, 3 states; heads 2, dim 8, f32 */
    const int R = 3, H = 2, DD = 8, T = 5;
    int ip[4] = {0, 2, 2, 5};
    float hv[T * H * DD], hs[T * H], mo[R * H * DD], ms[R * H];
    for (int i = 0; i < T * H * DD; ++i) hv[i] = (float)(runif() * 2 - 1);
    for (int i = 0; i < T * H; ++i) hs[i] = (float)(runif() * 8 - 4);
    hs[3] = -INFINITY; /* an empty state */
    void *dvv, *dss, *dmo, *dms;
    dvv = dalloc(sizeof hv);
    dss = dalloc(sizeof hs);
    dmo = dalloc(sizeof mo);
    dms = dalloc(sizeof ms);
    dput(dvv, hv, sizeof hv);
    dput(dss, hs, sizeof hs);
    kva_tensor v = kva_tensor_make(dvv, KVA_DTYPE_F32, 3, T, H, DD, 0);
    kva_tensor s = kva_tensor_make(dss, KVA_DTYPE_F32, 2, T, H, 0, 0);
    kva_tensor vo = kva_tensor_make(dmo, KVA_DTYPE_F32, 3, R, H, DD, 0);
    kva_tensor so = kva_tensor_make(dms, KVA_DTYPE_F32, 2, R, H, 0, 0);
    st = kva_merge_states(ctx, &v, &s, ip, R, &vo, &so, NULL);
    CHECK(st == KVA_OK, "merge_states: %s", kva_last_error_message());
    dsync();
    dget(mo, dmo, sizeof mo);
    dget(ms, dms, sizeof ms);
    bad = 0;
    for (int r = 0; r < R; ++r)
        for (int h = 0; h < H; ++h) {
            double m = -INFINITY, den = 0;
            for (int k = ip[r]; k < ip[r + 1]; ++k) m = fmax(m, hs[k * H + h]);
            for (int k = ip[r]; k < ip[r + 1]; ++k) den += isinf(hs[k * H + h]) ? 0 : exp2(hs[k * H + h] - m);
            double lse = den > 0 ? m + log2(den) : -INFINITY;
            if (isinf(lse) ? ms[r * H + h] != lse : fabs(ms[r * H + h] - lse) > 1e-4) bad++;
            for (int e = 0; e < DD; ++e) {
                double o = 0;
                for (int k = ip[r]; k < ip[r + 1]; ++k)
                    if (!isinf(hs[k * H + h])) o += exp2(hs[k * H + h] - m) / den * hv[(k * H + h) * DD + e];
                if (fabs(mo[(r * H + h) * DD + e] - o) > 1e-4) bad++;
            }
        }
    CHECK(bad == 0, "merge_states: %d mismatches", bad);
    /* merge_state in place: state 0 (+)= state 1 */
    kva_tensor va = kva_tensor_make(dvv, KVA_DTYPE_F32, 3, 1, H, DD, 0);
    kva_tensor sa = kva_tensor_make(dss, KVA_DTYPE_F32, 2, 1, H, 0, 0);
    kva_tensor vb = kva_tensor_make((float*)dvv + H * DD, KVA_DTYPE_F32, 3, 1, H, DD, 0);
    kva_tensor sb = kva_tensor_make((float*)dss + H, KVA_DTYPE_F32, 2, 1, H, 0, 0);
    st = kva_merge_state_in_place(ctx, &va, &sa, &vb, &sb, NULL, NULL);
    CHECK(st == KVA_OK, "merge_state_in_place: %s", kva_last_error_message());
    float v0[H * DD], s0[H];
    dsync();
    dget(v0, dvv, sizeof v0);
    dget(s0, dss, sizeof s0);
    bad = 0;
    for (int h = 0; h < H; ++h) {
        double m = fmax(hs[h], hs[H + h]);
        double wa = exp2(hs[h] - m), wb = isinf(hs[H + h]) ? 0 : exp2(hs[H + h] - m);
        if (fabs(s0[h] - (m + log2(wa + wb))) > 1e-4) bad++;
        for (int e = 0; e < DD; ++e)
            if (fabs(v0[h * DD + e] - (wa * hv[h * DD + e] + wb * hv[(H + h) * DD + e]) / (wa + wb)) > 1e-4) bad++;
    }
    CHECK(bad == 0, "merge_state_in_place: %d mismatches", bad);
    dfree(dvv);
    dfree(dss);
    dfree(dmo);
    dfree(dms);
}

/* ---------------------------------------------------------------------------------------------- */
/* BSR graph mode: capture a block-sparse run, re-plan another pattern into the same workspace (same indices and
   mask buffers, rewritten), replay, compare with a plain (non-graph) run of the new pattern. */

typedef struct bsr_pat {
    int32_t indptr[5];
    int32_t indices[4 * 32];
} bsr_pat;

static void bsr_pattern(bsr_pat* pt, int MB, int NB, int density) {
    pt->indptr[0] = 0;
    int n = 0;
    for (int b = 0; b < MB; ++b) {
        for (int j = 0; j < NB; ++j)
            if (rint_range(0, 99) < density) pt->indices[n++] = j;
        pt->indptr[b + 1] = n;
    }
}

static void test_bsr_graph(kva_context* ctx) {
    const int HQ = 8, HK = 2, D = 128, M = 64, N = 512, R = 16, C = 16, MB = 4, NB = 32;
    kva_attention_desc d;
    kva_attention_desc_init(&d, HQ, HK, D, KVA_DTYPE_BF16);
    d.mask_mode = KVA_MASK_CAUSAL;
    uint16_t* hq = (uint16_t*)malloc((size_t)M * HQ * D * 2);
    uint16_t* hk = (uint16_t*)malloc((size_t)N * HK * D * 2);
    uint16_t* hv = (uint16_t*)malloc((size_t)N * HK * D * 2);
    for (size_t i = 0; i < (size_t)M * HQ * D; ++i) rand_val(KVA_DTYPE_BF16, hq + i, 1.0);
    for (size_t i = 0; i < (size_t)N * HK * D; ++i) {
        rand_val(KVA_DTYPE_BF16, hk + i, 1.0);
        rand_val(KVA_DTYPE_BF16, hv + i, 1.0);
    }
    void* q = dalloc((size_t)M * HQ * D * 2);
    void* k = dalloc((size_t)N * HK * D * 2);
    void* v = dalloc((size_t)N * HK * D * 2);
    void* o_g = dalloc((size_t)M * HQ * D * 2);
    void* o_r = dalloc((size_t)M * HQ * D * 2);
    dput(q, hq, (size_t)M * HQ * D * 2);
    dput(k, hk, (size_t)N * HK * D * 2);
    dput(v, hv, (size_t)N * HK * D * 2);
    bsr_pat A, B;
    bsr_pattern(&A, MB, NB, 35);
    bsr_pattern(&B, MB, NB, 75);
    kva_bsr_params p;
    kva_bsr_params_init(&p);
    p.num_qo_rows = M;
    p.num_kv_rows = N;
    p.block_rows = R;
    p.block_cols = C;
    p.graph_mode = 1;
    p.indptr = A.indptr;
    p.indices = A.indices;
    size_t db = 0, hb = 0, db2 = 0, hb2 = 0;
    kva_status st = kva_bsr_workspace_size(ctx, &d, &p, &db, &hb);
    p.indptr = B.indptr;
    p.indices = B.indices;
    st = st == KVA_OK ? kva_bsr_workspace_size(ctx, &d, &p, &db2, &hb2) : st;
    CHECK(st == KVA_OK && db == db2 && hb == hb2, "bsr graph: workspace sizes depend only on the shape (%zu/%zu vs %zu/%zu)",
          db, hb, db2, hb2);
    kva_workspace ws = {dalloc(db), db, NULL, hb, NULL, 0};
    CU(cudaMallocHost(&ws.host, hb > 0 ? hb : 256));
    void* d_idx = dalloc(sizeof(int32_t) * MB * NB);
    p.indptr = A.indptr;
    p.indices = A.indices;
    kva_bsr_plan plan;
    st = kva_bsr_plan_make(ctx, &d, &p, &ws, &plan, NULL);
    CHECK(st == KVA_OK && plan.uses_mask, "bsr graph: plan A: %s", kva_last_error_message());
    void* d_mask = dalloc((size_t)plan.max_mask_bytes + 1);
    uint8_t* hmask = (uint8_t*)malloc((size_t)plan.max_mask_bytes + 1);
    size_t mb = 0;
    st = kva_bsr_mask_pack(&d, &p, hmask, (size_t)plan.max_mask_bytes, &mb);
    dput(d_idx, A.indices, sizeof(int32_t) * (size_t)A.indptr[MB]);
    dput(d_mask, hmask, mb);
    kva_bsr_run_args a;
    kva_bsr_run_args_init(&a);
    a.q = kva_tensor_make(q, KVA_DTYPE_BF16, 3, M, HQ, D, 0);
    a.k = kva_tensor_make(k, KVA_DTYPE_BF16, 3, N, HK, D, 0);
    a.v = kva_tensor_make(v, KVA_DTYPE_BF16, 3, N, HK, D, 0);
    a.o = kva_tensor_make(o_g, KVA_DTYPE_BF16, 3, M, HQ, D, 0);
    a.indices = (const int32_t*)d_idx;
    a.packed_mask = (const uint8_t*)d_mask;
    a.packed_mask_bytes = plan.max_mask_bytes; /* the buffer's size: enough for every pattern */
    cudaStream_t s;
    CU(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
    a.stream = s;
    CU(cudaStreamSynchronize(s));
    cudaGraph_t graph;
    cudaGraphExec_t exec;
    CU(cudaStreamBeginCapture(s, cudaStreamCaptureModeThreadLocal));
    st = kva_bsr_run(ctx, &plan, &ws, &a);
    CU(cudaStreamEndCapture(s, &graph));
    CHECK(st == KVA_OK, "bsr graph: run under capture: %s", kva_last_error_message());
    CU(cudaGraphInstantiate(&exec, graph, 0));
    CU(cudaGraphLaunch(exec, s));
    CU(cudaStreamSynchronize(s));
    /* pattern B into the same workspace and the same buffers, then replay */
    p.indptr = B.indptr;
    p.indices = B.indices;
    kva_bsr_plan planB;
    st = kva_bsr_plan_make(ctx, &d, &p, &ws, &planB, s);
    CHECK(st == KVA_OK && planB.mask_bytes <= plan.max_mask_bytes, "bsr graph: plan B: %s", kva_last_error_message());
    st = kva_bsr_mask_pack(&d, &p, hmask, (size_t)plan.max_mask_bytes, &mb);
    CU(cudaStreamSynchronize(s));
    dput(d_idx, B.indices, sizeof(int32_t) * (size_t)B.indptr[MB]);
    dput(d_mask, hmask, mb);
    dset(o_g, 0xff, (size_t)M * HQ * D * 2);
    CU(cudaGraphLaunch(exec, s));
    CU(cudaStreamSynchronize(s));
    /* reference: pattern B planned without graph mode into its own workspace and buffers */
    p.graph_mode = 0;
    st = kva_bsr_workspace_size(ctx, &d, &p, &db2, &hb2);
    kva_workspace ws2 = {dalloc(db2), db2, NULL, hb2, NULL, 0};
    CU(cudaMallocHost(&ws2.host, hb2 > 0 ? hb2 : 256));
    kva_bsr_plan planR;
    st = st == KVA_OK ? kva_bsr_plan_make(ctx, &d, &p, &ws2, &planR, s) : st;
    CHECK(st == KVA_OK, "bsr graph: reference plan: %s", kva_last_error_message());
    size_t mr = 0;
    kva_bsr_mask_pack(&d, &p, hmask, (size_t)plan.max_mask_bytes, &mr);
    void* d_idx2 = dalloc(sizeof(int32_t) * MB * NB);
    void* d_mask2 = dalloc(mr + 1);
    dput(d_idx2, B.indices, sizeof(int32_t) * (size_t)B.indptr[MB]);
    dput(d_mask2, hmask, mr);
    kva_bsr_run_args ar = a;
    ar.o = kva_tensor_make(o_r, KVA_DTYPE_BF16, 3, M, HQ, D, 0);
    ar.indices = (const int32_t*)d_idx2;
    ar.packed_mask = mr ? (const uint8_t*)d_mask2 : NULL;
    ar.packed_mask_bytes = (int64_t)mr;
    st = kva_bsr_run(ctx, &planR, &ws2, &ar);
    CHECK(st == KVA_OK, "bsr graph: reference run: %s", kva_last_error_message());
    CU(cudaStreamSynchronize(s));
    uint16_t* g1 = (uint16_t*)malloc((size_t)M * HQ * D * 2);
    uint16_t* g2 = (uint16_t*)malloc((size_t)M * HQ * D * 2);
    dget(g1, o_g, (size_t)M * HQ * D * 2);
    dget(g2, o_r, (size_t)M * HQ * D * 2);
    int bad = 0;
    double worst = 0;
    for (size_t i = 0; i < (size_t)M * HQ * D; ++i) {
        const double x = dec_bf16(g1[i]), y = dec_bf16(g2[i]);
        const double e = fabs(x - y);
        if (!(e <= tol_of(KVA_DTYPE_BF16) * (1.0 + fabs(y)))) bad++;
        if (e > worst || e != e) worst = e;
    }
    CHECK(bad == 0, "bsr graph: replay after re-planning pattern B matches a plain run of B (%d mismatches, worst %.3g)",
          bad, worst);
    if (verbose) printf("  bsr graph: nnz A %d, B %d, mask bytes %lld (max %lld), worst diff %.3g\n", A.indptr[MB],
                        B.indptr[MB], (long long)planB.mask_bytes, (long long)plan.max_mask_bytes, worst);
    cudaGraphExecDestroy(exec);
    cudaGraphDestroy(graph);
    CU(cudaStreamDestroy(s));
    cudaFreeHost(ws.host);
    cudaFreeHost(ws2.host);
    dfree(ws.device);
    dfree(ws2.device);
    dfree(q);
    dfree(k);
    dfree(v);
    dfree(o_g);
    dfree(o_r);
    dfree(d_idx);
    dfree(d_idx2);
    dfree(d_mask);
    dfree(d_mask2);
    free(hq);
    free(hk);
    free(hv);
    free(hmask);
    free(g1);
    free(g2);
}

/* KVATTN_JIT=0 on CUDA contexts (docs/errors.md): with an empty kernel cache, a decode plan that needs a kernel outside
   the prebuilt set (fused RoPE: the CUDA-core kernel, compiled by NVRTC) is UNSUPPORTED, naming the variable; with JIT
   allowed the same plan compiles into the cache and runs; a new context under KVATTN_JIT=0 then plans it from the
   cache and its run matches the reference. Creating a context sweeps temporary files older than an hour from the
   cache directory (what a compile killed long ago left) and keeps younger ones. */
static int touch_file(const char* path, long age_s) {
    FILE* f = fopen(path, "wb");
    if (!f) return 0;
    fputs("partial cubin", f);
    fclose(f);
    struct timeval tv[2];
    gettimeofday(&tv[0], NULL);
    tv[0].tv_sec -= age_s;
    tv[1] = tv[0];
    return utimes(path, tv) == 0;
}

static kva_status plan_status(kva_context* ctx, const tcase* c) {
    prob P;
    init_prob(&P, c);
    prob_build(&P);
    kva_plan_params pp;
    fill_params(&P, &pp);
    size_t db = 0, hb = 0;
    kva_status st = kva_plan_workspace_size(ctx, &P.d, c->op, &pp, &db, &hb);
    if (st == KVA_OK) {
        ws_t W;
        ws_alloc(ctx, &P.d, c->op, &pp, &W, 0, 0);
        kva_plan plan;
        st = kva_plan_make(ctx, &P.d, c->op, &pp, &W.w, &plan, NULL);
        ws_free(&W);
    }
    prob_free(&P);
    return st;
}

static void test_jit_off(const kva_context_options* base) {
    char dir[] = "/tmp/kvattn_selftest_jit_XXXXXX";
    if (!mkdtemp(dir)) {
        CHECK(0, "jit off: mkdtemp failed");
        return;
    }
    char stale[256], young[256];
    snprintf(stale, sizeof stale, "%s/.%s.tmp1234", dir, "0123456789abcdef0123456789abcdef");
    snprintf(young, sizeof young, "%s/.%s.tmp5678", dir, "fedcba9876543210fedcba9876543210");
    CHECK(touch_file(stale, 7200) && touch_file(young, 60), "jit off: temporary files created");
    kva_context_options opt = *base;
    opt.jit_cache_dir = dir;
    tcase c = base_case("jit off: fused RoPE decode");
    c.pos = KVA_POS_ROPE_LLAMA;
    c.hq = 12, c.hkv = 4, c.max_kv = 300;
    setenv("KVATTN_JIT", "0", 1);
    kva_context* c1 = NULL;
    kva_status st = kva_context_create(&opt, &c1);
    CHECK(st == KVA_OK, "jit off: context with KVATTN_JIT=0: %s", kva_last_error_message());
    CHECK(access(stale, F_OK) != 0 && access(young, F_OK) == 0,
          "jit off: context creation swept the stale temporary file (gone: %d) and kept the young one (kept: %d)",
          access(stale, F_OK) != 0, access(young, F_OK) == 0);
    if (st == KVA_OK) {
        st = plan_status(c1, &c);
        CHECK(st == KVA_ERR_UNSUPPORTED && strstr(kva_last_error_message(), "KVATTN_JIT"),
              "jit off: a kernel neither prebuilt nor cached is UNSUPPORTED naming KVATTN_JIT: %s (%s)",
              kva_status_string(st), kva_last_error_message());
        kva_context_destroy(c1);
    }
    unsetenv("KVATTN_JIT");
    kva_context* c2 = NULL;
    st = kva_context_create(&opt, &c2);
    CHECK(st == KVA_OK, "jit off: context with JIT allowed: %s", kva_last_error_message());
    if (st == KVA_OK) {
        st = plan_status(c2, &c);
        CHECK(st == KVA_OK, "jit off: the plan compiles with JIT allowed: %s", kva_last_error_message());
        kva_context_destroy(c2);
    }
    setenv("KVATTN_JIT", "0", 1);
    kva_context* c3 = NULL;
    st = kva_context_create(&opt, &c3);
    CHECK(st == KVA_OK, "jit off: second context with KVATTN_JIT=0: %s", kva_last_error_message());
    if (st == KVA_OK) {
        st = plan_status(c3, &c);
        CHECK(st == KVA_OK, "jit off: the cached kernel plans under KVATTN_JIT=0: %s", kva_last_error_message());
        if (st == KVA_OK) run_case(c3, &c); /* its run against the reference */
        kva_context_destroy(c3);
    }
    unsetenv("KVATTN_JIT");
    if (verbose) printf("  jit off: cache %s\n", dir);
}

int main(int argc, char** argv) {
    for (int i = 1; i < argc; ++i) {
        if (!strcmp(argv[i], "--quick")) quick = 1;
        else if (!strcmp(argv[i], "--cpu")) cpu_mode = 1;
        else if (!strcmp(argv[i], "--verbose") || !strcmp(argv[i], "-v")) verbose = 1;
        else if (!strcmp(argv[i], "--pdl-only")) pdl_only = 1;
        else if (!strcmp(argv[i], "--device") && i + 1 < argc) data_dev = atoi(argv[++i]);
        else if (!strcmp(argv[i], "--caller-device") && i + 1 < argc) call_dev = atoi(argv[++i]);
    }
    kva_context_options opt;
    kva_context_options_init(&opt);
    opt.backend = cpu_mode ? KVA_BACKEND_CPU : KVA_BACKEND_CUDA;
    if (cpu_mode) {
        data_dev = call_dev = -1;
    } else if (data_dev >= 0) {
        int n = 0;
        if (cudaGetDeviceCount(&n) != cudaSuccess || data_dev >= n) {
            printf("--device %d: the process sees %d CUDA device(s)\n0 passed, 1 failed\n", data_dev, n);
            return 1;
        }
        if (call_dev < 0 && data_dev > 0) call_dev = 0;
        if (call_dev >= n) call_dev = -1;
        CU(cudaSetDevice(data_dev));
        opt.device = data_dev;
        printf("context and buffers on device %d; decode-matrix calls made with device %d current\n", data_dev,
               call_dev >= 0 ? call_dev : data_dev);
    } else {
        call_dev = -1;
    }
    kva_context* ctx = NULL;
    kva_status st = kva_context_create(&opt, &ctx);
    if (st != KVA_OK) {
        printf("no CUDA context: %s\n", kva_last_error_message());
        printf("0 passed, 1 failed\n");
        return 1;
    }
    printf("kvattn CUDA selftest: %d workers%s\n", kva_context_num_workers(ctx), quick ? " (quick)" : "");
    if (!cpu_mode) {
        int dev = 0, major = 0, minor = 0;
        if (cudaGetDevice(&dev) == cudaSuccess &&
            cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, dev) == cudaSuccess &&
            cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, dev) == cudaSuccess)
            hg_device = major == 9 && minor == 0;
    }
    test_pdl(ctx, "eager plan", 0, 5, 7000);
    test_pdl(ctx, "graph-mode plan", 1, 5, 7000);
    test_pdl(ctx, "graph-mode plan, short", 1, 3, 1500); /* 24 units of <= 1500 tokens: clusters of 8 (H100, with
                                                            KVATTN_CUDA_CLUSTER=8) take it */
    if (pdl_only) {
        kva_context_destroy(ctx);
        printf("%d passed, %d failed\n", npass, nfail);
        return nfail ? 1 : 0;
    }
    test_decode_matrix(ctx);
    if (!cpu_mode) {
        test_fault(ctx, 0, 0, KVA_DTYPE_BF16, 0, 0);
        test_fault(ctx, 1, 0, KVA_DTYPE_BF16, 0, 0);
        test_fault(ctx, 1, 1, KVA_DTYPE_BF16, 0, 0);
        test_fault(ctx, 0, 0, KVA_DTYPE_BF16, 1, 0);
        test_fault(ctx, 1, 0, KVA_DTYPE_BF16, 1, 0);
        test_graph(ctx);
        test_bsr_graph(ctx);
    }
    test_append_and_merge(ctx);
    kva_context_destroy(ctx);
    if (!cpu_mode) test_threads(&opt);
    if (!cpu_mode && getenv("KVATTN_JIT") == NULL) test_jit_off(&opt);
    if (!cpu_mode) {
        /* head-group decode: contexts that take it wherever it is supported, with the fused merge and without */
        for (int nofused = 0; nofused < 2; ++nofused) {
            setenv("KVATTN_CUDA_DECODE_HG", "1", 1);
            if (nofused) setenv("KVATTN_BENCH_NO_FUSED_MERGE", "1", 1);
            kva_context* hctx = NULL;
            st = kva_context_create(&opt, &hctx);
            unsetenv("KVATTN_CUDA_DECODE_HG");
            unsetenv("KVATTN_BENCH_NO_FUSED_MERGE");
            CHECK(st == KVA_OK, "context with KVATTN_CUDA_DECODE_HG=1: %s", kva_last_error_message());
            if (st != KVA_OK) continue;
            printf("head-group decode (%s merge)%s\n", nofused ? "kernel" : "fused",
                   hg_device ? "" : ": not a compute capability 9.0 device, the plans keep one head per item");
            hg_ctx = 1;
            test_decode_hg(hctx, nofused);
            test_pdl(hctx, nofused ? "head groups, merge kernel" : "head groups", 0, 5, 7000);
            if (!nofused) {
                test_fault(hctx, 0, 0, KVA_DTYPE_BF16, 0, 0);
                test_fault(hctx, 1, 0, KVA_DTYPE_BF16, 0, 0);
                test_fault(hctx, 1, 1, KVA_DTYPE_BF16, 0, 0);
                test_fault(hctx, 0, 1, KVA_DTYPE_E4M3, 0, 0); /* fp8 KV in head groups */
                test_fault(hctx, 1, 0, KVA_DTYPE_E4M3, 0, 0);
                for (int hkv = 1; hkv <= 2; ++hkv) { /* row slots: groups of 32 and 16 */
                    test_fault(hctx, 0, 0, KVA_DTYPE_BF16, 0, hkv);
                    test_fault(hctx, 1, 1, KVA_DTYPE_BF16, 0, hkv);
                    test_fault(hctx, 1, 0, KVA_DTYPE_E4M3, 0, hkv);
                }
            }
            hg_ctx = 0;
            kva_context_destroy(hctx);
        }
    }
    printf("%d passed, %d failed\n", npass, nfail);
    return nfail ? 1 : 0;
}
