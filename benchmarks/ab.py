"""A/B timing: one benchmark run on a git revision's tree and on the working tree, in the
same GPU call, so a kernel change is judged against its base on the same machine, clocks
and copy bandwidth (medians drift by a few percent between calls; within one call they
do not).

1. CPU: ``python -m benchmarks.ab prepare REV`` writes REV's tree (reports/ left out) to
   ``.ab-base/`` (gitignored) and its commit to ``.ab-base/AB_REV``.
2. GPU: ``AB_BENCH=attention_decode AB_ARGS="--caches e4m3fnuz --batches 64"
   .ci/gpu ab`` with ``.ab-base`` in the device call's ``carry``, i.e. ``python -m
   benchmarks.ab run --bench NAME [--rounds N] -- ARGS``: per round the base tree's
   benchmark, then the working tree's, each with the same ARGS (the runs' own reports in
   a temporary directory: a device call brings back 8 files), and one ``ab/1`` JSON,
   ``$OUT/ab.json``: per run its copy bandwidth, source state and each row's median
   (results and ``--knobs`` sweep).
3. CPU: ``python -m benchmarks.ab render ab.json`` -> Markdown: per row the base and work
   medians (the median over rounds), work / base and the per-round ratios.

``prepare REV --build`` also builds the tree's csrc/ on the CPU (``python -m
kernels.cuda_build`` for the working tree): a tree that fails to build wastes a device call.
More candidates in one call (a device call's start costs minutes): ``prepare REV --dest
.ab-NAME`` writes another tree, and ``run ... --also NAME=.ab-NAME`` (``AB_ALSO`` in
``.ci/gpu ab``; carry the tree too) times it after the work tree in every round: its
medians and NAME / base join the table.

Rows are matched by (implementation, cache, batch, selection distribution, knobs); a row
only one side has shows '-' on the other.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

from benchmarks import render_bench
from benchmarks.render_bench import _fmt as _f

ROOT = Path(__file__).resolve().parents[1]
BASE_DIR = ".ab-base"
KEY_FIELDS = ("name", "cache", "batch", "dist")


def row_key(r: dict) -> str:
    """A benchmark row's identity across the two trees (its measured fields left out)."""
    parts = [f"{k}={r[k]}" for k in KEY_FIELDS if r.get(k) is not None]
    knobs = render_bench.knob_label(r.get("knobs"))
    return " ".join(parts + ([f"knobs={knobs}"] if knobs else []))


def medians(doc: dict) -> dict[str, float | None]:
    """row_key -> median us of a bench/1 report's results and sweep."""
    return {row_key(r): r.get("median_us") for r in doc.get("results", []) + doc.get("sweep", [])}


# ---------------------------------------------------------------------------- prepare


def check_build(tree: Path) -> None:
    """Build ``tree``'s csrc/ library with its own kernels/cuda_build.py (on the CPU: nvcc
    compiles sm_90 here), so that a tree that does not build is found before a device call
    spends minutes on it (a duplicate symbol at link time, for one)."""
    res = subprocess.run([sys.executable, "-m", "kernels.cuda_build"], cwd=tree,
                         env=dict(os.environ, PYTHONPATH=str(tree)), capture_output=True,
                         text=True)
    if res.returncode:
        raise SystemExit(f"{tree}: csrc/ does not build:\n{(res.stdout + res.stderr)[-3000:]}")


def prepare(rev: str, dest: Path = ROOT / BASE_DIR) -> str:
    """Write ``rev``'s tree without reports/ to ``dest`` (replacing it); returns the commit."""
    def git(*cmd, **kw):
        return subprocess.run(["git", *cmd], cwd=ROOT, check=True, capture_output=True, **kw)

    commit = git("rev-parse", "--verify", f"{rev}^{{commit}}", text=True).stdout.strip()
    shutil.rmtree(dest, ignore_errors=True)
    dest.mkdir(parents=True)
    with tempfile.TemporaryFile() as f:
        f.write(git("archive", commit, "--", ".", ":(exclude)reports").stdout)
        f.seek(0)
        with tarfile.open(fileobj=f) as tar:
            tar.extractall(dest, filter="data")
    (dest / "AB_REV").write_text(commit + "\n")
    return commit


# -------------------------------------------------------------------------------- run


def _bench(tree: Path, bench: str, args: list[str], out: Path) -> dict:
    """One benchmark run in ``tree`` (its own modules first on the path); its report."""
    env = dict(os.environ, PYTHONPATH=str(tree))
    cmd = [sys.executable, "-m", f"benchmarks.bench_{bench}", *args, "--out", str(out)]
    print("+", " ".join(cmd), f"(in {tree})", flush=True)
    subprocess.run(cmd, cwd=tree, env=env, check=True)
    return json.loads(out.read_text())


def run(bench: str, args: list[str], rounds: int, base: Path = ROOT / BASE_DIR,
        work: Path = ROOT, also: dict[str, Path] | None = None,
        work_rev: str | None = None) -> dict:
    """``rounds`` x (base, work, then each ``also`` tree) runs of ``bench`` with ``args``;
    the ab/1 document (``also``: name -> revision, each round a run per name; ``work_rev``:
    what the working tree is, as the caller names it: a device copy's git state is not
    reliable, and the prepared trees have none of their own)."""
    also = also or {}
    for tree in (base, *also.values()):
        if not (tree / "AB_REV").exists():
            raise SystemExit(f"no tree at {tree}: run 'python -m benchmarks.ab prepare REV' "
                             f"first and carry {tree.name} to the device")
    clash = set(also) & {"base", "work"}
    if clash:
        raise SystemExit(f"--also: names must not be base or work, got {sorted(clash)}")
    doc = {"schema": "ab/1", "bench": bench, "args": args,
           "base_rev": (base / "AB_REV").read_text().strip(), "rounds": [],
           "also": {n: (t / "AB_REV").read_text().strip() for n, t in also.items()},
           "work_rev": work_rev}
    tmp = Path(tempfile.mkdtemp(prefix="ab-"))
    for i in range(rounds):
        one = {}
        for side, tree in (("base", base), ("work", work), *also.items()):
            rep = _bench(tree, bench, args, tmp / f"{side}-{i}.json")
            one[side] = {"copy_bps": rep.get("copy", {}).get("bytes_per_s"),
                         "source": rep.get("source"), "medians": medians(rep)}
        doc["rounds"].append(one)
        doc["device"] = rep.get("device")
    return doc


# ----------------------------------------------------------------------------- render


def _median(values):
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


def _ratio(x, y):
    return None if x is None or y is None else y / x


def table(doc: dict) -> list[dict]:
    """Per row: base and work medians over the rounds, work / base, per-round ratios, and
    per ``also`` tree NAME its median (``NAME_us``) and NAME / base (``NAME_ratio``)."""
    sides = ["base", "work", *doc.get("also", {})]
    keys = list(dict.fromkeys(k for r in doc["rounds"] for side in sides
                              for k in r[side]["medians"]))
    rows = []
    for k in keys:
        per = {s: [r[s]["medians"].get(k) for r in doc["rounds"]] for s in sides}
        bm, wm = _median(per["base"]), _median(per["work"])
        row = {"row": k, "base_us": bm, "work_us": wm, "ratio": _ratio(bm, wm),
               "round_ratios": [_ratio(x, y) for x, y in zip(per["base"], per["work"])]}
        for s in sides[2:]:
            row[f"{s}_us"] = _median(per[s])
            row[f"{s}_ratio"] = _ratio(bm, row[f"{s}_us"])
        rows.append(row)
    return rows


def _tbps(run: dict) -> str:
    bps = run.get("copy_bps")
    return _f(None if bps is None else bps / 1e12, ".2f")


def markdown(doc: dict) -> str:
    f = _f
    also = list(doc.get("also", {}))
    sides = ["base", "work", *also]
    trees = "".join(f", {n} {rev[:12]}" for n, rev in doc.get("also", {}).items())
    work = f" ({doc['work_rev']})" if doc.get("work_rev") else ""
    lines = [f"# A/B: bench_{doc['bench']} {' '.join(doc['args'])}", "",
             f"Device {doc.get('device', '?')}; base {doc['base_rev'][:12]}, work = the "
             f"working tree{work}{trees}; {len(doc['rounds'])} round(s), each "
             f"{' then '.join(sides)}. Copy bandwidth per run, {' / '.join(sides)} (TB/s): "
             + ", ".join(" / ".join(_tbps(r[s]) for s in sides) for r in doc["rounds"])
             + ".", "",
             "| row | base us | work us | work / base | per round |"
             + "".join(f" {n} us | {n} / base |" for n in also),
             "|---|---:|---:|---:|---|" + "---:|---:|" * len(also)]
    for t in table(doc):
        lines.append(f"| {t['row']} | {f(t['base_us'], '.1f')} | {f(t['work_us'], '.1f')} | "
                     f"{f(t['ratio'], '.3f')} | "
                     f"{', '.join(f(x, '.3f') for x in t['round_ratios'])} |"
                     + "".join(f" {f(t[f'{n}_us'], '.1f')} | {f(t[f'{n}_ratio'], '.3f')} |"
                               for n in also))
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    extra = []
    if "--" in argv:
        i = argv.index("--")
        argv, extra = argv[:i], argv[i + 1:]
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("prepare", help="a revision's tree to .ab-base/")
    p.add_argument("rev")
    p.add_argument("--dest", default=BASE_DIR, help="the tree's directory (default "
                                                    f"{BASE_DIR}; another: .ab-NAME)")
    p.add_argument("--build", action="store_true",
                   help="then build its csrc/ here (nvcc), failing on an error")
    p = sub.add_parser("run", help="base and work runs of a benchmark (GPU)")
    p.add_argument("--bench", required=True, help="attention_decode, indexer, insert, ...")
    p.add_argument("--rounds", type=int, default=1)
    p.add_argument("--also", action="append", default=[], metavar="NAME=DIR",
                   help="another prepared tree, timed after the work tree in each round")
    p.add_argument("--work-rev", default=os.environ.get("AB_WORK_REV"),
                   help="what the working tree is (a revision, a branch; default $AB_WORK_REV)")
    p.add_argument("--out", default=os.environ.get("OUT", "reports/gpu-out"))
    p = sub.add_parser("render", help="Markdown of an ab/1 JSON")
    p.add_argument("report")
    p.add_argument("--out", help="Markdown path (default: beside the JSON)")
    args = ap.parse_args(argv)
    if args.cmd == "prepare":
        print(f"{args.dest}/ <- {prepare(args.rev, ROOT / args.dest)}")
        if args.build:
            check_build(ROOT / args.dest)
            print(f"{args.dest}/: csrc/ builds")
    elif args.cmd == "run":
        if args.rounds < 1:
            ap.error(f"--rounds must be >= 1, got {args.rounds}")
        if not (ROOT / "benchmarks" / f"bench_{args.bench}.py").exists():
            ap.error(f"--bench: no benchmarks/bench_{args.bench}.py")
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        also = {}
        for a in args.also:
            name, sep, path = a.partition("=")
            if not sep or not name or not path:
                ap.error(f"--also must be NAME=DIR, got {a!r}")
            also[name] = ROOT / path
        doc = run(args.bench, extra, args.rounds, also=also, work_rev=args.work_rev)
        (out / "ab.json").write_text(json.dumps(doc, indent=1) + "\n")
        print(markdown(doc))
    else:
        doc = json.loads(Path(args.report).read_text())
        md = Path(args.out or Path(args.report).with_suffix(".md"))
        md.write_text(markdown(doc))
        print(f"wrote {md}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
