/*
 * hbm_read.cu - the device's read ceiling for decode-like access patterns (benchmark tool, not part of the library).
 *
 * Each pattern reads `bytes` of K and V once after a cold-L2 flush (a 512 MB memset) and writes one word per CTA;
 * CUDA events, median of 20. Patterns:
 *   contig : every CTA reads one contiguous slice of the buffer
 *   nhd    : a paged NHD pool, 16-token pages of H_kv heads x 256 B rows, pages scattered; CTA (head, chunk)
 *            reads its head's 256 B row of every token of its chunk (what a decode item reads)
 *   hnd    : the same pool read as HND: a head's 16 rows of a page are one contiguous 4 KB block
 *   nhdall : the NHD pool, each CTA reading whole pages (every head of its tokens: 8 KB per token pair of K+V)
 * Every pattern runs with plain loads and with loads under the L2 evict-first policy ("+ef"), which leaves the
 * flush's dirty lines in L2 instead of paying their write-back inside the timed window.
 * Loads: ld.global.nc.L1::no_allocate.v4, UNROLL in flight per thread, 256 threads, 2 CTAs per SM.
 *
 * --floor: the fixed cost of a small call under the same protocol, no bandwidth: an empty kernel (264 x 128 threads,
 * without and with 113 KB of dynamic shared memory, like the decode kernel) and a kernel whose CTAs each chase
 * N dependent pointers through cold memory, timed as an eager launch and as a CUDA-graph replay after the flush,
 * and as back-to-back graph replays (warm).
 *
 * Asynchronous copies into shared memory (sm_90, "async" rows): one warp per CTA keeps S stages (of 8 KB x G: K and
 * V) in flight and re-issues a stage as soon as its mbarrier completes; S x stage bytes x CTAs per SM is the amount
 * in flight per SM. Patterns:
 *   tma-nhd : the NHD pool through 4-d tensor maps {128, 16, H, pages}, boxes {64, 16, G, 1} with the 128-byte
 *             swizzle (2 boxes per page slice of K, 2 of V), CTA (head group, chunk) as in nhd
 *   bulk-row: the NHD pool through 1-d bulk copies of one token's G heads (G x 256 B), 16 K + 16 V copies per page
 *             issued by 32 lanes, rows padded by 16 B in shared memory
 *   bulk-pg : whole pages (all heads) through 1-d bulk copies of 4 KB (a ceiling only: no MMA-friendly layout)
 *   bulk-ctg: contiguous slices through 1-d bulk copies of 4 KB
 * Tensor-map rows also vary the L2 promotion (p0 256 B, p1 none, p2 128 B) and the box form (form 1, "nsw": {128, 16, G}
 * without swizzle; form 2, "hfo": {64, G, 16} over a {d, heads, tokens, pages} map).
 *
 * usage: hbm_read [--floor] [--async-only] [MB of K+V ...]   (default 134 1074 2147; --floor alone: only the floor)
 */
#include <string.h>
#include "cuda_tool.cuh"

#define UNROLL 8
#define THREADS 256

__device__ int g_hint; /* 1: loads under the L2 evict-first policy (what the decode kernel's K/V copies use) */
__device__ __forceinline__ uint4 ldg_na(const void* p) {
    uint4 v;
    if (g_hint) {
        unsigned long long pol;
        asm volatile("createpolicy.fractional.L2::evict_first.b64 %0, 1.0;" : "=l"(pol));
        asm volatile("ld.global.nc.L1::no_allocate.L2::cache_hint.v4.u32 {%0,%1,%2,%3}, [%4], %5;"
                     : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
                     : "l"(p), "l"(pol));
    } else {
        asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0,%1,%2,%3}, [%4];"
                     : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
                     : "l"(p));
    }
    return v;
}

/* contiguous slice per CTA, 16 B per thread per load, UNROLL loads in flight */
__global__ void __launch_bounds__(THREADS) k_contig(const char* k, const char* v, size_t half, unsigned* out) {
    const size_t per = ((half + gridDim.x - 1) / gridDim.x + 4095) & ~(size_t)4095;
    const size_t b0 = per * blockIdx.x < half ? per * blockIdx.x : half, b1 = b0 + per < half ? b0 + per : half;
    unsigned acc = 0;
    for (size_t o = b0 + (size_t)threadIdx.x * 16; o < b1; o += (size_t)THREADS * 16 * UNROLL) {
        uint4 r[2 * UNROLL];
#pragma unroll
        for (int u = 0; u < UNROLL; ++u) {
            const size_t a = o + (size_t)u * THREADS * 16;
            r[2 * u] = a < b1 ? ldg_na(k + a) : make_uint4(0, 0, 0, 0);
            r[2 * u + 1] = a < b1 ? ldg_na(v + a) : make_uint4(0, 0, 0, 0);
        }
#pragma unroll
        for (int u = 0; u < 2 * UNROLL; ++u) acc ^= r[u].x ^ r[u].y ^ r[u].z ^ r[u].w;
    }
    if (acc == 0x12345678u) out[blockIdx.x] = acc;
}

/* paged pool: page = 16 tokens x H heads x 256 B. CTA b: head b % H, chunk b / H of the page list.
   mode 0: NHD rows (token t, head h at (t * H + h) * 256), mode 1: HND (h * 16 + t) * 256, mode 2: whole pages */
__global__ void __launch_bounds__(THREADS) k_paged(const char* k, const char* v, const int* pages, int npages, int H,
                                                   int mode, unsigned* out) {
    const int nchunks = mode == 2 ? gridDim.x : gridDim.x / H;
    const int head = mode == 2 ? 0 : blockIdx.x % H;
    const int chunk = mode == 2 ? blockIdx.x : blockIdx.x / H;
    const int p0 = (int)((long long)npages * chunk / nchunks), p1 = (int)((long long)npages * (chunk + 1) / nchunks);
    const size_t page_bytes = (size_t)16 * H * 256;
    unsigned acc = 0;
    if (mode < 2) {
        /* one warp-load = 2 rows of 256 B; a page slice = 16 rows = 8 warp-loads; thread i: row (i / 16) of a
           group of 16 rows, 16 B chunk i % 16 */
        const int rows = (p1 - p0) * 16;
        for (int r0 = threadIdx.x / 16; r0 < rows; r0 += (THREADS / 16) * UNROLL) {
            uint4 a[2 * UNROLL];
#pragma unroll
            for (int u = 0; u < UNROLL; ++u) {
                const int r = r0 + u * (THREADS / 16);
                if (r < rows) {
                    const int pg = pages[p0 + r / 16], t = r % 16;
                    const size_t off = (size_t)pg * page_bytes +
                                       (size_t)(mode == 0 ? (t * H + head) : (head * 16 + t)) * 256 + (threadIdx.x % 16) * 16;
                    a[2 * u] = ldg_na(k + off);
                    a[2 * u + 1] = ldg_na(v + off);
                } else {
                    a[2 * u] = a[2 * u + 1] = make_uint4(0, 0, 0, 0);
                }
            }
#pragma unroll
            for (int u = 0; u < 2 * UNROLL; ++u) acc ^= a[u].x ^ a[u].y ^ a[u].z ^ a[u].w;
        }
    } else {
        const size_t n16 = page_bytes / 16;
        const size_t tot = (size_t)(p1 - p0) * n16;
        for (size_t i0 = threadIdx.x; i0 < tot; i0 += (size_t)THREADS * UNROLL) {
            uint4 a[2 * UNROLL];
#pragma unroll
            for (int u = 0; u < UNROLL; ++u) {
                const size_t i = i0 + (size_t)u * THREADS;
                if (i < tot) {
                    const size_t off = (size_t)pages[p0 + i / n16] * page_bytes + (i % n16) * 16;
                    a[2 * u] = ldg_na(k + off);
                    a[2 * u + 1] = ldg_na(v + off);
                } else {
                    a[2 * u] = a[2 * u + 1] = make_uint4(0, 0, 0, 0);
                }
            }
#pragma unroll
            for (int u = 0; u < 2 * UNROLL; ++u) acc ^= a[u].x ^ a[u].y ^ a[u].z ^ a[u].w;
        }
    }
    if (acc == 0x12345678u) out[blockIdx.x] = acc;
}

/* ---- asynchronous copies (sm_90): mbarrier-completed TMA / bulk copies issued by one warp per CTA ---- */
__device__ __forceinline__ unsigned smem_u32(const void* p) { return (unsigned)__cvta_generic_to_shared(p); }
/* bytes of one stage: G heads x 16 tokens of K and V (tma-nhd, bulk-pg), 32 padded rows of G heads (bulk-row), 8 KB
   (bulk-ctg) */
__host__ __device__ constexpr int stage_bytes(int pat, int G) {
    return pat == 0 || pat == 3 ? 8192 * G : pat == 1 ? 32 * (G * 256 + 16) : 8192;
}
__global__ void __launch_bounds__(32) k_async(const __grid_constant__ CUtensorMap mk, const __grid_constant__ CUtensorMap mv,
                                             const char* k, const char* v, size_t half, const int* pages, int npages,
                                             int H, int pat, int S, int G, int form, unsigned* out) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    extern __shared__ __align__(1024) char sm_[];
    const int SB = stage_bytes(pat, G);
    unsigned long long* bar = (unsigned long long*)(sm_ + (size_t)S * SB);
    const int HG = H / G; /* head groups */
    const int nchunks = pat == 2 ? gridDim.x : gridDim.x / HG;
    const int head = pat == 2 ? 0 : (blockIdx.x % HG) * G;
    const int chunk = pat == 2 ? blockIdx.x : blockIdx.x / HG;
    long long n, i0;
    if (pat == 2) { /* 8 KB items: 4 KB of K and 4 KB of V at the same offset */
        const long long items = (long long)(half / 4096);
        i0 = items * chunk / nchunks, n = items * (chunk + 1) / nchunks - i0;
    } else {
        i0 = (long long)npages * chunk / nchunks, n = (long long)npages * (chunk + 1) / nchunks - i0;
    }
    const int lane = threadIdx.x;
    if (lane == 0) {
        for (int s = 0; s < S; ++s)
            asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" ::"r"(smem_u32(bar + s)) : "memory");
        asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
    }
    __syncwarp();
    unsigned long long pol;
    asm volatile("createpolicy.fractional.L2::evict_first.b64 %0, 1.0;" : "=l"(pol));
    auto issue = [&](long long it, int s) {
        const unsigned b = smem_u32(bar + s), dst = smem_u32(sm_ + (size_t)s * SB);
        if (lane == 0)
            asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(b), "r"(pat == 1 ? 32 * G * 256 : SB)
                         : "memory");
        __syncwarp();
        if (pat != 1 && lane != 0) return;
        if (pat == 3) { /* whole pages (G = H): 4 KB pieces */
            const size_t base = (size_t)pages[i0 + it] * 16 * H * 256;
            for (int q = 0; q < SB / 8192; ++q) {
                asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], 4096, [%2];"
                             ::"r"(dst + q * 4096), "l"(k + base + q * 4096), "r"(b) : "memory");
                asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], 4096, [%2];"
                             ::"r"(dst + SB / 2 + q * 4096), "l"(v + base + q * 4096), "r"(b) : "memory");
            }
        } else if (pat == 0 && form == 2) { /* map {d, H, tokens, pages}: box {64, G, 16, 1} */
            const int pg = pages[i0 + it];
            for (int h2 = 0; h2 < 2; ++h2) {
                asm volatile("cp.async.bulk.tensor.4d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3, %4, %5}], [%6];"
                             ::"r"(dst + h2 * (SB / 4)), "l"(&mk), "r"(h2 * 64), "r"(head), "r"(0), "r"(pg), "r"(b) : "memory");
                asm volatile("cp.async.bulk.tensor.4d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3, %4, %5}], [%6];"
                             ::"r"(dst + SB / 2 + h2 * (SB / 4)), "l"(&mv), "r"(h2 * 64), "r"(head), "r"(0), "r"(pg), "r"(b) : "memory");
            }
        } else if (pat == 0) {
            const int pg = pages[i0 + it];
            for (int h2 = 0; h2 < 2 - form; ++h2) {
                asm volatile("cp.async.bulk.tensor.4d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3, %4, %5}], [%6];"
                             ::"r"(dst + h2 * (SB / 4)), "l"(&mk), "r"(h2 * 64), "r"(0), "r"(head), "r"(pg), "r"(b) : "memory");
                asm volatile("cp.async.bulk.tensor.4d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3, %4, %5}], [%6];"
                             ::"r"(dst + SB / 2 + h2 * (SB / 4)), "l"(&mv), "r"(h2 * 64), "r"(0), "r"(head), "r"(pg), "r"(b) : "memory");
            }
        } else if (pat == 1) { /* lanes 0-15: K rows, 16-31: V rows; one bulk copy of G x 256 B each */
            const size_t base = (size_t)pages[i0 + it] * 16 * H * 256;
            const int t = lane & 15;
            const size_t off = base + (size_t)(t * H + head) * 256;
            const unsigned rb = (unsigned)(G * 256 + 16);
            asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes.L2::cache_hint [%0], [%1], %2, [%3], %4;"
                         ::"r"(dst + (lane >> 4) * 16 * rb + t * rb), "l"((lane < 16 ? k : v) + off), "r"(G * 256), "r"(b),
                         "l"(pol) : "memory");
        } else {
            const size_t off = (size_t)(i0 + it) * 4096;
            asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], 4096, [%2];"
                         ::"r"(dst), "l"(k + off), "r"(b) : "memory");
            asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], 4096, [%2];"
                         ::"r"(dst + 4096), "l"(v + off), "r"(b) : "memory");
        }
    };
    for (int s = 0; s < S && s < n; ++s) issue(s, s);
    unsigned acc = 0;
    for (long long it = 0; it < n; ++it) {
        const int s = (int)(it % S);
        const unsigned par = (unsigned)((it / S) & 1);
        unsigned done = 0;
        while (!done)
            asm volatile("{ .reg .pred p; mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2; selp.u32 %0, 1, 0, p; }"
                         : "=r"(done) : "r"(smem_u32(bar + s)), "r"(par) : "memory");
        acc ^= *(volatile unsigned*)(sm_ + (size_t)s * SB + (it & 63) * 4);
        __syncwarp();
        if (it + S < n) issue(it + S, s);
    }
    if (acc == 0x12345678u) out[blockIdx.x] = acc;
#endif
}

/* {128 elements, 16 tokens, H heads, pages} over an NHD pool of 16-bit elements, box {64, 16, G, 1} with the 128 B
   swizzle (form 0), {128, 16, G, 1} without swizzle (form 1), or {64, G, 16, 1} over {d, heads, tokens, pages} (form 2) */
static void nhd_map(encode_fn enc, CUtensorMap* m, void* base, int H, int npages, int G, int form, int promo) {
    cuuint64_t dims[4] = {128, 16, (cuuint64_t)H, (cuuint64_t)npages};
    cuuint64_t st[3] = {(cuuint64_t)H * 256, 256, (cuuint64_t)16 * H * 256};
    cuuint32_t box[4] = {form == 1 ? 128u : 64u, 16, (cuuint32_t)G, 1};
    const cuuint32_t es[4] = {1, 1, 1, 1};
    if (form == 2) { /* {d, heads, tokens, pages} */
        dims[1] = (cuuint64_t)H, dims[2] = 16, st[0] = 256, st[1] = (cuuint64_t)H * 256;
        box[1] = (cuuint32_t)G, box[2] = 16;
    }
    const CUtensorMapL2promotion pr[3] = {CU_TENSOR_MAP_L2_PROMOTION_L2_256B, CU_TENSOR_MAP_L2_PROMOTION_NONE,
                                          CU_TENSOR_MAP_L2_PROMOTION_L2_128B};
    const CUresult r = enc(m, CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, 4, base, dims, st, box, es, CU_TENSOR_MAP_INTERLEAVE_NONE,
                           form == 1 ? CU_TENSOR_MAP_SWIZZLE_NONE : CU_TENSOR_MAP_SWIZZLE_128B, pr[promo],
                           CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
    if (r != CUDA_SUCCESS) {
        fprintf(stderr, "cuTensorMapEncodeTiled failed (%d)\n", (int)r);
        exit(1);
    }
}

__global__ void k_empty(unsigned* out) {
    extern __shared__ char sm_[];
    if (threadIdx.x == 0 && out == nullptr) sm_[0] = 0;
}
/* thread 0 of each CTA follows `n` dependent links through `chain` (one per 4 KB, CTA-specific start) */
__global__ void k_chase(const unsigned* chain, unsigned nlinks, int n, unsigned* out) {
    extern __shared__ char sm_[];
    if (threadIdx.x != 0) return;
    unsigned i = (blockIdx.x * 7919u) % nlinks;
    for (int k = 0; k < n; ++k) {
        asm volatile("ld.global.nc.u32 %0, [%1];" : "=r"(i) : "l"(chain + (size_t)i * 1024));
    }
    out[blockIdx.x] = i;
    (void)sm_;
}

/* instruction fetch: 4096 ALU instructions (64 KB of code) run once in straight-line code, against the same count
   run as a 64-instruction loop body (hot in the instruction cache); 8 independent register chains */
#define CODE_BLK                                                                                                   \
    asm volatile("lop3.b32 %0, %0, %1, %2, 0x96;\n\tshf.l.wrap.b32 %1, %1, %3, 5;\n\tlop3.b32 %2, %2, %3, %4, 0x96;\n\t" \
                 "shf.l.wrap.b32 %3, %3, %5, 7;\n\tlop3.b32 %4, %4, %5, %6, 0x96;\n\tshf.l.wrap.b32 %5, %5, %7, 9;\n\t"  \
                 "lop3.b32 %6, %6, %7, %0, 0x96;\n\tshf.l.wrap.b32 %7, %7, %0, 11;"                                     \
                 : "+r"(x0), "+r"(x1), "+r"(x2), "+r"(x3), "+r"(x4), "+r"(x5), "+r"(x6), "+r"(x7));
#define CODE_R8(x) x x x x x x x x
__global__ void k_code_line(unsigned* out) {
    unsigned x0 = threadIdx.x, x1 = blockIdx.x, x2 = x0 * 3u, x3 = x1 ^ 7u, x4 = x0 + 5u, x5 = x1 * 9u, x6 = ~x0, x7 = ~x1;
    CODE_R8(CODE_R8(CODE_R8(CODE_BLK)))
    if ((x0 ^ x1 ^ x2 ^ x3 ^ x4 ^ x5 ^ x6 ^ x7) == 0x12345678u) out[blockIdx.x] = x0;
}
__global__ void k_code_loop(unsigned* out) {
    unsigned x0 = threadIdx.x, x1 = blockIdx.x, x2 = x0 * 3u, x3 = x1 ^ 7u, x4 = x0 + 5u, x5 = x1 * 9u, x6 = ~x0, x7 = ~x1;
#pragma unroll 1
    for (int i = 0; i < 64; ++i) { CODE_R8(CODE_BLK) }
    if ((x0 ^ x1 ^ x2 ^ x3 ^ x4 ^ x5 ^ x6 ^ x7) == 0x12345678u) out[blockIdx.x] = x0;
}

static void floor_probe(void* flush, size_t flush_bytes, unsigned* out, int sms, cudaEvent_t e0, cudaEvent_t e1) {
    const unsigned nlinks = 16384; /* 64 MB: more than the L2 */
    unsigned* chain;
    CU(cudaMalloc(&chain, (size_t)nlinks * 4096));
    std::vector<unsigned> hc((size_t)nlinks * 1024, 0);
    unsigned long long s = 0x9e3779b97f4a7c15ull;
    for (unsigned i = 0; i < nlinks; ++i) {
        s ^= s << 13, s ^= s >> 7, s ^= s << 17;
        hc[(size_t)i * 1024] = (unsigned)(s % nlinks);
    }
    CU(cudaMemcpy(chain, hc.data(), hc.size() * 4, cudaMemcpyHostToDevice));
    const int smem_big = 113 * 1024;
    CU(cudaFuncSetAttribute(k_empty, cudaFuncAttributeMaxDynamicSharedMemorySize, smem_big));
    CU(cudaFuncSetAttribute(k_chase, cudaFuncAttributeMaxDynamicSharedMemorySize, smem_big));
    cudaStream_t st;
    CU(cudaStreamCreateWithFlags(&st, cudaStreamNonBlocking));
    struct cfg { const char* name; int chase; int smem; };
    const cfg cfgs[] = {{"empty, no smem", -1, 0}, {"empty, 113 KB smem", -1, smem_big}, {"chase 1", 1, smem_big},
                        {"chase 2", 2, smem_big}, {"chase 4", 4, smem_big}, {"chase 8", 8, smem_big},
                        {"code 64 KB straight", -2, 0}, {"code 64 KB as loop", -3, 0}};
    const int grid = 2 * sms;
    printf("floor (grid %d x 128 threads; cold = after a 512 MB memset; medians of 30):\n", grid);
    for (const cfg& c : cfgs) {
        auto launch = [&](cudaStream_t q) {
            if (c.chase == -2) k_code_line<<<grid, 128, 0, q>>>(out);
            else if (c.chase == -3) k_code_loop<<<grid, 128, 0, q>>>(out);
            else if (c.chase < 0) k_empty<<<grid, 128, c.smem, q>>>(out);
            else k_chase<<<grid, 128, c.smem, q>>>(chain, nlinks, c.chase, out);
        };
        cudaGraph_t g;
        cudaGraphExec_t ge;
        CU(cudaStreamBeginCapture(st, cudaStreamCaptureModeThreadLocal));
        launch(st);
        CU(cudaStreamEndCapture(st, &g));
        CU(cudaGraphInstantiate(&ge, g, 0));
        double med[2];
        for (int mode = 0; mode < 2; ++mode) { /* 0 eager launch, 1 graph replay */
            med[mode] = cold_median_us(flush, flush_bytes, e0, e1, st, 3, 30, [&] {
                if (mode) CU(cudaGraphLaunch(ge, st));
                else launch(st);
            });
        }
        const int reps = 200;
        CU(cudaEventRecord(e0, st));
        for (int r = 0; r < reps; ++r) CU(cudaGraphLaunch(ge, st));
        CU(cudaEventRecord(e1, st));
        CU(cudaEventSynchronize(e1));
        float ms;
        CU(cudaEventElapsedTime(&ms, e0, e1));
        CU(cudaGetLastError());
        printf("  %-20s cold eager %6.2f us   cold graph %6.2f us   warm graph back to back %6.2f us\n", c.name, med[0],
               med[1], ms * 1000.0 / reps);
        cudaGraphExecDestroy(ge);
        cudaGraphDestroy(g);
    }
    CU(cudaStreamDestroy(st));
    cudaFree(chain);
}

int main(int argc, char** argv) {
    std::vector<double> mbs;
    bool do_floor = false, async_only = false;
    for (int i = 1; i < argc; ++i) {
        if (!strcmp(argv[i], "--floor")) do_floor = true;
        else if (!strcmp(argv[i], "--async-only")) async_only = true;
        else mbs.push_back(atof(argv[i]));
    }
    if (mbs.empty() && !do_floor) mbs = {134.2, 1073.7, 2147.5};
    cudaDeviceProp prop;
    CU(cudaGetDeviceProperties(&prop, 0));
    const double nominal = strstr(prop.name, "H200") ? 4.8 : strstr(prop.name, "H100") ? 3.35 : 0.0;
    printf("hbm_read: %s, %d SMs, nominal %.2f TB/s\n", prop.name, prop.multiProcessorCount, nominal);
    const size_t flush_bytes = (size_t)512 << 20;
    void* flush;
    CU(cudaMalloc(&flush, flush_bytes));
    unsigned* out;
    CU(cudaMalloc(&out, 1 << 20));
    cudaEvent_t e0, e1;
    CU(cudaEventCreate(&e0));
    CU(cudaEventCreate(&e1));
    const int H = 8, sms = prop.multiProcessorCount;
    if (do_floor) floor_probe(flush, flush_bytes, out, sms, e0, e1);
    for (double mb : mbs) {
        const size_t page_bytes = (size_t)16 * H * 256;
        const int npages = (int)(mb * 1e6 / 2 / page_bytes);
        const size_t half = (size_t)npages * page_bytes;
        char *k, *v;
        CU(cudaMalloc(&k, half));
        CU(cudaMalloc(&v, half));
        CU(cudaMemset(k, 1, half));
        CU(cudaMemset(v, 2, half));
        std::vector<int> hp(npages);
        for (int i = 0; i < npages; ++i) hp[i] = i;
        unsigned long long s = 88172645463325252ull;
        for (int i = npages - 1; i > 0; --i) {
            s ^= s << 13, s ^= s >> 7, s ^= s << 17;
            std::swap(hp[i], hp[s % (unsigned long long)(i + 1)]);
        }
        int* dp;
        CU(cudaMalloc(&dp, sizeof(int) * npages));
        CU(cudaMemcpy(dp, hp.data(), sizeof(int) * npages, cudaMemcpyHostToDevice));
        const char* names[] = {"contig", "nhd", "hnd", "nhdall"};
        for (int hint = 0; hint <= 1 && !async_only; ++hint)
        for (int ctas_per_sm = 1; ctas_per_sm <= 2; ++ctas_per_sm) {
            CU(cudaMemcpyToSymbol(g_hint, &hint, sizeof hint));
            for (int pat = 0; pat < 4; ++pat) {
                int grid = sms * ctas_per_sm;
                if (pat == 1 || pat == 2) grid = grid / H * H;
                const double us = cold_median_us(flush, flush_bytes, e0, e1, 0, 2, 20, [&] {
                    if (pat == 0) k_contig<<<grid, THREADS>>>(k, v, half, out);
                    else k_paged<<<grid, THREADS>>>(k, v, dp, npages, H, pat - 1, out);
                });
                const double tbs = 2.0 * half / (us * 1e-6) / 1e12;
                printf("%8.1f MB  %-7s%-3s %d CTA/SM (%4d CTAs)  %9.1f us  %6.3f TB/s  %5.1f %% of nominal\n", 2.0 * half / 1e6,
                       names[pat], hint ? "+ef" : "", ctas_per_sm, grid, us, tbs, nominal > 0 ? 100.0 * tbs / nominal : 0.0);
            }
        }
        if (prop.major >= 9) {
            const encode_fn enc = tensor_map_encoder();
            const char* anames[] = {"tma-nhd", "bulk-row", "bulk-ctg", "bulk-pg"};
            /* {pattern, heads per CTA, map form (0: box {64, 16 tokens, G}, swizzled; 1: box {128, 16, G}, not
               swizzled; 2: box {64, G, 16 tokens}, swizzled), CTAs per SM, KB in flight per CTA, L2 promotion
               (0: 256 B, 1: none, 2: 128 B)} */
            const int cfg[][6] = {{0, 1, 0, 2, 48, 0}, {0, 1, 0, 2, 48, 1}, {0, 1, 0, 2, 48, 2}, {0, 1, 0, 2, 96, 1},
                                  {0, 1, 0, 1, 96, 1}, {0, 1, 1, 2, 48, 1}, {0, 2, 0, 2, 48, 1}, {0, 4, 0, 2, 96, 1},
                                  {0, 8, 0, 1, 192, 0}, {0, 8, 0, 1, 192, 1}, {3, 8, 0, 1, 128, 0}, {2, 1, 0, 2, 48, 0}};
            for (const auto& c : cfg) {
                    const int pat = c[0], G = c[1], form = c[2], cps = c[3];
                    const int SB = stage_bytes(pat, G);
                    const int S = c[4] * 1024 / SB;
                    CUtensorMap mk, mv;
                    nhd_map(enc, &mk, k, H, npages, G, form, c[5]);
                    nhd_map(enc, &mv, v, H, npages, G, form, c[5]);
                    const int smem = S * SB + S * 8;
                    CU(cudaFuncSetAttribute(k_async, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
                    int grid = sms * cps;
                    const int HG = H / G;
                    if (pat < 2) grid = grid / HG * HG;
                    const double us = cold_median_us(flush, flush_bytes, e0, e1, 0, 2, 20, [&] {
                        k_async<<<grid, 32, smem>>>(mk, mv, k, v, half, dp, npages, H, pat, S, G, form, out);
                    });
                    const double tbs = 2.0 * half / (us * 1e-6) / 1e12;
                    printf("%8.1f MB  %-8s G%d%s p%d %d CTA/SM (%4d CTAs) %2d x %2d KB  %9.1f us  %6.3f TB/s  %5.1f %% of nominal\n",
                           2.0 * half / 1e6, anames[pat], G, form == 1 ? " nsw" : form == 2 ? " hfo" : "    ", c[5], cps, grid, S, SB / 1024, us, tbs,
                           nominal > 0 ? 100.0 * tbs / nominal : 0.0);
                }
        }
        cudaFree(k);
        cudaFree(v);
        cudaFree(dp);
    }
    return 0;
}
