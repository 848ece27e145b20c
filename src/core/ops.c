/* ops.c - run-time validation against the plan, the named operations, single-request ops, merges, append. */
#include <math.h>
#include <stdlib.h>
#include <stdio.h>
#include <string.h>

#include "internal.h"

KVA_API void kva_run_args_init(kva_run_args* args) {
    if (!args) return;
    memset(args, 0, sizeof *args);
    args->k_scale = 1.0f;
    args->v_scale = 1.0f;
}

static const char* kva__op_name(kva_op op) {
    switch (op) {
    case KVA_OP_BATCH_DECODE: return "batch decode";
    case KVA_OP_BATCH_PREFILL_PAGED: return "batch prefill (paged)";
    case KVA_OP_BATCH_PREFILL_RAGGED: return "batch prefill (ragged)";
    }
    return "unknown op";
}

static kva_status kva__check_plan(const kva_context* ctx, const kva_plan* plan, const kva_workspace* ws,
                                  const kva__plan_data** out) {
    KVA_RETURN_IF(!ctx, KVA_ERR_INVALID_ARGUMENT, "run: context is NULL");
    KVA_RETURN_IF(!plan, KVA_ERR_INVALID_ARGUMENT, "run: plan is NULL");
    KVA_RETURN_IF(!ws, KVA_ERR_INVALID_ARGUMENT, "run: workspace is NULL");
    const kva__plan_data* pd = kva__plan_data_ofc(plan);
    KVA_RETURN_IF(!kva__plan_intact(pd), KVA_ERR_PLAN_MISMATCH,
                  "run: the plan was not made by kva_plan_make (bad magic or version) or its bytes changed since "
                  "(corrupted)");
    KVA_RETURN_IF(pd->context_id != ctx->id, KVA_ERR_PLAN_MISMATCH,
                  "run: the plan was made by another context (plans are tied to their context's backend and workers)");
    KVA_RETURN_IF(pd->ws_device_addr != (uint64_t)(uintptr_t)ws->device || ws->device_bytes < pd->device_bytes,
                  KVA_ERR_PLAN_MISMATCH,
                  "run: the workspace (%p, %zu bytes) is not the one the plan was written into (%p, %zu bytes needed)",
                  ws->device, ws->device_bytes, (void*)(uintptr_t)pd->ws_device_addr, pd->device_bytes);
    /* an eager plan runs only while it is the latest plan into its workspace; graph-mode plans are re-planned into
       their workspace under a captured graph by design (their kernels read the counts from the workspace), so they
       run while the latest plan there is such a re-plan (same graph_key) */
    const int current = !pd->stamp || kva__stamp_current(pd->ws_device_addr, pd->stamp, pd->graph_key);
    KVA_RETURN_IF(!current && !pd->graph_mode, KVA_ERR_PLAN_MISMATCH,
                  "run: a later plan was made into this workspace (%p), replacing this plan's work list; plan again, "
                  "or give each plan its own workspace (plans may share one scratch region)",
                  (void*)(uintptr_t)pd->ws_device_addr);
    KVA_RETURN_IF(!current, KVA_ERR_PLAN_MISMATCH,
                  "run: a later plan into this workspace (%p) is not a graph-mode re-plan of this plan (an eager plan, "
                  "or other bounds, op, descriptor or context): its work list has another layout; plan again",
                  (void*)(uintptr_t)pd->ws_device_addr);
    KVA_RETURN_IF(pd->ws_scratch_addr != (uint64_t)(uintptr_t)ws->scratch ||
                      (pd->ws_scratch_addr && ws->scratch_bytes < pd->scratch_bytes),
                  KVA_ERR_PLAN_MISMATCH,
                  "run: the workspace scratch (%p, %zu bytes) is not the one the plan put its partials in (%p, %zu "
                  "bytes needed)",
                  ws->scratch, ws->scratch_bytes, (void*)(uintptr_t)pd->ws_scratch_addr, pd->scratch_bytes);
    KVA_RETURN_IF(pd->num_items < 0 || pd->num_items > pd->cap_items || pd->num_merge > pd->cap_merge ||
                      pd->num_partials > pd->cap_partials || pd->num_workers < 1 ||
                      pd->num_workers > ctx->num_workers ||
                      (pd->graph_mode && pd->cluster_size > 1 && pd->num_workers != ctx->cluster_ctas),
                  KVA_ERR_PLAN_MISMATCH, "run: the plan is inconsistent (corrupted?)");
    *out = pd;
    return KVA_OK;
}

static kva_status kva__check_paged(const kva__plan_data* pd, const kva_paged_kv* pk) {
    const kva_attention_desc* d = &pd->desc;
    KVA_RETURN_IF(pk->dtype != d->kv_dtype, KVA_ERR_PLAN_MISMATCH, "run: paged.dtype = %s, the plan has kv_dtype %s",
                  kva_dtype_name(pk->dtype), kva_dtype_name(d->kv_dtype));
    KVA_RETURN_IF(pk->page_size != pd->page_size, KVA_ERR_PLAN_MISMATCH,
                  "run: paged.page_size = %d, the plan has page_size %d", (int)pk->page_size, (int)pd->page_size);
    KVA_RETURN_IF(pk->num_pages < pd->num_pages || pk->num_pages < 0, KVA_ERR_PLAN_MISMATCH,
                  "run: paged.num_pages = %lld, but the plan checked its page table against a pool of %lld pages",
                  (long long)pk->num_pages, (long long)pd->num_pages);
    KVA_RETURN_IF(pd->num_page_entries > 0 && pk->num_pages < 1, KVA_ERR_INVALID_ARGUMENT,
                  "run: paged.num_pages = %lld: the pool size bounds every page index", (long long)pk->num_pages);
    KVA_RETURN_IF(pk->num_heads != d->num_kv_heads, KVA_ERR_PLAN_MISMATCH,
                  "run: paged.num_heads = %d, the descriptor has %d KV heads", (int)pk->num_heads,
                  (int)d->num_kv_heads);
    KVA_RETURN_IF(pk->head_dim_qk != d->head_dim_qk || pk->head_dim_vo != d->head_dim_vo, KVA_ERR_PLAN_MISMATCH,
                  "run: paged head dims (%d, %d) differ from the descriptor's (%d, %d)", (int)pk->head_dim_qk,
                  (int)pk->head_dim_vo, (int)d->head_dim_qk, (int)d->head_dim_vo);
    KVA_FORWARD(kva__check_paged_fields("run", pk));
    KVA_RETURN_IF(pk->num_indices > 0 && pk->num_indices < pd->num_page_entries, KVA_ERR_PAGETABLE_MALFORMED,
                  "run: the plan's page table has %lld entries (kv_indptr[B], or a block table's used span) but "
                  "paged.indices holds %lld (paged.num_indices)",
                  (long long)pd->num_page_entries, (long long)pk->num_indices);
    /* a graph-mode plan's run reads the work list in its workspace, which a later plan of the same bounds may have
       replaced with requests that have pages: its runs always need the pools and the page table */
    if (pd->num_page_entries > 0 || pd->graph_mode) {
        KVA_RETURN_IF(!pk->k_data || !pk->v_data, KVA_ERR_INVALID_ARGUMENT, "run: paged.k_data or v_data is NULL%s",
                      pd->num_page_entries > 0 ? "" : " (graph-mode plans always need the pools)");
        KVA_RETURN_IF(!pk->indices, KVA_ERR_INVALID_ARGUMENT, "run: paged.indices is NULL%s",
                      pd->num_page_entries > 0 ? "" : " (graph-mode plans always need the page table: a later plan "
                                                      "into the same workspace may have pages)");
    }
    return KVA_OK;
}

static kva_status kva__check_run_args(const kva__plan_data* pd, const kva_run_args* a) {
    const kva_attention_desc* d = &pd->desc;
    KVA_RETURN_IF(!a, KVA_ERR_INVALID_ARGUMENT, "run: args is NULL");
    KVA_RETURN_IF(a->enable_pdl != 0 && a->enable_pdl != 1, KVA_ERR_INVALID_ARGUMENT,
                  "run: enable_pdl = %d (must be 0 or 1)", (int)a->enable_pdl);
    const int64_t rows = pd->total_qo_rows;
    if (rows > 0) {
        int64_t qs[3] = {rows, d->num_qo_heads, d->head_dim_qk};
        int64_t os[3] = {rows, d->num_qo_heads, d->head_dim_vo};
        KVA_FORWARD(kva__check_tensor("run: q", &a->q, d->q_dtype, 3, qs));
        KVA_FORWARD(kva__check_tensor("run: o", &a->o, d->o_dtype, 3, os));
        KVA_FORWARD(kva__check_written("run: o", &a->o));
        if (a->lse.data) {
            KVA_RETURN_IF(d->score_mode == KVA_SCORE_SIGMOID, KVA_ERR_INVALID_ARGUMENT,
                          "run: lse is not defined in sigmoid (no-softmax) mode; pass lse.data = NULL");
            KVA_RETURN_IF(d->variant && !d->variant->use_softmax, KVA_ERR_INVALID_ARGUMENT,
                          "run: lse is not defined for variant %s (use_softmax = 0); pass lse.data = NULL",
                          d->variant->name);
            int64_t ls[2] = {rows, d->num_qo_heads};
            KVA_FORWARD(kva__check_tensor("run: lse", &a->lse, KVA_DTYPE_F32, 2, ls));
            KVA_FORWARD(kva__check_written("run: lse", &a->lse));
        }
    }
    KVA_RETURN_IF(!isfinite(a->k_scale) || !isfinite(a->v_scale), KVA_ERR_INVALID_ARGUMENT,
                  "run: k_scale = %g and v_scale = %g must be finite", (double)a->k_scale, (double)a->v_scale);
    if ((kva_op)pd->op == KVA_OP_BATCH_PREFILL_RAGGED) {
        if (pd->total_kv_tokens > 0) {
            int64_t ks[3] = {pd->total_kv_tokens, d->num_kv_heads, d->head_dim_qk};
            int64_t vs[3] = {pd->total_kv_tokens, d->num_kv_heads, d->head_dim_vo};
            KVA_FORWARD(kva__check_tensor("run: k", &a->k, d->kv_dtype, 3, ks));
            KVA_FORWARD(kva__check_tensor("run: v", &a->v, d->kv_dtype, 3, vs));
        }
    } else {
        KVA_FORWARD(kva__check_paged(pd, &a->paged));
    }
    /* a negative size is a bad count even where the plan's lengths need no mask byte (the CPU run compared each
       request's empty segment with it and reported a plan mismatch) */
    KVA_RETURN_IF(d->mask_mode == KVA_MASK_CUSTOM && a->custom_mask_bytes < 0, KVA_ERR_INVALID_ARGUMENT,
                  "run: custom_mask_bytes = %lld is negative", (long long)a->custom_mask_bytes);
    if (d->mask_mode == KVA_MASK_CUSTOM && pd->custom_mask_bytes > 0) {
        KVA_RETURN_IF(!a->custom_mask, KVA_ERR_INVALID_ARGUMENT, "run: the plan has a custom mask but custom_mask is NULL");
        KVA_RETURN_IF(a->custom_mask_bytes < pd->custom_mask_bytes, KVA_ERR_INVALID_ARGUMENT,
                      "run: custom_mask_bytes = %lld, the plan's lengths need %lld bytes (one byte-aligned segment "
                      "of qo_len * kv_len bits per request)",
                      (long long)a->custom_mask_bytes, (long long)pd->custom_mask_bytes);
    }
    return KVA_OK;
}

KVA_API kva_status kva_run(kva_context* context, const kva_plan* plan, const kva_workspace* workspace,
                           const kva_run_args* args) {
    const kva__plan_data* pd = NULL;
    KVA_FORWARD(kva__check_plan(context, plan, workspace, &pd));
    KVA_RETURN_IF(!args, KVA_ERR_INVALID_ARGUMENT, "run: args is NULL");
    KVA_FORWARD(kva__variant_check_args(context, &pd->desc, pd->variant_id, args, NULL));
    KVA_FORWARD(kva__check_run_args(pd, args));
    if (pd->total_qo_rows == 0) return KVA_OK;
    return context->ops->run(context, pd, workspace, args);
}

static kva_status kva__run_op(kva_context* ctx, const kva_plan* plan, const kva_workspace* ws, const kva_run_args* args,
                              kva_op op) {
    KVA_RETURN_IF(!plan, KVA_ERR_INVALID_ARGUMENT, "run: plan is NULL");
    const kva__plan_data* pd = kva__plan_data_ofc(plan);
    KVA_RETURN_IF(pd->magic == KVA__PLAN_MAGIC && (kva_op)pd->op != op, KVA_ERR_PLAN_MISMATCH,
                  "run: the plan is for %s, not %s", kva__op_name((kva_op)pd->op), kva__op_name(op));
    return kva_run(ctx, plan, ws, args);
}

KVA_API kva_status kva_batch_decode_plan(kva_context* context, const kva_attention_desc* desc,
                                         const kva_plan_params* params, const kva_workspace* workspace, kva_plan* plan,
                                         void* stream) {
    return kva_plan_make(context, desc, KVA_OP_BATCH_DECODE, params, workspace, plan, stream);
}
KVA_API kva_status kva_batch_decode_run(kva_context* context, const kva_plan* plan, const kva_workspace* workspace,
                                        const kva_run_args* args) {
    return kva__run_op(context, plan, workspace, args, KVA_OP_BATCH_DECODE);
}
KVA_API kva_status kva_batch_prefill_paged_plan(kva_context* context, const kva_attention_desc* desc,
                                                const kva_plan_params* params, const kva_workspace* workspace,
                                                kva_plan* plan, void* stream) {
    return kva_plan_make(context, desc, KVA_OP_BATCH_PREFILL_PAGED, params, workspace, plan, stream);
}
KVA_API kva_status kva_batch_prefill_paged_run(kva_context* context, const kva_plan* plan,
                                               const kva_workspace* workspace, const kva_run_args* args) {
    return kva__run_op(context, plan, workspace, args, KVA_OP_BATCH_PREFILL_PAGED);
}
KVA_API kva_status kva_batch_prefill_ragged_plan(kva_context* context, const kva_attention_desc* desc,
                                                 const kva_plan_params* params, const kva_workspace* workspace,
                                                 kva_plan* plan, void* stream) {
    return kva_plan_make(context, desc, KVA_OP_BATCH_PREFILL_RAGGED, params, workspace, plan, stream);
}
KVA_API kva_status kva_batch_prefill_ragged_run(kva_context* context, const kva_plan* plan,
                                                const kva_workspace* workspace, const kva_run_args* args) {
    return kva__run_op(context, plan, workspace, args, KVA_OP_BATCH_PREFILL_RAGGED);
}

/* ---------------------------------------------------------------------------------------------- */
/* Single-request ops: a one-request ragged plan over contiguous (any-stride) K/V.                  */

static void kva__single_params(kva_plan_params* p, int32_t* qo_indptr, int32_t* kv_indptr, int64_t qo_len,
                               int64_t kv_len) {
    kva_plan_params_init(p);
    qo_indptr[0] = 0;
    qo_indptr[1] = (int32_t)qo_len;
    kv_indptr[0] = 0;
    kv_indptr[1] = (int32_t)kv_len;
    p->batch_size = 1;
    p->qo_indptr = qo_indptr;
    p->kv_indptr = kv_indptr;
}

KVA_API kva_status kva_single_workspace_size(kva_context* context, const kva_attention_desc* desc, int64_t qo_len,
                                             int64_t kv_len, size_t* device_bytes, size_t* host_bytes) {
    KVA_RETURN_IF(qo_len < 0 || kv_len < 0 || qo_len > INT32_MAX / 2 || kv_len > INT32_MAX / 2,
                  KVA_ERR_INVALID_ARGUMENT, "kva_single_workspace_size: qo_len = %lld, kv_len = %lld out of range",
                  (long long)qo_len, (long long)kv_len);
    kva_plan_params p;
    int32_t qi[2], ki[2];
    kva__single_params(&p, qi, ki, qo_len, kv_len);
    return kva_plan_workspace_size(context, desc, KVA_OP_BATCH_PREFILL_RAGGED, &p, device_bytes, host_bytes);
}

static kva_status kva__single(kva_context* ctx, const kva_attention_desc* desc, const kva_run_args* args,
                              const kva_workspace* ws, bool decode) {
    KVA_RETURN_IF(!ctx, KVA_ERR_INVALID_ARGUMENT, "single: context is NULL");
    KVA_RETURN_IF(!args, KVA_ERR_INVALID_ARGUMENT, "single: args is NULL");
    kva_attention_desc nd;
    KVA_FORWARD(kva__desc_normalize(desc, &nd));
    kva_run_args a = *args;
    /* Decode accepts q/o as [heads, dim] and lse as [heads]. */
    if (decode) {
        kva_tensor* ts[3] = {&a.q, &a.o, &a.lse};
        for (int i = 0; i < 3; ++i) {
            kva_tensor* t = ts[i];
            int32_t want = i == 2 ? 1 : 2;
            if (t->data && t->ndim == want) {
                for (int k = want; k > 0; --k) {
                    t->shape[k] = t->shape[k - 1];
                    t->stride[k] = t->stride[k - 1];
                }
                t->shape[0] = 1;
                /* the one row's stride addresses nothing: the contiguous value where it is representable (huge or
                   negative extents are refused by the tensor checks below, without overflowing here) */
                t->stride[0] = t->shape[1] > 0 && t->stride[1] >= 0 && t->stride[1] <= INT64_MAX / t->shape[1]
                                   ? t->shape[1] * t->stride[1]
                                   : 0;
                t->ndim = want + 1;
            }
        }
        KVA_RETURN_IF(a.q.ndim == 3 && a.q.shape[0] != 1, KVA_ERR_INVALID_ARGUMENT,
                      "single decode: q has %lld rows; decode takes one row (use kva_single_prefill)",
                      (long long)a.q.shape[0]);
    }
    KVA_RETURN_IF(a.q.ndim != 3 || a.k.ndim != 3, KVA_ERR_INVALID_ARGUMENT,
                  "single: q and k must be 3-D ([rows, heads, dim]; got %d and %d dims)", (int)a.q.ndim,
                  (int)a.k.ndim);
    int64_t qo_len = a.q.shape[0], kv_len = a.k.shape[0];
    KVA_RETURN_IF(qo_len < 0 || kv_len < 0 || qo_len > INT32_MAX / 2 || kv_len > INT32_MAX / 2,
                  KVA_ERR_INVALID_ARGUMENT, "single: qo_len = %lld, kv_len = %lld out of range", (long long)qo_len,
                  (long long)kv_len);
    kva_plan_params p;
    int32_t qi[2], ki[2];
    kva__single_params(&p, qi, ki, qo_len, kv_len);
    {
        /* Check the tensors before the plan writes the caller's workspace. */
        kva__plan_data pd;
        KVA_FORWARD(kva__plan_layout(ctx, &nd, KVA_OP_BATCH_PREFILL_RAGGED, &p, &pd));
        KVA_FORWARD(kva__check_run_args(&pd, &a));
        KVA_FORWARD(kva__variant_check_args(ctx, &pd.desc, pd.variant_id, &a, NULL));
    }
    kva_workspace local;
    memset(&local, 0, sizeof local);
    void* owned = NULL;
    if (!ws) {
        KVA_RETURN_IF(!ctx->ops->plans_on_host_memory, KVA_ERR_INVALID_ARGUMENT,
                      "single: this backend needs a workspace (size from kva_single_workspace_size)");
        size_t dev = 0;
        KVA_FORWARD(kva_plan_workspace_size(ctx, &nd, KVA_OP_BATCH_PREFILL_RAGGED, &p, &dev, NULL));
        owned = aligned_alloc(KVA__WS_ALIGN, kva__align_up(dev > 0 ? dev : KVA__WS_ALIGN, KVA__WS_ALIGN));
        KVA_RETURN_IF(!owned, KVA_ERR_OUT_OF_MEMORY, "single: out of host memory for a %zu-byte workspace", dev);
        local.device = owned;
        local.device_bytes = kva__align_up(dev > 0 ? dev : KVA__WS_ALIGN, KVA__WS_ALIGN);
        ws = &local;
    }
    kva_plan plan;
    kva_status st = kva_plan_make(ctx, &nd, KVA_OP_BATCH_PREFILL_RAGGED, &p, ws, &plan, a.stream);
    if (st == KVA_OK) st = kva_run(ctx, &plan, ws, &a);
    free(owned);
    return st;
}

KVA_API kva_status kva_single_decode(kva_context* context, const kva_attention_desc* desc, const kva_run_args* args,
                                     const kva_workspace* workspace) {
    return kva__single(context, desc, args, workspace, true);
}
KVA_API kva_status kva_single_prefill(kva_context* context, const kva_attention_desc* desc, const kva_run_args* args,
                                      const kva_workspace* workspace) {
    return kva__single(context, desc, args, workspace, false);
}

/* ---------------------------------------------------------------------------------------------- */
/* Merges                                                                                          */

static kva_status kva__check_state(const char* name, const kva_tensor* v, const kva_tensor* s, int64_t rows,
                                   int64_t heads, int64_t dim, bool s_optional) {
    KVA_RETURN_IF(rows < 0 || heads < 0 || dim < 0, KVA_ERR_INVALID_ARGUMENT,
                  "%s: shape [%lld, %lld, %lld] has a negative extent", name, (long long)rows, (long long)heads,
                  (long long)dim);
    /* a state with no elements may have a NULL pointer (PyTorch's empty tensors): nothing is read or written */
    const bool empty = rows == 0 || heads == 0;
    KVA_RETURN_IF(!v || (!v->data && !empty && dim > 0), KVA_ERR_INVALID_ARGUMENT, "%s: v is NULL", name);
    KVA_RETURN_IF(!kva__is_float_dtype(v->dtype), KVA_ERR_UNSUPPORTED, "%s: v dtype %s (f32, f16 or bf16 expected)", name,
                  kva_dtype_name(v->dtype));
    int64_t vs[3] = {rows, heads, dim};
    kva_status st = kva__check_tensor(name, v, v->dtype, 3, vs);
    if (st == KVA_ERR_PLAN_MISMATCH) st = kva__retag_error(KVA_ERR_INVALID_ARGUMENT);
    KVA_FORWARD(st);
    if (!s || (!s->data && (s_optional || !empty))) {
        KVA_RETURN_IF(!s_optional, KVA_ERR_INVALID_ARGUMENT, "%s: s (lse) is NULL", name);
        return KVA_OK;
    }
    int64_t ss[2] = {rows, heads};
    st = kva__check_tensor(name, s, KVA_DTYPE_F32, 2, ss);
    if (st == KVA_ERR_PLAN_MISMATCH) st = kva__retag_error(KVA_ERR_INVALID_ARGUMENT);
    return st;
}

/* a state that is written (after kva__check_state): no broadcast dims in v or in s where s is given */
static kva_status kva__check_state_written(const char* name, const kva_tensor* v, const kva_tensor* s) {
    KVA_FORWARD(kva__check_written(name, v));
    return s && s->data ? kva__check_written(name, s) : KVA_OK;
}

KVA_API kva_status kva_merge_state(kva_context* context, const kva_tensor* v_a, const kva_tensor* s_a,
                                   const kva_tensor* v_b, const kva_tensor* s_b, const kva_tensor* v_out,
                                   const kva_tensor* s_out, void* stream) {
    KVA_RETURN_IF(!context, KVA_ERR_INVALID_ARGUMENT, "kva_merge_state: context is NULL");
    KVA_RETURN_IF(!v_a || v_a->ndim != 3, KVA_ERR_INVALID_ARGUMENT, "kva_merge_state: v_a must be [rows, heads, dim]");
    int64_t r = v_a->shape[0], h = v_a->shape[1], d = v_a->shape[2];
    KVA_FORWARD(kva__check_state("kva_merge_state: a", v_a, s_a, r, h, d, false));
    KVA_FORWARD(kva__check_state("kva_merge_state: b", v_b, s_b, r, h, d, false));
    KVA_FORWARD(kva__check_state("kva_merge_state: out", v_out, s_out, r, h, d, true));
    KVA_FORWARD(kva__check_state_written("kva_merge_state: out", v_out, s_out));
    if (r == 0) return KVA_OK;
    return context->ops->merge_state(context, v_a, s_a, v_b, s_b, v_out, s_out, NULL, stream);
}

KVA_API kva_status kva_merge_state_in_place(kva_context* context, const kva_tensor* v, const kva_tensor* s,
                                            const kva_tensor* v_other, const kva_tensor* s_other, const uint8_t* mask,
                                            void* stream) {
    KVA_RETURN_IF(!context, KVA_ERR_INVALID_ARGUMENT, "kva_merge_state_in_place: context is NULL");
    KVA_RETURN_IF(!v || v->ndim != 3, KVA_ERR_INVALID_ARGUMENT, "kva_merge_state_in_place: v must be [rows, heads, dim]");
    int64_t r = v->shape[0], h = v->shape[1], d = v->shape[2];
    KVA_FORWARD(kva__check_state("kva_merge_state_in_place: v", v, s, r, h, d, false));
    KVA_FORWARD(kva__check_state_written("kva_merge_state_in_place: v", v, s));
    KVA_FORWARD(kva__check_state("kva_merge_state_in_place: other", v_other, s_other, r, h, d, false));
    if (r == 0) return KVA_OK;
    return context->ops->merge_state(context, v, s, v_other, s_other, v, s, mask, stream);
}

KVA_API kva_status kva_merge_states(kva_context* context, const kva_tensor* v, const kva_tensor* s,
                                    const int32_t* indptr, int64_t rows, const kva_tensor* v_out,
                                    const kva_tensor* s_out, void* stream) {
    KVA_RETURN_IF(!context, KVA_ERR_INVALID_ARGUMENT, "kva_merge_states: context is NULL");
    KVA_RETURN_IF(rows < 0, KVA_ERR_INVALID_ARGUMENT, "kva_merge_states: rows = %lld is negative", (long long)rows);
    KVA_RETURN_IF(!indptr, KVA_ERR_INVALID_ARGUMENT, "kva_merge_states: indptr is NULL");
    KVA_RETURN_IF(!v || v->ndim != 3, KVA_ERR_INVALID_ARGUMENT, "kva_merge_states: v must be [total, heads, dim]");
    int64_t total = v->shape[0], h = v->shape[1], d = v->shape[2];
    KVA_RETURN_IF(indptr[0] != 0, KVA_ERR_INVALID_ARGUMENT, "kva_merge_states: indptr[0] = %d, expected 0",
                  (int)indptr[0]);
    for (int64_t r = 0; r < rows; ++r)
        KVA_RETURN_IF(indptr[r + 1] < indptr[r], KVA_ERR_INVALID_ARGUMENT,
                      "kva_merge_states: indptr decreases at %lld (%d > %d)", (long long)r + 1, (int)indptr[r],
                      (int)indptr[r + 1]);
    KVA_RETURN_IF(indptr[rows] != total, KVA_ERR_INVALID_ARGUMENT,
                  "kva_merge_states: indptr[rows] = %d but v has %lld states", (int)indptr[rows], (long long)total);
    if (total > 0) KVA_FORWARD(kva__check_state("kva_merge_states: input", v, s, total, h, d, false));
    KVA_FORWARD(kva__check_state("kva_merge_states: out", v_out, s_out, rows, h, d, true));
    KVA_FORWARD(kva__check_state_written("kva_merge_states: out", v_out, s_out));
    if (rows == 0) return KVA_OK;
    return context->ops->merge_states(context, v, s, indptr, rows, v_out, s_out, stream);
}

/* ---------------------------------------------------------------------------------------------- */
/* Append                                                                                          */

/* The checks both append forms share (pool, new rows), after the form's own arguments; fn names the call. */
static kva_status kva__append_common(const char* fn, const kva_tensor* append_k, const kva_tensor* append_v,
                                     int64_t nnz, const kva_paged_kv* paged) {
    KVA_RETURN_IF(!paged->k_data || !paged->v_data, KVA_ERR_INVALID_ARGUMENT, "%s: paged->k_data or v_data is NULL",
                  fn);
    KVA_RETURN_IF(paged->page_size < 1 || paged->num_pages < 1 || paged->num_heads < 1 || paged->head_dim_qk < 1 ||
                      paged->head_dim_vo < 1,
                  KVA_ERR_INVALID_ARGUMENT, "%s: paged has page_size %d, num_pages %lld, num_heads %d, head dims %d/%d",
                  fn, (int)paged->page_size, (long long)paged->num_pages, (int)paged->num_heads,
                  (int)paged->head_dim_qk, (int)paged->head_dim_vo);
    KVA_FORWARD(kva__check_paged_fields(fn, paged));
    KVA_RETURN_IF(!append_k || !append_v || !append_k->data || !append_v->data, KVA_ERR_INVALID_ARGUMENT,
                  "%s: append_k or append_v is NULL", fn);
    KVA_RETURN_IF(!kva__is_kv_dtype(paged->dtype), KVA_ERR_UNSUPPORTED,
                  "%s: paged->dtype %s is not a KV dtype (f32, f16, bf16, e4m3 or e5m2)", fn, kva_dtype_name(paged->dtype));
    KVA_RETURN_IF(!kva__is_float_dtype(append_k->dtype) && append_k->dtype != paged->dtype, KVA_ERR_UNSUPPORTED,
                  "%s: append_k dtype %s", fn, kva_dtype_name(append_k->dtype));
    int64_t ks[3] = {nnz, paged->num_heads, paged->head_dim_qk};
    int64_t vs[3] = {nnz, paged->num_heads, paged->head_dim_vo};
    char what[96];
    snprintf(what, sizeof what, "%s: append_k", fn);
    kva_status st = kva__check_tensor(what, append_k, append_k->dtype, 3, ks);
    snprintf(what, sizeof what, "%s: append_v", fn);
    if (st == KVA_OK) st = kva__check_tensor(what, append_v, append_k->dtype, 3, vs);
    if (st == KVA_ERR_PLAN_MISMATCH) st = kva__retag_error(KVA_ERR_INVALID_ARGUMENT);
    return st;
}

KVA_API kva_status kva_append_paged_kv_cache(kva_context* context, const kva_tensor* append_k,
                                             const kva_tensor* append_v, const int32_t* batch_indices,
                                             const int32_t* positions, int64_t nnz, const kva_paged_kv* paged,
                                             int32_t batch_size, void* stream) {
    KVA_RETURN_IF(!context, KVA_ERR_INVALID_ARGUMENT, "kva_append_paged_kv_cache: context is NULL");
    KVA_RETURN_IF(!paged, KVA_ERR_INVALID_ARGUMENT, "kva_append_paged_kv_cache: paged is NULL");
    KVA_RETURN_IF(nnz < 0, KVA_ERR_INVALID_ARGUMENT, "kva_append_paged_kv_cache: nnz = %lld is negative",
                  (long long)nnz);
    KVA_RETURN_IF(batch_size < 0, KVA_ERR_INVALID_ARGUMENT, "kva_append_paged_kv_cache: batch_size = %d is negative",
                  (int)batch_size);
    if (nnz == 0) return KVA_OK;
    KVA_RETURN_IF(!batch_indices || !positions, KVA_ERR_INVALID_ARGUMENT,
                  "kva_append_paged_kv_cache: batch_indices or positions is NULL");
    KVA_RETURN_IF(!paged->indices || !paged->indptr || !paged->last_page_len, KVA_ERR_INVALID_ARGUMENT,
                  "kva_append_paged_kv_cache: paged->indices, indptr and last_page_len are required");
    KVA_FORWARD(kva__append_common("kva_append_paged_kv_cache", append_k, append_v, nnz, paged));
    return context->ops->append_paged_kv(context, append_k, append_v, batch_indices, positions, NULL, nnz, paged,
                                         batch_size, stream);
}

KVA_API kva_status kva_append_paged_kv_cache_by_slot(kva_context* context, const kva_tensor* append_k,
                                                     const kva_tensor* append_v, const int64_t* slots, int64_t nnz,
                                                     const kva_paged_kv* paged, void* stream) {
    KVA_RETURN_IF(!context, KVA_ERR_INVALID_ARGUMENT, "kva_append_paged_kv_cache_by_slot: context is NULL");
    KVA_RETURN_IF(!paged, KVA_ERR_INVALID_ARGUMENT, "kva_append_paged_kv_cache_by_slot: paged is NULL");
    KVA_RETURN_IF(nnz < 0, KVA_ERR_INVALID_ARGUMENT, "kva_append_paged_kv_cache_by_slot: nnz = %lld is negative",
                  (long long)nnz);
    if (nnz == 0) return KVA_OK;
    KVA_RETURN_IF(!slots, KVA_ERR_INVALID_ARGUMENT, "kva_append_paged_kv_cache_by_slot: slots is NULL");
    KVA_FORWARD(kva__append_common("kva_append_paged_kv_cache_by_slot", append_k, append_v, nnz, paged));
    return context->ops->append_paged_kv(context, append_k, append_v, NULL, NULL, slots, nnz, paged, 0, stream);
}

KVA_API kva_status kva_read_faults(kva_context* context, const kva_workspace* workspace, kva_fault_report* report,
                                   void* stream) {
    KVA_RETURN_IF(!context || !workspace || !report, KVA_ERR_INVALID_ARGUMENT,
                  "kva_read_faults: context, workspace and report are required");
    return context->ops->read_faults(context, workspace, KVA__FAULTS_WS | KVA__FAULTS_APPEND, report, stream);
}
