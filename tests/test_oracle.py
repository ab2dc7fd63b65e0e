"""The oracle's own guarantees: sound (never rejects a legitimate fp32 evaluation), powerful
(rejects one-code errors), cases replay bit for bit, and diffs see silent regressions."""

import dataclasses

import numpy as np
import pytest

from oracle.core import diff, report
from oracle.core.bounds import norm_rope_bound
from oracle.core.cases import OPS, Case, input_hash, make_inputs
from oracle.core.checks import run_check
from oracle.core.intervals import (
    admissible_range,
    classify,
    joint_value_exists,
    ordinal,
    preimage,
    round_codes,
)
from oracle.core.reference_run import attention_call
from oracle.core.registry import Implementation, implementations
from oracle.tools.soundness import (
    indexer_power,
    indexer_soundness,
    norm_rope_power,
    norm_rope_soundness,
)
from reference.codec import decode, encode
from reference.formats import FORMATS


@pytest.mark.slow
def test_norm_rope_bound_is_sound_on_10000_adversarial_cases():
    """10,000 random head vectors (D, R, dtype, magnitude, weights, eps drawn from the domain)
    evaluated in fp32 with random summation order, FMA on/off and special functions at the
    edge of their declared error: every rounded output is admissible."""
    r = norm_rope_soundness(10_000)
    assert r["cases"] >= 10_000 and r["violations"] == 0, r
    assert r["max_err_over_bound"] <= 1.0


def test_norm_rope_model_rejects_one_code_errors():
    """At least 95% of the outputs one code away from the nearest rounding are rejected:
    the bound is tight enough to see a single-code error almost everywhere."""
    assert norm_rope_power(1000)["power"] >= 0.95


@pytest.mark.slow
def test_indexer_bound_is_sound_on_10000_adversarial_rows():
    """Selections made from fp32 block scores summed in random orders (every index format,
    normal and exact/near-tie distributions) are all admissible under the score bound."""
    r = indexer_soundness(10_000)
    assert r["cases"] >= 10_000 and r["violations"] == 0, r


def test_indexer_model_rejects_the_smallest_selection_change():
    """Swapping the weakest selected block for the strongest unselected one is rejected in
    at least 90% of rows (the rest are exact or near ties, where the swap is legitimate)."""
    assert indexer_power(1000)["power"] >= 0.9


def test_admissible_range_is_the_rounding_of_the_interval():
    """lo/hi are the ordinals of round(e - d) and round(e + d); a zero bound admits only
    the nearest code; outputs outside are rejected, NaN outputs always."""
    e = np.array([1.0, 1.0 + 2**-9, -3.3, 0.0])
    lo, hi = admissible_range(e, 0.0, "bfloat16")
    assert np.array_equal(lo, hi)
    nearest = round_codes(e, "bfloat16")
    assert classify(nearest, e, 0.0, "bfloat16")["ok"].all()
    one_up = encode(np.array([1.0 + 2**-7]), "bfloat16", "nonsaturating")
    assert not classify(one_up, np.array([1.0]), 0.0, "bfloat16")["ok"][0]
    assert not classify(one_up, np.array([1.0]), 2**-8, "bfloat16")["ok"][0]  # tie: to even
    assert classify(one_up, np.array([1.0]), 1.01 * 2**-8, "bfloat16")["ok"][0]
    nan = encode(np.array([np.nan]), "bfloat16", "nonsaturating")
    assert not classify(nan, np.array([1.0]), 1e9, "bfloat16")["ok"][0]


@pytest.mark.parametrize("fmt", list(FORMATS))
def test_preimage_is_what_rounds_to_each_code(fmt):
    """For every finite code of the format, as a code array and as int64: the values just
    inside its preimage [lo, hi] (one float64 step in from each end) round (the reference's
    RNE, satfinite for fp8) to a code of the same ordinal, the values just outside to
    another; the ordinal grows with the value (+0 and -0 one ordinal)."""
    f = FORMATS[fmt]
    codes = np.arange(1 << f.bits).astype(f.code_dtype)
    value = decode(codes, fmt)
    codes, value = codes[np.isfinite(value)], value[np.isfinite(value)]
    for given in (codes, codes.astype(np.int64)):
        lo, hi = preimage(given, fmt)
        own = ordinal(given, fmt)
        assert np.array_equal(own, ordinal(codes, fmt))
        assert (lo <= value).all() and (value <= hi).all()
        for ends, step, same in ((lo, np.inf, True), (hi, -np.inf, True),
                                 (lo, -np.inf, False), (hi, np.inf, False)):
            x = np.nextafter(ends, step)
            at = np.isfinite(x)
            assert np.array_equal(ordinal(round_codes(x[at], fmt), fmt) == own[at],
                                  np.full(at.sum(), same)), (fmt, same)
    by_value = np.argsort(value, kind="stable")
    assert (np.diff(ordinal(codes, fmt)[by_value]) >= 0).all()


def test_joint_check_requires_one_value_for_bf16_and_fp8():
    """A bf16 K and an fp8 K code from the same value pass; codes from two different values
    inside the bound fail when no single value rounds to both."""
    y = np.array([1.0 + 2**-4 + 2**-9])  # rounds up in e4m3 (step 2^-3), stays in bf16
    bf = encode(y, "bfloat16", "nonsaturating")
    e4 = encode(y, "e4m3fn", "satfinite")
    assert joint_value_exists(y, 0.0, bf, "bfloat16", e4, "e4m3fn").all()
    other = encode(y - 2**-5, "e4m3fn", "satfinite")  # another code, from another value
    assert decode(other, "e4m3fn")[0] != decode(e4, "e4m3fn")[0]
    assert not joint_value_exists(y, 2**-12, bf, "bfloat16", other, "e4m3fn").all()


@pytest.mark.parametrize("op", OPS)
def test_replay_reproduces_inputs_and_verdict(op):
    """A case id rebuilds bit-identical inputs (same hash) and the same verdict."""
    case = Case(op, "tiny", "normal", "rocm-fnuz", "fp8", "bfloat16",
                "none" if op.startswith("indexer") else "slot", seed=3)
    again = Case.from_id(case.id)
    assert again == case
    x1, x2 = make_inputs(case), make_inputs(again)
    assert input_hash(x1) == input_hash(x2)
    (ref,) = implementations(op, ["reference"])
    r1, r2 = run_check(case, ref, x1), run_check(again, ref, x2)
    assert r1.passed == r2.passed and r1.input_hash == r2.input_hash


@pytest.mark.parametrize("op", OPS)
def test_cases_of_one_shape_config_share_shapes_not_values(op):
    """``Case.config``: two cases of one config (and shape class) have arrays of the same
    shapes and dtypes (index arrays' widths included) and scalar shape parameters, but
    different values; another config gives other
    shapes for some op's draw; the id carries the config (``:c7``) and rebuilds the case;
    without a config the id is the eight fields it always was."""
    a = Case(op, "small", "normal", "cuda", "auto", "bfloat16", seed=5, config=7)
    b = dataclasses.replace(a, seed=6, dist="outliers")
    assert a.id.endswith(":5:c7") and Case.from_id(a.id) == a
    assert Case.from_id(dataclasses.replace(a, config=None).id).config is None
    assert len(dataclasses.replace(a, config=None).id.split(":")) == 8
    xa, xb = make_inputs(a), make_inputs(b)

    def shapes(x):
        return {k: (np.shape(v), v.dtype) if isinstance(v, np.ndarray) else v
                for k, v in x.items()
                if isinstance(v, np.ndarray) or k in ("rows_per_request", "topk",
                                                      "rotary_dim", "cache_layout")}

    assert shapes(xa) == shapes(xb)
    assert input_hash(xa) != input_hash(xb)
    others = [shapes(make_inputs(dataclasses.replace(a, config=c))) for c in range(8, 12)]
    assert any(o != shapes(xa) for o in others)
    with pytest.raises(ValueError, match="config"):
        Case(op, config=-1)
    with pytest.raises(ValueError, match="config"):
        Case.from_id(a.id[:-3] + ":cx")


def _worse_norm_rope(impl):
    """A legitimate but worse implementation: it declares a sloppy rsqrt (2,000 ulp) and
    rounds q from e + 0.9 d, inside its bound (so every check still passes), instead of the
    nearest value."""
    arith = dataclasses.replace(impl.arith, rsqrt_ulp=2000.0)

    def run(x):
        out = impl.run(x)
        from oracle.core.reference_run import layout_of, weights_of
        from reference.norm_rope import apply_rope_neox, rms_norm_gemma

        q = layout_of(x).split(x["rows"])["q"]
        w = weights_of(x)["q"]
        e = apply_rope_neox(rms_norm_gemma(q, w, x["eps"]), x["positions"], x["rope_table"],
                            x["rotary_dim"])
        d = norm_rope_bound(q, w, x["eps"], x["rope_table"][x["positions"]][:, None],
                            x["rotary_dim"], arith)
        out["q"] = round_codes(e + 0.9 * d, x["model_dtype"])
        return out

    return dataclasses.replace(impl, run=run, name="worse", arith=arith)


def test_diff_flags_a_silent_regression_and_not_a_rerun():
    """Rerunning the same implementation on the same case set flags nothing; a variant that
    still passes every check but rounds worse is flagged as a regression."""
    cases = [Case("norm_rope_insert", "tiny", "normal", p, "auto", "bfloat16", "none", s)
             for p in ("cuda", "rocm-fnuz") for s in range(4)]
    (ref,) = implementations("norm_rope_insert", ["reference"])
    worse = _worse_norm_rope(ref)

    def doc(impl):
        cells = {}
        for c in cases:
            r = run_check(c, impl)
            assert r.passed, r.summary()
            report.add_result(cells, c, dataclasses.replace(r, impl="candidate"))
        return {"cells": list(cells.values())}

    base = doc(ref)
    text, worse_flag = diff.diff_reports(base, doc(ref))
    assert not worse_flag, text
    text, worse_flag = diff.diff_reports(base, doc(worse))
    assert worse_flag and "exact" in text and "RMSE" in text, text


def test_diff_judges_admissibility_counts_not_the_rmse():
    """Per-case RMSEs that all rose (by 1e-14 or by 1e-6 relative) with the same counts are
    not a regression: the RMSE is context; one fewer exactly rounded output is one."""
    def cell(scale, exact=90):
        per_case = [{"case": f"c{i}", "hash": f"h{i}", "passed": True, "exact_rate": 0.9,
                     "exact": exact if i == 7 else 90, "max_err_over_bound": 0.5,
                     "rmse": (1e-3 + 1e-5 * i) * scale} for i in range(8)]
        return {"cells": [{"op": "o", "impl": "i", "platform": "cuda", "format": "bfloat16",
                           "shape_class": "tiny", "dist": "normal", "per_case": per_case}]}

    for scale in (1 + 1e-14, 1 + 1e-6):
        text, worse = diff.diff_reports(cell(1.0), cell(scale))
        assert not worse, text
    text, worse = diff.diff_reports(cell(1.0), cell(1.0, exact=89))
    assert worse and "exact 720 -> 719" in text, text


def test_diff_does_not_compare_cases_whose_inputs_changed():
    """A case whose input hash changed (regenerated inputs) is listed apart and left out of
    the paired comparison: its violations and larger RMSE are not a regression, while a
    violation on an unchanged case still is."""
    def cell(hash7, violations7=0, violations0=0):
        per_case = [{"case": f"c{i}", "hash": hash7 if i == 7 else f"h{i}", "passed": True,
                     "exact_rate": 0.9, "max_err_over_bound": 0.5,
                     "violations": {7: violations7, 0: violations0}.get(i, 0),
                     "rmse": 5e-3 if violations7 else 1e-3} for i in range(8)]
        return {"cells": [{"op": "o", "impl": "i", "platform": "cuda", "format": "bfloat16",
                           "shape_class": "tiny", "dist": "normal", "per_case": per_case}]}

    text, worse = diff.diff_reports(cell("h7"), cell("other", violations7=2))
    assert not worse and "1 with changed inputs (1 cases" in text and "c7" in text, text
    text, worse = diff.diff_reports(cell("h7"), cell("other", violations0=1))
    assert worse and "violations 0 -> 1" in text and "1 with changed inputs" in text, text


@pytest.mark.slow
def test_attention_bound_is_sound_on_10000_adversarial_rows():
    """Attention rows evaluated as an fp32 online-softmax kernel would (random summation
    orders, exp2 and divisions at the edge of their error, P rounded from the kernel's own
    fp32 value, split-K partials rounded to bf16/fp16) under three schedules, every format
    and distribution: every rounded output is admissible, and no pre-rounding value lies
    beyond its bound."""
    from oracle.tools.soundness import attention_soundness

    r = attention_soundness(10_000)
    assert r["cases"] >= 10_000 and r["violations"] == 0, r
    assert r["max_err_over_bound"] <= 1.0, r


def key_streams_schedule(md: str, splits: int | None):
    """A schedule of key streams (the decode kernel's ``key_streams``): four streams of P/4
    keys where the page allows (tiles of at least one key), else two."""
    from reference import attention as att

    def make(page):
        streams = 4 if page % 4 == 0 else 2
        return att.Schedule(kv_dtype=md, p_dtype=md, p_max="running", out_dtype=md,
                            tile_keys=page // streams, key_streams=streams,
                            blocks_per_split=splits, partial_dtype="float32")
    return make


def test_attention_bound_is_sound_with_key_streams():
    """Rows evaluated as a kernel whose warps each keep their own online softmax over one
    slice of every block (Schedule.key_streams: P rounded relative to the stream's running
    max, the streams merged in fp32 with exp2 at the edge of its error), with and without
    split-K: every rounded output is admissible and no value lies beyond its bound."""
    from oracle.tools.soundness import attention_soundness

    r = attention_soundness(600, seed=7, schedules=[
        key_streams_schedule("bfloat16", None), key_streams_schedule("float16", 2),
        key_streams_schedule("bfloat16", 1)])
    assert r["cases"] >= 600 and r["violations"] == 0, r
    assert r["max_err_over_bound"] <= 1.0, r


@pytest.mark.slow
def test_attention_bound_with_tensor_cores_is_sound():
    """Both products summed as tensor cores do (exact 16-bit products, k-steps aligned to
    the largest term and truncated, no guard bits), judged by the bound with the declared
    ``TENSOR_CORE_DOT_REL``: every rounded output is admissible (the first four seeded
    cases, 14,764 rows; a small case's long dots are where the declared error is tested)."""
    from oracle.core.bounds import TENSOR_CORE_DOT_REL
    from oracle.tools.soundness import attention_soundness

    r = attention_soundness(3_000, seed=5, dot_rel=TENSOR_CORE_DOT_REL)
    assert r["cases"] >= 3_000 and r["violations"] == 0, r
    assert r["max_err_over_bound"] <= 1.0, r


def test_tensor_core_sum_truncates_within_the_declared_error():
    """The emulated tensor-core sum of positive terms never exceeds the exact sum (its cuts
    are toward zero), differs from it (it is not an IEEE sum), and errs by less than the
    declared ``tensor_core_rel`` of the terms' magnitude; mixed signs likewise within it."""
    from oracle.core import rand
    from oracle.core.bounds import TENSOR_CORE_DOT_REL, tensor_core_rel
    from oracle.tools.emulate import tensor_core_sum

    bg = rand.generator(11)
    for n in (16, 128, 256, 2048):
        a = np.ldexp(1.0 + rand.uniform(bg, (64, n)), rand.integers(bg, -8, 8, (64, n)))
        a = a.astype(np.float16).astype(np.float64)  # 16-bit products stay exact
        for terms in (a, a * np.where(rand.uniform(bg, a.shape) < 0.5, -1.0, 1.0)):
            exact = terms.sum(axis=-1)
            err = np.abs(tensor_core_sum(terms).astype(np.float64) - exact)
            mag = np.abs(terms).sum(axis=-1)
            assert np.all(err <= tensor_core_rel(TENSOR_CORE_DOT_REL, n) * mag), n
            assert np.any(err > 0), n
        assert np.all(tensor_core_sum(a).astype(np.float64) <= a.sum(axis=-1))


def test_declared_dot_error_widens_the_attention_bound():
    """An implementation's declared dot error (``score_rel``) enters the attention bound:
    with it every element's bound is at least the IEEE one and some are larger."""
    from oracle.core.attention_bound import attention_bound
    from oracle.core.bounds import TENSOR_CORE_DOT_REL, Fp32Arith
    from oracle.core.cases import Case, make_inputs
    from reference.attention import vllm_schedule

    x = make_inputs(Case("attention_decode", "tiny", "normal", "cuda", "auto", "bfloat16",
                         "none", 3))
    sched = vllm_schedule("bfloat16")
    plain = attention_bound(x, sched, Fp32Arith())
    wide = attention_bound(x, sched, Fp32Arith(), dot_rel=TENSOR_CORE_DOT_REL)
    assert np.all(wide >= plain) and np.any(wide > plain)


BROKEN_CASES = {  # (shape class, dist, platform, kv_cache_dtype, model dtype, scales), seeds
    "norm_rope_insert": [(("tiny", "normal", "cuda", "fp8", "bfloat16", "slot"), range(3)),
                         (("small", "normal", "cuda", "fp8", "bfloat16", "none"), range(3))],
    "reshape_and_cache": [(("tiny", "normal", "cuda", "fp8", "bfloat16", "tensor"), range(2))],
    "attention_prefill": [(("tiny", "normal", "rocm-fnuz", "fp8", "bfloat16", "slot"),
                           range(3))],
    "attention_decode": [(("tiny", "normal", "rocm-fnuz", "fp8", "bfloat16", "tensor"),
                          range(6))],
    "indexer_prefill": [(("small", "near_overflow", "rocm-fnuz", "fp8", "bfloat16", "none"),
                         range(6))],
    "indexer_decode": [(("small", "near_overflow", "rocm-fnuz", "fp8", "bfloat16", "none"),
                        range(6))],
}


def _broken_params():
    from oracle.impls.torch_peer import BUGS

    for bug, spec in BUGS.items():
        for op in spec.ops:
            yield pytest.param(bug, op, id=f"{bug}-{op}")


@pytest.mark.parametrize("bug, op", list(_broken_params()))
def test_oracle_rejects_broken_baselines_and_accepts_the_correct_one(bug, op):
    """A realistic bug in the torch baseline (interleaved RoPE, w for 1+w, fnuz read as fn,
    no causal mask in the block, scales ignored, K quantised from bf16) fails the oracle's
    check on at least one seeded case of its op, while the correct baseline passes all."""
    from oracle.impls.torch_peer import make_torch_impl

    (good,) = implementations(op, ["torch"])
    broken = make_torch_impl(op, bug)
    killed = []
    for fields, seeds in BROKEN_CASES[op]:
        for seed in seeds:
            case = Case(op, *fields, seed=seed)
            x = make_inputs(case)
            assert run_check(case, good, x).passed, case.id
            if not run_check(case, broken, x).passed:
                killed.append(case.id)
    assert killed, f"{bug} survived every case of {op}"


@pytest.mark.parametrize("kv", ["fp8", "fp8_e5m2", "auto"])
def test_v_specials_in_the_cache_are_judged(kv):
    """Outlier cases put -0, +-Inf and NaN into V; the reference's codes pass, and a cache
    whose NaN V became a number, or whose Inf V became NaN (no satfinite) or a non-max code,
    is rejected."""
    from dataclasses import replace

    case = Case("reshape_and_cache", "small", "outliers", "cuda", kv, "bfloat16", "none", 3)
    x = make_inputs(case)
    ref = next(i for i in implementations(case.op) if i.name == "reference")
    out = ref.run(x)
    assert run_check(case, ref, inputs=x).passed
    s = np.asarray(x["slot_mapping"])
    page, d = x["kv_cache"].shape[2], x["kv_cache"].shape[3] // 2
    for special in (np.nan, np.inf):
        where = np.isnan(x["v"]) if np.isnan(special) else np.isposinf(x["v"])
        tok, h, j = (a[0] for a in np.nonzero(where & (s[:, None, None] >= 0)))
        bad = {k: np.array(v, copy=True) for k, v in out.items()}
        fmt = case.kv_fmt
        wrong = encode(np.array([1.0 if np.isnan(special) else np.nan]), fmt, "nonsaturating")
        bad["kv_cache"][s[tok] // page, h, s[tok] % page, d + j] = wrong[0]
        broken = replace(ref, run=lambda _x, b=bad: b)
        assert not run_check(case, broken, inputs=x).passed, (kv, special)



@pytest.mark.parametrize("decode", [True, False])
def test_long_cases_reach_long_contexts_within_the_cap(decode):
    """The ``long`` class (GPU differential) draws decode contexts past 64k tokens and
    prefill prefixes past 32k, at most 128k / 64k, never a multiple of any P for decode,
    their total times the KV heads within LONG_TOKEN_HEADS (which keeps the float64 check
    at seconds), new prefill tokens 1..128 after the prefix."""
    from oracle.core import rand
    from oracle.core.cases import (
        LONG_DECODE_TOKENS,
        LONG_PREFIX_TOKENS,
        LONG_TOKEN_HEADS,
        _requests,
    )

    longest = 0
    for seed in range(200):
        heads = (1, 3, 4)[seed % 3]
        seq, new = _requests(rand.generator(seed), "long", 128, decode, heads=heads)
        prefix = seq if decode else seq - new
        assert prefix.max() <= (LONG_DECODE_TOKENS if decode else LONG_PREFIX_TOKENS)
        assert prefix.sum() * heads <= LONG_TOKEN_HEADS
        if decode:
            assert np.all(seq[seq > 0] % 16 != 0)  # 0: a padding row
        else:
            assert 1 <= new.min() and new.max() <= 128
        longest = max(longest, int(prefix.max()))
    assert longest > (LONG_DECODE_TOKENS if decode else LONG_PREFIX_TOKENS) // 2


def test_long_class_is_for_the_sparse_ops_only():
    """An insert case cannot ask for the long class (it has no contexts)."""
    with pytest.raises(ValueError, match="shape_class 'long'"):
        Case("norm_rope_insert", "long")


def test_rows_are_judged_under_the_schedule_their_implementation_reports():
    """An implementation declaring two schedules (``oracle.core.registry``: a tuple) and naming
    each (token, head) row's in ``schedule_rows`` is judged row by row: outputs computed
    under the exact schedule for even tokens and vLLM's act-rounding one for odd tokens
    pass when reported so, fail when every row is reported under the exact one, and a
    malformed report (wrong shape, an index past the tuple) fails the check with the
    argument named."""
    from reference import attention

    case = Case("attention_prefill", "tiny", "normal", "cuda", "fp8", "bfloat16", "tensor",
                seed=3)
    x = make_inputs(case)
    md = x["model_dtype"]
    scheds = (attention.exact(), attention.vllm_schedule(md, order="ascending"))
    outs = [attention_call(x, schedule=s) for s in scheds]
    rows = np.zeros(x["q"].shape[:2], np.int64)
    rows[1::2] = 1
    codes = encode(np.where(rows[..., None] == 1, outs[1], outs[0]), md)
    assert not np.array_equal(outs[0], outs[1])

    def impl(report):
        return Implementation("two", "attention_prefill", lambda _: report,
                              schedule=lambda _md, _case: scheds)

    assert run_check(case, impl({"out": codes, "schedule_rows": rows}), x).passed
    assert not run_check(case, impl({"out": codes, "schedule_rows": 0 * rows}), x).passed
    for bad in (rows[:1], rows + 1):
        res = run_check(case, impl({"out": codes, "schedule_rows": bad}), x)
        assert not res.passed and "schedule_rows" in res.summary()


def test_a_check_hashes_its_inputs_twice_and_fails_an_implementation_that_modifies_them(
        monkeypatch, tmp_path):
    """run_check hashes the input set before the implementation runs and once after it:
    every reference lookup of the check keys by the second hash (no rehash per lookup),
    and an implementation that writes into its inputs fails, named so."""
    from oracle.core import checks, refcache

    monkeypatch.setenv(refcache.ENV, str(tmp_path))
    case = Case("attention_decode", "tiny", "normal", "cuda", "fp8", "bfloat16", "slot", seed=3)
    x = make_inputs(case)
    (torch_impl,) = implementations(case.op, ["torch"])
    hashed = []
    monkeypatch.setattr(checks, "input_hash", lambda inputs: hashed.append(1) or
                        input_hash(inputs))
    assert run_check(case, torch_impl, x).passed
    assert len(hashed) == 2 and refcache.default_cache().misses >= 2

    def writes_q(inputs):
        out = torch_impl.run(inputs)
        inputs["q"].flat[0] += 1.0
        return out

    sloppy = dataclasses.replace(torch_impl, name="writes_q", run=writes_q)
    r = run_check(case, sloppy, x)
    assert not r.passed and "the implementation modified its inputs" in r.failures
