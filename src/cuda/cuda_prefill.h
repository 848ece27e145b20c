/*
 * cuda_prefill.h - host side of the tensor-core attention kernel family (src/kernels/kva_prefill.cuh): which
 * descriptors and tiles it supports, the tile-size heuristic, and how an instance is named, specialised for NVRTC
 * and sized. Everything here is pure (no driver call), so it is unit-tested without a GPU.
 *
 * Keys reuse kva__kkey (cuda_internal.h) with family KVA__KF_PREFILL and rows = the kernel's tile TQ (16, 64, 128).
 * A plan's tile_q (packed rows per work item, <= 128) runs on the smallest TQ >= tile_q; partial slots keep the
 * plan's tile_q rows (the kernel reads kvk_attn_params.tile_q for them).
 *
 * Launch: grid = the plan's worker count (persistent, same work list as the CUDA-core kernel), block =
 * KVK_PF_THREADS (128, = KVK_THREADS), dynamic shared memory = kva__cuda_prefill_smem(key) (above 48 KB: raise
 * CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES first), parameter block = kvk_attn_params filled exactly as for
 * the decode kernel; the plan-merge kernel (kva_merge_partials) merges split-KV partials as before.
 */
#ifndef KVA_CUDA_PREFILL_H
#define KVA_CUDA_PREFILL_H

#include <stddef.h>
#include <stdint.h>

#include "cuda_internal.h"
#include "../kernels/kva_prefill_geom.h"

#ifdef __cplusplus
extern "C" {
#endif

#define KVA__KF_PREFILL 3 /* kva__kkey.family of kva_prefill.cuh instances */

/* Packed query rows per tile for a batch (the planner's choose_tile_q): a small pure heuristic.
 *   avg_packed_qo_len <= 16: 16  (decode with GQA groups up to 16, short appends, speculative decode)
 *                     <= 64: 64
 *                     else:  128 (64 at head dim 256, whose accumulators leave no room for 32 rows per warp)
 * then lowered while the instance does not fit max_smem_optin bytes of shared memory (0 = no limit). Returns 0
 * when no tile fits. Why these cuts: a CTA's 4 warps own 16 (TQ 64) or 32 (TQ 128) rows each and load every K/V
 * tile once per CTA, so bigger tiles read K/V fewer times; below 16 rows per tile the m16 MMA rows are padding
 * anyway, and TQ 16 splits the KV tile over the 4 warps instead. */
int32_t kva__cuda_prefill_tile_q(const kva_attention_desc* d, kva_op op, double avg_packed_qo_len,
                                 int32_t max_packed_qo_len, int max_smem_optin);

/* Is (desc, op, tile_q) supported by this family on a device with max_smem_optin bytes of opt-in shared memory
 * per block (0 = do not check)? Returns 1, or 0 with the reason in why (may be NULL). This is the one place that
 * answers "supported?"; kva__cuda_prefill_select answers "which kernel?" with the same checks. */
int kva__cuda_prefill_supported(const kva_attention_desc* d, kva_op op, int32_t tile_q, int max_smem_optin, char* why,
                                size_t why_size);

/* The kernel key and its dynamic shared memory for (desc, op, tile_q). KVA_ERR_UNSUPPORTED (message set) when
 * kva__cuda_prefill_supported says no. */
kva_status kva__cuda_prefill_select(const kva_attention_desc* d, kva_op op, int32_t tile_q, int max_smem_optin,
                                    kva__kkey* key, size_t* smem);

/* Whether batch decode should use this family rather than the decode families (a heuristic to confirm on the
 * GPU): GQA groups above 8 rows, which the decode kernels split into several tiles of <= 8 rows (each reading the
 * KV again), run as one 16- or 64-row tile here. */
int kva__cuda_prefill_prefer_for_decode(const kva_attention_desc* d);

/* "kva_pf_d128_qbf16_kvbf16_obf16_t128_rope0" ("_nochk" appended for benchmark keys with nochk bit 0) */
void kva__cuda_prefill_name(const kva__kkey* k, char* buf, size_t size);
/* NVRTC -D options of a key (8, or 9 with -DKVA_NO_BOUNDS_CHECK=1 for nochk bit 0); returns the count written
 * (0 if max < 8) */
int kva__cuda_prefill_defines(const kva__kkey* k, char (*defs)[128], int max);
/* Main NVRTC source of every instance */
const char* kva__cuda_prefill_source(void);
/* Dynamic shared memory of a key's kernel (bytes) */
size_t kva__cuda_prefill_smem(const kva__kkey* k);
/* Threads per CTA of a key's kernel (128; 384 for the Hopper mainloop) */
int kva__cuda_prefill_threads(const kva__kkey* k);
/* The Hopper mainloop (KVA_MAINLOOP = 1, "kva_pfw_*": warpgroup MMA, sm_90a only) takes a tensor-core attention key
 * when the device is compute capability 9.0 (cc = 90), the tile is 128 rows, the head dim 64 or 128, q and KV share
 * one 16-bit dtype, there is no fused RoPE and no user variant, and its shared memory fits max_smem_optin (0 = do not
 * check). kva__cuda_prefill_wg_ok answers; kva__cuda_prefill_upgrade sets key->mainloop and *smem accordingly and
 * leaves everything else (the plan's tile, the work list, the merge) unchanged. With alibi_fold (the descriptor has
 * ALiBi and no soft cap) it takes the instance that folds ALiBi's bias into the S accumulators (key->alibi_fold). */
int kva__cuda_prefill_wg_ok(const kva__kkey* k, int cc, int max_smem_optin);
void kva__cuda_prefill_upgrade(kva__kkey* k, size_t* smem, int cc, int max_smem_optin, int alibi_fold);
/* Every key of the family (3 head dims x 2 q x 4 KV x 3 o dtypes x tiles x RoPE = 384 mma.sync keys, then 24 keys
 * of the Hopper mainloop: head dim 64 / 128 x q = KV f16 / bf16 x 3 o dtypes x ALiBi folded or not): fills up to
 * max, returns the total */
int kva__cuda_prefill_enumerate(kva__kkey* keys, int max);
/* The prebuilt (AOT) subset: bf16 and f16 at head dim 128 (KV: same dtype or e4m3), bf16 at 64 and 256, every
 * tile, no RoPE; Hopper mainloop: bf16 and f16 at head dim 128, bf16 at 64, and bf16 at 128 with ALiBi folded. Fills up to max keys, returns the total. src/cuda/prefill.cmake lists the same set. */
int kva__cuda_prefill_aot_keys(kva__kkey* keys, int max);

#ifdef __cplusplus
}
#endif

#endif /* KVA_CUDA_PREFILL_H */
