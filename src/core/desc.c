/* desc.c - attention descriptor defaults, validation, ALiBi slopes. */
#include <math.h>
#include <string.h>

#include "internal.h"

KVA_API void kva_attention_desc_init(kva_attention_desc* desc, int32_t num_qo_heads, int32_t num_kv_heads,
                                     int32_t head_dim, kva_dtype dtype) {
    if (!desc) return;
    memset(desc, 0, sizeof *desc);
    desc->num_qo_heads = num_qo_heads;
    desc->num_kv_heads = num_kv_heads;
    desc->head_dim_qk = head_dim;
    desc->head_dim_vo = head_dim;
    desc->q_dtype = dtype;
    desc->kv_dtype = dtype;
    desc->o_dtype = dtype;
    desc->mask_mode = KVA_MASK_NONE;
    desc->window_left = -1;
    desc->logits_soft_cap = 0.0f;
    desc->sm_scale = 0.0f;
    desc->pos_encoding = KVA_POS_NONE;
    desc->rope_scale = 1.0f;
    desc->rope_theta = 1e4f;
    desc->score_mode = KVA_SCORE_SOFTMAX;
    desc->sigmoid_bias = 0.0f;
    desc->variant = NULL;
}


kva_status kva__desc_normalize(const kva_attention_desc* in, kva_attention_desc* out) {
    KVA_RETURN_IF(!in, KVA_ERR_INVALID_ARGUMENT, "desc is NULL");
    kva_attention_desc d = *in;
    KVA_RETURN_IF(d.num_qo_heads <= 0, KVA_ERR_INVALID_ARGUMENT, "desc->num_qo_heads = %d must be positive",
                  (int)d.num_qo_heads);
    KVA_RETURN_IF(d.num_kv_heads <= 0, KVA_ERR_INVALID_ARGUMENT, "desc->num_kv_heads = %d must be positive",
                  (int)d.num_kv_heads);
    KVA_RETURN_IF(d.num_qo_heads % d.num_kv_heads != 0, KVA_ERR_INVALID_ARGUMENT,
                  "desc->num_qo_heads = %d is not a multiple of desc->num_kv_heads = %d", (int)d.num_qo_heads,
                  (int)d.num_kv_heads);
    KVA_RETURN_IF(d.num_qo_heads / d.num_kv_heads > KVA__MAX_TILE_Q, KVA_ERR_UNSUPPORTED,
                  "GQA group size %d (= %d / %d) exceeds the supported maximum %d",
                  (int)(d.num_qo_heads / d.num_kv_heads), (int)d.num_qo_heads, (int)d.num_kv_heads, KVA__MAX_TILE_Q);
    KVA_RETURN_IF(d.head_dim_qk <= 0 || d.head_dim_vo <= 0, KVA_ERR_INVALID_ARGUMENT,
                  "desc->head_dim_qk = %d and head_dim_vo = %d must be positive", (int)d.head_dim_qk,
                  (int)d.head_dim_vo);
    KVA_RETURN_IF(!kva__is_float_dtype(d.q_dtype), KVA_ERR_UNSUPPORTED,
                  "desc->q_dtype = %s: queries must be f32, f16 or bf16", kva_dtype_name(d.q_dtype));
    KVA_RETURN_IF(!kva__is_float_dtype(d.o_dtype), KVA_ERR_UNSUPPORTED,
                  "desc->o_dtype = %s: outputs must be f32, f16 or bf16", kva_dtype_name(d.o_dtype));
    KVA_RETURN_IF(!kva__is_kv_dtype(d.kv_dtype), KVA_ERR_UNSUPPORTED,
                  "desc->kv_dtype = %s: KV must be f32, f16, bf16, e4m3 or e5m2", kva_dtype_name(d.kv_dtype));
    KVA_RETURN_IF(d.mask_mode != KVA_MASK_NONE && d.mask_mode != KVA_MASK_CAUSAL && d.mask_mode != KVA_MASK_CUSTOM,
                  KVA_ERR_INVALID_ARGUMENT, "desc->mask_mode = %d is not a kva_mask_mode", (int)d.mask_mode);
    KVA_RETURN_IF(d.window_left < -1, KVA_ERR_INVALID_ARGUMENT,
                  "desc->window_left = %d: use -1 for no window or a value >= 0", (int)d.window_left);
    KVA_RETURN_IF(!isfinite(d.logits_soft_cap) || d.logits_soft_cap < 0.0f, KVA_ERR_INVALID_ARGUMENT,
                  "desc->logits_soft_cap = %g must be finite and >= 0 (0 = off)", (double)d.logits_soft_cap);
    KVA_RETURN_IF(!isfinite(d.sm_scale), KVA_ERR_INVALID_ARGUMENT, "desc->sm_scale = %g is not finite",
                  (double)d.sm_scale);
    if (d.sm_scale == 0.0f) d.sm_scale = (float)(1.0 / sqrt((double)d.head_dim_qk));
    KVA_RETURN_IF(d.pos_encoding != KVA_POS_NONE && d.pos_encoding != KVA_POS_ROPE_LLAMA &&
                      d.pos_encoding != KVA_POS_ALIBI,
                  KVA_ERR_INVALID_ARGUMENT, "desc->pos_encoding = %d is not a kva_pos_encoding", (int)d.pos_encoding);
    if (d.rope_scale == 0.0f) d.rope_scale = 1.0f;
    if (d.rope_theta == 0.0f) d.rope_theta = 1e4f;
    if (d.pos_encoding == KVA_POS_ROPE_LLAMA) {
        KVA_RETURN_IF(d.head_dim_qk % 2 != 0, KVA_ERR_UNSUPPORTED,
                      "fused RoPE needs an even head_dim_qk (got %d)", (int)d.head_dim_qk);
        KVA_RETURN_IF(!isfinite(d.rope_scale) || d.rope_scale <= 0.0f, KVA_ERR_INVALID_ARGUMENT,
                      "desc->rope_scale = %g must be finite and > 0", (double)d.rope_scale);
        KVA_RETURN_IF(!isfinite(d.rope_theta) || d.rope_theta <= 0.0f, KVA_ERR_INVALID_ARGUMENT,
                      "desc->rope_theta = %g must be finite and > 0", (double)d.rope_theta);
    }
    KVA_RETURN_IF(d.score_mode != KVA_SCORE_SOFTMAX && d.score_mode != KVA_SCORE_SIGMOID, KVA_ERR_INVALID_ARGUMENT,
                  "desc->score_mode = %d is not a kva_score_mode", (int)d.score_mode);
    KVA_RETURN_IF(!isfinite(d.sigmoid_bias), KVA_ERR_INVALID_ARGUMENT, "desc->sigmoid_bias is not finite");
    if (d.variant) {
        /* the variant's use_softmax decides the scores; fused RoPE would rotate transformed values (the hooks are
           element-wise and cannot see the partner dimension) */
        KVA_RETURN_IF(d.score_mode != KVA_SCORE_SOFTMAX, KVA_ERR_INVALID_ARGUMENT,
                      "desc->score_mode must be KVA_SCORE_SOFTMAX with a variant (the variant's use_softmax chooses "
                      "softmax or plain weights)");
        KVA_RETURN_IF(d.pos_encoding == KVA_POS_ROPE_LLAMA, KVA_ERR_UNSUPPORTED,
                      "desc->pos_encoding = KVA_POS_ROPE_LLAMA with a variant is not supported (apply RoPE to q and k "
                      "before the call)");
    }
    if (out) *out = d;
    return KVA_OK;
}

KVA_API kva_status kva_attention_desc_check(const kva_context* context, const kva_attention_desc* desc) {
    KVA_RETURN_IF(!context, KVA_ERR_INVALID_ARGUMENT, "kva_attention_desc_check: context is NULL");
    kva_attention_desc d;
    KVA_FORWARD(kva__desc_normalize(desc, &d));
    if (d.variant) KVA_FORWARD(kva__variant_check_live((kva_context*)context, d.variant, 0, "desc->variant"));
    /* supported for at least one op */
    kva_status st = context->ops->check_desc(context, &d, KVA_OP_BATCH_DECODE);
    if (st == KVA_OK) return KVA_OK;
    return context->ops->check_desc(context, &d, KVA_OP_BATCH_PREFILL_PAGED);
}

float kva__alibi_slope(int32_t head, int32_t num_heads) {
    /* Standard ALiBi: n2 = largest power of two <= num_heads; heads h < n2 get 2^(-8(h+1)/n2); the remaining
       heads take the odd powers of 2^(-4/n2): 2^(-4(2k+1)/n2), k = h - n2. */
    int32_t n2 = 1;
    while (n2 <= num_heads / 2) n2 *= 2; /* (n2 * 2 would overflow for num_heads >= 2^30) */
    if (head < n2) return (float)exp2(-8.0 * (double)(head + 1) / (double)n2);
    int32_t k = head - n2;
    return (float)exp2(-4.0 * (double)(2 * k + 1) / (double)n2);
}

KVA_API kva_status kva_alibi_slopes(int32_t num_heads, float* slopes) {
    KVA_RETURN_IF(num_heads <= 0, KVA_ERR_INVALID_ARGUMENT, "kva_alibi_slopes: num_heads = %d must be positive",
                  (int)num_heads);
    KVA_RETURN_IF(!slopes, KVA_ERR_INVALID_ARGUMENT, "kva_alibi_slopes: slopes is NULL");
    for (int32_t h = 0; h < num_heads; ++h) slopes[h] = kva__alibi_slope(h, num_heads);
    return KVA_OK;
}
