/* cpu_convert.c - scalar dtype conversions of the CPU backend (f16, bf16, fp8 e4m3/e5m2 <-> f32). */
#include <math.h>
#include <string.h>

#include "cpu_internal.h"

float kva__cpu_e4m3_table[256];
float kva__cpu_e5m2_table[256];

static pthread_once_t kva__cpu_convert_once = PTHREAD_ONCE_INIT;

static inline uint32_t f2u(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    return u;
}
static inline float u2f(uint32_t u) {
    float f;
    memcpy(&f, &u, 4);
    return f;
}

/* OCP e4m3 "fn": S EEEE MMM, bias 7, no infinities, S.1111.111 is NaN, max 448. */
static float e4m3_decode(uint8_t b) {
    int sign = b >> 7, e = (b >> 3) & 0xf, m = b & 7;
    float v;
    if (e == 15 && m == 7) return u2f(sign ? 0xffc00000u : 0x7fc00000u);
    if (e == 0) v = ldexpf((float)m, -9);              /* m/8 * 2^-6 */
    else v = ldexpf((float)(8 + m), e - 7 - 3);       /* (1 + m/8) * 2^(e-7) */
    return sign ? -v : v;
}

/* e5m2: S EEEEE MM, bias 15, IEEE-like (inf and NaN). */
static float e5m2_decode(uint8_t b) {
    int sign = b >> 7, e = (b >> 2) & 0x1f, m = b & 3;
    float v;
    if (e == 31) {
        if (m == 0) return sign ? -INFINITY : INFINITY;
        return u2f(sign ? 0xffc00000u : 0x7fc00000u);
    }
    if (e == 0) v = ldexpf((float)m, -16);             /* m/4 * 2^-14 */
    else v = ldexpf((float)(4 + m), e - 15 - 2);      /* (1 + m/4) * 2^(e-15) */
    return sign ? -v : v;
}

static void build_tables(void) {
    for (int i = 0; i < 256; ++i) {
        kva__cpu_e4m3_table[i] = e4m3_decode((uint8_t)i);
        kva__cpu_e5m2_table[i] = e5m2_decode((uint8_t)i);
    }
}

void kva__cpu_convert_init(void) { pthread_once(&kva__cpu_convert_once, build_tables); }

float kva__cpu_f16_to_f32(uint16_t h) {
    uint32_t sign = (uint32_t)(h & 0x8000u) << 16;
    uint32_t e = (h >> 10) & 0x1fu, m = h & 0x3ffu;
    if (e == 0) {
        float v = (float)m * 5.9604644775390625e-8f; /* m * 2^-24, exact */
        return u2f(f2u(v) | sign);
    }
    if (e == 31) return u2f(sign | 0x7f800000u | (m << 13));
    return u2f(sign | ((e + 112u) << 23) | (m << 13));
}

uint16_t kva__cpu_f32_to_f16(float f) {
    uint32_t x = f2u(f);
    uint16_t sign = (uint16_t)((x >> 16) & 0x8000u);
    x &= 0x7fffffffu;
    if (x >= 0x7f800000u) { /* inf or NaN */
        if (x == 0x7f800000u) return (uint16_t)(sign | 0x7c00u);
        return (uint16_t)(sign | 0x7e00u | ((x >> 13) & 0x3ffu));
    }
    if (x >= 0x477ff000u) return (uint16_t)(sign | 0x7c00u); /* rounds to >= 65536: inf */
    if (x >= 0x38800000u) {                                  /* normal half */
        uint32_t h = (x - 0x38000000u) >> 13;
        uint32_t rem = x & 0x1fffu;
        if (rem > 0x1000u || (rem == 0x1000u && (h & 1u))) h++;
        return (uint16_t)(sign | h);
    }
    /* subnormal half (or zero): value in units of 2^-24 */
    uint32_t e = x >> 23;
    if (e < 102) return sign; /* < 2^-25: rounds to 0 (2^-25 exactly ties to even 0: e == 102 below) */
    uint32_t m = (x & 0x7fffffu) | 0x800000u;
    uint32_t shift = 126u - e; /* 14 .. 24 */
    uint32_t h = m >> shift;
    uint32_t rem = m & ((1u << shift) - 1u), half = 1u << (shift - 1u);
    if (rem > half || (rem == half && (h & 1u))) h++;
    return (uint16_t)(sign | h);
}

float kva__cpu_bf16_to_f32(uint16_t h) { return u2f((uint32_t)h << 16); }

uint16_t kva__cpu_f32_to_bf16(float f) {
    uint32_t x = f2u(f);
    if ((x & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((x >> 16) | 0x40u); /* quiet NaN */
    x += 0x7fffu + ((x >> 16) & 1u);
    return (uint16_t)(x >> 16);
}

/* Round |f| to a float format with M mantissa bits and exponent bias `bias` (round to nearest even),
   saturating at maxval/maxcode. Returns the magnitude code. */
static uint8_t fp8_encode_mag(float a, int M, int bias, float maxval, uint8_t maxcode) {
    if (!(a > 0.0f)) return 0; /* +-0 */
    if (a >= maxval) return maxcode;
    int e2;
    (void)frexpf(a, &e2);
    int ex = e2 - 1; /* a in [2^ex, 2^(ex+1)) */
    if (ex < 1 - bias) ex = 1 - bias;
    float q = ldexpf(1.0f, ex - M);
    float n = nearbyintf(a / q); /* exact division by a power of two; round to nearest even */
    int ni = (int)n;
    int code;
    if (ex == 1 - bias && ni < (1 << M)) {
        code = ni; /* subnormal (or zero) */
    } else {
        if (ni >= (2 << M)) {
            ex++;
            ni = 1 << M;
        }
        code = ((ex + bias) << M) | (ni - (1 << M));
    }
    if (code > maxcode) code = maxcode;
    return (uint8_t)code;
}

uint8_t kva__cpu_f32_to_e4m3(float f) {
    uint8_t sign = (uint8_t)((f2u(f) >> 24) & 0x80u);
    if (isnan(f)) return (uint8_t)(sign | 0x7fu);
    return (uint8_t)(sign | fp8_encode_mag(fabsf(f), 3, 7, 448.0f, 0x7e));
}

uint8_t kva__cpu_f32_to_e5m2(float f) {
    uint8_t sign = (uint8_t)((f2u(f) >> 24) & 0x80u);
    if (isnan(f)) return (uint8_t)(sign | 0x7eu);
    return (uint8_t)(sign | fp8_encode_mag(fabsf(f), 2, 15, 57344.0f, 0x7b));
}

size_t kva__cpu_dtype_size(kva_dtype dt) {
    switch (dt) {
    case KVA_DTYPE_F32: return 4;
    case KVA_DTYPE_F16:
    case KVA_DTYPE_BF16: return 2;
    case KVA_DTYPE_E4M3:
    case KVA_DTYPE_E5M2: return 1;
    default: return 0;
    }
}

int kva__cpu_is_float_dtype(kva_dtype dt) {
    return dt == KVA_DTYPE_F32 || dt == KVA_DTYPE_F16 || dt == KVA_DTYPE_BF16;
}

int kva__cpu_is_kv_dtype(kva_dtype dt) {
    return kva__cpu_is_float_dtype(dt) || dt == KVA_DTYPE_E4M3 || dt == KVA_DTYPE_E5M2;
}

float kva__cpu_load_scalar(kva_dtype dt, const void* src, int64_t i) {
    switch (dt) {
    case KVA_DTYPE_F32: return ((const float*)src)[i];
    case KVA_DTYPE_F16: return kva__cpu_f16_to_f32(((const uint16_t*)src)[i]);
    case KVA_DTYPE_BF16: return kva__cpu_bf16_to_f32(((const uint16_t*)src)[i]);
    case KVA_DTYPE_E4M3: return kva__cpu_e4m3_table[((const uint8_t*)src)[i]];
    case KVA_DTYPE_E5M2: return kva__cpu_e5m2_table[((const uint8_t*)src)[i]];
    default: return 0.0f;
    }
}

void kva__cpu_load_row_scalar(kva_dtype dt, const void* src, float* dst, int n, int npad, float scale) {
    int i;
    switch (dt) {
    case KVA_DTYPE_F32: {
        const float* s = (const float*)src;
        for (i = 0; i < n; ++i) dst[i] = s[i] * scale;
        break;
    }
    case KVA_DTYPE_F16: {
        const uint16_t* s = (const uint16_t*)src;
        for (i = 0; i < n; ++i) dst[i] = kva__cpu_f16_to_f32(s[i]) * scale;
        break;
    }
    case KVA_DTYPE_BF16: {
        const uint16_t* s = (const uint16_t*)src;
        for (i = 0; i < n; ++i) dst[i] = u2f((uint32_t)s[i] << 16) * scale;
        break;
    }
    case KVA_DTYPE_E4M3: {
        const uint8_t* s = (const uint8_t*)src;
        for (i = 0; i < n; ++i) dst[i] = kva__cpu_e4m3_table[s[i]] * scale;
        break;
    }
    case KVA_DTYPE_E5M2: {
        const uint8_t* s = (const uint8_t*)src;
        for (i = 0; i < n; ++i) dst[i] = kva__cpu_e5m2_table[s[i]] * scale;
        break;
    }
    default:
        for (i = 0; i < n; ++i) dst[i] = 0.0f;
        break;
    }
    for (i = n; i < npad; ++i) dst[i] = 0.0f;
}

void kva__cpu_store_row_scalar(kva_dtype dt, const float* src, void* dst, int n, float scale) {
    int i;
    switch (dt) {
    case KVA_DTYPE_F32: {
        float* d = (float*)dst;
        for (i = 0; i < n; ++i) d[i] = src[i] * scale;
        break;
    }
    case KVA_DTYPE_F16: {
        uint16_t* d = (uint16_t*)dst;
        for (i = 0; i < n; ++i) d[i] = kva__cpu_f32_to_f16(src[i] * scale);
        break;
    }
    case KVA_DTYPE_BF16: {
        uint16_t* d = (uint16_t*)dst;
        for (i = 0; i < n; ++i) d[i] = kva__cpu_f32_to_bf16(src[i] * scale);
        break;
    }
    case KVA_DTYPE_E4M3: {
        uint8_t* d = (uint8_t*)dst;
        for (i = 0; i < n; ++i) d[i] = kva__cpu_f32_to_e4m3(src[i] * scale);
        break;
    }
    case KVA_DTYPE_E5M2: {
        uint8_t* d = (uint8_t*)dst;
        for (i = 0; i < n; ++i) d[i] = kva__cpu_f32_to_e5m2(src[i] * scale);
        break;
    }
    default: break;
    }
}
