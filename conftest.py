"""Markers, platform selection, device detection and hypothesis profiles.

- ``--platform NAME`` (repeatable; default all three): the platforms whose fp8 formats the
  ``platform`` fixture runs over. ``cuda`` is native on NVIDIA; ``rocm-ocp`` and
  ``rocm-fnuz`` are emulated through the kernels' explicit storage-format argument.
- Tests marked ``gpu`` are skipped with a reason when no CUDA device is present. On a CUDA
  machine the ``interp`` tests run compiled and count as ``gpu`` tests too: ``pytest -m
  gpu`` there runs every kernel test on the GPU.
- ``pytest -m gpu`` on a CUDA machine with pytest-xdist: as many workers as the machine
  holds, one GPU each on several GPUs, unless ``-n`` says otherwise
  (oracle/tools/pytest_workers.py, oracle/tools/gpus.py).
- Hypothesis profiles: ``ci`` (derandomized, bounded, chosen when CI=true), ``dev``
  (the default), ``nightly`` (long). Pick one with ``--hypothesis-profile``.
"""

import os

from oracle.tools.gpus import pin_worker_gpu

# The worker count of a plain ``pytest -m gpu``, and the run's report with the baseline gate
# (one tuple: a second assignment would drop the first).
pytest_plugins = ("oracle.tools.pytest_workers", "oracle.tools.pytest_gate")

# ORACLE_GPUS=N with pytest-xdist: one GPU per worker, chosen before CUDA is initialised.
pin_worker_gpu()

# The reference's matrix products are skinny: one BLAS thread is as fast as two, and
# OpenBLAS's spinning workers slow down badly when another process holds a core.
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")


# Kernels run in Triton's CPU interpreter when no CUDA device is present (unless
# TRITON_INTERPRET is set): triton.jit reads the variable when a kernel module is first
# imported, possibly while collecting an unrelated test module, so it is decided here, before
# any test module is imported. On a CUDA machine kernels compile for the GPU; run the
# interpreter tests there with TRITON_INTERPRET=1 pytest -m interp (they skip otherwise).
import kernels  # noqa: E402

kernels.use_interpreter_without_gpu()

import pytest  # noqa: E402
from hypothesis import HealthCheck, settings  # noqa: E402

from kernels import _cuda_available  # noqa: E402
from oracle.impls.catalog import load_all  # noqa: E402
from reference.platforms import PLATFORMS  # noqa: E402

settings.register_profile(
    "ci",
    derandomize=True,
    max_examples=60,
    deadline=None,
    print_blob=True,
    suppress_health_check=[HealthCheck.too_slow],
)
settings.register_profile("dev", max_examples=100, deadline=None, print_blob=True)
settings.register_profile(
    "nightly", max_examples=5000, deadline=None, print_blob=True,
    suppress_health_check=[HealthCheck.too_slow],
)
settings.load_profile("ci" if os.environ.get("CI", "").lower() == "true" else "dev")


def pytest_addoption(parser):
    parser.addoption(
        "--platform",
        action="append",
        choices=PLATFORMS,
        help="platform(s) whose fp8 formats to test (default: all, emulated where not native)",
    )


def pytest_configure(config):
    # Every implementation registered before collection: tests parametrize over the registry.
    load_all()
    if not hasattr(config, "workerinput"):
        from kernels import cuda_build

        cuda_build.prebuild()


def pytest_generate_tests(metafunc):
    if "platform" in metafunc.fixturenames:
        metafunc.parametrize("platform", metafunc.config.getoption("platform") or PLATFORMS)


@pytest.hookimpl(tryfirst=True)  # before -m deselects: the marker added here counts
def pytest_collection_modifyitems(config, items):
    if _cuda_available():
        # On a CUDA machine the interpreter tests run compiled: they are GPU tests too, so
        # ``pytest -m gpu`` runs every kernel test on the GPU (the prefill's predecode test,
        # outside ``-m gpu``, once found compiled bits that the interpreter's did not show).
        for item in items:
            if "interp" in item.keywords:
                item.add_marker(pytest.mark.gpu)
        return
    skip = pytest.mark.skip(reason="needs a CUDA device (torch.cuda.is_available() is False)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
