/*
 * cuda_backend.c - the CUDA backend behind kvattn's C API (host code, C11, driver API through dlopen).
 *
 * Context: the device's primary context (pushed around every call unless already current). Kernels: a
 * prebuilt fatbin for sm_80 / sm_90a loaded at context creation, anything else compiled at plan time by NVRTC
 * (kva__cuda_kernel). Plans: the planner writes the int region into ws->host; finish_plan copies it into a
 * pinned staging slot of the backend (a small ring whose slots are reused only after the event of their last
 * copy completed, so a later plan never overwrites bytes a pending copy still reads) and issues one
 * cuMemcpyHtoDAsync to ws->device on the caller's stream. Run: validation, then a persistent attention
 * kernel over the work list and, when the plan splits KV (always in graph mode), the merge kernel. Run
 * never allocates or synchronises, and its launch configuration depends only on the plan's bounds.
 */
#define _POSIX_C_SOURCE 200809L
#include <math.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cuda_internal.h"
#include "cuda_prefill.h"

/* The workspace records must match internal.h */
_Static_assert(sizeof(kvk_request) == sizeof(kva__request), "kvk_request layout");
_Static_assert(offsetof(kvk_request, mask_offset) == offsetof(kva__request, mask_offset), "kvk_request layout");
_Static_assert(sizeof(kvk_work_item) == sizeof(kva__work_item), "kvk_work_item layout");
_Static_assert(offsetof(kvk_work_item, partial) == offsetof(kva__work_item, partial), "kvk_work_item layout");
_Static_assert(sizeof(kvk_merge_task) == sizeof(kva__merge_task), "kvk_merge_task layout");
_Static_assert(offsetof(kvk_merge_task, num_partials) == offsetof(kva__merge_task, num_partials), "merge layout");
_Static_assert(sizeof(kvk_counts) == sizeof(kva__counts), "kvk_counts layout");
_Static_assert(offsetof(kvk_counts, num_merge) == offsetof(kva__counts, num_merge), "kvk_counts layout");
_Static_assert(sizeof(kvk_status) <= KVA__STATUS_BYTES, "status region");
_Static_assert(sizeof(kvk_worker_head) == 64 && offsetof(kvk_worker_head, item) == 32, "kvk_worker_head layout");
_Static_assert(sizeof(kvk_merge_states_params) <= 4000, "merge_states params must fit the 4 KB parameter space");

/* backend_data slots of a plan */
enum { KVA__BD_KERNEL = 0, KVA__BD_SMEM = 1, KVA__BD_MAGIC = 2, KVA__BD_FUSED = 3, KVA__BD_CLUSTER = 4, KVA__BD_MERGE_ROWS = 5 };
#define KVA__BD_MAGIC_VALUE 0x6b7661637564616eull /* "kvacudan" */
/* K/V megabytes from which batch-decode plans take the head-group kernel by default (kva__cuda_kv_head_group) */
#define KVA__HG_MIN_MB 256
/* K/V megabytes below which batch-decode plans of GQA groups of 9 to 32 take the head-group kernel in row slots */
#define KVA__HG_RS_MAX_MB 160
/* row-slot plans whose largest merge task holds more than this many (row, partial) pairs (g x partials) merge by
   kva_merge_partials_rows, a warp per (task, row), instead of the fused merge (kva__cuda_merge_rows_pick) */
#define KVA__RS_ROW_MERGE_PAIRS 512

static kva__cuda_state* kva__st(const kva_context* ctx) { return (kva__cuda_state*)ctx->backend_state; }

static kva_status kva__enter(kva__cuda_state* st, int* pushed) {
    CUcontext cur = NULL;
    *pushed = 0;
    st->cu->CtxGetCurrent(&cur);
    if (cur == st->cuctx) return KVA_OK;
    KVA_CU_TRY(st->cu, st->cu->CtxPushCurrent(st->cuctx), "CUDA backend: cuCtxPushCurrent");
    *pushed = 1;
    return KVA_OK;
}
static void kva__leave(kva__cuda_state* st, int pushed) {
    if (pushed) {
        CUcontext c;
        st->cu->CtxPopCurrent(&c);
    }
}

static kva_status kva__not_capturing(kva__cuda_state* st, CUstream s, const char* what) {
    CUstreamCaptureStatus cs = CU_STREAM_CAPTURE_STATUS_NONE;
    CUresult r = st->cu->StreamIsCapturing(s, &cs);
    KVA_RETURN_IF(r == CUDA_ERROR_STREAM_CAPTURE_IMPLICIT || cs != CU_STREAM_CAPTURE_STATUS_NONE,
                  KVA_ERR_CAPTURE_ACTIVE,
                  "%s: the stream is being captured into a CUDA graph; plan (and compile) before capturing and "
                  "capture only run",
                  what);
    if (r != CUDA_SUCCESS) return kva__cu_error(st->cu, r, "CUDA backend: cuStreamIsCapturing");
    return KVA_OK;
}

/* params: the kernel's parameter block; tma: NULL, or the Hopper prefill kernel's second parameter (kvk_tma) */
static kva_status kva__launch_n(kva__cuda_state* st, CUfunction f, unsigned grid, unsigned threads, unsigned smem,
                                CUstream s, void* params, void* tma, const char* what) {
    void* args[2] = {params, tma};
    KVA_CU_TRY(st->cu, st->cu->LaunchKernel(f, grid, 1, 1, threads, 1, 1, smem, s, args, NULL), what);
    return KVA_OK;
}

/* a 1-D launch configuration in thread-block clusters of `cluster` CTAs (*at becomes its one attribute) */
static void kva__cluster_config(CUlaunchConfig* cfg, CUlaunchAttribute* at, unsigned grid, unsigned threads,
                                unsigned smem, CUstream s, unsigned cluster) {
    memset(at, 0, sizeof *at);
    at->id = CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION;
    at->value.clusterDim.x = cluster;
    at->value.clusterDim.y = at->value.clusterDim.z = 1;
    memset(cfg, 0, sizeof *cfg);
    cfg->gridDimX = grid;
    cfg->gridDimY = cfg->gridDimZ = 1;
    cfg->blockDimX = threads;
    cfg->blockDimY = cfg->blockDimZ = 1;
    cfg->sharedMemBytes = smem;
    cfg->hStream = s;
    cfg->attrs = at;
    cfg->numAttrs = 1;
}

/* a launch through cuLaunchKernelEx: in thread-block clusters of `cluster` CTAs along x when cluster > 1 (grid a
   multiple of it), with programmatic stream serialisation when pdl (kva_run_args.enable_pdl, and the kernel waits
   for its predecessors: kva__kentry.pdl), so that its CTAs may start while the previous kernel of the stream
   finishes. Neither: a plain launch */
static kva_status kva__launch_ex(kva__cuda_state* st, CUfunction f, unsigned grid, unsigned threads, unsigned smem,
                                 CUstream s, void* params, void* tma, unsigned cluster, int pdl, const char* what) {
    if (cluster < 2) cluster = 0;
    if (!pdl && cluster == 0) return kva__launch_n(st, f, grid, threads, smem, s, params, tma, what);
    KVA_RETURN_IF(!st->cu->LaunchKernelEx || (cluster > 0 && grid % cluster != 0), KVA_ERR_INTERNAL,
                  "%s: a launch of %u CTAs (clusters of %u, programmatic serialisation %d) is not possible here", what,
                  grid, cluster, pdl);
    CUlaunchAttribute at[2];
    CUlaunchConfig cfg;
    kva__cluster_config(&cfg, &at[0], grid, threads, smem, s, cluster);
    if (cluster == 0) cfg.numAttrs = 0;
    if (pdl) {
        CUlaunchAttribute* a = &at[cfg.numAttrs];
        memset(a, 0, sizeof *a);
        a->id = CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION;
        a->value.programmaticStreamSerializationAllowed = 1;
        cfg.numAttrs++;
    }
    void* args[2] = {params, tma};
    KVA_CU_TRY(st->cu, st->cu->LaunchKernelEx(&cfg, f, args, NULL), what);
    return KVA_OK;
}

static kva_status kva__launch(kva__cuda_state* st, CUfunction f, unsigned grid, unsigned smem, CUstream s, void* params,
                              const char* what) {
    return kva__launch_n(st, f, grid, KVK_THREADS, smem, s, params, NULL, what);
}

/* ---------------------------------------------------------------------------------------------- */
/* Descriptor checks and tile size                                                                 */

static kva_status kva__cuda_check_desc(const kva_context* ctx, const kva_attention_desc* desc, kva_op op) {
    (void)ctx;
    return kva__cuda_select(desc, op, 0, 1, NULL);
}

static int32_t kva__cuda_choose_tile_q(const kva_context* ctx, const kva_attention_desc* desc, kva_op op,
                                       double avg_packed_qo_len, int32_t max_packed_qo_len) {
    const kva__cuda_state* st = (const kva__cuda_state*)ctx->backend_state;
    kva__kchoice c;
    if (kva__cuda_select_dev(desc, op, 0, max_packed_qo_len, avg_packed_qo_len, st ? st->max_smem_optin : 0, &c) !=
        KVA_OK)
        return 8;
    return c.tile_q;
}

/* Decode on the decode kernels (GQA groups up to 8) with at most one (request, KV head) unit per SM: one worker per
   SM instead of ctas_per_sm. With two, the planner splits every unit to feed twice as many workers and pays the
   split's epilogues and merges, while the two CTAs of an SM stream side by side with nothing to overlap (one CTA
   keeps enough bytes in flight). H100, interleaved cold launches (docs/kernels/decode.md): D1 16 x 1k +9.9 %,
   1 x 4k +4.4 %, 1 x 32k +1.1 %, 16 x 4k and 1 x 128k within +-0.6 %; batches with more units than SMs (64 x 1k:
   -6 % on one worker per SM) keep both, and so do batches whose chunks do not give one item per worker (the
   planner checks; D4 zipf lengths were 15 % slower on one worker per SM), and calls of more than 1024 rows per SM
   that the 8-warp kernel does not stream (below). Graph-mode plans ask with their bounds (tokens = -1): a graph of at
   most one unit per SM for every batch under the bounds runs on one worker per SM with the 8-warp kernel, whatever
   the lengths (H100, sequential A/B against 264 workers of 4 warps, session 20: D7 1 x 1k -3.1 % cold, 16 x 1k
   -5.4 %, per layer of a 32-call graph with PDL -6.5 % / -5.7 %). KVATTN_BENCH_DECODE_ALL_WORKERS=1 turns it off
   (A/B). */
/* The tensor-core decode kernels that have an 8-warp form the backend takes by default (head dim 128, 16-bit KV:
   kva__cuda_want_8_warps, and kva__cuda_plan_workers' choice of one worker per SM) */
static bool kva__cuda_w8_key(const kva__kkey* k) {
    return k->family == KVA__KF_DECODE_TC && k->dqk == 128 && (k->kt == KVA_DTYPE_F16 || k->kt == KVA_DTYPE_BF16);
}
/* fp8 KV has an 8-warp form too (every head dim; at 256 not with 8 rows, whose shared memory does not fit), taken only
   by eager plans of more than 1024 K/V rows per SM that have at most one (request, KV head) unit per SM: D6 fp8 1 x 32k
   on one 8-warp CTA per SM instead of 264 workers of 4 warps, sequential pairs: H100 -3.7 / -4.5 %, H200 -4.3 %
   (docs/kernels/decode.md, session 25); 1 x 32k at head dim 256 (GQA 16/8) -3.6 %, at 64 (GQA 64/8) -10.0 % (H100,
   interleaved, session 26). Smaller and graph-mode fp8 plans keep their session-24 form (one 4-warp CTA per SM, resp.
   every worker with 4 warps): in a decode step whose layers also run a 16-bit call, the fp8 1 x 1k graph call on 8
   warps was not measured apart from the 16-bit one. */
static bool kva__cuda_w8_fp8_key(const kva__kkey* k) {
    return k->family == KVA__KF_DECODE_TC && kva__is_fp8(k->kt);
}
/* A/B (KVATTN_BENCH_FP8_CC=1): fp8 KV at head dims 64 and 256 on the CUDA-core kernel, as before the tensor-core
   kernel took them (session 26); the planner then sizes the plan as it did for that kernel */
static bool kva__cuda_fp8_cc(const kva__cuda_state* st, kva__kchoice* c, const kva_attention_desc* d) {
    if (!st->fp8_cc || c->key.family != KVA__KF_DECODE_TC || c->key.dqk == 128 ||
        !kva__is_fp8(c->key.kt))
        return false;
    c->key.family = KVA__KF_DECODE;
    c->key.rope = d->pos_encoding == KVA_POS_ROPE_LLAMA;
    c->key.warps = 0;
    c->smem = kva__kkey_smem(&c->key);
    return true;
}
static bool kva__cuda_w8_fp8_rows(const kva__cuda_state* st, int64_t rows) {
    return rows > 1024ll * st->num_sms;
}

static int32_t kva__cuda_plan_workers(const kva_context* ctx, const kva_attention_desc* desc, kva_op op,
                                      int64_t units, int64_t tokens) {
    const kva__cuda_state* st = (const kva__cuda_state*)ctx->backend_state;
    if (!st || st->decode_all_workers || op != KVA_OP_BATCH_DECODE || kva__cuda_prefill_prefer_for_decode(desc) ||
        st->ctas_per_sm < 2 || units > st->num_sms)
        return ctx->num_workers;
    /* Whether the 8-warp tensor-core kernel will stream the plan (kva__cuda_want_8_warps: head dim 128, 16-bit KV, its
       shared memory fits). One CTA of 4 warps per SM keeps half the bytes in flight:
       fine for small calls (1 x 4k 5.8 % and 16 x 1k 8.3 % faster than two CTAs per SM, session 9), slower from about
       2000 K/V rows per SM (fp8 1 x 32k 5 % and 1 x 128k 1 % slower). With 8 warps one CTA per SM is the faster plan
       at every size measured: 1 x 128k 4.3 % faster than 264 workers on the H200, 0.3-0.6 % on the H100 (session 17:
       128 items of 8k and one-pass merges of 16 partials instead of 264 items and merges of 33). */
    kva__kchoice c;
    const int32_t g = desc->num_kv_heads > 0 ? desc->num_qo_heads / desc->num_kv_heads : 1;
    bool w8 = st->tc_warps != 4 && g >= 1 && g <= KVA__MAX_TILE_Q &&
              kva__cuda_select_dev(desc, op, g, 0, 0.0, st->max_smem_optin, &c) == KVA_OK &&
              !kva__cuda_fp8_cc(st, &c, desc) &&
              (kva__cuda_w8_key(&c.key) ||
               (kva__cuda_w8_fp8_key(&c.key) && tokens >= 0 && kva__cuda_w8_fp8_rows(st, tokens)));
    if (w8) {
        c.key.warps = 8;
        w8 = kva__kkey_smem(&c.key) <= (size_t)st->max_smem_optin;
    }
    if (!w8 && (tokens < 0 || tokens > 1024ll * st->num_sms)) return ctx->num_workers;
    return st->num_sms;
}

/* The tensor-core decode kernel's cluster combine (kva_decode_tc.cuh, KVK_FLAG_CLUSTER; sm_90): a batch-decode plan
   whose (request, KV head) units fit the device's clusters puts each unit's chunks on the CTAs of one cluster, which
   combine their partial states through distributed shared memory (st.async into the rank that owns each head dim,
   one mbarrier wait) instead of global partials, an arrival atomic and a merge by the last CTA. Only where the
   kernel with the combine's shared memory still fits two CTAs per SM (head dims 64 and 128; not 128 x 8 rows). */
static bool kva__cuda_cluster_ok(const kva_context* ctx, const kva_attention_desc* desc, kva_op op, int32_t tile_q) {
    const kva__cuda_state* st = (const kva__cuda_state*)ctx->backend_state;
    if (!st || st->cluster < 2 || op != KVA_OP_BATCH_DECODE || desc->variant || tile_q < 1 || tile_q > 8) return false;
    kva__kchoice c;
    if (kva__cuda_select_dev(desc, op, tile_q, 0, 0.0, st->max_smem_optin, &c) != KVA_OK) return false;
    if (c.key.family != KVA__KF_DECODE_TC) return false;
    const size_t need = KVA__TC_SMEM_CC(c.key.dqk, c.key.kt, c.key.rows);
    return need <= (size_t)st->max_smem_optin && 2 * (need + 1024) <= (size_t)st->smem_sm;
}

/* see cuda_internal.h */
int32_t kva__cuda_hg_heads_pick(int32_t H, int64_t batch, int64_t kv_bytes, int32_t num_sms, int32_t* one_per_sm) {
    *one_per_sm = 0;
    if (H % 4 != 0) return 2;
    /* units of 4 heads that leave SMs without one (so each is cut into chunks with partials and merges), while units
       of 2 heads fill 7/8 to all of them one per SM: units of 2 heads at one CTA per SM, no split. Interleaved A/B on
       an H200 (session 31): D3 32/4 64 x 8k +2.4 / +2.6 %, 32/4 64 x 4k +4.3 / +4.5 %, 60 x 8k +4.7 / +4.8 %, 32/8
       30 x 4k +5.0 / +5.6 %, 32 x 2k +5.2 / +5.4 %, 32 x 8k +1.3 / +1.8 %, MHA 8 x 4k +1.9 / +2.2 %; H100 +1.0 to
       +1.9 %; at 2 GB (MHA 8 x 16k) -0.3 / -0.5 %: the merges' fixed cost no longer outweighs the 4-head read's
       efficiency, hence calls below 1.5 GB */
    const int64_t u4 = batch * (H / 4), u2 = 2 * u4;
    if (kv_bytes < ((int64_t)1536 << 20) && u4 < (int64_t)num_sms && u2 <= (int64_t)num_sms &&
        8 * u2 >= 7 * (int64_t)num_sms) {
        *one_per_sm = 1;
        return 2;
    }
    return 4;
}

/* Head-group decode (kva_decode_hg.cuh): units of G KV heads whose K/V the kernel reads as TMA boxes over the G heads
   of 16 tokens (pages of 16k tokens), or gathers token by token into the same layout with two cp.async producer warps
   (other page sizes: "_ga", session 29: D5 page 1 4.7-4.9 % faster than the tensor-core kernel on an H200). On an
   NHD pool that reads at 90-92 % of nominal where one head per load (kva_decode_tc.cuh) reads at 88-89 %
   (bench/results/read_probe_2026-11-21_session12.md). G = 4 (one CTA per SM, 192 KB of stages) where the
   KV heads divide by 4, else 2 (two CTAs per SM); by default 2 at one CTA per SM where units of 4 would be split
   (kva__cuda_hg_heads_pick). Taken for batch decode outside graph mode (the kernel family must
   not change between a graph's plans) and outside batch-invariant mode (fixed_split_size: a request's rounding
   must not depend on the rest of the batch), on devices of compute capability 9.0, for calls that read at least
   hg_min_bytes of K/V (KVATTN_CUDA_DECODE_HG=1: every call in the kernel's scope; =0: never). */
static int32_t kva__cuda_kv_head_group(const kva_context* ctx, const kva_attention_desc* desc, kva_op op,
                                       const kva_plan_params* params, int64_t total_kv, int64_t max_kv,
                                       int32_t* workers, int32_t* row_slots) {
    const kva__cuda_state* st = (const kva__cuda_state*)ctx->backend_state;
    if (!st || st->decode_hg == 0 || op != KVA_OP_BATCH_DECODE || st->cc != 90 || !st->cu->TensorMapEncodeTiled ||
        params->fixed_split_size > 0 || params->num_pages > INT32_MAX) /* num_pages 0: the pool size is known at run */
        return 1;
    const int32_t H = desc->num_kv_heads;
    const int64_t bytes = total_kv * (int64_t)H * (desc->head_dim_qk + desc->head_dim_vo) *
                          (int64_t)kva_dtype_size(desc->kv_dtype);
    {
        /* Row slots (kva_decode_hg.cuh, KVA_HG_RS): GQA groups of 9 to 32 otherwise run the tensor-core attention
           kernel (kva__cuda_prefill_prefer_for_decode). One CTA per SM (128-160 KB of stages). Interleaved A/B on an
           H200 against that kernel, two TMA producers (bench/results/rowslots_producers_h200_2026-11-29_session41.md):
           faster on every call measured with pages of 16k tokens, 17 MB to 1.08 GB (MQA 32/1 64 x 4k -15 %, 512 x 4k
           -5.4 %, 1 x 32k -72 %; 64/2 128 x 4k -3.3 %; 128/8 1 x 1k -29 %, 32 x 2k -0.2 %, 64 x 4k -1.5 %); with other
           page sizes (the cp.async producers) slower from 270 MB (128/8 32 x 2k page 1 +16 %), hence those calls only
           under hg_rs_max_bytes (160 MB) */
        kva__kkey k;
        if (st->hg_rs && kva__cuda_hg_rs_key(desc, params->page_size, &k) &&
            (st->decode_hg > 0 || k.mainloop != 1 || bytes < st->hg_rs_max_bytes) &&
            kva__kkey_smem(&k) <= (size_t)st->max_smem_optin) {
            *row_slots = k.rows;
            *workers = st->num_sms;
            return 1;
        }
    }
    int32_t one_per_sm = 0; /* G = 2 at one CTA per SM (kva__cuda_hg_heads_pick; default mode only) */
    int32_t G = st->hg_heads ? st->hg_heads : (H % 4 == 0 ? 4 : 2);
    if (!st->hg_heads && st->decode_hg < 0)
        G = kva__cuda_hg_heads_pick(H, params->batch_size, bytes, st->num_sms, &one_per_sm);
    kva__kkey k;
    if (!kva__cuda_hg_key(desc, params->page_size, G, &k) || kva__kkey_smem(&k) > (size_t)st->max_smem_optin) return 1;
    /* the default: calls of at least hg_min_bytes (256 MB) with at least 16 (request, head group) units. Interleaved
       A/B against kva_decode_tc.cuh, D1 (docs/kernels/decode.md, session 13): H200 +8 to +13 % at 1-2 GB, +2.5 % at
       64 x 1k (268 MB), even at 16 x 4k (268 MB), 9-21 % slower below 140 MB; H100 with the 256-byte promotion
       +1.5 to +3 % from 268 MB; 1 x 128k (2 units, 537 MB): H200 +1.6 %, H100 -6 % (without the promotion) */
    const int64_t units = (int64_t)params->batch_size * (H / G);
    if (st->decode_hg < 0 && (bytes < st->hg_min_bytes || units < 16)) return 1;
    /* and only where its units are not cut into many chunks: at least one unit per 4 SMs and no request over twice
       the mean length. Otherwise the head-group plan splits every unit (or the long request's) into 4 or more chunks
       with partials and merges, while the tensor-core kernel's per-head units are H / G times as many. Sequential A/B
       with page-index batches in kva_decode_tc.cuh (docs/kernels/decode.md, session 18): 16 x 4k (32 units) -2.2 %
       on the tensor-core kernel on an H100, +0.1 % on an H200; D4 1 x 32k + 63 x 512 -3.5 % / -1.9 %; D3 64 x 8k (64
       units) -0.6 % on the H100 but +10.5 % on the H200, so it keeps the head-group kernel, as do 64 x 1k (+2.8 %
       on the H100) and the larger calls */
    if (st->decode_hg < 0 &&
        (units * 4 < (int64_t)st->num_sms || max_kv * (int64_t)params->batch_size > 2 * total_kv))
        return 1;
    const int32_t per_sm = G == 4 || one_per_sm ? 1 : st->hg_per_sm ? st->hg_per_sm : st->ctas_per_sm;
    *workers = st->num_sms * per_sm;
    return G;
}

/* ---------------------------------------------------------------------------------------------- */
/* finish_plan                                                                                     */

static kva_status kva__staging_copy(kva__cuda_state* st, const kva_workspace* ws, size_t n, CUstream s) {
    const kva__cu_api* cu = st->cu;
    kva_status status = KVA_OK;
    pthread_mutex_lock(&st->mu);
    kva__staging_slot* slot = &st->staging[st->staging_next];
    st->staging_next = (st->staging_next + 1) % KVA__STAGING_SLOTS;
    CUresult r = CUDA_SUCCESS;
    if (slot->used) {
        r = cu->EventSynchronize(slot->done); /* normally long complete: only waits if the host ran far ahead */
        if (r != CUDA_SUCCESS) {
            status = kva__cu_error(cu, r, "CUDA backend: waiting for a staging slot");
            goto out;
        }
    }
    if (slot->bytes < n) {
        if (slot->host) cu->MemFreeHost(slot->host);
        slot->host = NULL;
        slot->bytes = 0;
        size_t want = kva__align_up(n + n / 2, 65536);
        r = cu->MemHostAlloc(&slot->host, want, 0);
        if (r != CUDA_SUCCESS) {
            slot->host = NULL;
            status = kva__cu_error(cu, r, "CUDA backend: cuMemHostAlloc of the plan staging buffer");
            goto out;
        }
        slot->bytes = want;
    }
    if (!slot->done) {
        r = cu->EventCreate(&slot->done, CU_EVENT_DISABLE_TIMING);
        if (r != CUDA_SUCCESS) {
            slot->done = NULL;
            status = kva__cu_error(cu, r, "CUDA backend: cuEventCreate");
            goto out;
        }
    }
    memcpy(slot->host, ws->host, n);
    r = cu->MemcpyHtoDAsync((CUdeviceptr)(uintptr_t)ws->device, slot->host, n, s);
    if (r != CUDA_SUCCESS) {
        status = kva__cu_error(cu, r, "CUDA backend: copying the plan to the device workspace");
        goto out;
    }
    r = cu->EventRecord(slot->done, s);
    if (r != CUDA_SUCCESS) {
        status = kva__cu_error(cu, r, "CUDA backend: cuEventRecord");
        goto out;
    }
    slot->used = 1;
out:
    pthread_mutex_unlock(&st->mu);
    return status;
}

/* Fused split-KV merge (tensor-core kernel): each split item learns its merge task (item.pad_), and the task's
 * num_partials must leave its high half free for the arrival counter. Returns 1 when the plan can use it. */
static int kva__prepare_fused_merge(kva__plan_data* plan, const kva_workspace* ws) {
    if (plan->num_merge <= 0) return 1;
    if (!ws->host) return 0;
    char* base = (char*)ws->host;
    const kva__merge_task* mt = (const kva__merge_task*)(base + plan->off_merge);
    kva__work_item* items = (kva__work_item*)(base + plan->off_items);
    const int32_t nm = plan->num_merge;
    for (int32_t t = 0; t < nm; ++t)
        if (mt[t].num_partials >= 32768 || (t > 0 && mt[t].partial_first < mt[t - 1].partial_first)) return 0;
    for (int32_t i = 0; i < plan->num_items; ++i) {
        const int32_t slot = items[i].partial;
        if (slot < 0) continue;
        int32_t lo = 0, hi = nm - 1; /* last task with partial_first <= slot */
        while (lo < hi) {
            int32_t mid = (lo + hi + 1) / 2;
            if (mt[mid].partial_first <= slot) lo = mid;
            else hi = mid - 1;
        }
        if (slot < mt[lo].partial_first || slot >= mt[lo].partial_first + mt[lo].num_partials) return 0;
        items[i].pad_ = lo;
    }
    return 1;
}

/* The per-worker headers (kvk_worker_head) in the host staging mirror, from the items and requests as they will be
   copied (after kva__prepare_fused_merge has set the items' merge tasks). */
static void kva__write_worker_heads(const kva__plan_data* plan, const kva_workspace* ws) {
    char* base = (char*)ws->host;
    const int32_t* windptr = kva__ws_worker_indptr(plan, base);
    const kva__work_item* items = kva__ws_items(plan, base);
    const kva__request* reqs = kva__ws_requests(plan, base);
    kvk_worker_head* wh = (kvk_worker_head*)(base + plan->off_worker_head);
    for (int32_t w = 0; w < plan->num_workers; ++w) {
        kvk_worker_head h;
        memset(&h, 0, sizeof h);
        h.it_begin = windptr[w];
        h.it_end = windptr[w + 1];
        if (h.it_begin < h.it_end) {
            memcpy(&h.item, &items[h.it_begin], sizeof h.item);
            memcpy(&h.rq, &reqs[h.item.req], sizeof h.rq);
        }
        memcpy(&wh[w], &h, sizeof h);
    }
}

/* Plans with one CTA per SM (kva__cuda_plan_workers) whose workers each stream at least 512 K/V rows run the
   tensor-core decode kernel with 8 warps instead of 4 (head dim 128, 16-bit KV: the prebuilt "_w8" kernels). The SM
   then keeps twice the K/V bytes in flight and hides each warp's per-subtile instruction latency behind another's,
   without splitting the units further (which costs partials and merges). Interleaved A/B, H200
   (docs/kernels/decode.md): D1 16 x 4k +2.7 %, 1 x 32k +1.5 %, D4 uniform 16 x [512, 1024] +4.6 % faster,
   16 x 1k and D4 zipf within noise. A floor of 512 rows per worker (1 x 4k 2.1 % slower on 8 warps, H200, session
   11) went in session 20: below it 8 warps were faster on both GPUs (sequential A/B, H200: 1 x 1k -4.1 %, 1 x 4k
   -4.2 %, small batches of 1-8 requests -2.6 to -4.5 %; H100: -2.2 to -3.8 %, 4 x 1k +0.3 %, 8 x 512 +1.8 %). Graph-
   mode plans on one worker per SM (kva__cuda_plan_workers, from the bounds) take 8 warps the same way, whatever the
   lengths of each plan under the captured kernel. KVATTN_BENCH_TC_WARPS=4 / 8: never / whenever it fits (A/B; 8 also
   in contexts of one CTA per SM, where it then differs in rounding from graph replays of the same plan). */
static int kva__cuda_want_8_warps(const kva__cuda_state* st, const kva__plan_data* plan, const kva__kkey* k) {
    if (k->family != KVA__KF_DECODE_TC || st->tc_warps == 4 || plan->num_workers > st->num_sms ||
        plan->num_workers <= 0 || plan->cluster_size > 0)
        return 0;
    if (st->tc_warps == 8) return 1; /* (A/B: also graph-mode plans of one worker per SM: KVATTN_CUDA_CTAS_PER_SM=1) */
    /* only where kva__cuda_plan_workers took one worker per SM out of two (graph mode: from the bounds, so every plan
       of a graph runs the captured kernel whatever its lengths): a context of one CTA per SM
       (KVATTN_CUDA_CTAS_PER_SM=1) keeps 4 warps, in graph and eager plans alike, so the two agree bitwise */
    if (st->ctas_per_sm >= 2 && kva__cuda_w8_fp8_key(k)) /* K/V rows x KV heads, kva__cuda_plan_workers' count where
                                                               the group fits one tile (else it counted more: then a
                                                               plan on one worker per SM may keep 4 warps) */
        return !plan->graph_mode &&
               kva__cuda_w8_fp8_rows(st, plan->total_kv_tokens * (int64_t)plan->desc.num_kv_heads);
    return st->ctas_per_sm >= 2 && kva__cuda_w8_key(k);
}

/* The split-KV merge of a row-slot plan (kva_decode_hg.cuh, KVA_HG_RS): the fused merge hands a unit's g rows x
 * its partials to the one CTA that finishes last, a serial tail that grows with both; the merge kernel with a warp
 * per (task, row) (kva_merge_partials_rows, row_units 1) spreads them over the GPU. Interleaved A/B on an H100
 * (bench/results/merge_rows_h100_2026-12-07_session43.md), the row merge at a cap of 64 chunks per unit against the
 * fused merge at 32: MQA 32/1 1 x 8k +24 %, 1 x 32k +41 %, 1 x 128k +67 %, 4 x 32k +5 %; 64/2 1 x 64k +11 %; 16/1
 * 1 x 32k (64 partials of 16 rows) +8 %, 4 x 16k (33 partials of 16 rows) -1 %; 128/8 1 x 32k (16 partials of 16 rows)
 * -2.5 %, hence only tasks of more than KVA__RS_ROW_MERGE_PAIRS pairs: the fused merge keeps at most what it merged
 * at the former cap of 32 chunks for groups of 16.
 * Returns the row_units to merge with (0: the default, fused where the kernel can). The benchmark's
 * KVATTN_BENCH_MERGE_ROWS applies to every plan; KVATTN_BENCH_RS_ROW_MERGE=0 turns this choice off. Row slots are
 * never planned in graph mode, so a graph's plans all merge alike. */
static int kva__cuda_merge_rows_pick(const kva__cuda_state* st, const kva__plan_data* plan, const kva_workspace* ws) {
    if (st->merge_rows) return st->merge_rows;
    if (!st->rs_row_merge || plan->row_slots <= 1 || plan->graph_mode || plan->num_merge <= 0 || !ws->host ||
        plan->cluster_size > 1 || plan->tile_q <= 0)
        return 0;
    const kva__merge_task* mt = (const kva__merge_task*)((const char*)ws->host + plan->off_merge);
    int32_t most = 0;
    for (int32_t t = 0; t < plan->num_merge; ++t)
        if (mt[t].num_partials > most) most = mt[t].num_partials;
    return (int64_t)plan->group_size * most > st->rs_row_merge_pairs ? 1 : 0;
}

static kva_status kva__cuda_finish_plan(kva_context* ctx, kva__plan_data* plan, const kva_workspace* ws, void* stream) {
    kva__cuda_state* st = kva__st(ctx);
    int pushed;
    KVA_FORWARD(kva__enter(st, &pushed));
    kva_status status = kva__not_capturing(st, (CUstream)stream, "plan");
    kva__kchoice c;
    int index = -1;
    if (status == KVA_OK && (plan->kv_head_group > 1 || plan->row_slots > 1)) {
        memset(&c, 0, sizeof c);
        if (plan->row_slots > 1 ? !kva__cuda_hg_rs_key(&plan->desc, plan->page_size, &c.key) ||
                                      c.key.rows != plan->row_slots || plan->tile_q != plan->group_size
                                : !kva__cuda_hg_key(&plan->desc, plan->page_size, plan->kv_head_group, &c.key))
            status = kva__set_error(KVA_ERR_INTERNAL, "plan: no head-group decode kernel for %d heads / %d row slots "
                                    "per unit", (int)plan->kv_head_group, (int)plan->row_slots);
        c.smem = kva__kkey_smem(&c.key);
        c.tile_q = plan->tile_q;
    } else if (status == KVA_OK) {
        status = kva__cuda_select_dev(&plan->desc, (kva_op)plan->op, plan->tile_q, 0, 0.0, st->max_smem_optin, &c);
        if (status == KVA_OK) kva__cuda_fp8_cc(st, &c, &plan->desc);
    }
    if (status == KVA_OK && c.key.family == KVA__KF_DECODE_TC && c.smem > (size_t)st->max_smem_optin) {
        /* e.g. head dim 256 on a device with less than 227 KB of shared memory per block */
        c.key.family = KVA__KF_DECODE;
        c.key.rope = plan->desc.pos_encoding == KVA_POS_ROPE_LLAMA;
        c.smem = kva__kkey_smem(&c.key);
    }
    if (status == KVA_OK && c.key.family == KVA__KF_PREFILL && !st->no_wgmma)
        kva__cuda_prefill_upgrade(&c.key, &c.smem, st->cc, st->max_smem_optin,
                                  plan->desc.pos_encoding == KVA_POS_ALIBI && !(plan->desc.logits_soft_cap > 0.0f));
    if (status == KVA_OK && kva__cuda_want_8_warps(st, plan, &c.key)) {
        kva__kkey k8 = c.key;
        k8.warps = 8;
        const size_t s8 = kva__kkey_smem(&k8);
        if (s8 <= (size_t)st->max_smem_optin) {
            c.key = k8;
            c.smem = s8;
        }
    }
    if (status == KVA_OK && st->no_bounds_check) c.key.nochk |= 1;
    if (status == KVA_OK && st->pf_exp && c.key.family == KVA__KF_PREFILL) c.key.nochk |= st->pf_exp << 4;
    if (status == KVA_OK && st->trace_ptr &&
        c.key.family == (st->trace_hg ? KVA__KF_DECODE_HG : KVA__KF_DECODE_TC)) c.key.nochk |= 2;
    if (status == KVA_OK && st->tc_generic_merge && c.key.family == KVA__KF_DECODE_TC) c.key.nochk |= 8;
    if (status == KVA_OK && st->tc_exp && c.key.family == KVA__KF_DECODE_TC) c.key.nochk |= st->tc_exp << 8;
    if (status == KVA_OK && st->hg_exp && c.key.family == KVA__KF_DECODE_HG) c.key.nochk |= st->hg_exp << 8;
    if (status == KVA_OK && st->no_l2_hint &&
        (c.key.family == KVA__KF_DECODE || c.key.family == KVA__KF_DECODE_TC)) c.key.nochk |= 4;
    if (status == KVA_OK) status = kva__cuda_kernel(ctx, st, &c.key, &index);
    if (status == KVA_OK) {
        plan->backend_data[KVA__BD_KERNEL] = (uint64_t)(index + 1);
        plan->backend_data[KVA__BD_SMEM] = (uint64_t)c.smem;
        plan->backend_data[KVA__BD_MAGIC] = KVA__BD_MAGIC_VALUE;
        const int merge_rows = plan->cluster_combine ? 0 : kva__cuda_merge_rows_pick(st, plan, ws);
        plan->backend_data[KVA__BD_MERGE_ROWS] = (uint64_t)merge_rows;
        plan->backend_data[KVA__BD_FUSED] = (c.key.family == KVA__KF_DECODE_TC || c.key.family == KVA__KF_DECODE_HG) &&
                                            ((!st->no_fused_merge && !(merge_rows && !st->merge_rows)) ||
                                             plan->cluster_combine) &&
                                            plan->int_region_end > 0 && kva__prepare_fused_merge(plan, ws);
        plan->backend_data[KVA__BD_CLUSTER] = 0;
        if (plan->cluster_size > 1) {
            /* launched in clusters (kva__cuda_cluster_ok); a cluster-combine plan's split items carry -(chunks of
               their unit) in pad_ instead of their merge task */
            const bool fits = c.key.family == KVA__KF_DECODE_TC && c.key.warps != 8 && st->cluster > 1 &&
                              (plan->num_merge == 0 || plan->backend_data[KVA__BD_FUSED]) && ws->host;
            if (!fits)
                status = kva__set_error(KVA_ERR_INTERNAL, "plan: a thread-block cluster plan without its kernel");
            else {
                plan->backend_data[KVA__BD_CLUSTER] = (uint64_t)plan->cluster_size;
                plan->backend_data[KVA__BD_SMEM] = (uint64_t)KVA__TC_SMEM_CC(c.key.dqk, c.key.kt, c.key.rows);
                if (plan->cluster_combine) {
                    char* base = (char*)ws->host;
                    const kva__merge_task* mt = (const kva__merge_task*)(base + plan->off_merge);
                    kva__work_item* items = (kva__work_item*)(base + plan->off_items);
                    for (int32_t i = 0; i < plan->num_items && status == KVA_OK; ++i) {
                        if (items[i].partial < 0) continue;
                        const int32_t n = mt[items[i].pad_].num_partials;
                        if (n < 2 || n > plan->cluster_size || n > KVK_TC_CC_MAX)
                            status = kva__set_error(KVA_ERR_INTERNAL, "plan: a cluster unit of %d chunks", (int)n);
                        items[i].pad_ = -n;
                    }
                }
            }
        }
        if (plan->int_region_end > 0) {
            if (!ws->host || !ws->device)
                status = kva__set_error(KVA_ERR_INVALID_ARGUMENT, "plan: the CUDA backend needs workspace->device "
                                                                  "and workspace->host");
            else if (plan->off_worker_head == 0)
                status = kva__set_error(KVA_ERR_INTERNAL, "plan: no worker header region in the CUDA plan layout");
            else {
                kva__write_worker_heads(plan, ws);
                status = kva__staging_copy(st, ws, plan->int_region_end, (CUstream)stream);
            }
        }
    }
    kva__leave(st, pushed);
    return status;
}

/* ---------------------------------------------------------------------------------------------- */
/* run                                                                                             */

static bool kva__al(const void* p, size_t a) { return ((uintptr_t)p % a) == 0; }

static kva_status kva__check_rows_tensor(const char* name, const kva_tensor* t, int64_t elem_mult) {
    KVA_RETURN_IF(!t->data, KVA_ERR_INVALID_ARGUMENT, "run: %s is NULL", name);
    KVA_RETURN_IF(t->ndim != 3 || t->stride[2] != 1, KVA_ERR_UNSUPPORTED,
                  "run: %s must be 3-D with a unit last stride on the CUDA backend", name);
    KVA_RETURN_IF(!kva__al(t->data, 16), KVA_ERR_ALIGNMENT,
                  "run: %s.data = %p must be 16-byte aligned on the CUDA backend", name, t->data);
    KVA_RETURN_IF((t->shape[0] > 1 && t->stride[0] % elem_mult != 0) || t->stride[1] % elem_mult != 0,
                  KVA_ERR_ALIGNMENT,
                  "run: %s strides (%lld, %lld) must be multiples of %lld elements (16-byte rows) on the CUDA backend",
                  name, (long long)t->stride[0], (long long)t->stride[1], (long long)elem_mult);
    KVA_RETURN_IF(t->stride[0] < 0 || t->stride[1] < 0, KVA_ERR_UNSUPPORTED, "run: %s has negative strides", name);
    return KVA_OK;
}

/* K/V tensor maps for the Hopper prefill kernel's TMA path (kvk_tma, KVK_FLAG_TMA). Returns 1 when both encoded.
 * 16-bit K/V at head dim 64 or 128, 128-byte swizzle (the kernel's shared layout), box of 64 columns:
 * - ragged: 3-d {head dim, KV heads, tokens}, box {64, 1, 128}; not in graph mode (the token extent is fixed in the
 *   captured map);
 * - paged: 4-d {head dim, page rows, KV heads, pages}, box {64, R, 1, 1} with R = min(page_size, 128), for page sizes
 *   16, 32, 64, 128 and multiples of 128: one box per page and column block of a page-aligned tile (8 pages x 2
 *   blocks at page size 16). The map depends on the pool only, so graph mode keeps it. */
/* Head-group decode (hg = heads per unit, > 1): paged only, box {128 bytes, 16, hg, 1} (16 tokens of hg heads: 64
 * columns of 16-bit K/V, or a whole fp8 row at head dim 128; page sizes that are multiples of 16), L2 promotion by
 * st->hg_promo (256 bytes on devices below 4 TB/s, else none: TMA boxes of half a 256-byte row read 7-8 % slower on an
 * H200 with the 256-byte promotion, docs/kernels/decode.md, session 12; on an H100 they read 2-3 % faster with it,
 * session 13). */
static int kva__cuda_tma_maps(const kva__cuda_state* st, const kva__plan_data* pd, const kva_run_args* a,
                              const kvk_attn_params* p, kvk_tma* tm, int hg) {
    const kva__cu_api* cu = st->cu;
    const kva_attention_desc* d = &pd->desc;
    const bool ragged = pd->op == KVA_OP_BATCH_PREFILL_RAGGED;
    if (!cu->TensorMapEncodeTiled) return 0;
    if (!hg && (st->no_tma || (ragged && pd->graph_mode) || (!ragged && st->no_paged_tma))) return 0;
    if (hg && ragged) return 0;
    /* fp8 K/V: head-group decode at head dim 128 only (one 128-byte box row per token and head) */
    const bool fp8 = kva__is_fp8(d->kv_dtype);
    if (d->kv_dtype != KVA_DTYPE_BF16 && d->kv_dtype != KVA_DTYPE_F16 && !(fp8 && hg)) return 0;
    const CUtensorMapDataType dt = fp8 ? CU_TENSOR_MAP_DATA_TYPE_UINT8
                                   : d->kv_dtype == KVA_DTYPE_BF16 ? CU_TENSOR_MAP_DATA_TYPE_BFLOAT16
                                                                   : CU_TENSOR_MAP_DATA_TYPE_FLOAT16;
    const int64_t eb = fp8 ? 1 : 2; /* bytes per element */
    const int64_t D = d->head_dim_qk, H = d->num_kv_heads;
    if ((D != 64 && D != 128) || H < 1 || d->head_dim_vo != D || (fp8 && D != 128)) return 0;
    int rank;
    cuuint64_t dims[4], kst[3], vst[3];
    cuuint32_t box[4];
    const cuuint32_t es[4] = {1, 1, 1, 1};
    if (ragged) {
        int64_t tokens = pd->total_kv_tokens;
        if (tokens < 1) return 0;
        if (a->k.shape[0] > tokens && a->v.shape[0] >= a->k.shape[0]) tokens = a->k.shape[0];
        rank = 3;
        dims[0] = (cuuint64_t)D, dims[1] = (cuuint64_t)H, dims[2] = (cuuint64_t)tokens;
        kst[0] = (cuuint64_t)(p->k_stride_head * eb), kst[1] = (cuuint64_t)(p->k_stride_token * eb);
        vst[0] = (cuuint64_t)(p->v_stride_head * eb), vst[1] = (cuuint64_t)(p->v_stride_token * eb);
        box[0] = 64, box[1] = 1, box[2] = 128;
    } else {
        const int64_t ps = p->page_size, np = p->num_pages;
        if (hg) { /* 16-token boxes of hg heads: any multiple of 16 rows a page */
            if (ps < 16 || ps % 16 != 0 || np < 1 || np > (int64_t)INT32_MAX || H % hg != 0) return 0;
        } else if (!(ps >= 16 && (ps <= 128 ? 128 % ps == 0 : ps % 128 == 0)) || np < 1 || np > (int64_t)UINT32_MAX) {
            /* from 16 rows a page: the TMA unit takes about 70 SM cycles a box on an H100 (page size 1, one box per
               row and column block: 2.3x slower than cp.async), so 8-row boxes would cost more than they save */
            return 0;
        }
        rank = 4;
        dims[0] = (cuuint64_t)D, dims[1] = (cuuint64_t)ps, dims[2] = (cuuint64_t)H, dims[3] = (cuuint64_t)np;
        kst[0] = (cuuint64_t)(p->k_stride_token * eb), kst[1] = (cuuint64_t)(p->k_stride_head * eb);
        kst[2] = (cuuint64_t)(p->k_stride_page * eb);
        vst[0] = (cuuint64_t)(p->v_stride_token * eb), vst[1] = (cuuint64_t)(p->v_stride_head * eb);
        vst[2] = (cuuint64_t)(p->v_stride_page * eb);
        box[0] = (cuuint32_t)(128 / eb), box[3] = 1; /* 128-byte rows: the 128-byte swizzle's span */
        box[1] = hg ? 16u : (cuuint32_t)(ps < 128 ? ps : 128);
        box[2] = hg ? (cuuint32_t)hg : 1u;
    }
    for (int i = 0; i + 1 < rank; ++i) /* TMA: strides are non-zero multiples of 16 bytes below 2^40 */
        if (kst[i] == 0 || vst[i] == 0 || kst[i] % 16 || vst[i] % 16 || kst[i] >= (1ull << 40) || vst[i] >= (1ull << 40))
            return 0;
    _Static_assert(sizeof(CUtensorMap) == sizeof tm->k, "CUtensorMap is 128 bytes");
    const void* const base[2] = {p->k, p->v};
    const cuuint64_t* const st2[2] = {kst, vst};
    static const CUtensorMapL2promotion hg_promo[3] = {CU_TENSOR_MAP_L2_PROMOTION_NONE, CU_TENSOR_MAP_L2_PROMOTION_L2_128B,
                                                       CU_TENSOR_MAP_L2_PROMOTION_L2_256B};
    const CUtensorMapL2promotion promo = hg ? hg_promo[st->hg_promo] : CU_TENSOR_MAP_L2_PROMOTION_L2_256B;
    CUtensorMap m[2];
    for (int i = 0; i < 2; ++i)
        if (cu->TensorMapEncodeTiled(&m[i], dt, (cuuint32_t)rank, (void*)base[i], dims, st2[i], box, es,
                                     CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B, promo,
                                     CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE) != CUDA_SUCCESS)
            return 0;
    memcpy(tm->k, &m[0], sizeof tm->k);
    memcpy(tm->v, &m[1], sizeof tm->v);
    return 1;
}

static kva_status kva__cuda_run(kva_context* ctx, const kva__plan_data* pd, const kva_workspace* ws,
                                const kva_run_args* a) {
    kva__cuda_state* st = kva__st(ctx);
    const kva_attention_desc* d = &pd->desc;
    const kva_op op = (kva_op)pd->op;
    const int idx = (int)pd->backend_data[KVA__BD_KERNEL] - 1;
    KVA_RETURN_IF(pd->backend_data[KVA__BD_MAGIC] != KVA__BD_MAGIC_VALUE || idx < 0 ||
                      idx >= __atomic_load_n(&st->num_kernels, __ATOMIC_ACQUIRE),
                  KVA_ERR_PLAN_MISMATCH, "run: the plan names no kernel of this CUDA context");
    const kva__kentry* ke = &st->kernels[idx];
    const int es = (int)kva_dtype_size(d->kv_dtype);

    /* ---- validation (before any launch) ---- */
    KVA_FORWARD(kva__check_rows_tensor("q", &a->q, 8));
    KVA_FORWARD(kva__check_rows_tensor("o", &a->o, d->o_dtype == KVA_DTYPE_F32 ? 4 : 8));
    if (a->lse.data) {
        KVA_RETURN_IF(!kva__al(a->lse.data, 4), KVA_ERR_ALIGNMENT, "run: lse.data = %p must be 4-byte aligned",
                      a->lse.data);
    }
    KVA_RETURN_IF(a->alibi_slopes && !kva__al(a->alibi_slopes, 4), KVA_ERR_ALIGNMENT,
                  "run: alibi_slopes = %p must be 4-byte aligned", (const void*)a->alibi_slopes);

    kvk_attn_params p;
    memset(&p, 0, sizeof p);
    if (op == KVA_OP_BATCH_PREFILL_RAGGED) {
        if (pd->total_kv_tokens > 0) {
            KVA_FORWARD(kva__check_rows_tensor("k", &a->k, 16 / es));
            KVA_FORWARD(kva__check_rows_tensor("v", &a->v, 16 / es));
        }
        p.k = a->k.data;
        p.v = a->v.data;
        p.k_stride_page = 0;
        p.k_stride_token = a->k.stride[0];
        p.k_stride_head = a->k.stride[1];
        p.v_stride_page = 0;
        p.v_stride_token = a->v.stride[0];
        p.v_stride_head = a->v.stride[1];
        p.page_size = 1;
        p.ps_mul = 1;
        p.ps_shift = 0;
    } else {
        const kva_paged_kv* pk = &a->paged;
        if (pd->num_page_entries > 0) {
            KVA_RETURN_IF(!kva__al(pk->k_data, 16) || !kva__al(pk->v_data, 16), KVA_ERR_ALIGNMENT,
                          "run: paged.k_data (%p) and v_data (%p) must be 16-byte aligned on the CUDA backend",
                          pk->k_data, pk->v_data);
            const int64_t m = 16 / es;
            KVA_RETURN_IF(pk->k_stride_page % m || pk->k_stride_token % m || pk->k_stride_head % m ||
                              pk->v_stride_page % m || pk->v_stride_token % m || pk->v_stride_head % m,
                          KVA_ERR_ALIGNMENT,
                          "run: paged K/V strides (k: %lld, %lld, %lld; v: %lld, %lld, %lld) must be multiples of %lld "
                          "elements (16 bytes) on the CUDA backend",
                          (long long)pk->k_stride_page, (long long)pk->k_stride_token, (long long)pk->k_stride_head,
                          (long long)pk->v_stride_page, (long long)pk->v_stride_token, (long long)pk->v_stride_head,
                          (long long)m);
            KVA_RETURN_IF(!kva__al(pk->indices, 4), KVA_ERR_ALIGNMENT, "run: paged.indices must be 4-byte aligned");
        }
        KVA_RETURN_IF(pk->page_size < 1, KVA_ERR_INVALID_ARGUMENT, "run: paged.page_size = %d", (int)pk->page_size);
        p.k = pk->k_data;
        p.v = pk->v_data;
        p.indices = pk->indices;
        p.k_stride_page = pk->k_stride_page;
        p.k_stride_token = pk->k_stride_token;
        p.k_stride_head = pk->k_stride_head;
        p.v_stride_page = pk->v_stride_page;
        p.v_stride_token = pk->v_stride_token;
        p.v_stride_head = pk->v_stride_head;
        p.num_pages = pk->num_pages;
        p.page_size = pk->page_size;
        kva__fastdiv_magic(pk->page_size, &p.ps_mul, &p.ps_shift);
    }

    p.q = a->q.data;
    p.o = a->o.data;
    p.lse = (float*)a->lse.data;
    p.ws = (char*)ws->device;
    p.custom_mask = a->custom_mask;
    p.alibi_slopes = a->alibi_slopes;
    p.off_counts = (int64_t)pd->off_counts;
    p.off_worker_indptr = (int64_t)pd->off_worker_indptr;
    p.off_requests = (int64_t)pd->off_requests;
    p.off_items = (int64_t)pd->off_items;
    /* partials in the scratch region: offsets from ws by the address difference (two's complement) */
    const int64_t scr = pd->ws_scratch_addr ? (int64_t)(pd->ws_scratch_addr - (uint64_t)(uintptr_t)ws->device) : 0;
    p.off_partial_o = (int64_t)pd->off_partial_o + scr;
    p.off_partial_lse = (int64_t)pd->off_partial_lse + scr;
    p.off_merge = (int64_t)pd->off_merge;
    p.off_worker_head = (int64_t)pd->off_worker_head;
    p.off_int_end = (int64_t)pd->int_region_end;
    p.num_entries = pd->graph_mode ? 0 : pd->num_page_entries; /* graph replays may use a shorter page table */
    p.trace = (kvk_u64*)(uintptr_t)st->trace_ptr;
    p.q_stride_row = a->q.stride[0];
    p.q_stride_head = a->q.stride[1];
    p.o_stride_row = a->o.stride[0];
    p.o_stride_head = a->o.stride[1];
    if (a->lse.data) {
        p.lse_stride_row = a->lse.stride[0];
        p.lse_stride_head = a->lse.ndim > 1 ? a->lse.stride[1] : 1;
    }
    p.group_size = pd->group_size;
    kva__fastdiv_magic(pd->group_size, &p.g_mul, &p.g_shift);
    p.num_qo_heads = d->num_qo_heads;
    p.tile_q = pd->tile_q;
    /* q positions lie in (-2^30, 2^30) and keys in [0, 2^30) (lengths <= INT32_MAX / 2), so any window of 2^30 or more
       sees every key: clamped, q - window_left stays inside 32 bits in the kernels */
    p.window_left = d->window_left > (1 << 30) ? (1 << 30) : d->window_left;
    uint32_t flags = 0;
    if (d->pos_encoding == KVA_POS_ALIBI) flags |= KVK_FLAG_ALIBI | KVK_FLAG_TRANSFORM;
    /* a user variant's hooks see natural-log logits; without softmax the scores are plain weights */
    const kva_variant* var = d->variant;
    if (var && ((var->hooks & (KVA_VARIANT_LOGITS_TRANSFORM | KVA_VARIANT_LOGITS_MASK)) || !var->use_softmax))
        flags |= KVK_FLAG_TRANSFORM; /* (a variant with only query / key / output transforms keeps log2 logits) */
    if (var && !var->use_softmax) flags |= KVK_FLAG_SIGMOID;
    if (d->logits_soft_cap > 0.0f) flags |= KVK_FLAG_SOFTCAP | KVK_FLAG_TRANSFORM;
    if (d->score_mode == KVA_SCORE_SIGMOID) flags |= KVK_FLAG_SIGMOID;
    if (d->mask_mode == KVA_MASK_CAUSAL) flags |= KVK_FLAG_CAUSAL;
    if (d->mask_mode == KVA_MASK_CUSTOM) flags |= KVK_FLAG_CUSTOM;
    if (d->window_left >= 0) flags |= KVK_FLAG_WINDOW;
    if (op == KVA_OP_BATCH_PREFILL_RAGGED) flags |= KVK_FLAG_RAGGED;
    const unsigned cluster = (unsigned)pd->backend_data[KVA__BD_CLUSTER];
    if (cluster > 1) flags |= KVK_FLAG_CLUSTER;
    const bool fused = pd->backend_data[KVA__BD_FUSED] != 0;
    if (fused) flags |= KVK_FLAG_FUSED_MERGE;
    /* L2 evict-first K/V copies (decode kernels) when each (request, KV head)'s rows fit one query tile, so every K/V
       row is read by one item (split chunks are disjoint), and the call reads at most 4 x the L2 size of K/V: H100,
       interleaved A/B, +3 to +10 % at 17-134 MB (the stream no longer evicts, and writes back, what earlier kernels
       left in L2), neutral at 269 MB, -3 % at 537 MB and 1 GB (docs/kernels/decode.md). Graph mode captures the flag
       (the capture-time plan decides), so there only decode (one row per request) qualifies. Without the flag the
       kernel copies K/V with no cache hint at all, except fp8 at head dim 128 (session 27: an evict-normal hint cost
       4-20 % on the H200's larger calls; kva_decode_tc.cuh). */
    const int64_t kv_bytes = pd->total_kv_tokens * (int64_t)d->num_kv_heads * (d->head_dim_qk + d->head_dim_vo) *
                             (int64_t)kva_dtype_size(d->kv_dtype);
    if ((int64_t)pd->group_size * (op == KVA_OP_BATCH_DECODE ? 1 : pd->graph_mode ? INT32_MAX : pd->max_qo_len) <=
            (int64_t)pd->tile_q &&
        kv_bytes <= 4 * (int64_t)st->l2_bytes)
        flags |= KVK_FLAG_KV_ONCE;
    p.flags = flags;
    const bool pfw = ke->key.family == KVA__KF_PREFILL && ke->key.mainloop == 1;
    kvk_tma tm;
    memset(&tm, 0, sizeof tm);
    if (pfw && !var && kva__cuda_tma_maps(st, pd, a, &p, &tm, 0)) p.flags |= KVK_FLAG_TMA;
    const bool hg = ke->key.family == KVA__KF_DECODE_HG;
    if (hg && ke->key.mainloop != 1 && pd->num_items > 0 && pd->num_page_entries > 0) {
        /* the plan's work items are head-group units: only this kernel runs them (a plan without page entries has
           only empty items, which never copy) */
        KVA_RETURN_IF(!kva__cuda_tma_maps(st, pd, a, &p, &tm, ke->key.hg_rs ? 1 : (int)pd->kv_head_group),
                      KVA_ERR_UNSUPPORTED,
                      "run: the plan reads K/V by tensor maps (head-group decode), and cuTensorMapEncodeTiled refused "
                      "the pool (k_data %p, v_data %p, strides k %lld/%lld/%lld v %lld/%lld/%lld, %lld pages); plan "
                      "with KVATTN_CUDA_DECODE_HG=0 for this pool",
                      p.k, p.v, (long long)p.k_stride_page, (long long)p.k_stride_token, (long long)p.k_stride_head,
                      (long long)p.v_stride_page, (long long)p.v_stride_token, (long long)p.v_stride_head,
                      (long long)p.num_pages);
    }
    const float log2e = 1.4426950408889634f;
    p.q_scale = d->sm_scale * a->k_scale * ((flags & KVK_FLAG_TRANSFORM) ? 1.0f : log2e);
    p.v_scale = a->v_scale;
    p.softcap = d->logits_soft_cap;
    p.sigmoid_bias = d->sigmoid_bias * log2e;
    p.rope_rcp_scale = 1.0f / d->rope_scale;
    p.rope_log2_theta = (float)log2((double)d->rope_theta);

    kvk_merge_params mp;
    memset(&mp, 0, sizeof mp);
    mp.o = a->o.data;
    mp.lse = (float*)a->lse.data;
    mp.ws = (char*)ws->device;
    mp.off_counts = (int64_t)pd->off_counts;
    mp.off_requests = (int64_t)pd->off_requests;
    mp.off_merge = (int64_t)pd->off_merge;
    mp.off_partial_o = p.off_partial_o;
    mp.off_partial_lse = p.off_partial_lse;
    mp.o_stride_row = p.o_stride_row;
    mp.o_stride_head = p.o_stride_head;
    mp.lse_stride_row = p.lse_stride_row;
    mp.lse_stride_head = p.lse_stride_head;
    mp.dvo = d->head_dim_vo;
    mp.o_dtype = d->o_dtype;
    mp.group_size = pd->group_size * pd->kv_head_group; /* packed rows per unit head (merge tasks index units) */
    mp.tile_q = pd->tile_q;
    mp.row_units = pd->tile_q > 0 ? (int32_t)pd->backend_data[KVA__BD_MERGE_ROWS] : 0; /* kva__cuda_merge_rows_pick */
    mp.sigmoid = d->score_mode == KVA_SCORE_SIGMOID || (var && !var->use_softmax);
    kvk_vparams vpar;
    memset(&vpar, 0, sizeof vpar);
    if (var) {
        kva__vparams hv;
        KVA_FORWARD(kva__variant_check_args(ctx, d, pd->variant_id, a, &hv));
        _Static_assert(sizeof hv == sizeof vpar, "kva__vparams and kvk_vparams differ");
        memcpy(&vpar, &hv, sizeof vpar);
        KVA_RETURN_IF(!ke->fn_vmerge, KVA_ERR_PLAN_MISMATCH, "run: the plan's kernel is not the variant's");
    }

    /* ---- launches ---- */
    int pushed;
    KVA_FORWARD(kva__enter(st, &pushed));
    CUstream s = (CUstream)a->stream;
    kva_status status = KVA_OK;
    const bool graph = pd->graph_mode != 0;
    const unsigned grid = (unsigned)pd->num_workers; /* one persistent CTA per planner worker */
    const unsigned threads = ke->key.family == KVA__KF_PREFILL ? (unsigned)kva__cuda_prefill_threads(&ke->key)
                             : ke->key.family == KVA__KF_DECODE_TC && ke->key.warps == 8 ? 256u
                             : hg ? (unsigned)KVK_HG_THREADS(ke->key.rows, ke->key.mainloop == 1, ke->key.hg_rs)
                                  : (unsigned)KVK_THREADS;
    /* programmatic dependent launch where asked for and the kernel waits for its predecessors (else a plain launch) */
    const int pdl = a->enable_pdl != 0 && ke->pdl;
    if (var) { /* the variant's kernels take their parameters after the built-in block */
        kvk_vattn_params vpp;
        vpp.base = p;
        vpp.vp = vpar;
        kvk_vmerge_params vmp;
        vmp.base = mp;
        vmp.vp = vpar;
        if (graph || pd->num_items > 0)
            status = kva__launch_ex(st, ke->fn, grid, threads, (unsigned)pd->backend_data[KVA__BD_SMEM], s, &vpp, NULL,
                                    0u, pdl, "run: launching the variant's attention kernel");
        if (status == KVA_OK && (graph || pd->num_merge > 0))
            status = kva__launch_ex(st, ke->fn_vmerge, (unsigned)pd->num_workers, KVK_THREADS, 0, s, &vmp, NULL, 0u,
                                    pdl, "run: launching the variant's merge kernel");
        kva__leave(st, pushed);
        return status;
    }
    if (graph || pd->num_items > 0)
        status = kva__launch_ex(st, ke->fn, grid, threads, (unsigned)pd->backend_data[KVA__BD_SMEM], s, &p,
                                (pfw || hg) ? (void*)&tm : NULL, cluster, pdl,
                                cluster > 1 ? "run: launching the attention kernel in clusters"
                                            : "run: launching the attention kernel");
    if (status == KVA_OK && !fused && (graph || pd->num_merge > 0)) {
        /* graph mode keeps the worker count whatever the plan; else a CTA per task (row_units 0), a warp per (task,
           row) (1) or a CTA per (task, row) (2), at most the worker count (kva_merge_partials[_rows]) */
        unsigned mgrid = (unsigned)pd->num_workers;
        const int64_t wpb = KVK_THREADS / 32;
        const int64_t need = mp.row_units == 2 ? (int64_t)pd->num_merge * pd->tile_q
                             : mp.row_units ? ((int64_t)pd->num_merge * pd->tile_q + wpb - 1) / wpb
                                            : pd->num_merge;
        if (!graph && need < (int64_t)pd->num_workers) mgrid = (unsigned)(need > 0 ? need : 1);
        status = kva__launch_ex(st, mp.row_units ? st->fn_merge_rows : st->fn_merge_partials, mgrid, KVK_THREADS, 0, s,
                                &mp, NULL, 0u,
                                a->enable_pdl != 0 && st->merge_pdl, "run: launching the merge kernel");
    }
    kva__leave(st, pushed);
    return status;
}

/* ---------------------------------------------------------------------------------------------- */
/* merge_state / merge_states                                                                      */

static kva_status kva__state_view(const char* name, const kva_tensor* v, const kva_tensor* s, kvk_state_view* out) {
    memset(out, 0, sizeof *out);
    /* the kernels step the head dim by one element: a last stride matters only where that dim has two or more
       elements (a view with no elements, or of head dim 1, has any; NumPy gives empty views zero strides) */
    const bool empty = v->shape[0] <= 0 || v->shape[1] <= 0 || v->shape[2] <= 0;
    KVA_RETURN_IF(!empty && v->shape[2] > 1 && v->stride[2] != 1, KVA_ERR_UNSUPPORTED,
                  "%s: v must have a unit last stride", name);
    KVA_RETURN_IF(!kva__al(v->data, kva_dtype_size(v->dtype)), KVA_ERR_ALIGNMENT, "%s: v.data is misaligned", name);
    out->v = v->data;
    out->v_stride_row = v->stride[0];
    out->v_stride_head = v->stride[1];
    out->dtype = v->dtype;
    if (s && s->data) {
        KVA_RETURN_IF(!kva__al(s->data, 4), KVA_ERR_ALIGNMENT, "%s: s.data is misaligned", name);
        out->s = (float*)s->data;
        out->s_stride_row = s->stride[0];
        out->s_stride_head = s->ndim > 1 ? s->stride[1] : 1;
    }
    return KVA_OK;
}

static unsigned kva__grid_for_warps(kva__cuda_state* st, int64_t warps) {
    int64_t ctas = (warps + 3) / 4;
    int64_t cap = (int64_t)st->num_sms * 16;
    if (ctas > cap) ctas = cap;
    if (ctas < 1) ctas = 1;
    return (unsigned)ctas;
}

static kva_status kva__cuda_merge_state(kva_context* ctx, const kva_tensor* v_a, const kva_tensor* s_a,
                                        const kva_tensor* v_b, const kva_tensor* s_b, const kva_tensor* v_out,
                                        const kva_tensor* s_out, const uint8_t* mask, void* stream) {
    kva__cuda_state* st = kva__st(ctx);
    kvk_merge_state_params p;
    memset(&p, 0, sizeof p);
    KVA_FORWARD(kva__state_view("merge_state: a", v_a, s_a, &p.a));
    KVA_FORWARD(kva__state_view("merge_state: b", v_b, s_b, &p.b));
    KVA_FORWARD(kva__state_view("merge_state: out", v_out, s_out, &p.out));
    KVA_RETURN_IF(v_a->shape[1] > INT32_MAX || v_a->shape[2] > INT32_MAX, KVA_ERR_UNSUPPORTED,
                  "merge_state: too many heads or dims");
    p.mask = mask;
    p.rows = v_a->shape[0];
    p.heads = (int32_t)v_a->shape[1];
    p.dim = (int32_t)v_a->shape[2];
    if (p.rows * p.heads == 0) return KVA_OK;
    int pushed;
    KVA_FORWARD(kva__enter(st, &pushed));
    kva_status status = kva__launch(st, st->fn_merge_state, kva__grid_for_warps(st, p.rows * p.heads), 0,
                                    (CUstream)stream, &p, "merge_state: launch");
    kva__leave(st, pushed);
    return status;
}

static kva_status kva__cuda_merge_states(kva_context* ctx, const kva_tensor* v, const kva_tensor* s,
                                         const int32_t* indptr, int64_t rows, const kva_tensor* v_out,
                                         const kva_tensor* s_out, void* stream) {
    kva__cuda_state* st = kva__st(ctx);
    kvk_merge_states_params p;
    memset(&p, 0, sizeof p);
    if (v->shape[0] > 0) KVA_FORWARD(kva__state_view("merge_states: input", v, s, &p.in));
    KVA_FORWARD(kva__state_view("merge_states: out", v_out, s_out, &p.out));
    KVA_RETURN_IF(v_out->shape[1] > INT32_MAX || v_out->shape[2] > INT32_MAX, KVA_ERR_UNSUPPORTED,
                  "merge_states: too many heads or dims");
    p.heads = (int32_t)v_out->shape[1];
    p.dim = (int32_t)v_out->shape[2];
    if (p.heads == 0) return KVA_OK;
    int pushed;
    KVA_FORWARD(kva__enter(st, &pushed));
    kva_status status = KVA_OK;
    for (int64_t r0 = 0; r0 < rows && status == KVA_OK; r0 += KVK_MERGE_STATES_CHUNK) {
        int32_t n = (int32_t)(rows - r0 < KVK_MERGE_STATES_CHUNK ? rows - r0 : KVK_MERGE_STATES_CHUNK);
        p.row0 = r0;
        p.nrows = n;
        for (int32_t i = 0; i <= n; ++i) p.indptr[i] = indptr[r0 + i];
        status = kva__launch(st, st->fn_merge_states, kva__grid_for_warps(st, (int64_t)n * p.heads), 0,
                             (CUstream)stream, &p, "merge_states: launch");
    }
    kva__leave(st, pushed);
    return status;
}

/* ---------------------------------------------------------------------------------------------- */
/* append                                                                                          */

static unsigned kva__pow2_align(uint64_t x) {
    unsigned v = 16;
    while (v > 1 && (x % v) != 0) v >>= 1;
    return v;
}

static kva_status kva__cuda_append(kva_context* ctx, const kva_tensor* append_k, const kva_tensor* append_v,
                                   const int32_t* batch_indices, const int32_t* positions, const int64_t* slots,
                                   int64_t nnz, const kva_paged_kv* paged, int32_t batch_size, void* stream) {
    kva__cuda_state* st = kva__st(ctx);
    const size_t ses = kva_dtype_size(append_k->dtype), des = kva_dtype_size(paged->dtype);
    KVA_RETURN_IF(ses == 0 || des == 0, KVA_ERR_UNSUPPORTED, "append: unsupported dtypes");
    KVA_RETURN_IF(append_k->stride[2] != 1 || append_v->stride[2] != 1, KVA_ERR_UNSUPPORTED,
                  "append: append_k and append_v need a unit last stride");
    KVA_RETURN_IF(!kva__al(append_k->data, ses) || !kva__al(append_v->data, ses) || !kva__al(paged->k_data, des) ||
                      !kva__al(paged->v_data, des) || !kva__al(batch_indices, 4) || !kva__al(positions, 4) ||
                      !kva__al(paged->indices, 4) || !kva__al(paged->indptr, 4) || !kva__al(paged->last_page_len, 4) ||
                      !kva__al(slots, 8),
                  KVA_ERR_ALIGNMENT, "append: a pointer is not aligned to its element size");
    kvk_append_params p;
    memset(&p, 0, sizeof p);
    p.ak = (const char*)append_k->data;
    p.av = (const char*)append_v->data;
    p.k = (char*)paged->k_data;
    p.v = (char*)paged->v_data;
    p.slots = slots; /* the slot form: the table fields are not read */
    p.batch_indices = slots ? NULL : batch_indices;
    p.positions = slots ? NULL : positions;
    p.indices = slots ? NULL : paged->indices;
    p.indptr = slots ? NULL : paged->indptr;
    p.last_page_len = slots ? NULL : paged->last_page_len;
    p.status = (kvk_status*)(uintptr_t)st->append_status;
    p.nnz = nnz;
    p.ak_stride_tok = append_k->stride[0] * (int64_t)ses;
    p.ak_stride_head = append_k->stride[1] * (int64_t)ses;
    p.av_stride_tok = append_v->stride[0] * (int64_t)ses;
    p.av_stride_head = append_v->stride[1] * (int64_t)ses;
    p.k_stride_page = paged->k_stride_page * (int64_t)des;
    p.k_stride_token = paged->k_stride_token * (int64_t)des;
    p.k_stride_head = paged->k_stride_head * (int64_t)des;
    p.v_stride_page = paged->v_stride_page * (int64_t)des;
    p.v_stride_token = paged->v_stride_token * (int64_t)des;
    p.v_stride_head = paged->v_stride_head * (int64_t)des;
    p.num_pages = paged->num_pages;
    p.num_indices = paged->num_indices;
    p.batch_size = batch_size;
    p.page_size = paged->page_size;
    p.heads = paged->num_heads;
    p.k_row_bytes = (int32_t)(paged->head_dim_qk * (int64_t)des);
    p.v_row_bytes = (int32_t)(paged->head_dim_vo * (int64_t)des);
    p.src_dtype = append_k->dtype;
    p.dst_dtype = paged->dtype;
    p.head_dim_qk = paged->head_dim_qk;
    p.head_dim_vo = paged->head_dim_vo;
    uint64_t all = (uint64_t)(uintptr_t)p.ak | (uint64_t)(uintptr_t)p.av | (uint64_t)(uintptr_t)p.k |
                   (uint64_t)(uintptr_t)p.v | (uint64_t)p.ak_stride_tok | (uint64_t)p.ak_stride_head |
                   (uint64_t)p.av_stride_tok | (uint64_t)p.av_stride_head | (uint64_t)p.k_stride_page |
                   (uint64_t)p.k_stride_token | (uint64_t)p.k_stride_head | (uint64_t)p.v_stride_page |
                   (uint64_t)p.v_stride_token | (uint64_t)p.v_stride_head | (uint64_t)p.k_row_bytes |
                   (uint64_t)p.v_row_bytes;
    p.vec = (int32_t)kva__pow2_align(all);
    if (nnz == 0 || p.heads == 0) return KVA_OK;
    int pushed;
    KVA_FORWARD(kva__enter(st, &pushed));
    kva_status status = kva__launch(st, st->fn_append, kva__grid_for_warps(st, nnz * p.heads), 0, (CUstream)stream,
                                    &p, "append: launch");
    kva__leave(st, pushed);
    return status;
}

/* ---------------------------------------------------------------------------------------------- */
/* faults                                                                                          */

static kva_status kva__cuda_read_faults(kva_context* ctx, const kva_workspace* ws, int which,
                                        kva_fault_report* report, void* stream) {
    kva__cuda_state* st = kva__st(ctx);
    const kva__cu_api* cu = st->cu;
    CUstream s = (CUstream)stream;
    int pushed;
    KVA_FORWARD(kva__enter(st, &pushed));
    kva_status status = kva__not_capturing(st, s, "kva_read_faults");
    kvk_status a, b;
    memset(&a, 0, sizeof a);
    memset(&b, 0, sizeof b);
    CUresult r = CUDA_SUCCESS;
    const bool have_ws = (which & KVA__FAULTS_WS) && ws->device && ws->device_bytes >= KVA__STATUS_BYTES;
    if (status == KVA_OK && have_ws) r = cu->MemcpyDtoHAsync(&a, (CUdeviceptr)(uintptr_t)ws->device, sizeof a, s);
    if (status == KVA_OK && r == CUDA_SUCCESS && (which & KVA__FAULTS_APPEND))
        r = cu->MemcpyDtoHAsync(&b, st->append_status, sizeof b, s);
    if (status == KVA_OK && r == CUDA_SUCCESS) r = cu->StreamSynchronize(s);
    /* Report (and clear) one fault word per call: a workspace fault first; an append fault then stays set and
       is reported by the next call, so neither is lost. */
    const kvk_status* f = a.first_key || a.count ? &a : (b.first_key || b.count ? &b : NULL);
    if (status == KVA_OK && r == CUDA_SUCCESS && f == &a)
        r = cu->MemsetD8Async((CUdeviceptr)(uintptr_t)ws->device, 0, sizeof a, s);
    if (status == KVA_OK && r == CUDA_SUCCESS && f == &b) r = cu->MemsetD8Async(st->append_status, 0, sizeof b, s);
    if (status == KVA_OK && r == CUDA_SUCCESS && f) r = cu->StreamSynchronize(s);
    if (status == KVA_OK && r != CUDA_SUCCESS) status = kva__cu_error(cu, r, "kva_read_faults");
    kva__leave(st, pushed);
    if (status != KVA_OK) return status;
    memset(report, 0, sizeof *report);
    report->request = -1;
    if (f) {
        report->faulted = 1;
        if (f->first_key) {
            uint64_t key = ~f->first_key;
            report->request = (int32_t)(key >> 32);
            report->page_index = (int64_t)(int32_t)(uint32_t)(key & 0xffffffffu);
        }
    }
    return KVA_OK;
}

/* ---------------------------------------------------------------------------------------------- */
/* init / destroy                                                                                  */

static void kva__cuda_destroy(kva_context* ctx) {
    kva__cuda_state* st = kva__st(ctx);
    if (!st) return;
    const kva__cu_api* cu = st->cu;
    int pushed = 0;
    if (kva__enter(st, &pushed) == KVA_OK) {
        for (int i = 0; i < KVA__STAGING_SLOTS; ++i) {
            kva__staging_slot* s = &st->staging[i];
            if (s->done) {
                cu->EventSynchronize(s->done);
                cu->EventDestroy(s->done);
            }
            if (s->host) cu->MemFreeHost(s->host);
        }
        for (int i = 0; i < st->num_kernels; ++i)
            if (st->kernels[i].module) cu->ModuleUnload(st->kernels[i].module);
        if (st->util_module) cu->ModuleUnload(st->util_module);
        if (st->aot) cu->ModuleUnload(st->aot);
        if (st->append_status) cu->MemFree(st->append_status);
        kva__leave(st, pushed);
    }
    cu->DevicePrimaryCtxRelease(st->dev);
    pthread_mutex_destroy(&st->mu);
    free(st);
    ctx->backend_state = NULL;
}

/* ---------------------------------------------------------------------------------------------- */
/* user variants                                                                                   */

/* The hooks are checked by a compile of their own (NVRTC, this device's architecture); the kernels that use
   them are compiled at plan time for the plan's dtypes, head dims and tile (kva__cuda_kernel: disk cache, logged). */
static kva_status kva__cuda_variant_compile(kva_context* ctx, kva_variant* v) {
    kva__cuda_state* st = kva__st(ctx);
    kva__log(ctx, KVA_LOG_DEBUG, "kvattn: checking variant %s with NVRTC (%s)", v->name, st->arch);
    KVA_FORWARD(kva__cuda_variant_check_compile(v, st->arch, st->cache_dir));
    v->cuda_src = kva__cuda_variant_source(v, 0);
    KVA_RETURN_IF(!v->cuda_src, KVA_ERR_OUT_OF_MEMORY, "kva_variant_create: out of host memory");
    if (kva__cuda_variant_tc_ok(v)) {
        v->cuda_src_pf = kva__cuda_variant_source(v, 2);
        KVA_RETURN_IF(!v->cuda_src_pf, KVA_ERR_OUT_OF_MEMORY, "kva_variant_create: out of host memory");
    }
    return KVA_OK;
}

static void kva__cuda_variant_release(kva_context* ctx, kva_variant* v) {
    (void)ctx;
    (void)v; /* the variant's kernels stay in the context's kernel table (keyed by its hash) until the context goes */
}

static const kva__backend_ops kva__cuda_ops = {
    .name = "cuda",
    .plans_on_host_memory = false,
    .check_desc = kva__cuda_check_desc,
    .choose_tile_q = kva__cuda_choose_tile_q,
    .finish_plan = kva__cuda_finish_plan,
    .run = kva__cuda_run,
    .merge_state = kva__cuda_merge_state,
    .merge_states = kva__cuda_merge_states,
    .append_paged_kv = kva__cuda_append,
    .read_faults = kva__cuda_read_faults,
    .destroy = kva__cuda_destroy,
    .variant_compile = kva__cuda_variant_compile,
    .variant_release = kva__cuda_variant_release,
    .plan_workers = kva__cuda_plan_workers,
    .kv_head_group = kva__cuda_kv_head_group,
    .cluster_ok = kva__cuda_cluster_ok,
};

/* The util module: prebuilt if the fatbin loaded, else NVRTC. */
static kva_status kva__load_util(kva_context* ctx, kva__cuda_state* st) {
    const kva__cu_api* cu = st->cu;
    CUmodule m = st->aot;
    if (m) {
        CUfunction f;
        if (cu->ModuleGetFunction(&f, m, "kva_merge_partials") != CUDA_SUCCESS) m = NULL;
    }
    if (!m) {
        kva__kkey k;
        memset(&k, 0, sizeof k);
        k.family = KVA__KF_UTIL;
        void* cubin = NULL;
        size_t cs = 0;
        KVA_FORWARD(kva__jit_cached(ctx, st->cache_dir, &k, st->arch, &cubin, &cs, NULL));
        CUresult r = cu->ModuleLoadData(&st->util_module, cubin);
        free(cubin);
        if (r != CUDA_SUCCESS) {
            st->util_module = NULL;
            return kva__cu_error(cu, r, "CUDA backend: loading the util module");
        }
        m = st->util_module;
    }
    KVA_CU_TRY(cu, cu->ModuleGetFunction(&st->fn_merge_partials, m, "kva_merge_partials"), "CUDA backend: kernel");
    st->merge_pdl = kva__cuda_func_pdl(st, st->fn_merge_partials);
    KVA_CU_TRY(cu, cu->ModuleGetFunction(&st->fn_merge_rows, m, "kva_merge_partials_rows"), "CUDA backend: kernel");
    KVA_CU_TRY(cu, cu->ModuleGetFunction(&st->fn_merge_state, m, "kva_merge_state"), "CUDA backend: kernel");
    KVA_CU_TRY(cu, cu->ModuleGetFunction(&st->fn_merge_states, m, "kva_merge_states"), "CUDA backend: kernel");
    KVA_CU_TRY(cu, cu->ModuleGetFunction(&st->fn_append, m, "kva_append_paged"), "CUDA backend: kernel");
    return KVA_OK;
}

/* Clusters for the tensor-core decode kernel's cluster combine (kva__cuda_cluster_ok): sm_90 with the prebuilt kernels
   and a driver with cuLaunchKernelEx. cluster_ctas = the clusters of the bf16 head-dim-128 4-row kernel (with the
   combine's shared memory) that fit at once, times the size: graph-mode plans of cluster descriptors run on that many
   workers (240 of 264 on an H100 at size 8). Off by default; KVATTN_CUDA_CLUSTER=2, 4, 8 or 16 (non-portable) turns
   clusters on at that size (8 is the measured one; 16 was slower everywhere). */
static void kva__cuda_cluster_init(kva_context* ctx, kva__cuda_state* st) {
    const kva__cu_api* cu = st->cu;
    st->cluster = 0;
    st->cluster_ctas = 0;
    const char* e = getenv("KVATTN_CUDA_CLUSTER");
    int want = 0; /* opt-in: measured neutral (eager) to mixed (graph) on an H100, docs/kernels/decode.md session 16 */
    if (e && *e) want = (!strcmp(e, "2") || !strcmp(e, "4") || !strcmp(e, "8") || !strcmp(e, "16")) ? atoi(e) : 0;
    if (want < 2 || st->cc != 90 || !st->aot || !cu->LaunchKernelEx || !cu->OccupancyMaxActiveClusters) return;
    kva__kkey k;
    memset(&k, 0, sizeof k);
    k.family = KVA__KF_DECODE_TC;
    k.dqk = k.dvo = 128;
    k.qt = k.kt = k.ot = KVA_DTYPE_BF16;
    k.rows = 4;
    char name[128];
    kva__kkey_name(&k, name, sizeof name);
    int index = -1;
    if (!kva__aot_has(name) || kva__cuda_kernel(ctx, st, &k, &index) != KVA_OK) return;
    CUlaunchAttribute at;
    CUlaunchConfig cfg;
    kva__cluster_config(&cfg, &at, (unsigned)(want * st->num_sms * 2), KVK_THREADS,
                        (unsigned)KVA__TC_SMEM_CC(k.dqk, k.kt, k.rows), NULL, (unsigned)want);
    int n = 0;
    if (cu->OccupancyMaxActiveClusters(&n, st->kernels[index].fn, &cfg) != CUDA_SUCCESS || n < 1) return;
    st->cluster = want;
    st->cluster_ctas = n * want;
    if (st->cluster_ctas > st->num_sms * st->ctas_per_sm)
        st->cluster_ctas = st->num_sms * st->ctas_per_sm / want * want;
    if (st->cluster_ctas < want) st->cluster = st->cluster_ctas = 0;
}

static kva_status kva__cuda_init_device(kva_context* ctx, kva__cuda_state* st) {
    const kva__cu_api* cu = st->cu;
    int v;
    KVA_CU_TRY(cu, cu->DeviceGetAttribute(&v, CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT, st->dev), "cuDeviceGetAttribute");
    st->num_sms = v;
    KVA_CU_TRY(cu, cu->DeviceGetAttribute(&v, CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN, st->dev),
               "cuDeviceGetAttribute");
    st->max_smem_optin = v;
    if (cu->DeviceGetAttribute(&v, CU_DEVICE_ATTRIBUTE_L2_CACHE_SIZE, st->dev) != CUDA_SUCCESS || v < 0) v = 0;
    st->l2_bytes = v;
    {
        /* nominal DRAM bandwidth (double data rate): the head-group tensor maps' L2 promotion depends on it */
        int mclk = 0, bus = 0;
        if (cu->DeviceGetAttribute(&mclk, CU_DEVICE_ATTRIBUTE_MEMORY_CLOCK_RATE, st->dev) != CUDA_SUCCESS || mclk < 0)
            mclk = 0;
        if (cu->DeviceGetAttribute(&bus, CU_DEVICE_ATTRIBUTE_GLOBAL_MEMORY_BUS_WIDTH, st->dev) != CUDA_SUCCESS || bus < 0)
            bus = 0;
        st->dram_gbps = 2.0 * (double)mclk * 1e3 * (double)bus / 8.0 / 1e9;
    }
    int smem_sm = 0;
    KVA_CU_TRY(cu, cu->DeviceGetAttribute(&smem_sm, CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_MULTIPROCESSOR, st->dev),
               "cuDeviceGetAttribute");
    /* the largest attention kernel: ROWS = 8, any head dim (every instance has the same pipeline bytes) */
    const int kmax = KVK_DEC_SMEM(64, 64, 2, 8) > KVK_DEC_SMEM(256, 256, 2, 8) ? KVK_DEC_SMEM(64, 64, 2, 8)
                                                                               : KVK_DEC_SMEM(256, 256, 2, 8);
    KVA_RETURN_IF(st->max_smem_optin < kmax, KVA_ERR_NO_DEVICE,
                  "CUDA backend: device %d allows %d bytes of shared memory per block; the kernels need %d", (int)ctx->device,
                  st->max_smem_optin, kmax);
    st->ctas_per_sm = smem_sm / (kmax + 1024) >= 2 ? 2 : 1;
    st->smem_sm = smem_sm;
    {
        const char* nb = getenv("KVATTN_BENCH_NO_BOUNDS_CHECK");
        st->no_bounds_check = nb && nb[0] == '1' && nb[1] == '\0';
        const char* nf = getenv("KVATTN_BENCH_NO_FUSED_MERGE"); /* A/B of the fused split-KV merge */
        st->no_fused_merge = nf && nf[0] == '1' && nf[1] == '\0';
        const char* mr = getenv("KVATTN_BENCH_MERGE_ROWS"); /* A/B: kva_merge_partials_rows' mapping 1 or 2 */
        st->merge_rows = mr && (mr[0] == '1' || mr[0] == '2') && mr[1] == '\0' ? mr[0] - '0' : 0;
        const char* rrm = getenv("KVATTN_BENCH_RS_ROW_MERGE"); /* A/B: =0 row-slot plans keep the fused merge */
        st->rs_row_merge = !(rrm && rrm[0] == '0' && rrm[1] == '\0');
        const char* rmp = getenv("KVATTN_BENCH_RS_ROW_MERGE_PAIRS"); /* A/B: the row merge's pair threshold */
        st->rs_row_merge_pairs = rmp && *rmp ? strtoll(rmp, NULL, 10) : KVA__RS_ROW_MERGE_PAIRS;
        const char* nw = getenv("KVATTN_BENCH_NO_WGMMA"); /* A/B: the mma.sync prefill mainloop on sm_90 too */
        st->no_wgmma = nw && nw[0] == '1' && nw[1] == '\0';
        const char* nt = getenv("KVATTN_BENCH_NO_TMA"); /* A/B: the Hopper prefill kernel copies K/V without TMA */
        st->no_tma = nt && nt[0] == '1' && nt[1] == '\0';
        const char* daw = getenv("KVATTN_BENCH_DECODE_ALL_WORKERS"); /* A/B: small decode batches on every worker */
        st->decode_all_workers = daw && daw[0] == '1' && daw[1] == '\0';
        const char* tw = getenv("KVATTN_BENCH_TC_WARPS"); /* A/B: 4 or 8 warps in one-CTA-per-SM decode plans */
        st->tc_warps = tw && (!strcmp(tw, "4") || !strcmp(tw, "8")) ? tw[0] - '0' : 0;
        const char* gm = getenv("KVATTN_BENCH_TC_GENERIC_MERGE"); /* A/B of the fused merge's small-task path */
        st->tc_generic_merge = gm && gm[0] == '1' && gm[1] == '\0';
        const char* te = getenv("KVATTN_BENCH_TC_EXP"); /* A/B experiments in the tensor-core decode kernel */
        st->tc_exp = te ? (int)(strtol(te, NULL, 0) & 0x3fff) : 0;
        const char* he = getenv("KVATTN_BENCH_HG_EXP"); /* A/B: the head-group kernel built at plan time */
        st->hg_exp = he ? (int)(strtol(he, NULL, 0) & 0x3fff) : 0;
        const char* npt = getenv("KVATTN_BENCH_NO_PAGED_TMA"); /* A/B: paged K/V by cp.async (ragged keeps TMA) */
        st->no_paged_tma = npt && npt[0] == '1' && npt[1] == '\0';
        const char* nh = getenv("KVATTN_BENCH_NO_L2_HINT"); /* A/B: decode K/V copies without the L2 evict-first policy */
        st->no_l2_hint = nh && nh[0] == '1' && nh[1] == '\0';
        const char* px = getenv("KVATTN_BENCH_PF_EXP"); /* timing experiments in the prefill kernels (wrong results) */
        st->pf_exp = px ? (int)(strtol(px, NULL, 0) & 0xff) : 0;
        if (st->pf_exp)
            kva__log(ctx, KVA_LOG_WARN, "kvattn: KVATTN_BENCH_PF_EXP=%d: prefill kernels built with timing experiments; "
                                        "results are NOT valid", st->pf_exp);
        const char* f8c = getenv("KVATTN_BENCH_FP8_CC"); /* A/B: fp8 KV at head dims 64, 256 on the CUDA-core kernel */
        st->fp8_cc = f8c && f8c[0] == '1' && f8c[1] == '\0';
        const char* hgv = getenv("KVATTN_CUDA_DECODE_HG"); /* 0: never, 1: wherever supported (tests, A/B) */
        st->decode_hg = hgv && (hgv[0] == '0' || hgv[0] == '1') && hgv[1] == '\0' ? hgv[0] - '0' : -1;
        const char* hgh = getenv("KVATTN_BENCH_HG_HEADS"); /* A/B: 2 or 4 heads per head-group item */
        st->hg_heads = hgh && (!strcmp(hgh, "2") || !strcmp(hgh, "4")) ? hgh[0] - '0' : 0;
        const char* hps = getenv("KVATTN_BENCH_HG_PER_SM"); /* A/B: head-group workers per SM at G = 2 (1 or 2) */
        st->hg_per_sm = hps && (!strcmp(hps, "1") || !strcmp(hps, "2")) ? hps[0] - '0' : 0;
        const char* hgp = getenv("KVATTN_BENCH_HG_L2_PROMO"); /* A/B: 0 none, 1 128 B, 2 256 B */
        /* default: the 256-byte promotion below 4 TB/s of DRAM bandwidth, none above. Interleaved A/B, head-group
           D1 calls of 268 MB to 2.1 GB: H100 SXM (3.35 TB/s) 2.3-2.8 % faster with it; H200 (4.8 TB/s) 4.8 % slower
           (prototype, 64 x 8k; TMA boxes of half a 256-byte row: docs/kernels/decode.md) */
        st->hg_promo = hgp && hgp[0] >= '0' && hgp[0] <= '2' && hgp[1] == '\0' ? hgp[0] - '0'
                       : (st->dram_gbps > 0.0 && st->dram_gbps < 4000.0)    ? 2
                                                                              : 0;
        const char* hrs = getenv("KVATTN_BENCH_HG_RS"); /* A/B: 0 = groups of 9-32 on the attention kernel, as before */
        st->hg_rs = !(hrs && hrs[0] == '0' && hrs[1] == '\0');
        const char* hrm = getenv("KVATTN_BENCH_HG_RS_MAX_MB"); /* A/B: K/V megabytes below which row slots with cp.async producers are taken */
        st->hg_rs_max_bytes = (hrm && *hrm ? strtoll(hrm, NULL, 10) : KVA__HG_RS_MAX_MB) * 1000000ll;
        const char* hgm = getenv("KVATTN_BENCH_HG_MIN_MB"); /* A/B: K/V megabytes from which head groups are taken */
        st->hg_min_bytes = (hgm && *hgm ? strtoll(hgm, NULL, 10) : KVA__HG_MIN_MB) * 1000000ll;
        const char* tp = getenv("KVATTN_BENCH_TRACE_PTR"); /* benchmark: kernel timestamps into this buffer */
        st->trace_ptr = tp && *tp ? strtoull(tp, NULL, 0) : 0ull;
        const char* th = getenv("KVATTN_BENCH_TRACE_HG"); /* 1: the trace is the head-group kernel's (KVA_HG_TRACE) */
        st->trace_hg = th && th[0] == '1' && th[1] == '\0';
        if (st->no_bounds_check)
            kva__log(ctx, KVA_LOG_WARN, "kvattn: KVATTN_BENCH_NO_BOUNDS_CHECK=1: page indices are NOT checked "
                                        "(benchmark builds only)");
    }
    const char* env = getenv("KVATTN_CUDA_CTAS_PER_SM");
    if (env && (env[0] == '1' || env[0] == '2') && env[1] == '\0') {
        int want = env[0] - '0';
        if (want <= st->ctas_per_sm) st->ctas_per_sm = want;
    }
    if (st->cc == 90) snprintf(st->arch, sizeof st->arch, "sm_90a");
    else snprintf(st->arch, sizeof st->arch, "sm_%d", st->cc);
    if (!kva__jit_cache_dir(ctx->jit_cache_dir, st->cache_dir, sizeof st->cache_dir)) {
        st->cache_dir[0] = '\0';
        kva__log(ctx, KVA_LOG_WARN,
                 "kvattn: no safe kernel cache directory (a directory owned by this user, not writable by group or "
                 "others); JIT-compiled kernels are not cached");
    } else {
        kva__jit_sweep(ctx, st->cache_dir, KVA__JIT_STALE_S); /* what compiles killed long ago left behind */
    }
    /* prebuilt kernels */
    for (int i = 0; i < kva__num_aot_images && !st->aot; ++i) {
        const kva__aot_image* im = &kva__aot_images[i];
        bool match = (im->arch == 90 && st->cc == 90) || (im->arch == 80 && st->cc_major == 8);
        if (!match) continue;
        CUresult r = cu->ModuleLoadData(&st->aot, im->data);
        if (r != CUDA_SUCCESS) {
            st->aot = NULL;
            kva__log(ctx, KVA_LOG_WARN, "kvattn: the prebuilt sm_%d kernels did not load (error %d); using NVRTC",
                     im->arch, (int)r);
        }
    }
    if (!st->aot)
        kva__log(ctx, KVA_LOG_INFO, "kvattn: no prebuilt kernels for compute capability %d.%d; kernels are compiled "
                                    "with NVRTC on first use",
                 st->cc_major, st->cc_minor);
    KVA_FORWARD(kva__load_util(ctx, st));
    kva__cuda_cluster_init(ctx, st);
    KVA_CU_TRY(cu, cu->MemAlloc(&st->append_status, KVA__STATUS_BYTES), "CUDA backend: cuMemAlloc");
    KVA_CU_TRY(cu, cu->MemsetD8Async(st->append_status, 0, KVA__STATUS_BYTES, NULL), "CUDA backend: cuMemsetD8Async");
    KVA_CU_TRY(cu, cu->StreamSynchronize(NULL), "CUDA backend: cuStreamSynchronize");
    return KVA_OK;
}

kva_status kva__cuda_init(kva_context* ctx) {
    const kva__cu_api* cu = kva__cu_load();
    if (!cu) return KVA_ERR_NO_DEVICE;
    int count = 0;
    CUresult r = cu->DeviceGetCount(&count);
    KVA_RETURN_IF(r != CUDA_SUCCESS || count == 0, KVA_ERR_NO_DEVICE, "CUDA backend: no CUDA device is visible");
    KVA_RETURN_IF(ctx->device >= count, KVA_ERR_NO_DEVICE, "CUDA backend: device %d requested, %d visible",
                  (int)ctx->device, count);
    kva__cuda_state* st = (kva__cuda_state*)calloc(1, sizeof *st);
    KVA_RETURN_IF(!st, KVA_ERR_OUT_OF_MEMORY, "CUDA backend: out of host memory");
    st->cu = cu;
    if (cu->DeviceGet(&st->dev, ctx->device) != CUDA_SUCCESS) {
        free(st);
        return kva__set_error(KVA_ERR_NO_DEVICE, "CUDA backend: cuDeviceGet(%d) failed", (int)ctx->device);
    }
    cu->DeviceGetAttribute(&st->cc_major, CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR, st->dev);
    cu->DeviceGetAttribute(&st->cc_minor, CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR, st->dev);
    st->cc = st->cc_major * 10 + st->cc_minor;
    cu->DeviceGetName(st->name, (int)sizeof st->name, st->dev);
    if (st->cc < 80) {
        kva__set_error(KVA_ERR_NO_DEVICE,
                       "CUDA backend: device %d (%s) has compute capability %d.%d; 8.0 or newer is needed",
                       (int)ctx->device, st->name, st->cc_major, st->cc_minor);
        free(st);
        return KVA_ERR_NO_DEVICE;
    }
    r = cu->DevicePrimaryCtxRetain(&st->cuctx, st->dev);
    if (r != CUDA_SUCCESS) {
        kva_status e = kva__cu_error(cu, r, "CUDA backend: cuDevicePrimaryCtxRetain");
        free(st);
        return e == KVA_ERR_BACKEND ? kva__retag_error(KVA_ERR_NO_DEVICE) : e; /* (keeps the message) */
    }
    pthread_mutex_init(&st->mu, NULL);
    ctx->backend_state = st;
    int pushed = 0;
    kva_status status = kva__enter(st, &pushed);
    if (status == KVA_OK) {
        status = kva__cuda_init_device(ctx, st);
        kva__leave(st, pushed);
    }
    if (status != KVA_OK) {
        char msg[1024];
        snprintf(msg, sizeof msg, "%s", kva_last_error_message());
        kva__cuda_destroy(ctx);
        return kva__set_error(status == KVA_ERR_JIT ? KVA_ERR_JIT : KVA_ERR_NO_DEVICE, "%s", msg);
    }
    ctx->ops = &kva__cuda_ops;
    ctx->num_workers = st->num_sms * st->ctas_per_sm;
    if (ctx->small_kv_chunk == 0) ctx->small_kv_chunk = 64; /* see kva_context.small_kv_chunk */
    ctx->worker_head_bytes = (int32_t)sizeof(kvk_worker_head);
    ctx->cluster_size = st->cluster;
    ctx->cluster_ctas = st->cluster_ctas;
    {
        const char* mc = getenv("KVATTN_BENCH_CLUSTER_MAX_CHUNK"); /* A/B: the longest chunk of a cluster-combine plan */
        ctx->cluster_max_chunk = mc && *mc ? (int32_t)strtol(mc, NULL, 10) : 256;
    }
    kva__log(ctx, KVA_LOG_INFO,
             "kvattn: CUDA device %d: %s, compute capability %d.%d, %d SMs, %d workers, %s kernels, clusters of %d "
             "(%d CTAs at once)",
             (int)ctx->device, st->name, st->cc_major, st->cc_minor, st->num_sms, (int)ctx->num_workers,
             st->aot ? "prebuilt + NVRTC" : "NVRTC", st->cluster, st->cluster_ctas);
    return KVA_OK;
}
