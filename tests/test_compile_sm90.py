"""Every Triton kernel compiles for sm_90 with the real Triton compiler, on the CPU (no GPU
needed): compiled Triton rejects some code the interpreter runs happily (e.g. one name bound
to different pointer types in two runtime branches), and CI has no GPU to find out.

Each kernel module declares ``compile_signatures()`` (kernel, signature, constexprs) that
cover its constexpr branches; this test compiles them in a subprocess with
TRITON_INTERPRET=0, so the kernels are decorated for the GPU there.

ptxas's log (TRITON_DUMP_PTXAS_LOG) is read too: a kernel whose tensor-core dots ptxas
serialises (C7510, "wgmma.mma_async instructions are serialized": each wgmma waits for the
one before it, e.g. across a call to a ``noinline`` function) fails the test unless its
module declares that case in ``SERIALISED_WGMMA`` ((kernel name, constexpr subset) pairs,
with the reason beside them): serialised wgmma alone can cost a kernel several percent."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from oracle.impls.triton import KERNEL_MODULES
from tests.helpers import compile_env

ROOT = Path(__file__).resolve().parents[1]
MODULES = KERNEL_MODULES

_COMPILE = textwrap.dedent("""
    import contextlib, importlib, io, sys
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    mod = importlib.import_module(sys.argv[1])
    assert not mod.INTERPRETED
    allowed = getattr(mod, "SERIALISED_WGMMA", ())
    for kernel, sig, const in mod.compile_signatures():
        ast = ASTSource(fn=kernel, signature=sig, constexprs=const)
        log = io.StringIO()
        with contextlib.redirect_stdout(log):  # ptxas's log (TRITON_DUMP_PTXAS_LOG)
            ptx = triton.compile(ast, target=GPUTarget("cuda", 90, 32)).asm["ptx"]
        assert ".target sm_90" in ptx
        name = kernel.fn.__name__
        if "C7510" in log.getvalue() and not any(
                n == name and all(const.get(k) == v for k, v in sub.items())
                for n, sub in allowed):
            print(name, const, "SERIALISED", [ln for ln in log.getvalue().splitlines()
                                               if "C7510" in ln])
        print(name, const, "ok")
""")


@pytest.mark.sm90_compile
@pytest.mark.parametrize("module", MODULES)
def test_kernel_compiles_for_sm90(module, tmp_path):
    """The module's kernels compile to sm_90 PTX for every declared constexpr branch, and
    ptxas keeps their tensor-core dots pipelined (no C7510 serialisation) except where the
    module declares it (``SERIALISED_WGMMA``)."""
    pytest.importorskip(module)
    env = dict(compile_env(tmp_path), TRITON_DUMP_PTXAS_LOG="1")
    # No timeout: on a loaded 2-core machine a module's compiles take many minutes, and a
    # time limit would fail a correct kernel; a hung compiler shows as the job's own limit.
    r = subprocess.run([sys.executable, "-c", _COMPILE, module], cwd=ROOT, env=env,
                       capture_output=True, text=True)
    if r.returncode and ("ptxas" in r.stderr and "not found" in r.stderr):
        pytest.skip(f"no CUDA compiler toolchain in this Triton install: {r.stderr[-300:]}")
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout.count(" ok") >= 1, r.stdout
    serialised = [ln for ln in r.stdout.splitlines() if " SERIALISED " in ln]
    assert not serialised, "\n".join(serialised)
