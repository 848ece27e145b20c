/*
 * formats.c - composable formats (paper section 3.1): block-sparse (BSR) attention and multi-level cascade
 * attention, both composed from the batch-prefill (paged) op. No kernels of their own: every backend that runs
 * the paged op runs these.
 *
 * BSR: block row b = a request of R query rows (the last one truncated to M), its column blocks = its pages
 * (page_size = C, last_page_len = C), K/V = the page pool (num_pages = N / C, page stride = C * token stride).
 * An element mask, a dense causal mask or a dense window become the op's custom mask (kva_bsr_mask_pack), since
 * the composed op only knows positions inside a block row's gathered KV.
 *
 * Cascade: one paged-prefill plan per level in one workspace (each level at a 256-byte aligned offset, then the
 * merge temporaries). Run: level 0 into o / lse, each further level into the temporaries, merged in place.
 */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "internal.h"

#define KVA__BSR_MAGIC 0x6b76616273727031ull     /* "kvabsrp1" */
#define KVA__CASCADE_MAGIC 0x6b76616361736331ull /* "kvacasc1" */

/* Re-tag the last error with a prefix naming where it happened (the message is copied first: it lives in the
 * same thread-local buffer the new message is written to). */
static kva_status kva__prefix_error(kva_status st, const char* prefix) {
    char old[1536];
    snprintf(old, sizeof old, "%s", kva_last_error_message());
    return kva__set_error(st, "%s%s", prefix, old);
}

/* ============================================================================================== */
/* Block-sparse attention                                                                          */

KVA_API void kva_bsr_params_init(kva_bsr_params* params) {
    if (params) memset(params, 0, sizeof *params);
}

KVA_API void kva_bsr_run_args_init(kva_bsr_run_args* args) {
    if (!args) return;
    memset(args, 0, sizeof *args);
    args->k_scale = 1.0f;
    args->v_scale = 1.0f;
}

typedef struct kva__bsr_geom {
    int64_t M, N, NB, nnz, mask_bytes, max_mask_bytes;
    int32_t R, C, MB;
    bool masked;
    kva_attention_desc dense; /* the caller's descriptor, normalised (dense causal / window) */
    kva_attention_desc op;    /* the composed op's descriptor */
} kva__bsr_geom;

/* Validate desc and params; fill g. Reads every host array; writes nothing. */
static kva_status kva__bsr_check(const char* fn, const kva_attention_desc* desc, const kva_bsr_params* p,
                                 kva__bsr_geom* g) {
    memset(g, 0, sizeof *g);
    KVA_RETURN_IF(!p, KVA_ERR_INVALID_ARGUMENT, "%s: params is NULL", fn);
    kva_status st = kva__desc_normalize(desc, &g->dense);
    if (st != KVA_OK) {
        char pre[128];
        snprintf(pre, sizeof pre, "%s: ", fn);
        return kva__prefix_error(st, pre);
    }
    KVA_RETURN_IF(g->dense.variant != NULL, KVA_ERR_UNSUPPORTED,
                  "%s: desc->variant: user variants are not supported by block-sparse attention (its run arguments "
                  "carry no variant parameters and its hooks would see block-row positions)", fn);
    KVA_RETURN_IF(g->dense.mask_mode == KVA_MASK_CUSTOM, KVA_ERR_INVALID_ARGUMENT,
                  "%s: desc->mask_mode = KVA_MASK_CUSTOM: block-sparse attention builds the custom mask itself; "
                  "give the element mask as params->block_mask (mask_mode NONE or CAUSAL)", fn);
    KVA_RETURN_IF(g->dense.pos_encoding != KVA_POS_NONE, KVA_ERR_UNSUPPORTED,
                  "%s: desc->pos_encoding = %s: block-sparse attention supports KVA_POS_NONE only (the composed op "
                  "sees positions inside a block row's gathered keys, not dense positions; apply RoPE beforehand)",
                  fn, g->dense.pos_encoding == KVA_POS_ALIBI ? "KVA_POS_ALIBI" : "KVA_POS_ROPE_LLAMA");
    const int64_t M = p->num_qo_rows, N = p->num_kv_rows;
    const int32_t R = p->block_rows, C = p->block_cols;
    KVA_RETURN_IF(M < 0 || N < 0, KVA_ERR_INVALID_ARGUMENT,
                  "%s: params->num_qo_rows = %lld and num_kv_rows = %lld must be >= 0", fn, (long long)M,
                  (long long)N);
    KVA_RETURN_IF(R < 1 || C < 1, KVA_ERR_INVALID_ARGUMENT,
                  "%s: params->block_rows = %d and block_cols = %d must be >= 1", fn, (int)R, (int)C);
    KVA_RETURN_IF(N % C != 0, KVA_ERR_INVALID_ARGUMENT,
                  "%s: params->num_kv_rows = %lld is not a multiple of block_cols = %d (N must divide into column "
                  "blocks)", fn, (long long)N, (int)C);
    KVA_RETURN_IF(M > INT32_MAX / 2 || N > (int64_t)INT32_MAX * C, KVA_ERR_UNSUPPORTED,
                  "%s: M = %lld query rows (at most 2^30) or N / C = %lld column blocks (at most 2^31 - 1) too large",
                  fn, (long long)M, (long long)(N / C));
    /* the mask bytes below (and the graph-mode bound max_mask_bytes, about M x N / 8) in 64-bit arithmetic */
    KVA_RETURN_IF(N > 0 && M > (INT64_MAX / 4) / N, KVA_ERR_UNSUPPORTED,
                  "%s: M x N = %lld x %lld query-key pairs: their element mask's size does not fit 64-bit arithmetic",
                  fn, (long long)M, (long long)N);
    KVA_RETURN_IF(!p->indptr, KVA_ERR_INVALID_ARGUMENT, "%s: params->indptr is NULL", fn);
    const int64_t MB = kva__ceil_div64(M, R), NB = N / C;
    const int32_t* ip = p->indptr;
    KVA_RETURN_IF(ip[0] != 0, KVA_ERR_PAGETABLE_MALFORMED, "%s: params->indptr[0] = %d, expected 0", fn, (int)ip[0]);
    for (int64_t b = 0; b < MB; ++b)
        KVA_RETURN_IF(ip[b + 1] < ip[b], KVA_ERR_PAGETABLE_MALFORMED,
                      "%s: params->indptr decreases at block row %lld: indptr[%lld] = %d > indptr[%lld] = %d", fn,
                      (long long)b + 1, (long long)b, (int)ip[b], (long long)b + 1, (int)ip[b + 1]);
    const int64_t nnz = ip[MB];
    KVA_RETURN_IF(nnz > 0 && !p->indices, KVA_ERR_INVALID_ARGUMENT,
                  "%s: params->indices is NULL but indptr[%lld] = %lld blocks are listed", fn, (long long)MB,
                  (long long)nnz);
    for (int64_t e = 0; e < nnz; ++e) {
        int32_t cb = p->indices[e];
        if (KVA_UNLIKELY(cb < 0 || cb >= NB)) {
            int64_t b = 0;
            while (b + 1 <= MB && ip[b + 1] <= e) ++b;
            return kva__set_error(KVA_ERR_PAGE_INDEX_OUT_OF_RANGE,
                                  "%s: params->indices[%lld] = %d (block row %lld) is not a column block of [0, %lld) "
                                  "(N = %lld, C = %d)",
                                  fn, (long long)e, (int)cb, (long long)b, (long long)NB, (long long)N, (int)C);
        }
    }
    int64_t mask_bytes = 0;
    /* graph mode: always masked, so the captured run's mask mode holds for every later pattern */
    const bool masked = p->block_mask != NULL || g->dense.mask_mode == KVA_MASK_CAUSAL || g->dense.window_left >= 0 ||
                        p->graph_mode;
    if (nnz > 0) {
        /* No column block twice in a block row (a key would count twice in the softmax). stamp[cb] = row + 1. */
        int32_t* stamp = (int32_t*)calloc((size_t)NB, sizeof(int32_t));
        KVA_RETURN_IF(!stamp, KVA_ERR_OUT_OF_MEMORY, "%s: out of host memory (%lld column blocks)", fn, (long long)NB);
        for (int64_t b = 0; b < MB; ++b) {
            for (int64_t e = ip[b]; e < ip[b + 1]; ++e) {
                int32_t cb = p->indices[e];
                if (KVA_UNLIKELY(stamp[cb] == (int32_t)(b + 1))) {
                    free(stamp);
                    return kva__set_error(KVA_ERR_INVALID_ARGUMENT,
                                          "%s: column block %d appears twice in block row %lld (params->indices[%lld]); "
                                          "each block of the matrix is listed at most once",
                                          fn, (int)cb, (long long)b, (long long)e);
                }
                stamp[cb] = (int32_t)(b + 1);
            }
        }
        free(stamp);
    }
    for (int64_t b = 0; b < MB; ++b) {
        int64_t kv = (int64_t)(ip[b + 1] - ip[b]) * C;
        KVA_RETURN_IF(kv > INT32_MAX / 2, KVA_ERR_UNSUPPORTED,
                      "%s: block row %lld sees %lld keys (more than 2^30)", fn, (long long)b, (long long)kv);
        int64_t rows = (b + 1) * R <= M ? R : M - b * R;
        if (masked) mask_bytes += (rows * kv + 7) / 8;
        g->max_mask_bytes += (rows * N + 7) / 8;
    }
    g->M = M;
    g->N = N;
    g->NB = NB;
    g->nnz = nnz;
    g->R = R;
    g->C = C;
    g->MB = (int32_t)MB;
    g->masked = masked;
    g->mask_bytes = mask_bytes;
    g->op = g->dense;
    g->op.mask_mode = masked ? KVA_MASK_CUSTOM : KVA_MASK_NONE;
    g->op.window_left = -1;
    return KVA_OK;
}

/* Plan params of the composed op; *scratch (qo_indptr [MB+1] then last_page_len [MB]) is owned by the caller. */
static kva_status kva__bsr_params(const char* fn, const kva_bsr_params* p, const kva__bsr_geom* g,
                                  kva_plan_params* pp, int32_t** scratch) {
    int32_t* s = (int32_t*)malloc(sizeof(int32_t) * (size_t)(2 * (int64_t)g->MB + 2));
    KVA_RETURN_IF(!s, KVA_ERR_OUT_OF_MEMORY, "%s: out of host memory (%d block rows)", fn, (int)g->MB);
    int32_t* qo = s;
    int32_t* lpl = s + g->MB + 1;
    for (int64_t b = 0; b <= g->MB; ++b) qo[b] = (int32_t)(b * g->R < g->M ? b * g->R : g->M);
    for (int64_t b = 0; b < g->MB; ++b) lpl[b] = g->C;
    kva_plan_params_init(pp);
    pp->batch_size = g->MB;
    pp->qo_indptr = qo;
    pp->kv_indptr = p->indptr;
    pp->kv_last_page_len = lpl;
    pp->page_size = g->C;
    pp->num_pages = g->NB;
    pp->kv_indices = g->nnz > 0 ? p->indices : NULL;
    pp->fixed_split_size = p->fixed_split_size;
    pp->disable_split_kv = p->disable_split_kv;
    if (p->graph_mode) {
        pp->graph_mode = 1;
        pp->max_batch_size = g->MB > 0 ? g->MB : 1;
        pp->max_total_qo_rows = g->M > 0 ? g->M : 1;
    }
    *scratch = s;
    return KVA_OK;
}

KVA_API kva_status kva_bsr_workspace_size(kva_context* context, const kva_attention_desc* desc,
                                          const kva_bsr_params* params, size_t* device_bytes, size_t* host_bytes) {
    static const char fn[] = "kva_bsr_workspace_size";
    KVA_RETURN_IF(!context, KVA_ERR_INVALID_ARGUMENT, "%s: context is NULL", fn);
    kva__bsr_geom g;
    KVA_FORWARD(kva__bsr_check(fn, desc, params, &g));
    kva_plan_params pp;
    int32_t* scratch = NULL;
    KVA_FORWARD(kva__bsr_params(fn, params, &g, &pp, &scratch));
    kva_status st = kva_plan_workspace_size(context, &g.op, KVA_OP_BATCH_PREFILL_PAGED, &pp, device_bytes, host_bytes);
    free(scratch);
    return st;
}

KVA_API kva_status kva_bsr_plan_make(kva_context* context, const kva_attention_desc* desc,
                                     const kva_bsr_params* params, const kva_workspace* workspace,
                                     kva_bsr_plan* plan, void* stream) {
    static const char fn[] = "kva_bsr_plan_make";
    KVA_RETURN_IF(!context, KVA_ERR_INVALID_ARGUMENT, "%s: context is NULL", fn);
    KVA_RETURN_IF(!workspace, KVA_ERR_INVALID_ARGUMENT, "%s: workspace is NULL", fn);
    KVA_RETURN_IF(!plan, KVA_ERR_INVALID_ARGUMENT, "%s: plan is NULL", fn);
    kva__bsr_geom g;
    KVA_FORWARD(kva__bsr_check(fn, desc, params, &g));
    kva_plan_params pp;
    int32_t* scratch = NULL;
    KVA_FORWARD(kva__bsr_params(fn, params, &g, &pp, &scratch));
    kva_plan inner;
    kva_status st = kva_plan_make(context, &g.op, KVA_OP_BATCH_PREFILL_PAGED, &pp, workspace, &inner, stream);
    free(scratch);
    if (st != KVA_OK) return st;
    memset(plan, 0, sizeof *plan);
    plan->plan = inner;
    plan->num_qo_rows = g.M;
    plan->num_kv_rows = g.N;
    plan->block_rows = g.R;
    plan->block_cols = g.C;
    plan->num_block_rows = g.MB;
    plan->uses_mask = g.masked ? 1 : 0;
    plan->nnz = g.nnz;
    plan->mask_bytes = g.masked ? g.mask_bytes : 0;
    plan->graph_mode = params->graph_mode ? 1 : 0;
    plan->max_mask_bytes = g.max_mask_bytes;
    plan->magic = KVA__BSR_MAGIC;
    return KVA_OK;
}

KVA_API kva_status kva_bsr_mask_pack(const kva_attention_desc* desc, const kva_bsr_params* params, uint8_t* packed,
                                     size_t capacity, size_t* packed_bytes) {
    static const char fn[] = "kva_bsr_mask_pack";
    KVA_RETURN_IF(!packed_bytes, KVA_ERR_INVALID_ARGUMENT, "%s: packed_bytes is NULL", fn);
    kva__bsr_geom g;
    KVA_FORWARD(kva__bsr_check(fn, desc, params, &g));
    const size_t need = g.masked ? (size_t)g.mask_bytes : 0;
    if (!packed || need == 0) {
        *packed_bytes = need;
        return KVA_OK;
    }
    KVA_RETURN_IF(capacity < need, KVA_ERR_INVALID_ARGUMENT,
                  "%s: the output buffer holds %zu bytes; the packed mask needs %zu", fn, capacity, need);
    memset(packed, 0, need);
    const bool causal = g.dense.mask_mode == KVA_MASK_CAUSAL;
    const int64_t win = g.dense.window_left;
    const int64_t shift = g.N - g.M; /* dense q_pos = i + shift (bottom-right aligned) */
    const int64_t R = g.R, C = g.C;
    const uint8_t* bm = params->block_mask;
    int64_t seg = 0; /* byte offset of block row b's segment */
    for (int64_t b = 0; b < g.MB; ++b) {
        const int64_t e0 = params->indptr[b], ne = params->indptr[b + 1] - e0;
        const int64_t rows = (b + 1) * R <= g.M ? R : g.M - b * R;
        const int64_t kv = ne * C;
        uint8_t* out = packed + seg;
        for (int64_t r = 0; r < rows; ++r) {
            const int64_t qpos = b * R + r + shift;
            /* visible dense key range from causal / window: [lo, hi] */
            const int64_t hi = causal ? qpos : INT64_MAX;
            const int64_t lo = win >= 0 ? qpos - win : INT64_MIN;
            for (int64_t e = 0; e < ne; ++e) {
                const int64_t j0 = (int64_t)params->indices[e0 + e] * C;
                const uint8_t* m = bm ? bm + ((e0 + e) * R + r) * C : NULL;
                const int64_t bit0 = r * kv + e * C;
                for (int64_t c = 0; c < C; ++c) {
                    const int64_t j = j0 + c;
                    if (j > hi || j < lo || (m && !m[c])) continue;
                    const int64_t bit = bit0 + c;
                    out[bit >> 3] |= (uint8_t)(1u << (bit & 7));
                }
            }
        }
        seg += (rows * kv + 7) / 8;
    }
    *packed_bytes = need;
    return KVA_OK;
}

KVA_API kva_status kva_bsr_run(kva_context* context, const kva_bsr_plan* plan, const kva_workspace* workspace,
                               const kva_bsr_run_args* args) {
    static const char fn[] = "kva_bsr_run";
    KVA_RETURN_IF(!context, KVA_ERR_INVALID_ARGUMENT, "%s: context is NULL", fn);
    KVA_RETURN_IF(!plan, KVA_ERR_INVALID_ARGUMENT, "%s: plan is NULL", fn);
    KVA_RETURN_IF(!workspace, KVA_ERR_INVALID_ARGUMENT, "%s: workspace is NULL", fn);
    KVA_RETURN_IF(!args, KVA_ERR_INVALID_ARGUMENT, "%s: args is NULL", fn);
    KVA_RETURN_IF(plan->magic != KVA__BSR_MAGIC, KVA_ERR_PLAN_MISMATCH,
                  "%s: the plan was not made by kva_bsr_plan_make (bad magic) or was corrupted", fn);
    const kva__plan_data* pd = kva__plan_data_ofc(&plan->plan);
    KVA_RETURN_IF(!kva__plan_intact(pd) || (kva_op)pd->op != KVA_OP_BATCH_PREFILL_PAGED ||
                      pd->total_qo_rows != plan->num_qo_rows || pd->page_size != plan->block_cols ||
                      pd->batch_size != plan->num_block_rows,
                  KVA_ERR_PLAN_MISMATCH, "%s: the plan is inconsistent (corrupted?)", fn);
    const kva_attention_desc* d = &pd->desc;
    const int64_t N = plan->num_kv_rows, C = plan->block_cols;
    kva_status st;
    if (N > 0) {
        int64_t ks[3] = {N, d->num_kv_heads, d->head_dim_qk};
        int64_t vs[3] = {N, d->num_kv_heads, d->head_dim_vo};
        st = kva__check_tensor("kva_bsr_run: k", &args->k, d->kv_dtype, 3, ks);
        if (st == KVA_OK) st = kva__check_tensor("kva_bsr_run: v", &args->v, d->kv_dtype, 3, vs);
        KVA_FORWARD(st);
        KVA_RETURN_IF(args->k.stride[0] > INT64_MAX / C || args->v.stride[0] > INT64_MAX / C, KVA_ERR_INVALID_ARGUMENT,
                      "%s: k / v row strides overflow", fn);
    }
    KVA_RETURN_IF(plan->nnz > 0 && !args->indices, KVA_ERR_INVALID_ARGUMENT,
                  "%s: args->indices (backend copy of the column-block ids) is NULL", fn);
    KVA_RETURN_IF(plan->uses_mask && plan->mask_bytes > 0 && !args->packed_mask, KVA_ERR_INVALID_ARGUMENT,
                  "%s: the plan needs a packed mask (element mask, causal or window; %lld bytes from "
                  "kva_bsr_mask_pack, in backend memory) but args->packed_mask is NULL",
                  fn, (long long)plan->mask_bytes);
    KVA_RETURN_IF(plan->uses_mask && args->packed_mask_bytes < plan->mask_bytes, KVA_ERR_INVALID_ARGUMENT,
                  "%s: args->packed_mask_bytes = %lld, the plan needs %lld (kva_bsr_mask_pack's size)", fn,
                  (long long)args->packed_mask_bytes, (long long)plan->mask_bytes);

    kva_run_args ra;
    kva_run_args_init(&ra);
    ra.q = args->q;
    ra.o = args->o;
    ra.lse = args->lse;
    kva_paged_kv* pk = &ra.paged;
    pk->k_data = args->k.data;
    pk->v_data = args->v.data;
    pk->dtype = d->kv_dtype;
    pk->num_pages = N / C;
    pk->page_size = (int32_t)C;
    pk->num_heads = d->num_kv_heads;
    pk->head_dim_qk = d->head_dim_qk;
    pk->head_dim_vo = d->head_dim_vo;
    if (N > 0) {
        pk->k_stride_token = args->k.stride[0];
        pk->k_stride_head = args->k.stride[1];
        pk->k_stride_page = args->k.stride[0] * C;
        pk->v_stride_token = args->v.stride[0];
        pk->v_stride_head = args->v.stride[1];
        pk->v_stride_page = args->v.stride[0] * C;
    }
    pk->indices = args->indices;
    if (plan->uses_mask) {
        ra.custom_mask = args->packed_mask;
        ra.custom_mask_bytes = args->packed_mask_bytes;
    }
    ra.k_scale = args->k_scale;
    ra.v_scale = args->v_scale;
    ra.stream = args->stream;
    st = kva_run(context, &plan->plan, workspace, &ra);
    if (st != KVA_OK) return kva__prefix_error(st, "kva_bsr_run: ");
    return KVA_OK;
}

/* ============================================================================================== */
/* Multi-level cascade                                                                             */

KVA_API void kva_cascade_params_init(kva_cascade_params* params) {
    if (params) memset(params, 0, sizeof *params);
}

KVA_API void kva_cascade_run_args_init(kva_cascade_run_args* args) {
    if (!args) return;
    memset(args, 0, sizeof *args);
    args->k_scale = 1.0f;
    args->v_scale = 1.0f;
}

typedef struct kva__cascade_layout {
    int32_t L;
    int64_t total_rows;
    int64_t tmp_rows;
    kva_attention_desc desc[KVA_CASCADE_MAX_LEVELS];
    kva_plan_params pp[KVA_CASCADE_MAX_LEVELS];
    size_t dev_off[KVA_CASCADE_MAX_LEVELS], dev_bytes[KVA_CASCADE_MAX_LEVELS];
    size_t host_off[KVA_CASCADE_MAX_LEVELS], host_bytes[KVA_CASCADE_MAX_LEVELS];
    size_t tmp_o_off, tmp_lse_off, acc_lse_off;
    size_t device_bytes, host_total;
} kva__cascade_layout;

/* Validate every level and lay the workspace out. Writes nothing. */
static kva_status kva__cascade_layout_of(const char* fn, kva_context* ctx, const kva_attention_desc* desc,
                                         const kva_cascade_params* p, kva__cascade_layout* lay) {
    memset(lay, 0, sizeof *lay);
    KVA_RETURN_IF(!ctx, KVA_ERR_INVALID_ARGUMENT, "%s: context is NULL", fn);
    KVA_RETURN_IF(!p, KVA_ERR_INVALID_ARGUMENT, "%s: params is NULL", fn);
    const int32_t L = p->num_levels;
    KVA_RETURN_IF(L < 1 || L > KVA_CASCADE_MAX_LEVELS, KVA_ERR_INVALID_ARGUMENT,
                  "%s: params->num_levels = %d must be in [1, %d]", fn, (int)L, KVA_CASCADE_MAX_LEVELS);
    kva_attention_desc nd;
    kva_status st = kva__desc_normalize(desc, &nd);
    if (st != KVA_OK) {
        char pre[128];
        snprintf(pre, sizeof pre, "%s: ", fn);
        return kva__prefix_error(st, pre);
    }
    KVA_RETURN_IF(nd.variant != NULL, KVA_ERR_UNSUPPORTED,
                  "%s: desc->variant: user variants are not supported by cascade attention (an output transform "
                  "cannot be merged across levels)", fn);
    KVA_RETURN_IF(nd.mask_mode == KVA_MASK_CUSTOM, KVA_ERR_UNSUPPORTED,
                  "%s: desc->mask_mode = KVA_MASK_CUSTOM is not supported by cascade attention (NONE or CAUSAL; "
                  "causal applies to the last level)", fn);
    if (L > 1) {
        KVA_RETURN_IF(nd.pos_encoding != KVA_POS_NONE, KVA_ERR_UNSUPPORTED,
                      "%s: desc->pos_encoding = %s with %d levels: positions are per level in cascade attention; "
                      "use KVA_POS_NONE (apply RoPE before the KV is cached)",
                      fn, nd.pos_encoding == KVA_POS_ALIBI ? "KVA_POS_ALIBI" : "KVA_POS_ROPE_LLAMA", (int)L);
        KVA_RETURN_IF(nd.window_left >= 0, KVA_ERR_UNSUPPORTED,
                      "%s: desc->window_left = %d with %d levels: a sliding window spans levels; not supported", fn,
                      (int)nd.window_left, (int)L);
        KVA_RETURN_IF(nd.score_mode != KVA_SCORE_SOFTMAX, KVA_ERR_UNSUPPORTED,
                      "%s: sigmoid (no-softmax) mode with %d levels: levels are merged through their lse, which "
                      "sigmoid mode does not have", fn, (int)L);
    }
    int64_t total = -1;
    for (int32_t l = 0; l < L; ++l) {
        const kva_cascade_level* lv = &p->levels[l];
        KVA_RETURN_IF(lv->batch_size < 0, KVA_ERR_INVALID_ARGUMENT, "%s: level %d: batch_size = %d is negative", fn,
                      (int)l, (int)lv->batch_size);
        KVA_RETURN_IF(!lv->qo_indptr || !lv->kv_indptr, KVA_ERR_INVALID_ARGUMENT,
                      "%s: level %d: qo_indptr and kv_indptr are required", fn, (int)l);
        const int32_t B = lv->batch_size;
        KVA_RETURN_IF(lv->qo_indptr[0] != 0, KVA_ERR_PAGETABLE_MALFORMED, "%s: level %d: qo_indptr[0] = %d, expected 0",
                      fn, (int)l, (int)lv->qo_indptr[0]);
        for (int32_t b = 0; b < B; ++b)
            KVA_RETURN_IF(lv->qo_indptr[b + 1] < lv->qo_indptr[b], KVA_ERR_PAGETABLE_MALFORMED,
                          "%s: level %d: qo_indptr decreases at %d (%d > %d): a level groups contiguous query rows "
                          "in the caller's order",
                          fn, (int)l, (int)b + 1, (int)lv->qo_indptr[b], (int)lv->qo_indptr[b + 1]);
        const int64_t rows = lv->qo_indptr[B];
        if (l == 0) total = rows;
        KVA_RETURN_IF(rows != total, KVA_ERR_INVALID_ARGUMENT,
                      "%s: level %d covers %lld query rows (qo_indptr[%d]) but level 0 covers %lld: every level's "
                      "qo_indptr must cover all query rows",
                      fn, (int)l, (long long)rows, (int)B, (long long)total);
        lay->desc[l] = nd;
        if (l != L - 1) lay->desc[l].mask_mode = KVA_MASK_NONE;
        kva_plan_params* pp = &lay->pp[l];
        kva_plan_params_init(pp);
        pp->batch_size = B;
        pp->qo_indptr = lv->qo_indptr;
        pp->kv_indptr = lv->kv_indptr;
        pp->kv_last_page_len = lv->kv_last_page_len;
        pp->page_size = p->page_size;
        pp->num_pages = p->num_pages;
        pp->kv_indices = lv->kv_indices;
        pp->fixed_split_size = p->fixed_split_size;
        pp->disable_split_kv = p->disable_split_kv;
        pp->graph_mode = p->graph_mode;
        pp->max_batch_size = p->max_batch_size;
        pp->max_total_qo_rows = p->max_total_qo_rows;
        kva__plan_data pd;
        st = kva__plan_layout(ctx, &lay->desc[l], KVA_OP_BATCH_PREFILL_PAGED, pp, &pd);
        if (st != KVA_OK) {
            char pre[128];
            snprintf(pre, sizeof pre, "%s: level %d: ", fn, (int)l);
            return kva__prefix_error(st, pre);
        }
        lay->dev_bytes[l] = kva__align_up(pd.device_bytes, KVA__WS_ALIGN);
        lay->host_bytes[l] = kva__align_up(pd.host_bytes, KVA__WS_ALIGN);
    }
    size_t off = 0, hoff = 0;
    for (int32_t l = 0; l < L; ++l) {
        lay->dev_off[l] = off;
        off += lay->dev_bytes[l];
        lay->host_off[l] = hoff;
        hoff += lay->host_bytes[l];
    }
    lay->L = L;
    lay->total_rows = total;
    if (L > 1) {
        /* graph mode: sized by the bound (the planner checked total <= max_total_qo_rows) */
        const int64_t rows = p->graph_mode ? p->max_total_qo_rows : total;
        const size_t heads = (size_t)nd.num_qo_heads;
        lay->tmp_rows = rows;
        lay->tmp_o_off = off;
        off = kva__align_up(off + (size_t)rows * heads * (size_t)nd.head_dim_vo * kva_dtype_size(nd.o_dtype),
                            KVA__WS_ALIGN);
        lay->tmp_lse_off = off;
        off = kva__align_up(off + (size_t)rows * heads * sizeof(float), KVA__WS_ALIGN);
        lay->acc_lse_off = off;
        off = kva__align_up(off + (size_t)rows * heads * sizeof(float), KVA__WS_ALIGN);
    }
    lay->device_bytes = off;
    lay->host_total = hoff;
    return KVA_OK;
}

KVA_API kva_status kva_cascade_workspace_size(kva_context* context, const kva_attention_desc* desc,
                                              const kva_cascade_params* params, size_t* device_bytes,
                                              size_t* host_bytes) {
    kva__cascade_layout lay;
    KVA_FORWARD(kva__cascade_layout_of("kva_cascade_workspace_size", context, desc, params, &lay));
    if (device_bytes) *device_bytes = lay.device_bytes;
    if (host_bytes) *host_bytes = lay.host_total;
    return KVA_OK;
}

static kva_workspace kva__sub_ws(const kva_workspace* ws, size_t dev_off, size_t dev_bytes, size_t host_off,
                                 size_t host_bytes) {
    kva_workspace s;
    s.device = (char*)ws->device + dev_off;
    s.device_bytes = dev_bytes;
    s.host = ws->host && host_bytes > 0 ? (void*)((char*)ws->host + host_off) : NULL;
    s.host_bytes = ws->host && host_bytes > 0 ? host_bytes : 0;
    s.scratch = NULL; /* the format planners keep their levels' partials in device */
    s.scratch_bytes = 0;
    return s;
}

KVA_API kva_status kva_cascade_plan_make(kva_context* context, const kva_attention_desc* desc,
                                         const kva_cascade_params* params, const kva_workspace* workspace,
                                         kva_cascade_plan* plan, void* stream) {
    static const char fn[] = "kva_cascade_plan_make";
    KVA_RETURN_IF(!workspace, KVA_ERR_INVALID_ARGUMENT, "%s: workspace is NULL", fn);
    KVA_RETURN_IF(!plan, KVA_ERR_INVALID_ARGUMENT, "%s: plan is NULL", fn);
    kva__cascade_layout lay;
    KVA_FORWARD(kva__cascade_layout_of(fn, context, desc, params, &lay));
    const bool staging = !context->ops->plans_on_host_memory;
    KVA_RETURN_IF(workspace->device_bytes < lay.device_bytes || !workspace->device, KVA_ERR_WORKSPACE_TOO_SMALL,
                  "%s: the device workspace has %zu bytes at %p; %d levels need %zu bytes "
                  "(kva_cascade_workspace_size)",
                  fn, workspace->device_bytes, workspace->device, (int)lay.L, lay.device_bytes);
    KVA_RETURN_IF(staging && lay.host_total > 0 && (workspace->host_bytes < lay.host_total || !workspace->host),
                  KVA_ERR_WORKSPACE_TOO_SMALL,
                  "%s: the host staging workspace has %zu bytes at %p; %d levels need %zu bytes", fn,
                  workspace->host_bytes, workspace->host, (int)lay.L, lay.host_total);
    KVA_RETURN_IF(((uintptr_t)workspace->device % KVA__WS_ALIGN) != 0 ||
                      (staging && ((uintptr_t)workspace->host % KVA__WS_ALIGN) != 0),
                  KVA_ERR_ALIGNMENT, "%s: workspace pointers must be %d-byte aligned (device %p, host %p)", fn,
                  KVA__WS_ALIGN, workspace->device, workspace->host);
    kva_cascade_plan cp;
    memset(&cp, 0, sizeof cp);
    for (int32_t l = 0; l < lay.L; ++l) {
        kva_workspace sub = kva__sub_ws(workspace, lay.dev_off[l], lay.dev_bytes[l], lay.host_off[l],
                                        lay.host_bytes[l]);
        kva_status st = kva_plan_make(context, &lay.desc[l], KVA_OP_BATCH_PREFILL_PAGED, &lay.pp[l], &sub,
                                      &cp.levels[l], stream);
        if (st != KVA_OK) {
            char pre[128];
            snprintf(pre, sizeof pre, "%s: level %d: ", fn, (int)l);
            return kva__prefix_error(st, pre);
        }
        cp.level_device_offset[l] = lay.dev_off[l];
        cp.level_device_bytes[l] = lay.dev_bytes[l];
        cp.level_host_offset[l] = lay.host_off[l];
        cp.level_host_bytes[l] = lay.host_bytes[l];
    }
    cp.num_levels = lay.L;
    cp.graph_mode = params->graph_mode ? 1 : 0;
    cp.total_qo_rows = lay.total_rows;
    cp.ws_device_addr = (uint64_t)(uintptr_t)workspace->device;
    cp.tmp_o_offset = lay.tmp_o_off;
    cp.tmp_lse_offset = lay.tmp_lse_off;
    cp.acc_lse_offset = lay.acc_lse_off;
    cp.tmp_rows = lay.tmp_rows;
    cp.device_bytes = lay.device_bytes;
    cp.host_bytes = lay.host_total;
    cp.magic = KVA__CASCADE_MAGIC;
    *plan = cp;
    return KVA_OK;
}

/* Checks of a cascade plan against its workspace and context (before anything runs). */
static kva_status kva__cascade_check_plan(const char* fn, const kva_context* ctx, const kva_cascade_plan* plan,
                                          const kva_workspace* ws) {
    KVA_RETURN_IF(!ctx, KVA_ERR_INVALID_ARGUMENT, "%s: context is NULL", fn);
    KVA_RETURN_IF(!plan, KVA_ERR_INVALID_ARGUMENT, "%s: plan is NULL", fn);
    KVA_RETURN_IF(!ws, KVA_ERR_INVALID_ARGUMENT, "%s: workspace is NULL", fn);
    KVA_RETURN_IF(plan->magic != KVA__CASCADE_MAGIC || plan->num_levels < 1 ||
                      plan->num_levels > KVA_CASCADE_MAX_LEVELS,
                  KVA_ERR_PLAN_MISMATCH, "%s: the plan was not made by kva_cascade_plan_make or was corrupted", fn);
    KVA_RETURN_IF(plan->ws_device_addr != (uint64_t)(uintptr_t)ws->device || ws->device_bytes < plan->device_bytes,
                  KVA_ERR_PLAN_MISMATCH,
                  "%s: the workspace (%p, %zu bytes) is not the one the plan was written into (%p, %zu bytes needed)",
                  fn, ws->device, ws->device_bytes, (void*)(uintptr_t)plan->ws_device_addr, plan->device_bytes);
    const kva__plan_data* pd0 = kva__plan_data_ofc(&plan->levels[0]);
    for (int32_t l = 0; l < plan->num_levels; ++l) {
        const kva__plan_data* pd = kva__plan_data_ofc(&plan->levels[l]);
        KVA_RETURN_IF(!kva__plan_intact(pd) ||
                          (kva_op)pd->op != KVA_OP_BATCH_PREFILL_PAGED || pd->total_qo_rows != plan->total_qo_rows,
                      KVA_ERR_PLAN_MISMATCH, "%s: level %d's plan is corrupted", fn, (int)l);
        KVA_RETURN_IF(pd->context_id != ctx->id, KVA_ERR_PLAN_MISMATCH,
                      "%s: the plan was made by another context", fn);
        KVA_RETURN_IF(pd->ws_device_addr != plan->ws_device_addr + plan->level_device_offset[l] ||
                          pd->device_bytes > plan->level_device_bytes[l],
                      KVA_ERR_PLAN_MISMATCH, "%s: level %d's plan is not at its workspace offset (corrupted?)", fn,
                      (int)l);
        KVA_RETURN_IF(pd->page_size != pd0->page_size || pd->num_pages != pd0->num_pages ||
                          pd->desc.num_qo_heads != pd0->desc.num_qo_heads ||
                          pd->desc.num_kv_heads != pd0->desc.num_kv_heads ||
                          pd->desc.head_dim_qk != pd0->desc.head_dim_qk ||
                          pd->desc.head_dim_vo != pd0->desc.head_dim_vo || pd->desc.q_dtype != pd0->desc.q_dtype ||
                          pd->desc.kv_dtype != pd0->desc.kv_dtype || pd->desc.o_dtype != pd0->desc.o_dtype,
                      KVA_ERR_PLAN_MISMATCH, "%s: level %d's plan disagrees with level 0's (corrupted?)", fn, (int)l);
        KVA_RETURN_IF(plan->level_device_offset[l] > plan->device_bytes ||
                          plan->level_device_bytes[l] > plan->device_bytes - plan->level_device_offset[l],
                      KVA_ERR_PLAN_MISMATCH, "%s: level %d's region lies outside the plan's workspace (corrupted?)", fn,
                      (int)l);
    }
    if (plan->num_levels > 1) {
        /* the merge buffers the run builds from these offsets must lie in the plan's workspace bytes */
        const kva__plan_data* pdl = kva__plan_data_ofc(&plan->levels[plan->num_levels - 1]);
        const uint64_t cells = (uint64_t)(plan->tmp_rows > 0 ? plan->tmp_rows : 0) * (uint64_t)pdl->desc.num_qo_heads;
        const uint64_t o_bytes = cells * (uint64_t)pdl->desc.head_dim_vo * (uint64_t)kva_dtype_size(pdl->desc.o_dtype);
        const uint64_t l_bytes = cells * sizeof(float), total = (uint64_t)plan->device_bytes;
        KVA_RETURN_IF(plan->tmp_rows < 0 || plan->tmp_rows > ((int64_t)1 << 40) ||
                          plan->tmp_o_offset > total || o_bytes > total - plan->tmp_o_offset ||
                          plan->tmp_lse_offset > total || l_bytes > total - plan->tmp_lse_offset ||
                          plan->acc_lse_offset > total || l_bytes > total - plan->acc_lse_offset,
                      KVA_ERR_PLAN_MISMATCH, "%s: the plan's merge buffers lie outside its workspace (corrupted?)", fn);
    }
    return KVA_OK;
}

KVA_API kva_status kva_cascade_run(kva_context* context, const kva_cascade_plan* plan,
                                   const kva_workspace* workspace, const kva_cascade_run_args* args) {
    static const char fn[] = "kva_cascade_run";
    KVA_FORWARD(kva__cascade_check_plan(fn, context, plan, workspace));
    KVA_RETURN_IF(!args, KVA_ERR_INVALID_ARGUMENT, "%s: args is NULL", fn);
    const int32_t L = plan->num_levels;
    const kva__plan_data* pd0 = kva__plan_data_ofc(&plan->levels[0]);
    const kva__plan_data* pdl = kva__plan_data_ofc(&plan->levels[L - 1]);
    const kva_attention_desc* d = &pdl->desc;
    const int64_t rows = plan->total_qo_rows;
    KVA_RETURN_IF(L > 1 && rows > plan->tmp_rows, KVA_ERR_PLAN_MISMATCH, "%s: the plan is inconsistent (corrupted?)",
                  fn);

    /* Everything every level's run will check, up front, so that no level writes before a later one fails. */
    if (rows > 0) {
        int64_t qs[3] = {rows, d->num_qo_heads, d->head_dim_qk};
        int64_t os[3] = {rows, d->num_qo_heads, d->head_dim_vo};
        KVA_FORWARD(kva__check_tensor("kva_cascade_run: q", &args->q, d->q_dtype, 3, qs));
        KVA_FORWARD(kva__check_tensor("kva_cascade_run: o", &args->o, d->o_dtype, 3, os));
        KVA_FORWARD(kva__check_written("kva_cascade_run: o", &args->o));
        if (args->lse.data) {
            KVA_RETURN_IF(d->score_mode == KVA_SCORE_SIGMOID, KVA_ERR_INVALID_ARGUMENT,
                          "%s: lse is not defined in sigmoid (no-softmax) mode; pass lse.data = NULL", fn);
            int64_t ls[2] = {rows, d->num_qo_heads};
            KVA_FORWARD(kva__check_tensor("kva_cascade_run: lse", &args->lse, KVA_DTYPE_F32, 2, ls));
            KVA_FORWARD(kva__check_written("kva_cascade_run: lse", &args->lse));
        }
    }
    KVA_RETURN_IF(!isfinite(args->k_scale) || !isfinite(args->v_scale), KVA_ERR_INVALID_ARGUMENT,
                  "%s: k_scale = %g and v_scale = %g must be finite", fn, (double)args->k_scale,
                  (double)args->v_scale);
    const kva_paged_kv* pk = &args->paged;
    KVA_RETURN_IF(pk->dtype != d->kv_dtype, KVA_ERR_PLAN_MISMATCH, "%s: paged.dtype = %s, the plan has kv_dtype %s",
                  fn, kva_dtype_name(pk->dtype), kva_dtype_name(d->kv_dtype));
    KVA_RETURN_IF(pk->page_size != pd0->page_size, KVA_ERR_PLAN_MISMATCH,
                  "%s: paged.page_size = %d, the plan has page_size %d", fn, (int)pk->page_size, (int)pd0->page_size);
    KVA_RETURN_IF(pk->num_pages < pd0->num_pages || pk->num_pages < 0, KVA_ERR_PLAN_MISMATCH,
                  "%s: paged.num_pages = %lld, but the plan checked its page tables against a pool of %lld pages", fn,
                  (long long)pk->num_pages, (long long)pd0->num_pages);
    KVA_RETURN_IF(pk->num_heads != d->num_kv_heads || pk->head_dim_qk != d->head_dim_qk ||
                      pk->head_dim_vo != d->head_dim_vo,
                  KVA_ERR_PLAN_MISMATCH, "%s: paged has %d heads of dims (%d, %d), the descriptor %d heads of (%d, %d)",
                  fn, (int)pk->num_heads, (int)pk->head_dim_qk, (int)pk->head_dim_vo, (int)d->num_kv_heads,
                  (int)d->head_dim_qk, (int)d->head_dim_vo);
    {
        /* the strides as every run checks them (non-negative, the pool addressable), here also for a plan of no rows;
           paged.num_indices is not read (each level's length is kv_num_indices[l]) */
        kva_paged_kv fields = *pk;
        fields.num_indices = 0;
        KVA_FORWARD(kva__check_paged_fields(fn, &fields));
    }
    const bool host_visible = context->ops->plans_on_host_memory;
    for (int32_t l = 0; l < L; ++l) {
        const kva__plan_data* pd = kva__plan_data_ofc(&plan->levels[l]);
        const int64_t entries = pd->num_page_entries;
        const int64_t given = args->kv_num_indices[l];
        KVA_RETURN_IF(given < 0, KVA_ERR_INVALID_ARGUMENT, "%s: kv_num_indices[%d] = %lld is negative", fn, (int)l,
                      (long long)given);
        KVA_RETURN_IF(given > 0 && given < entries, KVA_ERR_PAGETABLE_MALFORMED,
                      "%s: level %d's plan reads %lld page-table entries, but kv_indices[%d] holds %lld "
                      "(kv_num_indices[%d])",
                      fn, (int)l, (long long)entries, (int)l, (long long)given, (int)l);
        if (entries == 0) continue;
        KVA_RETURN_IF(!pk->k_data || !pk->v_data, KVA_ERR_INVALID_ARGUMENT, "%s: paged.k_data or v_data is NULL", fn);
        KVA_RETURN_IF(pk->num_pages < 1, KVA_ERR_INVALID_ARGUMENT,
                      "%s: paged.num_pages = %lld: the pool size bounds every page index", fn,
                      (long long)pk->num_pages);
        KVA_RETURN_IF(!args->kv_indices[l], KVA_ERR_INVALID_ARGUMENT,
                      "%s: kv_indices[%d] (level %d's page table, backend memory) is NULL", fn, (int)l, (int)l);
        if (host_visible) {
            const int32_t* ix = args->kv_indices[l];
            for (int64_t i = 0; i < entries; ++i)
                KVA_RETURN_IF(ix[i] < 0 || ix[i] >= pk->num_pages, KVA_ERR_PAGE_INDEX_OUT_OF_RANGE,
                              "%s: level %d: page table entry %lld holds page index %d, outside the pool [0, %lld)",
                              fn, (int)l, (long long)i, (int)ix[i], (long long)pk->num_pages);
        }
    }
    if (rows == 0) return KVA_OK;

    kva_run_args ra;
    kva_run_args_init(&ra);
    ra.q = args->q;
    ra.o = args->o;
    ra.lse = args->lse;
    ra.paged = *pk; /* paged.indices / num_indices are not read: each level sets its own table and length below */
    ra.paged.indptr = NULL;
    ra.paged.last_page_len = NULL;
    ra.k_scale = args->k_scale;
    ra.v_scale = args->v_scale;
    ra.stream = args->stream;
    char* base = (char*)workspace->device;
    const int64_t H = d->num_qo_heads;
    kva_tensor tmp_o = kva_tensor_make(base + plan->tmp_o_offset, d->o_dtype, 3, rows, H, d->head_dim_vo, 0);
    kva_tensor tmp_lse = kva_tensor_make(base + plan->tmp_lse_offset, KVA_DTYPE_F32, 2, rows, H, 0, 0);
    kva_tensor acc_lse = args->lse;
    if (L > 1 && !acc_lse.data) acc_lse = kva_tensor_make(base + plan->acc_lse_offset, KVA_DTYPE_F32, 2, rows, H, 0, 0);
    for (int32_t l = 0; l < L; ++l) {
        kva_workspace sub = kva__sub_ws(workspace, plan->level_device_offset[l], plan->level_device_bytes[l],
                                        plan->level_host_offset[l], plan->level_host_bytes[l]);
        ra.paged.indices = args->kv_indices[l];
        ra.paged.num_indices = args->kv_num_indices[l];
        if (l == 0) {
            ra.o = args->o;
            ra.lse = L > 1 ? acc_lse : args->lse;
        } else {
            ra.o = tmp_o;
            ra.lse = tmp_lse;
        }
        kva_status st = kva_run(context, &plan->levels[l], &sub, &ra);
        if (st == KVA_OK && l > 0)
            st = kva_merge_state_in_place(context, &args->o, &acc_lse, &tmp_o, &tmp_lse, NULL, args->stream);
        if (st != KVA_OK) {
            char pre[128];
            snprintf(pre, sizeof pre, "%s: level %d: ", fn, (int)l);
            return kva__prefix_error(st, pre);
        }
    }
    return KVA_OK;
}

/* After a composite's per-part reads of their workspace words (the first faulting part in *report): where none
   faulted, the context's append fault word, as kva_read_faults would report it; otherwise it stays set for the next
   read (one fault word per call, the workspace's first). */
static kva_status kva__read_append_fault(kva_context* context, const kva_workspace* workspace,
                                         kva_fault_report* report, void* stream) {
    if (report->faulted) return KVA_OK;
    return context->ops->read_faults(context, workspace, KVA__FAULTS_APPEND, report, stream);
}

KVA_API kva_status kva_cascade_read_faults(kva_context* context, const kva_cascade_plan* plan,
                                           const kva_workspace* workspace, kva_fault_report* report, void* stream) {
    static const char fn[] = "kva_cascade_read_faults";
    KVA_FORWARD(kva__cascade_check_plan(fn, context, plan, workspace));
    KVA_RETURN_IF(!report, KVA_ERR_INVALID_ARGUMENT, "%s: report is NULL", fn);
    memset(report, 0, sizeof *report);
    report->request = -1;
    for (int32_t l = 0; l < plan->num_levels; ++l) {
        kva_workspace sub = kva__sub_ws(workspace, plan->level_device_offset[l], plan->level_device_bytes[l],
                                        plan->level_host_offset[l], plan->level_host_bytes[l]);
        kva_fault_report r;
        KVA_FORWARD(context->ops->read_faults(context, &sub, KVA__FAULTS_WS, &r, stream));
        if (r.faulted && !report->faulted) *report = r;
    }
    return kva__read_append_fault(context, workspace, report, stream);
}

/* ============================================================================================== */
/* Variable block sizes per KV head                                                               */

#define KVA__VBSR_MAGIC 0x6b76617662737231ull /* "kvavbsr1" */

KVA_API void kva_vbsr_params_init(kva_vbsr_params* params) {
    if (params) memset(params, 0, sizeof *params);
}

KVA_API void kva_vbsr_run_args_init(kva_vbsr_run_args* args) {
    if (!args) return;
    memset(args, 0, sizeof *args);
    args->k_scale = 1.0f;
    args->v_scale = 1.0f;
}

typedef struct kva__vbsr_geom {
    int64_t M, N;
    int32_t MB, NB, H, g;
    bool masked;
    int64_t table_entries, mask_bytes; /* all heads */
    kva_attention_desc dense;          /* the caller's descriptor, normalised */
    kva_attention_desc op;             /* one KV head's composed op */
} kva__vbsr_geom;

/* Validate desc and params (every head); fill g. Reads every host array; writes nothing. */
static kva_status kva__vbsr_check(const char* fn, const kva_attention_desc* desc, const kva_vbsr_params* p,
                                  kva__vbsr_geom* g) {
    memset(g, 0, sizeof *g);
    KVA_RETURN_IF(!p, KVA_ERR_INVALID_ARGUMENT, "%s: params is NULL", fn);
    kva_status st = kva__desc_normalize(desc, &g->dense);
    if (st != KVA_OK) {
        char pre[128];
        snprintf(pre, sizeof pre, "%s: ", fn);
        return kva__prefix_error(st, pre);
    }
    KVA_RETURN_IF(g->dense.mask_mode == KVA_MASK_CUSTOM, KVA_ERR_INVALID_ARGUMENT,
                  "%s: desc->mask_mode = KVA_MASK_CUSTOM: give the block structure in params->block_mask_map "
                  "(mask_mode NONE or CAUSAL)", fn);
    KVA_RETURN_IF(g->dense.variant != NULL, KVA_ERR_UNSUPPORTED,
                  "%s: desc->variant: user variants are not supported by variable block-sparse attention (its run "
                  "arguments carry no variant parameters)", fn);
    KVA_RETURN_IF(g->dense.pos_encoding != KVA_POS_NONE, KVA_ERR_UNSUPPORTED,
                  "%s: desc->pos_encoding = %s: variable block-sparse attention supports KVA_POS_NONE only (apply "
                  "RoPE beforehand)", fn,
                  g->dense.pos_encoding == KVA_POS_ALIBI ? "KVA_POS_ALIBI" : "KVA_POS_ROPE_LLAMA");
    const int64_t M = p->num_qo_rows, N = p->num_kv_rows;
    const int32_t MB = p->num_block_rows, NB = p->num_block_cols, H = g->dense.num_kv_heads;
    KVA_RETURN_IF(M < 0 || N < 0, KVA_ERR_INVALID_ARGUMENT,
                  "%s: params->num_qo_rows = %lld and num_kv_rows = %lld must be >= 0", fn, (long long)M,
                  (long long)N);
    KVA_RETURN_IF(MB < 1 || NB < 1, KVA_ERR_INVALID_ARGUMENT,
                  "%s: params->num_block_rows = %d and num_block_cols = %d must be >= 1", fn, (int)MB, (int)NB);
    KVA_RETURN_IF(M > INT32_MAX / 2 || N > INT32_MAX / 2, KVA_ERR_UNSUPPORTED,
                  "%s: M = %lld or N = %lld is above 2^30", fn, (long long)M, (long long)N);
    KVA_RETURN_IF(!p->block_row_sz || !p->block_col_sz || !p->block_mask_map, KVA_ERR_INVALID_ARGUMENT,
                  "%s: params->block_row_sz, block_col_sz and block_mask_map are required", fn);
    const bool masked = g->dense.mask_mode == KVA_MASK_CAUSAL || g->dense.window_left >= 0;
    int64_t entries = 0, mbytes = 0;
    for (int32_t h = 0; h < H; ++h) {
        const int32_t* rs = p->block_row_sz + (int64_t)h * MB;
        const int32_t* cs = p->block_col_sz + (int64_t)h * NB;
        const uint8_t* mm = p->block_mask_map + (int64_t)h * MB * NB;
        int64_t sr = 0, sc = 0;
        for (int32_t b = 0; b < MB; ++b) {
            KVA_RETURN_IF(rs[b] < 0, KVA_ERR_INVALID_ARGUMENT, "%s: params->block_row_sz[%d, %d] = %d is negative",
                          fn, (int)h, (int)b, (int)rs[b]);
            sr += rs[b];
        }
        for (int32_t c = 0; c < NB; ++c) {
            KVA_RETURN_IF(cs[c] < 0, KVA_ERR_INVALID_ARGUMENT, "%s: params->block_col_sz[%d, %d] = %d is negative",
                          fn, (int)h, (int)c, (int)cs[c]);
            sc += cs[c];
        }
        KVA_RETURN_IF(sr != M || sc != N, KVA_ERR_INVALID_ARGUMENT,
                      "%s: KV head %d: block_row_sz sums to %lld (M = %lld) and block_col_sz to %lld (N = %lld); "
                      "each head's block sizes must tile the whole [M, N] matrix",
                      fn, (int)h, (long long)sr, (long long)M, (long long)sc, (long long)N);
        for (int32_t b = 0; b < MB; ++b) {
            int64_t kv = 0;
            for (int32_t c = 0; c < NB; ++c)
                if (mm[(int64_t)b * NB + c]) kv += cs[c];
            entries += kv;
            if (masked) mbytes += ((int64_t)rs[b] * kv + 7) / 8;
        }
        KVA_RETURN_IF(entries > INT32_MAX, KVA_ERR_UNSUPPORTED,
                      "%s: the token tables of heads 0..%d exceed 2^31 - 1 entries", fn, (int)h);
    }
    g->M = M;
    g->N = N;
    g->MB = MB;
    g->NB = NB;
    g->H = H;
    g->g = g->dense.num_qo_heads / H;
    g->masked = masked;
    g->table_entries = entries;
    g->mask_bytes = masked ? mbytes : 0;
    g->op = g->dense;
    g->op.num_qo_heads = g->g;
    g->op.num_kv_heads = 1;
    g->op.mask_mode = masked ? KVA_MASK_CUSTOM : KVA_MASK_NONE;
    g->op.window_left = -1;
    return KVA_OK;
}

/* Plan params of head h's op into scratch (qo_indptr [MB+1], kv_indptr [MB+1], last_page_len [MB]). */
static void kva__vbsr_head_params(const kva_vbsr_params* p, const kva__vbsr_geom* g, int32_t h, int32_t* scratch,
                                  kva_plan_params* pp) {
    const int32_t MB = g->MB, NB = g->NB;
    const int32_t* rs = p->block_row_sz + (int64_t)h * MB;
    const int32_t* cs = p->block_col_sz + (int64_t)h * NB;
    const uint8_t* mm = p->block_mask_map + (int64_t)h * MB * NB;
    int32_t* qo = scratch;
    int32_t* kvp = scratch + MB + 1;
    int32_t* lpl = scratch + 2 * (MB + 1);
    qo[0] = kvp[0] = 0;
    for (int32_t b = 0; b < MB; ++b) {
        int64_t kv = 0;
        for (int32_t c = 0; c < NB; ++c)
            if (mm[(int64_t)b * NB + c]) kv += cs[c];
        qo[b + 1] = qo[b] + rs[b];
        kvp[b + 1] = (int32_t)(kvp[b] + kv);
        lpl[b] = 1;
    }
    kva_plan_params_init(pp);
    pp->batch_size = MB;
    pp->qo_indptr = qo;
    pp->kv_indptr = kvp;
    pp->kv_last_page_len = lpl;
    pp->page_size = 1;
    pp->num_pages = g->N;
    pp->fixed_split_size = p->fixed_split_size;
    pp->disable_split_kv = p->disable_split_kv;
}

typedef struct kva__vbsr_layout {
    size_t dev_bytes, host_bytes; /* totals */
} kva__vbsr_layout;

/* Per-head region sizes (aligned) through the planner's layout; totals into lay; per-head sizes into the arrays
 * when given. */
static kva_status kva__vbsr_layout_of(const char* fn, kva_context* ctx, const kva_vbsr_params* p,
                                      const kva__vbsr_geom* g, size_t* dev_sz, size_t* host_sz,
                                      kva__vbsr_layout* lay) {
    memset(lay, 0, sizeof *lay);
    int32_t* scratch = (int32_t*)malloc(sizeof(int32_t) * (3 * (size_t)g->MB + 2));
    KVA_RETURN_IF(!scratch, KVA_ERR_OUT_OF_MEMORY, "%s: out of host memory", fn);
    for (int32_t h = 0; h < g->H; ++h) {
        kva_plan_params pp;
        kva__vbsr_head_params(p, g, h, scratch, &pp);
        kva__plan_data pd;
        kva_status st = kva__plan_layout(ctx, &g->op, KVA_OP_BATCH_PREFILL_PAGED, &pp, &pd);
        if (st != KVA_OK) {
            free(scratch);
            char pre[128];
            snprintf(pre, sizeof pre, "%s: KV head %d: ", fn, (int)h);
            return kva__prefix_error(st, pre);
        }
        size_t d = kva__align_up(pd.device_bytes, KVA__WS_ALIGN), hb = kva__align_up(pd.host_bytes, KVA__WS_ALIGN);
        if (dev_sz) dev_sz[h] = d;
        if (host_sz) host_sz[h] = hb;
        lay->dev_bytes += d;
        lay->host_bytes += hb;
    }
    free(scratch);
    return KVA_OK;
}

KVA_API kva_status kva_vbsr_workspace_size(kva_context* context, const kva_attention_desc* desc,
                                           const kva_vbsr_params* params, size_t* device_bytes, size_t* host_bytes) {
    static const char fn[] = "kva_vbsr_workspace_size";
    KVA_RETURN_IF(!context, KVA_ERR_INVALID_ARGUMENT, "%s: context is NULL", fn);
    kva__vbsr_geom g;
    KVA_FORWARD(kva__vbsr_check(fn, desc, params, &g));
    kva__vbsr_layout lay;
    KVA_FORWARD(kva__vbsr_layout_of(fn, context, params, &g, NULL, NULL, &lay));
    if (device_bytes) *device_bytes = lay.dev_bytes;
    if (host_bytes) *host_bytes = lay.host_bytes;
    return KVA_OK;
}

KVA_API kva_status kva_vbsr_plan_make(kva_context* context, const kva_attention_desc* desc,
                                      const kva_vbsr_params* params, const kva_workspace* workspace,
                                      kva_plan* head_plans, kva_vbsr_plan* plan, void* stream) {
    static const char fn[] = "kva_vbsr_plan_make";
    KVA_RETURN_IF(!context, KVA_ERR_INVALID_ARGUMENT, "%s: context is NULL", fn);
    KVA_RETURN_IF(!workspace, KVA_ERR_INVALID_ARGUMENT, "%s: workspace is NULL", fn);
    KVA_RETURN_IF(!plan || !head_plans, KVA_ERR_INVALID_ARGUMENT, "%s: plan and head_plans are required", fn);
    kva__vbsr_geom g;
    KVA_FORWARD(kva__vbsr_check(fn, desc, params, &g));
    size_t* sz = (size_t*)malloc(sizeof(size_t) * 2 * (size_t)g.H);
    KVA_RETURN_IF(!sz, KVA_ERR_OUT_OF_MEMORY, "%s: out of host memory", fn);
    kva__vbsr_layout lay;
    kva_status st = kva__vbsr_layout_of(fn, context, params, &g, sz, sz + g.H, &lay);
    if (st != KVA_OK) {
        free(sz);
        return st;
    }
    const bool staging = !context->ops->plans_on_host_memory;
    if (workspace->device_bytes < lay.dev_bytes || !workspace->device ||
        (staging && lay.host_bytes > 0 && (workspace->host_bytes < lay.host_bytes || !workspace->host))) {
        free(sz);
        return kva__set_error(KVA_ERR_WORKSPACE_TOO_SMALL,
                              "%s: the workspace has %zu device bytes at %p and %zu host bytes at %p; %d KV heads "
                              "need %zu and %zu (kva_vbsr_workspace_size)",
                              fn, workspace->device_bytes, workspace->device, workspace->host_bytes, workspace->host,
                              (int)g.H, lay.dev_bytes, staging ? lay.host_bytes : (size_t)0);
    }
    if (((uintptr_t)workspace->device % KVA__WS_ALIGN) != 0 ||
        (staging && ((uintptr_t)workspace->host % KVA__WS_ALIGN) != 0)) {
        free(sz);
        return kva__set_error(KVA_ERR_ALIGNMENT, "%s: workspace pointers must be %d-byte aligned (device %p, host %p)",
                              fn, KVA__WS_ALIGN, workspace->device, workspace->host);
    }
    int32_t* scratch = (int32_t*)malloc(sizeof(int32_t) * (3 * (size_t)g.MB + 2));
    if (!scratch) {
        free(sz);
        return kva__set_error(KVA_ERR_OUT_OF_MEMORY, "%s: out of host memory", fn);
    }
    size_t off = 0, hoff = 0;
    for (int32_t h = 0; h < g.H && st == KVA_OK; ++h) {
        kva_plan_params pp;
        kva__vbsr_head_params(params, &g, h, scratch, &pp);
        kva_workspace sub = kva__sub_ws(workspace, off, sz[h], hoff, sz[g.H + h]);
        st = kva_plan_make(context, &g.op, KVA_OP_BATCH_PREFILL_PAGED, &pp, &sub, &head_plans[h], stream);
        if (st != KVA_OK) {
            char pre[128];
            snprintf(pre, sizeof pre, "%s: KV head %d: ", fn, (int)h);
            st = kva__prefix_error(st, pre);
        }
        off += sz[h];
        hoff += sz[g.H + h];
    }
    free(scratch);
    free(sz);
    if (st != KVA_OK) return st;
    memset(plan, 0, sizeof *plan);
    plan->num_qo_rows = g.M;
    plan->num_kv_rows = g.N;
    plan->num_kv_heads = g.H;
    plan->uses_mask = g.masked ? 1 : 0;
    plan->table_entries = g.table_entries;
    plan->mask_bytes = g.mask_bytes;
    plan->device_bytes = lay.dev_bytes;
    plan->host_bytes = lay.host_bytes;
    plan->ws_device_addr = (uint64_t)(uintptr_t)workspace->device;
    plan->head_plans = head_plans;
    plan->magic = KVA__VBSR_MAGIC;
    return KVA_OK;
}

KVA_API kva_status kva_vbsr_pack(const kva_attention_desc* desc, const kva_vbsr_params* params, int32_t* table,
                                 size_t table_capacity, uint8_t* mask, size_t mask_capacity, int64_t* table_entries,
                                 int64_t* mask_bytes) {
    static const char fn[] = "kva_vbsr_pack";
    kva__vbsr_geom g;
    KVA_FORWARD(kva__vbsr_check(fn, desc, params, &g));
    KVA_RETURN_IF(table && table_capacity < (size_t)g.table_entries, KVA_ERR_INVALID_ARGUMENT,
                  "%s: table holds %zu entries; the plan needs %lld", fn, table_capacity,
                  (long long)g.table_entries);
    KVA_RETURN_IF(mask && mask_capacity < (size_t)g.mask_bytes, KVA_ERR_INVALID_ARGUMENT,
                  "%s: mask holds %zu bytes; the plan needs %lld", fn, mask_capacity, (long long)g.mask_bytes);
    KVA_RETURN_IF(table && g.masked && g.mask_bytes > 0 && !mask, KVA_ERR_INVALID_ARGUMENT,
                  "%s: the plan needs %lld bytes of packed masks (causal or window) but mask is NULL", fn,
                  (long long)g.mask_bytes);
    /* the sizes only once nothing can fail: an error leaves every output as it was */
    if (table_entries) *table_entries = g.table_entries;
    if (mask_bytes) *mask_bytes = g.mask_bytes;
    if (!table) return KVA_OK;
    if (mask && g.mask_bytes > 0) memset(mask, 0, (size_t)g.mask_bytes);
    const int32_t MB = g.MB, NB = g.NB;
    const bool causal = g.dense.mask_mode == KVA_MASK_CAUSAL;
    const int64_t win = g.dense.window_left;
    const int64_t shift = g.N - g.M;
    int64_t t = 0, mb = 0;
    for (int32_t h = 0; h < g.H; ++h) {
        const int32_t* rs = params->block_row_sz + (int64_t)h * MB;
        const int32_t* cs = params->block_col_sz + (int64_t)h * NB;
        const uint8_t* mm = params->block_mask_map + (int64_t)h * MB * NB;
        int64_t row0 = 0;
        for (int32_t b = 0; b < MB; ++b) {
            const int64_t t0 = t;
            int64_t col0 = 0;
            for (int32_t c = 0; c < NB; ++c) {
                if (mm[(int64_t)b * NB + c])
                    for (int64_t j = 0; j < cs[c]; ++j) table[t++] = (int32_t)(col0 + j);
                col0 += cs[c];
            }
            if (g.masked) {
                const int64_t kv = t - t0;
                uint8_t* out = mask + mb;
                for (int64_t r = 0; r < rs[b]; ++r) {
                    const int64_t qpos = row0 + r + shift;
                    for (int64_t e = 0; e < kv; ++e) {
                        const int64_t j = table[t0 + e];
                        if ((causal && j > qpos) || (win >= 0 && j < qpos - win)) continue;
                        const int64_t bit = r * kv + e;
                        out[bit >> 3] |= (uint8_t)(1u << (bit & 7));
                    }
                }
                mb += ((int64_t)rs[b] * kv + 7) / 8;
            }
            row0 += rs[b];
        }
    }
    return KVA_OK;
}

/* Checks of a vbsr plan against its workspace and context; per-head workspace offsets into dev_off/host_off. */
static kva_status kva__vbsr_check_plan(const char* fn, const kva_context* ctx, const kva_vbsr_plan* plan,
                                       const kva_workspace* ws) {
    KVA_RETURN_IF(!ctx, KVA_ERR_INVALID_ARGUMENT, "%s: context is NULL", fn);
    KVA_RETURN_IF(!plan, KVA_ERR_INVALID_ARGUMENT, "%s: plan is NULL", fn);
    KVA_RETURN_IF(!ws, KVA_ERR_INVALID_ARGUMENT, "%s: workspace is NULL", fn);
    KVA_RETURN_IF(plan->magic != KVA__VBSR_MAGIC || plan->num_kv_heads < 1 || !plan->head_plans,
                  KVA_ERR_PLAN_MISMATCH, "%s: the plan was not made by kva_vbsr_plan_make or was corrupted", fn);
    KVA_RETURN_IF(plan->ws_device_addr != (uint64_t)(uintptr_t)ws->device || ws->device_bytes < plan->device_bytes,
                  KVA_ERR_PLAN_MISMATCH,
                  "%s: the workspace (%p, %zu bytes) is not the one the plan was written into (%p, %zu bytes needed)",
                  fn, ws->device, ws->device_bytes, (void*)(uintptr_t)plan->ws_device_addr, plan->device_bytes);
    uint64_t addr = plan->ws_device_addr;
    int64_t entries = 0, mbytes = 0;
    const kva__plan_data* pd0 = kva__plan_data_ofc(&plan->head_plans[0]);
    for (int32_t h = 0; h < plan->num_kv_heads; ++h) {
        const kva__plan_data* pd = kva__plan_data_ofc(&plan->head_plans[h]);
        KVA_RETURN_IF(!kva__plan_intact(pd) ||
                          (kva_op)pd->op != KVA_OP_BATCH_PREFILL_PAGED || pd->total_qo_rows != plan->num_qo_rows ||
                          pd->page_size != 1 || pd->desc.num_kv_heads != 1,
                      KVA_ERR_PLAN_MISMATCH, "%s: head_plans[%d] is not this plan's (changed or corrupted?)", fn,
                      (int)h);
        KVA_RETURN_IF(pd->context_id != ctx->id, KVA_ERR_PLAN_MISMATCH, "%s: the plan was made by another context",
                      fn);
        KVA_RETURN_IF(pd->ws_device_addr != addr, KVA_ERR_PLAN_MISMATCH,
                      "%s: head_plans[%d] is not at its workspace offset (changed or corrupted?)", fn, (int)h);
        KVA_RETURN_IF(pd->desc.num_qo_heads != pd0->desc.num_qo_heads || pd->desc.head_dim_qk != pd0->desc.head_dim_qk ||
                          pd->desc.head_dim_vo != pd0->desc.head_dim_vo || pd->desc.q_dtype != pd0->desc.q_dtype ||
                          pd->desc.kv_dtype != pd0->desc.kv_dtype || pd->desc.o_dtype != pd0->desc.o_dtype ||
                          pd->desc.mask_mode != pd0->desc.mask_mode || pd->num_pages != pd0->num_pages,
                      KVA_ERR_PLAN_MISMATCH,
                      "%s: head_plans[%d] disagrees with head 0's (corrupted?)", fn, (int)h);
        addr += kva__align_up(pd->device_bytes, KVA__WS_ALIGN);
        entries += pd->num_page_entries;
        mbytes += pd->desc.mask_mode == KVA_MASK_CUSTOM ? pd->custom_mask_bytes : 0;
    }
    KVA_RETURN_IF(entries != plan->table_entries || mbytes != plan->mask_bytes ||
                      addr - plan->ws_device_addr != plan->device_bytes,
                  KVA_ERR_PLAN_MISMATCH, "%s: the head plans disagree with the plan's totals (changed or corrupted?)",
                  fn);
    return KVA_OK;
}

/* Head h's region of a vbsr workspace: the regions follow each other in head order, each its plan's sizes rounded
 * to the alignment; *off / *hoff advance past it. */
static kva_workspace kva__vbsr_next_ws(const kva_workspace* ws, const kva__plan_data* pd, size_t* off, size_t* hoff) {
    const size_t db = kva__align_up(pd->device_bytes, KVA__WS_ALIGN);
    const size_t hb = kva__align_up(pd->host_bytes, KVA__WS_ALIGN);
    kva_workspace sub = kva__sub_ws(ws, *off, db, *hoff, hb);
    *off += db;
    *hoff += hb;
    return sub;
}

/* The sub-view of a [rows, heads, dim] (or [rows, heads]) tensor at heads [h0, h0 + n). */
static kva_tensor kva__head_slice(const kva_tensor* t, int64_t h0, int64_t n) {
    kva_tensor s = *t;
    s.data = (char*)t->data + (size_t)(h0 * t->stride[1]) * kva_dtype_size(t->dtype);
    s.shape[1] = n;
    return s;
}

KVA_API kva_status kva_vbsr_run(kva_context* context, const kva_vbsr_plan* plan, const kva_workspace* workspace,
                                const kva_vbsr_run_args* args) {
    static const char fn[] = "kva_vbsr_run";
    KVA_FORWARD(kva__vbsr_check_plan(fn, context, plan, workspace));
    KVA_RETURN_IF(!args, KVA_ERR_INVALID_ARGUMENT, "%s: args is NULL", fn);
    const int32_t H = plan->num_kv_heads;
    const kva_attention_desc* d = &kva__plan_data_ofc(&plan->head_plans[0])->desc; /* one head's op */
    const int64_t M = plan->num_qo_rows, N = plan->num_kv_rows, Hq = (int64_t)d->num_qo_heads * H;
    if (M > 0) {
        int64_t qs[3] = {M, Hq, d->head_dim_qk};
        int64_t os[3] = {M, Hq, d->head_dim_vo};
        KVA_FORWARD(kva__check_tensor("kva_vbsr_run: q", &args->q, d->q_dtype, 3, qs));
        KVA_FORWARD(kva__check_tensor("kva_vbsr_run: o", &args->o, d->o_dtype, 3, os));
        KVA_FORWARD(kva__check_written("kva_vbsr_run: o", &args->o));
        if (args->lse.data) {
            KVA_RETURN_IF(d->score_mode == KVA_SCORE_SIGMOID, KVA_ERR_INVALID_ARGUMENT,
                          "%s: lse is not defined in sigmoid (no-softmax) mode; pass lse.data = NULL", fn);
            int64_t ls[2] = {M, Hq};
            KVA_FORWARD(kva__check_tensor("kva_vbsr_run: lse", &args->lse, KVA_DTYPE_F32, 2, ls));
            KVA_FORWARD(kva__check_written("kva_vbsr_run: lse", &args->lse));
        }
    }
    if (N > 0 && plan->table_entries > 0) {
        int64_t ks[3] = {N, H, d->head_dim_qk};
        int64_t vs[3] = {N, H, d->head_dim_vo};
        KVA_FORWARD(kva__check_tensor("kva_vbsr_run: k", &args->k, d->kv_dtype, 3, ks));
        KVA_FORWARD(kva__check_tensor("kva_vbsr_run: v", &args->v, d->kv_dtype, 3, vs));
    }
    KVA_RETURN_IF(!isfinite(args->k_scale) || !isfinite(args->v_scale), KVA_ERR_INVALID_ARGUMENT,
                  "%s: k_scale = %g and v_scale = %g must be finite", fn, (double)args->k_scale,
                  (double)args->v_scale);
    KVA_RETURN_IF(plan->table_entries > 0 && !args->table, KVA_ERR_INVALID_ARGUMENT,
                  "%s: args->table (kva_vbsr_pack's token tables, backend memory) is NULL", fn);
    KVA_RETURN_IF(args->table_entries < plan->table_entries, KVA_ERR_INVALID_ARGUMENT,
                  "%s: args->table_entries = %lld, the plan needs %lld", fn, (long long)args->table_entries,
                  (long long)plan->table_entries);
    KVA_RETURN_IF(plan->uses_mask && plan->mask_bytes > 0 && !args->packed_mask, KVA_ERR_INVALID_ARGUMENT,
                  "%s: the plan needs packed masks (%lld bytes from kva_vbsr_pack, backend memory) but "
                  "args->packed_mask is NULL", fn, (long long)plan->mask_bytes);
    KVA_RETURN_IF(plan->uses_mask && args->packed_mask_bytes < plan->mask_bytes, KVA_ERR_INVALID_ARGUMENT,
                  "%s: args->packed_mask_bytes = %lld, the plan needs %lld", fn, (long long)args->packed_mask_bytes,
                  (long long)plan->mask_bytes);
    if (context->ops->plans_on_host_memory && plan->table_entries > 0) {
        const int32_t* t = args->table;
        for (int64_t i = 0; i < plan->table_entries; ++i)
            KVA_RETURN_IF(t[i] < 0 || t[i] >= N, KVA_ERR_PAGE_INDEX_OUT_OF_RANGE,
                          "%s: table[%lld] = %d is not a key row of [0, %lld)", fn, (long long)i, (int)t[i],
                          (long long)N);
    }
    if (M == 0) return KVA_OK;

    const int64_t g = d->num_qo_heads;
    kva_run_args ra;
    kva_run_args_init(&ra);
    ra.k_scale = args->k_scale;
    ra.v_scale = args->v_scale;
    ra.stream = args->stream;
    size_t off = 0, hoff = 0;
    int64_t toff = 0, moff = 0;
    for (int32_t h = 0; h < H; ++h) {
        const kva__plan_data* pd = kva__plan_data_ofc(&plan->head_plans[h]);
        kva_workspace sub = kva__vbsr_next_ws(workspace, pd, &off, &hoff);
        ra.q = kva__head_slice(&args->q, (int64_t)h * g, g);
        ra.o = kva__head_slice(&args->o, (int64_t)h * g, g);
        if (args->lse.data) ra.lse = kva__head_slice(&args->lse, (int64_t)h * g, g);
        kva_paged_kv* pk = &ra.paged;
        memset(pk, 0, sizeof *pk);
        pk->dtype = d->kv_dtype;
        pk->num_pages = N;
        pk->page_size = 1;
        pk->num_heads = 1;
        pk->head_dim_qk = d->head_dim_qk;
        pk->head_dim_vo = d->head_dim_vo;
        if (pd->num_page_entries > 0) {
            const size_t es = kva_dtype_size(d->kv_dtype);
            pk->k_data = (char*)args->k.data + (size_t)(h * args->k.stride[1]) * es;
            pk->v_data = (char*)args->v.data + (size_t)(h * args->v.stride[1]) * es;
            pk->k_stride_page = pk->k_stride_token = args->k.stride[0];
            pk->v_stride_page = pk->v_stride_token = args->v.stride[0];
            pk->k_stride_head = args->k.stride[1];
            pk->v_stride_head = args->v.stride[1];
            pk->indices = args->table + toff;
        }
        if (plan->uses_mask) {
            ra.custom_mask = args->packed_mask ? args->packed_mask + moff : NULL;
            ra.custom_mask_bytes = args->packed_mask_bytes - moff;
        }
        kva_status st = kva_run(context, &plan->head_plans[h], &sub, &ra);
        if (st != KVA_OK) {
            char pre[128];
            snprintf(pre, sizeof pre, "%s: KV head %d: ", fn, (int)h);
            return kva__prefix_error(st, pre);
        }
        toff += pd->num_page_entries;
        moff += pd->desc.mask_mode == KVA_MASK_CUSTOM ? pd->custom_mask_bytes : 0;
    }
    return KVA_OK;
}

KVA_API kva_status kva_vbsr_read_faults(kva_context* context, const kva_vbsr_plan* plan,
                                        const kva_workspace* workspace, kva_fault_report* report, void* stream) {
    static const char fn[] = "kva_vbsr_read_faults";
    KVA_FORWARD(kva__vbsr_check_plan(fn, context, plan, workspace));
    KVA_RETURN_IF(!report, KVA_ERR_INVALID_ARGUMENT, "%s: report is NULL", fn);
    memset(report, 0, sizeof *report);
    report->request = -1;
    size_t off = 0, hoff = 0;
    for (int32_t h = 0; h < plan->num_kv_heads; ++h) {
        kva_workspace sub = kva__vbsr_next_ws(workspace, kva__plan_data_ofc(&plan->head_plans[h]), &off, &hoff);
        kva_fault_report r;
        KVA_FORWARD(context->ops->read_faults(context, &sub, KVA__FAULTS_WS, &r, stream));
        if (r.faulted && !report->faulted) *report = r;
    }
    return kva__read_append_fault(context, workspace, report, stream);
}
