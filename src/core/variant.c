/* variant.c - user-defined attention variants: spec validation, creation (the backend compiles the hooks),
 * the per-context registry that plans and runs consult, and the run-time parameter checks. docs/variants.md. */
#include <ctype.h>
#include <math.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>

#include "internal.h"

static atomic_uint_fast64_t kva__next_variant_id = 1;

/* The prelude of the host C compile. kva_vparams has the layout of kva__vparams. */
static const char kva__prelude_c[] =
    "/* kvattn variant prelude (host C compiler) */\n"
    "#include <math.h>\n"
    "#include <stdint.h>\n"
    "#define KVA_HOOK static inline\n"
    "#define KVA_INFINITY (INFINITY)\n"
    "#define KVA_CUDA 0\n"
    "typedef struct kva_vparams { float s[16]; const float* t[4]; } kva_vparams;\n";

/* The prelude of the NVRTC compile (kvk_vparams: src/kernels/kva_kparams.h). */
static const char kva__prelude_cuda[] =
    "/* kvattn variant prelude (NVRTC) */\n"
    "#include \"kva_kparams.h\"\n"
    "#define KVA_HOOK static __device__ __forceinline__\n"
    "#define KVA_INFINITY (__int_as_float(0x7f800000))\n"
    "#define KVA_CUDA 1\n"
    "typedef kvk_vparams kva_vparams;\n";

const char* kva__variant_prelude(int cuda) { return cuda ? kva__prelude_cuda : kva__prelude_c; }

KVA_API void kva_variant_spec_init(kva_variant_spec* spec) {
    if (!spec) return;
    memset(spec, 0, sizeof *spec);
    spec->use_softmax = 1;
}

static kva_status kva__check_spec(const kva_variant_spec* s) {
    KVA_RETURN_IF(!s, KVA_ERR_INVALID_ARGUMENT, "kva_variant_create: spec is NULL");
    KVA_RETURN_IF(!s->name || !s->name[0], KVA_ERR_INVALID_ARGUMENT, "kva_variant_create: spec->name is empty");
    size_t n = strlen(s->name);
    KVA_RETURN_IF(n > KVA_VARIANT_MAX_NAME, KVA_ERR_INVALID_ARGUMENT,
                  "kva_variant_create: spec->name has %zu characters (at most %d)", n, KVA_VARIANT_MAX_NAME);
    for (size_t i = 0; i < n; ++i) {
        unsigned char c = (unsigned char)s->name[i];
        bool ok = c == '_' || (c < 128 && isalpha(c)) || (i > 0 && c < 128 && isdigit(c));
        KVA_RETURN_IF(!ok, KVA_ERR_INVALID_ARGUMENT,
                      "kva_variant_create: spec->name \"%s\" is not a C identifier (character %zu)", s->name, i);
    }
    KVA_RETURN_IF(!s->source || !s->source[0], KVA_ERR_INVALID_ARGUMENT,
                  "kva_variant_create: spec->source of \"%s\" is empty", s->name);
    const uint32_t all = KVA_VARIANT_QUERY_TRANSFORM | KVA_VARIANT_KEY_TRANSFORM | KVA_VARIANT_LOGITS_TRANSFORM |
                         KVA_VARIANT_LOGITS_MASK | KVA_VARIANT_OUTPUT_TRANSFORM;
    KVA_RETURN_IF((s->hooks & ~all) != 0, KVA_ERR_INVALID_ARGUMENT,
                  "kva_variant_create: spec->hooks = 0x%x has bits outside the KVA_VARIANT_* flags (0x%x)",
                  (unsigned)s->hooks, (unsigned)all);
    KVA_RETURN_IF(s->use_softmax != 0 && s->use_softmax != 1, KVA_ERR_INVALID_ARGUMENT,
                  "kva_variant_create: spec->use_softmax = %d must be 0 or 1", (int)s->use_softmax);
    KVA_RETURN_IF(s->num_scalar_params < 0 || s->num_scalar_params > KVA_VARIANT_MAX_SCALARS,
                  KVA_ERR_INVALID_ARGUMENT, "kva_variant_create: spec->num_scalar_params = %d must be in [0, %d]",
                  (int)s->num_scalar_params, KVA_VARIANT_MAX_SCALARS);
    KVA_RETURN_IF(s->num_tensor_params < 0 || s->num_tensor_params > KVA_VARIANT_MAX_TENSORS,
                  KVA_ERR_INVALID_ARGUMENT, "kva_variant_create: spec->num_tensor_params = %d must be in [0, %d]",
                  (int)s->num_tensor_params, KVA_VARIANT_MAX_TENSORS);
    return KVA_OK;
}

/* Every live variant of every context, so that kva_variant_destroy can refuse a pointer that is no longer one (a
   second destroy, or a destroy after its context destroyed it) without reading freed memory. */
static pthread_mutex_t kva__live_mu = PTHREAD_MUTEX_INITIALIZER;
static kva_variant** kva__live;
static size_t kva__num_live, kva__cap_live;

static bool kva__live_add(kva_variant* v) {
    bool ok = true;
    pthread_mutex_lock(&kva__live_mu);
    if (kva__num_live == kva__cap_live) {
        size_t cap = kva__cap_live ? 2 * kva__cap_live : 16;
        kva_variant** nv = (kva_variant**)realloc(kva__live, sizeof *nv * cap);
        if (nv) {
            kva__live = nv;
            kva__cap_live = cap;
        } else {
            ok = false;
        }
    }
    if (ok) kva__live[kva__num_live++] = v;
    pthread_mutex_unlock(&kva__live_mu);
    return ok;
}

/* Removes v from the live set; false if it was not there. */
static bool kva__live_remove(const kva_variant* v) {
    bool found = false;
    pthread_mutex_lock(&kva__live_mu);
    for (size_t i = 0; i < kva__num_live; ++i)
        if (kva__live[i] == v) {
            kva__live[i] = kva__live[--kva__num_live];
            found = true;
            break;
        }
    if (kva__num_live == 0) { /* the last one gone: no allocation outlives the library's use */
        free(kva__live);
        kva__live = NULL;
        kva__cap_live = 0;
    }
    pthread_mutex_unlock(&kva__live_mu);
    return found;
}

static void kva__variant_free(kva_variant* v) {
    if (!v) return;
    kva__live_remove(v);
    v->magic = 0;
    free(v->source);
    free(v->cuda_src);
    free(v->cuda_src_pf);
    free(v);
}

KVA_API kva_status kva_variant_create(kva_context* context, const kva_variant_spec* spec, kva_variant** out_variant) {
    KVA_RETURN_IF(!context, KVA_ERR_INVALID_ARGUMENT, "kva_variant_create: context is NULL");
    KVA_RETURN_IF(!out_variant, KVA_ERR_INVALID_ARGUMENT, "kva_variant_create: out_variant is NULL");
    KVA_FORWARD(kva__check_spec(spec));
    KVA_RETURN_IF(!context->ops->variant_compile, KVA_ERR_UNSUPPORTED,
                  "kva_variant_create: the %s backend does not compile user variants", context->ops->name);
    kva_variant* v = (kva_variant*)calloc(1, sizeof *v);
    KVA_RETURN_IF(!v, KVA_ERR_OUT_OF_MEMORY, "kva_variant_create: out of host memory");
    size_t sl = strlen(spec->source);
    v->source = (char*)malloc(sl + 1);
    if (!v->source) {
        kva__variant_free(v);
        return kva__set_error(KVA_ERR_OUT_OF_MEMORY, "kva_variant_create: out of host memory");
    }
    memcpy(v->source, spec->source, sl + 1);
    v->magic = KVA__VARIANT_MAGIC;
    v->id = atomic_fetch_add(&kva__next_variant_id, 1);
    v->ctx = context;
    strcpy(v->name, spec->name);
    v->hooks = spec->hooks;
    v->use_softmax = spec->use_softmax;
    v->num_scalars = spec->num_scalar_params;
    v->num_tensors = spec->num_tensor_params;
    uint64_t h = KVA__FNV_SEED;
    h = kva__fnv(h, v->name, strlen(v->name) + 1);
    h = kva__fnv(h, v->source, sl + 1);
    int32_t facts[4] = {(int32_t)v->hooks, v->use_softmax, v->num_scalars, v->num_tensors};
    h = kva__fnv(h, facts, sizeof facts);
    v->hash = h;

    kva_status st = context->ops->variant_compile(context, v);
    if (st != KVA_OK) {
        if (context->ops->variant_release) context->ops->variant_release(context, v);
        kva__variant_free(v);
        return st;
    }
    if (!kva__live_add(v)) {
        if (context->ops->variant_release) context->ops->variant_release(context, v);
        kva__variant_free(v);
        return kva__set_error(KVA_ERR_OUT_OF_MEMORY, "kva_variant_create: out of host memory");
    }
    pthread_mutex_lock(&context->variant_mu);
    if (context->num_variants == context->cap_variants) {
        int32_t cap = context->cap_variants ? 2 * context->cap_variants : 8;
        kva_variant** nv = (kva_variant**)realloc(context->variants, sizeof *nv * (size_t)cap);
        if (!nv) {
            pthread_mutex_unlock(&context->variant_mu);
            if (context->ops->variant_release) context->ops->variant_release(context, v);
            kva__variant_free(v);
            return kva__set_error(KVA_ERR_OUT_OF_MEMORY, "kva_variant_create: out of host memory");
        }
        context->variants = nv;
        context->cap_variants = cap;
    }
    context->variants[context->num_variants++] = v;
    pthread_mutex_unlock(&context->variant_mu);
    kva__log(context, KVA_LOG_INFO, "kvattn: variant %s (hooks 0x%x, %s) ready on the %s backend", v->name,
             (unsigned)v->hooks, v->use_softmax ? "softmax" : "no softmax", context->ops->name);
    *out_variant = v;
    return KVA_OK;
}

KVA_API kva_status kva_variant_destroy(kva_variant* variant) {
    if (!variant) return KVA_OK;
    /* checked before the object is read: a pointer that is not live may point at freed memory */
    KVA_RETURN_IF(!kva__live_remove(variant), KVA_ERR_INVALID_ARGUMENT,
                  "kva_variant_destroy: %p is not a live variant (destroyed twice, destroyed with its context, or not "
                  "made by kva_variant_create)", (void*)variant);
    KVA_RETURN_IF(variant->magic != KVA__VARIANT_MAGIC, KVA_ERR_INTERNAL,
                  "kva_variant_destroy: a live variant with a bad magic (corrupted?)");
    kva_context* ctx = variant->ctx;
    pthread_mutex_lock(&ctx->variant_mu);
    int32_t found = -1;
    for (int32_t i = 0; i < ctx->num_variants; ++i)
        if (ctx->variants[i] == variant) found = i;
    if (found >= 0) ctx->variants[found] = ctx->variants[--ctx->num_variants];
    pthread_mutex_unlock(&ctx->variant_mu);
    KVA_RETURN_IF(found < 0, KVA_ERR_INVALID_ARGUMENT, "kva_variant_destroy: the variant is not registered with its "
                                                       "context (destroyed twice?)");
    if (ctx->ops->variant_release) ctx->ops->variant_release(ctx, variant);
    kva__variant_free(variant);
    return KVA_OK;
}

void kva__variants_destroy_all(kva_context* ctx) {
    for (int32_t i = 0; i < ctx->num_variants; ++i) {
        kva_variant* v = ctx->variants[i];
        if (ctx->ops && ctx->ops->variant_release) ctx->ops->variant_release(ctx, v);
        kva__variant_free(v);
    }
    free(ctx->variants);
    ctx->variants = NULL;
    ctx->num_variants = ctx->cap_variants = 0;
}

kva_status kva__variant_check_live(kva_context* ctx, const kva_variant* v, uint64_t id, const char* what) {
    bool live = false;
    pthread_mutex_lock(&ctx->variant_mu);
    for (int32_t i = 0; i < ctx->num_variants && !live; ++i)
        if (ctx->variants[i] == v && (id == 0 || ctx->variants[i]->id == id)) live = true;
    pthread_mutex_unlock(&ctx->variant_mu);
    KVA_RETURN_IF(!live, id ? KVA_ERR_PLAN_MISMATCH : KVA_ERR_INVALID_ARGUMENT,
                  "%s: the variant %p is not a live variant of this context (destroyed, or created with another "
                  "context)",
                  what, (const void*)v);
    return KVA_OK;
}

kva_status kva__variant_check_args(kva_context* ctx, const kva_attention_desc* d, uint64_t id, const kva_run_args* a,
                                   kva__vparams* vp) {
    if (vp) memset(vp, 0, sizeof *vp);
    if (!d->variant) {
        KVA_RETURN_IF(a->num_variant_scalars != 0 || a->num_variant_tensors != 0, KVA_ERR_INVALID_ARGUMENT,
                      "run: args give %d variant scalars and %d variant tensors, but the descriptor has no variant",
                      (int)a->num_variant_scalars, (int)a->num_variant_tensors);
        return KVA_OK;
    }
    KVA_FORWARD(kva__variant_check_live(ctx, d->variant, id, "run"));
    const kva_variant* v = d->variant;
    KVA_RETURN_IF(a->num_variant_scalars != v->num_scalars, KVA_ERR_INVALID_ARGUMENT,
                  "run: args->num_variant_scalars = %d, variant %s takes %d scalar parameters",
                  (int)a->num_variant_scalars, v->name, (int)v->num_scalars);
    KVA_RETURN_IF(a->num_variant_tensors != v->num_tensors, KVA_ERR_INVALID_ARGUMENT,
                  "run: args->num_variant_tensors = %d, variant %s takes %d tensor parameters",
                  (int)a->num_variant_tensors, v->name, (int)v->num_tensors);
    KVA_RETURN_IF(v->num_scalars > 0 && !a->variant_scalars, KVA_ERR_INVALID_ARGUMENT,
                  "run: args->variant_scalars is NULL (variant %s takes %d scalars)", v->name, (int)v->num_scalars);
    KVA_RETURN_IF(v->num_tensors > 0 && !a->variant_tensors, KVA_ERR_INVALID_ARGUMENT,
                  "run: args->variant_tensors is NULL (variant %s takes %d tensors)", v->name, (int)v->num_tensors);
    for (int32_t i = 0; i < v->num_tensors; ++i)
        KVA_RETURN_IF(!a->variant_tensors[i], KVA_ERR_INVALID_ARGUMENT,
                      "run: args->variant_tensors[%d] is NULL (variant %s)", (int)i, v->name);
    for (int32_t i = 0; i < v->num_tensors; ++i)
        KVA_RETURN_IF(((uintptr_t)a->variant_tensors[i] & 3u) != 0, KVA_ERR_ALIGNMENT,
                      "run: args->variant_tensors[%d] = %p is not 4-byte aligned (f32 data)", (int)i,
                      a->variant_tensors[i]);
    if (vp) {
        for (int32_t i = 0; i < v->num_scalars; ++i) vp->s[i] = a->variant_scalars[i];
        for (int32_t i = 0; i < v->num_tensors; ++i) vp->t[i] = (const float*)a->variant_tensors[i];
    }
    return KVA_OK;
}
