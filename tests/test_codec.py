"""The reference fp8/bf16/fp16 codec against ml_dtypes and the format definitions."""

import ml_dtypes
import numpy as np
import pytest

from oracle.tools import conformance
from reference.codec import FORMATS, FP8_FORMATS, POLICIES, decode, encode, round_to

# The format definitions written out independently of reference.codec (OCP FP8 spec v1.0
# and the fnuz variants of AMD/Graphcore), as in contract.md section 1.
DEFINITIONS = {
    "e4m3fn": dict(bias=7, max=448.0, max_code=0x7E, min_normal=2**-6, min_sub=2**-9,
                   inf=(), nan=(0x7F, 0xFF), neg_zero=0x80),
    "e5m2": dict(bias=15, max=57344.0, max_code=0x7B, min_normal=2**-14, min_sub=2**-16,
                 inf=(0x7C, 0xFC), nan=(0x7D, 0x7E, 0x7F, 0xFD, 0xFE, 0xFF), neg_zero=0x80),
    "e4m3fnuz": dict(bias=8, max=240.0, max_code=0x7F, min_normal=2**-7, min_sub=2**-10,
                     inf=(), nan=(0x80,), neg_zero=None),
    "e5m2fnuz": dict(bias=16, max=57344.0, max_code=0x7F, min_normal=2**-15, min_sub=2**-17,
                     inf=(), nan=(0x80,), neg_zero=None),
}


@pytest.fixture(scope="module")
def sets():
    return {s: conformance.source_set(s) for s in conformance.SOURCE_DTYPES}


def _same_values(a, b):
    """Equal as values including the sign of zero; NaN equals NaN."""
    return np.all((a == b) & (np.signbit(a) == np.signbit(b)) | (np.isnan(a) & np.isnan(b)))


@pytest.mark.parametrize("fmt", FP8_FORMATS)
def test_every_code_decodes_as_ml_dtypes(fmt):
    """All 256 codes decode to exactly the value ml_dtypes gives them (signed zeros too)."""
    codes = np.arange(256, dtype=np.uint8)
    theirs = codes.view(conformance.ML_DTYPES[fmt]).astype(np.float64)
    assert _same_values(decode(codes, fmt), theirs)


@pytest.mark.parametrize("fmt", FP8_FORMATS)
def test_format_constants_match_the_definitions(fmt):
    """Bias, extremes and the special codes agree with the independently written table."""
    f, d = FORMATS[fmt], DEFINITIONS[fmt]
    assert (f.bias, f.max_finite, f.max_code) == (d["bias"], d["max"], d["max_code"])
    assert (f.min_normal, f.min_subnormal) == (d["min_normal"], d["min_sub"])
    values = decode(np.arange(256, dtype=np.uint8), fmt)
    assert tuple(np.flatnonzero(np.isnan(values))) == d["nan"]
    assert tuple(np.flatnonzero(np.isinf(values))) == d["inf"]
    zeros = np.flatnonzero(values == 0)
    assert tuple(zeros) == ((0,) if d["neg_zero"] is None else (0, d["neg_zero"]))
    assert np.nanmax(values[np.isfinite(values)]) == d["max"]


@pytest.mark.parametrize("source", conformance.SOURCE_DTYPES)
@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("fmt", FP8_FORMATS)
def test_encode_matches_ml_dtypes(sets, fmt, policy, source):
    """Every bf16/fp16 pattern and >= 2M float32 values encode exactly as ml_dtypes casts
    (nonsaturating) or clips-then-casts (satfinite); two NaN codes count as equal."""
    x = sets[source]
    if source == "float32":
        assert x.size >= 2_000_000
    ours, theirs = encode(x, fmt, policy), conformance.ml_dtypes_encode(x, fmt, policy)
    assert conformance.count_mismatches(ours, theirs, fmt) == 0


@pytest.mark.parametrize("fmt", FP8_FORMATS)
def test_spec_examples_of_rounding_before_overflow(fmt):
    """contract.md s.1: 464 -> 448 in e4m3fn; 61440 -> Inf in e5m2; 248 -> NaN in e4m3fnuz;
    NaN -> 0x7F (OCP) / 0x80 (fnuz) under satfinite; -0 -> 0x80 (OCP) / 0x00 (fnuz)."""
    nan_code = 0x80 if "fnuz" in fmt else 0x7F
    assert encode(np.float32([np.nan]), fmt, "satfinite")[0] == nan_code
    assert encode(np.float32([-0.0]), fmt)[0] == (0x00 if "fnuz" in fmt else 0x80)
    if fmt == "e4m3fn":
        assert decode(encode(np.float32([464.0]), fmt, "nonsaturating"), fmt)[0] == 448.0
    if fmt == "e5m2":
        assert np.isposinf(decode(encode(np.float32([61440.0]), fmt, "nonsaturating"), fmt)[0])
    if fmt == "e4m3fnuz":
        assert np.isnan(decode(encode(np.float32([248.0]), fmt, "nonsaturating"), fmt)[0])
    big = np.float32([1e30, -np.inf])
    assert list(decode(encode(big, fmt, "satfinite"), fmt)) == [FORMATS[fmt].max_finite,
                                                               -FORMATS[fmt].max_finite]


@pytest.mark.parametrize("fmt", FP8_FORMATS)
def test_encode_is_the_nearest_grid_value_in_float64(fmt):
    """At every finite magnitude, every midpoint between neighbours (the first value past
    max included) and the float64 neighbours of both, satfinite encode gives the nearest
    code by brute force over the whole grid, ties to the even code, overflow to max: the
    float64 inputs between float32 values that the ml_dtypes comparison cannot reach."""
    f = FORMATS[fmt]
    grid = f._grid
    mid = (grid[1:] + grid[:-1]) / 2
    pts = np.concatenate([grid, mid, [2 * grid[-1]]])
    mags = np.concatenate([pts, np.nextafter(pts, 0), np.nextafter(pts, np.inf)])
    dist = np.abs(mags[:, None] - grid[None, :])
    nearest = dist == dist.min(axis=1, keepdims=True)
    # Of two nearest codes the even one (a tie has exactly two, adjacent).
    even = nearest & (np.arange(len(grid)) % 2 == 0)
    want = np.where(even.any(axis=1), even.argmax(axis=1), nearest.argmax(axis=1))
    want = np.minimum(want, f.max_code)
    for sign, bit in ((1.0, 0), (-1.0, f.sign_bit)):
        got = encode(sign * mags, fmt).astype(np.int64)
        zero = want == 0
        exp = np.where(zero & (f.specials == "fnuz"), 0, want | bit)
        assert np.array_equal(got, exp), mags[got != exp][:8]


@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("fmt", FP8_FORMATS)
def test_round_trip_of_every_representable_value(fmt, policy):
    """encode(decode(c)) == c for every code that is not NaN or Inf."""
    codes = np.arange(256, dtype=np.uint8)
    values = decode(codes, fmt)
    finite = np.isfinite(values)
    assert np.array_equal(encode(values[finite], fmt, policy), codes[finite])


@pytest.mark.parametrize("fmt", FP8_FORMATS)
def test_scale_divides_before_encoding(fmt):
    """encode(decode(c) * s, scale=s) == c for random float32 scales (the product is exact
    in float64), and a scaled encode is within half an fp8 step (times s) of the value."""
    codes = np.arange(256, dtype=np.uint8)
    values = decode(codes, fmt)
    finite = np.isfinite(values)
    for s in np.float32([0.5, 0.0173, 3.7, 1e-3]):
        assert np.array_equal(encode(values[finite] * s, fmt, scale=s), codes[finite])
    s = np.float32(0.37)
    top = 0.99 * FORMATS[fmt].max_finite * s
    x = np.linspace(-top, top, 2001, dtype=np.float32)
    back = decode(encode(x, fmt, scale=s), fmt) * s
    grid = np.unique(np.abs(values[finite])) * s
    step = np.diff(grid)[np.clip(np.searchsorted(grid, np.abs(x)) - 1, 0, len(grid) - 2)]
    assert np.all(np.abs(back - x) <= step / 2 * (1 + 1e-12))


@pytest.mark.parametrize("fmt,dtype", [("bfloat16", ml_dtypes.bfloat16), ("float16", np.float16)])
def test_bf16_fp16_rounding_matches_ml_dtypes(sets, fmt, dtype):
    """round_to(x, bf16/fp16) equals ml_dtypes/numpy's RNE cast on all the source sets,
    and every 16-bit pattern decodes to its own value."""
    for x in sets.values():
        with np.errstate(invalid="ignore", over="ignore"):
            theirs = x.astype(dtype).astype(np.float64)
        assert _same_values(round_to(x, fmt), theirs)
    patterns = np.arange(1 << 16, dtype=np.uint32).astype(np.uint16)
    with np.errstate(invalid="ignore"):
        theirs = patterns.view(dtype).astype(np.float64)
    assert _same_values(decode(patterns, fmt), theirs)


@pytest.mark.parametrize(
    "call, argument",
    [
        (lambda: encode(np.float32([1.0]), "e4m3fn", scale=0.0), "scale"),
        (lambda: encode(np.float32([1.0]), "e4m3fn", scale=-2.0), "scale"),
        (lambda: encode(np.float32([1.0]), "e4m3fn", scale=np.inf), "scale"),
        (lambda: encode(np.float32([1.0]), "e4m3fn", scale=np.nan), "scale"),
        (lambda: encode(np.float32([1.0]), "e4m3", "satfinite"), "fmt"),
        (lambda: encode(np.array([1, 2]), "e4m3fn"), "x"),
        (lambda: encode(np.float32([1.0]), "e4m3fn", policy="saturate"), "policy"),
        (lambda: decode(np.array([256]), "e4m3fn"), "codes"),
        (lambda: decode(np.float32([1.0]), "e4m3fn"), "codes"),
    ],
)
def test_bad_input_names_the_argument(call, argument):
    """Bad input raises ValueError whose message starts with the argument's name."""
    with pytest.raises(ValueError, match=rf"^{argument} "):
        call()
