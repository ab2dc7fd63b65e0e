"""Caches of more than 2^31 elements: every offset into them is 64-bit. Each test runs a
Triton kernel (its registered implementation) on a case, then on the same case with its
caches moved to the end of caches ``extra`` pages larger (block tables and slots shifted,
per-slot scales padded): the outputs must be identical bit for bit, the moved content
identical, and nothing written into the pages in front (zeros: a wrapped 32-bit offset
would land there or read them).

The size is ``LARGE_CACHE_ELEMENTS`` (default 2^31 + 2^24 elements, GPU-sized: a few GB
per cache); the environment variable of that name lowers it, so that the tests' logic can
be run in the CPU interpreter (``LARGE_CACHE_ELEMENTS=100000 pytest -m interp
tests/test_large_caches.py``: then they are marked ``interp`` instead of ``gpu``).
"""

from __future__ import annotations

import os

import numpy as np
import pytest

from oracle.core.cases import Case, make_inputs
from oracle.core.registry import implementations
from oracle.tools.large import LARGE_CACHE_ELEMENTS, moved_op_inputs

ELEMENTS = int(os.environ.get("LARGE_CACHE_ELEMENTS", LARGE_CACHE_ELEMENTS))
# GPU-sized by default; with the size lowered they are interpreter tests of the logic.
SIZED = pytest.mark.interp if "LARGE_CACHE_ELEMENTS" in os.environ else pytest.mark.gpu
# The GPU-sized tests take several GB each: one worker runs them one after another.
pytestmark = pytest.mark.xdist_group("large-caches")
# One insert case at an interpreter size in the default CPU run, so that the GPU-sized
# tests' own code (adapters, moved inputs) is exercised where CI runs.
INTERP_ELEMENTS = 100_000


def _run(op: str, x: dict) -> dict:
    """The registered Triton implementation of ``op`` on ``x``."""
    (impl,) = implementations(op, ["triton"])
    return impl.run(x)


def _assert_moved_cache(small: np.ndarray, big: np.ndarray, extra: int, name: str):
    assert np.array_equal(big[extra:], small), f"{name}: the moved pages differ"
    assert not big[:extra].any(), f"{name}: a write landed in front of the moved pages"


@pytest.mark.parametrize("case_id, elements", [
    pytest.param("norm_rope_insert:tiny:normal:cuda:fp8:bfloat16:tensor:3", ELEMENTS,
                 marks=SIZED),
    pytest.param("norm_rope_insert:tiny:outliers:rocm-fnuz:auto:bfloat16:none:4", ELEMENTS,
                 marks=SIZED),
    pytest.param("norm_rope_insert:tiny:normal:cuda:fp8:bfloat16:tensor:3", INTERP_ELEMENTS,
                 marks=pytest.mark.interp),
])
def test_fused_insert_writes_past_2_31_elements(case_id, elements):
    """The Triton fused insert writes K/V (and index_k) of tokens whose slots lie past
    2^31 elements (past ``elements``) exactly as into a small cache; its other outputs do
    not change."""
    x = make_inputs(Case.from_id(case_id))
    caches = ("kv_cache",) + (("index_cache",) if x.get("index_cache") is not None else ())
    y, extra = moved_op_inputs("norm_rope_insert", x, elements)
    small, big = _run("norm_rope_insert", x), _run("norm_rope_insert", y)
    for key in small:
        if key in caches:
            _assert_moved_cache(small[key], big[key], extra, key)
        else:
            assert np.array_equal(small[key], big[key]), key


@SIZED
@pytest.mark.parametrize("op", ["indexer_decode", "indexer_prefill"])
def test_indexer_reads_past_2_31_elements(op):
    """The Triton indexer selects the same blocks when the index cache's pages lie past
    2^31 elements."""
    x = make_inputs(Case(op, "small", "normal", "cuda", "fp8", "bfloat16", "none", 5))
    y, extra = moved_op_inputs(op, x, ELEMENTS)
    small, big = _run(op, x), _run(op, y)
    assert np.array_equal(small["topk"], big["topk"])


@SIZED
@pytest.mark.parametrize("op", ["attention_decode", "attention_prefill"])
@pytest.mark.parametrize("scales", ["tensor", "slot"])
def test_attention_reads_past_2_31_elements(op, scales):
    """The Triton sparse attention gives the same output, bit for bit, when the selected
    pages (and their per-slot scales) lie past 2^31 elements."""
    x = make_inputs(Case(op, "small", "normal", "cuda", "fp8", "bfloat16", scales, 6))
    y, extra = moved_op_inputs(op, x, ELEMENTS)
    small, big = _run(op, x), _run(op, y)
    assert np.array_equal(small["out"], big["out"])
