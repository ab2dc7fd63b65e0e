"""End-to-end accuracy cost of the KV cache formats (oracle/tools/e2e.py): that the exact step and
the cached runs compute what they claim, and the properties the report is read by, checked
on the output of ``python -m oracle e2e --quick``.

Thresholds come from the formats, not from measured values: bf16 keeps 8 significant bits
and e5m2 3 (relative steps 32x apart), e4m3 keeps 4 (2x finer than e5m2); each test leaves
a wide margin under those factors.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest

from oracle.tools import e2e
from reference.codec import FORMATS, decode
from reference.domain import MODEL
from reference.fused import fused_qknorm_rope_insert
from reference.kv_cache import quantize
from reference.pipeline import new_token_slots
from tests.helpers import assert_close

MODES = ("prefill", "decode")
DISTS = ("normal", "outliers", "near_overflow", "tiny")
# kv format -> (platform, index cache format): contract.md s.2, written out independently here.
FORMAT_TABLE = {"bfloat16": ("cuda", "bfloat16"), "e4m3fn": ("cuda", "e4m3fn"),
                "e5m2": ("cuda", "e4m3fn"), "e4m3fnuz": ("rocm-fnuz", "e4m3fnuz"),
                "e5m2fnuz": ("rocm-fnuz", "e4m3fnuz")}


@pytest.fixture(scope="module")
def quick(tmp_path_factory):
    """``python -m oracle e2e --quick`` run once, as a user runs it: (process, JSON, Markdown)."""
    out = tmp_path_factory.mktemp("e2e") / "quick.json"
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    r = subprocess.run([sys.executable, "-m", "oracle", "e2e", "--quick", "--quiet", "--out",
                        str(out)], capture_output=True, text=True, env=env)
    assert r.returncode == 0, r.stdout + r.stderr
    return r, json.loads(out.read_text()), out.with_suffix(".md").read_text()


def _row(doc, mode, dist, fmt, scales="amax"):
    scales = "none" if fmt == "bfloat16" else scales
    found = [r for r in doc["rows"] if (r["mode"], r["dist"], r["kv_fmt"], r["scales"]) ==
             (mode, dist, fmt, scales)]
    assert len(found) == 1, (mode, dist, fmt, scales)
    return found[0]


# ------------------------------------------------------------------------------ the CLI


def test_cli_quick_writes_json_and_markdown_covering_every_format(quick):
    """`python -m oracle e2e --quick` exits 0 and writes a JSON whose rows are exactly every
    (mode, distribution, format, scale) -- bf16 once without scales, each of the four fp8
    formats with amax and unit scales -- each with its platform and the index format contract.md
    s.2 pairs with it, finite non-negative metrics, positive scales where amax applies;
    the Markdown beside it has one table line per row."""
    r, doc, md = quick
    want = {(m, d, f, s) for m in MODES for d in DISTS for f in FORMAT_TABLE
            for s in (("none",) if f == "bfloat16" else ("amax", "unit"))}
    got = [(x["mode"], x["dist"], x["kv_fmt"], x["scales"]) for x in doc["rows"]]
    assert sorted(got) == sorted(want)
    for x in doc["rows"]:
        assert (x["platform"], x["index_fmt"]) == FORMAT_TABLE[x["kv_fmt"]]
        for key in ("rel_rmse", "max_abs_rel", "rel_rmse_exact_selection"):
            assert np.isfinite(x[key]) and x[key] >= 0, (key, x)
        assert 0 <= x["topk_changed"] <= 1
        scaled = x["scales"] == "amax"
        assert (x["k_scale"] is not None and x["k_scale"] > 0) == scaled
        assert (x["v_scale"] is not None and x["v_scale"] > 0) == scaled
    table = [line for line in md.splitlines() if line.startswith(("| prefill |", "| decode |"))]
    assert len(table) == len(doc["rows"])
    assert doc["quick"] is True and doc["schema"] == e2e.SCHEMA


# ------------------------------------------------------------------------- properties


@pytest.mark.parametrize("mode", MODES)
def test_bf16_cache_error_is_far_below_e5m2s_on_normal_data(quick, mode):
    """On normal data the bf16 cache costs far less than e5m2 (8 vs 3 significant bits):
    with the exact selection its relative RMSE is below an eighth of e5m2's; end to end
    (its bf16 index cache against e5m2's e4m3 one) below half, with no more selection
    changes."""
    _, doc, _ = quick
    bf, e5 = _row(doc, mode, "normal", "bfloat16"), _row(doc, mode, "normal", "e5m2")
    assert bf["rel_rmse_exact_selection"] < e5["rel_rmse_exact_selection"] / 8
    assert bf["rel_rmse"] < e5["rel_rmse"] / 2
    assert bf["topk_changed"] <= e5["topk_changed"]


@pytest.mark.parametrize("e4m3, e5m2", [("e4m3fn", "e5m2"), ("e4m3fnuz", "e5m2fnuz")])
@pytest.mark.parametrize("mode", MODES)
def test_e4m3_has_lower_error_than_e5m2_on_normal_data(quick, mode, e4m3, e5m2):
    """One more mantissa bit: on normal data with amax scales, e4m3's KV values cost less
    than e5m2's on the same platform (below 1/1.4 of it with the exact selection), and so
    does the whole step (both read the same e4m3 index cache, so their selections agree)."""
    _, doc, _ = quick
    a, b = _row(doc, mode, "normal", e4m3), _row(doc, mode, "normal", e5m2)
    assert a["rel_rmse_exact_selection"] < b["rel_rmse_exact_selection"] / 1.4
    assert a["topk_changed"] == b["topk_changed"]
    assert a["rel_rmse"] < b["rel_rmse"]


@pytest.mark.parametrize("mode", MODES)
def test_unit_scale_saturates_e4m3fnuz_on_near_overflow_values(quick, mode):
    """near_overflow V lies around +-448, above e4m3fnuz's max 240: with unit scale it
    saturates, which costs at least 3x the amax-scaled error, and more than e4m3fn with
    unit scale (max 448: only the values past 448 clip)."""
    _, doc, _ = quick
    unit = _row(doc, mode, "near_overflow", "e4m3fnuz", "unit")["rel_rmse_exact_selection"]
    amax = _row(doc, mode, "near_overflow", "e4m3fnuz", "amax")["rel_rmse_exact_selection"]
    fn_unit = _row(doc, mode, "near_overflow", "e4m3fn", "unit")["rel_rmse_exact_selection"]
    assert unit > 3 * amax and unit > fn_unit


# ---------------------------------------------------------------------- the machinery


def _case(mode="prefill", dist="normal", seed=0):
    return e2e.make_case(mode, dist, seed, e2e.QUICK)


def test_exact_step_against_itself_has_zero_error_and_the_metrics_see_a_change():
    """Two builds of the same seed give the same exact step: relative RMSE, max error and
    selection changes are all exactly 0. The metrics are not blind: one output element
    moved, or one block of one selection swapped for an unselected visible block, shows
    up (the swap as exactly one changed selection); another seed gives other inputs."""
    a, b = e2e.exact_step(_case()), e2e.exact_step(_case())
    assert e2e.rel_rmse(a["out"], b["out"]) == 0 and e2e.max_abs_rel(a["out"], b["out"]) == 0
    assert e2e.selection_change_fraction(a["topk"], b["topk"]) == 0
    moved = b["out"].copy()
    moved[3, 1, 2] += 1e-3
    assert e2e.rel_rmse(moved, a["out"]) > 0 and e2e.max_abs_rel(moved, a["out"]) > 0
    topk = b["topk"].copy()
    t = topk.shape[1] - 1  # the last row of the last request sees the most blocks
    unselected = sorted(set(range(topk.shape[2] + 1)) - set(topk[0, t].tolist()))
    topk[0, t, -1] = unselected[0]
    assert e2e.selection_change_fraction(topk, a["topk"]) == 1 / (topk.shape[0] * topk.shape[1])
    assert not np.array_equal(_case(seed=1)["rows"], _case()["rows"])


@pytest.mark.parametrize("fmt, index_fmt, scales", [("bfloat16", "bfloat16", "none"),
                                                    ("e5m2fnuz", "e4m3fnuz", "amax"),
                                                    ("e4m3fn", "e4m3fn", "unit")])
@pytest.mark.parametrize("mode", MODES)
def test_value_step_on_a_pipelines_decoded_caches_reproduces_that_pipeline(mode, fmt,
                                                                           index_fmt, scales):
    """The exact step's code (``value_step``), fed the values a reference pipeline run's
    caches hold (decoded, scales applied) with that run's q and index_q, gives that run's
    selection bit for bit and its output to float64 rounding: the exact step and the
    cached runs differ only in the values they read."""
    case = _case(mode)
    exact = e2e.exact_values(case)
    ks, vs = e2e.case_scales(exact, fmt, scales)
    res = e2e.run_cached(case, exact, fmt, index_fmt, ks, vs)
    out, topk = e2e.value_step(case, e2e.cached_values(case, res, fmt, index_fmt, ks, vs))
    assert np.array_equal(topk, res.topk)
    assert_close(out, res.out)


@pytest.mark.parametrize("fmt, index_fmt, scales", [("bfloat16", "bfloat16", "none"),
                                                    ("e4m3fn", "e4m3fn", "amax"),
                                                    ("e5m2fnuz", "e4m3fnuz", "unit")])
def test_prefix_write_equals_the_fused_op(fmt, index_fmt, scales):
    """``write_prefixes`` leaves the same codes in both caches (every byte, poison included)
    as calling the reference fused op on each request's prefix rows at its positions."""
    case = _case("prefill", "outliers")
    exact = e2e.exact_values(case)
    ks, vs = e2e.case_scales(exact, fmt, scales)
    kv, ic = e2e.empty_caches(case, fmt, index_fmt)
    e2e.write_prefixes(case, exact, kv, fmt, ic, index_fmt, ks, vs)
    kv2, ic2 = e2e.empty_caches(case, fmt, index_fmt)
    cfg = case["cfg"]
    for r, idx in enumerate(case["prefix_rows"]):
        pos, req = np.arange(idx.size), np.full(idx.size, r)
        fused_qknorm_rope_insert(
            case["rows"][idx], pos, case["layout"], case["weights"], case["table"],
            cfg.rotary_dim, MODEL.eps, "bfloat16", kv2, fmt,
            new_token_slots(case["block_table"], req, pos, cfg.page, case["num_pages"]), ks, vs,
            ic2, index_fmt,
            new_token_slots(case["index_block_table"], req, pos, cfg.page, case["num_pages"]))
    assert np.array_equal(kv, kv2) and np.array_equal(ic, ic2)


@pytest.mark.parametrize("fmt", ["e4m3fn", "e5m2", "e4m3fnuz", "e5m2fnuz"])
def test_amax_scale_maps_the_largest_value_to_the_formats_max(fmt):
    """The amax scales divide: the largest |K| and |V| encode to the format's max finite
    value (within float32 rounding of the scale), and nothing lands past it."""
    exact = e2e.exact_values(_case("decode", "outliers"))
    ks, vs = e2e.case_scales(exact, fmt, "amax")
    top = FORMATS[fmt].max_finite
    for values, scale in ((np.concatenate(exact["k"]), ks), (np.concatenate(exact["v"]), vs)):
        dec = np.abs(decode(quantize(values, fmt, scale), fmt))
        assert dec.max() == top
        assert np.max(np.abs(values)) / scale == pytest.approx(top, rel=1e-6)


def test_selection_depends_only_on_the_index_format():
    """e4m3fn and e5m2 KV caches come with the same e4m3fn index cache: their runs select
    identical blocks, whatever the KV format and its scales."""
    case = _case("decode", "normal")
    exact = e2e.exact_values(case)
    runs = [e2e.run_cached(case, exact, fmt, "e4m3fn", *e2e.case_scales(exact, fmt, "amax"))
            for fmt in ("e4m3fn", "e5m2")]
    assert np.array_equal(runs[0].topk, runs[1].topk)
    assert not np.array_equal(runs[0].out, runs[1].out)


# ------------------------------------------------------------- the kernel pipeline

# Relative half-ulp of bf16 (8 significant bits): RNE moves a value by at most 2^-9 of it.
BF16_HALF_ULP = 2.0**-9


def _without_seconds(rows):
    return [{**r, "kernel": {k: v for k, v in r["kernel"].items() if k != "seconds"}}
            for r in rows]


def _reference_impls(modes=MODES):
    return e2e.resolve_impls("reference", modes, "cpu")


def test_reference_impls_reproduce_the_reference_columns(quick):
    """`python -m oracle e2e --quick` (default --impl reference) runs the registered
    reference ops through the kernel plumbing on every row: they select exactly the
    reference pipeline's blocks (same top-k changes, no selection differs) and return its
    output rounded once to bf16 bit for bit (vs-reference RMSE 0; their metrics equal those
    of the rounded reference output exactly), so their rel RMSE and max error differ from
    the unrounded reference's only by that rounding: at most 2^-9 of the output (triangle
    inequality). The Markdown shows both pipelines' numbers on each row's line."""
    _, doc, md = quick
    assert doc["impl"] == "reference" and doc["shape_classes"] == {"prefill": "small",
                                                                   "decode": "small"}
    assert "| rel RMSE ref / reference |" in md
    lines = [line for line in md.splitlines() if line.startswith(("| prefill |", "| decode |"))]
    for r, line in zip(doc["rows"], lines, strict=True):
        k = r["kernel"]
        assert k["status"] == "ran" and k["impl"] == "reference", k
        assert k["topk_changed"] == r["topk_changed"] and k["topk_vs_reference"] == 0
        assert k["rel_rmse_vs_reference"] == 0
        assert k["rel_rmse_vs_reference_same_selection"] == 0
        assert k["rel_rmse"] == k["rel_rmse_ref_rounded"]
        assert k["max_abs_rel"] == k["max_abs_rel_ref_rounded"]
        assert abs(k["rel_rmse"] - r["rel_rmse"]) <= BF16_HALF_ULP * (1 + r["rel_rmse"])
        assert abs(k["max_abs_rel"] - r["max_abs_rel"]) <= BF16_HALF_ULP * (
            1 + r["max_abs_rel"])
        assert f"| {r['rel_rmse']:.2e} / {k['rel_rmse']:.2e} |" in line


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("fmt, index_fmt, scales", [("bfloat16", "bfloat16", "none"),
                                                    ("e4m3fn", "e4m3fn", "amax"),
                                                    ("e5m2fnuz", "e4m3fnuz", "unit")])
def test_kernel_step_with_reference_ops_leaves_the_pipelines_state(mode, fmt, index_fmt,
                                                                   scales):
    """``kernel_step`` through the registered reference ops ends in the reference
    pipeline's state, bit for bit: both caches (the index cache written through the KV
    cache's page order and put back: ``kv_to_index_pages``), q, index_q (decoded from the
    op's codes) and the selection equal ``run_cached``'s, and its output is the reference
    output rounded once to bf16. ``kv_to_index_pages`` maps every KV page to the index
    page of the same (request, block), one to one."""
    case = _case(mode)
    exact = e2e.exact_values(case)
    exact["out"], exact["topk"] = e2e.value_step(case, exact)
    ks, vs = e2e.case_scales(exact, fmt, scales)
    res = e2e.run_cached(case, exact, fmt, index_fmt, ks, vs)
    k = e2e.kernel_step(case, exact, fmt, index_fmt, _reference_impls((mode,)), ks, vs)
    perm = e2e.kv_to_index_pages(case)
    assert sorted(perm) == list(range(case["num_pages"]))
    assert np.array_equal(perm[case["block_table"]], case["index_block_table"])
    assert np.array_equal(k["kv_cache"], res.fused["kv_cache"])
    assert np.array_equal(k["index_cache"], res.fused["index_cache"])
    assert np.array_equal(k["q"], res.fused["q"])
    assert np.array_equal(k["index_q"], res.fused["index_q_values"])
    assert np.array_equal(k["topk"], res.topk)
    assert np.array_equal(k["out"], e2e.round_to(res.out, "bfloat16"))


def _drop_a_block(impl):
    """``impl`` with a bug: every selection loses one of its blocks (its first valid
    entry becomes -1) when it has two or more."""
    from dataclasses import replace

    def run(x):
        topk = np.array(impl.run(x)["topk"])
        valid = topk >= 0
        first = np.argmax(valid, axis=-1)[..., None]
        drop = (valid.sum(axis=-1) >= 2)[..., None]
        np.put_along_axis(topk, first, np.where(drop, -1, np.take_along_axis(
            topk, first, axis=-1)), axis=-1)
        return {"topk": topk}

    return replace(impl, name=f"{impl.name}-drops-a-block", run=run)


def test_a_broken_implementation_is_visible_in_the_table():
    """A pipeline whose indexer drops one selected block from each selection (the
    reference ops otherwise) shows up in the report: every one of its selections differs
    from the reference pipeline's, its rel RMSE is over 10x the reference's on a bf16
    cache (where the reference costs ~2e-3), and the Markdown line shows both numbers."""
    impls = _reference_impls(("decode",))
    impls["indexer_decode"] = _drop_a_block(impls["indexer_decode"])
    doc = e2e.run(config=e2e.TINY, modes=("decode",), dists=("normal",),
                  caches=(("bfloat16", "cuda"), ("fp8_e4m3", "cuda")), scale_kinds=("amax",),
                  impls=impls, impl="drops-a-block", progress=False)
    md = e2e.markdown(doc)
    assert "| rel RMSE ref / drops-a-block |" in md
    for r in doc["rows"]:
        k = r["kernel"]
        assert k["status"] == "ran" and k["topk_vs_reference"] == 1.0
        assert k["rel_rmse_vs_reference_same_selection"] is None
        assert k["rel_rmse"] > 10 * r["rel_rmse"] and k["rel_rmse_vs_reference"] > 0.1
        assert f"| {r['rel_rmse']:.2e} / {k['rel_rmse']:.2e} |" in md


def test_unclaimed_configurations_are_reported_as_skipped():
    """A configuration the pipeline's implementations do not all claim is a skipped row
    with every reason, never a dropped one: an attention that claims only the cuda
    platform runs the cuda rows and skips the rocm-fnuz ones ("platform rocm-fnuz"); an op
    with no implementation of the name skips every row, naming the op. The Markdown marks
    the rows skipped and lists the reasons."""
    from dataclasses import replace

    impls = _reference_impls(("decode",))
    impls["attention_decode"] = replace(impls["attention_decode"], platforms=("cuda",))
    caches = (("fp8_e4m3", "cuda"), ("fp8_e4m3", "rocm-fnuz"))
    args = dict(config=e2e.TINY, modes=("decode",), dists=("normal",), caches=caches,
                scale_kinds=("amax",), progress=False)
    doc = e2e.run(impls=impls, impl="cuda-only", **args)
    status = {r["platform"]: r["kernel"] for r in doc["rows"]}
    assert status["cuda"]["status"] == "ran"
    assert status["rocm-fnuz"]["status"] == "skipped"
    assert "attention_decode 'reference' does not claim platform rocm-fnuz" in status[
        "rocm-fnuz"]["reason"]
    md = e2e.markdown(doc)
    assert "/ skipped |" in md and "platform rocm-fnuz" in md
    impls["indexer_decode"] = "no implementation 'x' of indexer_decode"
    doc = e2e.run(impls=impls, impl="x", **args)
    assert [r["kernel"]["status"] for r in doc["rows"]] == ["skipped", "skipped"]
    assert all("of indexer_decode" in r["kernel"]["reason"] for r in doc["rows"])
    md = e2e.markdown(doc)
    assert "- decode (1 row): no implementation 'x' of indexer_decode\n" in md
    assert ("- decode (1 row): no implementation 'x' of indexer_decode; "
            "attention_decode 'reference' does not claim platform rocm-fnuz") in md


def test_resolve_impls_names_what_does_not_run_here(monkeypatch):
    """``resolve_impls`` takes a name's implementation of each op of the step when it runs
    on this machine (its devices include this one, or it is a CPU implementation, which
    runs anywhere: the reference on a CUDA machine too) and says why not otherwise: an
    op with no implementation of the name, or one that needs another device."""
    from dataclasses import replace

    from oracle.core import registry
    from oracle.impls.catalog import load_all

    load_all()
    fake = replace(registry.REGISTRY["attention_decode"]["reference"], name="gpu-only",
                   devices=("cuda",))
    monkeypatch.setitem(registry.REGISTRY["attention_decode"], "gpu-only", fake)
    found = e2e.resolve_impls("gpu-only", ("decode",), "cpu")
    assert found == {"norm_rope_insert": "no implementation 'gpu-only' of norm_rope_insert",
                     "indexer_decode": "no implementation 'gpu-only' of indexer_decode",
                     "attention_decode": "attention_decode 'gpu-only' needs cuda, not cpu"}
    assert e2e.resolve_impls("gpu-only", ("decode",), "cuda")["attention_decode"] is fake
    ref = e2e.resolve_impls("reference", MODES, "cuda")
    assert sorted(ref) == sorted({op for m in MODES for op in e2e.pipeline_ops(m)})
    assert all(not isinstance(i, str) and i.name == "reference" for i in ref.values())


def test_nearest_shape_class_follows_the_case_classes_limits():
    """The nearest case's shape class is the smallest whose per-request context and new
    tokens cover the step: TINY is tiny, QUICK small, DEFAULT model in both modes; one
    token past the model class's 8k context is long (sweep for the insert op); more new
    tokens than the class allows (25 > tiny's 24) move a prefill up a class."""
    for cfg, name in ((e2e.TINY, "tiny"), (e2e.QUICK, "small"), (e2e.DEFAULT, "model")):
        assert {e2e.nearest_shape_class(cfg, m) for m in MODES} == {name}
    from dataclasses import replace

    big = replace(e2e.DEFAULT, contexts=(8193,))
    assert e2e.nearest_shape_class(big, "decode") == "long"
    assert e2e.nearest_shape_class(big, "decode", "norm_rope_insert") == "sweep"
    wide = replace(e2e.TINY, prefixes=(1,), new_tokens=(25,))
    assert e2e.nearest_shape_class(wide, "prefill") == "small"
    case = e2e.nearest_case("attention_decode", "decode", "tiny", 3, e2e.QUICK, "fp8_e5m2",
                            "rocm-fnuz", "amax")
    assert case.id == "attention_decode:small:tiny:rocm-fnuz:fp8_e5m2:bfloat16:tensor:3"


@pytest.mark.interp
@pytest.mark.filterwarnings("ignore:Conversion of an array:DeprecationWarning")
def test_triton_pipeline_is_close_to_the_reference_pipeline():
    """The project's Triton kernels (interpreted on a CPU machine) as one pipeline on TINY
    (shape class tiny, which they all claim), both modes, a bf16 and two fp8 caches (OCP
    and fnuz) with amax scales: every row runs; its metrics are finite; it selects the
    reference pipeline's blocks (no fp32 near-tie in these inputs flips one, the float64
    scores' order is kept); and its output is within 1e-2 rel RMSE of the reference
    pipeline's rounded to bf16. The tolerance: the kernel rounds P to bf16 and its output to
    bf16 and the comparison output is rounded once more, each at most 2^-9 relative per
    element (fp16 q of the fp8 schedule: 2^-11), so at most ~3.3 * 2^-9 = 6.4e-3 even if
    every rounding hit its bound; a dropped or swapped block costs 1e-1 and more (see the
    test above). Hence also the top-k changes equal the reference's and the rel RMSE
    against the exact step is within 1e-2 + 2^-9 of the reference's."""
    caches = (("bfloat16", "cuda"), ("fp8_e4m3", "cuda"), ("fp8_e5m2", "rocm-fnuz"))
    doc = e2e.run(config=e2e.TINY, dists=("normal",), caches=caches, scale_kinds=("amax",),
                  impl="triton", progress=False)
    assert doc["impl"] == "triton" and len(doc["rows"]) == 2 * len(caches)
    for r in doc["rows"]:
        k = r["kernel"]
        assert k["status"] == "ran", k
        for key in ("rel_rmse", "max_abs_rel", "rel_rmse_vs_reference"):
            assert np.isfinite(k[key]) and k[key] >= 0, (key, k)
        assert k["topk_vs_reference"] == 0 and k["topk_changed"] == r["topk_changed"]
        assert k["rel_rmse_vs_reference"] < 1e-2, (r["mode"], r["kv_fmt"], k)
        assert abs(k["rel_rmse"] - r["rel_rmse"]) <= (1e-2 + BF16_HALF_ULP) * (
            1 + r["rel_rmse"])


def test_workers_give_the_same_rows_as_one_process():
    """--workers N spreads the (mode, distribution) pairs over spawned processes, each
    resolving the implementations by name itself: the rows are the same, in the same
    order, as in one process (their timings aside)."""
    args = dict(config=e2e.TINY, modes=("decode",), dists=("normal", "tiny"),
                caches=(("fp8_e5m2", "cuda"),), scale_kinds=("unit",), impl="reference",
                device="cpu", progress=False)
    one, two = e2e.run(**args), e2e.run(workers=2, **args)
    assert _without_seconds(two["rows"]) == _without_seconds(one["rows"])


@pytest.mark.parametrize("args, needle", [(("--impl", "nosuch"), "impls must be among"),
                                          (("--modes", "sideways"), "modes must be among"),
                                          (("--workers", "0"), "workers must be >= 1")])
def test_cli_rejects_bad_e2e_arguments_with_one_line(tmp_path, args, needle):
    """Bad --impl / --modes / --workers exit 2 with one error line, no traceback, and
    write nothing."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    r = subprocess.run([sys.executable, "-m", "oracle", "e2e", "--tiny", "--quiet",
                        "--out", str(tmp_path / "e2e.json"), *args], capture_output=True,
                       text=True, env=env)
    assert r.returncode == 2 and needle in r.stderr and "Traceback" not in r.stderr, r.stderr
    assert not list(tmp_path.iterdir())
