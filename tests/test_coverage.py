"""What the case generator varies, proved by mutants: an implementation wrong in one
argument of an op's contract fails the generic differential check on the generated cases
(the cases the differential test runs for every implementation), so docs/coverage.md's
rows that say "the case generator" hold for every implementation claiming the op.

The mutants here are the reference run with one argument mishandled the way a kernel
would (a bounds-guarded write at the wrong slot, a token skipped on the wrong mapping);
they run on the CPU in seconds.
"""

from __future__ import annotations

import dataclasses
import functools

import numpy as np
import pytest

from oracle.core import reference_run
from oracle.core.cases import Case, make_inputs
from oracle.core.checks import run_check
from oracle.core.registry import implementations
from oracle.core.report import differential_cases
from reference.codec import decode

INSERT = "norm_rope_insert"


@functools.cache
def _insert_cases() -> tuple[tuple[Case, dict], ...]:
    """The differential test's tiny CPU cases of the fused insert with an index cache, and
    their inputs (made once for every test here)."""
    found = []
    for case in differential_cases(INSERT, gpu=False):
        if case.shape_class != "tiny":
            continue
        x = make_inputs(case)
        if x["index_cache"] is not None:
            found.append((case, x))
    return tuple(found)


def _in_range(slots, cache) -> np.ndarray:
    """slots as a kernel's bounds guard sees them: outside the cache means skipped (-1)."""
    s = np.asarray(slots, np.int64)
    return np.where((s >= 0) & (s < cache.shape[0] * cache.shape[1]), s, -1)


def _index_slots(x) -> np.ndarray:
    s = x["index_slot_mapping"]
    return np.asarray(x["slot_mapping"] if s is None else s, np.int64)


def _index_at_main_slots(x):
    """index_k written at slot_mapping (index_slot_mapping ignored), guarded by the index
    cache's size."""
    return _in_range(x["slot_mapping"], x["index_cache"])


def _index_skipped_with_main(x):
    """A token whose main slot is negative skipped entirely: its index_k not written."""
    return np.where(np.asarray(x["slot_mapping"]) < 0, -1, _index_slots(x))


def _index_paged_by_kv_page(x):
    """The index slot split into page and offset by the KV cache's page size."""
    s, kv_page, ic_page = _index_slots(x), x["kv_cache"].shape[2], x["index_cache"].shape[1]
    flat = _in_range(np.where(s >= 0, s // kv_page * ic_page + s % kv_page, -1),
                     x["index_cache"])
    # Two tokens landing on one slot: one write wins (the first, here).
    _, first = np.unique(flat, return_index=True)
    return np.where(np.isin(np.arange(len(flat)), first), flat, -1)


MUTANTS = {
    "index_at_main_slots": _index_at_main_slots,
    "index_skipped_with_main": _index_skipped_with_main,
    "index_paged_by_kv_page": _index_paged_by_kv_page,
}


def _mutant(name):
    """The reference implementation, index_k written at the mutant's slots."""
    (ref,) = implementations(INSERT, ["reference"])
    where = MUTANTS[name]

    def run(x: dict) -> dict:
        return reference_run.norm_rope_insert(dict(x, index_slot_mapping=where(x)))

    return dataclasses.replace(ref, name=f"reference-{name}", run=run)


def test_generated_inserts_vary_the_index_target():
    """The generated fused-insert cases include an index_slot_mapping of its own (distinct
    from slot_mapping, with -1 entries where slot_mapping has none and valid slots where
    slot_mapping has -1), the default (None: the main slots), and index caches whose page
    size differs from the KV cache's."""
    own = [x for _, x in _insert_cases() if x["index_slot_mapping"] is not None]
    assert len(own) >= 4 and len(own) < len(_insert_cases())
    assert any(not np.array_equal(x["index_slot_mapping"], x["slot_mapping"]) for x in own)
    main, idx = (np.concatenate([x[k] for x in own]) for k in ("slot_mapping",
                                                                "index_slot_mapping"))
    assert np.any((idx < 0) & (main >= 0)) and np.any((idx >= 0) & (main < 0))
    assert any(x["index_cache"].shape[1] != x["kv_cache"].shape[2] for _, x in _insert_cases())
    for _, x in _insert_cases():  # every index slot in range, none repeated (the contract)
        s = _index_slots(x)
        valid = s[s >= 0]
        assert valid.max(initial=-1) < x["index_cache"].shape[0] * x["index_cache"].shape[1]
        assert np.unique(valid).size == valid.size


def _differs(x, slots) -> bool:
    """Whether writing index_k at ``slots`` instead of the contract's writes another set of
    (slot, token) pairs."""
    return not np.array_equal(np.asarray(slots), _in_range(_index_slots(x), x["index_cache"]))


@pytest.mark.parametrize("name", sorted(MUTANTS))
def test_index_mutant_fails_the_differential_check(name):
    """The reference with index_k written at the mutant's slots fails the differential
    check on every generated case where its slots differ from the contract's, and at
    least one generated case has such slots; the unmutated reference passes them all."""
    mutant = _mutant(name)
    (ref,) = implementations(INSERT, ["reference"])
    exposing = [(c, x) for c, x in _insert_cases() if _differs(x, MUTANTS[name](x))]
    assert exposing, f"no generated case separates {name} from the contract"
    for case, x in exposing:
        assert run_check(case, ref, x).passed, case.id
        res = run_check(case, mutant, x)
        assert not res.passed, f"{name} passed {case.id}"
        assert any("index_cache" in f for f in res.failures), res.summary()


def test_generated_index_arrays_come_in_both_integer_widths():
    """Across the differential test's tiny CPU cases, every index array of every op (slots,
    positions, block tables, lengths) arrives as int32 in some cases and int64 in others,
    and the adapters hand it on in its own dtype."""
    from oracle.core.cases import INDEX_ARRAYS, OPS
    from oracle.impls.io import ints_in

    for op in OPS:
        keys = INDEX_ARRAYS.get(op, ("block_table", "seq_lens"))
        seen = {key: set() for key in keys}
        for case in differential_cases(op, gpu=False):
            if case.shape_class != "tiny":
                continue
            x = make_inputs(case)
            for key in keys:
                if x.get(key) is not None:
                    seen[key].add(np.asarray(x[key]).dtype)
                    assert str(ints_in(x[key], "cpu").dtype) == f"torch.{x[key].dtype}"
        assert all(dtypes == {np.dtype(np.int32), np.dtype(np.int64)}
                   for dtypes in seen.values()), (op, seen)


def _nan_keys_dropped(op):
    """The reference indexer with its NaN keys read as zeros (an fmax-style block maximum
    that drops NaN), so a NaN-scored block ranks by its other keys instead of last."""
    (ref,) = implementations(op, ["reference"])
    run = reference_run.indexer_decode if op == "indexer_decode" else reference_run.indexer_prefill

    def mutant(x: dict) -> dict:
        cache = np.array(x["index_cache"], copy=True)
        cache[np.isnan(decode(cache, x["index_fmt"]))] = 0
        return {"topk": run(dict(x, index_cache=cache)).astype(np.int32)}

    return ref, dataclasses.replace(ref, name="reference-nan_keys_dropped", run=mutant)


@pytest.mark.parametrize("op", ["indexer_prefill", "indexer_decode"])
def test_nan_score_mutant_fails_the_differential_check(op):
    """The generated outliers cases put NaN codes among the visible index keys: the
    reference passes them, and an indexer that drops NaN keys from a block's maximum fails
    at least one of them."""
    ref, mutant = _nan_keys_dropped(op)
    cases = [c for c in differential_cases(op, gpu=False)
             if c.dist == "outliers"]
    failed = 0
    for case in cases:
        x = make_inputs(case)
        assert np.isnan(decode(np.asarray(x["index_cache"]), x["index_fmt"])).any(), case.id
        assert run_check(case, ref, x).passed, case.id
        res = run_check(case, mutant, x)
        assert res.passed or res.failures[0].startswith("topk:"), res.summary()
        failed += not res.passed
    assert failed, f"no generated {op} case separates NaN-dropping maxima from the contract"
