/*
 * cuda_internal.h - private to src/cuda: kernel keys (the one place that decides "supported?" and "which
 * kernel?"), the kernel cache (prebuilt fatbin + NVRTC with an on-disk cache), and the backend state.
 */
#ifndef KVA_CUDA_INTERNAL_H
#define KVA_CUDA_INTERNAL_H

#include <pthread.h>

#include "cuda_api.h"
#include "internal.h"
#include "../kernels/kva_kparams.h"

/* ---------------------------------------------------------------------------------------------- */
/* Kernel keys                                                                                     */

typedef enum kva__kfamily {
    KVA__KF_DECODE = 1, /* kva_decode.cuh: CUDA-core attention over <= 8 packed rows */
    KVA__KF_UTIL = 2,   /* kva_util.cuh: merges and append (one module) */
    KVA__KF_DECODE_TC = 4, /* kva_decode_tc.cuh: tensor-core attention over <= 8 packed rows (3: cuda_prefill.h) */
    KVA__KF_DECODE_HG = 5  /* kva_decode_hg.cuh: decode over groups of `rows` (2 or 4) KV heads, TMA (sm_90) */
} kva__kfamily;

/* fp8 KV dtypes (e4m3, e5m2) */
static inline int kva__is_fp8(int t) { return t == KVA_DTYPE_E4M3 || t == KVA_DTYPE_E5M2; }

typedef struct kva__kkey {
    int32_t family;
    int32_t dqk, dvo;
    int32_t qt, kt, ot; /* kva_dtype */
    int32_t rows;       /* decode families: 1, 2, 4, 8; tensor-core attention family: the tile 16, 64, 128 */
    int32_t rope;       /* 0 / 1 */
    int32_t nochk;      /* benchmark-only builds: bit 0 no page-index bounds check (KVATTN_BENCH_NO_BOUNDS_CHECK),
                           bit 1 timestamp trace (KVATTN_BENCH_TRACE_PTR, tensor-core kernel), bit 2 decode K/V
                           copies without the L2 evict-first policy (KVATTN_BENCH_NO_L2_HINT), bit 3 the fused
                           merge without its small-task path (KVATTN_BENCH_TC_GENERIC_MERGE); bits 4+: prefill
                           experiment (KVATTN_BENCH_PF_EXP, timing only: results may be wrong); bits 8+: tensor-core
                           decode A/B experiment (KVATTN_BENCH_TC_EXP) */
    int32_t mainloop;   /* tensor-core attention family: 0 mma.sync (kva_pf_*), 1 Hopper warpgroup MMA (kva_pfw_*,
                           sm_90a, 256 threads; kva__cuda_prefill_upgrade picks it); head-group decode family: 1 =
                           the cp.async producer for page sizes that are not multiples of 16 ("_ga" names) */
    int32_t alibi_fold; /* Hopper mainloop: 1 = ALiBi's per-key bias folded into the S accumulators (KVA_ALIBI_FOLD;
                           "_afold" names; taken for ALiBi without soft cap) */
    int32_t warps;      /* tensor-core decode family: 0 = 4 warps, 8 = 8 warps ("_w8": plans with one CTA per SM) */
    int32_t hg_rs;      /* head-group decode family: 1 = row slots (`rows` slots of 8 query rows over one KV head, "_rs") */
    int32_t var_hooks;  /* user variant (CUDA-core or mma.sync prefill family): KVA_VARIANT_* bits | 0x100 if use_softmax; 0 = none */
    uint64_t var_hash;  /* the variant's hash (kva_variant.hash); 0 = built-in */
    const char* var_src; /* the variant's NVRTC source (not part of the key's identity: var_hash is) */
} kva__kkey;

/* Keys compare by every field before var_src, and keys of a variant also by its source text (kva__kkey_eq). */
int kva__kkey_eq(const kva__kkey* a, const kva__kkey* b);
/* A key of `family` with these axes, every other field 0 (the enumerations' keys). */
void kva__kkey_set(kva__kkey* k, int family, int d, int qt, int kt, int ot, int rows, int rope, int warps);

/* The kernel choice for one descriptor, op and tile size. */
typedef struct kva__kchoice {
    kva__kkey key;
    int32_t tile_q; /* packed rows per tile the planner must use */
    size_t smem;    /* dynamic shared memory of the kernel */
} kva__kchoice;

/* THE selection function: validates (desc, op) for the CUDA backend and picks the kernel. tile_q = 0 lets it
 * choose the tile size from max_packed (the planner's choose_tile_q); tile_q > 0 (finish_plan) picks the kernel
 * for that tile. Returns KVA_ERR_UNSUPPORTED with a message naming what is not supported. */
kva_status kva__cuda_select(const kva_attention_desc* d, kva_op op, int32_t tile_q, int32_t max_packed,
                            kva__kchoice* out);
/* The same with the device facts: the average packed query length (tile heuristic of the tensor-core attention
 * family) and the device's opt-in shared memory per block (0 = unchecked). Prefill ops, and decode with GQA groups
 * above 8, use the tensor-core attention family (kva_prefill.cuh, cuda_prefill.h) when it supports the
 * descriptor, the tile and the device's shared memory; otherwise the decode families (tiles of at most 8 rows).
 * kva__cuda_select(d, op, t, mp, out) is kva__cuda_select_dev(d, op, t, mp, mp, 0, out). */
kva_status kva__cuda_select_dev(const kva_attention_desc* d, kva_op op, int32_t tile_q, int32_t max_packed,
                                double avg_packed, int max_smem_optin, kva__kchoice* out);

/* The head-group decode kernel (kva_decode_hg.cuh) for a batch-decode plan of `heads` (2 or 4) KV heads per unit:
 * 1 and the key when the descriptor and page size are in its scope (sm_90 device, 16-bit q = KV, head dim 64 or 128,
 * GQA group <= 8, softmax without soft cap, ALiBi, RoPE or a user variant, any page size: the TMA producer for
 * multiples of 16, the cp.async producers (mainloop 1, "_ga") for the others), else 0. The caller checks the device
 * (compute capability 9.0, tensor maps, shared memory). */
int kva__cuda_hg_key(const kva_attention_desc* d, int32_t page_size, int32_t heads, kva__kkey* out);
/* The same kernel in row slots (KVA_HG_RS, "_rs") for a batch-decode plan of one KV head per unit with GQA groups of 9
 * to 32 (a tile of all g rows): 1 and the key (rows = slots of 8 rows: 2 for g <= 16, else 4) in the same scope as
 * kva__cuda_hg_key but for the group size, else 0. */
int kva__cuda_hg_rs_key(const kva_attention_desc* d, int32_t page_size, kva__kkey* out);
/* Heads per head-group unit for a default-mode decode plan of `batch` requests over H KV heads reading kv_bytes on a
   device of num_sms SMs: 4 where H divides by 4, else 2; and 2 at one CTA per SM (*one_per_sm = 1) where units of 4
   would number fewer than the SMs (each then split, with merges) while units of 2 fill 7/8 of them to all of them,
   for calls under 1.5 GB (cuda_backend.c, kva__cuda_kv_head_group). */
int32_t kva__cuda_hg_heads_pick(int32_t H, int64_t batch, int64_t kv_bytes, int32_t num_sms, int32_t* one_per_sm);

/* Dynamic shared memory of an attention kernel key (0 for the util module) */
size_t kva__kkey_smem(const kva__kkey* k);
/* Symbol name ("kva_dec_d128_qbf16_kvbf16_obf16_r8_rope0", "kva_tc_d128_qbf16_kvbf16_obf16_r4"; util: "kva_util") */
void kva__kkey_name(const kva__kkey* k, char* buf, size_t size);
/* NVRTC -D options for the key; returns the count (at most max) */
int kva__kkey_defines(const kva__kkey* k, char (*defs)[128], int max);
/* Main NVRTC source text of a key's module */
const char* kva__kkey_source(const kva__kkey* k);

/* Every kernel variant (for the NVRTC test): fills up to max keys, returns the total count. */
int kva__kkey_enumerate(kva__kkey* keys, int max);

/* Compile a key with NVRTC for arch (e.g. "sm_90a"), with one extra option (or NULL): *cubin is malloc'd (caller
 * frees); log_out (optional) receives the malloc'd NVRTC log of a successful compile. On failure returns
 * KVA_ERR_JIT with the NVRTC log in the message. No driver or device needed. */
kva_status kva__jit_compile(const kva__kkey* k, const char* arch, const char* extra_opt, void** cubin,
                            size_t* cubin_size, char** log_out);
/* User variants on the CUDA backend: the NVRTC main source of the variant's kernels (malloc'd; prelude, hooks,
 * kva_decode.cuh, kva_variant.cuh), and a compile of the hooks alone for arch (kva_variant_check kernel) that
 * reports a bad source as KVA_ERR_JIT with the NVRTC log; a passed check is remembered in cache_dir (NULL or "" =
 * no cache). No device needed. */
/* mode 0: the CUDA-core kernel (kva_decode.cuh) and the variant's merge kernel; 1: the hook check only; 2: the
   tensor-core kernel (kva_prefill.cuh, mma.sync mainloop) and the merge kernel */
char* kva__cuda_variant_source(const struct kva_variant* v, int mode);
/* Can the tensor-core kernel run v? (no query or key transform: their results would be rounded to 16 bits) */
int kva__cuda_variant_tc_ok(const struct kva_variant* v);
kva_status kva__cuda_variant_check_compile(const struct kva_variant* v, const char* arch, const char* cache_dir);

/* Magic numbers of the kernels' division by the page size (see kva_fastdiv in kva_common.cuh) */
void kva__fastdiv_magic(int32_t d, uint32_t* mul, uint32_t* shift);
/* The cache identity of a key for an arch (hash of sources, options, NVRTC version, arch, library version) */
kva_status kva__jit_identity(const kva__kkey* k, const char* arch, char* ident, size_t ident_size, char* hash_hex,
                             size_t hash_size);
/* Compile through the disk cache: a hit loads the cubin; a miss logs "compiling <key>..." (when ctx != NULL),
 * compiles and stores atomically. *cubin is malloc'd. */
kva_status kva__jit_cached(const kva_context* ctx, const char* cache_dir, const kva__kkey* k, const char* arch,
                           void** cubin, size_t* cubin_size, int* was_hit);

/* Embedded kernel sources (generated at build time) */
typedef struct kva__src_file {
    const char* name;
    const char* text;
} kva__src_file;
extern const kva__src_file kva__kernel_sources[];
extern const int kva__num_kernel_sources;

/* Prebuilt fatbins (generated at build time), one per target */
typedef struct kva__aot_image {
    int arch;                  /* 80, 90 */
    const unsigned char* data;
    size_t size;
} kva__aot_image;
extern const kva__aot_image kva__aot_images[];
extern const int kva__num_aot_images;
/* Names of the attention kernels in the prebuilt fatbins (the same set for every target), sorted (strcmp) */
extern const char* const kva__aot_names[];
extern const int kva__num_aot_names;
/* Is this kernel name in the prebuilt set? (looked up before cuModuleGetFunction, which must not be asked for a
   symbol the module lacks) */
int kva__aot_has(const char* name);

/* ---------------------------------------------------------------------------------------------- */
/* Backend state                                                                                   */

#define KVA__MAX_KERNELS 512
#define KVA__STAGING_SLOTS 4

typedef struct kva__kentry {
    kva__kkey key;
    CUfunction fn;
    CUfunction fn_vmerge; /* user variants: the variant's split-KV merge kernel (same module) */
    CUmodule module; /* JIT module (owned), or NULL for prebuilt */
    int max_smem_set;
    int pdl; /* compiled for compute capability >= 9.0 (PTX version), so its CTAs wait for the kernels before them
                (kva_pdl_wait): it may be launched with programmatic stream serialisation (kva_run_args.enable_pdl) */
} kva__kentry;

typedef struct kva__staging_slot {
    void* host;     /* pinned */
    size_t bytes;
    CUevent done;   /* recorded after the copy out of this slot */
    int used;
} kva__staging_slot;

/* dynamic shared memory of the 4-warp tensor-core decode kernel with the cluster combine's buffers (KVK_FLAG_CLUSTER) */
#define KVA__TC_SMEM_CC(dqk, kt, rows) \
    ((size_t)KVK_TC_CC_OFF((dqk), KVK_DEC_ES(kt), (rows), 4) + (size_t)KVK_TC_CC_BYTES((dqk), (rows)))

typedef struct kva__cuda_state {
    const kva__cu_api* cu;
    CUdevice dev;
    CUcontext cuctx;
    int cc_major, cc_minor, cc; /* cc = 10 * major + minor */
    int num_sms;
    int max_smem_optin;
    int ctas_per_sm;
    int no_bounds_check;    /* KVATTN_BENCH_NO_BOUNDS_CHECK=1: kernels built without the page-index check */
    int no_wgmma;           /* KVATTN_BENCH_NO_WGMMA=1: the mma.sync prefill mainloop on sm_90 too (benchmark A/B) */
    int no_tma;             /* KVATTN_BENCH_NO_TMA=1: the Hopper prefill kernel copies K/V without TMA (benchmark A/B) */
    int decode_all_workers; /* KVATTN_BENCH_DECODE_ALL_WORKERS=1: small decode batches keep every worker (A/B) */
    int tc_warps;           /* KVATTN_BENCH_TC_WARPS=4|8: warps of the tensor-core decode kernel in plans with one CTA
                               per SM (A/B; 0 = the default choice) */
    int tc_exp;             /* KVATTN_BENCH_TC_EXP=n: A/B experiments n compiled into the tensor-core decode kernel */
    int hg_exp;             /* KVATTN_BENCH_HG_EXP=n (n > 0): the head-group decode kernel under its own name, compiled
                               at plan time (KVA_HG_EXP=n; no experiment is compiled in now): an A/B of NVRTC builds
                               against NVRTC builds (docs/kernels/decode.md, session 40) */
    int tc_generic_merge;   /* KVATTN_BENCH_TC_GENERIC_MERGE=1: the tensor-core decode kernel's fused merge always
                               through kva_merge_task_rows (A/B of the small-task path) */
    int no_paged_tma;       /* KVATTN_BENCH_NO_PAGED_TMA=1: paged K/V by cp.async, ragged keeps TMA (benchmark A/B) */
    double dram_gbps;       /* nominal DRAM bandwidth in GB/s (memory clock x bus width x 2; 0 if unknown) */
    int64_t l2_bytes;       /* L2 cache size (CU_DEVICE_ATTRIBUTE_L2_CACHE_SIZE; 0 if unknown) */
    int no_l2_hint;         /* KVATTN_BENCH_NO_L2_HINT=1: decode kernels built without the K/V L2 evict-first policy */
    int pf_exp;             /* KVATTN_BENCH_PF_EXP=n: timing experiments n compiled into the prefill kernels (KVP_EXP) */
    int merge_rows;         /* KVATTN_BENCH_MERGE_ROWS=1 / 2: kva_merge_partials_rows with this row_units (A/B) */
    int no_fused_merge;     /* KVATTN_BENCH_NO_FUSED_MERGE=1: split-KV merge by the merge kernel (benchmark A/B) */
    int rs_row_merge;       /* row-slot plans of large merge tasks merge a warp per (task, row) (kva__cuda_merge_rows_pick;
                               KVATTN_BENCH_RS_ROW_MERGE=0: off, A/B) */
    int64_t rs_row_merge_pairs; /* ... when the largest merge task holds more (row, partial) pairs (default
                                   KVA__RS_ROW_MERGE_PAIRS; benchmark A/B: $KVATTN_BENCH_RS_ROW_MERGE_PAIRS) */
    int decode_hg;          /* KVATTN_CUDA_DECODE_HG: -1 (default) head-group decode plans where they pay
                               (kva__cuda_kv_head_group), 0 never, 1 wherever supported */
    int hg_heads;           /* KVATTN_BENCH_HG_HEADS=2|4: heads per head-group item (A/B; 0 = the default choice) */
    int hg_per_sm;          /* KVATTN_BENCH_HG_PER_SM=1|2: head-group workers per SM (A/B; 0 = the default choice) */
    int fp8_cc;             /* KVATTN_BENCH_FP8_CC=1: fp8 KV at head dims 64 and 256 on the CUDA-core kernel (A/B) */
    int hg_promo;           /* L2 promotion of the head-group tensor maps: 0 none, 1 128 B, 2 256 B (default by
                               dram_gbps; KVATTN_BENCH_HG_L2_PROMO=0|1|2 for A/B) */
    int64_t hg_min_bytes;   /* KVATTN_BENCH_HG_MIN_MB: K/V bytes from which the default choice takes head groups */
    int hg_rs;              /* row slots for GQA groups of 9 to 32 (kva__cuda_kv_head_group; KVATTN_BENCH_HG_RS=0: off) */
    int64_t hg_rs_max_bytes; /* KVATTN_BENCH_HG_RS_MAX_MB: K/V bytes below which the default takes row slots on
                                pages of other than 16k tokens */
    unsigned long long trace_ptr; /* KVATTN_BENCH_TRACE_PTR=0x...: device buffer for kernel timestamps (benchmark) */
    int trace_hg;                 /* KVATTN_BENCH_TRACE_HG=1: trace the head-group kernel, not the tensor-core one */
    int smem_sm;            /* shared memory per SM (bytes) */
    int cluster;            /* thread-block clusters of this many CTAs for the tensor-core decode kernel's cluster
                               combine (sm_90; KVATTN_CUDA_CLUSTER=0 off, 2/4/8 the size; default 8); 0 = none */
    int cluster_ctas;       /* CTAs of those clusters that fit at once (cuOccupancyMaxActiveClusters x cluster) */
    char name[256];
    char arch[16];          /* NVRTC target, e.g. "sm_90a" */
    char cache_dir[1024];   /* "" = no disk cache */
    CUmodule aot;           /* prebuilt module for this device, or NULL */
    CUmodule util_module;   /* JIT util module when there is no prebuilt one */
    pthread_mutex_t mu;     /* guards kernels[] insertion, staging ring */
    kva__kentry kernels[KVA__MAX_KERNELS];
    int num_kernels;        /* entries [0, num_kernels) are immutable once published */
    CUfunction fn_merge_partials, fn_merge_rows, fn_merge_state, fn_merge_states, fn_append;
    int merge_pdl;          /* fn_merge_partials may be launched with programmatic stream serialisation (as kentry.pdl) */
    CUdeviceptr append_status; /* kvk_status for append faults (no workspace there) */
    kva__staging_slot staging[KVA__STAGING_SLOTS];
    int staging_next;
} kva__cuda_state;

/* Get (load or compile) the kernel of a key; returns its index in st->kernels. */
kva_status kva__cuda_kernel(kva_context* ctx, kva__cuda_state* st, const kva__kkey* k, int* index);
/* 1 when f may be launched with programmatic stream serialisation on this device: compute capability >= 9.0, a driver
   with cuLaunchKernelEx, and f compiled for a virtual architecture >= 9.0 (its kva_pdl_wait is real) */
int kva__cuda_func_pdl(const kva__cuda_state* st, CUfunction f);

#endif /* KVA_CUDA_INTERNAL_H */
