"""torch.library registration of kvattn's device calls as custom ops (with fake implementations), so that
torch.compile traces them as opaque ops that mutate their out/lse arguments.

Nothing here imports torch at module import; :func:`ensure_registered` is called the first time a torch
tensor reaches kvattn. Eager calls bypass the dispatcher (lower overhead); while torch.compile traces, the
wrappers call the ops through ``torch.ops.kvattn.*``.
"""

import sys
import threading
from typing import List, Optional

_lock = threading.Lock()
_registered = False
_impls = {}


_TORCH_MOD = None
_IS_COMPILING = None


def _torch():
    global _TORCH_MOD
    if _TORCH_MOD is None:
        _TORCH_MOD = sys.modules.get("torch")
    return _TORCH_MOD


def _find_is_compiling():
    t = _torch()
    comp = getattr(t, "compiler", None)
    f = getattr(comp, "is_compiling", None) if comp is not None else None
    if f is None:  # pragma: no cover - old torch
        dyn = getattr(t, "_dynamo", None)
        f = getattr(dyn, "is_compiling", None) if dyn is not None else None
    return f


def is_compiling() -> bool:
    """True while torch.compile (dynamo) traces the caller."""
    global _IS_COMPILING
    f = _IS_COMPILING
    if f is None:
        if _torch() is None:
            return False
        f = _IS_COMPILING = _find_is_compiling() or (lambda: False)
    return bool(f())


def ops():
    return _torch().ops.kvattn


def ensure_registered() -> None:
    global _registered
    if _registered:
        return
    with _lock:
        if _registered:
            return
        is_compiling()  # resolve torch.compiler.is_compiling eagerly
        _register()
        _registered = True


def _register() -> None:
    import torch
    from torch import Tensor

    from . import _core, _single, cascade, page

    def run_impl(handle: int, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Optional[Tensor],
                 k_scale: float, v_scale: float) -> None:
        _core.run_impl(handle, q, k, v, out, lse, k_scale, v_scale)

    def run_fake(handle, q, k, v, out, lse, k_scale, v_scale):
        return None

    def single_impl(q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Optional[Tensor], mask: Optional[Tensor],
                    iparams: List[int], fparams: List[float]) -> None:
        _single.single_impl(q, k, v, out, lse, mask, iparams, fparams)

    def single_fake(q, k, v, out, lse, mask, iparams, fparams):
        return None

    def merge_state_impl(v_a: Tensor, s_a: Tensor, v_b: Tensor, s_b: Tensor, v_out: Tensor,
                         s_out: Tensor) -> None:
        cascade._merge_state_impl(v_a, s_a, v_b, s_b, v_out, s_out)

    def merge_state_fake(v_a, s_a, v_b, s_b, v_out, s_out):
        return None

    def merge_state_in_place_impl(v: Tensor, s: Tensor, v_other: Tensor, s_other: Tensor,
                                  mask: Optional[Tensor]) -> None:
        cascade._merge_state_in_place_impl(v, s, v_other, s_other, mask)

    def merge_state_in_place_fake(v, s, v_other, s_other, mask):
        return None

    def merge_states_impl(v: Tensor, s: Tensor, v_out: Tensor, s_out: Tensor) -> None:
        cascade._merge_states_impl(v, s, v_out, s_out)

    def merge_states_fake(v, s, v_out, s_out):
        return None

    def append_impl(append_key: Tensor, append_value: Tensor, batch_indices: Tensor, positions: Tensor,
                    cache: Tensor, v_cache: Optional[Tensor], kv_indices: Tensor, kv_indptr: Tensor,
                    kv_last_page_len: Tensor, layout: int) -> None:
        page._append_impl(append_key, append_value, batch_indices, positions, cache, v_cache, kv_indices,
                          kv_indptr, kv_last_page_len, layout)

    def append_fake(append_key, append_value, batch_indices, positions, cache, v_cache, kv_indices, kv_indptr,
                    kv_last_page_len, layout):
        return None

    def append_slot_impl(append_key: Tensor, append_value: Tensor, slots: Tensor, cache: Tensor,
                         v_cache: Optional[Tensor], layout: int) -> None:
        page._append_slot_impl(append_key, append_value, slots, cache, v_cache, layout)

    def append_slot_fake(append_key, append_value, slots, cache, v_cache, layout):
        return None

    specs = [
        ("run", run_impl, run_fake, ("out", "lse"),
         "(int handle, Tensor q, Tensor k, Tensor v, Tensor(a!) out, Tensor(b!)? lse, float k_scale, "
         "float v_scale) -> ()"),
        ("single", single_impl, single_fake, ("out", "lse"),
         "(Tensor q, Tensor k, Tensor v, Tensor(a!) out, Tensor(b!)? lse, Tensor? mask, int[] iparams, "
         "float[] fparams) -> ()"),
        ("merge_state", merge_state_impl, merge_state_fake, ("v_out", "s_out"),
         "(Tensor v_a, Tensor s_a, Tensor v_b, Tensor s_b, Tensor(a!) v_out, Tensor(b!) s_out) -> ()"),
        ("merge_state_in_place", merge_state_in_place_impl, merge_state_in_place_fake, ("v", "s"),
         "(Tensor(a!) v, Tensor(b!) s, Tensor v_other, Tensor s_other, Tensor? mask) -> ()"),
        ("merge_states", merge_states_impl, merge_states_fake, ("v_out", "s_out"),
         "(Tensor v, Tensor s, Tensor(a!) v_out, Tensor(b!) s_out) -> ()"),
        ("append_paged_kv_cache", append_impl, append_fake, ("cache", "v_cache"),
         "(Tensor append_key, Tensor append_value, Tensor batch_indices, Tensor positions, Tensor(a!) cache, "
         "Tensor(b!)? v_cache, Tensor kv_indices, Tensor kv_indptr, Tensor kv_last_page_len, int layout) -> ()"),
        ("append_paged_kv_cache_by_slot", append_slot_impl, append_slot_fake, ("cache", "v_cache"),
         "(Tensor append_key, Tensor append_value, Tensor slots, Tensor(a!) cache, Tensor(b!)? v_cache, "
         "int layout) -> ()"),
    ]

    custom_op = getattr(torch.library, "custom_op", None)
    if custom_op is not None:
        for name, impl, fake, mutates, _schema in specs:
            op = custom_op("kvattn::" + name, impl, mutates_args=mutates, schema=_schema)
            op.register_fake(fake)
            _impls[name] = op
        return
    # torch < 2.4: define the schema by hand.
    lib = torch.library.Library("kvattn", "DEF")  # pragma: no cover
    _impls["_lib"] = lib
    for name, impl, fake, _mutates, schema in specs:
        lib.define(name + schema)
        for key in ("CPU", "CUDA"):
            lib.impl(name, impl, key)
        torch.library.impl_abstract("kvattn::" + name, lib=lib)(fake)
