/*
 * kva_decode.cuh - the CUDA-core attention kernel over paged (or ragged) KV: a persistent CTA of 128 threads
 * executes its worker's list of work items (see src/core/internal.h): up to KVA_ROWS packed query rows of one
 * (request, KV head) against a KV range. Used for batch decode with any GQA group size (groups above 8 rows are
 * split into several tiles by the planner) and, as a correct fallback, for small-tile prefill.
 *
 * One instance per inclusion, specialised by macros (defined by the includer or by NVRTC -D options):
 *   KVA_KERNEL_NAME   extern "C" symbol name
 *   KVA_DQK, KVA_DVO  head dims (64, 128, 256; equal)
 *   KVA_QT, KVA_KT, KVA_OT   dtypes of q, KV, o (KVK_F16 / KVK_BF16; KV also KVK_E4M3 / KVK_E5M2; o also KVK_F32)
 *   KVA_ROWS          packed rows per CTA (1, 2, 4, 8)
 *   KVA_ROPE          fused rotate-half RoPE on q and k (0 / 1)
 *   KVA_VARIANT       1: a user variant's instance (docs/variants.md); its source defines the hooks before this
 *                     file and KVA_VAR_HOOKS (KVA_VARIANT_* bits), KVA_VAR_SOFTMAX (0 / 1). The kernel then takes
 *                     kvk_vattn_params and the host sets KVK_FLAG_TRANSFORM (natural-log logits for the hooks) and,
 *                     without softmax, KVK_FLAG_SIGMOID (plain weighted sums). Built-in instances (KVA_VARIANT 0)
 *                     compile exactly as without this option: every hook site is under #if KVA_VARIANT.
 * Everything else (page size, layout, window, soft cap, ALiBi, sigmoid, masks) is a runtime argument.
 *
 * Per KV tile of KVA_TILE tokens (a multi-stage cp.async pipeline of KVA_STAGES tiles in shared memory):
 *   QK:      thread (lx, ty) holds q[r][8*lx .. 8*lx+8) of every row r and takes tokens ty + NT*k; partial dots
 *            are reduced across the LX lanes of a token with a reduce-scatter (each exchange halves the set);
 *            logits (log2 domain, masked = -inf) go to shared memory.
 *   softmax: each warp computes the tile's row maxima (redundantly, so no barrier is needed) and the
 *            probabilities of the tokens it owns in PV.
 *   PV:      the same thread takes the same tokens and accumulates o[r][8*lx .. 8*lx+8).
 * Page indices of the tile after next are loaded one iteration ahead (one compare against the pool size each);
 * KV rows past the range or on an out-of-range page are zero-filled and never read from global memory.
 */
#include "kva_common.cuh"

#ifndef KVA_KERNEL_NAME
#error "KVA_KERNEL_NAME must be defined"
#endif

/* ---- geometry ---- */
#undef KVA_ES
#undef KVA_LX
#undef KVA_LOG_LX
#undef KVA_NT
#undef KVA_TG
#undef KVA_TILE
#undef KVA_TPT
#undef KVA_STAGES
#undef KVA_CPR
#undef KVA_UK
#undef KVA_RSTEP
#undef KVA_KTILE_BYTES
#undef KVA_VTILE_BYTES
#undef KVA_STAGE_BYTES
#undef KVA_PIPE_BYTES
#undef KVA_NQK
#undef KVA_NF
#undef KVA_MV
#undef KVA_MP
#undef KVA_KFIX

#define KVA_ES KVK_DEC_ES(KVA_KT)
#define KVA_LX (KVA_DQK / 8)
#define KVA_LOG_LX (KVA_LX == 8 ? 3 : (KVA_LX == 16 ? 4 : 5))
#define KVA_NT (KVK_THREADS / KVA_LX) /* token lanes per CTA */
#define KVA_TG (32 / KVA_LX)          /* token lanes per warp */
#define KVA_TILE KVK_DEC_TILE(KVA_DQK)
#define KVA_TPT (KVA_TILE / KVA_NT)   /* tokens per thread per tile (4) */
#define KVA_STAGES KVK_DEC_STAGES(KVA_ES)
#define KVA_CPR (KVA_DQK * KVA_ES / 16) /* 16-byte chunks per K row */
#define KVA_UK (KVA_TILE * KVA_CPR / KVK_THREADS)
#define KVA_RSTEP (KVK_THREADS / KVA_CPR)
#define KVA_KTILE_BYTES (KVA_TILE * KVA_DQK * KVA_ES)
#define KVA_VTILE_BYTES (KVA_TILE * KVA_DVO * KVA_ES)
#define KVA_STAGE_BYTES (KVA_KTILE_BYTES + KVA_VTILE_BYTES)
#define KVA_PIPE_BYTES (KVA_STAGES * KVA_STAGE_BYTES)
#define KVA_NQK (KVA_TPT * KVA_ROWS)                     /* partial dots per thread per tile */
#define KVA_NF (KVA_NQK >= KVA_LX ? KVA_NQK / KVA_LX : 1) /* reduced logits per thread */
#define KVA_MV ((KVA_TILE * KVA_ROWS + 31) / 32)          /* logits per lane in the row-max pass */
#define KVA_MP ((4 * KVA_TG * KVA_ROWS + 31) / 32)        /* probabilities per lane */
#if KVA_KT == KVK_E4M3
#define KVA_KFIX KVA_E4M3_FIX
#else
#define KVA_KFIX 1.0f
#endif

#ifndef KVA_NO_BOUNDS_CHECK
#define KVA_NO_BOUNDS_CHECK 0
#endif
#ifndef KVA_VARIANT
#define KVA_VARIANT 0
#endif
#if KVA_VARIANT
#if KVA_ROPE
#error "user variants do not combine with fused RoPE"
#endif
#define KVA_VAR_HAS(bit) ((KVA_VAR_HOOKS & (bit)) != 0)
#else
#define KVA_VAR_HAS(bit) 0
#endif
#if KVA_DQK != KVA_DVO
#error "the CUDA-core kernel needs head_dim_qk == head_dim_vo"
#endif
#if KVA_DQK != 64 && KVA_DQK != 128 && KVA_DQK != 256
#error "head dim must be 64, 128 or 256"
#endif

/* ---- element helpers (expanded with this instance's dtypes) ---- */
#undef KVA_KV_TO_F32_8
#if KVA_ES == 2
#if KVA_KT == KVK_F16
#define KVA_PAIR_TO_F32 kva_f16x2_to_f32
#else
#define KVA_PAIR_TO_F32 kva_bf16x2_to_f32
#endif
/* 8 KV elements at shared address a -> f[0..8) */
#define KVA_KV_TO_F32_8(a, f)                                      \
    do {                                                           \
        uint4 w_ = kva_ld_shared16(a);                             \
        KVA_PAIR_TO_F32(w_.x, &(f)[0], &(f)[1]);                   \
        KVA_PAIR_TO_F32(w_.y, &(f)[2], &(f)[3]);                   \
        KVA_PAIR_TO_F32(w_.z, &(f)[4], &(f)[5]);                   \
        KVA_PAIR_TO_F32(w_.w, &(f)[6], &(f)[7]);                   \
    } while (0)
#else
#if KVA_KT == KVK_E4M3
#define KVA_FP8X2 kva_e4m3x2_to_f16x2
#else
#define KVA_FP8X2 kva_e5m2x2_to_f16x2
#endif
#define KVA_KV_TO_F32_8(a, f)                                                                    \
    do {                                                                                         \
        uint2 w_ = kva_ld_shared8(a);                                                            \
        kva_f16x2_to_f32(KVA_FP8X2((unsigned short)(w_.x & 0xffffu)), &(f)[0], &(f)[1]);         \
        kva_f16x2_to_f32(KVA_FP8X2((unsigned short)(w_.x >> 16)), &(f)[2], &(f)[3]);             \
        kva_f16x2_to_f32(KVA_FP8X2((unsigned short)(w_.y & 0xffffu)), &(f)[4], &(f)[5]);         \
        kva_f16x2_to_f32(KVA_FP8X2((unsigned short)(w_.y >> 16)), &(f)[6], &(f)[7]);             \
    } while (0)
#endif

#if KVA_QT == KVK_F16
#define KVA_QPAIR_TO_F32 kva_f16x2_to_f32
#else
#define KVA_QPAIR_TO_F32 kva_bf16x2_to_f32
#endif

#if KVA_VARIANT
/* the variant's parameters stay in the parameter space (__grid_constant__), so the hooks read them in place */
extern "C" __global__ void __launch_bounds__(KVK_THREADS, 2) KVA_KERNEL_NAME(const __grid_constant__ kvk_vattn_params vpp) {
    const kvk_attn_params& p = vpp.base;
    const kvk_vparams* const vp = &vpp.vp;
#else
extern "C" __global__ void __launch_bounds__(KVK_THREADS, 2) KVA_KERNEL_NAME(const kvk_attn_params p) {
#endif
    kva_pdl_start(); /* programmatic dependent launch (kva_common.cuh) */
    kva_pdl_wait();
    extern __shared__ __align__(16) char kva_smem[];
    const int tid = threadIdx.x;
    const int lane = tid & 31;
    const int warp = tid >> 5;
    const int lx = tid % KVA_LX;  /* lane along the head dim */
    const int ty = tid / KVA_LX;  /* token lane (the same tokens in QK and PV) */
    const int tgl = lane / KVA_LX; /* token lane within the warp */

    char* const pipe = kva_smem;
    float* const s_logit = (float*)(kva_smem + KVA_PIPE_BYTES);        /* [TILE][ROWS] */
    float* const s_p = s_logit + KVA_TILE * KVA_ROWS;                   /* [TILE][ROWS] */
    long long* const s_mbit = (long long*)(s_p + KVA_TILE * KVA_ROWS);  /* [8] */
    int* const s_qpos = (int*)(s_mbit + 8);                              /* [8] */
    float* const s_slope = (float*)(s_qpos + 8);                         /* [8] */
    float* const s_dred = s_slope + 8;                                   /* [4][8] */
    float* const s_m = s_dred + 32;                                      /* [8] */
    const unsigned pipe_addr = kva_smem_addr(pipe);

    const kvk_work_item* items = (const kvk_work_item*)(p.ws + p.off_items);
    const kvk_request* reqs = (const kvk_request*)(p.ws + p.off_requests);
    /* the worker's header (kvk_worker_head): item range, first item and its request in one line */
    int it_begin, it_end;
    kvk_work_item nitem;
    kvk_request nrq;
    kva_load_worker_head(p.ws, p.off_worker_head, &it_begin, &it_end, &nrq, &nitem);
    const unsigned flags = p.flags;
    const int g = p.group_size;
    const char* const kbase = (const char*)p.k;
    const char* const vbase = (const char*)p.v;
    const float neg_inf = KVA_NEG_INF;

#if KVA_ROPE
    /* inverse frequencies of this thread's 8 dims as a float pair (hi + lo), so positions up to 2^30 keep
       the angle accurate to ~1e-7 after reduction */
    float fr_hi[8], fr_lo[8];
#pragma unroll
    for (int e = 0; e < 8; ++e) {
        int f = (lx * 8 + e) % (KVA_DQK / 2);
        double w = (double)p.rope_rcp_scale * exp2((double)p.rope_log2_theta * (-2.0 * (double)f / (double)KVA_DQK));
        fr_hi[e] = (float)w;
        fr_lo[e] = (float)(w - (double)fr_hi[e]);
    }
    const float rope_sign = lx < KVA_LX / 2 ? -1.0f : 1.0f;
#endif


    for (int it = it_begin; it < it_end; ++it) {
        const kvk_work_item item = nitem;
        const kvk_request rq = nrq;
        if (it + 1 < it_end) { /* prefetch the next item's header */
            nitem = items[it + 1];
            nrq = reqs[nitem.req];
        }
        const int kv0 = item.kv_start, kv1 = item.kv_end;
        const int ntiles = kv1 > kv0 ? (kv1 - kv0 + KVA_TILE - 1) / KVA_TILE : 0;
        const int kvh = item.kv_head;
        const bool ragged = (flags & KVK_FLAG_RAGGED) != 0;
        const char* const kb = kbase + (long long)kvh * p.k_stride_head * KVA_ES;
        const char* const vb = vbase + (long long)kvh * p.v_stride_head * KVA_ES;
        const int* const pidx = ragged ? p.indices : p.indices + rq.kv_start;

        /* ---- per-row facts ---- */
        if (tid < KVA_ROWS) {
            int pr = item.row_start + (tid < item.rows ? tid : item.rows - 1);
            int i = pr / g;
            int qh = kvh * g + pr % g;
            s_qpos[tid] = rq.kv_len - rq.qo_len + i;
            s_mbit[tid] = rq.mask_offset * 8 + (long long)i * rq.kv_len;
            float sl = 0.0f;
            if (flags & KVK_FLAG_ALIBI) sl = p.alibi_slopes ? p.alibi_slopes[qh] : kva_alibi_slope(qh, p.num_qo_heads);
            s_slope[tid] = sl;
        }

        /* ---- page indices of the prologue tiles (independent loads, all in flight together) ---- */
        int bad = 0;
        unsigned long long bad_key = 0ull; /* ~((req << 32) | page), max wins */
        int pg[KVA_STAGES][KVA_UK];
        int sl[KVA_STAGES][KVA_UK];
#define KVA_FETCH(T, PG, SL)                                                                        \
    do {                                                                                            \
        _Pragma("unroll") for (int u_ = 0; u_ < KVA_UK; ++u_) {                                     \
            int row_ = tid / KVA_CPR + u_ * KVA_RSTEP;                                              \
            int j_ = kv0 + (T) * KVA_TILE + row_;                                                   \
            (PG)[u_] = -1;                                                                          \
            (SL)[u_] = 0;                                                                           \
            if ((T) < ntiles && j_ < kv1) {                                                         \
                if (ragged) {                                                                       \
                    (PG)[u_] = 0;                                                                   \
                    (SL)[u_] = rq.kv_start + j_;                                                    \
                } else {                                                                            \
                    int e_ = (int)kva_fastdiv((unsigned)j_, p.ps_mul, p.ps_shift);                  \
                    int pg_ = kva_ldg_i32(pidx + e_);                                               \
                    (SL)[u_] = j_ - e_ * p.page_size;                                               \
                    if (KVA_NO_BOUNDS_CHECK ||                                                      \
                        (unsigned long long)(unsigned)pg_ < (unsigned long long)p.num_pages) {      \
                        (PG)[u_] = pg_;                                                             \
                    } else {                                                                        \
                        unsigned long long k_ = ~(((unsigned long long)(unsigned)item.req << 32) |  \
                                                  (unsigned long long)(unsigned)pg_);               \
                        bad = 1;                                                                    \
                        bad_key = k_ > bad_key ? k_ : bad_key;                                      \
                    }                                                                               \
                }                                                                                   \
            }                                                                                       \
        }                                                                                           \
    } while (0)

#define KVA_ISSUE(T, PG, SL)                                                                        \
    do {                                                                                            \
        const unsigned st_ = pipe_addr + (unsigned)(((T) % KVA_STAGES) * KVA_STAGE_BYTES);          \
        if ((T) < ntiles) {                                                                         \
            _Pragma("unroll") for (int u_ = 0; u_ < KVA_UK; ++u_) {                                 \
                int row_ = tid / KVA_CPR + u_ * KVA_RSTEP;                                          \
                int col_ = tid % KVA_CPR;                                                           \
                bool ok_ = (PG)[u_] >= 0;                                                           \
                long long pgl_ = ok_ ? (long long)(PG)[u_] : 0ll;                                   \
                long long sll_ = ok_ ? (long long)(SL)[u_] : 0ll;                                   \
                const char* ks_ = kb + (pgl_ * p.k_stride_page + sll_ * p.k_stride_token) * KVA_ES + col_ * 16; \
                const char* vs_ = vb + (pgl_ * p.v_stride_page + sll_ * p.v_stride_token) * KVA_ES + col_ * 16; \
                unsigned off_ = (unsigned)(row_ * (KVA_DQK * KVA_ES) + col_ * 16);                  \
                kva_cp_async16(st_ + off_, ks_, ok_ ? 16u : 0u);                                    \
                kva_cp_async16(st_ + KVA_KTILE_BYTES + off_, vs_, ok_ ? 16u : 0u);                  \
            }                                                                                       \
        }                                                                                           \
    } while (0)

#pragma unroll
        for (int s = 0; s < KVA_STAGES - 1; ++s) KVA_FETCH(s, pg[s], sl[s]);

        /* ---- q (scaled; RoPE applied) into registers: q[r][e] = q'[row r][8*lx + e] ---- */
        float qr[KVA_ROWS][8];
        {
            const float qs = p.q_scale * KVA_KFIX;
#pragma unroll
            for (int r = 0; r < KVA_ROWS; ++r) {
                int pr = item.row_start + (r < item.rows ? r : item.rows - 1);
                int i = pr / g;
                int qh = kvh * g + pr % g;
                const unsigned short* qp = (const unsigned short*)p.q + (long long)(rq.qo_start + i) * p.q_stride_row +
                                           (long long)qh * p.q_stride_head;
                uint4 w = kva_ldg_nc16(qp + lx * 8);
                float f[8];
                KVA_QPAIR_TO_F32(w.x, &f[0], &f[1]);
                KVA_QPAIR_TO_F32(w.y, &f[2], &f[3]);
                KVA_QPAIR_TO_F32(w.z, &f[4], &f[5]);
                KVA_QPAIR_TO_F32(w.w, &f[6], &f[7]);
#if KVA_VAR_HAS(1) /* KVA_VARIANT_QUERY_TRANSFORM: on the raw q, before the scale */
#pragma unroll
                for (int e = 0; e < 8; ++e)
                    f[e] = kva_query_transform(vp, f[e], item.req, qh, rq.kv_len - rq.qo_len + i, lx * 8 + e);
#endif
#if KVA_ROPE
                uint4 w2 = kva_ldg_nc16(qp + (lx ^ (KVA_LX / 2)) * 8);
                float f2[8];
                KVA_QPAIR_TO_F32(w2.x, &f2[0], &f2[1]);
                KVA_QPAIR_TO_F32(w2.y, &f2[2], &f2[3]);
                KVA_QPAIR_TO_F32(w2.z, &f2[4], &f2[5]);
                KVA_QPAIR_TO_F32(w2.w, &f2[6], &f2[7]);
                const float pos = (float)(rq.kv_len - rq.qo_len + i);
#pragma unroll
                for (int e = 0; e < 8; ++e) {
                    float hi = pos * fr_hi[e];
                    float lo = fmaf(pos, fr_hi[e], -hi) + pos * fr_lo[e];
                    float n = rintf(hi * 0.15915494309189535f);
                    float rr = fmaf(-n, 6.28318548202514648f, hi);
                    rr = fmaf(n, 1.7484556e-7f, rr) + lo;
                    float sn, cs;
                    __sincosf(rr, &sn, &cs);
                    f[e] = f[e] * cs + rope_sign * f2[e] * sn;
                }
#endif
#pragma unroll
                for (int e = 0; e < 8; ++e) qr[r][e] = f[e] * qs;
            }
        }

        __syncthreads(); /* s_qpos & co visible; the previous item's epilogue is done with the pipe */

#pragma unroll
        for (int s = 0; s < KVA_STAGES - 1; ++s) {
            KVA_ISSUE(s, pg[s], sl[s]);
            kva_cp_async_commit();
        }
        KVA_FETCH(KVA_STAGES - 1, pg[0], sl[0]);

        float acc[KVA_ROWS][8];
#pragma unroll
        for (int r = 0; r < KVA_ROWS; ++r)
#pragma unroll
            for (int e = 0; e < 8; ++e) acc[r][e] = 0.0f;
        float m_run = neg_inf; /* row lane % ROWS */
        float d_run = 0.0f;
        const bool sigmoid = (flags & KVK_FLAG_SIGMOID) != 0;

        for (int t = 0; t < ntiles; ++t) {
            KVA_CP_ASYNC_WAIT(KVA_STAGES - 2);
            __syncthreads();
            KVA_ISSUE(t + KVA_STAGES - 1, pg[0], sl[0]);
            kva_cp_async_commit();
            KVA_FETCH(t + KVA_STAGES, pg[0], sl[0]);

            const unsigned kst = pipe_addr + (unsigned)((t % KVA_STAGES) * KVA_STAGE_BYTES);
            const unsigned vst = kst + KVA_KTILE_BYTES;
            const int tile0 = kv0 + t * KVA_TILE;

            /* ---- QK ---- */
            float ps[KVA_NQK];
#pragma unroll
            for (int k = 0; k < KVA_TPT; ++k) {
                const int jl = ty + k * KVA_NT;
                float kf[8];
                KVA_KV_TO_F32_8(kst + (unsigned)((jl * KVA_DQK + lx * 8) * KVA_ES), kf);
#if KVA_VAR_HAS(2) /* KVA_VARIANT_KEY_TRANSFORM: on the dequantised k (KVA_KFIX folds into q's scale) */
#pragma unroll
                for (int e = 0; e < 8; ++e)
                    kf[e] = kva_key_transform(vp, kf[e] * KVA_KFIX, item.req, kvh, tile0 + jl, lx * 8 + e) *
                            (1.0f / KVA_KFIX);
#endif
#if KVA_ROPE
                {
                    float part[8];
#pragma unroll
                    for (int e = 0; e < 8; ++e) part[e] = __shfl_xor_sync(0xffffffffu, kf[e], KVA_LX / 2);
                    const float pos = (float)(tile0 + jl);
#pragma unroll
                    for (int e = 0; e < 8; ++e) {
                        float hi = pos * fr_hi[e];
                        float lo = fmaf(pos, fr_hi[e], -hi) + pos * fr_lo[e];
                        float n = rintf(hi * 0.15915494309189535f);
                        float rr = fmaf(-n, 6.28318548202514648f, hi);
                        rr = fmaf(n, 1.7484556e-7f, rr) + lo;
                        float sn, cs;
                        __sincosf(rr, &sn, &cs);
                        kf[e] = kf[e] * cs + rope_sign * part[e] * sn;
                    }
                }
#endif
#pragma unroll
                for (int r = 0; r < KVA_ROWS; ++r) {
                    float a = qr[r][0] * kf[0];
#pragma unroll
                    for (int e = 1; e < 8; ++e) a = fmaf(qr[r][e], kf[e], a);
                    ps[k * KVA_ROWS + r] = a;
                }
            }
            /* reduce-scatter across the LX lanes of each token: step S keeps the half of the values selected by
               lane bit (LX/2 >> S) and adds the partner lane's copy of that half */
#define KVA_RS_STEP(S)                                                                              \
    {                                                                                               \
        const int o_ = (KVA_LX / 2) >> (S);                                                         \
        if ((KVA_NQK >> (S)) >= 2) {                                                                \
            const bool up_ = (lx & o_) != 0;                                                        \
            _Pragma("unroll") for (int i_ = 0; i_ < (KVA_NQK >> (S)) / 2; ++i_) {                   \
                float keep_ = up_ ? ps[i_ + (KVA_NQK >> (S)) / 2] : ps[i_];                         \
                float send_ = up_ ? ps[i_] : ps[i_ + (KVA_NQK >> (S)) / 2];                         \
                ps[i_] = keep_ + __shfl_xor_sync(0xffffffffu, send_, o_);                           \
            }                                                                                       \
        } else {                                                                                    \
            ps[0] += __shfl_xor_sync(0xffffffffu, ps[0], o_);                                       \
        }                                                                                           \
    }
            KVA_RS_STEP(0)
            KVA_RS_STEP(1)
            KVA_RS_STEP(2)
#if KVA_LOG_LX > 3
            KVA_RS_STEP(3)
#endif
#if KVA_LOG_LX > 4
            KVA_RS_STEP(4)
#endif
#undef KVA_RS_STEP
            {
#if KVA_NQK >= KVA_LX
                const int base = lx * KVA_NF;
                const bool writer = true;
#else
                const int base = lx / (KVA_LX / KVA_NQK);
                const bool writer = (lx % (KVA_LX / KVA_NQK)) == 0;
#endif
                if (writer) {
#pragma unroll
                    for (int i = 0; i < KVA_NF; ++i) {
                        const int idx = base + i;
                        const int k = idx / KVA_ROWS;
                        const int r = idx % KVA_ROWS;
                        const int jl = ty + k * KVA_NT;
                        const int j = tile0 + jl;
                        float x = ps[i];
                        bool vis = j < kv1;
                        if (flags & (KVK_FLAG_ALIBI | KVK_FLAG_SOFTCAP | KVK_FLAG_CAUSAL | KVK_FLAG_WINDOW |
                                     KVK_FLAG_CUSTOM)) {
                            const int qpos = s_qpos[r];
                            if (flags & KVK_FLAG_ALIBI) x += s_slope[r] * (float)(j - qpos);
                            if (flags & KVK_FLAG_SOFTCAP) x = p.softcap * kva_tanh(x * (1.0f / p.softcap));
                            if ((flags & KVK_FLAG_CAUSAL) && j > qpos) vis = false;
                            if ((flags & KVK_FLAG_WINDOW) && j < qpos - p.window_left) vis = false;
                            if ((flags & KVK_FLAG_CUSTOM) && vis) {
                                long long bit = s_mbit[r] + j;
                                if (((p.custom_mask[bit >> 3] >> (bit & 7)) & 1) == 0) vis = false;
                            }
                        }
#if KVA_VAR_HAS(4) || KVA_VAR_HAS(8) /* logits mask and transform, natural-log domain */
                        {
                            const int pr_ = item.row_start + (r < item.rows ? r : item.rows - 1);
                            const int qh_ = kvh * g + pr_ % g;
#if KVA_VAR_HAS(8)
                            if (vis && !kva_logits_mask(vp, item.req, qh_, kvh, s_qpos[r], j)) vis = false;
#endif
#if KVA_VAR_HAS(4)
                            if (vis) x = kva_logits_transform(vp, x, item.req, qh_, kvh, s_qpos[r], j);
#endif
                        }
#endif
#if KVA_VARIANT && !KVA_VAR_SOFTMAX
                        s_logit[jl * KVA_ROWS + r] = vis ? x : 0.0f; /* the weight itself; masked keys weigh 0 */
#else
                        if (flags & KVK_FLAG_TRANSFORM) x *= KVA_LOG2E;
                        s_logit[jl * KVA_ROWS + r] = vis ? x : neg_inf;
#endif
                    }
                }
            }
            __syncthreads();

            /* ---- softmax: row max of the tile (every warp), probabilities of this warp's tokens ---- */
            const int rr_ = lane % KVA_ROWS;
            float alpha = 1.0f, m_use = 0.0f;
            if (!sigmoid) {
                float mx = neg_inf;
#pragma unroll
                for (int m = 0; m < KVA_MV; ++m) {
                    const int jl = lane / KVA_ROWS + m * (32 / KVA_ROWS);
                    if (jl < KVA_TILE) mx = fmaxf(mx, s_logit[jl * KVA_ROWS + rr_]);
                }
#pragma unroll
                for (int o = KVA_ROWS; o < 32; o <<= 1) mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, o));
                const float m_new = fmaxf(m_run, mx);
                m_use = m_new == neg_inf ? 0.0f : m_new;
                alpha = kva_exp2(m_run - m_use);
                m_run = m_new;
                d_run *= alpha;
            }
            {
                float psum = 0.0f;
                const float sb = p.sigmoid_bias;
#pragma unroll
                for (int u = 0; u < KVA_MP; ++u) {
                    const int v = lane + 32 * u;
                    const int tt = v / KVA_ROWS;
                    if (tt < 4 * KVA_TG) {
                        const int jl = warp * KVA_TG + (tt % KVA_TG) + (tt / KVA_TG) * KVA_NT;
                        const float x = s_logit[jl * KVA_ROWS + rr_];
                        float pv;
#if KVA_VARIANT && !KVA_VAR_SOFTMAX
                        pv = x;
                        (void)sb;
#else
                        if (!sigmoid) pv = kva_exp2(x - m_use);
                        else pv = x == neg_inf ? 0.0f : kva_rcp(1.0f + kva_exp2(-(x + sb)));
#endif
                        s_p[jl * KVA_ROWS + rr_] = pv;
                        psum += pv;
                    }
                }
                d_run += psum;
            }
            if (!sigmoid) {
                float al[KVA_ROWS];
                bool any = false;
#pragma unroll
                for (int r = 0; r < KVA_ROWS; ++r) {
                    al[r] = __shfl_sync(0xffffffffu, alpha, r);
                    any |= al[r] != 1.0f;
                }
                if (any) {
#pragma unroll
                    for (int r = 0; r < KVA_ROWS; ++r)
#pragma unroll
                        for (int e = 0; e < 8; ++e) acc[r][e] *= al[r];
                }
            }
            __syncwarp();

            /* ---- PV ---- */
#pragma unroll
            for (int k = 0; k < KVA_TPT; ++k) {
                const int jl = ty + k * KVA_NT;
                float vf[8];
                KVA_KV_TO_F32_8(vst + (unsigned)((jl * KVA_DVO + lx * 8) * KVA_ES), vf);
                float pr[KVA_ROWS];
#if KVA_ROWS >= 4
#pragma unroll
                for (int r4 = 0; r4 < KVA_ROWS; r4 += 4) {
                    float4 q4 = *(const float4*)(s_p + jl * KVA_ROWS + r4);
                    pr[r4] = q4.x;
                    pr[r4 + 1] = q4.y;
                    pr[r4 + 2] = q4.z;
                    pr[r4 + 3] = q4.w;
                }
#elif KVA_ROWS == 2
                {
                    float2 q2 = *(const float2*)(s_p + jl * 2);
                    pr[0] = q2.x;
                    pr[1] = q2.y;
                }
#else
                pr[0] = s_p[jl];
#endif
#pragma unroll
                for (int r = 0; r < KVA_ROWS; ++r)
#pragma unroll
                    for (int e = 0; e < 8; ++e) acc[r][e] = fmaf(pr[r], vf[e], acc[r][e]);
            }
        }

        /* ---- epilogue ---- */
        KVA_CP_ASYNC_WAIT(0);
        const int faulted = __syncthreads_or(bad);
#pragma unroll
        for (int o = KVA_LX; o < 32; o <<= 1)
#pragma unroll
            for (int r = 0; r < KVA_ROWS; ++r)
#pragma unroll
                for (int e = 0; e < 8; ++e) acc[r][e] += __shfl_xor_sync(0xffffffffu, acc[r][e], o);
#pragma unroll
        for (int o = KVA_ROWS; o < 32; o <<= 1) d_run += __shfl_xor_sync(0xffffffffu, d_run, o);
        float* const red = (float*)pipe; /* [4][ROWS][DVO] */
        if (tgl == 0) {
#pragma unroll
            for (int r = 0; r < KVA_ROWS; ++r) {
                float* dst = red + (warp * KVA_ROWS + r) * KVA_DVO + lx * 8;
                *(float4*)dst = make_float4(acc[r][0], acc[r][1], acc[r][2], acc[r][3]);
                *(float4*)(dst + 4) = make_float4(acc[r][4], acc[r][5], acc[r][6], acc[r][7]);
            }
        }
        if (lane < KVA_ROWS) {
            s_dred[warp * 8 + lane] = d_run;
            if (warp == 0) s_m[lane] = m_run;
        }
        if (bad) {
            kvk_status* stw = (kvk_status*)p.ws;
            atomicMax((unsigned long long*)&stw->first_key, bad_key);
        }
        if (faulted && tid == 0) atomicAdd(&((kvk_status*)p.ws)->count, 1u);
        __syncthreads();

        {
            const bool to_partial = item.partial >= 0;
            float* const po = (float*)(p.ws + p.off_partial_o);
            float* const pl = (float*)(p.ws + p.off_partial_lse);
            for (int u = tid; u < KVA_ROWS * (KVA_DVO / 8); u += KVK_THREADS) {
                const int r = u / (KVA_DVO / 8);
                const int c = u % (KVA_DVO / 8);
                if (r >= item.rows) continue;
                float o8[8];
#pragma unroll
                for (int e = 0; e < 8; ++e) o8[e] = 0.0f;
                float dsum = 0.0f;
#pragma unroll
                for (int w = 0; w < 4; ++w) {
                    const float* src = red + (w * KVA_ROWS + r) * KVA_DVO + c * 8;
                    float4 a = *(const float4*)src;
                    float4 b = *(const float4*)(src + 4);
                    o8[0] += a.x;
                    o8[1] += a.y;
                    o8[2] += a.z;
                    o8[3] += a.w;
                    o8[4] += b.x;
                    o8[5] += b.y;
                    o8[6] += b.z;
                    o8[7] += b.w;
                    dsum += s_dred[w * 8 + r];
                }
                float scale = p.v_scale * KVA_KFIX;
                float lse;
                if (sigmoid) {
                    lse = 0.0f;
                } else {
                    scale = dsum > 0.0f ? scale / dsum : 0.0f;
                    lse = dsum > 0.0f ? s_m[r] + kva_log2(dsum) : neg_inf;
                }
                if (faulted) {
                    scale = 0.0f;
                    lse = to_partial ? __uint_as_float(KVK_FAULT_LSE_BITS) : neg_inf;
                }
#pragma unroll
                for (int e = 0; e < 8; ++e) o8[e] *= scale;
#if KVA_VAR_HAS(16) /* KVA_VARIANT_OUTPUT_TRANSFORM on a final row (split rows: in the variant's merge kernel) */
                if (!to_partial && !faulted) {
                    const int pr_ = item.row_start + r;
                    const int i_ = pr_ / g;
                    const int qh_ = kvh * g + pr_ % g;
#pragma unroll
                    for (int e = 0; e < 8; ++e)
                        o8[e] = kva_output_transform(vp, o8[e], sigmoid ? neg_inf : lse, item.req, qh_,
                                                     rq.kv_len - rq.qo_len + i_, c * 8 + e);
                }
#endif
                if (to_partial) {
                    float* dst = po + ((long long)item.partial * p.tile_q + r) * KVA_DVO + c * 8;
                    *(float4*)dst = make_float4(o8[0], o8[1], o8[2], o8[3]);
                    *(float4*)(dst + 4) = make_float4(o8[4], o8[5], o8[6], o8[7]);
                    if (c == 0) pl[(long long)item.partial * p.tile_q + r] = lse;
                } else {
                    const int pr = item.row_start + r;
                    const int i = pr / g;
                    const int qh = kvh * g + pr % g;
                    const long long orow = rq.qo_start + i;
#if KVA_OT == KVK_F32
                    float* dst = (float*)p.o + orow * p.o_stride_row + (long long)qh * p.o_stride_head + c * 8;
                    *(float4*)dst = make_float4(o8[0], o8[1], o8[2], o8[3]);
                    *(float4*)(dst + 4) = make_float4(o8[4], o8[5], o8[6], o8[7]);
#else
                    unsigned short* dst =
                        (unsigned short*)p.o + orow * p.o_stride_row + (long long)qh * p.o_stride_head + c * 8;
                    uint4 wv;
#if KVA_OT == KVK_F16
                    wv.x = kva_f32x2_to_f16x2(o8[0], o8[1]);
                    wv.y = kva_f32x2_to_f16x2(o8[2], o8[3]);
                    wv.z = kva_f32x2_to_f16x2(o8[4], o8[5]);
                    wv.w = kva_f32x2_to_f16x2(o8[6], o8[7]);
#else
                    wv.x = kva_f32x2_to_bf16x2(o8[0], o8[1]);
                    wv.y = kva_f32x2_to_bf16x2(o8[2], o8[3]);
                    wv.z = kva_f32x2_to_bf16x2(o8[4], o8[5]);
                    wv.w = kva_f32x2_to_bf16x2(o8[6], o8[7]);
#endif
                    *(uint4*)dst = wv;
#endif
                    if (c == 0 && p.lse) p.lse[orow * p.lse_stride_row + (long long)qh * p.lse_stride_head] = lse;
                }
            }
        }
        __syncthreads(); /* the pipe is reused by the next item */
    }
}

#undef KVA_FETCH
#undef KVA_ISSUE
#undef KVA_KV_TO_F32_8
#undef KVA_PAIR_TO_F32
#undef KVA_FP8X2
#undef KVA_QPAIR_TO_F32
#undef KVA_VAR_HAS
