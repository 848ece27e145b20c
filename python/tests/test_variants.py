"""User-defined attention variants from Python (kvattn.Variant): FlashSigmoid and the per-head attention sink of
examples/variants/ on the single ops and the decode, paged-prefill and ragged-prefill wrappers, against a float64
reference written from the math; error cases; lifetime. CPU backend with NumPy (needs a C compiler: skipped with
the reason when none is found); torch CPU and torch CUDA cases where torch (and a GPU) are present."""

import gc
import math
import os
import shutil
import subprocess
import sys
import textwrap
import weakref
from pathlib import Path

import numpy as np
import pytest

import kvattn
from reference import gather_kv, make_paged

REPO = Path(__file__).resolve().parents[2]
EXAMPLES = REPO / "examples" / "variants"
LN2 = math.log(2.0)


def _c_compiler():
    """The compiler the CPU backend would use ($KVA_CC, else cc, gcc, clang on PATH), or None."""
    env = os.environ.get("KVA_CC")
    if env:
        return shutil.which(env) or (env if os.access(env, os.X_OK) else None)
    for name in ("cc", "gcc", "clang"):
        path = shutil.which(name)
        if path:
            return path
    return None


needs_cc = pytest.mark.skipif(_c_compiler() is None,
                              reason="no C compiler ($KVA_CC, cc, gcc or clang) for the CPU backend's variants")

# (atol, rtol, weight): |got - ref| <= atol + rtol |ref| + weight * sum_j w_j |v_j| (the last term bounds the
# rounding of the attention weights to the 16-bit value type before P.V)
TOL = {"float32": (2e-4, 2e-4, 0.0), "float16": (4e-3, 1e-2, 2.0 ** -10), "bfloat16": (2e-2, 2e-2, 2.0 ** -7)}


# --------------------------------------------------------------------------------------------------
# Reference (float64, from the math of examples/variants/*.c)

def _expit(z):
    return 0.5 * (1.0 + np.tanh(0.5 * z))


def variant_ref(q, k, v, kind, params, sm_scale, causal=False):
    """One request. q [qo, Hq, D], k [kv, Hkv, D], v [kv, Hkv, Dv]. Returns (o [qo, Hq, Dv], lse [qo, Hq] or None,
    bound [qo, Hq, Dv] = sum_j w_j |v_j| with w_j the normalised weights).

    sigmoid (params = (scale, bias)): o = sum_j sigmoid(scale * s_j + bias) v_j.
    sink (params = sink[Hq]): o = sum_j exp(s_j) v_j / (exp(sink_h) + sum_j exp(s_j)),
    lse = log2(sum_j exp(s_j)) over the real keys; s_j = sm_scale * q.k_j over the visible keys."""
    q = np.asarray(q, np.float64)
    k = np.asarray(k, np.float64)
    v = np.asarray(v, np.float64)
    qo, hq, _ = q.shape
    kv, hkv, _ = k.shape
    g = hq // hkv
    kk = np.repeat(k, g, axis=1)
    vv = np.repeat(v, g, axis=1)
    s = sm_scale * np.einsum("qhd,khd->hqk", q, kk)
    vis = np.ones((qo, kv), dtype=bool)
    if causal:
        vis &= np.arange(kv)[None, :] <= (kv - qo + np.arange(qo))[:, None]
    vis = np.broadcast_to(vis[None], s.shape)
    if kind == "sigmoid":
        scale, bias = params
        w = np.where(vis, _expit(scale * s + bias), 0.0)
        lse = None
    else:
        sink = np.asarray(params, np.float64)[:, None, None]
        m = np.where(vis, s, -np.inf).max(axis=-1, keepdims=True, initial=-np.inf)
        top = np.maximum(m, sink)
        e = np.where(vis, np.exp(s - top), 0.0)
        w = e / (np.exp(sink - top) + e.sum(-1, keepdims=True))
        tot = e.sum(-1)
        with np.errstate(divide="ignore"):
            lse = np.where(tot > 0, (top[..., 0] + np.log(np.where(tot > 0, tot, 1.0))) / LN2, -np.inf).T
    o = np.einsum("hqk,khd->qhd", w, vv)
    bound = np.einsum("hqk,khd->qhd", w, np.abs(vv))
    return o, lse, bound


def check(got, ref, bound, dtype, what):
    atol, rtol, wt = TOL[dtype]
    a = np.asarray(got, np.float64)
    assert a.shape == ref.shape, "%s: shape %s, expected %s" % (what, a.shape, ref.shape)
    tol = atol + rtol * np.abs(ref) + wt * bound
    err = np.abs(a - ref)
    bad = ~(err <= tol)
    if bad.any():
        i = tuple(np.argwhere(bad)[0])
        raise AssertionError("%s: %d of %d elements off; first at %s: got %r, expected %r (tol %g)"
                             % (what, int(bad.sum()), bad.size, i, a[i], ref[i], tol[i]))


def check_lse(got, ref, dtype, what):
    atol, rtol, _ = TOL[dtype]
    a = np.asarray(got, np.float64)
    assert a.shape == ref.shape, what
    both = np.isneginf(a) & np.isneginf(ref)
    with np.errstate(invalid="ignore"):
        err = np.where(both, 0.0, np.abs(a - ref))
    assert np.all(err <= atol + rtol * np.where(np.isfinite(ref), np.abs(ref), 0.0)), \
        "%s: max error %g" % (what, float(np.nanmax(err)))


# --------------------------------------------------------------------------------------------------
# Variants and inputs

def sigmoid_variant(**kw):
    return kvattn.Variant.from_file(EXAMPLES / "flash_sigmoid.c", "logits", use_softmax=False, num_scalars=2, **kw)


def sink_variant(**kw):
    return kvattn.Variant.from_file(EXAMPLES / "attention_sink.c", ["output"], num_tensors=1, **kw)


@pytest.fixture(scope="module")
def variants():
    if _c_compiler() is None:
        pytest.skip("no C compiler ($KVA_CC, cc, gcc or clang) for the CPU backend's variants")
    sig = sigmoid_variant(device="cpu")
    snk = sink_variant(device="cpu")
    yield {"sigmoid": sig, "sink": snk}
    sig.close()
    snk.close()


SIG_PARAMS = (0.35, -0.5)  # scale, bias


def sink_logits(rng, hq):
    s = (rng.standard_normal(hq) * 2.0).astype(np.float32)
    s[0] = 12.0  # a head whose sink dominates: its output is nearly 0
    return s


def case_args(kind, rng, hq):
    """(params for the reference, variant_scalars, variant_tensors) of a case."""
    if kind == "sigmoid":
        return SIG_PARAMS, list(SIG_PARAMS), None
    sink = sink_logits(rng, hq)
    return sink, None, [sink]


def rand(rng, shape, dtype):
    return rng.standard_normal(shape).astype(dtype)


DTYPES = [np.float32, np.float16]
KINDS = ["sigmoid", "sink"]

# --------------------------------------------------------------------------------------------------
# Single ops


@needs_cc
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("layout", ["NHD", "HND"])
def test_single_decode(rng, variants, kind, dtype, layout):
    hkv, g, d, kv = 2, 4, 32, 77
    hq = hkv * g
    q, k, v = rand(rng, (hq, d), dtype), rand(rng, (kv, hkv, d), dtype), rand(rng, (kv, hkv, d), dtype)
    params, scalars, tensors = case_args(kind, rng, hq)
    sm = 0.25 if kind == "sigmoid" else None
    kk, vv = (k, v) if layout == "NHD" else (np.ascontiguousarray(k.transpose(1, 0, 2)),
                                             np.ascontiguousarray(v.transpose(1, 0, 2)))
    res = kvattn.single_decode_with_kv_cache(q, kk, vv, kv_layout=layout, sm_scale=sm, variant=variants[kind],
                                             variant_scalars=scalars, variant_tensors=tensors,
                                             return_lse=kind == "sink")
    o, lse = res if kind == "sink" else (res, None)
    assert o.shape == (hq, d) and o.dtype == dtype
    ro, rl, rb = variant_ref(q[None], k, v, kind, params, sm if sm else 1.0 / math.sqrt(d))
    name = np.dtype(dtype).name
    check(o, ro[0], rb[0], name, "o")
    if kind == "sink":
        check_lse(lse, rl[0], name, "lse")
        assert np.all(np.abs(o[0]) < 1e-3)  # head 0: the sink takes almost all the weight


@needs_cc
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("causal", [False, True])
def test_single_prefill(rng, variants, kind, dtype, causal):
    qo, kv, hkv, g, d = 11, 29, 2, 3, 32
    hq = hkv * g
    q, k, v = rand(rng, (qo, hq, d), dtype), rand(rng, (kv, hkv, d), dtype), rand(rng, (kv, hkv, d), dtype)
    params, scalars, tensors = case_args(kind, rng, hq)
    kw = dict(causal=causal, variant=variants[kind], variant_scalars=scalars, variant_tensors=tensors)
    if kind == "sink":
        o, lse = kvattn.single_prefill_with_kv_cache_return_lse(q, k, v, **kw)
    else:
        o, lse = kvattn.single_prefill_with_kv_cache(q, k, v, **kw), None
    ro, rl, rb = variant_ref(q, k, v, kind, params, 1.0 / math.sqrt(d), causal)
    name = np.dtype(dtype).name
    check(o, ro, rb, name, "o")
    if kind == "sink":
        check_lse(lse, rl, name, "lse")


# --------------------------------------------------------------------------------------------------
# Batch wrappers


def ws(nbytes=32 << 20):
    return np.zeros(nbytes, dtype=np.uint8)


@needs_cc
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("split", [None, 2])
def test_batch_decode(rng, variants, kind, dtype, split):
    lens, ps, hkv, g, d = [0, 1, 33, 150, 16], 16, 2, 4, 32
    hq = hkv * g
    cache, indptr, indices, last, P = make_paged(rng, lens, ps, hkv, d, dtype)
    q = rand(rng, (len(lens), hq, d), dtype)
    params, scalars, tensors = case_args(kind, rng, hq)
    w = kvattn.BatchDecodeWithPagedKVCacheWrapper(ws())
    w.plan(indptr, indices, last, hq, hkv, d, ps, q_data_type=dtype, fixed_split_size=split,
           variant=variants[kind])
    if split:
        assert w.plan_info()["num_merge_tasks"] > 0  # the split-KV merge path runs
    o = w.run(q, cache, variant_scalars=scalars, variant_tensors=tensors)
    name = np.dtype(dtype).name
    for b, n in enumerate(lens):
        k, v = gather_kv(cache[:, 0], cache[:, 1], indptr, indices, b, n)
        ro, _, rb = variant_ref(q[b:b + 1], k, v, kind, params, 1.0 / math.sqrt(d))
        check(o[b], ro[0], rb[0], name, "o[%d]" % b)
    if kind == "sink":
        o2, lse = w.run_return_lse(q, cache, variant_tensors=tensors)
        np.testing.assert_array_equal(o, o2)
        for b, n in enumerate(lens):
            k, v = gather_kv(cache[:, 0], cache[:, 1], indptr, indices, b, n)
            _, rl, _ = variant_ref(q[b:b + 1], k, v, kind, params, 1.0 / math.sqrt(d))
            check_lse(lse[b], rl[0], name, "lse[%d]" % b)


@needs_cc
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_batch_prefill_paged_causal(rng, variants, kind, dtype):
    kv_lens, qo_lens, ps, hkv, g, d = [40, 7, 0, 90], [5, 7, 0, 33], 8, 2, 2, 32
    hq = hkv * g
    cache, indptr, indices, last, P = make_paged(rng, kv_lens, ps, hkv, d, dtype)
    qo_indptr = np.concatenate([[0], np.cumsum(qo_lens)]).astype(np.int32)
    q = rand(rng, (int(qo_indptr[-1]), hq, d), dtype)
    params, scalars, tensors = case_args(kind, rng, hq)
    w = kvattn.BatchPrefillWithPagedKVCacheWrapper(ws())
    # parameters given at plan: the defaults of every run
    w.plan(qo_indptr, indptr, indices, last, hq, hkv, d, ps, causal=True, q_data_type=dtype,
           variant=variants[kind], variant_scalars=scalars, variant_tensors=tensors)
    o = w.run(q, cache)
    name = np.dtype(dtype).name
    for b in range(len(kv_lens)):
        k, v = gather_kv(cache[:, 0], cache[:, 1], indptr, indices, b, kv_lens[b])
        r = slice(qo_indptr[b], qo_indptr[b + 1])
        ro, _, rb = variant_ref(q[r], k, v, kind, params, 1.0 / math.sqrt(d), causal=True)
        check(o[r], ro, rb, name, "o[request %d]" % b)


@needs_cc
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("causal", [False, True])
def test_batch_prefill_ragged(rng, variants, kind, dtype, causal):
    kv_lens, qo_lens, hkv, g, d = [19, 64, 3], [19, 9, 3], 2, 4, 32
    hq = hkv * g
    kv_indptr = np.concatenate([[0], np.cumsum(kv_lens)]).astype(np.int32)
    qo_indptr = np.concatenate([[0], np.cumsum(qo_lens)]).astype(np.int32)
    q = rand(rng, (int(qo_indptr[-1]), hq, d), dtype)
    k = rand(rng, (int(kv_indptr[-1]), hkv, d), dtype)
    v = rand(rng, (int(kv_indptr[-1]), hkv, d), dtype)
    params, scalars, tensors = case_args(kind, rng, hq)
    w = kvattn.BatchPrefillWithRaggedKVCacheWrapper(ws())
    w.plan(qo_indptr, kv_indptr, hq, hkv, d, causal=causal, q_data_type=dtype, fixed_split_size=16,
           variant=variants[kind])
    o = w.run(q, k, v, variant_scalars=scalars, variant_tensors=tensors)
    name = np.dtype(dtype).name
    for b in range(len(kv_lens)):
        r = slice(qo_indptr[b], qo_indptr[b + 1])
        kr = slice(kv_indptr[b], kv_indptr[b + 1])
        ro, _, rb = variant_ref(q[r], k[kr], v[kr], kind, params, 1.0 / math.sqrt(d), causal)
        check(o[r], ro, rb, name, "o[request %d]" % b)


@needs_cc
def test_run_parameters_override_plan_defaults(rng, variants):
    """Scalars given at plan are the default of every run; scalars given at run replace them for that run."""
    lens, ps, hkv, d = [20, 45], 16, 2, 32
    cache, indptr, indices, last, _ = make_paged(rng, lens, ps, hkv, d, np.float32)
    q = rand(rng, (2, 4, d), np.float32)
    w = kvattn.BatchDecodeWithPagedKVCacheWrapper(ws())
    w.plan(indptr, indices, last, 4, hkv, d, ps, q_data_type="float32", variant=variants["sigmoid"],
           variant_scalars=[0.1, 0.2])
    o_default = w.run(q, cache)
    o_other = w.run(q, cache, variant_scalars=(0.5, -1.0))
    np.testing.assert_array_equal(o_default, w.run(q, cache))  # the override did not stick
    for b, n in enumerate(lens):
        k, v = gather_kv(cache[:, 0], cache[:, 1], indptr, indices, b, n)
        for out, params in ((o_default, (0.1, 0.2)), (o_other, (0.5, -1.0))):
            ro, _, rb = variant_ref(q[b:b + 1], k, v, "sigmoid", params, 1.0 / math.sqrt(d))
            check(out[b], ro[0], rb[0], "float32", "o[%d] with %s" % (b, params))


@needs_cc
def test_replans_keep_the_variant(rng, variants):
    """Plans remade by the wrapper itself (a smaller pool at run; forward() with another causal) keep the variant."""
    kv_lens, qo_lens, ps, hkv, d = [30, 12], [4, 12], 8, 2, 32
    cache, indptr, indices, last, P = make_paged(rng, kv_lens, ps, hkv, d, np.float32)
    qo_indptr = np.array([0, 4, 16], np.int32)
    q = rand(rng, (16, 4, d), np.float32)
    w = kvattn.BatchPrefillWithPagedKVCacheWrapper(ws())
    w.plan(qo_indptr, indptr, indices, last, 4, hkv, d, ps, causal=False, q_data_type="float32", num_pages=P + 10,
           variant=variants["sigmoid"], variant_scalars=SIG_PARAMS)
    o = w.run(q, cache)  # the pool has P < P + 10 pages: planned again for it
    o_causal = w.forward(q, cache, causal=True)  # planned again with causal=True
    for b in range(2):
        k, v = gather_kv(cache[:, 0], cache[:, 1], indptr, indices, b, kv_lens[b])
        r = slice(qo_indptr[b], qo_indptr[b + 1])
        for out, causal in ((o, False), (o_causal, True)):
            ro, _, rb = variant_ref(q[r], k, v, "sigmoid", SIG_PARAMS, 1.0 / math.sqrt(d), causal)
            check(out[r], ro, rb, "float32", "o[request %d] causal=%s" % (b, causal))


@needs_cc
def test_plan_keeps_variant_and_tensors_alive(rng):
    """A plan keeps its Variant and the tensors given at plan alive: no other reference is needed."""
    ps, hkv, d = 16, 1, 32
    cache, indptr, indices, last, _ = make_paged(rng, [30], ps, hkv, d, np.float32)
    q = rand(rng, (1, 2, d), np.float32)
    sink = np.array([0.5, -1.0], np.float32)
    w = kvattn.BatchDecodeWithPagedKVCacheWrapper(ws())
    w.plan(indptr, indices, last, 2, hkv, d, ps, q_data_type="float32", variant=sink_variant(),
           variant_tensors=[sink.copy()])
    gc.collect()
    o = w.run(q, cache)
    k, v = gather_kv(cache[:, 0], cache[:, 1], indptr, indices, 0, 30)
    ro, _, rb = variant_ref(q, k, v, "sink", sink, 1.0 / math.sqrt(d))
    check(o[0], ro[0], rb[0], "float32", "o")


# --------------------------------------------------------------------------------------------------
# Variant objects and errors


def test_hook_names_and_flags():
    P = kvattn.variant.parse_hooks
    H = kvattn.VariantHook
    assert P("logits") == P(4) == P(H.LOGITS_TRANSFORM) == P("KVA_VARIANT_LOGITS_TRANSFORM") == 4
    assert P(["query", "key", "logits", "mask", "output"]) == 31
    assert P("mask|output") == P([H.LOGITS_MASK, "output"]) == 24
    assert P("logits_mask") == 8 and P("QUERY_TRANSFORM") == 1
    with pytest.raises(ValueError, match="unknown variant hook"):
        P("softmax")
    with pytest.raises(ValueError, match="bits outside"):
        P(64)


def test_variant_spec_checked_at_construction():
    with pytest.raises(ValueError, match="C identifier"):
        kvattn.Variant("float x;", "logits", name="not an identifier")
    with pytest.raises(ValueError, match="C identifier"):
        kvattn.Variant("float x;", "logits", name="x" * 49)
    with pytest.raises(ValueError, match="num_scalars"):
        kvattn.Variant("float x;", "logits", num_scalars=17)
    with pytest.raises(ValueError, match="num_tensors"):
        kvattn.Variant("float x;", "logits", num_tensors=5)
    with pytest.raises(ValueError, match="empty"):
        kvattn.Variant("  \n", "logits")
    with pytest.raises(TypeError):
        kvattn.Variant(None, "logits")
    with pytest.raises(kvattn.InvalidArgumentError, match="UTF-8"):  # bytes that are not UTF-8
        kvattn.Variant(b"KVA_HOOK float f(void) { return 0.f; } /* \xff\xfe */", "logits")
    with pytest.raises(kvattn.InvalidArgumentError, match="UTF-8"):  # a lone surrogate
        kvattn.Variant("KVA_HOOK float f(void) { return 0.f; } /* \ud800 */", "logits")


@needs_cc
def test_bad_source_raises_jit_error_with_the_compiler_log():
    bad = "KVA_HOOK float kva_logits_transform(const kva_vparams* p, float logit) { return logit + ; }\n"
    with pytest.raises(kvattn.JitError) as ei:
        kvattn.Variant(bad, "logits", name="broken_variant", device="cpu")
    msg = str(ei.value)
    assert "broken_variant" in msg and "error" in msg
    assert ei.value.status_name == "KVA_ERR_JIT"
    # a declared hook that the source does not define is a compile error too
    with pytest.raises(kvattn.JitError):
        kvattn.Variant(bad.replace("return logit + ;", "return logit;"), "logits|output", device="cpu")
    # lazily: the error comes from the first use
    v = kvattn.Variant(bad, "logits", name="broken_lazy")
    q = np.zeros((2, 16), np.float32)
    k = np.zeros((3, 2, 16), np.float32)
    with pytest.raises(kvattn.JitError, match="broken_lazy"):
        kvattn.single_decode_with_kv_cache(q, k, k, variant=v)


@needs_cc
def test_no_compiler_raises_unsupported(monkeypatch):
    monkeypatch.setenv("KVA_CC", "/nonexistent/kvattn-no-such-cc")
    src = "/* unique: no_compiler_case */\n" + (EXAMPLES / "flash_sigmoid.c").read_text()
    with pytest.raises(kvattn.UnsupportedError, match="KVA_CC"):
        kvattn.Variant(src, "logits", use_softmax=False, num_scalars=2, name="no_cc", device="cpu")


@needs_cc
def test_wrong_parameter_counts_raise_at_run(rng, variants):
    q = rand(rng, (4, 16), np.float32)
    k = rand(rng, (9, 2, 16), np.float32)
    sig, snk = variants["sigmoid"], variants["sink"]
    with pytest.raises(ValueError, match="takes 2 scalar parameters"):
        kvattn.single_decode_with_kv_cache(q, k, k, variant=sig, variant_scalars=[1.0])
    with pytest.raises(ValueError, match="takes 2 scalar parameters"):
        kvattn.single_decode_with_kv_cache(q, k, k, variant=sig)
    with pytest.raises(ValueError, match="takes 1 tensor parameter"):
        kvattn.single_decode_with_kv_cache(q, k, k, variant=snk)
    with pytest.raises(TypeError, match="float32"):
        kvattn.single_decode_with_kv_cache(q, k, k, variant=snk, variant_tensors=[np.zeros(4)])
    with pytest.raises(ValueError, match="contiguous"):
        kvattn.single_decode_with_kv_cache(q, k, k, variant=snk,
                                           variant_tensors=[np.zeros(8, np.float32)[::2]])
    with pytest.raises(TypeError, match="sequence of arrays"):
        kvattn.single_decode_with_kv_cache(q, k, k, variant=snk, variant_tensors=np.zeros(4, np.float32))
    with pytest.raises(ValueError, match="without variant"):
        kvattn.single_decode_with_kv_cache(q, k, k, variant_scalars=[1.0, 2.0])

    cache, indptr, indices, last, _ = make_paged(rng, [10, 20], 16, 2, 16, np.float32)
    qb = rand(rng, (2, 4, 16), np.float32)
    w = kvattn.BatchDecodeWithPagedKVCacheWrapper(ws())
    w.plan(indptr, indices, last, 4, 2, 16, 16, q_data_type="float32", variant=sig)  # no scalars at plan
    with pytest.raises(ValueError, match="takes 2 scalar parameters.*got 0"):
        w.run(qb, cache)
    with pytest.raises(ValueError, match="takes 2 scalar parameters.*got 3"):
        w.run(qb, cache, variant_scalars=[1.0, 2.0, 3.0])
    w.run(qb, cache, variant_scalars=[1.0, 2.0])
    with pytest.raises(ValueError, match="takes 2 scalar parameters"):  # checked at plan when given there
        w.plan(indptr, indices, last, 4, 2, 16, 16, q_data_type="float32", variant=sig, variant_scalars=[1.0])
    w.plan(indptr, indices, last, 4, 2, 16, 16, q_data_type="float32")  # no variant
    with pytest.raises(ValueError, match="no variant"):
        w.run(qb, cache, variant_scalars=[1.0, 2.0])


@needs_cc
def test_closed_variant_refuses(rng):
    v = sigmoid_variant(device="cpu")
    cache, indptr, indices, last, _ = make_paged(rng, [10, 20], 16, 2, 16, np.float32)
    qb = rand(rng, (2, 4, 16), np.float32)
    w = kvattn.BatchDecodeWithPagedKVCacheWrapper(ws())
    w.plan(indptr, indices, last, 4, 2, 16, 16, q_data_type="float32", variant=v, variant_scalars=[1.0, 0.0])
    w.run(qb, cache)
    v.close()
    assert v.closed and v.devices == ()
    v.close()  # idempotent
    # the plan recorded the destroyed C variant: the C library refuses the run
    with pytest.raises(kvattn.PlanMismatchError, match="not a live variant"):
        w.run(qb, cache)
    with pytest.raises(ValueError, match="closed"):
        w.plan(indptr, indices, last, 4, 2, 16, 16, q_data_type="float32", variant=v)
    with pytest.raises(ValueError, match="closed"):
        kvattn.single_decode_with_kv_cache(qb[0], cache[0, 0], cache[0, 1], variant=v, variant_scalars=[1, 0])
    with pytest.raises(ValueError, match="closed"):
        v.compile("cpu")
    with sigmoid_variant() as v2:  # context manager
        v2.compile("cpu")
        assert v2.devices == ("cpu",)
    assert v2.closed


@needs_cc
def test_garbage_collected_variant_is_destroyed():
    v = sigmoid_variant(device="cpu")
    ref = weakref.ref(v)
    fin = v._finalizer
    assert fin.alive
    del v
    gc.collect()
    assert ref() is None and not fin.alive


@needs_cc
def test_destroy_after_context_is_gone_is_skipped(tmp_path):
    """Contexts are destroyed at exit (they free their variants): a Variant closed or collected afterwards must not
    touch the freed handle. Run in a child process (it destroys the process-wide CPU context)."""
    script = textwrap.dedent("""
        import kvattn
        from kvattn import _context, _ffi
        lib = _ffi.lib()
        real, calls = lib.kva_variant_destroy, []
        lib.kva_variant_destroy = lambda p: (calls.append(p), real(p))[1]   # count the C calls
        u = kvattn.Variant.from_file(%r, "logits", use_softmax=False, num_scalars=2, device="cpu")
        u.close()                     # context alive: destroyed
        assert len(calls) == 1, calls
        v = kvattn.Variant.from_file(%r, "logits", use_softmax=False, num_scalars=2, device="cpu")
        w = kvattn.Variant.from_file(%r, "output", num_tensors=1, device="cpu")
        _context._destroy_all()       # what the interpreter does at exit (the context frees v and w)
        assert v.devices == ()
        v.close()                     # must not call kva_variant_destroy on the freed variant
        del w
        import gc; gc.collect()       # nor the finalizer of a collected one
        assert len(calls) == 1, calls
        print("ok")
    """ % ((str(EXAMPLES / "flash_sigmoid.c"),) * 2 + (str(EXAMPLES / "attention_sink.c"),)))
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(REPO / "python")] + [p for p in [env.get("PYTHONPATH")] if p])
    r = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and r.stdout.strip() == "ok", r.stdout + r.stderr


@needs_cc
def test_refused_combinations(rng, variants):
    sig, snk = variants["sigmoid"], variants["sink"]
    q = rand(rng, (3, 4, 16), np.float32)
    k = rand(rng, (9, 2, 16), np.float32)
    # lse of a no-softmax variant
    with pytest.raises(ValueError, match="lse is not defined"):
        kvattn.single_prefill_with_kv_cache(q, k, k, variant=sig, variant_scalars=[1, 0], return_lse=True)
    cache, indptr, indices, last, _ = make_paged(rng, [10, 20], 16, 2, 16, np.float32)
    qb = rand(rng, (2, 4, 16), np.float32)
    w = kvattn.BatchDecodeWithPagedKVCacheWrapper(ws())
    w.plan(indptr, indices, last, 4, 2, 16, 16, q_data_type="float32", variant=sig, variant_scalars=[1, 0])
    with pytest.raises(ValueError, match="lse is not defined"):
        w.run(qb, cache, return_lse=True)
    with pytest.raises(ValueError, match="lse is not defined"):
        w.run(qb, cache, lse=np.zeros((2, 4), np.float32))
    # fused RoPE: refused by the C library's descriptor check
    with pytest.raises(kvattn.UnsupportedError, match="ROPE"):
        w.plan(indptr, indices, last, 4, 2, 16, 16, q_data_type="float32", variant=sig, variant_scalars=[1, 0],
               pos_encoding_mode="ROPE_LLAMA")
    with pytest.raises(kvattn.UnsupportedError, match="ROPE"):
        kvattn.single_prefill_with_kv_cache(q, k, k, variant=sig, variant_scalars=[1, 0],
                                            pos_encoding_mode="ROPE_LLAMA")
    # v_scale scales the values inside the kernel (any KV dtype), before the variant's output transform
    oa = kvattn.single_prefill_with_kv_cache(q, k, k, variant=snk, variant_tensors=[np.zeros(4, np.float32)],
                                             v_scale=2.0)
    ob = kvattn.single_prefill_with_kv_cache(q, k, 2.0 * k, variant=snk, variant_tensors=[np.zeros(4, np.float32)])
    np.testing.assert_allclose(oa, ob, rtol=1e-5, atol=1e-6)
    o1 = kvattn.single_prefill_with_kv_cache(q, k, k, variant=sig, variant_scalars=[1, 0])
    o2 = kvattn.single_prefill_with_kv_cache(q, k, k, variant=sig, variant_scalars=[1, 0], v_scale=2.0)
    np.testing.assert_allclose(o2, 2.0 * o1, rtol=1e-6)  # linear in v without an output transform: allowed
    # wrappers the C library runs without variants
    with pytest.raises(kvattn.UnsupportedError, match="variant"):
        kvattn.MultiLevelCascadeAttentionWrapper(2, ws()).plan(
            [np.array([0, 2], np.int32)] * 2, [indptr[:2]] * 2, [indices] * 2, [last[:1]] * 2, 4, 2, 16, 16,
            variant=snk)
    with pytest.raises(kvattn.UnsupportedError, match="variant"):
        kvattn.BlockSparseAttentionWrapper(ws()).plan(np.array([0, 1], np.int32), np.array([0], np.int32), 4, 4,
                                                      4, 4, 4, 2, 16, variant=snk)
    with pytest.raises(kvattn.UnsupportedError, match="variant"):
        kvattn.VariableBlockSparseAttentionWrapper(ws()).plan(
            np.ones((2, 1, 1), bool), np.full((2, 1), 4, np.int32), np.full((2, 1), 4, np.int32), 4, 2, 16,
            variant=snk)
    with pytest.raises(TypeError, match="kvattn.Variant"):
        kvattn.single_prefill_with_kv_cache(q, k, k, variant="flash_sigmoid")


@needs_cc
def test_workspace_size_with_variant(rng, variants):
    _, indptr, indices, last, _ = make_paged(rng, [100, 3], 16, 2, 16, np.float32)
    w = kvattn.BatchDecodeWithPagedKVCacheWrapper(ws())
    need, _ = w.workspace_size(indptr, indices, last, 4, 2, 16, 16, q_data_type="float32",
                               variant=variants["sink"])
    assert need > 0


# --------------------------------------------------------------------------------------------------
# torch: CPU tensors (CPU backend) and CUDA tensors (CUDA backend)


def _torch():
    return pytest.importorskip("torch", reason="torch is not installed")


@pytest.fixture
def torch_cuda():
    torch = _torch()
    if not torch.cuda.is_available():
        pytest.skip("CUDA is not available (torch.cuda.is_available() is False)")
    return torch


def np64(x):
    return x.detach().float().cpu().numpy().astype(np.float64)


@needs_cc
@pytest.mark.parametrize("kind", KINDS)
def test_torch_cpu(rng, variants, kind):
    """torch CPU tensors run on the CPU backend with the same compiled variant as NumPy arrays."""
    torch = _torch()
    hkv, g, d, ps = 2, 2, 32, 16
    hq = hkv * g
    q = torch.from_numpy(rand(rng, (5, hq, d), np.float32))
    k = torch.from_numpy(rand(rng, (21, hkv, d), np.float32))
    v = torch.from_numpy(rand(rng, (21, hkv, d), np.float32))
    params, scalars, tensors = case_args(kind, rng, hq)
    tt = None if tensors is None else [torch.from_numpy(t) for t in tensors]
    o = kvattn.single_prefill_with_kv_cache(q, k, v, causal=True, variant=variants[kind], variant_scalars=scalars,
                                            variant_tensors=tt)
    assert isinstance(o, torch.Tensor)
    ro, _, rb = variant_ref(q.numpy(), k.numpy(), v.numpy(), kind, params, 1.0 / math.sqrt(d), causal=True)
    check(o.numpy(), ro, rb, "float32", "single prefill o")

    lens = [9, 40]
    cache_np, indptr, indices, last, _ = make_paged(rng, lens, ps, hkv, d, np.float32)
    qd = torch.from_numpy(rand(rng, (2, hq, d), np.float32))
    w = kvattn.BatchDecodeWithPagedKVCacheWrapper(torch.zeros(16 << 20, dtype=torch.uint8))
    w.plan(torch.from_numpy(indptr), torch.from_numpy(indices), torch.from_numpy(last), hq, hkv, d, ps,
           q_data_type=torch.float32, variant=variants[kind], variant_scalars=scalars, variant_tensors=tt)
    od = w.run(qd, torch.from_numpy(cache_np))
    for b, n in enumerate(lens):
        kb, vb = gather_kv(cache_np[:, 0], cache_np[:, 1], indptr, indices, b, n)
        ro, _, rb = variant_ref(qd[b:b + 1].numpy(), kb, vb, kind, params, 1.0 / math.sqrt(d))
        check(od[b].numpy(), ro[0], rb[0], "float32", "decode o[%d]" % b)
    if kind == "sink":
        with pytest.raises(TypeError, match="must be float32"):
            kvattn.single_prefill_with_kv_cache(q, k, v, variant=variants[kind], variant_tensors=[tt[0].double()])
    else:
        with pytest.raises(ValueError, match="takes 2 scalar parameters"):
            kvattn.single_prefill_with_kv_cache(q, k, v, variant=variants[kind], variant_scalars=scalars[:1])


CUDA_DTYPES = ["float16", "bfloat16"]


def _tdt(torch, name):
    return {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}[name]


def trand(torch, rng, shape, tdt):
    """Seeded standard-normal CUDA tensor (drawn by the test's NumPy generator)."""
    return torch.from_numpy(rng.standard_normal(shape).astype(np.float32)).cuda().to(tdt)


def cuda_case_args(torch, kind, rng, hq):
    params, scalars, tensors = case_args(kind, rng, hq)
    return params, scalars, None if tensors is None else [torch.from_numpy(t).cuda() for t in tensors]


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("dtype", CUDA_DTYPES)
def test_cuda_single(rng, torch_cuda, kind, dtype):
    torch = torch_cuda
    var = sigmoid_variant() if kind == "sigmoid" else sink_variant()
    hkv, g, d, kv, qo = 2, 4, 64, 300, 17
    hq = hkv * g
    tdt = _tdt(torch, dtype)
    q = trand(torch, rng, (qo, hq, d), tdt)
    k = trand(torch, rng, (kv, hkv, d), tdt)
    v = trand(torch, rng, (kv, hkv, d), tdt)
    params, scalars, tensors = cuda_case_args(torch, kind, rng, hq)
    od = kvattn.single_decode_with_kv_cache(q[0], k, v, variant=var, variant_scalars=scalars,
                                            variant_tensors=tensors)
    op = kvattn.single_prefill_with_kv_cache(q, k, v, causal=True, variant=var, variant_scalars=scalars,
                                             variant_tensors=tensors)
    assert od.device.type == "cuda" and op.dtype == tdt
    assert var.devices == ("cuda:%d" % torch.cuda.current_device(),)
    sm = 1.0 / math.sqrt(d)
    ro, _, rb = variant_ref(np64(q[:1]), np64(k), np64(v), kind, params, sm)
    check(np64(od), ro[0], rb[0], dtype, "decode o")
    ro, _, rb = variant_ref(np64(q), np64(k), np64(v), kind, params, sm, causal=True)
    check(np64(op), ro, rb, dtype, "prefill o")
    var.close()


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("dtype", CUDA_DTYPES)
def test_cuda_batch_wrappers(rng, torch_cuda, kind, dtype):
    torch = torch_cuda
    var = sigmoid_variant() if kind == "sigmoid" else sink_variant()
    tdt = _tdt(torch, dtype)
    kv_lens, qo_lens, ps, hkv, g, d = [0, 1, 70, 600, 33], [0, 1, 9, 40, 33], 16, 2, 4, 64
    hq = hkv * g
    cache_np, indptr, indices, last, P = make_paged(rng, kv_lens, ps, hkv, d, np.float32)
    cache = torch.from_numpy(cache_np).cuda().to(tdt)
    c64 = np64(cache)
    params, scalars, tensors = cuda_case_args(torch, kind, rng, hq)
    wsb = torch.zeros(128 << 20, dtype=torch.uint8, device="cuda")
    sm = 1.0 / math.sqrt(d)

    # paged decode (with a forced split: the variant's merge kernel)
    qd = trand(torch, rng, (len(kv_lens), hq, d), tdt)
    w = kvattn.BatchDecodeWithPagedKVCacheWrapper(wsb)
    w.plan(indptr, torch.from_numpy(indices).cuda(), last, hq, hkv, d, ps, q_data_type=tdt, fixed_split_size=4,
           variant=var)
    o = w.run(qd, cache, variant_scalars=scalars, variant_tensors=tensors)
    for b, n in enumerate(kv_lens):
        k, v = gather_kv(c64[:, 0], c64[:, 1], indptr, indices, b, n)
        ro, _, rb = variant_ref(np64(qd[b:b + 1]), k, v, kind, params, sm)
        check(np64(o[b]), ro[0], rb[0], dtype, "decode o[%d]" % b)

    # paged prefill, causal
    qo_indptr = np.concatenate([[0], np.cumsum(qo_lens)]).astype(np.int32)
    qp = trand(torch, rng, (int(qo_indptr[-1]), hq, d), tdt)
    wp = kvattn.BatchPrefillWithPagedKVCacheWrapper(wsb)
    wp.plan(qo_indptr, indptr, indices, last, hq, hkv, d, ps, causal=True, q_data_type=tdt, variant=var,
            variant_scalars=scalars, variant_tensors=tensors)
    o = wp.run(qp, cache)
    for b, n in enumerate(kv_lens):
        k, v = gather_kv(c64[:, 0], c64[:, 1], indptr, indices, b, n)
        r = slice(qo_indptr[b], qo_indptr[b + 1])
        ro, _, rb = variant_ref(np64(qp[r]), k, v, kind, params, sm, causal=True)
        check(np64(o[r]), ro, rb, dtype, "paged prefill o[request %d]" % b)

    # ragged prefill
    kv_indptr = np.concatenate([[0], np.cumsum(kv_lens)]).astype(np.int32)
    k = trand(torch, rng, (int(kv_indptr[-1]), hkv, d), tdt)
    v = trand(torch, rng, (int(kv_indptr[-1]), hkv, d), tdt)
    wr = kvattn.BatchPrefillWithRaggedKVCacheWrapper(wsb)
    wr.plan(qo_indptr, kv_indptr, hq, hkv, d, causal=True, q_data_type=tdt, variant=var)
    o = wr.run(qp, k, v, variant_scalars=scalars, variant_tensors=tensors)
    for b in range(len(kv_lens)):
        r = slice(qo_indptr[b], qo_indptr[b + 1])
        kr = slice(kv_indptr[b], kv_indptr[b + 1])
        ro, _, rb = variant_ref(np64(qp[r]), np64(k[kr]), np64(v[kr]), kind, params, sm, causal=True)
        check(np64(o[r]), ro, rb, dtype, "ragged o[request %d]" % b)

    if tensors is not None:  # a tensor parameter on the wrong device
        with pytest.raises(ValueError, match="is on cpu"):
            wr.run(qp, k, v, variant_tensors=[tensors[0].cpu()])
    var.close()


def test_cuda_graph_replays_captured_scalars_and_reads_tensors(rng, torch_cuda):
    """CUDA graphs: the scalars are captured by value (a replay uses those of the captured run); tensor parameters
    are read at replay (their contents may change between replays)."""
    torch = torch_cuda
    sig, snk = sigmoid_variant(), sink_variant()
    lens, ps, hkv, g, d = [50, 200, 7], 16, 2, 4, 64
    hq = hkv * g
    B = len(lens)
    cache_np, indptr, indices, last, P = make_paged(rng, lens, ps, hkv, d, np.float32)
    cache = torch.from_numpy(cache_np).cuda().half()
    c64 = np64(cache)
    q = trand(torch, rng, (B, hq, d), torch.float16)
    sm = 1.0 / math.sqrt(d)
    bufs = [torch.zeros(B + 1, dtype=torch.int32, device="cuda"),
            torch.zeros(len(indices), dtype=torch.int32, device="cuda"),
            torch.zeros(B, dtype=torch.int32, device="cuda")]
    wsb = torch.zeros(64 << 20, dtype=torch.uint8, device="cuda")

    def graph_of(var, **run_kw):
        w = kvattn.BatchDecodeWithPagedKVCacheWrapper(wsb, use_cuda_graph=True, paged_kv_indptr_buffer=bufs[0],
                                                      paged_kv_indices_buffer=bufs[1],
                                                      paged_kv_last_page_len_buffer=bufs[2])
        w.plan(indptr, indices, last, hq, hkv, d, ps, q_data_type=torch.float16, num_pages=P, variant=var)
        out = torch.empty(B, hq, d, device="cuda", dtype=torch.float16)
        w.run(q, cache, out=out, **run_kw)  # warm-up outside capture
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            w.run(q, cache, out=out, **run_kw)
        return graph, out

    def expect(out, kind, params):
        for b, n in enumerate(lens):
            k, v = gather_kv(c64[:, 0], c64[:, 1], indptr, indices, b, n)
            ro, _, rb = variant_ref(np64(q[b:b + 1]), k, v, kind, params, sm)
            check(np64(out[b]), ro[0], rb[0], "float16", "%s o[%d]" % (kind, b))

    scalars = [0.3, 0.1]
    graph, out = graph_of(sig, variant_scalars=scalars)
    scalars[0] = 5.0  # the caller's list changing after capture does not reach the graph
    out.zero_()
    graph.replay()
    torch.cuda.synchronize()
    expect(out, "sigmoid", (0.3, 0.1))

    sink = torch.zeros(hq, device="cuda")
    graph, out = graph_of(snk, variant_tensors=[sink])
    new = sink_logits(rng, hq)
    sink.copy_(torch.from_numpy(new))  # same memory, new contents: read at replay
    graph.replay()
    torch.cuda.synchronize()
    expect(out, "sink", new)
    sig.close()
    snk.close()


@needs_cc
def test_one_variant_on_cpu_and_cuda(rng, torch_cuda):
    torch = torch_cuda
    var = sigmoid_variant()
    d = 64
    q = rand(rng, (4, d), np.float16)
    k = rand(rng, (40, 2, d), np.float16)
    v = rand(rng, (40, 2, d), np.float16)
    o_cpu = kvattn.single_decode_with_kv_cache(q, k, v, variant=var, variant_scalars=[0.2, 0.0])
    o_gpu = kvattn.single_decode_with_kv_cache(torch.from_numpy(q).cuda(), torch.from_numpy(k).cuda(),
                                               torch.from_numpy(v).cuda(), variant=var, variant_scalars=[0.2, 0.0])
    assert set(var.devices) == {"cpu", "cuda:%d" % torch.cuda.current_device()}
    ro, _, rb = variant_ref(q[None], k, v, "sigmoid", (0.2, 0.0), 1.0 / math.sqrt(d))
    check(o_cpu, ro[0], rb[0], "float16", "cpu o")
    check(np64(o_gpu), ro[0], rb[0], "float16", "cuda o")
    var.close()
    assert var.devices == ()
