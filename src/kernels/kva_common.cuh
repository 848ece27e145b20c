/*
 * kva_common.cuh - device helpers shared by the kvattn kernels. CUDA C kept C-like: no templates, no
 * standard headers (the text is compiled both by nvcc and by NVRTC, which has no system headers); element
 * conversions in inline PTX on raw bits.
 */
#ifndef KVA_COMMON_CUH
#define KVA_COMMON_CUH

#include "kva_kparams.h"

#define KVA_DEV static __device__ __forceinline__
#define KVA_NEG_INF (__int_as_float(0xff800000))
#define KVA_LOG2E 1.4426950408889634f
#define KVA_LN2 0.6931471805599453f

/* ---------------------------------------------------------------------------------------------- */
/* Conversions. A "pair" is two 16-bit values in one 32-bit word (element 0 in the low half).       */

KVA_DEV float kva_f16_to_f32(unsigned short h) {
    float f;
    asm("{ cvt.f32.f16 %0, %1; }" : "=f"(f) : "h"(h));
    return f;
}
KVA_DEV float kva_bf16_to_f32(unsigned short h) { return __uint_as_float(((unsigned)h) << 16); }

KVA_DEV void kva_f16x2_to_f32(unsigned u, float* a, float* b) {
    *a = kva_f16_to_f32((unsigned short)(u & 0xffffu));
    *b = kva_f16_to_f32((unsigned short)(u >> 16));
}
KVA_DEV void kva_bf16x2_to_f32(unsigned u, float* a, float* b) {
    *a = __uint_as_float(u << 16);
    *b = __uint_as_float(u & 0xffff0000u);
}

/* two floats -> packed (a in the low half) */
KVA_DEV unsigned kva_f32x2_to_f16x2(float a, float b) {
    unsigned u;
    asm("{ cvt.rn.f16x2.f32 %0, %2, %1; }" : "=r"(u) : "f"(a), "f"(b));
    return u;
}
KVA_DEV unsigned kva_f32x2_to_bf16x2(float a, float b) {
    unsigned u;
    asm("{ cvt.rn.bf16x2.f32 %0, %2, %1; }" : "=r"(u) : "f"(a), "f"(b));
    return u;
}
KVA_DEV unsigned short kva_f32_to_f16(float a) {
    unsigned short h;
    asm("{ cvt.rn.f16.f32 %0, %1; }" : "=h"(h) : "f"(a));
    return h;
}
KVA_DEV unsigned short kva_f32_to_bf16(float a) {
    return (unsigned short)(kva_f32x2_to_bf16x2(a, 0.0f) & 0xffffu);
}

KVA_DEV unsigned kva_prmt(unsigned a, unsigned b, unsigned sel) {
    unsigned r;
    asm("{ prmt.b32 %0, %1, %2, %3; }" : "=r"(r) : "r"(a), "r"(b), "r"(sel));
    return r;
}
/* Two fp8 values (u16: element 0 in the low byte) -> f16x2 bits. e4m3: on sm_89+ one cvt; before that a bit
   rearrangement that yields the value / 256 (the caller folds 256 into its scales; e4m3 NaN then reads as a finite
   number). e5m2 is the high byte of an f16 (same sign, exponent bias and special values): on sm_89+ one byte permute,
   before that shifts, both exact (the bits cvt.rn.f16x2.e5m2x2 gives, NaN and inf included). */
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 890
#define KVA_E4M3_FIX 1.0f
#define KVA_F8_PERMUTE 1 /* the fragment loaders below take e5m2 pairs straight from the words by permutes */
KVA_DEV unsigned kva_e4m3x2_to_f16x2(unsigned short v) {
    unsigned u;
    asm("{ cvt.rn.f16x2.e4m3x2 %0, %1; }" : "=r"(u) : "h"(v));
    return u;
}
KVA_DEV unsigned kva_e5m2x2_to_f16x2(unsigned short v) { return kva_prmt((unsigned)v, 0u, 0x1404u); }
#else
#define KVA_E4M3_FIX 256.0f
#define KVA_F8_PERMUTE 0 /* sm_80: with the permutes the d256 r8 tensor-core instances spill 4 bytes */
KVA_DEV unsigned kva_e4m3x2_to_f16x2(unsigned short v) {
    unsigned x = (unsigned)v;
    unsigned lo = ((x & 0x80u) << 8) | ((x & 0x7fu) << 7);
    unsigned hi = ((x & 0x8000u) << 16) | ((x & 0x7f00u) << 15);
    return lo | hi;
}
KVA_DEV unsigned kva_e5m2x2_to_f16x2(unsigned short v) {
    unsigned x = (unsigned)v;
    return ((x & 0xffu) << 8) | ((x & 0xff00u) << 16);
}
#endif

/* float -> fp8 (round to nearest even). e4m3 saturates to +-448 (no inf) and maps NaN to 0x7f; e5m2 overflows
   to inf and maps NaN to 0x7e (the conventions of the reference). Used by append only. */
KVA_DEV unsigned kva_f32_to_e4m3(float x) {
    unsigned bits = __float_as_uint(x);
    unsigned sign = (bits >> 24) & 0x80u;
    float a = fabsf(x);
    if (a != a) return 0x7fu;
    unsigned r;
    if (a < 0.015625f) { /* below 2^-6: subnormal step 2^-9 */
        r = (unsigned)__float2int_rn(a * 512.0f); /* 0..8; 8 is the smallest normal */
    } else {
        unsigned b = __float_as_uint(a);
        unsigned rb = (b + 0x7ffffu + ((b >> 20) & 1u)) >> 20; /* (biased exp << 3) | 3-bit mantissa */
        int e = (int)rb - (int)((127 - 7) << 3);
        r = e > 0x7e ? 0x7eu : (unsigned)e;
    }
    return sign | r;
}
KVA_DEV unsigned kva_f32_to_e5m2(float x) {
    unsigned bits = __float_as_uint(x);
    unsigned sign = (bits >> 24) & 0x80u;
    float a = fabsf(x);
    if (a != a) return sign | 0x7eu;
    unsigned r;
    if (a < 6.103515625e-05f) { /* below 2^-14: subnormal step 2^-16 */
        r = (unsigned)__float2int_rn(a * 65536.0f);
    } else {
        unsigned b = __float_as_uint(a);
        if (b >= 0x7f800000u) return sign | 0x7cu; /* inf */
        unsigned rb = (b + 0xfffffu + ((b >> 21) & 1u)) >> 21;
        int e = (int)rb - (int)((127 - 15) << 2);
        r = e > 0x7c ? 0x7cu : (unsigned)e;
    }
    return sign | r;
}

/* Load element i of a typed array as float (runtime dtype; utility kernels). */
KVA_DEV float kva_load_elem(const void* p, long long i, int dtype) {
    if (dtype == KVK_F32) return ((const float*)p)[i];
    if (dtype == KVK_F16) return kva_f16_to_f32(((const unsigned short*)p)[i]);
    if (dtype == KVK_BF16) return kva_bf16_to_f32(((const unsigned short*)p)[i]);
    unsigned char b = ((const unsigned char*)p)[i];
    unsigned h = dtype == KVK_E4M3 ? kva_e4m3x2_to_f16x2((unsigned short)b) : kva_e5m2x2_to_f16x2((unsigned short)b);
    float f = kva_f16_to_f32((unsigned short)(h & 0xffffu));
    return dtype == KVK_E4M3 ? f * KVA_E4M3_FIX : f;
}
KVA_DEV void kva_store_elem(void* p, long long i, int dtype, float x) {
    if (dtype == KVK_F32) ((float*)p)[i] = x;
    else if (dtype == KVK_F16) ((unsigned short*)p)[i] = kva_f32_to_f16(x);
    else if (dtype == KVK_BF16) ((unsigned short*)p)[i] = kva_f32_to_bf16(x);
    else if (dtype == KVK_E4M3) ((unsigned char*)p)[i] = (unsigned char)kva_f32_to_e4m3(x);
    else ((unsigned char*)p)[i] = (unsigned char)kva_f32_to_e5m2(x);
}

/* ---------------------------------------------------------------------------------------------- */
/* Memory                                                                                          */

KVA_DEV unsigned kva_smem_addr(const void* p) { return (unsigned)__cvta_generic_to_shared(p); }

/* 16-byte async copy global -> shared; src_bytes = 0 writes zeros and reads nothing. */
KVA_DEV void kva_cp_async16(unsigned dst, const void* src, unsigned src_bytes) {
    asm volatile("{ cp.async.cg.shared.global [%0], [%1], 16, %2; }" ::"r"(dst), "l"(src), "r"(src_bytes) : "memory");
}
/* 16-byte async copy global -> shared, all 16 bytes read */
KVA_DEV void kva_cp_async16_full(unsigned dst, const void* src) {
    asm volatile("{ cp.async.cg.shared.global [%0], [%1], 16; }" ::"r"(dst), "l"(src) : "memory");
}
/* L2 policy for the K/V stream: evict-first when every row is read once (decode: KVK_FLAG_KV_ONCE), so the stream
   replaces its own earlier lines instead of what other kernels left in L2 (whose dirty lines then need no write-back
   under it either); evict-normal when several items read the same rows (query tiles of one request) */
KVA_DEV unsigned long long kva_l2_kv_policy(bool once) {
    unsigned long long ef, en;
    asm volatile("{ createpolicy.fractional.L2::evict_first.b64 %0, 1.0; }" : "=l"(ef));
    asm volatile("{ createpolicy.fractional.L2::evict_normal.b64 %0, 1.0; }" : "=l"(en));
    return once ? ef : en;
}
/* kva_cp_async16 with an L2 cache policy (kva_l2_kv_policy) */
KVA_DEV void kva_cp_async16_pol(unsigned dst, const void* src, unsigned src_bytes, unsigned long long pol) {
    asm volatile("{ cp.async.cg.shared.global.L2::cache_hint [%0], [%1], 16, %2, %3; }" ::"r"(dst), "l"(src),
                 "r"(src_bytes), "l"(pol)
                 : "memory");
}
/* kva_cp_async16_pol where once != 0, else the plain copy without a cache hint: a predicated pair whose predicate is
   set inside the asm, so no predicate register stays live across the caller's loop */
KVA_DEV void kva_cp_async16_ef(unsigned dst, const void* src, unsigned src_bytes, unsigned long long pol, unsigned once) {
    asm volatile("{ .reg .pred p; setp.ne.u32 p, %4, 0;\n"
                 "  @p cp.async.cg.shared.global.L2::cache_hint [%0], [%1], 16, %2, %3;\n"
                 "  @!p cp.async.cg.shared.global [%0], [%1], 16, %2; }" ::"r"(dst), "l"(src), "r"(src_bytes), "l"(pol),
                 "r"(once)
                 : "memory");
}
KVA_DEV void kva_cp_async_commit(void) { asm volatile("{ cp.async.commit_group; }" ::: "memory"); }
#define KVA_CP_ASYNC_WAIT(n) asm volatile("{ cp.async.wait_group %0; }" ::"n"(n) : "memory")

KVA_DEV uint4 kva_ld_shared16(unsigned addr) {
    uint4 v;
    asm volatile("{ ld.shared.v4.u32 {%0, %1, %2, %3}, [%4]; }"
                 : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
                 : "r"(addr));
    return v;
}
KVA_DEV uint2 kva_ld_shared8(unsigned addr) {
    uint2 v;
    asm volatile("{ ld.shared.v2.u32 {%0, %1}, [%2]; }" : "=r"(v.x), "=r"(v.y) : "r"(addr));
    return v;
}
/* read-only global loads that skip L1 allocation */
KVA_DEV uint4 kva_ldg_nc16(const void* p) {
    uint4 v;
    asm volatile("{ ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4]; }"
                 : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
                 : "l"(p));
    return v;
}
KVA_DEV int kva_ldg_i32(const int* p) {
    int v;
    asm volatile("{ ld.global.nc.s32 %0, [%1]; }" : "=r"(v) : "l"(p));
    return v;
}

/* ---------------------------------------------------------------------------------------------- */
/* Plan records                                                                                    */

KVA_DEV kvk_work_item kva_item_of(const uint4 a, const uint4 b) {
    kvk_work_item w;
    w.req = (int)a.x;
    w.kv_head = (int)a.y;
    w.row_start = (int)a.z;
    w.rows = (int)a.w;
    w.kv_start = (int)b.x;
    w.kv_end = (int)b.y;
    w.partial = (int)b.z;
    w.pad_ = (int)b.w;
    return w;
}
/* Fused split-KV merge arrival (one thread of the CTA, after a barrier that orders the CTA's partial writes before
   it): one acq_rel 64-bit atomic on (partial_first, num_partials) releases the partials, counts the arrival in the
   high 16 bits of num_partials and returns the task's first slot and size. The last arriver restores num_partials
   for the next run or graph replay. s_flag[0] = this CTA merges the task, [1] = first partial slot, [2] = partials. */
KVA_DEV void kva_merge_arrive(kvk_merge_task* mtask, int* s_flag) {
    unsigned long long old;
    asm volatile("{ atom.add.acq_rel.gpu.u64 %0, [%1], %2; }"
                 : "=l"(old)
                 : "l"(&mtask->partial_first), "l"(1ull << 48)
                 : "memory");
    const int n = (int)((old >> 32) & 0xffffu);
    const int last = (int)(old >> 48) == n - 1;
    if (last) mtask->num_partials = n;
    s_flag[0] = last;
    s_flag[1] = (int)(unsigned)(old & 0xffffffffu);
    s_flag[2] = n;
}
/* this CTA's kvk_worker_head (p.ws + p.off_worker_head): four independent 16-byte loads of one 64-byte line */
KVA_DEV void kva_load_worker_head(const char* ws, long long off_worker_head, int* it_begin, int* it_end,
                                  kvk_request* rq, kvk_work_item* item) {
    const char* const wh = ws + off_worker_head + 64ll * blockIdx.x;
    const uint4 h0 = kva_ldg_nc16(wh), h1 = kva_ldg_nc16(wh + 16), h2 = kva_ldg_nc16(wh + 32),
                h3 = kva_ldg_nc16(wh + 48);
    *it_begin = (int)h0.x;
    *it_end = (int)h0.y;
    rq->qo_start = (int)h0.z;
    rq->qo_len = (int)h0.w;
    rq->kv_start = (int)h1.x;
    rq->kv_len = (int)h1.y;
    rq->mask_offset = (long long)(((unsigned long long)h1.w << 32) | (unsigned long long)h1.z);
    *item = kva_item_of(h2, h3);
}

/* ---------------------------------------------------------------------------------------------- */
/* Math                                                                                            */

KVA_DEV float kva_exp2(float x) {
    float y;
    asm("{ ex2.approx.ftz.f32 %0, %1; }" : "=f"(y) : "f"(x));
    return y;
}
KVA_DEV float kva_log2(float x) {
    float y;
    asm("{ lg2.approx.ftz.f32 %0, %1; }" : "=f"(y) : "f"(x));
    return y;
}
KVA_DEV float kva_rcp(float x) {
    float y;
    asm("{ rcp.approx.ftz.f32 %0, %1; }" : "=f"(y) : "f"(x));
    return y;
}
/* tanh with ~1e-7 absolute error (tanh.approx is too coarse for soft caps of 30-50) */
KVA_DEV float kva_tanh(float x) {
    float ax = fabsf(x);
    float e = kva_exp2(-2.0f * KVA_LOG2E * ax); /* in (0, 1] */
    float t = (1.0f - e) / (1.0f + e);
    return copysignf(t, x);
}
/* sin and cos of x (radians) with the argument reduced to [-pi, pi] first */
KVA_DEV void kva_sincos(float x, float* s, float* c) {
    float n = rintf(x * 0.15915494309189535f);
    float r = fmaf(-n, 6.28318548202514648f, x);
    r = fmaf(n, 1.7484556e-7f, r);
    __sincosf(r, s, c);
}
/* standard ALiBi slope of head h of n (n2 = largest power of two <= n) */
KVA_DEV float kva_alibi_slope(int h, int n) {
    int n2 = 1;
    while (n2 <= n / 2) n2 *= 2; /* (n2 * 2 would overflow for n >= 2^30) */
    float e = h < n2 ? -8.0f * (float)(h + 1) / (float)n2 : -4.0f * (float)(2 * (h - n2) + 1) / (float)n2;
    return exp2f(e);
}

/* q = (umulhi(n, mul) + n) >> shift = n / d for 0 <= n < 2^31 */
KVA_DEV unsigned kva_fastdiv(unsigned n, unsigned mul, unsigned shift) { return (__umulhi(n, mul) + n) >> shift; }

/* ---------------------------------------------------------------------------------------------- */
/* Split-KV merge of one plan merge task (the merge kernel, and the decode kernel's fused merge)     */

#define KVA_FULL 0xffffffffu

KVA_DEV float kva_warp_max(float x) {
#pragma unroll
    for (int o = 16; o >= 1; o >>= 1) x = fmaxf(x, __shfl_xor_sync(KVA_FULL, x, o));
    return x;
}
KVA_DEV float kva_warp_sum(float x) {
#pragma unroll
    for (int o = 16; o >= 1; o >>= 1) x += __shfl_xor_sync(KVA_FULL, x, o);
    return x;
}

/* Store 4 floats at element index i (multiple of 4) of a dtype array. */
KVA_DEV void kva_store4(void* base, long long i, int dtype, float a, float b, float c, float d) {
    if (dtype == KVK_F32) {
        *(float4*)((float*)base + i) = make_float4(a, b, c, d);
    } else {
        uint2 w;
        if (dtype == KVK_F16) {
            w.x = kva_f32x2_to_f16x2(a, b);
            w.y = kva_f32x2_to_f16x2(c, d);
        } else {
            w.x = kva_f32x2_to_bf16x2(a, b);
            w.y = kva_f32x2_to_bf16x2(c, d);
        }
        *(uint2*)((unsigned short*)base + i) = w;
    }
}

/* Merge rows [0, tk->rows) of a task: partial slots partial_first .. + num_partials in KV order, o and lse of
 * the tile's rows. Warp `warp` of `nwarps` takes rows warp, warp + nwarps, ...; lanes along the head dim in groups
 * of 4 (dvo % 4 == 0, dvo <= 256). Softmax: M = max lse, w_k = exp2(lse_k - M), o = sum w_k o_k / sum w_k,
 * lse = M + log2(sum); a partial with KVK_FAULT_LSE_BITS (its request hit a bad page) makes the rows o = 0,
 * lse = -inf. Sigmoid: the sum of the partials. Partials are read through L2 (__ldcg: they may have been written
 * by other CTAs of the running kernel); the loads of a chunk of 32 partials are independent, so they overlap
 * (a handful of L2 round trips per row whatever the number of partials). Deterministic: a fixed order. */
/* batch: partials whose values one lane loads per round trip to L2, 8 or 16 (a literal at each call site: the
   unused registers of a batch of 8 are compiled away); kernels short of registers pass 8 */
#define KVA_MERGE_BATCH_MAX 16
KVA_DEV void kva_merge_task_rows(const kvk_merge_task* tk, int qo_start, const float* po, const float* pl, int tile_q,
                                 int dvo, int g, int sigmoid, void* o, int o_dtype, long long o_stride_row,
                                 long long o_stride_head, float* lse, long long lse_stride_row,
                                 long long lse_stride_head, int warp, int nwarps, int lane, const int batch) {
    const float neg_inf = KVA_NEG_INF;
    const int n = tk->num_partials;
    for (int r = warp; r < tk->rows; r += nwarps) {
        const float* lr = pl + (long long)tk->partial_first * tile_q + r; /* lse of partial k: lr[k * tile_q] */
        const float* orow_p = po + ((long long)tk->partial_first * tile_q + r) * dvo;
        const long long ostep = (long long)tile_q * dvo;
        /* the first batch of partials' values (head dims lane*4 .. +4) is loaded together with the lse values */
        float4 v[KVA_MERGE_BATCH_MAX];
        const int c0l = lane * 4;
#pragma unroll
        for (int kk = 0; kk < KVA_MERGE_BATCH_MAX; ++kk) {
            if (kk >= batch) break;
            v[kk] = make_float4(0.f, 0.f, 0.f, 0.f);
            if (kk < n && c0l < dvo) v[kk] = __ldcg((const float4*)(orow_p + kk * ostep + c0l));
        }
        /* pass 1: max lse and fault check (lanes in parallel); lane k keeps lse k and k + 32 */
        float l_a = neg_inf, l_b = neg_inf;
        float mx = neg_inf;
        int fault = 0;
        for (int k = lane; k < n; k += 32) {
            float l = __ldcg(lr + (long long)k * tile_q);
            if (k == lane) l_a = l;
            else if (k == lane + 32) l_b = l;
            if (__float_as_uint(l) == KVK_FAULT_LSE_BITS) fault = 1;
            else mx = fmaxf(mx, l);
        }
        mx = kva_warp_max(mx);
        fault = __any_sync(KVA_FULL, fault);
        const float m_use = mx == neg_inf ? 0.0f : mx;
        /* weights of chunks of 32 partials (lane kk: partial c0 + kk), the sum in a fixed order */
        float wsum = 0.0f;
        for (int c0 = 0; c0 < n; c0 += 32) {
            float w = 0.0f;
            if (c0 + lane < n) {
                const float l = c0 == 0 ? l_a : (c0 == 32 ? l_b : __ldcg(lr + (long long)(c0 + lane) * tile_q));
                w = sigmoid ? 1.0f : kva_exp2(l - m_use);
            }
            wsum += kva_warp_sum(w);
        }
        /* o: head dims lane*4 (+128 for dvo 256, a second sweep), partials in batches (a divisor of 32: a batch never
           straddles two weight chunks); the sum runs over the partials in order whatever the batch */
#pragma unroll 1
        for (int jj = 0; jj < 2; ++jj) {
            const int c = c0l + 128 * jj;
            if (jj > 0 && 128 >= dvo) break;
            float4 acc = make_float4(0.f, 0.f, 0.f, 0.f);
            if (!fault) {
                for (int k0 = 0; k0 < n; k0 += batch) {
                    if (k0 > 0 || jj > 0) {
#pragma unroll
                        for (int kk = 0; kk < KVA_MERGE_BATCH_MAX; ++kk)
                            if (kk < batch && k0 + kk < n && c < dvo)
                                v[kk] = __ldcg((const float4*)(orow_p + (long long)(k0 + kk) * ostep + c));
                    }
                    const int c0 = k0 & ~31;
                    float w = 0.0f; /* weights of the chunk holding k0 */
                    if (c0 + lane < n) {
                        const float l =
                            c0 == 0 ? l_a : (c0 == 32 ? l_b : __ldcg(lr + (long long)(c0 + lane) * tile_q));
                        w = sigmoid ? 1.0f : kva_exp2(l - m_use);
                    }
#pragma unroll
                    for (int kk = 0; kk < KVA_MERGE_BATCH_MAX; ++kk) {
                        if (kk >= batch) break;
                        const float wk = __shfl_sync(KVA_FULL, w, (k0 + kk) & 31);
                        if (k0 + kk < n) {
                            acc.x = fmaf(wk, v[kk].x, acc.x);
                            acc.y = fmaf(wk, v[kk].y, acc.y);
                            acc.z = fmaf(wk, v[kk].z, acc.z);
                            acc.w = fmaf(wk, v[kk].w, acc.w);
                        }
                    }
                }
            }
            float scale;
            if (sigmoid) scale = 1.0f;
            else scale = wsum > 0.0f ? kva_rcp(wsum) : 0.0f;
            if (fault) scale = 0.0f;
            const int pr = tk->row_start + r;
            const int i = pr / g;
            const int qh = tk->kv_head * g + pr % g;
            const long long obase = ((long long)qo_start + i) * o_stride_row + (long long)qh * o_stride_head;
            if (c < dvo) kva_store4(o, obase + c, o_dtype, acc.x * scale, acc.y * scale, acc.z * scale, acc.w * scale);
            if (jj == 0 && lane == 0 && lse) {
                float l_out = sigmoid ? 0.0f : (wsum > 0.0f ? m_use + kva_log2(wsum) : neg_inf);
                if (fault) l_out = neg_inf;
                lse[((long long)qo_start + i) * lse_stride_row + (long long)qh * lse_stride_head] = l_out;
            }
        }
    }
}

/* ---------------------------------------------------------------------------------------------- */
/* mma.sync m16n8k16 fragments from shared memory (the tensor-core and head-group decode kernels) */
KVA_DEV void kva_ldsm_x4(unsigned addr, unsigned* r) {
    asm volatile("{ ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4]; }"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(addr)
                 : "memory");
}
KVA_DEV void kva_ldsm_x4_t(unsigned addr, unsigned* r) {
    asm volatile("{ ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4]; }"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(addr)
                 : "memory");
}
KVA_DEV void kva_mma_bf16(float* c, const unsigned* a, unsigned b0, unsigned b1) {
    asm("{ mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
        "{%0, %1, %2, %3}; }"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}
KVA_DEV void kva_mma_f16(float* c, const unsigned* a, unsigned b0, unsigned b1) {
    asm("{ mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
        "{%0, %1, %2, %3}; }"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}
/* fp8 K/V as f16 MMA A fragments (m16n8k16), the tensor-core and head-group decode kernels' fp8 paths. fmt (a
   compile-time constant at every call): KVA_F8_E5M2, KVA_F8_E4M3 (cvt on sm_89+, the bit form with value / 256
   before), KVA_F8_E4M3_BITS (the bit form on every architecture: value / 256, the caller folds 256 into its scales;
   benchmark A/B only). On sm_89+ e5m2 pairs and the e4m3 bit form take their bytes with one permute ([0, x, 0, y] is
   the pair x, y as the high bytes of two f16), without extracting the pair first. */
#define KVA_F8_E5M2 0
#define KVA_F8_E4M3 1
#define KVA_F8_E4M3_BITS 2
#define KVA_F8_E5M2_CVT 3 /* e5m2 by cvt on sm_89+ (the form before the byte permute; benchmark A/B only) */
KVA_DEV unsigned kva_fp8_cvt_pair(unsigned short v, int fmt) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 890
    if (fmt == KVA_F8_E5M2_CVT) {
        unsigned u;
        asm("{ cvt.rn.f16x2.e5m2x2 %0, %1; }" : "=r"(u) : "h"(v));
        return u;
    }
#endif
    return fmt == KVA_F8_E4M3 || fmt == KVA_F8_E4M3_BITS ? kva_e4m3x2_to_f16x2(v) : kva_e5m2x2_to_f16x2(v);
}
/* the pair of bytes of w that the permute sel (of the form 0xY4X4) puts into the high bytes of two f16, as f16x2 */
KVA_DEV unsigned kva_fp8_pair_bits(unsigned w, unsigned sel, int fmt) {
    const unsigned h = kva_prmt(w, 0u, sel);
    if (fmt == KVA_F8_E5M2) return h;
    return (h & 0x80008000u) | ((h >> 1) & 0x3f803f80u); /* e4m3: sign, then exponent and mantissa one bit lower */
}
/* A = K[16 tokens x 16 k] of one k-step from 4 bytes of token r8 (lo) and 4 of token r8 + 8 (hi): bytes 0-1 are k
   indices 2 q4, 2 q4 + 1 and bytes 2-3 are 2 q4 + 8, + 9 (the caller permutes q's dims the same way) */
KVA_DEV void kva_fp8_k_afrag(unsigned lo, unsigned hi, int fmt, unsigned* a) {
    if (fmt == KVA_F8_E4M3 || fmt == KVA_F8_E5M2_CVT || !KVA_F8_PERMUTE) {
        a[0] = kva_fp8_cvt_pair((unsigned short)(lo & 0xffffu), fmt);
        a[2] = kva_fp8_cvt_pair((unsigned short)(lo >> 16), fmt);
        a[1] = kva_fp8_cvt_pair((unsigned short)(hi & 0xffffu), fmt);
        a[3] = kva_fp8_cvt_pair((unsigned short)(hi >> 16), fmt);
    } else {
        a[0] = kva_fp8_pair_bits(lo, 0x1404u, fmt);
        a[2] = kva_fp8_pair_bits(lo, 0x3424u, fmt);
        a[1] = kva_fp8_pair_bits(hi, 0x1404u, fmt);
        a[3] = kva_fp8_pair_bits(hi, 0x3424u, fmt);
    }
}
/* A = V^T[16 dims x 16 tokens] from two words of ldmatrix.trans on byte pairs, g0 holding dims 2 r8, 2 r8 + 1 of tokens
   2 q4, 2 q4 + 1 (bytes: d0 t0, d1 t0, d0 t1, d1 t1) and g1 the same of tokens + 8: A row r8 is dim 2 r8, row r8 + 8 is
   dim 2 r8 + 1 */
KVA_DEV void kva_fp8_v_afrag(unsigned g0, unsigned g1, int fmt, unsigned* a) {
    if (fmt == KVA_F8_E4M3 || fmt == KVA_F8_E5M2_CVT || !KVA_F8_PERMUTE) {
        a[0] = kva_fp8_cvt_pair((unsigned short)kva_prmt(g0, 0u, 0x0020u), fmt);
        a[1] = kva_fp8_cvt_pair((unsigned short)kva_prmt(g0, 0u, 0x0031u), fmt);
        a[2] = kva_fp8_cvt_pair((unsigned short)kva_prmt(g1, 0u, 0x0020u), fmt);
        a[3] = kva_fp8_cvt_pair((unsigned short)kva_prmt(g1, 0u, 0x0031u), fmt);
    } else {
        a[0] = kva_fp8_pair_bits(g0, 0x2404u, fmt);
        a[1] = kva_fp8_pair_bits(g0, 0x3414u, fmt);
        a[2] = kva_fp8_pair_bits(g1, 0x2404u, fmt);
        a[3] = kva_fp8_pair_bits(g1, 0x3414u, fmt);
    }
}
KVA_DEV void kva_prefetch_l2(const void* p) { asm volatile("{ prefetch.global.L2 [%0]; }" ::"l"(p)); }
/* Programmatic dependent launch (kva_run_args.enable_pdl; sm_90+). kva_pdl_start lets the next kernel of the stream, if
   it was launched with programmatic stream serialisation, start its CTAs now; kva_pdl_wait, in a kernel so launched,
   blocks until the grids before it have completed and their memory is visible (in any other launch both are no-ops).
   Every kernel kva_run launches calls kva_pdl_wait, in every CTA, before it touches memory that an earlier kernel may
   write (q, K/V, page table, outputs, the plan's partials and merge counters); before it only the plan's read-only
   regions (worker headers) are read and L2 prefetches issued. */
KVA_DEV void kva_pdl_start() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("{ griddepcontrol.launch_dependents; }" ::: "memory");
#endif
}
KVA_DEV void kva_pdl_wait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("{ griddepcontrol.wait; }" ::: "memory");
#endif
}

/* One online-softmax step of the decode kernels on an S^T fragment of m16n8k16 (16 keys x 8 query rows): this lane
   holds keys g8 and g8 + 8 of rows 2 q4 (x[0], x[2]) and 2 q4 + 1 (x[1], x[3]), base-2 logits, -inf where masked.
   Updates the two rows' running max m and sum d, writes the weights p[4] and the factors al0, al1 by which the
   caller rescales its output accumulators (1 when the max did not move). */
KVA_DEV void kva_st_softmax_step(const float* x, float& m0, float& m1, float& d0, float& d1, float* p, float& al0,
                                 float& al1) {
    const float neg_inf = KVA_NEG_INF;
    float mx0 = fmaxf(x[0], x[2]), mx1 = fmaxf(x[1], x[3]);
#pragma unroll
    for (int o = 4; o < 32; o <<= 1) {
        mx0 = fmaxf(mx0, __shfl_xor_sync(0xffffffffu, mx0, o));
        mx1 = fmaxf(mx1, __shfl_xor_sync(0xffffffffu, mx1, o));
    }
    const float mn0 = fmaxf(m0, mx0), mn1 = fmaxf(m1, mx1);
    const float mu0 = mn0 == neg_inf ? 0.0f : mn0, mu1 = mn1 == neg_inf ? 0.0f : mn1;
    al0 = kva_exp2(m0 - mu0);
    al1 = kva_exp2(m1 - mu1);
    m0 = mn0;
    m1 = mn1;
    p[0] = kva_exp2(x[0] - mu0);
    p[2] = kva_exp2(x[2] - mu0);
    p[1] = kva_exp2(x[1] - mu1);
    p[3] = kva_exp2(x[3] - mu1);
    d0 = d0 * al0 + (p[0] + p[2]);
    d1 = d1 * al1 + (p[1] + p[3]);
}

/* ---------------------------------------------------------------------------------------------- */
/* mbarriers, TMA tensor copies and named barriers (sm_90: the Hopper prefill mainloop and the head-group decode
   kernel)                                                                                          */
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
KVA_DEV void kvp_fence_proxy_async() { asm volatile("{ fence.proxy.async.shared::cta; }" ::: "memory"); }
KVA_DEV void kvp_mbar_init(unsigned bar, unsigned count) {
    asm volatile("{ mbarrier.init.shared::cta.b64 [%0], %1; }" ::"r"(bar), "r"(count) : "memory");
}
/* wait for the completion of the phase with this parity (a fresh barrier counts its "previous" phase, parity 1,
   as complete) */
KVA_DEV void kvp_mbar_wait(unsigned bar, unsigned parity) {
    unsigned done;
    do {
        /* with a suspend-time hint: the waiting warps sleep in the barrier instead of spinning through issue slots
           the computing warps need */
        asm volatile("{ .reg .pred p; mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2, %3; selp.u32 %0, 1, 0, p; }"
                     : "=r"(done)
                     : "r"(bar), "r"(parity), "r"(1000000u)
                     : "memory");
    } while (!done);
}
KVA_DEV void kvp_mbar_arrive(unsigned bar) {
    asm volatile("{ mbarrier.arrive.shared::cta.b64 _, [%0]; }" ::"r"(bar) : "memory");
}
/* one arrival on bar once all of this thread's earlier cp.async copies have landed (init count includes it) */
KVA_DEV void kvp_mbar_arrive_expect_tx(unsigned bar, unsigned bytes) {
    asm volatile("{ mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1; }" ::"r"(bar), "r"(bytes) : "memory");
}
/* thread-block clusters (the tensor-core decode kernel's cluster combine) */
KVA_DEV unsigned kvp_cluster_rank() {
    unsigned r;
    asm volatile("{ mov.u32 %0, %%cluster_ctarank; }" : "=r"(r));
    return r;
}
KVA_DEV unsigned kvp_cluster_size() {
    unsigned r;
    asm volatile("{ mov.u32 %0, %%cluster_nctarank; }" : "=r"(r));
    return r;
}
/* every thread of every CTA arrives once (after the CTA's mbarrier init and its fence); threads that later write to
   another CTA's shared memory wait first. The wait only counts threads that have not exited. */
KVA_DEV void kvp_cluster_arrive_relaxed() { asm volatile("{ barrier.cluster.arrive.relaxed.aligned; }" ::: "memory"); }
KVA_DEV void kvp_cluster_wait() { asm volatile("{ barrier.cluster.wait.aligned; }" ::: "memory"); }
KVA_DEV void kvp_fence_mbar_init_cluster() { asm volatile("{ fence.mbarrier_init.release.cluster; }" ::: "memory"); }
/* the address of the same shared-memory offset in cluster CTA `rank` (shared::cluster window) */
KVA_DEV unsigned kvp_cluster_map(unsigned saddr, unsigned rank) {
    unsigned a;
    asm volatile("{ mapa.shared::cluster.u32 %0, %1, %2; }" : "=r"(a) : "r"(saddr), "r"(rank));
    return a;
}
/* 4 bytes into another CTA's shared memory, completing 4 transaction bytes on that CTA's mbarrier */
KVA_DEV void kvp_st_async_f32(unsigned raddr, float v, unsigned rbar) {
    asm volatile("{ st.async.shared::cluster.mbarrier::complete_tx::bytes.b32 [%0], %1, [%2]; }" ::"r"(raddr),
                 "r"(__float_as_uint(v)), "r"(rbar)
                 : "memory");
}
/* wait for the phase with this parity, acquiring at cluster scope (data that other CTAs' st.async delivered) */
KVA_DEV void kvp_mbar_wait_cluster(unsigned bar, unsigned parity) {
    unsigned done;
    do {
        asm volatile("{ .reg .pred p; mbarrier.try_wait.parity.acquire.cluster.shared::cta.b64 p, [%1], %2; selp.u32 %0, 1, 0, p; }"
                     : "=r"(done)
                     : "r"(bar), "r"(parity)
                     : "memory");
    } while (!done);
}
/* TMA tile copies into shared memory, completing on an mbarrier (tensor map in kernel-parameter space) */
KVA_DEV void kvp_tma_load3(unsigned dst, const void* map, int c0, int c1, int c2, unsigned bar) {
    asm volatile("{ cp.async.bulk.tensor.3d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3, %4}], [%5]; }"
                 ::"r"(dst), "l"(map), "r"(c0), "r"(c1), "r"(c2), "r"(bar) : "memory");
}
KVA_DEV void kvp_tma_load4(unsigned dst, const void* map, int c0, int c1, int c2, int c3, unsigned bar) {
    asm volatile("{ cp.async.bulk.tensor.4d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3, %4, %5}], [%6]; }"
                 ::"r"(dst), "l"(map), "r"(c0), "r"(c1), "r"(c2), "r"(c3), "r"(bar) : "memory");
}
KVA_DEV void kvp_cp_async_mbar_arrive(unsigned bar) {
    asm volatile("{ cp.async.mbarrier.arrive.noinc.shared::cta.b64 [%0]; }" ::"r"(bar) : "memory");
}
/* named barrier that also returns whether any participating thread passed pred != 0 */
KVA_DEV int kvp_named_sync_or(unsigned id, unsigned count, int pred) {
    int r;
    asm volatile("{ .reg .pred a, b; setp.ne.b32 a, %1, 0; bar.red.or.pred b, %2, %3, a; selp.s32 %0, 1, 0, b; }"
                 : "=r"(r)
                 : "r"(pred), "r"(id), "r"(count)
                 : "memory");
    return r;
}
KVA_DEV void kvp_named_arrive(unsigned id, unsigned count) {
    asm volatile("{ bar.arrive %0, %1; }" ::"r"(id), "r"(count) : "memory");
}
KVA_DEV void kvp_named_sync(unsigned id, unsigned count) {
    asm volatile("{ bar.sync %0, %1; }" ::"r"(id), "r"(count) : "memory");
}
#endif

/* ---------------------------------------------------------------------------------------------- */
/* Faults                                                                                          */

KVA_DEV void kva_record_fault(char* ws, int req, int page) {
    kvk_status* st = (kvk_status*)ws;
    unsigned long long key = ((unsigned long long)(unsigned)req << 32) | (unsigned long long)(unsigned)page;
    atomicMax((unsigned long long*)&st->first_key, ~key);
    atomicAdd(&st->count, 1u);
}

#endif /* KVA_COMMON_CUH */
