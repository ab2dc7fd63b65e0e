"""Tolerance reports: run a seeded case set through every selected implementation, aggregate
the check results per cell, write one JSON (schema ``oracle-report/1``).

A cell is (op, implementation, platform, storage format, shape class, distribution). Each
cell keeps its per-case rows (case id, input hash, pass, exact rate, max error/bound, RMSE)
so that ``oracle.core.diff`` can pair cases across two reports of the same case set.
Markdown and PNG are rendered from the JSON by ``oracle.core.render`` (a GPU run only needs to
bring back the JSON and a log).
"""

from __future__ import annotations

import gzip
import json
import os
import platform as host_platform
import subprocess
import time
from collections import defaultdict
from pathlib import Path

import numpy as np

from oracle.core.cases import OPS, Case
from oracle.core.checks import ULP_BINS, CheckResult, run_check
from oracle.core.inputsets import case_inputs
from oracle.core.registry import implementations
from reference.platforms import KV_CACHE_DTYPES, PLATFORMS, kv_cache_format

SCHEMA = "oracle-report/1"
ROOT = Path(__file__).resolve().parents[2]  # the repository (its commit goes in a report)
DISTS_BY_OP = {  # near_overflow: index keys at the fp8 format's max (0x7F: NaN in e4m3fn)
    "indexer_prefill": ("normal", "outliers", "near_overflow", "tiny", "ties"),
    "indexer_decode": ("normal", "outliers", "near_overflow", "tiny", "ties"),
}
DEFAULT_DISTS = ("normal", "outliers", "near_overflow", "tiny")


SWEPT_OPS = ("norm_rope_insert", "reshape_and_cache")
LONG_OPS = ("indexer_prefill", "indexer_decode", "attention_prefill", "attention_decode")
#: Classes whose differential cases draw their shapes from a config per platform and
#: format: a GPU run compiles each kernel once per config instead of once per case.
SHARED_SHAPE_CLASSES = ("tiny", "small")


def differential_cases(op: str, gpu: bool, seed0: int = 0) -> list[Case]:
    """Per platform x distinct format x distribution: one tiny case, one small case on a
    rotating subset, and (GPU) one model-shape case per platform x format plus, for the
    insert ops, two ``sweep`` cases (random shapes over the whole domain, N up to 16,384;
    the outliers one has V with -0/Inf/NaN), for the indexer and attention ops one ``long``
    case (contexts up to 128k tokens, prefill prefixes up to 64k; the kernels only: the
    torch and flex baselines stop at the model class). Scales rotate through none/tensor/slot; fp16
    activations on a rotating subset. The standard budget of the differential test and of
    the mutants' kill matrix; ``seed0`` offsets every seed (a run exploring new shapes).
    The tiny and small cases of one platform and format share one shape config
    (``Case.config``): their distributions, scales and dtypes differ on one compiled
    kernel, and the shapes differ across the formats."""
    pairs = platform_formats()
    cases, i = [], 0
    for f, (plat, kv, fmt) in enumerate(pairs):
        fp8 = fmt not in ("bfloat16", "float16")
        for d, dist in enumerate(DISTS_BY_OP.get(op, DEFAULT_DISTS)):
            i += 1
            scales = ("slot", "tensor", "none")[i % 3] if fp8 and "indexer" not in op \
                else "none"
            md = "float16" if i % 4 == 0 and kv == "auto" or kv == "float16" else "bfloat16"
            kv_ = "auto" if kv == "float16" else kv
            classes = ["tiny"] + (["small"] if i % 2 == 0 else [])
            if gpu and d == 0:
                classes.append("model")
            if gpu and op in SWEPT_OPS and d < 2:
                classes.append("sweep")
            if gpu and op in LONG_OPS and d == 1:
                classes.append("long")
            for sc in classes:
                config = seed0 * len(pairs) + f if sc in SHARED_SHAPE_CLASSES else None
                cases.append(Case(op, sc, dist, plat, kv_, md, scales, seed0 + i,
                                  config=config))
    return cases


def platform_formats() -> list[tuple[str, str, str]]:
    """(platform, kv_cache_dtype, storage format) for each distinct storage format of each
    platform, the first kv_cache_dtype naming it."""
    pairs = []
    for plat in PLATFORMS:
        seen = set()
        for kv in KV_CACHE_DTYPES:
            fmt = kv_cache_format(kv, plat)
            if fmt not in seen:
                seen.add(fmt)
                pairs.append((plat, kv, fmt))
    return pairs


def default_cases(ops=OPS, platforms=PLATFORMS, shape_classes=("tiny", "small"),
                  budget: int = 1, model_dtypes=("bfloat16",)) -> list[Case]:
    """The standard case set: every op x platform x distinct storage format x distribution x
    shape class, ``budget`` seeds each; fp8 formats rotate through no/tensor/slot scales
    (by seed) and fp16 runs on the first distribution only, to keep the set small."""
    cases = []
    for op in ops:
        for plat in platforms:
            seen = set()
            for kv in KV_CACHE_DTYPES:
                for md in model_dtypes:
                    fmt = kv_cache_format(kv, plat, md)
                    if (fmt, md) in seen:
                        continue
                    seen.add((fmt, md))
                    for dist in DISTS_BY_OP.get(op, DEFAULT_DISTS):
                        for sc in shape_classes:
                            for seed in range(budget):
                                scales = "none"
                                if fmt not in ("bfloat16", "float16") and not op.startswith(
                                        "indexer"):
                                    scales = ("slot", "tensor", "none")[seed % 3]
                                cases.append(Case(op, sc, dist, plat, kv, md, scales, seed))
    return cases


def cell_key(result: CheckResult, case: Case) -> tuple:
    fmt = case.index_fmt if case.op.startswith("indexer") else case.kv_fmt
    return (case.op, result.impl, case.platform, fmt, case.shape_class, case.dist)


def _new_cell(key) -> dict:
    op, impl, plat, fmt, sc, dist = key
    return {"op": op, "impl": impl, "platform": plat, "format": fmt, "shape_class": sc,
            "dist": dist, "cases": 0, "passed": 0, "elements": 0, "exact": 0,
            "within_one": 0, "admissible_not_nearest": 0, "violations": 0,
            "width_1": 0, "width_2": 0, "width_more": 0,
            "ulp_hist": {str(b): 0 for b in ULP_BINS}, "max_abs_err": 0.0,
            "max_rel_err": 0.0, "max_err_over_bound": 0.0, "sum_sq_err": 0.0,
            "worst_case": None, "per_case": []}


def add_result(cells: dict, case: Case, r: CheckResult) -> None:
    key = cell_key(r, case)
    c = cells.setdefault(key, _new_cell(key))
    t = r.tally
    c["cases"] += 1
    c["passed"] += int(r.passed)
    for name in ("elements", "exact", "within_one", "admissible_not_nearest", "violations",
                 "width_1", "width_2", "width_more"):
        c[name] += getattr(t, name)
    for b, n in t.ulp_hist.items():
        c["ulp_hist"][b] += n
    c["sum_sq_err"] += t.sum_sq_err
    for name in ("max_abs_err", "max_rel_err"):
        c[name] = max(c[name], getattr(t, name))
    if t.max_err_over_bound >= c["max_err_over_bound"] or not r.passed:
        c["max_err_over_bound"] = max(c["max_err_over_bound"], t.max_err_over_bound)
        if c["worst_case"] is None or not r.passed or c["worst_case"]["passed"]:
            c["worst_case"] = {"case": r.case, "replay": r.replay, "passed": r.passed,
                               "max_err_over_bound": t.max_err_over_bound,
                               "failures": r.failures[:3]}
    for name, value in r.extra.items():  # op-specific reported statistics: keep the max
        if isinstance(value, (int, float)):
            c.setdefault("reported", {})[name] = max(c.get("reported", {}).get(name, 0.0),
                                                     float(value))
    c["per_case"].append({
        "case": r.case, "hash": r.input_hash, "passed": r.passed,
        "exact_rate": t.exact / t.elements if t.elements else 1.0,
        "max_err_over_bound": t.max_err_over_bound, "rmse": r.rmse,
        "elements": t.elements, "exact": t.exact, "within_one": t.within_one,
        "admissible_not_nearest": t.admissible_not_nearest,
        "violations": t.violations, "seconds": round(r.seconds, 4), **r.extra})


#: Names the commit of a tree copied without its git state (a remote GPU machine's copy of
#: the working tree): taken as the commit, the tree as clean.
COMMIT_ENV = "ORACLE_COMMIT"


def source_state(root: Path = ROOT) -> dict:
    """The commit the tree is at and whether tracked files differ from it (a report of a
    dirty tree is not reproducible from its commit); None for both outside a git tree;
    ``$ORACLE_COMMIT`` where set."""
    if os.environ.get(COMMIT_ENV):
        return {"commit": os.environ[COMMIT_ENV], "dirty": False}

    def git(*args):
        return subprocess.run(["git", "-C", str(root), *args], capture_output=True, text=True,
                              timeout=60)
    try:
        head, status = git("rev-parse", "HEAD"), git("status", "--porcelain",
                                                     "--untracked-files=no")
    except (OSError, subprocess.TimeoutExpired):
        return {"commit": None, "dirty": None}
    if head.returncode or status.returncode:
        return {"commit": None, "dirty": None}
    return {"commit": head.stdout.strip(), "dirty": bool(status.stdout.strip())}


def machine_info() -> dict:
    """Where and from what a report was made: host, versions, device, commit, dirty tree."""
    info = {"host": host_platform.node(), "python": host_platform.python_version(),
            "numpy": np.__version__, **source_state()}
    try:
        import torch

        info["torch"] = torch.__version__
        info["device"] = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    except ImportError:
        info["device"] = "cpu"
    try:
        import triton

        info["triton"] = triton.__version__
    except ImportError:
        pass
    return info


def run_report(cases: list[Case], impl_names=None, device: str | None = None,
               progress=True, log=print) -> dict:
    """Run every case through every selected implementation that claims it."""
    cells: dict = {}
    failures = []
    skipped = defaultdict(int)
    t0 = time.perf_counter()
    iterator = cases
    if progress:
        from tqdm import tqdm

        iterator = tqdm(cases, desc="cases", unit="case", mininterval=2.0)
    for case in iterator:
        impls = implementations(case.op, impl_names, device)
        inputs = None
        for impl in impls:
            ok, why = impl.supports(case)
            if not ok:
                skipped[f"{impl.name}: {why}"] += 1
                continue
            if inputs is None:
                inputs = case_inputs(case)
            r = run_check(case, impl, inputs)
            add_result(cells, case, r)
            if not r.passed:
                failures.append({"case": r.case, "impl": r.impl, "summary": r.summary(),
                                 "replay": r.replay})
                log(r.summary())
    return {"schema": SCHEMA, "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "machine": machine_info(), "seconds": round(time.perf_counter() - t0, 2),
            "cases": len(cases), "cells": finished_cells(cells),
            "failures": failures, "skipped": dict(skipped)}


def finished_cells(cells: dict) -> list[dict]:
    """The report's cells in their fixed order, each with its RMSE."""
    for c in cells.values():
        c["rmse"] = float(np.sqrt(c["sum_sq_err"] / max(c["elements"], 1)))
    return sorted(cells.values(), key=lambda c: (
        c["op"], c["impl"], c["platform"], c["format"], c["shape_class"], c["dist"]))


def write_json(report: dict, path: str | Path) -> Path:
    """Write a report; a path ending in ``.gz`` is gzip-compressed (the committed baselines:
    a report compresses ~10x), with no timestamp in the header so equal reports are equal
    files."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    text = json.dumps(report, indent=1, default=_json_default)
    if path.suffix == ".gz":
        path.write_bytes(gzip.compress(text.encode(), mtime=0))
    else:
        path.write_text(text)
    return path


def json_safe(obj):
    """obj with numpy scalars and arrays replaced by plain Python values."""
    return json.loads(json.dumps(obj, default=_json_default))


def _json_default(o):
    if isinstance(o, np.integer):
        return int(o)
    if isinstance(o, np.floating):
        return float(o)
    if isinstance(o, np.ndarray):
        return o.tolist()
    raise TypeError(f"not JSON serialisable: {type(o).__name__}")


def load(path: str | Path) -> dict:
    """A report from disk, checked for the schema; ValueError with a clear message else."""
    try:
        raw = Path(path).read_bytes()
        doc = json.loads(gzip.decompress(raw) if raw[:2] == b"\x1f\x8b" else raw)
    except FileNotFoundError:
        raise ValueError(f"report file {path} does not exist") from None
    except IsADirectoryError:
        raise ValueError(f"report file {path} is a directory") from None
    except (json.JSONDecodeError, UnicodeDecodeError, OSError, EOFError) as e:
        raise ValueError(f"report file {path} is not JSON: {e}") from None
    if not isinstance(doc, dict) or doc.get("schema") != SCHEMA or not isinstance(
            doc.get("cells"), list):
        raise ValueError(f"report file {path} is not an {SCHEMA} report")
    return doc
