"""oracle/tools/large.py: an implementation judged with its caches past a large prefix."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from oracle.core.cases import Case, make_inputs
from oracle.core.checks import run_check
from oracle.core.registry import REGISTRY
from oracle.tools.large import MOVES, behind_large_prefix, moved_op_inputs

CASES = ["norm_rope_insert:tiny:normal:cuda:fp8:bfloat16:slot:3",
         "reshape_and_cache:tiny:outliers:rocm-fnuz:fp8:bfloat16:slot:4",
         "attention_decode:tiny:normal:cuda:fp8:bfloat16:slot:6",
         "indexer_prefill:tiny:normal:cuda:fp8:bfloat16:none:5"]


@pytest.mark.parametrize("case_id", CASES)
def test_moved_inputs_keep_every_read_and_write_on_the_same_content(case_id):
    """Each cache's pages sit behind zero pages; tables and slots point at the same
    content, per-slot scales stay attached to their slots; the reference passes its own
    check through the wrapper (the moved run is the same computation)."""
    case = Case.from_id(case_id)
    x = make_inputs(case)
    y, extra = moved_op_inputs(case.op, x, elements=5000)
    key = next(k for k in MOVES[case.op]["caches"] if x.get(k) is not None)
    assert y[key].size > 5000 and not y[key][:extra].any()
    assert np.array_equal(y[key][extra:], x[key])
    page = x[key].shape[-2]
    if "slot_mapping" in x:
        s, t = x["slot_mapping"], y["slot_mapping"]
        assert np.array_equal(t[s >= 0], s[s >= 0] + extra * page)
        assert np.array_equal(t[s < 0], s[s < 0])
    if "block_table" in x:
        b, t = x["block_table"], y["block_table"]
        assert np.array_equal(t[b >= 0], b[b >= 0] + extra)
    if np.ndim(x.get("k_scale")) == 2:
        assert np.array_equal(y["k_scale"][:, extra * page:], x["k_scale"])
    ref = REGISTRY[case.op]["reference"]
    assert run_check(case, behind_large_prefix(ref, elements=5000), x).passed


def test_a_write_into_the_prefix_fails_the_check():
    """An insert whose slot offsets wrap (modelled: every write also lands in page 0 of
    the moved cache) fails its check with a message naming the prefix."""
    case = Case.from_id(CASES[1])
    ref = REGISTRY[case.op]["reference"]

    def wrapping(x):
        out = ref.run(x)
        out["kv_cache"] = np.array(out["kv_cache"], copy=True)
        out["kv_cache"][0] = out["kv_cache"][-1]
        return out

    bad = behind_large_prefix(dataclasses.replace(ref, run=wrapping), elements=5000)
    r = run_check(case, bad, make_inputs(case))
    assert not r.passed and "zero prefix" in r.summary()
