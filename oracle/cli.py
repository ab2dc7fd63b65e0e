"""``python -m oracle VERB``: the command line of the framework.

Verbs: ``report`` (the main job: today the fp8 conformance summary) and ``conformance``.
Errors in the user's input print one line and exit 2, never a traceback.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path


def _conformance(args) -> int:
    import torch

    from oracle import conformance

    t0 = time.perf_counter()
    sets = {s: conformance.source_set(s) for s in conformance.SOURCE_DTYPES}
    rows = conformance.reference_rows(sets)
    trows = conformance.torch_rows(sets)
    text = conformance.summary_markdown(rows, trows, torch.__version__)
    print(text)
    failures = sum(r.mismatches for r in rows)
    print(f"\n{len(rows)} reference rows, {failures} mismatches; {time.perf_counter() - t0:.1f} s")
    if args.out:
        out = Path(args.out)
        out.parent.mkdir(parents=True, exist_ok=True)
        doc = {
            "schema": "conformance/1",
            "torch": torch.__version__,
            "reference": [r.__dict__ for r in rows],
            "torch_casts": [dict(r.__dict__, policy=r.policy) for r in trows],
        }
        out.with_suffix(".json").write_text(json.dumps(doc, indent=1))
        out.with_suffix(".md").write_text(text + "\n")
        print(f"wrote {out.with_suffix('.json')} and {out.with_suffix('.md')}")
    return 1 if failures else 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m oracle", description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="verb")
    for verb, help_ in (
        ("report", "the main job: conformance summary (grows into the tolerance report)"),
        ("conformance", "fp8 codec vs ml_dtypes, and which policy torch's casts follow"),
    ):
        s = sub.add_parser(verb, help=help_, description=help_)
        s.add_argument("--out", help="write OUT.json and OUT.md (e.g. reports/conformance)")
        s.set_defaults(func=_conformance)
    return p


def main(argv=None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.verb is None:
        args = parser.parse_args(["report", *(argv or sys.argv[1:])])
    try:
        return args.func(args)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
