/*
 * ref.h - float64 reference for kvattn's tests, written from the numerical contract in kvattn.h.
 *
 * Nothing here calls the library except for the enums and kva_tensor types of the public header:
 * the dtype codecs, RoPE, ALiBi slopes, masks and softmax/sigmoid are all computed here in double.
 */
#ifndef KVA_TEST_REF_H
#define KVA_TEST_REF_H

#include <stddef.h>
#include <stdint.h>

#include "kvattn.h"

/* ---- dtype codecs (one element) ---------------------------------------------------------------- */

double ref_decode_f16(uint16_t bits);
double ref_decode_bf16(uint16_t bits);
double ref_decode_e4m3(uint8_t bits); /* OCP e4m3 "fn": bias 7, no inf, S.1111.111 = NaN, max 448 */
double ref_decode_e5m2(uint8_t bits); /* IEEE-like: bias 15, inf and NaN at exponent 31 */
/* Element `index` of an array of dtype (f32, f16, bf16, e4m3, e5m2) as a double. */
double ref_decode(kva_dtype dtype, const void* base, size_t index);
/* Round x to the nearest value of dtype (ties to even) and store it. Out-of-range values become inf
 * (f16, bf16, e5m2, f32) or saturate to +-448 (e4m3, which has no inf). Returns the stored value. */
double ref_encode(kva_dtype dtype, void* base, size_t index, double x);
/* The value x becomes once stored in dtype. */
double ref_round(kva_dtype dtype, double x);
/* Element size in bytes (independent of kva_dtype_size). */
size_t ref_dtype_size(kva_dtype dtype);
/* A quiet NaN bit pattern of dtype written to base[index] (the poison value). */
void ref_store_nan(kva_dtype dtype, void* base, size_t index);

/* ---- ALiBi ---------------------------------------------------------------------------------------- */

/* Standard slope of head h of n heads (see ref.c for the formula). */
double ref_alibi_slope(int32_t head, int32_t num_heads);

/* ---- attention of one request --------------------------------------------------------------------- */

typedef struct ref_attn_cfg {
    int32_t num_qo_heads, num_kv_heads, head_dim_qk, head_dim_vo;
    kva_mask_mode mask_mode;
    int32_t window_left;   /* < 0: none */
    double soft_cap;       /* <= 0: none */
    double sm_scale;       /* <= 0: 1/sqrt(head_dim_qk) */
    kva_pos_encoding pos_encoding;
    double rope_scale;     /* <= 0: 1 */
    double rope_theta;     /* <= 0: 1e4 */
    kva_score_mode score_mode;
    double sigmoid_bias;
    const double* alibi_slopes; /* [num_qo_heads], NULL = standard slopes */
} ref_attn_cfg;

/*
 * One request of qo_len query rows over kv_len keys, all in double:
 *   q [qo_len][num_qo_heads][head_dim_qk]
 *   k [kv_len][num_kv_heads][head_dim_qk]   (already multiplied by k_scale)
 *   v [kv_len][num_kv_heads][head_dim_vo]   (already multiplied by v_scale)
 *   mask: the request's packed custom-mask segment (little bit order), only read for KVA_MASK_CUSTOM
 * Outputs:
 *   o   [qo_len][num_qo_heads][head_dim_vo]
 *   lse [qo_len][num_qo_heads] (base 2; -inf for rows with no visible key; NaN in sigmoid mode); may be NULL
 *   mag [qo_len][num_qo_heads][head_dim_vo] = sum_j w_j |v_j| (scale of the sum, for tolerances); may be NULL
 */
void ref_attention(const ref_attn_cfg* cfg, int64_t qo_len, int64_t kv_len, const double* q, const double* k,
                   const double* v, const uint8_t* mask, double* o, double* lse, double* mag);

/* Merge n attention states of one (row, head): lse[k] base 2, v[k*dim .. k*dim+dim). n may be 0.
 * out = sum_k w_k v_k / sum_k w_k, w_k = 2^(lse_k - max lse); lse_out = max + log2(sum w). All empty
 * (or n = 0): out = 0, lse_out = -inf. */
void ref_merge(int64_t n, const double* lse, const double* v, int64_t dim, double* v_out, double* lse_out);

/* log2(e) etc. */
#define REF_LN2 0.69314718055994530941723212145818

#endif /* KVA_TEST_REF_H */
