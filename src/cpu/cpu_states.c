/* cpu_states.c - attention-state merging (merge_state, merge_states) and paged KV append for the CPU backend. */
#include <math.h>
#include <string.h>

#include "cpu_internal.h"

#define MERGE_CHUNK KVA__CPU_MAX_DIM /* dims per pass (the state dim itself is not limited) */
#define PAR_MIN_ELEMS 65536          /* below this many elements a call runs on the calling thread */


/* address of (row, head) in a [rows, heads, dim] tensor */
static inline char* vrow(const kva_tensor* t, int64_t r, int64_t h) {
    return (char*)t->data + (size_t)(r * t->stride[0] + h * t->stride[1]) * kva__cpu_dtype_size(t->dtype);
}
static inline float* srow(const kva_tensor* t, int64_t r, int64_t h) {
    return (float*)t->data + r * t->stride[0] + h * t->stride[1];
}

/* ---------------------------------------------------------------------------------------------- */
/* merge_state                                                                                     */

typedef struct merge2_ctx {
    const kva__cpu_state* st;
    const kva_tensor *va, *sa, *vb, *sb, *vo, *so;
    const uint8_t* mask;
    int64_t rows, heads, dim;
    int nthreads;
} merge2_ctx;

static void merge2_job(void* arg, int tid) {
    const merge2_ctx* c = (const merge2_ctx*)arg;
    const kva__cpu_kernels* kern = c->st->kern;
    kva__cpu_scratch* sc = &c->st->scratch[tid];
    float* a = sc->q;
    float* b = sc->q + MERGE_CHUNK;
    const int64_t total = c->rows * c->heads;
    const int64_t begin = total * tid / c->nthreads, end = total * (tid + 1) / c->nthreads;
    const int have_so = c->so && c->so->data;
    for (int64_t x = begin; x < end; ++x) {
        const int64_t r = x / c->heads, h = x % c->heads;
        if (c->mask && !c->mask[r]) continue;
        const float la = *srow(c->sa, r, h), lb = *srow(c->sb, r, h);
        const float M = la > lb ? la : lb;
        float wa = 0.0f, wb = 0.0f, lse = -INFINITY;
        if (M != -INFINITY) {
            wa = la == -INFINITY ? 0.0f : exp2f(la - M);
            wb = lb == -INFINITY ? 0.0f : exp2f(lb - M);
            lse = M + log2f(wa + wb);
            float inv = 1.0f / (wa + wb);
            wa *= inv;
            wb *= inv;
        }
        /* head dim 0: no v to touch (its pointers may be NULL), the lse is still merged */
        const char* pa = c->dim > 0 ? vrow(c->va, r, h) : NULL;
        const char* pb = c->dim > 0 ? vrow(c->vb, r, h) : NULL;
        char* po = c->dim > 0 ? vrow(c->vo, r, h) : NULL;
        const size_t esa = kva__cpu_dtype_size(c->va->dtype), esb = kva__cpu_dtype_size(c->vb->dtype),
                     eso = kva__cpu_dtype_size(c->vo->dtype);
        for (int64_t d0 = 0; d0 < c->dim; d0 += MERGE_CHUNK) {
            const int n = (int)(c->dim - d0 < MERGE_CHUNK ? c->dim - d0 : MERGE_CHUNK);
            char* out = po + (size_t)d0 * eso;
            if (M == -INFINITY) {
                memset(out, 0, (size_t)n * eso);
                continue;
            }
            /* a zero weight never multiplies its state (a state with lse -inf may hold anything) */
            if (wa != 0.0f) kern->load_row(c->va->dtype, pa + (size_t)d0 * esa, a, n, n, wa);
            if (wb != 0.0f) kern->load_row(c->vb->dtype, pb + (size_t)d0 * esb, b, n, n, wb);
            if (wa == 0.0f) {
                kern->store_row(c->vo->dtype, b, out, n, 1.0f);
            } else if (wb == 0.0f) {
                kern->store_row(c->vo->dtype, a, out, n, 1.0f);
            } else {
                for (int i = 0; i < n; ++i) a[i] += b[i];
                kern->store_row(c->vo->dtype, a, out, n, 1.0f);
            }
        }
        if (have_so) *srow(c->so, r, h) = lse;
    }
}

kva_status kva__cpu_merge_state(kva_context* ctx, const kva_tensor* v_a, const kva_tensor* s_a,
                                const kva_tensor* v_b, const kva_tensor* s_b, const kva_tensor* v_out,
                                const kva_tensor* s_out, const uint8_t* mask, void* stream) {
    (void)stream;
    kva__cpu_state* st = (kva__cpu_state*)ctx->backend_state;
    KVA_RETURN_IF(!st, KVA_ERR_INTERNAL, "CPU merge_state: backend not initialised");
    KVA_RETURN_IF(!v_a || !s_a || !v_b || !s_b || !v_out, KVA_ERR_INVALID_ARGUMENT, "CPU merge_state: NULL tensor");
    KVA_RETURN_IF(v_a->ndim != 3 || v_b->ndim != 3 || v_out->ndim != 3 || s_a->ndim != 2 || s_b->ndim != 2,
                  KVA_ERR_INVALID_ARGUMENT, "CPU merge_state: v must be [rows, heads, dim] and s [rows, heads]");
    KVA_RETURN_IF(!kva__cpu_is_float_dtype(v_a->dtype) || !kva__cpu_is_float_dtype(v_b->dtype) ||
                      !kva__cpu_is_float_dtype(v_out->dtype),
                  KVA_ERR_UNSUPPORTED, "CPU merge_state: v dtypes must be f32, f16 or bf16");
    merge2_ctx c;
    c.st = st;
    c.va = v_a;
    c.sa = s_a;
    c.vb = v_b;
    c.sb = s_b;
    c.vo = v_out;
    c.so = s_out;
    c.mask = mask;
    c.rows = v_a->shape[0];
    c.heads = v_a->shape[1];
    c.dim = v_a->shape[2];
    if (c.rows <= 0 || c.heads <= 0) return KVA_OK; /* head dim 0 still merges the lse (s_out) */
    int64_t elems = c.rows * c.heads * c.dim;
    int n = st->num_threads;
    if (elems < PAR_MIN_ELEMS) n = 1;
    if ((int64_t)n > c.rows * c.heads) n = (int)(c.rows * c.heads);
    c.nthreads = n;
    pthread_mutex_lock(&st->call_mu);
    kva__cpu_pool_run(st->pool, n, merge2_job, &c);
    pthread_mutex_unlock(&st->call_mu);
    return KVA_OK;
}

/* ---------------------------------------------------------------------------------------------- */
/* merge_states                                                                                    */

typedef struct mergen_ctx {
    const kva__cpu_state* st;
    const kva_tensor *v, *s, *vo, *so;
    const int32_t* indptr;
    int64_t rows, heads, dim;
    int nthreads;
} mergen_ctx;

static void mergen_job(void* arg, int tid) {
    const mergen_ctx* c = (const mergen_ctx*)arg;
    const kva__cpu_kernels* kern = c->st->kern;
    kva__cpu_scratch* sc = &c->st->scratch[tid];
    float* acc = sc->q;
    float* tmp = sc->q + MERGE_CHUNK;
    const int64_t begin = c->rows * tid / c->nthreads, end = c->rows * (tid + 1) / c->nthreads;
    const int have_so = c->so && c->so->data;
    const size_t es = kva__cpu_dtype_size(c->v->dtype), eso = kva__cpu_dtype_size(c->vo->dtype);
    for (int64_t r = begin; r < end; ++r) {
        const int64_t k0 = c->indptr[r], k1 = c->indptr[r + 1];
        for (int64_t h = 0; h < c->heads; ++h) {
            float M = -INFINITY;
            for (int64_t k = k0; k < k1; ++k) {
                float l = *srow(c->s, k, h);
                M = l > M ? l : M;
            }
            float wsum = 0.0f;
            if (M != -INFINITY)
                for (int64_t k = k0; k < k1; ++k) {
                    float l = *srow(c->s, k, h);
                    if (l != -INFINITY) wsum += exp2f(l - M);
                }
            const float lse = M == -INFINITY ? -INFINITY : M + log2f(wsum);
            char* po = c->dim > 0 ? vrow(c->vo, r, h) : NULL; /* head dim 0: only the lse */
            /* with aliasing (v_out row r == v row r) row r's states are all read before the chunk is written */
            for (int64_t d0 = 0; d0 < c->dim; d0 += MERGE_CHUNK) {
                const int n = (int)(c->dim - d0 < MERGE_CHUNK ? c->dim - d0 : MERGE_CHUNK);
                char* out = po + (size_t)d0 * eso;
                if (M == -INFINITY) {
                    memset(out, 0, (size_t)n * eso);
                    continue;
                }
                for (int i = 0; i < n; ++i) acc[i] = 0.0f;
                for (int64_t k = k0; k < k1; ++k) {
                    float l = *srow(c->s, k, h);
                    if (l == -INFINITY) continue;
                    float w = exp2f(l - M) / wsum;
                    kern->load_row(c->v->dtype, vrow(c->v, k, h) + (size_t)d0 * es, tmp, n, n, w);
                    for (int i = 0; i < n; ++i) acc[i] += tmp[i];
                }
                kern->store_row(c->vo->dtype, acc, out, n, 1.0f);
            }
            if (have_so) *srow(c->so, r, h) = lse;
        }
    }
}

static int ranges_overlap(const kva_tensor* a, const kva_tensor* b) {
    /* conservative: compare the spans [data, data + max offset]. A tensor with no elements covers no memory (its
       pointer may be NULL and its strides anything: the tensor checks skip their extent), and the ends are computed
       on addresses, not pointers (no pointer arithmetic past an object) */
    for (int i = 0; i < a->ndim; ++i)
        if (a->shape[i] <= 0) return 0;
    for (int i = 0; i < b->ndim; ++i)
        if (b->shape[i] <= 0) return 0;
    size_t ea = kva__cpu_dtype_size(a->dtype), eb = kva__cpu_dtype_size(b->dtype);
    if (!ea) ea = 4;
    if (!eb) eb = 4;
    int64_t ma = 0, mb = 0;
    for (int i = 0; i < a->ndim; ++i) ma += (a->shape[i] - 1) * (a->stride[i] < 0 ? -a->stride[i] : a->stride[i]);
    for (int i = 0; i < b->ndim; ++i) mb += (b->shape[i] - 1) * (b->stride[i] < 0 ? -b->stride[i] : b->stride[i]);
    const uintptr_t a0 = (uintptr_t)a->data, b0 = (uintptr_t)b->data;
    const uintptr_t a1 = a0 + (uintptr_t)(ma + 1) * ea, b1 = b0 + (uintptr_t)(mb + 1) * eb;
    return a0 < b1 && b0 < a1;
}

kva_status kva__cpu_merge_states(kva_context* ctx, const kva_tensor* v, const kva_tensor* s, const int32_t* indptr,
                                 int64_t rows, const kva_tensor* v_out, const kva_tensor* s_out, void* stream) {
    (void)stream;
    kva__cpu_state* st = (kva__cpu_state*)ctx->backend_state;
    KVA_RETURN_IF(!st, KVA_ERR_INTERNAL, "CPU merge_states: backend not initialised");
    KVA_RETURN_IF(!v || !s || !v_out || (rows > 0 && !indptr), KVA_ERR_INVALID_ARGUMENT,
                  "CPU merge_states: NULL argument");
    KVA_RETURN_IF(v->ndim != 3 || v_out->ndim != 3 || s->ndim != 2, KVA_ERR_INVALID_ARGUMENT,
                  "CPU merge_states: v must be [total, heads, dim] and s [total, heads]");
    KVA_RETURN_IF(!kva__cpu_is_float_dtype(v->dtype) || !kva__cpu_is_float_dtype(v_out->dtype), KVA_ERR_UNSUPPORTED,
                  "CPU merge_states: v dtypes must be f32, f16 or bf16");
    if (rows <= 0) return KVA_OK;
    const int64_t total = v->shape[0];
    KVA_RETURN_IF(indptr[0] < 0, KVA_ERR_INVALID_ARGUMENT, "CPU merge_states: indptr[0] = %d < 0", (int)indptr[0]);
    for (int64_t r = 0; r < rows; ++r)
        KVA_RETURN_IF(indptr[r + 1] < indptr[r] || indptr[r + 1] > total, KVA_ERR_INVALID_ARGUMENT,
                      "CPU merge_states: indptr[%lld] = %d is not in [indptr[%lld] = %d, %lld]", (long long)(r + 1),
                      (int)indptr[r + 1], (long long)r, (int)indptr[r], (long long)total);
    mergen_ctx c;
    c.st = st;
    c.v = v;
    c.s = s;
    c.vo = v_out;
    c.so = s_out;
    c.indptr = indptr;
    c.rows = rows;
    c.heads = v->shape[1];
    c.dim = v->shape[2];
    if (c.heads <= 0) return KVA_OK; /* head dim 0 still merges the lse (s_out) */
    int n = st->num_threads;
    if (total * c.heads * c.dim < PAR_MIN_ELEMS) n = 1;
    if ((int64_t)n > rows) n = (int)rows;
    /* outputs aliasing inputs: rows are processed in order on one thread, each row's states read before
       its output is written */
    if (ranges_overlap(v, v_out) || (s_out && s_out->data && ranges_overlap(s, s_out))) n = 1;
    c.nthreads = n;
    pthread_mutex_lock(&st->call_mu);
    kva__cpu_pool_run(st->pool, n, mergen_job, &c);
    pthread_mutex_unlock(&st->call_mu);
    return KVA_OK;
}

/* ---------------------------------------------------------------------------------------------- */
/* append_paged_kv (FlashInfer semantics: the page table already includes the new tokens).        */

typedef struct append_ctx {
    const kva__cpu_state* st;
    const kva_tensor *ak, *av;
    const int32_t *bidx, *pos;
    const int64_t* slots; /* the slot form (kva_append_paged_kv_cache_by_slot): bidx, pos unused */
    const kva_paged_kv* pk;
    int64_t nnz;
    int nthreads;
} append_ctx;

static void copy_row(const kva__cpu_kernels* kern, float* tmp, kva_dtype sdt, const char* src, kva_dtype ddt, char* dst,
                     int n) {
    const size_t es = kva__cpu_dtype_size(sdt), ed = kva__cpu_dtype_size(ddt);
    if (sdt == ddt) {
        memcpy(dst, src, (size_t)n * ed);
        return;
    }
    for (int d0 = 0; d0 < n; d0 += KVA__CPU_MAX_DIM) {
        const int m = n - d0 < KVA__CPU_MAX_DIM ? n - d0 : KVA__CPU_MAX_DIM;
        kern->load_row(sdt, src + (size_t)d0 * es, tmp, m, m, 1.0f);
        if (ddt == KVA_DTYPE_E4M3 || ddt == KVA_DTYPE_E5M2) kva__cpu_store_row_scalar(ddt, tmp, dst + (size_t)d0 * ed, m, 1.0f);
        else kern->store_row(ddt, tmp, dst + (size_t)d0 * ed, m, 1.0f);
    }
}

static void append_job(void* arg, int tid) {
    const append_ctx* c = (const append_ctx*)arg;
    const kva__cpu_kernels* kern = c->st->kern;
    float* tmp = c->st->scratch[tid].q;
    const kva_paged_kv* pk = c->pk;
    const size_t es = kva__cpu_dtype_size(pk->dtype);
    const size_t eak = kva__cpu_dtype_size(c->ak->dtype), eav = kva__cpu_dtype_size(c->av->dtype);
    const int64_t begin = c->nnz * tid / c->nthreads, end = c->nnz * (tid + 1) / c->nthreads;
    for (int64_t i = begin; i < end; ++i) {
        int64_t page, slot;
        if (c->slots) {
            if (c->slots[i] < 0) continue; /* padding */
            page = c->slots[i] / pk->page_size;
            slot = c->slots[i] % pk->page_size;
        } else {
            const int32_t b = c->bidx[i], p = c->pos[i];
            page = pk->indices[pk->indptr[b] + p / pk->page_size];
            slot = p % pk->page_size;
        }
        for (int32_t h = 0; h < pk->num_heads; ++h) {
            const char* sk = (const char*)c->ak->data + (size_t)(i * c->ak->stride[0] + h * c->ak->stride[1]) * eak;
            const char* sv = (const char*)c->av->data + (size_t)(i * c->av->stride[0] + h * c->av->stride[1]) * eav;
            char* dk = (char*)pk->k_data + (size_t)(page * pk->k_stride_page + slot * pk->k_stride_token +
                                                    h * pk->k_stride_head) * es;
            char* dv = (char*)pk->v_data + (size_t)(page * pk->v_stride_page + slot * pk->v_stride_token +
                                                    h * pk->v_stride_head) * es;
            copy_row(kern, tmp, c->ak->dtype, sk, pk->dtype, dk, pk->head_dim_qk);
            copy_row(kern, tmp, c->av->dtype, sv, pk->dtype, dv, pk->head_dim_vo);
        }
    }
}

static kva_status append_check_table(const int32_t* batch_indices, const int32_t* positions, int64_t nnz,
                                     const kva_paged_kv* paged, int32_t batch_size);

kva_status kva__cpu_append_paged_kv(kva_context* ctx, const kva_tensor* append_k, const kva_tensor* append_v,
                                    const int32_t* batch_indices, const int32_t* positions, const int64_t* slots,
                                    int64_t nnz, const kva_paged_kv* paged, int32_t batch_size, void* stream) {
    (void)stream;
    kva__cpu_state* st = (kva__cpu_state*)ctx->backend_state;
    KVA_RETURN_IF(!st, KVA_ERR_INTERNAL, "CPU append_paged_kv: backend not initialised");
    KVA_RETURN_IF(!append_k || !append_v || !paged, KVA_ERR_INVALID_ARGUMENT, "CPU append_paged_kv: NULL argument");
    KVA_RETURN_IF(nnz < 0, KVA_ERR_INVALID_ARGUMENT, "CPU append_paged_kv: nnz = %lld < 0", (long long)nnz);
    if (nnz == 0) return KVA_OK;
    KVA_RETURN_IF(!slots && (!batch_indices || !positions), KVA_ERR_INVALID_ARGUMENT,
                  "CPU append_paged_kv: batch_indices and positions are required");
    KVA_RETURN_IF(!slots && (!paged->indices || !paged->indptr || !paged->last_page_len), KVA_ERR_INVALID_ARGUMENT,
                  "CPU append_paged_kv: paged->indices, indptr and last_page_len are required");
    KVA_RETURN_IF(!paged->k_data || !paged->v_data || !append_k->data || !append_v->data, KVA_ERR_INVALID_ARGUMENT,
                  "CPU append_paged_kv: NULL data pointer");
    KVA_RETURN_IF(batch_size < 0, KVA_ERR_INVALID_ARGUMENT, "CPU append_paged_kv: batch_size = %d < 0", (int)batch_size);
    KVA_RETURN_IF(paged->page_size < 1, KVA_ERR_INVALID_ARGUMENT, "CPU append_paged_kv: page_size = %d < 1",
                  (int)paged->page_size);
    KVA_RETURN_IF(!kva__cpu_is_kv_dtype(paged->dtype), KVA_ERR_UNSUPPORTED,
                  "CPU append_paged_kv: pool dtype %d is not a KV dtype", (int)paged->dtype);
    KVA_RETURN_IF(!kva__cpu_is_kv_dtype(append_k->dtype) || !kva__cpu_is_kv_dtype(append_v->dtype),
                  KVA_ERR_UNSUPPORTED, "CPU append_paged_kv: append_k/append_v dtypes must be float or fp8 dtypes");
    KVA_RETURN_IF(append_k->ndim != 3 || append_v->ndim != 3 || append_k->shape[0] < nnz || append_v->shape[0] < nnz ||
                      append_k->shape[1] != paged->num_heads || append_v->shape[1] != paged->num_heads ||
                      append_k->shape[2] != paged->head_dim_qk || append_v->shape[2] != paged->head_dim_vo,
                  KVA_ERR_INVALID_ARGUMENT,
                  "CPU append_paged_kv: append_k must be [nnz=%lld, %d, %d] and append_v [nnz, %d, %d]",
                  (long long)nnz, (int)paged->num_heads, (int)paged->head_dim_qk, (int)paged->num_heads,
                  (int)paged->head_dim_vo);
    /* validate everything before writing anything */
    if (slots) {
        for (int64_t i = 0; i < nnz; ++i) /* (negative slots are padding) */
            KVA_RETURN_IF(slots[i] / paged->page_size >= paged->num_pages, KVA_ERR_PAGE_INDEX_OUT_OF_RANGE,
                          "CPU append_paged_kv_by_slot: token %lld: slot %lld (page %lld) outside the pool of %lld "
                          "pages of %d tokens",
                          (long long)i, (long long)slots[i], (long long)(slots[i] / paged->page_size),
                          (long long)paged->num_pages, (int)paged->page_size);
    } else {
        KVA_FORWARD(append_check_table(batch_indices, positions, nnz, paged, batch_size));
    }
    append_ctx c;
    c.st = st;
    c.ak = append_k;
    c.av = append_v;
    c.bidx = batch_indices;
    c.pos = positions;
    c.slots = slots;
    c.pk = paged;
    c.nnz = nnz;
    int n = st->num_threads;
    if (nnz * paged->num_heads * (int64_t)(paged->head_dim_qk + paged->head_dim_vo) < PAR_MIN_ELEMS) n = 1;
    if ((int64_t)n > nnz) n = (int)nnz;
    c.nthreads = n;
    pthread_mutex_lock(&st->call_mu);
    kva__cpu_pool_run(st->pool, n, append_job, &c);
    pthread_mutex_unlock(&st->call_mu);
    return KVA_OK;
}

/* the page-table form's checks: the table, every token's request, position and page */
static kva_status append_check_table(const int32_t* batch_indices, const int32_t* positions, int64_t nnz,
                                     const kva_paged_kv* paged, int32_t batch_size) {
    const int32_t* indptr = paged->indptr;
    KVA_RETURN_IF(indptr[0] < 0, KVA_ERR_PAGETABLE_MALFORMED, "CPU append_paged_kv: indptr[0] = %d < 0", (int)indptr[0]);
    for (int32_t b = 0; b < batch_size; ++b) {
        KVA_RETURN_IF(indptr[b + 1] < indptr[b], KVA_ERR_PAGETABLE_MALFORMED,
                      "CPU append_paged_kv: indptr not monotonic: indptr[%d] = %d > indptr[%d] = %d", (int)b,
                      (int)indptr[b], (int)(b + 1), (int)indptr[b + 1]);
        if (indptr[b + 1] > indptr[b]) {
            const int32_t lpl = paged->last_page_len[b];
            KVA_RETURN_IF(lpl < 1 || lpl > paged->page_size, KVA_ERR_PAGETABLE_MALFORMED,
                          "CPU append_paged_kv: last_page_len[%d] = %d outside [1, page_size = %d]", (int)b, (int)lpl,
                          (int)paged->page_size);
        }
    }
    KVA_RETURN_IF(paged->num_indices > 0 && indptr[batch_size] > paged->num_indices, KVA_ERR_PAGETABLE_MALFORMED,
                  "CPU append_paged_kv: indptr[%d] = %d but paged->indices holds %lld entries (paged->num_indices)",
                  (int)batch_size, (int)indptr[batch_size], (long long)paged->num_indices);
    for (int64_t i = 0; i < nnz; ++i) {
        const int32_t b = batch_indices[i], p = positions[i];
        KVA_RETURN_IF(b < 0 || b >= batch_size, KVA_ERR_INVALID_ARGUMENT,
                      "CPU append_paged_kv: batch_indices[%lld] = %d outside [0, batch_size = %d)", (long long)i, (int)b,
                      (int)batch_size);
        const int64_t npages = (int64_t)indptr[b + 1] - indptr[b];
        const int64_t kv_len = npages > 0 ? (npages - 1) * paged->page_size + paged->last_page_len[b] : 0;
        KVA_RETURN_IF(p < 0 || p >= kv_len, KVA_ERR_PAGE_INDEX_OUT_OF_RANGE,
                      "CPU append_paged_kv: token %lld: position %d outside request %d's length %lld (the page table "
                      "must already include the appended tokens)",
                      (long long)i, (int)p, (int)b, (long long)kv_len);
        const int64_t entry = (int64_t)indptr[b] + p / paged->page_size;
        const int32_t page = paged->indices[entry];
        KVA_RETURN_IF(page < 0 || page >= paged->num_pages, KVA_ERR_PAGE_INDEX_OUT_OF_RANGE,
                      "CPU append_paged_kv: token %lld (request %d, position %d): page table entry %lld holds page "
                      "index %d, outside the pool [0, %lld)",
                      (long long)i, (int)b, (int)p, (long long)entry, (int)page, (long long)paged->num_pages);
    }

    return KVA_OK;
}
