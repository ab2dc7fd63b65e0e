"""The false-alarm run (oracle/tools/falsealarm.py)."""

from __future__ import annotations

import json

import numpy as np
import pytest

from oracle.tools import falsealarm
from oracle.tools.cli import main
from tests.helpers import register_broken_attention


def test_draws_are_valid_reproducible_and_cover_the_domain():
    """The same (op, n, seed) draws the same cases; every case is valid for its op; over
    200 draws every distribution the op takes and every platform appear."""
    a = falsealarm.draw_cases("attention_decode", 200, seed=3)
    assert [c.id for c in a] == [c.id for c in falsealarm.draw_cases("attention_decode", 200, 3)]
    assert {c.dist for c in a} == {"normal", "outliers", "near_overflow", "tiny"}
    assert {c.platform for c in a} == {"cuda", "rocm-ocp", "rocm-fnuz"}
    assert {c.dist for c in falsealarm.draw_cases("indexer_prefill", 200)} >= {"ties"}
    assert [c.id for c in falsealarm.draw_cases("attention_decode", 20, seed=4)] != [
        c.id for c in a[:20]]


def test_calibration_of_a_statistic():
    """Per (op, impl): the max, the calibrated multiplier (max x MARGIN), how many clean
    checks exceed the customary gate and whether that gate may be used with the margin."""
    rows = [{"op": "attention_decode", "impl": "k", "passed": True,
             "stats": {"fa_ratio": v, "prob_ratio": v / 4}} for v in (0.5, 1.0, 2.5)]
    rows.append({"op": "attention_decode", "impl": "k", "passed": False, "stats": {}})
    (cell,) = falsealarm.summarize(rows)
    assert cell["checks"] == 4 and cell["failures"] == 1
    fa = cell["stats"]["fa_ratio"]
    assert fa["max"] == 2.5 and fa["calibrated"] == 2.5 * falsealarm.MARGIN
    assert fa["over_customary"] == 1 and fa["may_gate_at_customary"] is False
    pr = cell["stats"]["prob_ratio"]
    assert pr["max"] == 0.625 and pr["may_gate_at_customary"] is True
    rows[0]["stats"]["fa_ratio"] = float("nan")  # undefined: counted, not calibrated
    (cell,) = falsealarm.summarize(rows)
    assert cell["stats"]["fa_ratio"]["undefined"] == 1 and cell["stats"]["fa_ratio"]["n"] == 2


def test_clean_run_has_no_failures_and_a_broken_kernel_shows(tmp_path, monkeypatch):
    """A few clean cases through the torch baseline raise no failure; the same run over a
    copy of the baseline that drops the last selected block counts failures with their
    replay commands (the run can fail)."""
    out = tmp_path / "fa.json"
    assert main(["falsealarm", "--cases", "4", "--ops", "attention_decode", "--impls",
                 "torch", "--out", str(out)]) == 0
    doc = json.loads(out.read_text())
    assert doc["failures"] == [] and doc["cells"][0]["checks"] == 4
    assert "fa_ratio" in doc["cells"][0]["stats"]

    name = register_broken_attention(monkeypatch)
    doc = falsealarm.run(["attention_decode"], 4, impl_names=[name])
    assert doc["failures"] and all("--impl broken_torch" in f["replay"]
                                   for f in doc["failures"])
    assert "FAIL" in falsealarm.markdown(doc)


def test_budget_keeps_ops_even_and_says_what_ran():
    """Cases are interleaved over the ops (a budget cut leaves each op about equally
    covered); an exhausted budget runs nothing and the report says so instead of claiming
    the drawn count."""
    a, b = falsealarm.draw_cases("attention_decode", 3), falsealarm.draw_cases("indexer_decode", 3)
    assert [c.op for c in falsealarm._interleaved([a, b])] == ["attention_decode",
                                                               "indexer_decode"] * 3
    doc = falsealarm.run(["attention_decode"], 3, impl_names=["torch"], seconds=-1.0)
    assert doc["cases_run"] == {"attention_decode": 0} and doc["cells"] == []
    assert "within the -1.0 s budget" in falsealarm.markdown(doc)


def test_nan_is_admitted_only_where_the_exact_output_is_infinite():
    """The false-alarm run's first find: with fp16 activations, e5m2 V x per-slot scale
    overflows to -Inf in the K/V dtype, so the exact output is -Inf, and the torch baseline
    (fp32 softmax: the P of far-below-max keys underflows to 0, 0 x -Inf = NaN) gives NaN.
    NaN is admitted where the exact value is +-Inf (and counted); NaN where it is finite
    is still a violation."""
    from oracle.core.cases import Case
    from oracle.core.checks import _nan_admitted_for_inf, run_check
    from oracle.core.registry import implementations
    from reference.codec import encode

    case = Case.from_id(
        "attention_prefill:tiny:near_overflow:rocm-ocp:fp8_e5m2:float16:slot:61771398")
    (torch_impl,) = implementations(case.op, ["torch"], "cpu")
    r = run_check(case, torch_impl)
    assert r.passed and r.extra["nan_for_inf"] > 0, r.summary()

    exact = np.array([-np.inf, 1.0, np.inf])
    nan = encode(np.full(3, np.nan), "float16")
    codes, n = _nan_admitted_for_inf(nan, exact, "float16")
    inf_codes = encode(exact, "float16", policy="nonsaturating")
    assert n == 2 and codes[0] == inf_codes[0] and codes[2] == inf_codes[2]
    assert codes[1] == nan[1]  # the finite exact value: NaN stays NaN, a violation


def test_runs_over_disjoint_ops_merge_into_one_report(tmp_path):
    """``falsealarm --merge``: two runs with the same settings over different ops join
    into one report holding both ops' cells and case counts, their seconds summed, and
    it equals the cells of one run over both ops; runs sharing an op, or with different
    seeds, are refused (percentiles cannot be joined without the raw rows)."""
    paths = []
    for op in ("reshape_and_cache", "indexer_decode"):
        paths.append(tmp_path / f"{op}.json")
        assert main(["falsealarm", "--cases", "3", "--ops", op, "--impls", "torch",
                     "--out", str(paths[-1])]) == 0
    out = tmp_path / "merged.json"
    assert main(["falsealarm", "--merge", *map(str, paths), "--out", str(out)]) == 0
    doc = json.loads(out.read_text())
    parts = [json.loads(p.read_text()) for p in paths]
    assert doc["cases_run"] == {"reshape_and_cache": 3, "indexer_decode": 3}
    assert doc["seconds"] == round(sum(p["seconds"] for p in parts), 2)
    both = falsealarm.run(["reshape_and_cache", "indexer_decode"], 3, impl_names=["torch"])
    assert [(c["op"], c["impl"], c["checks"], c["stats"]) for c in doc["cells"]] == [
        (c["op"], c["impl"], c["checks"], c["stats"]) for c in both["cells"]]
    with pytest.raises(ValueError, match="share ops"):
        falsealarm.merge([parts[0], parts[0]])
    with pytest.raises(ValueError, match="seed"):
        falsealarm.merge([parts[0], {**parts[1], "seed": 5}])


def test_false_alarm_cases_can_share_shape_configs():
    """``--configs N``: every drawn case takes one of the N configs of the seed's pool, the
    draw stays a pure function of its arguments, and without configs no case has one;
    ``pin_formats``: each case's format fields are its config's."""
    from oracle.core.cases import config_formats
    from oracle.tools.fuzz import config_pool

    a = falsealarm.draw_cases("attention_decode", 40, seed=2, configs=3)
    assert {c.config for c in a} <= set(config_pool(3, 2)) and len({c.config for c in a}) > 1
    assert a == falsealarm.draw_cases("attention_decode", 40, seed=2, configs=3)
    assert {c.config for c in falsealarm.draw_cases("attention_decode", 40, seed=2)} == {None}
    pinned = falsealarm.draw_cases("attention_decode", 40, seed=2, configs=3, pin_formats=True)
    assert all((c.platform, c.kv_cache_dtype, c.model_dtype, c.scales)
               == tuple(config_formats(c.op, c.shape_class, c.config).values()) for c in pinned)
