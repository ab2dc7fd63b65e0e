"""The test suite's JSON report: every pytest run's (oracle/tools/pytest_gate.py writes it to
``out/last-run-<kind>.json``, and to ``--suite-report PATH`` when given).

One file per run, in the oracle report's schema so that ``python -m oracle render`` and
``python -m oracle diff`` read it like a ``python -m oracle report`` run: the generic
differential test's checks become its cells (each test records its ``CheckResult`` as the
user property ``check``, which pytest-xdist carries from the workers), and a ``suite`` key
adds what only the test run knows: every test's outcome and seconds, the wall time, the
slowest tests and the failures with their replay commands.

Registered as a plugin of the controller (its ``pytest_runtest_logreport`` sees every
worker's reports), so ``pytest -m gpu -n N`` writes one report for the whole run.
"""

from __future__ import annotations

import json
import re
import time
from collections import Counter
from pathlib import Path

from oracle.core.cases import Case
from oracle.core.checks import CheckResult
from oracle.core.report import (
    SCHEMA,
    add_result,
    finished_cells,
    json_safe,
    machine_info,
    write_json,
)

CHECK_PROPERTY = "check"  # the user property holding a differential test's CheckResult


class SuiteRecorder:
    """Test outcomes and differential checks of one pytest session."""

    def __init__(self, path=None):
        self.path = path
        self.t0 = time.perf_counter()
        self.tests: dict[str, dict] = {}
        self.checks: list[dict] = []

    def pytest_runtest_logreport(self, report) -> None:
        """One phase's report (setup, call, teardown) of one test (a pytest hook: the
        recorder is registered as a plugin of the controller)."""
        # pytest-xdist's loadgroup appends "@group" to the node id: the test's id is before it.
        test = re.sub(r"@[^\]]*$", "", report.nodeid)
        row = self.tests.setdefault(test, {"outcome": "passed", "seconds": 0.0})
        row["seconds"] += report.duration
        if report.failed:
            row["outcome"] = "failed" if report.when == "call" else "error"
            row["message"] = str(report.longrepr).strip().splitlines()[-1][:500] \
                if report.longrepr else ""
        elif report.skipped and row["outcome"] == "passed":
            row["outcome"] = "skipped"
        for name, value in report.user_properties if report.when == "call" else ():
            if name == CHECK_PROPERTY:  # (every later phase's report repeats the item's)
                self.checks.append(value)

    def report(self) -> dict:
        cells: dict = {}
        failures = []
        for d in self.checks:
            r = CheckResult.from_dict(d)
            add_result(cells, Case.from_id(r.case), r)
            if not r.passed:
                failures.append({"case": r.case, "impl": r.impl, "summary": r.summary(),
                                 "replay": r.replay})
        wall = time.perf_counter() - self.t0
        outcomes = Counter(t["outcome"] for t in self.tests.values())
        slowest = sorted(self.tests.items(), key=lambda kv: -kv[1]["seconds"])[:20]
        return {
            "schema": SCHEMA, "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "machine": machine_info(), "seconds": round(wall, 2),
            "cases": len({d["case"] for d in self.checks}),
            "cells": finished_cells(cells),
            "failures": failures, "skipped": {},
            "suite": {
                "wall_seconds": round(wall, 2),
                "test_seconds": round(sum(t["seconds"] for t in self.tests.values()), 2),
                "outcomes": dict(outcomes),
                "slowest": [{"test": k, "seconds": round(v["seconds"], 2)} for k, v in slowest],
                "seconds_by_file": _seconds_by_file(self.tests),
                "failed": [{"test": k, **v} for k, v in self.tests.items()
                           if v["outcome"] in ("failed", "error")],
                "tests": {k: v["outcome"] for k, v in self.tests.items()},
            },
        }

    @staticmethod
    def check_property(r: CheckResult) -> tuple[str, dict]:
        """The user property a differential test records (plain JSON types: pytest-xdist
        carries it from the worker)."""
        return CHECK_PROPERTY, json_safe(r.as_dict())

    def write(self):
        return write_json(self.report(), self.path)


def _seconds_by_file(tests: dict) -> dict:
    """Test seconds summed per test file, largest first (where a run's time goes)."""
    by = Counter()
    for k, v in tests.items():
        by[k.split("::")[0]] += v["seconds"]
    return {f: round(sec, 2) for f, sec in by.most_common()}


def merge(docs: list[dict]) -> dict:
    """One suite report from the reports of a suite run split over device calls (``.ci/gpu
    suite`` with ``SUITE_PART``: each call within the device's per-call limit): tests,
    outcomes, failures and differential cells joined (a cell in several parts: counts
    summed, maxima kept, cases concatenated), seconds summed (the parts ran one after the
    other), the first part's machine. Parts that share a test are an error (they were not
    one run's parts)."""
    if not docs:
        raise ValueError("merge needs at least one suite report")
    tests: dict[str, str] = {}  # test -> outcome
    seconds = Counter()
    cells: dict = {}
    for d in docs:
        if "suite" not in d:
            raise ValueError("not a suite report (no 'suite' key): pytest --suite-report "
                             "writes them")
        shared = set(tests) & set(d["suite"]["tests"])
        if shared:
            raise ValueError(f"the parts share {len(shared)} tests, e.g. {min(shared)}: "
                             f"not parts of one run")
        tests.update(d["suite"]["tests"])
        seconds.update(d["suite"]["seconds_by_file"])
        for c in d["cells"]:
            key = tuple(c[k] for k in ("op", "impl", "platform", "format", "shape_class",
                                       "dist"))
            cells[key] = _merged_cell(cells[key], c) if key in cells else dict(c)
    parts = [d["suite"] for d in docs]
    wall = round(sum(p["wall_seconds"] for p in parts), 2)
    return {**docs[0], "seconds": wall,
            "cases": sum(d["cases"] for d in docs),
            "cells": finished_cells(cells),
            "failures": [f for d in docs for f in d["failures"]],
            "merged_from": len(docs),
            "suite": {
                "wall_seconds": wall,
                "part_wall_seconds": [p["wall_seconds"] for p in parts],
                "test_seconds": round(sum(p["test_seconds"] for p in parts), 2),
                "outcomes": dict(Counter(tests.values())),
                "slowest": sorted((t for p in parts for t in p["slowest"]),
                                  key=lambda t: -t["seconds"])[:20],
                "seconds_by_file": {f: round(sec, 2) for f, sec in seconds.most_common()},
                "failed": [f for p in parts for f in p["failed"]],
                "tests": tests,
            }}


def _merged_cell(a: dict, b: dict) -> dict:
    """Two parts' statistics of one differential cell as one (``oracle.core.report``'s cell)."""
    c = dict(a)
    for name in ("cases", "passed", "elements", "exact", "within_one",
                 "admissible_not_nearest", "violations", "width_1", "width_2", "width_more",
                 "sum_sq_err"):
        c[name] = a[name] + b[name]
    c["ulp_hist"] = {k: a["ulp_hist"].get(k, 0) + b["ulp_hist"].get(k, 0)
                     for k in a["ulp_hist"].keys() | b["ulp_hist"].keys()}
    for name in ("max_abs_err", "max_rel_err", "max_err_over_bound"):
        c[name] = max(a[name], b[name])
    wa, wb = a["worst_case"], b["worst_case"]
    if wa is None or (wb is not None and (not wb["passed"], wb["max_err_over_bound"])
                      > (not wa["passed"], wa["max_err_over_bound"])):
        c["worst_case"] = wb
    if "reported" in a or "reported" in b:
        ra, rb = a.get("reported", {}), b.get("reported", {})
        c["reported"] = {k: max(ra.get(k, 0.0), rb.get(k, 0.0)) for k in ra.keys() | rb}
    c["per_case"] = a["per_case"] + b["per_case"]
    return c


def scaleout(paths, subset: str, warm: str) -> dict:
    """One ``scaleout/1`` document from the suite reports of ``.ci/gpu scaleout``
    (``scaleout-W-G.json``: W pytest-xdist workers on G GPUs), each run's wall and test
    seconds, outcomes, and speedup over the one-worker one-GPU run (which must be there:
    it is the baseline)."""
    runs = []
    for p in paths:
        m = re.search(r"scaleout-(\d+)-(\d+)\.json$", str(p))
        if not m:
            raise ValueError(f"a scale-out report is named scaleout-W-G.json, got {p}")
        doc = json.loads(Path(p).read_text())
        s = doc["suite"]
        runs.append({"workers": int(m[1]), "gpus": int(m[2]), "wall_s": s["wall_seconds"],
                     "test_s": s["test_seconds"], "outcomes": s["outcomes"],
                     "machine": doc["machine"]})
    base = [r["wall_s"] for r in runs if (r["workers"], r["gpus"]) == (1, 1)]
    if not base:
        raise ValueError("the scale-out runs need the 1-worker 1-GPU baseline scaleout-1-1")
    runs.sort(key=lambda r: (r["gpus"], r["workers"]))
    for r in runs:
        r["speedup_vs_1_gpu"] = round(base[0] / r["wall_s"], 2)
    return {"schema": "scaleout/1", "machine": runs[0]["machine"], "subset": subset,
            "warm_cache": warm, "runs": [{k: v for k, v in r.items() if k != "machine"}
                                         for r in runs]}


def markdown(doc: dict) -> str:
    """The scale-out table of a ``scaleout/1`` document."""
    lines = [f"Subset: `{doc['subset']}`; {doc['warm_cache']}.", "",
             "| workers | GPUs | wall (s) | test (s) | outcomes | speedup vs 1 GPU |",
             "|---:|---:|---:|---:|---|---:|"]
    lines += [f"| {r['workers']} | {r['gpus']} | {r['wall_s']:.2f} | {r['test_s']:.2f} | "
              f"{', '.join(f'{k} {v}' for k, v in r['outcomes'].items())} | "
              f"{r['speedup_vs_1_gpu']:.2f}x |" for r in doc["runs"]]
    return "\n".join(lines) + "\n"
