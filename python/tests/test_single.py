"""single_decode_with_kv_cache / single_prefill_with_kv_cache on the CPU backend against the reference."""

import numpy as np
import pytest

import kvattn
from reference import TOL, assert_close, attention


@pytest.mark.parametrize("group", [1, 4, 7])
@pytest.mark.parametrize("layout", ["NHD", "HND"])
@pytest.mark.parametrize("dtype", [np.float32, np.float16])
def test_single_decode(rng, group, layout, dtype):
    hkv, d, kv = 2, 32, 37
    q = rng.standard_normal((hkv * group, d)).astype(dtype)
    k = rng.standard_normal((kv, hkv, d)).astype(dtype)
    v = rng.standard_normal((kv, hkv, d)).astype(dtype)
    kk, vv = (k, v) if layout == "NHD" else (np.ascontiguousarray(k.transpose(1, 0, 2)),
                                             np.ascontiguousarray(v.transpose(1, 0, 2)))
    o, lse = kvattn.single_decode_with_kv_cache(q, kk, vv, kv_layout=layout, return_lse=True)
    assert o.shape == (hkv * group, d) and lse.shape == (hkv * group,) and o.dtype == dtype
    ro, rl = attention(q[None], k, v)
    atol, rtol = TOL[np.dtype(dtype).name]
    assert_close(o, ro[0], atol, rtol, "o")
    assert_close(lse, rl[0], atol, rtol, "lse")
    o2 = kvattn.single_decode_with_kv_cache(q, kk, vv, kv_layout=layout)
    np.testing.assert_array_equal(o, o2)


@pytest.mark.parametrize("feature", [
    dict(pos_encoding_mode="ROPE_LLAMA"), dict(pos_encoding_mode="ALIBI"), dict(logits_soft_cap=4.0),
    dict(window_left=5), dict(sm_scale=0.5), dict(pos_encoding_mode="ROPE_LLAMA", rope_scale=2.0, rope_theta=1e5),
])
def test_single_decode_features(rng, feature):
    q = rng.standard_normal((8, 16)).astype(np.float32)
    k = rng.standard_normal((29, 2, 16)).astype(np.float32)
    v = rng.standard_normal((29, 2, 16)).astype(np.float32)
    o, lse = kvattn.single_decode_with_kv_cache(q, k, v, return_lse=True, **feature)
    kw = dict(feature)
    if "pos_encoding_mode" in kw:
        kw["pos_encoding"] = kw.pop("pos_encoding_mode")
    ro, rl = attention(q[None], k, v, **kw)
    assert_close(o, ro[0], 2e-4, 2e-4)
    assert_close(lse, rl[0], 2e-4, 2e-4)


def test_single_decode_scales_fold_into_sm_scale(rng):
    q = rng.standard_normal((4, 16)).astype(np.float32)
    k = rng.standard_normal((9, 4, 16)).astype(np.float32)
    v = rng.standard_normal((9, 4, 16)).astype(np.float32)
    o = kvattn.single_decode_with_kv_cache(q, k, v, q_scale=0.5, k_scale=2.0, v_scale=3.0, sm_scale=0.2)
    ro, _ = attention(q[None], k, v, sm_scale=0.2 * 0.5 * 2.0)
    assert_close(o, ro[0] * 3.0, 5e-4, 2e-4)


@pytest.mark.parametrize("group", [1, 4, 7])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("layout", ["NHD", "HND"])
def test_single_prefill(rng, group, causal, layout):
    qo, kv, hkv, d = 9, 23, 2, 32
    q = rng.standard_normal((qo, hkv * group, d)).astype(np.float32)
    k = rng.standard_normal((kv, hkv, d)).astype(np.float32)
    v = rng.standard_normal((kv, hkv, d)).astype(np.float32)
    kk, vv = (k, v) if layout == "NHD" else (k.transpose(1, 0, 2), v.transpose(1, 0, 2))  # strided HND views
    o, lse = kvattn.single_prefill_with_kv_cache(q, kk, vv, causal=causal, kv_layout=layout, return_lse=True)
    ro, rl = attention(q, k, v, causal=causal)
    assert_close(o, ro, 2e-4, 2e-4)
    assert_close(lse, rl, 2e-4, 2e-4)


@pytest.mark.parametrize("feature", [
    dict(causal=True, window_left=3), dict(causal=True, logits_soft_cap=2.0), dict(pos_encoding_mode="ALIBI"),
    dict(causal=True, pos_encoding_mode="ROPE_LLAMA"), dict(causal=True, sm_scale=0.07),
])
def test_single_prefill_features(rng, feature):
    q = rng.standard_normal((6, 4, 16)).astype(np.float32)
    k = rng.standard_normal((14, 2, 16)).astype(np.float32)
    v = rng.standard_normal((14, 2, 16)).astype(np.float32)
    o, lse = kvattn.single_prefill_with_kv_cache_return_lse(q, k, v, **feature)
    kw = dict(feature)
    if "pos_encoding_mode" in kw:
        kw["pos_encoding"] = kw.pop("pos_encoding_mode")
    ro, rl = attention(q, k, v, **kw)
    assert_close(o, ro, 2e-4, 2e-4)
    assert_close(lse, rl, 2e-4, 2e-4)


def test_single_prefill_custom_mask_and_packed(rng):
    qo, kv = 5, 11
    q = rng.standard_normal((qo, 4, 16)).astype(np.float32)
    k = rng.standard_normal((kv, 2, 16)).astype(np.float32)
    v = rng.standard_normal((kv, 2, 16)).astype(np.float32)
    mask = rng.random((qo, kv)) < 0.5
    mask[2] = False  # a fully masked row: o = 0, lse = -inf
    o1, l1 = kvattn.single_prefill_with_kv_cache(q, k, v, custom_mask=mask, causal=True, return_lse=True)
    packed = kvattn.packbits(mask.reshape(-1), bitorder="little")
    o2 = kvattn.single_prefill_with_kv_cache(q, k, v, packed_custom_mask=packed)
    ro, rl = attention(q, k, v, mask=mask)
    assert_close(o1, ro, 2e-4, 2e-4)
    assert_close(l1, rl, 2e-4, 2e-4)
    np.testing.assert_array_equal(o1, o2)
    assert np.all(o1[2] == 0) and np.all(np.isneginf(l1[2]))


def test_single_prefill_o_dtype_and_fp16(rng):
    q = rng.standard_normal((4, 2, 64)).astype(np.float16)
    k = rng.standard_normal((20, 2, 64)).astype(np.float16)
    v = rng.standard_normal((20, 2, 64)).astype(np.float16)
    o = kvattn.single_prefill_with_kv_cache(q, k, v, causal=True, o_dtype="float32")
    assert o.dtype == np.float32
    ro, _ = attention(q, k, v, causal=True)
    assert_close(o, ro, 1e-3, 1e-3)


def test_single_prefill_unsupported_arguments(rng):
    q = np.zeros((2, 2, 16), np.float32)
    k = np.zeros((3, 2, 16), np.float32)
    with pytest.raises(NotImplementedError, match="use_fp16_qk_reduction"):
        kvattn.single_prefill_with_kv_cache(q, k, k, use_fp16_qk_reduction=True)
    with pytest.raises(NotImplementedError, match="backend"):
        kvattn.single_prefill_with_kv_cache(q, k, k, backend="fa3")
    with pytest.raises(NotImplementedError, match="scale_q"):
        kvattn.single_prefill_with_kv_cache(q, k, k, scale_q=np.ones(2, np.float32))
