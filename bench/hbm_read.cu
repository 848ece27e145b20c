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
 * usage: hbm_read [--floor] [MB of K+V ...]   (default 134 1074 2147; with --floor alone, only the floor)
 */
#include <cuda_runtime.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <algorithm>
#include <vector>

#define CU(x)                                                                                     \
    do {                                                                                          \
        cudaError_t e_ = (x);                                                                     \
        if (e_ != cudaSuccess) {                                                                  \
            fprintf(stderr, "%s:%d %s: %s\n", __FILE__, __LINE__, #x, cudaGetErrorString(e_));    \
            exit(1);                                                                              \
        }                                                                                         \
    } while (0)

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
            std::vector<float> t;
            for (int it = -3; it < 30; ++it) {
                CU(cudaMemsetAsync(flush, it & 0xff, flush_bytes, st));
                CU(cudaEventRecord(e0, st));
                if (mode) CU(cudaGraphLaunch(ge, st));
                else launch(st);
                CU(cudaEventRecord(e1, st));
                CU(cudaEventSynchronize(e1));
                float ms;
                CU(cudaEventElapsedTime(&ms, e0, e1));
                if (it >= 0) t.push_back(ms * 1000.0f);
            }
            std::sort(t.begin(), t.end());
            med[mode] = t[t.size() / 2];
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
    bool do_floor = false;
    for (int i = 1; i < argc; ++i) {
        if (!strcmp(argv[i], "--floor")) do_floor = true;
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
        for (int hint = 0; hint <= 1; ++hint)
        for (int ctas_per_sm = 1; ctas_per_sm <= 2; ++ctas_per_sm) {
            CU(cudaMemcpyToSymbol(g_hint, &hint, sizeof hint));
            for (int pat = 0; pat < 4; ++pat) {
                int grid = sms * ctas_per_sm;
                if (pat == 1 || pat == 2) grid = grid / H * H;
                std::vector<float> t;
                for (int it = -2; it < 20; ++it) {
                    CU(cudaMemsetAsync(flush, it & 0xff, flush_bytes));
                    CU(cudaEventRecord(e0));
                    if (pat == 0) k_contig<<<grid, THREADS>>>(k, v, half, out);
                    else k_paged<<<grid, THREADS>>>(k, v, dp, npages, H, pat - 1, out);
                    CU(cudaEventRecord(e1));
                    CU(cudaEventSynchronize(e1));
                    float ms;
                    CU(cudaEventElapsedTime(&ms, e0, e1));
                    if (it >= 0) t.push_back(ms * 1000.0f);
                }
                CU(cudaGetLastError());
                std::sort(t.begin(), t.end());
                const double us = t[t.size() / 2];
                const double tbs = 2.0 * half / (us * 1e-6) / 1e12;
                printf("%8.1f MB  %-7s%-3s %d CTA/SM (%4d CTAs)  %9.1f us  %6.3f TB/s  %5.1f %% of nominal\n", 2.0 * half / 1e6,
                       names[pat], hint ? "+ef" : "", ctas_per_sm, grid, us, tbs, nominal > 0 ? 100.0 * tbs / nominal : 0.0);
            }
        }
        cudaFree(k);
        cudaFree(v);
        cudaFree(dp);
    }
    return 0;
}
