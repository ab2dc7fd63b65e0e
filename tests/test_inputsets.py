"""Input sets in the reference cache (oracle/core/inputsets.py): a packed set is the set
``make_inputs`` built, memory layout included (a padded cache's poison codes between its
rows, its strides and offset), and a hit returns it without drawing it again."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import numpy as np
import pytest

from oracle.core import inputsets, refcache
from oracle.core.cases import OPS, Case, input_hash, make_inputs
from oracle.core.refcache import RefCache
from oracle.core.report import differential_cases


def _same_set(a: dict, b: dict) -> None:
    """Equal keys in one order, scalars of one type and value, arrays of one dtype, shape,
    strides and offset into buffers with the same bytes, writable as the originals."""
    assert list(a) == list(b)
    assert input_hash(a) == input_hash(b)
    for key, va in a.items():
        vb = b[key]
        assert type(va) is type(vb), key
        if not isinstance(va, np.ndarray):
            assert va == vb or (va != va and vb != vb), key
            continue
        assert (va.dtype, va.shape, va.strides) == (vb.dtype, vb.shape, vb.strides), key
        ra, rb = inputsets._root(va), inputsets._root(vb)
        assert ra.tobytes() == rb.tobytes(), f"{key}: the buffers differ"
        offset = inputsets._address(va) - inputsets._address(ra)
        assert offset == inputsets._address(vb) - inputsets._address(rb), key
        assert va.flags.writeable == vb.flags.writeable, key


@pytest.mark.parametrize("op", OPS)
def test_a_packed_input_set_is_the_generated_one_memory_layout_included(op):
    """Over the differential test's tiny and small cases of the op (padded caches, views,
    int32 and int64 index arrays, numpy and Python scalars, None), unpack(pack(x)) is x:
    the padded caches keep the poison codes between their rows and their strides."""
    cases = [c for c in differential_cases(op, gpu=True) if c.shape_class in ("tiny", "small")]
    views = 0
    for case in cases:
        x = make_inputs(case)
        views += sum(isinstance(v, np.ndarray) and inputsets._root(v) is not v
                     for v in x.values())
        _same_set(x, inputsets.unpack(inputsets.pack(x)))
    assert views > 0, "no case of the op has an array that is a view: the layout is untested"


def test_a_hit_returns_the_set_without_drawing_it(tmp_path, monkeypatch):
    """The first call draws the set and writes its entry, the second reads it (make_inputs
    not called) and gets the same set, as a cache with another sources hash draws it
    again."""
    case = Case("attention_prefill", "small", "outliers", "rocm-ocp", "fp8", "bfloat16", "slot",
                seed=3, config=1)
    cache = RefCache(tmp_path)
    cold = inputsets.case_inputs(case, cache)
    assert (cache.misses, cache.hits) == (1, 0)
    monkeypatch.setattr(inputsets, "make_inputs",
                        lambda c: pytest.fail("a hit drew the input set again"))
    warm = inputsets.case_inputs(case, cache)
    assert (cache.misses, cache.hits, cache.rejected) == (1, 1, 0)
    fresh = make_inputs(case)
    _same_set(fresh, cold)
    _same_set(fresh, warm)
    other = RefCache(tmp_path, source="edited generator")
    monkeypatch.setattr(inputsets, "make_inputs", make_inputs)
    _same_set(fresh, inputsets.case_inputs(case, other))
    assert other.misses == 1


def test_the_inputs_key_follows_the_generator_not_the_references():
    """The input sets' entries follow the case generator and what it imports (the seeded
    draws, the codec that quantises the caches), not the attention or indexer reference."""
    rel = {str(f.relative_to(refcache.ROOT)) for f in refcache.hashed_files("inputs")}
    assert {"oracle/core/cases.py", "oracle/core/rand.py", "reference/codec.py",
            "oracle/core/inputsets.py"} <= rel
    assert not {"reference/attention.py", "reference/indexer.py"} & rel


@pytest.mark.parametrize("value, what", [
    (np.asfortranarray(np.ones((3, 4))), "not C-contiguous"),
    ([1, 2], "not packable"),
])
def test_pack_refuses_what_it_cannot_keep(value, what):
    """A value pack cannot restore exactly is refused with its key named."""
    with pytest.raises(ValueError, match=rf"inputs\['v'\].*{what}"):
        inputsets.pack({"v": value})


def test_the_cases_input_hashes_are_the_ones_the_cpu_baseline_holds():
    """A sample of the committed CPU baseline's cases (every op, tiny and small) draws inputs
    whose hash is the one the baseline recorded: a change to the case generator or to
    ``input_hash`` would leave every baseline cell "changed inputs", compared on nothing."""
    path = Path(__file__).resolve().parents[1] / "reports" / "baseline" / "cpu.json.gz"
    recorded = {c["case"]: c["hash"] for cell in json.loads(gzip.open(path).read())["cells"]
                for c in cell["per_case"]}
    sample = sorted(recorded)[::12]
    assert {Case.from_id(c).op for c in sample} == set(OPS) and len(sample) >= 30
    assert {c: input_hash(make_inputs(Case.from_id(c))) for c in sample} == \
        {c: recorded[c] for c in sample}
