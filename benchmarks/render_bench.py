"""Render a ``bench/1`` benchmark report (JSON) as a Markdown table; CPU-only, no torch.

Every number in the table is derived here from the report's raw measurements (each
result's ``median_us`` and ``min_bytes``, the run's copy bandwidth, the medians of the
named baselines), not copied from the derived fields the GPU run also stored, so a
hand-made or edited report renders consistently. ``derive`` is the one implementation of
that arithmetic: benchmarks/bench_insert.py calls it to fill the JSON's derived fields.

Per result: GB/s = min_bytes / median; % of copy BW = that over the measured
device-to-device copy bandwidth (bytes read + written per second); "x vs B" = B's median
over this result's (a speedup; baselines are looked up by name among the results of the
same cache and op); a result's ``targets`` (``{"copy_fraction": 0.8, "torch_compiled": 5}``:
a minimum fraction of copy bandwidth, minimum speedups vs named baselines) give "target
met" yes/no; results without targets show "-".

A report whose benchmark has a table of its own (``OWN_TABLES``, by the op of its results:
bench_attention_prefill's and bench_attention_decode's, with their own derived numbers;
bench_indexer's, with its for-scale numbers and knob sweep) is
rendered by that benchmark's ``markdown`` (``render``; importing it needs torch, still no
GPU).

Run: ``python benchmarks/render_bench.py [reports/bench.json] [--out reports/bench.md]``.
"""

from __future__ import annotations

import argparse
import importlib
import json
import sys
from pathlib import Path

SCHEMA = "bench/1"
COLUMNS = ("kernel", "cache", "mode", "median (us)", "GB/s", "% of copy BW",
           "x vs compiled", "x vs eager", "target met")
# Table columns "x vs compiled" / "x vs eager" read these baselines.
COMPILED, EAGER = "torch_compiled", "torch_eager"
# Benchmarks rendering their own table (a module with ``markdown(doc)``), by their results' op.
OWN_TABLES = {"attention_prefill": "benchmarks.bench_attention_prefill",
              "attention_decode": "benchmarks.bench_attention_decode",
              "indexer_decode": "benchmarks.bench_indexer"}


def _same_group(a: dict, b: dict) -> bool:
    return a.get("cache") == b.get("cache") and a.get("op") == b.get("op")


def _ratio(num, den):
    return None if num is None or not den else num / den


def _target_met(targets: dict, copy_fraction, ratios: dict):
    """All targets met (True/False), or None when there are none."""
    if not targets:
        return None
    got = {"copy_fraction": copy_fraction, **ratios}
    return all(got.get(k) is not None and got[k] >= v for k, v in targets.items())


def derive_one(result: dict, results: list[dict], copy_bps: float) -> dict:
    """Derived numbers of one result (None where its time or a baseline is missing)."""
    us = result.get("median_us")
    bps = None if us is None else result["min_bytes"] / (us * 1e-6)
    ratios = {}
    for name in result.get("baselines", ()):
        base = next((r for r in results if r["name"] == name and _same_group(r, result)), None)
        ratios[name] = _ratio(base and base.get("median_us"), us)
    frac = _ratio(bps, copy_bps)
    return {"bytes_per_s": bps, "copy_fraction": frac, "ratios": ratios,
            "target_met": _target_met(result.get("targets"), frac, ratios)}


def derive(doc: dict) -> list[dict]:
    """Derived numbers of every result of a report, in order."""
    results = doc["results"]
    copy_bps = doc["copy"]["bytes_per_s"]
    return [derive_one(r, results, copy_bps) for r in results]


def _fmt(value, spec: str, suffix: str = "") -> str:
    return "-" if value is None else f"{value:{spec}}{suffix}"


def knob_label(knobs: dict | None) -> str:
    """A result's launch knobs as ``k=v,k=v`` (sorted; '' for none): the inverse of
    harness.parse_knobs, naming a sweep's column or a row across A/B runs."""
    return ",".join(f"{k}={v}" for k, v in sorted((knobs or {}).items()))


def _yes_no(flag) -> str:
    return "-" if flag is None else ("yes" if flag else "no")


def table_row(r: dict, d: dict) -> str:
    gbps = None if d["bytes_per_s"] is None else d["bytes_per_s"] / 1e9
    pct = None if d["copy_fraction"] is None else 100 * d["copy_fraction"]
    mode = r.get("mode", "?") if r.get("median_us") is not None else f"error: {r.get('note')}"
    cells = (r["name"], r.get("cache", "-"), mode, _fmt(r.get("median_us"), ".1f"),
             _fmt(gbps, ".0f"), _fmt(pct, ".1f", "%"),
             _fmt(d["ratios"].get(COMPILED), ".2f", "x"), _fmt(d["ratios"].get(EAGER), ".2f", "x"),
             _yes_no(d["target_met"]))
    return "| " + " | ".join(cells) + " |"


def header(doc: dict) -> list[str]:
    c = doc["copy"]
    lines = [f"# Benchmark: {doc.get('what', 'kernels')}", "",
             f"Device {doc.get('device', '?')}; torch {doc.get('torch', '?')}, "
             f"triton {doc.get('triton', '?')}; {doc.get('tokens', '?')} tokens. "
             f"Copy bandwidth (eager device-to-device copy of {c['bytes'] / 2**30:.2f} GiB, "
             f"bytes read + written): {c['bytes_per_s'] / 1e12:.2f} TB/s.", ""]
    if doc.get("timing", {}).get("method"):
        lines[-1:] = [f"Timing: {doc['timing']['method']}.", ""]
    if doc.get("partial"):  # a run stopped by its time limit (harness.main)
        lines += [f"**Partial report: {doc['partial']}.**", ""]
    for note in doc.get("notes", ()):
        lines.append(f"- {note}")
    return lines + [""] if doc.get("notes") else lines


def markdown(doc: dict) -> str:
    if doc.get("schema") != SCHEMA:
        raise ValueError(f"schema must be {SCHEMA!r}, got {doc.get('schema')!r}")
    lines = header(doc)
    lines.append("| " + " | ".join(COLUMNS) + " |")
    lines.append("|---|---|---|" + "---:|" * 5 + "---|")
    for r, d in zip(doc["results"], derive(doc)):
        lines.append(table_row(r, d))
    lines += ["", "GB/s counts the minimal bytes (every input byte read once, every output "
              "byte written once); x vs B = B's median / this median; targets apply to the "
              "rows that declare them."]
    return "\n".join(lines) + "\n"


def render(doc: dict) -> str:
    """The report's table: its benchmark's own (``OWN_TABLES``) or ``markdown``'s."""
    ops = {r.get("op") for r in doc.get("results", ())}
    module = OWN_TABLES.get(ops.pop()) if len(ops) == 1 else None
    if module is None:
        return markdown(doc)
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    return importlib.import_module(module).markdown(doc)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("json", nargs="?", default="reports/bench.json")
    ap.add_argument("--out", help="Markdown file (default: the JSON's name with .md)")
    args = ap.parse_args(argv)
    src = Path(args.json)
    text = render(json.loads(src.read_text()))
    out = Path(args.out) if args.out else src.with_suffix(".md")
    out.write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
