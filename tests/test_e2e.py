"""End-to-end accuracy cost of the KV cache formats (oracle/e2e.py): that the exact step and
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

from oracle import e2e
from reference.codec import FORMATS, decode
from reference.domain import MODEL
from reference.fused import fused_qknorm_rope_insert
from reference.kv_cache import quantize
from reference.pipeline import new_token_slots
from tests.helpers import assert_close

MODES = ("prefill", "decode")
DISTS = ("normal", "outliers", "near_overflow", "tiny")
# kv format -> (platform, index cache format): SPEC.md s.2, written out independently here.
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
    formats with amax and unit scales -- each with its platform and the index format SPEC.md
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
