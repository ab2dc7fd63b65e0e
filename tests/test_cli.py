"""The command line: each verb runs, and bad input exits non-zero with one line."""

import json
import os
import subprocess
import sys

import pytest


def _run(*args):
    """The CLI in a fresh process WITHOUT the TRITON_INTERPRET that conftest.py set: as a
    user runs it, so the CLI itself must pick the interpreter on a machine without CUDA."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    return subprocess.run([sys.executable, "-m", "oracle", *args], capture_output=True,
                          text=True, env=env)


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


@pytest.mark.parametrize(
    "args, needle",
    [
        (("frobnicate",), "invalid choice"),
        (("report", "--ops", "attention_sideways"), "ops must be among"),
        (("report", "--platforms", "rocm"), "platforms must be among"),
        (("replay", "attention_decode:tiny:normal"), "case id must read"),
        (("replay", "attention_decode:tiny:normal:mars:auto:bfloat16:none:1"), "platform"),
    ],
)
def test_bad_input_exits_non_zero_without_traceback(args, needle):
    """Unknown verbs, ops, platforms and malformed case ids give one clear line, exit != 0."""
    r = _run(*args)
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
