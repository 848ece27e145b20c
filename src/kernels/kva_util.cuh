/*
 * kva_util.cuh - the small kernels: merge of a plan's split-KV partials (persistent, reads its task count from
 * the workspace), merge_state, merge_states, append_paged_kv. Dtypes and head dims are runtime arguments.
 * One warp per (row, head); lanes along the head dim.
 */
#include "kva_common.cuh"

/* kva_warp_max, kva_warp_sum, kva_store4, kva_merge_task_rows: kva_common.cuh */

/* ---------------------------------------------------------------------------------------------- */
/* Plan merge: task t merges partial slots partial_first .. +num_partials of rows [0, rows) of its tile. Three mappings:
   a CTA per task, its warps over the task's rows (row_units 0, the default); a warp per (task, row) over the whole
   grid (row_units 1: unit u is task u / tile_q, row u % tile_q; rows past the task's are skipped), which spreads a task
   of many rows (a row-slot unit of a GQA group of 9-32, a prefill tile) over many CTAs and SMs: one SM reads the
   partials at L2 rates of ~100 GB/s at best; a CTA per (task, row) whose warps take contiguous parts of the partials
   and combine them in shared memory (row_units 2: for many partials a row, a split unit of 64-128 chunks). row_units
   1 and 2 run in kva_merge_partials_rows. Row-slot decode plans whose merge tasks hold more than 512 (row, partial)
   pairs take row_units 1 by default (kva__cuda_merge_rows_pick, H100 A/B of session 43); row_units 2 stays a
   benchmark A/B (KVATTN_BENCH_MERGE_ROWS=2: slower than 1 on every shape measured). */

/* row_units 2: row r of task tk by the CTA (warp w: partials [n w / W, n (w + 1) / W)); the same arithmetic as
   kva_merge_task_rows up to the order of the sums (fault -> o = 0, lse = -inf; sigmoid scores: plain sums) */
KVA_DEV void kva_merge_row_cta(const kvk_merge_params& p, const kvk_merge_task& tk, int qo_start, int r, const float* po,
                               const float* pl, int warp, int nwarps, int lane) {
    __shared__ float s_m[KVK_THREADS / 32], s_s[KVK_THREADS / 32];
    __shared__ int s_f[KVK_THREADS / 32];
    __shared__ float4 s_acc[KVK_THREADS / 32][64];
    const float neg_inf = KVA_NEG_INF;
    const float4 zero = make_float4(0.f, 0.f, 0.f, 0.f);
    const int n = tk.num_partials;
    const int k0 = (int)((long long)n * warp / nwarps), k1 = (int)((long long)n * (warp + 1) / nwarps);
    const float* lr = pl + (long long)tk.partial_first * p.tile_q + r; /* lse of partial k: lr[k * tile_q] */
    const float* orow = po + ((long long)tk.partial_first * p.tile_q + r) * p.dvo;
    const long long ostep = (long long)p.tile_q * p.dvo;
    float mx = neg_inf;
    int fault = 0;
    for (int k = k0 + lane; k < k1; k += 32) {
        const float l = __ldcg(lr + (long long)k * p.tile_q);
        if (__float_as_uint(l) == KVK_FAULT_LSE_BITS) fault = 1;
        else mx = fmaxf(mx, l);
    }
    mx = kva_warp_max(mx);
    fault = __any_sync(KVA_FULL, fault);
    const float m_use = mx == neg_inf ? 0.0f : mx;
    const int c0 = lane * 4;
    float4 a0 = zero, a1 = zero;
    float wsum = 0.0f;
    for (int kb = k0; kb < k1; kb += 8) {
        float4 v0[8], v1[8];
        float w[8];
#pragma unroll
        for (int kk = 0; kk < 8; ++kk) {
            const int k = kb + kk;
            w[kk] = 0.0f;
            v0[kk] = v1[kk] = zero;
            if (k < k1) {
                const float l = __ldcg(lr + (long long)k * p.tile_q);
                w[kk] = p.sigmoid ? 1.0f : kva_exp2(l - m_use);
                if (c0 < p.dvo) v0[kk] = __ldcg((const float4*)(orow + (long long)k * ostep + c0));
                if (c0 + 128 < p.dvo) v1[kk] = __ldcg((const float4*)(orow + (long long)k * ostep + c0 + 128));
            }
        }
#pragma unroll
        for (int kk = 0; kk < 8; ++kk) {
            if (kb + kk >= k1) break;
            wsum += w[kk];
            a0.x = fmaf(w[kk], v0[kk].x, a0.x);
            a0.y = fmaf(w[kk], v0[kk].y, a0.y);
            a0.z = fmaf(w[kk], v0[kk].z, a0.z);
            a0.w = fmaf(w[kk], v0[kk].w, a0.w);
            a1.x = fmaf(w[kk], v1[kk].x, a1.x);
            a1.y = fmaf(w[kk], v1[kk].y, a1.y);
            a1.z = fmaf(w[kk], v1[kk].z, a1.z);
            a1.w = fmaf(w[kk], v1[kk].w, a1.w);
        }
    }
    if (lane == 0) {
        s_m[warp] = mx;
        s_s[warp] = wsum;
        s_f[warp] = fault;
    }
    s_acc[warp][lane] = a0;
    s_acc[warp][lane + 32] = a1;
    __syncthreads();
    if (warp == 0) {
        float M = neg_inf;
        int f = 0;
        for (int w = 0; w < nwarps; ++w) {
            M = fmaxf(M, s_m[w]);
            f |= s_f[w];
        }
        const float Mu = M == neg_inf ? 0.0f : M;
        float S = 0.0f;
        float4 o0 = zero, o1 = zero;
        for (int w = 0; w < nwarps; ++w) {
            const float fw = p.sigmoid ? 1.0f : (s_m[w] == neg_inf ? 0.0f : kva_exp2(s_m[w] - Mu));
            const float4 x0 = s_acc[w][lane], x1 = s_acc[w][lane + 32];
            S = fmaf(fw, s_s[w], S);
            o0 = make_float4(fmaf(fw, x0.x, o0.x), fmaf(fw, x0.y, o0.y), fmaf(fw, x0.z, o0.z), fmaf(fw, x0.w, o0.w));
            o1 = make_float4(fmaf(fw, x1.x, o1.x), fmaf(fw, x1.y, o1.y), fmaf(fw, x1.z, o1.z), fmaf(fw, x1.w, o1.w));
        }
        float scale = p.sigmoid ? 1.0f : (S > 0.0f ? kva_rcp(S) : 0.0f);
        if (f) scale = 0.0f;
        const int g = p.group_size, pr = tk.row_start + r, i = pr / g, qh = tk.kv_head * g + pr % g;
        const long long obase = ((long long)qo_start + i) * p.o_stride_row + (long long)qh * p.o_stride_head;
        if (c0 < p.dvo) kva_store4(p.o, obase + c0, p.o_dtype, o0.x * scale, o0.y * scale, o0.z * scale, o0.w * scale);
        if (c0 + 128 < p.dvo)
            kva_store4(p.o, obase + c0 + 128, p.o_dtype, o1.x * scale, o1.y * scale, o1.z * scale, o1.w * scale);
        if (lane == 0 && p.lse) {
            float l_out = p.sigmoid ? 0.0f : (S > 0.0f ? Mu + kva_log2(S) : neg_inf);
            if (f) l_out = neg_inf;
            p.lse[((long long)qo_start + i) * p.lse_stride_row + (long long)qh * p.lse_stride_head] = l_out;
        }
    }
    __syncthreads(); /* the shared slots are free for the next row */
}

extern "C" __global__ void __launch_bounds__(KVK_THREADS, 1) kva_merge_partials(const kvk_merge_params p) {
    kva_pdl_start(); /* programmatic dependent launch (kva_common.cuh) */
    kva_pdl_wait();
    const kvk_counts* counts = (const kvk_counts*)(p.ws + p.off_counts);
    const kvk_merge_task* tasks = (const kvk_merge_task*)(p.ws + p.off_merge);
    const kvk_request* reqs = (const kvk_request*)(p.ws + p.off_requests);
    const float* po = (const float*)(p.ws + p.off_partial_o);
    const float* pl = (const float*)(p.ws + p.off_partial_lse);
    const int ntasks = counts->num_merge;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nwarps = blockDim.x >> 5;
    for (int t = blockIdx.x; t < ntasks; t += gridDim.x) {
        const kvk_merge_task tk = tasks[t];
        kva_merge_task_rows(&tk, reqs[tk.req].qo_start, po, pl, p.tile_q, p.dvo, p.group_size, p.sigmoid, p.o,
                            p.o_dtype, p.o_stride_row, p.o_stride_head, p.lse, p.lse_stride_row, p.lse_stride_head,
                            warp, nwarps, lane, 16);
    }
}

/* The row mappings (row_units 1 and 2, above): a kernel of its own, so the default one keeps its code and
   registers. */
extern "C" __global__ void __launch_bounds__(KVK_THREADS, 1) kva_merge_partials_rows(const kvk_merge_params p) {
    kva_pdl_start();
    kva_pdl_wait();
    const kvk_counts* counts = (const kvk_counts*)(p.ws + p.off_counts);
    const kvk_merge_task* tasks = (const kvk_merge_task*)(p.ws + p.off_merge);
    const kvk_request* reqs = (const kvk_request*)(p.ws + p.off_requests);
    const float* po = (const float*)(p.ws + p.off_partial_o);
    const float* pl = (const float*)(p.ws + p.off_partial_lse);
    const int ntasks = counts->num_merge;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nwarps = blockDim.x >> 5;
    const long long nunits = (long long)ntasks * p.tile_q;
    if (p.row_units == 2) {
        for (long long u = blockIdx.x; u < nunits; u += gridDim.x) {
            const int t = (int)(u / p.tile_q), r = (int)(u % p.tile_q);
            const kvk_merge_task tk = tasks[t];
            if (r >= tk.rows) continue; /* (the whole CTA) */
            kva_merge_row_cta(p, tk, reqs[tk.req].qo_start, r, po, pl, warp, nwarps, lane);
        }
        return;
    }
    const long long stride = (long long)gridDim.x * nwarps;
    for (long long u = (long long)blockIdx.x * nwarps + warp; u < nunits; u += stride) {
        const int t = (int)(u / p.tile_q), r = (int)(u % p.tile_q);
        const kvk_merge_task tk = tasks[t];
        if (r >= tk.rows) continue;
        /* first row r, row step tile_q > r: row r alone */
        kva_merge_task_rows(&tk, reqs[tk.req].qo_start, po, pl, p.tile_q, p.dvo, p.group_size, p.sigmoid, p.o,
                            p.o_dtype, p.o_stride_row, p.o_stride_head, p.lse, p.lse_stride_row, p.lse_stride_head, r,
                            p.tile_q, lane, 16);
    }
}

/* ---------------------------------------------------------------------------------------------- */
/* merge_state: out = a (+) b per (row, head); rows with mask[row] == 0 are left untouched.        */

extern "C" __global__ void __launch_bounds__(KVK_THREADS, 1) kva_merge_state(const kvk_merge_state_params p) {
    const int lane = threadIdx.x & 31;
    const long long nwarps_total = (long long)gridDim.x * (blockDim.x >> 5);
    const float neg_inf = KVA_NEG_INF;
    for (long long w = (long long)blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5); w < p.rows * p.heads;
         w += nwarps_total) {
        const long long row = w / p.heads;
        const int h = (int)(w % p.heads);
        if (p.mask && p.mask[row] == 0) continue;
        const float sa = p.a.s[row * p.a.s_stride_row + h * p.a.s_stride_head];
        const float sb = p.b.s[row * p.b.s_stride_row + h * p.b.s_stride_head];
        const float m = fmaxf(sa, sb);
        const float m_use = m == neg_inf ? 0.0f : m;
        const float wa = kva_exp2(sa - m_use), wb = kva_exp2(sb - m_use);
        const float wsum = wa + wb;
        const float inv = wsum > 0.0f ? 1.0f / wsum : 0.0f;
        const float ca = wa * inv, cb = wb * inv;
        const long long oa = row * p.a.v_stride_row + h * p.a.v_stride_head;
        const long long ob = row * p.b.v_stride_row + h * p.b.v_stride_head;
        const long long oo = row * p.out.v_stride_row + h * p.out.v_stride_head;
        for (int d = lane; d < p.dim; d += 32) {
            float va = kva_load_elem(p.a.v, oa + d, p.a.dtype);
            float vb = kva_load_elem(p.b.v, ob + d, p.b.dtype);
            /* an empty state's v is ignored (it may hold anything) */
            float r = (ca != 0.0f ? ca * va : 0.0f) + (cb != 0.0f ? cb * vb : 0.0f);
            kva_store_elem(p.out.v, oo + d, p.out.dtype, r);
        }
        __syncwarp(); /* every lane has read sa/sb before s_out (which may alias) is written */
        if (lane == 0 && p.out.s)
            p.out.s[row * p.out.s_stride_row + h * p.out.s_stride_head] = wsum > 0.0f ? m_use + kva_log2(wsum) : neg_inf;
    }
}

/* merge_states: row r (of this launch's chunk) merges states indptr[r] .. indptr[r+1] (relative to row0's). */
extern "C" __global__ void __launch_bounds__(KVK_THREADS, 1) kva_merge_states(const kvk_merge_states_params p) {
    const int lane = threadIdx.x & 31;
    const long long nwarps_total = (long long)gridDim.x * (blockDim.x >> 5);
    const float neg_inf = KVA_NEG_INF;
    for (long long w = (long long)blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
         w < (long long)p.nrows * p.heads; w += nwarps_total) {
        const int r = (int)(w / p.heads);
        const int h = (int)(w % p.heads);
        const long long k0 = p.indptr[r], k1 = p.indptr[r + 1];
        float mx = neg_inf;
        for (long long k = k0 + lane; k < k1; k += 32)
            mx = fmaxf(mx, p.in.s[k * p.in.s_stride_row + h * p.in.s_stride_head]);
        mx = kva_warp_max(mx);
        const float m_use = mx == neg_inf ? 0.0f : mx;
        float wsum = 0.0f;
        for (long long k = k0; k < k1; ++k) wsum += kva_exp2(p.in.s[k * p.in.s_stride_row + h * p.in.s_stride_head] - m_use);
        const float inv = wsum > 0.0f ? 1.0f / wsum : 0.0f;
        const long long row = p.row0 + r;
        const long long oo = row * p.out.v_stride_row + h * p.out.v_stride_head;
        for (int d = lane; d < p.dim; d += 32) {
            float a = 0.0f;
            for (long long k = k0; k < k1; ++k) {
                const float wk = kva_exp2(p.in.s[k * p.in.s_stride_row + h * p.in.s_stride_head] - m_use);
                if (wk != 0.0f)
                    a = fmaf(wk, kva_load_elem(p.in.v, k * p.in.v_stride_row + h * p.in.v_stride_head + d, p.in.dtype), a);
            }
            kva_store_elem(p.out.v, oo + d, p.out.dtype, a * inv);
        }
        if (lane == 0 && p.out.s)
            p.out.s[row * p.out.s_stride_row + h * p.out.s_stride_head] = wsum > 0.0f ? m_use + kva_log2(wsum) : neg_inf;
    }
}

/* ---------------------------------------------------------------------------------------------- */
/* append_paged_kv: one warp per (token, head). Checks the request, its indptr range, the position and the page;
   a bad token is not written and is recorded in the status word (request = token index). */

KVA_DEV void kva_copy_row(char* dst, const char* src, int bytes, int vec, int lane) {
    if (vec == 16) {
        for (int b = lane * 16; b < bytes; b += 512) *(uint4*)(dst + b) = *(const uint4*)(src + b);
    } else if (vec == 8) {
        for (int b = lane * 8; b < bytes; b += 256) *(uint2*)(dst + b) = *(const uint2*)(src + b);
    } else if (vec == 4) {
        for (int b = lane * 4; b < bytes; b += 128) *(unsigned*)(dst + b) = *(const unsigned*)(src + b);
    } else if (vec == 2) {
        for (int b = lane * 2; b < bytes; b += 64) *(unsigned short*)(dst + b) = *(const unsigned short*)(src + b);
    } else {
        for (int b = lane; b < bytes; b += 32) dst[b] = src[b];
    }
}

extern "C" __global__ void __launch_bounds__(KVK_THREADS, 1) kva_append_paged(const kvk_append_params p) {
    const int lane = threadIdx.x & 31;
    const long long nwarps_total = (long long)gridDim.x * (blockDim.x >> 5);
    for (long long w = (long long)blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5); w < p.nnz * p.heads;
         w += nwarps_total) {
        const long long tok = w / p.heads;
        const int h = (int)(w % p.heads);
        int page = -1;    /* the fault report's page (clamped to 2^31 - 1) */
        long long pidx;   /* the page written */
        long long slot;
        bool ok;
        if (p.slots) { /* the slot form: a negative slot is padding */
            const long long sl = p.slots[tok];
            if (sl < 0) continue;
            const long long pg = sl / p.page_size;
            ok = pg < p.num_pages;
            page = pg > 0x7fffffffLL ? 0x7fffffff : (int)pg;
            pidx = pg;
            slot = sl % p.page_size;
        } else {
            const int b = p.batch_indices[tok];
            const int pos = p.positions[tok];
            ok = b >= 0 && b < p.batch_size && pos >= 0;
            if (ok) {
                const int e0 = p.indptr[b], e1 = p.indptr[b + 1];
                /* a malformed indptr (negative, decreasing, or past the table where its length is known) must not
                   index outside indices: the request's tokens are refused */
                const bool table_ok =
                    e0 >= 0 && e1 >= e0 && (p.num_indices == 0 || (long long)e1 <= p.num_indices);
                const int npages = table_ok ? e1 - e0 : 0;
                const int lpl = npages > 0 ? p.last_page_len[b] : 0;
                /* a malformed last_page_len must not let pos / page_size index past the request's pages */
                const long long len =
                    (npages > 0 && lpl >= 1 && lpl <= p.page_size) ? (long long)(npages - 1) * p.page_size + lpl : 0;
                ok = pos < len;
                if (ok) {
                    page = p.indices[e0 + pos / p.page_size];
                    ok = (unsigned long long)(unsigned)page < (unsigned long long)p.num_pages;
                }
            }
            slot = pos % p.page_size;
            pidx = page;
        }
        if (!ok) {
            if (lane == 0 && h == 0) {
                unsigned long long key = ((unsigned long long)(unsigned)tok << 32) | (unsigned long long)(unsigned)page;
                atomicMax((unsigned long long*)&p.status->first_key, ~key);
                atomicAdd(&p.status->count, 1u);
            }
            continue;
        }
        char* kd = p.k + pidx * p.k_stride_page + slot * p.k_stride_token + h * p.k_stride_head;
        char* vd = p.v + pidx * p.v_stride_page + slot * p.v_stride_token + h * p.v_stride_head;
        const char* ks = p.ak + tok * p.ak_stride_tok + h * p.ak_stride_head;
        const char* vs = p.av + tok * p.av_stride_tok + h * p.av_stride_head;
        if (p.src_dtype == p.dst_dtype) {
            kva_copy_row(kd, ks, p.k_row_bytes, p.vec, lane);
            kva_copy_row(vd, vs, p.v_row_bytes, p.vec, lane);
        } else {
            for (int d = lane; d < p.head_dim_qk; d += 32)
                kva_store_elem(kd, d, p.dst_dtype, kva_load_elem(ks, d, p.src_dtype));
            for (int d = lane; d < p.head_dim_vo; d += 32)
                kva_store_elem(vd, d, p.dst_dtype, kva_load_elem(vs, d, p.src_dtype));
        }
    }
}
