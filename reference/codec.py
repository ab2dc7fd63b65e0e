"""Bit-exact codecs for the fp8 formats (and bf16/fp16) in float64 NumPy.

``reference.formats.FORMATS`` defines every format by its bit split, bias and special-value
conventions; ``decode`` and ``encode`` are derived from it and nothing else.

Encoding is round-to-nearest-even onto the format's finite grid (subnormals included),
then one of two overflow policies (contract.md section 1):

``satfinite``      NVIDIA ``cvt.rn.satfinite`` / vLLM KV writes: overflow and +-Inf become
                   +-max finite; NaN becomes the format's canonical NaN code.
``nonsaturating``  OCP "overflow" mode, what ml_dtypes ``astype`` does: overflow and Inf
                   become Inf where the format has one (e5m2, bf16, fp16), else NaN.

Rounding happens before the overflow decision, so a value within half a step above max
may still round down to max (464 -> 448 in e4m3fn) and a tie past max rounds to even,
which can be the first value past max (61440 -> Inf in e5m2).

The optional ``scale`` divides first (``value / scale`` in float64). For float32 values
and scales this is as good as an exact quotient: an inexact quotient lies at least
~2^-30 (relative) from any fp8 grid point or midpoint, far beyond float64's 2^-53, so the
second rounding can never cross a midpoint.
"""

from __future__ import annotations

import numpy as np

# The table is re-exported: the codec's callers name formats through it.
from reference.formats import FORMATS, FP8_FORMATS, FloatFormat, get_format  # noqa: F401

POLICIES = ("satfinite", "nonsaturating")


def as_float64(x, name: str = "x") -> np.ndarray:
    """float64 copy of a floating-point array (bf16 via ml_dtypes included); every
    narrower float converts exactly. Integers and other kinds are rejected."""
    a = np.asarray(x)
    ml_float = a.dtype.name == "bfloat16" or a.dtype.name.startswith("float8")
    if a.dtype.kind != "f" and not ml_float:
        raise ValueError(f"{name} must be a floating-point array, got dtype {a.dtype}")
    with np.errstate(invalid="ignore"):  # signalling NaNs convert to quiet NaNs, as meant
        return a.astype(np.float64)


def check_scale(scale, name: str = "scale") -> np.ndarray:
    s = np.asarray(scale, dtype=np.float64)
    if s.size and not (np.all(np.isfinite(s)) and np.all(s > 0)):
        raise ValueError(f"{name} must be finite and > 0 everywhere, got {s.ravel()[:8]}")
    return s


def decode(codes, fmt: str | FloatFormat) -> np.ndarray:
    """float64 value of each code (exact; NaN/Inf codes give NaN/Inf)."""
    f = get_format(fmt)
    c = np.asarray(codes)
    if c.dtype.kind not in "ui":
        raise ValueError(f"codes must be an integer array, got dtype {c.dtype}")
    if c.size and (c.min() < 0 or c.max() >= 1 << f.bits):
        raise ValueError(f"codes must lie in [0, {(1 << f.bits) - 1}] for {f.name}")
    return f.values[c.astype(np.int64)]


def _magnitude_codes(mag: np.ndarray, f: FloatFormat) -> np.ndarray:
    """Codes of finite magnitudes rounded to nearest-even as if the exponent range went on
    past the top (a code above ``max_code`` means overflow; ``_grid`` lists the values).

    Exact arithmetic, no table search: with E = max(floor(log2 mag), emin), mag * 2^(m - E)
    is an exact float64 scaling, and rint rounds it half-to-even to the significand q
    (2^m..2^(m+1) for normals, 0..2^m below); code = (E - emin) * 2^m + q, so q = 2^(m+1)
    carries into the next binade and q's parity is the code's. ``tests/test_codec.py``
    checks it against a search of ``_grid`` at every grid value, midpoint and neighbour."""
    m, emin = f.man_bits, 1 - f.bias
    mag = np.minimum(mag, 4 * f.max_finite)  # past any overflow; keeps q small
    e = np.where(mag < f.min_normal, emin, np.frexp(mag)[1] - 1)
    q = np.rint(np.ldexp(mag, m - e))
    return ((e - emin).astype(np.int64) << m) + q.astype(np.int64)


def encode(x, fmt: str | FloatFormat, policy: str = "satfinite", scale=None) -> np.ndarray:
    """Codes of ``x / scale`` rounded to nearest-even, with the given overflow policy."""
    f = get_format(fmt)
    if policy not in POLICIES:
        raise ValueError(f"policy must be one of {POLICIES}, got {policy!r}")
    v = as_float64(x)
    if scale is not None:
        v = v / check_scale(scale)
    finite = np.isfinite(v)
    code = _magnitude_codes(np.where(finite, np.abs(v), 0.0), f)
    overflow = ~finite | (code > f.max_code)
    if policy == "satfinite":
        code = np.where(overflow, f.max_code, code)
    elif f.inf_code is not None:
        code = np.where(overflow, f.inf_code, code)
    negative = np.signbit(v)
    if f.specials == "fnuz":
        negative &= code != 0  # no -0: it encodes as +0
    code = code | np.where(negative, f.sign_bit, 0)
    if policy == "nonsaturating" and f.inf_code is None:
        code = np.where(overflow, f.nan_code, code)
    code = np.where(np.isnan(v), f.nan_code, code)
    return code.astype(f.code_dtype)


ROUNDING_DTYPES = ("float64", "float32", "bfloat16", "float16")


def round_to(x, fmt: str | FloatFormat) -> np.ndarray:
    """float64 values of x rounded (RNE, non-saturating) to a format, e.g. bf16 or fp16."""
    name = fmt.name if isinstance(fmt, FloatFormat) else fmt
    if name in ("bfloat16", "float16"):
        return round_dtype(as_float64(x), name)
    return decode(encode(x, fmt, "nonsaturating"), fmt)


def round_by_table(x, dtype: str) -> np.ndarray:
    """float64 values of x rounded once (RNE, non-saturating) to ``dtype`` by ``encode`` and
    ``decode`` (float32: NumPy's cast): the slow path the literal forms use, independent of
    ``round_dtype``'s bit tricks."""
    x = np.asarray(x, dtype=np.float64)
    if dtype == "float64":
        return x
    if dtype == "float32":
        with np.errstate(over="ignore"):
            return x.astype(np.float32).astype(np.float64)
    return decode(encode(x, dtype, "nonsaturating"), dtype)


def round_dtype(x, dtype: str) -> np.ndarray:
    """float64 values of x rounded once (RNE, non-saturating: overflow -> +-Inf, NaN kept)
    to ``dtype`` (float64, float32, bfloat16 or float16): the fast path of ``round_to``.

    float32/float16: NumPy's float64 casts (correctly rounded, single rounding). bfloat16:
    see ``bf16_from_f32``; ml_dtypes is not used, its float64 -> bfloat16 cast rounds
    through float32 without correcting the double rounding."""
    if dtype == "float64":
        return x
    with np.errstate(over="ignore", invalid="ignore"):
        x = np.asarray(x, np.float64)
        if dtype == "float32":
            return x.astype(np.float32).astype(np.float64)
        if dtype == "float16":
            return x.astype(np.float16).astype(np.float64)
        if dtype != "bfloat16":
            raise ValueError(f"dtype must be one of {ROUNDING_DTYPES}, got {dtype!r}")
        return bf16_from_f32(x.astype(np.float32), x)


def bf16_from_f32(x32: np.ndarray, exact: np.ndarray | None = None) -> np.ndarray:
    """float64 values of bf16 RNE(exact), given x32 = RNE_fp32(exact) (exact=None: x32 is
    the exact value). RNE on the fp32 bit pattern (drop 16 bits; fp32 and bf16 share the
    exponent field, so subnormals and overflow to Inf come out right; NaN is set back to
    NaN afterwards). fp32 first is a double rounding that errs only where
    x32 lands exactly on a bf16 midpoint while the exact value does not: those few are
    rounded by the side the exact value lies on."""
    b = np.ascontiguousarray(x32).view(np.uint32)
    r = b >> 16
    r &= 1
    r += 0x7FFF
    r += b
    r &= 0xFFFF0000
    if exact is not None:
        tie = np.flatnonzero((b & np.uint32(0xFFFF)) == np.uint32(0x8000))
        if tie.size:
            bt = b.ravel()[tie]
            ex = np.abs(exact.ravel()[tie])
            lo = np.abs(x32.ravel()[tie].astype(np.float64))
            away = (bt + np.uint32(0x8000)) & np.uint32(0xFFFF0000)
            toward = bt & np.uint32(0xFFFF0000)
            fix = np.where(ex > lo, away, np.where(ex < lo, toward, r.ravel()[tie]))
            r = r.ravel()
            r[tie] = fix
            r = r.reshape(b.shape)
    out = r.view(np.float32).reshape(np.shape(x32)).astype(np.float64)
    nan = np.isnan(x32)  # NaN payloads in the low bits would carry into the sign or vanish
    if nan.any():
        out[nan] = np.nan
    return out



def to_bf16(x) -> np.ndarray:
    return round_to(x, "bfloat16")


def to_fp16(x) -> np.ndarray:
    return round_to(x, "float16")
