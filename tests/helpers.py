"""Small assertions shared by several test modules."""

import numpy as np


def assert_close(a, b, tol=1e-12):
    """Equal up to float64 summation order (relative to the largest magnitude)."""
    a, b = np.asarray(a), np.asarray(b)
    assert a.shape == b.shape
    assert not np.isnan(a).any() and not np.isnan(b).any()
    scale = max(1.0, float(np.max(np.abs(b), initial=0.0)))
    err = float(np.max(np.abs(a - b), initial=0.0))
    assert err <= tol * scale, f"max |a - b| = {err:.3g} > {tol:.1g} * {scale:.3g}"


def same_float(a, b) -> np.ndarray:
    """Bitwise-equal values (so -0 != +0), any two NaNs equal."""
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return (a.view(np.uint64) == b.view(np.uint64)) | (np.isnan(a) & np.isnan(b))


def bad_args(good, name: str, **changes):
    """A pytest.param of (factory, name) for a bad-input test: the factory returns
    ``good()`` with the given arguments replaced (a callable change is applied to the good
    arguments); ``name`` is the argument the error must name."""
    import pytest

    def make():
        args = good()
        args.update({k: (v(args) if callable(v) else v) for k, v in changes.items()})
        return args
    return pytest.param(make, name, id=f"{name}-{'-'.join(changes)}")


def compile_env(tmp_path) -> dict:
    """Environment of a subprocess that compiles Triton kernels for a GPU on this machine:
    TRITON_INTERPRET=0 explicitly (importing ``kernels`` without CUDA would otherwise turn
    the interpreter on), the repo importable, a private Triton cache."""
    import os
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    return dict(os.environ, TRITON_INTERPRET="0", PYTHONPATH=str(root),
                TRITON_CACHE_DIR=str(tmp_path))
