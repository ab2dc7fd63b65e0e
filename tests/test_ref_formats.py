"""The storage-format table (reference.formats) against ml_dtypes and vLLM's conventions."""

import ml_dtypes
import numpy as np
import pytest

from reference.formats import (
    FORMATS,
    FP8_FORMATS,
    INDEX_FP8_FORMATS,
    KV_CACHE_FP8_KINDS,
    MODEL_DTYPES,
    PLATFORMS,
    native_fp8,
    platform_fp8,
)
from reference.platforms import kv_cache_format

ML_TYPES = {"e4m3fn": ml_dtypes.float8_e4m3fn, "e5m2": ml_dtypes.float8_e5m2,
            "e4m3fnuz": ml_dtypes.float8_e4m3fnuz, "e5m2fnuz": ml_dtypes.float8_e5m2fnuz,
            "bfloat16": ml_dtypes.bfloat16, "float16": np.float16}


def _all_values(name):
    f = FORMATS[name]
    codes = np.arange(1 << f.bits, dtype=f.code_dtype)
    with np.errstate(invalid="ignore"):  # signalling NaN codes convert to quiet NaNs
        return codes, codes.view(ML_TYPES[name]).astype(np.float64)


@pytest.mark.parametrize("name", list(FORMATS))
def test_bits_bias_and_extremes_agree_with_ml_dtypes(name):
    """Width, mantissa bits, bias (via the smallest normal), max finite and the smallest
    subnormal of each row equal ml_dtypes' finfo for the same format."""
    f, info = FORMATS[name], ml_dtypes.finfo(ML_TYPES[name])
    assert f.bits == info.bits
    assert f.man_bits == info.nmant and f.exp_bits == info.nexp
    assert 1 - f.bias == info.minexp
    assert f.max_finite == float(info.max)
    assert f.min_normal == float(info.smallest_normal)
    assert f.min_subnormal == float(info.smallest_subnormal)


@pytest.mark.parametrize("name", list(FORMATS))
def test_special_codes_agree_with_ml_dtypes(name):
    """The NaN codes, Inf codes, the negative-zero code and the max-finite code of each row
    are the codes ml_dtypes decodes to NaN, +-Inf, -0 and max; the canonical NaN is a NaN."""
    f = FORMATS[name]
    codes, values = _all_values(name)
    nan = np.isnan(values)
    assert nan[f.nan_code]
    assert nan.sum() == {"ieee": 2 * ((1 << f.man_bits) - 1), "fn": 2, "fnuz": 1}[f.specials]
    inf = np.flatnonzero(np.isinf(values))
    assert tuple(inf) == (() if f.inf_code is None else (f.inf_code, f.inf_code | f.sign_bit))
    neg_zero = np.flatnonzero((values == 0) & np.signbit(values))
    assert tuple(neg_zero) == (() if f.negative_zero_code is None else (f.negative_zero_code,))
    assert values[f.max_code] == float(ml_dtypes.finfo(ML_TYPES[name]).max)


def test_kernel_codes_are_distinct_and_fp8_first():
    """Every row has its own kernel code; the fp8 formats take 0..3 (the kernels' FMT
    constexpr) and the 16-bit model dtypes follow."""
    codes = [FORMATS[n].kernel_code for n in (*FP8_FORMATS, *MODEL_DTYPES)]
    assert codes == list(range(len(FORMATS)))


def test_torch_dtype_names_match_ml_dtypes_names():
    """torch names its fp8 and 16-bit dtypes as ml_dtypes does (float8_e4m3fn, ...)."""
    for name, f in FORMATS.items():
        assert f.torch_dtype == np.dtype(ML_TYPES[name]).name


@pytest.mark.parametrize("plat", PLATFORMS)
def test_each_platform_converts_one_format_per_kind(plat):
    """Each platform converts exactly one e4m3 and one e5m2 format natively: the OCP pair on
    cuda and rocm-ocp, the fnuz pair on rocm-fnuz (MI300)."""
    fnuz = plat == "rocm-fnuz"
    assert native_fp8(plat) == (("e4m3fnuz", "e5m2fnuz") if fnuz else ("e4m3fn", "e5m2"))
    assert platform_fp8("e4m3", plat) == ("e4m3fnuz" if fnuz else "e4m3fn")


def test_vllm_kv_cache_dtype_strings():
    """vLLM's "fp8" and "fp8_e4m3" are the platform's e4m3 (e4m3fnuz on MI300), "fp8_e5m2"
    its e5m2; the index cache's fp8 formats are the platforms' e4m3."""
    assert set(KV_CACHE_FP8_KINDS) == {"fp8", "fp8_e4m3", "fp8_e5m2"}
    assert kv_cache_format("fp8", "cuda") == "e4m3fn"
    assert kv_cache_format("fp8", "rocm-fnuz") == "e4m3fnuz"
    assert kv_cache_format("fp8_e4m3", "rocm-fnuz") == "e4m3fnuz"
    assert kv_cache_format("fp8_e5m2", "rocm-ocp") == "e5m2"
    assert INDEX_FP8_FORMATS == ("e4m3fn", "e4m3fnuz")


def test_platform_fp8_rejects_unknown_arguments():
    """An unknown platform or kind is a one-line ValueError naming the argument."""
    with pytest.raises(ValueError, match="platform must be one of"):
        platform_fp8("e4m3", "tpu")
    with pytest.raises(ValueError, match="kind must be"):
        platform_fp8("e3m4", "cuda")
