/* status.c - status strings, thread-local last-error message, logging, version. */
#include <stdio.h>
#include <string.h>

#include "internal.h"

#define KVA__MSG_CAP 8192 /* room for a compiler log */

static _Thread_local char kva__msg[KVA__MSG_CAP];
static _Thread_local kva_status kva__last_status = KVA_OK;

kva_status kva__set_error(kva_status status, const char* fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(kva__msg, sizeof kva__msg, fmt, ap);
    va_end(ap);
    kva__last_status = status;
    return status;
}

kva_status kva__retag_error(kva_status status) {
    kva__last_status = status;
    return status;
}

static _Thread_local char kva__saved_msg[KVA__MSG_CAP];
static _Thread_local kva_status kva__saved_status = KVA_OK;

void kva__error_save(void) {
    memcpy(kva__saved_msg, kva__msg, strlen(kva__msg) + 1);
    kva__saved_status = kva__last_status;
}

void kva__error_restore(void) {
    memcpy(kva__msg, kva__saved_msg, strlen(kva__saved_msg) + 1);
    kva__last_status = kva__saved_status;
}

KVA_API const char* kva_last_error_message(void) { return kva__msg; }
KVA_API kva_status kva_last_error_status(void) { return kva__last_status; }
KVA_API void kva_clear_last_error(void) {
    kva__msg[0] = '\0';
    kva__last_status = KVA_OK;
}

KVA_API const char* kva_status_string(kva_status status) {
    switch (status) {
    case KVA_OK: return "KVA_OK";
    case KVA_ERR_INVALID_ARGUMENT: return "KVA_ERR_INVALID_ARGUMENT";
    case KVA_ERR_UNSUPPORTED: return "KVA_ERR_UNSUPPORTED";
    case KVA_ERR_WORKSPACE_TOO_SMALL: return "KVA_ERR_WORKSPACE_TOO_SMALL";
    case KVA_ERR_PAGETABLE_MALFORMED: return "KVA_ERR_PAGETABLE_MALFORMED";
    case KVA_ERR_PAGE_INDEX_OUT_OF_RANGE: return "KVA_ERR_PAGE_INDEX_OUT_OF_RANGE";
    case KVA_ERR_PLAN_MISMATCH: return "KVA_ERR_PLAN_MISMATCH";
    case KVA_ERR_ALIGNMENT: return "KVA_ERR_ALIGNMENT";
    case KVA_ERR_OUT_OF_MEMORY: return "KVA_ERR_OUT_OF_MEMORY";
    case KVA_ERR_BACKEND: return "KVA_ERR_BACKEND";
    case KVA_ERR_JIT: return "KVA_ERR_JIT";
    case KVA_ERR_CAPTURE_ACTIVE: return "KVA_ERR_CAPTURE_ACTIVE";
    case KVA_ERR_NO_DEVICE: return "KVA_ERR_NO_DEVICE";
    case KVA_ERR_INTERNAL: return "KVA_ERR_INTERNAL";
    }
    return "KVA_ERR_UNKNOWN_STATUS";
}

void kva__log(const kva_context* ctx, kva_log_level level, const char* fmt, ...) {
    if (!ctx || !ctx->log_fn || level > ctx->log_level) return;
    char buf[1024];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(buf, sizeof buf, fmt, ap);
    va_end(ap);
    ctx->log_fn(ctx->log_user, level, buf);
}

KVA_API int kva_version(void) { return KVA_VERSION; }
KVA_API const char* kva_version_string(void) { return KVA_VERSION_STRING; }

KVA_API size_t kva_dtype_size(kva_dtype dtype) {
    switch (dtype) {
    case KVA_DTYPE_F32: return 4;
    case KVA_DTYPE_F16: return 2;
    case KVA_DTYPE_BF16: return 2;
    case KVA_DTYPE_E4M3: return 1;
    case KVA_DTYPE_E5M2: return 1;
    case KVA_DTYPE_I32: return 4;
    case KVA_DTYPE_U8: return 1;
    }
    return 0;
}

KVA_API const char* kva_dtype_name(kva_dtype dtype) {
    switch (dtype) {
    case KVA_DTYPE_F32: return "f32";
    case KVA_DTYPE_F16: return "f16";
    case KVA_DTYPE_BF16: return "bf16";
    case KVA_DTYPE_E4M3: return "e4m3";
    case KVA_DTYPE_E5M2: return "e5m2";
    case KVA_DTYPE_I32: return "i32";
    case KVA_DTYPE_U8: return "u8";
    }
    return "unknown";
}
