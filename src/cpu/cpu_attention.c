/* cpu_attention.c - the CPU backend's run(): validates the plan's page references, executes the work items
 * (thread t runs plan workers t, t+T, ...), then the merge tasks (shared by all threads through an atomic
 * counter). Semantics: docs/CONTRACT-NOTES.md. */
#include <math.h>
#include <string.h>

#include "cpu_internal.h"

#define LOG2E_F 1.44269504088896341f
#define KVA__ROPE_REANCHOR 512
#define KVA__CPU_DIRECT_MAX_ROWS 8

/* ---------------------------------------------------------------------------------------------- */
/* RoPE: inv_freq in double once per (dim, theta, scale); per position cos/sin by an exact anchor every
 * KVA__ROPE_REANCHOR positions and a double-precision rotation recurrence in between.              */

void kva__cpu_rope_prepare(kva__cpu_state* st, int32_t dim, float theta, float scale) {
    if (st->rope_dim == dim && st->rope_theta == theta && st->rope_scale == scale) return;
    int32_t half = dim / 2;
    for (int32_t f = 0; f < half; ++f) {
        double inv = pow((double)theta, -2.0 * (double)f / (double)dim) / (double)scale;
        st->rope_inv_freq[f] = inv;
        st->rope_step_c[f] = cos(inv);
        st->rope_step_s[f] = sin(inv);
    }
    st->rope_dim = dim;
    st->rope_theta = theta;
    st->rope_scale = scale;
}

void kva__cpu_rope_seek(const kva__cpu_state* st, kva__cpu_rope_cursor* cur, int32_t half, int64_t pos) {
    for (int32_t f = 0; f < half; ++f) {
        double a = (double)pos * st->rope_inv_freq[f];
        cur->c[f] = cos(a);
        cur->s[f] = sin(a);
    }
    cur->pos = pos;
    cur->anchor = pos;
}

void kva__cpu_rope_rows(const kva__cpu_state* st, kva__cpu_rope_cursor* cur, int32_t half, int n, float* cosr,
                        float* sinr, int ld) {
    for (int k = 0; k < n; ++k) {
        if (cur->pos - cur->anchor >= KVA__ROPE_REANCHOR) kva__cpu_rope_seek(st, cur, half, cur->pos);
        float* restrict co = cosr + (size_t)k * (size_t)ld;
        float* restrict si = sinr + (size_t)k * (size_t)ld;
        double* restrict c = cur->c;
        double* restrict s = cur->s;
        const double* restrict sc = st->rope_step_c;
        const double* restrict ss = st->rope_step_s;
        for (int32_t f = 0; f < half; ++f) {
            co[f] = (float)c[f];
            si[f] = (float)s[f];
            double cn = c[f] * sc[f] - s[f] * ss[f];
            double sn = s[f] * sc[f] + c[f] * ss[f];
            c[f] = cn;
            s[f] = sn;
        }
        cur->pos++;
    }
}

void kva__cpu_rope_apply(float* x, int32_t half, const float* c, const float* s) {
    float* restrict a = x;
    float* restrict b = x + half;
    for (int32_t f = 0; f < half; ++f) {
        float x0 = a[f], x1 = b[f];
        a[f] = x0 * c[f] - x1 * s[f];
        b[f] = x1 * c[f] + x0 * s[f];
    }
}

/* ---------------------------------------------------------------------------------------------- */
/* Run context shared (read-only, except merge_next) by the threads of one run.                    */

typedef struct run_ctx {
    const kva__plan_data* plan;
    const kva__cpu_state* st;
    const kva__cpu_kernels* kern;
    const int32_t* worker_indptr;
    const kva__request* reqs;
    const kva__work_item* items;
    const kva__merge_task* merges;
    float* partial_o;
    float* partial_lse;
    int32_t num_plan_workers;
    int32_t num_threads;
    int32_t num_merge;
    int32_t g, Dq, Dv, Dqp, Dvp, half, tile_q, num_qo_heads;
    int causal, window_left, custom, rope, alibi, sigmoid, paged, softcap_on;
    float qscale, vscale, softcap, sigmoid_bias;
    const float* alibi_slopes;
    /* q / o / lse */
    const char* q;
    int64_t qs0, qs1;
    kva_dtype qdt;
    size_t qsz;
    char* o;
    int64_t os0, os1;
    kva_dtype odt;
    size_t osz;
    float* lse;
    int64_t ls0, ls1;
    /* K / V */
    const char* kbase;
    const char* vbase;
    kva_dtype kvdt;
    size_t kvsz;
    int64_t ksp, kst, ksh, vsp, vst, vsh; /* page, token, head strides (ragged: page stride unused) */
    const int32_t* indices;
    int32_t page_size;
    const uint8_t* mask;
    atomic_int merge_next;
    /* user variant (NULL = built-in): its hooks through the shared object's row functions, its parameters */
    const kva_variant* var;
    kva__vparams vp;
} run_ctx;

/* Dim ndim - back of t, or 0 where t has no such dim. The core checks only the tensors a run uses (k and v of a
   ragged plan without tokens, or an lse that is not wanted, keep whatever rank the caller left in them): the rank is
   bounded here before it indexes shape / stride. */
static inline int has_dim(const kva_tensor* t, int back) { return t->ndim >= back && t->ndim <= KVA_MAX_DIMS; }
static inline int64_t row_stride(const kva_tensor* t) { return has_dim(t, 3) ? t->stride[t->ndim - 3] : 0; }
static inline int64_t head_stride(const kva_tensor* t) { return has_dim(t, 2) ? t->stride[t->ndim - 2] : 0; }

/* all elements finite? (bit test, vectorisable) */
static int all_finite(const float* x, size_t n) {
    uint32_t bad = 0;
    for (size_t i = 0; i < n; ++i) {
        uint32_t u;
        memcpy(&u, &x[i], 4);
        bad |= ((u & 0x7f800000u) == 0x7f800000u);
    }
    return bad == 0;
}

/* Row pointers for tokens j0 .. j0+nb-1 of request rq, KV head h. */
static void block_pointers(const run_ctx* rc, const kva__request* rq, int32_t h, int64_t j0, int nb, const char** kp,
                           const char** vp) {
    if (rc->paged) {
        const int32_t ps = rc->page_size;
        int64_t pe = rq->kv_start + j0 / ps;
        int32_t slot = (int32_t)(j0 % ps);
        const char* kh = rc->kbase + (size_t)(h * rc->ksh) * rc->kvsz;
        const char* vh = rc->vbase + (size_t)(h * rc->vsh) * rc->kvsz;
        int64_t page = rc->indices[pe];
        for (int t = 0; t < nb; ++t) {
            kp[t] = kh + (size_t)(page * rc->ksp + slot * rc->kst) * rc->kvsz;
            vp[t] = vh + (size_t)(page * rc->vsp + slot * rc->vst) * rc->kvsz;
            if (++slot == ps && t + 1 < nb) {
                slot = 0;
                page = rc->indices[++pe];
            }
        }
    } else {
        int64_t row = rq->kv_start + j0;
        for (int t = 0; t < nb; ++t, ++row) {
            kp[t] = rc->kbase + (size_t)(row * rc->kst + h * rc->ksh) * rc->kvsz;
            vp[t] = rc->vbase + (size_t)(row * rc->vst + h * rc->vsh) * rc->kvsz;
        }
    }
}

static void prefetch_rows(const char** p, int nb, size_t bytes) {
#if defined(__GNUC__) || defined(__clang__)
    for (int t = 0; t < nb; ++t)
        for (size_t b = 0; b < bytes; b += 64) __builtin_prefetch(p[t] + b, 0, 1);
#else
    (void)p;
    (void)nb;
    (void)bytes;
#endif
}

static void run_item(const run_ctx* rc, kva__cpu_scratch* sc, const kva__work_item* it) {
    const kva__cpu_kernels* kern = rc->kern;
    const kva__request* rq = &rc->reqs[it->req];
    const int g = rc->g, R = it->rows, p0 = it->row_start;
    const int32_t h = it->kv_head;
    const int64_t base = (int64_t)rq->kv_len - (int64_t)rq->qo_len;
    const int i_first = p0 / g, i_last = (p0 + R - 1) / g;
    const int Dq = rc->Dq, Dqp = rc->Dqp, Dv = rc->Dv, Dvp = rc->Dvp, half = rc->half;
    const int SB = KVA__CPU_KV_BLOCK;
    float* Q = sc->q;
    float* S = sc->s;
    float* K = sc->k;
    float* V = sc->v;
    float* acc = sc->acc;
    float* m = sc->m;
    float* dsum = sc->d;
    float* alpha = sc->alpha;

    /* ---- query tile in f32, scaled by sm_scale * k_scale, RoPE at q_pos ---- */
    if (rc->rope) {
        kva__cpu_rope_seek(rc->st, sc->rope, half, base + i_first);
        kva__cpu_rope_rows(rc->st, sc->rope, half, i_last - i_first + 1, sc->cosr, sc->sinr, half);
    }
    for (int r = 0; r < R; ++r) {
        const int p = p0 + r, i = p / g, qh = h * g + p % g;
        const char* src = rc->q + (size_t)((rq->qo_start + i) * rc->qs0 + qh * rc->qs1) * rc->qsz;
        float* qr = Q + (size_t)r * Dqp;
        if (rc->var && rc->var->cpu_query) { /* the hook sees the raw q; the scale follows */
            kern->load_row(rc->qdt, src, qr, Dq, Dqp, 1.0f);
            rc->var->cpu_query(&rc->vp, qr, Dq, it->req, qh, (int)(base + i));
            for (int d = 0; d < Dq; ++d) qr[d] *= rc->qscale;
        } else {
            kern->load_row(rc->qdt, src, qr, Dq, Dqp, rc->qscale);
        }
        if (rc->rope)
            kva__cpu_rope_apply(qr, half, sc->cosr + (size_t)(i - i_first) * half, sc->sinr + (size_t)(i - i_first) * half);
        if (rc->alibi) sc->slope[r] = rc->alibi_slopes ? rc->alibi_slopes[qh] : kva__alibi_slope(qh, rc->num_qo_heads);
        m[r] = -INFINITY;
        dsum[r] = 0.0f;
        memset(acc + (size_t)r * Dvp, 0, sizeof(float) * (size_t)Dvp);
    }

    /* ---- KV range the tile can see ---- */
    int64_t lo = it->kv_start, hi = it->kv_end;
    if (rc->causal && hi > base + i_last + 1) hi = base + i_last + 1;
    if (rc->window_left >= 0 && lo < base + i_first - rc->window_left) lo = base + i_first - rc->window_left;
    /* does every row see every key of [lo, hi)? then no per-row masking is needed */
    int need_mask = rc->custom;
    if (rc->causal && i_first != i_last) need_mask = 1;
    if (rc->window_left >= 0 && i_first != i_last) need_mask = 1;

    if (rc->rope && lo < hi) kva__cpu_rope_seek(rc->st, sc->rope, half, lo);

    /* small tiles (decode) read K/V rows straight from the cache in the products, converting in registers;
       larger tiles convert each block to f32 once and reuse it for every row */
    const int key_hook = rc->var && rc->var->cpu_key;
    const int direct_k = R <= KVA__CPU_DIRECT_MAX_ROWS && !rc->rope && !key_hook && (Dq % 8) == 0;
    const int direct_v = R <= KVA__CPU_DIRECT_MAX_ROWS && (Dv % 16) == 0;

    /* row pointers are double-buffered: block b+1's rows are computed and prefetched when block b starts */
    int cur = 0;
    if (lo < hi) {
        const int n0 = (int)(hi - lo < SB ? hi - lo : SB);
        block_pointers(rc, rq, h, lo, n0, sc->kp, sc->vp);
        prefetch_rows(sc->kp, n0, (size_t)Dq * rc->kvsz);
        prefetch_rows(sc->vp, n0, (size_t)Dv * rc->kvsz);
    }
    for (int64_t j0 = lo; j0 < hi; j0 += SB, cur ^= 1) {
        const int nb = (int)(hi - j0 < SB ? hi - j0 : SB);
        const int nbp = (nb + KVA__CPU_TOK_PAD - 1) / KVA__CPU_TOK_PAD * KVA__CPU_TOK_PAD;
        const char** kp = sc->kp + cur * SB;
        const char** vp = sc->vp + cur * SB;
        kva__cpu_prefetch pf = {{NULL, NULL}, 0, {0, 0}};
        if (j0 + SB < hi) {
            const int nn = (int)(hi - (j0 + SB) < SB ? hi - (j0 + SB) : SB);
            const char** kpn = sc->kp + (cur ^ 1) * SB;
            const char** vpn = sc->vp + (cur ^ 1) * SB;
            block_pointers(rc, rq, h, j0 + SB, nn, kpn, vpn);
            if (direct_k) { /* prefetch the next block's K and V rows while the scores run */
                pf.rows[0] = kpn;
                pf.rows[1] = vpn;
                pf.n = nn;
                pf.bytes[0] = (int)((size_t)Dq * rc->kvsz);
                pf.bytes[1] = (int)((size_t)Dv * rc->kvsz);
            } else {
                prefetch_rows(kpn, nn, (size_t)Dq * rc->kvsz);
                prefetch_rows(vpn, nn, (size_t)Dv * rc->kvsz);
            }
        }

        /* ---- scores: small tiles read K straight from the cache; otherwise K block -> f32 (RoPE) ---- */
        if (direct_k) {
            kern->scores_kv(rc->kvdt, Q, Dqp, R, kp, nb, Dq, S, SB, pf.n ? &pf : NULL);
        } else {
            if (rc->rope) kva__cpu_rope_rows(rc->st, sc->rope, half, nb, sc->cosr, sc->sinr, half);
            kern->load_rows(rc->kvdt, kp, nb, K, Dqp, Dq, Dqp);
            if (key_hook)
                for (int t = 0; t < nb; ++t) rc->var->cpu_key(&rc->vp, K + (size_t)t * Dqp, Dq, it->req, h, (int)(j0 + t));
            if (rc->rope)
                for (int t = 0; t < nb; ++t)
                    kva__cpu_rope_apply(K + (size_t)t * Dqp, half, sc->cosr + (size_t)t * half,
                                        sc->sinr + (size_t)t * half);
            if (nbp > nb) memset(K + (size_t)nb * Dqp, 0, sizeof(float) * (size_t)(nbp - nb) * Dqp);
            kern->scores(Q, Dqp, R, K, Dqp, nbp, Dqp, S, SB);
        }

        /* ---- logits transform and mask, per row ---- */
        int masked_any = 0;
        for (int r = 0; r < R; ++r) {
            float* restrict srow = S + (size_t)r * SB;
            const int i = (p0 + r) / g;
            const int64_t qpos = base + i;
            if (rc->alibi) {
                const float sl = sc->slope[r];
                const float off = (float)(j0 - qpos);
                for (int t = 0; t < nb; ++t) srow[t] += sl * (off + (float)t);
            }
            if (rc->softcap_on) kern->softcap(srow, nbp, rc->softcap);
            int64_t vlo = j0, vhi = j0 + nb;
            if (need_mask) {
                if (rc->causal && vhi > qpos + 1) vhi = qpos + 1;
                if (rc->window_left >= 0 && vlo < qpos - rc->window_left) vlo = qpos - rc->window_left;
                if (vlo > j0 + nb) vlo = j0 + nb; /* the row's window starts past this block (rows of a tall tile) */
                if (vhi < vlo) vhi = vlo;
            }
            const int tlo = (int)(vlo - j0), thi = (int)(vhi - j0);
            for (int t = 0; t < tlo; ++t) srow[t] = -INFINITY;
            for (int t = thi; t < nbp; ++t) srow[t] = -INFINITY;
            if (tlo > 0 || thi < nb) masked_any = 1;
            if (rc->custom) {
                const uint8_t* mk = rc->mask + rq->mask_offset;
                int64_t bit = (int64_t)i * rq->kv_len + vlo;
                for (int t = tlo; t < thi; ++t, ++bit) {
                    if (!((mk[bit >> 3] >> (bit & 7)) & 1)) {
                        srow[t] = -INFINITY;
                        masked_any = 1;
                    }
                }
            }
            /* variant: mask hook and logits transform on the visible keys (no softmax: masked keys get weight 0) */
            if (rc->var && rc->var->cpu_logits) {
                const int qh = h * g + (p0 + r) % g;
                if (rc->var->cpu_logits(&rc->vp, srow, nbp, it->req, qh, h, (int)qpos, (int)j0)) masked_any = 1;
            }
        }

        /* ---- softmax (online) or sigmoid ---- */
        if (rc->sigmoid) {
            if (!rc->var) /* a no-softmax variant's row function already wrote the weights */
                for (int r = 0; r < R; ++r) kern->sigmoid(S + (size_t)r * SB, nbp, rc->sigmoid_bias);
        } else {
            for (int r = 0; r < R; ++r) {
                float* srow = S + (size_t)r * SB;
                float bm = kern->row_max(srow, nbp);
                if (bm == -INFINITY) { /* nothing visible in this block for this row */
                    memset(srow, 0, sizeof(float) * (size_t)nbp);
                    alpha[r] = 1.0f;
                    continue;
                }
                float mo = m[r], mn = mo > bm ? mo : bm;
                alpha[r] = mo == -INFINITY ? 0.0f : expf(mo - mn);
                float s = kern->exp_sum(srow, nbp, mn);
                dsum[r] = dsum[r] * alpha[r] + s;
                m[r] = mn;
            }
        }

        /* ---- P V ---- */
        if (direct_v && !masked_any) {
            kern->pv_kv(rc->kvdt, S, SB, R, vp, nb, Dv, acc, Dvp, rc->sigmoid ? NULL : alpha);
        } else {
            kern->load_rows(rc->kvdt, vp, nb, V, Dvp, Dv, Dvp);
            if (nbp > nb) memset(V + (size_t)nb * Dvp, 0, sizeof(float) * (size_t)(nbp - nb) * Dvp);
            /* a masked key's value must not reach the accumulators: with a non-finite V row in a block that has
               masked entries use the generic kernel, which skips zero probabilities */
            const kva__cpu_kernels* pvk = kern;
            if (masked_any && !all_finite(V, (size_t)nb * Dvp)) pvk = &kva__cpu_kernels_generic;
            pvk->pv(S, SB, R, V, Dvp, nbp, Dvp, acc, Dvp, rc->sigmoid ? NULL : alpha);
        }
    }

    /* ---- write o/lse or the partial slot ---- */
    for (int r = 0; r < R; ++r) {
        const int p = p0 + r, i = p / g, qh = h * g + p % g;
        const float* ar = acc + (size_t)r * Dvp;
        float scale, lse;
        int empty = 0;
        if (rc->sigmoid) {
            scale = rc->vscale;
            lse = -INFINITY;
        } else if (dsum[r] > 0.0f) {
            scale = rc->vscale / dsum[r];
            lse = m[r] * LOG2E_F + log2f(dsum[r]);
        } else {
            scale = 0.0f;
            lse = -INFINITY;
            empty = 1;
        }
        if (it->partial >= 0) {
            float* po = rc->partial_o + ((size_t)it->partial * (size_t)rc->tile_q + (size_t)r) * (size_t)Dv;
            if (empty) memset(po, 0, sizeof(float) * (size_t)Dv);
            else kern->store_row(KVA_DTYPE_F32, ar, po, Dv, scale);
            rc->partial_lse[(size_t)it->partial * (size_t)rc->tile_q + (size_t)r] = lse;
        } else {
            char* dst = rc->o + (size_t)((rq->qo_start + i) * rc->os0 + qh * rc->os1) * rc->osz;
            if (rc->var && rc->var->cpu_output) { /* the hook sees the final o and lse */
                float* tmp = sc->tmp;
                for (int d = 0; d < Dv; ++d) tmp[d] = empty ? 0.0f : ar[d] * scale;
                rc->var->cpu_output(&rc->vp, tmp, Dv, lse, it->req, qh, (int)(base + i));
                kern->store_row(rc->odt, tmp, dst, Dv, 1.0f);
            } else if (empty) {
                memset(dst, 0, (size_t)Dv * rc->osz);
            } else {
                kern->store_row(rc->odt, ar, dst, Dv, scale);
            }
            if (rc->lse && !rc->sigmoid) rc->lse[(rq->qo_start + i) * rc->ls0 + qh * rc->ls1] = lse;
        }
    }
}

static void run_merge_task(const run_ctx* rc, kva__cpu_scratch* sc, const kva__merge_task* mt) {
    const kva__request* rq = &rc->reqs[mt->req];
    const int g = rc->g, Dv = rc->Dv, tq = rc->tile_q;
    float* accr = sc->tmp;
    for (int r = 0; r < mt->rows; ++r) {
        const int p = mt->row_start + r, i = p / g, qh = mt->kv_head * g + p % g;
        char* dst = rc->o + (size_t)((rq->qo_start + i) * rc->os0 + qh * rc->os1) * rc->osz;
        for (int d = 0; d < Dv; ++d) accr[d] = 0.0f;
        if (rc->sigmoid) {
            for (int k = 0; k < mt->num_partials; ++k) {
                const float* po = rc->partial_o + ((size_t)(mt->partial_first + k) * tq + (size_t)r) * (size_t)Dv;
                for (int d = 0; d < Dv; ++d) accr[d] += po[d];
            }
            if (rc->var && rc->var->cpu_output)
                rc->var->cpu_output(&rc->vp, accr, Dv, -INFINITY, mt->req, qh, rq->kv_len - rq->qo_len + i);
            rc->kern->store_row(rc->odt, accr, dst, Dv, 1.0f);
            continue;
        }
        float M = -INFINITY;
        for (int k = 0; k < mt->num_partials; ++k) {
            float l = rc->partial_lse[(size_t)(mt->partial_first + k) * tq + (size_t)r];
            M = l > M ? l : M;
        }
        float lse;
        if (rc->var && rc->var->cpu_output) { /* the hook sees the merged o and lse */
            float wsum = 0.0f;
            if (M != -INFINITY)
                for (int k = 0; k < mt->num_partials; ++k) {
                    float l = rc->partial_lse[(size_t)(mt->partial_first + k) * tq + (size_t)r];
                    if (l == -INFINITY) continue;
                    float w = exp2f(l - M);
                    wsum += w;
                    const float* po = rc->partial_o + ((size_t)(mt->partial_first + k) * tq + (size_t)r) * (size_t)Dv;
                    for (int d = 0; d < Dv; ++d) accr[d] += w * po[d];
                }
            const float inv = wsum > 0.0f ? 1.0f / wsum : 0.0f;
            for (int d = 0; d < Dv; ++d) accr[d] *= inv;
            lse = wsum > 0.0f ? M + log2f(wsum) : -INFINITY;
            rc->var->cpu_output(&rc->vp, accr, Dv, lse, mt->req, qh, rq->kv_len - rq->qo_len + i);
            rc->kern->store_row(rc->odt, accr, dst, Dv, 1.0f);
        } else if (M == -INFINITY) {
            memset(dst, 0, (size_t)Dv * rc->osz);
            lse = -INFINITY;
        } else {
            float wsum = 0.0f;
            for (int k = 0; k < mt->num_partials; ++k) {
                float l = rc->partial_lse[(size_t)(mt->partial_first + k) * tq + (size_t)r];
                if (l == -INFINITY) continue;
                float w = exp2f(l - M);
                wsum += w;
                const float* po = rc->partial_o + ((size_t)(mt->partial_first + k) * tq + (size_t)r) * (size_t)Dv;
                for (int d = 0; d < Dv; ++d) accr[d] += w * po[d];
            }
            rc->kern->store_row(rc->odt, accr, dst, Dv, 1.0f / wsum);
            lse = M + log2f(wsum);
        }
        if (rc->lse) rc->lse[(rq->qo_start + i) * rc->ls0 + qh * rc->ls1] = lse;
    }
}

static void items_job(void* arg, int tid) {
    run_ctx* rc = (run_ctx*)arg;
    kva__cpu_scratch* sc = &rc->st->scratch[tid];
    for (int32_t w = tid; w < rc->num_plan_workers; w += rc->num_threads)
        for (int32_t k = rc->worker_indptr[w]; k < rc->worker_indptr[w + 1]; ++k) run_item(rc, sc, &rc->items[k]);
}

static void merge_job(void* arg, int tid) {
    run_ctx* rc = (run_ctx*)arg;
    kva__cpu_scratch* sc = &rc->st->scratch[tid];
    for (;;) {
        int k = atomic_fetch_add_explicit(&rc->merge_next, 1, memory_order_relaxed);
        if (k >= rc->num_merge) break;
        run_merge_task(rc, sc, &rc->merges[k]);
    }
}

/* ---------------------------------------------------------------------------------------------- */
/* Validation of the work list against the run arguments (before anything is written).             */

#define PLAN_BAD(...) kva__set_error(KVA_ERR_PLAN_MISMATCH, __VA_ARGS__)

static kva_status validate(const kva__plan_data* plan, const void* wsd, const kva_run_args* args, int paged,
                           int32_t* out_items, int32_t* out_merge) {
    const kva__counts* c = kva__ws_counts(plan, wsd);
    const int32_t B = c->batch_size, W = plan->num_workers;
    const int32_t g = plan->group_size;
    const int32_t tq = plan->tile_q;
    const int64_t q_rows = has_dim(&args->q, 3) ? args->q.shape[args->q.ndim - 3] : 1;
    const int64_t o_rows = has_dim(&args->o, 3) ? args->o.shape[args->o.ndim - 3] : 1;
    if (B < 0 || (plan->max_batch_size > 0 && B > plan->max_batch_size) || c->num_items < 0 ||
        c->num_items > plan->cap_items || c->num_merge < 0 || c->num_merge > plan->cap_merge ||
        c->num_partials < 0 || c->num_partials > plan->cap_partials || W < 1)
        return PLAN_BAD("CPU run: the workspace does not hold this plan's work list (counts: batch %d, items %d, "
                        "merge tasks %d, partials %d); was it overwritten or planned again?",
                        (int)B, (int)c->num_items, (int)c->num_merge, (int)c->num_partials);
    if (tq < 1 || tq > KVA__MAX_TILE_Q || g < 1)
        return PLAN_BAD("CPU run: plan tile_q %d / group size %d out of range", (int)tq, (int)g);
    const int32_t* wi = kva__ws_worker_indptr(plan, wsd);
    if (wi[0] != 0 || wi[W] != c->num_items)
        return PLAN_BAD("CPU run: worker_indptr[0] = %d, worker_indptr[%d] = %d, expected 0 and %d items", (int)wi[0],
                        (int)W, (int)wi[W], (int)c->num_items);
    for (int32_t w = 0; w < W; ++w)
        if (wi[w + 1] < wi[w])
            return PLAN_BAD("CPU run: worker_indptr not monotonic at worker %d (%d > %d)", (int)w, (int)wi[w],
                            (int)wi[w + 1]);

    const kva__request* rq = kva__ws_requests(plan, wsd);
    const int custom = plan->desc.mask_mode == KVA_MASK_CUSTOM;
    for (int32_t r = 0; r < B; ++r) {
        const kva__request* x = &rq[r];
        if (x->qo_start < 0 || x->qo_len < 0 || x->kv_len < 0 || x->kv_start < 0 ||
            (int64_t)x->qo_start + x->qo_len > q_rows || (int64_t)x->qo_start + x->qo_len > o_rows)
            return PLAN_BAD("CPU run: request %d of the work list (qo_start %d, qo_len %d, kv_len %d) does not fit "
                            "q/o with %lld rows",
                            (int)r, (int)x->qo_start, (int)x->qo_len, (int)x->kv_len, (long long)q_rows);
        if (custom) {
            int64_t need = ((int64_t)x->qo_len * x->kv_len + 7) / 8;
            if (x->mask_offset < 0 || x->mask_offset + need > args->custom_mask_bytes)
                return PLAN_BAD("CPU run: request %d's custom mask segment [%lld, %lld) exceeds custom_mask_bytes %lld",
                                (int)r, (long long)x->mask_offset, (long long)(x->mask_offset + need),
                                (long long)args->custom_mask_bytes);
        }
        if (paged) {
            const int64_t ps = args->paged.page_size;
            const int64_t np = kva__ceil_div64(x->kv_len, ps);
            if (np > 0 && plan->num_page_entries > 0 && (int64_t)x->kv_start + np > plan->num_page_entries)
                return PLAN_BAD("CPU run: request %d uses page-table entries [%d, %lld) beyond the plan's %lld entries",
                                (int)r, (int)x->kv_start, (long long)(x->kv_start + np),
                                (long long)plan->num_page_entries);
            const int32_t* ind = args->paged.indices;
            if (np > 0 && !ind)
                return PLAN_BAD("CPU run: request %d of the work list has %lld pages but paged.indices is NULL (the "
                                "workspace holds a later plan?)", (int)r, (long long)np);
            if (np > 0 && args->paged.num_indices > 0 && (int64_t)x->kv_start + np > args->paged.num_indices)
                return PLAN_BAD("CPU run: request %d uses page-table entries [%d, %lld) beyond paged.num_indices %lld",
                                (int)r, (int)x->kv_start, (long long)(x->kv_start + np),
                                (long long)args->paged.num_indices);
            for (int64_t e = 0; e < np; ++e) {
                int32_t pg = ind[x->kv_start + e];
                if (pg < 0 || pg >= args->paged.num_pages)
                    return kva__set_error(KVA_ERR_PAGE_INDEX_OUT_OF_RANGE,
                                          "CPU run: request %d: page table entry %lld (position %lld of the request) "
                                          "holds page index %d, outside the pool [0, %lld)",
                                          (int)r, (long long)(x->kv_start + e), (long long)e, (int)pg,
                                          (long long)args->paged.num_pages);
            }
        } else {
            const int64_t kv_rows = has_dim(&args->k, 3) ? args->k.shape[args->k.ndim - 3] : 0;
            const int64_t v_rows = has_dim(&args->v, 3) ? args->v.shape[args->v.ndim - 3] : 0;
            if ((int64_t)x->kv_start + x->kv_len > kv_rows || (int64_t)x->kv_start + x->kv_len > v_rows)
                return PLAN_BAD("CPU run: request %d's K/V rows [%d, %lld) exceed k/v with %lld/%lld rows", (int)r,
                                (int)x->kv_start, (long long)x->kv_start + x->kv_len, (long long)kv_rows,
                                (long long)v_rows);
        }
    }

    const kva__work_item* it = kva__ws_items(plan, wsd);
    const int32_t Hkv = plan->desc.num_kv_heads;
    for (int32_t k = 0; k < c->num_items; ++k) {
        const kva__work_item* x = &it[k];
        if (x->req < 0 || x->req >= B || x->kv_head < 0 || x->kv_head >= Hkv || x->rows < 1 || x->rows > tq ||
            x->row_start < 0 || (int64_t)x->row_start + x->rows > (int64_t)rq[x->req].qo_len * g || x->kv_start < 0 ||
            x->kv_end < x->kv_start || x->kv_end > rq[x->req].kv_len || x->partial >= c->num_partials)
            return PLAN_BAD("CPU run: work item %d (req %d, kv_head %d, rows %d+%d, kv %d..%d, partial %d) is "
                            "inconsistent with the plan",
                            (int)k, (int)x->req, (int)x->kv_head, (int)x->row_start, (int)x->rows, (int)x->kv_start,
                            (int)x->kv_end, (int)x->partial);
    }
    const kva__merge_task* mt = kva__ws_merge(plan, wsd);
    for (int32_t k = 0; k < c->num_merge; ++k) {
        const kva__merge_task* x = &mt[k];
        if (x->req < 0 || x->req >= B || x->kv_head < 0 || x->kv_head >= Hkv || x->rows < 1 || x->rows > tq ||
            x->row_start < 0 || (int64_t)x->row_start + x->rows > (int64_t)rq[x->req].qo_len * g ||
            x->partial_first < 0 || x->num_partials < 0 ||
            (int64_t)x->partial_first + x->num_partials > c->num_partials)
            return PLAN_BAD("CPU run: merge task %d (req %d, kv_head %d, rows %d+%d, partials %d+%d) is inconsistent "
                            "with the plan",
                            (int)k, (int)x->req, (int)x->kv_head, (int)x->row_start, (int)x->rows,
                            (int)x->partial_first, (int)x->num_partials);
    }
    *out_items = c->num_items;
    *out_merge = c->num_merge;
    return KVA_OK;
}

kva_status kva__cpu_run(kva_context* ctx, const kva__plan_data* plan, const kva_workspace* ws,
                        const kva_run_args* args) {
    kva__cpu_state* st = (kva__cpu_state*)ctx->backend_state;
    KVA_RETURN_IF(!st, KVA_ERR_INTERNAL, "CPU run: backend not initialised");
    KVA_RETURN_IF(!ws || !ws->device, KVA_ERR_INVALID_ARGUMENT, "CPU run: workspace->device is NULL");
    const kva_attention_desc* d = &plan->desc;
    const int paged = plan->op != KVA_OP_BATCH_PREFILL_RAGGED;
    KVA_RETURN_IF(d->head_dim_qk < 1 || d->head_dim_qk > KVA__CPU_MAX_DIM || d->head_dim_vo < 1 ||
                      d->head_dim_vo > KVA__CPU_MAX_DIM,
                  KVA_ERR_UNSUPPORTED, "CPU run: head dims %d/%d outside [1, %d]", (int)d->head_dim_qk,
                  (int)d->head_dim_vo, KVA__CPU_MAX_DIM);
    KVA_RETURN_IF(paged && args->paged.page_size < 1, KVA_ERR_INVALID_ARGUMENT, "CPU run: paged.page_size = %d",
                  (int)args->paged.page_size);
    KVA_RETURN_IF(paged && plan->num_page_entries > 0 && !args->paged.indices, KVA_ERR_INVALID_ARGUMENT,
                  "CPU run: paged.indices is NULL");
    KVA_RETURN_IF(d->mask_mode == KVA_MASK_CUSTOM && plan->custom_mask_bytes > 0 && !args->custom_mask,
                  KVA_ERR_INVALID_ARGUMENT, "CPU run: custom mask mode but args->custom_mask is NULL");

    pthread_mutex_lock(&st->call_mu);
    int32_t num_items = 0, num_merge = 0;
    kva_status stt = validate(plan, ws->device, args, paged, &num_items, &num_merge);
    if (stt != KVA_OK) {
        pthread_mutex_unlock(&st->call_mu);
        return stt;
    }

    run_ctx rc;
    memset(&rc, 0, sizeof(rc));
    rc.plan = plan;
    rc.st = st;
    rc.kern = st->kern;
    rc.worker_indptr = kva__ws_worker_indptr(plan, ws->device);
    rc.reqs = kva__ws_requests(plan, ws->device);
    rc.items = kva__ws_items(plan, ws->device);
    rc.merges = kva__ws_merge(plan, ws->device);
    rc.partial_o = kva__ws_partial_o(plan, ws);
    rc.partial_lse = kva__ws_partial_lse(plan, ws);
    rc.num_plan_workers = plan->num_workers;
    rc.num_merge = num_merge;
    rc.g = plan->group_size;
    rc.Dq = d->head_dim_qk;
    rc.Dv = d->head_dim_vo;
    rc.Dqp = (rc.Dq + KVA__CPU_DIM_PAD - 1) / KVA__CPU_DIM_PAD * KVA__CPU_DIM_PAD;
    rc.Dvp = (rc.Dv + KVA__CPU_DIM_PAD - 1) / KVA__CPU_DIM_PAD * KVA__CPU_DIM_PAD;
    rc.half = rc.Dq / 2;
    rc.tile_q = plan->tile_q;
    rc.num_qo_heads = d->num_qo_heads;
    rc.causal = d->mask_mode == KVA_MASK_CAUSAL;
    rc.custom = d->mask_mode == KVA_MASK_CUSTOM;
    rc.window_left = d->window_left;
    rc.rope = d->pos_encoding == KVA_POS_ROPE_LLAMA;
    rc.alibi = d->pos_encoding == KVA_POS_ALIBI;
    rc.sigmoid = d->score_mode == KVA_SCORE_SIGMOID;
    if (d->variant) {
        rc.var = d->variant;
        rc.sigmoid = !d->variant->use_softmax; /* no softmax: plain weighted sum, no lse (as sigmoid mode) */
        stt = kva__variant_check_args(ctx, d, plan->variant_id, args, &rc.vp);
        if (stt != KVA_OK) {
            pthread_mutex_unlock(&st->call_mu);
            return stt;
        }
    }
    rc.softcap_on = d->logits_soft_cap > 0.0f;
    rc.softcap = d->logits_soft_cap;
    rc.sigmoid_bias = d->sigmoid_bias;
    rc.paged = paged;
    float sm_scale = d->sm_scale != 0.0f ? d->sm_scale : 1.0f / sqrtf((float)d->head_dim_qk);
    rc.qscale = sm_scale * args->k_scale; /* scales apply to every KV dtype (FlashInfer semantics) */
    rc.vscale = args->v_scale;
    rc.alibi_slopes = args->alibi_slopes;
    rc.q = (const char*)args->q.data;
    rc.qs0 = row_stride(&args->q);
    rc.qs1 = head_stride(&args->q);
    rc.qdt = args->q.dtype;
    rc.qsz = kva__cpu_dtype_size(args->q.dtype);
    rc.o = (char*)args->o.data;
    rc.os0 = row_stride(&args->o);
    rc.os1 = head_stride(&args->o);
    rc.odt = args->o.dtype;
    rc.osz = kva__cpu_dtype_size(args->o.dtype);
    rc.lse = (float*)args->lse.data;
    rc.ls0 = has_dim(&args->lse, 2) ? args->lse.stride[args->lse.ndim - 2] : 0;
    rc.ls1 = has_dim(&args->lse, 1) ? args->lse.stride[args->lse.ndim - 1] : 1;
    if (args->lse.ndim == 1) { /* [heads] for a single row */
        rc.ls0 = 0;
        rc.ls1 = args->lse.stride[0];
    }
    if (paged) {
        rc.kbase = (const char*)args->paged.k_data;
        rc.vbase = (const char*)args->paged.v_data;
        rc.kvdt = args->paged.dtype;
        rc.ksp = args->paged.k_stride_page;
        rc.kst = args->paged.k_stride_token;
        rc.ksh = args->paged.k_stride_head;
        rc.vsp = args->paged.v_stride_page;
        rc.vst = args->paged.v_stride_token;
        rc.vsh = args->paged.v_stride_head;
        rc.indices = args->paged.indices;
        rc.page_size = args->paged.page_size;
    } else {
        rc.kbase = (const char*)args->k.data;
        rc.vbase = (const char*)args->v.data;
        rc.kvdt = d->kv_dtype; /* = k.dtype where the run has KV tokens; without any, k and v are not checked (nor read) */
        rc.kst = row_stride(&args->k);
        rc.ksh = head_stride(&args->k);
        rc.vst = row_stride(&args->v);
        rc.vsh = head_stride(&args->v);
    }
    rc.kvsz = kva__cpu_dtype_size(rc.kvdt);
    rc.mask = args->custom_mask;
    atomic_init(&rc.merge_next, 0);
    if (rc.rope) kva__cpu_rope_prepare(st, rc.Dq, d->rope_theta, d->rope_scale);
    if (rc.qsz == 0 || rc.osz == 0 || rc.kvsz == 0) {
        pthread_mutex_unlock(&st->call_mu);
        return kva__set_error(KVA_ERR_INVALID_ARGUMENT, "CPU run: unsupported q/o/kv dtype (%d/%d/%d)", (int)rc.qdt,
                              (int)rc.odt, (int)rc.kvdt);
    }

    int nt = st->num_threads < rc.num_plan_workers ? st->num_threads : rc.num_plan_workers;
    rc.num_threads = nt;
    if (num_items > 0) kva__cpu_pool_run(st->pool, nt, items_job, &rc);
    if (num_merge > 0) {
        int mt = st->num_threads < num_merge ? st->num_threads : num_merge;
        kva__cpu_pool_run(st->pool, mt, merge_job, &rc);
    }
    pthread_mutex_unlock(&st->call_mu);
    return KVA_OK;
}
