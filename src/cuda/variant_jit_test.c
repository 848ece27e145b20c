/*
 * variant_jit_test.c - the CUDA compile path of user variants without a GPU (CTest "cuda_nvrtc_user_variants"):
 * NVRTC compiles the shipped example variants (examples/variants) and a variant with every hook into their
 * kernels (the CUDA-core attention kernel and the variant's merge kernel) for sm_80 and sm_90a, for the tiles and
 * dtypes the selection function picks; the hook check compile accepts them and rejects a bad source with the
 * NVRTC log in the message; the selection function routes variants to the CUDA-core kernel.
 * Prints "N passed, N failed" last.
 */
#define _POSIX_C_SOURCE 200809L
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cuda_internal.h"
#include "cuda_prefill.h"
#include "ptxas_log.h"

#ifndef KVA_EXAMPLES_DIR
#error "KVA_EXAMPLES_DIR must name examples/variants"
#endif

static int npass, nfail;

#define CHECK(cond, ...)                                \
    do {                                                \
        if (cond) {                                     \
            npass++;                                    \
        } else {                                        \
            nfail++;                                    \
            printf("FAIL %s:%d: ", __FILE__, __LINE__); \
            printf(__VA_ARGS__);                        \
            printf("\n");                               \
        }                                               \
    } while (0)

static char* read_text(const char* path) {
    FILE* f = fopen(path, "rb");
    if (!f) return NULL;
    fseek(f, 0, SEEK_END);
    long n = ftell(f);
    fseek(f, 0, SEEK_SET);
    char* s = (char*)malloc((size_t)n + 1);
    if (s && fread(s, 1, (size_t)n, f) != (size_t)n) {
        free(s);
        s = NULL;
    }
    if (s) s[n] = '\0';
    fclose(f);
    return s;
}

static const char all_hooks_src[] =
    "KVA_HOOK float kva_query_transform(const kva_vparams* p, float q, int b, int h, int qp, int d) {\n"
    "    return q * p->s[0] + (float)(b + h + qp + d) * 0.0f;\n"
    "}\n"
    "KVA_HOOK float kva_key_transform(const kva_vparams* p, float k, int b, int h, int kp, int d) {\n"
    "    return k + p->s[1] * (float)(d % 3) + (float)(b + h + kp) * 0.0f;\n"
    "}\n"
    "KVA_HOOK float kva_logits_transform(const kva_vparams* p, float x, int b, int qh, int kh, int qp, int kp) {\n"
    "    return p->s[2] * tanhf(x / p->s[2]) + 0.1f * p->t[0][qh] + (float)(b + kh + qp + kp) * 0.0f;\n"
    "}\n"
    "KVA_HOOK int kva_logits_mask(const kva_vparams* p, int b, int qh, int kh, int qp, int kp) {\n"
    "    (void)p, (void)qh, (void)kh;\n"
    "    return (qp + 2 * kp + b) % 5 != 0;\n"
    "}\n"
    "KVA_HOOK float kva_output_transform(const kva_vparams* p, float o, float lse, int b, int h, int qp, int d) {\n"
    "    (void)p, (void)b, (void)qp, (void)d;\n"
    "    return o * (1.0f + 0.01f * (float)h) + (lse == -KVA_INFINITY ? 0.0f : 0.001f * lse);\n"
    "}\n";

static void make_variant(kva_variant* v, const char* name, const char* src, uint32_t hooks, int softmax) {
    memset(v, 0, sizeof *v);
    v->magic = KVA__VARIANT_MAGIC;
    snprintf(v->name, sizeof v->name, "%s", name);
    v->source = (char*)src;
    v->hooks = hooks;
    v->use_softmax = softmax;
    v->hash = kva__fnv(KVA__FNV_SEED, src, strlen(src)) ^ (uint64_t)hooks ^ ((uint64_t)softmax << 40);
    v->cuda_src = kva__cuda_variant_source(v, 0);
    v->cuda_src_pf = kva__cuda_variant_tc_ok(v) ? kva__cuda_variant_source(v, 2) : NULL;
}

static void compile_variant(kva_variant* v) {
    static const char* const archs[] = {"sm_80", "sm_90a"};
    for (int a = 0; a < 2; ++a) {
        kva_status st = kva__cuda_variant_check_compile(v, archs[a], NULL);
        CHECK(st == KVA_OK, "hook check of %s for %s: %s", v->name, archs[a], kva_last_error_message());
    }
    /* decode (GQA 32/8: the CUDA-core kernel, tile 4) and prefill (the tensor-core kernel for a variant without query
       / key transforms, else the CUDA-core kernel with tile 8), f16 / bf16 with bf16 and e4m3 KV */
    struct {
        kva_op op;
        int hq, hkv, d;
        kva_dtype qt, kt, ot;
    } cfg[] = {{KVA_OP_BATCH_DECODE, 32, 8, 128, KVA_DTYPE_BF16, KVA_DTYPE_BF16, KVA_DTYPE_BF16},
               {KVA_OP_BATCH_PREFILL_PAGED, 32, 8, 128, KVA_DTYPE_F16, KVA_DTYPE_F16, KVA_DTYPE_F32},
               {KVA_OP_BATCH_PREFILL_RAGGED, 8, 8, 64, KVA_DTYPE_BF16, KVA_DTYPE_E4M3, KVA_DTYPE_BF16}};
    for (int c = 0; c < 3; ++c) {
        kva_attention_desc d;
        kva_attention_desc_init(&d, cfg[c].hq, cfg[c].hkv, cfg[c].d, cfg[c].qt);
        d.kv_dtype = cfg[c].kt;
        d.o_dtype = cfg[c].ot;
        d.variant = v;
        kva__kchoice ch;
        kva_status st = kva__cuda_select(&d, cfg[c].op, 0, 64, &ch);
        CHECK(st == KVA_OK, "select %s: %s", v->name, kva_last_error_message());
        if (st != KVA_OK) continue;
        /* prefill ops: the tensor-core kernel unless the variant transforms q or k; decode: the CUDA-core kernel */
        const int tc = cfg[c].op != KVA_OP_BATCH_DECODE && kva__cuda_variant_tc_ok(v);
        CHECK(ch.key.var_hash == v->hash &&
                  (tc ? ch.key.family == KVA__KF_PREFILL && ch.key.var_src == v->cuda_src_pf && ch.tile_q > 8 &&
                            ch.key.mainloop == 0
                      : ch.key.family == KVA__KF_DECODE && ch.key.var_src == v->cuda_src && ch.tile_q <= 8),
              "%s: a variant selects the %s kernel with its hash and source (family %d, tile %d)", v->name,
              tc ? "tensor-core" : "CUDA-core", (int)ch.key.family, (int)ch.tile_q);
        for (int a = 0; a < 2; ++a) {
            void* cubin = NULL;
            size_t size = 0;
            char name[128];
            kva__kkey_name(&ch.key, name, sizeof name);
            char* log = NULL;
            st = kva__jit_compile(&ch.key, archs[a], tc ? "--ptxas-options=-v" : NULL, &cubin, &size, tc ? &log : NULL);
            CHECK(st == KVA_OK && size > 0, "NVRTC %s (%s) for %s: %s", name, v->name, archs[a],
                  kva_last_error_message());
            if (st == KVA_OK && log) { /* the tensor-core instance keeps its register budget (no spills) */
                const int sp = kva__ptxas_max_count(log, "bytes spill stores") + kva__ptxas_max_count(log, "bytes spill loads");
                CHECK(sp == 0 && kva__ptxas_max_count(log, "bytes stack frame") == 0, "%s (%s) for %s spills:\n%s", name,
                      v->name, archs[a], log);
            }
            free(log);
            free(cubin);
        }
    }
}

int main(void) {
    const kva__nvrtc_api* nv = kva__nvrtc_load();
    CHECK(nv != NULL, "NVRTC not loadable: %s", kva_last_error_message());
    if (!nv) {
        printf("%d passed, %d failed\n", npass, nfail);
        return 1;
    }
    char* sig = read_text(KVA_EXAMPLES_DIR "/flash_sigmoid.c");
    char* sink = read_text(KVA_EXAMPLES_DIR "/attention_sink.c");
    CHECK(sig && sink, "example sources under %s", KVA_EXAMPLES_DIR);
    kva_variant v;
    if (sig) {
        make_variant(&v, "flash_sigmoid", sig, KVA_VARIANT_LOGITS_TRANSFORM, 0);
        compile_variant(&v);
        free(v.cuda_src);
        free(v.cuda_src_pf);
    }
    if (sink) {
        make_variant(&v, "attention_sink", sink, KVA_VARIANT_OUTPUT_TRANSFORM, 1);
        compile_variant(&v);
        free(v.cuda_src);
        free(v.cuda_src_pf);
    }
    make_variant(&v, "all_hooks", all_hooks_src, 31u, 1);
    compile_variant(&v);
    free(v.cuda_src);
    free(v.cuda_src_pf);
    /* the tensor-core kernel's hook sites: logits mask and transform and the output transform, with and without
       softmax */
    for (int sm = 0; sm < 2; ++sm) {
        make_variant(&v, sm ? "logits_hooks" : "logits_hooks_nosoftmax", all_hooks_src, 28u, sm);
        compile_variant(&v);
        free(v.cuda_src);
        free(v.cuda_src_pf);
    }

    /* a bad source: KVA_ERR_JIT with the NVRTC log (naming the user's file and line) */
    make_variant(&v, "broken",
                 "KVA_HOOK float kva_output_transform(const kva_vparams* p, float o, float lse, int b, int h, int qp,\n"
                 "                                    int d) {\n"
                 "    return o * undeclared_identifier_xyz;\n"
                 "}\n",
                 KVA_VARIANT_OUTPUT_TRANSFORM, 1);
    kva_status st = kva__cuda_variant_check_compile(&v, "sm_90a", NULL);
    CHECK(st == KVA_ERR_JIT && strstr(kva_last_error_message(), "undeclared_identifier_xyz") &&
              strstr(kva_last_error_message(), "broken.hooks.cu"),
          "a bad source gives KVA_ERR_JIT with the log: %s: %s", kva_status_string(st), kva_last_error_message());
    free(v.cuda_src);
    free(v.cuda_src_pf);
    /* a declared hook that the source does not define */
    make_variant(&v, "missing", sink ? sink : "", KVA_VARIANT_OUTPUT_TRANSFORM | KVA_VARIANT_LOGITS_MASK, 1);
    st = kva__cuda_variant_check_compile(&v, "sm_80", NULL);
    CHECK(st == KVA_ERR_JIT && strstr(kva_last_error_message(), "kva_logits_mask"),
          "a declared but undefined hook gives KVA_ERR_JIT: %s: %s", kva_status_string(st), kva_last_error_message());
    free(v.cuda_src);
    free(v.cuda_src_pf);
    free(sig);
    free(sink);
    printf("%d passed, %d failed\n", npass, nfail);
    return nfail ? 1 : 0;
}
