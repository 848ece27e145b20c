/*
 * cuda_tool.cuh - shared by the standalone CUDA benchmark tools (bench/hbm_read.cu, bench/hg_decode.cu): the error
 * macro, the cold-L2 timing loop of WORKLOADS.md, and the driver's tensor-map encoder. Not library code.
 */
#pragma once
#include <cuda.h>
#include <cuda_runtime.h>
#include <stdio.h>
#include <stdlib.h>
#include <algorithm>
#include <vector>

#define CU(x)                                                                                  \
    do {                                                                                       \
        cudaError_t e_ = (x);                                                                  \
        if (e_ != cudaSuccess) {                                                               \
            fprintf(stderr, "%s:%d %s: %s\n", __FILE__, __LINE__, #x, cudaGetErrorString(e_)); \
            exit(1);                                                                           \
        }                                                                                      \
    } while (0)

/* Median of n timed calls of launch() on stream st, after `warm` untimed ones; before each call the flush buffer is
   overwritten (cold L2), CUDA events around the call. Microseconds. */
template <class F>
static double cold_median_us(void* flush, size_t flush_bytes, cudaEvent_t e0, cudaEvent_t e1, cudaStream_t st, int warm,
                             int n, F launch) {
    std::vector<float> t;
    for (int it = -warm; it < n; ++it) {
        CU(cudaMemsetAsync(flush, it & 0xff, flush_bytes, st));
        CU(cudaEventRecord(e0, st));
        launch();
        CU(cudaEventRecord(e1, st));
        CU(cudaEventSynchronize(e1));
        float ms;
        CU(cudaEventElapsedTime(&ms, e0, e1));
        if (it >= 0) t.push_back(ms * 1000.0f);
    }
    CU(cudaGetLastError());
    std::sort(t.begin(), t.end());
    return t[t.size() / 2];
}

typedef CUresult (*encode_fn)(CUtensorMap*, CUtensorMapDataType, cuuint32_t, void*, const cuuint64_t*, const cuuint64_t*,
                              const cuuint32_t*, const cuuint32_t*, CUtensorMapInterleave, CUtensorMapSwizzle,
                              CUtensorMapL2promotion, CUtensorMapFloatOOBfill);
/* cuTensorMapEncodeTiled through the runtime's driver entry point (no libcuda link) */
static encode_fn tensor_map_encoder() {
    void* fn = nullptr;
    cudaDriverEntryPointQueryResult q;
    CU(cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &fn, 12000, cudaEnableDefault, &q));
    if (!fn || q != cudaDriverEntryPointSuccess) {
        fprintf(stderr, "no cuTensorMapEncodeTiled in this driver\n");
        exit(1);
    }
    return (encode_fn)fn;
}
