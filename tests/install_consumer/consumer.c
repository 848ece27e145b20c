/* consumer.c - a program built against an installed kvattn (pkg-config and CMake's find_package; see
 * tests/install_consumer.cmake): one decode step on the CPU backend, page table in CSR and in block-table form,
 * checked against a float64 computation here. Exits 0 when both match. */
#include <kvattn.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define CHECK(call)                                                                                   \
    do {                                                                                              \
        kva_status s_ = (call);                                                                       \
        if (s_ != KVA_OK) {                                                                           \
            fprintf(stderr, "%s: %s: %s\n", #call, kva_status_string(s_), kva_last_error_message()); \
            return 1;                                                                                 \
        }                                                                                             \
    } while (0)

enum { HQ = 4, HKV = 2, D = 8, PAGE = 4, NUM_PAGES = 8, B = 2, STRIDE = 4 };

static double lcg(unsigned* s) {
    *s = *s * 1664525u + 1013904223u;
    return (double)(*s >> 8) / (double)(1u << 24) - 0.5;
}

int main(void) {
    kva_context_options opt;
    kva_context_options_init(&opt);
    opt.backend = KVA_BACKEND_CPU;
    kva_context* ctx;
    CHECK(kva_context_create(&opt, &ctx));
    kva_attention_desc desc;
    kva_attention_desc_init(&desc, HQ, HKV, D, KVA_DTYPE_F32);

    static float k_pool[NUM_PAGES * PAGE * HKV * D], v_pool[NUM_PAGES * PAGE * HKV * D], q[B * HQ * D];
    unsigned seed = 12345u;
    for (int i = 0; i < NUM_PAGES * PAGE * HKV * D; ++i) {
        k_pool[i] = (float)lcg(&seed);
        v_pool[i] = (float)lcg(&seed);
    }
    for (int i = 0; i < B * HQ * D; ++i) q[i] = (float)lcg(&seed);
    const int32_t lens[B] = {6, 9};                 /* 2 and 3 pages of 4 */
    const int32_t kv_indptr[B + 1] = {0, 2, 5}, kv_indices[5] = {5, 1, 7, 0, 3}, last[B] = {2, 1};
    const int32_t block_table[B * STRIDE] = {5, 1, -1, -1, 7, 0, 3, -1}; /* the same pages in rows of 4 */

    for (int form = 0; form < 2; ++form) {
        kva_plan_params p;
        kva_plan_params_init(&p);
        p.batch_size = B;
        p.page_size = PAGE;
        p.num_pages = NUM_PAGES;
        if (form == 0) {
            p.kv_indptr = kv_indptr;
            p.kv_last_page_len = last;
        } else {
            p.kv_seq_lens = lens;
            p.block_table_stride = STRIDE;
        }
        size_t dev_bytes = 0, host_bytes = 0;
        CHECK(kva_plan_workspace_size(ctx, &desc, KVA_OP_BATCH_DECODE, &p, &dev_bytes, &host_bytes));
        kva_workspace ws = {aligned_alloc(256, (dev_bytes + 255) / 256 * 256), dev_bytes, NULL, 0, NULL, 0};
        kva_plan plan;
        CHECK(kva_batch_decode_plan(ctx, &desc, &p, &ws, &plan, NULL));
        float o[B * HQ * D], lse[B * HQ];
        kva_run_args args;
        kva_run_args_init(&args);
        args.q = kva_tensor_make(q, KVA_DTYPE_F32, 3, B, HQ, D, 0);
        args.o = kva_tensor_make(o, KVA_DTYPE_F32, 3, B, HQ, D, 0);
        args.lse = kva_tensor_make(lse, KVA_DTYPE_F32, 2, B, HQ, 0, 0);
        CHECK(kva_paged_kv_init(&args.paged, k_pool, v_pool, KVA_DTYPE_F32, KVA_LAYOUT_NHD, NUM_PAGES, PAGE, HKV, D,
                                D));
        args.paged.indices = form == 0 ? kv_indices : block_table;
        CHECK(kva_batch_decode_run(ctx, &plan, &ws, &args));
        free(ws.device);
        double worst = 0;
        for (int b = 0; b < B; ++b)
            for (int h = 0; h < HQ; ++h) {
                const int kh = h / (HQ / HKV);
                double s[16], m = -INFINITY, sum = 0, acc[D] = {0};
                for (int j = 0; j < lens[b]; ++j) {
                    const int page = kv_indices[kv_indptr[b] + j / PAGE], t = j % PAGE;
                    const float* k = k_pool + ((page * PAGE + t) * HKV + kh) * D;
                    double x = 0;
                    for (int d = 0; d < D; ++d) x += (double)q[(b * HQ + h) * D + d] * k[d];
                    s[j] = x / sqrt((double)D);
                    if (s[j] > m) m = s[j];
                }
                for (int j = 0; j < lens[b]; ++j) {
                    const int page = kv_indices[kv_indptr[b] + j / PAGE], t = j % PAGE;
                    const float* v = v_pool + ((page * PAGE + t) * HKV + kh) * D;
                    const double w = exp(s[j] - m);
                    sum += w;
                    for (int d = 0; d < D; ++d) acc[d] += w * v[d];
                }
                for (int d = 0; d < D; ++d) {
                    const double e = fabs(o[(b * HQ + h) * D + d] - acc[d] / sum);
                    if (e > worst) worst = e;
                }
                const double l2 = (m + log(sum)) / log(2.0), e = fabs(lse[b * HQ + h] - l2);
                if (e > worst) worst = e;
            }
        printf("kvattn %s consumer: %s page table, max error %.3g\n", KVA_VERSION_STRING,
               form == 0 ? "CSR" : "block-table", worst);
        if (!(worst < 1e-4)) return 1;
    }
    kva_context_destroy(ctx);
    return 0;
}
