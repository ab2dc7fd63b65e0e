"""``oracle VERB`` (or ``python -m oracle VERB``): the command line of the framework.

Errors in the user's input print one line and exit 2, never a traceback; a run that checks
nothing says so and exits 1. ``oracle VERB --help`` lists a verb's options, with the valid op
and implementation names where it takes them.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

from oracle.impls.catalog import device_name


def _split(value, flag: str):
    """A comma-separated option's names; None when the option is absent. Given but empty
    (``--ops ,``) is an error, never "every name"."""
    if value is None:
        return None
    names = [v.strip() for v in value.split(",") if v.strip()]
    if not names:
        raise ValueError(f"--{flag} must name at least one entry, got {value!r}")
    return names


def _names(flag: str, value, valid):
    """The names a comma-separated option ``--flag`` gives, each one of ``valid``; None
    when the option is absent."""
    values = _split(value, flag)
    bad = [v for v in values or [] if v not in valid]
    if bad:
        raise ValueError(f"{flag} must be among {list(valid)}, got {bad}")
    return values


# ------------------------------------------------------------------------------ verbs


def cmd_conformance(args) -> int:
    import torch

    from oracle.tools import conformance

    if args.out:
        _check_writable(Path(args.out).with_suffix(".json"), "--out")
    t0 = time.perf_counter()
    sets = {s: conformance.source_set(s) for s in conformance.SOURCE_DTYPES}
    rows = conformance.reference_rows(sets)
    trows = conformance.torch_rows(sets)
    text = conformance.summary_markdown(rows, trows, torch.__version__)
    print(text)
    failures = sum(r.mismatches for r in rows)
    print(f"\n{len(rows)} reference rows, {failures} mismatches; {time.perf_counter() - t0:.1f} s")
    if args.out:
        import json

        out = Path(args.out)
        doc = {"schema": "conformance/1", "torch": torch.__version__,
               "reference": [r.__dict__ for r in rows],
               "torch_casts": [dict(r.__dict__, policy=r.policy) for r in trows]}
        out.with_suffix(".json").write_text(json.dumps(doc, indent=1))
        out.with_suffix(".md").write_text(text + "\n")
        print(f"wrote {out.with_suffix('.json')} and {out.with_suffix('.md')}")
    return 1 if failures else 0


def cmd_report(args) -> int:
    from oracle.core import render, report
    from oracle.core.cases import OPS, SHAPE_CLASSES
    from oracle.core.registry import known_names
    from oracle.tools import baseline
    from reference.platforms import PLATFORMS

    ops = _names("ops", args.ops, OPS) or list(OPS)
    platforms = _names("platforms", args.platforms, PLATFORMS) or list(PLATFORMS)
    impls = _names("impls", args.impls, sorted(known_names()))
    device = device_name()
    default_classes = ["tiny", "small", "model"] if device == "cuda" else ["tiny", "small"]
    classes = _names("shape-classes", args.shape_classes, SHAPE_CLASSES) or default_classes
    cases = report.default_cases(ops, platforms, classes, args.budget)
    if not _claimed(cases, impls, device):
        among = f"among {','.join(impls)} " if impls else ""
        print(f"error: nothing to check: no implementation {among}that runs on {device} "
              f"claims any of the {len(cases)} cases of ops {','.join(ops)}",
              file=sys.stderr)
        return 1
    out = Path(args.out or baseline.OUT_DIR / baseline.device_kind())
    _check_writable(out.with_suffix(".json"), "--out")
    print(f"{len(cases)} cases on {device}: ops {','.join(ops)}; platforms "
          f"{','.join(platforms)}; shape classes {','.join(classes)}", flush=True)
    doc = report.run_report(cases, impls, device=device, progress=not args.quiet)
    path = report.write_json(doc, out.with_suffix(".json"))
    files = [path, *render.render(doc, out)]
    print(_summary_table(doc))
    print("wrote " + ", ".join(str(f) for f in files))
    return 1 if doc["failures"] else 0


def _claimed(cases, impl_names, device: str) -> int:
    """How many (case, implementation) checks a report over ``cases`` would run."""
    from oracle.core.registry import implementations

    return sum(impl.supports(case)[0] for case in cases
               for impl in implementations(case.op, impl_names, device))


def _check_writable(path: Path, flag: str) -> None:
    """ValueError naming ``flag`` unless ``path`` (a file; its folders are made) can be
    written: checked before the work, so a long run never ends in an unwritable path."""
    existed = path.exists()
    if path.is_dir():
        raise ValueError(f"{flag} {path} is a directory, expected a file path")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(path, "a"):
            pass
    except OSError as e:
        raise ValueError(f"{flag} {path} is not writable: {e.strerror}") from None
    if not existed:
        path.unlink()


def _summary_table(doc) -> str:
    from collections import defaultdict

    agg = defaultdict(lambda: [0, 0, 0, 0.0])
    for c in doc["cells"]:
        a = agg[(c["op"], c["impl"])]
        a[0] += c["cases"]
        a[1] += c["passed"]
        a[2] += c["violations"]
        a[3] = max(a[3], c["max_err_over_bound"])
    lines = ["", "| op | impl | cases | passed | violations | max err/bound |",
             "|---|---|---:|---:|---:|---:|"]
    lines += [f"| {op} | {impl} | {a[0]} | {a[1]} | {a[2]} | {a[3]:.3g} |"
              for (op, impl), a in sorted(agg.items())]
    return "\n".join(lines)


#: The run reports other than the tolerance report: schema -> module with ``markdown``.
RUN_REPORTS = {"fuzz/1": "oracle.tools.fuzz", "mutants/1": "oracle.tools.mutants",
               "false-alarms/1": "oracle.tools.falsealarm", "scaleout/1": "oracle.tools.suite"}


def cmd_render(args) -> int:
    import importlib
    import json

    from oracle.core import render, report

    if Path(args.report).is_dir():
        raise ValueError(f"report file {args.report} is a directory: name a report JSON")
    out = Path(args.out) if args.out else Path(args.report).with_suffix("")
    _check_writable(out.with_name(out.name + ".md"), "--out")
    try:  # a GPU run's fuzz / mutants / false-alarm JSON: its Markdown beside it
        schema = json.loads(Path(args.report).read_text()).get("schema")
    except (OSError, ValueError, AttributeError):
        schema = None
    if schema in RUN_REPORTS:
        doc = json.loads(Path(args.report).read_text())
        md = out.with_name(out.name + ".md")
        md.write_text(importlib.import_module(RUN_REPORTS[schema]).markdown(doc))
        print(f"wrote {md}")
        return 0
    doc = report.load(args.report)
    print("wrote " + ", ".join(str(p) for p in render.render(doc, out)))
    return 0


def cmd_diff(args) -> int:
    from oracle.core import diff, report

    text, worse = diff.diff_reports(report.load(args.old), report.load(args.new))
    print(text)
    return 1 if worse else 0


def cmd_baseline(args) -> int:
    from oracle.core import report
    from oracle.tools import baseline

    kind = args.kind or baseline.device_kind()
    source = Path(args.report or baseline.last_run_path(kind))
    directory = args.dir or baseline.BASELINE_DIR
    target = baseline.baseline_path(kind, directory)
    if args.action == "accept":
        written = baseline.accept(source, kind, directory, merge=args.merge)
        print("wrote " + ", ".join(str(p) for p in written))
        return 0
    if args.action == "show":
        doc = report.load(target)
        m = doc["machine"]
        print(f"{target}: {len(doc['cells'])} cells, {doc['cases']} cases, made "
              f"{doc['created']} on {m.get('device')} at commit {m.get('commit')}"
              f"{' (dirty tree)' if m.get('dirty') else ''}")
        print(_summary_table(doc))
        return 0
    text, worse = baseline.gate(report.load(source), target)
    print(text)
    return 1 if worse else 0


def cmd_replay(args) -> int:
    from oracle.core.cases import Case, input_hash, make_inputs
    from oracle.core.checks import run_check
    from oracle.core.registry import implementations

    case = Case.from_id(args.case)
    x = make_inputs(case)
    print(f"case {case.id}\ninput hash {input_hash(x)}")
    if args.hash and args.hash != input_hash(x):
        print(f"input hash differs from the recorded {args.hash}: not the same inputs")
        return 1
    if args.impl and args.impl.startswith("mutant:"):  # printed by the kill matrix
        impls = [_mutant(args.impl.split(":", 1)[1]).implementation(device_name())]
    else:
        impls = implementations(case.op, [args.impl] if args.impl else None, device_name())
    failed = 0
    for impl in impls:
        ok, why = impl.supports(case)
        if not ok:
            print(f"{impl.name}: does not claim this case ({why})")
            continue
        r = run_check(case, impl, x)
        print(r.summary())
        failed += not r.passed
    return 1 if failed else 0


def cmd_fuzz(args) -> int:
    from oracle.core.cases import OPS, SHAPE_CLASSES
    from oracle.core.registry import implementations, known_names
    from oracle.tools import fuzz

    seconds = args.seconds if args.minutes is None else 60.0 * args.minutes
    ops = _names("ops", args.ops, OPS) or list(OPS)
    impls = _names("impls", args.impls, sorted(known_names()))
    classes = (_names("shape-classes", args.shape_classes, SHAPE_CLASSES)
               or list(fuzz.DEFAULT_SHAPE_CLASSES))
    warmup = fuzz.check_budget(seconds, args.warmup)
    if args.report:
        _check_writable(Path(args.report), "--report")
    device = device_name()
    impls = impls or fuzz.default_impls(device)
    salt = args.config_salt if args.config_salt is not None else \
        int.from_bytes(os.urandom(3), "little")
    gpus = int(os.environ.get("ORACLE_GPUS", "0"))
    size, pin = fuzz.default_configs(device, args.configs, args.pin_formats)
    configs = fuzz.config_pool(size, salt)
    if configs:
        print(f"shape configs {configs[0]}..{configs[-1]} (--configs {size} "
              f"--config-salt {salt}{' --pin-formats' if pin else ''})")
    t0 = time.monotonic()
    stats = fuzz.run_workers(args.workers, seconds=seconds, ops=ops, impls=impls,
                             out_dir=Path(args.out), device=device,
                             db=fuzz.DEFAULT_DB if args.db is None else
                             None if args.db == "none" else Path(args.db),
                             gpus=gpus, shape_classes=classes, shrink=not args.no_shrink,
                             configs=configs, pin_formats=pin)
    wall = time.monotonic() - t0
    if args.report:
        names = sorted({i.name for op in ops for i in implementations(op, impls, device)})
        doc = fuzz.report(stats, seconds=seconds, warmup=warmup, ops=ops, impls=names,
                          shape_classes=classes, device=device, wall_s=wall,
                          configs=list(configs) if configs else None,
                          pin_formats=pin, gpus=gpus)
        path = fuzz.write_report(doc, args.report)
        print(fuzz.markdown(doc))
        print(f"wrote {path}")
    return 1 if any(s["failure"] for s in stats) else 0


def _mutant(name: str):
    from oracle.tools.mutants import catalog

    known = catalog()
    if name not in known:
        raise ValueError(f"mutant must be among {sorted(known)}, got {name!r}")
    return known[name]


def cmd_mutants(args) -> int:
    import json

    from oracle.core.report import write_json
    from oracle.tools import mutants

    known = mutants.catalog()
    if args.list:
        for m in known.values():
            print(f"{m.name:32s} {m.op:18s} {m.bug}: {m.incident}")
        return 0
    if args.merge:
        _check_writable(Path(args.out or "reports/mutants-merged.json"), "--out")
        doc = mutants.merge([json.loads(Path(p).read_text()) for p in args.merge], list(known))
        out = Path(args.out or "reports/mutants-merged.json")
        write_json(doc, out)
        out.with_suffix(".md").write_text(mutants.markdown(doc))
        print(f"wrote {out}, {out.with_suffix('.md')}")
        return 0
    chosen = [_mutant(n) for n in _split(args.mutants, "mutants")] if args.mutants else list(
        known.values())
    gpu = device_name() == "cuda"
    out = Path(args.out or f"reports/mutants-{'h200' if gpu else 'cpu'}.json")
    _check_writable(out, "--out")
    # Written after every mutant: a run stopped by a time limit keeps its finished rows.
    doc = mutants.kill_matrix(chosen, gpu=gpu, fuzz_seconds=args.fuzz_seconds,
                              full=args.full, partial=lambda d: write_json(d, out))
    write_json(doc, out)
    text = mutants.markdown(doc)
    out.with_suffix(".md").write_text(text)
    print(text)
    print(f"wrote {out}, {out.with_suffix('.md')}")
    return 1 if doc["survivors"] or doc["errors"] else 0


def cmd_falsealarm(args) -> int:
    import json

    from oracle.core.cases import OPS, SHAPE_CLASSES
    from oracle.core.registry import known_names
    from oracle.tools import falsealarm

    if args.merge:
        _check_writable(Path(args.out or "reports/false-alarms-merged.json"), "--out")
        doc = falsealarm.merge([json.loads(Path(p).read_text()) for p in args.merge])
        return _write_falsealarm(doc, Path(args.out or "reports/false-alarms-merged.json"))
    ops = _names("ops", args.ops, OPS) or list(OPS)
    impls = _names("impls", args.impls, sorted(known_names()))
    classes = _names("shape-classes", args.shape_classes, SHAPE_CLASSES) or ["tiny", "small"]
    device = device_name()
    out = Path(args.out or f"reports/false-alarms-{'h200' if device == 'cuda' else 'cpu'}.json")
    _check_writable(out, "--out")
    from oracle.tools.fuzz import default_impls

    # As a fuzz run: random shapes, so on CUDA the per-shape compiled flex baseline is
    # left out unless named.
    doc = falsealarm.run(ops, args.cases, args.seed, classes, impls or default_impls(device),
                         device, args.workers, args.seconds,
                         gpus=int(os.environ.get("ORACLE_GPUS", "0")), configs=args.configs)
    return _write_falsealarm(doc, out)


def _write_falsealarm(doc: dict, out: Path) -> int:
    from oracle.core.report import write_json
    from oracle.tools import falsealarm

    write_json(doc, out)
    text = falsealarm.markdown(doc)
    out.with_suffix(".md").write_text(text)
    print(text)
    print(f"wrote {out}, {out.with_suffix('.md')}")
    return 1 if doc["failures"] else 0


def cmd_scaleout(args) -> int:
    from oracle.core.report import write_json
    from oracle.tools import suite

    _check_writable(Path(args.out), "--out")
    doc = suite.scaleout(args.runs, args.subset, args.warm)
    path = write_json(doc, args.out)
    md = Path(path).with_suffix(".md")
    md.write_text(suite.markdown(doc))
    print(suite.markdown(doc) + f"wrote {path}, {md}")
    return 0


def cmd_suite_merge(args) -> int:
    from oracle.core.report import load, write_json
    from oracle.tools import suite

    _check_writable(Path(args.out), "--out")
    doc = suite.merge([load(p) for p in args.parts])
    path = write_json(doc, args.out)
    s = doc["suite"]
    print(f"{len(args.parts)} parts, {s['outcomes']}, {s['wall_seconds']} s: wrote {path}")
    return 1 if s["failed"] else 0


def cmd_e2e(args) -> int:
    from oracle.tools import e2e

    modes = _names("modes", args.modes, e2e.MODES) or list(e2e.MODES)
    dists = _names("dists", args.dists, e2e.DISTS) or list(e2e.DISTS)
    size = "tiny" if args.tiny else "quick" if args.quick else "default"
    device = device_name()
    # The reference's own implementations run on the CPU: their report keeps its old name.
    stem = ("e2e-accuracy-cpu" if args.impl == "reference"
            else f"e2e-accuracy-{args.impl}-{device}")
    out = args.out or f"reports/{stem}{'' if size == 'default' else '-' + size}.json"
    _check_writable(Path(out), "--out")
    doc = e2e.run(quick=args.quick, seed=args.seed, modes=modes, dists=dists,
                  progress=not args.quiet, impl=args.impl, config=e2e.CONFIGS[size],
                  workers=args.workers, device=device)
    paths = e2e.write(doc, out)
    print(e2e.markdown(doc))
    print("wrote " + ", ".join(str(p) for p in paths))
    return 0


# ------------------------------------------------------------------------------- parser


class _VerbParser(argparse.ArgumentParser):
    """A verb's parser; ``lists_names``: its help ends with the valid op and implementation
    names, looked up only when the help is shown (loading the registry takes seconds)."""

    lists_names = False

    def format_help(self) -> str:
        text = super().format_help()
        if not self.lists_names:
            return text
        from oracle.core.cases import OPS
        from oracle.core.registry import known_names
        from reference.platforms import PLATFORMS

        _load_implementations()
        return text + (f"\nops: {', '.join(OPS)}\nimplementations: "
                       f"{', '.join(sorted(known_names()))}\nplatforms: {', '.join(PLATFORMS)}\n")


#: Every numeric option's valid range, one entry per destination (the same name means the
#: same thing in every verb): dest -> (lowest value, whether the lowest itself is allowed).
NUMBER_BOUNDS = {
    "budget": (1, True), "workers": (1, True), "cases": (1, True), "seconds": (0, False),
    "minutes": (0, False), "fuzz_seconds": (0, True), "configs": (0, True),
    "config_salt": (0, True), "seed": (0, True), "warmup": (0, True),
}


def check_numbers(args) -> None:
    """ValueError naming the first numeric option outside its range (``NUMBER_BOUNDS``)."""
    for dest, (low, inclusive) in NUMBER_BOUNDS.items():
        value = getattr(args, dest, None)
        if value is None or (value >= low if inclusive else value > low):
            continue
        raise ValueError(f"--{dest.replace('_', '-')} must be {'>=' if inclusive else '>'} "
                         f"{low}, got {value:g}")


def cmd_impls(args) -> int:
    from oracle.impls.catalog import table

    print(table(device_name()))
    return 0


#: The verbs that work on files alone: no kernel is imported for them.
FILE_VERBS = ("render", "diff", "baseline", "conformance", "scaleout", "suite-merge")


def _load_implementations() -> None:
    """Interpret the kernels where no GPU is (before any kernel module is imported), then
    register every implementation."""
    import kernels
    from oracle.impls.catalog import load_all

    kernels.use_interpreter_without_gpu()
    load_all()


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="oracle", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog=__doc__.split("\n\n", 1)[1])
    sub = p.add_subparsers(dest="verb", title="verbs", metavar="VERB",
                           parser_class=_VerbParser)
    for add in (_add_report, _add_render, _add_diff, _add_baseline, _add_replay, _add_fuzz,
                _add_conformance, _add_e2e, _add_mutants, _add_falsealarm, _add_scaleout,
                _add_suite_merge, _add_impls):
        add(sub)
    for verb in ("report", "fuzz", "falsealarm", "replay", "e2e"):
        sub.choices[verb].lists_names = True
    return p


def _add_report(sub) -> None:
    s = sub.add_parser("report", help="the tolerance report on the default case set")
    s.add_argument("--ops", help="comma-separated ops (default: all)")
    s.add_argument("--impls", help="comma-separated implementation names (default: all)")
    s.add_argument("--platforms", help="comma-separated platforms (default: all three)")
    s.add_argument("--shape-classes", help="tiny,small[,model] (default: model on CUDA only)")
    s.add_argument("--budget", type=int, default=1, help="seeds per cell (default 1)")
    s.add_argument("--out", help="output prefix (default out/KIND: out/cpu, out/h100...; "
                   "never a committed report)")
    s.add_argument("--quiet", action="store_true", help="no progress bar")
    s.set_defaults(func=cmd_report)


def _add_render(sub) -> None:
    s = sub.add_parser("render", help="Markdown and PNG from a report JSON (also Markdown "
                       "from a fuzz, mutants or false-alarm JSON)")
    s.add_argument("report")
    s.add_argument("--out", help="output prefix (default: the report's path without .json)")
    s.set_defaults(func=cmd_render)


def _add_diff(sub) -> None:
    s = sub.add_parser("diff", help="flag cells whose numerics got worse; exit 1 if any")
    s.add_argument("old")
    s.add_argument("new")
    s.set_defaults(func=cmd_diff)


def _add_baseline(sub) -> None:
    s = sub.add_parser("baseline", help="the differential cells' baseline per device kind: "
                       "accept the last run's report, show it, or diff the last run with it")
    s.add_argument("action", choices=("accept", "show", "diff"))
    s.add_argument("--kind", help="device kind (default: this machine's: cpu, h100, h200...)")
    s.add_argument("--report", help="the run's report (default out/last-run-KIND.json, "
                   "written by every pytest run)")
    s.add_argument("--dir", type=Path, default=None, help="baseline directory (default "
                   "reports/baseline)")
    s.add_argument("--merge", action="store_true", help="accept: replace only the cells the "
                   "run checked, keep the baseline's others")
    s.set_defaults(func=cmd_baseline)


def _add_impls(sub) -> None:
    s = sub.add_parser("impls", help="every implementation: claims, and why it cannot run here")
    s.set_defaults(func=cmd_impls)


def _add_replay(sub) -> None:
    s = sub.add_parser("replay", help="re-run one case by its id")
    s.add_argument("case", help="op:shape_class:dist:platform:kv_cache_dtype:model_dtype:"
                                "scales:seed[:c<shape config>]")
    s.add_argument("--impl", help="only this implementation")
    s.add_argument("--hash", help="the input hash recorded with the failure, to verify")
    s.set_defaults(func=cmd_replay)


def _add_fuzz(sub) -> None:
    s = sub.add_parser("fuzz", help="hypothesis search for failing cases")
    s.add_argument("--seconds", type=float, default=60.0, help="time budget")
    s.add_argument("--minutes", type=float, help="time budget in minutes (overrides --seconds)")
    s.add_argument("--workers", type=int, default=1, help="processes fuzzing at once (with "
                   "ORACLE_GPUS=N, worker i on GPU i mod N)")
    s.add_argument("--db", help="hypothesis example database folder (default "
                   ".hypothesis/oracle-fuzz; failing examples are replayed first next "
                   "time); 'none': no database")
    s.add_argument("--ops", help="comma-separated ops (default: all)")
    s.add_argument("--impls", help="comma-separated implementation names (default: all; on "
                   "CUDA all but flex, which Inductor compiles for every new shape)")
    s.add_argument("--shape-classes", help="comma-separated shape classes drawn (default "
                   "tiny,small)")
    s.add_argument("--configs", type=int, help="shape configs per run: every case takes "
                   "its shapes from one of N configs (Case.config), so cases share compiled "
                   "kernels; 0: every case its own shapes (default: 0 on the CPU; on CUDA "
                   "oracle.tools.fuzz.CUDA_CONFIGS with --pin-formats, a new pool each run)")
    s.add_argument("--config-salt", type=int, help="picks the run's configs (default: "
                   "random, printed)")
    s.add_argument("--pin-formats", action="store_true", help="with --configs: each config "
                   "fixes the platform, cache dtype, model dtype and scale kind too "
                   "(oracle.core.cases.config_formats), so a warm-up compiles every variant the "
                   "run meets; values, distributions and seeds stay free")
    s.add_argument("--out", default="fuzz-failures", help="folder for shrunk failing cases")
    s.add_argument("--no-shrink", action="store_true", help="report a failing case as "
                   "drawn (hypothesis may spend minutes shrinking it)")
    s.add_argument("--report", help="write a fuzz/1 JSON here: counts per op, shape class "
                   "and implementation, the failure, cases per second after the warm-up")
    s.add_argument("--warmup", type=float, help="seconds from each worker's start not "
                   "counted in the throughput after warm-up (default 20%% of the budget)")
    s.set_defaults(func=cmd_fuzz)


def _add_conformance(sub) -> None:
    s = sub.add_parser("conformance", help="fp8 codec vs ml_dtypes; torch's cast policies")
    s.add_argument("--out", help="write OUT.json and OUT.md")
    s.set_defaults(func=cmd_conformance)


def _add_e2e(sub) -> None:
    s = sub.add_parser("e2e", help="end-to-end accuracy cost of each KV cache format, the "
                       "reference pipeline beside a registered implementation's")
    s.add_argument("--impl", default="reference",
                   help="the registered implementations (this name's insert, indexer and "
                        "attention) whose pipeline runs beside the float64 reference's "
                        "(default reference: its own ops, the plumbing check); e.g. triton")
    size = s.add_mutually_exclusive_group()
    size.add_argument("--quick", action="store_true", help="small shapes (seconds with the "
                      "reference; minutes with interpreted kernels)")
    size.add_argument("--tiny", action="store_true", help="interpreter-sized shapes (shape "
                      "class tiny, which every implementation claims)")
    s.add_argument("--modes", help="comma-separated: prefill,decode (default both)")
    s.add_argument("--dists", help="comma-separated distributions (default all four)")
    s.add_argument("--workers", type=int, default=1, help="processes, one (mode, "
                   "distribution) each at a time (default 1)")
    s.add_argument("--out", help="OUT.json, with OUT.md beside it (default "
                   "reports/e2e-accuracy-cpu.json for --impl reference, else "
                   "reports/e2e-accuracy-IMPL-DEVICE.json; -quick / -tiny appended)")
    s.add_argument("--seed", type=int, default=0, help="input seed (default 0)")
    s.add_argument("--quiet", action="store_true", help="no per-row progress on stderr")
    s.set_defaults(func=cmd_e2e)


def _add_mutants(sub) -> None:
    s = sub.add_parser("mutants", help="the mutant catalog against the standard budget: "
                       "the kill matrix")
    s.add_argument("--mutants", help="comma-separated names (default: the whole catalog)")
    s.add_argument("--list", action="store_true", help="print the catalog and exit")
    s.add_argument("--configs", type=int, default=0, help="shape configs per op (each "
                   "case's shapes from one of N, chosen by --seed; cases share compiled "
                   "kernels); 0 (default): every case its own shapes")
    s.add_argument("--merge", nargs="+", metavar="JSON", help="merge the reports of runs "
                   "over parts of the catalog into one (--out) instead of running")
    s.add_argument("--fuzz-seconds", type=float, default=60.0, help="budget of the fuzz "
                   "class per mutant (default 60)")
    s.add_argument("--full", action="store_true", help="run every test class (default: a "
                   "mutant stops at its first kill)")
    s.add_argument("--out", help="OUT.json, with OUT.md beside it (default "
                   "reports/mutants-cpu.json, reports/mutants-h200.json on CUDA)")
    s.set_defaults(func=cmd_mutants)


def _add_falsealarm(sub) -> None:
    s = sub.add_parser("falsealarm", help="clean randomized cases: failures and the "
                       "calibration of the reported-only statistics")
    s.add_argument("--cases", type=int, default=2000, help="cases per op (default 2000)")
    s.add_argument("--ops", help="comma-separated ops (default all)")
    s.add_argument("--impls", help="comma-separated implementations (default all; on "
                   "CUDA all but flex, as fuzz)")
    s.add_argument("--shape-classes", help="comma-separated (default tiny,small)")
    s.add_argument("--seed", type=int, default=0, help="draws the cases (default 0)")
    s.add_argument("--workers", type=int, default=1, help="processes (default 1)")
    s.add_argument("--seconds", type=float, help="time budget: cases not started by then "
                   "are left out, the report says how many ran (default: none)")
    s.add_argument("--out", help="OUT.json, with OUT.md beside it (default "
                   "reports/false-alarms-cpu.json, -h200 on CUDA)")
    s.add_argument("--configs", type=int, default=0, help="shape configs per op (each "
                   "case's shapes from one of N, chosen by --seed; cases share compiled "
                   "kernels); 0 (default): every case its own shapes")
    s.add_argument("--merge", nargs="+", metavar="JSON", help="join runs over disjoint "
                   "--ops into one report (default out: reports/false-alarms-merged.json)")
    s.set_defaults(func=cmd_falsealarm)


def _add_scaleout(sub) -> None:
    s = sub.add_parser("scaleout", help="one scale-out report (JSON and Markdown) from the "
                       "suite reports of .ci/gpu scaleout")
    s.add_argument("runs", nargs="+", help="scaleout-W-G.json suite reports (W workers on "
                   "G GPUs; scaleout-1-1.json, the baseline, among them)")
    s.add_argument("--subset", required=True, help="the tests the runs ran (SCALE_K)")
    s.add_argument("--warm", required=True, help="how Triton's cache was filled first")
    s.add_argument("--out", default="reports/scaleout-h200x2.json", help="OUT.json, with "
                   "OUT.md beside it (default reports/scaleout-h200x2.json)")
    s.set_defaults(func=cmd_scaleout)


def _add_suite_merge(sub) -> None:
    s = sub.add_parser("suite-merge", help="one suite report from the parts of a suite run "
                       "split over device calls (.ci/gpu suite with SUITE_PART)")
    s.add_argument("parts", nargs="+", help="the parts' suite.json reports")
    s.add_argument("--out", required=True, help="the joined report (e.g. "
                   "reports/suite-h200.json; render it with python -m oracle render)")
    s.set_defaults(func=cmd_suite_merge)


def main(argv=None) -> int:
    parser = build_parser()
    argv = sys.argv[1:] if argv is None else argv
    if not argv:  # never a long run by accident: the verbs, and exit 2 as for a usage error
        parser.print_help()
        return 2
    args = parser.parse_args(argv)
    try:
        check_numbers(args)
        if args.verb not in FILE_VERBS:
            _load_implementations()
        return args.func(args)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except OSError as e:  # a path named on the command line: a folder, no permission
        print(f"error: {e.filename}: {e.strerror}", file=sys.stderr)
        return 2
