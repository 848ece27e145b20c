/*
 * cluster_probe.cu - what a split-KV combine costs through a thread-block cluster's distributed shared memory
 * against the global-memory path of the decode kernels (benchmark tool, not part of the library; sm_90).
 *
 * Every kernel runs GRID CTAs of 128 threads with the decode kernel's dynamic shared memory; the first UNITS x 8 CTAs
 * have work: a partial state of R = 4 rows x 128 floats + 4 lse values (what a split work item writes), combined
 * over the 8 chunks of each unit:
 *   plain   : the partial goes to global memory, nothing else (the floor of the launch and the stores)
 *   global  : + the fused merge of kva_decode_tc.cuh: barrier, one acq_rel atomic per CTA, the last CTA of a unit
 *             loads the 8 partials and writes the 512 outputs
 *   cl-noop : plain, launched with clusters of 8 (the launch's own cost)
 *   cluster : clusters of 8 (one unit per cluster): the partial stays in shared memory, barrier.cluster, rank r
 *             combines outputs r * 64 .. + 63 from the 8 ranks' shared memory (ld.shared::cluster, all 16 loads of a
 *             thread in flight together), barrier.cluster
 *   cl-serial: the same with each load waiting for the previous one (volatile asm with a memory clobber)
 *   cl-1bar : clusters of 8, the partial in shared memory and one barrier.cluster (no loads)
 * Timed as CUDA-graph replays: back to back (warm) and one replay after a 512 MB overwrite (cold), medians.
 * Also prints cudaOccupancyMaxActiveClusters for cluster sizes 2, 4, 8 (16 non-portable) at the decode kernel's
 * shared memory (2 CTAs per SM) and at 8-warp sizes (1 CTA per SM).
 *
 * usage: cluster_probe [units (default 8)]
 */
#include "cuda_tool.cuh"

#define R 4
#define D 128
#define C 8

__device__ __forceinline__ unsigned smem_u32(const void* p) { return (unsigned)__cvta_generic_to_shared(p); }
__device__ __forceinline__ unsigned cl_rank() {
    unsigned r;
    asm volatile("mov.u32 %0, %%cluster_ctarank;" : "=r"(r));
    return r;
}
__device__ __forceinline__ void cl_sync() {
    asm volatile("barrier.cluster.arrive.release.aligned;\n\tbarrier.cluster.wait.acquire.aligned;" ::: "memory");
}
/* not volatile: the loads of one combine are independent and may be in flight together (the barrier before them
   carries the ordering) */
__device__ __forceinline__ float ld_cluster(unsigned saddr, unsigned rank) {
    unsigned a;
    float v;
    asm("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(a) : "r"(saddr), "r"(rank));
    asm("ld.shared::cluster.f32 %0, [%1];" : "=f"(v) : "r"(a));
    return v;
}
__device__ __forceinline__ float ld_cluster_serial(unsigned saddr, unsigned rank) {
    unsigned a;
    float v;
    asm volatile("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(a) : "r"(saddr), "r"(rank));
    asm volatile("ld.shared::cluster.f32 %0, [%1];" : "=f"(v) : "r"(a) : "memory");
    return v;
}

__device__ __forceinline__ void make_partial(float* o, float* l, int cta) {
    const int t = threadIdx.x;
    for (int i = t; i < R * D; i += 128) o[i] = 0.001f * (float)((cta * 131 + i) & 1023);
    if (t < R) l[t] = 0.5f * (float)((cta + t) & 7);
}

__global__ void __launch_bounds__(128) k_plain(float* po, float* pl, float* out, int active) {
    extern __shared__ float sm[];
    const int b = blockIdx.x;
    if (b >= active) return;
    make_partial(po + (size_t)b * R * D, pl + (size_t)b * R, b);
    (void)sm, (void)out;
}

__global__ void __launch_bounds__(128) k_global(float* po, float* pl, float* out, unsigned* cnt, int active) {
    extern __shared__ float sm[];
    __shared__ int last;
    const int b = blockIdx.x;
    if (b >= active) return;
    make_partial(po + (size_t)b * R * D, pl + (size_t)b * R, b);
    __syncthreads();
    const int u = b / C;
    if (threadIdx.x == 0) {
        unsigned old;
        asm volatile("atom.add.acq_rel.gpu.u32 %0, [%1], 1;" : "=r"(old) : "l"(cnt + u) : "memory");
        last = old == C - 1;
        if (last) cnt[u] = 0;
    }
    __syncthreads();
    if (!last) return;
    const int t = threadIdx.x;
    for (int i = t; i < R * D; i += 128) {
        const int r = i / D;
        float lse[C], m = -INFINITY;
        for (int k = 0; k < C; ++k) lse[k] = __ldcg(pl + (size_t)(u * C + k) * R + r), m = fmaxf(m, lse[k]);
        float ws = 0.f, acc = 0.f;
        for (int k = 0; k < C; ++k) {
            const float w = exp2f(lse[k] - m);
            ws += w;
            acc = fmaf(w, __ldcg(po + (size_t)(u * C + k) * R * D + i), acc);
        }
        out[(size_t)u * R * D + i] = acc / ws;
    }
    (void)sm;
}

template <bool SERIAL>
__global__ void __launch_bounds__(128) k_cluster(float* po, float* pl, float* out, int active) {
    extern __shared__ float sm[];
    const int b = blockIdx.x;
    if (b >= active) return; /* whole clusters: active is a multiple of C */
    float* so = sm;
    float* sl = sm + R * D;
    make_partial(so, sl, b);
    cl_sync();
    const unsigned rk = cl_rank();
    const int u = b / C, t = threadIdx.x;
    if (t < R * D / C) {
        const int r = t / (D / C), d = (int)rk * (D / C) + t % (D / C);
        float lse[C], v[C], m = -INFINITY;
#pragma unroll
        for (int k = 0; k < C; ++k) {
            lse[k] = SERIAL ? ld_cluster_serial(smem_u32(sl + r), (unsigned)k) : ld_cluster(smem_u32(sl + r), (unsigned)k);
            v[k] = SERIAL ? ld_cluster_serial(smem_u32(so + r * D + d), (unsigned)k)
                          : ld_cluster(smem_u32(so + r * D + d), (unsigned)k);
        }
#pragma unroll
        for (int k = 0; k < C; ++k) m = fmaxf(m, lse[k]);
        float ws = 0.f, acc = 0.f;
#pragma unroll
        for (int k = 0; k < C; ++k) {
            const float w = exp2f(lse[k] - m);
            ws += w;
            acc = fmaf(w, v[k], acc);
        }
        out[(size_t)u * R * D + r * D + d] = acc / ws;
    }
    cl_sync(); /* peers may still read this CTA's shared memory */
    (void)po, (void)pl;
}

/* one barrier only (the floor of the cluster path: arrive + wait once, no loads) */
__global__ void __launch_bounds__(128) k_cluster_bar(float* po, float* pl, float* out, int active) {
    extern __shared__ float sm[];
    const int b = blockIdx.x;
    if (b >= active) return;
    make_partial(sm, sm + R * D, b);
    cl_sync();
    (void)po, (void)pl, (void)out;
}

static cudaLaunchConfig_t cfg(int grid, size_t smem, cudaStream_t st, cudaLaunchAttribute* at, int cl) {
    cudaLaunchConfig_t c = {};
    c.gridDim = dim3(grid);
    c.blockDim = dim3(128);
    c.dynamicSmemBytes = smem;
    c.stream = st;
    if (cl > 1) {
        at[0].id = cudaLaunchAttributeClusterDimension;
        at[0].val.clusterDim.x = cl;
        at[0].val.clusterDim.y = 1;
        at[0].val.clusterDim.z = 1;
        c.attrs = at;
        c.numAttrs = 1;
    }
    return c;
}

int main(int argc, char** argv) {
    const int units = argc > 1 ? atoi(argv[1]) : 8;
    cudaDeviceProp prop;
    CU(cudaGetDeviceProperties(&prop, 0));
    const int grid = prop.multiProcessorCount * 2;
    const int active = units * C;
    printf("cluster_probe: %s, %d SMs, grid %d, %d units x %d chunks\n", prop.name, prop.multiProcessorCount, grid,
           units, C);
    const size_t smem2 = 109392, smem1 = 213 * 1024; /* TC r4 (2 CTAs/SM) and w8-like (1 CTA/SM) */
    CU(cudaFuncSetAttribute(k_cluster<false>, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem1));
    CU(cudaFuncSetAttribute(k_cluster<false>, cudaFuncAttributeNonPortableClusterSizeAllowed, 1));
    CU(cudaFuncSetAttribute(k_cluster<true>, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem1));
    CU(cudaFuncSetAttribute(k_cluster_bar, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem1));
    CU(cudaFuncSetAttribute(k_plain, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem1));
    CU(cudaFuncSetAttribute(k_global, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem1));
    cudaLaunchAttribute at[1];
    for (size_t sm : {smem2, smem1}) {
        printf("max active clusters at %zu B of shared memory:", sm);
        for (int cl : {2, 4, 8, 16}) {
            cudaLaunchConfig_t c = cfg(grid, sm, 0, at, cl);
            int n = -1;
            cudaError_t e = cudaOccupancyMaxActiveClusters(&n, (void*)k_cluster<false>, &c);
            if (e != cudaSuccess) {
                cudaGetLastError();
                n = -1;
            }
            printf("  %d x %d = %d CTAs", cl, n, n * cl);
        }
        printf("\n");
    }
    float *po, *pl, *out;
    unsigned* cnt;
    CU(cudaMalloc(&po, (size_t)grid * R * D * 4));
    CU(cudaMalloc(&pl, (size_t)grid * R * 4));
    CU(cudaMalloc(&out, (size_t)grid * R * D * 4));
    CU(cudaMalloc(&cnt, (size_t)grid * 4));
    CU(cudaMemset(cnt, 0, (size_t)grid * 4));
    void* flush;
    const size_t fb = (size_t)512 << 20;
    CU(cudaMalloc(&flush, fb));
    cudaStream_t st;
    CU(cudaStreamCreateWithFlags(&st, cudaStreamNonBlocking));
    cudaEvent_t e0, e1;
    CU(cudaEventCreate(&e0));
    CU(cudaEventCreate(&e1));
    const char* names[6] = {"plain", "global", "cl-noop", "cluster", "cl-serial", "cl-1bar"};
    for (int kind = 0; kind < 6; ++kind) {
        cudaGraph_t g;
        cudaGraphExec_t ge;
        CU(cudaStreamBeginCapture(st, cudaStreamCaptureModeThreadLocal));
        cudaLaunchConfig_t c = cfg(grid, smem2, st, at, kind >= 2 ? C : 1);
        if (kind == 0 || kind == 2) CU(cudaLaunchKernelEx(&c, k_plain, po, pl, out, active));
        else if (kind == 1) CU(cudaLaunchKernelEx(&c, k_global, po, pl, out, cnt, active));
        else if (kind == 3) CU(cudaLaunchKernelEx(&c, k_cluster<false>, po, pl, out, active));
        else if (kind == 4) CU(cudaLaunchKernelEx(&c, k_cluster<true>, po, pl, out, active));
        else CU(cudaLaunchKernelEx(&c, k_cluster_bar, po, pl, out, active));
        CU(cudaStreamEndCapture(st, &g));
        CU(cudaGraphInstantiate(&ge, g, 0));
        for (int i = 0; i < 10; ++i) CU(cudaGraphLaunch(ge, st));
        CU(cudaStreamSynchronize(st));
        const int reps = 400;
        std::vector<float> w;
        for (int rep = 0; rep < 5; ++rep) {
            CU(cudaEventRecord(e0, st));
            for (int i = 0; i < reps; ++i) CU(cudaGraphLaunch(ge, st));
            CU(cudaEventRecord(e1, st));
            CU(cudaEventSynchronize(e1));
            float ms;
            CU(cudaEventElapsedTime(&ms, e0, e1));
            w.push_back(ms * 1000.f / reps);
        }
        std::sort(w.begin(), w.end());
        const double cold = cold_median_us(flush, fb, e0, e1, st, 3, 30, [&] { CU(cudaGraphLaunch(ge, st)); });
        printf("  %-8s warm %6.2f us per replay   cold %6.2f us\n", names[kind], w[2], cold);
        CU(cudaGraphExecDestroy(ge));
        CU(cudaGraphDestroy(g));
    }
    /* check: global and cluster give the same outputs */
    std::vector<float> a((size_t)units * R * D), b2((size_t)units * R * D);
    {
        cudaLaunchConfig_t c = cfg(grid, smem2, st, at, 1);
        CU(cudaLaunchKernelEx(&c, k_global, po, pl, out, cnt, active));
        CU(cudaMemcpyAsync(a.data(), out, a.size() * 4, cudaMemcpyDeviceToHost, st));
        CU(cudaMemsetAsync(out, 0, a.size() * 4, st));
        cudaLaunchConfig_t c2 = cfg(grid, smem2, st, at, C);
        CU(cudaLaunchKernelEx(&c2, k_cluster<false>, po, pl, out, active));
        CU(cudaMemcpyAsync(b2.data(), out, b2.size() * 4, cudaMemcpyDeviceToHost, st));
        CU(cudaStreamSynchronize(st));
    }
    double md = 0;
    for (size_t i = 0; i < a.size(); ++i) md = std::max(md, (double)fabsf(a[i] - b2[i]));
    printf("global vs cluster outputs: max |diff| %.3g\n", md);
    return 0;
}
