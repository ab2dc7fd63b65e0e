"""The command line: each verb runs, and bad input exits non-zero with one line."""

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _run(*args):
    """The CLI in a fresh process WITHOUT the TRITON_INTERPRET that conftest.py set: as a
    user runs it, so the CLI itself must pick the interpreter on a machine without CUDA."""
    return subprocess.run([sys.executable, "-m", "oracle", *args], capture_output=True,
                          text=True, env=_user_env())


def _user_env() -> dict:
    return {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}


# Runs each argument list of stdin's JSON through the CLI's main, as `python -m oracle`
# does, and prints one [exit code, stdout, stderr] per list (an uncaught exception: its
# traceback on stderr, exit 1, as Python itself would).
_BATCH = textwrap.dedent("""
    import contextlib, io, json, sys, traceback
    from oracle.tools.cli import main
    results = []
    for argv in json.loads(sys.stdin.read()):
        out, err = io.StringIO(), io.StringIO()
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            try:
                code = main(argv)
            except SystemExit as e:
                code = e.code if isinstance(e.code, int) else int(e.code is not None)
            except BaseException:
                traceback.print_exc()
                code = 1
        results.append([code, out.getvalue(), err.getvalue()])
    print(json.dumps(results))
""")


@pytest.mark.slow
def test_conformance_prints_every_row_with_zero_mismatches(tmp_path):
    """`python -m oracle conformance` prints every format x policy x source row, all 0."""
    r = _run("conformance", "--out", str(tmp_path / "conf"))
    assert r.returncode == 0, r.stderr
    doc = json.loads((tmp_path / "conf.json").read_text())
    assert len(doc["reference"]) == 4 * 2 * 3
    assert all(row["mismatches"] == 0 for row in doc["reference"])
    for row in doc["reference"]:
        assert f"| {row['fmt']} | {row['policy']} | {row['source']} |" in r.stdout
    assert (tmp_path / "conf.md").exists()


def test_report_render_diff_replay_round_trip(tmp_path):
    """report (the Triton kernel included, interpreted on a CPU machine) writes JSON +
    Markdown + PNGs; render re-renders them from the JSON; diff of
    a report against itself flags nothing; replay of a case id reproduces its input hash."""
    out = tmp_path / "rep"
    r = _run("report", "--ops", "reshape_and_cache", "--platforms", "rocm-fnuz",
             "--shape-classes", "tiny", "--quiet", "--out", str(out))
    assert r.returncode == 0, r.stdout + r.stderr
    doc = json.loads(out.with_suffix(".json").read_text())
    assert doc["schema"] == "oracle-report/1" and doc["cells"]
    assert {"reference", "torch", "triton"} <= {c["impl"] for c in doc["cells"]}
    for suffix in (".md", "-ulp.png", "-err-bound.png"):
        assert (tmp_path / f"rep{suffix}").stat().st_size > 0
    r = _run("render", str(out.with_suffix(".json")), "--out", str(tmp_path / "again"))
    assert r.returncode == 0 and (tmp_path / "again.md").exists()
    r = _run("diff", str(out.with_suffix(".json")), str(out.with_suffix(".json")))
    assert r.returncode == 0 and "0 worse" in r.stdout
    case = doc["cells"][0]["per_case"][0]
    r = _run("replay", case["case"], "--hash", case["hash"])
    assert r.returncode == 0 and case["hash"] in r.stdout


def test_report_writes_no_tracked_file_and_baseline_verbs_round_trip(tmp_path):
    """report without --out writes out/KIND.json (git-ignored): no tracked file changes, the
    report names its commit; baseline accept writes KIND.json.gz from a run's report,
    show summarises it, diff of the same report against it flags nothing; a report
    without differential cells is refused with one line."""
    from oracle.core import report
    from oracle.tools.baseline import OUT_DIR, device_kind

    def tracked_changes():
        return subprocess.run(["git", "status", "--porcelain", "--untracked-files=all"],
                              cwd=ROOT, capture_output=True, text=True).stdout

    before = tracked_changes()
    r = _run("report", "--ops", "reshape_and_cache", "--platforms", "cuda",
             "--shape-classes", "tiny", "--impls", "torch", "--quiet")
    assert r.returncode == 0, r.stdout + r.stderr
    assert tracked_changes() == before
    run = OUT_DIR / f"{device_kind()}.json"
    doc = json.loads(run.read_text())
    assert len(doc["machine"]["commit"]) == 40 and doc["cells"]
    base = ("--kind", "testkind", "--dir", str(tmp_path))
    r = _run("baseline", "accept", "--report", str(run), *base)
    assert r.returncode == 0, r.stderr
    assert report.load(tmp_path / "testkind.json.gz")["cells"] == doc["cells"]
    r = _run("baseline", "show", *base)
    assert r.returncode == 0 and f"{len(doc['cells'])} cells" in r.stdout, r.stdout + r.stderr
    r = _run("baseline", "diff", "--report", str(run), *base)
    assert r.returncode == 0 and "0 worse" in r.stdout, r.stdout + r.stderr
    empty = tmp_path / "empty.json"
    empty.write_text(json.dumps({**doc, "cells": []}))
    r = _run("baseline", "accept", "--report", str(empty), *base)
    assert r.returncode == 2 and "no differential cells" in r.stderr, r.stderr


BAD_INPUT = [
    (("frobnicate",), "invalid choice"),
    (("report", "--ops", "attention_sideways"), "ops must be among"),
    (("report", "--platforms", "rocm"), "platforms must be among"),
    (("replay", "attention_decode:tiny:normal"), "case id must read"),
    (("replay", "attention_decode:tiny:normal:mars:auto:bfloat16:none:1"), "platform"),
]


@pytest.mark.parametrize("args, needle", BAD_INPUT)
def test_bad_input_exits_non_zero_without_traceback(args, needle, cli):
    """Unknown verbs, ops, platforms and malformed case ids give one clear line, exit != 0."""
    r = cli[args]
    assert r.returncode != 0 and "Traceback" not in r.stderr and needle in r.stderr


def test_malformed_report_file_is_a_clear_error(tmp_path):
    """diff/render on a file that is not a report exit 2 with a message naming the file."""
    bad = tmp_path / "bad.json"
    bad.write_text('{"schema": "something-else"}')
    for args in (("render", str(bad)), ("diff", str(bad), str(bad)),
                 ("render", str(tmp_path / "missing.json"))):
        r = _run(*args)
        assert r.returncode == 2 and "Traceback" not in r.stderr and "report file" in r.stderr


def test_xdist_workers_get_one_gpu_each():
    """ORACLE_GPUS=N: worker gwK gets GPU K mod N through CUDA_VISIBLE_DEVICES; not a
    worker, one GPU, or a user's CUDA_VISIBLE_DEVICES: nothing is set."""
    from oracle.tools.gpus import pin_worker_gpu, worker_gpu

    assert [worker_gpu(f"gw{k}", 2) for k in range(4)] == [0, 1, 0, 1]
    assert worker_gpu(None, 4) is None and worker_gpu("gw3", 1) is None
    env = {"PYTEST_XDIST_WORKER": "gw5", "ORACLE_GPUS": "4"}
    assert pin_worker_gpu(env) == 1 and env["CUDA_VISIBLE_DEVICES"] == "1"
    env = {"PYTEST_XDIST_WORKER": "gw5", "ORACLE_GPUS": "4", "CUDA_VISIBLE_DEVICES": "3"}
    assert pin_worker_gpu(env) is None and env["CUDA_VISIBLE_DEVICES"] == "3"
    assert pin_worker_gpu({"ORACLE_GPUS": "2"}) is None


def test_pool_workers_get_one_gpu_each(monkeypatch):
    """``pin_gpu``: pool worker i on GPU i mod N, nothing set for one GPU or a user's
    CUDA_VISIBLE_DEVICES; the false-alarm pool's initializer gives its workers GPUs 0 and 1
    on two GPUs (each process sees the variable before anything touches CUDA)."""
    import multiprocessing

    from oracle.tools.falsealarm import _pin_worker
    from oracle.tools.gpus import pin_gpu

    env = {}
    assert pin_gpu(3, 2, env) == 1 and env["CUDA_VISIBLE_DEVICES"] == "1"
    assert pin_gpu(3, 1, {}) is None
    env = {"CUDA_VISIBLE_DEVICES": "5"}
    assert pin_gpu(0, 2, env) is None and env["CUDA_VISIBLE_DEVICES"] == "5"
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    ctx = multiprocessing.get_context("spawn")
    with ctx.Pool(2, _pin_worker, (ctx.Value("i", 0), 2)) as pool:
        seen = set(pool.map(_visible_devices, range(40), chunksize=1))
    assert seen == {"0", "1"}


def _visible_devices(_):
    import os
    import time

    time.sleep(0.01)  # both workers take tasks
    return os.environ.get("CUDA_VISIBLE_DEVICES")


def test_no_verb_shows_the_help_and_runs_nothing():
    """`oracle` alone prints the verbs (each once) and exits 2 at once, never a report."""
    r = _run()
    assert r.returncode == 2 and "usage: oracle" in r.stdout and "cases on" not in r.stdout
    verbs = r.stdout.split("verbs:", 1)[1]
    for verb in ("report", "render", "diff", "replay", "fuzz", "mutants", "falsealarm"):
        listed = [line.split()[0] for line in verbs.splitlines() if line.startswith("    ")
                  and not line.startswith("     ")]
        assert listed.count(verb) == 1, verb


HELP_VERBS = ["report", "fuzz", "falsealarm", "replay", "e2e"]


@pytest.mark.parametrize("verb", HELP_VERBS)
def test_verb_help_lists_the_valid_names(verb, cli):
    """`oracle VERB --help` names every op, every registered implementation and platform."""
    from oracle.core.cases import OPS
    from oracle.core.registry import known_names
    from reference.platforms import PLATFORMS

    r = cli[(verb, "--help")]
    assert r.returncode == 0
    tail = r.stdout.split("\nops: ", 1)[1]
    for name in (*OPS, *known_names(), *PLATFORMS):
        assert name in tail, name


@pytest.mark.parametrize("args", [
    ("report", "--ops", "reshape_and_cache", "--impls", "flex"),
    ("report", "--ops", "reshape_and_cache", "--impls", "triton_flat"),
])
def test_report_that_checks_nothing_says_so_and_fails(args, tmp_path):
    """A selection no implementation on this machine claims exits 1 with one line saying
    nothing was checked, and writes no report. (triton_flat runs on CUDA only: on a GPU
    machine the selection checks something, so the case is CPU-only.)"""
    if "triton_flat" in args and _cuda():
        pytest.skip("triton_flat claims cases on a CUDA machine")
    r = _run(*args, "--quiet", "--out", str(tmp_path / "rep"))
    assert r.returncode == 1 and "nothing to check" in r.stderr, r.stdout + r.stderr
    assert "Traceback" not in r.stderr and not list(tmp_path.iterdir())


def _cuda() -> bool:
    import torch

    return torch.cuda.is_available()


OUT_OF_RANGE = [
    (("report", "--ops", ","), "--ops must name at least one entry, got ','"),
    (("report", "--impls", " ,"), "--impls must name at least one entry"),
    (("fuzz", "--seconds", "-5"), "--seconds must be > 0, got -5"),
    (("fuzz", "--minutes", "0"), "--minutes must be > 0, got 0"),
    (("fuzz", "--seconds", "10", "--warmup", "10"), "--warmup must be in [0, 10)"),
    (("fuzz", "--workers", "0"), "--workers must be >= 1, got 0"),
    (("fuzz", "--configs", "-1"), "--configs must be >= 0, got -1"),
    (("fuzz", "--config-salt", "-2"), "--config-salt must be >= 0, got -2"),
    (("fuzz", "--seconds", "nan"), "--seconds must be > 0, got nan"),
    (("report", "--budget", "0"), "--budget must be >= 1, got 0"),
    (("falsealarm", "--cases", "0"), "--cases must be >= 1, got 0"),
    (("falsealarm", "--seconds", "-1"), "--seconds must be > 0, got -1"),
    (("falsealarm", "--seed", "-1"), "--seed must be >= 0, got -1"),
    (("mutants", "--fuzz-seconds", "-1"), "--fuzz-seconds must be >= 0, got -1"),
    (("e2e", "--seed", "-3"), "--seed must be >= 0, got -3"),
    (("e2e", "--workers", "0"), "--workers must be >= 1, got 0"),
]


@pytest.mark.parametrize("args, needle", OUT_OF_RANGE)
def test_out_of_range_numbers_name_the_option(args, needle, cli):
    """Every numeric option out of its range: one line naming the option, its range and the
    value given, exit 2, before any work."""
    r = cli[args]
    assert r.returncode == 2 and needle in r.stderr and "Traceback" not in r.stderr, r.stderr
    assert len(r.stderr.strip().splitlines()) == 1


UNWRITABLE = [
    ("report", "--ops", "reshape_and_cache", "--shape-classes", "tiny", "--out", "/proc/x"),
    ("fuzz", "--seconds", "1", "--report", "/proc/x.json"),
    ("falsealarm", "--cases", "1", "--out", "/proc/x.json"),
    ("conformance", "--out", "/proc/x"),
]


@pytest.mark.parametrize("args", UNWRITABLE)
def test_unwritable_out_fails_before_the_run(args, cli):
    """An output path that cannot be written is a one-line error naming the option, exit 2,
    before any case runs."""
    r = cli[args]
    assert r.returncode == 2 and "is not writable" in r.stderr, r.stdout + r.stderr
    assert "Traceback" not in r.stderr and "cases on" not in r.stdout


def test_out_under_a_file_fails_before_the_run(tmp_path):
    """--out whose folder cannot be made (a plain file stands in its path): the same
    one-line error, before any case runs."""
    (tmp_path / "plain").write_text("")
    r = _run("report", "--ops", "reshape_and_cache", "--out", str(tmp_path / "plain" / "rep"))
    assert r.returncode == 2 and "is not writable" in r.stderr and "cases on" not in r.stdout


def test_render_of_a_directory_is_a_clear_error(tmp_path):
    """render or diff of a folder: one line naming it as a directory, exit 2, no
    traceback."""
    for args in (("render", str(tmp_path)), ("diff", str(tmp_path), str(tmp_path))):
        r = _run(*args)
        assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
        assert "is a directory" in r.stderr.lower() and str(tmp_path) in r.stderr
        assert len(r.stderr.strip().splitlines()) == 1


def test_console_script_is_declared():
    """pyproject.toml declares `oracle` as the console script of tools.cli.main."""
    import tomllib
    from pathlib import Path

    from oracle.tools import cli

    doc = tomllib.loads((Path(__file__).parent.parent / "pyproject.toml").read_text())
    target = doc["project"]["scripts"]["oracle"]
    module, func = target.split(":")
    assert module == cli.__name__ and getattr(cli, func) is cli.main


def test_plots_are_small_multiples_with_labelled_tails(tmp_path):
    """The ULP histogram is a grid (at most HIST_COLUMNS panels a row, not one tall column)
    whose outer bins read "<=-3" / ">=3", each row with a y-label; the err/bound plot's
    axis is logarithmic, so ratios of 0.01 and 0.17 stay apart."""
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib import image

    from oracle.core import render
    from oracle.core.checks import ULP_BINS

    assert render.ulp_labels() == ["<=-3", "-2", "-1", "0", "1", "2", ">=3"]
    assert len(render.ulp_labels()) == len(ULP_BINS)
    cells = [{"op": f"op{i}", "impl": "k", "ulp_hist": {str(b): 1 + i for b in ULP_BINS},
              "per_case": [{"max_err_over_bound": r} for r in (0.0, 0.01, 0.17)]}
             for i in range(9)]
    groups = render._groups({"cells": cells})
    fig = render._ulp_figure(groups, sorted(groups))
    axes = [ax for ax in fig.axes if ax.get_visible()]
    assert len(axes) == 9 and len(fig.axes) == 12  # 3 rows of 4
    assert [t.get_text() for t in axes[-1].get_xticklabels()] == render.ulp_labels()
    assert sum(bool(ax.get_ylabel()) for ax in fig.axes) == 3
    fig = render._ratio_figure(groups, sorted(groups))
    assert fig.axes[0].get_xscale() == "log"
    paths = render.plots({"cells": cells}, tmp_path / "p")
    height, width = image.imread(paths[0]).shape[:2]
    assert width > height  # a grid, not a column of 9 panels


def test_report_prints_no_warnings_a_user_cannot_act_on(tmp_path):
    """The interpreted Triton insert's report (whose masked-off lanes divide integers by
    zero inside the interpreter) prints no RuntimeWarning or DeprecationWarning."""
    r = _run("report", "--ops", "norm_rope_insert", "--impls", "triton", "--platforms",
             "rocm-fnuz", "--shape-classes", "tiny", "--quiet", "--out", str(tmp_path / "r"))
    assert r.returncode == 0, r.stdout + r.stderr
    assert "Warning" not in r.stderr, r.stderr


def test_impls_lists_every_implementation_and_why_it_cannot_run_here():
    """`python -m oracle impls` prints one row per registered implementation (name, op,
    devices, formats, platforms, model dtypes, shape classes, whether it runs here), the
    registry of the CLI's own process row for row; one that needs another device says
    which (a CPU implementation runs anywhere); a project module that cannot load is
    listed with its reason."""
    from oracle.core.registry import REGISTRY
    from oracle.impls.catalog import UNAVAILABLE, device_name

    r = _run("impls")
    assert r.returncode == 0, r.stderr
    rows = [[c.strip() for c in line.strip("|").split("|")]
            for line in r.stdout.splitlines()[2:] if line.startswith("|")]
    assert r.stdout.splitlines()[0].split("|")[1:-1] == [
        " name ", " op ", " devices ", " formats ", " platforms ", " model dtypes ",
        " shape classes ", " here "]
    listed = {(row[0], row[1]): row for row in rows}
    here = device_name()
    for op, impls in REGISTRY.items():
        for name, impl in impls.items():
            row = listed.pop((name, op))
            assert row[2] == ",".join(impl.devices)
            assert row[5] == ",".join(impl.model_dtypes)
            assert row[6] == ",".join(impl.shape_classes)
            runs = here in impl.devices or "cpu" in impl.devices
            want = "runs" if runs else "needs a CUDA device"
            assert row[7] == want, (name, op, row)
    for module, reason in UNAVAILABLE.items():
        assert listed.pop((module, "-"))[7] == f"not loaded: {reason}"
    assert not listed, listed


@pytest.fixture(scope="module")
def cli():
    """The results of every argument list of BAD_INPUT, HELP_VERBS, OUT_OF_RANGE and
    UNWRITABLE, run through the CLI's main in ONE fresh process with the user's
    environment (``_BATCH``; a process each costs seconds of imports): {args: the run}."""
    argvs = [*(a for a, _ in BAD_INPUT), *((v, "--help") for v in HELP_VERBS),
             *(a for a, _ in OUT_OF_RANGE), *UNWRITABLE]
    r = subprocess.run([sys.executable, "-c", _BATCH], input=json.dumps(argvs), cwd=ROOT,
                       capture_output=True, text=True, env=_user_env())
    assert r.returncode == 0, r.stderr[-3000:]
    results = json.loads(r.stdout.splitlines()[-1])
    return {tuple(a): subprocess.CompletedProcess(a, code, out, err)
            for a, (code, out, err) in zip(argvs, results)}


def test_the_batch_runs_each_argument_list_as_its_own_process_would(cli):
    """The batch's results are those of a process per argument list: the same exit code,
    output and error output (a sample: an argparse error, a help text, a range error)."""
    for args in (BAD_INPUT[0][0], ("fuzz", "--help"), OUT_OF_RANGE[2][0]):
        alone = _run(*args)
        got = cli[tuple(args)]
        assert (got.returncode, got.stdout, got.stderr) == (
            alone.returncode, alone.stdout, alone.stderr), args
