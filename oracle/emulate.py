"""Adversarial fp32 emulations: what a legitimate kernel might compute, at its worst.

Used to test the *soundness* of the tolerance models: every emulated result must be
admissible. Each emulation performs real fp32 operations (NumPy float32, IEEE RNE), sums in
a random order, uses FMA or not at random, and replaces each special function by a value
pushed to the edge of its declared error (``Fp32Arith``), on the fp32 grid.
"""

from __future__ import annotations

import numpy as np

from oracle import rand
from oracle.bounds import ULP_REL, Fp32Arith

F32 = np.float32


def within_ulps(exact: np.ndarray, ulps: float, bg) -> np.ndarray:
    """fp32 values at most ``ulps`` fp32 ulps (relative 2^-23 each) from exact float64 values:
    a third pushed to each edge, a third uniform in between."""
    pick = rand.integers(bg, 0, 3, exact.shape)
    t = np.where(pick == 0, -1.0, np.where(pick == 1, 1.0, 2 * rand.uniform(bg, exact.shape) - 1))
    limit = ulps * ULP_REL * np.abs(exact)
    target = exact + t * limit
    out = target.astype(F32)
    # Rounding may step past the allowed distance: step back toward the exact value.
    over = np.abs(out.astype(np.float64) - exact) > limit
    toward = np.nextafter(out, exact.astype(F32))
    return np.where(over, toward, out).astype(F32)


def random_order_sum(terms: np.ndarray, bg) -> np.ndarray:
    """fp32 sum over the last axis in a random order (sequential or pairwise, per call)."""
    perm = rand.permutation(bg, terms.shape[-1])
    t = terms[..., perm].astype(F32)
    if rand.integers(bg, 0, 2, ())[()] == 0:
        acc = np.zeros(t.shape[:-1], F32)
        for i in range(t.shape[-1]):
            acc = (acc + t[..., i]).astype(F32)
        return acc
    while t.shape[-1] > 1:
        if t.shape[-1] % 2:
            t = np.concatenate([t, np.zeros(t.shape[:-1] + (1,), F32)], axis=-1)
        t = (t[..., 0::2] + t[..., 1::2]).astype(F32)
    return t[..., 0]


def fma(a, b, c) -> np.ndarray:
    """fp32 fused multiply-add: the float64 a*b is exact, one rounding of a*b + c to float64
    and then fp32 (the double rounding is far inside the bounds' slack)."""
    return (a.astype(np.float64) * b.astype(np.float64) + c.astype(np.float64)).astype(F32)


def mul_add(a, b, c, use_fma: bool) -> np.ndarray:
    return fma(a, b, c) if use_fma else ((a * b).astype(F32) + c).astype(F32)


def norm_rope_fp32(x, w, eps, cos_sin, rotary_dim, arith: Fp32Arith, bg) -> np.ndarray:
    """One adversarial fp32 evaluation of Gemma RMSNorm + partial NeoX RoPE (float64 result
    of fp32 values, before the final rounding to the model dtype)."""
    x32, w32, cs = x.astype(F32), np.asarray(w).astype(F32), cos_sin.astype(F32)
    d = x.shape[-1]
    ss = random_order_sum((x32 * x32).astype(F32), bg)[..., None]
    mean = within_ulps(ss.astype(np.float64) / d, arith.div_ulp, bg)
    t = (mean + F32(eps)).astype(F32)
    r = within_ulps(1.0 / np.sqrt(t.astype(np.float64)), arith.rsqrt_ulp, bg)
    one_w = (F32(1) + w32).astype(F32)
    if rand.integers(bg, 0, 2, ())[()]:
        n = ((x32 * r).astype(F32) * one_w).astype(F32)
    else:
        n = (x32 * (r * one_w).astype(F32)).astype(F32)
    h = rotary_dim // 2
    c, s = cs[..., :h], cs[..., h:rotary_dim]
    first, second = n[..., :h], n[..., h:rotary_dim]
    use_fma = bool(rand.integers(bg, 0, 2, ())[()])
    y_first = mul_add(first, c, (-(second * s)).astype(F32), use_fma)
    y_second = mul_add(second, c, (first * s).astype(F32), use_fma)
    return np.concatenate([y_first, y_second, n[..., rotary_dim:]], axis=-1).astype(np.float64)


def indexer_scores_fp32(q, keys, positions, page, bg) -> np.ndarray:
    """Adversarial fp32 block scores of one request: ``q [T, Hi, D]`` values, ``keys [n, D]``
    (visible keys 0..n-1), each dot summed in fp32 in a random order, then the block max over
    keys j <= p. Returns float64 ``[Hi, T, NB]``, -inf past each row's visible blocks."""
    prods = (q.astype(F32)[:, :, None, :] * keys.astype(F32)[None, None, :, :]).astype(F32)
    dots = random_order_sum(prods, bg).astype(np.float64)  # [T, Hi, n]
    n = keys.shape[0]
    nb = -(-n // page)
    j = np.arange(nb * page)
    visible = j[None, :] <= np.asarray(positions)[:, None]  # [T, nb*P]
    padded = np.full(dots.shape[:2] + (nb * page,), -np.inf)
    padded[..., :n] = dots
    padded = np.where(visible[:, None, :], padded, -np.inf)
    return padded.reshape(dots.shape[:2] + (nb, page)).max(axis=-1).transpose(1, 0, 2)
