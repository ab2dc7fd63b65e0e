"""``pytest -m gpu`` typed plainly spreads over the machine (oracle/tools/pytest_workers.py):
the worker count from cores and memory, the user's ``-n`` winning, and a run with a faked
CUDA machine that spawns its xdist workers, one GPU each."""

from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from oracle.tools import pytest_workers as pw

ROOT = Path(__file__).resolve().parents[1]
GIB = 1 << 30


@pytest.mark.parametrize("cores, host, gpus, want", [
    (16, 128 * GIB, [80 * GIB], 16),            # one H100, 16 cores: the cores limit
    (16, 40 * GIB, [80 * GIB], 10),             # host memory limits
    (64, 512 * GIB, [16 * GIB], 4),             # a small GPU's memory limits
    (64, 512 * GIB, [80 * GIB, 16 * GIB], 8),   # round-robin: the smaller GPU sets each share
    (32, 256 * GIB, [80 * GIB, 80 * GIB], 32),  # two GPUs, the cores limit
    (1, 128 * GIB, [80 * GIB], 0),              # one core: one process
    (16, 6 * GIB, [80 * GIB], 0),               # room for one worker only: one process
    (16, 128 * GIB, [], 0),                     # no GPU
])
def test_worker_count_is_the_tightest_limit(cores, host, gpus, want):
    """The worker count is the least of the cores, host memory / 4 GiB and the GPUs'
    share (the smallest GPU's memory / 4 GiB, times the GPUs); fewer than two is none."""
    assert pw.worker_count(cores, host, gpus) == want


def test_worker_count_rejects_nonsense():
    """Zero cores or negative memory is a clear error naming the arguments."""
    with pytest.raises(ValueError, match="cores must be >= 1"):
        pw.worker_count(0, GIB, [GIB])
    with pytest.raises(ValueError, match="memory sizes >= 0"):
        pw.worker_count(4, -1, [GIB])


class _Allocator:
    """What ``release_cached_gpu_memory`` reads of ``torch.cuda``: an allocator holding
    ``reserved`` bytes, which ``empty_cache`` returns to the device."""

    def __init__(self, initialized: bool, reserved: int):
        self.initialized, self.reserved = initialized, reserved

    def is_initialized(self) -> bool:
        return self.initialized

    def memory_reserved(self) -> int:
        return self.reserved

    def empty_cache(self) -> None:
        self.reserved = 0


@pytest.mark.parametrize("initialized, reserved, released", [
    (True, 9 * GIB, True), (True, pw.KEPT_RESERVED_BYTES + 1, True),
    (True, pw.KEPT_RESERVED_BYTES, False), (False, 9 * GIB, False)])
def test_a_worker_returns_cached_gpu_memory_beyond_its_share(initialized, reserved, released):
    """After a test, a worker whose allocator caches more than half its share of the GPU
    returns the cache (so a neighbour's multi-GB test finds room); one within it, or one
    that never initialised CUDA, keeps it (no CUDA context made for nothing)."""
    cuda = _Allocator(initialized, reserved)
    assert pw.release_cached_gpu_memory(cuda) is released
    assert cuda.reserved == (0 if released else reserved)


@pytest.mark.parametrize("expr, want", [
    ("gpu", True), ("gpu and not slow", True), ("gpu or interp", True),
    ("not gpu and not fuzz", False), ("interp", False), ("", False), ("not gpu", False),
])
def test_only_a_selection_of_gpu_tests_counts(expr, want):
    """Only a ``-m`` expression that selects a test marked ``gpu`` turns the plugin on (the
    CPU default ``not gpu and not fuzz`` never does)."""
    assert pw.selects_gpu_tests(expr) is want


def test_the_root_conftest_registers_the_plugin(request):
    """conftest.py assigns ``pytest_plugins`` once (a second assignment silently drops the
    first) naming this plugin and the gate, and this very run has both loaded."""
    tree = ast.parse((ROOT / "conftest.py").read_text())
    names = [ast.literal_eval(node.value) for node in tree.body if isinstance(node, ast.Assign)
             and any(getattr(t, "id", "") == "pytest_plugins" for t in node.targets)]
    assert len(names) == 1, names
    assert {"oracle.tools.pytest_workers", "oracle.tools.pytest_gate"} <= set(names[0])
    for plugin in ("oracle.tools.pytest_workers", "oracle.tools.pytest_gate"):
        assert request.config.pluginmanager.hasplugin(plugin), plugin


_FAKE = textwrap.dedent("""
    # A CUDA machine with two 80 GiB GPUs, 2 cores and 64 GiB free, as the plugin sees it.
    import oracle.tools.pytest_workers as pw
    pw.gpu_memories = lambda: [80 << 30, 80 << 30]
    pw.usable_cores = lambda: 2
    pw.host_memory = lambda: 64 << 30
""")
_NO_XDIST = "import oracle.tools.pytest_workers as pw\npw.xdist_installed = lambda: False\n"
_TEST = textwrap.dedent("""
    import os, pathlib, pytest

    @pytest.mark.gpu
    @pytest.mark.parametrize("i", range(4))
    def test_where(i, request):
        env = os.environ
        pathlib.Path(env["WHERE"], str(i)).write_text(
            f"{env.get('PYTEST_XDIST_WORKER', '-')} {env.get('ORACLE_GPUS', '-')}")
        if "ORDER" in env:  # the order this process collected the tests in
            pathlib.Path(env["ORDER"]).write_text(
                " ".join(item.name for item in request.session.items))
""")


def _run(tmp_path, *args, rc=0, **extra_env):
    """Run pytest on the tiny gpu test in tmp_path; returns (stdout, where each test ran)."""
    (tmp_path / "pytest.ini").write_text(
        "[pytest]\nmarkers =\n    gpu: needs CUDA\n"
        # The fakes import the plugin before pytest does: nothing of it to rewrite.
        "filterwarnings =\n    ignore::pytest.PytestAssertRewriteWarning\n")
    (tmp_path / "conftest.py").write_text('pytest_plugins = ("oracle.tools.pytest_workers",)\n')
    (tmp_path / "fakecuda.py").write_text(_FAKE)
    (tmp_path / "noxdist.py").write_text(_NO_XDIST)
    (tmp_path / "test_tiny.py").write_text(_TEST)
    where = tmp_path / "where"
    where.mkdir(exist_ok=True)
    for f in where.iterdir():
        f.unlink()
    env = {k: v for k, v in os.environ.items()
           if k not in ("ORACLE_GPUS", "CUDA_VISIBLE_DEVICES", "PYTEST_ADDOPTS",
                        "PYTEST_XDIST_WORKER")}
    env.update(WHERE=str(where), PYTHONPATH=f"{ROOT}:{tmp_path}",
               ORACLE_TEST_SECONDS=str(tmp_path / "seconds.json"), **extra_env)
    r = subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", *args],
                       cwd=tmp_path, env=env, capture_output=True, text=True)
    assert r.returncode == rc, r.stdout[-2000:] + r.stderr[-2000:]
    return r.stdout, sorted(f.read_text() for f in where.iterdir())


def test_plain_gpu_run_spawns_one_worker_per_core_each_on_its_gpu(tmp_path):
    """``pytest -m gpu`` on a (faked) two-GPU CUDA machine with 2 cores runs in 2 xdist
    workers with ``--dist loadgroup``, each told of the 2 GPUs (ORACLE_GPUS) so that
    conftest's pin_worker_gpu puts it on its own."""
    out, where = _run(tmp_path, "-p", "fakecuda", "-m", "gpu")
    assert "2 workers [4 items]" in out, out
    assert len(where) == 4 and all(w.startswith("gw") and w.endswith(" 2") for w in where)
    assert {w.split()[0] for w in where} <= {"gw0", "gw1"}


def test_a_plain_run_keeps_the_tests_seconds_and_the_next_sends_the_slowest_first(tmp_path):
    """The faked CUDA run writes every test's seconds (ORACLE_TEST_SECONDS); the next run's
    workers collect the tests slowest first by them (a test never timed first of all),
    while a run without the file keeps the collection order."""
    order = tmp_path / "order"
    _run(tmp_path, "-p", "fakecuda", "-m", "gpu", ORDER=str(order))
    assert order.read_text() == "test_where[0] test_where[1] test_where[2] test_where[3]"
    seconds = json.loads((tmp_path / "seconds.json").read_text())
    assert sorted(seconds) == [f"test_tiny.py::test_where[{i}]" for i in range(4)]
    assert all(v >= 0 for v in seconds.values())
    timed = {"test_tiny.py::test_where[0]": 0.1, "test_tiny.py::test_where[1]": 3.0,
             "test_tiny.py::test_where[3]": 2.0}
    (tmp_path / "seconds.json").write_text(json.dumps(timed))
    _run(tmp_path, "-p", "fakecuda", "-m", "gpu", ORDER=str(order))
    assert order.read_text() == "test_where[2] test_where[1] test_where[3] test_where[0]"
    assert len(json.loads((tmp_path / "seconds.json").read_text())) == 4


def test_slowest_first_keeps_groups_together_and_breaks_ties_by_collection_order():
    """Groups go by their summed seconds (two 2 s tests of one group before a 3 s test),
    a group's tests stay together in collection order, equal totals keep collection order,
    and without any seconds the order is the collection's."""
    ids = ["a", "b", "c", "d", "e"]
    groups = [None, "g", None, "g", None]
    secs = {"a": 1.0, "b": 2.0, "c": 3.0, "d": 2.0, "e": 1.0}
    assert pw.slowest_first(ids, groups, secs) == [1, 3, 2, 0, 4]
    assert pw.slowest_first(ids, groups, {}) == [0, 1, 3, 2, 4]


def test_the_seconds_file_merges_and_a_bad_one_is_ignored(tmp_path):
    """Writing merges with what the file held (tests not run keep their seconds); an
    unreadable or malformed file reads as empty; ``off`` disables it."""
    path = tmp_path / "s.json"
    pw.write_seconds(path, {"a": 1.0, "b": 2.0})
    pw.write_seconds(path, {"b": 5.0})
    assert pw.read_seconds(path) == {"a": 1.0, "b": 5.0}
    path.write_text("[not a dict")
    assert pw.read_seconds(path) == {}
    path.write_text('["a list"]')
    assert pw.read_seconds(path) == {}
    assert pw.seconds_path({pw.SECONDS_ENV: "off"}) is None
    assert pw.seconds_path({"XDG_CACHE_HOME": "/x"}) == Path(
        "/x/sparse-attn-oracle/test-seconds.json")


@pytest.mark.parametrize("args", [("-n", "0"), ("-p", "no:xdist"), ("--pdb",)])
def test_the_users_choice_wins(tmp_path, args):
    """``-n 0``, ``-p no:xdist`` or ``--pdb`` keeps the faked CUDA run in one process,
    silently."""
    out, where = _run(tmp_path, "-p", "fakecuda", "-m", "gpu", *args)
    assert where == ["- -"] * 4 and "pytest-xdist" not in out


def test_an_explicit_worker_count_wins(tmp_path):
    """``-n 1`` on the faked two-GPU machine gives one worker, and no ORACLE_GPUS."""
    _, where = _run(tmp_path, "-p", "fakecuda", "-m", "gpu", "-n", "1")
    assert where == ["gw0 -"] * 4


def test_no_cuda_or_no_gpu_selection_stays_in_one_process(tmp_path):
    """Without CUDA (this machine as it is), or with a ``-m`` that selects no gpu test,
    the run is left alone."""
    _, where = _run(tmp_path, "-m", "gpu")
    assert where == ["- -"] * 4
    out, where = _run(tmp_path, "-p", "fakecuda", "-m", "not gpu", rc=5)  # all deselected
    assert where == [] and "workers" not in out


def test_without_xdist_the_header_says_how_to_go_faster(tmp_path):
    """With pytest-xdist absent (faked) the faked CUDA run stays in one process and its
    header says once how to spread it."""
    out, where = _run(tmp_path, "-p", "fakecuda", "-p", "noxdist", "-p", "no:xdist", "-m", "gpu")
    assert where == ["- -"] * 4 and out.count("install pytest-xdist") == 1


def test_the_sm90_compile_checks_are_not_gpu_tests():
    """The sm_90 compile checks (for GPU-less machines) and the CPU budget's mutant kills
    carry neither ``gpu`` nor ``interp`` (which a CUDA machine turns into ``gpu``):
    ``-m "gpu or interp"`` collects none of them, while the default run collects them
    all."""
    files = ["tests/test_compile_sm90.py", "tests/test_static_sm90.py",
             "tests/test_mutants.py::test_cpu_budget_kills_the_mutant"]

    def collected(*args):
        r = subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider",
                            "--collect-only", "-q", *args, *files], cwd=ROOT,
                           capture_output=True, text=True, env={**os.environ,
                                                                "PYTHONPATH": str(ROOT)})
        return [ln for ln in r.stdout.splitlines() if "::" in ln]

    assert collected("-m", "gpu or interp") == []
    assert len(collected()) >= 10


def test_the_environment_script_keeps_bytecode_where_the_user_turned_it_off():
    """`.ci/env` runs Python with bytecode written (the test run's hundred processes then
    compile the project once) even under PYTHONDONTWRITEBYTECODE=1."""
    env = dict(os.environ, PYTHONDONTWRITEBYTECODE="1")
    r = subprocess.run([str(ROOT / ".ci" / "env"), "python", "-c",
                        "import sys; print(sys.dont_write_bytecode)"],
                       env=env, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.split() == ["False"]
