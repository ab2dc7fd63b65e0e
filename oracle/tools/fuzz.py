"""Hypothesis-driven fuzzing over cases: draw (op, shape class, distribution, platform,
cache dtype, model dtype, scales, seed), run every implementation that claims the case,
and on a failure let hypothesis shrink it (toward simpler fields and smaller seeds).
Each shrunk failure is written as ``OUT/<case id>.txt`` holding the replay command.

The time budget is met by running hypothesis in rounds of a few examples until the budget
is spent; a failure ends the search. Each case reports its worst error over bound to
``hypothesis.target`` (label ``err/bound``), so the search climbs toward cases that come
close to failing. Failing examples are kept in a persistent example database
(``DEFAULT_DB``, ``--db``; None: none) and replayed first by the next run, before it
draws new ones.

Each worker records when every case finished (``time.monotonic`` since its search began,
``run_stats``), which op and shape class it had, and how many checks each implementation
ran; ``report`` merges the workers' records into one ``fuzz/1`` document whose throughput
counts the cases finished after a warm-up (JIT compiles, first CUDA calls) separately.
"""

from __future__ import annotations

import itertools
import json
import time
from collections import Counter
from pathlib import Path

from hypothesis import HealthCheck, Phase, given, settings, target
from hypothesis import strategies as st
from hypothesis.database import DirectoryBasedExampleDatabase

from oracle.core.cases import DISTRIBUTIONS, OPS, SCALES, Case, config_formats
from oracle.core.checks import check_claimants
from oracle.impls.catalog import load_all
from reference.platforms import KV_CACHE_DTYPES, MODEL_DTYPES, PLATFORMS


def _valid(fields) -> Case | None:
    try:
        return Case(**fields)
    except ValueError:
        return None


def case_strategy(ops=OPS, shape_classes=("tiny", "small"), configs=None,
                  pin_formats: bool = False) -> st.SearchStrategy[Case]:
    """Cases over the domain; ``configs`` (a sequence of ints): each case's shapes come
    from one of these shape configs (``Case.config``), so cases share compiled kernels;
    ``pin_formats``: its format fields too (``oracle.core.cases.config_formats``: one compiled
    variant per kernel and config; the values, distribution and seed stay free)."""
    fields = st.fixed_dictionaries({
        "op": st.sampled_from(list(ops)),
        "shape_class": st.sampled_from(list(shape_classes)),
        "dist": st.sampled_from(list(DISTRIBUTIONS)),
        "platform": st.sampled_from(list(PLATFORMS)),
        "kv_cache_dtype": st.sampled_from(list(KV_CACHE_DTYPES)),
        "model_dtype": st.sampled_from(list(MODEL_DTYPES)),
        "scales": st.sampled_from(list(SCALES)),
        "seed": st.integers(0, 2**31 - 1),
        "config": st.sampled_from(list(configs)) if configs else st.none(),
    })
    if configs and pin_formats:
        fields = fields.map(lambda f: {**f, **config_formats(f["op"], f["shape_class"],
                                                             f["config"])})
    return fields.map(_valid).filter(lambda c: c is not None)


#: Where failing examples persist between runs (relative to the working directory).
DEFAULT_DB = Path(".hypothesis") / "oracle-fuzz"

#: Examples per hypothesis search. Searches run one op each, the ops in turn, until the
#: budget is spent: every op gets searches (with ops drawn by hypothesis, its early bias to
#: the simplest example, the first op, gave norm_rope_insert 262 of an H200 run's 471
#: cases), and each search replays only a tenth of its size from the database.
EXAMPLES_PER_SEARCH = 20


class CaseFailed(AssertionError):
    pass


def worst_ratio(results) -> float:
    """The largest error / bound over the results' elements (0 when none was measured)."""
    return max((r.tally.max_err_over_bound for r in results), default=0.0)


def check_case(case: Case, impl_names=None, device: str = "cpu",
               checks: Counter | None = None) -> list:
    """Results of every implementation claiming the case; raises CaseFailed on a failure.
    ``checks`` (when given) counts the checks run per implementation name, the failing
    one included."""
    results = []
    for impl, r in check_claimants(case, impl_names, device):
        if checks is not None:
            checks[impl.name] += 1
        results.append(r)
        if not r.passed:
            raise CaseFailed(r.summary())
    return results


DEFAULT_SHAPE_CLASSES = ("tiny", "small")

#: Left out of a CUDA fuzz run unless named with ``--impls``: the compiled flex baseline is
#: compiled by Inductor for every new shape (``dynamic=False``, oracle/impls/flex.py), seconds
#: per case, which the suite's fixed case set amortises and a random-shape search does not
#: (H200, 14 workers: a quarter of the gaps between cases were over 3 s).
CUDA_FUZZ_SKIPS = ("flex",)


def check_budget(seconds: float, warmup: float | None) -> float:
    """The warm-up of a run of ``seconds`` (default a fifth of it), after checking both:
    ValueError naming the option that is out of range."""
    if not seconds > 0:
        raise ValueError(f"--seconds must be > 0, got {seconds:g}")
    warmup = 0.2 * seconds if warmup is None else warmup
    if not 0 <= warmup < seconds:
        raise ValueError(f"--warmup must be in [0, {seconds:g}) seconds (below the time "
                         f"budget), got {warmup:g}")
    return warmup


def config_pool(size: int, salt: int) -> tuple[int, ...] | None:
    """The shape configs of one run: ``size`` consecutive ids from ``salt * size`` (a
    run's salt picks a fresh pool; the ids are in the cases' replay commands), or None
    for ``size`` 0 (every case draws its own shapes)."""
    if size < 0 or salt < 0:
        raise ValueError(f"configs and config salt must be >= 0, got {size}, {salt}")
    return tuple(range(salt * size, (salt + 1) * size)) if size else None


#: Configs of a CUDA fuzz run when ``--configs`` is not given, their formats pinned: each
#: run explores this many random kernel configurations (shapes, formats, dtypes, scale
#: kinds) with free values, distributions and seeds, a new pool each run. With every
#: case its own shapes the H200 spent 73% of its time compiling (4.2 cases/s on 14
#: workers); with 4 shape configs and formats drawn per case still 71% (6.9/s): pinned,
#: 300 cases per op meet at most 8 specialisations per kernel, compiled in the warm-up.
CUDA_CONFIGS = 4


def default_configs(device: str, configs: int | None, pin_formats: bool
                    ) -> tuple[int, bool]:
    """(configs, pin_formats) of a run: as given, or when ``configs`` is None,
    ``CUDA_CONFIGS`` pinned on CUDA (where each specialisation costs a compile) and 0 on
    the CPU (the interpreter compiles nothing)."""
    if configs is not None:
        return configs, pin_formats
    return (CUDA_CONFIGS, True) if device == "cuda" else (0, pin_formats)


def default_impls(device: str) -> list[str] | None:
    """The implementations a fuzz run checks when none are named: all (None) on the CPU,
    all but ``CUDA_FUZZ_SKIPS`` on CUDA."""
    from oracle.core.registry import known_names

    if device != "cuda":
        return None
    return sorted(known_names() - set(CUDA_FUZZ_SKIPS))


def run_parallel(workers: int, seconds: float, ops=None, impls=None,
                 out_dir: Path = Path("fuzz-failures"), device: str = "cpu",
                 db: Path | None = DEFAULT_DB, gpus: int = 0,
                 shape_classes=DEFAULT_SHAPE_CLASSES) -> int:
    """``run`` in ``workers`` processes at once (each its own hypothesis stream, one shared
    example database and failure folder); with ``gpus`` > 1 worker i runs on GPU i mod
    gpus alone (CUDA_VISIBLE_DEVICES, set before it touches CUDA). Returns 1 when any
    worker found a failure."""
    stats = run_workers(workers, seconds, ops, impls, out_dir, device, db, gpus,
                        shape_classes)
    return 1 if any(s["failure"] for s in stats) else 0


def run_workers(workers: int, seconds: float, ops=None, impls=None,
                out_dir: Path = Path("fuzz-failures"), device: str = "cpu",
                db: Path | None = DEFAULT_DB, gpus: int = 0,
                shape_classes=DEFAULT_SHAPE_CLASSES, shrink: bool = True,
                configs=None, pin_formats: bool = False) -> list[dict]:
    """As ``run_parallel``, returning every worker's stats (``run_stats``), worker 0 first
    (one worker: in this process). ``shrink=False``: a failure is reported as drawn
    (hypothesis may spend minutes shrinking one)."""
    import multiprocessing

    from kernels import cuda_build

    if workers <= 1:
        return [run_stats(seconds, ops, impls, out_dir, device, db,
                          shape_classes=shape_classes, shrink=shrink, configs=configs,
                          pin_formats=pin_formats)]
    args = [(i, gpus, seconds, ops, impls, out_dir, device, db, tuple(shape_classes), shrink,
             configs, pin_formats)
            for i in range(workers)]
    cuda_build.prebuild()  # once here, not in every worker at once
    with multiprocessing.get_context("spawn").Pool(workers) as pool:
        return pool.starmap(_worker, args)


def _worker(index, gpus, seconds, ops, impls, out_dir, device, db, shape_classes,
            shrink=True, configs=None, pin_formats=False) -> dict:
    from oracle.tools.gpus import pin_gpu

    pin_gpu(index, gpus)
    load_all()  # a spawned process: its registry starts empty
    stats = run_stats(seconds, ops, impls, out_dir, device, db, progress=index == 0,
                      shape_classes=shape_classes, shrink=shrink, offset=index,
                      configs=configs, pin_formats=pin_formats)
    return dict(stats, worker=index)


def run(seconds: float, ops=None, impls=None, out_dir: Path = Path("fuzz-failures"),
        device: str = "cpu", db: Path | None = DEFAULT_DB, progress: bool = True,
        shape_classes=DEFAULT_SHAPE_CLASSES) -> int:
    """Fuzz for ``seconds`` in this process; 1 when a failure was found (and written)."""
    stats = run_stats(seconds, ops, impls, out_dir, device, db, progress, shape_classes)
    return 1 if stats["failure"] else 0


def run_stats(seconds: float, ops=None, impls=None, out_dir: Path = Path("fuzz-failures"),
              device: str = "cpu", db: Path | None = DEFAULT_DB, progress: bool = True,
              shape_classes=DEFAULT_SHAPE_CLASSES, shrink: bool = True, offset: int = 0,
              configs=None, pin_formats: bool = False) -> dict:
    """Fuzz for ``seconds`` in this process and return what was done: ``cases`` (every
    distinct drawn case checked by each implementation claiming it, the database's replays
    and shrinking's included; searches of ``EXAMPLES_PER_SEARCH`` examples, one op each,
    the ops in turn from ``ops[offset]``), ``case_times_s`` (when each finished, seconds
    since this call began), ``per_op`` / ``per_shape_class`` case counts, ``checks`` per
    implementation, ``elapsed_s`` (when the search stopped) and ``failure`` (None, or the
    shrunk case's id, replay command and file)."""
    from tqdm import tqdm

    from kernels._triton import CompileClock  # here: after the CLI has set TRITON_INTERPRET

    start = time.monotonic()
    ops = ops or list(OPS)
    deadline = start + seconds
    failures: list[Case] = []
    n = 0
    times: list[float] = []
    per_op: Counter = Counter()
    per_class: Counter = Counter()
    checks: Counter = Counter()
    bar = tqdm(total=int(seconds), desc="fuzz (s)", unit="s", disable=not progress)
    clock = CompileClock().install()
    compile_s: list[float] = []  # each case's seconds in Triton compiles

    database = DirectoryBasedExampleDatabase(str(db)) if db is not None else None
    seen: set[str] = set()

    def search(op):
        @settings(max_examples=EXAMPLES_PER_SEARCH, deadline=None, database=database,
                  derandomize=False, phases=[Phase.reuse, Phase.generate, Phase.target,
                                             *([Phase.shrink] if shrink else [])],
                  report_multiple_bugs=False, suppress_health_check=list(HealthCheck))
        @given(case_strategy([op], shape_classes, configs, pin_formats))
        def one(case):
            nonlocal n
            # Budget spent, or a case already checked (hypothesis repeats some): skipped,
            # unless shrinking a failure (it replays it and its variants, past the budget).
            if not failures and (time.monotonic() >= deadline or case.id in seen):
                return
            seen.add(case.id)
            n += 1
            compiled_before = clock.seconds
            try:
                results = check_case(case, impls, device, checks)
            except CaseFailed as e:
                failures.append((case, str(e)))  # the last one recorded: the shrunk example
                raise
            finally:
                times.append(time.monotonic() - start)
                compile_s.append(clock.seconds - compiled_before)
                per_op[case.op] += 1
                per_class[case.shape_class] += 1
                bar.n = int(time.monotonic() - start)
                bar.refresh()
            target(worst_ratio(results), label="err/bound")
        one()

    for i in itertools.count(offset):
        if time.monotonic() >= deadline:
            break
        try:
            search(ops[i % len(ops)])
        except CaseFailed:
            break
    elapsed = time.monotonic() - start
    bar.close()
    stats = {"cases": n, "case_times_s": times, "case_compile_s": compile_s,
             "compiles": clock.count, "per_op": dict(per_op),
             "per_shape_class": dict(per_class), "checks": dict(checks),
             "elapsed_s": elapsed, "failure": None}
    if not failures:
        print(f"fuzz: {n} cases, no failure in {seconds:.0f} s")
        return stats
    case, summary = failures[-1]
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / f"{case.id.replace(':', '_')}.txt"
    path.write_text(case.replay_command() + "\n")
    print(f"fuzz: failure after {n} cases; shrunk to {case.id}\n{summary}\n"
          f"replay: {case.replay_command()}\nwritten to {path}")
    stats["failure"] = {"case": case.id, "replay": case.replay_command(), "file": str(path),
                        "summary": summary}
    return stats


# ------------------------------------------------------------------------------ report


def rate_after(times, elapsed: float, warmup: float) -> float | None:
    """Cases per second of one worker over (warmup, elapsed]: the cases finished after the
    warm-up over the time left after it (None when the search stopped within the warm-up)."""
    if elapsed <= warmup:
        return None
    return sum(t > warmup for t in times) / (elapsed - warmup)


def compile_after(stats: dict, warmup: float) -> float:
    """Seconds one worker spent in Triton compiles after the warm-up: each case's compile
    seconds, capped at the part of its span (from the previous case's end) that lies after
    the warm-up (a case straddling it compiled partly within it)."""
    total, prev = 0.0, 0.0
    for t, c in zip(stats["case_times_s"], stats.get("case_compile_s", ())):
        if t > warmup:
            total += min(c, t - max(prev, warmup))
        prev = t
    return total


def report(stats: list[dict], *, seconds: float, warmup: float, ops, impls, shape_classes,
           device: str, wall_s: float | None = None, configs=None,
           pin_formats: bool = False, gpus: int = 0) -> dict:
    """One ``fuzz/1`` document from the workers' stats (``run_workers``). Throughput is
    summed over the workers' own rates: ``after_warmup`` counts the cases each finished
    after ``warmup`` seconds from its start over its time after that; ``overall`` each
    one's cases over its whole search."""
    from oracle.core.report import machine_info

    per_op: Counter = Counter()
    per_class: Counter = Counter()
    checks: Counter = Counter()
    workers = []
    after, overall, net = [], [], []
    for i, s in enumerate(stats):
        per_op.update(s["per_op"])
        per_class.update(s["per_shape_class"])
        checks.update(s["checks"])
        r = rate_after(s["case_times_s"], s["elapsed_s"], warmup)
        after.append(r)
        overall.append(s["cases"] / s["elapsed_s"] if s["elapsed_s"] > 0 else 0.0)
        compiling = compile_after(s, warmup)
        left = s["elapsed_s"] - warmup - compiling
        net.append(None if r is None or left <= 0 else r * (s["elapsed_s"] - warmup) / left)
        workers.append({
            "worker": s.get("worker", i), "cases": s["cases"],
            "cases_after_warmup": sum(t > warmup for t in s["case_times_s"]),
            "per_op": s["per_op"], "per_shape_class": s["per_shape_class"],
            "checks": s["checks"],
            "elapsed_s": s["elapsed_s"],
            "cases_per_s_after_warmup": r, "cases_per_s": overall[-1],
            "case_times_s": s["case_times_s"],
            "compiles": s.get("compiles", 0),
            "compile_s": sum(s.get("case_compile_s", ())),
            "compile_s_after_warmup": compiling,
            "case_compile_s": s.get("case_compile_s", []),
            "failure": s["failure"]})
    measured = [r for r in after if r is not None]
    after_s = sum(max(s["elapsed_s"] - warmup, 0.0) for s in stats)
    return {
        "schema": "fuzz/1",
        "machine": machine_info(),
        "device": device,
        "workers": len(stats),
        "gpus": max(gpus, 1) if device == "cuda" else 0,
        "seconds": seconds,
        "warmup_s": warmup,
        "wall_s": wall_s,
        "ops": list(ops),
        "impls": list(impls),
        "shape_classes": list(shape_classes),
        "configs": configs,
        "pin_formats": bool(configs) and pin_formats,
        "cases": sum(s["cases"] for s in stats),
        "per_op": dict(sorted(per_op.items())),
        "per_shape_class": dict(sorted(per_class.items())),
        "checks": dict(sorted(checks.items())),
        "throughput": {
            "cases_per_s_after_warmup": sum(measured) if measured else None,
            "workers_measured_after_warmup": len(measured),
            "cases_per_s": sum(overall),
            # The share of the workers' time after the warm-up spent in Triton compiles, and
            # the rate with that time taken out (what a warm compile cache would give).
            "compile_share_after_warmup": (sum(w["compile_s_after_warmup"] for w in workers)
                                           / after_s if after_s else None),
            "cases_per_s_after_warmup_net_of_compiles":
                sum(r for r in net if r is not None) if measured else None,
        },
        "failures": [w["failure"] for w in workers if w["failure"]],
        "per_worker": workers,
    }


def write_report(doc: dict, path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(doc, indent=1) + "\n")
    return path


def _rate(v) -> str:
    return "-" if v is None else f"{v:.1f}"


def _share(v) -> str:
    return "-" if v is None else f"{100 * v:.0f}%"


def _configs_line(doc: dict) -> str:
    ids = doc.get("configs")
    if not ids:
        return "Every case its own shapes and formats."
    pinned = " and formats" if doc.get("pin_formats") else " (formats drawn per case)"
    return f"Shapes{pinned} from {len(ids)} configs (ids {ids[0]}..{ids[-1]})."


def markdown(doc: dict) -> str:
    """A short Markdown summary of a ``fuzz/1`` document."""
    t = doc["throughput"]
    lines = [
        "| device | GPUs | workers | shape classes | budget (s) | warm-up (s) | cases | "
        "cases/s after warm-up | cases/s overall | compile share after warm-up | "
        "cases/s after warm-up, compiles taken out | failures |",
        "|---|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|",
        f"| {doc['machine'].get('device', doc['device'])} | {doc.get('gpus', '-')} | "
        f"{doc['workers']} | "
        f"{','.join(doc['shape_classes'])} | {doc['seconds']:g} | {doc['warmup_s']:g} | "
        f"{doc['cases']} | {_rate(t['cases_per_s_after_warmup'])} | "
        f"{_rate(t['cases_per_s'])} | {_share(t.get('compile_share_after_warmup'))} | "
        f"{_rate(t.get('cases_per_s_after_warmup_net_of_compiles'))} | "
        f"{len(doc['failures'])} |",
        "",
        _configs_line(doc),
        "",
        "| op | cases |",
        "|---|---:|",
        *(f"| {op} | {n} |" for op, n in doc["per_op"].items()),
    ]
    for f in doc["failures"]:
        lines += ["", f"failure: `{f['case']}`; replay: `{f['replay']}`"]
        lines += ["", "```", f["summary"], "```"] if f.get("summary") else []
    return "\n".join(lines) + "\n"
