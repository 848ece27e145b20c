/*
 * kvattn.h - the one public header of kvattn, an attention engine for LLM serving.
 *
 * C11, compiles as C and as C++, includes no CUDA header. Every public symbol starts with kva_ / KVA_.
 *
 * Model of use (see docs/design.md):
 *   once per process:   kva_context_create (backend: CPU threads or a CUDA device)
 *   once per layer shape: kva_attention_desc (heads, head dims, dtypes, mask, variant)
 *   once per step:      kva_plan_make(...) on host arrays of lengths -> a kva_plan (POD) + a work list written
 *                       at fixed offsets into caller-owned workspace
 *   once per layer:     kva_run_*(plan, tensors) -> o and optionally lse
 *
 * Numerical contract:
 *   - logits x = sm_scale * dot(q', k') where q', k' are q, k after fused RoPE (if enabled);
 *     then ALiBi adds slope[h] * (kv_pos - q_pos); then a soft cap gives cap * tanh(x / cap).
 *   - softmax mode: o = sum_j softmax(x)_j v_j over the visible keys; lse = log2(sum_j exp(x_j)), i.e.
 *     the log-sum-exp in BASE 2 (the FlashInfer convention). Rows with no visible key: o = 0, lse = -inf.
 *   - sigmoid mode (no softmax): o = sum_j sigmoid(x_j + sigmoid_bias) v_j; no lse is defined.
 *   - query row i of a request with qo_len rows and kv_len keys sits at position q_pos = kv_len - qo_len + i;
 *     key j sits at position j. Causal (bottom-right aligned): key j visible iff j <= q_pos.
 *     Sliding window (window_left >= 0): key j visible iff j >= q_pos - window_left.
 *     Custom mask: bit (i * kv_len + j) of the request's segment, little bit order, 1 = visible; each
 *     request's segment starts at a byte boundary (segments in request order).
 *   - KV scales (run args k_scale, v_scale; default 1): keys are k_scale * k and values v_scale * v, for every KV
 *     dtype (per-tensor dequantisation scales of fp8 KV; FlashInfer folds them the same way).
 *   - A request with more query rows than keys (qo_len > kv_len) is accepted: with a causal mask its first rows
 *     (q_pos < 0) see no key and get o = 0, lse = -inf.
 *
 * Errors: every fallible call returns a kva_status; kva_last_error_message() (thread-local) says which
 * argument or index was wrong and why. The library never aborts, exits or prints; diagnostics go to the
 * context's log callback. A call that returns an error detected on the host leaves every output untouched.
 */
#ifndef KVATTN_H
#define KVATTN_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#if defined(_WIN32)
#define KVA_API
#elif defined(__GNUC__) || defined(__clang__)
#define KVA_API __attribute__((visibility("default")))
#else
#define KVA_API
#endif

/* ---------------------------------------------------------------------------------------------- */
/* Version                                                                                         */

#define KVA_VERSION_MAJOR 0
#define KVA_VERSION_MINOR 1
#define KVA_VERSION_PATCH 0
#define KVA_VERSION_STRING "0.1.0"
/* KVA_VERSION = major * 10000 + minor * 100 + patch */
#define KVA_VERSION (KVA_VERSION_MAJOR * 10000 + KVA_VERSION_MINOR * 100 + KVA_VERSION_PATCH)

KVA_API int kva_version(void);                /* the runtime library's KVA_VERSION */
KVA_API const char* kva_version_string(void); /* the runtime library's KVA_VERSION_STRING */

/* ---------------------------------------------------------------------------------------------- */
/* Status and errors. Values are stable; the enum only grows.                                      */

typedef enum kva_status {
    KVA_OK = 0,
    KVA_ERR_INVALID_ARGUMENT = 1,      /* a NULL pointer, a bad shape, stride, count or value */
    KVA_ERR_UNSUPPORTED = 2,           /* a valid configuration this backend does not implement */
    KVA_ERR_WORKSPACE_TOO_SMALL = 3,   /* from plan and the single ops (never from run); the message gives the bytes
                                          needed */
    KVA_ERR_PAGETABLE_MALFORMED = 4,   /* indptr not monotonic, last_page_len out of range, ... */
    KVA_ERR_PAGE_INDEX_OUT_OF_RANGE = 5, /* a page index outside [0, num_pages) */
    KVA_ERR_PLAN_MISMATCH = 6,         /* run-time tensors or workspace disagree with the plan */
    KVA_ERR_ALIGNMENT = 7,             /* a pointer or stride misaligned for the backend */
    KVA_ERR_OUT_OF_MEMORY = 8,         /* a host allocation failed (context creation, plan, variant creation, the
                                          format planners and packers, CPU single ops without a workspace; never
                                          from run) */
    KVA_ERR_BACKEND = 9,               /* the device runtime reported an error (message has its code) */
    KVA_ERR_JIT = 10,                  /* run-time compilation failed (message has the compiler log) */
    KVA_ERR_CAPTURE_ACTIVE = 11,       /* plan/compile or kva_read_faults attempted while the stream is being
                                          captured */
    KVA_ERR_NO_DEVICE = 12,            /* the requested backend/device is not available */
    KVA_ERR_INTERNAL = 13              /* a bug in kvattn: please report the message */
} kva_status;

/* Static string naming a status ("KVA_ERR_INVALID_ARGUMENT"). Never NULL. */
KVA_API const char* kva_status_string(kva_status status);
/* Detailed message of the last failing call on this thread ("" if none). Valid until the next call. */
KVA_API const char* kva_last_error_message(void);
/* Status of the last failing call on this thread (KVA_OK if none). */
KVA_API kva_status kva_last_error_status(void);
KVA_API void kva_clear_last_error(void);

/* ---------------------------------------------------------------------------------------------- */
/* Data types and enums                                                                            */

typedef enum kva_dtype {
    KVA_DTYPE_F32 = 0,
    KVA_DTYPE_F16 = 1,
    KVA_DTYPE_BF16 = 2,
    KVA_DTYPE_E4M3 = 3, /* fp8 e4m3 (OCP "fn": no inf, one NaN pattern), KV only */
    KVA_DTYPE_E5M2 = 4, /* fp8 e5m2, KV only */
    KVA_DTYPE_I32 = 5,  /* index arrays only */
    KVA_DTYPE_U8 = 6    /* packed masks only */
} kva_dtype;

KVA_API size_t kva_dtype_size(kva_dtype dtype); /* 0 for an unknown dtype */
KVA_API const char* kva_dtype_name(kva_dtype dtype);

typedef enum kva_backend {
    KVA_BACKEND_AUTO = 0, /* CUDA when a device is usable, else CPU */
    KVA_BACKEND_CPU = 1,
    KVA_BACKEND_CUDA = 2
} kva_backend;

typedef enum kva_layout {
    KVA_LAYOUT_NHD = 0, /* page [page_size, heads, dim] */
    KVA_LAYOUT_HND = 1  /* page [heads, page_size, dim] */
} kva_layout;

typedef enum kva_mask_mode {
    KVA_MASK_NONE = 0,
    KVA_MASK_CAUSAL = 1, /* bottom-right aligned */
    KVA_MASK_CUSTOM = 2  /* packed bitmask given at run time */
} kva_mask_mode;

typedef enum kva_pos_encoding {
    KVA_POS_NONE = 0,
    KVA_POS_ROPE_LLAMA = 1, /* fused rotate-half RoPE on q and k (not v) */
    KVA_POS_ALIBI = 2
} kva_pos_encoding;

typedef enum kva_score_mode {
    KVA_SCORE_SOFTMAX = 0,
    KVA_SCORE_SIGMOID = 1 /* no softmax: o = sum_j sigmoid(x_j + sigmoid_bias) v_j */
} kva_score_mode;

typedef enum kva_log_level { KVA_LOG_ERROR = 0, KVA_LOG_WARN = 1, KVA_LOG_INFO = 2, KVA_LOG_DEBUG = 3 } kva_log_level;

typedef void (*kva_log_fn)(void* user, kva_log_level level, const char* message);

/* ---------------------------------------------------------------------------------------------- */
/* Context                                                                                         */

typedef struct kva_context kva_context;

typedef struct kva_context_options {
    kva_backend backend;     /* default KVA_BACKEND_AUTO */
    int32_t device;          /* CUDA device ordinal (default 0). Each call makes the device's primary context
                                current for its duration and restores the caller's: the caller's current device
                                may be another one; streams and memory passed in must belong to this device */
    int32_t num_threads;     /* CPU backend worker threads; 0 = number of online CPUs */
    kva_log_fn log_fn;       /* NULL = diagnostics are dropped */
    void* log_user;
    kva_log_level log_level; /* messages above this level are dropped (default KVA_LOG_WARN) */
    const char* jit_cache_dir; /* on-disk cache of NVRTC kernels (CUDA) and user-variant shared objects (CPU);
                                  NULL = $KVATTN_CACHE_DIR, $XDG_CACHE_HOME/kvattn, ~/.cache/kvattn. With
                                  $KVATTN_JIT=0 nothing is compiled at run time: a kernel or variant neither prebuilt
                                  nor cached is KVA_ERR_UNSUPPORTED (docs/variants.md) */
} kva_context_options;

KVA_API void kva_context_options_init(kva_context_options* options);
KVA_API kva_status kva_context_create(const kva_context_options* options, kva_context** out_context);
KVA_API kva_status kva_context_destroy(kva_context* context); /* NULL is allowed */
/* fork(): a CPU context made before fork() also works in the child (which has none of its worker threads: its calls
 * run on the calling thread alone) and is destroyed there as usual; do not fork while another thread is inside a
 * call on the context. */
KVA_API kva_backend kva_context_backend(const kva_context* context);
/* Number of workers W the planner balances over (CPU threads, or persistent CTAs on a GPU). */
KVA_API int32_t kva_context_num_workers(const kva_context* context);

/* ---------------------------------------------------------------------------------------------- */
/* Tensors: descriptors over caller memory (host memory for the CPU backend, device memory for CUDA). */

#define KVA_MAX_DIMS 4

typedef struct kva_tensor {
    void* data;                   /* NULL = absent (only where a tensor is optional) */
    kva_dtype dtype;
    int32_t ndim;
    int64_t shape[KVA_MAX_DIMS];
    int64_t stride[KVA_MAX_DIMS]; /* in elements; the last dimension must have stride 1. A tensor kvattn writes
                                     (o, lse, merge outputs) has no stride 0 over more than one element
                                     (KVA_ERR_INVALID_ARGUMENT): a broadcast view would put several results in
                                     one place. Outputs must not overlap the inputs (not checked). */
} kva_tensor;

/* A contiguous row-major tensor of 1 to 4 dims (pass 0 for unused trailing dims). A stride that does not fit int64
 * (more than 2^63 elements) is set to INT64_MAX, which every call refuses over more than one element. */
KVA_API kva_tensor kva_tensor_make(void* data, kva_dtype dtype, int32_t ndim, int64_t d0, int64_t d1, int64_t d2,
                                   int64_t d3);

/* Paged KV cache: K and V pools of num_pages pages each, addressed through a CSR page table.
 * Request b owns pages indices[indptr[b] .. indptr[b+1]); its length is
 * (indptr[b+1] - indptr[b] - 1) * page_size + last_page_len[b], or 0 when it owns no page.
 * Element (page p, token t, head h, dim d) of K is at k_data + p*k_stride_page + t*k_stride_token
 * + h*k_stride_head + d (elements of kv_dtype). NHD: stride_token = heads*dim, stride_head = dim;
 * HND: stride_head = page_size*dim, stride_token = dim. Any strides are accepted (e.g. the halves of a
 * [num_pages, 2, page_size, heads, dim] pool). */
typedef struct kva_paged_kv {
    void* k_data;
    void* v_data;
    kva_dtype dtype;
    int64_t num_pages;   /* pool size: every page index must lie in [0, num_pages) */
    int32_t page_size;   /* >= 1 */
    int32_t num_heads;   /* KV heads */
    int32_t head_dim_qk; /* K row length */
    int32_t head_dim_vo; /* V row length */
    int64_t k_stride_page, k_stride_token, k_stride_head;
    int64_t v_stride_page, v_stride_token, v_stride_head;
    const int32_t* indices;       /* page table (backend memory) */
    const int32_t* indptr;        /* [B+1] (backend memory): needed by append only; attention uses the plan's copy */
    const int32_t* last_page_len; /* [B] (backend memory): needed by append only */
    /* Appended field: the number of entries in `indices` (0 = not given: unchecked; kva_paged_kv_init sets 0).
     * Where given, run refuses a plan whose page table (kv_indptr[B]) is longer (KVA_ERR_PAGETABLE_MALFORMED) and
     * append refuses (CPU) or faults (CUDA) a request whose indptr range leaves [0, num_indices). */
    int64_t num_indices;
} kva_paged_kv;

/* Fill a kva_paged_kv for separately allocated contiguous K and V pools in the given layout. */
KVA_API kva_status kva_paged_kv_init(kva_paged_kv* paged, void* k_data, void* v_data, kva_dtype dtype,
                                     kva_layout layout, int64_t num_pages, int32_t page_size, int32_t num_heads,
                                     int32_t head_dim_qk, int32_t head_dim_vo);

/* ---------------------------------------------------------------------------------------------- */
/* Attention descriptor: static per layer shape.                                                   */

typedef struct kva_variant kva_variant; /* a compiled user-defined attention variant (below) */

typedef struct kva_attention_desc {
    int32_t num_qo_heads;
    int32_t num_kv_heads;  /* num_qo_heads % num_kv_heads == 0; group size g = num_qo_heads / num_kv_heads */
    int32_t head_dim_qk;   /* CPU: 1 .. 512; CUDA: 64, 128 or 256, equal to head_dim_vo */
    int32_t head_dim_vo;   /* CPU: 1 .. 512 */
    kva_dtype q_dtype;     /* f32, f16, bf16 (CUDA: f16, bf16) */
    kva_dtype kv_dtype;    /* f32, f16, bf16, e4m3, e5m2 (CUDA: no f32) */
    kva_dtype o_dtype;     /* f32, f16, bf16 */
    kva_mask_mode mask_mode;
    int32_t window_left;   /* -1 = no sliding window */
    float logits_soft_cap; /* 0 = off */
    float sm_scale;        /* 0 = 1/sqrt(head_dim_qk) */
    kva_pos_encoding pos_encoding;
    float rope_scale;      /* default 1 */
    float rope_theta;      /* default 1e4 */
    kva_score_mode score_mode;
    float sigmoid_bias;    /* sigmoid mode only */
    const kva_variant* variant; /* user-defined attention variant (kva_variant_create); NULL = built-in.
                                          Appended field: kva_attention_desc_init sets NULL. */
} kva_attention_desc;

/* Defaults: q/kv/o dtype = dtype, no mask, no window, no cap, default scale, no pos-enc, softmax. */
KVA_API void kva_attention_desc_init(kva_attention_desc* desc, int32_t num_qo_heads, int32_t num_kv_heads,
                                     int32_t head_dim, kva_dtype dtype);
/* Validates the descriptor and answers whether the context's backend supports it. */
KVA_API kva_status kva_attention_desc_check(const kva_context* context, const kva_attention_desc* desc);

/* ---------------------------------------------------------------------------------------------- */
/* Plans                                                                                           */

typedef enum kva_op {
    KVA_OP_BATCH_DECODE = 0,         /* paged KV, one query row per request */
    KVA_OP_BATCH_PREFILL_PAGED = 1,  /* paged KV, qo_indptr rows per request (prefill, append, multi-token) */
    KVA_OP_BATCH_PREFILL_RAGGED = 2  /* ragged K/V addressed by a token indptr */
} kva_op;

/* Host arrays describing one step. All arrays are read during the call only. */
typedef struct kva_plan_params {
    int32_t batch_size;
    const int32_t* qo_indptr;        /* host [B+1] query rows; NULL for KVA_OP_BATCH_DECODE (one row each) */
    const int32_t* kv_indptr;        /* host [B+1]: page indptr (paged ops) or token indptr (ragged) */
    const int32_t* kv_last_page_len; /* host [B] (paged ops) */
    int32_t page_size;               /* paged ops: >= 1; ragged: ignored */
    int64_t num_pages;               /* paged ops: pool size, or 0 = known at run only (run's pool must have at
                                        least this many pages; kernels bound-check against the run-time pool) */
    const int32_t* kv_indices;       /* optional host copy of the page table, checked against num_pages (> 0) */
    int32_t fixed_split_size;        /* > 0: KV chunks of this many tokens regardless of the batch
                                        (results then do not depend on other requests; each chunk of a split
                                        tile takes a partial slot of tile_q rows, so very small sizes on long
                                        requests need large workspaces: ask kva_plan_workspace_size) */
    int32_t disable_split_kv;        /* nonzero: never split KV */
    int32_t graph_mode;              /* nonzero: worker count, kernels and workspace offsets depend only on
                                        the bounds below, so a captured run replays with new plans */
    int32_t max_batch_size;          /* graph mode: bound on batch_size */
    int64_t max_total_qo_rows;       /* graph mode: bound on qo_indptr[B] (decode: = max_batch_size) */
    /* Appended fields: the block-table form of the page table (paged ops), as engines that keep a 2-D block table
     * [B, max_blocks] and per-request lengths (vLLM's block_table and seq_lens) hold it, in place of the CSR arrays.
     * kv_seq_lens non-NULL selects it: request b has kv_seq_lens[b] >= 0 KV tokens on its first
     * ceil(kv_seq_lens[b] / page_size) pages, page-table entries b * block_table_stride + j; kv_indptr and
     * kv_last_page_len are not read (may be NULL); kv_indices (host copy) and the run's paged.indices are the block
     * table, row-major with that stride. Entries past a request's pages are never read, so they may hold anything
     * (e.g. -1 or a null block); the plan's page table spans entries up to the last request's last used one
     * (paged.num_indices, where given, must cover that). kva_plan_params_init sets the CSR form. */
    const int32_t* kv_seq_lens;      /* host [B] */
    int32_t block_table_stride;      /* entries per row: >= every request's page count; B * stride < 2^31 */
} kva_plan_params;

KVA_API void kva_plan_params_init(kva_plan_params* params);

/* Caller-owned workspace. `device` is backend memory (device memory for CUDA, host memory for CPU);
 * it holds the work list, merge map and split-KV partial outputs. `host` is a page-locked staging
 * buffer the CUDA backend copies the work list from (unused by the CPU backend, may be NULL there).
 * Both must be 256-byte aligned. The plan refers to offsets in them: do not change either between plan
 * and run, and do not plan again into a workspace whose previous plan is still running on the device
 * unless the stream orders it (the CUDA backend records an event and waits on it before reuse).
 *
 * Optional `scratch` (backend memory, 256-byte aligned; NULL = none): kva_plan_make then keeps only the plan
 * (fault status, work list, merge map) in `device` and puts the split-KV partial outputs, which a run writes and
 * reads before it returns its results, in `scratch`. Plans whose runs are ordered on one stream may share one
 * scratch region while each keeps its own `device` region: several plans of a step (prefill, decode, the two
 * window sizes of a model) stay valid side by side, as wrappers sharing one float workspace expect. Sizes:
 * kva_plan_workspace_parts / kva_workspace_bound_parts. The format planners (cascade, BSR, VBSR) ignore it. */
typedef struct kva_workspace {
    void* device;
    size_t device_bytes;
    void* host;
    size_t host_bytes;
    void* scratch;
    size_t scratch_bytes;
} kva_workspace;

/* A plan: plain data, caller-owned, may be copied byte for byte. Filled by kva_plan_make, which seals it with a hash
   of its bytes: run refuses (KVA_ERR_PLAN_MISMATCH) a plan whose bytes changed since. */
typedef struct kva_plan {
    uint64_t opaque[160];
} kva_plan;

/* Exact workspace sizes for these inputs (same arguments as kva_plan_make). */
KVA_API kva_status kva_plan_workspace_size(kva_context* context, const kva_attention_desc* desc, kva_op op,
                                           const kva_plan_params* params, size_t* device_bytes,
                                           size_t* host_bytes);
/* Worst-case workspace sizes over every batch with batch_size <= max_batch_size,
 * total query rows <= max_total_qo_rows and any KV lengths (also the graph-mode sizes). */
KVA_API kva_status kva_workspace_bound(kva_context* context, const kva_attention_desc* desc, kva_op op,
                                       int32_t max_batch_size, int64_t max_total_qo_rows, size_t* device_bytes,
                                       size_t* host_bytes);
/* The same sizes split for a workspace with a scratch region: plan_bytes of `device` (the plan's own region) and
 * scratch_bytes of `scratch` (split-KV partials); device_bytes of the two functions above = plan_bytes +
 * scratch_bytes. */
KVA_API kva_status kva_plan_workspace_parts(kva_context* context, const kva_attention_desc* desc, kva_op op,
                                            const kva_plan_params* params, size_t* plan_bytes, size_t* scratch_bytes,
                                            size_t* host_bytes);
KVA_API kva_status kva_workspace_bound_parts(kva_context* context, const kva_attention_desc* desc, kva_op op,
                                             int32_t max_batch_size, int64_t max_total_qo_rows, size_t* plan_bytes,
                                             size_t* scratch_bytes, size_t* host_bytes);
/* Plan one step: validates the host arrays, balances work over the context's workers, writes the work list
 * into the workspace (CUDA: one async copy on `stream`) and fills *plan. Never synchronises the device. */
KVA_API kva_status kva_plan_make(kva_context* context, const kva_attention_desc* desc, kva_op op,
                            const kva_plan_params* params, const kva_workspace* workspace, kva_plan* plan,
                            void* stream);

/* Facts about a plan (for tests, tools and benchmarks). */
typedef struct kva_plan_info {
    kva_op op;
    int32_t batch_size;
    int64_t total_qo_rows;
    int32_t num_workers;
    int32_t tile_q;          /* packed query rows per tile (GQA heads packed into rows) */
    int32_t kv_chunk_size;   /* tokens per KV chunk; 0 = no split */
    int32_t num_work_items;
    int32_t num_merge_tasks;
    int32_t num_partials;
    int32_t graph_mode;
    int32_t kv_head_group;   /* KV heads per work item (1; more where the backend reads groups of heads together) */
    int64_t max_worker_cost; /* planner cost of the most loaded worker */
    int64_t total_cost;
    size_t device_bytes;     /* workspace bytes this plan uses in `device` (the plan alone with a scratch region) */
    size_t host_bytes;
    size_t scratch_bytes;    /* bytes it uses in `scratch` (0 without one) */
} kva_plan_info;

KVA_API kva_status kva_plan_get_info(const kva_plan* plan, kva_plan_info* info);

/* ---------------------------------------------------------------------------------------------- */
/* Running a plan                                                                                  */

typedef struct kva_run_args {
    kva_tensor q;   /* [total_qo_rows, num_qo_heads, head_dim_qk], q_dtype */
    kva_tensor o;   /* [total_qo_rows, num_qo_heads, head_dim_vo], o_dtype */
    kva_tensor lse; /* optional (data NULL = not wanted): [total_qo_rows, num_qo_heads] f32, base 2 */
    kva_paged_kv paged; /* paged ops */
    kva_tensor k;   /* ragged op: [total_kv_tokens, num_kv_heads, head_dim_qk] (kv_dtype) */
    kva_tensor v;   /* ragged op: [total_kv_tokens, num_kv_heads, head_dim_vo] (kv_dtype) */
    const uint8_t* custom_mask;  /* KVA_MASK_CUSTOM: packed bits, per-request byte-aligned segments */
    int64_t custom_mask_bytes;   /* size of custom_mask (checked against the plan) */
    const float* alibi_slopes;   /* optional [num_qo_heads] (backend memory); NULL = standard ALiBi slopes */
    float k_scale;               /* fp8 dequantisation scales (default 1) */
    float v_scale;
    void* stream;                /* CUDA stream (cudaStream_t) of the context's device; NULL = that device's legacy
                                    default stream */
    /* Appended fields: the run-time parameters of the plan's user variant (desc->variant; docs/variants.md).
       Both counts must equal the variant's num_scalar_params / num_tensor_params (0 without a variant). */
    const float* variant_scalars;          /* host array of num_variant_scalars floats (read during the call) */
    int32_t num_variant_scalars;
    int32_t num_variant_tensors;
    const void* const* variant_tensors;    /* host array of num_variant_tensors pointers to f32 data in backend
                                              memory (device memory for CUDA); each must be non-NULL */
    /* Programmatic dependent launch (CUDA, compute capability 9.0+; FlashInfer's enable_pdl): 1 = launch the call's
       kernels so that their CTAs may start while the previous kernel of the stream finishes (they read and write
       nothing an earlier kernel may touch until it has completed and its memory is visible), and let the next
       kernel, if it was launched the same way, start early in turn; this hides launch latency between kernels
       that run back to back, also inside a CUDA graph. 0 (default) = plain launches. Elsewhere 1 is accepted and
       has no effect. Other values are refused. */
    int32_t enable_pdl;
} kva_run_args;

KVA_API void kva_run_args_init(kva_run_args* args);

/* Run a plan (any op). Never allocates or synchronises. */
KVA_API kva_status kva_run(kva_context* context, const kva_plan* plan, const kva_workspace* workspace,
                           const kva_run_args* args);

/* The named operations (thin wrappers over kva_plan_make/kva_run that also check the op). */
KVA_API kva_status kva_batch_decode_plan(kva_context* context, const kva_attention_desc* desc,
                                         const kva_plan_params* params, const kva_workspace* workspace,
                                         kva_plan* plan, void* stream);
KVA_API kva_status kva_batch_decode_run(kva_context* context, const kva_plan* plan, const kva_workspace* workspace,
                                        const kva_run_args* args);
KVA_API kva_status kva_batch_prefill_paged_plan(kva_context* context, const kva_attention_desc* desc,
                                                const kva_plan_params* params, const kva_workspace* workspace,
                                                kva_plan* plan, void* stream);
KVA_API kva_status kva_batch_prefill_paged_run(kva_context* context, const kva_plan* plan,
                                               const kva_workspace* workspace, const kva_run_args* args);
KVA_API kva_status kva_batch_prefill_ragged_plan(kva_context* context, const kva_attention_desc* desc,
                                                 const kva_plan_params* params, const kva_workspace* workspace,
                                                 kva_plan* plan, void* stream);
KVA_API kva_status kva_batch_prefill_ragged_run(kva_context* context, const kva_plan* plan,
                                                const kva_workspace* workspace, const kva_run_args* args);

/* Single request on contiguous K/V (args->k, args->v: [kv_len, num_kv_heads, head_dim], any strides;
 * decode: args->q is [1, num_qo_heads, head_dim_qk] or [num_qo_heads, head_dim_qk]).
 * The workspace must hold kva_single_workspace_size bytes (else KVA_ERR_WORKSPACE_TOO_SMALL, nothing written);
 * the CPU backend also accepts workspace == NULL (it then allocates host scratch for the call). */
KVA_API kva_status kva_single_workspace_size(kva_context* context, const kva_attention_desc* desc, int64_t qo_len,
                                             int64_t kv_len, size_t* device_bytes, size_t* host_bytes);
KVA_API kva_status kva_single_decode(kva_context* context, const kva_attention_desc* desc, const kva_run_args* args,
                                     const kva_workspace* workspace);
KVA_API kva_status kva_single_prefill(kva_context* context, const kva_attention_desc* desc, const kva_run_args* args,
                                      const kva_workspace* workspace);

/* ---------------------------------------------------------------------------------------------- */
/* User-defined attention variants (docs/variants.md): C source of up to five hooks, compiled once for
 * the context's backend (CUDA: NVRTC, into the kernels at plan time, cached on disk; CPU: the host C
 * compiler $KVA_CC / cc / gcc / clang into a cached shared object loaded with dlopen). The same source
 * serves both backends. Hooks (define the ones named in `hooks`, with exactly these names and signatures;
 * KVA_HOOK and kva_vparams come from the prelude the source is compiled with):
 *   KVA_HOOK float kva_query_transform(const kva_vparams* p, float q, int batch, int qo_head, int q_pos, int dim);
 *   KVA_HOOK float kva_key_transform(const kva_vparams* p, float k, int batch, int kv_head, int kv_pos, int dim);
 *   KVA_HOOK float kva_logits_transform(const kva_vparams* p, float logit, int batch, int qo_head, int kv_head,
 *                                       int q_pos, int kv_pos);   (logit = sm_scale * k_scale * q'.k', natural log)
 *   KVA_HOOK int kva_logits_mask(const kva_vparams* p, int batch, int qo_head, int kv_head, int q_pos,
 *                                int kv_pos);                      (0 = masked)
 *   KVA_HOOK float kva_output_transform(const kva_vparams* p, float o, float lse, int batch, int qo_head,
 *                                       int q_pos, int dim);       (final o and its base-2 lse, after merges)
 * p->s[i] are the run's variant_scalars, p->t[i] its variant_tensors (const float*). */

#define KVA_VARIANT_QUERY_TRANSFORM 1u
#define KVA_VARIANT_KEY_TRANSFORM 2u
#define KVA_VARIANT_LOGITS_TRANSFORM 4u
#define KVA_VARIANT_LOGITS_MASK 8u
#define KVA_VARIANT_OUTPUT_TRANSFORM 16u
#define KVA_VARIANT_MAX_SCALARS 16
#define KVA_VARIANT_MAX_TENSORS 4
#define KVA_VARIANT_MAX_NAME 48

typedef struct kva_variant_spec {
    const char* name;            /* C identifier, 1..KVA_VARIANT_MAX_NAME characters (logs, kernel names) */
    const char* source;          /* C source of the hooks (copied by kva_variant_create) */
    uint32_t hooks;              /* OR of KVA_VARIANT_* : the hooks the source defines */
    int32_t use_softmax;         /* 1 (default): softmax over the (transformed) logits; 0: o = sum_j w_j v_j with
                                    w_j = the transformed logit of each visible key (no lse) */
    int32_t num_scalar_params;   /* 0 .. KVA_VARIANT_MAX_SCALARS floats given at run (kva_run_args) */
    int32_t num_tensor_params;   /* 0 .. KVA_VARIANT_MAX_TENSORS f32 arrays given at run */
} kva_variant_spec;

/* Defaults: no name, no source, no hooks, use_softmax = 1, no parameters. */
KVA_API void kva_variant_spec_init(kva_variant_spec* spec);
/* Validates the spec and compiles the hooks for the context's backend. KVA_ERR_JIT: the source does not compile
 * (the message carries the compiler's log); KVA_ERR_UNSUPPORTED: no compiler is available (CPU backend without a
 * C compiler; CUDA without NVRTC). The variant belongs to `context`: destroy it before the context (a context
 * destroys the variants still alive when it is destroyed). */
KVA_API kva_status kva_variant_create(kva_context* context, const kva_variant_spec* spec, kva_variant** out_variant);
/* NULL is allowed. Plans made with the variant must not be run afterwards (run then reports
 * KVA_ERR_PLAN_MISMATCH). A pointer that is no longer a live variant (destroyed already, or destroyed with its
 * context) gets KVA_ERR_INVALID_ARGUMENT and is not read. Not thread-safe against runs of the same variant on other
 * threads. */
KVA_API kva_status kva_variant_destroy(kva_variant* variant);

/* ---------------------------------------------------------------------------------------------- */
/* Attention states: (v [rows, heads, dim], s [rows, heads] f32 base-2 lse).                       */

/* v_out/s_out = (v_a, s_a) merged with (v_b, s_b). Outputs may alias either input. s_out optional. */
KVA_API kva_status kva_merge_state(kva_context* context, const kva_tensor* v_a, const kva_tensor* s_a,
                                   const kva_tensor* v_b, const kva_tensor* s_b, const kva_tensor* v_out,
                                   const kva_tensor* s_out, void* stream);
/* In place: (v, s) <- (v, s) merge (v_other, s_other), only for rows whose mask byte is nonzero (mask
 * optional, backend memory, [rows]). */
KVA_API kva_status kva_merge_state_in_place(kva_context* context, const kva_tensor* v, const kva_tensor* s,
                                            const kva_tensor* v_other, const kva_tensor* s_other,
                                            const uint8_t* mask, void* stream);
/* n-ary, variable count per row: row r merges states indptr[r] .. indptr[r+1] of v [total, heads, dim] and
 * s [total, heads] into v_out [rows, heads, dim], s_out [rows, heads] (optional). indptr is a host array
 * [rows+1]. A row with no states gets v = 0, s = -inf. v_out/s_out must not overlap v/s. */
KVA_API kva_status kva_merge_states(kva_context* context, const kva_tensor* v, const kva_tensor* s,
                                    const int32_t* indptr, int64_t rows, const kva_tensor* v_out,
                                    const kva_tensor* s_out, void* stream);

/* ---------------------------------------------------------------------------------------------- */
/* KV cache maintenance                                                                            */

/* Scatter new K/V rows into the paged cache (FlashInfer semantics: the page table already includes the new
 * tokens). append_k [nnz, num_heads, head_dim_qk], append_v [nnz, num_heads, head_dim_vo] (f32/f16/bf16 or the
 * pool dtype); token i goes to request batch_indices[i] at position positions[i] (both arrays in backend memory). paged->indices, indptr and
 * last_page_len are required; batch_size is the number of requests in the page table. A token whose
 * request, position or page lies outside the batch, its request or the pool is never written. The CPU
 * backend checks everything before writing and returns KVA_ERR_PAGE_INDEX_OUT_OF_RANGE,
 * KVA_ERR_PAGETABLE_MALFORMED or KVA_ERR_INVALID_ARGUMENT (nothing written). The CUDA backend cannot read
 * device arrays on the host without a sync: it returns KVA_OK, writes the valid tokens only, and records the
 * first bad token in a context-owned fault word that kva_read_faults reports (request = token index). */
KVA_API kva_status kva_append_paged_kv_cache(kva_context* context, const kva_tensor* append_k,
                                             const kva_tensor* append_v, const int32_t* batch_indices,
                                             const int32_t* positions, int64_t nnz, const kva_paged_kv* paged,
                                             int32_t batch_size, void* stream);

/* Scatter new K/V rows by slot (the slot-mapping form of block-table engines): token i goes to slot slots[i] of the
 * pool, that is page slots[i] / page_size at offset slots[i] % page_size. slots: int64 [nnz] in backend memory. A
 * negative slot skips its token (padding); slots of distinct tokens must differ (which of two tokens lands in a
 * shared slot is unspecified). append_k / append_v as kva_append_paged_kv_cache; paged->indices, indptr and
 * last_page_len are not read (NULL is fine). A slot at or past num_pages * page_size: the CPU backend checks every
 * slot before writing and returns KVA_ERR_PAGE_INDEX_OUT_OF_RANGE (nothing written); the CUDA backend returns
 * KVA_OK, writes the valid tokens only and records the first bad token in the context's append fault word
 * (kva_read_faults: request = token index, page_index = slot / page_size, clamped to the int32 range). */
KVA_API kva_status kva_append_paged_kv_cache_by_slot(kva_context* context, const kva_tensor* append_k,
                                                     const kva_tensor* append_v, const int64_t* slots, int64_t nnz,
                                                     const kva_paged_kv* paged, void* stream);

/* ---------------------------------------------------------------------------------------------- */
/* Device-side faults (CUDA backend): kernels bounds-check every page index where they load it; a request
 * with an out-of-range index gets o = 0, lse = -inf and is recorded in a status word inside the workspace.
 * This reads and clears that word (it synchronises with `stream`); each plan also clears it, so read it after
 * the step's runs and before the next plan into the same workspace. Append faults live in a context-owned
 * word: one call reports one fault word (the workspace's first), the other stays set for the next call.
 * The CPU backend validates before running, so it reports no device faults. */
typedef struct kva_fault_report {
    int32_t faulted;       /* nonzero if any request faulted since the last read */
    int32_t request;       /* first faulting request seen (-1 if unknown) */
    int64_t page_index;    /* the offending page index */
} kva_fault_report;

KVA_API kva_status kva_read_faults(kva_context* context, const kva_workspace* workspace, kva_fault_report* report,
                                   void* stream);

/* Standard ALiBi slopes for num_heads heads (host array of num_heads floats). */
KVA_API kva_status kva_alibi_slopes(int32_t num_heads, float* slopes);

/* ============================================================================================== */
/* Composable formats (src/core/formats.c): block-sparse attention and multi-level cascade attention. */
/* Both compose the batch-prefill (paged) op above (no kernels of their own), so they run on every    */
/* backend. Plan on host arrays, run with backend memory, like the ops above. Additive section.        */
/* ============================================================================================== */

/* ---- Block-sparse attention (BSR, scipy bsr_matrix semantics; FlashInfer's BlockSparseAttentionWrapper) ----
 *
 * q [M, num_qo_heads, head_dim_qk], k [N, num_kv_heads, head_dim_qk], v [N, num_kv_heads, head_dim_vo] (explicit
 * strides, unit last stride), o [M, num_qo_heads, head_dim_vo], lse [M, num_qo_heads] (optional, base 2).
 * The attention matrix [M, N] is cut into blocks of R rows x C columns (MB = ceil(M / R) block rows, the last one
 * may be short; NB = N / C column blocks, N % C == 0). Block row b attends to the column blocks
 * indices[indptr[b] .. indptr[b+1]) (any order, no repeats within a row). Key j of a listed block is visible to
 * query row i iff all of these hold:
 *   - the optional element mask says so: block_mask[(e * R + r) * C + c] != 0 for the e-th listed block
 *     (e indexes indices[], r = i - b * R, c = j - col * C); a NULL block_mask means every element is visible;
 *   - desc->mask_mode == KVA_MASK_CAUSAL: j <= i + (N - M) (bottom-right aligned over the DENSE matrix, so the
 *     usual j <= i when M == N);
 *   - desc->window_left >= 0: j >= i + (N - M) - window_left (dense positions too).
 * Rows with no visible key get o = 0, lse = -inf (every row of a block row with no listed block, for example).
 * Implementation: one batch-prefill (paged) plan whose requests are the block rows (R query rows each, the last
 * truncated to M), whose pages are the column blocks (page_size = C, last_page_len = C) and whose page pool is
 * K/V itself (num_pages = NB, page stride = C * token stride). An element mask, a causal mask or a window is
 * folded into that op's custom mask (the packed mask below), which the run reads from backend memory.
 * desc: mask_mode NONE or CAUSAL (CUSTOM is refused: give block_mask instead); pos_encoding must be
 * KVA_POS_NONE (the composed op does not see dense positions: KVA_ERR_UNSUPPORTED). Soft cap, sm_scale, every
 * dtype and sigmoid mode work as for the other ops.
 * Graph mode (params->graph_mode): for a fixed (desc, M, N, R, C) the workspace sizes, offsets and kernel grid do
 * not depend on the sparsity pattern, so a run captured in a CUDA graph replays correctly after re-planning a new
 * pattern into the same workspace (update the contents of the same indices / packed-mask buffers; the packed mask
 * is then always used, and its size is at most plan->max_mask_bytes). Variable block sizes per KV head: the
 * kva_vbsr_* functions below. */

typedef struct kva_bsr_params {
    int64_t num_qo_rows;        /* M >= 0 */
    int64_t num_kv_rows;        /* N >= 0, a multiple of block_cols */
    int32_t block_rows;         /* R >= 1 */
    int32_t block_cols;         /* C >= 1 (C = 1: vector sparsity) */
    const int32_t* indptr;      /* host [MB + 1]: indptr[0] = 0, non-decreasing */
    const int32_t* indices;     /* host [indptr[MB]]: column-block ids in [0, NB) */
    const uint8_t* block_mask;  /* optional host [indptr[MB], R, C] bytes, nonzero = visible (read by
                                   kva_bsr_mask_pack; the plan only notes whether it is NULL) */
    int32_t fixed_split_size;   /* as kva_plan_params (tokens) */
    int32_t disable_split_kv;   /* as kva_plan_params */
    int32_t graph_mode;         /* nonzero: layout and grid depend only on (desc, M, N, R, C); see above */
} kva_bsr_params;

KVA_API void kva_bsr_params_init(kva_bsr_params* params);

/* A BSR plan: plain data, caller-owned (the batch-prefill plan plus the facts the run checks). */
typedef struct kva_bsr_plan {
    kva_plan plan;             /* the batch-prefill (paged) plan underneath */
    int64_t num_qo_rows;       /* M */
    int64_t num_kv_rows;       /* N */
    int32_t block_rows;        /* R */
    int32_t block_cols;        /* C */
    int32_t num_block_rows;    /* MB */
    int32_t uses_mask;         /* nonzero: run reads a packed mask (element mask, causal or window) */
    int64_t nnz;               /* listed blocks (indptr[MB]) */
    int64_t mask_bytes;        /* bytes of the packed mask run reads (kva_bsr_mask_pack's size) */
    uint64_t magic;            /* set by kva_bsr_plan_make */
    int32_t graph_mode;        /* the plan was made in graph mode (uses_mask is then always 1) */
    int32_t pad_;
    int64_t max_mask_bytes;    /* bound on mask_bytes over every pattern of this (M, N, R, C): size graph buffers */
} kva_bsr_plan;

/* Exact workspace sizes for these inputs (same arguments as kva_bsr_plan_make). */
KVA_API kva_status kva_bsr_workspace_size(kva_context* context, const kva_attention_desc* desc,
                                          const kva_bsr_params* params, size_t* device_bytes, size_t* host_bytes);
/* Validates params (indptr, column ids, repeats, shapes) and desc, then plans like kva_plan_make (one async
 * copy on `stream` for CUDA). Nothing is written on an error. */
KVA_API kva_status kva_bsr_plan_make(kva_context* context, const kva_attention_desc* desc,
                                     const kva_bsr_params* params, const kva_workspace* workspace,
                                     kva_bsr_plan* plan, void* stream);
/* Pack the visibility of every listed block element (params->block_mask, causal and window of desc) into the
 * custom-mask layout of the composed op: block row b is a segment of rows_b * (blocks_b * C) bits
 * (bit r * blocks_b * C + (e - indptr[b]) * C + c, little bit order), segments byte aligned, in block-row order.
 * *packed_bytes gets the size (0 when the plan needs no mask). packed == NULL: size query only; else packed
 * (host memory) must hold capacity >= *packed_bytes bytes (else KVA_ERR_INVALID_ARGUMENT, nothing written).
 * Copy the result to backend memory and pass it to kva_bsr_run as packed_mask. Same params as the plan. */
KVA_API kva_status kva_bsr_mask_pack(const kva_attention_desc* desc, const kva_bsr_params* params, uint8_t* packed,
                                     size_t capacity, size_t* packed_bytes);

typedef struct kva_bsr_run_args {
    kva_tensor q;               /* [M, num_qo_heads, head_dim_qk], q_dtype */
    kva_tensor k;               /* [N, num_kv_heads, head_dim_qk], kv_dtype; any strides, unit last stride */
    kva_tensor v;               /* [N, num_kv_heads, head_dim_vo], kv_dtype */
    kva_tensor o;               /* [M, num_qo_heads, head_dim_vo], o_dtype */
    kva_tensor lse;             /* optional (data NULL = not wanted): [M, num_qo_heads] f32, base 2 */
    const int32_t* indices;     /* backend memory: the plan's column-block ids (same values as params->indices) */
    const uint8_t* packed_mask; /* backend memory: kva_bsr_mask_pack's bytes (required when plan->uses_mask) */
    int64_t packed_mask_bytes;  /* size of packed_mask (>= plan->mask_bytes) */
    float k_scale;              /* default 1 */
    float v_scale;              /* default 1 */
    void* stream;               /* CUDA stream; NULL = the legacy default stream */
} kva_bsr_run_args;

KVA_API void kva_bsr_run_args_init(kva_bsr_run_args* args);
/* Run a BSR plan. Never allocates or synchronises. Host-detected errors write nothing. Device faults (CUDA):
 * kva_read_faults on the same workspace. */
KVA_API kva_status kva_bsr_run(kva_context* context, const kva_bsr_plan* plan, const kva_workspace* workspace,
                               const kva_bsr_run_args* args);

/* ---- Variable block sizes per KV head (FlashInfer's VariableBlockSparseAttentionWrapper) ----
 *
 * Same tensors as BSR (q [M, Hq, dqk], k / v [N, Hkv, d], o [M, Hq, dvo], lse [M, Hq]; any strides, unit last
 * stride). For KV head h (and the g = Hq / Hkv query heads h*g .. h*g+g-1 that share it) the [M, N] matrix is cut
 * into MB block rows of heights block_row_sz[h*MB + b] (each >= 0, summing to M) and NB block columns of widths
 * block_col_sz[h*NB + c] (each >= 0, summing to N); key j is visible to query row i of head h iff the block
 * (b, c) holding (i, j) has block_mask_map[(h*MB + b)*NB + c] != 0 and, as for BSR, the dense causal mask
 * (desc->mask_mode == KVA_MASK_CAUSAL: j <= i + N - M) and window (desc->window_left) allow it.
 * Rows that see no key get o = 0, lse = -inf. pos_encoding must be KVA_POS_NONE; mask_mode NONE or CAUSAL.
 *
 * Implementation: one batch-prefill (paged) plan per KV head (a 1-KV-head op over that head's slices of q / k /
 * v / o / lse) with page size 1: request b is block row b, its "pages" are the key tokens of its visible column
 * blocks in column order, and the pool is the head's K / V rows. kva_vbsr_pack writes those token tables of all
 * heads (int32, head after head) and, with causal / window, the packed masks; copy both to backend memory for
 * run. The plans live in a caller array of num_kv_heads kva_plan (kept alive and unchanged while the plan is
 * used) and in one workspace (each head's region 256-byte aligned). Run launches num_kv_heads ops in order on
 * the stream. No graph mode. */

typedef struct kva_vbsr_params {
    int64_t num_qo_rows;            /* M >= 0 */
    int64_t num_kv_rows;            /* N >= 0 */
    int32_t num_block_rows;         /* MB >= 1 */
    int32_t num_block_cols;         /* NB >= 1 */
    const int32_t* block_row_sz;    /* host [num_kv_heads, MB]: rows of each block row (>= 0, sum M per head) */
    const int32_t* block_col_sz;    /* host [num_kv_heads, NB]: columns of each block column (>= 0, sum N) */
    const uint8_t* block_mask_map;  /* host [num_kv_heads, MB, NB]: nonzero = the block is visible */
    int32_t fixed_split_size;       /* as kva_plan_params (tokens), every head */
    int32_t disable_split_kv;       /* as kva_plan_params */
} kva_vbsr_params;

KVA_API void kva_vbsr_params_init(kva_vbsr_params* params);

typedef struct kva_vbsr_plan {
    int64_t num_qo_rows;        /* M */
    int64_t num_kv_rows;        /* N */
    int32_t num_kv_heads;       /* plans in head_plans */
    int32_t uses_mask;          /* nonzero: run reads the packed masks (causal or window) */
    int64_t table_entries;      /* int32 entries of the token tables (kva_vbsr_pack), all heads */
    int64_t mask_bytes;         /* bytes of the packed masks, all heads (0 when uses_mask is 0) */
    size_t device_bytes;        /* workspace bytes used */
    size_t host_bytes;
    uint64_t ws_device_addr;    /* the workspace it was planned into */
    kva_plan* head_plans;       /* the caller's array given to kva_vbsr_plan_make */
    uint64_t magic;             /* set by kva_vbsr_plan_make */
} kva_vbsr_plan;

/* Exact workspace sizes (device and host staging) for these inputs. */
KVA_API kva_status kva_vbsr_workspace_size(kva_context* context, const kva_attention_desc* desc,
                                           const kva_vbsr_params* params, size_t* device_bytes, size_t* host_bytes);
/* Validates desc and params (every head) first, then plans head h into head_plans[h] (an array of
 * desc->num_kv_heads plans) and its workspace region. Nothing is written on a validation error. */
KVA_API kva_status kva_vbsr_plan_make(kva_context* context, const kva_attention_desc* desc,
                                      const kva_vbsr_params* params, const kva_workspace* workspace,
                                      kva_plan* head_plans, kva_vbsr_plan* plan, void* stream);
/* Write the token tables (table: capacity >= table_entries int32) and, when the plan needs them, the packed masks
 * (mask: capacity >= mask_bytes bytes; may be NULL when *mask_bytes is 0) into host memory. NULL outputs: size
 * query only (*table_entries, *mask_bytes). Same desc and params as the plan. */
KVA_API kva_status kva_vbsr_pack(const kva_attention_desc* desc, const kva_vbsr_params* params, int32_t* table,
                                 size_t table_capacity, uint8_t* mask, size_t mask_capacity, int64_t* table_entries,
                                 int64_t* mask_bytes);

typedef struct kva_vbsr_run_args {
    kva_tensor q, k, v, o;      /* as kva_bsr_run_args */
    kva_tensor lse;             /* optional */
    const int32_t* table;       /* backend memory: kva_vbsr_pack's token tables */
    int64_t table_entries;      /* size of table (>= plan->table_entries) */
    const uint8_t* packed_mask; /* backend memory: kva_vbsr_pack's masks (when plan->uses_mask) */
    int64_t packed_mask_bytes;
    float k_scale;              /* default 1 */
    float v_scale;              /* default 1 */
    void* stream;
} kva_vbsr_run_args;

KVA_API void kva_vbsr_run_args_init(kva_vbsr_run_args* args);
/* Run every head's op. Never allocates or synchronises. Host-detected errors write nothing (on the CPU backend
 * this includes every table entry). Device faults (CUDA): kva_vbsr_read_faults. */
KVA_API kva_status kva_vbsr_run(kva_context* context, const kva_vbsr_plan* plan, const kva_workspace* workspace,
                                const kva_vbsr_run_args* args);
KVA_API kva_status kva_vbsr_read_faults(kva_context* context, const kva_vbsr_plan* plan,
                                        const kva_workspace* workspace, kva_fault_report* report, void* stream);

/* ---- Multi-level cascade attention on one paged pool (FlashInfer's MultiLevelCascadeAttentionWrapper) ----
 *
 * The KV of a query row is the concatenation of its KV at levels 0, 1, ..., num_levels - 1 (for example a system
 * prompt shared by all rows, then a conversation history shared by some, then each request's own suffix).
 * Level l is one batch-prefill (paged) step over the same q and the same page pool with its own qo_indptr: each
 * level-l "request" is a contiguous range of query rows that share that level's pages, so a shared prefix is
 * read once for all of its rows. Every level's qo_indptr covers all rows [0, total) in the caller's order (the
 * levels may group the rows differently; each row's attention state is merged over the levels, so no nesting
 * is required). Only the last level may be causal (desc->mask_mode == KVA_MASK_CAUSAL applies to it, with its
 * own kv_len and qo_len: bottom-right aligned within the last level, the earlier levels fully visible; this equals
 * causal attention over the concatenated KV when each last-level request has kv_len >= qo_len).
 * With num_levels > 1: no custom mask, no sliding window, no fused RoPE/ALiBi (positions are per level), softmax
 * only (KVA_ERR_UNSUPPORTED otherwise). Run: level 0 writes o / lse, each further level writes temporaries in the
 * workspace that are merged into o / lse with kva_merge_state_in_place.
 *
 * Workspace: ONE workspace holding every level's plan at its own offset (256-byte aligned) followed by the
 * merge temporaries (o [rows, num_qo_heads, head_dim_vo] in o_dtype and two lse [rows, num_qo_heads] f32, rows =
 * total rows, or max_total_qo_rows in graph mode; none for one level). kva_cascade_workspace_size gives the
 * exact device and host (CUDA staging) sizes; in graph mode they and every offset depend only on the bounds. */

#define KVA_CASCADE_MAX_LEVELS 8

typedef struct kva_cascade_level {
    int32_t batch_size;              /* requests of this level */
    const int32_t* qo_indptr;        /* host [B + 1]: qo_indptr[0] = 0, qo_indptr[B] = total rows (every level) */
    const int32_t* kv_indptr;        /* host [B + 1]: page indptr of this level's page table */
    const int32_t* kv_last_page_len; /* host [B] */
    const int32_t* kv_indices;       /* optional host copy of this level's page table (checked vs num_pages) */
} kva_cascade_level;

typedef struct kva_cascade_params {
    int32_t num_levels;              /* 1 .. KVA_CASCADE_MAX_LEVELS */
    kva_cascade_level levels[KVA_CASCADE_MAX_LEVELS];
    int32_t page_size;               /* >= 1, the pool's */
    int64_t num_pages;               /* pool size (or 0 = known at run only), as kva_plan_params */
    int32_t fixed_split_size;        /* as kva_plan_params, every level */
    int32_t disable_split_kv;        /* as kva_plan_params, every level */
    int32_t graph_mode;              /* as kva_plan_params: offsets and sizes depend only on the bounds below */
    int32_t max_batch_size;          /* graph mode: bound on every level's batch_size */
    int64_t max_total_qo_rows;       /* graph mode: bound on the total rows */
} kva_cascade_params;

KVA_API void kva_cascade_params_init(kva_cascade_params* params);

typedef struct kva_cascade_plan {
    int32_t num_levels;
    int32_t graph_mode;
    int64_t total_qo_rows;
    uint64_t magic;                                    /* set by kva_cascade_plan_make */
    uint64_t ws_device_addr;                           /* the workspace it was planned into */
    size_t level_device_offset[KVA_CASCADE_MAX_LEVELS]; /* byte offset of level l's plan in workspace->device */
    size_t level_device_bytes[KVA_CASCADE_MAX_LEVELS];
    size_t level_host_offset[KVA_CASCADE_MAX_LEVELS];   /* ... in workspace->host (CUDA staging) */
    size_t level_host_bytes[KVA_CASCADE_MAX_LEVELS];
    size_t tmp_o_offset;                               /* merge temporaries in workspace->device (0 = none) */
    size_t tmp_lse_offset;
    size_t acc_lse_offset;
    int64_t tmp_rows;                                  /* rows the temporaries hold */
    size_t device_bytes;                               /* workspace bytes used */
    size_t host_bytes;
    kva_plan levels[KVA_CASCADE_MAX_LEVELS];           /* level l's batch-prefill (paged) plan */
} kva_cascade_plan;

KVA_API kva_status kva_cascade_workspace_size(kva_context* context, const kva_attention_desc* desc,
                                              const kva_cascade_params* params, size_t* device_bytes,
                                              size_t* host_bytes);
/* Validates every level first (nothing is written on an error), then plans each level into its region. */
KVA_API kva_status kva_cascade_plan_make(kva_context* context, const kva_attention_desc* desc,
                                         const kva_cascade_params* params, const kva_workspace* workspace,
                                         kva_cascade_plan* plan, void* stream);

typedef struct kva_cascade_run_args {
    kva_tensor q;               /* [rows, num_qo_heads, head_dim_qk] */
    kva_tensor o;               /* [rows, num_qo_heads, head_dim_vo] */
    kva_tensor lse;             /* optional: [rows, num_qo_heads] f32, base 2, over the whole concatenated KV */
    kva_paged_kv paged;         /* the shared pool (paged.indices is not read: see kv_indices) */
    const int32_t* kv_indices[KVA_CASCADE_MAX_LEVELS]; /* backend memory: level l's page table */
    float k_scale;              /* default 1 */
    float v_scale;              /* default 1 */
    void* stream;
    /* appended: the length (entries) of kv_indices[l], 0 = not given (unchecked), as kva_paged_kv.num_indices:
       where given, run refuses a level whose planned page table (its kv_indptr[B]) is longer
       (KVA_ERR_PAGETABLE_MALFORMED); negative: KVA_ERR_INVALID_ARGUMENT. paged.num_indices is not read. */
    int64_t kv_num_indices[KVA_CASCADE_MAX_LEVELS];
} kva_cascade_run_args;

KVA_API void kva_cascade_run_args_init(kva_cascade_run_args* args);
/* Run every level and merge. Never allocates or synchronises. Host-detected errors write nothing (on the CPU
 * backend this includes every level's page indices). */
KVA_API kva_status kva_cascade_run(kva_context* context, const kva_cascade_plan* plan,
                                   const kva_workspace* workspace, const kva_cascade_run_args* args);
/* Device faults of every level (CUDA; see kva_read_faults): reads and clears every level's word and reports the
 * first faulting level's; where no level faulted, the context's append fault word (as kva_read_faults), which
 * otherwise stays set for the next read. kva_vbsr_read_faults does the same over the KV heads. */
KVA_API kva_status kva_cascade_read_faults(kva_context* context, const kva_cascade_plan* plan,
                                           const kva_workspace* workspace, kva_fault_report* report, void* stream);

#ifdef __cplusplus
}
#endif

#endif /* KVATTN_H */
