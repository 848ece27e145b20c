/* cuda_api.c - dlopen of libcuda.so.1 and libnvrtc (see cuda_api.h). */
#define _POSIX_C_SOURCE 200809L
#include "cuda_api.h"

#include <dlfcn.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static kva__cu_api kva__cu;
static kva_status kva__cu_status = KVA_ERR_NO_DEVICE;
static char kva__cu_msg[512];
static pthread_once_t kva__cu_once = PTHREAD_ONCE_INIT;

static kva__nvrtc_api kva__nv;
static kva_status kva__nv_status = KVA_ERR_JIT;
static char kva__nv_msg[1024];
static pthread_once_t kva__nv_once = PTHREAD_ONCE_INIT;

/* dlsym into a function pointer without a cast warning */
static int kva__sym(void* lib, const char* name, void* out) {
    void* f = dlsym(lib, name);
    memcpy(out, &f, sizeof f);
    return f != NULL;
}

static void kva__cu_load_once(void) {
    void* lib = dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
    if (!lib) {
        const char* e = dlerror();
        snprintf(kva__cu_msg, sizeof kva__cu_msg, "CUDA backend: cannot load the driver library libcuda.so.1 (%s)",
                 e ? e : "not found");
        return;
    }
    kva__cu_api* c = &kva__cu;
    c->lib = lib;
    struct {
        const char* name;
        void* slot;
    } syms[] = {
        {"cuInit", &c->Init},
        {"cuDriverGetVersion", &c->DriverGetVersion},
        {"cuDeviceGetCount", &c->DeviceGetCount},
        {"cuDeviceGet", &c->DeviceGet},
        {"cuDeviceGetAttribute", &c->DeviceGetAttribute},
        {"cuDeviceGetName", &c->DeviceGetName},
        {"cuDevicePrimaryCtxRetain", &c->DevicePrimaryCtxRetain},
        {"cuDevicePrimaryCtxRelease_v2", &c->DevicePrimaryCtxRelease},
        {"cuCtxGetCurrent", &c->CtxGetCurrent},
        {"cuCtxPushCurrent_v2", &c->CtxPushCurrent},
        {"cuCtxPopCurrent_v2", &c->CtxPopCurrent},
        {"cuModuleLoadData", &c->ModuleLoadData},
        {"cuModuleUnload", &c->ModuleUnload},
        {"cuModuleGetFunction", &c->ModuleGetFunction},
        {"cuFuncSetAttribute", &c->FuncSetAttribute},
        {"cuFuncGetAttribute", &c->FuncGetAttribute},
        {"cuLaunchKernel", &c->LaunchKernel},
        {"cuMemAlloc_v2", &c->MemAlloc},
        {"cuMemFree_v2", &c->MemFree},
        {"cuMemHostAlloc", &c->MemHostAlloc},
        {"cuMemFreeHost", &c->MemFreeHost},
        {"cuMemcpyHtoDAsync_v2", &c->MemcpyHtoDAsync},
        {"cuMemcpyDtoHAsync_v2", &c->MemcpyDtoHAsync},
        {"cuMemsetD8Async", &c->MemsetD8Async},
        {"cuEventCreate", &c->EventCreate},
        {"cuEventDestroy_v2", &c->EventDestroy},
        {"cuEventRecord", &c->EventRecord},
        {"cuEventSynchronize", &c->EventSynchronize},
        {"cuStreamSynchronize", &c->StreamSynchronize},
        {"cuStreamIsCapturing", &c->StreamIsCapturing},
        {"cuOccupancyMaxActiveBlocksPerMultiprocessor", &c->OccupancyMaxActiveBlocksPerMultiprocessor},
        {"cuGetErrorName", &c->GetErrorName},
        {"cuGetErrorString", &c->GetErrorString},
    };
    for (size_t i = 0; i < sizeof syms / sizeof syms[0]; ++i) {
        if (!kva__sym(lib, syms[i].name, syms[i].slot)) {
            snprintf(kva__cu_msg, sizeof kva__cu_msg,
                     "CUDA backend: libcuda.so.1 lacks %s (driver too old; CUDA 12 or newer needed)", syms[i].name);
            kva__cu_status = KVA_ERR_NO_DEVICE;
            dlclose(lib);
            memset(c, 0, sizeof *c);
            return;
        }
    }
    if (!kva__sym(lib, "cuTensorMapEncodeTiled", &c->TensorMapEncodeTiled)) c->TensorMapEncodeTiled = NULL;
    if (!kva__sym(lib, "cuLaunchKernelEx", &c->LaunchKernelEx) ||
        !kva__sym(lib, "cuOccupancyMaxActiveClusters", &c->OccupancyMaxActiveClusters)) {
        c->LaunchKernelEx = NULL;
        c->OccupancyMaxActiveClusters = NULL;
    }
    CUresult r = c->Init(0);
    if (r != CUDA_SUCCESS) {
        const char* nm = NULL;
        c->GetErrorName(r, &nm);
        snprintf(kva__cu_msg, sizeof kva__cu_msg, "CUDA backend: cuInit failed with %s (no usable GPU or driver)",
                 nm ? nm : "an unknown error");
        /* keep the library loaded: the process may not unload it safely after cuInit */
        memset(c, 0, sizeof *c);
        return;
    }
    c->DriverGetVersion(&c->driver_version);
    kva__cu_status = KVA_OK;
}

const kva__cu_api* kva__cu_load(void) {
    pthread_once(&kva__cu_once, kva__cu_load_once);
    if (kva__cu_status != KVA_OK) {
        kva__set_error(kva__cu_status, "%s", kva__cu_msg);
        return NULL;
    }
    return &kva__cu;
}

kva_status kva__cu_error(const kva__cu_api* cu, CUresult r, const char* what) {
    const char* nm = NULL;
    const char* ds = NULL;
    if (cu && cu->GetErrorName) cu->GetErrorName(r, &nm);
    if (cu && cu->GetErrorString) cu->GetErrorString(r, &ds);
    return kva__set_error(KVA_ERR_BACKEND, "%s: %s (%s)", what, nm ? nm : "CUDA error", ds ? ds : "no description");
}

#ifndef KVA_CUDA_TOOLKIT_LIBDIR
#define KVA_CUDA_TOOLKIT_LIBDIR "/usr/local/cuda/lib64"
#endif

static void kva__nv_load_once(void) {
    char cand[8][512];
    int n = 0;
    const char* env = getenv("KVATTN_NVRTC_PATH");
    if (env && *env) snprintf(cand[n++], sizeof cand[0], "%.500s", env);
    snprintf(cand[n++], sizeof cand[0], "libnvrtc.so.13");
    snprintf(cand[n++], sizeof cand[0], "libnvrtc.so.12");
    snprintf(cand[n++], sizeof cand[0], "libnvrtc.so");
    snprintf(cand[n++], sizeof cand[0], "%s/libnvrtc.so", KVA_CUDA_TOOLKIT_LIBDIR);
    snprintf(cand[n++], sizeof cand[0], "/usr/local/cuda/lib64/libnvrtc.so");
    void* lib = NULL;
    int which = -1;
    for (int i = 0; i < n && !lib; ++i) {
        lib = dlopen(cand[i], RTLD_NOW | RTLD_LOCAL);
        if (lib) which = i;
    }
    if (!lib) {
        const char* e = dlerror();
        snprintf(kva__nv_msg, sizeof kva__nv_msg,
                 "NVRTC (libnvrtc.so.13/.12) not found (%s); set KVATTN_NVRTC_PATH to the library to compile kernels "
                 "outside the prebuilt set",
                 e ? e : "not found");
        return;
    }
    kva__nvrtc_api* v = &kva__nv;
    v->lib = lib;
    snprintf(v->path, sizeof v->path, "%.500s", cand[which]);
    struct {
        const char* name;
        void* slot;
    } syms[] = {
        {"nvrtcVersion", &v->Version},
        {"nvrtcCreateProgram", &v->CreateProgram},
        {"nvrtcCompileProgram", &v->CompileProgram},
        {"nvrtcGetProgramLogSize", &v->GetProgramLogSize},
        {"nvrtcGetProgramLog", &v->GetProgramLog},
        {"nvrtcGetCUBINSize", &v->GetCUBINSize},
        {"nvrtcGetCUBIN", &v->GetCUBIN},
        {"nvrtcDestroyProgram", &v->DestroyProgram},
        {"nvrtcGetErrorString", &v->GetErrorString},
    };
    for (size_t i = 0; i < sizeof syms / sizeof syms[0]; ++i) {
        if (!kva__sym(lib, syms[i].name, syms[i].slot)) {
            snprintf(kva__nv_msg, sizeof kva__nv_msg, "NVRTC at %s lacks %s (NVRTC 11.1 or newer needed)", v->path,
                     syms[i].name);
            dlclose(lib);
            memset(v, 0, sizeof *v);
            return;
        }
    }
    if (v->Version(&v->major, &v->minor) != NVRTC_SUCCESS) {
        snprintf(kva__nv_msg, sizeof kva__nv_msg, "NVRTC at %s: nvrtcVersion failed", v->path);
        memset(v, 0, sizeof *v);
        return;
    }
    kva__nv_status = KVA_OK;
}

const kva__nvrtc_api* kva__nvrtc_load(void) {
    pthread_once(&kva__nv_once, kva__nv_load_once);
    if (kva__nv_status != KVA_OK) {
        kva__set_error(KVA_ERR_JIT, "%s", kva__nv_msg);
        return NULL;
    }
    return &kva__nv;
}
