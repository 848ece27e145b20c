/*
 * kva_prefill_geom.h - geometry of the tensor-core attention kernel family (kva_prefill.cuh), shared by the
 * kernels and the host code that sizes shared memory (src/cuda/cuda_prefill.c). Plain C macros only.
 *
 * A CTA is 128 threads = 4 warps and executes work items of at most TQ packed query rows:
 *   TQ = 128: 4 warps x 32 rows (2 m16 blocks per warp), every warp sees the whole KV tile;
 *   TQ =  64: 4 warps x 16 rows;
 *   TQ =  16: 1 x 16 rows, the 4 warps split each KV tile (16 keys each) and merge their states at the end
 *             (decode with large GQA groups and short appends: K/V is read once per tile).
 * KV tiles of TKV tokens stream through STAGES shared-memory stages (cp.async). Head dim 256 uses TKV = 32 at
 * TQ 64 (the O accumulator alone takes 128 registers). TQ = 128 is not offered at head dim 256.
 *
 * Shared memory (bytes, in this order):
 *   region:  Q tile [TQ][D] 16-bit (swizzled) | STAGES x (K [TKV][D], V [TKV][D]) in the KV dtype
 *            (16-bit: swizzled; fp8: plain rows) | fp8 only: converted K and V [TKV][D] 16-bit (swizzled).
 *            After the mainloop the same bytes hold the epilogue's staging: per KV warp slice and row the
 *            unnormalised O (D + 8 floats, padded against bank conflicts), the running max and the sum.
 *   offsets: STAGES x TKV x (K byte offset, V byte offset) (i64; -1 = zero-fill the row), then STAGES x TKV
 *            prefetched page-table entries (i32, cp.async 2 * STAGES - 1 tiles ahead)
 *   rows:    per tile row: mask bit base (i64), q_pos, global query row, query head, ALiBi slope (24 bytes);
 *            then 128 bytes of item context (K/V base pointers, page table, KV range: read by the copy code after
 *            each barrier instead of occupying registers across the mainloop)
 *   freq:    RoPE inverse frequencies as (hi, lo) float pairs, D/2 each
 */
#ifndef KVA_PREFILL_GEOM_H
#define KVA_PREFILL_GEOM_H

#define KVK_PF_THREADS 128

#define KVK_PF_ES(kt) (((kt) == 3 || (kt) == 4) ? 1 : 2) /* bytes per KV element (e4m3 = 3, e5m2 = 4) */
#define KVK_PF_MQ(tq) ((tq) == 128 ? 2 : 1)               /* m16 row blocks per warp */
#define KVK_PF_WKV(tq) ((tq) == 16 ? 4 : 1)               /* warps sharing one KV tile's keys */
#define KVK_PF_WQ(tq) (4 / KVK_PF_WKV(tq))                /* warps along the rows */
#define KVK_PF_TKV(d, tq) (((d) == 256 && (tq) != 16) ? 32 : 64)

/* Pipeline depth. Chosen so that every instance but head dim 256 at TQ 16 fits two CTAs per SM on sm_80 / sm_90
   (<= ~110 KB each); see the table in docs/kernels/prefill.md. */
#define KVK_PF_STAGES(d, tq, es)                                                              \
    ((d) == 64 ? ((tq) == 16 ? 4 : 3)                                                         \
               : ((d) == 128 ? ((tq) == 16 ? ((es) == 1 ? 4 : 3) : (((tq) == 64 && (es) == 1) ? 3 : 2)) : 2))

#define KVK_PF_Q_BYTES(d, tq) ((tq) * (d) * 2)
#define KVK_PF_STAGE_BYTES(d, tq, es) (2 * KVK_PF_TKV(d, tq) * (d) * (es))
#define KVK_PF_CONV_BYTES(d, tq, es) ((es) == 1 ? 2 * KVK_PF_TKV(d, tq) * (d) * 2 : 0)
#define KVK_PF_MAIN_BYTES(d, tq, es) \
    (KVK_PF_Q_BYTES(d, tq) + KVK_PF_STAGES(d, tq, es) * KVK_PF_STAGE_BYTES(d, tq, es) + KVK_PF_CONV_BYTES(d, tq, es))
#define KVK_PF_EPI_LD(d) ((d) + 8) /* floats per staged O row */
#define KVK_PF_EPI_BYTES(d, tq) (KVK_PF_WKV(tq) * (tq) * KVK_PF_EPI_LD(d) * 4 + 2 * KVK_PF_WKV(tq) * (tq) * 4)
#define KVK_PF_REGION(d, tq, es)                                                                  \
    (KVK_PF_MAIN_BYTES(d, tq, es) > KVK_PF_EPI_BYTES(d, tq) ? KVK_PF_MAIN_BYTES(d, tq, es)       \
                                                            : KVK_PF_EPI_BYTES(d, tq))
#define KVK_PF_OFFS_BYTES(d, tq, es) (KVK_PF_STAGES(d, tq, es) * KVK_PF_TKV(d, tq) * 20)
#define KVK_PF_ROW_BYTES(tq) ((tq) * 24 + 128) /* + the item context (pointers and bounds) */
#define KVK_PF_FREQ_BYTES(d) ((d) * 4)

#define KVK_PF_OFF_OFFS(d, tq, es) (((KVK_PF_REGION(d, tq, es) + 127) / 128) * 128)
#define KVK_PF_OFF_ROWS(d, tq, es) (KVK_PF_OFF_OFFS(d, tq, es) + KVK_PF_OFFS_BYTES(d, tq, es))
#define KVK_PF_OFF_FREQ(d, tq, es) (KVK_PF_OFF_ROWS(d, tq, es) + KVK_PF_ROW_BYTES(tq))
/* dynamic shared memory of an instance */
#define KVK_PF_SMEM(d, tq, es) (KVK_PF_OFF_FREQ(d, tq, es) + KVK_PF_FREQ_BYTES(d))

/* kernel tile (instance TQ) that executes a plan's tile_q (0 = none: tile_q above the head dim's maximum) */
#define KVK_PF_MAX_TQ(d) ((d) == 256 ? 64 : 128)
#define KVK_PF_KERNEL_TQ(d, tile_q) \
    ((tile_q) <= 16 ? 16 : ((tile_q) <= 64 ? 64 : ((tile_q) <= KVK_PF_MAX_TQ(d) ? 128 : 0)))

/* ---- Hopper mainloop (KVA_MAINLOOP = 1, sm_90a: wgmma) ----
 * A CTA is 384 threads = 3 warpgroups: warpgroup 0 copies K/V tiles (cp.async, completion on mbarriers), warpgroups
 * 1 and 2 each own 64 of the 128 tile rows and run S = Q K^T (Q and K from shared memory) and O += P V (P from
 * registers, V from shared memory) as warpgroup MMAs. One CTA per SM (the plan's 2 x SMs workers run in two waves).
 * Shared memory (bytes, in this order; the kernel aligns its base to 1024 bytes, hence the extra 1024):
 *   region:  Q [128][D] | STAGES x (K [TKV][D], V [TKV][D]), 16-bit, each in the 128-byte swizzled layout of the
 *            warpgroup MMA: column block b (64 elements) at b * rows * 128, row r at r * 128 within it, 16-byte
 *            chunk c at (c ^ (r & 7)) * 16. (No staging: the consumers' epilogue writes from registers.)
 *   offsets, rows, freq: as for the mma.sync mainloop. */
#define KVK_PFW_THREADS 384   /* warpgroup 0 copies K/V (producer), warpgroups 1 and 2 compute (consumers) */
#define KVK_PFW_CONSUMERS 256
#define KVK_PFW_TQ 128
#define KVK_PFW_TKV(d) ((d) == 256 ? 64 : 128)
#define KVK_PFW_STAGES(d) 2 /* K and V rings of 2 slots each */
#define KVK_PFW_RING 2      /* row-offset ring (the producer's) */
#define KVK_PFW_Q_BYTES(d) (KVK_PFW_TQ * (d) * 2)
#define KVK_PFW_STAGE_BYTES(d) (2 * KVK_PFW_TKV(d) * (d) * 2)
#define KVK_PFW_MAIN_BYTES(d) (KVK_PFW_Q_BYTES(d) + KVK_PFW_STAGES(d) * KVK_PFW_STAGE_BYTES(d))
#define KVK_PFW_OFF_OFFS(d) (((KVK_PFW_MAIN_BYTES(d) + 127) / 128) * 128)
/* per ring slot and row: K and V byte offsets (8 + 8) and their 16-byte-unit forms for the fast copy path (4 + 4) */
#define KVK_PFW_OFF_ROWS(d) (KVK_PFW_OFF_OFFS(d) + KVK_PFW_RING * KVK_PFW_TKV(d) * 24)
#define KVK_PFW_OFF_FREQ(d) (KVK_PFW_OFF_ROWS(d) + KVK_PF_ROW_BYTES(KVK_PFW_TQ))
/* 8 mbarriers of the K/V slots (64 bytes), then those of the Q slots (full[2] +0, empty[2] +16), the request fault
   words (+32), the worker's end (+40) and the producer's request-check cache (+44) (48 bytes); then Q slot 1
   (1024-aligned) and its row facts: the producer fills slot (item count & 1) with the next item's Q, row facts and
   item facts while the consumers compute */
#define KVK_PFW_OFF_BAR(d) (KVK_PFW_OFF_FREQ(d) + KVK_PF_FREQ_BYTES(d))
#define KVK_PFW_OFF_QBAR(d) (KVK_PFW_OFF_BAR(d) + 64)
#define KVK_PFW_OFF_Q2(d) (((KVK_PFW_OFF_QBAR(d) + 48 + 1023) / 1024) * 1024)
#define KVK_PFW_OFF_ROWS2(d) (KVK_PFW_OFF_Q2(d) + KVK_PFW_Q_BYTES(d))
#define KVK_PFW_SMEM(d) (KVK_PFW_OFF_ROWS2(d) + KVK_PF_ROW_BYTES(KVK_PFW_TQ) + 1024)

#endif /* KVA_PREFILL_GEOM_H */
