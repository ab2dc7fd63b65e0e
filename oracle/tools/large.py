"""Caches of more than 2^31 elements: a case's inputs moved behind a prefix of zero pages.

A 64-bit-offset bug shows only when an address passes 2^31 elements, which no case of
the standard shape classes reaches. ``moved`` puts each cache of an input set behind
``extra`` zero pages (block tables and slots shifted, per-slot scales padded with 1.0);
``behind_large_prefix`` wraps an implementation so that it runs on the moved inputs and
hands back its caches cut to the original pages, so the op's ordinary reference check
judges a kernel working past 2^31 elements, and a write into the prefix (a wrapped 32-bit
offset lands there or faults) raises, which the check counts as a failure.

Used by ``tests/test_large_caches.py`` and by the mutants' ``large`` kill class (CUDA).
"""

from __future__ import annotations

import dataclasses

import numpy as np

#: Default size a moved cache passes: 2^31 + 2^24 elements (a few GB per cache).
LARGE_CACHE_ELEMENTS = 2**31 + 2**24

#: Per op: the caches to move, the block tables to shift, the slot arrays to shift with
#: the cache each addresses, the per-slot scales to pad.
MOVES = {
    "norm_rope_insert": dict(caches=("kv_cache", "index_cache"),
                             slots=(("slot_mapping", "kv_cache"),
                                    ("index_slot_mapping", "index_cache")),
                             scales=("k_scale", "v_scale")),
    "reshape_and_cache": dict(caches=("kv_cache",), slots=(("slot_mapping", "kv_cache"),),
                              scales=("k_scale", "v_scale")),
    "indexer_decode": dict(caches=("index_cache",), tables=("block_table",)),
    "indexer_prefill": dict(caches=("index_cache",), tables=("block_table",)),
    "attention_decode": dict(caches=("kv_cache",), tables=("block_table",),
                             scales=("k_scale", "v_scale")),
    "attention_prefill": dict(caches=("kv_cache",), tables=("block_table",),
                              scales=("k_scale", "v_scale")),
}


def extra_pages(cache: np.ndarray, elements: int = LARGE_CACHE_ELEMENTS) -> int:
    """Pages to put in front so that the cache holds more than ``elements`` elements."""
    per_page = int(np.prod(cache.shape[1:]))
    return max(1, -(-(elements - cache.size) // per_page) + 1)


def moved(x: dict, caches, extra: int, tables=(), slots=(), scales=()) -> dict:
    """x with each cache of ``caches`` (absent ones skipped) behind ``extra`` zero pages,
    the block tables' entries and the slots (>= 0) shifted by as much (``slots``: pairs
    of a slot array and the cache it addresses), per-slot scales padded with 1.0."""
    y = dict(x)
    caches = [k for k in caches if x.get(k) is not None]
    for key in caches:
        c = x[key]
        big = np.zeros((extra + c.shape[0],) + c.shape[1:], c.dtype)
        big[extra:] = c
        y[key] = big
    page = x[caches[0]].shape[-2]  # [pages, (Hkv,) P, width]: the slots per page
    for key in tables:
        t = np.array(x[key], copy=True)
        t[t >= 0] += extra
        y[key] = t
    for key, cache in slots:
        if x.get(cache) is None:
            continue
        # An absent index_slot_mapping defaults to slot_mapping: shifted by the pages of
        # the cache it addresses, whose page size may differ, so it is given explicitly.
        s = np.array(x[key] if x.get(key) is not None else x["slot_mapping"], np.int64)
        s[s >= 0] += extra * x[cache].shape[-2]
        y[key] = s
    for key in scales:
        s = x.get(key)
        if s is not None and np.ndim(s) == 2:
            y[key] = np.concatenate([np.ones((s.shape[0], extra * page), s.dtype), s], axis=1)
    return y


def moved_op_inputs(op: str, x: dict, elements: int = LARGE_CACHE_ELEMENTS
                    ) -> tuple[dict, int]:
    """``x`` of ``op`` with its caches past ``elements`` elements, and the pages added."""
    spec = MOVES[op]
    first = next(k for k in spec["caches"] if x.get(k) is not None)
    extra = extra_pages(x[first], elements)
    return moved(x, extra=extra, **spec), extra


def cut_front(out: dict, caches, extra: int) -> dict:
    """The outputs with each moved cache cut back to its own pages; raises when anything
    was written into the zero prefix."""
    out = dict(out)
    for key in caches:
        if out.get(key) is None:
            continue
        front = np.asarray(out[key][:extra])
        if front.any():
            pages = np.unique(np.nonzero(front.reshape(extra, -1))[0])
            raise AssertionError(f"{key}: writes landed in {pages.size} page(s) of the "
                                 f"zero prefix (first {pages[0]}): an offset wrapped")
        out[key] = out[key][extra:]
    return out


def behind_large_prefix(impl, elements: int = LARGE_CACHE_ELEMENTS):
    """``impl`` run on its inputs moved past ``elements`` elements (module docstring)."""
    caches = MOVES[impl.op]["caches"]

    def run(x: dict) -> dict:
        y, extra = moved_op_inputs(impl.op, x, elements)
        return cut_front(impl.run(y), caches, extra)

    return dataclasses.replace(impl, name=f"{impl.name}@2^31", run=run)
