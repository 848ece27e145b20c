/*
 * test_variants.c - user-defined attention variants (docs/variants.md) on the tested backend
 * (KVA_TEST_BACKEND=cpu|cuda), against a float64 reference written from the math of each variant.
 *
 *   test_variants [--suite ops|errors|cache|all] [--case "<line>"] [--verbose]
 *
 * Variants: the two shipped examples (examples/variants/flash_sigmoid.c, attention_sink.c) and "combo", a test
 * variant that uses all five hooks, scalars and a tensor. Each case is one printable line with its seed; --case
 * replays it. Outputs are NaN-poisoned between guard bands before each run. On the CPU backend the variants need
 * a C compiler at run time: without one (kva_variant_create returns KVA_ERR_UNSUPPORTED) the variant cases are
 * skipped with a message; every other failure fails.
 */
#define _POSIX_C_SOURCE 200809L
#include <dirent.h>
#include <fcntl.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "harness.h"

#ifndef KVA_EXAMPLES_DIR
#error "KVA_EXAMPLES_DIR must name examples/variants"
#endif

#define LN2 0.69314718055994530942
#define LOG2E 1.44269504088896340736

/* ---------------------------------------------------------------------------------------------- */
/* Variants                                                                                        */

/* V_LOGITS: the combo source with only its logits mask, logits transform and output transform declared (the hook
   sites of the tensor-core kernel on CUDA; V_COMBO, with query and key transforms, runs on the CUDA-core kernel) */
enum { V_SIGMOID = 0, V_SINK = 1, V_COMBO = 2, V_LOGITS = 3, V_COUNT };
static const char* const var_names[V_COUNT] = {"sigmoid", "sink", "combo", "logits"};

/* combo: every hook; scalars s0 (q scale), s1 (key offset per dim % 3), s2 (cap); tensor t0 [num_qo_heads] */
static const char combo_src[] =
    "KVA_HOOK float kva_query_transform(const kva_vparams* p, float q, int batch, int qo_head, int q_pos, int dim) {\n"
    "    (void)batch, (void)qo_head, (void)q_pos, (void)dim;\n"
    "    return q * p->s[0];\n"
    "}\n"
    "KVA_HOOK float kva_key_transform(const kva_vparams* p, float k, int batch, int kv_head, int kv_pos, int dim) {\n"
    "    (void)batch, (void)kv_head, (void)kv_pos;\n"
    "    return k + p->s[1] * (float)(dim % 3);\n"
    "}\n"
    "KVA_HOOK float kva_logits_transform(const kva_vparams* p, float x, int batch, int qo_head, int kv_head,\n"
    "                                    int q_pos, int kv_pos) {\n"
    "    (void)batch, (void)kv_head, (void)q_pos, (void)kv_pos;\n"
    "    return p->s[2] * tanhf(x / p->s[2]) + 0.1f * p->t[0][qo_head];\n"
    "}\n"
    "KVA_HOOK int kva_logits_mask(const kva_vparams* p, int batch, int qo_head, int kv_head, int q_pos, int kv_pos) {\n"
    "    (void)p, (void)qo_head, (void)kv_head;\n"
    "    return (q_pos + 2 * kv_pos + batch) % 5 != 0;\n"
    "}\n"
    "KVA_HOOK float kva_output_transform(const kva_vparams* p, float o, float lse, int batch, int qo_head,\n"
    "                                    int q_pos, int dim) {\n"
    "    (void)p, (void)batch, (void)q_pos, (void)dim;\n"
    "    return o * (1.0f + 0.01f * (float)qo_head) + (lse == -KVA_INFINITY ? 0.0f : 0.001f * lse);\n"
    "}\n";

static char* read_text(const char* path) {
    FILE* f = fopen(path, "rb");
    if (!f) return NULL;
    fseek(f, 0, SEEK_END);
    long n = ftell(f);
    fseek(f, 0, SEEK_SET);
    char* s = (char*)malloc((size_t)n + 1);
    if (s && fread(s, 1, (size_t)n, f) != (size_t)n) {
        free(s);
        s = NULL;
    }
    if (s) s[n] = '\0';
    fclose(f);
    return s;
}

static char* var_src[V_COUNT];

static void var_spec(int v, kva_variant_spec* s) {
    kva_variant_spec_init(s);
    s->name = v == V_SIGMOID ? "flash_sigmoid" : v == V_SINK ? "attention_sink" : v == V_COMBO ? "combo" : "logits";
    s->source = var_src[v];
    if (v == V_SIGMOID) {
        s->hooks = KVA_VARIANT_LOGITS_TRANSFORM;
        s->use_softmax = 0;
        s->num_scalar_params = 2;
    } else if (v == V_SINK) {
        s->hooks = KVA_VARIANT_OUTPUT_TRANSFORM;
        s->num_tensor_params = 1;
    } else {
        s->hooks = KVA_VARIANT_LOGITS_TRANSFORM | KVA_VARIANT_LOGITS_MASK | KVA_VARIANT_OUTPUT_TRANSFORM;
        if (v == V_COMBO) s->hooks |= KVA_VARIANT_QUERY_TRANSFORM | KVA_VARIANT_KEY_TRANSFORM;
        s->num_scalar_params = 3;
        s->num_tensor_params = 1;
    }
}

static kva_variant* variants[V_COUNT];
static int no_compiler; /* CPU backend without a C compiler: variant cases are skipped */

static int make_variants(kva_context* ctx) {
    for (int v = 0; v < V_COUNT; ++v) {
        if (variants[v]) continue;
        kva_variant_spec s;
        var_spec(v, &s);
        if (!s.source) {
            H_CHECK(0, "cannot read the source of variant %s from %s", var_names[v], KVA_EXAMPLES_DIR);
            return 0;
        }
        kva_status st = kva_variant_create(ctx, &s, &variants[v]);
        if (st == KVA_ERR_UNSUPPORTED && h_opt.backend == KVA_BACKEND_CPU) {
            printf("SKIP: the CPU backend has no C compiler for variants (%s)\n", kva_last_error_message());
            no_compiler = 1;
            return 0;
        }
        if (!H_CHECK(st == KVA_OK, "kva_variant_create(%s): %s: %s", var_names[v], kva_status_string(st),
                     kva_last_error_message()))
            return 0;
    }
    return 1;
}

/* The variants' math in float64 (the reference) */
typedef struct vparams_d {
    double s[16];
    const double* t0; /* tensor 0 */
} vparams_d;

static double ref_qt(int v, const vparams_d* p, double q, int d) {
    (void)d;
    return v == V_COMBO ? q * p->s[0] : q;
}
static double ref_kt(int v, const vparams_d* p, double k, int d) {
    return v == V_COMBO ? k + p->s[1] * (double)(d % 3) : k;
}
static double ref_lt(int v, const vparams_d* p, double x, int qh) {
    if (v == V_SIGMOID) return 1.0 / (1.0 + exp(-(p->s[0] * x + p->s[1])));
    if (v == V_COMBO || v == V_LOGITS) return p->s[2] * tanh(x / p->s[2]) + 0.1 * p->t0[qh];
    return x;
}
static int ref_mask(int v, int b, int qp, int kp) {
    return v == V_COMBO || v == V_LOGITS ? (qp + 2 * kp + b) % 5 != 0 : 1;
}
static double ref_ot(int v, const vparams_d* p, double o, double lse, int qh) {
    if (v == V_SINK) return o / (1.0 + exp(p->t0[qh] - lse * LN2));
    if (v == V_COMBO || v == V_LOGITS) return o * (1.0 + 0.01 * qh) + (isinf(lse) ? 0.0 : 0.001 * lse);
    return o;
}
static int var_softmax(int v) { return v != V_SIGMOID; }

/* ---------------------------------------------------------------------------------------------- */
/* Cases                                                                                           */

enum { OP_DECODE = 0, OP_PAGED, OP_RAGGED, OP_SINGLE_DECODE, OP_SINGLE_PREFILL, OP_COUNT };
static const char* const op_names[OP_COUNT] = {"decode", "paged", "ragged", "single_decode", "single_prefill"};

typedef struct vcase {
    int op, var;
    int batch, max_qo, max_kv;
    int hq, hkv, d;
    kva_dtype qt, kvt, ot;
    int page_size;
    int causal;
    int window;
    int split;      /* fixed_split_size (0 = planner's choice) */
    float k_scale, v_scale;
    int lse;
    uint64_t seed;
} vcase;

static void case_format(const vcase* c, char* buf, size_t n) {
    snprintf(buf, n,
             "op=%s var=%s batch=%d max_qo=%d max_kv=%d hq=%d hkv=%d d=%d q=%s kv=%s o=%s page=%d causal=%d "
             "window=%d split=%d k_scale=%g v_scale=%g lse=%d seed=%llu",
             op_names[c->op], var_names[c->var], c->batch, c->max_qo, c->max_kv, c->hq, c->hkv, c->d,
             h_dtype_str(c->qt), h_dtype_str(c->kvt), h_dtype_str(c->ot), c->page_size, c->causal, c->window, c->split,
             (double)c->k_scale, (double)c->v_scale, c->lse, (unsigned long long)c->seed);
}

static int case_parse(const char* s, vcase* c) {
    memset(c, 0, sizeof *c);
    c->k_scale = c->v_scale = 1.0f;
    c->window = -1;
    c->page_size = 16;
    c->qt = c->kvt = c->ot = KVA_DTYPE_F16;
    char buf[1024];
    snprintf(buf, sizeof buf, "%s", s);
    for (char* tok = strtok(buf, " "); tok; tok = strtok(NULL, " ")) {
        char* eq = strchr(tok, '=');
        if (!eq) return 0;
        *eq = '\0';
        const char* k = tok;
        const char* v = eq + 1;
        if (!strcmp(k, "op")) {
            c->op = -1;
            for (int i = 0; i < OP_COUNT; ++i)
                if (!strcmp(v, op_names[i])) c->op = i;
            if (c->op < 0) return 0;
        } else if (!strcmp(k, "var")) {
            c->var = -1;
            for (int i = 0; i < V_COUNT; ++i)
                if (!strcmp(v, var_names[i])) c->var = i;
            if (c->var < 0) return 0;
        } else if (!strcmp(k, "q")) {
            if (!h_dtype_parse(v, &c->qt)) return 0;
        } else if (!strcmp(k, "kv")) {
            if (!h_dtype_parse(v, &c->kvt)) return 0;
        } else if (!strcmp(k, "o")) {
            if (!h_dtype_parse(v, &c->ot)) return 0;
        } else if (!strcmp(k, "k_scale")) {
            c->k_scale = strtof(v, NULL);
        } else if (!strcmp(k, "v_scale")) {
            c->v_scale = strtof(v, NULL);
        } else if (!strcmp(k, "seed")) {
            c->seed = strtoull(v, NULL, 10);
        } else {
            int x = atoi(v);
            if (!strcmp(k, "batch")) c->batch = x;
            else if (!strcmp(k, "max_qo")) c->max_qo = x;
            else if (!strcmp(k, "max_kv")) c->max_kv = x;
            else if (!strcmp(k, "hq")) c->hq = x;
            else if (!strcmp(k, "hkv")) c->hkv = x;
            else if (!strcmp(k, "d")) c->d = x;
            else if (!strcmp(k, "page")) c->page_size = x;
            else if (!strcmp(k, "causal")) c->causal = x;
            else if (!strcmp(k, "window")) c->window = x;
            else if (!strcmp(k, "split")) c->split = x;
            else if (!strcmp(k, "lse")) c->lse = x;
            else return 0;
        }
    }
    return c->batch > 0 && c->hq > 0 && c->hkv > 0 && c->d > 0;
}

/* ---------------------------------------------------------------------------------------------- */
/* One case: build inputs, run, compare                                                            */

typedef struct req {
    int qo_len, kv_len;
    int qo_off, kv_off; /* rows in q / tokens in the reference K/V */
} req;

static int run_case(const vcase* c) {
    char line[1024];
    case_format(c, line, sizeof line);
    h_logf("case: %s\n", line);
    const int dev = h_backend_device();
    if (dev && (c->qt == KVA_DTYPE_F32 || c->kvt == KVA_DTYPE_F32)) {
        h_nskip++;
        return 1;
    }
    kva_context* ctx = h_context(3);
    if (!make_variants(ctx)) return no_compiler;
    const int v = c->var;
    h_rng rng;
    h_rng_seed(&rng, c->seed);
    const int single = c->op == OP_SINGLE_DECODE || c->op == OP_SINGLE_PREFILL;
    const int B = single ? 1 : c->batch;
    const int decode = c->op == OP_DECODE || c->op == OP_SINGLE_DECODE;
    const int g = c->hq / c->hkv, D = c->d;
    req* rq = (req*)calloc((size_t)B, sizeof *rq);
    int total_qo = 0, total_kv = 0;
    for (int b = 0; b < B; ++b) {
        rq[b].kv_len = (int)h_rng_range(&rng, b == 0 ? 1 : 0, c->max_kv);
        rq[b].qo_len = decode ? 1 : (int)h_rng_range(&rng, 1, c->max_qo);
        rq[b].qo_off = total_qo;
        rq[b].kv_off = total_kv;
        total_qo += rq[b].qo_len;
        total_kv += rq[b].kv_len;
    }
    /* variant parameters */
    vparams_d vpd;
    memset(&vpd, 0, sizeof vpd);
    float scal[16];
    if (v == V_SIGMOID) {
        scal[0] = (float)(1.0 / sqrt((double)D) * (0.8 + 0.4 * h_rng_uniform(&rng)));
        scal[1] = (float)(h_rng_uniform(&rng) - 0.5);
    } else if (v == V_COMBO || v == V_LOGITS) {
        scal[0] = (float)(0.5 + h_rng_uniform(&rng));
        scal[1] = (float)(0.3 * h_rng_normalish(&rng));
        scal[2] = (float)(2.0 + 3.0 * h_rng_uniform(&rng));
    }
    for (int i = 0; i < 16; ++i) vpd.s[i] = scal[i];
    h_buf tens = h_buf_alloc(KVA_DTYPE_F32, (size_t)c->hq);
    double* t0 = (double*)malloc(sizeof(double) * (size_t)c->hq);
    for (int h = 0; h < c->hq; ++h) t0[h] = h_buf_set(&tens, (size_t)h, 2.0 * h_rng_normalish(&rng));
    h_buf_upload(&tens);
    vpd.t0 = t0;
    const void* tptr[1] = {h_buf_dp(&tens)};

    /* q and reference K/V (values as stored in their dtype) */
    h_buf qb = h_buf_alloc(c->qt, (size_t)total_qo * c->hq * D);
    for (size_t i = 0; i < qb.elems; ++i) h_buf_set(&qb, i, h_rng_normalish(&rng));
    h_buf_upload(&qb);
    const size_t kvn = (size_t)(total_kv > 0 ? total_kv : 1) * c->hkv * D;
    double* kref = (double*)malloc(sizeof(double) * kvn);
    double* vref = (double*)malloc(sizeof(double) * kvn);
    const int paged = c->op == OP_DECODE || c->op == OP_PAGED;
    const int ps = c->page_size;
    int32_t* kv_indptr = (int32_t*)calloc((size_t)B + 1, sizeof(int32_t));
    int32_t* qo_indptr = (int32_t*)calloc((size_t)B + 1, sizeof(int32_t));
    int32_t* last = (int32_t*)calloc((size_t)B, sizeof(int32_t));
    int npages = 0;
    for (int b = 0; b < B; ++b) {
        int np = (rq[b].kv_len + ps - 1) / ps;
        kv_indptr[b + 1] = kv_indptr[b] + (paged ? np : rq[b].kv_len);
        qo_indptr[b + 1] = qo_indptr[b] + rq[b].qo_len;
        last[b] = rq[b].kv_len ? (rq[b].kv_len - 1) % ps + 1 : 0;
        npages += np;
    }
    const int pool_pages = npages + 3;
    int32_t* indices = (int32_t*)calloc((size_t)npages + 1, sizeof(int32_t));
    {
        int32_t* perm = (int32_t*)malloc(sizeof(int32_t) * (size_t)pool_pages);
        for (int i = 0; i < pool_pages; ++i) perm[i] = i;
        h_rng_shuffle_i32(&rng, perm, pool_pages);
        for (int i = 0; i < npages; ++i) indices[i] = perm[i];
        free(perm);
    }
    const size_t kv_elems = paged ? (size_t)pool_pages * ps * c->hkv * D : kvn;
    h_buf kb = h_buf_alloc(c->kvt, kv_elems), vb = h_buf_alloc(c->kvt, kv_elems);
    for (size_t i = 0; i < kv_elems; ++i) { /* every element random, also the unused pages */
        h_buf_set(&kb, i, h_rng_normalish(&rng));
        h_buf_set(&vb, i, h_rng_normalish(&rng));
    }
    for (int b = 0; b < B; ++b)
        for (int j = 0; j < rq[b].kv_len; ++j)
            for (int kh = 0; kh < c->hkv; ++kh)
                for (int e = 0; e < D; ++e) {
                    size_t src;
                    if (paged) {
                        int page = indices[kv_indptr[b] + j / ps];
                        src = (((size_t)page * ps + (size_t)(j % ps)) * c->hkv + kh) * D + e;
                    } else {
                        src = (((size_t)rq[b].kv_off + j) * c->hkv + kh) * D + e;
                    }
                    size_t dst = (((size_t)rq[b].kv_off + j) * c->hkv + kh) * D + e;
                    kref[dst] = h_buf_get(&kb, src);
                    vref[dst] = h_buf_get(&vb, src);
                }
    h_buf_upload(&kb);
    h_buf_upload(&vb);
    h_buf idxb = h_buf_alloc(KVA_DTYPE_I32, (size_t)npages + 1);
    memcpy(h_buf_hp(&idxb), indices, sizeof(int32_t) * ((size_t)npages + 1));
    h_buf_upload(&idxb);

    /* reference */
    const double sm = 1.0 / sqrt((double)D);
    const double sm_eff = (v == V_SIGMOID ? 1.0 : sm) * c->k_scale;
    double* oref = (double*)calloc((size_t)total_qo * c->hq * D, sizeof(double));
    double* lref = (double*)calloc((size_t)total_qo * c->hq, sizeof(double));
    double* mag = (double*)calloc((size_t)total_qo * c->hq, sizeof(double));
    double* qv = (double*)malloc(sizeof(double) * (size_t)D);
    double* w = (double*)malloc(sizeof(double) * (size_t)(c->max_kv + 1));
    double* acc = (double*)malloc(sizeof(double) * (size_t)D);
    for (int b = 0; b < B; ++b)
        for (int i = 0; i < rq[b].qo_len; ++i)
            for (int qh = 0; qh < c->hq; ++qh) {
                const int kh = qh / g, qp = rq[b].kv_len - rq[b].qo_len + i;
                const size_t row = (size_t)(rq[b].qo_off + i) * c->hq + qh;
                for (int e = 0; e < D; ++e) qv[e] = ref_qt(v, &vpd, h_buf_get(&qb, row * D + e), e);
                double mx = -INFINITY;
                for (int j = 0; j < rq[b].kv_len; ++j) {
                    int vis = (!c->causal || j <= qp) && (c->window < 0 || j >= qp - c->window) &&
                              ref_mask(v, b, qp, j);
                    if (!vis) {
                        w[j] = NAN;
                        continue;
                    }
                    const double* kr = kref + (((size_t)rq[b].kv_off + j) * c->hkv + kh) * D;
                    double dot = 0;
                    for (int e = 0; e < D; ++e) dot += qv[e] * ref_kt(v, &vpd, kr[e], e);
                    w[j] = ref_lt(v, &vpd, sm_eff * dot, qh);
                    if (w[j] > mx) mx = w[j];
                }
                double den = 0, m = 0;
                for (int e = 0; e < D; ++e) acc[e] = 0;
                for (int j = 0; j < rq[b].kv_len; ++j) {
                    if (isnan(w[j])) continue;
                    double p = var_softmax(v) ? exp(w[j] - mx) : w[j];
                    den += p;
                    const double* vr = vref + (((size_t)rq[b].kv_off + j) * c->hkv + kh) * D;
                    double vm = 0;
                    for (int e = 0; e < D; ++e) {
                        acc[e] += p * vr[e];
                        if (fabs(vr[e]) > vm) vm = fabs(vr[e]);
                    }
                    m += fabs(p) * vm;
                }
                double lse = -INFINITY, norm = 1;
                if (var_softmax(v)) {
                    if (den > 0) {
                        lse = (mx + log(den)) * LOG2E;
                        norm = 1 / den;
                    } else {
                        norm = 0;
                    }
                }
                lref[row] = lse;
                mag[row] = m * norm * fabs(c->v_scale);
                for (int e = 0; e < D; ++e) oref[row * D + e] = ref_ot(v, &vpd, acc[e] * norm * c->v_scale, lse, qh);
            }

    /* descriptor, outputs */
    kva_attention_desc desc;
    kva_attention_desc_init(&desc, c->hq, c->hkv, D, c->qt);
    desc.kv_dtype = c->kvt;
    desc.o_dtype = c->ot;
    desc.mask_mode = c->causal ? KVA_MASK_CAUSAL : KVA_MASK_NONE;
    desc.window_left = c->window;
    desc.sm_scale = v == V_SIGMOID ? 1.0f : 0.0f;
    desc.variant = variants[v];
    const int want_lse = c->lse && var_softmax(v);
    h_buf ob = h_buf_alloc(c->ot, (size_t)total_qo * c->hq * D);
    h_buf lb = h_buf_alloc(KVA_DTYPE_F32, (size_t)total_qo * c->hq);
    h_buf_poison(&ob);
    h_buf_poison(&lb);
    h_buf_upload(&ob);
    h_buf_upload(&lb);
    kva_run_args a;
    kva_run_args_init(&a);
    a.q = kva_tensor_make(h_buf_dp(&qb), c->qt, 3, total_qo, c->hq, D, 0);
    a.o = kva_tensor_make(h_buf_dp(&ob), c->ot, 3, total_qo, c->hq, D, 0);
    if (want_lse) a.lse = kva_tensor_make(h_buf_dp(&lb), KVA_DTYPE_F32, 2, total_qo, c->hq, 0, 0);
    a.k_scale = c->k_scale;
    a.v_scale = c->v_scale;
    a.variant_scalars = scal;
    a.num_variant_scalars = variants[v] ? (v == V_SIGMOID ? 2 : v == V_COMBO || v == V_LOGITS ? 3 : 0) : 0;
    a.variant_tensors = tptr;
    a.num_variant_tensors = v == V_SIGMOID ? 0 : 1;
    kva_status st = KVA_OK;
    h_ws ws;
    memset(&ws, 0, sizeof ws);
    if (paged) {
        st = kva_paged_kv_init(&a.paged, h_buf_dp(&kb), h_buf_dp(&vb), c->kvt, KVA_LAYOUT_NHD, pool_pages, ps, c->hkv,
                               D, D);
        a.paged.indices = (const int32_t*)h_buf_dp(&idxb);
    } else {
        a.k = kva_tensor_make(h_buf_dp(&kb), c->kvt, 3, total_kv, c->hkv, D, 0);
        a.v = kva_tensor_make(h_buf_dp(&vb), c->kvt, 3, total_kv, c->hkv, D, 0);
    }
    if (st == KVA_OK && single) {
        size_t db = 0, hb = 0;
        st = kva_single_workspace_size(ctx, &desc, total_qo, total_kv, &db, &hb);
        if (st == KVA_OK) {
            h_ws_alloc(&ws, db ? db : 256, hb);
            if (c->op == OP_SINGLE_DECODE) {
                a.q = kva_tensor_make(h_buf_dp(&qb), c->qt, 2, c->hq, D, 0, 0);
                a.o = kva_tensor_make(h_buf_dp(&ob), c->ot, 2, c->hq, D, 0, 0);
                if (want_lse) a.lse = kva_tensor_make(h_buf_dp(&lb), KVA_DTYPE_F32, 1, c->hq, 0, 0, 0);
                st = kva_single_decode(ctx, &desc, &a, &ws.ws);
            } else {
                st = kva_single_prefill(ctx, &desc, &a, &ws.ws);
            }
        }
    } else if (st == KVA_OK) {
        kva_plan_params pp;
        kva_plan_params_init(&pp);
        pp.batch_size = B;
        pp.qo_indptr = c->op == OP_DECODE ? NULL : qo_indptr;
        pp.kv_indptr = kv_indptr;
        pp.kv_last_page_len = paged ? last : NULL;
        pp.page_size = ps;
        pp.num_pages = paged ? pool_pages : 0;
        pp.kv_indices = paged ? indices : NULL;
        pp.fixed_split_size = c->split;
        kva_op op = c->op == OP_DECODE ? KVA_OP_BATCH_DECODE
                    : c->op == OP_PAGED ? KVA_OP_BATCH_PREFILL_PAGED
                                        : KVA_OP_BATCH_PREFILL_RAGGED;
        size_t db = 0, hb = 0;
        st = kva_plan_workspace_size(ctx, &desc, op, &pp, &db, &hb);
        if (st == KVA_OK) {
            h_ws_alloc(&ws, db, hb);
            kva_plan plan;
            st = kva_plan_make(ctx, &desc, op, &pp, &ws.ws, &plan, NULL);
            if (st == KVA_OK) st = kva_run(ctx, &plan, &ws.ws, &a);
        }
    }
    int ok = 1;
    H_EXPECT(ok, st == KVA_OK, "%s: %s", kva_status_string(st), kva_last_error_message());
    if (st == KVA_OK) {
        h_buf_download(&ob);
        h_buf_download(&lb);
        H_EXPECT(ok, h_buf_guards_ok(&ob) && h_buf_guards_ok(&lb), "guard bands overwritten");
        h_tol t = h_tol_out(c->ot, c->qt, c->kvt), tl = h_tol_lse();
        int shown = 0;
        for (size_t r = 0; r < (size_t)total_qo * c->hq && shown < 5; ++r) {
            for (int e = 0; e < D && shown < 5; ++e) {
                double got = h_buf_get(&ob, r * D + e);
                if (!h_close(got, oref[r * D + e], t, mag[r])) {
                    H_EXPECT(ok, 0, "o[row %zu, head %zu][%d] = %.7g, reference %.7g (scale %.3g)", r / c->hq,
                             r % c->hq, e, got, oref[r * D + e], mag[r]);
                    ++shown;
                }
            }
            if (want_lse) {
                double got = h_buf_get(&lb, r);
                if (!h_close(got, lref[r], tl, 1)) {
                    H_EXPECT(ok, 0, "lse[row %zu, head %zu] = %.7g, reference %.7g", r / c->hq, r % c->hq, got,
                             lref[r]);
                    ++shown;
                }
            } else {
                H_EXPECT(ok, h_buf_elem_is_poison(&lb, r), "lse[%zu] written though not requested", r);
            }
        }
    }
    if (!ok) printf("  case: %s\n", line);
    H_CHECK(ok, "variant case %s", line);
    h_ws_free(&ws);
    h_buf_free(&qb);
    h_buf_free(&kb);
    h_buf_free(&vb);
    h_buf_free(&ob);
    h_buf_free(&lb);
    h_buf_free(&idxb);
    h_buf_free(&tens);
    free(t0);
    free(kref);
    free(vref);
    free(kv_indptr);
    free(qo_indptr);
    free(last);
    free(indices);
    free(oref);
    free(lref);
    free(mag);
    free(qv);
    free(w);
    free(acc);
    free(rq);
    return ok;
}

static void suite_ops(void) {
    static const kva_dtype qts[] = {KVA_DTYPE_F16, KVA_DTYPE_BF16};
    static const kva_dtype kvts[] = {KVA_DTYPE_F16, KVA_DTYPE_BF16, KVA_DTYPE_E4M3};
    static const kva_dtype ots[] = {KVA_DTYPE_F16, KVA_DTYPE_BF16, KVA_DTYPE_F32};
    h_rng r;
    h_rng_seed(&r, h_opt.seed * 7919u + 11u);
    int n = 0;
    for (int v = 0; v < V_COUNT; ++v)
        for (int op = 0; op < OP_COUNT; ++op)
            for (int rep = 0; rep < 3; ++rep) {
                vcase c;
                memset(&c, 0, sizeof c);
                c.op = op;
                c.var = v;
                c.batch = (int)h_rng_range(&r, 1, 5);
                c.max_qo = op == OP_DECODE || op == OP_SINGLE_DECODE ? 1 : (int)h_rng_range(&r, 1, 24);
                c.max_kv = rep == 2 ? (int)h_rng_range(&r, 300, 700) : (int)h_rng_range(&r, 1, 150);
                static const int heads[][2] = {{4, 4}, {8, 2}, {6, 1}, {16, 1}};
                int hh = (int)h_rng_range(&r, 0, 3);
                c.hq = heads[hh][0];
                c.hkv = heads[hh][1];
                c.d = h_rng_range(&r, 0, 1) ? 64 : 128;
                c.qt = qts[h_rng_range(&r, 0, 1)];
                c.kvt = rep == 1 ? kvts[h_rng_range(&r, 0, 2)] : c.qt;
                c.ot = ots[h_rng_range(&r, 0, 2)];
                c.page_size = (int)(h_rng_range(&r, 0, 2) == 0 ? 1 : h_rng_range(&r, 0, 1) ? 16 : 5);
                c.causal = op != OP_DECODE && op != OP_SINGLE_DECODE && h_rng_range(&r, 0, 1);
                c.window = h_rng_range(&r, 0, 3) == 0 ? (int)h_rng_range(&r, 0, 40) : -1;
                c.split = rep == 2 ? 128 : 0; /* long KV, split into 128-token chunks: the merge path */
                c.k_scale = rep == 1 ? 0.75f : 1.0f;
                c.v_scale = rep == 1 ? 1.5f : 1.0f;
                c.lse = (int)h_rng_range(&r, 0, 1);
                c.seed = h_rng_u64(&r) >> 16;
                if (!run_case(&c) && no_compiler) return;
                if (no_compiler) return;
                ++n;
            }
    /* CPU-only dtypes (f32 q/KV): skipped on a device */
    for (int v = 0; v < V_COUNT; ++v) {
        vcase c;
        memset(&c, 0, sizeof c);
        c.op = OP_PAGED;
        c.var = v;
        c.batch = 3;
        c.max_qo = 9;
        c.max_kv = 200;
        c.hq = 6;
        c.hkv = 2;
        c.d = 48;
        c.qt = c.kvt = c.ot = KVA_DTYPE_F32;
        c.page_size = 7;
        c.causal = 1;
        c.window = -1;
        c.split = 128;
        c.k_scale = c.v_scale = 1.0f;
        c.lse = 1;
        c.seed = 1000u + (unsigned)v;
        if (!h_backend_device()) run_case(&c);
    }
    h_logf("%d cases\n", n);
}

/* ---------------------------------------------------------------------------------------------- */
/* Errors: bad specs, bad sources, bad run arguments (outputs untouched), lifetime                 */

#define EXPECT_ST(call, want, ...)                                                                        \
    do {                                                                                                  \
        kva_status st_ = (call);                                                                          \
        H_CHECK(st_ == (want), "%s: got %s (%s), expected %s", #call, kva_status_string(st_),            \
                kva_last_error_message(), kva_status_string(want));                                      \
    } while (0)

static void expect_msg(const char* what, const char* needle) {
    H_CHECK(strstr(kva_last_error_message(), needle) != NULL, "%s: message \"%s\" does not mention \"%s\"", what,
            kva_last_error_message(), needle);
}

static void suite_errors(void) {
    kva_context* ctx = h_context(3);
    if (!make_variants(ctx)) return;
    kva_variant* out = NULL;
    kva_variant_spec s;
    /* spec fields */
    EXPECT_ST(kva_variant_create(ctx, NULL, &out), KVA_ERR_INVALID_ARGUMENT);
    var_spec(V_SINK, &s);
    EXPECT_ST(kva_variant_create(NULL, &s, &out), KVA_ERR_INVALID_ARGUMENT);
    EXPECT_ST(kva_variant_create(ctx, &s, NULL), KVA_ERR_INVALID_ARGUMENT);
    s.name = "9lives";
    EXPECT_ST(kva_variant_create(ctx, &s, &out), KVA_ERR_INVALID_ARGUMENT);
    expect_msg("bad name", "spec->name");
    s.name = "a-b";
    EXPECT_ST(kva_variant_create(ctx, &s, &out), KVA_ERR_INVALID_ARGUMENT);
    s.name = "a_name_that_is_much_longer_than_the_forty_eight_characters_allowed";
    EXPECT_ST(kva_variant_create(ctx, &s, &out), KVA_ERR_INVALID_ARGUMENT);
    s.name = NULL;
    EXPECT_ST(kva_variant_create(ctx, &s, &out), KVA_ERR_INVALID_ARGUMENT);
    var_spec(V_SINK, &s);
    s.source = "";
    EXPECT_ST(kva_variant_create(ctx, &s, &out), KVA_ERR_INVALID_ARGUMENT);
    expect_msg("empty source", "spec->source");
    var_spec(V_SINK, &s);
    s.hooks = 0x40;
    EXPECT_ST(kva_variant_create(ctx, &s, &out), KVA_ERR_INVALID_ARGUMENT);
    expect_msg("bad hooks", "spec->hooks");
    var_spec(V_SINK, &s);
    s.use_softmax = 2;
    EXPECT_ST(kva_variant_create(ctx, &s, &out), KVA_ERR_INVALID_ARGUMENT);
    expect_msg("bad use_softmax", "spec->use_softmax");
    var_spec(V_SINK, &s);
    s.num_scalar_params = 17;
    EXPECT_ST(kva_variant_create(ctx, &s, &out), KVA_ERR_INVALID_ARGUMENT);
    expect_msg("too many scalars", "spec->num_scalar_params");
    var_spec(V_SINK, &s);
    s.num_tensor_params = 5;
    EXPECT_ST(kva_variant_create(ctx, &s, &out), KVA_ERR_INVALID_ARGUMENT);
    expect_msg("too many tensors", "spec->num_tensor_params");
    s.num_tensor_params = -1;
    EXPECT_ST(kva_variant_create(ctx, &s, &out), KVA_ERR_INVALID_ARGUMENT);
    H_CHECK(out == NULL, "no variant is returned on errors");

    /* sources that do not compile: the compiler's log in the message */
    var_spec(V_SINK, &s);
    s.name = "broken";
    s.source = "KVA_HOOK float kva_output_transform(const kva_vparams* p, float o, float lse, int batch, int qo_head,\n"
               "                                    int q_pos, int dim) {\n"
               "    return o * undeclared_identifier_xyz;\n"
               "}\n";
    EXPECT_ST(kva_variant_create(ctx, &s, &out), KVA_ERR_JIT);
    expect_msg("compile error", "undeclared_identifier_xyz");
    expect_msg("compile error", "broken");
    /* a declared hook the source does not define */
    var_spec(V_SINK, &s);
    s.name = "missing_hook";
    s.hooks |= KVA_VARIANT_QUERY_TRANSFORM;
    EXPECT_ST(kva_variant_create(ctx, &s, &out), KVA_ERR_JIT);
    expect_msg("missing hook", "kva_query_transform");
    H_CHECK(out == NULL, "no variant is returned on errors");

    /* descriptor rules */
    kva_attention_desc d;
    kva_attention_desc_init(&d, 4, 2, 64, KVA_DTYPE_F16);
    H_CHECK(d.variant == NULL, "kva_attention_desc_init sets variant = NULL");
    d.variant = variants[V_SINK];
    EXPECT_ST(kva_attention_desc_check(ctx, &d), KVA_OK);
    d.score_mode = KVA_SCORE_SIGMOID;
    EXPECT_ST(kva_attention_desc_check(ctx, &d), KVA_ERR_INVALID_ARGUMENT);
    d.score_mode = KVA_SCORE_SOFTMAX;
    d.pos_encoding = KVA_POS_ROPE_LLAMA;
    EXPECT_ST(kva_attention_desc_check(ctx, &d), KVA_ERR_UNSUPPORTED);
    d.pos_encoding = KVA_POS_NONE;

    /* run-time arguments: a decode step of 2 requests, outputs poisoned; every error leaves them untouched */
    const int B = 2, H = 4, HKV = 2, D = 64, PS = 4, NP = 6;
    int32_t kv_indptr[3] = {0, 2, 5}, last[2] = {3, 4}, indices[5] = {5, 1, 0, 3, 2};
    h_buf kb = h_buf_alloc(KVA_DTYPE_F16, (size_t)NP * PS * HKV * D), vb = h_buf_alloc(KVA_DTYPE_F16, kb.elems);
    h_buf qb = h_buf_alloc(KVA_DTYPE_F16, (size_t)B * H * D), ob = h_buf_alloc(KVA_DTYPE_F16, qb.elems);
    h_buf lb = h_buf_alloc(KVA_DTYPE_F32, (size_t)B * H), ib = h_buf_alloc(KVA_DTYPE_I32, 5);
    h_buf sink = h_buf_alloc(KVA_DTYPE_F32, (size_t)H);
    h_rng r;
    h_rng_seed(&r, 77);
    for (size_t i = 0; i < kb.elems; ++i) {
        h_buf_set(&kb, i, h_rng_normalish(&r));
        h_buf_set(&vb, i, h_rng_normalish(&r));
    }
    for (size_t i = 0; i < qb.elems; ++i) h_buf_set(&qb, i, h_rng_normalish(&r));
    for (int h = 0; h < H; ++h) h_buf_set(&sink, (size_t)h, 0.5 * h);
    memcpy(h_buf_hp(&ib), indices, sizeof indices);
    h_buf* ups[] = {&kb, &vb, &qb, &ib, &sink};
    for (int i = 0; i < 5; ++i) h_buf_upload(ups[i]);
    h_buf_poison(&ob);
    h_buf_poison(&lb);
    h_buf_upload(&ob);
    h_buf_upload(&lb);
    kva_plan_params pp;
    kva_plan_params_init(&pp);
    pp.batch_size = B;
    pp.kv_indptr = kv_indptr;
    pp.kv_last_page_len = last;
    pp.page_size = PS;
    pp.num_pages = NP;
    size_t db = 0, hb = 0;
    EXPECT_ST(kva_plan_workspace_size(ctx, &d, KVA_OP_BATCH_DECODE, &pp, &db, &hb), KVA_OK);
    h_ws ws;
    h_ws_alloc(&ws, db, hb);
    kva_plan plan;
    EXPECT_ST(kva_batch_decode_plan(ctx, &d, &pp, &ws.ws, &plan, NULL), KVA_OK);
    kva_run_args a;
    kva_run_args_init(&a);
    H_CHECK(a.variant_scalars == NULL && a.num_variant_scalars == 0 && a.variant_tensors == NULL &&
                a.num_variant_tensors == 0,
            "kva_run_args_init clears the variant parameters");
    a.q = kva_tensor_make(h_buf_dp(&qb), KVA_DTYPE_F16, 3, B, H, D, 0);
    a.o = kva_tensor_make(h_buf_dp(&ob), KVA_DTYPE_F16, 3, B, H, D, 0);
    a.lse = kva_tensor_make(h_buf_dp(&lb), KVA_DTYPE_F32, 2, B, H, 0, 0);
    kva_paged_kv_init(&a.paged, h_buf_dp(&kb), h_buf_dp(&vb), KVA_DTYPE_F16, KVA_LAYOUT_NHD, NP, PS, HKV, D, D);
    a.paged.indices = (const int32_t*)h_buf_dp(&ib);
    const void* tp[1] = {h_buf_dp(&sink)};
    const void* tnull[1] = {NULL};
    float sc[2] = {1.0f, 0.0f};
    EXPECT_ST(kva_batch_decode_run(ctx, &plan, &ws.ws, &a), KVA_ERR_INVALID_ARGUMENT); /* tensor missing */
    expect_msg("missing tensor", "num_variant_tensors");
    a.num_variant_tensors = 1;
    EXPECT_ST(kva_batch_decode_run(ctx, &plan, &ws.ws, &a), KVA_ERR_INVALID_ARGUMENT); /* NULL array */
    a.variant_tensors = tnull;
    EXPECT_ST(kva_batch_decode_run(ctx, &plan, &ws.ws, &a), KVA_ERR_INVALID_ARGUMENT); /* NULL tensor */
    expect_msg("NULL tensor", "variant_tensors[0]");
    const void* tmis[1] = {(const char*)h_buf_dp(&sink) + 2};
    a.variant_tensors = tmis;
    EXPECT_ST(kva_batch_decode_run(ctx, &plan, &ws.ws, &a), KVA_ERR_ALIGNMENT); /* f32 data misaligned */
    a.variant_tensors = tp;
    a.variant_scalars = sc;
    a.num_variant_scalars = 2; /* the sink takes none */
    EXPECT_ST(kva_batch_decode_run(ctx, &plan, &ws.ws, &a), KVA_ERR_INVALID_ARGUMENT);
    expect_msg("scalar count", "num_variant_scalars");
    a.num_variant_scalars = 0;
    h_buf_download(&ob);
    h_buf_download(&lb);
    int untouched = h_buf_guards_ok(&ob) && h_buf_guards_ok(&lb);
    for (size_t i = 0; i < ob.elems; ++i) untouched &= h_buf_elem_is_poison(&ob, i);
    for (size_t i = 0; i < lb.elems; ++i) untouched &= h_buf_elem_is_poison(&lb, i);
    H_CHECK(untouched, "host-detected variant errors leave o and lse untouched");
    /* the right arguments run */
    EXPECT_ST(kva_batch_decode_run(ctx, &plan, &ws.ws, &a), KVA_OK);
    h_buf_download(&ob);
    int written = 1;
    for (size_t i = 0; i < ob.elems; ++i) written &= !h_buf_elem_is_poison(&ob, i);
    H_CHECK(written, "a valid variant run writes o");

    /* parameters without a variant */
    kva_attention_desc dn = d;
    dn.variant = NULL;
    kva_plan plain;
    EXPECT_ST(kva_batch_decode_plan(ctx, &dn, &pp, &ws.ws, &plain, NULL), KVA_OK);
    EXPECT_ST(kva_batch_decode_run(ctx, &plain, &ws.ws, &a), KVA_ERR_INVALID_ARGUMENT);
    expect_msg("params without variant", "no variant");

    /* lse with a no-softmax variant */
    kva_attention_desc ds = d;
    ds.variant = variants[V_SIGMOID];
    kva_plan psig;
    EXPECT_ST(kva_batch_decode_plan(ctx, &ds, &pp, &ws.ws, &psig, NULL), KVA_OK);
    kva_run_args as = a;
    as.variant_scalars = sc;
    as.num_variant_scalars = 2;
    as.num_variant_tensors = 0;
    EXPECT_ST(kva_batch_decode_run(ctx, &psig, &ws.ws, &as), KVA_ERR_INVALID_ARGUMENT);
    expect_msg("lse without softmax", "lse");

    /* a variant of another context; a destroyed variant */
    kva_context_options o;
    kva_context_options_init(&o);
    o.backend = h_opt.backend;
    o.num_threads = 2;
    kva_context* ctx2 = NULL;
    EXPECT_ST(kva_context_create(&o, &ctx2), KVA_OK);
    if (ctx2) {
        kva_variant* v2 = NULL;
        var_spec(V_SINK, &s);
        EXPECT_ST(kva_variant_create(ctx2, &s, &v2), KVA_OK);
        kva_attention_desc dx = d;
        dx.variant = v2;
        kva_plan px;
        EXPECT_ST(kva_batch_decode_plan(ctx, &dx, &pp, &ws.ws, &px, NULL), KVA_ERR_INVALID_ARGUMENT);
        expect_msg("foreign variant", "another context");
        EXPECT_ST(kva_attention_desc_check(ctx, &dx), KVA_ERR_INVALID_ARGUMENT);
        kva_context_destroy(ctx2); /* destroys v2 with it */
        EXPECT_ST(kva_variant_destroy(v2), KVA_ERR_INVALID_ARGUMENT); /* after its context: refused, not freed again */
        expect_msg("variant destroyed with its context", "not a live variant");
    }
    kva_variant* vt = NULL;
    var_spec(V_SINK, &s);
    s.name = "short_lived";
    EXPECT_ST(kva_variant_create(ctx, &s, &vt), KVA_OK);
    if (vt) {
        kva_attention_desc dt = d;
        dt.variant = vt;
        kva_plan pt;
        EXPECT_ST(kva_batch_decode_plan(ctx, &dt, &pp, &ws.ws, &pt, NULL), KVA_OK);
        h_buf_poison(&ob);
        h_buf_upload(&ob);
        EXPECT_ST(kva_variant_destroy(vt), KVA_OK);
        EXPECT_ST(kva_variant_destroy(vt), KVA_ERR_INVALID_ARGUMENT); /* a second destroy reads no freed memory */
        expect_msg("variant destroyed twice", "not a live variant");
        EXPECT_ST(kva_batch_decode_run(ctx, &pt, &ws.ws, &a), KVA_ERR_PLAN_MISMATCH);
        expect_msg("destroyed variant", "not a live variant");
        EXPECT_ST(kva_batch_decode_plan(ctx, &dt, &pp, &ws.ws, &pt, NULL), KVA_ERR_INVALID_ARGUMENT);
        h_buf_download(&ob);
        untouched = h_buf_guards_ok(&ob);
        for (size_t i = 0; i < ob.elems; ++i) untouched &= h_buf_elem_is_poison(&ob, i);
        H_CHECK(untouched, "a run with a destroyed variant leaves o untouched");
    }
    EXPECT_ST(kva_variant_destroy(NULL), KVA_OK);

    /* composed formats refuse variants */
    kva_bsr_params bp;
    kva_bsr_params_init(&bp);
    bp.num_qo_rows = 4;
    bp.num_kv_rows = 4;
    bp.block_rows = 2;
    bp.block_cols = 2;
    int32_t bind[3] = {0, 1, 2}, bidx[2] = {0, 1};
    bp.indptr = bind;
    bp.indices = bidx;
    EXPECT_ST(kva_bsr_workspace_size(ctx, &d, &bp, &db, &hb), KVA_ERR_UNSUPPORTED);
    kva_cascade_params cp;
    kva_cascade_params_init(&cp);
    cp.num_levels = 1;
    cp.levels[0].batch_size = B;
    int32_t qi[3] = {0, 1, 2};
    cp.levels[0].qo_indptr = qi;
    cp.levels[0].kv_indptr = kv_indptr;
    cp.levels[0].kv_last_page_len = last;
    cp.page_size = PS;
    cp.num_pages = NP;
    EXPECT_ST(kva_cascade_workspace_size(ctx, &d, &cp, &db, &hb), KVA_ERR_UNSUPPORTED);

    /* CPU: the compiler is found at run time */
    if (h_opt.backend == KVA_BACKEND_CPU) {
        const char* old = getenv("KVA_CC");
        char saved[1024];
        snprintf(saved, sizeof saved, "%s", old ? old : "");
        var_spec(V_SINK, &s);
        s.name = "no_compiler";
        setenv("KVA_CC", "/nonexistent/kvattn-cc", 1);
        EXPECT_ST(kva_variant_create(ctx, &s, &out), KVA_ERR_UNSUPPORTED);
        expect_msg("no compiler", "KVA_CC");
        if (access("/bin/false", X_OK) == 0) {
            s.name = "failing_compiler";
            setenv("KVA_CC", "/bin/false", 1);
            EXPECT_ST(kva_variant_create(ctx, &s, &out), KVA_ERR_JIT);
            expect_msg("failing compiler", "failing_compiler");
        }
        if (old) setenv("KVA_CC", saved, 1);
        else unsetenv("KVA_CC");
    }
    h_ws_free(&ws);
    h_buf* frees[] = {&kb, &vb, &qb, &ob, &lb, &ib, &sink};
    for (int i = 0; i < 7; ++i) h_buf_free(frees[i]);
}

/* ---------------------------------------------------------------------------------------------- */
/* Cache: a fresh cache directory gets one entry per compiled object; a second create reuses it      */

static int count_entries(const char* dir, int* temps) {
    DIR* dd = opendir(dir);
    int n = 0;
    *temps = 0;
    if (!dd) return -1;
    struct dirent* e;
    while ((e = readdir(dd)) != NULL) {
        if (e->d_name[0] == '.') {
            if (strcmp(e->d_name, ".") && strcmp(e->d_name, "..")) ++*temps;
            continue;
        }
        ++n;
    }
    closedir(dd);
    return n;
}

static int n_dir_warns; /* warnings naming kva_context_options.jit_cache_dir */
static char dir_warn_path[64];
static void count_dir_warns(void* user, kva_log_level level, const char* message) {
    (void)user;
    if (level == KVA_LOG_WARN && strstr(message, "cache directory") && strstr(message, dir_warn_path)) ++n_dir_warns;
}

static int n_compiles;    /* "compiling variant" log lines (cold compiles) */
static int n_entry_warns; /* warnings about a cache entry that is not used */
static void count_compiles(void* user, kva_log_level level, const char* message) {
    (void)user;
    if (strstr(message, "compiling variant")) ++n_compiles;
    if (level == KVA_LOG_WARN && strstr(message, "cache entry")) ++n_entry_warns;
}

/* A cache entry (not a dot file) of dir whose name is not `skip`, into out; 0 if none. */
static int find_entry(const char* dir, const char* skip, char* out, size_t size) {
    DIR* dd = opendir(dir);
    if (!dd) return 0;
    struct dirent* e;
    int found = 0;
    while (!found && (e = readdir(dd)) != NULL) {
        if (e->d_name[0] == '.' || (skip && !strcmp(e->d_name, skip))) continue;
        snprintf(out, size, "%s/%s", dir, e->d_name);
        found = 1;
    }
    closedir(dd);
    return found;
}

/* CPU backend: a truncated or corrupted shared object in the cache is detected before it is loaded (it used to be
   dlopen'ed: SIGBUS on a truncated file, a patched object ran) and compiled again; the entry is then whole. So is an
   entry that is group-writable, a symbolic link (here to a complete copy of the entry) or a directory, with a
   warning (those used to be compiled again without one). */
static void cache_damage(const char* dir, const kva_variant_spec* s) {
    char path[1200];
    if (!H_CHECK(find_entry(dir, NULL, path, sizeof path), "a cache entry in %s", dir)) return;
    kva_context_options o;
    kva_context_options_init(&o);
    o.backend = h_opt.backend;
    o.num_threads = 1;
    o.jit_cache_dir = dir;
    o.log_fn = count_compiles;
    o.log_level = KVA_LOG_INFO;
    kva_context* ctx = NULL;
    if (!H_CHECK(kva_context_create(&o, &ctx) == KVA_OK, "context: %s", kva_last_error_message())) return;
    static const char* const what[6] = {"truncated", "object byte", "text byte", "group-writable", "symlink",
                                        "directory"};
    char copy[1300];
    snprintf(copy, sizeof copy, "%s.copy", dir);
    struct stat sb;
    for (int damage = 0; damage < 6; ++damage) {
        if (stat(path, &sb) != 0 || !H_CHECK(sb.st_size > 64, "entry size")) break;
        if (damage == 0) {
            H_CHECK(truncate(path, sb.st_size / 2) == 0, "truncate");
        } else if (damage == 3) {
            H_CHECK(chmod(path, 0620) == 0, "chmod");
        } else if (damage == 4) { /* a complete entry, but through a link */
            H_CHECK(rename(path, copy) == 0 && symlink(copy, path) == 0, "symlink");
        } else if (damage == 5) {
            H_CHECK(unlink(path) == 0 && mkdir(path, 0700) == 0, "directory");
        } else {
            FILE* f = fopen(path, "r+b");
            if (!H_CHECK(f != NULL, "open entry")) break;
            /* 1: a byte inside the object; 2: a byte of the text after it */
            long at = damage == 1 ? 200 : (long)sb.st_size - 60;
            fseek(f, at, SEEK_SET);
            int c = fgetc(f);
            fseek(f, at, SEEK_SET);
            fputc(c ^ 0x5a, f);
            fclose(f);
        }
        n_compiles = 0;
        n_entry_warns = 0;
        kva_variant* v = NULL;
        kva_alibi_slopes(0, NULL); /* a failing call before: the create that recovers from the miss keeps its error */
        kva_status st = kva_variant_create(ctx, s, &v);
        H_CHECK(st == KVA_OK && n_compiles == 1 && n_entry_warns >= 1,
                "damaged cache entry (%s): create %s with %d compiles, %d warnings (want OK, 1, >= 1): %s",
                what[damage], kva_status_string(st), n_compiles, n_entry_warns, kva_last_error_message());
        H_CHECK(kva_last_error_status() == KVA_ERR_INVALID_ARGUMENT,
                "damaged cache entry (%s): the last error after a create that succeeded is the earlier one (%s: %s)",
                what[damage], kva_status_string(kva_last_error_status()), kva_last_error_message());
        kva_variant_destroy(v);
        unlink(copy);
        if (damage == 5) { /* the directory stays (never removed): every create compiles; a file in its place again */
            H_CHECK(rmdir(path) == 0, "rmdir");
            st = kva_variant_create(ctx, s, &v);
            H_CHECK(st == KVA_OK, "create after the directory is gone: %s", kva_last_error_message());
            kva_variant_destroy(v);
        }
        n_compiles = 0;
        v = NULL;
        st = kva_variant_create(ctx, s, &v);
        H_CHECK(st == KVA_OK && n_compiles == 0, "after the recompile the entry is whole: create %s with %d compiles",
                kva_status_string(st), n_compiles);
        kva_variant_destroy(v);
    }
    kva_context_destroy(ctx);
}

/* CPU backend: a complete entry in a cache directory the user may read but not write is a hit (the checked object is
   loaded through a private copy in a private temporary directory); it used to be compiled again on every create,
   because the private copy was written into the cache directory. Root writes into any directory, so the check runs
   in a child process, as user 65534 when the test runs as root. The child's verdict is its exit status. */
static int cache_readonly_child(const kva_variant_spec* s) {
    if (geteuid() == 0 && (setgid(65534) != 0 || setuid(65534) != 0)) return 77;
    char dir[] = "/tmp/kvattn-variant-rocache-XXXXXX";
    if (!mkdtemp(dir)) return 77;
    kva_context_options o;
    kva_context_options_init(&o);
    o.backend = KVA_BACKEND_CPU;
    o.num_threads = 1;
    o.jit_cache_dir = dir;
    o.log_fn = count_compiles;
    o.log_level = KVA_LOG_INFO;
    kva_context* ctx = NULL;
    int fail = 0;
    char entry[1200];
    if (kva_context_create(&o, &ctx) != KVA_OK) {
        printf("FAIL read-only cache: context: %s\n", kva_last_error_message());
        fail = 1;
    }
    for (int pass = 0; pass < 2 && !fail; ++pass) {
        if (pass == 1 && chmod(dir, 0500) != 0) fail = 1; /* warm, now read-only */
        n_compiles = 0;
        kva_variant* v = NULL;
        kva_status st = kva_variant_create(ctx, s, &v);
        if (st != KVA_OK || n_compiles != (pass == 0 ? 1 : 0)) {
            printf("FAIL read-only cache: %s create: %s with %d compiles (want OK, %d): %s\n",
                   pass == 0 ? "cold" : "warm read-only", kva_status_string(st), n_compiles, pass == 0 ? 1 : 0,
                   kva_last_error_message());
            fail = 1;
        }
        kva_variant_destroy(v);
    }
    kva_context_destroy(ctx);
    int temps = 0;
    if (!fail && count_entries(dir, &temps) != 1) fail = 1;
    if (temps) {
        printf("FAIL read-only cache: %d temporary files left in the cache directory\n", temps);
        fail = 1;
    }
    chmod(dir, 0700);
    while (find_entry(dir, NULL, entry, sizeof entry)) unlink(entry);
    rmdir(dir);
    return fail;
}

static void cache_readonly(const kva_variant_spec* s) {
    fflush(stdout);
    pid_t pid = fork();
    if (pid == 0) {
        int rc = cache_readonly_child(s);
        fflush(stdout);
        _exit(rc);
    }
    int status = 0;
    if (!H_CHECK(pid > 0 && waitpid(pid, &status, 0) == pid, "fork for the read-only cache check")) return;
    if (WIFEXITED(status) && WEXITSTATUS(status) == 77) {
        printf("SKIP: read-only cache check (no user to drop to, or no temporary directory)\n");
        return;
    }
    H_CHECK(WIFEXITED(status) && WEXITSTATUS(status) == 0,
            "a complete entry in a read-only cache directory is loaded without a compile (child status 0x%x)",
            (unsigned)status);
}

/* CPU backend: temporary files of the cache directory left by a process that died (here: every name the old
   numbering, ".<hash>.<pid>.<n>.c" / ".load.so" with a per-process counter n, gave this process for its first 1024
   compiles, as a restarted server with the same pid would find them) are neither reused nor, while recent, removed: a
   create used to fail with "cannot write ... (File exists)" and delete the dead process's file. Temporary files last
   written more than an hour ago are removed by a cache miss (kva__jit_sweep). */
static void cache_stale_temps(const char* entry_dir, const kva_variant_spec* s) {
    char entry[1200], dir[] = "/tmp/kvattn-variant-stale-XXXXXX";
    if (!H_CHECK(find_entry(entry_dir, NULL, entry, sizeof entry), "a cache entry in %s", entry_dir)) return;
    if (!H_CHECK(mkdtemp(dir) != NULL, "mkdtemp")) return;
    const char* base = strrchr(entry, '/') + 1;
    const int hash_len = (int)(strlen(base) - 3); /* "<hash>.so" */
    enum { N_STALE = 1024 };
    int planted = 0;
    for (int n = 0; n < N_STALE; ++n)
        for (int k = 0; k < 2; ++k) {
            char p[1400];
            snprintf(p, sizeof p, "%s/.%.*s.%ld.%d.%s", dir, hash_len, base, (long)getpid(), n, k ? "load.so" : "c");
            FILE* f = fopen(p, "wb");
            if (f && fclose(f) == 0) ++planted;
        }
    H_CHECK(planted == 2 * N_STALE, "stale temporary files planted (%d)", planted);
    /* two more, last written two hours ago (a compile killed long since): a cache miss removes them */
    char old_tmp[2][1400];
    for (int k = 0; k < 2; ++k) {
        snprintf(old_tmp[k], sizeof old_tmp[k], "%s/.%.*s.old%03d.%s", dir, hash_len, base, k, k ? "load.so" : "c");
        FILE* f = fopen(old_tmp[k], "wb");
        if (f) fclose(f);
        struct timespec ts[2];
        ts[0].tv_sec = ts[1].tv_sec = time(NULL) - 7200;
        ts[0].tv_nsec = ts[1].tv_nsec = 0;
        H_CHECK(utimensat(AT_FDCWD, old_tmp[k], ts, 0) == 0, "back-dated %s", old_tmp[k]);
    }
    kva_context_options o;
    kva_context_options_init(&o);
    o.backend = h_opt.backend;
    o.num_threads = 1;
    o.jit_cache_dir = dir;
    o.log_fn = count_compiles;
    o.log_level = KVA_LOG_INFO;
    kva_context* ctx = NULL;
    if (H_CHECK(kva_context_create(&o, &ctx) == KVA_OK, "context: %s", kva_last_error_message())) {
        for (int pass = 0; pass < 2; ++pass) { /* cold (compile and load), then warm (load) */
            n_compiles = 0;
            kva_variant* v = NULL;
            kva_status st = kva_variant_create(ctx, s, &v);
            H_CHECK(st == KVA_OK && n_compiles == 1 - pass,
                    "%s create beside stale temporary files: %s with %d compiles (want OK, %d): %s",
                    pass ? "warm" : "cold", kva_status_string(st), n_compiles, 1 - pass, kva_last_error_message());
            kva_variant_destroy(v);
        }
        kva_context_destroy(ctx);
    }
    int temps = 0;
    int entries = count_entries(dir, &temps);
    H_CHECK(entries == 1 && temps == 2 * N_STALE,
            "one entry stored, the recent temporary files left alone and the two-hour-old ones removed (%d entries, "
            "%d dot files, want 1, %d)", entries, temps, 2 * N_STALE);
    H_CHECK(access(old_tmp[0], F_OK) != 0 && access(old_tmp[1], F_OK) != 0, "the two-hour-old temporary files are gone");
    DIR* dd = opendir(dir);
    struct dirent* e;
    while (dd && (e = readdir(dd)) != NULL) {
        if (!strcmp(e->d_name, ".") || !strcmp(e->d_name, "..")) continue;
        char p[1400];
        snprintf(p, sizeof p, "%s/%s", dir, e->d_name);
        unlink(p);
    }
    if (dd) closedir(dd);
    rmdir(dir);
}

/* CPU backend: a cache directory the caller names that cannot be used (here a regular file) leaves variants working,
   compiled privately, with a warning that names it (it used to be passed over silently); the file is untouched. */
static void cache_dir_unusable(const kva_variant_spec* s) {
    char file[] = "/tmp/kvattn-variant-notadir-XXXXXX";
    int fd = mkstemp(file);
    if (!H_CHECK(fd >= 0, "mkstemp")) return;
    close(fd);
    snprintf(dir_warn_path, sizeof dir_warn_path, "%s", file);
    kva_context_options o;
    kva_context_options_init(&o);
    o.backend = KVA_BACKEND_CPU;
    o.num_threads = 1;
    o.jit_cache_dir = file;
    o.log_fn = count_dir_warns;
    o.log_level = KVA_LOG_WARN;
    kva_context* ctx = NULL;
    if (H_CHECK(kva_context_create(&o, &ctx) == KVA_OK, "context: %s", kva_last_error_message())) {
        n_dir_warns = 0;
        kva_variant* v = NULL;
        kva_status st = kva_variant_create(ctx, s, &v);
        H_CHECK(st == KVA_OK && n_dir_warns == 1,
                "cache directory that is a file: create %s with %d warnings naming it (want OK, 1): %s",
                kva_status_string(st), n_dir_warns, kva_last_error_message());
        kva_variant_destroy(v);
        kva_context_destroy(ctx);
    }
    struct stat sb;
    H_CHECK(stat(file, &sb) == 0 && S_ISREG(sb.st_mode) && sb.st_size == 0, "the file is left as it was");
    unlink(file);
}

static void suite_cache(void) {
    char dir[] = "/tmp/kvattn-variant-cache-XXXXXX";
    if (!H_CHECK(mkdtemp(dir) != NULL, "mkdtemp")) return;
    kva_context_options o;
    kva_context_options_init(&o);
    o.backend = h_opt.backend;
    o.num_threads = 2;
    o.jit_cache_dir = dir;
    kva_context* ctx = NULL;
    kva_status st = kva_context_create(&o, &ctx);
    if (!H_CHECK(st == KVA_OK, "context: %s", kva_last_error_message())) return;
    int temps = 0;
    int before = count_entries(dir, &temps);
    kva_variant_spec s;
    var_spec(V_COMBO, &s);
    kva_variant* v1 = NULL;
    st = kva_variant_create(ctx, &s, &v1);
    if (st == KVA_ERR_UNSUPPORTED && h_opt.backend == KVA_BACKEND_CPU) {
        printf("SKIP: the CPU backend has no C compiler for variants (%s)\n", kva_last_error_message());
        kva_context_destroy(ctx);
        rmdir(dir);
        return;
    }
    H_CHECK(st == KVA_OK, "create: %s", kva_last_error_message());
    int after1 = count_entries(dir, &temps);
    /* CPU: the shared object; CUDA: the passed hook check (the kernels follow at plan time) */
    H_CHECK(after1 == before + 1, "a cold create stores one cache entry (%d -> %d entries)", before, after1);
    H_CHECK(temps == 0, "no temporary files are left in the cache directory (%d)", temps);
    kva_variant* v2 = NULL;
    st = kva_variant_create(ctx, &s, &v2); /* same spec: a cache hit */
    H_CHECK(st == KVA_OK, "second create: %s", kva_last_error_message());
    int after2 = count_entries(dir, &temps);
    H_CHECK(after2 == after1, "a second create of the same spec reuses the cache (%d -> %d entries)", after1, after2);
    /* a different source is a different entry */
    char* src2 = (char*)malloc(strlen(s.source) + 64);
    sprintf(src2, "%s\n/* another variant */\n", s.source);
    s.source = src2;
    kva_variant* v3 = NULL;
    st = kva_variant_create(ctx, &s, &v3);
    H_CHECK(st == KVA_OK, "third create: %s", kva_last_error_message());
    int after3 = count_entries(dir, &temps);
    H_CHECK(after3 == after2 + 1, "another source gets its own entry (%d -> %d entries)", after2, after3);
    /* KVATTN_JIT=0: a cached spec is created; one that would need a compile is UNSUPPORTED and nothing is stored */
    {
        setenv("KVATTN_JIT", "0", 1);
        kva_variant* v4 = NULL;
        st = kva_variant_create(ctx, &s, &v4);
        H_CHECK(st == KVA_OK, "KVATTN_JIT=0, cached source: %s", kva_last_error_message());
        kva_variant_destroy(v4);
        char* src3 = (char*)malloc(strlen(s.source) + 64);
        sprintf(src3, "%s\n/* never compiled */\n", s.source);
        const char* keep = s.source;
        s.source = src3;
        v4 = NULL;
        st = kva_variant_create(ctx, &s, &v4);
        H_CHECK(st == KVA_ERR_UNSUPPORTED && v4 == NULL && strstr(kva_last_error_message(), "KVATTN_JIT=0"),
                "KVATTN_JIT=0, new source: %s (want UNSUPPORTED): %s", kva_status_string(st), kva_last_error_message());
        const int after4 = count_entries(dir, &temps);
        H_CHECK(after4 == after3 && temps == 0, "nothing stored with KVATTN_JIT=0 (%d -> %d entries, %d temps)", after3,
                after4, temps);
        unsetenv("KVATTN_JIT");
        s.source = keep;
        free(src3);
    }
    free(src2);
    kva_variant_destroy(v1);
    kva_variant_destroy(v3);
    kva_context_destroy(ctx); /* destroys v2 */
    if (h_opt.backend == KVA_BACKEND_CPU) {
        /* one entry only, the first spec's: empty the directory and create it again */
        var_spec(V_COMBO, &s);
        DIR* d2 = opendir(dir);
        struct dirent* e;
        while (d2 && (e = readdir(d2)) != NULL) {
            if (e->d_name[0] == '.') continue;
            char p[1200];
            snprintf(p, sizeof p, "%s/%s", dir, e->d_name);
            unlink(p);
        }
        if (d2) closedir(d2);
        kva_context* c2 = NULL;
        if (kva_context_create(&o, &c2) == KVA_OK) {
            kva_variant* vk = NULL;
            H_CHECK(kva_variant_create(c2, &s, &vk) == KVA_OK, "recreate: %s", kva_last_error_message());
            kva_context_destroy(c2);
        }
        cache_damage(dir, &s);
        cache_readonly(&s);
        cache_stale_temps(dir, &s);
        cache_dir_unusable(&s);
    }
    /* clean the directory */
    DIR* dd = opendir(dir);
    if (dd) {
        struct dirent* e;
        while ((e = readdir(dd)) != NULL) {
            if (!strcmp(e->d_name, ".") || !strcmp(e->d_name, "..")) continue;
            char p[1024];
            snprintf(p, sizeof p, "%s/%s", dir, e->d_name);
            unlink(p);
        }
        closedir(dd);
    }
    rmdir(dir);
}

int main(int argc, char** argv) {
    h_init(argc, argv, "test_variants");
    var_src[V_SIGMOID] = read_text(KVA_EXAMPLES_DIR "/flash_sigmoid.c");
    var_src[V_SINK] = read_text(KVA_EXAMPLES_DIR "/attention_sink.c");
    var_src[V_COMBO] = (char*)malloc(sizeof combo_src);
    memcpy(var_src[V_COMBO], combo_src, sizeof combo_src);
    var_src[V_LOGITS] = (char*)malloc(sizeof combo_src);
    memcpy(var_src[V_LOGITS], combo_src, sizeof combo_src);
    H_CHECK(var_src[V_SIGMOID] && var_src[V_SINK], "example variant sources under %s", KVA_EXAMPLES_DIR);
    const char* suite = h_opt.suite ? h_opt.suite : "all";
    if (h_opt.case_str) {
        vcase c;
        if (!case_parse(h_opt.case_str, &c)) {
            printf("cannot parse --case \"%s\"\n", h_opt.case_str);
            return 2;
        }
        run_case(&c);
    } else {
        if (!strcmp(suite, "ops") || !strcmp(suite, "all")) suite_ops();
        if (!no_compiler && (!strcmp(suite, "errors") || !strcmp(suite, "all"))) suite_errors();
        if (!no_compiler && (!strcmp(suite, "cache") || !strcmp(suite, "all"))) suite_cache();
    }
    for (int v = 0; v < V_COUNT; ++v) {
        kva_variant_destroy(variants[v]);
        free(var_src[v]);
    }
    h_contexts_destroy();
    return h_finish();
}
