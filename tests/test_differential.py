"""The generic differential test: every registered implementation of every op, on every
platform (native and emulated) and storage format, over the case classes, against the
reference by the op's tolerance model. Kernel issues add implementations to the registry,
never tests. Implementations that need CUDA are marked ``gpu``; the rest run in CI.

A failure prints the check's summary and the one command that replays it.
"""

import functools
import os

import pytest

from oracle.core.cases import OPS, Case
from oracle.core.checks import run_check
from oracle.core.inputsets import case_inputs
from oracle.core.registry import implementations
from oracle.core.report import differential_cases
from oracle.tools.suite import SuiteRecorder

# A different seed offset per run explores new shapes; CI and replays use 0.
SEED0 = int(os.environ.get("ORACLE_SEED", "0"))
# Heaviest first on a cold GPU run, so that xdist starts the longest groups first and the
# light ones fill the workers' ends (one H100, cold, summed seconds per op: 2,259 / 1,006 /
# 650 / 514 / 133 / 35; per class: small 1,540, model 1,339, long 779, sweep 190, and tiny
# 749 in many short groups). Scheduled so, that run's groups take 288 s on 16 workers
# instead of 366 s in the ops' own order (a simulation over its measured times).
HEAVY_FIRST_OPS = ("attention_prefill", "indexer_decode", "attention_decode",
                   "norm_rope_insert", "indexer_prefill", "reshape_and_cache")
HEAVY_FIRST_CLASSES = ("small", "model", "long", "sweep", "tiny")


def _params():
    """CPU-capable implementations in the default run; every CUDA-capable one (a torch
    composition included) again under the ``gpu`` marker, model shapes added. Ordered
    heaviest op and shape class first, then by case, and grouped for pytest-xdist
    (``--dist loadgroup``) by shape config (by case where it has none), so that the
    implementations of one case run one after the other in one process and share its
    input set (``_inputs``), and the cases of one config share the process's compiled
    kernels."""
    params = []
    for op in OPS:
        for impl in implementations(op):
            if impl.name == "reference":
                continue  # the contract itself
            runs = [(False, [])] if "cpu" in impl.devices else []
            if "cuda" in impl.devices:
                runs.append((True, [pytest.mark.gpu]))
            for gpu, marks in runs:
                for case in differential_cases(op, gpu=gpu, seed0=SEED0):
                    if impl.supports(case)[0]:
                        params.append((gpu, case, impl.name, marks))
    params.sort(key=lambda p: (HEAVY_FIRST_OPS.index(p[1].op),
                               HEAVY_FIRST_CLASSES.index(p[1].shape_class), p[0], p[1].id))
    return [pytest.param(name, case.id, marks=[*marks, pytest.mark.xdist_group(_group(case))],
                         id=f"{'cuda' if gpu else 'cpu'}|{name}|{case.id}")
            for gpu, case, name, marks in params]


def _group(case: Case) -> str:
    """The xdist group of a case: its shape config, or the case itself."""
    if case.config is None:
        return case.id
    return f"{case.op}:{case.shape_class}:c{case.config}"


@functools.lru_cache(maxsize=2)
def _inputs(case_id: str) -> dict:
    """A case's input set, made (or read from the cache) once for all the implementations
    checked on it (seconds for the long and model cases; run_check fails an
    implementation that modifies it)."""
    return case_inputs(Case.from_id(case_id))


@pytest.mark.parametrize("impl_name, case_id", _params())
def test_implementation_matches_reference(impl_name, case_id, record_property):
    """The implementation's outputs are admissible under the op's rigorous tolerance model
    (rounded outputs within the rounding interval of exact +- bound, untouched cache slots
    bit-identical, selections equal up to near-ties, attention within its schedule's
    bound)."""
    case = Case.from_id(case_id)
    (impl,) = implementations(case.op, [impl_name])
    r = run_check(case, impl, _inputs(case_id))
    record_property(*SuiteRecorder.check_property(r))  # for --suite-report
    if any("modified its inputs" in f for f in r.failures):
        _inputs.cache_clear()  # the next implementation gets a fresh input set
    assert r.passed, r.summary()
