"""The plain torch baseline (oracle/impls/torch_peer.py) against the float64 reference, on the CPU.

Seeded cases of every op over the shape classes tiny and small, the formats auto/bf16,
fp8 and fp8_e5m2 on the platforms cuda and rocm-fnuz (OCP and fnuz codes), scales
none/tensor/slot and the distributions normal/outliers/near_overflow/tiny (ties for the
indexer). Simple criteria, not the oracle's final checks (oracle/core/checks.py):
- rounded outputs and written cache codes lie in the rounding interval of the exact value
  widened by a rigorous fp32 error bound (``oracle.core.intervals.classify``);
- topk selections are admissible against the exact scores with an fp32 accumulation bound
  (``reference.indexer.selection_admissible``: equal as sets up to near-ties);
- attention outputs are within 2 model-dtype ulps (+1e-6) of the reference run with the
  baseline's declared schedule, and never NaN.
The deliberately broken variants (``impl_torch.BUGS``) must fail those criteria.
"""

from __future__ import annotations

import functools

import numpy as np
import pytest

from oracle.core.bounds import F64_REL, Fp32Arith, U, gamma, norm_rope_bound
from oracle.core.cases import OPS, Case, input_hash, make_inputs
from oracle.core.intervals import classify, ordinal
from oracle.core.reference_run import (
    attention_call,
    indexer_decode,
    indexer_prefill,
    layout_of,
    weights_of,
)
from oracle.core.registry import REGISTRY, implementations, schedule_for
from reference import fused
from reference.codec import decode, encode
from reference.platforms import is_fp8

torch = pytest.importorskip("torch")
impl_torch = pytest.importorskip("oracle.impls.torch_peer")


@pytest.fixture(scope="module", autouse=True)
def one_torch_thread():
    """OpenMP threads spin badly on a loaded 2-core machine; one thread is 10x faster."""
    old = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(old)


# (shape class, dist, platform, kv_cache_dtype, model dtype, scales, seed) per op.
_INSERT_CASES = [
    ("tiny", "normal", "cuda", "auto", "bfloat16", "none", 0),
    ("tiny", "outliers", "cuda", "fp8", "bfloat16", "tensor", 1),
    ("tiny", "near_overflow", "rocm-fnuz", "fp8", "bfloat16", "slot", 2),
    ("tiny", "tiny", "rocm-fnuz", "fp8_e5m2", "float16", "slot", 3),
    ("small", "normal", "cuda", "fp8_e5m2", "float16", "tensor", 4),
    ("small", "near_overflow", "cuda", "fp8", "float16", "slot", 5),
    ("small", "outliers", "rocm-fnuz", "fp8", "bfloat16", "none", 6),
    ("small", "normal", "cuda", "bfloat16", "float16", "none", 7),
    ("tiny", "outliers", "rocm-fnuz", "fp8", "float16", "tensor", 7),  # dense rows: q|k|v
]
_INDEX_CASES = [
    ("tiny", "normal", "cuda", "auto", "bfloat16", "none", 0),
    ("tiny", "ties", "cuda", "fp8", "bfloat16", "none", 1),
    ("tiny", "near_overflow", "rocm-fnuz", "fp8", "float16", "none", 2),
    ("small", "ties", "rocm-fnuz", "fp8", "bfloat16", "none", 3),
    ("small", "outliers", "cuda", "auto", "float16", "none", 4),
    ("small", "tiny", "rocm-fnuz", "fp8", "bfloat16", "none", 5),
]
_ATTN_CASES = [
    ("tiny", "normal", "cuda", "auto", "bfloat16", "none", 0),
    ("tiny", "outliers", "cuda", "fp8", "bfloat16", "slot", 1),
    ("tiny", "near_overflow", "rocm-fnuz", "fp8", "float16", "tensor", 2),
    ("tiny", "tiny", "rocm-fnuz", "fp8_e5m2", "bfloat16", "slot", 3),
    ("small", "normal", "cuda", "fp8_e5m2", "float16", "none", 4),
    ("small", "outliers", "rocm-fnuz", "fp8", "bfloat16", "slot", 5),
    ("tiny", "normal", "cuda", "float16", "bfloat16", "none", 6),
]
CASES = {op: [Case(op, *a) for a in
              (_INSERT_CASES if op in ("norm_rope_insert", "reshape_and_cache") else
               _INDEX_CASES if op.startswith("indexer") else _ATTN_CASES)]
         for op in OPS}
ALL = [c for op in OPS for c in CASES[op]]


@functools.cache
def inputs(case: Case) -> dict:
    return make_inputs(case)


@functools.cache
def baseline(case: Case, bug: str | None = None) -> dict:
    return impl_torch.make_torch_impl(case.op, bug).run(inputs(case))


@functools.cache
def reference_outputs(case: Case) -> dict:
    return REGISTRY[case.op]["reference"].run(inputs(case))


# ------------------------------------------------------------------------ criteria


def _div_rel(x):
    """The fp32 division by a scale: one rounding of the quotient (relative 2^-24; 2u
    leaves room for the float64 reference's own division)."""
    return 2 * U if is_fp8(x["kv_fmt"]) and x["k_scale"] is not None else 0.0


def _scale_per(scale, slots, hkv):
    """``[n, Hkv, 1]`` float64 scales of written tokens (1.0 when None)."""
    if scale is None:
        return np.ones((len(slots), hkv, 1))
    s = np.asarray(scale, np.float64)
    return np.broadcast_to(s, (len(slots), hkv, 1)) if s.ndim == 0 else s[:, slots].T[..., None]


def _code_failures(name, codes, exact, bound, fmt, scale=None):
    ok = classify(codes, exact, bound, fmt, scale)["ok"]
    return [] if ok.all() else [f"{name}: {int((~ok).sum())} of {ok.size} codes outside "
                                f"their rounding interval"]


def _cache_failures(x, out_cache, k_exact, v_exact, k_bound, v_bound):
    """Untouched slots bit-identical to the input; written slots' codes admissible."""
    fails = []
    cache = np.asarray(x["kv_cache"])
    num_pages, hkv, page, two_d = cache.shape
    d = two_d // 2
    slots = np.asarray(x["slot_mapping"], np.int64)
    keep = np.flatnonzero(slots >= 0)
    s = slots[keep]
    mask = np.ones((num_pages, page), bool)
    mask[s // page, s % page] = False
    untouched = mask[:, None, :, None]
    if out_cache.shape != cache.shape or not np.array_equal(
            np.where(untouched, out_cache, 0), np.where(untouched, cache, 0)):
        fails.append("kv_cache: a slot outside slot_mapping changed")
    fmt = x["kv_fmt"]
    rows = out_cache[s // page, :, s % page]  # [n, Hkv, 2D]
    ks = _scale_per(x["k_scale"], s, hkv) if is_fp8(fmt) else None
    vs = _scale_per(x["v_scale"], s, hkv) if is_fp8(fmt) else None
    rel = _div_rel(x)
    ke, ve = k_exact[keep], v_exact[keep]
    with np.errstate(invalid="ignore"):  # rel * |Inf| with rel 0 (no division): NaN bound
        fails += _code_failures("kv_cache K", rows[..., :d], ke,
                                k_bound[keep] + rel * np.abs(ke), fmt, ks)
        fails += _code_failures("kv_cache V", rows[..., d:], ve,
                                v_bound + rel * np.abs(ve), fmt, vs)
    return fails


def insert_failures(x: dict, out: dict) -> list[str]:
    if "rows" not in x:  # reshape_and_cache
        z = np.zeros(np.shape(x["k"]))
        return _cache_failures(x, out["kv_cache"], np.asarray(x["k"]),
                               np.asarray(x["v"]), z, 0.0)
    md = x["model_dtype"]
    layout = layout_of(x)
    ref = fused.fused_qknorm_rope_insert(
        x["rows"], x["positions"], layout, weights_of(x), x["rope_table"], x["rotary_dim"],
        x["eps"], md, x["kv_cache"].copy(), x["kv_fmt"], x["slot_mapping"], x["k_scale"],
        x["v_scale"], None if x["index_cache"] is None else x["index_cache"].copy(),
        x["index_fmt"], index_slot_mapping=x.get("index_slot_mapping"))
    parts = layout.split(np.asarray(x["rows"], np.float64))
    cs = np.asarray(x["rope_table"])[np.asarray(x["positions"])]
    arith = Fp32Arith()
    bounds = {}
    for kind in ("q", "k", "index_q", "index_k"):
        if kind in parts:
            c = cs if kind == "index_k" else cs[:, None, :]
            bounds[kind] = norm_rope_bound(parts[kind], x[f"weights_{kind}"], x["eps"], c,
                                           x["rotary_dim"], arith)
    fails = []
    for kind in ("q", "k", "index_k"):
        if kind in bounds:
            fails += _code_failures(kind, out[kind], ref[f"{kind}_exact"], bounds[kind], md)
    if "index_q" in bounds:
        fails += _code_failures("index_q", out["index_q"], ref["index_q_exact"],
                                bounds["index_q"], ref["index_q_fmt"])
    fails += _cache_failures(x, out["kv_cache"], ref["k_exact"], ref["v"],
                             bounds["k"], 0.0)
    if "index_k" in bounds:
        ic, fmt = np.asarray(x["index_cache"]), x["index_fmt"]
        page = ic.shape[1]
        islots = x.get("index_slot_mapping")
        slots = np.asarray(x["slot_mapping"] if islots is None else islots, np.int64)
        keep = np.flatnonzero(slots >= 0)
        s = slots[keep]
        mask = np.ones(ic.shape[:2], bool)
        mask[s // page, s % page] = False
        got = out["index_cache"]
        if not np.array_equal(got[mask], ic[mask]):
            fails.append("index_cache: a slot outside index_slot_mapping changed")
        fails += _code_failures("index_cache", got[s // page, s % page],
                                ref["index_k_exact"][keep], bounds["index_k"][keep], fmt)
    return fails


@functools.cache
def indexer_result(case: Case):
    x = inputs(case)
    call = indexer_decode if "rows_per_request" in x else indexer_prefill
    return call(x, return_scores=True)


def indexer_failures(case: Case, out: dict) -> list[str]:
    """Admissible against the exact scores with fp32 accumulation error gamma(D) * magnitude
    (any summation order; the scores of exact copies may differ in fp32 by blocking)."""
    res = indexer_result(case)
    d = inputs(case)["index_q"].shape[2]
    bound = (gamma(d) + F64_REL) * res.magnitudes * (1 + 1e-6)
    # A block with a NaN key scores NaN: it ranks by rule (last, lower id first).
    ok, det = res.admits(out["topk"], np.nan_to_num(bound, nan=0.0))
    return [] if ok else [f"topk: {det['rows_failed']} of {det['rows']} rows not admissible "
                          f"({det['failures'][:2]}), needed bound {det['needed_bound']:.3g}"]


@functools.cache
def attention_reference(case: Case) -> np.ndarray:
    x = inputs(case)
    sched = schedule_for(impl_torch.make_torch_impl(case.op), x["model_dtype"])
    return attention_call(x, schedule=sched)


def attention_failures(case: Case, out: dict) -> list[str]:
    """Within 2 model-dtype ulps (ordinal code distance), or 1e-6, or 2^-12 of the row's
    largest output (where V cancels, the fp32 error scales with the row, not the element)
    of the scheduled reference, never NaN."""
    md = inputs(case)["model_dtype"]
    ref = attention_reference(case)
    got = decode(out["out"], md)
    fails = []
    if np.isnan(got).any():
        fails.append(f"out: {int(np.isnan(got).sum())} NaN")
    ulps = np.abs(ordinal(out["out"], md) - ordinal(encode(ref, md, "nonsaturating"), md))
    row_max = np.abs(ref).max(axis=-1, keepdims=True)
    with np.errstate(invalid="ignore"):
        bad = ~((ulps <= 2) | (np.abs(got - ref) <= np.maximum(1e-6, 2**-12 * row_max)))
    if bad.any():
        i = tuple(np.argwhere(bad)[np.argmax(ulps[bad])])
        fails.append(f"out: {int(bad.sum())} of {bad.size} elements beyond 2 ulp + 1e-6 "
                     f"(worst {i}: {got[i]!r} vs {ref[i]!r}, row max "
                     f"{np.abs(ref[i[:2]]).max():.3g})")
    return fails


def failures(case: Case, out: dict) -> list[str]:
    if case.op in ("norm_rope_insert", "reshape_and_cache"):
        return insert_failures(inputs(case), out)
    if case.op.startswith("indexer"):
        return indexer_failures(case, out)
    return attention_failures(case, out)


# --------------------------------------------------------------------------- tests


def test_registered_for_every_op_with_its_numerics():
    """"torch" is registered for all six ops on cpu and cuda; reshape_and_cache declares
    two roundings, the fused op one; attention declares Schedule(kv=act, out=act) for each
    model dtype through its PerModelDtype schedule."""
    for op in OPS:
        found = {i.name: i for i in implementations(op)}
        impl = found["torch"]
        assert impl.devices == ("cpu", "cuda") and impl.score_rel == 0.0
        assert impl.quantize_from == ("model_dtype" if op == "reshape_and_cache" else "value")
        if op.startswith("attention"):
            for md in ("bfloat16", "float16"):
                s = schedule_for(impl, md)
                assert (s.kv_dtype, s.out_dtype, s.p_dtype) == (md, md, "float64")
        else:
            assert impl.schedule is None
    assert not any(n.startswith("torch[") for n in
                   {i.name for impls in REGISTRY.values() for i in impls.values()})


@pytest.mark.parametrize("case", ALL, ids=lambda c: c.id)
def test_outputs_have_the_reference_format_and_inputs_stay_unmodified(case):
    """Same output keys, shapes and dtypes as impl_reference; the input set (caches
    included, whatever their strides) is bit-identical after the call."""
    x = inputs(case)
    before = input_hash(x)
    out = impl_torch.make_torch_impl(case.op).run(x)
    assert input_hash(x) == before
    ref = reference_outputs(case)
    assert sorted(out) == sorted(ref)
    for key in ref:
        assert isinstance(out[key], np.ndarray)
        assert (out[key].shape, out[key].dtype) == (ref[key].shape, ref[key].dtype), key


@pytest.mark.parametrize("case", ALL, ids=lambda c: c.id)
def test_baseline_meets_the_simple_criteria(case):
    """Insert ops: every rounded output and written code admissible for an fp32 evaluation
    and every untouched cache slot (NaN-poisoned) bit-identical; indexer: selection equal to
    the reference's as a set up to near-ties; attention: within 2 ulps of the reference
    under the declared schedule, never NaN."""
    assert failures(case, baseline(case)) == []


def test_reshape_and_cache_is_code_exact_without_scales():
    """Without scales the two-rounding insert is a pure conversion: codes equal the
    reference's bit for bit (NaN-poisoned cache included)."""
    for case in CASES["reshape_and_cache"]:
        if case.scales == "none":
            assert np.array_equal(baseline(case)["kv_cache"],
                                  reference_outputs(case)["kv_cache"]), case.id


def test_padding_rows_and_exact_ties():
    """Decode padding rows (seq_len 0) give all -1 selections and all-zero attention
    outputs; in a case of exact block copies the baseline's selection passes with a bound
    of 0 wherever the reference's scores are exact ties."""
    c = Case("attention_decode", "small", "normal", "cuda", "fp8", "bfloat16", "slot", 16)
    x = inputs(c)
    pad = np.repeat(np.asarray(x["seq_lens"]) == 0, x["rows_per_request"])
    assert pad.any(), "the seed must draw a padding request"
    out = decode(baseline(c)["out"], "bfloat16")
    assert np.all(out[pad] == 0) and not np.isnan(out).any()
    ci = Case("indexer_decode", "small", "normal", "cuda", "fp8", "bfloat16", "none", 18)
    xi = inputs(ci)
    pad_i = np.repeat(np.asarray(xi["seq_lens"]) == 0, xi["rows_per_request"])
    assert pad_i.any(), "the seed must draw a padding request"
    assert np.all(baseline(ci)["topk"][:, pad_i] == -1)


_BUG_CASES = {
    "interleaved_rope": [("norm_rope_insert", ("tiny", "normal", "cuda", "auto", "bfloat16",
                                               "none", 0))],
    "plain_w": [("norm_rope_insert", ("tiny", "normal", "cuda", "auto", "bfloat16", "none",
                                      0))],
    "k_from_model_dtype": [("norm_rope_insert", ("small", "normal", "cuda", "fp8", "bfloat16",
                                                 "none", s)) for s in (20, 21, 22)],
    "scales_ignored": [("norm_rope_insert", ("tiny", "normal", "cuda", "fp8", "bfloat16",
                                             "slot", 0)),
                       ("reshape_and_cache", ("tiny", "normal", "cuda", "fp8", "bfloat16",
                                              "tensor", 0)),
                       ("attention_prefill", ("tiny", "normal", "cuda", "fp8", "bfloat16",
                                              "slot", 0)),
                       ("attention_decode", ("tiny", "normal", "cuda", "fp8", "float16",
                                             "tensor", 0))],
    "fnuz_as_fn": [("attention_prefill", ("tiny", "normal", "rocm-fnuz", "fp8", "bfloat16",
                                          "none", 0)),
                   ("attention_decode", ("tiny", "normal", "rocm-fnuz", "fp8_e5m2",
                                         "bfloat16", "none", 3)),
                   *[("indexer_prefill", ("small", "near_overflow", "rocm-fnuz", "fp8",
                                         "bfloat16", "none", s)) for s in (2, 3, 4, 5)],
                   ("indexer_decode", ("small", "near_overflow", "rocm-fnuz", "fp8",
                                       "bfloat16", "none", 3))],
    "no_causal_in_block": [("attention_prefill", ("tiny", "normal", "cuda", "auto",
                                                  "bfloat16", "none", 0))]
                          + [("attention_decode", ("tiny", "normal", "cuda", "auto",
                                                   "bfloat16", "none", s)) for s in (2, 3)],
}
BUG_OPS = [(bug, op) for bug, spec in impl_torch.BUGS.items() for op in spec.ops]


def test_every_bug_has_cases_for_each_of_its_ops():
    """The power test below covers every (bug, op) pair that BUGS declares."""
    covered = {(bug, op) for bug, cases in _BUG_CASES.items() for op, _ in cases}
    assert covered == set(BUG_OPS)


@pytest.mark.parametrize("bug,op", BUG_OPS, ids=lambda v: v)
def test_each_broken_variant_is_caught(bug, op):
    """Each deliberately broken variant fails the simple criteria on at least one of a few
    seeded cases of its op (while the clean baseline passes them)."""
    cases = [Case(o, *a) for o, a in _BUG_CASES[bug] if o == op]
    impl = impl_torch.make_torch_impl(op, bug)
    assert impl.name == f"torch[{bug}]"
    caught = []
    for case in cases:
        assert failures(case, baseline(case)) == [], case.id
        caught += failures(case, baseline(case, bug))
        if caught:
            break
    assert caught, f"torch[{bug}] survived {[c.id for c in cases]}"


def test_bad_bug_or_op_is_rejected():
    """make_torch_impl names the valid choices when a bug does not exist or does not apply."""
    with pytest.raises(ValueError, match="bug must be one of"):
        impl_torch.make_torch_impl("attention_decode", "nope")
    with pytest.raises(ValueError, match="applies to"):
        impl_torch.make_torch_impl("indexer_decode", "plain_w")
    with pytest.raises(ValueError, match="op must be one of"):
        impl_torch.make_torch_impl("nope")


def test_zero_tokens_is_a_no_op():
    """N = 0 (every per-token input sliced empty): empty outputs of the reference's shapes
    and dtypes, caches bit-identical to the input."""
    for op in ("norm_rope_insert", "reshape_and_cache"):
        case = CASES[op][2]
        x = dict(inputs(case))
        for key in ("rows", "positions", "slot_mapping", "index_slot_mapping", "k", "v"):
            if x.get(key) is not None:
                x[key] = x[key][:0]
        out = impl_torch.make_torch_impl(op).run(x)
        ref = REGISTRY[op]["reference"].run(x)
        assert sorted(out) == sorted(ref)
        for key in ref:
            assert (out[key].shape, out[key].dtype) == (ref[key].shape, ref[key].dtype)
        assert np.array_equal(out["kv_cache"], x["kv_cache"])
        if "index_cache" in out:
            assert np.array_equal(out["index_cache"], x["index_cache"])


def _poisonable_block(x):
    """(KV head, request, logical block) selected by some but not all rows of a request."""
    tk = np.asarray(x["topk"])
    cu = np.asarray(x["cu_seqlens_q"])
    for g in range(tk.shape[0]):
        for r in range(len(cu) - 1):
            rows = [set(tk[g, t][tk[g, t] >= 0].tolist()) for t in range(cu[r], cu[r + 1])]
            some = set().union(*rows) - set.intersection(*rows) if rows else set()
            if some:
                return g, r, min(some)
    return None


def test_nan_in_a_block_reaches_only_the_rows_that_select_it():
    """NaN K/V codes in a block that some rows of a request select and others do not:
    the selecting rows (of that KV head's query heads) are NaN, as in the reference, and
    every other output stays within 2 ulps of the reference (no 0 * NaN leak)."""
    for seed in range(6):
        case = Case("attention_prefill", "tiny", "normal", "cuda", "fp8", "bfloat16", "none",
                    seed)
        x = dict(inputs(case))
        found = _poisonable_block(x)
        if found:
            break
    assert found, "no seed drew a block selected by only some rows"
    g, r, b = found
    cache = x["kv_cache"].copy()
    cache[x["block_table"][r, b], g] = 0x7F  # e4m3fn NaN, K and V
    x["kv_cache"] = cache
    sched = schedule_for(impl_torch.make_torch_impl(case.op), x["model_dtype"])
    ref = attention_call(x, schedule=sched)
    got = decode(impl_torch.make_torch_impl(case.op).run(x)["out"], "bfloat16")
    assert np.isnan(ref).any() and not np.isnan(ref).all()
    assert np.array_equal(np.isnan(got), np.isnan(ref))
    fin = ~np.isnan(ref)
    ulps = np.abs(ordinal(encode(got[fin], "bfloat16", "nonsaturating"), "bfloat16")
                  - ordinal(encode(ref[fin], "bfloat16", "nonsaturating"), "bfloat16"))
    assert np.all((ulps <= 2) | (np.abs(got[fin] - ref[fin]) <= 1e-6))


def test_row_chunking_changes_nothing_but_summation(monkeypatch):
    """With one row per chunk (the memory bound that model-size cases hit) indexer and
    attention still meet the criteria, and the selections are identical."""
    monkeypatch.setattr(impl_torch, "_CHUNK_ELEMS", 1)
    for op in ("indexer_prefill", "attention_prefill", "attention_decode"):
        case = CASES[op][1]
        out = impl_torch.make_torch_impl(op).run(inputs(case))
        assert failures(case, out) == [], case.id
        if op.startswith("indexer"):
            assert np.array_equal(out["topk"], baseline(case)["topk"])
