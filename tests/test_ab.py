"""benchmarks/ab.py: a benchmark on a revision's tree and on the working tree, compared."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from benchmarks import ab

ROOT = Path(__file__).resolve().parents[1]


def _doc(results, sweep=()):
    return {"results": list(results), "sweep": list(sweep)}


def test_rows_are_keyed_by_what_was_measured_not_by_the_measurement():
    """Two rows differing only in knobs (or batch, cache, distribution) get different keys;
    the same row measured twice gets the same key; sweep rows count as rows."""
    a = {"name": "triton", "cache": "e4m3fn", "batch": 64, "median_us": 59.0, "knobs": {}}
    b = dict(a, knobs={"num_stages": 2}, median_us=65.6)
    c = dict(a, batch=8, median_us=19.2)
    m = ab.medians(_doc([a, c], [b]))
    assert m == {"name=triton cache=e4m3fn batch=64": 59.0,
                 "name=triton cache=e4m3fn batch=64 knobs=num_stages=2": 65.6,
                 "name=triton cache=e4m3fn batch=8": 19.2}
    assert ab.row_key(dict(a, median_us=1.0)) == ab.row_key(a)
    assert ab.row_key(dict(a, dist="random")) != ab.row_key(a)


def _ab_doc(rounds):
    return {"schema": "ab/1", "bench": "attention_decode", "args": ["--batches", "64"],
            "base_rev": "0123456789abcdef", "device": "NVIDIA H200",
            "rounds": [{"base": {"copy_bps": 4.25e12, "medians": b},
                        "work": {"copy_bps": 4.26e12, "medians": w}} for b, w in rounds]}


def test_table_takes_the_median_over_rounds_and_marks_one_sided_rows():
    """work / base is the ratio of the medians over rounds (an outlier round moves it
    less than a mean would); per-round ratios are listed; a row only the work tree has
    shows '-' for base and no ratio."""
    doc = _ab_doc([({"x": 100.0}, {"x": 80.0, "new": 5.0}),
                   ({"x": 110.0}, {"x": 90.0, "new": 5.5}),
                   ({"x": 300.0}, {"x": 85.0, "new": 6.0})])
    rows = {t["row"]: t for t in ab.table(doc)}
    assert rows["x"]["base_us"] == 110.0 and rows["x"]["work_us"] == 85.0
    assert rows["x"]["ratio"] == pytest.approx(85 / 110)
    assert rows["x"]["round_ratios"] == pytest.approx([0.8, 90 / 110, 85 / 300])
    assert rows["new"]["base_us"] is None and rows["new"]["ratio"] is None
    md = ab.markdown(doc)
    assert "| x | 110.0 | 85.0 | 0.773 | 0.800, 0.818, 0.283 |" in md
    assert "| new | - | 5.5 | - | -, -, - |" in md
    assert "base 0123456789ab" in md and "4.25 / 4.26" in md


def test_prepare_writes_the_revision_without_reports(tmp_path):
    """The base tree is the revision's files (this module among them), reports/ left out,
    and records the commit it came from."""
    dest = tmp_path / "base"
    commit = ab.prepare("HEAD", dest)
    head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True,
                          text=True, check=True).stdout.strip()
    assert commit == head and (dest / "AB_REV").read_text().strip() == head
    assert (dest / "kernels" / "__init__.py").exists()
    assert (dest / "benchmarks" / "harness.py").exists()
    assert not (dest / "reports").exists()
    with pytest.raises(subprocess.CalledProcessError):
        ab.prepare("no-such-revision-xyz", tmp_path / "other")


def _fake_tree(root: Path, us: float) -> Path:
    """A tree whose benchmark 'fake' reports one row at ``us`` (and echoes its args)."""
    (root / "benchmarks").mkdir(parents=True)
    (root / "benchmarks" / "bench_fake.py").write_text(textwrap.dedent(f"""
        import json, sys
        out = sys.argv[sys.argv.index("--out") + 1]
        args = sys.argv[1:sys.argv.index("--out")]
        json.dump({{"copy": {{"bytes_per_s": 4e12}}, "device": "fake",
                   "results": [{{"name": "k", "cache": " ".join(args), "median_us": {us}}}]}},
                  open(out, "w"))
    """))
    return root


def test_run_times_both_trees_with_the_same_arguments_in_each_round(tmp_path):
    """Each round runs the base tree's benchmark, then the work tree's, each from its own
    modules, with the same arguments; the document records the base revision."""
    base = _fake_tree(tmp_path / "base", 100.0)
    (base / "AB_REV").write_text("abc\n")
    work = _fake_tree(tmp_path / "work", 80.0)
    doc = ab.run("fake", ["--caches", "e4m3fn"], 2, base=base, work=work)
    assert doc["base_rev"] == "abc" and len(doc["rounds"]) == 2
    for r in doc["rounds"]:
        assert r["base"]["medians"] == {"name=k cache=--caches e4m3fn": 100.0}
        assert r["work"]["medians"] == {"name=k cache=--caches e4m3fn": 80.0}
    assert ab.table(doc)[0]["ratio"] == pytest.approx(0.8)


def test_run_without_a_base_tree_says_how_to_make_one(tmp_path):
    """No .ab-base: the error names the command that makes it, nothing is run."""
    with pytest.raises(SystemExit, match="benchmarks.ab prepare REV"):
        ab.run("fake", [], 1, base=tmp_path / "missing", work=tmp_path)


def test_render_command_writes_markdown_beside_the_json(tmp_path):
    """`python -m benchmarks.ab render X.json` writes X.md with the comparison table."""
    p = tmp_path / "ab.json"
    p.write_text(json.dumps(_ab_doc([({"x": 100.0}, {"x": 90.0})])))
    subprocess.run([sys.executable, "-m", "benchmarks.ab", "render", str(p)], cwd=ROOT,
                   check=True, capture_output=True)
    assert "| x | 100.0 | 90.0 | 0.900 | 0.900 |" in (tmp_path / "ab.md").read_text()


def test_also_trees_run_in_every_round_and_join_the_table(tmp_path):
    """A tree given as --also runs after the work tree in each round with the same
    arguments; its median and its ratio to the base join each row and the Markdown."""
    base = _fake_tree(tmp_path / "base", 100.0)
    (base / "AB_REV").write_text("abc\n")
    work = _fake_tree(tmp_path / "work", 80.0)
    cand = _fake_tree(tmp_path / "cand", 90.0)
    (cand / "AB_REV").write_text("def\n")
    doc = ab.run("fake", ["--x"], 2, base=base, work=work, also={"cand": cand})
    assert doc["also"] == {"cand": "def"}
    assert all(r["cand"]["medians"] == {"name=k cache=--x": 90.0} for r in doc["rounds"])
    row = ab.table(doc)[0]
    assert row["cand_us"] == 90.0 and row["cand_ratio"] == pytest.approx(0.9)
    md = ab.markdown(doc)
    assert "| name=k cache=--x | 100.0 | 80.0 | 0.800 | 0.800, 0.800 | 90.0 | 0.900 |" in md
    with pytest.raises(SystemExit, match="prepare REV"):
        ab.run("fake", [], 1, base=base, work=work, also={"x": tmp_path / "missing"})
    with pytest.raises(SystemExit, match="must not be base or work"):
        ab.run("fake", [], 1, base=base, work=work, also={"work": cand})


def test_the_working_trees_name_reaches_the_report(tmp_path):
    """run(work_rev=...) records what the working tree is, and the Markdown names it (a
    device copy's own git state does not say which branch was timed)."""
    base = _fake_tree(tmp_path / "base", 100.0)
    (base / "AB_REV").write_text("abc\n")
    work = _fake_tree(tmp_path / "work", 80.0)
    doc = ab.run("fake", [], 1, base=base, work=work, work_rev="exp/branch 1234567")
    assert doc["work_rev"] == "exp/branch 1234567"
    assert "work = the working tree (exp/branch 1234567)" in ab.markdown(doc)


def test_check_build_stops_on_a_tree_that_does_not_build(tmp_path):
    """check_build runs the tree's own kernels/cuda_build.py: a failing build stops with
    its output's end (the cause), a passing one returns."""
    for name, body in (("bad", "raise SystemExit('nvcc failed: multiple definition of f')"),
                       ("good", "print('build: 1.00 s')")):
        (tmp_path / name / "kernels").mkdir(parents=True)
        (tmp_path / name / "kernels" / "__init__.py").write_text("")
        (tmp_path / name / "kernels" / "cuda_build.py").write_text(body + "\n")
    with pytest.raises(SystemExit, match="does not build:\n.*multiple definition of f"):
        ab.check_build(tmp_path / "bad")
    ab.check_build(tmp_path / "good")
