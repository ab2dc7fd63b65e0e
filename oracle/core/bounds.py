"""Rigorous bounds on an fp32 evaluation's error, per op, for the rounding-interval oracle.

An implementation declares its fp32 arithmetic (``Fp32Arith``): the worst relative error of
the special functions it uses. Sums may run in any order, with or without FMA; products and
sums are IEEE round-to-nearest (unit roundoff u = 2^-24); flush-to-zero of subnormal
intermediates is allowed (an absolute loss of at most 2^-126 per flushed value).

Derivations are first order in u; the neglected higher-order terms are below 1e-6 of the
bound for every D <= 1024, so each bound is multiplied by (1 + 1e-6) and receives the float64
reference's own error (2^-50 relative to the magnitudes involved) on top.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from reference.norm_rope import rms_norm_gemma

U = 2.0**-24  # fp32 unit roundoff
ULP_REL = 2.0**-23  # one fp32 ulp, relative to the value, at most
FTZ = 2.0**-126  # the largest value flush-to-zero can lose
HIGHER_ORDER = 1 + 1e-6
F64_REL = 2.0**-50

#: Declared error of a sum of products of 16-bit operands on NVIDIA tensor cores (wgmma /
#: mma with fp32 accumulation) beyond an IEEE fp32 sum, relative to the sum of the terms'
#: magnitudes, for sums of at most ``TENSOR_CORE_LENGTH`` products: the products are exact,
#: but each k-step's products are added to the accumulator aligned to the largest and
#: truncated (Fasi, Higham, Mikaitis and Pranesh, "Numerical behavior of NVIDIA tensor
#: cores", 2021), about twice the unit roundoff per addition, and truncation errors share
#: a sign, so they reach the worst case that random IEEE roundings do not (~2 gamma(n) in
#: all: 2^-15 at n = 256); declared with a factor 2 margin at n = 256. The attention bound
#: carries it to other lengths linearly (``tensor_core_rel``); the indexer applies it as is
#: (D <= 256). Implementations declare it as ``score_rel`` (oracle.core.registry).
TENSOR_CORE_DOT_REL = 2.0**-14
TENSOR_CORE_LENGTH = 256


def tensor_core_rel(dot_rel: float, length: int) -> float:
    """A dot error ``dot_rel`` declared for sums of ``TENSOR_CORE_LENGTH`` products, carried
    to a sum of ``length`` products (per-addition truncation: linear in the length)."""
    return dot_rel * length / TENSOR_CORE_LENGTH


NORMALISATIONS = ("divide", "lse")
LOG2_ABS = 2.0**-21  # absolute error of an fp32 log2 near 1 (PTX lg2.approx: 2^-22.6)


@dataclass(frozen=True)
class Fp32Arith:
    """Declared worst-case errors of an implementation's fp32 special functions, in fp32
    ulps of the exact result. Defaults are measured on the H200 (Triton 3.6,
    reports/probe-h200.json: rsqrt 1.51, approximate division 2.05, exp2 2.06 ulp max) with
    headroom, and match CUDA's documented 2 ulp for rsqrtf and __fdividef."""

    rsqrt_ulp: float = 2.0  # 1/sqrt(t), by rsqrt or by sqrt and a division (sum their ulps)
    div_ulp: float = 2.5  # x / y (also the division by a KV scale)
    exp2_ulp: float = 2.5
    #: How attention normalises its output: "divide" (``acc / l``) or "lse" (``acc *
    #: exp2(m - lse)``, ``lse = m + log2(l)``, base-2 logits): oracle.core.attention_bound.
    normalise: str = "divide"
    #: log2 with normalise="lse": ulps of the result plus ``LOG2_ABS`` absolute (an
    #: approximate log2 is accurate to an absolute 2^-22 near 1, where its result nears 0).
    log2_ulp: float = 2.5

    def __post_init__(self):
        if self.normalise not in NORMALISATIONS:
            raise ValueError(f"normalise must be one of {list(NORMALISATIONS)}, got "
                             f"{self.normalise!r}")

    @property
    def rsqrt_rel(self) -> float:
        return self.rsqrt_ulp * ULP_REL

    @property
    def div_rel(self) -> float:
        return self.div_ulp * ULP_REL

    @property
    def exp2_rel(self) -> float:
        return self.exp2_ulp * ULP_REL

    @property
    def log2_rel(self) -> float:
        return self.log2_ulp * ULP_REL


def gamma(n: int) -> float:
    """Relative error bound of an n-term fp32 sum of non-negative terms, any order."""
    return (n - 1) * U / (1 - (n - 1) * U)


def rms_scale_rel_error(x: np.ndarray, eps: float, arith: Fp32Arith) -> np.ndarray:
    """Bound on the relative error of r = 1/sqrt(mean(x^2) + eps) computed in fp32.

    x^2 is exact in fp32 for bf16/fp16 inputs; the sum of D squares errs by gamma(D) relative
    (plus D * 2^-126 absolute if squares flush); the mean (a division by D, or a product
    with fp32(1/D): 2u) adds at most the declared division error; adding eps (itself rounded
    to fp32) adds 2u; t's relative error halves under the square root; rsqrt adds its own."""
    d = x.shape[-1]
    t = np.mean(x * x, axis=-1, keepdims=True) + eps
    with np.errstate(divide="ignore"):
        flush = np.where(t > 0, FTZ / t, np.inf)
    delta_t = gamma(d) + max(arith.div_rel, 2 * U) + 2 * U + flush
    return delta_t / 2 + arith.rsqrt_rel


def norm_rope_bound(x, w, eps, cos_sin, rotary_dim, arith: Fp32Arith) -> np.ndarray:
    """Bound d on |y_hat - y| for Gemma RMSNorm + partial NeoX RoPE of x ``[..., D]``.

    cos_sin: the table rows of each token, broadcastable to ``[..., R]``.
    n_d = x_d * r * (1 + w_d): relative error delta_n = delta_r + 4u (three roundings: the
    sum 1 + w, two products). Rotated pairs y_i = n_i c_i - n_{i+h} s_i: each product errs by
    (delta_n + u) relative, the sum (or FMA) adds u |y_i|. Pass-through dims: delta_n |n_d|.
    Every output also gets 4 * 2^-126 for flushed intermediates."""
    x = np.asarray(x, dtype=np.float64)
    n = rms_norm_gemma(x, w, eps)
    delta_n = rms_scale_rel_error(x, eps, arith) + 4 * U
    h = rotary_dim // 2
    c, s = cos_sin[..., :h], cos_sin[..., h:rotary_dim]
    first, second = n[..., :h], n[..., h:rotary_dim]
    mag_first = np.abs(first * c) + np.abs(second * s)
    mag_second = np.abs(second * c) + np.abs(first * s)
    y_first, y_second = first * c - second * s, second * c + first * s
    bound = np.concatenate(
        [
            (delta_n + U) * mag_first + U * np.abs(y_first) + F64_REL * mag_first,
            (delta_n + U) * mag_second + U * np.abs(y_second) + F64_REL * mag_second,
            (delta_n + F64_REL) * np.abs(n[..., rotary_dim:]),
        ],
        axis=-1,
    )
    return bound * HIGHER_ORDER + 4 * FTZ
