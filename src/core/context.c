/* context.c - context creation: backend choice, worker count, log sink. */
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "internal.h"

static atomic_uint_fast64_t kva__next_context_id = 1;

KVA_API void kva_context_options_init(kva_context_options* options) {
    if (!options) return;
    memset(options, 0, sizeof *options);
    options->backend = KVA_BACKEND_AUTO;
    options->device = 0;
    options->num_threads = 0;
    options->log_level = KVA_LOG_WARN;
}

static int32_t kva__online_cpus(void) {
    long n = sysconf(_SC_NPROCESSORS_ONLN);
    if (n < 1) n = 1;
    if (n > 1024) n = 1024;
    return (int32_t)n;
}

KVA_API kva_status kva_context_create(const kva_context_options* options, kva_context** out_context) {
    KVA_RETURN_IF(!out_context, KVA_ERR_INVALID_ARGUMENT, "kva_context_create: out_context is NULL");
    kva_context_options opt;
    if (options) opt = *options;
    else kva_context_options_init(&opt);
    KVA_RETURN_IF(opt.backend != KVA_BACKEND_AUTO && opt.backend != KVA_BACKEND_CPU && opt.backend != KVA_BACKEND_CUDA,
                  KVA_ERR_INVALID_ARGUMENT, "kva_context_create: options->backend = %d is not a kva_backend",
                  (int)opt.backend);
    KVA_RETURN_IF(opt.num_threads < 0 || opt.num_threads > 4096, KVA_ERR_INVALID_ARGUMENT,
                  "kva_context_create: options->num_threads = %d must be in [0, 4096] (0 = all online CPUs)",
                  (int)opt.num_threads);
    KVA_RETURN_IF(opt.device < 0, KVA_ERR_INVALID_ARGUMENT, "kva_context_create: options->device = %d is negative",
                  (int)opt.device);
    KVA_RETURN_IF(opt.jit_cache_dir && strlen(opt.jit_cache_dir) >= 1024, KVA_ERR_INVALID_ARGUMENT,
                  "kva_context_create: options->jit_cache_dir is longer than 1023 bytes");

    kva_context* ctx = (kva_context*)calloc(1, sizeof *ctx);
    KVA_RETURN_IF(!ctx, KVA_ERR_OUT_OF_MEMORY, "kva_context_create: out of host memory");
    kva__error_save(); /* a backend that is not there (AUTO falls back to the CPU) is not this call's failure */
    ctx->device = opt.device;
    ctx->num_threads = opt.num_threads > 0 ? opt.num_threads : kva__online_cpus();
    ctx->log_fn = opt.log_fn;
    ctx->log_user = opt.log_user;
    ctx->log_level = opt.log_level;
    if (opt.jit_cache_dir) strcpy(ctx->jit_cache_dir, opt.jit_cache_dir);
    ctx->id = atomic_fetch_add(&kva__next_context_id, 1);
    ctx->min_kv_chunk = KVA__MIN_KV_CHUNK;
    {
        const char* mc = getenv("KVATTN_BENCH_MIN_KV_CHUNK"); /* benchmark A/B only */
        const long v = mc ? strtol(mc, NULL, 10) : 0;
        if (v >= 16 && v <= (1L << 20)) {
            ctx->min_kv_chunk = (int32_t)v;
            ctx->small_kv_chunk = -1; /* the benchmark fixed the shortest chunk: no small-call floor */
        }
        const char* rsx = getenv("KVATTN_BENCH_RS_SPLIT"); /* benchmark A/B only */
        const long r = rsx ? strtol(rsx, NULL, 10) : 0;
        ctx->rs_max_split = r >= 1 && r <= 4096 ? (int32_t)r : KVA__RS_MAX_SPLIT;
        const char* rsm = getenv("KVATTN_BENCH_RS_MULTI_SPLIT"); /* benchmark A/B only: 0 = rs_max_split alone */
        const long rm = rsm && *rsm ? strtol(rsm, NULL, 10) : -1;
        ctx->rs_multi_split = rm >= 0 && rm <= 4096 ? (int32_t)rm : KVA__RS_MULTI_SPLIT;
        const char* rsg = getenv("KVATTN_BENCH_RS_MULTI_GROUP"); /* benchmark A/B only: the largest group it takes */
        const long rg = rsg && *rsg ? strtol(rsg, NULL, 10) : -1;
        ctx->rs_multi_group = rg >= 0 && rg <= 4096 ? (int32_t)rg : KVA__RS_MULTI_GROUP;
        const char* rsr = getenv("KVATTN_BENCH_RS_ROUND"); /* benchmark A/B only: 0 = chunk counts as computed */
        ctx->rs_merge_batch = rsr && rsr[0] == '0' && rsr[1] == '\0' ? 0 : KVA__RS_MERGE_BATCH;
        const char* lpt = getenv("KVATTN_BENCH_PLAN_LPT"); /* benchmark A/B only */
        ctx->plan_lpt_only = lpt && lpt[0] == '1';
    }
    pthread_mutex_init(&ctx->variant_mu, NULL);

    kva_status st = KVA_ERR_NO_DEVICE;
    if (opt.backend == KVA_BACKEND_CUDA || opt.backend == KVA_BACKEND_AUTO) {
#ifdef KVA_HAVE_CUDA
        ctx->backend = KVA_BACKEND_CUDA;
        st = kva__cuda_init(ctx);
#else
        st = kva__set_error(KVA_ERR_NO_DEVICE, "kva_context_create: this build of kvattn has no CUDA backend");
#endif
        if (st != KVA_OK && opt.backend == KVA_BACKEND_CUDA) {
            pthread_mutex_destroy(&ctx->variant_mu);
            free(ctx);
            return st;
        }
        if (st != KVA_OK)
            kva__log(ctx, KVA_LOG_INFO, "kvattn: CUDA backend unavailable (%s); using the CPU backend",
                     kva_last_error_message());
    }
    if (st != KVA_OK) {
        memset((void*)&ctx->ops, 0, sizeof ctx->ops);
        ctx->backend_state = NULL;
        ctx->backend = KVA_BACKEND_CPU;
        st = kva__cpu_init(ctx);
        if (st != KVA_OK) {
            pthread_mutex_destroy(&ctx->variant_mu);
            free(ctx);
            return st;
        }
    }
    kva__error_restore();
    kva__log(ctx, KVA_LOG_INFO, "kvattn %s: %s backend, %d workers", KVA_VERSION_STRING, ctx->ops->name,
             (int)ctx->num_workers);
    *out_context = ctx;
    return KVA_OK;
}

KVA_API kva_status kva_context_destroy(kva_context* context) {
    if (!context) return KVA_OK;
    kva__variants_destroy_all(context); /* before the backend: their kernels or shared objects are its */
    if (context->ops && context->ops->destroy) context->ops->destroy(context);
    pthread_mutex_destroy(&context->variant_mu);
    for (int i = 0; i < 8; ++i) free(context->plan_scratch[i]);
    free(context);
    return KVA_OK;
}

KVA_API kva_backend kva_context_backend(const kva_context* context) {
    return context ? context->backend : KVA_BACKEND_AUTO;
}

KVA_API int32_t kva_context_num_workers(const kva_context* context) { return context ? context->num_workers : 0; }

static pthread_mutex_t kva__stamp_mu = PTHREAD_MUTEX_INITIALIZER;
static uint64_t kva__stamp_next;
static uint32_t kva__stamp_victim;
static struct {
    uint64_t addr, stamp, graph_key;
} kva__stamps[KVA__STAMP_SLOTS];

uint64_t kva__stamp_record(uint64_t addr, uint64_t graph_key) {
    pthread_mutex_lock(&kva__stamp_mu);
    const uint64_t stamp = ++kva__stamp_next;
    int slot = -1;
    for (int i = 0; i < KVA__STAMP_SLOTS; ++i)
        if (kva__stamps[i].stamp && kva__stamps[i].addr == addr) {
            slot = i;
            break;
        }
    if (slot < 0) slot = (int)(kva__stamp_victim++ % KVA__STAMP_SLOTS);
    kva__stamps[slot].addr = addr;
    kva__stamps[slot].stamp = stamp;
    kva__stamps[slot].graph_key = graph_key;
    pthread_mutex_unlock(&kva__stamp_mu);
    return stamp;
}

int kva__stamp_current(uint64_t addr, uint64_t stamp, uint64_t graph_key) {
    int current = 1;
    pthread_mutex_lock(&kva__stamp_mu);
    for (int i = 0; i < KVA__STAMP_SLOTS; ++i)
        if (kva__stamps[i].stamp && kva__stamps[i].addr == addr) {
            current = graph_key ? kva__stamps[i].graph_key == graph_key : kva__stamps[i].stamp == stamp;
            break;
        }
    pthread_mutex_unlock(&kva__stamp_mu);
    return current;
}
