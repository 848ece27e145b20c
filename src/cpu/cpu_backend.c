/* cpu_backend.c - CPU backend (stub; being filled in). */
#include "internal.h"

kva_status kva__cpu_init(kva_context* ctx) {
    (void)ctx;
    return kva__set_error(KVA_ERR_UNSUPPORTED, "CPU backend: not yet implemented");
}
