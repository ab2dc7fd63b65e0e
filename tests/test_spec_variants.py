"""benchmarks/spec_variants.py: the specialisation key it counts compiles with."""

from __future__ import annotations

import os

import pytest
import torch

from benchmarks.spec_variants import count_keys, launch_key


def _kernel(x_ptr, n, stride, BLOCK):  # the parameters' names are what the key reads
    pass


def test_launch_key_classes_integers_and_tensors_as_triton_specialises():
    """Integers key by class (1, a multiple of 16, other), so 32 and 48 share a compile and
    1 does not; a do_not_specialize argument never changes the key (its tensor's dtype
    still does); constexprs key by value; tensors by dtype and 16-byte alignment."""
    x = torch.zeros(64)
    key = lambda *a, dns=(), **k: launch_key(_kernel, dns, a, k)  # noqa: E731
    assert key(x, 32, 7, BLOCK=16) == key(x, 48, 7, BLOCK=16)
    assert key(x, 1, 7, BLOCK=16) != key(x, 48, 7, BLOCK=16)
    assert key(x, 33, 7, BLOCK=16) != key(x, 48, 7, BLOCK=16)
    assert key(x, 33, 7, dns=("n",), BLOCK=16) == key(x, 48, 7, dns=("n",), BLOCK=16)
    assert key(x, 32, 7, BLOCK=16) != key(x, 32, 7, BLOCK=32)
    assert key(x[1:], 32, 7, BLOCK=16) != key(x, 32, 7, BLOCK=16)  # 4-byte offset
    assert key(x.double(), 32, 7, BLOCK=16) != key(x, 32, 7, BLOCK=16)


def test_importing_the_tool_leaves_the_interpreter_switch_alone():
    """Importing the module does not set TRITON_INTERPRET: on a GPU that would make every
    later torch.compile kernel of the process interpreted (on the H200 the flex
    checks raised 'Cannot call @triton.jit'd outside of the scope of a kernel')."""
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    code = ("import os, benchmarks.spec_variants; "
            "print(os.environ.get('TRITON_INTERPRET'))")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                         text=True, check=True, cwd=os.path.dirname(os.path.dirname(
                             os.path.abspath(__file__))))
    assert out.stdout.strip() == "None"


@pytest.mark.interp
@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1",
                    reason="Triton kernels are compiled for a GPU in this process; "
                           "run TRITON_INTERPRET=1 pytest -m interp")
def test_count_keys_records_every_launch_without_running_it():
    """Four reshape_and_cache cases launch the kernel once each: the curve ends at 4 cases
    with between 1 and 4 distinct keys of that kernel, and the kernel's varied arguments
    are named (the count is a pure function of the drawn cases)."""
    curve, varied = count_keys("reshape_and_cache", 4, ("tiny",))
    n, counts = curve[-1]
    assert n == 4 and 1 <= counts["_reshape_and_cache_kernel"] <= 4
    assert set(varied) == {"_reshape_and_cache_kernel"}
    assert count_keys("reshape_and_cache", 4, ("tiny",)) == (curve, varied)
