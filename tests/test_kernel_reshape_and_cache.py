"""kernels/reshape_and_cache.py: every cache format, layouts, scales, special values,
guarded slots, N = 0 and host validation, judged by the oracle (oracle.core.checks.run_check)
against the reference. Runs the kernel in the (patched) CPU interpreter when no CUDA device
is present (conftest.py sets TRITON_INTERPRET=1), compiled on a GPU otherwise.
"""

from __future__ import annotations

import functools

import numpy as np
import pytest
import torch

from kernels import reshape_and_cache as rc
from oracle.core.cases import Case, poison_code
from oracle.core.checks import run_check
from oracle.core.registry import implementations
from oracle.impls.torch_peer import HALF_DTYPES, device
from oracle.impls.triton import run_reshape_and_cache as run_reshape
from reference.codec import round_to
from reference.kv_cache import empty_cache
from tests.helpers import bad_args

pytestmark = pytest.mark.interp

SPECIALS = (-0.0, np.inf, -np.inf, np.nan)


def make_rc_inputs(kv_fmt="bfloat16", layout="HND", pad=0, scales="none", md="bfloat16",
                   n=6, hkv=2, d=64, page=16, seed=0, slots=None, specials=True):
    """An oracle input set of op reshape_and_cache (oracle.core.cases' keys), built by hand so the
    cache layout, the scales and special values in K and V can be chosen. Every third token
    is padding (slot -1); with ``specials`` K and V hold -0, +-Inf and NaN."""
    bg = np.random.default_rng(seed)
    num_pages = -(-n // page) + 2
    num_slots = num_pages * page
    if slots is None:
        slots = bg.permutation(num_slots)[:n].astype(np.int64)
        slots[::3] = -1
    k = 3.0 * bg.normal(size=(n, hkv, d))
    v = 3.0 * bg.normal(size=(n, hkv, d))
    if specials and n:
        for a in (k, v):
            flat = a.reshape(-1)
            at = bg.choice(flat.size, size=4 * len(SPECIALS), replace=False)
            flat[at] = np.repeat(SPECIALS, 4)
    if kv_fmt != md:  # values near and past the cache format's max too
        k[..., 1] *= 1e4
        v[..., 2] *= 1e4

    def scale():
        if scales == "none":
            return None
        if scales == "tensor":
            return np.float32(0.37)
        return np.exp(bg.uniform(np.log(0.25), np.log(4.0), (hkv, num_slots))).astype(np.float32)

    return dict(
        slot_mapping=np.asarray(slots, np.int64), model_dtype=md, kv_fmt=kv_fmt,
        kv_cache=empty_cache(num_pages, hkv, page, d, kv_fmt, layout, pad,
                             fill_code=poison_code(kv_fmt)),
        cache_layout=layout, k_scale=scale(), v_scale=scale(),
        k=round_to(k, md), v=round_to(v, md))


def _case(x):
    kv = {"bfloat16": "auto", "float16": "float16", "e4m3fn": "fp8", "e4m3fnuz": "fp8",
          "e5m2": "fp8_e5m2", "e5m2fnuz": "fp8_e5m2"}[x["kv_fmt"]]
    plat = "rocm-fnuz" if "fnuz" in x["kv_fmt"] else "cuda"
    sc = "none" if x["k_scale"] is None else ("tensor" if np.ndim(x["k_scale"]) == 0 else "slot")
    return Case("reshape_and_cache", "tiny", "normal", plat, kv, x["model_dtype"], sc, 0)


def _impl():
    (impl,) = implementations("reshape_and_cache", ["triton"])
    return impl


def _passes(x):
    res = run_check(_case(x), _impl(), inputs=x)
    assert res.passed, res.summary()


@pytest.mark.parametrize("kv_fmt, layout, pad, scales, md", [
    ("bfloat16", "HND", 0, "none", "bfloat16"),
    ("float16", "NHD", 8, "none", "float16"),
    ("float16", "HND", 8, "none", "bfloat16"),
    ("bfloat16", "NHD", 0, "none", "float16"),
    ("e4m3fn", "NHD", 0, "slot", "bfloat16"),
    ("e4m3fn", "HND", 8, "tensor", "float16"),
    ("e5m2", "HND", 8, "none", "bfloat16"),
    ("e5m2", "NHD", 0, "slot", "float16"),
    ("e4m3fnuz", "HND", 0, "slot", "bfloat16"),
    ("e4m3fnuz", "NHD", 8, "none", "float16"),
    ("e5m2fnuz", "NHD", 8, "tensor", "bfloat16"),
    ("e5m2fnuz", "HND", 0, "slot", "bfloat16"),
])
def test_every_format_layout_and_scale_matches_reference(kv_fmt, layout, pad, scales, md):
    """For every cache format (bf16, fp16 -- also from the other model dtype -- and the
    four fp8 formats), HND/NHD and padded layouts and none/tensor/per-slot scales, with K
    and V holding -0, +-Inf, NaN and values past the cache format's max, the cache codes
    are the (satfinite for fp8) rounding of value / scale the oracle admits, padding
    tokens (slot -1) write nothing and no other slot changes."""
    _passes(make_rc_inputs(kv_fmt=kv_fmt, layout=layout, pad=pad, scales=scales, md=md,
                           seed=len(kv_fmt) + pad))


@pytest.mark.parametrize("block_h", [1, 2, 4])
def test_head_blocks_smaller_than_hkv(block_h, monkeypatch):
    """Hkv = 3 (not a power of two) split over several head blocks per token (grid axis 1)
    writes every head exactly once, with D = 128 and P = 32."""
    x = make_rc_inputs(kv_fmt="e4m3fn", hkv=3, d=128, page=32, n=5, scales="slot", seed=7)
    monkeypatch.setattr(rc, "reshape_and_cache",
                        functools.partial(rc.reshape_and_cache, block_h=block_h))
    _passes(x)


def _with_run(out):
    """The registered implementation with a precomputed output (for run_check)."""
    from dataclasses import replace

    return replace(_impl(), run=lambda _x: out)


def test_model_dtype_cache_copies_bits_exactly():
    """A bf16/fp16 cache receives K and V bit for bit: -0, +-Inf, subnormals and NaNs with
    any sign and payload arrive unchanged (bits are moved, not converted)."""
    dev = device()
    bits = torch.tensor([0x8000, 0x7F80, 0xFF80, 0x7FC1, 0xFFFF, 0x0001, 0x8001, 0x3F80],
                        dtype=torch.int32)
    for act in (torch.bfloat16, torch.float16):
        pattern = bits.to(torch.int16).repeat(16)  # D = 128 lanes
        k = pattern.view(1, 1, 128).to(dev).view(act)
        v = pattern.flip(0).view(1, 1, 128).to(dev).view(act)
        cache = torch.zeros(2, 1, 16, 256, dtype=act, device=dev)
        name = "bfloat16" if act == torch.bfloat16 else "float16"
        rc.reshape_and_cache(k, v, cache, name, torch.tensor([19], device=dev))
        row = cache.view(torch.int16)[1, 0, 3]
        assert torch.equal(row[:128], k.view(torch.int16)[0, 0])
        assert torch.equal(row[128:], v.view(torch.int16)[0, 0])
        assert int(torch.count_nonzero(cache.view(torch.int16))) == int(
            torch.count_nonzero(row))


def test_strided_slot_mapping_is_read_through_its_stride():
    """A non-contiguous slot_mapping (every other entry of a wider tensor) is read through
    its stride, not as if it were contiguous."""
    x = make_rc_inputs(kv_fmt="e5m2", n=4, seed=11, slots=[5, -1, 20, 33])
    dev = device()
    act = HALF_DTYPES[x["model_dtype"]]
    wide = torch.tensor([5, 99, -1, 99, 20, 99, 33, 99], device=dev)[::2]
    kv = torch.from_numpy(np.ascontiguousarray(x["kv_cache"])).to(dev)
    k = torch.from_numpy(x["k"]).to(act).to(dev)
    v = torch.from_numpy(x["v"]).to(act).to(dev)
    rc.reshape_and_cache(k, v, kv, "e5m2", wide)
    res = run_check(_case(x), _with_run({"kv_cache": kv.cpu().numpy()}), inputs=x)
    assert res.passed, res.summary()


def test_out_of_range_slots_are_guarded():
    """With validate=False a slot past the cache writes nothing (and does not crash); the
    other tokens are written and nothing else in the cache changes."""
    x = make_rc_inputs(kv_fmt="e4m3fnuz", n=4, seed=3, slots=[3, 10**6, -1, 7])
    num_slots = x["kv_cache"].shape[0] * x["kv_cache"].shape[2]
    x["slot_mapping"][1] = num_slots  # the first slot past the end
    out = run_reshape(x, validate=False)
    before, after = x["kv_cache"], out["kv_cache"]
    page = before.shape[2]
    mask = np.ones(before.shape, bool)
    for s in (3, 7):
        mask[s // page, :, s % page] = False
    assert np.array_equal(after[mask], before[mask])
    good = dict(x, slot_mapping=np.array([3, -1, -1, 7], np.int64))
    res = run_check(_case(good), _with_run(out), inputs=good)
    assert res.passed, res.summary()


def test_no_tokens_is_a_no_op(monkeypatch):
    """N = 0: nothing is launched and the cache is unchanged (the oracle agrees)."""
    x = make_rc_inputs(kv_fmt="e4m3fn", n=0, seed=1, slots=np.zeros(0, np.int64))

    class NoLaunch:
        def __getitem__(self, grid):
            raise AssertionError("launched for N = 0")

    monkeypatch.setattr(rc, "_reshape_and_cache_kernel", NoLaunch())
    out = run_reshape(x)
    assert np.array_equal(out["kv_cache"], x["kv_cache"])
    _passes(x)


# ------------------------------------------------------------------ host validation


def _good_args(kv_fmt="e4m3fn"):
    dev = device()
    act = torch.bfloat16
    n, hkv, d, page, pages = 3, 2, 64, 16, 2
    fp8 = kv_fmt not in HALF_DTYPES
    return dict(
        k=torch.randn(n, hkv, d).to(act).to(dev), v=torch.randn(n, hkv, d).to(act).to(dev),
        kv_cache=torch.zeros(pages, hkv, page, 2 * d,
                             dtype=torch.uint8 if fp8 else HALF_DTYPES[kv_fmt], device=dev),
        kv_fmt=kv_fmt, slot_mapping=torch.tensor([0, 5, -1], device=dev))


def _bad(name, **changes):
    return bad_args(_good_args, name, **changes)


@pytest.mark.parametrize("make, name", [
    _bad("k", k=lambda a: a["k"].float()),
    _bad("k", k=lambda a: a["k"][0]),
    _bad("k", k=lambda a: a["k"][..., :48], v=lambda a: a["v"][..., :48]),
    _bad("k", k=lambda a: a["k"].transpose(1, 2).contiguous().transpose(1, 2)),
    _bad("k", k=[[0.0]]),
    _bad("v", v=lambda a: a["v"].half()),
    _bad("v", v=lambda a: a["v"][:2]),
    _bad("v", v=lambda a: a["v"].transpose(1, 2).contiguous().transpose(1, 2)),
    _bad("kv_cache", kv_cache=lambda a: a["kv_cache"].to(torch.bfloat16)),
    _bad("kv_cache", kv_cache=lambda a: a["kv_cache"][..., :64]),
    _bad("kv_cache", kv_cache=lambda a: a["kv_cache"][:, :1]),
    _bad("kv_cache", kv_cache=lambda a: a["kv_cache"].new_zeros(2, 2, 24, 128)),
    _bad("kv_cache", kv_cache=lambda a: a["kv_cache"].new_zeros(2, 2, 16, 128, 2)[..., 0]),
    _bad("kv_fmt", kv_fmt="e4m3"),
    _bad("kv_fmt", kv_fmt="fp8"),
    _bad("slot_mapping", slot_mapping=lambda a: a["slot_mapping"].float()),
    _bad("slot_mapping", slot_mapping=lambda a: a["slot_mapping"][:2]),
    _bad("k_scale", k_scale=lambda a: torch.ones(3, device=a["k"].device)),
    _bad("k_scale", k_scale=lambda a: torch.ones((), dtype=torch.float64, device=a["k"].device)),
    _bad("v_scale", v_scale=lambda a: torch.ones(1, 32, device=a["k"].device)),
    _bad("block_h", block_h=3),
    _bad("block_h", block_h=0),
])
def test_bad_host_input_raises_value_error_naming_it(make, name):
    """Wrong dtypes, shapes, head dims, strides, cache dtypes, unknown or mismatched format
    strings, bad scales and block sizes raise ValueError whose message starts with the
    argument's name, before any launch (the cache is left untouched)."""
    args = make()
    kv_before = args["kv_cache"].clone()
    with pytest.raises(ValueError, match=rf"^{name}\b"):
        rc.reshape_and_cache(**args)
    assert torch.equal(args["kv_cache"], kv_before)


def test_model_dtype_cache_rejects_a_scale():
    """A bf16/fp16 cache takes no (non-unit) scale: ValueError naming k_scale / v_scale."""
    args = _good_args(kv_fmt="bfloat16")
    with pytest.raises(ValueError, match=r"^k_scale\b"):
        rc.reshape_and_cache(**args, k_scale=0.5)
    with pytest.raises(ValueError, match=r"^v_scale\b"):
        rc.reshape_and_cache(**args, v_scale=torch.full((), 2.0, device=device()))


@pytest.mark.parametrize("slots, scale, match", [
    ([0, 32, -1], None, r"^slot_mapping\b.*slots in \[0, 31\]"),
    ([4, -1, 4], None, r"^slot_mapping\b.*repeat"),
    ([0, 5, -1], 0.0, r"^k_scale\b.*positive finite"),
    ([0, 5, -1], float("inf"), r"^k_scale\b.*positive finite"),
])
def test_validate_rejects_bad_contents(slots, scale, match):
    """validate=True checks contents on the host: a slot past the cache, a repeated
    non-negative slot, or a zero / non-finite scale raise ValueError naming the argument,
    and nothing is written."""
    args = _good_args()
    args["slot_mapping"] = torch.tensor(slots, device=device())
    with pytest.raises(ValueError, match=match):
        rc.reshape_and_cache(**args, k_scale=scale, validate=True)
    assert not args["kv_cache"].any()


def test_good_host_input_runs():
    """The valid baseline of the validation tests runs (also with validate=True), writes
    the used slots only, and returns the cache."""
    args = _good_args()
    out = rc.reshape_and_cache(**args, validate=True)
    kv = args["kv_cache"]
    assert out is kv
    assert kv[0, :, 0].any() and kv[0, :, 5].any()
    mask = torch.ones(kv.shape[:3], dtype=torch.bool, device=kv.device)
    mask[0, :, 0] = mask[0, :, 5] = False
    assert not kv[mask].any()


def test_registered_for_cpu_and_cuda():
    """The kernel is registered as implementation "triton" of reshape_and_cache, quantising
    K from its model-dtype value; model shapes only when compiled (not interpreted)."""
    impl = _impl()
    assert impl.devices == ("cpu", "cuda") and impl.quantize_from == "model_dtype"
    assert ("model" in impl.shape_classes) == (not rc.INTERPRETED)
