"""The kernel-change loop timed: ``pytest -m gpu`` (or ``--pytest-args``) run cold, with an
empty Triton cache (``TRITON_CACHE_DIR``; Inductor's, ``TORCHINDUCTOR_CACHE_DIR``, for the
compiled flex peer) and an empty reference cache (``ORACLE_REFERENCE_CACHE``), then warm,
with the caches as the cold run left them (the tests' seconds too, ``ORACLE_TEST_SECONDS``:
the warm run sends its slowest tests first) and one kernel file's mtime touched (``--touch``;
Triton keys its cache by source contents, so a touch alone recompiles nothing: the warm
number is the floor of an edit's loop). ``--runs edited`` is an edit's loop itself: the
caches as the cold run left them and one kernel's source changed (``--edit``: a comment
put into the body of that ``@triton.jit`` function of the ``--touch`` file, taken out
after the run), so every compile of that kernel, and of no other, is redone.

Each run's wall time, and where its tests' time went, from this module loaded as a pytest
plugin into every pytest process of the run (controller and xdist workers):
- ``jit``: Triton's compiles (``kernels._triton.CompileClock``: every in-memory cache miss,
  disk-cache loads included); ``built`` counts those the compiler built (new entries in
  the disk cache), by kernel: a warm run that builds any met a specialisation the cold run
  did not, and ``new_specs`` says which (``Probe.on_compile`` notes every compile's
  specialisation; ``specs-<run>.json`` beside the caches);
- ``reference``: the differential checks' reference side (``oracle.core.checks._cached``:
  cache lookups and, on a miss, the float64 reference and its bounds), with the reference
  cache's hits, misses and rejected entries (the cases' input sets' entries included);
- ``kernels and the rest``: the tests' remaining time (the launches, input sets, the
  torch peers, the kernel tests' own references).

``--profile`` also profiles every process's tests (cProfile, which slows Python-heavy code)
and adds to each run their own seconds by area (project package or library) and the
functions with the most.

Writes ``loop.json`` and ``loop.md`` under ``--out``, and each run's gate report
(``last-run-cold.json``, ``last-run-warm.json``: one of a whole suite that passed is
what ``python -m oracle baseline accept --report`` takes). Runs on the CPU too (the interpreter
compiles nothing); ``--pytest-args`` narrows the selection, e.g. for a quick CPU check:

    python -m benchmarks.bench_loop --out /tmp/loop --pytest-args "-m gpu -k indexer_decode"
"""

from __future__ import annotations

import argparse
import ast
import contextlib
import cProfile
import hashlib
import json
import os
import pstats
import shlex
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
from triton._C.libtriton import get_cache_invalidating_env_vars

ROOT = Path(__file__).resolve().parents[1]
PROBE_ENV = "BENCH_LOOP_PROBE_DIR"
PROFILE_ENV = "BENCH_LOOP_PROFILE"  # set: every process profiles its tests (cProfile)
SCHEMA = "bench-loop/1"
INTERRUPT_GRACE_S = 30  # for an interrupted pytest to write its reports
LOG_LINES = 400  # of each run's pytest output kept in loop.json: its failures and summary
BUILT_TOP = 20  # kernel names listed by how many specialisations a run built
NEW_TOP = 8  # a warm run's new specialisations explained, field by field
SLOW_TOP = 25  # tests listed by their seconds, the slowest first
DRIVER_KERNELS, DRIVER_FIELDS = 6, 8  # kernels with the most specialisations, fields each
PROFILE_TOP = 40  # functions listed by their own time in a profiled run


# ------------------------------------------------------------ the probe (a pytest plugin)


class Probe:
    """Seconds of one pytest process: its tests, Triton's compiles, the reference side."""

    def __init__(self):
        from kernels._triton import CompileClock, triton

        self.clock = CompileClock().install()
        triton.knobs.runtime.jit_cache_hook = self.on_compile
        self.tests = 0
        self.test_s = 0.0
        self.reference_s = 0.0
        self.current = ""  # the running test's node id, noted with each compile
        # id, seconds, JIT seconds, compiles, start (epoch seconds: one clock for all
        # the run's processes, so that the run's start and end can be told apart)
        self.per_test: list[tuple[str, float, float, int, float]] = []
        self.profile = cProfile.Profile() if os.environ.get(PROFILE_ENV) else None

    def on_compile(self, **kw) -> bool:
        """Triton's in-memory cache missed: note what it compiles (the kernel's source hash,
        its specialisation data: signature, constexprs, alignment, options, and the
        environment variables Triton's disk-cache key holds), then time it."""
        fn, spec = kw["fn"], kw["compile"]["specialization_data"]
        line = json.dumps(dict(kernel=f"{fn.module}.{fn.name}", test=self.current,
                               source=fn.jit_function.cache_key, spec=spec,
                               env=sorted(get_cache_invalidating_env_vars().items())))
        with open(Path(os.environ[PROBE_ENV]) / f"specs-{os.getpid()}.jsonl", "a") as f:
            f.write(line + "\n")
        return self.clock.started(**kw)

    def timed_reference(self, cached):
        def timed(*args, **kwargs):
            t0 = time.perf_counter()
            try:
                return cached(*args, **kwargs)
            finally:
                self.reference_s += time.perf_counter() - t0

        return timed

    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_protocol(self, item):
        t0, jit0, count0 = time.perf_counter(), self.clock.seconds, self.clock.count
        started = time.time()
        self.current = item.nodeid
        if self.profile is not None:
            self.profile.enable()
        yield
        if self.profile is not None:
            self.profile.disable()
        seconds = time.perf_counter() - t0
        self.tests += 1
        self.test_s += seconds
        self.per_test.append((item.nodeid, seconds, self.clock.seconds - jit0,
                              self.clock.count - count0, started))
        self.save()  # after every test: a run stopped by --timeout still tells its share

    def save(self) -> None:
        out = Path(os.environ[PROBE_ENV]) / f"probe-{os.getpid()}.json"
        tmp = out.with_suffix(".tmp")
        tmp.write_text(json.dumps(self.record()))
        os.replace(tmp, out)
        tests = out.with_name(f"tests-{os.getpid()}.json")
        tests.with_suffix(".tmp").write_text(json.dumps(self.per_test))
        os.replace(tests.with_suffix(".tmp"), tests)

    def record(self) -> dict:
        from oracle.core import refcache

        cache = refcache.default_cache()
        return dict(tests=self.tests, test_s=self.test_s, jit_s=self.clock.seconds,
                    jit_count=self.clock.count, reference_s=self.reference_s,
                    ref_hits=cache.hits, ref_memory_hits=cache.memory_hits,
                    ref_misses=cache.misses, ref_rejected=cache.rejected)


def pytest_configure(config):
    if not os.environ.get(PROBE_ENV):
        return
    from oracle.core import checks

    probe = Probe()
    checks._cached = probe.timed_reference(checks._cached)
    config.pluginmanager.register(probe, "bench_loop_probe")


def pytest_unconfigure(config):
    probe = config.pluginmanager.get_plugin("bench_loop_probe")
    if probe is not None:
        probe.save()
        if probe.profile is not None and probe.tests:  # an xdist controller runs none
            probe.profile.dump_stats(Path(os.environ[PROBE_ENV]) / f"profile-{os.getpid()}.prof")


# ------------------------------------------------------------------------- the runs


def built_kernels(triton_cache: Path) -> set[Path]:
    """The kernels Triton's disk cache holds: one ``<hash>/__grp__<name>.json`` per compiled
    specialisation (written when the compiler built it, never when it loaded it)."""
    return set(triton_cache.glob("*/__grp__*.json")) if triton_cache.is_dir() else set()


def by_kernel(paths: set[Path], top: int = BUILT_TOP) -> dict[str, int]:
    """Counts of ``paths`` (``built_kernels`` entries) by kernel name, the largest first."""
    names: dict[str, int] = {}
    for path in paths:
        name = path.name.removeprefix("__grp__").removesuffix(".json")
        names[name] = names.get(name, 0) + 1
    return dict(sorted(names.items(), key=lambda kv: (-kv[1], kv[0]))[:top])


def run_pytest(pytest_args: list[str], env: dict, probes: Path,
               timeout: float | None = None) -> dict:
    """One pytest run in a subprocess with the probe loaded; its wall time, exit code (124:
    stopped at ``timeout`` seconds, its workers with it), the probes' sums and the kernels
    the compiler built (not loaded from the disk cache) during the run."""
    cache = Path(env.get("TRITON_CACHE_DIR", Path.home() / ".triton" / "cache"))
    before = built_kernels(cache)
    probes.mkdir(parents=True, exist_ok=True)
    for f in [*probes.glob("probe-*.json"), *probes.glob("specs-*.jsonl"),
              *probes.glob("tests-*.json"), *probes.glob("profile-*.prof")]:
        f.unlink()
    cmd = [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-p",
           "benchmarks.bench_loop", "-q", *pytest_args]
    t0, launched = time.perf_counter(), time.time()
    p = subprocess.Popen(cmd, cwd=ROOT, env={**env, PROBE_ENV: str(probes)},
                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                         start_new_session=True)
    try:
        output, _ = p.communicate(timeout=timeout)
        code = p.returncode
    except subprocess.TimeoutExpired:
        # SIGINT first: pytest stops its workers and still writes its reports (the gate's
        # last-run report of the tests it finished); SIGKILL if it does not end soon.
        os.killpg(p.pid, signal.SIGINT)
        try:
            output, _ = p.communicate(timeout=INTERRUPT_GRACE_S)
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, signal.SIGKILL)
            output, _ = p.communicate()
        code = 124
    wall = time.perf_counter() - t0
    ended = launched + wall
    totals = dict(tests=0, test_s=0.0, jit_s=0.0, jit_count=0, reference_s=0.0, ref_hits=0,
                  ref_memory_hits=0, ref_misses=0, ref_rejected=0)
    for f in probes.glob("probe-*.json"):
        for k, v in json.loads(f.read_text()).items():
            totals[k] += v
    totals["other_s"] = max(0.0, totals["test_s"] - totals["jit_s"] - totals["reference_s"])
    built = built_kernels(cache) - before
    lines = output.strip().splitlines()
    record = dict(wall_s=wall, exit_code=code, summary=(lines[-1:] or [""])[0],
                  output_tail="\n".join(lines[-LOG_LINES:]), built=len(built),
                  built_by_kernel=by_kernel(built), **totals, **where_time_went(probes),
                  **start_and_end(probes, launched, ended))
    profiles = sorted(probes.glob("profile-*.prof"))
    if profiles:
        record["profile"] = profile_summary(profiles)
    return record


def _file(nodeid: str) -> str:
    return nodeid.split("::")[0]


def where_time_went(probes: Path, top: int = SLOW_TOP) -> dict:
    """The run's tests by the processes that ran them (``busy_s``: each process's summed
    test seconds, the busiest first: the wall time is at least the busiest's), by file
    (tests, seconds, JIT seconds, compiles, and ``specs_alone``: distinct specialisations
    no other file's tests compiled, the builds a file costs a cold run on its own) and the
    ``top`` slowest tests."""
    busy, rows = [], []
    for tests in _process_tests(probes):
        busy.append(round(sum(t[1] for t in tests), 1))
        rows += tests
    files: dict[str, dict] = {}
    for nodeid, seconds, jit, compiles, _ in rows:
        entry = files.setdefault(_file(nodeid), dict(tests=0, s=0.0, jit_s=0.0, compiles=0))
        entry["tests"] += 1
        entry["s"] += seconds
        entry["jit_s"] += jit
        entry["compiles"] += compiles
    owners: dict[str, set[str]] = {}
    for digest, _, _, test in _compiles(probes):
        owners.setdefault(digest, set()).add(_file(test))
    for (owner,) in (o for o in owners.values() if len(o) == 1):
        if owner in files:
            files[owner]["specs_alone"] = files[owner].get("specs_alone", 0) + 1
    for entry in files.values():
        entry["s"], entry["jit_s"] = round(entry["s"], 1), round(entry["jit_s"], 1)
    slowest = sorted(rows, key=lambda t: -t[1])[:top]
    return dict(busy_s=sorted(busy, reverse=True),
                by_file=dict(sorted(files.items(), key=lambda kv: -kv[1]["s"])),
                slowest=[dict(test=t[0], s=round(t[1], 1), jit_s=round(t[2], 1))
                         for t in slowest])


def _process_tests(probes: Path):
    """Each process's tests as its probe noted them (``Probe.per_test``), those that ran
    any."""
    for f in probes.glob("tests-*.json"):
        tests = json.loads(f.read_text())
        if tests:
            yield tests


def start_and_end(probes: Path, launched: float, ended: float) -> dict:
    """Where a run's wall time is not its tests' (epoch seconds ``launched`` to ``ended``):
    ``start_s``, from the launch to the first test of any process (imports, collection,
    the workers' start), ``last_start_s`` to the first test of the last process to begin,
    and ``end_s``, from the end of the last test to the run's end (the reports, the gate,
    the workers' exit). Empty when no test ran."""
    spans = [(min(t[4] for t in tests), max(t[4] + t[1] for t in tests))
             for tests in _process_tests(probes)]
    if not spans:
        return {}
    firsts, lasts = zip(*spans)
    return dict(start_s=round(min(firsts) - launched, 1),
                last_start_s=round(max(firsts) - launched, 1),
                end_s=round(ended - max(lasts), 1))


def _area(file: str, name: str) -> str:
    """Which part of the stack a profiled function belongs to: the project's top-level
    packages by path, the libraries by name (their C functions have no file)."""
    for part in ("reference", "oracle", "kernels", "tests"):
        if f"{os.sep}{part}{os.sep}" in file and str(ROOT) in file:
            return part
    for lib in ("triton", "torch", "numpy", "ml_dtypes", "_pytest", "xdist"):
        if lib in file or lib in name:
            return lib.strip("_")
    return "python"


def profile_summary(files: list[Path], top: int = PROFILE_TOP) -> dict:
    """The profiled processes' tests together: own (not cumulative) seconds by area
    (``_area``) and the ``top`` functions by own seconds, with their calls and
    cumulative seconds."""
    stats = pstats.Stats(*map(str, files))
    areas: dict[str, float] = {}
    rows = []
    for (file, line, name), (_, calls, own, cum, _) in stats.stats.items():
        area = _area(file, name)
        areas[area] = areas.get(area, 0.0) + own
        where = os.path.relpath(file, ROOT) if file.startswith(str(ROOT)) else file
        rows.append(dict(function=f"{where}:{line}({name})", area=area, calls=calls,
                         own_s=round(own, 3), cum_s=round(cum, 3)))
    rows.sort(key=lambda r: -r["own_s"])
    return dict(own_s_by_area=dict(sorted(((k, round(v, 1)) for k, v in areas.items()),
                                          key=lambda kv: -kv[1])),
                top_own=rows[:top])


def compiled_specs(probes: Path) -> dict[str, dict]:
    """What the run's processes compiled (``Probe.on_compile``), one ``{kernel, fields}``
    per distinct (kernel, specialisation), keyed by the digest of both (``_fields``: what
    the compiled code depends on, leaving out whatever else Triton's in-memory key
    holds)."""
    return {digest: dict(kernel=kernel, fields=fields)
            for digest, kernel, fields, _ in _compiles(probes)}


def _compiles(probes: Path):
    """Every compile the run's processes noted: (digest of the kernel and its ``_fields``,
    kernel, fields, the test that compiled it)."""
    for f in probes.glob("specs-*.jsonl"):
        for line in f.read_text().splitlines():
            entry = json.loads(line)
            fields = _fields(entry)
            text = json.dumps([entry["kernel"], sorted(fields.items())])
            yield (hashlib.sha256(text.encode()).hexdigest()[:16], entry["kernel"], fields,
                   entry.get("test", ""))


def _fields(entry: dict) -> dict:
    """A compile's specialisation as flat fields: each constexpr, attribute and option by
    name, the signature, the source hash, the cache-invalidating environment."""
    spec = json.loads(entry["spec"])
    out = {"source": entry["source"], "signature": json.dumps(spec["signature"]),
           "env": json.dumps(entry.get("env", []))}
    for prefix, keys, vals in (("constexpr", "constant_keys", "constant_vals"),
                               ("attrs", "attrs_keys", "attrs_vals")):
        for k, v in zip(spec[keys], spec[vals]):
            out[f"{prefix} {k}"] = json.dumps(v)
    out.update({f"option {k}": json.dumps(v) for k, v in spec["options"].items()})
    return out


def _named(field: str, names: list[str]) -> str:
    """``attrs [3]`` / ``constexpr [3]`` (an argument's path) as ``attrs q_s0``: the
    argument's name; other fields as they are."""
    prefix, _, path = field.partition(" ")
    try:
        index = json.loads(path)
        while isinstance(index, list):
            index = index[0]
        return f"{prefix} {names[index]}"
    except (ValueError, IndexError, TypeError):
        return field


def spec_drivers(specs: dict[str, dict], kernels: int = DRIVER_KERNELS,
                 top: int = DRIVER_FIELDS) -> dict:
    """What multiplies the specialisations of the ``kernels`` kernels with the most: for
    each field (a constexpr, an argument's alignment or ==1 attribute, the signature's
    dtypes, an option) how many specialisations would stay distinct without it, the
    ``top`` fields that merge the most, and the same with every argument's attributes
    dropped at once (``attrs *``: what specialising on alignment costs)."""
    by_kernel: dict[str, list[dict]] = {}
    for spec in specs.values():
        by_kernel.setdefault(spec["kernel"], []).append(spec["fields"])
    out = {}
    for kernel, rows in sorted(by_kernel.items(), key=lambda kv: -len(kv[1]))[:kernels]:
        def distinct(keep, rows=rows) -> int:
            return len({tuple(sorted((k, v) for k, v in r.items() if keep(k))) for r in rows})
        names = list(json.loads(rows[0]["signature"]))
        varying = sorted({k for r in rows for k in r
                          if len({r2.get(k) for r2 in rows}) > 1})
        without = {_named(f, names): distinct(lambda k, f=f: k != f) for f in varying}
        without["attrs *"] = distinct(lambda k: not k.startswith("attrs "))
        ranked = sorted(without.items(), key=lambda kv: kv[1])[:top]
        out[kernel.rsplit(".", 1)[-1]] = dict(specs=len(rows), without=dict(ranked))
    return out


def new_specs(before: dict[str, dict], now: dict[str, dict], top: int = NEW_TOP) -> dict:
    """The compiles of ``now`` that ``before`` lacks (a warm run's specialisations the cold
    run never met): how many, and for up to ``top`` of them the fields in which they differ
    from the closest compile of the same kernel in ``before`` (none: the kernel was not
    compiled there)."""
    fresh = sorted(set(now) - set(before))
    old_by_kernel: dict[str, list[dict]] = {}
    for spec in before.values():
        old_by_kernel.setdefault(spec["kernel"], []).append(spec["fields"])
    examples = []
    for digest in fresh[:top]:
        kernel, fields = now[digest]["kernel"], now[digest]["fields"]
        diffs = [sorted(k for k in fields.keys() | old.keys() if fields.get(k) != old.get(k))
                 for old in old_by_kernel.get(kernel, [])]
        closest = min(diffs, key=len) if diffs else None
        examples.append(dict(kernel=kernel, differs_in=closest, fields={
            k: fields.get(k) for k in (closest or [])}))
    return dict(count=len(fresh), examples=examples)


RUNS = ("cold", "warm")
EDITED = "edited"  # not a default run: one kernel's compiles redone on the warm caches
EDIT_COMMENT = "# bench_loop: this kernel's source changed"


@contextlib.contextmanager
def kernel_edited(path: Path, function: str):
    """``path`` with a comment put at the end of the first statement of its function
    ``function``: that function's JIT cache key changes (Triton hashes its source text),
    and no line moves (the key holds the function's first line: an added line would change
    every function below it too); restored byte for byte, mtime included, on the way out."""
    text, stat = path.read_bytes(), path.stat()
    defs = _functions(text)
    if function not in defs:
        raise ValueError(f"--edit: no function {function!r} in {path}")
    lines = text.decode().splitlines(keepends=True)
    end = defs[function].body[0].end_lineno - 1
    body = lines[end].rstrip("\r\n")
    lines[end] = f"{body}  {EDIT_COMMENT}{lines[end][len(body):]}"
    path.write_bytes("".join(lines).encode())
    try:
        yield
    finally:
        path.write_bytes(text)
        os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns))


def measure(pytest_args: list[str], touch: Path, work: Path, timeout: float | None = None,
            environ=os.environ, total: float | None = None, runs=RUNS,
            reports: Path | None = None, edit: str | None = None) -> dict:
    """The cold run (empty caches under ``work``), then the warm one (``touch`` touched).
    ``total``: seconds for both together; the warm run gets what the cold one left.
    ``runs``: the runs to make (a warm run alone reuses the caches a cold one left in
    ``work``, e.g. where one call cannot hold both). ``reports``: where each run's gate
    report goes (``last-run-<run>.json``, e.g. the cold one to accept as a baseline),
    instead of both to ``out/last-run-<kind>.json``. ``edit``: the function of ``touch``
    the edited run changes."""
    env = dict(environ, TRITON_CACHE_DIR=str(work / "triton"),
               TORCHINDUCTOR_CACHE_DIR=str(work / "inductor"),
               ORACLE_REFERENCE_CACHE=str(work / "reference"),
               ORACLE_TEST_SECONDS=str(work / "test-seconds.json"))

    def args(name: str) -> list[str]:
        if reports is None:
            return pytest_args
        return [*pytest_args, "--last-run", str(reports / f"last-run-{name}.json")]

    def run(name: str, seconds: float | None) -> tuple[dict, dict]:
        """One run, its compiles kept beside the caches (for a warm run in a later call)."""
        record = run_pytest(args(name), env, work / "probes", seconds)
        specs = compiled_specs(work / "probes")
        (work / f"specs-{name}.json").write_text(json.dumps(specs))
        record["distinct_compiles"] = len(specs)
        record["spec_drivers"] = spec_drivers(specs)
        return record, specs

    done = {}
    if "cold" in runs:
        done["cold"], _ = run("cold", timeout)
    if "warm" in runs:
        os.utime(touch)
        spent = sum(r["wall_s"] for r in done.values())
        left = None if total is None else max(1.0, total - spent)
        warm_timeout = left if timeout is None else min(timeout, left or timeout)
        cold = work / "specs-cold.json"
        cold_specs = json.loads(cold.read_text()) if cold.is_file() else None
        done["warm"], specs = run("warm", warm_timeout)
        if cold_specs is not None:
            done["warm"]["new_specs"] = new_specs(cold_specs, specs)
    if EDITED in runs:
        with kernel_edited(touch, edit):
            done[EDITED], _ = run(EDITED, timeout)
    return dict(schema=SCHEMA, pytest_args=pytest_args, touched=_shown(touch),
                edited=edit if EDITED in runs else None, device=_device(), runs=done)


def _shown(path: Path) -> str:
    """``path`` as the report names it: from the repository's root when inside it."""
    return str(path.relative_to(ROOT) if path.is_relative_to(ROOT) else path)


def _functions(source: bytes) -> dict[str, ast.FunctionDef]:
    """The functions a module's source defines, by name (the first of a name)."""
    found: dict[str, ast.FunctionDef] = {}
    for n in ast.walk(ast.parse(source)):
        if isinstance(n, ast.FunctionDef):
            found.setdefault(n.name, n)
    return found


def _device() -> str:
    try:
        import torch

        if torch.cuda.is_available():
            return f"{torch.cuda.get_device_name(0)} x{torch.cuda.device_count()}"
    except ImportError:
        pass
    return f"CPU ({os.cpu_count()} cores, Triton interpreter)"


def _share(part: float, whole: float) -> str:
    return f"{100 * part / whole:.0f}%" if whole > 0 else "-"


def markdown(doc: dict) -> str:
    """The report as a Markdown table (shares of the tests' summed seconds)."""
    lines = [f"# The `pytest {shlex.join(doc['pytest_args'])}` loop on {doc['device']}", "",
             f"Warm: both caches from the cold run, `{doc['touched']}` touched."
             + (f" Edited: the same caches, `{doc['edited']}` in it changed (its compiles "
                f"redone)." if doc.get("edited") else ""), "",
             "| run | wall (s) | tests | test time (s) | JIT | reference | kernels and the "
             "rest | compiles (built) | reference hits (from memory) / misses / rejected | "
             "exit |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for name, r in doc["runs"].items():
        t = r["test_s"]
        lines.append(
            f"| {name} | {r['wall_s']:.1f} | {r['tests']} | {t:.1f} | {_share(r['jit_s'], t)} "
            f"| {_share(r['reference_s'], t)} | {_share(r['other_s'], t)} | {r['jit_count']} "
            f"({r.get('built', '-')}) | {r['ref_hits']} ({r.get('ref_memory_hits', '-')}) / "
            f"{r['ref_misses']} / {r['ref_rejected']} | {r['exit_code']} |")
    for name, r in doc["runs"].items():
        if r.get("built_by_kernel"):
            top = ", ".join(f"{k} {n}" for k, n in r["built_by_kernel"].items())
            lines += ["", f"Built in the {name} run, by kernel: {top}."]
    shown = []  # a later run whose compiles are those of an earlier one repeats nothing
    for name, r in doc["runs"].items():
        if r.get("spec_drivers") in shown:
            continue
        shown.append(r.get("spec_drivers"))
        for kernel, d in (r.get("spec_drivers") or {}).items():
            merged = ", ".join(f"{k} {n}" for k, n in d["without"].items())
            lines += ["", f"{name}: `{kernel}` compiled {d['specs']} specialisations; "
                          f"distinct without one field: {merged}."]
    for name, r in doc["runs"].items():
        if r.get("busy_s"):
            busy = r["busy_s"]
            files = ", ".join(f"{k} {v['s']:,.0f} s" for k, v in
                              list(r["by_file"].items())[:5])
            lines += ["", f"The {name} run's {len(busy)} processes: the busiest ran its "
                          f"tests for {busy[0]:,.0f} s, the idlest {busy[-1]:,.0f} s; the "
                          f"files with the most seconds: {files}."]
            if "start_s" in r:
                lines[-1] += (f" Its first test started {r['start_s']:.1f} s after the "
                              f"launch (the last process's first {r['last_start_s']:.1f} s), "
                              f"and the run ended {r['end_s']:.1f} s after its last test.")
    for name, r in doc["runs"].items():
        if r.get("profile"):
            areas = ", ".join(f"{k} {v:,.0f} s" for k, v in r["profile"]["own_s_by_area"].items())
            lines += ["", f"Profiled {name} run, own seconds by area: {areas}."]
    fresh = doc["runs"].get("warm", {}).get("new_specs")
    if fresh and not fresh["count"]:
        lines += ["", "The warm run compiled no specialisation the cold run did not."]
    elif fresh:
        lines += ["", f"The warm run compiled {fresh['count']} specialisations the cold run "
                      "did not; how some differ from the closest cold one of their kernel:",
                  ""]
        for e in fresh["examples"]:
            what = ("no cold compile of this kernel" if e["differs_in"] is None else
                    "; ".join(f"{k} = {v}" for k, v in e["fields"].items()) or "nothing")
            lines.append(f"- `{e['kernel']}`: {what}")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True, type=Path, help="directory for loop.json / loop.md")
    ap.add_argument("--pytest-args", default="-m gpu",
                    help="pytest's arguments, one shell-quoted string (default: -m gpu)")
    ap.add_argument("--touch", default="kernels/indexer_decode.py",
                    help="the kernel file whose mtime the warm run follows")
    ap.add_argument("--timeout", type=float,
                    help="seconds per run; a run stopped there reports exit 124 and the "
                         "tests it finished")
    ap.add_argument("--total", type=float,
                    help="seconds for both runs together: the warm run gets what is left")
    ap.add_argument("--work", type=Path,
                    help="where the caches live (default: a fresh temporary directory)")
    ap.add_argument("--profile", action="store_true",
                    help="profile every process's tests (cProfile, slower): the runs' own "
                         "seconds by area and their top functions go into loop.json")
    ap.add_argument("--edit", default="_indexer_decode_kernel",
                    help="the @triton.jit function of the --touch file the edited run changes")
    ap.add_argument("--runs", nargs="+", choices=(*RUNS, EDITED), default=list(RUNS),
                    help="which runs to make (default: cold and warm; warm or edited "
                         "without cold needs --work holding a cold run's caches)")
    a = ap.parse_args(argv)
    touch = ROOT / a.touch
    if not touch.is_file():
        ap.error(f"--touch must name a file of the repository, got {a.touch!r}")
    if EDITED in a.runs and a.edit not in _functions(touch.read_bytes()):
        ap.error(f"--edit must name a function of {a.touch}, got {a.edit!r}")
    with tempfile.TemporaryDirectory(prefix="bench-loop-") as tmp:
        work = a.work or Path(tmp)
        cached = [p.exists() for p in (work / "triton", work / "reference")]
        if "cold" in a.runs and any(cached):
            ap.error(f"--work must not hold a cache yet (the cold run needs empty ones): {work}")
        if "cold" not in a.runs and not any(cached):
            ap.error(f"--runs {' '.join(a.runs)} without cold needs --work holding a cold "
                     f"run's caches: {work}")
        a.out.mkdir(parents=True, exist_ok=True)
        environ = {**os.environ, PROFILE_ENV: "1"} if a.profile else os.environ
        doc = measure(shlex.split(a.pytest_args), touch, work, a.timeout, environ=environ,
                      total=a.total, runs=a.runs, reports=a.out, edit=a.edit)
    (a.out / "loop.json").write_text(json.dumps(doc, indent=1) + "\n")
    (a.out / "loop.md").write_text(markdown(doc))
    print(markdown(doc))
    return max(r["exit_code"] for r in doc["runs"].values())


if __name__ == "__main__":
    sys.exit(main())
