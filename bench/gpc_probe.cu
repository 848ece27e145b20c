/*
 * gpc_probe.cu - which SMs share a GPC, and how fast each SM streams from HBM when every SM reads the same number of
 * bytes at once (benchmark tool, not part of the library; sm_90).
 *
 * Why: per-CTA traces of D1 16 x 4k (one 2 MB work item per SM, docs/kernels/decode.md session 30) end in two groups,
 * ~32 SMs about 15 % before the other ~96, on every run. If the SMs of a GPC share that GPC's path to L2 and the GPCs
 * hold different numbers of SMs, an equal share per SM cannot end together: this tool measures both halves of that.
 *
 * 1. GPC membership: a thread-block cluster runs inside one GPC. Kernels of clusters of 2 .. 16 CTAs (one CTA per SM:
 *    the dynamic shared memory allows no second one) record each CTA's %smid; SMs met in one cluster are joined
 *    (union-find). The groups printed are the GPCs as far as the clusters reached them.
 * 2. Per-SM read time: GRID CTAs of 1024 threads (one per SM), each reads BYTES_PER_CTA (2 MB) with 16-byte loads,
 *    8 in flight per thread, either contiguous or as decode-like rows (256 bytes of each 2 KB token row of a 16 MB
 *    region shared by 8 CTAs: one KV head of an NHD page pool), or the same bytes as nsm shares taken in chunks of
 *    128 or 256 KB from a global counter (dynamic). %globaltimer at the CTA's start and end; cold L2
 *    (512 MB overwrite before each launch); medians over the runs, per SM, then summarised per GPC group.
 *
 * usage: gpc_probe [runs (default 7)]
 */
#include "cuda_tool.cuh"

#include <map>
#include <numeric>

static __device__ __forceinline__ unsigned long long gtimer() {
    unsigned long long t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    return t;
}
static __device__ __forceinline__ unsigned smid() {
    unsigned s;
    asm volatile("mov.u32 %0, %%smid;" : "=r"(s));
    return s;
}

/* every CTA records its SM and waits ~30 us so that the whole grid is resident together */
__global__ void where_kernel(int* out) {
    extern __shared__ char pad[];
    if (threadIdx.x == 0) {
        pad[0] = 0;
        out[blockIdx.x] = (int)smid();
        const unsigned long long t0 = gtimer();
        while (gtimer() - t0 < 30000ull) {
        }
    }
}

/* mode 0: contiguous slice of the CTA; mode 1: region blockIdx / 8, rows of 256 bytes at a 2 KB stride starting at
   256 * (blockIdx % 8) */
__global__ void __launch_bounds__(1024, 1) read_kernel(const uint4* buf, long long bytes_per_cta, int mode,
                                                      unsigned long long* rec, unsigned* sink) {
    extern __shared__ char pad[];
    const unsigned long long t0 = gtimer();
    const long long n16 = bytes_per_cta / 16; /* 16-byte chunks of this CTA */
    unsigned acc = 0;
    const int tid = threadIdx.x;
    const long long step = 1024;
    for (long long i0 = tid; i0 < n16; i0 += 8 * step) {
        uint4 v[8];
#pragma unroll
        for (int u = 0; u < 8; ++u) {
            const long long i = i0 + u * step;
            long long idx;
            if (mode == 0) {
                idx = (long long)blockIdx.x * n16 + i;
            } else {
                const long long row = i >> 4, c = i & 15; /* 16 chunks of 16 B per 256-byte row */
                idx = ((long long)(blockIdx.x >> 3) * 8 * n16) + row * 128 + (long long)(blockIdx.x & 7) * 16 + c;
            }
            v[u] = i < n16 ? __ldcs(buf + idx) : make_uint4(0, 0, 0, 0);
        }
#pragma unroll
        for (int u = 0; u < 8; ++u) acc ^= v[u].x ^ v[u].y ^ v[u].z ^ v[u].w;
    }
    if (acc == 0x9e3779b9u) sink[0] = acc; /* keeps the loads */
    __syncthreads();
    if (tid == 0) {
        pad[0] = 0;
        rec[3 * blockIdx.x + 0] = t0;
        rec[3 * blockIdx.x + 1] = gtimer();
        rec[3 * blockIdx.x + 2] = smid();
    }
}

/* mode 2 (dynamic shares): the grid's bytes in chunks of `chunk` bytes taken from a global counter (thread 0 claims
   the chunk after the current one while the CTA reads the current one) */
__global__ void __launch_bounds__(1024, 1) read_dyn_kernel(const uint4* buf, long long nchunks, long long chunk,
                                                          unsigned long long* ctr, unsigned long long* rec,
                                                          unsigned* sink) {
    extern __shared__ char pad[];
    __shared__ long long sc[2];
    const unsigned long long t0 = gtimer();
    const int tid = threadIdx.x;
    if (tid == 0) sc[0] = (long long)atomicAdd(ctr, 1ull);
    __syncthreads();
    long long cur = sc[0];
    unsigned acc = 0;
    int k = 0, taken = 0;
    const long long n16 = chunk / 16;
    while (cur < nchunks) {
        if (tid == 0) sc[(k + 1) & 1] = (long long)atomicAdd(ctr, 1ull);
        for (long long i0 = tid; i0 < n16; i0 += 8 * 1024) {
            uint4 v[8];
#pragma unroll
            for (int u = 0; u < 8; ++u) {
                const long long i = i0 + u * 1024;
                v[u] = i < n16 ? __ldcs(buf + cur * n16 + i) : make_uint4(0, 0, 0, 0);
            }
#pragma unroll
            for (int u = 0; u < 8; ++u) acc ^= v[u].x ^ v[u].y ^ v[u].z ^ v[u].w;
        }
        ++taken;
        __syncthreads();
        cur = sc[(k + 1) & 1];
        ++k;
    }
    if (acc == 0x9e3779b9u) sink[0] = acc;
    if (tid == 0) {
        pad[0] = 0;
        rec[3 * blockIdx.x + 0] = t0;
        rec[3 * blockIdx.x + 1] = gtimer();
        rec[3 * blockIdx.x + 2] = smid() | ((unsigned long long)taken << 32);
    }
}

static int find(std::vector<int>& p, int x) {
    while (p[x] != x) x = p[x] = p[p[x]];
    return x;
}

int main(int argc, char** argv) {
    const int runs = argc > 1 ? atoi(argv[1]) : 7;
    cudaDeviceProp prop;
    CU(cudaGetDeviceProperties(&prop, 0));
    const int nsm = prop.multiProcessorCount;
    printf("device: %s, %d SMs\n", prop.name, nsm);
    const int smem = (int)(prop.sharedMemPerMultiprocessor / 2 + 4096); /* more than half: one CTA per SM */
    CU(cudaFuncSetAttribute(where_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
    CU(cudaFuncSetAttribute(where_kernel, cudaFuncAttributeNonPortableClusterSizeAllowed, 1));
    CU(cudaFuncSetAttribute(read_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
    CU(cudaFuncSetAttribute(read_dyn_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));

    /* 1. GPC membership */
    std::vector<int> par(1024);
    std::iota(par.begin(), par.end(), 0);
    int* d_out;
    CU(cudaMalloc(&d_out, 4096 * sizeof(int)));
    for (int cs = 2; cs <= 16; ++cs) {
        cudaLaunchConfig_t cfg = {};
        cudaLaunchAttribute at[1];
        at[0].id = cudaLaunchAttributeClusterDimension;
        at[0].val.clusterDim.x = cs;
        at[0].val.clusterDim.y = 1;
        at[0].val.clusterDim.z = 1;
        cfg.blockDim = dim3(32);
        cfg.dynamicSmemBytes = smem;
        cfg.attrs = at;
        cfg.numAttrs = 1;
        cfg.gridDim = dim3(cs);
        int ncl = 0;
        if (cudaOccupancyMaxActiveClusters(&ncl, where_kernel, &cfg) != cudaSuccess || ncl <= 0) {
            cudaGetLastError();
            printf("cluster size %2d: not launchable\n", cs);
            continue;
        }
        cfg.gridDim = dim3(cs * ncl);
        for (int rep = 0; rep < 3; ++rep) {
            if (cudaLaunchKernelEx(&cfg, where_kernel, d_out) != cudaSuccess) {
                cudaGetLastError();
                break;
            }
            CU(cudaDeviceSynchronize());
            std::vector<int> h(cs * ncl);
            CU(cudaMemcpy(h.data(), d_out, h.size() * sizeof(int), cudaMemcpyDeviceToHost));
            for (int c = 0; c < ncl; ++c)
                for (int r = 1; r < cs; ++r) par[find(par, h[c * cs + r])] = find(par, h[c * cs]);
        }
        printf("cluster size %2d: %3d clusters at once (%d SMs)\n", cs, ncl, cs * ncl);
    }
    std::map<int, std::vector<int>> groups;
    for (int s = 0; s < nsm; ++s) groups[find(par, s)].push_back(s);
    std::vector<int> gid(nsm);
    std::vector<std::vector<int>> glist;
    for (auto& kv : groups) {
        for (int s : kv.second) gid[s] = (int)glist.size();
        glist.push_back(kv.second);
    }
    printf("\nGPC groups (SMs met in one cluster): %zu\n", glist.size());
    for (size_t g = 0; g < glist.size(); ++g) {
        printf("  group %zu: %zu SMs:", g, glist[g].size());
        for (int s : glist[g]) printf(" %d", s);
        printf("\n");
    }

    /* 2. per-SM read time */
    const long long per = 2ll << 20;
    const size_t flush_bytes = 512ull << 20;
    void* flush;
    CU(cudaMalloc(&flush, flush_bytes));
    uint4* buf;
    CU(cudaMalloc(&buf, (size_t)per * nsm));
    CU(cudaMemset(buf, 1, (size_t)per * nsm));
    unsigned long long* d_rec;
    unsigned* d_sink;
    CU(cudaMalloc(&d_rec, 3 * sizeof(unsigned long long) * nsm));
    CU(cudaMalloc(&d_sink, 4));
    unsigned long long* d_ctr;
    CU(cudaMalloc(&d_ctr, 8));
    printf("\nper-SM read of 2 MB each, cold L2, median of %d runs; times from the grid's first CTA start (us)\n", runs);
    printf("| mode | CTAs | kernel span | GPC group: SMs used, median SM end (min-max) |\n|---|---:|---:|---|\n");
    /* (mode, CTAs, chunk KB for mode 2): the dynamic rows read the bytes of nsm static shares */
    const int cfgs[6][3] = {{0, nsm, 0},   {0, nsm / 8 * 8, 0}, {1, nsm / 8 * 8, 0},
                            {2, nsm, 256}, {2, nsm, 128},       {2, nsm / 8 * 8, 256}};
    for (int ci = 0; ci < 6; ++ci) {
        const int mode = cfgs[ci][0], grid = cfgs[ci][1];
        const long long chunk = (long long)cfgs[ci][2] << 10;
        std::vector<std::vector<double>> ends(nsm), takes(nsm);
        std::vector<double> spans;
        for (int r = 0; r < runs + 1; ++r) {
            CU(cudaMemset(flush, r & 0xff, flush_bytes));
            if (mode == 2) {
                CU(cudaMemset(d_ctr, 0, 8));
                read_dyn_kernel<<<grid, 1024, smem>>>(buf, (long long)nsm * per / chunk, chunk, d_ctr, d_rec, d_sink);
            } else {
                read_kernel<<<grid, 1024, smem>>>(buf, per, mode, d_rec, d_sink);
            }
            CU(cudaGetLastError());
            CU(cudaDeviceSynchronize());
            if (r == 0) continue;
            std::vector<unsigned long long> h(3 * grid);
            CU(cudaMemcpy(h.data(), d_rec, h.size() * 8, cudaMemcpyDeviceToHost));
            unsigned long long t0 = ~0ull, t1 = 0;
            for (int b = 0; b < grid; ++b) {
                t0 = std::min(t0, h[3 * b]);
                t1 = std::max(t1, h[3 * b + 1]);
            }
            spans.push_back((t1 - t0) / 1000.0);
            for (int b = 0; b < grid; ++b) {
                ends[h[3 * b + 2] & 0xffffffffull].push_back((h[3 * b + 1] - t0) / 1000.0);
                takes[h[3 * b + 2] & 0xffffffffull].push_back((double)(h[3 * b + 2] >> 32));
            }
        }
        std::sort(spans.begin(), spans.end());
        char what[64];
        if (mode == 2) snprintf(what, sizeof what, "dynamic %d KB chunks, %d x 2 MB", cfgs[ci][2], nsm);
        else snprintf(what, sizeof what, "%s", mode ? "rows 256 B / 2 KB" : "contiguous");
        printf("| %s | %d | %.1f |", what, grid, spans[spans.size() / 2]);
        for (size_t g = 0; g < glist.size(); ++g) {
            std::vector<double> med;
            for (int s : glist[g]) {
                auto& e = ends[s];
                if (e.size() < (size_t)(runs + 1) / 2) continue; /* the SM held no CTA in most runs */
                std::sort(e.begin(), e.end());
                med.push_back(e[e.size() / 2]);
            }
            if (med.empty()) {
                printf(" g%zu: 0;", g);
                continue;
            }
            std::sort(med.begin(), med.end());
            printf(" g%zu: %zu, %.1f (%.1f-%.1f)", g, med.size(), med[med.size() / 2], med.front(), med.back());
            if (mode == 2) { /* chunks taken per SM: min-max of the SMs' medians */
                double lo = 1e30, hi = 0;
                for (int s : glist[g]) {
                    auto& t = takes[s];
                    if (t.empty()) continue;
                    std::sort(t.begin(), t.end());
                    lo = std::min(lo, t[t.size() / 2]);
                    hi = std::max(hi, t[t.size() / 2]);
                }
                printf(", %.0f-%.0f chunks", lo, hi);
            }
            printf(";");
        }
        printf("\n");
    }
    return 0;
}
