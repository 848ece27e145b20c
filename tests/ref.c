/*
 * ref.c - float64 reference of kvattn's numerical contract (include/kvattn.h header comment).
 *
 * Written from the math, not from the library: nothing here includes library source.
 */
#include "ref.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

/* ---------------------------------------------------------------------------------------------- */
/* dtype decoders. Each format is sign | exponent (E bits, bias) | mantissa (M bits).               */

/* value of a finite non-NaN pattern with exponent field e and mantissa field m */
static double ref_fp_value(int sign, int e, uint32_t m, int mbits, int bias) {
    double mag;
    if (e == 0) {
        mag = ldexp((double)m, 1 - bias - mbits); /* subnormal: 0.m * 2^(1-bias) */
    } else {
        mag = ldexp((double)((1u << mbits) | m), e - bias - mbits); /* 1.m * 2^(e-bias) */
    }
    return sign ? -mag : mag;
}

double ref_decode_f16(uint16_t bits) {
    int s = bits >> 15, e = (bits >> 10) & 0x1f;
    uint32_t m = bits & 0x3ffu;
    if (e == 0x1f) return m ? NAN : (s ? -INFINITY : INFINITY);
    return ref_fp_value(s, e, m, 10, 15);
}

double ref_decode_bf16(uint16_t bits) {
    int s = bits >> 15, e = (bits >> 7) & 0xff;
    uint32_t m = bits & 0x7fu;
    if (e == 0xff) return m ? NAN : (s ? -INFINITY : INFINITY);
    return ref_fp_value(s, e, m, 7, 127);
}

double ref_decode_e4m3(uint8_t bits) {
    int s = bits >> 7, e = (bits >> 3) & 0xf;
    uint32_t m = bits & 0x7u;
    if (e == 0xf && m == 0x7) return NAN; /* S.1111.111: the only NaN; no infinities */
    return ref_fp_value(s, e, m, 3, 7);
}

double ref_decode_e5m2(uint8_t bits) {
    int s = bits >> 7, e = (bits >> 2) & 0x1f;
    uint32_t m = bits & 0x3u;
    if (e == 0x1f) return m ? NAN : (s ? -INFINITY : INFINITY);
    return ref_fp_value(s, e, m, 2, 15);
}

size_t ref_dtype_size(kva_dtype dtype) {
    switch (dtype) {
    case KVA_DTYPE_F32: return 4;
    case KVA_DTYPE_F16: return 2;
    case KVA_DTYPE_BF16: return 2;
    case KVA_DTYPE_E4M3: return 1;
    case KVA_DTYPE_E5M2: return 1;
    case KVA_DTYPE_I32: return 4;
    case KVA_DTYPE_U8: return 1;
    }
    return 0;
}

double ref_decode(kva_dtype dtype, const void* base, size_t index) {
    const unsigned char* p = (const unsigned char*)base + index * ref_dtype_size(dtype);
    switch (dtype) {
    case KVA_DTYPE_F32: {
        float f;
        memcpy(&f, p, 4);
        return (double)f;
    }
    case KVA_DTYPE_F16: {
        uint16_t h;
        memcpy(&h, p, 2);
        return ref_decode_f16(h);
    }
    case KVA_DTYPE_BF16: {
        uint16_t h;
        memcpy(&h, p, 2);
        return ref_decode_bf16(h);
    }
    case KVA_DTYPE_E4M3: return ref_decode_e4m3(*p);
    case KVA_DTYPE_E5M2: return ref_decode_e5m2(*p);
    case KVA_DTYPE_I32: {
        int32_t i;
        memcpy(&i, p, 4);
        return (double)i;
    }
    case KVA_DTYPE_U8: return (double)*p;
    }
    return NAN;
}

/* ---------------------------------------------------------------------------------------------- */
/* Encoders (test data only): round to nearest, ties to even, from double directly (no double rounding). */

/* Returns the bit pattern (without sign) for |x| in a format with E exponent bits, M mantissa bits,
 * the given bias; max_field_e/max_m: the largest finite pattern; *overflow set when |x| rounds past it. */
static uint32_t ref_fp_encode_mag(double ax, int mbits, int bias, int max_e, uint32_t max_m, int* overflow) {
    *overflow = 0;
    if (ax == 0.0) return 0;
    int ex;
    (void)frexp(ax, &ex); /* ax = f * 2^ex, f in [0.5, 1) -> unbiased exponent ex - 1 */
    int eu = ex - 1;
    int emin = 1 - bias;
    if (eu < emin) { /* subnormal range: quantum 2^(emin - M) */
        double q = nearbyint(ldexp(ax, -(emin - mbits)));
        return (uint32_t)q; /* q == 2^M rolls into the smallest normal, which is the right pattern */
    }
    double q = nearbyint(ldexp(ax, -(eu - mbits))); /* in [2^M, 2^(M+1)] */
    if (q >= ldexp(1.0, mbits + 1)) {
        q = ldexp(1.0, mbits);
        eu += 1;
    }
    int ef = eu + bias;
    uint32_t m = (uint32_t)q - (1u << mbits);
    if (ef > max_e || (ef == max_e && m > max_m)) {
        *overflow = 1;
        return ((uint32_t)max_e << mbits) | max_m;
    }
    return ((uint32_t)ef << mbits) | m;
}

double ref_encode(kva_dtype dtype, void* base, size_t index, double x) {
    unsigned char* p = (unsigned char*)base + index * ref_dtype_size(dtype);
    int sign = signbit(x) ? 1 : 0;
    double ax = fabs(x);
    int ovf = 0;
    switch (dtype) {
    case KVA_DTYPE_F32: {
        float f = (float)x; /* the C conversion rounds to nearest even */
        memcpy(p, &f, 4);
        return (double)f;
    }
    case KVA_DTYPE_F16: {
        uint16_t h;
        if (isnan(x)) h = 0x7e00;
        else if (isinf(x)) h = 0x7c00;
        else {
            uint32_t b = ref_fp_encode_mag(ax, 10, 15, 30, 0x3ff, &ovf);
            h = (uint16_t)(ovf ? 0x7c00 : b);
        }
        h = (uint16_t)(h | (sign << 15));
        memcpy(p, &h, 2);
        return ref_decode_f16(h);
    }
    case KVA_DTYPE_BF16: {
        uint16_t h;
        if (isnan(x)) h = 0x7fc0;
        else if (isinf(x)) h = 0x7f80;
        else {
            uint32_t b = ref_fp_encode_mag(ax, 7, 127, 254, 0x7f, &ovf);
            h = (uint16_t)(ovf ? 0x7f80 : b);
        }
        h = (uint16_t)(h | (sign << 15));
        memcpy(p, &h, 2);
        return ref_decode_bf16(h);
    }
    case KVA_DTYPE_E4M3: {
        uint8_t b;
        if (isnan(x)) b = 0x7f;
        else if (isinf(x)) b = 0x7e; /* saturate */
        else b = (uint8_t)ref_fp_encode_mag(ax, 3, 7, 15, 0x6, &ovf); /* overflow saturates to 448 */
        b = (uint8_t)(b | (sign << 7));
        *p = b;
        return ref_decode_e4m3(b);
    }
    case KVA_DTYPE_E5M2: {
        uint8_t b;
        if (isnan(x)) b = 0x7e;
        else if (isinf(x)) b = 0x7c;
        else {
            uint32_t m = ref_fp_encode_mag(ax, 2, 15, 30, 0x3, &ovf);
            b = (uint8_t)(ovf ? 0x7c : m);
        }
        b = (uint8_t)(b | (sign << 7));
        *p = b;
        return ref_decode_e5m2(b);
    }
    case KVA_DTYPE_I32: {
        int32_t i = (int32_t)x;
        memcpy(p, &i, 4);
        return (double)i;
    }
    case KVA_DTYPE_U8: {
        *p = (uint8_t)x;
        return (double)*p;
    }
    }
    return NAN;
}

double ref_round(kva_dtype dtype, double x) {
    unsigned char tmp[8];
    return ref_encode(dtype, tmp, 0, x);
}

void ref_store_nan(kva_dtype dtype, void* base, size_t index) {
    unsigned char* p = (unsigned char*)base + index * ref_dtype_size(dtype);
    switch (dtype) {
    case KVA_DTYPE_F32: {
        uint32_t u = 0x7fc0dead; /* quiet NaN with a recognisable payload */
        memcpy(p, &u, 4);
        break;
    }
    case KVA_DTYPE_F16: {
        uint16_t u = 0x7e5a;
        memcpy(p, &u, 2);
        break;
    }
    case KVA_DTYPE_BF16: {
        uint16_t u = 0x7fda;
        memcpy(p, &u, 2);
        break;
    }
    case KVA_DTYPE_E4M3: *p = 0x7f; break;
    case KVA_DTYPE_E5M2: *p = 0x7f; break;
    default: memset(p, 0xa5, ref_dtype_size(dtype)); break;
    }
}

/* ---------------------------------------------------------------------------------------------- */
/* ALiBi slopes.
 *
 * For n heads let n2 = 2^floor(log2 n) (the largest power of two <= n). Then
 *   head h <  n2:  m_h = 2^(-8 (h + 1) / n2)
 *   head h >= n2:  k = h - n2, m_h = 2^(-4 (2k + 1) / n2)     (the odd powers of 2^(-8 / (2 n2)))
 * which is the usual get_alibi_slopes: the first n2 heads get the geometric series for n2 heads, the
 * remaining n - n2 heads the odd-indexed slopes of the series for 2 n2 heads. */
double ref_alibi_slope(int32_t head, int32_t num_heads) {
    int32_t n2 = 1;
    while (n2 * 2 <= num_heads) n2 *= 2;
    if (head < n2) return exp2(-8.0 * (double)(head + 1) / (double)n2);
    int32_t k = head - n2;
    return exp2(-4.0 * (double)(2 * k + 1) / (double)n2);
}

/* ---------------------------------------------------------------------------------------------- */
/* RoPE (Llama rotate-half over the whole head_dim_qk, D even):
 *   inv_freq_f = theta^(-2f/D) / rope_scale, angle = pos * inv_freq_f, for f in [0, D/2)
 *   x'[f] = x[f] cos - x[f + D/2] sin;  x'[f + D/2] = x[f + D/2] cos + x[f] sin */
static void ref_rope(const double* x, double* out, int32_t dim, double pos, double scale, double theta) {
    int32_t half = dim / 2;
    for (int32_t f = 0; f < half; ++f) {
        double inv_freq = pow(theta, -2.0 * (double)f / (double)dim) / scale;
        double a = pos * inv_freq;
        double c = cos(a), s = sin(a);
        double x0 = x[f], x1 = x[f + half];
        out[f] = x0 * c - x1 * s;
        out[f + half] = x1 * c + x0 * s;
    }
}

static int ref_mask_bit(const uint8_t* mask, int64_t bit) { return (mask[bit >> 3] >> (bit & 7)) & 1; }

void ref_attention(const ref_attn_cfg* cfg, int64_t qo_len, int64_t kv_len, const double* q, const double* k,
                   const double* v, const uint8_t* mask, double* o, double* lse, double* mag) {
    const int32_t hq = cfg->num_qo_heads, hkv = cfg->num_kv_heads;
    const int32_t dqk = cfg->head_dim_qk, dvo = cfg->head_dim_vo;
    const int32_t g = hq / hkv;
    const double sm_scale = cfg->sm_scale > 0 ? cfg->sm_scale : 1.0 / sqrt((double)dqk);
    const double rope_scale = cfg->rope_scale > 0 ? cfg->rope_scale : 1.0;
    const double rope_theta = cfg->rope_theta > 0 ? cfg->rope_theta : 1e4;
    const int rope = cfg->pos_encoding == KVA_POS_ROPE_LLAMA;
    const int sigmoid = cfg->score_mode == KVA_SCORE_SIGMOID;

    /* keys after RoPE (position j) */
    const double* kr = k;
    double* kbuf = NULL;
    if (rope && kv_len > 0) {
        kbuf = (double*)malloc(sizeof(double) * (size_t)kv_len * (size_t)hkv * (size_t)dqk);
        for (int64_t j = 0; j < kv_len; ++j)
            for (int32_t h = 0; h < hkv; ++h) {
                size_t off = ((size_t)j * (size_t)hkv + (size_t)h) * (size_t)dqk;
                ref_rope(k + off, kbuf + off, dqk, (double)j, rope_scale, rope_theta);
            }
        kr = kbuf;
    }
    double* x = (double*)malloc(sizeof(double) * (size_t)(kv_len > 0 ? kv_len : 1));
    unsigned char* vis = (unsigned char*)malloc((size_t)(kv_len > 0 ? kv_len : 1));
    double* qr = (double*)malloc(sizeof(double) * (size_t)dqk);

    for (int64_t i = 0; i < qo_len; ++i) {
        const int64_t q_pos = kv_len - qo_len + i;
        for (int32_t qh = 0; qh < hq; ++qh) {
            const int32_t kh = qh / g;
            const double* qi = q + ((size_t)i * (size_t)hq + (size_t)qh) * (size_t)dqk;
            if (rope) ref_rope(qi, qr, dqk, (double)q_pos, rope_scale, rope_theta);
            else memcpy(qr, qi, sizeof(double) * (size_t)dqk);
            const double slope = cfg->pos_encoding == KVA_POS_ALIBI
                                     ? (cfg->alibi_slopes ? cfg->alibi_slopes[qh] : ref_alibi_slope(qh, hq))
                                     : 0.0;
            double m = -INFINITY;
            int64_t nvis = 0;
            for (int64_t j = 0; j < kv_len; ++j) {
                int ok = 1;
                if (cfg->mask_mode == KVA_MASK_CAUSAL && j > q_pos) ok = 0;
                if (cfg->window_left >= 0 && j < q_pos - cfg->window_left) ok = 0;
                if (cfg->mask_mode == KVA_MASK_CUSTOM && !ref_mask_bit(mask, i * kv_len + j)) ok = 0;
                vis[j] = (unsigned char)ok;
                if (!ok) continue;
                ++nvis;
                const double* kj = kr + ((size_t)j * (size_t)hkv + (size_t)kh) * (size_t)dqk;
                double dot = 0;
                for (int32_t d = 0; d < dqk; ++d) dot += qr[d] * kj[d];
                double xx = sm_scale * dot;
                if (cfg->pos_encoding == KVA_POS_ALIBI) xx += slope * (double)(j - q_pos);
                if (cfg->soft_cap > 0) xx = cfg->soft_cap * tanh(xx / cfg->soft_cap);
                x[j] = xx;
                if (xx > m) m = xx;
            }
            double* oi = o + ((size_t)i * (size_t)hq + (size_t)qh) * (size_t)dvo;
            double* mi = mag ? mag + ((size_t)i * (size_t)hq + (size_t)qh) * (size_t)dvo : NULL;
            for (int32_t d = 0; d < dvo; ++d) {
                oi[d] = 0;
                if (mi) mi[d] = 0;
            }
            double l;
            if (nvis == 0) {
                l = sigmoid ? NAN : -INFINITY;
            } else if (sigmoid) {
                for (int64_t j = 0; j < kv_len; ++j) {
                    if (!vis[j]) continue;
                    double w = 1.0 / (1.0 + exp(-(x[j] + cfg->sigmoid_bias)));
                    const double* vj = v + ((size_t)j * (size_t)hkv + (size_t)kh) * (size_t)dvo;
                    for (int32_t d = 0; d < dvo; ++d) {
                        oi[d] += w * vj[d];
                        if (mi) mi[d] += w * fabs(vj[d]);
                    }
                }
                l = NAN;
            } else {
                double den = 0;
                for (int64_t j = 0; j < kv_len; ++j)
                    if (vis[j]) den += exp(x[j] - m);
                for (int64_t j = 0; j < kv_len; ++j) {
                    if (!vis[j]) continue;
                    double w = exp(x[j] - m) / den;
                    const double* vj = v + ((size_t)j * (size_t)hkv + (size_t)kh) * (size_t)dvo;
                    for (int32_t d = 0; d < dvo; ++d) {
                        oi[d] += w * vj[d];
                        if (mi) mi[d] += w * fabs(vj[d]);
                    }
                }
                l = (m + log(den)) / REF_LN2; /* base 2 */
            }
            if (lse) lse[(size_t)i * (size_t)hq + (size_t)qh] = l;
        }
    }
    free(qr);
    free(vis);
    free(x);
    free(kbuf);
}

void ref_merge(int64_t n, const double* lse, const double* v, int64_t dim, double* v_out, double* lse_out) {
    double m = -INFINITY;
    for (int64_t k = 0; k < n; ++k)
        if (lse[k] > m) m = lse[k];
    for (int64_t d = 0; d < dim; ++d) v_out[d] = 0;
    if (m == -INFINITY) {
        *lse_out = -INFINITY;
        return;
    }
    double den = 0;
    for (int64_t k = 0; k < n; ++k) {
        if (lse[k] == -INFINITY) continue;
        double w = exp2(lse[k] - m);
        den += w;
        for (int64_t d = 0; d < dim; ++d) v_out[d] += w * v[k * dim + d];
    }
    for (int64_t d = 0; d < dim; ++d) v_out[d] /= den;
    *lse_out = m + log2(den);
}
