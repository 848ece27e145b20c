/*
 * cuda_api.h - the CUDA driver API and NVRTC, loaded at run time with dlopen so that libkvattn loads (and the
 * CPU backend works) on machines without a driver or without NVRTC. Types come from the toolkit headers;
 * no symbol of libcuda or libnvrtc is linked.
 */
#ifndef KVA_CUDA_API_H
#define KVA_CUDA_API_H

#include <cuda.h>
#include <nvrtc.h>
#include <stdbool.h>

#include "internal.h"

typedef struct kva__cu_api {
    void* lib;
    int driver_version;
    CUresult (*Init)(unsigned int);
    CUresult (*DriverGetVersion)(int*);
    CUresult (*DeviceGetCount)(int*);
    CUresult (*DeviceGet)(CUdevice*, int);
    CUresult (*DeviceGetAttribute)(int*, CUdevice_attribute, CUdevice);
    CUresult (*DeviceGetName)(char*, int, CUdevice);
    CUresult (*DevicePrimaryCtxRetain)(CUcontext*, CUdevice);
    CUresult (*DevicePrimaryCtxRelease)(CUdevice);
    CUresult (*CtxGetCurrent)(CUcontext*);
    CUresult (*CtxPushCurrent)(CUcontext);
    CUresult (*CtxPopCurrent)(CUcontext*);
    CUresult (*ModuleLoadData)(CUmodule*, const void*);
    CUresult (*ModuleUnload)(CUmodule);
    CUresult (*ModuleGetFunction)(CUfunction*, CUmodule, const char*);
    CUresult (*FuncSetAttribute)(CUfunction, CUfunction_attribute, int);
    CUresult (*FuncGetAttribute)(int*, CUfunction_attribute, CUfunction);
    CUresult (*LaunchKernel)(CUfunction, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned,
                             CUstream, void**, void**);
    CUresult (*MemAlloc)(CUdeviceptr*, size_t);
    CUresult (*MemFree)(CUdeviceptr);
    CUresult (*MemHostAlloc)(void**, size_t, unsigned int);
    CUresult (*MemFreeHost)(void*);
    CUresult (*MemcpyHtoDAsync)(CUdeviceptr, const void*, size_t, CUstream);
    CUresult (*MemcpyDtoHAsync)(void*, CUdeviceptr, size_t, CUstream);
    CUresult (*MemsetD8Async)(CUdeviceptr, unsigned char, size_t, CUstream);
    CUresult (*EventCreate)(CUevent*, unsigned int);
    CUresult (*EventDestroy)(CUevent);
    CUresult (*EventRecord)(CUevent, CUstream);
    CUresult (*EventSynchronize)(CUevent);
    CUresult (*StreamSynchronize)(CUstream);
    CUresult (*StreamIsCapturing)(CUstream, CUstreamCaptureStatus*);
    CUresult (*OccupancyMaxActiveBlocksPerMultiprocessor)(int*, CUfunction, int, size_t);
    CUresult (*GetErrorName)(CUresult, const char**);
    CUresult (*GetErrorString)(CUresult, const char**);
    /* optional (NULL when the driver lacks it: the Hopper prefill kernel then copies without TMA) */
    CUresult (*TensorMapEncodeTiled)(CUtensorMap*, CUtensorMapDataType, cuuint32_t, void*, const cuuint64_t*,
                                     const cuuint64_t*, const cuuint32_t*, const cuuint32_t*, CUtensorMapInterleave,
                                     CUtensorMapSwizzle, CUtensorMapL2promotion, CUtensorMapFloatOOBfill);
    /* optional (NULL: no thread-block cluster launches; decode combines split KV through global memory) */
    CUresult (*LaunchKernelEx)(const CUlaunchConfig*, CUfunction, void**, void**);
    CUresult (*OccupancyMaxActiveClusters)(int*, CUfunction, const CUlaunchConfig*);
} kva__cu_api;

typedef struct kva__nvrtc_api {
    void* lib;
    int major, minor;
    char path[512];
    nvrtcResult (*Version)(int*, int*);
    nvrtcResult (*CreateProgram)(nvrtcProgram*, const char*, const char*, int, const char* const*,
                                 const char* const*);
    nvrtcResult (*CompileProgram)(nvrtcProgram, int, const char* const*);
    nvrtcResult (*GetProgramLogSize)(nvrtcProgram, size_t*);
    nvrtcResult (*GetProgramLog)(nvrtcProgram, char*);
    nvrtcResult (*GetCUBINSize)(nvrtcProgram, size_t*);
    nvrtcResult (*GetCUBIN)(nvrtcProgram, char*);
    nvrtcResult (*DestroyProgram)(nvrtcProgram*);
    const char* (*GetErrorString)(nvrtcResult);
} kva__nvrtc_api;

/* Load libcuda (once per process; thread-safe). NULL with the error recorded when unavailable. */
const kva__cu_api* kva__cu_load(void);
/* Load NVRTC (once per process). NULL with KVA_ERR_JIT recorded when unavailable. */
const kva__nvrtc_api* kva__nvrtc_load(void);

/* Record a driver error as KVA_ERR_BACKEND: "<what>: CUDA_ERROR_X (description)". */
kva_status kva__cu_error(const kva__cu_api* cu, CUresult r, const char* what);

#define KVA_CU_TRY(cu, call, what)                                   \
    do {                                                             \
        CUresult kva__r_ = (call);                                   \
        if (KVA_UNLIKELY(kva__r_ != CUDA_SUCCESS)) return kva__cu_error((cu), kva__r_, (what)); \
    } while (0)

#endif /* KVA_CUDA_API_H */
