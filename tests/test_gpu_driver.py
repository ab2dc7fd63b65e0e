""".ci/gpu (benchmarks/gpu_driver.py): its help, its argument checks and its stage runner,
on the CPU (no stage here touches a GPU)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks import gpu_driver as drv

ROOT = Path(__file__).resolve().parents[1]
EVERY_MODE = ("suite", "diff", "tests", "all", "sanitize", "fuzz", "mutants", "falsealarm",
              "bench", "tune", "profile", "ab", "scaleout", "loop", "timeline")


def test_help_lists_every_mode(capsys):
    """`.ci/gpu --help` exits 0 and names each mode at the start of a line of its list."""
    with pytest.raises(SystemExit) as stop:
        drv.main(["--help"])
    assert stop.value.code == 0
    text = capsys.readouterr().out
    listed = {line.split()[0] for line in text.splitlines() if line.startswith("  ")
              and line.split()}
    assert set(EVERY_MODE) <= listed


def test_unknown_mode_exits_2_with_one_line():
    """An unknown mode, through the shell shim, exits 2 with one stderr line naming it,
    and runs nothing (no output on stdout)."""
    res = subprocess.run([str(ROOT / ".ci" / "gpu"), "tests", "nosuchmode"],
                         capture_output=True, text=True, timeout=60)
    assert res.returncode == 2
    assert res.stdout == ""
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and "'nosuchmode'" in lines[0] and "MODE" in lines[0]


@pytest.mark.parametrize("env, modes, needle", [
    ({"SUITE_PART": "half"}, ["suite"], "SUITE_PART"),
    ({"AB_BENCH": ""}, ["ab"], "AB_BENCH"),
    ({"LOOP_RUNS": "hot"}, ["loop"], "LOOP_RUNS"),
])
def test_bad_settings_exit_2_before_any_work(monkeypatch, capsys, env, modes, needle):
    """A bad SUITE_PART or LOOP_RUNS, or a missing AB_BENCH, is a one-line error (exit 2)
    naming the variable, before any stage starts."""
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    started = []
    monkeypatch.setattr(drv.Runner, "start", lambda self, stage, log=None: started.append(stage))
    assert drv.main([*modes, "--dry-run"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and needle in err[0] and not started


def test_suite_both_runs_the_two_parts_then_merges(monkeypatch, capsys):
    """SUITE_PART=both: `pytest -m gpu` on the differential file, then on the rest, each
    with its own suite report, then `oracle suite-merge` of the two into suite.json."""
    monkeypatch.setenv("SUITE_PART", "both")
    monkeypatch.setenv("OUT", "/o")
    assert drv.main(["suite", "--dry-run"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert [ln.split(",")[0] for ln in lines] == ["[suite-diff", "[suite-rest", "[suite-merge"]
    assert "-m gpu tests/test_differential.py --suite-report /o/suite-diff.json" in lines[0]
    assert "tests --ignore=tests/test_differential.py --suite-report /o/suite-rest.json" \
        in lines[1]
    assert lines[2].endswith("suite-merge /o/suite-diff.json /o/suite-rest.json --out "
                             "/o/suite.json")


@pytest.mark.parametrize("runs, expected", [("", "cold warm"), ("warm", "warm")])
def test_loop_runs_inside_the_stage_limit(monkeypatch, capsys, runs, expected):
    """The loop stage asks bench_loop for LOOP_RUNS, its caches in out/loopwork (a later
    call's warm run finds them), both runs bounded a minute inside STAGE_LIMIT_S."""
    monkeypatch.setenv("LOOP_RUNS", runs)
    monkeypatch.setenv("STAGE_LIMIT_S", "500")
    monkeypatch.setenv("OUT", "/o")
    assert drv.main(["loop", "--dry-run"]) == 0
    (line,) = capsys.readouterr().out.splitlines()
    assert line.startswith("[loop,")
    assert (f"benchmarks.bench_loop --out /o --work out/loopwork --runs {expected} "
            "--total 440") in line


def test_stage_log_ends_with_its_status_and_times_out_as_124(tmp_path):
    """A stage's output and `<name> rc=<status>` go to its log; a stage past its limit is
    killed and reads 124, as `timeout` gives."""
    ok = drv.Stage("ok", [sys.executable, "-c", "print('hello'); raise SystemExit(3)"])
    assert drv.run_stage(ok, tmp_path) == 3
    assert (tmp_path / "ok.log").read_text().splitlines() == ["hello", "ok rc=3"]
    slow = drv.Stage("slow", [sys.executable, "-c", "import time; time.sleep(30)"], limit=0.5)
    assert drv.run_stage(slow, tmp_path) == 124
    assert (tmp_path / "slow.log").read_text().endswith("slow rc=124\n")


def test_a_crashed_sanitizer_runs_once_more_and_reads_as_a_shell_would(tmp_path):
    """A stage ended by SIGSEGV reads 139 (128 + 11, so the summary counts it as failed);
    a sanitizer stage that crashed so runs a second time, and both runs reach its log."""
    crash = [sys.executable, "-c",
             "import os, signal; print('start', flush=True); os.kill(os.getpid(), signal.SIGSEGV)"]
    assert drv.run_stage(drv.Stage("plain", crash), tmp_path) == 139
    assert (tmp_path / "plain.log").read_text().count("start") == 1
    assert drv.run_stage(drv.Stage("memcheck", crash, retry_crash=True), tmp_path) == 139
    log = (tmp_path / "memcheck.log").read_text()
    assert log.count("start") == 2 and "running it again" in log
    assert log.endswith("memcheck rc=139\n")


def test_summary_joins_the_logs_and_fails_on_a_failed_stage(tmp_path, capsys):
    """gpu.log holds every stage's log under its name; the per-stage logs are removed; the
    run passes only when every stage's status is 0."""
    (tmp_path / "a.log").write_text("3 passed\na rc=0\n")
    (tmp_path / "b.log").write_text("FAILED tests/x.py::t\n1 failed\nb rc=1\n")
    assert drv.summarize(tmp_path, ["a", "b"]) is False
    joined = (tmp_path / "gpu.log").read_text()
    assert joined.startswith("=== a\n3 passed") and "=== b\nFAILED" in joined
    assert not (tmp_path / "a.log").exists() and not (tmp_path / "b.log").exists()
    assert "FAILED tests/x.py::t" in capsys.readouterr().out
    (tmp_path / "c.log").write_text("c rc=0\n")
    assert drv.summarize(tmp_path, ["c"]) is True
