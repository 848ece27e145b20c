/*
 * harness.h - shared test machinery: backend choice, pass/fail counting, seeded RNG, backend memory with
 * guard bands and NaN poison, tolerance table, and the one-line replayable test cases of test_ops.
 *
 * The backend is a parameter: KVA_TEST_BACKEND=cpu|cuda (default cpu) or --backend cpu|cuda. All memory a
 * kernel sees goes through harness_backend_alloc/harness_backend_copy; with -DKVA_TEST_CUDA they use cudart,
 * otherwise (and always for the CPU backend) malloc/memcpy.
 */
#ifndef KVA_TEST_HARNESS_H
#define KVA_TEST_HARNESS_H

#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>

#include "kvattn.h"
#include "ref.h"

#if defined(__GNUC__) || defined(__clang__)
#define H_PRINTF(a, b) __attribute__((format(printf, a, b)))
#else
#define H_PRINTF(a, b)
#endif

/* ---------------------------------------------------------------------------------------------- */
/* Options and counting                                                                            */

typedef struct h_options {
    kva_backend backend;      /* KVA_BACKEND_CPU or KVA_BACKEND_CUDA */
    const char* backend_name; /* "cpu" | "cuda" */
    const char* case_str;     /* --case: replay exactly this case */
    uint64_t seed;            /* --seed (fuzz) */
    int count;                /* --count (fuzz cases); -1 = the suite's default */
    const char* suite;        /* --suite NAME (test_ops) */
    int verbose;              /* --verbose: print every case */
    int threads;              /* --threads: override CPU worker threads (0 = per case) */
} h_options;

extern h_options h_opt;
extern int h_npass, h_nfail, h_nskip;

/* Parse the common flags (and KVA_TEST_BACKEND). Unknown flags: usage and exit(2). */
void h_init(int argc, char** argv, const char* program);
/* Print "N passed, N failed" (the last line) and return the process exit code (0 iff no failure). */
int h_finish(void);

void h_pass(void);
void h_failf(const char* file, int line, const char* fmt, ...) H_PRINTF(3, 4);
void h_logf(const char* fmt, ...) H_PRINTF(1, 2); /* printed when verbose */

/* Assertion that counts: evaluates to 1 if cond holds. */
int h_check(int cond, const char* file, int line, const char* fmt, ...) H_PRINTF(4, 5);
#define H_CHECK(cond, ...) h_check(!!(cond), __FILE__, __LINE__, __VA_ARGS__)
/* Non-counting check (used inside one case; the case itself counts once). */
#define H_EXPECT(ok, cond, ...) \
    do { \
        if (!(cond)) { \
            h_note(__FILE__, __LINE__, __VA_ARGS__); \
            (ok) = 0; \
        } \
    } while (0)
void h_note(const char* file, int line, const char* fmt, ...) H_PRINTF(3, 4);

/* ---------------------------------------------------------------------------------------------- */
/* Backend stride rules. The CPU backend takes any element stride; the CUDA backend wants 16-byte rows: q/o row
 * and head strides, ragged K/V strides and paged K/V strides in multiples of 16 bytes (KVA_ERR_ALIGNMENT
 * otherwise, docs/errors.md). Generated paddings go through h_round_pad, so strided inputs are still tested on
 * a device backend, with the smallest padding it accepts. */

int h_backend_device(void);                          /* nonzero: the tested backend is not the CPU backend */
int64_t h_stride_quantum(kva_dtype dtype);           /* 1 on the CPU backend; 16 bytes of dtype on a device */
int64_t h_round_pad(int64_t pad, kva_dtype dtype);   /* pad rounded up to a multiple of h_stride_quantum */

/* ---------------------------------------------------------------------------------------------- */
/* RNG: splitmix64-seeded xoshiro256**, fully deterministic.                                        */

typedef struct h_rng {
    uint64_t s[4];
} h_rng;

void h_rng_seed(h_rng* r, uint64_t seed);
uint64_t h_rng_u64(h_rng* r);
int64_t h_rng_range(h_rng* r, int64_t lo, int64_t hi); /* inclusive */
double h_rng_uniform(h_rng* r);                       /* [0, 1) */
double h_rng_normalish(h_rng* r);                     /* N(0,1), |x| >= 0.02 (never zero) */
void h_rng_shuffle_i32(h_rng* r, int32_t* a, int64_t n);

/* ---------------------------------------------------------------------------------------------- */
/* Backend memory hooks. dir: H_H2D or H_D2H.                                                       */

enum { H_H2D = 1, H_D2H = 2 };
int harness_backend_is_device(void);                  /* nonzero: backend memory is not host memory */
void* harness_backend_alloc(size_t bytes);            /* 256-byte aligned; NULL on failure */
void harness_backend_free(void* p);
void harness_backend_copy(void* dst, const void* src, size_t bytes, int dir);
void* harness_host_pinned_alloc(size_t bytes);        /* 256-byte aligned staging memory */
void harness_host_pinned_free(void* p);

/* ---------------------------------------------------------------------------------------------- */
/* Guarded buffers: [guard | payload | guard] in backend memory, mirrored on the host.              */

#define H_GUARD_BYTES 256
#define H_GUARD_BYTE 0xa5

typedef struct h_buf {
    kva_dtype dtype;
    size_t elems;   /* payload elements */
    size_t bytes;   /* payload bytes */
    unsigned char* host; /* host mirror of the whole allocation (guards included) */
    unsigned char* dev;  /* backend allocation (== host for host-memory backends) */
} h_buf;

h_buf h_buf_alloc(kva_dtype dtype, size_t elems); /* payload zeroed, guards set; both sides */
void h_buf_free(h_buf* b);
void* h_buf_hp(const h_buf* b);              /* host payload */
void* h_buf_dp(const h_buf* b);              /* backend payload (pass this to the library) */
void h_buf_upload(h_buf* b);                 /* host -> backend (whole allocation) */
void h_buf_download(h_buf* b);               /* backend -> host (whole allocation) */
void h_buf_poison(h_buf* b);                 /* payload = NaN of its dtype (bytes 0xa5... for ints) */
int h_buf_guards_ok(const h_buf* b);         /* on the host mirror: 1 if both guards are intact */
int h_buf_elem_is_poison(const h_buf* b, size_t i);
double h_buf_get(const h_buf* b, size_t i);  /* host mirror element as double */
double h_buf_set(h_buf* b, size_t i, double x); /* encode; returns the stored value */

/* ---------------------------------------------------------------------------------------------- */
/* Context and workspace                                                                           */

/* A cached context of the tested backend (CPU: with num_threads workers; 0 = default 3). */
kva_context* h_context(int num_threads);
void h_contexts_destroy(void);

typedef struct h_ws {
    h_buf dev;      /* device workspace (guarded) */
    void* host;     /* host staging (pinned for CUDA), may be NULL */
    size_t host_bytes;
    kva_workspace ws;
} h_ws;

void h_ws_alloc(h_ws* w, size_t device_bytes, size_t host_bytes);
void h_ws_free(h_ws* w);

/* ---------------------------------------------------------------------------------------------- */
/* Tolerances: |got - ref| <= atol * scale + rtol * |ref| (see the table in harness.c).              */

typedef struct h_tol {
    double atol, rtol;
} h_tol;

/* Output tolerance for an attention/merge output: the loosest of the dtypes the value passed through. */
h_tol h_tol_out(kva_dtype o_dtype, kva_dtype q_dtype, kva_dtype kv_dtype);
/* Base-2 LSE (f32) tolerance. */
h_tol h_tol_lse(void);
/* 1 if got matches ref: NaN never passes, infinities must match exactly. */
int h_close(double got, double ref, h_tol t, double scale);

/* ---------------------------------------------------------------------------------------------- */
/* Test cases of test_ops: one printable line, all parameters and the seed.                        */

typedef enum h_op {
    H_OP_DECODE = 0,
    H_OP_PREFILL,        /* batch prefill, paged KV */
    H_OP_RAGGED,         /* batch prefill, ragged KV */
    H_OP_SINGLE_DECODE,
    H_OP_SINGLE_PREFILL,
    H_OP_MERGE,          /* merge_state */
    H_OP_MERGE_IN_PLACE, /* merge_state_in_place */
    H_OP_MERGE_STATES,   /* merge_states (variable count) */
    H_OP_APPEND,         /* append_paged_kv_cache */
    H_OP_COUNT_
} h_op;

typedef struct h_case {
    h_op op;
    int32_t batch;      /* requests (merge ops: rows) */
    int32_t max_qo;     /* prefill: max query rows per request; merge_states: max states per row; append: max
                           new tokens per request */
    int32_t max_kv;     /* max KV tokens per request */
    int32_t empty_pct;  /* percent of empty requests (kv = 0 pages) / rows with empty states */
    int32_t equal_kv;   /* 1: every non-empty request of a paged/ragged op has exactly max_kv tokens */
    int32_t zero_qo_pct; /* prefill: percent of requests with qo_len = 0 */
    int32_t long_qo_pct; /* prefill: percent of requests whose qo_len is drawn up to max_qo even past kv_len (with a
                            causal mask their first rows see no key) */
    int32_t hq, hkv, dqk, dvo;
    kva_dtype q_dt, kv_dt, o_dt;
    int32_t page_size;
    kva_layout layout;
    kva_mask_mode mask;   /* merge_state_in_place: CUSTOM = with a row mask */
    int32_t window;
    float cap;
    float scale;          /* sm_scale (0 = default) */
    kva_pos_encoding pos;
    float rope_scale, rope_theta;
    int32_t custom_slopes; /* ALiBi: 1 = pass random slopes in args */
    kva_score_mode score;
    float sig_bias;
    int32_t lse;          /* request lse (merge ops: s_out present) */
    int32_t fixed_split;
    int32_t no_split;
    int32_t graph;        /* graph mode with a re-plan of other lengths into the same workspace */
    int32_t scratch;      /* batch ops: the partials in a scratch region (kva_workspace.scratch) that a second plan,
                             made between this plan and its run, shares */
    int32_t threads;      /* CPU workers of the context */
    int32_t qpad, opad;   /* extra elements per q / o row (row stride > heads * dim) */
    int32_t pool;         /* 0: separate pools, 1: halves of one [P,2,...] pool, 2: padded strides */
    float k_scale, v_scale;
    float kv_amp;         /* K and V drawn as kv_amp * N(0,1), saturated at the KV dtype's largest finite value (fp8 near
                             saturation: pair it with k_scale, v_scale of about 1 / kv_amp) */
    int32_t api;          /* 0: kva_plan/kva_run, 1: the named wrappers */
    int32_t hidx;         /* pass the host copy of the page table to plan */
    int32_t alias;        /* merge_state: 0 separate out, 1 out = a, 2 out = b */
    int32_t bt;           /* paged batch ops: the block-table form (kv_seq_lens + block_table_stride) of the page
                             table, rows padded past each request's pages with entries outside the pool; append: the
                             slot form (kva_append_paged_kv_cache_by_slot) with padding tokens */
    uint64_t seed;
} h_case;

const char* h_op_name(h_op op);
void h_case_default(h_case* c, h_op op);
/* Into buf (>= 512 bytes); returns buf. */
char* h_case_format(const h_case* c, char* buf, size_t size);
/* Parse "key=value ..." (unset keys keep h_case_default of the op). Returns 0 on error (message in err). */
int h_case_parse(const char* s, h_case* c, char* err, size_t err_size);
/* A random case of op (fuzz). */
void h_case_random(h_case* c, h_op op, h_rng* r);
/* Make a case consistent (e.g. pool = 1 needs dqk == dvo, fp8 only for KV, RoPE needs even dims). */
void h_case_fixup(h_case* c);

const char* h_dtype_str(kva_dtype t);
int h_dtype_parse(const char* s, kva_dtype* t);

#endif /* KVA_TEST_HARNESS_H */
