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
 * usage: hbm_read [MB of K+V ...]   (default 134 1074 2147)
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

int main(int argc, char** argv) {
    std::vector<double> mbs;
    for (int i = 1; i < argc; ++i) mbs.push_back(atof(argv[i]));
    if (mbs.empty()) mbs = {134.2, 1073.7, 2147.5};
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
