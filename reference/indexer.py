"""Indexer: block scores and top-k block selection (contract.md section 5), float64 NumPy.

Semantics, for request r, index head h, a query token at absolute position p:

- Keys j <= p are visible; block b = j // P; the visible blocks are 0 .. p//P, so
  ``num_visible = p//P + 1``. Keys are read from the index cache (``[num_pages, P, D]``
  codes, slot = page*P + offset) through the request's own block table row.
- ``S[h, p, b] = max over visible j in block b of index_q[p, h] . index_k[j]``: a float64
  dot product of the values as given, no scale. A NaN dot makes the block's score NaN
  (np.maximum semantics). Index keys are decoded exactly from their codes; ``index_q`` is
  used as given: when the index cache is fp8, pass index_q as decoded e4m3 values already
  (``dec(e4m3(index_q))``, contract.md s.4); no rounding happens here.
- n = min(K, num_visible) blocks are selected. Forced blocks: the first L_init blocks
  (``b < L_init``) and the last L_loc visible blocks (``b >= num_visible - L_loc``), both
  within the visible range. Then the highest scores.

Ordering of the output (one total order, used for both the choice and the entries):
  1. forced blocks, in ascending block id. Every initial block has a lower id than every
     local block that is not also initial, so this is "initial blocks first, then local
     blocks"; when the forced blocks exceed n, the first n of this order are kept: initial
     blocks win over local ones (contract.md s.5, vLLM's sentinels 1e30 > 1e29), and among
     local blocks the lower id wins, which is the tie rule applied to vLLM's equal local
     sentinels (so with L_init = 0 and L_loc > n the current block is the one dropped).
  2. the other visible blocks with a non-NaN score, by descending score; equal scores
     (compared as values: -0 == +0) go to the lower block id.
  3. visible blocks with a NaN score, by ascending block id (NaN ranks lowest).
The n first blocks of this order are written to ``topk[h, t, :n]`` in this order; the
remaining K - n entries are -1. Consumers treat the selection as a set.

Output ``[Hi, T, K]`` int32 of LOGICAL block ids (head-major, as contract.md s.5; servers keep
the buffer token-major and pass ``buf.transpose(1, 0, 2)``; this is value-identical).

Scores for the oracle: with ``return_scores=True`` the entry points return an
``IndexerResult`` that also holds the float64 scores ``[Hi, T, NB]`` (NB = the largest
num_visible of the call; entries with b >= num_visible[t] are -inf and mean "not a
block"), the magnitudes ``max over visible j in b of sum_d |q_d| |k_jd|`` (what a
rigorous bound on a kernel's accumulation error scales with: an implementation whose
dot products are each within gamma * sum_d |q_d k_jd| of exact has block scores within
gamma * magnitude), num_visible and the positions.

About float64: each product of two model-dtype or fp8 values is exact in float64, but the
sum of D products is rounded (error <= D * 2^-53 * magnitude), and the matmul's summation
order is BLAS's. The tie rule is applied to the computed float64 scores; identical key
vectors give bit-identical dots in practice, and where all partial sums are exact (small
exponent range, as in the tests' grid data) the scores are the exact values. Oracles
should add this (tiny) reference error to their bounds.

Implementation (the fast block-centric form; the literal per-row loops,
``indexer_literal`` with ``block_scores_literal`` and ``select_literal``, are the cross-
check): per request, keys are decoded in chunks of whole blocks that stay in cache (bf16
by a 16-bit shift into float32 bits, fp8 and fp16 by table lookup), one matmul per chunk
covers all the request's tokens and heads, the block maxima come from a reshape to ``[...,
blocks, P]``; a token's own (last visible) block is recomputed with its causal mask and
later blocks are set to -inf, so cache content past p or past seq_len (which may be NaN)
never reaches a score. Selection is one vectorised lexsort per chunk of tokens.

Validation raises ValueError whose message starts with the argument's name.
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass

import numpy as np

from reference.codec import FORMATS, decode
from reference.domain import DECODE_ROWS_RANGE, PAGE_SIZES, TOPK_RANGE

# Work sizes of the fast form (elements of float64): decoded keys per chunk (fits L2/L3)
# and the dot-product block per matmul.
_KEY_CHUNK_ELEMS = 1 << 18
_DOT_CHUNK_ELEMS = 1 << 21


@dataclass(frozen=True)
class IndexerResult:
    """Everything the reference knows about one indexer call.

    topk:        int32 ``[Hi, T, K]`` logical block ids, n valid entries then -1.
    scores:      float64 ``[Hi, T, NB]``; ``scores[h, t, b]`` for b < num_visible[t],
                 -inf beyond (no block there).
    magnitudes:  float64 ``[Hi, T, NB]``, ``max_{j in b, j <= p} sum_d |q_d| |k_jd|``;
                 0 where b >= num_visible[t].
    num_visible: int64 ``[T]``, p//P + 1, or 0 for padding rows.
    positions:   int64 ``[T]``, absolute position p, or -1 for padding rows.
    """

    topk: np.ndarray
    scores: np.ndarray
    magnitudes: np.ndarray
    num_visible: np.ndarray
    positions: np.ndarray
    local_blocks: int
    initial_blocks: int

    def admits(self, sel, bound) -> tuple[bool, dict]:
        """``selection_admissible`` of sel against this call's exact scores."""
        return selection_admissible(sel, self.scores, bound, self.num_visible,
                                    self.local_blocks, self.initial_blocks)


# ----------------------------------------------------------------------------- validation


def _int_arg(name, value, lo, hi=None) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < lo or (
        hi is not None and value > hi
    ):
        span = f"[{lo}, {hi}]" if hi is not None else f">= {lo}"
        raise ValueError(f"{name} must be an integer {span}, got {value!r}")
    return int(value)


def _int_array(name, value, ndim) -> np.ndarray:
    a = np.asarray(value)
    if a.dtype.kind not in "iu" or a.ndim != ndim:
        raise ValueError(f"{name} must be a {ndim}-d integer array, got {a.dtype} "
                         f"with shape {a.shape}")
    return a.astype(np.int64)


def _check_common(index_q, index_cache, index_fmt, block_table, seq_lens, topk,
                  local_blocks, initial_blocks):
    q = np.asarray(index_q)
    ml_float = q.dtype.name == "bfloat16" or q.dtype.name.startswith("float8")
    if (q.dtype.kind != "f" and not ml_float) or q.ndim != 3 or q.shape[1] < 1:
        raise ValueError(f"index_q must be a floating-point array [T, Hi, D] with Hi >= 1, "
                         f"got {q.dtype} with shape {q.shape}")
    if index_fmt not in FORMATS:
        raise ValueError(f"index_fmt must be one of {sorted(FORMATS)}, got {index_fmt!r}")
    cache = index_cache
    code_dtype = FORMATS[index_fmt].code_dtype
    if not isinstance(cache, np.ndarray) or cache.ndim != 3 or cache.dtype != code_dtype:
        raise ValueError(f"index_cache must be a [num_pages, P, D] array of "
                         f"{np.dtype(code_dtype).name} codes for {index_fmt}, got "
                         f"{getattr(cache, 'dtype', type(cache))} with shape "
                         f"{getattr(cache, 'shape', None)}")
    num_pages, page, d = cache.shape
    if page not in PAGE_SIZES:
        raise ValueError(f"index_cache page size P must be one of {list(PAGE_SIZES)}, "
                         f"got {page}")
    if q.shape[2] != d:
        raise ValueError(f"index_q head dim {q.shape[2]} does not match index_cache's D = {d}")
    lens = _int_array("seq_lens", seq_lens, 1)
    if lens.size and lens.min() < 0:
        raise ValueError(f"seq_lens must be >= 0, got {lens.min()}")
    bt = _int_array("block_table", block_table, 2)
    if bt.shape[0] != lens.size:
        raise ValueError(f"block_table must have one row per request ({lens.size}), got "
                         f"shape {bt.shape}")
    need = -(-lens // page)  # pages each request uses
    if need.size and need.max() > bt.shape[1]:
        raise ValueError(f"block_table has {bt.shape[1]} columns but a request of "
                         f"{lens.max()} tokens needs {need.max()} pages of {page}")
    used = np.arange(bt.shape[1])[None, :] < need[:, None]
    bad = used & ((bt < 0) | (bt >= num_pages))
    if bad.any():
        r, c = np.argwhere(bad)[0]
        raise ValueError(f"block_table entries used by a request must be in [0, num_pages="
                         f"{num_pages}), got block_table[{r}, {c}] = {bt[r, c]}")
    k = _int_arg("topk", topk, *TOPK_RANGE)
    loc = _int_arg("local_blocks", local_blocks, 0)
    ini = _int_arg("initial_blocks", initial_blocks, 0)
    with np.errstate(invalid="ignore"):
        qf = q.astype(np.float64)
    return qf, bt, lens, k, loc, ini


# ------------------------------------------------------------------------------ entry points


def indexer_prefill(index_q, index_cache, index_fmt, block_table, cu_seqlens_q, seq_lens, topk,
                    local_blocks=1, initial_blocks=0, return_scores=False):
    """Top-k blocks of every new token of a ragged prefill batch.

    index_q      float ``[T, Hi, D]`` (values as given; decoded e4m3 when the cache is fp8)
    index_cache  codes ``[num_pages, P, D]`` of format ``index_fmt`` (a reference.codec name)
    block_table  int ``[B, max_pages]``: logical block -> physical page of the index cache
    cu_seqlens_q int ``[B+1]``, 0 = cu[0] <= ... <= cu[B] = T
    seq_lens     int ``[B]`` total tokens incl. this step; token i of request r is at
                 position ``seq_lens[r] - query_len[r] + i``
    Returns int32 ``[Hi, T, K]``, or an ``IndexerResult`` if ``return_scores``.
    """
    q, bt, lens, k, loc, ini = _check_common(index_q, index_cache, index_fmt, block_table,
                                             seq_lens, topk, local_blocks, initial_blocks)
    cu = _int_array("cu_seqlens_q", cu_seqlens_q, 1)
    if cu.size != lens.size + 1 or cu[0] != 0 or np.any(np.diff(cu) < 0) or cu[-1] != len(q):
        raise ValueError(f"cu_seqlens_q must be non-decreasing of length B+1 = {lens.size + 1}"
                         f", from 0 to T = {len(q)}, got {cu.tolist()[:16]}")
    qlens = np.diff(cu)
    if np.any(qlens > lens):
        r = int(np.argmax(qlens > lens))
        raise ValueError(f"cu_seqlens_q gives request {r} {qlens[r]} new tokens but "
                         f"seq_lens[{r}] = {lens[r]}")
    res = _indexer(q, index_cache, index_fmt, bt, cu[:-1], qlens, lens, k, loc, ini,
                   return_scores)
    return res if return_scores else res.topk


def indexer_decode(index_q, index_cache, index_fmt, block_table, seq_lens, rows_per_request,
                   topk, local_blocks=1, initial_blocks=0, return_scores=False):
    """Top-k blocks of decode rows: ``rows_per_request`` (1..4) rows per request,
    request-major (``index_q`` is ``[B * rows, Hi, D]``); row j of request r is at position
    ``seq_lens[r] - rows + j``. Requests with ``seq_lens[r] == 0`` are padding: their rows
    get all -1 (num_visible 0, position -1). Otherwise as ``indexer_prefill``."""
    q, bt, lens, k, loc, ini = _check_common(index_q, index_cache, index_fmt, block_table,
                                             seq_lens, topk, local_blocks, initial_blocks)
    rows = _int_arg("rows_per_request", rows_per_request, *DECODE_ROWS_RANGE)
    if len(q) != rows * lens.size:
        raise ValueError(f"index_q must have B * rows_per_request = {rows * lens.size} rows, "
                         f"got {len(q)}")
    short = (lens != 0) & (lens < rows)
    if short.any():
        r = int(np.argmax(short))
        raise ValueError(f"seq_lens must be >= rows_per_request ({rows}) or 0 (padding), got "
                         f"seq_lens[{r}] = {lens[r]}")
    starts = np.arange(lens.size, dtype=np.int64) * rows
    counts = np.where(lens > 0, rows, 0)
    res = _indexer(q, index_cache, index_fmt, bt, starts, counts, lens, k, loc, ini,
                   return_scores)
    return res if return_scores else res.topk


# ----------------------------------------------------------------------------------- core


def _indexer(q, cache, fmt, bt, starts, counts, lens, topk, loc, ini, want_scores):
    """Shared core: request r owns tokens starts[r] .. starts[r]+counts[r]-1, at positions
    lens[r] - counts[r] + i; tokens owned by no request are padding rows."""
    t_total, hi, _ = q.shape
    page = cache.shape[1]
    positions = np.full(t_total, -1, np.int64)
    for r in np.flatnonzero(counts > 0):
        positions[starts[r]:starts[r] + counts[r]] = lens[r] - counts[r] + np.arange(counts[r])
    num_visible = np.where(positions >= 0, positions // page + 1, 0)
    nb_all = int(num_visible.max(initial=0))
    out = np.full((hi, t_total, topk), -1, np.int32)
    if want_scores:
        scores = np.full((hi, t_total, nb_all), -np.inf)
        mags = np.zeros((hi, t_total, nb_all))
    for r in np.flatnonzero(counts > 0):
        tok = slice(int(starts[r]), int(starts[r] + counts[r]))
        nb = int(num_visible[tok].max())
        keys_per_chunk = min(nb, _blocks_per_chunk(page, q.shape[2])) * page
        step = max(1, _DOT_CHUNK_ELEMS // (hi * keys_per_chunk))  # tokens per chunk
        for t0 in range(tok.start, tok.stop, step):
            t1 = min(tok.stop, t0 + step)
            s, m = _block_scores(q[t0:t1], cache, fmt, bt[r], positions[t0:t1], want_scores)
            nbc = s.shape[2]
            out[:, t0:t1] = select_blocks(s, num_visible[t0:t1], topk, loc, ini)
            if want_scores:
                scores[:, t0:t1, :nbc] = s
                mags[:, t0:t1, :nbc] = m
    if not want_scores:
        scores = mags = None
    return IndexerResult(out, scores, mags, num_visible, positions, loc, ini)


def _blocks_per_chunk(page, d):
    return max(1, _KEY_CHUNK_ELEMS // (page * d))


def _decode_into(codes, fmt, out):
    """Exact float64 values of codes written into out (same shape)."""
    with np.errstate(invalid="ignore"):  # signalling NaN patterns become quiet NaNs
        if fmt == "bfloat16":
            out[...] = (codes.astype(np.uint32) << 16).view(np.float32)
        else:  # table lookup (fp8: 256 entries; fp16: 65536); codes are in range by dtype
            np.take(FORMATS[fmt].values, codes, out=out, mode="clip")
    return out


def decode_keys(codes, fmt) -> np.ndarray:
    """Fast exact decode of index-cache codes (equal to ``reference.codec.decode``)."""
    codes = np.asarray(codes)
    return _decode_into(codes, fmt, np.empty(codes.shape, np.float64))


def _block_scores(q, cache, fmt, bt_row, positions, want_mag):
    """Scores (and magnitudes) ``[Hi, n, nb]`` of n tokens of one request.

    Block-centric: for each chunk of whole key blocks, decode once, one matmul for all
    tokens and heads, max over each block; then each token's own block is recomputed under
    its causal mask and blocks past it are set to -inf."""
    n, hi, d = q.shape
    page = cache.shape[1]
    own = positions // page
    nb = int(own.max()) + 1
    scores = np.full((n, hi, nb), -np.inf)
    mags = np.zeros((n, hi, nb)) if want_mag else None
    qm = q.reshape(n * hi, d)
    qa = np.abs(qm) if want_mag else None
    bpc = _blocks_per_chunk(page, d)
    keys = np.empty((min(bpc, nb) * page, d))
    lane = np.arange(page)
    for b0 in range(0, nb, bpc):
        b1 = min(nb, b0 + bpc)
        kc = _decode_into(cache[bt_row[b0:b1]].reshape(-1, d), fmt, keys[:(b1 - b0) * page])
        sees = own >= b0  # tokens that see at least one key of this chunk
        first = int(np.argmax(sees)) if sees.any() else n
        if first == n:
            continue
        parts = [(scores, qm, kc)] + ([(mags, qa, np.abs(kc))] if want_mag else [])
        for dst, qq, kk in parts:
            dots = (qq[first * hi:] @ kk.T).reshape(n - first, hi, b1 - b0, page)
            bmax = dots.max(axis=-1)
            rel = own[first:] - b0  # own block relative to the chunk
            inside = np.flatnonzero((rel >= 0) & (rel < b1 - b0))
            if inside.size:  # causal mask inside each token's own block
                own_dots = dots[inside, :, rel[inside], :]  # [m, hi, page]
                hidden = lane[None, :] > (positions[first:][inside] % page)[:, None]
                own_dots = np.where(hidden[:, None, :], -np.inf, own_dots)
                bmax[inside, :, rel[inside]] = own_dots.max(axis=-1)
            past = np.arange(b1 - b0)[None, :] > rel[:, None]  # blocks after the own block
            fill = -np.inf if dst is scores else 0.0
            bmax = np.where(past[:, None, :], fill, bmax)
            dst[first:, :, b0:b1] = bmax
    m = None if mags is None else mags.transpose(1, 0, 2)
    return scores.transpose(1, 0, 2), m


# ------------------------------------------------------------------------------ selection


def _forced_and_visible(num_visible, num_blocks, local_blocks, initial_blocks):
    """Boolean ``[T, NB]`` masks: forced (initial or local, visible) and visible."""
    nvis = np.asarray(num_visible, np.int64)[:, None]
    b = np.arange(num_blocks)[None, :]
    visible = b < nvis
    forced = visible & ((b < initial_blocks) | (b >= nvis - local_blocks))
    return forced, visible


def required_blocks(num_visible, num_blocks, topk, local_blocks=1, initial_blocks=0):
    """Boolean ``[T, NB]``: the forced blocks every selection must contain, i.e. the first
    n = min(K, num_visible) forced blocks in ascending id (all of them when they fit;
    initial blocks before local ones otherwise)."""
    forced, _ = _forced_and_visible(num_visible, num_blocks, local_blocks, initial_blocks)
    n = np.minimum(topk, np.asarray(num_visible, np.int64))[:, None]
    return forced & (np.cumsum(forced, axis=1) <= n)


def select_blocks(scores, num_visible, topk, local_blocks=1, initial_blocks=0) -> np.ndarray:
    """int32 ``[Hi, T, K]`` selection from float64 scores ``[Hi, T, NB]`` (entries with
    b >= num_visible[t] ignored), in the module's total order (forced ascending, then
    descending score with ties to the lower id, then NaN by id), -1 padded."""
    s = np.asarray(scores, np.float64)
    hi, t, nb = s.shape
    nvis = np.asarray(num_visible, np.int64)
    if nvis.shape != (t,) or (t and nvis.max() > nb):
        raise ValueError(f"num_visible must be [T] = [{t}] with entries <= NB = {nb}")
    topk = _int_arg("topk", topk, 1)
    forced, visible = _forced_and_visible(nvis, nb, local_blocks, initial_blocks)
    nan = np.isnan(s)
    cls = np.where(forced, 0, np.where(nan, 2, 1))
    cls = np.where(visible, cls, 3)
    key = np.where(cls == 1, -np.where(nan, 0.0, s), 0.0)
    ids = np.broadcast_to(np.arange(nb), s.shape)
    order = np.lexsort((ids, key, cls), axis=-1)[..., :topk]
    out = np.full((hi, t, topk), -1, np.int32)
    kk = min(topk, nb)
    n = np.minimum(topk, nvis)
    keep = np.arange(kk)[None, :] < n[:, None]  # [T, kk]
    out[..., :kk] = np.where(keep[None], order[..., :kk], -1)
    return out


# ------------------------------------------------------------------ tie-aware comparison


def _bound_array(bound, shape):
    e = np.asarray(bound, np.float64)
    if not (np.all(np.isfinite(e)) and np.all(e >= 0)):
        raise ValueError("bound must be finite and >= 0 everywhere")
    try:
        return np.broadcast_to(e, shape)
    except ValueError:
        raise ValueError(f"bound must be a scalar or broadcast to {shape}, got shape "
                         f"{e.shape}") from None


def selection_admissible(sel, exact_scores, bound, num_visible, local_blocks=1,
                         initial_blocks=0) -> tuple[bool, dict]:
    """Whether a selection is one an implementation with score error <= bound may return.

    sel           int ``[Hi, T, K]`` (any strides, e.g. a transposed token-major buffer)
    exact_scores  float64 ``[Hi, T, NB]`` of the reference (b >= num_visible[t] ignored)
    bound         scalar or array broadcasting to ``[Hi, T, NB]``: the implementation's
                  absolute score error per block, ``|S_impl - S| <= bound``
    num_visible   int ``[T]``

    Exact checks, per row (h, t), with n = min(K, num_visible[t]): entries 0..n-1 are
    block ids in [0, num_visible), no duplicates, entries n..K-1 are -1; the required
    forced blocks (``required_blocks``) are all present.

    Threshold check (rigorous): let A be the selected blocks that are not required-forced
    and U the visible blocks not selected. The row is admissible iff there is a threshold
    t with ``S_a >= t - e_a`` for all a in A and ``S_u <= t + e_u`` for all u in U, i.e.
    ``min_A (S_a + e_a) >= max_U (S_u - e_u)``: exactly the condition for A to be the top
    set of some scores S' with |S' - S| <= e (ties in S' broken either way). NaN exact
    scores count as -inf (rank lowest). With bound 0 it accepts any order among exactly
    tied scores. The order of the valid entries is not significant.

    Returns (ok, details); details: rows, rows_failed, failures (first 8 as
    (h, t, reason)), and ``needed_bound``: the smallest scalar bound that would make every
    row's threshold check pass (max over rows of (max_U S_u - min_A S_a) / 2, >= 0).
    """
    sel = np.asarray(sel)
    s = np.asarray(exact_scores, np.float64)
    if s.ndim != 3:
        raise ValueError(f"exact_scores must be [Hi, T, NB], got shape {s.shape}")
    hi, t, nb = s.shape
    if sel.dtype.kind not in "iu" or sel.ndim != 3 or sel.shape[:2] != (hi, t):
        raise ValueError(f"sel must be an integer array [Hi, T, K] = [{hi}, {t}, K], got "
                         f"{sel.dtype} {sel.shape}")
    nvis = np.asarray(num_visible, np.int64)
    if nvis.shape != (t,) or (t and nvis.max() > nb):
        raise ValueError(f"num_visible must be [T] = [{t}] with entries <= NB = {nb}")
    e = _bound_array(bound, s.shape)
    k = sel.shape[2]
    sel = sel.astype(np.int64)
    n = np.minimum(k, nvis)
    slot_valid = np.arange(k)[None, :] < n[:, None]  # [T, K]
    fails = []
    bad_shape = np.any(np.where(slot_valid[None], (sel < 0) | (sel >= nvis[None, :, None]),
                                sel != -1), axis=-1)
    srt = np.sort(sel, axis=-1)
    dup = np.any((srt[..., 1:] == srt[..., :-1]) & (srt[..., 1:] >= 0), axis=-1)
    member = np.zeros((hi, t, nb + 1), bool)
    idx = np.where((sel >= 0) & (sel < nvis[None, :, None]), sel, nb)
    np.put_along_axis(member, idx, True, axis=-1)
    member = member[..., :nb]
    req = required_blocks(nvis, nb, k, local_blocks, initial_blocks)[None]
    _, visible = _forced_and_visible(nvis, nb, local_blocks, initial_blocks)
    missing = np.any(req & ~member, axis=-1)
    sv = np.where(np.isnan(s), -np.inf, s)
    a_mask = member & ~req
    u_mask = visible[None] & ~member
    with np.errstate(invalid="ignore"):
        lo = np.where(a_mask, sv + e, np.inf).min(axis=-1, initial=np.inf)
        hi_ = np.where(u_mask, sv - e, -np.inf).max(axis=-1, initial=-np.inf)
        gap = (np.where(u_mask, sv, -np.inf).max(axis=-1, initial=-np.inf)
               - np.where(a_mask, sv, np.inf).min(axis=-1, initial=np.inf))
    thresh_bad = ~(lo >= hi_)
    for name, bad in (("entries (n valid ids then -1)", bad_shape), ("duplicate ids", dup),
                      ("missing forced block", missing), ("swap beyond bound", thresh_bad)):
        for h_, t_ in np.argwhere(bad)[: 8 - len(fails)]:
            fails.append((int(h_), int(t_), name))
    failed = bad_shape | dup | missing | thresh_bad
    finite_gap = gap[np.isfinite(gap)]
    needed = float(max(0.0, finite_gap.max(initial=0.0) / 2))
    if np.any(np.isposinf(gap)):
        needed = float("inf")
    details = dict(rows=hi * t, rows_failed=int(failed.sum()), failures=fails,
                   needed_bound=needed)
    return not failed.any(), details


def selections_equivalent(sel_a, sel_b, exact_scores, bound, num_visible, local_blocks=1,
                          initial_blocks=0) -> tuple[bool, dict]:
    """Whether two selections are the same up to near-tie swaps: both pass
    ``selection_admissible`` against the exact scores with the given bound (so every
    block in which they differ lies within the bound of the threshold that separates the
    selected from the unselected blocks), compared as sets.

    Returns (ok, details): details of each side (``a``, ``b``) and ``rows_differing``
    (rows whose sets differ) and ``blocks_swapped`` (total |A \\ B| over rows)."""
    ok_a, det_a = selection_admissible(sel_a, exact_scores, bound, num_visible, local_blocks,
                                       initial_blocks)
    ok_b, det_b = selection_admissible(sel_b, exact_scores, bound, num_visible, local_blocks,
                                       initial_blocks)
    a, b = np.asarray(sel_a, np.int64), np.asarray(sel_b, np.int64)
    if a.shape != b.shape:
        raise ValueError(f"sel_b must have the shape of sel_a {a.shape}, got {b.shape}")
    in_b = (a[..., :, None] == b[..., None, :]).any(-1) | (a < 0)
    only_a = (~in_b).sum(-1)
    details = dict(a=det_a, b=det_b, rows_differing=int((only_a > 0).sum()),
                   blocks_swapped=int(only_a.sum()))
    return ok_a and ok_b, details


# ----------------------------------------------------------------------------- literal form
# The module docstring's definitions written out per row, per head, per block and per key:
# each dot an exactly rounded sum (math.fsum of exact products), keys fetched one by one
# through the block table and decoded by the codec, the selection a Python sort. It shares
# nothing with the fast form but the codec; the tests hold the fast form to it.


def indexer_literal(q, cache, fmt, block_table, starts, counts, seq_lens, topk,
                    local_blocks, initial_blocks, magnitudes=True):
    """(topk [Hi, T, K], scores, mags) of the rows ``starts[r] .. starts[r] + counts[r]`` of
    each request r (the last ``counts[r]`` positions of its ``seq_lens[r]`` keys), with
    ``scores[(h, t)]`` / ``mags[(h, t)]`` the lists of the visible blocks' scores and
    magnitudes. Inputs are trusted (no validation)."""
    t_total, hi, _ = q.shape
    page = cache.shape[1]
    out = np.full((hi, t_total, topk), -1, np.int32)
    scores, mags = {}, {}
    for r in range(len(seq_lens)):
        seq_len, count = int(seq_lens[r]), int(counts[r])
        keys = [decode(cache[block_table[r][j // page], j % page], fmt).tolist()
                for j in range(seq_len if count else 0)]
        for i in range(count):
            t, p = int(starts[r]) + i, seq_len - count + i
            for h in range(hi):
                row_s, row_m = block_scores_literal(q[t, h].tolist(), keys, p, page,
                                                    magnitudes)
                scores[(h, t)], mags[(h, t)] = row_s, row_m
                out[h, t] = select_literal(row_s, topk, local_blocks, initial_blocks)
    return out, scores, mags


def block_scores_literal(q_row, keys, p, page, magnitudes=True):
    """(scores, magnitudes) of the blocks 0 .. p // page seen from position p: per block,
    the max over its keys j <= p of q . k_j (NaN if any dot is NaN) and of sum |q_d k_jd|."""
    row_s, row_m = [], []
    for b in range(p // page + 1):
        best, mag = -math.inf, 0.0
        for j in range(b * page, min(b * page + page, p + 1)):
            products = [x * y for x, y in zip(q_row, keys[j], strict=True)]
            dot = math.fsum(products)
            best = math.nan if math.isnan(dot) or math.isnan(best) else max(best, dot)
            if magnitudes:
                mag = max(mag, math.fsum(abs(x) for x in products))
        row_s.append(best)
        row_m.append(mag)
    return row_s, row_m


def select_literal(row_scores, topk, local_blocks, initial_blocks):
    """One row's selection: forced blocks (initial, then local, each ascending, the initial
    ones winning when they do not all fit), then the others by descending score, NaN last,
    equal scores to the lower id; then -1."""
    num_visible = len(row_scores)
    n = min(topk, num_visible)
    initial = [b for b in range(num_visible) if b < initial_blocks]
    local = [b for b in range(num_visible)
             if b >= num_visible - local_blocks and b not in initial]
    chosen = (initial + local)[:n]
    others = [b for b in range(num_visible) if b not in initial and b not in local]
    others.sort(key=lambda b: (math.isnan(row_scores[b]),
                               0.0 if math.isnan(row_scores[b]) else -row_scores[b], b))
    chosen += others[: n - len(chosen)]
    return chosen + [-1] * (topk - n)
