/*
 * prefill_jit_test.c - no-GPU checks of the tensor-core attention family (CTest "cuda_prefill_nvrtc"):
 *   - NVRTC (loaded like the backend loads it) compiles kva_prefill.cuh instances for sm_80 and sm_90a with
 *     ptxas -v and none may spill or keep a stack frame: a covering set by default (every head dim x tile x RoPE
 *     in bf16, every dtype triple at the register-tightest shapes, every KV dtype at the other corners, the AOT
 *     set), the whole family (408 keys) with KVATTN_JIT_TEST_FULL=1;
 *   - the host functions of cuda_prefill.c: supported / select / tile heuristic / names / enumeration / shared
 *     memory against the device limits of sm_80, sm_86 and sm_90.
 * The kernel sources are read from KVA_KERNEL_DIR (the source tree), so the test does not depend on how the
 * library embeds them. usage: kva_cuda_prefill_jit_test [-v] [--arch sm_XX] [--only SUBSTR]
 * Prints "N passed, N failed" last; exits non-zero on any failure.
 */
#define _POSIX_C_SOURCE 200809L
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "cuda_prefill.h"
#include "ptxas_log.h"

#ifndef KVA_KERNEL_DIR
#error "KVA_KERNEL_DIR (the src/kernels directory) must be defined"
#endif

static int npass, nfail, verbose;
static pthread_mutex_t mu = PTHREAD_MUTEX_INITIALIZER;

#define CHECK(cond, ...)                                  \
    do {                                                  \
        pthread_mutex_lock(&mu);                          \
        if (cond) {                                       \
            npass++;                                      \
        } else {                                          \
            nfail++;                                      \
            printf("FAIL %s:%d: ", __FILE__, __LINE__);   \
            printf(__VA_ARGS__);                          \
            printf("\n");                                 \
        }                                                 \
        pthread_mutex_unlock(&mu);                        \
    } while (0)

/* ---------------------------------------------------------------------------------------------- */
/* kernel sources                                                                                  */

static const char* src_names[] = {"kva_kparams.h", "kva_common.cuh", "kva_prefill_geom.h", "kva_wgmma.cuh",
                                   "kva_prefill.cuh"};
#define NSRC ((int)(sizeof src_names / sizeof src_names[0]))
static char* src_texts[NSRC];

static char* read_file(const char* path) {
    FILE* f = fopen(path, "rb");
    if (!f) return NULL;
    fseek(f, 0, SEEK_END);
    long n = ftell(f);
    fseek(f, 0, SEEK_SET);
    char* b = n >= 0 ? (char*)malloc((size_t)n + 1) : NULL;
    if (b && fread(b, 1, (size_t)n, f) != (size_t)n) {
        free(b);
        b = NULL;
    }
    if (b) b[n] = '\0';
    fclose(f);
    return b;
}

/* ---------------------------------------------------------------------------------------------- */
/* NVRTC                                                                                           */

typedef struct job {
    kva__kkey key;
    const char* arch;
} job;

static job* jobs;
static int njobs, next_job;

static void compile_one(const kva__nvrtc_api* nv, const job* j) {
    char name[128], defs[8][128], archopt[64];
    kva__cuda_prefill_name(&j->key, name, sizeof name);
    int nd = kva__cuda_prefill_defines(&j->key, defs, 8);
    snprintf(archopt, sizeof archopt, "--gpu-architecture=%s", j->arch);
    const char* opts[16];
    int no = 0;
    opts[no++] = archopt;
    opts[no++] = "--std=c++17";
    opts[no++] = "-DKVA_NVRTC=1";
    opts[no++] = "--ptxas-options=-v";
    for (int i = 0; i < nd; ++i) opts[no++] = defs[i];
    nvrtcProgram prog;
    nvrtcResult r = nv->CreateProgram(&prog, kva__cuda_prefill_source(), name, NSRC, (const char* const*)src_texts,
                                      src_names);
    CHECK(r == NVRTC_SUCCESS, "%s: nvrtcCreateProgram: %s", name, nv->GetErrorString(r));
    if (r != NVRTC_SUCCESS) return;
    r = nv->CompileProgram(prog, no, opts);
    size_t ls = 0;
    nv->GetProgramLogSize(prog, &ls);
    char* log = (char*)calloc(ls + 1, 1);
    if (log) nv->GetProgramLog(prog, log);
    CHECK(r == NVRTC_SUCCESS, "NVRTC %s %s failed (%s):\n%s", name, j->arch, nv->GetErrorString(r), log ? log : "");
    if (r == NVRTC_SUCCESS) {
        size_t cs = 0;
        nv->GetCUBINSize(prog, &cs);
        CHECK(cs > 0, "%s %s: no cubin", name, j->arch);
        const int spill = log ? kva__ptxas_max_count(log, "bytes spill stores") + kva__ptxas_max_count(log, "bytes spill loads") : 0;
        const int stack = log ? kva__ptxas_max_count(log, "bytes stack frame") : 0;
        CHECK(spill == 0 && stack == 0, "%s %s: ptxas reports %d bytes of spills and a %d-byte stack frame:\n%s", name,
              j->arch, spill, stack, log ? log : "");
        if (verbose) {
            const char* reg = log ? strstr(log, "Used ") : NULL;
            pthread_mutex_lock(&mu);
            printf("  %-46s %-7s %3d registers, %6zu smem, %7zu bytes cubin\n", name, j->arch, reg ? atoi(reg + 5) : -1,
                   kva__cuda_prefill_smem(&j->key), cs);
            pthread_mutex_unlock(&mu);
        }
    }
    free(log);
    nv->DestroyProgram(&prog);
}

static const kva__nvrtc_api* g_nv;

static void* worker(void* arg) {
    (void)arg;
    for (;;) {
        int i = __atomic_fetch_add(&next_job, 1, __ATOMIC_RELAXED);
        if (i >= njobs) break;
        compile_one(g_nv, &jobs[i]);
    }
    return NULL;
}

static int in_covering_set(const kva__kkey* k) {
    if (k->mainloop) return 1; /* every Hopper-mainloop key (24, sm_90a only) */
    const int bf = k->qt == KVA_DTYPE_BF16 && k->kt == KVA_DTYPE_BF16 && k->ot == KVA_DTYPE_BF16;
    if (bf) return 1; /* every (dim, tile, rope) */
    /* the register-tightest shapes: every dtype triple */
    if (k->dqk == 128 && k->rows == 128) return 1;
    if (k->dqk == 256 && k->rows == 64 && k->rope == 1) return 1;
    /* every KV dtype at the other corners */
    if (k->qt == KVA_DTYPE_F16 && k->ot == KVA_DTYPE_F32 && k->rope == 1 && (k->rows == 16 || k->dqk == 64)) return 1;
    return 0;
}

static int is_aot(const kva__kkey* k) {
    kva__kkey a[64];
    int n = kva__cuda_prefill_aot_keys(a, 64);
    for (int i = 0; i < n; ++i)
        if (memcmp(&a[i], k, sizeof *k) == 0) return 1;
    return 0;
}

static void test_nvrtc(const char* only_arch, const char* only) {
    g_nv = kva__nvrtc_load();
    CHECK(g_nv != NULL, "NVRTC not loadable: %s", kva_last_error_message());
    if (!g_nv) return;
    printf("NVRTC %d.%d (%s)\n", g_nv->major, g_nv->minor, g_nv->path);
    for (int i = 0; i < NSRC; ++i) {
        char path[1024];
        snprintf(path, sizeof path, "%s/%s", KVA_KERNEL_DIR, src_names[i]);
        src_texts[i] = read_file(path);
        CHECK(src_texts[i] != NULL, "cannot read %s", path);
        if (!src_texts[i]) return;
    }
    const char* full_env = getenv("KVATTN_JIT_TEST_FULL");
    const int full = full_env && *full_env && strcmp(full_env, "0") != 0;
    int n = kva__cuda_prefill_enumerate(NULL, 0);
    kva__kkey* keys = (kva__kkey*)calloc((size_t)n, sizeof *keys);
    kva__cuda_prefill_enumerate(keys, n);
    static const char* archs[] = {"sm_80", "sm_90a"};
    jobs = (job*)calloc((size_t)n * 2, sizeof *jobs);
    njobs = 0;
    for (int i = 0; i < n; ++i) {
        if (!full && !in_covering_set(&keys[i]) && !is_aot(&keys[i])) continue;
        char name[128];
        kva__cuda_prefill_name(&keys[i], name, sizeof name);
        if (only && !strstr(name, only)) continue;
        for (int a = 0; a < 2; ++a) {
            if (only_arch && strcmp(only_arch, archs[a]) != 0) continue;
            if (keys[i].mainloop && a == 0) continue; /* sm_90a code only */
            jobs[njobs].key = keys[i];
            jobs[njobs].arch = archs[a];
            njobs++;
        }
    }
    long ncpu = sysconf(_SC_NPROCESSORS_ONLN);
    int nthreads = ncpu < 1 ? 1 : (ncpu > 16 ? 16 : (int)ncpu);
    const char* tenv = getenv("KVATTN_JIT_TEST_THREADS");
    if (tenv && atoi(tenv) > 0) nthreads = atoi(tenv) > 16 ? 16 : atoi(tenv);
    printf("compiling %d tensor-core kernel variants (%s of %d keys) with NVRTC on %d threads\n", njobs,
           full ? "all" : "covering set", n, nthreads);
    fflush(stdout);
    pthread_t th[16];
    for (int t = 0; t < nthreads; ++t) pthread_create(&th[t], NULL, worker, NULL);
    for (int t = 0; t < nthreads; ++t) pthread_join(th[t], NULL);
    free(jobs);
    free(keys);
    for (int i = 0; i < NSRC; ++i) free(src_texts[i]);
}

/* ---------------------------------------------------------------------------------------------- */
/* host functions                                                                                  */

static void test_host(void) {
    kva_attention_desc d;
    kva__kkey k;
    size_t smem = 0;
    char why[256];
    const int lim80 = 163 * 1024, lim86 = 99 * 1024, lim90 = 227 * 1024;

    /* P1 shape: GQA 32/8, D 128, bf16 */
    kva_attention_desc_init(&d, 32, 8, 128, KVA_DTYPE_BF16);
    CHECK(kva__cuda_prefill_tile_q(&d, KVA_OP_BATCH_PREFILL_RAGGED, 4.0 * 4096, 4 * 4096, lim90) == 128, "P1 tile 128");
    CHECK(kva__cuda_prefill_tile_q(&d, KVA_OP_BATCH_PREFILL_PAGED, 40.0, 64, lim90) == 64, "tile 64");
    CHECK(kva__cuda_prefill_tile_q(&d, KVA_OP_BATCH_DECODE, 4.0, 4, lim90) == 16, "decode tile 16");
    CHECK(kva__cuda_prefill_tile_q(&d, KVA_OP_BATCH_PREFILL_RAGGED, 1000.0, 4000, lim86) == 64,
          "99 KB devices (sm_86/89) fall back to 64-row tiles at D 128");
    CHECK(kva__cuda_prefill_select(&d, KVA_OP_BATCH_PREFILL_RAGGED, 128, lim90, &k, &smem) == KVA_OK &&
              k.family == KVA__KF_PREFILL && k.rows == 128 && k.dqk == 128 && k.rope == 0 && smem > 48 * 1024 &&
              smem <= 110 * 1024,
          "select P1: rows %d smem %zu", k.rows, smem);
    CHECK(2 * (smem + 1024) <= 228 * 1024, "two CTAs per SM on sm_90 at D128/TQ128 (%zu bytes)", smem);
    char name[128];
    kva__cuda_prefill_name(&k, name, sizeof name);
    CHECK(strcmp(name, "kva_pf_d128_qbf16_kvbf16_obf16_t128_rope0") == 0, "name %s", name);
    char defs[8][128];
    CHECK(kva__cuda_prefill_defines(&k, defs, 8) == 8 && strcmp(defs[6], "-DKVA_TQ=128") == 0 &&
              strstr(defs[0], name) != NULL,
          "defines");
    CHECK(kva__cuda_prefill_defines(&k, defs, 7) == 0, "defines need room for 8");
    {
        kva__kkey kn = k;
        kn.nochk = 1;
        char nn[128], dn[9][128];
        kva__cuda_prefill_name(&kn, nn, sizeof nn);
        CHECK(strcmp(nn, "kva_pf_d128_qbf16_kvbf16_obf16_t128_rope0_nochk") == 0 &&
                  kva__cuda_prefill_defines(&kn, dn, 9) == 9 && strcmp(dn[8], "-DKVA_NO_BOUNDS_CHECK=1") == 0 &&
                  strstr(dn[0], nn) != NULL,
              "benchmark key without bounds checks: %s", nn);
    }
    /* the Hopper mainloop: taken on sm_90 for 128-row tiles of 16-bit q = KV without RoPE or variant */
    {
        kva__kkey kw = k;
        size_t sw = 0;
        CHECK(kva__cuda_prefill_wg_ok(&kw, 90, lim90) && !kva__cuda_prefill_wg_ok(&kw, 80, lim80) &&
                  !kva__cuda_prefill_wg_ok(&kw, 89, lim86) && !kva__cuda_prefill_wg_ok(&kw, 90, 100 * 1024),
              "Hopper mainloop on sm_90 only, and only where its shared memory fits");
        kva__cuda_prefill_upgrade(&kw, &sw, 90, lim90, 0);
        char wn[128], wd[10][128];
        kva__cuda_prefill_name(&kw, wn, sizeof wn);
        CHECK(kw.mainloop == 1 && sw == kva__cuda_prefill_smem(&kw) && sw > 110 * 1024 && sw <= (size_t)lim90 &&
                  kva__cuda_prefill_threads(&kw) == 384 && kva__cuda_prefill_threads(&k) == 128 &&
                  strcmp(wn, "kva_pfw_d128_qbf16_kvbf16_obf16_t128_rope0") == 0 &&
                  kva__cuda_prefill_defines(&kw, wd, 10) == 9 && strcmp(wd[8], "-DKVA_MAINLOOP=1") == 0,
              "upgrade: mainloop %d smem %zu name %s", kw.mainloop, sw, wn);
        kva__kkey ka = k;
        size_t sa = 0;
        kva__cuda_prefill_upgrade(&ka, &sa, 90, lim90, 1); /* ALiBi without soft cap: the folding instance */
        kva__cuda_prefill_name(&ka, wn, sizeof wn);
        CHECK(ka.mainloop == 1 && ka.alibi_fold == 1 && sa == sw && !kva__kkey_eq(&ka, &kw) &&
                  strcmp(wn, "kva_pfw_d128_qbf16_kvbf16_obf16_t128_rope0_afold") == 0 &&
                  kva__cuda_prefill_defines(&ka, wd, 10) == 10 && strcmp(wd[9], "-DKVA_ALIBI_FOLD=1") == 0,
              "ALiBi-folding upgrade: name %s", wn);
        ka = k;
        kva__cuda_prefill_upgrade(&ka, &sa, 80, lim80, 1);
        CHECK(ka.mainloop == 0 && ka.alibi_fold == 0, "no ALiBi-folding instance off sm_90");
        kva__kkey k64 = kw, kr = k, kd = k, kq = k;
        k64.rows = 64;
        k64.mainloop = 0;
        kr.rope = 1;
        kd.dqk = kd.dvo = 256;
        kq.kt = KVA_DTYPE_E4M3;
        CHECK(!kva__cuda_prefill_wg_ok(&k64, 90, lim90) && !kva__cuda_prefill_wg_ok(&kr, 90, lim90) &&
                  !kva__cuda_prefill_wg_ok(&kd, 90, lim90) && !kva__cuda_prefill_wg_ok(&kq, 90, lim90),
              "no Hopper mainloop for 64-row tiles, RoPE, head dim 256 or fp8 KV");
    }
    /* tile_q -> kernel tile */
    for (int t = 1; t <= 128; ++t) {
        CHECK(kva__cuda_prefill_select(&d, KVA_OP_BATCH_PREFILL_PAGED, t, 0, &k, NULL) == KVA_OK &&
                  k.rows == (t <= 16 ? 16 : (t <= 64 ? 64 : 128)),
              "tile_q %d -> kernel tile %d", t, k.rows);
    }
    CHECK(!kva__cuda_prefill_supported(&d, KVA_OP_BATCH_PREFILL_PAGED, 129, 0, why, sizeof why) && strstr(why, "tile_q"),
          "tile 129 refused: %s", why);
    CHECK(!kva__cuda_prefill_supported(&d, KVA_OP_BATCH_PREFILL_PAGED, 0, 0, why, sizeof why), "tile 0 refused");
    /* head dim 256: at most 64 rows */
    kva_attention_desc_init(&d, 16, 16, 256, KVA_DTYPE_BF16);
    CHECK(kva__cuda_prefill_tile_q(&d, KVA_OP_BATCH_PREFILL_RAGGED, 4096.0, 4096, lim90) == 64, "D256 tile 64");
    CHECK(!kva__cuda_prefill_supported(&d, KVA_OP_BATCH_PREFILL_RAGGED, 65, 0, why, sizeof why), "D256 tile 65 refused");
    CHECK(kva__cuda_prefill_tile_q(&d, KVA_OP_BATCH_PREFILL_RAGGED, 4096.0, 4096, lim86) == 0,
          "D256 does not fit 99 KB devices (the caller falls back)");
    CHECK(kva__cuda_prefill_tile_q(&d, KVA_OP_BATCH_PREFILL_RAGGED, 4096.0, 4096, lim80) == 64, "D256 on sm_80");
    /* refusals name what is unsupported */
    kva_attention_desc_init(&d, 8, 8, 96, KVA_DTYPE_F16);
    CHECK(!kva__cuda_prefill_supported(&d, KVA_OP_BATCH_PREFILL_PAGED, 16, 0, why, sizeof why) && strstr(why, "head dim"),
          "head dim 96: %s", why);
    CHECK(kva__cuda_prefill_select(&d, KVA_OP_BATCH_PREFILL_PAGED, 16, 0, &k, NULL) == KVA_ERR_UNSUPPORTED &&
              strstr(kva_last_error_message(), "head dim"),
          "select message: %s", kva_last_error_message());
    kva_attention_desc_init(&d, 8, 8, 128, KVA_DTYPE_F32);
    CHECK(!kva__cuda_prefill_supported(&d, KVA_OP_BATCH_PREFILL_PAGED, 16, 0, why, sizeof why) && strstr(why, "q_dtype"),
          "f32 q: %s", why);
    kva_attention_desc_init(&d, 8, 8, 128, KVA_DTYPE_F16);
    d.kv_dtype = KVA_DTYPE_F32;
    CHECK(!kva__cuda_prefill_supported(&d, KVA_OP_BATCH_PREFILL_PAGED, 16, 0, why, sizeof why) && strstr(why, "kv_dtype"),
          "f32 kv: %s", why);
    kva_attention_desc_init(&d, 8, 8, 128, KVA_DTYPE_F16);
    d.head_dim_vo = 64;
    CHECK(!kva__cuda_prefill_supported(&d, KVA_OP_BATCH_PREFILL_PAGED, 16, 0, why, sizeof why), "dqk != dvo");
    kva_attention_desc_init(&d, 12, 8, 128, KVA_DTYPE_F16);
    CHECK(!kva__cuda_prefill_supported(&d, KVA_OP_BATCH_PREFILL_PAGED, 16, 0, why, sizeof why), "12 / 8 heads");
    /* group sizes 3, 5, 7 (any g; the planner packs) and decode preference */
    for (int g = 1; g <= 16; ++g) {
        kva_attention_desc_init(&d, 2 * g, 2, 64, KVA_DTYPE_BF16);
        CHECK(kva__cuda_prefill_supported(&d, KVA_OP_BATCH_DECODE, g, lim90, why, sizeof why), "decode g %d: %s", g, why);
        CHECK(kva__cuda_prefill_prefer_for_decode(&d) == (g > 8), "decode preference g %d", g);
    }
    /* the enumeration holds every key select can produce, and every key fits sm_80 except D256 x TQ16 */
    int n = kva__cuda_prefill_enumerate(NULL, 0);
    CHECK(n == 408, "408 keys, got %d", n);
    kva__kkey* keys = (kva__kkey*)calloc((size_t)n, sizeof *keys);
    kva__cuda_prefill_enumerate(keys, n);
    int missing = 0, too_big = 0;
    static const kva_dtype qts[] = {KVA_DTYPE_F16, KVA_DTYPE_BF16};
    static const kva_dtype kts[] = {KVA_DTYPE_F16, KVA_DTYPE_BF16, KVA_DTYPE_E4M3, KVA_DTYPE_E5M2};
    static const kva_dtype ots[] = {KVA_DTYPE_F16, KVA_DTYPE_BF16, KVA_DTYPE_F32};
    static const int dims[] = {64, 128, 256};
    for (int a = 0; a < 2; ++a)
        for (int b = 0; b < 4; ++b)
            for (int c = 0; c < 3; ++c)
                for (int dd = 0; dd < 3; ++dd)
                    for (int rope = 0; rope < 2; ++rope)
                        for (int t = 1; t <= 128; t += 9) {
                            kva_attention_desc_init(&d, 8, 2, dims[dd], qts[a]);
                            d.kv_dtype = kts[b];
                            d.o_dtype = ots[c];
                            d.pos_encoding = rope ? KVA_POS_ROPE_LLAMA : KVA_POS_NONE;
                            if (!kva__cuda_prefill_supported(&d, KVA_OP_BATCH_PREFILL_PAGED, t, 0, NULL, 0)) continue;
                            if (kva__cuda_prefill_select(&d, KVA_OP_BATCH_PREFILL_PAGED, t, 0, &k, NULL) != KVA_OK) {
                                missing++;
                                continue;
                            }
                            int found = 0;
                            for (int i = 0; i < n && !found; ++i) found = memcmp(&keys[i], &k, sizeof k) == 0;
                            if (!found) missing++;
                        }
    for (int i = 0; i < n; ++i) {
        size_t s = kva__cuda_prefill_smem(&keys[i]);
        if (s > (size_t)lim90) too_big++;
        if (!keys[i].mainloop && !(keys[i].dqk == 256 && keys[i].rows == 16)) {
            if (s > (size_t)lim80) too_big++;
            if (2 * (s + 1024) > 228 * 1024) too_big++; /* two CTAs per SM on sm_90 */
        }
    }
    CHECK(missing == 0, "%d selections outside the enumeration", missing);
    CHECK(too_big == 0, "%d keys exceed their shared-memory budget", too_big);
    kva__kkey aot[64];
    int na = kva__cuda_prefill_aot_keys(aot, 64);
    int aot_missing = 0;
    for (int i = 0; i < na; ++i) {
        int found = 0;
        for (int j = 0; j < n && !found; ++j) found = memcmp(&keys[j], &aot[i], sizeof aot[i]) == 0;
        if (!found) aot_missing++;
    }
    CHECK(na == 18 && aot_missing == 0, "AOT set: %d keys, %d outside the enumeration", na, aot_missing);
    free(keys);
}

int main(int argc, char** argv) {
    const char* only_arch = NULL;
    const char* only = NULL;
    for (int i = 1; i < argc; ++i) {
        if (strcmp(argv[i], "-v") == 0 || strcmp(argv[i], "--verbose") == 0) verbose = 1;
        else if (strcmp(argv[i], "--arch") == 0 && i + 1 < argc) only_arch = argv[++i];
        else if (strcmp(argv[i], "--only") == 0 && i + 1 < argc) only = argv[++i];
    }
    test_host();
    test_nvrtc(only_arch, only);
    printf("%d passed, %d failed\n", npass, nfail);
    return nfail ? 1 : 0;
}
