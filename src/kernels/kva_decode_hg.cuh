/*
 * kva_decode_hg.cuh - the head-group decode kernel (sm_90: TMA and mbarriers; mma.sync m16n8k16): a persistent CTA
 * executes its worker's list of work items, each (request, group of HG consecutive KV heads, KV range) with the
 * group's HG x g query rows (the planner's unit with kv_head_group = HG: src/plan/planner.c). Batch decode with
 * q = KV of one 16-bit dtype at head dims 64 / 128, or 16-bit q with fp8 KV (e4m3 / e5m2) at head dim 128; GQA groups
 * g <= 8 (in row slots, 9 to 32: below); page sizes that are multiples of 16 (TMA) or any other (KVA_HG_GATHER).
 *
 * Why (docs/kernels/decode.md, session 12): on an NHD pool a load of one head reads 256-byte rows 2 KB apart, which
 * the H100 and H200 serve at 87.6-88.9 % of nominal whatever the copy engine; a TMA box over HG >= 2 heads of the same
 * 16 tokens reads at 90-92 %.
 *
 * One instance per inclusion, specialised by macros (the includer's or NVRTC -D options):
 *   KVA_KERNEL_NAME, KVA_DQK (= KVA_DVO: 64 or 128), KVA_QT (f16 or bf16), KVA_KT (= KVA_QT, or e4m3 / e5m2 at head
 *   dim 128), KVA_OT, KVA_HG (2 or 4: heads per item), KVA_HG_GATHER (1: pages of any size, below),
 *   KVA_NO_BOUNDS_CHECK (benchmark only).
 *
 * CTA: 2 HG consumer warps (8 for row slots: KVK_HG_CONSUMERS) and one producer warp (two for row slots and for
 * KVA_HG_GATHER: KVK_HG_PRODUCERS). The
 * KV range of an item is cut into 16-token subtiles on the absolute token grid (the item's first and last subtiles may be partial: masked); a page
 * size that is a multiple of 16 puts every subtile in one page. The producer warp walks the subtiles of its worker's
 * items (lanes load 32 page indices at a time, lane 0 issues) and fills a ring of HG_S stages: per subtile and
 * 64-column block, one TMA box {64 columns, 16 tokens, HG heads} of K and one of V (tensor maps over {head dim, page
 * rows, KV heads, pages} from the host, 128-byte swizzle), completing on the stage's full mbarrier. Other page sizes
 * (KVA_HG_GATHER: page 1, 3, ...) take two producer warps that gather each token's page and copy the same layout with
 * cp.async (docs/kernels/decode.md, session 29). Consumer warp w owns head w % HG of the group
 * and the subtiles j with j % P == w / HG (P = 2 consumer warps a head; row slots below):
 *   S^T[16 tok x 8 rows] = K[16 x D] . Q^T[D x 8]       A = K (ldmatrix), B = the head's g <= 8 query rows (registers)
 *   online softmax on S^T in registers (base 2)
 *   O^T[D x 8] += V^T[D x 16 tok] . P^T[16 x 8]         A = V^T (ldmatrix.trans), B = P^T (4 shuffles, 2 byte permutes)
 * and releases the stage on its empty mbarrier (HG arrivals). The two warps of a head combine through shared memory.
 * fp8 KV (head dim 128: one 128-byte box row per token and head) runs the same f16 MMAs as kva_decode_tc.cuh's fp8
 * path: K is read 16 bytes per lane (ld.shared, the 16 dims of one chunk) and converted in registers, the head dims
 * permuted the same way in q (lane q4 owns dims 32 q4 .. + 31, k-step ks takes dims 4 ks .. + 3 of that slice, q
 * scaled into the f16 range by a power of two folded into the logit scale); V is read by ldmatrix.trans on byte pairs
 * (two dims of one token per 16-bit element) and split into f16 by byte permutes, so accumulator row r8 of m-tile mt
 * holds dims 16 mt + 2 r8 and + 1.
 *
 * Row slots (KVA_HG_RS = 1, "_rs" names): GQA groups of 9 to 32 query heads over one KV head (MQA and large groups,
 * which the tensor-core decode kernel, at most 8 rows an item, would read once per 8 rows). The unit is one KV head
 * with its g rows (the planner's tile of g rows, kv_head_group 1); a stage holds 16 tokens of that one head (boxes
 * {64 columns, 16 tokens, 1 head}, a quarter of the bytes of a 4-head stage; 128-160 KB of stages, issued by two
 * producer warps: one issues a stage in ~340 ns, docs/kernels/decode.md, session 41). KVA_HG (2 or 4) / 2
 * slots of 16 rows: consumer warp w (8 of them) takes slot h = w % (KVA_HG / 2), rows 16 h .. 16 h + 15 of the group
 * (rows >= g are zero and never written), and every (8 / slots)-th subtile, with the rows as the MMA's M (S = Q.K^T,
 * O += P.V; P from S's accumulators in registers), so one warp computes 16 rows of a stage with D / 8 independent
 * MMAs in its P.V step (docs/kernels/decode.md, session 40; the first form had slots of 8 rows in the orientation
 * above). Every K/V byte is read from memory once per item, whatever g.
 *
 * Faults: a page index outside the pool skips the copy, records (request, page) in the status word, and the item's
 * rows get o = 0, lse = -inf (partials: KVK_FAULT_LSE_BITS, which the merge turns into o = 0, lse = -inf).
 * Split KV: partial slots of HG x g rows; with KVK_FLAG_FUSED_MERGE the CTA that writes a task's last partial merges
 * it (as in kva_decode_tc.cuh), else the merge kernel does.
 */
#include "kva_common.cuh"

#ifndef KVA_KERNEL_NAME
#error "KVA_KERNEL_NAME must be defined"
#endif
#if KVA_DQK != KVA_DVO || (KVA_DQK != 64 && KVA_DQK != 128)
#error "the head-group decode kernel takes head dims 64 or 128 (qk = vo)"
#endif
#if KVA_QT != KVK_F16 && KVA_QT != KVK_BF16
#error "the head-group decode kernel needs 16-bit q"
#endif
#undef HG_FP8
#if KVA_KT == KVK_E4M3 || KVA_KT == KVK_E5M2
#define HG_FP8 1
#if KVA_DQK != 128
#error "the head-group decode kernel takes fp8 KV at head dim 128"
#endif
#elif KVA_KT == KVA_QT
#define HG_FP8 0
#else
#error "the head-group decode kernel needs KV of q's dtype or fp8"
#endif
#if KVA_HG != 2 && KVA_HG != 4
#error "KVA_HG must be 2 or 4"
#endif
#ifndef KVA_HG_RS
#define KVA_HG_RS 0
#endif
#ifndef KVA_NO_BOUNDS_CHECK
#define KVA_NO_BOUNDS_CHECK 0
#endif
#undef HG_GATHER /* KVA_HG_GATHER = 1: the cp.async producer for page sizes that are not multiples of 16 ("_ga") */
#if defined(KVA_HG_GATHER) && KVA_HG_GATHER
#define HG_GATHER 1
#else
#define HG_GATHER 0
#endif


#undef HG_G
#undef HG_ES
#undef HG_RB
#undef HG_BH
#undef HG_NC
#undef HG_P
#undef HG_SL
#undef HG_RDIM
#undef HG_THREADS
#undef HG_NP
#undef HG_D
#undef HG_NCB
#undef HG_BOX
#undef HG_SB
#undef HG_S
#undef HG_KS
#undef HG_MT
#undef HG_CW
#undef HG_MMA
#undef HG_PACK
#undef HG_DLO
#undef HG_DHI
#undef HG_KFIX
#undef HG_F8
#define HG_G KVA_HG
#define HG_SL KVK_HG_SLOTS(HG_G, KVA_HG_RS) /* heads of a stage, or 16-row slots */
#define HG_P KVK_HG_PARTS(HG_G, KVA_HG_RS) /* consumer warps per head / row slot */
#define HG_NC KVK_HG_CONSUMERS(HG_G, KVA_HG_RS) /* consumer warps */
#define HG_NP KVK_HG_PRODUCERS(HG_GATHER, KVA_HG_RS) /* producer warps */
#define HG_THREADS KVK_HG_THREADS(HG_G, HG_GATHER, KVA_HG_RS)
#define HG_D KVA_DQK
#define HG_ES KVK_DEC_ES(KVA_KT)        /* bytes per K/V element */
#define HG_RB (HG_D * HG_ES)            /* bytes of one head's token row */
#define HG_NCB (HG_RB / 128)            /* 128-byte column blocks (one TMA box each) */
#define HG_BH (KVA_HG_RS ? 1 : HG_G)    /* KV heads in a stage: HG heads, or the one head of a row-slot item */
#define HG_BOX (HG_BH * 16 * 128)      /* bytes of one box: [HG_BH heads][16 tokens][128 B] */
#define HG_SB KVK_HG_STAGE_BYTES(HG_RB, HG_BH) /* stage: K blocks, then V blocks (2 * HG_NCB * HG_BOX) */
#define HG_S KVK_HG_NSTAGES(HG_RB, HG_G, KVA_HG_RS)
#define HG_KS (HG_D / 16)
#define HG_MT (HG_D / 16)
#define HG_CW KVK_HG_COMB_FLOATS(HG_D, KVA_HG_RS) /* combine record per lane: m0 m1 l0 l1 fault, acc */
#if KVA_KT == KVK_BF16
#define HG_MMA kva_mma_bf16
#define HG_PACK kva_f32x2_to_bf16x2
#else /* f16, and fp8 KV converted to f16 */
#define HG_MMA kva_mma_f16
#define HG_PACK kva_f32x2_to_f16x2
#endif
#if KVA_KT == KVK_E4M3 && defined(KVA_HG_EXP) && (KVA_HG_EXP & 1) /* A/B: e4m3 by the bit form (value / 256) */
#define HG_F8 KVA_F8_E4M3_BITS
#define HG_KFIX 256.0f
#elif KVA_KT == KVK_E4M3
#define HG_F8 KVA_F8_E4M3
#define HG_KFIX KVA_E4M3_FIX
#elif defined(KVA_HG_EXP) && (KVA_HG_EXP & 2) /* A/B: e5m2 by cvt, the form before the byte permute */
#define HG_F8 KVA_F8_E5M2_CVT
#define HG_KFIX 1.0f
#else
#define HG_F8 KVA_F8_E5M2
#define HG_KFIX 1.0f
#endif
#ifndef KVA_HG_TRACE
#define KVA_HG_TRACE 0
#endif
/* benchmark trace (KVA_HG_TRACE, built at plan time only; bench_decode.c --trace): per CTA, KVK_HGT_SLOTS 64-bit slots
   at p.trace + KVK_HGT_SLOTS * blockIdx.x: 0 SM clock at start, 1 global timer at start, 2 SM clock at the end of the
   consumers, 3 global timer then, 4 SM id, 5 the worker's subtiles, 6 SM clock after the prologue; per subtile c <
   KVK_HGT_N, at 8 + 6 c: the producer before its empty-barrier wait, after it, after the fault word and the
   expect_tx arrival, after the copies' issue; the consumer of head / slot 0 after its full-barrier wait, and at its
   release */
#undef HG_TRC
#if KVA_HG_TRACE
#define KVK_HGT_SLOTS 512
#define KVK_HGT_N 80
#define HG_TRC(i) (p.trace + (size_t)KVK_HGT_SLOTS * blockIdx.x + (i))
KVA_DEV unsigned long long kva_hg_clock(void) {
    unsigned long long t;
    asm volatile("{ mov.u64 %0, %%clock64; }" : "=l"(t)::"memory");
    return t;
}
KVA_DEV unsigned long long kva_hg_gtimer(void) {
    unsigned long long t;
    asm volatile("{ mov.u64 %0, %%globaltimer; }" : "=l"(t)::"memory");
    return t;
}
#endif
/* accumulator rows r8 and r8 + 8 of m-tile mt: head dims HG_DLO(mt) and HG_DLO(mt) + HG_DHI */
/* row slots: accumulator n-tile n, column 2 q4 + e: head dim HG_RDIM(n, e) (fp8: n-tiles of the even and the odd dims
   of each 16-dim chunk, kva_fp8_v_afrag) */
#if HG_FP8
#define HG_RDIM(n, e) (16 * ((n) >> 1) + 4 * q4 + 2 * (e) + ((n) & 1))
#else
#define HG_RDIM(n, e) (8 * (n) + 2 * q4 + (e))
#endif
#if HG_FP8
#define HG_DLO(mt) (16 * (mt) + 2 * r8)
#define HG_DHI 1
#else
#define HG_DLO(mt) (16 * (mt) + r8)
#define HG_DHI 8
#endif

extern "C" __global__ void __launch_bounds__(HG_THREADS, 1)
    KVA_KERNEL_NAME(const kvk_attn_params p, const __grid_constant__ kvk_tma tm) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    extern __shared__ __align__(128) char kva_smem[];
    /* the 128-byte swizzle repeats every 1024 bytes: stages start on a 1024-byte boundary (the host adds 1 KB) */
    const unsigned sraw = kva_smem_addr(kva_smem);
    const unsigned sbase = (sraw + 1023u) & ~1023u;
    char* const smem = kva_smem + (sbase - sraw);
    const unsigned full0 = sbase + (unsigned)(HG_S * HG_SB), empty0 = full0 + 8u * HG_S;
    int* const s_fault = (int*)(smem + HG_S * HG_SB + 16 * HG_S);  /* [S]: the stage's subtile hit a bad page */
    int* const s_flag = s_fault + HG_S;                             /* [4]: fused merge */
    float* const s_comb = (float*)(smem + KVK_HG_OFF_COMB(HG_RB, HG_G, KVA_HG_RS)); /* [HG_P-1][HG_SL][32][HG_CW] */

    const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
    const kvk_work_item* items = (const kvk_work_item*)(p.ws + p.off_items);
    const kvk_request* reqs = (const kvk_request*)(p.ws + p.off_requests);
    const float neg_inf = KVA_NEG_INF;

#if KVA_HG_TRACE
    if (tid == 0 && p.trace) {
        *HG_TRC(0) = kva_hg_clock();
        *HG_TRC(1) = kva_hg_gtimer();
        unsigned smid;
        asm volatile("{ mov.u32 %0, %%smid; }" : "=r"(smid));
        *HG_TRC(4) = smid;
    }
#endif
    kva_pdl_start();
    if (tid == 0) {
        for (int s = 0; s < HG_S; ++s) {
            kvp_mbar_init(full0 + 8u * s, HG_GATHER ? 33 : 1); /* gather: 32 cp.async arrivals and lane 0's */
            kvp_mbar_init(empty0 + 8u * s, HG_SL); /* one consumer warp of each head / slot */
        }
        asm volatile("{ fence.mbarrier_init.release.cluster; }" ::: "memory");
    }
    /* the worker's header (kvk_worker_head): item range, first item and its request */
    int it0, it1;
    kvk_request h_rq;
    kvk_work_item h_item;
    kva_load_worker_head(p.ws, p.off_worker_head, &it0, &it1, &h_rq, &h_item);
    /* warm L2 with this CTA's slice of the plan's int region and of the page table (as kva_decode_tc.cuh) */
    {
        const unsigned n = (unsigned)(p.off_int_end - p.off_counts);
        const unsigned per = ((n + gridDim.x - 1u) / gridDim.x + 127u) & ~127u;
        for (unsigned o = (unsigned)tid * 128u; o < per; o += HG_THREADS * 128u) {
            const unsigned a = per * blockIdx.x + o;
            if (a < n) kva_prefetch_l2(p.ws + p.off_counts + a);
        }
        if (p.num_entries > 0) {
            const unsigned long long nb = (unsigned long long)p.num_entries * 4ull;
            const unsigned long long per2 = ((nb + gridDim.x - 1u) / gridDim.x + 127u) & ~127ull;
            for (unsigned long long o = (unsigned long long)tid * 128u; o < per2; o += HG_THREADS * 128u) {
                const unsigned long long a = per2 * blockIdx.x + o;
                if (a < nb) kva_prefetch_l2((const char*)p.indices + a);
            }
        }
    }
    kva_pdl_wait(); /* programmatic dependent launch (kva_common.cuh): only the read-only header was read so far */
    __syncthreads();
#if KVA_HG_TRACE
    if (tid == 0 && p.trace) *HG_TRC(6) = kva_hg_clock();
#endif

#if HG_GATHER
    if (warp >= HG_NC) {
        /* ================= producers: pages of any size (cp.async) =================
           A subtile's 16 tokens may lie in as many pages. HG_NP producer warps fill the ring in turn: warp
           HG_NC + pw copies the subtiles c (counted over the worker's items, as the consumers count them) with
           c % HG_NP == pw, so with an even ring each warp owns its own stages. Lane l (and l + 16) owns token l of a
           subtile: its page index and byte offsets (K and V), loaded two of the warp's subtiles ahead (a register
           queue: the page-table loads of single-token pages never stall the copies). The warp copies a subtile in the
           TMA boxes' layout (box [HG heads][16 tokens][128 B] per 128-byte column block, 128-byte swizzle: 16-byte
           chunk c of box row r at chunk c ^ (r & 7)): each instruction covers 32 consecutive chunks of the subtile's
           [token][head][chunk] order, so the HG heads of one token, contiguous in an NHD pool, are read together, and
           each token's offsets are gathered once. Tokens outside the item or on a bad page are zero-filled; a bad page
           marks the stage (s_fault) and records the first (request, page) as the TMA producer does. Each lane's copies
           complete on the stage's full barrier (cp.async.mbarrier.arrive.noinc: 32 arrivals, and lane 0's plain
           arrival after its s_fault write). */
        static_assert(HG_S % HG_NP == 0, "each producer warp owns every HG_NP-th stage");
        constexpr int CPH = HG_RB / 16;   /* 16-byte chunks per head row: 4, 8 or 16 */
        constexpr int CT = HG_BH * CPH;  /* per token over the stage's heads: 4 .. 64 */
        constexpr int TPI = CT >= 32 ? 1 : 32 / CT; /* tokens per copy instruction */
        constexpr int IPT = CT >= 32 ? CT / 32 : 1; /* copy instructions per token (K; as many for V) */
        const int pw = warp - HG_NC;
        const long long khs = p.k_stride_head * HG_ES, vhs = p.v_stride_head * HG_ES;
        int c = 0; /* subtiles of the worker's earlier items */
        for (int it = it0; it < it1; ++it) {
            const kvk_work_item w = it == it0 ? h_item : items[it];
            const int kv0 = w.kv_start, kv1 = w.kv_end;
            const int t0 = kv0 & ~15;
            const int nsub = kv1 > kv0 ? (kv1 - t0 + 15) >> 4 : 0;
            if (nsub == 0) continue;
            const int pbase = it == it0 ? h_rq.kv_start : reqs[w.req].kv_start;
            const char* const kg = (const char*)p.k + (long long)(w.kv_head * HG_BH) * khs;
            const char* const vg = (const char*)p.v + (long long)(w.kv_head * HG_BH) * vhs;
            /* this warp's first subtile of the item, and this lane's token of subtile S_: in the item, its page */
            const int s_first = (pw - c % HG_NP + HG_NP) % HG_NP;
#define HG_GA_LOAD(S_, IN_, PG_, SL_)                                                                         \
    do {                                                                                                      \
        const int tk_ = t0 + 16 * (S_) + (lane & 15);                                                         \
        IN_ = (S_) < nsub && tk_ >= kv0 && tk_ < kv1;                                                         \
        PG_ = 0;                                                                                              \
        SL_ = 0;                                                                                              \
        if (IN_) {                                                                                            \
            const int e_ = (int)kva_fastdiv((unsigned)tk_, p.ps_mul, p.ps_shift);                             \
            PG_ = kva_ldg_i32(p.indices + pbase + e_);                                                        \
            SL_ = tk_ - e_ * p.page_size;                                                                     \
        }                                                                                                     \
    } while (0)
            int a_in, a_pg, a_sl, b_in, b_pg, b_sl; /* the warp's next two subtiles */
            HG_GA_LOAD(s_first, a_in, a_pg, a_sl);
            HG_GA_LOAD(s_first + HG_NP, b_in, b_pg, b_sl);
            for (int s = s_first; s < nsub; s += HG_NP) {
                const int cs = c + s; /* the subtile's place in the worker's ring */
                const int in = a_in, pg = a_pg, sl = a_sl;
                a_in = b_in;
                a_pg = b_pg;
                a_sl = b_sl;
                HG_GA_LOAD(s + 2 * HG_NP, b_in, b_pg, b_sl);
                const bool bad = !KVA_NO_BOUNDS_CHECK && in &&
                                 (unsigned long long)(unsigned)pg >= (unsigned long long)p.num_pages;
                const bool ok = in && !bad;
                const long long ko =
                    ok ? ((long long)pg * p.k_stride_page + (long long)sl * p.k_stride_token) * HG_ES : 0ll;
                const long long vo =
                    ok ? ((long long)pg * p.v_stride_page + (long long)sl * p.v_stride_token) * HG_ES : 0ll;
                const unsigned okm = __ballot_sync(0xffffffffu, ok);
                const unsigned badm = __ballot_sync(0xffffffffu, bad) & 0xffffu;
                const int st = cs % HG_S;
                if (cs >= HG_S) kvp_mbar_wait(empty0 + 8u * st, (unsigned)(((cs / HG_S) & 1) ^ 1));
                const int bpg = __shfl_sync(0xffffffffu, pg, badm ? __ffs(badm) - 1 : 0);
                if (lane == 0) {
                    atomicExch(s_fault + st, badm ? 1 : 0);
                    if (badm) {
                        const unsigned long long k = ~(((unsigned long long)(unsigned)w.req << 32) |
                                                       (unsigned long long)(unsigned)bpg);
                        atomicMax((unsigned long long*)&((kvk_status*)p.ws)->first_key, k);
                    }
                }
                const unsigned dst = sbase + (unsigned)(st * HG_SB);
#pragma unroll
                for (int tg = 0; tg < 16 / TPI; ++tg) { /* TPI tokens per instruction, IPT instructions per token */
                    const int t = tg * TPI + (TPI > 1 ? lane / CT : 0);
                    const long long kr = __shfl_sync(0xffffffffu, ko, t);
                    const long long vr = __shfl_sync(0xffffffffu, vo, t);
                    const unsigned nb = ((okm >> t) & 1u) ? 16u : 0u;
#pragma unroll
                    for (int j = 0; j < IPT; ++j) {
                        const int cc = TPI > 1 ? lane % CT : 32 * j + lane;
                        const int hh = cc / CPH, c16 = cc % CPH;
                        const unsigned d = dst + (unsigned)((c16 >> 3) * HG_BOX + (hh * 16 + t) * 128 +
                                                            (((c16 & 7) ^ (t & 7)) << 4));
                        kva_cp_async16(d, nb ? kg + kr + hh * khs + c16 * 16 : kg, nb);
                        kva_cp_async16(d + (unsigned)(HG_NCB * HG_BOX), nb ? vg + vr + hh * vhs + c16 * 16 : vg, nb);
                    }
                }
                kvp_cp_async_mbar_arrive(full0 + 8u * st);
                if (lane == 0) kvp_mbar_arrive(full0 + 8u * st); /* releases s_fault and first_key with the stage */
            }
#undef HG_GA_LOAD
            c += nsub;
        }
        asm volatile("{ cp.async.wait_all; }" ::: "memory"); /* no copy outlives its issuing thread */
        return;
    }
#else
    if (HG_NP > 1 ? warp >= HG_NC : warp == HG_NC) {
        /* ================= producers =================
           HG_NP warps (row slots: 2) walk the worker's subtiles; warp HG_NC + pw issues those (counted over the
           worker's items, c) with c % HG_NP == pw. One warp issues a stage in ~340 ns (SM clock trace, H200: the
           empty-barrier check, the fault word and expect_tx arrival, 4 TMA issues ~165 ns, the loop ~90 ns), which
           caps a CTA of one-head 8 KB stages at ~22 GB/s (docs/kernels/decode.md, session 41); 4-head stages of 32 KB
           need one. */
#if HG_NP > 1
        const int pw = warp - HG_NC;
        int c0 = 0; /* subtiles of the earlier 32-subtile batches and items */
#else
        int c = 0;
#endif
        for (int it = it0; it < it1; ++it) {
            const kvk_work_item w = it == it0 ? h_item : items[it];
            const int t0 = w.kv_start & ~15;
            const int nsub = w.kv_end > w.kv_start ? (w.kv_end - t0 + 15) >> 4 : 0;
            if (nsub == 0) continue;
            const int pbase = it == it0 ? h_rq.kv_start : reqs[w.req].kv_start;
            const int head0 = w.kv_head * HG_BH;
            for (int s0 = 0; s0 < nsub; s0 += 32) {
                int pg = 0, sl = 0;
                if (s0 + lane < nsub) {
                    const int tok = t0 + 16 * (s0 + lane);
                    const int e = (int)kva_fastdiv((unsigned)tok, p.ps_mul, p.ps_shift);
                    pg = kva_ldg_i32(p.indices + pbase + e);
                    sl = tok - e * p.page_size;
                }
                const int n = nsub - s0 < 32 ? nsub - s0 : 32;
#if HG_NP > 1
                for (int l = (pw - c0 % HG_NP + HG_NP) % HG_NP; l < n; l += HG_NP) {
                    const int c = c0 + l; /* the subtile's place in the worker's ring */
#else
                for (int l = 0; l < n; ++l, ++c) {
#endif
                    const int pgl = __shfl_sync(0xffffffffu, pg, l), sll = __shfl_sync(0xffffffffu, sl, l);
                    if (lane == 0) {
                        const int st = c % HG_S;
#if KVA_HG_TRACE
                        if (p.trace && c < KVK_HGT_N) *HG_TRC(8 + 6 * c) = kva_hg_clock();
#endif
                        if (c >= HG_S) kvp_mbar_wait(empty0 + 8u * st, (unsigned)(((c / HG_S) & 1) ^ 1));
#if KVA_HG_TRACE
                        if (p.trace && c < KVK_HGT_N) *HG_TRC(9 + 6 * c) = kva_hg_clock();
#endif
                        const bool bad = !KVA_NO_BOUNDS_CHECK && (unsigned long long)(unsigned)pgl >=
                                                                    (unsigned long long)p.num_pages;
                        atomicExch(s_fault + st, bad ? 1 : 0); /* shared atomics: the consumers read it after the
                                                                   full barrier, racecheck-clean (a plain load there
                                                                   was no faster on row slots: session 40) */
                        const unsigned fb = full0 + 8u * st, dst = sbase + (unsigned)(st * HG_SB);
                        if (bad) {
                            const unsigned long long k = ~(((unsigned long long)(unsigned)w.req << 32) |
                                                           (unsigned long long)(unsigned)pgl);
                            atomicMax((unsigned long long*)&((kvk_status*)p.ws)->first_key, k);
                            kvp_mbar_arrive(fb);
                        } else {
                            kvp_mbar_arrive_expect_tx(fb, (unsigned)HG_SB);
#if KVA_HG_TRACE
                            if (p.trace && c < KVK_HGT_N) *HG_TRC(10 + 6 * c) = kva_hg_clock();
#endif
#pragma unroll
                            for (int cb = 0; cb < HG_NCB; ++cb) {
                                kvp_tma_load4(dst + (unsigned)(cb * HG_BOX), tm.k, cb * (128 / HG_ES), sll, head0,
                                              pgl, fb);
                                kvp_tma_load4(dst + (unsigned)((HG_NCB + cb) * HG_BOX), tm.v, cb * (128 / HG_ES), sll,
                                              head0, pgl, fb);
                            }
#if KVA_HG_TRACE
                            if (p.trace && c < KVK_HGT_N) *HG_TRC(11 + 6 * c) = kva_hg_clock();
#endif
                        }
                    }
                    __syncwarp();
                }
#if HG_NP > 1
                c0 += n;
#endif
            }
        }
        return;
    }
#endif

    /* ================= consumers ================= */
    const int h = warp % HG_SL, part = warp / HG_SL;
    const int q4 = lane & 3, r8 = lane >> 2;
    const int g = p.group_size;
    /* this warp's rows: the group's rows hb0 .. hb0 + gl - 1 (gl <= 8; row-slot warps past the group have none), and
       its K/V block in a stage (head hs) */
    const int hb0 = KVA_HG_RS ? 16 * h : 0, gl = KVA_HG_RS ? (g - hb0 < 16 ? g - hb0 : 16) : g;
    const int hs = KVA_HG_RS ? 0 : h;
    /* K ldmatrix (A = K[16 tok x 16 cols]): token (lane & 7) + 8 ((lane >> 3) & 1), 16-byte chunk 2 ks + (lane >> 4);
       V ldmatrix.trans (A = V^T): token (lane & 7) + 8 (lane >> 4), chunk 2 mt + ((lane >> 3) & 1). Row r of a box is
       h * 16 + token; its 16-byte chunk c sits at chunk c ^ (r & 7) (128-byte swizzle) */
#if !HG_FP8
    const int kt = (lane & 7) + 8 * ((lane >> 3) & 1), kc = lane >> 4;
    const int vt = (lane & 7) + 8 * (lane >> 4), vc = (lane >> 3) & 1;
    const unsigned krow = (unsigned)((hs * 16 + kt) * 128), vrow = (unsigned)((hs * 16 + vt) * 128);
#else
    /* fp8: K rows h * 16 + r8 (and + 8); V ldmatrix.trans rows: token (lane & 7) + 8 ((lane >> 3) & 1), chunk bit
       lane >> 4 */
    const unsigned k8row = (unsigned)((hs * 16 + r8) * 128);
    const int v8t = (lane & 7) + 8 * ((lane >> 3) & 1), v8c = lane >> 4;
    const unsigned v8row = (unsigned)((hs * 16 + v8t) * 128);
#endif
    static_assert((HG_P & (HG_P - 1)) == 0, "parts: a power of two");
    /* A stage's successive rounds must go to one part: a part waits on a stage's full barrier by parity, which cannot
       tell the round it wants from the one before it, so a part one round ahead of another on the same stage would
       pass a wait whose copies are still in flight (and its release would end the empty phase early). Subtile j of
       an item goes to part j % HG_P, so within an item stage c % HG_S stays with one part when HG_P divides HG_S; at
       an item's end the parts meet at the combine's barrier. (Session 41: row slots of one slot, 8 parts over 20
       stages, failed so once two producers kept the ring full.) */
    static_assert(HG_S % HG_P == 0, "each stage is consumed by one part within an item");
#if !KVA_HG_RS
    float* const comb = s_comb + (((part > 0 ? part - 1 : 0) * HG_SL + h) * 32 + lane) * HG_CW; /* parts >= 1 publish */
#endif
    const bool fused = (p.flags & KVK_FLAG_FUSED_MERGE) != 0u;
    int c = 0;
#if KVA_HG_RS
    kvk_work_item w = h_item; /* the item and its request: the header's first, then loaded (the header's copies do not
                                 stay live through the loop: 168 registers at 9-10 warps) */
    kvk_request rq = h_rq;
#endif
    for (int it = it0; it < it1; ++it) {
#if KVA_HG_RS
        if (it != it0) {
            w = items[it];
            rq = reqs[w.req];
        }
#else
        const kvk_work_item w = it == it0 ? h_item : items[it];
        const kvk_request rq = it == it0 ? h_rq : reqs[w.req];
#endif
        const int kv0 = w.kv_start, kv1 = w.kv_end;
        const int t0 = kv0 & ~15;
        const int nsub = kv1 > kv0 ? (kv1 - t0 + 15) >> 4 : 0;
        const int kvh = KVA_HG_RS ? w.kv_head : w.kv_head * HG_G + h;
#if KVA_HG_RS
        /* ---- row slots: this warp's 16-row tile (rows hb0 .. hb0 + 15 of the group; rows >= gl are zero and never
           written), the rows as the MMA's M:
             S[16 rows x 16 tok] = Q[16 x D] . K^T[D x 16 tok]    A = q (registers), B = K (ldmatrix, as the K
                                                                 A fragment of the other orientation: n-tile 0 takes
                                                                 its words 0 and 2, n-tile 1 words 1 and 3)
             online softmax on S in registers (rows r8 and r8 + 8, four tokens each; a quad holds a row)
             O[16 rows x D] += P[16 x 16 tok] . V[16 tok x D]     A = P from S's accumulators (no shuffles), B = V
                                                                 (ldmatrix.trans), D / 8 independent MMAs
           so one warp computes 16 rows of a stage where the 8-row orientation needs two warps' serial chains.
           Q A fragments: rows r8 (a[0], a[2]) and r8 + 8 (a[1], a[3]), columns 16 ks + 2 q4 (+1) and + 8; fp8 KV:
           dims 32 q4 + 4 ks (+1) and + 2 (+3), the k permutation of the fp8 K fragments (kva_fp8_k_afrag), q scaled
           into the f16 range by a power of two that the logit scale takes back. ---- */
        unsigned qa[HG_KS][4];
        float qscale = p.q_scale;
        {
            const bool ha = r8 < gl, hb = r8 + 8 < gl;
            const unsigned short* const q0 = (const unsigned short*)p.q + (long long)rq.qo_start * p.q_stride_row +
                                             (long long)(kvh * g + hb0) * p.q_stride_head;
            const unsigned short* const qra = q0 + (long long)(ha ? r8 : 0) * p.q_stride_head;
            const unsigned short* const qrb = q0 + (long long)(hb ? r8 + 8 : 0) * p.q_stride_head;
#if !HG_FP8
#pragma unroll
            for (int ks = 0; ks < HG_KS; ++ks) {
                qa[ks][0] = ha ? __ldg((const unsigned*)(qra + 16 * ks + 2 * q4)) : 0u;
                qa[ks][1] = hb ? __ldg((const unsigned*)(qrb + 16 * ks + 2 * q4)) : 0u;
                qa[ks][2] = ha ? __ldg((const unsigned*)(qra + 16 * ks + 8 + 2 * q4)) : 0u;
                qa[ks][3] = hb ? __ldg((const unsigned*)(qrb + 16 * ks + 8 + 2 * q4)) : 0u;
            }
#else
            float qf[2][HG_D / 4];
#pragma unroll
            for (int rr = 0; rr < 2; ++rr) {
                const bool has = rr ? hb : ha;
                const unsigned short* const qr = rr ? qrb : qra;
#pragma unroll
                for (int h8 = 0; h8 < HG_D / 32; ++h8) {
                    const uint4 w4 =
                        has ? __ldg((const uint4*)(qr + q4 * (HG_D / 4) + 8 * h8)) : make_uint4(0u, 0u, 0u, 0u);
                    const unsigned wv[4] = {w4.x, w4.y, w4.z, w4.w};
#pragma unroll
                    for (int e = 0; e < 4; ++e) {
#if KVA_QT == KVK_BF16
                        kva_bf16x2_to_f32(wv[e], &qf[rr][8 * h8 + 2 * e], &qf[rr][8 * h8 + 2 * e + 1]);
#else
                        kva_f16x2_to_f32(wv[e], &qf[rr][8 * h8 + 2 * e], &qf[rr][8 * h8 + 2 * e + 1]);
#endif
                    }
                }
            }
            /* one power of two for the warp's rows keeps the largest |q| below 2^14 in f16 */
            float mx = 0.f;
#pragma unroll
            for (int i = 0; i < HG_D / 4; ++i) mx = fmaxf(mx, fmaxf(fabsf(qf[0][i]), fabsf(qf[1][i])));
#pragma unroll
            for (int o = 1; o < 32; o <<= 1) mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, o));
            const int ex = (int)((__float_as_uint(mx) >> 23) & 0xffu) - 127;
            const int sh = ex > 13 ? ex - 13 : 0;
            const float down = __uint_as_float((unsigned)(127 - sh) << 23);
            qscale *= __uint_as_float((unsigned)(127 + (sh > 127 ? 127 : sh)) << 23) * HG_KFIX;
#pragma unroll
            for (int ks = 0; ks < HG_KS; ++ks) {
                qa[ks][0] = kva_f32x2_to_f16x2(qf[0][4 * ks] * down, qf[0][4 * ks + 1] * down);
                qa[ks][1] = kva_f32x2_to_f16x2(qf[1][4 * ks] * down, qf[1][4 * ks + 1] * down);
                qa[ks][2] = kva_f32x2_to_f16x2(qf[0][4 * ks + 2] * down, qf[0][4 * ks + 3] * down);
                qa[ks][3] = kva_f32x2_to_f16x2(qf[1][4 * ks + 2] * down, qf[1][4 * ks + 3] * down);
            }
#endif
        }
        /* rows r8 (m0, l0) and r8 + 8 (m1, l1); l: this lane's share of the row sum until the item's end */
        float m0 = neg_inf, m1 = neg_inf, l0 = 0.f, l1 = 0.f;
        float acc[HG_D / 8][4]; /* n-tile n: rows r8 (0, 1) and r8 + 8 (2, 3), dims HG_RDIM(n, 0 / 1) */
#pragma unroll
        for (int n = 0; n < HG_D / 8; ++n) acc[n][0] = acc[n][1] = acc[n][2] = acc[n][3] = 0.f;
        int faulted = 0;
        for (int j = 0; j < nsub; ++j, ++c) {
            if ((j & (HG_P - 1)) != part) continue;
            const int st = c % HG_S;
            kvp_mbar_wait(full0 + 8u * st, (unsigned)((c / HG_S) & 1));
#if KVA_HG_TRACE
            if (p.trace && h == 0 && lane == 0 && c < KVK_HGT_N) *HG_TRC(12 + 6 * c) = kva_hg_clock();
#endif
            if (atomicAdd(s_fault + st, 0)) {
                faulted = 1;
                __syncwarp();
                if (lane == 0) kvp_mbar_arrive(empty0 + 8u * st);
                continue;
            }
            const unsigned kbase = sbase + (unsigned)(st * HG_SB), vbase = kbase + (unsigned)(HG_NCB * HG_BOX);
            float sa[2][4] = {}; /* n-tiles: tokens 0-7, 8-15 (two independent MMA chains) */
#if !HG_FP8
#pragma unroll
            for (int ks = 0; ks < HG_KS; ++ks) {
                const int ch = 2 * ks + kc;
                unsigned a[4];
                kva_ldsm_x4(kbase + (unsigned)((ch >> 3) * HG_BOX) + krow + 16u * (unsigned)((ch & 7) ^ (kt & 7)), a);
                HG_MMA(sa[0], qa[ks], a[0], a[2]);
                HG_MMA(sa[1], qa[ks], a[1], a[3]);
            }
#else
#pragma unroll
            for (int hh = 0; hh < 2; ++hh) {
                const unsigned co = 16u * (unsigned)((2 * q4 + hh) ^ (r8 & 7));
                const uint4 wlo = kva_ld_shared16(kbase + k8row + co);
                const uint4 whi = kva_ld_shared16(kbase + k8row + 8u * 128u + co);
                const unsigned lo[4] = {wlo.x, wlo.y, wlo.z, wlo.w};
                const unsigned hi[4] = {whi.x, whi.y, whi.z, whi.w};
#pragma unroll
                for (int e = 0; e < 4; ++e) {
                    const int ks = 4 * hh + e;
                    unsigned a[4];
                    kva_fp8_k_afrag(lo[e], hi[e], HG_F8, a);
                    HG_MMA(sa[0], qa[ks], a[0], a[2]);
                    HG_MMA(sa[1], qa[ks], a[1], a[3]);
                }
            }
#endif
            /* x[nt][0 / 1]: row r8, tokens tb + 8 nt (+1); x[nt][2 / 3]: row r8 + 8, the same tokens */
            const int tb = t0 + 16 * j + 2 * q4;
            const bool edge = t0 + 16 * j < kv0 || t0 + 16 * j + 16 > kv1;
            float x[2][4];
#pragma unroll
            for (int nt = 0; nt < 2; ++nt)
#pragma unroll
                for (int e = 0; e < 4; ++e) {
                    const int tk = tb + 8 * nt + (e & 1);
                    x[nt][e] = !edge || (tk >= kv0 && tk < kv1) ? sa[nt][e] * qscale : neg_inf;
                }
            float mx0 = fmaxf(fmaxf(x[0][0], x[0][1]), fmaxf(x[1][0], x[1][1]));
            float mx1 = fmaxf(fmaxf(x[0][2], x[0][3]), fmaxf(x[1][2], x[1][3]));
#pragma unroll
            for (int o = 1; o < 4; o <<= 1) {
                mx0 = fmaxf(mx0, __shfl_xor_sync(0xffffffffu, mx0, o));
                mx1 = fmaxf(mx1, __shfl_xor_sync(0xffffffffu, mx1, o));
            }
            const float mn0 = fmaxf(m0, mx0), mn1 = fmaxf(m1, mx1);
            const float mu0 = mn0 == neg_inf ? 0.f : mn0, mu1 = mn1 == neg_inf ? 0.f : mn1;
            const float al0 = kva_exp2(m0 - mu0), al1 = kva_exp2(m1 - mu1);
            m0 = mn0;
            m1 = mn1;
#pragma unroll
            for (int nt = 0; nt < 2; ++nt) {
                x[nt][0] = kva_exp2(x[nt][0] - mu0);
                x[nt][1] = kva_exp2(x[nt][1] - mu0);
                x[nt][2] = kva_exp2(x[nt][2] - mu1);
                x[nt][3] = kva_exp2(x[nt][3] - mu1);
            }
            l0 = l0 * al0 + ((x[0][0] + x[0][1]) + (x[1][0] + x[1][1]));
            l1 = l1 * al1 + ((x[0][2] + x[0][3]) + (x[1][2] + x[1][3]));
            if (__any_sync(0xffffffffu, al0 != 1.0f || al1 != 1.0f)) {
#pragma unroll
                for (int n = 0; n < HG_D / 8; ++n) {
                    acc[n][0] *= al0;
                    acc[n][1] *= al0;
                    acc[n][2] *= al1;
                    acc[n][3] *= al1;
                }
            }
            /* P as the A fragment: rows r8 / r8 + 8, tokens 2 q4 (+1) and 2 q4 + 8 (+9) */
            unsigned pa[4];
            pa[0] = HG_PACK(x[0][0], x[0][1]);
            pa[1] = HG_PACK(x[0][2], x[0][3]);
            pa[2] = HG_PACK(x[1][0], x[1][1]);
            pa[3] = HG_PACK(x[1][2], x[1][3]);
            /* tokens outside the item: their V rows may hold anything (NaN, Inf); P is 0 there and 0 * NaN is NaN, so
               the B elements are zeroed: tokens 2 q4, 2 q4 + 1 (mlo) and 2 q4 + 8, + 9 (mhi) */
            unsigned mlo = 0xffffffffu, mhi = 0xffffffffu;
            if (edge) {
                mlo = (tb >= kv0 && tb < kv1 ? 0xffffu : 0u) | (tb + 1 >= kv0 && tb + 1 < kv1 ? 0xffff0000u : 0u);
                mhi = (tb + 8 >= kv0 && tb + 8 < kv1 ? 0xffffu : 0u) | (tb + 9 >= kv0 && tb + 9 < kv1 ? 0xffff0000u : 0u);
            }
#if !HG_FP8
#pragma unroll
            for (int mt = 0; mt < HG_MT; ++mt) {
                /* words: tokens 0-7 / dims 16 mt .., tokens 0-7 / + 8, tokens 8-15 / 16 mt .., tokens 8-15 / + 8 */
                const int ch = 2 * mt + vc;
                unsigned b[4];
                kva_ldsm_x4_t(vbase + (unsigned)((ch >> 3) * HG_BOX) + vrow + 16u * (unsigned)((ch & 7) ^ (vt & 7)), b);
                b[0] &= mlo;
                b[1] &= mlo;
                b[2] &= mhi;
                b[3] &= mhi;
                HG_MMA(acc[2 * mt], pa, b[0], b[2]);
                HG_MMA(acc[2 * mt + 1], pa, b[1], b[3]);
            }
#else
#pragma unroll
            for (int m2 = 0; m2 < HG_MT / 2; ++m2) {
                /* byte pairs (kva_fp8_v_afrag): chunk 2 m2 + hh gives n-tiles of the even dims (words 0, 2) and of the
                   odd dims (words 1, 3) of dims 32 m2 + 16 hh .. */
                unsigned r[4];
                kva_ldsm_x4_t(vbase + v8row + 16u * (unsigned)((2 * m2 + v8c) ^ (v8t & 7)), r);
                r[0] &= mlo;
                r[1] &= mhi;
                r[2] &= mlo;
                r[3] &= mhi;
#pragma unroll
                for (int hh = 0; hh < 2; ++hh) {
                    unsigned b[4];
                    kva_fp8_v_afrag(r[2 * hh], r[2 * hh + 1], HG_F8, b);
                    HG_MMA(acc[2 * (2 * m2 + hh)], pa, b[0], b[2]);
                    HG_MMA(acc[2 * (2 * m2 + hh) + 1], pa, b[1], b[3]);
                }
            }
#endif
            __syncwarp();
            if (lane == 0) kvp_mbar_arrive(empty0 + 8u * st);
#if KVA_HG_TRACE
            if (p.trace && h == 0 && lane == 0 && c < KVK_HGT_N) *HG_TRC(13 + 6 * c) = kva_hg_clock();
#endif
        }
#pragma unroll
        for (int o = 1; o < 4; o <<= 1) {
            l0 += __shfl_xor_sync(0xffffffffu, l0, o);
            l1 += __shfl_xor_sync(0xffffffffu, l1, o);
        }
        /* ---- the slot's HG_P warps combine in a tree (named barrier 1 + h): in the round of width `half`, parts
           half .. 2 half - 1 publish their record and parts 0 .. half - 1 merge one each (log2 HG_P records deep
           where one warp merging HG_P - 1 of them cost small calls 7-11 %: docs/kernels/decode.md, session 40) ---- */
#pragma unroll 1
        for (int half = HG_P / 2; half >= 1; half >>= 1) {
            float* const cr = s_comb + (((part >= half ? part - half : part) * HG_SL + h) * 32 + lane) * HG_CW;
            if (part >= half && part < 2 * half) {
                cr[0] = m0, cr[1] = m1, cr[2] = l0, cr[3] = l1, cr[4] = (float)faulted;
#pragma unroll
                for (int n = 0; n < HG_D / 8; ++n) {
                    cr[5 + 4 * n] = acc[n][0];
                    cr[6 + 4 * n] = acc[n][1];
                    cr[7 + 4 * n] = acc[n][2];
                    cr[8 + 4 * n] = acc[n][3];
                }
            }
            kvp_named_sync(1u + (unsigned)h, 32u * HG_P);
            if (part < half) {
                const float mo0 = cr[0], mo1 = cr[1];
                const float n0 = fmaxf(m0, mo0), n1 = fmaxf(m1, mo1);
                const float b0 = n0 == neg_inf ? 0.f : n0, b1 = n1 == neg_inf ? 0.f : n1;
                const float sa0 = kva_exp2(m0 - b0), sb0 = kva_exp2(mo0 - b0);
                const float sa1 = kva_exp2(m1 - b1), sb1 = kva_exp2(mo1 - b1);
                l0 = l0 * sa0 + cr[2] * sb0;
                l1 = l1 * sa1 + cr[3] * sb1;
                m0 = n0;
                m1 = n1;
                faulted |= cr[4] != 0.f;
#pragma unroll
                for (int n = 0; n < HG_D / 8; ++n) {
                    acc[n][0] = acc[n][0] * sa0 + cr[5 + 4 * n] * sb0;
                    acc[n][1] = acc[n][1] * sa0 + cr[6 + 4 * n] * sb0;
                    acc[n][2] = acc[n][2] * sa1 + cr[7 + 4 * n] * sb1;
                    acc[n][3] = acc[n][3] * sa1 + cr[8 + 4 * n] * sb1;
                }
            }
            kvp_named_sync(1u + (unsigned)h, 32u * HG_P);
        }
        const bool to_partial = w.partial >= 0;
        if (part == 0) {
            /* ---- write rows r8 and r8 + 8 of the slot's tile (dims HG_RDIM) ---- */
            const float lg0 = l0 > 0.f ? m0 + kva_log2(l0) : neg_inf, lg1 = l1 > 0.f ? m1 + kva_log2(l1) : neg_inf;
            const float vs = p.v_scale * HG_KFIX;
            float i0 = l0 > 0.f ? vs * kva_rcp(l0) : 0.f, i1 = l1 > 0.f ? vs * kva_rcp(l1) : 0.f;
            float e0 = lg0, e1 = lg1;
            if (faulted) {
                i0 = i1 = 0.f;
                e0 = e1 = to_partial ? __uint_as_float(KVK_FAULT_LSE_BITS) : neg_inf;
            }
            const int ra = r8, rb = r8 + 8;
            if (to_partial) {
                float* const po = (float*)(p.ws + p.off_partial_o) + ((long long)w.partial * p.tile_q + hb0) * HG_D;
                float* const pl = (float*)(p.ws + p.off_partial_lse) + (long long)w.partial * p.tile_q + hb0;
#pragma unroll
                for (int n = 0; n < HG_D / 8; ++n) {
#if HG_FP8
                    if (ra < gl) po[ra * HG_D + HG_RDIM(n, 0)] = acc[n][0] * i0, po[ra * HG_D + HG_RDIM(n, 1)] = acc[n][1] * i0;
                    if (rb < gl) po[rb * HG_D + HG_RDIM(n, 0)] = acc[n][2] * i1, po[rb * HG_D + HG_RDIM(n, 1)] = acc[n][3] * i1;
#else /* adjacent dims */
                    if (ra < gl) *(float2*)(po + ra * HG_D + HG_RDIM(n, 0)) = make_float2(acc[n][0] * i0, acc[n][1] * i0);
                    if (rb < gl) *(float2*)(po + rb * HG_D + HG_RDIM(n, 0)) = make_float2(acc[n][2] * i1, acc[n][3] * i1);
#endif
                }
                if (q4 == 0) {
                    if (ra < gl) pl[ra] = e0;
                    if (rb < gl) pl[rb] = e1;
                }
            } else {
                const long long oa =
                    (long long)rq.qo_start * p.o_stride_row + (long long)(kvh * g + hb0 + ra) * p.o_stride_head;
                const long long ob = oa + 8ll * p.o_stride_head;
#pragma unroll
                for (int n = 0; n < HG_D / 8; ++n) {
                    if (ra < gl) kva_store_elem(p.o, oa + HG_RDIM(n, 0), KVA_OT, acc[n][0] * i0), kva_store_elem(p.o, oa + HG_RDIM(n, 1), KVA_OT, acc[n][1] * i0);
                    if (rb < gl) kva_store_elem(p.o, ob + HG_RDIM(n, 0), KVA_OT, acc[n][2] * i1), kva_store_elem(p.o, ob + HG_RDIM(n, 1), KVA_OT, acc[n][3] * i1);
                }
                if (q4 == 0 && p.lse) {
                    const long long la =
                        (long long)rq.qo_start * p.lse_stride_row + (long long)(kvh * g + hb0) * p.lse_stride_head;
                    if (ra < gl) p.lse[la + (long long)ra * p.lse_stride_head] = e0;
                    if (rb < gl) p.lse[la + (long long)rb * p.lse_stride_head] = e1;
                }
            }
            if (faulted && h == 0 && lane == 0) atomicAdd(&((kvk_status*)p.ws)->count, 1u);
        }
#else /* !KVA_HG_RS */
        /* Q^T fragments (B = Q^T[16 cols x 8 rows]): row r8 (query head kvh * g + r8), columns 16 ks + 2 q4 (+1), +8;
           fp8 KV: dims 32 q4 + 4 ks (+1), + 2 (+3) in f16, scaled down by 2^qsh (the logit scale takes it back) */
        unsigned qb[HG_KS][2];
        float qscale = p.q_scale;
        {
            const bool has = r8 < gl;
            const unsigned short* qr = (const unsigned short*)p.q + (long long)rq.qo_start * p.q_stride_row +
                                       (long long)(kvh * g + (has ? hb0 + r8 : 0)) * p.q_stride_head;
#if !HG_FP8
#pragma unroll
            for (int ks = 0; ks < HG_KS; ++ks) {
                qb[ks][0] = has ? __ldg((const unsigned*)(qr + 16 * ks + 2 * q4)) : 0u;
                qb[ks][1] = has ? __ldg((const unsigned*)(qr + 16 * ks + 8 + 2 * q4)) : 0u;
            }
#else
            float qf[HG_D / 4];
#pragma unroll
            for (int h8 = 0; h8 < HG_D / 32; ++h8) {
                const uint4 w4 =
                    has ? __ldg((const uint4*)(qr + q4 * (HG_D / 4) + 8 * h8)) : make_uint4(0u, 0u, 0u, 0u);
                const unsigned wv[4] = {w4.x, w4.y, w4.z, w4.w};
#pragma unroll
                for (int e = 0; e < 4; ++e) {
#if KVA_QT == KVK_BF16
                    kva_bf16x2_to_f32(wv[e], &qf[8 * h8 + 2 * e], &qf[8 * h8 + 2 * e + 1]);
#else
                    kva_f16x2_to_f32(wv[e], &qf[8 * h8 + 2 * e], &qf[8 * h8 + 2 * e + 1]);
#endif
                }
            }
            /* one power of two for the warp's rows keeps the largest |q| below 2^14 in f16 */
            float mx = 0.f;
#pragma unroll
            for (int i = 0; i < HG_D / 4; ++i) mx = fmaxf(mx, fabsf(qf[i]));
#pragma unroll
            for (int o = 1; o < 32; o <<= 1) mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, o));
            const int ex = (int)((__float_as_uint(mx) >> 23) & 0xffu) - 127;
            const int sh = ex > 13 ? ex - 13 : 0;
            const float down = __uint_as_float((unsigned)(127 - sh) << 23);
            qscale *= __uint_as_float((unsigned)(127 + (sh > 127 ? 127 : sh)) << 23) * HG_KFIX;
#pragma unroll
            for (int ks = 0; ks < HG_KS; ++ks) {
                qb[ks][0] = kva_f32x2_to_f16x2(qf[4 * ks] * down, qf[4 * ks + 1] * down);
                qb[ks][1] = kva_f32x2_to_f16x2(qf[4 * ks + 2] * down, qf[4 * ks + 3] * down);
            }
#endif
        }
        float m0 = neg_inf, m1 = neg_inf, l0 = 0.f, l1 = 0.f;
        float acc[HG_MT][4];
#pragma unroll
        for (int mt = 0; mt < HG_MT; ++mt) acc[mt][0] = acc[mt][1] = acc[mt][2] = acc[mt][3] = 0.f;
        int faulted = 0;
        for (int j = 0; j < nsub; ++j, ++c) {
            if ((j & (HG_P - 1)) != part) continue;
            const int st = c % HG_S;
            kvp_mbar_wait(full0 + 8u * st, (unsigned)((c / HG_S) & 1));
#if KVA_HG_TRACE
            if (p.trace && h == 0 && lane == 0 && c < KVK_HGT_N) *HG_TRC(12 + 6 * c) = kva_hg_clock();
#endif
            if (atomicAdd(s_fault + st, 0)) {
                faulted = 1;
                __syncwarp();
                if (lane == 0) kvp_mbar_arrive(empty0 + 8u * st);
                continue;
            }
            const unsigned kbase = sbase + (unsigned)(st * HG_SB), vbase = kbase + (unsigned)(HG_NCB * HG_BOX);
            float sa[2][4] = {{0.f, 0.f, 0.f, 0.f}, {0.f, 0.f, 0.f, 0.f}}; /* two independent MMA chains */
#if !HG_FP8
#pragma unroll
            for (int ks = 0; ks < HG_KS; ++ks) {
                const int ch = 2 * ks + kc;
                unsigned a[4];
                kva_ldsm_x4(kbase + (unsigned)((ch >> 3) * HG_BOX) + krow + 16u * (unsigned)((ch & 7) ^ (kt & 7)), a);
                HG_MMA(sa[ks & 1], a, qb[ks][0], qb[ks][1]);
            }
#else
#pragma unroll
            for (int hh = 0; hh < 2; ++hh) {
                /* chunk 2 q4 + hh (dims 32 q4 + 16 hh ..) of tokens r8 and r8 + 8: k-steps 4 hh .. 4 hh + 3 */
                const unsigned co = 16u * (unsigned)((2 * q4 + hh) ^ (r8 & 7));
                const uint4 wlo = kva_ld_shared16(kbase + k8row + co);
                const uint4 whi = kva_ld_shared16(kbase + k8row + 8u * 128u + co);
                const unsigned lo[4] = {wlo.x, wlo.y, wlo.z, wlo.w};
                const unsigned hi[4] = {whi.x, whi.y, whi.z, whi.w};
#pragma unroll
                for (int e = 0; e < 4; ++e) {
                    const int ks = 4 * hh + e;
                    unsigned a[4];
                    kva_fp8_k_afrag(lo[e], hi[e], HG_F8, a);
                    HG_MMA(sa[ks & 1], a, qb[ks][0], qb[ks][1]);
                }
            }
#endif
            /* s[0]: token r8, row 2 q4; s[1]: token r8, row 2 q4 + 1; s[2], s[3]: token r8 + 8 */
            const int tok = t0 + 16 * j + r8;
            const bool edge = t0 + 16 * j < kv0 || t0 + 16 * j + 16 > kv1;
            const bool v0 = tok >= kv0 && tok < kv1, v1 = tok + 8 >= kv0 && tok + 8 < kv1;
            float s[4];
            s[0] = v0 ? (sa[0][0] + sa[1][0]) * qscale : neg_inf;
            s[1] = v0 ? (sa[0][1] + sa[1][1]) * qscale : neg_inf;
            s[2] = v1 ? (sa[0][2] + sa[1][2]) * qscale : neg_inf;
            s[3] = v1 ? (sa[0][3] + sa[1][3]) * qscale : neg_inf;
            float pv[4], al0, al1;
            kva_st_softmax_step(s, m0, m1, l0, l1, pv, al0, al1);
            if (__any_sync(0xffffffffu, al0 != 1.0f || al1 != 1.0f)) {
#pragma unroll
                for (int mt = 0; mt < HG_MT; ++mt) {
                    acc[mt][0] *= al0;
                    acc[mt][1] *= al1;
                    acc[mt][2] *= al0;
                    acc[mt][3] *= al1;
                }
            }
            /* P^T as the B fragment: lane (r8, q4) needs P[row r8][tokens 2 q4, 2 q4 + 1, + 8, + 9] */
            const unsigned X = HG_PACK(pv[0], pv[2]), Y = HG_PACK(pv[1], pv[3]);
            const int sa_ = 8 * q4 + (r8 >> 1), sb_ = sa_ + 4;
            const unsigned xa = __shfl_sync(0xffffffffu, X, sa_), ya = __shfl_sync(0xffffffffu, Y, sa_);
            const unsigned xb = __shfl_sync(0xffffffffu, X, sb_), yb = __shfl_sync(0xffffffffu, Y, sb_);
            const unsigned ra = (r8 & 1) ? ya : xa, rb = (r8 & 1) ? yb : xb;
            const unsigned pb0 = kva_prmt(ra, rb, 0x5410u), pb1 = kva_prmt(ra, rb, 0x7632u);
            /* tokens outside the item (partial first / last subtile): their V rows may hold anything (a pool slot never
               written, NaN or Inf); P is 0 there, and 0 * NaN is NaN, so the A fragment's elements are zeroed. This
               lane's A elements are tokens 2 q4, 2 q4 + 1 (a[0], a[1]) and 2 q4 + 8, + 9 (a[2], a[3]). */
            unsigned mlo = 0xffffffffu, mhi = 0xffffffffu;
            if (edge) {
                const int tb = t0 + 16 * j + 2 * q4;
                mlo = (tb >= kv0 && tb < kv1 ? 0xffffu : 0u) | (tb + 1 >= kv0 && tb + 1 < kv1 ? 0xffff0000u : 0u);
                mhi = (tb + 8 >= kv0 && tb + 8 < kv1 ? 0xffffu : 0u) | (tb + 9 >= kv0 && tb + 9 < kv1 ? 0xffff0000u : 0u);
            }
#if !HG_FP8
#pragma unroll
            for (int mt = 0; mt < HG_MT; ++mt) {
                const int ch = 2 * mt + vc;
                unsigned a[4];
                kva_ldsm_x4_t(vbase + (unsigned)((ch >> 3) * HG_BOX) + vrow + 16u * (unsigned)((ch & 7) ^ (vt & 7)), a);
                a[0] &= mlo;
                a[1] &= mlo;
                a[2] &= mhi;
                a[3] &= mhi;
                HG_MMA(acc[mt], a, pb0, pb1);
            }
#else
#pragma unroll
            for (int m2 = 0; m2 < HG_MT / 2; ++m2) {
                /* ldmatrix.trans on byte pairs: matrix b = lane >> 3 is tokens 8 (b & 1) .., chunk 2 m2 + (b >> 1);
                   r[0] / r[1]: dims 32 m2 + 2 r8 (+1) of tokens 2 q4, 2 q4 + 1 / + 8, + 9; r[2], r[3]: dims + 16 */
                unsigned r[4];
                kva_ldsm_x4_t(vbase + v8row + 16u * (unsigned)((2 * m2 + v8c) ^ (v8t & 7)), r);
                r[0] &= mlo;
                r[1] &= mhi;
                r[2] &= mlo;
                r[3] &= mhi;
#pragma unroll
                for (int hh = 0; hh < 2; ++hh) {
                    unsigned a[4];
                    kva_fp8_v_afrag(r[2 * hh], r[2 * hh + 1], HG_F8, a);
                    HG_MMA(acc[2 * m2 + hh], a, pb0, pb1);
                }
            }
#endif
            __syncwarp();
            if (lane == 0) kvp_mbar_arrive(empty0 + 8u * st);
#if KVA_HG_TRACE
            if (p.trace && h == 0 && lane == 0 && c < KVK_HGT_N) *HG_TRC(13 + 6 * c) = kva_hg_clock();
#endif
        }
#pragma unroll
        for (int o = 4; o < 32; o <<= 1) {
            l0 += __shfl_xor_sync(0xffffffffu, l0, o);
            l1 += __shfl_xor_sync(0xffffffffu, l1, o);
        }
        /* ---- the head's HG_P warps: parts >= 1 publish, part 0 combines (named barrier 1 + h) ---- */
        if (part >= 1) {
            comb[0] = m0, comb[1] = m1, comb[2] = l0, comb[3] = l1, comb[4] = (float)faulted;
#pragma unroll
            for (int mt = 0; mt < HG_MT; ++mt) {
                comb[5 + 4 * mt] = acc[mt][0];
                comb[6 + 4 * mt] = acc[mt][1];
                comb[7 + 4 * mt] = acc[mt][2];
                comb[8 + 4 * mt] = acc[mt][3];
            }
        }
        kvp_named_sync(1u + (unsigned)h, 32u * HG_P);
#pragma unroll 1
        for (int pp = 1; pp < HG_P && part == 0; ++pp) {
            const float* const cr = s_comb + (((pp - 1) * HG_SL + h) * 32 + lane) * HG_CW;
            const float mo0 = cr[0], mo1 = cr[1];
            const float n0 = fmaxf(m0, mo0), n1 = fmaxf(m1, mo1);
            const float b0 = n0 == neg_inf ? 0.f : n0, b1 = n1 == neg_inf ? 0.f : n1;
            const float sa0 = kva_exp2(m0 - b0), sb0 = kva_exp2(mo0 - b0);
            const float sa1 = kva_exp2(m1 - b1), sb1 = kva_exp2(mo1 - b1);
            l0 = l0 * sa0 + cr[2] * sb0;
            l1 = l1 * sa1 + cr[3] * sb1;
            m0 = n0;
            m1 = n1;
            faulted |= cr[4] != 0.f;
#pragma unroll
            for (int mt = 0; mt < HG_MT; ++mt) {
                acc[mt][0] = acc[mt][0] * sa0 + cr[5 + 4 * mt] * sb0;
                acc[mt][1] = acc[mt][1] * sa1 + cr[6 + 4 * mt] * sb1;
                acc[mt][2] = acc[mt][2] * sa0 + cr[7 + 4 * mt] * sb0;
                acc[mt][3] = acc[mt][3] * sa1 + cr[8 + 4 * mt] * sb1;
            }
        }
        kvp_named_sync(1u + (unsigned)h, 32u * HG_P);
        const bool to_partial = w.partial >= 0;
        if (part == 0) {
            /* ---- write rows 2 q4 and 2 q4 + 1 of this head (columns 16 mt + r8, + 8) ---- */
            const float lg0 = l0 > 0.f ? m0 + kva_log2(l0) : neg_inf, lg1 = l1 > 0.f ? m1 + kva_log2(l1) : neg_inf;
            const float vs = p.v_scale * HG_KFIX;
            float i0 = l0 > 0.f ? vs * kva_rcp(l0) : 0.f, i1 = l1 > 0.f ? vs * kva_rcp(l1) : 0.f;
            float e0 = lg0, e1 = lg1;
            if (faulted) {
                i0 = i1 = 0.f;
                e0 = e1 = to_partial ? __uint_as_float(KVK_FAULT_LSE_BITS) : neg_inf;
            }
            const int ra = 2 * q4, rb = 2 * q4 + 1;
            if (to_partial) {
                const int pr0 = h * g; /* the warp's first row in the item's tile */
                float* const po = (float*)(p.ws + p.off_partial_o) + ((long long)w.partial * p.tile_q + pr0) * HG_D;
                float* const pl = (float*)(p.ws + p.off_partial_lse) + (long long)w.partial * p.tile_q + pr0;
#pragma unroll
                for (int mt = 0; mt < HG_MT; ++mt) {
                    const int d0 = HG_DLO(mt);
                    if (ra < gl) po[ra * HG_D + d0] = acc[mt][0] * i0, po[ra * HG_D + d0 + HG_DHI] = acc[mt][2] * i0;
                    if (rb < gl) po[rb * HG_D + d0] = acc[mt][1] * i1, po[rb * HG_D + d0 + HG_DHI] = acc[mt][3] * i1;
                }
                if (r8 == 0) {
                    if (ra < gl) pl[ra] = e0;
                    if (rb < gl) pl[rb] = e1;
                }
            } else {
                const long long oa =
                    (long long)rq.qo_start * p.o_stride_row + (long long)(kvh * g + hb0 + ra) * p.o_stride_head;
                const long long ob = oa + p.o_stride_head;
#pragma unroll
                for (int mt = 0; mt < HG_MT; ++mt) {
                    const int d0 = HG_DLO(mt);
                    if (ra < gl) kva_store_elem(p.o, oa + d0, KVA_OT, acc[mt][0] * i0), kva_store_elem(p.o, oa + d0 + HG_DHI, KVA_OT, acc[mt][2] * i0);
                    if (rb < gl) kva_store_elem(p.o, ob + d0, KVA_OT, acc[mt][1] * i1), kva_store_elem(p.o, ob + d0 + HG_DHI, KVA_OT, acc[mt][3] * i1);
                }
                if (r8 == 0 && p.lse) {
                    const long long la =
                        (long long)rq.qo_start * p.lse_stride_row + (long long)(kvh * g + hb0) * p.lse_stride_head;
                    if (ra < gl) p.lse[la + (long long)ra * p.lse_stride_head] = e0;
                    if (rb < gl) p.lse[la + (long long)rb * p.lse_stride_head] = e1;
                }
            }
            if (faulted && h == 0 && lane == 0) atomicAdd(&((kvk_status*)p.ws)->count, 1u);
        }
#endif /* KVA_HG_RS */
        /* ---- fused split-KV merge (kva_decode_tc.cuh's protocol): the consumer warps' partial writes are ordered
           before thread 0's acq_rel arrival by the named barrier; the last arriving CTA merges the task ---- */
        if (to_partial && fused) {
            kvp_named_sync(1u + HG_G, 32u * HG_NC);
            kvk_merge_task* const mtask = (kvk_merge_task*)(p.ws + p.off_merge) + w.pad_;
            if (tid == 0) kva_merge_arrive(mtask, s_flag);
            kvp_named_sync(1u + HG_G, 32u * HG_NC);
            if (s_flag[0]) {
                kvk_merge_task tk;
                tk.req = w.req;
                tk.kv_head = w.kv_head;
                tk.row_start = w.row_start;
                tk.rows = w.rows;
                tk.partial_first = s_flag[1];
                tk.num_partials = s_flag[2];
                kva_merge_task_rows(&tk, rq.qo_start, (const float*)(p.ws + p.off_partial_o),
                                    (const float*)(p.ws + p.off_partial_lse), p.tile_q, HG_D, KVA_HG_RS ? g : g * HG_G, 0, p.o,
                                    KVA_OT, p.o_stride_row, p.o_stride_head, p.lse, p.lse_stride_row,
                                    p.lse_stride_head, warp, HG_NC, lane, KVA_HG_RS ? 16 : 8);
                /* row slots: batches of 16 partials (a split unit's g <= 32 rows of up to 512 / g partials
                   are merged by this one CTA, larger tasks by the merge kernel: kva__cuda_merge_rows_pick; half
                   the L2 round trips of 8) */
            }
            kvp_named_sync(1u + HG_G, 32u * HG_NC); /* s_flag is reused by the next item */
        }
    }
#if KVA_HG_TRACE
    if (tid == 0 && p.trace) {
        *HG_TRC(2) = kva_hg_clock();
        *HG_TRC(3) = kva_hg_gtimer();
        *HG_TRC(5) = (unsigned long long)c;
    }
#endif
#else
    (void)p, (void)tm; /* sm_90 only: the host never selects it elsewhere */
#endif
}
