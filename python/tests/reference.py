"""Float64 NumPy reference of the attention contract (include/kvattn.h), written independently of the library,
plus helpers that build paged caches. Used by the CPU (NumPy) and GPU (torch) tests."""

import math

import numpy as np

LN2 = math.log(2.0)


def alibi_slopes(num_heads):
    n2 = 1 << int(math.floor(math.log2(num_heads)))
    out = []
    for h in range(num_heads):
        if h < n2:
            out.append(2.0 ** (-8.0 * (h + 1) / n2))
        else:
            out.append(2.0 ** (-4.0 * (2 * (h - n2) + 1) / n2))
    return np.array(out, dtype=np.float64)


def rope(x, pos, rope_scale=1.0, rope_theta=1e4):
    """Rotate-half RoPE over the whole head dim. x [n, H, D], pos [n]."""
    D = x.shape[-1]
    half = D // 2
    f = np.arange(half, dtype=np.float64)
    inv_freq = rope_theta ** (-2.0 * f / D) / rope_scale
    ang = np.asarray(pos, dtype=np.float64)[:, None] * inv_freq[None, :]
    c, s = np.cos(ang)[:, None, :], np.sin(ang)[:, None, :]
    x1, x2 = x[..., :half], x[..., half:]
    return np.concatenate([x1 * c - x2 * s, x2 * c + x1 * s], axis=-1)


def attention(q, k, v, causal=False, window_left=-1, logits_soft_cap=0.0, sm_scale=None, pos_encoding="NONE",
              rope_scale=1.0, rope_theta=1e4, mask=None):
    """One request. q [qo, Hq, Dqk], k [kv, Hkv, Dqk], v [kv, Hkv, Dvo] (any float dtype; computed in float64).
    mask: bool [qo, kv] (True = visible). Returns o [qo, Hq, Dvo], lse [qo, Hq] (base 2; -inf for empty rows)."""
    q = np.asarray(q, dtype=np.float64)
    k = np.asarray(k, dtype=np.float64)
    v = np.asarray(v, dtype=np.float64)
    qo, hq, d = q.shape
    kv, hkv, dv = v.shape
    if sm_scale is None:
        sm_scale = 1.0 / math.sqrt(d)
    g = hq // hkv
    qpos = kv - qo + np.arange(qo)
    kpos = np.arange(kv)
    if pos_encoding == "ROPE_LLAMA":
        q = rope(q, qpos, rope_scale, rope_theta)
        k = rope(k, kpos, rope_scale, rope_theta)
    kk = np.repeat(k, g, axis=1)
    vv = np.repeat(v, g, axis=1)
    x = np.einsum("qhd,khd->hqk", q, kk) * sm_scale
    if pos_encoding == "ALIBI":
        x = x + alibi_slopes(hq)[:, None, None] * (kpos[None, None, :] - qpos[None, :, None])
    if logits_soft_cap and logits_soft_cap > 0:
        x = logits_soft_cap * np.tanh(x / logits_soft_cap)
    vis = np.ones((qo, kv), dtype=bool)
    if causal:
        vis &= kpos[None, :] <= qpos[:, None]
    if window_left is not None and window_left >= 0:
        vis &= kpos[None, :] >= qpos[:, None] - window_left
    if mask is not None:
        vis &= np.asarray(mask, dtype=bool).reshape(qo, kv)
    x = np.where(vis[None], x, -np.inf)
    m = x.max(axis=-1, initial=-np.inf)  # [hq, qo]
    safe_m = np.where(np.isfinite(m), m, 0.0)
    p = np.where(vis[None], np.exp(x - safe_m[..., None]), 0.0)
    den = p.sum(-1)
    with np.errstate(divide="ignore", invalid="ignore"):
        o = np.einsum("hqk,khd->qhd", p / np.where(den > 0, den, 1.0)[..., None], vv)
        lse = np.where(den > 0, (safe_m + np.log(np.where(den > 0, den, 1.0))) / LN2, -np.inf).T
    return o, lse


def make_paged(rng, kv_lens, page_size, num_kv_heads, head_dim, dtype=np.float32, layout="NHD", extra_pages=3,
               head_dim_vo=None):
    """A shuffled page table for kv_lens and a random 5-D pool [P, 2, ...]. Returns (cache, indptr, indices,
    last_page_len, P). head_dim_vo (if different) is not supported by the 5-D form."""
    pages = [(n + page_size - 1) // page_size for n in kv_lens]
    P = int(sum(pages)) + extra_pages
    indptr = np.concatenate([[0], np.cumsum(pages)]).astype(np.int32)
    indices = rng.permutation(P)[: indptr[-1]].astype(np.int32)
    last = np.array([((n - 1) % page_size) + 1 if n > 0 else 1 for n in kv_lens], dtype=np.int32)
    if layout == "NHD":
        shape = (P, 2, page_size, num_kv_heads, head_dim)
    else:
        shape = (P, 2, num_kv_heads, page_size, head_dim)
    cache = rng.standard_normal(shape).astype(dtype)
    return cache, indptr, indices, last, P


def gather_kv(cache_k, cache_v, indptr, indices, b, kv_len, layout="NHD"):
    """Request b's K and V as [kv_len, H, D] (float64) from 4-D pools."""
    pg = indices[indptr[b]:indptr[b + 1]]
    k = np.asarray(cache_k[pg], dtype=np.float64)
    v = np.asarray(cache_v[pg], dtype=np.float64)
    if layout == "HND":
        k = k.transpose(0, 2, 1, 3)
        v = v.transpose(0, 2, 1, 3)
    k = k.reshape(-1, k.shape[-2], k.shape[-1])[:kv_len]
    v = v.reshape(-1, v.shape[-2], v.shape[-1])[:kv_len]
    return k, v


def paged_decode(q, cache, indptr, indices, lens, layout="NHD"):
    """Decode outputs [B, Hq, D] in float64: request b's query row q[b] against its pages of a 5-D pool cache
    [P, 2, ...] (float64 arrays)."""
    out = []
    for b, n in enumerate(lens):
        k, v = gather_kv(cache[:, 0], cache[:, 1], indptr, indices, b, n, layout)
        out.append(attention(q[b:b + 1], k, v)[0][0])
    return np.stack(out)


def merge(v_a, s_a, v_b, s_b):
    v_a, v_b = np.asarray(v_a, np.float64), np.asarray(v_b, np.float64)
    s_a, s_b = np.asarray(s_a, np.float64), np.asarray(s_b, np.float64)
    m = np.maximum(s_a, s_b)
    safe = np.where(np.isfinite(m), m, 0.0)
    wa = np.where(np.isfinite(s_a), np.exp2(s_a - safe), 0.0)
    wb = np.where(np.isfinite(s_b), np.exp2(s_b - safe), 0.0)
    den = wa + wb
    with np.errstate(divide="ignore", invalid="ignore"):
        v = (wa[..., None] * v_a + wb[..., None] * v_b) / np.where(den > 0, den, 1.0)[..., None]
        s = np.where(den > 0, safe + np.log2(np.where(den > 0, den, 1.0)), -np.inf)
    return v, s


# ---- block-sparse (BSR) helpers: a random structure, its dense visibility, FlashInfer's packed mask ----

def bsr_random(rng, M, N, R, C, density):
    """Random BSR structure: indptr [MB+1], indices (shuffled within each row)."""
    MB, NB = (M + R - 1) // R, N // C
    indptr, indices = [0], []
    for _ in range(MB):
        cols = [int(j) for j in rng.permutation(NB) if rng.random() < density]
        indices += cols
        indptr.append(len(indices))
    return np.array(indptr, dtype=np.int32), np.array(indices, dtype=np.int32)


def bsr_dense_visible(indptr, indices, M, N, R, C, mask=None, causal=False):
    vis = np.zeros((M, N), dtype=bool)
    for b in range(len(indptr) - 1):
        for e in range(indptr[b], indptr[b + 1]):
            rows = min(R, M - b * R)
            blk = np.ones((rows, C), dtype=bool) if mask is None else mask[e, :rows]
            vis[b * R:b * R + rows, indices[e] * C:(indices[e] + 1) * C] = blk
    if causal:
        i = np.arange(M)[:, None]
        j = np.arange(N)[None, :]
        vis &= j <= i + (N - M)
    return vis


def bsr_packed_mask(mask, indptr, M, R, C):
    """FlashInfer's packed_mask: per block row mask[e0:e1].transpose(1, 0, 2) (rows truncated to M), flattened and
    packed little-endian into its own byte-aligned segment."""
    segs = []
    for b in range(len(indptr) - 1):
        e0, e1 = indptr[b], indptr[b + 1]
        rows = min(R, M - b * R)
        flat = mask[e0:e1, :rows].transpose(1, 0, 2).reshape(-1)
        segs.append(np.packbits(flat.astype(np.uint8), bitorder="little"))
    return np.concatenate(segs) if segs else np.zeros(0, np.uint8)


def assert_close(actual, expected, atol, rtol, what=""):
    a = np.asarray(actual, dtype=np.float64)
    e = np.asarray(expected, dtype=np.float64)
    assert a.shape == e.shape, "%s: shape %s vs %s" % (what, a.shape, e.shape)
    both_inf = np.isinf(a) & np.isinf(e) & (np.sign(a) == np.sign(e))
    with np.errstate(invalid="ignore"):
        err = np.where(both_inf, 0.0, np.abs(a - e))
    tol = atol + rtol * np.where(np.isfinite(e), np.abs(e), 0.0)
    bad = ~(err <= tol)
    if bad.any():
        idx = np.argwhere(bad)[0]
        raise AssertionError("%s: %d of %d elements differ; first at %s: got %r, expected %r (max err %g)" % (
            what, int(bad.sum()), bad.size, tuple(idx), a[tuple(idx)], e[tuple(idx)],
            float(np.nanmax(np.where(both_inf, 0, err)))))


TOL = {"float32": (2e-4, 2e-4), "float16": (4e-3, 1e-2), "bfloat16": (2e-2, 2e-2)}
