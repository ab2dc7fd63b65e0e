"""The reference cache (oracle/core/refcache.py): a hit judges exactly as a miss, an entry
that cannot be trusted is recomputed and reported, a process serves the entries it holds
from memory as copies, the key follows the reference's sources and not the kernels', and
concurrent writers leave a valid entry."""

from __future__ import annotations

import subprocess
import sys
import warnings
from pathlib import Path

import numpy as np
import pytest

from oracle.core import refcache
from oracle.core.cases import Case, make_inputs
from oracle.core.checks import run_check
from oracle.core.refcache import RefCache, RefCacheWarning
from oracle.core.registry import implementations

ROOT = Path(__file__).resolve().parents[1]


def _result(case, impl_name, x):
    (impl,) = implementations(case.op, [impl_name])
    d = run_check(case, impl, x).as_dict()
    d.pop("seconds")
    return d


@pytest.mark.parametrize("op", ["indexer_decode", "attention_decode", "norm_rope_insert"])
def test_a_hit_judges_bit_identically_to_a_miss(op, tmp_path, monkeypatch):
    """The check of an implementation on a case has the same result, every statistic
    included, from an empty cache (misses, entries written) as from the entries (hits,
    nothing computed: not even the admissible codes' ordinals), and as with the cache
    off."""
    case = Case(op, "tiny", "normal", "cuda", "fp8", "bfloat16", "none", seed=5)
    x = make_inputs(case)
    monkeypatch.setenv(refcache.ENV, "off")
    off = _result(case, "torch", x)
    monkeypatch.setenv(refcache.ENV, str(tmp_path))
    cold = _result(case, "torch", x)
    cache = refcache.default_cache()
    assert cache.misses > 0 and cache.hits == 0 and list(tmp_path.rglob("*.npz"))
    from oracle.core import checks

    def computed(*_):
        raise AssertionError("admissible ordinals computed on a warm cache")
    monkeypatch.setattr(checks, "reference_ordinals", computed)
    warm = _result(case, "torch", x)
    assert cache.hits == cache.misses and cache.rejected == 0
    assert off == cold == warm


def _entry(tmp_path, source="s"):
    cache = RefCache(tmp_path, source=source)
    want = {"a": np.arange(1000, dtype=np.float64) / 3, "n": np.asarray(7)}
    got = cache.get("k", "h" * 16, ("arg", 1), lambda: want)
    return cache, want, got, cache.path(cache.key("k", "h" * 16, ("arg", 1)))


def _again(cache, want):
    calls = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got = cache.get("k", "h" * 16, ("arg", 1), lambda: calls.append(1) or want)
    return got, calls, [str(w.message) for w in caught if w.category is RefCacheWarning]


@pytest.mark.parametrize("damage", ["flip", "truncate", "empty", "foreign", "no_checksum"])
def test_an_entry_that_cannot_be_trusted_is_recomputed_and_reported(tmp_path, damage):
    """A flipped payload byte (checksum), a truncated or empty file, another key's entry
    in this key's place, an entry without its checksum: each is rejected with a warning,
    recomputed (the same arrays) and rewritten, so the next lookup hits."""
    cache, want, _, path = _entry(tmp_path)
    data = path.read_bytes()
    if damage == "flip":
        i = data.index(np.float64(1 / 3).tobytes())  # inside the payload "a"
        path.write_bytes(data[:i] + bytes([data[i] ^ 1]) + data[i + 1:])
    elif damage == "truncate":
        path.write_bytes(data[: len(data) // 2])
    elif damage == "empty":
        path.write_bytes(b"")
    elif damage == "foreign":
        other = RefCache(tmp_path, source="s")
        other.get("k", "g" * 16, ("arg", 1), lambda: want)
        path.write_bytes(other.path(other.key("k", "g" * 16, ("arg", 1))).read_bytes())
    else:
        np.savez(path, **want)
    reader = RefCache(tmp_path, source="s")  # a process that holds no entry in memory
    got, calls, reported = _again(reader, want)
    assert calls == [1] and reader.rejected == 1 and len(reported) == 1
    assert all(np.array_equal(got[k], want[k]) for k in want)
    after = RefCache(tmp_path, source="s")
    got, calls, reported = _again(after, want)
    assert calls == [] and not reported and after.rejected == 0 and after.memory_hits == 0


@pytest.mark.parametrize("where", ["file", "memory"])
def test_a_hit_returns_the_stored_bits(tmp_path, where):
    """A second lookup, from the file (another process) or from the process's memory,
    computes nothing and returns arrays equal bit for bit, dtypes and shapes included."""
    cache, want, first, _ = _entry(tmp_path)
    if where == "file":
        cache = RefCache(tmp_path, source="s")
    got, calls, _ = _again(cache, want)
    assert calls == [] and cache.hits == 1 and cache.memory_hits == (where == "memory")
    for k in want:
        assert got[k].dtype == want[k].dtype and got[k].shape == want[k].shape
        assert got[k].tobytes() == want[k].tobytes() == first[k].tobytes()


def test_memory_hands_out_copies_and_keeps_the_recent_entries_within_its_bytes(tmp_path,
                                                                             monkeypatch):
    """An entry the process read or wrote is served again without a file read, as arrays
    the caller may change without changing the next lookup's; past ``memory_bytes`` the
    least recently used entry leaves memory (its next lookup reads the file) and an entry
    larger than the budget is never kept."""
    cache = RefCache(tmp_path, source="s", memory_bytes=2 * 8000)
    arrays = {n: {"a": np.full(1000, n, np.float64)} for n in range(3)}  # 8000 B each
    for n in (0, 1):
        cache.get("k", f"{n:016}", (), lambda n=n: arrays[n])
    reads = []
    read = RefCache._read
    monkeypatch.setattr(RefCache, "_read", lambda self, p, k: reads.append(k) or read(self, p, k))
    got = cache.get("k", f"{0:016}", (), lambda: pytest.fail("computed"))
    got["a"][:] = -1
    assert reads == [] and np.all(cache.get("k", f"{0:016}", (), list)["a"] == 0)
    cache.get("k", f"{2:016}", (), lambda: arrays[2])  # 1 is now the least recently used
    assert len(reads) == 1
    cache.get("k", f"{0:016}", (), list)
    assert len(reads) == 1
    assert np.all(cache.get("k", f"{1:016}", (), list)["a"] == 1) and len(reads) == 2
    small = RefCache(tmp_path, source="s", memory_bytes=4000)
    small.get("k", f"{0:016}", (), list)
    small.get("k", f"{0:016}", (), list)
    assert len(reads) == 4 and small.memory_hits == 0


def test_a_source_change_misses_and_the_key_has_no_kernel_in_it(tmp_path):
    """Another sources hash (an edited reference or tolerance model) misses the entry;
    the hashed sources are the reference's and oracle/core's, none of kernels/, csrc/ or
    the implementations'."""
    _entry(tmp_path, source="one")
    cache, want, _, _ = _entry(tmp_path, source="two")
    assert cache.misses == 1 and len(list(tmp_path.rglob("*.npz"))) == 2
    for kind in refcache.KIND_MODULES:
        rel = {str(f.relative_to(ROOT)) for f in refcache.hashed_files(kind)}
        assert {"reference/codec.py", "oracle/core/checks.py",
                "oracle/core/reference_run.py", "reference/__init__.py"} <= rel
        assert all(r.startswith(("reference/", "oracle/core/", "oracle/__init__"))
                   for r in rel), rel


@pytest.mark.parametrize("kind, uses, not_uses", [
    ("indexer_decode", "reference/indexer.py", "reference/attention.py"),
    ("attention", "reference/attention.py", "oracle/core/bounds.py"),
    ("attention_bound", "oracle/core/bounds.py", "reference/indexer.py"),
    ("attention_ordinals", "oracle/core/intervals.py", "reference/indexer.py"),
    ("norm_rope", "reference/norm_rope.py", "reference/attention.py"),
])
def test_a_reference_change_invalidates_the_kinds_that_use_it(kind, uses, not_uses):
    """A kind's entries follow the modules that compute them, transitively (attention's
    bound: bounds.py through attention_bound.py), and not a module they never import (an
    edit to the attention reference keeps the indexer's entries)."""
    rel = {str(f.relative_to(ROOT)) for f in refcache.hashed_files(kind)}
    assert uses in rel and not_uses not in rel
    with pytest.raises(ValueError, match="kind must be one of"):
        refcache.hashed_files("nonsense")


def test_two_implementations_share_the_references_entries(tmp_path, monkeypatch):
    """The indexer's reference entry has no implementation in its key: the check of a
    second implementation on the same inputs computes no reference."""
    monkeypatch.setenv(refcache.ENV, str(tmp_path))
    case = Case("indexer_decode", "tiny", "normal", "cuda", "auto", "bfloat16", "none", seed=2)
    x = make_inputs(case)
    _result(case, "reference", x)
    cache = refcache.default_cache()
    misses = cache.misses
    _result(case, "torch", x)
    assert cache.misses == misses and cache.hits >= 1


def test_the_environment_moves_or_disables_the_cache(tmp_path):
    """ORACLE_REFERENCE_CACHE=<dir> moves it, =off disables it; unset, it lives under
    $XDG_CACHE_HOME (or ~/.cache) / sparse-attn-oracle / reference."""
    assert refcache.default_dir({refcache.ENV: "off"}) is None
    assert refcache.default_dir({refcache.ENV: str(tmp_path)}) == tmp_path
    assert refcache.default_dir({"XDG_CACHE_HOME": "/x"}) == Path(
        "/x/sparse-attn-oracle/reference")
    assert refcache.default_dir({}) == Path.home() / ".cache/sparse-attn-oracle/reference"


_WRITER = """
import sys
import numpy as np
from oracle.core.refcache import RefCache
cache = RefCache(sys.argv[1], source="s")
key = cache.key("k", "h" * 16, ())
fill = float(sys.argv[2])
for _ in range(30):
    cache._write(cache.path(key), key, {"a": np.full(1 << 17, fill)})
"""


def test_concurrent_writers_leave_a_valid_entry(tmp_path):
    """Two processes rewriting one entry over and over (each its own value) while this
    one reads it: every read is absent or a whole, valid entry of one writer, never a
    rejected one, and the final entry is valid."""
    cache = RefCache(tmp_path, source="s")
    key = cache.key("k", "h" * 16, ())
    procs = [subprocess.Popen([sys.executable, "-c", _WRITER, str(tmp_path), str(v)],
                              cwd=ROOT, env={"PYTHONPATH": str(ROOT), "PATH": ""})
             for v in (1.0, 2.0)]
    seen = set()
    while any(p.poll() is None for p in procs):
        got = cache._read(cache.path(key), key)
        if got is not None:
            seen.add(float(got["a"][0]))
            assert np.all(got["a"] == got["a"][0])
    assert all(p.wait() == 0 for p in procs)
    final = cache._read(cache.path(key), key)
    assert final is not None and cache.rejected == 0 and seen <= {1.0, 2.0}
    assert not [p for p in tmp_path.rglob("*") if p.name.startswith(".tmp-")]
