"""The GPU driver behind ``.ci/gpu``: the test, sanitizer, fuzz and benchmark runs of a GPU
machine, each a *stage* whose output goes to ``$OUT/<stage>.log``.

``.ci/gpu MODE...`` runs the modes in a fixed order (see ``--help``); at the end the stages'
logs are joined into ``$OUT/gpu.log``, a summary (pass/fail counts, failed tests, the
benchmark tables) is printed, Triton's cache is packed into ``$OUT/triton-cache.tgz`` (unless
``TAR_CACHE=0`` or it exceeds 16 MB; carry it back in as ``.triton-cache.tgz`` to skip the
JIT next time), and the exit status is 1 when any stage failed. Each mode reads its knobs
from environment variables, listed in ``--help``; ``--dry-run`` prints the stages instead
of running them. Every command runs through ``.ci/env python`` (the installed stack on a
GPU machine).
"""

from __future__ import annotations

import argparse
import os
import re
import shlex
import signal
import subprocess
import sys
import tarfile
import textwrap
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PY = [str(ROOT / ".ci" / "env"), "python"]
PYTEST = [*PY, "-m", "pytest", "-p", "no:cacheprovider"]
#: One BLAS thread per worker: the float64 reference runs in every worker at once.
ONE_THREAD = {"OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
DIFF_K = "(norm_rope_insert or reshape_and_cache) and (triton or cuda)"
SCALE_K = "indexer_decode and triton and (tiny or small)"
BENCHES = "insert indexer attention_decode attention_prefill"
TIMELINE_SPECS = "indexer bf16 ;indexer e4m3 ;attention_decode bf16 ;attention_decode e4m3fn "
PROFILE_SPECS = "insert:triton e4m3 ;attention_decode e4m3fn "
#: Representative subsets under compute-sanitizer: guarded slots and positions, every
#: format, no tokens, odd R/2; the sparse kernels' -1 entries, padded rows, out-of-range
#: pages and blocks, the prefill's listed passes and predecoded pages.
MEMCHECK_K = ("guarded or no_tokens or any_even or out_of_range or every_format or misaligned"
              " or persist_variant or split_variant")
MEMCHECK_SPARSE_K = ("selection_is_a_set or padded or out_of_range or bad_block_table or "
                     "bad_pages or no_rows or no_tokens or inconsistent_lengths or more_splits"
                     " or nonfinite or either_tier_alone or predecoded_pages")
RACECHECK_K = "cuda_any_even or cuda_guards or variants_guard"
SANITIZER = ["compute-sanitizer", "--error-exitcode", "9", "--print-limit", "20"]
CACHE_LIMIT = 16_000_000  # bytes: the largest file a device call brings back

MODES = {  # in the order they run
    "tests": "the GPU suites in parallel processes: the differential stage (as `diff`), "
             "every other gpu/interp test (KERNEL_TESTS overrides the paths; KERNEL_WORKERS, "
             "default 4) and the sanitizer stages (as `sanitize`)",
    "all": "tests, then bench",
    "diff": "the differential stage alone: tests/test_differential.py -m 'gpu or interp' on "
            "DIFF_WORKERS xdist workers (default 12, --dist loadgroup); TESTS_K narrows it "
            "(a pytest -k expression)",
    "suite": "the whole `pytest -m gpu` as a user runs it, in one xdist session of "
             "SUITE_WORKERS (default 16, --dist loadgroup), to suite.json (--suite-report) "
             "and suite.xml; SUITE_PART=diff / rest: only tests/test_differential.py / all "
             "but it; SUITE_PART=both: the two parts one after the other (the rest gets what "
             "is left of SUITE_CALL_S, default 585 s), joined by `oracle suite-merge`",
    "sanitize": "compute-sanitizer memcheck on subsets of the insert and sparse kernels' "
                "tests, racecheck on csrc/'s",
    "tune": "benchmarks.tune_insert with TUNE_ARGS, to tune.json",
    "fuzz": "python -m oracle fuzz on the CUDA implementations, small shapes: FUZZ_SECONDS "
            "(120), FUZZ_WORKERS (14), FUZZ_WARMUP, FUZZ_CONFIGS, FUZZ_PIN_FORMATS=1, "
            "FUZZ_SALT; to fuzz.json",
    "scaleout": "one worker per GPU: the same subset of tests/test_differential.py (SCALE_K) "
                "with 1 worker on 1 GPU, 2 on GPU 0 and 2 on 2 GPUs, after an untimed "
                "pass that fills Triton's cache; to scaleout-W-G.json (join them with "
                "`python -m oracle scaleout`)",
    "mutants": "python -m oracle mutants (MUTANT_ARGS added), to mutants.json",
    "falsealarm": "python -m oracle falsealarm --cases FA_CASES (2000) in FUZZ_WORKERS "
                  "processes; FA_SECONDS, FA_OPS, FA_CONFIGS; to false-alarms.json",
    "bench": "the benchmarks one after the other (timing needs a quiet GPU): BENCHES "
             f"(default '{BENCHES}'), BENCH_ARGS_<name> adds arguments to one; to "
             "bench.json (insert) and bench_<name>.json",
    "ab": "benchmarks.ab run: AB_BENCH with AB_ARGS on the base tree (.ab-base/, from "
          "`python -m benchmarks.ab prepare REV`, carried in) and on the working tree, "
          "AB_ROUNDS times (1); AB_ALSO='NAME=.ab-NAME ...' adds candidates; to ab.json",
    "loop": "benchmarks.bench_loop, to loop.json: LOOP_RUNS cold, warm, both (default) or "
            "edited (one kernel's source changed); warm or edited in a later call on the "
            "same machine reuses the cold call's caches",
    "timeline": "per-program timelines of TIMELINE_CALLS (3) traced model-shape launches per "
                "TIMELINE_SPECS entry ('bench cache knobs;...'), to timeline.log",
    "profile": "Nsight Compute on one model-shape launch per PROFILE_SPECS entry "
               "('bench[:impl] cache knobs;...'), to profile.log",
}
SUITE_PARTS = ("", "diff", "rest", "both")


@dataclass
class Stage:
    """One command whose output goes to ``$OUT/<name>.log``, ended after ``limit`` seconds
    (exit status 124, as ``timeout`` gives)."""

    name: str
    argv: list[str]
    env: dict[str, str] = field(default_factory=dict)
    limit: float = 480.0
    retry_crash: bool = False  # a sanitizer that died of SIGSEGV before reporting runs again


def run_stage(stage: Stage, out: Path) -> int:
    """Run ``stage`` into its log and append ``<name> rc=<status>`` to it.

    compute-sanitizer itself can crash at start beside other stages; its findings exit
    with 9 and a crash of the code under test recurs, so one retry hides nothing."""
    log = out / f"{stage.name}.log"
    with log.open("w") as f:
        rc = _run_logged(stage, f)
        if rc in (139, -11) and stage.retry_crash:
            f.write(f"{stage.name} rc={rc} (crashed): running it again\n")
            f.flush()
            rc = _run_logged(stage, f)
        f.write(f"{stage.name} rc={rc}\n")
    return rc


def _run_logged(stage: Stage, f) -> int:
    """The stage's command with stdout and stderr to ``f``; 124 when it ran out of time,
    128 + N when signal N ended it (as a shell reports it). Each stage is a process group
    of its own, so its workers end with it."""
    proc = subprocess.Popen(stage.argv, stdout=f, stderr=subprocess.STDOUT, cwd=ROOT,
                            env={**os.environ, **stage.env}, start_new_session=True)
    LIVE.add(proc)
    try:
        rc = proc.wait(timeout=max(stage.limit, 1))
    except subprocess.TimeoutExpired:
        _end_group(proc)
        rc = 124
    finally:
        LIVE.discard(proc)
    return 128 - rc if rc < 0 else rc


LIVE: set[subprocess.Popen] = set()  # the stages running now, ended with the driver


def _end_group(proc: subprocess.Popen) -> None:
    """SIGTERM to the stage's process group, SIGKILL 10 s later if it is still there."""
    for sig, wait in ((signal.SIGTERM, 10), (signal.SIGKILL, None)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=wait)
            return
        except subprocess.TimeoutExpired:
            pass


def _on_terminate(signum, _frame) -> None:
    """The driver stopped (a time limit, Ctrl-C): its stages stop too."""
    for proc in list(LIVE):
        _end_group(proc)
    sys.exit(128 + signum)


class Runner:
    """Starts stages (in the background or not), waits for them, remembers their logs."""

    def __init__(self, out: Path, limit: float, dry_run: bool):
        self.out, self.limit, self.dry_run = out, limit, dry_run
        self.logs: list[str] = []
        self.rcs: dict[str, int] = {}
        self._threads: list[threading.Thread] = []

    def start(self, stage: Stage, log_name: str | None = None) -> None:
        """Run ``stage`` in the background; its log joins gpu.log under ``log_name``."""
        self.logs.append(log_name or stage.name)
        if self.dry_run:
            env = " ".join(f"{k}={v}" for k, v in stage.env.items())
            print(f"[{stage.name}, {stage.limit:.0f} s] {env + ' ' if env else ''}"
                  f"{shlex.join(stage.argv)}")
            return
        t = threading.Thread(target=self._record, args=(stage,))
        t.start()
        self._threads.append(t)

    def run(self, stage: Stage) -> None:
        """Run ``stage`` and wait for it (and for any stage still running)."""
        self.start(stage)
        self.wait()

    def wait(self) -> None:
        for t in self._threads:
            t.join()
        self._threads.clear()

    def _record(self, stage: Stage) -> None:
        self.rcs[stage.name] = run_stage(stage, self.out)

    def stage(self, name: str, argv: list[str], env: dict[str, str] | None = None,
              **kw) -> Stage:
        return Stage(name, argv, env or {}, kw.pop("limit", self.limit), **kw)


def env_str(name: str, default: str = "") -> str:
    return os.environ.get(name, default)


def opt(flag: str, var: str) -> list[str]:
    """``[flag, $var]`` when the environment variable is set and non-empty, else []."""
    return [flag, os.environ[var]] if os.environ.get(var) else []


def xdist(workers_var: str, default: str, dry_run: bool, dist: str = "loadgroup") -> list[str]:
    """pytest-xdist's arguments where it is installed (assumed so in a dry run)."""
    if not dry_run and subprocess.run([*PY, "-c", "import xdist"], cwd=ROOT,
                                      capture_output=True).returncode != 0:
        return []
    return ["-n", env_str(workers_var, default), *(["--dist", dist] if dist else [])]


def diff_stage(r: Runner) -> Stage:
    """The differential stage; -v so each finished test's id reaches the log even when the
    stage times out, loadgroup so a case's implementations share its inputs in one worker."""
    return r.stage("gpu-diff", [
        *PYTEST, "-v", "-rfE", "--tb=line", *xdist("DIFF_WORKERS", "12", r.dry_run),
        "-m", "gpu or interp", "tests/test_differential.py", "-k", env_str("TESTS_K", DIFF_K),
        f"--junitxml={r.out}/gpu-diff.xml"], ONE_THREAD)


def kernel_tests_stage(r: Runner) -> Stage:
    """Every gpu / interp test outside the differential stage (kernels, custom ops, csrc,
    the codec on the GPU, flex, the benchmarks' small runs); the sm_90 compile check is
    for GPU-less machines."""
    paths = shlex.split(env_str("KERNEL_TESTS", "tests --ignore=tests/test_differential.py "
                                "--ignore=tests/test_compile_sm90.py"))
    return r.stage("gpu-kernels", [
        *PYTEST, "-q", *xdist("KERNEL_WORKERS", "4", r.dry_run, dist=""),
        "-m", "gpu or interp", *paths, f"--junitxml={r.out}/gpu-kernels.xml"])


def sanitizer_stages(r: Runner) -> list[Stage]:
    memcheck = [*SANITIZER[:1], "--tool", "memcheck", *SANITIZER[1:], *PYTEST, "-q"]
    return [
        r.stage("memcheck", [*memcheck, "-m", "gpu or interp",
                             "tests/test_kernel_norm_rope_insert.py",
                             "tests/test_kernel_reshape_and_cache.py", "tests/test_csrc.py",
                             "-k", MEMCHECK_K], retry_crash=True),
        r.stage("memcheck-sparse", [*memcheck, "-m", "gpu or interp",
                                    "tests/test_kernel_indexer.py",
                                    "tests/test_kernel_attention_decode.py",
                                    "tests/test_kernel_attention_prefill.py",
                                    "-k", MEMCHECK_SPARSE_K], retry_crash=True),
        r.stage("racecheck", [*SANITIZER[:1], "--tool", "racecheck", *SANITIZER[1:],
                              *PYTEST, "-q", "-m", "gpu", "tests/test_csrc.py",
                              "-k", RACECHECK_K], retry_crash=True),
    ]


def suite_part(r: Runner, name: str, paths: list[str], xd: list[str],
               limit: float | None = None) -> None:
    """One part of ``pytest -m gpu`` with its suite report and junit XML."""
    r.run(r.stage(name, [*PYTEST, "-q", "-rfE", "--tb=line", *xd, "-m", "gpu", *paths,
                         "--suite-report", f"{r.out}/{name}.json",
                         f"--junitxml={r.out}/{name}.xml"], ONE_THREAD,
                  limit=limit if limit is not None else r.limit))


def run_suite(r: Runner) -> None:
    xd = xdist("SUITE_WORKERS", "16", r.dry_run)
    rest = ["tests", "--ignore=tests/test_differential.py"]
    part = env_str("SUITE_PART")
    if part == "":
        suite_part(r, "suite", ["tests"], xd)
    elif part == "diff":
        suite_part(r, "suite", ["tests/test_differential.py"], xd)
    elif part == "rest":
        suite_part(r, "suite", rest, xd)
    else:
        t0 = time.monotonic()
        suite_part(r, "suite-diff", ["tests/test_differential.py"], xd)
        r.limit = float(env_str("SUITE_CALL_S", "585")) - (time.monotonic() - t0)
        suite_part(r, "suite-rest", rest, xd)
        r.run(r.stage("suite-merge", [*PY, "-m", "oracle", "suite-merge",
                                      f"{r.out}/suite-diff.json", f"{r.out}/suite-rest.json",
                                      "--out", f"{r.out}/suite.json"]))


def run_fuzz(r: Runner) -> None:
    """The device is CUDA wherever torch sees it; failures are not shrunk (time)."""
    r.run(r.stage("fuzz", [
        *PY, "-m", "oracle", "fuzz", "--seconds", env_str("FUZZ_SECONDS", "120"),
        "--workers", env_str("FUZZ_WORKERS", "14"), "--shape-classes", "small", "--no-shrink",
        "--report", f"{r.out}/fuzz.json", *opt("--warmup", "FUZZ_WARMUP"),
        *opt("--configs", "FUZZ_CONFIGS"),
        *(["--pin-formats"] if env_str("FUZZ_PIN_FORMATS") else []),
        *opt("--config-salt", "FUZZ_SALT")], ONE_THREAD))


def run_scaleout(r: Runner) -> None:
    """An untimed first pass on both GPUs fills Triton's disk cache, so the timed runs
    time the sharding, not the JIT."""
    k = env_str("SCALE_K", SCALE_K)
    diff = ["tests/test_differential.py", "-k", k]
    r.run(r.stage("scaleout-warm", [*PYTEST, "-q", "-m", "gpu", "-n", "2", "--dist",
                                    "loadgroup", *diff], {**ONE_THREAD, "ORACLE_GPUS": "2"}))
    for workers, gpus in (("1", "1"), ("2", "1"), ("2", "2")):
        name = f"scaleout-{workers}-{gpus}"
        pin = {"CUDA_VISIBLE_DEVICES": "0"} if gpus == "1" else {}
        r.run(r.stage(name, [*PYTEST, "-q", "-m", "gpu", "-n", workers, "--dist", "loadgroup",
                             *diff, "--suite-report", f"{r.out}/{name}.json"],
                      {**pin, **ONE_THREAD, "ORACLE_GPUS": gpus}))


def run_reports(r: Runner, modes: list[str]) -> None:
    """mutants and falsealarm; their Markdown is rendered again on the CPU from the JSON."""
    if "mutants" in modes:
        r.run(r.stage("mutants", [*PY, "-m", "oracle", "mutants",
                                  *shlex.split(env_str("MUTANT_ARGS")),
                                  "--out", f"{r.out}/mutants.json"], ONE_THREAD))
        _remove(r, "mutants.md")
    if "falsealarm" in modes:
        r.run(r.stage("falsealarm", [
            *PY, "-m", "oracle", "falsealarm", "--cases", env_str("FA_CASES", "2000"),
            "--workers", env_str("FUZZ_WORKERS", "14"), *opt("--seconds", "FA_SECONDS"),
            *opt("--ops", "FA_OPS"), *opt("--configs", "FA_CONFIGS"),
            "--out", f"{r.out}/false-alarms.json"], ONE_THREAD))
        _remove(r, "false-alarms.md")


def run_bench(r: Runner) -> None:
    """Each benchmark alone; the Markdown is rendered on the CPU (render_bench.py)."""
    for b in env_str("BENCHES", BENCHES).split():
        json_name = "bench.json" if b == "insert" else f"bench_{b}.json"
        r.run(r.stage(f"bench-{b}", [*PY, "-m", f"benchmarks.bench_{b}", "--out",
                                     f"{r.out}/{json_name}",
                                     *shlex.split(env_str(f"BENCH_ARGS_{b}"))]))
        _remove(r, json_name.replace(".json", ".md"))


LOOP_RUNS = {"": ["cold", "warm"], "both": ["cold", "warm"], "cold": ["cold"],
             "warm": ["warm"], "edited": ["edited"]}
LOOP_WORK = "out/loopwork"  # the caches a warm loop run in a later call reuses
LOOP_MARGIN_S = 60  # for bench_loop to stop its run and write loop.json inside the stage


def run_loop(r: Runner) -> None:
    """benchmarks.bench_loop over LOOP_RUNS, its caches in LOOP_WORK, both runs bounded so
    that its report is written before the stage's limit."""
    runs = LOOP_RUNS[env_str("LOOP_RUNS")]
    total = max(1.0, r.limit - LOOP_MARGIN_S)
    r.run(r.stage("loop", [*PY, "-m", "benchmarks.bench_loop", "--out", str(r.out),
                           "--work", LOOP_WORK, "--runs", *runs, "--total", f"{total:g}"]))


def run_ab(r: Runner) -> None:
    also = [a for name in env_str("AB_ALSO").split() for a in ("--also", name)]
    r.run(r.stage("ab", [*PY, "-m", "benchmarks.ab", "run", "--bench", env_str("AB_BENCH"),
                         "--rounds", env_str("AB_ROUNDS", "1"), "--out", str(r.out), *also,
                         "--", *shlex.split(env_str("AB_ARGS"))]))


def spec_list(var: str, default: str) -> list[tuple[str, str, str]]:
    """'bench cache knobs;...' as (bench, cache, knobs) triples."""
    out = []
    for spec in env_str(var, default).split(";"):
        words = spec.split(None, 2)
        if words:
            out.append((words[0], words[1] if len(words) > 1 else "",
                        words[2] if len(words) > 2 else ""))
    return out


def run_timeline(r: Runner) -> None:
    runs = [(f"{bench} {cache} {knobs}",
             [*PY, "-m", "benchmarks.profile_launch", "--bench", bench, "--cache", cache,
              "--knobs", knobs, "--timeline", env_str("TIMELINE_CALLS", "3")])
            for bench, cache, knobs in spec_list("TIMELINE_SPECS", TIMELINE_SPECS)]
    _run_sequence(r, "timeline", runs)


def run_profile(r: Runner) -> None:
    """The first call's launches are skipped (compile, warm-up); the prefill launches its
    kernel twice per call (the main pass, then the repair pass)."""
    runs = []
    for target, cache, knobs in spec_list("PROFILE_SPECS", PROFILE_SPECS):
        bench, _, impl = target.partition(":")
        skip = "2" if bench == "attention_prefill" else "1"
        runs.append((f"{target} {cache} {knobs}", [
            "ncu", "--clock-control", "none", "--launch-skip", skip, "--launch-count", "1",
            "--kernel-name", "regex:norm_rope|nri|indexer|decode_split|prefill",
            "--section", "SpeedOfLight", "--section", "MemoryWorkloadAnalysis",
            "--section", "Occupancy", "--section", "LaunchStats", "--section", "WarpStateStats",
            "--section", "SchedulerStats",
            "--metrics", "dram__bytes_read.sum,dram__bytes_write.sum",
            *PY, "-m", "benchmarks.profile_launch", "--bench", bench, "--impl", impl or "triton",
            "--cache", cache, "--knobs", knobs]))
    _run_sequence(r, "profile", runs)


def _run_sequence(r: Runner, name: str, runs: list[tuple[str, list[str]]]) -> None:
    """Commands one after the other into one log, each headed by ``##### <spec>`` and
    given the stage limit of its own."""
    script = "; ".join(f"echo {shlex.quote('##### ' + head)}; timeout {int(r.limit)} "
                       f"{shlex.join(argv)}" for head, argv in runs)
    r.run(r.stage(name, ["bash", "-c", script], limit=r.limit * max(len(runs), 1)))


def _remove(r: Runner, name: str) -> None:
    if not r.dry_run:
        (r.out / name).unlink(missing_ok=True)


def run_modes(r: Runner, modes: list[str]) -> None:
    """The modes in their fixed order; the test stages run side by side."""
    tests = "tests" in modes
    if tests or "diff" in modes:
        r.start(diff_stage(r))
    if "suite" in modes:
        run_suite(r)
    if tests:
        r.start(kernel_tests_stage(r))
    if tests or "sanitize" in modes:
        for stage in sanitizer_stages(r):
            r.start(stage)
    r.wait()
    if "tune" in modes:
        r.run(r.stage("tune", [*PY, "-m", "benchmarks.tune_insert",
                               *shlex.split(env_str("TUNE_ARGS")), "--out", f"{r.out}/tune.json"]))
    if "fuzz" in modes:
        run_fuzz(r)
    if "scaleout" in modes:
        run_scaleout(r)
    run_reports(r, modes)
    if "bench" in modes:
        run_bench(r)
    if "ab" in modes:
        run_ab(r)
    if "loop" in modes:
        run_loop(r)
    if "timeline" in modes:
        run_timeline(r)
    if "profile" in modes:
        run_profile(r)


SUMMARY_GREPS = {  # log kind -> (pattern of the lines shown, how many of the last)
    "bench": (r"^\|", 30), "ab": (r"^\|", 30), "loop": (r"^\|", 30),
    "timeline": (r"^(#####|\||[0-9]+ programs|SM busy|end-time)", 60),
    "tune": (r" us |^best", 40),
}


def summarize(out: Path, logs: list[str]) -> bool:
    """Join the logs into gpu.log (one file back instead of one per stage), print each
    stage's outcome, the failed tests and the tables; True when every stage passed."""
    texts = {name: _read(out / f"{name}.log") for name in logs}
    joined = "".join(f"=== {name}\n{text}" for name, text in texts.items())
    (out / "gpu.log").write_text(joined)
    outcome = re.compile(r"passed|failed|ERROR SUMMARY| rc=")
    for name, text in texts.items():
        print(f"== {name}")
        _print_lines([ln for ln in text.splitlines() if outcome.search(ln)][-3:])
        (out / f"{name}.log").unlink(missing_ok=True)
    lines = joined.splitlines()
    failed = [ln[:300] for ln in lines if re.search(r"^(FAILED|ERROR) |\] (FAILED|ERROR) ", ln)]
    _print_lines(failed[:40])
    shown = set()
    for name in logs:
        kind = name.split("-")[0]
        if kind in SUMMARY_GREPS and kind not in shown:
            shown.add(kind)
            pattern, last = SUMMARY_GREPS[kind]
            _print_lines([ln[:160] for ln in lines if re.search(pattern, ln)][-last:])
    return not re.search(r" rc=[1-9]", joined)


def _print_lines(lines: list[str]) -> None:
    if lines:
        print("\n".join(lines))


def _read(path: Path) -> str:
    return path.read_text(errors="replace") if path.exists() else ""


def pack_triton_cache(out: Path) -> None:
    """Triton's JIT cache to $OUT/triton-cache.tgz (xz packs it about twice as tightly as
    gzip), dropped when too large to come back."""
    home, dest = Path.home() / ".triton", out / "triton-cache.tgz"
    if not (home / "cache").is_dir():
        return
    xz = subprocess.run(["tar", "cJf", str(dest), "-C", str(home), "cache"],
                        env={**os.environ, "XZ_OPT": "-T0"}, capture_output=True)
    if xz.returncode != 0:
        subprocess.run(["tar", "czf", str(dest), "-C", str(home), "cache"], capture_output=True)
    if dest.exists() and dest.stat().st_size >= CACHE_LIMIT:
        dest.unlink()


def unpack_triton_cache() -> None:
    """A cache carried in as .triton-cache.tgz (gzip or xz) skips the JIT."""
    src, home = ROOT / ".triton-cache.tgz", Path.home() / ".triton"
    home.mkdir(exist_ok=True)
    if src.exists():
        with tarfile.open(src) as tar:  # compression detected: gzip or xz
            tar.extractall(home)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    width = max(map(len, MODES)) + 4
    wrap = textwrap.TextWrapper(width=92, subsequent_indent=" " * width)
    epilog = "modes (several in one call run in this order):\n" + "\n".join(
        wrap.fill(f"  {name:<{width - 2}}{text}") for name, text in MODES.items())
    epilog += "\n\n" + textwrap.fill(
        "every mode: OUT (where reports and logs go, default reports/gpu-out), STAGE_LIMIT_S "
        "(seconds per stage, default 480), TAR_CACHE=0 (no Triton cache back)", 92)
    p = argparse.ArgumentParser(prog=".ci/gpu", description="Run the project's GPU stages.",
                                epilog=epilog, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("modes", nargs="*", default=["tests"], metavar="MODE",
                   help="what to run (default: tests)")
    p.add_argument("--dry-run", action="store_true", help="print the stages, run nothing")
    return p.parse_args(argv)


def check_args(modes: list[str]) -> str | None:
    """The one-line error for a bad request, before any work; None when it is good."""
    unknown = [m for m in modes if m not in MODES]
    if unknown:
        return f"unknown mode {unknown[0]!r}: MODE must be one of {', '.join(MODES)}"
    if "suite" in modes and env_str("SUITE_PART") not in SUITE_PARTS:
        return f"SUITE_PART must be diff, rest, both or unset, got {env_str('SUITE_PART')!r}"
    if "loop" in modes and env_str("LOOP_RUNS") not in LOOP_RUNS:
        return f"LOOP_RUNS must be cold, warm, both, edited or unset, got {env_str('LOOP_RUNS')!r}"
    if "ab" in modes and not env_str("AB_BENCH"):
        return "AB_BENCH must name the benchmark for mode ab (insert, indexer, ...)"
    return None


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    error = check_args(args.modes)
    if error:
        print(f".ci/gpu: {error}", file=sys.stderr)
        return 2
    modes = list(args.modes) + (["tests", "bench"] if "all" in args.modes else [])
    out = Path(os.environ.get("OUT", ROOT / "reports" / "gpu-out"))
    r = Runner(out, float(env_str("STAGE_LIMIT_S", "480")), args.dry_run)
    if not args.dry_run:
        out.mkdir(parents=True, exist_ok=True)
        unpack_triton_cache()
        signal.signal(signal.SIGTERM, _on_terminate)
        signal.signal(signal.SIGINT, _on_terminate)
    run_modes(r, modes)
    if args.dry_run:
        return 0
    ok = summarize(out, r.logs)
    if env_str("TAR_CACHE", "1") != "0":
        pack_triton_cache(out)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
