"""kernels/norm_rope_insert.py: host validation, rotary dims whose half is odd, layouts,
scales, guarded slots and N = 0, judged by the oracle (oracle.core.checks.run_check) against the
reference. Runs the kernel in the (patched) CPU interpreter when no CUDA device is present
(conftest.py sets TRITON_INTERPRET=1), compiled on a GPU otherwise.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kernels import norm_rope_insert as nri
from oracle.core.cases import Case, poison_code
from oracle.core.checks import run_check
from oracle.core.registry import implementations
from oracle.impls.torch_peer import HALF_DTYPES, device
from oracle.impls.triton import run_norm_rope_insert as run_insert
from reference.codec import round_to
from reference.domain import MODEL
from reference.kv_cache import empty_cache, empty_index_cache
from reference.norm_rope import QKVLayout, rope_table
from tests.helpers import bad_args

pytestmark = pytest.mark.interp

MAX_POS = 64


def _round(values, md):
    return round_to(values, md)


def make_case_inputs(d=64, r=64, kv_fmt="bfloat16", layout="HND", pad=0, scales="none",
                     dense=False, n=5, hkv=2, group=2, page=16, md="bfloat16", seed=0,
                     slots=None):
    """An oracle input set of op norm_rope_insert (oracle.core.cases' keys), built by hand so D,
    R, the cache layout and the scales can be chosen."""
    bg = np.random.default_rng(seed)
    hi = 0 if dense else hkv
    lay = QKVLayout(group * hkv, hkv, d, num_index_heads=hi, has_index_k=not dense)
    num_pages = -(-n // page) + 2
    num_slots = num_pages * page
    if slots is None:
        slots = bg.permutation(num_slots)[:n].astype(np.int64)
        slots[::4] = -1  # padding tokens are skipped
    width = lay.row_width
    rows = _round(bg.normal(size=(n, width + 16)), md)[:, 8:8 + width]
    fp8 = kv_fmt not in ("bfloat16", "float16")
    index_fmt = None if dense else ({"e4m3fnuz": "e4m3fnuz", "e5m2fnuz": "e4m3fnuz"}.get(
        kv_fmt, "e4m3fn") if fp8 else md)

    def scale():
        if scales == "none":
            return None
        if scales == "tensor":
            return np.float32(0.37)
        return np.exp(bg.uniform(np.log(0.25), np.log(4.0), (hkv, num_slots))).astype(np.float32)

    x = dict(
        slot_mapping=np.asarray(slots, np.int64), model_dtype=md, kv_fmt=kv_fmt,
        kv_cache=empty_cache(num_pages, hkv, page, d, kv_fmt, layout, pad,
                             fill_code=poison_code(kv_fmt)),
        cache_layout=layout, k_scale=scale(), v_scale=scale(), rows=rows,
        positions=bg.integers(0, MAX_POS, n).astype(np.int64), num_q_heads=group * hkv,
        num_kv_heads=hkv, head_dim=d, num_index_heads=hi, has_index_k=not dense,
        rotary_dim=r, eps=MODEL.eps, rope_table=rope_table(MAX_POS, r, MODEL.rope_base, md),
        index_cache=None if dense else empty_index_cache(num_pages, page, d, index_fmt,
                                                         fill_code=poison_code(index_fmt)),
        index_fmt=index_fmt)
    for kind in ("q", "k", "index_q", "index_k"):
        x[f"weights_{kind}"] = _round(0.3 * bg.normal(size=d), md)
    return x


def _case(x):
    kv = {"bfloat16": "auto", "float16": "float16", "e4m3fn": "fp8", "e4m3fnuz": "fp8",
          "e5m2": "fp8_e5m2", "e5m2fnuz": "fp8_e5m2"}[x["kv_fmt"]]
    plat = "rocm-fnuz" if "fnuz" in x["kv_fmt"] else "cuda"
    sc = "none" if x["k_scale"] is None else ("tensor" if np.ndim(x["k_scale"]) == 0 else "slot")
    md = x["model_dtype"] if kv == "auto" else "bfloat16"
    return Case("norm_rope_insert", "tiny", "normal", plat, kv, md, sc, 0)


def _impl():
    (impl,) = implementations("norm_rope_insert", ["triton"])
    return impl


@pytest.mark.parametrize("r, d, kv_fmt, layout, pad, scales, dense", [
    (6, 64, "e4m3fn", "NHD", 0, "slot", False),
    (10, 64, "bfloat16", "HND", 8, "none", False),
    (126, 128, "e4m3fnuz", "HND", 8, "tensor", False),
    (2, 64, "e5m2fnuz", "NHD", 8, "slot", False),
    (62, 64, "e5m2", "HND", 0, "tensor", True),
    (64, 64, "float16", "NHD", 0, "none", False),
])
def test_any_even_rotary_dim_matches_reference(r, d, kv_fmt, layout, pad, scales, dense):
    """Rotary dims whose half is odd (R = 6, 10, 126, 62, 2: not a power of two) and full
    R = D give outputs and cache writes the oracle admits, for every cache format, HND/NHD
    and padded layouts, none/tensor/per-slot scales, indexed and dense rows."""
    md = "float16" if kv_fmt == "float16" else "bfloat16"
    x = make_case_inputs(d=d, r=r, kv_fmt=kv_fmt, layout=layout, pad=pad, scales=scales,
                         dense=dense, md=md, seed=r)
    res = run_check(_case(x), _impl(), inputs=x)
    assert res.passed, res.summary()


def test_out_of_range_slots_and_positions_are_guarded():
    """A slot past the cache or a position past the table reads/writes nothing out of
    bounds: such slots are skipped (the caches elsewhere are untouched) and the run does not
    crash; in-range tokens are still correct."""
    x = make_case_inputs(kv_fmt="e4m3fn", n=4, seed=3)
    num_slots = x["kv_cache"].shape[0] * x["kv_cache"].shape[2]
    x["slot_mapping"] = np.array([3, num_slots + 5, -1, 7], np.int64)
    x["positions"] = np.array([1, MAX_POS + 3, -2, 5], np.int64)
    out = run_insert(x, validate=False)
    before, after = x["kv_cache"], out["kv_cache"]
    page = before.shape[2]
    mask = np.ones(before.shape, bool)
    for s in (3, 7):
        mask[s // page, :, s % page] = False
    assert np.array_equal(after[mask], before[mask])
    good = make_case_inputs(kv_fmt="e4m3fn", n=4, seed=3, slots=[3, -1, -1, 7])
    good["positions"] = np.array([1, 0, 0, 5], np.int64)
    res = run_check(_case(good), _impl(), inputs=good)
    assert res.passed, res.summary()


def test_no_tokens_is_a_no_op():
    """N = 0: no launch, both caches unchanged, empty outputs of the right shapes."""
    x = make_case_inputs(kv_fmt="e4m3fn", n=0, seed=1, slots=np.zeros(0, np.int64))
    out = _impl().run(x)
    assert np.array_equal(out["kv_cache"], x["kv_cache"])
    assert np.array_equal(out["index_cache"], x["index_cache"])
    assert out["q"].shape == (0, 4, 64) and out["index_k"].shape == (0, 64)
    res = run_check(_case(x), _impl(), inputs=x)
    assert res.passed, res.summary()


# ------------------------------------------------------------------ host validation


def _good_args(kv_fmt="e4m3fn", r=8):
    dev = device()
    act = torch.bfloat16
    n, hq, hkv, hi, d, page, pages = 3, 2, 1, 1, 64, 16, 2
    width = (hq + 2 * hkv + hi + 1) * d
    fp8 = kv_fmt not in HALF_DTYPES
    kv_dtype = torch.uint8 if fp8 else HALF_DTYPES[kv_fmt]
    return dict(
        rows=torch.randn(n, width).to(act).to(dev),
        positions=torch.arange(n, dtype=torch.int64, device=dev),
        rope_table=torch.ones(16, r, dtype=act, device=dev),
        w_q=torch.zeros(d, dtype=act, device=dev), w_k=torch.zeros(d, dtype=act, device=dev),
        w_index_q=torch.zeros(d, dtype=act, device=dev),
        w_index_k=torch.zeros(d, dtype=act, device=dev),
        num_q_heads=hq, num_kv_heads=hkv, num_index_heads=hi, has_index_k=True, head_dim=d,
        rotary_dim=r, eps=1e-6,
        kv_cache=torch.zeros(pages, hkv, page, 2 * d, dtype=kv_dtype, device=dev),
        kv_fmt=kv_fmt, slot_mapping=torch.tensor([0, 5, -1], device=dev),
        index_cache=torch.zeros(pages, page, d, dtype=torch.uint8 if fp8 else act, device=dev),
        index_fmt="e4m3fn" if fp8 else "bfloat16")


def _bad(name, **changes):
    return bad_args(_good_args, name, **changes)


@pytest.mark.parametrize("make, name", [
    _bad("rows", rows=lambda a: a["rows"].float()),
    _bad("rows", rows=lambda a: a["rows"][:, :-2]),
    _bad("positions", positions=lambda a: a["positions"].float()),
    _bad("rotary_dim", rotary_dim=7),
    _bad("rotary_dim", rotary_dim=66, rope_table=lambda a: a["rope_table"].new_ones(16, 66)),
    _bad("rotary_dim", rotary_dim=0),
    _bad("rope_table", rope_table=lambda a: a["rope_table"].half()),
    _bad("w_k", w_k=lambda a: a["w_k"][:32]),
    _bad("head_dim", head_dim=96),
    _bad("kv_cache", kv_cache=lambda a: a["kv_cache"].to(torch.bfloat16)),
    _bad("kv_cache", kv_cache=lambda a: a["kv_cache"][..., :64]),
    _bad("kv_fmt", kv_fmt="e4m3"),
    _bad("kv_fmt", kv_fmt="fp8"),
    _bad("slot_mapping", slot_mapping=lambda a: a["slot_mapping"].float()),
    _bad("slot_mapping", slot_mapping=lambda a: a["slot_mapping"][:2]),
    _bad("k_scale", k_scale=lambda a: torch.ones(3, device=a["rows"].device)),
    _bad("v_scale", v_scale=lambda a: torch.ones(1, 32, dtype=torch.float64,
                                                 device=a["rows"].device)),
    _bad("index_fmt", index_fmt="e5m2"),
    _bad("index_fmt", index_fmt="int8"),
    _bad("index_cache", index_cache=lambda a: a["index_cache"].to(torch.bfloat16)),
    _bad("index_cache", index_cache=None),
    _bad("num_q_heads", num_q_heads=3, num_kv_heads=2),
    _bad("eps", eps=float("nan")),
    _bad("block_h", block_h=3),
    _bad("programs", programs=0),
    _bad("max_registers", max_registers=-1),
    _bad("max_registers", max_registers=300),
])
def test_bad_host_input_raises_value_error_naming_it(make, name):
    """Wrong dtypes, shapes, odd or too large R, wrong cache dtypes, unknown format
    strings and out-of-range launch knobs raise ValueError whose message starts with the
    argument's name, before any launch (the caches are left untouched)."""
    args = make()
    kv_before = args["kv_cache"].clone()
    with pytest.raises(ValueError, match=rf"^{name}\b"):
        nri.norm_rope_insert(**args)
    assert torch.equal(args["kv_cache"], kv_before)


def test_good_host_input_runs():
    """The valid baseline of the validation tests runs and writes the used slots only."""
    args = _good_args()
    out = nri.norm_rope_insert(**args)
    assert out["q"].shape == (3, 2, 64) and out["index_q"].dtype == torch.uint8
    kv = args["kv_cache"]
    assert kv[0, 0, 0].any() and kv[0, 0, 5].any() and not kv[1].any()


def test_model_dtype_cache_rejects_a_scale():
    """A bf16/fp16 cache takes no (non-unit) scale: ValueError naming k_scale."""
    args = _good_args(kv_fmt="bfloat16")
    with pytest.raises(ValueError, match=r"^k_scale\b"):
        nri.norm_rope_insert(**args, k_scale=0.5)


def test_registered_for_cpu_and_cuda():
    """The kernel is registered as implementation "triton" of norm_rope_insert, quantising K
    from its fp32 value; model shapes only when compiled (not interpreted)."""
    impl = _impl()
    assert impl.devices == ("cpu", "cuda") and impl.quantize_from == "value"
    assert ("model" in impl.shape_classes) == (not nri.INTERPRETED)


def test_index_slot_mapping_is_its_own():
    """index_k goes to the index cache at index_slot_mapping (not slot_mapping); with a
    model-dtype index cache the stored bits are exactly the index_k output; negative index
    slots are skipped and nothing else in the index cache changes."""
    args = _good_args(kv_fmt="bfloat16")
    dev = args["rows"].device
    ic = args["index_cache"].fill_(float("nan"))
    islots = torch.tensor([17, -1, 2], device=dev)
    out = nri.norm_rope_insert(**args, index_slot_mapping=islots)
    flat = ic.view(-1, ic.shape[-1]).view(torch.int16)
    ik = out["index_k"].view(torch.int16)
    assert torch.equal(flat[17], ik[0]) and torch.equal(flat[2], ik[2])
    others = torch.ones(flat.shape[0], dtype=torch.bool, device=dev)
    others[[17, 2]] = False
    assert torch.isnan(ic.view(-1, ic.shape[-1])[others]).all()


# ------------------------------------------------------- in place, skip_index, validate


def _bits(t):
    return t.contiguous().view(torch.int16 if t.dtype != torch.uint8 else torch.uint8)


def test_in_place_writes_transformed_heads_into_the_rows_and_leaves_v():
    """Without q_out, q, k, index_q (model-dtype index cache) and index_k are written back
    into the row columns they came from (the returned tensors are views of rows); v is
    untouched; the values are bit-identical to a run writing q to a separate output."""
    a = _good_args(kv_fmt="bfloat16")
    rows0 = a["rows"].clone()
    b = _good_args(kv_fmt="bfloat16")
    b["rows"] = rows0.clone()
    q_out = torch.empty(2, 3, 64, dtype=torch.bfloat16, device=rows0.device).transpose(0, 1)
    out_in = nri.norm_rope_insert(**a)
    out_sep = nri.norm_rope_insert(**b, q_out=q_out)
    base, end = a["rows"].data_ptr(), a["rows"].data_ptr() + a["rows"].nbytes
    for key in ("q", "k", "index_q", "index_k"):
        if key == "index_q" and out_in[key].dtype == torch.uint8:
            continue
        assert base <= out_in[key].data_ptr() < end, key
        assert torch.equal(_bits(out_in[key]), _bits(out_sep[key])), key
    d, hq, hkv = 64, 2, 1
    v = slice((hq + hkv) * d, (hq + 2 * hkv) * d)
    assert torch.equal(_bits(a["rows"][:, v]), _bits(rows0[:, v]))
    assert torch.equal(_bits(b["rows"][:, :hq * d]), _bits(rows0[:, :hq * d]))  # q_out run
    assert not torch.equal(_bits(a["rows"][:, :hq * d]), _bits(rows0[:, :hq * d]))


def test_skip_index_leaves_index_heads_and_cache_alone():
    """skip_index=True transforms and inserts q, k, v exactly as a full run does, and leaves
    the index_q / index_k columns of the rows and the index cache untouched."""
    a, b = _good_args(), _good_args()
    b["rows"] = a["rows"].clone()
    rows0, ic0 = a["rows"].clone(), a["index_cache"].clone()
    full = nri.norm_rope_insert(**a)
    skip = nri.norm_rope_insert(**b, skip_index=True)
    assert set(skip) == {"q", "k"}
    for key in ("q", "k"):
        assert torch.equal(_bits(full[key]), _bits(skip[key])), key
    assert torch.equal(a["kv_cache"], b["kv_cache"])
    assert torch.equal(b["index_cache"], ic0)
    idx = slice(4 * 64, 6 * 64)
    assert torch.equal(_bits(b["rows"][:, idx]), _bits(rows0[:, idx]))


@pytest.mark.parametrize("name, change", [
    ("slot_mapping", lambda a: {"slot_mapping": a["slot_mapping"].new_tensor([0, 32, -1])}),
    ("slot_mapping", lambda a: {"slot_mapping": a["slot_mapping"].new_tensor([4, 4, -1])}),
    ("index_slot_mapping",
     lambda a: {"index_slot_mapping": a["slot_mapping"].new_tensor([1, 99, 2])}),
    ("positions", lambda a: {"positions": a["positions"].new_tensor([0, 16, 1])}),
    ("positions", lambda a: {"positions": a["positions"].new_tensor([0, -1, 1])}),
    ("k_scale", lambda a: {"k_scale": -1.0}),
    ("v_scale", lambda a: {"v_scale": float("inf")}),
])
def test_validate_rejects_bad_contents_before_launch(name, change):
    """validate=True reads the contents back: a slot past the cache, a repeated slot, a
    position outside the table or a non-positive / non-finite scale raises ValueError
    naming the argument, and the caches are untouched."""
    a = _good_args()
    a.update(change(a))
    kv0, ic0 = a["kv_cache"].clone(), a["index_cache"].clone()
    with pytest.raises(ValueError, match=rf"^{name}\b"):
        nri.norm_rope_insert(**a, validate=True)
    assert torch.equal(a["kv_cache"], kv0) and torch.equal(a["index_cache"], ic0)


@pytest.mark.gpu
@pytest.mark.parametrize("kv_fmt, scales", [("e4m3fn", "slot"), ("bfloat16", "none"),
                                            ("e5m2fnuz", "tensor")])
def test_16384_tokens_match_reference(kv_fmt, scales):
    """The top of the token range (N = 16,384, more programs than any grid axis-0 tile of
    the small cases, slots spread over 1,026 pages) is admitted by the oracle for a native
    fp8, a model-dtype and an emulated fnuz cache."""
    x = make_case_inputs(d=64, r=36, kv_fmt=kv_fmt, scales=scales, n=16384, hkv=2, group=2,
                         seed=16384)
    res = run_check(_case(x), _impl(), inputs=x)
    assert res.passed, res.summary()


@pytest.mark.parametrize("kv_cache_dtype, plat, kv_fmt", [
    ("fp8", "cuda", "e4m3fn"), ("fp8_e5m2", "cuda", "e5m2"), ("fp8", "rocm-fnuz", "e4m3fnuz"),
    ("fp8_e5m2", "rocm-fnuz", "e5m2fnuz"), ("auto", "cuda", "bfloat16")])
def test_kv_cache_dtype_and_platform_choose_the_format(kv_cache_dtype, plat, kv_fmt):
    """vLLM's kv_cache_dtype string read on a platform selects the same storage format as
    naming it: the cache bytes and outputs are identical to an explicit kv_fmt run (and the
    index format follows the platform's e4m3)."""
    a, b = _good_args(kv_fmt=kv_fmt), _good_args(kv_fmt=kv_fmt)
    b["rows"] = a["rows"].clone()
    del a["index_fmt"], b["kv_fmt"], b["index_fmt"]
    a_out = nri.norm_rope_insert(**a, index_fmt=None if kv_fmt == "bfloat16" else
                                 ("e4m3fnuz" if "fnuz" in kv_fmt else "e4m3fn"))
    b_out = nri.norm_rope_insert(**b, kv_cache_dtype=kv_cache_dtype, platform=plat)
    assert torch.equal(a["kv_cache"].view(torch.uint8), b["kv_cache"].view(torch.uint8))
    assert torch.equal(a["index_cache"].view(torch.uint8), b["index_cache"].view(torch.uint8))
    assert torch.equal(_bits(a_out["index_q"]), _bits(b_out["index_q"]))


def test_kv_cache_dtype_errors_name_the_argument():
    """An unknown kv_cache_dtype or platform, or both kv_fmt and kv_cache_dtype, raise
    ValueError naming the argument."""
    a = _good_args()
    for kw, name in (({"kv_cache_dtype": "fp8_e4m3fnuz", "kv_fmt": None}, "kv_cache_dtype"),
                     ({"kv_cache_dtype": "fp8", "platform": "tpu", "kv_fmt": None}, "platform"),
                     ({"kv_cache_dtype": "fp8"}, "kv_fmt")):
        with pytest.raises(ValueError, match=rf"^{name}\b"):
            nri.norm_rope_insert(**{**a, **kw})


@pytest.mark.parametrize("knobs", [dict(block_h=1, programs=1), dict(block_h=2, programs=3),
                                   dict(block_h=4, programs=1000, num_stages=2)])
def test_launch_knobs_do_not_change_results(knobs):
    """The tuning knobs (heads per work item, persistent programs, pipeline depth) change
    only speed: rows, caches and index_q are bit-identical to the default launch, whether a
    program strides over many work items or over none."""
    a, b = _good_args(), _good_args()
    b["rows"] = a["rows"].clone()
    out_a = nri.norm_rope_insert(**a)
    out_b = nri.norm_rope_insert(**b, **knobs)
    assert torch.equal(_bits(a["rows"]), _bits(b["rows"]))
    assert torch.equal(a["kv_cache"], b["kv_cache"])
    assert torch.equal(a["index_cache"], b["index_cache"])
    assert torch.equal(out_a["index_q"], out_b["index_q"])
