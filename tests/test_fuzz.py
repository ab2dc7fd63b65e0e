"""Fuzzing: the hypothesis driver finds and shrinks a planted bug and writes its replay file;
the long fuzz run (marker ``fuzz``) searches the CPU implementations."""

import pytest
from hypothesis import given, settings

from oracle import fuzz
from oracle.cases import Case
from oracle.impl_torch import make_torch_impl
from oracle.registry import REGISTRY, implementations, load_all


@pytest.fixture
def planted_bug():
    """The torch baseline with (w) instead of (1 + w), registered for the test's duration."""
    load_all()
    broken = make_torch_impl("norm_rope_insert", "plain_w")
    REGISTRY["norm_rope_insert"][broken.name] = broken
    yield broken.name
    del REGISTRY["norm_rope_insert"][broken.name]


def test_fuzz_finds_shrinks_and_writes_a_replayable_failure(planted_bug, tmp_path):
    """Within a short budget the driver fails on the planted bug, writes one file holding
    the replay command of a case that still fails, and exits 1; the failing example is
    kept in the example database (replayed first by the next run)."""
    out, db = tmp_path / "out", tmp_path / "db"
    rc = fuzz.run(seconds=60, ops=["norm_rope_insert"], impls=[planted_bug], out_dir=out,
                  db=db)
    assert rc == 1
    assert any(p.is_file() for p in db.rglob("*"))
    (path,) = out.iterdir()
    command = path.read_text().strip()
    assert command.startswith("python -m oracle replay norm_rope_insert:")
    case = Case.from_id(command.split()[4])
    (impl,) = implementations("norm_rope_insert", [planted_bug])
    with pytest.raises(fuzz.CaseFailed):
        fuzz.check_case(case, [impl.name])


def test_fuzz_reports_no_failure_on_correct_implementations(tmp_path, monkeypatch):
    """A short run over the correct CPU implementations finds nothing and exits 0, and
    reports every case's worst error over bound (in [0, 1]) to hypothesis.target."""
    seen = []
    monkeypatch.setattr(fuzz, "target", lambda value, label: seen.append((label, value)))
    out = tmp_path / "out"
    assert fuzz.run(seconds=5, ops=["norm_rope_insert"], impls=["torch"], out_dir=out,
                    db=None) == 0
    assert not out.exists() or not list(out.iterdir())
    assert seen and all(label == "err/bound" and 0 <= v <= 1 for label, v in seen)
    assert any(v > 0 for _, v in seen)  # rounding errors are measured, not all zero


@pytest.mark.fuzz
@settings(max_examples=2000)
@given(fuzz.case_strategy())
def test_fuzz_every_cpu_implementation(case):
    """Every CPU implementation passes on hypothesis-drawn cases over the whole case space
    (ops, shape classes tiny/small, distributions, platforms, cache dtypes, scales, seeds)."""
    fuzz.check_case(case, device="cpu")


def test_parallel_workers_each_fuzz_and_report(tmp_path, capfd):
    """``--workers 2``: two processes fuzz at once (their own hypothesis streams), each
    reports its summary; no failure on a correct implementation gives 0."""
    rc = fuzz.run_parallel(2, seconds=3, ops=["reshape_and_cache"], impls=["torch"],
                           out_dir=tmp_path / "out", db=None)
    assert rc == 0
    assert capfd.readouterr().out.count("no failure in 3 s") == 2
