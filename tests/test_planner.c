/*
 * test_planner.c - planner invariants from random lengths (links kvattn_static and reads the plan data and the
 * workspace int region through src/core/internal.h). CPU contexts only: the CPU backend plans straight into
 * the workspace, so the int region is host memory.
 *
 * Invariants:
 *   coverage   every (request, KV head, packed query row) is produced exactly once: by one direct item, or by
 *              one merge task whose partial items are consecutive KV chunks; the KV range that produces a row
 *              contains every position the row can see (causal / window);
 *   merge map  each partial slot is written by exactly one item and read by exactly one merge task; the tasks'
 *              slot ranges tile [0, num_partials);
 *   layout     every region 256-byte aligned, inside device_bytes, not overlapping; the fault-status region zeroed;
 *   determinism same inputs -> byte-identical plan and int region (also from another context with the same W);
 *   balance    per-worker cost (len + 2 * rows per item, docs/design.md) sums to the plan's facts, and
 *              max_worker_cost <= 4/3 * max(total / W, largest item) + largest item. Greedy longest-first (LPT) is
 *              within 4/3 of the optimal makespan (Graham 1969) and the optimum is at least max(total / W,
 *              largest item); the extra "+ largest item" only makes the bound safe. The worst observed ratio
 *              max_worker_cost / max(total / W, largest item) is printed;
 *   graph mode offsets, capacities, tile size, workers and sizes identical across plans under the same bounds;
 *   fixed split chunk pieces seen by a request's rows do not depend on the other requests of the batch;
 *   bounds     kva_workspace_bound >= kva_plan_workspace_size for random batches under the bound.
 */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "harness.h"
#include "internal.h"

static double g_worst_ratio = 0, g_worst_ratio2 = 0;

static int cmp_i64_desc(const void* a, const void* b) {
    int64_t x = *(const int64_t*)a, y = *(const int64_t*)b;
    return x < y ? 1 : x > y ? -1 : 0;
}
static int64_t g_plans = 0, g_items = 0, g_partials = 0;
static int32_t g_small_chunk = 0; /* small_kv_chunk of the contexts of the plan being checked */
static int32_t g_cluster = 0, g_cluster_ctas = 0, g_cluster_max_chunk = 0; /* contexts' thread-block cluster facts */
static int g_cluster_plans = 0, g_cluster_graph_plans = 0;
static int32_t g_head_bytes = 0;  /* worker_head_bytes of the contexts of the plan being checked */
static int64_t g_small_plans = 0; /* plans whose chunks are below KVA__MIN_KV_CHUNK */

typedef struct batch {
    kva_op op;
    int32_t B;
    int32_t qo[512], kv[512];
    int32_t qo_indptr[513], kv_indptr[513], last[513];
    int32_t* indices;
    int64_t num_pages;
    int32_t page_size;
} batch;

static void batch_free(batch* b) {
    free(b->indices);
    b->indices = NULL;
}

static int32_t rand_kv(h_rng* r) {
    int64_t k = h_rng_range(r, 0, 9);
    if (k == 0) return 0;
    if (k <= 4) return (int32_t)h_rng_range(r, 1, 200);
    if (k <= 8) return (int32_t)h_rng_range(r, 1, 3000);
    return (int32_t)h_rng_range(r, 1, 40000);
}

/* Fill the CSR arrays from b->qo / b->kv. */
static void batch_finish(batch* b, h_rng* r) {
    b->qo_indptr[0] = b->kv_indptr[0] = 0;
    int64_t entries = 0;
    for (int32_t i = 0; i < b->B; ++i) {
        b->qo_indptr[i + 1] = b->qo_indptr[i] + b->qo[i];
        if (b->op == KVA_OP_BATCH_PREFILL_RAGGED) {
            b->kv_indptr[i + 1] = b->kv_indptr[i] + b->kv[i];
            b->last[i] = 0;
        } else {
            int32_t np = (b->kv[i] + b->page_size - 1) / b->page_size;
            b->kv_indptr[i + 1] = b->kv_indptr[i] + np;
            b->last[i] = np ? b->kv[i] - (np - 1) * b->page_size : 0;
            entries += np;
        }
    }
    b->num_pages = entries * 2 + 1;
    b->indices = (int32_t*)malloc(sizeof(int32_t) * (size_t)(entries + 1));
    for (int64_t i = 0; i < entries; ++i) b->indices[i] = (int32_t)h_rng_range(r, 0, b->num_pages - 1);
}

static void batch_random(batch* b, kva_op op, h_rng* r, int32_t max_b) {
    memset(b, 0, sizeof *b);
    b->op = op;
    b->B = (int32_t)h_rng_range(r, 0, max_b);
    static const int pss[] = {1, 3, 16, 64};
    b->page_size = pss[h_rng_range(r, 0, 3)];
    int64_t qo_cap = h_rng_range(r, 0, 2) == 0 ? 300 : 24;
    for (int32_t i = 0; i < b->B; ++i) {
        b->kv[i] = rand_kv(r);
        if (op == KVA_OP_BATCH_DECODE) b->qo[i] = 1;
        else {
            int64_t hi = b->kv[i] < qo_cap ? b->kv[i] : qo_cap;
            b->qo[i] = (int32_t)h_rng_range(r, 0, hi > 0 ? hi : 2);
        }
    }
    batch_finish(b, r);
}

static void params_of(const batch* b, kva_plan_params* p) {
    kva_plan_params_init(p);
    p->batch_size = b->B;
    p->qo_indptr = b->op == KVA_OP_BATCH_DECODE ? NULL : b->qo_indptr;
    p->kv_indptr = b->kv_indptr;
    if (b->op != KVA_OP_BATCH_PREFILL_RAGGED) {
        p->kv_last_page_len = b->last;
        p->page_size = b->page_size;
        p->num_pages = b->num_pages;
        p->kv_indices = b->indices;
    }
}

static kva_context* make_ctx(int threads) {
    kva_context_options o;
    kva_context_options_init(&o);
    o.backend = KVA_BACKEND_CPU;
    o.num_threads = threads;
    kva_context* ctx = NULL;
    kva_status st = kva_context_create(&o, &ctx);
    if (st != KVA_OK) {
        printf("FATAL: kva_context_create: %s: %s\n", kva_status_string(st), kva_last_error_message());
        exit(1);
    }
    return ctx;
}

typedef struct ws_t {
    void* mem;
    size_t bytes;
    kva_workspace ws;
} ws_t;

/* Workspaces come from a few growing arenas (reused: large fresh allocations would cost millions of page faults).
 * Only the front (status + int region) is filled with garbage: the planner writes nothing else. */
static void* g_arena[4];
static size_t g_arena_cap[4];

static void ws_make(ws_t* w, int which, size_t bytes, unsigned char fill) {
    size_t need = (bytes + 255) / 256 * 256 + 256;
    if (g_arena_cap[which] < need) {
        free(g_arena[which]);
        g_arena[which] = aligned_alloc(256, need);
        if (!g_arena[which]) {
            printf("FATAL: out of memory (workspace of %zu bytes)\n", bytes);
            exit(3);
        }
        g_arena_cap[which] = need;
    }
    w->bytes = bytes;
    w->mem = g_arena[which];
    memset(w->mem, fill, need < ((size_t)4 << 20) ? need : ((size_t)4 << 20));
    memset(&w->ws, 0, sizeof w->ws);
    w->ws.device = w->mem;
    w->ws.device_bytes = bytes;
}

static void ws_free(ws_t* w) { (void)w; }

/* The visible KV interval [lo, hi) of query row i of a request (causal / window; custom masks see all). */
static void visible_range(const kva_attention_desc* d, int32_t qo, int32_t kv, int32_t i, int64_t* lo, int64_t* hi) {
    int64_t qpos = (int64_t)kv - qo + i;
    *lo = 0;
    *hi = kv;
    if (d->mask_mode == KVA_MASK_CAUSAL && qpos + 1 < *hi) *hi = qpos + 1;
    if (d->window_left >= 0 && qpos - d->window_left > *lo) *lo = qpos - d->window_left;
    if (*hi < 0) *hi = 0;
    if (*lo > *hi) *lo = *hi;
}

#define P_EXPECT(cond, ...) H_EXPECT(ok, cond, __VA_ARGS__)

/* All structural invariants of one plan in workspace base. Returns 1 if all hold. */
static int check_plan(const kva_attention_desc* d, const batch* b, const kva_plan_params* pp, const kva_plan* plan,
                      const void* base, int W, const char* what) {
    int ok = 1;
    const kva__plan_data* pd = kva__plan_data_ofc(plan);
    const int32_t g = d->num_qo_heads / d->num_kv_heads, H = d->num_kv_heads;
    P_EXPECT(pd->magic == KVA__PLAN_MAGIC && pd->version == KVA__PLAN_VERSION, "%s: magic/version", what);
    P_EXPECT(pd->op == (uint32_t)b->op && pd->batch_size == b->B && pd->group_size == g, "%s: op/batch/group", what);
    P_EXPECT(pd->total_qo_rows == b->qo_indptr[b->B], "%s: total rows %lld vs %d", what, (long long)pd->total_qo_rows,
             b->qo_indptr[b->B]);
    if (pd->cluster_size > 0) {
        /* thread-block clusters: graph plans run on the clusters' CTAs; eager cluster-combine plans on C x units */
        P_EXPECT(g_cluster > 1 && pd->cluster_size == g_cluster && b->op == KVA_OP_BATCH_DECODE && !pp->disable_split_kv &&
                     pp->fixed_split_size == 0,
                 "%s: cluster size %d on a context of %d", what, pd->cluster_size, g_cluster);
        if (pp->graph_mode) P_EXPECT(pd->num_workers == g_cluster_ctas, "%s: graph cluster plan on %d workers, not %d", what, pd->num_workers, g_cluster_ctas);
        else P_EXPECT(pd->cluster_combine && pd->num_workers % g_cluster == 0 && pd->num_workers <= g_cluster_ctas,
                      "%s: eager cluster plan (combine %d) on %d workers", what, pd->cluster_combine, pd->num_workers);
        W = pd->num_workers;
    } else {
        P_EXPECT(!pd->cluster_combine, "%s: cluster combine without clusters", what);
    }
    P_EXPECT(pd->num_workers == W, "%s: num_workers %d, context has %d", what, pd->num_workers, W);
    P_EXPECT(pd->tile_q >= 1 && pd->tile_q <= KVA__MAX_TILE_Q, "%s: tile_q %d", what, pd->tile_q);
    if (!ok) return 0;
    /* layout */
    const size_t A = KVA__WS_ALIGN;
    size_t offs[] = {pd->off_counts, pd->off_worker_indptr, pd->off_requests, pd->off_items, pd->off_merge,
                     pd->int_region_end, pd->off_partial_o, pd->off_partial_lse, pd->device_bytes};
    for (size_t i = 0; i < sizeof offs / sizeof offs[0]; ++i) P_EXPECT(offs[i] % A == 0, "%s: offset %zu (#%zu) not 256-aligned", what, offs[i], i);
    P_EXPECT(pd->off_counts >= KVA__STATUS_BYTES, "%s: counts overlap the status region", what);
    P_EXPECT(pd->off_counts + sizeof(kva__counts) <= pd->off_worker_indptr, "%s: counts region too small", what);
    if (g_head_bytes > 0) {
        P_EXPECT(pd->off_worker_head % A == 0, "%s: worker header region not 256-aligned", what);
        P_EXPECT(pd->off_worker_indptr + sizeof(int32_t) * (size_t)(W + 1) <= pd->off_worker_head &&
                     pd->off_worker_head + (size_t)g_head_bytes * (size_t)W <= pd->off_requests,
                 "%s: worker header region [%zu, +%d x %d) vs indptr %zu, requests %zu", what, pd->off_worker_head,
                 (int)g_head_bytes, (int)W, pd->off_worker_indptr, pd->off_requests);
    } else {
        P_EXPECT(pd->off_worker_head == 0, "%s: a worker header region (%zu) without worker_head_bytes", what,
                 pd->off_worker_head);
    }
    P_EXPECT(pd->off_worker_indptr + sizeof(int32_t) * (size_t)(W + 1) <= pd->off_requests, "%s: worker_indptr region", what);
    P_EXPECT(pd->off_requests + sizeof(kva__request) * (size_t)pd->max_batch_size <= pd->off_items && pd->max_batch_size >= b->B,
             "%s: request region", what);
    P_EXPECT(pd->off_items + sizeof(kva__work_item) * (size_t)pd->cap_items <= pd->off_merge && pd->num_items <= pd->cap_items,
             "%s: items region", what);
    P_EXPECT(pd->off_merge + sizeof(kva__merge_task) * (size_t)pd->cap_merge <= pd->int_region_end && pd->num_merge <= pd->cap_merge,
             "%s: merge region", what);
    P_EXPECT(pd->int_region_end <= pd->off_partial_o, "%s: partials overlap the int region", what);
    P_EXPECT(pd->off_partial_o + sizeof(float) * (size_t)pd->cap_partials * (size_t)pd->tile_q * (size_t)d->head_dim_vo <= pd->off_partial_lse &&
                 pd->num_partials <= pd->cap_partials,
             "%s: partial o region", what);
    P_EXPECT(pd->off_partial_lse + sizeof(float) * (size_t)pd->cap_partials * (size_t)pd->tile_q <= pd->device_bytes, "%s: partial lse region", what);
    if (!ok) return 0;
    const unsigned char* st = (const unsigned char*)base;
    int zero = 1;
    for (int i = 0; i < KVA__STATUS_BYTES; ++i) zero &= st[i] == 0;
    P_EXPECT(zero, "%s: fault status region not zeroed by plan", what);
    /* counts */
    const kva__counts* cn = kva__ws_counts(pd, base);
    P_EXPECT(cn->batch_size == b->B && cn->num_items == pd->num_items && cn->num_merge == pd->num_merge &&
                 cn->num_partials == pd->num_partials && cn->total_qo_rows == pd->total_qo_rows,
             "%s: counts region disagrees with the plan", what);
    /* requests */
    const kva__request* rq = kva__ws_requests(pd, base);
    int64_t moff = 0;
    for (int32_t i = 0; i < b->B; ++i) {
        P_EXPECT(rq[i].qo_start == (b->op == KVA_OP_BATCH_DECODE ? i : b->qo_indptr[i]) && rq[i].qo_len == b->qo[i] &&
                     rq[i].kv_start == b->kv_indptr[i] && rq[i].kv_len == b->kv[i],
                 "%s: request %d table entry (%d %d %d %d) wrong", what, i, rq[i].qo_start, rq[i].qo_len, rq[i].kv_start, rq[i].kv_len);
        if (d->mask_mode == KVA_MASK_CUSTOM) {
            P_EXPECT(rq[i].mask_offset == moff, "%s: request %d mask offset %lld, expected %lld", what, i, (long long)rq[i].mask_offset, (long long)moff);
            moff += ((int64_t)b->qo[i] * b->kv[i] + 7) / 8;
        }
        if (!ok) return 0;
    }
    if (d->mask_mode == KVA_MASK_CUSTOM) P_EXPECT(pd->custom_mask_bytes == moff, "%s: custom_mask_bytes %lld vs %lld", what, (long long)pd->custom_mask_bytes, (long long)moff);
    /* workers */
    const int32_t* wi = kva__ws_worker_indptr(pd, base);
    P_EXPECT(wi[0] == 0 && wi[W] == pd->num_items, "%s: worker_indptr ends %d..%d, items %d", what, wi[0], wi[W], pd->num_items);
    for (int w = 0; w < W; ++w) P_EXPECT(wi[w + 1] >= wi[w], "%s: worker_indptr decreases at %d", what, w);
    if (!ok) return 0;
    /* items */
    const kva__work_item* it = kva__ws_items(pd, base);
    const int32_t NI = pd->num_items, NP = pd->num_partials, NM = pd->num_merge;
    int32_t* slot_item = (int32_t*)malloc(sizeof(int32_t) * (size_t)(NP + 1));
    for (int32_t s = 0; s < NP; ++s) slot_item[s] = -1;
    int64_t max_item = 0, total = 0, maxw = 0;
    const int decode = pd->op == KVA_OP_BATCH_DECODE;
    for (int w = 0; w < W && ok; ++w) {
        int64_t cw = 0, prev = INT64_MAX;
        /* Order of a worker's list. Decode: longest first (LPT). Prefill: the locality order, i.e. a prefix
           whose (request, head) groups never go back and whose items are longest first within a group, then a
           longest-first suffix (the tail); an LPT list (small plans) is the case of an empty prefix. in_prefix:
           still inside the longest valid prefix; then every later item must be no longer than the one before. */
        int in_prefix = !decode;
        int64_t pgroup = -1;
        for (int32_t k = wi[w]; k < wi[w + 1]; ++k) {
            const kva__work_item* x = &it[k];
            int ib = x->req >= 0 && x->req < b->B;
            P_EXPECT(ib, "%s: item %d request %d out of range", what, k, x->req);
            if (!ib) break;
            int64_t packed = (int64_t)b->qo[x->req] * g;
            P_EXPECT(x->kv_head >= 0 && x->kv_head < H && x->row_start >= 0 && x->rows >= 1 && x->rows <= pd->tile_q &&
                         x->row_start + x->rows <= packed && x->kv_start >= 0 && x->kv_start <= x->kv_end &&
                         x->kv_end <= b->kv[x->req] && x->partial >= -1 && x->partial < NP,
                     "%s: item %d (req %d head %d rows %d+%d kv %d..%d partial %d) out of range (qo %d kv %d tile %d)", what, k,
                     x->req, x->kv_head, x->row_start, x->rows, x->kv_start, x->kv_end, x->partial, b->qo[x->req], b->kv[x->req], pd->tile_q);
            if (!ok) break;
            if (x->partial >= 0) {
                P_EXPECT(slot_item[x->partial] < 0, "%s: partial slot %d written by items %d and %d", what, x->partial, slot_item[x->partial], k);
                slot_item[x->partial] = k;
            }
            int64_t c = (int64_t)(x->kv_end - x->kv_start) + 2 * (int64_t)x->rows;
            const int64_t grp = (int64_t)x->req * H + x->kv_head;
            if (in_prefix && (grp > pgroup || (grp == pgroup && c <= prev))) {
                pgroup = grp;
            } else {
                in_prefix = 0;
                P_EXPECT(c <= prev, "%s: worker %d list not in %s order at item %d", what, w,
                         decode ? "longest-first" : "locality", k);
            }
            prev = c;
            cw += c;
            if (c > max_item) max_item = c;
            if (pd->kv_chunk_size > 0) P_EXPECT(x->kv_end - x->kv_start <= pd->kv_chunk_size, "%s: item %d has %d tokens > chunk %d", what, k, x->kv_end - x->kv_start, pd->kv_chunk_size);
        }
        total += cw;
        if (cw > maxw) maxw = cw;
    }
    if (!ok) {
        free(slot_item);
        return 0;
    }
    for (int32_t s = 0; s < NP; ++s) P_EXPECT(slot_item[s] >= 0, "%s: partial slot %d written by no item", what, s);
    if (pd->cluster_combine) {
        /* one item per CTA; cluster c holds the chunks of one (request, KV head, rows) unit, rank r its r-th chunk
           (contiguous KV ranges in rank order), at most cluster_max_chunk tokens each */
        const int32_t C = pd->cluster_size;
        const int32_t maxc = g_cluster_max_chunk > 0 ? g_cluster_max_chunk : 256;
        ++g_cluster_plans;
        for (int w = 0; w < W && ok; ++w) {
            P_EXPECT(wi[w + 1] - wi[w] <= 1, "%s: cluster worker %d has %d items", what, w, wi[w + 1] - wi[w]);
            if (wi[w + 1] == wi[w]) continue; /* (a later rank of this cluster must then be empty too) */
            const kva__work_item* x = &it[wi[w]];
            P_EXPECT(x->kv_end - x->kv_start <= maxc, "%s: cluster item of %d tokens > %d", what, x->kv_end - x->kv_start, maxc);
            if (w % C == 0) continue;
            P_EXPECT(wi[w] > wi[w - 1], "%s: cluster rank %d of worker %d follows an empty rank", what, w % C, w);
            if (!ok) break;
            const kva__work_item* y = &it[wi[w - 1]];
            P_EXPECT(y->req == x->req && y->kv_head == x->kv_head && y->row_start == x->row_start && y->rows == x->rows &&
                         y->kv_end == x->kv_start && x->partial >= 0 && y->partial >= 0,
                     "%s: cluster worker %d's item (req %d head %d kv %d..%d) does not continue rank %d's (req %d head %d kv %d..%d)",
                     what, w, x->req, x->kv_head, x->kv_start, x->kv_end, w % C - 1, y->req, y->kv_head, y->kv_start, y->kv_end);
        }
    } else if (pd->cluster_size > 0) {
        ++g_cluster_graph_plans;
    }
    /* balance */
    P_EXPECT(total == pd->total_cost && maxw == pd->max_worker_cost, "%s: cost facts: total %lld/%lld max %lld/%lld", what,
             (long long)total, (long long)pd->total_cost, (long long)maxw, (long long)pd->max_worker_cost);
    if (NI > 0) {
        double lb = (double)total / W;
        if ((double)max_item > lb) lb = (double)max_item;
        double bound = 4.0 / 3.0 * lb + (double)max_item;
        P_EXPECT((double)maxw <= bound, "%s: max worker cost %lld > bound %.1f (total %lld, W %d, largest %lld)", what,
                 (long long)maxw, bound, (long long)total, W, (long long)max_item);
        double ratio = (double)maxw / lb;
        if (ratio > g_worst_ratio) g_worst_ratio = ratio;
        /* a sharper lower bound on the optimum: among the W+1 largest items two share a worker */
        int64_t* costs = (int64_t*)malloc(sizeof(int64_t) * (size_t)NI);
        for (int32_t k = 0; k < NI; ++k) costs[k] = (int64_t)(it[k].kv_end - it[k].kv_start) + 2 * (int64_t)it[k].rows;
        qsort(costs, (size_t)NI, sizeof(int64_t), cmp_i64_desc);
        double lb2 = lb;
        if (NI > W && (double)(costs[W - 1] + costs[W]) > lb2) lb2 = (double)(costs[W - 1] + costs[W]);
        free(costs);
        if ((double)maxw / lb2 > g_worst_ratio2) g_worst_ratio2 = (double)maxw / lb2;
    }
    if (pp->disable_split_kv) P_EXPECT(NP == 0 && NM == 0, "%s: disable_split_kv but %d partials", what, NP);
    if (!pp->disable_split_kv && pp->fixed_split_size == 0 && pd->kv_chunk_size > 0) {
        /* the shortest chunk: KVA__MIN_KV_CHUNK, or the context's small_kv_chunk for tiny decode calls */
        const int32_t lo = g_small_chunk > 0 && b->op == KVA_OP_BATCH_DECODE ? g_small_chunk : KVA__MIN_KV_CHUNK;
        P_EXPECT(pd->kv_chunk_size >= lo && pd->kv_chunk_size % 16 == 0, "%s: chunk size %d (shortest %d)", what,
                 pd->kv_chunk_size, lo);
        if (pd->kv_chunk_size < KVA__MIN_KV_CHUNK) { /* ... and then at most KVA__SMALL_SPLIT chunks per tile */
            ++g_small_plans;
            P_EXPECT(b->op == KVA_OP_BATCH_DECODE && g_small_chunk > 0, "%s: chunk %d below the minimum", what,
                     pd->kv_chunk_size);
            const kva__merge_task* mts = kva__ws_merge(pd, base);
            for (int32_t m = 0; m < pd->num_merge; ++m)
                P_EXPECT(mts[m].num_partials <= KVA__SMALL_SPLIT, "%s: chunk %d, merge task %d of %d partials", what,
                         pd->kv_chunk_size, m, mts[m].num_partials);
        }
    }
    if (pp->fixed_split_size > 0 && pd->kv_chunk_size > 0) P_EXPECT(pd->kv_chunk_size == pp->fixed_split_size, "%s: fixed chunk %d vs %d", what, pd->kv_chunk_size, pp->fixed_split_size);
    /* merge tasks */
    const kva__merge_task* mt = kva__ws_merge(pd, base);
    int32_t* slot_task = (int32_t*)malloc(sizeof(int32_t) * (size_t)(NP + 1));
    for (int32_t s = 0; s < NP; ++s) slot_task[s] = -1;
    for (int32_t m = 0; m < NM && ok; ++m) {
        const kva__merge_task* t = &mt[m];
        P_EXPECT(t->partial_first >= 0 && t->num_partials >= 2 && t->partial_first + t->num_partials <= NP,
                 "%s: merge task %d slots %d+%d out of [0, %d)", what, m, t->partial_first, t->num_partials, NP);
        if (!ok) break;
        for (int32_t k = 0; k < t->num_partials; ++k) {
            int32_t s = t->partial_first + k;
            P_EXPECT(slot_task[s] < 0, "%s: slot %d read by merge tasks %d and %d", what, s, slot_task[s], m);
            slot_task[s] = m;
            const kva__work_item* x = &it[slot_item[s]];
            P_EXPECT(x->req == t->req && x->kv_head == t->kv_head && x->row_start == t->row_start && x->rows == t->rows,
                     "%s: merge task %d slot %d belongs to another tile", what, m, s);
            if (k > 0) {
                const kva__work_item* p = &it[slot_item[s - 1]];
                P_EXPECT(p->kv_end == x->kv_start, "%s: merge task %d: slots %d, %d are not consecutive KV chunks (%d..%d, %d..%d)",
                         what, m, s - 1, s, p->kv_start, p->kv_end, x->kv_start, x->kv_end);
            }
            if (pp->fixed_split_size > 0 && k + 1 < t->num_partials)
                P_EXPECT(x->kv_end - x->kv_start == pp->fixed_split_size, "%s: fixed split chunk of %d tokens", what, x->kv_end - x->kv_start);
            if (!ok) break;
        }
    }
    for (int32_t s = 0; s < NP && ok; ++s) P_EXPECT(slot_task[s] >= 0, "%s: partial slot %d merged by no task", what, s);
    /* coverage: per (request, head, packed row) */
    for (int32_t r = 0; r < b->B && ok; ++r) {
        int64_t packed = (int64_t)b->qo[r] * g;
        if (packed == 0) continue;
        for (int32_t h = 0; h < H && ok; ++h) {
            int32_t* direct = (int32_t*)calloc((size_t)packed, sizeof(int32_t));
            int32_t* task = (int32_t*)calloc((size_t)packed, sizeof(int32_t));
            int64_t* lo = (int64_t*)calloc((size_t)packed, sizeof(int64_t));
            int64_t* hi = (int64_t*)calloc((size_t)packed, sizeof(int64_t));
            for (int32_t k = 0; k < NI; ++k) {
                const kva__work_item* x = &it[k];
                if (x->req != r || x->kv_head != h || x->partial >= 0) continue;
                for (int32_t p = x->row_start; p < x->row_start + x->rows; ++p) {
                    direct[p]++;
                    lo[p] = x->kv_start;
                    hi[p] = x->kv_end;
                }
            }
            for (int32_t m = 0; m < NM; ++m) {
                const kva__merge_task* t = &mt[m];
                if (t->req != r || t->kv_head != h) continue;
                for (int32_t p = t->row_start; p < t->row_start + t->rows; ++p) {
                    task[p]++;
                    lo[p] = it[slot_item[t->partial_first]].kv_start;
                    hi[p] = it[slot_item[t->partial_first + t->num_partials - 1]].kv_end;
                }
            }
            for (int64_t p = 0; p < packed && ok; ++p) {
                P_EXPECT(direct[p] + task[p] == 1, "%s: request %d head %d packed row %lld produced %d times directly and %d by merges",
                         what, r, h, (long long)p, direct[p], task[p]);
                int64_t vlo, vhi;
                visible_range(d, b->qo[r], b->kv[r], (int32_t)(p / g), &vlo, &vhi);
                if (ok && vhi > vlo)
                    P_EXPECT(lo[p] <= vlo && hi[p] >= vhi, "%s: request %d head %d row %lld: KV %lld..%lld misses visible %lld..%lld",
                             what, r, h, (long long)p, (long long)lo[p], (long long)hi[p], (long long)vlo, (long long)vhi);
            }
            free(direct);
            free(task);
            free(lo);
            free(hi);
        }
    }
    free(slot_item);
    free(slot_task);
    g_plans++;
    g_items += NI;
    g_partials += NP;
    return ok;
}

static void random_desc(kva_attention_desc* d, h_rng* r, kva_op op) {
    static const int groups[] = {1, 2, 3, 4, 5, 7, 8, 16};
    int32_t hkv = (int32_t)h_rng_range(r, 1, 4);
    int32_t g = groups[h_rng_range(r, 0, 7)];
    static const int dims[] = {64, 128, 256};
    kva_attention_desc_init(d, hkv * g, hkv, dims[h_rng_range(r, 0, 2)], KVA_DTYPE_F16);
    int64_t m = h_rng_range(r, 0, 2);
    d->mask_mode = m == 0 ? KVA_MASK_NONE : m == 1 ? KVA_MASK_CAUSAL : KVA_MASK_CUSTOM;
    if (op == KVA_OP_BATCH_DECODE && d->mask_mode == KVA_MASK_CUSTOM) d->mask_mode = KVA_MASK_CAUSAL;
    if (h_rng_range(r, 0, 3) == 0) d->window_left = (int32_t)h_rng_range(r, 0, 500);
}

static const kva_op k_ops[] = {KVA_OP_BATCH_DECODE, KVA_OP_BATCH_PREFILL_PAGED, KVA_OP_BATCH_PREFILL_RAGGED};
static const int k_workers[] = {1, 2, 3, 5, 8, 16, 64};
#define NW ((int)(sizeof k_workers / sizeof k_workers[0]))

/* Structural invariants + determinism over random batches, modes and worker counts. */
static void test_random_plans(kva_context** ctxs, kva_context** ctxs2, int count) {
    h_rng r;
    h_rng_seed(&r, h_opt.seed * 7919 + 11);
    for (int n = 0; n < count; ++n) {
        int wi = (int)h_rng_range(&r, 0, NW - 1);
        int W = k_workers[wi];
        kva_op op = k_ops[h_rng_range(&r, 0, 2)];
        kva_attention_desc d;
        random_desc(&d, &r, op);
        batch b;
        batch_random(&b, op, &r, h_rng_range(&r, 0, 3) == 0 ? 300 : 12);
        kva_plan_params pp;
        params_of(&b, &pp);
        int64_t mode = h_rng_range(&r, 0, 5);
        if (mode == 1) pp.fixed_split_size = (int32_t)h_rng_range(&r, 1, 600);
        if (mode == 2) pp.disable_split_kv = 1;
        if (mode == 3) {
            pp.graph_mode = 1;
            pp.max_batch_size = b.B + (int32_t)h_rng_range(&r, 1, 10);
            pp.max_total_qo_rows = b.qo_indptr[b.B] + h_rng_range(&r, 0, 100);
        }
        /* half the plans on contexts with the CUDA backend's small-call chunk floor (set here on CPU contexts) */
        g_small_chunk = h_rng_range(&r, 0, 1) ? 64 : 0;
        ctxs[wi]->small_kv_chunk = ctxs2[wi]->small_kv_chunk = g_small_chunk;
        g_head_bytes = h_rng_range(&r, 0, 1) ? 64 : 0; /* the CUDA backend's per-worker header region */
        /* a third of the plans on contexts with thread-block clusters (the CUDA backend's cluster combine on sm_90) */
        g_cluster = h_rng_range(&r, 0, 2) == 0 ? (h_rng_range(&r, 0, 1) ? 8 : 4) : 0;
        g_cluster_ctas = g_cluster ? g_cluster * (int32_t)h_rng_range(&r, 1, 40) : 0;
        g_cluster_max_chunk = g_cluster ? (int32_t)(h_rng_range(&r, 0, 2) * 256) : 0;
        ctxs[wi]->cluster_size = ctxs2[wi]->cluster_size = g_cluster;
        ctxs[wi]->cluster_ctas = ctxs2[wi]->cluster_ctas = g_cluster_ctas;
        ctxs[wi]->cluster_max_chunk = ctxs2[wi]->cluster_max_chunk = g_cluster_max_chunk;
        ctxs[wi]->worker_head_bytes = ctxs2[wi]->worker_head_bytes = g_head_bytes;
        char what[160];
        snprintf(what, sizeof what, "plan #%d (op %d, W %d, B %d, mode %d, g %d, mask %d, win %d, small %d)", n, (int)op, W,
                 b.B, (int)mode, d.num_qo_heads / d.num_kv_heads, (int)d.mask_mode, d.window_left, g_small_chunk);
        size_t dev = 0, host = 0;
        kva_status st = kva_plan_workspace_size(ctxs[wi], &d, op, &pp, &dev, &host);
        if (!H_CHECK(st == KVA_OK, "%s: workspace_size: %s: %s", what, kva_status_string(st), kva_last_error_message())) {
            batch_free(&b);
            continue;
        }
        if (dev > ((size_t)512 << 20)) { /* tiny fixed splits of 40k-token requests: legal, but not on this machine */
            ++h_nskip;
            batch_free(&b);
            continue;
        }
        ws_t w1, w2;
        ws_make(&w1, 0, dev, 0xee);
        ws_make(&w2, 1, dev, 0x11);
        kva_plan p1, p2, p3;
        memset(&p1, 0xab, sizeof p1);
        memset(&p2, 0x00, sizeof p2);
        st = kva_plan_make(ctxs[wi], &d, op, &pp, &w1.ws, &p1, NULL);
        if (H_CHECK(st == KVA_OK, "%s: plan: %s: %s", what, kva_status_string(st), kva_last_error_message())) {
            int ok = check_plan(&d, &b, &pp, &p1, w1.mem, W, what);
            kva_plan_info info;
            kva_plan_get_info(&p1, &info);
            ok &= info.device_bytes == dev && info.num_work_items == kva__plan_data_ofc(&p1)->num_items;
            /* determinism: same context, same workspace -> identical plan bytes; another workspace and another
               context with the same W -> identical int region */
            const kva__plan_data* pd = kva__plan_data_ofc(&p1);
            size_t n_int = pd->int_region_end;
            unsigned char* snapshot = (unsigned char*)malloc(n_int + 1);
            memcpy(snapshot, w1.mem, n_int);
            st = kva_plan_make(ctxs[wi], &d, op, &pp, &w1.ws, &p2, NULL);
            {
                /* identical but for the stamp, which is later (run refuses p1 from now on), and the seal over it */
                kva_plan q1 = p1, q2 = p2;
                ok &= kva__plan_data_ofc(&p2)->stamp > kva__plan_data_ofc(&p1)->stamp;
                kva__plan_data_of(&q1)->stamp = kva__plan_data_of(&q2)->stamp = 0;
                kva__plan_data_of(&q1)->seal = kva__plan_data_of(&q2)->seal = 0;
                ok &= st == KVA_OK && memcmp(&q1, &q2, sizeof q1) == 0 && memcmp(snapshot, w1.mem, n_int) == 0;
            }
            if (!ok) h_note(__FILE__, __LINE__, "%s: replanning the same inputs changed the plan", what);
            st = kva_plan_make(ctxs2[wi], &d, op, &pp, &w2.ws, &p3, NULL);
            int same = st == KVA_OK;
            /* regions with meaning (padding between regions is not written) */
            size_t regs[5][2] = {{pd->off_counts, sizeof(kva__counts)},
                                 {pd->off_worker_indptr, sizeof(int32_t) * (size_t)(pd->num_workers + 1)},
                                 {pd->off_requests, sizeof(kva__request) * (size_t)b.B},
                                 {pd->off_items, sizeof(kva__work_item) * (size_t)pd->num_items},
                                 {pd->off_merge, sizeof(kva__merge_task) * (size_t)pd->num_merge}};
            for (int k = 0; k < 5 && same; ++k)
                same &= memcmp((char*)w1.mem + regs[k][0], (char*)w2.mem + regs[k][0], regs[k][1]) == 0;
            if (!same) h_note(__FILE__, __LINE__, "%s: another context/workspace with the same W gave another int region", what);
            ok &= same;
            if (op != KVA_OP_BATCH_PREFILL_RAGGED && b.B > 0) {
                /* the block-table form of the same batch (rows of max pages + 0..2 entries, the spare ones outside the
                   pool): the same work list, requests that differ only in kv_start = b x stride */
                int32_t maxp = 0;
                for (int32_t i = 0; i < b.B; ++i)
                    if (b.kv_indptr[i + 1] - b.kv_indptr[i] > maxp) maxp = b.kv_indptr[i + 1] - b.kv_indptr[i];
                const int32_t stride = maxp + (int32_t)h_rng_range(&r, 0, 2) + (maxp == 0);
                int32_t* bt = (int32_t*)malloc(sizeof(int32_t) * (size_t)b.B * (size_t)stride);
                for (int64_t i = 0; i < (int64_t)b.B * stride; ++i) bt[i] = -1 - (int32_t)(i % 7);
                for (int32_t i = 0; i < b.B; ++i)
                    memcpy(bt + (int64_t)i * stride, b.indices + b.kv_indptr[i],
                           sizeof(int32_t) * (size_t)(b.kv_indptr[i + 1] - b.kv_indptr[i]));
                kva_plan_params pb = pp;
                pb.kv_indptr = NULL;
                pb.kv_last_page_len = NULL;
                pb.kv_seq_lens = b.kv;
                pb.block_table_stride = stride;
                pb.kv_indices = bt;
                kva_plan p4;
                st = kva_plan_make(ctxs2[wi], &d, op, &pb, &w2.ws, &p4, NULL);
                int bsame = st == KVA_OK && kva__plan_data_ofc(&p4)->num_items == pd->num_items &&
                            kva__plan_data_ofc(&p4)->num_merge == pd->num_merge;
                for (int k = 0; k < 5 && bsame; ++k) {
                    if (k == 2) continue; /* requests: below */
                    bsame &= memcmp((char*)w1.mem + regs[k][0], (char*)w2.mem + regs[k][0], regs[k][1]) == 0;
                }
                const kva__request* r1 = (const kva__request*)((char*)w1.mem + pd->off_requests);
                const kva__request* r2 = (const kva__request*)((char*)w2.mem + pd->off_requests);
                for (int32_t i = 0; i < b.B && bsame; ++i) {
                    kva__request x = r1[i];
                    x.kv_start = i * stride;
                    bsame &= memcmp(&x, &r2[i], sizeof x) == 0;
                }
                if (!bsame)
                    h_note(__FILE__, __LINE__, "%s: the block-table form (stride %d) planned otherwise: %s", what,
                           (int)stride, st == KVA_OK ? "another work list" : kva_last_error_message());
                ok &= bsame;
                free(bt);
            }
            free(snapshot);
            if (ok) h_pass();
            else h_failf(__FILE__, __LINE__, "%s (replay: test_planner --seed %llu)", what, (unsigned long long)h_opt.seed);
        }
        ws_free(&w1);
        ws_free(&w2);
        batch_free(&b);
    }
    for (int i = 0; i < NW; ++i) {
        ctxs[i]->small_kv_chunk = ctxs2[i]->small_kv_chunk = 0;
        ctxs[i]->worker_head_bytes = ctxs2[i]->worker_head_bytes = 0;
        ctxs[i]->cluster_size = ctxs2[i]->cluster_size = 0;
        ctxs[i]->cluster_ctas = ctxs2[i]->cluster_ctas = 0;
        ctxs[i]->cluster_max_chunk = ctxs2[i]->cluster_max_chunk = 0;
    }
    g_cluster = g_cluster_ctas = g_cluster_max_chunk = 0;
    g_small_chunk = 0;
    g_head_bytes = 0;
    if (count >= 500) { /* the random batches include tiny decode calls on the wide contexts */
        H_CHECK(g_small_plans > 0, "no plan took the small-call chunk floor in %d plans", count);
        H_CHECK(g_cluster_plans > 0 && g_cluster_graph_plans > 0, "cluster plans: %d combine, %d graph-only in %d plans",
                g_cluster_plans, g_cluster_graph_plans, count);
    }
}

/* Graph mode: same bounds -> same offsets, capacities, tile size, sizes; all under kva_workspace_bound. */
static void test_graph_mode(kva_context** ctxs) {
    h_rng r;
    h_rng_seed(&r, h_opt.seed * 31 + 5);
    for (int n = 0; n < 30; ++n) {
        int wi = (int)h_rng_range(&r, 0, NW - 1), W = k_workers[wi];
        kva_op op = k_ops[h_rng_range(&r, 0, 2)];
        kva_attention_desc d;
        random_desc(&d, &r, op);
        int32_t maxb = (int32_t)h_rng_range(&r, 1, 64);
        int64_t maxr = op == KVA_OP_BATCH_DECODE ? maxb : maxb * h_rng_range(&r, 1, 40);
        size_t bd = 0, bh = 0;
        kva_status st = kva_workspace_bound(ctxs[wi], &d, op, maxb, maxr, &bd, &bh);
        if (!H_CHECK(st == KVA_OK, "graph: kva_workspace_bound: %s", kva_status_string(st))) continue;
        ws_t w;
        ws_make(&w, 0, bd, 0x77);
        kva__plan_data first;
        int have = 0, ok = 1;
        for (int k = 0; k < 8 && ok; ++k) {
            batch b;
            memset(&b, 0, sizeof b);
            b.op = op;
            b.page_size = 16;
            b.B = (int32_t)h_rng_range(&r, 0, maxb);
            int64_t rows_left = maxr;
            for (int32_t i = 0; i < b.B; ++i) {
                b.kv[i] = rand_kv(&r);
                if (op == KVA_OP_BATCH_DECODE) b.qo[i] = 1;
                else {
                    int64_t hi = rows_left / (b.B - i);
                    if (hi > b.kv[i] + 1) hi = b.kv[i] + 1;
                    b.qo[i] = (int32_t)h_rng_range(&r, 0, hi);
                    rows_left -= b.qo[i];
                }
            }
            batch_finish(&b, &r);
            kva_plan_params pp;
            params_of(&b, &pp);
            pp.graph_mode = 1;
            pp.max_batch_size = maxb;
            pp.max_total_qo_rows = maxr;
            size_t dev = 0, host = 0;
            st = kva_plan_workspace_size(ctxs[wi], &d, op, &pp, &dev, &host);
            H_EXPECT(ok, st == KVA_OK && dev <= bd && host <= bh, "graph: size %zu/%zu vs bound %zu/%zu (%s)", dev, host, bd, bh,
                     kva_status_string(st));
            kva_plan p;
            st = kva_plan_make(ctxs[wi], &d, op, &pp, &w.ws, &p, NULL);
            H_EXPECT(ok, st == KVA_OK, "graph plan: %s: %s", kva_status_string(st), kva_last_error_message());
            if (st == KVA_OK) {
                char what[96];
                snprintf(what, sizeof what, "graph plan %d.%d (W %d, B %d <= %d)", n, k, W, b.B, maxb);
                ok &= check_plan(&d, &b, &pp, &p, w.mem, W, what);
                const kva__plan_data* pd = kva__plan_data_ofc(&p);
                if (!have) {
                    first = *pd;
                    have = 1;
                } else {
                    H_EXPECT(ok,
                             pd->off_counts == first.off_counts && pd->off_worker_indptr == first.off_worker_indptr &&
                                 pd->off_requests == first.off_requests && pd->off_items == first.off_items &&
                                 pd->off_merge == first.off_merge && pd->int_region_end == first.int_region_end &&
                                 pd->off_partial_o == first.off_partial_o && pd->off_partial_lse == first.off_partial_lse &&
                                 pd->device_bytes == first.device_bytes && pd->host_bytes == first.host_bytes &&
                                 pd->num_workers == first.num_workers && pd->tile_q == first.tile_q &&
                                 pd->cap_items == first.cap_items && pd->cap_merge == first.cap_merge &&
                                 pd->cap_partials == first.cap_partials && pd->max_batch_size == first.max_batch_size &&
                                 pd->graph_mode && memcmp(pd->backend_data, first.backend_data, sizeof first.backend_data) == 0,
                             "%s: graph-mode layout changed between plans", what);
                }
            }
            batch_free(&b);
        }
        ws_free(&w);
        if (ok) h_pass();
        else h_failf(__FILE__, __LINE__, "graph mode stability, round %d (seed %llu)", n, (unsigned long long)h_opt.seed);
    }
}

/* kva_workspace_bound >= the exact size of every batch under the bound (non-graph plans). */
static void test_bound(kva_context** ctxs) {
    h_rng r;
    h_rng_seed(&r, h_opt.seed * 131 + 7);
    int ok = 1;
    for (int n = 0; n < 300; ++n) {
        int wi = (int)h_rng_range(&r, 0, NW - 1);
        kva_op op = k_ops[h_rng_range(&r, 0, 2)];
        kva_attention_desc d;
        random_desc(&d, &r, op);
        batch b;
        batch_random(&b, op, &r, 40);
        kva_plan_params pp;
        params_of(&b, &pp);
        if (h_rng_range(&r, 0, 3) == 0) pp.disable_split_kv = 1;
        int32_t maxb = b.B > 0 ? b.B : 1;
        int64_t maxr = b.qo_indptr[b.B];
        size_t dev = 0, host = 0, bd = 0, bh = 0;
        kva_status s1 = kva_plan_workspace_size(ctxs[wi], &d, op, &pp, &dev, &host);
        kva_status s2 = kva_workspace_bound(ctxs[wi], &d, op, maxb, maxr, &bd, &bh);
        H_EXPECT(ok, s1 == KVA_OK && s2 == KVA_OK, "bound #%d: %s / %s", n, kva_status_string(s1), kva_status_string(s2));
        H_EXPECT(ok, dev <= bd && host <= bh, "bound #%d: exact %zu/%zu > bound %zu/%zu (W %d op %d B %d rows %lld g %d)", n, dev, host,
                 bd, bh, k_workers[wi], (int)op, b.B, (long long)maxr, d.num_qo_heads / d.num_kv_heads);
        batch_free(&b);
        if (!ok) break;
    }
    H_CHECK(ok, "kva_workspace_bound >= kva_plan_workspace_size over 300 random batches");
}

/* Fixed split: the chunk pieces each row of request 0 sees are the same whatever the other requests are.
 * A piece is (head * 2^20 + packed row, first, end) of an item's KV range clipped to the row's visible range. */
static int cmp_piece(const void* a, const void* b) {
    const int64_t* x = (const int64_t*)a;
    const int64_t* y = (const int64_t*)b;
    for (int i = 0; i < 3; ++i)
        if (x[i] != y[i]) return x[i] < y[i] ? -1 : 1;
    return 0;
}

static int64_t* collect_pieces(const kva_attention_desc* d, const batch* b, const kva_plan* plan, const void* base,
                               int32_t req, int64_t* n_out) {
    const kva__plan_data* pd = kva__plan_data_ofc(plan);
    const kva__work_item* it = kva__ws_items(pd, base);
    const int32_t g = d->num_qo_heads / d->num_kv_heads;
    int64_t cap = 64, n = 0;
    int64_t* out = (int64_t*)malloc(sizeof(int64_t) * 3 * (size_t)cap);
    for (int32_t k = 0; k < pd->num_items; ++k) {
        const kva__work_item* x = &it[k];
        if (x->req != req) continue;
        for (int32_t p = x->row_start; p < x->row_start + x->rows; ++p) {
            int64_t vlo, vhi;
            visible_range(d, b->qo[req], b->kv[req], p / g, &vlo, &vhi);
            int64_t s0 = x->kv_start > vlo ? x->kv_start : vlo, e0 = x->kv_end < vhi ? x->kv_end : vhi;
            if (s0 >= e0) continue;
            if (n == cap) {
                cap *= 2;
                out = (int64_t*)realloc(out, sizeof(int64_t) * 3 * (size_t)cap);
            }
            out[3 * n] = ((int64_t)x->kv_head << 20) + p;
            out[3 * n + 1] = s0;
            out[3 * n + 2] = e0;
            ++n;
        }
    }
    qsort(out, (size_t)n, sizeof(int64_t) * 3, cmp_piece);
    *n_out = n;
    return out;
}

static void test_fixed_split(kva_context** ctxs) {
    h_rng r;
    h_rng_seed(&r, h_opt.seed * 977 + 3);
    int bad = 0, tested = 0;
    for (int n = 0; n < 40; ++n) {
        int wi = (int)h_rng_range(&r, 0, NW - 1), W = k_workers[wi];
        kva_op op = k_ops[h_rng_range(&r, 1, 2)];
        kva_attention_desc d;
        random_desc(&d, &r, op);
        int32_t fs = (int32_t)h_rng_range(&r, 8, 300);
        batch a, b2;
        batch_random(&a, op, &r, 10);
        if (a.B == 0) {
            batch_free(&a);
            continue;
        }
        a.qo[0] = (int32_t)h_rng_range(&r, 1, 40);
        a.kv[0] = (int32_t)h_rng_range(&r, a.qo[0], 3000);
        batch_free(&a);
        batch_finish(&a, &r);
        batch_random(&b2, op, &r, 30);
        if (b2.B == 0) b2.B = 1;
        b2.qo[0] = a.qo[0];
        b2.kv[0] = a.kv[0];
        b2.page_size = a.page_size;
        batch_free(&b2);
        batch_finish(&b2, &r);
        kva_plan_params pa, pb;
        params_of(&a, &pa);
        params_of(&b2, &pb);
        pa.fixed_split_size = pb.fixed_split_size = fs;
        size_t da, db, ha, hb;
        kva_plan plan_a, plan_b;
        if (kva_plan_workspace_size(ctxs[wi], &d, op, &pa, &da, &ha) != KVA_OK ||
            kva_plan_workspace_size(ctxs[wi], &d, op, &pb, &db, &hb) != KVA_OK) {
            h_failf(__FILE__, __LINE__, "fixed split: workspace_size failed: %s", kva_last_error_message());
            batch_free(&a);
            batch_free(&b2);
            continue;
        }
        if (da > ((size_t)512 << 20) || db > ((size_t)512 << 20)) {
            ++h_nskip;
            batch_free(&a);
            batch_free(&b2);
            continue;
        }
        ws_t wa, wb;
        ws_make(&wa, 0, da, 0);
        ws_make(&wb, 1, db, 0);
        if (kva_plan_make(ctxs[wi], &d, op, &pa, &wa.ws, &plan_a, NULL) == KVA_OK &&
            kva_plan_make(ctxs[wi], &d, op, &pb, &wb.ws, &plan_b, NULL) == KVA_OK) {
            int64_t na = 0, nb = 0;
            int64_t* xa = collect_pieces(&d, &a, &plan_a, wa.mem, 0, &na);
            int64_t* xb = collect_pieces(&d, &b2, &plan_b, wb.mem, 0, &nb);
            ++tested;
            if (na != nb || memcmp(xa, xb, sizeof(int64_t) * 3 * (size_t)na) != 0) {
                ++bad;
                if (bad <= 3)
                    h_note(__FILE__, __LINE__,
                           "fixed split %d: request 0 (qo %d, kv %d, mask %d, window %d) is chunked differently in two batches "
                           "(tile_q %d vs %d, W %d)",
                           fs, a.qo[0], a.kv[0], (int)d.mask_mode, d.window_left, kva__plan_data_ofc(&plan_a)->tile_q,
                           kva__plan_data_ofc(&plan_b)->tile_q, W);
            }
            free(xa);
            free(xb);
        } else {
            h_failf(__FILE__, __LINE__, "fixed split: plan failed: %s", kva_last_error_message());
        }
        ws_free(&wa);
        ws_free(&wb);
        batch_free(&a);
        batch_free(&b2);
    }
    H_CHECK(bad == 0, "fixed_split_size: chunking of a request independent of the batch (%d of %d pairs differ)", bad, tested);
}

/* Locality order (prefill): with many more items than workers, the first item of every worker comes from the
 * first (request, KV head) group, so the CTAs that start together read the same K/V; the tail is longest first. */
static void test_locality(kva_context** ctxs) {
    int wi = 0;
    while (wi < NW && k_workers[wi] != 8) ++wi;
    if (!H_CHECK(wi < NW, "locality: no 8-worker context")) return;
    const int W = k_workers[wi];
    h_rng r;
    h_rng_seed(&r, h_opt.seed * 31 + 7);
    kva_attention_desc d;
    kva_attention_desc_init(&d, 8, 8, 128, KVA_DTYPE_BF16);
    d.mask_mode = KVA_MASK_CAUSAL;
    batch b;
    memset(&b, 0, sizeof b);
    b.op = KVA_OP_BATCH_PREFILL_RAGGED;
    b.B = 4;
    for (int i = 0; i < b.B; ++i) b.qo[i] = b.kv[i] = 1024;
    batch_finish(&b, &r);
    kva_plan_params pp;
    params_of(&b, &pp);
    pp.disable_split_kv = 1;
    size_t dev = 0, host = 0;
    kva_status st = kva_plan_workspace_size(ctxs[wi], &d, b.op, &pp, &dev, &host);
    if (H_CHECK(st == KVA_OK, "locality: size: %s", kva_last_error_message())) {
        ws_t w;
        ws_make(&w, 0, dev, 0x5a);
        kva_plan p;
        st = kva_plan_make(ctxs[wi], &d, b.op, &pp, &w.ws, &p, NULL);
        if (H_CHECK(st == KVA_OK, "locality: plan: %s", kva_last_error_message())) {
            H_CHECK(check_plan(&d, &b, &pp, &p, w.mem, W, "locality 4 x 1024 MHA 8 heads W 8"), "locality: plan invariants");
            const kva__plan_data* pd = kva__plan_data_ofc(&p);
            const int32_t* ind = kva__ws_worker_indptr(pd, w.mem);
            const kva__work_item* it = kva__ws_items(pd, w.mem);
            int firsts = 0, last_small = 1;
            for (int k = 0; k < W; ++k) {
                if (ind[k + 1] > ind[k] && it[ind[k]].req == 0 && it[ind[k]].kv_head == 0) ++firsts;
                /* every worker ends on a short tail item (longest first across the tail's groups) */
                if (ind[k + 1] > ind[k] && it[ind[k + 1] - 1].kv_end - it[ind[k + 1] - 1].kv_start > 512) last_small = 0;
            }
            H_CHECK(firsts == W, "locality: %d of %d workers start in group (request 0, head 0)", firsts, W);
            H_CHECK(last_small, "locality: a worker ends on an item longer than 512 keys");
        }
        ws_free(&w);
    }
    batch_free(&b);
}

/* Row-slot plans: the CUDA backend's kv_head_group hook (GQA groups of 9 to 32 on sm_90: one KV head per unit, one
 * worker per SM) stood in for on a CPU context of 264 workers with 132 SMs. The merge of a unit loads 16 partials a
 * round trip, so the planner takes 32 chunks where the split would give 33 (kva__rs_round_chunk), and keeps the
 * count where it is a multiple of 16 or the rule is off ($KVATTN_BENCH_RS_ROUND=0: rs_merge_batch 0). Where two or more
 * units of groups of at most rs_multi_group (16) are split, at most rs_multi_split (32) chunks per unit. */
static int32_t rs_hook(const kva_context* ctx, const kva_attention_desc* desc, kva_op op, const kva_plan_params* params,
                       int64_t total_kv, int64_t max_kv, int32_t* workers, int32_t* row_slots) {
    (void)ctx, (void)params, (void)total_kv, (void)max_kv;
    const int32_t g = desc->num_qo_heads / desc->num_kv_heads;
    if (op == KVA_OP_BATCH_DECODE && g >= 9 && g <= 32) {
        *row_slots = 16;
        *workers = 132;
    }
    return 1;
}

static void test_row_slots(void) {
    kva_context* ctx = make_ctx(2);
    const kva__backend_ops* saved_ops = ctx->ops;
    const int32_t saved_w = ctx->num_workers, saved_b = ctx->rs_merge_batch, saved_m = ctx->rs_multi_split;
    const int32_t saved_g = ctx->rs_multi_group;
    kva__backend_ops ops = *ctx->ops;
    ops.kv_head_group = rs_hook;
    ctx->ops = &ops;
    ctx->num_workers = 264;
    static const struct {
        int32_t hq, hkv, B, kv, batch, multi, want, group; /* group: rs_multi_group, 0 = the default (16) */
    } cases[] = {
        /* the rounding alone (rs_multi_split 0) */
        {48, 4, 1, 32768, 16, 0, 32, 0},
        {48, 4, 1, 32768, 0, 0, 33, 0},
        {40, 4, 1, 65536, 16, 0, 32, 0},
        {40, 4, 1, 65536, 0, 0, 33, 0},
        {64, 4, 1, 131072, 16, 0, 32, 0},
        {64, 4, 1, 131072, 0, 0, 33, 0},
        {24, 2, 1, 32768, 16, 0, 64, 0},
        {12, 1, 1, 32768, 16, 0, 64, 0},
        {48, 4, 2, 20000, 16, 0, 16, 0},
        {16, 1, 1, 1000, 16, 0, 8, 0},
        {48, 4, 1, 4224, 16, 0, 33, 0}, /* 32 chunks of a multiple of 16 tokens do not cover 4224 evenly: kept */
        /* at most 32 chunks where two or more units of groups <= 16 are split (rs_multi_split 32, the default) */
        {24, 2, 1, 32768, 16, 32, 32, 0},
        {24, 2, 1, 32768, 0, 32, 32, 0},
        {16, 1, 2, 32768, 16, 32, 32, 0},
        {48, 4, 1, 32768, 0, 32, 32, 0},
        {12, 1, 1, 32768, 16, 32, 64, 0},  /* one unit */
        {64, 2, 1, 65536, 16, 32, 64, 0},  /* a group of 32 */
        {40, 2, 1, 32768, 16, 32, 64, 0},  /* a group of 20 */
        {24, 2, 1, 131072, 16, 32, 32, 0},
        {16, 1, 3, 32768, 16, 32, 32, 0},  /* three requests of one KV head: 44 chunks without the rule */
        {32, 1, 2, 16384, 16, 32, 64, 0},  /* a group of 32 */
        /* rs_multi_group moves the largest group the rule takes ($KVATTN_BENCH_RS_MULTI_GROUP) */
        {40, 2, 1, 32768, 16, 32, 32, 32}, /* a group of 20 */
        {64, 2, 1, 65536, 16, 32, 32, 32}, /* a group of 32 */
        {64, 2, 1, 65536, 16, 32, 64, 24},
        {24, 2, 1, 32768, 16, 32, 64, 8},  /* a group of 12 over a limit of 8 */
    };
    for (size_t c = 0; c < sizeof cases / sizeof cases[0]; ++c) {
        char what[160];
        snprintf(what, sizeof what, "row slots %d/%d %d x %d, merge batch %d, multi-unit split %d (groups <= %d)",
                 cases[c].hq, cases[c].hkv, cases[c].B, cases[c].kv, cases[c].batch, cases[c].multi,
                 cases[c].group ? cases[c].group : KVA__RS_MULTI_GROUP);
        ctx->rs_merge_batch = cases[c].batch;
        ctx->rs_multi_split = cases[c].multi;
        ctx->rs_multi_group = cases[c].group ? cases[c].group : KVA__RS_MULTI_GROUP;
        kva_attention_desc d;
        kva_attention_desc_init(&d, cases[c].hq, cases[c].hkv, 128, KVA_DTYPE_F16);
        batch b;
        memset(&b, 0, sizeof b);
        b.op = KVA_OP_BATCH_DECODE;
        b.B = cases[c].B;
        b.page_size = 16;
        for (int32_t i = 0; i < b.B; ++i) {
            b.qo[i] = 1;
            b.kv[i] = cases[c].kv;
        }
        h_rng r;
        h_rng_seed(&r, h_opt.seed + c);
        batch_finish(&b, &r);
        kva_plan_params pp;
        params_of(&b, &pp);
        size_t dev = 0, host = 0;
        kva_status st = kva_plan_workspace_size(ctx, &d, b.op, &pp, &dev, &host);
        if (!H_CHECK(st == KVA_OK, "%s: workspace_size: %s", what, kva_last_error_message())) {
            batch_free(&b);
            continue;
        }
        ws_t w;
        ws_make(&w, 0, dev, 0x5a);
        kva_plan plan;
        st = kva_plan_make(ctx, &d, b.op, &pp, &w.ws, &plan, NULL);
        if (H_CHECK(st == KVA_OK, "%s: plan: %s", what, kva_last_error_message())) {
            const kva__plan_data* pd = kva__plan_data_ofc(&plan);
            const kva__merge_task* mt = (const kva__merge_task*)((const char*)w.mem + pd->off_merge);
            int32_t most = 1;
            for (int32_t t = 0; t < pd->num_merge; ++t)
                if (mt[t].num_partials > most) most = mt[t].num_partials;
            H_CHECK(pd->row_slots == 16 && most == cases[c].want, "%s: row slots %d, %d chunks per unit, expected %d",
                    what, pd->row_slots, most, cases[c].want);
            check_plan(&d, &b, &pp, &plan, w.mem, 132, what);
        }
        ws_free(&w);
        batch_free(&b);
    }
    ctx->ops = saved_ops;
    ctx->num_workers = saved_w;
    ctx->rs_merge_batch = saved_b;
    ctx->rs_multi_split = saved_m;
    ctx->rs_multi_group = saved_g;
    kva_context_destroy(ctx);
}

int main(int argc, char** argv) {
    h_init(argc, argv, "test_planner");
    kva_context* ctxs[NW];
    kva_context* ctxs2[NW];
    for (int i = 0; i < NW; ++i) {
        ctxs[i] = make_ctx(k_workers[i]);
        ctxs2[i] = make_ctx(k_workers[i]);
        H_CHECK(kva_context_num_workers(ctxs[i]) == k_workers[i], "CPU context with %d threads has %d workers", k_workers[i],
                kva_context_num_workers(ctxs[i]));
    }
    int count = h_opt.count >= 0 ? h_opt.count : 1500;
    test_random_plans(ctxs, ctxs2, count);
    test_graph_mode(ctxs);
    test_bound(ctxs);
    test_fixed_split(ctxs);
    test_locality(ctxs);
    test_row_slots();
    printf("planner: %lld plans checked (%lld items, %lld partial slots; %lld with chunks below %d)\n"
           "  worst max_worker_cost / max(total/W, largest item)                 = %.4f (checked: <= 4/3 + largest/bound)\n"
           "  worst max_worker_cost / max(total/W, largest, c[W-1] + c[W]) (LB*) = %.4f (decode LPT <= 4/3 OPT; prefill: list scheduling in locality order)\n",
           (long long)g_plans, (long long)g_items, (long long)g_partials, (long long)g_small_plans, KVA__MIN_KV_CHUNK,
           g_worst_ratio, g_worst_ratio2);
    for (int i = 0; i < NW; ++i) {
        kva_context_destroy(ctxs[i]);
        kva_context_destroy(ctxs2[i]);
    }
    return h_finish();
}
