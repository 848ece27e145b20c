/*
 * test_ops.c - every operation of the public API against the float64 reference (ref.c), on the backend
 * chosen by KVA_TEST_BACKEND / --backend.
 *
 * Every case is one printable line (h_case_format); a failing case prints it, and
 *   test_ops --case "<line>"
 * replays exactly that case. Suites (--suite): ref, decode, prefill, ragged, single, merge, append, split,
 * fuzz (--seed, --count), long, all (default: everything but long).
 *
 * Per case: inputs are random normal-ish values in their dtype (the reference reads the rounded values),
 * KV pools are 2-3x larger than needed with a scattered page table, every byte a kernel must not read
 * (unused pages, page slots past a request's length, stride padding) holds NaN, outputs are poisoned with
 * NaN between guard bands, and after the run: guards intact, padding still poison, inputs unchanged,
 * every output element within the tolerance table of harness.c, and a second run byte-identical.
 */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "harness.h"

static void* xcalloc(size_t n, size_t s) {
    void* p = calloc(n ? n : 1, s ? s : 1);
    if (!p) {
        printf("FATAL: out of memory\n");
        exit(3);
    }
    return p;
}

static int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }
static int op_is_batch(h_op op) { return op == H_OP_DECODE || op == H_OP_PREFILL || op == H_OP_RAGGED; }
static int op_is_paged(h_op op) { return op == H_OP_DECODE || op == H_OP_PREFILL; }

/* ============================================================================================== */
/* Attention cases                                                                                 */

typedef struct att {
    int32_t B;
    int32_t *qo, *kv;
    int32_t *qo_indptr, *kv_indptr, *last, *indices; /* host; kv_indptr: pages (paged) or tokens (ragged) */
    int32_t *bt, bt_stride; /* the block-table form (h_case.bt): [B][bt_stride] host, the pages of indices */
    int64_t *kv_off;   /* first token of request b in k_ref / v_ref */
    int64_t total_rows, total_kv, num_pages, num_entries, max_kv_len;
    int64_t *mask_off, mask_bytes;
    uint8_t* mask;
    float* slopes;     /* custom ALiBi slopes [hq] or NULL */
    double *q_ref, *k_ref, *v_ref, *o_ref, *lse_ref, *mag_ref;
    h_buf q, o, o2, lse, lse2, kp, vp, k, v, idx_d, indptr_d, last_d, mask_d, slopes_d;
    int shared_pool;   /* pool = 1: kp holds K and V */
    int64_t q_s0, o_s0, lse_s0;
    int64_t k_s[3], v_s[3]; /* element strides (page/row, token, head) */
    kva_paged_kv paged;
    kva_tensor tq, to, to2, tlse, tlse2, tk, tv;
} att;

static void att_free(att* a) {
    free(a->qo);
    free(a->kv);
    free(a->qo_indptr);
    free(a->kv_indptr);
    free(a->last);
    free(a->indices);
    free(a->bt);
    free(a->kv_off);
    free(a->mask_off);
    free(a->mask);
    free(a->slopes);
    free(a->q_ref);
    free(a->k_ref);
    free(a->v_ref);
    free(a->o_ref);
    free(a->lse_ref);
    free(a->mag_ref);
    h_buf* bufs[] = {&a->q, &a->o, &a->o2, &a->lse, &a->lse2, &a->kp, &a->vp, &a->k, &a->v, &a->idx_d,
                     &a->indptr_d, &a->last_d, &a->mask_d, &a->slopes_d};
    for (size_t i = 0; i < sizeof bufs / sizeof bufs[0]; ++i)
        if (bufs[i]->host) h_buf_free(bufs[i]);
    memset(a, 0, sizeof *a);
}

/* Forced lengths (batch-invariance checks); NULL = random. */
static const int32_t* g_force_qo;
static const int32_t* g_force_kv;

/* Lengths of batch B: the first non-empty request gets exactly max_kv (long cases reach their length). */
static void gen_lengths(const h_case* c, h_rng* r, int32_t B, int32_t* qo, int32_t* kv) {
    if (g_force_qo && g_force_kv) {
        memcpy(qo, g_force_qo, sizeof(int32_t) * (size_t)B);
        memcpy(kv, g_force_kv, sizeof(int32_t) * (size_t)B);
        return;
    }
    int first = 1;
    for (int32_t b = 0; b < B; ++b) {
        int empty = h_rng_range(r, 0, 99) < c->empty_pct;
        int32_t k = empty ? 0 : first || c->equal_kv ? c->max_kv : (int32_t)h_rng_range(r, 1, c->max_kv);
        if (!empty) first = 0;
        if (c->max_kv == 0) k = 0;
        int32_t q;
        switch (c->op) {
        case H_OP_DECODE:
        case H_OP_SINGLE_DECODE: q = 1; break;
        default: {
            int32_t hi = k > 0 ? (k < c->max_qo ? k : c->max_qo) : (c->max_qo < 3 ? c->max_qo : 3);
            /* drawn only when asked for, so the cases without it keep their lengths */
            if (c->long_qo_pct > 0 && h_rng_range(r, 0, 99) < c->long_qo_pct) hi = c->max_qo;
            if (hi < 1) hi = 1;
            q = (int32_t)h_rng_range(r, 1, hi);
            if (h_rng_range(r, 0, 99) < c->zero_qo_pct) q = 0;
        }
        }
        qo[b] = q;
        kv[b] = k;
    }
}

static void fill_nan(h_buf* b) { h_buf_poison(b); }

/* f32 where the backend has it, else `dev`: for cases about another feature that use f32 q (or KV) on the CPU. The
 * CUDA backend takes f16/bf16 q and f16/bf16/fp8 KV only (f32: KVA_ERR_UNSUPPORTED, a skip); there the case keeps
 * its other features with a 16-bit dtype. The dtype sweeps still list f32 and skip it on such a backend. */
static kva_dtype f32_or(kva_dtype dev) { return h_backend_device() ? dev : KVA_DTYPE_F32; }

/* Random value of dtype stored at element i of buffer b; returns the stored value. */
static double put_rand(h_buf* b, size_t i, h_rng* r) { return h_buf_set(b, i, h_rng_normalish(r)); }

/* The same times amp, saturated at the largest finite value of the buffer's dtype (K/V of h_case.kv_amp). */
static double put_rand_amp(h_buf* b, size_t i, h_rng* r, double amp) {
    double x = amp * h_rng_normalish(r);
    if (amp != 1.0) {
        double top = b->dtype == KVA_DTYPE_E4M3 ? 448.0 : b->dtype == KVA_DTYPE_E5M2 ? 57344.0
                     : b->dtype == KVA_DTYPE_F16 ? 65504.0 : INFINITY;
        x = x > top ? top : x < -top ? -top : x;
    }
    return h_buf_set(b, i, x);
}

/* K/V strides for the pool mode: s[0] page, s[1] token, s[2] head. pool = 2 pads every stride by an odd number
 * of elements, rounded up to a multiple of quantum (1: keep them odd; attention cases pass
 * h_stride_quantum(kv dtype), which is 16 bytes on a device backend; append takes any stride everywhere). */
static void pool_strides(const h_case* c, int32_t D, int64_t quantum, int64_t s[3]) {
    int64_t H = c->hkv, ps = c->page_size;
    if (c->pool == 2) {
        const int64_t p3 = (3 + quantum - 1) / quantum * quantum, p5 = (5 + quantum - 1) / quantum * quantum,
                      p11 = (11 + quantum - 1) / quantum * quantum;
        if (c->layout == KVA_LAYOUT_NHD) {
            s[2] = D + p3;
            s[1] = H * s[2] + p5;
            s[0] = ps * s[1] + p11;
        } else {
            s[1] = D + p3;
            s[2] = ps * s[1] + p5;
            s[0] = H * s[2] + p11;
        }
        return;
    }
    int64_t pair = c->pool == 1 ? 2 : 1;
    if (c->layout == KVA_LAYOUT_NHD) {
        s[2] = D;
        s[1] = H * D;
    } else {
        s[1] = D;
        s[2] = ps * D;
    }
    s[0] = pair * ps * H * D;
}

/* Build one batch: lengths, page table, inputs (NaN around them), outputs (poisoned), reference. */
static void att_build(const h_case* c, h_rng* r, int32_t B, att* a) {
    memset(a, 0, sizeof *a);
    const int32_t hq = c->hq, H = c->hkv, dqk = c->dqk, dvo = c->dvo, ps = c->page_size;
    const kva_dtype kvt = c->kv_dt;
    a->B = B;
    a->qo = (int32_t*)xcalloc((size_t)B, sizeof(int32_t));
    a->kv = (int32_t*)xcalloc((size_t)B, sizeof(int32_t));
    gen_lengths(c, r, B, a->qo, a->kv);
    a->qo_indptr = (int32_t*)xcalloc((size_t)B + 1, sizeof(int32_t));
    a->kv_indptr = (int32_t*)xcalloc((size_t)B + 1, sizeof(int32_t));
    a->last = (int32_t*)xcalloc((size_t)B + 1, sizeof(int32_t));
    a->kv_off = (int64_t*)xcalloc((size_t)B + 1, sizeof(int64_t));
    a->mask_off = (int64_t*)xcalloc((size_t)B + 1, sizeof(int64_t));
    for (int32_t b = 0; b < B; ++b) {
        a->qo_indptr[b + 1] = a->qo_indptr[b] + a->qo[b];
        a->kv_off[b + 1] = a->kv_off[b] + a->kv[b];
        a->mask_off[b + 1] = a->mask_off[b] + ceil_div((int64_t)a->qo[b] * a->kv[b], 8);
        if (a->kv[b] > a->max_kv_len) a->max_kv_len = a->kv[b];
        if (op_is_paged(c->op)) {
            int32_t np = (int32_t)ceil_div(a->kv[b], ps);
            a->kv_indptr[b + 1] = a->kv_indptr[b] + np;
            a->last[b] = np ? a->kv[b] - (np - 1) * ps : 0;
        } else {
            a->kv_indptr[b + 1] = a->kv_indptr[b] + a->kv[b];
        }
    }
    a->total_rows = a->qo_indptr[B];
    a->total_kv = a->kv_off[B];
    a->mask_bytes = a->mask_off[B];

    /* q: [rows, hq, dqk], row stride hq * dqk + qpad; padding NaN */
    a->q_s0 = (int64_t)hq * dqk + c->qpad;
    a->q = h_buf_alloc(c->q_dt, (size_t)(a->total_rows * a->q_s0));
    fill_nan(&a->q);
    a->q_ref = (double*)xcalloc((size_t)(a->total_rows * hq * dqk), sizeof(double));
    for (int64_t i = 0; i < a->total_rows; ++i)
        for (int32_t h = 0; h < hq; ++h)
            for (int32_t d = 0; d < dqk; ++d)
                a->q_ref[(i * hq + h) * dqk + d] = put_rand(&a->q, (size_t)(i * a->q_s0 + h * dqk + d), r);

    /* K/V, reference copies gathered per request [total_kv][H][D] (scaled) */
    a->k_ref = (double*)xcalloc((size_t)(a->total_kv * H * dqk), sizeof(double));
    a->v_ref = (double*)xcalloc((size_t)(a->total_kv * H * dvo), sizeof(double));
    const double ks = c->k_scale, vs = c->v_scale, amp = c->kv_amp;
    if (op_is_paged(c->op)) {
        a->num_entries = a->kv_indptr[B];
        a->num_pages = a->num_entries * 2 + h_rng_range(r, 1, a->num_entries + 3);
        int32_t* perm = (int32_t*)xcalloc((size_t)a->num_pages, sizeof(int32_t));
        for (int64_t p = 0; p < a->num_pages; ++p) perm[p] = (int32_t)p;
        h_rng_shuffle_i32(r, perm, a->num_pages);
        a->indices = (int32_t*)xcalloc((size_t)a->num_entries + 1, sizeof(int32_t));
        memcpy(a->indices, perm, sizeof(int32_t) * (size_t)a->num_entries);
        free(perm);
        pool_strides(c, dqk, h_stride_quantum(kvt), a->k_s);
        pool_strides(c, dvo, h_stride_quantum(kvt), a->v_s);
        if (c->pool == 1) {
            a->shared_pool = 1;
            a->kp = h_buf_alloc(kvt, (size_t)(a->num_pages * a->k_s[0]));
            fill_nan(&a->kp);
        } else {
            a->kp = h_buf_alloc(kvt, (size_t)(a->num_pages * a->k_s[0]));
            a->vp = h_buf_alloc(kvt, (size_t)(a->num_pages * a->v_s[0]));
            fill_nan(&a->kp);
            fill_nan(&a->vp);
        }
        h_buf* vbuf = c->pool == 1 ? &a->kp : &a->vp;
        int64_t v_base = c->pool == 1 ? (int64_t)ps * H * dqk : 0; /* V half of each [2, ...] page */
        for (int32_t b = 0; b < B; ++b)
            for (int64_t j = 0; j < a->kv[b]; ++j) {
                int64_t page = a->indices[a->kv_indptr[b] + j / ps], t = j % ps;
                for (int32_t h = 0; h < H; ++h) {
                    int64_t kb = page * a->k_s[0] + t * a->k_s[1] + h * a->k_s[2];
                    int64_t vb = v_base + page * a->v_s[0] + t * a->v_s[1] + h * a->v_s[2];
                    for (int32_t d = 0; d < dqk; ++d)
                        a->k_ref[((a->kv_off[b] + j) * H + h) * dqk + d] = ks * put_rand_amp(&a->kp, (size_t)(kb + d), r, amp);
                    for (int32_t d = 0; d < dvo; ++d)
                        a->v_ref[((a->kv_off[b] + j) * H + h) * dvo + d] = vs * put_rand_amp(vbuf, (size_t)(vb + d), r, amp);
                }
            }
        memset(&a->paged, 0, sizeof a->paged);
        a->paged.k_data = h_buf_dp(&a->kp);
        a->paged.v_data = (char*)h_buf_dp(vbuf) + (size_t)v_base * ref_dtype_size(kvt);
        a->paged.dtype = kvt;
        a->paged.num_pages = a->num_pages;
        a->paged.page_size = ps;
        a->paged.num_heads = H;
        a->paged.head_dim_qk = dqk;
        a->paged.head_dim_vo = dvo;
        a->paged.k_stride_page = a->k_s[0];
        a->paged.k_stride_token = a->k_s[1];
        a->paged.k_stride_head = a->k_s[2];
        a->paged.v_stride_page = a->v_s[0];
        a->paged.v_stride_token = a->v_s[1];
        a->paged.v_stride_head = a->v_s[2];
        if (c->bt) {
            /* the block-table form: row b holds request b's pages, then entries outside the pool that must never be
               read (a read faults the request); one to three spare entries a row */
            int32_t maxp = 0;
            for (int32_t b = 0; b < B; ++b)
                if (a->kv_indptr[b + 1] - a->kv_indptr[b] > maxp) maxp = a->kv_indptr[b + 1] - a->kv_indptr[b];
            a->bt_stride = maxp + (int32_t)h_rng_range(r, 1, 3);
            const int64_t n = (int64_t)B * a->bt_stride;
            a->bt = (int32_t*)xcalloc((size_t)n + 1, sizeof(int32_t));
            for (int64_t i = 0; i < n; ++i) a->bt[i] = i % 3 == 0 ? -1 : i % 3 == 1 ? INT32_MAX : (int32_t)a->num_pages;
            for (int32_t b = 0; b < B; ++b)
                memcpy(a->bt + (int64_t)b * a->bt_stride, a->indices + a->kv_indptr[b],
                       sizeof(int32_t) * (size_t)(a->kv_indptr[b + 1] - a->kv_indptr[b]));
            a->idx_d = h_buf_alloc(KVA_DTYPE_I32, (size_t)n);
            memcpy(h_buf_hp(&a->idx_d), a->bt, sizeof(int32_t) * (size_t)n);
        } else {
            a->idx_d = h_buf_alloc(KVA_DTYPE_I32, (size_t)a->num_entries);
            memcpy(h_buf_hp(&a->idx_d), a->indices, sizeof(int32_t) * (size_t)a->num_entries);
        }
        a->indptr_d = h_buf_alloc(KVA_DTYPE_I32, (size_t)B + 1);
        memcpy(h_buf_hp(&a->indptr_d), a->kv_indptr, sizeof(int32_t) * ((size_t)B + 1));
        a->last_d = h_buf_alloc(KVA_DTYPE_I32, (size_t)B);
        memcpy(h_buf_hp(&a->last_d), a->last, sizeof(int32_t) * (size_t)B);
        h_buf_upload(&a->idx_d);
        h_buf_upload(&a->indptr_d);
        h_buf_upload(&a->last_d);
        a->paged.indices = (const int32_t*)h_buf_dp(&a->idx_d);
        if (c->bt) a->paged.num_indices = (int64_t)B * a->bt_stride; /* checked against the plan's span */
        a->paged.indptr = (const int32_t*)h_buf_dp(&a->indptr_d);
        a->paged.last_page_len = (const int32_t*)h_buf_dp(&a->last_d);
        h_buf_upload(&a->kp);
        if (c->pool != 1) h_buf_upload(&a->vp);
    } else {
        /* ragged / single: k [total_kv, H, dqk] with (row, head) strides; pool = 2 pads them (odd paddings, rounded
           to 16 bytes on a device backend) */
        int64_t pad_h = c->pool == 2 ? h_round_pad(3, kvt) : 0, pad_r = c->pool ? h_round_pad(5, kvt) : 0;
        a->k_s[2] = dqk + pad_h;
        a->k_s[1] = H * a->k_s[2] + pad_r;
        a->v_s[2] = dvo + pad_h;
        a->v_s[1] = H * a->v_s[2] + pad_r;
        a->k = h_buf_alloc(kvt, (size_t)(a->total_kv * a->k_s[1]));
        a->v = h_buf_alloc(kvt, (size_t)(a->total_kv * a->v_s[1]));
        fill_nan(&a->k);
        fill_nan(&a->v);
        for (int64_t j = 0; j < a->total_kv; ++j)
            for (int32_t h = 0; h < H; ++h) {
                for (int32_t d = 0; d < dqk; ++d)
                    a->k_ref[(j * H + h) * dqk + d] = ks * put_rand_amp(&a->k, (size_t)(j * a->k_s[1] + h * a->k_s[2] + d), r, amp);
                for (int32_t d = 0; d < dvo; ++d)
                    a->v_ref[(j * H + h) * dvo + d] = vs * put_rand_amp(&a->v, (size_t)(j * a->v_s[1] + h * a->v_s[2] + d), r, amp);
            }
        h_buf_upload(&a->k);
        h_buf_upload(&a->v);
        a->tk.data = h_buf_dp(&a->k);
        a->tk.dtype = kvt;
        a->tk.ndim = 3;
        a->tk.shape[0] = a->total_kv;
        a->tk.shape[1] = H;
        a->tk.shape[2] = dqk;
        a->tk.stride[0] = a->k_s[1];
        a->tk.stride[1] = a->k_s[2];
        a->tk.stride[2] = 1;
        a->tv = a->tk;
        a->tv.data = h_buf_dp(&a->v);
        a->tv.shape[2] = dvo;
        a->tv.stride[0] = a->v_s[1];
        a->tv.stride[1] = a->v_s[2];
    }
    h_buf_upload(&a->q);

    /* custom mask: ~75% ones, some rows fully masked; the unused tail bits of each segment random */
    a->mask = (uint8_t*)xcalloc((size_t)a->mask_bytes + 1, 1);
    if (c->mask == KVA_MASK_CUSTOM) {
        for (int64_t i = 0; i < a->mask_bytes; ++i) a->mask[i] = (uint8_t)h_rng_u64(r);
        for (int32_t b = 0; b < B; ++b)
            for (int64_t i = 0; i < a->qo[b]; ++i) {
                int64_t mode = h_rng_range(r, 0, 7); /* 0: row masked out, 1: all visible, else random 75% */
                for (int64_t j = 0; j < a->kv[b]; ++j) {
                    int64_t bit = i * a->kv[b] + j;
                    uint8_t* byte = a->mask + a->mask_off[b] + bit / 8;
                    int on = mode == 0 ? 0 : mode == 1 ? 1 : h_rng_range(r, 0, 3) != 0;
                    if (on) *byte = (uint8_t)(*byte | (1u << (bit % 8)));
                    else *byte = (uint8_t)(*byte & ~(1u << (bit % 8)));
                }
            }
    }
    a->mask_d = h_buf_alloc(KVA_DTYPE_U8, (size_t)a->mask_bytes);
    memcpy(h_buf_hp(&a->mask_d), a->mask, (size_t)a->mask_bytes);
    h_buf_upload(&a->mask_d);

    double* slopes_ref = NULL;
    if (c->pos == KVA_POS_ALIBI && c->custom_slopes) {
        a->slopes = (float*)xcalloc((size_t)hq, sizeof(float));
        slopes_ref = (double*)xcalloc((size_t)hq, sizeof(double));
        a->slopes_d = h_buf_alloc(KVA_DTYPE_F32, (size_t)hq);
        for (int32_t h = 0; h < hq; ++h) {
            a->slopes[h] = (float)(0.01 + 0.99 * h_rng_uniform(r));
            slopes_ref[h] = a->slopes[h];
            h_buf_set(&a->slopes_d, (size_t)h, a->slopes[h]);
        }
        h_buf_upload(&a->slopes_d);
    }

    /* outputs: o [rows, hq, dvo] with row stride hq * dvo + opad; lse [rows, hq] with a padded row when opad */
    a->o_s0 = (int64_t)hq * dvo + c->opad;
    a->lse_s0 = hq + (c->opad ? 3 : 0);
    a->o = h_buf_alloc(c->o_dt, (size_t)(a->total_rows * a->o_s0));
    a->o2 = h_buf_alloc(c->o_dt, (size_t)(a->total_rows * a->o_s0));
    a->lse = h_buf_alloc(KVA_DTYPE_F32, (size_t)(a->total_rows * a->lse_s0));
    a->lse2 = h_buf_alloc(KVA_DTYPE_F32, (size_t)(a->total_rows * a->lse_s0));
    h_buf* outs[] = {&a->o, &a->o2, &a->lse, &a->lse2};
    for (int i = 0; i < 4; ++i) {
        h_buf_poison(outs[i]);
        h_buf_upload(outs[i]);
    }
    kva_tensor* tos[] = {&a->to, &a->to2};
    h_buf* obufs[] = {&a->o, &a->o2};
    for (int i = 0; i < 2; ++i) {
        memset(tos[i], 0, sizeof(kva_tensor));
        tos[i]->data = h_buf_dp(obufs[i]);
        tos[i]->dtype = c->o_dt;
        tos[i]->ndim = 3;
        tos[i]->shape[0] = a->total_rows;
        tos[i]->shape[1] = hq;
        tos[i]->shape[2] = dvo;
        tos[i]->stride[0] = a->o_s0;
        tos[i]->stride[1] = dvo;
        tos[i]->stride[2] = 1;
    }
    kva_tensor* tls[] = {&a->tlse, &a->tlse2};
    h_buf* lbufs[] = {&a->lse, &a->lse2};
    for (int i = 0; i < 2; ++i) {
        memset(tls[i], 0, sizeof(kva_tensor));
        tls[i]->data = h_buf_dp(lbufs[i]);
        tls[i]->dtype = KVA_DTYPE_F32;
        tls[i]->ndim = 2;
        tls[i]->shape[0] = a->total_rows;
        tls[i]->shape[1] = hq;
        tls[i]->stride[0] = a->lse_s0;
        tls[i]->stride[1] = 1;
    }
    memset(&a->tq, 0, sizeof a->tq);
    a->tq.data = h_buf_dp(&a->q);
    a->tq.dtype = c->q_dt;
    a->tq.ndim = 3;
    a->tq.shape[0] = a->total_rows;
    a->tq.shape[1] = hq;
    a->tq.shape[2] = dqk;
    a->tq.stride[0] = a->q_s0;
    a->tq.stride[1] = dqk;
    a->tq.stride[2] = 1;

    /* reference */
    ref_attn_cfg cfg;
    memset(&cfg, 0, sizeof cfg);
    cfg.num_qo_heads = hq;
    cfg.num_kv_heads = H;
    cfg.head_dim_qk = dqk;
    cfg.head_dim_vo = dvo;
    cfg.mask_mode = c->mask;
    cfg.window_left = c->window;
    cfg.soft_cap = c->cap;
    cfg.sm_scale = c->scale;
    cfg.pos_encoding = c->pos;
    cfg.rope_scale = c->rope_scale;
    cfg.rope_theta = c->rope_theta;
    cfg.score_mode = c->score;
    cfg.sigmoid_bias = c->sig_bias;
    cfg.alibi_slopes = slopes_ref;
    a->o_ref = (double*)xcalloc((size_t)(a->total_rows * hq * dvo), sizeof(double));
    a->mag_ref = (double*)xcalloc((size_t)(a->total_rows * hq * dvo), sizeof(double));
    a->lse_ref = (double*)xcalloc((size_t)(a->total_rows * hq), sizeof(double));
    for (int32_t b = 0; b < B; ++b) {
        int64_t r0 = a->qo_indptr[b];
        ref_attention(&cfg, a->qo[b], a->kv[b], a->q_ref + r0 * hq * dqk, a->k_ref + a->kv_off[b] * H * dqk,
                      a->v_ref + a->kv_off[b] * H * dvo, a->mask + a->mask_off[b], a->o_ref + r0 * hq * dvo,
                      a->lse_ref + r0 * hq, a->mag_ref + r0 * hq * dvo);
    }
    free(slopes_ref);
}

/* Compare o (and lse if wanted) with the reference; padding must still be poison, guards intact. */
static int att_check(const h_case* c, att* a, h_buf* o, h_buf* lse, int lse_wanted, const char* what) {
    int ok = 1, shown = 0;
    const int32_t hq = c->hq, dvo = c->dvo;
    h_buf_download(o);
    h_buf_download(lse);
    H_EXPECT(ok, h_buf_guards_ok(o), "%s: guard band around o overwritten", what);
    H_EXPECT(ok, h_buf_guards_ok(lse), "%s: guard band around lse overwritten", what);
    h_tol t = h_tol_out(c->o_dt, c->q_dt, c->kv_dt), tl = h_tol_lse();
    if (c->pos == KVA_POS_ROPE_LLAMA) {
        /* fp32 RoPE angles pos * inv_freq carry ~pos * 2^-24 rad of rounding: an honest f32 floor */
        double extra = 1e-7 * (double)(a->max_kv_len + 1);
        t.atol += extra;
        tl.atol += extra;
    }
    int32_t b = 0;
    for (int64_t row = 0; row < a->total_rows; ++row) {
        while (b < a->B && a->qo_indptr[b + 1] <= row) ++b;
        for (int32_t h = 0; h < hq; ++h) {
            for (int32_t d = 0; d < dvo; ++d) {
                double got = h_buf_get(o, (size_t)(row * a->o_s0 + h * dvo + d));
                size_t ri = (size_t)((row * hq + h) * dvo + d);
                if (!h_close(got, a->o_ref[ri], t, a->mag_ref[ri])) {
                    if (shown++ < 6)
                        h_note(__FILE__, __LINE__, "%s: o[row %lld (request %d, i %lld, qo %d, kv %d), head %d, d %d] = %.7g, ref %.7g (tol %.2g)",
                               what, (long long)row, b, (long long)(row - a->qo_indptr[b]), a->qo[b], a->kv[b], h, d,
                               got, a->o_ref[ri], t.atol * (a->mag_ref[ri] > 0 && a->mag_ref[ri] < 1e-4 ? 1e-4 : a->mag_ref[ri]) + t.rtol * fabs(a->o_ref[ri]));
                    ok = 0;
                }
            }
            if (lse_wanted) {
                double got = h_buf_get(lse, (size_t)(row * a->lse_s0 + h));
                double ref = a->lse_ref[row * hq + h];
                if (!h_close(got, ref, tl, 1)) {
                    if (shown++ < 6)
                        h_note(__FILE__, __LINE__, "%s: lse[row %lld (request %d, qo %d, kv %d), head %d] = %.7g, ref %.7g",
                               what, (long long)row, b, a->qo[b], a->kv[b], h, got, ref);
                    ok = 0;
                }
            }
        }
        for (int64_t e = (int64_t)hq * dvo; e < a->o_s0; ++e)
            if (!h_buf_elem_is_poison(o, (size_t)(row * a->o_s0 + e))) {
                if (shown++ < 6) h_note(__FILE__, __LINE__, "%s: o row %lld: padding element %lld written", what, (long long)row, (long long)e);
                ok = 0;
                break;
            }
        for (int64_t e = lse_wanted ? hq : 0; e < a->lse_s0; ++e)
            if (!h_buf_elem_is_poison(lse, (size_t)(row * a->lse_s0 + e))) {
                if (shown++ < 6)
                    h_note(__FILE__, __LINE__, "%s: lse row %lld: element %lld written (%s)", what, (long long)row,
                           (long long)e, lse_wanted ? "padding" : "lse was not requested");
                ok = 0;
                break;
            }
    }
    if (shown > 6) h_note(__FILE__, __LINE__, "%s: ... %d mismatches in all", what, shown);
    return ok;
}

/* Snapshot of the input bytes (host mirror, guards included) to prove the run did not write them. */
typedef struct snap {
    h_buf* b[8];
    unsigned char* copy[8];
    size_t n[8];
    int count;
} snap;

static void snap_take(snap* s, h_buf* const* bufs, int n) {
    memset(s, 0, sizeof *s);
    for (int i = 0; i < n; ++i) {
        if (!bufs[i]->host) continue;
        size_t total = 2 * H_GUARD_BYTES + (bufs[i]->bytes + 255) / 256 * 256;
        s->b[s->count] = bufs[i];
        s->n[s->count] = total;
        s->copy[s->count] = (unsigned char*)xcalloc(total, 1);
        memcpy(s->copy[s->count], bufs[i]->host, total);
        ++s->count;
    }
}

static int snap_same(snap* s, const char* what) {
    int ok = 1;
    for (int i = 0; i < s->count; ++i) {
        h_buf_download(s->b[i]);
        if (memcmp(s->copy[i], s->b[i]->host, s->n[i]) != 0) {
            h_note(__FILE__, __LINE__, "%s: input buffer %d (%zu bytes) was modified", what, i, s->b[i]->bytes);
            ok = 0;
        }
        free(s->copy[i]);
    }
    s->count = 0;
    return ok;
}

static kva_op op_kva(h_op op) {
    return op == H_OP_DECODE ? KVA_OP_BATCH_DECODE : op == H_OP_PREFILL ? KVA_OP_BATCH_PREFILL_PAGED : KVA_OP_BATCH_PREFILL_RAGGED;
}

static void desc_of(const h_case* c, kva_attention_desc* d) {
    kva_attention_desc_init(d, c->hq, c->hkv, c->dqk, c->q_dt);
    d->head_dim_vo = c->dvo;
    d->kv_dtype = c->kv_dt;
    d->o_dtype = c->o_dt;
    d->mask_mode = c->mask;
    d->window_left = c->window;
    d->logits_soft_cap = c->cap;
    d->sm_scale = c->scale;
    d->pos_encoding = c->pos;
    d->rope_scale = c->rope_scale;
    d->rope_theta = c->rope_theta;
    d->score_mode = c->score;
    d->sigmoid_bias = c->sig_bias;
}

static void args_of(const h_case* c, att* a, kva_run_args* args, int second) {
    kva_run_args_init(args);
    {
        /* KVA_TEST_PDL=1: every run with programmatic dependent launch (kva_run_args.enable_pdl) */
        const char* pdl = getenv("KVA_TEST_PDL");
        args->enable_pdl = pdl && pdl[0] == '1';
    }
    args->q = a->tq;
    args->o = second ? a->to2 : a->to;
    if (c->lse) args->lse = second ? a->tlse2 : a->tlse;
    if (op_is_paged(c->op)) args->paged = a->paged;
    else {
        args->k = a->tk;
        args->v = a->tv;
    }
    if (c->mask == KVA_MASK_CUSTOM) {
        args->custom_mask = (const uint8_t*)h_buf_dp(&a->mask_d);
        args->custom_mask_bytes = a->mask_bytes;
    }
    if (a->slopes) args->alibi_slopes = (const float*)h_buf_dp(&a->slopes_d);
    args->k_scale = c->k_scale;
    args->v_scale = c->v_scale;
}

static kva_status do_plan(const h_case* c, kva_context* ctx, const kva_attention_desc* d, const kva_plan_params* pp,
                          const kva_workspace* ws, kva_plan* plan) {
    if (!c->api) return kva_plan_make(ctx, d, op_kva(c->op), pp, ws, plan, NULL);
    switch (c->op) {
    case H_OP_DECODE: return kva_batch_decode_plan(ctx, d, pp, ws, plan, NULL);
    case H_OP_PREFILL: return kva_batch_prefill_paged_plan(ctx, d, pp, ws, plan, NULL);
    default: return kva_batch_prefill_ragged_plan(ctx, d, pp, ws, plan, NULL);
    }
}

static kva_status do_run(const h_case* c, kva_context* ctx, const kva_plan* plan, const kva_workspace* ws,
                         const kva_run_args* args) {
    if (!c->api) return kva_run(ctx, plan, ws, args);
    switch (c->op) {
    case H_OP_DECODE: return kva_batch_decode_run(ctx, plan, ws, args);
    case H_OP_PREFILL: return kva_batch_prefill_paged_run(ctx, plan, ws, args);
    default: return kva_batch_prefill_ragged_run(ctx, plan, ws, args);
    }
}

static void params_of(const h_case* c, att* a, kva_plan_params* pp) {
    kva_plan_params_init(pp);
    pp->batch_size = a->B;
    pp->qo_indptr = c->op == H_OP_DECODE ? NULL : a->qo_indptr;
    pp->kv_indptr = a->kv_indptr;
    if (op_is_paged(c->op)) {
        pp->kv_last_page_len = a->last;
        pp->page_size = c->page_size;
        pp->num_pages = a->num_pages;
        pp->kv_indices = c->hidx ? a->indices : NULL;
        if (c->bt) { /* the block-table form: the CSR arrays are not read */
            pp->kv_indptr = NULL;
            pp->kv_last_page_len = NULL;
            pp->kv_seq_lens = a->kv;
            pp->block_table_stride = a->bt_stride;
            pp->kv_indices = c->hidx ? a->bt : NULL;
        }
    }
    pp->fixed_split_size = c->fixed_split;
    pp->disable_split_kv = c->no_split;
    pp->graph_mode = c->graph;
    if (c->graph) {
        pp->max_batch_size = c->batch;
        pp->max_total_qo_rows = c->op == H_OP_DECODE ? c->batch : (int64_t)c->batch * (c->max_qo > 0 ? c->max_qo : 1);
    }
}

#define ST_NAME(s) kva_status_string(s)

enum { CASE_PASS = 0, CASE_FAIL = 1, CASE_SKIP = 2 };

/* Batch ops: plan (exact workspace, one byte less fails), run twice (byte-identical), graph re-plan. */
static int run_batch_case(const h_case* c) {
    kva_context* ctx = h_context(c->threads);
    kva_attention_desc d;
    desc_of(c, &d);
    int ok = 1;
    kva_status st = kva_attention_desc_check(ctx, &d);
    if (st == KVA_ERR_UNSUPPORTED && h_opt.backend != KVA_BACKEND_CPU) return CASE_SKIP;
    if (st != KVA_OK) {
        h_note(__FILE__, __LINE__, "kva_attention_desc_check: %s: %s", ST_NAME(st), kva_last_error_message());
        return CASE_FAIL;
    }
    h_ws ws;
    memset(&ws, 0, sizeof ws);
    kva_plan plan;
    kva_plan_info info0;
    memset(&info0, 0, sizeof info0);
    size_t alloc_dev = 0, alloc_host = 0, alloc_scr = 0;
    h_buf scr;
    memset(&scr, 0, sizeof scr);
    int iters = c->graph ? 3 : 1;
    unsigned char *first_o = NULL, *first_lse = NULL;
    for (int it = 0; it < iters && ok; ++it) {
        char what[64];
        snprintf(what, sizeof what, "%s plan %d", h_op_name(c->op), it);
        /* graph mode: plan 1 has other lengths (and fewer requests); plan 2 repeats plan 0's inputs and must
           reproduce its bytes after the re-plans into the same workspace */
        h_rng r;
        h_rng_seed(&r, c->seed + 0x9e3779b97f4a7c15ull * (uint64_t)(it == 1));
        int32_t B = c->batch;
        if (it == 1) B = (int32_t)h_rng_range(&r, c->batch > 1 ? 1 : c->batch, c->batch); /* fewer requests */
        att a;
        att_build(c, &r, B, &a);
        kva_plan_params pp;
        params_of(c, &a, &pp);
        size_t dev_b = 0, host_b = 0;
        st = kva_plan_workspace_size(ctx, &d, op_kva(c->op), &pp, &dev_b, &host_b);
        if (st == KVA_ERR_UNSUPPORTED && h_opt.backend != KVA_BACKEND_CPU) { /* e.g. a decode-only restriction */
            att_free(&a);
            if (ws.dev.host) h_ws_free(&ws);
            free(first_o);
            free(first_lse);
            return CASE_SKIP;
        }
        if (st != KVA_OK) {
            h_note(__FILE__, __LINE__, "%s: kva_plan_workspace_size: %s: %s", what, ST_NAME(st), kva_last_error_message());
            att_free(&a);
            ok = 0;
            break;
        }
        /* scratch = 1: the partials in their own region; the plan's part of the device workspace and the scratch
           part add up to the one-region size */
        size_t plan_b = dev_b, scr_b = 0;
        if (c->scratch) {
            size_t hb2 = 0;
            st = kva_plan_workspace_parts(ctx, &d, op_kva(c->op), &pp, &plan_b, &scr_b, &hb2);
            H_EXPECT(ok, st == KVA_OK && plan_b + scr_b == dev_b && hb2 == host_b,
                     "%s: kva_plan_workspace_parts %s: %zu + %zu bytes, host %zu (one region: %zu, host %zu)", what,
                     ST_NAME(st), plan_b, scr_b, hb2, dev_b, host_b);
        }
        if (it == 0) {
            alloc_dev = plan_b;
            alloc_host = host_b;
            alloc_scr = scr_b;
            if (c->graph) {
                size_t bd = 0, bh = 0, bp = 0, bs = 0, bh2 = 0;
                st = kva_workspace_bound(ctx, &d, op_kva(c->op), pp.max_batch_size, pp.max_total_qo_rows, &bd, &bh);
                H_EXPECT(ok, st == KVA_OK, "kva_workspace_bound: %s: %s", ST_NAME(st), kva_last_error_message());
                H_EXPECT(ok, bd >= dev_b && bh >= host_b, "graph mode: bound %zu/%zu < plan size %zu/%zu", bd, bh, dev_b, host_b);
                if (c->scratch) {
                    st = kva_workspace_bound_parts(ctx, &d, op_kva(c->op), pp.max_batch_size, pp.max_total_qo_rows,
                                                   &bp, &bs, &bh2);
                    H_EXPECT(ok, st == KVA_OK && bp + bs == bd && bh2 == bh && bp >= plan_b && bs >= scr_b,
                             "kva_workspace_bound_parts %s: %zu + %zu host %zu (bound %zu host %zu; plan %zu + %zu)",
                             ST_NAME(st), bp, bs, bh2, bd, bh, plan_b, scr_b);
                    bd = bp;
                    if (bs > alloc_scr) alloc_scr = bs;
                }
                if (bd > alloc_dev) alloc_dev = bd;
                if (bh > alloc_host) alloc_host = bh;
            }
            h_ws_alloc(&ws, alloc_dev, alloc_host);
            if (c->scratch) {
                scr = h_buf_alloc(KVA_DTYPE_U8, alloc_scr);
                memset(h_buf_hp(&scr), 0xff, alloc_scr); /* NaN floats: a partial read before it is written shows */
                h_buf_upload(&scr);
                ws.ws.scratch = h_buf_dp(&scr);
                ws.ws.scratch_bytes = alloc_scr;
                if (scr_b > 0) {
                    ws.ws.scratch_bytes = scr_b - 1;
                    st = do_plan(c, ctx, &d, &pp, &ws.ws, &plan);
                    H_EXPECT(ok, st == KVA_ERR_WORKSPACE_TOO_SMALL,
                             "plan with scratch %zu - 1 bytes: %s (expected KVA_ERR_WORKSPACE_TOO_SMALL)", scr_b, ST_NAME(st));
                    ws.ws.scratch_bytes = alloc_scr;
                    ws.ws.scratch = (char*)h_buf_dp(&scr) + 16;
                    st = do_plan(c, ctx, &d, &pp, &ws.ws, &plan);
                    H_EXPECT(ok, st == KVA_ERR_ALIGNMENT, "plan with scratch misaligned by 16 bytes: %s (expected "
                             "KVA_ERR_ALIGNMENT)", ST_NAME(st));
                    if (plan_b > 0) { /* scratch over the plan's own bytes */
                        ws.ws.scratch = ws.ws.device;
                        ws.ws.scratch_bytes = alloc_dev;
                        st = do_plan(c, ctx, &d, &pp, &ws.ws, &plan);
                        H_EXPECT(ok, alloc_dev < scr_b || st == KVA_ERR_INVALID_ARGUMENT,
                                 "plan with scratch = device: %s (expected KVA_ERR_INVALID_ARGUMENT)", ST_NAME(st));
                    }
                    ws.ws.scratch = h_buf_dp(&scr);
                    ws.ws.scratch_bytes = alloc_scr;
                }
            }
            /* exactly the size works, one byte less is refused by plan */
            ws.ws.device_bytes = plan_b - 1;
            st = do_plan(c, ctx, &d, &pp, &ws.ws, &plan);
            H_EXPECT(ok, plan_b == 0 || st == KVA_ERR_WORKSPACE_TOO_SMALL,
                     "plan with device workspace %zu - 1 bytes: %s (expected KVA_ERR_WORKSPACE_TOO_SMALL)", plan_b, ST_NAME(st));
            H_EXPECT(ok, st == KVA_OK || *kva_last_error_message(), "plan failed without a message");
            ws.ws.device_bytes = plan_b;
            if (host_b) {
                ws.ws.host_bytes = host_b - 1;
                st = do_plan(c, ctx, &d, &pp, &ws.ws, &plan);
                H_EXPECT(ok, st == KVA_ERR_WORKSPACE_TOO_SMALL,
                         "plan with host workspace %zu - 1 bytes: %s (expected KVA_ERR_WORKSPACE_TOO_SMALL)", host_b, ST_NAME(st));
                ws.ws.host_bytes = host_b;
            }
        } else {
            H_EXPECT(ok, plan_b <= alloc_dev && host_b <= alloc_host && scr_b <= alloc_scr,
                     "%s: graph re-plan needs %zu/%zu/%zu bytes, more than the first %zu/%zu/%zu", what, plan_b, host_b,
                     scr_b, alloc_dev, alloc_host, alloc_scr);
            ws.ws.device_bytes = alloc_dev;
            ws.ws.host_bytes = alloc_host;
        }
        st = do_plan(c, ctx, &d, &pp, &ws.ws, &plan);
        if (st != KVA_OK) {
            h_note(__FILE__, __LINE__, "%s: plan: %s: %s", what, ST_NAME(st), kva_last_error_message());
            att_free(&a);
            ok = 0;
            break;
        }
        kva_plan_info info;
        st = kva_plan_get_info(&plan, &info);
        H_EXPECT(ok, st == KVA_OK, "kva_plan_get_info: %s", ST_NAME(st));
        H_EXPECT(ok, info.batch_size == B && info.total_qo_rows == a.total_rows, "%s: plan info batch %d rows %lld, expected %d %lld",
                 what, info.batch_size, (long long)info.total_qo_rows, B, (long long)a.total_rows);
        H_EXPECT(ok, info.device_bytes <= ws.ws.device_bytes, "%s: plan uses %zu device bytes of %zu", what, info.device_bytes,
                 ws.ws.device_bytes);
        H_EXPECT(ok, info.device_bytes == plan_b && info.scratch_bytes == scr_b,
                 "%s: plan info device %zu scratch %zu bytes, the size query said %zu and %zu", what, info.device_bytes,
                 info.scratch_bytes, plan_b, scr_b);
        if (c->no_split) H_EXPECT(ok, info.num_partials == 0 && info.num_merge_tasks == 0, "%s: disable_split_kv but %d partials",
                                  what, info.num_partials);
        if (it == 0) info0 = info;
        else {
            H_EXPECT(ok, info.num_workers == info0.num_workers && info.device_bytes == info0.device_bytes &&
                             info.host_bytes == info0.host_bytes && info.tile_q == info0.tile_q && info.graph_mode,
                     "%s: graph-mode plan facts changed: workers %d/%d bytes %zu/%zu host %zu/%zu tile_q %d/%d", what,
                     info.num_workers, info0.num_workers, info.device_bytes, info0.device_bytes, info.host_bytes,
                     info0.host_bytes, info.tile_q, info0.tile_q);
        }
        /* scratch: a second plan (other inputs, its own device region, the same scratch) is made now, so the two
           plans stand side by side; it runs after this one and must be right too. A run given another scratch (or
           none) is refused and writes nothing. */
        att a2;
        memset(&a2, 0, sizeof a2);
        h_ws ws2;
        memset(&ws2, 0, sizeof ws2);
        kva_plan plan2;
        int have2 = 0;
        if (c->scratch && ok) {
            h_rng r2;
            h_rng_seed(&r2, c->seed ^ 0x5bd1e995u ^ (uint64_t)it);
            att_build(c, &r2, B, &a2);
            kva_plan_params pp2;
            params_of(c, &a2, &pp2);
            size_t p2 = 0, s2 = 0, h2 = 0;
            st = kva_plan_workspace_parts(ctx, &d, op_kva(c->op), &pp2, &p2, &s2, &h2);
            if (st == KVA_OK && s2 <= ws.ws.scratch_bytes) {
                h_ws_alloc(&ws2, p2 > 0 ? p2 : 1, h2);
                ws2.ws.scratch = ws.ws.scratch;
                ws2.ws.scratch_bytes = ws.ws.scratch_bytes;
                st = do_plan(c, ctx, &d, &pp2, &ws2.ws, &plan2);
                H_EXPECT(ok, st == KVA_OK, "%s: second plan sharing the scratch: %s: %s", what, ST_NAME(st),
                         kva_last_error_message());
                have2 = st == KVA_OK;
            }
        }
        h_buf* ins[] = {&a.q, &a.kp, &a.vp, &a.k, &a.v, &a.idx_d, &a.mask_d, &a.slopes_d};
        snap sn;
        snap_take(&sn, ins, 8);
        kva_run_args args;
        args_of(c, &a, &args, 0);
        if (c->scratch && ok) {
            kva_workspace wrong = ws.ws;
            wrong.scratch = NULL;
            st = do_run(c, ctx, &plan, &wrong, &args);
            H_EXPECT(ok, st == KVA_ERR_PLAN_MISMATCH, "%s: run without the plan's scratch region: %s (expected "
                     "KVA_ERR_PLAN_MISMATCH)", what, ST_NAME(st));
            if (have2) {
                wrong.scratch = ws2.ws.device;
                st = do_run(c, ctx, &plan, &wrong, &args);
                H_EXPECT(ok, st == KVA_ERR_PLAN_MISMATCH, "%s: run with another scratch region: %s", what, ST_NAME(st));
            }
        }
        st = do_run(c, ctx, &plan, &ws.ws, &args);
        if (st != KVA_OK) {
            h_note(__FILE__, __LINE__, "%s: run: %s: %s", what, ST_NAME(st), kva_last_error_message());
            ok = 0;
        } else {
            ok &= att_check(c, &a, &a.o, &a.lse, c->lse, what);
            /* a second run of the same plan gives the same bytes */
            args_of(c, &a, &args, 1);
            st = do_run(c, ctx, &plan, &ws.ws, &args);
            H_EXPECT(ok, st == KVA_OK, "%s: second run: %s: %s", what, ST_NAME(st), kva_last_error_message());
            h_buf_download(&a.o2);
            h_buf_download(&a.lse2);
            H_EXPECT(ok, memcmp(a.o.host, a.o2.host, a.o.bytes + 2 * H_GUARD_BYTES) == 0, "%s: second run of the plan: o differs", what);
            H_EXPECT(ok, memcmp(a.lse.host, a.lse2.host, a.lse.bytes + 2 * H_GUARD_BYTES) == 0, "%s: second run: lse differs", what);
        }
        if (c->graph && ok) {
            if (it == 0) {
                first_o = (unsigned char*)xcalloc(a.o.bytes + 1, 1);
                first_lse = (unsigned char*)xcalloc(a.lse.bytes + 1, 1);
                memcpy(first_o, h_buf_hp(&a.o), a.o.bytes);
                memcpy(first_lse, h_buf_hp(&a.lse), a.lse.bytes);
            } else if (it == 2) {
                H_EXPECT(ok, memcmp(first_o, h_buf_hp(&a.o), a.o.bytes) == 0 && memcmp(first_lse, h_buf_hp(&a.lse), a.lse.bytes) == 0,
                         "%s: the same lengths re-planned into the same workspace after another plan give other bytes", what);
            }
        }
        if (have2) {
            kva_run_args args2;
            args_of(c, &a2, &args2, 0);
            char w2[128];
            snprintf(w2, sizeof w2, "%s (second plan, shared scratch)", what);
            st = do_run(c, ctx, &plan2, &ws2.ws, &args2);
            H_EXPECT(ok, st == KVA_OK, "%s: run: %s: %s", w2, ST_NAME(st), kva_last_error_message());
            if (st == KVA_OK) ok &= att_check(c, &a2, &a2.o, &a2.lse, c->lse, w2);
            h_buf_download(&ws2.dev);
            H_EXPECT(ok, h_buf_guards_ok(&ws2.dev), "%s: workspace guard band overwritten", w2);
        }
        if (ws2.dev.host) h_ws_free(&ws2);
        if (c->scratch) att_free(&a2);
        ok &= snap_same(&sn, what);
        h_buf_download(&ws.dev);
        H_EXPECT(ok, h_buf_guards_ok(&ws.dev), "%s: workspace guard band overwritten", what);
        if (scr.host) {
            h_buf_download(&scr);
            H_EXPECT(ok, h_buf_guards_ok(&scr), "%s: scratch guard band overwritten", what);
        }
        att_free(&a);
    }
    if (ws.dev.host) h_ws_free(&ws);
    if (scr.host) h_buf_free(&scr);
    free(first_o);
    free(first_lse);
    return ok ? CASE_PASS : CASE_FAIL;
}

/* Single decode / prefill on contiguous K/V. no_split = 1: no workspace (NULL; CPU only). Otherwise the exact size
 * from kva_single_workspace_size; one byte less is refused with KVA_ERR_WORKSPACE_TOO_SMALL and writes nothing. */
static int run_single_case(const h_case* c) {
    kva_context* ctx = h_context(c->threads);
    kva_attention_desc d;
    desc_of(c, &d);
    int ok = 1;
    kva_status st = kva_attention_desc_check(ctx, &d);
    if (st == KVA_ERR_UNSUPPORTED && h_opt.backend != KVA_BACKEND_CPU) return CASE_SKIP;
    if (st != KVA_OK) {
        h_note(__FILE__, __LINE__, "kva_attention_desc_check: %s: %s", ST_NAME(st), kva_last_error_message());
        return CASE_FAIL;
    }
    h_rng r;
    h_rng_seed(&r, c->seed);
    att a;
    att_build(c, &r, 1, &a);
    size_t dev_b = 0, host_b = 0;
    st = kva_single_workspace_size(ctx, &d, a.qo[0], a.kv[0], &dev_b, &host_b);
    if (st == KVA_ERR_UNSUPPORTED && h_opt.backend != KVA_BACKEND_CPU) {
        att_free(&a);
        return CASE_SKIP;
    }
    H_EXPECT(ok, st == KVA_OK, "kva_single_workspace_size: %s: %s", ST_NAME(st), kva_last_error_message());
    h_ws ws;
    memset(&ws, 0, sizeof ws);
    h_ws_alloc(&ws, dev_b, host_b);
    h_buf* ins[] = {&a.q, &a.k, &a.v, &a.mask_d, &a.slopes_d};
    snap sn;
    snap_take(&sn, ins, 5);
    for (int pass = 0; pass < 2 && ok; ++pass) {
        const char* what = pass == 0 ? "single (workspace exact or NULL)" : "single (workspace one byte short)";
        const kva_workspace* wsp = c->no_split && h_opt.backend == KVA_BACKEND_CPU ? NULL : &ws.ws;
        if (pass == 1) {
            if (c->no_split || dev_b == 0) break;
            ws.ws.device_bytes = dev_b - 1;
        }
        h_buf* o = pass ? &a.o2 : &a.o;
        h_buf* lse = pass ? &a.lse2 : &a.lse;
        kva_run_args args;
        args_of(c, &a, &args, pass);
        /* decode: q/o may be [1, heads, dim] or [heads, dim], lse [1, heads] or [heads] (api = 1: the short form) */
        if (c->op == H_OP_SINGLE_DECODE && c->api && c->qpad == 0 && c->opad == 0) {
            args.q = kva_tensor_make(args.q.data, c->q_dt, 2, c->hq, c->dqk, 0, 0);
            args.o = kva_tensor_make(args.o.data, c->o_dt, 2, c->hq, c->dvo, 0, 0);
            if (args.lse.data) args.lse = kva_tensor_make(args.lse.data, KVA_DTYPE_F32, 1, c->hq, 0, 0, 0);
        }
        st = c->op == H_OP_SINGLE_DECODE ? kva_single_decode(ctx, &d, &args, wsp) : kva_single_prefill(ctx, &d, &args, wsp);
        if (pass == 1) {
            /* contract: a workspace smaller than kva_single_workspace_size is refused, nothing written */
            H_EXPECT(ok, st == KVA_ERR_WORKSPACE_TOO_SMALL && *kva_last_error_message(),
                     "%s: %s (expected KVA_ERR_WORKSPACE_TOO_SMALL)", what, ST_NAME(st));
            h_buf_download(o);
            h_buf_download(lse);
            for (size_t i = 0; i < o->elems && ok; ++i)
                H_EXPECT(ok, h_buf_elem_is_poison(o, i), "%s: refused call wrote o element %zu", what, i);
            for (size_t i = 0; i < lse->elems && ok; ++i)
                H_EXPECT(ok, h_buf_elem_is_poison(lse, i), "%s: refused call wrote lse element %zu", what, i);
            break;
        }
        if (st != KVA_OK) {
            h_note(__FILE__, __LINE__, "%s: %s: %s", what, ST_NAME(st), kva_last_error_message());
            ok = 0;
            break;
        }
        ok &= att_check(c, &a, o, lse, c->lse, what);
        h_buf_download(&ws.dev);
        H_EXPECT(ok, h_buf_guards_ok(&ws.dev), "%s: workspace guard band overwritten", what);
    }
    ok &= snap_same(&sn, "single");
    h_ws_free(&ws);
    att_free(&a);
    return ok ? CASE_PASS : CASE_FAIL;
}

/* ============================================================================================== */
/* Merge cases: states (v [rows, heads, dim] in o_dt, s [rows, heads] f32 base 2)                  */

typedef struct st_buf {
    h_buf v, s;
    kva_tensor tv, ts;
    int64_t rows, v_s0;
} st_buf;

static void st_alloc(st_buf* x, const h_case* c, int64_t rows) {
    x->rows = rows;
    x->v_s0 = (int64_t)c->hq * c->dvo + c->opad;
    x->v = h_buf_alloc(c->o_dt, (size_t)(rows * x->v_s0));
    x->s = h_buf_alloc(KVA_DTYPE_F32, (size_t)(rows * c->hq));
    h_buf_poison(&x->v);
    h_buf_poison(&x->s);
    memset(&x->tv, 0, sizeof x->tv);
    x->tv.data = h_buf_dp(&x->v);
    x->tv.dtype = c->o_dt;
    x->tv.ndim = 3;
    x->tv.shape[0] = rows;
    x->tv.shape[1] = c->hq;
    x->tv.shape[2] = c->dvo;
    x->tv.stride[0] = x->v_s0;
    x->tv.stride[1] = c->dvo;
    x->tv.stride[2] = 1;
    x->ts = kva_tensor_make(h_buf_dp(&x->s), KVA_DTYPE_F32, 2, rows, c->hq, 0, 0);
}

/* Random states; ~empty_pct% (or 15%) of (row, head) are empty (s = -inf, v random: it must be ignored). */
static void st_fill(st_buf* x, const h_case* c, h_rng* r) {
    int pct = c->empty_pct ? c->empty_pct : 15;
    for (int64_t i = 0; i < x->rows; ++i)
        for (int32_t h = 0; h < c->hq; ++h) {
            for (int32_t d = 0; d < c->dvo; ++d) put_rand(&x->v, (size_t)(i * x->v_s0 + h * c->dvo + d), r);
            double s = h_rng_range(r, 0, 99) < pct ? -INFINITY : -6.0 + 30.0 * h_rng_uniform(r);
            h_buf_set(&x->s, (size_t)(i * c->hq + h), s);
        }
    h_buf_upload(&x->v);
    h_buf_upload(&x->s);
}

static void st_free(st_buf* x) {
    if (x->v.host) h_buf_free(&x->v);
    if (x->s.host) h_buf_free(&x->s);
}

/* Check merged state x (rows, from host mirror) against refs; rows with keep[i] must equal the snapshot. */
static int st_check(const h_case* c, st_buf* x, const double* v_ref, const double* s_ref, int check_s, const char* what) {
    int ok = 1, shown = 0;
    h_buf_download(&x->v);
    h_buf_download(&x->s);
    H_EXPECT(ok, h_buf_guards_ok(&x->v) && h_buf_guards_ok(&x->s), "%s: guard band overwritten", what);
    h_tol t = h_tol_out(c->o_dt, c->o_dt, c->o_dt), tl = h_tol_lse();
    for (int64_t i = 0; i < x->rows; ++i)
        for (int32_t h = 0; h < c->hq; ++h) {
            for (int32_t d = 0; d < c->dvo; ++d) {
                double got = h_buf_get(&x->v, (size_t)(i * x->v_s0 + h * c->dvo + d));
                double ref = v_ref[(i * c->hq + h) * c->dvo + d];
                if (!h_close(got, ref, t, 1)) {
                    if (shown++ < 6) h_note(__FILE__, __LINE__, "%s: v[%lld, %d, %d] = %.7g, ref %.7g", what, (long long)i, h, d, got, ref);
                    ok = 0;
                }
            }
            if (check_s) {
                double got = h_buf_get(&x->s, (size_t)(i * c->hq + h)), ref = s_ref[i * c->hq + h];
                if (!h_close(got, ref, tl, 1)) {
                    if (shown++ < 6) h_note(__FILE__, __LINE__, "%s: s[%lld, %d] = %.7g, ref %.7g", what, (long long)i, h, got, ref);
                    ok = 0;
                }
            }
        }
    return ok;
}

static int run_merge_case(const h_case* c) {
    kva_context* ctx = h_context(c->threads);
    h_rng r;
    h_rng_seed(&r, c->seed);
    int ok = 1;
    const int64_t rows = c->batch;
    const int32_t hq = c->hq, dim = c->dvo;
    double* v_ref = (double*)xcalloc((size_t)(rows * hq * dim), sizeof(double));
    double* s_ref = (double*)xcalloc((size_t)(rows * hq), sizeof(double));
    double* vv = (double*)xcalloc((size_t)(2 * dim) + (size_t)(c->max_qo + 2) * (size_t)dim, sizeof(double));
    double ss[64];
    kva_status st;
    if (c->op == H_OP_MERGE || c->op == H_OP_MERGE_IN_PLACE) {
        st_buf A, Bs, O;
        memset(&O, 0, sizeof O);
        st_alloc(&A, c, rows);
        st_alloc(&Bs, c, rows);
        st_fill(&A, c, &r);
        st_fill(&Bs, c, &r);
        /* both-empty rows: force some (row, head) pairs empty in both */
        for (int64_t i = 0; i < rows; i += 5) {
            h_buf_set(&A.s, (size_t)(i * hq), -INFINITY);
            h_buf_set(&Bs.s, (size_t)(i * hq), -INFINITY);
        }
        h_buf_upload(&A.s);
        h_buf_upload(&Bs.s);
        uint8_t* mask = (uint8_t*)xcalloc((size_t)rows, 1);
        h_buf mask_d = h_buf_alloc(KVA_DTYPE_U8, (size_t)rows);
        for (int64_t i = 0; i < rows; ++i) {
            int64_t m = h_rng_range(&r, 0, 2);
            mask[i] = (uint8_t)(m == 0 ? 0 : m == 1 ? 1 : 0x80);
        }
        memcpy(h_buf_hp(&mask_d), mask, (size_t)rows);
        h_buf_upload(&mask_d);
        int use_mask = c->op == H_OP_MERGE_IN_PLACE && c->mask == KVA_MASK_CUSTOM;
        /* reference (from the decoded inputs) */
        for (int64_t i = 0; i < rows; ++i)
            for (int32_t h = 0; h < hq; ++h) {
                ss[0] = h_buf_get(&A.s, (size_t)(i * hq + h));
                ss[1] = h_buf_get(&Bs.s, (size_t)(i * hq + h));
                for (int32_t d = 0; d < dim; ++d) {
                    vv[d] = h_buf_get(&A.v, (size_t)(i * A.v_s0 + h * dim + d));
                    vv[dim + d] = h_buf_get(&Bs.v, (size_t)(i * Bs.v_s0 + h * dim + d));
                }
                double* vo = v_ref + (i * hq + h) * dim;
                if (use_mask && !mask[i]) {
                    memcpy(vo, vv, sizeof(double) * (size_t)dim);
                    s_ref[i * hq + h] = ss[0];
                } else {
                    ref_merge(2, ss, vv, dim, vo, &s_ref[i * hq + h]);
                }
            }
        /* a copy of A's bytes: rows outside the mask must stay byte-identical */
        size_t a_tot = 2 * H_GUARD_BYTES + (A.v.bytes + 255) / 256 * 256;
        unsigned char* a_copy = (unsigned char*)xcalloc(a_tot, 1);
        memcpy(a_copy, A.v.host, a_tot);
        h_buf* ins[] = {&Bs.v, &Bs.s, &mask_d};
        snap sn;
        snap_take(&sn, ins, c->op == H_OP_MERGE && c->alias == 2 ? 0 : 3);
        if (c->op == H_OP_MERGE) {
            h_buf* ins2[] = {&A.v, &A.s};
            const kva_tensor *vo, *so;
            st_buf* res;
            if (c->alias == 1) res = &A;
            else if (c->alias == 2) res = &Bs;
            else {
                st_alloc(&O, c, rows);
                h_buf_upload(&O.v);
                h_buf_upload(&O.s);
                res = &O;
            }
            snap sa;
            snap_take(&sa, ins2, c->alias == 0 ? 2 : 0);
            vo = &res->tv;
            so = c->lse ? &res->ts : NULL;
            st = kva_merge_state(ctx, &A.tv, &A.ts, &Bs.tv, &Bs.ts, vo, so, NULL);
            H_EXPECT(ok, st == KVA_OK, "kva_merge_state: %s: %s", ST_NAME(st), kva_last_error_message());
            if (st == KVA_OK) ok &= st_check(c, res, v_ref, s_ref, c->lse, "merge_state");
            if (!c->lse && c->alias == 0) {
                h_buf_download(&O.s);
                for (size_t i = 0; i < O.s.elems; ++i)
                    if (!h_buf_elem_is_poison(&O.s, i)) {
                        H_EXPECT(ok, 0, "merge_state: s_out not requested but a poisoned s buffer was written");
                        break;
                    }
            }
            ok &= snap_same(&sa, "merge_state inputs");
        } else {
            st = kva_merge_state_in_place(ctx, &A.tv, &A.ts, &Bs.tv, &Bs.ts,
                                          use_mask ? (const uint8_t*)h_buf_dp(&mask_d) : NULL, NULL);
            H_EXPECT(ok, st == KVA_OK, "kva_merge_state_in_place: %s: %s", ST_NAME(st), kva_last_error_message());
            if (st == KVA_OK) {
                ok &= st_check(c, &A, v_ref, s_ref, 1, "merge_state_in_place");
                if (use_mask) /* unmasked rows: bytes untouched (including row padding) */
                    for (int64_t i = 0; i < rows; ++i)
                        if (!mask[i] &&
                            memcmp(a_copy + H_GUARD_BYTES + (size_t)(i * A.v_s0) * ref_dtype_size(c->o_dt),
                                   (unsigned char*)h_buf_hp(&A.v) + (size_t)(i * A.v_s0) * ref_dtype_size(c->o_dt),
                                   (size_t)A.v_s0 * ref_dtype_size(c->o_dt)) != 0) {
                            H_EXPECT(ok, 0, "merge_state_in_place: row %lld has mask 0 but changed", (long long)i);
                            break;
                        }
            }
        }
        ok &= snap_same(&sn, "merge inputs");
        free(a_copy);
        free(mask);
        h_buf_free(&mask_d);
        st_free(&A);
        st_free(&Bs);
        st_free(&O);
    } else {
        /* merge_states: row i merges states indptr[i] .. indptr[i+1] (counts 0 .. max_qo) */
        int32_t* indptr = (int32_t*)xcalloc((size_t)rows + 1, sizeof(int32_t));
        for (int64_t i = 0; i < rows; ++i) {
            int64_t n = h_rng_range(&r, 0, c->max_qo > 60 ? 60 : c->max_qo);
            indptr[i + 1] = indptr[i] + (int32_t)n;
        }
        int64_t total = indptr[rows];
        st_buf S, O;
        st_alloc(&S, c, total);
        st_fill(&S, c, &r);
        st_alloc(&O, c, rows);
        h_buf_upload(&O.v);
        h_buf_upload(&O.s);
        for (int64_t i = 0; i < rows; ++i)
            for (int32_t h = 0; h < hq; ++h) {
                int64_t n = indptr[i + 1] - indptr[i];
                double* buf = (double*)xcalloc((size_t)((n + 1) * dim), sizeof(double));
                double* sl = (double*)xcalloc((size_t)(n + 1), sizeof(double));
                for (int64_t k = 0; k < n; ++k) {
                    int64_t srow = indptr[i] + k;
                    sl[k] = h_buf_get(&S.s, (size_t)(srow * hq + h));
                    for (int32_t d = 0; d < dim; ++d) buf[k * dim + d] = h_buf_get(&S.v, (size_t)(srow * S.v_s0 + h * dim + d));
                }
                ref_merge(n, sl, buf, dim, v_ref + (i * hq + h) * dim, &s_ref[i * hq + h]);
                free(buf);
                free(sl);
            }
        h_buf* ins[] = {&S.v, &S.s};
        snap sn;
        snap_take(&sn, ins, 2);
        st = kva_merge_states(ctx, &S.tv, &S.ts, indptr, rows, &O.tv, c->lse ? &O.ts : NULL, NULL);
        H_EXPECT(ok, st == KVA_OK, "kva_merge_states: %s: %s", ST_NAME(st), kva_last_error_message());
        if (st == KVA_OK) ok &= st_check(c, &O, v_ref, s_ref, c->lse, "merge_states");
        ok &= snap_same(&sn, "merge_states inputs");
        st_free(&S);
        st_free(&O);
        free(indptr);
    }
    free(v_ref);
    free(s_ref);
    free(vv);
    return ok ? CASE_PASS : CASE_FAIL;
}

/* ============================================================================================== */
/* append_paged_kv_cache: exact byte match of the whole pool against the expected scatter.           */

static int run_append_case(const h_case* c) {
    kva_context* ctx = h_context(c->threads);
    h_rng r;
    h_rng_seed(&r, c->seed);
    int ok = 1;
    const int32_t B = c->batch, H = c->hkv, dqk = c->dqk, dvo = c->dvo, ps = c->page_size;
    const kva_dtype t = c->kv_dt;
    const size_t es = ref_dtype_size(t);
    h_case pc = *c;
    pc.op = H_OP_PREFILL; /* page-table helpers */
    int32_t* kv = (int32_t*)xcalloc((size_t)B, sizeof(int32_t));
    int32_t* nnew = (int32_t*)xcalloc((size_t)B, sizeof(int32_t));
    int32_t* indptr = (int32_t*)xcalloc((size_t)B + 1, sizeof(int32_t));
    int32_t* last = (int32_t*)xcalloc((size_t)B + 1, sizeof(int32_t));
    int64_t nnz = 0;
    for (int32_t b = 0; b < B; ++b) {
        kv[b] = h_rng_range(&r, 0, 99) < c->empty_pct ? 0 : (int32_t)h_rng_range(&r, 1, c->max_kv > 0 ? c->max_kv : 1);
        int32_t hi = kv[b] < c->max_qo ? kv[b] : c->max_qo;
        nnew[b] = (int32_t)h_rng_range(&r, 0, hi);
        int32_t np = (int32_t)ceil_div(kv[b], ps);
        indptr[b + 1] = indptr[b] + np;
        last[b] = np ? kv[b] - (np - 1) * ps : 0;
        nnz += nnew[b];
    }
    int64_t entries = indptr[B];
    int64_t P = entries * 2 + h_rng_range(&r, 1, entries + 3);
    int32_t* perm = (int32_t*)xcalloc((size_t)P, sizeof(int32_t));
    for (int64_t p = 0; p < P; ++p) perm[p] = (int32_t)p;
    h_rng_shuffle_i32(&r, perm, P);
    /* tokens: per request, either its last nnew positions or nnew distinct random positions; shuffled */
    /* bt=1: the slot form (kva_append_paged_kv_cache_by_slot) with 0-3 padding tokens (negative slots, request -1)
       that must not be written */
    const int64_t npad = c->bt ? h_rng_range(&r, 0, 3) : 0;
    nnz += npad;
    int32_t* bidx = (int32_t*)xcalloc((size_t)nnz + 1, sizeof(int32_t));
    int32_t* pos = (int32_t*)xcalloc((size_t)nnz + 1, sizeof(int32_t));
    int64_t n = 0;
    for (int64_t k = 0; k < npad; ++k, ++n) bidx[n] = -1, pos[n] = (int32_t)k;
    for (int32_t b = 0; b < B; ++b) {
        int tail = h_rng_range(&r, 0, 1) == 0;
        int32_t* cand = (int32_t*)xcalloc((size_t)kv[b] + 1, sizeof(int32_t));
        for (int32_t j = 0; j < kv[b]; ++j) cand[j] = j;
        if (!tail) h_rng_shuffle_i32(&r, cand, kv[b]);
        for (int32_t k = 0; k < nnew[b]; ++k) {
            bidx[n] = b;
            pos[n] = tail ? kv[b] - nnew[b] + k : cand[k];
            ++n;
        }
        free(cand);
    }
    for (int64_t i = nnz - 1; i > 0; --i) { /* shuffle token order */
        int64_t j = h_rng_range(&r, 0, i);
        int32_t tb = bidx[i], tp = pos[i];
        bidx[i] = bidx[j];
        pos[i] = pos[j];
        bidx[j] = tb;
        pos[j] = tp;
    }
    int64_t ks[3], vs[3];
    pool_strides(&pc, dqk, 1, ks); /* append takes any stride on every backend: keep them odd */
    pool_strides(&pc, dvo, 1, vs);
    h_buf kp = h_buf_alloc(t, (size_t)(P * ks[0]));
    h_buf vp = c->pool == 1 ? kp : h_buf_alloc(t, (size_t)(P * vs[0]));
    int64_t v_base = c->pool == 1 ? (int64_t)ps * H * dqk : 0;
    for (size_t i = 0; i < kp.bytes; ++i) ((unsigned char*)h_buf_hp(&kp))[i] = (unsigned char)h_rng_u64(&r);
    if (c->pool != 1)
        for (size_t i = 0; i < vp.bytes; ++i) ((unsigned char*)h_buf_hp(&vp))[i] = (unsigned char)h_rng_u64(&r);
    h_buf_upload(&kp);
    if (c->pool != 1) h_buf_upload(&vp);
    /* new rows [nnz, H, D] with row stride H * D + qpad */
    int64_t ak_s0 = (int64_t)H * dqk + c->qpad, av_s0 = (int64_t)H * dvo + c->qpad;
    h_buf ak = h_buf_alloc(t, (size_t)(nnz * ak_s0)), av = h_buf_alloc(t, (size_t)(nnz * av_s0));
    h_buf_poison(&ak);
    h_buf_poison(&av);
    for (int64_t i = 0; i < nnz; ++i)
        for (int32_t h = 0; h < H; ++h) {
            for (int32_t d = 0; d < dqk; ++d) put_rand(&ak, (size_t)(i * ak_s0 + h * dqk + d), &r);
            for (int32_t d = 0; d < dvo; ++d) put_rand(&av, (size_t)(i * av_s0 + h * dvo + d), &r);
        }
    h_buf_upload(&ak);
    h_buf_upload(&av);
    /* expected pools */
    size_t ktot = 2 * H_GUARD_BYTES + (kp.bytes + 255) / 256 * 256, vtot = 2 * H_GUARD_BYTES + (vp.bytes + 255) / 256 * 256;
    unsigned char* kexp = (unsigned char*)xcalloc(ktot, 1);
    unsigned char* vexp = (unsigned char*)xcalloc(vtot, 1);
    memcpy(kexp, kp.host, ktot);
    unsigned char* vexp_used = c->pool == 1 ? kexp : vexp;
    if (c->pool != 1) memcpy(vexp, vp.host, vtot);
    for (int64_t i = 0; i < nnz; ++i) {
        int32_t b = bidx[i];
        if (b < 0) continue; /* padding */
        int64_t page = perm[indptr[b] + pos[i] / ps], slot = pos[i] % ps;
        for (int32_t h = 0; h < H; ++h) {
            memcpy(kexp + H_GUARD_BYTES + (size_t)(page * ks[0] + slot * ks[1] + h * ks[2]) * es,
                   (unsigned char*)h_buf_hp(&ak) + (size_t)(i * ak_s0 + h * dqk) * es, (size_t)dqk * es);
            memcpy(vexp_used + H_GUARD_BYTES + (size_t)(v_base + page * vs[0] + slot * vs[1] + h * vs[2]) * es,
                   (unsigned char*)h_buf_hp(&av) + (size_t)(i * av_s0 + h * dvo) * es, (size_t)dvo * es);
        }
    }
    h_buf idx_d = h_buf_alloc(KVA_DTYPE_I32, (size_t)entries), indptr_d = h_buf_alloc(KVA_DTYPE_I32, (size_t)B + 1),
          last_d = h_buf_alloc(KVA_DTYPE_I32, (size_t)B), bidx_d = h_buf_alloc(KVA_DTYPE_I32, (size_t)nnz),
          pos_d = h_buf_alloc(KVA_DTYPE_I32, (size_t)nnz);
    memcpy(h_buf_hp(&idx_d), perm, (size_t)entries * 4);
    memcpy(h_buf_hp(&indptr_d), indptr, ((size_t)B + 1) * 4);
    memcpy(h_buf_hp(&last_d), last, (size_t)B * 4);
    memcpy(h_buf_hp(&bidx_d), bidx, (size_t)nnz * 4);
    memcpy(h_buf_hp(&pos_d), pos, (size_t)nnz * 4);
    /* the slot form's int64 slots (an I32 buffer of twice the length) */
    h_buf slot_d = h_buf_alloc(KVA_DTYPE_I32, 2 * (size_t)nnz + 2);
    for (int64_t i = 0; i < nnz; ++i) {
        const int64_t sl = bidx[i] < 0 ? (pos[i] == 0 ? -1 : pos[i] == 1 ? INT64_MIN : -(INT64_C(1) << 40) - pos[i])
                                       : (int64_t)perm[indptr[bidx[i]] + pos[i] / ps] * ps + pos[i] % ps;
        memcpy((char*)h_buf_hp(&slot_d) + 8 * (size_t)i, &sl, 8);
    }
    h_buf* ups[] = {&idx_d, &indptr_d, &last_d, &bidx_d, &pos_d, &slot_d};
    for (int i = 0; i < 6; ++i) h_buf_upload(ups[i]);
    kva_paged_kv pg;
    memset(&pg, 0, sizeof pg);
    pg.k_data = h_buf_dp(&kp);
    pg.v_data = (char*)h_buf_dp(&vp) + (size_t)v_base * es;
    pg.dtype = t;
    pg.num_pages = P;
    pg.page_size = ps;
    pg.num_heads = H;
    pg.head_dim_qk = dqk;
    pg.head_dim_vo = dvo;
    pg.k_stride_page = ks[0];
    pg.k_stride_token = ks[1];
    pg.k_stride_head = ks[2];
    pg.v_stride_page = vs[0];
    pg.v_stride_token = vs[1];
    pg.v_stride_head = vs[2];
    pg.indices = (const int32_t*)h_buf_dp(&idx_d);
    pg.indptr = (const int32_t*)h_buf_dp(&indptr_d);
    pg.last_page_len = (const int32_t*)h_buf_dp(&last_d);
    kva_tensor tk, tv;
    memset(&tk, 0, sizeof tk);
    tk.data = h_buf_dp(&ak);
    tk.dtype = t;
    tk.ndim = 3;
    tk.shape[0] = nnz;
    tk.shape[1] = H;
    tk.shape[2] = dqk;
    tk.stride[0] = ak_s0;
    tk.stride[1] = dqk;
    tk.stride[2] = 1;
    tv = tk;
    tv.data = h_buf_dp(&av);
    tv.shape[2] = dvo;
    tv.stride[0] = av_s0;
    tv.stride[1] = dvo;
    h_buf* ins[] = {&ak, &av, &idx_d, &indptr_d, &last_d, &bidx_d, &pos_d, &slot_d};
    snap sn;
    snap_take(&sn, ins, 8);
    kva_status st;
    if (c->bt) {
        if (h_rng_range(&r, 0, 1)) { /* the table fields are not read */
            pg.indices = NULL;
            pg.indptr = NULL;
            pg.last_page_len = NULL;
        }
        st = kva_append_paged_kv_cache_by_slot(ctx, &tk, &tv, (const int64_t*)h_buf_dp(&slot_d), nnz, &pg, NULL);
    } else {
        st = kva_append_paged_kv_cache(ctx, &tk, &tv, (const int32_t*)h_buf_dp(&bidx_d),
                                       (const int32_t*)h_buf_dp(&pos_d), nnz, &pg, B, NULL);
    }
    H_EXPECT(ok, st == KVA_OK, "kva_append_paged_kv_cache%s: %s: %s", c->bt ? "_by_slot" : "", ST_NAME(st),
             kva_last_error_message());
    h_buf_download(&kp);
    if (c->pool != 1) h_buf_download(&vp);
    if (memcmp(kexp, kp.host, ktot) != 0) {
        size_t i = 0;
        while (i < ktot && kexp[i] == kp.host[i]) ++i;
        H_EXPECT(ok, 0, "append: K pool differs from the expected scatter at byte %lld of the payload",
                 (long long)i - H_GUARD_BYTES);
    }
    if (c->pool != 1 && memcmp(vexp, vp.host, vtot) != 0) {
        size_t i = 0;
        while (i < vtot && vexp[i] == vp.host[i]) ++i;
        H_EXPECT(ok, 0, "append: V pool differs from the expected scatter at byte %lld of the payload",
                 (long long)i - H_GUARD_BYTES);
    }
    ok &= snap_same(&sn, "append inputs");
    h_buf_free(&kp);
    if (c->pool != 1) h_buf_free(&vp);
    h_buf_free(&ak);
    h_buf_free(&av);
    for (int i = 0; i < 6; ++i) h_buf_free(ups[i]);
    free(kexp);
    free(vexp);
    free(kv);
    free(nnew);
    free(indptr);
    free(last);
    free(perm);
    free(bidx);
    free(pos);
    return ok ? CASE_PASS : CASE_FAIL;
}

/* ============================================================================================== */
/* Case dispatch and suites                                                                        */

static int run_case(const h_case* c0) {
    h_case c = *c0;
    h_case_fixup(&c);
    char line[1024];
    h_case_format(&c, line, sizeof line);
    h_logf("case: %s\n", line);
    /* kva_last_error_status() is sticky (a successful call does not reset it): clear it, so that the skip below
       only sees an UNSUPPORTED returned inside this case, not one left over from an earlier (skipped) case, which
       would turn a wrong result of this case into a skip */
    kva_clear_last_error();
    int res;
    switch (c.op) {
    case H_OP_DECODE:
    case H_OP_PREFILL:
    case H_OP_RAGGED: res = run_batch_case(&c); break;
    case H_OP_SINGLE_DECODE:
    case H_OP_SINGLE_PREFILL: res = run_single_case(&c); break;
    case H_OP_MERGE:
    case H_OP_MERGE_IN_PLACE:
    case H_OP_MERGE_STATES: res = run_merge_case(&c); break;
    case H_OP_APPEND: res = run_append_case(&c); break;
    default: res = CASE_FAIL; break;
    }
    if (res == CASE_FAIL && h_opt.backend != KVA_BACKEND_CPU && kva_last_error_status() == KVA_ERR_UNSUPPORTED)
        res = CASE_SKIP; /* a device backend may lack a dtype/shape the CPU backend has (never on CPU) */
    if (res == CASE_PASS) h_pass();
    else if (res == CASE_SKIP) {
        ++h_nskip;
        h_logf("  skipped (unsupported on %s)\n", h_opt.backend_name);
    } else {
        h_failf(__FILE__, __LINE__, "case failed; replay with:\n  test_ops --backend %s --case \"%s\"", h_opt.backend_name, line);
    }
    return res;
}

static uint64_t g_seed_counter = 1000;

/* Run c with a fresh deterministic seed. */
static void go(h_case c) {
    c.seed = g_seed_counter++;
    run_case(&c);
}

/* The common sweep for attention ops: each line varies one feature of the base case. */
static void sweep_attention(const h_case* base) {
    const int cpu = h_opt.backend == KVA_BACKEND_CPU;
    h_case c;
    /* GQA group sizes */
    static const int groups[] = {1, 2, 3, 4, 5, 7, 8};
    for (int i = 0; i < 7; ++i) {
        c = *base;
        c.hkv = i % 2 ? 1 : 2;
        c.hq = c.hkv * groups[i];
        go(c);
    }
    /* page sizes x layouts (for ragged/single: pool padding variants instead) */
    static const int pss[] = {1, 3, 16};
    for (int i = 0; i < 3; ++i)
        for (int l = 0; l < 2; ++l) {
            c = *base;
            c.page_size = pss[i];
            c.layout = (kva_layout)l;
            go(c);
        }
    /* head dims */
    static const int dims[] = {64, 128, 256};
    for (int i = 0; i < 3; ++i) {
        c = *base;
        c.dqk = c.dvo = dims[i];
        go(c);
    }
    if (cpu) {
        c = *base;
        c.dqk = c.dvo = 80;
        go(c);
        c.dqk = c.dvo = 7; /* odd, tiny */
        go(c);
        c.dqk = c.dvo = 512; /* the CPU backend's largest */
        c.max_kv = 40;
        go(c);
        c = *base;
        c.dqk = 192;
        c.dvo = 128;
        go(c);
    }
    /* dtypes: q/o x KV (fp8 with scales != 1) */
    static const kva_dtype qd[] = {KVA_DTYPE_F32, KVA_DTYPE_F16, KVA_DTYPE_BF16};
    static const kva_dtype kd[] = {KVA_DTYPE_F16, KVA_DTYPE_BF16, KVA_DTYPE_F32, KVA_DTYPE_E4M3, KVA_DTYPE_E5M2};
    for (int i = 0; i < 3; ++i)
        for (int j = 0; j < 5; ++j) {
            c = *base;
            c.q_dt = c.o_dt = qd[i];
            c.kv_dt = kd[j];
            c.k_scale = 0.75f;
            c.v_scale = 1.5f;
            go(c);
        }
    c = *base;
    c.q_dt = KVA_DTYPE_F16;
    c.o_dt = KVA_DTYPE_F32;
    go(c);
    c = *base;
    c.q_dt = KVA_DTYPE_BF16;
    c.kv_dt = KVA_DTYPE_E4M3;
    c.o_dt = KVA_DTYPE_F16;
    c.k_scale = 2.0f;
    c.v_scale = 0.3f;
    go(c);
    /* masks, window */
    for (int m = 0; m < 3; ++m) {
        c = *base;
        c.mask = (kva_mask_mode)m;
        go(c);
    }
    static const int wins[] = {0, 5, 37};
    for (int i = 0; i < 3; ++i) {
        c = *base;
        c.window = wins[i];
        go(c);
        c.mask = KVA_MASK_CAUSAL;
        go(c);
    }
    /* one head; huge logits (|x| in the hundreds: exp overflows without the running max) */
    c = *base;
    c.hq = c.hkv = 1;
    go(c);
    c = *base;
    c.scale = 20.0f;
    go(c);
    c.mask = KVA_MASK_CAUSAL;
    c.fixed_split = 16;
    c.q_dt = f32_or(KVA_DTYPE_F16);
    c.o_dt = KVA_DTYPE_F32;
    go(c);
    /* soft cap, scale */
    c = *base;
    c.cap = 2.5f;
    c.scale = 0.3f; /* big logits, so the cap matters */
    go(c);
    c = *base;
    c.cap = 30.0f;
    go(c);
    /* ALiBi: standard (power of two and not), custom slopes */
    c = *base;
    c.pos = KVA_POS_ALIBI;
    go(c);
    c.hkv = 3;
    c.hq = 12;
    go(c);
    c = *base;
    c.pos = KVA_POS_ALIBI;
    c.custom_slopes = 1;
    c.mask = KVA_MASK_CAUSAL;
    go(c);
    /* RoPE */
    c = *base;
    c.pos = KVA_POS_ROPE_LLAMA;
    go(c);
    c.rope_scale = 4.0f;
    c.rope_theta = 5e5f;
    c.mask = KVA_MASK_CAUSAL;
    c.dqk = c.dvo = 128;
    go(c);
    /* sigmoid */
    c = *base;
    c.score = KVA_SCORE_SIGMOID;
    c.sig_bias = -1.25f;
    go(c);
    c.mask = KVA_MASK_CAUSAL;
    c.sig_bias = 0.5f;
    c.fixed_split = 16;
    go(c);
    /* lse off, empty requests, qo_len 0 */
    c = *base;
    c.lse = 0;
    go(c);
    c = *base;
    c.empty_pct = 50;
    c.mask = KVA_MASK_CAUSAL;
    go(c);
    if (base->op == H_OP_PREFILL || base->op == H_OP_RAGGED) {
        c = *base;
        c.zero_qo_pct = 40;
        go(c);
    }
    /* splitting */
    c = *base;
    c.fixed_split = 16;
    go(c);
    c.fixed_split = 100;
    c.mask = KVA_MASK_CAUSAL;
    go(c);
    c = *base;
    c.no_split = 1;
    c.max_kv = 600;
    c.threads = 8;
    go(c);
    c = *base;
    c.max_kv = 700;
    c.threads = 8; /* long enough to be split by the balancer */
    go(c);
    c.threads = 1;
    go(c);
    /* graph mode with re-plans into the same workspace */
    if (op_is_batch(base->op)) {
        c = *base;
        c.graph = 1;
        go(c);
        c.mask = KVA_MASK_CAUSAL;
        c.max_kv = 500;
        c.threads = 5;
        c.fixed_split = 64;
        go(c);
    }
    /* strided q/o, strided pools */
    c = *base;
    c.qpad = 16;
    c.opad = 8;
    go(c);
    for (int l = 0; l < 2; ++l) {
        c = *base;
        c.pool = 1;
        c.layout = (kva_layout)l;
        go(c);
        c.pool = 2;
        c.page_size = 3;
        go(c);
    }
    /* API flavours */
    c = *base;
    c.api = 1;
    go(c);
    c = *base;
    c.hidx = 0;
    go(c);
    /* a few everything-at-once cases */
    c = *base;
    c.pos = KVA_POS_ROPE_LLAMA;
    c.mask = KVA_MASK_CAUSAL;
    c.window = 20;
    c.cap = 20.0f;
    c.kv_dt = KVA_DTYPE_E4M3;
    c.k_scale = 0.5f;
    c.v_scale = 1.25f;
    c.q_dt = c.o_dt = KVA_DTYPE_BF16;
    c.qpad = 3;
    c.opad = 5;
    c.pool = 1;
    c.layout = KVA_LAYOUT_HND;
    c.graph = op_is_batch(base->op);
    c.hq = 14;
    c.hkv = 2;
    go(c);
    c = *base;
    c.pos = KVA_POS_ALIBI;
    c.mask = KVA_MASK_CUSTOM;
    c.fixed_split = 7;
    c.page_size = 1;
    c.kv_dt = KVA_DTYPE_E5M2;
    c.q_dt = f32_or(KVA_DTYPE_BF16);
    c.o_dt = KVA_DTYPE_F32;
    c.empty_pct = 25;
    c.pool = 2;
    go(c);
}

/* Cases given as --case strings (h_case_parse), e.g. serving shapes outside the sweeps. */
static void go_strings(const char* const* cases, size_t n) {
    for (size_t i = 0; i < n; ++i) {
        h_case c;
        char err[256];
        if (!h_case_parse(cases[i], &c, err, sizeof err)) {
            h_failf(__FILE__, __LINE__, "case \"%s\": %s", cases[i], err);
            continue;
        }
        go(c);
    }
}

static void suite_decode(void) {
    h_case b;
    h_case_default(&b, H_OP_DECODE);
    b.batch = 5;
    b.max_kv = 150;
    b.empty_pct = 10;
    sweep_attention(&b);
    /* multi-request decode of big batches */
    b.batch = 40;
    b.max_kv = 90;
    b.hq = 8;
    b.hkv = 1;
    go(b);
    /* serving shapes beyond the sweep: groups of 5 to 64 query heads per KV head (the tensor-core and head-group
       kernels' row tiling), page sizes 3, 5, 17, 48, 128, 1024, head dims 64 and 256 with large groups and fp8 KV,
       MHA with odd pages, graph mode, window + soft cap, ALiBi and RoPE on grouped heads */
    static const char* const shapes[] = {
        "op=decode B=3 kv=700 hq=48 hkv=4 dqk=128 dvo=128 qt=bf16 kvt=bf16 ot=bf16 ps=16",
        "op=decode B=5 kv=3000 hq=64 hkv=4 dqk=128 dvo=128 qt=bf16 kvt=bf16 ot=bf16 ps=16",
        "op=decode B=2 kv=5000 hq=32 hkv=1 dqk=128 dvo=128 qt=f16 kvt=f16 ot=f16 ps=16",
        "op=decode B=2 kv=2000 hq=64 hkv=1 dqk=64 dvo=64 qt=bf16 kvt=bf16 ot=bf16 ps=32",
        "op=decode B=3 kv=1500 hq=24 hkv=4 dqk=128 dvo=128 qt=bf16 kvt=bf16 ot=bf16 ps=5",
        "op=decode B=2 kv=2500 hq=32 hkv=2 dqk=256 dvo=256 qt=bf16 kvt=bf16 ot=bf16 ps=16",
        "op=decode B=2 kv=2500 hq=32 hkv=2 dqk=256 dvo=256 qt=bf16 kvt=e4m3 ot=bf16 ps=16 ks=0.5 vs=2",
        "op=decode B=4 kv=4100 hq=64 hkv=4 dqk=128 dvo=128 qt=bf16 kvt=e5m2 ot=bf16 ps=64 ks=1.5 vs=0.25",
        "op=decode B=3 kv=999 hq=12 hkv=12 dqk=64 dvo=64 qt=f16 kvt=f16 ot=f16 ps=17 layout=HND",
        "op=decode B=3 kv=999 hq=40 hkv=8 dqk=128 dvo=128 qt=bf16 kvt=bf16 ot=bf16 ps=1 layout=HND",
        "op=decode B=7 kv=777 hq=96 hkv=8 dqk=128 dvo=128 qt=bf16 kvt=bf16 ot=bf16 ps=128 graph=1",
        "op=decode B=9 kv=2048 hq=32 hkv=8 dqk=128 dvo=128 qt=bf16 kvt=bf16 ot=bf16 ps=1024",
        "op=decode B=4 kv=3333 hq=28 hkv=4 dqk=128 dvo=128 qt=bf16 kvt=bf16 ot=bf16 ps=16 win=1000 cap=30",
        "op=decode B=4 kv=3333 hq=16 hkv=1 dqk=128 dvo=128 qt=bf16 kvt=bf16 ot=bf16 ps=16 pos=alibi",
        "op=decode B=4 kv=3333 hq=16 hkv=2 dqk=128 dvo=128 qt=bf16 kvt=bf16 ot=bf16 ps=16 pos=rope",
        "op=decode B=3 kv=999 hq=40 hkv=8 dqk=128 dvo=128 qt=bf16 kvt=bf16 ot=bf16 ps=3 layout=HND graph=1 lse=1",
        "op=decode B=2 kv=9000 hq=20 hkv=4 dqk=64 dvo=64 qt=f16 kvt=e4m3 ot=f16 ps=48 layout=HND ks=0.8 vs=1.1",
        /* groups of 9 to 32 (the CUDA backend's head-group kernel in row slots; with pages of other than 16k tokens for
           calls under 160 MB): odd groups,
           a slot with fewer than 16 rows, pages of 1 and 7 (its cp.async producers), fp8, many items a CTA,
           split KV of a single long request, empty requests */
        "op=decode B=5 kv=1200 hq=18 hkv=2 dqk=128 dvo=128 qt=bf16 kvt=bf16 ot=bf16 ps=16 lse=1",
        "op=decode B=3 kv=2000 hq=96 hkv=4 dqk=128 dvo=128 qt=f16 kvt=f16 ot=f32 ps=7 layout=HND empty=30",
        "op=decode B=1 kv=40000 hq=32 hkv=1 dqk=128 dvo=128 qt=bf16 kvt=bf16 ot=bf16 ps=16 lse=1",
        "op=decode B=40 kv=900 hq=20 hkv=1 dqk=64 dvo=64 qt=bf16 kvt=bf16 ot=bf16 ps=1",
        "op=decode B=6 kv=3000 hq=64 hkv=4 dqk=128 dvo=128 qt=bf16 kvt=e4m3 ot=bf16 ps=32 ks=0.6 vs=1.4 lse=1",
        "op=decode B=200 kv=300 hq=44 hkv=2 dqk=128 dvo=128 qt=bf16 kvt=bf16 ot=bf16 ps=16 empty=10",
        /* 16-row slots: a second slot of one row, e5m2; a group of 12 at head dim 64 on pages of 5; fp8 split KV of 30
           rows */
        "op=decode B=7 kv=1500 hq=17 hkv=1 dqk=128 dvo=128 qt=f16 kvt=e5m2 ot=f16 ps=16 ks=0.9 vs=1.1 lse=1",
        "op=decode B=3 kv=5000 hq=48 hkv=4 dqk=64 dvo=64 qt=f16 kvt=f16 ot=f32 ps=5 lse=1",
        "op=decode B=2 kv=20000 hq=30 hkv=1 dqk=128 dvo=128 qt=bf16 kvt=e4m3 ot=bf16 ps=16 ks=0.7 vs=1.3",
        /* fp8 KV at head dim 256 on the tensor-core decode kernel (groups 1-8; 4 warps, and 8 warps for the long
           single request: more than 1024 K/V rows per SM, one unit per SM; head dim 64 below) */
        "op=decode B=3 kv=1500 hq=16 hkv=8 dqk=256 dvo=256 qt=bf16 kvt=e4m3 ot=bf16 ps=16 ks=0.5 vs=2",
        "op=decode B=5 kv=700 hq=20 hkv=4 dqk=256 dvo=256 qt=f16 kvt=e5m2 ot=f32 ps=3 layout=HND ks=1.25 vs=0.5",
        "op=decode B=1 kv=20000 hq=16 hkv=8 dqk=256 dvo=256 qt=bf16 kvt=e4m3 ot=bf16 ps=16 ks=0.8 vs=1.2",
        "op=decode B=4 kv=999 hq=32 hkv=4 dqk=256 dvo=256 qt=bf16 kvt=e4m3 ot=bf16 ps=1 graph=1 lse=1",
        "op=decode B=3 kv=2000 hq=8 hkv=8 dqk=256 dvo=256 qt=f16 kvt=e4m3 ot=f16 ps=16 win=700 cap=30",
        "op=decode B=2 kv=1800 hq=16 hkv=4 dqk=256 dvo=256 qt=bf16 kvt=e5m2 ot=bf16 ps=32 pos=alibi lse=1",
        /* fp8 KV at head dim 64 on the tensor-core kernel (64-byte rows in 128-byte shared slots) */
        "op=decode B=4 kv=1200 hq=64 hkv=8 dqk=64 dvo=64 qt=bf16 kvt=e4m3 ot=bf16 ps=16 win=128 ks=0.7 vs=1.3",
        "op=decode B=3 kv=800 hq=8 hkv=8 dqk=64 dvo=64 qt=f16 kvt=e5m2 ot=f32 ps=1 ks=1.1 vs=0.9",
        "op=decode B=1 kv=30000 hq=16 hkv=8 dqk=64 dvo=64 qt=bf16 kvt=e4m3 ot=bf16 ps=16",
        "op=decode B=5 kv=600 hq=12 hkv=4 dqk=64 dvo=64 qt=bf16 kvt=e4m3 ot=bf16 ps=3 layout=HND graph=1 lse=1",
        "op=decode B=2 kv=3000 hq=28 hkv=4 dqk=64 dvo=64 qt=f16 kvt=e4m3 ot=f16 ps=16 cap=20 pos=alibi",
        /* the block-table form of the page table (rows padded with entries outside the pool, never read): the
           tensor-core and head-group kernels, row slots, page 1, split KV, empty requests (a trailing one too),
           graph mode, the host copy checked, a scratch region */
        "op=decode B=6 kv=2000 hq=32 hkv=8 dqk=128 dvo=128 qt=bf16 kvt=bf16 ot=bf16 ps=16 bt=1 empty=30 lse=1",
        "op=decode B=3 kv=5000 hq=32 hkv=2 dqk=128 dvo=128 qt=bf16 kvt=bf16 ot=bf16 ps=16 bt=1 hidx=1",
        "op=decode B=2 kv=20000 hq=24 hkv=1 dqk=128 dvo=128 qt=f16 kvt=f16 ot=f16 ps=16 bt=1 lse=1",
        "op=decode B=5 kv=900 hq=8 hkv=2 dqk=64 dvo=64 qt=bf16 kvt=e4m3 ot=bf16 ps=1 bt=1 ks=0.7 vs=1.2",
        "op=decode B=7 kv=777 hq=40 hkv=8 dqk=128 dvo=128 qt=bf16 kvt=bf16 ot=bf16 ps=5 layout=HND bt=1 graph=1 lse=1",
        "op=decode B=4 kv=1500 hq=16 hkv=4 dqk=256 dvo=256 qt=f16 kvt=f16 ot=f16 ps=32 bt=1 scratch=1 empty=40",
        /* fp8 KV near saturation (values up to 448 / 57344 with scales of about 1 / amplitude), scales on 16-bit KV */
        "op=decode B=4 kv=1200 hq=32 hkv=8 dqk=128 dvo=128 qt=bf16 kvt=e4m3 ot=bf16 ps=16 amp=300 ks=0.003 vs=0.004",
        "op=decode B=4 kv=1200 hq=16 hkv=2 dqk=128 dvo=128 qt=f16 kvt=e5m2 ot=f32 ps=16 amp=30000 ks=3e-5 vs=4e-5",
        "op=decode B=4 kv=900 hq=16 hkv=4 dqk=128 dvo=128 qt=f16 kvt=f16 ot=f16 ps=16 ks=0.6 vs=0.02",
    };
    go_strings(shapes, sizeof shapes / sizeof shapes[0]);
}

static void suite_prefill(void) {
    h_case b;
    h_case_default(&b, H_OP_PREFILL);
    b.batch = 4;
    b.max_kv = 120;
    b.max_qo = 20;
    sweep_attention(&b);
    /* prefill (qo = kv), append (qo < kv), multi-token decode (qo 2..4, causal) */
    h_case c = b;
    c.max_qo = c.max_kv = 96;
    c.mask = KVA_MASK_CAUSAL;
    go(c);
    c = b;
    c.max_qo = 4;
    c.max_kv = 300;
    c.mask = KVA_MASK_CAUSAL;
    c.batch = 8;
    go(c);
    c.hq = 32;
    c.hkv = 4;
    go(c);
    /* more query rows than keys (lqo): under a causal mask the first rows of such a request see no key (o = 0,
       lse = -inf); with a window, RoPE at negative query positions, ALiBi, a custom mask, split KV and graph mode */
    static const char* const longq[] = {
        "op=prefill B=4 qo=40 kv=12 lqo=100 hq=8 hkv=2 mask=causal ps=3 lse=1",
        "op=prefill B=3 qo=64 kv=20 lqo=100 hq=4 hkv=1 dqk=128 dvo=128 qt=bf16 kvt=bf16 ot=bf16 mask=causal win=4 pos=rope fsplit=8",
        "op=prefill B=3 qo=30 kv=9 lqo=100 hq=6 hkv=2 mask=none pos=alibi ps=1 graph=1",
        "op=prefill B=5 qo=30 kv=9 lqo=100 zqo=20 empty=20 hq=4 hkv=2 mask=custom kvt=e4m3 ks=0.5 vs=2 layout=HND",
    };
    go_strings(longq, sizeof longq / sizeof longq[0]);
    /* KV scales on 16-bit KV (they apply to every KV dtype), small values (the tolerance follows their size), and fp8
       KV near saturation (values up to 448 / 57344, scales of about 1 / amplitude) */
    static const char* const scaled[] = {
        "op=prefill B=3 qo=20 kv=200 hq=4 hkv=2 qt=bf16 kvt=bf16 ot=bf16 mask=causal ks=0.3 vs=3",
        "op=prefill B=3 qo=20 kv=200 hq=4 hkv=2 qt=f16 kvt=f16 ot=f32 mask=causal ks=1.5 vs=0.01",
        "op=prefill B=3 qo=16 kv=300 hq=8 hkv=2 qt=bf16 kvt=e4m3 ot=bf16 mask=causal amp=300 ks=0.003 vs=0.004",
        "op=prefill B=3 qo=16 kv=300 hq=8 hkv=2 qt=f16 kvt=e5m2 ot=f16 mask=causal amp=30000 ks=3e-5 vs=4e-5 ps=1",
    };
    go_strings(scaled, sizeof scaled / sizeof scaled[0]);
    /* the block-table form of the page table (rows padded with entries outside the pool): causal append and prefill,
       a custom mask, split KV, graph mode, the host copy checked, 128-row tiles at D 128 (TMA on page-aligned tiles) */
    static const char* const btab[] = {
        "op=prefill B=4 qo=20 kv=300 hq=8 hkv=2 mask=causal ps=16 bt=1 lse=1 empty=25",
        "op=prefill B=3 qo=30 kv=200 hq=4 hkv=1 mask=custom ps=3 bt=1 hidx=1 fsplit=32",
        "op=prefill B=3 qo=12 kv=500 hq=6 hkv=2 mask=causal ps=1 bt=1 graph=1 lse=1",
        "op=prefill B=2 qo=300 kv=700 hq=16 hkv=4 dqk=128 dvo=128 qt=bf16 kvt=bf16 ot=bf16 mask=causal ps=64 bt=1",
    };
    go_strings(btab, sizeof btab / sizeof btab[0]);
    /* long queries at D 128, 16-bit: 128-row tiles (the Hopper mainloop on sm_90, whose paged K/V goes through TMA
       at page sizes 16-128 dividing 128 or multiples of 128, page-aligned tiles only); graph mode keeps the
       paged tensor maps; split chunks off page boundaries take cp.async */
    h_case l = b;
    l.hq = 8;
    l.hkv = 2;
    l.dqk = l.dvo = 128;
    l.q_dt = l.kv_dt = l.o_dt = KVA_DTYPE_BF16;
    l.batch = 3;
    l.max_qo = 300;
    l.max_kv = 900;
    l.mask = KVA_MASK_CAUSAL;
    static const int lps[] = {16, 32, 256, 3};
    for (int i = 0; i < 4; ++i) {
        c = l;
        c.page_size = lps[i];
        go(c);
    }
    c = l;
    c.layout = KVA_LAYOUT_HND;
    c.q_dt = c.kv_dt = c.o_dt = KVA_DTYPE_F16;
    go(c);
    c = l;
    c.fixed_split = 72;
    go(c);
    c = l;
    c.graph = 1;
    go(c);
}

static void suite_ragged(void) {
    h_case b;
    h_case_default(&b, H_OP_RAGGED);
    b.batch = 4;
    b.max_kv = 120;
    b.max_qo = 20;
    sweep_attention(&b);
    /* tall tiles (128 packed rows of one head each) under a short sliding window: the later rows of a tile see none
       of the tile's first KV block (the CPU kernel masked past the end of the block's score row there) */
    static const char* const tall[] = {
        "op=ragged B=2 qo=300 kv=300 hq=2 hkv=2 dqk=64 dvo=64 mask=none win=0",
        "op=ragged B=2 qo=260 kv=400 hq=3 hkv=3 dqk=128 dvo=128 mask=causal win=5 lse=1",
        "op=prefill B=2 qo=200 kv=300 hq=2 hkv=1 dqk=64 dvo=64 ps=7 mask=custom win=2",
        /* ... and tall tiles of more query rows than keys */
        "op=ragged B=3 qo=200 kv=40 lqo=100 hq=4 hkv=4 dqk=64 dvo=64 mask=causal win=10 lse=1",
        "op=ragged B=4 qo=24 kv=5 lqo=100 hq=8 hkv=1 dqk=64 dvo=64 mask=causal score=sigmoid sb=0.5",
        "op=ragged B=4 qo=48 kv=16 lqo=100 hq=4 hkv=2 dqk=80 dvo=80 mask=causal pos=rope qt=f32 kvt=f32 ot=f32 lse=1",
    };
    go_strings(tall, sizeof tall / sizeof tall[0]);
}

static void suite_single(void) {
    h_case b;
    h_case_default(&b, H_OP_SINGLE_DECODE);
    b.max_kv = 300;
    h_case c = b;
    static const int groups[] = {1, 2, 4, 5, 8};
    for (int i = 0; i < 5; ++i) {
        c = b;
        c.hkv = 2;
        c.hq = 2 * groups[i];
        c.api = i & 1;
        go(c);
    }
    c = b;
    c.max_kv = 2000;
    c.threads = 4;
    go(c);
    c.no_split = 1;
    go(c);
    c = b;
    c.kv_dt = KVA_DTYPE_E4M3;
    c.k_scale = 1.5f;
    c.v_scale = 0.5f;
    c.pos = KVA_POS_ROPE_LLAMA;
    c.dqk = c.dvo = 128;
    go(c);
    c = b;
    c.window = 10;
    c.cap = 5.0f;
    c.pos = KVA_POS_ALIBI;
    c.q_dt = c.o_dt = c.kv_dt = KVA_DTYPE_BF16;
    c.pool = 2;
    c.qpad = 4;
    c.opad = 4;
    go(c);
    c = b;
    c.score = KVA_SCORE_SIGMOID;
    c.sig_bias = 1.0f;
    c.q_dt = c.kv_dt = f32_or(KVA_DTYPE_F16);
    c.o_dt = KVA_DTYPE_F32;
    go(c);
    c = b;
    c.lse = 0;
    c.dqk = c.dvo = 256;
    go(c);

    h_case_default(&b, H_OP_SINGLE_PREFILL);
    b.max_kv = 200;
    b.max_qo = 64;
    for (int m = 0; m < 3; ++m) {
        c = b;
        c.mask = (kva_mask_mode)m;
        go(c);
    }
    c = b;
    c.max_kv = 9; /* qo_len up to 64 over 9 keys: the first rows see no key */
    c.long_qo_pct = 100;
    c.mask = KVA_MASK_CAUSAL;
    go(c);
    c = b;
    c.max_kv = 1500;
    c.max_qo = 16;
    c.threads = 6;
    c.mask = KVA_MASK_CAUSAL;
    go(c);
    c = b;
    c.hq = 8;
    c.hkv = 1;
    c.pos = KVA_POS_ROPE_LLAMA;
    c.mask = KVA_MASK_CAUSAL;
    c.window = 30;
    go(c);
    c = b;
    c.kv_dt = KVA_DTYPE_E5M2;
    c.k_scale = 0.8f;
    c.v_scale = 1.2f;
    c.pool = 1;
    c.qpad = 2;
    c.opad = 9;
    go(c);
    c = b;
    c.q_dt = f32_or(KVA_DTYPE_BF16);
    c.o_dt = KVA_DTYPE_F32;
    c.kv_dt = KVA_DTYPE_BF16;
    c.pos = KVA_POS_ALIBI;
    c.custom_slopes = 1;
    c.no_split = 1;
    go(c);
    c = b;
    c.score = KVA_SCORE_SIGMOID;
    c.mask = KVA_MASK_CUSTOM;
    go(c);
    if (h_opt.backend == KVA_BACKEND_CPU) {
        c = b;
        c.dqk = c.dvo = 80;
        go(c);
    }
}

static void suite_merge(void) {
    static const kva_dtype dts[] = {KVA_DTYPE_F32, KVA_DTYPE_F16, KVA_DTYPE_BF16};
    h_case b, c;
    for (int op = H_OP_MERGE; op <= H_OP_MERGE_STATES; ++op) {
        h_case_default(&b, (h_op)op);
        b.batch = 17;
        b.hq = 5;
        b.dvo = 64;
        b.max_qo = 6;
        for (int i = 0; i < 3; ++i) {
            c = b;
            c.o_dt = dts[i];
            go(c);
            c.opad = 12;
            c.lse = 0;
            c.mask = KVA_MASK_CUSTOM;
            go(c);
            c.dvo = 128;
            c.alias = 1;
            c.lse = 1;
            go(c);
            c.alias = 2;
            c.empty_pct = 60;
            go(c);
        }
        c = b;
        c.batch = 0; /* no rows */
        go(c);
        c = b;
        c.dvo = 256;
        c.hq = 32;
        c.batch = 9;
        go(c);
        if (op == H_OP_MERGE_STATES) {
            c = b;
            c.max_qo = 0; /* every row has no states */
            go(c);
            c.max_qo = 40;
            c.batch = 30;
            go(c);
        }
    }
}

static void suite_append(void) {
    h_case b, c;
    h_case_default(&b, H_OP_APPEND);
    b.batch = 5;
    b.max_kv = 100;
    b.max_qo = 20;
    static const kva_dtype dts[] = {KVA_DTYPE_F32, KVA_DTYPE_F16, KVA_DTYPE_BF16, KVA_DTYPE_E4M3, KVA_DTYPE_E5M2};
    for (int i = 0; i < 5; ++i) {
        c = b;
        c.kv_dt = dts[i];
        go(c);
    }
    static const int pss[] = {1, 3, 16};
    for (int i = 0; i < 3; ++i)
        for (int l = 0; l < 2; ++l)
            for (int p = 0; p < 3; ++p) {
                c = b;
                c.page_size = pss[i];
                c.layout = (kva_layout)l;
                c.pool = p;
                c.qpad = p;
                go(c);
            }
    c = b;
    c.empty_pct = 40;
    go(c);
    c = b;
    c.dqk = 192;
    c.dvo = 128;
    c.hkv = 3;
    go(c);
    c = b;
    c.max_qo = 0; /* nnz = 0 */
    go(c);
    c = b;
    c.batch = 1;
    c.max_kv = 2000;
    c.max_qo = 2000;
    go(c);
    /* the slot form (bt=1: kva_append_paged_kv_cache_by_slot, with padding tokens) */
    for (int i = 0; i < 5; ++i) {
        c = b;
        c.bt = 1;
        c.kv_dt = dts[i];
        c.page_size = pss[i % 3];
        c.layout = (kva_layout)(i & 1);
        c.pool = i % 3;
        c.empty_pct = 20;
        go(c);
    }
    c = b;
    c.bt = 1;
    c.max_qo = 0; /* padding only, or nothing */
    go(c);
}

static void batch_invariance(h_op op, int32_t window, int32_t fixed_split, kva_mask_mode mask);

/* Splitting and planning modes across the batch ops, at lengths where the balancer splits. */
static void suite_split(void) {
    static const h_op ops[] = {H_OP_DECODE, H_OP_PREFILL, H_OP_RAGGED};
    for (int k = 0; k < 3; ++k) {
        h_case b, c;
        h_case_default(&b, ops[k]);
        b.batch = 6;
        b.max_kv = 900;
        b.max_qo = 6;
        b.hq = 8;
        b.hkv = 2;
        b.empty_pct = 15;
        static const int thr[] = {1, 2, 4, 7, 16};
        for (int i = 0; i < 5; ++i) {
            c = b;
            c.threads = thr[i];
            go(c);
        }
        static const int fs[] = {1, 16, 128, 333};
        for (int i = 0; i < 4; ++i) {
            c = b;
            c.fixed_split = fs[i];
            c.threads = 4;
            c.mask = i & 1 ? KVA_MASK_CAUSAL : KVA_MASK_NONE;
            c.max_kv = fs[i] == 1 ? 120 : 900;
            go(c);
        }
        c = b;
        c.graph = 1;
        c.threads = 6;
        go(c);
        c.fixed_split = 50;
        go(c);
        c = b;
        c.no_split = 1;
        c.threads = 16;
        go(c);
        c = b;
        c.window = 100;
        c.mask = KVA_MASK_CAUSAL;
        c.threads = 8;
        go(c);
        c = b;
        c.score = KVA_SCORE_SIGMOID;
        c.threads = 8;
        go(c);
        /* the partials in a scratch region shared with a second plan (kva_workspace.scratch): default split,
           fixed split, graph mode, and a GQA 32/8 d128 bf16 call with a long request (the tensor-core decode
           kernel's fused merge on a GPU) */
        c = b;
        c.scratch = 1;
        c.threads = 4;
        go(c);
        c.fixed_split = 16;
        c.mask = KVA_MASK_CAUSAL;
        go(c);
        c = b;
        c.scratch = 1;
        c.graph = 1;
        c.threads = 6;
        go(c);
        c = b;
        c.scratch = 1;
        c.hq = 32, c.hkv = 8, c.dqk = c.dvo = 128;
        c.q_dt = c.kv_dt = c.o_dt = KVA_DTYPE_BF16;
        c.batch = 3, c.max_kv = 3000, c.max_qo = 3, c.threads = 5;
        go(c);
    }
    batch_invariance(H_OP_PREFILL, -1, 64, KVA_MASK_CAUSAL);
    batch_invariance(H_OP_RAGGED, -1, 100, KVA_MASK_NONE);
    batch_invariance(H_OP_PREFILL, 300, 64, KVA_MASK_CAUSAL);
    batch_invariance(H_OP_RAGGED, 342, 68, KVA_MASK_NONE);
}

/* fixed_split_size promises results that do not depend on the other requests: request 0 planned alone and as
 * the first request of a batch whose other requests change the batch's average query length (and so the tile
 * size) must give byte-identical o and lse rows. */
static void batch_invariance(h_op op, int32_t window, int32_t fixed_split, kva_mask_mode mask) {
    h_case c;
    h_case_default(&c, op);
    c.hq = 8;
    c.hkv = 2;
    c.mask = mask;
    c.window = window;
    c.fixed_split = fixed_split;
    c.threads = 3;
    /* f32 q where the backend has it (CPU); the CUDA backend takes f16/bf16 q only (f32 q: KVA_ERR_UNSUPPORTED),
       so bf16 q there, with f32 o on both (the last bits of an f32 o are the most sensitive to the split) */
    c.q_dt = h_backend_device() ? KVA_DTYPE_BF16 : KVA_DTYPE_F32;
    c.o_dt = KVA_DTYPE_F32;
    c.kv_dt = KVA_DTYPE_BF16;
    c.seed = g_seed_counter++;
    int32_t qo[4] = {34, 1, 2, 1}, kv[4] = {1457, 300, 400, 500}; /* alone: 136 packed rows; batch: 38 on average */
    g_force_qo = qo;
    g_force_kv = kv;
    h_rng r;
    h_rng_seed(&r, c.seed);
    att a;
    att_build(&c, &r, 4, &a);
    g_force_qo = g_force_kv = NULL;
    kva_context* ctx = h_context(c.threads);
    kva_attention_desc d;
    desc_of(&c, &d);
    int ok = 1;
    kva_plan_info info[2];
    for (int pass = 0; pass < 2 && ok; ++pass) {
        kva_plan_params pp;
        params_of(&c, &a, &pp);
        if (pass == 1) pp.batch_size = 1; /* request 0 alone: the arrays' prefix */
        size_t db = 0, hb = 0;
        kva_status st = kva_plan_workspace_size(ctx, &d, op_kva(op), &pp, &db, &hb);
        h_ws ws;
        h_ws_alloc(&ws, db, hb);
        kva_plan plan;
        if (st == KVA_OK) st = kva_plan_make(ctx, &d, op_kva(op), &pp, &ws.ws, &plan, NULL);
        kva_run_args args;
        args_of(&c, &a, &args, pass);
        if (pass == 1) {
            args.q.shape[0] = args.o.shape[0] = args.lse.shape[0] = qo[0];
            if (op == H_OP_RAGGED) args.k.shape[0] = args.v.shape[0] = kv[0];
        }
        if (st == KVA_OK) st = kva_plan_get_info(&plan, &info[pass]);
        if (st == KVA_OK) st = kva_run(ctx, &plan, &ws.ws, &args);
        H_EXPECT(ok, st == KVA_OK, "batch invariance pass %d: %s: %s", pass, ST_NAME(st), kva_last_error_message());
        h_ws_free(&ws);
    }
    if (ok) {
        h_buf_download(&a.o);
        h_buf_download(&a.o2);
        h_buf_download(&a.lse);
        h_buf_download(&a.lse2);
        size_t orow = (size_t)a.o_s0 * ref_dtype_size(c.o_dt), lrow = (size_t)a.lse_s0 * 4;
        int same = memcmp(h_buf_hp(&a.o), h_buf_hp(&a.o2), orow * (size_t)qo[0]) == 0 &&
                   memcmp(h_buf_hp(&a.lse), h_buf_hp(&a.lse2), lrow * (size_t)qo[0]) == 0;
        ok &= att_check(&c, &a, &a.o, &a.lse, 1, "batch invariance (in the batch)");
        h_logf("batch invariance: rows %lld/%lld tile_q %d / %d, partials %d / %d, same %d\n", (long long)info[0].total_qo_rows, (long long)info[1].total_qo_rows, info[0].tile_q, info[1].tile_q,
               info[0].num_partials, info[1].num_partials, same);
        H_EXPECT(ok, same, "request 0 alone (tile_q %d) and in a batch (tile_q %d) differ in the last bits", info[1].tile_q,
                 info[0].tile_q);
    }
    att_free(&a);
    char line[1024];
    h_case_format(&c, line, sizeof line);
    H_CHECK(ok, "fixed_split_size batch invariance: %s window %d split %d mask %d (case base: %s)", h_op_name(op), window,
            fixed_split, (int)mask, line);
}

/* 64-bit pool addressing: pages beyond element offset 2^32 of an e4m3 pool (the pools are lazily mapped calloc
 * memory, so only the pages used are touched). CPU only (device memory of that size is not worth it here). */
static void bigpool_case(kva_layout layout) {
    if (h_opt.backend != KVA_BACKEND_CPU) return;
    enum { H = 2, Dm = 128, ps = 16, B = 2, hq = 8 };
    const int64_t num_pages = ((int64_t)1 << 32) / (ps * H * Dm) + 4096;
    const size_t bytes = (size_t)num_pages * ps * H * Dm;
    uint8_t* kp = (uint8_t*)calloc(bytes, 1);
    uint8_t* vp = (uint8_t*)calloc(bytes, 1);
    if (!kp || !vp) {
        free(kp);
        free(vp);
        printf("bigpool: cannot map 2 x %zu bytes; skipped\n", bytes);
        ++h_nskip;
        return;
    }
    h_rng r;
    h_rng_seed(&r, 4242 + (uint64_t)layout);
    int32_t kv[B] = {70, 33}, indptr[B + 1] = {0, 5, 8}, last[B] = {6, 1};
    int32_t idx[8];
    for (int i = 0; i < 8; ++i) idx[i] = (int32_t)(num_pages - 1 - 400 * i - (int64_t)h_rng_range(&r, 0, 300));
    idx[3] = 5; /* one low page too */
    kva_paged_kv pg;
    kva_paged_kv_init(&pg, kp, vp, KVA_DTYPE_E4M3, layout, num_pages, ps, H, Dm, Dm);
    pg.indices = idx;
    double* kref = (double*)xcalloc((size_t)(70 + 33) * H * Dm, sizeof(double));
    double* vref = (double*)xcalloc((size_t)(70 + 33) * H * Dm, sizeof(double));
    int64_t off = 0;
    for (int b = 0; b < B; ++b)
        for (int64_t j = 0; j < kv[b]; ++j, ++off)
            for (int32_t h = 0; h < H; ++h)
                for (int32_t d = 0; d < Dm; ++d) {
                    int64_t page = idx[indptr[b] + j / ps], t = j % ps;
                    int64_t e = page * pg.k_stride_page + t * pg.k_stride_token + h * pg.k_stride_head + d;
                    kref[(off * H + h) * Dm + d] = 0.5 * ref_encode(KVA_DTYPE_E4M3, kp, (size_t)e, h_rng_normalish(&r));
                    vref[(off * H + h) * Dm + d] = 2.0 * ref_encode(KVA_DTYPE_E4M3, vp, (size_t)e, h_rng_normalish(&r));
                }
    h_buf q = h_buf_alloc(KVA_DTYPE_F16, (size_t)B * hq * Dm), o = h_buf_alloc(KVA_DTYPE_F32, (size_t)B * hq * Dm);
    double* qref = (double*)xcalloc((size_t)B * hq * Dm, sizeof(double));
    for (size_t i = 0; i < q.elems; ++i) qref[i] = put_rand(&q, i, &r);
    h_buf_poison(&o);
    kva_context* ctx = h_context(3);
    kva_attention_desc d;
    kva_attention_desc_init(&d, hq, H, Dm, KVA_DTYPE_F16);
    d.kv_dtype = KVA_DTYPE_E4M3;
    d.o_dtype = KVA_DTYPE_F32;
    kva_plan_params pp;
    kva_plan_params_init(&pp);
    pp.batch_size = B;
    pp.kv_indptr = indptr;
    pp.kv_last_page_len = last;
    pp.page_size = ps;
    pp.num_pages = num_pages;
    pp.kv_indices = idx;
    pp.fixed_split_size = 16;
    size_t db = 0, hb = 0;
    int ok = 1;
    kva_status st = kva_plan_workspace_size(ctx, &d, KVA_OP_BATCH_DECODE, &pp, &db, &hb);
    h_ws ws;
    h_ws_alloc(&ws, db, hb);
    kva_plan plan;
    if (st == KVA_OK) st = kva_plan_make(ctx, &d, KVA_OP_BATCH_DECODE, &pp, &ws.ws, &plan, NULL);
    kva_run_args a;
    kva_run_args_init(&a);
    a.q = kva_tensor_make(h_buf_dp(&q), KVA_DTYPE_F16, 3, B, hq, Dm, 0);
    a.o = kva_tensor_make(h_buf_dp(&o), KVA_DTYPE_F32, 3, B, hq, Dm, 0);
    a.paged = pg;
    a.k_scale = 0.5f;
    a.v_scale = 2.0f;
    if (st == KVA_OK) st = kva_run(ctx, &plan, &ws.ws, &a);
    H_EXPECT(ok, st == KVA_OK, "bigpool: %s: %s", ST_NAME(st), kva_last_error_message());
    if (st == KVA_OK) {
        ref_attn_cfg cfg;
        memset(&cfg, 0, sizeof cfg);
        cfg.num_qo_heads = hq;
        cfg.num_kv_heads = H;
        cfg.head_dim_qk = cfg.head_dim_vo = Dm;
        cfg.window_left = -1;
        double* oref = (double*)xcalloc((size_t)hq * Dm, sizeof(double));
        h_tol t = h_tol_out(KVA_DTYPE_F32, KVA_DTYPE_F16, KVA_DTYPE_E4M3);
        off = 0;
        for (int b = 0; b < B; ++b) {
            ref_attention(&cfg, 1, kv[b], qref + (size_t)b * hq * Dm, kref + off * H * Dm, vref + off * H * Dm, NULL, oref, NULL, NULL);
            off += kv[b];
            for (int i = 0; i < hq * Dm && ok; ++i) {
                double got = h_buf_get(&o, (size_t)b * hq * Dm + (size_t)i);
                H_EXPECT(ok, h_close(got, oref[i], t, 1), "bigpool: request %d element %d = %.7g, ref %.7g", b, i, got, oref[i]);
            }
        }
        free(oref);
    }
    H_CHECK(ok, "pages beyond element offset 2^32 of a %s e4m3 pool (%lld pages)", layout == KVA_LAYOUT_NHD ? "NHD" : "HND",
            (long long)num_pages);
    h_ws_free(&ws);
    h_buf_free(&q);
    h_buf_free(&o);
    free(qref);
    free(kref);
    free(vref);
    free(kp);
    free(vp);
}

static void suite_long(void) {
    bigpool_case(KVA_LAYOUT_NHD);
    bigpool_case(KVA_LAYOUT_HND);
    h_case c;
    h_case_default(&c, H_OP_DECODE);
    c.batch = 2;
    c.max_kv = 65536;
    c.hq = 8;
    c.hkv = 1;
    c.dqk = c.dvo = 128;
    go(c);
    c.page_size = 1;
    c.kv_dt = KVA_DTYPE_E4M3;
    c.k_scale = 0.5f;
    c.v_scale = 2.0f;
    c.layout = KVA_LAYOUT_HND;
    c.max_kv = 32768;
    c.graph = 1;
    go(c);
    h_case_default(&c, H_OP_PREFILL);
    c.batch = 1;
    c.max_kv = 65536;
    c.max_qo = 8;
    c.hq = 4;
    c.hkv = 1;
    c.mask = KVA_MASK_CAUSAL;
    c.q_dt = c.o_dt = c.kv_dt = KVA_DTYPE_BF16;
    c.pos = KVA_POS_ROPE_LLAMA;
    go(c);
    h_case_default(&c, H_OP_SINGLE_DECODE);
    c.max_kv = 65536;
    c.q_dt = c.kv_dt = f32_or(KVA_DTYPE_F16);
    c.o_dt = KVA_DTYPE_F32;
    c.hq = 4;
    c.hkv = 4;
    go(c);
    h_case_default(&c, H_OP_DECODE);
    c.batch = 3;
    c.max_kv = 20000;
    c.pos = KVA_POS_ALIBI; /* logits down to -slope * 20000 */
    c.hq = 16;
    c.hkv = 2;
    c.threads = 8;
    go(c);
    h_case_default(&c, H_OP_RAGGED);
    c.batch = 3;
    c.max_kv = 12000;
    c.max_qo = 16;
    c.mask = KVA_MASK_CAUSAL;
    c.window = 4000;
    go(c);
    /* pages of other multiples of 16, requests long enough for several batches of page indices per warp (the CUDA
       tensor-core decode kernel loads a warp's page indices 32 subtiles at a time where every subtile lies in one page) */
    static const int bps[] = {32, 48, 256};
    for (int i = 0; i < 3; ++i) {
        h_case_default(&c, H_OP_DECODE);
        c.batch = 3;
        c.max_kv = 12000;
        c.hq = 8;
        c.hkv = 2;
        c.dqk = c.dvo = 128;
        c.q_dt = c.kv_dt = c.o_dt = KVA_DTYPE_BF16;
        c.page_size = bps[i];
        c.layout = i == 1 ? KVA_LAYOUT_HND : KVA_LAYOUT_NHD;
        go(c);
    }
    /* equal long requests that the CUDA planner does not split: items of two page-index batches per warp on the
       8-warp plan (16 x 4200: 128 units, one worker per SM) and on the 4-warp plan (64 x 2100: 512 units); bf16 and
       fp8 KV */
    {
        static int32_t fq[64], fk[64];
        static const int fb[4] = {16, 64, 16, 64}, fl[4] = {4200, 2100, 4200, 2100};
        static const kva_dtype fkv[4] = {KVA_DTYPE_BF16, KVA_DTYPE_BF16, KVA_DTYPE_E4M3, KVA_DTYPE_E5M2};
        for (int k = 0; k < 4; ++k) {
            for (int b = 0; b < fb[k]; ++b) {
                fq[b] = 1;
                fk[b] = fl[k];
            }
            h_case_default(&c, H_OP_DECODE);
            c.batch = fb[k];
            c.max_kv = fl[k];
            c.hq = 32;
            c.hkv = 8;
            c.dqk = c.dvo = 128;
            c.q_dt = c.o_dt = KVA_DTYPE_BF16;
            c.kv_dt = fkv[k]; /* fp8 KV (with scales): its own build of the kernel */
            if (k >= 2) {
                c.k_scale = 0.75f;
                c.v_scale = 1.5f;
            }
            g_force_qo = fq;
            g_force_kv = fk;
            go(c);
            g_force_qo = g_force_kv = NULL;
        }
    }
    /* long calls of large groups (16 query heads per KV head, 1 x 64k) and of many long requests with empty ones */
    static const char* const shapes[] = {
        "op=decode B=1 kv=65536 hq=128 hkv=8 dqk=128 dvo=128 qt=bf16 kvt=bf16 ot=bf16 ps=16",
        "op=decode B=6 kv=20000 hq=32 hkv=8 dqk=128 dvo=128 qt=bf16 kvt=bf16 ot=bf16 ps=16 empty=30 lse=1",
    };
    go_strings(shapes, sizeof shapes / sizeof shapes[0]);
    /* device backends: several work items per worker (the CUDA kernels' item boundaries), with split KV and fused
       merges among them (30-60 s each on the CPU backend, whose workers have no such boundary state) */
    static const char* const many[] = {
        "op=decode B=300 kv=700 hq=32 hkv=8 dqk=128 dvo=128 qt=bf16 kvt=bf16 ot=bf16 ps=16 empty=10 lse=1",
        "op=decode B=100 kv=4000 hq=16 hkv=4 dqk=64 dvo=64 qt=f16 kvt=f16 ot=f16 ps=5 lse=1",
        "op=decode B=64 kv=2000 hq=40 hkv=8 dqk=256 dvo=256 qt=bf16 kvt=bf16 ot=f32 ps=16 layout=HND",
    };
    if (h_backend_device()) go_strings(many, sizeof many / sizeof many[0]);
    /* device backends: equal lengths of >= 256 MB whose units of 4 KV heads leave SMs idle while units of 2 fill
       7/8 or more of a 132-SM GPU (the CUDA planner then takes head groups of 2 at one CTA per SM, unsplit):
       275 and 270 MB, just above the head-group kernel's 256 MB */
    static const char* const hg2[] = {
        "op=decode B=64 kv=2100 eqkv=1 hq=32 hkv=4 dqk=128 dvo=128 qt=bf16 kvt=bf16 ot=bf16 ps=16 lse=1",
        "op=decode B=30 kv=2200 eqkv=1 hq=32 hkv=8 dqk=128 dvo=128 qt=bf16 kvt=bf16 ot=bf16 ps=16",
    };
    if (h_backend_device()) go_strings(hg2, sizeof hg2 / sizeof hg2[0]);
}

/* serving edge shapes across ops (about 16 s on 2 CPU cores): more query rows than keys under the causal mask
   (rows that see no key: o = 0, lse = -inf), fp8 KV near saturation with small scales, small-valued outputs (v scale
   0.02), 64 query heads on one KV head over pages of 2, single-key requests on pages of 1024, a batch of 95 % empty
   requests, window 0, ALiBi and RoPE with long KV; device backends run them through their own kernels */
static void suite_edge(void) {
    static const char* const cases[] = {
        "op=prefill B=4 qo=64 kv=20 lqo=100 hq=8 hkv=2 dqk=128 dvo=128 qt=bf16 kvt=bf16 ot=bf16 mask=causal ps=16 lse=1",
        "op=ragged B=3 qo=300 kv=40 lqo=100 hq=4 hkv=4 dqk=64 dvo=64 qt=f16 kvt=f16 ot=f16 mask=causal win=10 lse=1",
        "op=single_prefill qo=200 kv=9 lqo=100 hq=8 hkv=1 dqk=128 dvo=128 qt=bf16 kvt=bf16 ot=f32 mask=causal pos=rope lse=1",
        "op=prefill B=3 qo=160 kv=30 lqo=100 hq=16 hkv=2 dqk=256 dvo=256 qt=bf16 kvt=e4m3 ot=bf16 mask=causal ps=1 ks=0.5 vs=2 fsplit=16",
        "op=prefill B=4 qo=100 kv=60 lqo=100 hq=12 hkv=4 dqk=64 dvo=64 qt=f16 kvt=e5m2 ot=f16 mask=custom ps=7 layout=HND ks=0.8 vs=1.2",
        "op=decode B=4 kv=1200 hq=32 hkv=8 dqk=128 dvo=128 qt=bf16 kvt=e4m3 ot=bf16 ps=16 amp=300 ks=0.003 vs=0.004 lse=1",
        "op=decode B=4 kv=3000 hq=16 hkv=2 dqk=256 dvo=256 qt=f16 kvt=e5m2 ot=f32 ps=7 layout=HND pool=2 amp=30000 ks=3e-5 vs=4e-5",
        "op=prefill B=3 qo=128 kv=900 hq=8 hkv=2 dqk=128 dvo=128 qt=bf16 kvt=e4m3 ot=bf16 mask=causal ps=16 amp=400 ks=0.0025 vs=0.0025 lse=1",
        "op=decode B=4 kv=900 hq=16 hkv=4 dqk=128 dvo=128 qt=f16 kvt=f16 ot=f16 ps=16 ks=0.6 vs=0.02 lse=1",
        "op=prefill B=3 qo=64 kv=500 hq=8 hkv=2 dqk=64 dvo=64 qt=bf16 kvt=bf16 ot=bf16 mask=causal ps=32 ks=0.3 vs=3",
        "op=decode B=3 kv=2000 hq=64 hkv=1 dqk=128 dvo=128 qt=bf16 kvt=bf16 ot=bf16 ps=2 layout=HND pool=2",
        "op=decode B=8 kv=1 hq=32 hkv=4 dqk=128 dvo=128 qt=f16 kvt=f16 ot=f16 ps=1024 lse=1",
        "op=prefill B=8 qo=64 kv=1500 empty=100 hq=8 hkv=2 dqk=128 dvo=128 qt=bf16 kvt=bf16 ot=bf16 mask=causal graph=1 lse=1",
        "op=decode B=60 kv=20000 empty=95 hq=32 hkv=8 dqk=128 dvo=128 qt=bf16 kvt=bf16 ot=bf16 ps=16 lse=1",
        "op=ragged B=5 qo=300 kv=1200 hq=8 hkv=2 dqk=128 dvo=128 qt=bf16 kvt=bf16 ot=bf16 mask=causal win=0 lse=1",
        "op=decode B=4 kv=3000 hq=16 hkv=2 dqk=128 dvo=128 qt=f16 kvt=f16 ot=f16 ps=16 cap=5 scale=1 lse=1",
        "op=prefill B=2 qo=200 kv=8000 hq=8 hkv=1 dqk=128 dvo=128 qt=bf16 kvt=bf16 ot=f32 mask=causal pos=alibi slopes=1 lse=1",
        "op=decode B=3 kv=30000 hq=16 hkv=2 dqk=128 dvo=128 qt=bf16 kvt=bf16 ot=bf16 ps=16 pos=rope rs=8 rt=500000 lse=1",
    };
    go_strings(cases, sizeof cases / sizeof cases[0]);
}

static void suite_fuzz(void) {
    h_rng r;
    h_rng_seed(&r, h_opt.seed);
    int count = h_opt.count >= 0 ? h_opt.count : 800;
    static const h_op ops[] = {H_OP_DECODE, H_OP_DECODE, H_OP_PREFILL, H_OP_PREFILL, H_OP_RAGGED, H_OP_RAGGED,
                               H_OP_SINGLE_DECODE, H_OP_SINGLE_PREFILL, H_OP_MERGE, H_OP_MERGE_IN_PLACE,
                               H_OP_MERGE_STATES, H_OP_APPEND};
    for (int i = 0; i < count; ++i) {
        h_case c;
        h_case_random(&c, ops[h_rng_range(&r, 0, 11)], &r);
        run_case(&c);
    }
}

/* ---- self-checks of the reference (the oracle must be right before it judges) ---- */
static void suite_ref(void) {
    /* known bit patterns */
    H_CHECK(ref_decode_f16(0x3c00) == 1.0 && ref_decode_f16(0xc000) == -2.0 && ref_decode_f16(0x7bff) == 65504.0 &&
                ref_decode_f16(0x0001) == ldexp(1, -24) && ref_decode_f16(0x0400) == ldexp(1, -14) &&
                isinf(ref_decode_f16(0x7c00)) && isnan(ref_decode_f16(0x7e00)) && ref_decode_f16(0x3555) == 0.333251953125,
            "f16 decoder");
    H_CHECK(ref_decode_bf16(0x3f80) == 1.0 && ref_decode_bf16(0x4049) == 3.140625 && ref_decode_bf16(0x7f7f) == 0x1.fep127 &&
                ref_decode_bf16(0x0001) == ldexp(1, -133) && isinf(ref_decode_bf16(0xff80)) && isnan(ref_decode_bf16(0x7fc0)),
            "bf16 decoder");
    H_CHECK(ref_decode_e4m3(0x38) == 1.0 && ref_decode_e4m3(0x7e) == 448.0 && ref_decode_e4m3(0xfe) == -448.0 &&
                isnan(ref_decode_e4m3(0x7f)) && isnan(ref_decode_e4m3(0xff)) && ref_decode_e4m3(0x78) == 256.0 &&
                ref_decode_e4m3(0x01) == ldexp(1, -9) && ref_decode_e4m3(0x08) == ldexp(1, -6) && ref_decode_e4m3(0x07) == 7 * ldexp(1, -9),
            "e4m3 decoder");
    H_CHECK(ref_decode_e5m2(0x3c) == 1.0 && ref_decode_e5m2(0x7b) == 57344.0 && isinf(ref_decode_e5m2(0x7c)) &&
                isnan(ref_decode_e5m2(0x7d)) && ref_decode_e5m2(0x01) == ldexp(1, -16) && ref_decode_e5m2(0xbe) == -1.5 && ref_decode_e5m2(0xc2) == -3.0,
            "e5m2 decoder");
    /* encoders: every pattern of the 8/16-bit formats decodes and re-encodes to itself (finite values) */
    int enc_ok = 1;
    for (uint32_t u = 0; u < 65536; ++u) {
        uint16_t h = (uint16_t)u;
        unsigned char buf[4];
        double x = ref_decode_f16(h);
        if (!isnan(x)) {
            ref_encode(KVA_DTYPE_F16, buf, 0, x);
            uint16_t g;
            memcpy(&g, buf, 2);
            if (g != h) enc_ok = 0;
        }
        x = ref_decode_bf16(h);
        if (!isnan(x)) {
            ref_encode(KVA_DTYPE_BF16, buf, 0, x);
            uint16_t g;
            memcpy(&g, buf, 2);
            if (g != h) enc_ok = 0;
        }
        if (u < 256) {
            x = ref_decode_e4m3((uint8_t)u);
            if (!isnan(x)) {
                ref_encode(KVA_DTYPE_E4M3, buf, 0, x);
                if (buf[0] != u) enc_ok = 0;
            }
            x = ref_decode_e5m2((uint8_t)u);
            if (!isnan(x)) {
                ref_encode(KVA_DTYPE_E5M2, buf, 0, x);
                if (buf[0] != u) enc_ok = 0;
            }
        }
    }
    H_CHECK(enc_ok, "encoders round-trip every finite pattern");
    /* ties to even, saturation */
    H_CHECK(ref_round(KVA_DTYPE_F16, 1.0 + ldexp(1, -11)) == 1.0 && ref_round(KVA_DTYPE_F16, 1.0 + 3 * ldexp(1, -11)) == 1.0 + ldexp(1, -9) &&
                ref_round(KVA_DTYPE_E4M3, 1000.0) == 448.0 && ref_round(KVA_DTYPE_E4M3, 1.0625) == 1.0 &&
                ref_round(KVA_DTYPE_E4M3, 1.1875) == 1.25 && isinf(ref_round(KVA_DTYPE_E5M2, 1e6)) &&
                ref_round(KVA_DTYPE_BF16, 1.0 + ldexp(1, -8)) == 1.0 && ref_round(KVA_DTYPE_F32, 0.1) == (double)0.1f,
            "rounding: ties to even, e4m3 saturates");
    /* ALiBi: n = 8 gives 1/2 .. 1/256; n = 12: 8 of the 8-series then 2^-0.5, 2^-1.5, 2^-2.5, 2^-3.5 */
    int al = 1;
    for (int h = 0; h < 8; ++h) al &= ref_alibi_slope(h, 8) == ldexp(1, -(h + 1));
    for (int h = 0; h < 8; ++h) al &= ref_alibi_slope(h, 12) == ldexp(1, -(h + 1));
    for (int k = 0; k < 4; ++k) al &= fabs(ref_alibi_slope(8 + k, 12) - pow(2, -0.5 - k)) < 1e-15;
    al &= ref_alibi_slope(0, 1) == ldexp(1, -8);
    H_CHECK(al, "reference ALiBi slopes");
    /* merge: merging a split softmax equals the whole; empty states give 0/-inf */
    {
        double x[5] = {0.3, -1.2, 2.0, 0.7, -0.1}, v[5] = {1, -2, 0.5, 3, -1};
        double m = -INFINITY;
        for (int i = 0; i < 5; ++i) m = x[i] > m ? x[i] : m;
        double d = 0, o = 0;
        for (int i = 0; i < 5; ++i) d += exp(x[i] - m);
        for (int i = 0; i < 5; ++i) o += exp(x[i] - m) / d * v[i];
        double lse_all = (m + log(d)) / REF_LN2;
        double ls[2], vs2[2];
        for (int part = 0; part < 2; ++part) {
            int lo = part ? 2 : 0, hi = part ? 5 : 2;
            double mm = -INFINITY, dd = 0, oo = 0;
            for (int i = lo; i < hi; ++i) mm = x[i] > mm ? x[i] : mm;
            for (int i = lo; i < hi; ++i) dd += exp(x[i] - mm);
            for (int i = lo; i < hi; ++i) oo += exp(x[i] - mm) / dd * v[i];
            ls[part] = (mm + log(dd)) / REF_LN2;
            vs2[part] = oo;
        }
        double vo, lo;
        ref_merge(2, ls, vs2, 1, &vo, &lo);
        double e2[2] = {-INFINITY, -INFINITY}, ev[2] = {5, 7}, vo2, lo2;
        ref_merge(2, e2, ev, 1, &vo2, &lo2);
        H_CHECK(fabs(vo - o) < 1e-14 && fabs(lo - lse_all) < 1e-14 && vo2 == 0 && lo2 == -INFINITY, "reference merge");
    }
    /* attention: decode over one key returns that value and lse = x / ln 2 */
    {
        ref_attn_cfg cfg;
        memset(&cfg, 0, sizeof cfg);
        cfg.num_qo_heads = cfg.num_kv_heads = 1;
        cfg.head_dim_qk = cfg.head_dim_vo = 2;
        cfg.window_left = -1;
        double q[2] = {1, 2}, k[2] = {3, 4}, v[2] = {5, 6}, o[2], lse;
        ref_attention(&cfg, 1, 1, q, k, v, NULL, o, &lse, NULL);
        H_CHECK(o[0] == 5 && o[1] == 6 && fabs(lse - 11 / sqrt(2.0) / REF_LN2) < 1e-12, "reference single key");
        cfg.mask_mode = KVA_MASK_CUSTOM;
        uint8_t mk = 0;
        ref_attention(&cfg, 1, 1, q, k, v, &mk, o, &lse, NULL);
        H_CHECK(o[0] == 0 && o[1] == 0 && lse == -INFINITY, "reference fully masked row: o = 0, lse = -inf");
    }
    /* library ALiBi slopes against the reference formula (float rounding of the same value) */
    int lib_ok = 1;
    for (int n = 1; n <= 64; ++n) {
        float s[64];
        if (kva_alibi_slopes(n, s) != KVA_OK) {
            lib_ok = 0;
            break;
        }
        for (int h = 0; h < n; ++h)
            if (fabs((double)s[h] - ref_alibi_slope(h, n)) > 1.2e-7 * ref_alibi_slope(h, n)) {
                h_note(__FILE__, __LINE__, "kva_alibi_slopes(%d)[%d] = %.9g, ref %.9g", n, h, (double)s[h], ref_alibi_slope(h, n));
                lib_ok = 0;
            }
    }
    H_CHECK(lib_ok, "kva_alibi_slopes matches the reference formula for 1..64 heads");
}

int main(int argc, char** argv) {
    h_init(argc, argv, "test_ops");
    if (h_opt.case_str) {
        h_case c;
        char err[256];
        if (!h_case_parse(h_opt.case_str, &c, err, sizeof err)) {
            printf("bad --case: %s\n", err);
            h_nfail++;
            return h_finish();
        }
        run_case(&c);
        return h_finish();
    }
    const char* s = h_opt.suite ? h_opt.suite : "all";
    int all = strcmp(s, "all") == 0, any = 0;
#define SUITE(name, fn) \
    if (all || strcmp(s, name) == 0) { \
        fn(); \
        any = 1; \
    }
    SUITE("ref", suite_ref);
    SUITE("decode", suite_decode);
    SUITE("prefill", suite_prefill);
    SUITE("ragged", suite_ragged);
    SUITE("single", suite_single);
    SUITE("merge", suite_merge);
    SUITE("append", suite_append);
    SUITE("split", suite_split);
    SUITE("fuzz", suite_fuzz);
    SUITE("edge", suite_edge);
    if (strcmp(s, "long") == 0) {
        suite_long();
        any = 1;
    }
    if (!any) {
        printf("unknown suite '%s'\n", s);
        h_nfail++;
    }
    return h_finish();
}
