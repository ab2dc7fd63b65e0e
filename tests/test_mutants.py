"""The mutant machinery (oracle/tools/mutants.py) and the catalog: every mutant builds on the
real kernel it names, and the CPU part of the standard budget kills every mutant that is
not marked as showing only on CUDA."""

from __future__ import annotations

import json

import numpy as np
import pytest

from oracle.core.cases import Case, make_inputs
from oracle.core.checks import run_check
from oracle.core.registry import REGISTRY, implementations
from oracle.tools import mutants
from oracle.tools.cli import main

CATALOG = mutants.catalog()


def test_catalog_has_at_least_25_mutants_with_their_incidents():
    """The catalog: at least 25 mutants, each with a bug class and an incident."""
    assert len(CATALOG) >= 25, sorted(CATALOG)
    assert all(m.bug and m.incident and m.op and m.base for m in CATALOG.values())


@pytest.mark.parametrize("name", sorted(CATALOG))
def test_mutant_builds_on_its_registered_base(name):
    """The mutant's patch still matches its kernel (or its wrapper applies) and the result
    declares what the base declares, under a mutant's name; the copy registers nothing."""
    m = CATALOG[name]
    before = {op: set(impls) for op, impls in REGISTRY.items()}
    impl = m.implementation()
    (base,) = implementations(m.op, [m.base])
    assert impl.name == f"mutant:{name}" and impl.run is not base.run
    assert (impl.schedule, impl.score_rel, impl.arith) == (base.schedule, base.score_rel,
                                                         base.arith)
    assert {op: set(impls) for op, impls in REGISTRY.items()} == before


# A verdict on the CPU budget, for the CPU machine: no ``interp`` marker, so a CUDA machine
# does not rerun it compiled under ``-m gpu`` (the GPU's kill matrix is `oracle mutants`).
@pytest.mark.parametrize("name", sorted(n for n, m in CATALOG.items() if not m.gpu_only))
def test_cpu_budget_kills_the_mutant(name):
    """The tiny, then small, cases of the standard budget fail the mutant (a survivor is a
    hole in the suite); the killing check is a numeric or contract failure of the mutant,
    and the unmutated base passes the same case."""
    m = CATALOG[name]
    impl = m.implementation()
    for cls in mutants.CPU_CLASSES:
        res = mutants.first_kill(impl, mutants.class_cases(m.op, cls, gpu=False))
        if res["killed"]:
            break
    assert res["killed"], f"{name} survived {res['cases']} cases"
    case = Case.from_id(res["case"])
    (base,) = implementations(m.op, [m.base])
    assert run_check(case, base, make_inputs(case)).passed


def test_patch_that_no_longer_matches_is_an_error():
    """A pattern absent from the kernel source (a refactor) raises MutantError naming it,
    so a stale mutant can never silently test the unmutated kernel."""
    m = mutants.Mutant("stale", "attention_decode", "triton", "bug", "incident",
                       mutants.patch("kernels.attention_decode", ("no such line\n", "x\n")))
    with pytest.raises(mutants.MutantError, match="occurs 0 times"):
        m.implementation()


def test_wrapped_inputs_are_copies():
    """wrap_inputs hands the function a copy of the input dict: replacing an entry there
    leaves the caller's inputs as they were."""
    seen = {}

    def base_run(x):
        seen.update(x)
        return {}

    base = implementations("attention_decode", ["triton"])[0]
    run = mutants.wrap_inputs(lambda x: {**x, "k_scale": 7.0})(
        type("B", (), {"run": staticmethod(base_run)})())
    x = {"k_scale": np.float32(1.0)}
    run(x)
    assert seen["k_scale"] == 7.0 and x["k_scale"] == 1.0 and base.name == "triton"


def test_kill_matrix_report_and_cli(tmp_path, capsys):
    """python -m oracle mutants writes the kill matrix (JSON + Markdown): each mutant's
    killing class, cases and seconds and its replay command, which replays the failure."""
    out = tmp_path / "m.json"
    names = "decode_gqa_modulo,decode_k_scale_ignored"
    assert main(["mutants", "--mutants", names, "--fuzz-seconds", "0",
                 "--out", str(out)]) == 0
    doc = json.loads(out.read_text())
    assert doc["killed"] == 2 and not doc["survivors"]
    kill = doc["mutants"][0]["classes"]["tiny"]
    assert kill["killed"] and kill["cases"] >= 1 and "--impl mutant:" in kill["replay"]
    assert "| decode_gqa_modulo |" in (tmp_path / "m.md").read_text()
    case = kill["replay"].split()[4]
    assert main(["replay", case, "--impl", "mutant:decode_gqa_modulo"]) == 1
    assert main(["mutants", "--mutants", "no_such_mutant"]) == 2
    (tmp_path / "m.md").unlink()
    assert main(["render", str(out)]) == 0  # a GPU run's JSON rendered where it lands
    assert "| decode_gqa_modulo |" in (tmp_path / "m.md").read_text()
    capsys.readouterr()


def test_partial_reports_after_each_mutant_and_cut_short_runs_say_so():
    """The kill matrix hands out its report after every mutant (the CLI writes it, so a
    run stopped by a time limit keeps its rows); a report with fewer rows than planned
    says how many mutants did not run. The CUDA-only mutants are ordered last."""
    seen = []
    ms = [mutants.catalog()[n] for n in ("insert_int32_offsets", "decode_gqa_modulo",
                                         "decode_k_scale_ignored")]
    doc = mutants.kill_matrix(ms, fuzz_seconds=0, progress=lambda _: None,
                              partial=lambda d: seen.append(len(d["mutants"])))
    assert seen == [1, 2, 3]
    assert [r["mutant"] for r in doc["mutants"]][-1] == "insert_int32_offsets"
    cut = dict(doc, mutants=doc["mutants"][:1], not_run=["a", "b"])
    assert "cut short, not run: a, b" in mutants.markdown(cut)
    first = mutants.kill_matrix(ms[1:2], fuzz_seconds=0, progress=lambda _: None)
    second = mutants.kill_matrix(ms[2:], fuzz_seconds=0, progress=lambda _: None)
    merged = mutants.merge([first, second], [m.name for m in ms])
    assert merged["killed"] == 2 and merged["not_run"] == ["insert_int32_offsets"]
    assert merged["seconds"] == round(first["seconds"] + second["seconds"], 2)


def test_gpu_only_mutants_meet_the_gpu_classes_first(monkeypatch):
    """On CUDA a mutant whose bug shows only there (32-bit offsets) runs the GPU classes
    (``large`` first) before the CPU ones; every other mutant keeps the cheapest-first
    order. Checked on the class order ``_kill_row`` walks (the kills stubbed out)."""
    walked = []

    def fake_first_kill(impl, cases):
        walked.append(cases)
        return {"killed": False, "cases": 0, "seconds": 0.0}

    monkeypatch.setattr(mutants, "first_kill", fake_first_kill)
    monkeypatch.setattr(mutants, "class_cases", lambda op, cls, gpu: cls)
    monkeypatch.setattr(mutants, "fuzz_kill", lambda *a: walked.append("fuzz") or
                        {"killed": False, "cases": 0, "seconds": 0.0})
    classes = [*mutants.CPU_CLASSES, *mutants.GPU_CLASSES, "fuzz"]
    for gpu_only in (True, False):
        walked.clear()
        m = mutants.Mutant("m", "reshape_and_cache", "torch", "bug", "incident",
                           build=lambda base: base.run, gpu_only=gpu_only)
        mutants._kill_row(m, classes, True, "cpu", 1.0, False, lambda s: None,
                          lambda impl: impl)
        expected = ([*mutants.GPU_CLASSES, *mutants.CPU_CLASSES, "fuzz"] if gpu_only
                    else classes)
        assert walked == expected
