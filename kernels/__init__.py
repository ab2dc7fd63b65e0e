"""Production kernels (Triton, and the Python side of csrc/), registered as torch custom ops.

Importing this package changes nothing. Entry points (conftest.py, the ``oracle`` CLI,
benchmarks) call ``use_interpreter_without_gpu()`` before any kernel module is imported:
``triton.jit`` reads ``TRITON_INTERPRET`` when a kernel is decorated, i.e. when its
``kernels.*`` module is first imported, and kernels._triton then patches Triton's CPU
interpreter to be numerically faithful (kernels/interpreter.py).
"""

import os


def _cuda_available() -> bool:
    """Whether torch is importable and sees a CUDA device."""
    try:
        import torch
    except ImportError:
        return False
    return torch.cuda.is_available()


def use_interpreter_without_gpu() -> bool:
    """Set ``TRITON_INTERPRET=1`` when no CUDA device is present and the variable is not
    set, so kernels imported afterwards run in Triton's CPU interpreter; an explicit value
    wins (``TRITON_INTERPRET=1`` on a GPU machine runs the interpreter tests there).
    Returns whether kernels will be interpreted."""
    if "TRITON_INTERPRET" not in os.environ and not _cuda_available():
        os.environ["TRITON_INTERPRET"] = "1"
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")
