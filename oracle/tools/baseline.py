"""Committed baselines of the differential cells, one per device kind, and the gate.

``reports/baseline/<kind>.json.gz`` (kind: ``cpu``, ``h100``, ``h200``, ...) holds the oracle
report of the differential cells a plain ``pytest`` (CPU) or ``pytest -m gpu`` run checks on
that kind of device. Every pytest run writes its own report to ``out/last-run-<kind>.json``
(oracle/tools/pytest_gate.py); the gate compares the cells that run checked with the
baseline by ``oracle.core.diff``'s rules. ``python -m oracle baseline accept`` makes the last
run's report the new baseline: the only command that writes reports/baseline/.
"""

from __future__ import annotations

import re
from pathlib import Path

from oracle.core import diff, report
from oracle.impls.catalog import device_name

ROOT = report.ROOT
BASELINE_DIR = ROOT / "reports" / "baseline"
OUT_DIR = ROOT / "out"  # git-ignored: runs write here, never over a committed file


def device_kind(name: str | None = None) -> str:
    """The baseline kind of a device: ``cpu`` without CUDA, else the GPU's model from its
    name in lower case (``NVIDIA H100 80GB HBM3`` -> ``h100``), else the whole name made
    file-safe. ``name``: a CUDA device name (default: the current device's)."""
    if name is None:
        if device_name() == "cpu":
            return "cpu"
        import torch  # present: device_name() found a CUDA device through it

        name = torch.cuda.get_device_name()
    m = re.search(r"\b([A-Z]{1,2}\d{2,4}[A-Z]?)\b", name)
    if m:
        return m[1].lower()
    return re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-") or "unknown"


def baseline_path(kind: str, directory: Path = BASELINE_DIR) -> Path:
    """Compressed: a baseline is read by the gate, not by people (``baseline show``)."""
    return Path(directory) / f"{kind}.json.gz"


def last_run_path(kind: str, directory: Path = OUT_DIR) -> Path:
    return Path(directory) / f"last-run-{kind}.json"


def gate(run: dict, baseline_file: Path) -> tuple[str, bool]:
    """Markdown for a reviewer and whether the run is worse than the baseline on a cell it
    checked. Only the baseline's cells that the run checked are compared (a selection of
    tests is not a regression of the rest); the run's cells without a baseline are listed,
    not failed; no baseline file: said once, not failed."""
    baseline_file = Path(baseline_file)
    if not baseline_file.exists():
        return (f"No baseline {baseline_file} for this device kind: the run is not gated "
                f"(`python -m oracle baseline accept` makes one from this run).\n", False)
    base = report.load(baseline_file)
    ran = {diff.cell_key(c) for c in run["cells"]}
    base = {**base, "cells": [c for c in base["cells"] if diff.cell_key(c) in ran]}
    text, worse = diff.diff_reports(base, run)
    return f"Baseline: {baseline_file}\n\n{text}", worse


def accept(source: Path, kind: str, directory: Path = BASELINE_DIR,
           merge: bool = False) -> list[Path]:
    """Write the report ``source`` (a run's) as the baseline of ``kind``; ``merge``: replace
    only the cells the run checked, keep the others. A report
    without differential cells is refused (it would gate nothing)."""
    doc = report.load(source)
    if not doc["cells"]:
        raise ValueError(f"report {source} has no differential cells: run the differential "
                         "tests (pytest, or pytest -m gpu) before accepting a baseline")
    dest = baseline_path(kind, directory)
    if merge and dest.exists():
        ran = {diff.cell_key(c) for c in doc["cells"]}
        kept = [c for c in report.load(dest)["cells"] if diff.cell_key(c) not in ran]
        doc = {**doc, "cells": sorted(kept + doc["cells"], key=diff.cell_key)}
    return [report.write_json(doc, dest)]
