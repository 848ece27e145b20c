/*
 * cuda_prefill.c - host side of the tensor-core attention kernel family (see cuda_prefill.h). Pure functions only.
 */
#include <stdio.h>
#include <string.h>

#include "cuda_prefill.h"

static int kva__pf_is16(kva_dtype t) { return t == KVA_DTYPE_F16 || t == KVA_DTYPE_BF16; }

static const char* kva__pf_dt(int t) {
    switch (t) {
    case KVA_DTYPE_F32: return "f32";
    case KVA_DTYPE_F16: return "f16";
    case KVA_DTYPE_BF16: return "bf16";
    case KVA_DTYPE_E4M3: return "e4m3";
    case KVA_DTYPE_E5M2: return "e5m2";
    }
    return "x";
}

static int kva__pf_es(kva_dtype kv) { return KVK_PF_ES((int)kv); }

static size_t kva__pf_smem_of(int32_t d, int32_t tq, int es) { return (size_t)KVK_PF_SMEM(d, tq, es); }

static void kva__pf_why(char* why, size_t n, const char* fmt, int a, int b) {
    if (why && n) snprintf(why, n, fmt, a, b);
}

int kva__cuda_prefill_supported(const kva_attention_desc* d, kva_op op, int32_t tile_q, int max_smem_optin, char* why,
                                size_t why_size) {
    if (why && why_size) why[0] = '\0';
    if (op != KVA_OP_BATCH_PREFILL_PAGED && op != KVA_OP_BATCH_PREFILL_RAGGED && op != KVA_OP_BATCH_DECODE) {
        kva__pf_why(why, why_size, "op %d is not a kva_op", (int)op, 0);
        return 0;
    }
    if (!kva__pf_is16(d->q_dtype)) {
        kva__pf_why(why, why_size, "q_dtype %d is not supported (f16 or bf16)", (int)d->q_dtype, 0);
        return 0;
    }
    if (!kva__pf_is16(d->kv_dtype) && !kva__is_fp8(d->kv_dtype)) {
        kva__pf_why(why, why_size, "kv_dtype %d is not supported (f16, bf16, e4m3 or e5m2)", (int)d->kv_dtype, 0);
        return 0;
    }
    if (!kva__pf_is16(d->o_dtype) && d->o_dtype != KVA_DTYPE_F32) {
        kva__pf_why(why, why_size, "o_dtype %d is not supported (f16, bf16 or f32)", (int)d->o_dtype, 0);
        return 0;
    }
    if (d->head_dim_qk != d->head_dim_vo) {
        kva__pf_why(why, why_size, "head_dim_qk = %d differs from head_dim_vo = %d (equal head dims only)",
                    (int)d->head_dim_qk, (int)d->head_dim_vo);
        return 0;
    }
    if (d->head_dim_qk != 64 && d->head_dim_qk != 128 && d->head_dim_qk != 256) {
        kva__pf_why(why, why_size, "head dim %d is not supported (64, 128 or 256)", (int)d->head_dim_qk, 0);
        return 0;
    }
    if (d->num_kv_heads <= 0 || d->num_qo_heads <= 0 || d->num_qo_heads % d->num_kv_heads != 0) {
        kva__pf_why(why, why_size, "%d query heads are not a multiple of %d KV heads", (int)d->num_qo_heads,
                    (int)d->num_kv_heads);
        return 0;
    }
    if (tile_q < 1 || tile_q > KVK_PF_MAX_TQ(d->head_dim_qk)) {
        kva__pf_why(why, why_size, "tile_q = %d is outside [1, %d] for this head dim", (int)tile_q,
                    KVK_PF_MAX_TQ(d->head_dim_qk));
        return 0;
    }
    const int32_t tq = KVK_PF_KERNEL_TQ(d->head_dim_qk, tile_q);
    const size_t smem = kva__pf_smem_of(d->head_dim_qk, tq, kva__pf_es(d->kv_dtype));
    if (max_smem_optin > 0 && smem > (size_t)max_smem_optin) {
        kva__pf_why(why, why_size, "the %d-row tile needs %d bytes of shared memory, more than the device's limit",
                    (int)tq, (int)smem);
        return 0;
    }
    return 1;
}

kva_status kva__cuda_prefill_select(const kva_attention_desc* d, kva_op op, int32_t tile_q, int max_smem_optin,
                                    kva__kkey* key, size_t* smem) {
    char why[256];
    KVA_RETURN_IF(!kva__cuda_prefill_supported(d, op, tile_q, max_smem_optin, why, sizeof why), KVA_ERR_UNSUPPORTED,
                  "CUDA backend (tensor-core attention): %s", why);
    kva__kkey k;
    memset(&k, 0, sizeof k);
    k.family = KVA__KF_PREFILL;
    k.dqk = d->head_dim_qk;
    k.dvo = d->head_dim_vo;
    k.qt = d->q_dtype;
    k.kt = d->kv_dtype;
    k.ot = d->o_dtype;
    k.rows = KVK_PF_KERNEL_TQ(d->head_dim_qk, tile_q);
    k.rope = d->pos_encoding == KVA_POS_ROPE_LLAMA;
    if (key) *key = k;
    if (smem) *smem = kva__cuda_prefill_smem(&k);
    return KVA_OK;
}

int32_t kva__cuda_prefill_tile_q(const kva_attention_desc* d, kva_op op, double avg_packed_qo_len,
                                 int32_t max_packed_qo_len, int max_smem_optin) {
    (void)max_packed_qo_len;
    int32_t t = avg_packed_qo_len <= 16.0 ? 16 : (avg_packed_qo_len <= 64.0 ? 64 : 128);
    if (t > KVK_PF_MAX_TQ(d->head_dim_qk)) t = KVK_PF_MAX_TQ(d->head_dim_qk);
    for (;;) {
        if (kva__cuda_prefill_supported(d, op, t, max_smem_optin, NULL, 0)) return t;
        if (t == 16) return 0;
        t = t == 128 ? 64 : 16;
    }
}

int kva__cuda_prefill_prefer_for_decode(const kva_attention_desc* d) {
    if (d->num_kv_heads <= 0) return 0;
    return d->num_qo_heads / d->num_kv_heads > 8;
}

void kva__cuda_prefill_name(const kva__kkey* k, char* buf, size_t size) {
    char x[16] = "", v[24] = "";
    if (k->nochk >> 4) snprintf(x, sizeof x, "_x%d", (int)(k->nochk >> 4));
    if (k->var_hash) snprintf(v, sizeof v, "_v%016llx", (unsigned long long)k->var_hash);
    snprintf(buf, size, "%s_d%d_q%s_kv%s_o%s_t%d_rope%d%s%s%s%s", k->mainloop ? "kva_pfw" : "kva_pf", (int)k->dqk,
             kva__pf_dt(k->qt), kva__pf_dt(k->kt), kva__pf_dt(k->ot), (int)k->rows, (int)k->rope, v,
             k->alibi_fold ? "_afold" : "", (k->nochk & 1) ? "_nochk" : "", x);
}

int kva__cuda_prefill_defines(const kva__kkey* k, char (*defs)[128], int max) {
    if (max < 8) return 0;
    char name[96];
    kva__cuda_prefill_name(k, name, sizeof name);
    snprintf(defs[0], 128, "-DKVA_KERNEL_NAME=%s", name);
    snprintf(defs[1], 128, "-DKVA_DQK=%d", (int)k->dqk);
    snprintf(defs[2], 128, "-DKVA_DVO=%d", (int)k->dvo);
    snprintf(defs[3], 128, "-DKVA_QT=%d", (int)k->qt);
    snprintf(defs[4], 128, "-DKVA_KT=%d", (int)k->kt);
    snprintf(defs[5], 128, "-DKVA_OT=%d", (int)k->ot);
    snprintf(defs[6], 128, "-DKVA_TQ=%d", (int)k->rows);
    snprintf(defs[7], 128, "-DKVA_ROPE=%d", (int)k->rope);
    int n = 8;
    if (k->mainloop && max > n) snprintf(defs[n++], 128, "-DKVA_MAINLOOP=%d", (int)k->mainloop);
    if (k->alibi_fold && max > n) snprintf(defs[n++], 128, "-DKVA_ALIBI_FOLD=1");
    if ((k->nochk & 1) && max > n) snprintf(defs[n++], 128, "-DKVA_NO_BOUNDS_CHECK=1"); /* benchmark builds only */
    if ((k->nochk >> 4) && max > n) snprintf(defs[n++], 128, "-DKVP_EXP=%d", (int)(k->nochk >> 4)); /* timing only */
    if (k->var_hash && max > n) snprintf(defs[n++], 128, "-DKVA_VMERGE_NAME=%s_merge", name); /* a user variant's */
    return n;
}

const char* kva__cuda_prefill_source(void) { return "#include \"kva_prefill.cuh\"\n"; }

size_t kva__cuda_prefill_smem(const kva__kkey* k) {
    if (k->mainloop == 1) return (size_t)KVK_PFW_SMEM(k->dqk);
    return kva__pf_smem_of(k->dqk, k->rows, kva__pf_es((kva_dtype)k->kt));
}

int kva__cuda_prefill_threads(const kva__kkey* k) { return k->mainloop == 1 ? KVK_PFW_THREADS : KVK_PF_THREADS; }

int kva__cuda_prefill_wg_ok(const kva__kkey* k, int cc, int max_smem_optin) {
    if (k->family != KVA__KF_PREFILL || cc != 90 || k->rows != KVK_PFW_TQ || k->rope || k->var_hash) return 0;
    if (k->dqk != k->dvo || (k->dqk != 64 && k->dqk != 128)) return 0;
    if (k->qt != k->kt || !kva__pf_is16((kva_dtype)k->kt)) return 0;
    if (max_smem_optin > 0 && (size_t)KVK_PFW_SMEM(k->dqk) > (size_t)max_smem_optin) return 0;
    return 1;
}

void kva__cuda_prefill_upgrade(kva__kkey* k, size_t* smem, int cc, int max_smem_optin, int alibi_fold) {
    if (!kva__cuda_prefill_wg_ok(k, cc, max_smem_optin)) return;
    k->mainloop = 1;
    k->alibi_fold = alibi_fold ? 1 : 0;
    if (smem) *smem = kva__cuda_prefill_smem(k);
}

static void kva__pf_key(kva__kkey* k, int d, int qt, int kt, int ot, int tq, int rope) {
    kva__kkey_set(k, KVA__KF_PREFILL, d, qt, kt, ot, tq, rope, 0);
}

int kva__cuda_prefill_enumerate(kva__kkey* keys, int max) {
    static const int dims[] = {64, 128, 256};
    static const int qts[] = {KVA_DTYPE_F16, KVA_DTYPE_BF16};
    static const int kts[] = {KVA_DTYPE_F16, KVA_DTYPE_BF16, KVA_DTYPE_E4M3, KVA_DTYPE_E5M2};
    static const int ots[] = {KVA_DTYPE_F16, KVA_DTYPE_BF16, KVA_DTYPE_F32};
    static const int tqs[] = {16, 64, 128};
    int n = 0;
    for (int a = 0; a < 3; ++a)
        for (int t = 0; t < 3; ++t) {
            if (tqs[t] > KVK_PF_MAX_TQ(dims[a])) continue;
            for (int b = 0; b < 2; ++b)
                for (int c = 0; c < 4; ++c)
                    for (int e = 0; e < 3; ++e)
                        for (int rope = 0; rope < 2; ++rope) {
                            if (n < max) kva__pf_key(&keys[n], dims[a], qts[b], kts[c], ots[e], tqs[t], rope);
                            ++n;
                        }
        }
    /* the Hopper mainloop: tile 128, head dim 64 / 128, q = KV 16-bit, every o dtype, no RoPE, ALiBi folded or not */
    for (int af = 0; af < 2; ++af)
        for (int a = 0; a < 2; ++a)
            for (int b = 0; b < 2; ++b)
                for (int e = 0; e < 3; ++e) {
                    if (n < max) {
                        kva__pf_key(&keys[n], dims[a], qts[b], qts[b], ots[e], 128, 0);
                        keys[n].mainloop = 1;
                        keys[n].alibi_fold = af;
                    }
                    ++n;
                }
    return n;
}

int kva__cuda_prefill_aot_keys(kva__kkey* keys, int max) {
    /* (d, q, kv, o) as in src/cuda/prefill.cmake */
    static const int cfg[][4] = {{128, KVA_DTYPE_BF16, KVA_DTYPE_BF16, KVA_DTYPE_BF16},
                                 {128, KVA_DTYPE_F16, KVA_DTYPE_F16, KVA_DTYPE_F16},
                                 {128, KVA_DTYPE_BF16, KVA_DTYPE_E4M3, KVA_DTYPE_BF16},
                                 {64, KVA_DTYPE_BF16, KVA_DTYPE_BF16, KVA_DTYPE_BF16},
                                 {256, KVA_DTYPE_BF16, KVA_DTYPE_BF16, KVA_DTYPE_BF16}};
    static const int tqs[] = {16, 64, 128};
    int n = 0;
    for (size_t i = 0; i < sizeof cfg / sizeof cfg[0]; ++i)
        for (int t = 0; t < 3; ++t) {
            if (tqs[t] > KVK_PF_MAX_TQ(cfg[i][0])) continue;
            if (n < max) kva__pf_key(&keys[n], cfg[i][0], cfg[i][1], cfg[i][2], cfg[i][3], tqs[t], 0);
            ++n;
        }
    /* the Hopper mainloop (tile 128): head dim 128 bf16 and f16, head dim 64 bf16; head dim 128 bf16 with ALiBi
       folded */
    static const int wcfg[][3] = {{128, KVA_DTYPE_BF16, 0}, {128, KVA_DTYPE_F16, 0}, {64, KVA_DTYPE_BF16, 0},
                                  {128, KVA_DTYPE_BF16, 1}};
    for (size_t i = 0; i < sizeof wcfg / sizeof wcfg[0]; ++i) {
        if (n < max) {
            kva__pf_key(&keys[n], wcfg[i][0], wcfg[i][1], wcfg[i][1], wcfg[i][1], 128, 0);
            keys[n].mainloop = 1;
            keys[n].alibi_fold = wcfg[i][2];
        }
        ++n;
    }
    return n;
}
