/*
 * kva_variant.cuh - the kernels a user variant adds next to its instance of kva_decode.cuh (docs/variants.md).
 * Included after the variant's hooks (and the prelude: KVA_HOOK, kva_vparams), with KVA_VAR_HOOKS and
 * KVA_VAR_SOFTMAX defined.
 *
 *   KVA_VARIANT_CHECK 1: only kva_variant_check, a kernel calling every declared hook once, compiled when the
 *                        variant is created so that a bad source fails there (with the NVRTC log);
 *   otherwise:           KVA_VMERGE_NAME, the variant's split-KV merge: the plan's partial states of a row are
 *                        merged (softmax: lse-weighted; no softmax: summed) and the output transform is applied to
 *                        the merged row with its merged lse. One warp per (merge task, row); lanes along the head
 *                        dim. Persistent: the task count is read from the workspace (graph replays).
 */
#include "kva_common.cuh"

#if KVA_VARIANT_CHECK

extern "C" __global__ void kva_variant_check(const kvk_vparams p, float* out) {
    const kvk_vparams* vp = &p;
    float acc = 0.0f;
#if (KVA_VAR_HOOKS & 1)
    acc += kva_query_transform(vp, 1.0f, 0, 0, 0, 0);
#endif
#if (KVA_VAR_HOOKS & 2)
    acc += kva_key_transform(vp, 1.0f, 0, 0, 0, 0);
#endif
#if (KVA_VAR_HOOKS & 4)
    acc += kva_logits_transform(vp, 1.0f, 0, 0, 0, 0, 0);
#endif
#if (KVA_VAR_HOOKS & 8)
    acc += (float)kva_logits_mask(vp, 0, 0, 0, 0, 0);
#endif
#if (KVA_VAR_HOOKS & 16)
    acc += kva_output_transform(vp, 1.0f, 0.0f, 0, 0, 0, 0);
#endif
    out[threadIdx.x] = acc;
}

#else

#ifndef KVA_VMERGE_NAME
#error "KVA_VMERGE_NAME must be defined"
#endif

extern "C" __global__ void __launch_bounds__(KVK_THREADS, 1) KVA_VMERGE_NAME(const __grid_constant__ kvk_vmerge_params vmp) {
    kva_pdl_start(); /* programmatic dependent launch (kva_common.cuh) */
    kva_pdl_wait();
    const kvk_merge_params& p = vmp.base;
    const kvk_vparams* const vp = &vmp.vp;
    (void)vp;
    const kvk_counts* counts = (const kvk_counts*)(p.ws + p.off_counts);
    const kvk_merge_task* tasks = (const kvk_merge_task*)(p.ws + p.off_merge);
    const kvk_request* reqs = (const kvk_request*)(p.ws + p.off_requests);
    const float* po = (const float*)(p.ws + p.off_partial_o);
    const float* pl = (const float*)(p.ws + p.off_partial_lse);
    const float neg_inf = KVA_NEG_INF;
    const long long units = (long long)counts->num_merge * p.tile_q;
    const int lane = threadIdx.x & 31;
    const long long nwarps = (long long)gridDim.x * (blockDim.x >> 5);
    for (long long u = (long long)blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5); u < units; u += nwarps) {
        const kvk_merge_task tk = tasks[u / p.tile_q];
        const int r = (int)(u % p.tile_q);
        if (r >= tk.rows) continue;
        const int n = tk.num_partials;
        const float* lr = pl + (long long)tk.partial_first * p.tile_q + r; /* lse of partial k: lr[k * tile_q] */
        const float* orow = po + ((long long)tk.partial_first * p.tile_q + r) * p.dvo;
        const long long ostep = (long long)p.tile_q * p.dvo;
        float mx = neg_inf;
        int fault = 0;
        for (int k = lane; k < n; k += 32) {
            const float l = __ldcg(lr + (long long)k * p.tile_q);
            if (__float_as_uint(l) == KVK_FAULT_LSE_BITS) fault = 1;
            else mx = fmaxf(mx, l);
        }
        mx = kva_warp_max(mx);
        fault = __any_sync(0xffffffffu, fault);
        const float m_use = mx == neg_inf ? 0.0f : mx;
        float wsum = 0.0f;
        for (int k = 0; k < n; ++k) wsum += KVA_VAR_SOFTMAX ? kva_exp2(__ldcg(lr + (long long)k * p.tile_q) - m_use) : 1.0f;
        float scale = KVA_VAR_SOFTMAX ? (wsum > 0.0f ? 1.0f / wsum : 0.0f) : 1.0f;
        float lse = KVA_VAR_SOFTMAX ? (wsum > 0.0f ? m_use + kva_log2(wsum) : neg_inf) : neg_inf;
        if (fault) {
            scale = 0.0f;
            lse = neg_inf;
        }
        const kvk_request rq = reqs[tk.req];
        const int pr = tk.row_start + r;
        const int i = pr / p.group_size;
        const int qh = tk.kv_head * p.group_size + pr % p.group_size;
        const long long obase = ((long long)rq.qo_start + i) * p.o_stride_row + (long long)qh * p.o_stride_head;
        for (int d = lane; d < p.dvo; d += 32) {
            float a = 0.0f;
            if (!fault)
                for (int k = 0; k < n; ++k) {
                    const float w = KVA_VAR_SOFTMAX ? kva_exp2(__ldcg(lr + (long long)k * p.tile_q) - m_use) : 1.0f;
                    if (w != 0.0f) a = fmaf(w, __ldcg(orow + (long long)k * ostep + d), a);
                }
            float o = a * scale;
#if (KVA_VAR_HOOKS & 16)
            if (!fault) o = kva_output_transform(vp, o, lse, tk.req, qh, rq.kv_len - rq.qo_len + i, d);
#endif
            kva_store_elem(p.o, obase + d, p.o_dtype, o);
        }
        if (lane == 0 && p.lse)
            p.lse[((long long)rq.qo_start + i) * p.lse_stride_row + (long long)qh * p.lse_stride_head] = lse;
    }
}

#endif
