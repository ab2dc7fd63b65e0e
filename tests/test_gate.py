"""The baseline gate (oracle/tools/pytest_gate.py, oracle/tools/baseline.py), the diff rules
it applies (oracle/core/diff.py) and the determinism it relies on."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from oracle.core import diff, report
from oracle.core.checks import run_check
from oracle.core.report import differential_cases, machine_info
from oracle.tools import baseline
from tests.helpers import plugins_registered

ROOT = Path(__file__).resolve().parents[1]

# An external attention_decode kernel: the vLLM schedule's attention in float64, rounded to
# the model dtype, or (GATE_NUDGE=1) the same with one output element moved one code towards
# its exact value, on the element nearest a rounding tie: still admissible (the schedule's
# fp32 error bound reaches past the tie), but no longer the nearest code.
PLUGIN = textwrap.dedent("""
    import os
    import numpy as np
    from oracle.core.reference_run import attention_call, model_codes
    from oracle.core.registry import Implementation, register
    from reference.attention import vllm_schedule
    from reference.codec import decode

    def run(x):
        md = x["model_dtype"]
        value = attention_call(x, vllm_schedule(md), return_details=True).unrounded.ravel()
        codes = model_codes(value, md)
        if os.environ.get("GATE_NUDGE") == "1":
            got = decode(codes, md)
            up = (value > got) == (got >= 0)  # a larger code is a larger magnitude
            other = np.where(up, codes + 1, codes - 1).astype(codes.dtype)
            tie = (decode(other, md) + got) / 2  # the bound is absolute: the nearest tie
            i = int(np.argmin(np.abs(value - tie)))
            codes[i] = other[i]
        return {"out": codes.reshape(np.shape(x["q"]))}

    register(Implementation("plugin_gate", "attention_decode", run, devices=("cpu",),
                            shape_classes=("tiny",),
                            schedule=lambda md, case=None: vllm_schedule(md)))
""")


def _cell(per_case, **totals):
    c = {"op": "o", "impl": "i", "platform": "cuda", "format": "bfloat16",
         "shape_class": "tiny", "dist": "normal", "cases": len(per_case), "rmse": 1.0,
         "passed": len(per_case), "violations": 0, "per_case": per_case, **totals}
    return {"cells": [c]}


def _row(i, **kw):
    row = {"case": f"c{i}", "hash": f"h{i}", "passed": True, "elements": 100, "exact": 90,
           "exact_rate": 0.9, "within_one": 100, "admissible_not_nearest": 10,
           "violations": 0, "max_err_over_bound": 0.5, "rmse": 1e-3}
    return {**row, **kw}


def test_a_moved_rmse_alone_is_not_worse():
    """The fresh-clone report's cell: the RMSE rose in its fourth digit while the exact
    count rose and the admissible-not-nearest count fell: not worse (better)."""
    old = _cell([_row(0, exact=97, admissible_not_nearest=3, rmse=46.4896)])
    new = _cell([_row(0, exact=100, admissible_not_nearest=0, rmse=46.4993)])
    text, worse = diff.diff_reports(old, new)
    assert not worse and "0 worse, 1 better" in text, text


@pytest.mark.parametrize("change, reason", [
    (dict(exact=89, admissible_not_nearest=11), "admissible not nearest 80 -> 81"),
    (dict(within_one=99), "within one 800 -> 799"),
    (dict(exact=89), "exact 720 -> 719"),
    (dict(violations=1), "violations 0 -> 1"),
    (dict(passed=False), "failed cases 0 -> 1"),
    (dict(max_err_over_bound=0.5 * (1 + 1e-4)), "max err/bound 0.5 -> 0.50005"),
])
def test_one_count_worse_on_one_case_is_worse(change, reason):
    """Among 8 paired cases, one case one count worse (one output code) is a regression,
    whatever the other cases: the code is deterministic, so no change is noise."""
    old = _cell([_row(i) for i in range(8)])
    new = _cell([_row(i, **(change if i == 5 else {})) for i in range(8)])
    text, worse = diff.diff_reports(old, new)
    assert worse and reason in text and "RMSE" in text, text


def test_err_bound_within_its_tolerance_is_not_worse():
    """A largest error/bound higher by less than ERR_BOUND_REL (the float64 reference's own
    rounding) is not a regression."""
    old = _cell([_row(0)])
    new = _cell([_row(0, max_err_over_bound=0.5 * (1 + diff.ERR_BOUND_REL / 2))])
    assert not diff.diff_reports(old, new)[1]


def test_a_report_without_per_case_counts_is_judged_on_its_exact_rates():
    """A baseline written before the per-case counts: its exact rates are paired with the
    new report's (a fall is worse), the counts it lacks are not judged."""
    legacy = [{k: v for k, v in _row(i).items() if k in ("case", "hash", "passed",
                                                          "exact_rate", "violations",
                                                          "max_err_over_bound", "rmse")}
              for i in range(3)]
    assert not diff.diff_reports(_cell(legacy), _cell([_row(i) for i in range(3)]))[1]
    text, worse = diff.diff_reports(
        _cell(legacy), _cell([_row(i, exact_rate=0.89 if i else 0.9) for i in range(3)]))
    assert worse and "exact rate" in text, text


def test_cells_without_a_common_case_are_listed_not_judged():
    """A cell whose cases all differ (another case set, or regenerated inputs) is listed as
    not compared and never worse, however its numbers moved."""
    old = _cell([_row(0)])
    new = _cell([_row(1, violations=3, exact=0)])
    text, worse = diff.diff_reports(old, new)
    assert not worse and "1 without a case in common" in text and "o/i/cuda" in text, text


def test_device_kind_from_the_gpu_name():
    """Baselines are per device kind: the GPU model in lower case, a file-safe name else."""
    assert baseline.device_kind("NVIDIA H100 80GB HBM3") == "h100"
    assert baseline.device_kind("NVIDIA H200") == "h200"
    assert baseline.device_kind("Some Accelerator 9") == "some-accelerator-9"


def test_a_report_records_its_commit_and_whether_the_tree_was_dirty():
    """machine_info names the repository's commit (40 hex digits) and a dirty flag."""
    info = machine_info()
    assert len(info["commit"]) == 40 and int(info["commit"], 16) >= 0
    assert isinstance(info["dirty"], bool)


def _gate_case() -> str:
    """The one case the gate test runs: a tiny bf16 attention_decode case."""
    return next(c.id for c in differential_cases("attention_decode", gpu=False)
                if c.kv_fmt == "bfloat16" and c.shape_class == "tiny")


def _pytest(tmp_path, *args, nudge=False, env=()):
    node = (f"tests/test_differential.py::test_implementation_matches_reference"
            f"[cpu|plugin_gate|{_gate_case()}]")
    env = {**os.environ, "ORACLE_PLUGINS": "gate_kernels", "PYTEST_ADDOPTS": "",
           "GATE_NUDGE": "1" if nudge else "0", **dict(env),
           "PYTHONPATH": os.pathsep.join([str(tmp_path), str(ROOT)])}
    return subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", node,
         "--baseline", str(tmp_path / "base" / "cpu.json.gz"),
         "--last-run", str(tmp_path / "last.json"), *args],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)


def test_the_gate_fails_a_kernel_one_code_worse_and_passes_the_honest_one(tmp_path,
                                                                          monkeypatch):
    """A plugin kernel one code worse on one element (still admissible: its test passes)
    fails the pytest run against the honest kernel's accepted baseline, with the Markdown
    naming the cell; the honest kernel passes it; without a baseline, or with the gate off,
    the run passes and says so."""
    from oracle.core.cases import Case

    (tmp_path / "gate_kernels.py").write_text(PLUGIN)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setenv("ORACLE_PLUGINS", "gate_kernels")  # for the pytest runs below
    monkeypatch.setenv("GATE_NUDGE", "1")
    with plugins_registered("gate_kernels") as reg:
        (impl,) = reg.implementations("attention_decode", ["plugin_gate"])
    nudged = run_check(Case.from_id(_gate_case()), impl)
    assert nudged.passed and nudged.tally.admissible_not_nearest >= 1, nudged.summary()

    r = _pytest(tmp_path)
    assert r.returncode == 0 and "No baseline" in r.stdout, r.stdout[-3000:]
    written = baseline.accept(tmp_path / "last.json", "cpu", tmp_path / "base")
    assert report.load(written[0])["cells"] and written[0].name == "cpu.json.gz"

    r = _pytest(tmp_path, nudge=True)
    assert "1 passed" in r.stdout and r.returncode == 1, r.stdout[-3000:]
    assert "Baseline gate FAILED" in r.stdout and "| attention_decode | plugin_gate |" in \
        r.stdout and "admissible not nearest" in r.stdout, r.stdout[-3000:]
    r = _pytest(tmp_path, nudge=True, env={"ORACLE_BASELINE_GATE": "off"})
    assert r.returncode == 0 and "baseline gate off" in r.stdout, r.stdout[-3000:]
    r = _pytest(tmp_path)
    assert r.returncode == 0 and "0 worse" in r.stdout, r.stdout[-3000:]


DETERMINISM = textwrap.dedent("""
    import hashlib, sys
    import numpy as np
    import torch
    torch.set_num_threads(int(sys.argv[1]))
    import kernels
    kernels.use_interpreter_without_gpu()
    from oracle.impls import catalog
    catalog.load_all()
    from oracle.core.cases import Case, make_inputs
    from oracle.core.registry import implementations
    from oracle.core.reference_run import attention_call
    case = Case.from_id(sys.argv[2])
    x = make_inputs(case)
    h = hashlib.sha256()
    for impl in implementations(case.op, ["triton", "torch"]):
        for k, v in sorted(impl.run(x).items()):
            h.update(np.ascontiguousarray(v).tobytes())
    h.update(attention_call(x).tobytes())
    print(h.hexdigest())
""")


def test_outputs_do_not_depend_on_the_thread_pools(tmp_path):
    """The Triton kernel (interpreted: its tl.dot is a NumPy matmul), the torch composition
    and the float64 reference give the same bits on an fp8 attention case with one BLAS and
    torch thread as with four."""
    script = tmp_path / "bits.py"
    script.write_text(DETERMINISM)
    case = next(c.id for c in differential_cases("attention_decode", gpu=False)
                if c.platform == "rocm-fnuz" and c.shape_class == "tiny")
    digests = []
    for n in ("1", "4"):
        env = {**os.environ, "PYTHONPATH": str(ROOT), "OPENBLAS_NUM_THREADS": n,
               "OMP_NUM_THREADS": n, "MKL_NUM_THREADS": n}
        r = subprocess.run([sys.executable, str(script), n, case], cwd=ROOT, env=env,
                           capture_output=True, text=True, timeout=600)
        assert r.returncode == 0, r.stderr[-2000:]
        digests.append(r.stdout.split()[-1])
    assert digests[0] == digests[1]


def test_the_interpreters_dot_sums_in_index_order():
    """The interpreted tl.dot (kernels.interpreter.fixed_order_matmul) equals the fp32 sum of
    the fp32 products taken left to right over K, element by element (a Python loop here),
    batched over a leading axis: an order no BLAS build, CPU or thread count changes."""
    import numpy as np

    from kernels.interpreter import fixed_order_matmul

    rng = np.random.default_rng(7)
    scale = 1e4 ** rng.integers(-1, 2, (2, 3, 5))  # magnitudes apart: the order shows
    a = (rng.standard_normal((2, 3, 5)) * scale).astype(np.float32)
    b = rng.standard_normal((2, 5, 4)).astype(np.float32)
    want = np.zeros((2, 3, 4), np.float32)
    for i, m, n in np.ndindex(want.shape):
        s = np.float32(a[i, m, 0] * b[i, 0, n])
        for k in range(1, 5):
            s = np.float32(s + np.float32(a[i, m, k] * b[i, k, n]))
        want[i, m, n] = s
    got = fixed_order_matmul(a, b)
    assert got.dtype == np.float32 and np.array_equal(got.view(np.uint32), want.view(np.uint32))


def test_a_named_commit_stands_for_a_copied_tree(monkeypatch):
    """$ORACLE_COMMIT (a GPU machine's copy of the tree has no reliable git state) is the
    report's commit, the tree taken as clean; without it, git's HEAD."""
    from oracle.core.report import COMMIT_ENV, source_state

    monkeypatch.setenv(COMMIT_ENV, "0123abc")
    assert source_state() == {"commit": "0123abc", "dirty": False}
    monkeypatch.delenv(COMMIT_ENV)
    head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True,
                          text=True).stdout.strip()
    assert source_state()["commit"] == head
