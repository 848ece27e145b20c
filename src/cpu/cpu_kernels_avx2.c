/* cpu_kernels_avx2.c - AVX2 + FMA + F16C kernels of the CPU backend (x86-64, GCC or clang).
 * Compiled for those extensions with a target pragma; selected at init only when CPUID reports them. */
#include "cpu_internal.h"

#if defined(KVA__CPU_HAVE_AVX2)

#include <immintrin.h>
#include <math.h>
#include <string.h>

#if defined(__clang__)
#pragma clang attribute push(__attribute__((target("avx2,fma,f16c"))), apply_to = function)
#else
#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c")
#endif

/* ---------------------------------------------------------------------------------------------- */
/* exp: Cody-Waite range reduction to r in [-ln2/2, ln2/2], degree-7 Taylor polynomial, 2^n by exponent
 * construction. Relative error ~1e-7 for x in [-87.3, 88]; exactly 0 for x < -87.34 (including -inf). */
static inline __m256 v_exp(__m256 x) {
    const __m256 lo = _mm256_set1_ps(-87.33654f);
    const __m256 hi = _mm256_set1_ps(88.0f);
    __m256 xc = _mm256_min_ps(_mm256_max_ps(x, lo), hi);
    __m256 n = _mm256_round_ps(_mm256_mul_ps(xc, _mm256_set1_ps(1.44269504088896341f)),
                               _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), xc);
    r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440054690583e-4f), r);
    __m256 p = _mm256_set1_ps(1.0f / 5040.0f);
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 720.0f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 120.0f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 24.0f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 6.0f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(0.5f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f));
    __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    __m256 res = _mm256_mul_ps(p, _mm256_castsi256_ps(e));
    return _mm256_andnot_ps(_mm256_cmp_ps(x, lo, _CMP_LT_OQ), res);
}

static inline float hsum256(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

static inline float hmax256(__m256 v) {
    __m128 s = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_max_ps(s, _mm_movehl_ps(s, s));
    s = _mm_max_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

/* ---------------------------------------------------------------------------------------------- */
/* Row conversion                                                                                  */

#define KVA__CVT_INLINE static inline __attribute__((always_inline))

KVA__CVT_INLINE __m256 cvt8(kva_dtype dt, const void* src, int i) {
    switch (dt) {
    case KVA_DTYPE_F32: return _mm256_loadu_ps((const float*)src + i);
    case KVA_DTYPE_F16: return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)((const uint16_t*)src + i)));
    case KVA_DTYPE_BF16: {
        __m128i h = _mm_loadu_si128((const __m128i*)((const uint16_t*)src + i));
        return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
    }
    case KVA_DTYPE_E5M2: { /* e5m2 is the high byte of an IEEE half */
        __m128i b = _mm_cvtepu8_epi16(_mm_loadl_epi64((const __m128i*)((const uint8_t*)src + i)));
        return _mm256_cvtph_ps(_mm_slli_epi16(b, 8));
    }
    case KVA_DTYPE_E4M3: { /* S EEEE MMM -> half S 0EEEE MMM0000000 is the value * 2^-8 (normals and subnormals) */
        __m128i b = _mm_cvtepu8_epi16(_mm_loadl_epi64((const __m128i*)((const uint8_t*)src + i)));
        __m128i mag = _mm_and_si128(b, _mm_set1_epi16(0x7f));
        __m128i h = _mm_or_si128(_mm_slli_epi16(_mm_and_si128(b, _mm_set1_epi16(0x80)), 8), _mm_slli_epi16(mag, 7));
        __m256 f = _mm256_mul_ps(_mm256_cvtph_ps(h), _mm256_set1_ps(256.0f));
        __m256 nan = _mm256_castsi256_ps(_mm256_cvtepi16_epi32(_mm_cmpeq_epi16(mag, _mm_set1_epi16(0x7f))));
        return _mm256_blendv_ps(f, _mm256_set1_ps(NAN), nan);
    }
    default: return _mm256_setzero_ps();
    }
}

static void a_load_row(kva_dtype dt, const void* src, float* dst, int n, int npad, float scale) {
    __m256 s = _mm256_set1_ps(scale);
    int i = 0;
    if (scale == 1.0f) {
        for (; i + 8 <= n; i += 8) _mm256_storeu_ps(dst + i, cvt8(dt, src, i));
    } else {
        for (; i + 8 <= n; i += 8) _mm256_storeu_ps(dst + i, _mm256_mul_ps(cvt8(dt, src, i), s));
    }
    for (; i < n; ++i) dst[i] = kva__cpu_load_scalar(dt, src, i) * scale;
    for (; i < npad; ++i) dst[i] = 0.0f;
}

/* one loop per dtype (the dtype switch stays out of the inner loops) */
#define KVA__LOAD_ROWS_CASE(DT)                                                              \
    case DT:                                                                                 \
        for (int r = 0; r < nrows; ++r) {                                                    \
            const void* s = src[r];                                                          \
            float* d = dst + (size_t)r * (size_t)ld;                                         \
            int i = 0;                                                                       \
            for (; i + 8 <= n; i += 8) _mm256_storeu_ps(d + i, cvt8(DT, s, i));             \
            for (; i < n; ++i) d[i] = kva__cpu_load_scalar(DT, s, i);                        \
            for (; i < npad; ++i) d[i] = 0.0f;                                               \
        }                                                                                    \
        break;

static void a_load_rows(kva_dtype dt, const char* const* src, int nrows, float* dst, int ld, int n, int npad) {
    switch (dt) {
        KVA__LOAD_ROWS_CASE(KVA_DTYPE_F32)
        KVA__LOAD_ROWS_CASE(KVA_DTYPE_F16)
        KVA__LOAD_ROWS_CASE(KVA_DTYPE_BF16)
        KVA__LOAD_ROWS_CASE(KVA_DTYPE_E4M3)
        KVA__LOAD_ROWS_CASE(KVA_DTYPE_E5M2)
    default:
        for (int r = 0; r < nrows; ++r) memset(dst + (size_t)r * (size_t)ld, 0, sizeof(float) * (size_t)npad);
        break;
    }
}
#undef KVA__LOAD_ROWS_CASE

static inline __m128i f32_to_bf16_8(__m256 v) {
    __m256i x = _mm256_castps_si256(v);
    __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(x, 16), _mm256_set1_epi32(1));
    __m256i r = _mm256_srli_epi32(_mm256_add_epi32(_mm256_add_epi32(x, _mm256_set1_epi32(0x7fff)), lsb), 16);
    __m256i qnan = _mm256_or_si256(_mm256_srli_epi32(x, 16), _mm256_set1_epi32(0x40));
    __m256 isnan = _mm256_cmp_ps(v, v, _CMP_UNORD_Q);
    r = _mm256_castps_si256(_mm256_blendv_ps(_mm256_castsi256_ps(r), _mm256_castsi256_ps(qnan), isnan));
    /* pack the low 16 bits of 8 lanes */
    __m128i lo = _mm256_castsi256_si128(r), hi = _mm256_extracti128_si256(r, 1);
    return _mm_packus_epi32(lo, hi); /* values are < 65536, so unsigned saturation keeps them */
}

static void a_store_row(kva_dtype dt, const float* src, void* dst, int n, float scale) {
    __m256 s = _mm256_set1_ps(scale);
    int i = 0;
    switch (dt) {
    case KVA_DTYPE_F32:
        for (; i + 8 <= n; i += 8) _mm256_storeu_ps((float*)dst + i, _mm256_mul_ps(_mm256_loadu_ps(src + i), s));
        break;
    case KVA_DTYPE_F16:
        for (; i + 8 <= n; i += 8)
            _mm_storeu_si128((__m128i*)((uint16_t*)dst + i),
                             _mm256_cvtps_ph(_mm256_mul_ps(_mm256_loadu_ps(src + i), s),
                                             _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
        break;
    case KVA_DTYPE_BF16:
        for (; i + 8 <= n; i += 8)
            _mm_storeu_si128((__m128i*)((uint16_t*)dst + i), f32_to_bf16_8(_mm256_mul_ps(_mm256_loadu_ps(src + i), s)));
        break;
    default: break;
    }
    if (i < n) {
        size_t es = kva__cpu_dtype_size(dt);
        kva__cpu_store_row_scalar(dt, src + i, (char*)dst + (size_t)i * es, n - i, scale);
    }
}

/* ---------------------------------------------------------------------------------------------- */
/* Scores: 4 query rows x 2 keys per step (8 accumulators), then single rows x 4 keys.              */

static void a_scores(const float* Q, int ldq, int R, const float* K, int ldk, int nt, int D, float* S, int lds) {
    int r = 0;
    for (; r + 4 <= R; r += 4) {
        const float* q0 = Q + (size_t)r * ldq;
        const float* q1 = q0 + ldq;
        const float* q2 = q1 + ldq;
        const float* q3 = q2 + ldq;
        float* s0 = S + (size_t)r * lds;
        for (int t = 0; t < nt; t += 2) {
            const float* k0 = K + (size_t)t * ldk;
            const float* k1 = k0 + ldk;
            __m256 a00 = _mm256_setzero_ps(), a01 = _mm256_setzero_ps(), a10 = _mm256_setzero_ps(),
                   a11 = _mm256_setzero_ps(), a20 = _mm256_setzero_ps(), a21 = _mm256_setzero_ps(),
                   a30 = _mm256_setzero_ps(), a31 = _mm256_setzero_ps();
            for (int d = 0; d < D; d += 8) {
                __m256 kv0 = _mm256_loadu_ps(k0 + d), kv1 = _mm256_loadu_ps(k1 + d);
                __m256 qv = _mm256_loadu_ps(q0 + d);
                a00 = _mm256_fmadd_ps(qv, kv0, a00);
                a01 = _mm256_fmadd_ps(qv, kv1, a01);
                qv = _mm256_loadu_ps(q1 + d);
                a10 = _mm256_fmadd_ps(qv, kv0, a10);
                a11 = _mm256_fmadd_ps(qv, kv1, a11);
                qv = _mm256_loadu_ps(q2 + d);
                a20 = _mm256_fmadd_ps(qv, kv0, a20);
                a21 = _mm256_fmadd_ps(qv, kv1, a21);
                qv = _mm256_loadu_ps(q3 + d);
                a30 = _mm256_fmadd_ps(qv, kv0, a30);
                a31 = _mm256_fmadd_ps(qv, kv1, a31);
            }
            /* reduce: g1 = [a00 a01 a10 a11 | ...], g2 = [a20 a21 a30 a31 | ...] per 128-bit lane */
            __m256 g1 = _mm256_hadd_ps(_mm256_hadd_ps(a00, a01), _mm256_hadd_ps(a10, a11));
            __m256 g2 = _mm256_hadd_ps(_mm256_hadd_ps(a20, a21), _mm256_hadd_ps(a30, a31));
            __m128 s01 = _mm_add_ps(_mm256_castps256_ps128(g1), _mm256_extractf128_ps(g1, 1));
            __m128 s23 = _mm_add_ps(_mm256_castps256_ps128(g2), _mm256_extractf128_ps(g2, 1));
            _mm_storel_pi((__m64*)(s0 + t), s01);
            _mm_storeh_pi((__m64*)(s0 + lds + t), s01);
            _mm_storel_pi((__m64*)(s0 + 2 * (size_t)lds + t), s23);
            _mm_storeh_pi((__m64*)(s0 + 3 * (size_t)lds + t), s23);
        }
    }
    for (; r < R; ++r) {
        const float* q = Q + (size_t)r * ldq;
        float* s = S + (size_t)r * lds;
        for (int t = 0; t < nt; t += 4) {
            const float* k0 = K + (size_t)t * ldk;
            const float* k1 = k0 + ldk;
            const float* k2 = k1 + ldk;
            const float* k3 = k2 + ldk;
            __m256 a0 = _mm256_setzero_ps(), a1 = _mm256_setzero_ps(), a2 = _mm256_setzero_ps(),
                   a3 = _mm256_setzero_ps();
            for (int d = 0; d < D; d += 8) {
                __m256 qv = _mm256_loadu_ps(q + d);
                a0 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k0 + d), a0);
                a1 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k1 + d), a1);
                a2 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k2 + d), a2);
                a3 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k3 + d), a3);
            }
            __m256 g = _mm256_hadd_ps(_mm256_hadd_ps(a0, a1), _mm256_hadd_ps(a2, a3));
            _mm_storeu_ps(s + t, _mm_add_ps(_mm256_castps256_ps128(g), _mm256_extractf128_ps(g, 1)));
        }
    }
}

/* ---------------------------------------------------------------------------------------------- */
/* P V: 4 rows x 16 dims of accumulators in registers over all keys of the block.                  */

static void a_pv(const float* P, int ldp, int R, const float* V, int ldv, int nt, int D, float* acc, int lda,
                 const float* alpha) {
    int r = 0;
    for (; r + 4 <= R; r += 4) {
        const float* p0 = P + (size_t)r * ldp;
        const float* p1 = p0 + ldp;
        const float* p2 = p1 + ldp;
        const float* p3 = p2 + ldp;
        float* c0 = acc + (size_t)r * lda;
        float* c1 = c0 + lda;
        float* c2 = c1 + lda;
        float* c3 = c2 + lda;
        __m256 al0 = _mm256_set1_ps(alpha ? alpha[r] : 1.0f), al1 = _mm256_set1_ps(alpha ? alpha[r + 1] : 1.0f),
               al2 = _mm256_set1_ps(alpha ? alpha[r + 2] : 1.0f), al3 = _mm256_set1_ps(alpha ? alpha[r + 3] : 1.0f);
        for (int d = 0; d < D; d += 16) {
            __m256 x0 = _mm256_mul_ps(_mm256_loadu_ps(c0 + d), al0), y0 = _mm256_mul_ps(_mm256_loadu_ps(c0 + d + 8), al0);
            __m256 x1 = _mm256_mul_ps(_mm256_loadu_ps(c1 + d), al1), y1 = _mm256_mul_ps(_mm256_loadu_ps(c1 + d + 8), al1);
            __m256 x2 = _mm256_mul_ps(_mm256_loadu_ps(c2 + d), al2), y2 = _mm256_mul_ps(_mm256_loadu_ps(c2 + d + 8), al2);
            __m256 x3 = _mm256_mul_ps(_mm256_loadu_ps(c3 + d), al3), y3 = _mm256_mul_ps(_mm256_loadu_ps(c3 + d + 8), al3);
            const float* v = V + d;
            for (int t = 0; t < nt; ++t, v += ldv) {
                __m256 v0 = _mm256_loadu_ps(v), v1 = _mm256_loadu_ps(v + 8);
                __m256 pb = _mm256_broadcast_ss(p0 + t);
                x0 = _mm256_fmadd_ps(pb, v0, x0);
                y0 = _mm256_fmadd_ps(pb, v1, y0);
                pb = _mm256_broadcast_ss(p1 + t);
                x1 = _mm256_fmadd_ps(pb, v0, x1);
                y1 = _mm256_fmadd_ps(pb, v1, y1);
                pb = _mm256_broadcast_ss(p2 + t);
                x2 = _mm256_fmadd_ps(pb, v0, x2);
                y2 = _mm256_fmadd_ps(pb, v1, y2);
                pb = _mm256_broadcast_ss(p3 + t);
                x3 = _mm256_fmadd_ps(pb, v0, x3);
                y3 = _mm256_fmadd_ps(pb, v1, y3);
            }
            _mm256_storeu_ps(c0 + d, x0);
            _mm256_storeu_ps(c0 + d + 8, y0);
            _mm256_storeu_ps(c1 + d, x1);
            _mm256_storeu_ps(c1 + d + 8, y1);
            _mm256_storeu_ps(c2 + d, x2);
            _mm256_storeu_ps(c2 + d + 8, y2);
            _mm256_storeu_ps(c3 + d, x3);
            _mm256_storeu_ps(c3 + d + 8, y3);
        }
    }
    for (; r < R; ++r) {
        const float* p = P + (size_t)r * ldp;
        float* c = acc + (size_t)r * lda;
        __m256 al = _mm256_set1_ps(alpha ? alpha[r] : 1.0f);
        int d = 0;
        for (; d + 32 <= D; d += 32) {
            __m256 x0 = _mm256_mul_ps(_mm256_loadu_ps(c + d), al), x1 = _mm256_mul_ps(_mm256_loadu_ps(c + d + 8), al),
                   x2 = _mm256_mul_ps(_mm256_loadu_ps(c + d + 16), al),
                   x3 = _mm256_mul_ps(_mm256_loadu_ps(c + d + 24), al);
            const float* v = V + d;
            for (int t = 0; t < nt; ++t, v += ldv) {
                __m256 pb = _mm256_broadcast_ss(p + t);
                x0 = _mm256_fmadd_ps(pb, _mm256_loadu_ps(v), x0);
                x1 = _mm256_fmadd_ps(pb, _mm256_loadu_ps(v + 8), x1);
                x2 = _mm256_fmadd_ps(pb, _mm256_loadu_ps(v + 16), x2);
                x3 = _mm256_fmadd_ps(pb, _mm256_loadu_ps(v + 24), x3);
            }
            _mm256_storeu_ps(c + d, x0);
            _mm256_storeu_ps(c + d + 8, x1);
            _mm256_storeu_ps(c + d + 16, x2);
            _mm256_storeu_ps(c + d + 24, x3);
        }
        for (; d < D; d += 16) {
            __m256 x0 = _mm256_mul_ps(_mm256_loadu_ps(c + d), al), x1 = _mm256_mul_ps(_mm256_loadu_ps(c + d + 8), al);
            const float* v = V + d;
            for (int t = 0; t < nt; ++t, v += ldv) {
                __m256 pb = _mm256_broadcast_ss(p + t);
                x0 = _mm256_fmadd_ps(pb, _mm256_loadu_ps(v), x0);
                x1 = _mm256_fmadd_ps(pb, _mm256_loadu_ps(v + 8), x1);
            }
            _mm256_storeu_ps(c + d, x0);
            _mm256_storeu_ps(c + d + 8, x1);
        }
    }
}

/* ---------------------------------------------------------------------------------------------- */
/* Direct kernels: K / V rows read from the cache and converted in registers (small tiles, e.g. decode). */

#define KVA__INLINE static inline __attribute__((always_inline))

/* prefetch rows [n*i/steps, n*(i+1)/steps) of the list */
KVA__INLINE void pf_step(const kva__cpu_prefetch* pf, int i, int steps) {
    if (!pf || i >= steps) return;
    const int a = (int)((int64_t)pf->n * i / steps), b = (int)((int64_t)pf->n * (i + 1) / steps);
    for (int k = a; k < b; ++k) {
        for (int off = 0; off < pf->bytes[0]; off += 64) _mm_prefetch(pf->rows[0][k] + off, _MM_HINT_T0);
        for (int off = 0; off < pf->bytes[1]; off += 64) _mm_prefetch(pf->rows[1][k] + off, _MM_HINT_T0);
    }
}

KVA__INLINE void scores_kv_impl(const kva_dtype dt, const float* Q, int ldq, int R, const char* const* kp, int nt,
                                int D, float* S, int lds, const kva__cpu_prefetch* pf) {
    int r = 0;
    /* the prefetch list is spread over the first pass over the keys */
    const int pf_steps = R >= 4 ? nt / 2 : nt / 4;
    int pf_i = 0;
    for (; r + 4 <= R; r += 4) {
        const float* q0 = Q + (size_t)r * ldq;
        const float* q1 = q0 + ldq;
        const float* q2 = q1 + ldq;
        const float* q3 = q2 + ldq;
        float* s0 = S + (size_t)r * lds;
        int t = 0;
        for (; t + 2 <= nt; t += 2) {
            const char* k0 = kp[t];
            const char* k1 = kp[t + 1];
            if (r == 0) pf_step(pf, pf_i++, pf_steps);
            __m256 a00 = _mm256_setzero_ps(), a01 = _mm256_setzero_ps(), a10 = _mm256_setzero_ps(),
                   a11 = _mm256_setzero_ps(), a20 = _mm256_setzero_ps(), a21 = _mm256_setzero_ps(),
                   a30 = _mm256_setzero_ps(), a31 = _mm256_setzero_ps();
            for (int d = 0; d < D; d += 8) {
                __m256 kv0 = cvt8(dt, k0, d), kv1 = cvt8(dt, k1, d);
                __m256 qv = _mm256_loadu_ps(q0 + d);
                a00 = _mm256_fmadd_ps(qv, kv0, a00);
                a01 = _mm256_fmadd_ps(qv, kv1, a01);
                qv = _mm256_loadu_ps(q1 + d);
                a10 = _mm256_fmadd_ps(qv, kv0, a10);
                a11 = _mm256_fmadd_ps(qv, kv1, a11);
                qv = _mm256_loadu_ps(q2 + d);
                a20 = _mm256_fmadd_ps(qv, kv0, a20);
                a21 = _mm256_fmadd_ps(qv, kv1, a21);
                qv = _mm256_loadu_ps(q3 + d);
                a30 = _mm256_fmadd_ps(qv, kv0, a30);
                a31 = _mm256_fmadd_ps(qv, kv1, a31);
            }
            __m256 g1 = _mm256_hadd_ps(_mm256_hadd_ps(a00, a01), _mm256_hadd_ps(a10, a11));
            __m256 g2 = _mm256_hadd_ps(_mm256_hadd_ps(a20, a21), _mm256_hadd_ps(a30, a31));
            __m128 s01 = _mm_add_ps(_mm256_castps256_ps128(g1), _mm256_extractf128_ps(g1, 1));
            __m128 s23 = _mm_add_ps(_mm256_castps256_ps128(g2), _mm256_extractf128_ps(g2, 1));
            _mm_storel_pi((__m64*)(s0 + t), s01);
            _mm_storeh_pi((__m64*)(s0 + lds + t), s01);
            _mm_storel_pi((__m64*)(s0 + 2 * (size_t)lds + t), s23);
            _mm_storeh_pi((__m64*)(s0 + 3 * (size_t)lds + t), s23);
        }
        for (; t < nt; ++t) {
            const char* k0 = kp[t];
            __m256 a0 = _mm256_setzero_ps(), a1 = _mm256_setzero_ps(), a2 = _mm256_setzero_ps(),
                   a3 = _mm256_setzero_ps();
            for (int d = 0; d < D; d += 8) {
                __m256 kv = cvt8(dt, k0, d);
                a0 = _mm256_fmadd_ps(_mm256_loadu_ps(q0 + d), kv, a0);
                a1 = _mm256_fmadd_ps(_mm256_loadu_ps(q1 + d), kv, a1);
                a2 = _mm256_fmadd_ps(_mm256_loadu_ps(q2 + d), kv, a2);
                a3 = _mm256_fmadd_ps(_mm256_loadu_ps(q3 + d), kv, a3);
            }
            __m256 g = _mm256_hadd_ps(_mm256_hadd_ps(a0, a1), _mm256_hadd_ps(a2, a3));
            __m128 v = _mm_add_ps(_mm256_castps256_ps128(g), _mm256_extractf128_ps(g, 1));
            float tmp[4];
            _mm_storeu_ps(tmp, v);
            s0[t] = tmp[0];
            s0[lds + t] = tmp[1];
            s0[2 * (size_t)lds + t] = tmp[2];
            s0[3 * (size_t)lds + t] = tmp[3];
        }
    }
    for (; r < R; ++r) {
        const float* q = Q + (size_t)r * ldq;
        float* s = S + (size_t)r * lds;
        int t = 0;
        for (; t + 4 <= nt; t += 4) {
            const char* k0 = kp[t];
            const char* k1 = kp[t + 1];
            const char* k2 = kp[t + 2];
            const char* k3 = kp[t + 3];
            if (r == 0) pf_step(pf, pf_i++, pf_steps);
            __m256 a0 = _mm256_setzero_ps(), a1 = _mm256_setzero_ps(), a2 = _mm256_setzero_ps(),
                   a3 = _mm256_setzero_ps();
            for (int d = 0; d < D; d += 8) {
                __m256 qv = _mm256_loadu_ps(q + d);
                a0 = _mm256_fmadd_ps(qv, cvt8(dt, k0, d), a0);
                a1 = _mm256_fmadd_ps(qv, cvt8(dt, k1, d), a1);
                a2 = _mm256_fmadd_ps(qv, cvt8(dt, k2, d), a2);
                a3 = _mm256_fmadd_ps(qv, cvt8(dt, k3, d), a3);
            }
            __m256 g = _mm256_hadd_ps(_mm256_hadd_ps(a0, a1), _mm256_hadd_ps(a2, a3));
            _mm_storeu_ps(s + t, _mm_add_ps(_mm256_castps256_ps128(g), _mm256_extractf128_ps(g, 1)));
        }
        for (; t < nt; ++t) {
            const char* k0 = kp[t];
            __m256 a0 = _mm256_setzero_ps();
            for (int d = 0; d < D; d += 8) a0 = _mm256_fmadd_ps(_mm256_loadu_ps(q + d), cvt8(dt, k0, d), a0);
            s[t] = hsum256(a0);
        }
    }
}

static void a_scores_kv(kva_dtype dt, const float* Q, int ldq, int R, const char* const* kp, int nt, int D, float* S,
                        int lds, const kva__cpu_prefetch* pf) {
    if (pf && nt < 8) { /* too few steps to spread over */
        pf_step(pf, 0, 1);
        pf = NULL;
    }
    switch (dt) {
    case KVA_DTYPE_F32: scores_kv_impl(KVA_DTYPE_F32, Q, ldq, R, kp, nt, D, S, lds, pf); break;
    case KVA_DTYPE_F16: scores_kv_impl(KVA_DTYPE_F16, Q, ldq, R, kp, nt, D, S, lds, pf); break;
    case KVA_DTYPE_BF16: scores_kv_impl(KVA_DTYPE_BF16, Q, ldq, R, kp, nt, D, S, lds, pf); break;
    case KVA_DTYPE_E4M3: scores_kv_impl(KVA_DTYPE_E4M3, Q, ldq, R, kp, nt, D, S, lds, pf); break;
    case KVA_DTYPE_E5M2: scores_kv_impl(KVA_DTYPE_E5M2, Q, ldq, R, kp, nt, D, S, lds, pf); break;
    default: break;
    }
}

KVA__INLINE void pv_kv_impl(const kva_dtype dt, const float* P, int ldp, int R, const char* const* vp, int nt, int D,
                            float* acc, int lda, const float* alpha) {
    int r = 0;
    for (; r + 4 <= R; r += 4) {
        const float* p0 = P + (size_t)r * ldp;
        const float* p1 = p0 + ldp;
        const float* p2 = p1 + ldp;
        const float* p3 = p2 + ldp;
        float* c0 = acc + (size_t)r * lda;
        float* c1 = c0 + lda;
        float* c2 = c1 + lda;
        float* c3 = c2 + lda;
        __m256 al0 = _mm256_set1_ps(alpha ? alpha[r] : 1.0f), al1 = _mm256_set1_ps(alpha ? alpha[r + 1] : 1.0f),
               al2 = _mm256_set1_ps(alpha ? alpha[r + 2] : 1.0f), al3 = _mm256_set1_ps(alpha ? alpha[r + 3] : 1.0f);
        for (int d = 0; d < D; d += 16) {
            __m256 x0 = _mm256_mul_ps(_mm256_loadu_ps(c0 + d), al0), y0 = _mm256_mul_ps(_mm256_loadu_ps(c0 + d + 8), al0);
            __m256 x1 = _mm256_mul_ps(_mm256_loadu_ps(c1 + d), al1), y1 = _mm256_mul_ps(_mm256_loadu_ps(c1 + d + 8), al1);
            __m256 x2 = _mm256_mul_ps(_mm256_loadu_ps(c2 + d), al2), y2 = _mm256_mul_ps(_mm256_loadu_ps(c2 + d + 8), al2);
            __m256 x3 = _mm256_mul_ps(_mm256_loadu_ps(c3 + d), al3), y3 = _mm256_mul_ps(_mm256_loadu_ps(c3 + d + 8), al3);
            for (int t = 0; t < nt; ++t) {
                __m256 v0 = cvt8(dt, vp[t], d), v1 = cvt8(dt, vp[t], d + 8);
                __m256 pb = _mm256_broadcast_ss(p0 + t);
                x0 = _mm256_fmadd_ps(pb, v0, x0);
                y0 = _mm256_fmadd_ps(pb, v1, y0);
                pb = _mm256_broadcast_ss(p1 + t);
                x1 = _mm256_fmadd_ps(pb, v0, x1);
                y1 = _mm256_fmadd_ps(pb, v1, y1);
                pb = _mm256_broadcast_ss(p2 + t);
                x2 = _mm256_fmadd_ps(pb, v0, x2);
                y2 = _mm256_fmadd_ps(pb, v1, y2);
                pb = _mm256_broadcast_ss(p3 + t);
                x3 = _mm256_fmadd_ps(pb, v0, x3);
                y3 = _mm256_fmadd_ps(pb, v1, y3);
            }
            _mm256_storeu_ps(c0 + d, x0);
            _mm256_storeu_ps(c0 + d + 8, y0);
            _mm256_storeu_ps(c1 + d, x1);
            _mm256_storeu_ps(c1 + d + 8, y1);
            _mm256_storeu_ps(c2 + d, x2);
            _mm256_storeu_ps(c2 + d + 8, y2);
            _mm256_storeu_ps(c3 + d, x3);
            _mm256_storeu_ps(c3 + d + 8, y3);
        }
    }
    for (; r < R; ++r) {
        const float* p = P + (size_t)r * ldp;
        float* c = acc + (size_t)r * lda;
        __m256 al = _mm256_set1_ps(alpha ? alpha[r] : 1.0f);
        int d = 0;
        for (; d + 32 <= D; d += 32) {
            __m256 x0 = _mm256_mul_ps(_mm256_loadu_ps(c + d), al), x1 = _mm256_mul_ps(_mm256_loadu_ps(c + d + 8), al),
                   x2 = _mm256_mul_ps(_mm256_loadu_ps(c + d + 16), al),
                   x3 = _mm256_mul_ps(_mm256_loadu_ps(c + d + 24), al);
            for (int t = 0; t < nt; ++t) {
                __m256 pb = _mm256_broadcast_ss(p + t);
                const char* v = vp[t];
                x0 = _mm256_fmadd_ps(pb, cvt8(dt, v, d), x0);
                x1 = _mm256_fmadd_ps(pb, cvt8(dt, v, d + 8), x1);
                x2 = _mm256_fmadd_ps(pb, cvt8(dt, v, d + 16), x2);
                x3 = _mm256_fmadd_ps(pb, cvt8(dt, v, d + 24), x3);
            }
            _mm256_storeu_ps(c + d, x0);
            _mm256_storeu_ps(c + d + 8, x1);
            _mm256_storeu_ps(c + d + 16, x2);
            _mm256_storeu_ps(c + d + 24, x3);
        }
        for (; d < D; d += 16) {
            __m256 x0 = _mm256_mul_ps(_mm256_loadu_ps(c + d), al), x1 = _mm256_mul_ps(_mm256_loadu_ps(c + d + 8), al);
            for (int t = 0; t < nt; ++t) {
                __m256 pb = _mm256_broadcast_ss(p + t);
                x0 = _mm256_fmadd_ps(pb, cvt8(dt, vp[t], d), x0);
                x1 = _mm256_fmadd_ps(pb, cvt8(dt, vp[t], d + 8), x1);
            }
            _mm256_storeu_ps(c + d, x0);
            _mm256_storeu_ps(c + d + 8, x1);
        }
    }
}

static void a_pv_kv(kva_dtype dt, const float* P, int ldp, int R, const char* const* vp, int nt, int D, float* acc,
                    int lda, const float* alpha) {
    switch (dt) {
    case KVA_DTYPE_F32: pv_kv_impl(KVA_DTYPE_F32, P, ldp, R, vp, nt, D, acc, lda, alpha); break;
    case KVA_DTYPE_F16: pv_kv_impl(KVA_DTYPE_F16, P, ldp, R, vp, nt, D, acc, lda, alpha); break;
    case KVA_DTYPE_BF16: pv_kv_impl(KVA_DTYPE_BF16, P, ldp, R, vp, nt, D, acc, lda, alpha); break;
    case KVA_DTYPE_E4M3: pv_kv_impl(KVA_DTYPE_E4M3, P, ldp, R, vp, nt, D, acc, lda, alpha); break;
    case KVA_DTYPE_E5M2: pv_kv_impl(KVA_DTYPE_E5M2, P, ldp, R, vp, nt, D, acc, lda, alpha); break;
    default: break;
    }
}

/* ---------------------------------------------------------------------------------------------- */
/* Row operations                                                                                  */

static float a_row_max(const float* x, int n) {
    __m256 m = _mm256_set1_ps(-INFINITY);
    for (int i = 0; i < n; i += 8) m = _mm256_max_ps(m, _mm256_loadu_ps(x + i));
    return hmax256(m);
}

static float a_exp_sum(float* x, int n, float m) {
    __m256 mv = _mm256_set1_ps(m), s = _mm256_setzero_ps();
    for (int i = 0; i < n; i += 8) {
        __m256 e = v_exp(_mm256_sub_ps(_mm256_loadu_ps(x + i), mv)); /* -inf - m = -inf -> 0 */
        _mm256_storeu_ps(x + i, e);
        s = _mm256_add_ps(s, e);
    }
    return hsum256(s);
}

static void a_sigmoid(float* x, int n, float bias) {
    __m256 b = _mm256_set1_ps(bias), one = _mm256_set1_ps(1.0f), ninf = _mm256_set1_ps(-INFINITY);
    for (int i = 0; i < n; i += 8) {
        __m256 v = _mm256_loadu_ps(x + i);
        __m256 e = v_exp(_mm256_sub_ps(_mm256_setzero_ps(), _mm256_add_ps(v, b)));
        __m256 y = _mm256_div_ps(one, _mm256_add_ps(one, e));
        y = _mm256_andnot_ps(_mm256_cmp_ps(v, ninf, _CMP_EQ_OQ), y);
        _mm256_storeu_ps(x + i, y);
    }
}

static void a_softcap(float* x, int n, float cap) {
    __m256 c = _mm256_set1_ps(cap), rc = _mm256_set1_ps(1.0f / cap), one = _mm256_set1_ps(1.0f);
    __m256 signbit = _mm256_set1_ps(-0.0f), m2 = _mm256_set1_ps(-2.0f);
    for (int i = 0; i < n; i += 8) {
        __m256 y = _mm256_mul_ps(_mm256_loadu_ps(x + i), rc);
        __m256 ay = _mm256_andnot_ps(signbit, y);
        __m256 t = v_exp(_mm256_mul_ps(ay, m2)); /* exp(-2|y|) in (0, 1] */
        __m256 th = _mm256_div_ps(_mm256_sub_ps(one, t), _mm256_add_ps(one, t));
        th = _mm256_or_ps(th, _mm256_and_ps(signbit, y));
        _mm256_storeu_ps(x + i, _mm256_mul_ps(c, th));
    }
}

#if defined(__clang__)
#pragma clang attribute pop
#else
#pragma GCC pop_options
#endif

const kva__cpu_kernels kva__cpu_kernels_avx2 = {
    "avx2", a_load_row, a_load_rows, a_store_row, a_scores, a_pv, a_scores_kv, a_pv_kv, a_row_max, a_exp_sum, a_sigmoid, a_softcap,
};

#else
/* not x86-64 GCC/clang: only the generic kernels exist */
typedef int kva__cpu_kernels_avx2_unused;
#endif
