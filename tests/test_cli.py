"""The command line: the main job runs and bad input exits non-zero with one line."""

import json
import subprocess
import sys

import pytest


def _run(*args):
    return subprocess.run([sys.executable, "-m", "oracle", *args], capture_output=True, text=True)


@pytest.mark.slow
def test_report_prints_the_conformance_table_with_zero_mismatches(tmp_path):
    """`python -m oracle report` prints every format x policy x source row, all 0."""
    r = _run("report", "--out", str(tmp_path / "conf"))
    assert r.returncode == 0, r.stderr
    doc = json.loads((tmp_path / "conf.json").read_text())
    assert len(doc["reference"]) == 4 * 2 * 3
    assert all(row["mismatches"] == 0 for row in doc["reference"])
    for row in doc["reference"]:
        assert f"| {row['fmt']} | {row['policy']} | {row['source']} |" in r.stdout
    assert (tmp_path / "conf.json").exists() and (tmp_path / "conf.md").exists()


def test_unknown_verb_exits_non_zero_without_traceback():
    r = _run("frobnicate")
    assert r.returncode != 0 and "Traceback" not in r.stderr and "invalid choice" in r.stderr
