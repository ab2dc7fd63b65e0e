"""The rounding-interval oracle: which rounded outputs a correct implementation may return.

An implementation computes some value y_hat in fp32 and rounds it once to a storage
format (bf16/fp16 values, fp8 codes). The reference supplies the exact value e (float64)
and a rigorous bound d with |y_hat - e| <= d. Rounding is monotone, so the admissible
outputs are exactly the roundings of the values in [e - d, e + d]: every code between
round(e - d) and round(e + d) in value order (+0 and -0 counting as one value).

Codes are compared by *ordinal*: a sign-magnitude code maps to a signed integer that grows
with the value (+-0 -> 0), so "one ULP away" is an ordinal difference of one in every
format, fp8 included.
"""

from __future__ import annotations

import functools

import numpy as np

from reference.codec import decode, encode, get_format


def ordinal(codes, fmt) -> np.ndarray:
    """Signed integer growing with the value of each code; +0 and -0 both map to 0."""
    f = get_format(fmt)
    return _tables(f)[0][_index(codes, f)]


def _code_ordinals(c: np.ndarray, f) -> np.ndarray:
    magnitude = c & (f.sign_bit - 1)
    return np.where(c & f.sign_bit, -magnitude, magnitude)


@functools.cache
def _tables(f) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(ordinal, preimage lo, preimage hi) of every code of format ``f``, so that a check
    looks codes up (two gathers) instead of computing a dozen temporaries per element."""
    every = np.arange(1 << f.bits, dtype=np.int64)
    return _code_ordinals(every, f), *_code_preimages(every, f)


def _index(codes, f) -> np.ndarray:
    """``codes`` as indices into a format's tables (the low ``bits`` bits, as the sign and
    magnitude masks read them)."""
    c = np.asarray(codes)
    return c if c.dtype == f.code_dtype else c.astype(np.int64) & ((1 << f.bits) - 1)


def round_codes(values, fmt, scale=None) -> np.ndarray:
    """RNE codes: satfinite for fp8 (the kernels' conversion), nonsaturating for bf16/fp16."""
    policy = "satfinite" if get_format(fmt).bits == 8 else "nonsaturating"
    return encode(values, fmt, policy, scale=scale)


def admissible_range(exact, bound, fmt, scale=None) -> tuple[np.ndarray, np.ndarray]:
    """Ordinals (lo, hi) of the roundings of e - d and e + d: the admissible codes."""
    e = np.asarray(exact, dtype=np.float64)
    d = np.broadcast_to(np.asarray(bound, dtype=np.float64), e.shape)
    lo = ordinal(round_codes(e - d, fmt, scale), fmt)
    hi = ordinal(round_codes(e + d, fmt, scale), fmt)
    return lo, hi


def preimage(codes, fmt, scale=1.0) -> tuple[np.ndarray, np.ndarray]:
    """Closed interval [lo, hi] of real values whose RNE rounding (of value/scale) gives the
    code: from the midpoint with the previous value to the midpoint with the next (ties
    counted on both sides: a measure-zero over-approximation). Under satfinite the max
    codes extend to +-inf; zero codes cover both signs."""
    f = get_format(fmt)
    _, lo, hi = _tables(f)
    index = _index(codes, f)
    s = np.asarray(scale, dtype=np.float64)
    return lo[index] * s, hi[index] * s


def _code_preimages(c: np.ndarray, f) -> tuple[np.ndarray, np.ndarray]:
    """``preimage`` of int64 codes ``c`` at scale 1."""
    grid = f._grid  # magnitudes of codes 0..max_code, then the first value past max
    m = np.minimum(c & (f.sign_bit - 1), f.max_code)  # non-finite codes: no preimage
    below = np.where(m > 0, (grid[m - 1] + grid[m]) / 2, -grid[1] / 2)
    above = (grid[m] + grid[m + 1]) / 2
    if f.bits == 8:  # satfinite: everything past max rounds to max
        above = np.where(m == f.max_code, np.inf, above)
    negative = (c & f.sign_bit) != 0
    return np.where(negative, -above, below), np.where(negative, -below, above)


def joint_value_exists(exact, bound, out_codes, out_fmt, q_codes, q_fmt, q_scale=1.0,
                       q_rel=0.0) -> np.ndarray:
    """True where one value y in [e - d, e + d] explains both outputs: out = RNE(y) in
    out_fmt and q = satfinite RNE(y / q_scale * (1 + t)) in q_fmt for some |t| <= q_rel
    (the relative error of the kernel's fp32 division by the scale)."""
    e = np.asarray(exact, dtype=np.float64)
    d = np.asarray(bound, dtype=np.float64)
    o_lo, o_hi = preimage(out_codes, out_fmt)
    q_lo, q_hi = preimage(q_codes, q_fmt, q_scale)
    # y * (1 + t) in [q_lo, q_hi]  <=>  y in [q_lo, q_hi] widened by the factor's range.
    q_lo = np.where(q_lo > 0, q_lo / (1 + q_rel), q_lo / (1 - q_rel))
    q_hi = np.where(q_hi > 0, q_hi / (1 - q_rel), q_hi / (1 + q_rel))
    lo = np.maximum.reduce([e - d, o_lo, q_lo])
    hi = np.minimum.reduce([e + d, o_hi, q_hi])
    return lo <= hi


def reference_ordinals(exact, bound, fmt, scale=None) -> dict[str, np.ndarray]:
    """What ``classify`` needs of the reference alone: the ordinals of e's nearest rounding
    (``nearest``) and of the admissible range's ends (``lo``, ``hi``), as int32. They depend
    on (exact, bound) and not on the outputs, so a check caches them with the reference's
    arrays instead of rounding e, e - d and e + d on every run."""
    e = np.asarray(exact, dtype=np.float64)
    nearest = ordinal(round_codes(e, fmt, scale), fmt)
    with np.errstate(invalid="ignore"):
        lo, hi = admissible_range(np.where(np.isfinite(e), e, 0.0), bound, fmt, scale)
    return {k: v.astype(np.int32) for k, v in (("nearest", nearest), ("lo", lo), ("hi", hi))}


def classify(out_codes, exact, bound, fmt, scale=None, ordinals=None) -> dict:
    """Per-element verdict of rounded outputs against (exact, bound).

    Returns arrays: ``ok`` (inside the admissible range), ``ulps`` (signed ordinal distance
    from the nearest rounding of e), ``width`` (number of admissible codes), plus
    ``nearest`` ordinals. NaN outputs are violations unless e itself is NaN. ``ordinals``:
    ``reference_ordinals`` of the same (exact, bound, fmt, scale), computed earlier."""
    e = np.asarray(exact, dtype=np.float64)
    got = ordinal(out_codes, fmt)
    if ordinals is None:
        ordinals = reference_ordinals(e, bound, fmt, scale)
    nearest, lo, hi = (ordinals[k] for k in ("nearest", "lo", "hi"))
    finite = np.isfinite(e)
    got_value = decode(out_codes, fmt)
    got_nan = np.isnan(got_value)
    # A non-finite exact value (Inf from overflow in a 16-bit dtype, NaN from NaN content a
    # row may see) admits exactly its own rounding: Inf itself, or +-max under satfinite.
    ok = np.where(finite, ~got_nan & (lo <= got) & (got <= hi),
                  np.where(np.isnan(e), got_nan, ~got_nan & (got == nearest)))
    return {"ok": ok, "ulps": got - nearest, "width": hi - lo + 1, "nearest": nearest}
