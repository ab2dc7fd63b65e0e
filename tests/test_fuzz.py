"""Fuzzing: the hypothesis driver finds and shrinks a planted bug and writes its replay file;
the long fuzz run (marker ``fuzz``) searches the CPU implementations."""

from collections import Counter
from pathlib import Path

import pytest
from hypothesis import given, settings

from oracle.core.cases import Case
from oracle.core.registry import REGISTRY, implementations
from oracle.impls.catalog import load_all
from oracle.impls.torch_peer import make_torch_impl
from oracle.tools import fuzz


@pytest.fixture
def planted_bug():
    """The torch baseline with (w) instead of (1 + w), registered for the test's duration."""
    load_all()
    broken = make_torch_impl("norm_rope_insert", "plain_w")
    REGISTRY["norm_rope_insert"][broken.name] = broken
    yield broken.name
    del REGISTRY["norm_rope_insert"][broken.name]


def test_fuzz_finds_shrinks_and_writes_a_replayable_failure(planted_bug, tmp_path):
    """Within a short budget the driver fails on the planted bug, writes one file holding
    the replay command of a case that still fails, and exits 1; the failing example is
    kept in the example database (replayed first by the next run)."""
    out, db = tmp_path / "out", tmp_path / "db"
    rc = fuzz.run(seconds=60, ops=["norm_rope_insert"], impls=[planted_bug], out_dir=out,
                  db=db)
    assert rc == 1
    assert any(p.is_file() for p in db.rglob("*"))
    (path,) = out.iterdir()
    command = path.read_text().strip()
    assert command.startswith("python -m oracle replay norm_rope_insert:")
    case = Case.from_id(command.split()[4])
    (impl,) = implementations("norm_rope_insert", [planted_bug])
    with pytest.raises(fuzz.CaseFailed):
        fuzz.check_case(case, [impl.name])


def test_fuzz_reports_no_failure_on_correct_implementations(tmp_path, monkeypatch):
    """A short run over the correct CPU implementations finds nothing and exits 0, and
    reports every case's worst error over bound (in [0, 1]) to hypothesis.target."""
    seen = []
    monkeypatch.setattr(fuzz, "target", lambda value, label: seen.append((label, value)))
    out = tmp_path / "out"
    assert fuzz.run(seconds=5, ops=["norm_rope_insert"], impls=["torch"], out_dir=out,
                    db=None) == 0
    assert not out.exists() or not list(out.iterdir())
    assert seen and all(label == "err/bound" and 0 <= v <= 1 for label, v in seen)
    assert any(v > 0 for _, v in seen)  # rounding errors are measured, not all zero


@pytest.mark.fuzz
@settings(max_examples=2000)
@given(fuzz.case_strategy())
def test_fuzz_every_cpu_implementation(case):
    """Every CPU implementation passes on hypothesis-drawn cases over the whole case space
    (ops, shape classes tiny/small, distributions, platforms, cache dtypes, scales, seeds)."""
    fuzz.check_case(case, device="cpu")


def test_parallel_workers_each_fuzz_and_report(tmp_path, capfd):
    """``--workers 2``: two processes fuzz at once (their own hypothesis streams), each
    reports its summary; no failure on a correct implementation gives 0."""
    rc = fuzz.run_parallel(2, seconds=3, ops=["reshape_and_cache"], impls=["torch"],
                           out_dir=tmp_path / "out", db=None)
    assert rc == 0
    assert capfd.readouterr().out.count("no failure in 3 s") == 2


def _fuzz_report(tmp_path, *extra):
    """Run ``python -m oracle fuzz`` on reshape_and_cache/torch with a report; (rc, doc)."""
    import json

    from oracle.tools.cli import main

    path = tmp_path / "fuzz.json"
    rc = main(["fuzz", "--ops", "reshape_and_cache", "--impls", "torch", "--db",
               str(tmp_path / "db"), "--out", str(tmp_path / "out"), "--report", str(path),
               *extra])
    return rc, json.loads(path.read_text())


def _check_throughput(doc):
    """The throughput recomputed from each worker's recorded case completion times."""
    warmup = doc["warmup_s"]
    after = overall = 0.0
    for w in doc["per_worker"]:
        times = w["case_times_s"]
        assert len(times) == w["cases"] and times == sorted(times)
        assert all(0 < t <= w["elapsed_s"] for t in times)
        n_after = sum(t > warmup for t in times)
        assert w["cases_after_warmup"] == n_after
        rate = n_after / (w["elapsed_s"] - warmup)
        assert w["cases_per_s_after_warmup"] == pytest.approx(rate, rel=1e-12)
        after += rate
        overall += w["cases"] / w["elapsed_s"]
    t = doc["throughput"]
    assert t["cases_per_s_after_warmup"] == pytest.approx(after, rel=1e-12)
    assert t["cases_per_s"] == pytest.approx(overall, rel=1e-12)
    assert t["workers_measured_after_warmup"] == doc["workers"]


def test_fuzz_report_has_the_schema_counts_that_add_up_and_the_throughput(tmp_path):
    """``fuzz --report``: one fuzz/1 JSON with the machine, budget, warm-up, what was
    fuzzed (only the requested shape class drawn), cases per op and per shape class summing
    to the total, one torch check per case, and the throughput after warm-up equal to the
    cases finished after the warm-up over the time after it (from the recorded times)."""
    rc, doc = _fuzz_report(tmp_path, "--seconds", "4", "--warmup", "1",
                           "--shape-classes", "small")
    assert rc == 0
    assert doc["schema"] == "fuzz/1" and doc["machine"]["device"]
    assert (doc["workers"], doc["seconds"], doc["warmup_s"]) == (1, 4.0, 1.0)
    assert doc["ops"] == ["reshape_and_cache"] and doc["impls"] == ["torch"]
    assert doc["shape_classes"] == ["small"]
    assert doc["cases"] > 0 and doc["failures"] == []
    assert sum(doc["per_op"].values()) == doc["cases"] == doc["per_op"]["reshape_and_cache"]
    assert doc["per_shape_class"] == {"small": doc["cases"]}
    assert doc["checks"] == {"torch": doc["cases"]}
    (w,) = doc["per_worker"]
    assert w["elapsed_s"] >= 4.0 and w["cases_after_warmup"] > 0
    _check_throughput(doc)


def test_fuzz_report_default_warmup_is_a_fifth_of_the_budget(tmp_path):
    """Without ``--warmup`` the warm-up is 20% of the budget; a bad shape class or a
    warm-up not shorter than the budget is a usage error (exit 2), before any fuzzing."""
    from oracle.tools.cli import main

    assert main(["fuzz", "--seconds", "1", "--shape-classes", "huge", "--db", "none"]) == 2
    assert main(["fuzz", "--seconds", "1", "--warmup", "1", "--db", "none"]) == 2
    rc, doc = _fuzz_report(tmp_path, "--seconds", "2.5")
    assert rc == 0 and doc["warmup_s"] == pytest.approx(0.5)
    _check_throughput(doc)


def test_fuzz_report_merges_parallel_workers(tmp_path):
    """``--workers 2 --report``: both workers' stats are in the report, and the totals
    (cases, per op, per shape class, checks, throughput) are their sums."""
    rc, doc = _fuzz_report(tmp_path, "--seconds", "3", "--warmup", "0.5", "--workers", "2")
    assert rc == 0
    assert doc["workers"] == 2
    ws = doc["per_worker"]
    assert sorted(w["worker"] for w in ws) == [0, 1] and all(w["cases"] > 0 for w in ws)
    assert doc["cases"] == sum(w["cases"] for w in ws) == sum(doc["per_op"].values())
    assert sum(doc["per_shape_class"].values()) == doc["cases"]
    for key in ("per_op", "per_shape_class", "checks"):
        assert doc[key] == dict(Counter(ws[0][key]) + Counter(ws[1][key]))
    assert set(doc["per_shape_class"]) <= {"tiny", "small"}
    assert doc["checks"] == {"torch": doc["cases"]}
    _check_throughput(doc)


def test_report_counts_failures_and_rates_from_worker_stats():
    """``fuzz.report`` on hand-made worker stats: counts are summed over workers, a
    worker's rate after warm-up counts only cases finished after it (2 of 5 over 2 s),
    a worker that stopped within the warm-up has no such rate, and its failure is listed;
    ``markdown`` shows the device, GPUs (none on the CPU), workers, cases, warm-up, both
    rates and per-op counts."""
    fail = {"case": "x", "replay": "python -m oracle replay x", "file": "x.txt"}
    stats = [
        {"worker": 0, "cases": 5, "case_times_s": [0.1, 0.2, 0.3, 2.5, 3.5], "elapsed_s": 4.0,
         "per_op": {"a": 4, "b": 1}, "per_shape_class": {"tiny": 5}, "checks": {"t": 5},
         "failure": None},
        {"worker": 1, "cases": 1, "case_times_s": [0.5], "elapsed_s": 1.0,
         "per_op": {"a": 1}, "per_shape_class": {"small": 1}, "checks": {"t": 1, "u": 1},
         "failure": fail},
    ]
    doc = fuzz.report(stats, seconds=4, warmup=2, ops=["a", "b"], impls=["t", "u"],
                      shape_classes=["tiny", "small"], device="cpu")
    assert doc["cases"] == 6 and doc["per_op"] == {"a": 5, "b": 1}
    assert doc["per_shape_class"] == {"small": 1, "tiny": 5}
    assert doc["checks"] == {"t": 6, "u": 1}
    assert doc["throughput"] == {"cases_per_s_after_warmup": 1.0,
                                 "workers_measured_after_warmup": 1,
                                 "cases_per_s": 5 / 4 + 1 / 1,
                                 # no compile times recorded: none taken out
                                 "compile_share_after_warmup": 0.0,
                                 "cases_per_s_after_warmup_net_of_compiles": 1.0}
    assert [w["cases_per_s_after_warmup"] for w in doc["per_worker"]] == [1.0, None]
    assert doc["failures"] == [fail]
    md = fuzz.markdown(doc)
    row = md.splitlines()[2]
    assert row.split("|")[1:-1] == [" " + doc["machine"]["device"] + " ", " 0 ", " 2 ",
                                    " tiny,small ", " 4 ", " 2 ", " 6 ", " 1.0 ", " 2.2 ",
                                    " 0% ", " 1.0 ", " 1 "]
    assert "| a | 5 |" in md and "| b | 1 |" in md and "python -m oracle replay x" in md


def test_no_shrink_reports_the_failure_as_drawn(tmp_path, monkeypatch):
    """With shrink=False a failing implementation is reported on the first failing case
    drawn (its replay file written), without hypothesis's shrinking passes: the search
    checks no more cases after the failure than before it."""
    from tests.helpers import register_broken_attention

    stats = fuzz.run_stats(30, ["attention_decode"], [register_broken_attention(monkeypatch)],
                           tmp_path, db=None,
                           progress=False, shrink=False)
    f = stats["failure"]
    assert f is not None and "broken_torch" in f["summary"]
    assert (tmp_path / Path(f["file"]).name).exists()
    assert stats["checks"]["broken_torch"] == stats["cases"]


def test_cuda_fuzz_leaves_out_the_per_shape_compiled_baseline():
    """On CUDA a fuzz run without --impls checks every implementation but the flex
    baseline (compiled anew for every random shape); on the CPU it checks all."""
    from oracle.core.registry import known_names

    assert fuzz.default_impls("cpu") is None
    names = fuzz.default_impls("cuda")
    assert "flex" not in names and set(names) == known_names() - {"flex"}


def test_compile_seconds_after_the_warmup_are_capped_at_the_case_span():
    """A case finishing at 3 s after one at 1 s, with a 2 s warm-up and 1.5 s of compiles,
    compiled at most 1 s after the warm-up; cases within the warm-up count nothing."""
    stats = {"case_times_s": [1.0, 3.0, 5.0], "case_compile_s": [1.0, 1.5, 0.5]}
    assert fuzz.compile_after(stats, 2.0) == pytest.approx(1.0 + 0.5)


def test_fuzz_report_takes_compile_seconds_out_of_the_net_rate():
    """The report's compile share and net rate: a worker with 10 s elapsed, a 2 s warm-up
    and cases finished at 1, 3, 5 and 9 s, of which those after the warm-up spent 1, 0 and
    3 s compiling, ran 3 cases in 8 s (0.375/s), half of them compiling, so 3 cases in the
    4 s left (0.75/s)."""
    stats = [{"cases": 4, "case_times_s": [1.0, 3.0, 5.0, 9.0],
              "case_compile_s": [0.5, 1.0, 0.0, 3.0], "compiles": 3,
              "per_op": {"reshape_and_cache": 4}, "per_shape_class": {"small": 4},
              "checks": {"torch": 4}, "elapsed_s": 10.0, "failure": None}]
    doc = fuzz.report(stats, seconds=10, warmup=2, ops=["reshape_and_cache"],
                      impls=["torch"], shape_classes=["small"], device="cpu")
    t = doc["throughput"]
    assert t["cases_per_s_after_warmup"] == pytest.approx(0.375)
    assert t["compile_share_after_warmup"] == pytest.approx(0.5)
    assert t["cases_per_s_after_warmup_net_of_compiles"] == pytest.approx(0.75)
    assert doc["per_worker"][0]["compile_s"] == pytest.approx(4.5)
    assert "50%" in fuzz.markdown(doc)


def test_compile_clock_counts_the_time_between_triton_hooks(monkeypatch):
    """``CompileClock``: installed as Triton's JIT cache / post-compile hooks, it lets the
    compile go on and adds one compile and its seconds per start-finish pair; a finish
    without a start adds nothing."""
    import time

    import triton

    from kernels._triton import CompileClock

    monkeypatch.setattr(triton.knobs.runtime, "jit_cache_hook", None)
    monkeypatch.setattr(triton.knobs.runtime, "jit_post_compile_hook", None)
    clock = CompileClock().install()
    assert triton.knobs.runtime.jit_cache_hook == clock.started
    assert triton.knobs.runtime.jit_post_compile_hook == clock.finished
    assert clock.started(key="k") is False
    time.sleep(0.02)
    clock.finished(key="k")
    clock.finished(key="k")
    assert clock.count == 1 and 0.02 <= clock.seconds < 1.0


def test_a_config_pool_confines_the_cases_shapes_to_its_configs():
    """``--configs N``: the run's pool is N consecutive config ids picked by the salt (a
    new salt, a disjoint pool); the strategy draws every case's config from the pool, and
    without a pool none."""
    from hypothesis import HealthCheck, given, settings

    pool = fuzz.config_pool(4, 3)
    assert pool == (12, 13, 14, 15) and set(pool).isdisjoint(fuzz.config_pool(4, 4))
    assert fuzz.config_pool(0, 3) is None
    with pytest.raises(ValueError, match="configs"):
        fuzz.config_pool(-1, 0)
    seen = []

    @settings(max_examples=60, database=None, deadline=None,
              suppress_health_check=list(HealthCheck))
    @given(fuzz.case_strategy(["indexer_decode"], ("small",), pool))
    def draw(case):
        seen.append(case.config)

    draw()
    assert set(seen) <= set(pool) and len(set(seen)) > 1
    seen.clear()
    given(fuzz.case_strategy(["indexer_decode"], ("small",)))(
        settings(max_examples=10, database=None)(lambda case: seen.append(case.config)))()
    assert set(seen) == {None}


def test_pinned_formats_give_each_config_one_format_combination():
    """``pin_formats``: every case of a config has that config's platform, cache dtype,
    model dtype and scale kind (``config_formats``, the same for every draw), while the
    distribution and seed stay free; the pool still spans several combinations."""
    from hypothesis import HealthCheck, given, settings

    from oracle.core.cases import FORMAT_FIELDS, config_formats

    pool = fuzz.config_pool(6, 1)
    seen = []

    @settings(max_examples=80, database=None, deadline=None,
              suppress_health_check=list(HealthCheck))
    @given(fuzz.case_strategy(["attention_decode"], ("small",), pool, pin_formats=True))
    def draw(case):
        seen.append(case)

    draw()
    for case in seen:
        want = config_formats(case.op, case.shape_class, case.config)
        assert {f: getattr(case, f) for f in FORMAT_FIELDS} == want, case.id
    assert len({c.seed for c in seen}) > 10 and len({c.dist for c in seen}) > 1
    combos = {tuple(config_formats("attention_decode", "small", c).values()) for c in pool}
    assert len(combos) > 1
    assert config_formats("attention_decode", "small", 6) == \
        config_formats("attention_decode", "small", 6)


def test_fuzz_cli_runs_on_the_salted_config_pool(tmp_path, capsys):
    """``fuzz --configs 2 --config-salt 5``: the run prints and reports its pool (configs
    10 and 11) and checks cases; a negative pool size is a usage error."""
    from oracle.tools.cli import main

    rc, doc = _fuzz_report(tmp_path, "--seconds", "2", "--configs", "2", "--config-salt", "5")
    assert rc == 0 and doc["configs"] == [10, 11] and doc["cases"] > 0
    assert "--configs 2 --config-salt 5" in capsys.readouterr().out
    assert main(["fuzz", "--seconds", "1", "--configs", "-1", "--db", "none"]) == 2


def test_cuda_fuzz_defaults_to_pinned_configs_and_the_cpu_to_none():
    """Without ``--configs`` a CUDA run draws from ``CUDA_CONFIGS`` pinned configs (every
    random specialisation there costs a compile) and a CPU run from none; given values
    are kept as given."""
    assert fuzz.default_configs("cuda", None, False) == (fuzz.CUDA_CONFIGS, True)
    assert fuzz.default_configs("cpu", None, False) == (0, False)
    assert fuzz.default_configs("cuda", 0, False) == (0, False)
    assert fuzz.default_configs("cpu", 3, True) == (3, True)
