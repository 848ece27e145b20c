/* cpu_backend.c - CPU backend: init/destroy, the ops table, descriptor checks and the tile heuristic. */
#include <stdlib.h>
#include <string.h>

#include "cpu_internal.h"

#if defined(KVA__CPU_HAVE_AVX2)
#include <cpuid.h>
#endif

/* ---------------------------------------------------------------------------------------------- */
/* Descriptor support                                                                              */

static kva_status cpu_check_desc(const kva_context* ctx, const kva_attention_desc* desc, kva_op op) {
    (void)ctx;
    KVA_RETURN_IF(!desc, KVA_ERR_INVALID_ARGUMENT, "CPU backend: desc is NULL");
    KVA_RETURN_IF(op != KVA_OP_BATCH_DECODE && op != KVA_OP_BATCH_PREFILL_PAGED && op != KVA_OP_BATCH_PREFILL_RAGGED,
                  KVA_ERR_UNSUPPORTED, "CPU backend: unknown op %d", (int)op);
    KVA_RETURN_IF(desc->head_dim_qk < 1 || desc->head_dim_qk > KVA__CPU_MAX_DIM, KVA_ERR_UNSUPPORTED,
                  "CPU backend: head_dim_qk = %d is not supported (supported: 1 .. %d)", (int)desc->head_dim_qk,
                  KVA__CPU_MAX_DIM);
    KVA_RETURN_IF(desc->head_dim_vo < 1 || desc->head_dim_vo > KVA__CPU_MAX_DIM, KVA_ERR_UNSUPPORTED,
                  "CPU backend: head_dim_vo = %d is not supported (supported: 1 .. %d)", (int)desc->head_dim_vo,
                  KVA__CPU_MAX_DIM);
    KVA_RETURN_IF(desc->pos_encoding == KVA_POS_ROPE_LLAMA && (desc->head_dim_qk % 2) != 0, KVA_ERR_UNSUPPORTED,
                  "CPU backend: fused RoPE needs an even head_dim_qk (got %d)", (int)desc->head_dim_qk);
    KVA_RETURN_IF(!kva__cpu_is_float_dtype(desc->q_dtype), KVA_ERR_UNSUPPORTED,
                  "CPU backend: q_dtype %d is not supported (f32, f16, bf16)", (int)desc->q_dtype);
    KVA_RETURN_IF(!kva__cpu_is_float_dtype(desc->o_dtype), KVA_ERR_UNSUPPORTED,
                  "CPU backend: o_dtype %d is not supported (f32, f16, bf16)", (int)desc->o_dtype);
    KVA_RETURN_IF(!kva__cpu_is_kv_dtype(desc->kv_dtype), KVA_ERR_UNSUPPORTED,
                  "CPU backend: kv_dtype %d is not supported (f32, f16, bf16, e4m3, e5m2)", (int)desc->kv_dtype);
    KVA_RETURN_IF(desc->mask_mode != KVA_MASK_NONE && desc->mask_mode != KVA_MASK_CAUSAL &&
                      desc->mask_mode != KVA_MASK_CUSTOM,
                  KVA_ERR_UNSUPPORTED, "CPU backend: mask_mode %d is not supported", (int)desc->mask_mode);
    KVA_RETURN_IF(desc->pos_encoding != KVA_POS_NONE && desc->pos_encoding != KVA_POS_ROPE_LLAMA &&
                      desc->pos_encoding != KVA_POS_ALIBI,
                  KVA_ERR_UNSUPPORTED, "CPU backend: pos_encoding %d is not supported", (int)desc->pos_encoding);
    KVA_RETURN_IF(desc->score_mode != KVA_SCORE_SOFTMAX && desc->score_mode != KVA_SCORE_SIGMOID, KVA_ERR_UNSUPPORTED,
                  "CPU backend: score_mode %d is not supported", (int)desc->score_mode);
    return KVA_OK;
}

/*
 * Packed query rows per tile. The CPU kernel converts each K/V block to f32 once per tile and reuses it
 * for every row of the tile, so taller tiles cut conversion and memory traffic; shorter tiles waste less
 * work on partially filled tiles and give the planner more items to balance over few threads.
 *  - decode: one tile covers the whole GQA group (g packed rows), so K/V is read once per group; rounded
 *    up to a multiple of 4 (the score/PV micro-kernels work on 4 rows), capped at KVA__MAX_TILE_Q.
 *  - prefill: 128 rows for long queries (the 128 x D f32 q tile plus accumulators stay cache resident up
 *    to D < 256), 64 for medium, 16 for short (append/speculative steps).
 */
static int32_t cpu_choose_tile_q(const kva_context* ctx, const kva_attention_desc* desc, kva_op op,
                                 double avg_packed_qo_len, int32_t max_packed_qo_len) {
    (void)ctx;
    (void)max_packed_qo_len;
    if (op == KVA_OP_BATCH_DECODE) {
        int32_t g = desc && desc->num_kv_heads > 0 ? desc->num_qo_heads / desc->num_kv_heads : 1;
        if (g < 1) g = 1;
        int32_t t = (g + 3) / 4 * 4;
        return t > KVA__MAX_TILE_Q ? KVA__MAX_TILE_Q : t;
    }
    if (avg_packed_qo_len > 64.0 && desc && desc->head_dim_qk < 256) return 128;
    if (avg_packed_qo_len > 16.0) return 64;
    return 16;
}

static kva_status cpu_finish_plan(kva_context* ctx, kva__plan_data* plan, const kva_workspace* ws, void* stream) {
    (void)ctx;
    (void)plan;
    (void)ws;
    (void)stream;
    return KVA_OK; /* the planner wrote the int region straight into ws->device (host memory) */
}

static kva_status cpu_read_faults(kva_context* ctx, const kva_workspace* ws, int which, kva_fault_report* report,
                                  void* stream) {
    (void)ctx;
    (void)ws;
    (void)which;
    (void)stream;
    KVA_RETURN_IF(!report, KVA_ERR_INVALID_ARGUMENT, "read_faults: report is NULL");
    report->faulted = 0; /* the CPU backend validates page indices before running */
    report->request = -1;
    report->page_index = 0;
    return KVA_OK;
}

/* ---------------------------------------------------------------------------------------------- */
/* Scratch                                                                                         */

static size_t carve(size_t* off, size_t bytes) {
    size_t at = kva__align_up(*off, KVA__CPU_ALIGN);
    *off = at + bytes;
    return at;
}

static int scratch_alloc(kva__cpu_scratch* sc) {
    const size_t F = sizeof(float);
    size_t off = 0;
    size_t o_q = carve(&off, F * KVA__MAX_TILE_Q * KVA__CPU_MAX_DIM);
    size_t o_acc = carve(&off, F * KVA__MAX_TILE_Q * KVA__CPU_MAX_DIM);
    size_t o_s = carve(&off, F * KVA__MAX_TILE_Q * KVA__CPU_KV_BLOCK);
    size_t o_k = carve(&off, F * KVA__CPU_KV_BLOCK * KVA__CPU_MAX_DIM);
    size_t o_v = carve(&off, F * KVA__CPU_KV_BLOCK * KVA__CPU_MAX_DIM);
    size_t o_m = carve(&off, F * KVA__MAX_TILE_Q);
    size_t o_d = carve(&off, F * KVA__MAX_TILE_Q);
    size_t o_al = carve(&off, F * KVA__MAX_TILE_Q);
    size_t o_sl = carve(&off, F * KVA__MAX_TILE_Q);
    size_t o_cos = carve(&off, F * KVA__MAX_TILE_Q * (KVA__CPU_MAX_DIM / 2));
    size_t o_sin = carve(&off, F * KVA__MAX_TILE_Q * (KVA__CPU_MAX_DIM / 2));
    size_t o_tmp = carve(&off, F * 2 * KVA__CPU_MAX_DIM);
    size_t o_kp = carve(&off, sizeof(const char*) * 2 * KVA__CPU_KV_BLOCK);
    size_t o_vp = carve(&off, sizeof(const char*) * 2 * KVA__CPU_KV_BLOCK);
    size_t o_rope = carve(&off, sizeof(kva__cpu_rope_cursor));
    size_t total = kva__align_up(off, KVA__CPU_ALIGN);
    char* b = (char*)aligned_alloc(KVA__CPU_ALIGN, total);
    if (!b) return 0;
    memset(b, 0, total);
    sc->block = b;
    sc->q = (float*)(void*)(b + o_q);
    sc->acc = (float*)(void*)(b + o_acc);
    sc->s = (float*)(void*)(b + o_s);
    sc->k = (float*)(void*)(b + o_k);
    sc->v = (float*)(void*)(b + o_v);
    sc->m = (float*)(void*)(b + o_m);
    sc->d = (float*)(void*)(b + o_d);
    sc->alpha = (float*)(void*)(b + o_al);
    sc->slope = (float*)(void*)(b + o_sl);
    sc->cosr = (float*)(void*)(b + o_cos);
    sc->sinr = (float*)(void*)(b + o_sin);
    sc->tmp = (float*)(void*)(b + o_tmp);
    sc->kp = (const char**)(void*)(b + o_kp);
    sc->vp = (const char**)(void*)(b + o_vp);
    sc->rope = (kva__cpu_rope_cursor*)(void*)(b + o_rope);
    return 1;
}

/* ---------------------------------------------------------------------------------------------- */
/* Lifetime                                                                                        */

static void cpu_destroy(kva_context* ctx);

static const kva__backend_ops kva__cpu_ops = {
    "cpu",
    true,
    cpu_check_desc,
    cpu_choose_tile_q,
    cpu_finish_plan,
    kva__cpu_run,
    kva__cpu_merge_state,
    kva__cpu_merge_states,
    kva__cpu_append_paged_kv,
    cpu_read_faults,
    cpu_destroy,
    kva__cpu_variant_compile,
    kva__cpu_variant_release,
    NULL, /* plan_workers: every thread */
    NULL, /* kv_head_group: one KV head per unit */
    NULL, /* cluster_ok: (no clusters unless a test sets kva_context.cluster_size) */
};

#if defined(KVA__CPU_HAVE_AVX2)
/* AVX2 + FMA + F16C, and the OS saves YMM state (CPUID leaves 1 and 7, XGETBV) */
static int cpu_has_avx2_fma_f16c(void) {
    unsigned a, b, c, d;
    if (!__get_cpuid(1, &a, &b, &c, &d)) return 0;
    const unsigned need1 = (1u << 12) | (1u << 27) | (1u << 28) | (1u << 29); /* FMA, OSXSAVE, AVX, F16C */
    if ((c & need1) != need1) return 0;
    unsigned xlo, xhi;
    __asm__ volatile("xgetbv" : "=a"(xlo), "=d"(xhi) : "c"(0));
    (void)xhi;
    if ((xlo & 6u) != 6u) return 0; /* XMM and YMM state */
    if (__get_cpuid_max(0, NULL) < 7) return 0;
    __cpuid_count(7, 0, a, b, c, d);
    return (b >> 5) & 1u; /* AVX2 */
}
#endif

static const kva__cpu_kernels* select_kernels(void) {
    const char* force = getenv("KVATTN_CPU_KERNELS"); /* "generic" forces the portable kernels (testing) */
    if (force && strcmp(force, "generic") == 0) return &kva__cpu_kernels_generic;
#if defined(KVA__CPU_HAVE_AVX2)
    if (cpu_has_avx2_fma_f16c()) return &kva__cpu_kernels_avx2;
#endif
    return &kva__cpu_kernels_generic;
}

static void state_free(kva__cpu_state* st) {
    if (!st) return;
    if (st->pool) kva__cpu_pool_destroy(st->pool);
    if (st->scratch) {
        for (int32_t t = 0; t < st->num_threads; ++t) free(st->scratch[t].block);
        free(st->scratch);
    }
    pthread_mutex_destroy(&st->call_mu);
    free(st);
}

kva_status kva__cpu_init(kva_context* ctx) {
    KVA_RETURN_IF(!ctx, KVA_ERR_INVALID_ARGUMENT, "CPU backend: context is NULL");
    kva__cpu_convert_init();
    int32_t nt = ctx->num_threads >= 1 ? ctx->num_threads : 1;
    kva__cpu_state* st = (kva__cpu_state*)calloc(1, sizeof(*st));
    if (!st) return kva__set_error(KVA_ERR_OUT_OF_MEMORY, "CPU backend: cannot allocate the backend state");
    if (pthread_mutex_init(&st->call_mu, NULL) != 0) {
        free(st);
        return kva__set_error(KVA_ERR_OUT_OF_MEMORY, "CPU backend: pthread_mutex_init failed");
    }
    st->num_threads = nt;
    st->kern = select_kernels();
    st->scratch = (kva__cpu_scratch*)calloc((size_t)nt, sizeof(kva__cpu_scratch));
    if (!st->scratch) {
        state_free(st);
        return kva__set_error(KVA_ERR_OUT_OF_MEMORY, "CPU backend: cannot allocate scratch for %d threads", (int)nt);
    }
    for (int32_t t = 0; t < nt; ++t) {
        if (!scratch_alloc(&st->scratch[t])) {
            state_free(st);
            return kva__set_error(KVA_ERR_OUT_OF_MEMORY, "CPU backend: cannot allocate scratch for thread %d of %d",
                                  (int)t, (int)nt);
        }
    }
    kva_status s = kva__cpu_pool_create(nt, &st->pool);
    if (s != KVA_OK) {
        state_free(st);
        return s; /* message recorded by the pool */
    }
    ctx->num_workers = nt;
    ctx->ops = &kva__cpu_ops;
    ctx->backend_state = st;
    return KVA_OK;
}

static void cpu_destroy(kva_context* ctx) {
    if (!ctx) return;
    state_free((kva__cpu_state*)ctx->backend_state);
    ctx->backend_state = NULL;
}

const char* kva__cpu_kernel_name(const kva_context* ctx) {
    const kva__cpu_state* st = ctx ? (const kva__cpu_state*)ctx->backend_state : NULL;
    return st && st->kern ? st->kern->name : "none";
}
