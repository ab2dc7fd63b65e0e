"""oracle.impls.conventions: vLLM's conventions and the converters from the oracle's case
inputs, each checked against the reference's own definitions (formats, platforms, layouts)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from oracle.impls import conventions as cv
from reference.codec import FP8_FORMATS, decode, encode
from reference.platforms import PLATFORMS


@pytest.mark.parametrize("fmt", [*FP8_FORMATS, "bfloat16", "float16"])
def test_torch_dtype_views_decode_like_the_reference(fmt):
    """Every code of a format, viewed with torch_dtype(fmt), has the reference's value (NaN
    where the reference decodes NaN); oracle_format inverts torch_dtype."""
    n = 256 if fmt in FP8_FORMATS else 1 << 16
    codes = np.arange(n, dtype=np.uint8 if n == 256 else np.uint16)
    got = cv.cache_view(codes, fmt).double().numpy()
    want = decode(codes, fmt)
    assert np.array_equal(got, want, equal_nan=True)
    assert cv.oracle_format(cv.torch_dtype(fmt)) == fmt


def test_cache_view_rejects_the_wrong_storage_width():
    """A 2-byte array viewed as an fp8 format (or bytes as bf16) is a one-line ValueError."""
    with pytest.raises(ValueError, match="1-byte elements"):
        cv.cache_view(np.zeros(4, np.uint16), "e4m3fn")
    with pytest.raises(ValueError, match="fmt must be one of"):
        cv.torch_dtype("e4m3")


# vLLM's platform code: fp8 / fp8_e4m3 are float8_e4m3fn on CUDA and gfx950, and
# float8_e4m3fnuz on MI300 (gfx942); fp8_e5m2 likewise e5m2 / e5m2fnuz; auto the model dtype.
VLLM_TABLE = {
    ("fp8", "cuda"): torch.float8_e4m3fn, ("fp8_e4m3", "cuda"): torch.float8_e4m3fn,
    ("fp8_e5m2", "cuda"): torch.float8_e5m2, ("fp8", "rocm-ocp"): torch.float8_e4m3fn,
    ("fp8_e5m2", "rocm-ocp"): torch.float8_e5m2, ("fp8", "rocm-fnuz"): torch.float8_e4m3fnuz,
    ("fp8_e4m3", "rocm-fnuz"): torch.float8_e4m3fnuz,
    ("fp8_e5m2", "rocm-fnuz"): torch.float8_e5m2fnuz,
    ("auto", "cuda"): torch.bfloat16, ("auto", "rocm-fnuz"): torch.bfloat16,
}


@pytest.mark.parametrize("key", sorted(VLLM_TABLE))
def test_kv_cache_dtype_strings_resolve_per_platform_as_vllm_does(key):
    """resolve_kv_cache_dtype gives vLLM's dtype for each (string, platform)."""
    assert cv.resolve_kv_cache_dtype(*key, "bfloat16") == VLLM_TABLE[key]


@pytest.mark.parametrize("fmt", [*FP8_FORMATS, "bfloat16"])
def test_vllm_name_of_a_format_resolves_back_to_it(fmt):
    """The (kv_cache_dtype, platform) vllm_kv_cache_dtype names resolves to the format."""
    name, platform = cv.vllm_kv_cache_dtype(fmt, "bfloat16")
    assert platform in PLATFORMS
    assert cv.resolve_kv_cache_dtype(name, platform, "bfloat16") == cv.torch_dtype(fmt)


def test_bad_convention_names_are_one_line_errors():
    """Unknown strings name the argument and the valid values."""
    with pytest.raises(ValueError, match="kv_cache_dtype must be one of"):
        cv.resolve_kv_cache_dtype("fp8_e4m3fnuz", "cuda")
    with pytest.raises(ValueError, match="layout must be one of"):
        cv.split_kv_cache(np.zeros((1, 1, 1, 2), np.uint8), "e4m3fn", "NDH")
    with pytest.raises(ValueError, match="ordering must be one of"):
        cv.order_selection(torch.zeros(1, 1, dtype=torch.int32), "random")
    with pytest.raises(ValueError, match="form must be one of"):
        cv.scale_form(1.0, "channel", 1, 1)


@pytest.mark.parametrize("layout", cv.LAYOUTS)
def test_split_kv_cache_puts_each_code_where_the_layout_says(layout):
    """Key code (page b, head h, slot p, dim i) of the oracle's combined cache is at
    [b, p, h, i] (NHD) or [b, h, p, i] (HND) of key_cache; value codes likewise."""
    rng = np.random.default_rng(0)
    codes = rng.integers(0, 256, (3, 2, 4, 2 * 5), dtype=np.uint8)
    k, v = cv.split_kv_cache(codes, "e4m3fnuz", layout)
    assert k.dtype == torch.float8_e4m3fnuz
    kb, vb = k.view(torch.uint8).numpy(), v.view(torch.uint8).numpy()
    for b, h, p, i in np.ndindex(3, 2, 4, 5):
        at = (b, p, h, i) if layout == "NHD" else (b, h, p, i)
        assert kb[at] == codes[b, h, p, i] and vb[at] == codes[b, h, p, 5 + i]


def test_topk_layouts_hold_the_same_entries():
    """Token-major [T, Hkv, K] entry (t, h, j) is head-major (h, t, j); head is unchanged."""
    topk = np.arange(2 * 3 * 4).reshape(2, 3, 4) - 5
    tok = cv.topk_layout(topk, "token").numpy()
    assert tok.shape == (3, 2, 4) and tok.dtype == np.int32
    for h, t, j in np.ndindex(2, 3, 4):
        assert tok[t, h, j] == topk[h, t, j]
    assert np.array_equal(cv.topk_layout(topk, "head").numpy(), topk)


def test_selection_orderings_move_the_padding_last():
    """valid_first: the valid entries in their given order, then the -1s; sorted: the valid
    entries ascending, then the -1s; both keep every entry (a permutation of the row)."""
    row = torch.tensor([[-1, 7, 3, -1, 9, 3]], dtype=torch.int32)
    assert cv.order_selection(row, "valid_first").tolist() == [[7, 3, 9, 3, -1, -1]]
    assert cv.order_selection(row, "sorted").tolist() == [[3, 3, 7, 9, -1, -1]]


def test_scale_forms_hold_the_cases_scales():
    """token form [slot, h] is the case's [h, slot]; a per-head constant gives the head
    form; a scalar the tensor form; scales that vary where the form cannot are an error."""
    s = np.array([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]])
    tok = cv.scale_form(s, "token", 2, 3)
    assert tok.dtype == torch.float32 and tok.numpy().tolist() == s.T.tolist()
    heads = np.array([[0.5] * 3, [0.25] * 3])
    assert cv.scale_form(heads, "head", 2, 3).tolist() == [0.5, 0.25]
    assert cv.scale_form(0.75, "tensor", 2, 3).item() == 0.75
    assert cv.scale_form(0.75, "head", 2, 3).tolist() == [0.75, 0.75]
    assert cv.scale_form(None, "token", 2, 3) is None
    with pytest.raises(ValueError, match="vary across slots"):
        cv.scale_form(s, "head", 2, 3)
    with pytest.raises(ValueError, match="vary across heads"):
        cv.scale_form(heads, "tensor", 2, 3)


@pytest.mark.parametrize("model_dtype", ["bfloat16", "float16"])
def test_output_codes_are_the_references_rounding(model_dtype):
    """fp32 outputs become the model dtype's round-to-nearest-even codes, as the
    reference encodes the same values (overflow to Inf, as a cast does)."""
    rng = np.random.default_rng(1)
    x = np.concatenate([rng.standard_normal(1000) * 10.0 ** rng.integers(-8, 5, 1000),
                        [0.0, -0.0, 1e6, np.inf, -np.inf]]).astype(np.float32)
    got = cv.output_codes(torch.from_numpy(x), model_dtype)
    want = encode(x.astype(np.float64), model_dtype, "nonsaturating")
    assert got.dtype == np.uint16 and np.array_equal(got, want)
