"""Seeded randomized differential test of the Python API (CPU backend, NumPy arrays) against the float64 reference.

Every case draws, from its own seed: the op (BatchDecodeWithPagedKVCacheWrapper, BatchPrefillWithPagedKVCacheWrapper,
BatchPrefillWithRaggedKVCacheWrapper, MultiLevelCascadeAttentionWrapper with 2-3 levels,
single_decode_with_kv_cache, single_prefill_with_kv_cache), batch and lengths (empty requests included), the page
size and a shuffled page table in a pool larger than needed, layout, heads, head dims, dtypes and the optional
features (causal, window_left, logits_soft_cap, sm_scale, RoPE / ALiBi, custom / packed masks, return_lse, out= /
lse= buffers, the KV cache as one 5-D array or a (k, v) tuple, split-KV options), then runs the op (a batch plan
twice, with a new q) and compares o and lse element-wise with reference.attention (reference.merge for cascade
levels) at reference.TOL of the loosest dtype involved. Rows that see no key must give o = 0 and lse = -inf exactly;
out= / lse= buffers are poisoned with NaN (and, as views, surrounded by a guard band that must stay untouched).
Some cases also plan the same wrapper again for a second batch, plan a companion wrapper into the same float
workspace between a plan and its runs (as engines share one buffer), use decode's use_cuda_graph=True buffers, the
deprecated forward() entry points, padded / strided pools and queries, and page tables that share pages.

A combination that an API documents as unsupported (or cannot express) is re-drawn, and the reason printed; the
drawing never produces anything else the docs call unsupported, so an UnsupportedError / NotImplementedError at run
time fails the case.

torch groups (skipped without torch; importing this module never imports torch):
  test_fuzz_api_torch_cpu   the same cases (same seeds, draws and checks; default 30) with torch CPU tensors
  test_fuzz_api_torch_cuda  cases drawn within the CUDA backend's constraints (draw_cuda_case; default 60: head dims
                            64/128/256, q f16/bf16, KV also fp8 with k_scale/v_scale, o also f32, lengths to 2048),
                            torch CUDA tensors, run 0 / run 1 with enable_pdl on / off, against the float64 reference
                            of the rounded inputs (skipped unless torch.cuda.is_available())
  test_fuzz_api_torch_cuda_graph  a use_cuda_graph=True decode wrapper captured, re-planned and replayed (default 2)
The env vars below select the cases of every group (-k torch_cpu / torch_cuda picks a group).

Replay:
    KVATTN_FUZZ_SEED=<base seed> KVATTN_FUZZ_CASES=<n> pytest python/tests/test_fuzz_api.py   # cases 0 .. n-1
    KVATTN_FUZZ_CASE_SEED=<case seed> pytest python/tests/test_fuzz_api.py                     # one case
Each case prints its index, seed and every drawn parameter (shown with a failure). Without a library,
``python3 python/tests/test_fuzz_api.py`` prints the drawn cases and a coverage summary.
"""

import os
import sys

import numpy as np
import pytest

try:
    import ml_dtypes  # noqa: F401  (NumPy bfloat16; optional)
    BF16 = ml_dtypes.bfloat16
except ImportError:  # pragma: no cover
    BF16 = None

from conftest import workspace
from reference import TOL, assert_close, attention, gather_kv, merge

# base seed 4: its 60 cases draw every op, page size, head dim, group size, output mode, mask kind, split option and
# the re-plan / shared-workspace / graph-mode / head_dim_vo variants at least once (python3 test_fuzz_api.py)
DEFAULT_BASE_SEED = 4
DEFAULT_NUM_CASES = 60
BASE_SEED = int(os.environ.get("KVATTN_FUZZ_SEED", DEFAULT_BASE_SEED))
NUM_CASES = int(os.environ.get("KVATTN_FUZZ_CASES", DEFAULT_NUM_CASES))
ONE_CASE_SEED = os.environ.get("KVATTN_FUZZ_CASE_SEED")

OPS = ["decode", "prefill_paged", "prefill_ragged", "cascade", "single_decode", "single_prefill"]
BATCH_OPS = ("decode", "prefill_paged", "prefill_ragged")
PAGED_OPS = ("decode", "prefill_paged", "cascade")
PAGE_SIZES = [1, 2, 3, 5, 8, 16, 17, 32]
HEAD_DIMS = [16, 32, 64, 128]
DTYPES = ["float32", "float16"] + (["bfloat16"] if BF16 is not None else [])
OUT_MODES = ["alloc", "alloc_lse", "run_return_lse", "out", "out_lse", "out_lse_noret", "forward",
             "forward_return_lse"]
# reference MACs (sum over requests of Hq * qo * kv * (Dqk + Dvo)) one run may cost: keeps a case below ~0.5 s
COST_BUDGET = 2e8


def case_seed(index, base=None):
    """Case index -> its seed. The op is seed % 6 (see draw_case), and case i's seed is chosen = i (mod 6), so
    consecutive cases rotate through the six ops while one seed alone still replays a case."""
    s = int(np.random.SeedSequence([BASE_SEED if base is None else base, index]).generate_state(1)[0])
    return (s // len(OPS)) * len(OPS) + index % len(OPS)


def _cases():
    if ONE_CASE_SEED is not None:
        return [(0, int(ONE_CASE_SEED))]
    return [(i, case_seed(i)) for i in range(NUM_CASES)]


CASES = _cases()


def np_dtype(name):
    return {"float32": np.float32, "float16": np.float16, "bfloat16": BF16}[name]


def f32(x):
    """x as a float32-exact Python float (the C descriptor stores float32: no ambiguity in the reference)."""
    return float(np.float32(x))


# ---------------------------------------------------------------------------------------------------------------
# Array front end of the runners below: NumPy arrays (test_fuzz_api) or torch CPU tensors (test_fuzz_api_torch_cpu).
# The runners draw and check NumPy arrays; IO converts what they pass to the API and what comes back. The NumPy
# front end is the identity, so the NumPy cases are exactly what they were.

class NumpyIO:
    name = "numpy"

    def t(self, x):  # a NumPy array as passed to the API
        return x

    def idx(self, x):  # an int32 index array (indptr, indices, last_page_len) as passed to plan()
        return x

    def np(self, x):  # an API result as a NumPy array of its dtype
        return x

    def ws(self, nbytes):
        return workspace(nbytes)

    def dtype(self, name):  # the dtype a result of dtype `name` has
        return np.dtype(np_dtype(name))

    def api_dtype(self, name):  # a dtype argument given as a dtype object rather than a string
        return np.dtype(np_dtype(name))


class TorchCpuIO(NumpyIO):
    """torch CPU tensors sharing the NumPy arrays' memory (torch.from_numpy keeps strides, so padded pools, strided
    queries, transposed HND views and out= views inside a guard band stay what they are). idx_torch: plan()'s
    index arrays as torch tensors too (else NumPy arrays, which torch wrappers also take)."""
    name = "torch_cpu"

    def __init__(self, torch, idx_torch):
        self.torch = torch
        self.idx_torch = idx_torch
        self.tdt = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}

    def t(self, x):
        assert isinstance(x, np.ndarray)
        if BF16 is not None and x.dtype == np.dtype(BF16):
            return self.torch.from_numpy(x.view(np.int16)).view(self.torch.bfloat16)
        return self.torch.from_numpy(x)

    def idx(self, x):
        return self.torch.from_numpy(x) if self.idx_torch else x

    def np(self, x):
        assert isinstance(x, self.torch.Tensor) and x.device.type == "cpu", (type(x), getattr(x, "device", None))
        if x.dtype == self.torch.bfloat16:
            return x.view(self.torch.int16).numpy().view(BF16)
        return x.numpy()

    def ws(self, nbytes):
        return self.torch.zeros(nbytes, dtype=self.torch.uint8)

    def dtype(self, name):
        return self.tdt[name]

    def api_dtype(self, name):
        return self.tdt[name]


IO = NumpyIO()  # the front end of the case being run (set by the test functions)


# ---------------------------------------------------------------------------------------------------------------
# Drawing

def _draw_kv_len(rng):
    r = rng.random()
    if r < 0.12:
        return 0
    if r < 0.45:
        return int(rng.integers(1, 33))
    return int(rng.integers(33, 301))


def _draw_qo_len(rng, allow_zero=True):
    r = rng.random()
    if r < 0.1 and allow_zero:
        return 0
    if r < 0.3:
        return 1
    if r < 0.75:
        return int(rng.integers(2, 17))
    if r < 0.93:
        return int(rng.integers(17, 49))
    return int(rng.integers(49, 129))


def _pick(rng, seq, p=None):
    return seq[int(rng.choice(len(seq), p=p))]


def _draw_features(rng, op):
    """Everything but the op: shapes, dtypes, features, API forms (op-independent; unsupported(c) filters)."""
    c = {"op": op}
    c["num_kv_heads"] = int(rng.integers(1, 5))
    c["group"] = int(rng.integers(1, 9))
    c["num_qo_heads"] = c["num_kv_heads"] * c["group"]
    c["head_dim_qk"] = _pick(rng, HEAD_DIMS)
    c["head_dim_vo"] = _pick(rng, HEAD_DIMS) if rng.random() < 0.3 else c["head_dim_qk"]
    c["kv_layout"] = _pick(rng, ["NHD", "HND"])
    c["layout_as_enum"] = bool(rng.random() < 0.15)
    main = _pick(rng, DTYPES, p=[0.5, 0.4, 0.1] if len(DTYPES) == 3 else [0.55, 0.45])
    c["q_dtype"] = main
    c["kv_dtype"] = main if rng.random() < 0.75 else _pick(rng, DTYPES)
    c["o_dtype"] = main if rng.random() < 0.75 else _pick(rng, DTYPES)
    c["dtype_as_numpy"] = bool(rng.random() < 0.3)
    c["page_size"] = _pick(rng, PAGE_SIZES)
    c["extra_pages"] = int(rng.integers(1, 9))
    c["junk_indices"] = int(rng.integers(0, 4)) if rng.random() < 0.3 else 0  # entries past indptr[-1]
    c["junk_out_of_range"] = bool(c["junk_indices"] and rng.random() < 0.3)
    c["batch_size"] = int(rng.integers(1, 7))
    B = c["batch_size"] if op not in ("single_decode", "single_prefill") else 1
    c["kv_lens"] = [_draw_kv_len(rng) for _ in range(B)]
    c["qo_lens"] = [_draw_qo_len(rng, allow_zero=op != "single_prefill") for _ in range(B)]
    c["q_len_per_req"] = 1 if rng.random() < 0.8 else int(rng.integers(2, 5))
    if c["q_len_per_req"] > 1 and op == "decode":  # a request holds its verified tokens (plan refuses 0 < kv < ql)
        c["kv_lens"] = [n if n == 0 else max(n, c["q_len_per_req"]) for n in c["kv_lens"]]
    if op == "cascade":
        c["num_levels"] = int(rng.integers(2, 4))
        bounds, kvs = [], []
        for lvl in range(c["num_levels"] - 1):
            p_cut = 0.15 if lvl == 0 else 0.5
            cuts = [i for i in range(1, B) if rng.random() < p_cut]
            bnd = [0] + cuts + [B]
            bounds.append(bnd)
            kvs.append([_draw_kv_len(rng) for _ in range(len(bnd) - 1)])
        bounds.append(list(range(B + 1)))
        kvs.append(c["kv_lens"])
        c["cascade_bounds"] = bounds  # level l: group g holds last-level requests bounds[l][g] .. bounds[l][g+1]
        c["cascade_kv_lens"] = kvs
    c["causal"] = bool(rng.random() < 0.6)
    c["pos_encoding_mode"] = _pick(rng, ["NONE", "ROPE_LLAMA", "ALIBI"], p=[0.5, 0.25, 0.25])
    c["pos_as_enum"] = bool(rng.random() < 0.2)
    c["rope_scale"] = None if rng.random() < 0.5 else f32(rng.uniform(0.25, 8.0))
    c["rope_theta"] = None if rng.random() < 0.4 else _pick(
        rng, [1e4, 5e5, 1e6, f32(10 ** rng.uniform(2, 6))])
    r = rng.random()
    c["window_left"] = -1 if r < 0.6 else int(rng.integers(0, 9)) if r < 0.8 else int(rng.integers(0, 320))
    c["logits_soft_cap"] = None if rng.random() < 0.65 else f32(rng.uniform(0.5, 30.0))
    c["sm_scale"] = None if rng.random() < 0.6 else f32(rng.uniform(0.02, 0.3))
    c["q_mag"] = _pick(rng, [0.5, 1.0, 1.0, 2.0, 3.0, 8.0, 20.0])  # 8, 20: peaked softmax, large |lse|
    c["mask"] = _pick(rng, ["none", "custom", "packed"], p=[0.6, 0.2, 0.2])
    r = rng.random()
    c["mask_density"] = 0.0 if r < 0.05 else 1.0 if r < 0.1 else float(rng.uniform(0.05, 0.95))
    c["mask_2d"] = bool(rng.random() < 0.5)  # single prefill: [qo, kv] rather than flat
    # a [P, 2, ...] cache (or its halves as a tuple) needs one head dim; separate K and V pools take any two
    forms = ["5d", "5d_padded", "tuple_views", "tuple", "tuple_padded"] if c["head_dim_vo"] == c["head_dim_qk"] \
        else ["tuple", "tuple_padded"]
    c["kv_form"] = _pick(rng, forms)
    c["kv_form_run2"] = c["kv_form"] if rng.random() < 0.7 else _pick(rng, forms)
    c["kv_strided_view"] = bool(rng.random() < 0.3)  # single / ragged: HND given as a transposed view
    c["new_kv_run2"] = bool(rng.random() < 0.5)
    c["grow_pool_run2"] = int(rng.integers(1, 6)) if rng.random() < 0.2 else 0
    c["strided_q"] = bool(rng.random() < 0.2)
    c["out_modes"] = [_pick(rng, OUT_MODES), _pick(rng, OUT_MODES)]
    c["out_guard"] = bool(rng.random() < 0.3)  # out= / lse= as strided views inside a guard band
    c["shared_pages"] = bool(rng.random() < 0.2)  # page-table entries repeated (prefix caching shares pages)
    c["return_lse_single"] = bool(rng.random() < 0.7)
    c["echo_scalars_at_run"] = bool(rng.random() < 0.2)
    c["use_tensor_cores"] = bool(rng.random() < 0.3)
    c["replan"] = bool(op in BATCH_OPS + ("cascade",) and rng.random() < 0.35)
    c["graph"] = bool(op == "decode" and rng.random() < 0.2)  # use_cuda_graph=True (fixed buffers) on the CPU
    c["graph_subclass"] = bool(rng.random() < 0.5)  # CUDAGraphBatchDecodeWithPagedKVCacheWrapper
    c["pass_head_dim_vo"] = bool(rng.random() < 0.5)
    c["pass_o_dtype"] = bool(rng.random() < 0.5)
    r = rng.random()
    if r < 0.6 or op not in BATCH_OPS:
        c["split"] = None
    elif r < 0.8:
        toks = int(rng.integers(16, 257))
        c["split"] = ("fixed", toks if op == "prefill_ragged" else max(1, -(-toks // c["page_size"])))
    else:
        c["split"] = ("disable",)
    c["workspace"] = "exact" if (c["split"] and c["split"][0] == "fixed") or rng.random() < 0.3 else "default"
    # another wrapper plans into the same float workspace between this plan and its runs (not with an exact-size
    # workspace, which the wrapper replaces)
    c["companion"] = bool(op in BATCH_OPS + ("cascade",) and c["workspace"] == "default" and rng.random() < 0.25)
    return c


def unsupported(c):
    """Why the API cannot run c (documented as unsupported, or not expressible), or None."""
    op = c["op"]
    same_d = c["head_dim_vo"] == c["head_dim_qk"]
    if op in ("decode", "single_decode", "cascade") and c["mask"] != "none":
        return {"decode": "BatchDecodeWithPagedKVCacheWrapper takes no custom mask (decode + custom mask is "
                          "KVA_ERR_UNSUPPORTED in the C library)",
                "single_decode": "single_decode_with_kv_cache has no custom_mask argument",
                "cascade": "MultiLevelCascadeAttentionWrapper.plan has no custom_mask argument"}[op]
    if op in ("decode", "single_decode", "cascade") and not same_d:
        return "%s has one head_dim (head_dim_vo != head_dim_qk is prefill only)" % op
    if op in ("single_decode", "cascade") and c["o_dtype"] != c["q_dtype"]:
        return "%s has no output dtype argument (o = q's dtype)" % op
    if c.get("graph") and c["split"] and c["split"][0] == "fixed":
        return "graph mode with fixed_split_size is KVA_ERR_UNSUPPORTED (its partial count depends on KV lengths)"
    if op in PAGED_OPS and not same_d and any(f.startswith("5d") or f == "tuple_views"
                                              for f in (c["kv_form"], c["kv_form_run2"])):
        return "a [P, 2, ...] cache (or its halves) needs head_dim_vo == head_dim_qk"
    return None


def request_cost(c):
    d = c["head_dim_qk"] + c["head_dim_vo"]
    hq = c["num_qo_heads"]
    op = c["op"]
    if op == "decode":
        return sum(hq * c["q_len_per_req"] * n * d for n in c["kv_lens"])
    if op == "single_decode":
        return hq * c["kv_lens"][0] * d
    if op == "cascade":
        qo_ind = np.concatenate([[0], np.cumsum(c["qo_lens"])])
        tot = 0
        for bnd, kvs in zip(c["cascade_bounds"], c["cascade_kv_lens"]):
            for g, n in enumerate(kvs):
                tot += hq * int(qo_ind[bnd[g + 1]] - qo_ind[bnd[g]]) * n * d
        return tot
    return sum(hq * q * n * d for q, n in zip(c["qo_lens"], c["kv_lens"]))


def _draw_supported(rng, op, log, like=None):
    """A supported draw for op (re-drawn while unsupported(c) says why not). like: the first plan of a wrapper
    that is planned again (the layout, tensor-core flag and cascade level count are the wrapper's)."""
    for attempt in range(200):
        c = _draw_features(rng, op)
        if like is not None:
            c["kv_layout"], c["layout_as_enum"] = like["kv_layout"], like["layout_as_enum"]
            c["use_tensor_cores"] = like["use_tensor_cores"]
            c["graph"], c["graph_subclass"] = like["graph"], like["graph_subclass"]
            c["replan"] = False
        why = unsupported(c)
        if why is None and like is not None and op == "cascade" and c["num_levels"] != like["num_levels"]:
            why = "the wrapper was made for %d levels" % like["num_levels"]
        if why is None and like is not None and c["graph"] and len(c["kv_lens"]) != len(like["kv_lens"]):
            why = "the CUDA-graph wrapper's batch size is fixed to %d" % len(like["kv_lens"])
        if why is None:
            break
        log("  re-draw %d: %s" % (attempt + 1, why))
    else:  # pragma: no cover
        raise AssertionError("no supported draw for op %s in 200 attempts" % op)
    _shrink(c, log)
    return c


def _shrink(c, log):
    # keep the float64 reference cheap: halve query lengths first, then KV lengths
    while request_cost(c) > COST_BUDGET:
        if c["op"] not in ("decode", "single_decode") and max(c["qo_lens"]) > 1:
            c["qo_lens"] = [max(q // 2, 1) if q > 0 else 0 for q in c["qo_lens"]]
        else:
            c["kv_lens"] = [n // 2 for n in c["kv_lens"]]
            if c["op"] == "cascade":
                c["cascade_kv_lens"] = [[n // 2 for n in kvs] for kvs in c["cascade_kv_lens"]]
                c["cascade_kv_lens"][-1] = c["kv_lens"]
        log("  shrunk lengths to stay within the reference budget")


def draw_case(seed, index=0, log=print):
    rng = np.random.default_rng(seed)
    c = _draw_supported(rng, OPS[seed % len(OPS)], log)
    c["index"], c["seed"] = index, seed
    return c, rng


def draw_companion(rng, c, log=print):
    """Another batch wrapper (any batch op) on the same float workspace buffer as c's."""
    op = _pick(rng, list(BATCH_OPS) + ["cascade"])
    for attempt in range(200):
        c3 = _draw_supported(rng, op, log)
        if not (c3["split"] and c3["split"][0] == "fixed"):
            break
        log("  re-draw %d: fixed_split_size needs an exact-size workspace (not a shared one)" % (attempt + 1))
    c3.update(index=c["index"], seed=c["seed"], ws_buffer=c["ws_buffer"], workspace="default", replan=False,
              companion=False)
    return c3


def draw_replan(rng, c, log=print):
    """A second, different batch for the same wrapper (plan() again after two runs of the first plan)."""
    c2 = _draw_supported(rng, c["op"], log, like=c)
    c2["index"], c2["seed"], c2["prev_workspace"] = c["index"], c["seed"], c["workspace"]
    c2["graph_buffers"] = c.get("graph_buffers")
    return c2


def describe(c):
    keys = ["op", "num_qo_heads", "num_kv_heads", "group", "head_dim_qk", "head_dim_vo", "kv_layout", "q_dtype",
            "kv_dtype", "o_dtype", "kv_lens"]
    op = c["op"]
    if op in ("prefill_paged", "prefill_ragged", "single_prefill", "cascade"):
        keys += ["qo_lens"]
    if op == "decode":
        keys += ["q_len_per_req", "use_tensor_cores", "graph", "graph_subclass"]
    if op == "cascade":
        keys += ["num_levels", "cascade_bounds", "cascade_kv_lens"]
    if op in PAGED_OPS:
        keys += ["page_size", "extra_pages", "shared_pages", "junk_indices", "junk_out_of_range", "kv_form",
                 "kv_form_run2", "grow_pool_run2"]
    if op in ("prefill_paged", "prefill_ragged", "single_prefill", "cascade"):
        keys += ["causal"]
    if op in ("prefill_paged", "prefill_ragged", "single_prefill"):
        keys += ["mask", "mask_density", "mask_2d", "pass_head_dim_vo", "pass_o_dtype"]
    keys += ["pos_encoding_mode", "rope_scale", "rope_theta", "window_left", "logits_soft_cap", "sm_scale", "q_mag",
             "strided_q", "layout_as_enum", "pos_as_enum", "dtype_as_numpy"]
    if op in BATCH_OPS or op == "cascade":
        keys += ["new_kv_run2", "replan", "companion"]
    if op in BATCH_OPS:
        keys += ["out_modes", "out_guard", "echo_scalars_at_run", "split", "workspace"]
    else:
        keys += ["return_lse_single"]
    if op in ("single_decode", "single_prefill", "prefill_ragged"):
        keys += ["kv_strided_view"]
    return ", ".join("%s=%r" % (k, c[k]) for k in keys)


# ---------------------------------------------------------------------------------------------------------------
# Inputs

def randn(rng, shape, dtype_name, mag=1.0):
    x = rng.standard_normal(shape, dtype=np.float32)
    if mag != 1.0:
        x *= np.float32(mag)
    return x.astype(np_dtype(dtype_name))


def make_q(rng, c, shape):
    q = randn(rng, shape, c["q_dtype"], c["q_mag"])
    if c["strided_q"]:  # a view of a wider buffer (unit last stride, padded rows)
        big = np.zeros(shape[:-1] + (shape[-1] + 24,), dtype=q.dtype)
        big[..., 3:3 + shape[-1]] = q
        q = big[..., 3:3 + shape[-1]]  # (NumPy calls it contiguous when only one row is left)
    return q


def page_tables(rng, c, lens_per_table):
    """One shuffled pool of P pages (more than needed) holding several page tables (cascade levels share it)."""
    ps = c["page_size"]
    pages = [[(n + ps - 1) // ps for n in lens] for lens in lens_per_table]
    P = int(sum(sum(p) for p in pages)) + c["extra_pages"]
    perm = rng.permutation(P).astype(np.int32)
    off, tables = 0, []
    for lens, pg in zip(lens_per_table, pages):
        indptr = np.concatenate([[0], np.cumsum(pg)]).astype(np.int32)
        n = int(indptr[-1])
        idx = perm[off:off + n].copy()
        off += n
        if c["shared_pages"] and off > 0:  # some entries point at pages other entries (or tables) use as well
            dup = rng.random(n) < 0.3
            idx[dup] = perm[rng.integers(0, off, int(dup.sum()))]
        if c["junk_indices"]:  # the array may be longer than indptr[-1]: those entries are never read
            hi = P + 1000 if c["junk_out_of_range"] else P
            lo = P if c["junk_out_of_range"] else 0
            idx = np.concatenate([idx, rng.integers(lo, hi, c["junk_indices"])]).astype(np.int32)
        # last_page_len only matters for requests that own a page (an empty request's entry is ignored)
        last = np.array([((x - 1) % ps) + 1 if x > 0 else int(rng.integers(0, ps + 1)) for x in lens], np.int32)
        tables.append((indptr, np.ascontiguousarray(idx), last))
    return P, tables


def make_pools(rng, c, P, form):
    """(argument for run, k pool 4-D, v pool 4-D) in the case's layout and KV dtype."""
    ps, H, dqk, dvo = c["page_size"], c["num_kv_heads"], c["head_dim_qk"], c["head_dim_vo"]

    def shape(d):
        return (P, ps, H, d) if c["kv_layout"] == "NHD" else (P, H, ps, d)

    pad = 8 if form.endswith("_padded") else 0  # head rows padded: pools with non-packed strides

    def pool(shp):
        return randn(rng, shp[:-1] + (shp[-1] + pad,), c["kv_dtype"])[..., :shp[-1]]

    if form.startswith("5d") or form == "tuple_views":
        assert dqk == dvo
        cache = pool((P, 2) + shape(dqk)[1:])
        k, v = cache[:, 0], cache[:, 1]
        ct = IO.t(cache)  # (torch modes: the halves are views of the converted 5-D tensor, as in the NumPy form)
        return (ct if form.startswith("5d") else (ct[:, 0], ct[:, 1])), k, v
    k = pool(shape(dqk))
    v = pool(shape(dvo))
    return (IO.t(k), IO.t(v)), k, v


def make_mask(rng, c, qo, kv):
    m = rng.random((qo, kv)) < c["mask_density"]
    if qo and kv and rng.random() < 0.3:
        m[int(rng.integers(0, qo))] = False  # a fully masked row
    return m


def packed_segments(masks):
    """FlashInfer's packed_custom_mask: each request's row-major bits packed little-endian into its own
    byte-aligned segment (written with NumPy, independently of kvattn.segment_packbits)."""
    segs = [np.packbits(m.reshape(-1).astype(np.uint8), bitorder="little") for m in masks]
    return np.concatenate(segs).astype(np.uint8) if segs else np.zeros(0, np.uint8)


# ---------------------------------------------------------------------------------------------------------------
# Reference and checks

# fp8 KV (CUDA group only): test_torch.test_decode_fp8_kv's tolerance, against the reference on the fp8 values
TOLS = dict(TOL, float8_e4m3fn=(2e-2, 2e-2), float8_e5m2=(2e-2, 2e-2))


def tolerance(c):
    names = {c["q_dtype"], c["kv_dtype"], c["o_dtype"]}
    return max(TOLS[n][0] for n in names), max(TOLS[n][1] for n in names)


def ref_kw(c, causal):
    kw = dict(causal=causal, window_left=c["window_left"], logits_soft_cap=c["logits_soft_cap"] or 0.0,
              pos_encoding=c["pos_encoding_mode"])
    for name in ("sm_scale", "rope_scale", "rope_theta"):
        if c[name] is not None:
            kw[name] = c[name]
    return kw


def check(c, o, lse, ro, rl, what):
    """o / lse against the reference; rows that see no key: o exactly 0, lse exactly -inf."""
    atol, rtol = tolerance(c)
    what = "case %d seed %d %s: %s" % (c["index"], c["seed"], c["op"], what)
    assert_close(o, ro, atol, rtol, what + " o")
    if lse is not None:
        assert_close(lse, rl, atol, rtol, what + " lse")
    empty = np.isneginf(rl)
    if empty.any():
        oa = np.asarray(o, dtype=np.float64)
        assert np.all(oa[empty] == 0), "%s: rows with no visible key must give o = 0, got max |o| %g" % (
            what, float(np.max(np.abs(oa[empty]))))
        if lse is not None:
            la = np.asarray(lse, dtype=np.float64)
            assert np.all(np.isneginf(la[empty])), "%s: rows with no visible key must give lse = -inf" % what


# ---------------------------------------------------------------------------------------------------------------
# API argument helpers

def api_dtype(c, name):
    return IO.api_dtype(c[name]) if c["dtype_as_numpy"] else c[name]


def api_layout(c):
    import kvattn
    return kvattn.TensorLayout[c["kv_layout"]] if c["layout_as_enum"] else c["kv_layout"]


def api_pos(c):
    import kvattn
    return kvattn.PosEncodingMode[c["pos_encoding_mode"]] if c["pos_as_enum"] else c["pos_encoding_mode"]


def feature_kw(c):
    return dict(pos_encoding_mode=api_pos(c), window_left=c["window_left"], logits_soft_cap=c["logits_soft_cap"],
                sm_scale=c["sm_scale"], rope_scale=c["rope_scale"], rope_theta=c["rope_theta"])


def split_kw(c):
    if c["split"] is None:
        return {}
    if c["split"][0] == "fixed":
        return dict(fixed_split_size=c["split"][1])
    return dict(disable_split_kv=True)


def echo_kw(c):
    """Run-time copies of plan-time scalars (equal values are accepted; FlashInfer checks window_left)."""
    if not c["echo_scalars_at_run"]:
        return {}
    kw = dict(window_left=c["window_left"])
    if c["logits_soft_cap"] is not None:
        kw["logits_soft_cap"] = c["logits_soft_cap"]
    if c["sm_scale"] is not None:
        kw["sm_scale"] = c["sm_scale"]
    return kw


def case_workspace(c):
    """The float workspace a new wrapper gets: the one it shares with another wrapper, else a fresh 32 MB one."""
    ws = c.get("ws_buffer")
    return ws if ws is not None else IO.ws(32 << 20)


def setup_workspace(c, w, size_args, size_kw):
    """The default 32 MB buffer, or exactly what workspace_size() asks for (reset_workspace_buffer)."""
    if c["workspace"] == "exact":
        fbytes, ibytes = w.workspace_size(*size_args, **size_kw)
        assert fbytes >= 0 and ibytes > 0
        w.reset_workspace_buffer(IO.ws(fbytes))
    elif c.get("prev_workspace") == "exact":  # a re-plan after an exact-size plan: the default buffer again
        w.reset_workspace_buffer(IO.ws(32 << 20))


GUARD = 12345.0  # the value around out= / lse= views; a write outside the view changes it


def guarded(shape, dtype, guard):
    """A NaN-poisoned buffer of `shape`; guard: a view into a larger GUARD-filled array (two extra rows before and
    after, last dim padded by 5), returned with the big array."""
    if not guard:
        return np.full(shape, np.nan, dtype=dtype), None
    big = np.full((shape[0] + 4,) + tuple(shape[1:-1]) + (shape[-1] + 5,), GUARD, dtype=dtype)
    view = big[(slice(2, 2 + shape[0]),) + (slice(None),) * (len(shape) - 2) + (slice(1, 1 + shape[-1]),)]
    view[...] = np.nan
    return view, big


def check_guard(big, shape, what):
    if big is None:
        return
    inside = np.zeros(big.shape, bool)
    inside[(slice(2, 2 + shape[0]),) + (slice(None),) * (len(shape) - 2) + (slice(1, 1 + shape[-1]),)] = True
    outside = np.asarray(big, np.float64)[~inside]
    g = float(np.asarray(GUARD, dtype=big.dtype).astype(np.float64))  # GUARD as the buffer's dtype rounds it
    assert np.all(outside == g), "%s: %d elements outside the %s buffer view were written" % (
        what, int(np.sum(outside != g)), shape)


def call_run(w, mode, args, kw, o_shape, o_dtype, rows, hq, guard=False):
    """One run() in output mode `mode`; returns (o, lse or None). Buffers are poisoned with NaN (guard: views
    with a guard band that must stay untouched)."""
    if mode == "alloc":
        o, lse = w.run(*args, **kw), None
    elif mode == "alloc_lse":
        o, lse = w.run(*args, return_lse=True, **kw)
    elif mode == "run_return_lse":
        o, lse = w.run_return_lse(*args, **kw)
    elif mode == "forward":  # the deprecated entry points (per-call values equal to the plan's)
        o, lse = w.forward(*args, **kw), None
    elif mode == "forward_return_lse":
        o, lse = w.forward_return_lse(*args, **kw)
    else:
        out, obig = guarded(tuple(o_shape), np_dtype(o_dtype), guard)
        out_a = IO.t(out)  # torch CPU: a tensor sharing out's memory (and the guard band's)
        if mode == "out":
            r = w.run(*args, out=out_a, **kw)
            assert r is out_a
            o, lse = out_a, None
        else:
            lbuf, lbig = guarded((rows, hq), np.float32, guard)
            lbuf_a = IO.t(lbuf)
            if mode == "out_lse":
                r = w.run(*args, out=out_a, lse=lbuf_a, return_lse=True, **kw)
                assert r[0] is out_a and r[1] is lbuf_a
            else:  # lse= without return_lse: the buffer is still written, only out is returned
                r = w.run(*args, out=out_a, lse=lbuf_a, **kw)
                assert r is out_a
            o, lse = out_a, lbuf_a  # (torch CPU: IO.np gives back views of out / lbuf)
            check_guard(lbig, (rows, hq), "lse=")
        check_guard(obig, tuple(o_shape), "out=")
    assert tuple(o.shape) == tuple(o_shape), (o.shape, o_shape)
    assert o.dtype == IO.dtype(o_dtype), (o.dtype, o_dtype)
    if lse is not None:
        assert tuple(lse.shape) == (rows, hq) and lse.dtype == IO.dtype("float32")
        lse = IO.np(lse)
    return IO.np(o), lse


# ---------------------------------------------------------------------------------------------------------------
# Ops

def check_paged(c, o, lse, q, kp, vp, indptr, indices, qo_indptr, kv_lens, masks, what, decode=False, ref_kv=None):
    """Every request of a paged batch against the reference: rows qo_indptr[b] .. qo_indptr[b + 1] attend to request
    b's pages (decode: causal inside the request's block of q_len_per_req rows; ref_kv: the K/V the kernels see)."""
    for b, n in enumerate(kv_lens):
        k, v = gather_kv(kp, vp, indptr, indices, b, n, c["kv_layout"])
        if ref_kv is not None:
            k, v = ref_kv(k, v)
        rs = slice(int(qo_indptr[b]), int(qo_indptr[b + 1]))
        m = masks[b] if masks is not None else None
        causal = True if decode else (c["causal"] and m is None)
        ro, rl = attention(q[rs], k, v, mask=m, **ref_kw(c, causal=causal))
        check(c, o[rs], None if lse is None else lse[rs], ro, rl,
              "%s request %d (qo rows %d, kv_len %d)" % (what, b, rs.stop - rs.start, n))


def check_ragged(c, o, lse, q, k, v, qo_indptr, kv_indptr, masks, what, ref_kv=None):
    """Every request of a ragged batch against the reference (rows and K/V rows by the two indptrs)."""
    for b in range(len(qo_indptr) - 1):
        rs = slice(int(qo_indptr[b]), int(qo_indptr[b + 1]))
        ks = slice(int(kv_indptr[b]), int(kv_indptr[b + 1]))
        kk, vv = (k[ks], v[ks]) if ref_kv is None else ref_kv(k[ks], v[ks])
        m = masks[b] if masks is not None else None
        ro, rl = attention(q[rs], kk, vv, mask=m, **ref_kw(c, causal=c["causal"] and m is None))
        check(c, o[rs], None if lse is None else lse[rs], ro, rl,
              "%s request %d (qo_len %d, kv_len %d)" % (what, b, rs.stop - rs.start, ks.stop - ks.start))


def cascade_reference(c, q, kp, vp, tables, qo_last, rows, hq, d):
    """Cascade = per level a paged prefill over that level's grouping of the query rows (only the last level causal),
    merged level by level: the reference o and lse of every row."""
    L = c["num_levels"]
    ro_all = rl_all = None
    for lvl, (bnd, kvs, (indptr, indices, _)) in enumerate(zip(c["cascade_bounds"], c["cascade_kv_lens"], tables)):
        lo = np.zeros((rows, hq, d))
        ll = np.full((rows, hq), -np.inf)
        for g, n in enumerate(kvs):
            k, v = gather_kv(kp, vp, indptr, indices, g, n, c["kv_layout"])
            rs = slice(int(qo_last[bnd[g]]), int(qo_last[bnd[g + 1]]))
            lo[rs], ll[rs] = attention(q[rs], k, v, **ref_kw(c, causal=c["causal"] and lvl == L - 1))
        if ro_all is None:
            ro_all, rl_all = lo, ll
        else:
            ro_all, rl_all = merge(ro_all, rl_all, lo, ll)
    return ro_all, rl_all


def run_pools(rng, c, P):
    """The two runs' paged pools, drawn when each run starts: run 0 on the case's form, run 1 on new pools where the
    case asks for new KV, another form or more pages, else the same ones."""
    pools = make_pools(rng, c, P, c["kv_form"])
    yield pools
    if c["new_kv_run2"] or c["kv_form_run2"] != c["kv_form"] or c["grow_pool_run2"]:
        pools = make_pools(rng, c, P + c["grow_pool_run2"], c["kv_form_run2"])
    yield pools


def run_decode(rng, c, w=None):
    import kvattn
    hq, hkv, d, ps = c["num_qo_heads"], c["num_kv_heads"], c["head_dim_qk"], c["page_size"]
    kv_lens, ql = c["kv_lens"], c["q_len_per_req"]
    B = len(kv_lens)
    rows = B * ql
    P, [(indptr, indices, last)] = page_tables(rng, c, [kv_lens])
    if w is None:
        ws = case_workspace(c)
        if c["graph"]:  # fixed buffers the plan copies the page table into (batch size fixed to B)
            bufs = c["graph_buffers"] = (IO.t(np.full(B + 1, -7, np.int32)), IO.t(np.full(16384, -7, np.int32)),
                                         IO.t(np.full(B, -7, np.int32)))
            if c["graph_subclass"]:
                w = kvattn.CUDAGraphBatchDecodeWithPagedKVCacheWrapper(ws, *bufs, kv_layout=api_layout(c),
                                                                       use_tensor_cores=c["use_tensor_cores"])
            else:
                w = kvattn.BatchDecodeWithPagedKVCacheWrapper(
                    ws, kv_layout=api_layout(c), use_cuda_graph=True, use_tensor_cores=c["use_tensor_cores"],
                    paged_kv_indptr_buffer=bufs[0], paged_kv_indices_buffer=bufs[1],
                    paged_kv_last_page_len_buffer=bufs[2])
            assert w.is_cuda_graph_enabled
        else:
            w = kvattn.BatchDecodeWithPagedKVCacheWrapper(ws, kv_layout=api_layout(c),
                                                          use_tensor_cores=c["use_tensor_cores"])
    plan_kw = dict(feature_kw(c), q_data_type=api_dtype(c, "q_dtype"), kv_data_type=api_dtype(c, "kv_dtype"),
                   o_data_type=api_dtype(c, "o_dtype"), q_len_per_req=ql, **split_kw(c))
    setup_workspace(c, w, (indptr, indices, last, hq, hkv, d, ps), plan_kw)
    w.plan(IO.idx(indptr), IO.idx(indices), IO.idx(last), hq, hkv, d, ps, **plan_kw)
    if c["graph"]:
        ib, xb, lb = (IO.np(b) for b in c["graph_buffers"])
        n = int(indptr[-1])
        np.testing.assert_array_equal(ib, indptr)
        np.testing.assert_array_equal(xb[:n], indices[:n])
        np.testing.assert_array_equal(lb, last)
    yield  # planned (a wrapper sharing the workspace may plan now)
    for run, (arg, kp, vp) in enumerate(run_pools(rng, c, P)):
        q = make_q(rng, c, (rows, hq, d))
        o, lse = call_run(w, c["out_modes"][run], (IO.t(q), arg), echo_kw(c), (rows, hq, d), c["o_dtype"], rows, hq,
                          c["out_guard"])
        check_paged(c, o, lse, q, kp, vp, indptr, indices, np.arange(B + 1) * ql, kv_lens, None, "run %d" % run,
                    decode=True)
    return w


def _batch_masks(rng, c, qo_lens, kv_lens):
    if c["mask"] == "none":
        return None, {}
    masks = [make_mask(rng, c, q, n) for q, n in zip(qo_lens, kv_lens)]
    if c["mask"] == "custom":
        flat = np.concatenate([m.reshape(-1) for m in masks]) if masks else np.zeros(0, bool)
        return masks, dict(custom_mask=IO.t(flat.astype(bool)))
    return masks, dict(packed_custom_mask=IO.t(packed_segments(masks)))


def run_prefill_paged(rng, c, w=None):
    import kvattn
    hq, hkv, dqk, dvo, ps = c["num_qo_heads"], c["num_kv_heads"], c["head_dim_qk"], c["head_dim_vo"], c["page_size"]
    kv_lens, qo_lens = c["kv_lens"], c["qo_lens"]
    qo_indptr = np.concatenate([[0], np.cumsum(qo_lens)]).astype(np.int32)
    rows = int(qo_indptr[-1])
    P, [(indptr, indices, last)] = page_tables(rng, c, [kv_lens])
    masks, mask_kw = _batch_masks(rng, c, qo_lens, kv_lens)
    if w is None:
        w = kvattn.BatchPrefillWithPagedKVCacheWrapper(case_workspace(c), kv_layout=api_layout(c))
    plan_kw = dict(feature_kw(c), causal=c["causal"], q_data_type=api_dtype(c, "q_dtype"),
                   kv_data_type=api_dtype(c, "kv_dtype"), o_data_type=api_dtype(c, "o_dtype"), **mask_kw,
                   **split_kw(c))
    if dvo != dqk or c["pass_head_dim_vo"]:
        plan_kw["head_dim_vo"] = dvo
    setup_workspace(c, w, (qo_indptr, indptr, indices, last, hq, hkv, dqk, ps), plan_kw)
    w.plan(IO.idx(qo_indptr), IO.idx(indptr), IO.idx(indices), IO.idx(last), hq, hkv, dqk, ps, **plan_kw)
    yield  # planned (a wrapper sharing the workspace may plan now)
    for run, (arg, kp, vp) in enumerate(run_pools(rng, c, P)):
        q = make_q(rng, c, (rows, hq, dqk))
        o, lse = call_run(w, c["out_modes"][run], (IO.t(q), arg), echo_kw(c), (rows, hq, dvo), c["o_dtype"], rows, hq,
                          c["out_guard"])
        check_paged(c, o, lse, q, kp, vp, indptr, indices, qo_indptr, kv_lens, masks, "run %d" % run)
    return w


def _ragged_kv(rng, c, nnz):
    k = randn(rng, (nnz, c["num_kv_heads"], c["head_dim_qk"]), c["kv_dtype"])
    v = randn(rng, (nnz, c["num_kv_heads"], c["head_dim_vo"]), c["kv_dtype"])
    return k, v


def _hnd(c, x):
    """x [n, H, D] in the case's layout: HND as a contiguous [H, n, D] array or a transposed view."""
    if c["kv_layout"] == "NHD":
        return x
    t = x.transpose(1, 0, 2)
    return t if c["kv_strided_view"] else np.ascontiguousarray(t)


def run_prefill_ragged(rng, c, w=None):
    import kvattn
    hq, hkv, dqk, dvo = c["num_qo_heads"], c["num_kv_heads"], c["head_dim_qk"], c["head_dim_vo"]
    kv_lens, qo_lens = c["kv_lens"], c["qo_lens"]
    qo_indptr = np.concatenate([[0], np.cumsum(qo_lens)]).astype(np.int32)
    kv_indptr = np.concatenate([[0], np.cumsum(kv_lens)]).astype(np.int32)
    rows, nnz = int(qo_indptr[-1]), int(kv_indptr[-1])
    masks, mask_kw = _batch_masks(rng, c, qo_lens, kv_lens)
    if w is None:
        w = kvattn.BatchPrefillWithRaggedKVCacheWrapper(case_workspace(c), kv_layout=api_layout(c))
    plan_kw = dict(feature_kw(c), causal=c["causal"], q_data_type=api_dtype(c, "q_dtype"),
                   kv_data_type=api_dtype(c, "kv_dtype"), o_data_type=api_dtype(c, "o_dtype"), **mask_kw,
                   **split_kw(c))
    if dvo != dqk or c["pass_head_dim_vo"]:
        plan_kw["head_dim_vo"] = dvo
    setup_workspace(c, w, (qo_indptr, kv_indptr, hq, hkv, dqk), plan_kw)
    w.plan(IO.idx(qo_indptr), IO.idx(kv_indptr), hq, hkv, dqk, **plan_kw)
    yield  # planned (a wrapper sharing the workspace may plan now)
    k, v = _ragged_kv(rng, c, nnz)
    for run in range(2):
        if run == 1 and c["new_kv_run2"]:
            k, v = _ragged_kv(rng, c, nnz)
        q = make_q(rng, c, (rows, hq, dqk))
        o, lse = call_run(w, c["out_modes"][run], (IO.t(q), IO.t(_hnd(c, k)), IO.t(_hnd(c, v))), echo_kw(c),
                          (rows, hq, dvo),
                          c["o_dtype"], rows, hq, c["out_guard"])
        check_ragged(c, o, lse, q, k, v, qo_indptr, kv_indptr, masks, "run %d" % run)
    return w


def run_cascade(rng, c, w=None):
    """Cascade = per level a paged prefill over that level's grouping of the query rows (positions, masks and
    RoPE relative to the level's own KV; only the last level causal), merged level by level (FlashInfer's
    composition, which the wrapper documents)."""
    import kvattn
    hq, hkv, d, ps = c["num_qo_heads"], c["num_kv_heads"], c["head_dim_qk"], c["page_size"]
    L = c["num_levels"]
    qo_lens = c["qo_lens"]
    qo_last = np.concatenate([[0], np.cumsum(qo_lens)]).astype(np.int32)
    rows = int(qo_last[-1])
    P, tables = page_tables(rng, c, c["cascade_kv_lens"])
    qo_arr = [qo_last[np.array(bnd)].astype(np.int32) for bnd in c["cascade_bounds"]]
    if w is None:
        w = kvattn.MultiLevelCascadeAttentionWrapper(L, case_workspace(c), kv_layout=api_layout(c))
    w.plan([IO.idx(a) for a in qo_arr], [IO.idx(t[0]) for t in tables], [IO.idx(t[1]) for t in tables],
           [IO.idx(t[2]) for t in tables], hq, hkv, d, ps,
           causal=c["causal"], q_data_type=api_dtype(c, "q_dtype"), kv_data_type=api_dtype(c, "kv_dtype"),
           **feature_kw(c))
    yield  # planned (a wrapper sharing the workspace may plan now)
    for run, (arg, kp, vp) in enumerate(run_pools(rng, c, P)):
        q = make_q(rng, c, (rows, hq, d))
        o = w.run(IO.t(q), arg)
        assert tuple(o.shape) == (rows, hq, d) and o.dtype == IO.dtype(c["q_dtype"])
        o = IO.np(o)
        ro_all, rl_all = cascade_reference(c, q, kp, vp, tables, qo_last, rows, hq, d)
        check(c, o, None, ro_all, rl_all, "run %d (%d levels)" % (run, L))
    return w


def run_single_decode(rng, c, w=None):
    import kvattn
    yield  # (no plan)
    hq, d = c["num_qo_heads"], c["head_dim_qk"]
    n = c["kv_lens"][0]
    q = make_q(rng, c, (hq, d))
    k, v = _ragged_kv(rng, c, n)
    kw = feature_kw(c)
    res = kvattn.single_decode_with_kv_cache(IO.t(q), IO.t(_hnd(c, k)), IO.t(_hnd(c, v)), kv_layout=api_layout(c),
                                             use_tensor_cores=c["use_tensor_cores"],
                                             return_lse=c["return_lse_single"], **kw)
    o, lse = res if c["return_lse_single"] else (res, None)
    assert tuple(o.shape) == (hq, d) and o.dtype == IO.dtype(c["q_dtype"])
    o = IO.np(o)
    ro, rl = attention(q[None], k, v, **ref_kw(c, causal=False))
    if lse is not None:
        assert tuple(lse.shape) == (hq,) and lse.dtype == IO.dtype("float32")
        lse = IO.np(lse)[None]
    check(c, o[None], lse, ro, rl, "kv_len %d" % n)


def run_single_prefill(rng, c, w=None):
    import kvattn
    yield  # (no plan)
    hq, dqk, dvo = c["num_qo_heads"], c["head_dim_qk"], c["head_dim_vo"]
    qo, n = c["qo_lens"][0], c["kv_lens"][0]
    q = make_q(rng, c, (qo, hq, dqk))
    k, v = _ragged_kv(rng, c, n)
    kw = feature_kw(c)
    m = None
    if c["mask"] != "none":
        m = make_mask(rng, c, qo, n)
        if c["mask"] == "custom":
            kw["custom_mask"] = IO.t(m if c["mask_2d"] else m.reshape(-1))
        else:
            kw["packed_custom_mask"] = IO.t(packed_segments([m]))
    if c["o_dtype"] != c["q_dtype"] or c["pass_o_dtype"]:
        kw["o_dtype"] = api_dtype(c, "o_dtype")
    res = kvattn.single_prefill_with_kv_cache(IO.t(q), IO.t(_hnd(c, k)), IO.t(_hnd(c, v)), causal=c["causal"],
                                              kv_layout=api_layout(c), return_lse=c["return_lse_single"], **kw)
    o, lse = res if c["return_lse_single"] else (res, None)
    assert tuple(o.shape) == (qo, hq, dvo) and o.dtype == IO.dtype(c["o_dtype"])
    o = IO.np(o)
    if lse is not None:
        assert tuple(lse.shape) == (qo, hq) and lse.dtype == IO.dtype("float32")
        lse = IO.np(lse)
    ro, rl = attention(q, k, v, mask=m, **ref_kw(c, causal=c["causal"] and m is None))
    check(c, o, lse, ro, rl, "qo_len %d, kv_len %d" % (qo, n))


def finish(gen):
    """Run a runner (a generator that stops once after its plan) to its end; returns its wrapper."""
    while True:
        try:
            next(gen)
        except StopIteration as e:
            return e.value


RUNNERS = {"decode": run_decode, "prefill_paged": run_prefill_paged, "prefill_ragged": run_prefill_ragged,
           "cascade": run_cascade, "single_decode": run_single_decode, "single_prefill": run_single_prefill}


# ---------------------------------------------------------------------------------------------------------------

def replay_hint(c, group=""):
    return ("replay: KVATTN_FUZZ_CASE_SEED=%d PYTHONPATH=$PWD/python KVATTN_LIBRARY=$PWD/build/libkvattn.so "
            "python3 -m pytest -q python/tests/test_fuzz_api.py%s" % (c["seed"], " -k " + group if group else ""))


@pytest.mark.parametrize("index,seed", CASES, ids=["case%03d-seed%d" % cs for cs in CASES])
def test_fuzz_api(index, seed):
    run_case(index, seed)


def run_case(index, seed, group=""):
    c, rng = draw_case(seed, index)
    print("fuzz case %d (base seed %d) seed %d: %s" % (index, BASE_SEED, seed, describe(c)))
    print(replay_hint(c, group))
    gens = [RUNNERS[c["op"]](rng, c)]
    if c["companion"]:
        # FlashInfer engines share one float workspace among their wrappers: a second wrapper plans into the buffer
        # between this plan and its runs, and runs after them
        c["ws_buffer"] = IO.ws(32 << 20)
        next(gens[0])
        c3 = draw_companion(rng, c)
        print("companion wrapper on the same float workspace: %s" % describe(c3))
        gens.append(RUNNERS[c3["op"]](rng, c3))
    ws = [finish(g) for g in gens]
    if c["replan"]:
        c2 = draw_replan(rng, c)
        print("re-plan of the same wrapper: %s" % describe(c2))
        finish(RUNNERS[c2["op"]](rng, c2, ws[0]))


# ---------------------------------------------------------------------------------------------------------------
# torch groups. Importing this module never imports torch: the tests below import it (pytest.importorskip).

def _group_cases(default_n):
    """Cases of a torch group: KVATTN_FUZZ_CASE_SEED (one case), else KVATTN_FUZZ_CASES (default default_n) cases
    of base seed KVATTN_FUZZ_SEED, seeded as the NumPy group's (so the torch CPU cases are its first ones)."""
    if ONE_CASE_SEED is not None:
        return [(0, int(ONE_CASE_SEED))]
    n = NUM_CASES if "KVATTN_FUZZ_CASES" in os.environ else default_n
    return [(i, case_seed(i)) for i in range(n)]


TORCH_CPU_CASES = _group_cases(30)
CUDA_CASES = _group_cases(60)
CUDA_GRAPH_CASES = _group_cases(2)


def _torch_or_skip():
    return pytest.importorskip("torch", reason="torch is not installed: the torch fuzz groups need it")


@pytest.mark.parametrize("index,seed", TORCH_CPU_CASES, ids=["case%03d-seed%d" % cs for cs in TORCH_CPU_CASES])
def test_fuzz_api_torch_cpu(index, seed):
    """The NumPy group's case of this seed (same draws, same checks) with torch CPU tensors: inputs, out= / lse=
    buffers, the paged cache in both forms, workspaces, masks, CUDA-graph-mode buffers and (mostly) the plan's index
    arrays."""
    global IO
    torch = _torch_or_skip()
    opts = np.random.default_rng([seed, 0x7057])  # torch-only choices: the case's own draws stay the NumPy ones
    io = TorchCpuIO(torch, idx_torch=bool(opts.random() < 0.7))
    print("torch CPU tensors (torch %s); plan index arrays as %s" % (
        torch.__version__, "torch tensors" if io.idx_torch else "NumPy arrays"))
    IO = io
    try:
        run_case(index, seed, "torch_cpu")
    finally:
        IO = NumpyIO()


# ---- torch CUDA tensors (the CUDA backend) ----
# What the CUDA backend takes (include/kvattn.h q_dtype, docs/variants.md "Dtypes and head dims are those of the
# CUDA backend", src/cuda kva__cuda_select): q f16 / bf16; KV f16 / bf16 / e4m3 / e5m2; o f16 / bf16 / f32;
# head_dim_qk == head_dim_vo in {64, 128, 256}; row / head strides multiples of 16 bytes and 16-byte aligned
# q / o / K / V pointers (docs/errors.md ALIGNMENT), so paddings and view offsets below are 16-byte multiples.

CUDA_DEV = "cuda"  # (a local smoke test of this code can point it at the CPU backend)
CUDA_HEAD_DIMS = [64, 128, 256]
CUDA_PAGE_SIZES = [1, 3, 5, 16, 17, 32]
CUDA_OUT_MODES = ["alloc", "alloc_lse", "run_return_lse", "out", "out_lse"]
CUDA_COST_BUDGET = 1.5e8  # float64 reference MACs per run (the CPU computes it)


def _draw_cuda_kv_len(rng):
    r = rng.random()
    if r < 0.1:
        return 0
    if r < 0.35:
        return int(rng.integers(1, 65))
    if r < 0.75:
        return int(rng.integers(65, 700))
    return int(rng.integers(700, 2049))  # long: split-KV


def draw_cuda_case(seed, index=0, fp8_names=(), log=print):
    """A case within the CUDA backend's constraints (its own draws from `seed`; op = seed % 6 as in draw_case).
    fp8_names: the fp8 dtypes this torch has."""
    rng = np.random.default_rng(seed)
    op = OPS[seed % len(OPS)]
    c = {"op": op, "index": index, "seed": seed}
    c["num_kv_heads"] = int(rng.integers(1, 5))
    c["group"] = int(rng.integers(1, 9))
    c["num_qo_heads"] = c["num_kv_heads"] * c["group"]
    c["head_dim_qk"] = c["head_dim_vo"] = _pick(rng, CUDA_HEAD_DIMS)
    c["kv_layout"] = _pick(rng, ["NHD", "HND"])
    q16 = ["float16", "bfloat16"]
    c["q_dtype"] = _pick(rng, q16)
    other = q16[1 - q16.index(c["q_dtype"])]
    r = rng.random()
    if r < 0.25 and fp8_names:
        c["kv_dtype"] = _pick(rng, list(fp8_names))
    elif r < 0.4:
        c["kv_dtype"] = other
    else:
        c["kv_dtype"] = c["q_dtype"]
    r = rng.random()
    if op in ("single_decode", "cascade") or r < 0.6:  # no output dtype argument there
        c["o_dtype"] = c["q_dtype"]
    else:
        c["o_dtype"] = other if r < 0.8 else "float32"
    fp8 = c["kv_dtype"].startswith("float8")
    c["k_scale"] = c["v_scale"] = None  # fp8 dequantisation scales (the cascade run takes none)
    if fp8 and op != "cascade":
        c["k_scale"] = _pick(rng, [0.5, 1.0, 2.0, f32(rng.uniform(0.25, 4.0))])
        c["v_scale"] = _pick(rng, [0.5, 1.0, 2.0, f32(rng.uniform(0.25, 4.0))])
    c["page_size"] = _pick(rng, CUDA_PAGE_SIZES)
    c["extra_pages"] = int(rng.integers(1, 9))
    c["shared_pages"] = bool(rng.random() < 0.2)
    c["junk_indices"], c["junk_out_of_range"] = 0, False
    B = int(rng.integers(1, 7)) if op not in ("single_decode", "single_prefill") else 1
    c["kv_lens"] = [_draw_cuda_kv_len(rng) for _ in range(B)]
    c["qo_lens"] = [_draw_qo_len(rng, allow_zero=op != "single_prefill") for _ in range(B)]
    c["q_len_per_req"] = 1 if rng.random() < 0.8 else int(rng.integers(2, 5))
    if c["q_len_per_req"] > 1 and op == "decode":  # a request holds its verified tokens (plan refuses 0 < kv < ql)
        c["kv_lens"] = [n if n == 0 else max(n, c["q_len_per_req"]) for n in c["kv_lens"]]
    if op == "cascade":
        c["num_levels"] = int(rng.integers(2, 4))
        bounds, kvs = [], []
        for lvl in range(c["num_levels"] - 1):
            cuts = [i for i in range(1, B) if rng.random() < (0.15 if lvl == 0 else 0.5)]
            bnd = [0] + cuts + [B]
            bounds.append(bnd)
            kvs.append([_draw_cuda_kv_len(rng) for _ in range(len(bnd) - 1)])
        bounds.append(list(range(B + 1)))
        kvs.append(c["kv_lens"])
        c["cascade_bounds"], c["cascade_kv_lens"] = bounds, kvs
    c["causal"] = bool(rng.random() < 0.6)
    c["pos_encoding_mode"] = _pick(rng, ["NONE", "ROPE_LLAMA", "ALIBI"], p=[0.5, 0.25, 0.25])
    c["rope_scale"] = None if rng.random() < 0.5 else f32(rng.uniform(0.25, 8.0))
    c["rope_theta"] = None if rng.random() < 0.4 else _pick(rng, [1e4, 5e5, 1e6, f32(10 ** rng.uniform(2, 6))])
    r = rng.random()
    c["window_left"] = -1 if r < 0.6 else int(rng.integers(0, 9)) if r < 0.8 else int(rng.integers(0, 1500))
    c["logits_soft_cap"] = None if rng.random() < 0.65 else f32(rng.uniform(0.5, 30.0))
    c["sm_scale"] = None if rng.random() < 0.6 else f32(rng.uniform(0.02, 0.3))
    c["q_mag"] = _pick(rng, [0.5, 1.0, 1.0, 2.0, 4.0, 8.0])
    mask_ok = op in ("prefill_paged", "prefill_ragged", "single_prefill")
    c["mask"] = _pick(rng, ["none", "custom", "packed"], p=[0.7, 0.15, 0.15]) if mask_ok else "none"
    c["mask_density"] = float(rng.uniform(0.05, 0.95))
    c["mask_2d"] = bool(rng.random() < 0.5)
    c["kv_form"] = _pick(rng, ["5d", "5d_padded", "tuple_views", "tuple", "tuple_padded"])
    c["kv_strided_view"] = bool(rng.random() < 0.3)
    c["strided_q"] = bool(rng.random() < 0.2)
    c["new_kv_run2"] = bool(rng.random() < 0.5)
    c["out_modes"] = [_pick(rng, CUDA_OUT_MODES), _pick(rng, CUDA_OUT_MODES)]
    c["out_guard"] = bool(rng.random() < 0.3)
    c["return_lse_single"] = bool(rng.random() < 0.7)
    c["idx_on_device"] = bool(rng.random() < 0.5)  # page indices as a device tensor (vLLM), else host arrays
    c["pdl_first"] = bool(rng.random() < 0.5)  # run 0 with enable_pdl=pdl_first, run 1 with the other
    r = rng.random()
    if r < 0.7 or op not in BATCH_OPS:
        c["split"] = None
    elif r < 0.85:
        toks = int(rng.integers(64, 1025))
        c["split"] = ("fixed", toks if op == "prefill_ragged" else max(1, -(-toks // c["page_size"])))
    else:
        c["split"] = ("disable",)
    while request_cost(c) > CUDA_COST_BUDGET:
        if op not in ("decode", "single_decode") and max(c["qo_lens"]) > 1:
            c["qo_lens"] = [max(q // 2, 1) if q > 0 else 0 for q in c["qo_lens"]]
        else:
            c["kv_lens"] = [n // 2 for n in c["kv_lens"]]
            if op == "cascade":
                c["cascade_kv_lens"] = [[n // 2 for n in kvs] for kvs in c["cascade_kv_lens"]]
                c["cascade_kv_lens"][-1] = c["kv_lens"]
        log("  shrunk lengths to stay within the reference budget")
    return c, rng


def describe_cuda(c):
    skip = {"index", "seed", "junk_indices", "junk_out_of_range"}
    return ", ".join("%s=%r" % (k, v) for k, v in c.items() if k not in skip)


class CudaCase:
    """Device tensors of a CUDA case, made from the case's NumPy draws (float32, then rounded to the dtype on the
    device) and read back as float64 for the reference (np64: the rounded values)."""

    def __init__(self, torch, c, rng):
        self.torch, self.c, self.rng = torch, c, rng
        self.tdt = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
        for name in ("float8_e4m3fn", "float8_e5m2"):
            if hasattr(torch, name):
                self.tdt[name] = getattr(torch, name)

    def np64(self, x):
        return x.detach().float().cpu().numpy().astype(np.float64)

    def tensor(self, shape, dtype_name, mag=1.0, pad=0, offset=0):
        """A random [shape] tensor on the device; pad: the last dim padded by `pad` elements and the tensor a
        view at element `offset` of it (both 16-byte multiples for the CUDA backend's alignment rules)."""
        x = self.rng.standard_normal(tuple(shape[:-1]) + (shape[-1] + pad,), dtype=np.float32)
        if mag != 1.0:
            x *= np.float32(mag)
        t = self.torch.from_numpy(x).to(CUDA_DEV).to(self.tdt[dtype_name])
        return t[..., offset:offset + shape[-1]] if pad else t

    def q(self, shape):
        c = self.c
        if c["strided_q"]:  # 32 elements of padding, the view 8 elements in: 16-byte aligned rows and pointer
            return self.tensor(shape, c["q_dtype"], c["q_mag"], pad=32, offset=8)
        return self.tensor(shape, c["q_dtype"], c["q_mag"])

    def pools(self, P):
        """(argument for run, k pool float64 4-D, v pool float64 4-D)."""
        c = self.c
        ps, H, d = c["page_size"], c["num_kv_heads"], c["head_dim_qk"]
        shape = (P, ps, H, d) if c["kv_layout"] == "NHD" else (P, H, ps, d)
        pad = 16 if c["kv_form"].endswith("_padded") else 0  # 16 elements: 16-byte multiples for fp8 too
        if c["kv_form"].startswith("5d") or c["kv_form"] == "tuple_views":
            cache = self.tensor((P, 2) + shape[1:], c["kv_dtype"], pad=pad)
            k, v = cache[:, 0], cache[:, 1]
            arg = cache if c["kv_form"].startswith("5d") else (k, v)
        else:
            k = self.tensor(shape, c["kv_dtype"], pad=pad)
            v = self.tensor(shape, c["kv_dtype"], pad=pad)
            arg = (k, v)
        return arg, self.np64(k), self.np64(v)

    def ragged(self, n):
        """k, v [n, Hkv, D] in the case's layout (HND: contiguous [H, n, D] or a transposed view) and float64
        NHD copies."""
        c = self.c
        k = self.tensor((n, c["num_kv_heads"], c["head_dim_qk"]), c["kv_dtype"])
        v = self.tensor((n, c["num_kv_heads"], c["head_dim_vo"]), c["kv_dtype"])
        k64, v64 = self.np64(k), self.np64(v)
        if c["kv_layout"] == "HND":
            k, v = k.transpose(0, 1), v.transpose(0, 1)
            if not c["kv_strided_view"]:
                k, v = k.contiguous(), v.contiguous()
        return k, v, k64, v64

    def scale_kw(self):
        c = self.c
        return {} if c["k_scale"] is None else dict(k_scale=c["k_scale"], v_scale=c["v_scale"])

    def ref_kv(self, k, v):
        """K/V as the kernels see them: times k_scale / v_scale (fp8 dequantisation)."""
        c = self.c
        return (k if c["k_scale"] is None else k * c["k_scale"]), (v if c["v_scale"] is None else v * c["v_scale"])

    def idx(self, x, device_ok=True):
        t = self.torch.from_numpy(np.ascontiguousarray(x))
        return t.to(CUDA_DEV) if device_ok and self.c["idx_on_device"] else t

    def feature_kw(self):
        c = self.c
        return dict(pos_encoding_mode=c["pos_encoding_mode"], window_left=c["window_left"],
                    logits_soft_cap=c["logits_soft_cap"], sm_scale=c["sm_scale"], rope_scale=c["rope_scale"],
                    rope_theta=c["rope_theta"])

    def masks(self, qo_lens, kv_lens):
        c = self.c
        if c["mask"] == "none":
            return None, {}
        masks = [make_mask(self.rng, c, q, n) for q, n in zip(qo_lens, kv_lens)]
        if c["mask"] == "custom":
            flat = np.concatenate([m.reshape(-1) for m in masks]) if masks else np.zeros(0, bool)
            return masks, dict(custom_mask=self.torch.from_numpy(flat.astype(bool)).to(CUDA_DEV))
        return masks, dict(packed_custom_mask=self.torch.from_numpy(packed_segments(masks)).to(CUDA_DEV))

    def run(self, w, mode, args, kw, o_shape, rows, hq):
        """One run() in output mode `mode` (out= / lse= poisoned with NaN, maybe inside a guard band); synchronises
        and returns (o, lse or None) as float64 NumPy arrays."""
        torch, c = self.torch, self.c
        odt = self.tdt[c["o_dtype"]]
        bigs = []
        if mode == "alloc":
            o, lse = w.run(*args, **kw), None
        elif mode == "alloc_lse":
            o, lse = w.run(*args, return_lse=True, **kw)
        elif mode == "run_return_lse":
            o, lse = w.run_return_lse(*args, **kw)
        else:
            if c["out_guard"]:  # 2 guard rows either side; last dim padded by 16, the view 8 elements in
                obig = torch.full((o_shape[0] + 4,) + tuple(o_shape[1:-1]) + (o_shape[-1] + 16,), GUARD,
                                  dtype=odt, device=CUDA_DEV)
                osl = (slice(2, 2 + o_shape[0]), slice(None), slice(8, 8 + o_shape[-1]))
                out = obig[osl]
                out.fill_(float("nan"))
                bigs.append((obig, osl, "out="))
            else:
                out = torch.full(tuple(o_shape), float("nan"), dtype=odt, device=CUDA_DEV)
            if mode == "out":
                r = w.run(*args, out=out, **kw)
                assert r is out
                o, lse = out, None
            else:
                if c["out_guard"]:
                    lbig = torch.full((rows + 4, hq + 5), GUARD, dtype=torch.float32, device=CUDA_DEV)
                    lsl = (slice(2, 2 + rows), slice(1, 1 + hq))
                    lbuf = lbig[lsl]
                    lbuf.fill_(float("nan"))
                    bigs.append((lbig, lsl, "lse="))
                else:
                    lbuf = torch.full((rows, hq), float("nan"), dtype=torch.float32, device=CUDA_DEV)
                r = w.run(*args, out=out, lse=lbuf, return_lse=True, **kw)
                assert r[0] is out and r[1] is lbuf
                o, lse = out, lbuf
        torch.cuda.synchronize()
        for big, sl, what in bigs:
            inside = torch.zeros(big.shape, dtype=torch.bool)
            inside[sl] = True
            outside = big.float().cpu()[~inside]
            g = float(torch.tensor(GUARD, dtype=big.dtype).float())
            assert bool((outside == g).all()), "%s: %d elements outside the buffer view were written" % (
                what, int((outside != g).sum()))
        assert o.device.type == CUDA_DEV and o.dtype == odt and tuple(o.shape) == tuple(o_shape), (
            o.device, o.dtype, tuple(o.shape))
        if lse is not None:
            assert lse.device.type == CUDA_DEV and lse.dtype == torch.float32 and tuple(lse.shape) == (rows, hq)
            lse = self.np64(lse)
        return self.np64(o), lse


def run_cuda_paged(cc, kvattn):
    """decode / prefill_paged on the CUDA backend: plan once, two runs (new q, maybe new KV) with enable_pdl
    pdl_first then its opposite."""
    c, torch = cc.c, cc.torch
    op = c["op"]
    hq, hkv, d, ps = c["num_qo_heads"], c["num_kv_heads"], c["head_dim_qk"], c["page_size"]
    kv_lens = c["kv_lens"]
    B = len(kv_lens)
    P, [(indptr, indices, last)] = page_tables(cc.rng, c, [kv_lens])
    ws = torch.zeros(64 << 20, dtype=torch.uint8, device=CUDA_DEV)
    plan_kw = dict(cc.feature_kw(), q_data_type=cc.tdt[c["q_dtype"]], kv_data_type=cc.tdt[c["kv_dtype"]],
                   o_data_type=cc.tdt[c["o_dtype"]], **split_kw(c))
    masks = None
    if op == "decode":
        ql = c["q_len_per_req"]
        qo_indptr = np.arange(B + 1, dtype=np.int32) * ql
        w = kvattn.BatchDecodeWithPagedKVCacheWrapper(ws, kv_layout=c["kv_layout"])
        w.plan(cc.idx(indptr, False), cc.idx(indices), cc.idx(last, False), hq, hkv, d, ps, q_len_per_req=ql,
               **plan_kw)
    else:
        qo_indptr = np.concatenate([[0], np.cumsum(c["qo_lens"])]).astype(np.int32)
        masks, mask_kw = cc.masks(c["qo_lens"], kv_lens)
        w = kvattn.BatchPrefillWithPagedKVCacheWrapper(ws, kv_layout=c["kv_layout"])
        w.plan(cc.idx(qo_indptr, False), cc.idx(indptr, False), cc.idx(indices), cc.idx(last, False), hq, hkv, d, ps,
               causal=c["causal"], **mask_kw, **plan_kw)
    rows = int(qo_indptr[-1])
    arg, kp, vp = cc.pools(P)
    for run in range(2):
        if run == 1 and c["new_kv_run2"]:
            arg, kp, vp = cc.pools(P)
        pdl = c["pdl_first"] if run == 0 else not c["pdl_first"]
        q = cc.q((rows, hq, d))
        q64 = cc.np64(q)
        o, lse = cc.run(w, c["out_modes"][run], (q, arg), dict(cc.scale_kw(), enable_pdl=pdl), (rows, hq, d), rows,
                        hq)
        check_paged(c, o, lse, q64, kp, vp, indptr, indices, qo_indptr, kv_lens, masks,
                    "run %d (enable_pdl=%s)" % (run, pdl), decode=op == "decode", ref_kv=cc.ref_kv)


def run_cuda_ragged(cc, kvattn):
    c, torch = cc.c, cc.torch
    hq, hkv, d = c["num_qo_heads"], c["num_kv_heads"], c["head_dim_qk"]
    kv_lens, qo_lens = c["kv_lens"], c["qo_lens"]
    qo_indptr = np.concatenate([[0], np.cumsum(qo_lens)]).astype(np.int32)
    kv_indptr = np.concatenate([[0], np.cumsum(kv_lens)]).astype(np.int32)
    rows, nnz = int(qo_indptr[-1]), int(kv_indptr[-1])
    masks, mask_kw = cc.masks(qo_lens, kv_lens)
    w = kvattn.BatchPrefillWithRaggedKVCacheWrapper(torch.zeros(64 << 20, dtype=torch.uint8, device=CUDA_DEV),
                                                    kv_layout=c["kv_layout"])
    w.plan(cc.idx(qo_indptr), cc.idx(kv_indptr), hq, hkv, d, causal=c["causal"], q_data_type=cc.tdt[c["q_dtype"]],
           kv_data_type=cc.tdt[c["kv_dtype"]], o_data_type=cc.tdt[c["o_dtype"]], **mask_kw, **cc.feature_kw(),
           **split_kw(c))
    k, v, k64, v64 = cc.ragged(nnz)
    for run in range(2):
        if run == 1 and c["new_kv_run2"]:
            k, v, k64, v64 = cc.ragged(nnz)
        pdl = c["pdl_first"] if run == 0 else not c["pdl_first"]
        q = cc.q((rows, hq, d))
        q64 = cc.np64(q)
        o, lse = cc.run(w, c["out_modes"][run], (q, k, v), dict(cc.scale_kw(), enable_pdl=pdl), (rows, hq, d), rows,
                        hq)
        check_ragged(c, o, lse, q64, k64, v64, qo_indptr, kv_indptr, masks, "run %d (enable_pdl=%s)" % (run, pdl),
                     ref_kv=cc.ref_kv)


def run_cuda_cascade(cc, kvattn):
    c, torch = cc.c, cc.torch
    hq, hkv, d, ps = c["num_qo_heads"], c["num_kv_heads"], c["head_dim_qk"], c["page_size"]
    L = c["num_levels"]
    qo_last = np.concatenate([[0], np.cumsum(c["qo_lens"])]).astype(np.int32)
    rows = int(qo_last[-1])
    P, tables = page_tables(cc.rng, c, c["cascade_kv_lens"])
    qo_arr = [qo_last[np.array(bnd)].astype(np.int32) for bnd in c["cascade_bounds"]]
    w = kvattn.MultiLevelCascadeAttentionWrapper(L, torch.zeros(64 << 20, dtype=torch.uint8, device=CUDA_DEV),
                                                 kv_layout=c["kv_layout"])
    w.plan([cc.idx(a, False) for a in qo_arr], [cc.idx(t[0], False) for t in tables], [cc.idx(t[1]) for t in tables],
           [cc.idx(t[2], False) for t in tables], hq, hkv, d, ps, causal=c["causal"],
           q_data_type=cc.tdt[c["q_dtype"]], kv_data_type=cc.tdt[c["kv_dtype"]], **cc.feature_kw())
    arg, kp, vp = cc.pools(P)
    for run in range(2):
        if run == 1 and c["new_kv_run2"]:
            arg, kp, vp = cc.pools(P)
        q = cc.q((rows, hq, d))
        o = w.run(q, arg)
        torch.cuda.synchronize()
        assert o.device.type == CUDA_DEV and o.dtype == cc.tdt[c["q_dtype"]] and tuple(o.shape) == (rows, hq, d)
        o = cc.np64(o)
        q64 = cc.np64(q)
        ro_all, rl_all = cascade_reference(c, q64, kp, vp, tables, qo_last, rows, hq, d)
        check(c, o, None, ro_all, rl_all, "run %d (%d levels)" % (run, L))


def run_cuda_single(cc, kvattn):
    c, torch = cc.c, cc.torch
    hq, d = c["num_qo_heads"], c["head_dim_qk"]
    n = c["kv_lens"][0]
    k, v, k64, v64 = cc.ragged(n)
    kk, vv = cc.ref_kv(k64, v64)
    kw = dict(cc.feature_kw(), kv_layout=c["kv_layout"], return_lse=c["return_lse_single"], **cc.scale_kw())
    if c["op"] == "single_decode":
        q = cc.q((hq, d))
        res = kvattn.single_decode_with_kv_cache(q, k, v, **kw)
        q64 = cc.np64(q)[None]
        ro, rl = attention(q64, kk, vv, **ref_kw(c, causal=False))
        shape, what = (hq, d), "kv_len %d" % n
    else:
        qo = c["qo_lens"][0]
        q = cc.q((qo, hq, d))
        m = None
        if c["mask"] != "none":
            m = make_mask(cc.rng, c, qo, n)
            if c["mask"] == "custom":
                kw["custom_mask"] = torch.from_numpy(m if c["mask_2d"] else m.reshape(-1)).to(CUDA_DEV)
            else:
                kw["packed_custom_mask"] = torch.from_numpy(packed_segments([m])).to(CUDA_DEV)
        if c["o_dtype"] != c["q_dtype"]:
            kw["o_dtype"] = cc.tdt[c["o_dtype"]]
        res = kvattn.single_prefill_with_kv_cache(q, k, v, causal=c["causal"], **kw)
        ro, rl = attention(cc.np64(q), kk, vv, mask=m, **ref_kw(c, causal=c["causal"] and m is None))
        shape, what = (qo, hq, d), "qo_len %d, kv_len %d" % (qo, n)
    o, lse = res if c["return_lse_single"] else (res, None)
    torch.cuda.synchronize()
    assert o.device.type == CUDA_DEV and o.dtype == cc.tdt[c["o_dtype"]] and tuple(o.shape) == shape
    o = cc.np64(o)
    if lse is not None:
        assert lse.dtype == torch.float32 and tuple(lse.shape) == shape[:-1]
        lse = cc.np64(lse)
    if c["op"] == "single_decode":
        o = o[None]
        lse = None if lse is None else lse[None]
    check(c, o, lse, ro, rl, what)


CUDA_RUNNERS = {"decode": run_cuda_paged, "prefill_paged": run_cuda_paged, "prefill_ragged": run_cuda_ragged,
                "cascade": run_cuda_cascade, "single_decode": run_cuda_single, "single_prefill": run_cuda_single}


def _cuda_or_skip():
    torch = _torch_or_skip()
    if not torch.cuda.is_available():
        pytest.skip("CUDA is not available (torch.cuda.is_available() is False)")
    return torch


def _fp8_names(torch):
    return tuple(n for n in ("float8_e4m3fn", "float8_e5m2") if hasattr(torch, n))


@pytest.mark.parametrize("index,seed", CUDA_CASES, ids=["case%03d-seed%d" % cs for cs in CUDA_CASES])
def test_fuzz_api_torch_cuda(index, seed):
    """A case drawn within the CUDA backend's constraints (draw_cuda_case), with torch CUDA tensors, against the
    float64 reference of the rounded inputs."""
    torch = _cuda_or_skip()
    import kvattn
    c, rng = draw_cuda_case(seed, index, _fp8_names(torch))
    print("fuzz CUDA case %d (base seed %d) seed %d: %s" % (index, BASE_SEED, seed, describe_cuda(c)))
    print(replay_hint(c, "torch_cuda"))
    CUDA_RUNNERS[c["op"]](CudaCase(torch, c, rng), kvattn)


@pytest.mark.parametrize("index,seed", CUDA_GRAPH_CASES, ids=["case%03d-seed%d" % cs for cs in CUDA_GRAPH_CASES])
def test_fuzz_api_torch_cuda_graph(index, seed):
    """A use_cuda_graph=True decode wrapper: plan, eager run, capture run(out=, lse=) in a torch.cuda.CUDAGraph,
    then re-plan other lengths (same batch size and pool) and replay; every result against the reference."""
    torch = _cuda_or_skip()
    import kvattn
    rng = np.random.default_rng([seed, 0x6AF])
    B = int(rng.integers(2, 7))
    hkv = int(rng.integers(1, 5))
    g = int(rng.integers(1, 9))
    c = {"op": "decode", "index": index, "seed": seed, "num_kv_heads": hkv, "group": g, "num_qo_heads": hkv * g,
         "head_dim_qk": _pick(rng, CUDA_HEAD_DIMS), "kv_layout": _pick(rng, ["NHD", "HND"]),
         "q_dtype": _pick(rng, ["float16", "bfloat16"]), "page_size": _pick(rng, [1, 3, 16, 17]),
         "window_left": -1, "logits_soft_cap": None, "sm_scale": None, "pos_encoding_mode": "NONE",
         "rope_scale": None, "rope_theta": None, "enable_pdl": bool(rng.random() < 0.5)}
    c["head_dim_vo"] = c["head_dim_qk"]
    c["kv_dtype"] = c["o_dtype"] = c["q_dtype"]
    hq, d, ps = c["num_qo_heads"], c["head_dim_qk"], c["page_size"]
    max_len = 2048 if ps > 1 else 1200
    max_len = max(64, min(max_len, int(CUDA_COST_BUDGET // (hq * 2 * d * B))))
    lens_sets = [[int(x) for x in rng.integers(1, max_len + 1, B)] for _ in range(3)]
    lens_sets[1][0] = 0  # an empty request
    lens_sets[2] = [int(x) for x in rng.integers(1, 9, B)]  # all short
    c["lens_sets"] = lens_sets
    print("fuzz CUDA graph case %d (base seed %d) seed %d: %s" % (index, BASE_SEED, seed, describe_cuda(c)))
    print(replay_hint(c, "torch_cuda_graph"))
    P = B * (-(-max_len // ps)) + 3
    tdt = {"float16": torch.float16, "bfloat16": torch.bfloat16}[c["q_dtype"]]
    dev = CUDA_DEV
    bufs = (torch.zeros(B + 1, dtype=torch.int32, device=dev), torch.zeros(P, dtype=torch.int32, device=dev),
            torch.zeros(B, dtype=torch.int32, device=dev))
    w = kvattn.BatchDecodeWithPagedKVCacheWrapper(torch.zeros(64 << 20, dtype=torch.uint8, device=dev),
                                                  kv_layout=c["kv_layout"], use_cuda_graph=True,
                                                  paged_kv_indptr_buffer=bufs[0], paged_kv_indices_buffer=bufs[1],
                                                  paged_kv_last_page_len_buffer=bufs[2])
    shape = (P, 2, ps, hkv, d) if c["kv_layout"] == "NHD" else (P, 2, hkv, ps, d)
    cache = torch.from_numpy(rng.standard_normal(shape, dtype=np.float32)).to(dev).to(tdt)
    c64 = cache.float().cpu().numpy().astype(np.float64)
    q = torch.zeros(B, hq, d, device=dev, dtype=tdt)
    out = torch.empty(B, hq, d, device=dev, dtype=tdt)
    lse = torch.empty(B, hq, device=dev, dtype=torch.float32)

    def table(lens):
        pages = [(n + ps - 1) // ps for n in lens]
        indptr = np.concatenate([[0], np.cumsum(pages)]).astype(np.int32)
        indices = rng.permutation(P)[: indptr[-1]].astype(np.int32)
        last = np.array([((n - 1) % ps) + 1 if n else 1 for n in lens], np.int32)
        return indptr, indices, last

    def check_now(lens, t, what):
        q64 = q.float().cpu().numpy().astype(np.float64)
        o64 = out.float().cpu().numpy().astype(np.float64)
        l64 = lse.cpu().numpy().astype(np.float64)
        for b, n in enumerate(lens):
            k, v = gather_kv(c64[:, 0], c64[:, 1], t[0], t[1], b, n, c["kv_layout"])
            ro, rl = attention(q64[b:b + 1], k, v)
            check(c, o64[b:b + 1], l64[b:b + 1], ro, rl, "%s request %d (kv_len %d)" % (what, b, n))

    def new_q():
        q.copy_(torch.from_numpy(rng.standard_normal((B, hq, d), dtype=np.float32)).to(dev).to(tdt))

    t = table(lens_sets[0])
    w.plan(*t, hq, hkv, d, ps, q_data_type=tdt, kv_data_type=tdt)
    new_q()
    w.run(q, cache, out=out, lse=lse, enable_pdl=c["enable_pdl"])  # warm-up outside capture (pool size learnt)
    torch.cuda.synchronize()
    check_now(lens_sets[0], t, "eager")
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        w.run(q, cache, out=out, lse=lse, enable_pdl=c["enable_pdl"])
    for i, lens in enumerate(lens_sets[1:] + lens_sets[:1]):
        t = table(lens)
        w.plan(*t, hq, hkv, d, ps, q_data_type=tdt, kv_data_type=tdt)
        new_q()
        out.fill_(float("nan"))
        lse.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        check_now(lens, t, "replay %d after a re-plan" % i)


def summarize(cases):
    """Coverage of the drawn parameters (no library needed)."""
    from collections import Counter
    tally = Counter()
    for i, s in cases:
        c, _ = draw_case(s, i, log=lambda *_: None)
        op = c["op"]
        tally["op=" + op] += 1
        tally["layout=" + c["kv_layout"]] += 1
        tally["dtypes=%s/%s/%s" % (c["q_dtype"], c["kv_dtype"], c["o_dtype"])] += 1
        tally["head_dim_qk=%d" % c["head_dim_qk"]] += 1
        tally["group=%d" % c["group"]] += 1
        tally["num_kv_heads=%d" % c["num_kv_heads"]] += 1
        tally["pos=" + c["pos_encoding_mode"]] += 1
        if op in PAGED_OPS:
            tally["page_size=%d" % c["page_size"]] += 1
            tally["kv_form=" + c["kv_form"]] += 1
        if op in ("prefill_paged", "prefill_ragged", "single_prefill"):
            tally["mask=" + c["mask"]] += 1
            if c["head_dim_vo"] != c["head_dim_qk"]:
                tally["head_dim_vo!=qk (%s)" % op] += 1
        if op in ("prefill_paged", "prefill_ragged", "single_prefill", "cascade"):
            tally["causal=%s" % c["causal"]] += 1
            if any(q > n for q, n in zip(c["qo_lens"], c["kv_lens"])):
                tally["a request with qo_len > kv_len"] += 1
            if 0 in c["qo_lens"]:
                tally["a request with qo_len 0"] += 1
        if 0 in c["kv_lens"]:
            tally["a request with kv_len 0"] += 1
        if op == "cascade":
            tally["cascade levels=%d" % c["num_levels"]] += 1
        if op == "decode" and c["q_len_per_req"] > 1:
            tally["decode q_len_per_req>1"] += 1
        tally["window_left>=0" if c["window_left"] >= 0 else "window_left=-1"] += 1
        if c["logits_soft_cap"]:
            tally["logits_soft_cap"] += 1
        if c["sm_scale"] is not None:
            tally["sm_scale"] += 1
        if c["replan"]:
            tally["re-plan of the same wrapper (%s)" % op] += 1
        if c["companion"]:
            tally["companion wrapper on a shared workspace (%s)" % op] += 1
        if op in PAGED_OPS and c["shared_pages"]:
            tally["page tables sharing pages"] += 1
        if op in BATCH_OPS and c["out_guard"]:
            tally["out= / lse= views in a guard band"] += 1
        if c.get("graph"):
            tally["decode use_cuda_graph=True"] += 1
        if c["q_mag"] >= 8:
            tally["|q| x8 / x20 (peaked softmax)"] += 1
        if op in PAGED_OPS and c["kv_form"].endswith("_padded"):
            tally["padded pool strides"] += 1
        if op in BATCH_OPS:
            for m in c["out_modes"]:
                tally["out_mode=" + m] += 1
            tally["split=%s" % (c["split"][0] if c["split"] else None)] += 1
    return tally


if __name__ == "__main__":  # python3 test_fuzz_api.py: the drawn cases and their coverage
    for i, s in CASES:
        c, _ = draw_case(s, i, log=lambda *_: None)
        print("case %d seed %d: %s" % (i, s, describe(c)))
    for key, n in sorted(summarize(CASES).items()):
        print("%6d  %s" % (n, key))
    sys.exit(0)
