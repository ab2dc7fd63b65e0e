"""The false-alarm run: clean randomized cases on the unmutated implementations, counting
failures (there must be none), and the calibration of the reported-only statistics.

Cases (``draw_cases``): per op, ``n`` cases whose fields are drawn uniformly from the op's
domain (shape classes given, every distribution the op takes, platform, cache dtype, model
dtype, scales where the format has them) with seeds from a seeded generator, so a run is a
pure function of (op, n, seed, shape classes). Each case runs through every implementation
that claims it (``oracle.core.checks.run_check``), the reference included.

Calibration of the reported, non-gating statistics (``oracle.core.checks.reported_attention_stats``
and the indexer's ``needed_bound``): per op and implementation the distribution of each
statistic over the clean cases (max, 99.9th and 99th percentiles). A gate "statistic <=
multiplier" raises no false alarm on this run when the multiplier is at least the max;
the calibrated multiplier is the max times ``MARGIN``. Whether one may gate: ``fa_ratio``
(FlashAttention's criterion, the kernel's error over a same-precision baseline's) may gate
at FlashAttention's customary 2 only if no clean case exceeded 2 / ``MARGIN``;
``prob_ratio`` (the error over a probabilistic bound with a 1e-6 failure probability per
element) only if its max stays below 1 / ``MARGIN``; the index ``needed_bound`` is already
the gate (the rigorous score bound), reported for its headroom.
"""

from __future__ import annotations

import time
from collections import defaultdict

import numpy as np

from oracle.core import rand
from oracle.core.cases import DISTRIBUTIONS, SCALES, Case, config_formats, pick
from oracle.core.checks import check_claimants
from oracle.impls.catalog import load_all
from reference.platforms import KV_CACHE_DTYPES, MODEL_DTYPES, PLATFORMS

MARGIN = 1.5  # the calibrated multiplier: the clean run's max times this
CUSTOMARY = {"fa_ratio": 2.0, "prob_ratio": 1.0}  # where the literature would gate


def draw_cases(op: str, n: int, seed: int = 0, shape_classes=("tiny", "small"),
               configs: int = 0, pin_formats: bool = False) -> list[Case]:
    """``n`` valid cases of ``op`` with uniformly drawn fields (module docstring);
    ``configs`` > 0: each case's shapes from one of that many shape configs
    (``oracle.tools.fuzz.config_pool(configs, seed)``), so the cases share compiled kernels;
    ``pin_formats``: its format fields too (``oracle.core.cases.config_formats``)."""
    from oracle.tools.fuzz import config_pool

    pool = config_pool(configs, seed)
    bg = rand.generator(rand.seed_of(f"falsealarm:{op}:{seed}"))
    dists = [d for d in DISTRIBUTIONS if d != "ties" or op.startswith("indexer")]
    cases = []
    while len(cases) < n:
        fields = dict(op=op, shape_class=pick(bg, shape_classes), dist=pick(bg, dists),
                      platform=pick(bg, PLATFORMS), kv_cache_dtype=pick(bg, KV_CACHE_DTYPES),
                      model_dtype=pick(bg, MODEL_DTYPES), scales=pick(bg, SCALES),
                      seed=int(rand.integers(bg, 0, 2**31 - 1, ())[()]))
        if pool:
            fields["config"] = pick(bg, pool)
            if pin_formats:
                fields.update(config_formats(op, fields["shape_class"], fields["config"]))
        try:
            cases.append(Case(**fields))
        except ValueError:  # scales on a 16-bit cache: the same draw without them
            try:
                cases.append(Case(**{**fields, "scales": "none"}))
            except ValueError:
                continue
    return cases


def run_cases(cases, impl_names=None, device: str = "cpu", deadline: float | None = None
              ) -> list[dict]:
    """Every claiming implementation on every case: one row per check. Cases not started
    by ``deadline`` (a ``time.time()`` value) are skipped: a budgeted run reports what it
    checked instead of nothing."""
    rows = []
    for case in cases:
        if deadline is not None and time.time() > deadline:
            break
        for impl, r in check_claimants(case, impl_names, device):
            rows.append({"op": case.op, "impl": impl.name, "case": case.id,
                         "passed": r.passed, "seconds": r.seconds, "replay": r.replay,
                         "summary": None if r.passed else r.summary(),
                         "stats": {k: float(v) for k, v in r.extra.items()
                                   if isinstance(v, (int, float))}})
    return rows


def _worker(args):
    load_all()  # a spawned process: its registry starts empty (loading again adds nothing)
    cases, impl_names, device, deadline = args
    return run_cases(cases, impl_names, device, deadline)


def _pin_worker(counter, gpus: int) -> None:
    """Pool initializer: the i-th worker started runs on GPU i mod ``gpus`` alone (set
    before it touches CUDA), as ``oracle fuzz`` pins its workers."""
    from oracle.tools.gpus import pin_gpu

    with counter.get_lock():
        index = counter.value
        counter.value += 1
    pin_gpu(index, gpus)


def _interleaved(per_op: list[list[Case]]) -> list[Case]:
    """Round-robin over the ops, so a budgeted run covers each op about equally."""
    return [c for group in zip(*per_op) for c in group]


def run(ops, n: int, seed: int = 0, shape_classes=("tiny", "small"), impl_names=None,
        device: str = "cpu", workers: int = 1, seconds: float | None = None,
        gpus: int = 0, configs: int = 0) -> dict:
    """The clean run over ``n`` cases per op and its calibration (module docstring); with
    ``seconds``, cases not started within that budget are left out and the report says
    how many each op got (``cases_run``). ``gpus`` > 1: worker i on GPU i mod gpus."""
    from oracle.core.report import machine_info

    t0 = time.perf_counter()
    deadline = None if seconds is None else time.time() + seconds
    cases = _interleaved([draw_cases(op, n, seed, shape_classes, configs) for op in ops])
    if workers > 1:
        import multiprocessing

        from kernels import cuda_build

        cuda_build.prebuild()  # once here, not in every worker at once
        # Small tasks in case order: every worker stops at the same deadline, and the
        # cases run are a prefix of the interleaved order (each op about equally).
        tasks = [(cases[i:i + 4], impl_names, device, deadline)
                 for i in range(0, len(cases), 4)]
        ctx = multiprocessing.get_context("spawn")
        with ctx.Pool(workers, _pin_worker, (ctx.Value("i", 0), gpus)) as pool:
            rows = [r for part in pool.imap(_worker, tasks) for r in part]
    else:
        rows = run_cases(cases, impl_names, device, deadline)
    cases_run = {op: len({r["case"] for r in rows if r["op"] == op}) for op in ops}
    return {"schema": "false-alarms/1", "machine": machine_info(), "device": device,
            "seed": seed, "cases_per_op": n, "configs": configs, "cases_run": cases_run,
            "budget_s": seconds, "shape_classes": list(shape_classes),
            "workers": workers, "gpus": max(gpus, 1) if device == "cuda" else 0,
            "seconds": round(time.perf_counter() - t0, 2),
            "cells": summarize(rows), "failures": [r for r in rows if not r["passed"]]}


def merge(docs: list[dict]) -> dict:
    """One false-alarm report from runs over disjoint ops (a 2,000-case-per-op run split
    over device calls with ``--ops``): cells, failures and per-op counts joined, seconds
    summed, the first run's settings. The percentiles are per (op, implementation) cell,
    so runs sharing an op cannot be joined without their raw rows: that is an error."""
    if not docs:
        raise ValueError("merge needs at least one false-alarm report")
    first = docs[0]
    seen: set = set()
    for d in docs:
        if d.get("schema") != "false-alarms/1":
            raise ValueError(f"not a false-alarm report: schema {d.get('schema')!r}")
        for key in ("device", "seed", "cases_per_op", "shape_classes", "configs"):
            if d.get(key) != first.get(key):
                raise ValueError(f"runs differ in {key}: {first.get(key)!r} vs {d.get(key)!r}")
        ops = set(d["cases_run"])
        if ops & seen:
            raise ValueError(f"runs share ops {sorted(ops & seen)}: merge needs disjoint --ops")
        seen |= ops
    return {**first,
            "cases_run": {op: n for d in docs for op, n in d["cases_run"].items()},
            "workers": max(d["workers"] for d in docs),
            "seconds": round(sum(d["seconds"] for d in docs), 2),
            "cells": sorted((c for d in docs for c in d["cells"]),
                            key=lambda c: (c["op"], c["impl"])),
            "failures": [f for d in docs for f in d["failures"]],
            "merged_from": len(docs)}


def summarize(rows) -> list[dict]:
    """Per (op, implementation): checks, failures, and each reported statistic's
    distribution with its calibrated multiplier and whether it may gate."""
    groups = defaultdict(list)
    for r in rows:
        groups[(r["op"], r["impl"])].append(r)
    cells = []
    for (op, impl), rs in sorted(groups.items()):
        stats = defaultdict(list)
        for r in rs:
            for k, v in r["stats"].items():
                stats[k].append(v)
        cell = {"op": op, "impl": impl, "checks": len(rs),
                "failures": sum(not r["passed"] for r in rs), "stats": {}}
        for k, vals in sorted(stats.items()):
            a = np.asarray(vals, np.float64)
            undefined = int(np.count_nonzero(np.isnan(a)))  # never calibrates a gate
            a = a[~np.isnan(a)]
            if not a.size:
                cell["stats"][k] = {"n": 0, "undefined": undefined}
                continue
            top = float(a.max())
            entry = {"n": int(a.size), "undefined": undefined, "max": top,
                     "p999": float(np.quantile(a, 0.999)),
                     "p99": float(np.quantile(a, 0.99)), "calibrated": top * MARGIN}
            if k in CUSTOMARY:
                entry["customary"] = CUSTOMARY[k]
                entry["over_customary"] = int(np.count_nonzero(a > CUSTOMARY[k]))
                entry["may_gate_at_customary"] = bool(top * MARGIN <= CUSTOMARY[k])
            cell["stats"][k] = entry
        cells.append(cell)
    return cells


def _yes_no(flag) -> str:
    return "-" if flag is None else "yes" if flag else "no"


def _cases_line(doc: dict) -> str:
    run = doc.get("cases_run")
    if not run or all(v == doc["cases_per_op"] for v in run.values()):
        return f"{doc['cases_per_op']} clean cases per op"
    got = ", ".join(f"{op} {v}" for op, v in run.items())
    return (f"clean cases run per op within the {doc['budget_s']} s budget ({got}; "
            f"{doc['cases_per_op']} drawn)")


def _configs(doc: dict) -> str:
    n = doc.get("configs") or 0
    return f", shapes from {n} configs per op" if n else ""


def _gpus(doc: dict) -> str:
    n = doc.get("gpus", 0)
    return f" over {n} GPUs" if n > 1 else ""


def markdown(doc: dict) -> str:
    lines = [f"# False-alarm run ({doc['device']}, {doc['machine'].get('device')})", "",
             f"{_cases_line(doc)} (shape classes "
             f"{', '.join(doc['shape_classes'])}, seed {doc['seed']}"
             f"{_configs(doc)}), every implementation "
             f"that claims each; {doc['seconds']} s on {doc['workers']} worker(s)"
             f"{_gpus(doc)}. "
             f"Failures: {len(doc['failures'])}.", "",
             "| op | impl | checks | failures |", "|---|---|---:|---:|"]
    lines += [f"| {c['op']} | {c['impl']} | {c['checks']} | {c['failures']} |"
              for c in doc["cells"]]
    lines += ["", "Reported statistics (not gating): distribution over the clean checks, the "
              f"calibrated multiplier (max x {MARGIN}), and whether the customary gate "
              "(FlashAttention's 2x for fa_ratio, 1 for prob_ratio) would hold with that "
              "margin.", "",
              "| op | impl | statistic | p99 | p99.9 | max | calibrated | over customary "
              "| may gate at customary |", "|---|---|---|---:|---:|---:|---:|---:|---|"]
    for c in doc["cells"]:
        for k, s in c["stats"].items():
            if not s["n"]:
                continue
            lines.append(f"| {c['op']} | {c['impl']} | {k} | {s['p99']:.3g} | "
                         f"{s['p999']:.3g} | {s['max']:.3g} | {s['calibrated']:.3g} | "
                         f"{s.get('over_customary', '-')} | "
                         f"{_yes_no(s.get('may_gate_at_customary'))} |")
    for f in doc["failures"][:30]:
        lines += ["", "```", f["summary"], "```"]
    return "\n".join(lines) + "\n"

