/*
 * kva_prefill.cuh - the tensor-core attention kernel family: a persistent CTA of 128 threads executes its
 * worker's list of plan work items (src/core/internal.h) - up to TQ packed query rows of one (request, KV head)
 * against a KV range - for batch prefill on paged or ragged KV, append, multi-token decode and decode with large
 * GQA groups. FA2-style: mma.sync m16n8k16 (f16/bf16 in, f32 accumulate), ldmatrix, a multi-stage cp.async
 * pipeline over XOR-swizzled shared memory, online softmax in the log2 domain.
 *
 * One instance per inclusion, specialised by macros (the includer's #defines or NVRTC -D options):
 *   KVA_KERNEL_NAME  extern "C" symbol name
 *   KVA_DQK, KVA_DVO head dims (64, 128, 256; equal)
 *   KVA_QT, KVA_KT, KVA_OT  dtypes of q, KV, o (q: KVK_F16 / KVK_BF16; KV also KVK_E4M3 / KVK_E5M2; o also KVK_F32)
 *   KVA_TQ           packed rows per CTA tile (16, 64, 128; 128 not at head dim 256)
 *   KVA_ROPE         fused rotate-half RoPE on q (once, at load) and on every K tile (0 / 1)
 *   KVA_MAINLOOP     0 (default): mma.sync mainloop (sm_80+), 128 threads. 1: the Hopper mainloop (sm_90a warpgroup
 *                    MMA, 256 threads, TQ 128, q = KV 16-bit, no RoPE; kvp_mainloop_wg) with the same contract.
 *   KVA_ALIBI_FOLD   Hopper mainloop only (0 / 1): ALiBi's per-key bias goes into the S accumulators (the host takes
 *                    these instances for ALiBi without soft cap); any flags still give correct results.
 * Everything else (page size and layout via strides, ragged, causal, window, custom mask, soft cap, ALiBi,
 * sigmoid, lse, split-KV partials) is a runtime argument of kvk_attn_params, as for kva_decode.cuh.
 * Geometry (tiles, stages, shared memory) is in kva_prefill_geom.h.
 *
 * Per work item:
 *   rows:     per tile row r: packed row p = row_start + r -> query row i = p / g, head kv_head * g + p % g,
 *             q_pos = kv_len - qo_len + i; kept in shared memory (the masked path and the epilogue read them).
 *   prologue: the K/V row byte offsets of the first STAGES tiles (page table lookups, one bounds check each:
 *             a bad page zero-fills the row and marks the thread), Q tile -> shared memory (cp.async, or through
 *             registers when RoPE or a dtype conversion applies), the first STAGES - 1 KV tiles in flight.
 *   mainloop: per KV tile t: wait for tile t, one barrier, issue tile t + STAGES - 1, look up the offsets of
 *             tile t + STAGES (latency hidden behind this tile's math), [fp8: convert K/V to 16-bit in shared
 *             memory; RoPE: rotate K; one more barrier], then per warp: S = Q K^T (ldmatrix + mma), mask and
 *             transform only on tiles that need it (causal diagonal, window edge, range end, custom mask, ALiBi,
 *             soft cap), online softmax (or sigmoid), O += P V with P re-packed from the S accumulators.
 *             A warp skips a tile that no row of it can see (causal / window), and warps without valid rows idle.
 *   epilogue: unnormalised O, max and sum of each warp slice -> shared memory; merged per row (TQ 16 splits a
 *             tile's keys over 4 warps), normalised, v_scale applied, written to o (+ lse, base 2) or to the
 *             item's partial slot; a faulted item writes o = 0 and lse = -inf (partials: KVK_FAULT_LSE_BITS).
 */
#include "kva_common.cuh"
#include "kva_prefill_geom.h"
#include "kva_wgmma.cuh"

/* ============================================================================================== */
/* Helpers shared by every instance (defined once per translation unit)                            */
/* ============================================================================================== */
#ifndef KVA_PREFILL_HELPERS
#define KVA_PREFILL_HELPERS

#define KVP_CAT2(a, b) a##__##b
#define KVP_CAT(a, b) KVP_CAT2(a, b)
#define KVP_FULL 0xffffffffu

/* ldmatrix: four 8x8 b16 matrices; lane l gives the row address of matrix l / 8 */
KVA_DEV void kvp_ldsm4(unsigned addr, unsigned* r) {
    asm volatile("{ ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4]; }"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(addr));
}
KVA_DEV void kvp_ldsm4_t(unsigned addr, unsigned* r) {
    asm volatile("{ ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4]; }"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(addr));
}
/* 4-byte async copy global -> shared (L1-cached); src_bytes = 0 writes zeros and reads nothing */
KVA_DEV void kvp_cp_async4(unsigned dst, const void* src, unsigned src_bytes) {
    asm volatile("{ cp.async.ca.shared.global [%0], [%1], 4, %2; }" ::"r"(dst), "l"(src), "r"(src_bytes) : "memory");
}
KVA_DEV unsigned kvp_laneid() {
    unsigned v;
    asm volatile("{ mov.u32 %0, %%laneid; }" : "=r"(v));
    return v;
}
/* 4-byte shared memory word through its 32-bit address (volatile: written by another warpgroup) */
KVA_DEV int kvp_ld_shared_vol(unsigned addr) {
    int v;
    asm volatile("{ ld.volatile.shared.u32 %0, [%1]; }" : "=r"(v) : "r"(addr) : "memory");
    return v;
}
KVA_DEV void kvp_st_shared_vol(unsigned addr, int v) {
    asm volatile("{ st.volatile.shared.u32 [%0], %1; }" ::"r"(addr), "r"(v) : "memory");
}
KVA_DEV void kvp_st_shared16(unsigned addr, uint4 v) {
    asm volatile("{ st.shared.v4.u32 [%0], {%1, %2, %3, %4}; }" ::"r"(addr), "r"(v.x), "r"(v.y), "r"(v.z), "r"(v.w)
                 : "memory");
}

/* c += a * b, m16n8k16, f32 accumulators; ct = KVK_BF16 or KVK_F16 (a literal after inlining) */
KVA_DEV void kvp_mma(float* c, const unsigned* a, unsigned b0, unsigned b1, int ct) {
    if (ct == KVK_BF16) {
        asm("{ mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
            "{%0, %1, %2, %3}; }"
            : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
            : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
    } else {
        asm("{ mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
            "{%0, %1, %2, %3}; }"
            : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
            : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
    }
}

/* 16-bit pairs <-> floats (t = KVK_F16 / KVK_BF16, a literal) */
KVA_DEV void kvp_unpack2(unsigned u, int t, float* a, float* b) {
    if (t == KVK_BF16) kva_bf16x2_to_f32(u, a, b);
    else kva_f16x2_to_f32(u, a, b);
}
KVA_DEV unsigned kvp_pack2(float a, float b, int t) {
    return t == KVK_BF16 ? kva_f32x2_to_bf16x2(a, b) : kva_f32x2_to_f16x2(a, b);
}
/* 8 16-bit values (one 16-byte chunk) <-> floats */
KVA_DEV void kvp_unpack8(uint4 w, int t, float* f) {
    kvp_unpack2(w.x, t, &f[0], &f[1]);
    kvp_unpack2(w.y, t, &f[2], &f[3]);
    kvp_unpack2(w.z, t, &f[4], &f[5]);
    kvp_unpack2(w.w, t, &f[6], &f[7]);
}
KVA_DEV uint4 kvp_pack8(const float* f, int t) {
    uint4 w;
    w.x = kvp_pack2(f[0], f[1], t);
    w.y = kvp_pack2(f[2], f[3], t);
    w.z = kvp_pack2(f[4], f[5], t);
    w.w = kvp_pack2(f[6], f[7], t);
    return w;
}
/* two fp8 values (u16, element 0 low) -> a 16-bit pair of type ct (exact: fp8 values are representable;
   e4m3 before sm_89 yields value / 256, see KVA_E4M3_FIX) */
KVA_DEV unsigned kvp_fp8x2_to_ct(unsigned short v, int kt, int ct) {
    unsigned h = kt == KVK_E4M3 ? kva_e4m3x2_to_f16x2(v) : kva_e5m2x2_to_f16x2(v);
    if (ct == KVK_F16) return h;
    float a, b;
    kva_f16x2_to_f32(h, &a, &b);
    return kva_f32x2_to_bf16x2(a, b);
}
/* 8 fp8 values (u32 x 2) -> floats */
KVA_DEV void kvp_fp8x8_to_f32(uint2 w, int kt, float* f) {
    unsigned short h[4] = {(unsigned short)(w.x & 0xffffu), (unsigned short)(w.x >> 16), (unsigned short)(w.y & 0xffffu),
                           (unsigned short)(w.y >> 16)};
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        unsigned u = kt == KVK_E4M3 ? kva_e4m3x2_to_f16x2(h[i]) : kva_e5m2x2_to_f16x2(h[i]);
        kva_f16x2_to_f32(u, &f[2 * i], &f[2 * i + 1]);
    }
}

/* sin and cos of pos * w where the frequency w = fhi + flo is a float pair: the product is formed exactly
   enough (hi + lo) and reduced by 2 pi in two steps, so positions up to ~2^24 keep ~1e-6 rad accuracy */
KVA_DEV void kvp_rope_sincos(float pos, float fhi, float flo, float* s, float* c) {
    float hi = pos * fhi;
    float lo = fmaf(pos, fhi, -hi) + pos * flo;
    float n = rintf(hi * 0.15915494309189535f);
    float r = fmaf(-n, 6.28318548202514648f, hi); /* 6.283185482 = float(2 pi) */
    r = fmaf(n, 1.7484556e-7f, r) + lo;           /* float(2 pi) - 2 pi */
    __sincosf(r, s, c);
}

/* base + off, computed where it stands: an asm the compiler cannot hoist out of the item loop, so that the
   pointer is not held in registers across the mainloop (where every register goes to the accumulators) */
KVA_DEV const char* kvp_at(const char* base, long long off) {
    const char* r;
    asm volatile("{ add.s64 %0, %1, %2; }" : "=l"(r) : "l"(base), "l"(off));
    return r;
}

/* A finished row's output scale and lse (base 2) from its running max m (finite whenever dsum > 0) and sum: softmax
   divides by the sum, sigmoid does not; a faulted item gets scale 0 and lse -inf (a partial slot: the fault bits the
   merge kernel turns into o = 0, lse = -inf). */
KVA_DEV void kvp_row_norm(float m, float dsum, float vs, bool sigmoid, int faulted, bool to_partial, float* scale,
                          float* lse) {
    float sc = vs, l = 0.0f;
    if (!sigmoid) {
        sc = dsum > 0.0f ? vs / dsum : 0.0f;
        l = dsum > 0.0f ? m + kva_log2(dsum) : KVA_NEG_INF;
    }
    if (faulted) {
        sc = 0.0f;
        l = to_partial ? __uint_as_float(KVK_FAULT_LSE_BITS) : KVA_NEG_INF;
    }
    *scale = sc;
    *lse = l;
}

/* item context in shared memory (see kva_prefill_geom.h) */
typedef struct kvp_ctx {
    const char* kb;    /* K of this KV head */
    const char* vb;
    const int* pidx;   /* the request's page table (paged) */
    long long tok0;    /* first K/V token row (ragged) */
    int kv0, kv1;      /* item KV range */
    int ntiles;
    int req;
    int wq[4][2];      /* per warp: q_pos of its first and last valid row */
    int wact[4];       /* per warp: has valid rows */
    int rows;          /* item rows (epilogue) */
    int partial;       /* item partial slot (epilogue) */
    int fault;         /* set (atomicOr) by any thread that met an out-of-range page */
    int pad_[3];
} kvp_ctx;
static_assert(sizeof(kvp_ctx) <= 128, "kvp_ctx must fit its 128 bytes");

/* the same with the frequencies read from shared memory element by element (volatile: not hoisted into
   registers, for passes that run while the O accumulators are live) */
KVA_DEV void kvp_rope8_smem(float* x1, float* x2, float pos, const volatile float* fhi, const volatile float* flo) {
#pragma unroll
    for (int e = 0; e < 8; ++e) {
        float sn, cs;
        kvp_rope_sincos(pos, fhi[e], flo[e], &sn, &cs);
        const float a = x1[e], b = x2[e];
        x1[e] = a * cs - b * sn;
        x2[e] = b * cs + a * sn;
    }
}

/* rotate-half on one pair of 8-element chunks (x1: dims f..f+7 of the first half, x2: the same of the second) */
KVA_DEV void kvp_rope8(float* x1, float* x2, float pos, const float* fhi, const float* flo) {
#pragma unroll
    for (int e = 0; e < 8; ++e) {
        float sn, cs;
        kvp_rope_sincos(pos, fhi[e], flo[e], &sn, &cs);
        const float a = x1[e], b = x2[e];
        x1[e] = a * cs - b * sn;
        x2[e] = b * cs + a * sn;
    }
}

/* ---- warpgroup MMA (sm_90a) helpers for the Hopper mainloop ---- */
/* shared-memory matrix descriptor, 128-byte swizzle, 1024-byte stride byte offset: the low word (start address and
   leading byte offset fields, each / 16), then the whole descriptor from it */
KVA_DEV unsigned kvp_wg_desc_lo(unsigned addr, unsigned lbo) { return ((addr & 0x3FFFFu) >> 4) | (((lbo & 0x3FFFFu) >> 4) << 16); }
KVA_DEV unsigned long long kvp_wg_desc_sbo1k(unsigned lo) {
    return (unsigned long long)lo | ((unsigned long long)((1024u >> 4) | (1u << 30)) << 32);
}
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
KVA_DEV void kvp_wg_fence() { asm volatile("{ wgmma.fence.sync.aligned; }" ::: "memory"); }
KVA_DEV void kvp_wg_commit() { asm volatile("{ wgmma.commit_group.sync.aligned; }" ::: "memory"); }
KVA_DEV void kvp_wg_wait0() { asm volatile("{ wgmma.wait_group.sync.aligned 0; }" ::: "memory"); }
KVA_DEV void kvp_wg_wait1() { asm volatile("{ wgmma.wait_group.sync.aligned 1; }" ::: "memory"); }
#endif
/* pins a register at this point of the program (accumulators and A fragments of an asynchronous MMA must not be
   read, written or reused by the compiler between the MMA's issue and its wait) */
KVA_DEV void kvp_reg_fence(float& x) { asm volatile("" : "+f"(x)::"memory"); }
KVA_DEV void kvp_reg_fence_u(unsigned& x) { asm volatile("" : "+r"(x)::"memory"); }

#endif /* KVA_PREFILL_HELPERS */

/* ============================================================================================== */
/* One instance                                                                                    */
/* ============================================================================================== */
#ifndef KVA_KERNEL_NAME
#error "KVA_KERNEL_NAME must be defined"
#endif
#undef KVP_ML
#if !defined(KVA_MAINLOOP) || KVA_MAINLOOP == 0
#define KVP_ML 0
#elif KVA_MAINLOOP == 1
#define KVP_ML 1
#else
#error "KVA_MAINLOOP must be 0 (mma.sync) or 1 (Hopper warpgroup MMA)"
#endif
#if KVP_ML == 1 && (KVA_TQ != 128 || KVA_ROPE || KVA_QT != KVA_KT)
#error "the Hopper mainloop takes 128-row tiles, q and KV of one 16-bit dtype, no fused RoPE"
#endif
#undef KVP_AB
#if defined(KVA_ALIBI_FOLD) && KVA_ALIBI_FOLD
#define KVP_AB 1 /* ALiBi's per-key bias folded into the S accumulators (Hopper mainloop only) */
#if KVP_ML != 1
#error "KVA_ALIBI_FOLD needs the Hopper mainloop"
#endif
#else
#define KVP_AB 0
#endif
#if KVA_DQK != KVA_DVO
#error "the tensor-core kernel needs head_dim_qk == head_dim_vo"
#endif
#if KVA_DQK != 64 && KVA_DQK != 128 && KVA_DQK != 256
#error "head dim must be 64, 128 or 256"
#endif
#if KVA_TQ != 16 && KVA_TQ != 64 && KVA_TQ != 128
#error "KVA_TQ must be 16, 64 or 128"
#endif
#if KVA_TQ > KVK_PF_MAX_TQ(KVA_DQK)
#error "KVA_TQ = 128 is not offered at head dim 256"
#endif
#if KVA_QT != KVK_F16 && KVA_QT != KVK_BF16
#error "q must be f16 or bf16"
#endif

#undef KVP_FN
#undef KVP_NOCHK
#undef KVP_D
#undef KVP_ES
#undef KVP_CT
#undef KVP_FP8
#undef KVP_QCONV
#undef KVP_MQ
#undef KVP_WKV
#undef KVP_WQ
#undef KVP_RW
#undef KVP_TKV
#undef KVP_KW
#undef KVP_NK
#undef KVP_CH
#undef KVP_SK
#undef KVP_NSK
#undef KVP_ND
#undef KVP_KS
#undef KVP_S
#undef KVP_ROWB
#undef KVP_RAWB
#undef KVP_CPR
#undef KVP_UK
#undef KVP_RSTEP
#undef KVP_QIR
#undef KVP_KFIX
#undef KVP_STAGE
#undef KVP_OFF_KV
#undef KVP_OFF_CONV
#undef KVP_OFF_OFFS
#undef KVP_OFF_ROWS
#undef KVP_OFF_FREQ
#undef KVP_LD
#undef KVP_OES
#undef KVP_PREP_UNROLL
#undef KVP_NT
#undef KVP_CTA_NT
#undef KVP_TID
#undef KVP_MINB
#undef KVP_SOFF
#undef KVP_RING
#undef KVP_KDST
#undef KVP_VDST
#undef KVP_OFF_BAR
#undef KVP_OFF_QBAR
#undef KVP_OFF_Q2
#undef KVP_ROWS2
#undef KVP_LAZY
#undef KVP_VAR_HAS
#undef KVP_VLOGITS
#undef KVP_VP_DECL
#undef KVP_VP_ARG

#define KVP_FN(name) KVP_CAT(name, KVA_KERNEL_NAME) /* instance-private function names */
/* User variants (docs/variants.md; NVRTC only: the variant's source defines KVA_VARIANT, KVA_VAR_HOOKS and
   KVA_VAR_SOFTMAX and its hooks before this file): the logits transform and mask in kvp_scores, the weights of
   use_softmax = 0, and the output transform in the epilogue of final rows (split rows: in the variant's merge
   kernel, kva_variant.cuh). The query and key transforms are not here: their results would be rounded to 16 bits
   for the MMA (the host keeps such variants on the CUDA-core kernel). mma.sync mainloop only. */
#ifndef KVA_VARIANT
#define KVA_VARIANT 0
#endif
#if KVA_VARIANT
#if (KVA_VAR_HOOKS & 3) || KVA_ROPE || KVP_ML != 0
#error "the tensor-core kernel takes user variants without query / key transforms, on the mma.sync mainloop, without RoPE"
#endif
#define KVP_VAR_HAS(bit) ((KVA_VAR_HOOKS & (bit)) != 0)
#define KVP_VP_DECL , const kvk_vparams* const vp
#define KVP_VP_ARG , vp
/* the logits pass: a logits mask or transform, or weights instead of a softmax (the host then sets
   KVK_FLAG_TRANSFORM: natural-log logits); an output transform alone leaves the score path as built in */
#define KVP_VLOGITS (KVP_VAR_HAS(4) || KVP_VAR_HAS(8) || !KVA_VAR_SOFTMAX)
#else
#define KVP_VAR_HAS(bit) 0
#define KVP_VP_DECL
#define KVP_VP_ARG
#define KVP_VLOGITS 0
#endif
#ifndef KVP_EXP /* benchmark timing experiments (KVATTN_BENCH_PF_EXP; results are not valid): 1 no ping-pong between the
                   consumer warpgroups, 2 exp2 replaced by a multiply-add, 4 no mask / softmax at all, 8 no O rescale,
                   16 the Hopper producer copies nothing (barriers only), 32 no consumer-side proxy fences; valid
                   results: 64 the eager rescale (KVP_LAZY = 0), 128 the Hopper consumers read the item's facts and the worker's
                   end from the plan in global memory at every item (the order before) */
#define KVP_EXP 0
#endif
/* Lazy rescale: a row keeps its running max m until a tile's max exceeds it by more than KVP_LAZY (log2 units), so
   P = exp2(s - m) <= 2^KVP_LAZY (exact in f16 / bf16 up to rounding; d and O in f32) and after a row's first tiles
   almost no tile rescales O (the warps skip it by a vote). The result is exact: O, d and lse = m + log2(d) all
   refer to the same m, and partials merge through their own (m, d). */
#if KVP_EXP & 64
#define KVP_LAZY 0.0f
#else
#define KVP_LAZY 8.0f
#endif

/* benchmark-only builds (KVATTN_BENCH_NO_BOUNDS_CHECK): no page-index bounds check, to measure its cost */
#if defined(KVA_NO_BOUNDS_CHECK) && KVA_NO_BOUNDS_CHECK
#define KVP_NOCHK 1
#else
#define KVP_NOCHK 0
#endif
#define KVP_D KVA_DQK
#define KVP_ES KVK_PF_ES(KVA_KT)
/* compute type of the tensor cores: the KV type when it is 16-bit (q is converted if it differs), else q's */
#define KVP_CT ((KVA_KT == KVK_F16 || KVA_KT == KVK_BF16) ? KVA_KT : KVA_QT)
#define KVP_FP8 (KVP_ES == 1)
#define KVP_QCONV (KVA_ROPE || KVA_QT != KVP_CT) /* Q goes through registers on its way to shared memory */
#if KVP_ML == 0
#define KVP_NT KVK_PF_THREADS           /* threads that run rows / Q / epilogue (all, here) */
#define KVP_CTA_NT KVK_PF_THREADS       /* threads per CTA */
#define KVP_TID ((int)threadIdx.x)      /* index among the KVP_NT */
#define KVP_MINB 2                      /* CTAs per SM (launch bounds) */
#define KVP_MQ KVK_PF_MQ(KVA_TQ)
#define KVP_WKV KVK_PF_WKV(KVA_TQ)
#define KVP_WQ KVK_PF_WQ(KVA_TQ)
#define KVP_TKV KVK_PF_TKV(KVA_DQK, KVA_TQ)
#else /* Hopper: 2 warpgroups x 64 rows, each warp 16 rows; one S block of the whole tile per warpgroup */
#define KVP_NT KVK_PFW_CONSUMERS      /* the two computing warpgroups */
#define KVP_CTA_NT KVK_PFW_THREADS
#define KVP_TID ((int)threadIdx.x - 128)
#define KVP_MINB 1
#define KVP_MQ 1
#define KVP_WKV 1
#define KVP_WQ 8
#define KVP_TKV KVK_PFW_TKV(KVA_DQK)
#endif
#define KVP_RW (16 * KVP_MQ)          /* rows per warp */
#define KVP_KW (KVP_TKV / KVP_WKV)    /* keys per warp per tile */
/* Keys per online-softmax step (KVP_SK): the warp's whole slice of the tile, except at TQ 128 x D 128 where S (64
   registers for 64 keys) next to O (128) leaves ptxas no headroom (nvcc and NVRTC then spill a few words, on
   different instances): there each warp takes its 64 keys in two 32-key steps (the Q fragments are read from
   shared memory once more per tile). KVA_PF_SK (32 or 64, a -D option) overrides it for A/B timing. The Hopper
   mainloop takes the whole tile in one step (its O has 64 rows per warpgroup: half the registers). */
#if KVP_ML == 1
#define KVP_SK KVP_KW
#elif defined(KVA_PF_SK)
#define KVP_SK (KVA_PF_SK < KVP_KW ? KVA_PF_SK : KVP_KW)
#elif KVP_D == 128 && KVA_TQ == 128
#define KVP_SK 32
#else
#define KVP_SK KVP_KW
#endif
#define KVP_NSK (KVP_KW / KVP_SK)
#define KVP_NK (KVP_SK / 8)           /* n8 blocks of S per warp and sub-step */
#define KVP_CH (KVP_NK >= 4 ? 4 : KVP_NK >= 2 ? 2 : 1) /* independent max / sum chains per row in kvp_scores (1, 2 or 4) */
#define KVP_ND (KVP_D / 8)            /* n8 blocks of O; also 16-byte chunks per 16-bit row */
#define KVP_KS (KVP_D / 16)           /* k16 steps of QK */
#if KVP_ML == 0
#define KVP_S KVK_PF_STAGES(KVA_DQK, KVA_TQ, KVP_ES)
#else
#define KVP_S KVK_PFW_STAGES(KVA_DQK)
#endif
#define KVP_ROWB (KVP_D * 2)          /* bytes per 16-bit shared row */
#define KVP_RAWB (KVP_D * KVP_ES)     /* bytes per KV row as stored */
#define KVP_CPR (KVP_RAWB / 16)       /* 16-byte chunks per KV row */
#define KVP_UK (KVP_TKV * KVP_CPR / KVP_NT) /* copies per thread per tile (K and V each) */
#define KVP_RSTEP (KVP_NT / KVP_CPR)
#define KVP_QIR (KVP_MQ * KVP_KS <= 8) /* Q fragments live in registers (<= 32 of them) */
#if KVA_KT == KVK_E4M3
#define KVP_KFIX KVA_E4M3_FIX
#else
#define KVP_KFIX 1.0f
#endif
#if KVP_ML == 0
#define KVP_STAGE KVK_PF_STAGE_BYTES(KVA_DQK, KVA_TQ, KVP_ES)
#define KVP_OFF_KV KVK_PF_Q_BYTES(KVA_DQK, KVA_TQ)
#define KVP_OFF_CONV (KVP_OFF_KV + KVP_S * KVP_STAGE)
#define KVP_OFF_OFFS KVK_PF_OFF_OFFS(KVA_DQK, KVA_TQ, KVP_ES)
#define KVP_OFF_ROWS KVK_PF_OFF_ROWS(KVA_DQK, KVA_TQ, KVP_ES)
#define KVP_OFF_FREQ KVK_PF_OFF_FREQ(KVA_DQK, KVA_TQ, KVP_ES)
/* byte offset of 16-byte chunk c of row r in a 16-bit shared tile of nr rows (chunk c at c ^ (r & 7)) */
#define KVP_SOFF(r, c, nr) ((r) * KVP_ROWB + (((c) ^ ((r) & 7)) << 4))
#define KVP_RING KVP_S                                        /* offset / page-entry ring slots */
#define KVP_KDST(T) (((T) % KVP_S) * KVP_STAGE)               /* K tile T in the region after Q */
#define KVP_VDST(T) (((T) % KVP_S) * KVP_STAGE + KVP_STAGE / 2)
#else
#define KVP_STAGE KVK_PFW_STAGE_BYTES(KVA_DQK)
#define KVP_OFF_KV KVK_PFW_Q_BYTES(KVA_DQK)
#define KVP_OFF_CONV KVP_OFF_KV /* unused: no fp8 */
#define KVP_OFF_OFFS KVK_PFW_OFF_OFFS(KVA_DQK)
#define KVP_OFF_ROWS KVK_PFW_OFF_ROWS(KVA_DQK)
#define KVP_OFF_FREQ KVK_PFW_OFF_FREQ(KVA_DQK)
/* the warpgroup MMA's 128-byte swizzle: column block c / 8 of nr rows x 128 bytes, chunk c % 8 at (c % 8) ^ (r % 8) */
#define KVP_SOFF(r, c, nr) (((c) >> 3) * ((nr) * 128) + (r) * 128 + ((((c) & 7) ^ ((r) & 7)) << 4))
/* K and V in separate two-slot rings indexed by the CTA's running K / V tile counts (the producer runs up to two
   tiles ahead), the producer's row offsets in a ring of 2, then 8 mbarriers */
#define KVP_RING KVK_PFW_RING
#define KVP_KDST(C) (((C) & 1) * (KVP_STAGE / 2))
#define KVP_VDST(C) ((2 + ((C) & 1)) * (KVP_STAGE / 2))
#define KVP_OFF_BAR KVK_PFW_OFF_BAR(KVA_DQK)
#define KVP_OFF_QBAR KVK_PFW_OFF_QBAR(KVA_DQK)
#define KVP_OFF_Q2 KVK_PFW_OFF_Q2(KVA_DQK)
#define KVP_ROWS2 (KVK_PFW_OFF_ROWS2(KVA_DQK) - KVP_OFF_ROWS) /* the KVP_S_* row facts of Q slot 1: at smem + this */
#endif
#define KVP_LD KVK_PF_EPI_LD(KVA_DQK)
#define KVP_OES (KVA_OT == KVK_F32 ? 4 : 2)
/* units in flight in the fp8 / RoPE tile passes (the O accumulators stay live through them) */
#define KVP_PREP_UNROLL ((KVP_MQ == 2 || KVP_D == 256) ? 1 : 2)

#if (KVP_ML == 0 && KVP_UK * KVP_NT != KVP_TKV * KVP_CPR) || KVP_NK % 2 != 0 || KVP_SK % 16 != 0 || KVP_KW % KVP_SK != 0
#error "inconsistent prefill geometry"
#endif

/* Row facts (shared memory, TQ entries each) */
#define KVP_S_MBIT(sm) ((long long*)((sm) + KVP_OFF_ROWS))
#define KVP_S_QPOS(sm) ((int*)((sm) + KVP_OFF_ROWS + 8 * KVA_TQ))
#define KVP_S_QI(sm) ((int*)((sm) + KVP_OFF_ROWS + 12 * KVA_TQ))
#define KVP_S_QH(sm) ((int*)((sm) + KVP_OFF_ROWS + 16 * KVA_TQ))
#define KVP_S_SLOPE(sm) ((float*)((sm) + KVP_OFF_ROWS + 20 * KVA_TQ))
#define KVP_S_CTX(sm) ((kvp_ctx*)((sm) + KVP_OFF_ROWS + 24 * KVA_TQ))
#define KVP_S_WQ(sm) ((int*)((sm) + KVP_OFF_ROWS + 24 * KVA_TQ)) /* Hopper: int[8][2] in place of the context */
/* Hopper: the Q slot's item (kv_start, kv_end, rows, partial), after KVP_S_WQ */
#define KVP_S_ITEM(sm) ((volatile int*)((sm) + KVP_OFF_ROWS + 24 * KVA_TQ + 64))

/* ---------------------------------------------------------------------------------------------- */
/* Row facts of a work item (no barrier: the mainloop's first barrier publishes them)              */

/* tile row r's facts (rows past the item repeat its last row) */
KVA_DEV void KVP_FN(kvp_row_fact)(const kvk_attn_params p, const kvk_work_item item, const kvk_request rq, char* smem,
                                  const int r) {
    const int g = p.group_size;
    const int pr = item.row_start + (r < item.rows ? r : (item.rows > 0 ? item.rows - 1 : 0));
    const int i = pr / g;
    const int qh = item.kv_head * g + (pr - i * g);
    KVP_S_QPOS(smem)[r] = rq.kv_len - rq.qo_len + i;
    KVP_S_QI(smem)[r] = rq.qo_start + i;
    KVP_S_QH(smem)[r] = qh;
    float sl = 0.0f;
    if (p.flags & KVK_FLAG_ALIBI) sl = p.alibi_slopes ? p.alibi_slopes[qh] : kva_alibi_slope(qh, p.num_qo_heads);
    KVP_S_SLOPE(smem)[r] = sl;
    KVP_S_MBIT(smem)[r] = rq.mask_offset * 8 + (long long)i * rq.kv_len;
}

KVA_DEV void KVP_FN(kvp_rows)(const kvk_attn_params p, const kvk_work_item item, const kvk_request rq, char* smem) {
    for (int r = KVP_TID; r < KVA_TQ; r += KVP_NT) KVP_FN(kvp_row_fact)(p, item, rq, smem, r);
    if (KVP_TID == 0) {
        kvp_ctx* c = KVP_S_CTX(smem);
        const int es = KVK_PF_ES(KVA_KT);
        c->kb = (const char*)p.k + (long long)item.kv_head * p.k_stride_head * es;
        c->vb = (const char*)p.v + (long long)item.kv_head * p.v_stride_head * es;
        c->pidx = p.indices + rq.kv_start;
        c->tok0 = rq.kv_start;
        c->kv0 = item.kv_start;
        c->kv1 = item.kv_end;
        c->ntiles = item.kv_end > item.kv_start ? (item.kv_end - item.kv_start + KVP_TKV - 1) /
                                                      KVP_TKV
                                                : 0;
        c->req = item.req;
        c->rows = item.rows;
        c->partial = item.partial;
        c->fault = 0; /* no thread writes it before the next barrier (the request check's or the mainloop's first) */
    }
}

/* ---------------------------------------------------------------------------------------------- */
/* Request-wide page check: every item of a request checks the request's whole page table (coalesced, 8 loads in
   flight per thread), so a request with any out-of-range page is faulted in every one of its tiles and KV heads
   (o = 0, lse = -inf for all its rows), not only in the tiles whose KV range reaches the bad page. Returns whether
   this thread (tid of nt) saw a bad page; the key of each bad page goes into the status word by a second pass, only
   when there is one. */
KVA_DEV int KVP_FN(kvp_request_bad)(const kvk_attn_params p, const kvk_request rq, const int req, const int tid, const int nt) {
    if (KVP_NOCHK || (p.flags & KVK_FLAG_RAGGED) || rq.kv_len <= 0) return 0;
    const int n = (int)kva_fastdiv((unsigned)(rq.kv_len - 1), p.ps_mul, p.ps_shift) + 1;
    const kvk_i32* const pidx = p.indices + rq.kv_start;
    const unsigned np = (unsigned)p.num_pages;
    int bad = 0;
    for (int e0 = 0; e0 < n; e0 += 8 * nt) {
        int pg[8];
#pragma unroll
        for (int u = 0; u < 8; ++u) {
            const int e = e0 + u * nt + tid;
            pg[u] = e < n ? kva_ldg_i32(pidx + e) : 0;
        }
#pragma unroll
        for (int u = 0; u < 8; ++u) bad |= (unsigned)pg[u] >= np;
    }
    if (bad)
        for (int e = tid; e < n; e += nt) {
            const int pg = kva_ldg_i32(pidx + e);
            if ((unsigned)pg >= np)
                atomicMax((unsigned long long*)&((kvk_status*)p.ws)->first_key,
                          ~(((unsigned long long)(unsigned)req << 32) | (unsigned long long)(unsigned)pg));
        }
    return bad;
}

/* ---------------------------------------------------------------------------------------------- */
/* Q tile -> shared memory [TQ][D] (CT, swizzled); rows >= item.rows are zero                      */

/* The item's Q tile into the swizzled tile at q_s (row facts at smem), by threads tid of nt (KVP_ND divides nt) */
KVA_DEV void KVP_FN(kvp_load_q)(const kvk_attn_params p, const kvk_work_item item, const char* smem, const unsigned q_s,
                                const int tid, const int nt) {
    const int* s_qi = KVP_S_QI(smem);
    const int* s_qh = KVP_S_QH(smem);
    const unsigned short* qbase = (const unsigned short*)p.q;
#if !KVP_QCONV
    const int c = tid % KVP_ND; /* fixed per thread */
#pragma unroll 4
    for (int r = tid / KVP_ND; r < KVA_TQ; r += nt / KVP_ND) {
        const unsigned short* src =
            qbase + (long long)s_qi[r] * p.q_stride_row + (long long)s_qh[r] * p.q_stride_head + c * 8;
        kva_cp_async16(q_s + (unsigned)KVP_SOFF(r, c, KVA_TQ), src, r < item.rows ? 16u : 0u);
    }
#elif KVA_ROPE
    const float* s_fhi = (const float*)(smem + KVP_OFF_FREQ);
    const float* s_flo = s_fhi + KVP_D / 2;
    const int* s_qpos = KVP_S_QPOS(smem);
    const int c = tid % (KVP_ND / 2);
    for (int r = tid / (KVP_ND / 2); r < KVA_TQ; r += nt / (KVP_ND / 2)) {
        float x1[8], x2[8];
        if (r < item.rows) {
            const unsigned short* src =
                qbase + (long long)s_qi[r] * p.q_stride_row + (long long)s_qh[r] * p.q_stride_head + c * 8;
            kvp_unpack8(kva_ldg_nc16(src), KVA_QT, x1);
            kvp_unpack8(kva_ldg_nc16(src + KVP_D / 2), KVA_QT, x2);
            float fh[8], fl[8];
#pragma unroll
            for (int e = 0; e < 8; ++e) {
                fh[e] = s_fhi[c * 8 + e];
                fl[e] = s_flo[c * 8 + e];
            }
            kvp_rope8(x1, x2, (float)s_qpos[r], fh, fl);
        } else {
#pragma unroll
            for (int e = 0; e < 8; ++e) x1[e] = x2[e] = 0.0f;
        }
        const int c2 = c + KVP_ND / 2;
        kvp_st_shared16(q_s + (unsigned)KVP_SOFF(r, c, KVA_TQ), kvp_pack8(x1, KVP_CT));
        kvp_st_shared16(q_s + (unsigned)KVP_SOFF(r, c2, KVA_TQ), kvp_pack8(x2, KVP_CT));
    }
#else
    const int c = tid % KVP_ND;
    for (int r = tid / KVP_ND; r < KVA_TQ; r += nt / KVP_ND) {
        float x[8];
        if (r < item.rows) {
            const unsigned short* src =
                qbase + (long long)s_qi[r] * p.q_stride_row + (long long)s_qh[r] * p.q_stride_head + c * 8;
            kvp_unpack8(kva_ldg_nc16(src), KVA_QT, x);
        } else {
#pragma unroll
            for (int e = 0; e < 8; ++e) x[e] = 0.0f;
        }
        kvp_st_shared16(q_s + (unsigned)KVP_SOFF(r, c, KVA_TQ), kvp_pack8(x, KVP_CT));
    }
#endif
}

/* ---------------------------------------------------------------------------------------------- */
/* KV tile preparation after arrival: fp8 -> 16-bit (into the conversion buffer), RoPE on K.      */

#if KVP_FP8 || KVA_ROPE
KVA_DEV void KVP_FN(kvp_prep_tile)(unsigned raw_k, unsigned raw_v, unsigned ck, unsigned cv, int j0, const char* smem) {
    const int tid = threadIdx.x;
#if KVA_ROPE
    const float* s_fhi = (const float*)(smem + KVP_OFF_FREQ);
    const float* s_flo = s_fhi + KVP_D / 2;
    /* K, rotated: units (row, chunk c of the first half) with its partner chunk c + D/16; c is fixed per thread
       since D/16 divides the thread count */
    {
        const int c = tid % (KVP_ND / 2);
        const int c2 = c + KVP_ND / 2;
#if KVP_PREP_UNROLL == 1
#pragma unroll 1
#else
#pragma unroll 2
#endif
        for (int r = tid / (KVP_ND / 2); r < KVP_TKV; r += KVP_NT / (KVP_ND / 2)) {
            float x1[8], x2[8];
#if KVP_FP8
            kvp_fp8x8_to_f32(kva_ld_shared8(raw_k + (unsigned)(r * KVP_RAWB + c * 8)), KVA_KT, x1);
            kvp_fp8x8_to_f32(kva_ld_shared8(raw_k + (unsigned)(r * KVP_RAWB + c2 * 8)), KVA_KT, x2);
            const unsigned dst = ck;
#else
            kvp_unpack8(kva_ld_shared16(raw_k + (unsigned)(r * KVP_ROWB + ((c ^ (r & 7)) << 4))), KVP_CT, x1);
            kvp_unpack8(kva_ld_shared16(raw_k + (unsigned)(r * KVP_ROWB + ((c2 ^ (r & 7)) << 4))), KVP_CT, x2);
            const unsigned dst = raw_k;
#endif
            kvp_rope8_smem(x1, x2, (float)(j0 + r), s_fhi + c * 8, s_flo + c * 8);
            kvp_st_shared16(dst + (unsigned)(r * KVP_ROWB + ((c ^ (r & 7)) << 4)), kvp_pack8(x1, KVP_CT));
            kvp_st_shared16(dst + (unsigned)(r * KVP_ROWB + ((c2 ^ (r & 7)) << 4)), kvp_pack8(x2, KVP_CT));
        }
    }
#endif
#if KVP_FP8
    /* plain conversion of V (and of K without RoPE): 8 values per unit */
#if KVA_ROPE
    const int nmat = 1;
#else
    const int nmat = 2;
#endif
#pragma unroll
    for (int mtx = 0; mtx < nmat; ++mtx) {
        const unsigned src = mtx == 0 ? raw_v : raw_k;
        const unsigned dst = mtx == 0 ? cv : ck;
#if KVP_PREP_UNROLL == 1
#pragma unroll 1
#else
#pragma unroll 2
#endif
        for (int r = tid / KVP_ND; r < KVP_TKV; r += KVP_NT / KVP_ND) {
            const int c = tid % KVP_ND;
            const uint2 w = kva_ld_shared8(src + (unsigned)(r * KVP_RAWB + c * 8));
            uint4 o;
            o.x = kvp_fp8x2_to_ct((unsigned short)(w.x & 0xffffu), KVA_KT, KVP_CT);
            o.y = kvp_fp8x2_to_ct((unsigned short)(w.x >> 16), KVA_KT, KVP_CT);
            o.z = kvp_fp8x2_to_ct((unsigned short)(w.y & 0xffffu), KVA_KT, KVP_CT);
            o.w = kvp_fp8x2_to_ct((unsigned short)(w.y >> 16), KVA_KT, KVP_CT);
            kvp_st_shared16(dst + (unsigned)(r * KVP_ROWB + ((c ^ (r & 7)) << 4)), o);
        }
    }
#else
    (void)raw_v;
    (void)ck;
    (void)cv;
#endif
}
#endif

/* ---------------------------------------------------------------------------------------------- */
/* One warp's S block -> P: logits transforms and mask (only on tiles that need them), then the online softmax
   (rescaling O where a row's max moved) or sigmoid. s holds S for rows wr0 + mq * 16 + qr (+ 8) and keys
   jw0 + n * 8 + qc (+ 1) (the m16n8 accumulator layout, which is also the warpgroup MMA's); on return it holds P
   in f32. Shared by both mainloops. With alpha, O is left alone and each row's rescale factor is stored there
   instead (sigmoid: untouched). */

KVA_DEV void KVP_FN(kvp_scores)(const kvk_attn_params p, float (&s)[KVP_MQ][KVP_NK][4], float (&o)[KVP_MQ][KVP_ND][4],
                                float (&m)[KVP_MQ][2], float (&d)[KVP_MQ][2], const int jw0, const int kv1,
                                const int wr0, const int wqmin, const int wqmax, const int qr, const int qc,
                                const char* smem, float (*alpha)[2], const bool abias, const float (&rofs)[KVP_MQ][2]
                                KVP_VP_DECL) {
    const unsigned flags = p.flags;
    const bool causal = (flags & KVK_FLAG_CAUSAL) != 0;
    const bool window = (flags & KVK_FLAG_WINDOW) != 0;
    const bool sigmoid = (flags & KVK_FLAG_SIGMOID) != 0;
    const float neg_inf = KVA_NEG_INF;
    const int jw1 = jw0 + KVP_SK - 1;
    const int* const s_qpos = KVP_S_QPOS(smem);
    const float* const s_slope = KVP_S_SLOPE(smem);
    const long long* const s_mbit = KVP_S_MBIT(smem);
    /* ---- logits transforms and mask (only where needed) ----
       In passes without per-element branches. Per row, the visible keys of this warp slice are k in [lo, hi]
       with k = j - (jw0 + qc), compared against the compile-time offsets n * 8 + e. */
    /* ALiBi without soft cap: the natural-log logit s * q_scale + slope (j - q) goes to the log2 domain by scaling
       q_scale and the slope by log2(e) (no per-element multiply) */
    const bool alibi_l2 = !KVP_VLOGITS && (flags & KVK_FLAG_ALIBI) && !(flags & KVK_FLAG_SOFTCAP);
    const float qsc = p.q_scale * KVP_KFIX * (alibi_l2 ? KVA_LOG2E : 1.0f);
    /* geo: every key of the slice is inside the range and visible to every row (causal, window), so no mask */
    /* (32-bit window arithmetic: q positions are above -2^30 and the host clamps window_left to 2^30) */
    const bool geo = jw1 < kv1 && (!causal || jw1 <= wqmin) && (!window || jw0 >= wqmax - p.window_left);
    /* abias: the caller put ALiBi's per-key part in s (the MMA accumulated onto it); row (mq, h) adds rofs[mq][h]
       (zero without abias) */
    const bool full = !KVP_VLOGITS && !(flags & (KVK_FLAG_CUSTOM | (abias ? 0u : KVK_FLAG_TRANSFORM))) && qsc > 0.0f && geo;
    float sc = qsc; /* s * sc (+ rofs) is the log2-domain logit */
    if (!full) {
        sc = 1.0f;
        const int base = jw0 + qc;
        if ((flags & KVK_FLAG_ALIBI) && !abias) {
#pragma unroll
            for (int mq = 0; mq < KVP_MQ; ++mq)
#pragma unroll
                for (int h = 0; h < 2; ++h) {
                    const int row = wr0 + mq * 16 + qr + 8 * h;
                    const float slope = s_slope[row] * (alibi_l2 ? KVA_LOG2E : 1.0f);
                    const float c0 = slope * (float)(base - s_qpos[row]); /* bias of key offset 0 */
#pragma unroll
                    for (int n = 0; n < KVP_NK; ++n)
#pragma unroll
                        for (int e = 0; e < 2; ++e) /* two multiply-adds per element */
                            s[mq][n][2 * h + e] = fmaf(s[mq][n][2 * h + e], qsc, fmaf(slope, (float)(n * 8 + e), c0));
                }
        } else {
#pragma unroll
            for (int mq = 0; mq < KVP_MQ; ++mq)
#pragma unroll
                for (int n = 0; n < KVP_NK; ++n)
#pragma unroll
                    for (int e = 0; e < 4; ++e) s[mq][n][e] *= qsc;
        }
        if (flags & KVK_FLAG_SOFTCAP) {
            /* cap * tanh(s / cap) = cap - 2 cap / (1 + exp2(s * 2 log2(e) / cap)): five instructions per element and
               no copy of s kept (|error| ~ 2.5e-7 cap; exp2 -> inf gives cap, -> 0 gives -cap) */
            const float c2 = 2.0f * KVA_LOG2E / p.softcap, cap = p.softcap;
#pragma unroll
            for (int mq = 0; mq < KVP_MQ; ++mq)
#pragma unroll
                for (int n = 0; n < KVP_NK; ++n)
#pragma unroll
                    for (int e = 0; e < 4; ++e)
                        s[mq][n][e] = fmaf(-2.0f * cap, kva_rcp(1.0f + kva_exp2(s[mq][n][e] * c2)), cap);
        }
        if (!KVP_VLOGITS && (flags & KVK_FLAG_TRANSFORM) && !alibi_l2) { /* natural -> log2 domain */
#pragma unroll
            for (int mq = 0; mq < KVP_MQ; ++mq)
#pragma unroll
                for (int n = 0; n < KVP_NK; ++n)
#pragma unroll
                    for (int e = 0; e < 4; ++e) s[mq][n][e] *= KVA_LOG2E;
        }
        if (!geo) /* (ALiBi and soft-cap tiles inside the visible region skip the mask) */
#pragma unroll
        for (int mq = 0; mq < KVP_MQ; ++mq)
#pragma unroll
            for (int h = 0; h < 2; ++h) {
                const int row = wr0 + mq * 16 + qr + 8 * h;
                const int qpos = s_qpos[row];
                int hi = kv1 - 1 - base;
                if (causal && qpos - base < hi) hi = qpos - base;
                int lo = -1;
                if (window) {
                    const int ql = qpos - p.window_left; /* first visible key, or below 0 */
                    const int l = ql < base ? -1 : ql - base;
                    lo = l > KVP_SK ? KVP_SK : l;
                }
#pragma unroll
                for (int n = 0; n < KVP_NK; ++n)
#pragma unroll
                    for (int e = 0; e < 2; ++e) {
                        const int k = n * 8 + e;
                        if (!(k >= lo && k <= hi)) s[mq][n][2 * h + e] = neg_inf;
                    }
            }
        if (flags & KVK_FLAG_CUSTOM) {
            /* per row and 64-key chunk, the chunk's bits from its first key on, gathered byte by byte (never past
               the row's last visible key, so never past the request's segment); then bit qc + n * 8 + e per element */
#pragma unroll
            for (int mq = 0; mq < KVP_MQ; ++mq)
#pragma unroll
                for (int h = 0; h < 2; ++h) {
                    const long long mb = s_mbit[wr0 + mq * 16 + qr + 8 * h];
                    const long long last = (mb + kv1 - 1) >> 3;
#pragma unroll
                    for (int ch = 0; ch < (KVP_SK + 63) / 64; ++ch) {
                        const int nkeys = KVP_SK - ch * 64 < 64 ? KVP_SK - ch * 64 : 64;
                        const long long b0 = mb + jw0 + ch * 64;
                        const long long byte0 = b0 >> 3;
                        const int sh = (int)(b0 & 7);
                        unsigned long long w = 0ull;
                        unsigned top = 0u;
#pragma unroll 1
                        for (int q = 0; q <= nkeys / 8; ++q) {
                            const unsigned v = byte0 + q <= last ? (unsigned)__ldg(p.custom_mask + byte0 + q) : 0u;
                            if (q < 8) w |= (unsigned long long)v << (8 * q);
                            else top = v;
                        }
                        w = sh ? (w >> sh) | ((unsigned long long)top << (64 - sh)) : w;
                        w >>= qc;
#pragma unroll
                        for (int n = ch * 8; n < KVP_NK && n < ch * 8 + 8; ++n)
#pragma unroll
                            for (int e = 0; e < 2; ++e)
                                if (((w >> ((n - ch * 8) * 8 + e)) & 1ull) == 0ull) s[mq][n][2 * h + e] = neg_inf;
                    }
                }
        }
#if KVP_VLOGITS
        {
            /* the variant's logits mask and transform on the keys the built-in masks left visible (finite here:
               masked keys and keys past the item are -inf), natural-log logits; then to the log2 domain (softmax)
               or, without softmax, the transformed logit is the weight and masked keys weigh 0 */
            const int* const s_qh = KVP_S_QH(smem);
            const int req = KVP_S_CTX(smem)->req;
#pragma unroll
            for (int mq = 0; mq < KVP_MQ; ++mq)
#pragma unroll
                for (int h = 0; h < 2; ++h) {
                    const int row = wr0 + mq * 16 + qr + 8 * h;
                    const int qpos = s_qpos[row], qh = s_qh[row], kvh = qh / p.group_size;
                    (void)qpos, (void)qh, (void)kvh, (void)req;
#pragma unroll
                    for (int n = 0; n < KVP_NK; ++n)
#pragma unroll
                        for (int e = 0; e < 2; ++e) {
                            float x = s[mq][n][2 * h + e];
                            bool vis = x != neg_inf;
#if KVP_VAR_HAS(8)
                            if (vis && !kva_logits_mask(vp, req, qh, kvh, qpos, base + n * 8 + e)) vis = false;
#endif
#if KVP_VAR_HAS(4)
                            if (vis) x = kva_logits_transform(vp, x, req, qh, kvh, qpos, base + n * 8 + e);
#endif
#if KVA_VAR_SOFTMAX
                            s[mq][n][2 * h + e] = vis ? x * KVA_LOG2E : neg_inf;
#else
                            s[mq][n][2 * h + e] = vis ? x : 0.0f;
#endif
                        }
                }
        }
#endif
    }

    /* ---- online softmax (or sigmoid) ---- */
    if (!sigmoid) {
#pragma unroll
        for (int mq = 0; mq < KVP_MQ; ++mq)
#pragma unroll
            for (int h = 0; h < 2; ++h) {
                /* max and sum in KVP_CH independent chains (short dependency chains: the softmax is latency-bound) */
                float mc[KVP_CH];
#pragma unroll
                for (int c = 0; c < KVP_CH; ++c) mc[c] = fmaxf(s[mq][c][2 * h], s[mq][c][2 * h + 1]);
#pragma unroll
                for (int n = KVP_CH; n < KVP_NK; ++n) mc[n % KVP_CH] = fmaxf(mc[n % KVP_CH], fmaxf(s[mq][n][2 * h], s[mq][n][2 * h + 1]));
#pragma unroll
                for (int w = KVP_CH / 2; w >= 1; w /= 2)
#pragma unroll
                    for (int c = 0; c < w; ++c) mc[c] = fmaxf(mc[c], mc[c + w]);
                float mx = mc[0];
                mx = fmaxf(mx, __shfl_xor_sync(KVP_FULL, mx, 1));
                mx = fmaxf(mx, __shfl_xor_sync(KVP_FULL, mx, 2));
                const float ro = rofs[mq][h];
                mx = fmaf(mx, sc, ro); /* sc > 0 */
                const float mo = m[mq][h];
                const bool up = mx > mo + KVP_LAZY; /* (mo = -inf: any finite mx) */
                const float mn = up ? mx : mo;
                const float mu = mn == neg_inf ? 0.0f : mn;
                const float al = up ? kva_exp2(mo - mu) : 1.0f;
                const float rmu = ro - mu;
                m[mq][h] = mn;
                float pc[KVP_CH];
#pragma unroll
                for (int c = 0; c < KVP_CH; ++c) pc[c] = 0.0f;
#pragma unroll
                for (int n = 0; n < KVP_NK; ++n)
#pragma unroll
                    for (int e = 0; e < 2; ++e) {
                        const float pv = (KVP_EXP & 2) ? fmaf(s[mq][n][2 * h + e], sc, rmu)
                                                       : kva_exp2(fmaf(s[mq][n][2 * h + e], sc, rmu));
                        s[mq][n][2 * h + e] = pv;
                        pc[n % KVP_CH] += pv;
                    }
#pragma unroll
                for (int w = KVP_CH / 2; w >= 1; w /= 2)
#pragma unroll
                    for (int c = 0; c < w; ++c) pc[c] += pc[c + w];
                d[mq][h] = d[mq][h] * al + pc[0];
                if (alpha) { /* the caller rescales O (its MMA may still be accumulating into it) */
                    alpha[mq][h] = al;
                } else if (__any_sync(KVP_FULL, al != 1.0f)) { /* most tiles leave every row's max unchanged */
#pragma unroll
                    for (int n = 0; n < KVP_ND; ++n) {
                        o[mq][n][2 * h] *= al;
                        o[mq][n][2 * h + 1] *= al;
                    }
                }
            }
    } else {
#if KVA_VARIANT && !KVA_VAR_SOFTMAX
        (void)sc; /* s holds the weights (the variant pass above) */
#else
#pragma unroll
        for (int mq = 0; mq < KVP_MQ; ++mq)
#pragma unroll
            for (int n = 0; n < KVP_NK; ++n)
#pragma unroll
                for (int e = 0; e < 4; ++e) /* masked: exp2(+inf) = inf -> 0 */
                    s[mq][n][e] = kva_rcp(1.0f + kva_exp2(-fmaf(s[mq][n][e], sc, p.sigmoid_bias)));
#endif
    }
}

/* ---------------------------------------------------------------------------------------------- */
/* K/V copy machinery shared by both mainloops (macros over the mainloop's locals: tid, ctx, p, ragged, ntiles,
   s_koff, s_voff, s_pidx_a, kv_s).                                                                   */

/* K/V byte offsets of tile T's rows into ring slot T % S (threads < TKV, one row each; one bounds check per page
   index; an out-of-range page zero-fills the row and faults the item). The page-table entries come from
   KVP_IDX_PREFETCH: a 4-byte cp.async per row into the index ring, issued 2 S - 1 tiles ahead inside the
   commit group of an earlier K/V tile, so the lookup's latency never stalls the mainloop and no register
   holds it. Each thread reads back only the entry it copied itself (after its own wait_group). */
#define KVP_IDX_PREFETCH(T)                                                                            \
    do {                                                                                               \
        if (tid < KVP_TKV && !ragged) {                                                                \
            const int j_ = ctx->kv0 + (T) * KVP_TKV + tid;                                             \
            const bool ok_ = (T) < ntiles && j_ < ctx->kv1;                                            \
            const int e_ = ok_ ? (int)kva_fastdiv((unsigned)j_, p.ps_mul, p.ps_shift) : 0;             \
            kvp_cp_async4(s_pidx_a + (unsigned)((((T) % KVP_RING) * KVP_TKV + tid) * 4), ctx->pidx + e_, \
                          ok_ ? 4u : 0u);                                                              \
        }                                                                                              \
    } while (0)
#define KVP_OFFS_STORE(T, PG)                                                                          \
    do {                                                                                               \
        if (tid < KVP_TKV) {                                                                           \
            const int j_ = ctx->kv0 + (T) * KVP_TKV + tid;                                             \
            const int pg_ = (PG);                                                                      \
            long long ko_ = -1, vo_ = -1;                                                              \
            if ((T) < ntiles && j_ < ctx->kv1) {                                                       \
                if (ragged) {                                                                          \
                    const long long tok_ = ctx->tok0 + j_;                                             \
                    ko_ = tok_ * p.k_stride_token * KVP_ES;                                            \
                    vo_ = tok_ * p.v_stride_token * KVP_ES;                                            \
                } else if (KVP_NOCHK || (unsigned long long)(unsigned)pg_ < (unsigned long long)p.num_pages) { \
                    const int e_ = (int)kva_fastdiv((unsigned)j_, p.ps_mul, p.ps_shift);               \
                    const long long sl_ = (long long)(j_ - e_ * p.page_size);                          \
                    ko_ = ((long long)pg_ * p.k_stride_page + sl_ * p.k_stride_token) * KVP_ES;        \
                    vo_ = ((long long)pg_ * p.v_stride_page + sl_ * p.v_stride_token) * KVP_ES;        \
                } else { /* rare: record the key now, keep one flag for the item */                   \
                    atomicMax((unsigned long long*)&((kvk_status*)p.ws)->first_key,                    \
                              ~(((unsigned long long)(unsigned)ctx->req << 32) |                       \
                                (unsigned long long)(unsigned)pg_));                                   \
                    atomicOr(&((kvp_ctx*)ctx)->fault, 1); /* atomic: no racecheck hazard */           \
                }                                                                                      \
            }                                                                                          \
            s_koff[((T) % KVP_RING) * KVP_TKV + tid] = ko_;                                            \
            s_voff[((T) % KVP_RING) * KVP_TKV + tid] = vo_;                                            \
        }                                                                                              \
    } while (0)

/* cp.async of tile T's K (DOK) and / or V (DOV) rows into their slots (rows with offset -1 are zero-filled, nothing
   is read) */
#define KVP_ISSUE_KV(T, DOK, DOV)                                                                      \
    do {                                                                                               \
        if ((T) < ntiles) {                                                                            \
            const int sl_ = (T) % KVP_RING;                                                            \
            const char* const kb = ctx->kb;                                                            \
            const char* const vb = ctx->vb;                                                            \
            const unsigned kd_ = kv_s + (unsigned)KVP_KDST(T);                                         \
            const unsigned vd_ = kv_s + (unsigned)KVP_VDST(T);                                         \
            const int col_ = tid % KVP_CPR;                                                            \
            _Pragma("unroll") for (int u_ = 0; u_ < KVP_UK; ++u_) {                                   \
                const int row_ = tid / KVP_CPR + u_ * KVP_RSTEP;                                       \
                const unsigned dst_ = KVP_FP8 ? (unsigned)(row_ * KVP_RAWB + col_ * 16)                \
                                              : (unsigned)KVP_SOFF(row_, col_, KVP_TKV);               \
                if (DOK) {                                                                             \
                    const long long ko_ = s_koff[sl_ * KVP_TKV + row_];                                \
                    kva_cp_async16(kd_ + dst_, kb + (ko_ < 0 ? 0ll : ko_) + col_ * 16, ko_ < 0 ? 0u : 16u); \
                }                                                                                      \
                if (DOV) {                                                                             \
                    const long long vo_ = s_voff[sl_ * KVP_TKV + row_];                                \
                    kva_cp_async16(vd_ + dst_, vb + (vo_ < 0 ? 0ll : vo_) + col_ * 16, vo_ < 0 ? 0u : 16u); \
                }                                                                                      \
            }                                                                                          \
        }                                                                                              \
    } while (0)
#define KVP_ISSUE(T) KVP_ISSUE_KV(T, 1, 1)

#if KVP_ML == 0
/* ---------------------------------------------------------------------------------------------- */
/* The mma.sync mainloop. Contract (shared with any future mainloop, e.g. wgmma/TMA on sm_90a):
 *   entry:  row facts and context of the item written (not yet published), no cp.async in flight, shared
 *           memory free;
 *   exit:   after a barrier, the region holds for every KV warp slice w < WKV and tile row r < TQ the unnormalised
 *           O row (f32 [w][r][LD]), the running max m (log2 domain, -inf if nothing was seen) and the sum d
 *           (softmax) at [w][r]; no cp.async in flight. A thread that met an out-of-range page has folded
 *           ~((req << 32) | page) into the status word's first_key (atomicMax) and set the context's fault flag,
 *           which the caller reads after its next barrier. */

KVA_DEV void KVP_FN(kvp_mainloop_mma)(const kvk_attn_params p, const kvk_work_item item, char* smem KVP_VP_DECL) {
    const int tid = threadIdx.x;
    const int lane = tid & 31;
    const int warp = tid >> 5;
    const int wq = warp / KVP_WKV;   /* row block of this warp */
    const int wkv = warp % KVP_WKV;  /* key slice of this warp */
    const int wr0 = wq * KVP_RW;     /* first tile row of this warp */
    const unsigned sbase = kva_smem_addr(smem);
    const unsigned q_s = sbase;
    const unsigned kv_s = sbase + KVP_OFF_KV;
    long long* const s_koff = (long long*)(smem + KVP_OFF_OFFS); /* [S][TKV] */
    long long* const s_voff = s_koff + KVP_S * KVP_TKV;
    const int* const s_pidx = (const int*)(s_voff + KVP_S * KVP_TKV); /* [S][TKV] prefetched page indices */
    const unsigned s_pidx_a = kva_smem_addr(s_pidx);
    const int* const s_qpos = KVP_S_QPOS(smem);

    const unsigned flags = p.flags;
    const bool ragged = (flags & KVK_FLAG_RAGGED) != 0;
    const kvp_ctx* const ctx = KVP_S_CTX(smem);
    const int ntiles = item.kv_end > item.kv_start ? (item.kv_end - item.kv_start + KVP_TKV - 1) / KVP_TKV : 0;

    /* ---- prologue ---- */
    __syncthreads(); /* row facts and the item context visible */
    {
        int pg[KVP_S]; /* the first S tiles' entries directly (loads in flight together) */
#pragma unroll
        for (int T = 0; T < KVP_S; ++T) {
            pg[T] = 0;
            const int j_ = ctx->kv0 + T * KVP_TKV + tid;
            if (tid < KVP_TKV && !ragged && T < ntiles && j_ < ctx->kv1)
                pg[T] = kva_ldg_i32(ctx->pidx + (int)kva_fastdiv((unsigned)j_, p.ps_mul, p.ps_shift));
        }
#pragma unroll
        for (int T = 0; T < KVP_S; ++T) KVP_OFFS_STORE(T, pg[T]);
    }
    if (lane == 0) { /* this warp's rows: any valid one, and the q_pos range of the valid ones */
        kvp_ctx* const c = KVP_S_CTX(smem);
        const int act = wr0 < item.rows;
        const int wlast = (wr0 + KVP_RW < item.rows ? wr0 + KVP_RW : item.rows) - 1;
        c->wact[warp] = act;
        c->wq[warp][0] = s_qpos[act ? wr0 : 0];
        c->wq[warp][1] = s_qpos[act ? wlast : 0];
    }
    __syncthreads(); /* offsets and warp bounds visible */
    KVP_FN(kvp_load_q)(p, item, smem, kva_smem_addr(smem), KVP_TID, KVP_NT);
#pragma unroll
    for (int T = KVP_S; T < 2 * KVP_S - 1; ++T) KVP_IDX_PREFETCH(T); /* consumed in iterations 0 .. S-2 */
    kva_cp_async_commit();
#pragma unroll
    for (int T = 0; T < KVP_S - 1; ++T) {
        KVP_ISSUE(T);
        kva_cp_async_commit();
    }
    KVA_CP_ASYNC_WAIT(KVP_S - 1); /* the Q group */
    __syncthreads();

    /* lane constants of the ldmatrix addresses: rows of 16-bit shared tiles are swizzled in 16-byte chunks,
       chunk c of row r stored at c ^ (r & 7); every ldmatrix row block starts at a multiple of 8 */
    const int lx = lane & 7;
    const int a_xor = (lane >> 4) ^ lx;        /* Q (A) and V (B, trans): chunk 2k + (lane >> 4) */
    const int k_xor = ((lane >> 3) & 1) ^ lx;  /* K (B): chunk 2k + ((lane >> 3) & 1) */
    const int a_row = lane & 15;
    const int k_row = lx + ((lane >> 4) << 3);
    const int v_row = lx + (((lane >> 3) & 1) << 3);
    const int qr = lane >> 2;        /* accumulator row (and row + 8) */
    const int qc = (lane & 3) * 2;   /* accumulator column pair */

    /* loop-invariant scalars are read where used (kernel parameters: constant bank; item bounds: shared memory
       after each barrier) so that the 255-register budget goes to the O and S accumulators */
    const bool causal = (flags & KVK_FLAG_CAUSAL) != 0;
    const bool window = (flags & KVK_FLAG_WINDOW) != 0;
    const float neg_inf = KVA_NEG_INF;

#if KVP_QIR
    unsigned qf[KVP_MQ][KVP_KS][4];
#pragma unroll
    for (int mq = 0; mq < KVP_MQ; ++mq)
#pragma unroll
        for (int ks = 0; ks < KVP_KS; ++ks)
            kvp_ldsm4(q_s + (unsigned)((wr0 + mq * 16 + a_row) * KVP_ROWB + (((2 * ks) ^ a_xor) << 4)), qf[mq][ks]);
#endif

    float o[KVP_MQ][KVP_ND][4];
    float m[KVP_MQ][2], d[KVP_MQ][2];
#pragma unroll
    for (int mq = 0; mq < KVP_MQ; ++mq) {
#pragma unroll
        for (int n = 0; n < KVP_ND; ++n)
#pragma unroll
            for (int e = 0; e < 4; ++e) o[mq][n][e] = 0.0f;
        m[mq][0] = m[mq][1] = neg_inf;
        d[mq][0] = d[mq][1] = 0.0f;
    }

    /* ---- mainloop ---- */
    for (int t = 0; t < ntiles; ++t) {
        KVA_CP_ASYNC_WAIT(KVP_S - 2);
        __syncthreads(); /* tile t landed; every warp is done with tile t - 1's stage and offsets */
        KVP_ISSUE(t + KVP_S - 1);
        KVP_IDX_PREFETCH(t + 2 * KVP_S - 1); /* lands with tile t + S - 1, read in iteration t + S - 1 */
        kva_cp_async_commit();

        const int st = t % KVP_S;
        const int j0 = ctx->kv0 + t * KVP_TKV;
        unsigned k_s = kv_s + (unsigned)(st * KVP_STAGE);
        unsigned v_s = k_s + (unsigned)(KVP_STAGE / 2);
#if KVP_FP8
        KVP_FN(kvp_prep_tile)(k_s, v_s, sbase + KVP_OFF_CONV, sbase + KVP_OFF_CONV + KVP_TKV * KVP_ROWB, j0, smem);
        k_s = sbase + KVP_OFF_CONV;
        v_s = k_s + (unsigned)(KVP_TKV * KVP_ROWB);
        __syncthreads();
#elif KVA_ROPE
        KVP_FN(kvp_prep_tile)(k_s, v_s, 0u, 0u, j0, smem);
        __syncthreads();
#endif

        const int kv1 = ctx->kv1;
        const int wqmin = ctx->wq[warp][0];
        const int wqmax = ctx->wq[warp][1];
        /* this warp's keys of the tile in sub-steps of KVP_SK (one online-softmax step each) */
#if KVP_NSK > 1
#pragma unroll 1
#endif
        for (int sk = 0; sk < KVP_NSK; ++sk) {
            const int jw0 = j0 + wkv * KVP_KW + sk * KVP_SK; /* first key of this sub-step */
            const int jw1 = jw0 + KVP_SK - 1;
            bool skip = !ctx->wact[warp] || jw0 >= kv1;
            if (causal && jw0 > wqmax) skip = true;
            if (window && (long long)jw1 < (long long)wqmin - p.window_left) skip = true;
            if (skip) continue; /* warp-uniform; no barrier in the sub-step loop */

            /* ---- S = Q K^T ---- */
            float s[KVP_MQ][KVP_NK][4];
#pragma unroll
            for (int mq = 0; mq < KVP_MQ; ++mq)
#pragma unroll
                for (int n = 0; n < KVP_NK; ++n)
#pragma unroll
                    for (int e = 0; e < 4; ++e) s[mq][n][e] = 0.0f;
            const unsigned k_w = k_s + (unsigned)((wkv * KVP_KW + sk * KVP_SK + k_row) * KVP_ROWB);
#if KVP_QIR
#pragma unroll
#else
#pragma unroll 2
#endif
            for (int ks = 0; ks < KVP_KS; ++ks) {
#if KVP_QIR
#define KVP_QA(mq) qf[mq][ks]
#else
                unsigned qa[KVP_MQ][4];
#pragma unroll
                for (int mq = 0; mq < KVP_MQ; ++mq)
                    kvp_ldsm4(q_s + (unsigned)((wr0 + mq * 16 + a_row) * KVP_ROWB + (((2 * ks) ^ a_xor) << 4)), qa[mq]);
#define KVP_QA(mq) qa[mq]
#endif
#pragma unroll
                for (int n2 = 0; n2 < KVP_NK / 2; ++n2) {
                    unsigned b[4];
                    kvp_ldsm4(k_w + (unsigned)(n2 * 16 * KVP_ROWB + (((2 * ks) ^ k_xor) << 4)), b);
#pragma unroll
                    for (int mq = 0; mq < KVP_MQ; ++mq) {
                        kvp_mma(s[mq][2 * n2], KVP_QA(mq), b[0], b[1], KVP_CT);
                        kvp_mma(s[mq][2 * n2 + 1], KVP_QA(mq), b[2], b[3], KVP_CT);
                    }
                }
#undef KVP_QA
            }

            const float ro0[KVP_MQ][2] = {}; /* (ALiBi's bias is added per element here) */
            KVP_FN(kvp_scores)(p, s, o, m, d, jw0, kv1, wr0, wqmin, wqmax, qr, qc, smem, nullptr, false, ro0 KVP_VP_ARG);

            /* ---- O += P V ---- */
            const unsigned v_w = v_s + (unsigned)((wkv * KVP_KW + sk * KVP_SK + v_row) * KVP_ROWB);
#pragma unroll
            for (int kk = 0; kk < KVP_SK / 16; ++kk) {
                unsigned pa[KVP_MQ][4];
#pragma unroll
                for (int mq = 0; mq < KVP_MQ; ++mq) {
                    pa[mq][0] = kvp_pack2(s[mq][2 * kk][0], s[mq][2 * kk][1], KVP_CT);
                    pa[mq][1] = kvp_pack2(s[mq][2 * kk][2], s[mq][2 * kk][3], KVP_CT);
                    pa[mq][2] = kvp_pack2(s[mq][2 * kk + 1][0], s[mq][2 * kk + 1][1], KVP_CT);
                    pa[mq][3] = kvp_pack2(s[mq][2 * kk + 1][2], s[mq][2 * kk + 1][3], KVP_CT);
                }
#pragma unroll
                for (int n2 = 0; n2 < KVP_ND / 2; ++n2) {
                    unsigned b[4];
                    kvp_ldsm4_t(v_w + (unsigned)(kk * 16 * KVP_ROWB + (((2 * n2) ^ a_xor) << 4)), b);
#pragma unroll
                    for (int mq = 0; mq < KVP_MQ; ++mq) {
                        kvp_mma(o[mq][2 * n2], pa[mq], b[0], b[1], KVP_CT);
                        kvp_mma(o[mq][2 * n2 + 1], pa[mq], b[2], b[3], KVP_CT);
                    }
                }
            }
        }
        /* offsets of tile t + S into slot t % S (its last reader was KVP_ISSUE(t), an iteration ago; the next
           comes after a barrier); its page entries were prefetched with tile t's group, complete since this
           iteration's wait */
        KVP_OFFS_STORE(t + KVP_S, s_pidx[(t % KVP_S) * KVP_TKV + tid]);
    }

    /* ---- hand the state to the epilogue ---- */
    KVA_CP_ASYNC_WAIT(0);
    __syncthreads(); /* nobody reads Q or a stage any more: the region becomes the staging area */
    {
        float* const s_o = (float*)smem;
        float* const s_m = s_o + KVP_WKV * KVA_TQ * KVP_LD;
        float* const s_d = s_m + KVP_WKV * KVA_TQ;
#pragma unroll
        for (int mq = 0; mq < KVP_MQ; ++mq)
#pragma unroll
            for (int h = 0; h < 2; ++h) {
                const int row = wr0 + mq * 16 + qr + 8 * h;
                float dd = d[mq][h];
                dd += __shfl_xor_sync(KVP_FULL, dd, 1);
                dd += __shfl_xor_sync(KVP_FULL, dd, 2);
                if ((lane & 3) == 0) {
                    s_m[wkv * KVA_TQ + row] = m[mq][h];
                    s_d[wkv * KVA_TQ + row] = dd;
                }
                float* const dst = s_o + (wkv * KVA_TQ + row) * KVP_LD + qc;
#pragma unroll
                for (int n = 0; n < KVP_ND; ++n) *(float2*)(dst + n * 8) = make_float2(o[mq][n][2 * h], o[mq][n][2 * h + 1]);
            }
    }
}

#else /* KVP_ML == 1 */
/* The Hopper mainloop (sm_90a; KVP_ML == 1): a producer warpgroup and two consumer warpgroups, each walking the
 * worker's items on its own and meeting on mbarriers (kvp_wg_producer, kvp_wg_consumer below; docs/kernels/prefill.md).
 * Compiled only for sm_90a; the host never selects it elsewhere. The warpgroup MMA of each shape and dtype: */

KVA_DEV void KVP_FN(kvp_wg_s)(float* d, unsigned long long da, unsigned long long db, int acc) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
#if KVP_TKV == 128 && KVA_KT == KVK_BF16
    kvw_ss_n128_bf16(d, da, db, acc);
#elif KVP_TKV == 128
    kvw_ss_n128_f16(d, da, db, acc);
#elif KVA_KT == KVK_BF16
    kvw_ss_n64_bf16(d, da, db, acc);
#else
    kvw_ss_n64_f16(d, da, db, acc);
#endif
#else
    (void)d, (void)da, (void)db, (void)acc;
#endif
}
KVA_DEV void KVP_FN(kvp_wg_o)(float* d, const unsigned* a, unsigned long long db, int acc) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
#if KVP_D == 64 && KVA_KT == KVK_BF16
    kvw_rs_n64_bf16(d, a, db, acc);
#elif KVP_D == 64
    kvw_rs_n64_f16(d, a, db, acc);
#elif KVP_D == 128 && KVA_KT == KVK_BF16
    kvw_rs_n128_bf16(d, a, db, acc);
#elif KVP_D == 128
    kvw_rs_n128_f16(d, a, db, acc);
#elif KVA_KT == KVK_BF16
    kvw_rs_n256_bf16(d, a, db, acc);
#else
    kvw_rs_n256_f16(d, a, db, acc);
#endif
#else
    (void)d, (void)a, (void)db, (void)acc;
#endif
}

/* mbarriers (KVP_OFF_BAR): full_k[2] (+0), full_v[2] (+16): 128 producer arrivals (cp.async.mbarrier.arrive: the
   thread's copies landed); empty_k[2] (+32), empty_v[2] (+48): 256 consumer arrivals (their MMAs finished reading the
   slot). A tile's out-of-range page needs no word of its own: the producer's request-wide check (Q slot fault word)
   covers every page an item can reach, and the tile's rows on it are zero-filled. */
#define KVP_BAR_FULL_K(c) (bar + 8u * ((c) & 1u))
#define KVP_BAR_FULL_V(c) (bar + 16u + 8u * ((c) & 1u))
#define KVP_BAR_EMPTY_K(c) (bar + 32u + 8u * ((c) & 1u))
#define KVP_BAR_EMPTY_V(c) (bar + 48u + 8u * ((c) & 1u))
#define KVP_PHASE(c) (((c) >> 1) & 1u)
/* Q slots (KVP_OFF_QBAR): full[2] (+0): 128 producer arrivals (their Q copies landed) + 1 (producer thread 0, after
   the row facts and the request's fault word); empty[2] (+16): 256 consumer arrivals (done with the slot's Q and row
   facts); the request fault word of each slot (+32) */
#define KVP_BAR_FULL_Q(c) (qbar + 8u * ((c) & 1u))
#define KVP_BAR_EMPTY_Q(c) (qbar + 16u + 8u * ((c) & 1u))

/* The producer warpgroup (threads 0-127): for every item of the worker (running ahead into the next item while the
 * consumers finish one: only the empty barriers hold it back), first the item's Q slot (row facts, the request-wide
 * page check, Q; full / empty Q barriers), then every K/V tile: the byte offsets of its rows (one row per thread,
 * page-table entry loaded a tile ahead, bounds-checked: a bad page zero-fills the row and folds the key into the
 * status word), then K into its slot once the consumers released it,
 * then V; each completes on its full barrier through cp.async.mbarrier.arrive. A consumer that waited on a full
 * barrier fences (fence.proxy.async) before its MMAs read the slot: the copies are generic-proxy writes.
 * Two copy paths, chosen per tile for the whole warpgroup by the barrier that publishes the offsets:
 * - fast (every row in range, no bad page, every offset below 2^36 bytes): 32-bit offsets in 16-byte units, stored
 *   so that a thread's rows are adjacent (vector loads), one multiply-add and one copy per 16-byte chunk;
 * - general: 64-bit offsets, zero-fill for rows past the range or on a bad page. */
KVA_DEV void KVP_FN(kvp_wg_producer)(const kvk_attn_params p, const kvk_tma* tm, char* smem) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
    const int ptid = threadIdx.x;
    const unsigned sbase = kva_smem_addr(smem);
    const unsigned kv_s = sbase + KVP_OFF_KV;
    const unsigned bar = sbase + KVP_OFF_BAR;
    long long* const s_koff = (long long*)(smem + KVP_OFF_OFFS); /* [2][TKV] */
    long long* const s_voff = s_koff + KVP_RING * KVP_TKV;
    unsigned* const s_off16 = (unsigned*)(s_voff + KVP_RING * KVP_TKV); /* [2 slots][K, V][TKV], rows transposed */
    const bool tma = (p.flags & KVK_FLAG_TMA) != 0; /* K/V through tensor maps (the host sets it) */
    const unsigned qbar = sbase + KVP_OFF_QBAR;
    const bool ragged = (p.flags & KVK_FLAG_RAGGED) != 0;
    unsigned kc = 0;         /* K / V tiles copied by this CTA so far (K and V of a tile share the count) */
    unsigned qn = 0;         /* items (Q slots) filled so far */
    /* the last request checked and its result, request * 2 + bad (page tables do not change in a run), lives at
       qbar + 44 (set to -1 before the roles split; thread 0 updates it), not in a register across the tile loop */
    static_assert(KVA_TQ == 128 && !KVP_QCONV, "Hopper producer: one row per thread, Q copied as is");
    /* copy geometry: thread ptid copies 16-byte chunk col of rows r0 + u * PRS (u < PUK); PRS is a multiple of 8, so
       the swizzled chunk position is the same for all of them and the destination advances by PRS rows */
#define KVP_PRS (128 / KVP_CPR)
#define KVP_PUK (KVP_TKV / KVP_PRS)
    static_assert(KVP_PUK % 4 == 0 && KVP_PRS % 8 == 0, "producer copy geometry");
    const int r0 = ptid / KVP_CPR;
    const int col = ptid % KVP_CPR;
    const unsigned dst0 = (unsigned)KVP_SOFF(r0, col, KVP_TKV);
    /* the fast table keeps row r at (r % PRS) * PUK + r / PRS: this thread's PUK rows are adjacent */
    const int own16 = (ptid % KVP_PRS) * KVP_PUK + ptid / KVP_PRS;
    const int it_begin = ((const kvk_i32*)(p.ws + p.off_worker_indptr))[blockIdx.x];
    for (int it = it_begin;
         it < *(volatile const kvk_i32*)(kvp_at(p.ws, p.off_worker_indptr) + 4ll * (blockIdx.x + 1)); ++it) {
        const kvk_work_item item = *(const kvk_work_item*)kvp_at(p.ws, p.off_items + (long long)sizeof(kvk_work_item) * it);
        const kvk_request rq = *(const kvk_request*)kvp_at(p.ws, p.off_requests + (long long)sizeof(kvk_request) * item.req);
        const int ntiles = item.kv_end > item.kv_start ? (item.kv_end - item.kv_start + KVP_TKV - 1) / KVP_TKV : 0;
        const char* const kb = (const char*)p.k + (long long)item.kv_head * p.k_stride_head * KVP_ES;
        const char* const vb = (const char*)p.v + (long long)item.kv_head * p.v_stride_head * KVP_ES;
        const kvk_i32* const pidx = p.indices + rq.kv_start;
        /* page-table entry of this thread's row of tile T (0 past the range or when ragged) */
#define KVP_PAGE_OF(T)                                                                                  \
    (!ragged && (T) < ntiles && item.kv_start + (T) * KVP_TKV + ptid < item.kv_end                       \
         ? kva_ldg_i32(pidx + (int)kva_fastdiv((unsigned)(item.kv_start + (T) * KVP_TKV + ptid), p.ps_mul, p.ps_shift)) \
         : 0)
        int pg_next = KVP_PAGE_OF(0);
        { /* the item's row facts, request-wide page check and Q into Q slot (item count & 1), once the consumers are
             done with the item that used it last: this runs while they compute the previous item */
            const unsigned qs = qn & 1u;
            char* const rsm = smem + (qs ? KVP_ROWS2 : 0);
            kvp_mbar_wait(KVP_BAR_EMPTY_Q(qn), KVP_PHASE(qn) ^ 1u);
            if (ptid == 0) { /* the item's facts for the consumers (KVP_S_ITEM), released by thread 0's arrival on
                                the slot's full barrier below: they read shared memory after that barrier instead
                                of the plan in global memory at every item boundary */
                KVP_S_ITEM(rsm)[0] = item.kv_start;
                KVP_S_ITEM(rsm)[1] = item.kv_end;
                KVP_S_ITEM(rsm)[2] = item.rows;
                KVP_S_ITEM(rsm)[3] = item.partial;
            }
            KVP_FN(kvp_row_fact)(p, item, rq, rsm, ptid);
            /* the request-wide page check (docs: Faults), once per run of items of one request (the locality order
               keeps a request's items together) */
            kvp_named_sync(2u, 128u); /* thread 0's last update of the cache before anyone reads it */
            const unsigned chk = (unsigned)kvp_ld_shared_vol(qbar + 44u);
            const bool check = !ragged && rq.kv_len > 0 && (unsigned)item.req != chk >> 1;
            int qbad = check ? KVP_FN(kvp_request_bad)(p, rq, item.req, ptid, 128) : 0;
            qbad = kvp_named_sync_or(2, 128, qbad); /* also publishes the row facts to the producer warpgroup */
            if (check && ptid == 0) kvp_st_shared_vol(qbar + 44u, (int)((unsigned)item.req * 2u + (unsigned)qbad));
            else if (!ragged && rq.kv_len > 0) qbad = (int)(chk & 1u);
            KVP_FN(kvp_load_q)(p, item, rsm, sbase + (qs ? (unsigned)KVP_OFF_Q2 : 0u), ptid, 128);
            kvp_cp_async_mbar_arrive(KVP_BAR_FULL_Q(qn));
            if (ptid == 0) { /* per consumer warp the q positions of its first and last valid row (KVP_S_WQ), and the
                                fault word, released by one more arrival */
                const int* const s_qpos = KVP_S_QPOS(rsm);
#pragma unroll 1
                for (int w = 0; w < 8; ++w) {
                    const int a = w * 16 < item.rows;
                    const int wl = (w * 16 + 16 < item.rows ? w * 16 + 16 : item.rows) - 1;
                    KVP_S_WQ(rsm)[2 * w] = s_qpos[a ? w * 16 : 0];
                    KVP_S_WQ(rsm)[2 * w + 1] = s_qpos[a ? wl : 0];
                }
                kvp_st_shared_vol(qbar + 32u + 4u * qs, qbad);
                kvp_mbar_arrive(KVP_BAR_FULL_Q(qn));
            }
            ++qn;
        }
        for (int T = 0; T < ntiles; ++T) {
            const int pg = pg_next;
            const int j = item.kv_start + T * KVP_TKV + ptid;
            pg_next = KVP_PAGE_OF(T + 1); /* loaded a tile ahead */
            long long ko = -1, vo = -1; /* -1: zero-fill (past the range, or an out-of-range page) */
            if (j < item.kv_end) {
                if (ragged) {
                    const long long tok = (long long)rq.kv_start + j;
                    ko = tok * p.k_stride_token * KVP_ES;
                    vo = tok * p.v_stride_token * KVP_ES;
                } else if (KVP_NOCHK || (unsigned long long)(unsigned)pg < (unsigned long long)p.num_pages) {
                    const int e = (int)kva_fastdiv((unsigned)j, p.ps_mul, p.ps_shift);
                    const long long sl = (long long)(j - e * p.page_size);
                    ko = ((long long)pg * p.k_stride_page + sl * p.k_stride_token) * KVP_ES;
                    vo = ((long long)pg * p.v_stride_page + sl * p.v_stride_token) * KVP_ES;
                } else {
                    atomicMax((unsigned long long*)&((kvk_status*)p.ws)->first_key,
                              ~(((unsigned long long)(unsigned)item.req << 32) | (unsigned long long)(unsigned)pg));
                }
            }
            /* ring slot by the CTA's running tile count, not T: items restart T at 0, and the only barrier between
               two tiles' offsets is the one below */
            const unsigned os = kc & 1u;
            const bool fast = ko >= 0 && vo >= 0 && (unsigned long long)(ko | vo) < (1ull << 36);
            s_koff[os * KVP_TKV + ptid] = ko;
            s_voff[os * KVP_TKV + ptid] = vo;
            s_off16[(os * 2 + 0) * KVP_TKV + own16] = (unsigned)(ko >> 4);
            s_off16[(os * 2 + 1) * KVP_TKV + own16] = (unsigned)(vo >> 4);
            /* this tile's offsets visible to the producer warpgroup; whether any row needs the general path */
            const int slow = kvp_named_sync_or(2, 128, !fast);
            /* TMA for every fast tile (the host sets KVK_FLAG_TMA for 16-bit K/V: ragged, or paged at page sizes 16,
               32, 64, 128 and multiples of 128); paged tiles also start on a page boundary (or, for pages
               longer than a tile, on a tile boundary inside the page): then each box is one page's rows. Uniform
               over the warpgroup: every thread sees the same slow, T and item. */
            const int pr = p.page_size < KVP_TKV ? p.page_size : KVP_TKV; /* a power of two when tma && !ragged */
            const bool use_tma = tma && !slow && (ragged || ((item.kv_start + T * KVP_TKV) & (pr - 1)) == 0);
#pragma unroll
            for (int mtx = 0; mtx < 2; ++mtx) {
                const unsigned cnt = kc;
                kvp_mbar_wait(mtx == 0 ? KVP_BAR_EMPTY_K(cnt) : KVP_BAR_EMPTY_V(cnt), KVP_PHASE(cnt) ^ 1u);
                const unsigned dst = kv_s + (unsigned)(mtx == 0 ? KVP_KDST(cnt) : KVP_VDST(cnt)) + dst0;
                const char* const base = (mtx == 0 ? kb : vb) + col * 16;
                const unsigned fullb = mtx == 0 ? KVP_BAR_FULL_K(cnt) : KVP_BAR_FULL_V(cnt);
                if (use_tma && !ragged) {
                    /* paged: thread 0 announces the tile's bytes; the thread of each box's first row (it holds the
                       page-table entry of its row, checked above) copies its page's rows of every column block */
                    if (ptid == 0) kvp_mbar_arrive_expect_tx(fullb, (unsigned)(KVP_TKV * KVP_D * 2));
                    if ((ptid & (pr - 1)) == 0) {
                        constexpr int CB = KVP_D / 64;
                        const void* const map = mtx == 0 ? (const void*)tm->k : (const void*)tm->v;
                        const unsigned rdst = kv_s + (unsigned)(mtx == 0 ? KVP_KDST(cnt) : KVP_VDST(cnt)) +
                                              (unsigned)(ptid * 128);
                        const int e = (int)kva_fastdiv((unsigned)j, p.ps_mul, p.ps_shift);
                        const int sl = j - e * p.page_size; /* 0 unless pages are longer than a tile */
#pragma unroll
                        for (int c = 0; c < CB; ++c)
                            kvp_tma_load4(rdst + (unsigned)(c * KVP_TKV * 128), map, c * 64, sl, item.kv_head, pg, fullb);
                    }
                    if (ptid != 0) kvp_mbar_arrive(fullb);
                } else if (use_tma) {
                    /* ragged, one warp: lane 0 announces the tile's bytes, then lane c copies 64-column block c of
                       the tile's 128 rows */
                    if (ptid < 32) {
                        constexpr int CB = KVP_D / 64; /* 64-column blocks */
                        const void* const map = mtx == 0 ? (const void*)tm->k : (const void*)tm->v;
                        const unsigned slot = kv_s + (unsigned)(mtx == 0 ? KVP_KDST(cnt) : KVP_VDST(cnt));
                        if (ptid == 0) kvp_mbar_arrive_expect_tx(fullb, (unsigned)(KVP_TKV * KVP_D * 2));
                        __syncwarp();
                        /* (no proxy fence here: it would also wait for this warp's cp.async copies of a general-path
                           tile still in flight; the slot's earlier generic-proxy writes were ordered before the
                           consumers' reads by their fence, and those reads before this write by the empty barrier) */
                        if (ptid < CB)
                            kvp_tma_load3(slot + (unsigned)(ptid * KVP_TKV * 128), map, ptid * 64, item.kv_head,
                                          rq.kv_start + item.kv_start + T * KVP_TKV, fullb);
                    }
                    if (ptid != 0) kvp_mbar_arrive(fullb);
                } else if (KVP_EXP & 16) {
                } else if (!slow) {
                    unsigned long long b64 = (unsigned long long)base;
                    asm volatile("" : "+l"(b64)); /* computed once per tile, not once per copy */
                    const uint4* const o16 = (const uint4*)(s_off16 + (os * 2 + mtx) * KVP_TKV + r0 * KVP_PUK);
                    uint4 w[KVP_PUK / 4]; /* all offsets first: the copies' memory clobbers would order the loads */
#pragma unroll
                    for (int q = 0; q < KVP_PUK / 4; ++q) w[q] = o16[q];
#pragma unroll
                    for (int q = 0; q < KVP_PUK / 4; ++q) {
                        const unsigned ow[4] = {w[q].x, w[q].y, w[q].z, w[q].w};
#pragma unroll
                        for (int e = 0; e < 4; ++e)
                            kva_cp_async16_full(dst + (unsigned)((q * 4 + e) * KVP_PRS * 128), (const void*)(b64 + 16ull * ow[e]));
                    }
                } else {
                    const long long* const offs = (mtx == 0 ? s_koff : s_voff) + os * KVP_TKV + r0;
#pragma unroll
                    for (int u = 0; u < KVP_PUK; ++u) {
                        const long long off = offs[u * KVP_PRS];
                        kva_cp_async16(dst + (unsigned)(u * KVP_PRS * 128), base + (off < 0 ? 0ll : off), off < 0 ? 0u : 16u);
                    }
                }
                /* one arrival per thread once its copies have landed (TMA tiles: arrived above) */
                if (!use_tma) kvp_cp_async_mbar_arrive(fullb);
            }
            ++kc;
        }
    }
#undef KVP_PAGE_OF
#undef KVP_PRS
#undef KVP_PUK
#else
    (void)p, (void)smem; /* not an sm_90a build: never launched (the host selects it on sm_90 only) */
#endif
}

/* The epilogue of one item, straight from a consumer thread's accumulators: normalise, v_scale, o + lse or the
   partial slot (faulted: 0 / -inf). The thread owns rows wr0 + qr (+ 8) and columns n * 8 + qc (+ 1) of O. rsm: the
   item's row facts; fault: the shared address of its Q slot's fault word. */
KVA_DEV void KVP_FN(kvp_wg_epilogue)(const kvk_attn_params p, const float (&o)[1][KVP_ND][4], const float (&m)[1][2],
                                     const float (&d)[1][2], const char* rsm, const int rows, const int partial,
                                     const unsigned fault, const int wr0, const int ctid) {
    /* (the slot's fault word stays until this item releases the slot) */
    const int faulted = kvp_ld_shared_vol(fault);
    if (faulted && ctid == 0) atomicAdd(&((kvk_status*)p.ws)->count, 1u);
    const bool sigmoid = (p.flags & KVK_FLAG_SIGMOID) != 0;
    const bool to_partial = partial >= 0;
    const float vs = p.v_scale * KVP_KFIX;
    const int* const s_qi = KVP_S_QI(rsm);
    const int* const s_qh = KVP_S_QH(rsm);
    const int qr = (int)(kvp_laneid() >> 2), qc = (int)(kvp_laneid() & 3u) * 2;
#pragma unroll
    for (int h = 0; h < 2; ++h) {
        const int row = wr0 + qr + 8 * h;
        float dd = d[0][h];
        dd += __shfl_xor_sync(KVP_FULL, dd, 1);
        dd += __shfl_xor_sync(KVP_FULL, dd, 2);
        if (row >= rows) continue;
        float scale, lse;
        kvp_row_norm(m[0][h], dd, vs, sigmoid, faulted, to_partial, &scale, &lse);
        if (to_partial) {
            /* (slot rows in 32 bits: the workspace holds slots x tile_q x D floats) */
            const unsigned prow = (unsigned)partial * (unsigned)p.tile_q + (unsigned)row;
            float* const dst = (float*)(p.ws + p.off_partial_o) + (unsigned long long)prow * KVP_D + qc;
#pragma unroll
            for (int n = 0; n < KVP_ND; ++n)
                *(float2*)(dst + n * 8) = make_float2(o[0][n][2 * h] * scale, o[0][n][2 * h + 1] * scale);
            if ((ctid & 3) == 0) ((float*)(p.ws + p.off_partial_lse))[prow] = lse;
        } else {
            const long long qi = s_qi[row], qh = s_qh[row];
            const long long off = qi * p.o_stride_row + qh * p.o_stride_head + qc;
#pragma unroll
            for (int n = 0; n < KVP_ND; ++n) {
#if KVA_OT == KVK_F32
                *(float2*)((float*)p.o + off + n * 8) = make_float2(o[0][n][2 * h] * scale, o[0][n][2 * h + 1] * scale);
#else
                *(unsigned*)((unsigned short*)p.o + off + n * 8) =
                    kvp_pack2(o[0][n][2 * h] * scale, o[0][n][2 * h + 1] * scale, KVA_OT);
#endif
            }
            if ((ctid & 3) == 0 && p.lse) p.lse[qi * p.lse_stride_row + qh * p.lse_stride_head] = lse;
        }
    }
}

/* The two consumer warpgroups (threads 128-383): per item, wait for its Q slot (filled by the producer); then per
 * tile t: S_{t+1} = Q K_{t+1}^T and O += P_t V_t issued together, the mask / softmax of S_{t+1} while the PV MMA
 * runs, O rescaled; K and V slots released on their empty barriers as soon as their MMA finished. Then the
 * epilogue straight from the accumulators (normalise, v_scale, o + lse or the partial slot; faulted: 0 / -inf), and
 * the Q slot released. */
KVA_DEV void KVP_FN(kvp_wg_consumer)(const kvk_attn_params p, char* smem) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
    const int ctid = KVP_TID;
    const int warp = ctid >> 5;
    const int wg = warp >> 2;        /* consumer warpgroup: rows wg * 64 .. + 63 */
    const int wr0 = warp * 16;       /* first tile row of this warp */
    /* accumulator row (and row + 8) and column pair: re-read from %laneid where used (ptxas would rather spill
       them than recompute them under the 224-register budget) */
#define KVP_QR() ((int)(kvp_laneid() >> 2))
#define KVP_QC() ((int)(kvp_laneid() & 3u) * 2)
    const unsigned sbase = kva_smem_addr(smem);
    const unsigned kv_s = sbase + KVP_OFF_KV;
    const unsigned bar = sbase + KVP_OFF_BAR;
    const unsigned q_wg = sbase + (unsigned)(wg * 64 * 128); /* this warpgroup's rows in each column block of Q */
    const unsigned qbar = sbase + KVP_OFF_QBAR;
    unsigned kc = 0, vc = 0; /* K / V tiles consumed by this CTA so far */
    unsigned qn = 0;         /* items (Q slots) consumed so far */
    if (!(KVP_EXP & 1) && wg == 1) kvp_named_arrive(4u, KVP_NT); /* warpgroup 0 issues first */
    const int it_begin = ((const kvk_i32*)(p.ws + p.off_worker_indptr))[blockIdx.x];
    /* the worker's end: from shared memory (qbar + 40, written before the roles split), so the loop test costs no
       global load per item */
#define KVP_C_IT_END()                                                                                  \
    ((KVP_EXP & 128) ? *(volatile const kvk_i32*)(kvp_at(p.ws, p.off_worker_indptr) + 4ll * (blockIdx.x + 1)) \
                     : kvp_ld_shared_vol(qbar + 40u))
    for (int it = it_begin; it < KVP_C_IT_END(); ++it) {
        /* the producer filled the item's Q slot (Q, row facts, the item's facts, the request's fault word) while
           this CTA computed the previous item; the two consumer warpgroups do not wait for each other between
           items. KVP_EXP & 128: the item's facts from the plan in global memory, read before the wait (A/B). */
        kvk_work_item item;
        if (KVP_EXP & 128) item = *(const kvk_work_item*)kvp_at(p.ws, p.off_items + (long long)sizeof(kvk_work_item) * it);
        const unsigned qs = qn & 1u;
        const char* const rsm = smem + (qs ? KVP_ROWS2 : 0); /* the KVP_S_* row facts of this item */
        kvp_mbar_wait(KVP_BAR_FULL_Q(qn), KVP_PHASE(qn));
        kvp_fence_proxy_async(); /* the producer's Q copies (generic proxy) before the MMAs read them */
        if (!(KVP_EXP & 128)) {
            item.kv_start = KVP_S_ITEM(rsm)[0];
            item.kv_end = KVP_S_ITEM(rsm)[1];
        }

        const int ntiles = item.kv_end > item.kv_start ? (item.kv_end - item.kv_start + KVP_TKV - 1) / KVP_TKV : 0;
        const int kv0 = item.kv_start, kv1 = item.kv_end;
        /* this warp's q-position bounds, re-read per tile (KVP_S_WQ, volatile: not held in registers) */
        const unsigned wqa = kva_smem_addr(KVP_S_WQ(rsm) + 2 * warp);

        /* descriptor low words: this warpgroup's Q rows, K slot 0 (K-major), V slot 0 (MN-major) */
        const unsigned dq = kvp_wg_desc_lo(q_wg + (qs ? (unsigned)KVP_OFF_Q2 : 0u), 16u);
        const unsigned dk = kvp_wg_desc_lo(kv_s + (unsigned)KVP_KDST(0), 16u);
        const unsigned dv = kvp_wg_desc_lo(kv_s + (unsigned)KVP_VDST(0), (unsigned)(KVP_TKV * 128));
        float o[1][KVP_ND][4];
        float m[1][2], d[1][2], al[1][2];
#pragma unroll
        for (int n = 0; n < KVP_ND; ++n)
#pragma unroll
            for (int e = 0; e < 4; ++e) o[0][n][e] = 0.0f;
        m[0][0] = m[0][1] = KVA_NEG_INF;
        d[0][0] = d[0][1] = 0.0f;
        unsigned pa[KVP_TKV / 16][4]; /* P of the tile whose O += P V is next */
        /* ALiBi folded (KVA_ALIBI_FOLD instances, the flags and a nonzero q_scale agreeing): S accumulates onto
           ALiBi's per-key part; otherwise these instances start S at 0 and kvp_scores adds the bias per element */
        const bool abr = KVP_AB && (p.flags & (KVK_FLAG_ALIBI | KVK_FLAG_SOFTCAP | KVK_FLAG_SIGMOID)) == KVK_FLAG_ALIBI &&
                         p.q_scale * KVP_KFIX != 0.0f;

        /* No warpgroup skips a tile: the planner clipped the item's range to what its rows see (causal, window),
           keys a row cannot see are masked to P = 0 by kvp_scores, and a branch around the asynchronous MMAs
           makes ptxas serialise them (C7518). */
/* descriptors: the address field (bits 0-13, address / 16) of a slot's base descriptor plus the k-step's offset / 16
   (shared memory addresses stay below 256 KB, so the field never carries) */
#define KVP_WG_ISSUE_S(s)                                                                               \
    do { /* the first MMA overwrites s (no zeroing), or (KVP_AB) accumulates onto ALiBi's per-key part */ \
        if (KVP_AB) KVP_WG_ALIBI_INIT(s);                                                               \
        kvp_wg_fence();                                                                                 \
        const unsigned dk_ = dk + (kc & 1u) * (unsigned)((KVP_KDST(1) - KVP_KDST(0)) >> 4);            \
        _Pragma("unroll") for (int ks_ = 0; ks_ < KVP_KS; ++ks_) {                                     \
            const unsigned long long da_ =                                                              \
                kvp_wg_desc_sbo1k(dq + (unsigned)(((ks_ >> 2) * (KVA_TQ * 128) + (ks_ & 3) * 32) >> 4)); \
            const unsigned long long db_ =                                                              \
                kvp_wg_desc_sbo1k(dk_ + (unsigned)(((ks_ >> 2) * (KVP_TKV * 128) + (ks_ & 3) * 32) >> 4)); \
            KVP_FN(kvp_wg_s)(&s[0][0][0], da_, db_, ks_ > 0 || KVP_AB);                                \
        }                                                                                               \
        kvp_wg_commit();                                                                                \
    } while (0)
#define KVP_WG_ISSUE_PV()                                                                               \
    do {                                                                                                \
        _Pragma("unroll") for (int n_ = 0; n_ < KVP_ND; ++n_)                                          \
            _Pragma("unroll") for (int e_ = 0; e_ < 4; ++e_) kvp_reg_fence(o[0][n_][e_]);              \
        kvp_wg_fence();                                                                                 \
        const unsigned dv_ = dv + (vc & 1u) * (unsigned)((KVP_VDST(1) - KVP_VDST(0)) >> 4);            \
        _Pragma("unroll") for (int kk_ = 0; kk_ < KVP_TKV / 16; ++kk_)                                 \
            KVP_FN(kvp_wg_o)(&o[0][0][0], pa[kk_], kvp_wg_desc_sbo1k(dv_ + (unsigned)((kk_ * 16 * 128) >> 4)), 1); \
        kvp_wg_commit();                                                                                \
    } while (0)
#define KVP_WG_FENCE_PO()                                                                               \
    do {                                                                                                \
        _Pragma("unroll") for (int kk_ = 0; kk_ < KVP_TKV / 16; ++kk_)                                 \
            _Pragma("unroll") for (int e_ = 0; e_ < 4; ++e_) kvp_reg_fence_u(pa[kk_][e_]);             \
        _Pragma("unroll") for (int n_ = 0; n_ < KVP_ND; ++n_)                                          \
            _Pragma("unroll") for (int e_ = 0; e_ < 4; ++e_) kvp_reg_fence(o[0][n_][e_]);              \
    } while (0)
/* ALiBi folded (KVP_AB): the tile's S accumulates onto slope (j - j0) / q_scale, j0 its first key (0 unless abr), so
   kvp_scores adds one constant per row (slope log2(e) (j0 - q)) instead of a bias per element. The slope is re-read
   per tile (volatile): hoisted out of the tile loop, the 64 start values would not fit in registers. */
#define KVP_WG_ALIBI_INIT(s)                                                                            \
    do {                                                                                                \
        const float iq_ = abr ? kva_rcp(p.q_scale * KVP_KFIX) : 0.0f;                                   \
        _Pragma("unroll") for (int h_ = 0; h_ < 2; ++h_) {                                              \
            const float bs_ =                                                                           \
                __int_as_float(kvp_ld_shared_vol(kva_smem_addr(KVP_S_SLOPE(rsm) + wr0 + KVP_QR() + 8 * h_))) * iq_; \
            const float b0_ = bs_ * (float)KVP_QC();                                                    \
            _Pragma("unroll") for (int n_ = 0; n_ < KVP_NK; ++n_)                                      \
                _Pragma("unroll") for (int e_ = 0; e_ < 2; ++e_)                                       \
                    s[0][n_][2 * h_ + e_] = fmaf(bs_, (float)(n_ * 8 + e_), b0_);                       \
        }                                                                                               \
    } while (0)
#define KVP_WG_SCORES(T, s)                                                                             \
    do {                                                                                                \
        _Pragma("unroll") for (int n_ = 0; n_ < KVP_NK; ++n_)                                          \
            _Pragma("unroll") for (int e_ = 0; e_ < 4; ++e_) kvp_reg_fence(s[0][n_][e_]);              \
        al[0][0] = al[0][1] = 1.0f;                                                                     \
        float ro_[1][2] = {{0.0f, 0.0f}};                                                               \
        if (abr)                                                                                        \
            _Pragma("unroll") for (int h_ = 0; h_ < 2; ++h_) {                                          \
                const int r_ = wr0 + KVP_QR() + 8 * h_;                                                 \
                ro_[0][h_] = KVP_S_SLOPE(rsm)[r_] * KVA_LOG2E * (float)(kv0 + (T) * KVP_TKV - KVP_S_QPOS(rsm)[r_]); \
            }                                                                                           \
        if (!(KVP_EXP & 4))                                                                             \
            KVP_FN(kvp_scores)(p, s, o, m, d, kv0 + (T) * KVP_TKV, kv1, wr0, kvp_ld_shared_vol(wqa),           \
                               kvp_ld_shared_vol(wqa + 4u), KVP_QR(), KVP_QC(), rsm, al, abr, ro_);           \
    } while (0)
/* Ping-pong: the two warpgroups take turns issuing their MMAs (named barriers 4 and 5), so one's softmax runs
   while the other's MMAs keep the tensor cores busy */
#if KVP_EXP & 1
#define KVP_WG_TURN() ((void)0)
#define KVP_WG_PASS() ((void)0)
#else
#define KVP_WG_TURN() kvp_named_sync(4u + (unsigned)wg, KVP_NT)
#define KVP_WG_PASS() kvp_named_arrive(5u - (unsigned)wg, KVP_NT)
#endif
#define KVP_WG_PACK(s)                                                                                  \
    do {                                                                                                \
        _Pragma("unroll") for (int kk_ = 0; kk_ < KVP_TKV / 16; ++kk_) {                               \
            pa[kk_][0] = kvp_pack2(s[0][2 * kk_][0], s[0][2 * kk_][1], KVP_CT);                         \
            pa[kk_][1] = kvp_pack2(s[0][2 * kk_][2], s[0][2 * kk_][3], KVP_CT);                         \
            pa[kk_][2] = kvp_pack2(s[0][2 * kk_ + 1][0], s[0][2 * kk_ + 1][1], KVP_CT);                 \
            pa[kk_][3] = kvp_pack2(s[0][2 * kk_ + 1][2], s[0][2 * kk_ + 1][3], KVP_CT);                 \
        }                                                                                               \
    } while (0)

        if (ntiles > 0) { /* S_0 -> P_0 (O is zero: no rescale) */
            float s[1][KVP_NK][4];
            kvp_mbar_wait(KVP_BAR_FULL_K(kc), KVP_PHASE(kc));
            if (!(KVP_EXP & 32)) kvp_fence_proxy_async();
            KVP_WG_TURN();
            KVP_WG_ISSUE_S(s);
            KVP_WG_PASS();
            kvp_wg_wait0();
            kvp_mbar_arrive(KVP_BAR_EMPTY_K(kc));
            ++kc;
            KVP_WG_SCORES(0, s);
            KVP_WG_PACK(s);
        }
        for (int t = 0; t + 1 < ntiles; ++t) { /* tile t's O += P V beside tile t + 1's S and softmax */
            float s[1][KVP_NK][4];
            kvp_mbar_wait(KVP_BAR_FULL_K(kc), KVP_PHASE(kc));
            if (!(KVP_EXP & 32)) kvp_fence_proxy_async();
            kvp_mbar_wait(KVP_BAR_FULL_V(vc), KVP_PHASE(vc));
            if (!(KVP_EXP & 32)) kvp_fence_proxy_async();
            KVP_WG_TURN();
            KVP_WG_ISSUE_S(s);
            KVP_WG_ISSUE_PV();
            KVP_WG_PASS();
            kvp_wg_wait1(); /* S_{t+1} done; O += P_t V_t may still run (kvp_scores touches neither O nor pa) */
            kvp_mbar_arrive(KVP_BAR_EMPTY_K(kc));
            ++kc;
            KVP_WG_SCORES(t + 1, s);
            kvp_wg_wait0();
            KVP_WG_FENCE_PO();
            kvp_mbar_arrive(KVP_BAR_EMPTY_V(vc));
            ++vc;
            if (!(KVP_EXP & 8) && __any_sync(KVP_FULL, al[0][0] != 1.0f || al[0][1] != 1.0f)) {
#pragma unroll
                for (int n = 0; n < KVP_ND; ++n) {
                    o[0][n][0] *= al[0][0];
                    o[0][n][1] *= al[0][0];
                    o[0][n][2] *= al[0][1];
                    o[0][n][3] *= al[0][1];
                }
            }
            KVP_WG_PACK(s);
        }
        if (ntiles > 0) { /* the last tile's O += P V */
            kvp_mbar_wait(KVP_BAR_FULL_V(vc), KVP_PHASE(vc));
            if (!(KVP_EXP & 32)) kvp_fence_proxy_async();
            KVP_WG_TURN();
            KVP_WG_ISSUE_PV();
            KVP_WG_PASS();
            kvp_wg_wait0();
            KVP_WG_FENCE_PO();
            kvp_mbar_arrive(KVP_BAR_EMPTY_V(vc));
            ++vc;
        }
#undef KVP_WG_ISSUE_S
#undef KVP_WG_ISSUE_PV
#undef KVP_WG_FENCE_PO
#undef KVP_WG_SCORES
#undef KVP_WG_ALIBI_INIT
#undef KVP_WG_PACK
#undef KVP_WG_TURN
#undef KVP_WG_PASS

        /* ---- epilogue from registers (no staging: the producer may already fill the K/V slots for the next item) */
        if (!(KVP_EXP & 128)) { /* (re-read here: not held in registers across the mainloop) */
            item.rows = KVP_S_ITEM(rsm)[2];
            item.partial = KVP_S_ITEM(rsm)[3];
        }
        KVP_FN(kvp_wg_epilogue)(p, o, m, d, rsm, item.rows, item.partial, qbar + 32u + 4u * qs, wr0, ctid);
        kvp_mbar_arrive(KVP_BAR_EMPTY_Q(qn)); /* this thread is done with the slot's Q (its MMAs completed) and rows */
        ++qn;
    }
#undef KVP_C_IT_END
    if (!(KVP_EXP & 1) && wg == 0) kvp_named_sync(4u, KVP_NT); /* warpgroup 1's last pass (or its first, when there was no tile) */
#else
    (void)p, (void)smem; /* not an sm_90a build: never launched (the host selects it on sm_90 only) */
#endif
}
#undef KVP_BAR_FULL_K
#undef KVP_BAR_FULL_V
#undef KVP_BAR_EMPTY_K
#undef KVP_BAR_EMPTY_V
#undef KVP_PHASE
#undef KVP_BAR_FULL_Q
#undef KVP_QR
#undef KVP_QC
#undef KVP_BAR_EMPTY_Q

#endif /* KVP_ML */
#undef KVP_IDX_PREFETCH
#undef KVP_OFFS_STORE
#undef KVP_ISSUE
#undef KVP_ISSUE_KV

/* ---------------------------------------------------------------------------------------------- */
/* Epilogue: merge the warp slices of each row, normalise, store (o + lse, or the partial slot).  */

KVA_DEV void KVP_FN(kvp_epilogue)(const kvk_attn_params p, const char* smem, int faulted KVP_VP_DECL) {
    const float* const s_o = (const float*)smem;
    const float* const s_m = s_o + KVP_WKV * KVA_TQ * KVP_LD;
    const float* const s_d = s_m + KVP_WKV * KVA_TQ;
    const int* const s_qi = KVP_S_QI(smem);
    const int* const s_qh = KVP_S_QH(smem);
    const kvp_ctx* const ctx = KVP_S_CTX(smem);
    const int rows = ctx->rows;
    const int partial = ctx->partial;
    const bool sigmoid = (p.flags & KVK_FLAG_SIGMOID) != 0;
    const bool to_partial = partial >= 0;
    const float neg_inf = KVA_NEG_INF;
    const float vs = p.v_scale * KVP_KFIX;
    float* const po = (float*)(p.ws + p.off_partial_o);
    float* const pl = (float*)(p.ws + p.off_partial_lse);
    const int c = KVP_TID % KVP_ND;
    for (int r = KVP_TID / KVP_ND; r < rows; r += KVP_NT / KVP_ND) {
        float mx = neg_inf;
#pragma unroll
        for (int w = 0; w < KVP_WKV; ++w) mx = fmaxf(mx, s_m[w * KVA_TQ + r]);
        const float mu = mx == neg_inf ? 0.0f : mx;
        float acc[8];
#pragma unroll
        for (int e = 0; e < 8; ++e) acc[e] = 0.0f;
        float dsum = 0.0f;
#pragma unroll
        for (int w = 0; w < KVP_WKV; ++w) {
            const float wt = sigmoid ? 1.0f : kva_exp2(s_m[w * KVA_TQ + r] - mu);
            dsum += wt * s_d[w * KVA_TQ + r];
            const float* src = s_o + (w * KVA_TQ + r) * KVP_LD + c * 8;
            const float4 a = *(const float4*)src;
            const float4 b = *(const float4*)(src + 4);
            acc[0] = fmaf(wt, a.x, acc[0]);
            acc[1] = fmaf(wt, a.y, acc[1]);
            acc[2] = fmaf(wt, a.z, acc[2]);
            acc[3] = fmaf(wt, a.w, acc[3]);
            acc[4] = fmaf(wt, b.x, acc[4]);
            acc[5] = fmaf(wt, b.y, acc[5]);
            acc[6] = fmaf(wt, b.z, acc[6]);
            acc[7] = fmaf(wt, b.w, acc[7]);
        }
        float scale, lse;
        kvp_row_norm(mu, dsum, vs, sigmoid, faulted, to_partial, &scale, &lse);
#pragma unroll
        for (int e = 0; e < 8; ++e) acc[e] = faulted ? 0.0f : acc[e] * scale;
        if (to_partial) {
            float* dst = po + ((long long)partial * p.tile_q + r) * KVP_D + c * 8;
            *(float4*)dst = make_float4(acc[0], acc[1], acc[2], acc[3]);
            *(float4*)(dst + 4) = make_float4(acc[4], acc[5], acc[6], acc[7]);
            if (c == 0) pl[(long long)partial * p.tile_q + r] = lse;
        } else {
            const long long qi = s_qi[r], qh = s_qh[r];
            const long long off = qi * p.o_stride_row + qh * p.o_stride_head + c * 8;
#if KVP_VAR_HAS(16) /* the output transform on a final row, with its lse (use_softmax = 0: -inf) */
            if (!faulted)
#pragma unroll
                for (int e = 0; e < 8; ++e)
                    acc[e] = kva_output_transform(vp, acc[e], sigmoid ? neg_inf : lse, ctx->req, (int)qh,
                                                  KVP_S_QPOS(smem)[r], c * 8 + e);
#endif
#if KVA_OT == KVK_F32
            float* dst = (float*)p.o + off;
            *(float4*)dst = make_float4(acc[0], acc[1], acc[2], acc[3]);
            *(float4*)(dst + 4) = make_float4(acc[4], acc[5], acc[6], acc[7]);
#else
            *(uint4*)((unsigned short*)p.o + off) = kvp_pack8(acc, KVA_OT);
#endif
            if (c == 0 && p.lse) p.lse[qi * p.lse_stride_row + qh * p.lse_stride_head] = lse;
        }
    }
}

/* ---------------------------------------------------------------------------------------------- */
/* The kernel: a persistent CTA over its worker's items                                            */

#if KVP_ML == 0
#if KVA_VARIANT
/* the variant's parameters stay in the parameter space (__grid_constant__), so the hooks read them in place */
extern "C" __global__ void __launch_bounds__(KVP_CTA_NT, KVP_MINB) KVA_KERNEL_NAME(const __grid_constant__ kvk_vattn_params vpp) {
    const kvk_attn_params& p = vpp.base;
    const kvk_vparams* const vp = &vpp.vp;
#else
extern "C" __global__ void __launch_bounds__(KVP_CTA_NT, KVP_MINB) KVA_KERNEL_NAME(const kvk_attn_params p) {
#endif
    kva_pdl_start(); /* programmatic dependent launch (kva_common.cuh) */
    kva_pdl_wait();
    extern __shared__ __align__(128) char kvp_smem_raw[];
    char* const kvp_smem = kvp_smem_raw;
    const int it_begin = ((const kvk_i32*)(p.ws + p.off_worker_indptr))[blockIdx.x];

#if KVA_ROPE
    /* inverse frequencies rope_theta^(-2f/D) / rope_scale as float pairs (published by the first item's barrier) */
    for (int f = threadIdx.x; f < KVP_D / 2; f += KVP_NT) {
        const double w = (double)p.rope_rcp_scale * exp2((double)p.rope_log2_theta * (-2.0 * (double)f / (double)KVP_D));
        float* s_f = (float*)(kvp_smem + KVP_OFF_FREQ);
        s_f[f] = (float)w;
        s_f[KVP_D / 2 + f] = (float)(w - (double)(float)w);
    }
#endif

    /* the work list is re-addressed per item (kvp_at) rather than held in registers across the mainloop */
    for (int it = it_begin;
         it < *(volatile const kvk_i32*)(kvp_at(p.ws, p.off_worker_indptr) + 4ll * (blockIdx.x + 1)); ++it) {
        const kvk_work_item item = *(const kvk_work_item*)kvp_at(p.ws, p.off_items + (long long)sizeof(kvk_work_item) * it);
        const kvk_request rq = *(const kvk_request*)kvp_at(p.ws, p.off_requests + (long long)sizeof(kvk_request) * item.req);
        KVP_FN(kvp_rows)(p, item, rq, kvp_smem);
#if !KVP_NOCHK
        if (!(p.flags & KVK_FLAG_RAGGED)) {
            __syncthreads(); /* the context's fault flag is initialised */
            if (KVP_FN(kvp_request_bad)(p, rq, item.req, KVP_TID, KVP_NT)) atomicOr(&KVP_S_CTX(kvp_smem)->fault, 1);
        }
#endif
        KVP_FN(kvp_mainloop_mma)(p, item, kvp_smem KVP_VP_ARG);
        __syncthreads(); /* publishes the staging area and the fault flag */
        const int faulted = KVP_S_CTX(kvp_smem)->fault;
        if (faulted && threadIdx.x == 0) atomicAdd(&((kvk_status*)p.ws)->count, 1u);
        KVP_FN(kvp_epilogue)(p, kvp_smem, faulted KVP_VP_ARG);
        __syncthreads(); /* the next item reuses the shared memory */
    }
}
#else
/* Hopper: warpgroup 0 produces (copies), warpgroups 1 and 2 consume; registers move from the producer (56) to the
   consumers (224) with setmaxnreg. */
extern "C" __global__ void __launch_bounds__(KVP_CTA_NT, 1) KVA_KERNEL_NAME(const kvk_attn_params p,
                                                                             const __grid_constant__ kvk_tma tm) {
    kva_pdl_start(); /* programmatic dependent launch (kva_common.cuh) */
    kva_pdl_wait();
    extern __shared__ __align__(128) char kvp_smem_raw[];
    /* the warpgroup MMA's 128-byte swizzle repeats every 1024 bytes: align the base (KVK_PFW_SMEM has the slack) */
    char* const kvp_smem = kvp_smem_raw + ((1024u - (kva_smem_addr(kvp_smem_raw) & 1023u)) & 1023u);
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
    if (threadIdx.x == 0) {
        const unsigned bar = kva_smem_addr(kvp_smem + KVP_OFF_BAR);
        for (int i = 0; i < 4; ++i) kvp_mbar_init(bar + 8u * i, 128u);          /* full K / V: producer threads */
        for (int i = 4; i < 8; ++i) kvp_mbar_init(bar + 8u * i, KVP_NT);        /* empty: consumer threads */
        const unsigned qbar = kva_smem_addr(kvp_smem + KVP_OFF_QBAR);
        for (int i = 0; i < 2; ++i) kvp_mbar_init(qbar + 8u * i, 129u);         /* Q full: producer threads + 1 */
        for (int i = 2; i < 4; ++i) kvp_mbar_init(qbar + 8u * i, KVP_NT);       /* Q empty: consumer threads */
        /* the worker's end (+40, read by the consumers' item loop) and the producer's request-check cache (+44:
           none yet) */
        kvp_st_shared_vol(qbar + 40u, ((const kvk_i32*)(p.ws + p.off_worker_indptr))[blockIdx.x + 1]);
        kvp_st_shared_vol(qbar + 44u, -1);
    }
    __syncthreads();
    if (threadIdx.x < 128) {
        asm volatile("{ setmaxnreg.dec.sync.aligned.u32 56; }" ::: "memory");
        KVP_FN(kvp_wg_producer)(p, &tm, kvp_smem);
    } else {
        asm volatile("{ setmaxnreg.inc.sync.aligned.u32 224; }" ::: "memory");
        KVP_FN(kvp_wg_consumer)(p, kvp_smem);
    }
#else
    (void)p, (void)tm, (void)kvp_smem; /* not an sm_90a build: never launched (the host selects it on sm_90 only) */
#endif
}
#endif
