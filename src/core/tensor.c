/* tensor.c - tensor and paged-KV descriptors and their validation. */
#include <string.h>

#include "internal.h"

KVA_API kva_tensor kva_tensor_make(void* data, kva_dtype dtype, int32_t ndim, int64_t d0, int64_t d1, int64_t d2,
                                   int64_t d3) {
    kva_tensor t;
    memset(&t, 0, sizeof t);
    t.data = data;
    t.dtype = dtype;
    if (ndim < 1) ndim = 1;
    if (ndim > KVA_MAX_DIMS) ndim = KVA_MAX_DIMS;
    t.ndim = ndim;
    int64_t dims[4] = {d0, d1, d2, d3};
    for (int i = 0; i < ndim; ++i) t.shape[i] = dims[i];
    int64_t s = 1;
    for (int i = ndim - 1; i >= 0; --i) {
        t.stride[i] = s;
        const int64_t n = t.shape[i] > 0 ? t.shape[i] : 1;
        /* more than 2^63 elements have no contiguous strides: saturate (the tensor checks refuse such a view) */
        s = s > INT64_MAX / n ? INT64_MAX : s * n;
    }
    return t;
}

kva_status kva__check_tensor(const char* name, const kva_tensor* t, kva_dtype dtype, int32_t ndim,
                             const int64_t* shape) {
    KVA_RETURN_IF(!t, KVA_ERR_INVALID_ARGUMENT, "%s: tensor descriptor is NULL", name);
    /* a tensor with no elements may have a NULL pointer (PyTorch's empty CUDA tensors do): nothing is read or written */
    int empty = 0;
    for (int i = 0; i < ndim; ++i) empty |= shape[i] <= 0;
    KVA_RETURN_IF(!t->data && !empty, KVA_ERR_INVALID_ARGUMENT, "%s: data pointer is NULL", name);
    KVA_RETURN_IF(t->dtype != dtype, KVA_ERR_PLAN_MISMATCH, "%s: dtype %s, expected %s", name,
                  kva_dtype_name(t->dtype), kva_dtype_name(dtype));
    /* Accept a tensor with the expected number of dims, or leading dims of size 1 folded in. */
    KVA_RETURN_IF(t->ndim != ndim, KVA_ERR_PLAN_MISMATCH, "%s: %d dims, expected %d", name, (int)t->ndim, (int)ndim);
    for (int i = 0; i < ndim; ++i) {
        KVA_RETURN_IF(t->shape[i] != shape[i], KVA_ERR_PLAN_MISMATCH, "%s: shape[%d] = %lld, expected %lld", name, i,
                      (long long)t->shape[i], (long long)shape[i]);
        KVA_RETURN_IF(t->stride[i] < 0, KVA_ERR_INVALID_ARGUMENT, "%s: stride[%d] = %lld is negative", name, i,
                      (long long)t->stride[i]);
    }
    KVA_RETURN_IF(t->stride[ndim - 1] != 1 && shape[ndim - 1] > 1, KVA_ERR_INVALID_ARGUMENT,
                  "%s: the last dimension must be contiguous (stride[%d] = %lld, expected 1)", name, ndim - 1,
                  (long long)t->stride[ndim - 1]);
    if (!empty) {
        /* the byte offset of the last element must be representable (no tensor in memory is larger), so the
           backends' index arithmetic cannot overflow */
        const int64_t limit = kva__max_elem_offset(dtype);
        int64_t extent = 0;
        for (int i = 0; i < ndim; ++i) {
            const int64_t span = shape[i] - 1;
            KVA_RETURN_IF(t->stride[i] > 0 && span > (limit - extent) / t->stride[i], KVA_ERR_INVALID_ARGUMENT,
                          "%s: the strides address beyond 2^63 bytes (stride[%d] = %lld with shape[%d] = %lld)", name,
                          i, (long long)t->stride[i], i, (long long)shape[i]);
            extent += span * t->stride[i];
        }
    }
    return KVA_OK;
}

kva_status kva__check_written(const char* name, const kva_tensor* t) {
    /* a view with no elements (e.g. a state of head dim 0, whose contiguous row stride heads * 0 is 0) writes
       nothing: no stride can put two results in one place */
    for (int i = 0; i < t->ndim && i < KVA_MAX_DIMS; ++i)
        if (t->shape[i] <= 0) return KVA_OK;
    for (int i = 0; i < t->ndim && i < KVA_MAX_DIMS; ++i)
        KVA_RETURN_IF(t->shape[i] > 1 && t->stride[i] == 0, KVA_ERR_INVALID_ARGUMENT,
                      "%s: stride[%d] = 0 over %lld elements (a broadcast view): the results written there would "
                      "overlap; pass a tensor with its own storage", name, i, (long long)t->shape[i]);
    return KVA_OK;
}

int64_t kva__max_elem_offset(kva_dtype dtype) {
    const size_t es = kva_dtype_size(dtype);
    return INT64_MAX / (int64_t)(es > 0 ? es : 4) - 1;
}

kva_status kva__check_paged_fields(const char* name, const kva_paged_kv* pk) {
    KVA_RETURN_IF(pk->num_indices < 0, KVA_ERR_INVALID_ARGUMENT, "%s: paged num_indices = %lld is negative", name,
                  (long long)pk->num_indices);
    KVA_RETURN_IF(pk->k_stride_page < 0 || pk->k_stride_token < 0 || pk->k_stride_head < 0 || pk->v_stride_page < 0 ||
                      pk->v_stride_token < 0 || pk->v_stride_head < 0,
                  KVA_ERR_INVALID_ARGUMENT, "%s: paged strides must be non-negative", name);
    /* pages are addressed by int32 indices below num_pages: the farthest element must be representable */
    int64_t last_page = pk->num_pages < ((int64_t)INT32_MAX + 1) ? pk->num_pages - 1 : INT32_MAX;
    if (last_page < 0) last_page = 0;
    const int64_t limit = kva__max_elem_offset(pk->dtype);
    for (int kv = 0; kv < 2; ++kv) {
        const int64_t st[4] = {kv ? pk->v_stride_page : pk->k_stride_page, kv ? pk->v_stride_token : pk->k_stride_token,
                               kv ? pk->v_stride_head : pk->k_stride_head, 1};
        const int64_t span[4] = {last_page, (int64_t)pk->page_size - 1, (int64_t)pk->num_heads - 1,
                                 (int64_t)(kv ? pk->head_dim_vo : pk->head_dim_qk) - 1};
        int64_t extent = 0;
        for (int i = 0; i < 4; ++i) {
            if (span[i] <= 0 || st[i] == 0) continue;
            KVA_RETURN_IF(span[i] > (limit - extent) / st[i], KVA_ERR_INVALID_ARGUMENT,
                          "%s: the %s pool's strides (page %lld, token %lld, head %lld) address beyond 2^63 bytes "
                          "for %lld pages of %d tokens",
                          name, kv ? "V" : "K", (long long)st[0], (long long)st[1], (long long)st[2],
                          (long long)last_page + 1, (int)pk->page_size);
            extent += span[i] * st[i];
        }
    }
    return KVA_OK;
}

KVA_API kva_status kva_paged_kv_init(kva_paged_kv* paged, void* k_data, void* v_data, kva_dtype dtype,
                                     kva_layout layout, int64_t num_pages, int32_t page_size, int32_t num_heads,
                                     int32_t head_dim_qk, int32_t head_dim_vo) {
    KVA_RETURN_IF(!paged, KVA_ERR_INVALID_ARGUMENT, "kva_paged_kv_init: paged is NULL");
    KVA_RETURN_IF(num_pages < 0 || page_size < 1 || num_heads < 1 || head_dim_qk < 1 || head_dim_vo < 1,
                  KVA_ERR_INVALID_ARGUMENT,
                  "kva_paged_kv_init: num_pages = %lld (>= 0), page_size = %d, num_heads = %d, head_dim_qk = %d, "
                  "head_dim_vo = %d (all >= 1)",
                  (long long)num_pages, (int)page_size, (int)num_heads, (int)head_dim_qk, (int)head_dim_vo);
    KVA_RETURN_IF(layout != KVA_LAYOUT_NHD && layout != KVA_LAYOUT_HND, KVA_ERR_INVALID_ARGUMENT,
                  "kva_paged_kv_init: layout = %d is not a kva_layout", (int)layout);
    {
        const int64_t dmax = head_dim_qk > head_dim_vo ? head_dim_qk : head_dim_vo;
        KVA_RETURN_IF((int64_t)page_size * num_heads > INT64_MAX / dmax, KVA_ERR_INVALID_ARGUMENT,
                      "kva_paged_kv_init: a page of %d tokens x %d heads x %lld dims has more than 2^63 elements",
                      (int)page_size, (int)num_heads, (long long)dmax);
    }
    memset(paged, 0, sizeof *paged);
    paged->k_data = k_data;
    paged->v_data = v_data;
    paged->dtype = dtype;
    paged->num_pages = num_pages;
    paged->page_size = page_size;
    paged->num_heads = num_heads;
    paged->head_dim_qk = head_dim_qk;
    paged->head_dim_vo = head_dim_vo;
    int64_t ps = page_size, h = num_heads;
    paged->k_stride_page = ps * h * head_dim_qk;
    paged->v_stride_page = ps * h * head_dim_vo;
    if (layout == KVA_LAYOUT_NHD) {
        paged->k_stride_token = h * head_dim_qk;
        paged->k_stride_head = head_dim_qk;
        paged->v_stride_token = h * head_dim_vo;
        paged->v_stride_head = head_dim_vo;
    } else {
        paged->k_stride_head = ps * head_dim_qk;
        paged->k_stride_token = head_dim_qk;
        paged->v_stride_head = ps * head_dim_vo;
        paged->v_stride_token = head_dim_vo;
    }
    return KVA_OK;
}
