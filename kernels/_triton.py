"""The one place kernel modules import Triton from.

``from kernels._triton import triton, tl`` in every kernel module guarantees that, when
``TRITON_INTERPRET=1`` is set, Triton's CPU interpreter is patched to be numerically
faithful (kernels/interpreter.py) before any kernel runs. ``triton.jit`` reads
``TRITON_INTERPRET`` when a kernel is decorated, i.e. when its module is imported: the
variable must be set before that (tests: conftest.py sets it when no CUDA device is
present; elsewhere: set it in the environment of the process).
"""

from __future__ import annotations

import triton
import triton.language as tl

from kernels.interpreter import patch_interpreter

INTERPRET: bool = bool(triton.knobs.runtime.interpret)
if INTERPRET:
    patch_interpreter()


def is_interpreted(kernel) -> bool:
    """True when ``kernel`` (a decorated function) runs in the CPU interpreter."""
    from triton.runtime.interpreter import InterpretedFunction

    return isinstance(kernel, InterpretedFunction)


def ensure_ready(kernel) -> None:
    """Call from launchers: an interpreted kernel needs the patched interpreter (in case the
    variable was set after this module was imported)."""
    if is_interpreted(kernel):
        patch_interpreter()


__all__ = ["INTERPRET", "ensure_ready", "is_interpreted", "patch_interpreter", "tl", "triton"]
