/*
 * test_mutate.c - a seeded random mutation fuzzer of bad inputs for the public C API.
 *
 * Each case builds a valid fixture of one op family with random shapes (batch decode, paged prefill, ragged
 * prefill, the single-request ops, append to the paged cache (page-table and slot forms), merge_state /
 * merge_state_in_place / merge_states),
 * then applies 0-3 mutations drawn from a list (NULL pointers and descriptors; negative, huge or inconsistent counts;
 * malformed page tables, CSR or block-table form (kv_seq_lens + block_table_stride: a short or huge stride, lengths past a
 * row, junk in rows' tails that must never be read, unread kv_indptr / kv_last_page_len); page indices outside the pool
 * in the host copy or in backend memory; negative, zero, huge,
 * too small (overlapping) and non-unit strides; rank, dtype and shape disagreement with the plan; small, NULL or
 * misaligned workspaces; corrupted, zeroed, foreign or stale plans; non-finite scalars; out-of-enum values; aliased
 * outputs; ...) and makes the calls. The oracle of every call:
 *   - refused (status != KVA_OK): the status is one the drawn mutations allow (docs/errors.md),
 *     kva_last_error_status() repeats it, kva_last_error_message() is non-empty, and every buffer of the case
 *     (outputs, inputs, workspace, KV pools; the kva_plan struct of a failed plan) is byte-identical to its
 *     snapshot, guard bands included (single ops: their workspace is scratch, docs/errors.md);
 *   - accepted (KVA_OK): no drawn mutation had to be refused, a model of the contract (written here from kvattn.h and
 *     docs/errors.md) finds the inputs as given valid, the outputs match the float64 reference (tests/ref.c) computed
 *     from those inputs at the harness tolerances, every output element the call must not write keeps its NaN poison,
 *     guards are intact and the inputs are unchanged. Append: the pools hold exactly the tokens the model writes.
 * Mutations that are harmless by the contract (a larger pool, a smaller but overlapping input stride, a broadcast
 * input, an output aliasing a merge input, another valid length, ...) are part of the list: their calls must pass
 * and match the reference. Anything else fails the case, which prints its index, the seed, the fixture and the
 * mutations with a replay command line.
 *
 * Backend memory data the host cannot see on the CUDA backend (page indices of the run's page table, append batch
 * indices / positions / page table) follow docs/errors.md: the CPU backend refuses them; on a device backend the
 * call returns KVA_OK, the bad requests get o = 0 and lse = -inf (run) or the bad tokens are not written (append),
 * and kva_read_faults reports the first fault.
 *
 * Options: --seed N (KVA_TEST_SEED), --count N (KVA_TEST_COUNT; default 2000), --case I (KVA_TEST_CASE: replay
 * case I of the seed alone), --suite decode|prefill|ragged|single|append|merge|all, --verbose, --backend cpu|cuda
 * (KVA_TEST_BACKEND).
 */
#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "harness.h"

#define MAXB 5     /* requests per batch */
#define MAXBUF 24  /* buffers per case */
#define MAXMUT 3   /* mutations per case */
#define XPAGES 3   /* pages allocated past num_pages (NaN for attention: a read through a bad index shows) */
#define SPARE 4    /* page-table entries past kv_indptr[B] (valid pages) */

#define SB(s) (1u << (unsigned)(s))
#define S_OK SB(KVA_OK)
#define S_INV SB(KVA_ERR_INVALID_ARGUMENT)
#define S_UNS SB(KVA_ERR_UNSUPPORTED)
#define S_WSS SB(KVA_ERR_WORKSPACE_TOO_SMALL)
#define S_MAL SB(KVA_ERR_PAGETABLE_MALFORMED)
#define S_PIR SB(KVA_ERR_PAGE_INDEX_OUT_OF_RANGE)
#define S_PMM SB(KVA_ERR_PLAN_MISMATCH)
#define S_ALN SB(KVA_ERR_ALIGNMENT)
#define S_OOM SB(KVA_ERR_OUT_OF_MEMORY)

#define F32 KVA_DTYPE_F32
#define F16 KVA_DTYPE_F16
#define BF16 KVA_DTYPE_BF16
#define E4M3 KVA_DTYPE_E4M3
#define E5M2 KVA_DTYPE_E5M2

#define NELEM(a) ((int64_t)(sizeof(a) / sizeof((a)[0])))
#define PICK(a) ((a)[rr(0, NELEM(a) - 1)])

enum { F_DEC, F_PRE, F_RAG, F_SDEC, F_SPRE, F_APP, F_MRG, F_MIP, F_MRGS, F_N };
static const char* const fam_names[F_N] = {"decode",         "prefill", "ragged",      "single_decode",
                                           "single_prefill", "append",  "merge_state", "merge_state_in_place",
                                           "merge_states"};
static const int fam_weight[F_N] = {16, 16, 13, 6, 6, 17, 9, 7, 10};
#define FB(f) (1u << (f))
#define FB_BATCH (FB(F_DEC) | FB(F_PRE) | FB(F_RAG))
#define FB_PAGED (FB(F_DEC) | FB(F_PRE))
#define FB_SINGLE (FB(F_SDEC) | FB(F_SPRE))
#define FB_ATT (FB_BATCH | FB_SINGLE)
#define FB_MERGE (FB(F_MRG) | FB(F_MIP) | FB(F_MRGS))

static void* xcalloc(size_t n, size_t s) {
    void* p = calloc(n ? n : 1, s ? s : 1);
    if (!p) {
        printf("FATAL: out of memory\n");
        exit(3);
    }
    return p;
}

/* ============================================================================================== */
/* The case: RNG, mutations, buffers, failure report                                               */

typedef struct mut {
    const char* name;
    char detail[200];
    unsigned mask[2]; /* statuses allowed at stage 0 (plan, or the family's only call) and stage 1 (run); S_OK: may pass */
    int must;         /* 1: stage 0 must refuse; 2: the run must refuse if the plan passed; 0: may pass */
    int need_nnz;     /* append: the refusal is certain only with nnz > 0 (the call returns early for nnz = 0) */
    int host;         /* append: a host-side mutation (else: backend data, judged by the model) */
} mut;

typedef struct tcase {
    int index;
    uint64_t seed;
    int fam;
    h_rng r;
    mut m[MAXMUT];
    int nm;
    unsigned groups, conf;
    h_buf* buf[MAXBUF];
    const char* bname[MAXBUF];
    int nbuf;
    unsigned char* snap[MAXBUF];
    size_t snapn[MAXBUF];
    char fix[700];
    int failed;
    int refused; /* the case's last call was refused */
} tcase;

static tcase T;
static kva_context* g_ctx;
static kva_context* g_other;
static int g_dev;          /* device backend */
static int g_single_stage; /* the family makes one call: stage masks fold into stage 0 */
static uint64_t g_seed;
static h_ws g_fws;         /* a workspace for kva_read_faults of appends */

static int64_t rr(int64_t lo, int64_t hi) { return h_rng_range(&T.r, lo, hi); }
static int pct(int p) { return rr(0, 99) < p; }
static double unif(void) { return h_rng_uniform(&T.r); }

static void mask_str(unsigned m, char* out, size_t n) {
    out[0] = 0;
    size_t k = 0;
    for (int s = 0; s <= 13; ++s)
        if (m & SB(s)) {
            int w = snprintf(out + k, n - k, "%s%s", k ? "|" : "", s == 0 ? "OK" : kva_status_string((kva_status)s) + 8);
            if (w < 0 || (size_t)w >= n - k) break;
            k += (size_t)w;
        }
    if (!k) snprintf(out, n, "nothing");
}

static void cfail(const char* fmt, ...) H_PRINTF(1, 2);
static void cfail(const char* fmt, ...) {
    if (!T.failed) {
        T.failed = 1;
        printf("FAIL case %d (seed %llu, %s, %s backend)\n", T.index, (unsigned long long)g_seed, fam_names[T.fam],
               h_opt.backend_name);
        printf("  fixture: %s\n", T.fix);
        if (!T.nm) printf("  mutations: none (a control case)\n");
        for (int i = 0; i < T.nm; ++i) {
            char a[160], b[160];
            mask_str(T.m[i].mask[0], a, sizeof a);
            mask_str(T.m[i].mask[1], b, sizeof b);
            printf("  mutation %d: %s: %s [stage 0: %s; stage 1: %s; must %d]\n", i + 1, T.m[i].name, T.m[i].detail, a,
                   b, T.m[i].must);
        }
        printf("  replay: KVA_TEST_BACKEND=%s test_mutate --seed %llu --case %d%s%s --verbose\n", h_opt.backend_name,
               (unsigned long long)g_seed, T.index, h_opt.suite ? " --suite " : "", h_opt.suite ? h_opt.suite : "");
    }
    va_list ap;
    va_start(ap, fmt);
    printf("  -> ");
    vprintf(fmt, ap);
    printf("\n");
    va_end(ap);
}

static mut* add_v(const char* name, unsigned m0, unsigned m1, int must, const char* fmt, va_list ap) {
    if (T.nm >= MAXMUT) {
        printf("FATAL: test_mutate: more than %d mutations\n", MAXMUT);
        exit(3);
    }
    mut* m = &T.m[T.nm++];
    memset(m, 0, sizeof *m);
    m->name = name;
    if (g_single_stage) { /* one call: OK where both stages pass (m1 == 0: no run stage) */
        const unsigned e = (m0 | m1) & ~S_OK, ok = m0 & (m1 ? m1 : S_OK) & S_OK;
        m0 = e | ok;
        m1 = 0;
        must = must ? 1 : 0;
        if (must) m0 &= ~S_OK;
    }
    m->mask[0] = m0;
    m->mask[1] = m1;
    m->must = must;
    vsnprintf(m->detail, sizeof m->detail, fmt, ap);
    return m;
}

/* A mutation with explicit masks for stage 0 and stage 1. */
static mut* add(const char* name, unsigned m0, unsigned m1, int must, const char* fmt, ...) H_PRINTF(5, 6);
static mut* add(const char* name, unsigned m0, unsigned m1, int must, const char* fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    mut* m = add_v(name, m0, m1, must, fmt, ap);
    va_end(ap);
    return m;
}

/* A mutation that matters at one stage: refused there with one of errs (certainly when must), else passes. */
static mut* addst(int st, const char* name, unsigned errs, int must, const char* fmt, ...) H_PRINTF(5, 6);
static mut* addst(int st, const char* name, unsigned errs, int must, const char* fmt, ...) {
    const unsigned m = errs | (must ? 0 : S_OK);
    va_list ap;
    va_start(ap, fmt);
    mut* r = add_v(name, st == 0 ? m : S_OK, st == 0 ? S_OK : m, must ? st + 1 : 0, fmt, ap);
    va_end(ap);
    return r;
}

/* ---- buffers ---- */

static size_t btotal(const h_buf* b) { return 2 * H_GUARD_BYTES + (b->bytes + 255) / 256 * 256; }

static void reg(h_buf* b, const char* name) {
    if (T.nbuf >= MAXBUF) {
        printf("FATAL: test_mutate: more than %d buffers\n", MAXBUF);
        exit(3);
    }
    T.buf[T.nbuf] = b;
    T.bname[T.nbuf] = name;
    T.snap[T.nbuf] = NULL;
    T.snapn[T.nbuf] = 0;
    ++T.nbuf;
}

static void snap_all(void) {
    for (int i = 0; i < T.nbuf; ++i) {
        h_buf_download(T.buf[i]);
        free(T.snap[i]);
        T.snapn[i] = btotal(T.buf[i]);
        T.snap[i] = (unsigned char*)xcalloc(T.snapn[i], 1);
        memcpy(T.snap[i], T.buf[i]->host, T.snapn[i]);
    }
}

/* The first registered buffer, other than those in skip, that differs from its snapshot (NULL: none). */
static const char* changed(h_buf* const* skip, int nskip) {
    for (int i = 0; i < T.nbuf; ++i) {
        int sk = 0;
        for (int k = 0; k < nskip; ++k) sk |= skip[k] == T.buf[i];
        if (sk || !T.snap[i]) continue;
        h_buf_download(T.buf[i]);
        if (memcmp(T.snap[i], T.buf[i]->host, T.snapn[i]) != 0) return T.bname[i];
    }
    return NULL;
}

static void free_bufs(void) {
    for (int i = 0; i < T.nbuf; ++i) {
        if (T.buf[i]->host) h_buf_free(T.buf[i]);
        free(T.snap[i]);
        T.snap[i] = NULL;
    }
    T.nbuf = 0;
}

/* A view of backend memory through the host mirror of the registered buffer holding `base`: bytes [lo, hi) around
   base lie in that buffer's payload. */
typedef struct view {
    const unsigned char* h;
    int64_t lo, hi;
    int bi; /* registered buffer index */
    int64_t off; /* byte offset of base in the payload */
} view;

static int resolve(const void* base, view* v) {
    memset(v, 0, sizeof *v);
    v->bi = -1;
    if (!base) return 0;
    const uintptr_t p = (uintptr_t)base;
    for (int i = 0; i < T.nbuf; ++i) {
        const uintptr_t p0 = (uintptr_t)h_buf_dp(T.buf[i]);
        if (p >= p0 && p <= p0 + T.buf[i]->bytes) {
            v->off = (int64_t)(p - p0);
            v->h = (const unsigned char*)h_buf_hp(T.buf[i]) + v->off;
            v->lo = -v->off;
            v->hi = (int64_t)T.buf[i]->bytes - v->off;
            v->bi = i;
            return 1;
        }
    }
    return 0;
}

/* element e (of dtype dt) of the view; 0 if outside its buffer */
static int vget(const view* v, kva_dtype dt, int64_t e, double* x) {
    const int64_t es = (int64_t)ref_dtype_size(dt);
    if (!v->h || es <= 0 || e < v->lo / es - 1 || e > v->hi / es + 1) return 0;
    const int64_t b = e * es;
    if (b < v->lo || b + es > v->hi) return 0;
    *x = ref_decode(dt, v->h + b, 0);
    return 1;
}

static void fill_rand(h_buf* b) {
    for (size_t i = 0; i < b->elems; ++i) h_buf_set(b, i, h_rng_normalish(&T.r));
}

/* ---- the call oracle ---- */

/* Stage verdict: st must be allowed by every drawn mutation (OK) or by one of them (an error). */
static int verdict(int stage, kva_status st, const char* call) {
    unsigned errs = 0;
    int ok_allowed = 1;
    for (int i = 0; i < T.nm; ++i) {
        errs |= T.m[i].mask[stage] & ~S_OK;
        if (!(T.m[i].mask[stage] & S_OK) || T.m[i].must == stage + 1) ok_allowed = 0;
    }
    if (st == KVA_OK) {
        if (!ok_allowed) cfail("%s returned KVA_OK, but a mutation must be refused there", call);
        return ok_allowed;
    }
    if (!(errs & SB(st))) {
        char a[200];
        mask_str(errs, a, sizeof a);
        cfail("%s returned %s (\"%s\"); the mutations allow %s", call, kva_status_string(st), kva_last_error_message(),
              a);
        return 0;
    }
    return 1;
}

/* A refused call: its message and status, and every buffer but skip unchanged. */
static void check_refused(kva_status st, const char* call, h_buf* const* skip, int nskip) {
    const char* msg = kva_last_error_message();
    if (kva_last_error_status() != st)
        cfail("%s returned %s but kva_last_error_status() is %s", call, kva_status_string(st),
              kva_status_string(kva_last_error_status()));
    if (!msg || !msg[0]) cfail("%s returned %s with an empty kva_last_error_message()", call, kva_status_string(st));
    const char* w = changed(skip, nskip);
    T.refused = 1;
    if (w) cfail("%s refused the call (%s: %s) but modified %s", call, kva_status_string(st), msg ? msg : "", w);
    h_logf("    %s: %s: %s\n", call, kva_status_string(st), msg ? msg : "");
}

/* ---- outputs: every element of a logical output against the buffer under it ----
 * n logical elements at element positions pos[] (in dtype units from the start of buffer bi's payload), references
 * ref[] with tolerance scales mag[] (NULL: 1). Each position some element maps to must match the reference of one of
 * them (several when a stride overlaps rows: the last writer wins); every other byte of the payload, and the guards,
 * must equal the snapshot. Returns 1 if all hold. */
static int check_out(int bi, kva_dtype dt, const int64_t* pos, const double* ref, const double* mag, int64_t n, h_tol t,
                     const char* what) {
    h_buf* b = T.buf[bi];
    h_buf_download(b);
    const int64_t es = (int64_t)ref_dtype_size(dt);
    const int64_t ne = (int64_t)b->bytes / es;
    int64_t* head = (int64_t*)xcalloc((size_t)(ne > 0 ? ne : 1), sizeof(int64_t));
    int64_t* next = (int64_t*)xcalloc((size_t)(n > 0 ? n : 1), sizeof(int64_t));
    int ok = 1, shown = 0;
    for (int64_t p = 0; p < ne; ++p) head[p] = -1;
    for (int64_t i = 0; i < n; ++i) {
        if (pos[i] < 0 || pos[i] >= ne) {
            cfail("%s: element %lld of the output lies outside its buffer (position %lld of %lld)", what, (long long)i,
                  (long long)pos[i], (long long)ne);
            free(head);
            free(next);
            return 0;
        }
        next[i] = head[pos[i]];
        head[pos[i]] = i;
    }
    const unsigned char* hp = (const unsigned char*)h_buf_hp(b);
    const unsigned char* sp = T.snap[bi] + H_GUARD_BYTES;
    for (int64_t p = 0; p < ne; ++p) {
        if (head[p] < 0) {
            if (memcmp(hp + p * es, sp + p * es, (size_t)es) != 0) {
                if (shown++ < 6) cfail("%s: element %lld of the buffer was written but no output maps there", what, (long long)p);
                ok = 0;
            }
            continue;
        }
        const double got = ref_decode(dt, hp + p * es, 0);
        int match = 0;
        int64_t first = head[p];
        for (int64_t i = head[p]; i >= 0 && !match; i = next[i]) match = h_close(got, ref[i], t, mag ? mag[i] : 1.0);
        if (!match) {
            if (shown++ < 6)
                cfail("%s: buffer element %lld = %.7g, reference %.7g (logical element %lld%s; tol %.2g + %.2g rel)", what,
                      (long long)p, got, ref[first], (long long)first, next[first] >= 0 ? ", one of several" : "",
                      t.atol * (mag ? mag[first] : 1.0), t.rtol);
            ok = 0;
        }
    }
    for (size_t k = (size_t)(ne * es); k < b->bytes; ++k)
        if (hp[k] != sp[k]) {
            if (shown++ < 6) cfail("%s: trailing byte %zu written", what, k);
            ok = 0;
            break;
        }
    if (!h_buf_guards_ok(b)) {
        cfail("%s: guard band overwritten", what);
        ok = 0;
    }
    free(head);
    free(next);
    return ok;
}

/* ---- a model of the tensor checks of the contract (kvattn.h: kva_tensor) ---- */

static int64_t max_elem_off(kva_dtype dt) {
    const size_t es = ref_dtype_size(dt);
    return INT64_MAX / (int64_t)(es > 0 ? es : 4) - 1;
}

/* NULL if t is a valid view of shape[nd] in dt (out: written, no broadcast), else the reason (into why). */
static const char* model_tensor(char* why, size_t n, const char* name, const kva_tensor* t, kva_dtype dt, int nd,
                                const int64_t* shape, int out) {
    if (!t) return snprintf(why, n, "%s: descriptor NULL", name), why;
    int empty = 0;
    for (int i = 0; i < nd; ++i) empty |= shape[i] <= 0;
    if (!t->data && !empty) return snprintf(why, n, "%s: data NULL", name), why;
    if (t->dtype != dt) return snprintf(why, n, "%s: dtype %d, expected %d", name, (int)t->dtype, (int)dt), why;
    if (t->ndim != nd) return snprintf(why, n, "%s: %d dims, expected %d", name, (int)t->ndim, nd), why;
    for (int i = 0; i < nd; ++i) {
        if (t->shape[i] != shape[i])
            return snprintf(why, n, "%s: shape[%d] = %lld, expected %lld", name, i, (long long)t->shape[i],
                            (long long)shape[i]),
                   why;
        if (t->stride[i] < 0) return snprintf(why, n, "%s: negative stride %d", name, i), why;
    }
    if (t->stride[nd - 1] != 1 && shape[nd - 1] > 1) return snprintf(why, n, "%s: last stride not 1", name), why;
    if (!empty) {
        const int64_t limit = max_elem_off(dt);
        int64_t ext = 0;
        for (int i = 0; i < nd; ++i) {
            const int64_t span = shape[i] - 1;
            if (t->stride[i] > 0 && span > (limit - ext) / t->stride[i])
                return snprintf(why, n, "%s: strides address beyond 2^63 bytes", name), why;
            ext += span * t->stride[i];
        }
    }
    if (out)
        for (int i = 0; i < nd; ++i)
            if (shape[i] > 1 && t->stride[i] == 0) return snprintf(why, n, "%s: broadcast output (stride %d = 0)", name, i), why;
    return NULL;
}

/* ---- a generic tensor mutation ---- */

typedef struct tspec {
    const char* name;
    int stage;          /* 0 or 1 */
    int checked;        /* the call validates this tensor: a bad one is certainly refused */
    int out;            /* the call writes it */
    unsigned mm;        /* status of a shape / rank / dtype mismatch */
    unsigned badtype;   /* status of a dtype that is no float dtype */
    unsigned extra;     /* statuses also allowed */
    int free_rows;      /* dim 0 is a length of the call (single ops' q and k): the model judges its changes */
    int ndim_alt;       /* another rank the call accepts (single decode: q, o [heads, dim], lse [heads]); 0: none */
    int overlap_ok;     /* a smaller (overlapping) stride is within the contract (the reference follows it) */
    int dtype_ok;       /* another float dtype of no larger element is within the contract (merge outputs) */
    int null_ok;        /* data NULL means "not wanted" (lse, s_out): not drawn here */
} tspec;

static int mut_tensor(kva_tensor* t, const tspec* s) {
    const int nd = t->ndim;
    if (nd < 1 || nd > KVA_MAX_DIMS) return 0;
    const unsigned dvm = g_dev ? S_ALN : 0;
    const unsigned ex = s->extra;
    const int chk = s->checked;
    switch (rr(0, 10)) {
    case 0:
    case 1: { /* a shape */
        static const int64_t sp[] = {0, -1, 1 << 30, INT64_MAX, INT64_MIN, (int64_t)1 << 40};
        const int i = (int)rr(0, nd - 1);
        const int64_t old = t->shape[i];
        int64_t nv = pct(60) && old < INT64_MAX - 3 && old > INT64_MIN + 3 ? old + (pct(50) ? 1 : -1) * rr(1, 3) : PICK(sp);
        if (nv == old) nv = old == 0 ? 1 : 0;
        t->shape[i] = nv;
        const int fr = s->free_rows && i == 0;
        addst(s->stage, "tensor shape", s->mm | ex, chk && !fr, "%s.shape[%d] = %lld (was %lld)", s->name, i,
              (long long)nv, (long long)old);
        return 1;
    }
    case 2: { /* dtype */
        static const kva_dtype bad[] = {KVA_DTYPE_I32, KVA_DTYPE_U8, (kva_dtype)42, (kva_dtype)-1, E4M3, E5M2};
        static const kva_dtype fl[] = {F32, F16, BF16};
        const kva_dtype old = t->dtype;
        if (pct(50)) {
            kva_dtype nv = PICK(fl);
            if (nv == old) return 0;
            const int smaller = ref_dtype_size(nv) <= ref_dtype_size(old);
            if (s->dtype_ok && !smaller) return 0; /* a larger element would run past the caller's buffer */
            t->dtype = nv;
            addst(s->stage, "tensor dtype (another float dtype)", s->mm | ex, chk && !s->dtype_ok, "%s.dtype = %s (was %s)",
                  s->name, h_dtype_str(nv), h_dtype_str(old));
        } else {
            kva_dtype nv = PICK(bad);
            if (nv == old) return 0;
            t->dtype = nv;
            addst(s->stage, "tensor dtype (not a float dtype)", s->badtype | ex, chk, "%s.dtype = %d (was %s)", s->name,
                  (int)nv, h_dtype_str(old));
        }
        return 1;
    }
    case 3: { /* rank */
        static const int32_t nds[] = {0, 1, 2, 3, 4, 5, -1, INT32_MAX};
        const int32_t nv = PICK(nds);
        if (nv == nd) return 0;
        t->ndim = nv;
        addst(s->stage, "tensor rank", s->mm | ex, chk && nv != s->ndim_alt, "%s.ndim = %d (was %d)", s->name, (int)nv, nd);
        return 1;
    }
    case 4: /* NULL data */
        if (s->null_ok) return 0;
        t->data = NULL;
        addst(s->stage, "tensor data NULL", S_INV | ex, chk, "%s.data = NULL", s->name);
        return 1;
    case 5: { /* a negative stride */
        static const int64_t ns[] = {-1, -2, -64, INT64_MIN};
        const int i = (int)rr(0, nd - 1);
        const int64_t old = t->stride[i];
        t->stride[i] = PICK(ns);
        addst(s->stage, "tensor stride negative", S_INV | ex, chk, "%s.stride[%d] = %lld (was %lld)", s->name, i,
              (long long)t->stride[i], (long long)old);
        return 1;
    }
    case 6: { /* the last stride not 1 */
        static const int64_t ls[] = {0, 2, 3, 7};
        const int64_t old = t->stride[nd - 1];
        t->stride[nd - 1] = PICK(ls);
        const int bad = t->shape[nd - 1] > 1;
        addst(s->stage, "tensor last stride", bad ? S_INV | ex : ex | dvm, chk && bad,
              "%s.stride[%d] = %lld (was %lld; extent %lld)", s->name, nd - 1, (long long)t->stride[nd - 1],
              (long long)old, (long long)t->shape[nd - 1]);
        return 1;
    }
    case 7: { /* a stride addressing beyond 2^63 bytes (smaller ones are the caller's to get right) */
        const int64_t es = ref_dtype_size(t->dtype) > 0 ? (int64_t)ref_dtype_size(t->dtype) : 1;
        const int64_t hs[] = {INT64_MAX, INT64_MAX / es, es > 1 ? INT64_MAX / es + rr(1, 1000) : INT64_MAX};
        const int i = (int)rr(0, nd - 1);
        const int64_t old = t->stride[i];
        t->stride[i] = PICK(hs);
        const int bad = t->shape[i] > 1;
        addst(s->stage, "tensor stride huge", bad ? S_INV | ex | dvm : ex | dvm, chk && bad,
              "%s.stride[%d] = %lld (was %lld; extent %lld)",
              s->name, i, (long long)t->stride[i], (long long)old, (long long)t->shape[i]);
        return 1;
    }
    case 8: { /* stride 0: a broadcast view */
        if (nd < 2) return 0;
        const int i = (int)rr(0, nd - 2);
        const int64_t old = t->stride[i];
        const int bad = s->out && t->shape[i] > 1;
        if (s->out && !bad && !s->overlap_ok) return 0;
        if (!s->out && !s->overlap_ok) return 0;
        t->stride[i] = 0;
        addst(s->stage, "tensor stride 0", bad ? S_INV | ex : ex | dvm, chk && bad,
              "%s.stride[%d] = 0 (was %lld; extent %lld)", s->name, i, (long long)old, (long long)t->shape[i]);
        return 1;
    }
    default: { /* a smaller stride: rows (or heads) overlap */
        if (nd < 2 || !s->overlap_ok) return 0;
        const int i = (int)rr(0, nd - 2);
        const int64_t old = t->stride[i];
        if (old <= 1) return 0;
        t->stride[i] = rr(1, old - 1);
        addst(s->stage, "tensor stride overlapping", ex | dvm, 0, "%s.stride[%d] = %lld (was %lld; extent %lld)", s->name,
              i, (long long)t->stride[i], (long long)old, (long long)t->shape[i]);
        return 1;
    }
    }
}

/* ---- drawing mutations ---- */

typedef struct mdef {
    const char* name;
    unsigned fams;
    unsigned group;
    unsigned conf;
    int (*fn)(void);
} mdef;

static void draw(const mdef* defs, int ndefs) {
    /* 8 % control cases, else mostly one mutation (a harmless one then reaches the reference), up to MAXMUT */
    const int64_t k = rr(0, 99);
    const int want = k < 8 ? 0 : k < 58 ? 1 : k < 83 ? 2 : MAXMUT;
    for (int tries = 0; T.nm < want && tries < 200; ++tries) {
        const mdef* d = &defs[rr(0, ndefs - 1)];
        if (!(d->fams & FB(T.fam))) continue;
        if ((d->group & (T.conf | T.groups)) || (d->conf & T.groups)) continue;
        const int before = T.nm;
        if (!d->fn() || T.nm == before) continue;
        T.groups |= d->group;
        T.conf |= d->conf;
    }
}

static float pick_nonfinite(void) {
    static const float v[] = {NAN, INFINITY, -INFINITY};
    return PICK(v);
}

/* ============================================================================================== */
/* Attention: batch decode, paged prefill, ragged prefill, single decode / prefill                 */

typedef struct att {
    int fam, paged, single;
    kva_op op;
    kva_attention_desc d;
    int32_t B, qo[MAXB], kv[MAXB];
    int32_t qo_ip[MAXB + 1], kv_ip[MAXB + 1], last[MAXB + 1];
    int32_t* hidx;  /* host copy of the page table: entries + SPARE valid entries (block-table form: B rows of bts
                       entries, each row's tail past its pages junk, then SPARE valid entries) */
    int64_t entries, nidx, rows, total_kv, mask_bytes;
    int bt;         /* the block-table form (kv_seq_lens + block_table_stride; paged families) */
    int32_t bts;    /* its row stride */
    int32_t jip[MAXB + 1], jlast[MAXB + 1]; /* kv_indptr / kv_last_page_len given with it: junk (not read) */
    int32_t ps;
    int64_t num_pages, alloc_pages;
    int lse_on, graph, custom;
    h_buf q, o, lse, kp, vp, k, v, idx_d, mask_d, sl_d;
    h_ws ws, ws2;
    int have_ws2;
    size_t need;    /* device bytes the valid plan needs */
    kva_plan_params pp;
    kva_run_args ra;
    /* the plan call as mutated */
    kva_context* pctx;
    kva_attention_desc cd;
    int desc_null, params_null, pws_null, plan_null, named;
    kva_op cop;
    kva_plan_params cp;
    int32_t cqo[MAXB + 2], ckv[MAXB + 2], clast[MAXB + 2], csl[MAXB + 2];
    int32_t* chidx;
    kva_workspace pws;
    int64_t ws_small;  /* > 0: declare the plan's need minus this (resolved before the call) */
    int ws_small_mut;  /* its mutation index */
    /* the run call as mutated */
    kva_context* rctx;
    int rplan_null, rws_null, args_null, wrapper; /* wrapper: 0 kva_run, 1 the op's named run, 2 another op's */
    int plan_zero, plan_garbage, flip_n, flip_words, stale, rws_short;
    int flip_w[8], flip_b[8];
    kva_workspace rws;
    kva_run_args ca;
} att;

static att A;

static void att_free(void) {
    free(A.hidx);
    free(A.chidx);
    h_ws_free(&A.ws);
    if (A.have_ws2) h_ws_free(&A.ws2);
}

static kva_dtype pick_q_dt(void) {
    if (g_dev) return pct(50) ? F16 : BF16;
    const int k = (int)rr(0, 2);
    return k == 0 ? F32 : k == 1 ? F16 : BF16;
}
static kva_dtype pick_o_dt(void) {
    const int k = (int)rr(0, 2);
    return k == 0 ? F32 : k == 1 ? F16 : BF16;
}
static kva_dtype pick_kv_dt(void) {
    const int k = (int)rr(0, 11);
    if (k == 10) return E4M3;
    if (k == 11) return E5M2;
    if (g_dev) return k < 5 ? F16 : BF16;
    return k < 3 ? F32 : k < 7 ? F16 : BF16;
}

/* an entry of a block-table row past the request's pages: anything (a caller's -1, a null block, a stale page) */
static int32_t bt_junk(int64_t num_pages) {
    const int k = (int)rr(0, 99);
    if (k < 35) return -1;
    if (k < 55) return (int32_t)(num_pages + rr(0, XPAGES - 1)); /* (a NaN page past the pool) */
    if (k < 65) return INT32_MIN;
    if (k < 75) return INT32_MAX;
    return (int32_t)rr(0, num_pages - 1);
}

static kva_tensor t3(void* data, kva_dtype dt, int64_t a, int64_t b, int64_t c, int64_t s0, int64_t s1) {
    kva_tensor t = kva_tensor_make(data, dt, 3, a, b, c, 0);
    t.stride[0] = s0;
    t.stride[1] = s1;
    return t;
}

static void att_build(int fam) {
    att* a = &A;
    memset(a, 0, sizeof *a);
    a->fam = fam;
    a->paged = fam == F_DEC || fam == F_PRE;
    a->single = fam == F_SDEC || fam == F_SPRE;
    a->op = fam == F_DEC ? KVA_OP_BATCH_DECODE : fam == F_PRE ? KVA_OP_BATCH_PREFILL_PAGED : KVA_OP_BATCH_PREFILL_RAGGED;
    const int decode = fam == F_DEC || fam == F_SDEC;
    static const int32_t cpu_dims[] = {1, 2, 3, 4, 7, 8, 16, 24, 32, 64, 96, 128};
    static const int32_t dev_dims[] = {64, 128};
    const int32_t hkv = (int32_t)rr(1, 4), g = (int32_t)rr(1, 8), hq = hkv * g;
    int32_t dqk = g_dev ? PICK(dev_dims) : PICK(cpu_dims);
    int32_t dvo = g_dev || pct(70) ? dqk : PICK(cpu_dims);
    kva_attention_desc* d = &a->d;
    kva_attention_desc_init(d, hq, hkv, dqk, pick_q_dt());
    d->head_dim_vo = dvo;
    d->kv_dtype = pick_kv_dt();
    d->o_dtype = pick_o_dt();
    if (decode) {
        d->mask_mode = pct(20) ? KVA_MASK_CAUSAL : KVA_MASK_NONE;
    } else {
        const int k = (int)rr(0, 99);
        d->mask_mode = k < 50 ? KVA_MASK_NONE : k < 85 || a->single ? KVA_MASK_CAUSAL : KVA_MASK_CUSTOM;
    }
    a->custom = d->mask_mode == KVA_MASK_CUSTOM;
    if (pct(25)) d->window_left = (int32_t)rr(0, 10);
    if (pct(15)) d->logits_soft_cap = (float)(1.0 + 29.0 * unif());
    if (pct(25)) d->sm_scale = (float)(0.05 + 0.4 * unif());
    {
        const int k = (int)rr(0, 99);
        if (k < 15) d->pos_encoding = KVA_POS_ALIBI;
        else if (k < 30 && dqk % 2 == 0) d->pos_encoding = KVA_POS_ROPE_LLAMA;
        if (pct(30)) {
            d->rope_scale = (float)(0.5 + 3.5 * unif());
            d->rope_theta = (float)(100.0 + 1e5 * unif());
        }
    }
    if (pct(8)) {
        d->score_mode = KVA_SCORE_SIGMOID;
        d->sigmoid_bias = (float)(-2.0 + 4.0 * unif());
    }
    a->lse_on = d->score_mode == KVA_SCORE_SOFTMAX && pct(75);

    /* lengths and page table */
    a->B = a->single ? 1 : pct(5) ? 0 : (int32_t)rr(1, MAXB);
    a->ps = (int32_t)rr(1, 17);
    const kva_layout layout = pct(50) ? KVA_LAYOUT_NHD : KVA_LAYOUT_HND;
    const int no_kv = pct(6); /* every request without KV: the pools / k / v are then not needed */
    for (int32_t b = 0; b < a->B; ++b) {
        const int32_t kv = no_kv || pct(20) ? 0 : (int32_t)rr(1, 40);
        int32_t qo = 1;
        if (!decode) {
            const int32_t hi = kv < 5 ? (kv > 0 ? kv : 1) : 5;
            qo = pct(15) ? 0 : (int32_t)rr(1, hi);
            if (pct(15)) qo = kv + (int32_t)rr(1, 3);
            if (fam == F_SPRE) qo = (int32_t)rr(0, 6);
        }
        a->qo[b] = qo;
        a->kv[b] = kv;
        a->qo_ip[b + 1] = a->qo_ip[b] + qo;
        if (a->paged) {
            const int32_t np = (kv + a->ps - 1) / a->ps;
            a->kv_ip[b + 1] = a->kv_ip[b] + np;
            a->last[b] = np ? kv - (np - 1) * a->ps : 0;
        } else {
            a->kv_ip[b + 1] = a->kv_ip[b] + kv;
        }
        a->rows += qo;
        a->total_kv += kv;
        if (a->custom) a->mask_bytes += ((int64_t)qo * kv + 7) / 8;
    }
    const int32_t B = a->B;
    const kva_dtype kvt = d->kv_dtype;
    if (a->paged) {
        const int64_t used = a->kv_ip[B]; /* pages of the requests */
        a->bt = pct(30);
        if (a->bt) { /* rows of bts entries: a request's pages first, then junk (never read) */
            int32_t mx = 0;
            for (int32_t b = 0; b < B; ++b) mx = a->kv_ip[b + 1] - a->kv_ip[b] > mx ? a->kv_ip[b + 1] - a->kv_ip[b] : mx;
            a->bts = mx + (int32_t)rr(mx ? 0 : 1, 3);
            for (int32_t b = 0; b < B; ++b)
                if (a->kv_ip[b + 1] > a->kv_ip[b]) a->entries = (int64_t)b * a->bts + a->kv_ip[b + 1] - a->kv_ip[b];
            a->nidx = (int64_t)B * a->bts + SPARE;
            a->jip[0] = (int32_t)rr(1, 9); /* (nonzero: read as CSR, the plan would refuse it) */
            for (int32_t b = 0; b < B; ++b) {
                a->jip[b + 1] = (int32_t)rr(-5, 50);
                a->jlast[b] = (int32_t)rr(-2, 40);
            }
        } else {
            a->entries = used;
            a->nidx = a->entries + SPARE;
        }
        a->num_pages = used + rr(1, 6);
        a->alloc_pages = a->num_pages + XPAGES;
        int32_t* perm = (int32_t*)xcalloc((size_t)a->num_pages, sizeof(int32_t));
        for (int64_t p = 0; p < a->num_pages; ++p) perm[p] = (int32_t)p;
        h_rng_shuffle_i32(&T.r, perm, a->num_pages);
        a->hidx = (int32_t*)xcalloc((size_t)a->nidx, sizeof(int32_t));
        if (a->bt) {
            int64_t k = 0;
            for (int32_t b = 0; b < B; ++b)
                for (int32_t j = 0; j < a->bts; ++j)
                    a->hidx[(int64_t)b * a->bts + j] = j < a->kv_ip[b + 1] - a->kv_ip[b] ? perm[k++] : bt_junk(a->num_pages);
            for (int64_t i = (int64_t)B * a->bts; i < a->nidx; ++i) a->hidx[i] = (int32_t)rr(0, a->num_pages - 1);
        } else {
            for (int64_t i = 0; i < a->nidx; ++i) a->hidx[i] = i < a->num_pages ? perm[i] : (int32_t)rr(0, a->num_pages - 1);
        }
        free(perm);
        /* pools: strides of the layout, optionally padded (16 bytes on a device backend) */
        kva_paged_kv pk;
        kva_paged_kv_init(&pk, NULL, NULL, kvt, layout, a->num_pages, a->ps, hkv, dqk, dvo);
        if (pct(30)) {
            const int64_t p1 = h_round_pad(rr(1, 5), kvt), p2 = h_round_pad(rr(1, 5), kvt), p3 = h_round_pad(rr(1, 5), kvt);
            if (layout == KVA_LAYOUT_NHD) {
                pk.k_stride_head = dqk + p1;
                pk.v_stride_head = dvo + p1;
                pk.k_stride_token = hkv * pk.k_stride_head + p2;
                pk.v_stride_token = hkv * pk.v_stride_head + p2;
                pk.k_stride_page = a->ps * pk.k_stride_token + p3;
                pk.v_stride_page = a->ps * pk.v_stride_token + p3;
            } else {
                pk.k_stride_token = dqk + p1;
                pk.v_stride_token = dvo + p1;
                pk.k_stride_head = a->ps * pk.k_stride_token + p2;
                pk.v_stride_head = a->ps * pk.v_stride_token + p2;
                pk.k_stride_page = hkv * pk.k_stride_head + p3;
                pk.v_stride_page = hkv * pk.v_stride_head + p3;
            }
        }
        a->kp = h_buf_alloc(kvt, (size_t)(a->alloc_pages * pk.k_stride_page));
        a->vp = h_buf_alloc(kvt, (size_t)(a->alloc_pages * pk.v_stride_page));
        /* pages of the pool: finite values everywhere (padding too: a harmless overlapping stride reads them);
           the pages past num_pages: NaN */
        for (size_t i = 0; i < a->kp.elems; ++i)
            if ((int64_t)i < a->num_pages * pk.k_stride_page) h_buf_set(&a->kp, i, h_rng_normalish(&T.r));
            else ref_store_nan(kvt, h_buf_hp(&a->kp), i);
        for (size_t i = 0; i < a->vp.elems; ++i)
            if ((int64_t)i < a->num_pages * pk.v_stride_page) h_buf_set(&a->vp, i, h_rng_normalish(&T.r));
            else ref_store_nan(kvt, h_buf_hp(&a->vp), i);
        h_buf_upload(&a->kp);
        h_buf_upload(&a->vp);
        a->idx_d = h_buf_alloc(KVA_DTYPE_I32, (size_t)a->nidx);
        memcpy(h_buf_hp(&a->idx_d), a->hidx, sizeof(int32_t) * (size_t)a->nidx);
        h_buf_upload(&a->idx_d);
        pk.k_data = h_buf_dp(&a->kp);
        pk.v_data = h_buf_dp(&a->vp);
        pk.indices = (const int32_t*)h_buf_dp(&a->idx_d);
        pk.num_indices = pct(50) ? a->nidx : 0;
        a->ra.paged = pk;
    } else {
        const int64_t ph = pct(30) ? h_round_pad(rr(1, 4), kvt) : 0, pr = pct(30) ? h_round_pad(rr(1, 4), kvt) : 0;
        const int64_t ks1 = dqk + ph, vs1 = dvo + ph, ks0 = hkv * ks1 + pr, vs0 = hkv * vs1 + pr;
        a->k = h_buf_alloc(kvt, (size_t)(a->total_kv * ks0));
        a->v = h_buf_alloc(kvt, (size_t)(a->total_kv * vs0));
        fill_rand(&a->k);
        fill_rand(&a->v);
        h_buf_upload(&a->k);
        h_buf_upload(&a->v);
        a->ra.k = t3(h_buf_dp(&a->k), kvt, a->total_kv, hkv, dqk, ks0, ks1);
        a->ra.v = t3(h_buf_dp(&a->v), kvt, a->total_kv, hkv, dvo, vs0, vs1);
    }
    /* q, o, lse */
    const int64_t qs0 = (int64_t)hq * dqk + (pct(30) ? h_round_pad(rr(1, 5), d->q_dtype) : 0);
    const int64_t os0 = (int64_t)hq * dvo + (pct(30) ? h_round_pad(rr(1, 5), d->o_dtype) : 0);
    const int64_t ls0 = hq + (!g_dev && pct(30) ? rr(1, 3) : 0);
    a->q = h_buf_alloc(d->q_dtype, (size_t)(a->rows * qs0));
    fill_rand(&a->q);
    h_buf_upload(&a->q);
    a->o = h_buf_alloc(d->o_dtype, (size_t)(a->rows * os0));
    h_buf_poison(&a->o);
    h_buf_upload(&a->o);
    a->lse = h_buf_alloc(F32, (size_t)(a->rows * ls0));
    h_buf_poison(&a->lse);
    h_buf_upload(&a->lse);
    kva_run_args* ra = &a->ra;
    kva_paged_kv keep = ra->paged;
    kva_tensor kk = ra->k, vv = ra->v;
    kva_run_args_init(ra);
    ra->paged = keep;
    ra->k = kk;
    ra->v = vv;
    ra->q = t3(h_buf_dp(&a->q), d->q_dtype, a->rows, hq, dqk, qs0, dqk);
    ra->o = t3(h_buf_dp(&a->o), d->o_dtype, a->rows, hq, dvo, os0, dvo);
    ra->lse = kva_tensor_make(a->lse_on ? h_buf_dp(&a->lse) : NULL, F32, 2, a->rows, hq, 0, 0);
    ra->lse.stride[0] = ls0;
    if (fam == F_SDEC && pct(30)) { /* decode's [heads, dim] views */
        ra->q = kva_tensor_make(ra->q.data, d->q_dtype, 2, hq, dqk, 0, 0);
        ra->o = kva_tensor_make(ra->o.data, d->o_dtype, 2, hq, dvo, 0, 0);
        ra->lse = kva_tensor_make(ra->lse.data, F32, 1, hq, 0, 0, 0);
    }
    if (a->custom) {
        a->mask_d = h_buf_alloc(KVA_DTYPE_U8, (size_t)a->mask_bytes + 8);
        for (size_t i = 0; i < a->mask_d.elems; ++i) ((uint8_t*)h_buf_hp(&a->mask_d))[i] = (uint8_t)h_rng_u64(&T.r);
        h_buf_upload(&a->mask_d);
        ra->custom_mask = (const uint8_t*)h_buf_dp(&a->mask_d);
        ra->custom_mask_bytes = a->mask_bytes + (pct(50) ? rr(0, 8) : 0);
    }
    if (d->pos_encoding == KVA_POS_ALIBI && pct(50)) {
        a->sl_d = h_buf_alloc(F32, (size_t)hq);
        for (int32_t h = 0; h < hq; ++h) h_buf_set(&a->sl_d, (size_t)h, 0.01 + 0.99 * unif());
        h_buf_upload(&a->sl_d);
        ra->alibi_slopes = (const float*)h_buf_dp(&a->sl_d);
    }
    if (pct(20)) {
        ra->k_scale = (float)(0.25 + 1.75 * unif());
        ra->v_scale = (float)(0.25 + 1.75 * unif());
    }
    if (pct(10)) ra->enable_pdl = 1;

    /* plan params and workspace */
    kva_plan_params* pp = &a->pp;
    kva_plan_params_init(pp);
    pp->batch_size = B;
    pp->qo_indptr = fam == F_DEC && pct(70) ? NULL : a->qo_ip;
    pp->kv_indptr = a->kv_ip;
    if (a->paged) {
        pp->kv_last_page_len = a->last;
        if (a->bt) {
            pp->kv_seq_lens = a->kv;
            pp->block_table_stride = a->bts;
            pp->kv_indptr = pct(50) ? a->jip : NULL;
            pp->kv_last_page_len = pct(50) ? a->jlast : NULL;
        }
        pp->page_size = a->ps;
        pp->kv_indices = pct(50) ? a->hidx : NULL;
        pp->num_pages = pp->kv_indices || pct(50) ? a->num_pages : 0;
    }
    if (pct(15)) pp->fixed_split_size = (int32_t)rr(1, 16);
    if (pct(10)) pp->disable_split_kv = 1;
    if (!a->single && pct(10) && !pp->fixed_split_size) {
        a->graph = 1;
        pp->graph_mode = 1;
        pp->max_batch_size = B + (int32_t)rr(B ? 0 : 1, 2);
        pp->max_total_qo_rows = fam == F_DEC && pct(50) ? 0 : a->rows + rr(0, 3);
    }
    size_t db = 0, hb = 0;
    kva_status st;
    if (a->single) st = kva_single_workspace_size(g_ctx, d, a->rows, a->total_kv, &db, &hb);
    else if (a->graph)
        st = kva_workspace_bound(g_ctx, d, a->op, pp->max_batch_size,
                                 pp->max_total_qo_rows ? pp->max_total_qo_rows : pp->max_batch_size, &db, &hb);
    else st = kva_plan_workspace_size(g_ctx, d, a->op, pp, &db, &hb);
    if (st != KVA_OK) cfail("fixture: workspace size: %s: %s", kva_status_string(st), kva_last_error_message());
    a->need = db;
    h_ws_alloc(&a->ws, db + 512, hb ? hb + 256 : 0);
    a->ws.ws.device_bytes = db + 256;

    snprintf(T.fix, sizeof T.fix,
             "B=%d qo=[%d %d %d %d %d] kv=[%d %d %d %d %d] hq=%d hkv=%d dqk=%d dvo=%d q=%s kv=%s o=%s ps=%d %s "
             "pages=%lld mask=%d win=%d cap=%g scale=%g pos=%d score=%d lse=%d hidx=%d np=%lld nidx=%lld fsplit=%d "
             "nosplit=%d graph=%d ks=%g vs=%g qs0=%lld os0=%lld slopes=%d bt=%d stride=%d",
             B, a->qo[0], a->qo[1], a->qo[2], a->qo[3], a->qo[4], a->kv[0], a->kv[1], a->kv[2], a->kv[3], a->kv[4], hq,
             hkv, dqk, dvo, h_dtype_str(d->q_dtype), h_dtype_str(kvt), h_dtype_str(d->o_dtype), a->ps,
             layout == KVA_LAYOUT_NHD ? "NHD" : "HND", (long long)a->num_pages, (int)d->mask_mode, d->window_left,
             (double)d->logits_soft_cap, (double)d->sm_scale, (int)d->pos_encoding, (int)d->score_mode, a->lse_on,
             pp->kv_indices != NULL, (long long)pp->num_pages, (long long)ra->paged.num_indices, pp->fixed_split_size,
             pp->disable_split_kv, a->graph, (double)ra->k_scale, (double)ra->v_scale, (long long)qs0, (long long)os0,
             ra->alibi_slopes != NULL, a->bt, a->bts);

    reg(&a->q, "q");
    reg(&a->o, "o");
    reg(&a->lse, "lse");
    reg(&a->ws.dev, "workspace");
    if (a->paged) {
        reg(&a->kp, "K pool");
        reg(&a->vp, "V pool");
        reg(&a->idx_d, "page table");
    } else {
        reg(&a->k, "k");
        reg(&a->v, "v");
    }
    if (a->custom) reg(&a->mask_d, "custom mask");
    if (a->sl_d.host) reg(&a->sl_d, "ALiBi slopes");

    /* the calls, before mutations */
    a->pctx = a->rctx = g_ctx;
    a->cd = a->d;
    a->cop = a->op;
    a->named = pct(30);
    a->cp = a->pp;
    memcpy(a->cqo, a->qo_ip, sizeof a->qo_ip);
    memcpy(a->ckv, a->bt ? a->jip : a->kv_ip, sizeof a->kv_ip);
    memcpy(a->clast, a->bt ? a->jlast : a->last, sizeof a->last);
    memcpy(a->csl, a->kv, sizeof a->kv);
    if (a->pp.qo_indptr) a->cp.qo_indptr = a->cqo;
    if (a->pp.kv_indptr) a->cp.kv_indptr = a->ckv;
    if (a->paged) {
        if (a->pp.kv_last_page_len) a->cp.kv_last_page_len = a->clast;
        if (a->bt) a->cp.kv_seq_lens = a->csl;
        a->chidx = (int32_t*)xcalloc((size_t)a->nidx, sizeof(int32_t));
        memcpy(a->chidx, a->hidx, sizeof(int32_t) * (size_t)a->nidx);
        if (a->pp.kv_indices) a->cp.kv_indices = a->chidx;
    }
    a->pws = a->ws.ws;
    a->rws = a->ws.ws;
    a->ca = a->ra;
    a->ws_small_mut = -1;
    if (a->single && !g_dev && pct(20)) a->pws_null = 1; /* the CPU backend allocates scratch for a NULL workspace */
}


/* ---- attention mutations ---- */

enum {
    G_DESC = 1 << 0,  /* a descriptor the plan refuses */
    G_DESCV = 1 << 1, /* a descriptor the plan takes (a valid change, or one the run then disagrees with) */
    G_CALLP = 1 << 2, /* the plan call itself (NULLs, op) / the single call */
    G_QO = 1 << 3,    /* batch size, qo_indptr */
    G_KV = 1 << 4,    /* kv_indptr, last_page_len, page_size, num_pages, host page table */
    G_SPLIT = 1 << 5,
    G_GRAPH = 1 << 6,
    G_WS = 1 << 7,    /* the plan's workspace */
    G_CALLR = 1 << 8, /* the run call itself */
    G_PLAN = 1 << 9,  /* the plan struct between plan and run */
    G_RWS = 1 << 10,  /* the run's workspace */
    G_Q = 1 << 11,
    G_O = 1 << 12,
    G_LSE = 1 << 13,
    G_KVT = 1 << 14,  /* ragged / single k, v */
    G_PAGED = 1 << 15,
    G_DEV = 1 << 16,  /* the run's page table in backend memory */
    G_MASK = 1 << 17,
    G_SCALE = 1 << 18
};
#define G_ARGS (G_Q | G_O | G_LSE | G_KVT | G_PAGED | G_DEV | G_MASK | G_SCALE)

static int ast(void) { return A.single ? 0 : 1; } /* the stage run-time arguments are checked at */

static int am_desc_bad(void) {
    kva_attention_desc* d = &A.cd;
    switch (rr(0, 14)) {
    case 0: {
        static const int32_t v[] = {0, -1, INT32_MIN};
        d->num_qo_heads = PICK(v);
        addst(0, "desc num_qo_heads", S_INV, 1, "num_qo_heads = %d", d->num_qo_heads);
        return 1;
    }
    case 1: {
        static const int32_t v[] = {0, -3, INT32_MIN};
        d->num_kv_heads = PICK(v);
        addst(0, "desc num_kv_heads", S_INV, 1, "num_kv_heads = %d", d->num_kv_heads);
        return 1;
    }
    case 2: {
        const int32_t hkv = (int32_t)rr(2, 5);
        d->num_kv_heads = hkv;
        d->num_qo_heads = hkv * (int32_t)rr(1, 4) + (int32_t)rr(1, hkv - 1);
        addst(0, "desc heads not divisible", S_INV, 1, "num_qo_heads = %d over num_kv_heads = %d", d->num_qo_heads, hkv);
        return 1;
    }
    case 3: {
        static const int32_t v[] = {129, 1000, 1 << 30, INT32_MAX};
        d->num_kv_heads = 1;
        d->num_qo_heads = PICK(v);
        addst(0, "desc group size", S_UNS, 1, "num_qo_heads = %d over 1 KV head", d->num_qo_heads);
        return 1;
    }
    case 4: {
        static const int32_t v[] = {0, -1, INT32_MIN};
        if (pct(50)) d->head_dim_qk = PICK(v);
        else d->head_dim_vo = PICK(v);
        addst(0, "desc head dim", S_INV, 1, "head_dim_qk = %d, head_dim_vo = %d", d->head_dim_qk, d->head_dim_vo);
        return 1;
    }
    case 5: {
        static const int32_t v[] = {513, 1024, 1 << 30, INT32_MAX};
        if (pct(50)) d->head_dim_qk = PICK(v);
        else d->head_dim_vo = PICK(v);
        addst(0, "desc head dim unsupported", S_UNS, 1, "head_dim_qk = %d, head_dim_vo = %d", d->head_dim_qk,
              d->head_dim_vo);
        return 1;
    }
    case 6: {
        static const kva_dtype v[] = {E4M3, E5M2, KVA_DTYPE_I32, KVA_DTYPE_U8, (kva_dtype)42, (kva_dtype)-1};
        if (pct(50)) d->q_dtype = PICK(v);
        else d->o_dtype = PICK(v);
        addst(0, "desc q/o dtype", S_UNS, 1, "q_dtype = %d, o_dtype = %d", (int)d->q_dtype, (int)d->o_dtype);
        return 1;
    }
    case 7: {
        static const kva_dtype v[] = {KVA_DTYPE_I32, KVA_DTYPE_U8, (kva_dtype)7, (kva_dtype)-1};
        d->kv_dtype = PICK(v);
        addst(0, "desc kv dtype", S_UNS, 1, "kv_dtype = %d", (int)d->kv_dtype);
        return 1;
    }
    case 8:
        if (A.fam == F_DEC && pct(50)) {
            d->mask_mode = KVA_MASK_CUSTOM;
            addst(0, "desc custom mask for decode", S_UNS, 1, "batch decode with mask_mode CUSTOM");
        } else {
            static const int v[] = {3, -1, 1000};
            d->mask_mode = (kva_mask_mode)PICK(v);
            addst(0, "desc mask_mode", S_INV, 1, "mask_mode = %d", (int)d->mask_mode);
        }
        return 1;
    case 9: {
        static const int32_t v[] = {-2, -100, INT32_MIN};
        d->window_left = PICK(v);
        addst(0, "desc window_left", S_INV, 1, "window_left = %d", d->window_left);
        return 1;
    }
    case 10: {
        static const float v[] = {-1.0f, -1e-3f, NAN, INFINITY, -INFINITY};
        d->logits_soft_cap = PICK(v);
        addst(0, "desc logits_soft_cap", S_INV, 1, "logits_soft_cap = %g", (double)d->logits_soft_cap);
        return 1;
    }
    case 11:
        d->sm_scale = pick_nonfinite();
        addst(0, "desc sm_scale", S_INV, 1, "sm_scale = %g", (double)d->sm_scale);
        return 1;
    case 12:
        if (pct(40)) {
            static const int v[] = {3, -1};
            d->pos_encoding = (kva_pos_encoding)PICK(v);
            addst(0, "desc pos_encoding", S_INV, 1, "pos_encoding = %d", (int)d->pos_encoding);
        } else if (d->head_dim_qk % 2 != 0) {
            d->pos_encoding = KVA_POS_ROPE_LLAMA;
            addst(0, "desc RoPE with an odd head_dim_qk", S_UNS, 1, "RoPE, head_dim_qk = %d", d->head_dim_qk);
        } else {
            static const float v[] = {NAN, -1.0f, INFINITY, -INFINITY, -0.5f};
            d->pos_encoding = KVA_POS_ROPE_LLAMA;
            if (pct(50)) d->rope_theta = PICK(v);
            else d->rope_scale = PICK(v);
            addst(0, "desc RoPE theta / scale", S_INV, 1, "RoPE, rope_theta = %g, rope_scale = %g", (double)d->rope_theta,
                  (double)d->rope_scale);
        }
        return 1;
    case 13:
        if (pct(50)) {
            static const int v[] = {2, -1};
            d->score_mode = (kva_score_mode)PICK(v);
            addst(0, "desc score_mode", S_INV, 1, "score_mode = %d", (int)d->score_mode);
        } else {
            d->sigmoid_bias = pick_nonfinite();
            addst(0, "desc sigmoid_bias", S_INV, 1, "sigmoid_bias = %g (score_mode %d)", (double)d->sigmoid_bias,
                  (int)d->score_mode);
        }
        return 1;
    default: {
        static char fake[64];
        d->variant = (const kva_variant*)(void*)fake;
        addst(0, "desc variant not live", S_INV | (d->pos_encoding == KVA_POS_ROPE_LLAMA ? S_UNS : 0), 1,
              "variant = %p (no variant)", (void*)fake);
        return 1;
    }
    }
}

static int am_desc_null(void) {
    A.desc_null = 1;
    addst(0, "desc NULL", S_INV, 1, "desc = NULL");
    return 1;
}

/* a valid descriptor change: the plan takes it; the run computes it (the reference follows it) */
static int am_desc_valid(void) {
    kva_attention_desc* d = &A.cd;
    switch (rr(0, 6)) {
    case 0:
        d->window_left = d->window_left < 0 ? (int32_t)rr(0, 10) : -1;
        add("desc window (valid)", S_OK | S_WSS, S_OK, 0, "window_left = %d", d->window_left);
        return 1;
    case 1:
        d->logits_soft_cap = d->logits_soft_cap > 0 ? 0.0f : (float)(1.0 + 29.0 * unif());
        add("desc soft cap (valid)", S_OK | S_WSS, S_OK, 0, "logits_soft_cap = %g", (double)d->logits_soft_cap);
        return 1;
    case 2:
        d->sm_scale = pct(30) ? 0.0f : (float)(0.05 + 0.4 * unif());
        add("desc sm_scale (valid)", S_OK | S_WSS, S_OK, 0, "sm_scale = %g", (double)d->sm_scale);
        return 1;
    case 3:
        if (d->mask_mode == KVA_MASK_CUSTOM) return 0;
        d->mask_mode = d->mask_mode == KVA_MASK_NONE ? KVA_MASK_CAUSAL : KVA_MASK_NONE;
        add("desc causal (valid)", S_OK | S_WSS, S_OK, 0, "mask_mode = %d", (int)d->mask_mode);
        return 1;
    case 4: {
        const int k = (int)rr(0, 2);
        if (k == 2 && d->head_dim_qk % 2) return 0;
        d->pos_encoding = k == 0 ? KVA_POS_NONE : k == 1 ? KVA_POS_ALIBI : KVA_POS_ROPE_LLAMA;
        add("desc pos_encoding (valid)", S_OK | S_WSS, S_OK, 0, "pos_encoding = %d", (int)d->pos_encoding);
        return 1;
    }
    case 5:
        d->rope_scale = pct(20) ? 0.0f : (float)(0.5 + 3.5 * unif());
        d->rope_theta = pct(20) ? 0.0f : (float)(100.0 + 1e5 * unif());
        add("desc RoPE parameters (valid)", S_OK | S_WSS, S_OK, 0, "rope_scale = %g, rope_theta = %g", (double)d->rope_scale,
            (double)d->rope_theta);
        return 1;
    default:
        if (d->score_mode == KVA_SCORE_SOFTMAX) {
            d->score_mode = KVA_SCORE_SIGMOID;
            d->sigmoid_bias = (float)(-2.0 + 4.0 * unif());
            /* lse is not defined in sigmoid mode: refused where it is given and checked */
            const int bad = A.lse_on && A.rows > 0;
            add("desc sigmoid (valid)", S_OK | S_WSS, S_INV | (bad ? 0 : S_OK), bad ? 2 : 0, "score_mode SIGMOID, bias %g%s",
                (double)d->sigmoid_bias, bad ? " (lse given)" : "");
        } else {
            d->score_mode = KVA_SCORE_SOFTMAX;
            add("desc softmax (valid)", S_OK | S_WSS, S_OK, 0, "score_mode SOFTMAX");
        }
        return 1;
    }
}

/* the plan takes another valid dtype; the run's tensors disagree with it */
static int am_desc_dtype(void) {
    kva_attention_desc* d = &A.cd;
    static const kva_dtype fl[] = {F32, F16, BF16};
    const int which = (int)rr(0, 2);
    kva_dtype* t = which == 0 ? &d->q_dtype : which == 1 ? &d->kv_dtype : &d->o_dtype;
    const kva_dtype old = *t, nv = PICK(fl);
    if (nv == old) return 0;
    *t = nv;
    /* checked: q and o with rows; KV of a paged op always, ragged K/V with tokens; single ops: k/v with tokens */
    const int chk = which == 1 ? (A.paged || A.total_kv > 0) : A.rows > 0;
    const unsigned dev = g_dev && nv == F32 && which != 2 ? S_UNS : 0; /* f32 q / KV: a CPU-only dtype */
    add("desc dtype (valid, the run disagrees)", S_OK | S_WSS | dev, S_PMM | (chk ? 0 : S_OK), chk ? 2 : 0,
        "%s dtype %s (run tensors %s)", which == 0 ? "q" : which == 1 ? "kv" : "o", h_dtype_str(nv), h_dtype_str(old));
    return 1;
}

/* heads the run's tensors cannot have: refused by the plan's limits, its workspace, or the run */
static int am_desc_heads_huge(void) {
    static const int32_t v[] = {1 << 20, 1 << 29, 1 << 30, INT32_MAX};
    kva_attention_desc* d = &A.cd;
    d->num_qo_heads = d->num_kv_heads = PICK(v);
    const int chk = A.paged || A.rows > 0 || A.total_kv > 0;
    add("desc heads huge", S_OK | S_UNS | S_WSS | S_OOM, S_PMM | (chk ? 0 : S_OK), chk ? 2 : 0,
        "num_qo_heads = num_kv_heads = %d", d->num_qo_heads);
    return 1;
}

static int am_pcall(void) {
    switch (rr(0, 5)) {
    case 0:
        A.pctx = NULL;
        addst(0, "plan context NULL", S_INV, 1, "context = NULL");
        return 1;
    case 1:
        A.params_null = 1;
        addst(0, "plan params NULL", S_INV, 1, "params = NULL");
        return 1;
    case 2:
        A.pws_null = 1;
        addst(0, "plan workspace NULL", S_INV, 1, "workspace = NULL");
        return 1;
    case 3:
        A.plan_null = 1;
        addst(0, "plan struct NULL", S_INV, 1, "plan = NULL");
        return 1;
    case 4: {
        static const int v[] = {3, -1, 99, INT32_MIN};
        A.cop = (kva_op)PICK(v);
        A.named = 0;
        addst(0, "plan op", S_INV, 1, "op = %d", (int)A.cop);
        return 1;
    }
    default:
        /* another op: its params do not fit (decode rows, a missing qo_indptr or last_page_len) */
        if (A.fam == F_DEC && A.B > 0) {
            if (A.cp.qo_indptr) return 0;
            A.named = 0;
            A.cop = KVA_OP_BATCH_PREFILL_PAGED;
            addst(0, "plan as paged prefill", S_INV, 1, "a decode batch planned as paged prefill (no qo_indptr)");
            return 1;
        }
        if ((A.fam == F_PRE || A.fam == F_RAG) && A.B > 0) {
            int notone = 0;
            for (int32_t b = 0; b < A.B; ++b) notone |= A.qo[b] != 1;
            if (!notone) return 0;
            A.named = 0;
            A.cop = KVA_OP_BATCH_DECODE;
            addst(0, "plan as decode", S_INV | (A.custom ? S_UNS : 0), 1,
                  "a prefill batch with qo lengths other than 1 planned as decode");
            return 1;
        }
        if (A.fam == F_RAG && A.B > 0) {
            A.named = 0;
            A.cop = KVA_OP_BATCH_PREFILL_PAGED;
            addst(0, "plan ragged as paged", S_INV, 1, "a ragged batch planned as paged (page_size 0)");
            return 1;
        }
        return 0;
    }
}

static int am_batch(void) {
    if (pct(40) || A.B == 0) {
        static const int32_t v[] = {-1, -7, INT32_MIN};
        A.cp.batch_size = PICK(v);
        addst(0, "batch_size negative", S_INV, 1, "batch_size = %d", A.cp.batch_size);
        return 1;
    }
    const int32_t nb = (int32_t)rr(0, A.B - 1);
    A.cp.batch_size = nb;
    const int64_t rows = A.qo_ip[nb], tk = A.fam == F_RAG ? A.kv_ip[nb] : 0;
    const int bad = (rows > 0 && rows != A.rows) || (A.fam == F_RAG && tk > 0 && tk != A.total_kv);
    add("batch_size smaller", S_OK | S_WSS, S_PMM | (bad ? 0 : S_OK), bad ? 2 : 0, "batch_size = %d (was %d: %lld rows)",
        nb, A.B, (long long)rows);
    return 1;
}

static int am_qo(void) {
    int32_t* q = A.cqo;
    if (A.fam == F_DEC) {
        if (A.B == 0) return 0;
        for (int32_t b = 0; b <= A.B; ++b) q[b] = b;
        A.cp.qo_indptr = q;
        if (pct(30)) {
            add("decode qo_indptr 0..B (valid)", S_OK, S_OK, 0, "qo_indptr = 0..%d given", A.B);
        } else {
            const int32_t j = (int32_t)rr(0, A.B);
            q[j] += (int32_t)(pct(50) ? rr(1, 2) : -rr(1, 2));
            addst(0, "decode qo_indptr not 0..B", S_INV, 1, "qo_indptr[%d] = %d", j, q[j]);
        }
        return 1;
    }
    switch (rr(0, 3)) {
    case 0:
        A.cp.qo_indptr = NULL;
        addst(0, "qo_indptr NULL", S_INV, 1, "qo_indptr = NULL");
        return 1;
    case 1: {
        static const int32_t v[] = {1, -1, 7, INT32_MIN};
        q[0] = PICK(v);
        addst(0, "qo_indptr[0] != 0", S_MAL, 1, "qo_indptr[0] = %d", q[0]);
        return 1;
    }
    case 2: {
        if (A.B == 0) return 0;
        const int32_t j = (int32_t)rr(1, A.B);
        q[j] = pct(80) ? q[j - 1] - (int32_t)rr(1, 3) : INT32_MIN;
        addst(0, "qo_indptr decreasing", S_MAL, 1, "qo_indptr[%d] = %d < qo_indptr[%d] = %d", j, q[j], j - 1, q[j - 1]);
        return 1;
    }
    default: {
        if (A.B == 0) return 0;
        const int32_t old = q[A.B];
        if (pct(25)) {
            static const int32_t v[] = {1 << 30, INT32_MAX};
            q[A.B] = PICK(v);
            addst(0, "qo_indptr[B] huge", S_UNS, 1, "qo_indptr[%d] = %d", A.B, q[A.B]);
            return 1;
        }
        q[A.B] = q[A.B - 1] + (int32_t)rr(0, 8);
        if (q[A.B] == old) q[A.B] = old + 1;
        const int bad = q[A.B] > 0;
        add("qo_indptr[B] changed", S_OK | S_WSS | (A.graph ? S_INV : 0), S_PMM | (bad ? 0 : S_OK), bad ? 2 : 0,
            "qo_indptr[%d] = %d (was %d): the run's q has %lld rows", A.B, q[A.B], old, (long long)A.rows);
        return 1;
    }
    }
}

/* the page table's entries in use: request b's page j is entry b * bts + j (block-table form) or kv_indptr[b] + j */
static int32_t req_pages(int32_t b) { return A.kv_ip[b + 1] - A.kv_ip[b]; }
static int64_t entry_of(int32_t b, int64_t j) { return A.bt ? (int64_t)b * A.bts + j : A.kv_ip[b] + j; }
static int64_t pick_used_entry(void) { /* -1: none */
    if (A.kv_ip[A.B] == 0) return -1;
    const int32_t u = (int32_t)rr(0, A.kv_ip[A.B] - 1);
    int32_t b = 0;
    while (A.kv_ip[b + 1] <= u) ++b;
    return entry_of(b, u - A.kv_ip[b]);
}
static int64_t pick_tail_entry(void) { /* block-table form: an entry of a row past its request's pages; -1: none */
    if (!A.bt) return -1;
    int32_t c[MAXB], n = 0;
    for (int32_t b = 0; b < A.B; ++b)
        if (req_pages(b) < A.bts) c[n++] = b;
    if (!n) return -1;
    const int32_t b = c[rr(0, n - 1)];
    return (int64_t)b * A.bts + rr(req_pages(b), A.bts - 1);
}
static int32_t max_used_page(void) {
    int32_t mx = 0;
    for (int32_t b = 0; b < A.B; ++b)
        for (int32_t j = 0; j < req_pages(b); ++j) mx = A.hidx[entry_of(b, j)] > mx ? A.hidx[entry_of(b, j)] : mx;
    return mx;
}

/* kv_indptr / kv_last_page_len given with a block table: not read, anything goes */
static int am_bt_unread(int last) {
    if (pct(30)) {
        if (last) A.cp.kv_last_page_len = NULL;
        else A.cp.kv_indptr = NULL;
    } else {
        int32_t* x = last ? A.clast : A.ckv;
        for (int32_t b = 0; b <= A.B; ++b) x[b] = pct(20) ? INT32_MIN : (int32_t)rr(-3, 60);
        if (!last && x[0] == 0) x[0] = 1; /* (kv_seq_lens NULL then falls back to a malformed CSR table) */
        if (last) A.cp.kv_last_page_len = x;
        else A.cp.kv_indptr = x;
    }
    add(last ? "kv_last_page_len with a block table (not read)" : "kv_indptr with a block table (not read)", S_OK, S_OK,
        0, "%s = %s", last ? "kv_last_page_len" : "kv_indptr", (last ? A.cp.kv_last_page_len : A.cp.kv_indptr) ? "junk" : "NULL");
    return 1;
}

/* the block-table form: stride and lengths */
static int am_bt(void) {
    if (!A.bt) return 0;
    int32_t mx = 0;
    for (int32_t b = 0; b < A.B; ++b) mx = req_pages(b) > mx ? req_pages(b) : mx;
    const int custom_inv = A.custom ? S_INV : 0;
    /* a device skips pages a mask or window hides, so a junk page read there need not fault: junk only where every
       page is read (see am_devidx) */
    const int junk_ok = !g_dev || (A.d.mask_mode == KVA_MASK_NONE && A.d.window_left < 0);
    switch (rr(0, 8)) {
    case 0: {
        static const int32_t v[] = {0, -1, INT32_MIN};
        A.cp.block_table_stride = PICK(v);
        addst(0, "block_table_stride < 1", S_INV, A.B > 0, "block_table_stride = %d (batch %d)", A.cp.block_table_stride, A.B);
        return 1;
    }
    case 1: {
        if (A.B < 2) return 0;
        A.cp.block_table_stride = pct(50) ? INT32_MAX : (int32_t)(INT32_MAX / A.B + rr(1, 100));
        addst(0, "block table of 2^31 entries", S_UNS, 1, "block_table_stride = %d (batch %d)", A.cp.block_table_stride, A.B);
        return 1;
    }
    case 2: {
        if (mx < 2) return 0;
        A.cp.block_table_stride = (int32_t)rr(1, mx - 1);
        addst(0, "block_table_stride below a request's pages", S_MAL, 1, "block_table_stride = %d (a request has %d pages)",
              A.cp.block_table_stride, mx);
        return 1;
    }
    case 3: {
        /* another stride that holds every request: rows start elsewhere, requests may read other rows' pages or junk.
           Larger only where the run's table length bounds the reads and no host copy is read past its end. */
        if (!junk_ok) return 0;
        const int larger = A.ca.paged.num_indices > 0 && !A.cp.kv_indices && pct(50);
        const int32_t lo = mx > 1 ? mx : 1, ns = larger ? A.bts + (int32_t)rr(1, 4) : (int32_t)rr(lo, A.bts);
        if (ns == A.bts) return 0;
        A.cp.block_table_stride = ns;
        add("block_table_stride changed", S_OK | S_PIR, S_OK | S_PIR | S_MAL, 0,
            "block_table_stride = %d (rows of %d entries)", ns, A.bts);
        return 1;
    }
    case 4: {
        if (A.B == 0) return 0;
        const int32_t b = (int32_t)rr(0, A.B - 1);
        static const int32_t v[] = {-1, -100, INT32_MIN};
        A.csl[b] = PICK(v);
        addst(0, "kv_seq_lens negative", S_MAL, 1, "kv_seq_lens[%d] = %d", b, A.csl[b]);
        return 1;
    }
    case 5: {
        if (A.B == 0) return 0;
        const int32_t b = (int32_t)rr(0, A.B - 1);
        const int64_t cap = (int64_t)A.bts * A.ps;
        A.csl[b] = pct(20) || cap >= INT32_MAX - 40 ? INT32_MAX : (int32_t)(cap + rr(1, A.ps + 20));
        addst(0, "kv_seq_lens past a block-table row", S_MAL, 1, "kv_seq_lens[%d] = %d (rows of %d pages of %d)", b,
              A.csl[b], A.bts, A.ps);
        return 1;
    }
    case 6: {
        /* another length the row holds: shorter, or into the row's tail (junk pages there are faults) */
        if (A.B == 0) return 0;
        const int32_t b = (int32_t)rr(0, A.B - 1), old = A.csl[b];
        A.csl[b] = (int32_t)rr(0, (int64_t)(junk_ok ? A.bts : req_pages(b)) * A.ps);
        if (A.csl[b] == old) return 0;
        add("kv_seq_lens changed", S_OK | S_WSS | S_PIR, S_OK | S_PIR | custom_inv, 0, "kv_seq_lens[%d] = %d (was %d)", b,
            A.csl[b], old);
        return 1;
    }
    case 7:
        A.cp.kv_seq_lens = NULL;
        addst(0, "kv_seq_lens NULL (the CSR form, without its arrays)", S_INV | S_MAL, A.B > 0 || !A.cp.kv_indptr,
              "kv_seq_lens = NULL (kv_indptr %s)", A.cp.kv_indptr ? "junk" : "NULL");
        return 1;
    default:
        A.cop = KVA_OP_BATCH_PREFILL_RAGGED;
        A.named = pct(50);
        addst(0, "block table for ragged KV", S_INV, 1, "op = ragged prefill with kv_seq_lens");
        return 1;
    }
}

static int am_kv(void) {
    if (A.bt) return am_bt_unread(0);
    int32_t* k = A.ckv;
    switch (rr(0, 3)) {
    case 0:
        A.cp.kv_indptr = NULL;
        addst(0, "kv_indptr NULL", S_INV, 1, "kv_indptr = NULL");
        return 1;
    case 1: {
        static const int32_t v[] = {1, -1, 3, INT32_MIN};
        k[0] = PICK(v);
        addst(0, "kv_indptr[0] != 0", S_MAL, 1, "kv_indptr[0] = %d", k[0]);
        return 1;
    }
    case 2: {
        if (A.B == 0) return 0;
        const int32_t j = (int32_t)rr(1, A.B);
        k[j] = pct(80) ? k[j - 1] - (int32_t)rr(1, 3) : INT32_MIN;
        addst(0, "kv_indptr decreasing", S_MAL, 1, "kv_indptr[%d] = %d < kv_indptr[%d] = %d", j, k[j], j - 1, k[j - 1]);
        return 1;
    }
    default: {
        /* past the end of the page table (ragged: past k / v) */
        if (A.B == 0) return 0;
        const int32_t old = k[A.B];
        if (A.paged) {
            const int64_t v[] = {SPARE + 1, SPARE + rr(2, 6), 1 << 29, (int64_t)INT32_MAX - old};
            k[A.B] = (int32_t)(old + PICK(v));
            A.cp.kv_indices = NULL; /* (a host copy is read up to kv_indptr[B]) */
            A.ca.paged.num_indices = A.nidx;
            if (A.kv[A.B - 1] == 0) {
                addst(0, "kv_indptr[B] past the table", S_MAL, 1,
                      "kv_indptr[%d] = %d (was %d; last_page_len of the empty request is 0)", A.B, k[A.B], old);
            } else {
                add("kv_indptr[B] past the table", S_OK | S_MAL | S_UNS | S_WSS, S_MAL, 2,
                    "kv_indptr[%d] = %d (was %d), paged.num_indices = %lld", A.B, k[A.B], old, (long long)A.nidx);
            }
        } else {
            const int64_t v[] = {1, 2, 1 << 29};
            k[A.B] = (int32_t)(old + PICK(v));
            add("kv_indptr[B] past k / v", S_OK | S_UNS | S_WSS, S_PMM, 2, "kv_indptr[%d] = %d (k, v have %d rows)", A.B,
                k[A.B], old);
        }
        return 1;
    }
    }
}

static int nonempty_req(void) {
    int32_t c[MAXB], n = 0;
    for (int32_t b = 0; b < A.B; ++b)
        if (A.kv[b] > 0) c[n++] = b;
    return n ? c[rr(0, n - 1)] : -1;
}

static int am_last(void) {
    if (A.bt) return am_bt_unread(1);
    const int b = nonempty_req();
    switch (rr(0, 3)) {
    case 0: {
        if (b < 0) return 0;
        const int32_t ps = A.ps;
        const int32_t v[] = {0, -1, ps + 1, ps + (int32_t)rr(2, 20), INT32_MAX, INT32_MIN};
        A.clast[b] = PICK(v);
        addst(0, "last_page_len out of range", S_MAL, 1, "last_page_len[%d] = %d (page size %d)", b, A.clast[b], ps);
        return 1;
    }
    case 1: {
        if (b < 0 || A.ps < 2) return 0;
        const int32_t old = A.clast[b];
        A.clast[b] = (int32_t)rr(1, A.ps);
        if (A.clast[b] == old) return 0;
        add("last_page_len changed (valid)", S_OK | S_WSS, S_OK | (A.custom ? S_INV : 0), 0,
            "last_page_len[%d] = %d (was %d)", b, A.clast[b], old);
        return 1;
    }
    case 2: {
        int e = -1;
        for (int32_t i = 0; i < A.B; ++i)
            if (A.kv[i] == 0) e = i;
        if (e < 0) return 0;
        static const int32_t v[] = {0, -5, INT32_MAX, INT32_MIN};
        A.clast[e] = PICK(v);
        add("last_page_len of an empty request", S_OK, S_OK, 0, "last_page_len[%d] = %d (request without pages)", e,
            A.clast[e]);
        return 1;
    }
    default:
        if (A.B == 0) return 0;
        A.cp.kv_last_page_len = NULL;
        addst(0, "kv_last_page_len NULL", S_INV, 1, "kv_last_page_len = NULL");
        return 1;
    }
}

static int am_ps(void) {
    if (pct(40)) {
        static const int32_t v[] = {0, -1, INT32_MIN};
        A.cp.page_size = PICK(v);
        addst(0, "page_size < 1", S_INV, 1, "page_size = %d", A.cp.page_size);
        return 1;
    }
    int32_t np = (int32_t)rr(1, 17);
    if (np == A.ps) np = A.ps + 1;
    A.cp.page_size = np;
    add("page_size differs from the pool", S_OK | S_MAL | S_WSS | S_UNS | (A.bt ? S_PIR : 0), S_PMM, 2,
        "page_size = %d (pool %d)", np, A.ps);
    return 1;
}

static int am_npages(void) {
    const int hc = A.cp.kv_indices != NULL;
    switch (rr(0, 3)) {
    case 0: {
        static const int64_t v[] = {-1, INT64_MIN};
        A.cp.num_pages = PICK(v);
        addst(0, "num_pages negative", S_INV, 1, "num_pages = %lld", (long long)A.cp.num_pages);
        return 1;
    }
    case 1: {
        A.cp.num_pages = 0;
        const int bad = hc && A.entries > 0;
        addst(0, "num_pages 0", S_INV, bad, "num_pages = 0 (host page table %s, %lld entries)", hc ? "given" : "not given",
              (long long)A.entries);
        return 1;
    }
    case 2: {
        if (A.entries == 0) return 0;
        const int32_t mx = max_used_page();
        if (mx < 1) return 0;
        A.cp.num_pages = mx;
        addst(0, "num_pages below a page index", S_PIR, hc, "num_pages = %d (page %d is used; host page table %s)", mx, mx,
              hc ? "given" : "not given");
        return 1;
    }
    default:
        A.cp.num_pages = A.num_pages + rr(1, 5);
        add("num_pages larger than the pool", S_OK, S_PMM, 2, "num_pages = %lld (the run's pool has %lld)",
            (long long)A.cp.num_pages, (long long)A.num_pages);
        return 1;
    }
}

static int am_hidx(void) {
    const int64_t t = pct(25) ? pick_tail_entry() : -1;
    const int64_t e = t >= 0 ? t : pick_used_entry();
    if (e < 0) return 0;
    A.cp.kv_indices = A.chidx;
    if (A.cp.num_pages == 0) A.cp.num_pages = A.num_pages;
    if (t >= 0) {
        const int64_t v[] = {-1, A.num_pages, INT32_MAX, INT32_MIN};
        A.chidx[e] = (int32_t)PICK(v);
        add("host block-table entry past a request's pages (not read)", S_OK, S_OK, 0, "kv_indices[%lld] = %d",
            (long long)e, A.chidx[e]);
    } else if (pct(70)) {
        const int64_t v[] = {-1, A.num_pages, A.num_pages + rr(1, 5), INT32_MAX, INT32_MIN};
        A.chidx[e] = (int32_t)PICK(v);
        addst(0, "host page index out of range", S_PIR, 1, "kv_indices[%lld] = %d (pool of %lld)", (long long)e,
              A.chidx[e], (long long)A.cp.num_pages);
    } else {
        A.chidx[e] = (int32_t)rr(0, A.num_pages - 1);
        add("host page index changed (valid)", S_OK, S_OK, 0, "kv_indices[%lld] = %d (the run's table keeps %d)",
            (long long)e, A.chidx[e], A.hidx[e]);
    }
    return 1;
}

static int am_split(void) {
    switch (rr(0, 2)) {
    case 0: {
        static const int32_t v[] = {-1, INT32_MIN};
        A.cp.fixed_split_size = PICK(v);
        addst(0, "fixed_split_size negative", S_INV, 1, "fixed_split_size = %d", A.cp.fixed_split_size);
        return 1;
    }
    case 1:
        A.cp.fixed_split_size = (int32_t)rr(1, 16);
        if (A.graph) {
            addst(0, "graph mode with fixed_split_size", S_UNS, 1, "fixed_split_size = %d", A.cp.fixed_split_size);
        } else {
            add("fixed_split_size (valid)", S_OK | S_WSS, S_OK, 0, "fixed_split_size = %d", A.cp.fixed_split_size);
        }
        return 1;
    default:
        A.cp.disable_split_kv = !A.cp.disable_split_kv;
        add("disable_split_kv toggled (valid)", S_OK | S_WSS, S_OK, 0, "disable_split_kv = %d", A.cp.disable_split_kv);
        return 1;
    }
}

static int am_graph_apply(kva_plan_params* p);
static int am_graph(void) {
    kva_plan_params keep = A.cp, *p = &A.cp;
    if (!am_graph_apply(p)) {
        A.cp = keep; /* not drawn: nothing changed */
        return 0;
    }
    return 1;
}

static int am_graph_apply(kva_plan_params* p) {
    if (!p->graph_mode) {
        p->graph_mode = 1;
        p->max_batch_size = A.B + 1;
        p->max_total_qo_rows = A.rows + 1;
        p->fixed_split_size = 0;
    }
    const int dec = A.fam == F_DEC;
    switch (rr(0, 3)) {
    case 0: {
        const int32_t v[] = {0, -1, A.B - 1, INT32_MIN};
        const int32_t nv = PICK(v);
        if (nv >= A.B && nv >= 1) return 0;
        p->max_batch_size = nv;
        if (dec && p->max_total_qo_rows == 0 && nv >= 1) return 0;
        addst(0, "graph max_batch_size too small", S_INV, 1, "max_batch_size = %d (batch %d)", nv, A.B);
        return 1;
    }
    case 1: {
        if (A.rows < 1) return 0;
        p->max_total_qo_rows = pct(50) ? A.rows - 1 : -1;
        if (dec && p->max_total_qo_rows == 0) return 0;
        addst(0, "graph max_total_qo_rows too small", S_INV, 1, "max_total_qo_rows = %lld (%lld rows)",
              (long long)p->max_total_qo_rows, (long long)A.rows);
        return 1;
    }
    case 2:
        p->fixed_split_size = (int32_t)rr(1, 16);
        addst(0, "graph mode with fixed_split_size", S_UNS, 1, "fixed_split_size = %d", p->fixed_split_size);
        return 1;
    default: {
        static const int64_t v[] = {(int64_t)1 << 31, (int64_t)1 << 40, INT64_MAX};
        p->max_total_qo_rows = PICK(v);
        addst(0, "graph max_total_qo_rows huge", S_UNS, 1, "max_total_qo_rows = %lld", (long long)p->max_total_qo_rows);
        return 1;
    }
    }
}

static int am_pws(void) {
    switch (rr(0, g_dev ? 3 : 2)) {
    case 0: {
        if (A.pws_null) return 0;
        const int64_t v[] = {1, 256, 100000000};
        A.ws_small = PICK(v);
        A.ws_small_mut = T.nm;
        addst(0, "workspace too small", S_WSS, 1, "device_bytes = need - %lld", (long long)A.ws_small);
        return 1;
    }
    case 1:
        if (A.pws_null) return 0;
        A.pws.device = NULL;
        addst(0, "workspace device NULL", S_WSS, 1, "workspace.device = NULL (%zu bytes)", A.pws.device_bytes);
        return 1;
    case 2: {
        if (A.pws_null) return 0;
        static const int v[] = {1, 8, 64, 128};
        const int off = PICK(v);
        A.pws.device = (char*)A.pws.device + off;
        A.pws.device_bytes -= 256;
        A.rws = A.pws;
        addst(0, "workspace misaligned", S_ALN, 1, "workspace.device + %d", off);
        return 1;
    }
    default:
        if (A.pws_null) return 0;
        if (pct(50)) A.pws.host = NULL;
        else A.pws.host_bytes = A.pws.host_bytes > 0 ? A.pws.host_bytes / 2 : 0;
        addst(0, "host staging workspace", S_WSS, 1, "workspace.host = %p, host_bytes = %zu", A.pws.host, A.pws.host_bytes);
        return 1;
    }
}

static int am_scall(void) { /* single ops */
    switch (rr(0, 3)) {
    case 0:
        A.pctx = NULL;
        addst(0, "single context NULL", S_INV, 1, "context = NULL");
        return 1;
    case 1:
        A.args_null = 1;
        addst(0, "single args NULL", S_INV, 1, "args = NULL");
        return 1;
    case 2:
        A.desc_null = 1;
        addst(0, "single desc NULL", S_INV, 1, "desc = NULL");
        return 1;
    default:
        if (A.pws_null) return 0;
        A.pws_null = 1;
        addst(0, "single workspace NULL", S_INV, g_dev, "workspace = NULL (%s)",
              g_dev ? "a device backend needs one" : "the CPU backend allocates scratch");
        return 1;
    }
}

static int am_rcall(void) {
    switch (rr(0, 5)) {
    case 0:
        A.rctx = NULL;
        addst(1, "run context NULL", S_INV, 1, "context = NULL");
        return 1;
    case 1:
        A.rplan_null = 1;
        addst(1, "run plan NULL", S_INV, 1, "plan = NULL");
        return 1;
    case 2:
        A.rws_null = 1;
        addst(1, "run workspace NULL", S_INV, 1, "workspace = NULL");
        return 1;
    case 3:
        A.args_null = 1;
        addst(1, "run args NULL", S_INV, 1, "args = NULL");
        return 1;
    case 4:
        A.rctx = g_other;
        addst(1, "run on another context", S_PMM, 1, "a second context of the same backend and workers");
        return 1;
    default:
        A.wrapper = pct(70) ? 2 : 1;
        if (A.wrapper == 2) addst(1, "run through another op's named run", S_PMM, 1, "another op's kva_batch_*_run");
        else add("run through the op's named run", S_OK, S_OK, 0, "kva_batch_*_run of the plan's op");
        return 1;
    }
}

static int am_plan(void) {
    switch (rr(0, 4)) {
    case 0:
    case 1: { /* bits flipped: words 0..63 are the plan's data (sealed by its hash); the rest may be unused */
        const int all = rr(0, 1) == 1;
        A.flip_n = (int)rr(1, 4);
        A.flip_words = all ? 160 : 64;
        int covered = 1;
        char desc[120];
        size_t k = 0;
        desc[0] = 0;
        for (int i = 0; i < A.flip_n; ++i) {
            A.flip_w[i] = (int)rr(0, A.flip_words - 1);
            A.flip_b[i] = (int)rr(0, 63);
            covered &= A.flip_w[i] < 64;
            int w = snprintf(desc + k, sizeof desc - k, " %d:%d", A.flip_w[i], A.flip_b[i]);
            if (w > 0 && (size_t)w < sizeof desc - k) k += (size_t)w;
        }
        if (covered) addst(1, "plan bits flipped", S_PMM, 1, "word:bit%s", desc);
        else addst(1, "plan bits flipped (maybe in unused words)", S_PMM, 0, "word:bit%s", desc);
        return 1;
    }
    case 2:
        A.plan_zero = 1;
        addst(1, "plan zeroed", S_PMM, 1, "memset(plan, 0)");
        return 1;
    case 3:
        A.plan_garbage = 1;
        addst(1, "plan random bytes", S_PMM, 1, "every byte of the plan random");
        return 1;
    default:
        A.stale = 1;
        if (A.graph) add("a graph-mode re-plan of the same bounds", S_OK, S_OK, 0, "plan again into the workspace first");
        else addst(1, "a later plan into the same workspace", S_PMM, 1, "plan again into the workspace first (eager)");
        return 1;
    }
}

static int am_rws(void) {
    switch (rr(0, 3)) {
    case 0:
        if (!A.have_ws2) {
            h_ws_alloc(&A.ws2, A.need + 512, A.ws.host_bytes);
            A.have_ws2 = 1;
            reg(&A.ws2.dev, "other workspace");
        }
        A.rws = A.ws2.ws;
        A.rws.device_bytes = A.need + 256;
        addst(1, "run with another workspace", S_PMM, 1, "a workspace of the same size");
        return 1;
    case 1:
        A.rws_short = 1;
        addst(1, "run workspace declared smaller", S_PMM, 1, "device_bytes = the plan's bytes - 1");
        return 1;
    case 2:
        A.rws.device_bytes += (size_t)rr(1, 4096);
        add("run workspace declared larger", S_OK, S_OK, 0, "device_bytes = %zu", A.rws.device_bytes);
        return 1;
    default:
        if (!A.have_ws2) {
            h_ws_alloc(&A.ws2, A.need + 512, A.ws.host_bytes);
            A.have_ws2 = 1;
            reg(&A.ws2.dev, "other workspace");
        }
        A.rws.scratch = A.ws2.ws.device;
        A.rws.scratch_bytes = A.need;
        addst(1, "run with a scratch region the plan has not", S_PMM, 1, "workspace.scratch = %p", A.rws.scratch);
        return 1;
    }
}

static int am_tensor(kva_tensor* t, const char* name, int out, int free_rows, int ndim_alt, int checked) {
    tspec s;
    memset(&s, 0, sizeof s);
    s.name = name;
    s.null_ok = t == &A.ca.lse;
    s.stage = ast();
    s.checked = checked;
    s.out = out;
    s.mm = S_PMM;
    s.badtype = S_PMM;
    s.extra = A.single ? S_INV | S_PMM : 0;
    s.free_rows = free_rows;
    s.ndim_alt = ndim_alt;
    s.overlap_ok = 1;
    return mut_tensor(t, &s);
}

static int am_q(void) {
    const int sdec = A.fam == F_SDEC;
    /* single ops: q's rows are the call's qo_len (decode: must be one row) */
    return am_tensor(&A.ca.q, "q", 0, A.fam == F_SPRE, sdec ? 2 : 0, A.rows > 0);
}
static int am_o(void) { return am_tensor(&A.ca.o, "o", 1, 0, A.fam == F_SDEC ? 2 : 0, A.rows > 0); }
static int am_lse(void) {
    if (A.cd.score_mode == KVA_SCORE_SIGMOID || A.d.score_mode == KVA_SCORE_SIGMOID) {
        if (A.rows == 0 || A.ca.lse.data) return 0;
        A.ca.lse.data = h_buf_dp(&A.lse);
        addst(ast(), "lse in sigmoid mode", S_INV | (A.single ? S_PMM : 0), 1, "lse given in sigmoid mode");
        return 1;
    }
    if (!A.ca.lse.data && pct(40)) { /* an lse that is not requested: its descriptor is not read */
        static const int32_t v[] = {-1, 0, 5, 7, INT32_MAX, INT32_MIN};
        A.ca.lse.ndim = PICK(v);
        A.ca.lse.dtype = (kva_dtype)42;
        add("lse not requested, descriptor garbage (valid)", S_OK, S_OK, 0, "lse.data = NULL, ndim %d, dtype 42",
            A.ca.lse.ndim);
        return 1;
    }
    if (!A.ca.lse.data) {
        if (A.rows == 0) return 0;
        A.ca.lse.data = h_buf_dp(&A.lse);
        add("lse requested (valid)", S_OK, S_OK, 0, "lse given");
        return 1;
    }
    if (pct(15)) {
        A.ca.lse.data = NULL;
        add("lse not requested (valid)", S_OK, S_OK, 0, "lse.data = NULL");
        return 1;
    }
    return am_tensor(&A.ca.lse, "lse", 1, 0, A.fam == F_SDEC ? 1 : 0, A.rows > 0);
}
static int am_kvt(void) {
    if (A.paged) return 0;
    if (A.total_kv == 0 && pct(50)) { /* no KV token: k and v are not read (single ops: k's rank and rows are) */
        static const int32_t nds[] = {-1, 0, 5, INT32_MAX, INT32_MIN};
        A.ca.k.dtype = A.ca.v.dtype = (kva_dtype)42;
        A.ca.v.ndim = PICK(nds);
        if (!A.single) A.ca.k.ndim = PICK(nds);
        add("k / v unused, descriptors garbage (valid)", S_OK, S_OK, 0, "no KV token; k, v dtype 42, ranks %d / %d",
            A.ca.k.ndim, A.ca.v.ndim);
        return 1;
    }
    const int k = pct(50);
    /* single ops: k's rows are the call's kv_len */
    return am_tensor(k ? &A.ca.k : &A.ca.v, k ? "k" : "v", 0, A.single && k, 0, A.total_kv > 0);
}

static int am_paged(void) {
    kva_paged_kv* pk = &A.ca.paged;
    const int need = A.entries > 0 || A.graph; /* pools and table required */
    switch (rr(0, 11)) {
    case 0: {
        static const kva_dtype v[] = {F32, F16, BF16, E4M3, E5M2, (kva_dtype)42};
        const kva_dtype nv = PICK(v);
        if (nv == pk->dtype) return 0;
        pk->dtype = nv;
        addst(1, "paged dtype", S_PMM, 1, "paged.dtype = %d (plan %s)", (int)nv, h_dtype_str(A.d.kv_dtype));
        return 1;
    }
    case 1: {
        const int32_t v[] = {0, -1, A.ps + 1, A.ps > 1 ? A.ps - 1 : 2, INT32_MAX};
        pk->page_size = PICK(v);
        addst(1, "paged page_size", S_PMM, 1, "paged.page_size = %d (plan %d)", pk->page_size, A.ps);
        return 1;
    }
    case 2: {
        const int64_t plan_np = A.cp.num_pages;
        const int k = (int)rr(0, 3);
        if (k == 0) {
            pk->num_pages = pct(50) ? -1 : INT64_MIN;
            addst(1, "paged num_pages negative", S_PMM, 1, "paged.num_pages = %lld", (long long)pk->num_pages);
        } else if (k == 1) {
            pk->num_pages = 0;
            if (plan_np > 0) addst(1, "paged num_pages 0", S_PMM, 1, "paged.num_pages = 0 (plan %lld)", (long long)plan_np);
            else addst(1, "paged num_pages 0", S_INV, A.entries > 0, "paged.num_pages = 0 (%lld entries)", (long long)A.entries);
        } else if (k == 2) {
            if (A.entries == 0) return 0;
            const int32_t mx = max_used_page();
            if (mx < 1) return 0;
            pk->num_pages = mx;
            if (plan_np > 0) {
                addst(1, "paged num_pages below the plan's", S_PMM, 1, "paged.num_pages = %d (plan %lld)", mx, (long long)plan_np);
            } else if (g_dev) {
                if (A.d.mask_mode != KVA_MASK_NONE || A.d.window_left >= 0) {
                    pk->num_pages = A.ra.paged.num_pages;
                    return 0;
                }
                add("paged num_pages below a page index (device fault)", S_OK, S_OK, 0, "paged.num_pages = %d", mx);
            } else {
                addst(1, "paged num_pages below a page index", S_PIR, A.rows > 0, "paged.num_pages = %d (page %d used)", mx, mx);
            }
        } else {
            static const int64_t v[] = {1, 5, (int64_t)1 << 31, INT64_MAX - 100};
            pk->num_pages = pk->num_pages < 100 ? pk->num_pages + PICK(v) : INT64_MAX;
            add("paged num_pages larger (valid)", S_OK, S_OK, 0, "paged.num_pages = %lld", (long long)pk->num_pages);
        }
        return 1;
    }
    case 3: {
        static const int32_t v[] = {0, -1, 1, 2, 5};
        const int32_t nv = PICK(v);
        if (nv == pk->num_heads) return 0;
        pk->num_heads = nv;
        addst(1, "paged num_heads", S_PMM, 1, "paged.num_heads = %d (desc %d)", nv, A.d.num_kv_heads);
        return 1;
    }
    case 4: {
        const int32_t nv = pct(50) ? (int32_t)rr(-1, 3) : A.d.head_dim_qk + (int32_t)rr(1, 8);
        if (pct(50)) {
            if (nv == pk->head_dim_qk) return 0;
            pk->head_dim_qk = nv;
        } else {
            if (nv == pk->head_dim_vo) return 0;
            pk->head_dim_vo = nv;
        }
        addst(1, "paged head dims", S_PMM, 1, "paged head dims %d / %d (desc %d / %d)", pk->head_dim_qk,
              pk->head_dim_vo, A.d.head_dim_qk, A.d.head_dim_vo);
        return 1;
    }
    case 5: {
        int64_t* s[6] = {&pk->k_stride_page, &pk->k_stride_token, &pk->k_stride_head,
                         &pk->v_stride_page, &pk->v_stride_token, &pk->v_stride_head};
        const int i = (int)rr(0, 5);
        static const int64_t v[] = {-1, -64, INT64_MIN};
        *s[i] = PICK(v);
        addst(1, "paged stride negative", S_INV, 1, "paged stride %d = %lld", i, (long long)*s[i]);
        return 1;
    }
    case 6: {
        int64_t* s[6] = {&pk->k_stride_page, &pk->k_stride_token, &pk->k_stride_head,
                         &pk->v_stride_page, &pk->v_stride_token, &pk->v_stride_head};
        const int i = (int)rr(0, 5);
        const int64_t es = (int64_t)ref_dtype_size(pk->dtype);
        const int64_t v[] = {INT64_MAX, INT64_MAX / es, es > 1 ? INT64_MAX / es + rr(1, 1000) : INT64_MAX};
        *s[i] = PICK(v);
        const int64_t span = i % 3 == 0 ? pk->num_pages - 1 : i % 3 == 1 ? A.ps - 1 : A.d.num_kv_heads - 1;
        addst(1, "paged stride huge", S_INV | (g_dev ? S_ALN : 0), span > 0, "paged stride %d = %lld (span %lld)", i,
              (long long)*s[i], (long long)span);
        return 1;
    }
    case 7: {
        /* a smaller stride: rows of the pool overlap (reads stay inside the pool) */
        int64_t* s[6] = {&pk->k_stride_page, &pk->k_stride_token, &pk->k_stride_head,
                         &pk->v_stride_page, &pk->v_stride_token, &pk->v_stride_head};
        const int i = (int)rr(0, 5);
        if (*s[i] <= 0) return 0;
        const int64_t old = *s[i];
        *s[i] = rr(0, old - 1);
        add("paged stride smaller (valid)", S_OK, S_OK | (g_dev ? S_ALN : 0), 0, "paged stride %d = %lld (was %lld)", i,
            (long long)*s[i], (long long)old);
        return 1;
    }
    case 8:
        if (pct(50)) pk->k_data = NULL;
        else pk->v_data = NULL;
        addst(1, "paged k_data / v_data NULL", S_INV, need, "paged.%s = NULL", pk->k_data ? "v_data" : "k_data");
        return 1;
    case 9:
        pk->indices = NULL;
        addst(1, "paged indices NULL", S_INV, need, "paged.indices = NULL (%lld entries)", (long long)A.entries);
        return 1;
    case 10: {
        static const int64_t v[] = {-1, INT64_MIN};
        pk->num_indices = PICK(v);
        addst(1, "paged num_indices negative", S_INV, 1, "paged.num_indices = %lld", (long long)pk->num_indices);
        return 1;
    }
    default: {
        if (A.entries < 1) return 0;
        pk->num_indices = rr(0, A.entries - 1);
        const int bad = pk->num_indices > 0;
        addst(1, "paged num_indices short", S_MAL, bad, "paged.num_indices = %lld (the plan's table has %lld entries)",
              (long long)pk->num_indices, (long long)A.entries);
        return 1;
    }
    }
}

static int am_devidx(void) {
    int32_t* ix = (int32_t*)h_buf_hp(&A.idx_d);
    const int64_t t = pct(25) ? pick_tail_entry() : -1;
    const int64_t e = t >= 0 ? t : pick_used_entry();
    if (e < 0) return 0;
    const int32_t old = ix[e];
    /* a device reads the pages it needs: with a mask or a window some may be skipped (no fault) */
    const int all_read = A.d.mask_mode == KVA_MASK_NONE && A.d.window_left < 0;
    if (t >= 0) {
        const int64_t v[] = {-1, A.num_pages, A.alloc_pages - 1, INT32_MAX, INT32_MIN};
        ix[e] = (int32_t)PICK(v);
        add("device block-table entry past a request's pages (not read)", S_OK, S_OK, 0, "indices[%lld] = %d (was %d)",
            (long long)e, ix[e], old);
    } else if (pct(70) && (!g_dev || all_read)) {
        const int64_t v[] = {-1, A.num_pages, A.alloc_pages - 1, INT32_MAX, INT32_MIN};
        ix[e] = (int32_t)PICK(v);
        if (g_dev) {
            add("device page index out of range (device fault)", S_OK, S_OK, 0, "indices[%lld] = %d (was %d)", (long long)e,
                ix[e], old);
        } else {
            /* (a run of no query rows computes nothing and checks no page) */
            addst(1, "device page index out of range", S_PIR, A.rows > 0, "indices[%lld] = %d (was %d; pool of %lld)",
                  (long long)e, ix[e], old, (long long)A.num_pages);
        }
    } else {
        ix[e] = (int32_t)rr(0, A.num_pages - 1);
        add("device page index changed (valid)", S_OK, S_OK, 0, "indices[%lld] = %d (was %d)", (long long)e, ix[e], old);
    }
    h_buf_upload(&A.idx_d);
    return 1;
}

static int am_mask(void) {
    if (!A.custom) return 0;
    const int bad = A.mask_bytes > 0;
    switch (rr(0, 2)) {
    case 0:
        A.ca.custom_mask = NULL;
        addst(1, "custom mask NULL", S_INV, bad, "custom_mask = NULL (%lld bytes needed)", (long long)A.mask_bytes);
        return 1;
    case 1: {
        const int64_t v[] = {A.mask_bytes - 1, A.mask_bytes > 0 ? rr(0, A.mask_bytes - 1) : -1, -1, INT64_MIN};
        A.ca.custom_mask_bytes = PICK(v);
        /* a negative size is refused even where no byte is needed (a run of no query rows checks nothing) */
        addst(1, "custom mask short", S_INV, bad || (A.ca.custom_mask_bytes < 0 && A.rows > 0),
              "custom_mask_bytes = %lld (%lld needed)",
              (long long)A.ca.custom_mask_bytes, (long long)A.mask_bytes);
        return 1;
    }
    default: {
        uint8_t* m = (uint8_t*)h_buf_hp(&A.mask_d);
        const size_t i = (size_t)rr(0, (int64_t)A.mask_d.elems - 1);
        m[i] ^= (uint8_t)(1u << rr(0, 7));
        h_buf_upload(&A.mask_d);
        add("custom mask bits (valid)", S_OK, S_OK, 0, "byte %zu flipped", i);
        return 1;
    }
    }
}

static int am_scale(void) {
    const int st = ast();
    switch (rr(0, 5)) {
    case 0:
        if (pct(50)) A.ca.k_scale = pick_nonfinite();
        else A.ca.v_scale = pick_nonfinite();
        addst(st, "k/v scale not finite", S_INV, 1, "k_scale = %g, v_scale = %g", (double)A.ca.k_scale, (double)A.ca.v_scale);
        return 1;
    case 1:
        A.ca.k_scale = (float)(-2.0 + 4.0 * unif());
        A.ca.v_scale = pct(20) ? 0.0f : (float)(-2.0 + 4.0 * unif());
        add("k/v scale (valid)", S_OK, S_OK, 0, "k_scale = %g, v_scale = %g", (double)A.ca.k_scale, (double)A.ca.v_scale);
        return 1;
    case 2: {
        static const int32_t v[] = {2, -1, INT32_MIN};
        A.ca.enable_pdl = PICK(v);
        addst(st, "enable_pdl", S_INV, 1, "enable_pdl = %d", A.ca.enable_pdl);
        return 1;
    }
    case 3:
        A.ca.enable_pdl = !A.ca.enable_pdl;
        add("enable_pdl (valid)", S_OK, S_OK, 0, "enable_pdl = %d", A.ca.enable_pdl);
        return 1;
    case 4: {
        static const int32_t v[] = {1, -1, 16};
        if (pct(50)) A.ca.num_variant_scalars = PICK(v);
        else A.ca.num_variant_tensors = PICK(v);
        addst(st, "variant parameters without a variant", S_INV, 1, "num_variant_scalars = %d, num_variant_tensors = %d",
              A.ca.num_variant_scalars, A.ca.num_variant_tensors);
        return 1;
    }
    default:
        if (A.d.pos_encoding != KVA_POS_ALIBI) return 0;
        if (A.ca.alibi_slopes) {
            A.ca.alibi_slopes = NULL;
            add("ALiBi slopes dropped (valid)", S_OK, S_OK, 0, "alibi_slopes = NULL (standard slopes)");
        } else {
            if (!A.sl_d.host) {
                A.sl_d = h_buf_alloc(F32, (size_t)A.d.num_qo_heads);
                for (int32_t h = 0; h < A.d.num_qo_heads; ++h) h_buf_set(&A.sl_d, (size_t)h, 0.01 + 0.99 * unif());
                h_buf_upload(&A.sl_d);
                reg(&A.sl_d, "ALiBi slopes");
            }
            A.ca.alibi_slopes = (const float*)h_buf_dp(&A.sl_d);
            add("ALiBi slopes given (valid)", S_OK, S_OK, 0, "alibi_slopes given");
        }
        return 1;
    }
}

static const mdef att_defs[] = {
    {"desc bad", FB_ATT, G_DESC, 0, am_desc_bad},
    {"desc bad", FB_ATT, G_DESC, 0, am_desc_bad},
    {"desc NULL", FB_BATCH, G_DESC, 0, am_desc_null},
    {"desc valid", FB_ATT, G_DESCV, G_ARGS | G_QO | G_KV | G_DESC, am_desc_valid},
    {"desc dtype", FB_ATT, G_DESCV, G_ARGS | G_QO | G_KV | G_DESC, am_desc_dtype},
    {"desc heads huge", FB_ATT, G_DESCV, G_ARGS | G_QO | G_KV | G_DESC | G_WS, am_desc_heads_huge},
    {"plan call", FB_BATCH, G_CALLP, G_QO | G_KV, am_pcall},
    {"single call", FB_SINGLE, G_CALLP, G_WS, am_scall},
    {"batch", FB_BATCH, G_QO, G_Q | G_O | G_LSE | G_MASK | G_KV | G_KVT | G_PAGED | G_DEV | G_GRAPH, am_batch},
    {"qo", FB_BATCH, G_QO, G_Q | G_O | G_LSE | G_MASK | G_KV | G_KVT | G_PAGED | G_DEV | G_GRAPH, am_qo},
    {"kv", FB_BATCH, G_KV, G_PAGED | G_DEV | G_KVT | G_MASK | G_QO, am_kv},
    {"last", FB_PAGED, G_KV, G_PAGED | G_DEV | G_KVT | G_MASK | G_QO, am_last},
    {"page size", FB_PAGED, G_KV, G_PAGED | G_DEV | G_KVT | G_MASK | G_QO, am_ps},
    {"num_pages", FB_PAGED, G_KV, G_PAGED | G_DEV | G_KVT | G_MASK | G_QO, am_npages},
    {"host page table", FB_PAGED, G_KV, G_PAGED | G_DEV | G_KVT | G_MASK | G_QO, am_hidx},
    {"block table", FB_PAGED, G_KV, G_PAGED | G_DEV | G_KVT | G_MASK | G_QO, am_bt},
    {"block table", FB_PAGED, G_KV, G_PAGED | G_DEV | G_KVT | G_MASK | G_QO, am_bt},
    {"split", FB_BATCH, G_SPLIT, G_GRAPH, am_split},
    {"graph", FB_BATCH, G_GRAPH, G_SPLIT | G_WS | G_PLAN | G_QO, am_graph},
    {"plan workspace", FB_ATT, G_WS, G_GRAPH | G_RWS, am_pws},
    {"run call", FB_BATCH, G_CALLR, 0, am_rcall},
    {"plan struct", FB_BATCH, G_PLAN, G_RWS | G_GRAPH, am_plan},
    {"run workspace", FB_BATCH, G_RWS, G_PLAN | G_WS, am_rws},
    {"q", FB_BATCH, G_Q, 0, am_q},
    {"q", FB_SINGLE, G_Q, G_O | G_LSE, am_q}, /* (single ops: q's rows are the call's, which o and lse follow) */
    {"o", FB_BATCH, G_O, 0, am_o},
    {"o", FB_SINGLE, G_O, G_Q, am_o},
    {"lse", FB_BATCH, G_LSE, 0, am_lse},
    {"lse", FB_SINGLE, G_LSE, G_Q, am_lse},
    {"k / v", FB(F_RAG) | FB_SINGLE, G_KVT, 0, am_kvt},
    {"paged", FB_PAGED, G_PAGED, G_DEV, am_paged},
    {"paged", FB_PAGED, G_PAGED, G_DEV, am_paged},
    {"device page table", FB_PAGED, G_DEV, G_PAGED, am_devidx},
    {"custom mask", FB(F_PRE) | FB(F_RAG), G_MASK, 0, am_mask},
    {"scalars", FB_ATT, G_SCALE, 0, am_scale},
};

/* ---- attention: a model of the contract, and the reference ---- */

typedef struct aeff {
    kva_attention_desc d; /* normalised (defaults filled) */
    kva_op op;
    int paged, graph;
    int32_t B, ps;
    int32_t qo[MAXB], kv[MAXB], qs[MAXB], ks[MAXB];
    int64_t moff[MAXB];
    int64_t rows, total_kv, entries, mask_bytes, num_pages;
} aeff;

#define BAD(...) return (snprintf(why, n, __VA_ARGS__), why)

static int is_float_dt(kva_dtype t) { return t == F32 || t == F16 || t == BF16; }

static const char* desc_model(const kva_attention_desc* in, kva_attention_desc* out, char* why, size_t n) {
    kva_attention_desc d = *in;
    if (d.num_qo_heads <= 0 || d.num_kv_heads <= 0) BAD("desc: heads %d / %d", d.num_qo_heads, d.num_kv_heads);
    if (d.num_qo_heads % d.num_kv_heads) BAD("desc: %d heads over %d", d.num_qo_heads, d.num_kv_heads);
    if (d.num_qo_heads / d.num_kv_heads > 128) BAD("desc: group size over 128");
    if (d.head_dim_qk <= 0 || d.head_dim_vo <= 0) BAD("desc: head dims %d / %d", d.head_dim_qk, d.head_dim_vo);
    if (!is_float_dt(d.q_dtype) || !is_float_dt(d.o_dtype)) BAD("desc: q / o dtype");
    if (!is_float_dt(d.kv_dtype) && d.kv_dtype != E4M3 && d.kv_dtype != E5M2) BAD("desc: kv dtype");
    if ((unsigned)d.mask_mode > 2u) BAD("desc: mask_mode %d", (int)d.mask_mode);
    if (d.window_left < -1) BAD("desc: window_left %d", d.window_left);
    if (!isfinite(d.logits_soft_cap) || d.logits_soft_cap < 0) BAD("desc: soft cap");
    if (!isfinite(d.sm_scale)) BAD("desc: sm_scale");
    if (d.sm_scale == 0.0f) d.sm_scale = (float)(1.0 / sqrt((double)d.head_dim_qk));
    if ((unsigned)d.pos_encoding > 2u) BAD("desc: pos_encoding %d", (int)d.pos_encoding);
    if (d.rope_scale == 0.0f) d.rope_scale = 1.0f;
    if (d.rope_theta == 0.0f) d.rope_theta = 1e4f;
    if (d.pos_encoding == KVA_POS_ROPE_LLAMA) {
        if (d.head_dim_qk % 2) BAD("desc: RoPE with an odd head dim");
        if (!isfinite(d.rope_scale) || d.rope_scale <= 0 || !isfinite(d.rope_theta) || d.rope_theta <= 0)
            BAD("desc: RoPE scale / theta");
    }
    if ((unsigned)d.score_mode > 1u) BAD("desc: score_mode %d", (int)d.score_mode);
    if (!isfinite(d.sigmoid_bias)) BAD("desc: sigmoid_bias");
    if (d.variant) BAD("desc: a variant pointer (none is live)");
    if (!g_dev && (d.head_dim_qk > 512 || d.head_dim_vo > 512)) BAD("desc: head dim over 512 (CPU)");
    *out = d;
    return NULL;
}

static const char* att_plan_model(aeff* e, char* why, size_t n) {
    const att* a = &A;
    memset(e, 0, sizeof *e);
    if (!a->pctx) BAD("plan: context NULL");
    if (a->desc_null) BAD("plan: desc NULL");
    if (a->params_null) BAD("plan: params NULL");
    if (a->pws_null) BAD("plan: workspace NULL");
    if (a->plan_null) BAD("plan: plan NULL");
    const kva_op op = a->cop;
    if ((unsigned)op > 2u) BAD("plan: op %d", (int)op);
    const char* r = desc_model(&a->cd, &e->d, why, n);
    if (r) return r;
    if (op == KVA_OP_BATCH_DECODE && e->d.mask_mode == KVA_MASK_CUSTOM) BAD("plan: decode with a custom mask");
    const kva_plan_params* p = &a->cp;
    const int32_t B = p->batch_size;
    if (B < 0) BAD("plan: batch_size %d", B);
    if (B > MAXB) BAD("test: batch_size %d past the arrays", B);
    const int paged = op != KVA_OP_BATCH_PREFILL_RAGGED;
    if (op == KVA_OP_BATCH_DECODE) {
        if (p->qo_indptr)
            for (int32_t b = 0; b <= B; ++b)
                if (p->qo_indptr[b] != b) BAD("plan: decode qo_indptr[%d] = %d", b, p->qo_indptr[b]);
    } else if (!p->qo_indptr) {
        BAD("plan: qo_indptr NULL");
    }
    const int bt = p->kv_seq_lens != NULL; /* the block-table form */
    if (bt && !paged) BAD("plan: kv_seq_lens for ragged KV");
    if (!bt && !p->kv_indptr) BAD("plan: kv_indptr NULL");
    if (paged) {
        if (p->page_size < 1) BAD("plan: page_size %d", p->page_size);
        if (!bt && B > 0 && !p->kv_last_page_len) BAD("plan: kv_last_page_len NULL");
        if (bt && B > 0 && p->block_table_stride < 1) BAD("plan: block_table_stride %d", p->block_table_stride);
        if (bt && (int64_t)B * p->block_table_stride > INT32_MAX) BAD("plan: block table of 2^31 entries");
        if (p->num_pages < 0) BAD("plan: num_pages negative");
    }
    if (p->fixed_split_size < 0) BAD("plan: fixed_split_size negative");
    if (p->qo_indptr && p->qo_indptr[0] != 0) BAD("plan: qo_indptr[0] = %d", p->qo_indptr[0]);
    if (!bt && p->kv_indptr[0] != 0) BAD("plan: kv_indptr[0] = %d", p->kv_indptr[0]);
    int64_t bt_entries = 0;
    for (int32_t b = 0; b < B; ++b) {
        int64_t qo = 1;
        if (p->qo_indptr) qo = (int64_t)p->qo_indptr[b + 1] - p->qo_indptr[b];
        if (qo < 0) BAD("plan: qo_indptr decreasing at %d", b + 1);
        int64_t kv;
        if (bt) {
            kv = p->kv_seq_lens[b];
            if (kv < 0) BAD("plan: kv_seq_lens[%d] = %lld", b, (long long)kv);
            const int64_t np = (kv + p->page_size - 1) / p->page_size;
            if (np > p->block_table_stride) BAD("plan: request %d's %lld pages past a block-table row", b, (long long)np);
            if (np > 0) bt_entries = (int64_t)b * p->block_table_stride + np;
        }
        const int64_t ne = bt ? 0 : (int64_t)p->kv_indptr[b + 1] - p->kv_indptr[b];
        if (ne < 0) BAD("plan: kv_indptr decreasing at %d", b + 1);
        if (!bt) kv = ne;
        if (!bt && paged && ne > 0) {
            const int32_t l = p->kv_last_page_len[b];
            if (l < 1 || l > p->page_size) BAD("plan: last_page_len[%d] = %d (page size %d)", b, l, p->page_size);
            kv = (ne - 1) * p->page_size + l;
        }
        if (kv > INT32_MAX / 2) BAD("plan: request %d has %lld tokens", b, (long long)kv);
        e->qo[b] = (int32_t)qo;
        e->kv[b] = (int32_t)kv;
        e->qs[b] = p->qo_indptr ? p->qo_indptr[b] : b;
        e->ks[b] = bt ? (int32_t)((int64_t)b * p->block_table_stride) : p->kv_indptr[b];
        e->moff[b] = e->mask_bytes;
        if (e->d.mask_mode == KVA_MASK_CUSTOM) e->mask_bytes += (qo * kv + 7) / 8;
        e->rows += qo;
        e->total_kv += kv;
    }
    if (e->rows > INT32_MAX / 2 || e->rows * e->d.num_qo_heads > INT32_MAX) BAD("plan: %lld rows", (long long)e->rows);
    if (paged) {
        e->entries = bt ? bt_entries : p->kv_indptr[B];
        if (e->entries > 0 && p->kv_indices && p->num_pages < 1) BAD("plan: host page table with num_pages 0");
        if (p->kv_indices)
            for (int32_t b = 0; b < B; ++b) { /* the entries in use (block-table rows' tails are not read) */
                const int64_t np = bt ? (e->kv[b] + p->page_size - 1) / p->page_size
                                      : (int64_t)p->kv_indptr[b + 1] - p->kv_indptr[b];
                for (int64_t j = 0; j < np; ++j) {
                    const int64_t i = e->ks[b] + j;
                    if (i >= a->nidx) BAD("test: the host page table is read past its %lld entries", (long long)a->nidx);
                    if (p->kv_indices[i] < 0 || p->kv_indices[i] >= p->num_pages)
                        BAD("plan: host page index %d at %lld (num_pages %lld)", p->kv_indices[i], (long long)i,
                            (long long)p->num_pages);
                }
            }
        e->num_pages = p->num_pages;
        e->ps = p->page_size;
    } else {
        e->total_kv = B > 0 ? p->kv_indptr[B] : 0;
    }
    if (p->graph_mode) {
        int64_t mr = p->max_total_qo_rows;
        if (op == KVA_OP_BATCH_DECODE && mr == 0) mr = p->max_batch_size;
        if (p->max_batch_size < 1 || p->max_batch_size < B || mr < e->rows || mr < 0) BAD("plan: graph bounds");
        if (mr > INT32_MAX / 2 || mr * e->d.num_qo_heads > INT32_MAX) BAD("plan: graph row bound too large");
        if (p->fixed_split_size > 0) BAD("plan: graph mode with fixed_split_size");
    }
    size_t need = 0, hneed = 0;
    const kva_status s = kva_plan_workspace_size(a->pctx, &a->cd, op, p, &need, &hneed);
    if (s != KVA_OK) BAD("plan: the size query refuses these inputs (%s)", kva_status_string(s));
    if (a->pws.device_bytes < need || (need > 0 && !a->pws.device)) BAD("plan: workspace of %zu bytes, %zu needed", a->pws.device_bytes, need);
    if (g_dev && (a->pws.host_bytes < hneed || !a->pws.host)) BAD("plan: host staging too small");
    if ((uintptr_t)a->pws.device % 256 != 0 || (g_dev && (uintptr_t)a->pws.host % 256 != 0)) BAD("plan: workspace misaligned");
    e->op = op;
    e->paged = paged;
    e->graph = p->graph_mode != 0;
    e->B = B;
    return NULL;
}

static int paged_extent_ok(const kva_paged_kv* pk) {
    int64_t last_page = pk->num_pages < ((int64_t)INT32_MAX + 1) ? pk->num_pages - 1 : INT32_MAX;
    if (last_page < 0) last_page = 0;
    const int64_t limit = max_elem_off(pk->dtype);
    for (int kv = 0; kv < 2; ++kv) {
        const int64_t st[4] = {kv ? pk->v_stride_page : pk->k_stride_page, kv ? pk->v_stride_token : pk->k_stride_token,
                               kv ? pk->v_stride_head : pk->k_stride_head, 1};
        const int64_t span[4] = {last_page, (int64_t)pk->page_size - 1, (int64_t)pk->num_heads - 1,
                                 (int64_t)(kv ? pk->head_dim_vo : pk->head_dim_qk) - 1};
        int64_t ext = 0;
        for (int i = 0; i < 4; ++i) {
            if (span[i] <= 0 || st[i] == 0) continue;
            if (span[i] > (limit - ext) / st[i]) return 0;
            ext += span[i] * st[i];
        }
    }
    return 1;
}

/* the run-time arguments against the (effective) plan */
static const char* att_args_model(const aeff* e, const kva_run_args* x, char* why, size_t n) {
    const kva_attention_desc* d = &e->d;
    if (x->enable_pdl != 0 && x->enable_pdl != 1) BAD("run: enable_pdl %d", x->enable_pdl);
    if (x->num_variant_scalars || x->num_variant_tensors) BAD("run: variant parameters without a variant");
    const char* r;
    if (e->rows > 0) {
        const int64_t qs[3] = {e->rows, d->num_qo_heads, d->head_dim_qk}, os[3] = {e->rows, d->num_qo_heads, d->head_dim_vo};
        if ((r = model_tensor(why, n, "q", &x->q, d->q_dtype, 3, qs, 0))) return r;
        if ((r = model_tensor(why, n, "o", &x->o, d->o_dtype, 3, os, 1))) return r;
        if (x->lse.data) {
            if (d->score_mode == KVA_SCORE_SIGMOID) BAD("run: lse in sigmoid mode");
            const int64_t ls[2] = {e->rows, d->num_qo_heads};
            if ((r = model_tensor(why, n, "lse", &x->lse, F32, 2, ls, 1))) return r;
        }
    }
    if (!isfinite(x->k_scale) || !isfinite(x->v_scale)) BAD("run: k_scale / v_scale not finite");
    if (!e->paged) {
        if (e->total_kv > 0) {
            const int64_t ks[3] = {e->total_kv, d->num_kv_heads, d->head_dim_qk};
            const int64_t vs[3] = {e->total_kv, d->num_kv_heads, d->head_dim_vo};
            if ((r = model_tensor(why, n, "k", &x->k, d->kv_dtype, 3, ks, 0))) return r;
            if ((r = model_tensor(why, n, "v", &x->v, d->kv_dtype, 3, vs, 0))) return r;
        }
    } else {
        const kva_paged_kv* pk = &x->paged;
        if (pk->dtype != d->kv_dtype) BAD("run: paged dtype");
        if (pk->page_size != e->ps) BAD("run: paged page_size %d (plan %d)", pk->page_size, e->ps);
        if (pk->num_pages < e->num_pages || pk->num_pages < 0) BAD("run: paged num_pages %lld below the plan's", (long long)pk->num_pages);
        if (e->entries > 0 && pk->num_pages < 1) BAD("run: paged num_pages 0");
        if (pk->num_heads != d->num_kv_heads) BAD("run: paged num_heads");
        if (pk->head_dim_qk != d->head_dim_qk || pk->head_dim_vo != d->head_dim_vo) BAD("run: paged head dims");
        if (pk->num_indices < 0) BAD("run: paged num_indices negative");
        if (pk->k_stride_page < 0 || pk->k_stride_token < 0 || pk->k_stride_head < 0 || pk->v_stride_page < 0 ||
            pk->v_stride_token < 0 || pk->v_stride_head < 0)
            BAD("run: paged stride negative");
        if (!paged_extent_ok(pk)) BAD("run: paged strides address beyond 2^63 bytes");
        if (pk->num_indices > 0 && pk->num_indices < e->entries) BAD("run: paged num_indices below the plan's table");
        if (e->entries > 0 || e->graph) {
            if (!pk->k_data || !pk->v_data) BAD("run: paged pools NULL");
            if (!pk->indices) BAD("run: paged indices NULL");
        }
    }
    if (d->mask_mode == KVA_MASK_CUSTOM && e->mask_bytes > 0) {
        if (!x->custom_mask) BAD("run: custom mask NULL");
        if (x->custom_mask_bytes < e->mask_bytes) BAD("run: custom mask of %lld bytes", (long long)x->custom_mask_bytes);
    }
    return NULL;
}

static const char* att_run_model(const aeff* e, const kva_plan_info* info, char* why, size_t n) {
    const att* a = &A;
    if (!a->rctx) BAD("run: context NULL");
    if (a->rctx != a->pctx) BAD("run: another context");
    if (a->rplan_null) BAD("run: plan NULL");
    if (a->plan_zero || a->plan_garbage) BAD("run: a corrupted plan");
    if (a->rws_null) BAD("run: workspace NULL");
    if (a->rws.device != a->pws.device || a->rws.device_bytes < info->device_bytes) BAD("run: another workspace");
    if (a->rws.scratch) BAD("run: a scratch region the plan has not");
    if (a->stale && !e->graph) BAD("run: a stale plan");
    if (a->args_null) BAD("run: args NULL");
    if (a->wrapper == 2) BAD("run: another op's named run");
    return att_args_model(e, &a->ca, why, n);
}

/* the single ops' view of their arguments (decode: [heads, dim] q / o and [heads] lse are one row) */
static void single_normalize(kva_run_args* x, int decode) {
    if (!decode) return;
    kva_tensor* ts[3] = {&x->q, &x->o, &x->lse};
    for (int i = 0; i < 3; ++i) {
        kva_tensor* t = ts[i];
        const int32_t want = i == 2 ? 1 : 2;
        if (t->data && t->ndim == want) {
            for (int k = want; k > 0; --k) {
                t->shape[k] = t->shape[k - 1];
                t->stride[k] = t->stride[k - 1];
            }
            t->shape[0] = 1;
            t->stride[0] = t->shape[1] > 0 && t->stride[1] >= 0 && t->stride[1] <= INT64_MAX / t->shape[1]
                               ? t->shape[1] * t->stride[1]
                               : 0;
            t->ndim = want + 1;
        }
    }
}

static const char* att_single_model(aeff* e, kva_run_args* x, char* why, size_t n) {
    const att* a = &A;
    memset(e, 0, sizeof *e);
    if (!a->pctx) BAD("single: context NULL");
    if (a->args_null) BAD("single: args NULL");
    if (a->desc_null) BAD("single: desc NULL");
    const char* r = desc_model(&a->cd, &e->d, why, n);
    if (r) return r;
    *x = a->ca;
    single_normalize(x, a->fam == F_SDEC);
    if (a->fam == F_SDEC && x->q.ndim == 3 && x->q.shape[0] != 1) BAD("single decode: q rows %lld", (long long)x->q.shape[0]);
    if (x->q.ndim != 3 || x->k.ndim != 3) BAD("single: q / k rank");
    const int64_t qo = x->q.shape[0], kv = x->k.shape[0];
    if (qo < 0 || kv < 0 || qo > INT32_MAX / 2 || kv > INT32_MAX / 2) BAD("single: lengths %lld / %lld", (long long)qo, (long long)kv);
    e->op = KVA_OP_BATCH_PREFILL_RAGGED;
    e->B = 1;
    e->qo[0] = (int32_t)qo;
    e->kv[0] = (int32_t)kv;
    e->rows = qo;
    e->total_kv = kv;
    if (e->d.mask_mode == KVA_MASK_CUSTOM) e->mask_bytes = (qo * kv + 7) / 8;
    if (e->rows * e->d.num_qo_heads > INT32_MAX) BAD("single: %lld packed rows", (long long)(e->rows * e->d.num_qo_heads));
    if ((r = att_args_model(e, x, why, n))) return r;
    if (a->pws_null) {
        if (g_dev) BAD("single: no workspace on a device backend");
    } else {
        size_t need = 0, hneed = 0;
        const kva_status s = kva_single_workspace_size(a->pctx, &a->cd, qo, kv, &need, &hneed);
        if (s != KVA_OK) BAD("single: the size query refuses these inputs (%s)", kva_status_string(s));
        if (a->pws.device_bytes < need || (need > 0 && !a->pws.device)) BAD("single: workspace small");
        if (g_dev && (a->pws.host_bytes < hneed || !a->pws.host)) BAD("single: host staging small");
        if ((uintptr_t)a->pws.device % 256 != 0) BAD("single: workspace misaligned");
    }
    return NULL;
}

static int rd_i32(const view* v, int64_t e, int32_t* x) {
    if (!v->h || e < v->lo / 4 - 1 || e > v->hi / 4 + 1) return 0;
    const int64_t b = e * 4;
    if (b < v->lo || b + 4 > v->hi) return 0;
    memcpy(x, v->h + b, 4);
    return 1;
}

/* Outputs of an accepted run against the float64 reference computed from the inputs as given. */
static void att_reference(const aeff* e, const kva_run_args* x, const char* what) {
    const kva_attention_desc* d = &e->d;
    const int32_t hq = d->num_qo_heads, hkv = d->num_kv_heads, dqk = d->head_dim_qk, dvo = d->head_dim_vo;
    const int64_t R = e->rows;
    const int paged = e->paged;
    double* q = (double*)xcalloc((size_t)(R * hq * dqk), sizeof(double));
    double* o = (double*)xcalloc((size_t)(R * hq * dvo), sizeof(double));
    double* mag = (double*)xcalloc((size_t)(R * hq * dvo), sizeof(double));
    double* lse = (double*)xcalloc((size_t)(R * hq), sizeof(double));
    double* slopes = NULL;
    int64_t max_kv = 0;
    int bad_req[MAXB] = {0}, any_bad = 0;
    view qv, kvw, vvw, iv, mv;
    int ok = 1;
    resolve(x->q.data, &qv);
    for (int32_t b = 0; b < e->B && ok; ++b)
        for (int64_t i = 0; i < e->qo[b] && ok; ++i)
            for (int32_t h = 0; h < hq && ok; ++h)
                for (int32_t c = 0; c < dqk; ++c) {
                    const int64_t r = e->qs[b] + i;
                    if (!vget(&qv, x->q.dtype, r * x->q.stride[0] + h * x->q.stride[1] + c * x->q.stride[2],
                              &q[((r)*hq + h) * dqk + c])) {
                        cfail("%s: q element (%lld, %d, %d) lies outside its buffer", what, (long long)r, h, c);
                        ok = 0;
                        break;
                    }
                }
    if (ok && R > 0 && d->pos_encoding == KVA_POS_ALIBI && x->alibi_slopes) {
        view sv;
        resolve(x->alibi_slopes, &sv);
        slopes = (double*)xcalloc((size_t)hq, sizeof(double));
        for (int32_t h = 0; h < hq && ok; ++h)
            if (!vget(&sv, F32, h, &slopes[h])) {
                cfail("%s: ALiBi slope %d lies outside its buffer", what, h);
                ok = 0;
            }
    }
    if (paged) {
        resolve(x->paged.k_data, &kvw);
        resolve(x->paged.v_data, &vvw);
        resolve(x->paged.indices, &iv);
    } else {
        resolve(x->k.data, &kvw);
        resolve(x->v.data, &vvw);
    }
    if (d->mask_mode == KVA_MASK_CUSTOM) resolve(x->custom_mask, &mv);
    ref_attn_cfg cfg;
    memset(&cfg, 0, sizeof cfg);
    cfg.num_qo_heads = hq;
    cfg.num_kv_heads = hkv;
    cfg.head_dim_qk = dqk;
    cfg.head_dim_vo = dvo;
    cfg.mask_mode = d->mask_mode;
    cfg.window_left = d->window_left;
    cfg.soft_cap = d->logits_soft_cap;
    cfg.sm_scale = d->sm_scale;
    cfg.pos_encoding = d->pos_encoding;
    cfg.rope_scale = d->rope_scale;
    cfg.rope_theta = d->rope_theta;
    cfg.score_mode = d->score_mode;
    cfg.sigmoid_bias = d->sigmoid_bias;
    cfg.alibi_slopes = slopes;
    /* (a run of no query rows computes nothing: it reads no page) */
    for (int32_t b = 0; b < e->B && ok && R > 0; ++b) {
        const int64_t kv = e->kv[b], qo = e->qo[b];
        if (kv > max_kv) max_kv = kv;
        double* kd = (double*)xcalloc((size_t)(kv * hkv * dqk), sizeof(double));
        double* vd = (double*)xcalloc((size_t)(kv * hkv * dvo), sizeof(double));
        const uint8_t* mseg = NULL;
        for (int64_t j = 0; j < kv && ok && !bad_req[b]; ++j) {
            int64_t kb, vb;
            kva_dtype dt;
            if (paged) {
                const kva_paged_kv* pk = &x->paged;
                int32_t page;
                if (!rd_i32(&iv, e->ks[b] + j / e->ps, &page)) {
                    cfail("%s: request %d reads page-table entry %lld outside its buffer", what, b,
                          (long long)(e->ks[b] + j / e->ps));
                    ok = 0;
                    break;
                }
                if (page < 0 || page >= pk->num_pages) {
                    if (g_dev) { /* a device reads the pages of requests with query rows only */
                        if (qo > 0) bad_req[b] = any_bad = 1;
                        break;
                    }
                    cfail("%s: accepted request %d with page index %d outside the pool [0, %lld)", what, b, page,
                          (long long)pk->num_pages);
                    ok = 0;
                    break;
                }
                const int64_t t = j % e->ps;
                kb = page * pk->k_stride_page + t * pk->k_stride_token;
                vb = page * pk->v_stride_page + t * pk->v_stride_token;
                dt = pk->dtype;
                for (int32_t h = 0; h < hkv && ok; ++h) {
                    for (int32_t c = 0; c < dqk && ok; ++c)
                        if (!vget(&kvw, dt, kb + h * pk->k_stride_head + c, &kd[(j * hkv + h) * dqk + c])) ok = 0;
                    for (int32_t c = 0; c < dvo && ok; ++c)
                        if (!vget(&vvw, dt, vb + h * pk->v_stride_head + c, &vd[(j * hkv + h) * dvo + c])) ok = 0;
                }
            } else {
                const int64_t row = e->ks[b] + j;
                dt = x->k.dtype;
                for (int32_t h = 0; h < hkv && ok; ++h) {
                    for (int32_t c = 0; c < dqk && ok; ++c)
                        if (!vget(&kvw, dt, row * x->k.stride[0] + h * x->k.stride[1] + c * x->k.stride[2],
                                  &kd[(j * hkv + h) * dqk + c]))
                            ok = 0;
                    for (int32_t c = 0; c < dvo && ok; ++c)
                        if (!vget(&vvw, x->v.dtype, row * x->v.stride[0] + h * x->v.stride[1] + c * x->v.stride[2],
                                  &vd[(j * hkv + h) * dvo + c]))
                            ok = 0;
                }
            }
            if (!ok) cfail("%s: request %d: a K/V element of token %lld lies outside its buffer", what, b, (long long)j);
        }
        for (int64_t i = 0; i < kv * hkv * dqk; ++i) kd[i] *= x->k_scale;
        for (int64_t i = 0; i < kv * hkv * dvo; ++i) vd[i] *= x->v_scale;
        if (ok && d->mask_mode == KVA_MASK_CUSTOM && qo * kv > 0) {
            const int64_t nb = (qo * kv + 7) / 8;
            if (!mv.h || e->moff[b] < mv.lo || e->moff[b] + nb > mv.hi) {
                cfail("%s: request %d's custom mask segment lies outside its buffer", what, b);
                ok = 0;
            } else {
                mseg = mv.h + e->moff[b];
            }
        }
        if (ok && !bad_req[b]) {
            const int64_t r0 = e->qs[b];
            ref_attention(&cfg, qo, kv, q + r0 * hq * dqk, kd, vd, mseg, o + r0 * hq * dvo, lse + r0 * hq, mag + r0 * hq * dvo);
        } else if (ok) { /* a device fault: the request's rows are 0, lse -inf */
            for (int64_t i = 0; i < qo * hq; ++i) lse[(e->qs[b]) * hq + i] = -INFINITY;
        }
        free(kd);
        free(vd);
    }
    /* outputs */
    if (ok && R > 0) {
        view ov;
        resolve(x->o.data, &ov);
        const int64_t es = (int64_t)ref_dtype_size(x->o.dtype);
        if (ov.bi < 0 || ov.off % es) {
            cfail("%s: o is not inside a buffer of the case", what);
            ok = 0;
        } else {
            int64_t* pos = (int64_t*)xcalloc((size_t)(R * hq * dvo), sizeof(int64_t));
            const int64_t base = ov.off / es;
            for (int64_t r = 0; r < R; ++r)
                for (int32_t h = 0; h < hq; ++h)
                    for (int32_t c = 0; c < dvo; ++c)
                        pos[(r * hq + h) * dvo + c] = base + r * x->o.stride[0] + h * x->o.stride[1] + c * x->o.stride[2];
            h_tol t = h_tol_out(d->o_dtype, d->q_dtype, d->kv_dtype);
            if (d->pos_encoding == KVA_POS_ROPE_LLAMA) t.atol += 1e-7 * (double)(max_kv + 1);
            check_out(ov.bi, x->o.dtype, pos, o, mag, R * hq * dvo, t, "o");
            free(pos);
        }
        if (ok && x->lse.data) {
            view lv;
            resolve(x->lse.data, &lv);
            if (lv.bi < 0 || lv.off % 4) {
                cfail("%s: lse is not inside a buffer of the case", what);
            } else {
                int64_t* pos = (int64_t*)xcalloc((size_t)(R * hq), sizeof(int64_t));
                for (int64_t r = 0; r < R; ++r)
                    for (int32_t h = 0; h < hq; ++h) pos[r * hq + h] = lv.off / 4 + r * x->lse.stride[0] + h * x->lse.stride[1];
                h_tol tl = h_tol_lse();
                if (d->pos_encoding == KVA_POS_ROPE_LLAMA) tl.atol += 1e-7 * (double)(max_kv + 1);
                check_out(lv.bi, F32, pos, lse, NULL, R * hq, tl, "lse");
                free(pos);
            }
        }
    }
    if (ok) {
        /* everything else (inputs, and o / lse where nothing is written) unchanged */
        h_buf* skip[4] = {&A.ws.dev, A.have_ws2 ? &A.ws2.dev : &A.ws.dev, NULL, NULL};
        int ns = 2;
        view ov;
        if (R > 0 && resolve(x->o.data, &ov)) skip[ns++] = T.buf[ov.bi];
        if (R > 0 && x->lse.data && resolve(x->lse.data, &ov)) skip[ns++] = T.buf[ov.bi];
        const char* w = changed(skip, ns);
        if (w) cfail("%s: the call modified %s", what, w);
    }
    if (g_dev && ok && !A.single) {
        kva_fault_report rep;
        memset(&rep, 0, sizeof rep);
        const kva_status s = kva_read_faults(g_ctx, &A.rws, &rep, NULL);
        int match = 0;
        for (int32_t b = 0; b < e->B; ++b) match |= bad_req[b] && rep.request == b;
        if (s != KVA_OK || (any_bad && (!rep.faulted || !match)) || (!any_bad && rep.faulted))
            cfail("%s: device fault report: %s, faulted %d, request %d, page %lld (expected %s)", what,
                  kva_status_string(s), rep.faulted, rep.request, (long long)rep.page_index,
                  any_bad ? "a fault of a request with a bad page" : "no fault");
    }
    free(q);
    free(o);
    free(mag);
    free(lse);
    free(slopes);
}

/* ---- attention: the calls ---- */

static kva_status att_plan_call(kva_plan* plan) {
    att* a = &A;
    const kva_attention_desc* d = a->desc_null ? NULL : &a->cd;
    const kva_plan_params* p = a->params_null ? NULL : &a->cp;
    const kva_workspace* w = a->pws_null ? NULL : &a->pws;
    kva_plan* pl = a->plan_null ? NULL : plan;
    if (a->named) {
        switch (a->cop) {
        case KVA_OP_BATCH_DECODE: return kva_batch_decode_plan(a->pctx, d, p, w, pl, NULL);
        case KVA_OP_BATCH_PREFILL_PAGED: return kva_batch_prefill_paged_plan(a->pctx, d, p, w, pl, NULL);
        default: return kva_batch_prefill_ragged_plan(a->pctx, d, p, w, pl, NULL);
        }
    }
    return kva_plan_make(a->pctx, d, a->cop, p, w, pl, NULL);
}

static void att_resolve_ws_small(void) {
    att* a = &A;
    if (a->ws_small <= 0) return;
    size_t need = 0, hb = 0;
    kva_status s = KVA_ERR_INVALID_ARGUMENT;
    if (a->pctx && !a->desc_null) {
        if (a->single) {
            kva_run_args x = a->ca;
            single_normalize(&x, a->fam == F_SDEC);
            if (!a->args_null && x.q.ndim == 3 && x.k.ndim == 3)
                s = kva_single_workspace_size(a->pctx, &a->cd, x.q.shape[0], x.k.shape[0], &need, &hb);
        } else if (!a->params_null) {
            s = kva_plan_workspace_size(a->pctx, &a->cd, a->cop, &a->cp, &need, &hb);
        }
    }
    if (s == KVA_OK) {
        a->pws.device_bytes = need > (size_t)a->ws_small ? need - (size_t)a->ws_small : 0;
    } else { /* the size is unknown here: the other mutations decide */
        mut* m = &T.m[a->ws_small_mut];
        m->must = 0;
        m->mask[0] |= S_OK;
    }
}

static void att_single_case(void) {
    att* a = &A;
    char why[300];
    att_resolve_ws_small();
    snap_all();
    kva_clear_last_error();
    const kva_attention_desc* d = a->desc_null ? NULL : &a->cd;
    const kva_run_args* ar = a->args_null ? NULL : &a->ca;
    const kva_workspace* w = a->pws_null ? NULL : &a->pws;
    const kva_status st = a->fam == F_SDEC ? kva_single_decode(a->pctx, d, ar, w) : kva_single_prefill(a->pctx, d, ar, w);
    const char* call = a->fam == F_SDEC ? "kva_single_decode" : "kva_single_prefill";
    verdict(0, st, call);
    h_buf* skip[1] = {&a->ws.dev}; /* the single ops' workspace is scratch (docs/errors.md) */
    if (st != KVA_OK) {
        check_refused(st, call, skip, 1);
        return;
    }
    aeff e;
    kva_run_args x;
    const char* bad = att_single_model(&e, &x, why, sizeof why);
    if (bad) {
        cfail("%s accepted invalid inputs: %s", call, bad);
        return;
    }
    att_reference(&e, &x, call);
}

static void att_case(void) {
    att* a = &A;
    if (a->single) {
        att_single_case();
        return;
    }
    char why[300];
    att_resolve_ws_small();
    kva_plan plan;
    memset(&plan, 0x77, sizeof plan);
    const kva_plan plan0 = plan;
    size_t qd = 12345, qh = 678;
    const kva_status sq = kva_plan_workspace_size(a->pctx, a->desc_null ? NULL : &a->cd, a->cop,
                                                  a->params_null ? NULL : &a->cp, &qd, &qh);
    snap_all();
    kva_clear_last_error();
    kva_status st = att_plan_call(&plan);
    verdict(0, st, "plan");
    if (st != KVA_OK) {
        check_refused(st, "plan", NULL, 0);
        if (memcmp(&plan, &plan0, sizeof plan) != 0) cfail("the refused plan call modified the kva_plan struct");
        if (st != KVA_ERR_WORKSPACE_TOO_SMALL && st != KVA_ERR_ALIGNMENT && !a->pws_null && !a->plan_null && sq != st)
            cfail("kva_plan_workspace_size returned %s on the inputs kva_plan_make refused with %s", kva_status_string(sq),
                  kva_status_string(st));
        if (sq != KVA_OK && (qd != 12345 || qh != 678)) cfail("the refused size query wrote its outputs");
        return;
    }
    if (sq != KVA_OK) cfail("kva_plan_workspace_size refused (%s) what kva_plan_make accepted", kva_status_string(sq));
    aeff e;
    const char* bad = att_plan_model(&e, why, sizeof why);
    if (bad) {
        cfail("plan accepted invalid inputs: %s", bad);
        return;
    }
    kva_plan_info info;
    memset(&info, 0, sizeof info);
    st = kva_plan_get_info(&plan, &info);
    if (st != KVA_OK || info.total_qo_rows != e.rows || info.batch_size != e.B || info.op != e.op)
        cfail("kva_plan_get_info: %s, rows %lld, batch %d (expected %lld, %d)", kva_status_string(st),
              (long long)info.total_qo_rows, info.batch_size, (long long)e.rows, e.B);
    if (info.device_bytes > a->pws.device_bytes) cfail("the plan uses %zu bytes of a %zu-byte workspace", info.device_bytes, a->pws.device_bytes);
    if (a->stale) {
        kva_plan p2;
        st = att_plan_call(&p2);
        if (st != KVA_OK) cfail("the second plan into the workspace: %s: %s", kva_status_string(st), kva_last_error_message());
    }
    if (a->rws_short) a->rws.device_bytes = info.device_bytes - 1;
    kva_plan rp = plan;
    for (int i = 0; i < a->flip_n; ++i) rp.opaque[a->flip_w[i]] ^= 1ull << a->flip_b[i];
    if (a->plan_zero) memset(&rp, 0, sizeof rp);
    if (a->plan_garbage)
        for (int i = 0; i < 160; ++i) rp.opaque[i] = h_rng_u64(&T.r);
    if (g_dev) { /* start from a clear fault word */
        kva_fault_report rep;
        kva_read_faults(g_ctx, &a->ws.ws, &rep, NULL);
    }
    snap_all();
    const kva_plan rp0 = rp;
    kva_clear_last_error();
    const kva_plan* pl = a->rplan_null ? NULL : &rp;
    const kva_workspace* w = a->rws_null ? NULL : &a->rws;
    const kva_run_args* ar = a->args_null ? NULL : &a->ca;
    if (a->wrapper == 0) {
        st = kva_run(a->rctx, pl, w, ar);
    } else {
        const kva_op op = a->wrapper == 2 ? (kva_op)(((int)a->cop + 1) % 3) : a->cop;
        st = op == KVA_OP_BATCH_DECODE          ? kva_batch_decode_run(a->rctx, pl, w, ar)
             : op == KVA_OP_BATCH_PREFILL_PAGED ? kva_batch_prefill_paged_run(a->rctx, pl, w, ar)
                                                : kva_batch_prefill_ragged_run(a->rctx, pl, w, ar);
    }
    verdict(1, st, "run");
    if (memcmp(&rp, &rp0, sizeof rp) != 0) cfail("the run modified the kva_plan struct");
    if (st != KVA_OK) check_refused(st, "run", NULL, 0);
    if (a->flip_n) { /* a plan whose seal broke is refused by run and by kva_plan_get_info alike */
        kva_plan_info i2;
        const kva_status si = kva_plan_get_info(&rp, &i2);
        if (si != KVA_OK && si != KVA_ERR_INVALID_ARGUMENT) cfail("kva_plan_get_info of a flipped plan: %s", kva_status_string(si));
        if (st == KVA_OK && si != KVA_OK)
            cfail("run accepted a plan with flipped bits that kva_plan_get_info refuses (%s)", kva_status_string(si));
        if (si == KVA_OK && a->flip_words == 64) cfail("kva_plan_get_info accepted a plan with flipped bits in words 0..63");
    }
    if (st != KVA_OK) return;
    bad = att_run_model(&e, &info, why, sizeof why);
    if (bad) {
        cfail("run accepted invalid inputs: %s", bad);
        return;
    }
    att_reference(&e, &a->ca, "run");
}

/* ============================================================================================== */
/* Append to the paged KV cache                                                                    */

typedef struct app {
    int32_t B, ps, H, dqk, dvo;
    kva_dtype pdt, adt;
    int32_t kv[MAXB], ip[MAXB + 1], last[MAXB + 1];
    int64_t entries, nidx, num_pages, alloc_pages, nnz;
    h_buf kp, vp, ak, av, bi, po, idx, ipd, lpd;
    kva_paged_kv pg;
    kva_tensor tk, tv;
    /* the call as mutated */
    kva_context* ctx;
    int tk_null, tv_null, bi_null, po_null, pg_null;
    kva_tensor ctk, ctv;
    kva_paged_kv cpg;
    int64_t cnnz;
    int32_t cB;
    /* the slot form (kva_append_paged_kv_cache_by_slot): token i to slot sl[i] (int64 in an I32 buffer); batch
       indices, positions, batch_size and the page table are then not read */
    int slot_form, sl_null;
    h_buf sl;
} app;

static app P;

enum { GA_CALL = 1, GA_NNZ = 2, GA_PTR = 4, GA_GEOM = 8, GA_STRIDE = 16, GA_TK = 32, GA_TV = 64, GA_DATA = 128, GA_TABLE = 256,
       GA_SLOT = 512 };

static void app_build(void) {
    app* p = &P;
    memset(p, 0, sizeof *p);
    static const int32_t cpu_dims[] = {1, 2, 3, 4, 8, 16, 32, 64};
    static const int32_t dev_dims[] = {64, 128};
    static const kva_dtype cpu_pdt[] = {F32, F16, BF16, E4M3, E5M2};
    static const kva_dtype dev_pdt[] = {F16, BF16, E4M3, E5M2};
    static const kva_dtype fl[] = {F32, F16, BF16};
    p->B = (int32_t)rr(1, MAXB);
    p->ps = (int32_t)rr(1, 17);
    p->H = (int32_t)rr(1, 4);
    p->dqk = g_dev ? PICK(dev_dims) : PICK(cpu_dims);
    p->dvo = g_dev || pct(70) ? p->dqk : PICK(cpu_dims);
    p->pdt = g_dev ? PICK(dev_pdt) : PICK(cpu_pdt);
    p->adt = pct(60) ? p->pdt : PICK(fl);
    for (int32_t b = 0; b < p->B; ++b) {
        p->kv[b] = pct(20) ? 0 : (int32_t)rr(1, 30);
        const int32_t np = (p->kv[b] + p->ps - 1) / p->ps;
        p->ip[b + 1] = p->ip[b] + np;
        p->last[b] = np ? p->kv[b] - (np - 1) * p->ps : 0;
    }
    p->entries = p->ip[p->B];
    p->nidx = p->entries + SPARE;
    p->num_pages = p->entries + rr(1, 4);
    p->alloc_pages = p->num_pages + XPAGES;
    int32_t* perm = (int32_t*)xcalloc((size_t)p->num_pages, sizeof(int32_t));
    for (int64_t i = 0; i < p->num_pages; ++i) perm[i] = (int32_t)i;
    h_rng_shuffle_i32(&T.r, perm, p->num_pages);
    p->idx = h_buf_alloc(KVA_DTYPE_I32, (size_t)p->nidx);
    int32_t* ix = (int32_t*)h_buf_hp(&p->idx);
    for (int64_t i = 0; i < p->nidx; ++i) ix[i] = i < p->entries ? perm[i] : (int32_t)rr(0, p->num_pages - 1);
    free(perm);
    const kva_layout layout = pct(50) ? KVA_LAYOUT_NHD : KVA_LAYOUT_HND;
    kva_paged_kv* pg = &p->pg;
    kva_paged_kv_init(pg, NULL, NULL, p->pdt, layout, p->num_pages, p->ps, p->H, p->dqk, p->dvo);
    if (pct(30)) { /* append takes any stride on every backend */
        const int64_t p1 = rr(1, 5), p2 = rr(1, 5), p3 = rr(1, 5);
        if (layout == KVA_LAYOUT_NHD) {
            pg->k_stride_head = p->dqk + p1;
            pg->v_stride_head = p->dvo + p1;
            pg->k_stride_token = p->H * pg->k_stride_head + p2;
            pg->v_stride_token = p->H * pg->v_stride_head + p2;
            pg->k_stride_page = p->ps * pg->k_stride_token + p3;
            pg->v_stride_page = p->ps * pg->v_stride_token + p3;
        } else {
            pg->k_stride_token = p->dqk + p1;
            pg->v_stride_token = p->dvo + p1;
            pg->k_stride_head = p->ps * pg->k_stride_token + p2;
            pg->v_stride_head = p->ps * pg->v_stride_token + p2;
            pg->k_stride_page = p->H * pg->k_stride_head + p3;
            pg->v_stride_page = p->H * pg->v_stride_head + p3;
        }
    }
    p->kp = h_buf_alloc(p->pdt, (size_t)(p->alloc_pages * pg->k_stride_page));
    p->vp = h_buf_alloc(p->pdt, (size_t)(p->alloc_pages * pg->v_stride_page));
    fill_rand(&p->kp);
    fill_rand(&p->vp);
    /* tokens: distinct positions of the non-empty requests, shuffled */
    int32_t bis[MAXB * 5], pos[MAXB * 5];
    int64_t n = 0;
    for (int32_t b = 0; b < p->B; ++b) {
        if (p->kv[b] == 0) continue;
        const int32_t m = (int32_t)rr(0, p->kv[b] < 4 ? p->kv[b] : 4);
        int32_t cand[30];
        for (int32_t j = 0; j < p->kv[b]; ++j) cand[j] = j;
        h_rng_shuffle_i32(&T.r, cand, p->kv[b]);
        for (int32_t k = 0; k < m; ++k) {
            bis[n] = b;
            pos[n] = cand[k];
            ++n;
        }
    }
    for (int64_t i = n - 1; i > 0; --i) {
        const int64_t j = rr(0, i);
        int32_t t = bis[i];
        bis[i] = bis[j];
        bis[j] = t;
        t = pos[i];
        pos[i] = pos[j];
        pos[j] = t;
    }
    p->nnz = n;
    p->bi = h_buf_alloc(KVA_DTYPE_I32, (size_t)(n > 0 ? n : 1));
    p->po = h_buf_alloc(KVA_DTYPE_I32, (size_t)(n > 0 ? n : 1));
    memcpy(h_buf_hp(&p->bi), bis, sizeof(int32_t) * (size_t)n);
    memcpy(h_buf_hp(&p->po), pos, sizeof(int32_t) * (size_t)n);
    const int64_t ks0 = (int64_t)p->H * p->dqk + (pct(30) ? rr(1, 5) : 0), vs0 = (int64_t)p->H * p->dvo + (pct(30) ? rr(1, 5) : 0);
    p->ak = h_buf_alloc(p->adt, (size_t)((n + 2) * ks0)); /* (two rows more than the view: a larger nnz stays inside) */
    p->av = h_buf_alloc(p->adt, (size_t)((n + 2) * vs0));
    fill_rand(&p->ak);
    fill_rand(&p->av);
    p->ipd = h_buf_alloc(KVA_DTYPE_I32, (size_t)p->B + 1);
    p->lpd = h_buf_alloc(KVA_DTYPE_I32, (size_t)p->B);
    memcpy(h_buf_hp(&p->ipd), p->ip, sizeof(int32_t) * ((size_t)p->B + 1));
    memcpy(h_buf_hp(&p->lpd), p->last, sizeof(int32_t) * (size_t)p->B);
    h_buf* all[] = {&p->kp, &p->vp, &p->ak, &p->av, &p->bi, &p->po, &p->idx, &p->ipd, &p->lpd};
    const char* names[] = {"K pool", "V pool", "append_k", "append_v", "batch_indices", "positions", "page table",
                           "indptr", "last_page_len"};
    for (int i = 0; i < 9; ++i) {
        h_buf_upload(all[i]);
        reg(all[i], names[i]);
    }
    pg->k_data = h_buf_dp(&p->kp);
    pg->v_data = h_buf_dp(&p->vp);
    pg->indices = (const int32_t*)h_buf_dp(&p->idx);
    pg->indptr = (const int32_t*)h_buf_dp(&p->ipd);
    pg->last_page_len = (const int32_t*)h_buf_dp(&p->lpd);
    pg->num_indices = pct(50) ? p->nidx : 0;
    p->tk = kva_tensor_make(h_buf_dp(&p->ak), p->adt, 3, n, p->H, p->dqk, 0);
    p->tk.stride[0] = ks0;
    p->tv = kva_tensor_make(h_buf_dp(&p->av), p->adt, 3, n, p->H, p->dvo, 0);
    p->tv.stride[0] = vs0;
    p->ctx = g_ctx;
    p->ctk = p->tk;
    p->ctv = p->tv;
    p->cpg = p->pg;
    p->cnnz = n;
    p->cB = p->B;
    /* the slot form: the same tokens by slot (drawn last: the draws above stay as they were) */
    p->slot_form = pct(30);
    p->sl = h_buf_alloc(KVA_DTYPE_I32, (size_t)(2 * (n > 0 ? n : 1)));
    for (int64_t i = 0; i < n; ++i) {
        const int64_t sl = (int64_t)ix[p->ip[bis[i]] + pos[i] / p->ps] * p->ps + pos[i] % p->ps;
        memcpy((char*)h_buf_hp(&p->sl) + 8 * i, &sl, 8);
    }
    h_buf_upload(&p->sl);
    reg(&p->sl, "slots");
    snprintf(T.fix, sizeof T.fix,
             "%sB=%d kv=[%d %d %d %d %d] nnz=%lld H=%d dqk=%d dvo=%d pool=%s append=%s ps=%d %s pages=%lld entries=%lld "
             "num_indices=%lld strides k=%lld/%lld/%lld",
             p->slot_form ? "by slot: " : "", p->B, p->kv[0], p->kv[1], p->kv[2], p->kv[3], p->kv[4], (long long)n, p->H, p->dqk, p->dvo,
             h_dtype_str(p->pdt), h_dtype_str(p->adt), p->ps, layout == KVA_LAYOUT_NHD ? "NHD" : "HND",
             (long long)p->num_pages, (long long)p->entries, (long long)pg->num_indices, (long long)pg->k_stride_page,
             (long long)pg->k_stride_token, (long long)pg->k_stride_head);
}

/* host-side mutations: refused for certain when the call has tokens (need_nnz) */
static mut* app_host(const char* name, unsigned errs, int must, int need_nnz, const char* fmt, ...) H_PRINTF(5, 6);
static mut* app_host(const char* name, unsigned errs, int must, int need_nnz, const char* fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    mut* m = add_v(name, errs | (must ? 0 : S_OK), 0, must ? 1 : 0, fmt, ap);
    va_end(ap);
    m->need_nnz = need_nnz;
    m->host = 1;
    return m;
}
/* backend-data mutations: judged by the model (CPU: refused with the model's status; device: OK and faults) */
static mut* app_data(const char* name, const char* fmt, ...) H_PRINTF(2, 3);
static mut* app_data(const char* name, const char* fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    mut* m = add_v(name, g_dev ? S_OK : S_OK | S_INV | S_MAL | S_PIR, 0, 0, fmt, ap);
    va_end(ap);
    return m;
}

static int pm_call(void) {
    switch (rr(0, 3)) {
    case 0:
        P.ctx = NULL;
        app_host("append context NULL", S_INV, 1, 0, "context = NULL");
        return 1;
    case 1:
        P.pg_null = 1;
        app_host("append paged NULL", S_INV, 1, 0, "paged = NULL");
        return 1;
    case 2: {
        static const int32_t v[] = {-1, INT32_MIN};
        if (P.cB != P.B || P.slot_form) return 0; /* (the slot form has no batch_size) */
        P.cB = PICK(v);
        app_host("append batch_size negative", S_INV, 1, 0, "batch_size = %d", P.cB);
        return 1;
    }
    default:
        if (pct(50)) P.tk_null = 1;
        else P.tv_null = 1;
        app_host("append tensor descriptor NULL", S_INV, 1, 1, "%s = NULL", P.tk_null ? "append_k" : "append_v");
        return 1;
    }
}

static int pm_nnz(void) {
    switch (rr(0, 2)) {
    case 0: {
        static const int64_t v[] = {-1, INT64_MIN};
        P.cnnz = PICK(v);
        app_host("append nnz negative", S_INV, 1, 0, "nnz = %lld", (long long)P.cnnz);
        return 1;
    }
    case 1:
        P.cnnz = P.nnz + rr(1, 2);
        app_host("append nnz larger than append_k", S_INV, 1, 0, "nnz = %lld (append_k has %lld rows)", (long long)P.cnnz,
                 (long long)P.nnz);
        return 1;
    default:
        if (P.nnz == 0) return 0;
        P.cnnz = pct(40) ? 0 : rr(0, P.nnz - 1);
        if (P.cnnz == 0) add("append nnz 0 (valid)", S_OK, 0, 0, "nnz = 0");
        else app_host("append nnz smaller than append_k", S_INV, 1, 0, "nnz = %lld (append_k has %lld rows)",
                      (long long)P.cnnz, (long long)P.nnz);
        return 1;
    }
}

static int pm_ptr(void) {
    if (P.slot_form) {
        const int k = (int)rr(0, 6);
        if (k == 5) {
            P.cpg.k_data = NULL;
            app_host("append paged k_data NULL", S_INV, 1, 1, "paged.k_data = NULL");
            return 1;
        }
        if (k == 6) {
            P.cpg.v_data = NULL;
            app_host("append paged v_data NULL", S_INV, 1, 1, "paged.v_data = NULL");
            return 1;
        }
        if (k == 0) {
            P.sl_null = 1;
            app_host("append slots NULL", S_INV, 1, 1, "slots = NULL");
            return 1;
        }
        /* the table form's arguments are not read by the slot form: NULL is valid */
        if (k == 1) P.bi_null = 1, P.po_null = 1;
        if (k == 2) P.cpg.indices = NULL;
        if (k == 3) P.cpg.indptr = NULL;
        if (k == 4) P.cpg.last_page_len = NULL;
        add("append by slot: a table-form pointer NULL (valid)", S_OK, 0, 0, "%s = NULL",
            k == 1 ? "batch_indices, positions" : k == 2 ? "paged.indices" : k == 3 ? "paged.indptr" : "paged.last_page_len");
        return 1;
    }
    switch (rr(0, 6)) {
    case 0: P.bi_null = 1; app_host("append batch_indices NULL", S_INV, 1, 1, "batch_indices = NULL"); return 1;
    case 1: P.po_null = 1; app_host("append positions NULL", S_INV, 1, 1, "positions = NULL"); return 1;
    case 2: P.cpg.indices = NULL; app_host("append paged indices NULL", S_INV, 1, 1, "paged.indices = NULL"); return 1;
    case 3: P.cpg.indptr = NULL; app_host("append paged indptr NULL", S_INV, 1, 1, "paged.indptr = NULL"); return 1;
    case 4: P.cpg.last_page_len = NULL; app_host("append paged last_page_len NULL", S_INV, 1, 1, "paged.last_page_len = NULL"); return 1;
    case 5: P.cpg.k_data = NULL; app_host("append paged k_data NULL", S_INV, 1, 1, "paged.k_data = NULL"); return 1;
    default: P.cpg.v_data = NULL; app_host("append paged v_data NULL", S_INV, 1, 1, "paged.v_data = NULL"); return 1;
    }
}

static int pm_geom(void) {
    kva_paged_kv* g = &P.cpg;
    switch (rr(0, 5)) {
    case 0: {
        static const int32_t v[] = {0, -1, INT32_MIN};
        g->page_size = PICK(v);
        app_host("append page_size < 1", S_INV, 1, 1, "paged.page_size = %d", g->page_size);
        return 1;
    }
    case 1: {
        static const int64_t v[] = {0, -1, INT64_MIN};
        g->num_pages = PICK(v);
        app_host("append num_pages < 1", S_INV, 1, 1, "paged.num_pages = %lld", (long long)g->num_pages);
        return 1;
    }
    case 2: {
        static const int32_t v[] = {0, -1, 1, 2, 5};
        const int32_t nv = PICK(v);
        if (nv == g->num_heads) return 0;
        g->num_heads = nv;
        app_host("append num_heads", S_INV, 1, 1, "paged.num_heads = %d (append_k has %d)", nv, P.H);
        return 1;
    }
    case 3: {
        int32_t* f = pct(50) ? &g->head_dim_qk : &g->head_dim_vo;
        const int32_t nv = pct(50) ? (int32_t)rr(-1, 0) : *f + (int32_t)rr(1, 3);
        *f = nv;
        app_host("append head dims", S_INV, 1, 1, "paged head dims %d / %d (append %d / %d)", g->head_dim_qk,
                 g->head_dim_vo, P.dqk, P.dvo);
        return 1;
    }
    case 4: {
        static const kva_dtype v[] = {KVA_DTYPE_I32, KVA_DTYPE_U8, (kva_dtype)42};
        g->dtype = PICK(v);
        app_host("append pool dtype", S_UNS | S_INV, 1, 1, "paged.dtype = %d", (int)g->dtype);
        return 1;
    }
    default: {
        static const int64_t v[] = {-1, INT64_MIN};
        g->num_indices = PICK(v);
        app_host("append num_indices negative", S_INV, 1, 1, "paged.num_indices = %lld", (long long)g->num_indices);
        return 1;
    }
    }
}

static int pm_stride(void) {
    kva_paged_kv* g = &P.cpg;
    int64_t* s[6] = {&g->k_stride_page, &g->k_stride_token, &g->k_stride_head,
                     &g->v_stride_page, &g->v_stride_token, &g->v_stride_head};
    const int i = (int)rr(0, 5);
    const int64_t old = *s[i];
    if (pct(50)) {
        static const int64_t v[] = {-1, -7, INT64_MIN};
        *s[i] = PICK(v);
        app_host("append pool stride negative", S_INV, 1, 1, "paged stride %d = %lld", i, (long long)*s[i]);
    } else {
        const int64_t es = (int64_t)ref_dtype_size(g->dtype) > 0 ? (int64_t)ref_dtype_size(g->dtype) : 4;
        const int64_t v[] = {INT64_MAX, INT64_MAX / es, es > 1 ? INT64_MAX / es + rr(1, 1000) : INT64_MAX};
        *s[i] = PICK(v);
        const int64_t span = i % 3 == 0 ? g->num_pages - 1 : i % 3 == 1 ? g->page_size - 1 : g->num_heads - 1;
        app_host("append pool stride huge", S_INV, span > 0, 1, "paged stride %d = %lld (was %lld, span %lld)", i,
                 (long long)*s[i], (long long)old, (long long)span);
    }
    return 1;
}

static int pm_tensor(int v) {
    tspec s;
    memset(&s, 0, sizeof s);
    s.name = v ? "append_v" : "append_k";
    s.stage = 0;
    s.checked = 1;
    s.mm = S_INV;
    s.badtype = v ? S_INV : S_UNS | S_INV;
    s.extra = g_dev ? S_ALN : 0;
    s.overlap_ok = 1;
    const int before = T.nm;
    if (!mut_tensor(v ? &P.ctv : &P.ctk, &s)) return 0;
    if (T.nm > before) {
        T.m[T.nm - 1].need_nnz = 1;
        T.m[T.nm - 1].host = 1;
    }
    return 1;
}
static int pm_tk(void) { return pm_tensor(0); }
static int pm_tv(void) { return pm_tensor(1); }

static int pm_data(void) { /* batch indices, positions, last_page_len (one of them: a bad last and a bad position could
                              send a device's lookup past the table) */
    int32_t* bi = (int32_t*)h_buf_hp(&P.bi);
    int32_t* po = (int32_t*)h_buf_hp(&P.po);
    int32_t* lp = (int32_t*)h_buf_hp(&P.lpd);
    switch (rr(0, 4)) {
    case 0: {
        if (P.nnz == 0) return 0;
        const int64_t i = rr(0, P.nnz - 1);
        const int32_t v[] = {-1, P.B, P.B + (int32_t)rr(1, 5), INT32_MAX, INT32_MIN};
        const int32_t old = bi[i];
        bi[i] = PICK(v);
        h_buf_upload(&P.bi);
        app_data("append batch index out of range", "batch_indices[%lld] = %d (was %d)", (long long)i, bi[i], old);
        return 1;
    }
    case 1: {
        if (P.nnz == 0) return 0;
        const int64_t i = rr(0, P.nnz - 1);
        const int32_t old = bi[i];
        bi[i] = (int32_t)rr(0, P.B - 1);
        h_buf_upload(&P.bi);
        app_data("append batch index changed", "batch_indices[%lld] = %d (was %d; position %d)", (long long)i, bi[i], old,
                 po[i]);
        return 1;
    }
    case 2: {
        if (P.nnz == 0) return 0;
        const int64_t i = rr(0, P.nnz - 1);
        const int32_t len = P.kv[bi[i]];
        const int32_t v[] = {-1, len, len + (int32_t)rr(1, 5), INT32_MAX, INT32_MIN, (int32_t)rr(0, len - 1)};
        const int32_t old = po[i];
        po[i] = PICK(v);
        h_buf_upload(&P.po);
        app_data("append position changed", "positions[%lld] = %d (was %d; request %d of %d tokens)", (long long)i, po[i],
                 old, bi[i], len);
        return 1;
    }
    case 3: {
        const int b = (int)rr(0, P.B - 1);
        if (P.kv[b] == 0) return 0;
        const int32_t v[] = {0, -1, P.ps + 1, INT32_MAX, INT32_MIN};
        const int32_t old = lp[b];
        lp[b] = PICK(v);
        h_buf_upload(&P.lpd);
        app_data("append last_page_len out of range", "last_page_len[%d] = %d (was %d, page size %d)", b, lp[b], old, P.ps);
        return 1;
    }
    default: {
        const int b = (int)rr(0, P.B - 1);
        if (P.kv[b] == 0 || P.ps < 2) return 0;
        const int32_t old = lp[b];
        lp[b] = (int32_t)rr(1, P.ps);
        if (lp[b] == old) return 0;
        h_buf_upload(&P.lpd);
        app_data("append last_page_len changed", "last_page_len[%d] = %d (was %d)", b, lp[b], old);
        return 1;
    }
    }
}

static int pm_table(void) {
    int32_t* ip = (int32_t*)h_buf_hp(&P.ipd);
    int32_t* ix = (int32_t*)h_buf_hp(&P.idx);
    switch (rr(0, 7)) {
    case 0: {
        if (P.entries == 0) return 0;
        const int64_t e = rr(0, P.entries - 1);
        const int64_t v[] = {-1, P.num_pages, P.alloc_pages - 1, INT32_MAX, INT32_MIN, rr(0, P.num_pages - 1)};
        const int32_t old = ix[e];
        ix[e] = (int32_t)PICK(v);
        h_buf_upload(&P.idx);
        app_data("append page table entry", "indices[%lld] = %d (was %d, pool of %lld)", (long long)e, ix[e], old,
                 (long long)P.num_pages);
        return 1;
    }
    case 1:
        ip[0] = -(int32_t)rr(1, 5);
        h_buf_upload(&P.ipd);
        app_data("append indptr[0] negative", "indptr[0] = %d", ip[0]);
        return 1;
    case 2: {
        const int j = (int)rr(1, P.B);
        ip[j] = ip[j - 1] - (int32_t)rr(1, 3);
        h_buf_upload(&P.ipd);
        app_data("append indptr decreasing", "indptr[%d] = %d < indptr[%d] = %d", j, ip[j], j - 1, ip[j - 1]);
        return 1;
    }
    case 3: { /* offsets into the table (FlashInfer reads them as such): valid where the table holds them */
        const int32_t k = (int32_t)rr(1, SPARE);
        for (int32_t b = 0; b <= P.B; ++b) ip[b] += k;
        h_buf_upload(&P.ipd);
        app_data("append indptr shifted", "indptr += %d (the table has %lld entries)", k, (long long)P.nidx);
        return 1;
    }
    case 4:
        ip[P.B] = (int32_t)P.nidx + (int32_t)rr(1, 5);
        P.cpg.num_indices = P.nidx;
        h_buf_upload(&P.ipd);
        app_data("append indptr[B] past num_indices", "indptr[%d] = %d, num_indices = %lld", P.B, ip[P.B], (long long)P.nidx);
        return 1;
    case 5:
        if (P.entries < 2) return 0;
        P.cpg.num_indices = rr(1, P.entries - 1);
        app_data("append num_indices short", "paged.num_indices = %lld (indptr[B] = %lld)", (long long)P.cpg.num_indices,
                 (long long)P.entries);
        return 1;
    case 6:
        if (P.cB != P.B) return 0;
        P.cB = (int32_t)rr(0, P.B - 1);
        app_data("append batch_size smaller", "batch_size = %d (was %d)", P.cB, P.B);
        return 1;
    default:
        if (pct(50)) {
            if (P.ps < 2) return 0;
            P.cpg.page_size = (int32_t)rr(1, P.ps - 1);
            app_data("append page_size smaller", "paged.page_size = %d (was %d)", P.cpg.page_size, P.ps);
        } else {
            if (P.num_pages < 2) return 0;
            P.cpg.num_pages = rr(1, P.num_pages - 1);
            app_data("append num_pages smaller", "paged.num_pages = %lld (was %lld)", (long long)P.cpg.num_pages,
                     (long long)P.num_pages);
        }
        return 1;
    }
}

static int pm_slots(void) { /* the slot form's slots (backend data) */
    if (!P.slot_form || P.nnz == 0) return 0;
    int64_t* sl = (int64_t*)h_buf_hp(&P.sl);
    const int64_t i = rr(0, P.nnz - 1), old = sl[i], cap = P.num_pages * P.ps;
    switch (rr(0, 2)) {
    case 0: {
        const int64_t v[] = {cap, cap + rr(1, 2 * P.ps), (int64_t)P.alloc_pages * P.ps - 1, INT64_C(1) << 40, INT64_MAX};
        sl[i] = PICK(v);
        app_data("append slot past the pool", "slots[%lld] = %lld (was %lld; pool of %lld slots)", (long long)i,
                 (long long)sl[i], (long long)old, (long long)cap);
        break;
    }
    case 1: {
        const int64_t v[] = {-1, -(int64_t)rr(2, 1000), INT64_MIN, -cap};
        sl[i] = PICK(v);
        add("append slot negative (padding, valid)", S_OK, 0, 0, "slots[%lld] = %lld (was %lld)", (long long)i,
            (long long)sl[i], (long long)old);
        break;
    }
    default: { /* another slot of the pool that no token uses */
        int64_t nv = -1;
        for (int t = 0; t < 8 && nv < 0; ++t) {
            nv = rr(0, cap - 1);
            for (int64_t j = 0; j < P.nnz; ++j)
                if (sl[j] == nv) nv = -1;
        }
        if (nv < 0) return 0;
        sl[i] = nv;
        add("append slot changed (valid)", S_OK, 0, 0, "slots[%lld] = %lld (was %lld)", (long long)i, (long long)nv,
            (long long)old);
        break;
    }
    }
    h_buf_upload(&P.sl);
    return 1;
}

static const mdef app_defs[] = {
    {"slots", FB(F_APP), GA_SLOT, 0, pm_slots},
    {"call", FB(F_APP), GA_CALL, 0, pm_call},
    {"nnz", FB(F_APP), GA_NNZ, GA_TK | GA_TV, pm_nnz},
    {"pointers", FB(F_APP), GA_PTR, 0, pm_ptr},
    {"geometry", FB(F_APP), GA_GEOM, GA_STRIDE | GA_TABLE | GA_TK | GA_TV, pm_geom}, /* (a pool head dim and an append_k
                                                                                    shape mutated alike would agree) */
    {"pool strides", FB(F_APP), GA_STRIDE, GA_GEOM | GA_TABLE, pm_stride},
    {"append_k", FB(F_APP), GA_TK, GA_NNZ | GA_TV, pm_tk}, /* (one of them: both in another dtype would be valid) */
    {"append_v", FB(F_APP), GA_TV, GA_NNZ | GA_TK, pm_tv},
    {"data", FB(F_APP), GA_DATA, 0, pm_data},
    {"data", FB(F_APP), GA_DATA, 0, pm_data},
    {"table", FB(F_APP), GA_TABLE, GA_GEOM | GA_STRIDE, pm_table},
    {"table", FB(F_APP), GA_TABLE, GA_GEOM | GA_STRIDE, pm_table},
};

/* The host-side checks of the contract (kva_append_paged_kv_cache): NULL if the call's host arguments are valid. */
static const char* app_host_model(char* why, size_t n) {
    const app* p = &P;
    const kva_paged_kv* g = &p->cpg;
    if (!p->ctx) BAD("append: context NULL");
    if (p->pg_null) BAD("append: paged NULL");
    if (p->cnnz < 0) BAD("append: nnz negative");
    if (p->cB < 0 && !p->slot_form) BAD("append: batch_size negative");
    if (p->cnnz == 0) return NULL;
    if (p->slot_form) {
        if (p->sl_null) BAD("append: slots NULL");
    } else {
        if (p->bi_null || p->po_null) BAD("append: batch_indices / positions NULL");
        if (!g->indices || !g->indptr || !g->last_page_len) BAD("append: page table NULL");
    }
    if (!g->k_data || !g->v_data) BAD("append: pools NULL");
    if (g->page_size < 1 || g->num_pages < 1 || g->num_heads < 1 || g->head_dim_qk < 1 || g->head_dim_vo < 1)
        BAD("append: pool geometry");
    if (g->num_indices < 0) BAD("append: num_indices negative");
    if (g->k_stride_page < 0 || g->k_stride_token < 0 || g->k_stride_head < 0 || g->v_stride_page < 0 ||
        g->v_stride_token < 0 || g->v_stride_head < 0)
        BAD("append: pool stride negative");
    if (!paged_extent_ok(g)) BAD("append: pool strides address beyond 2^63 bytes");
    if (p->tk_null || p->tv_null || !p->ctk.data || !p->ctv.data) BAD("append: append_k / append_v NULL");
    if (!is_float_dt(p->ctk.dtype) && p->ctk.dtype != g->dtype) BAD("append: append_k dtype");
    if (!is_float_dt(g->dtype) && g->dtype != E4M3 && g->dtype != E5M2) BAD("append: pool dtype");
    const int64_t ks[3] = {p->cnnz, g->num_heads, g->head_dim_qk}, vs[3] = {p->cnnz, g->num_heads, g->head_dim_vo};
    const char* r;
    if ((r = model_tensor(why, n, "append_k", &p->ctk, p->ctk.dtype, 3, ks, 0))) return r;
    if ((r = model_tensor(why, n, "append_v", &p->ctv, p->ctk.dtype, 3, vs, 0))) return r;
    return NULL;
}

/* The backend-data model. CPU: the status the call must return (KVA_OK: no violation); device: KVA_OK, and the first
 * bad token (*bad_tok, *bad_page; -1: none). Fills the expected writes (element positions in the pools and values). */
typedef struct wlist {
    int64_t* pos;
    double* val;
    int64_t n, cap;
} wlist;

static void wl_push(wlist* w, int64_t pos, double v) {
    if (w->n == w->cap) {
        w->cap = w->cap ? 2 * w->cap : 256;
        w->pos = (int64_t*)realloc(w->pos, sizeof(int64_t) * (size_t)w->cap);
        w->val = (double*)realloc(w->val, sizeof(double) * (size_t)w->cap);
        if (!w->pos || !w->val) {
            printf("FATAL: out of memory\n");
            exit(3);
        }
    }
    w->pos[w->n] = pos;
    w->val[w->n] = v;
    ++w->n;
}

static kva_status app_data_model(wlist* wk, wlist* wv, int64_t* bad_tok, int64_t* bad_page, int* testbug) {
    const app* p = &P;
    const kva_paged_kv* g = &p->cpg;
    view ipv, lpv, ixv, biv, pov, akv, avv, kpv, vpv;
    resolve(g->indptr, &ipv);
    resolve(g->last_page_len, &lpv);
    resolve(g->indices, &ixv);
    resolve(h_buf_dp(&p->bi), &biv);
    resolve(h_buf_dp(&p->po), &pov);
    resolve(p->ctk.data, &akv);
    resolve(p->ctv.data, &avv);
    resolve(g->k_data, &kpv);
    resolve(g->v_data, &vpv);
    const int32_t B = p->cB, ps = g->page_size;
    *bad_tok = -1;
    *bad_page = -1;
    *testbug = 0;
    int64_t* tpage = (int64_t*)xcalloc((size_t)(p->cnnz > 0 ? p->cnnz : 1), sizeof(int64_t));
    int64_t* tslot = (int64_t*)xcalloc((size_t)(p->cnnz > 0 ? p->cnnz : 1), sizeof(int64_t));
    if (p->slot_form) {
        const int64_t* sl = (const int64_t*)h_buf_hp(&p->sl);
        for (int64_t i = 0; i < p->cnnz; ++i) {
            tpage[i] = -1;
            if (sl[i] < 0) continue; /* padding */
            const int64_t page = sl[i] / ps;
            if (page >= g->num_pages) {
                if (!g_dev) {
                    free(tpage);
                    free(tslot);
                    return KVA_ERR_PAGE_INDEX_OUT_OF_RANGE;
                }
                if (*bad_tok < 0) {
                    *bad_tok = i;
                    *bad_page = page > INT32_MAX ? INT32_MAX : page;
                }
                continue;
            }
            tpage[i] = page;
            tslot[i] = sl[i] % ps;
        }
    } else {
        int32_t ip[MAXB + 1] = {0}, lp[MAXB] = {0};
        for (int32_t b = 0; b <= B; ++b) rd_i32(&ipv, b, &ip[b]);
        for (int32_t b = 0; b < B; ++b) rd_i32(&lpv, b, &lp[b]);
        if (!g_dev) {
            int mal = ip[0] < 0 || (g->num_indices > 0 && ip[B] > g->num_indices);
            for (int32_t b = 0; b < B; ++b)
                mal |= ip[b + 1] < ip[b] || (ip[b + 1] > ip[b] && (lp[b] < 1 || lp[b] > ps));
            if (mal) {
                free(tpage);
                free(tslot);
                return KVA_ERR_PAGETABLE_MALFORMED;
            }
        }
        for (int64_t i = 0; i < p->cnnz; ++i) {
            int32_t b = 0, pos = 0, page = -1;
            rd_i32(&biv, i, &b);
            rd_i32(&pov, i, &pos);
            int ok = b >= 0 && b < B;
            if (!ok && !g_dev) {
                free(tpage);
                free(tslot);
                return KVA_ERR_INVALID_ARGUMENT;
            }
            int64_t len = 0;
            if (ok) {
                const int table_ok = !g_dev || (ip[b] >= 0 && ip[b + 1] >= ip[b] && (g->num_indices == 0 || ip[b + 1] <= g->num_indices));
                const int64_t np = table_ok ? (int64_t)ip[b + 1] - ip[b] : 0;
                /* a device refuses every token of a request whose last_page_len is outside [1, page_size] (the host
                   refused the call above) */
                len = np > 0 && lp[b] >= 1 && lp[b] <= ps ? (np - 1) * ps + lp[b] : 0;
                ok = pos >= 0 && pos < len;
            }
            if (ok) {
                const int64_t entry = (int64_t)ip[b] + pos / ps;
                if (!rd_i32(&ixv, entry, &page)) {
                    *testbug = 1; /* the model would read past the table: a test bug */
                    free(tpage);
                    free(tslot);
                    return KVA_OK;
                }
                ok = page >= 0 && page < g->num_pages;
            }
            if (!ok) {
                if (!g_dev) {
                    free(tpage);
                    free(tslot);
                    return KVA_ERR_PAGE_INDEX_OUT_OF_RANGE;
                }
                if (*bad_tok < 0) {
                    *bad_tok = i;
                    *bad_page = page;
                }
                tpage[i] = -1;
                continue;
            }
            tpage[i] = page;
            tslot[i] = pos % ps;
        }
    }
    /* the writes of the valid tokens */
    const int64_t kb0 = kpv.off / (int64_t)ref_dtype_size(g->dtype), vb0 = vpv.off / (int64_t)ref_dtype_size(g->dtype);
    for (int64_t i = 0; i < p->cnnz; ++i) {
        if (tpage[i] < 0) continue;
        const int64_t slot = tslot[i], page = tpage[i];
        for (int32_t h = 0; h < g->num_heads; ++h) {
            for (int32_t c = 0; c < g->head_dim_qk; ++c) {
                double x = 0;
                if (!vget(&akv, p->ctk.dtype, i * p->ctk.stride[0] + h * p->ctk.stride[1] + c * p->ctk.stride[2], &x)) *testbug = 1;
                wl_push(wk, kb0 + page * g->k_stride_page + slot * g->k_stride_token + h * g->k_stride_head + c,
                        ref_round(g->dtype, x));
            }
            for (int32_t c = 0; c < g->head_dim_vo; ++c) {
                double x = 0;
                if (!vget(&avv, p->ctv.dtype, i * p->ctv.stride[0] + h * p->ctv.stride[1] + c * p->ctv.stride[2], &x)) *testbug = 1;
                wl_push(wv, vb0 + page * g->v_stride_page + slot * g->v_stride_token + h * g->v_stride_head + c,
                        ref_round(g->dtype, x));
            }
        }
    }
    free(tpage);
    free(tslot);
    return KVA_OK;
}

static h_tol round_tol(kva_dtype src, kva_dtype dst) {
    if (src == dst) return (h_tol){0.0, 0.0}; /* a byte copy */
    switch (dst) { /* one unit in the last place (a tie rounded the other way) */
    case F32: return (h_tol){1e-44, ldexp(1.0, -23)};
    case F16: return (h_tol){ldexp(1.0, -24), ldexp(1.0, -10)};
    case BF16: return (h_tol){1e-39, ldexp(1.0, -7)};
    case E4M3: return (h_tol){ldexp(1.0, -9), ldexp(1.0, -3)};
    default: return (h_tol){ldexp(1.0, -16), ldexp(1.0, -2)};
    }
}

static void app_case(void) {
    app* p = &P;
    char why[300];
    if (p->cnnz <= 0) /* the call returns before it looks at anything else */
        for (int i = 0; i < T.nm; ++i)
            if (T.m[i].need_nnz) {
                T.m[i].must = 0;
                T.m[i].mask[0] |= S_OK;
            }
    if (g_dev) {
        kva_fault_report rep;
        kva_read_faults(g_ctx, &g_fws.ws, &rep, NULL);
    }
    snap_all();
    kva_clear_last_error();
    const kva_status st =
        p->slot_form
            ? kva_append_paged_kv_cache_by_slot(p->ctx, p->tk_null ? NULL : &p->ctk, p->tv_null ? NULL : &p->ctv,
                                                p->sl_null ? NULL : (const int64_t*)h_buf_dp(&p->sl), p->cnnz,
                                                p->pg_null ? NULL : &p->cpg, NULL)
            : kva_append_paged_kv_cache(p->ctx, p->tk_null ? NULL : &p->ctk, p->tv_null ? NULL : &p->ctv,
                                        p->bi_null ? NULL : (const int32_t*)h_buf_dp(&p->bi),
                                        p->po_null ? NULL : (const int32_t*)h_buf_dp(&p->po), p->cnnz,
                                        p->pg_null ? NULL : &p->cpg, p->cB, NULL);
    verdict(0, st, "append");
    const char* hbad = app_host_model(why, sizeof why);
    if (st != KVA_OK) {
        check_refused(st, "append", NULL, 0);
        if (!hbad && p->cnnz > 0) {
            wlist wk = {0}, wv = {0};
            int64_t bt, bp;
            int tb;
            const kva_status want = app_data_model(&wk, &wv, &bt, &bp, &tb);
            if (!tb && want != st)
                cfail("append refused valid host arguments with %s; the page table and tokens call for %s",
                      kva_status_string(st), kva_status_string(want));
            free(wk.pos);
            free(wk.val);
            free(wv.pos);
            free(wv.val);
        }
        return;
    }
    if (hbad) {
        cfail("append accepted invalid inputs: %s", hbad);
        return;
    }
    wlist wk = {0}, wv = {0};
    int64_t bt = -1, bp = -1;
    int tb = 0;
    kva_status want = KVA_OK;
    if (p->cnnz > 0) want = app_data_model(&wk, &wv, &bt, &bp, &tb);
    if (tb) {
        cfail("test bug: the append model reads outside its buffers");
    } else if (want != KVA_OK) {
        cfail("append accepted tokens the page table refuses (%s expected)", kva_status_string(want));
    } else {
        const h_tol tk = round_tol(p->ctk.dtype, p->cpg.dtype), tv = round_tol(p->ctv.dtype, p->cpg.dtype);
        view kv_, vv_;
        if (p->cnnz > 0 && resolve(p->cpg.k_data, &kv_) && resolve(p->cpg.v_data, &vv_)) {
            check_out(kv_.bi, p->cpg.dtype, wk.pos, wk.val, NULL, wk.n, tk, "K pool");
            check_out(vv_.bi, p->cpg.dtype, wv.pos, wv.val, NULL, wv.n, tv, "V pool");
        }
        h_buf* skip[2] = {&p->kp, &p->vp};
        const char* w = changed(skip, p->cnnz > 0 ? 2 : 0);
        if (w) cfail("append modified %s", w);
        if (g_dev) {
            kva_fault_report rep;
            memset(&rep, 0, sizeof rep);
            const kva_status s = kva_read_faults(g_ctx, &g_fws.ws, &rep, NULL);
            if (s != KVA_OK || (bt >= 0) != (rep.faulted != 0) || (bt >= 0 && (rep.request != bt || rep.page_index != bp)))
                cfail("append fault report: %s, faulted %d, token %d, page %lld (expected %s token %lld page %lld)",
                      kva_status_string(s), rep.faulted, rep.request, (long long)rep.page_index,
                      bt >= 0 ? "a fault at" : "none;", (long long)bt, (long long)bp);
        }
    }
    free(wk.pos);
    free(wk.val);
    free(wv.pos);
    free(wv.val);
}

/* ============================================================================================== */
/* Attention states: merge_state, merge_state_in_place, merge_states                               */

typedef struct mrg {
    int64_t R, H, D, total;
    int32_t ip[MAXB + 3];
    h_buf va, sa, vb, sb, vo, so, mk;
    /* the call as mutated: tensors 0..5 = v_a, s_a, v_b, s_b, v_out, s_out (in place: v, s, v_other, s_other;
       merge_states: v, s, -, -, v_out, s_out) */
    kva_context* ctx;
    kva_tensor t[6];
    int tnull[6];
    int mask_on, ip_null, alias;
    int tmut[6]; /* tensor k was mutated */
    int32_t cip[MAXB + 3];
    int64_t crows;
} mrg;

static mrg M;
static const char* const mt_names[6] = {"v_a", "s_a", "v_b", "s_b", "v_out", "s_out"};

static void mrg_build(void) {
    mrg* m = &M;
    memset(m, 0, sizeof *m);
    static const int64_t dims[] = {1, 2, 3, 8, 16, 33, 64, 128};
    static const kva_dtype fl[] = {F32, F16, BF16};
    m->R = pct(5) ? 0 : rr(1, MAXB + 1);
    m->H = rr(1, 4);
    m->D = pct(10) ? 0 : PICK(dims);
    const int states = T.fam == F_MRGS;
    if (states) {
        for (int64_t r = 0; r < m->R; ++r) m->ip[r + 1] = m->ip[r] + (int32_t)rr(0, 4);
        m->total = m->ip[m->R];
    }
    const int64_t in_rows = states ? m->total : m->R;
    /* v: [rows, H, D] with an optionally padded row stride; s: [rows, H] f32 */
    h_buf* vb[3] = {&m->va, &m->vb, &m->vo};
    h_buf* sb[3] = {&m->sa, &m->sb, &m->so};
    for (int k = 0; k < 3; ++k) {
        if (states && k == 1) continue;
        const int64_t rows = k == 2 ? m->R : in_rows;
        const kva_dtype dt = PICK(fl);
        const int64_t s0 = m->H * m->D + (pct(30) ? h_round_pad(rr(1, 5), dt) : 0);
        *vb[k] = h_buf_alloc(dt, (size_t)(rows * s0));
        *sb[k] = h_buf_alloc(F32, (size_t)(rows * m->H));
        if (k == 2 && T.fam != F_MIP) {
            h_buf_poison(vb[k]);
            h_buf_poison(sb[k]);
        } else {
            fill_rand(vb[k]);
            for (size_t i = 0; i < sb[k]->elems; ++i) h_buf_set(sb[k], i, pct(15) ? -INFINITY : -6.0 + 30.0 * unif());
        }
        h_buf_upload(vb[k]);
        h_buf_upload(sb[k]);
        m->t[2 * k] = kva_tensor_make(h_buf_dp(vb[k]), dt, 3, rows, m->H, m->D, 0);
        m->t[2 * k].stride[0] = s0;
        m->t[2 * k + 1] = kva_tensor_make(h_buf_dp(sb[k]), F32, 2, rows, m->H, 0, 0);
    }
    if (T.fam == F_MIP) {
        m->mk = h_buf_alloc(KVA_DTYPE_U8, (size_t)(m->R > 0 ? m->R : 1));
        for (size_t i = 0; i < m->mk.elems; ++i) ((uint8_t*)h_buf_hp(&m->mk))[i] = (uint8_t)(pct(40) ? 0 : rr(1, 255));
        h_buf_upload(&m->mk);
        m->mask_on = pct(50);
    }
    if (T.fam != F_MIP && pct(30)) m->tnull[5] = 1; /* s_out is optional */
    h_buf* all[7] = {&m->va, &m->sa, &m->vb, &m->sb, &m->vo, &m->so, &m->mk};
    for (int k = 0; k < 7; ++k)
        if (all[k]->host) reg(all[k], k < 6 ? mt_names[k] : "mask");
    m->ctx = g_ctx;
    memcpy(m->cip, m->ip, sizeof m->ip);
    m->crows = m->R;
    snprintf(T.fix, sizeof T.fix, "rows=%lld heads=%lld dim=%lld total=%lld v_a=%s v_b=%s v_out=%s s_out=%d mask=%d",
             (long long)m->R, (long long)m->H, (long long)m->D, (long long)m->total, h_dtype_str(m->t[0].dtype),
             states ? "-" : h_dtype_str(m->t[2].dtype), h_dtype_str(m->t[4].dtype), !m->tnull[5], m->mask_on);
}

static int mm_call(void) {
    const int states = T.fam == F_MRGS, inpl = T.fam == F_MIP;
    switch (rr(0, 2)) {
    case 0:
        M.ctx = NULL;
        addst(0, "merge context NULL", S_INV, 1, "context = NULL");
        return 1;
    case 1: { /* a descriptor NULL */
        const int k = (int)rr(0, 5);
        if (inpl && k >= 4) return 0;
        if (states && (k == 2 || k == 3)) return 0;
        if (M.tnull[k] || M.tmut[k]) return 0;
        M.tnull[k] = 1;
        const int optional = k == 5 || (states && k == 1 && M.total == 0);
        addst(0, "merge tensor NULL", S_INV, !optional, "%s = NULL%s", mt_names[k], optional ? " (optional here)" : "");
        return 1;
    }
    default:
        if (inpl) {
            M.mask_on = !M.mask_on;
            add("merge_state_in_place mask toggled (valid)", S_OK, 0, 0, "mask %s", M.mask_on ? "given" : "NULL");
            return 1;
        }
        if (states) {
            switch (rr(0, 5)) {
            case 0:
                M.ip_null = 1;
                addst(0, "merge_states indptr NULL", S_INV, 1, "indptr = NULL");
                return 1;
            case 1: {
                static const int64_t v[] = {-1, INT64_MIN};
                M.crows = PICK(v);
                addst(0, "merge_states rows negative", S_INV, 1, "rows = %lld", (long long)M.crows);
                return 1;
            }
            case 2:
                M.cip[0] = pct(50) ? 1 : -1;
                addst(0, "merge_states indptr[0] != 0", S_INV, 1, "indptr[0] = %d", M.cip[0]);
                return 1;
            case 3: {
                if (M.R < 1) return 0;
                const int j = (int)rr(1, M.R);
                M.cip[j] = M.cip[j - 1] - (int32_t)rr(1, 3);
                addst(0, "merge_states indptr decreasing", S_INV, 1, "indptr[%d] = %d", j, M.cip[j]);
                return 1;
            }
            case 4:
                if (M.R < 1) return 0;
                M.cip[M.R] += pct(50) ? 1 : -1;
                if (M.cip[M.R] < M.cip[M.R - 1]) {
                    M.cip[M.R] = M.ip[M.R];
                    return 0;
                }
                addst(0, "merge_states indptr[rows] != states", S_INV, 1, "indptr[%lld] = %d (%lld states)", (long long)M.R,
                      M.cip[M.R], (long long)M.total);
                return 1;
            default:
                if (M.R < 1 || M.tmut[4] || M.tmut[5]) return 0; /* (an output of fewer rows would make it valid) */
                M.crows = rr(0, M.R - 1);
                addst(0, "merge_states rows smaller", S_INV, 1, "rows = %lld (v_out has %lld)", (long long)M.crows, (long long)M.R);
                return 1;
            }
        }
        /* merge_state: the output aliases an input (allowed) */
        if (M.tmut[4] || M.tmut[5] || M.tnull[4]) return 0;
        M.alias = pct(50) ? 1 : 2;
        if (M.tmut[2 * M.alias - 2] || M.tmut[2 * M.alias - 1]) { /* an aliased input keeps its own valid view */
            M.alias = 0;
            return 0;
        }
        M.t[4] = M.t[M.alias == 1 ? 0 : 2];
        M.t[5] = M.t[M.alias == 1 ? 1 : 3];
        M.tnull[5] = 0;
        add("merge_state output aliases an input (valid)", S_OK, 0, 0, "v_out, s_out = %s", M.alias == 1 ? "a" : "b");
        return 1;
    }
}

static int mm_empty(void) { /* a v with no elements: any strides (it covers no memory) */
    const int k = 2 * (int)rr(0, 2);
    if (M.D != 0 || M.tnull[k] || M.tmut[k] || (T.fam == F_MRGS && k == 2) || (T.fam == F_MIP && k == 4)) return 0;
    if (M.alias && (k == 4 || k == 2 * (M.alias - 1))) return 0;
    static const int64_t v[] = {0, INT64_MAX, INT64_MAX / 2, (int64_t)1 << 62};
    for (int i = 0; i < 3; ++i) M.t[k].stride[i] = PICK(v);
    M.tmut[k] = 1;
    add("empty state, any strides (valid)", S_OK, 0, 0, "%s (head dim 0): strides %lld %lld %lld", mt_names[k],
        (long long)M.t[k].stride[0], (long long)M.t[k].stride[1], (long long)M.t[k].stride[2]);
    return 1;
}

static int mm_tensor(void) {
    const int states = T.fam == F_MRGS, inpl = T.fam == F_MIP;
    const int k = (int)rr(0, 5);
    if (states && (k == 2 || k == 3)) return 0;
    if (inpl && k >= 4) return 0;
    if (M.tnull[k] || M.tmut[k] || (M.alias && (k >= 4 || k / 2 == M.alias - 1))) return 0;
    if (states && k >= 4 && M.crows != M.R) return 0; /* (rows changed: an output of those rows would be valid) */
    const int is_s = k % 2 == 1;
    const int out = k >= 4 || (inpl && k <= 1);
    const int64_t rows = states && k < 2 ? M.total : M.R;
    const int empty = rows == 0 || M.H == 0 || (!is_s && M.D == 0);
    tspec s;
    memset(&s, 0, sizeof s);
    s.name = mt_names[k];
    s.stage = 0;
    /* checked: a bad view is refused for certain (an empty one may pass: the model judges); s_out: optional */
    s.checked = !empty && !(states && k < 2 && M.total == 0);
    s.out = out;
    s.mm = S_INV;
    s.badtype = is_s ? S_INV : S_UNS;
    s.extra = g_dev ? S_ALN : 0;
    s.overlap_ok = !(inpl && out) && !(k == 0 && M.alias); /* in place: an overlapping v reads what it wrote */
    s.dtype_ok = out && !inpl && !is_s;
    s.null_ok = k == 5;
    kva_tensor* t = &M.t[k];
    const kva_dtype old = t->dtype;
    const int before = T.nm;
    if (!mut_tensor(t, &s)) return 0;
    /* another float dtype of an input would reinterpret its bytes (the contract allows it; the values may be
       NaN): not drawn */
    if (!out && !is_s && t->dtype != old && is_float_dt(t->dtype)) {
        t->dtype = old;
        T.nm = before;
        return 0;
    }
    if (inpl && k == 0 && t->dtype != old && is_float_dt(t->dtype)) { /* v is read and written: the same */
        t->dtype = old;
        T.nm = before;
        return 0;
    }
    M.tmut[k] = 1;
    return 1;
}

static const mdef mrg_defs[] = {
    {"call", FB_MERGE, 1, 0, mm_call},
    {"tensor", FB_MERGE, 2, 0, mm_tensor},
    {"tensor", FB_MERGE, 4, 0, mm_tensor},
    {"tensor", FB_MERGE, 8, 0, mm_tensor},
    {"empty", FB_MERGE, 16, 0, mm_empty},
};

/* kvattn.h's rules for a state (v [rows, heads, dim], s [rows, heads] f32) */
static const char* model_state(char* why, size_t n, const char* name, const kva_tensor* v, const kva_tensor* s,
                               int64_t rows, int64_t heads, int64_t dim, int s_optional, int* has_s) {
    *has_s = 0;
    if (rows < 0 || heads < 0 || dim < 0) BAD("%s: a negative extent", name);
    const int empty = rows == 0 || heads == 0;
    if (!v || (!v->data && !empty && dim > 0)) BAD("%s: v NULL", name);
    if (!is_float_dt(v->dtype)) BAD("%s: v dtype", name);
    const int64_t vs[3] = {rows, heads, dim};
    const char* r = model_tensor(why, n, name, v, v->dtype, 3, vs, 0);
    if (r) return r;
    if (!s || (!s->data && (s_optional || !empty))) {
        if (!s_optional) BAD("%s: s NULL", name);
        return NULL;
    }
    const int64_t ss[2] = {rows, heads};
    *has_s = 1;
    return model_tensor(why, n, name, s, F32, 2, ss, 0);
}

static const char* model_written(char* why, size_t n, const char* name, const kva_tensor* t) {
    for (int i = 0; i < t->ndim && i < KVA_MAX_DIMS; ++i)
        if (t->shape[i] <= 0) return NULL; /* no elements: nothing written */
    for (int i = 0; i < t->ndim && i < KVA_MAX_DIMS; ++i)
        if (t->shape[i] > 1 && t->stride[i] == 0) BAD("%s: broadcast output", name);
    return NULL;
}

typedef struct mref {
    int64_t *vpos, *spos;
    double *vref, *sref;
    int64_t nv, ns;
    int vbi, sbi;
    kva_dtype vdt;
} mref;

static void mref_free(mref* r) {
    free(r->vpos);
    free(r->spos);
    free(r->vref);
    free(r->sref);
}

/* the model of the call (NULL: valid) and, when valid, the expected outputs from the inputs as they are now */
static const char* mrg_model(mref* out, char* why, size_t n) {
    const mrg* m = &M;
    const kva_tensor* t[6];
    for (int k = 0; k < 6; ++k) t[k] = m->tnull[k] ? NULL : &m->t[k];
    memset(out, 0, sizeof *out);
    if (!m->ctx) BAD("merge: context NULL");
    const char* r;
    int hs = 0, hs_out = 0;
    int64_t rows, heads, dim;
    const kva_tensor *vo = NULL, *so = NULL;
    if (T.fam == F_MRG || T.fam == F_MIP) {
        if (!t[0] || t[0]->ndim != 3) BAD("merge: v_a rank");
        rows = t[0]->shape[0];
        heads = t[0]->shape[1];
        dim = t[0]->shape[2];
        if ((r = model_state(why, n, "a", t[0], t[1], rows, heads, dim, 0, &hs))) return r;
        if ((r = model_state(why, n, "b", t[2], t[3], rows, heads, dim, 0, &hs))) return r;
        if (T.fam == F_MRG) {
            if ((r = model_state(why, n, "out", t[4], t[5], rows, heads, dim, 1, &hs_out))) return r;
            vo = t[4];
            so = hs_out ? t[5] : NULL;
        } else {
            vo = t[0];
            so = t[1];
            hs_out = 1;
        }
        if ((r = model_written(why, n, "out v", vo))) return r;
        if (so && (r = model_written(why, n, "out s", so))) return r;
    } else {
        rows = m->crows;
        if (rows < 0) BAD("merge_states: rows negative");
        if (m->ip_null) BAD("merge_states: indptr NULL");
        if (!t[0] || t[0]->ndim != 3) BAD("merge_states: v rank");
        if (rows > MAXB + 1) BAD("test: rows past the indptr array");
        const int64_t total = t[0]->shape[0];
        heads = t[0]->shape[1];
        dim = t[0]->shape[2];
        if (m->cip[0] != 0) BAD("merge_states: indptr[0]");
        for (int64_t i = 0; i < rows; ++i)
            if (m->cip[i + 1] < m->cip[i]) BAD("merge_states: indptr decreasing");
        if (m->cip[rows] != total) BAD("merge_states: indptr[rows] != states");
        if (total > 0 && (r = model_state(why, n, "input", t[0], t[1], total, heads, dim, 0, &hs))) return r;
        if ((r = model_state(why, n, "out", t[4], t[5], rows, heads, dim, 1, &hs_out))) return r;
        if ((r = model_written(why, n, "out v", t[4]))) return r;
        vo = t[4];
        so = hs_out ? t[5] : NULL;
        if (so && (r = model_written(why, n, "out s", so))) return r;
    }
    /* the reference (inputs read now, before the call: an output may alias them) */
    view vv[3], sv[3], ov, osv, mv;
    for (int k = 0; k < 3; ++k) {
        resolve(t[2 * k] ? t[2 * k]->data : NULL, &vv[k]);
        resolve(t[2 * k + 1] ? t[2 * k + 1]->data : NULL, &sv[k]);
    }
    resolve(vo->data, &ov);
    if (so) resolve(so->data, &osv);
    resolve(h_buf_dp(&m->mk), &mv);
    const int64_t N = rows * heads;
    out->vpos = (int64_t*)xcalloc((size_t)(N * dim), sizeof(int64_t));
    out->vref = (double*)xcalloc((size_t)(N * dim), sizeof(double));
    out->spos = (int64_t*)xcalloc((size_t)N, sizeof(int64_t));
    out->sref = (double*)xcalloc((size_t)N, sizeof(double));
    out->vdt = vo->dtype;
    out->vbi = ov.bi;
    out->sbi = so ? osv.bi : -1;
    const int64_t ves = (int64_t)ref_dtype_size(vo->dtype);
    if (N > 0 && dim > 0 && (ov.bi < 0 || ov.off % ves)) BAD("test: v_out outside the case's buffers");
    if (N > 0 && so && (osv.bi < 0 || osv.off % 4)) BAD("test: s_out outside the case's buffers");
    double* buf = (double*)xcalloc((size_t)((MAXB * 5 + 2) * (dim > 0 ? dim : 1)), sizeof(double));
    double sl[MAXB * 5 + 2];
    for (int64_t i = 0; i < rows; ++i) {
        if (T.fam == F_MIP && m->mask_on) {
            const uint8_t mb = mv.h ? mv.h[i] : 1;
            if (!mb) continue; /* untouched */
        }
        for (int64_t h = 0; h < heads; ++h) {
            int64_t k0, k1;
            const kva_tensor *V[2], *S[2];
            if (T.fam == F_MRGS) {
                k0 = m->cip[i];
                k1 = m->cip[i + 1];
            } else {
                k0 = 0;
                k1 = 2;
            }
            int nst = 0;
            for (int64_t kk = k0; kk < k1; ++kk, ++nst) {
                const int src = T.fam == F_MRGS ? 0 : (int)kk;
                const int64_t row = T.fam == F_MRGS ? kk : i;
                V[0] = t[2 * src];
                S[0] = t[2 * src + 1];
                int in = vget(&sv[src], F32, row * S[0]->stride[0] + h * S[0]->stride[1], &sl[nst]);
                for (int64_t c = 0; c < dim && in; ++c)
                    in = vget(&vv[src], V[0]->dtype, row * V[0]->stride[0] + h * V[0]->stride[1] + c * V[0]->stride[2],
                              &buf[nst * dim + c]);
                if (!in) {
                    free(buf);
                    BAD("state %lld (%s) outside its buffer", (long long)kk, mt_names[2 * src]);
                }
            }
            (void)V[1];
            (void)S[1];
            double* vr = out->vref + out->nv;
            double lr;
            ref_merge(nst, sl, buf, dim, vr, &lr);
            for (int64_t c = 0; c < dim; ++c)
                out->vpos[out->nv + c] = ov.off / ves + i * vo->stride[0] + h * vo->stride[1] + c * vo->stride[2];
            out->nv += dim;
            if (so) {
                out->spos[out->ns] = osv.off / 4 + i * so->stride[0] + h * so->stride[1];
                out->sref[out->ns] = lr;
                ++out->ns;
            }
        }
    }
    free(buf);
    return NULL;
}

static void mrg_case(void) {
    mrg* m = &M;
    char why[300];
    mref ex;
    snap_all();
    const char* bad = mrg_model(&ex, why, sizeof why);
    const kva_tensor* t[6];
    for (int k = 0; k < 6; ++k) t[k] = m->tnull[k] ? NULL : &m->t[k];
    kva_clear_last_error();
    kva_status st;
    const char* call;
    if (T.fam == F_MRG) {
        call = "kva_merge_state";
        st = kva_merge_state(m->ctx, t[0], t[1], t[2], t[3], t[4], t[5], NULL);
    } else if (T.fam == F_MIP) {
        call = "kva_merge_state_in_place";
        st = kva_merge_state_in_place(m->ctx, t[0], t[1], t[2], t[3], m->mask_on ? (const uint8_t*)h_buf_dp(&m->mk) : NULL,
                                      NULL);
    } else {
        call = "kva_merge_states";
        st = kva_merge_states(m->ctx, t[0], t[1], m->ip_null ? NULL : m->cip, m->crows, t[4], t[5], NULL);
    }
    verdict(0, st, call);
    if (st != KVA_OK) {
        check_refused(st, call, NULL, 0);
    } else if (bad) {
        cfail("%s accepted invalid inputs: %s", call, bad);
    } else {
        const kva_tensor* vo = T.fam == F_MIP ? t[0] : t[4];
        const h_tol tv = h_tol_out(vo->dtype, t[0]->dtype, T.fam == F_MRGS ? t[0]->dtype : t[2]->dtype);
        h_buf* skip[2];
        int ns = 0;
        if (ex.vbi >= 0) {
            check_out(ex.vbi, ex.vdt, ex.vpos, ex.vref, NULL, ex.nv, tv, "v_out");
            skip[ns++] = T.buf[ex.vbi];
        }
        if (ex.sbi >= 0) {
            check_out(ex.sbi, F32, ex.spos, ex.sref, NULL, ex.ns, h_tol_lse(), "s_out");
            skip[ns++] = T.buf[ex.sbi];
        }
        const char* w = changed(skip, ns);
        if (w) cfail("%s modified %s", call, w);
    }
    mref_free(&ex);
}

/* ============================================================================================== */
/* Driver                                                                                          */

#define MAXKINDS 256
static struct {
    const char* name;
    int drawn, refused;
} g_kinds[MAXKINDS];
static int g_nkinds, g_fam_cases[F_N], g_refused, g_accepted;

static void stats_add(void) {
    ++g_fam_cases[T.fam];
    if (T.refused) ++g_refused;
    else ++g_accepted;
    for (int i = 0; i < T.nm; ++i) {
        int k = 0;
        while (k < g_nkinds && strcmp(g_kinds[k].name, T.m[i].name) != 0) ++k;
        if (k == g_nkinds) {
            if (g_nkinds == MAXKINDS) continue;
            g_kinds[g_nkinds++].name = T.m[i].name;
        }
        ++g_kinds[k].drawn;
        g_kinds[k].refused += T.refused;
    }
}

static void stats_print(void) {
    printf("test_mutate: cases");
    for (int f = 0; f < F_N; ++f) printf(" %s %d", fam_names[f], g_fam_cases[f]);
    printf("; last call refused %d, accepted %d; %d kinds of mutation drawn\n", g_refused, g_accepted, g_nkinds);
    if (!h_opt.verbose) return;
    printf("  %-58s %7s %8s\n", "mutation", "drawn", "refused");
    for (int k = 0; k < g_nkinds; ++k) printf("  %-58s %7d %8d\n", g_kinds[k].name, g_kinds[k].drawn, g_kinds[k].refused);
}

static uint64_t mix64(uint64_t x) {
    x += 0x9e3779b97f4a7c15ull;
    x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
    x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
    return x ^ (x >> 31);
}

static unsigned suite_families(const char* s) {
    if (!s || !strcmp(s, "all")) return (1u << F_N) - 1;
    if (!strcmp(s, "decode")) return FB(F_DEC);
    if (!strcmp(s, "prefill")) return FB(F_PRE);
    if (!strcmp(s, "ragged")) return FB(F_RAG);
    if (!strcmp(s, "single")) return FB_SINGLE;
    if (!strcmp(s, "attention")) return FB_ATT;
    if (!strcmp(s, "append")) return FB(F_APP);
    if (!strcmp(s, "merge")) return FB_MERGE;
    fprintf(stderr, "test_mutate: unknown --suite %s (decode, prefill, ragged, single, attention, append, merge, all)\n", s);
    exit(2);
}

static void run_case(int index, unsigned fams) {
    memset(&T, 0, sizeof T);
    T.index = index;
    T.seed = mix64(g_seed * 0x100000001b3ull + (uint64_t)index);
    h_rng_seed(&T.r, T.seed);
    int total = 0;
    for (int f = 0; f < F_N; ++f)
        if (fams & FB(f)) total += fam_weight[f];
    int x = (int)rr(0, total - 1), fam = 0;
    for (fam = 0; fam < F_N; ++fam) {
        if (!(fams & FB(fam))) continue;
        if (x < fam_weight[fam]) break;
        x -= fam_weight[fam];
    }
    T.fam = fam;
    g_single_stage = !(fam == F_DEC || fam == F_PRE || fam == F_RAG);
    switch (fam) {
    case F_APP:
        app_build();
        draw(app_defs, (int)NELEM(app_defs));
        break;
    case F_MRG:
    case F_MIP:
    case F_MRGS:
        mrg_build();
        draw(mrg_defs, (int)NELEM(mrg_defs));
        break;
    default:
        att_build(fam);
        draw(att_defs, (int)NELEM(att_defs));
        break;
    }
    if (h_opt.verbose) {
        printf("case %d: %s: %s\n", index, fam_names[fam], T.fix);
        for (int i = 0; i < T.nm; ++i) printf("    mutation %s: %s\n", T.m[i].name, T.m[i].detail);
    }
    if (!T.failed) {
        switch (fam) {
        case F_APP: app_case(); break;
        case F_MRG:
        case F_MIP:
        case F_MRGS: mrg_case(); break;
        default: att_case(); break;
        }
    }
    if (fam <= F_SPRE) att_free();
    free_bufs();
    stats_add();
    if (T.failed) ++h_nfail;
    else h_pass();
}

int main(int argc, char** argv) {
    int seed_flag = 0;
    for (int i = 1; i < argc; ++i) seed_flag |= strcmp(argv[i], "--seed") == 0;
    h_init(argc, argv, "test_mutate");
    g_seed = h_opt.seed;
    const char* env = getenv("KVA_TEST_SEED");
    if (!seed_flag && env && *env) g_seed = strtoull(env, NULL, 0);
    int count = h_opt.count;
    env = getenv("KVA_TEST_COUNT");
    if (count < 0) count = env && *env ? atoi(env) : 2000;
    const char* one = h_opt.case_str;
    env = getenv("KVA_TEST_CASE");
    if (!one && env && *env) one = env;
    const unsigned fams = suite_families(h_opt.suite);
    g_dev = h_backend_device();
    g_ctx = h_context(3);
    kva_context_options co;
    kva_context_options_init(&co);
    co.backend = h_opt.backend;
    co.num_threads = g_dev ? 0 : h_opt.threads > 0 ? h_opt.threads : 3;
    const kva_status sc = kva_context_create(&co, &g_other);
    if (!H_CHECK(sc == KVA_OK && g_other, "a second %s context: %s", h_opt.backend_name, kva_status_string(sc)))
        return h_finish();
    h_ws_alloc(&g_fws, 4096, g_dev ? 4096 : 0);
    memset(h_buf_hp(&g_fws.dev), 0, 4096); /* no plan was made into it: its fault word reads "none" */
    h_buf_upload(&g_fws.dev);
    if (one) printf("test_mutate: seed %llu, case %s, %s backend\n", (unsigned long long)g_seed, one, h_opt.backend_name);
    else printf("test_mutate: seed %llu, %d cases, %s backend\n", (unsigned long long)g_seed, count, h_opt.backend_name);
    if (one) {
        run_case(atoi(one), fams);
    } else {
        for (int i = 0; i < count; ++i) run_case(i, fams);
    }
    stats_print();
    h_ws_free(&g_fws);
    kva_context_destroy(g_other);
    return h_finish();
}
