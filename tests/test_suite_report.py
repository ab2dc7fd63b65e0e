"""The suite's JSON report (every pytest run's, and ``--suite-report PATH``:
oracle/tools/suite.py, oracle/tools/pytest_gate.py)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from oracle.core.render import markdown
from oracle.core.report import load
from oracle.tools.suite import SuiteRecorder
from tests.test_plugins import PLUGIN

ROOT = Path(__file__).resolve().parents[1]


def test_report_holds_every_check_outcome_and_replay(tmp_path):
    """A differential run over a correct and a broken plugin writes one report that the
    oracle's loader accepts: one cell per (op, impl, platform, format, class, dist) with the
    checks' counts, every test's outcome (the broken plugin's tests failed, the correct
    one's passed), and each failure with its replay command."""
    (tmp_path / "my_kernels.py").write_text(PLUGIN)
    path = tmp_path / "suite.json"
    env = {**os.environ, "ORACLE_PLUGINS": "my_kernels", "PYTEST_ADDOPTS": "",
           "PYTHONPATH": os.pathsep.join([str(tmp_path), str(ROOT)])}
    run = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
         "tests/test_differential.py", "-k", "plugin", "--suite-report", str(path),
         "--last-run", str(tmp_path / "last.json")],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 1, run.stdout[-2000:] + run.stderr[-2000:]
    doc = load(path)
    assert load(tmp_path / "last.json")["cells"] == doc["cells"]  # every run writes it
    tests = doc["suite"]["tests"]
    exact = {k: v for k, v in tests.items() if "plugin_exact" in k}
    broken = {k: v for k, v in tests.items() if "plugin_broken" in k}
    assert exact and set(exact.values()) == {"passed"}
    assert len(broken) == len(exact) and "failed" in set(broken.values())
    assert doc["suite"]["outcomes"]["passed"] + doc["suite"]["outcomes"]["failed"] == len(tests)
    cells = {c["impl"]: c for c in doc["cells"] if c["impl"] == "plugin_exact"}
    assert cells and all(c["passed"] == c["cases"] for c in doc["cells"]
                         if c["impl"] == "plugin_exact")
    assert sum(c["cases"] for c in doc["cells"]) == len(tests)
    fails = doc["failures"]
    assert len(fails) == list(broken.values()).count("failed")
    assert all(f["impl"] == "plugin_broken" and "oracle replay" in f["replay"] for f in fails)
    assert {f["test"] for f in doc["suite"]["failed"]} == {
        k for k, v in broken.items() if v == "failed"}
    by_file = doc["suite"]["seconds_by_file"]
    assert list(by_file) == ["tests/test_differential.py"]
    assert by_file["tests/test_differential.py"] == pytest.approx(
        doc["suite"]["test_seconds"], abs=0.05)
    text = markdown(doc)
    assert f"{doc['suite']['outcomes']['failed']} failed" in text
    assert all(f"FAILED `{f['test']}`" in text for f in doc["suite"]["failed"])


def _report(when, outcome, duration=1.0, props=()):
    return SimpleNamespace(nodeid="t::x[a|b]@group", when=when, duration=duration,
                           failed=outcome == "failed", skipped=outcome == "skipped",
                           longrepr="E   boom\nt.py:1: AssertionError" if outcome == "failed"
                           else None, user_properties=list(props))


def test_recorder_classifies_phases(tmp_path):
    """A test's seconds add over its phases; a failing setup is an error, a failing call a
    failure (with the last line of its traceback), a skip a skip."""
    for phases, outcome in (((("setup", "passed"), ("call", "passed")), "passed"),
                            ((("setup", "failed"),), "error"),
                            ((("setup", "passed"), ("call", "failed")), "failed"),
                            ((("setup", "skipped"),), "skipped")):
        rec = SuiteRecorder(tmp_path / "r.json")
        for when, what in phases:
            rec.pytest_runtest_logreport(_report(when, what))
        row = rec.report()["suite"]
        assert row["tests"] == {"t::x[a|b]": outcome}  # without xdist's group suffix
        assert row["test_seconds"] == len(phases)
        if outcome in ("failed", "error"):
            assert row["failed"][0]["message"] == "t.py:1: AssertionError"


def test_scaleout_report_divides_the_one_gpu_wall_time(tmp_path, capsys):
    """``oracle scaleout``: each scaleout-W-G.json suite report becomes one run (workers and
    GPUs from its name) whose speedup is the 1-worker 1-GPU run's wall time over its own;
    a report without the baseline, or misnamed, is refused."""
    import json

    from oracle.tools import suite
    from oracle.tools.cli import main

    def run(name, wall):
        p = tmp_path / name
        p.write_text(json.dumps({"machine": {"device": "X"}, "suite": {
            "wall_seconds": wall, "test_seconds": 2 * wall, "outcomes": {"passed": 3}}}))
        return str(p)

    paths = [run("scaleout-2-2.json", 25.0), run("scaleout-1-1.json", 60.0),
             run("scaleout-2-1.json", 40.0)]
    out = tmp_path / "s.json"
    assert main(["scaleout", *paths, "--subset", "k", "--warm", "w", "--out", str(out)]) == 0
    doc = json.loads(out.read_text())
    assert [(r["workers"], r["gpus"], r["speedup_vs_1_gpu"]) for r in doc["runs"]] == \
        [(1, 1, 1.0), (2, 1, 1.5), (2, 2, 2.4)]
    assert "| 2 | 2 | 25.00 |" in out.with_suffix(".md").read_text()
    with pytest.raises(ValueError, match="baseline"):
        suite.scaleout(paths[::2], "k", "w")
    with pytest.raises(ValueError, match="scaleout-W-G"):
        suite.scaleout([str(tmp_path / "s.json")], "k", "w")


def test_parts_of_a_run_merge_into_the_report_of_the_whole_run(tmp_path):
    """A suite split over device calls (``.ci/gpu suite`` with SUITE_PART) is joined by
    ``oracle.tools.suite.merge``: the parts' tests, outcomes, failures and differential cells
    (one cell split over both parts: counts summed, maxima kept, every case kept) equal
    the report a single recorder of all their tests writes; the seconds are the parts'
    sums; parts sharing a test are refused."""
    from oracle.core.cases import Case
    from oracle.core.checks import run_check
    from oracle.core.registry import implementations
    from oracle.tools.suite import merge

    (impl,) = implementations("norm_rope_insert", ["torch"])
    checks = [run_check(Case("norm_rope_insert", "tiny", "normal", "cuda", "fp8", "bfloat16",
                             "tensor", seed=s), impl) for s in range(3)]
    tests = [(f"t{i}::x[{i}]", "passed", (SuiteRecorder.check_property(r),))
             for i, r in enumerate(checks)] + [("u::y", "failed", ())]
    whole, parts = SuiteRecorder(tmp_path / "w.json"), [SuiteRecorder(tmp_path / f"{i}.json")
                                                        for i in range(2)]
    for i, (nodeid, outcome, props) in enumerate(tests):
        for rec in (whole, parts[i % 2]):
            rep = _report("call", outcome, duration=0.5 + i, props=props)
            rec.pytest_runtest_logreport(SimpleNamespace(**{**vars(rep), "nodeid": nodeid}))
    a, b, w = parts[0].report(), parts[1].report(), whole.report()
    m = merge([a, b])
    assert len(w["cells"]) == 1 and len(a["cells"]) == len(b["cells"]) == 1
    for key in ("tests", "outcomes", "failed", "seconds_by_file"):
        assert m["suite"][key] == w["suite"][key], key
    assert m["suite"]["test_seconds"] == pytest.approx(w["suite"]["test_seconds"])
    assert m["suite"]["wall_seconds"] == pytest.approx(a["seconds"] + b["seconds"], abs=0.02)
    (mc,), (wc,) = m["cells"], w["cells"]
    for key in ("cases", "passed", "elements", "exact", "violations", "ulp_hist",
                "max_err_over_bound", "max_abs_err", "rmse"):
        assert mc[key] == pytest.approx(wc[key]), key
    assert sorted(c["case"] for c in mc["per_case"]) == sorted(c["case"] for c in wc["per_case"])
    assert m["failures"] == w["failures"] and m["cases"] == w["cases"]
    with pytest.raises(ValueError, match="share 1 tests"):
        merge([a, a | {"suite": {**a["suite"], "tests": {"t0::x[0]": "passed"}}}])
