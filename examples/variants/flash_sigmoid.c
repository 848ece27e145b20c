/*
 * FlashSigmoid: sigmoid attention, o = sum_j sigmoid(scale * logit_j + bias) v_j over the visible keys.
 *
 * kvattn variant (docs/variants.md): hooks = KVA_VARIANT_LOGITS_TRANSFORM, use_softmax = 0,
 * num_scalar_params = 2: p->s[0] = scale, p->s[1] = bias. num_tensor_params = 0.
 * The logit given to the hook is sm_scale * k_scale * q.k (natural-log domain); with desc->sm_scale = 1 and
 * k_scale = 1 it is q.k, so scale plays the role of the usual 1 / sqrt(head_dim).
 */
KVA_HOOK float kva_logits_transform(const kva_vparams* p, float logit, int batch, int qo_head, int kv_head,
                                    int q_pos, int kv_pos) {
    (void)batch, (void)qo_head, (void)kv_head, (void)q_pos, (void)kv_pos;
    return 1.0f / (1.0f + expf(-(p->s[0] * logit + p->s[1])));
}
