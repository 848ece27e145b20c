/*
 * internal.h - kvattn's internal contract between the core (status, context, planner, validation) and the
 * backends (CPU, CUDA). Not installed. Internal non-static symbols are prefixed kva__.
 */
#ifndef KVATTN_INTERNAL_H
#define KVATTN_INTERNAL_H

#include <pthread.h>
#include <stdarg.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>

#include "kvattn.h"

#ifdef __cplusplus
extern "C" {
#endif

#if defined(__GNUC__) || defined(__clang__)
#define KVA_PRINTF(a, b) __attribute__((format(printf, a, b)))
#define KVA_LIKELY(x) __builtin_expect(!!(x), 1)
#define KVA_UNLIKELY(x) __builtin_expect(!!(x), 0)
#else
#define KVA_PRINTF(a, b)
#define KVA_LIKELY(x) (x)
#define KVA_UNLIKELY(x) (x)
#endif

/* ---------------------------------------------------------------------------------------------- */
/* Errors: record (thread-local) and return. Pattern after zstd's RETURN_ERROR_IF / FORWARD_IF_ERROR. */

kva_status kva__set_error(kva_status status, const char* fmt, ...) KVA_PRINTF(2, 3);
/* keep the last message, change its status */
kva_status kva__retag_error(kva_status status);
/* A call that succeeds after an internal failure it recovered from (a backend fallback, a cache miss) puts back the
   thread's last error as it was before the call: save at the call's start, restore on its success. One level (a
   thread-local copy; the two calls that use it do not nest). */
void kva__error_save(void);
void kva__error_restore(void);

/* if (cond) record the message and return status */
#define KVA_RETURN_IF(cond, status, ...)                    \
    do {                                                    \
        if (KVA_UNLIKELY(cond)) return kva__set_error((status), __VA_ARGS__); \
    } while (0)

/* forward a non-OK status (the callee already recorded its message) */
#define KVA_FORWARD(expr)                 \
    do {                                  \
        kva_status kva__st_ = (expr);     \
        if (kva__st_ != KVA_OK) return kva__st_; \
    } while (0)

/* ---------------------------------------------------------------------------------------------- */
/* Context and logging                                                                             */

struct kva__backend_ops;

#define KVA__STAMP_SLOTS 128 /* workspaces whose latest plan the process remembers (kva__stamp_record) */
struct kva_context {
    kva_backend backend;
    int32_t device;
    int32_t num_workers;      /* W for the planner */
    int32_t num_threads;      /* CPU backend threads */
    kva_log_fn log_fn;
    void* log_user;
    kva_log_level log_level;
    char jit_cache_dir[1024];
    const struct kva__backend_ops* ops;
    void* backend_state;      /* owned by the backend */
    uint64_t id;              /* unique per context in the process; plans record it */
    int32_t min_kv_chunk;     /* shortest KV chunk the planner splits into (KVA__MIN_KV_CHUNK; benchmark A/B:
                                 $KVATTN_BENCH_MIN_KV_CHUNK at context creation) */
    int32_t small_kv_chunk;   /* batch decode with less than min_kv_chunk tokens of work per worker: chunks as short as
                                 this (<= 0 = off), as long as the longest tile keeps at most KVA__SMALL_SPLIT
                                 chunks. The CUDA backend sets 64 unless $KVATTN_BENCH_MIN_KV_CHUNK fixed
                                 min_kv_chunk (-1) */
    int32_t rs_max_split;     /* row-slot plans (kva__plan_data.row_slots): at most this many chunks per unit
                                 (KVA__RS_MAX_SPLIT; benchmark A/B: $KVATTN_BENCH_RS_SPLIT at context creation) */
    int32_t rs_multi_split;   /* row-slot plans of groups of at most 16 with two or more split units: at most this many
                                 chunks per unit (KVA__RS_MULTI_SPLIT, below rs_max_split; 0 = rs_max_split alone;
                                 benchmark A/B: $KVATTN_BENCH_RS_MULTI_SPLIT) */
    int32_t rs_multi_group;   /* the largest GQA group rs_multi_split applies to (KVA__RS_MULTI_GROUP; benchmark A/B:
                                 $KVATTN_BENCH_RS_MULTI_GROUP) */
    int32_t rs_merge_batch;   /* row-slot plans: the merge's partials per round trip (KVA__RS_MERGE_BATCH); the planner
                                 avoids b * k + 1 chunks per unit (kva__rs_round_chunk). 0 = off (benchmark A/B:
                                 $KVATTN_BENCH_RS_ROUND=0) */
    int32_t worker_head_bytes; /* > 0: plans reserve this many bytes per worker at off_worker_head for the backend's
                                  per-worker header (the CUDA backend: kvk_worker_head, 64 bytes); 0 = none */
    int32_t cluster_size;     /* > 1: batch-decode plans may combine split KV inside thread-block clusters of this many
                                 CTAs (the CUDA backend on sm_90; kva__backend_ops.cluster_ok decides per descriptor):
                                 a plan whose (request, KV head) units fit the clusters gives unit u's chunks to CTAs
                                 u * cluster_size + c, and graph-mode plans of such descriptors run on cluster_ctas
                                 workers (their grid is always launched in clusters). 0 = off */
    int32_t cluster_ctas;     /* CTAs of the clusters that fit on the device at once (a multiple of cluster_size) */
    int32_t cluster_max_chunk; /* the longest chunk (tokens) a cluster-combine plan gives one CTA */
    int plan_lpt_only;        /* benchmark A/B ($KVATTN_BENCH_PLAN_LPT=1 at context creation): prefill plans use the
                                 LPT order instead of the locality order */
    /* Planner scratch buffers, reused across plans (a plan that finds them busy uses its own). */
    int plan_scratch_busy;    /* taken with __atomic_exchange_n */
    void* plan_scratch[8];
    size_t plan_scratch_cap[8];
    /* Live user variants of this context (src/core/variant.c): plans and runs look them up here, so a destroyed
       variant or one of another context is reported instead of dereferenced. */
    pthread_mutex_t variant_mu;
    struct kva_variant** variants;
    int32_t num_variants, cap_variants;
};

/* The latest plan made into each recently used workspace, process-wide (device address -> plan stamp,
   KVA__STAMP_SLOTS slots, round-robin; addresses are unique across devices and the host under unified addressing,
   so plans of different contexts into one workspace are ordered too): run refuses an eager plan that a later plan
   into the same workspace replaced. Record that a plan was just made into the workspace at device address addr;
   returns its stamp. */
uint64_t kva__stamp_record(uint64_t addr, uint64_t graph_key);
/* Whether the plan (stamp, graph_key) may still run on the workspace at addr: 1 where the table no longer remembers
   addr; an eager plan (graph_key 0) only while it is the latest plan made into it; a graph-mode plan while the latest
   one there has its graph_key (itself or a re-plan whose work list it reads in the same layout: not an eager plan, nor
   other bounds, op, descriptor or context). */
int kva__stamp_current(uint64_t addr, uint64_t stamp, uint64_t graph_key);

void kva__log(const kva_context* ctx, kva_log_level level, const char* fmt, ...) KVA_PRINTF(3, 4);

/* ---------------------------------------------------------------------------------------------- */
/* Plan data: the public kva_plan's opaque bytes. Everything a backend needs at run time.           */

#define KVA__PLAN_MAGIC 0x6b76617474706c6eull /* "kvattpln" */
#define KVA__PLAN_VERSION 8
#define KVA__WS_ALIGN 256          /* alignment of every region in the workspace */
#define KVA__STATUS_BYTES 256      /* device fault status region at offset 0 of the device workspace */
#define KVA__MIN_KV_CHUNK 128      /* never split KV into chunks shorter than this (tokens) */
#define KVA__SMALL_SPLIT 16        /* see small_kv_chunk: the CUDA decode kernels' one-pass fused merge width */
#define KVA__RS_MAX_SPLIT 64       /* see rs_max_split: a split unit of row slots has its g <= 32 rows times its
                                      partials merged, by one CTA (the fused merge) or a warp per row where that is more
                                      than 512 pairs (CUDA backend, kva__cuda_merge_rows_pick; planner.c,
                                      kva__choose_chunk) */
#define KVA__RS_MULTI_SPLIT 32     /* see rs_multi_split: H100, 1 x 32k, 2 units (24/2, 32/2): 32 chunks of 1k (64
                                      CTAs, fused merge) 6.4 % / 4.5 % faster than 64 of 512 (128 CTAs, row merge),
                                      24/2 1 x 128k even; one unit keeps 64 (16/1 1 x 32k: 8.7 % faster than 32), as
                                      do groups over 16 (64/2 1 x 64k: 5.1 % faster than 32); session 47 */
#define KVA__RS_MULTI_GROUP 16     /* see rs_multi_group */
#define KVA__RS_MERGE_BATCH 16     /* see rs_merge_batch: kva_decode_hg.cuh's row-slot fused merge and the row merge
                                      (kva_merge_partials_rows) load 16 partials per round trip */
#define KVA__MAX_TILE_Q 128

/* Per-request table in the workspace (written by plan). */
typedef struct kva__request {
    int32_t qo_start;   /* first query row of the request in q/o */
    int32_t qo_len;     /* query rows */
    int32_t kv_start;   /* paged: first entry of the request in the page table; ragged: first K/V token row */
    int32_t kv_len;     /* tokens */
    int64_t mask_offset; /* custom mask: byte offset of the request's segment */
} kva__request;

/* One unit of work: packed query rows [row_start, row_start + rows) of one (request, KV head) against KV
 * positions [kv_start, kv_end). Packed row p is query row p / g, query head kv_head * g + p % g.
 * partial < 0: write o/lse directly; else write partial slot `partial` (rows in the slot are indexed
 * p - row_start). kv_start == kv_end is legal (the rows see no keys: o = 0, lse = -inf). */
typedef struct kva__work_item {
    int32_t req;
    int32_t kv_head;
    int32_t row_start;
    int32_t rows;
    int32_t kv_start;
    int32_t kv_end;
    int32_t partial;
    int32_t pad_;
} kva__work_item;

/* Merge of num_partials consecutive partial slots (in KV order) into o/lse for the tile's rows. */
typedef struct kva__merge_task {
    int32_t req;
    int32_t kv_head;
    int32_t row_start;
    int32_t rows;
    int32_t partial_first;
    int32_t num_partials;
} kva__merge_task;

/* Counts, at the start of the int region (graph-mode kernels read these from device memory). */
typedef struct kva__counts {
    int32_t batch_size;
    int32_t num_items;
    int32_t num_merge;
    int32_t num_partials;
    int64_t total_qo_rows;
    int64_t pad_[5];
} kva__counts;

/*
 * Workspace layout (byte offsets, every region KVA__WS_ALIGN aligned):
 *   device: [0, KVA__STATUS_BYTES) fault status (zeroed by each plan)
 *           [off_counts ...)       int region: counts, worker_indptr[W+1], worker headers (CUDA: W x 64 bytes),
 *                                  requests[B], items[], merge[]
 *           [off_partial_o ...)    float partials: o [num_partial_slots][tile_q][head_dim_vo] f32
 *           [off_partial_lse ...)  lse [num_partial_slots][tile_q] f32
 *   With a scratch region (kva_workspace.scratch) the two partial regions are at the same offsets less
 *   int_region_end, in scratch, and device ends at int_region_end.
 *   host (CUDA staging): a mirror of device bytes [0, int_region_end) copied with one async copy.
 * The CPU backend plans straight into the device workspace (host memory).
 */
typedef struct kva__plan_data {
    uint64_t magic;
    uint32_t version;
    uint32_t op;             /* kva_op */
    uint64_t context_id;
    int32_t backend;         /* kva_backend */
    int32_t graph_mode;
    kva_attention_desc desc; /* normalised: sm_scale, rope_scale, rope_theta filled in */
    uint64_t variant_id;     /* desc.variant's id (0 = none): run checks the variant is still alive */

    int32_t batch_size;
    int32_t group_size;      /* g */
    int64_t total_qo_rows;
    int64_t total_kv_tokens; /* ragged: kv_indptr[B]; paged: sum of kv lengths */
    int64_t num_page_entries; /* paged: kv_indptr[B] (length of the page table) */
    int32_t page_size;
    int32_t max_qo_len;
    int64_t num_pages;
    int32_t max_kv_len;
    int32_t num_workers;
    int32_t tile_q;
    int32_t kv_head_group;   /* G >= 1: a unit (tile, work item, merge task) spans KV heads kv_head * G .. + G - 1 and
                                their G x g query heads as packed rows (kv_head is the group's index); 1 = one head */
    int32_t kv_chunk_size;   /* 0 = no split */
    int32_t row_slots;       /* > 1 (batch decode, kv_head_group 1): the backend's kernel reads each unit's K/V once for
                                its tile of all g rows; the backend's kernel key (CUDA: 2 = one slot of 16 rows, 4 = two;
                                0 = not) */
    int32_t cluster_size;    /* > 1: the kernel is launched in thread-block clusters of this many CTAs (0 = not) */
    int32_t cluster_combine; /* 1: unit u's chunks are on CTAs u * cluster_size + c and combine inside the cluster */
    int32_t num_items;
    int32_t num_merge;
    int32_t num_partials;
    int32_t cap_items;       /* capacity of the items region */
    int32_t cap_merge;
    int32_t cap_partials;
    int32_t max_batch_size;  /* capacity of the request table */
    int32_t fixed_split_size;
    int64_t max_total_qo_rows;
    int64_t custom_mask_bytes; /* total bytes of the packed custom mask the plan expects */
    int64_t max_worker_cost;
    int64_t total_cost;

    size_t off_counts;
    size_t off_worker_indptr;
    size_t off_worker_head;  /* [num_workers][worker_head_bytes] (0 = no header region; backend-written) */
    size_t off_requests;
    size_t off_items;
    size_t off_merge;
    size_t int_region_end;   /* bytes copied host -> device */
    size_t off_partial_o;
    size_t off_partial_lse;
    size_t device_bytes;     /* total device bytes used */
    size_t host_bytes;
    uint64_t ws_device_addr; /* the workspace the plan was written into (run must use the same) */
    uint64_t ws_host_addr;
    uint64_t stamp;           /* kva__stamp_record's stamp (0: none) */
    uint64_t graph_key;       /* graph-mode plans: a nonzero key of the facts every re-plan shares (context, op,
                                 descriptor shape, page size, workers, tile size, capacities, work-list layout);
                                 0 for eager plans */
    uint64_t ws_scratch_addr; /* != 0: the partials live in the workspace's scratch region at this address
                                 (off_partial_* relative to it; device_bytes = int_region_end); run must pass it */
    size_t scratch_bytes;     /* bytes of it the plan uses */

    uint64_t backend_data[16]; /* backend-specific plan facts (e.g. chosen kernel ids) */
    uint64_t seal;             /* kva__plan_hash of every byte before it, set last by kva_plan_make: a plan whose
                                  bytes changed after (a stray write into the caller's kva_plan) is refused by run */
} kva__plan_data;

_Static_assert(sizeof(kva__plan_data) <= sizeof(kva_plan), "kva__plan_data must fit in kva_plan");

/* The dtype classes the core validates against: float (q, o, merge states) and KV (float or fp8). */
static inline bool kva__is_float_dtype(kva_dtype t) {
    return t == KVA_DTYPE_F32 || t == KVA_DTYPE_F16 || t == KVA_DTYPE_BF16;
}
static inline bool kva__is_kv_dtype(kva_dtype t) {
    return kva__is_float_dtype(t) || t == KVA_DTYPE_E4M3 || t == KVA_DTYPE_E5M2;
}

/* Word-wise hash of the plan's bytes before `seal` (about 70 multiply-xor steps: cheap enough for every run). */
static inline uint64_t kva__plan_hash(const kva__plan_data* pd) {
    const unsigned char* b = (const unsigned char*)(const void*)pd;
    uint64_t h = 0x9e3779b97f4a7c15ull;
    for (size_t i = 0; i + 8 <= offsetof(kva__plan_data, seal); i += 8) {
        uint64_t w;
        memcpy(&w, b + i, 8);
        h = (h ^ w) * 0x100000001b3ull;
        h ^= h >> 29;
    }
    return h;
}
static inline void kva__plan_seal(kva__plan_data* pd) { pd->seal = kva__plan_hash(pd); }
/* A plan made by kva_plan_make of this version, its bytes unchanged since (magic, version, seal). */
static inline int kva__plan_intact(const kva__plan_data* pd) {
    return pd->magic == KVA__PLAN_MAGIC && pd->version == KVA__PLAN_VERSION && pd->seal == kva__plan_hash(pd);
}

static inline kva__plan_data* kva__plan_data_of(kva_plan* plan) { return (kva__plan_data*)(void*)plan->opaque; }
static inline const kva__plan_data* kva__plan_data_ofc(const kva_plan* plan) {
    return (const kva__plan_data*)(const void*)plan->opaque;
}

static inline const kva__counts* kva__ws_counts(const kva__plan_data* p, const void* base) {
    return (const kva__counts*)((const char*)base + p->off_counts);
}
static inline const int32_t* kva__ws_worker_indptr(const kva__plan_data* p, const void* base) {
    return (const int32_t*)((const char*)base + p->off_worker_indptr);
}
static inline const kva__request* kva__ws_requests(const kva__plan_data* p, const void* base) {
    return (const kva__request*)((const char*)base + p->off_requests);
}
static inline const kva__work_item* kva__ws_items(const kva__plan_data* p, const void* base) {
    return (const kva__work_item*)((const char*)base + p->off_items);
}
static inline const kva__merge_task* kva__ws_merge(const kva__plan_data* p, const void* base) {
    return (const kva__merge_task*)((const char*)base + p->off_merge);
}
/* the partials' base: the workspace's scratch region when the plan put them there, else its device region */
static inline void* kva__ws_partial_base(const kva__plan_data* p, const kva_workspace* ws) {
    return p->ws_scratch_addr ? ws->scratch : ws->device;
}
static inline float* kva__ws_partial_o(const kva__plan_data* p, const kva_workspace* ws) {
    return (float*)((char*)kva__ws_partial_base(p, ws) + p->off_partial_o);
}
static inline float* kva__ws_partial_lse(const kva__plan_data* p, const kva_workspace* ws) {
    return (float*)((char*)kva__ws_partial_base(p, ws) + p->off_partial_lse);
}

/* ---------------------------------------------------------------------------------------------- */
/* Backends                                                                                        */

#define KVA__FAULTS_WS 1     /* read_faults: the workspace's fault word */
#define KVA__FAULTS_APPEND 2 /* read_faults: the context's append fault word */

typedef struct kva__backend_ops {
    const char* name;
    bool plans_on_host_memory; /* true: plan writes straight into workspace->device (CPU) */
    /* Does this backend support the descriptor for this op? (One function answers "supported?" and
       "which kernel?": backends that pick kernels store their choice in plan->backend_data during
       prepare_plan.) Message explains what is unsupported. */
    kva_status (*check_desc)(const kva_context* ctx, const kva_attention_desc* desc, kva_op op);
    /* Packed query rows per tile for this op and average packed query length (a small pure heuristic). */
    int32_t (*choose_tile_q)(const kva_context* ctx, const kva_attention_desc* desc, kva_op op,
                             double avg_packed_qo_len, int32_t max_packed_qo_len);
    /* Called after the planner filled the plan data and the int region (host side): pick kernels, then (CUDA)
       copy the int region to the device on `stream`. */
    kva_status (*finish_plan)(kva_context* ctx, kva__plan_data* plan, const kva_workspace* ws, void* stream);
    /* Run a validated plan: args were checked against the plan by the core. */
    kva_status (*run)(kva_context* ctx, const kva__plan_data* plan, const kva_workspace* ws,
                      const kva_run_args* args);
    kva_status (*merge_state)(kva_context* ctx, const kva_tensor* v_a, const kva_tensor* s_a, const kva_tensor* v_b,
                              const kva_tensor* s_b, const kva_tensor* v_out, const kva_tensor* s_out,
                              const uint8_t* mask, void* stream);
    kva_status (*merge_states)(kva_context* ctx, const kva_tensor* v, const kva_tensor* s, const int32_t* indptr,
                               int64_t rows, const kva_tensor* v_out, const kva_tensor* s_out, void* stream);
    /* slots != NULL: kva_append_paged_kv_cache_by_slot (batch_indices, positions, batch_size and the paged table
       fields unused) */
    kva_status (*append_paged_kv)(kva_context* ctx, const kva_tensor* append_k, const kva_tensor* append_v,
                                  const int32_t* batch_indices, const int32_t* positions, const int64_t* slots,
                                  int64_t nnz, const kva_paged_kv* paged, int32_t batch_size, void* stream);
    /* which: KVA__FAULTS_WS (the workspace's word) | KVA__FAULTS_APPEND (the context's append word); reports and
       clears one word per call, the workspace's first */
    kva_status (*read_faults)(kva_context* ctx, const kva_workspace* ws, int which, kva_fault_report* report,
                              void* stream);
    void (*destroy)(kva_context* ctx);
    /* Compile a validated user variant for this backend (fills the backend part of *v); KVA_ERR_JIT with the
       compiler log, KVA_ERR_UNSUPPORTED without a compiler. variant_release frees what compile made. */
    kva_status (*variant_compile)(kva_context* ctx, struct kva_variant* v);
    void (*variant_release)(kva_context* ctx, struct kva_variant* v);
    /* Workers for a plan whose (query tile, KV head) units number `units` and read `tokens` KV rows in all (per KV
       head), at most ctx->num_workers (NULL: always ctx->num_workers). Outside graph mode the planner keeps a
       smaller count only if the split then gives each worker at most one item. Graph-mode plans ask with the
       bounds' units and tokens = -1 (unknown) and keep the answer whatever the lengths: their grid must not
       depend on the lengths. */
    int32_t (*plan_workers)(const kva_context* ctx, const kva_attention_desc* desc, kva_op op, int64_t units,
                            int64_t tokens);
    /* KV heads per unit for a plan outside graph mode (NULL: 1), given the validated params and the sum and maximum
       of the KV lengths; a result G > 1 must divide num_kv_heads and may set *workers (1 <= *workers <=
       ctx->num_workers) to the worker count of its kernel. With a result of 1 the backend may instead set
       *row_slots > 1 (and *workers): one KV head per unit, and a tile of the whole group (g rows) for a kernel that
       reads each unit's K/V once for all of them. */
    int32_t (*kv_head_group)(const kva_context* ctx, const kva_attention_desc* desc, kva_op op,
                             const kva_plan_params* params, int64_t total_kv, int64_t max_kv, int32_t* workers,
                             int32_t* row_slots);
    /* With ctx->cluster_size > 1: whether a batch-decode plan of this descriptor at this tile size runs on a kernel
       that combines split KV inside thread-block clusters (NULL: yes). */
    bool (*cluster_ok)(const kva_context* ctx, const kva_attention_desc* desc, kva_op op, int32_t tile_q);
} kva__backend_ops;

/* CPU backend (src/cpu). init sets ctx->ops, ctx->backend_state, ctx->num_workers. */
kva_status kva__cpu_init(kva_context* ctx);
/* CUDA backend (src/cuda); returns KVA_ERR_NO_DEVICE when no usable device (then AUTO falls back to CPU). */
kva_status kva__cuda_init(kva_context* ctx);

/* ---------------------------------------------------------------------------------------------- */
/* Shared helpers                                                                                  */

/* Normalise defaults (sm_scale, rope) into *out and validate generic constraints. */
kva_status kva__desc_normalize(const kva_attention_desc* in, kva_attention_desc* out);
/* ALiBi slope for head h of n (standard geometric series, extra odd powers for non powers of two). */
float kva__alibi_slope(int32_t head, int32_t num_heads);
/* Does query row i of a request see key j? (the mask semantics of kvattn.h, custom bits excluded) */
static inline bool kva__visible(const kva_attention_desc* d, int64_t q_pos, int64_t kv_pos) {
    if (d->mask_mode == KVA_MASK_CAUSAL && kv_pos > q_pos) return false;
    if (d->window_left >= 0 && kv_pos < q_pos - d->window_left) return false;
    return true;
}

/* Tensor checks used by the core and the backends. */
kva_status kva__check_tensor(const char* name, const kva_tensor* t, kva_dtype dtype, int32_t ndim, const int64_t* shape);
/* an output (after kva__check_tensor): no dim of more than one element with stride 0 */
kva_status kva__check_written(const char* name, const kva_tensor* t);
/* Paged K/V fields every call checks: strides non-negative with the farthest element of the pool addressable
   without overflow, num_indices non-negative. */
kva_status kva__check_paged_fields(const char* name, const kva_paged_kv* pk);
/* Largest element offset of a tensor of dtype whose byte offset stays below 2^63. */
int64_t kva__max_elem_offset(kva_dtype dtype);

/* Size helpers */
static inline size_t kva__align_up(size_t x, size_t a) { return (x + a - 1) / a * a; }
static inline int64_t kva__ceil_div64(int64_t a, int64_t b) { return (a + b - 1) / b; }

/* ---------------------------------------------------------------------------------------------- */
/* User variants (src/core/variant.c; docs/variants.md)                                            */

#define KVA__VARIANT_MAGIC 0x6b76617661726e74ull /* "kvavarnt" */

/* The run-time parameter block of a variant, shared with the kernels (kvk_vparams in kva_kparams.h and the
   prelude's kva_vparams have this layout). */
typedef struct kva__vparams {
    float s[KVA_VARIANT_MAX_SCALARS];
    const float* t[KVA_VARIANT_MAX_TENSORS];
} kva__vparams;

/* CPU backend: row-wise entry points exported by the variant's shared object (wrappers around the hooks). */
typedef void (*kva__vx_query_fn)(const kva__vparams* p, float* q, int n, int batch, int qo_head, int q_pos);
typedef void (*kva__vx_key_fn)(const kva__vparams* p, float* k, int n, int batch, int kv_head, int kv_pos);
/* logits s[0..nt) of keys kv_pos0 + t: keeps -inf (masked by the built-in masks), applies the mask hook and the
   logits transform; use_softmax: masked -> -inf, else masked -> 0 (weights). Returns 1 if it masked any key. */
typedef int (*kva__vx_logits_fn)(const kva__vparams* p, float* s, int nt, int batch, int qo_head, int kv_head,
                                 int q_pos, int kv_pos0);
typedef void (*kva__vx_output_fn)(const kva__vparams* p, float* o, int n, float lse, int batch, int qo_head,
                                  int q_pos);

struct kva_variant {
    uint64_t magic;
    uint64_t id;          /* unique in the process, never reused */
    kva_context* ctx;
    char name[KVA_VARIANT_MAX_NAME + 1];
    char* source;         /* the user's hook source (copy) */
    uint32_t hooks;       /* KVA_VARIANT_* */
    int32_t use_softmax;
    int32_t num_scalars;
    int32_t num_tensors;
    uint64_t hash;        /* FNV-1a of name, source, hooks, use_softmax and the parameter counts */
    /* CPU backend */
    void* dl;
    kva__vx_query_fn cpu_query;
    kva__vx_key_fn cpu_key;
    kva__vx_logits_fn cpu_logits;
    kva__vx_output_fn cpu_output;
    /* CUDA backend: the NVRTC main sources of the variant's kernels (prelude + hooks + kernel templates): the
       CUDA-core attention kernel's, and the tensor-core kernel's (variants without query / key transforms) */
    char* cuda_src;
    char* cuda_src_pf;
};

/* The C text every variant source is compiled with, before the user's hooks, for a host C compiler (cuda = 0) or
   for NVRTC (cuda = 1). Static strings. */
const char* kva__variant_prelude(int cuda);
/* Is v a live variant of ctx (and, when id != 0, the one with this id)? Never dereferences a dead pointer. */
kva_status kva__variant_check_live(kva_context* ctx, const kva_variant* v, uint64_t id, const char* what);
/* Run-time variant arguments against the plan's variant (counts, pointers) and packing into *vp (may be NULL). */
kva_status kva__variant_check_args(kva_context* ctx, const kva_attention_desc* d, uint64_t id, const kva_run_args* a,
                                   kva__vparams* vp);
/* Destroy every variant still registered with ctx (context destruction). */
void kva__variants_destroy_all(kva_context* ctx);

/* FNV-1a 64-bit over n bytes, continuing from h (start with KVA__FNV_SEED). */
#define KVA__FNV_SEED 0xcbf29ce484222325ull
uint64_t kva__fnv(uint64_t h, const void* data, size_t n);
/* The JIT cache directory (configured, $KVATTN_CACHE_DIR, $XDG_CACHE_HOME/kvattn, ~/.cache/kvattn), created 0700
   and checked to be owned by this user and not writable by group or others. Returns 0 when none is usable. */
int kva__jit_cache_dir(const char* configured, char* out, size_t size);
/* A regular file owned by this user, not writable by group or others, not a symlink? (cache entries) */
int kva__jit_file_safe(const char* path);
/* All n bytes to fd (retrying short writes and EINTR); 0 on a failed or empty write. */
int kva__jit_write_all(int fd, const void* data, size_t n);
/* A new file "<dir>/.<hash>.XXXXXX<suffix>" with a fresh random XXXXXX, created 0600, exclusively and close-on-exec
   (a file of that name left by a process that died, or made by another one, is never reused or removed); its name
   goes to path. The descriptor, or -1 (errno set; ENAMETOOLONG when the name does not fit in size). */
int kva__jit_open_unique(char* path, size_t size, const char* dir, const char* hash, const char* suffix);
/* The nparts byte ranges, in order, to a new file named as kva__jit_open_unique does. 1, or 0 on failure with nothing
   left behind (errno kept). */
int kva__jit_write_unique(char* path, size_t size, const char* dir, const char* hash, const char* suffix, int nparts,
                          const void* const* parts, const size_t* lens);
/* $KVATTN_JIT is 0 / off / no / false: nothing is compiled at run time. A kernel or variant that is neither prebuilt
   nor in the cache is then KVA_ERR_UNSUPPORTED (for deployments that must never stall on a compile). */
int kva__jit_disabled(void);
/* Removes the temporary files (".<hash>.<random><suffix>", regular, this user's) of dir last modified at least
   max_age_s seconds ago: what a process killed while writing or compiling left behind. Cache entries, other names,
   links and younger files are left alone. Returns how many were removed (logged at KVA_LOG_INFO to ctx, if any). */
#define KVA__JIT_STALE_S 3600
int kva__jit_sweep(const kva_context* ctx, const char* dir, long max_age_s);
/* Atomic publication of a cache entry: the parts to a unique temporary file in dir, renamed over final_path (readers
   see the old entry or the whole new one). 1, or 0 with nothing left behind. */
int kva__jit_publish(const char* dir, const char* hash, const char* final_path, int nparts, const void* const* parts,
                     const size_t* lens);

/* Planner (src/plan/planner.c): pure C. Fills *pd (counts and layout) without writing any workspace. */
kva_status kva__plan_layout(kva_context* ctx, const kva_attention_desc* desc, kva_op op,
                            const kva_plan_params* params, kva__plan_data* pd);
typedef struct kva__plan_request_in {
    int32_t qo_len;
    int32_t kv_len;
} kva__plan_request_in;

#ifdef __cplusplus
}
#endif

#endif /* KVATTN_INTERNAL_H */
