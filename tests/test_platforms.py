"""kv_cache_dtype strings -> storage formats per platform (contract.md section 2)."""

import pytest

from reference.platforms import (
    KV_CACHE_DTYPES,
    PLATFORMS,
    index_cache_format,
    kv_cache_format,
    op_formats,
    platform_formats,
)

EXPECTED = {  # written out from contract.md's table
    ("cuda", "fp8"): "e4m3fn", ("cuda", "fp8_e4m3"): "e4m3fn", ("cuda", "fp8_e5m2"): "e5m2",
    ("rocm-ocp", "fp8"): "e4m3fn", ("rocm-ocp", "fp8_e4m3"): "e4m3fn",
    ("rocm-ocp", "fp8_e5m2"): "e5m2",
    ("rocm-fnuz", "fp8"): "e4m3fnuz", ("rocm-fnuz", "fp8_e4m3"): "e4m3fnuz",
    ("rocm-fnuz", "fp8_e5m2"): "e5m2fnuz",
}


@pytest.mark.parametrize("model_dtype", ["bfloat16", "float16"])
def test_kv_cache_dtype_table(platform, model_dtype):
    """Each string maps to contract.md's format; auto means the model dtype."""
    for kv in KV_CACHE_DTYPES:
        got = kv_cache_format(kv, platform, model_dtype)
        want = EXPECTED.get((platform, kv), model_dtype if kv == "auto" else kv)
        assert got == want, (platform, kv)


def test_index_cache_uses_the_platform_e4m3(platform):
    """An fp8 index cache is always the platform's e4m3 format."""
    assert index_cache_format(True, platform) == EXPECTED[(platform, "fp8_e4m3")]
    assert index_cache_format(False, platform, "float16") == "float16"


def test_every_platform_exercises_its_fp8_formats(platform):
    """The set of formats a test on a platform must cover holds both of its fp8 formats."""
    assert {EXPECTED[(platform, "fp8_e4m3")], EXPECTED[(platform, "fp8_e5m2")]} <= set(
        platform_formats(platform)
    )


@pytest.mark.parametrize(
    "args, argument",
    [(("fp8_e4m3fn", "cuda"), "kv_cache_dtype"), (("fp8", "rocm"), "platform"),
     (("auto", "cuda", "float32"), "model_dtype")],
)
def test_unknown_strings_list_the_valid_ones(args, argument):
    """An unknown string raises ValueError naming the argument and listing valid values."""
    with pytest.raises(ValueError, match=argument) as e:
        kv_cache_format(*args)
    valid = {"kv_cache_dtype": KV_CACHE_DTYPES, "platform": PLATFORMS,
             "model_dtype": ("bfloat16", "float16")}[argument]
    assert all(v in str(e.value) for v in valid)


def test_op_formats(platform):
    """The indexer supports the model dtype and the platform's e4m3 only; the KV ops every
    KV format of the platform (both fp8 formats included)."""
    e4m3, e5m2 = EXPECTED[(platform, "fp8_e4m3")], EXPECTED[(platform, "fp8_e5m2")]
    assert op_formats("indexer_decode", platform) == ("bfloat16", e4m3)
    for op in ("norm_rope_insert", "reshape_and_cache", "attention_prefill"):
        assert {e4m3, e5m2, "bfloat16"} <= set(op_formats(op, platform))
