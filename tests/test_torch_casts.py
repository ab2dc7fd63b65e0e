"""Which overflow policy the installed torch's fp8 casts follow (torch changed e4m3fn
overflow between 2.11 and 2.13, which is why torch is never the reference)."""

import pytest

from oracle.tools import conformance

torch = pytest.importorskip("torch")


@pytest.fixture(scope="module")
def torch_rows():
    sets = {s: conformance.source_set(s) for s in conformance.SOURCE_DTYPES}
    return conformance.torch_rows(sets)


def test_each_torch_cast_follows_exactly_one_policy(torch_rows):
    """Per format, source dtype and device, torch's cast equals exactly one of the two
    policies on every value of the conformance sets (which include overflow, so both
    cannot match); 'neither' would mean a torch cast the reference cannot describe."""
    bad = [r for r in torch_rows if r.policy in ("neither", "both")]
    assert not bad, bad
