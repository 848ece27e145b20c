/*
 * test_errors.c - adversarial inputs. Each case asserts the exact status, a non-empty kva_last_error_message(),
 * kva_last_error_status() equal to the returned status, and that every output buffer (o, lse, the workspace, the
 * plan struct, KV pools for append) is byte-identical to before the call. docs/errors.md is the table of these.
 *
 * Statuses are pinned to what the implementation returns (run-time tensors that disagree with the plan in shape,
 * rank or dtype: KVA_ERR_PLAN_MISMATCH; NULL pointers and bad strides: KVA_ERR_INVALID_ARGUMENT).
 *
 * A few rows differ by backend (docs/errors.md has the CUDA notes): strides and pointers the CPU backend takes but
 * the CUDA backend refuses (KVA_ERR_ALIGNMENT), and append tokens that are bad only through data in backend memory
 * (batch indices, positions, the page table): the CPU backend reads them on the host and refuses the call before
 * writing anything; the CUDA backend cannot, so its call returns KVA_OK, the kernel skips every bad token (valid
 * tokens are written) and kva_read_faults reports the first bad token.
 *
 * Fixture: a paged prefill batch of 3 requests (qo 3, 2, 1; kv 10, 0, 7; page size 4; 4 query heads over 2 KV
 * heads; head dim 64; f16), plus a decode plan and a ragged plan over the same shapes.
 */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "harness.h"

#define B 3
#define HQ 4
#define HKV 2
#define D 64
#define PS 4
#define NPAGES 12
#define ROWS 6
#define KVTOK 17

typedef struct fx {
    kva_context* ctx;
    kva_context* other_ctx;
    kva_attention_desc d;
    int32_t qo_indptr[B + 1], kv_indptr[B + 1], last[B], indices[8], tok_indptr[B + 1];
    h_buf q, o, lse, kp, vp, k, v, idx_d, indptr_d, last_d, mask_d;
    h_ws ws, ws_dec, ws_rag, ws_other;
    kva_plan plan, plan_dec, plan_rag;
    kva_plan_params pp, pp_dec, pp_rag;
    kva_run_args args, args_rag;
    /* snapshot of every output (host mirrors, guards included) */
    h_buf* outs[8];
    const char* out_names[8];
    int nouts;
    unsigned char* snap[8];
    size_t snap_n[8];
    kva_plan plan_snap[3];
} fx;

static fx F;

static size_t buf_total(const h_buf* b) { return 2 * H_GUARD_BYTES + (b->bytes + 255) / 256 * 256; }

static void fx_snap(void) {
    for (int i = 0; i < F.nouts; ++i) {
        h_buf_download(F.outs[i]);
        free(F.snap[i]);
        F.snap_n[i] = buf_total(F.outs[i]);
        F.snap[i] = (unsigned char*)malloc(F.snap_n[i]);
        memcpy(F.snap[i], F.outs[i]->host, F.snap_n[i]);
    }
    F.plan_snap[0] = F.plan;
    F.plan_snap[1] = F.plan_dec;
    F.plan_snap[2] = F.plan_rag;
}

/* 1 if every output is byte-identical to the snapshot; names the first that changed. */
static int fx_same(const char** which) {
    for (int i = 0; i < F.nouts; ++i) {
        h_buf_download(F.outs[i]);
        if (memcmp(F.snap[i], F.outs[i]->host, F.snap_n[i]) != 0) {
            *which = F.out_names[i];
            return 0;
        }
    }
    if (memcmp(&F.plan_snap[0], &F.plan, sizeof F.plan) || memcmp(&F.plan_snap[1], &F.plan_dec, sizeof F.plan) ||
        memcmp(&F.plan_snap[2], &F.plan_rag, sizeof F.plan)) {
        *which = "a plan struct";
        return 0;
    }
    return 1;
}

/* The buffers that must stay byte-identical across a failing call. */
static void fx_watch(int n, h_buf* const* bufs, const char* const* names) {
    for (int i = 0; i < n; ++i) {
        F.outs[i] = bufs[i];
        F.out_names[i] = names[i];
    }
    F.nouts = n;
}

static void fx_watch_default(void) {
    h_buf* const bufs[] = {&F.o, &F.lse, &F.ws.dev, &F.ws_dec.dev, &F.ws_rag.dev, &F.kp, &F.vp};
    const char* const names[] = {"o", "lse", "workspace", "decode workspace", "ragged workspace", "K pool", "V pool"};
    fx_watch(7, bufs, names);
}

static void err_check(const char* what, kva_status got, kva_status want, kva_status alt) {
    const char* which = "";
    int same = fx_same(&which);
    const char* msg = kva_last_error_message();
    int ok = (got == want || got == alt) && got != KVA_OK;
    int msg_ok = msg && msg[0] != 0;
    int last_ok = kva_last_error_status() == got;
    if (ok && msg_ok && last_ok && same) {
        h_pass();
        h_logf("ok   %-60s %s: %s\n", what, kva_status_string(got), msg);
        return;
    }
    h_failf(__FILE__, __LINE__, "%s: got %s (expected %s%s%s), message \"%s\"%s%s%s", what, kva_status_string(got),
            kva_status_string(want), alt != want ? " or " : "", alt != want ? kva_status_string(alt) : "", msg ? msg : "(null)",
            last_ok ? "" : ", kva_last_error_status() differs", same ? "" : ", modified: ", same ? "" : which);
}

/* ERR(want, alt, what, call): snapshot outputs, make the call, check status, message and untouched outputs. */
#define ERR2(want, alt, what, call) \
    do { \
        fx_snap(); \
        kva_clear_last_error(); \
        kva_status st_ = (call); \
        err_check(what, st_, want, alt); \
    } while (0)
#define ERR(want, what, call) ERR2(want, want, what, call)

static void fill_rand(h_buf* b, h_rng* r) {
    for (size_t i = 0; i < b->elems; ++i) h_buf_set(b, i, h_rng_normalish(r));
    h_buf_upload(b);
}

static kva_tensor t3(void* data, kva_dtype dt, int64_t a, int64_t b, int64_t c) { return kva_tensor_make(data, dt, 3, a, b, c, 0); }

static void fx_init(void) {
    memset(&F, 0, sizeof F);
    h_rng r;
    h_rng_seed(&r, 77);
    F.ctx = h_context(3);
    /* a context of its own (h_context caches one context per device on a device backend, and the CPU one has the
       same worker count, so only the plan's context identity can tell them apart) */
    kva_context_options co;
    kva_context_options_init(&co);
    co.backend = h_opt.backend;
    co.num_threads = h_backend_device() ? 0 : h_opt.threads > 0 ? h_opt.threads : 3;
    kva_status sc = kva_context_create(&co, &F.other_ctx);
    if (!H_CHECK(sc == KVA_OK && F.other_ctx && F.other_ctx != F.ctx, "a second %s context: %s: %s", h_opt.backend_name,
                 kva_status_string(sc), kva_last_error_message())) {
        printf("%d passed, %d failed\n", h_npass, h_nfail);
        exit(1);
    }
    kva_attention_desc_init(&F.d, HQ, HKV, D, KVA_DTYPE_F16);
    int32_t qo[B] = {3, 2, 1}, kv[B] = {10, 0, 7};
    F.qo_indptr[0] = F.kv_indptr[0] = F.tok_indptr[0] = 0;
    for (int b = 0; b < B; ++b) {
        int32_t np = (kv[b] + PS - 1) / PS;
        F.qo_indptr[b + 1] = F.qo_indptr[b] + qo[b];
        F.kv_indptr[b + 1] = F.kv_indptr[b] + np;
        F.tok_indptr[b + 1] = F.tok_indptr[b] + kv[b];
        F.last[b] = np ? kv[b] - (np - 1) * PS : 0;
    }
    int32_t idx[5] = {7, 2, 9, 0, 11};
    memcpy(F.indices, idx, sizeof idx);
    F.q = h_buf_alloc(KVA_DTYPE_F16, ROWS * HQ * D);
    fill_rand(&F.q, &r);
    F.o = h_buf_alloc(KVA_DTYPE_F16, ROWS * HQ * D);
    F.lse = h_buf_alloc(KVA_DTYPE_F32, ROWS * HQ);
    h_buf_poison(&F.o);
    h_buf_poison(&F.lse);
    h_buf_upload(&F.o);
    h_buf_upload(&F.lse);
    F.kp = h_buf_alloc(KVA_DTYPE_F16, NPAGES * PS * HKV * D);
    F.vp = h_buf_alloc(KVA_DTYPE_F16, NPAGES * PS * HKV * D);
    fill_rand(&F.kp, &r);
    fill_rand(&F.vp, &r);
    F.k = h_buf_alloc(KVA_DTYPE_F16, KVTOK * HKV * D);
    F.v = h_buf_alloc(KVA_DTYPE_F16, KVTOK * HKV * D);
    fill_rand(&F.k, &r);
    fill_rand(&F.v, &r);
    F.idx_d = h_buf_alloc(KVA_DTYPE_I32, 5);
    memcpy(h_buf_hp(&F.idx_d), idx, sizeof idx);
    h_buf_upload(&F.idx_d);
    F.indptr_d = h_buf_alloc(KVA_DTYPE_I32, B + 1);
    memcpy(h_buf_hp(&F.indptr_d), F.kv_indptr, sizeof F.kv_indptr);
    h_buf_upload(&F.indptr_d);
    F.last_d = h_buf_alloc(KVA_DTYPE_I32, B);
    memcpy(h_buf_hp(&F.last_d), F.last, sizeof F.last);
    h_buf_upload(&F.last_d);
    F.mask_d = h_buf_alloc(KVA_DTYPE_U8, 16);
    memset(h_buf_hp(&F.mask_d), 0xff, 16);
    h_buf_upload(&F.mask_d);

    kva_plan_params_init(&F.pp);
    F.pp.batch_size = B;
    F.pp.qo_indptr = F.qo_indptr;
    F.pp.kv_indptr = F.kv_indptr;
    F.pp.kv_last_page_len = F.last;
    F.pp.page_size = PS;
    F.pp.num_pages = NPAGES;
    F.pp.kv_indices = F.indices;
    F.pp_dec = F.pp;
    F.pp_dec.qo_indptr = NULL;
    kva_plan_params_init(&F.pp_rag);
    F.pp_rag.batch_size = B;
    F.pp_rag.qo_indptr = F.qo_indptr;
    F.pp_rag.kv_indptr = F.tok_indptr;

    size_t db, hb;
    kva_plan_workspace_size(F.ctx, &F.d, KVA_OP_BATCH_PREFILL_PAGED, &F.pp, &db, &hb);
    h_ws_alloc(&F.ws, db, hb);
    h_ws_alloc(&F.ws_other, db, hb);
    kva_plan_workspace_size(F.ctx, &F.d, KVA_OP_BATCH_DECODE, &F.pp_dec, &db, &hb);
    h_ws_alloc(&F.ws_dec, db, hb);
    kva_plan_workspace_size(F.ctx, &F.d, KVA_OP_BATCH_PREFILL_RAGGED, &F.pp_rag, &db, &hb);
    h_ws_alloc(&F.ws_rag, db, hb);
    kva_status s1 = kva_plan_make(F.ctx, &F.d, KVA_OP_BATCH_PREFILL_PAGED, &F.pp, &F.ws.ws, &F.plan, NULL);
    kva_status s2 = kva_plan_make(F.ctx, &F.d, KVA_OP_BATCH_DECODE, &F.pp_dec, &F.ws_dec.ws, &F.plan_dec, NULL);
    kva_status s3 = kva_plan_make(F.ctx, &F.d, KVA_OP_BATCH_PREFILL_RAGGED, &F.pp_rag, &F.ws_rag.ws, &F.plan_rag, NULL);
    if (!H_CHECK(s1 == KVA_OK && s2 == KVA_OK && s3 == KVA_OK, "fixture plans: %s %s %s: %s", kva_status_string(s1),
                 kva_status_string(s2), kva_status_string(s3), kva_last_error_message())) {
        printf("%d passed, %d failed\n", h_npass, h_nfail);
        exit(1);
    }
    h_buf_download(&F.ws.dev);
    h_buf_download(&F.ws_dec.dev);
    h_buf_download(&F.ws_rag.dev);

    kva_run_args_init(&F.args);
    F.args.q = t3(h_buf_dp(&F.q), KVA_DTYPE_F16, ROWS, HQ, D);
    F.args.o = t3(h_buf_dp(&F.o), KVA_DTYPE_F16, ROWS, HQ, D);
    F.args.lse = kva_tensor_make(h_buf_dp(&F.lse), KVA_DTYPE_F32, 2, ROWS, HQ, 0, 0);
    kva_paged_kv_init(&F.args.paged, h_buf_dp(&F.kp), h_buf_dp(&F.vp), KVA_DTYPE_F16, KVA_LAYOUT_NHD, NPAGES, PS, HKV, D, D);
    F.args.paged.indices = (const int32_t*)h_buf_dp(&F.idx_d);
    F.args.paged.indptr = (const int32_t*)h_buf_dp(&F.indptr_d);
    F.args.paged.last_page_len = (const int32_t*)h_buf_dp(&F.last_d);
    F.args_rag = F.args;
    memset(&F.args_rag.paged, 0, sizeof F.args_rag.paged);
    F.args_rag.k = t3(h_buf_dp(&F.k), KVA_DTYPE_F16, KVTOK, HKV, D);
    F.args_rag.v = t3(h_buf_dp(&F.v), KVA_DTYPE_F16, KVTOK, HKV, D);

    fx_watch_default();
}

/* The fixture's calls succeed (so each error below is caused by its one change). */
static void test_baseline(void) {
    kva_status st = kva_run(F.ctx, &F.plan, &F.ws.ws, &F.args);
    H_CHECK(st == KVA_OK, "baseline paged prefill run: %s: %s", kva_status_string(st), kva_last_error_message());
    kva_run_args a = F.args;
    a.q.shape[0] = a.o.shape[0] = a.lse.shape[0] = B;
    st = kva_run(F.ctx, &F.plan_dec, &F.ws_dec.ws, &a);
    H_CHECK(st == KVA_OK, "baseline decode run: %s: %s", kva_status_string(st), kva_last_error_message());
    st = kva_run(F.ctx, &F.plan_rag, &F.ws_rag.ws, &F.args_rag);
    H_CHECK(st == KVA_OK, "baseline ragged run: %s: %s", kva_status_string(st), kva_last_error_message());
    h_buf_poison(&F.o);
    h_buf_poison(&F.lse);
    h_buf_upload(&F.o);
    h_buf_upload(&F.lse);
}

/* The fixture's run args with zero-row q / o / lse (the fixture's buffers). */
static kva_run_args zero_row_args(void) {
    kva_run_args a = F.args;
    a.q = t3(h_buf_dp(&F.q), KVA_DTYPE_F16, 0, HQ, D);
    a.o = t3(h_buf_dp(&F.o), KVA_DTYPE_F16, 0, HQ, D);
    a.lse = kva_tensor_make(h_buf_dp(&F.lse), KVA_DTYPE_F32, 2, 0, HQ, 0, 0);
    return a;
}

/* A step with no requests (batch_size 0): decode and paged prefill, eager and graph mode, plan and run succeed with
   zero-row q / o / lse (NULL data, as PyTorch gives for empty CUDA tensors, or the fixture's buffers), and nothing
   is written. */
static void test_empty_batch(void) {
    int32_t zero[1] = {0};
    fx_snap();
    for (int graph = 0; graph < 2; ++graph) {
        for (int dec = 0; dec < 2; ++dec) {
            const kva_op op = dec ? KVA_OP_BATCH_DECODE : KVA_OP_BATCH_PREFILL_PAGED;
            kva_plan_params p;
            kva_plan_params_init(&p);
            p.batch_size = 0;
            p.qo_indptr = dec ? NULL : zero;
            p.kv_indptr = zero;
            p.kv_last_page_len = NULL;
            p.page_size = PS;
            p.num_pages = NPAGES;
            if (graph) {
                p.graph_mode = 1;
                p.max_batch_size = B;
                p.max_total_qo_rows = dec ? B : ROWS;
            }
            size_t db = 0, hb = 0;
            kva_status st = graph ? kva_workspace_bound(F.ctx, &F.d, op, B, dec ? B : ROWS, &db, &hb)
                                  : kva_plan_workspace_size(F.ctx, &F.d, op, &p, &db, &hb);
            h_ws w;
            h_ws_alloc(&w, db + 256, hb + 256);
            kva_plan pl;
            if (st == KVA_OK) st = kva_plan_make(F.ctx, &F.d, op, &p, &w.ws, &pl, NULL);
            H_CHECK(st == KVA_OK, "empty batch (%s, %s): plan: %s: %s", dec ? "decode" : "paged prefill",
                    graph ? "graph mode" : "eager", kva_status_string(st), kva_last_error_message());
            for (int nul = 0; nul < 2 && st == KVA_OK; ++nul) {
                kva_run_args a = F.args;
                a.q = t3(nul ? NULL : h_buf_dp(&F.q), KVA_DTYPE_F16, 0, HQ, D);
                a.o = t3(nul ? NULL : h_buf_dp(&F.o), KVA_DTYPE_F16, 0, HQ, D);
                a.lse = kva_tensor_make(nul ? NULL : h_buf_dp(&F.lse), KVA_DTYPE_F32, 2, 0, HQ, 0, 0);
                kva_status sr = kva_run(F.ctx, &pl, &w.ws, &a); /* (fx_same's downloads synchronise) */
                const char* which = "";
                H_CHECK(sr == KVA_OK && fx_same(&which), "empty batch (%s, %s, %s data): run: %s: %s%s%s",
                        dec ? "decode" : "paged prefill", graph ? "graph mode" : "eager", nul ? "NULL" : "buffer",
                        kva_status_string(sr), kva_last_error_message(), sr == KVA_OK ? "; modified: " : "",
                        sr == KVA_OK ? which : "");
            }
            if (graph && st == KVA_OK) {
                /* a graph-mode run reads the work list in its workspace, which a later plan of the same bounds may
                   have filled with requests that have pages: its runs need the page table and the pools even when
                   this plan has no page */
                kva_run_args a = zero_row_args();
                a.paged.indices = NULL;
                ERR(KVA_ERR_INVALID_ARGUMENT, "empty graph-mode plan: run with paged.indices NULL",
                    kva_run(F.ctx, &pl, &w.ws, &a));
                a = zero_row_args();
                a.paged.k_data = NULL;
                ERR(KVA_ERR_INVALID_ARGUMENT, "empty graph-mode plan: run with paged.k_data NULL",
                    kva_run(F.ctx, &pl, &w.ws, &a));
                /* the stale-plan case itself: a later plan of the same bounds, with pages, into the same workspace,
                   then the empty plan run without a page table (was a NULL read in the CPU run's validation) */
                kva_plan_params p2 = p;
                p2.batch_size = B;
                p2.qo_indptr = dec ? NULL : F.qo_indptr;
                p2.kv_indptr = F.kv_indptr;
                p2.kv_last_page_len = F.last;
                p2.kv_indices = F.indices;
                kva_plan pl2;
                kva_status s2 = kva_plan_make(F.ctx, &F.d, op, &p2, &w.ws, &pl2, NULL);
                H_CHECK(s2 == KVA_OK, "graph-mode plan with pages into the empty plan's workspace: %s: %s",
                        kva_status_string(s2), kva_last_error_message());
                a = zero_row_args();
                a.paged.indices = NULL;
                ERR(KVA_ERR_INVALID_ARGUMENT, "stale empty graph-mode plan after a plan with pages: indices NULL",
                    kva_run(F.ctx, &pl, &w.ws, &a));
            }
            h_ws_free(&w);
        }
    }
}

/* ---------------------------------------------------------------------------------------------- */

static void test_context_and_desc(void) {
    kva_context* c = NULL;
    kva_context_options o;
    kva_context_options_init(&o);
    ERR(KVA_ERR_INVALID_ARGUMENT, "context_create: out_context NULL", kva_context_create(&o, NULL));
    o.backend = (kva_backend)7;
    ERR(KVA_ERR_INVALID_ARGUMENT, "context_create: backend 7", kva_context_create(&o, &c));
    kva_context_options_init(&o);
    o.num_threads = -1;
    ERR(KVA_ERR_INVALID_ARGUMENT, "context_create: num_threads -1", kva_context_create(&o, &c));
    kva_context_options_init(&o);
    o.device = -1;
    ERR(KVA_ERR_INVALID_ARGUMENT, "context_create: device -1", kva_context_create(&o, &c));
    H_CHECK(c == NULL, "failed context_create left *out_context untouched");

    kva_attention_desc d = F.d;
    ERR(KVA_ERR_INVALID_ARGUMENT, "desc_check: NULL context", kva_attention_desc_check(NULL, &d));
    ERR(KVA_ERR_INVALID_ARGUMENT, "desc_check: NULL desc", kva_attention_desc_check(F.ctx, NULL));
    /* one change each */
    d = F.d; d.num_qo_heads = 0;
    ERR(KVA_ERR_INVALID_ARGUMENT, "desc: num_qo_heads 0", kva_attention_desc_check(F.ctx, &d));
    d = F.d; d.num_kv_heads = 0;
    ERR(KVA_ERR_INVALID_ARGUMENT, "desc: num_kv_heads 0", kva_attention_desc_check(F.ctx, &d));
    d = F.d; d.num_qo_heads = 6; d.num_kv_heads = 4;
    ERR(KVA_ERR_INVALID_ARGUMENT, "desc: 6 qo heads over 4 kv heads", kva_attention_desc_check(F.ctx, &d));
    d = F.d; d.num_qo_heads = -4;
    ERR(KVA_ERR_INVALID_ARGUMENT, "desc: negative heads", kva_attention_desc_check(F.ctx, &d));
    d = F.d; d.num_qo_heads = 2 * 129; d.num_kv_heads = 2;
    ERR(KVA_ERR_UNSUPPORTED, "desc: group size 129", kva_attention_desc_check(F.ctx, &d));
    d = F.d; d.head_dim_qk = 0;
    ERR(KVA_ERR_INVALID_ARGUMENT, "desc: head_dim_qk 0", kva_attention_desc_check(F.ctx, &d));
    d = F.d; d.head_dim_qk = d.head_dim_vo = 1024;
    ERR(KVA_ERR_UNSUPPORTED, "desc: head dim 1024", kva_attention_desc_check(F.ctx, &d));
    d = F.d; d.q_dtype = KVA_DTYPE_E4M3;
    ERR(KVA_ERR_UNSUPPORTED, "desc: fp8 e4m3 q", kva_attention_desc_check(F.ctx, &d));
    d = F.d; d.q_dtype = KVA_DTYPE_E5M2;
    ERR(KVA_ERR_UNSUPPORTED, "desc: fp8 e5m2 q", kva_attention_desc_check(F.ctx, &d));
    d = F.d; d.o_dtype = KVA_DTYPE_E4M3;
    ERR(KVA_ERR_UNSUPPORTED, "desc: fp8 o", kva_attention_desc_check(F.ctx, &d));
    d = F.d; d.kv_dtype = KVA_DTYPE_I32;
    ERR(KVA_ERR_UNSUPPORTED, "desc: i32 kv", kva_attention_desc_check(F.ctx, &d));
    d = F.d; d.q_dtype = (kva_dtype)42;
    ERR(KVA_ERR_UNSUPPORTED, "desc: q dtype 42", kva_attention_desc_check(F.ctx, &d));
    d = F.d; d.mask_mode = (kva_mask_mode)5;
    ERR(KVA_ERR_INVALID_ARGUMENT, "desc: mask_mode 5", kva_attention_desc_check(F.ctx, &d));
    d = F.d; d.window_left = -2;
    ERR(KVA_ERR_INVALID_ARGUMENT, "desc: window_left -2", kva_attention_desc_check(F.ctx, &d));
    d = F.d; d.logits_soft_cap = -1.0f;
    ERR(KVA_ERR_INVALID_ARGUMENT, "desc: soft cap -1", kva_attention_desc_check(F.ctx, &d));
    d = F.d; d.logits_soft_cap = NAN;
    ERR(KVA_ERR_INVALID_ARGUMENT, "desc: soft cap NaN", kva_attention_desc_check(F.ctx, &d));
    d = F.d; d.sm_scale = INFINITY;
    ERR(KVA_ERR_INVALID_ARGUMENT, "desc: sm_scale inf", kva_attention_desc_check(F.ctx, &d));
    d = F.d; d.pos_encoding = (kva_pos_encoding)9;
    ERR(KVA_ERR_INVALID_ARGUMENT, "desc: pos_encoding 9", kva_attention_desc_check(F.ctx, &d));
    d = F.d; d.pos_encoding = KVA_POS_ROPE_LLAMA; d.head_dim_qk = 63;
    ERR(KVA_ERR_UNSUPPORTED, "desc: RoPE with odd head_dim_qk", kva_attention_desc_check(F.ctx, &d));
    d = F.d; d.pos_encoding = KVA_POS_ROPE_LLAMA; d.rope_theta = -1.0f;
    ERR(KVA_ERR_INVALID_ARGUMENT, "desc: RoPE theta -1", kva_attention_desc_check(F.ctx, &d));
    d = F.d; d.pos_encoding = KVA_POS_ROPE_LLAMA; d.rope_scale = NAN;
    ERR(KVA_ERR_INVALID_ARGUMENT, "desc: RoPE scale NaN", kva_attention_desc_check(F.ctx, &d));
    d = F.d; d.score_mode = (kva_score_mode)3;
    ERR(KVA_ERR_INVALID_ARGUMENT, "desc: score_mode 3", kva_attention_desc_check(F.ctx, &d));
    d = F.d; d.score_mode = KVA_SCORE_SIGMOID; d.sigmoid_bias = NAN;
    ERR(KVA_ERR_INVALID_ARGUMENT, "desc: sigmoid_bias NaN", kva_attention_desc_check(F.ctx, &d));
}

/* The fixture's page table in block-table form: lengths 10, 0, 7 on pages of 4 = 3, 0, 2 pages in rows of 3 entries,
   the entries past each request's pages outside the pool (never read or checked). Fills sl, bt and returns F.pp in
   that form. */
#define BT_STRIDE 3
static kva_plan_params fx_block_table(int32_t sl[B], int32_t bt[BT_STRIDE * B]) {
    const int32_t s0[B] = {10, 0, 7}, t0[BT_STRIDE * B] = {7, 2, 9, -1, NPAGES, -5, 0, 11, INT32_MAX};
    memcpy(sl, s0, sizeof s0);
    memcpy(bt, t0, sizeof t0);
    kva_plan_params pb = F.pp;
    pb.kv_indptr = NULL;
    pb.kv_last_page_len = NULL;
    pb.kv_seq_lens = sl;
    pb.block_table_stride = BT_STRIDE;
    pb.kv_indices = bt;
    return pb;
}

/* Plan errors: the plan struct and the workspace stay untouched. */
static void test_plan(void) {
    kva_plan_params p;
    kva_attention_desc d = F.d;
    const kva_op PP = KVA_OP_BATCH_PREFILL_PAGED;
    kva_workspace* ws = &F.ws.ws;
    kva_plan* pl = &F.plan;
#define PLAN(what, want, params) ERR(want, what, kva_plan_make(F.ctx, &d, PP, params, ws, pl, NULL))
    ERR(KVA_ERR_INVALID_ARGUMENT, "plan: NULL context", kva_plan_make(NULL, &d, PP, &F.pp, ws, pl, NULL));
    ERR(KVA_ERR_INVALID_ARGUMENT, "plan: NULL desc", kva_plan_make(F.ctx, NULL, PP, &F.pp, ws, pl, NULL));
    ERR(KVA_ERR_INVALID_ARGUMENT, "plan: NULL params", kva_plan_make(F.ctx, &d, PP, NULL, ws, pl, NULL));
    ERR(KVA_ERR_INVALID_ARGUMENT, "plan: NULL workspace", kva_plan_make(F.ctx, &d, PP, &F.pp, NULL, pl, NULL));
    ERR(KVA_ERR_INVALID_ARGUMENT, "plan: NULL plan", kva_plan_make(F.ctx, &d, PP, &F.pp, ws, NULL, NULL));
    ERR(KVA_ERR_INVALID_ARGUMENT, "plan: op 9", kva_plan_make(F.ctx, &d, (kva_op)9, &F.pp, ws, pl, NULL));
    d.num_kv_heads = 3;
    PLAN("plan: 4 qo heads over 3 kv heads", KVA_ERR_INVALID_ARGUMENT, &F.pp);
    d = F.d;
    d.q_dtype = KVA_DTYPE_E4M3;
    PLAN("plan: fp8 q", KVA_ERR_UNSUPPORTED, &F.pp);
    d = F.d;
    d.head_dim_qk = d.head_dim_vo = 1024;
    PLAN("plan: head dim 1024", KVA_ERR_UNSUPPORTED, &F.pp);
    d = F.d;

    p = F.pp; p.batch_size = -1;
    PLAN("plan: batch_size -1", KVA_ERR_INVALID_ARGUMENT, &p);
    p = F.pp; p.qo_indptr = NULL;
    PLAN("plan: prefill without qo_indptr", KVA_ERR_INVALID_ARGUMENT, &p);
    p = F.pp; p.kv_indptr = NULL;
    PLAN("plan: kv_indptr NULL", KVA_ERR_INVALID_ARGUMENT, &p);
    p = F.pp; p.kv_last_page_len = NULL;
    PLAN("plan: kv_last_page_len NULL", KVA_ERR_INVALID_ARGUMENT, &p);
    p = F.pp; p.page_size = 0;
    PLAN("plan: page_size 0", KVA_ERR_INVALID_ARGUMENT, &p);
    p = F.pp; p.num_pages = -1;
    PLAN("plan: num_pages -1", KVA_ERR_INVALID_ARGUMENT, &p);
    p = F.pp; p.num_pages = 0;
    PLAN("plan: num_pages 0 with a host page table to check", KVA_ERR_INVALID_ARGUMENT, &p);
    p = F.pp; p.fixed_split_size = -1;
    PLAN("plan: fixed_split_size -1", KVA_ERR_INVALID_ARGUMENT, &p);

    int32_t bad[B + 1];
    memcpy(bad, F.qo_indptr, sizeof bad);
    bad[0] = 1;
    p = F.pp; p.qo_indptr = bad;
    PLAN("plan: qo_indptr[0] = 1", KVA_ERR_PAGETABLE_MALFORMED, &p);
    memcpy(bad, F.qo_indptr, sizeof bad);
    bad[2] = 1; /* 0 3 1 6: decreasing */
    PLAN("plan: qo_indptr decreasing", KVA_ERR_PAGETABLE_MALFORMED, &p);
    int32_t kb[B + 1];
    memcpy(kb, F.kv_indptr, sizeof kb);
    kb[0] = 1;
    p = F.pp; p.kv_indptr = kb;
    PLAN("plan: kv_indptr[0] = 1", KVA_ERR_PAGETABLE_MALFORMED, &p);
    memcpy(kb, F.kv_indptr, sizeof kb);
    kb[2] = 2; /* 0 3 2 5 */
    PLAN("plan: kv_indptr decreasing", KVA_ERR_PAGETABLE_MALFORMED, &p);
    int32_t lb[B];
    memcpy(lb, F.last, sizeof lb);
    lb[0] = 0;
    p = F.pp; p.kv_last_page_len = lb;
    PLAN("plan: last_page_len 0 (non-empty request)", KVA_ERR_PAGETABLE_MALFORMED, &p);
    lb[0] = PS + 1;
    PLAN("plan: last_page_len > page_size", KVA_ERR_PAGETABLE_MALFORMED, &p);
    lb[0] = -3;
    PLAN("plan: last_page_len negative", KVA_ERR_PAGETABLE_MALFORMED, &p);
    int32_t ib[8];
    memcpy(ib, F.indices, sizeof ib);
    ib[3] = -1;
    p = F.pp; p.kv_indices = ib;
    PLAN("plan: host page index -1", KVA_ERR_PAGE_INDEX_OUT_OF_RANGE, &p);
    ib[3] = NPAGES;
    PLAN("plan: host page index == num_pages", KVA_ERR_PAGE_INDEX_OUT_OF_RANGE, &p);
    ib[3] = 0;
    p.num_pages = 9; /* index 11 of request 0 now outside */
    PLAN("plan: host page index >= a smaller num_pages", KVA_ERR_PAGE_INDEX_OUT_OF_RANGE, &p);

    /* the block-table form (kv_seq_lens + block_table_stride, fx_block_table) */
    {
        int32_t sl[B], bt[BT_STRIDE * B];
        const kva_plan_params pb = fx_block_table(sl, bt);
        size_t db = 0, hb = 0;
        kva_status sb = kva_plan_workspace_size(F.ctx, &d, PP, &pb, &db, &hb);
        H_CHECK(sb == KVA_OK && db > 0,
                "plan: a block table with out-of-pool entries past the pages is accepted: %s: %s",
                kva_status_string(sb), kva_last_error_message());
        p = pb; p.block_table_stride = 0;
        PLAN("plan: block table with stride 0", KVA_ERR_INVALID_ARGUMENT, &p);
        p = pb; p.block_table_stride = INT32_MAX;
        PLAN("plan: block table of more than 2^31 entries", KVA_ERR_UNSUPPORTED, &p);
        p = pb; p.block_table_stride = 2; /* request 0 needs 3 pages */
        PLAN("plan: block table row shorter than a request's pages", KVA_ERR_PAGETABLE_MALFORMED, &p);
        sl[2] = -1;
        p = pb;
        PLAN("plan: block table with a negative length", KVA_ERR_PAGETABLE_MALFORMED, &p);
        sl[2] = 7;
        bt[7] = NPAGES; /* request 2's second page */
        PLAN("plan: block table page index == num_pages", KVA_ERR_PAGE_INDEX_OUT_OF_RANGE, &p);
        bt[7] = 11;
        ERR(KVA_ERR_INVALID_ARGUMENT, "plan: block table for ragged KV",
            kva_plan_make(F.ctx, &d, KVA_OP_BATCH_PREFILL_RAGGED, &p, ws, pl, NULL));
        p = pb; p.kv_seq_lens = NULL;
        PLAN("plan: no kv_indptr and no kv_seq_lens", KVA_ERR_INVALID_ARGUMENT, &p);
    }

    /* decode: one row per request; no custom mask */
    int32_t qi[B + 1] = {0, 1, 3, 4};
    p = F.pp_dec; p.qo_indptr = qi;
    ERR(KVA_ERR_INVALID_ARGUMENT, "plan decode: qo_indptr with 2 rows for a request",
        kva_batch_decode_plan(F.ctx, &d, &p, &F.ws_dec.ws, &F.plan_dec, NULL));
    d.mask_mode = KVA_MASK_CUSTOM;
    ERR(KVA_ERR_UNSUPPORTED, "plan decode: custom mask", kva_batch_decode_plan(F.ctx, &d, &F.pp_dec, &F.ws_dec.ws, &F.plan_dec, NULL));
    d = F.d;

    /* graph mode */
    p = F.pp; p.graph_mode = 1; p.max_batch_size = 2; p.max_total_qo_rows = 100;
    PLAN("plan graph: batch_size > max_batch_size", KVA_ERR_INVALID_ARGUMENT, &p);
    p.max_batch_size = 8; p.max_total_qo_rows = 5;
    PLAN("plan graph: rows > max_total_qo_rows", KVA_ERR_INVALID_ARGUMENT, &p);
    p.max_batch_size = 0; p.max_total_qo_rows = 100;
    PLAN("plan graph: max_batch_size 0", KVA_ERR_INVALID_ARGUMENT, &p);
    p.max_batch_size = 8; p.fixed_split_size = 32;
    PLAN("plan graph: with fixed_split_size", KVA_ERR_UNSUPPORTED, &p);
    {
        /* work beyond the assignment's cost limit (2^14 tiles of 2^30 keys over 64 KV heads): refused by the size
           query as by the plan, before the plan writes anything */
        kva_attention_desc dc;
        kva_attention_desc_init(&dc, 64, 64, 1, KVA_DTYPE_F32);
        const int32_t qo2[2] = {0, 1 << 21}, kv2[2] = {0, 1 << 14}, last2[1] = {(1 << 16) - 1};
        kva_plan_params pc;
        kva_plan_params_init(&pc);
        pc.batch_size = 1;
        pc.qo_indptr = qo2;
        pc.kv_indptr = kv2;
        pc.kv_last_page_len = last2;
        pc.page_size = 1 << 16;
        pc.fixed_split_size = 1 << 29;
        size_t cdb = 0, chb = 0;
        ERR(KVA_ERR_UNSUPPORTED, "plan size query: total cost over the planner's limit",
            kva_plan_workspace_size(F.ctx, &dc, PP, &pc, &cdb, &chb));
        ERR(KVA_ERR_UNSUPPORTED, "plan: total cost over the planner's limit", kva_plan_make(F.ctx, &dc, PP, &pc, ws, pl, NULL));
    }

    /* workspace */
    size_t db = 0, hb = 0;
    kva_plan_workspace_size(F.ctx, &d, PP, &F.pp, &db, &hb);
    kva_workspace small = *ws;
    small.device_bytes = db - 1;
    ERR(KVA_ERR_WORKSPACE_TOO_SMALL, "plan: device workspace one byte short", kva_plan_make(F.ctx, &d, PP, &F.pp, &small, pl, NULL));
    H_CHECK(strstr(kva_last_error_message(), "needs") != NULL, "WORKSPACE_TOO_SMALL message gives the bytes needed: \"%s\"",
            kva_last_error_message());
    small = *ws;
    small.device = NULL;
    ERR(KVA_ERR_WORKSPACE_TOO_SMALL, "plan: device workspace NULL", kva_plan_make(F.ctx, &d, PP, &F.pp, &small, pl, NULL));
    if (hb) {
        small = *ws;
        small.host_bytes = hb - 1;
        ERR(KVA_ERR_WORKSPACE_TOO_SMALL, "plan: host workspace one byte short", kva_plan_make(F.ctx, &d, PP, &F.pp, &small, pl, NULL));
    }
    /* misaligned: a pointer 64 bytes into the other workspace (same size available after it? use the big one) */
    h_ws big;
    h_ws_alloc(&big, db + 512, hb + 512);
    small = big.ws;
    small.device = (char*)big.ws.device + 64;
    small.device_bytes = db + 256;
    ERR(KVA_ERR_ALIGNMENT, "plan: device workspace not 256-byte aligned", kva_plan_make(F.ctx, &d, PP, &F.pp, &small, pl, NULL));
    h_ws_free(&big);
    ERR(KVA_ERR_INVALID_ARGUMENT, "workspace_bound: max_batch_size 0",
        kva_workspace_bound(F.ctx, &d, PP, 0, 10, &db, &hb));
    /* bounds beyond what one plan supports (2^30 rows, 2^31 packed rows): the capacities derived from them overflowed
       int64 (nonsense sizes, signed overflow) before they were refused */
    {
        size_t db2 = 12345, hb2 = 678;
        ERR(KVA_ERR_UNSUPPORTED, "workspace_bound: max_total_qo_rows 2^62",
            kva_workspace_bound(F.ctx, &d, PP, 1, (int64_t)1 << 62, &db2, &hb2));
        H_CHECK(db2 == 12345 && hb2 == 678, "workspace_bound: sizes untouched on an error (%zu, %zu)", db2, hb2);
        ERR(KVA_ERR_UNSUPPORTED, "workspace_bound: max_total_qo_rows INT64_MAX, max_batch_size INT32_MAX",
            kva_workspace_bound(F.ctx, &d, PP, INT32_MAX, INT64_MAX, &db2, &hb2));
        ERR(KVA_ERR_UNSUPPORTED, "workspace_bound: 2^29 rows x 4 heads (over 2^31 packed rows)",
            kva_workspace_bound(F.ctx, &d, PP, 1, (int64_t)1 << 29, &db2, &hb2));
        p = F.pp; p.graph_mode = 1; p.max_batch_size = 8; p.max_total_qo_rows = INT64_MAX / 4;
        PLAN("plan graph: max_total_qo_rows INT64_MAX / 4", KVA_ERR_UNSUPPORTED, &p);
        ERR(KVA_ERR_UNSUPPORTED, "workspace_size graph: max_total_qo_rows INT64_MAX / 4",
            kva_plan_workspace_size(F.ctx, &d, PP, &p, &db2, &hb2));
    }
    ERR(KVA_ERR_INVALID_ARGUMENT, "workspace_size: NULL context", kva_plan_workspace_size(NULL, &d, PP, &F.pp, &db, &hb));
    p = F.pp; p.kv_indptr = kb;
    ERR(KVA_ERR_PAGETABLE_MALFORMED, "workspace_size: kv_indptr decreasing", kva_plan_workspace_size(F.ctx, &d, PP, &p, &db, &hb));
#undef PLAN
}

/* Run errors: o and lse (and everything else) untouched. */
static void test_run(void) {
    kva_run_args a;
    const kva_plan* pl = &F.plan;
    const kva_workspace* ws = &F.ws.ws;
#define RUN(what, want, alt) ERR2(want, alt, what, kva_run(F.ctx, pl, ws, &a))
    a = F.args;
    ERR(KVA_ERR_INVALID_ARGUMENT, "run: NULL context", kva_run(NULL, pl, ws, &a));
    ERR(KVA_ERR_INVALID_ARGUMENT, "run: NULL plan", kva_run(F.ctx, NULL, ws, &a));
    ERR(KVA_ERR_INVALID_ARGUMENT, "run: NULL workspace", kva_run(F.ctx, pl, NULL, &a));
    ERR(KVA_ERR_INVALID_ARGUMENT, "run: NULL args", kva_run(F.ctx, pl, ws, NULL));
    a = F.args; a.q.shape[0] = ROWS - 1;
    RUN("run: q has one row less", KVA_ERR_PLAN_MISMATCH, KVA_ERR_PLAN_MISMATCH);
    a = F.args; a.q.dtype = KVA_DTYPE_BF16;
    RUN("run: q dtype bf16 (plan f16)", KVA_ERR_PLAN_MISMATCH, KVA_ERR_PLAN_MISMATCH);
    a = F.args; a.q.shape[2] = D / 2;
    RUN("run: q head dim 32 (plan 64)", KVA_ERR_PLAN_MISMATCH, KVA_ERR_PLAN_MISMATCH);
    a = F.args; a.q.shape[1] = HQ * 2;
    RUN("run: q heads 8 (plan 4)", KVA_ERR_PLAN_MISMATCH, KVA_ERR_PLAN_MISMATCH);
    a = F.args; a.q.ndim = 2;
    RUN("run: q 2-D", KVA_ERR_PLAN_MISMATCH, KVA_ERR_PLAN_MISMATCH);
    a = F.args; a.q.data = NULL;
    RUN("run: q data NULL", KVA_ERR_INVALID_ARGUMENT, KVA_ERR_INVALID_ARGUMENT);
    a = F.args; a.o.dtype = KVA_DTYPE_F32;
    RUN("run: o dtype f32 (plan f16)", KVA_ERR_PLAN_MISMATCH, KVA_ERR_PLAN_MISMATCH);
    a = F.args; a.o.shape[0] = ROWS + 1;
    RUN("run: o has one row more", KVA_ERR_PLAN_MISMATCH, KVA_ERR_PLAN_MISMATCH);
    a = F.args; a.lse.shape[1] = HQ + 1;
    RUN("run: lse [rows, heads + 1]", KVA_ERR_PLAN_MISMATCH, KVA_ERR_PLAN_MISMATCH);
    a = F.args; a.lse.ndim = 3; a.lse.shape[2] = 1; a.lse.stride[2] = 1;
    RUN("run: lse 3-D", KVA_ERR_PLAN_MISMATCH, KVA_ERR_PLAN_MISMATCH);
    a = F.args; a.lse.dtype = KVA_DTYPE_F16;
    RUN("run: lse dtype f16", KVA_ERR_PLAN_MISMATCH, KVA_ERR_PLAN_MISMATCH);
    a = F.args; a.q.stride[2] = 2; a.q.stride[1] = 2 * D; a.q.stride[0] = 2 * D * HQ;
    RUN("run: q last stride 2", KVA_ERR_INVALID_ARGUMENT, KVA_ERR_INVALID_ARGUMENT);
    a = F.args; a.o.stride[2] = 0;
    RUN("run: o last stride 0", KVA_ERR_INVALID_ARGUMENT, KVA_ERR_INVALID_ARGUMENT);
    a = F.args; a.o.stride[0] = -HQ * D;
    RUN("run: o negative row stride", KVA_ERR_INVALID_ARGUMENT, KVA_ERR_INVALID_ARGUMENT);
    a = F.args; a.o.stride[0] = 0;
    RUN("run: o row stride 0 (a broadcast view: every row's results in one place)", KVA_ERR_INVALID_ARGUMENT,
        KVA_ERR_INVALID_ARGUMENT);
    a = F.args; a.lse.stride[0] = 0;
    RUN("run: lse row stride 0", KVA_ERR_INVALID_ARGUMENT, KVA_ERR_INVALID_ARGUMENT);
    a = F.args; a.k_scale = NAN;
    RUN("run: k_scale NaN", KVA_ERR_INVALID_ARGUMENT, KVA_ERR_INVALID_ARGUMENT);
    a = F.args; a.enable_pdl = 2;
    RUN("run: enable_pdl 2", KVA_ERR_INVALID_ARGUMENT, KVA_ERR_INVALID_ARGUMENT);
    a = F.args; a.enable_pdl = -1;
    RUN("run: enable_pdl -1", KVA_ERR_INVALID_ARGUMENT, KVA_ERR_INVALID_ARGUMENT);
    a = F.args; a.paged.dtype = KVA_DTYPE_BF16;
    RUN("run: paged dtype bf16 (plan f16)", KVA_ERR_PLAN_MISMATCH, KVA_ERR_PLAN_MISMATCH);
    a = F.args; a.paged.page_size = PS * 2;
    RUN("run: paged page_size differs from plan", KVA_ERR_PLAN_MISMATCH, KVA_ERR_PLAN_MISMATCH);
    a = F.args; a.paged.num_pages = NPAGES - 1;
    RUN("run: paged pool smaller than the plan's", KVA_ERR_PLAN_MISMATCH, KVA_ERR_PLAN_MISMATCH);
    a = F.args; a.paged.num_pages = 0;
    RUN("run: paged num_pages 0", KVA_ERR_PLAN_MISMATCH, KVA_ERR_PLAN_MISMATCH);
    a = F.args; a.paged.num_heads = 1;
    RUN("run: paged num_heads 1 (desc 2)", KVA_ERR_PLAN_MISMATCH, KVA_ERR_PLAN_MISMATCH);
    a = F.args; a.paged.head_dim_vo = 32;
    RUN("run: paged head_dim_vo 32", KVA_ERR_PLAN_MISMATCH, KVA_ERR_PLAN_MISMATCH);
    a = F.args; a.paged.k_stride_token = -1;
    RUN("run: paged negative stride", KVA_ERR_INVALID_ARGUMENT, KVA_ERR_INVALID_ARGUMENT);
    /* strides whose farthest element lies beyond 2^63 bytes: no tensor in memory has them, and the element offsets
       would overflow (the CPU backend read far outside q before these were checked) */
    a = F.args; a.q.stride[0] = INT64_MAX / 2;
    RUN("run: q row stride addressing beyond 2^63 bytes", KVA_ERR_INVALID_ARGUMENT, KVA_ERR_INVALID_ARGUMENT);
    a = F.args; a.o.stride[1] = INT64_MAX / 3;
    RUN("run: o head stride addressing beyond 2^63 bytes", KVA_ERR_INVALID_ARGUMENT, KVA_ERR_INVALID_ARGUMENT);
    a = F.args; a.paged.v_stride_page = INT64_MAX / 4;
    RUN("run: paged page stride addressing beyond 2^63 bytes", KVA_ERR_INVALID_ARGUMENT, KVA_ERR_INVALID_ARGUMENT);
    a = F.args; a.paged.num_pages = INT64_MAX; /* only int32 page indices are reachable: a large pool bound is fine */
    {
        kva_status st = kva_run(F.ctx, pl, ws, &a);
        H_CHECK(st == KVA_OK, "run: paged num_pages INT64_MAX with ordinary strides: %s: %s", kva_status_string(st),
                kva_last_error_message());
    }
    a = F.args; a.paged.indices = NULL;
    RUN("run: paged indices NULL", KVA_ERR_INVALID_ARGUMENT, KVA_ERR_INVALID_ARGUMENT);
    /* paged.num_indices: the length of paged.indices where the caller gives it (0 = unchecked) */
    a = F.args; a.paged.num_indices = F.kv_indptr[B] - 1;
    RUN("run: paged.num_indices one short of the plan's page table", KVA_ERR_PAGETABLE_MALFORMED,
        KVA_ERR_PAGETABLE_MALFORMED);
    a = F.args; a.paged.num_indices = -1;
    RUN("run: paged.num_indices -1", KVA_ERR_INVALID_ARGUMENT, KVA_ERR_INVALID_ARGUMENT);
    a = F.args; a.paged.num_indices = F.kv_indptr[B];
    {
        kva_status st = kva_run(F.ctx, pl, ws, &a);
        H_CHECK(st == KVA_OK, "run: paged.num_indices == kv_indptr[B]: %s: %s", kva_status_string(st),
                kva_last_error_message());
    }
    a = F.args; a.paged.k_data = NULL;
    RUN("run: paged k_data NULL", KVA_ERR_INVALID_ARGUMENT, KVA_ERR_INVALID_ARGUMENT);
    {
        /* the block-table form (fx_block_table): the plan's page table spans entries [0, 8), which paged.num_indices
           must cover; the run gives the CSR plan's result bit for bit (both into outputs of their own) */
        int32_t sl[B], bt_h[BT_STRIDE * B];
        const kva_plan_params pb = fx_block_table(sl, bt_h);
        h_buf bt_d = h_buf_alloc(KVA_DTYPE_I32, BT_STRIDE * B);
        memcpy(h_buf_hp(&bt_d), bt_h, sizeof bt_h);
        h_buf_upload(&bt_d);
        size_t db = 0, hb = 0;
        kva_status st = kva_plan_workspace_size(F.ctx, &F.d, KVA_OP_BATCH_PREFILL_PAGED, &pb, &db, &hb);
        h_ws wb;
        h_ws_alloc(&wb, db, hb);
        kva_plan pbt;
        if (st == KVA_OK) st = kva_plan_make(F.ctx, &F.d, KVA_OP_BATCH_PREFILL_PAGED, &pb, &wb.ws, &pbt, NULL);
        if (H_CHECK(st == KVA_OK, "plan: block table: %s: %s", kva_status_string(st), kva_last_error_message())) {
            h_buf o1 = h_buf_alloc(KVA_DTYPE_F16, ROWS * HQ * D), o2 = h_buf_alloc(KVA_DTYPE_F16, ROWS * HQ * D);
            h_buf_poison(&o1);
            h_buf_poison(&o2);
            h_buf_upload(&o1);
            h_buf_upload(&o2);
            a = F.args;
            a.lse.data = NULL;
            a.paged.indices = (const int32_t*)h_buf_dp(&bt_d);
            a.paged.num_indices = 7;
            ERR2(KVA_ERR_PAGETABLE_MALFORMED, KVA_ERR_PAGETABLE_MALFORMED,
                 "run: block table: paged.num_indices one short of the plan's span", kva_run(F.ctx, &pbt, &wb.ws, &a));
            a.paged.num_indices = 8;
            a.o.data = h_buf_dp(&o2);
            st = kva_run(F.ctx, &pbt, &wb.ws, &a);
            kva_run_args c = F.args;
            c.lse.data = NULL;
            c.o.data = h_buf_dp(&o1);
            kva_status st2 = kva_run(F.ctx, pl, ws, &c);
            h_buf_download(&o1);
            h_buf_download(&o2);
            H_CHECK(st == KVA_OK && st2 == KVA_OK && memcmp(h_buf_hp(&o1), h_buf_hp(&o2), (size_t)ROWS * HQ * D * 2) == 0,
                    "run: block table: %s / CSR: %s; outputs %s", kva_status_string(st), kva_status_string(st2),
                    "differ (or a run failed)");
            h_buf_free(&o1);
            h_buf_free(&o2);
        }
        h_ws_free(&wb);
        h_buf_free(&bt_d);
    }

    /* the plan and the workspace */
    a = F.args;
    ERR2(KVA_ERR_PLAN_MISMATCH, KVA_ERR_PLAN_MISMATCH, "run: decode plan through kva_batch_prefill_paged_run",
         kva_batch_prefill_paged_run(F.ctx, &F.plan_dec, &F.ws_dec.ws, &a));
    ERR2(KVA_ERR_PLAN_MISMATCH, KVA_ERR_PLAN_MISMATCH, "run: paged prefill plan through kva_batch_decode_run",
         kva_batch_decode_run(F.ctx, pl, ws, &a));
    ERR2(KVA_ERR_PLAN_MISMATCH, KVA_ERR_PLAN_MISMATCH, "run: paged plan through kva_batch_prefill_ragged_run",
         kva_batch_prefill_ragged_run(F.ctx, pl, ws, &a));
    kva_plan bad = F.plan;
    bad.opaque[0] ^= 0x10;
    ERR2(KVA_ERR_PLAN_MISMATCH, KVA_ERR_PLAN_MISMATCH, "run: plan with a corrupted magic", kva_run(F.ctx, &bad, ws, &a));
    ERR2(KVA_ERR_PLAN_MISMATCH, KVA_ERR_PLAN_MISMATCH, "run (named): plan with a corrupted magic",
         kva_batch_prefill_paged_run(F.ctx, &bad, ws, &a));
    /* one bit changed anywhere in the plan's bytes (layout offsets, counts, descriptor, backend facts), not only its
       magic: refused, nothing written (a changed offset once sent the CPU run to a misaligned workspace address) */
    for (int w = 1; w < 66; w += 3) {
        bad = F.plan;
        bad.opaque[w] ^= 1ull << (w % 61);
        char what[96];
        snprintf(what, sizeof what, "run: plan with bit %d of word %d flipped", w % 61, w);
        ERR2(KVA_ERR_PLAN_MISMATCH, KVA_ERR_PLAN_MISMATCH, what, kva_run(F.ctx, &bad, ws, &a));
        kva_plan_info inf;
        snprintf(what, sizeof what, "plan_get_info: plan with bit %d of word %d flipped", w % 61, w);
        ERR(KVA_ERR_INVALID_ARGUMENT, what, kva_plan_get_info(&bad, &inf));
    }
    bad = F.plan; /* a byte copy of the plan is the plan */
    {
        kva_status st = kva_run(F.ctx, &bad, ws, &a);
        H_CHECK(st == KVA_OK, "run: a copy of the plan runs: %s: %s", kva_status_string(st), kva_last_error_message());
    }
    memset(&bad, 0, sizeof bad);
    ERR2(KVA_ERR_PLAN_MISMATCH, KVA_ERR_PLAN_MISMATCH, "run: zeroed plan", kva_run(F.ctx, &bad, ws, &a));
    kva_plan_info info;
    ERR(KVA_ERR_INVALID_ARGUMENT, "plan_get_info: zeroed plan", kva_plan_get_info(&bad, &info));
    ERR(KVA_ERR_INVALID_ARGUMENT, "plan_get_info: NULL", kva_plan_get_info(NULL, &info));
    ERR2(KVA_ERR_PLAN_MISMATCH, KVA_ERR_PLAN_MISMATCH, "run: plan of another context", kva_run(F.other_ctx, pl, ws, &a));
    ERR2(KVA_ERR_PLAN_MISMATCH, KVA_ERR_PLAN_MISMATCH, "run: another workspace than planned",
         kva_run(F.ctx, pl, &F.ws_other.ws, &a));
    kva_workspace w2 = *ws;
    w2.device_bytes -= 1;
    ERR2(KVA_ERR_PLAN_MISMATCH, KVA_ERR_PLAN_MISMATCH, "run: workspace declared one byte smaller than planned",
         kva_run(F.ctx, pl, &w2, &a));
    /* an eager plan that a later plan into the same workspace replaced: refused (its work list is gone), nothing
       written; the later plan runs */
    {
        kva_plan old = F.plan, fresh;
        kva_status st = kva_plan_make(F.ctx, &F.d, KVA_OP_BATCH_PREFILL_PAGED, &F.pp, ws, &fresh, NULL);
        H_CHECK(st == KVA_OK, "re-plan into the same workspace: %s: %s", kva_status_string(st), kva_last_error_message());
        a = F.args;
        ERR2(KVA_ERR_PLAN_MISMATCH, KVA_ERR_PLAN_MISMATCH, "run: a plan replaced by a later plan into its workspace",
             kva_run(F.ctx, &old, ws, &a));
        F.plan = fresh;
        st = kva_run(F.ctx, &F.plan, ws, &a);
        H_CHECK(st == KVA_OK, "run of the later plan: %s: %s", kva_status_string(st), kva_last_error_message());
        /* the same across contexts: another context's plan into this workspace replaces F.plan too */
        kva_plan theirs;
        st = kva_plan_make(F.other_ctx, &F.d, KVA_OP_BATCH_PREFILL_PAGED, &F.pp, ws, &theirs, NULL);
        H_CHECK(st == KVA_OK, "another context's plan into the same workspace: %s: %s", kva_status_string(st),
                kva_last_error_message());
        a = F.args;
        ERR2(KVA_ERR_PLAN_MISMATCH, KVA_ERR_PLAN_MISMATCH,
             "run: a plan replaced by another context's plan into its workspace", kva_run(F.ctx, &F.plan, ws, &a));
        st = kva_plan_make(F.ctx, &F.d, KVA_OP_BATCH_PREFILL_PAGED, &F.pp, ws, &fresh, NULL);
        H_CHECK(st == KVA_OK, "re-plan after the other context: %s: %s", kva_status_string(st), kva_last_error_message());
        F.plan = fresh;
        st = kva_run(F.ctx, &F.plan, ws, &a);
        H_CHECK(st == KVA_OK, "run after re-planning: %s: %s", kva_status_string(st), kva_last_error_message());
    }
    /* a graph-mode plan runs the work list a later graph-mode re-plan of the same bounds wrote into its workspace, but
       not one of an eager plan, of other bounds, another op or another context (its layout differs: the run had
       read it at this plan's offsets and computed other requests or stale items, status OK) */
    {
        size_t db = 0, hb = 0;
        kva_status st = kva_workspace_bound(F.ctx, &F.d, KVA_OP_BATCH_PREFILL_PAGED, 2 * B, 2 * ROWS, &db, &hb);
        h_ws gw;
        h_ws_alloc(&gw, db + 256, hb + 256);
        kva_plan_params gp = F.pp;
        gp.graph_mode = 1;
        gp.max_batch_size = 2 * B;
        gp.max_total_qo_rows = 2 * ROWS;
        kva_plan g1, later;
        if (st == KVA_OK) st = kva_plan_make(F.ctx, &F.d, KVA_OP_BATCH_PREFILL_PAGED, &gp, &gw.ws, &g1, NULL);
        H_CHECK(st == KVA_OK, "graph-mode plan: %s: %s", kva_status_string(st), kva_last_error_message());
        kva_plan_params ep = F.pp;
        st = kva_plan_make(F.ctx, &F.d, KVA_OP_BATCH_PREFILL_PAGED, &ep, &gw.ws, &later, NULL);
        H_CHECK(st == KVA_OK, "eager plan into the graph-mode plan's workspace: %s", kva_status_string(st));
        a = F.args;
        ERR2(KVA_ERR_PLAN_MISMATCH, KVA_ERR_PLAN_MISMATCH,
             "run: a graph-mode plan after an eager plan into its workspace", kva_run(F.ctx, &g1, &gw.ws, &a));
        kva_plan_params op = gp;
        op.max_batch_size = B;
        op.max_total_qo_rows = ROWS;
        st = kva_plan_make(F.ctx, &F.d, KVA_OP_BATCH_PREFILL_PAGED, &op, &gw.ws, &later, NULL);
        H_CHECK(st == KVA_OK, "graph-mode plan of other bounds: %s", kva_status_string(st));
        ERR2(KVA_ERR_PLAN_MISMATCH, KVA_ERR_PLAN_MISMATCH,
             "run: a graph-mode plan after a graph-mode plan of other bounds into its workspace",
             kva_run(F.ctx, &g1, &gw.ws, &a));
        kva_plan_params dp = gp;
        dp.qo_indptr = NULL;
        dp.max_total_qo_rows = 2 * B;
        st = kva_plan_make(F.ctx, &F.d, KVA_OP_BATCH_DECODE, &dp, &gw.ws, &later, NULL);
        H_CHECK(st == KVA_OK, "graph-mode decode plan of the same batch size bound: %s", kva_status_string(st));
        ERR2(KVA_ERR_PLAN_MISMATCH, KVA_ERR_PLAN_MISMATCH,
             "run: a graph-mode plan after a graph-mode plan of another op into its workspace",
             kva_run(F.ctx, &g1, &gw.ws, &a));
        st = kva_plan_make(F.other_ctx, &F.d, KVA_OP_BATCH_PREFILL_PAGED, &gp, &gw.ws, &later, NULL);
        H_CHECK(st == KVA_OK, "another context's graph-mode plan of the same bounds: %s", kva_status_string(st));
        ERR2(KVA_ERR_PLAN_MISMATCH, KVA_ERR_PLAN_MISMATCH,
             "run: a graph-mode plan after another context's graph-mode plan into its workspace",
             kva_run(F.ctx, &g1, &gw.ws, &a));
        /* a re-plan of the same bounds (another batch: request 1 dropped) is what graph mode is for */
        int32_t qi[3] = {0, F.qo_indptr[1], F.qo_indptr[1]}, ki[3] = {0, F.kv_indptr[1], F.kv_indptr[1]};
        kva_plan_params rp = gp;
        rp.batch_size = 2;
        rp.qo_indptr = qi;
        rp.kv_indptr = ki;
        rp.kv_indices = F.indices;
        st = kva_plan_make(F.ctx, &F.d, KVA_OP_BATCH_PREFILL_PAGED, &rp, &gw.ws, &later, NULL);
        H_CHECK(st == KVA_OK, "graph-mode re-plan of the same bounds: %s: %s", kva_status_string(st),
                kva_last_error_message());
        st = kva_run(F.ctx, &g1, &gw.ws, &a);
        H_CHECK(st == KVA_OK, "run: a graph-mode plan after a re-plan of the same bounds: %s: %s",
                kva_status_string(st), kva_last_error_message());
        h_ws_free(&gw);
    }

    /* ragged: K/V rows must match kv_indptr[B] */
    a = F.args_rag;
    a.k.shape[0] = KVTOK - 1;
    ERR2(KVA_ERR_PLAN_MISMATCH, KVA_ERR_PLAN_MISMATCH, "run ragged: k has fewer rows than kv_indptr[B]",
         kva_run(F.ctx, &F.plan_rag, &F.ws_rag.ws, &a));
    a = F.args_rag;
    a.v.dtype = KVA_DTYPE_F32;
    ERR2(KVA_ERR_PLAN_MISMATCH, KVA_ERR_PLAN_MISMATCH, "run ragged: v dtype f32",
         kva_run(F.ctx, &F.plan_rag, &F.ws_rag.ws, &a));
#undef RUN
}

/* Custom mask, sigmoid lse, page indices found bad at run time. */
static void test_run_special(void) {
    kva_attention_desc d = F.d;
    d.mask_mode = KVA_MASK_CUSTOM;
    kva_plan pm;
    kva_status st = kva_plan_make(F.ctx, &d, KVA_OP_BATCH_PREFILL_PAGED, &F.pp, &F.ws.ws, &pm, NULL);
    H_CHECK(st == KVA_OK, "custom-mask plan: %s", kva_status_string(st));
    h_buf_download(&F.ws.dev);
    F.plan = pm; /* keep the snapshot's plan in sync (fx_same compares it) */
    kva_run_args a = F.args;
    a.custom_mask = (const uint8_t*)h_buf_dp(&F.mask_d);
    a.custom_mask_bytes = 4; /* needs ceil(3*10/8) + 0 + ceil(1*7/8) = 5 */
    ERR(KVA_ERR_INVALID_ARGUMENT, "run: custom mask of 4 bytes, plan needs 5", kva_run(F.ctx, &pm, &F.ws.ws, &a));
    a.custom_mask = NULL;
    a.custom_mask_bytes = 5;
    ERR(KVA_ERR_INVALID_ARGUMENT, "run: custom mask NULL", kva_run(F.ctx, &pm, &F.ws.ws, &a));
    a.custom_mask = (const uint8_t*)h_buf_dp(&F.mask_d);
    st = kva_run(F.ctx, &pm, &F.ws.ws, &a);
    H_CHECK(st == KVA_OK, "custom mask of exactly 5 bytes runs: %s: %s", kva_status_string(st), kva_last_error_message());
    h_buf_poison(&F.o);
    h_buf_poison(&F.lse);
    h_buf_upload(&F.o);
    h_buf_upload(&F.lse);

    d = F.d;
    d.score_mode = KVA_SCORE_SIGMOID;
    st = kva_plan_make(F.ctx, &d, KVA_OP_BATCH_PREFILL_PAGED, &F.pp, &F.ws.ws, &pm, NULL);
    h_buf_download(&F.ws.dev);
    F.plan = pm;
    a = F.args;
    ERR(KVA_ERR_INVALID_ARGUMENT, "run: lse requested in sigmoid mode", kva_run(F.ctx, &pm, &F.ws.ws, &a));

    /* page index out of range at run time (plan had no host copy of the page table) */
    kva_plan_params p = F.pp;
    p.kv_indices = NULL;
    st = kva_plan_make(F.ctx, &F.d, KVA_OP_BATCH_PREFILL_PAGED, &p, &F.ws.ws, &pm, NULL);
    h_buf_download(&F.ws.dev);
    F.plan = pm;
    int32_t* idx = (int32_t*)h_buf_hp(&F.idx_d);
    const int32_t vals[2] = {-1, NPAGES};
    for (int k = 0; k < 2; ++k) {
        idx[4] = vals[k]; /* request 2's second page */
        h_buf_upload(&F.idx_d);
        a = F.args;
        char what[96];
        snprintf(what, sizeof what, "run: page index %d in the device page table (pool of %d)", vals[k], NPAGES);
        if (h_opt.backend == KVA_BACKEND_CPU) {
            ERR(KVA_ERR_PAGE_INDEX_OUT_OF_RANGE, what, kva_run(F.ctx, &pm, &F.ws.ws, &a));
        } else {
            /* CUDA: the kernel bounds-checks where it loads; the request gets o = 0, lse = -inf and a fault report */
            st = kva_run(F.ctx, &pm, &F.ws.ws, &a);
            kva_fault_report rep;
            kva_status s2 = kva_read_faults(F.ctx, &F.ws.ws, &rep, NULL);
            H_CHECK(st == KVA_OK && s2 == KVA_OK && rep.faulted && rep.request == 2 && rep.page_index == vals[k],
                    "%s: device fault report (run %s, read %s, faulted %d request %d page %lld)", what, kva_status_string(st),
                    kva_status_string(s2), rep.faulted, rep.request, (long long)rep.page_index);
            /* kvattn.h: the faulting request (2: row 5) gets o = 0 and lse = -inf; request 0 (rows 0-2) is computed */
            h_buf_download(&F.o);
            h_buf_download(&F.lse);
            int rows_ok = 1;
            for (int e = 0; e < HQ * D; ++e) {
                rows_ok &= h_buf_get(&F.o, (size_t)(5 * HQ * D + e)) == 0.0;
                rows_ok &= isfinite(h_buf_get(&F.o, (size_t)e)) != 0;
            }
            for (int h = 0; h < HQ; ++h) {
                rows_ok &= h_buf_get(&F.lse, (size_t)(5 * HQ + h)) == -INFINITY;
                rows_ok &= isfinite(h_buf_get(&F.lse, (size_t)h)) != 0;
            }
            H_CHECK(rows_ok, "%s: the faulting request has o = 0, lse = -inf; request 0 is computed", what);
            /* the read cleared the report */
            memset(&rep, 0x7f, sizeof rep);
            s2 = kva_read_faults(F.ctx, &F.ws.ws, &rep, NULL);
            H_CHECK(s2 == KVA_OK && rep.faulted == 0 && rep.request == -1, "%s: a second kva_read_faults reports nothing (%s, %d, %d)",
                    what, kva_status_string(s2), rep.faulted, rep.request);
            h_buf_poison(&F.o);
            h_buf_poison(&F.lse);
            h_buf_upload(&F.o);
            h_buf_upload(&F.lse);
        }
    }
    idx[4] = F.indices[4];
    h_buf_upload(&F.idx_d);
    if (h_opt.backend == KVA_BACKEND_CPU) {
        kva_fault_report rep;
        memset(&rep, 0x7f, sizeof rep);
        st = kva_read_faults(F.ctx, &F.ws.ws, &rep, NULL);
        H_CHECK(st == KVA_OK && rep.faulted == 0, "CPU kva_read_faults: OK and no fault (%s, %d)", kva_status_string(st), rep.faulted);
    }
    kva_fault_report rep;
    ERR(KVA_ERR_INVALID_ARGUMENT, "read_faults: NULL report", kva_read_faults(F.ctx, &F.ws.ws, NULL, NULL));
    ERR(KVA_ERR_INVALID_ARGUMENT, "read_faults: NULL context", kva_read_faults(NULL, &F.ws.ws, &rep, NULL));
    /* restore the fixture plan */
    st = kva_plan_make(F.ctx, &F.d, KVA_OP_BATCH_PREFILL_PAGED, &F.pp, &F.ws.ws, &F.plan, NULL);
    h_buf_download(&F.ws.dev);
    H_CHECK(st == KVA_OK, "fixture re-plan");
}

/* Strides and pointers: the CPU backend takes any element stride; the CUDA backend wants q/o/k/v row and head strides
 * and paged K/V strides in multiples of 16 bytes (8 f16 elements) and 16-byte aligned q/o/K/V pointers, and refuses
 * anything else with KVA_ERR_ALIGNMENT before launching (nothing written). Each view below is in bounds of its own
 * padded buffer, so on the CPU the same call runs (KVA_OK). */
static void test_alignment(void) {
    const int64_t Q = ROWS * HQ * (D + 8), P = NPAGES * PS * HKV * (D + 8);
    h_buf qx = h_buf_alloc(KVA_DTYPE_F16, (size_t)Q), ox = h_buf_alloc(KVA_DTYPE_F16, (size_t)Q);
    h_buf kx = h_buf_alloc(KVA_DTYPE_F16, (size_t)P), vx = h_buf_alloc(KVA_DTYPE_F16, (size_t)P);
    h_rng r;
    h_rng_seed(&r, 31);
    fill_rand(&qx, &r);
    fill_rand(&kx, &r);
    fill_rand(&vx, &r);
    h_buf_poison(&ox);
    h_buf_upload(&ox);
    h_buf* const watched[] = {&ox, &F.o, &F.lse, &F.ws.dev, &F.ws_rag.dev, &kx, &vx, &qx};
    const char* const names[] = {"o (padded)", "o", "lse", "workspace", "ragged workspace", "K (padded)", "V (padded)", "q (padded)"};
    fx_watch(8, watched, names);
    const int dev = h_backend_device();
    char* q8 = (char*)h_buf_dp(&qx) + 8; /* 8 bytes past a 16-byte boundary */
    struct {
        const char* what;
        int ragged;
        kva_run_args a;
    } cs[8];
    int n = 0;
    kva_run_args a;
    /* q row stride HQ*D + 4: 8 bytes past a 16-byte multiple */
    a = F.args; a.q = t3(h_buf_dp(&qx), KVA_DTYPE_F16, ROWS, HQ, D); a.q.stride[0] = HQ * D + 4;
    cs[n].what = "run: q row stride HQ*D + 4 elements"; cs[n].ragged = 0; cs[n++].a = a;
    a = F.args; a.q = t3(h_buf_dp(&qx), KVA_DTYPE_F16, ROWS, HQ, D); a.q.stride[1] = D + 4; a.q.stride[0] = HQ * (D + 4);
    cs[n].what = "run: q head stride D + 4 elements"; cs[n].ragged = 0; cs[n++].a = a;
    a = F.args; a.q = t3(q8, KVA_DTYPE_F16, ROWS, HQ, D);
    cs[n].what = "run: q.data 8 bytes past a 16-byte boundary"; cs[n].ragged = 0; cs[n++].a = a;
    a = F.args; a.o = t3(h_buf_dp(&ox), KVA_DTYPE_F16, ROWS, HQ, D); a.o.stride[0] = HQ * D + 2;
    cs[n].what = "run: o row stride HQ*D + 2 elements"; cs[n].ragged = 0; cs[n++].a = a;
    a = F.args; a.paged.k_data = h_buf_dp(&kx); a.paged.v_data = h_buf_dp(&vx);
    a.paged.k_stride_page = a.paged.v_stride_page = PS * HKV * D + 4;
    cs[n].what = "run: paged page stride PS*HKV*D + 4 elements"; cs[n].ragged = 0; cs[n++].a = a;
    a = F.args; a.paged.k_data = h_buf_dp(&kx); a.paged.v_data = (char*)h_buf_dp(&vx) + 8;
    cs[n].what = "run: paged v_data 8 bytes past a 16-byte boundary"; cs[n].ragged = 0; cs[n++].a = a;
    a = F.args_rag; a.k = t3(h_buf_dp(&kx), KVA_DTYPE_F16, KVTOK, HKV, D); a.k.stride[0] = HKV * D + 4;
    cs[n].what = "run ragged: k row stride HKV*D + 4 elements"; cs[n].ragged = 1; cs[n++].a = a;
    a = F.args_rag; a.v = t3(h_buf_dp(&vx), KVA_DTYPE_F16, KVTOK, HKV, D); a.v.stride[1] = D + 2; a.v.stride[0] = HKV * (D + 2);
    cs[n].what = "run ragged: v head stride D + 2 elements"; cs[n].ragged = 1; cs[n++].a = a;
    for (int i = 0; i < n; ++i) {
        const kva_plan* pl = cs[i].ragged ? &F.plan_rag : &F.plan;
        const kva_workspace* ws = cs[i].ragged ? &F.ws_rag.ws : &F.ws.ws;
        if (dev) {
            ERR(KVA_ERR_ALIGNMENT, cs[i].what, kva_run(F.ctx, pl, ws, &cs[i].a));
        } else {
            kva_status st = kva_run(F.ctx, pl, ws, &cs[i].a);
            H_CHECK(st == KVA_OK, "%s: the CPU backend takes any stride: %s: %s", cs[i].what, kva_status_string(st),
                    kva_last_error_message());
        }
    }
    /* the single ops run the same checks (after planning into their workspace, which is scratch for them) */
    size_t db = 0, hb = 0;
    kva_single_workspace_size(F.ctx, &F.d, 1, KVTOK, &db, &hb);
    h_ws w;
    h_ws_alloc(&w, db, hb);
    a = F.args_rag;
    a.q.shape[0] = a.o.shape[0] = a.lse.shape[0] = 1;
    a.k = t3(h_buf_dp(&kx), KVA_DTYPE_F16, KVTOK, HKV, D);
    a.k.stride[0] = HKV * D + 4;
    if (dev) {
        ERR(KVA_ERR_ALIGNMENT, "single decode: k row stride HKV*D + 4 elements", kva_single_decode(F.ctx, &F.d, &a, &w.ws));
    } else {
        kva_status st = kva_single_decode(F.ctx, &F.d, &a, &w.ws);
        H_CHECK(st == KVA_OK, "single decode: k row stride HKV*D + 4 elements: the CPU backend takes any stride: %s: %s",
                kva_status_string(st), kva_last_error_message());
    }
    /* a single op without a workspace: the CPU backend allocates host scratch, the CUDA backend needs one */
    a = F.args_rag;
    a.q.shape[0] = a.o.shape[0] = a.lse.shape[0] = 1;
    if (dev) {
        ERR(KVA_ERR_INVALID_ARGUMENT, "single decode: NULL workspace", kva_single_decode(F.ctx, &F.d, &a, NULL));
    } else {
        kva_status st = kva_single_decode(F.ctx, &F.d, &a, NULL);
        H_CHECK(st == KVA_OK, "single decode: NULL workspace: the CPU backend allocates scratch: %s: %s", kva_status_string(st),
                kva_last_error_message());
    }
    h_ws_free(&w);
    h_buf_free(&qx);
    h_buf_free(&ox);
    h_buf_free(&kx);
    h_buf_free(&vx);
    h_buf_poison(&F.o);
    h_buf_poison(&F.lse);
    h_buf_upload(&F.o);
    h_buf_upload(&F.lse);
    fx_watch_default();
}

static void test_single(void) {
    kva_run_args a = F.args_rag;
    a.q.shape[0] = 1;
    a.o.shape[0] = 1;
    a.lse.shape[0] = 1;
    size_t db = 0, hb = 0;
    kva_status st = kva_single_workspace_size(F.ctx, &F.d, 1, KVTOK, &db, &hb);
    H_CHECK(st == KVA_OK, "single_workspace_size");
    h_ws w;
    h_ws_alloc(&w, db, hb);
    /* single ops plan into their workspace before they check q/o/k/v against the plan: for them the workspace is
       scratch, not an output (o, lse and the fixture's buffers are still checked) */
    kva_workspace small = w.ws;
    small.device_bytes = db - 1;
    ERR(KVA_ERR_WORKSPACE_TOO_SMALL, "single decode: workspace one byte short", kva_single_decode(F.ctx, &F.d, &a, &small));
    ERR(KVA_ERR_INVALID_ARGUMENT, "single decode: NULL context", kva_single_decode(NULL, &F.d, &a, &w.ws));
    ERR(KVA_ERR_INVALID_ARGUMENT, "single decode: NULL args", kva_single_decode(F.ctx, &F.d, NULL, &w.ws));
    ERR(KVA_ERR_INVALID_ARGUMENT, "single decode: NULL desc", kva_single_decode(F.ctx, NULL, &a, &w.ws));
    kva_run_args b = F.args_rag; /* 6 query rows */
    ERR(KVA_ERR_INVALID_ARGUMENT, "single decode: q with 6 rows", kva_single_decode(F.ctx, &F.d, &b, &w.ws));
    b = a;
    b.k.ndim = 2;
    ERR(KVA_ERR_INVALID_ARGUMENT, "single decode: 2-D k", kva_single_decode(F.ctx, &F.d, &b, &w.ws));
    b = a;
    b.o.dtype = KVA_DTYPE_BF16;
    ERR2(KVA_ERR_PLAN_MISMATCH, KVA_ERR_PLAN_MISMATCH, "single decode: o dtype bf16 (desc f16)", kva_single_decode(F.ctx, &F.d, &b, &w.ws));
    b = F.args_rag;
    b.q.ndim = 2;
    ERR(KVA_ERR_INVALID_ARGUMENT, "single prefill: 2-D q", kva_single_prefill(F.ctx, &F.d, &b, &w.ws));
    kva_attention_desc d = F.d;
    d.q_dtype = KVA_DTYPE_E4M3;
    ERR(KVA_ERR_UNSUPPORTED, "single prefill: fp8 q", kva_single_prefill(F.ctx, &d, &b, &w.ws));
    ERR(KVA_ERR_INVALID_ARGUMENT, "single_workspace_size: qo_len -1", kva_single_workspace_size(F.ctx, &F.d, -1, 5, &db, &hb));
    /* q as [heads, dim] whose head stride cannot be addressed: decode views it as [1, heads, dim] without overflowing
       the one row's stride (a signed overflow under UBSan before), then refuses the head stride */
    b = a;
    b.q = kva_tensor_make(h_buf_dp(&F.q), KVA_DTYPE_F16, 2, HQ, D, 0, 0);
    b.q.stride[0] = INT64_MAX / 2;
    ERR(KVA_ERR_INVALID_ARGUMENT, "single decode: 2-D q with a head stride addressing beyond 2^63 bytes",
        kva_single_decode(F.ctx, &F.d, &b, &w.ws));
    h_ws_free(&w);
}

static void test_merge(void) {
    const int R = 5, H = 3, DD = 16;
    h_buf va = h_buf_alloc(KVA_DTYPE_F32, (size_t)(R * H * DD)), sa = h_buf_alloc(KVA_DTYPE_F32, (size_t)(R * H));
    h_buf vb = h_buf_alloc(KVA_DTYPE_F32, (size_t)(R * H * DD)), sb = h_buf_alloc(KVA_DTYPE_F32, (size_t)(R * H));
    h_buf vo = h_buf_alloc(KVA_DTYPE_F32, (size_t)(R * H * DD)), so = h_buf_alloc(KVA_DTYPE_F32, (size_t)(R * H));
    h_rng r;
    h_rng_seed(&r, 5);
    fill_rand(&va, &r);
    fill_rand(&sa, &r);
    fill_rand(&vb, &r);
    fill_rand(&sb, &r);
    h_buf_poison(&vo);
    h_buf_poison(&so);
    h_buf_upload(&vo);
    h_buf_upload(&so);
    h_buf* const watched[] = {&vo, &so, &va, &sa, &vb, &sb};
    const char* const names[] = {"v_out", "s_out", "v_a", "s_a", "v_b", "s_b"};
    fx_watch(6, watched, names);
    kva_tensor tva = t3(h_buf_dp(&va), KVA_DTYPE_F32, R, H, DD), tvb = t3(h_buf_dp(&vb), KVA_DTYPE_F32, R, H, DD);
    kva_tensor tvo = t3(h_buf_dp(&vo), KVA_DTYPE_F32, R, H, DD);
    kva_tensor tsa = kva_tensor_make(h_buf_dp(&sa), KVA_DTYPE_F32, 2, R, H, 0, 0);
    kva_tensor tsb = kva_tensor_make(h_buf_dp(&sb), KVA_DTYPE_F32, 2, R, H, 0, 0);
    kva_tensor tso = kva_tensor_make(h_buf_dp(&so), KVA_DTYPE_F32, 2, R, H, 0, 0);
    kva_tensor x;
    ERR(KVA_ERR_INVALID_ARGUMENT, "merge_state: NULL context", kva_merge_state(NULL, &tva, &tsa, &tvb, &tsb, &tvo, &tso, NULL));
    ERR(KVA_ERR_INVALID_ARGUMENT, "merge_state: s_a NULL", kva_merge_state(F.ctx, &tva, NULL, &tvb, &tsb, &tvo, &tso, NULL));
    ERR(KVA_ERR_INVALID_ARGUMENT, "merge_state: v_out NULL", kva_merge_state(F.ctx, &tva, &tsa, &tvb, &tsb, NULL, &tso, NULL));
    x = tvb;
    x.shape[0] = R - 1;
    ERR(KVA_ERR_INVALID_ARGUMENT, "merge_state: v_b has fewer rows", kva_merge_state(F.ctx, &tva, &tsa, &x, &tsb, &tvo, &tso, NULL));
    x = tvo;
    x.shape[2] = DD + 1;
    ERR(KVA_ERR_INVALID_ARGUMENT, "merge_state: v_out dim differs", kva_merge_state(F.ctx, &tva, &tsa, &tvb, &tsb, &x, &tso, NULL));
    x = tsb;
    x.dtype = KVA_DTYPE_F16;
    ERR(KVA_ERR_INVALID_ARGUMENT, "merge_state: s_b dtype f16", kva_merge_state(F.ctx, &tva, &tsa, &tvb, &x, &tvo, &tso, NULL));
    x = tva;
    x.dtype = KVA_DTYPE_E4M3;
    ERR(KVA_ERR_UNSUPPORTED, "merge_state: v_a dtype e4m3", kva_merge_state(F.ctx, &x, &tsa, &tvb, &tsb, &tvo, &tso, NULL));
    x = tvo;
    x.stride[2] = 2;
    ERR(KVA_ERR_INVALID_ARGUMENT, "merge_state: v_out last stride 2", kva_merge_state(F.ctx, &tva, &tsa, &tvb, &tsb, &x, &tso, NULL));
    x = tvo;
    x.stride[0] = 0;
    ERR(KVA_ERR_INVALID_ARGUMENT, "merge_state: v_out row stride 0", kva_merge_state(F.ctx, &tva, &tsa, &tvb, &tsb, &x, &tso, NULL));
    x = tso;
    x.stride[0] = 0;
    ERR(KVA_ERR_INVALID_ARGUMENT, "merge_state: s_out row stride 0", kva_merge_state(F.ctx, &tva, &tsa, &tvb, &tsb, &tvo, &x, NULL));
    x = tvo;
    x.stride[1] = 0;
    ERR(KVA_ERR_INVALID_ARGUMENT, "merge_state_in_place: v head stride 0",
        kva_merge_state_in_place(F.ctx, &x, &tso, &tvb, &tsb, NULL, NULL));
    x = tvb;
    x.shape[1] = H + 1;
    ERR(KVA_ERR_INVALID_ARGUMENT, "merge_state_in_place: other has more heads",
        kva_merge_state_in_place(F.ctx, &tvo, &tso, &x, &tsb, NULL, NULL));
    ERR(KVA_ERR_INVALID_ARGUMENT, "merge_state_in_place: s NULL", kva_merge_state_in_place(F.ctx, &tvo, NULL, &tvb, &tsb, NULL, NULL));
    /* merge_states: 5 output rows over the 5 states of va (indptr host) */
    int32_t ip[6] = {0, 1, 1, 3, 4, 5};
    kva_tensor to4 = t3(h_buf_dp(&vo), KVA_DTYPE_F32, R, H, DD);
    int32_t bad[6];
    memcpy(bad, ip, sizeof ip);
    bad[0] = 1;
    ERR(KVA_ERR_INVALID_ARGUMENT, "merge_states: indptr[0] = 1", kva_merge_states(F.ctx, &tva, &tsa, bad, R, &to4, &tso, NULL));
    memcpy(bad, ip, sizeof ip);
    bad[3] = 0;
    ERR(KVA_ERR_INVALID_ARGUMENT, "merge_states: indptr decreasing", kva_merge_states(F.ctx, &tva, &tsa, bad, R, &to4, &tso, NULL));
    memcpy(bad, ip, sizeof ip);
    bad[5] = 4;
    ERR(KVA_ERR_INVALID_ARGUMENT, "merge_states: indptr[rows] != number of states",
        kva_merge_states(F.ctx, &tva, &tsa, bad, R, &to4, &tso, NULL));
    bad[5] = 6;
    ERR(KVA_ERR_INVALID_ARGUMENT, "merge_states: indptr[rows] past the states",
        kva_merge_states(F.ctx, &tva, &tsa, bad, R, &to4, &tso, NULL));
    ERR(KVA_ERR_INVALID_ARGUMENT, "merge_states: indptr NULL", kva_merge_states(F.ctx, &tva, &tsa, NULL, R, &to4, &tso, NULL));
    ERR(KVA_ERR_INVALID_ARGUMENT, "merge_states: rows -1", kva_merge_states(F.ctx, &tva, &tsa, ip, -1, &to4, &tso, NULL));
    x = to4;
    x.shape[0] = R + 1;
    ERR(KVA_ERR_INVALID_ARGUMENT, "merge_states: v_out rows != rows", kva_merge_states(F.ctx, &tva, &tsa, ip, R, &x, &tso, NULL));
    x = to4;
    x.stride[0] = 0;
    ERR(KVA_ERR_INVALID_ARGUMENT, "merge_states: v_out row stride 0", kva_merge_states(F.ctx, &tva, &tsa, ip, R, &x, &tso, NULL));
    /* states with no elements and NULL data pointers (PyTorch's empty tensors) are not an error (docs/errors.md) */
    {
        kva_tensor ev = t3(NULL, KVA_DTYPE_F32, 0, H, DD), es = kva_tensor_make(NULL, KVA_DTYPE_F32, 2, 0, H, 0, 0);
        kva_tensor ev0 = t3(NULL, KVA_DTYPE_F32, R, 0, DD), es0 = kva_tensor_make(NULL, KVA_DTYPE_F32, 2, R, 0, 0, 0);
        const int32_t ip0[1] = {0};
        const char* which = "";
        fx_snap();
        kva_status s1 = kva_merge_state(F.ctx, &ev, &es, &ev, &es, &ev, &es, NULL);
        kva_status s2 = kva_merge_state_in_place(F.ctx, &ev, &es, &ev, &es, NULL, NULL);
        kva_status s3 = kva_merge_states(F.ctx, &ev, &es, ip0, 0, &ev, &es, NULL);
        kva_status s4 = kva_merge_state(F.ctx, &ev0, &es0, &ev0, &es0, &ev0, &es0, NULL);
        H_CHECK(s1 == KVA_OK && s2 == KVA_OK && s3 == KVA_OK && s4 == KVA_OK && fx_same(&which),
                "merges of empty states with NULL pointers: %s %s %s %s (%s)%s%s", kva_status_string(s1),
                kva_status_string(s2), kva_status_string(s3), kva_status_string(s4), kva_last_error_message(),
                fx_same(&which) ? "" : ", modified: ", fx_same(&which) ? "" : which);
        /* a non-empty state still needs its pointers */
        x = es;
        x.shape[0] = R;
        ERR(KVA_ERR_INVALID_ARGUMENT, "merge_state: s_a with data NULL", kva_merge_state(F.ctx, &tva, &x, &tvb, &tsb, &tvo, &tso, NULL));
        x = tva;
        x.stride[0] = INT64_MAX / 2;
        ERR(KVA_ERR_INVALID_ARGUMENT, "merge_state: v_a row stride addressing beyond 2^63 bytes",
            kva_merge_state(F.ctx, &x, &tsa, &tvb, &tsb, &tvo, &tso, NULL));
    }
    /* negative extents are malformed, not empty */
    for (int k = 0; k < 3; ++k) {
        kva_tensor na = tva, nb = tvb, no = tvo, nsa = tsa, nsb = tsb, nso = tso;
        na.shape[k] = nb.shape[k] = no.shape[k] = k == 2 ? -2 : -1;
        if (k < 2) nsa.shape[k] = nsb.shape[k] = nso.shape[k] = -1;
        ERR(KVA_ERR_INVALID_ARGUMENT, "merge_state: a negative extent", kva_merge_state(F.ctx, &na, &nsa, &nb, &nsb, &no, &nso, NULL));
        ERR(KVA_ERR_INVALID_ARGUMENT, "merge_state_in_place: a negative extent",
            kva_merge_state_in_place(F.ctx, &na, &nsa, &nb, &nsb, NULL, NULL));
    }
    fx_watch_default();
    /* head dim 0 (v pointers NULL): nothing in v, but s_out is the merged lse log2(2^s_a + 2^s_b) */
    {
        kva_tensor z = t3(NULL, KVA_DTYPE_F32, R, H, 0);
        h_buf_poison(&so);
        h_buf_upload(&so);
        kva_status s0 = kva_merge_state(F.ctx, &z, &tsa, &z, &tsb, &z, &tso, NULL);
        h_buf_download(&so);
        const float *a0 = (const float*)h_buf_hp(&sa), *b0 = (const float*)h_buf_hp(&sb), *o0 = (const float*)h_buf_hp(&so);
        double worst = 0.0;
        for (int i = 0; i < R * H; ++i) {
            const double m = a0[i] > b0[i] ? a0[i] : b0[i];
            const double want = m + log2(exp2(a0[i] - m) + exp2(b0[i] - m));
            const double e = fabs((double)o0[i] - want);
            worst = e > worst || e != e ? (e != e ? INFINITY : e) : worst;
        }
        H_CHECK(s0 == KVA_OK && worst < 1e-5, "merge_state at head dim 0: %s, worst s_out error %g (%s)",
                kva_status_string(s0), worst, kva_last_error_message());
    }
    h_buf_free(&va);
    h_buf_free(&sa);
    h_buf_free(&vb);
    h_buf_free(&sb);
    h_buf_free(&vo);
    h_buf_free(&so);
    fx_watch_default();
}

/* Append. Host-side mistakes (NULL pointers, nnz, shapes) are refused by every backend before anything is written.
 * A token that is bad only through data in backend memory (its batch index, its position, the page table) is
 *   - CPU: found on the host before anything is written (the statuses of docs/errors.md);
 *   - CUDA: out of the host's sight: the call returns KVA_OK, the kernel writes every valid token and no bad one, and
 *     records the first bad token in the context's append status word, which kva_read_faults reports and clears
 *     (request = the token's index in the call, page_index = the page it mapped to, or -1 where it was refused
 *     before a page lookup: batch index or position out of range).
 * The pools here have XPAGES pages past num_pages, so a write through an out-of-range page table entry would land in
 * watched memory. */
#define XPAGES 4
#define NNZ 4

typedef struct app_fx {
    h_buf kp, vp, ak, av, bi, po;
    kva_tensor tk, tv;
    kva_paged_kv pg;
} app_fx;

static app_fx A;

static void app_watch(int with_pools) {
    h_buf* const bufs[] = {&A.kp, &A.vp, &A.ak, &A.av, &A.bi, &A.po, &F.o, &F.ws.dev};
    const char* const names[] = {"K pool", "V pool", "append_k", "append_v", "batch_indices", "positions", "o", "workspace"};
    fx_watch(with_pools ? 8 : 6, bufs + (with_pools ? 0 : 2), names + (with_pools ? 0 : 2));
}

static kva_status app_call(const kva_tensor* tk, const kva_tensor* tv, const int32_t* bi, const int32_t* po, int64_t nnz,
                           const kva_paged_kv* pg) {
    return kva_append_paged_kv_cache(F.ctx, tk, tv, bi, po, nnz, pg, B, NULL);
}

/* Host model of an append over the host mirrors of the tokens and of the page table (F.idx_d, F.indptr_d, F.last_d):
 * token i is written iff 0 <= b < B, 0 <= pos < len(b) and its page lies in [0, NPAGES). Writes the valid tokens'
 * rows into k/v (images of the whole pool allocations, guards included); returns the first bad token (-1 if none)
 * and its page in *bad_page (-1 where it got none). */
static int app_model(unsigned char* k, unsigned char* v, int64_t* bad_page) {
    const int32_t* bi = (const int32_t*)h_buf_hp(&A.bi);
    const int32_t* po = (const int32_t*)h_buf_hp(&A.po);
    const int32_t* ip = (const int32_t*)h_buf_hp(&F.indptr_d);
    const int32_t* lp = (const int32_t*)h_buf_hp(&F.last_d);
    const int32_t* ix = (const int32_t*)h_buf_hp(&F.idx_d);
    const size_t row = (size_t)D * 2; /* f16 rows, same dtype in and out: a byte copy */
    int first = -1;
    *bad_page = -1;
    for (int i = 0; i < NNZ; ++i) {
        const int32_t b = bi[i], pos = po[i];
        int64_t page = -1;
        int ok = b >= 0 && b < B && pos >= 0;
        if (ok) {
            /* a request whose indptr range is negative, decreasing or past num_indices (where given) has no tokens */
            const int table_ok = ip[b] >= 0 && ip[b + 1] >= ip[b] && (A.pg.num_indices == 0 || ip[b + 1] <= A.pg.num_indices);
            const int32_t np = table_ok ? ip[b + 1] - ip[b] : 0;
            const int64_t len = np > 0 ? (int64_t)(np - 1) * PS + lp[b] : 0;
            ok = pos < len;
            if (ok) {
                page = ix[ip[b] + pos / PS];
                ok = page >= 0 && page < NPAGES;
            }
        }
        if (!ok) {
            if (first < 0) {
                first = i;
                *bad_page = page;
            }
            continue;
        }
        for (int h = 0; h < HKV; ++h) {
            const size_t dst = H_GUARD_BYTES + (size_t)(((page * PS + pos % PS) * HKV + h) * D) * 2;
            const size_t src = (size_t)((i * HKV + h) * D) * 2;
            memcpy(k + dst, (const unsigned char*)h_buf_hp(&A.ak) + src, row);
            memcpy(v + dst, (const unsigned char*)h_buf_hp(&A.av) + src, row);
        }
    }
    return first;
}

/* Append the current tokens and check the pools against the model (CUDA: also the fault report). expect_fault:
 * the tokens hold a bad one. */
static void app_check_device(const char* what, int expect_fault) {
    kva_fault_report rep;
    kva_read_faults(F.ctx, &F.ws.ws, &rep, NULL); /* start from a clear report */
    h_buf_download(&A.kp);
    h_buf_download(&A.vp);
    const size_t kt = buf_total(&A.kp), vt = buf_total(&A.vp);
    unsigned char* kexp = (unsigned char*)malloc(kt);
    unsigned char* vexp = (unsigned char*)malloc(vt);
    memcpy(kexp, A.kp.host, kt);
    memcpy(vexp, A.vp.host, vt);
    int64_t bad_page = -1;
    const int bad = app_model(kexp, vexp, &bad_page);
    app_watch(0); /* everything but the pools stays byte-identical */
    fx_snap();
    kva_clear_last_error();
    kva_status st = app_call(&A.tk, &A.tv, (const int32_t*)h_buf_dp(&A.bi), (const int32_t*)h_buf_dp(&A.po), NNZ, &A.pg);
    memset(&rep, 0x7f, sizeof rep);
    kva_status s2 = kva_read_faults(F.ctx, &F.ws.ws, &rep, NULL);
    h_buf_download(&A.kp);
    h_buf_download(&A.vp);
    const int pools_ok = memcmp(kexp, A.kp.host, kt) == 0 && memcmp(vexp, A.vp.host, vt) == 0;
    const char* which = "";
    const int same = fx_same(&which);
    const int fault_ok = expect_fault ? bad >= 0 && rep.faulted && rep.request == bad && rep.page_index == bad_page
                                      : bad < 0 && !rep.faulted;
    H_CHECK(st == KVA_OK && s2 == KVA_OK && pools_ok && same && fault_ok,
            "%s [%s]: call %s (expected KVA_OK), read_faults %s; pools %s; %s%s; report faulted %d request %d page %lld "
            "(expected %s token %d page %lld)",
            what, h_opt.backend_name, kva_status_string(st), kva_status_string(s2),
            pools_ok ? "= valid tokens written, nothing else" : "DIFFER from valid tokens written, nothing else",
            same ? "other buffers untouched" : "modified: ", same ? "" : which, rep.faulted, rep.request,
            (long long)rep.page_index, expect_fault ? "a fault at" : "no fault,", bad, (long long)bad_page);
    free(kexp);
    free(vexp);
    app_watch(1);
}

/* A token bad only through backend-memory data: CPU status cpu_want with nothing written; CUDA as described above. */
static void app_device_data_case(const char* what, kva_status cpu_want) {
    if (h_backend_device()) {
        app_check_device(what, 1);
        return;
    }
    ERR(cpu_want, what, app_call(&A.tk, &A.tv, (const int32_t*)h_buf_dp(&A.bi), (const int32_t*)h_buf_dp(&A.po), NNZ, &A.pg));
}

/* The append fixture's pools (NPAGES + XPAGES pages, random) and NNZ random new f16 rows, from seed. */
static void app_fixture(uint64_t seed) {
    const int64_t pool = (int64_t)(NPAGES + XPAGES) * PS * HKV * D;
    h_rng r;
    h_rng_seed(&r, seed);
    A.kp = h_buf_alloc(KVA_DTYPE_F16, (size_t)pool);
    A.vp = h_buf_alloc(KVA_DTYPE_F16, (size_t)pool);
    fill_rand(&A.kp, &r);
    fill_rand(&A.vp, &r);
    A.ak = h_buf_alloc(KVA_DTYPE_F16, (size_t)(NNZ * HKV * D));
    A.av = h_buf_alloc(KVA_DTYPE_F16, (size_t)(NNZ * HKV * D));
    fill_rand(&A.ak, &r);
    fill_rand(&A.av, &r);
    A.tk = t3(h_buf_dp(&A.ak), KVA_DTYPE_F16, NNZ, HKV, D);
    A.tv = t3(h_buf_dp(&A.av), KVA_DTYPE_F16, NNZ, HKV, D);
    A.pg = F.args.paged; /* the fixture's device page table */
    A.pg.k_data = h_buf_dp(&A.kp);
    A.pg.v_data = h_buf_dp(&A.vp);
    A.pg.num_pages = NPAGES; /* XPAGES more are allocated */
}

static void test_append(void) {
    app_fixture(9);
    A.bi = h_buf_alloc(KVA_DTYPE_I32, NNZ);
    A.po = h_buf_alloc(KVA_DTYPE_I32, NNZ);
    const int32_t b0[NNZ] = {0, 0, 2, 2}, p0[NNZ] = {8, 9, 5, 6}; /* valid: request 0 has 10 tokens, request 2 has 7 */
    app_watch(1);
    struct {
        const char* what;
        int tok, bval, pval;
        kva_status cpu_want;
    } cases[] = {
        {"append: position == kv_len of its request", 1, 0, 10, KVA_ERR_PAGE_INDEX_OUT_OF_RANGE},
        {"append: negative position", 2, 2, -1, KVA_ERR_PAGE_INDEX_OUT_OF_RANGE},
        {"append: token for the empty request 1", 3, 1, 0, KVA_ERR_PAGE_INDEX_OUT_OF_RANGE},
        {"append: batch index == batch_size", 3, B, 0, KVA_ERR_INVALID_ARGUMENT},
        {"append: batch index -1", 0, -1, 0, KVA_ERR_INVALID_ARGUMENT},
    };
    for (size_t c = 0; c < sizeof cases / sizeof cases[0]; ++c) {
        memcpy(h_buf_hp(&A.bi), b0, sizeof b0);
        memcpy(h_buf_hp(&A.po), p0, sizeof p0);
        ((int32_t*)h_buf_hp(&A.bi))[cases[c].tok] = cases[c].bval;
        ((int32_t*)h_buf_hp(&A.po))[cases[c].tok] = cases[c].pval;
        h_buf_upload(&A.bi);
        h_buf_upload(&A.po);
        app_device_data_case(cases[c].what, cases[c].cpu_want);
    }
    memcpy(h_buf_hp(&A.bi), b0, sizeof b0);
    memcpy(h_buf_hp(&A.po), p0, sizeof p0);
    h_buf_upload(&A.bi);
    h_buf_upload(&A.po);
    const int32_t* bip = (const int32_t*)h_buf_dp(&A.bi);
    const int32_t* pop = (const int32_t*)h_buf_dp(&A.po);
    /* a page of the table outside the pool (inside the allocation's extra pages) */
    int32_t* idx = (int32_t*)h_buf_hp(&F.idx_d);
    idx[4] = NPAGES + 3; /* request 2, positions 4..6 */
    h_buf_upload(&F.idx_d);
    app_device_data_case("append: page table entry outside the pool", KVA_ERR_PAGE_INDEX_OUT_OF_RANGE);
    idx[4] = F.indices[4];
    h_buf_upload(&F.idx_d);
    /* malformed page table given to append (CUDA: request 0 is 8 tokens long then, so positions 8 and 9 are outside) */
    int32_t* lp = (int32_t*)h_buf_hp(&F.last_d);
    lp[0] = 0;
    h_buf_upload(&F.last_d);
    app_device_data_case("append: last_page_len 0 for a non-empty request", KVA_ERR_PAGETABLE_MALFORMED);
    lp[0] = F.last[0];
    h_buf_upload(&F.last_d);
    /* indptr that leaves the page table: request 2's range [3, 5) against a table said to hold 4 entries; then
       request 2's range starting at -8 (before the fix the CUDA kernel read indices[-8 + pos / PS]) */
    A.pg.num_indices = F.kv_indptr[B] - 1;
    app_device_data_case("append: request's indptr range past paged.num_indices", KVA_ERR_PAGETABLE_MALFORMED);
    A.pg.num_indices = F.kv_indptr[B];
    if (h_backend_device()) app_check_device("append: paged.num_indices == indptr[B] (valid tokens)", 0);
    A.pg.num_indices = 0;
    int32_t* ipd = (int32_t*)h_buf_hp(&F.indptr_d);
    ipd[2] = -8;
    h_buf_upload(&F.indptr_d);
    app_device_data_case("append: negative indptr entry", KVA_ERR_PAGETABLE_MALFORMED);
    ipd[2] = F.kv_indptr[2];
    ipd[3] = 1 << 30; /* request 2 ends far past the table: refused where num_indices is given */
    h_buf_upload(&F.indptr_d);
    A.pg.num_indices = F.kv_indptr[B];
    app_device_data_case("append: indptr[B] far past paged.num_indices", KVA_ERR_PAGETABLE_MALFORMED);
    A.pg.num_indices = 0;
    ipd[3] = F.kv_indptr[3];
    h_buf_upload(&F.indptr_d);
    /* host-side mistakes: every backend */
    const kva_tensor* tk = &A.tk;
    const kva_tensor* tv = &A.tv;
    const kva_paged_kv pg = A.pg;
    ERR(KVA_ERR_INVALID_ARGUMENT, "append: nnz -1", app_call(tk, tv, bip, pop, -1, &pg));
    ERR(KVA_ERR_INVALID_ARGUMENT, "append: NULL context", kva_append_paged_kv_cache(NULL, tk, tv, bip, pop, NNZ, &pg, B, NULL));
    ERR(KVA_ERR_INVALID_ARGUMENT, "append: NULL paged", app_call(tk, tv, bip, pop, NNZ, NULL));
    ERR(KVA_ERR_INVALID_ARGUMENT, "append: positions NULL", app_call(tk, tv, bip, NULL, NNZ, &pg));
    kva_paged_kv pg2 = pg;
    pg2.indices = NULL;
    ERR(KVA_ERR_INVALID_ARGUMENT, "append: paged indices NULL", app_call(tk, tv, bip, pop, NNZ, &pg2));
    pg2 = pg;
    pg2.last_page_len = NULL;
    ERR(KVA_ERR_INVALID_ARGUMENT, "append: paged last_page_len NULL", app_call(tk, tv, bip, pop, NNZ, &pg2));
    kva_tensor x = *tk;
    x.shape[2] = D / 2;
    ERR(KVA_ERR_INVALID_ARGUMENT, "append: append_k head dim differs from the pool", app_call(&x, tv, bip, pop, NNZ, &pg));
    x = *tk;
    x.shape[0] = NNZ - 1;
    ERR(KVA_ERR_INVALID_ARGUMENT, "append: append_k has fewer rows than nnz", app_call(&x, tv, bip, pop, NNZ, &pg));
    /* pool strides as run checks them (the CPU backend wrote through a negative page stride before) */
    pg2 = pg;
    pg2.k_stride_page = -pg2.k_stride_page;
    ERR(KVA_ERR_INVALID_ARGUMENT, "append: paged negative page stride", app_call(tk, tv, bip, pop, NNZ, &pg2));
    pg2 = pg;
    pg2.v_stride_token = -1;
    ERR(KVA_ERR_INVALID_ARGUMENT, "append: paged negative token stride", app_call(tk, tv, bip, pop, NNZ, &pg2));
    pg2 = pg;
    pg2.k_stride_head = INT64_MAX / 2;
    ERR(KVA_ERR_INVALID_ARGUMENT, "append: paged head stride addressing beyond 2^63 bytes", app_call(tk, tv, bip, pop, NNZ, &pg2));
    pg2 = pg;
    pg2.num_indices = -1;
    ERR(KVA_ERR_INVALID_ARGUMENT, "append: paged num_indices -1", app_call(tk, tv, bip, pop, NNZ, &pg2));
    pg2 = pg;
    pg2.dtype = KVA_DTYPE_U8; /* a mask dtype: the pool must hold KV (f32, f16, bf16, e4m3, e5m2) */
    ERR(KVA_ERR_UNSUPPORTED, "append: paged dtype u8 (not a KV dtype)", app_call(tk, tv, bip, pop, NNZ, &pg2));
    pg2 = pg;
    pg2.dtype = KVA_DTYPE_I32;
    ERR(KVA_ERR_UNSUPPORTED, "append: paged dtype i32 (not a KV dtype)", app_call(tk, tv, bip, pop, NNZ, &pg2));
    if (h_backend_device()) {
        /* CUDA: pointers must be aligned to their element size (2 bytes for f16 rows) */
        x = *tk;
        x.data = (char*)x.data + 1;
        ERR(KVA_ERR_ALIGNMENT, "append: append_k.data odd (f16)", app_call(&x, tv, bip, pop, NNZ, &pg));
    }
    /* the valid tokens: written exactly where the page table says, nothing else (CUDA: and no fault) */
    if (h_backend_device()) {
        app_check_device("append baseline (valid tokens)", 0);
    } else {
        h_buf_download(&A.kp);
        h_buf_download(&A.vp);
        const size_t kt = buf_total(&A.kp), vt = buf_total(&A.vp);
        unsigned char* kexp = (unsigned char*)malloc(kt);
        unsigned char* vexp = (unsigned char*)malloc(vt);
        memcpy(kexp, A.kp.host, kt);
        memcpy(vexp, A.vp.host, vt);
        int64_t bad_page = -1;
        const int bad = app_model(kexp, vexp, &bad_page);
        kva_status st = app_call(tk, tv, bip, pop, NNZ, &pg);
        h_buf_download(&A.kp);
        h_buf_download(&A.vp);
        H_CHECK(st == KVA_OK && bad < 0 && memcmp(kexp, A.kp.host, kt) == 0 && memcmp(vexp, A.vp.host, vt) == 0,
                "append baseline (valid tokens): %s: %s; pools %s", kva_status_string(st), kva_last_error_message(),
                memcmp(kexp, A.kp.host, kt) == 0 && memcmp(vexp, A.vp.host, vt) == 0 ? "as expected" : "differ");
        free(kexp);
        free(vexp);
    }
    h_buf* const bufs[] = {&A.kp, &A.vp, &A.ak, &A.av, &A.bi, &A.po};
    for (int i = 0; i < 6; ++i) h_buf_free(bufs[i]);
    fx_watch_default();
}

/* Append by slot (kva_append_paged_kv_cache_by_slot): token i goes to slot slots[i] (page slots[i] / PS), a negative
 * slot is padding. A slot past the pool: CPU refuses (KVA_ERR_PAGE_INDEX_OUT_OF_RANGE, nothing written); CUDA writes
 * the valid tokens, reports the first bad token (page_index = slot / PS clamped to INT32_MAX). */
static void app_slot_case(const char* what, const int64_t* sl, int expect_bad, int64_t bad_page) {
    h_buf sb = h_buf_alloc(KVA_DTYPE_I32, 2 * NNZ);
    memcpy(h_buf_hp(&sb), sl, sizeof(int64_t) * NNZ);
    h_buf_upload(&sb);
    const int64_t* sd = (const int64_t*)h_buf_dp(&sb);
    h_buf_download(&A.kp);
    h_buf_download(&A.vp);
    const size_t kt = buf_total(&A.kp), vt = buf_total(&A.vp);
    unsigned char* kexp = (unsigned char*)malloc(kt);
    unsigned char* vexp = (unsigned char*)malloc(vt);
    memcpy(kexp, A.kp.host, kt);
    memcpy(vexp, A.vp.host, vt);
    int first = -1;
    for (int i = 0; i < NNZ; ++i) {
        if (sl[i] < 0) continue;
        if (sl[i] / PS >= NPAGES) {
            if (first < 0) first = i;
            continue;
        }
        for (int h = 0; h < HKV; ++h) {
            const size_t dst = H_GUARD_BYTES + (size_t)((sl[i] * HKV + h) * D) * 2;
            const size_t src = (size_t)((i * HKV + h) * D) * 2;
            memcpy(kexp + dst, (const unsigned char*)h_buf_hp(&A.ak) + src, (size_t)D * 2);
            memcpy(vexp + dst, (const unsigned char*)h_buf_hp(&A.av) + src, (size_t)D * 2);
        }
    }
    H_CHECK((first >= 0) == (expect_bad != 0), "%s: the test's own model disagrees with the case", what);
    if (!h_backend_device() && expect_bad) { /* refused, nothing written */
        memcpy(kexp, A.kp.host, kt);
        memcpy(vexp, A.vp.host, vt);
    }
    kva_fault_report rep;
    if (h_backend_device()) kva_read_faults(F.ctx, &F.ws.ws, &rep, NULL); /* start from a clear report */
    h_buf* const bufs[] = {&A.ak, &A.av, &sb, &F.o, &F.ws.dev};
    const char* const names[] = {"append_k", "append_v", "slots", "o", "workspace"};
    fx_watch(5, bufs, names);
    fx_snap();
    kva_clear_last_error();
    const kva_status st = kva_append_paged_kv_cache_by_slot(F.ctx, &A.tk, &A.tv, sd, NNZ, &A.pg, NULL);
    const kva_status want = !h_backend_device() && expect_bad ? KVA_ERR_PAGE_INDEX_OUT_OF_RANGE : KVA_OK;
    memset(&rep, 0, sizeof rep);
    kva_status s2 = KVA_OK;
    if (h_backend_device()) s2 = kva_read_faults(F.ctx, &F.ws.ws, &rep, NULL);
    h_buf_download(&A.kp);
    h_buf_download(&A.vp);
    const int pools_ok = memcmp(kexp, A.kp.host, kt) == 0 && memcmp(vexp, A.vp.host, vt) == 0;
    const char* which = "";
    const int same = fx_same(&which);
    const int fault_ok = !h_backend_device() ||
                         (expect_bad ? rep.faulted && rep.request == first && rep.page_index == bad_page : !rep.faulted);
    const int msg_ok = st == KVA_OK || (kva_last_error_status() == st && kva_last_error_message()[0]);
    H_CHECK(st == want && s2 == KVA_OK && pools_ok && same && fault_ok && msg_ok,
            "%s [%s]: %s (expected %s): %s; pools %s; %s%s; report faulted %d request %d page %lld (expected %s token %d "
            "page %lld)",
            what, h_opt.backend_name, kva_status_string(st), kva_status_string(want), kva_last_error_message(),
            pools_ok ? "as expected" : "DIFFER", same ? "other buffers untouched" : "modified: ", same ? "" : which,
            rep.faulted, rep.request, (long long)rep.page_index, expect_bad ? "a fault at" : "no fault,", first,
            (long long)bad_page);
    free(kexp);
    free(vexp);
    h_buf_free(&sb);
    fx_watch_default();
}

static void test_append_slot(void) {
    app_fixture(11);
    A.pg.indices = NULL; /* not read by the slot form */
    A.pg.indptr = NULL;
    A.pg.last_page_len = NULL;
    const int64_t last = (int64_t)NPAGES * PS - 1;
    const int64_t ok4[NNZ] = {0, last, 2 * PS + 1, PS - 1};
    app_slot_case("append by slot: valid slots, page table fields NULL", ok4, 0, -1);
    const int64_t pad[NNZ] = {-1, PS + 3, INT64_MIN, -(INT64_C(1) << 40)};
    app_slot_case("append by slot: negative slots are padding", pad, 0, -1);
    const int64_t past[NNZ] = {3, last + 1, 5, last + 2 * PS};
    app_slot_case("append by slot: slot num_pages * page_size (first past the pool)", past, 1, NPAGES);
    const int64_t huge[NNZ] = {-1, 7, INT64_C(1) << 50, 9};
    app_slot_case("append by slot: slot 2^50", huge, 1, INT32_MAX);
    /* host-side mistakes: every backend, nothing written */
    h_buf sb = h_buf_alloc(KVA_DTYPE_I32, 2 * NNZ + 2);
    memcpy(h_buf_hp(&sb), ok4, sizeof ok4);
    h_buf_upload(&sb);
    const int64_t* sd = (const int64_t*)h_buf_dp(&sb);
    h_buf* const bufs[] = {&A.kp, &A.vp, &A.ak, &A.av, &sb, &F.o, &F.ws.dev};
    const char* const names[] = {"K pool", "V pool", "append_k", "append_v", "slots", "o", "workspace"};
    fx_watch(7, bufs, names);
    const kva_tensor* tk = &A.tk;
    const kva_tensor* tv = &A.tv;
    ERR(KVA_ERR_INVALID_ARGUMENT, "append by slot: NULL context",
        kva_append_paged_kv_cache_by_slot(NULL, tk, tv, sd, NNZ, &A.pg, NULL));
    ERR(KVA_ERR_INVALID_ARGUMENT, "append by slot: NULL paged",
        kva_append_paged_kv_cache_by_slot(F.ctx, tk, tv, sd, NNZ, NULL, NULL));
    ERR(KVA_ERR_INVALID_ARGUMENT, "append by slot: NULL slots",
        kva_append_paged_kv_cache_by_slot(F.ctx, tk, tv, NULL, NNZ, &A.pg, NULL));
    ERR(KVA_ERR_INVALID_ARGUMENT, "append by slot: nnz -1",
        kva_append_paged_kv_cache_by_slot(F.ctx, tk, tv, sd, -1, &A.pg, NULL));
    ERR(KVA_ERR_INVALID_ARGUMENT, "append by slot: NULL append_v",
        kva_append_paged_kv_cache_by_slot(F.ctx, tk, NULL, sd, NNZ, &A.pg, NULL));
    kva_tensor x = *tk;
    x.shape[0] = NNZ - 1;
    ERR(KVA_ERR_INVALID_ARGUMENT, "append by slot: append_k has fewer rows than nnz",
        kva_append_paged_kv_cache_by_slot(F.ctx, &x, tv, sd, NNZ, &A.pg, NULL));
    kva_paged_kv pg2 = A.pg;
    pg2.page_size = 0;
    ERR(KVA_ERR_INVALID_ARGUMENT, "append by slot: page_size 0",
        kva_append_paged_kv_cache_by_slot(F.ctx, tk, tv, sd, NNZ, &pg2, NULL));
    pg2 = A.pg;
    pg2.k_data = NULL;
    ERR(KVA_ERR_INVALID_ARGUMENT, "append by slot: NULL k_data",
        kva_append_paged_kv_cache_by_slot(F.ctx, tk, tv, sd, NNZ, &pg2, NULL));
    if (h_backend_device())
        ERR(KVA_ERR_ALIGNMENT, "append by slot: slots not 8-byte aligned",
            kva_append_paged_kv_cache_by_slot(F.ctx, tk, tv, (const int64_t*)((const char*)sd + 4), NNZ, &A.pg, NULL));
    h_buf_free(&sb);
    fx_watch_default();
    h_buf* const own[] = {&A.kp, &A.vp, &A.ak, &A.av};
    for (int i = 0; i < 4; ++i) h_buf_free(own[i]);
}

static void test_misc(void) {
    float s[4];
    ERR(KVA_ERR_INVALID_ARGUMENT, "alibi_slopes: 0 heads", kva_alibi_slopes(0, s));
    ERR(KVA_ERR_INVALID_ARGUMENT, "alibi_slopes: NULL", kva_alibi_slopes(4, NULL));
    kva_paged_kv pk;
    ERR(KVA_ERR_INVALID_ARGUMENT, "paged_kv_init: page_size 0",
        kva_paged_kv_init(&pk, h_buf_dp(&F.kp), h_buf_dp(&F.vp), KVA_DTYPE_F16, KVA_LAYOUT_NHD, NPAGES, 0, HKV, D, D));
    ERR(KVA_ERR_INVALID_ARGUMENT, "paged_kv_init: layout 5",
        kva_paged_kv_init(&pk, h_buf_dp(&F.kp), h_buf_dp(&F.vp), KVA_DTYPE_F16, (kva_layout)5, NPAGES, PS, HKV, D, D));
    ERR(KVA_ERR_INVALID_ARGUMENT, "paged_kv_init: NULL", kva_paged_kv_init(NULL, NULL, NULL, KVA_DTYPE_F16, KVA_LAYOUT_NHD, 1, 1, 1, 1, 1));
    kva_paged_kv pk0;
    memset(&pk0, 0x5a, sizeof pk0);
    pk = pk0;
    kva_status st = kva_paged_kv_init(&pk, h_buf_dp(&F.kp), h_buf_dp(&F.vp), KVA_DTYPE_F16, KVA_LAYOUT_NHD, NPAGES, INT32_MAX,
                                      INT32_MAX, INT32_MAX, D);
    H_CHECK(st == KVA_ERR_INVALID_ARGUMENT && kva_last_error_message()[0] && memcmp(&pk, &pk0, sizeof pk) == 0,
            "paged_kv_init: page of 2^31 x 2^31 x 2^31 elements (strides overflow int64): %s: %s", kva_status_string(st),
            kva_last_error_message());
    /* a shape of more than 2^63 elements: the contiguous strides saturate at INT64_MAX (which every call refuses over
       more than one element) instead of overflowing into small or negative strides */
    kva_tensor big = kva_tensor_make(h_buf_dp(&F.q), KVA_DTYPE_F16, 4, (int64_t)1 << 40, (int64_t)1 << 40,
                                     (int64_t)1 << 40, 2);
    H_CHECK(big.stride[3] == 1 && big.stride[2] == 2 && big.stride[1] == ((int64_t)1 << 41) && big.stride[0] == INT64_MAX,
            "tensor_make: [2^40, 2^40, 2^40, 2] has strides %lld %lld %lld %lld (expected INT64_MAX, 2^41, 2, 1)",
            (long long)big.stride[0], (long long)big.stride[1], (long long)big.stride[2], (long long)big.stride[3]);
    /* cascade run of a plan with no query rows checks the pool as kva_run does (strides addressable) */
    {
        int32_t qo[2] = {0, 0}, kv[2] = {0, 1}, last[1] = {1};
        kva_cascade_params cp;
        kva_cascade_params_init(&cp);
        cp.num_levels = 1;
        cp.page_size = PS;
        cp.num_pages = NPAGES;
        cp.levels[0].batch_size = 1;
        cp.levels[0].qo_indptr = qo;
        cp.levels[0].kv_indptr = kv;
        cp.levels[0].kv_last_page_len = last;
        size_t db = 0, hb = 0;
        st = kva_cascade_workspace_size(F.ctx, &F.d, &cp, &db, &hb);
        h_ws w;
        h_ws_alloc(&w, db, hb);
        kva_cascade_plan plan;
        if (st == KVA_OK) st = kva_cascade_plan_make(F.ctx, &F.d, &cp, &w.ws, &plan, NULL);
        kva_cascade_run_args a;
        kva_cascade_run_args_init(&a);
        a.q = t3(h_buf_dp(&F.q), KVA_DTYPE_F16, 0, HQ, D);
        a.o = t3(h_buf_dp(&F.o), KVA_DTYPE_F16, 0, HQ, D);
        a.paged = F.args.paged;
        a.kv_indices[0] = (const int32_t*)h_buf_dp(&F.idx_d);
        if (st == KVA_OK) st = kva_cascade_run(F.ctx, &plan, &w.ws, &a);
        H_CHECK(st == KVA_OK, "cascade of no rows: %s: %s", kva_status_string(st), kva_last_error_message());
        a.paged.k_stride_page = INT64_MAX;
        ERR(KVA_ERR_INVALID_ARGUMENT, "cascade run (no rows): paged page stride addressing beyond 2^63 bytes",
            kva_cascade_run(F.ctx, &plan, &w.ws, &a));
        h_ws_free(&w);
    }
    /* errors are per thread and cleared on request */
    kva_clear_last_error();
    H_CHECK(kva_last_error_status() == KVA_OK && kva_last_error_message()[0] == 0, "kva_clear_last_error resets status and message");
}

int main(int argc, char** argv) {
    h_init(argc, argv, "test_errors");
    fx_init();
    test_baseline();
    test_empty_batch();
    test_context_and_desc();
    test_plan();
    test_run();
    test_run_special();
    test_alignment();
    test_single();
    test_merge();
    test_append();
    test_append_slot();
    test_misc();
    kva_context_destroy(F.other_ctx);
    return h_finish();
}
