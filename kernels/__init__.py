"""Production kernels (Triton, and the Python side of csrc/), registered as torch custom ops.

Importing this package decides how Triton kernels run, for every entry point (tests, the
``oracle`` CLI, benchmarks): when no CUDA device is present and ``TRITON_INTERPRET`` is not
set, it is set to 1, so kernels run in Triton's CPU interpreter (which kernels._triton
patches to be numerically faithful). ``triton.jit`` reads the variable when a kernel is
decorated, i.e. when its ``kernels.*`` module is first imported, which always happens after
this package's ``__init__``. An explicit value wins (``TRITON_INTERPRET=1`` on a GPU
machine runs the interpreter tests there).
"""

import os


def _cuda_available() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return torch.cuda.is_available()


if "TRITON_INTERPRET" not in os.environ and not _cuda_available():
    os.environ["TRITON_INTERPRET"] = "1"
