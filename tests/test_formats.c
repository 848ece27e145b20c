/*
 * test_formats.c - composable formats (src/core/formats.c): block-sparse (BSR) attention and multi-level cascade
 * attention against a float64 reference written here:
 *   - BSR == dense attention over [M, N] with the block mask (and the element mask, dense causal, window);
 *   - cascade == flat attention of each request over the concatenation of its KV at every level.
 * Every case is one printable line (seeded); a failure prints it, and
 *   test_formats --case "<line>"
 * replays it. Outputs are NaN-poisoned and guarded; tolerances come from the harness table per dtype.
 * Suites: --suite bsr | vbsr | cascade | errors | fuzz (--seed, --count) | all (default).
 */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "harness.h"

/* ---------------------------------------------------------------------------------------------- */
/* Cases                                                                                           */

typedef enum { F_BSR = 0, F_CASCADE = 1, F_VBSR = 2 } f_op;

typedef struct f_case {
    f_op op;
    /* BSR */
    int64_t M, N;
    int32_t R, C;
    int32_t density; /* percent of listed blocks */
    int32_t emask;   /* element mask */
    int32_t kpad;    /* extra elements per K/V row (row stride > heads * dim) */
    int32_t mb, nb;  /* vbsr: block rows / columns per head (random sizes, some zero) */
    /* cascade */
    int32_t levels, batch, append, ps, hnd, maxkv, maxqo, graph, empty;
    /* common */
    int32_t hq, hkv, dqk, dvo;
    kva_dtype qdt, kvdt, odt;
    int32_t causal, window;
    float cap;
    int32_t lse;
    int32_t threads;
    uint64_t seed;
} f_case;

static void f_default(f_case* c, f_op op) {
    memset(c, 0, sizeof *c);
    c->op = op;
    c->M = 40;
    c->N = 48;
    c->R = 3;
    c->C = 16;
    c->density = 50;
    c->mb = 4;
    c->nb = 5;
    c->levels = 2;
    c->batch = 5;
    c->ps = 16;
    c->maxkv = 40;
    c->maxqo = 6;
    c->hq = 4;
    c->hkv = 2;
    c->dqk = 16;
    c->dvo = 16;
    c->qdt = c->kvdt = c->odt = KVA_DTYPE_F32;
    c->window = -1;
    c->lse = 1;
    c->threads = 3;
    c->seed = 1;
}

static char* f_format(const f_case* c, char* buf, size_t n) {
    int k;
    if (c->op == F_BSR)
        k = snprintf(buf, n, "bsr M=%lld N=%lld R=%d C=%d density=%d emask=%d kpad=%d graph=%d", (long long)c->M,
                     (long long)c->N, (int)c->R, (int)c->C, (int)c->density, (int)c->emask, (int)c->kpad,
                     (int)c->graph);
    else if (c->op == F_VBSR)
        k = snprintf(buf, n, "vbsr M=%lld N=%lld mb=%d nb=%d density=%d kpad=%d hnd=%d", (long long)c->M,
                     (long long)c->N, (int)c->mb, (int)c->nb, (int)c->density, (int)c->kpad, (int)c->hnd);
    else
        k = snprintf(buf, n, "cascade levels=%d batch=%d append=%d ps=%d hnd=%d maxkv=%d maxqo=%d graph=%d empty=%d",
                     (int)c->levels, (int)c->batch, (int)c->append, (int)c->ps, (int)c->hnd, (int)c->maxkv,
                     (int)c->maxqo, (int)c->graph, (int)c->empty);
    snprintf(buf + k, n - (size_t)k,
             " hq=%d hkv=%d dqk=%d dvo=%d q=%s kv=%s o=%s causal=%d window=%d cap=%g lse=%d threads=%d seed=%llu",
             (int)c->hq, (int)c->hkv, (int)c->dqk, (int)c->dvo, h_dtype_str(c->qdt), h_dtype_str(c->kvdt),
             h_dtype_str(c->odt), (int)c->causal, (int)c->window, (double)c->cap, (int)c->lse, (int)c->threads,
             (unsigned long long)c->seed);
    return buf;
}

static int f_parse(const char* s, f_case* c) {
    char tok[128];
    int first = 1;
    while (*s) {
        while (*s == ' ') ++s;
        if (!*s) break;
        size_t n = strcspn(s, " ");
        if (n >= sizeof tok) return 0;
        memcpy(tok, s, n);
        tok[n] = 0;
        s += n;
        if (first) {
            first = 0;
            if (strcmp(tok, "bsr") == 0) f_default(c, F_BSR);
            else if (strcmp(tok, "vbsr") == 0) f_default(c, F_VBSR);
            else if (strcmp(tok, "cascade") == 0) f_default(c, F_CASCADE);
            else return 0;
            continue;
        }
        char* eq = strchr(tok, '=');
        if (!eq) return 0;
        *eq = 0;
        const char* key = tok;
        const char* val = eq + 1;
        long long iv = strtoll(val, NULL, 0);
#define F_INT(name, field) else if (strcmp(key, name) == 0) c->field = iv
#define F_DT(name, field) else if (strcmp(key, name) == 0) { if (!h_dtype_parse(val, &c->field)) return 0; }
        if (0) {
        }
        F_INT("M", M); F_INT("N", N); F_INT("R", R); F_INT("C", C); F_INT("density", density); F_INT("emask", emask);
        F_INT("kpad", kpad); F_INT("mb", mb); F_INT("nb", nb); F_INT("levels", levels); F_INT("batch", batch); F_INT("append", append); F_INT("ps", ps);
        F_INT("hnd", hnd); F_INT("maxkv", maxkv); F_INT("maxqo", maxqo); F_INT("graph", graph); F_INT("empty", empty);
        F_INT("hq", hq); F_INT("hkv", hkv); F_INT("dqk", dqk); F_INT("dvo", dvo); F_INT("causal", causal);
        F_INT("window", window); F_INT("lse", lse); F_INT("threads", threads);
        F_DT("q", qdt) F_DT("kv", kvdt) F_DT("o", odt)
        else if (strcmp(key, "cap") == 0) c->cap = (float)atof(val);
        else if (strcmp(key, "seed") == 0) c->seed = strtoull(val, NULL, 0);
        else return 0;
#undef F_INT
#undef F_DT
    }
    return !first;
}

/* ---------------------------------------------------------------------------------------------- */
/* float64 reference: one query row of one head against a list of keys (already visible)          */

typedef struct f_ref_row {
    double lse; /* base 2, -inf when no key */
    double mag; /* sum_j w_j |v_j| scale of the output (max over d) */
} f_ref_row;

/* q [dqk], keys[n] -> pointers into doubles (k rows [dqk], v rows [dvo]). o [dvo]. */
static f_ref_row f_ref_attend(const double* q, int64_t n, const double* const* ks, const double* const* vs, int dqk,
                              int dvo, double scale, double cap, double* o) {
    f_ref_row res = {-INFINITY, 0.0};
    for (int d = 0; d < dvo; ++d) o[d] = 0.0;
    if (n == 0) return res;
    double* x = (double*)malloc(sizeof(double) * (size_t)n);
    double m = -INFINITY;
    for (int64_t j = 0; j < n; ++j) {
        double s = 0.0;
        for (int d = 0; d < dqk; ++d) s += q[d] * ks[j][d];
        s *= scale;
        if (cap > 0) s = cap * tanh(s / cap);
        x[j] = s;
        if (s > m) m = s;
    }
    double den = 0.0;
    for (int64_t j = 0; j < n; ++j) {
        x[j] = exp(x[j] - m);
        den += x[j];
    }
    double mag = 0.0;
    for (int d = 0; d < dvo; ++d) {
        double acc = 0.0, am = 0.0;
        for (int64_t j = 0; j < n; ++j) {
            acc += x[j] * vs[j][d];
            am += x[j] * fabs(vs[j][d]);
        }
        o[d] = acc / den;
        if (am / den > mag) mag = am / den;
    }
    res.lse = (m + log(den)) / REF_LN2;
    res.mag = mag;
    free(x);
    return res;
}

/* Compare o [rows, hq, dvo] and lse [rows, hq] (host mirrors) with the reference. */
typedef struct f_cmp {
    int ok;
    int64_t bad;
    double worst;
} f_cmp;

static void f_compare(f_cmp* r, const h_buf* o, const h_buf* lse, int64_t rows, int hq, int dvo, const double* ro,
                      const double* rl, const double* rmag, h_tol tol, int want_lse, const char* what) {
    for (int64_t i = 0; i < rows; ++i)
        for (int h = 0; h < hq; ++h) {
            const int64_t rh = i * hq + h;
            for (int d = 0; d < dvo; ++d) {
                double got = h_buf_get(o, (size_t)(rh * dvo + d)), want = ro[rh * dvo + d];
                if (!h_close(got, want, tol, rmag[rh])) {
                    if (r->bad++ < 4)
                        h_note(__FILE__, __LINE__, "%s: o[%lld, %d, %d] = %.7g, reference %.7g", what, (long long)i, h,
                               d, got, want);
                    r->ok = 0;
                }
            }
            if (want_lse) {
                double got = h_buf_get(lse, (size_t)rh), want = rl[rh];
                if (!h_close(got, want, h_tol_lse(), 1.0)) {
                    if (r->bad++ < 4)
                        h_note(__FILE__, __LINE__, "%s: lse[%lld, %d] = %.7g, reference %.7g", what, (long long)i, h,
                               got, want);
                    r->ok = 0;
                }
            }
        }
}

static void f_fill(h_buf* b, h_rng* r) {
    for (size_t i = 0; i < b->elems; ++i) h_buf_set(b, i, h_rng_normalish(r));
}

static h_buf f_i32_buf(const int32_t* v, int64_t n) {
    h_buf b = h_buf_alloc(KVA_DTYPE_I32, (size_t)(n > 0 ? n : 0));
    if (n > 0) memcpy(h_buf_hp(&b), v, sizeof(int32_t) * (size_t)n);
    h_buf_upload(&b);
    return b;
}

static void f_desc(const f_case* c, kva_attention_desc* d) {
    kva_attention_desc_init(d, c->hq, c->hkv, c->dqk, c->qdt);
    d->head_dim_vo = c->dvo;
    d->kv_dtype = c->kvdt;
    d->o_dtype = c->odt;
    d->mask_mode = c->causal ? KVA_MASK_CAUSAL : KVA_MASK_NONE;
    d->window_left = c->window;
    d->logits_soft_cap = c->cap;
}

static double f_scale(const f_case* c) { return (double)(float)(1.0 / sqrt((double)c->dqk)); }

/* ---------------------------------------------------------------------------------------------- */
/* BSR                                                                                             */

/* Returns 1 on pass, 0 on failure, -1 when skipped (unsupported on this backend). With `shared` (graph mode):
 * the first call allocates *shared, later calls must plan into it with the same sizes. */
static int f_run_bsr_ws(const f_case* c, h_ws* shared) {
    int ok = 1;
    h_rng rng;
    h_rng_seed(&rng, c->seed);
    const int64_t M = c->M, N = c->N;
    const int32_t R = c->R, C = c->C;
    const int64_t MB = (M + R - 1) / R, NB = N / C;
    const int g = c->hq / c->hkv;
    /* block structure: each block row lists ~density% of the column blocks, in shuffled order */
    int32_t* indptr = (int32_t*)calloc((size_t)MB + 1, sizeof(int32_t));
    int32_t* indices = (int32_t*)malloc(sizeof(int32_t) * (size_t)(MB * NB + 1));
    int32_t* perm = (int32_t*)malloc(sizeof(int32_t) * (size_t)(NB + 1));
    int64_t nnz = 0;
    for (int64_t b = 0; b < MB; ++b) {
        for (int64_t j = 0; j < NB; ++j) perm[j] = (int32_t)j;
        h_rng_shuffle_i32(&rng, perm, NB);
        for (int64_t j = 0; j < NB; ++j)
            if (h_rng_range(&rng, 0, 99) < c->density) indices[nnz++] = perm[j];
        indptr[b + 1] = (int32_t)nnz;
    }
    uint8_t* emask = NULL;
    if (c->emask) {
        emask = (uint8_t*)malloc((size_t)(nnz * R * C + 1));
        for (int64_t i = 0; i < nnz * R * C; ++i) emask[i] = (uint8_t)(h_rng_range(&rng, 0, 99) < 70 ? 1 : 0);
    }
    /* data */
    const int64_t krow = (int64_t)c->hkv * c->dqk + c->kpad, vrow = (int64_t)c->hkv * c->dvo + c->kpad;
    h_buf q = h_buf_alloc(c->qdt, (size_t)(M * c->hq * c->dqk));
    h_buf k = h_buf_alloc(c->kvdt, (size_t)(N * krow));
    h_buf v = h_buf_alloc(c->kvdt, (size_t)(N * vrow));
    h_buf o = h_buf_alloc(c->odt, (size_t)(M * c->hq * c->dvo));
    h_buf lse = h_buf_alloc(KVA_DTYPE_F32, (size_t)(M * c->hq));
    f_fill(&q, &rng);
    f_fill(&k, &rng);
    f_fill(&v, &rng);
    h_buf_upload(&q);
    h_buf_upload(&k);
    h_buf_upload(&v);
    h_buf_poison(&o);
    h_buf_poison(&lse);
    h_buf_upload(&o);
    h_buf_upload(&lse);
    h_buf d_idx = f_i32_buf(indices, nnz);

    kva_context* ctx = h_context(c->threads);
    kva_attention_desc desc;
    f_desc(c, &desc);
    kva_bsr_params p;
    kva_bsr_params_init(&p);
    p.num_qo_rows = M;
    p.num_kv_rows = N;
    p.block_rows = R;
    p.block_cols = C;
    p.indptr = indptr;
    p.indices = indices;
    p.block_mask = emask;
    p.graph_mode = c->graph;
    size_t dev_b = 0, host_b = 0, mbytes = 0;
    h_ws ws;
    memset(&ws, 0, sizeof ws);
    h_buf dmask;
    memset(&dmask, 0, sizeof dmask);
    int result = 1;
    kva_status st = kva_bsr_workspace_size(ctx, &desc, &p, &dev_b, &host_b);
    if (st == KVA_ERR_UNSUPPORTED) {
        result = -1;
        goto out;
    }
    H_EXPECT(ok, st == KVA_OK, "kva_bsr_workspace_size: %s: %s", kva_status_string(st), kva_last_error_message());
    if (!ok) goto done;
    if (shared && shared->ws.device) {
        H_EXPECT(ok, dev_b == shared->ws.device_bytes && host_b <= shared->host_bytes,
                 "graph mode: the re-plan needs %zu/%zu bytes, the first plan %zu/%zu", dev_b, host_b,
                 shared->ws.device_bytes, shared->host_bytes);
        if (!ok) goto done;
        ws = *shared;
    } else {
        h_ws_alloc(&ws, dev_b, host_b);
        if (shared) *shared = ws;
    }
    kva_bsr_plan plan;
    st = kva_bsr_plan_make(ctx, &desc, &p, &ws.ws, &plan, NULL);
    if (st == KVA_ERR_UNSUPPORTED) {
        result = -1;
        goto out;
    }
    H_EXPECT(ok, st == KVA_OK, "kva_bsr_plan_make: %s: %s", kva_status_string(st), kva_last_error_message());
    if (!ok) goto done;
    st = kva_bsr_mask_pack(&desc, &p, NULL, 0, &mbytes);
    H_EXPECT(ok, st == KVA_OK && (int64_t)mbytes == plan.mask_bytes, "kva_bsr_mask_pack size: %s, %zu vs plan %lld",
             kva_status_string(st), mbytes, (long long)plan.mask_bytes);
    H_EXPECT(ok, plan.uses_mask == (c->emask || c->causal || c->window >= 0 || c->graph), "uses_mask = %d",
             plan.uses_mask);
    H_EXPECT(ok, plan.mask_bytes <= plan.max_mask_bytes && plan.graph_mode == (c->graph != 0),
             "mask_bytes %lld > max_mask_bytes %lld or graph_mode %d", (long long)plan.mask_bytes,
             (long long)plan.max_mask_bytes, plan.graph_mode);
    dmask = h_buf_alloc(KVA_DTYPE_U8, mbytes);
    if (mbytes) {
        memset(h_buf_hp(&dmask), 0xff, mbytes); /* the packer must clear what it does not set */
        size_t got = 0;
        st = kva_bsr_mask_pack(&desc, &p, (uint8_t*)h_buf_hp(&dmask), mbytes, &got);
        H_EXPECT(ok, st == KVA_OK && got == mbytes, "kva_bsr_mask_pack: %s (%zu bytes)", kva_status_string(st), got);
        h_buf_upload(&dmask);
    }
    kva_bsr_run_args a;
    kva_bsr_run_args_init(&a);
    a.q = kva_tensor_make(h_buf_dp(&q), c->qdt, 3, M, c->hq, c->dqk, 0);
    a.k = kva_tensor_make(h_buf_dp(&k), c->kvdt, 3, N, c->hkv, c->dqk, 0);
    a.k.stride[0] = krow;
    a.v = kva_tensor_make(h_buf_dp(&v), c->kvdt, 3, N, c->hkv, c->dvo, 0);
    a.v.stride[0] = vrow;
    a.o = kva_tensor_make(h_buf_dp(&o), c->odt, 3, M, c->hq, c->dvo, 0);
    if (c->lse) a.lse = kva_tensor_make(h_buf_dp(&lse), KVA_DTYPE_F32, 2, M, c->hq, 0, 0);
    a.indices = (const int32_t*)h_buf_dp(&d_idx);
    a.packed_mask = mbytes ? (const uint8_t*)h_buf_dp(&dmask) : NULL;
    a.packed_mask_bytes = (int64_t)mbytes;
    st = kva_bsr_run(ctx, &plan, &ws.ws, &a);
    H_EXPECT(ok, st == KVA_OK, "kva_bsr_run: %s: %s", kva_status_string(st), kva_last_error_message());
    if (!ok) goto done;
    h_buf_download(&o);
    h_buf_download(&lse);
    H_EXPECT(ok, h_buf_guards_ok(&o) && h_buf_guards_ok(&lse), "output guard bands overwritten");
    if (!c->lse)
        for (size_t i = 0; i < lse.elems; ++i)
            if (!h_buf_elem_is_poison(&lse, i)) {
                H_EXPECT(ok, 0, "lse written although not requested");
                break;
            }
    {
        /* dense reference */
        uint8_t* vis = (uint8_t*)calloc((size_t)(M * N + 1), 1);
        for (int64_t b = 0; b < MB; ++b)
            for (int64_t e = indptr[b]; e < indptr[b + 1]; ++e)
                for (int64_t r = 0; r < R && b * R + r < M; ++r)
                    for (int64_t cc = 0; cc < C; ++cc) {
                        int64_t i = b * R + r, j = (int64_t)indices[e] * C + cc;
                        int visible = emask ? emask[(e * R + r) * C + cc] != 0 : 1;
                        int64_t qpos = i + N - M;
                        if (c->causal && j > qpos) visible = 0;
                        if (c->window >= 0 && j < qpos - c->window) visible = 0;
                        vis[i * N + j] = (uint8_t)visible;
                    }
        double* kd = (double*)malloc(sizeof(double) * (size_t)(N * c->hkv * c->dqk + 1));
        double* vd = (double*)malloc(sizeof(double) * (size_t)(N * c->hkv * c->dvo + 1));
        for (int64_t j = 0; j < N; ++j)
            for (int h = 0; h < c->hkv; ++h) {
                for (int d = 0; d < c->dqk; ++d)
                    kd[(j * c->hkv + h) * c->dqk + d] = h_buf_get(&k, (size_t)(j * krow + h * c->dqk + d));
                for (int d = 0; d < c->dvo; ++d)
                    vd[(j * c->hkv + h) * c->dvo + d] = h_buf_get(&v, (size_t)(j * vrow + h * c->dvo + d));
            }
        double* ro = (double*)malloc(sizeof(double) * (size_t)(M * c->hq * c->dvo + 1));
        double* rl = (double*)malloc(sizeof(double) * (size_t)(M * c->hq + 1));
        double* rm = (double*)malloc(sizeof(double) * (size_t)(M * c->hq + 1));
        const double** ks = (const double**)malloc(sizeof(double*) * (size_t)(N + 1));
        const double** vs = (const double**)malloc(sizeof(double*) * (size_t)(N + 1));
        double* qrow = (double*)malloc(sizeof(double) * (size_t)c->dqk);
        for (int64_t i = 0; i < M; ++i)
            for (int h = 0; h < c->hq; ++h) {
                const int kh = h / g;
                int64_t n = 0;
                for (int64_t j = 0; j < N; ++j)
                    if (vis[i * N + j]) {
                        ks[n] = kd + (j * c->hkv + kh) * c->dqk;
                        vs[n] = vd + (j * c->hkv + kh) * c->dvo;
                        ++n;
                    }
                for (int d = 0; d < c->dqk; ++d) qrow[d] = h_buf_get(&q, (size_t)((i * c->hq + h) * c->dqk + d));
                f_ref_row rr = f_ref_attend(qrow, n, ks, vs, c->dqk, c->dvo, f_scale(c), c->cap,
                                            ro + (i * c->hq + h) * c->dvo);
                rl[i * c->hq + h] = rr.lse;
                rm[i * c->hq + h] = rr.mag;
            }
        f_cmp cmp = {1, 0, 0.0};
        f_compare(&cmp, &o, &lse, M, c->hq, c->dvo, ro, rl, rm, h_tol_out(c->odt, c->qdt, c->kvdt), c->lse, "bsr");
        if (!cmp.ok) ok = 0;
        free(vis);
        free(kd);
        free(vd);
        free(ro);
        free(rl);
        free(rm);
        free(ks);
        free(vs);
        free(qrow);
    }
done:
    result = ok;
out:
    if (!shared) h_ws_free(&ws);
    if (dmask.host) h_buf_free(&dmask);
    h_buf_free(&q);
    h_buf_free(&k);
    h_buf_free(&v);
    h_buf_free(&o);
    h_buf_free(&lse);
    h_buf_free(&d_idx);
    free(indptr);
    free(indices);
    free(perm);
    free(emask);
    return result;
}

static int f_run_bsr(const f_case* c) {
    if (!c->graph) return f_run_bsr_ws(c, NULL);
    /* graph mode: a second pattern (other density, other seed) planned into the same workspace */
    h_ws ws;
    memset(&ws, 0, sizeof ws);
    int r1 = f_run_bsr_ws(c, &ws);
    int r2 = r1;
    if (r1 > 0) {
        f_case c2 = *c;
        c2.seed = c->seed * 31 + 7;
        c2.density = (c->density + 45) % 101;
        r2 = f_run_bsr_ws(&c2, &ws);
    }
    if (ws.ws.device) h_ws_free(&ws);
    return r1 <= 0 ? r1 : r2;
}

/* ---------------------------------------------------------------------------------------------- */
/* Cascade                                                                                         */

typedef struct f_casc {
    int32_t L, B;
    int32_t* qo_len;                             /* [B] */
    int32_t nb[KVA_CASCADE_MAX_LEVELS];          /* requests (groups) per level */
    int32_t* qo_indptr[KVA_CASCADE_MAX_LEVELS];  /* [nb+1] rows */
    int32_t* kv_indptr[KVA_CASCADE_MAX_LEVELS];  /* [nb+1] pages */
    int32_t* lpl[KVA_CASCADE_MAX_LEVELS];        /* [nb] */
    int32_t* kv_len[KVA_CASCADE_MAX_LEVELS];     /* [nb] */
    int32_t* indices[KVA_CASCADE_MAX_LEVELS];    /* pages */
    int32_t* group_of[KVA_CASCADE_MAX_LEVELS];   /* [B] request -> group of the level */
    int64_t rows, pages;
    int32_t max_nb;
} f_casc;

static void f_casc_free(f_casc* s) {
    free(s->qo_len);
    for (int l = 0; l < KVA_CASCADE_MAX_LEVELS; ++l) {
        free(s->qo_indptr[l]);
        free(s->kv_indptr[l]);
        free(s->lpl[l]);
        free(s->kv_len[l]);
        free(s->indices[l]);
        free(s->group_of[l]);
    }
    memset(s, 0, sizeof *s);
}

/* Random cascade structure: level 0 splits the requests into a few contiguous groups, each further level (but the
 * last) splits every group of the level above again, the last level has one group per request. */
static void f_casc_make(const f_case* c, uint64_t seed, f_casc* s) {
    memset(s, 0, sizeof *s);
    h_rng rng;
    h_rng_seed(&rng, seed);
    const int32_t L = c->levels, B = c->batch;
    s->L = L;
    s->B = B;
    s->qo_len = (int32_t*)malloc(sizeof(int32_t) * (size_t)(B + 1));
    for (int32_t b = 0; b < B; ++b) s->qo_len[b] = c->append ? (int32_t)h_rng_range(&rng, 1, c->maxqo) : 1;
    /* cut points per level: cut[l][b] = 1 if a new group starts at request b */
    int32_t* prev = (int32_t*)calloc((size_t)B + 1, sizeof(int32_t));
    int64_t page_next = 0;
    for (int32_t l = 0; l < L; ++l) {
        int32_t* cut = (int32_t*)calloc((size_t)B + 1, sizeof(int32_t));
        for (int32_t b = 0; b < B; ++b) {
            if (b == 0 || l == L - 1) cut[b] = 1;
            else cut[b] = prev[b] || h_rng_range(&rng, 0, 99) < (l == 0 ? 25 : 50);
        }
        int32_t nb = 0;
        for (int32_t b = 0; b < B; ++b) nb += cut[b];
        s->nb[l] = nb;
        if (nb > s->max_nb) s->max_nb = nb;
        s->qo_indptr[l] = (int32_t*)calloc((size_t)nb + 1, sizeof(int32_t));
        s->kv_indptr[l] = (int32_t*)calloc((size_t)nb + 1, sizeof(int32_t));
        s->lpl[l] = (int32_t*)calloc((size_t)nb + 1, sizeof(int32_t));
        s->kv_len[l] = (int32_t*)calloc((size_t)nb + 1, sizeof(int32_t));
        s->group_of[l] = (int32_t*)calloc((size_t)B + 1, sizeof(int32_t));
        int32_t gi = -1;
        int64_t row = 0;
        for (int32_t b = 0; b < B; ++b) {
            if (cut[b]) {
                ++gi;
                s->qo_indptr[l][gi] = (int32_t)row;
            }
            s->group_of[l][b] = gi;
            row += s->qo_len[b];
            s->qo_indptr[l][gi + 1] = (int32_t)row;
        }
        s->rows = row;
        for (int32_t gidx = 0; gidx < nb; ++gidx) {
            int32_t qo = s->qo_indptr[l][gidx + 1] - s->qo_indptr[l][gidx];
            int32_t kv;
            if (c->empty && h_rng_range(&rng, 0, 99) < 20) kv = 0;
            else kv = (int32_t)h_rng_range(&rng, l == L - 1 ? 0 : 1, c->maxkv);
            if (l == L - 1 && c->causal && kv < qo) kv = qo + (int32_t)h_rng_range(&rng, 0, 3);
            s->kv_len[l][gidx] = kv;
            int32_t np = (kv + c->ps - 1) / c->ps;
            s->kv_indptr[l][gidx + 1] = s->kv_indptr[l][gidx] + np;
            s->lpl[l][gidx] = np ? kv - (np - 1) * c->ps : 0;
        }
        page_next += s->kv_indptr[l][nb];
        free(prev);
        prev = cut;
    }
    free(prev);
    /* pages: a shuffled pool with a few unused pages */
    s->pages = page_next + 3;
    int32_t* perm = (int32_t*)malloc(sizeof(int32_t) * (size_t)s->pages);
    for (int64_t i = 0; i < s->pages; ++i) perm[i] = (int32_t)i;
    h_rng_shuffle_i32(&rng, perm, s->pages);
    int64_t used = 0;
    for (int32_t l = 0; l < L; ++l) {
        int32_t n = s->kv_indptr[l][s->nb[l]];
        s->indices[l] = (int32_t*)malloc(sizeof(int32_t) * (size_t)(n + 1));
        for (int32_t i = 0; i < n; ++i) s->indices[l][i] = perm[used++];
    }
    free(perm);
}

static void f_casc_params(const f_case* c, const f_casc* s, kva_cascade_params* p) {
    kva_cascade_params_init(p);
    p->num_levels = s->L;
    for (int32_t l = 0; l < s->L; ++l) {
        p->levels[l].batch_size = s->nb[l];
        p->levels[l].qo_indptr = s->qo_indptr[l];
        p->levels[l].kv_indptr = s->kv_indptr[l];
        p->levels[l].kv_last_page_len = s->lpl[l];
        p->levels[l].kv_indices = s->indices[l];
    }
    p->page_size = c->ps;
    p->num_pages = s->pages;
    if (c->graph) {
        p->graph_mode = 1;
        p->max_batch_size = c->batch;
        p->max_total_qo_rows = (int64_t)c->batch * (c->append ? c->maxqo : 1);
    }
}

static int f_run_cascade(const f_case* c) {
    int ok = 1, result = 1;
    f_casc s, decoy;
    f_casc_make(c, c->seed, &s);
    memset(&decoy, 0, sizeof decoy);
    h_rng rng;
    h_rng_seed(&rng, c->seed ^ 0x5eedull);
    const int g = c->hq / c->hkv;
    const int64_t rows = s.rows;
    /* pool: separate K and V pools of the chosen layout, sized for the larger of the two structures */
    int64_t P = s.pages;
    if (c->graph) {
        f_casc_make(c, c->seed * 7919u + 17u, &decoy);
        if (decoy.pages > P) P = decoy.pages;
    }
    h_buf kp = h_buf_alloc(c->kvdt, (size_t)(P * c->ps * c->hkv * c->dqk));
    h_buf vp = h_buf_alloc(c->kvdt, (size_t)(P * c->ps * c->hkv * c->dvo));
    h_buf q = h_buf_alloc(c->qdt, (size_t)(rows * c->hq * c->dqk));
    h_buf o = h_buf_alloc(c->odt, (size_t)(rows * c->hq * c->dvo));
    h_buf lse = h_buf_alloc(KVA_DTYPE_F32, (size_t)(rows * c->hq));
    f_fill(&kp, &rng);
    f_fill(&vp, &rng);
    f_fill(&q, &rng);
    h_buf_upload(&kp);
    h_buf_upload(&vp);
    h_buf_upload(&q);
    h_buf_poison(&o);
    h_buf_poison(&lse);
    h_buf_upload(&o);
    h_buf_upload(&lse);
    h_buf didx[KVA_CASCADE_MAX_LEVELS];
    memset(didx, 0, sizeof didx);
    for (int32_t l = 0; l < s.L; ++l) didx[l] = f_i32_buf(s.indices[l], s.kv_indptr[l][s.nb[l]]);
    kva_paged_kv pool;
    kva_paged_kv_init(&pool, h_buf_dp(&kp), h_buf_dp(&vp), c->kvdt, c->hnd ? KVA_LAYOUT_HND : KVA_LAYOUT_NHD, P,
                      c->ps, c->hkv, c->dqk, c->dvo);

    kva_context* ctx = h_context(c->threads);
    kva_attention_desc desc;
    f_desc(c, &desc);
    kva_cascade_params p;
    f_casc_params(c, &s, &p);
    p.num_pages = P;
    size_t dev_b = 0, host_b = 0;
    h_ws ws;
    memset(&ws, 0, sizeof ws);
    kva_status st = kva_cascade_workspace_size(ctx, &desc, &p, &dev_b, &host_b);
    if (st == KVA_ERR_UNSUPPORTED) {
        result = -1;
        goto out;
    }
    H_EXPECT(ok, st == KVA_OK, "kva_cascade_workspace_size: %s: %s", kva_status_string(st), kva_last_error_message());
    if (!ok) goto done;
    h_ws_alloc(&ws, dev_b, host_b);
    kva_cascade_plan plan;
    if (c->graph) {
        /* plan another structure first (same bounds) into the same workspace: sizes and offsets must agree */
        kva_cascade_params pd;
        f_casc_params(c, &decoy, &pd);
        pd.num_pages = P;
        size_t d2 = 0, h2 = 0;
        st = kva_cascade_workspace_size(ctx, &desc, &pd, &d2, &h2);
        H_EXPECT(ok, st == KVA_OK && d2 == dev_b && h2 == host_b,
                 "graph mode: workspace sizes differ between structures (%zu/%zu vs %zu/%zu): %s", d2, h2, dev_b,
                 host_b, kva_last_error_message());
        kva_cascade_plan first;
        st = kva_cascade_plan_make(ctx, &desc, &pd, &ws.ws, &first, NULL);
        H_EXPECT(ok, st == KVA_OK, "graph mode: decoy plan: %s: %s", kva_status_string(st), kva_last_error_message());
        if (!ok) goto done;
        st = kva_cascade_plan_make(ctx, &desc, &p, &ws.ws, &plan, NULL);
        H_EXPECT(ok, st == KVA_OK, "kva_cascade_plan_make: %s: %s", kva_status_string(st), kva_last_error_message());
        if (!ok) goto done;
        for (int32_t l = 0; l < s.L; ++l)
            H_EXPECT(ok, first.level_device_offset[l] == plan.level_device_offset[l] &&
                             first.level_host_offset[l] == plan.level_host_offset[l],
                     "graph mode: level %d offsets moved", (int)l);
        H_EXPECT(ok, first.tmp_o_offset == plan.tmp_o_offset && first.acc_lse_offset == plan.acc_lse_offset &&
                         first.device_bytes == plan.device_bytes,
                 "graph mode: temporaries moved");
    } else {
        st = kva_cascade_plan_make(ctx, &desc, &p, &ws.ws, &plan, NULL);
        if (st == KVA_ERR_UNSUPPORTED) {
            result = -1;
            goto out;
        }
        H_EXPECT(ok, st == KVA_OK, "kva_cascade_plan_make: %s: %s", kva_status_string(st), kva_last_error_message());
        if (!ok) goto done;
    }
    H_EXPECT(ok, plan.device_bytes <= dev_b && plan.host_bytes <= host_b, "plan uses more than the size query");
    kva_cascade_run_args a;
    kva_cascade_run_args_init(&a);
    a.q = kva_tensor_make(h_buf_dp(&q), c->qdt, 3, rows, c->hq, c->dqk, 0);
    a.o = kva_tensor_make(h_buf_dp(&o), c->odt, 3, rows, c->hq, c->dvo, 0);
    if (c->lse) a.lse = kva_tensor_make(h_buf_dp(&lse), KVA_DTYPE_F32, 2, rows, c->hq, 0, 0);
    a.paged = pool;
    for (int32_t l = 0; l < s.L; ++l) a.kv_indices[l] = (const int32_t*)h_buf_dp(&didx[l]);
    st = kva_cascade_run(ctx, &plan, &ws.ws, &a);
    H_EXPECT(ok, st == KVA_OK, "kva_cascade_run: %s: %s", kva_status_string(st), kva_last_error_message());
    if (!ok) goto done;
    h_buf_download(&o);
    h_buf_download(&lse);
    H_EXPECT(ok, h_buf_guards_ok(&o) && h_buf_guards_ok(&lse), "output guard bands overwritten");
    if (!c->lse)
        for (size_t i = 0; i < lse.elems; ++i)
            if (!h_buf_elem_is_poison(&lse, i)) {
                H_EXPECT(ok, 0, "lse written although not requested");
                break;
            }
    {
        /* flat reference: each request over the concatenation of its groups' KV, level by level */
        int64_t maxkv = 0;
        for (int32_t b = 0; b < s.B; ++b) {
            int64_t t = 0;
            for (int32_t l = 0; l < s.L; ++l) t += s.kv_len[l][s.group_of[l][b]];
            if (t > maxkv) maxkv = t;
        }
        double* kd = (double*)malloc(sizeof(double) * (size_t)((maxkv + 1) * c->dqk));
        double* vd = (double*)malloc(sizeof(double) * (size_t)((maxkv + 1) * c->dvo));
        const double** ks = (const double**)malloc(sizeof(double*) * (size_t)(maxkv + 1));
        const double** vs = (const double**)malloc(sizeof(double*) * (size_t)(maxkv + 1));
        double* ro = (double*)malloc(sizeof(double) * (size_t)(rows * c->hq * c->dvo + 1));
        double* rl = (double*)malloc(sizeof(double) * (size_t)(rows * c->hq + 1));
        double* rm = (double*)malloc(sizeof(double) * (size_t)(rows * c->hq + 1));
        double* qrow = (double*)malloc(sizeof(double) * (size_t)c->dqk);
        int64_t row0 = 0;
        for (int32_t b = 0; b < s.B; ++b) {
            const int32_t qo = s.qo_len[b];
            for (int kh = 0; kh < c->hkv; ++kh) {
                /* gather this request's keys of KV head kh */
                int64_t n = 0;
                for (int32_t l = 0; l < s.L; ++l) {
                    const int32_t gi = s.group_of[l][b];
                    for (int32_t t = 0; t < s.kv_len[l][gi]; ++t) {
                        const int64_t page = s.indices[l][s.kv_indptr[l][gi] + t / c->ps], slot = t % c->ps;
                        for (int d = 0; d < c->dqk; ++d)
                            kd[n * c->dqk + d] = h_buf_get(&kp, (size_t)(page * pool.k_stride_page + slot * pool.k_stride_token +
                                                                         kh * pool.k_stride_head + d));
                        for (int d = 0; d < c->dvo; ++d)
                            vd[n * c->dvo + d] = h_buf_get(&vp, (size_t)(page * pool.v_stride_page + slot * pool.v_stride_token +
                                                                         kh * pool.v_stride_head + d));
                        ++n;
                    }
                }
                for (int64_t j = 0; j < n; ++j) {
                    ks[j] = kd + j * c->dqk;
                    vs[j] = vd + j * c->dvo;
                }
                for (int32_t i = 0; i < qo; ++i) {
                    const int64_t qpos = n - qo + i;
                    const int64_t nvis = c->causal ? (qpos + 1 < 0 ? 0 : (qpos + 1 > n ? n : qpos + 1)) : n;
                    for (int hh = 0; hh < g; ++hh) {
                        const int h = kh * g + hh;
                        const int64_t r = (row0 + i) * c->hq + h;
                        for (int d = 0; d < c->dqk; ++d) qrow[d] = h_buf_get(&q, (size_t)(r * c->dqk + d));
                        f_ref_row rr = f_ref_attend(qrow, nvis, ks, vs, c->dqk, c->dvo, f_scale(c), c->cap,
                                                    ro + r * c->dvo);
                        rl[r] = rr.lse;
                        rm[r] = rr.mag;
                    }
                }
            }
            row0 += qo;
        }
        f_cmp cmp = {1, 0, 0.0};
        f_compare(&cmp, &o, &lse, rows, c->hq, c->dvo, ro, rl, rm, h_tol_out(c->odt, c->qdt, c->kvdt), c->lse,
                  "cascade");
        if (!cmp.ok) ok = 0;
        free(kd);
        free(vd);
        free(ks);
        free(vs);
        free(ro);
        free(rl);
        free(rm);
        free(qrow);
    }
done:
    result = ok;
out:
    h_ws_free(&ws);
    for (int32_t l = 0; l < KVA_CASCADE_MAX_LEVELS; ++l)
        if (didx[l].host) h_buf_free(&didx[l]);
    h_buf_free(&kp);
    h_buf_free(&vp);
    h_buf_free(&q);
    h_buf_free(&o);
    h_buf_free(&lse);
    f_casc_free(&s);
    f_casc_free(&decoy);
    return result;
}

/* ---------------------------------------------------------------------------------------------- */
/* Case driver                                                                                     */

/* ---------------------------------------------------------------------------------------------- */
/* Variable block sizes per KV head                                                                */

/* Split total into n parts >= 0 at random (about one in five empty when allow_zero). */
static void f_random_parts(h_rng* r, int64_t total, int32_t n, int allow_zero, int32_t* out) {
    for (int32_t i = 0; i < n; ++i) out[i] = 0;
    if (n == 0) return;
    /* n - 1 random cut points in [0, total], sorted */
    int64_t* cut = (int64_t*)malloc(sizeof(int64_t) * (size_t)(n + 1));
    cut[0] = 0;
    for (int32_t i = 1; i < n; ++i) cut[i] = allow_zero ? h_rng_range(r, 0, total) : 0;
    if (!allow_zero) {
        /* as even as possible with jitter, no zero part while total >= n */
        for (int32_t i = 1; i < n; ++i) cut[i] = total * i / n;
    }
    for (int32_t i = 1; i < n; ++i)
        for (int32_t j = i; j > 1 && cut[j] < cut[j - 1]; --j) {
            int64_t t = cut[j];
            cut[j] = cut[j - 1];
            cut[j - 1] = t;
        }
    cut[n] = total;
    for (int32_t i = 0; i < n; ++i) out[i] = (int32_t)(cut[i + 1] - cut[i]);
    free(cut);
}

static int f_run_vbsr(const f_case* c) {
    int ok = 1;
    h_rng rng;
    h_rng_seed(&rng, c->seed);
    const int64_t M = c->M, N = c->N;
    const int32_t MB = c->mb, NB = c->nb, H = c->hkv, Hq = c->hq, g = c->hq / c->hkv;
    int32_t* rs = (int32_t*)malloc(sizeof(int32_t) * (size_t)(H * MB));
    int32_t* cs = (int32_t*)malloc(sizeof(int32_t) * (size_t)(H * NB));
    uint8_t* mm = (uint8_t*)malloc((size_t)(H * MB * NB));
    for (int32_t h = 0; h < H; ++h) {
        f_random_parts(&rng, M, MB, (int)((c->seed + h) % 2), rs + h * MB);
        f_random_parts(&rng, N, NB, (int)((c->seed + h + 1) % 2), cs + h * NB);
    }
    for (int64_t i = 0; i < (int64_t)H * MB * NB; ++i) mm[i] = (uint8_t)(h_rng_range(&rng, 0, 99) < c->density);
    /* q / k / v: NHD, or HND (heads outermost, as FlashInfer's variable wrapper takes them); o / lse NHD */
    const int64_t krow = c->hnd ? c->dqk + c->kpad : (int64_t)H * c->dqk + c->kpad;
    const int64_t vrow = c->hnd ? c->dvo + c->kpad : (int64_t)H * c->dvo + c->kpad;
    h_buf q = h_buf_alloc(c->qdt, (size_t)(M * Hq * c->dqk));
    h_buf k = h_buf_alloc(c->kvdt, (size_t)(N * H * krow / (c->hnd ? 1 : H) + 1));
    h_buf v = h_buf_alloc(c->kvdt, (size_t)(N * H * vrow / (c->hnd ? 1 : H) + 1));
    h_buf o = h_buf_alloc(c->odt, (size_t)(M * Hq * c->dvo));
    h_buf lse = h_buf_alloc(KVA_DTYPE_F32, (size_t)(M * Hq));
    f_fill(&q, &rng);
    f_fill(&k, &rng);
    f_fill(&v, &rng);
    h_buf_upload(&q);
    h_buf_upload(&k);
    h_buf_upload(&v);
    h_buf_poison(&o);
    h_buf_poison(&lse);
    h_buf_upload(&o);
    h_buf_upload(&lse);
    /* element offsets */
#define F_QOFF(i, h) (c->hnd ? ((int64_t)(h) * M + (i)) * c->dqk : ((int64_t)(i) * Hq + (h)) * c->dqk)
#define F_KOFF(j, h) (c->hnd ? ((int64_t)(h) * N + (j)) * krow : (int64_t)(j) * krow + (int64_t)(h) * c->dqk)
#define F_VOFF(j, h) (c->hnd ? ((int64_t)(h) * N + (j)) * vrow : (int64_t)(j) * vrow + (int64_t)(h) * c->dvo)

    kva_context* ctx = h_context(c->threads);
    kva_attention_desc desc;
    f_desc(c, &desc);
    kva_vbsr_params p;
    kva_vbsr_params_init(&p);
    p.num_qo_rows = M;
    p.num_kv_rows = N;
    p.num_block_rows = MB;
    p.num_block_cols = NB;
    p.block_row_sz = rs;
    p.block_col_sz = cs;
    p.block_mask_map = mm;
    h_ws ws;
    memset(&ws, 0, sizeof ws);
    h_buf dtab, dmask;
    memset(&dtab, 0, sizeof dtab);
    memset(&dmask, 0, sizeof dmask);
    kva_plan* hp = (kva_plan*)calloc((size_t)H, sizeof(kva_plan));
    int result = 1;
    size_t dev_b = 0, host_b = 0;
    kva_status st = kva_vbsr_workspace_size(ctx, &desc, &p, &dev_b, &host_b);
    if (st == KVA_ERR_UNSUPPORTED) {
        result = -1;
        goto out;
    }
    H_EXPECT(ok, st == KVA_OK, "kva_vbsr_workspace_size: %s: %s", kva_status_string(st), kva_last_error_message());
    if (!ok) goto done;
    h_ws_alloc(&ws, dev_b, host_b);
    kva_vbsr_plan plan;
    st = kva_vbsr_plan_make(ctx, &desc, &p, &ws.ws, hp, &plan, NULL);
    if (st == KVA_ERR_UNSUPPORTED) {
        result = -1;
        goto out;
    }
    H_EXPECT(ok, st == KVA_OK, "kva_vbsr_plan_make: %s: %s", kva_status_string(st), kva_last_error_message());
    if (!ok) goto done;
    int64_t nt = -1, nm = -1;
    st = kva_vbsr_pack(&desc, &p, NULL, 0, NULL, 0, &nt, &nm);
    H_EXPECT(ok, st == KVA_OK && nt == plan.table_entries && nm == plan.mask_bytes,
             "kva_vbsr_pack size query: %s, %lld/%lld vs plan %lld/%lld", kva_status_string(st), (long long)nt,
             (long long)nm, (long long)plan.table_entries, (long long)plan.mask_bytes);
    H_EXPECT(ok, plan.uses_mask == (c->causal || c->window >= 0), "uses_mask = %d", plan.uses_mask);
    if (!ok) goto done;
    dtab = h_buf_alloc(KVA_DTYPE_I32, (size_t)nt);
    dmask = h_buf_alloc(KVA_DTYPE_U8, (size_t)nm);
    if (nm > 0) memset(h_buf_hp(&dmask), 0xff, (size_t)nm); /* the packer must clear what it does not set */
    st = kva_vbsr_pack(&desc, &p, (int32_t*)h_buf_hp(&dtab), (size_t)nt, nm > 0 ? (uint8_t*)h_buf_hp(&dmask) : NULL,
                       (size_t)nm, &nt, &nm);
    H_EXPECT(ok, st == KVA_OK, "kva_vbsr_pack: %s: %s", kva_status_string(st), kva_last_error_message());
    h_buf_upload(&dtab);
    h_buf_upload(&dmask);
    kva_vbsr_run_args a;
    kva_vbsr_run_args_init(&a);
    a.q = kva_tensor_make(h_buf_dp(&q), c->qdt, 3, M, Hq, c->dqk, 0);
    a.k = kva_tensor_make(h_buf_dp(&k), c->kvdt, 3, N, H, c->dqk, 0);
    a.v = kva_tensor_make(h_buf_dp(&v), c->kvdt, 3, N, H, c->dvo, 0);
    if (c->hnd) {
        a.q.stride[0] = c->dqk;
        a.q.stride[1] = M * c->dqk;
        a.k.stride[0] = krow;
        a.k.stride[1] = N * krow;
        a.v.stride[0] = vrow;
        a.v.stride[1] = N * vrow;
    } else {
        a.k.stride[0] = krow;
        a.v.stride[0] = vrow;
    }
    a.o = kva_tensor_make(h_buf_dp(&o), c->odt, 3, M, Hq, c->dvo, 0);
    if (c->lse) a.lse = kva_tensor_make(h_buf_dp(&lse), KVA_DTYPE_F32, 2, M, Hq, 0, 0);
    a.table = (const int32_t*)h_buf_dp(&dtab);
    a.table_entries = nt;
    a.packed_mask = nm > 0 ? (const uint8_t*)h_buf_dp(&dmask) : NULL;
    a.packed_mask_bytes = nm;
    st = kva_vbsr_run(ctx, &plan, &ws.ws, &a);
    H_EXPECT(ok, st == KVA_OK, "kva_vbsr_run: %s: %s", kva_status_string(st), kva_last_error_message());
    if (!ok) goto done;
    if (h_backend_device()) {
        kva_fault_report fr;
        st = kva_vbsr_read_faults(ctx, &plan, &ws.ws, &fr, NULL);
        H_EXPECT(ok, st == KVA_OK && !fr.faulted, "kva_vbsr_read_faults: %s, faulted %d", kva_status_string(st),
                 (int)fr.faulted);
    }
    h_buf_download(&o);
    h_buf_download(&lse);
    H_EXPECT(ok, h_buf_guards_ok(&o) && h_buf_guards_ok(&lse), "output guard bands overwritten");
    if (!c->lse)
        for (size_t i = 0; i < lse.elems; ++i)
            if (!h_buf_elem_is_poison(&lse, i)) {
                H_EXPECT(ok, 0, "lse written although not requested");
                break;
            }
    {
        /* dense reference, straight from the definition: block (b, c) of head h holds (i, j) */
        int32_t* brow = (int32_t*)malloc(sizeof(int32_t) * (size_t)(M + 1));
        int32_t* bcol = (int32_t*)malloc(sizeof(int32_t) * (size_t)(N + 1));
        double* ro = (double*)malloc(sizeof(double) * (size_t)(M * Hq * c->dvo + 1));
        double* rl = (double*)malloc(sizeof(double) * (size_t)(M * Hq + 1));
        double* rm = (double*)malloc(sizeof(double) * (size_t)(M * Hq + 1));
        double* kd = (double*)malloc(sizeof(double) * (size_t)(N * c->dqk + 1));
        double* vd = (double*)malloc(sizeof(double) * (size_t)(N * c->dvo + 1));
        const double** ks = (const double**)malloc(sizeof(double*) * (size_t)(N + 1));
        const double** vs = (const double**)malloc(sizeof(double*) * (size_t)(N + 1));
        double* qrow = (double*)malloc(sizeof(double) * (size_t)c->dqk);
        for (int32_t kh = 0; kh < H; ++kh) {
            int64_t x = 0;
            for (int32_t b = 0; b < MB; ++b)
                for (int32_t r = 0; r < rs[kh * MB + b]; ++r) brow[x++] = b;
            x = 0;
            for (int32_t cb = 0; cb < NB; ++cb)
                for (int32_t r = 0; r < cs[kh * NB + cb]; ++r) bcol[x++] = cb;
            for (int64_t j = 0; j < N; ++j) {
                for (int d = 0; d < c->dqk; ++d) kd[j * c->dqk + d] = h_buf_get(&k, (size_t)(F_KOFF(j, kh) + d));
                for (int d = 0; d < c->dvo; ++d) vd[j * c->dvo + d] = h_buf_get(&v, (size_t)(F_VOFF(j, kh) + d));
            }
            for (int64_t i = 0; i < M; ++i) {
                const int64_t qpos = i + N - M;
                int64_t n = 0;
                for (int64_t j = 0; j < N; ++j) {
                    if (!mm[((int64_t)kh * MB + brow[i]) * NB + bcol[j]]) continue;
                    if (c->causal && j > qpos) continue;
                    if (c->window >= 0 && j < qpos - c->window) continue;
                    ks[n] = kd + j * c->dqk;
                    vs[n] = vd + j * c->dvo;
                    ++n;
                }
                for (int32_t hh = 0; hh < g; ++hh) {
                    const int32_t h = kh * g + hh;
                    for (int d = 0; d < c->dqk; ++d) qrow[d] = h_buf_get(&q, (size_t)(F_QOFF(i, h) + d));
                    f_ref_row rr =
                        f_ref_attend(qrow, n, ks, vs, c->dqk, c->dvo, f_scale(c), c->cap, ro + (i * Hq + h) * c->dvo);
                    rl[i * Hq + h] = rr.lse;
                    rm[i * Hq + h] = rr.mag;
                }
            }
        }
        f_cmp cmp = {1, 0, 0.0};
        f_compare(&cmp, &o, &lse, M, Hq, c->dvo, ro, rl, rm, h_tol_out(c->odt, c->qdt, c->kvdt), c->lse, "vbsr");
        if (!cmp.ok) ok = 0;
        free(brow);
        free(bcol);
        free(ro);
        free(rl);
        free(rm);
        free(kd);
        free(vd);
        free(ks);
        free(vs);
        free(qrow);
    }
#undef F_QOFF
#undef F_KOFF
#undef F_VOFF
done:
    result = ok;
out:
    h_ws_free(&ws);
    if (dtab.host) h_buf_free(&dtab);
    if (dmask.host) h_buf_free(&dmask);
    h_buf_free(&q);
    h_buf_free(&k);
    h_buf_free(&v);
    h_buf_free(&o);
    h_buf_free(&lse);
    free(hp);
    free(rs);
    free(cs);
    free(mm);
    return result;
}

/* On a device backend, map a case onto what the device kernels take (head dims 64 / 128 / 256 with dqk == dvo,
 * 16-bit queries, K/V row padding in 16-byte units); the printed line is the adapted case, so it replays as is. */
static void f_adapt_device(f_case* c) {
    if (!h_backend_device()) return;
    int d = c->dqk > c->dvo ? c->dqk : c->dvo;
    d = d <= 64 ? 64 : (d <= 128 ? 128 : 256);
    c->dqk = c->dvo = d;
    if (c->qdt == KVA_DTYPE_F32) c->qdt = KVA_DTYPE_F16;
    if (c->kvdt == KVA_DTYPE_F32) c->kvdt = c->qdt;
    const int64_t qu = h_stride_quantum(c->kvdt);
    if (c->kpad % qu) c->kpad = (int32_t)((c->kpad / qu + 1) * qu);
}

static void f_case_run(const f_case* c0) {
    f_case adapted = *c0;
    f_adapt_device(&adapted);
    const f_case* c = &adapted;
    char line[512];
    f_format(c, line, sizeof line);
    h_logf("case: %s\n", line);
    int r = c->op == F_BSR ? f_run_bsr(c) : (c->op == F_VBSR ? f_run_vbsr(c) : f_run_cascade(c));
    if (r > 0) h_pass();
    else if (r < 0) ++h_nskip;
    else
        h_failf(__FILE__, __LINE__, "case failed; replay with:\n  test_formats --backend %s --case \"%s\"",
                h_opt.backend_name, line);
}

static const kva_dtype f_dts[3] = {KVA_DTYPE_F32, KVA_DTYPE_F16, KVA_DTYPE_BF16};

static void f_suite_bsr(void) {
    static const int32_t sizes[3] = {1, 3, 16};
    uint64_t seed = 1000;
    int n = 0;
    for (int ri = 0; ri < 3; ++ri)
        for (int ci = 0; ci < 3; ++ci)
            for (int em = 0; em < 2; ++em)
                for (int ca = 0; ca < 2; ++ca) {
                    f_case c;
                    f_default(&c, F_BSR);
                    h_rng r;
                    h_rng_seed(&r, seed);
                    c.R = sizes[ri];
                    c.C = sizes[ci];
                    c.M = h_rng_range(&r, 1, c.R == 16 ? 70 : 40);
                    c.N = c.C * h_rng_range(&r, 1, c.C == 16 ? 6 : (c.C == 3 ? 20 : 50));
                    if (ca && c.N < c.M) c.N += c.C * ((c.M - c.N) / c.C + 1); /* some causal cases with M < N */
                    c.emask = em;
                    c.causal = ca;
                    c.density = (int32_t)h_rng_range(&r, 20, 100);
                    c.qdt = c.kvdt = c.odt = f_dts[n % 3];
                    c.lse = (n / 3) % 2 == 0;
                    c.kpad = n % 4 == 1 ? 8 : 0;
                    c.hq = n % 5 == 2 ? 8 : 4;
                    c.hkv = n % 5 == 2 ? 2 : (n % 2 ? 4 : 1);
                    c.seed = seed++;
                    f_case_run(&c);
                    ++n;
                }
    /* specials */
    const char* lines[] = {
        "bsr M=0 N=32 R=4 C=16 density=50 seed=7",
        "bsr M=20 N=0 R=4 C=16 density=50 seed=8",
        "bsr M=33 N=33 R=1 C=1 density=100 causal=1 seed=9",                      /* dense causal, vector sparsity */
        "bsr M=50 N=30 R=3 C=3 density=80 causal=1 emask=1 seed=10",               /* M > N: first rows see little */
        "bsr M=40 N=64 R=16 C=16 density=70 window=20 seed=11",                   /* dense window */
        "bsr M=40 N=64 R=3 C=1 density=30 causal=1 window=9 emask=1 seed=12",
        "bsr M=37 N=48 R=5 C=4 density=60 cap=5 hq=8 hkv=1 seed=13",              /* soft cap, g = 8 */
        "bsr M=29 N=45 R=7 C=3 density=40 dqk=32 dvo=8 q=f16 kv=e4m3 o=f32 seed=14", /* fp8 KV, asymmetric dims */
        "bsr M=64 N=256 R=16 C=16 density=10 q=bf16 kv=bf16 o=bf16 seed=15",
        "bsr M=30 N=40 R=3 C=2 density=0 emask=1 seed=16",                        /* no block listed anywhere */
        "bsr M=130 N=384 R=64 C=16 density=60 threads=5 causal=1 emask=1 seed=17",
        "bsr M=40 N=64 R=4 C=16 density=50 graph=1 seed=18",                      /* graph mode, re-plan */
        "bsr M=64 N=128 R=16 C=16 density=30 causal=1 graph=1 q=bf16 kv=bf16 o=bf16 seed=19",
        "bsr M=1 N=512 R=1 C=16 density=20 graph=1 hq=8 hkv=8 q=f16 kv=f16 o=f16 seed=20", /* sparse decode */
    };
    for (size_t i = 0; i < sizeof lines / sizeof lines[0]; ++i) {
        f_case c;
        if (!f_parse(lines[i], &c)) {
            h_failf(__FILE__, __LINE__, "bad built-in case %s", lines[i]);
            continue;
        }
        f_case_run(&c);
    }
}

static void f_suite_vbsr(void) {
    uint64_t seed = 7000;
    int n = 0;
    for (int hnd = 0; hnd < 2; ++hnd)
        for (int ca = 0; ca < 2; ++ca)
            for (int di = 0; di < 3; ++di) {
                f_case c;
                f_default(&c, F_VBSR);
                h_rng r;
                h_rng_seed(&r, seed);
                c.M = h_rng_range(&r, 1, 60);
                c.N = h_rng_range(&r, 1, 90);
                if (ca && c.N < c.M) c.N = c.M + h_rng_range(&r, 0, 20);
                c.mb = (int32_t)h_rng_range(&r, 1, 7);
                c.nb = (int32_t)h_rng_range(&r, 1, 9);
                c.density = (int32_t)h_rng_range(&r, 30, 100);
                c.causal = ca;
                c.hnd = hnd;
                c.qdt = c.kvdt = c.odt = f_dts[di];
                c.lse = n % 3 != 2;
                c.kpad = n % 4 == 1 ? 8 : 0;
                c.hq = n % 3 == 0 ? 8 : 6;
                c.hkv = n % 3 == 0 ? 2 : (n % 2 ? 3 : 1);
                c.seed = seed++;
                f_case_run(&c);
                ++n;
            }
    const char* lines[] = {
        "vbsr M=0 N=20 mb=3 nb=2 density=50 seed=31",
        "vbsr M=17 N=0 mb=2 nb=3 density=50 seed=32",
        "vbsr M=40 N=40 mb=5 nb=5 density=100 causal=1 window=7 seed=33",
        "vbsr M=33 N=70 mb=4 nb=6 density=0 seed=34",                            /* nothing visible */
        "vbsr M=48 N=96 mb=3 nb=8 density=60 hq=8 hkv=1 cap=6 q=f16 kv=e4m3 o=f32 seed=35",
        "vbsr M=64 N=128 mb=4 nb=8 density=70 hq=4 hkv=4 dqk=32 dvo=32 q=bf16 kv=bf16 o=bf16 hnd=1 seed=36",
        "vbsr M=25 N=50 mb=5 nb=10 density=50 hq=7 hkv=7 threads=1 seed=37",
    };
    for (size_t i = 0; i < sizeof lines / sizeof lines[0]; ++i) {
        f_case c;
        if (!f_parse(lines[i], &c)) {
            h_failf(__FILE__, __LINE__, "bad built-in case %s", lines[i]);
            continue;
        }
        f_case_run(&c);
    }
}

static void f_suite_cascade(void) {
    uint64_t seed = 5000;
    int n = 0;
    for (int levels = 1; levels <= 3; ++levels)
        for (int pi = 0; pi < 2; ++pi)
            for (int append = 0; append < 2; ++append)
                for (int lse = 0; lse < 2; ++lse) {
                    f_case c;
                    f_default(&c, F_CASCADE);
                    c.levels = levels;
                    c.ps = pi ? 16 : 1;
                    c.append = append;
                    c.lse = lse;
                    c.causal = append && (n % 3 != 0);
                    c.batch = append ? 4 + n % 4 : 6 + n % 9;
                    c.maxkv = pi ? 70 : 25;
                    c.maxqo = 7;
                    c.empty = n % 4 == 3;
                    c.hnd = n % 5 == 1;
                    c.qdt = c.kvdt = c.odt = f_dts[n % 3];
                    c.hq = n % 2 ? 8 : 4;
                    c.hkv = n % 3 == 0 ? 1 : 2;
                    c.seed = seed++;
                    f_case_run(&c);
                    ++n;
                }
    const char* lines[] = {
        "cascade levels=2 batch=32 append=0 ps=16 maxkv=300 lse=1 seed=21",              /* decode, long prefix */
        "cascade levels=3 batch=12 append=1 ps=16 maxkv=80 maxqo=9 causal=1 lse=1 graph=1 seed=22",
        "cascade levels=2 batch=9 append=0 ps=1 maxkv=30 graph=1 lse=0 seed=23",
        "cascade levels=3 batch=7 append=1 ps=3 maxkv=20 maxqo=4 empty=1 lse=1 hnd=1 seed=24",
        "cascade levels=4 batch=10 append=1 ps=16 maxkv=50 maxqo=5 causal=1 lse=1 q=f16 kv=e4m3 o=f16 seed=25",
        "cascade levels=2 batch=6 append=1 ps=16 maxkv=40 maxqo=6 causal=1 cap=4 hq=8 hkv=1 dqk=32 dvo=16 seed=26",
        "cascade levels=8 batch=5 append=0 ps=2 maxkv=12 lse=1 seed=27",
        "cascade levels=2 batch=1 append=1 ps=16 maxkv=64 maxqo=20 causal=1 lse=1 threads=1 seed=28",
    };
    for (size_t i = 0; i < sizeof lines / sizeof lines[0]; ++i) {
        f_case c;
        if (!f_parse(lines[i], &c)) {
            h_failf(__FILE__, __LINE__, "bad built-in case %s", lines[i]);
            continue;
        }
        f_case_run(&c);
    }
}

/* Random cases (--seed, --count; default 40 of each format). */
static void f_suite_fuzz(void) {
    const int count = h_opt.count >= 0 ? h_opt.count : 40;
    h_rng r;
    h_rng_seed(&r, h_opt.seed * 0x9e3779b97f4a7c15ull + 3);
    for (int i = 0; i < count; ++i) {
        f_case c;
        f_default(&c, F_BSR);
        c.R = (int32_t)h_rng_range(&r, 1, 20);
        c.C = (int32_t)h_rng_range(&r, 1, 20);
        c.M = h_rng_range(&r, 0, 90);
        c.N = c.C * h_rng_range(&r, 0, 80 / c.C + 1);
        c.density = (int32_t)h_rng_range(&r, 0, 100);
        c.emask = (int32_t)h_rng_range(&r, 0, 1);
        c.causal = (int32_t)h_rng_range(&r, 0, 1);
        c.window = h_rng_range(&r, 0, 3) == 0 ? (int32_t)h_rng_range(&r, 0, 30) : -1;
        c.kpad = h_rng_range(&r, 0, 3) == 0 ? 8 : 0; /* 16-byte rows for device backends */
        c.hkv = (int32_t)h_rng_range(&r, 1, 3);
        c.hq = c.hkv * (int32_t)h_rng_range(&r, 1, 4);
        c.dqk = 8 * (int32_t)h_rng_range(&r, 1, 4);
        c.dvo = 8 * (int32_t)h_rng_range(&r, 1, 4);
        c.qdt = c.odt = f_dts[h_rng_range(&r, 0, 2)];
        c.kvdt = f_dts[h_rng_range(&r, 0, 2)];
        c.cap = h_rng_range(&r, 0, 4) == 0 ? 6.0f : 0.0f;
        c.lse = (int32_t)h_rng_range(&r, 0, 1);
        c.threads = (int32_t)h_rng_range(&r, 1, 6);
        c.seed = h_rng_u64(&r) & 0xffffffffu;
        f_case_run(&c);
    }
    for (int i = 0; i < count; ++i) {
        f_case c;
        f_default(&c, F_CASCADE);
        c.levels = (int32_t)h_rng_range(&r, 1, 5);
        c.batch = (int32_t)h_rng_range(&r, 1, 16);
        c.append = (int32_t)h_rng_range(&r, 0, 1);
        c.causal = c.append ? (int32_t)h_rng_range(&r, 0, 1) : 0;
        c.ps = (int32_t)h_rng_range(&r, 1, 17);
        c.hnd = (int32_t)h_rng_range(&r, 0, 1);
        c.maxkv = (int32_t)h_rng_range(&r, 1, 200);
        c.maxqo = (int32_t)h_rng_range(&r, 1, 12);
        c.graph = h_rng_range(&r, 0, 3) == 0;
        c.empty = (int32_t)h_rng_range(&r, 0, 1);
        c.hkv = (int32_t)h_rng_range(&r, 1, 3);
        c.hq = c.hkv * (int32_t)h_rng_range(&r, 1, 4);
        c.dqk = 8 * (int32_t)h_rng_range(&r, 1, 4);
        c.dvo = 8 * (int32_t)h_rng_range(&r, 1, 4);
        c.qdt = c.odt = f_dts[h_rng_range(&r, 0, 2)];
        c.kvdt = f_dts[h_rng_range(&r, 0, 2)];
        c.cap = h_rng_range(&r, 0, 4) == 0 ? 6.0f : 0.0f;
        c.lse = (int32_t)h_rng_range(&r, 0, 1);
        c.threads = (int32_t)h_rng_range(&r, 1, 6);
        c.seed = h_rng_u64(&r) & 0xffffffffu;
        f_case_run(&c);
    }
}

/* ---------------------------------------------------------------------------------------------- */
/* Errors: status, message, and nothing written                                                    */

#define F_ERR(expr, want)                                                                                          \
    do {                                                                                                           \
        kva_clear_last_error();                                                                                    \
        kva_status st_ = (expr);                                                                                   \
        H_CHECK(st_ == (want) && ((want) == KVA_OK || kva_last_error_message()[0] != '\0'), "%s: got %s (\"%s\"), expected %s", #expr,  \
                kva_status_string(st_), kva_last_error_message(), kva_status_string(want));                        \
    } while (0)

static int f_all_poison(const h_buf* b) {
    for (size_t i = 0; i < b->elems; ++i)
        if (!h_buf_elem_is_poison(b, i)) return 0;
    return 1;
}

/* A 3-level cascade case's backend buffers (pools, q, o and lse poisoned, each level's page table) and run args
   over them, for the error and fault suites. */
typedef struct f_casc_io {
    h_buf kp, vp, q, o, lse, didx[3];
    kva_cascade_run_args a;
} f_casc_io;

/* the suites' 3-level cascade case: 6 requests with appended rows, causal, pages of 4, all tensors of dtype edt */
static void f_casc_io_case(f_case* c, kva_dtype edt) {
    f_default(c, F_CASCADE);
    c->levels = 3;
    c->batch = 6;
    c->append = 1;
    c->causal = 1;
    c->ps = 4;
    c->qdt = c->kvdt = c->odt = edt;
}

static void f_casc_io_make(const f_case* c, const f_casc* s, kva_dtype edt, f_casc_io* io) {
    const int64_t rows = s->rows;
    io->kp = h_buf_alloc(edt, (size_t)(s->pages * c->ps * c->hkv * c->dqk));
    io->vp = h_buf_alloc(edt, (size_t)(s->pages * c->ps * c->hkv * c->dvo));
    io->q = h_buf_alloc(edt, (size_t)(rows * c->hq * c->dqk));
    io->o = h_buf_alloc(edt, (size_t)(rows * c->hq * c->dvo));
    io->lse = h_buf_alloc(KVA_DTYPE_F32, (size_t)(rows * c->hq));
    h_buf_poison(&io->o);
    h_buf_poison(&io->lse);
    h_buf_upload(&io->o);
    h_buf_upload(&io->lse);
    for (int l = 0; l < 3; ++l) io->didx[l] = f_i32_buf(s->indices[l], s->kv_indptr[l][s->nb[l]]);
    kva_cascade_run_args* a = &io->a;
    kva_cascade_run_args_init(a);
    a->q = kva_tensor_make(h_buf_dp(&io->q), edt, 3, rows, c->hq, c->dqk, 0);
    a->o = kva_tensor_make(h_buf_dp(&io->o), edt, 3, rows, c->hq, c->dvo, 0);
    a->lse = kva_tensor_make(h_buf_dp(&io->lse), KVA_DTYPE_F32, 2, rows, c->hq, 0, 0);
    kva_paged_kv_init(&a->paged, h_buf_dp(&io->kp), h_buf_dp(&io->vp), edt, KVA_LAYOUT_NHD, s->pages, c->ps, c->hkv,
                      c->dqk, c->dvo);
    for (int l = 0; l < 3; ++l) a->kv_indices[l] = (const int32_t*)h_buf_dp(&io->didx[l]);
}

static void f_casc_io_free(f_casc_io* io) {
    for (int l = 0; l < 3; ++l) h_buf_free(&io->didx[l]);
    h_buf_free(&io->kp);
    h_buf_free(&io->vp);
    h_buf_free(&io->q);
    h_buf_free(&io->o);
    h_buf_free(&io->lse);
}

/* the last of a 3-level cascade's levels whose page table has entries (-1: none) */
static int f_casc_last_level_with_pages(const f_casc* s) {
    int last = -1;
    for (int l = 0; l < 3; ++l)
        if (s->kv_indptr[l][s->nb[l]] > 0) last = l;
    return last;
}

static void f_suite_errors(void) {
    if (harness_backend_is_device()) {
        /* The format checks are host-side and backend independent (the CPU run covers them); the cases here use
           head dim 16, which device backends do not take. */
        printf("formats errors: skipped on a device backend (host-side validation, covered on the CPU backend)\n");
        return;
    }
    kva_context* ctx = h_context(3);
    /* f32 on the CPU backend; f16 where the device backend takes no f32 queries */
    const kva_dtype edt = harness_backend_is_device() ? KVA_DTYPE_F16 : KVA_DTYPE_F32;
    /* ---- BSR ---- */
    {
        const int64_t M = 10, N = 32;
        const int32_t R = 4, C = 8; /* MB = 3, NB = 4 */
        int32_t indptr[4] = {0, 2, 3, 5};
        int32_t indices[5] = {0, 3, 1, 2, 0};
        kva_attention_desc desc;
        kva_attention_desc_init(&desc, 4, 2, 16, edt);
        kva_bsr_params p;
        kva_bsr_params_init(&p);
        p.num_qo_rows = M;
        p.num_kv_rows = N;
        p.block_rows = R;
        p.block_cols = C;
        p.indptr = indptr;
        p.indices = indices;
        size_t dev = 0, host = 0;
        F_ERR(kva_bsr_workspace_size(ctx, &desc, &p, &dev, &host), KVA_OK);
        F_ERR(kva_bsr_workspace_size(NULL, &desc, &p, &dev, &host), KVA_ERR_INVALID_ARGUMENT);
        F_ERR(kva_bsr_workspace_size(ctx, &desc, NULL, &dev, &host), KVA_ERR_INVALID_ARGUMENT);
        kva_bsr_params b = p;
        b.block_rows = 0;
        F_ERR(kva_bsr_workspace_size(ctx, &desc, &b, &dev, &host), KVA_ERR_INVALID_ARGUMENT);
        b = p;
        b.block_cols = 0;
        F_ERR(kva_bsr_workspace_size(ctx, &desc, &b, &dev, &host), KVA_ERR_INVALID_ARGUMENT);
        b = p;
        b.num_kv_rows = 30; /* not a multiple of C */
        F_ERR(kva_bsr_workspace_size(ctx, &desc, &b, &dev, &host), KVA_ERR_INVALID_ARGUMENT);
        b = p;
        b.num_qo_rows = -1;
        F_ERR(kva_bsr_workspace_size(ctx, &desc, &b, &dev, &host), KVA_ERR_INVALID_ARGUMENT);
        b = p;
        b.indptr = NULL;
        F_ERR(kva_bsr_workspace_size(ctx, &desc, &b, &dev, &host), KVA_ERR_INVALID_ARGUMENT);
        b = p;
        b.indices = NULL;
        F_ERR(kva_bsr_workspace_size(ctx, &desc, &b, &dev, &host), KVA_ERR_INVALID_ARGUMENT);
        int32_t bad_ip0[4] = {1, 2, 3, 5}, bad_ipd[4] = {0, 3, 2, 5};
        b = p;
        b.indptr = bad_ip0;
        F_ERR(kva_bsr_workspace_size(ctx, &desc, &b, &dev, &host), KVA_ERR_PAGETABLE_MALFORMED);
        b.indptr = bad_ipd;
        F_ERR(kva_bsr_workspace_size(ctx, &desc, &b, &dev, &host), KVA_ERR_PAGETABLE_MALFORMED);
        int32_t bad_col[5] = {0, 4, 1, 2, 0}, neg_col[5] = {0, 3, -1, 2, 0}, dup_col[5] = {3, 3, 1, 2, 0};
        b = p;
        b.indices = bad_col;
        F_ERR(kva_bsr_workspace_size(ctx, &desc, &b, &dev, &host), KVA_ERR_PAGE_INDEX_OUT_OF_RANGE);
        b.indices = neg_col;
        F_ERR(kva_bsr_workspace_size(ctx, &desc, &b, &dev, &host), KVA_ERR_PAGE_INDEX_OUT_OF_RANGE);
        b.indices = dup_col;
        F_ERR(kva_bsr_workspace_size(ctx, &desc, &b, &dev, &host), KVA_ERR_INVALID_ARGUMENT);
        /* M x N whose element mask's size overflows 64 bits (each within its own limit): a status, not a wrap */
        {
            int32_t ip0[2] = {0, 0};
            size_t mb = 0;
            b = p;
            b.num_qo_rows = 1 << 24;
            b.block_rows = 1 << 24;
            b.block_cols = 1 << 21;
            b.num_kv_rows = (int64_t)1 << 41;
            b.indptr = ip0;
            b.indices = NULL;
            b.block_mask = NULL;
            F_ERR(kva_bsr_workspace_size(ctx, &desc, &b, &dev, &host), KVA_ERR_UNSUPPORTED);
            F_ERR(kva_bsr_mask_pack(&desc, &b, NULL, 0, &mb), KVA_ERR_UNSUPPORTED);
        }
        kva_attention_desc dd = desc;
        dd.mask_mode = KVA_MASK_CUSTOM;
        F_ERR(kva_bsr_workspace_size(ctx, &dd, &p, &dev, &host), KVA_ERR_INVALID_ARGUMENT);
        dd = desc;
        dd.pos_encoding = KVA_POS_ROPE_LLAMA;
        F_ERR(kva_bsr_workspace_size(ctx, &dd, &p, &dev, &host), KVA_ERR_UNSUPPORTED);
        dd.pos_encoding = KVA_POS_ALIBI;
        F_ERR(kva_bsr_workspace_size(ctx, &dd, &p, &dev, &host), KVA_ERR_UNSUPPORTED);
        dd = desc;
        dd.num_kv_heads = 3;
        F_ERR(kva_bsr_workspace_size(ctx, &dd, &p, &dev, &host), KVA_ERR_INVALID_ARGUMENT);

        /* plan into a too-small workspace: nothing written */
        F_ERR(kva_bsr_workspace_size(ctx, &desc, &p, &dev, &host), KVA_OK);
        h_ws small;
        h_ws_alloc(&small, dev - 256, host);
        kva_bsr_plan plan;
        memset(&plan, 0x77, sizeof plan);
        F_ERR(kva_bsr_plan_make(ctx, &desc, &p, &small.ws, &plan, NULL), KVA_ERR_WORKSPACE_TOO_SMALL);
        h_buf_download(&small.dev);
        {
            int untouched = 1;
            const unsigned char* w = (const unsigned char*)h_buf_hp(&small.dev);
            for (size_t i = 0; i < small.dev.bytes; ++i) untouched &= w[i] == 0x5c;
            H_CHECK(untouched, "bsr plan into a too-small workspace wrote to it");
        }
        h_ws_free(&small);

        /* a causal plan with an element mask, then run errors (outputs stay poisoned) */
        uint8_t emask[5 * 4 * 8];
        for (size_t i = 0; i < sizeof emask; ++i) emask[i] = (uint8_t)(i % 3 != 0);
        p.block_mask = emask;
        desc.mask_mode = KVA_MASK_CAUSAL;
        F_ERR(kva_bsr_workspace_size(ctx, &desc, &p, &dev, &host), KVA_OK);
        h_ws ws;
        h_ws_alloc(&ws, dev, host);
        F_ERR(kva_bsr_plan_make(ctx, &desc, &p, &ws.ws, &plan, NULL), KVA_OK);
        size_t mb = 0, got = 0;
        F_ERR(kva_bsr_mask_pack(&desc, &p, NULL, 0, &mb), KVA_OK);
        H_CHECK((int64_t)mb == plan.mask_bytes && plan.uses_mask, "mask size %zu vs plan %lld", mb,
                (long long)plan.mask_bytes);
        uint8_t tiny[4] = {0xaa, 0xaa, 0xaa, 0xaa};
        F_ERR(kva_bsr_mask_pack(&desc, &p, tiny, mb > 1 ? mb - 1 : 0, &got), mb > 1 ? KVA_ERR_INVALID_ARGUMENT : KVA_OK);
        H_CHECK(tiny[0] == 0xaa, "mask pack into a too-small buffer wrote to it");
        F_ERR(kva_bsr_mask_pack(&desc, &p, tiny, 4, NULL), KVA_ERR_INVALID_ARGUMENT);
        h_buf dm = h_buf_alloc(KVA_DTYPE_U8, mb);
        F_ERR(kva_bsr_mask_pack(&desc, &p, (uint8_t*)h_buf_hp(&dm), mb, &got), KVA_OK);
        h_buf_upload(&dm);
        h_buf di = f_i32_buf(indices, 5);
        h_buf q = h_buf_alloc(edt, (size_t)(M * 4 * 16)), k = h_buf_alloc(edt, (size_t)(N * 2 * 16));
        h_buf v = h_buf_alloc(edt, (size_t)(N * 2 * 16)), o = h_buf_alloc(edt, (size_t)(M * 4 * 16));
        h_buf_poison(&o);
        h_buf_upload(&o);
        kva_bsr_run_args a;
        kva_bsr_run_args_init(&a);
        a.q = kva_tensor_make(h_buf_dp(&q), edt, 3, M, 4, 16, 0);
        a.k = kva_tensor_make(h_buf_dp(&k), edt, 3, N, 2, 16, 0);
        a.v = kva_tensor_make(h_buf_dp(&v), edt, 3, N, 2, 16, 0);
        a.o = kva_tensor_make(h_buf_dp(&o), edt, 3, M, 4, 16, 0);
        a.indices = (const int32_t*)h_buf_dp(&di);
        a.packed_mask = (const uint8_t*)h_buf_dp(&dm);
        a.packed_mask_bytes = (int64_t)mb;
        kva_bsr_run_args e = a;
        e.packed_mask = NULL;
        F_ERR(kva_bsr_run(ctx, &plan, &ws.ws, &e), KVA_ERR_INVALID_ARGUMENT);
        e = a;
        e.packed_mask_bytes = (int64_t)mb - 1;
        F_ERR(kva_bsr_run(ctx, &plan, &ws.ws, &e), KVA_ERR_INVALID_ARGUMENT);
        e = a;
        e.indices = NULL;
        F_ERR(kva_bsr_run(ctx, &plan, &ws.ws, &e), KVA_ERR_INVALID_ARGUMENT);
        e = a;
        e.k.shape[0] = N - 8;
        F_ERR(kva_bsr_run(ctx, &plan, &ws.ws, &e), KVA_ERR_PLAN_MISMATCH);
        e = a;
        e.v.dtype = KVA_DTYPE_BF16;
        F_ERR(kva_bsr_run(ctx, &plan, &ws.ws, &e), KVA_ERR_PLAN_MISMATCH);
        e = a;
        e.q.shape[0] = M + 1;
        F_ERR(kva_bsr_run(ctx, &plan, &ws.ws, &e), KVA_ERR_PLAN_MISMATCH);
        kva_bsr_plan bp = plan;
        bp.magic ^= 1;
        F_ERR(kva_bsr_run(ctx, &bp, &ws.ws, &a), KVA_ERR_PLAN_MISMATCH);
        F_ERR(kva_bsr_run(ctx, &plan, &ws.ws, NULL), KVA_ERR_INVALID_ARGUMENT);
        if (!harness_backend_is_device()) {
            int32_t bad[5] = {0, 3, 1, 2, 9};
            e = a;
            e.indices = bad; /* backend copy disagrees with the plan: the CPU backend checks before writing */
            F_ERR(kva_bsr_run(ctx, &plan, &ws.ws, &e), KVA_ERR_PAGE_INDEX_OUT_OF_RANGE);
        }
        h_buf_download(&o);
        H_CHECK(f_all_poison(&o) && h_buf_guards_ok(&o), "a failed bsr run wrote to o");
        F_ERR(kva_bsr_run(ctx, &plan, &ws.ws, &a), KVA_OK);
        h_buf_free(&q);
        h_buf_free(&k);
        h_buf_free(&v);
        h_buf_free(&o);
        h_buf_free(&dm);
        h_buf_free(&di);
        h_ws_free(&ws);
    }
    /* ---- variable block sizes ---- */
    {
        const int64_t M = 9, N = 12;
        const int32_t MB = 3, NB = 2;
        int32_t rs[6] = {4, 0, 5, 3, 3, 3};
        int32_t cs[4] = {5, 7, 12, 0};
        uint8_t mm[12] = {1, 0, 1, 1, 0, 1, 1, 1, 0, 0, 1, 0};
        kva_attention_desc desc;
        kva_attention_desc_init(&desc, 4, 2, 16, edt);
        desc.mask_mode = KVA_MASK_CAUSAL;
        kva_vbsr_params p;
        kva_vbsr_params_init(&p);
        p.num_qo_rows = M;
        p.num_kv_rows = N;
        p.num_block_rows = MB;
        p.num_block_cols = NB;
        p.block_row_sz = rs;
        p.block_col_sz = cs;
        p.block_mask_map = mm;
        size_t dev = 0, host = 0;
        F_ERR(kva_vbsr_workspace_size(ctx, &desc, &p, &dev, &host), KVA_OK);
        F_ERR(kva_vbsr_workspace_size(NULL, &desc, &p, &dev, &host), KVA_ERR_INVALID_ARGUMENT);
        F_ERR(kva_vbsr_workspace_size(ctx, &desc, NULL, &dev, &host), KVA_ERR_INVALID_ARGUMENT);
        kva_vbsr_params b = p;
        b.num_block_rows = 0;
        F_ERR(kva_vbsr_workspace_size(ctx, &desc, &b, &dev, &host), KVA_ERR_INVALID_ARGUMENT);
        b = p;
        b.block_mask_map = NULL;
        F_ERR(kva_vbsr_workspace_size(ctx, &desc, &b, &dev, &host), KVA_ERR_INVALID_ARGUMENT);
        int32_t bad_rs[6] = {4, 0, 5, 3, 3, 4}, neg_cs[4] = {5, 7, 13, -1};
        b = p;
        b.block_row_sz = bad_rs; /* head 1 sums to 10 */
        F_ERR(kva_vbsr_workspace_size(ctx, &desc, &b, &dev, &host), KVA_ERR_INVALID_ARGUMENT);
        b = p;
        b.block_col_sz = neg_cs;
        F_ERR(kva_vbsr_workspace_size(ctx, &desc, &b, &dev, &host), KVA_ERR_INVALID_ARGUMENT);
        kva_attention_desc bd = desc;
        bd.mask_mode = KVA_MASK_CUSTOM;
        F_ERR(kva_vbsr_workspace_size(ctx, &bd, &p, &dev, &host), KVA_ERR_INVALID_ARGUMENT);
        bd = desc;
        bd.pos_encoding = KVA_POS_ALIBI;
        F_ERR(kva_vbsr_workspace_size(ctx, &bd, &p, &dev, &host), KVA_ERR_UNSUPPORTED);
        int64_t nt = 0, nm = 0;
        F_ERR(kva_vbsr_pack(&desc, &p, NULL, 0, NULL, 0, &nt, &nm), KVA_OK);
        H_CHECK(nt == 24 + 24 && nm > 0, "vbsr pack sizes %lld %lld", (long long)nt, (long long)nm);
        int32_t tab[64]; /* 48 entries */
        uint8_t msk[64];
        {
            /* a capacity error leaves every output as it was, the size outputs too */
            int64_t nt2 = -7, nm2 = -7;
            F_ERR(kva_vbsr_pack(&desc, &p, tab, (size_t)nt - 1, msk, sizeof msk, &nt2, &nm2), KVA_ERR_INVALID_ARGUMENT);
            H_CHECK(nt2 == -7 && nm2 == -7, "vbsr pack capacity error wrote sizes %lld %lld", (long long)nt2,
                    (long long)nm2);
        }
        F_ERR(kva_vbsr_pack(&desc, &p, tab, sizeof tab / sizeof tab[0], NULL, 0, &nt, &nm), KVA_ERR_INVALID_ARGUMENT);
        F_ERR(kva_vbsr_pack(&desc, &p, tab, sizeof tab / sizeof tab[0], msk, sizeof msk, &nt, &nm), KVA_OK);
        h_ws ws;
        h_ws_alloc(&ws, dev, host);
        kva_plan hp[2];
        kva_vbsr_plan plan;
        kva_workspace small = ws.ws;
        small.device_bytes = dev - 1;
        F_ERR(kva_vbsr_plan_make(ctx, &desc, &p, &small, hp, &plan, NULL), KVA_ERR_WORKSPACE_TOO_SMALL);
        F_ERR(kva_vbsr_plan_make(ctx, &desc, &p, &ws.ws, NULL, &plan, NULL), KVA_ERR_INVALID_ARGUMENT);
        F_ERR(kva_vbsr_plan_make(ctx, &desc, &p, &ws.ws, hp, &plan, NULL), KVA_OK);
        h_buf q = h_buf_alloc(edt, (size_t)(M * 4 * 16)), o = h_buf_alloc(edt, (size_t)(M * 4 * 16));
        h_buf k = h_buf_alloc(edt, (size_t)(N * 2 * 16)), v = h_buf_alloc(edt, (size_t)(N * 2 * 16));
        h_buf dt = h_buf_alloc(KVA_DTYPE_I32, (size_t)nt), dm = h_buf_alloc(KVA_DTYPE_U8, (size_t)nm);
        memcpy(h_buf_hp(&dt), tab, sizeof(int32_t) * (size_t)nt);
        memcpy(h_buf_hp(&dm), msk, (size_t)nm);
        h_rng er;
        h_rng_seed(&er, 41);
        f_fill(&q, &er);
        f_fill(&k, &er);
        f_fill(&v, &er);
        h_buf_upload(&q);
        h_buf_upload(&k);
        h_buf_upload(&v);
        h_buf_upload(&dt);
        h_buf_upload(&dm);
        h_buf_poison(&o);
        h_buf_upload(&o);
        kva_vbsr_run_args a;
        kva_vbsr_run_args_init(&a);
        a.q = kva_tensor_make(h_buf_dp(&q), edt, 3, M, 4, 16, 0);
        a.o = kva_tensor_make(h_buf_dp(&o), edt, 3, M, 4, 16, 0);
        a.k = kva_tensor_make(h_buf_dp(&k), edt, 3, N, 2, 16, 0);
        a.v = kva_tensor_make(h_buf_dp(&v), edt, 3, N, 2, 16, 0);
        a.table = (const int32_t*)h_buf_dp(&dt);
        a.table_entries = nt;
        a.packed_mask = (const uint8_t*)h_buf_dp(&dm);
        a.packed_mask_bytes = nm;
        kva_vbsr_run_args ba = a;
        ba.table = NULL;
        F_ERR(kva_vbsr_run(ctx, &plan, &ws.ws, &ba), KVA_ERR_INVALID_ARGUMENT);
        ba = a;
        ba.packed_mask_bytes = nm - 1;
        F_ERR(kva_vbsr_run(ctx, &plan, &ws.ws, &ba), KVA_ERR_INVALID_ARGUMENT);
        ba = a;
        ba.o.stride[1] = 0; /* a broadcast view of o: refused before anything is written */
        F_ERR(kva_vbsr_run(ctx, &plan, &ws.ws, &ba), KVA_ERR_INVALID_ARGUMENT);
        ba = a;
        ba.k.shape[1] = 3;
        F_ERR(kva_vbsr_run(ctx, &plan, &ws.ws, &ba), KVA_ERR_PLAN_MISMATCH);
        kva_vbsr_plan bp = plan;
        bp.magic = 0;
        F_ERR(kva_vbsr_run(ctx, &bp, &ws.ws, &a), KVA_ERR_PLAN_MISMATCH);
        kva_plan saved = hp[1];
        hp[1] = hp[0]; /* the caller's array changed under the plan */
        F_ERR(kva_vbsr_run(ctx, &plan, &ws.ws, &a), KVA_ERR_PLAN_MISMATCH);
        hp[1] = saved;
        /* an out-of-range table entry in the last head: nothing written, not even head 0 */
        ((int32_t*)h_buf_hp(&dt))[nt - 1] = (int32_t)N;
        h_buf_upload(&dt);
        F_ERR(kva_vbsr_run(ctx, &plan, &ws.ws, &a), KVA_ERR_PAGE_INDEX_OUT_OF_RANGE);
        h_buf_download(&o);
        H_CHECK(f_all_poison(&o), "vbsr: output written although run failed");
        ((int32_t*)h_buf_hp(&dt))[nt - 1] = tab[nt - 1];
        h_buf_upload(&dt);
        F_ERR(kva_vbsr_run(ctx, &plan, &ws.ws, &a), KVA_OK);
        h_buf_download(&o);
        H_CHECK(!f_all_poison(&o) && h_buf_guards_ok(&o), "vbsr: run wrote nothing or overran");
        h_buf_free(&q);
        h_buf_free(&o);
        h_buf_free(&k);
        h_buf_free(&v);
        h_buf_free(&dt);
        h_buf_free(&dm);
        h_ws_free(&ws);
    }
    /* ---- cascade ---- */
    {
        f_case c;
        f_casc_io_case(&c, edt);
        f_casc s;
        f_casc_make(&c, 77, &s);
        kva_attention_desc desc;
        f_desc(&c, &desc);
        kva_cascade_params p;
        f_casc_params(&c, &s, &p);
        size_t dev = 0, host = 0;
        F_ERR(kva_cascade_workspace_size(ctx, &desc, &p, &dev, &host), KVA_OK);
        F_ERR(kva_cascade_workspace_size(NULL, &desc, &p, &dev, &host), KVA_ERR_INVALID_ARGUMENT);
        F_ERR(kva_cascade_workspace_size(ctx, &desc, NULL, &dev, &host), KVA_ERR_INVALID_ARGUMENT);
        kva_cascade_params b = p;
        b.num_levels = 0;
        F_ERR(kva_cascade_workspace_size(ctx, &desc, &b, &dev, &host), KVA_ERR_INVALID_ARGUMENT);
        b.num_levels = KVA_CASCADE_MAX_LEVELS + 1;
        F_ERR(kva_cascade_workspace_size(ctx, &desc, &b, &dev, &host), KVA_ERR_INVALID_ARGUMENT);
        /* a level that does not cover every row */
        int32_t short_qo[64];
        memcpy(short_qo, s.qo_indptr[1], sizeof(int32_t) * (size_t)(s.nb[1] + 1));
        short_qo[s.nb[1]] -= 1;
        b = p;
        b.levels[1].qo_indptr = short_qo;
        F_ERR(kva_cascade_workspace_size(ctx, &desc, &b, &dev, &host), KVA_ERR_INVALID_ARGUMENT);
        /* rows out of order */
        int32_t dec_qo[64];
        memcpy(dec_qo, s.qo_indptr[2], sizeof(int32_t) * (size_t)(s.nb[2] + 1));
        dec_qo[1] = dec_qo[2] + 1;
        b = p;
        b.levels[2].qo_indptr = dec_qo;
        F_ERR(kva_cascade_workspace_size(ctx, &desc, &b, &dev, &host), KVA_ERR_PAGETABLE_MALFORMED);
        b = p;
        b.levels[1].qo_indptr = NULL;
        F_ERR(kva_cascade_workspace_size(ctx, &desc, &b, &dev, &host), KVA_ERR_INVALID_ARGUMENT);
        b = p;
        b.page_size = 0;
        F_ERR(kva_cascade_workspace_size(ctx, &desc, &b, &dev, &host), KVA_ERR_INVALID_ARGUMENT);
        /* page index outside the pool (host copy) in level 2 */
        int32_t bad_idx[256];
        int32_t n2 = s.kv_indptr[2][s.nb[2]];
        memcpy(bad_idx, s.indices[2], sizeof(int32_t) * (size_t)n2);
        if (n2 > 0) {
            bad_idx[n2 - 1] = (int32_t)s.pages;
            b = p;
            b.levels[2].kv_indices = bad_idx;
            F_ERR(kva_cascade_workspace_size(ctx, &desc, &b, &dev, &host), KVA_ERR_PAGE_INDEX_OUT_OF_RANGE);
        }
        kva_attention_desc dd = desc;
        dd.mask_mode = KVA_MASK_CUSTOM;
        F_ERR(kva_cascade_workspace_size(ctx, &dd, &p, &dev, &host), KVA_ERR_UNSUPPORTED);
        dd = desc;
        dd.pos_encoding = KVA_POS_ROPE_LLAMA;
        F_ERR(kva_cascade_workspace_size(ctx, &dd, &p, &dev, &host), KVA_ERR_UNSUPPORTED);
        dd = desc;
        dd.window_left = 4;
        F_ERR(kva_cascade_workspace_size(ctx, &dd, &p, &dev, &host), KVA_ERR_UNSUPPORTED);
        dd = desc;
        dd.score_mode = KVA_SCORE_SIGMOID;
        F_ERR(kva_cascade_workspace_size(ctx, &dd, &p, &dev, &host), KVA_ERR_UNSUPPORTED);
        dd.mask_mode = KVA_MASK_NONE;
        b = p;
        b.num_levels = 1; /* one level is a plain paged prefill: sigmoid and RoPE are fine there */
        b.levels[0] = p.levels[2];
        if (!harness_backend_is_device()) /* (a device backend may not offer sigmoid mode at all) */
            F_ERR(kva_cascade_workspace_size(ctx, &dd, &b, &dev, &host), KVA_OK);

        F_ERR(kva_cascade_workspace_size(ctx, &desc, &p, &dev, &host), KVA_OK);
        kva_cascade_plan plan;
        h_ws small;
        h_ws_alloc(&small, dev - 256, host);
        F_ERR(kva_cascade_plan_make(ctx, &desc, &p, &small.ws, &plan, NULL), KVA_ERR_WORKSPACE_TOO_SMALL);
        h_buf_download(&small.dev);
        {
            int untouched = 1;
            const unsigned char* w = (const unsigned char*)h_buf_hp(&small.dev);
            for (size_t i = 0; i < small.dev.bytes; ++i) untouched &= w[i] == 0x5c;
            H_CHECK(untouched, "cascade plan into a too-small workspace wrote to it");
        }
        h_ws_free(&small);
        h_ws ws;
        h_ws_alloc(&ws, dev + 256, host + 256);
        kva_workspace mis = ws.ws;
        mis.device = (char*)mis.device + 64;
        mis.device_bytes -= 64;
        F_ERR(kva_cascade_plan_make(ctx, &desc, &p, &mis, &plan, NULL), KVA_ERR_ALIGNMENT);
        F_ERR(kva_cascade_plan_make(ctx, &desc, &p, NULL, &plan, NULL), KVA_ERR_INVALID_ARGUMENT);
        F_ERR(kva_cascade_plan_make(ctx, &desc, &p, &ws.ws, &plan, NULL), KVA_OK);

        const int64_t rows = s.rows;
        f_casc_io io;
        f_casc_io_make(&c, &s, edt, &io);
        kva_cascade_run_args a = io.a;
        kva_cascade_run_args e = a;
        const int last_with_pages = f_casc_last_level_with_pages(&s);
        if (last_with_pages > 0) {
            e.kv_indices[last_with_pages] = NULL; /* a later level's table missing: level 0 must not run either */
            F_ERR(kva_cascade_run(ctx, &plan, &ws.ws, &e), KVA_ERR_INVALID_ARGUMENT);
        }
        if (rows > 1) {
            e = a;
            e.o.stride[0] = 0; /* a broadcast view of o */
            F_ERR(kva_cascade_run(ctx, &plan, &ws.ws, &e), KVA_ERR_INVALID_ARGUMENT);
        }
        e = a;
        e.paged.page_size = c.ps + 1;
        F_ERR(kva_cascade_run(ctx, &plan, &ws.ws, &e), KVA_ERR_PLAN_MISMATCH);
        e = a;
        e.paged.num_pages = s.pages - 1;
        F_ERR(kva_cascade_run(ctx, &plan, &ws.ws, &e), KVA_ERR_PLAN_MISMATCH);
        e = a;
        e.o.shape[1] = c.hq + 1;
        F_ERR(kva_cascade_run(ctx, &plan, &ws.ws, &e), KVA_ERR_PLAN_MISMATCH);
        e = a;
        e.lse.dtype = KVA_DTYPE_F16;
        F_ERR(kva_cascade_run(ctx, &plan, &ws.ws, &e), KVA_ERR_PLAN_MISMATCH);
        e = a;
        e.k_scale = NAN;
        F_ERR(kva_cascade_run(ctx, &plan, &ws.ws, &e), KVA_ERR_INVALID_ARGUMENT);
        if (last_with_pages > 0) {
            /* a later level's table one entry short of its plan (kv_num_indices): level 0 must not run either */
            e = a;
            e.kv_num_indices[last_with_pages] = s.kv_indptr[last_with_pages][s.nb[last_with_pages]] - 1;
            if (e.kv_num_indices[last_with_pages] > 0)
                F_ERR(kva_cascade_run(ctx, &plan, &ws.ws, &e), KVA_ERR_PAGETABLE_MALFORMED);
            e = a;
            e.kv_num_indices[last_with_pages] = -1;
            F_ERR(kva_cascade_run(ctx, &plan, &ws.ws, &e), KVA_ERR_INVALID_ARGUMENT);
        }
        F_ERR(kva_cascade_run(ctx, &plan, &mis, &a), KVA_ERR_PLAN_MISMATCH);
        kva_cascade_plan bp = plan;
        bp.magic = 0;
        F_ERR(kva_cascade_run(ctx, &bp, &ws.ws, &a), KVA_ERR_PLAN_MISMATCH);
        bp = plan;
        bp.level_device_offset[1] += 256;
        F_ERR(kva_cascade_run(ctx, &bp, &ws.ws, &a), KVA_ERR_PLAN_MISMATCH);
        /* merge buffers outside the plan's workspace bytes (a corrupted plan): refused, nothing written */
        bp = plan;
        bp.tmp_o_offset = bp.device_bytes;
        F_ERR(kva_cascade_run(ctx, &bp, &ws.ws, &a), KVA_ERR_PLAN_MISMATCH);
        bp = plan;
        bp.tmp_lse_offset = bp.device_bytes - 4;
        F_ERR(kva_cascade_run(ctx, &bp, &ws.ws, &a), KVA_ERR_PLAN_MISMATCH);
        bp = plan;
        bp.tmp_rows = -1;
        F_ERR(kva_cascade_run(ctx, &bp, &ws.ws, &a), KVA_ERR_PLAN_MISMATCH);
        if (!harness_backend_is_device() && last_with_pages > 0) {
            /* the backend copy of a later level's table has a bad page: detected before level 0 runs */
            int32_t n = s.kv_indptr[last_with_pages][s.nb[last_with_pages]];
            int32_t* bad = (int32_t*)malloc(sizeof(int32_t) * (size_t)n);
            memcpy(bad, s.indices[last_with_pages], sizeof(int32_t) * (size_t)n);
            bad[n - 1] = -3;
            e = a;
            e.kv_indices[last_with_pages] = bad;
            F_ERR(kva_cascade_run(ctx, &plan, &ws.ws, &e), KVA_ERR_PAGE_INDEX_OUT_OF_RANGE);
            free(bad);
        }
        h_buf_download(&io.o);
        h_buf_download(&io.lse);
        H_CHECK(f_all_poison(&io.o) && f_all_poison(&io.lse) && h_buf_guards_ok(&io.o),
                "a failed cascade run wrote to o or lse");
        for (int l = 0; l < 3; ++l) a.kv_num_indices[l] = s.kv_indptr[l][s.nb[l]]; /* exact lengths: accepted */
        F_ERR(kva_cascade_run(ctx, &plan, &ws.ws, &a), KVA_OK);
        kva_fault_report rep;
        F_ERR(kva_cascade_read_faults(ctx, &plan, &ws.ws, &rep, NULL), KVA_OK);
        H_CHECK(rep.faulted == 0, "faults reported after a clean run");
        f_casc_io_free(&io);
        h_ws_free(&ws);
        f_casc_free(&s);
    }
    /* init functions tolerate NULL and set defaults */
    kva_bsr_params_init(NULL);
    kva_bsr_run_args_init(NULL);
    kva_cascade_params_init(NULL);
    kva_cascade_run_args_init(NULL);
    kva_bsr_run_args ba;
    kva_bsr_run_args_init(&ba);
    kva_cascade_run_args ca;
    kva_cascade_run_args_init(&ca);
    H_CHECK(ba.k_scale == 1.0f && ba.v_scale == 1.0f && ca.k_scale == 1.0f && ca.v_scale == 1.0f && !ba.indices &&
                !ca.kv_indices[0],
            "run-args init defaults");
}

/* Device fault words (device backends; the CPU backend validates on the host and has none): a cascade whose later
   level has a bad page while an append fault is pending in the context's word. The cascade read reports the level's
   fault (a level without one used to read, report and clear the append word, and the later level's fault was then
   dropped); the next read reports the append fault. */
static void f_suite_faults(void) {
    if (!harness_backend_is_device()) {
        printf("formats faults: skipped on the CPU backend (it validates on the host: no device fault words)\n");
        return;
    }
    kva_context* ctx = h_context(3);
    const kva_dtype edt = KVA_DTYPE_F16;
    f_case c;
    f_casc_io_case(&c, edt);
    c.hq = 8;
    c.hkv = 2;
    c.dqk = c.dvo = 64; /* head dims a device backend takes */
    f_casc s;
    f_casc_make(&c, 78, &s);
    kva_attention_desc desc;
    f_desc(&c, &desc);
    kva_cascade_params p;
    f_casc_params(&c, &s, &p);
    size_t dev = 0, host = 0;
    F_ERR(kva_cascade_workspace_size(ctx, &desc, &p, &dev, &host), KVA_OK);
    h_ws ws;
    h_ws_alloc(&ws, dev, host);
    kva_cascade_plan plan;
    F_ERR(kva_cascade_plan_make(ctx, &desc, &p, &ws.ws, &plan, NULL), KVA_OK);
    f_casc_io io;
    f_casc_io_make(&c, &s, edt, &io);
    const kva_cascade_run_args a = io.a;
    const int last_with_pages = f_casc_last_level_with_pages(&s);
    H_CHECK(last_with_pages > 0, "the fault case has pages in a later level");
    kva_fault_report rep;
    kva_cascade_run_args e = a;
    F_ERR(kva_cascade_run(ctx, &plan, &ws.ws, &a), KVA_OK);
    F_ERR(kva_cascade_read_faults(ctx, &plan, &ws.ws, &rep, NULL), KVA_OK);
    H_CHECK(rep.faulted == 0, "faults reported after a clean run");
    if (last_with_pages > 0) {
        /* an append fault pending in the context's word and a device page fault in a later level: the cascade
           read reports the level's fault (not the append's as level 0's), the next read the append's */
        const int32_t one_indptr[2] = {0, 1}, one_last[1] = {1}, one_idx[1] = {0}, bad_b[1] = {5}, pos0[1] = {0};
        h_buf dip = f_i32_buf(one_indptr, 2), dlast = f_i32_buf(one_last, 1), dix = f_i32_buf(one_idx, 1);
        h_buf db = f_i32_buf(bad_b, 1), dpos = f_i32_buf(pos0, 1);
        h_buf ak = h_buf_alloc(edt, (size_t)(c.hkv * c.dqk)), av = h_buf_alloc(edt, (size_t)(c.hkv * c.dvo));
        kva_tensor tak = kva_tensor_make(h_buf_dp(&ak), edt, 3, 1, c.hkv, c.dqk, 0);
        kva_tensor tav = kva_tensor_make(h_buf_dp(&av), edt, 3, 1, c.hkv, c.dvo, 0);
        kva_paged_kv pg = a.paged;
        pg.indices = (const int32_t*)h_buf_dp(&dix);
        pg.indptr = (const int32_t*)h_buf_dp(&dip);
        pg.last_page_len = (const int32_t*)h_buf_dp(&dlast);
        F_ERR(kva_append_paged_kv_cache(ctx, &tak, &tav, (const int32_t*)h_buf_dp(&db),
                                        (const int32_t*)h_buf_dp(&dpos), 1, &pg, 1, NULL), KVA_OK);
        const int32_t n = s.kv_indptr[last_with_pages][s.nb[last_with_pages]];
        int32_t* bad = (int32_t*)malloc(sizeof(int32_t) * (size_t)n);
        memcpy(bad, s.indices[last_with_pages], sizeof(int32_t) * (size_t)n);
        bad[n - 1] = -3;
        h_buf dbad = f_i32_buf(bad, n);
        free(bad);
        e = a;
        e.kv_indices[last_with_pages] = (const int32_t*)h_buf_dp(&dbad);
        F_ERR(kva_cascade_run(ctx, &plan, &ws.ws, &e), KVA_OK);
        F_ERR(kva_cascade_read_faults(ctx, &plan, &ws.ws, &rep, NULL), KVA_OK);
        H_CHECK(rep.faulted && rep.page_index == -3, "cascade faults: the level's bad page first (faulted %d, "
                "request %d, page %lld)", rep.faulted, rep.request, (long long)rep.page_index);
        F_ERR(kva_cascade_read_faults(ctx, &plan, &ws.ws, &rep, NULL), KVA_OK);
        H_CHECK(rep.faulted && rep.request == 0 && rep.page_index == -1, "cascade faults: then the pending append "
                "fault (faulted %d, request %d, page %lld)", rep.faulted, rep.request, (long long)rep.page_index);
        F_ERR(kva_cascade_read_faults(ctx, &plan, &ws.ws, &rep, NULL), KVA_OK);
        H_CHECK(!rep.faulted, "cascade faults: nothing left after both were read");
        h_buf_free(&dip);
        h_buf_free(&dlast);
        h_buf_free(&dix);
        h_buf_free(&db);
        h_buf_free(&dpos);
        h_buf_free(&ak);
        h_buf_free(&av);
        h_buf_free(&dbad);
    }
    f_casc_io_free(&io);
    h_ws_free(&ws);
    f_casc_free(&s);
}

int main(int argc, char** argv) {
    h_init(argc, argv, "test_formats");
    if (h_opt.case_str) {
        f_case c;
        if (!f_parse(h_opt.case_str, &c)) {
            printf("bad --case \"%s\"\n", h_opt.case_str);
            return 2;
        }
        h_opt.verbose = 1;
        f_case_run(&c);
        return h_finish();
    }
    const char* s = h_opt.suite ? h_opt.suite : "all";
    const int all = strcmp(s, "all") == 0;
    if (all || strcmp(s, "bsr") == 0) f_suite_bsr();
    if (all || strcmp(s, "vbsr") == 0) f_suite_vbsr();
    if (all || strcmp(s, "cascade") == 0) f_suite_cascade();
    if (all || strcmp(s, "errors") == 0) f_suite_errors();
    if (all || strcmp(s, "faults") == 0) f_suite_faults();
    if (all || strcmp(s, "fuzz") == 0) f_suite_fuzz();
    return h_finish();
}
