/* cpu_selftest.c - private self-test and micro-benchmark of the CPU backend (not part of the test suite).
 *
 * Build (after building the library in build-cpu):
 *   gcc -std=c11 -O2 -Wall -Wextra -I include -I src/core -I src/cpu src/cpu/selftest/cpu_selftest.c \
 *       build-cpu/libkvattn_static.a -lpthread -lm -o /tmp/cpu_selftest
 * Run: /tmp/cpu_selftest [quick|full|bench]
 *
 * Compares every op against a naive double-precision loop written here from the contract. */
#define _POSIX_C_SOURCE 200809L
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <pthread.h>

#include "cpu_internal.h"
#include "kvattn.h"

/* ---------------------------------------------------------------------------------------------- */
static uint64_t rng_state = 0x9e3779b97f4a7c15ull;
static uint64_t rnd(void) {
    uint64_t x = rng_state;
    x ^= x << 13;
    x ^= x >> 7;
    x ^= x << 17;
    return rng_state = x;
}
static double urand(void) { return (double)(rnd() >> 11) * (1.0 / 9007199254740992.0); }
static int irand(int lo, int hi) { return lo + (int)(rnd() % (uint64_t)(hi - lo + 1)); }

static int g_fail = 0, g_cases = 0;
static kva_context* g_ctx = NULL;
#define CHECK(cond, ...)                  \
    do {                                  \
        if (!(cond)) {                    \
            printf("FAIL %s:%d: ", __FILE__, __LINE__); \
            printf(__VA_ARGS__);          \
            printf("\n");                 \
            g_fail++;                     \
        }                                 \
    } while (0)

/* independent decoders */
static double dec_f16(uint16_t h) {
    int s = h >> 15, e = (h >> 10) & 31, m = h & 1023;
    double v;
    if (e == 31) v = m ? NAN : INFINITY;
    else if (e == 0) v = ldexp(m, -24);
    else v = ldexp(1024 + m, e - 25);
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
    double v;
    if (e == 15 && m == 7) return NAN;
    v = e == 0 ? ldexp(m, -9) : ldexp(8 + m, e - 10);
    return s ? -v : v;
}
static double dec_e5m2(uint8_t b) {
    int s = b >> 7, e = (b >> 2) & 31, m = b & 3;
    double v;
    if (e == 31) v = m ? NAN : INFINITY;
    else v = e == 0 ? ldexp(m, -16) : ldexp(4 + m, e - 17);
    return s ? -v : v;
}
static size_t esz(kva_dtype t) { return kva__cpu_dtype_size(t); }
static double dec(kva_dtype t, const void* p, int64_t i) {
    switch (t) {
    case KVA_DTYPE_F32: return ((const float*)p)[i];
    case KVA_DTYPE_F16: return dec_f16(((const uint16_t*)p)[i]);
    case KVA_DTYPE_BF16: return dec_bf16(((const uint16_t*)p)[i]);
    case KVA_DTYPE_E4M3: return dec_e4m3(((const uint8_t*)p)[i]);
    case KVA_DTYPE_E5M2: return dec_e5m2(((const uint8_t*)p)[i]);
    default: return NAN;
    }
}
static void enc(kva_dtype t, void* p, int64_t i, float x) {
    switch (t) {
    case KVA_DTYPE_F32: ((float*)p)[i] = x; break;
    case KVA_DTYPE_F16: ((uint16_t*)p)[i] = kva__cpu_f32_to_f16(x); break;
    case KVA_DTYPE_BF16: ((uint16_t*)p)[i] = kva__cpu_f32_to_bf16(x); break;
    case KVA_DTYPE_E4M3: ((uint8_t*)p)[i] = kva__cpu_f32_to_e4m3(x); break;
    case KVA_DTYPE_E5M2: ((uint8_t*)p)[i] = kva__cpu_f32_to_e5m2(x); break;
    default: break;
    }
}
static void poison(kva_dtype t, void* p, int64_t i) { enc(t, p, i, NAN); }

static const char* dtn(kva_dtype t) { return kva_dtype_name(t); }

/* ---------------------------------------------------------------------------------------------- */
/* Conversion tests                                                                                 */

static double nearest_in(const double* vals, int n, double x, int* idx) {
    /* RNE among a sorted positive list: nearest, ties -> even index (even mantissa) */
    int best = 0;
    for (int i = 1; i < n; ++i) {
        double d0 = fabs(vals[best] - x), d1 = fabs(vals[i] - x);
        if (d1 < d0 || (d1 == d0 && (i % 2) == 0)) best = i;
    }
    *idx = best;
    return vals[best];
}

static void test_convert(void) {
    kva__cpu_convert_init();
    for (uint32_t h = 0; h < 65536; ++h) {
        double a = kva__cpu_f16_to_f32((uint16_t)h), b = dec_f16((uint16_t)h);
        CHECK((isnan(a) && isnan(b)) || a == b, "f16 decode %04x: %g vs %g", h, a, b);
        if (!isnan(b)) CHECK(kva__cpu_f32_to_f16((float)b) == h, "f16 roundtrip %04x", h);
    }
    /* f32 -> f16 RNE on midpoints and random values */
    for (int it = 0; it < 200000; ++it) {
        uint16_t h = (uint16_t)(rnd() & 0x7bff);
        double lo = dec_f16(h), hi = dec_f16((uint16_t)(h + 1));
        double mid = 0.5 * (lo + hi);
        uint16_t want = (h & 1) ? (uint16_t)(h + 1) : h;
        if ((float)mid == mid) CHECK(kva__cpu_f32_to_f16((float)mid) == want, "f16 tie %04x", h);
        float x = (float)(lo + (hi - lo) * urand());
        uint16_t r = kva__cpu_f32_to_f16(x);
        double dl = fabs(x - lo), dh = fabs(hi - x);
        uint16_t w2 = dl < dh ? h : dl > dh ? (uint16_t)(h + 1) : want;
        CHECK(r == w2, "f16 rne %.9g -> %04x want %04x", x, r, w2);
    }
    CHECK(kva__cpu_f32_to_f16(65520.0f) == 0x7c00, "f16 overflow");
    CHECK(kva__cpu_f32_to_f16(65519.0f) == 0x7bff, "f16 max");
    CHECK(kva__cpu_f32_to_bf16(1.0f + 1.0f / 256.0f) == 0x3f80, "bf16 tie even");
    CHECK(kva__cpu_f32_to_bf16(1.0f + 3.0f / 256.0f) == 0x3f82, "bf16 tie even up");
    CHECK(isnan(dec_bf16(kva__cpu_f32_to_bf16(NAN))), "bf16 nan");
    /* fp8 tables vs independent decode; encode by nearest search */
    double p4[127], p5[124];
    for (int i = 0; i < 127; ++i) p4[i] = dec_e4m3((uint8_t)i);
    for (int i = 0; i < 124; ++i) p5[i] = dec_e5m2((uint8_t)i);
    for (int i = 0; i < 256; ++i) {
        double a = kva__cpu_e4m3_table[i], b = dec_e4m3((uint8_t)i);
        CHECK((isnan(a) && isnan(b)) || a == b, "e4m3 table %02x", i);
        a = kva__cpu_e5m2_table[i];
        b = dec_e5m2((uint8_t)i);
        CHECK((isnan(a) && isnan(b)) || a == b, "e5m2 table %02x", i);
    }
    for (int it = 0; it < 100000; ++it) {
        float x = (float)(urand() * 500.0 * (urand() < 0.5 ? 1e-3 : 1.0));
        int idx;
        nearest_in(p4, 127, x, &idx);
        if (x >= 448.0f) idx = 0x7e;
        CHECK(kva__cpu_f32_to_e4m3(x) == idx, "e4m3 enc %.9g -> %02x want %02x", x, kva__cpu_f32_to_e4m3(x), idx);
        CHECK(kva__cpu_f32_to_e4m3(-x) == (idx | 0x80) || (x == 0 && kva__cpu_f32_to_e4m3(-x) == 0x80), "e4m3 neg");
        float y = (float)(urand() * 60000.0 * (urand() < 0.5 ? 1e-4 : 1.0));
        nearest_in(p5, 124, y, &idx);
        if (y >= 57344.0f) idx = 0x7b;
        CHECK(kva__cpu_f32_to_e5m2(y) == idx, "e5m2 enc %.9g -> %02x want %02x", y, kva__cpu_f32_to_e5m2(y), idx);
    }
    for (int i = 0; i < 127; ++i) CHECK(kva__cpu_f32_to_e4m3((float)p4[i]) == i, "e4m3 exact %d", i);
    for (int i = 0; i < 124; ++i) CHECK(kva__cpu_f32_to_e5m2((float)p5[i]) == i, "e5m2 exact %d", i);
    CHECK(kva__cpu_f32_to_e4m3(1e9f) == 0x7e && kva__cpu_f32_to_e4m3(-INFINITY) == 0xfe, "e4m3 sat");
    CHECK(kva__cpu_f32_to_e5m2(INFINITY) == 0x7b, "e5m2 sat");
    CHECK(kva__cpu_f32_to_e4m3(NAN) == 0x7f, "e4m3 nan");
    /* vector kernels' load/store agree with the scalar path for every dtype */
#if defined(KVA__CPU_HAVE_AVX2)
    if (strcmp(kva__cpu_kernel_name(g_ctx), "avx2") == 0) {
        const kva__cpu_kernels* K = &kva__cpu_kernels_avx2;
        kva_dtype dts[5] = {KVA_DTYPE_F32, KVA_DTYPE_F16, KVA_DTYPE_BF16, KVA_DTYPE_E4M3, KVA_DTYPE_E5M2};
        for (int di = 0; di < 5; ++di) {
            uint8_t raw[4 * 300];
            for (int i = 0; i < (int)sizeof raw; ++i) raw[i] = (uint8_t)rnd();
            float a[300], b[300];
            K->load_row(dts[di], raw, a, 299, 300, 0.5f);
            kva__cpu_load_row_scalar(dts[di], raw, b, 299, 300, 0.5f);
            for (int i = 0; i < 300; ++i)
                CHECK((isnan(a[i]) && isnan(b[i])) || a[i] == b[i], "avx2 load %s [%d] %g vs %g", dtn(dts[di]), i, a[i],
                      b[i]);
            if (di < 3) {
                float src[300];
                for (int i = 0; i < 300; ++i) src[i] = (float)((urand() - 0.5) * 1e5 * urand());
                src[7] = NAN;
                uint8_t o1[1200], o2[1200];
                K->store_row(dts[di], src, o1, 300, 0.75f);
                kva__cpu_store_row_scalar(dts[di], src, o2, 300, 0.75f);
                for (int i = 0; i < 300; ++i) {
                    double x = dec(dts[di], o1, i), y = dec(dts[di], o2, i);
                    CHECK((isnan(x) && isnan(y)) || x == y, "avx2 store %s [%d] %g vs %g", dtn(dts[di]), i, x, y);
                }
            }
        }
        /* exp / sigmoid / softcap accuracy */
        float x[64], y[64];
        for (int i = 0; i < 64; ++i) x[i] = y[i] = (float)(-90.0 + 100.0 * urand());
        x[3] = y[3] = -INFINITY;
        float s = K->exp_sum(x, 64, 0.0f);
        double sr = 0;
        for (int i = 0; i < 64; ++i) {
            double e = y[i] == -INFINITY ? 0.0 : exp((double)y[i]);
            sr += e;
            CHECK(fabs(x[i] - e) <= 2e-7 * e + 1e-37, "exp(%g) = %g vs %g", y[i], x[i], e);
        }
        CHECK(fabs(s - sr) <= 1e-6 * sr, "exp sum");
        for (int i = 0; i < 64; ++i) x[i] = y[i] = (float)(-30.0 + 60.0 * urand());
        K->softcap(x, 64, 7.5f);
        for (int i = 0; i < 64; ++i) CHECK(fabs(x[i] - 7.5 * tanh(y[i] / 7.5)) < 2e-6, "softcap %g", y[i]);
        for (int i = 0; i < 64; ++i) x[i] = y[i];
        x[5] = -INFINITY;
        K->sigmoid(x, 64, 0.25f);
        for (int i = 0; i < 64; ++i)
            CHECK(i == 5 ? x[i] == 0.0f : fabs(x[i] - 1.0 / (1.0 + exp(-(y[i] + 0.25)))) < 1e-6, "sigmoid %g", y[i]);
    }
#endif
}

/* ---------------------------------------------------------------------------------------------- */
/* Attention tests                                                                                  */

typedef struct tcase {
    kva_op op;
    int B;
    int qo[64], kv[64];
    int Hq, Hk, Dqk, Dvo;
    kva_dtype qdt, kvdt, odt;
    int page_size;
    int layout; /* 0 NHD, 1 HND, 2 interleaved [pages][2][ps][H][D] */
    kva_mask_mode mask;
    int window;
    float softcap;
    kva_pos_encoding pos;
    kva_score_mode score;
    float sig_bias;
    int fixed_split;
    int use_lse;
    int custom_slopes;
    float k_scale, v_scale;
    int padded; /* pad q/o/k/v row and head strides */
    float rope_theta, rope_scale, sm_scale;
    int poison_masked; /* custom mask: one key column masked for every row holds NaN/inf K and V */
} tcase;

static double ref_slope(int h, int n, const float* custom) { return custom ? custom[h] : kva__alibi_slope(h, n); }

static void rope_d(double* x, int D, double pos, double theta, double scale) {
    int half = D / 2;
    for (int f = 0; f < half; ++f) {
        double inv = pow(theta, -2.0 * f / D) / scale, a = pos * inv;
        double c = cos(a), s = sin(a), x0 = x[f], x1 = x[f + half];
        x[f] = x0 * c - x1 * s;
        x[f + half] = x1 * c + x0 * s;
    }
}

/* returns 0 on pass */
static int run_attn_case(kva_context* ctx, const tcase* tc, const char* label) {
    g_cases++;
    const int B = tc->B, Hq = tc->Hq, Hk = tc->Hk, Dq = tc->Dqk, Dv = tc->Dvo, g = Hq / Hk;
    const int paged = tc->op != KVA_OP_BATCH_PREFILL_RAGGED;
    const int ps = paged ? tc->page_size : 1;
    int32_t qo_indptr[65], kv_indptr[65], lpl[64];
    int64_t total_rows = 0, total_kv = 0;
    qo_indptr[0] = 0;
    kv_indptr[0] = 0;
    for (int b = 0; b < B; ++b) {
        qo_indptr[b + 1] = qo_indptr[b] + tc->qo[b];
        int np = paged ? (tc->kv[b] + ps - 1) / ps : tc->kv[b];
        kv_indptr[b + 1] = kv_indptr[b] + np;
        lpl[b] = paged && tc->kv[b] > 0 ? tc->kv[b] - (np - 1) * ps : 0;
        total_rows += tc->qo[b];
        total_kv += tc->kv[b];
    }
    const int64_t entries = kv_indptr[B];
    const int64_t num_pages = paged ? entries + 3 : 0;
    /* q, o with optional padded strides */
    const int64_t qhs = Dq + (tc->padded ? 3 : 0), qrs = Hq * qhs + (tc->padded ? 5 : 0);
    const int64_t ohs = Dv + (tc->padded ? 2 : 0), ors = Hq * ohs + (tc->padded ? 7 : 0);
    void* q = calloc((size_t)(total_rows * qrs + 1), esz(tc->qdt));
    void* o = calloc((size_t)(total_rows * ors + 1), esz(tc->odt));
    float* lse = (float*)calloc((size_t)(total_rows * Hq + 1), sizeof(float));
    for (int64_t i = 0; i < total_rows * qrs; ++i) poison(tc->qdt, q, i);
    for (int64_t r = 0; r < total_rows; ++r)
        for (int h = 0; h < Hq; ++h)
            for (int d = 0; d < Dq; ++d) enc(tc->qdt, q, r * qrs + h * qhs + d, (float)(urand() * 2 - 1));
    for (int64_t i = 0; i < total_rows * ors; ++i) enc(tc->odt, o, i, 12345.0f);
    for (int64_t i = 0; i < total_rows * Hq; ++i) lse[i] = 777.0f;

    /* K/V storage */
    void *kd = NULL, *vd = NULL;
    kva_paged_kv pk;
    memset(&pk, 0, sizeof pk);
    int32_t* indices = NULL;
    int64_t kst = 0, ksh = 0, ksp = 0, vst = 0, vsh = 0, vsp = 0; /* element strides */
    int64_t ktot, vtot;
    if (paged) {
        const int64_t dmax = Dq > Dv ? Dq : Dv;
        if (tc->layout == 2) { /* [pages][2][ps][H][dmax] */
            ksp = vsp = 2 * ps * Hk * dmax;
            kst = vst = Hk * dmax;
            ksh = vsh = dmax;
            ktot = num_pages * ksp;
            kd = calloc((size_t)ktot, esz(tc->kvdt));
            vd = (char*)kd + (size_t)(ps * Hk * dmax) * esz(tc->kvdt);
            vtot = ktot - ps * Hk * dmax;
        } else {
            int64_t pad = tc->padded ? 1 : 0;
            if (tc->layout == 0) {
                ksh = Dq + pad;
                kst = Hk * ksh;
                ksp = ps * kst + pad;
                vsh = Dv + pad;
                vst = Hk * vsh;
                vsp = ps * vst;
            } else {
                kst = Dq + pad;
                ksh = ps * kst;
                ksp = Hk * ksh + pad;
                vst = Dv;
                vsh = ps * vst + pad;
                vsp = Hk * vsh;
            }
            ktot = num_pages * ksp;
            vtot = num_pages * vsp;
            kd = calloc((size_t)ktot, esz(tc->kvdt));
            vd = calloc((size_t)vtot, esz(tc->kvdt));
        }
        for (int64_t i = 0; i < ktot; ++i) poison(tc->kvdt, kd, i);
        if (tc->layout != 2)
            for (int64_t i = 0; i < vtot; ++i) poison(tc->kvdt, vd, i);
        /* page table: a random permutation of pages */
        int32_t* perm = (int32_t*)malloc(sizeof(int32_t) * (size_t)num_pages);
        for (int64_t i = 0; i < num_pages; ++i) perm[i] = (int32_t)i;
        for (int64_t i = num_pages - 1; i > 0; --i) {
            int64_t j = (int64_t)(rnd() % (uint64_t)(i + 1));
            int32_t t = perm[i];
            perm[i] = perm[j];
            perm[j] = t;
        }
        indices = (int32_t*)malloc(sizeof(int32_t) * (size_t)(entries + 1));
        for (int64_t e = 0; e < entries; ++e) indices[e] = perm[e];
        free(perm);
        pk.k_data = kd;
        pk.v_data = vd;
        pk.dtype = tc->kvdt;
        pk.num_pages = num_pages;
        pk.page_size = ps;
        pk.num_heads = Hk;
        pk.head_dim_qk = Dq;
        pk.head_dim_vo = Dv;
        pk.k_stride_page = ksp;
        pk.k_stride_token = kst;
        pk.k_stride_head = ksh;
        pk.v_stride_page = vsp;
        pk.v_stride_token = vst;
        pk.v_stride_head = vsh;
        pk.indices = indices;
    } else {
        ksh = Dq + (tc->padded ? 1 : 0);
        kst = Hk * ksh + (tc->padded ? 3 : 0);
        vsh = Dv + (tc->padded ? 2 : 0);
        vst = Hk * vsh;
        ktot = total_kv * kst + 1;
        vtot = total_kv * vst + 1;
        kd = calloc((size_t)ktot, esz(tc->kvdt));
        vd = calloc((size_t)vtot, esz(tc->kvdt));
        for (int64_t i = 0; i < ktot; ++i) poison(tc->kvdt, kd, i);
        for (int64_t i = 0; i < vtot; ++i) poison(tc->kvdt, vd, i);
    }
    /* element offset of (request b, token j, head h) */
#define KOFF(b, j, h)                                                                                        \
    (paged ? (int64_t)indices[kv_indptr[b] + (j) / ps] * ksp + ((j) % ps) * kst + (h) * ksh                  \
           : ((int64_t)kv_indptr[b] + (j)) * kst + (h) * ksh)
#define VOFF(b, j, h)                                                                                        \
    (paged ? (int64_t)indices[kv_indptr[b] + (j) / ps] * vsp + ((j) % ps) * vst + (h) * vsh                  \
           : ((int64_t)kv_indptr[b] + (j)) * vst + (h) * vsh)
    const int fp8 = tc->kvdt == KVA_DTYPE_E4M3 || tc->kvdt == KVA_DTYPE_E5M2;
    const float kamp = fp8 ? 4.0f : 1.0f;
    for (int b = 0; b < B; ++b)
        for (int j = 0; j < tc->kv[b]; ++j)
            for (int h = 0; h < Hk; ++h) {
                for (int d = 0; d < Dq; ++d) enc(tc->kvdt, kd, KOFF(b, j, h) + d, (float)((urand() * 2 - 1) * kamp));
                for (int d = 0; d < Dv; ++d) enc(tc->kvdt, vd, VOFF(b, j, h) + d, (float)((urand() * 2 - 1) * kamp));
            }
    /* custom mask */
    int64_t mask_bytes = 0, moff[64];
    for (int b = 0; b < B; ++b) {
        moff[b] = mask_bytes;
        mask_bytes += ((int64_t)tc->qo[b] * tc->kv[b] + 7) / 8;
    }
    uint8_t* mask = (uint8_t*)malloc((size_t)mask_bytes + 1);
    for (int64_t i = 0; i < mask_bytes + 1; ++i) mask[i] = (uint8_t)(rnd() & rnd()); /* ~25% visible */
    float slopes[256];
    for (int h = 0; h < Hq; ++h) slopes[h] = (float)(0.05 + 0.5 * urand());
    if (tc->poison_masked && tc->mask == KVA_MASK_CUSTOM)
        for (int b = 0; b < B; ++b) {
            if (tc->kv[b] == 0) continue;
            const int jc = tc->kv[b] / 2;
            for (int i = 0; i < tc->qo[b]; ++i) {
                int64_t bit = (int64_t)i * tc->kv[b] + jc;
                mask[moff[b] + bit / 8] &= (uint8_t)~(1u << (bit % 8));
            }
            for (int h = 0; h < Hk; ++h) {
                for (int d = 0; d < Dq; ++d) enc(tc->kvdt, kd, KOFF(b, jc, h) + d, d % 2 ? NAN : INFINITY);
                for (int d = 0; d < Dv; ++d) enc(tc->kvdt, vd, VOFF(b, jc, h) + d, d % 2 ? INFINITY : NAN);
            }
        }

    /* plan */
    kva_attention_desc desc;
    kva_attention_desc_init(&desc, Hq, Hk, Dq, tc->kvdt);
    desc.head_dim_vo = Dv;
    desc.q_dtype = tc->qdt;
    desc.o_dtype = tc->odt;
    desc.kv_dtype = tc->kvdt;
    desc.mask_mode = tc->mask;
    desc.window_left = tc->window;
    desc.logits_soft_cap = tc->softcap;
    desc.pos_encoding = tc->pos;
    desc.score_mode = tc->score;
    desc.sigmoid_bias = tc->sig_bias;
    desc.rope_theta = tc->rope_theta;
    desc.rope_scale = tc->rope_scale;
    desc.sm_scale = tc->sm_scale;
    kva_plan_params pp;
    kva_plan_params_init(&pp);
    pp.batch_size = B;
    pp.qo_indptr = tc->op == KVA_OP_BATCH_DECODE ? NULL : qo_indptr;
    pp.kv_indptr = kv_indptr;
    pp.kv_last_page_len = paged ? lpl : NULL;
    pp.page_size = ps;
    pp.num_pages = num_pages;
    pp.fixed_split_size = tc->fixed_split;
    size_t dev = 0, host = 0;
    kva_status st = kva_plan_workspace_size(ctx, &desc, tc->op, &pp, &dev, &host);
    int bad = 0;
    if (st != KVA_OK) {
        printf("FAIL %s: workspace size: %s\n", label, kva_last_error_message());
        g_fail++;
        return 1;
    }
    kva_workspace ws;
    memset(&ws, 0, sizeof ws);
    ws.device_bytes = kva__align_up(dev + 256, 256);
    ws.device = aligned_alloc(256, ws.device_bytes);
    kva_plan plan;
    st = kva_plan_make(ctx, &desc, tc->op, &pp, &ws, &plan, NULL);
    if (st != KVA_OK) {
        printf("FAIL %s: plan: %s\n", label, kva_last_error_message());
        g_fail++;
        return 1;
    }
    kva_plan_info info;
    kva_plan_get_info(&plan, &info);
    kva_run_args args;
    kva_run_args_init(&args);
    args.q.data = q;
    args.q.dtype = tc->qdt;
    args.q.ndim = 3;
    args.q.shape[0] = total_rows;
    args.q.shape[1] = Hq;
    args.q.shape[2] = Dq;
    args.q.stride[0] = qrs;
    args.q.stride[1] = qhs;
    args.q.stride[2] = 1;
    args.o = args.q;
    args.o.data = o;
    args.o.dtype = tc->odt;
    args.o.shape[2] = Dv;
    args.o.stride[0] = ors;
    args.o.stride[1] = ohs;
    if (tc->use_lse) args.lse = kva_tensor_make(lse, KVA_DTYPE_F32, 2, total_rows, Hq, 0, 0);
    if (paged) {
        args.paged = pk;
    } else {
        args.k.data = kd;
        args.k.dtype = tc->kvdt;
        args.k.ndim = 3;
        args.k.shape[0] = total_kv;
        args.k.shape[1] = Hk;
        args.k.shape[2] = Dq;
        args.k.stride[0] = kst;
        args.k.stride[1] = ksh;
        args.k.stride[2] = 1;
        args.v = args.k;
        args.v.data = vd;
        args.v.shape[2] = Dv;
        args.v.stride[0] = vst;
        args.v.stride[1] = vsh;
    }
    args.custom_mask = mask;
    args.custom_mask_bytes = mask_bytes;
    args.alibi_slopes = tc->custom_slopes ? slopes : NULL;
    args.k_scale = tc->k_scale;
    args.v_scale = tc->v_scale;
    st = kva_run(ctx, &plan, &ws, &args);
    if (st != KVA_OK) {
        printf("FAIL %s: run: %s\n", label, kva_last_error_message());
        g_fail++;
        bad = 1;
    }

    /* reference */
    const double sm = tc->sm_scale > 0 ? tc->sm_scale : 1.0 / sqrt((double)Dq);
    const double theta = tc->rope_theta > 0 ? tc->rope_theta : 1e4, rscale = tc->rope_scale > 0 ? tc->rope_scale : 1.0;
    const double ks = tc->k_scale, vs = tc->v_scale;
    double max_err = 0.0, max_lse_err = 0.0;
    const double otol = tc->odt == KVA_DTYPE_F32 ? 2e-4 : tc->odt == KVA_DTYPE_F16 ? 2e-3 : 1.6e-2;
    double* qv = (double*)malloc(sizeof(double) * (size_t)Dq);
    double* kvb = (double*)malloc(sizeof(double) * (size_t)Dq);
    int maxkv = 1;
    for (int b = 0; b < B; ++b) maxkv = tc->kv[b] > maxkv ? tc->kv[b] : maxkv;
    double* x = (double*)malloc(sizeof(double) * (size_t)maxkv);
    char* vis = (char*)malloc((size_t)maxkv);
    double* acc = (double*)malloc(sizeof(double) * (size_t)Dv);
    for (int b = 0; b < B && !bad; ++b) {
        const int qo = tc->qo[b], kv = tc->kv[b];
        for (int i = 0; i < qo; ++i) {
            const int64_t qpos = (int64_t)kv - qo + i;
            const int64_t row = qo_indptr[b] + i;
            for (int qh = 0; qh < Hq; ++qh) {
                const int kh = qh / g;
                for (int d = 0; d < Dq; ++d) qv[d] = dec(tc->qdt, q, row * qrs + qh * qhs + d);
                if (tc->pos == KVA_POS_ROPE_LLAMA) rope_d(qv, Dq, (double)qpos, theta, rscale);
                double mx = -INFINITY;
                for (int j = 0; j < kv; ++j) {
                    int v = 1;
                    if (tc->mask == KVA_MASK_CAUSAL && j > qpos) v = 0;
                    if (tc->window >= 0 && j < qpos - tc->window) v = 0;
                    if (tc->mask == KVA_MASK_CUSTOM) {
                        int64_t bit = (int64_t)i * kv + j;
                        if (!((mask[moff[b] + bit / 8] >> (bit % 8)) & 1)) v = 0;
                    }
                    vis[j] = (char)v;
                    if (!v) continue;
                    for (int d = 0; d < Dq; ++d) kvb[d] = dec(tc->kvdt, kd, KOFF(b, j, kh) + d) * ks;
                    if (tc->pos == KVA_POS_ROPE_LLAMA) rope_d(kvb, Dq, (double)j, theta, rscale);
                    double dot = 0;
                    for (int d = 0; d < Dq; ++d) dot += qv[d] * kvb[d];
                    double xx = sm * dot;
                    if (tc->pos == KVA_POS_ALIBI) xx += ref_slope(qh, Hq, tc->custom_slopes ? slopes : NULL) * (double)(j - qpos);
                    if (tc->softcap > 0) xx = tc->softcap * tanh(xx / tc->softcap);
                    x[j] = xx;
                    if (xx > mx) mx = xx;
                }
                for (int d = 0; d < Dv; ++d) acc[d] = 0;
                double den = 0, lse_ref = -INFINITY;
                for (int j = 0; j < kv; ++j) {
                    if (!vis[j]) continue;
                    double p = tc->score == KVA_SCORE_SIGMOID ? 1.0 / (1.0 + exp(-(x[j] + tc->sig_bias))) : exp(x[j] - mx);
                    den += p;
                    for (int d = 0; d < Dv; ++d) acc[d] += p * dec(tc->kvdt, vd, VOFF(b, j, kh) + d) * vs;
                }
                if (tc->score == KVA_SCORE_SOFTMAX) {
                    if (den > 0) {
                        for (int d = 0; d < Dv; ++d) acc[d] /= den;
                        lse_ref = (mx + log(den)) / log(2.0);
                    }
                }
                double scale = fabs(vs) * kamp;
                if (tc->score == KVA_SCORE_SIGMOID) scale *= (den > 1 ? den : 1);
                for (int d = 0; d < Dv; ++d) {
                    double got = dec(tc->odt, o, row * ors + qh * ohs + d);
                    double err = fabs(got - acc[d]) / scale;
                    if (!(err <= otol)) { /* also catches NaN */
                        if (max_err <= otol)
                            printf("  %s: b %d i %d qh %d d %d: got %g want %g\n", label, b, i, qh, d, got, acc[d]);
                        max_err = isnan(err) ? INFINITY : err > max_err ? err : max_err;
                        if (isnan(err)) max_err = INFINITY;
                    } else if (err > max_err)
                        max_err = err;
                }
                if (tc->use_lse) {
                    double got = lse[row * Hq + qh];
                    double err = (got == lse_ref) ? 0.0 : fabs(got - lse_ref);
                    if (!(err <= 2e-3)) {
                        if (max_lse_err <= 2e-3)
                            printf("  %s: lse b %d i %d qh %d: got %g want %g\n", label, b, i, qh, got, lse_ref);
                        max_lse_err = isnan(err) ? INFINITY : err;
                    } else if (err > max_lse_err)
                        max_lse_err = err;
                }
            }
        }
    }
    /* padding of o must be untouched */
    if (tc->padded && !bad && tc->odt == KVA_DTYPE_F32)
        for (int64_t r = 0; r < total_rows; ++r)
            for (int64_t e = 0; e < ors; ++e) {
                int64_t h = e / ohs, d = e % ohs;
                if ((h >= Hq || d >= Dv) && ((float*)o)[r * ors + e] != 12345.0f) {
                    if (!bad) printf("  %s: o padding overwritten\n", label);
                    bad = 1;
                }
            }
    if (max_err > otol || max_lse_err > 2e-3 || bad) {
        printf("FAIL %s: max err %.3g (tol %.3g), lse err %.3g [tile_q %d items %d merges %d chunk %d]\n", label,
               max_err, otol, max_lse_err, info.tile_q, info.num_work_items, info.num_merge_tasks, info.kv_chunk_size);
        g_fail++;
    } else if (getenv("VERBOSE")) {
        printf("ok   %s: err %.3g lse %.3g [tile_q %d items %d merges %d chunk %d]\n", label, max_err, max_lse_err,
               info.tile_q, info.num_work_items, info.num_merge_tasks, info.kv_chunk_size);
    }
    free(qv);
    free(kvb);
    free(x);
    free(vis);
    free(acc);
    free(q);
    free(o);
    free(lse);
    free(kd);
    if (!(paged && tc->layout == 2)) free(vd);
    free(indices);
    free(mask);
    free(ws.device);
#undef KOFF
#undef VOFF
    return max_err > otol || bad;
}

static void base_case(tcase* tc) {
    memset(tc, 0, sizeof *tc);
    tc->op = KVA_OP_BATCH_PREFILL_PAGED;
    tc->Hq = 8;
    tc->Hk = 2;
    tc->Dqk = tc->Dvo = 64;
    tc->qdt = tc->odt = tc->kvdt = KVA_DTYPE_F32;
    tc->page_size = 16;
    tc->window = -1;
    tc->use_lse = 1;
    tc->k_scale = tc->v_scale = 1.0f;
}

static void random_lengths(tcase* tc, int B, int maxq, int maxkv, int allow_empty) {
    tc->B = B;
    for (int b = 0; b < B; ++b) {
        tc->kv[b] = irand(allow_empty ? 0 : 1, maxkv);
        tc->qo[b] = tc->op == KVA_OP_BATCH_DECODE ? 1 : irand(allow_empty ? 0 : 1, maxq);
    }
}

static void test_attention(kva_context* ctx, int full) {
    char label[512];
    const kva_dtype fdt[3] = {KVA_DTYPE_F32, KVA_DTYPE_F16, KVA_DTYPE_BF16};
    const kva_dtype kdt[5] = {KVA_DTYPE_F32, KVA_DTYPE_F16, KVA_DTYPE_BF16, KVA_DTYPE_E4M3, KVA_DTYPE_E5M2};
    const int groups[3][2] = {{4, 4}, {6, 2}, {16, 2}}; /* g = 1, 3, 8 */
    const int psizes[3] = {1, 3, 16};
    const kva_op ops[3] = {KVA_OP_BATCH_DECODE, KVA_OP_BATCH_PREFILL_PAGED, KVA_OP_BATCH_PREFILL_RAGGED};
    int n = 0;
    /* sweep: op x group x page size x layout x dtype, variants rotated */
    for (int oi = 0; oi < 3; ++oi)
        for (int gi = 0; gi < 3; ++gi)
            for (int pi = 0; pi < 3; ++pi)
                for (int li = 0; li < 3; ++li) {
                    if (ops[oi] == KVA_OP_BATCH_PREFILL_RAGGED && (pi > 0 || li > 0)) continue;
                    for (int variant = 0; variant < (full ? 9 : 3); ++variant, ++n) {
                        tcase tc;
                        base_case(&tc);
                        tc.op = ops[oi];
                        tc.Hq = groups[gi][0];
                        tc.Hk = groups[gi][1];
                        tc.page_size = psizes[pi];
                        tc.layout = li;
                        tc.qdt = fdt[n % 3];
                        tc.odt = fdt[(n / 3) % 3];
                        tc.kvdt = kdt[n % 5];
                        int dims[6] = {64, 128, 40, 8, 96, 256};
                        tc.Dqk = dims[n % 6];
                        tc.Dvo = (n % 7 == 3) ? 24 : tc.Dqk;
                        tc.padded = n % 2;
                        tc.k_scale = (tc.kvdt == KVA_DTYPE_E4M3 || tc.kvdt == KVA_DTYPE_E5M2) ? 0.37f : (n % 4 == 1 ? 1.3f : 1.0f);
                        tc.v_scale = (tc.kvdt == KVA_DTYPE_E4M3 || tc.kvdt == KVA_DTYPE_E5M2) ? 1.7f : (n % 4 == 1 ? 0.6f : 1.0f);
                        switch (variant) {
                        case 0: break;
                        case 1: tc.mask = KVA_MASK_CAUSAL; break;
                        case 2:
                            tc.mask = tc.op == KVA_OP_BATCH_DECODE ? KVA_MASK_NONE : KVA_MASK_CUSTOM;
                            tc.pos = KVA_POS_ROPE_LLAMA;
                            if (tc.Dqk % 2) tc.Dqk++;
                            break;
                        case 3: tc.window = irand(0, 40); tc.mask = KVA_MASK_CAUSAL; break;
                        case 4: tc.pos = KVA_POS_ALIBI; tc.custom_slopes = n % 2; tc.softcap = 5.0f; break;
                        case 5: tc.score = KVA_SCORE_SIGMOID; tc.sig_bias = -1.5f; tc.use_lse = 0; tc.mask = KVA_MASK_CAUSAL; break;
                        case 6: tc.pos = KVA_POS_ROPE_LLAMA; tc.rope_theta = 5e5f; tc.rope_scale = 2.0f; tc.mask = KVA_MASK_CAUSAL; tc.window = 100; break;
                        case 7: tc.softcap = 2.0f; tc.sm_scale = 0.3f; tc.use_lse = 1; break;
                        case 8: tc.mask = KVA_MASK_CAUSAL; tc.pos = KVA_POS_ALIBI; tc.score = KVA_SCORE_SIGMOID; tc.use_lse = 0; break;
                        }
                        int B = irand(1, 6);
                        int long_kv = (n % 4 == 0);
                        random_lengths(&tc, B, tc.op == KVA_OP_BATCH_DECODE ? 1 : 70, long_kv ? 900 : 150, n % 3 == 0);
                        tc.fixed_split = (n % 5 == 1) ? 128 : 0;
                        snprintf(label, sizeof label,
                                 "op%d Hq%d Hk%d ps%d lay%d q%s kv%s o%s D%d/%d pad%d var%d B%d split%d", (int)tc.op,
                                 tc.Hq, tc.Hk, tc.page_size, tc.layout, dtn(tc.qdt), dtn(tc.kvdt), dtn(tc.odt), tc.Dqk,
                                 tc.Dvo, tc.padded, variant, tc.B, tc.fixed_split);
                        run_attn_case(ctx, &tc, label);
                    }
                }
    /* specific: long prefill causal with 128-row tiles and split, all rows empty requests mixed */
    {
        tcase tc;
        base_case(&tc);
        tc.mask = KVA_MASK_CAUSAL;
        tc.B = 3;
        tc.qo[0] = 300; tc.kv[0] = 700;
        tc.qo[1] = 0; tc.kv[1] = 50;
        tc.qo[2] = 5; tc.kv[2] = 0;
        tc.fixed_split = 128;
        run_attn_case(ctx, &tc, "prefill causal long + empty");
        tc.qo[0] = 40; tc.kv[0] = 20; /* qo > kv: first rows see nothing */
        tc.fixed_split = 0;
        run_attn_case(ctx, &tc, "prefill causal qo>kv");
        tc.Dqk = 512; tc.Dvo = 512; tc.Hq = 2; tc.Hk = 1; tc.kvdt = KVA_DTYPE_BF16; tc.qdt = KVA_DTYPE_BF16;
        tc.qo[0] = 130; tc.kv[0] = 300;
        run_attn_case(ctx, &tc, "D512");
        tc.Dqk = 1; tc.Dvo = 3; tc.Hq = 3; tc.Hk = 3; tc.mask = KVA_MASK_NONE;
        run_attn_case(ctx, &tc, "D1");
    }
    {
        tcase tc;
        base_case(&tc);
        tc.Hq = 32; /* g = 16: prefill tiles of 16 packed rows hold one query row each */
        tc.Hk = 2;
        tc.mask = KVA_MASK_CAUSAL;
        tc.window = 7;
        random_lengths(&tc, 4, 40, 300, 0);
        run_attn_case(ctx, &tc, "prefill g16 causal window");
        tc.window = -1;
        tc.mask = KVA_MASK_CUSTOM;
        tc.poison_masked = 1;
        for (int k = 0; k < 3; ++k) {
            tc.kvdt = k == 0 ? KVA_DTYPE_F32 : k == 1 ? KVA_DTYPE_E5M2 : KVA_DTYPE_BF16;
            tc.Hq = k == 2 ? 4 : 32; /* g = 2: 16-row tiles take the f32 block path */
            random_lengths(&tc, 4, 40, 300, 0);
            run_attn_case(ctx, &tc, "custom mask, NaN/inf in a fully masked key");
        }
        tc.op = KVA_OP_BATCH_PREFILL_RAGGED;
        tc.Hq = 2;
        run_attn_case(ctx, &tc, "ragged custom mask, NaN/inf in a fully masked key");
    }
    {
        tcase tc;
        base_case(&tc);
        tc.op = KVA_OP_BATCH_DECODE;
        tc.Hq = 32; tc.Hk = 8; tc.Dqk = tc.Dvo = 128;
        tc.kvdt = tc.qdt = tc.odt = KVA_DTYPE_BF16;
        random_lengths(&tc, 16, 1, 3000, 0);
        run_attn_case(ctx, &tc, "decode 32/8 bf16 long");
        tc.fixed_split = 256;
        run_attn_case(ctx, &tc, "decode 32/8 bf16 long split");
        tc.Hq = 128; tc.Hk = 1; /* g = 128 */
        tc.fixed_split = 0;
        random_lengths(&tc, 3, 1, 500, 1);
        run_attn_case(ctx, &tc, "decode g128");
    }
}

/* ---------------------------------------------------------------------------------------------- */
/* Error paths: out-of-range page index leaves outputs untouched                                   */

static void test_page_errors(kva_context* ctx) {
    const int Hq = 4, Hk = 2, D = 16, ps = 4, B = 3;
    int32_t kv_indptr[4] = {0, 2, 3, 5}, lpl[3] = {4, 1, 2}, indices[5] = {0, 1, 2, 3, 4};
    float* pool = (float*)calloc(12 * ps * Hk * D, sizeof(float));
    float q[3 * Hq * D], o[3 * Hq * D], lse[3 * Hq];
    for (int i = 0; i < 3 * Hq * D; ++i) q[i] = 0.1f, o[i] = 55.0f;
    for (int i = 0; i < 3 * Hq; ++i) lse[i] = 66.0f;
    kva_attention_desc desc;
    kva_attention_desc_init(&desc, Hq, Hk, D, KVA_DTYPE_F32);
    kva_plan_params pp;
    kva_plan_params_init(&pp);
    pp.batch_size = B;
    pp.kv_indptr = kv_indptr;
    pp.kv_last_page_len = lpl;
    pp.page_size = ps;
    pp.num_pages = 6;
    size_t dev;
    kva_plan_workspace_size(ctx, &desc, KVA_OP_BATCH_DECODE, &pp, &dev, NULL);
    kva_workspace ws = {aligned_alloc(256, kva__align_up(dev, 256)), kva__align_up(dev, 256), NULL, 0};
    kva_plan plan;
    kva_status st = kva_plan_make(ctx, &desc, KVA_OP_BATCH_DECODE, &pp, &ws, &plan, NULL);
    CHECK(st == KVA_OK, "plan: %s", kva_last_error_message());
    kva_run_args a;
    kva_run_args_init(&a);
    a.q = kva_tensor_make(q, KVA_DTYPE_F32, 3, 3, Hq, D, 0);
    a.o = kva_tensor_make(o, KVA_DTYPE_F32, 3, 3, Hq, D, 0);
    a.lse = kva_tensor_make(lse, KVA_DTYPE_F32, 2, 3, Hq, 0, 0);
    kva_paged_kv_init(&a.paged, pool, pool + 6 * ps * Hk * D, KVA_DTYPE_F32, KVA_LAYOUT_NHD, 6, ps, Hk, D, D);
    a.paged.num_pages = 6;
    indices[4] = 6; /* out of range, used by request 2 */
    a.paged.indices = indices;
    st = kva_run(ctx, &plan, &ws, &a);
    CHECK(st == KVA_ERR_PAGE_INDEX_OUT_OF_RANGE, "bad page: status %d", (int)st);
    if (getenv("VERBOSE")) printf("  message: %s\n", kva_last_error_message());
    for (int i = 0; i < 3 * Hq * D; ++i) CHECK(o[i] == 55.0f, "o touched");
    for (int i = 0; i < 3 * Hq; ++i) CHECK(lse[i] == 66.0f, "lse touched");
    indices[4] = -1;
    CHECK(kva_run(ctx, &plan, &ws, &a) == KVA_ERR_PAGE_INDEX_OUT_OF_RANGE, "negative page");
    indices[4] = 4;
    CHECK(kva_run(ctx, &plan, &ws, &a) == KVA_OK, "good run: %s", kva_last_error_message());
    kva_fault_report fr;
    CHECK(kva_read_faults(ctx, &ws, &fr, NULL) == KVA_OK && fr.faulted == 0 && fr.request == -1, "faults");
    free(ws.device);
    free(pool);
}

/* ---------------------------------------------------------------------------------------------- */
/* merge_state / merge_states                                                                       */

static void test_merge(kva_context* ctx) {
    const int R = 37, H = 5, D = 700; /* D > 512 exercises the chunking */
    const kva_dtype dts[3] = {KVA_DTYPE_F32, KVA_DTYPE_F16, KVA_DTYPE_BF16};
    for (int di = 0; di < 3; ++di) {
        kva_dtype dt = dts[di];
        void* va = malloc((size_t)R * H * D * 4);
        void* vb = malloc((size_t)R * H * D * 4);
        void* vo = malloc((size_t)R * H * D * 4);
        float *sa = malloc(sizeof(float) * R * H), *sb = malloc(sizeof(float) * R * H), *so = malloc(sizeof(float) * R * H);
        double* vac = malloc(sizeof(double) * R * H * D);
        for (int i = 0; i < R * H * D; ++i) {
            enc(dt, va, i, (float)(urand() * 2 - 1));
            enc(dt, vb, i, (float)(urand() * 2 - 1));
        }
        for (int i = 0; i < R * H; ++i) {
            sa[i] = (float)(urand() * 20 - 10);
            sb[i] = (float)(urand() * 20 - 10);
            if (i % 7 == 0) sa[i] = -INFINITY;
            if (i % 11 == 0) sb[i] = -INFINITY;
            if (i % 7 == 0) /* empty state may hold garbage */
                for (int d = 0; d < D; ++d) poison(dt, va, (int64_t)i * D + d);
        }
        for (int i = 0; i < R * H * D; ++i) vac[i] = dec(dt, va, i);
        kva_tensor ta = kva_tensor_make(va, dt, 3, R, H, D, 0), tb = kva_tensor_make(vb, dt, 3, R, H, D, 0),
                   to = kva_tensor_make(vo, KVA_DTYPE_F32, 3, R, H, D, 0);
        kva_tensor tsa = kva_tensor_make(sa, KVA_DTYPE_F32, 2, R, H, 0, 0), tsb = kva_tensor_make(sb, KVA_DTYPE_F32, 2, R, H, 0, 0),
                   tso = kva_tensor_make(so, KVA_DTYPE_F32, 2, R, H, 0, 0);
        kva_status st = kva_merge_state(ctx, &ta, &tsa, &tb, &tsb, &to, &tso, NULL);
        CHECK(st == KVA_OK, "merge_state: %s", kva_last_error_message());
        double tol = dt == KVA_DTYPE_F32 ? 1e-5 : dt == KVA_DTYPE_F16 ? 2e-3 : 1.6e-2;
        for (int i = 0; i < R * H; ++i) {
            double A = sa[i], Bv = sb[i], M = A > Bv ? A : Bv;
            double wa = A == -INFINITY ? 0 : exp2(A - M), wb = Bv == -INFINITY ? 0 : exp2(Bv - M);
            double lse = M == -INFINITY ? -INFINITY : M + log2(wa + wb);
            CHECK(so[i] == lse || fabs(so[i] - lse) < 1e-4, "merge lse %d: %g vs %g", i, so[i], lse);
            for (int d = 0; d < D; ++d) {
                double want = M == -INFINITY ? 0.0
                                             : ((wa ? wa * dec(dt, va, (int64_t)i * D + d) : 0) +
                                                (wb ? wb * dec(dt, vb, (int64_t)i * D + d) : 0)) / (wa + wb);
                double got = ((float*)vo)[(int64_t)i * D + d];
                if (!(fabs(got - want) < 1e-5)) {
                    CHECK(0, "merge v %s row %d d %d: %g vs %g", dtn(dt), i, d, got, want);
                    break;
                }
            }
        }
        /* in place with mask, output dtype = input dtype */
        uint8_t mask[R];
        for (int r = 0; r < R; ++r) mask[r] = (uint8_t)(r % 3 != 0);
        float* sa0 = malloc(sizeof(float) * R * H);
        memcpy(sa0, sa, sizeof(float) * R * H);
        st = kva_merge_state_in_place(ctx, &ta, &tsa, &tb, &tsb, mask, NULL);
        CHECK(st == KVA_OK, "merge in place: %s", kva_last_error_message());
        for (int i = 0; i < R * H; ++i) {
            int r = i / H;
            double A = sa0[i], Bv = sb[i], M = A > Bv ? A : Bv;
            if (!mask[r]) {
                CHECK(sa[i] == sa0[i] || (isnan(sa[i]) && isnan(sa0[i])), "masked row s changed");
                for (int d = 0; d < D; ++d) {
                    double a0 = vac[(int64_t)i * D + d], a1 = dec(dt, va, (int64_t)i * D + d);
                    if (!((isnan(a0) && isnan(a1)) || a0 == a1)) {
                        CHECK(0, "masked row v changed");
                        break;
                    }
                }
                continue;
            }
            double wa = A == -INFINITY ? 0 : exp2(A - M), wb = Bv == -INFINITY ? 0 : exp2(Bv - M);
            for (int d = 0; d < D; ++d) {
                double want = M == -INFINITY ? 0.0
                                             : ((wa ? wa * vac[(int64_t)i * D + d] : 0) +
                                                (wb ? wb * dec(dt, vb, (int64_t)i * D + d) : 0)) / (wa + wb);
                double got = dec(dt, va, (int64_t)i * D + d);
                if (!(fabs(got - want) <= tol * (1 + fabs(want)))) {
                    CHECK(0, "merge in place %s row %d d %d: %g vs %g", dtn(dt), i, d, got, want);
                    break;
                }
            }
        }
        free(sa0);
        /* merge_states: rows with 0..4 states, in f32 out of dt input */
        int32_t indptr[R + 1];
        indptr[0] = 0;
        for (int r = 0; r < R; ++r) indptr[r + 1] = indptr[r] + (r % 5 == 2 ? 0 : irand(1, 4));
        int total = indptr[R];
        void* vv = malloc((size_t)total * H * D * 4);
        float* ss = malloc(sizeof(float) * (size_t)total * H);
        for (int i = 0; i < total * H * D; ++i) enc(dt, vv, i, (float)(urand() * 2 - 1));
        for (int i = 0; i < total * H; ++i) ss[i] = (i % 9 == 4) ? -INFINITY : (float)(urand() * 30 - 15);
        for (int i = 0; i < total * H; ++i)
            if (ss[i] == -INFINITY)
                for (int d = 0; d < D; ++d) poison(dt, vv, (int64_t)i * D + d);
        kva_tensor tv = kva_tensor_make(vv, dt, 3, total, H, D, 0), ts = kva_tensor_make(ss, KVA_DTYPE_F32, 2, total, H, 0, 0);
        st = kva_merge_states(ctx, &tv, &ts, indptr, R, &to, &tso, NULL);
        CHECK(st == KVA_OK, "merge_states: %s", kva_last_error_message());
        for (int r = 0; r < R; ++r)
            for (int h = 0; h < H; ++h) {
                double M = -INFINITY;
                for (int k = indptr[r]; k < indptr[r + 1]; ++k) M = ss[k * H + h] > M ? ss[k * H + h] : M;
                double W = 0;
                for (int k = indptr[r]; k < indptr[r + 1]; ++k)
                    if (ss[k * H + h] != -INFINITY) W += exp2(ss[k * H + h] - M);
                double lse = M == -INFINITY ? -INFINITY : M + log2(W);
                CHECK(so[r * H + h] == lse || fabs(so[r * H + h] - lse) < 1e-4, "merge_states lse r %d h %d: %g vs %g", r, h,
                      so[r * H + h], lse);
                for (int d = 0; d < D; ++d) {
                    double want = 0;
                    if (M != -INFINITY)
                        for (int k = indptr[r]; k < indptr[r + 1]; ++k)
                            if (ss[k * H + h] != -INFINITY)
                                want += exp2(ss[k * H + h] - M) / W * dec(dt, vv, ((int64_t)k * H + h) * D + d);
                    double got = ((float*)vo)[((int64_t)r * H + h) * D + d];
                    if (!(fabs(got - want) < 2e-5)) {
                        CHECK(0, "merge_states %s r %d h %d d %d: %g vs %g", dtn(dt), r, h, d, got, want);
                        break;
                    }
                }
            }
        free(vv);
        free(ss);
        free(va);
        free(vb);
        free(vo);
        free(sa);
        free(sb);
        free(so);
        free(vac);
    }
}

/* ---------------------------------------------------------------------------------------------- */
/* append                                                                                           */

static void test_append(kva_context* ctx) {
    const int H = 3, Dq = 40, Dv = 24, ps = 5, B = 3, NP = 12;
    const kva_dtype pdts[5] = {KVA_DTYPE_F32, KVA_DTYPE_F16, KVA_DTYPE_BF16, KVA_DTYPE_E4M3, KVA_DTYPE_E5M2};
    for (int pi = 0; pi < 5; ++pi)
        for (int si = 0; si < 2; ++si) {
            kva_dtype pdt = pdts[pi], adt = si ? KVA_DTYPE_F32 : pdt;
            int32_t indptr[4] = {0, 3, 3, 7}, lpl[3] = {2, 0, 5}, indices[7] = {4, 0, 7, 11, 2, 9, 1};
            size_t es = esz(pdt);
            char* kp = calloc((size_t)NP * ps * H * Dq, es);
            char* vp = calloc((size_t)NP * H * ps * Dv, es);
            kva_paged_kv pk;
            kva_paged_kv_init(&pk, kp, vp, pdt, KVA_LAYOUT_NHD, NP, ps, H, Dq, Dv);
            /* V in HND */
            pk.v_stride_head = ps * Dv;
            pk.v_stride_token = Dv;
            pk.indices = indices;
            pk.indptr = indptr;
            pk.last_page_len = lpl;
            int nnz = 6;
            int32_t bi[6] = {0, 0, 2, 2, 2, 0}, pos[6] = {11, 0, 19, 3, 10, 5};
            float* ak = malloc(sizeof(float) * nnz * H * Dq);
            float* av = malloc(sizeof(float) * nnz * H * Dv);
            void* akd = malloc(4 * (size_t)nnz * H * Dq);
            void* avd = malloc(4 * (size_t)nnz * H * Dv);
            for (int i = 0; i < nnz * H * Dq; ++i) {
                ak[i] = (float)(urand() * 8 - 4);
                enc(adt, akd, i, ak[i]);
            }
            for (int i = 0; i < nnz * H * Dv; ++i) {
                av[i] = (float)(urand() * 8 - 4);
                enc(adt, avd, i, av[i]);
            }
            kva_tensor tk = kva_tensor_make(akd, adt, 3, nnz, H, Dq, 0), tv = kva_tensor_make(avd, adt, 3, nnz, H, Dv, 0);
            kva_status st = kva_append_paged_kv_cache(ctx, &tk, &tv, bi, pos, nnz, &pk, B, NULL);
            if (adt != pdt && st == KVA_ERR_UNSUPPORTED) {
                /* conversion refused by the core */
            } else {
                CHECK(st == KVA_OK, "append %s<-%s: %s", dtn(pdt), dtn(adt), kva_last_error_message());
                for (int i = 0; i < nnz; ++i) {
                    int b = bi[i], p = pos[i];
                    int page = indices[indptr[b] + p / ps], slot = p % ps;
                    for (int h = 0; h < H; ++h) {
                        for (int d = 0; d < Dq; ++d) {
                            double got = dec(pdt, kp, ((int64_t)page * ps * H + slot * H + h) * Dq + d);
                            char tmp[4];
                            enc(pdt, tmp, 0, (float)dec(adt, akd, ((int64_t)i * H + h) * Dq + d));
                            double want = dec(pdt, tmp, 0);
                            if (got != want) {
                                CHECK(0, "append k %s<-%s tok %d h %d d %d: %g vs %g", dtn(pdt), dtn(adt), i, h, d, got, want);
                                break;
                            }
                        }
                        for (int d = 0; d < Dv; ++d) {
                            double got = dec(pdt, vp, (int64_t)page * H * ps * Dv + h * ps * Dv + slot * Dv + d);
                            char tmp[4];
                            enc(pdt, tmp, 0, (float)dec(adt, avd, ((int64_t)i * H + h) * Dv + d));
                            double want = dec(pdt, tmp, 0);
                            if (got != want) {
                                CHECK(0, "append v %s tok %d: %g vs %g", dtn(pdt), i, got, want);
                                break;
                            }
                        }
                    }
                }
            }
            /* errors: nothing written */
            char* snap = malloc((size_t)NP * ps * H * Dq * es);
            memcpy(snap, kp, (size_t)NP * ps * H * Dq * es);
            pos[5] = 15; /* request 0 has length 12 */
            CHECK(kva_append_paged_kv_cache(ctx, &tk, &tv, bi, pos, nnz, &pk, B, NULL) == KVA_ERR_PAGE_INDEX_OUT_OF_RANGE,
                  "append position out of range");
            pos[5] = 5;
            bi[2] = 1; /* request 1 is empty */
            CHECK(kva_append_paged_kv_cache(ctx, &tk, &tv, bi, pos, nnz, &pk, B, NULL) == KVA_ERR_PAGE_INDEX_OUT_OF_RANGE,
                  "append to empty request");
            bi[2] = 3;
            CHECK(kva_append_paged_kv_cache(ctx, &tk, &tv, bi, pos, nnz, &pk, B, NULL) == KVA_ERR_INVALID_ARGUMENT,
                  "append batch index");
            bi[2] = 2;
            indices[6] = 12;
            CHECK(kva_append_paged_kv_cache(ctx, &tk, &tv, bi, pos, nnz, &pk, B, NULL) == KVA_ERR_PAGE_INDEX_OUT_OF_RANGE,
                  "append page out of pool");
            indices[6] = 1;
            indptr[2] = 8;
            CHECK(kva_append_paged_kv_cache(ctx, &tk, &tv, bi, pos, nnz, &pk, B, NULL) == KVA_ERR_PAGETABLE_MALFORMED,
                  "append indptr");
            indptr[2] = 3;
            lpl[2] = 6;
            CHECK(kva_append_paged_kv_cache(ctx, &tk, &tv, bi, pos, nnz, &pk, B, NULL) == KVA_ERR_PAGETABLE_MALFORMED,
                  "append last_page_len");
            lpl[2] = 5;
            CHECK(memcmp(snap, kp, (size_t)NP * ps * H * Dq * es) == 0, "append error wrote to the pool");
            free(snap);
            free(kp);
            free(vp);
            free(ak);
            free(av);
            free(akd);
            free(avd);
        }
}

/* ---------------------------------------------------------------------------------------------- */
/* two application threads sharing one context: results equal the sequential ones bit for bit      */

typedef struct conc_arg {
    kva_context* ctx;
    const kva_plan* plan;
    const kva_workspace* ws;
    kva_run_args args;
    const float* want;
    int64_t n;
    int bad;
} conc_arg;

static void* conc_main(void* p) {
    conc_arg* a = (conc_arg*)p;
    for (int it = 0; it < 30; ++it) {
        memset(a->args.o.data, 0, sizeof(float) * (size_t)a->n);
        if (kva_run(a->ctx, a->plan, a->ws, &a->args) != KVA_OK) a->bad = 1;
        if (memcmp(a->args.o.data, a->want, sizeof(float) * (size_t)a->n) != 0) a->bad = 1;
    }
    return NULL;
}

static void test_concurrent(kva_context* ctx) {
    const int B = 4, Hq = 8, Hk = 2, D = 64, ps = 8, kv = 700;
    const int npb = (kv + ps - 1) / ps;
    const int64_t NP = (int64_t)B * npb, n = (int64_t)B * Hq * D;
    float* kp = malloc(sizeof(float) * (size_t)(NP * ps * Hk * D));
    float* vp = malloc(sizeof(float) * (size_t)(NP * ps * Hk * D));
    for (int64_t i = 0; i < NP * ps * Hk * D; ++i) kp[i] = (float)urand(), vp[i] = (float)urand();
    int32_t* ind = malloc(sizeof(int32_t) * (size_t)NP);
    for (int64_t i = 0; i < NP; ++i) ind[i] = (int32_t)i;
    int32_t kvi[5], lpl[4];
    for (int b = 0; b <= B; ++b) kvi[b] = b * npb;
    for (int b = 0; b < B; ++b) lpl[b] = kv - (npb - 1) * ps;
    kva_attention_desc d;
    kva_attention_desc_init(&d, Hq, Hk, D, KVA_DTYPE_F32);
    kva_plan_params pp;
    kva_plan_params_init(&pp);
    pp.batch_size = B;
    pp.kv_indptr = kvi;
    pp.kv_last_page_len = lpl;
    pp.page_size = ps;
    pp.num_pages = NP;
    pp.fixed_split_size = 128; /* exercise partials and merges too */
    size_t dev;
    kva_plan_workspace_size(ctx, &d, KVA_OP_BATCH_DECODE, &pp, &dev, NULL);
    kva_workspace ws = {aligned_alloc(256, kva__align_up(dev, 256)), kva__align_up(dev, 256), NULL, 0};
    kva_plan plan;
    CHECK(kva_plan_make(ctx, &d, KVA_OP_BATCH_DECODE, &pp, &ws, &plan, NULL) == KVA_OK, "conc plan");
    float* q = malloc(sizeof(float) * (size_t)n);
    for (int64_t i = 0; i < n; ++i) q[i] = (float)urand();
    float* want = malloc(sizeof(float) * (size_t)n);
    conc_arg a[2];
    for (int k = 0; k < 2; ++k) {
        memset(&a[k], 0, sizeof a[k]);
        a[k].ctx = ctx;
        a[k].plan = &plan;
        a[k].ws = &ws;
        a[k].want = want;
        a[k].n = n;
        kva_run_args_init(&a[k].args);
        a[k].args.q = kva_tensor_make(q, KVA_DTYPE_F32, 3, B, Hq, D, 0);
        a[k].args.o = kva_tensor_make(malloc(sizeof(float) * (size_t)n), KVA_DTYPE_F32, 3, B, Hq, D, 0);
        kva_paged_kv_init(&a[k].args.paged, kp, vp, KVA_DTYPE_F32, KVA_LAYOUT_NHD, NP, ps, Hk, D, D);
        a[k].args.paged.indices = ind;
    }
    kva_run_args r0 = a[0].args;
    r0.o.data = want;
    CHECK(kva_run(ctx, &plan, &ws, &r0) == KVA_OK, "conc run");
    pthread_t th[2];
    for (int k = 0; k < 2; ++k) pthread_create(&th[k], NULL, conc_main, &a[k]);
    for (int k = 0; k < 2; ++k) pthread_join(th[k], NULL);
    CHECK(!a[0].bad && !a[1].bad, "concurrent runs on one context differ from the sequential result");
    for (int k = 0; k < 2; ++k) free(a[k].args.o.data);
    free(kp);
    free(vp);
    free(ind);
    free(q);
    free(want);
    free(ws.device);
}

/* ---------------------------------------------------------------------------------------------- */
/* benchmark                                                                                        */

static double now_s(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec + ts.tv_nsec * 1e-9;
}

static void bench_decode(kva_context* ctx, int B, int kvlen, int Hq, int Hk, int D, kva_dtype dt, int ps, int qo,
                         int causal, const char* name) {
    const int npb = (kvlen + ps - 1) / ps;
    const int64_t NP = (int64_t)B * npb;
    size_t es = esz(dt);
    char* kp = malloc((size_t)NP * ps * Hk * D * es);
    char* vp = malloc((size_t)NP * ps * Hk * D * es);
    for (int64_t i = 0; i < NP * ps * Hk * D; ++i) {
        enc(dt, kp, i, (float)(urand() - 0.5));
        enc(dt, vp, i, (float)(urand() - 0.5));
    }
    int32_t* indices = malloc(sizeof(int32_t) * (size_t)NP);
    for (int64_t i = 0; i < NP; ++i) indices[i] = (int32_t)((i * 7919) % NP);
    int32_t kv_indptr[257], lpl[256], qo_indptr[257];
    for (int b = 0; b <= B; ++b) kv_indptr[b] = b * npb, qo_indptr[b] = b * qo;
    for (int b = 0; b < B; ++b) lpl[b] = kvlen - (npb - 1) * ps;
    kva_op op = qo == 1 && !causal ? KVA_OP_BATCH_DECODE : KVA_OP_BATCH_PREFILL_PAGED;
    kva_attention_desc desc;
    kva_attention_desc_init(&desc, Hq, Hk, D, dt);
    if (causal) desc.mask_mode = KVA_MASK_CAUSAL;
    kva_plan_params pp;
    kva_plan_params_init(&pp);
    pp.batch_size = B;
    pp.qo_indptr = op == KVA_OP_BATCH_DECODE ? NULL : qo_indptr;
    pp.kv_indptr = kv_indptr;
    pp.kv_last_page_len = lpl;
    pp.page_size = ps;
    pp.num_pages = NP;
    size_t dev;
    kva_plan_workspace_size(ctx, &desc, op, &pp, &dev, NULL);
    kva_workspace ws = {aligned_alloc(256, kva__align_up(dev, 256)), kva__align_up(dev, 256), NULL, 0};
    kva_plan plan;
    if (kva_plan_make(ctx, &desc, op, &pp, &ws, &plan, NULL) != KVA_OK) {
        printf("bench plan failed: %s\n", kva_last_error_message());
        return;
    }
    int64_t rows = (int64_t)B * qo;
    void* q = malloc((size_t)rows * Hq * D * es);
    void* o = malloc((size_t)rows * Hq * D * es);
    for (int64_t i = 0; i < rows * Hq * D; ++i) enc(dt, q, i, (float)(urand() - 0.5));
    kva_run_args a;
    kva_run_args_init(&a);
    a.q = kva_tensor_make(q, dt, 3, rows, Hq, D, 0);
    a.o = kva_tensor_make(o, dt, 3, rows, Hq, D, 0);
    kva_paged_kv_init(&a.paged, kp, vp, dt, KVA_LAYOUT_NHD, NP, ps, Hk, D, D);
    a.paged.indices = indices;
    kva_plan_info info;
    kva_plan_get_info(&plan, &info);
    for (int i = 0; i < 3; ++i) kva_run(ctx, &plan, &ws, &a);
    int iters = 0;
    double t0 = now_s(), t;
    do {
        kva_run(ctx, &plan, &ws, &a);
        iters++;
        t = now_s() - t0;
    } while (t < 1.0);
    double per = t / iters;
    double bytes = 2.0 * B * kvlen * Hk * D * es;
    double flops = 4.0 * rows * Hq * (double)kvlen * D * (causal ? 0.5 : 1.0);
    printf("%-44s %8.3f ms/call  %6.2f GB/s KV  %6.1f GFLOP/s  [tile_q %d items %d merges %d]\n", name, per * 1e3,
           bytes / per / 1e9, flops / per / 1e9, info.tile_q, info.num_work_items, info.num_merge_tasks);
    free(q);
    free(o);
    free(kp);
    free(vp);
    free(indices);
    free(ws.device);
}

int main(int argc, char** argv) {
    const char* mode = argc > 1 ? argv[1] : "quick";
    int threads = argc > 2 ? atoi(argv[2]) : 2;
    kva_context_options opt;
    kva_context_options_init(&opt);
    opt.backend = KVA_BACKEND_CPU;
    opt.num_threads = threads;
    kva_context* ctx = NULL;
    if (kva_context_create(&opt, &ctx) != KVA_OK) {
        printf("context: %s\n", kva_last_error_message());
        return 1;
    }
    g_ctx = ctx;
    printf("kernels: %s, threads %d\n", kva__cpu_kernel_name(ctx), threads);
    if (strcmp(mode, "bench") == 0) {
        bench_decode(ctx, 16, 1024, 32, 8, 128, KVA_DTYPE_BF16, 16, 1, 0, "decode B16 kv1k 32/8 D128 bf16 ps16");
        bench_decode(ctx, 16, 1024, 32, 8, 128, KVA_DTYPE_BF16, 1, 1, 0, "decode B16 kv1k 32/8 D128 bf16 ps1");
        bench_decode(ctx, 16, 1024, 32, 8, 128, KVA_DTYPE_F16, 16, 1, 0, "decode B16 kv1k 32/8 D128 f16 ps16");
        bench_decode(ctx, 16, 1024, 32, 32, 128, KVA_DTYPE_BF16, 16, 1, 0, "decode B16 kv1k 32/32 D128 bf16 ps16");
        bench_decode(ctx, 1, 2048, 32, 8, 128, KVA_DTYPE_BF16, 16, 2048, 1, "prefill 2k causal 32/8 D128 bf16");
    } else {
        test_convert();
        printf("convert: %d failures\n", g_fail);
        test_page_errors(ctx);
        test_merge(ctx);
        printf("merge/page errors: %d failures\n", g_fail);
        test_append(ctx);
        printf("append: %d failures\n", g_fail);
        test_concurrent(ctx);
        printf("concurrent: %d failures\n", g_fail);
        test_attention(ctx, strcmp(mode, "full") == 0);
        printf("attention: %d cases, %d failures total\n", g_cases, g_fail);
    }
    kva_context_destroy(ctx);
    return g_fail != 0;
}
