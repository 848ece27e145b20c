/*
 * jit_test.c - host-side tests of the CUDA backend that need no GPU (CTest "cuda_nvrtc_variants"):
 *   - NVRTC compiles kernel variants for sm_80 and sm_90a, spill-free (ptxas report in the NVRTC log):
 *     a covering set by default (every value of every key axis, every row count x RoPE x head dim, every dtype
 *     triple), the full cross product with KVATTN_JIT_TEST_FULL=1, either narrowed by KVATTN_JIT_TEST_MATCH="a|b"
 *     (kernel names containing a substring);
 *   - the selection function (supported / unsupported, tile sizes, shared memory) and the head-group plan's heads per unit;
 *   - the on-disk cache (cold miss, hit, corrupt entry, unsafe directory refused, 0700 directory, stale temporary
 *     files swept);
 *   - the kernels' fast division by the page size.
 * Prints "N passed, N failed" last.
 */
#define _POSIX_C_SOURCE 200809L
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <fcntl.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include "cuda_internal.h"
#include "cuda_prefill.h"

static int npass, nfail;
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

typedef struct job {
    kva__kkey key;
    const char* arch;
} job;

static job* jobs;
static int njobs;
static int next_job;
static int verbose;

static void* worker(void* arg) {
    (void)arg;
    for (;;) {
        int i = __atomic_fetch_add(&next_job, 1, __ATOMIC_RELAXED);
        if (i >= njobs) break;
        const job* j = &jobs[i];
        char name[128];
        kva__kkey_name(&j->key, name, sizeof name);
        void* cubin = NULL;
        size_t size = 0;
        char* log = NULL;
        kva_status st = kva__jit_compile(&j->key, j->arch, "--ptxas-options=-v", &cubin, &size, &log);
        CHECK(st == KVA_OK, "NVRTC %s %s: %s", name, j->arch, kva_last_error_message());
        if (st == KVA_OK) {
            CHECK(size > 0, "%s %s: empty cubin", name, j->arch);
            int spills = 0;
            if (log) {
                const char* p = log;
                while ((p = strstr(p, "bytes spill")) != NULL) {
                    /* "N bytes spill stores": N > 0 is a spill */
                    const char* q = p;
                    while (q > log && q[-1] == ' ') --q;
                    while (q > log && q[-1] >= '0' && q[-1] <= '9') --q;
                    if (atoi(q) > 0) spills = 1;
                    p += 11;
                }
                const char* sf = strstr(log, "bytes stack frame");
                if (sf) {
                    const char* q = sf;
                    while (q > log && q[-1] == ' ') --q;
                    while (q > log && q[-1] >= '0' && q[-1] <= '9') --q;
                    if (atoi(q) > 0) spills = 1;
                }
            }
            CHECK(!spills, "%s %s: ptxas reports spills or a stack frame:\n%s", name, j->arch, log ? log : "");
            if (verbose) {
                const char* reg = log ? strstr(log, "Used ") : NULL;
                int nreg = reg ? atoi(reg + 5) : -1;
                pthread_mutex_lock(&mu);
                printf("  %-48s %-7s %7zu bytes cubin, %d registers\n", name, j->arch, size, nreg);
                pthread_mutex_unlock(&mu);
            }
        }
        free(cubin);
        free(log);
    }
    return NULL;
}

static int same(const kva__kkey* a, const kva__kkey* b) { return memcmp(a, b, sizeof *a) == 0; }

/* covering set: a key is kept when it is D128/bf16/bf16/bf16 except along at most... (see file comment) */
static int in_covering_set(const kva__kkey* k) {
    if (k->family == KVA__KF_DECODE_HG && k->hg_rs) /* row slots: bf16 q = o at every (dim, KV dtype, slots) */
        return k->qt == KVA_DTYPE_BF16 && k->ot == KVA_DTYPE_BF16;
    if (k->family == KVA__KF_DECODE_HG) /* bf16 at every (dim, output, heads); f16 at 128 / f16 / 4 heads */
        return k->qt == KVA_DTYPE_BF16 || (k->dqk == 128 && k->ot == KVA_DTYPE_F16 && k->rows == 4);
    if (k->family == KVA__KF_DECODE_TC && k->warps == 8) /* bf16 at every rows; f16 with f32 output at 8 rows */
        return (k->qt == KVA_DTYPE_BF16 && k->ot == KVA_DTYPE_BF16) || (k->ot == KVA_DTYPE_F32 && k->rows == 8);
    if (k->family == KVA__KF_DECODE_TC) {
        /* bf16 at every (dim, rows); every dtype triple at (128, 8) and (256, 8); fp8 KV at (64, 8) */
        if (k->qt == KVA_DTYPE_BF16 && k->kt == KVA_DTYPE_BF16 && k->ot == KVA_DTYPE_BF16) return 1;
        const int fp8 = kva__is_fp8(k->kt);
        return (k->dqk == 128 || k->dqk == 256 || (k->dqk == 64 && fp8)) && k->rows == 8;
    }
    if (k->family != KVA__KF_DECODE) return 1;
    const int base_types = k->qt == KVA_DTYPE_BF16 && k->kt == KVA_DTYPE_BF16 && k->ot == KVA_DTYPE_BF16;
    if (base_types) return 1;                                      /* every (dim, rows, rope) */
    if (k->dqk == 128 && k->rows == 8 && k->rope == 0) return 1;    /* every dtype triple */
    if (k->dqk == 64 && k->rows == 1 && k->rope == 1 && k->qt == KVA_DTYPE_F16 && k->ot == KVA_DTYPE_F32)
        return 1;                                                  /* every KV dtype with RoPE, small */
    if (k->dqk == 256 && k->rows == 4 && k->rope == 1 && k->qt == KVA_DTYPE_F16 && k->ot == KVA_DTYPE_F16)
        return 1;                                                  /* every KV dtype with RoPE, large */
    return 0;
}

static void test_nvrtc_variants(void) {
    const kva__nvrtc_api* nv = kva__nvrtc_load();
    CHECK(nv != NULL, "NVRTC not loadable: %s", kva_last_error_message());
    if (!nv) return;
    printf("NVRTC %d.%d (%s)\n", nv->major, nv->minor, nv->path);
    const char* full_env = getenv("KVATTN_JIT_TEST_FULL");
    const int full = full_env && *full_env && strcmp(full_env, "0") != 0;
    int n = kva__kkey_enumerate(NULL, 0);
    kva__kkey* keys = (kva__kkey*)calloc((size_t)n, sizeof *keys);
    kva__kkey_enumerate(keys, n);
    /* the enumeration must hold every key the selection function can produce */
    static const kva_dtype qts[] = {KVA_DTYPE_F16, KVA_DTYPE_BF16};
    static const kva_dtype kts[] = {KVA_DTYPE_F16, KVA_DTYPE_BF16, KVA_DTYPE_E4M3, KVA_DTYPE_E5M2};
    static const kva_dtype ots[] = {KVA_DTYPE_F16, KVA_DTYPE_BF16, KVA_DTYPE_F32};
    static const int dims[] = {64, 128, 256};
    int missing = 0;
    for (int a = 0; a < 2; ++a)
        for (int b = 0; b < 4; ++b)
            for (int c = 0; c < 3; ++c)
                for (int dd = 0; dd < 3; ++dd)
                    for (int g = 1; g <= 16; ++g)
                        for (int rope = 0; rope < 2; ++rope)
                            for (int op = 0; op < 3; ++op)
                                for (int mp = 1; mp <= 12; mp += 5) {
                                    kva_attention_desc d;
                                    kva_attention_desc_init(&d, 2 * g, 2, dims[dd], qts[a]);
                                    d.kv_dtype = kts[b];
                                    d.o_dtype = ots[c];
                                    d.pos_encoding = rope ? KVA_POS_ROPE_LLAMA : KVA_POS_NONE;
                                    kva__kchoice ch;
                                    if (kva__cuda_select(&d, (kva_op)op, 0, mp * g, &ch) != KVA_OK) {
                                        missing++;
                                        continue;
                                    }
                                    if (ch.key.family == KVA__KF_PREFILL) continue; /* prefill_jit_test.c */
                                    int found = 0;
                                    for (int i = 0; i < n && !found; ++i) found = same(&keys[i], &ch.key);
                                    if (!found) missing++;
                                }
    CHECK(missing == 0, "%d selections name a key outside kva__kkey_enumerate", missing);
    /* and every head-group key (kva__cuda_hg_key) */
    int hg_keys = 0;
    missing = 0;
    for (int a = 0; a < 2; ++a)
        for (int b = 0; b < 4; ++b)
            for (int c = 0; c < 3; ++c)
                for (int dd = 0; dd < 3; ++dd)
                    for (int g = 1; g <= 9; ++g)
                        for (int hg = 1; hg <= 8; ++hg)
                            for (int ps = 1; ps <= 48; ps += ps < 8 ? 7 : 8) {
                                kva_attention_desc d;
                                kva_attention_desc_init(&d, 8 * g, 8, dims[dd], qts[a]);
                                d.kv_dtype = kts[b];
                                d.o_dtype = ots[c];
                                kva__kkey k;
                                if (!kva__cuda_hg_key(&d, ps, hg, &k)) continue;
                                hg_keys++;
                                int found = 0;
                                for (int i = 0; i < n && !found; ++i) found = same(&keys[i], &k);
                                if (!found) missing++;
                            }
    CHECK(hg_keys > 0 && missing == 0, "%d of %d head-group keys outside kva__kkey_enumerate", missing, hg_keys);
    /* and every row-slot key (kva__cuda_hg_rs_key) */
    hg_keys = 0;
    missing = 0;
    for (int a = 0; a < 2; ++a)
        for (int b = 0; b < 4; ++b)
            for (int c = 0; c < 3; ++c)
                for (int dd = 0; dd < 3; ++dd)
                    for (int g = 1; g <= 40; ++g)
                        for (int ps = 1; ps <= 48; ps += ps < 8 ? 7 : 8) {
                            kva_attention_desc d;
                            kva_attention_desc_init(&d, 3 * g, 3, dims[dd], qts[a]);
                            d.kv_dtype = kts[b];
                            d.o_dtype = ots[c];
                            kva__kkey k;
                            if (!kva__cuda_hg_rs_key(&d, ps, &k)) continue;
                            hg_keys++;
                            int found = 0;
                            for (int i = 0; i < n && !found; ++i) found = same(&keys[i], &k);
                            if (!found) missing++;
                        }
    CHECK(hg_keys > 0 && missing == 0, "%d of %d row-slot keys outside kva__kkey_enumerate", missing, hg_keys);

    static const char* archs[] = {"sm_80", "sm_90a"};
    /* KVATTN_JIT_TEST_MATCH="a|b": only kernels whose name contains one of the substrings (with FULL: all of them) */
    const char* match = getenv("KVATTN_JIT_TEST_MATCH");
    jobs = (job*)calloc((size_t)n * 2, sizeof *jobs);
    njobs = 0;
    for (int i = 0; i < n; ++i) {
        if (!full && !in_covering_set(&keys[i])) continue;
        if (match && *match) {
            char name[128], pat[256];
            kva__kkey_name(&keys[i], name, sizeof name);
            snprintf(pat, sizeof pat, "%s", match);
            int hit = 0;
            char* save = NULL;
            for (char* t = strtok_r(pat, "|", &save); t && !hit; t = strtok_r(NULL, "|", &save))
                hit = strstr(name, t) != NULL;
            if (!hit) continue;
        }
        for (int a = 0; a < 2; ++a) {
            if (keys[i].warps == 8 && a == 0) continue; /* 8-warp kernels need sm_90's shared memory */
            if (keys[i].family == KVA__KF_DECODE_HG && a == 0) continue; /* TMA: sm_90 only */
            jobs[njobs].key = keys[i];
            jobs[njobs].arch = archs[a];
            njobs++;
        }
    }
    long ncpu = sysconf(_SC_NPROCESSORS_ONLN);
    int nthreads = ncpu < 1 ? 1 : (ncpu > 16 ? 16 : (int)ncpu);
    const char* tenv = getenv("KVATTN_JIT_TEST_THREADS");
    if (tenv && atoi(tenv) > 0) nthreads = atoi(tenv);
    printf("compiling %d kernel variants (%s of %d keys x 2 targets) with NVRTC on %d threads\n", njobs,
           full ? "all" : "covering set", n, nthreads);
    fflush(stdout);
    pthread_t th[16];
    if (nthreads > 16) nthreads = 16;
    for (int t = 0; t < nthreads; ++t) pthread_create(&th[t], NULL, worker, NULL);
    for (int t = 0; t < nthreads; ++t) pthread_join(th[t], NULL);
    free(jobs);
    free(keys);
}

/* ---------------------------------------------------------------------------------------------- */

static void test_select(void) {
    kva_attention_desc d;
    kva__kchoice c;
    {
        /* head-group decode scope (kva__cuda_hg_key) */
        kva__kkey k;
        kva_attention_desc_init(&d, 32, 8, 128, KVA_DTYPE_BF16);
        CHECK(kva__cuda_hg_key(&d, 16, 4, &k) && k.family == KVA__KF_DECODE_HG && k.rows == 4 &&
                  kva__kkey_smem(&k) <= 227 * 1024,
              "hg: GQA 32/8 bf16 page 16, 4 heads per item (smem %zu)", kva__kkey_smem(&k));
        CHECK(kva__cuda_hg_key(&d, 16, 2, &k) && k.rows == 2 && 2 * (kva__kkey_smem(&k) + 1024) <= 228 * 1024,
              "hg: 2 heads per item, two CTAs per SM (smem %zu)", kva__kkey_smem(&k));
        CHECK(kva__cuda_hg_key(&d, 48, 4, &k) && k.mainloop == 0 && kva__cuda_hg_key(&d, 8, 4, &k) &&
                  k.mainloop == 1 && kva__cuda_hg_key(&d, 1, 4, &k) && k.mainloop == 1 &&
                  kva__cuda_hg_key(&d, 24, 2, &k) && k.mainloop == 1 && !kva__cuda_hg_key(&d, 0, 4, NULL),
              "hg: TMA producer for page sizes that are multiples of 16, the cp.async one (\"_ga\") for the others");
        CHECK(!kva__cuda_hg_key(&d, 16, 3, NULL) && !kva__cuda_hg_key(&d, 16, 8, NULL), "hg: 2 or 4 heads per item");
        d.logits_soft_cap = 30.0f;
        CHECK(!kva__cuda_hg_key(&d, 16, 4, NULL), "hg: no soft cap");
        kva_attention_desc_init(&d, 32, 8, 128, KVA_DTYPE_BF16);
        d.pos_encoding = KVA_POS_ALIBI;
        CHECK(!kva__cuda_hg_key(&d, 16, 4, NULL), "hg: no ALiBi");
        kva_attention_desc_init(&d, 32, 8, 128, KVA_DTYPE_BF16);
        d.kv_dtype = KVA_DTYPE_E4M3;
        CHECK(kva__cuda_hg_key(&d, 16, 4, &k) && k.kt == KVA_DTYPE_E4M3 && k.qt == KVA_DTYPE_BF16 &&
                  kva__kkey_smem(&k) <= 227 * 1024,
              "hg: fp8 KV under bf16 q at head dim 128 (smem %zu)", kva__kkey_smem(&k));
        d.kv_dtype = KVA_DTYPE_F16;
        CHECK(!kva__cuda_hg_key(&d, 16, 4, NULL), "hg: 16-bit KV of q's dtype only");
        kva_attention_desc_init(&d, 16, 8, 64, KVA_DTYPE_BF16);
        d.kv_dtype = KVA_DTYPE_E5M2;
        CHECK(!kva__cuda_hg_key(&d, 16, 4, NULL), "hg: fp8 KV at head dim 128 only");
        kva_attention_desc_init(&d, 72, 8, 128, KVA_DTYPE_F16);
        CHECK(!kva__cuda_hg_key(&d, 16, 4, NULL), "hg: GQA groups up to 8");
        kva_attention_desc_init(&d, 12, 6, 256, KVA_DTYPE_F16);
        CHECK(!kva__cuda_hg_key(&d, 16, 2, NULL), "hg: head dims 64 and 128");
        kva_attention_desc_init(&d, 12, 6, 64, KVA_DTYPE_F16);
        CHECK(kva__cuda_hg_key(&d, 16, 2, NULL) && !kva__cuda_hg_key(&d, 16, 4, NULL), "hg: the heads divide by G");
        /* row slots (kva__cuda_hg_rs_key): groups of 9 to 32 over one KV head, key rows 2 up to 16 rows (one slot of 16),
           else 4 (two) */
        for (int g = 1; g <= 40; ++g) {
            kva_attention_desc_init(&d, 3 * g, 3, 128, KVA_DTYPE_BF16);
            const int ok = kva__cuda_hg_rs_key(&d, 16, &k);
            CHECK(ok == (g >= 9 && g <= 32), "hg rs: g = %d in scope %d", g, ok);
            if (ok)
                CHECK(k.family == KVA__KF_DECODE_HG && k.hg_rs == 1 && k.rows == (g <= 16 ? 2 : 4) &&
                          k.mainloop == 0 && kva__kkey_smem(&k) <= 227 * 1024,
                      "hg rs: g = %d: slots %d, smem %zu", g, (int)k.rows, kva__kkey_smem(&k));
        }
        kva_attention_desc_init(&d, 32, 1, 64, KVA_DTYPE_F16);
        CHECK(kva__cuda_hg_rs_key(&d, 1, &k) && k.mainloop == 1 && k.rows == 4 && kva__kkey_smem(&k) <= 227 * 1024,
              "hg rs: MQA 32/1 at head dim 64, page 1 (\"_ga\"; smem %zu)", kva__kkey_smem(&k));
        kva_attention_desc_init(&d, 16, 1, 128, KVA_DTYPE_BF16);
        d.kv_dtype = KVA_DTYPE_E4M3;
        CHECK(kva__cuda_hg_rs_key(&d, 16, &k) && k.rows == 2 && kva__kkey_smem(&k) <= 227 * 1024,
              "hg rs: fp8 KV at head dim 128 (smem %zu)", kva__kkey_smem(&k));
        d.logits_soft_cap = 30.0f;
        CHECK(!kva__cuda_hg_rs_key(&d, 16, NULL), "hg rs: no soft cap");
        kva_attention_desc_init(&d, 32, 2, 256, KVA_DTYPE_BF16);
        CHECK(!kva__cuda_hg_rs_key(&d, 16, NULL), "hg rs: head dims 64 and 128");
    }
    kva_attention_desc_init(&d, 32, 8, 128, KVA_DTYPE_BF16);
    CHECK(kva__cuda_select(&d, KVA_OP_BATCH_DECODE, 0, 4, &c) == KVA_OK, "GQA 32/8 bf16 decode");
    CHECK(c.tile_q == 4 && c.key.rows == 4, "g=4: tile %d rows %d", c.tile_q, c.key.rows);
    CHECK(c.smem <= 113 * 1024, "smem %zu fits two CTAs per SM", c.smem);
    for (int g = 1; g <= 64; ++g) {
        kva_attention_desc_init(&d, g, 1, 64, KVA_DTYPE_F16);
        kva_status st = kva__cuda_select(&d, KVA_OP_BATCH_DECODE, 0, g, &c);
        int ntiles = (g + c.tile_q - 1) / c.tile_q;
        if (g > 8) /* large groups: the tensor-core attention family, one tile per (request, KV head) */
            CHECK(st == KVA_OK && c.key.family == KVA__KF_PREFILL && c.tile_q >= g && c.key.rows >= c.tile_q,
                  "group %d: tensor-core tile_q %d rows %d", g, c.tile_q, c.key.rows);
        else
            CHECK(st == KVA_OK && c.key.family != KVA__KF_PREFILL && c.tile_q >= 1 && c.tile_q <= 8 &&
                      c.key.rows >= c.tile_q && ntiles == (g + 7) / 8,
                  "group %d: tile_q %d rows %d", g, c.tile_q, c.key.rows);
    }
    kva_attention_desc_init(&d, 8, 8, 128, KVA_DTYPE_F32);
    CHECK(kva__cuda_select(&d, KVA_OP_BATCH_DECODE, 0, 1, &c) == KVA_ERR_UNSUPPORTED &&
              strstr(kva_last_error_message(), "q_dtype"),
          "f32 q unsupported: %s", kva_last_error_message());
    kva_attention_desc_init(&d, 8, 8, 96, KVA_DTYPE_F16);
    CHECK(kva__cuda_select(&d, KVA_OP_BATCH_DECODE, 0, 1, &c) == KVA_ERR_UNSUPPORTED &&
              strstr(kva_last_error_message(), "head dim"),
          "head dim 96 unsupported: %s", kva_last_error_message());
    kva_attention_desc_init(&d, 8, 8, 128, KVA_DTYPE_F16);
    d.kv_dtype = KVA_DTYPE_F32;
    CHECK(kva__cuda_select(&d, KVA_OP_BATCH_DECODE, 0, 1, &c) == KVA_ERR_UNSUPPORTED, "f32 KV unsupported");
    kva_attention_desc_init(&d, 8, 8, 128, KVA_DTYPE_F16);
    d.head_dim_vo = 64;
    CHECK(kva__cuda_select(&d, KVA_OP_BATCH_DECODE, 0, 1, &c) == KVA_ERR_UNSUPPORTED, "dqk != dvo unsupported");
    kva_attention_desc_init(&d, 8, 8, 128, KVA_DTYPE_F16);
    CHECK(kva__cuda_select(&d, KVA_OP_BATCH_PREFILL_PAGED, 0, 100, &c) == KVA_OK && c.tile_q == 128 &&
              c.key.family == KVA__KF_PREFILL && c.key.rows == 128,
          "prefill tile 128 (tensor-core attention)");
    CHECK(kva__cuda_select(&d, KVA_OP_BATCH_PREFILL_RAGGED, 0, 12, &c) == KVA_OK && c.tile_q == 16 &&
              c.key.family == KVA__KF_PREFILL,
          "ragged tile 16 (tensor-core attention)");
    /* at most 8 packed rows per request (multi-token decode, one-row sparse blocks): the decode families, and
       finish_plan (which passes the chosen tile) agrees */
    CHECK(kva__cuda_select(&d, KVA_OP_BATCH_PREFILL_RAGGED, 0, 3, &c) == KVA_OK && c.tile_q == 3 &&
              c.key.family == KVA__KF_DECODE_TC,
          "ragged with 3 packed rows: decode family (tile %d, family %d)", c.tile_q, (int)c.key.family);
    CHECK(kva__cuda_select(&d, KVA_OP_BATCH_PREFILL_PAGED, 3, 0, &c) == KVA_OK && c.key.family == KVA__KF_DECODE_TC,
          "finish_plan with tile 3: decode family");
    /* a device with too little shared memory for any tensor-core attention tile (99 KB, head dim 256) falls back
       to the decode families, both when choosing the tile and when planning with the chosen one */
    kva_attention_desc_init(&d, 16, 16, 256, KVA_DTYPE_BF16);
    CHECK(kva__cuda_select_dev(&d, KVA_OP_BATCH_PREFILL_RAGGED, 0, 4096, 4096.0, 99 * 1024, &c) == KVA_OK &&
              c.key.family != KVA__KF_PREFILL && c.tile_q <= 8,
          "D256 on a 99 KB device: decode-family fallback (tile %d)", c.tile_q);
    CHECK(kva__cuda_select_dev(&d, KVA_OP_BATCH_PREFILL_RAGGED, c.tile_q, 0, 0.0, 99 * 1024, &c) == KVA_OK &&
              c.key.family != KVA__KF_PREFILL,
          "D256 on a 99 KB device: finish_plan agrees");
    CHECK(kva__cuda_select_dev(&d, KVA_OP_BATCH_PREFILL_RAGGED, 0, 4096, 4096.0, 227 * 1024, &c) == KVA_OK &&
              c.key.family == KVA__KF_PREFILL && c.tile_q == 64,
          "D256 on sm_90: tensor-core attention, tile 64");
    kva_attention_desc_init(&d, 8, 8, 128, KVA_DTYPE_F16);
    CHECK(kva__cuda_select(&d, KVA_OP_BATCH_DECODE, 9, 0, &c) == KVA_ERR_INTERNAL, "tile 9 refused");
}

/* the head-group plan's heads per unit (kva__cuda_hg_heads_pick) on a 132-SM device */
static void test_hg_pick(void) {
    static const struct {
        int32_t H;
        int64_t B, mb;
        int32_t G, one;
    } c[] = {
        {4, 64, 1074, 2, 1},  /* D3 64 x 8k: 64 units of 4 heads (split), 128 of 2 */
        {4, 60, 1007, 2, 1},  /* 120 units of 2: >= 7/8 of 132 */
        {8, 64, 1074, 4, 0},  /* D1 64 x 4k: 128 units of 4, none split */
        {8, 16, 268, 4, 0},   /* 16 x 4k: 64 units of 2 would leave half the SMs idle */
        {8, 33, 537, 2, 1},   /* 132 units of 2 */
        {8, 34, 537, 4, 0},   /* 136 units of 2: more than the SMs */
        {8, 29, 537, 2, 1},   /* 116 units of 2 */
        {8, 28, 537, 4, 0},   /* 112 units of 2: below 7/8 */
        {32, 8, 2147, 4, 0},  /* MHA 8 x 16k: 2 GB, the merges are worth it */
        {32, 8, 537, 2, 1},   /* MHA 8 x 4k */
        {6, 40, 537, 2, 0},   /* H not a multiple of 4: units of 2 at the context's CTAs per SM */
    };
    for (size_t i = 0; i < sizeof c / sizeof c[0]; ++i) {
        int32_t one = -1;
        const int32_t G = kva__cuda_hg_heads_pick(c[i].H, c[i].B, c[i].mb * 1000000ll, 132, &one);
        CHECK(G == c[i].G && one == c[i].one, "hg pick: H %d, B %lld, %lld MB: G %d one per SM %d, expected %d %d",
              (int)c[i].H, (long long)c[i].B, (long long)c[i].mb, (int)G, (int)one, (int)c[i].G, (int)c[i].one);
    }
}

static void test_fastdiv(void) {
    int bad = 0;
    for (int32_t d = 1; d <= 1100 && bad < 5; ++d) {
        uint32_t m, s;
        kva__fastdiv_magic(d, &m, &s);
        uint32_t ns[] = {0, 1, 2, 3, (uint32_t)d - 1, (uint32_t)d, (uint32_t)d + 1, 1000, 65535, 65536, 1u << 20,
                         (1u << 30) + 7, 0x7fffffffu, 0x7ffffffeu, 123456789u};
        for (size_t i = 0; i < sizeof ns / sizeof ns[0]; ++i) {
            uint32_t n = ns[i];
            uint32_t q = (uint32_t)(((uint64_t)n * m >> 32) + n) >> s;
            if (q != n / (uint32_t)d) {
                if (bad++ < 5) printf("fastdiv: %u / %d = %u, got %u\n", n, (int)d, n / (uint32_t)d, q);
            }
        }
        for (uint32_t n = 0; n < 5000; ++n) {
            uint32_t q = (uint32_t)(((uint64_t)n * m >> 32) + n) >> s;
            if (q != n / (uint32_t)d && bad++ < 5) printf("fastdiv: %u / %d\n", n, (int)d);
        }
    }
    CHECK(bad == 0, "fast division by the page size");
}

static void test_cache(void) {
    char base[] = "/tmp/kva_jit_test_XXXXXX";
    if (!mkdtemp(base)) {
        CHECK(0, "mkdtemp");
        return;
    }
    char dir[1024], got[1024];
    snprintf(dir, sizeof dir, "%s/a/b/kvattn", base);
    CHECK(kva__jit_cache_dir(dir, got, sizeof got) && strcmp(got, dir) == 0, "cache dir created: %s", dir);
    struct stat sb;
    CHECK(stat(dir, &sb) == 0 && (sb.st_mode & 0777) == 0700, "cache dir mode %o", (unsigned)(sb.st_mode & 0777));
    char bad[1024];
    snprintf(bad, sizeof bad, "%s/open", base);
    mkdir(bad, 0777);
    chmod(bad, 0777);
    CHECK(!kva__jit_cache_dir(bad, got, sizeof got), "a world-writable cache dir is refused");

    kva__kkey k;
    memset(&k, 0, sizeof k);
    k.family = KVA__KF_UTIL;
    void* c1 = NULL;
    void* c2 = NULL;
    size_t s1 = 0, s2 = 0;
    int hit = -1;
    kva_status st = kva__jit_cached(NULL, dir, &k, "sm_90a", &c1, &s1, &hit);
    CHECK(st == KVA_OK && hit == 0 && s1 > 0, "cold compile: %s", kva_last_error_message());
    st = kva__jit_cached(NULL, dir, &k, "sm_90a", &c2, &s2, &hit);
    CHECK(st == KVA_OK && hit == 1 && s2 == s1 && c1 && c2 && memcmp(c1, c2, s1) == 0, "cache hit, same bytes");
    free(c2);
    c2 = NULL;
    /* another arch is another entry */
    st = kva__jit_cached(NULL, dir, &k, "sm_80", &c2, &s2, &hit);
    CHECK(st == KVA_OK && hit == 0, "sm_80 is a separate entry");
    free(c2);
    c2 = NULL;
    /* KVATTN_JIT=0: a cached kernel still loads; a miss is UNSUPPORTED, naming the kernel, and nothing is compiled */
    setenv("KVATTN_JIT", "0", 1);
    st = kva__jit_cached(NULL, dir, &k, "sm_90a", &c2, &s2, &hit);
    CHECK(st == KVA_OK && hit == 1, "KVATTN_JIT=0: a cache hit loads: %s", kva_last_error_message());
    free(c2);
    c2 = NULL;
    st = kva__jit_cached(NULL, dir, &k, "sm_86", &c2, &s2, &hit);
    CHECK(st == KVA_ERR_UNSUPPORTED && c2 == NULL && strstr(kva_last_error_message(), "KVATTN_JIT=0") &&
              strstr(kva_last_error_message(), "sm_86"),
          "KVATTN_JIT=0: a miss is UNSUPPORTED: %s (%s)", kva_status_string(st), kva_last_error_message());
    free(c2);
    c2 = NULL;
    setenv("KVATTN_JIT", "1", 1);
    st = kva__jit_cached(NULL, dir, &k, "sm_86", &c2, &s2, &hit);
    CHECK(st == KVA_OK && hit == 0, "KVATTN_JIT=1 compiles: %s", kva_last_error_message());
    unsetenv("KVATTN_JIT");
    free(c2);
    c2 = NULL;
    /* corrupt the sm_90a entry: it must be recompiled, not loaded */
    char ident[2048], hash[40], file[1200];
    kva__jit_identity(&k, "sm_90a", ident, sizeof ident, hash, sizeof hash);
    snprintf(file, sizeof file, "%s/%s.cubin", dir, hash);
    FILE* f = fopen(file, "r+b");
    CHECK(f != NULL, "cache file %s exists", file);
    if (f) {
        fseek(f, -5, SEEK_END);
        fputc('X', f);
        fclose(f);
    }
    st = kva__jit_cached(NULL, dir, &k, "sm_90a", &c2, &s2, &hit);
    CHECK(st == KVA_OK && hit == 0 && s2 == s1 && memcmp(c1, c2, s1) == 0, "corrupt entry recompiled");
    free(c2);
    c2 = NULL;
    st = kva__jit_cached(NULL, dir, &k, "sm_90a", &c2, &s2, &hit);
    CHECK(st == KVA_OK && hit == 1, "rewritten entry hits");
    CHECK(stat(file, &sb) == 0 && (sb.st_mode & 0077) == 0, "cache file mode %o", (unsigned)(sb.st_mode & 0777));
    /* stale temporary files: only this user's regular files with a temporary name, older than the limit, go */
    {
        static const char* const names[] = {
            ".0123456789abcdef0123456789abcdef.Ab3xYz.tmp",     /* old temporary: removed */
            ".0123456789abcdef0123456789abcdef.4242.7.tmp",     /* old, the former <pid>.<n> naming: removed */
            ".fedcba9876543210fedcba9876543210.Qw12Er.load.so", /* old: removed */
            ".0123456789abcdef0123456789abcdef.Zz9Yy8.c",       /* fresh: another process may be writing it */
            "0123456789abcdef0123456789abcdef.cubin",           /* an entry, however old */
            ".notahash.Ab3xYz.tmp",                             /* another name */
            ".0123456789ABCDEF0123456789abcdef.Ab3xYz.tmp",     /* upper-case digits: not a kvattn hash */
        };
        const int want_gone[] = {1, 1, 1, 0, 0, 0, 0};
        const int n = (int)(sizeof names / sizeof names[0]);
        char p[1400];
        for (int i = 0; i < n; ++i) {
            snprintf(p, sizeof p, "%s/%s", dir, names[i]);
            FILE* tf = fopen(p, "wb");
            if (tf) fclose(tf);
            if (i != 3) {
                struct timespec ts[2];
                ts[0].tv_sec = ts[1].tv_sec = time(NULL) - 2 * KVA__JIT_STALE_S;
                ts[0].tv_nsec = ts[1].tv_nsec = 0;
                utimensat(AT_FDCWD, p, ts, 0);
            }
        }
        /* an old link with a temporary name (to a file outside) and an old directory: left alone */
        char target[1200], lnk[1400], sub[1400];
        snprintf(target, sizeof target, "%s/outside", base);
        FILE* tf = fopen(target, "wb");
        if (tf) fclose(tf);
        snprintf(lnk, sizeof lnk, "%s/.00000000000000000000000000000000.link00.tmp", dir);
        CHECK(symlink(target, lnk) == 0, "symlink planted");
        snprintf(sub, sizeof sub, "%s/.11111111111111111111111111111111.dir000.tmp", dir);
        CHECK(mkdir(sub, 0700) == 0, "directory planted");
        struct timespec ts[2];
        ts[0].tv_sec = ts[1].tv_sec = time(NULL) - 2 * KVA__JIT_STALE_S;
        ts[0].tv_nsec = ts[1].tv_nsec = 0;
        utimensat(AT_FDCWD, lnk, ts, AT_SYMLINK_NOFOLLOW);
        utimensat(AT_FDCWD, sub, ts, 0);
        const int removed = kva__jit_sweep(NULL, dir, KVA__JIT_STALE_S);
        CHECK(removed == 3, "sweep removed %d files, want 3", removed);
        for (int i = 0; i < n; ++i) {
            snprintf(p, sizeof p, "%s/%s", dir, names[i]);
            const int gone = access(p, F_OK) != 0;
            CHECK(gone == want_gone[i], "%s: %s", names[i], gone ? "removed" : "kept");
        }
        struct stat lsb;
        CHECK(lstat(lnk, &lsb) == 0 && S_ISLNK(lsb.st_mode) && access(target, F_OK) == 0,
              "an old link with a temporary name and its target are kept");
        CHECK(stat(sub, &lsb) == 0 && S_ISDIR(lsb.st_mode), "an old directory with a temporary name is kept");
        st = kva__jit_cached(NULL, dir, &k, "sm_90a", &c2, &s2, &hit);
        CHECK(st == KVA_OK && hit == 1, "the entry still hits after the sweep");
        free(c2);
        c2 = NULL;
        CHECK(kva__jit_sweep(NULL, dir, KVA__JIT_STALE_S) == 0, "a second sweep removes nothing");
        CHECK(kva__jit_sweep(NULL, "/nonexistent/kvattn-cache", KVA__JIT_STALE_S) == 0, "a missing directory: nothing");
    }
    free(c1);
    free(c2);
    /* variant keys: equal only with equal source text (a colliding var_hash must not share a kernel) */
    {
        kva__kkey va, vb;
        memset(&va, 0, sizeof va);
        va.family = KVA__KF_DECODE;
        va.var_hash = 0x1234abcdull;
        char sa[] = "variant source A", sb2[] = "variant source B", sa2[] = "variant source A";
        va.var_src = sa;
        vb = va;
        vb.var_src = sb2;
        CHECK(!kva__kkey_eq(&va, &vb), "variant keys with one hash and different sources differ");
        vb.var_src = sa2;
        CHECK(kva__kkey_eq(&va, &vb), "variant keys with equal sources (other buffers) are equal");
    }
    /* a compile error carries the NVRTC log */
    kva__kkey badk;
    memset(&badk, 0, sizeof badk);
    badk.family = KVA__KF_DECODE;
    badk.dqk = 96; /* not a supported head dim: the kernel source refuses it */
    badk.dvo = 96;
    badk.qt = badk.kt = badk.ot = KVA_DTYPE_F16;
    badk.rows = 1;
    void* cb = NULL;
    size_t cbs = 0;
    st = kva__jit_compile(&badk, "sm_90a", NULL, &cb, &cbs, NULL);
    CHECK(st == KVA_ERR_JIT && strstr(kva_last_error_message(), "error"), "compile failure returns KVA_ERR_JIT with the log");
    free(cb);
    char cmd[1200];
    snprintf(cmd, sizeof cmd, "rm -rf '%s'", base);
    if (system(cmd) != 0) printf("note: could not remove %s\n", base);
}

int main(int argc, char** argv) {
    for (int i = 1; i < argc; ++i)
        if (strcmp(argv[i], "-v") == 0 || strcmp(argv[i], "--verbose") == 0) verbose = 1;
    test_select();
    test_hg_pick();
    test_fastdiv();
    test_cache();
    test_nvrtc_variants();
    printf("%d passed, %d failed\n", npass, nfail);
    return nfail ? 1 : 0;
}
