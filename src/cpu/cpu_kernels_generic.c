/* cpu_kernels_generic.c - portable kernels of the CPU backend (plain C; the compiler may vectorise them). */
#include <math.h>

#include "cpu_internal.h"

static void g_load_row(kva_dtype dt, const void* src, float* dst, int n, int npad, float scale) {
    kva__cpu_load_row_scalar(dt, src, dst, n, npad, scale);
}

static void g_load_rows(kva_dtype dt, const char* const* src, int nrows, float* dst, int ld, int n, int npad) {
    for (int r = 0; r < nrows; ++r) kva__cpu_load_row_scalar(dt, src[r], dst + (size_t)r * (size_t)ld, n, npad, 1.0f);
}

static void g_store_row(kva_dtype dt, const float* src, void* dst, int n, float scale) {
    kva__cpu_store_row_scalar(dt, src, dst, n, scale);
}

/* 8 independent partial sums per dot product so the loop is vectorisable without reassociation flags */
static void g_scores(const float* Q, int ldq, int R, const float* K, int ldk, int nt, int D, float* S, int lds) {
    for (int r = 0; r < R; ++r) {
        const float* restrict q = Q + (size_t)r * (size_t)ldq;
        float* restrict srow = S + (size_t)r * (size_t)lds;
        for (int t = 0; t < nt; ++t) {
            const float* restrict k = K + (size_t)t * (size_t)ldk;
            float acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
            for (int d = 0; d < D; d += 8)
                for (int l = 0; l < 8; ++l) acc[l] += q[d + l] * k[d + l];
            srow[t] = ((acc[0] + acc[4]) + (acc[1] + acc[5])) + ((acc[2] + acc[6]) + (acc[3] + acc[7]));
        }
    }
}

static void g_pv(const float* P, int ldp, int R, const float* V, int ldv, int nt, int D, float* acc, int lda,
                 const float* alpha) {
    for (int r = 0; r < R; ++r) {
        float* restrict a = acc + (size_t)r * (size_t)lda;
        const float* restrict p = P + (size_t)r * (size_t)ldp;
        if (alpha) {
            float al = alpha[r];
            for (int d = 0; d < D; ++d) a[d] *= al;
        }
        for (int t = 0; t < nt; ++t) {
            float pt = p[t];
            if (pt == 0.0f) continue; /* masked keys never reach the accumulator */
            const float* restrict v = V + (size_t)t * (size_t)ldv;
            for (int d = 0; d < D; ++d) a[d] += pt * v[d];
        }
    }
}

static void g_scores_kv(kva_dtype dt, const float* Q, int ldq, int R, const char* const* kp, int nt, int D, float* S,
                        int lds, const kva__cpu_prefetch* pf) {
    (void)pf;
    for (int r = 0; r < R; ++r)
        for (int t = 0; t < nt; ++t) {
            const float* q = Q + (size_t)r * (size_t)ldq;
            float acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
            for (int d = 0; d < D; d += 8)
                for (int l = 0; l < 8; ++l) acc[l] += q[d + l] * kva__cpu_load_scalar(dt, kp[t], d + l);
            S[(size_t)r * (size_t)lds + t] =
                ((acc[0] + acc[4]) + (acc[1] + acc[5])) + ((acc[2] + acc[6]) + (acc[3] + acc[7]));
        }
}

static void g_pv_kv(kva_dtype dt, const float* P, int ldp, int R, const char* const* vp, int nt, int D, float* acc,
                    int lda, const float* alpha) {
    for (int r = 0; r < R; ++r) {
        float* a = acc + (size_t)r * (size_t)lda;
        const float* p = P + (size_t)r * (size_t)ldp;
        if (alpha)
            for (int d = 0; d < D; ++d) a[d] *= alpha[r];
        for (int t = 0; t < nt; ++t) {
            if (p[t] == 0.0f) continue;
            for (int d = 0; d < D; ++d) a[d] += p[t] * kva__cpu_load_scalar(dt, vp[t], d);
        }
    }
}

static float g_row_max(const float* x, int n) {
    float m = -INFINITY;
    for (int i = 0; i < n; ++i) m = x[i] > m ? x[i] : m;
    return m;
}

static float g_exp_sum(float* x, int n, float m) {
    float s = 0.0f;
    for (int i = 0; i < n; ++i) {
        float e = x[i] == -INFINITY ? 0.0f : expf(x[i] - m);
        x[i] = e;
        s += e;
    }
    return s;
}

static void g_sigmoid(float* x, int n, float bias) {
    for (int i = 0; i < n; ++i) x[i] = x[i] == -INFINITY ? 0.0f : 1.0f / (1.0f + expf(-(x[i] + bias)));
}

static void g_softcap(float* x, int n, float cap) {
    float rc = 1.0f / cap;
    for (int i = 0; i < n; ++i) x[i] = cap * tanhf(x[i] * rc);
}

const kva__cpu_kernels kva__cpu_kernels_generic = {
    "generic", g_load_row, g_load_rows, g_store_row, g_scores, g_pv, g_scores_kv, g_pv_kv, g_row_max, g_exp_sum, g_sigmoid, g_softcap,
};
