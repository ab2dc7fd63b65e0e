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
"""

from __future__ import annotations

import time
from pathlib import Path

from hypothesis import HealthCheck, Phase, given, settings, target
from hypothesis import strategies as st
from hypothesis.database import DirectoryBasedExampleDatabase

from oracle.cases import DISTRIBUTIONS, OPS, SCALES, Case
from oracle.checks import run_check
from oracle.registry import implementations
from reference.platforms import KV_CACHE_DTYPES, MODEL_DTYPES, PLATFORMS


def _valid(fields) -> Case | None:
    try:
        return Case(**fields)
    except ValueError:
        return None


def case_strategy(ops=OPS, shape_classes=("tiny", "small")) -> st.SearchStrategy[Case]:
    fields = st.fixed_dictionaries({
        "op": st.sampled_from(list(ops)),
        "shape_class": st.sampled_from(list(shape_classes)),
        "dist": st.sampled_from(list(DISTRIBUTIONS)),
        "platform": st.sampled_from(list(PLATFORMS)),
        "kv_cache_dtype": st.sampled_from(list(KV_CACHE_DTYPES)),
        "model_dtype": st.sampled_from(list(MODEL_DTYPES)),
        "scales": st.sampled_from(list(SCALES)),
        "seed": st.integers(0, 2**31 - 1),
    })
    return fields.map(_valid).filter(lambda c: c is not None)


#: Where failing examples persist between runs (relative to the working directory).
DEFAULT_DB = Path(".hypothesis") / "oracle-fuzz"


class CaseFailed(AssertionError):
    pass


def worst_ratio(results) -> float:
    """The largest error / bound over the results' elements (0 when none was measured)."""
    return max((r.tally.max_err_over_bound for r in results), default=0.0)


def check_case(case: Case, impl_names=None, device: str = "cpu") -> list:
    """Results of every implementation claiming the case; raises CaseFailed on a failure."""
    results = []
    for impl in implementations(case.op, impl_names, device):
        if impl.supports(case)[0]:
            r = run_check(case, impl)
            results.append(r)
            if not r.passed:
                raise CaseFailed(r.summary())
    return results


def run_parallel(workers: int, seconds: float, ops=None, impls=None,
                 out_dir: Path = Path("fuzz-failures"), device: str = "cpu",
                 db: Path | None = DEFAULT_DB, gpus: int = 0) -> int:
    """``run`` in ``workers`` processes at once (each its own hypothesis stream, one shared
    example database and failure folder); with ``gpus`` > 1 worker i runs on GPU i mod
    gpus alone (CUDA_VISIBLE_DEVICES, set before it touches CUDA). Returns 1 when any
    worker found a failure."""
    import multiprocessing

    if workers <= 1:
        return run(seconds, ops, impls, out_dir, device, db)
    args = [(i, gpus, seconds, ops, impls, out_dir, device, db) for i in range(workers)]
    with multiprocessing.get_context("spawn").Pool(workers) as pool:
        return max(pool.starmap(_worker, args))


def _worker(index, gpus, seconds, ops, impls, out_dir, device, db) -> int:
    import os

    if gpus > 1 and "CUDA_VISIBLE_DEVICES" not in os.environ:
        os.environ["CUDA_VISIBLE_DEVICES"] = str(index % gpus)
    return run(seconds, ops, impls, out_dir, device, db, progress=index == 0)


def run(seconds: float, ops=None, impls=None, out_dir: Path = Path("fuzz-failures"),
        device: str = "cpu", db: Path | None = DEFAULT_DB, progress: bool = True) -> int:
    from tqdm import tqdm

    ops = ops or list(OPS)
    deadline = time.monotonic() + seconds
    failures: list[Case] = []
    n = 0
    bar = tqdm(total=int(seconds), desc="fuzz (s)", unit="s", disable=not progress)

    database = DirectoryBasedExampleDatabase(str(db)) if db is not None else None

    @settings(max_examples=3, deadline=None, database=database, derandomize=False,
              phases=[Phase.reuse, Phase.generate, Phase.target, Phase.shrink],
              report_multiple_bugs=False, suppress_health_check=list(HealthCheck))
    @given(case_strategy(ops))
    def one(case):
        nonlocal n
        n += 1
        try:
            results = check_case(case, impls, device)
        except CaseFailed:
            failures.append(case)  # the last one recorded is hypothesis's shrunk example
            raise
        target(worst_ratio(results), label="err/bound")

    start = time.monotonic()
    while time.monotonic() < deadline:
        try:
            one()
        except CaseFailed:
            break
        finally:
            bar.n = int(time.monotonic() - start)
            bar.refresh()
    bar.close()
    if not failures:
        print(f"fuzz: {n} cases, no failure in {seconds:.0f} s")
        return 0
    case = failures[-1]
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / f"{case.id.replace(':', '_')}.txt"
    path.write_text(case.replay_command() + "\n")
    print(f"fuzz: failure after {n} cases; shrunk to {case.id}\nreplay: {case.replay_command()}"
          f"\nwritten to {path}")
    return 1
