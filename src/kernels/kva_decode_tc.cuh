/*
 * kva_decode_tc.cuh - the tensor-core decode kernel (mma.sync m16n8k16, sm_80+): a persistent CTA of 4 warps (8 with
 * KVA_TC_NW=8: plans with one CTA per SM)
 * executes its worker's list of work items (src/core/internal.h): up to 8 packed query rows of one (request, KV
 * head) against a KV range. Used for batch decode and small-tile prefill whenever q and KV share a 16-bit dtype,
 * or KV is fp8 (any head dim), without fused RoPE; kva_decode.cuh (CUDA cores) covers the rest.
 *
 * One instance per inclusion, specialised by macros (defined by the includer or by NVRTC -D options):
 *   KVA_KERNEL_NAME, KVA_DQK (= KVA_DVO: 64, 128, 256), KVA_QT, KVA_KT, KVA_OT, KVA_ROWS (1, 2, 4, 8: size of the
 *   cross-warp combine buffer only; the MMA always computes 8 rows), KVA_NO_BOUNDS_CHECK (benchmark only: no page
 *   index check).
 *
 * Work decomposition. The KV range of an item is cut into subtiles of 16 tokens; warp w takes subtiles w, w+4, ...
 * Each warp runs its own cp.async pipeline of KVK_TC_STAGES(D, es) subtile buffers over the flattened sequence of
 * its subtiles across ALL items of the worker, so the first loads of the next item are in flight while the current
 * item finishes (no CTA barrier per tile; two CTA barriers per item, in the epilogue). A buffer is refilled right
 * after its subtile is computed, so while a warp waits every buffer is in flight (the kernel is latency-bound
 * on HBM: bytes in flight per SM = 8 warps x STAGES x 8 KB at head dim 128). cp.async copies whole 128-byte lines
 * (instruction i: rows i * 32/CPR + lane / CPR, chunk lane % CPR): 4-sector L2 requests. Page indices: the lane
 * that owns a token loads its index one subtile ahead; byte offsets reach the copying lanes by shuffles.
 *
 * Per subtile (one warp, 16 tokens, rows padded to 8):
 *   S^T[16 tok x 8 rows] = K[16 x D] . Q^T[D x 8]      A = K (ldmatrix from shared memory), B = Q (registers)
 *   online softmax on S^T in registers (each thread holds 2 rows x 2 tokens; row max over 8 lanes: 3 shuffles)
 *   O^T[D x 8 rows] += V^T[D x 16 tok] . P^T[16 x 8]    A = V^T (ldmatrix.trans), B = P^T (4 shuffles from S^T)
 * The K-dim of the PV product is a permutation of the subtile's tokens (pi2 below) chosen so that P^T's B fragment
 * comes from just two source lanes. fp8 KV: K is converted from shared memory in registers (the QK reduction over
 * the head dim uses a permuted dim order, the same for Q), V through ldmatrix.trans on byte pairs + prmt; both
 * as f16 with Q in f16 (scaled by a power of two so its largest element stays below 2^14).
 *
 * Shared memory layout of a subtile row (one token, D * es bytes): 16-byte chunk c is stored at chunk
 * c ^ f(t), f(t) = (t & 7) ^ ((t & 8) >> 1): conflict-free for the cp.async writes, the K ldmatrix (tokens 0-7 and
 * 8-15) and the V ldmatrix.trans (token sets {0,8,1,9,2,10,3,11} and {4,12,5,13,6,14,7,15}). fp8 rows of 64 bytes
 * (head dim 64) take 128-byte slots with chunk c at 2c ^ f(t): the 8 tokens of an ldmatrix still hit 8 slots, and the
 * two rows of a quarter-warp's K reads or copies (f differing in bit 0) the even and the odd slots.
 *
 * Split KV: an item with partial >= 0 writes its partial slot; with KVK_FLAG_FUSED_MERGE the CTA that writes the
 * last partial of a merge task (a counter in the high half of the task's num_partials, restored by that CTA)
 * merges the task's partials itself, so no merge kernel runs. The task of an item is in item.pad_ (finish_plan).
 * Cluster combine (sm_90, KVK_FLAG_CLUSTER: the kernel is launched in thread-block clusters): a split item with
 * pad_ = -n is chunk r (its cluster rank) of a unit of n chunks on ranks 0 .. n - 1, one item per CTA. Each rank owns
 * head dims r * ceil(D / n) .. of the unit's rows: every rank pushes its normalised partial values of those dims and
 * its rows' lse into the owner's shared memory (st.async, completing bytes on the owner's mbarrier), then waits for
 * the n pushes into its own buffer and writes the merged outputs; rank 0 also writes the lse. Every CTA initialises
 * its mbarrier and arrives on the cluster barrier at its start; a pushing CTA waits on that barrier first. No global
 * partials, arrival atomic or merge by the last CTA (docs/kernels/decode.md, session 16).
 *
 * Faults: page indices are checked against the pool (one compare per lane per subtile); a bad index zero-fills
 * the token, records (request, page) in the status word, and the item's rows get o = 0, lse = -inf (partials:
 * KVK_FAULT_LSE_BITS, which the merge turns into o = 0, lse = -inf).
 */
#include "kva_common.cuh"

#ifndef KVA_KERNEL_NAME
#error "KVA_KERNEL_NAME must be defined"
#endif

/* ---- helpers (once per translation unit) ---- */
#ifndef KVA_TC_HELPERS
#define KVA_TC_HELPERS

/* benchmark trace (KVA_TC_TRACE): the SM clock once `dep` is available, and the global timer */
KVA_DEV unsigned long long kva_clock_dep(unsigned dep) {
    unsigned long long t;
    asm volatile("{ .reg .u32 d; mov.u32 d, %1; mov.u64 %0, %%clock64; }" : "=l"(t) : "r"(dep) : "memory");
    return t;
}
KVA_DEV unsigned long long kva_globaltimer(void) {
    unsigned long long t;
    asm volatile("{ mov.u64 %0, %%globaltimer; }" : "=l"(t)::"memory");
    return t;
}
KVA_DEV int kva_tc_swz(int t) { return (t & 7) ^ ((t & 8) >> 1); }
/* token of K-index k (0..15) of the PV product */
KVA_DEV int kva_tc_pi2(int k) { return ((k >> 1) & 3) + 4 * (k >> 3) + 8 * (k & 1); }
KVA_DEV uint4 kva_ldg16(const void* p) {
    uint4 v;
    asm volatile("{ ld.global.nc.v4.u32 {%0, %1, %2, %3}, [%4]; }"
                 : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
                 : "l"(p));
    return v;
}
KVA_DEV unsigned kva_ldg_u32(const void* p) {
    unsigned v;
    asm volatile("{ ld.global.nc.u32 %0, [%1]; }" : "=r"(v) : "l"(p));
    return v;
}
KVA_DEV kvk_work_item kva_tc_load_item(const kvk_work_item* it) {
    return kva_item_of(kva_ldg16(it), kva_ldg16((const char*)it + 16));
}
#endif /* KVA_TC_HELPERS */

/* ---- geometry ---- */
#undef TC_NW
#undef TC_THREADS
#undef TC_ES
#undef TC_FP8
#undef TC_D
#undef TC_ROWB
#undef TC_CPR
#undef TC_KB
#undef TC_SB
#undef TC_ST
#undef TC_KS
#undef TC_MT
#undef TC_R
#undef TC_MERGE_BATCH
#undef TC_PIPE
#undef TC_COMB
#undef TC_KFIX
#undef TC_F8
#undef TC_MMA
#undef TC_PACK
#undef TC_QPAIR
#undef TC_CP16
#undef TC_L2_ONCE
#undef TC_KCH
#undef TC_SRB
#undef TC_CSC
#undef TC_PRO_UNROLL

#ifdef KVA_TC_NW /* warps per CTA: 4 (default) or 8 (plans with one CTA per SM; "_w8" kernels) */
#define TC_NW KVA_TC_NW
#else
#define TC_NW 4
#endif
#if TC_NW != 4 && TC_NW != 8
#error "KVA_TC_NW must be 4 or 8"
#endif
#define TC_THREADS (32 * TC_NW)
#define TC_ES KVK_DEC_ES(KVA_KT)
#define TC_FP8 (TC_ES == 1)
#define TC_D KVA_DQK
#define TC_ROWB (TC_D * TC_ES)      /* bytes per token row */
#define TC_CPR (TC_ROWB / 16)        /* 16-byte chunks per row (>= 4) */
#define TC_SRB KVK_TC_SROWB(TC_D, TC_ES) /* shared-memory bytes per token row (>= 128) */
#define TC_CSC (TC_SRB / TC_ROWB)    /* row chunk c sits in shared chunk slot TC_CSC * c (before the swizzle) */
#define TC_KB (16 * TC_SRB)          /* K (or V) bytes of a subtile */
#define TC_SB (2 * TC_KB)            /* stage bytes */
#define TC_ST KVK_TC_STAGES(TC_D, TC_ES)
#define TC_KS (TC_D / 16)            /* k-steps of QK, m-tiles of PV */
#define TC_MT (TC_D / 16)
#define TC_R KVA_ROWS
/* fused merge: 16 partials per round trip where the registers allow it (head dim 128 with 16-bit KV; every fp8 and
   head-dim 64 / 256 instance spills with 16: checked by the all-keys NVRTC test) */
#if KVA_DQK == 128 && (KVA_KT == KVK_F16 || KVA_KT == KVK_BF16)
#define TC_MERGE_BATCH 16
#else
#define TC_MERGE_BATCH 8
#endif
/* fp8 KV at head dim 256 is the register-tightest instance (64 accumulators, 32 q fragment words, the conversions):
   its QK product runs two independent MMA chains instead of four and its prologue issues unrolled, which keeps every
   sm_80 / sm_90a instance of it spill-free (ptxas; the all-keys NVRTC test checks) */
#if TC_FP8 && KVA_DQK == 256
#define TC_KCH 2
#define TC_PRO_UNROLL 1
#else
#define TC_KCH 4
#define TC_PRO_UNROLL 0
#endif
#define TC_PIPE (TC_NW * TC_ST * TC_SB)
#define TC_COMB (TC_NW * TC_D * TC_R * 4)
#if KVA_KT == KVK_E4M3
#define TC_KFIX KVA_E4M3_FIX
#define TC_F8 KVA_F8_E4M3
#else
#define TC_KFIX 1.0f
#define TC_F8 KVA_F8_E5M2
#endif
#if KVA_KT == KVK_BF16
#define TC_MMA kva_mma_bf16
#define TC_PACK kva_f32x2_to_bf16x2
#else
#define TC_MMA kva_mma_f16
#define TC_PACK kva_f32x2_to_f16x2
#endif
#if KVA_QT == KVK_F16
#define TC_QPAIR kva_f16x2_to_f32
#else
#define TC_QPAIR kva_bf16x2_to_f32
#endif

#if KVA_DQK != KVA_DVO
#error "the tensor-core decode kernel needs head_dim_qk == head_dim_vo"
#endif
#if KVA_DQK != 64 && KVA_DQK != 128 && KVA_DQK != 256
#error "head dim must be 64, 128 or 256"
#endif
#if TC_CPR < 8 && !(TC_FP8 && TC_CPR == 4)
#error "the tensor-core decode kernel needs rows of at least 128 bytes, or fp8 rows of 64"
#endif
#if !TC_FP8 && KVA_QT != KVA_KT
#error "the tensor-core decode kernel needs q and KV of the same 16-bit dtype"
#endif
#if KVA_ROWS != 1 && KVA_ROWS != 2 && KVA_ROWS != 4 && KVA_ROWS != 8
#error "KVA_ROWS must be 1, 2, 4 or 8"
#endif
#ifndef KVA_NO_BOUNDS_CHECK
#define KVA_NO_BOUNDS_CHECK 0
#endif
#ifndef KVA_TC_EXP /* benchmark A/B experiments (KVATTN_BENCH_TC_EXP) */
#define KVA_TC_EXP 0
#endif
#ifndef KVA_KV_L2_HINT /* K/V copies with the L2 evict-first policy (benchmark builds: KVATTN_BENCH_NO_L2_HINT=1 -> 0) */
#define KVA_KV_L2_HINT 1
#endif
/* K/V copies: evict-first where KVK_FLAG_KV_ONCE, else plain ones without a cache hint (a predicated pair,
   kva_cp_async16_ef): copies under an evict-normal policy hint were 4-20 % slower on H200 calls above 4 x the L2 size
   (1 x 128k 5.9 %, head dim 256 at 64 x 4k 8.9 %, fp8 head dim 64 at 64 x 4k 19.9 %; docs/kernels/decode.md, session
   27). fp8 at head dim 128 keeps the evict-normal hint where the flag is off: the pair spills there, and a branch per
   subtile instead made D6 fp8 1 x 32k 14 % slower (H200); its large calls run the head-group kernel. KVA_TC_EXP bit 9
   (A/B): the evict-normal hint everywhere. */
#if KVA_KV_L2_HINT && !(KVA_TC_EXP & 512) && !(TC_FP8 && KVA_DQK == 128)
#define TC_L2_ONCE true /* l2pol: always the evict-first policy; the flag picks the copy */
#define TC_CP16(d, s, n) kva_cp_async16_ef((d), (s), (n), l2pol, p.flags & KVK_FLAG_KV_ONCE)
#elif KVA_KV_L2_HINT
#define TC_L2_ONCE ((p.flags & KVK_FLAG_KV_ONCE) != 0u) /* l2pol: evict-first or evict-normal by the flag */
#define TC_CP16(d, s, n) kva_cp_async16_pol((d), (s), (n), l2pol)
#else
#define TC_CP16(d, s, n) kva_cp_async16((d), (s), (n))
#endif
#ifndef KVA_TC_TRACE
#define KVA_TC_TRACE 0
#endif
#undef TC_CC
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900 && TC_NW == 4 /* the cluster combine (KVK_FLAG_CLUSTER) */
#define TC_CC 1
#else
#define TC_CC 0
#endif
/* page indices in batches: where every subtile of an item lies in one page (page sizes that are multiples of 16, items
   on the 16-token grid) and the item has at least 4 subtiles per warp, lane l of a warp loads the page of the warp's
   subtile 32 b + l of the item when the warp reaches batch b, and the subtiles take their page from it by a shuffle.
   One page-index load per subtile, each waited on by the subtile's copies, cost 1-2.5 % on large calls at page size
   16 against the same pool read with pages of 256 tokens; loading the next batch ahead as well gained nothing
   (H100, docs/kernels/decode.md, session 18). TC_EXP bit 5 (A/B): one load per subtile, one subtile ahead, as before;
   bit 7 (probe, page tables with indices[i] = i only): no page-index load at all. Not on sm_80 with fp8 KV, whose
   kernels spill with it. */
#undef TC_PB
#if (KVA_TC_EXP & 32) || (TC_FP8 && defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 900)
#define TC_PB 0
#else
#define TC_PB 1
#endif
#ifndef KVA_TC_GENERIC_MERGE /* benchmark A/B: the fused merge always through kva_merge_task_rows */
#define KVA_TC_GENERIC_MERGE 0
#endif
/* trace slot i of this CTA (first item only): the SM clock after `dep` is available (thread 0) */
#undef TC_TR
#if KVA_TC_TRACE
#define TC_TR(i, dep)                                                                                         \
    do {                                                                                                      \
        if (tid == 0 && p.trace && tr_on) p.trace[blockIdx.x * 16 + (i)] = kva_clock_dep((unsigned)(dep));   \
    } while (0)
#else
#define TC_TR(i, dep) \
    do {              \
    } while (0)
#endif

extern "C" __global__ void __launch_bounds__(TC_THREADS, 1) KVA_KERNEL_NAME(const kvk_attn_params p) {
    extern __shared__ __align__(128) char kva_smem[];
    const int tid = threadIdx.x;
    const int lane = tid & 31;
    const int warp = tid >> 5;
    const int g8 = lane >> 2; /* MMA fragment row group */
    const int q4 = lane & 3;  /* MMA fragment column pair */
    const unsigned sbase = kva_smem_addr(kva_smem);
    const unsigned wpipe = sbase + (unsigned)(warp * (TC_ST * TC_SB));
#if KVA_KV_L2_HINT
    const unsigned long long l2pol = kva_l2_kv_policy(TC_L2_ONCE);
#endif
    float* const s_comb = (float*)(kva_smem + TC_PIPE);            /* [NW][D][R] */
    float* const s_md = (float*)(kva_smem + TC_PIPE + TC_COMB);    /* [NW][8][2]: m, d */
    int* const s_sbad = (int*)(s_md + TC_NW * 16);                 /* [NW][ST] */
    int* const s_flag = s_sbad + TC_NW * TC_ST;                    /* [4] */

    const unsigned flags = p.flags;
#if !(KVA_TC_EXP & 256)
    kva_pdl_start(); /* programmatic dependent launch (kva_common.cuh): the next kernel may start its CTAs */
#endif
#if TC_CC
    /* cluster combine (KVK_FLAG_CLUSTER): this CTA's mbarrier for the partial slices other ranks push into its shared
       memory, initialised before any rank can push (every thread arrives on the cluster barrier here; a pushing
       thread waits on it first) */
    const unsigned cc_bar = sbase + (unsigned)KVK_TC_CC_OFF(TC_D, TC_ES, TC_R, TC_NW);
    const unsigned cc_lse = cc_bar + 16u;                                       /* [KVK_TC_CC_MAX][R] */
    const unsigned cc_o = cc_lse + (unsigned)(KVK_TC_CC_MAX * TC_R * 4);        /* [n][S][R] */
    if (flags & KVK_FLAG_CLUSTER) {
        if (tid == 0) {
            kvp_mbar_init(cc_bar, 1u);
            kvp_fence_mbar_init_cluster();
        }
        kvp_cluster_arrive_relaxed();
    }
#endif
    const bool ragged = (flags & KVK_FLAG_RAGGED) != 0;
    const bool sigmoid = (flags & KVK_FLAG_SIGMOID) != 0;
    const float neg_inf = KVA_NEG_INF;
    const kvk_work_item* items = (const kvk_work_item*)(p.ws + p.off_items);
    const kvk_request* reqs = (const kvk_request*)(p.ws + p.off_requests);

    /* ---- warm L2 with this CTA's slice of the plan's int region and of the page table: the dependent header and
       page-index loads below then hit L2 instead of HBM (small, latency-bound calls; cold caches) ---- */
    {
        const unsigned n = (unsigned)(p.off_int_end - p.off_counts);
        const unsigned per = ((n + gridDim.x - 1u) / gridDim.x + 127u) & ~127u;
        for (unsigned o = (unsigned)tid * 128u; o < per; o += TC_THREADS * 128u) {
            const unsigned a = per * blockIdx.x + o;
            if (a < n) kva_prefetch_l2(p.ws + p.off_counts + a);
        }
        if (!ragged && p.num_entries > 0) {
            const unsigned long long nb = (unsigned long long)p.num_entries * 4ull;
            const unsigned long long per2 = ((nb + gridDim.x - 1u) / gridDim.x + 127u) & ~127ull;
            for (unsigned long long o = (unsigned long long)tid * 128u; o < per2; o += TC_THREADS * 128u) {
                const unsigned long long a = per2 * blockIdx.x + o;
                if (a < nb) kva_prefetch_l2((const char*)p.indices + a);
            }
        }
    }

#if KVA_TC_TRACE
    int tr_on = 1;
    if (tid == 0 && p.trace) {
        p.trace[blockIdx.x * 16 + 14] = kva_globaltimer();
        p.trace[blockIdx.x * 16 + 0] = kva_clock_dep(0u);
    }
#endif
    /* the worker's header: item range, first item and its request (kvk_worker_head), so the first page-index load
       waits on one load, not on worker range -> item -> request */
    int it_begin, it_end;
    kvk_request h_rq;
    kvk_work_item h_item;
    kva_load_worker_head(p.ws, p.off_worker_head, &it_begin, &it_end, &h_rq, &h_item);
#if KVA_TC_EXP & 16 /* TC_EXP bit 4 (A/B): the chain worker range -> item -> request instead of the header */
    {
        const kvk_i32* windptr = (const kvk_i32*)(p.ws + p.off_worker_indptr);
        it_begin = windptr[blockIdx.x];
        it_end = windptr[blockIdx.x + 1];
        if (it_begin < it_end) {
            h_item = kva_tc_load_item(items + it_begin);
            h_rq = reqs[h_item.req];
        }
    }
#endif
    /* programmatic dependent launch: the header is the plan's read-only region; everything below (page table, q, K/V,
       outputs, partials, merge counters) waits for the kernels before this one (TC_EXP bit 6, only to show that the
       selftest's PDL chain catches a missing wait: none) */
#if !(KVA_TC_EXP & 64)
    kva_pdl_wait();
#endif
    TC_TR(1, it_begin);

    /* ---- per-lane constants ---- */
    /* fetch: lane owns token (lane & 15) of a subtile (lanes 16-31 duplicate 0-15); cp.async: instruction i copies
       rows i * RPI + lane / CPR, chunk lane % CPR (whole 128-byte lines: 4-sector L2 requests) */
    const int ptok = lane & 15;
    const int pchunk = lane % TC_CPR;
    const bool kv_same = p.k_stride_page == p.v_stride_page && p.k_stride_token == p.v_stride_token;
    /* pages of 16k tokens: a subtile starting at a multiple of 16 lies in one page (row r at slot + r) */
    const bool ps16 = !ragged && (p.page_size & 15) == 0;
    const long long kstb = p.k_stride_token * TC_ES, vstb = p.v_stride_token * TC_ES;
#if !TC_FP8
    /* K ldmatrix: token (lane & 7) + 8 * ((lane >> 3) & 1), chunk 2 ks + (lane >> 4) */
    unsigned koff[4];
    {
        const int t = (lane & 7) + 8 * ((lane >> 3) & 1);
        const int f = kva_tc_swz(t);
        const int h = (lane >> 4) ^ (f & 1);
#pragma unroll
        for (int k = 0; k < 4; ++k) koff[k] = (unsigned)(t * TC_ROWB + 16 * h + 32 * (k ^ (f >> 1)));
    }
    /* V ldmatrix.trans: K-index (lane & 7) + 8 * (lane >> 4) (token pi2), chunk 2 mt + ((lane >> 3) & 1) */
    unsigned voff[4];
    {
        const int t = kva_tc_pi2((lane & 7) + 8 * (lane >> 4));
        const int f = kva_tc_swz(t);
        const int h = ((lane >> 3) & 1) ^ (f & 1);
#pragma unroll
        for (int k = 0; k < 4; ++k) voff[k] = (unsigned)(t * TC_ROWB + 16 * h + 32 * (k ^ (f >> 1)));
    }
#else
    /* fp8 K: rows g8 and g8 + 8, this lane's D/4 bytes: chunks q4 * (CPR/4) + h */
    unsigned k8off[2][TC_CPR / 4];
#pragma unroll
    for (int hh = 0; hh < 2; ++hh) {
        const int t = g8 + 8 * hh;
        const int f = kva_tc_swz(t);
#pragma unroll
        for (int h = 0; h < TC_CPR / 4; ++h)
            k8off[hh][h] = (unsigned)(t * TC_SRB + 16 * ((TC_CSC * (q4 * (TC_CPR / 4) + h)) ^ f));
    }
    /* fp8 V ldmatrix.trans on byte pairs: block (lane >> 3): token group (blk & 1), chunk 2 m2 + (blk >> 1) */
    unsigned voff[4];
    {
        const int t = kva_tc_pi2((lane & 7) + 8 * ((lane >> 3) & 1));
        const int f = kva_tc_swz(t);
#if TC_CSC == 1
        const int h = (lane >> 4) ^ (f & 1);
#pragma unroll
        for (int k = 0; k < 4; ++k) voff[k] = (unsigned)(t * TC_ROWB + 16 * h + 32 * (k ^ (f >> 1)));
#else /* 64-byte rows in 128-byte slots: chunk 2 k + (lane >> 4) at slot 2 (2 k + (lane >> 4)) ^ f; k = 0, 1 */
#pragma unroll
        for (int k = 0; k < 4; ++k) voff[k] = (unsigned)(t * TC_SRB + 16 * ((TC_CSC * ((2 * k + (lane >> 4)) & 3)) ^ f));
#endif
    }
#endif

    const char* const kbase = (const char*)p.k;
    const char* const vbase = (const char*)p.v;

    /* ================= producer: the warp's subtile sequence, STAGES - 1 subtiles ahead ================= */
    int pr_it = it_begin - 1, pr_s = 0, pr_nsub = 0, pr_kv0 = 0, pr_kv1 = 0, pr_req = 0, pr_rbase = 0;
    const char* pr_kb = kbase;
    const char* pr_vb = vbase;
    /* the producer's next item starts as the header's first item, with its request's KV base */
    int pr_nx_it = it_begin, pr_nx_rq_ok = 1, pr_nx_rbase = h_rq.kv_start;
    /* page-index batches (TC_PB): this lane's entry of the current batch of the producer's item and the batch's number
       (-1: none loaded for this item; TC_PR_NEXT resets it) */
    int pb_cur = 0, pb_b = -1;
    kvk_work_item pr_nx = h_item;
    bool alive = true;

    /* advance the producer cursor to its next subtile (crossing items); false when the worker's list is done */
#define TC_PR_NEXT()                                                                                          \
    do {                                                                                                      \
        pr_s += TC_NW;                                                                                        \
        while (pr_s >= pr_nsub) {                                                                             \
            if (++pr_it >= it_end) {                                                                          \
                alive = false;                                                                                \
                break;                                                                                        \
            }                                                                                                 \
            kvk_work_item w_ = pr_nx_it == pr_it ? pr_nx : kva_tc_load_item(items + pr_it);                   \
            const int rb_ = (pr_nx_it == pr_it && pr_nx_rq_ok) ? pr_nx_rbase : reqs[w_.req].kv_start;         \
            pr_kv0 = w_.kv_start;                                                                             \
            pr_kv1 = w_.kv_end;                                                                               \
            pr_nsub = pr_kv1 > pr_kv0 ? (pr_kv1 - pr_kv0 + 15) >> 4 : 0;                                      \
            pr_req = w_.req;                                                                                  \
            pr_rbase = rb_;                                                                                   \
            pr_kb = kbase + (long long)w_.kv_head * p.k_stride_head * TC_ES;                                  \
            pr_vb = vbase + (long long)w_.kv_head * p.v_stride_head * TC_ES;                                  \
            pr_s = warp;                                                                                      \
            pb_b = -1; /* no page-index batch of the new item yet */                                          \
            pr_nx_rq_ok = 0;                                                                                  \
            if (pr_it + 1 < it_end) {                                                                         \
                pr_nx = kva_tc_load_item(items + pr_it + 1);                                                  \
                pr_nx_it = pr_it + 1;                                                                         \
            }                                                                                                 \
        }                                                                                                     \
    } while (0)

    /* a fetched subtile: the page index load is in flight until TC_ISSUE uses it (TC_EXP bit 12, A/B: per-lane
       page-index loads one subtile ahead for every item, no batches; session 31 measured batches only from 12
       subtiles per warp 2-5 % slower on every small D4 row): items of fewer than TC_PB_MIN subtiles per warp take
       per-lane loads */
#define TC_PB_MIN ((KVA_TC_EXP & 4096) ? (1 << 20) : 4)
    typedef struct {
        const char* kb;
        const char* vb;
        int pg, sl, has, req, live, one_page;
    } tc_rec;
#define TC_FETCH(R)                                                                                           \
    do {                                                                                                      \
        (R).live = alive ? 1 : 0;                                                                             \
        (R).has = 0;                                                                                          \
        (R).pg = 0;                                                                                           \
        (R).sl = 0;                                                                                           \
        (R).kb = pr_kb;                                                                                       \
        (R).vb = pr_vb;                                                                                       \
        (R).req = pr_req;                                                                                     \
        (R).one_page = 0;                                                                                     \
        if ((R).live) {                                                                                       \
            const int j_ = pr_kv0 + pr_s * 16 + ptok;                                                         \
            (R).one_page = ps16 && ((pr_kv0 + pr_s * 16) & 15) == 0;                                          \
            if (!TC_PB || ragged || !(R).one_page || pr_nsub < TC_PB_MIN * TC_NW) {                            \
                if (j_ < pr_kv1) {                                                                            \
                    (R).has = 1;                                                                              \
                    if (ragged) {                                                                             \
                        (R).sl = pr_rbase + j_;                                                               \
                    } else {                                                                                  \
                        const int e_ = (int)kva_fastdiv((unsigned)j_, p.ps_mul, p.ps_shift);                  \
                        (R).pg = (KVA_TC_EXP & 128) ? pr_rbase + e_ : kva_ldg_i32(p.indices + pr_rbase + e_); \
                        (R).sl = j_ - e_ * p.page_size;                                                       \
                    }                                                                                         \
                }                                                                                             \
            } else { /* warp-uniform: every subtile of this item lies in one page; its page from the batch */ \
                const int k_ = pr_s / TC_NW, b_ = k_ >> 5;                                                    \
                if (pb_b != b_) {                                                                             \
                    TC_PB_LOAD(pb_cur, b_);                                                                   \
                    pb_b = b_;                                                                                \
                }                                                                                             \
                const int pgb_ = __shfl_sync(0xffffffffu, pb_cur, k_ & 31);                                   \
                if (j_ < pr_kv1) {                                                                            \
                    (R).has = 1;                                                                              \
                    (R).pg = pgb_;                                                                            \
                    (R).sl = j_ - (int)kva_fastdiv((unsigned)j_, p.ps_mul, p.ps_shift) * p.page_size;         \
                }                                                                                             \
            }                                                                                                 \
            TC_PR_NEXT();                                                                                     \
        }                                                                                                     \
    } while (0)
    /* batch B_ of the producer's item: lane l loads the page of the warp's subtile 32 B_ + l (0 past the item) */
#define TC_PB_LOAD(DST, B_)                                                                                   \
    do {                                                                                                      \
        const int jb_ = pr_kv0 + 16 * (warp + TC_NW * (32 * (B_) + lane));                                    \
        (DST) = jb_ < pr_kv1 ? kva_ldg_i32(p.indices + pr_rbase +                                             \
                                           (int)kva_fastdiv((unsigned)jb_, p.ps_mul, p.ps_shift))             \
                             : 0;                                                                             \
    } while (0)

    /* issue a fetched subtile into stage ST_ (cp.async, zero-fill past the range or on a bad page): the owner lane
       of a token computes its byte offsets, every lane copies whole lines of RPI rows per instruction */
#define TC_ISSUE(R, ST_)                                                                                      \
    do {                                                                                                      \
        if ((R).live) {                                                                                       \
            bool ok_ = (R).has != 0;                                                                          \
            int bad_ = 0;                                                                                     \
            if (!KVA_NO_BOUNDS_CHECK && ok_ && !ragged &&                                                     \
                (unsigned long long)(unsigned)(R).pg >= (unsigned long long)p.num_pages) {                    \
                ok_ = false;                                                                                  \
                bad_ = 1;                                                                                     \
                if (lane < 16) {                                                                              \
                    const unsigned long long k_ = ~(((unsigned long long)(unsigned)(R).req << 32) |           \
                                                    (unsigned long long)(unsigned)(R).pg);                    \
                    atomicMax((unsigned long long*)&((kvk_status*)p.ws)->first_key, k_);                      \
                }                                                                                             \
            }                                                                                                 \
            const unsigned okm_ = __ballot_sync(0xffffffffu, ok_);                                            \
            const unsigned st_ = wpipe + (unsigned)((ST_) * TC_SB);                                           \
            const char* kc_ = (R).kb + pchunk * 16;                                                           \
            const char* vc_ = (R).vb + pchunk * 16;                                                           \
            if ((R).one_page) { /* one page: row r at (page, slot0 + r); no per-row offsets to gather */      \
                const int pg0_ = __shfl_sync(0xffffffffu, (R).pg, 0);                                         \
                const int sl0_ = __shfl_sync(0xffffffffu, (R).sl, 0);                                        \
                const long long r0_ = lane / TC_CPR;                                                          \
                const char* kr_ = kc_ + ((long long)pg0_ * p.k_stride_page + (long long)sl0_ * p.k_stride_token) * TC_ES + r0_ * kstb; \
                const char* vr_ = vc_ + ((long long)pg0_ * p.v_stride_page + (long long)sl0_ * p.v_stride_token) * TC_ES + r0_ * vstb; \
                _Pragma("unroll") for (int i_ = 0; i_ < TC_CPR / 2; ++i_) {                                   \
                    const int r_ = i_ * (32 / TC_CPR) + lane / TC_CPR;                                        \
                    const unsigned nb_ = ((okm_ >> r_) & 1u) ? 16u : 0u;                                      \
                    const unsigned d_ = st_ + (unsigned)(r_ * TC_SRB + 16 * ((TC_CSC * pchunk) ^ kva_tc_swz(r_))); \
                    TC_CP16(d_, nb_ ? kr_ + (long long)(i_ * (32 / TC_CPR)) * kstb : kc_, nb_);         \
                    TC_CP16(d_ + TC_KB, nb_ ? vr_ + (long long)(i_ * (32 / TC_CPR)) * vstb : vc_, nb_); \
                }                                                                                             \
            } else {                                                                                          \
                const long long ko_ =                                                                         \
                    ok_ ? ((long long)(R).pg * p.k_stride_page + (long long)(R).sl * p.k_stride_token) * TC_ES : 0ll; \
                const long long vo_ =                                                                         \
                    ok_ ? ((long long)(R).pg * p.v_stride_page + (long long)(R).sl * p.v_stride_token) * TC_ES : 0ll; \
                _Pragma("unroll") for (int i_ = 0; i_ < TC_CPR / 2; ++i_) {                                   \
                    const int r_ = i_ * (32 / TC_CPR) + lane / TC_CPR;                                        \
                    const long long kor_ = __shfl_sync(0xffffffffu, ko_, r_);                                 \
                    const long long vor_ = kv_same ? kor_ : __shfl_sync(0xffffffffu, vo_, r_);               \
                    const unsigned nb_ = ((okm_ >> r_) & 1u) ? 16u : 0u;                                      \
                    const unsigned d_ = st_ + (unsigned)(r_ * TC_SRB + 16 * ((TC_CSC * pchunk) ^ kva_tc_swz(r_))); \
                    TC_CP16(d_, kc_ + kor_, nb_);                                                      \
                    TC_CP16(d_ + TC_KB, vc_ + vor_, nb_);                                              \
                }                                                                                             \
            }                                                                                                 \
            const int any_ = __any_sync(0xffffffffu, bad_);                                                   \
            if (lane == 0) s_sbad[warp * TC_ST + (ST_)] = any_;                                               \
        }                                                                                                     \
        if (alive && !pr_nx_rq_ok && pr_nx_it == pr_it + 1) { /* the producer's next request, ahead of use */ \
            pr_nx_rbase = reqs[pr_nx.req].kv_start;                                                           \
            pr_nx_rq_ok = 1;                                                                                  \
        }                                                                                                     \
    } while (0)

    {
        pr_nsub = 0;
        pr_s = 0;
        TC_PR_NEXT(); /* the first subtile */
    }
    TC_TR(2, pr_rbase);
    /* prologue: fetch the first STAGES subtiles (page loads in flight together), then issue them into every stage */
    {
        tc_rec pro[TC_ST];
#pragma unroll
        for (int s = 0; s < TC_ST; ++s) TC_FETCH(pro[s]);
        TC_TR(11, 0);
        /* 4 warps: one TC_ISSUE instance for every stage (not unrolled). A small call whose kernel code is not in
           the SM's instruction caches (other kernels ran in between, as in a model's decode step) mostly waits for
           its code: interleaved A/B, H200, 11-18 % faster at D1 1 x 1k, 1 x 4k, D7 1 x 1k, fp8 1 x 32k, where the
           unrolled issue was 0-2 % faster only with the code cached (docs/kernels/decode.md) */
#if (KVA_TC_EXP & 1) || (TC_NW == 8 && (KVA_TC_EXP & 8192)) || TC_PRO_UNROLL /* fp8 at head dim 256: registers
        (above). 8 warps rolled too (TC_EXP bit 13, A/B: unrolled): 101 against 129 KB of code at head dim 128, and
        interleaved on an H200 1 x 1k +9 %, 1 x 4k +14 %, 16 x 1k +2 %, 1 x 32k +2 %, D7 32-layer graph 1 x 1k +18 %
        (+6 % with PDL), single-call graph +6 %, none slower (session 31) */
#pragma unroll
        for (int s = 0; s < TC_ST; ++s) {
            TC_ISSUE(pro[s], s);
            kva_cp_async_commit();
        }
#else
#pragma unroll 1
        for (int s = 0; s < TC_ST; ++s) {
            TC_ISSUE(pro[0], s);
            kva_cp_async_commit();
#pragma unroll
            for (int j = 0; j + 1 < TC_ST; ++j) pro[j] = pro[j + 1];
        }
#endif
    }
    TC_TR(3, 0);
    tc_rec nrec;
    TC_FETCH(nrec);

    /* ================= consumer ================= */
    int cc = 0; /* consumer subtile counter (stage = cc % ST) */
    /* item header of the next item (prefetched) */
    kvk_work_item cn_item;
    kvk_request cn_rq;
    cn_item.req = 0;
    cn_item.rows = 0;
    if (it_begin < it_end) {
        cn_item = h_item;
        cn_rq = h_rq;
    }
    /* q of the next item, raw */
#if !TC_FP8
    unsigned qn[TC_KS][2];
#else
    uint4 qn[TC_KS / 2];
#endif
#define TC_LOAD_Q(ITEM, RQ)                                                                                   \
    do {                                                                                                      \
        const bool qv_ = g8 < (ITEM).rows;                                                                    \
        const int pr_ = (ITEM).row_start + (qv_ ? g8 : 0);                                                    \
        const int i_ = pr_ / p.group_size;                                                                    \
        const int qh_ = (ITEM).kv_head * p.group_size + (pr_ - i_ * p.group_size);                            \
        const unsigned short* qp_ = (const unsigned short*)p.q + (long long)((RQ).qo_start + i_) * p.q_stride_row + \
                                    (long long)qh_ * p.q_stride_head;                                         \
        TC_LOAD_Q_ROW(qp_, qv_);                                                                              \
    } while (0)
#if !TC_FP8
#define TC_LOAD_Q_ROW(QP, QV)                                                                                 \
    _Pragma("unroll") for (int ks_ = 0; ks_ < TC_KS; ++ks_) {                                                 \
        qn[ks_][0] = (QV) ? kva_ldg_u32((QP) + 16 * ks_ + 2 * q4) : 0u;                                       \
        qn[ks_][1] = (QV) ? kva_ldg_u32((QP) + 16 * ks_ + 8 + 2 * q4) : 0u;                                   \
    }
#else
#define TC_LOAD_Q_ROW(QP, QV)                                                                                 \
    _Pragma("unroll") for (int h_ = 0; h_ < TC_KS / 2; ++h_) {                                                \
        if (QV) qn[h_] = kva_ldg16((QP) + q4 * (TC_D / 4) + 8 * h_);                                          \
        else qn[h_] = make_uint4(0u, 0u, 0u, 0u);                                                             \
    }
#endif
    if (it_begin < it_end) TC_LOAD_Q(cn_item, cn_rq);

    for (int it = it_begin; it < it_end; ++it) {
#if KVA_TC_TRACE
        tr_on = it == it_begin + ((KVA_TC_EXP & 2) ? 1 : 0); /* TC_EXP bit 1: trace the worker's second item */
#endif
        const kvk_work_item item = cn_item;
        const kvk_request rq = cn_rq;
        /* next item's header: its record now, its request after the first subtile */
        int cn_stage = 0;
        if (it + 1 < it_end) cn_item = kva_tc_load_item(items + it + 1);

        const int kv0 = item.kv_start, kv1 = item.kv_end;
        const int nsub = kv1 > kv0 ? (kv1 - kv0 + 15) >> 4 : 0;

        /* ---- q fragments (B operand of S^T = K . Q^T) ---- */
        unsigned qf[TC_KS][2];
        float qscale = p.q_scale * TC_KFIX;
#if !TC_FP8
#pragma unroll
        for (int ks = 0; ks < TC_KS; ++ks) {
            qf[ks][0] = qn[ks][0];
            qf[ks][1] = qn[ks][1];
        }
#else
        {
            /* element (h, e) of this lane's slice is dim q4 * D/4 + 8 h + e; k-step ks takes dims 4 ks .. 4 ks + 3 */
            float mx = 0.0f;
#pragma unroll
            for (int h = 0; h < TC_KS / 2; ++h) {
                const unsigned w[4] = {qn[h].x, qn[h].y, qn[h].z, qn[h].w};
#pragma unroll
                for (int e = 0; e < 4; ++e) {
                    float a, b;
                    TC_QPAIR(w[e], &a, &b);
                    mx = fmaxf(mx, fmaxf(fabsf(a), fabsf(b)));
                }
            }
#pragma unroll
            for (int o = 1; o < 32; o <<= 1) mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, o));
            const int ex = (int)((__float_as_uint(mx) >> 23) & 0xffu) - 127;
            const int sh = ex > 13 ? ex - 13 : 0;
            const float down = __uint_as_float((unsigned)(127 - sh) << 23);
            qscale *= __uint_as_float((unsigned)(127 + (sh > 127 ? 127 : sh)) << 23);
#pragma unroll
            for (int h = 0; h < TC_KS / 2; ++h) {
                const unsigned w[4] = {qn[h].x, qn[h].y, qn[h].z, qn[h].w};
#pragma unroll
                for (int e = 0; e < 2; ++e) {
                    float a0, a1, a2, a3;
                    TC_QPAIR(w[2 * e], &a0, &a1);
                    TC_QPAIR(w[2 * e + 1], &a2, &a3);
                    qf[2 * h + e][0] = kva_f32x2_to_f16x2(a0 * down, a1 * down);
                    qf[2 * h + e][1] = kva_f32x2_to_f16x2(a2 * down, a3 * down);
                }
            }
        }
#endif

        /* ---- per-row facts of this lane's S^T rows 2 q4, 2 q4 + 1 ---- */
        int qpos[2];
        long long mbit[2];
        float slope[2];
#pragma unroll
        for (int e = 0; e < 2; ++e) {
            const int r = 2 * q4 + e;
            const int pr = item.row_start + (r < item.rows ? r : (item.rows > 0 ? item.rows - 1 : 0));
            const int i = pr / p.group_size;
            const int qh = item.kv_head * p.group_size + (pr - i * p.group_size);
            qpos[e] = rq.kv_len - rq.qo_len + i;
            mbit[e] = rq.mask_offset * 8 + (long long)i * rq.kv_len;
            float sl = 0.0f;
            if (flags & KVK_FLAG_ALIBI) sl = p.alibi_slopes ? p.alibi_slopes[qh] : kva_alibi_slope(qh, p.num_qo_heads);
            slope[e] = sl;
        }

        float oacc[TC_MT][4];
#pragma unroll
        for (int mt = 0; mt < TC_MT; ++mt)
#pragma unroll
            for (int e = 0; e < 4; ++e) oacc[mt][e] = 0.0f;
        float m0 = neg_inf, m1 = neg_inf, d0 = 0.0f, d1 = 0.0f;
        int item_bad = 0;

        for (int s = warp; s < nsub; s += TC_NW, ++cc) {
            /* every stage is in flight while we wait (the stage is refilled right after its compute, below) */
            KVA_CP_ASYNC_WAIT(TC_ST - 1);
            __syncwarp();
            if (s == warp) TC_TR(4, 0);
            const int stg = cc % TC_ST;
            const unsigned kst = wpipe + (unsigned)(stg * TC_SB);
            const unsigned vst = kst + TC_KB;
            item_bad |= s_sbad[warp * TC_ST + stg];
            const int tile0 = kv0 + s * 16;

            /* ---- S^T = K . Q^T ---- */
            float sa[4][4]; /* four independent MMA chains (TC_KCH of them with fp8 KV) */
#pragma unroll
            for (int e = 0; e < 4; ++e) sa[0][e] = sa[1][e] = sa[2][e] = sa[3][e] = 0.0f;
#if !TC_FP8
#pragma unroll
            for (int ks = 0; ks < TC_KS; ++ks) {
                unsigned a[4];
                kva_ldsm_x4(kst + koff[ks & 3] + 128u * (unsigned)(ks >> 2), a);
                TC_MMA(sa[ks & 3], a, qf[ks][0], qf[ks][1]);
            }
#else
#pragma unroll
            for (int h = 0; h < TC_CPR / 4; ++h) {
                const uint4 wlo = kva_ld_shared16(kst + k8off[0][h]);
                const uint4 whi = kva_ld_shared16(kst + k8off[1][h]);
                const unsigned lo[4] = {wlo.x, wlo.y, wlo.z, wlo.w};
                const unsigned hi[4] = {whi.x, whi.y, whi.z, whi.w};
#pragma unroll
                for (int e = 0; e < 4; ++e) {
                    const int ks = 4 * h + e;
                    unsigned a[4];
                    kva_fp8_k_afrag(lo[e], hi[e], TC_F8, a);
                    TC_MMA(sa[ks & (TC_KCH - 1)], a, qf[ks][0], qf[ks][1]);
                }
            }
#endif
            /* x[0]: token g8, row 2q4; x[1]: token g8, row 2q4+1; x[2], x[3]: token g8 + 8 */
            float x[4];
#pragma unroll
            for (int e = 0; e < 4; ++e) x[e] = ((sa[0][e] + sa[1][e]) + (sa[2][e] + sa[3][e])) * qscale;
            {
                const bool tail = tile0 + 16 > kv1;
                if (tail || (flags & (KVK_FLAG_ALIBI | KVK_FLAG_SOFTCAP | KVK_FLAG_CAUSAL | KVK_FLAG_WINDOW |
                                      KVK_FLAG_CUSTOM))) {
#pragma unroll
                    for (int e = 0; e < 4; ++e) {
                        const int r = e & 1;
                        const int j = tile0 + g8 + 8 * (e >> 1);
                        float v = x[e];
                        bool vis = j < kv1;
                        if (flags & KVK_FLAG_ALIBI) v += slope[r] * (float)(j - qpos[r]);
                        if (flags & KVK_FLAG_SOFTCAP) v = p.softcap * kva_tanh(v * (1.0f / p.softcap));
                        if ((flags & KVK_FLAG_CAUSAL) && j > qpos[r]) vis = false;
                        if ((flags & KVK_FLAG_WINDOW) && j < qpos[r] - p.window_left) vis = false;
                        if ((flags & KVK_FLAG_CUSTOM) && vis) {
                            const long long bit = mbit[r] + j;
                            if (((p.custom_mask[bit >> 3] >> (bit & 7)) & 1) == 0) vis = false;
                        }
                        if (flags & KVK_FLAG_TRANSFORM) v *= KVA_LOG2E;
                        x[e] = vis ? v : neg_inf;
                    }
                }
            }
            /* ---- online softmax (or sigmoid) ---- */
            float pv[4];
            if (!sigmoid) {
                float al0, al1;
                kva_st_softmax_step(x, m0, m1, d0, d1, pv, al0, al1);
                if (__any_sync(0xffffffffu, al0 != 1.0f || al1 != 1.0f)) {
#pragma unroll
                    for (int mt = 0; mt < TC_MT; ++mt) {
                        oacc[mt][0] *= al0;
                        oacc[mt][1] *= al1;
                        oacc[mt][2] *= al0;
                        oacc[mt][3] *= al1;
                    }
                }
            } else {
                const float sb = p.sigmoid_bias;
#pragma unroll
                for (int e = 0; e < 4; ++e) pv[e] = x[e] == neg_inf ? 0.0f : kva_rcp(1.0f + kva_exp2(-(x[e] + sb)));
            }
            /* ---- P^T B fragment: b0 = P(tokens q4, q4 + 8; row g8), b1 = P(tokens q4 + 4, q4 + 12; row g8) ---- */
            unsigned pb0, pb1;
            {
                const unsigned X0 = TC_PACK(pv[0], pv[2]);
                const unsigned X1 = TC_PACK(pv[1], pv[3]);
                const int src = q4 * 4 + (g8 >> 1);
                const unsigned y0a = __shfl_sync(0xffffffffu, X0, src);
                const unsigned y1a = __shfl_sync(0xffffffffu, X1, src);
                const unsigned y0b = __shfl_sync(0xffffffffu, X0, src + 16);
                const unsigned y1b = __shfl_sync(0xffffffffu, X1, src + 16);
                pb0 = (g8 & 1) ? y1a : y0a;
                pb1 = (g8 & 1) ? y1b : y0b;
            }
            /* ---- O^T += V^T . P^T ---- */
#if !TC_FP8
#pragma unroll
            for (int mt = 0; mt < TC_MT; ++mt) {
                unsigned a[4];
                kva_ldsm_x4_t(vst + voff[mt & 3] + 128u * (unsigned)(mt >> 2), a);
                TC_MMA(oacc[mt], a, pb0, pb1);
            }
#else
#pragma unroll
            for (int m2 = 0; m2 < TC_MT / 2; ++m2) {
                unsigned r[4];
                kva_ldsm_x4_t(vst + voff[m2 & 3] + 128u * (unsigned)(m2 >> 2), r);
                /* r[0]: tokens of K-index 2q4, 2q4+1 (group 0), dims 2 g8, 2 g8 + 1 of chunk 2 m2;
                   r[1]: group 1 (K-index + 8); r[2], r[3]: chunk 2 m2 + 1 */
#pragma unroll
                for (int hh = 0; hh < 2; ++hh) {
                    unsigned a[4];
                    kva_fp8_v_afrag(r[2 * hh], r[2 * hh + 1], TC_F8, a);
                    TC_MMA(oacc[2 * m2 + hh], a, pb0, pb1);
                }
            }
#endif
            /* refill this stage with the subtile STAGES ahead (every lane is done reading it) */
            __syncwarp();
            TC_ISSUE(nrec, stg);
            kva_cp_async_commit();
            TC_FETCH(nrec);
            /* the next item's request record, once this item's first subtile is done */
            if (cn_stage == 0) {
                cn_stage = 1;
                if (it + 1 < it_end) cn_rq = reqs[cn_item.req];
            }
        }

        TC_TR(5, __float_as_uint(oacc[0][0]));
        /* ---- next item's request and q in flight during the epilogue ---- */
        if (it + 1 < it_end) {
            if (cn_stage == 0) cn_rq = reqs[cn_item.req];
#if KVA_TC_EXP & 2048 /* TC_EXP bit 11 (timing only, wrong results): every item reads the first item's q (in L2) */
            TC_LOAD_Q(h_item, h_rq);
#else
            TC_LOAD_Q(cn_item, cn_rq);
#endif
        }
#if KVA_TC_EXP & 1024
        /* TC_EXP bit 10 (timing only, wrong results): no epilogue (no CTA barrier, combine, write or merge at an
           item's end), the bound on what an epilogue without CTA barriers could save; the values stay live */
        {
            float sink_ = m0 + m1 + d0 + d1;
#pragma unroll
            for (int mt = 0; mt < TC_MT; ++mt) sink_ += (oacc[mt][0] + oacc[mt][1]) + (oacc[mt][2] + oacc[mt][3]);
            if (__float_as_uint(sink_) == 0x7f800001u || item_bad) atomicAdd(&((kvk_status*)p.ws)->count, 1u);
            if (it >= it_begin) continue; /* (always: a plain continue leaves the epilogue unreachable, a warning) */
        }
#endif

        /* ================= item epilogue ================= */
#pragma unroll
        for (int o = 4; o < 32; o <<= 1) {
            d0 += __shfl_xor_sync(0xffffffffu, d0, o);
            d1 += __shfl_xor_sync(0xffffffffu, d1, o);
        }
        if (g8 == 0) {
            s_md[(warp * 8 + 2 * q4) * 2 + 0] = m0;
            s_md[(warp * 8 + 2 * q4) * 2 + 1] = d0;
            s_md[(warp * 8 + 2 * q4 + 1) * 2 + 0] = m1;
            s_md[(warp * 8 + 2 * q4 + 1) * 2 + 1] = d1;
        }
        if (2 * q4 < TC_R) {
            float* const cw = s_comb + warp * (TC_D * TC_R);
#pragma unroll
            for (int mt = 0; mt < TC_MT; ++mt) {
#if !TC_FP8
                const int dlo = 16 * mt + g8, dhi = dlo + 8;
#else
                const int dlo = 16 * mt + 2 * g8, dhi = dlo + 1;
#endif
#if TC_R >= 2
                *(float2*)(cw + dlo * TC_R + 2 * q4) = make_float2(oacc[mt][0], oacc[mt][1]);
                *(float2*)(cw + dhi * TC_R + 2 * q4) = make_float2(oacc[mt][2], oacc[mt][3]);
#else
                cw[dlo] = oacc[mt][0];
                cw[dhi] = oacc[mt][2];
#endif
            }
        }
        const int faulted = __syncthreads_or(item_bad);
        TC_TR(6, faulted);
        if (faulted && tid == 0) atomicAdd(&((kvk_status*)p.ws)->count, 1u);

        const bool to_partial = item.partial >= 0;
#if TC_CC
        /* a split item of a cluster-combine plan: chunk cc_rank of a unit of cc_n chunks on ranks 0 .. cc_n - 1; rank k
           combines head dims k * cc_s .. + cc_s - 1 of every row */
        const bool cc = to_partial && (flags & KVK_FLAG_CLUSTER) && item.pad_ < 0 && -item.pad_ <= KVK_TC_CC_MAX;
        const int cc_n = cc ? -item.pad_ : 1;
        const int cc_s = (TC_D + cc_n - 1) / cc_n;
        const unsigned cc_rank = cc ? kvp_cluster_rank() : 0u;
        if (cc) kvp_cluster_wait(); /* every rank's mbarrier is initialised (one item per CTA in these plans) */
#else
        const bool cc = false;
#endif
        {
            /* rows in parallel (unrolled), thread tid: head dims tid, tid + 128 */
            float* const po = (float*)(p.ws + p.off_partial_o);
            float* const pl = (float*)(p.ws + p.off_partial_lse);
            const int rows = item.rows < TC_R ? item.rows : TC_R;
            float ew[TC_R][TC_NW], rsc[TC_R];
            long long obase[TC_R];
#if KVA_TC_EXP & 4 /* A/B: every thread computes every row's factors */
#pragma unroll
            for (int r = 0; r < TC_R; ++r) {
#else
            /* lane r of each warp computes row r's factors (the same arithmetic), then the warp broadcasts them:
               a quarter to an eighth of the instructions on this serial stretch of a small call */
            {
                const int r = lane < TC_R ? lane : 0;
#endif
                float mw[TC_NW], dw[TC_NW], e_[TC_NW];
                float M = neg_inf;
#pragma unroll
                for (int w = 0; w < TC_NW; ++w) {
                    const float2 md = *(const float2*)(s_md + (w * 8 + r) * 2);
                    mw[w] = md.x;
                    dw[w] = md.y;
                    M = fmaxf(M, mw[w]);
                }
                const float Mu = M == neg_inf ? 0.0f : M;
                float dsum = 0.0f;
#pragma unroll
                for (int w = 0; w < TC_NW; ++w) {
                    e_[w] = sigmoid ? 1.0f : kva_exp2(mw[w] - Mu);
                    dsum += e_[w] * dw[w];
                }
                float sc = p.v_scale * TC_KFIX, l;
                if (sigmoid) {
                    l = 0.0f;
                } else {
                    sc = dsum > 0.0f ? sc * kva_rcp(dsum) : 0.0f;
                    l = dsum > 0.0f ? Mu + kva_log2(dsum) : neg_inf;
                }
                if (faulted) {
                    sc = 0.0f;
                    l = to_partial ? __uint_as_float(KVK_FAULT_LSE_BITS) : neg_inf;
                }
                const int pr = item.row_start + r;
                const int i = (int)kva_fastdiv((unsigned)pr, p.g_mul, p.g_shift);
                const int qh = item.kv_head * p.group_size + (pr - i * p.group_size);
                const long long ob = to_partial ? ((long long)item.partial * p.tile_q + r) * TC_D
                                                : (rq.qo_start + i) * p.o_stride_row + (long long)qh * p.o_stride_head;
                if (tid == r && r < rows) {
                    if (to_partial) {
                        if (!cc) pl[(long long)item.partial * p.tile_q + r] = l;
                    } else if (p.lse)
                        p.lse[(rq.qo_start + i) * p.lse_stride_row + (long long)qh * p.lse_stride_head] = l;
                }
#if TC_CC
                if (cc && lane == r && r < rows) /* row r's lse to every rank (warp w: ranks w, w + NW, ...) */
                    for (int k = warp; k < cc_n; k += TC_NW)
                        kvp_st_async_f32(kvp_cluster_map(cc_lse + (cc_rank * TC_R + (unsigned)r) * 4u, (unsigned)k), l,
                                         kvp_cluster_map(cc_bar, (unsigned)k));
#endif
#if KVA_TC_EXP & 4
#pragma unroll
                for (int w = 0; w < TC_NW; ++w) ew[r][w] = e_[w];
                rsc[r] = sc;
                obase[r] = ob;
#else
#pragma unroll
                for (int rr = 0; rr < TC_R; ++rr) {
#pragma unroll
                    for (int w = 0; w < TC_NW; ++w) ew[rr][w] = __shfl_sync(0xffffffffu, e_[w], rr);
                    rsc[rr] = __shfl_sync(0xffffffffu, sc, rr);
                    obase[rr] = __shfl_sync(0xffffffffu, ob, rr);
                }
#endif
            }
            TC_TR(12, 0);
#pragma unroll
            for (int dd = 0; dd < (TC_D + TC_THREADS - 1) / TC_THREADS; ++dd) {
                const int d = tid + TC_THREADS * dd;
                if (d < TC_D) {
#if TC_CC
                    /* the cluster combine: this dim's values go to rank d / cc_s, slice row d % cc_s of this rank */
                    unsigned cc_dst = 0u, cc_rb = 0u;
                    if (cc) {
                        const int k = d / cc_s;
                        const int j = d - k * cc_s;
                        cc_dst = kvp_cluster_map(cc_o + (unsigned)(((int)cc_rank * cc_s + j) * TC_R * 4), (unsigned)k);
                        cc_rb = kvp_cluster_map(cc_bar, (unsigned)k);
                    }
#endif
                    float cv[TC_NW][TC_R];
#pragma unroll
                    for (int w = 0; w < TC_NW; ++w) {
#if TC_R >= 4
#pragma unroll
                        for (int r4 = 0; r4 < TC_R; r4 += 4) {
                            const float4 v = *(const float4*)(s_comb + (w * TC_D + d) * TC_R + r4);
                            cv[w][r4] = v.x;
                            cv[w][r4 + 1] = v.y;
                            cv[w][r4 + 2] = v.z;
                            cv[w][r4 + 3] = v.w;
                        }
#else
#pragma unroll
                        for (int r = 0; r < TC_R; ++r) cv[w][r] = s_comb[(w * TC_D + d) * TC_R + r];
#endif
                    }
#pragma unroll
                    for (int r = 0; r < TC_R; ++r) {
                        if (r < rows) {
                            float acc = 0.0f;
#pragma unroll
                            for (int w = 0; w < TC_NW; ++w) acc = fmaf(ew[r][w], cv[w][r], acc);
                            const float o = acc * rsc[r];
                            if (to_partial) {
#if TC_CC
                                if (cc) kvp_st_async_f32(cc_dst + 4u * (unsigned)r, o, cc_rb);
                                else
#endif
                                    po[obase[r] + d] = o;
                            } else {
#if KVA_OT == KVK_F32
                                ((float*)p.o)[obase[r] + d] = o;
#elif KVA_OT == KVK_F16
                                ((unsigned short*)p.o)[obase[r] + d] = kva_f32_to_f16(o);
#else
                                ((unsigned short*)p.o)[obase[r] + d] = kva_f32_to_bf16(o);
#endif
                            }
                        }
                    }
                }
            }
        }

        TC_TR(7, 0);
#if TC_CC
        /* ---- cluster combine: wait for every rank's slice of this rank's dims (and every rank's lse), then merge
           them as kva_merge_task_rows does (fault -> o = 0, lse = -inf; sigmoid scores: plain sums) ---- */
        if (cc) {
            const int rows = item.rows < TC_R ? item.rows : TC_R;
            int cnt = TC_D - (int)cc_rank * cc_s;
            cnt = cnt < 0 ? 0 : (cnt > cc_s ? cc_s : cnt);
            if (tid == 0) kvp_mbar_arrive_expect_tx(cc_bar, (unsigned)(cc_n * (cnt + 1) * rows * 4));
            kvp_mbar_wait_cluster(cc_bar, 0u);
            const float* const ccl = (const float*)(kva_smem + KVK_TC_CC_OFF(TC_D, TC_ES, TC_R, TC_NW) + 16);
            const float* const cco = ccl + KVK_TC_CC_MAX * TC_R;
            for (int e = tid; e < (cnt + (cc_rank == 0u ? 1 : 0)) * rows; e += TC_THREADS) {
                const int j = e / rows, r = e - j * rows; /* j == cnt: rank 0 writes row r's lse */
                float mx = neg_inf;
                int fault = 0;
                for (int k = 0; k < cc_n; ++k) {
                    const float l = ccl[k * TC_R + r];
                    if (__float_as_uint(l) == KVK_FAULT_LSE_BITS) fault = 1;
                    else mx = fmaxf(mx, l);
                }
                const float m_use = mx == neg_inf ? 0.0f : mx;
                float wsum = 0.0f, acc = 0.0f;
                for (int k = 0; k < cc_n; ++k) {
                    const float l = ccl[k * TC_R + r];
                    const float w = sigmoid ? 1.0f : kva_exp2(l - m_use);
                    wsum += w;
                    if (j < cnt) acc = fmaf(w, cco[(k * cc_s + j) * TC_R + r], acc);
                }
                const int pr = item.row_start + r;
                const int i = pr / p.group_size;
                const int qh = item.kv_head * p.group_size + pr % p.group_size;
                if (j < cnt) {
                    const float scale = sigmoid ? 1.0f : (wsum > 0.0f ? kva_rcp(wsum) : 0.0f);
                    const float o = fault ? 0.0f : acc * scale; /* (a fault's lse is a NaN pattern) */
                    const long long oi = (rq.qo_start + i) * p.o_stride_row + (long long)qh * p.o_stride_head +
                                         (int)cc_rank * cc_s + j;
#if KVA_OT == KVK_F32
                    ((float*)p.o)[oi] = o;
#elif KVA_OT == KVK_F16
                    ((unsigned short*)p.o)[oi] = kva_f32_to_f16(o);
#else
                    ((unsigned short*)p.o)[oi] = kva_f32_to_bf16(o);
#endif
                } else if (p.lse) {
                    float l_out = sigmoid ? 0.0f : (wsum > 0.0f ? m_use + kva_log2(wsum) : neg_inf);
                    if (fault) l_out = neg_inf;
                    p.lse[(rq.qo_start + i) * p.lse_stride_row + (long long)qh * p.lse_stride_head] = l_out;
                }
            }
        }
#endif
        /* ---- fused split-KV merge: the CTA that writes a task's last partial merges the task (kva_merge_arrive;
           the barrier orders this CTA's partial writes before thread 0's arrival) ---- */
        /* KVA_TC_EXP bit 3 (timing only, wrong results): no arrival and no merge, the bound on what a cheaper
           cross-CTA combine could save */
        if (to_partial && !cc && (flags & KVK_FLAG_FUSED_MERGE) && !(KVA_TC_EXP & 8)) {
            __syncthreads();
            kvk_merge_task* const mtask = (kvk_merge_task*)(p.ws + p.off_merge) + item.pad_;
            if (tid == 0) kva_merge_arrive(mtask, s_flag);
            __syncthreads();
            TC_TR(8, s_flag[0]);
            if (s_flag[0]) {
#if KVA_TC_TRACE
                if (tid == 0 && p.trace && tr_on)
                    p.trace[blockIdx.x * 16 + 13] = kva_clock_dep(__float_as_uint(
                        __ldcg((const float*)(p.ws + p.off_partial_lse) + (long long)s_flag[1] * p.tile_q)));
#endif
#if TC_D <= 128 && !KVA_TC_GENERIC_MERGE
                if (s_flag[2] <= TC_MERGE_BATCH) {
                    /* a task of at most TC_MERGE_BATCH partials (small calls): kva_merge_task_rows' arithmetic in
                       the same order, without its loops over batches, weight chunks and head-dim sweeps */
                    const int n = s_flag[2];
                    const long long pf = s_flag[1];
                    const float* const plse = (const float*)(p.ws + p.off_partial_lse);
                    const float* const pov = (const float*)(p.ws + p.off_partial_o);
                    const long long ostep = (long long)p.tile_q * TC_D;
                    for (int r = warp; r < item.rows; r += TC_NW) {
                        const float* const orow = pov + (pf * p.tile_q + r) * TC_D + lane * 4;
                        float4 v[TC_MERGE_BATCH];
#pragma unroll
                        for (int k = 0; k < TC_MERGE_BATCH; ++k)
                            v[k] = (k < n && lane * 4 < TC_D) ? __ldcg((const float4*)(orow + k * ostep))
                                                             : make_float4(0.f, 0.f, 0.f, 0.f);
                        const float l = lane < n ? __ldcg(plse + (pf + lane) * p.tile_q + r) : neg_inf;
                        const bool lf = lane < n && __float_as_uint(l) == KVK_FAULT_LSE_BITS;
                        const int fault = __any_sync(0xffffffffu, lf);
                        const float mx = kva_warp_max(lf ? neg_inf : l);
                        const float m_use = mx == neg_inf ? 0.0f : mx;
                        const float w = lane < n ? (sigmoid ? 1.0f : kva_exp2(l - m_use)) : 0.0f;
                        const float wsum = 0.0f + kva_warp_sum(w);
                        float4 acc = make_float4(0.f, 0.f, 0.f, 0.f);
                        if (!fault) {
#pragma unroll
                            for (int k = 0; k < TC_MERGE_BATCH; ++k) {
                                const float wk = __shfl_sync(0xffffffffu, w, k);
                                if (k < n) {
                                    acc.x = fmaf(wk, v[k].x, acc.x);
                                    acc.y = fmaf(wk, v[k].y, acc.y);
                                    acc.z = fmaf(wk, v[k].z, acc.z);
                                    acc.w = fmaf(wk, v[k].w, acc.w);
                                }
                            }
                        }
                        float scale = sigmoid ? 1.0f : (wsum > 0.0f ? kva_rcp(wsum) : 0.0f);
                        if (fault) scale = 0.0f;
                        const int pr = item.row_start + r;
                        const int i = pr / p.group_size;
                        const int qh = item.kv_head * p.group_size + pr % p.group_size;
                        const long long ob = (rq.qo_start + i) * p.o_stride_row + (long long)qh * p.o_stride_head;
                        if (lane * 4 < TC_D)
                            kva_store4(p.o, ob + lane * 4, KVA_OT, acc.x * scale, acc.y * scale, acc.z * scale,
                                       acc.w * scale);
                        if (lane == 0 && p.lse) {
                            float l_out = sigmoid ? 0.0f : (wsum > 0.0f ? m_use + kva_log2(wsum) : neg_inf);
                            if (fault) l_out = neg_inf;
                            p.lse[(rq.qo_start + i) * p.lse_stride_row + (long long)qh * p.lse_stride_head] = l_out;
                        }
                    }
                } else
#endif
                {
                    kvk_merge_task tk;
                    tk.req = item.req;
                    tk.kv_head = item.kv_head;
                    tk.row_start = item.row_start;
                    tk.rows = item.rows;
                    tk.partial_first = s_flag[1];
                    tk.num_partials = s_flag[2];
                    kva_merge_task_rows(&tk, rq.qo_start, (const float*)(p.ws + p.off_partial_o),
                                        (const float*)(p.ws + p.off_partial_lse), p.tile_q, TC_D, p.group_size, sigmoid,
                                        p.o, KVA_OT, p.o_stride_row, p.o_stride_head, p.lse, p.lse_stride_row,
                                        p.lse_stride_head, warp, TC_NW, lane, TC_MERGE_BATCH);
                }
            }
        }
        __syncthreads(); /* s_comb, s_md, s_flag are reused by the next item */
        TC_TR(9, 0);
    }
#if KVA_TC_EXP & 256 /* A/B: the next kernel may start once this CTA's items are done (not at its start) */
    kva_pdl_start();
#endif
    KVA_CP_ASYNC_WAIT(0);
#if KVA_TC_TRACE
    if (tid == 0 && p.trace) {
        p.trace[blockIdx.x * 16 + 10] = kva_clock_dep(0u);
        p.trace[blockIdx.x * 16 + 15] = kva_globaltimer();
        unsigned smid;
        asm volatile("{ mov.u32 %0, %%smid; }" : "=r"(smid));
        p.trace[gridDim.x * 16 + blockIdx.x] = smid; /* after the grid's slots (the benchmark allocates 17 per CTA) */
    }
#endif
}

#undef TC_PR_NEXT
#undef TC_FETCH
#undef TC_PB_LOAD
#undef TC_ISSUE
#undef TC_LOAD_Q
#undef TC_PB_MIN
#undef TC_LOAD_Q_ROW
