/*
 * planner.c - the load-balanced planner (paper Algorithm 1, docs/design.md section 3). Pure C, no CUDA.
 *
 * From host arrays of query and KV lengths it builds:
 *   tiles:  per (request, KV head, query tile of tile_q packed rows) the visible KV range [lo, hi)
 *           (causal and sliding window clip it; GQA heads of a group are packed into rows);
 *   chunks: each tile's range split into chunks of at most L tokens, L = max(128, ceil(sum / W)) rounded to 16,
 *           raised to the smallest L with at most W items when that shortens the longest worker (or a fixed
 *           size, or no split);
 *   assignment: chunks sorted longest first (cost = len + 2 * rows), each given to the least-loaded worker
 *           (min-heap, ties to the lowest worker id): deterministic for the same lengths;
 *   merge map: the chunks of a split tile write consecutive partial slots; one merge task per split tile.
 * Everything is written at fixed offsets into the caller's workspace (see internal.h).
 */
#include <limits.h>
#include <stdlib.h>
#include <string.h>

#include "internal.h"

#define KVA__CHUNK_ALIGN 16

typedef struct kva__tile {
    int32_t req;
    int32_t row_start;
    int32_t rows;
    int32_t lo, hi;
    int32_t nchunks;
    int32_t chunk_len; /* chunk size used for this tile (tokens) */
    int32_t slot_base; /* first partial slot of the tile's head 0 (split tiles), -1 otherwise */
} kva__tile;

/* A unit of the plan spans kv_head_group KV heads (1 unless the backend reads groups of heads together): the planner
 * sees num_kv_heads / G heads of G x g packed rows each. */
static int64_t kva__unit_heads(const kva__plan_data* pd) { return pd->desc.num_kv_heads / pd->kv_head_group; }
static int32_t kva__unit_group(const kva__plan_data* pd) { return pd->group_size * pd->kv_head_group; }

/* Scratch for one planning call: growable buffers, borrowed from the context when free (no allocation and no
 * page faults in the steady state), else owned by the call. */
enum { KVA__S_LEN, KVA__S_TILES, KVA__S_ITEMS, KVA__S_COST, KVA__S_ORDER, KVA__S_OWNER, KVA__S_WORKERS, KVA__S_SEQ,
       KVA__S_NUM };

typedef struct kva__plan_scratch {
    void** buf;
    size_t* cap;
    void* own_buf[KVA__S_NUM];
    size_t own_cap[KVA__S_NUM];
    kva_context* borrowed_from;
    int32_t* qo_len;
    int32_t* kv_len;
    int32_t* kv_start; /* paged: request b's first page-table entry (kv_indptr[b], or b x block_table_stride) */
    int64_t* mask_off;
    kva__tile* tiles;
    int64_t ntiles;
} kva__plan_scratch;

static void kva__scratch_open(kva__plan_scratch* s, kva_context* ctx) {
    memset(s, 0, sizeof *s);
    if (__atomic_exchange_n(&ctx->plan_scratch_busy, 1, __ATOMIC_ACQUIRE) == 0) {
        s->borrowed_from = ctx;
        s->buf = ctx->plan_scratch;
        s->cap = ctx->plan_scratch_cap;
    } else {
        s->buf = s->own_buf;
        s->cap = s->own_cap;
    }
}

static void* kva__scratch_get(kva__plan_scratch* s, int slot, size_t bytes) {
    if (bytes == 0) bytes = 64;
    if (s->cap[slot] < bytes) {
        size_t want = bytes + bytes / 2;
        void* p = realloc(s->buf[slot], want);
        if (!p) return NULL;
        s->buf[slot] = p;
        s->cap[slot] = want;
    }
    return s->buf[slot];
}

static void kva__scratch_free(kva__plan_scratch* s) {
    if (s->borrowed_from) {
        __atomic_store_n(&s->borrowed_from->plan_scratch_busy, 0, __ATOMIC_RELEASE);
    } else {
        for (int i = 0; i < KVA__S_NUM; ++i) free(s->own_buf[i]);
    }
    memset(s, 0, sizeof *s);
}

/* ---------------------------------------------------------------------------------------------- */
/* Validation of the host arrays                                                                   */

static kva_status kva__validate_params(const kva_attention_desc* d, kva_op op, const kva_plan_params* p,
                                       kva__plan_scratch* s, int64_t* total_rows_out, int64_t* total_kv_out,
                                       int64_t* page_entries_out, int64_t* mask_bytes_out, int32_t* max_qo_out,
                                       int32_t* max_kv_out) {
    const int32_t B = p->batch_size;
    KVA_RETURN_IF(B < 0, KVA_ERR_INVALID_ARGUMENT, "params->batch_size = %d is negative", (int)B);
    const bool paged = op != KVA_OP_BATCH_PREFILL_RAGGED;
    if (op == KVA_OP_BATCH_DECODE) {
        if (p->qo_indptr) {
            for (int32_t b = 0; b <= B; ++b)
                KVA_RETURN_IF(p->qo_indptr[b] != b, KVA_ERR_INVALID_ARGUMENT,
                              "params->qo_indptr[%d] = %d: batch decode has exactly one query row per request "
                              "(use KVA_OP_BATCH_PREFILL_PAGED for several rows)",
                              (int)b, (int)p->qo_indptr[b]);
        }
    } else {
        KVA_RETURN_IF(!p->qo_indptr, KVA_ERR_INVALID_ARGUMENT, "params->qo_indptr is NULL (required for prefill ops)");
    }
    /* the block-table form (kv_seq_lens + block_table_stride) in place of kv_indptr / kv_last_page_len */
    const bool bt = p->kv_seq_lens != NULL;
    KVA_RETURN_IF(bt && !paged, KVA_ERR_INVALID_ARGUMENT,
                  "params->kv_seq_lens (the block-table form) is for paged ops; ragged KV takes kv_indptr");
    KVA_RETURN_IF(!bt && !p->kv_indptr, KVA_ERR_INVALID_ARGUMENT,
                  "params->kv_indptr is NULL (give kv_indptr, or kv_seq_lens and block_table_stride for a block "
                  "table)");
    if (paged) {
        KVA_RETURN_IF(p->page_size < 1, KVA_ERR_INVALID_ARGUMENT, "params->page_size = %d must be >= 1",
                      (int)p->page_size);
        KVA_RETURN_IF(!bt && B > 0 && !p->kv_last_page_len, KVA_ERR_INVALID_ARGUMENT,
                      "params->kv_last_page_len is NULL (required for paged ops)");
        KVA_RETURN_IF(bt && B > 0 && p->block_table_stride < 1, KVA_ERR_INVALID_ARGUMENT,
                      "params->block_table_stride = %d must be >= 1 with kv_seq_lens (the block-table form)",
                      (int)p->block_table_stride);
        KVA_RETURN_IF(bt && (int64_t)B * p->block_table_stride > INT32_MAX, KVA_ERR_UNSUPPORTED,
                      "params: a block table of %d rows x block_table_stride %d has more than 2^31 - 1 entries",
                      (int)B, (int)p->block_table_stride);
        KVA_RETURN_IF(p->num_pages < 0, KVA_ERR_INVALID_ARGUMENT, "params->num_pages = %lld is negative",
                      (long long)p->num_pages);
    }
    KVA_RETURN_IF(p->fixed_split_size < 0, KVA_ERR_INVALID_ARGUMENT, "params->fixed_split_size = %d is negative",
                  (int)p->fixed_split_size);

    size_t n = (size_t)(B > 0 ? B : 1);
    char* lens = (char*)kva__scratch_get(s, KVA__S_LEN, n * (sizeof(int32_t) * 3 + sizeof(int64_t)));
    KVA_RETURN_IF(!lens, KVA_ERR_OUT_OF_MEMORY, "plan: out of host memory");
    s->mask_off = (int64_t*)(void*)lens;
    s->qo_len = (int32_t*)(void*)(lens + n * sizeof(int64_t));
    s->kv_len = s->qo_len + n;
    s->kv_start = s->kv_len + n;

    KVA_RETURN_IF(p->qo_indptr && p->qo_indptr[0] != 0, KVA_ERR_PAGETABLE_MALFORMED,
                  "params->qo_indptr[0] = %d, expected 0", (int)p->qo_indptr[0]);
    KVA_RETURN_IF(!bt && p->kv_indptr[0] != 0, KVA_ERR_PAGETABLE_MALFORMED, "params->kv_indptr[0] = %d, expected 0",
                  (int)p->kv_indptr[0]);
    int64_t total_rows = 0, total_kv = 0, mask_bytes = 0, bt_entries = 0;
    int32_t max_qo = 0, max_kv = 0;
    for (int32_t b = 0; b < B; ++b) {
        int32_t qo = 1;
        if (p->qo_indptr) {
            int64_t q = (int64_t)p->qo_indptr[b + 1] - p->qo_indptr[b];
            KVA_RETURN_IF(q < 0, KVA_ERR_PAGETABLE_MALFORMED,
                          "params->qo_indptr decreases at %d: qo_indptr[%d] = %d > qo_indptr[%d] = %d", (int)b + 1,
                          (int)b, (int)p->qo_indptr[b], (int)b + 1, (int)p->qo_indptr[b + 1]);
            qo = (int32_t)q;
        }
        int64_t kv;
        if (bt) {
            kv = p->kv_seq_lens[b];
            KVA_RETURN_IF(kv < 0, KVA_ERR_PAGETABLE_MALFORMED, "params->kv_seq_lens[%d] = %lld is negative", (int)b,
                          (long long)kv);
            const int64_t np = (kv + p->page_size - 1) / p->page_size;
            KVA_RETURN_IF(np > p->block_table_stride, KVA_ERR_PAGETABLE_MALFORMED,
                          "params->kv_seq_lens[%d] = %lld tokens need %lld pages of %d, more than a block-table row "
                          "holds (block_table_stride = %d)",
                          (int)b, (long long)kv, (long long)np, (int)p->page_size, (int)p->block_table_stride);
            s->kv_start[b] = b * p->block_table_stride;
            if (np > 0 && s->kv_start[b] + np > bt_entries) bt_entries = s->kv_start[b] + np;
        } else {
            const int64_t e = (int64_t)p->kv_indptr[b + 1] - p->kv_indptr[b];
            KVA_RETURN_IF(e < 0, KVA_ERR_PAGETABLE_MALFORMED,
                          "params->kv_indptr decreases at %d: kv_indptr[%d] = %d > kv_indptr[%d] = %d", (int)b + 1,
                          (int)b, (int)p->kv_indptr[b], (int)b + 1, (int)p->kv_indptr[b + 1]);
            s->kv_start[b] = p->kv_indptr[b];
            if (!paged || e == 0) {
                kv = e; /* ragged: tokens; paged: no page, no token */
            } else {
                int32_t lpl = p->kv_last_page_len[b];
                KVA_RETURN_IF(lpl < 1 || lpl > p->page_size, KVA_ERR_PAGETABLE_MALFORMED,
                              "params->kv_last_page_len[%d] = %d must be in [1, page_size = %d] for a request "
                              "with %lld pages",
                              (int)b, (int)lpl, (int)p->page_size, (long long)e);
                kv = (e - 1) * (int64_t)p->page_size + lpl;
            }
        }
        KVA_RETURN_IF(kv > INT32_MAX / 2, KVA_ERR_UNSUPPORTED, "request %d has %lld KV tokens (more than 2^30)",
                      (int)b, (long long)kv);
        s->qo_len[b] = qo;
        s->kv_len[b] = (int32_t)kv;
        s->mask_off[b] = mask_bytes;
        if (d->mask_mode == KVA_MASK_CUSTOM) mask_bytes += ((int64_t)qo * kv + 7) / 8;
        total_rows += qo;
        total_kv += kv;
        if (qo > max_qo) max_qo = qo;
        if (kv > max_kv) max_kv = (int32_t)kv;
    }
    KVA_RETURN_IF(total_rows > INT32_MAX / 2 || total_rows * (int64_t)d->num_qo_heads > INT32_MAX,
                  KVA_ERR_UNSUPPORTED, "the batch has %lld query rows x %d heads (more than 2^31 packed rows)",
                  (long long)total_rows, (int)d->num_qo_heads);
    if (paged) {
        /* the block-table form: entries up to the last used one (a row's unused tail is neither read nor checked) */
        int64_t entries = bt ? bt_entries : p->kv_indptr[B];
        KVA_RETURN_IF(entries > 0 && p->kv_indices && p->num_pages < 1, KVA_ERR_INVALID_ARGUMENT,
                      "params->num_pages = %lld: a host copy of the page table (kv_indices) is checked against the "
                      "pool size, so num_pages is required with it",
                      (long long)p->num_pages);
        if (bt && p->kv_indices) {
            for (int32_t b = 0; b < B; ++b) {
                const int64_t np = ((int64_t)s->kv_len[b] + p->page_size - 1) / p->page_size;
                const int32_t* row = p->kv_indices + s->kv_start[b];
                for (int64_t j = 0; j < np; ++j)
                    if (KVA_UNLIKELY(row[j] < 0 || row[j] >= p->num_pages))
                        return kva__set_error(KVA_ERR_PAGE_INDEX_OUT_OF_RANGE,
                                              "params->kv_indices[%lld] = %d (block table row %d, page %lld) is "
                                              "outside the pool [0, %lld)",
                                              (long long)(s->kv_start[b] + j), (int)row[j], (int)b, (long long)j,
                                              (long long)p->num_pages);
            }
        } else if (p->kv_indices) {
            /* A branch-free min/max pass (vectorised); the slow scan below only runs to name a bad entry. */
            int32_t lo = INT32_MAX, hi = INT32_MIN;
            const int32_t* ix = p->kv_indices;
            for (int64_t i = 0; i < entries; ++i) {
                lo = ix[i] < lo ? ix[i] : lo;
                hi = ix[i] > hi ? ix[i] : hi;
            }
            for (int64_t i = 0; (entries > 0 && (lo < 0 || hi >= p->num_pages)) && i < entries; ++i) {
                int32_t pg = p->kv_indices[i];
                if (KVA_UNLIKELY(pg < 0 || pg >= p->num_pages)) {
                    int32_t req = 0;
                    while (req + 1 <= B && p->kv_indptr[req + 1] <= i) ++req;
                    return kva__set_error(KVA_ERR_PAGE_INDEX_OUT_OF_RANGE,
                                          "params->kv_indices[%lld] = %d (request %d) is outside the pool [0, %lld)",
                                          (long long)i, (int)pg, (int)req, (long long)p->num_pages);
                }
            }
        }
        *page_entries_out = entries;
    } else {
        *page_entries_out = 0;
    }
    *total_rows_out = total_rows;
    *total_kv_out = total_kv;
    *mask_bytes_out = mask_bytes;
    *max_qo_out = max_qo;
    *max_kv_out = max_kv;
    return KVA_OK;
}

/* ---------------------------------------------------------------------------------------------- */
/* Layout                                                                                          */

typedef struct kva__caps {
    int32_t batch;
    int32_t items;
    int32_t merge;
    int32_t partials;
} kva__caps;

static void kva__layout(kva__plan_data* pd, const kva__caps* c, bool host_staging, size_t head_bytes) {
    size_t off = KVA__STATUS_BYTES;
    pd->off_counts = off;
    off = kva__align_up(off + sizeof(kva__counts), KVA__WS_ALIGN);
    pd->off_worker_indptr = off;
    off = kva__align_up(off + sizeof(int32_t) * (size_t)(pd->num_workers + 1), KVA__WS_ALIGN);
    pd->off_worker_head = 0;
    if (head_bytes > 0) {
        pd->off_worker_head = off;
        off = kva__align_up(off + head_bytes * (size_t)pd->num_workers, KVA__WS_ALIGN);
    }
    pd->off_requests = off;
    off = kva__align_up(off + sizeof(kva__request) * (size_t)c->batch, KVA__WS_ALIGN);
    pd->off_items = off;
    off = kva__align_up(off + sizeof(kva__work_item) * (size_t)c->items, KVA__WS_ALIGN);
    pd->off_merge = off;
    off = kva__align_up(off + sizeof(kva__merge_task) * (size_t)c->merge, KVA__WS_ALIGN);
    pd->int_region_end = off;
    pd->off_partial_o = off;
    off = kva__align_up(off + sizeof(float) * (size_t)c->partials * (size_t)pd->tile_q * (size_t)pd->desc.head_dim_vo,
                        KVA__WS_ALIGN);
    pd->off_partial_lse = off;
    off = kva__align_up(off + sizeof(float) * (size_t)c->partials * (size_t)pd->tile_q, KVA__WS_ALIGN);
    pd->device_bytes = off;
    pd->host_bytes = host_staging ? pd->int_region_end : 0;
    pd->cap_items = c->items;
    pd->cap_merge = c->merge;
    pd->cap_partials = c->partials;
    pd->max_batch_size = c->batch;
}

/* Capacities that hold for every batch under the bounds (graph mode and kva_workspace_bound):
 *   tiles  <= Hkv * (ceil(max_rows * g / T) + max_batch)        (each request adds at most one partial tile)
 *   split chunks <= 2W: every split tile has > L tokens and sum of tokens <= W * L, so there are at most W split
 *   tiles and at most W + (#split tiles) chunks among them; merge tasks <= W. */
static kva__caps kva__bound_caps(const kva__plan_data* pd, int32_t max_batch, int64_t max_rows) {
    kva__caps c;
    int64_t W = pd->num_workers, T = pd->tile_q, g = kva__unit_group(pd), H = kva__unit_heads(pd);
    int64_t tiles = H * (kva__ceil_div64(max_rows * g, T) + max_batch);
    c.batch = max_batch;
    int64_t items = tiles + 2 * W;
    c.items = items > INT32_MAX ? INT32_MAX : (int32_t)items;
    c.merge = (int32_t)W;
    c.partials = (int32_t)(2 * W);
    return c;
}

/* ---------------------------------------------------------------------------------------------- */
/* Tiles and chunks                                                                                */

static kva_status kva__make_tiles(const kva__plan_data* pd, int32_t B, kva__plan_scratch* s) {
    const int32_t g = kva__unit_group(pd), T = pd->tile_q;
    int64_t n = 0;
    for (int32_t b = 0; b < B; ++b) n += kva__ceil_div64((int64_t)s->qo_len[b] * g, T);
    s->ntiles = n;
    s->tiles = (kva__tile*)kva__scratch_get(s, KVA__S_TILES, sizeof(kva__tile) * (size_t)(n > 0 ? n : 1));
    KVA_RETURN_IF(!s->tiles, KVA_ERR_OUT_OF_MEMORY, "plan: out of host memory (%lld tiles)", (long long)n);
    const kva_attention_desc* d = &pd->desc;
    int64_t k = 0;
    for (int32_t b = 0; b < B; ++b) {
        const int32_t qo = s->qo_len[b], kv = s->kv_len[b];
        const int64_t packed = (int64_t)qo * g;
        for (int64_t r0 = 0; r0 < packed; r0 += T) {
            kva__tile* t = &s->tiles[k++];
            int32_t rows = (int32_t)(packed - r0 < T ? packed - r0 : T);
            int64_t i_first = r0 / g, i_last = (r0 + rows - 1) / g;
            int64_t qpos_first = (int64_t)kv - qo + i_first, qpos_last = (int64_t)kv - qo + i_last;
            int64_t lo = 0, hi = kv;
            if (d->mask_mode == KVA_MASK_CAUSAL && qpos_last + 1 < hi) hi = qpos_last + 1;
            if (d->window_left >= 0 && qpos_first - d->window_left > lo) lo = qpos_first - d->window_left;
            if (hi < 0) hi = 0;
            if (lo > hi) lo = hi;
            t->req = b;
            t->row_start = (int32_t)r0;
            t->rows = rows;
            t->lo = (int32_t)lo;
            t->hi = (int32_t)hi;
            t->nchunks = 1;
            t->chunk_len = 0;
        }
    }
    return KVA_OK;
}

/* Balanced chunks of a tile of len tokens at chunk size L: n = ceil(len / L) chunks of ceil(len / n) rounded up to
 * KVA__CHUNK_ALIGN (which may need fewer chunks). Returns the count and sets *chunk_len (len for one chunk). */
static int64_t kva__chunks_of(int64_t len, int64_t L, int64_t* chunk_len) {
    if (len <= L) {
        *chunk_len = len;
        return 1;
    }
    const int64_t n = kva__ceil_div64(len, L);
    *chunk_len = kva__ceil_div64(kva__ceil_div64(len, n), KVA__CHUNK_ALIGN) * KVA__CHUNK_ALIGN;
    return kva__ceil_div64(len, *chunk_len);
}

/* Chunking facts at chunk size L: work items (all KV heads), the longest and the shortest chunk (balanced chunks
 * as kva__split_tiles makes them). */
static void kva__chunk_stats(const kva__plan_scratch* s, int64_t H, int64_t L, int64_t* items, int64_t* longest,
                             int64_t* shortest) {
    int64_t n_all = 0, mx = 0, mn = INT64_MAX;
    for (int64_t i = 0; i < s->ntiles; ++i) {
        const int64_t len = s->tiles[i].hi - s->tiles[i].lo;
        int64_t cl;
        const int64_t n = kva__chunks_of(len, L, &cl);
        n_all += n;
        if (cl > mx) mx = cl;
        const int64_t last = len - (n - 1) * cl;
        if (last < mn) mn = last;
    }
    *items = n_all * H;
    *longest = mx;
    *shortest = mn == INT64_MAX ? 0 : mn;
}

/* The longest tile's KV range (tokens). */
static int64_t kva__max_tile_len(const kva__plan_scratch* s) {
    int64_t m = 0;
    for (int64_t i = 0; i < s->ntiles; ++i)
        if (s->tiles[i].hi - s->tiles[i].lo > m) m = s->tiles[i].hi - s->tiles[i].lo;
    return m;
}

/* L = ceil(total / W) is the ideal chunk only when the chunks pack: with T tiles of equal length it gives
 * T * ceil(len / L) items, often a little more than W (e.g. 32 heads x 32k over 264 workers: 288 items), and the
 * last few workers then take two chunks (makespan ~2L). When all tiles fit in W items, the smallest L with at most
 * W items ends at its longest chunk; take it unless that is worse than the estimate for L (its longest chunk plus
 * its shortest, the least a second chunk on a worker adds). */
static int64_t kva__refine_chunk(const kva__plan_data* pd, const kva__plan_scratch* s, int64_t L0) {
    const int64_t W = pd->num_workers, H = kva__unit_heads(pd);
    int64_t items, longest, shortest;
    kva__chunk_stats(s, H, L0, &items, &longest, &shortest);
    if (items <= W || s->ntiles * H > W) return L0;
    const int64_t maxlen = kva__max_tile_len(s);
    const int64_t est0 = longest + shortest;
    /* smallest multiple of the alignment in (L0, maxlen] with at most W items (items do not grow with L) */
    int64_t lo = L0 / KVA__CHUNK_ALIGN + 1, hi = kva__ceil_div64(maxlen, KVA__CHUNK_ALIGN);
    if (lo > hi) return L0;
    while (lo < hi) {
        const int64_t mid = lo + (hi - lo) / 2;
        int64_t it, lg, sh;
        kva__chunk_stats(s, H, mid * KVA__CHUNK_ALIGN, &it, &lg, &sh);
        if (it <= W) hi = mid;
        else lo = mid + 1;
    }
    const int64_t L1 = lo * KVA__CHUNK_ALIGN;
    int64_t it1, longest1, sh1;
    kva__chunk_stats(s, H, L1, &it1, &longest1, &sh1);
    if (it1 > W || longest1 > est0) return L0; /* a tie goes to L1: fewer items, fewer merges */
    return L1 > INT32_MAX / 2 ? L0 : L1;
}

/* Units (tile x unit heads) that chunks of L tokens split. */
static int64_t kva__split_units(const kva__plan_scratch* s, int64_t H, int64_t L) {
    int64_t n = 0;
    for (int64_t i = 0; i < s->ntiles; ++i)
        if (s->tiles[i].hi - s->tiles[i].lo > L) n += H;
    return n;
}

/* Row-slot plans: the merge of a split unit loads its partials in batches of ctx->rs_merge_batch per L2 round trip
 * (the fused merge and the row merge alike), so n = b * k + 1 chunks cost one more round trip per row for one
 * partial. Then take n - 1 slightly longer chunks: 4 KV heads on 132 SMs gave 33 chunks per unit (H100, 48/4 1 x 32k
 * and 40/4 1 x 64k: 32 chunks 3.9 % / 3.4 % faster, bench/results/rs_split_h100_2026-12-07_session46.md). */
static int64_t kva__rs_round_chunk(const kva_context* ctx, const kva__plan_data* pd, const kva__plan_scratch* s,
                                   int64_t L) {
    const int64_t b = ctx->rs_merge_batch;
    if (pd->row_slots <= 1 || b <= 1 || L <= 0) return L;
    const int64_t maxlen = kva__max_tile_len(s);
    int64_t cl;
    const int64_t n = kva__chunks_of(maxlen, L, &cl);
    if (n <= b || n % b != 1) return L;
    const int64_t L1 = kva__ceil_div64(kva__ceil_div64(maxlen, n - 1), KVA__CHUNK_ALIGN) * KVA__CHUNK_ALIGN;
    return L1 <= INT32_MAX / 2 && kva__chunks_of(maxlen, L1, &cl) == n - 1 ? L1 : L;
}

/* Chunk size L for this batch (0 = no split). */
static int32_t kva__choose_chunk(const kva_context* ctx, const kva__plan_data* pd, const kva_plan_params* p,
                                 const kva__plan_scratch* s) {
    if (p->disable_split_kv) return 0;
    if (p->fixed_split_size > 0) return p->fixed_split_size;
    int64_t total = 0;
    for (int64_t i = 0; i < s->ntiles; ++i) total += s->tiles[i].hi - s->tiles[i].lo;
    total *= kva__unit_heads(pd);
    int64_t L = kva__ceil_div64(total, pd->num_workers);
    int64_t min_chunk = ctx->min_kv_chunk > 0 ? ctx->min_kv_chunk : KVA__MIN_KV_CHUNK;
    if (L < min_chunk && ctx->small_kv_chunk > 0 && ctx->small_kv_chunk < min_chunk &&
        pd->op == (uint32_t)KVA_OP_BATCH_DECODE) {
        /* tiny decode calls (one request of a few hundred to a thousand tokens): shorter chunks put one 16-token
           subtile per warp instead of two, and the split stays within the fused merge's one-pass width
           (docs/kernels/decode.md, session 14) */
        int64_t lo = kva__ceil_div64(kva__max_tile_len(s), KVA__SMALL_SPLIT);
        if (lo < ctx->small_kv_chunk) lo = ctx->small_kv_chunk;
        if (lo < min_chunk) min_chunk = lo;
    }
    if (L < min_chunk) L = min_chunk;
    if (pd->row_slots > 1 && ctx->rs_max_split > 0) {
        /* a split unit's g > 8 rows are merged by one CTA or a warp per row: fewer, longer chunks (H200, 1 x 32k MQA
           32/1, fused merge: 32 chunks of 1k 42 us, 128 of 256 57 us, 16 of 2k 62 us, 8 of 4k 109 us; H100, a warp
           per row: 64 chunks of 512 26.3 us, 32 of 1k 31.9 us, 128 of 256 29.1 us; KVA__RS_MAX_SPLIT) */
        const int64_t maxlen = kva__max_tile_len(s);
        int64_t cap = ctx->rs_max_split;
        if (ctx->rs_multi_split > 0 && ctx->rs_multi_split < cap && pd->group_size <= ctx->rs_multi_group &&
            kva__split_units(s, kva__unit_heads(pd), L) >= 2)
            cap = ctx->rs_multi_split;
        const int64_t lo = kva__ceil_div64(maxlen, cap);
        if (L < lo) L = lo;
    }
    L = kva__ceil_div64(L, KVA__CHUNK_ALIGN) * KVA__CHUNK_ALIGN;
    if (L > INT32_MAX / 2) L = INT32_MAX / 2;
    return (int32_t)kva__rs_round_chunk(ctx, pd, s, kva__refine_chunk(pd, s, L));
}

/* Split every tile: n = ceil(len / L) chunks. Fixed-split mode uses boundaries lo + k*L (they depend only on
 * the request); otherwise chunks are balanced: ceil(len / n) rounded up to KVA__CHUNK_ALIGN. */
static void kva__split_tiles(kva__plan_scratch* s, int32_t L, bool fixed, int64_t* nsplit_tiles,
                             int64_t* nsplit_chunks, int64_t* nchunks_total) {
    int64_t st = 0, sc = 0, all = 0;
    for (int64_t i = 0; i < s->ntiles; ++i) {
        kva__tile* t = &s->tiles[i];
        int64_t len = t->hi - t->lo;
        if (L > 0 && len > L) {
            int64_t cl = L;
            const int64_t n = fixed ? kva__ceil_div64(len, L) : kva__chunks_of(len, L, &cl);
            t->nchunks = (int32_t)n;
            t->chunk_len = (int32_t)cl;
            if (n > 1) {
                st++;
                sc += n;
            }
        } else {
            t->nchunks = 1;
            t->chunk_len = (int32_t)len;
        }
        all += t->nchunks;
    }
    *nsplit_tiles = st;
    *nsplit_chunks = sc;
    *nchunks_total = all;
}

/* ---------------------------------------------------------------------------------------------- */
/* Assignment: LPT greedy with a min-heap of workers.                                               */

/* Stable sort of chunk ids by cost, descending (LSD radix over 8-bit digits, only as many passes as needed). */
static void kva__sort_desc(const uint32_t* cost, uint32_t* ids, uint32_t* tmp, int64_t n) {
    uint32_t maxc = 0;
    for (int64_t i = 0; i < n; ++i) {
        ids[i] = (uint32_t)i;
        if (cost[i] > maxc) maxc = cost[i];
    }
    uint32_t* src = ids;
    uint32_t* dst = tmp;
    for (int shift = 0; shift < 32 && (maxc >> shift) != 0; shift += 8) {
        int64_t cnt[257];
        memset(cnt, 0, sizeof cnt);
        for (int64_t i = 0; i < n; ++i) cnt[255 - ((cost[src[i]] >> shift) & 255) + 1]++;
        for (int j = 0; j < 256; ++j) cnt[j + 1] += cnt[j];
        for (int64_t i = 0; i < n; ++i) dst[cnt[255 - ((cost[src[i]] >> shift) & 255)]++] = src[i];
        uint32_t* x = src;
        src = dst;
        dst = x;
    }
    if (src != ids) memcpy(ids, src, sizeof(uint32_t) * (size_t)n);
}

/* Locality order for prefill plans: seq gets every item id (unit * H + head) with the items of one (request, KV
 * head) back to back, longest first (ties: unit order), groups in (request, head) order; then the tail, the last
 * items whose costs add up to KVA__TAIL_SPAN x W x the longest item, re-sorted longest first across its groups, so
 * list scheduling ends as evenly as LPT. Scratch: 3 * U * H entries after seq's U * H. Returns false (seq
 * untouched) when the plan is too small for the order to matter: then LPT. */
#define KVA__TAIL_SPAN 1
static bool kva__locality_order(const kva__plan_scratch* s, const uint32_t* unit_tile, const uint32_t* cost, int64_t U,
                                int64_t H, int32_t W, uint32_t* seq) {
    const int64_t N = U * H;
    if (U < 2 || N < 2 * (int64_t)W) return false;
    uint32_t* const a = seq + N;
    uint32_t* const b = seq + 2 * N;
    uint32_t* const c = seq + 3 * N;
    uint32_t maxc = 0;
    int64_t k = 0;
    for (int64_t u0 = 0; u0 < U;) { /* a request's units are consecutive ids (tiles are made request by request) */
        const int32_t req = s->tiles[unit_tile[u0]].req;
        int64_t u1 = u0 + 1;
        while (u1 < U && s->tiles[unit_tile[u1]].req == req) ++u1;
        kva__sort_desc(cost + u0, a, b, u1 - u0); /* the request's units longest first (ids from u0) */
        if (cost[u0 + a[0]] > maxc) maxc = cost[u0 + a[0]];
        for (int64_t h = 0; h < H; ++h)
            for (int64_t i = 0; i < u1 - u0; ++i) seq[k++] = (uint32_t)((u0 + (int64_t)a[i]) * H + h);
        u0 = u1;
    }
    const int64_t thr = (int64_t)KVA__TAIL_SPAN * W * (int64_t)maxc;
    int64_t ts = N, acc = 0;
    while (ts > 0 && acc < thr) acc += cost[seq[--ts] / (uint32_t)H];
    if (ts == 0) return false;
    const int64_t n = N - ts; /* the tail longest first */
    for (int64_t i = 0; i < n; ++i) b[i] = cost[seq[ts + i] / (uint32_t)H];
    kva__sort_desc(b, a, c, n);
    for (int64_t i = 0; i < n; ++i) c[i] = seq[ts + a[i]];
    memcpy(seq + ts, c, sizeof(uint32_t) * (size_t)n);
    return true;
}

/* ---------------------------------------------------------------------------------------------- */
/* Entry points                                                                                    */

static kva_status kva__check_common(kva_context* ctx, const kva_attention_desc* desc, kva_op op,
                                    const kva_plan_params* params, kva_attention_desc* nd) {
    KVA_RETURN_IF(!ctx, KVA_ERR_INVALID_ARGUMENT, "plan: context is NULL");
    KVA_RETURN_IF(!params, KVA_ERR_INVALID_ARGUMENT, "plan: params is NULL");
    KVA_RETURN_IF(op != KVA_OP_BATCH_DECODE && op != KVA_OP_BATCH_PREFILL_PAGED && op != KVA_OP_BATCH_PREFILL_RAGGED,
                  KVA_ERR_INVALID_ARGUMENT, "plan: op = %d is not a kva_op", (int)op);
    KVA_FORWARD(kva__desc_normalize(desc, nd));
    if (nd->variant) KVA_FORWARD(kva__variant_check_live(ctx, nd->variant, 0, "plan: desc->variant"));
    KVA_RETURN_IF(op == KVA_OP_BATCH_DECODE && nd->mask_mode == KVA_MASK_CUSTOM, KVA_ERR_UNSUPPORTED,
                  "batch decode takes no custom mask (use KVA_OP_BATCH_PREFILL_PAGED with one row per request)");
    KVA_FORWARD(ctx->ops->check_desc(ctx, nd, op));
    return KVA_OK;
}

/* A bound on the query rows of every plan (graph mode, kva_workspace_bound) within what one plan supports (the
 * limits of kva__validate_params), so the capacities derived from it cannot overflow. */
static kva_status kva__check_row_bound(const char* fn, const kva_attention_desc* d, int64_t max_rows) {
    KVA_RETURN_IF(max_rows > INT32_MAX / 2 || max_rows * (int64_t)d->num_qo_heads > INT32_MAX, KVA_ERR_UNSUPPORTED,
                  "%s: max_total_qo_rows = %lld x %d query heads exceeds what a plan supports (2^30 rows, 2^31 "
                  "packed rows)",
                  fn, (long long)max_rows, (int)d->num_qo_heads);
    return KVA_OK;
}

static void kva__init_plan_data(kva__plan_data* pd, kva_context* ctx, const kva_attention_desc* nd, kva_op op) {
    memset(pd, 0, sizeof *pd);
    pd->magic = KVA__PLAN_MAGIC;
    pd->version = KVA__PLAN_VERSION;
    pd->op = (uint32_t)op;
    pd->context_id = ctx->id;
    pd->backend = (int32_t)ctx->backend;
    pd->desc = *nd;
    pd->variant_id = nd->variant ? nd->variant->id : 0;
    pd->group_size = nd->num_qo_heads / nd->num_kv_heads;
    pd->kv_head_group = 1;
    pd->num_workers = ctx->num_workers > 0 ? ctx->num_workers : 1;
}

static int32_t kva__tile_q(kva_context* ctx, const kva__plan_data* pd, kva_op op, double avg_packed, int32_t max_packed) {
    int32_t t = ctx->ops->choose_tile_q(ctx, &pd->desc, op, avg_packed, max_packed);
    if (t < 1) t = 1;
    if (t > KVA__MAX_TILE_Q) t = KVA__MAX_TILE_Q;
    return t;
}

/* pd->graph_key (nonzero): a run of one graph-mode re-plan may read the work list of any other with this key */
static uint64_t kva__plan_graph_key(const kva__plan_data* pd) {
    /* every field here follows from the context, the descriptor and the bounds alone (graph-mode plans choose their
       workers, tile size and capacities from the bounds), never from the lengths of one batch; the partials are
       written and read within one run, so where they live (device or scratch region) is not part of it */
    const int64_t f[] = {(int64_t)pd->context_id,   pd->op,
                         pd->backend,               pd->desc.num_qo_heads,
                         pd->desc.num_kv_heads,     pd->desc.head_dim_qk,
                         pd->desc.head_dim_vo,      pd->desc.mask_mode,
                         pd->desc.window_left,      pd->page_size,
                         pd->num_workers,           pd->tile_q,
                         pd->kv_head_group,         pd->cluster_size,
                         pd->row_slots,
                         pd->cap_items,             pd->cap_merge,
                         pd->cap_partials,          pd->max_batch_size,
                         pd->max_total_qo_rows,     (int64_t)pd->off_counts,
                         (int64_t)pd->off_worker_indptr, (int64_t)pd->off_worker_head,
                         (int64_t)pd->off_requests, (int64_t)pd->off_items,
                         (int64_t)pd->off_merge,    (int64_t)pd->int_region_end};
    return kva__fnv(KVA__FNV_SEED, f, sizeof f) | 1u;
}

/* Builds the plan. ws == NULL: sizes only (pd gets the layout; nothing is written). */
static kva_status kva__plan_build(kva_context* ctx, const kva_attention_desc* desc, kva_op op,
                                  const kva_plan_params* params, const kva_workspace* ws, kva__plan_data* pd,
                                  void* stream) {
    kva_attention_desc nd;
    KVA_FORWARD(kva__check_common(ctx, desc, op, params, &nd));
    kva__init_plan_data(pd, ctx, &nd, op);
    const bool graph = params->graph_mode != 0;
    const bool host_staging = !ctx->ops->plans_on_host_memory;

    kva__plan_scratch s;
    kva__scratch_open(&s, ctx);
    int64_t total_rows = 0, total_kv = 0, entries = 0, mask_bytes = 0;
    int32_t max_qo = 0, max_kv = 0;
    kva_status st = kva__validate_params(&nd, op, params, &s, &total_rows, &total_kv, &entries, &mask_bytes, &max_qo,
                                         &max_kv);
    if (st != KVA_OK) goto done;
    const int32_t B = params->batch_size;
    if (!graph && ctx->ops->kv_head_group) {
        int32_t w = 0, rs = 0;
        const int32_t G = ctx->ops->kv_head_group(ctx, &nd, op, params, total_kv, max_kv, &w, &rs);
        if (G > 1 && nd.num_kv_heads % G == 0) {
            pd->kv_head_group = G;
            if (w >= 1 && w < pd->num_workers) pd->num_workers = w;
        } else if (G == 1 && rs > 1 && pd->group_size <= KVA__MAX_TILE_Q) {
            pd->row_slots = rs;
            if (w >= 1 && w < pd->num_workers) pd->num_workers = w;
        }
    }
    const int32_t g = kva__unit_group(pd);

    int64_t max_rows_bound = 0;
    if (graph) {
        int64_t mr = params->max_total_qo_rows;
        if (op == KVA_OP_BATCH_DECODE && mr == 0) mr = params->max_batch_size;
        if (params->max_batch_size < 1 || params->max_batch_size < B || mr < total_rows || mr < 0) {
            st = kva__set_error(KVA_ERR_INVALID_ARGUMENT,
                                "graph mode: batch_size = %d and %lld query rows must fit the bounds max_batch_size = "
                                "%d, max_total_qo_rows = %lld",
                                (int)B, (long long)total_rows, (int)params->max_batch_size, (long long)mr);
            goto done;
        }
        st = kva__check_row_bound("graph mode", &nd, mr);
        if (st != KVA_OK) goto done;
        if (params->fixed_split_size > 0) {
            st = kva__set_error(KVA_ERR_UNSUPPORTED,
                                "graph mode with fixed_split_size: the partial-output buffer would depend on KV "
                                "lengths; use graph mode with the default split or disable_split_kv");
            goto done;
        }
        max_rows_bound = mr;
        /* Tile size from the bounds, so the chosen kernels never change between plans. */
        double avg = (double)mr * g / (double)params->max_batch_size;
        int32_t maxp = (int32_t)(mr * g > INT32_MAX ? INT32_MAX : mr * g);
        pd->tile_q = kva__tile_q(ctx, pd, op, avg, maxp);
    } else if (params->fixed_split_size > 0 && op != KVA_OP_BATCH_DECODE) {
        /* Batch-invariant mode: the tile size must not depend on the other requests either (a request's tiles,
           their KV ranges and so every row's summation order follow from it). A fixed mid-size choice. */
        pd->tile_q = kva__tile_q(ctx, pd, op, 65.0, 128);
    } else if (pd->kv_head_group > 1 || pd->row_slots > 1) {
        pd->tile_q = g; /* decode: one tile of the group's G x g rows per request */
    } else {
        double avg = B > 0 ? (double)total_rows * g / (double)B : 0.0;
        pd->tile_q = kva__tile_q(ctx, pd, op, avg, max_qo * g);
    }
    pd->graph_mode = graph;
    pd->batch_size = B;
    pd->total_qo_rows = total_rows;
    pd->total_kv_tokens = op == KVA_OP_BATCH_PREFILL_RAGGED ? (B > 0 ? params->kv_indptr[B] : 0) : total_kv;
    pd->num_page_entries = entries;
    pd->page_size = op == KVA_OP_BATCH_PREFILL_RAGGED ? 0 : params->page_size;
    pd->num_pages = op == KVA_OP_BATCH_PREFILL_RAGGED ? 0 : params->num_pages;
    pd->max_qo_len = max_qo;
    pd->max_kv_len = max_kv;
    pd->custom_mask_bytes = mask_bytes;
    pd->fixed_split_size = params->fixed_split_size;
    pd->max_total_qo_rows = graph ? max_rows_bound : total_rows;

    st = kva__make_tiles(pd, B, &s);
    if (st != KVA_OK) goto done;
    /* Thread-block clusters (ctx->cluster_size > 1: the CUDA backend on sm_90). Graph-mode plans of a descriptor whose
       kernel combines in clusters, with bounds that fit the clusters, run on cluster_ctas workers, every plan of them
       (the captured launch is in clusters). A plan whose (tile, KV head) units fit the clusters, with the longest tile in at most cluster_size
       chunks of at most cluster_max_chunk tokens, gives unit u's chunks to CTAs u * cluster_size + c, which combine
       them through distributed shared memory instead of global partials, an arrival atomic and a merge
       (docs/kernels/decode.md, session 16). */
    int32_t L_cc = 0;
    {
        const int32_t C = ctx->cluster_size;
        const bool cl_desc = C > 1 && ctx->cluster_ctas >= C && op == KVA_OP_BATCH_DECODE && pd->kv_head_group == 1 &&
                             pd->row_slots == 0 &&
                             params->fixed_split_size <= 0 && !params->disable_split_kv &&
                             (!ctx->ops->cluster_ok || ctx->ops->cluster_ok(ctx, &nd, op, pd->tile_q));
        const int64_t clusters = C > 1 ? ctx->cluster_ctas / C : 0;
        /* graph mode: only graphs whose every batch under the bounds fits the clusters (max_batch_size requests of
           ceil(g / tile_q) tiles per KV head), since the cluster grid has fewer workers than the plain one (240 of
           264 on an H100 at size 8: larger graph calls 1.5-5 % slower on it) */
        const bool cl_graph =
            graph && (int64_t)params->max_batch_size * kva__ceil_div64(pd->group_size, pd->tile_q > 0 ? pd->tile_q : 1) *
                             (int64_t)nd.num_kv_heads <= clusters;
        if (cl_desc && (!graph || cl_graph)) {
            if (graph) {
                pd->cluster_size = C;
                pd->num_workers = ctx->cluster_ctas;
            }
            const int64_t U = s.ntiles * (int64_t)nd.num_kv_heads, maxlen = kva__max_tile_len(&s);
            int64_t floor_len = ctx->small_kv_chunk > 0 ? ctx->small_kv_chunk
                                : ctx->min_kv_chunk > 0 ? ctx->min_kv_chunk
                                                        : KVA__MIN_KV_CHUNK;
            int64_t l = kva__ceil_div64(kva__ceil_div64(maxlen, C), KVA__CHUNK_ALIGN) * KVA__CHUNK_ALIGN;
            if (l < floor_len) l = floor_len;
            const int64_t max_chunk = ctx->cluster_max_chunk > 0 ? ctx->cluster_max_chunk : 256;
            if (U >= 1 && U <= clusters && maxlen > l && l <= max_chunk) {
                L_cc = (int32_t)l;
                pd->cluster_size = C;
                pd->cluster_combine = 1;
                if (!graph) pd->num_workers = (int32_t)(U * C);
            }
        }
    }
    const int32_t W0 = pd->num_workers;
    if (graph && pd->cluster_size <= 1 && pd->kv_head_group == 1 && ctx->ops->plan_workers) {
        /* graph mode: the backend may plan every batch under the bounds on fewer workers, chosen from the bounds
           alone (max_batch_size requests of ceil(g / tile_q) tiles per KV head; tokens unknown: -1), so every plan
           of the graph has the same grid */
        const int64_t units = (int64_t)params->max_batch_size *
                              kva__ceil_div64(pd->group_size, pd->tile_q > 0 ? pd->tile_q : 1) * (int64_t)nd.num_kv_heads;
        const int32_t w = ctx->ops->plan_workers(ctx, &nd, op, units, -1);
        if (w >= 1 && w < pd->num_workers) pd->num_workers = w;
    }
    if (!graph && !pd->cluster_combine && pd->kv_head_group == 1 && pd->row_slots == 0 &&
        ctx->ops->plan_workers) { /* the backend may plan a small batch on fewer workers */
        int64_t tokens = 0;
        for (int64_t i = 0; i < s.ntiles; ++i) tokens += s.tiles[i].hi - s.tiles[i].lo;
        const int32_t w = ctx->ops->plan_workers(ctx, &nd, op, s.ntiles * (int64_t)nd.num_kv_heads,
                                                 tokens * (int64_t)nd.num_kv_heads);
        if (w >= 1 && w < pd->num_workers) pd->num_workers = w;
    }
    const int64_t H = kva__unit_heads(pd);
    int32_t L = pd->cluster_combine ? L_cc : kva__choose_chunk(ctx, pd, params, &s);
    int64_t nsplit_tiles = 0, nsplit_chunks = 0, nchunks_tile = 0;
    kva__split_tiles(&s, L, params->fixed_split_size > 0, &nsplit_tiles, &nsplit_chunks, &nchunks_tile);
    if (!graph && !pd->cluster_combine && pd->num_workers < W0 && nchunks_tile * H > pd->num_workers) {
        /* fewer workers only where each then has at most one item: with skewed lengths the chunks do not pack
           (D4 zipf on 132 instead of 264 workers: 15 % slower), and all W0 workers balance them better */
        pd->num_workers = W0;
        L = kva__choose_chunk(ctx, pd, params, &s);
        kva__split_tiles(&s, L, params->fixed_split_size > 0, &nsplit_tiles, &nsplit_chunks, &nchunks_tile);
    }
    const int64_t n_items = nchunks_tile * H, n_merge = nsplit_tiles * H, n_partials = nsplit_chunks * H;
    pd->kv_chunk_size = nsplit_tiles > 0 ? L : 0;
    if (n_items > INT32_MAX / 2 || n_partials > INT32_MAX / 2) {
        st = kva__set_error(KVA_ERR_UNSUPPORTED, "plan: %lld work items exceed the supported maximum",
                            (long long)n_items);
        goto done;
    }
    /* The assignment's limits (load keys of worker ids in 13 bits and loads below 2^50), checked here, before anything
       is written and for the size query too, with the costs the assignment uses (every chunk: its tokens + 2 x rows,
       for each of the H heads; the sum is the plan's reported total). n_items <= 2^30 bounds each tile's terms below
       2^63. */
    int64_t total_cost = 0;
    for (int64_t ti = 0; ti < s.ntiles && total_cost < ((int64_t)1 << 50); ++ti) {
        const kva__tile* t = &s.tiles[ti];
        total_cost += (int64_t)(t->hi - t->lo) * H + 2 * (int64_t)t->rows * ((int64_t)t->nchunks * H);
    }
    if (pd->num_workers > (1 << 13) || total_cost >= ((int64_t)1 << 50)) {
        st = kva__set_error(KVA_ERR_UNSUPPORTED, "plan: %d workers or total cost %lld exceed the planner's limits",
                            (int)pd->num_workers, (long long)total_cost);
        goto done;
    }
    pd->num_items = (int32_t)n_items;
    pd->num_merge = (int32_t)n_merge;
    pd->num_partials = (int32_t)n_partials;

    kva__caps caps;
    if (graph) {
        caps = kva__bound_caps(pd, params->max_batch_size, max_rows_bound);
        if (n_items > caps.items || n_merge > caps.merge || n_partials > caps.partials) {
            st = kva__set_error(KVA_ERR_INTERNAL,
                                "plan: graph-mode capacities exceeded (items %lld/%d, merge %lld/%d, partials %lld/%d)",
                                (long long)n_items, caps.items, (long long)n_merge, caps.merge, (long long)n_partials,
                                caps.partials);
            goto done;
        }
    } else {
        caps.batch = B;
        caps.items = (int32_t)n_items;
        caps.merge = (int32_t)n_merge;
        caps.partials = (int32_t)n_partials;
    }
    kva__layout(pd, &caps, host_staging, ctx->worker_head_bytes > 0 ? (size_t)ctx->worker_head_bytes : 0);

    if (!ws) goto done; /* size query */

    /* Workspace checks. */
    {
        const size_t need = ws->scratch ? pd->int_region_end : pd->device_bytes;
        if (ws->device_bytes < need || (need > 0 && !ws->device)) {
            st = kva__set_error(KVA_ERR_WORKSPACE_TOO_SMALL,
                                "plan: the device workspace has %zu bytes at %p; this plan needs %zu bytes%s",
                                ws->device_bytes, ws->device, need, ws->scratch ? " (its scratch region aside)" : "");
            goto done;
        }
    }
    if (host_staging && (ws->host_bytes < pd->host_bytes || !ws->host)) {
        st = kva__set_error(KVA_ERR_WORKSPACE_TOO_SMALL,
                            "plan: the host staging workspace has %zu bytes at %p; this plan needs %zu bytes",
                            ws->host_bytes, ws->host, pd->host_bytes);
        goto done;
    }
    if (((uintptr_t)ws->device % KVA__WS_ALIGN) != 0 || (host_staging && ((uintptr_t)ws->host % KVA__WS_ALIGN) != 0)) {
        st = kva__set_error(KVA_ERR_ALIGNMENT, "plan: workspace pointers must be %d-byte aligned (device %p, host %p)",
                            KVA__WS_ALIGN, ws->device, ws->host);
        goto done;
    }
    if (ws->scratch) { /* the partials go to the scratch region; device keeps the plan */
        const size_t sb = pd->device_bytes - pd->int_region_end;
        const uintptr_t d0 = (uintptr_t)ws->device, s0 = (uintptr_t)ws->scratch;
        if (((uintptr_t)ws->scratch % KVA__WS_ALIGN) != 0) {
            st = kva__set_error(KVA_ERR_ALIGNMENT, "plan: workspace scratch %p must be %d-byte aligned", ws->scratch,
                                KVA__WS_ALIGN);
            goto done;
        }
        if (ws->scratch_bytes < sb) {
            st = kva__set_error(KVA_ERR_WORKSPACE_TOO_SMALL,
                                "plan: the workspace scratch has %zu bytes at %p; this plan needs %zu bytes",
                                ws->scratch_bytes, ws->scratch, sb);
            goto done;
        }
        if (sb > 0 && pd->int_region_end > 0 && s0 < d0 + pd->int_region_end && d0 < s0 + sb) {
            st = kva__set_error(KVA_ERR_INVALID_ARGUMENT,
                                "plan: the workspace scratch [%p, +%zu) overlaps the plan's device bytes [%p, +%zu)",
                                ws->scratch, sb, ws->device, pd->int_region_end);
            goto done;
        }
        pd->off_partial_o -= pd->int_region_end;
        pd->off_partial_lse -= pd->int_region_end;
        pd->device_bytes = pd->int_region_end;
        pd->scratch_bytes = sb;
        pd->ws_scratch_addr = (uint64_t)s0;
    }
    pd->ws_device_addr = (uint64_t)(uintptr_t)ws->device;
    pd->ws_host_addr = (uint64_t)(uintptr_t)ws->host;

    {
        /* Units are (tile, chunk) pairs; each stands for num_kv_heads identical work items (one per KV head), so
           the sort runs over units and the heads of a unit are assigned consecutively. */
        const int64_t U = nchunks_tile, N = n_items;
        const size_t u1 = (size_t)(U > 0 ? U : 1), n1 = (size_t)(N > 0 ? N : 1);
        const int32_t W = pd->num_workers;
        uint32_t* unit_tile = (uint32_t*)kva__scratch_get(&s, KVA__S_ITEMS, sizeof(uint32_t) * 2 * u1);
        uint32_t* cost = (uint32_t*)kva__scratch_get(&s, KVA__S_COST, sizeof(uint32_t) * u1);
        uint32_t* order = (uint32_t*)kva__scratch_get(&s, KVA__S_ORDER, sizeof(uint32_t) * u1 * 2);
        int32_t* owner = (int32_t*)kva__scratch_get(&s, KVA__S_OWNER, sizeof(int32_t) * n1);
        char* wmem = (char*)kva__scratch_get(&s, KVA__S_WORKERS,
                                             sizeof(uint64_t) * (4 * (size_t)W + 2) + sizeof(int32_t) * ((size_t)W + 1));
        if (!unit_tile || !cost || !order || !owner || !wmem) {
            st = kva__set_error(KVA_ERR_OUT_OF_MEMORY, "plan: out of host memory (%lld work items)", (long long)N);
            goto done;
        }
        uint32_t* unit_chunk = unit_tile + u1;
        uint64_t* heap = (uint64_t*)(void*)wmem;
        int32_t* wcount = (int32_t*)(void*)(wmem + sizeof(uint64_t) * (4 * (size_t)W + 2));
        memset(wcount, 0, sizeof(int32_t) * ((size_t)W + 1));
        char* base = (char*)(host_staging ? ws->host : ws->device);
        kva__merge_task* merge = (kva__merge_task*)(base + pd->off_merge);
        int64_t u = 0, slot = 0, mt = 0;
        for (int64_t ti = 0; ti < s.ntiles; ++ti) {
            kva__tile* t = &s.tiles[ti];
            const bool split = t->nchunks > 1;
            t->slot_base = split ? (int32_t)slot : -1;
            for (int32_t c = 0; c < t->nchunks; ++c) {
                int64_t ks = t->lo + (int64_t)c * t->chunk_len;
                int64_t ke = split ? ks + t->chunk_len : t->hi;
                if (ke > t->hi) ke = t->hi;
                unit_tile[u] = (uint32_t)ti;
                unit_chunk[u] = (uint32_t)c;
                /* fits 32 bits: KV lengths are int32, and 2 x rows is at most 2 x the tile's rows */
                cost[u] = (uint32_t)(ke - ks) + 2u * (uint32_t)t->rows;
                ++u;
            }
            if (split) {
                for (int32_t h = 0; h < (int32_t)H; ++h) {
                    merge[mt].req = t->req;
                    merge[mt].kv_head = h;
                    merge[mt].row_start = t->row_start;
                    merge[mt].rows = t->rows;
                    merge[mt].partial_first = (int32_t)(slot + (int64_t)h * t->nchunks);
                    merge[mt].num_partials = t->nchunks;
                    ++mt;
                }
                slot += (int64_t)t->nchunks * H;
            }
        }
        /* Assignment order (seq: item ids unit * H + head), then each item in turn to the least-loaded worker
           (ties: lowest worker id), which is the worker that reaches it first.
           - Decode, and any plan too small for the locality order below: LPT, units longest first.
           - Prefill (kva__locality_order): the items of one (request, KV head) run back to back, longest first,
             so the CTAs running at the same time share their K/V in L2 instead of every CTA streaming a
             different head's K/V from DRAM; the tail is longest first across groups (LPT's balance). */
        if (!pd->cluster_combine) kva__sort_desc(cost, order, order + u1, U); /* (cluster plans: fixed places) */
        uint32_t* seq = (uint32_t*)kva__scratch_get(&s, KVA__S_SEQ, sizeof(uint32_t) * 4 * n1);
        if (!seq) {
            st = kva__set_error(KVA_ERR_OUT_OF_MEMORY, "plan: out of host memory (%lld work items)", (long long)N);
            goto done;
        }
        if (!pd->cluster_combine && !(op != KVA_OP_BATCH_DECODE && !ctx->plan_lpt_only &&
                                      kva__locality_order(&s, unit_tile, cost, U, H, W, seq))) {
            int64_t k = 0;
            for (int64_t i = 0; i < U; ++i)
                for (int64_t h = 0; h < H; ++h) seq[k++] = (uint32_t)((int64_t)order[i] * H + h);
        }
        int64_t k = 0;
        int64_t maxload = 0;
        if (pd->cluster_combine) {
            /* clusters: the chunks of unit (tile t, KV head h) on CTAs (t * H + h) * C + c, one item each (the
               planner chose C and the chunk length so that every unit fits its cluster) */
            const int64_t C = pd->cluster_size;
            for (k = 0; k < N; ++k) {
                const int64_t uid = k / H, h = k % H;
                seq[k] = (uint32_t)k;
                owner[k] = (int32_t)(((int64_t)unit_tile[uid] * H + h) * C + (int64_t)unit_chunk[uid]);
                wcount[owner[k] + 1]++;
                if ((int64_t)cost[uid] > maxload) maxload = (int64_t)cost[uid];
            }
        } else {
            /* Worker loads live in a tournament tree of keys load << 13 | worker (one integer compare orders (load,
               worker)); the root is the least-loaded worker. An update walks from the leaf to the root taking the min
               with each sibling: the sibling loads do not depend on the compares, so the walk costs a short chain of
               integer mins, not dependent loads. The first min(W, N) items go to workers 0, 1, ... in order (all loads
               are 0; ties to the lowest id): placed directly, then the tree is built once. */
            size_t P = 1;
            while (P < (size_t)W) P *= 2;
            for (size_t i = 0; i < P; ++i) heap[P + i] = i < (size_t)W ? (uint64_t)i : UINT64_MAX;
            for (; k < N && k < W; ++k) {
                owner[k] = (int32_t)k;
                wcount[k + 1]++;
                heap[P + (size_t)k] += (uint64_t)cost[seq[k] / (uint32_t)H] << 13;
            }
            for (size_t i = P - 1; i >= 1; --i) heap[i] = heap[2 * i] < heap[2 * i + 1] ? heap[2 * i] : heap[2 * i + 1];
            for (; k < N; ++k) {
                uint64_t x = P > 1 ? heap[1] : heap[P];
                const int32_t w = (int32_t)(x & 8191u);
                owner[k] = w;
                wcount[w + 1]++;
                x += (uint64_t)cost[seq[k] / (uint32_t)H] << 13;
                size_t pos = P + (size_t)w;
                heap[pos] = x;
                while (pos > 1) {
                    const uint64_t sib = heap[pos ^ 1];
                    x = sib < x ? sib : x;
                    pos >>= 1;
                    heap[pos] = x;
                }
            }
            for (int32_t w = 0; w < W; ++w)
                if ((int64_t)(heap[P + (size_t)w] >> 13) > maxload) maxload = (int64_t)(heap[P + (size_t)w] >> 13);
        }
        pd->max_worker_cost = maxload;
        pd->total_cost = total_cost;
        int32_t* windptr = (int32_t*)(base + pd->off_worker_indptr);
        windptr[0] = 0;
        for (int32_t w = 0; w < W; ++w) windptr[w + 1] = windptr[w] + wcount[w + 1];
        /* Write items in assignment order (each worker's list runs in the order of seq). */
        kva__work_item* dst = (kva__work_item*)(base + pd->off_items);
        for (int32_t w = 0; w < W; ++w) wcount[w] = windptr[w];
        for (k = 0; k < N; ++k) {
            const uint32_t uid = seq[k] / (uint32_t)H;
            const int32_t h = (int32_t)(seq[k] % (uint32_t)H);
            const kva__tile* t = &s.tiles[unit_tile[uid]];
            const int32_t c = (int32_t)unit_chunk[uid];
            const bool split = t->nchunks > 1;
            int64_t ks = t->lo + (int64_t)c * t->chunk_len;
            int64_t ke = split ? ks + t->chunk_len : t->hi;
            if (ke > t->hi) ke = t->hi;
            kva__work_item* w = &dst[wcount[owner[k]]++];
            w->req = t->req;
            w->kv_head = h;
            w->row_start = t->row_start;
            w->rows = t->rows;
            w->kv_start = (int32_t)ks;
            w->kv_end = (int32_t)ke;
            w->partial = split ? t->slot_base + h * t->nchunks + c : -1;
            w->pad_ = 0;
        }
        kva__request* req = (kva__request*)(base + pd->off_requests);
        for (int32_t b = 0; b < B; ++b) {
            req[b].qo_start = params->qo_indptr ? params->qo_indptr[b] : b;
            req[b].qo_len = s.qo_len[b];
            req[b].kv_start = s.kv_start[b];
            req[b].kv_len = s.kv_len[b];
            req[b].mask_offset = s.mask_off[b];
        }
        kva__counts* counts = (kva__counts*)(base + pd->off_counts);
        memset(counts, 0, sizeof *counts);
        counts->batch_size = B;
        counts->num_items = pd->num_items;
        counts->num_merge = pd->num_merge;
        counts->num_partials = pd->num_partials;
        counts->total_qo_rows = total_rows;
        memset(base, 0, KVA__STATUS_BYTES);
    }
    st = ctx->ops->finish_plan(ctx, pd, ws, stream);
    if (st == KVA_OK) {
        pd->graph_key = pd->graph_mode ? kva__plan_graph_key(pd) : 0;
        pd->stamp = kva__stamp_record(pd->ws_device_addr, pd->graph_key);
    }

done:
    kva__scratch_free(&s);
    return st;
}

kva_status kva__plan_layout(kva_context* ctx, const kva_attention_desc* desc, kva_op op,
                            const kva_plan_params* params, kva__plan_data* pd) {
    return kva__plan_build(ctx, desc, op, params, NULL, pd, NULL);
}

KVA_API void kva_plan_params_init(kva_plan_params* params) {
    if (params) memset(params, 0, sizeof *params);
}

KVA_API kva_status kva_plan_workspace_size(kva_context* context, const kva_attention_desc* desc, kva_op op,
                                           const kva_plan_params* params, size_t* device_bytes,
                                           size_t* host_bytes) {
    kva__plan_data pd;
    KVA_FORWARD(kva__plan_build(context, desc, op, params, NULL, &pd, NULL));
    if (device_bytes) *device_bytes = pd.device_bytes;
    if (host_bytes) *host_bytes = pd.host_bytes;
    return KVA_OK;
}

KVA_API kva_status kva_plan_workspace_parts(kva_context* context, const kva_attention_desc* desc, kva_op op,
                                            const kva_plan_params* params, size_t* plan_bytes, size_t* scratch_bytes,
                                            size_t* host_bytes) {
    kva__plan_data pd;
    KVA_FORWARD(kva__plan_build(context, desc, op, params, NULL, &pd, NULL));
    if (plan_bytes) *plan_bytes = pd.int_region_end;
    if (scratch_bytes) *scratch_bytes = pd.device_bytes - pd.int_region_end;
    if (host_bytes) *host_bytes = pd.host_bytes;
    return KVA_OK;
}

static kva_status kva__workspace_bound(kva_context* context, const kva_attention_desc* desc, kva_op op,
                                       int32_t max_batch_size, int64_t max_total_qo_rows, kva__plan_data* out);

KVA_API kva_status kva_workspace_bound_parts(kva_context* context, const kva_attention_desc* desc, kva_op op,
                                             int32_t max_batch_size, int64_t max_total_qo_rows, size_t* plan_bytes,
                                             size_t* scratch_bytes, size_t* host_bytes) {
    kva__plan_data pd;
    KVA_FORWARD(kva__workspace_bound(context, desc, op, max_batch_size, max_total_qo_rows, &pd));
    if (plan_bytes) *plan_bytes = pd.int_region_end;
    if (scratch_bytes) *scratch_bytes = pd.device_bytes - pd.int_region_end;
    if (host_bytes) *host_bytes = pd.host_bytes;
    return KVA_OK;
}

KVA_API kva_status kva_workspace_bound(kva_context* context, const kva_attention_desc* desc, kva_op op,
                                       int32_t max_batch_size, int64_t max_total_qo_rows, size_t* device_bytes,
                                       size_t* host_bytes) {
    kva__plan_data pd;
    KVA_FORWARD(kva__workspace_bound(context, desc, op, max_batch_size, max_total_qo_rows, &pd));
    if (device_bytes) *device_bytes = pd.device_bytes;
    if (host_bytes) *host_bytes = pd.host_bytes;
    return KVA_OK;
}

static kva_status kva__workspace_bound(kva_context* context, const kva_attention_desc* desc, kva_op op,
                                       int32_t max_batch_size, int64_t max_total_qo_rows, kva__plan_data* out) {
    kva_plan_params p;
    kva_plan_params_init(&p);
    kva_attention_desc nd;
    KVA_FORWARD(kva__check_common(context, desc, op, &p, &nd));
    if (op == KVA_OP_BATCH_DECODE && max_total_qo_rows == 0) max_total_qo_rows = max_batch_size;
    KVA_RETURN_IF(max_batch_size < 1 || max_total_qo_rows < 0, KVA_ERR_INVALID_ARGUMENT,
                  "kva_workspace_bound: max_batch_size = %d must be >= 1 and max_total_qo_rows = %lld >= 0",
                  (int)max_batch_size, (long long)max_total_qo_rows);
    KVA_FORWARD(kva__check_row_bound("kva_workspace_bound", &nd, max_total_qo_rows));
    kva__plan_data* pd = out;
    kva__init_plan_data(pd, context, &nd, op);
    /* Valid for every tile size the backend may choose (1..128 packed rows): the item count is largest for
       one-row tiles, the partial buffer (2W slots of tile_q rows) for 128-row tiles. */
    pd->tile_q = 1;
    kva__caps c = kva__bound_caps(pd, max_batch_size, max_total_qo_rows);
    pd->tile_q = KVA__MAX_TILE_Q;
    kva__layout(pd, &c, !context->ops->plans_on_host_memory,
                context->worker_head_bytes > 0 ? (size_t)context->worker_head_bytes : 0);
    return KVA_OK;
}

KVA_API kva_status kva_plan_make(kva_context* context, const kva_attention_desc* desc, kva_op op,
                            const kva_plan_params* params, const kva_workspace* workspace, kva_plan* plan,
                            void* stream) {
    KVA_RETURN_IF(!workspace, KVA_ERR_INVALID_ARGUMENT, "kva_plan_make: workspace is NULL");
    KVA_RETURN_IF(!plan, KVA_ERR_INVALID_ARGUMENT, "kva_plan_make: plan is NULL");
    kva__plan_data pd;
    kva_status st = kva__plan_build(context, desc, op, params, workspace, &pd, stream);
    if (st != KVA_OK) return st;
    memset(plan, 0, sizeof *plan);
    memcpy(plan->opaque, &pd, sizeof pd);
    kva__plan_seal(kva__plan_data_of(plan));
    return KVA_OK;
}

KVA_API kva_status kva_plan_get_info(const kva_plan* plan, kva_plan_info* info) {
    KVA_RETURN_IF(!plan || !info, KVA_ERR_INVALID_ARGUMENT, "kva_plan_get_info: plan or info is NULL");
    const kva__plan_data* pd = kva__plan_data_ofc(plan);
    KVA_RETURN_IF(!kva__plan_intact(pd), KVA_ERR_INVALID_ARGUMENT,
                  "kva_plan_get_info: not a plan made by kva_plan_make (bad magic or version) or its bytes changed since");
    memset(info, 0, sizeof *info);
    info->op = (kva_op)pd->op;
    info->batch_size = pd->batch_size;
    info->total_qo_rows = pd->total_qo_rows;
    info->num_workers = pd->num_workers;
    info->tile_q = pd->tile_q;
    info->kv_chunk_size = pd->kv_chunk_size;
    info->num_work_items = pd->num_items;
    info->num_merge_tasks = pd->num_merge;
    info->num_partials = pd->num_partials;
    info->graph_mode = pd->graph_mode;
    info->kv_head_group = pd->kv_head_group;
    info->max_worker_cost = pd->max_worker_cost;
    info->total_cost = pd->total_cost;
    info->device_bytes = pd->device_bytes;
    info->host_bytes = pd->host_bytes;
    info->scratch_bytes = pd->scratch_bytes;
    return KVA_OK;
}
