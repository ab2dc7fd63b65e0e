"""Adversarial fp32 emulations: what a legitimate kernel might compute, at its worst.

Used to test the *soundness* of the tolerance models: every emulated result must be
admissible. Each emulation performs real fp32 operations (NumPy float32, IEEE RNE), sums in
a random order, uses FMA or not at random, and replaces each special function by a value
pushed to the edge of its declared error (``Fp32Arith``), on the fp32 grid.
"""

from __future__ import annotations

import numpy as np

from oracle.core import rand
from oracle.core.bounds import ULP_REL, Fp32Arith

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


def _truncate_f32(x: np.ndarray) -> np.ndarray:
    """float64 values cut to fp32's 24 significant bits toward zero (no subnormals)."""
    m, e = np.frexp(x)
    return np.ldexp(np.trunc(np.ldexp(m, 24)), e - 24)


def tensor_core_sum(terms: np.ndarray, k: int = 16) -> np.ndarray:
    """fp32 sum over the last axis as tensor cores accumulate exact products (16-bit
    operands), in steps of ``k`` terms: each step aligns the accumulator and its k terms to
    the largest of them, cuts every one to 24 bits below that exponent (toward zero, no
    guard bits), adds them exactly and cuts the result to fp32 toward zero (Fasi et al.,
    2021: the worst of the behaviours measured). ``oracle.core.bounds.TENSOR_CORE_DOT_REL``
    must cover it."""
    t = np.asarray(terms, np.float64)
    acc = np.zeros(t.shape[:-1])
    with np.errstate(invalid="ignore", over="ignore"):
        for j in range(0, t.shape[-1], k):
            parts = np.concatenate([acc[..., None], t[..., j:j + k]], axis=-1)
            _, e = np.frexp(np.abs(parts).max(axis=-1, keepdims=True))
            step = np.ldexp(1.0, e - 24)
            acc = _truncate_f32((np.trunc(parts / step) * step).sum(axis=-1))
    return acc.astype(F32)


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


def _exp2(x, arith, bg):
    """fp32 exp2 at the edge of its declared error."""
    with np.errstate(over="ignore"):
        return within_ulps(np.exp2(x.astype(np.float64)), arith.exp2_ulp, bg)


def _round_to(x, dtype):
    from reference.codec import round_dtype

    return round_dtype(x, dtype)


def attention_chunk_fp32(q, k, v, rank, sched, arith, sigma, bg, mma=False):
    """One split chunk of one row, all heads of the group, as an online-softmax fp32 kernel
    with tiles of ``blocks_per_tile`` ranks (blocks; key tiles with ``Schedule.tile_keys``,
    whose ranks ``_row_keys`` gives) (or one tile: ``p_max="row"``), exp2 with the
    scale folded in, P rounded from the kernel's own fp32 value. ``mma``: both products as
    tensor cores compute them (``tensor_core_sum`` of exact products; K, V and P must be
    16-bit values), else IEEE fp32 in a random order. Returns the fp32 partial output
    ``[G, D]``, its log-sum-exp (natural log) and whether any key was seen."""
    scale2 = F32(sigma * np.log2(np.e))
    if mma:
        dot = tensor_core_sum((q[:, None, :] * k[None, :, :]).astype(np.float64))
    else:
        dot = random_order_sum((q.astype(F32)[:, None, :] * k.astype(F32)[None, :, :])
                               .astype(F32), bg)
    s = (dot * scale2).astype(F32)  # [G, n], log2 units
    tiles = rank // sched.blocks_per_tile if sched.p_max == "running" else np.zeros_like(rank)
    streams = [_online_fp32(s, v, tiles, tiles % sched.key_streams == w, sched, arith, bg,
                            mma) for w in range(sched.key_streams)]
    m, acc, l_sum = streams[0]
    if len(streams) > 1:  # the streams merged once, in fp32 (Schedule.key_streams)
        ms = np.stack([st[0] for st in streams])  # [S, G, 1]
        m = ms.max(axis=0)
        m0 = np.where(np.isfinite(m), m, F32(0))
        sc = np.where(np.isfinite(ms), _exp2((ms - m0).astype(F32), arith, bg), F32(0))
        acc = random_order_sum(np.stack([(st[1] * c).astype(F32) for st, c in
                                         zip(streams, sc)]).transpose(1, 2, 0), bg)
        l_sum = random_order_sum(np.stack([(st[2] * c).astype(F32) for st, c in
                                           zip(streams, sc)]).transpose(1, 2, 0), bg)
    out = within_ulps(acc.astype(np.float64) / l_sum.astype(np.float64), arith.div_ulp, bg)
    lse = (m.astype(np.float64) * np.log(2) + np.log(l_sum.astype(np.float64)))[:, 0]
    return out, within_ulps(lse, 2.0, bg)


def _online_fp32(s, v, tiles, mine, sched, arith, bg, mma):
    """The online softmax over the tiles of ``tiles`` where ``mine`` (one key stream):
    its fp32 running max ``[G, 1]``, accumulator ``[G, D]`` and sum ``[G, 1]``."""
    g_, d = s.shape[0], v.shape[1]
    m = np.full((g_, 1), -np.inf, F32)
    acc = np.zeros((g_, d), F32)
    l_sum = np.zeros((g_, 1), F32)
    for t in np.unique(tiles[mine]):
        cols = tiles == t
        st = s[:, cols]
        m_new = np.maximum(m, st.max(axis=1, keepdims=True))
        alpha = np.where(np.isfinite(m), _exp2((m - m_new).astype(F32), arith, bg), F32(0))
        p = _exp2((st - m_new).astype(F32), arith, bg)
        pr = _round_to(p, sched.p_dtype).astype(F32) if sched.p_dtype != "float64" else p
        if mma:
            pv = tensor_core_sum((pr.astype(np.float64)[:, :, None] * v[cols][None])
                                 .transpose(0, 2, 1))
        else:
            pv = random_order_sum((pr[:, :, None] * v[cols].astype(F32)[None]).astype(F32)
                                  .transpose(0, 2, 1), bg)
        acc = ((acc * alpha).astype(F32) + pv).astype(F32)
        l_sum = ((l_sum * alpha).astype(F32) + random_order_sum(p, bg)[:, None]).astype(F32)
        m = m_new
    return m, acc, l_sum


def attention_row_fp32(q, k, v, chunk, rank, sched, arith, sigma, bg, mma=False):
    """One row and KV head group: chunks, partials in the partial dtype, fp32 merge."""
    parts = [attention_chunk_fp32(q, k[chunk == c], v[chunk == c], rank[chunk == c], sched,
                                  arith, sigma, bg, mma) for c in np.unique(chunk)]
    if sched.blocks_per_split is None:
        return parts[0][0].astype(np.float64)
    o = np.stack([_round_to(p[0], sched.partial_dtype) for p in parts]).astype(F32)
    lse = np.stack([_round_to(p[1], sched.lse_dtype) for p in parts]).astype(F32)
    top = lse.max(axis=0)
    w = within_ulps(np.exp(lse.astype(np.float64) - top), arith.exp2_ulp, bg)
    num = random_order_sum((w[..., None] * o).astype(F32).transpose(1, 2, 0), bg)
    den = random_order_sum(w.T, bg)
    return within_ulps(num.astype(np.float64) / den.astype(np.float64)[:, None],
                       arith.div_ulp, bg).astype(np.float64)
