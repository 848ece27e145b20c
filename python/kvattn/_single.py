"""Single-request attention (single_decode_with_kv_cache / single_prefill_with_kv_cache) over the C library's
kva_single_decode / kva_single_prefill."""

from __future__ import annotations

import ctypes
import math
from typing import Any, List, Optional

import numpy as np

from . import _context as C
from . import _core
from . import _ffi as F
from . import _tensor as T
from . import _torch_ops
from . import variant as V
from .exceptions import InvalidArgumentError, UnsupportedError
from .quantization import packbits


def _transpose01(x: Any) -> Any:
    return x.transpose(0, 1) if T.is_torch(x) else x.transpose(1, 0, 2)


def single_impl(q: Any, k: Any, v: Any, out: Any, lse: Any, mask: Any, iparams: List[int],
                fparams: List[float], variant: Optional[V.Variant] = None,
                vparams: Optional[V.RunParams] = None) -> None:
    """Body of the kvattn::single custom op. k, v: [kv_len, Hkv, D] views. iparams = [decode, mask_mode,
    window_left, pos_encoding]; fparams = [logits_soft_cap, sm_scale, rope_scale, rope_theta, k_scale, v_scale].
    variant / vparams: a user variant and its checked run-time parameters (eager calls only)."""
    decode, mask_mode, window_left, pos = (int(x) for x in iparams)
    cap, sm, rope_scale, rope_theta, ks, vs = (float(x) for x in fparams)
    dev = T.device_of(q)
    q_dtype = T.dtype_of(q, "q")
    kv_dtype = T.dtype_of(k, "k")
    o_dtype = T.dtype_of(out, "out")
    hq = int(q.shape[-2])
    hkv = int(k.shape[1])
    desc = _core.make_desc(hq, hkv, int(q.shape[-1]), int(v.shape[2]), q_dtype, kv_dtype, o_dtype, mask_mode,
                           window_left, cap, sm, _core._POS_BY_CODE[pos], rope_scale, rope_theta,
                           variant.handle(dev) if variant is not None else 0)
    lib = F.lib()
    ctx = C.get_context(dev)
    args = F.kva_run_args()
    lib.kva_run_args_init(ctypes.byref(args))
    T.fill_tensor(args.q, q, "q")
    T.fill_tensor(args.o, out, "out", out=True)
    if lse is not None:
        T.fill_tensor(args.lse, lse, "lse", out=True)
    T.fill_tensor(args.k, k, "k")
    T.fill_tensor(args.v, v, "v")
    if mask is not None:
        args.custom_mask = T.data_ptr(mask) or None
        args.custom_mask_bytes = T.nbytes_of(mask)
    args.k_scale = ks
    args.v_scale = vs
    args.stream = C.current_stream(dev)
    if vparams is not None:
        vparams.apply(args)
    ws_p = None
    if dev[0] != "cpu":
        qo_len = 1 if decode else int(q.shape[0])
        db, hb = ctypes.c_size_t(0), ctypes.c_size_t(0)
        F.check(lib.kva_single_workspace_size(ctx, ctypes.byref(desc), qo_len, int(k.shape[0]), ctypes.byref(db),
                                              ctypes.byref(hb)), "kva_single_workspace_size")
        ws = C.single_workspaces.get(dev, int(db.value), int(hb.value))
        ws_p = ctypes.byref(ws)
    fn = lib.kva_single_decode if decode else lib.kva_single_prefill
    F.check(fn(ctx, ctypes.byref(desc), ctypes.byref(args), ws_p),
            "single_decode_with_kv_cache" if decode else "single_prefill_with_kv_cache")


def single_attention(q: Any, k: Any, v: Any, *, decode: bool, kv_layout: str, pos_encoding_mode: Any,
                     q_scale: Any, k_scale: Any, v_scale: Any, window_left: Any, logits_soft_cap: Any,
                     sm_scale: Any, rope_scale: Any, rope_theta: Any, return_lse: bool, causal: bool = False,
                     custom_mask: Any = None, packed_custom_mask: Any = None, o_dtype: Any = None,
                     variant: Any = None, variant_scalars: Any = None, variant_tensors: Any = None) -> Any:
    layout = _core.parse_layout(kv_layout)
    for name, x in (("q", q), ("k", k), ("v", v)):
        if not (T.is_torch(x) or isinstance(x, np.ndarray)):
            raise TypeError("kvattn: %s must be a NumPy array or a torch tensor, got %s" % (name, type(x).__name__))
    dev = T.device_of(q)
    for name, x in (("k", k), ("v", v)):
        if T.device_of(x) != dev:
            raise ValueError("kvattn: q is on %s but %s is on %s" % (T.device_str(dev), name,
                                                                      T.device_str(T.device_of(x))))
    if T.is_torch(q):
        _torch_ops.ensure_registered()
    want_q = 2 if decode else 3
    if q.ndim != want_q:
        raise ValueError("kvattn: q must be %s, got shape %s" % (
            "[num_qo_heads, head_dim]" if decode else "[qo_len, num_qo_heads, head_dim]", tuple(q.shape)))
    if k.ndim != 3 or v.ndim != 3:
        raise ValueError("kvattn: k and v must be 3-D (%s), got %s and %s" % (
            "[kv_len, num_kv_heads, head_dim]" if layout == "NHD" else "[num_kv_heads, kv_len, head_dim]",
            tuple(k.shape), tuple(v.shape)))
    if layout == "HND":
        k, v = _transpose01(k), _transpose01(v)
    kv_dtype = T.dtype_of(k, "k")
    if T.dtype_of(v, "v") != kv_dtype:
        raise TypeError("kvattn: k and v must have the same dtype")
    q_dtype = T.dtype_of(q, "q")
    o_code = q_dtype if o_dtype is None else T.parse_dtype(o_dtype, "o_dtype")
    if q_dtype not in T.FLOAT_DTYPES:
        raise NotImplementedError("kvattn: q dtype %s is not supported (float32, float16, bfloat16)"
                                  % T.dtype_name(q_dtype))
    head_dim = int(q.shape[-1])
    if head_dim < 1:
        raise ValueError("kvattn: q has head_dim %d (its last dimension must be >= 1)" % head_dim)
    qs = 1.0 if q_scale is None else float(q_scale)
    ks = 1.0 if k_scale is None else float(k_scale)
    vs = 1.0 if v_scale is None else float(v_scale)
    sm = (1.0 / math.sqrt(head_dim) if sm_scale is None else float(sm_scale)) * qs * ks
    sm = _core.f32(sm)  # the precision the C descriptor stores: a product that rounds to 0 would read as "default"
    if not math.isfinite(sm) or sm <= 0:
        raise ValueError("kvattn: sm_scale (times q_scale and k_scale, as float32) = %r must be positive and finite" % sm)

    what = "single_decode_with_kv_cache" if decode else "single_prefill_with_kv_cache"
    var = V.check_variant(variant)
    vparams = None
    if var is None:
        if variant_scalars is not None or variant_tensors is not None:
            raise InvalidArgumentError("kvattn: %s got variant_scalars / variant_tensors without variant="
                                             % what)
    else:
        if T.is_torch(q) and _torch_ops.is_compiling():
            raise UnsupportedError("kvattn: %s with a user variant cannot be traced by torch.compile (its "
                                   "parameters do not go through the custom op); call it outside the compiled "
                                   "region or use a batch wrapper with the parameters given at plan()" % what)
        if return_lse and not var.use_softmax:
            raise InvalidArgumentError("kvattn: %s: lse is not defined for variant %r (use_softmax=False); "
                                             "call it with return_lse=False" % (what, var.name))
        vparams = V.run_params(var, V.check_scalars(var, variant_scalars, what),
                               V.check_tensors(var, variant_tensors, dev, what))

    mask = None
    mask_mode = F.KVA_MASK_CAUSAL if causal else F.KVA_MASK_NONE
    if packed_custom_mask is not None or custom_mask is not None:
        mask_mode = F.KVA_MASK_CUSTOM
        qo_len = 1 if decode else int(q.shape[0])
        kv_len = int(k.shape[0])
        if packed_custom_mask is not None:
            mask = packed_custom_mask
            if T.is_bool(mask) or T.dtype_of(mask, "packed_custom_mask") != F.KVA_DTYPE_U8 or mask.ndim != 1:
                raise TypeError("kvattn: packed_custom_mask must be a 1-D uint8 array of packed bits (a bool mask "
                                "goes to custom_mask)")
        else:
            custom_mask = T.check_bool_mask(custom_mask, "custom_mask")
            if tuple(int(s) for s in custom_mask.shape) not in ((qo_len, kv_len), (qo_len * kv_len,)):
                raise ValueError("kvattn: custom_mask must have shape [qo_len, kv_len] = [%d, %d], got %s"
                                 % (qo_len, kv_len, tuple(custom_mask.shape)))
            mask = packbits(custom_mask, bitorder="little")
        if T.device_of(mask) != dev:
            raise ValueError("kvattn: the custom mask must be on the same device as q")
        if not T.is_contiguous(mask):
            mask = mask.contiguous() if T.is_torch(mask) else np.ascontiguousarray(mask)

    hq = int(q.shape[-2])
    dvo = int(v.shape[2])
    if decode:
        out = T.empty(q, (hq, dvo), o_code)
        lse = T.empty(q, (hq,), F.KVA_DTYPE_F32) if return_lse else None
    else:
        out = T.empty(q, (int(q.shape[0]), hq, dvo), o_code)
        lse = T.empty(q, (int(q.shape[0]), hq), F.KVA_DTYPE_F32) if return_lse else None
    iparams = [1 if decode else 0, mask_mode, _core.norm_window(window_left),
               _core.POS_ENCODING_MODES[_core.parse_pos_encoding(pos_encoding_mode)]]
    fparams = [_core.norm_cap(logits_soft_cap), sm, 1.0 if rope_scale is None else float(rope_scale),
               1e4 if rope_theta is None else float(rope_theta), 1.0, vs]
    if T.is_torch(q) and _torch_ops.is_compiling():
        _torch_ops.ops().single(q, k, v, out, lse, mask, iparams, fparams)
    else:
        single_impl(q, k, v, out, lse, mask, iparams, fparams, var, vparams)
    return (out, lse) if return_lse else out
