/*
 * Per-head attention sink: each query head h has a virtual key with logit sink[h] and value zero that joins the
 * softmax denominator:
 *     o = sum_j exp(x_j) v_j / (exp(sink[h]) + sum_j exp(x_j)).
 * With S = sum_j exp(x_j) = 2^lse (kvattn's lse is base 2), the sink only rescales the ordinary softmax output:
 *     o_sink = o_softmax * S / (S + exp(sink[h])) = o_softmax / (1 + exp(sink[h] - lse * ln 2)),
 * so it is an output transform. A row with no visible key has o = 0 and lse = -inf: the result stays 0.
 *
 * kvattn variant (docs/variants.md): hooks = KVA_VARIANT_OUTPUT_TRANSFORM, use_softmax = 1,
 * num_tensor_params = 1: p->t[0] = sink [num_qo_heads] f32 (backend memory). num_scalar_params = 0.
 * kvattn returns the lse of the real keys (without the sink).
 */
KVA_HOOK float kva_output_transform(const kva_vparams* p, float o, float lse, int batch, int qo_head, int q_pos,
                                    int dim) {
    (void)batch, (void)q_pos, (void)dim;
    return o / (1.0f + expf(p->t[0][qo_head] - lse * 0.69314718055994531f));
}
