"""The example plugins (examples/): a kernel in vLLM's conventions registered through
$ORACLE_PLUGINS passes the oracle on every case it claims; its twin that views MI300's fnuz
bytes as OCP fp8 fails on exactly the rocm-fnuz fp8 cases, naming the storage format. The
lse normalisation they use is covered by the error model, tightly enough that one output
code off fails."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from oracle.core import registry, report
from oracle.core.attention_bound import _normalisation_rel, attention_bound
from oracle.core.bounds import Fp32Arith
from oracle.core.cases import Case
from oracle.core.checks import run_check
from oracle.core.reference_run import attention_call
from oracle.core.registry import arith_for, schedule_for
from reference.codec import round_dtype
from tests.helpers import plugins_registered

ROOT = Path(__file__).resolve().parent.parent
PLUGINS = "examples.vllm_style_kernel,examples.vllm_style_kernel_mislabelled"


@pytest.fixture(scope="module")
def example_impls():
    """The registry with both example plugins loaded through $ORACLE_PLUGINS; the
    project's registry and environment are restored afterwards."""
    with plugins_registered(PLUGINS) as reg:
        yield {i.name: i for i in reg.implementations("attention_decode")}


def _tiny_cases(platforms=("cuda", "rocm-ocp", "rocm-fnuz")):
    return report.default_cases(["attention_decode"], list(platforms), ["tiny"], 1)


# Beyond the default set: tensor scales, float16, several rows per request (shape class
# small), e5m2fnuz with per-slot scales.
EXTRA = [Case("attention_decode", "tiny", "normal", "cuda", "fp8", "float16", "tensor", 5),
         Case("attention_decode", "small", "outliers", "rocm-fnuz", "fp8", "bfloat16",
              "tensor", 2),
         Case("attention_decode", "small", "normal", "rocm-fnuz", "fp8_e5m2", "float16",
              "slot", 4)]


def test_vllm_style_kernel_passes_every_case_it_claims(example_impls):
    """vllm_style (uint8 caches viewed by kv_cache_dtype, token-major top-k, lse
    normalisation) passes every default tiny case on every platform and the extras."""
    impl = example_impls["vllm_style"]
    checked = 0
    for case in [*_tiny_cases(), *EXTRA]:
        if impl.supports(case)[0]:
            r = run_check(case, impl)
            assert r.passed, r.summary()
            checked += 1
    assert checked >= len(EXTRA) + 40


def test_mislabelled_kernel_fails_on_fnuz_naming_the_format(example_impls):
    """vllm_style_mislabelled fails every rocm-fnuz fp8 case, its verdict naming the
    storage format it misread, and passes the CUDA cases (where its label is right)."""
    impl = example_impls["vllm_style_mislabelled"]
    fnuz = [c for c in _tiny_cases(["rocm-fnuz"]) if c.kv_fmt.endswith("fnuz")]
    assert {c.kv_fmt for c in fnuz} == {"e4m3fnuz", "e5m2fnuz"}
    for case in fnuz:
        r = run_check(case, impl)
        assert not r.passed and f"storage format {case.kv_fmt}" in r.summary()
    for case in _tiny_cases(["cuda"])[:6]:
        assert run_check(case, impl).passed


def _single_code_element(x, impl) -> int:
    """Flat index of an output element whose admissible set is one code: the scheduled
    reference's unrounded value +- the lse bound rounds to one model-dtype value."""
    sched = schedule_for(impl, x["model_dtype"], x)
    u = attention_call(x, schedule=sched, return_details=True).unrounded
    b = attention_bound(x, sched, arith_for(impl, x))
    md = x["model_dtype"]
    with np.errstate(invalid="ignore"):
        single = (np.isfinite(u) & (u != 0) & (round_dtype(u - b, md) == round_dtype(u + b, md)))
    assert single.any(), "the bound admits two codes everywhere: vacuous"
    return int(np.flatnonzero(single.ravel())[single.sum() // 2])


def test_one_code_off_the_lse_kernel_fails(example_impls):
    """The lse-normalised kernel with one output moved by one code, where its bound admits
    a single code, fails: the lse error model sees a single code."""
    impl = example_impls["vllm_style"]

    def off_by_one(x):
        out = impl.run(x)["out"].copy()
        out.ravel()[_single_code_element(x, impl)] += 1
        return {"out": out}

    broken = registry.Implementation("vllm_style[one code off]", "attention_decode",
                                     off_by_one, schedule=impl.schedule, arith=impl.arith)
    for case in [*_tiny_cases(["cuda"])[:4], *EXTRA]:
        assert run_check(case, impl).passed
        assert not run_check(case, broken).passed, case.id


def test_lse_normalisation_bound_holds_for_fp32_arithmetic():
    """fp32 ``exp2(m - (m + log2(l)))`` (the lse factor, numpy's fp32 exp2/log2) is within
    ``_normalisation_rel`` of the exact 1/l for random row maxima and sums, and the bound is
    under 100 fp32 ulps where |m| and l are moderate (not vacuous)."""
    rng = np.random.default_rng(0)
    arith = Fp32Arith(normalise="lse")
    m2 = (rng.standard_normal(20000) * 10.0 ** rng.integers(-3, 3, 20000)).astype(np.float32)
    l_sum = (1 + rng.random(20000) * 10.0 ** rng.integers(0, 6, 20000)).astype(np.float32)
    lse = m2 + np.log2(l_sum)
    w = np.exp2(m2 - lse).astype(np.float64)
    err = np.abs(w * l_sum.astype(np.float64) - 1.0)
    eta = _normalisation_rel(arith, np.abs(m2) / np.log2(np.e), l_sum.astype(np.float64), 0)
    assert np.all(err <= eta)
    moderate = (np.abs(m2) < 10) & (l_sum < 100)
    assert eta[moderate].max() < 100 * 2.0**-23
    divide = _normalisation_rel(Fp32Arith(), 0.0, 2.0, 1)
    assert divide == Fp32Arith().div_rel + 2.0**-24


def test_example_runs_through_the_command_line(tmp_path):
    """`ORACLE_PLUGINS=examples.vllm_style_kernel python -m oracle report --ops
    attention_decode --impls vllm_style` from the repository root checks its cases, exit 0."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.update(ORACLE_PLUGINS="examples.vllm_style_kernel", PYTHONPATH=str(ROOT))
    r = subprocess.run([sys.executable, "-m", "oracle", "report", "--ops", "attention_decode",
                        "--impls", "vllm_style", "--shape-classes", "tiny", "--platforms",
                        "rocm-fnuz", "--quiet", "--out", str(tmp_path / "rep")],
                       capture_output=True, text=True, env=env, cwd=ROOT)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "| attention_decode | vllm_style |" in r.stdout


def test_arith_is_declared_per_case(example_impls):
    """An implementation's arith may be a callable of the case's inputs: arith_for calls
    it (the example declares the lse normalisation), a plain Fp32Arith comes back as is;
    an unknown normalisation is a one-line error."""
    from oracle.core.cases import make_inputs

    x = make_inputs(EXTRA[0])
    assert arith_for(example_impls["vllm_style"], x).normalise == "lse"
    assert arith_for(example_impls["reference"], x) == Fp32Arith()
    with pytest.raises(ValueError, match="normalise must be one of"):
        Fp32Arith(normalise="softmax")
