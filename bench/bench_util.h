/* bench_util.h - helpers shared by the GPU benchmark programs (bench_decode.c, bench_prefill.c): fail-fast
 * checks of CUDA and kvattn calls, a seeded xorshift generator, a float comparator for medians, a monotonic
 * clock, the timed plan of a workload. Benchmarks exit on the first error; the library itself never does. */
#ifndef KVA_BENCH_UTIL_H
#define KVA_BENCH_UTIL_H

#include <cuda_runtime_api.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "kvattn.h"

#define CU(call)                                                                                    \
    do {                                                                                            \
        cudaError_t e_ = (call);                                                                    \
        if (e_ != cudaSuccess) {                                                                    \
            fprintf(stderr, "CUDA error %s at %s:%d: %s\n", cudaGetErrorName(e_), __FILE__, __LINE__, #call); \
            exit(1);                                                                                \
        }                                                                                           \
    } while (0)
#define KV(call)                                                                                    \
    do {                                                                                            \
        kva_status s_ = (call);                                                                     \
        if (s_ != KVA_OK) {                                                                         \
            fprintf(stderr, "kvattn error %s at %s:%d: %s\n", kva_status_string(s_), __FILE__, __LINE__, \
                    kva_last_error_message());                                                      \
            exit(1);                                                                                \
        }                                                                                           \
    } while (0)

static uint64_t rng = 88172645463325252ull; /* xorshift64 state; programs may reseed it */
static inline uint64_t xs(void) {
    rng ^= rng << 13;
    rng ^= rng >> 7;
    rng ^= rng << 17;
    return rng;
}
static inline double unif(void) { return (double)(xs() >> 11) / 9007199254740992.0; }

/* float <-> bf16 bits (round to nearest even; finite inputs) */
static inline uint16_t f2bf(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    return (uint16_t)((u + 0x7fff + ((u >> 16) & 1)) >> 16);
}
static inline float bf2f(uint16_t h) {
    uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

static inline int cmp_f(const void* a, const void* b) {
    float x = *(const float*)a, y = *(const float*)b;
    return x < y ? -1 : x > y;
}
static inline double now_s(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec + t.tv_nsec * 1e-9;
}

/* The workspace of db device / hb pinned host bytes, then kva_plan_make 15 times into it: the median in microseconds
   (plan() stays outside the kernel timings; the last plan is the one the benchmark runs). */
static inline float bench_plan_median_us(kva_context* ctx, const kva_attention_desc* d, kva_op op,
                                         const kva_plan_params* pp, size_t db, size_t hb, kva_workspace* ws,
                                         kva_plan* plan, cudaStream_t s) {
    ws->device_bytes = db;
    ws->host_bytes = hb;
    CU(cudaMalloc(&ws->device, db));
    CU(cudaMallocHost(&ws->host, hb));
    float pt[15];
    for (int i = 0; i < 15; ++i) {
        double t0 = now_s();
        KV(kva_plan_make(ctx, d, op, pp, ws, plan, s));
        pt[i] = (float)((now_s() - t0) * 1e6);
    }
    qsort(pt, 15, sizeof(float), cmp_f);
    return pt[7];
}

#endif /* KVA_BENCH_UTIL_H */
