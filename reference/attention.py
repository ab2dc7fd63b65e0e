"""Block-sparse GQA attention over a paged KV cache (contract.md section 6), in float64 NumPy.

Semantics. A query row is a token at absolute position ``p`` of request ``r``; query head
``qh`` reads KV head ``g = qh // G`` (``G = Hq / Hkv``). Its selection is the SET of
non-negative entries of ``topk[g, row, :]`` (negative entries, -1 by convention, are ignored
wherever they stand). Its keys are every position ``j`` of a selected block ``b`` (``j // P
== b``) with ``j <= p`` and ``j < seq_len[r]``, read through ``block_table[r, j // P]`` at
offset ``j % P`` and dequantised as ``decode(code) * scale`` (``reference.kv_cache``). Then::

    out = softmax_j(softmax_scale * q . K_j) @ V,    softmax_scale = 1 / sqrt(D) by default

Rows with no keys (decode padding rows, seq_len = 0) give zeros, never NaN. Cache content a
row must not see (unselected blocks, keys past p or past seq_len, unused pages, the tail of
the last page) is never used in any arithmetic of that row, so NaN there cannot leak: key
tiles are sliced to what the row sees, never masked by adding -inf (0 * NaN = NaN).

Invalid selections (a block past ``p // P``, a block repeated in one row) raise ValueError
when ``validate=True``. With ``validate=False`` the contents are trusted: such entries are
dropped (past ``p // P`` they hold no visible key; a repeat counts once, as in a set), and
out-of-range block-table entries are unspecified (IndexError or a wrong page).

Rounding schedule (``Schedule``): the reference applies an implementation's declared
rounding points exactly, so the implementation is judged against its own schedule and only
its fp32 accumulation order / exp2 / division errors are left to the tolerance bound. The
exact schedule (``EXACT``, the default) is plain float64 math with an unrounded float64
output; ``exact(out_dtype)`` rounds only the output; ``vllm_schedule(act)`` is vLLM's.

Two forms exist: the fast block-centric form, and the literal per-row form
(``attention_literal``) that reads like the formulas above and cross-checks it. The fast
form works per KV head and chunk of rows: every selected (request, block) is decoded once
(fp8 and bf16/fp16 by a per-code table, a scalar scale folded in) and multiplied with all
the rows that selected it in one float64 BLAS matmul; logits are kept per (row, block)
pair; pass 1 gives each pair's max, reduced exactly to the row / split / tile maxima; pass
2 forms P, its sums and P @ V block by block. All bookkeeping is float64 and exact up to
float64 rounding (agreement with the literal form: ~1e-15 relative). KV heads run in
parallel threads for large calls (``THREADS``); results do not depend on it.
"""

from __future__ import annotations

import math
import operator
import os
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from typing import NamedTuple

import numpy as np

from reference.codec import (
    FORMATS,
    ROUNDING_DTYPES,
    bf16_from_f32,
    decode,
    round_by_table,
    round_dtype,
)
from reference.domain import DECODE_ROWS_RANGE, check_in_range
from reference.kv_cache import check_scales, scale_at, token_slots

ACT_DTYPES = ("bfloat16", "float16")

# Work bounds of the fast form: elements of the per-chunk logit array and of one decoded
# batch of key blocks (float64), and the pair count from which a block is multiplied with
# its rows by one matmul instead of a batched per-pair product.
_CHUNK_ELEMS = 1 << 22
_UNIT_ELEMS = 1 << 19
_HEAVY_PAIRS = 4
# KV heads run in up to THREADS threads when a call is large (NumPy and BLAS release the
# GIL); results do not depend on it. Threads on top of a multi-threaded BLAS oversubscribe
# the cores (slower, measured on 2 cores), so the default is one thread
# unless BLAS is pinned to one (OPENBLAS_NUM_THREADS=1 or OMP_NUM_THREADS=1), then the
# cores. REFERENCE_ATTENTION_THREADS overrides; the module attribute may be set too.
_BLAS_PINNED = "1" in (os.environ.get("OPENBLAS_NUM_THREADS"), os.environ.get("OMP_NUM_THREADS"))
THREADS = int(os.environ.get("REFERENCE_ATTENTION_THREADS",
                             min(4, os.cpu_count() or 1) if _BLAS_PINNED else 1))
_THREADED_ELEMS = 1 << 22  # smaller calls (logit elements, roughly) run in one thread


# ----------------------------------------------------------------------------- rounding


def _check_dtype(name, value, choices=ROUNDING_DTYPES):
    if value not in choices:
        raise ValueError(f"{name} must be one of {list(choices)}, got {value!r}")


# ----------------------------------------------------------------------------- schedule


@dataclass(frozen=True)
class Schedule:
    """Where an implementation rounds, applied exactly by the reference.

    Notation for one query row and head: ``s_j = softmax_scale * q . K_j`` (float64, from the
    scheduled K), ``V_j`` the scheduled V, "round" = RNE to the named dtype.

    kv_dtype
        Dequantised K/V. ``"float64"``: ``decode(code) * scale`` exactly. ``"float32"``:
        ``f32(decode(code) * f32(scale))``, an fp32 multiply. ``"bfloat16"``/``"float16"``
        (vLLM, "act"): ``act(f32(act(decode(code)) * f32(scale)))``: the code converted to
        act (exact for every fp8 format), times the fp32 scale in fp32, re-rounded to act.
        A missing scale is 1.0, which this leaves unchanged (vLLM multiplies only when a
        scale tensor is passed; the results agree). For bf16/fp16 caches the scale is 1
        and only the conversion to kv_dtype applies.
    p_dtype, p_max, blocks_per_tile
        ``p_j`` used in ``P @ V`` is rounded to p_dtype; the row sum ``l`` always uses
        unrounded p. ``p_max="row"``: ``P_j = round(exp(s_j - m))`` with ``m`` the max over
        all keys of the split (a two-pass kernel, or all keys in one tile). ``"running"``
        (online softmax): the split's blocks, in ``order``, form tiles of
        ``blocks_per_tile`` consecutive blocks; tile t rounds relative to the running max
        ``m_t`` = max over tiles 0..t, and the exact rescaling follows:
        ``P_j = round(exp(s_j - m_t)) * exp(m_t - m)``. With ``p_dtype="float64"`` both
        modes are the same.
    tile_keys
        None: tiles of whole blocks (``blocks_per_tile``). An integer: a kernel that cuts
        each block into tiles of ``tile_keys`` consecutive keys (a divisor of P, with
        ``blocks_per_tile`` 1 and ``order`` "ascending"): the online-softmax tiles are the
        blocks' tiles, block by block in order, key order within a block. Computed as
        the same attention over pages of ``tile_keys`` keys (block e's tile i as block
        ``e * P / tile_keys + i``): exactly that order, and a block's tiles past a row's
        position are the last of its selection, so a split chunk of ``blocks_per_split``
        blocks is one of ``blocks_per_split * P / tile_keys`` such blocks.
    key_streams
        1: one online softmax per split chunk. S > 1 (with ``tile_keys = P / S`` and
        ``p_max`` "running"; a kernel that gives each warp its own slice of every block):
        tile i of every block goes to stream i, each stream rounds P relative to its own
        running max (over its tiles 0..t, block by block), and the streams of a chunk
        combine exactly before the chunk's partial rounding: ``P_j = round(exp(s_j -
        m_{w,t})) * exp(m_{w,t} - m)``.
    blocks_per_split, partial_dtype, lse_dtype
        ``None``: no split-K; ``out = sum_j P_j V_j / l``. An integer n: the row's selected
        blocks, in ``order`` and counted among the valid entries only (ranks 0, 1, ...),
        are split into consecutive chunks of n blocks (chunk c = ranks c*n .. c*n+n-1; a
        row with fewer blocks has fewer chunks). Each chunk is its own softmax (own max,
        own tiles for ``p_max``): ``o_c = sum_{j in c} P_j V_j / l_c`` rounded to
        partial_dtype, ``lse_c = m_c + log(l_c)`` rounded to lse_dtype; then the exact merge
        ``out = sum_c w_c o_c / sum_c w_c`` with ``w_c = exp(lse_c - max_c lse_c)``. A row
        whose blocks all fall in one chunk still goes through the partial rounding and the
        merge (what a split-K kernel with one non-empty split writes).
    order
        ``"ascending"``: blocks by ascending block id. ``"given"``: in the order their
        entries stand in ``topk[g, row, :]`` (negative entries skipped, a repeat counts at
        its first position). Only matters for ``"running"`` tiles and split chunks; a
        kernel that splits by raw entry position agrees with ``"given"`` whenever the -1
        entries trail, as the indexer writes them.
    out_dtype
        The output's rounding (``"float64"``: returned unrounded).
    q_dtype
        q as the ``q . K`` products see it (``scheduled_q``). ``"given"``: the model-dtype
        values as they are. ``"float16"``: each (token, head) row scaled by a power of two
        ``2^s`` chosen from its largest magnitude, rounded to fp16 (RNE) and scaled back:
        exact for every element within ``2^31`` of the row's largest (bf16 has 8
        significant bits, fp16 11), smaller ones rounded to fp16's subnormal grid there.
        ``"bfloat16"``: the same with bf16 and the row's largest scaled into [2^100,
        2^101) (``Q_TOP["bfloat16"]``): a bf16 q unchanged, an fp16 q rounded to 8 bits.

    Not modelled (left to the tolerance bound): the fp32 accumulation order of q.K and
    P@V, exp2 and its scale folding, the fp32 row sum and division, and the fp32 value of
    ``softmax_scale``; ``p`` is computed exactly and rounded once, where a kernel rounds its
    fp32 exp2 result (near a p_dtype midpoint the two may differ by one step).
    """

    kv_dtype: str = "float64"
    p_dtype: str = "float64"
    p_max: str = "row"
    blocks_per_tile: int = 1
    blocks_per_split: int | None = None
    partial_dtype: str = "float64"
    lse_dtype: str = "float32"
    out_dtype: str = "float64"
    order: str = "ascending"
    q_dtype: str = "given"
    tile_keys: int | None = None
    key_streams: int = 1

    def __post_init__(self):
        for name in ("kv_dtype", "p_dtype", "partial_dtype", "lse_dtype", "out_dtype"):
            _check_dtype(name, getattr(self, name))
        if self.p_max not in ("row", "running"):
            raise ValueError(f"p_max must be 'row' or 'running', got {self.p_max!r}")
        if self.order not in ("ascending", "given"):
            raise ValueError(f"order must be 'ascending' or 'given', got {self.order!r}")
        if self.q_dtype not in ("given", "float16", "bfloat16"):
            raise ValueError(f"q_dtype must be 'given', 'float16' or 'bfloat16', "
                             f"got {self.q_dtype!r}")
        if not isinstance(self.blocks_per_tile, int) or self.blocks_per_tile < 1:
            raise ValueError(f"blocks_per_tile must be an integer >= 1, "
                             f"got {self.blocks_per_tile!r}")
        bps = self.blocks_per_split
        if bps is not None and (not isinstance(bps, int) or bps < 1):
            raise ValueError(f"blocks_per_split must be None or an integer >= 1, got {bps!r}")
        tk = self.tile_keys
        if tk is not None:
            if not isinstance(tk, int) or tk < 1:
                raise ValueError(f"tile_keys must be None or an integer >= 1, got {tk!r}")
            if self.blocks_per_tile != 1 or self.order != "ascending":
                raise ValueError("tile_keys needs blocks_per_tile 1 and order 'ascending', "
                                 f"got {self.blocks_per_tile} and {self.order!r}")
        ks = self.key_streams
        if not isinstance(ks, int) or ks < 1:
            raise ValueError(f"key_streams must be an integer >= 1, got {ks!r}")
        if ks > 1 and (tk is None or self.p_max != "running"):
            raise ValueError("key_streams > 1 needs tile_keys and p_max 'running', "
                             f"got tile_keys {tk!r} and p_max {self.p_max!r}")


EXACT = Schedule()


#: ``q_row_exponent``'s target per scheduled q dtype: the biased exponent a row's largest
#: magnitude is scaled to (2^14 for fp16, 2^100 for bf16).
Q_TOP = {"float16": 141, "bfloat16": 227}


def q_row_exponent(q, q_dtype: str = "float16") -> np.ndarray:
    """The power of two ``s`` of ``Schedule.q_dtype = "float16"`` for each row (last axis)
    of q (model-dtype values, exact in fp32): ``clip(141 - E, -113, 126)`` with E the
    biased fp32 exponent of the row's largest ``|q|`` as an integer bit pattern (a NaN
    ranks above Inf, Inf above every number: E = 255 for a non-finite row). The largest
    finite magnitude then lands in [2^14, 2^15); the clip keeps ``2^s`` and ``2^-s``
    normal fp32 numbers (a bf16 row's smallest subnormal, 2^-133, scales to 2^-7).
    ``"bfloat16"``: 227 for 141 (``Q_TOP``)."""
    bits = np.abs(np.asarray(q, np.float64)).astype(np.float32).view(np.uint32)
    e = (bits.max(axis=-1) >> 23).astype(np.int64)
    return np.clip(Q_TOP[q_dtype] - e, -113, 126)


def scheduled_q(q, q_dtype: str = "given") -> np.ndarray:
    """q as the products see it under ``Schedule.q_dtype`` (float64 values): ``"given"``
    as is; ``"float16"`` / ``"bfloat16"``: ``round(q * 2^s) * 2^-s`` per row
    (``q_row_exponent``), the only rounding that dtype's RNE (power-of-two scalings are
    exact)."""
    qa = np.asarray(q, np.float64)
    if q_dtype == "given":
        return qa
    f = np.ldexp(1.0, q_row_exponent(qa, q_dtype))[..., None]
    with np.errstate(over="ignore", invalid="ignore"):
        return round_dtype(qa * f, q_dtype) / f


def exact(out_dtype: str = "float64") -> Schedule:
    """Pure float64 math; the output rounded once to out_dtype (float64: unrounded)."""
    return Schedule(out_dtype=out_dtype)


def vllm_schedule(act: str = "bfloat16", blocks_per_split: int | None = None,
                  order: str = "given", p_max: str = "running",
                  blocks_per_tile: int = 1) -> Schedule:
    """vLLM's sparse attention schedule (contract.md s.6) for activation dtype ``act``.

    K/V dequantised to act (fp8 -> act exactly; times the fp32 scale in fp32, re-rounded
    to act); P rounded to act for P@V, the row sum unrounded; split-K partials in act with
    fp32 LSE; output in act. ``blocks_per_split`` is the decode kernel's split size in
    blocks (None: no split, as in prefill). The tile structure (``order``, ``p_max``,
    ``blocks_per_tile``: online softmax over one P-key block per tile, blocks in the order
    of the topk entries) is the usual Triton structure; confirm it against the kernel
    source before relying on it for a tight bound.
    """
    _check_dtype("act", act, ACT_DTYPES)
    return Schedule(kv_dtype=act, p_dtype=act, p_max=p_max, blocks_per_tile=blocks_per_tile,
                    blocks_per_split=blocks_per_split, partial_dtype=act,
                    lse_dtype="float32", out_dtype=act, order=order)


class AttentionResult(NamedTuple):
    """``out``: rounded to the schedule's out_dtype; ``unrounded``: the float64 output
    before that rounding; ``lse``: float64 ``[T, Hq]`` natural-log sum of exp of the scaled
    logits (in split mode merged from the rounded chunk LSEs), -inf for rows with no keys."""

    out: np.ndarray
    unrounded: np.ndarray
    lse: np.ndarray


# ----------------------------------------------------------------------------- validation


def _int_array(x, name, ndim):
    a = np.asarray(x)
    if a.dtype.kind not in "iu" or a.ndim != ndim:
        raise ValueError(f"{name} must be a {ndim}-D integer array, got {a.dtype} "
                         f"of shape {a.shape}")
    return a


def _check_common(q, kv_cache, kv_fmt, block_table, seq_lens, topk, k_scale, v_scale,
                  softmax_scale, schedule, validate):
    if kv_fmt not in FORMATS:
        raise ValueError(f"kv_fmt must be one of {sorted(FORMATS)}, got {kv_fmt!r}")
    if not isinstance(kv_cache, np.ndarray) or kv_cache.ndim != 4:
        raise ValueError("kv_cache must be a 4-D array [num_pages, Hkv, P, 2*D]")
    if kv_cache.dtype != FORMATS[kv_fmt].code_dtype:
        raise ValueError(f"kv_cache must hold {np.dtype(FORMATS[kv_fmt].code_dtype).name} "
                         f"codes for {kv_fmt}, got {kv_cache.dtype}")
    num_pages, hkv, page, two_d = kv_cache.shape
    if two_d % 2 or two_d == 0 or page < 1 or hkv < 1:
        raise ValueError(f"kv_cache must have shape [num_pages, Hkv, P, 2*D] with even last "
                         f"dim, got {kv_cache.shape}")
    d = two_d // 2
    qa = np.asarray(q)
    if qa.dtype.kind != "f" or qa.ndim != 3 or qa.shape[2] != d:
        raise ValueError(f"q must be a float array [T, Hq, D] with D = {d} (kv_cache), got "
                         f"{qa.dtype} of shape {qa.shape}")
    if qa.shape[1] < 1 or qa.shape[1] % hkv:
        raise ValueError(f"q has Hq = {qa.shape[1]} heads, which is not a positive multiple "
                         f"of Hkv = {hkv} (kv_cache)")
    qa = qa.astype(np.float64, copy=False)
    seq = _int_array(seq_lens, "seq_lens", 1).astype(np.int64)
    if seq.size and seq.min() < 0:
        raise ValueError(f"seq_lens must be >= 0, got {seq.min()}")
    bt = _int_array(block_table, "block_table", 2)
    if bt.shape[0] != seq.size:
        raise ValueError(f"block_table must have one row per request ({seq.size}), "
                         f"got shape {bt.shape}")
    need = -(-seq // page)
    if need.size and need.max() > bt.shape[1]:
        r = int(np.argmax(need))
        raise ValueError(f"block_table has {bt.shape[1]} columns, too few for request {r} "
                         f"(seq_len {seq[r]} needs {need[r]} pages of {page})")
    tk = _int_array(topk, "topk", 3)
    if tk.shape[0] != hkv or tk.shape[1] != qa.shape[0]:
        raise ValueError(f"topk must have shape [Hkv, T, K] = [{hkv}, {qa.shape[0]}, K], "
                         f"got {tk.shape}")
    if tk.shape[2] < 1:
        raise ValueError(f"topk must have K >= 1 entries per row, got shape {tk.shape}")
    ks = check_scales(k_scale, "k_scale", kv_fmt, hkv, num_pages * page)
    vs = check_scales(v_scale, "v_scale", kv_fmt, hkv, num_pages * page)
    if softmax_scale is None:
        softmax_scale = 1.0 / math.sqrt(d)
    elif not (isinstance(softmax_scale, (int, float, np.floating, np.integer))
              and math.isfinite(softmax_scale) and softmax_scale > 0):
        raise ValueError(f"softmax_scale must be a finite number > 0, got {softmax_scale!r}")
    if schedule is None:
        schedule = EXACT
    elif not isinstance(schedule, Schedule):
        raise ValueError(f"schedule must be a Schedule or None, got {type(schedule).__name__}")
    if schedule.tile_keys is not None and page % schedule.tile_keys:
        raise ValueError(f"tile_keys (of the schedule) must divide the page size P = "
                         f"{page}, got {schedule.tile_keys}")
    if schedule.key_streams > 1 and schedule.tile_keys * schedule.key_streams != page:
        raise ValueError(f"key_streams x tile_keys (of the schedule) must be the page size "
                         f"P = {page}, got {schedule.key_streams} x {schedule.tile_keys}")
    if validate not in (True, False):
        raise ValueError(f"validate must be True or False, got {validate!r}")
    if validate:
        cols = np.arange(bt.shape[1])[None, :]
        used = cols < need[:, None]
        bad = used & ((bt < 0) | (bt >= num_pages))
        if bad.any():
            r, c = np.argwhere(bad)[0]
            raise ValueError(f"block_table[{r}, {c}] = {bt[r, c]} is not a page index in "
                             f"[0, {num_pages}) although request {r} uses that block")
    return qa, seq, bt.astype(np.int64), tk, ks, vs, float(softmax_scale), schedule


def _check_selection(tk, row_pos, page):
    """topk entries must be <= p // P and not repeated in a row (rows with p >= 0 only)."""
    rows = np.flatnonzero(row_pos >= 0)
    if not rows.size:
        return
    sel = tk[:, rows, :].astype(np.int64)
    last = (row_pos[rows] // page)[None, :, None]
    past = (sel >= 0) & (sel > last)
    if past.any():
        g, i, k = np.argwhere(past)[0]
        raise ValueError(
            f"topk[{g}, {rows[i]}, {k}] = {sel[g, i, k]} selects a block past the query's "
            f"last visible block p // P = {row_pos[rows[i]]} // {page} = {last[0, i, 0]}")
    srt = np.sort(np.where(sel >= 0, sel, -1), axis=2)
    dup = (srt[..., 1:] == srt[..., :-1]) & (srt[..., 1:] >= 0)
    if dup.any():
        g, i, k = np.argwhere(dup)[0]
        raise ValueError(f"topk[{g}, {rows[i]}, :] selects block {srt[g, i, k + 1]} more "
                         f"than once")


# ----------------------------------------------------------------------------- public ops


def prefill_positions(cu_seqlens_q, seq_lens, num_tokens):
    """(request, position) of each new token: the i-th new token of request r sits at
    ``seq_lens[r] - query_len[r] + i``. Validates ``cu_seqlens_q`` against them."""
    seq = np.asarray(seq_lens).astype(np.int64)
    cu = _int_array(cu_seqlens_q, "cu_seqlens_q", 1).astype(np.int64)
    if cu.shape != (seq.size + 1,):
        raise ValueError(f"cu_seqlens_q must have len(seq_lens) + 1 = {seq.size + 1} "
                         f"entries, got {cu.shape[0]}")
    qlen = np.diff(cu)
    if cu[0] != 0 or (qlen < 0).any() or cu[-1] != num_tokens:
        raise ValueError(f"cu_seqlens_q must start at 0, be non-decreasing and end at "
                         f"T = {num_tokens}, got {cu.tolist()[:8]}...")
    if (qlen > seq).any():
        r = int(np.argmax(qlen > seq))
        raise ValueError(f"seq_lens[{r}] = {seq[r]} is less than request {r}'s query length "
                         f"{qlen[r]} (seq_lens counts the new tokens too)")
    row_req = np.repeat(np.arange(seq.size), qlen)
    row_pos = np.arange(num_tokens) - cu[row_req] + (seq - qlen)[row_req]
    return row_req, row_pos


def decode_positions(seq_lens, rows_per_request):
    """(request, position) of each decode row: rows are request-major, row j of request r
    at ``seq_lens[r] - rows_per_request + j``; requests with seq_len 0 are padding (position
    -1, output zeros)."""
    seq = np.asarray(seq_lens).astype(np.int64)
    rows = rows_per_request
    bad = (seq != 0) & (seq < rows)
    if bad.any():
        r = int(np.argmax(bad))
        raise ValueError(f"seq_lens[{r}] = {seq[r]} is less than rows_per_request = {rows} "
                         f"(and not 0, which marks a padding row)")
    row_req = np.repeat(np.arange(seq.size), rows)
    j = np.tile(np.arange(rows), seq.size)
    row_pos = np.where(seq[row_req] > 0, seq[row_req] - rows + j, -1)
    return row_req, row_pos


def sparse_attention_prefill(q, kv_cache, kv_fmt, block_table, cu_seqlens_q, seq_lens, topk,
                             k_scale=None, v_scale=None, softmax_scale=None, schedule=None,
                             validate=True, return_details=False):
    """Block-sparse GQA attention of a ragged batch of new tokens (contract.md s.6).

    q: float ``[T, Hq, D]`` (model-dtype values); kv_cache: logical ``[num_pages, Hkv, P,
    2*D]`` codes of format ``kv_fmt`` (any strides); block_table: int ``[B, max_blocks]``;
    cu_seqlens_q: int ``[B + 1]``; seq_lens: int ``[B]`` (total length including the new
    tokens); topk: int ``[Hkv, T, K]`` logical block ids (any strides, e.g. a transposed
    token-major buffer); k_scale/v_scale: None (1.0), a scalar, or ``[Hkv, num_pages*P]``.
    Returns ``out`` float64 ``[T, Hq, D]`` rounded to ``schedule.out_dtype`` (EXACT by
    default: unrounded), or an ``AttentionResult`` when ``return_details``.
    """
    qa, seq, bt, tk, ks, vs, scale, sched = _check_common(
        q, kv_cache, kv_fmt, block_table, seq_lens, topk, k_scale, v_scale, softmax_scale,
        schedule, validate)
    row_req, row_pos = prefill_positions(cu_seqlens_q, seq, qa.shape[0])
    if validate:
        _check_selection(tk, row_pos, kv_cache.shape[2])
    res = _attend(qa, kv_cache, kv_fmt, bt, row_req, row_pos, seq, tk, ks, vs, scale, sched)
    return res if return_details else res.out


def sparse_attention_decode(q, kv_cache, kv_fmt, block_table, seq_lens, topk,
                            rows_per_request, k_scale=None, v_scale=None, softmax_scale=None,
                            schedule=None, validate=True, return_details=False):
    """Block-sparse GQA attention of 1..4 query rows per request (contract.md s.6).

    q: float ``[B * rows_per_request, Hq, D]``, rows request-major, row j of request r at
    position ``seq_lens[r] - rows_per_request + j``; requests with ``seq_lens[r] == 0`` are
    padding and give zeros (their topk and block-table rows are not read). Other arguments
    and the result as in ``sparse_attention_prefill``.
    """
    try:
        rows = operator.index(rows_per_request)
    except TypeError:
        rows = rows_per_request
    check_in_range("rows_per_request", rows, *DECODE_ROWS_RANGE)
    qa, seq, bt, tk, ks, vs, scale, sched = _check_common(
        q, kv_cache, kv_fmt, block_table, seq_lens, topk, k_scale, v_scale, softmax_scale,
        schedule, validate)
    if qa.shape[0] != seq.size * rows:
        raise ValueError(f"q must have len(seq_lens) * rows_per_request = {seq.size * rows} "
                         f"rows, got {qa.shape[0]}")
    row_req, row_pos = decode_positions(seq, rows)
    if validate:
        _check_selection(tk, row_pos, kv_cache.shape[2])
    res = _attend(qa, kv_cache, kv_fmt, bt, row_req, row_pos, seq, tk, ks, vs, scale, sched)
    return res if return_details else res.out


# ----------------------------------------------------------------------------- fast form


class _Dequantizer:
    """Scheduled K or V values of whole pages of one KV head, by table lookup.

    kv_dtype float64: ``decode(code) * scale`` in float64. Otherwise the code's value (in
    act for an act schedule: exact for fp8) is held in float32, times the scale rounded to
    fp32 by an fp32 multiply (NumPy float32 arithmetic is IEEE RNE, subnormals included),
    then rounded to bf16/fp16 for an act schedule. A scalar scale folds into the per-code
    table. Codes past a page's valid length are replaced by code 0 before decoding, so
    they are never part of any product."""

    def __init__(self, cache, fmt, scale, kv_dtype, half):
        self.cache, self.kv_dtype = cache, kv_dtype
        d = cache.shape[3] // 2
        self.cols = slice(0, d) if half == 0 else slice(d, 2 * d)
        values = FORMATS[fmt].values
        if kv_dtype in ACT_DTYPES:
            values = round_dtype(values, kv_dtype)
        if kv_dtype != "float64":
            with np.errstate(over="ignore", invalid="ignore"):
                values = values.astype(np.float32)  # exact: act and fp8 values fit
        self.per_slot = scale.ndim == 2
        self.scale = scale if kv_dtype == "float64" else scale.astype(np.float32)
        self.table = values if self.per_slot else self._apply(values, self.scale)

    def _apply(self, x, s):
        """The schedule's float64 value of decoded x times scale s (Schedule.kv_dtype)."""
        if self.kv_dtype == "float64":
            return x * s
        with np.errstate(over="ignore", invalid="ignore"):
            prod = x * s  # float32 * float32: the fp32 multiply, one rounding
            if self.kv_dtype == "float32":
                return prod.astype(np.float64)
            if self.kv_dtype == "float16":
                return prod.astype(np.float16).astype(np.float64)
            return bf16_from_f32(prod)

    def __call__(self, pages, lengths, g):
        page = self.cache.shape[2]
        codes = self.cache[pages, g, :, self.cols]
        short = lengths < page
        if short.any():
            codes[(np.arange(page)[None, :] >= lengths[:, None])] = 0
        x = np.take(self.table, codes.astype(np.intp))  # faster than table[codes]
        if self.per_slot:
            s = self.scale[g, (pages[:, None] * page + np.arange(page)[None, :])]
            x = self._apply(x, s[..., None])
        return x


def _normalise_selection(sel, last_block, order):
    """Valid selected blocks of each row, deduplicated and compacted in schedule order
    (int64 ``[n, Kc]``, -1 padded, Kc = the largest count)."""
    n, k = sel.shape
    sel = sel.astype(np.int64)
    valid = (sel >= 0) & (sel <= last_block[:, None])
    big = np.iinfo(np.int64).max
    by_block = np.argsort(np.where(valid, sel, big), axis=1, kind="stable")
    sv = np.take_along_axis(sel, by_block, 1)
    vv = np.take_along_axis(valid, by_block, 1)
    vv[:, 1:] &= sv[:, 1:] != sv[:, :-1]  # a repeat counts once, at its first position
    np.put_along_axis(valid, by_block, vv, 1)
    key = sel if order == "ascending" else np.broadcast_to(np.arange(k), (n, k))
    idx = np.argsort(np.where(valid, key, big), axis=1, kind="stable")
    out = np.where(np.take_along_axis(valid, idx, 1), np.take_along_axis(sel, idx, 1), -1)
    kc = max(1, int(valid.sum(1).max(initial=0)))
    return out[:, :kc]


def _tiles_as_pages(cache, bt, tk, tile):
    """``Schedule.tile_keys``: the cache as pages of ``tile`` keys (page n's tile i is page
    ``n * P / tile + i``; a slot keeps its number ``page * P + key``, so per-slot scales
    apply unchanged), and the block table and selections as ids of those tiles (negative
    entries stay -1)."""
    n, h, page, d2 = cache.shape
    sub = page // tile
    tiles = cache.reshape(n, h, sub, tile, d2).transpose(0, 2, 1, 3, 4)
    i = np.arange(sub)

    def spread(a):
        a = np.asarray(a, np.int64)
        return np.where(a[..., None] >= 0, a[..., None] * sub + i, -1).reshape(
            *a.shape[:-1], a.shape[-1] * sub)  # explicit: -1 fails on empty arrays

    return tiles.reshape(n * sub, h, tile, d2), spread(bt), spread(tk)


def _attend(q, cache, fmt, bt, row_req, row_pos, seq, tk, ks, vs, scale, sched):
    t_rows, hq, d = q.shape
    _, hkv, page, _ = cache.shape
    if sched.tile_keys is not None and sched.tile_keys < page:
        sub = page // sched.tile_keys
        bps = sched.blocks_per_split
        cache, bt, tk = _tiles_as_pages(cache, bt, tk, sched.tile_keys)
        # tile_keys kept (now the page size: no further cut) for key_streams' check
        sched = replace(sched, blocks_per_split=bps and bps * sub)
        return _attend(q, cache, fmt, bt, row_req, row_pos, seq, tk, ks, vs, scale, sched)
    grp = hq // hkv
    out = np.zeros((t_rows, hq, d))
    lse = np.full((t_rows, hq), -np.inf)
    active = np.flatnonzero(row_pos >= 0)
    if not active.size:
        return AttentionResult(out.copy(), out, lse)
    kdec = _Dequantizer(cache, fmt, ks, sched.kv_dtype, 0)
    vdec = _Dequantizer(cache, fmt, vs, sched.kv_dtype, 1)
    qa = scheduled_q(q[active], sched.q_dtype) * scale

    def head(g):  # KV heads are independent and write disjoint outputs
        heads = slice(g * grp, (g + 1) * grp)
        sel = _normalise_selection(tk[g, active, :], row_pos[active] // page, sched.order)
        kc = sel.shape[1]
        bps = kc if sched.blocks_per_split is None else sched.blocks_per_split
        kp = -(-kc // bps) * bps
        sel = np.pad(sel, ((0, 0), (0, kp - kc)), constant_values=-1)
        n_chunk = max(1, _CHUNK_ELEMS // (grp * kp * page))
        buf = np.empty((min(n_chunk, active.size) * kp, grp, page))  # logits, reused
        for c0 in range(0, active.size, n_chunk):
            c1 = min(c0 + n_chunk, active.size)
            rows = active[c0:c1]
            o, l_ = _attend_chunk(np.ascontiguousarray(qa[c0:c1, heads]), sel[c0:c1],
                                  row_req[rows], row_pos[rows], seq, bt, page, g, kdec, vdec,
                                  sched, bps, buf)
            out[rows, heads] = o
            lse[rows, heads] = l_

    workers = min(THREADS, hkv) if active.size * tk.shape[2] * hq * page > _THREADED_ELEMS else 1
    if workers > 1:
        with ThreadPoolExecutor(workers) as pool:
            list(pool.map(head, range(hkv)))
    else:
        for g in range(hkv):
            head(g)
    return AttentionResult(round_dtype(out, sched.out_dtype), out, lse)


def _attend_chunk(qg, sel, req, pos, seq, bt, page, g, kdec, vdec, sched, bps, buf):
    """One KV head, one chunk of rows: qg ``[n, G, D]`` (pre-scaled), sel ``[n, Kp]``.

    A *pair* is (row, selected block); a *unit* is (request, block), decoded once for all
    the pairs that share it. Logits live in pair layout ``[pairs, G, P]`` (pairs sorted by
    unit, a unit's fully visible pairs first). A unit used by many rows is one matmul with
    all of them; units used by few rows are one batched product over their pairs; a pair
    whose row sees only part of the block (its own block, with keys past p in it) gets its
    own products on exactly the keys it sees, so no invisible key enters any arithmetic.
    Pass 1 (K): logits and per-pair maxima. Then the split / tile maxima. Pass 2 (V): per
    unit, P = exp(logits - max) (rounded as scheduled), the pair sums, and P @ V."""
    n, grp, d = qg.shape
    ns = sel.shape[1] // bps
    pr = _pairs(sel, req, pos, seq, bt, page, bps, d)
    logits, pmax = _logits(qg, pr, g, kdec, page, buf)
    stream = pr.u_blk[pr.pu] % sched.key_streams  # a tile's stream: its index in its block
    m, ref, factor = _maxima(pmax, pr.pi, pr.pk, pr.pc, n, ns, bps, sched, stream)
    num, psum = _weighted_values(pr, g, vdec, logits, ref, factor, sched, n, ns, grp, d)
    if factor is not None:
        psum *= factor
    l_sum = np.zeros((n, ns, grp))
    np.add.at(l_sum, (pr.pi, pr.pc), psum)
    return _combine(num, m, l_sum, sched)


@dataclass
class _Pairs:
    """The (row, block) pairs of a chunk, sorted by unit, and its units (see
    ``_attend_chunk``): per pair its row, selection slot, unit, visible keys, partial flag
    and split; per unit its page and key count; and the batches of units decoded at once,
    each (u0, u1, light pairs, heavy units, partial pairs)."""

    pi: np.ndarray
    pk: np.ndarray
    pu: np.ndarray
    p_vis: np.ndarray
    partial: np.ndarray
    pc: np.ndarray
    u_blk: np.ndarray
    u_page: np.ndarray
    u_len: np.ndarray
    bounds: np.ndarray
    n_full: np.ndarray
    light_pair: np.ndarray
    batches: list


def _pairs(sel, req, pos, seq, bt, page, bps, d) -> _Pairs:
    """The pairs and units of a chunk's selections, and the unit batches that bound the
    decoded keys' size (``_UNIT_ELEMS``)."""
    pi, pk = np.nonzero(sel >= 0)
    pb = sel[pi, pk]
    width = bt.shape[1]
    units, pu = np.unique(req[pi] * width + pb, return_inverse=True)
    u_req, u_blk = units // width, units % width
    u_len = np.minimum(page, seq[u_req] - u_blk * page)  # keys of the block < seq_len
    p_vis = np.minimum(u_len[pu], pos[pi] + 1 - pb * page)  # keys the pair's row sees
    partial = p_vis < u_len[pu]
    order = np.lexsort((partial, pu))
    pi, pk, pu, p_vis, partial = pi[order], pk[order], pu[order], p_vis[order], partial[order]
    bounds = np.searchsorted(pu, np.arange(units.size + 1))
    n_full = np.bincount(pu[~partial], minlength=units.size)
    heavy_unit = n_full >= _HEAVY_PAIRS
    light_pair = ~heavy_unit[pu] & ~partial
    step = max(1, _UNIT_ELEMS // (page * d))
    batches = []
    for u0 in range(0, units.size, step):
        u1 = min(u0 + step, units.size)
        a, b = bounds[u0], bounds[u1]
        light = np.flatnonzero(light_pair[a:b]) + a
        if light.size and light[-1] - light[0] + 1 == light.size:
            light = slice(light[0], light[-1] + 1)  # contiguous: views instead of copies
        batches.append((u0, u1, light, np.flatnonzero(heavy_unit[u0:u1]) + u0,
                        np.flatnonzero(partial[a:b]) + a))
    return _Pairs(pi, pk, pu, p_vis, partial, pk // bps, u_blk, bt[u_req, u_blk], u_len,
                  bounds, n_full, light_pair, batches)


def _decoded(dec, pr, g, u0, u1, light):
    """Decoded blocks of units u0..u1, and one per light pair (no copy if the same)."""
    x = dec(pr.u_page[u0:u1], pr.u_len[u0:u1], g)
    idx = pr.pu[light] - u0
    if idx.size == u1 - u0 and np.array_equal(idx, np.arange(u1 - u0)):
        return x, x
    return x, x[idx]


def _logits(qg, pr, g, kdec, page, buf):
    """Pass 1: every pair's logits ``[pairs, G, P]`` (in ``buf``; only the keys the pair
    sees are written) and their maxima ``[pairs, G]``."""
    grp, d = qg.shape[1], qg.shape[2]
    pi, pu = pr.pi, pr.pu
    logits = buf[:pi.size]  # every entry used is written below
    pmax = np.empty((pi.size, grp))
    with np.errstate(invalid="ignore"):
        for u0, u1, light, heavy, parts in pr.batches:
            kd, kl = _decoded(kdec, pr, g, u0, u1, light)
            if kl.shape[0]:
                s = np.matmul(qg[pi[light]], kl.transpose(0, 2, 1))
                lens = pr.u_len[pu[light]]
                if (lens < page).any():
                    s = np.where(np.arange(page)[None, None, :] < lens[:, None, None], s,
                                 -np.inf)
                logits[light] = s
                pmax[light] = s.max(axis=2)
            for u in heavy:
                a, nf, nu = pr.bounds[u], pr.n_full[u], pr.u_len[u]
                qu = qg[pi[a:a + nf]].reshape(-1, d)
                s = np.matmul(qu, kd[u - u0, :nu].T).reshape(nf, grp, nu)
                logits[a:a + nf, :, :nu] = s
                pmax[a:a + nf] = s.max(axis=2)
            for e in parts:
                v = pr.p_vis[e]
                s = qg[pi[e]] @ kd[pu[e] - u0, :v].T
                logits[e, :, :v] = s
                pmax[e] = s.max(axis=1)
    return logits, pmax


def _weighted_values(pr, g, vdec, logits, ref, factor, sched, n, ns, grp, d):
    """Pass 2: the split numerators ``sum P @ V`` ``[n, ns, G, D]`` and each pair's sum of
    P ``[pairs, G]`` (unscaled by ``factor``), P = exp(logits - ref) rounded to the
    schedule's ``p_dtype``."""
    pi, pc, pu = pr.pi, pr.pc, pr.pu
    num = np.zeros((n, ns, grp, d))
    psum = np.empty((pi.size, grp))
    light_all = np.flatnonzero(pr.light_pair)
    w_light = np.empty((light_all.size, grp, d))
    filled = 0

    def probs(x, rows):
        """Scheduled P of pairs ``rows`` from their logits x (modified in place)."""
        x -= ref[rows][..., None]
        np.exp(x, out=x)
        psum[rows] = x.sum(axis=-1)
        return round_dtype(x, sched.p_dtype)

    with np.errstate(invalid="ignore", over="ignore"):
        for u0, u1, light, heavy, parts in pr.batches:
            vd, vl = _decoded(vdec, pr, g, u0, u1, light)
            if vl.shape[0]:
                x = logits[light]
                k = vl.shape[0]
                np.matmul(probs(x, light), vl, out=w_light[filled:filled + k])
                filled += k
            for u in heavy:
                a, nf, nu = pr.bounds[u], pr.n_full[u], pr.u_len[u]
                p = probs(logits[a:a + nf, :, :nu], slice(a, a + nf))
                res = (p.reshape(-1, nu) @ vd[u - u0, :nu]).reshape(nf, grp, d)
                if factor is not None:
                    res *= factor[a:a + nf, :, None]
                num[pi[a:a + nf], pc[a:a + nf]] += res  # a unit holds a row once
            for e in parts:
                v = pr.p_vis[e]
                res = probs(logits[e, :, :v], e) @ vd[pu[e] - u0, :v]
                num[pi[e], pc[e]] += res if factor is None else res * factor[e][:, None]
    if light_all.size:
        _add_light(num, w_light, light_all, pr, factor, ns)
    return num, psum


def _add_light(num, w_light, light_all, pr, factor, ns):
    """Adds the light pairs' P @ V to their (row, split) numerators: light pairs may repeat
    (row, split), so by segmented sums."""
    n, grp, d = num.shape[0], num.shape[2], num.shape[3]
    if factor is not None:
        w_light *= factor[light_all][..., None]
    key = pr.pi[light_all] * ns + pr.pc[light_all]
    srt = np.argsort(key, kind="stable")
    if not np.array_equal(srt, np.arange(srt.size)):
        key, w_light = key[srt], w_light[srt]
    starts = np.flatnonzero(np.r_[True, key[1:] != key[:-1]])
    num.reshape(n * ns, grp, d)[key[starts]] += np.add.reduceat(w_light, starts, axis=0)


def _maxima(pmax, pi, pk, pc, n, ns, bps, sched, stream):
    """From per-pair maxima ``[pairs, G]``: the split max ``m [n, ns, G]``, each pair's
    reference max ``ref`` for P (the split max, or with ``p_max="running"`` the running
    max of its tile within its key stream ``stream``, ``Schedule.key_streams``) and
    ``factor = exp(ref - m)`` rescaling its P @ V and its sum to the split max (None when
    ref is the split max). Non-finite maxima (NaN content) are replaced by 0 so that they
    propagate as NaN rather than produce spurious values."""
    grp = pmax.shape[1]
    with np.errstate(invalid="ignore", over="ignore"):
        m = np.full((n, ns, grp), -np.inf)
        np.maximum.at(m, (pi, pc), pmax)
        m0 = np.where(np.isfinite(m), m, 0.0)[pi, pc]
        if sched.p_max != "running" or sched.p_dtype == "float64":
            return m, m0, None
        bpt = sched.blocks_per_tile
        nt = -(-bps // bpt)
        pt = (pk % bps) // bpt
        tmax = np.full((n, ns, sched.key_streams, nt, grp), -np.inf)
        np.maximum.at(tmax, (pi, pc, stream, pt), pmax)
        run = np.maximum.accumulate(tmax, axis=3)[pi, pc, stream, pt]
        ref = np.where(np.isfinite(run), run, m0)
        return m, ref, np.exp(ref - m0)


def _combine(num, m, l_sum, sched):
    """Outputs ``[n, G, D]`` and LSE ``[n, G]`` from per-split numerators ``[n, ns, G, D]``,
    maxima and sums ``[n, ns, G]``."""
    nonempty = ~(l_sum == 0)  # NaN from visible NaN content propagates, it is not "empty"
    with np.errstate(invalid="ignore", divide="ignore", over="ignore"):
        safe_l = np.where(nonempty, l_sum, 1.0)
        o = np.where(nonempty[..., None], num / safe_l[..., None], 0.0)
        lse_c = np.where(nonempty, m + np.log(safe_l), -np.inf)
        if sched.blocks_per_split is None:
            return o[:, 0], lse_c[:, 0]
        o = round_dtype(o, sched.partial_dtype)
        lse_c = round_dtype(lse_c, sched.lse_dtype)
        top = lse_c.max(axis=1, keepdims=True)
        top0 = np.where(np.isfinite(top), top, 0.0)
        wgt = np.where(nonempty, np.exp(lse_c - top0), 0.0)
        total = wgt.sum(axis=1)
        has = ~(total == 0)
        safe_t = np.where(has, total, 1.0)
        out = np.where(has[..., None], (wgt[..., None] * o).sum(axis=1) / safe_t[..., None],
                       0.0)
        lse = np.where(has, top0[:, 0] + np.log(safe_t), -np.inf)
    return out, lse


# ----------------------------------------------------------------------------- literal form
# The module docstring's formulas written out per row, per query head, per split chunk and
# per key tile, with every rounding of the schedule by the codec's table path. Slow; it
# shares nothing with the fast form but the codec and the cache addressing, and the tests
# hold the fast form to it.


def attention_literal(q, kv_cache, kv_fmt, block_table, seq_lens, topk, row_req, row_pos,
                      k_scale=None, v_scale=None, schedule=EXACT, softmax_scale=None):
    """(unrounded output [T, Hq, D], lse [T, Hq]) of every query row ``t`` of request
    ``row_req[t]`` at position ``row_pos[t]`` (negative: a padding row, zeros), one row and
    query head at a time. Inputs are trusted (no validation)."""
    t_rows, hq, d = q.shape
    grp = hq // kv_cache.shape[1]
    scale = 1.0 / math.sqrt(d) if softmax_scale is None else softmax_scale
    out, lse = np.zeros((t_rows, hq, d)), np.full((t_rows, hq), -np.inf)
    for t in range(t_rows):
        r, p = int(row_req[t]), int(row_pos[t])
        if p < 0:
            continue
        for qh in range(hq):
            g = qh // grp
            kv = _LiteralKV(kv_cache, kv_fmt, block_table[r], g, k_scale, v_scale,
                            schedule.kv_dtype)
            keys_seen = min(p + 1, int(seq_lens[r]))
            blocks = _literal_blocks(topk[g, t, :], schedule.order)
            out[t, qh], lse[t, qh] = _literal_row(q[t, qh], scale, kv, blocks, keys_seen,
                                                  schedule)
    return out, lse


@dataclass(frozen=True)
class _LiteralKV:
    """One request's KV head g, read key by key through its block-table row."""

    cache: np.ndarray
    fmt: str
    bt_row: np.ndarray
    g: int
    k_scale: object
    v_scale: object
    kv_dtype: str

    def read(self, keys, half):
        """Scheduled K (half 0) or V (half 1) at key positions ``keys``:
        ``round_kv(round_fp32(round_kv(decode(code)) * round_fp32(scale)))``."""
        page, d = self.cache.shape[2], self.cache.shape[3] // 2
        slots = token_slots(self.bt_row, keys, page)
        codes = self.cache[slots // page, self.g, slots % page, half * d:(half + 1) * d]
        x = decode(codes, self.fmt)
        scale = self.k_scale if half == 0 else self.v_scale
        s = 1.0 if scale is None else np.reshape(scale_at(scale, self.g, slots), (-1, 1))
        if self.kv_dtype == "float64":
            return x * s
        s32 = round_by_table(s, "float32")
        if self.kv_dtype == "float32":
            return round_by_table(x * s32, "float32")
        x = round_by_table(x, self.kv_dtype)
        return round_by_table(round_by_table(x * s32, "float32"), self.kv_dtype)


def _literal_blocks(selection, order):
    """The selected blocks as a set, in entry order or ascending."""
    blocks = []
    for b in selection:
        if b >= 0 and int(b) not in blocks:
            blocks.append(int(b))
    return sorted(blocks) if order == "ascending" else blocks


def _literal_spans(chunk, page, s):
    """Key positions of each tile of a chunk: ``blocks_per_tile`` whole blocks, or each
    block's tiles of ``tile_keys`` keys in key order."""
    if s.tile_keys is None:
        return [[j for b in chunk[t0:t0 + s.blocks_per_tile]
                 for j in range(b * page, (b + 1) * page)]
                for t0 in range(0, len(chunk), s.blocks_per_tile)]
    return [list(range(j0, j0 + s.tile_keys)) for b in chunk
            for j0 in range(b * page, (b + 1) * page, s.tile_keys)]


def _literal_row(q_row, scale, kv, blocks, keys_seen, s):
    """(output, lse) of one row and head: each split chunk's softmax, then their merge."""
    page = kv.cache.shape[2]
    bps = s.blocks_per_split or len(blocks)
    parts = []
    for c0 in range(0, len(blocks), bps):
        tiles = []
        for span in _literal_spans(blocks[c0:c0 + bps], page, s):
            keys = np.array([j for j in span if j < keys_seen], dtype=np.int64)
            if keys.size:  # a tile wholly past the row's position has nothing to attend
                stream = (span[0] % page) // s.tile_keys if s.key_streams > 1 else 0
                tiles.append((scale * (kv.read(keys, 0) @ q_row), kv.read(keys, 1), stream))
        parts.append(_literal_softmax(tiles, s))
    if s.blocks_per_split is None:
        return parts[0]
    return _literal_merge(parts, s)


def _literal_softmax(tiles, s):
    """(P @ V / sum P, lse) over a chunk's tiles of (logits, V, stream): P = exp(logit - ref)
    rounded to ``p_dtype``, ref the chunk max or the stream's running max, then rescaled to
    the chunk max."""
    m = max(float(np.max(lg)) for lg, _, _ in tiles)
    acc, total, run = np.zeros(tiles[0][1].shape[1]), 0.0, {}
    for lg, v, w in tiles:
        run[w] = max(run.get(w, -np.inf), float(np.max(lg)))
        ref = run[w] if s.p_max == "running" else m
        p_raw = np.exp(lg - ref)
        total += p_raw.sum() * math.exp(ref - m)
        acc += (round_by_table(p_raw, s.p_dtype) * math.exp(ref - m)) @ v
    return acc / total, m + math.log(total)


def _literal_merge(parts, s):
    """Split-K merge: outputs rounded to ``partial_dtype`` and lse to ``lse_dtype``, weighted
    by exp(lse - max lse)."""
    outs = [round_by_table(o, s.partial_dtype) for o, _ in parts]
    lses = [float(round_by_table(lse, s.lse_dtype)) for _, lse in parts]
    top = max(lses)
    w = [math.exp(x - top) for x in lses]
    o = sum(wi * oi for wi, oi in zip(w, outs, strict=True)) / sum(w)
    return o, top + math.log(sum(w))
