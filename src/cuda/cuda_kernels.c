/*
 * cuda_kernels.c - kernel keys, the selection function, NVRTC compilation with an on-disk cache, and the
 * per-context kernel table (prebuilt fatbin first, then JIT).
 */
#define _POSIX_C_SOURCE 200809L
#include <errno.h>
#include <stddef.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/types.h>
#include <unistd.h>

#include "cuda_internal.h"
#include "cuda_prefill.h"

/* ---------------------------------------------------------------------------------------------- */
/* Selection                                                                                       */

static bool kva__is16(kva_dtype t) { return t == KVA_DTYPE_F16 || t == KVA_DTYPE_BF16; }

static int32_t kva__pow2_ceil(int32_t x) {
    int32_t p = 1;
    while (p < x) p *= 2;
    return p;
}

static const char* kva__op_str(kva_op op) {
    switch (op) {
    case KVA_OP_BATCH_DECODE: return "batch decode";
    case KVA_OP_BATCH_PREFILL_PAGED: return "batch prefill (paged)";
    case KVA_OP_BATCH_PREFILL_RAGGED: return "batch prefill (ragged)";
    }
    return "?";
}

kva_status kva__cuda_select(const kva_attention_desc* d, kva_op op, int32_t tile_q, int32_t max_packed,
                            kva__kchoice* out) {
    return kva__cuda_select_dev(d, op, tile_q, max_packed, (double)max_packed, 0, out);
}

kva_status kva__cuda_select_dev(const kva_attention_desc* d, kva_op op, int32_t tile_q, int32_t max_packed,
                                double avg_packed, int max_smem_optin, kva__kchoice* out) {
    KVA_RETURN_IF(op != KVA_OP_BATCH_DECODE && op != KVA_OP_BATCH_PREFILL_PAGED && op != KVA_OP_BATCH_PREFILL_RAGGED,
                  KVA_ERR_INVALID_ARGUMENT, "CUDA backend: op %d is not a kva_op", (int)op);
    KVA_RETURN_IF(!kva__is16(d->q_dtype), KVA_ERR_UNSUPPORTED,
                  "CUDA backend (%s): q_dtype %s is not supported (f16 or bf16)", kva__op_str(op),
                  kva_dtype_name(d->q_dtype));
    KVA_RETURN_IF(!kva__is16(d->o_dtype) && d->o_dtype != KVA_DTYPE_F32, KVA_ERR_UNSUPPORTED,
                  "CUDA backend (%s): o_dtype %s is not supported (f16, bf16 or f32)", kva__op_str(op),
                  kva_dtype_name(d->o_dtype));
    KVA_RETURN_IF(!kva__is16(d->kv_dtype) && !kva__is_fp8(d->kv_dtype),
                  KVA_ERR_UNSUPPORTED, "CUDA backend (%s): kv_dtype %s is not supported (f16, bf16, e4m3 or e5m2)",
                  kva__op_str(op), kva_dtype_name(d->kv_dtype));
    KVA_RETURN_IF(d->head_dim_qk != d->head_dim_vo, KVA_ERR_UNSUPPORTED,
                  "CUDA backend (%s): head_dim_qk = %d differs from head_dim_vo = %d (equal head dims only)",
                  kva__op_str(op), (int)d->head_dim_qk, (int)d->head_dim_vo);
    KVA_RETURN_IF(d->head_dim_qk != 64 && d->head_dim_qk != 128 && d->head_dim_qk != 256, KVA_ERR_UNSUPPORTED,
                  "CUDA backend (%s): head dim %d is not supported (64, 128 or 256)", kva__op_str(op),
                  (int)d->head_dim_qk);
    KVA_RETURN_IF(d->num_kv_heads <= 0 || d->num_qo_heads % d->num_kv_heads != 0, KVA_ERR_INVALID_ARGUMENT,
                  "CUDA backend: %d query heads are not a multiple of %d KV heads", (int)d->num_qo_heads,
                  (int)d->num_kv_heads);
    const int32_t g = d->num_qo_heads / d->num_kv_heads;
    /* User variants: the tensor-core kernel (mma.sync mainloop) has the logits and output hook sites; variants with
       a query or key transform, and decode ops (one row per KV head at small groups), run on the CUDA-core kernel
       (kva_decode.cuh), which has them all. */
    const kva_variant* var = d->variant;
    KVA_RETURN_IF(var && !var->cuda_src, KVA_ERR_INVALID_ARGUMENT,
                  "CUDA backend (%s): desc->variant %s was not compiled for the CUDA backend", kva__op_str(op),
                  var->name);
    KVA_RETURN_IF(var && d->pos_encoding == KVA_POS_ROPE_LLAMA, KVA_ERR_UNSUPPORTED,
                  "CUDA backend (%s): a variant with fused RoPE is not supported", kva__op_str(op));
    /* the tensor-core attention family: prefill ops, and decode with GQA groups above 8 */
    /* Not (yet) for fused RoPE or q/KV of different 16-bit dtypes: those round q to 16 bits before the MMA
       (RoPE'd q in shared memory, q converted to the KV dtype) and missed the lse tolerance in the GPU suite;
       they run on the CUDA-core kernel below. */
    const bool pf_fp8 = kva__is_fp8(d->kv_dtype);
    const bool pf_ok = d->pos_encoding != KVA_POS_ROPE_LLAMA && (pf_fp8 || d->q_dtype == d->kv_dtype);
    /* Prefill ops whose requests pack at most 8 rows per KV head (multi-token decode, block-sparse decode with
       one-row blocks) run on the decode families: an MMA tile of 16+ rows would be mostly padding. The planner
       passes max_packed (graph mode: from the bounds); finish_plan passes the tile it chose (<= 8 only here). */
    const bool few_rows = op != KVA_OP_BATCH_DECODE && !kva__cuda_prefill_prefer_for_decode(d) &&
                          ((tile_q > 0 && tile_q <= 8) || (tile_q <= 0 && max_packed >= 1 && max_packed <= 8));
    const bool var_tc = !var || (kva__cuda_variant_tc_ok(var) && var->cuda_src_pf);
    if (var_tc && pf_ok && !few_rows && (op != KVA_OP_BATCH_DECODE || kva__cuda_prefill_prefer_for_decode(d))) {
        int32_t t = tile_q > 0 ? tile_q : kva__cuda_prefill_tile_q(d, op, avg_packed, max_packed, max_smem_optin);
        if (t > 0 && kva__cuda_prefill_supported(d, op, t, max_smem_optin, NULL, 0)) {
            kva__kchoice c;
            memset(&c, 0, sizeof c);
            KVA_FORWARD(kva__cuda_prefill_select(d, op, t, max_smem_optin, &c.key, &c.smem));
            c.tile_q = t;
            if (var) { /* NVRTC only (kva_prefill.cuh with KVA_VARIANT; never the Hopper mainloop) */
                c.key.var_hooks = (int32_t)var->hooks | (var->use_softmax ? 0x100 : 0);
                c.key.var_hash = var->hash;
                c.key.var_src = var->cuda_src_pf;
            }
            if (out) *out = c;
            return KVA_OK;
        }
        /* otherwise (a device whose shared memory is too small): the decode families below */
    }
    if (tile_q <= 0) {
        if (op == KVA_OP_BATCH_DECODE) {
            /* one tile per (request, KV head) up to 8 heads; larger groups in equal tiles of <= 8 rows */
            int32_t nt = (g + 7) / 8;
            tile_q = (g + nt - 1) / nt;
        } else {
            tile_q = max_packed < 1 ? 1 : (max_packed > 8 ? 8 : max_packed);
        }
    }
    KVA_RETURN_IF(tile_q > 8, KVA_ERR_INTERNAL,
                  "CUDA backend: the plan has %d packed rows per tile; the CUDA-core kernel takes at most 8",
                  (int)tile_q);
    kva__kchoice c;
    memset(&c, 0, sizeof c);
    c.key.dqk = d->head_dim_qk;
    c.key.dvo = d->head_dim_vo;
    c.key.qt = d->q_dtype;
    c.key.kt = d->kv_dtype;
    c.key.ot = d->o_dtype;
    c.key.rows = kva__pow2_ceil(tile_q);
    c.key.rope = d->pos_encoding == KVA_POS_ROPE_LLAMA;
    c.tile_q = tile_q;
    /* The tensor-core kernel (kva_decode_tc.cuh) unless it lacks the variant: fused RoPE, or q and 16-bit KV of
       different dtypes; those run on the CUDA-core kernel (kva_decode.cuh). fp8 KV (e4m3, e5m2) at every head dim. */
    const bool fp8 = kva__is_fp8(d->kv_dtype);
    const bool tc = !var && !c.key.rope && (fp8 || d->q_dtype == d->kv_dtype);
    if (tc) {
        c.key.family = KVA__KF_DECODE_TC;
        c.key.rope = 0;
        c.smem = (size_t)KVK_TC_SMEM(c.key.dqk, KVK_DEC_ES(c.key.kt), c.key.rows);
    } else {
        c.key.family = KVA__KF_DECODE;
        c.smem = (size_t)KVK_DEC_SMEM(c.key.dqk, c.key.dvo, KVK_DEC_ES(c.key.kt), c.key.rows);
    }
    if (var) {
        c.key.var_hooks = (int32_t)var->hooks | (var->use_softmax ? 0x100 : 0);
        c.key.var_hash = var->hash;
        c.key.var_src = var->cuda_src;
    }
    if (out) *out = c;
    return KVA_OK;
}

static int kva__cuda_hg_key_x(const kva_attention_desc* d, int32_t page_size, int32_t heads, int rs, kva__kkey* out) {
    if (heads != 2 && heads != 4) return 0;
    /* 16-bit q = KV at head dims 64 and 128, or fp8 KV (e4m3, e5m2) under 16-bit q at head dim 128 */
    const bool fp8 = kva__is_fp8(d->kv_dtype);
    if (!kva__is16(d->q_dtype) || (d->kv_dtype != d->q_dtype && !fp8) || d->head_dim_qk != d->head_dim_vo ||
        (d->head_dim_qk != 64 && d->head_dim_qk != 128) || (fp8 && d->head_dim_qk != 128))
        return 0;
    if (!(d->o_dtype == KVA_DTYPE_F32 || kva__is16(d->o_dtype))) return 0;
    if (d->num_kv_heads < 1 || d->num_qo_heads % d->num_kv_heads != 0) return 0;
    const int32_t g = d->num_qo_heads / d->num_kv_heads;
    if (rs ? g <= 8 * heads / 2 || g > 8 * heads : g > 8 || d->num_kv_heads % heads != 0) return 0;
    if (d->variant || d->pos_encoding != KVA_POS_NONE || d->logits_soft_cap > 0.0f ||
        d->score_mode != KVA_SCORE_SOFTMAX || d->mask_mode == KVA_MASK_CUSTOM)
        return 0;
    if (page_size < 1) return 0;
    if (out) {
        memset(out, 0, sizeof *out);
        out->family = KVA__KF_DECODE_HG;
        out->dqk = out->dvo = d->head_dim_qk;
        out->qt = d->q_dtype;
        out->kt = d->kv_dtype;
        out->ot = d->o_dtype;
        out->rows = heads;
        out->mainloop = page_size % 16 != 0; /* the cp.async producer ("_ga"): TMA boxes need 16-token pages */
        out->hg_rs = rs;
    }
    return 1;
}

int kva__cuda_hg_key(const kva_attention_desc* d, int32_t page_size, int32_t heads, kva__kkey* out) {
    return kva__cuda_hg_key_x(d, page_size, heads, 0, out);
}

int kva__cuda_hg_rs_key(const kva_attention_desc* d, int32_t page_size, kva__kkey* out) {
    const int32_t g = d->num_kv_heads > 0 ? d->num_qo_heads / d->num_kv_heads : 0;
    return kva__cuda_hg_key_x(d, page_size, g <= 16 ? 2 : 4, 1, out);
}

size_t kva__kkey_smem(const kva__kkey* k) {
    if (k->family == KVA__KF_PREFILL) return kva__cuda_prefill_smem(k);
    if (k->family == KVA__KF_DECODE_HG)
        return (size_t)KVK_HG_SMEM(k->dqk, k->dqk * KVK_DEC_ES(k->kt), k->rows, k->hg_rs ? 1 : 0);
    if (k->family == KVA__KF_DECODE_TC)
        return (size_t)KVK_TC_SMEM_NW(k->dqk, KVK_DEC_ES(k->kt), k->rows, k->warps == 8 ? 8 : 4);
    if (k->family == KVA__KF_DECODE) return (size_t)KVK_DEC_SMEM(k->dqk, k->dvo, KVK_DEC_ES(k->kt), k->rows);
    return 0;
}

int kva__cuda_func_pdl(const kva__cuda_state* st, CUfunction f) {
    int ptx = 0;
    if (!f || st->cc < 90 || !st->cu->LaunchKernelEx || !st->cu->FuncGetAttribute) return 0;
    if (st->cu->FuncGetAttribute(&ptx, CU_FUNC_ATTRIBUTE_PTX_VERSION, f) != CUDA_SUCCESS) return 0;
    return ptx >= 90;
}

int kva__aot_has(const char* name) {
    int lo = 0, hi = kva__num_aot_names - 1;
    while (lo <= hi) {
        int mid = (lo + hi) / 2;
        int c = strcmp(kva__aot_names[mid], name);
        if (c == 0) return 1;
        if (c < 0) lo = mid + 1;
        else hi = mid - 1;
    }
    return 0;
}

void kva__fastdiv_magic(int32_t d, uint32_t* mul, uint32_t* shift) {
    /* n / d = (umulhi(n, m) + n) >> l for 0 <= n < 2^31, with l = ceil(log2 d), m = floor(2^32 (2^l - d) / d) + 1 */
    uint32_t l = 0;
    while (((uint64_t)1 << l) < (uint64_t)d) ++l;
    *mul = (uint32_t)((((uint64_t)1 << 32) * (((uint64_t)1 << l) - (uint64_t)d)) / (uint64_t)d + 1);
    *shift = l;
}

/* ---------------------------------------------------------------------------------------------- */
/* Keys                                                                                            */

static const char* kva__dt(int t) {
    switch (t) {
    case KVA_DTYPE_F32: return "f32";
    case KVA_DTYPE_F16: return "f16";
    case KVA_DTYPE_BF16: return "bf16";
    case KVA_DTYPE_E4M3: return "e4m3";
    case KVA_DTYPE_E5M2: return "e5m2";
    }
    return "x";
}

void kva__kkey_name(const kva__kkey* k, char* buf, size_t size) {
    if (k->family == KVA__KF_UTIL) {
        snprintf(buf, size, "kva_util");
        return;
    }
    if (k->family == KVA__KF_PREFILL)
        kva__cuda_prefill_name(k, buf, size);
    else if (k->family == KVA__KF_DECODE_TC) {
        char x[16] = "";
        if (k->nochk >> 8) snprintf(x, sizeof x, "_x%d", (int)(k->nochk >> 8));
        snprintf(buf, size, "kva_tc_d%d_q%s_kv%s_o%s_r%d%s%s%s%s%s%s", (int)k->dqk, kva__dt(k->qt), kva__dt(k->kt),
                 kva__dt(k->ot), (int)k->rows, k->warps == 8 ? "_w8" : "", (k->nochk & 1) ? "_nochk" : "",
                 (k->nochk & 2) ? "_trace" : "", (k->nochk & 4) ? "_nohint" : "", (k->nochk & 8) ? "_gmerge" : "", x);
    }
    else if (k->family == KVA__KF_DECODE_HG) {
        char x[16] = "";
        if (k->nochk >> 8) snprintf(x, sizeof x, "_x%d", (int)(k->nochk >> 8));
        snprintf(buf, size, "kva_hg_d%d_q%s_kv%s_o%s_g%d%s%s%s%s%s", (int)k->dqk, kva__dt(k->qt), kva__dt(k->kt),
                 kva__dt(k->ot), (int)k->rows, k->hg_rs ? "_rs" : "", k->mainloop == 1 ? "_ga" : "",
                 (k->nochk & 1) ? "_nochk" : "", (k->nochk & 2) ? "_trace" : "", x);
    }
    else if (k->var_hash)
        snprintf(buf, size, "kva_dec_d%d_q%s_kv%s_o%s_r%d_v%016llx%s%s", (int)k->dqk, kva__dt(k->qt), kva__dt(k->kt),
                 kva__dt(k->ot), (int)k->rows, (unsigned long long)k->var_hash, (k->nochk & 1) ? "_nochk" : "",
                 (k->nochk & 4) ? "_nohint" : "");
    else
        snprintf(buf, size, "kva_dec_d%d_q%s_kv%s_o%s_r%d_rope%d%s%s", (int)k->dqk, kva__dt(k->qt), kva__dt(k->kt),
                 kva__dt(k->ot), (int)k->rows, (int)k->rope, (k->nochk & 1) ? "_nochk" : "",
                 (k->nochk & 4) ? "_nohint" : "");
}

int kva__kkey_eq(const kva__kkey* a, const kva__kkey* b) {
    if (memcmp(a, b, offsetof(kva__kkey, var_src)) != 0) return 0;
    /* a variant's 64-bit source hash can collide (sources can be made to): the kernels of two live variants are
       the same only if their sources are */
    if (a->var_hash && a->var_src != b->var_src && (!a->var_src || !b->var_src || strcmp(a->var_src, b->var_src) != 0))
        return 0;
    return 1;
}

int kva__kkey_defines(const kva__kkey* k, char (*defs)[128], int max) {
    if (k->family == KVA__KF_PREFILL) return kva__cuda_prefill_defines(k, defs, max);
    if (k->family == KVA__KF_UTIL || max < 8) return 0;
    char name[96];
    kva__kkey_name(k, name, sizeof name);
    snprintf(defs[0], 128, "-DKVA_KERNEL_NAME=%s", name);
    snprintf(defs[1], 128, "-DKVA_DQK=%d", (int)k->dqk);
    snprintf(defs[2], 128, "-DKVA_DVO=%d", (int)k->dvo);
    snprintf(defs[3], 128, "-DKVA_QT=%d", (int)k->qt);
    snprintf(defs[4], 128, "-DKVA_KT=%d", (int)k->kt);
    snprintf(defs[5], 128, "-DKVA_OT=%d", (int)k->ot);
    snprintf(defs[6], 128, "-DKVA_ROWS=%d", (int)k->rows);
    snprintf(defs[7], 128, "-DKVA_ROPE=%d", (int)k->rope);
    int n = 8;
    if ((k->nochk & 1) && max > n) snprintf(defs[n++], 128, "-DKVA_NO_BOUNDS_CHECK=1");
    if ((k->nochk & 2) && max > n)
        snprintf(defs[n++], 128, k->family == KVA__KF_DECODE_HG ? "-DKVA_HG_TRACE=1" : "-DKVA_TC_TRACE=1");
    if ((k->nochk & 4) && max > n) snprintf(defs[n++], 128, "-DKVA_KV_L2_HINT=0"); /* benchmark A/B only */
    if (k->family == KVA__KF_DECODE_TC && k->warps == 8 && max > n) snprintf(defs[n++], 128, "-DKVA_TC_NW=8");
    if (k->family == KVA__KF_DECODE_HG && max > n) snprintf(defs[n++], 128, "-DKVA_HG=%d", (int)k->rows);
    if (k->family == KVA__KF_DECODE_HG && k->mainloop == 1 && max > n) snprintf(defs[n++], 128, "-DKVA_HG_GATHER=1");
    if (k->family == KVA__KF_DECODE_HG && k->hg_rs && max > n) snprintf(defs[n++], 128, "-DKVA_HG_RS=1");
    if (k->family == KVA__KF_DECODE_TC && (k->nochk & 8) && max > n)
        snprintf(defs[n++], 128, "-DKVA_TC_GENERIC_MERGE=1"); /* benchmark A/B only */
    if (k->family == KVA__KF_DECODE_TC && (k->nochk >> 8) && max > n)
        snprintf(defs[n++], 128, "-DKVA_TC_EXP=%d", (int)(k->nochk >> 8)); /* benchmark A/B only */
    if (k->family == KVA__KF_DECODE_HG && (k->nochk >> 8) && max > n)
        snprintf(defs[n++], 128, "-DKVA_HG_EXP=%d", (int)(k->nochk >> 8)); /* benchmark A/B only */
    if (k->var_hash && max > n) snprintf(defs[n++], 128, "-DKVA_VMERGE_NAME=%s_merge", name);
    return n;
}

const char* kva__kkey_source(const kva__kkey* k) {
    if (k->family == KVA__KF_UTIL) return "#include \"kva_util.cuh\"\n";
    if (k->family == KVA__KF_DECODE_TC) return "#include \"kva_decode_tc.cuh\"\n";
    if (k->family == KVA__KF_DECODE_HG) return "#include \"kva_decode_hg.cuh\"\n";
    if (k->var_hash && k->var_src) return k->var_src; /* a variant's (either family) */
    if (k->family == KVA__KF_PREFILL) return kva__cuda_prefill_source();
    return "#include \"kva_decode.cuh\"\n";
}

int kva__cuda_variant_tc_ok(const kva_variant* v) {
    return v && !(v->hooks & (KVA_VARIANT_QUERY_TRANSFORM | KVA_VARIANT_KEY_TRANSFORM));
}

char* kva__cuda_variant_source(const kva_variant* v, int mode) {
    const int check_only = mode == 1;
    const char* pre = kva__variant_prelude(1);
    char head[512];
    snprintf(head, sizeof head,
             "/* kvattn user variant %s */\n#define KVA_VARIANT 1\n#define KVA_VAR_HOOKS %u\n#define KVA_VAR_SOFTMAX %d\n"
             "#define KVA_VARIANT_CHECK %d\n",
             v->name, (unsigned)v->hooks, v->use_softmax ? 1 : 0, check_only ? 1 : 0);
    char line[160];
    snprintf(line, sizeof line, "#line 1 \"%s.hooks.cu\"\n", v->name);
    const char* tail = check_only  ? "\n#line 1 \"kvattn-variant-kernels\"\n#include \"kva_variant.cuh\"\n"
                       : mode == 2 ? "\n#line 1 \"kvattn-variant-kernels\"\n#include \"kva_prefill.cuh\"\n"
                                     "#include \"kva_variant.cuh\"\n"
                                   : "\n#line 1 \"kvattn-variant-kernels\"\n#include \"kva_decode.cuh\"\n"
                                     "#include \"kva_variant.cuh\"\n";
    size_t n = strlen(head) + strlen(pre) + strlen(line) + strlen(v->source) + strlen(tail) + 1;
    char* s = (char*)malloc(n);
    if (!s) return NULL;
    snprintf(s, n, "%s%s%s%s%s", head, pre, line, v->source, tail);
    return s;
}

/* The check's cache marker: a file named by the hash of its identity and holding the identity. */
static int kva__vcheck_hit(const char* file, const char* ident) {
    if (!kva__jit_file_safe(file)) return 0;
    int fd = open(file, O_RDONLY | O_NOFOLLOW);
    if (fd < 0) return 0;
    size_t il = strlen(ident);
    char* buf = (char*)malloc(il + 2);
    ssize_t got = buf ? read(fd, buf, il + 1) : -1;
    close(fd);
    int ok = got == (ssize_t)il && memcmp(buf, ident, il) == 0;
    free(buf);
    return ok;
}

static void kva__vcheck_store(const char* dir, const char* hash, const char* file, const char* ident) {
    const void* parts[1] = {ident};
    const size_t lens[1] = {strlen(ident)};
    kva__jit_publish(dir, hash, file, 1, parts, lens); /* a failed store only means a later check runs again */
}

kva_status kva__cuda_variant_check_compile(const kva_variant* v, const char* arch, const char* cache_dir) {
    const kva__nvrtc_api* nv = kva__nvrtc_load();
    KVA_RETURN_IF(!nv, KVA_ERR_UNSUPPORTED,
                  "kva_variant_create: the CUDA backend compiles variants with NVRTC, which could not be loaded");
    char* src = kva__cuda_variant_source(v, 1);
    KVA_RETURN_IF(!src, KVA_ERR_OUT_OF_MEMORY, "kva_variant_create: out of host memory");
    /* a check that passed before (same source, headers, NVRTC, arch, library) is remembered in the cache */
    char ident[512], hash[40], file[1200];
    {
        uint64_t h = kva__fnv(KVA__FNV_SEED, src, strlen(src) + 1);
        for (int i = 0; i < kva__num_kernel_sources; ++i)
            h = kva__fnv(h, kva__kernel_sources[i].text, strlen(kva__kernel_sources[i].text) + 1);
        snprintf(ident, sizeof ident, "kvattn %s|nvrtc %d.%d|%s|variant check %s|src %016llx", KVA_VERSION_STRING,
                 nv->major, nv->minor, arch, v->name, (unsigned long long)h);
        snprintf(hash, sizeof hash, "%016llx%016llx",
                 (unsigned long long)kva__fnv(KVA__FNV_SEED, ident, strlen(ident)),
                 (unsigned long long)kva__fnv(0x84222325cbf29ce4ull ^ 0x5bd1e995ull, ident, strlen(ident)));
        if (cache_dir && *cache_dir) {
            snprintf(file, sizeof file, "%s/%s.vcheck", cache_dir, hash);
            if (kva__vcheck_hit(file, ident)) {
                free(src);
                return KVA_OK;
            }
        }
    }
    if (kva__jit_disabled()) {
        free(src);
        return kva__set_error(KVA_ERR_UNSUPPORTED,
                              "kva_variant_create: variant %s has not been checked for %s before (no entry in the "
                              "kernel cache %s), and KVATTN_JIT=%s forbids compiling it at run time",
                              v->name, arch, cache_dir && *cache_dir ? cache_dir : "(none)", getenv("KVATTN_JIT"));
    }
    const char* hdr_names[16];
    const char* hdr_texts[16];
    int nh = kva__num_kernel_sources < 16 ? kva__num_kernel_sources : 16;
    for (int i = 0; i < nh; ++i) {
        hdr_names[i] = kva__kernel_sources[i].name;
        hdr_texts[i] = kva__kernel_sources[i].text;
    }
    char name[96];
    snprintf(name, sizeof name, "%s_check.cu", v->name);
    nvrtcProgram prog;
    nvrtcResult r = nv->CreateProgram(&prog, src, name, nh, hdr_texts, hdr_names);
    free(src);
    KVA_RETURN_IF(r != NVRTC_SUCCESS, KVA_ERR_JIT, "compiling variant %s: nvrtcCreateProgram failed: %s", v->name,
                  nv->GetErrorString(r));
    /* the virtual architecture: front end and PTX only, which is where a bad hook source fails */
    char a[64];
    snprintf(a, sizeof a, "--gpu-architecture=compute_%s", arch + (strncmp(arch, "sm_", 3) == 0 ? 3 : 0));
    const char* opts[3] = {a, "--std=c++17", "-DKVA_NVRTC=1"};
    r = nv->CompileProgram(prog, 3, opts);
    kva_status st = KVA_OK;
    if (r != NVRTC_SUCCESS) {
        size_t ls = 0;
        nv->GetProgramLogSize(prog, &ls);
        char* log = (char*)malloc(ls + 1);
        if (log) {
            log[0] = '\0';
            nv->GetProgramLog(prog, log);
            log[ls] = '\0';
        }
        st = kva__set_error(KVA_ERR_JIT, "kva_variant_create: compiling variant %s with NVRTC %d.%d failed (%s):\n%s",
                            v->name, nv->major, nv->minor, nv->GetErrorString(r), log ? log : "(no log)");
        free(log);
    }
    nv->DestroyProgram(&prog);
    if (st == KVA_OK && cache_dir && *cache_dir) kva__vcheck_store(cache_dir, hash, file, ident);
    return st;
}

void kva__kkey_set(kva__kkey* k, int family, int d, int qt, int kt, int ot, int rows, int rope, int warps) {
    memset(k, 0, sizeof *k);
    k->family = family;
    k->dqk = k->dvo = d;
    k->qt = qt;
    k->kt = kt;
    k->ot = ot;
    k->rows = rows;
    k->rope = rope;
    k->warps = warps;
}

/* one key of the enumeration (written only while it fits) */
static void kva__put_key(kva__kkey* keys, int max, int* n, int family, int d, int qt, int kt, int ot, int rows,
                         int rope, int warps) {
    if (*n < max) kva__kkey_set(&keys[*n], family, d, qt, kt, ot, rows, rope, warps);
    ++*n;
}

int kva__kkey_enumerate(kva__kkey* keys, int max) {
    static const int dims[] = {64, 128, 256};
    static const int qts[] = {KVA_DTYPE_F16, KVA_DTYPE_BF16};
    static const int kts[] = {KVA_DTYPE_F16, KVA_DTYPE_BF16, KVA_DTYPE_E4M3, KVA_DTYPE_E5M2};
    static const int ots[] = {KVA_DTYPE_F16, KVA_DTYPE_BF16, KVA_DTYPE_F32};
    static const int rows[] = {1, 2, 4, 8};
    int n = 0;
    kva__put_key(keys, max, &n, KVA__KF_UTIL, 0, 0, 0, 0, 0, 0, 0);
    for (int a = 0; a < 3; ++a)
        for (int b = 0; b < 2; ++b)
            for (int c = 0; c < 4; ++c)
                for (int e = 0; e < 3; ++e)
                    for (int r = 0; r < 4; ++r)
                        for (int rope = 0; rope < 2; ++rope)
                            kva__put_key(keys, max, &n, KVA__KF_DECODE, dims[a], qts[b], kts[c], ots[e], rows[r], rope,
                                         0);
    /* the tensor-core and head-group kernels take q = KV (16-bit), or fp8 KV (tensor-core: every head dim; head
       groups: 128); no RoPE */
    static const int fams[] = {KVA__KF_DECODE_TC, KVA__KF_DECODE_HG};
    for (int f = 0; f < 2; ++f)
        for (int a = 0; a < 3; ++a)
            for (int b = 0; b < 2; ++b)
                for (int c = 0; c < 4; ++c) {
                    const int fp8 = kva__is_fp8(kts[c]);
                    const int family = fams[f];
                    if ((!fp8 && kts[c] != qts[b]) || (fp8 && dims[a] != 128 && family != KVA__KF_DECODE_TC))
                        continue;
                    if (family == KVA__KF_DECODE_TC) {
                        /* 4 warps, and 8 warps (kva__cuda_want_8_warps) at head dim 128 and with fp8 KV */
                        for (int w = 4; w <= 8; w += 4) {
                            if (w == 8 && !(dims[a] == 128 || fp8)) continue;
                            for (int e = 0; e < 3; ++e)
                                for (int r = 0; r < 4; ++r) {
                                    if (w == 8 && dims[a] == 256 && rows[r] == 8) continue; /* 256 KB: 4 warps */
                                    kva__put_key(keys, max, &n, family, dims[a], qts[b], kts[c], ots[e], rows[r], 0,
                                                 w == 8 ? 8 : 0);
                                }
                        }
                    } else if (dims[a] != 256) {
                        /* head groups (kva__cuda_hg_key): head dims 64 and 128, 2 or 4 heads per item; TMA and
                           cp.async ("_ga") producers */
                        for (int e = 0; e < 3; ++e)
                            for (int hg = 2; hg <= 4; hg += 2)
                                for (int ga = 0; ga < 2; ++ga)
                                    for (int rs = 0; rs < 2; ++rs) { /* heads, or row slots ("_rs") */
                                        kva__put_key(keys, max, &n, family, dims[a], qts[b], kts[c], ots[e], hg, 0, 0);
                                        if (n <= max) keys[n - 1].mainloop = ga, keys[n - 1].hg_rs = rs;
                                    }
                    }
                }
    return n;
}

/* ---------------------------------------------------------------------------------------------- */
/* NVRTC                                                                                           */

#define KVA__MAX_OPTS 16

static int kva__jit_options(const kva__kkey* k, const char* arch, char (*store)[128], const char** opts) {
    int n = 0;
    snprintf(store[n], 128, "--gpu-architecture=%s", arch);
    opts[n] = store[n];
    ++n;
    snprintf(store[n], 128, "--std=c++17");
    opts[n] = store[n];
    ++n;
    snprintf(store[n], 128, "-DKVA_NVRTC=1");
    opts[n] = store[n];
    ++n;
    int nd = kva__kkey_defines(k, store + n, KVA__MAX_OPTS - n);
    for (int i = 0; i < nd; ++i) opts[n + i] = store[n + i];
    return n + nd;
}

kva_status kva__jit_compile(const kva__kkey* k, const char* arch, const char* extra_opt, void** cubin,
                            size_t* cubin_size, char** log_out) {
    const kva__nvrtc_api* nv = kva__nvrtc_load();
    if (!nv) return KVA_ERR_JIT;
    char name[128];
    kva__kkey_name(k, name, sizeof name);
    const char* hdr_names[16];
    const char* hdr_texts[16];
    int nh = kva__num_kernel_sources < 16 ? kva__num_kernel_sources : 16;
    for (int i = 0; i < nh; ++i) {
        hdr_names[i] = kva__kernel_sources[i].name;
        hdr_texts[i] = kva__kernel_sources[i].text;
    }
    nvrtcProgram prog;
    nvrtcResult r = nv->CreateProgram(&prog, kva__kkey_source(k), name, nh, hdr_texts, hdr_names);
    KVA_RETURN_IF(r != NVRTC_SUCCESS, KVA_ERR_JIT, "compiling %s: nvrtcCreateProgram failed: %s", name,
                  nv->GetErrorString(r));
    char store[KVA__MAX_OPTS][128];
    const char* opts[KVA__MAX_OPTS];
    int no = kva__jit_options(k, arch, store, opts);
    if (extra_opt && no < KVA__MAX_OPTS) opts[no++] = extra_opt;
    if (log_out) *log_out = NULL;
    r = nv->CompileProgram(prog, no, opts);
    if (r == NVRTC_SUCCESS && log_out) {
        size_t ls = 0;
        nv->GetProgramLogSize(prog, &ls);
        char* log = (char*)malloc(ls + 1);
        if (log) {
            log[0] = '\0';
            nv->GetProgramLog(prog, log);
            log[ls] = '\0';
        }
        *log_out = log;
    }
    if (r != NVRTC_SUCCESS) {
        size_t ls = 0;
        nv->GetProgramLogSize(prog, &ls);
        char* log = (char*)malloc(ls + 1);
        if (log) {
            log[0] = '\0';
            nv->GetProgramLog(prog, log);
            log[ls] = '\0';
        }
        kva_status st = kva__set_error(KVA_ERR_JIT, "compiling %s for %s with NVRTC %d.%d failed (%s):\n%s", name,
                                       arch, nv->major, nv->minor, nv->GetErrorString(r), log ? log : "(no log)");
        free(log);
        nv->DestroyProgram(&prog);
        return st;
    }
    size_t cs = 0;
    r = nv->GetCUBINSize(prog, &cs);
    void* buf = r == NVRTC_SUCCESS && cs > 0 ? malloc(cs) : NULL;
    if (!buf || nv->GetCUBIN(prog, (char*)buf) != NVRTC_SUCCESS) {
        free(buf);
        nv->DestroyProgram(&prog);
        return kva__set_error(KVA_ERR_JIT, "compiling %s for %s: NVRTC produced no CUBIN (%zu bytes)", name, arch, cs);
    }
    nv->DestroyProgram(&prog);
    *cubin = buf;
    *cubin_size = cs;
    return KVA_OK;
}

kva_status kva__jit_identity(const kva__kkey* k, const char* arch, char* ident, size_t ident_size, char* hash_hex,
                             size_t hash_size) {
    const kva__nvrtc_api* nv = kva__nvrtc_load();
    if (!nv) return KVA_ERR_JIT;
    uint64_t src = 0xcbf29ce484222325ull;
    for (int i = 0; i < kva__num_kernel_sources; ++i) {
        src = kva__fnv(src, kva__kernel_sources[i].name, strlen(kva__kernel_sources[i].name) + 1);
        src = kva__fnv(src, kva__kernel_sources[i].text, strlen(kva__kernel_sources[i].text) + 1);
    }
    const char* main_src = kva__kkey_source(k);
    src = kva__fnv(src, main_src, strlen(main_src) + 1);
    char store[KVA__MAX_OPTS][128];
    const char* opts[KVA__MAX_OPTS];
    int no = kva__jit_options(k, arch, store, opts);
    char name[128];
    kva__kkey_name(k, name, sizeof name);
    int len = snprintf(ident, ident_size, "kvattn %s|nvrtc %d.%d|%s|%s|src %016llx|opts", KVA_VERSION_STRING,
                       nv->major, nv->minor, arch, name, (unsigned long long)src);
    for (int i = 0; i < no && len > 0 && (size_t)len < ident_size; ++i)
        len += snprintf(ident + len, ident_size - (size_t)len, " %s", opts[i]);
    KVA_RETURN_IF(len < 0 || (size_t)len >= ident_size, KVA_ERR_INTERNAL, "JIT identity too long for %s", name);
    uint64_t h1 = kva__fnv(0xcbf29ce484222325ull, ident, (size_t)len);
    uint64_t h2 = kva__fnv(0x84222325cbf29ce4ull ^ 0x5bd1e995ull, ident, (size_t)len);
    snprintf(hash_hex, hash_size, "%016llx%016llx", (unsigned long long)h1, (unsigned long long)h2);
    return KVA_OK;
}

/* ---------------------------------------------------------------------------------------------- */
/* Disk cache                                                                                      */

/* An entry: header, identity, the kernel's main source text (a variant's whole source; compared byte for byte, so
   sources whose hashes in the identity collide never share an entry), payload. */
#define KVA__CACHE_MAGIC "KVACUBN2"

typedef struct kva__cache_hdr {
    char magic[8];
    uint32_t ident_len;
    uint32_t src_len;
    uint64_t payload_size;
    uint64_t payload_hash;
} kva__cache_hdr;

/* returns 1 and a malloc'd payload on a valid entry */
static int kva__cache_read(const char* file, const char* ident, const char* src, void** out, size_t* out_size) {
    int fd = open(file, O_RDONLY | O_NOFOLLOW);
    if (fd < 0) return 0;
    struct stat sb;
    int ok = 0;
    void* buf = NULL;
    if (fstat(fd, &sb) != 0 || !S_ISREG(sb.st_mode) || sb.st_uid != geteuid() || (sb.st_mode & (S_IWGRP | S_IWOTH)) ||
        sb.st_size < (off_t)sizeof(kva__cache_hdr) || sb.st_size > ((off_t)1 << 30))
        goto out;
    buf = malloc((size_t)sb.st_size);
    if (!buf) goto out;
    size_t got = 0;
    while (got < (size_t)sb.st_size) {
        ssize_t r = read(fd, (char*)buf + got, (size_t)sb.st_size - got);
        if (r <= 0) goto out;
        got += (size_t)r;
    }
    kva__cache_hdr h;
    memcpy(&h, buf, sizeof h);
    size_t il = strlen(ident), sl = strlen(src);
    if (memcmp(h.magic, KVA__CACHE_MAGIC, 8) != 0 || h.ident_len != il || h.src_len != sl ||
        h.payload_size > (uint64_t)sb.st_size || sizeof h + il + sl + h.payload_size != (size_t)sb.st_size ||
        memcmp((char*)buf + sizeof h, ident, il) != 0 || memcmp((char*)buf + sizeof h + il, src, sl) != 0)
        goto out;
    const char* payload = (const char*)buf + sizeof h + il + sl;
    if (kva__fnv(0xcbf29ce484222325ull, payload, h.payload_size) != h.payload_hash) goto out;
    void* res = malloc(h.payload_size);
    if (!res) goto out;
    memcpy(res, payload, h.payload_size);
    *out = res;
    *out_size = h.payload_size;
    ok = 1;
out:
    free(buf);
    close(fd);
    return ok;
}

static void kva__cache_write(const char* dir, const char* hash, const char* ident, const char* src, const void* data,
                             size_t size) {
    char dst[1200];
    if (snprintf(dst, sizeof dst, "%s/%s.cubin", dir, hash) >= (int)sizeof dst) return;
    kva__cache_hdr h;
    memset(&h, 0, sizeof h);
    memcpy(h.magic, KVA__CACHE_MAGIC, 8);
    const size_t il = strlen(ident), sl = strlen(src);
    if (il >= ((size_t)1 << 31) || sl >= ((size_t)1 << 31)) return;
    h.ident_len = (uint32_t)il;
    h.src_len = (uint32_t)sl;
    h.payload_size = size;
    h.payload_hash = kva__fnv(0xcbf29ce484222325ull, data, size);
    const void* parts[4] = {&h, ident, src, data};
    const size_t lens[4] = {sizeof h, il, sl, size};
    kva__jit_publish(dir, hash, dst, 4, parts, lens); /* a failed store only means a later compile */
}

kva_status kva__jit_cached(const kva_context* ctx, const char* cache_dir, const kva__kkey* k, const char* arch,
                           void** cubin, size_t* cubin_size, int* was_hit) {
    char ident[2048], hash[40], file[1200], name[128];
    KVA_FORWARD(kva__jit_identity(k, arch, ident, sizeof ident, hash, sizeof hash));
    kva__kkey_name(k, name, sizeof name);
    if (was_hit) *was_hit = 0;
    if (cache_dir && *cache_dir) {
        snprintf(file, sizeof file, "%s/%s.cubin", cache_dir, hash);
        if (kva__cache_read(file, ident, kva__kkey_source(k), cubin, cubin_size)) {
            if (was_hit) *was_hit = 1;
            kva__log(ctx, KVA_LOG_DEBUG, "kvattn: kernel %s (%s) from the cache %s", name, arch, file);
            return KVA_OK;
        }
    }
    if (kva__jit_disabled())
        return kva__set_error(KVA_ERR_UNSUPPORTED,
                              "CUDA backend: kernel %s for %s is neither prebuilt nor in the kernel cache (%s), and "
                              "KVATTN_JIT=%s forbids compiling it at run time",
                              name, arch, cache_dir && *cache_dir ? cache_dir : "none", getenv("KVATTN_JIT"));
    kva__log(ctx, KVA_LOG_INFO, "kvattn: compiling %s for %s (NVRTC; cache %s)...", name, arch,
             cache_dir && *cache_dir ? cache_dir : "disabled");
    kva_status st = kva__jit_compile(k, arch, NULL, cubin, cubin_size, NULL);
    if (st != KVA_OK) {
        kva__log(ctx, KVA_LOG_ERROR, "kvattn: %s", kva_last_error_message());
        return st;
    }
    if (cache_dir && *cache_dir) kva__cache_write(cache_dir, hash, ident, kva__kkey_source(k), *cubin, *cubin_size);
    return KVA_OK;
}

/* ---------------------------------------------------------------------------------------------- */
/* Kernel table                                                                                    */


kva_status kva__cuda_kernel(kva_context* ctx, kva__cuda_state* st, const kva__kkey* k, int* index) {
    const kva__cu_api* cu = st->cu;
    int n = __atomic_load_n(&st->num_kernels, __ATOMIC_ACQUIRE);
    for (int i = 0; i < n; ++i)
        if (kva__kkey_eq(&st->kernels[i].key, k)) {
            *index = i;
            return KVA_OK;
        }
    pthread_mutex_lock(&st->mu);
    kva_status status = KVA_OK;
    n = st->num_kernels;
    for (int i = 0; i < n; ++i)
        if (kva__kkey_eq(&st->kernels[i].key, k)) {
            *index = i;
            goto unlock;
        }
    if (n >= KVA__MAX_KERNELS) {
        status = kva__set_error(KVA_ERR_UNSUPPORTED, "CUDA backend: more than %d kernel variants in one context",
                                KVA__MAX_KERNELS);
        goto unlock;
    }
    {
        kva__kentry e;
        memset(&e, 0, sizeof e);
        e.key = *k;
        char name[128];
        kva__kkey_name(k, name, sizeof name);
        const int attn = k->family == KVA__KF_DECODE || k->family == KVA__KF_DECODE_TC ||
                         k->family == KVA__KF_DECODE_HG || k->family == KVA__KF_PREFILL;
        if (attn && st->aot && kva__aot_has(name)) {
            CUresult r = cu->ModuleGetFunction(&e.fn, st->aot, name);
            if (r != CUDA_SUCCESS) e.fn = NULL;
        }
        if (!e.fn) {
            void* cubin = NULL;
            size_t cs = 0;
            status = kva__jit_cached(ctx, st->cache_dir, k, st->arch, &cubin, &cs, NULL);
            if (status != KVA_OK) goto unlock;
            CUresult r = cu->ModuleLoadData(&e.module, cubin);
            free(cubin);
            if (r != CUDA_SUCCESS) {
                status = kva__cu_error(cu, r, "CUDA backend: loading a JIT-compiled kernel module");
                goto unlock;
            }
            r = cu->ModuleGetFunction(&e.fn, e.module, name);
            if (r == CUDA_SUCCESS && k->var_hash) {
                char mname[160];
                snprintf(mname, sizeof mname, "%s_merge", name);
                r = cu->ModuleGetFunction(&e.fn_vmerge, e.module, mname);
            }
            if (r != CUDA_SUCCESS) {
                cu->ModuleUnload(e.module);
                status = kva__cu_error(cu, r, "CUDA backend: kernel missing from its JIT module");
                goto unlock;
            }
        }
        if (attn) {
            size_t smem = kva__kkey_smem(k);
            if (k->family == KVA__KF_DECODE_TC && k->warps != 8 && st->cc == 90) {
                /* room for the cluster combine's buffers (KVK_FLAG_CLUSTER launches pass the larger size) */
                const size_t cc = KVA__TC_SMEM_CC(k->dqk, k->kt, k->rows);
                if (cc <= (size_t)st->max_smem_optin) smem = cc;
                /* clusters of 16 CTAs (KVATTN_CUDA_CLUSTER=16) are a non-portable size */
                (void)cu->FuncSetAttribute(e.fn, CU_FUNC_ATTRIBUTE_NON_PORTABLE_CLUSTER_SIZE_ALLOWED, 1);
            }
            CUresult r = cu->FuncSetAttribute(e.fn, CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, (int)smem);
            if (r != CUDA_SUCCESS) {
                if (e.module) cu->ModuleUnload(e.module);
                status = kva__cu_error(cu, r, "CUDA backend: cuFuncSetAttribute(MAX_DYNAMIC_SHARED_SIZE_BYTES)");
                goto unlock;
            }
            e.max_smem_set = (int)smem;
            /* the most shared memory per SM, so that two CTAs fit (a preference; ignored where unsupported) */
            (void)cu->FuncSetAttribute(e.fn, CU_FUNC_ATTRIBUTE_PREFERRED_SHARED_MEMORY_CARVEOUT, 100);
        }
        e.pdl = kva__cuda_func_pdl(st, e.fn) && (!e.fn_vmerge || kva__cuda_func_pdl(st, e.fn_vmerge));
        st->kernels[n] = e;
        __atomic_store_n(&st->num_kernels, n + 1, __ATOMIC_RELEASE);
        *index = n;
    }
unlock:
    pthread_mutex_unlock(&st->mu);
    return status;
}
