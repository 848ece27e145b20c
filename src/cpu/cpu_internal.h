/*
 * cpu_internal.h - private declarations of the CPU backend (src/cpu). Not part of the core contract.
 *
 * Layout of the backend:
 *   cpu_backend.c        init/destroy, the ops table, check_desc, choose_tile_q, finish_plan, read_faults
 *   cpu_pool.c           persistent pthread pool (the calling thread is worker 0)
 *   cpu_convert.c        scalar dtype conversions and the fp8 tables
 *   cpu_kernels_generic.c portable kernels (plain C)
 *   cpu_kernels_avx2.c   AVX2/FMA/F16C kernels (x86-64 GCC/clang only; selected at init by CPUID)
 *   cpu_attention.c      run(): plan execution (work items, then merge tasks)
 *   cpu_states.c         merge_state, merge_states, append_paged_kv
 */
#ifndef KVATTN_CPU_INTERNAL_H
#define KVATTN_CPU_INTERNAL_H

#include <pthread.h>
#include <stdatomic.h>
#include <stddef.h>
#include <stdint.h>

#include "internal.h"

#define KVA__CPU_MAX_DIM 512   /* largest head_dim_qk / head_dim_vo the CPU backend supports */
#define KVA__CPU_KV_BLOCK 64   /* KV tokens per block in the attention inner loop */
#define KVA__CPU_TOK_PAD 8     /* token count of a block is padded to a multiple of this */
#define KVA__CPU_DIM_PAD 16    /* head dims are padded (with zeros) to a multiple of this in scratch */
#define KVA__CPU_ALIGN 64

/* ---------------------------------------------------------------------------------------------- */
/* Scalar conversions (cpu_convert.c). The fp8 tables are built once (pthread_once).               */

void kva__cpu_convert_init(void); /* builds the fp8 decode tables; idempotent and thread-safe */
extern float kva__cpu_e4m3_table[256];
extern float kva__cpu_e5m2_table[256];

float kva__cpu_f16_to_f32(uint16_t h);
uint16_t kva__cpu_f32_to_f16(float f);   /* round to nearest even; overflow -> inf; NaN stays NaN */
float kva__cpu_bf16_to_f32(uint16_t h);
uint16_t kva__cpu_f32_to_bf16(float f);  /* round to nearest even; NaN stays NaN */
uint8_t kva__cpu_f32_to_e4m3(float f);   /* round to nearest even, saturate to +-448, NaN -> 0x7f|sign */
uint8_t kva__cpu_f32_to_e5m2(float f);   /* round to nearest even, saturate to +-57344, NaN -> 0x7e|sign */
size_t kva__cpu_dtype_size(kva_dtype dt); /* float dtypes only; 0 otherwise */
int kva__cpu_is_float_dtype(kva_dtype dt); /* f32/f16/bf16 */
int kva__cpu_is_kv_dtype(kva_dtype dt);    /* f32/f16/bf16/e4m3/e5m2 */

/* element i of a row of dtype dt as f32 */
float kva__cpu_load_scalar(kva_dtype dt, const void* src, int64_t i);
/* generic conversions used off the hot paths */
void kva__cpu_load_row_scalar(kva_dtype dt, const void* src, float* dst, int n, int npad, float scale);
void kva__cpu_store_row_scalar(kva_dtype dt, const float* src, void* dst, int n, float scale);

/* ---------------------------------------------------------------------------------------------- */
/* Kernel table: one portable implementation and one AVX2 implementation.                         */

/* rows to prefetch while a kernel runs (spread over its loop instead of one burst) */
typedef struct kva__cpu_prefetch {
    const char* const* rows[2]; /* two lists of n rows (K and V of the next block) */
    int n;
    int bytes[2];               /* bytes per row of each list */
} kva__cpu_prefetch;

typedef struct kva__cpu_kernels {
    const char* name;
    /* dst[0..n) = scale * src (dtype dt, any KV dtype); dst[n..npad) = 0 */
    void (*load_row)(kva_dtype dt, const void* src, float* dst, int n, int npad, float scale);
    /* rows r < nrows: dst[r*ld + 0..n) = src[r][0..n) (dtype dt, any KV dtype); dst[r*ld + n..npad) = 0 */
    void (*load_rows)(kva_dtype dt, const char* const* src, int nrows, float* dst, int ld, int n, int npad);
    /* dst (dtype dt: f32/f16/bf16) = src * scale, n elements */
    void (*store_row)(kva_dtype dt, const float* src, void* dst, int n, float scale);
    /* S[r*lds + t] = dot(Q[r*ldq .. +D], K[t*ldk .. +D]) for r < R, t < nt; D % 16 == 0, nt % 8 == 0 */
    void (*scores)(const float* Q, int ldq, int R, const float* K, int ldk, int nt, int D, float* S, int lds);
    /* acc[r] = acc[r] * alpha[r] (alpha may be NULL = 1) + sum_t P[r*ldp + t] V[t]; D % 16 == 0 */
    void (*pv)(const float* P, int ldp, int R, const float* V, int ldv, int nt, int D, float* acc, int lda,
               const float* alpha);
    /* scores_kv / pv_kv: the same products reading K / V rows straight from the cache (dtype dt, row r of the
       block at kp[r]), converting in registers. scores_kv: D % 8 == 0, writes t < nt. pv_kv: D % 16 == 0. */
    void (*scores_kv)(kva_dtype dt, const float* Q, int ldq, int R, const char* const* kp, int nt, int D, float* S,
                      int lds, const kva__cpu_prefetch* pf);
    void (*pv_kv)(kva_dtype dt, const float* P, int ldp, int R, const char* const* vp, int nt, int D, float* acc,
                  int lda, const float* alpha);
    /* max of x[0..n) (n % 8 == 0); -inf for all -inf */
    float (*row_max)(const float* x, int n);
    /* x[t] = exp(x[t] - m) (exactly 0 where x[t] == -inf); returns the sum. m finite. n % 8 == 0 */
    float (*exp_sum)(float* x, int n, float m);
    /* x[t] = sigmoid(x[t] + bias) (exactly 0 where x[t] == -inf). n % 8 == 0 */
    void (*sigmoid)(float* x, int n, float bias);
    /* x[t] = cap * tanh(x[t] / cap). n % 8 == 0 */
    void (*softcap)(float* x, int n, float cap);
} kva__cpu_kernels;

extern const kva__cpu_kernels kva__cpu_kernels_generic;
#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#define KVA__CPU_HAVE_AVX2 1
extern const kva__cpu_kernels kva__cpu_kernels_avx2;
#endif

/* ---------------------------------------------------------------------------------------------- */
/* Thread pool (cpu_pool.c). fn(arg, tid) runs on threads 0..n-1; the caller is thread 0.          */

typedef void (*kva__cpu_job_fn)(void* arg, int tid);

typedef struct kva__cpu_pool kva__cpu_pool;
kva_status kva__cpu_pool_create(int32_t num_threads, kva__cpu_pool** out);
void kva__cpu_pool_destroy(kva__cpu_pool* pool);
/* Runs fn on `n` threads (1 <= n <= pool threads) and returns when all have finished. */
void kva__cpu_pool_run(kva__cpu_pool* pool, int n, kva__cpu_job_fn fn, void* arg);

/* ---------------------------------------------------------------------------------------------- */
/* Per-thread scratch, preallocated at init.                                                       */

typedef struct kva__cpu_rope_cursor {
    double c[KVA__CPU_MAX_DIM / 2];
    double s[KVA__CPU_MAX_DIM / 2];
    int64_t pos;
    int64_t anchor;
} kva__cpu_rope_cursor;

typedef struct kva__cpu_scratch {
    float* q;      /* [KVA__MAX_TILE_Q][KVA__CPU_MAX_DIM] */
    float* acc;    /* [KVA__MAX_TILE_Q][KVA__CPU_MAX_DIM] */
    float* s;      /* [KVA__MAX_TILE_Q][KVA__CPU_KV_BLOCK] */
    float* k;      /* [KVA__CPU_KV_BLOCK][KVA__CPU_MAX_DIM] */
    float* v;      /* [KVA__CPU_KV_BLOCK][KVA__CPU_MAX_DIM] */
    float* m;      /* [KVA__MAX_TILE_Q] running max */
    float* d;      /* [KVA__MAX_TILE_Q] running denominator */
    float* alpha;  /* [KVA__MAX_TILE_Q] */
    float* slope;  /* [KVA__MAX_TILE_Q] ALiBi slope per row */
    float* cosr;   /* [KVA__MAX_TILE_Q][KVA__CPU_MAX_DIM/2] RoPE cos rows (tokens or query rows) */
    float* sinr;   /* same */
    float* tmp;    /* [2][KVA__CPU_MAX_DIM] */
    const char** kp; /* [2][KVA__CPU_KV_BLOCK] row pointers (double-buffered) */
    const char** vp;
    kva__cpu_rope_cursor* rope; /* one cursor */
    void* block;   /* the single allocation */
} kva__cpu_scratch;

typedef struct kva__cpu_state {
    int32_t num_threads;
    kva__cpu_pool* pool;
    kva__cpu_scratch* scratch; /* [num_threads] */
    const kva__cpu_kernels* kern;
    pthread_mutex_t call_mu;   /* serialises backend calls on one context (scratch and pool are shared) */
    /* RoPE tables (computed on the calling thread before dispatch; memoised by key) */
    int32_t rope_dim;
    float rope_theta, rope_scale;
    double rope_inv_freq[KVA__CPU_MAX_DIM / 2];
    double rope_step_c[KVA__CPU_MAX_DIM / 2];
    double rope_step_s[KVA__CPU_MAX_DIM / 2];
} kva__cpu_state;

/* entry points used by the ops table */
kva_status kva__cpu_run(kva_context* ctx, const kva__plan_data* plan, const kva_workspace* ws,
                        const kva_run_args* args);
kva_status kva__cpu_merge_state(kva_context* ctx, const kva_tensor* v_a, const kva_tensor* s_a,
                                const kva_tensor* v_b, const kva_tensor* s_b, const kva_tensor* v_out,
                                const kva_tensor* s_out, const uint8_t* mask, void* stream);
kva_status kva__cpu_merge_states(kva_context* ctx, const kva_tensor* v, const kva_tensor* s, const int32_t* indptr,
                                 int64_t rows, const kva_tensor* v_out, const kva_tensor* s_out, void* stream);
kva_status kva__cpu_append_paged_kv(kva_context* ctx, const kva_tensor* append_k, const kva_tensor* append_v,
                                    const int32_t* batch_indices, const int32_t* positions, const int64_t* slots,
                                    int64_t nnz, const kva_paged_kv* paged, int32_t batch_size, void* stream);

/* user variants (cpu_variant.c): compile the hooks into a cached shared object and bind its row functions */
kva_status kva__cpu_variant_compile(kva_context* ctx, struct kva_variant* v);
void kva__cpu_variant_release(kva_context* ctx, struct kva_variant* v);

/* name of the kernel set a CPU context selected ("avx2" or "generic"; "none" for other backends) */
const char* kva__cpu_kernel_name(const kva_context* ctx);

/* RoPE helpers (cpu_attention.c) */
void kva__cpu_rope_prepare(kva__cpu_state* st, int32_t dim, float theta, float scale);
void kva__cpu_rope_seek(const kva__cpu_state* st, kva__cpu_rope_cursor* cur, int32_t half, int64_t pos);
/* writes cos/sin rows (half floats each, row stride ld) for n consecutive positions starting at cur->pos,
   advancing the cursor */
void kva__cpu_rope_rows(const kva__cpu_state* st, kva__cpu_rope_cursor* cur, int32_t half, int n, float* cosr,
                        float* sinr, int ld);
void kva__cpu_rope_apply(float* x, int32_t half, const float* c, const float* s);

#endif /* KVATTN_CPU_INTERNAL_H */
