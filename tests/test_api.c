/*
 * test_api.c - the small surface of the public API: version, status strings, dtypes, defaults of the *_init
 * functions, tensor and paged-KV helpers, contexts and their log callback, thread-local errors, and "the library
 * never prints" (stdout and stderr are redirected to a file around a series of calls that must leave it empty).
 */
#define _POSIX_C_SOURCE 200809L /* mkstemp, dup, lseek, fork */
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#include "harness.h"

static void test_version(void) {
    H_CHECK(KVA_VERSION == KVA_VERSION_MAJOR * 10000 + KVA_VERSION_MINOR * 100 + KVA_VERSION_PATCH, "KVA_VERSION formula");
    H_CHECK(kva_version() == KVA_VERSION, "kva_version() = %d, header %d", kva_version(), KVA_VERSION);
    char buf[64];
    snprintf(buf, sizeof buf, "%d.%d.%d", KVA_VERSION_MAJOR, KVA_VERSION_MINOR, KVA_VERSION_PATCH);
    H_CHECK(strcmp(KVA_VERSION_STRING, buf) == 0, "KVA_VERSION_STRING \"%s\" vs \"%s\"", KVA_VERSION_STRING, buf);
    H_CHECK(kva_version_string() && strcmp(kva_version_string(), KVA_VERSION_STRING) == 0, "kva_version_string() = \"%s\"",
            kva_version_string() ? kva_version_string() : "(null)");
}

static void test_status_strings(void) {
    static const char* names[] = {"KVA_OK",
                                  "KVA_ERR_INVALID_ARGUMENT",
                                  "KVA_ERR_UNSUPPORTED",
                                  "KVA_ERR_WORKSPACE_TOO_SMALL",
                                  "KVA_ERR_PAGETABLE_MALFORMED",
                                  "KVA_ERR_PAGE_INDEX_OUT_OF_RANGE",
                                  "KVA_ERR_PLAN_MISMATCH",
                                  "KVA_ERR_ALIGNMENT",
                                  "KVA_ERR_OUT_OF_MEMORY",
                                  "KVA_ERR_BACKEND",
                                  "KVA_ERR_JIT",
                                  "KVA_ERR_CAPTURE_ACTIVE",
                                  "KVA_ERR_NO_DEVICE",
                                  "KVA_ERR_INTERNAL"};
    /* the enum values are part of the ABI */
    static const kva_status vals[] = {KVA_OK, KVA_ERR_INVALID_ARGUMENT, KVA_ERR_UNSUPPORTED, KVA_ERR_WORKSPACE_TOO_SMALL,
                                      KVA_ERR_PAGETABLE_MALFORMED, KVA_ERR_PAGE_INDEX_OUT_OF_RANGE, KVA_ERR_PLAN_MISMATCH,
                                      KVA_ERR_ALIGNMENT, KVA_ERR_OUT_OF_MEMORY, KVA_ERR_BACKEND, KVA_ERR_JIT,
                                      KVA_ERR_CAPTURE_ACTIVE, KVA_ERR_NO_DEVICE, KVA_ERR_INTERNAL};
    for (int i = 0; i < 14; ++i) {
        const char* s = kva_status_string((kva_status)i);
        H_CHECK((int)vals[i] == i && s && strcmp(s, names[i]) == 0, "kva_status_string(%d) = \"%s\", expected %s", i, s ? s : "(null)",
                names[i]);
    }
    const char* u = kva_status_string((kva_status)99);
    H_CHECK(u != NULL && u[0] != 0, "kva_status_string(99) is a non-empty string");
    u = kva_status_string((kva_status)-1);
    H_CHECK(u != NULL && u[0] != 0, "kva_status_string(-1) is a non-empty string");
}

static void test_dtypes(void) {
    struct {
        kva_dtype t;
        size_t size;
        int value;
    } d[] = {{KVA_DTYPE_F32, 4, 0}, {KVA_DTYPE_F16, 2, 1}, {KVA_DTYPE_BF16, 2, 2}, {KVA_DTYPE_E4M3, 1, 3},
             {KVA_DTYPE_E5M2, 1, 4}, {KVA_DTYPE_I32, 4, 5}, {KVA_DTYPE_U8, 1, 6}};
    for (int i = 0; i < 7; ++i) {
        const char* n = kva_dtype_name(d[i].t);
        H_CHECK((int)d[i].t == d[i].value && kva_dtype_size(d[i].t) == d[i].size && kva_dtype_size(d[i].t) == ref_dtype_size(d[i].t),
                "kva_dtype_size(%d) = %zu, expected %zu", (int)d[i].t, kva_dtype_size(d[i].t), d[i].size);
        H_CHECK(n && n[0], "kva_dtype_name(%d) non-empty", (int)d[i].t);
        for (int j = 0; j < i; ++j) H_CHECK(strcmp(n, kva_dtype_name(d[j].t)) != 0, "dtype names %d and %d differ", i, j);
    }
    H_CHECK(kva_dtype_size((kva_dtype)77) == 0, "kva_dtype_size(unknown) = 0");
    H_CHECK(kva_dtype_name((kva_dtype)77) != NULL, "kva_dtype_name(unknown) is not NULL");
    H_CHECK(KVA_LAYOUT_NHD == 0 && KVA_LAYOUT_HND == 1 && KVA_MASK_NONE == 0 && KVA_MASK_CAUSAL == 1 && KVA_MASK_CUSTOM == 2 &&
                KVA_POS_NONE == 0 && KVA_POS_ROPE_LLAMA == 1 && KVA_POS_ALIBI == 2 && KVA_BACKEND_AUTO == 0 &&
                KVA_BACKEND_CPU == 1 && KVA_BACKEND_CUDA == 2 && KVA_OP_BATCH_DECODE == 0 && KVA_OP_BATCH_PREFILL_PAGED == 1 &&
                KVA_OP_BATCH_PREFILL_RAGGED == 2 && KVA_SCORE_SOFTMAX == 0 && KVA_SCORE_SIGMOID == 1,
            "enum values (FlashInfer-compatible where FlashInfer has them)");
}

static void test_inits(void) {
    kva_attention_desc d;
    memset(&d, 0x5a, sizeof d);
    kva_attention_desc_init(&d, 32, 8, 128, KVA_DTYPE_BF16);
    H_CHECK(d.num_qo_heads == 32 && d.num_kv_heads == 8 && d.head_dim_qk == 128 && d.head_dim_vo == 128 &&
                d.q_dtype == KVA_DTYPE_BF16 && d.kv_dtype == KVA_DTYPE_BF16 && d.o_dtype == KVA_DTYPE_BF16 &&
                d.mask_mode == KVA_MASK_NONE && d.window_left == -1 && d.logits_soft_cap == 0.0f && d.sm_scale == 0.0f &&
                d.pos_encoding == KVA_POS_NONE && d.rope_scale == 1.0f && d.rope_theta == 1e4f &&
                d.score_mode == KVA_SCORE_SOFTMAX && d.sigmoid_bias == 0.0f,
            "kva_attention_desc_init defaults");
    kva_attention_desc_init(NULL, 1, 1, 1, KVA_DTYPE_F16); /* must not crash */
    H_CHECK(1, "kva_attention_desc_init(NULL) is harmless");

    kva_context_options o;
    memset(&o, 0x5a, sizeof o);
    kva_context_options_init(&o);
    H_CHECK(o.backend == KVA_BACKEND_AUTO && o.device == 0 && o.num_threads == 0 && o.log_fn == NULL && o.log_user == NULL &&
                o.log_level == KVA_LOG_WARN && o.jit_cache_dir == NULL,
            "kva_context_options_init defaults");

    kva_plan_params p;
    memset(&p, 0x5a, sizeof p);
    kva_plan_params_init(&p);
    H_CHECK(p.batch_size == 0 && !p.qo_indptr && !p.kv_indptr && !p.kv_last_page_len && p.page_size == 0 && p.num_pages == 0 &&
                !p.kv_indices && p.fixed_split_size == 0 && p.disable_split_kv == 0 && p.graph_mode == 0 &&
                p.max_batch_size == 0 && p.max_total_qo_rows == 0,
            "kva_plan_params_init zeroes everything");

    kva_run_args a;
    memset(&a, 0x5a, sizeof a);
    kva_run_args_init(&a);
    H_CHECK(a.k_scale == 1.0f && a.v_scale == 1.0f && !a.q.data && !a.o.data && !a.lse.data && !a.k.data && !a.v.data &&
                !a.paged.k_data && !a.paged.indices && !a.custom_mask && a.custom_mask_bytes == 0 && !a.alibi_slopes && !a.stream,
            "kva_run_args_init: scales 1, everything else empty");

    int x;
    kva_tensor t = kva_tensor_make(&x, KVA_DTYPE_F16, 3, 5, 4, 64, 0);
    H_CHECK(t.data == &x && t.dtype == KVA_DTYPE_F16 && t.ndim == 3 && t.shape[0] == 5 && t.shape[1] == 4 && t.shape[2] == 64 &&
                t.stride[0] == 256 && t.stride[1] == 64 && t.stride[2] == 1,
            "kva_tensor_make: row-major strides");
    t = kva_tensor_make(&x, KVA_DTYPE_F32, 1, 7, 0, 0, 0);
    H_CHECK(t.ndim == 1 && t.shape[0] == 7 && t.stride[0] == 1, "kva_tensor_make 1-D");
    t = kva_tensor_make(&x, KVA_DTYPE_F32, 4, 2, 3, 4, 5);
    H_CHECK(t.stride[0] == 60 && t.stride[1] == 20 && t.stride[2] == 5 && t.stride[3] == 1, "kva_tensor_make 4-D");

    kva_paged_kv pk;
    kva_status st = kva_paged_kv_init(&pk, &x, &x, KVA_DTYPE_F16, KVA_LAYOUT_NHD, 10, 16, 8, 128, 64);
    H_CHECK(st == KVA_OK && pk.num_pages == 10 && pk.page_size == 16 && pk.num_heads == 8 && pk.head_dim_qk == 128 &&
                pk.head_dim_vo == 64 && pk.k_stride_page == 16 * 8 * 128 && pk.k_stride_token == 8 * 128 && pk.k_stride_head == 128 &&
                pk.v_stride_page == 16 * 8 * 64 && pk.v_stride_token == 8 * 64 && pk.v_stride_head == 64 && !pk.indices,
            "kva_paged_kv_init NHD strides");
    st = kva_paged_kv_init(&pk, &x, &x, KVA_DTYPE_E4M3, KVA_LAYOUT_HND, 10, 16, 8, 128, 64);
    H_CHECK(st == KVA_OK && pk.dtype == KVA_DTYPE_E4M3 && pk.k_stride_page == 16 * 8 * 128 && pk.k_stride_head == 16 * 128 &&
                pk.k_stride_token == 128 && pk.v_stride_head == 16 * 64 && pk.v_stride_token == 64,
            "kva_paged_kv_init HND strides");
}

typedef struct log_rec {
    int count;
    int max_level;
    int bad;
    void* user_seen;
} log_rec;

static void log_fn(void* user, kva_log_level level, const char* msg) {
    log_rec* r = (log_rec*)user;
    r->count++;
    if ((int)level > r->max_level) r->max_level = (int)level;
    if (!msg || !msg[0]) r->bad++;
    r->user_seen = user;
}

static void test_contexts(void) {
    for (int n = 1; n <= 5; n += 2) {
        kva_context_options o;
        kva_context_options_init(&o);
        o.backend = KVA_BACKEND_CPU;
        o.num_threads = n;
        kva_context* c = NULL;
        kva_status st = kva_context_create(&o, &c);
        H_CHECK(st == KVA_OK && c && kva_context_backend(c) == KVA_BACKEND_CPU && kva_context_num_workers(c) == n,
                "CPU context with %d threads: %s, %d workers", n, kva_status_string(st), c ? kva_context_num_workers(c) : -1);
        H_CHECK(kva_context_destroy(c) == KVA_OK, "destroy");
    }
    kva_context_options o;
    kva_context_options_init(&o);
    o.backend = KVA_BACKEND_CPU;
    kva_context* c = NULL;
    kva_status st = kva_context_create(&o, &c);
    long ncpu = sysconf(_SC_NPROCESSORS_ONLN);
    H_CHECK(st == KVA_OK && kva_context_num_workers(c) == (int)ncpu, "num_threads 0 gives one worker per online CPU (%d vs %ld)",
            c ? kva_context_num_workers(c) : -1, ncpu);
    kva_context_destroy(c);
    H_CHECK(kva_context_destroy(NULL) == KVA_OK, "kva_context_destroy(NULL) is OK");
    H_CHECK(kva_context_create(NULL, &c) == KVA_OK && c != NULL, "kva_context_create(NULL options) uses the defaults");
    kva_backend b = kva_context_backend(c);
    H_CHECK(b == KVA_BACKEND_CPU || b == KVA_BACKEND_CUDA, "AUTO context picked CPU or CUDA (%d)", (int)b);
    kva_context_destroy(c);
    /* many create/destroy cycles (thread pools are joined, nothing accumulates) */
    int ok = 1;
    for (int i = 0; i < 50 && ok; ++i) {
        o.num_threads = 1 + i % 4;
        c = NULL;
        ok = kva_context_create(&o, &c) == KVA_OK && kva_context_destroy(c) == KVA_OK;
    }
    H_CHECK(ok, "50 context create/destroy cycles");
    /* CUDA requested: a context on a CUDA device, or KVA_ERR_NO_DEVICE with a message (no silent CPU fallback) */
    kva_context_options_init(&o);
    o.backend = KVA_BACKEND_CUDA;
    c = NULL;
    kva_clear_last_error();
    st = kva_context_create(&o, &c);
    if (st == KVA_OK) {
        H_CHECK(kva_context_backend(c) == KVA_BACKEND_CUDA, "CUDA context reports the CUDA backend");
        kva_context_destroy(c);
    } else {
        H_CHECK(st == KVA_ERR_NO_DEVICE && kva_last_error_message()[0] && c == NULL,
                "CUDA context without a usable device: %s (expected KVA_ERR_NO_DEVICE), \"%s\"", kva_status_string(st),
                kva_last_error_message());
    }
    /* the log callback: gets messages at or below its level, with the user pointer */
    log_rec rec;
    memset(&rec, 0, sizeof rec);
    kva_context_options_init(&o);
    o.backend = KVA_BACKEND_CPU;
    o.num_threads = 2;
    o.log_fn = log_fn;
    o.log_user = &rec;
    o.log_level = KVA_LOG_DEBUG;
    st = kva_context_create(&o, &c);
    H_CHECK(st == KVA_OK && rec.count > 0 && rec.bad == 0 && rec.user_seen == &rec,
            "log callback at DEBUG: %d messages at context creation, user pointer passed", rec.count);
    kva_context_destroy(c);
    memset(&rec, 0, sizeof rec);
    o.log_level = KVA_LOG_ERROR;
    st = kva_context_create(&o, &c);
    H_CHECK(st == KVA_OK && rec.max_level <= (int)KVA_LOG_ERROR, "log level ERROR filters INFO/DEBUG (max level seen %d)", rec.max_level);
    kva_context_destroy(c);
}

static void* thread_err(void* arg) {
    int* out = (int*)arg;
    kva_clear_last_error();
    kva_status st = kva_alibi_slopes(0, NULL);
    out[0] = st == KVA_ERR_INVALID_ARGUMENT && kva_last_error_status() == st && kva_last_error_message()[0] != 0;
    return NULL;
}

static void test_thread_local_errors(void) {
    kva_clear_last_error();
    H_CHECK(kva_last_error_status() == KVA_OK && kva_last_error_message()[0] == 0, "no error after kva_clear_last_error");
    int res = 0;
    pthread_t th;
    pthread_create(&th, NULL, thread_err, &res);
    pthread_join(th, NULL);
    H_CHECK(res, "an error in another thread is recorded there");
    H_CHECK(kva_last_error_status() == KVA_OK && kva_last_error_message()[0] == 0, "and not seen in this thread");
    float s[2];
    kva_status st = kva_alibi_slopes(0, s);
    H_CHECK(st == KVA_ERR_INVALID_ARGUMENT && kva_last_error_status() == st && kva_last_error_message()[0] != 0,
            "last error status and message of this thread");
    /* a call that succeeds keeps the last failing call's error, also where it recovered from an internal failure
       (AUTO without a usable CUDA device falls back to the CPU) */
    char before[256];
    snprintf(before, sizeof before, "%s", kva_last_error_message());
    kva_context* c = NULL;
    st = kva_context_create(NULL, &c);
    H_CHECK(st == KVA_OK && kva_last_error_status() == KVA_ERR_INVALID_ARGUMENT &&
                strcmp(kva_last_error_message(), before) == 0,
            "a successful kva_context_create keeps the last error (%s, \"%s\")",
            kva_status_string(kva_last_error_status()), kva_last_error_message());
    kva_context_destroy(c);
}

/* CPU backend: a context made before fork() works in the child, which has none of its worker threads: calls run on
   the calling thread (same results) and destroy frees it. The child used to wait forever for the workers (a watchdog
   alarm turns a hang into a failure here). */
static void test_fork_child(void) {
    if (h_opt.backend != KVA_BACKEND_CPU) return;
    enum { ROWS = 8192, HEADS = 4, DIM = 8 }; /* above the CPU backend's threshold for a threaded merge */
    float* va = (float*)malloc(sizeof(float) * ROWS * HEADS * DIM * 4);
    float* sa = (float*)malloc(sizeof(float) * ROWS * HEADS * 4);
    if (!H_CHECK(va && sa, "host memory")) return;
    float *vb = va + ROWS * HEADS * DIM, *vo = vb + ROWS * HEADS * DIM, *vc = vo + ROWS * HEADS * DIM;
    float *sb = sa + ROWS * HEADS, *so = sb + ROWS * HEADS, *sc = so + ROWS * HEADS;
    for (int i = 0; i < ROWS * HEADS * DIM; ++i) {
        va[i] = (float)(i % 7) - 3.0f;
        vb[i] = (float)(i % 5) * 0.5f;
    }
    for (int i = 0; i < ROWS * HEADS; ++i) {
        sa[i] = (float)(i % 9) * 0.25f;
        sb[i] = (float)(i % 4) - 1.0f;
    }
    kva_context_options o;
    kva_context_options_init(&o);
    o.backend = KVA_BACKEND_CPU;
    o.num_threads = 2;
    kva_context* c = NULL;
    if (!H_CHECK(kva_context_create(&o, &c) == KVA_OK, "context: %s", kva_last_error_message())) return;
    kva_tensor tva = kva_tensor_make(va, KVA_DTYPE_F32, 3, ROWS, HEADS, DIM, 0);
    kva_tensor tvb = kva_tensor_make(vb, KVA_DTYPE_F32, 3, ROWS, HEADS, DIM, 0);
    kva_tensor tsa = kva_tensor_make(sa, KVA_DTYPE_F32, 2, ROWS, HEADS, 0, 0);
    kva_tensor tsb = kva_tensor_make(sb, KVA_DTYPE_F32, 2, ROWS, HEADS, 0, 0);
    kva_tensor tvo = kva_tensor_make(vo, KVA_DTYPE_F32, 3, ROWS, HEADS, DIM, 0);
    kva_tensor tso = kva_tensor_make(so, KVA_DTYPE_F32, 2, ROWS, HEADS, 0, 0);
    kva_tensor tvc = kva_tensor_make(vc, KVA_DTYPE_F32, 3, ROWS, HEADS, DIM, 0);
    kva_tensor tsc = kva_tensor_make(sc, KVA_DTYPE_F32, 2, ROWS, HEADS, 0, 0);
    H_CHECK(kva_merge_state(c, &tva, &tsa, &tvb, &tsb, &tvo, &tso, NULL) == KVA_OK, "merge in the parent: %s",
            kva_last_error_message());
    fflush(stdout);
    pid_t pid = fork();
    if (pid == 0) {
        alarm(120); /* watchdog only */
        int bad = kva_merge_state(c, &tva, &tsa, &tvb, &tsb, &tvc, &tsc, NULL) != KVA_OK ||
                  memcmp(vc, vo, sizeof(float) * ROWS * HEADS * DIM) != 0 ||
                  memcmp(sc, so, sizeof(float) * ROWS * HEADS) != 0;
        bad |= kva_context_destroy(c) != KVA_OK;
        _exit(bad);
    }
    int status = 0;
    if (H_CHECK(pid > 0 && waitpid(pid, &status, 0) == pid, "fork"))
        H_CHECK(WIFEXITED(status) && WEXITSTATUS(status) == 0,
                "a CPU context made before fork() merges in the child as in the parent and is destroyed there (child "
                "%s %d)", WIFSIGNALED(status) ? "killed by signal" : "exit status",
                WIFSIGNALED(status) ? WTERMSIG(status) : WEXITSTATUS(status));
    kva_context_destroy(c);
    free(va);
    free(sa);
}

/* A small but complete session (contexts, errors, plan, run, merges, append), all with stdout/stderr redirected. */
static int quiet_session(void) {
    int ok = 1;
    kva_context_options o;
    kva_context_options_init(&o);
    o.backend = h_opt.backend;
    o.num_threads = 2;
    o.log_level = KVA_LOG_DEBUG; /* no log_fn: diagnostics must be dropped, not printed */
    kva_context* c = NULL;
    ok &= kva_context_create(&o, &c) == KVA_OK;
    o.backend = KVA_BACKEND_CUDA;
    kva_context* c2 = NULL;
    if (kva_context_create(&o, &c2) == KVA_OK) kva_context_destroy(c2);
    kva_attention_desc d;
    kva_attention_desc_init(&d, 4, 2, 64, KVA_DTYPE_F16);
    d.mask_mode = KVA_MASK_CAUSAL;
    int32_t qi[3] = {0, 3, 5}, ki[3] = {0, 2, 3}, last[2] = {4, 1}, idx[3] = {2, 0, 5};
    kva_plan_params p;
    kva_plan_params_init(&p);
    p.batch_size = 2;
    p.qo_indptr = qi;
    p.kv_indptr = ki;
    p.kv_last_page_len = last;
    p.page_size = 4;
    p.num_pages = 6;
    p.kv_indices = idx;
    size_t db = 0, hb = 0;
    ok &= kva_plan_workspace_size(c, &d, KVA_OP_BATCH_PREFILL_PAGED, &p, &db, &hb) == KVA_OK;
    h_ws ws;
    h_ws_alloc(&ws, db, hb);
    kva_plan plan;
    ok &= kva_plan_make(c, &d, KVA_OP_BATCH_PREFILL_PAGED, &p, &ws.ws, &plan, NULL) == KVA_OK;
    h_buf q = h_buf_alloc(KVA_DTYPE_F16, 5 * 4 * 64), out = h_buf_alloc(KVA_DTYPE_F16, 5 * 4 * 64);
    h_buf kp = h_buf_alloc(KVA_DTYPE_F16, 6 * 4 * 2 * 64), vp = h_buf_alloc(KVA_DTYPE_F16, 6 * 4 * 2 * 64);
    h_buf id = h_buf_alloc(KVA_DTYPE_I32, 3);
    memcpy(h_buf_hp(&id), idx, sizeof idx);
    h_buf_upload(&id);
    kva_run_args a;
    kva_run_args_init(&a);
    a.q = kva_tensor_make(h_buf_dp(&q), KVA_DTYPE_F16, 3, 5, 4, 64, 0);
    a.o = kva_tensor_make(h_buf_dp(&out), KVA_DTYPE_F16, 3, 5, 4, 64, 0);
    kva_paged_kv_init(&a.paged, h_buf_dp(&kp), h_buf_dp(&vp), KVA_DTYPE_F16, KVA_LAYOUT_NHD, 6, 4, 2, 64, 64);
    a.paged.indices = (const int32_t*)h_buf_dp(&id);
    ok &= kva_run(c, &plan, &ws.ws, &a) == KVA_OK;
    /* errors of every kind */
    kva_run_args bad = a;
    bad.q.shape[0] = 4;
    ok &= kva_run(c, &plan, &ws.ws, &bad) != KVA_OK;
    ok &= kva_run(c, NULL, &ws.ws, &a) != KVA_OK;
    kva_plan junk;
    memset(&junk, 0x33, sizeof junk);
    ok &= kva_run(c, &junk, &ws.ws, &a) != KVA_OK;
    p.page_size = 0;
    ok &= kva_plan_make(c, &d, KVA_OP_BATCH_PREFILL_PAGED, &p, &ws.ws, &plan, NULL) != KVA_OK;
    d.num_kv_heads = 3;
    ok &= kva_attention_desc_check(c, &d) != KVA_OK;
    ok &= kva_alibi_slopes(-1, NULL) != KVA_OK;
    int32_t mi[2] = {0, 9};
    ok &= kva_merge_states(c, &a.o, &a.lse, mi, 1, &a.o, NULL, NULL) != KVA_OK;
    h_buf_free(&q);
    h_buf_free(&out);
    h_buf_free(&kp);
    h_buf_free(&vp);
    h_buf_free(&id);
    h_ws_free(&ws);
    kva_context_destroy(c);
    return ok;
}

static void test_never_prints(void) {
    char path[] = "/tmp/kva_test_api_XXXXXX";
    int fd = mkstemp(path);
    if (fd < 0) {
        H_CHECK(0, "mkstemp failed");
        return;
    }
    fflush(stdout);
    fflush(stderr);
    int out_saved = dup(1), err_saved = dup(2);
    dup2(fd, 1);
    dup2(fd, 2);
    int ok = quiet_session();
    fflush(stdout);
    fflush(stderr);
    dup2(out_saved, 1);
    dup2(err_saved, 2);
    close(out_saved);
    close(err_saved);
    off_t size = lseek(fd, 0, SEEK_END);
    char head[200] = {0};
    if (size > 0) {
        lseek(fd, 0, SEEK_SET);
        ssize_t n = read(fd, head, sizeof head - 1);
        (void)n;
    }
    close(fd);
    unlink(path);
    H_CHECK(ok, "the quiet session's calls behaved (successes succeeded, errors failed)");
    H_CHECK(size == 0, "the library wrote %lld bytes to stdout/stderr: \"%s\"", (long long)size, head);
}

int main(int argc, char** argv) {
    h_init(argc, argv, "test_api");
    test_version();
    test_status_strings();
    test_dtypes();
    test_inits();
    test_contexts();
    test_thread_local_errors();
    test_fork_child();
    test_never_prints();
    return h_finish();
}
