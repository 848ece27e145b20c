/*
 * kva_kparams.h - kernel parameter blocks and workspace records shared by the CUDA host code (C11) and the
 * kernels (CUDA C, compiled by nvcc ahead of time or by NVRTC at plan time). Plain C, fixed-width fields only.
 *
 * The workspace records mirror kva__request / kva__work_item / kva__merge_task / kva__counts of
 * src/core/internal.h; src/cuda/cuda_backend.c checks the layouts with static asserts.
 */
#ifndef KVA_KPARAMS_H
#define KVA_KPARAMS_H

#if defined(__CUDACC_RTC__)
typedef signed char kvk_i8;
typedef unsigned char kvk_u8;
typedef int kvk_i32;
typedef unsigned int kvk_u32;
typedef long long kvk_i64;
typedef unsigned long long kvk_u64;
#else
#include <stdint.h>
typedef int8_t kvk_i8;
typedef uint8_t kvk_u8;
typedef int32_t kvk_i32;
typedef uint32_t kvk_u32;
typedef int64_t kvk_i64;
typedef uint64_t kvk_u64;
#endif

/* dtype codes (the values of kva_dtype) */
#define KVK_F32 0
#define KVK_F16 1
#define KVK_BF16 2
#define KVK_E4M3 3
#define KVK_E5M2 4

/* threads per CTA of every attention kernel */
#define KVK_THREADS 128

/* geometry of the CUDA-core attention kernel (kva_decode.cuh), shared with the host for the smem size */
#define KVK_DEC_ES(kt) (((kt) == KVK_E4M3 || (kt) == KVK_E5M2) ? 1 : 2)
#define KVK_DEC_TILE(dqk) (4096 / (dqk))
#define KVK_DEC_STAGES(es) ((es) == 1 ? 8 : 4)
#define KVK_DEC_SMEM(dqk, dvo, es, rows) \
    (KVK_DEC_STAGES(es) * KVK_DEC_TILE(dqk) * ((dqk) + (dvo)) * (es) + 2 * KVK_DEC_TILE(dqk) * (rows) * 4 + 288)

/* geometry of the tensor-core decode kernel (kva_decode_tc.cuh): 4 warps, each with its own pipeline of
   KVK_TC_STAGES subtiles of 16 tokens (K + V: 32 * d * es bytes), about 24 KB per warp (d 256 x 16-bit: 48 KB);
   a cross-warp combine buffer [4][d][rows] f32; 256 + 16 * stages + 16 bytes of row factors and flags. */
/* shared-memory bytes of a token row: d * es, at least 128 (fp8 at head dim 64 keeps its 64-byte rows in 128-byte
   slots, every other 16-byte chunk, so the swizzle below stays conflict-free) */
#define KVK_TC_SROWB(d, es) ((d) * (es) < 128 ? 128 : (d) * (es))
#define KVK_TC_STAGES(d, es)                                                                                \
    (24576 / (32 * KVK_TC_SROWB(d, es)) < 3                                                                 \
         ? 3                                                                                                \
         : (24576 / (32 * KVK_TC_SROWB(d, es)) > 8 ? 8 : 24576 / (32 * KVK_TC_SROWB(d, es))))
#define KVK_TC_SMEM(d, es, rows) KVK_TC_SMEM_NW(d, es, rows, 4)
/* the same kernel with nw warps (4 or 8): every per-warp region scales with nw */
#define KVK_TC_SMEM_NW(d, es, rows, nw)                                                                     \
    ((nw) * KVK_TC_STAGES(d, es) * 32 * KVK_TC_SROWB(d, es) + (nw) * (d) * (rows) * 4 + 64 * (nw) +         \
     4 * (nw) * KVK_TC_STAGES(d, es) + 16)

/* geometry of the head-group decode kernel (kva_decode_hg.cuh, sm_90): a ring of stages of one 16-token subtile of
   K and V for g heads (rb / 128 TMA boxes of [g][16][128 B] each for K and for V: rb * g * 32 bytes, where rb is the
   bytes of one head's token row: 256 at head dim 128 x 16-bit, 128 at 64 x 16-bit and at 128 x fp8), 192 KB at 256 B x
   4 heads; full and empty mbarriers and a fault word per stage, 16 bytes of merge flags; the combine buffer [consumer
   warps but one a head / slot][32 lanes] of KVK_HG_COMB_FLOATS (odd: conflict-free); 1 KB of slack to align the stages
   to the 128-byte swizzle's period. */
#define KVK_HG_STAGES(rb) ((rb) <= 128 ? 12 : 6)
#define KVK_HG_STAGE_BYTES(rb, g) ((rb) * (g) * 32)
/* combine record per lane: m0 m1 l0 l1 fault, then the lane's output accumulators (d / 4 floats of 2 rows; row slots:
   d / 2 of 2 rows of a 16-row tile) */
#define KVK_HG_COMB_FLOATS(d, rs) ((rs) ? 5 + (d) / 2 : 5 + (d) / 4)
/* row slots (rs = 1, "_rs": g / 2 slots of 16 query rows over one KV head): stages of one head, 160 KB of them (the
   combine buffer of 8 consumer warps' 16-row tiles takes the rest), 128 KB (16 stages) for one slot of 8 parts: the
   stage count is a multiple of the parts (kva_decode_hg.cuh) */
#define KVK_HG_NSTAGES(rb, g, rs) \
    ((rs) ? ((rb) > 128 && (g) == 2 ? 16 : KVK_HG_STAGES(rb) * 10 / 3) : KVK_HG_STAGES(rb))
/* consumer warps: 2 per head; row slots: 8 (g / 2 slots of 16 rows, 16 / g warps a slot) */
#define KVK_HG_CONSUMERS(g, rs) ((rs) ? 8 : 2 * (g))
#define KVK_HG_SLOTS(g, rs) ((rs) ? (g) / 2 : (g))
/* consumer warps per head / row slot (each takes every PARTS-th subtile) */
#define KVK_HG_PARTS(g, rs) (KVK_HG_CONSUMERS(g, rs) / KVK_HG_SLOTS(g, rs))
#define KVK_HG_OFF_COMB(rb, g, rs)                                                                           \
    ((KVK_HG_NSTAGES(rb, g, rs) * KVK_HG_STAGE_BYTES(rb, (rs) ? 1 : (g)) + 20 * KVK_HG_NSTAGES(rb, g, rs) + 16 + 15) & \
     ~15)
/* every consumer warp but the first of each head / slot publishes its combine record */
#define KVK_HG_SMEM(d, rb, g, rs)                                                                             \
    (1024 + KVK_HG_OFF_COMB(rb, g, rs) +                                                                      \
     (KVK_HG_CONSUMERS(g, rs) - KVK_HG_SLOTS(g, rs)) * 32 * KVK_HG_COMB_FLOATS(d, rs) * 4)
/* head-group decode CTA: the consumer warps and the producer warps (1 TMA producer for stages of 2 or 4 heads; 2 for
   row slots' one-head stages; 2 cp.async producers for pages of other than 16k tokens, the "_ga" kernels) */
#define KVK_HG_PRODUCERS(ga, rs) ((ga) || (rs) ? 2 : 1)
#define KVK_HG_THREADS(g, ga, rs) (32 * (KVK_HG_CONSUMERS(g, rs) + KVK_HG_PRODUCERS(ga, rs)))

/* runtime flags of the attention kernels */
#define KVK_FLAG_ALIBI 1u       /* ALiBi bias (slopes from alibi_slopes, or the standard ones) */
#define KVK_FLAG_SOFTCAP 2u     /* logits soft cap */
#define KVK_FLAG_SIGMOID 4u     /* sigmoid scores (no softmax) */
#define KVK_FLAG_CAUSAL 8u      /* causal mask (bottom-right aligned) */
#define KVK_FLAG_CUSTOM 16u     /* packed custom mask */
#define KVK_FLAG_WINDOW 32u     /* sliding window (window_left >= 0) */
#define KVK_FLAG_RAGGED 64u     /* K/V rows addressed by token (no page table) */
#define KVK_FLAG_TRANSFORM 128u /* logits need the natural-log domain (ALiBi, soft cap, a variant's logits hooks or weights) */
#define KVK_FLAG_FUSED_MERGE 256u /* tensor-core kernel: the last CTA of a merge task merges it (no merge kernel) */
#define KVK_FLAG_KV_ONCE 1024u  /* tensor-core decode kernel: L2 evict-first K/V copies (each row read by one item; the host
                                   sets it only for calls reading at most 4 x L2 of K/V); without it, copies carry
                                   no cache hint (fp8 at head dim 128: the evict-normal one) */
#define KVK_FLAG_TMA 512u       /* Hopper prefill: kvk_tma holds K/V tensor maps (TMA copies of full tiles) */
#define KVK_FLAG_CLUSTER 2048u  /* tensor-core decode kernel (sm_90): launched in thread-block clusters; a split item with
                                   pad_ = -n is chunk (cluster rank) of a unit of n chunks on ranks 0 .. n - 1, which
                                   combine through distributed shared memory (KVK_TC_CC_BYTES after the kernel's
                                   shared memory) */

/* the cluster combine's shared memory (tensor-core decode kernel, after KVK_TC_SMEM_NW rounded up to 16 bytes): an
   mbarrier (16 bytes), the lse of every rank [16][rows], the rank's slice of every rank's partial [n][ceil(d / n)][rows]
   (at most (d + 15) x rows floats for n <= 16) */
#define KVK_TC_CC_MAX 16
#define KVK_TC_CC_BYTES(d, rows) (16 + KVK_TC_CC_MAX * (rows) * 4 + ((d) + KVK_TC_CC_MAX) * (rows) * 4)
#define KVK_TC_CC_OFF(d, es, rows, nw) ((KVK_TC_SMEM_NW(d, es, rows, nw) + 15) & ~15)

/* lse value written into a partial slot by a work item whose request hit an out-of-range page index
   (a NaN with a payload no arithmetic produces); the merge kernel then outputs o = 0, lse = -inf. */
#define KVK_FAULT_LSE_BITS 0x7fbadbadu

/* Device fault status region (offset 0 of the device workspace, KVA__STATUS_BYTES long, zeroed by plan). */
typedef struct kvk_status {
    kvk_u64 first_key; /* atomicMax of ~((request << 32) | (u32)page): the smallest (request, page) wins */
    kvk_u32 count;     /* number of faulting work items */
    kvk_u32 pad0;
} kvk_status;

typedef struct kvk_request {
    kvk_i32 qo_start;
    kvk_i32 qo_len;
    kvk_i32 kv_start;
    kvk_i32 kv_len;
    kvk_i64 mask_offset;
} kvk_request;

typedef struct kvk_work_item {
    kvk_i32 req;
    kvk_i32 kv_head;
    kvk_i32 row_start;
    kvk_i32 rows;
    kvk_i32 kv_start;
    kvk_i32 kv_end;
    kvk_i32 partial;
    kvk_i32 pad_;
} kvk_work_item;

/* Per-worker header (CUDA decode kernels; one 64-byte line per worker at off_worker_head, written by the backend's
   finish_plan): the worker's item range, its first item and that item's request, so a CTA's first page-index load
   depends on one load instead of the chain worker range -> item -> request. */
typedef struct kvk_worker_head {
    kvk_i32 it_begin;
    kvk_i32 it_end;
    kvk_request rq;      /* requests[item.req] (zero when the worker has no item) */
    kvk_work_item item;  /* items[it_begin] */
} kvk_worker_head;

typedef struct kvk_merge_task {
    kvk_i32 req;
    kvk_i32 kv_head;
    kvk_i32 row_start;
    kvk_i32 rows;
    kvk_i32 partial_first;
    kvk_i32 num_partials;
} kvk_merge_task;

typedef struct kvk_counts {
    kvk_i32 batch_size;
    kvk_i32 num_items;
    kvk_i32 num_merge;
    kvk_i32 num_partials;
    kvk_i64 total_qo_rows;
    kvk_i64 pad_[5];
} kvk_counts;

/* Attention (decode / small-tile) kernel. Strides in elements. */
typedef struct kvk_attn_params {
    const void* q;
    void* o;
    float* lse;                 /* may be NULL */
    const void* k;
    const void* v;
    const kvk_i32* indices;     /* page table (paged) */
    char* ws;                   /* device workspace base */
    const kvk_u8* custom_mask;  /* KVK_FLAG_CUSTOM */
    const float* alibi_slopes;  /* KVK_FLAG_ALIBI; NULL = standard slopes */
    /* byte offsets from ws; off_partial_o / off_partial_lse reach the workspace's scratch region when the plan put
       the partials there (kva_workspace.scratch): a 64-bit address difference, possibly negative */
    kvk_i64 off_counts, off_worker_indptr, off_requests, off_items, off_partial_o, off_partial_lse;
    kvk_i64 off_merge;          /* merge tasks (fused merge) */
    kvk_i64 off_worker_head;    /* kvk_worker_head[grid] (decode kernels) */
    kvk_i64 off_int_end;        /* end of the plan's int region (the bytes the decode kernels warm in L2) */
    kvk_i64 num_entries;        /* page-table entries of the plan (L2 prefetch) */
    kvk_u64* trace;             /* benchmark trace (kernels built with KVA_TC_TRACE), else NULL */
    kvk_i64 q_stride_row, q_stride_head;
    kvk_i64 o_stride_row, o_stride_head;
    kvk_i64 lse_stride_row, lse_stride_head;
    kvk_i64 k_stride_page, k_stride_token, k_stride_head;
    kvk_i64 v_stride_page, v_stride_token, v_stride_head;
    kvk_i64 num_pages;
    kvk_u32 ps_mul;             /* fast division by page_size: q = (umulhi(n, ps_mul) + n) >> ps_shift */
    kvk_u32 ps_shift;
    kvk_u32 g_mul;              /* fast division by group_size (packed row -> query row) */
    kvk_u32 g_shift;
    kvk_i32 page_size;
    kvk_i32 group_size;
    kvk_i32 num_qo_heads;
    kvk_i32 tile_q;             /* rows per partial slot */
    kvk_i32 window_left;
    kvk_u32 flags;
    float q_scale;              /* sm_scale * k_scale (* log2(e) unless KVK_FLAG_TRANSFORM) */
    float v_scale;
    float softcap;              /* cap (> 0 with KVK_FLAG_SOFTCAP) */
    float sigmoid_bias;         /* in the log2 domain (bias * log2 e) */
    float rope_rcp_scale;       /* 1 / rope_scale */
    float rope_log2_theta;      /* log2(rope_theta) */
} kvk_attn_params;

/* The Hopper prefill kernel's second parameter (__grid_constant__): CUtensorMap images of K and V (128 bytes each,
   64-byte aligned), valid when KVK_FLAG_TMA is set (16-bit elements, 128-byte swizzle; ragged K/V: 3-d {head dim,
   KV heads, tokens}, box {64, 1, 128}; paged (page sizes 16-128 dividing 128, or multiples of 128): 4-d {head dim,
   page rows, KV heads, pages}, box {64, min(page size, 128), 1, 1}). */
#if defined(__cplusplus)
#define KVK_ALIGN64 alignas(64)
#else
#define KVK_ALIGN64 _Alignas(64)
#endif
typedef struct kvk_tma {
    KVK_ALIGN64 kvk_u64 k[16];
    KVK_ALIGN64 kvk_u64 v[16];
} kvk_tma;

/* Merge of the plan's split-KV partials. */
typedef struct kvk_merge_params {
    void* o;
    float* lse;
    char* ws;
    kvk_i64 off_counts, off_requests, off_merge, off_partial_o, off_partial_lse; /* as kvk_attn_params */
    kvk_i64 o_stride_row, o_stride_head;
    kvk_i64 lse_stride_row, lse_stride_head;
    kvk_i32 dvo;
    kvk_i32 o_dtype;
    kvk_i32 group_size;
    kvk_i32 tile_q;
    kvk_i32 sigmoid;
    kvk_i32 row_units; /* kva_merge_partials: 0 = a CTA per task, 1 = a warp per (task, row) over the grid, 2 = a CTA per
                          (task, row), its warps over the partials */
} kvk_merge_params;

/* User variants (docs/variants.md): the run-time parameters every hook receives (the prelude's kva_vparams;
   kva__vparams in src/core/internal.h has the same layout), and the parameter blocks of a variant's kernels:
   the built-in block followed by the variant's parameters (the built-in kernels never see these). */
typedef struct kvk_vparams {
    float s[16];
    const float* t[4];
} kvk_vparams;

typedef struct kvk_vattn_params {
    kvk_attn_params base;
    kvk_vparams vp;
} kvk_vattn_params;

typedef struct kvk_vmerge_params {
    kvk_merge_params base;
    kvk_vparams vp;
} kvk_vmerge_params;

/* v/s state tensor view: v [rows, heads, dim] of dtype, s [rows, heads] f32 */
typedef struct kvk_state_view {
    void* v;
    float* s;
    kvk_i64 v_stride_row, v_stride_head;
    kvk_i64 s_stride_row, s_stride_head;
    kvk_i32 dtype;
    kvk_i32 pad_;
} kvk_state_view;

/* merge_state: out = a merge b, rows x heads x dim; mask (optional) selects rows */
typedef struct kvk_merge_state_params {
    kvk_state_view a, b, out;
    const kvk_u8* mask;
    kvk_i64 rows;
    kvk_i32 heads;
    kvk_i32 dim;
} kvk_merge_state_params;

/* merge_states: rows [row0, row0 + nrows) merge states indptr[r - row0] .. indptr[r - row0 + 1) */
#define KVK_MERGE_STATES_CHUNK 480
typedef struct kvk_merge_states_params {
    kvk_state_view in, out;
    kvk_i64 row0;
    kvk_i32 nrows;
    kvk_i32 heads;
    kvk_i32 dim;
    kvk_i32 pad_;
    kvk_i32 indptr[KVK_MERGE_STATES_CHUNK + 1];
} kvk_merge_states_params;

/* append_paged_kv: token i of nnz goes to request batch_indices[i] at positions[i], or to slots[i] */
typedef struct kvk_append_params {
    const char* ak;
    const char* av;
    char* k;
    char* v;
    const kvk_i32* batch_indices;
    const kvk_i32* positions;
    const kvk_i32* indices;
    const kvk_i32* indptr;
    const kvk_i32* last_page_len;
    kvk_status* status;
    kvk_i64 nnz;
    kvk_i64 ak_stride_tok, ak_stride_head; /* bytes */
    kvk_i64 av_stride_tok, av_stride_head;
    kvk_i64 k_stride_page, k_stride_token, k_stride_head; /* bytes */
    kvk_i64 v_stride_page, v_stride_token, v_stride_head;
    kvk_i64 num_pages;
    kvk_i64 num_indices; /* entries in indices; 0 = unchecked */
    kvk_i32 batch_size;
    kvk_i32 page_size;
    kvk_i32 heads;
    kvk_i32 k_row_bytes;
    kvk_i32 v_row_bytes;
    kvk_i32 vec;          /* bytes per copy unit: 16, 8, 4, 2 or 1 */
    kvk_i32 src_dtype;    /* dtype of append_k/append_v */
    kvk_i32 dst_dtype;    /* pool dtype (conversion when they differ) */
    kvk_i32 head_dim_qk;
    kvk_i32 head_dim_vo;
    const kvk_i64* slots; /* non-NULL: token i goes to slot slots[i] (page slots[i] / page_size; < 0: skipped) and
                             batch_indices .. last_page_len are unused (kva_append_paged_kv_cache_by_slot) */
} kvk_append_params;

#endif /* KVA_KPARAMS_H */
