"""benchmarks/bench_loop.py on the CPU with a tiny selection: the cold run fills the
reference cache (misses), the warm run after the touch reads it (hits, no miss), both
runs' times are split into JIT, reference and the rest, and the JSON and Markdown are
written."""

from __future__ import annotations

import json
import os
from types import SimpleNamespace

import pytest

from benchmarks import bench_loop


@pytest.fixture(autouse=True)
def _one_process(monkeypatch):
    """The nested runs in one process: CI's ``PYTEST_ADDOPTS`` (``-n <cores>``) would give
    each its own xdist workers to start and, on an interrupted run, to stop."""
    monkeypatch.setenv("PYTEST_ADDOPTS", "")


SELECTION = ("tests/test_differential.py::test_implementation_matches_reference"
             "[cpu|torch|indexer_decode:tiny:normal:cuda:auto:bfloat16:none:1:c0]")


def test_a_warm_run_alone_reuses_a_cold_runs_caches(tmp_path, capsys):
    """--runs warm alone is refused on a --work without caches; after a --runs cold call
    it reads what that run left, as the warm half of one call would (one call making both
    runs goes through the same ``measure``: the timeout test below). Cold: the reference
    lookups miss; warm: every one hits; the reference's seconds are part of the tests'
    seconds; the interpreter compiles nothing; each run's Markdown has its row and each
    run's gate report is its own."""
    work = str(tmp_path / "work")
    try:
        bench_loop.main(["--out", str(tmp_path / "o"), "--work", work, "--runs", "warm"])
    except SystemExit as e:
        assert e.code == 2
    assert "needs --work holding a cold run's caches" in capsys.readouterr().err
    runs = {}
    for name in ("cold", "warm"):
        out = tmp_path / name
        assert bench_loop.main(["--out", str(out), "--work", work, "--runs", name,
                                "--pytest-args", SELECTION]) == 0
        (runs[name],) = json.loads((out / "loop.json").read_text())["runs"].values()
        assert f"| {name} |" in (out / "loop.md").read_text()
        report = json.loads((out / f"last-run-{name}.json").read_text())
        assert report["suite"]["outcomes"] == {"passed": 1}
    cold, warm = runs["cold"], runs["warm"]
    assert cold["tests"] == warm["tests"] == 1
    assert cold["ref_misses"] > 0
    assert warm["ref_misses"] == 0 and warm["ref_hits"] == cold["ref_misses"] + cold["ref_hits"]
    for r in (cold, warm):
        assert 0 <= r["ref_memory_hits"] <= r["ref_hits"]
        assert 0 < r["reference_s"] <= r["test_s"] <= r["wall_s"]
        assert r["jit_count"] == r["built"] == r["distinct_compiles"] == 0
        assert r["exit_code"] == 0
        assert abs(r["other_s"] - (r["test_s"] - r["reference_s"] - r["jit_s"])) < 1e-9
    assert warm["new_specs"] == {"count": 0, "examples": []}
    assert "compiled no specialisation the cold run did not" in (
        tmp_path / "warm" / "loop.md").read_text()


def test_the_cold_run_refuses_a_filled_cache_directory(tmp_path, capsys):
    """--work holding a cache already is refused before any run (a cold run needs empty
    caches)."""
    (tmp_path / "reference").mkdir()
    try:
        bench_loop.main(["--out", str(tmp_path / "o"), "--work", str(tmp_path)])
    except SystemExit as e:
        assert e.code == 2
    assert "must not hold a cache yet" in capsys.readouterr().err


def test_a_run_past_its_timeout_is_stopped_and_marked(tmp_path, monkeypatch):
    """--timeout stops a run (its whole process group) and records exit 124 for it, with
    the JSON still written. The grace after SIGINT is cut short: a pytest interrupted while
    still importing torch on a loaded machine has sat out the whole grace before its
    SIGKILL."""
    monkeypatch.setattr(bench_loop, "INTERRUPT_GRACE_S", 3)
    out = tmp_path / "out"
    rc = bench_loop.main(["--out", str(out), "--work", str(tmp_path / "work"),
                          "--timeout", "0.5", "--pytest-args", "tests/test_oracle.py"])
    doc = json.loads((out / "loop.json").read_text())
    assert rc == 124 and [r["exit_code"] for r in doc["runs"].values()] == [124, 124]
    assert all(r["wall_s"] < 60 for r in doc["runs"].values())


def test_a_run_counts_the_kernels_it_built_by_name(tmp_path):
    """``built`` counts the disk-cache entries (``<hash>/__grp__<name>.json``) a run wrote,
    not those it found there, and ``built_by_kernel`` names them, the most built first;
    without the profile on, the record keeps no profile."""
    cache = tmp_path / "triton"
    (cache / "old").mkdir(parents=True)
    (cache / "old" / "__grp__k.json").write_text("{}")
    test = tmp_path / "test_builds.py"
    test.write_text(
        "import os, pathlib\n"
        "def test_builds():\n"
        "    root = pathlib.Path(os.environ['TRITON_CACHE_DIR'])\n"
        "    for h, name in (('a', 'k'), ('b', 'k'), ('c', 'j')):\n"
        "        (root / h).mkdir()\n"
        "        (root / h / f'__grp__{name}.json').write_text('{}')\n"
        "        (root / h / f'{name}.json').write_text('{}')\n")
    run = bench_loop.run_pytest([str(test)], {**os.environ, "TRITON_CACHE_DIR": str(cache)},
                                tmp_path / "probes")
    assert run["exit_code"] == 0
    assert run["built"] == 3 and run["built_by_kernel"] == {"k": 2, "j": 1}
    (file,) = run["by_file"].values()  # one process, one file, one test
    assert run["busy_s"] == [file["s"]] and file["tests"] == 1
    # One process: its start, its test and its end fit in the wall time, in that order.
    assert 0 < run["start_s"] == run["last_start_s"] and run["end_s"] >= 0
    assert run["start_s"] + file["s"] + run["end_s"] <= run["wall_s"] + 0.2
    assert run["slowest"][0]["test"].endswith("test_builds.py::test_builds")
    assert "profile" not in run  # only with the profile on
    assert "k 2, j 1" in bench_loop.markdown(dict(pytest_args=["-m", "gpu"], device="d",
                                                  touched="f", runs={"warm": run}))


def _compile(probe, kernel: str, block: int, source: str = "src1") -> None:
    """One in-memory cache miss as Triton reports it to ``jit_cache_hook``."""
    spec = json.dumps(dict(name=kernel, signature={"x": "*fp32", "BLOCK": "constexpr"},
                           constant_keys=[[1]], constant_vals=[block], attrs_keys=[[0]],
                           attrs_vals=[[["tt.divisibility", 16]]],
                           options={"num_warps": 4}, key="k"))
    fn = SimpleNamespace(module="kernels.m", name=kernel,
                         jit_function=SimpleNamespace(cache_key=source))
    assert bench_loop.Probe.on_compile(probe, fn=fn, compile={"specialization_data": spec}) \
        is False  # Triton goes on compiling


def test_a_warm_runs_new_specialisations_are_named_with_what_differs(tmp_path, monkeypatch):
    """The probe notes every compile's specialisation; ``new_specs`` counts the warm run's
    compiles the cold run lacks and names, for each, the fields in which it differs from
    the closest cold compile of its kernel: a constexpr, the source hash, a variable of
    the environment that Triton's disk-cache key holds, or no cold compile of that kernel
    at all."""
    from kernels._triton import CompileClock

    monkeypatch.setenv(bench_loop.PROBE_ENV, str(tmp_path))
    probe = SimpleNamespace(clock=CompileClock(), current="tests/t.py::a")
    for kernel, block in (("k", 64), ("k", 128), ("j", 64)):
        _compile(probe, kernel, block)
    cold = bench_loop.compiled_specs(tmp_path)
    for f in tmp_path.glob("specs-*.jsonl"):
        f.unlink()
    _compile(probe, "k", 64)  # met cold: not new
    _compile(probe, "k", 32)
    _compile(probe, "j", 64, source="src2")
    _compile(probe, "z", 64)
    monkeypatch.setenv("LLVM_IR_ENABLE_DUMP", "1")  # a variable Triton's disk key holds
    _compile(probe, "k", 128)
    fresh = bench_loop.new_specs(cold, bench_loop.compiled_specs(tmp_path))
    assert len(cold) == 3 and fresh["count"] == 4
    got = sorted((e["kernel"], e["differs_in"], e["fields"]) for e in fresh["examples"])
    assert got == [("kernels.m.j", ["source"], {"source": "src2"}),
                   ("kernels.m.k", ["constexpr [1]"], {"constexpr [1]": "32"}),
                   ("kernels.m.k", ["env"], {"env": '[["LLVM_IR_ENABLE_DUMP", "true"]]'}),
                   ("kernels.m.z", None, {})]
    md = bench_loop.markdown(dict(pytest_args=["-m", "gpu"], device="d", touched="f", runs={
        "warm": dict(wall_s=1, tests=1, test_s=1, jit_s=0, reference_s=0, other_s=1,
                     jit_count=5, ref_hits=0, ref_misses=0, ref_rejected=0, exit_code=0,
                     new_specs=fresh)}))
    assert "compiled 4 specialisations the cold run did not" in md
    assert "`kernels.m.k`: constexpr [1] = 32" in md and "`kernels.m.z`: no cold compile" in md


def test_a_profiled_run_names_the_function_its_tests_spend_their_time_in(tmp_path):
    """With the profile on, every process's tests are profiled and the run's record names
    the function with the most own seconds first (a test's loop), with its calls; the
    seconds by area sum the profile's and stay within the tests' seconds (a run without
    the profile keeps none: the built-kernels test above)."""
    test = tmp_path / "test_spins.py"
    test.write_text(
        "def spin_for_a_while(n):\n"
        "    total = 0\n"
        "    for i in range(n):\n"
        "        total += i * i\n"
        "    return total\n"
        "def test_spins():\n"
        "    for _ in range(3):\n"
        "        spin_for_a_while(300_000)\n")
    env = {**os.environ, bench_loop.PROFILE_ENV: "1"}
    run = bench_loop.run_pytest([str(test)], env, tmp_path / "probes")
    assert run["exit_code"] == 0
    profile = run["profile"]
    top = profile["top_own"][0]  # its loop is its own time: no call inside it
    assert top["function"].endswith("(spin_for_a_while)") and top["calls"] == 3, top
    areas = profile["own_s_by_area"]  # each rounded to 0.1 s
    assert 0 < sum(areas.values()) <= run["test_s"] * 1.05 + 0.05 * len(areas)
    assert "own seconds by area" in bench_loop.markdown(
        dict(pytest_args=["-m", "gpu"], device="d", touched="f", runs={"warm": run}))


def test_a_run_splits_its_time_by_file_and_names_the_specialisations_a_file_alone_builds(
        tmp_path, monkeypatch):
    """``where_time_went`` sums each process's tests (the busiest first), each file's
    seconds, JIT seconds and compiles, lists the slowest tests, and counts for each file
    the specialisations no other file's tests compiled (a spec two files compile is
    neither's alone); ``start_and_end`` times the run's start up to the first test of any
    process and of the last process to begin, and its end after the last test."""
    from kernels._triton import CompileClock

    monkeypatch.setenv(bench_loop.PROBE_ENV, str(tmp_path))
    probe = SimpleNamespace(clock=CompileClock(), current="")
    for test, block in (("tests/a.py::x", 64), ("tests/a.py::y", 128), ("tests/b.py::z", 128),
                        ("tests/b.py::z", 32), ("tests/b.py::z", 16)):
        probe.current = test
        _compile(probe, "k", block)
    (tmp_path / "tests-1.json").write_text(json.dumps([["tests/a.py::x", 2.0, 1.5, 1, 103.0],
                                                       ["tests/b.py::z", 5.0, 4.0, 3, 105.0]]))
    (tmp_path / "tests-2.json").write_text(json.dumps([["tests/a.py::y", 1.0, 0.5, 1, 108.0]]))
    got = bench_loop.where_time_went(tmp_path, top=2)
    # Launched at 100, ended at 112: the first test at 3 s, the second process's first at
    # 8 s; the last test to end (z, 105 + 5) ends 2 s before the run.
    assert bench_loop.start_and_end(tmp_path, 100.0, 112.0) == dict(
        start_s=3.0, last_start_s=8.0, end_s=2.0)
    assert bench_loop.start_and_end(tmp_path / "none", 100.0, 112.0) == {}
    assert got["busy_s"] == [7.0, 1.0]
    assert got["by_file"] == {
        "tests/b.py": dict(tests=1, s=5.0, jit_s=4.0, compiles=3, specs_alone=2),
        "tests/a.py": dict(tests=2, s=3.0, jit_s=2.0, compiles=2, specs_alone=1)}
    assert [t["test"] for t in got["slowest"]] == ["tests/b.py::z", "tests/a.py::x"]


def test_the_fields_that_multiply_a_kernels_specialisations_are_ranked(tmp_path, monkeypatch):
    """``spec_drivers`` counts, per kernel, the specialisations left distinct without each
    varying field (named by its argument) and without every alignment attribute at once:
    four specs from two BLOCK values times two alignments of ``x`` merge to two without
    either field, and a field that never varies is not listed; the Markdown names them
    once for runs with the same compiles."""
    from kernels._triton import CompileClock

    monkeypatch.setenv(bench_loop.PROBE_ENV, str(tmp_path))
    probe = SimpleNamespace(clock=CompileClock(), current="tests/a.py::x")
    for block in (64, 128):
        _compile(probe, "k", block)
    for f in tmp_path.glob("specs-*.jsonl"):  # the same two, x not 16-aligned
        text = f.read_text()
        f.write_text(text + text.replace('"tt.divisibility\\", 16', '"tt.divisibility\\", 8'))
    specs = bench_loop.compiled_specs(tmp_path)
    assert len(specs) == 4
    got = bench_loop.spec_drivers(specs)
    assert got == {"k": dict(specs=4, without={"attrs x": 2, "attrs *": 2,
                                               "constexpr BLOCK": 2})}
    # A later run with the same compiles (a warm run's loads) does not repeat them.
    run = dict(wall_s=1.0, tests=1, test_s=1.0, jit_s=0.0, reference_s=0.0, other_s=1.0,
               jit_count=4, ref_hits=0, ref_misses=0, ref_rejected=0, exit_code=0,
               spec_drivers=got)
    md = bench_loop.markdown(dict(pytest_args=["-m", "gpu"], device="d", touched="f",
                                  runs={"cold": run, "warm": run}))
    assert md.count("`k` compiled 4 specialisations") == 1 and "cold: `k`" in md


_KERNELS = '''\
import triton.language as tl


def first(x_ptr):
    """One store."""
    tl.store(x_ptr, 1)


def second(x_ptr):
    tl.store(x_ptr, 2)
'''


def _jit_keys(path, tag: str) -> dict:
    """Triton's JIT cache keys of the functions of the module at ``path`` (imported afresh
    under its own name; the keys need no GPU)."""
    import importlib.util

    from triton.runtime.jit import JITFunction

    spec = importlib.util.spec_from_file_location(f"bench_loop_edit_{tag}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return {name: JITFunction(getattr(module, name)).cache_key for name in ("first", "second")}


def test_the_edited_run_changes_one_kernels_key_and_restores_the_file(tmp_path, capsys):
    """``kernel_edited`` changes one line, in the named function's body, and no line
    moves: that function's JIT cache key changes and the next function's does not (its
    key holds its first line); on the way out the file is the same bytes with the same
    mtime. A function the file lacks is refused, by the command line before any run."""
    path = tmp_path / "kernels.py"
    path.write_text(_KERNELS)
    os.utime(path, ns=(1_000_000_000, 2_000_000_000))
    before = _jit_keys(path, "before")
    with bench_loop.kernel_edited(path, "first"):
        edited = path.read_text().splitlines()
        changed = [i for i, (a, b) in enumerate(zip(_KERNELS.splitlines(), edited)) if a != b]
        assert len(edited) == len(_KERNELS.splitlines()) and changed == [4]
        assert edited[4].endswith(bench_loop.EDIT_COMMENT)
        during = _jit_keys(path, "during")
    assert during["first"] != before["first"] and during["second"] == before["second"]
    assert path.read_text() == _KERNELS and path.stat().st_mtime_ns == 2_000_000_000
    with pytest.raises(ValueError, match="no function 'third'"):
        with bench_loop.kernel_edited(path, "third"):
            pass
    with pytest.raises(SystemExit):
        bench_loop.main(["--out", str(tmp_path / "o"), "--runs", "cold", "edited",
                         "--edit", "third"])
    assert "--edit must name a function of kernels/indexer_decode.py" in capsys.readouterr().err


def test_the_edited_run_runs_its_tests_on_the_changed_source(tmp_path):
    """``measure(runs=("edited",))``: the run's tests see the named function changed, the
    report names it, and the file is as before once the run is over."""
    kernels = tmp_path / "kernels.py"
    kernels.write_text(_KERNELS)
    test = tmp_path / "test_sees_edit.py"
    test.write_text(f"def test_sees_edit():\n"
                    f"    assert {bench_loop.EDIT_COMMENT!r} in open({str(kernels)!r}).read()\n")
    doc = bench_loop.measure([str(test)], kernels, tmp_path / "work", runs=("edited",),
                             edit="first")
    assert doc["runs"]["edited"]["exit_code"] == 0 and doc["edited"] == "first"
    assert "`first` in it changed" in bench_loop.markdown(doc)
    assert kernels.read_text() == _KERNELS
