"""Shared by the two indexer kernels (kernels/indexer_prefill.py, kernels/indexer_decode.py):
the device helpers that score key blocks and keep a running top-k list and the host checks
of their arguments. contract.md section 5 is the contract; the float64
reference is reference/indexer.py.

Rows. A program owns ROWS "rows": (query token, index head) pairs flattened token-major
(row i = token i // Hi, head i % Hi), so one key block, loaded once, serves every head and
every token of the program (Hi need not be a power of two: rows past the last whole token
are masked).

Scores. For key block b (logical id, physical page ``block_table[r, b]``), each row's score
is ``max over visible keys j (j <= p) of q . k_j`` with fp32 products and fp32 accumulation:
q and k are widened exactly to fp32 (bf16/fp16 by a cast, fp8 codes by
``kernels.fp8.decode_fp8``: hardware conversion for e4m3fn/e5m2, software codec for the
fnuz formats) and multiplied by ``tl.dot(..., input_precision="ieee")`` (no TF32, no
reduced-precision fp8 MMA) or, in the decode kernel's ``scan_blocks_fma``, by exact fp32
products summed in FMA chains (another fp32 summation order: the oracle's bound covers any
order), so the registry declares ``score_rel = 0``. A NaN dot on a visible key makes the
score NaN (tracked explicitly: hardware max drops NaNs; the FMA scan uses the
NaN-propagating max); -0 is normalised to +0.

Selection: one 64-bit key per (row, block) encodes the whole order of contract.md s.5 so that
"larger key" means "ranks first", and keys of one row are unique:

    key = class_and_score << 32 | (0xFFFFFFFF - b)

with class_and_score = 0xFFFFFFFF for a forced block (initial or local: forced blocks come
first and, among them, the lower id wins, so initial blocks beat local ones when they
exceed n), 1 for a NaN score (ranks below every number; among NaNs the lower id first),
else the order-preserving map of the fp32 score bits (descending score; bit-equal scores:
the lower id wins through the low word). Keys below 2^32 mean "empty".

Each row keeps a list of BK = next_pow2(K) keys (unsorted), initialised with the distinct
empty keys 0..BK-1; after the last block it holds the BK largest keys of the row. Two exact
strategies fill it in ``scan_blocks`` (``strategy`` picks one; both produce the same list;
``scan_blocks_fma`` also fills a column per block when it scans at most BK blocks):
- replace-min (compiled default): one block per step; its key takes the slot of the row's
  smallest key if larger (keys are unique, so exactly one slot changes). O(BK) per block.
- rank merge (``VEC``, interpreted default): CH blocks per step; every key of the list and
  of the step gets its stable rank in their union and the BK first are kept. Needs 3-d
  tiles (R x BK x (BK + CH)), pointless on a GPU but it cuts the interpreter's per-call
  overhead (every device-function call costs milliseconds there) by scoring a request's
  blocks in one or a few steps.
Writing: an entry's stable rank in its row (number of larger keys; equal keys by position)
is its output column, so the first K are written in descending key order without a sort
(tl.sort's xor reductions run element by element in the interpreter); the valid ones are
exactly n = min(K, num_visible), since every visible block got a non-empty key; empty keys
are written as -1. The list does not depend on the order in which blocks arrive, which is
what makes the decode kernel's split-and-merge exact.

Guards (contents are checked on the host only under ``validate=True``): a block-table entry
outside [0, num_pages) reads no memory (its keys are 0), blocks at or past the table's
width are never visited, token indices outside [0, T) are neither read nor written, rows at
negative positions select nothing.
"""

from __future__ import annotations

import numpy as np
import torch

from kernels._host import (
    HALF_FORMATS,
    HEAD_DIMS,
    check_int,
    check_last_dim_contiguous,
    check_tensor,
    fail,
)
from kernels._triton import tl, triton
from kernels.fp8 import FMT_E4M3FN, HW_FORMATS, decode_fp8, decode_fp8_to, fmt_code
from reference.domain import KV_HEADS_RANGE, PAGE_SIZES, TOPK_RANGE
from reference.formats import FP8_FORMATS, MODEL_DTYPES

# The bitonic top-k's building blocks (private to Triton 3.6, pinned): ``_top_of_runs``
# runs its last steps alone.
_bitonic_merge_hypercube = triton.language.standard._bitonic_merge_hypercube
_log2 = triton.language.standard._log2

#: The index formats the kernels read: the four fp8 formats (uint8 codes; e4m3fn/e4m3fnuz
#: are what platforms use, e5m2/e5m2fnuz exist for emulation) and the model dtypes.
INDEX_FORMATS = (*FP8_FORMATS, *MODEL_DTYPES)
INT_DTYPES = (torch.int32, torch.int64)


# ------------------------------------------------------------------------ device helpers


@triton.jit
def load_fp32(ptrs, mask, FP8: tl.constexpr, FMT: tl.constexpr, HW: tl.constexpr):
    """Values at ptrs widened exactly to fp32 (fp8 codes decoded; masked lanes 0)."""
    raw = tl.load(ptrs, mask=mask, other=0)
    if FP8:
        v = decode_fp8(raw, FMT, HW)
    else:
        v = raw.to(tl.float32)
    return v


@triton.jit
def empty_list(ROWS: tl.constexpr, BK: tl.constexpr):
    """A running top-k list of distinct empty keys 0..BK-1 per row, uint64 [ROWS, BK]."""
    cols = tl.arange(0, BK).to(tl.uint64)
    return tl.zeros([ROWS, BK], dtype=tl.uint64) + cols[None, :]


@triton.jit
def block_key(score, is_nan, forced, b):
    """The selection key of block(s) b for each row (see the module docstring)."""
    bits = score.to(tl.uint32, bitcast=True)
    bits = tl.where(bits == 0x80000000, 0, bits)  # -0 ranks as +0
    neg = (bits >> 31) != 0
    ordered = tl.where(neg, bits ^ 0xFFFFFFFF, bits | 0x80000000)  # (~ fails interpreted)
    cls = tl.where(forced, 0xFFFFFFFF, tl.where(is_nan, 1, ordered).to(tl.uint32))
    low = (4294967295 - b.to(tl.int64)).to(tl.uint64)
    return (cls.to(tl.uint64) << 32) | low


@triton.jit
def insert(top, key, live):
    """Replace-min insertion of one key per row (rows where ``live``) into a list of
    unique keys: the key takes the slot of the row's smallest key if it is larger."""
    m = tl.min(top, axis=1)
    ins = live & (key > m)
    return tl.where((top == m[:, None]) & ins[:, None], key[:, None], top)


@triton.jit
def rank_merge(top, cand, CH: tl.constexpr):
    """VEC strategy: the BK largest keys of ``top`` [R, BK] and ``cand`` [R, CH] per row.
    Every element of the union gets its stable rank (larger keys first; equal keys by
    position, top before cand), a permutation, and the element of rank j becomes entry j.
    Duplicates are allowed (empty keys may repeat). O(R * (BK + CH)^2) in 3-d tiles: fast
    interpreted, meant for the interpreter."""
    BK: tl.constexpr = top.shape[1]
    bi = tl.arange(0, BK)
    ci = tl.arange(0, CH)
    t_i = top[:, :, None]
    c_i = cand[:, :, None]
    r_top = (tl.sum(((top[:, None, :] > t_i) | ((top[:, None, :] == t_i)
                                                 & (bi[None, None, :] < bi[None, :, None])))
                    .to(tl.int32), axis=2)
             + tl.sum((cand[:, None, :] > t_i).to(tl.int32), axis=2))
    r_cand = (tl.sum((top[:, None, :] >= c_i).to(tl.int32), axis=2)
              + tl.sum(((cand[:, None, :] > c_i) | ((cand[:, None, :] == c_i)
                                                     & (ci[None, None, :] < ci[None, :, None])))
                       .to(tl.int32), axis=2))
    j = bi[None, :, None]
    zero = tl.zeros([1, 1, 1], dtype=tl.uint64)
    return (tl.sum(tl.where(r_top[:, None, :] == j, top[:, None, :], zero), axis=2)
            + tl.sum(tl.where(r_cand[:, None, :] == j, cand[:, None, :], zero), axis=2))


@triton.jit
def scan_blocks(top, q_rows, pos, live, bt_row, bt_s1, b_lo, b_hi,
                ic_ptr, ic_s0, ic_s1, num_pages, local_blocks, initial_blocks,
                P: tl.constexpr, D: tl.constexpr, BLOCK_N: tl.constexpr,
                BLOCK_D: tl.constexpr, ROWS: tl.constexpr, CH: tl.constexpr,
                VEC: tl.constexpr, FP8: tl.constexpr, FMT: tl.constexpr, HW: tl.constexpr):
    """Score key blocks b_lo .. b_hi-1, CH blocks per step, for every row and merge them into
    ``top`` (VEC: ``rank_merge``; else replace-min ``insert`` per block).

    q_rows: [ROWS] pointers to each row's index_q vector; pos: [ROWS] int32 positions;
    live: [ROWS] rows that select (others are neither read nor scored); bt_row: pointer to
    the request's block-table row (entries b_lo .. b_hi-1 must lie inside it). A step's keys
    are the CH blocks' first BLOCK_N keys, then the next BLOCK_N, ...: one tl.dot of
    [ROWS, BLOCK_D] x [BLOCK_D, CH * BLOCK_N] per (sub-block, D chunk). Replace-min
    (not VEC) takes one block per step (CH = 1)."""
    tl.static_assert(VEC or CH == 1, "replace-min scores one block per step")
    dd = tl.arange(0, BLOCK_D)
    kk = tl.arange(0, CH * BLOCK_N)
    kblk = kk // BLOCK_N  # block of each key lane within the step
    koff = kk % BLOCK_N
    cc = tl.arange(0, CH)
    own = pos // P  # the row's last visible block
    nvis = own + 1
    if BLOCK_D == D:  # q stays in registers
        q_all = load_fp32(q_rows[:, None] + dd[None, :], live[:, None], FP8, FMT, HW)
    for c0 in range(b_lo, b_hi, CH):
        bk = c0 + kblk  # logical block of each key lane
        lane_ok = bk < b_hi
        page = tl.load(bt_row + bk * bt_s1, mask=lane_ok, other=0).to(tl.int64)
        page_ok = lane_ok & (page >= 0) & (page < num_pages)
        krow = ic_ptr + tl.where(page_ok, page, 0) * ic_s0
        if VEC:
            best = tl.full([ROWS, CH], float("-inf"), tl.float32)
            has_nan = tl.zeros([ROWS, CH], dtype=tl.int32)
        else:  # CH == 1: 1-d per-row values (no 3-d tiles, whose layouts compile badly)
            best = tl.full([ROWS], float("-inf"), tl.float32)
            has_nan = tl.zeros([ROWS], dtype=tl.int32)
        for n0 in range(0, P, BLOCK_N):  # runtime loops: compact code, fast compiles
            kp = krow + (n0 + koff).to(tl.int64) * ic_s1
            acc = tl.zeros([ROWS, CH * BLOCK_N], dtype=tl.float32)
            for d0 in range(0, D, BLOCK_D):
                if BLOCK_D == D:
                    qc = q_all
                else:
                    qc = load_fp32(q_rows[:, None] + d0 + dd[None, :], live[:, None], FP8,
                                   FMT, HW)
                kc = load_fp32(kp[:, None] + d0 + dd[None, :], page_ok[:, None], FP8, FMT,
                               HW)
                acc = tl.dot(qc, tl.trans(kc), acc, input_precision="ieee")
            vis = (bk * P + n0 + koff)[None, :] <= pos[:, None]  # causal, per key
            nan = (vis & (acc != acc)).to(tl.int32)
            if VEC:
                s3 = tl.reshape(tl.where(vis, acc, float("-inf")), [ROWS, CH, BLOCK_N])
                best = tl.maximum(best, tl.max(s3, axis=2))
                has_nan = tl.maximum(has_nan, tl.max(tl.reshape(nan, [ROWS, CH, BLOCK_N]),
                                                     axis=2))
            else:
                best = tl.maximum(best, tl.max(tl.where(vis, acc, float("-inf")), axis=1))
                has_nan = tl.maximum(has_nan, tl.max(nan, axis=1))
        if VEC:
            b = c0 + cc  # [CH]
            sees = live[:, None] & (b[None, :] <= own[:, None]) & (b < b_hi)[None, :]
            forced = (b[None, :] < initial_blocks) | (b[None, :] >= nvis[:, None]
                                                       - local_blocks)
            keys = block_key(best, has_nan != 0, forced, b[None, :])
            top = rank_merge(top, tl.where(sees, keys, tl.zeros_like(keys)), CH)
        else:
            b1 = c0 + 0  # a tensor also in the interpreter (where loop variables are ints)
            forced = (b1 < initial_blocks) | (b1 >= nvis - local_blocks)
            top = insert(top, block_key(best, has_nan != 0, forced, b1), live & (b1 <= own))
    return top


@triton.jit
def write_list(top, out_ptr, o_s0, o_s1, o_s2, heads, toks, row_in, topk, BK: tl.constexpr,
               VEC: tl.constexpr):
    """Write each row's list in descending key order to ``out[head, token, :topk]`` through
    the strides (rows where ``row_in``): the entry of stable rank i (larger keys first,
    equal keys by position: a permutation) goes to column i when i < topk, as its block id,
    or -1 for an empty key. No sort (tl.sort's xor reductions run element by element in
    the interpreter): VEC ranks with one 3-d comparison, else BK rounds of one column
    against the whole list."""
    cols = tl.arange(0, BK)
    if VEC:
        t_i = top[:, :, None]
        t_j = top[:, None, :]
        rank = tl.sum(((t_j > t_i) | ((t_j == t_i) & (cols[None, None, :] < cols[None, :, None])))
                      .to(tl.int32), axis=2)
    else:
        rank = tl.zeros(top.shape, dtype=tl.int32)
        for j in range(BK):
            col = tl.max(tl.where(cols[None, :] == j, top, tl.zeros_like(top)), axis=1)
            rank += ((col[:, None] > top) | ((col[:, None] == top) & (j < cols[None, :]))
                     ).to(tl.int32)
    valid = (top >> 32) != 0
    ids = tl.where(valid, 4294967295 - (top & 0xFFFFFFFF).to(tl.int64), -1).to(tl.int32)
    dst = (out_ptr + heads.to(tl.int64)[:, None] * o_s0 + toks.to(tl.int64)[:, None] * o_s1
           + rank.to(tl.int64) * o_s2)
    tl.store(dst, ids, mask=row_in[:, None] & (rank < topk))


# ------------------------------------------- streaming FMA scan and merge (decode kernel)


@triton.jit
def _fma_pair(s1, w1, s2, w2):
    """Combine of a tuple reduction whose elements (s, w) stand for the products s * w: the
    sum of two is one FMA (w is 1 after the first combine and LLVM folds the multiply by 1),
    so a reduction within a thread is one FMA chain over the thread's elements."""
    return tl.fma(s2, w2, s1 * w1), tl.full(s1.shape, 1.0, tl.float32)


@triton.jit
def _nanmax(a, b):
    """max that propagates NaN (hardware max.NaN): a NaN dot anywhere makes the max NaN."""
    return tl.maximum(a, b, propagate_nan=tl.PropagateNan.ALL)


@triton.jit
def _key_dots(k, q, CHAIN: tl.constexpr):
    """k, q [LANES, BN, M, V] fp32 (q the same vector for every key) -> [BN]: each key's
    dot product. Dims M and V are held by each thread (CHAIN: one FMA chain of M * V
    products per key), LANES by lanes of a warp (log2(LANES) shuffle-adds at the end).
    Without CHAIN: ``tl.sum`` of the products (same fp32 values up to the summation order;
    the interpreter runs a tuple reduction's combine element by element, this vectorised)."""
    BN: tl.constexpr = k.shape[1]
    MV: tl.constexpr = k.shape[2] * k.shape[3]
    kk = tl.reshape(tl.permute(k, (1, 0, 2, 3)), [BN, k.shape[0], MV])
    qq = tl.reshape(tl.permute(q, (1, 0, 2, 3)), [BN, q.shape[0], MV])
    if CHAIN:
        s, _ = tl.reduce((kk, qq), 2, _fma_pair)
    else:
        s = tl.sum(kk * qq, axis=2)
    return tl.sum(s, axis=1)


@triton.jit
def _load_key_tile(kp, ok, LANES: tl.constexpr, M: tl.constexpr, V: tl.constexpr,
                   FP8: tl.constexpr, FMT: tl.constexpr, HW: tl.constexpr, PAIRS: tl.constexpr):
    """Key tile [LANES, BN, M, V] widened exactly to fp32 (masked: 0); element d = m *
    LANES * V + lane * V + v of each key. kp: [1, BN, 1, 1] pointers to the keys' rows.
    PAIRS (bf16 only; rows 4-byte aligned): read as int32 words of two bf16 values, widened
    by one integer op per value (``w << 16`` and ``w & 0xFFFF0000``: exactly the bf16 ->
    fp32 cast), instead of an extract and a shift."""
    if PAIRS:
        H: tl.constexpr = V // 2
        offs = (tl.arange(0, LANES)[:, None, None, None] * H
                + tl.arange(0, M)[None, None, :, None] * (LANES * H)
                + tl.arange(0, H)[None, None, None, :])
        w = tl.load(kp.to(tl.pointer_type(tl.int32), bitcast=True) + offs, mask=ok, other=0)
        lo = (w << 16).to(tl.float32, bitcast=True)
        hi = (w & -65536).to(tl.float32, bitcast=True)
        k = tl.reshape(tl.join(lo, hi), [w.shape[0], w.shape[1], w.shape[2], V])
    else:
        offs = (tl.arange(0, LANES)[:, None, None, None] * V
                + tl.arange(0, M)[None, None, :, None] * (LANES * V)
                + tl.arange(0, V)[None, None, None, :])
        k = load_fp32(kp + offs, ok, FP8, FMT, HW)
    return k


@triton.jit
def _take_block(top, best, b, b_lo, live, own, local_blocks, initial_blocks,
                DIRECT: tl.constexpr):
    """Block b's key (its per-row NaN-propagated maximum ``best``) into the rows' lists,
    for the rows that see it (``live``, ``b <= own``): DIRECT, column ``b - b_lo`` (a split
    of at most BK blocks); else replace-min ``insert``."""
    b1 = b + 0  # a tensor also in the interpreter (where loop variables are ints)
    forced = (b1 < initial_blocks) | (b1 >= own + 1 - local_blocks)
    key = block_key(best, best != best, forced, b1)
    if DIRECT:
        cols = tl.arange(0, top.shape[1])
        put = (cols[None, :] == b1 - b_lo) & (live & (b1 <= own))[:, None]
        top = tl.where(put, key[:, None], top)
    else:
        top = insert(top, key, live & (b1 <= own))
    return top


@triton.jit
def scan_blocks_fma(top, q_req, q_s0, q_s1, tok0, num_tokens, seq, bt_row, bt_s1, b_lo,
                    b_hi, ic_ptr, ic_s0, ic_s1, num_pages, local_blocks, initial_blocks,
                    P: tl.constexpr, D: tl.constexpr, HI: tl.constexpr, QR: tl.constexpr,
                    ROWS: tl.constexpr, LANES: tl.constexpr, BLOCK_N: tl.constexpr,
                    STAGES: tl.constexpr, FP8: tl.constexpr, FMT: tl.constexpr,
                    HW: tl.constexpr, PAIRS: tl.constexpr, DIRECT: tl.constexpr,
                    CHAIN: tl.constexpr):
    """The decode kernel's compiled strategy: score key blocks b_lo .. b_hi-1 of one
    request for its QR * HI rows (row i = token i // HI of the request, head i % HI; ROWS >=
    QR * HI the list's padded row count) without tl.dot, and collect their keys in ``top``:
    DIRECT (at most BK blocks, b_hi - b_lo <= BK): block b's key goes to column b - b_lo
    (a select; rows that do not see the block keep their distinct empty keys), so a
    block costs no min-reduction over the list (the caller merges the lists later); else
    replace-min ``insert``. (No store in the loop: it would keep the q loads from being
    hoisted.)

    Keys of a block are read as BLOCK_N-key tiles [LANES, BLOCK_N, M, V] of one 16-byte
    vector (V = 8 half or 16 fp8 elements) per thread and (LANES, M, V) = D: Triton's
    coalescing gives the V dim to a thread, LANES lanes along D, the other lanes and the warps
    along keys, and M to each thread (element d = m * LANES * V + lane * V + v), so every
    load is a 16-byte vector and every key's M * V products of a thread are one fp32 FMA
    chain (``_key_dots``), then log2(LANES) shuffle-adds; per row of the program, one static
    pass over the tile (no padding rows: the rows are constexpr). Each row's q vector is
    loaded as a tile of the same shape (every key the same vector, so it gets the tile's
    layout) inside the loop; it does not depend on the block, and Triton's loop-invariant
    code motion hoists it into registers (QR * HI * D / LANES fp32 per thread).
    The block loop is ``tl.range(..., num_stages=STAGES)``: Triton pipelines the key tiles
    (and the block-table entry they depend on) through shared memory with cp.async,
    STAGES - 1 blocks ahead. A block's per-key maxima live in a [BLOCK_N, ROWS] tile whose
    layout is the dot products' own (rows along the D lanes), reduced once per block.

    Scores are exact fp32 products accumulated in fp32 (another summation order than the
    dot path, within the same fp32 bound: ``score_rel = 0``); invisible keys (past the row's
    position) are -inf before a NaN-propagating max, so a NaN dot on a visible key makes
    the block's score NaN and an invisible one never does."""
    V: tl.constexpr = 16 if FP8 else 8
    M: tl.constexpr = D // (LANES * V)
    tl.static_assert(M * LANES * V == D, "LANES * (16-byte vector) must divide D")
    tl.static_assert(P % BLOCK_N == 0, "BLOCK_N must divide P")
    NR: tl.constexpr = QR * HI
    rows = tl.arange(0, ROWS)
    tq = rows // HI  # token of each row within the request
    pos = seq - QR + tq
    live = (rows < NR) & (tok0 + tq < num_tokens) & (seq > 0) & (pos >= 0)
    own = pos // P  # each row's last visible block
    nn = tl.arange(0, BLOCK_N)[None, :, None, None]
    dofs = (tl.arange(0, LANES)[:, None, None, None] * V
            + tl.arange(0, M)[None, None, :, None] * (LANES * V)
            + tl.arange(0, V)[None, None, None, :])
    kn = tl.arange(0, BLOCK_N)
    for b in tl.range(b_lo, b_hi, num_stages=STAGES):
        page = tl.load(bt_row + b * bt_s1).to(tl.int64)
        ok = (page >= 0) & (page < num_pages)  # else no memory is read (keys 0)
        kblk = ic_ptr + tl.where(ok, page, 0) * ic_s0
        sblk = tl.full([BLOCK_N, ROWS], float("-inf"), tl.float32)
        for n0 in tl.static_range(0, P, BLOCK_N):
            k = _load_key_tile(kblk + (n0 + nn).to(tl.int64) * ic_s1, ok, LANES, M, V, FP8,
                               FMT, HW, PAIRS)
            kpos = b * P + n0 + kn
            for i in tl.static_range(NR):
                p_i = seq - QR + i // HI
                live_i = (tok0 + i // HI < num_tokens) & (seq > 0) & (p_i >= 0)
                q = load_fp32(q_req + (i // HI) * q_s0 + (i % HI) * q_s1 + nn * 0 + dofs,
                              live_i, FP8, FMT, HW)
                s = tl.where(kpos <= p_i, _key_dots(k, q, CHAIN), float("-inf"))
                sblk = tl.where(rows[None, :] == i, _nanmax(sblk, s[:, None]), sblk)
        best = tl.reduce(sblk, 0, _nanmax)
        top = _take_block(top, best, b, b_lo, live, own, local_blocks, initial_blocks, DIRECT)
    return top


@triton.jit
def load_operand(ptrs, mask, FP8: tl.constexpr, FMT: tl.constexpr, HW: tl.constexpr,
                 F8MMA: tl.constexpr):
    """Values at ptrs as MMA operands, exactly: bf16/fp16 as stored; fp8 codes as the fp8
    type itself (F8MMA: hardware formats, fp8 tensor-core products) or as their fp16 values
    (every value of the four formats is one); masked lanes 0."""
    if F8MMA:  # loaded as the fp8 type (a bitcast after the load would route the wgmma
        # operand through registers and leave the pipeliner a single buffer)
        if FMT == FMT_E4M3FN:
            v = tl.load(ptrs.to(tl.pointer_type(tl.float8e4nv), bitcast=True), mask=mask,
                        other=0.0)
        else:
            v = tl.load(ptrs.to(tl.pointer_type(tl.float8e5), bitcast=True), mask=mask,
                        other=0.0)
    else:
        raw = tl.load(ptrs, mask=mask, other=0)
        v = decode_fp8_to(raw, FMT, HW, tl.float16) if FP8 else raw
    return v


@triton.jit
def scan_blocks_mma(top, q_req, q_s0, q_s1, tok0, num_tokens, seq, bt_row, bt_s1, b_lo,
                    b_hi, ic_ptr, ic_s0, ic_s1, num_pages, local_blocks, initial_blocks,
                    P: tl.constexpr, D: tl.constexpr, HI: tl.constexpr, QR: tl.constexpr,
                    ROWS: tl.constexpr, MR: tl.constexpr, CH: tl.constexpr,
                    STAGES: tl.constexpr, FP8: tl.constexpr, FMT: tl.constexpr,
                    HW: tl.constexpr, DIRECT: tl.constexpr, F8MMA: tl.constexpr):
    """The decode kernel's tensor-core strategy (``scan="mma"``): ``scan_blocks_fma``'s
    contract (rows, DIRECT columns or replace-min, NaN-propagating block maxima), with each
    block's scores one ``tl.dot`` of its whole key tile ``[P, D]`` by the rows' q ``[D,
    MR]`` on the tensor cores with an fp32 accumulator, keys along M (so on sm_90 the key
    tile goes from cp.async straight into ``wgmma``; MR = max(16, ROWS) rows along N, the
    padding costs nothing there; the list keeps its ROWS rows). Operands: bf16/fp16 as
    stored; hardware fp8 formats with F8MMA as fp8 (an fp8 ``wgmma``: Triton's default
    reduced-precision fp8 accumulation); else fp8 decoded exactly to fp16. The products
    are exact; the accumulation is the MMA's (16-bit operands: aligned, truncating
    additions per k-step; fp8: an accumulator of about 14 bits), not an IEEE fp32 sum: the
    registry declares ``score_rel`` per format for it.
    The block loop is ``tl.range(..., num_stages=STAGES)`` (pipelined key tiles), CH blocks
    per step: their tiles stacked along M in one dot (more bytes per step in flight), each
    block's maxima by a masked reduction."""
    NR: tl.constexpr = QR * HI
    rows = tl.arange(0, ROWS)  # the list's rows
    tq = rows // HI
    pos = seq - QR + tq
    live = (rows < NR) & (tok0 + tq < num_tokens) & (seq > 0) & (pos >= 0)
    own = pos // P
    dd = tl.arange(0, D)
    mr = tl.arange(0, MR)  # the MMA's rows (N >= 16): rows past ROWS are zeros
    mq = mr // HI
    m_pos = seq - QR + mq
    m_live = (mr < NR) & (tok0 + mq < num_tokens) & (seq > 0) & (m_pos >= 0)
    q = load_operand(q_req + mq.to(tl.int64)[:, None] * q_s0 + (mr % HI).to(tl.int64)
                     [:, None] * q_s1 + dd[None, :], m_live[:, None], FP8, FMT, HW, F8MMA)
    qt = tl.trans(q)  # [D, MR]
    kn = tl.arange(0, CH * P)  # CH blocks' keys stacked along M: one dot per step
    kc = kn // P  # block of each key within the step
    for b in tl.range(b_lo, b_hi, CH, num_stages=STAGES):
        pages = tl.zeros([CH * P], tl.int64)
        for c in tl.static_range(CH):
            pc = tl.load(bt_row + (b + c) * bt_s1, mask=b + c < b_hi, other=-1).to(tl.int64)
            pages = tl.where(kc == c, pc, pages)
        ok = (b + kc < b_hi) & (pages >= 0) & (pages < num_pages)  # else keys 0, no read
        kp = (ic_ptr + tl.where(ok, pages, 0)[:, None] * ic_s0
              + (kn % P).to(tl.int64)[:, None] * ic_s1 + dd[None, :])
        s = tl.dot(load_operand(kp, ok[:, None], FP8, FMT, HW, F8MMA), qt)  # [CH*P, MR]
        kpos = b * P + kn
        s = tl.where(kpos[:, None] <= m_pos[None, :], s, float("-inf"))
        for c in tl.static_range(CH):
            best = tl.reduce(tl.where((kc == c)[:, None], s, float("-inf")), 0, _nanmax)
            if MR != ROWS:  # the list's rows only: its keys, workspace and merge stay small
                best = tl.reduce(tl.where(mr[None, :] == rows[:, None], best[None, :],
                                          float("-inf")), 1, _nanmax)
            top = _take_block(top, best, b + c, b_lo, live & (b + c < b_hi), own,
                              local_blocks, initial_blocks, DIRECT)
    return top


@triton.jit
def _partial_tile(part, s0, num_splits, rows, ROWS: tl.constexpr, BK: tl.constexpr,
                  MC: tl.constexpr):
    """Partial lists s0 .. s0 + MC - 1 of ``part`` (int64 ``[num_splits, ROWS, BK]``, read
    through L2, ``.cg``: other programs wrote them) as uint64 ``[ROWS, MC * BK]``; lists
    past num_splits read as key 0 (empty)."""
    n = tl.arange(0, MC * BK)
    sp = s0 + n // BK
    ptrs = (part + rows.to(tl.int64)[:, None] * BK
            + (sp.to(tl.int64) * (ROWS * BK) + n % BK)[None, :])
    return tl.load(ptrs, mask=(sp < num_splits)[None, :], other=0,
                   cache_modifier=".cg").to(tl.uint64, bitcast=True)


@triton.jit
def _tile_top(cand, ROWS: tl.constexpr, BK: tl.constexpr):
    """The BK largest keys of each row of ``cand``, in descending order."""
    if BK == 1:  # tl.topk with k = 1 does not compile (Triton 3.6): a plain max
        return tl.reshape(tl.max(cand, axis=1), [ROWS, 1])
    else:
        return tl.topk(cand, BK)


@triton.jit
def _step_top(part, s0, num_splits, rows, ROWS: tl.constexpr, BK: tl.constexpr,
              MC: tl.constexpr, SORTED: tl.constexpr):
    cand = _partial_tile(part, s0, num_splits, rows, ROWS, BK, MC)
    if SORTED and BK > 1:
        return _top_of_runs(cand, BK)
    else:
        return _tile_top(cand, ROWS, BK)


@triton.jit
def merge_partials(part, num_splits, rows, ROWS: tl.constexpr, BK: tl.constexpr,
                   MC: tl.constexpr, SORTED: tl.constexpr = False):
    """The BK largest keys per row of ``num_splits`` partial lists stored at ``part`` as
    int64 ``[num_splits, ROWS, BK]``, sorted in descending order: MC lists per step, the
    bitonic top-k of the step's MC * BK keys (``tl.topk``; SORTED: lists stored sorted by
    ``store_partial``, its last steps alone), then (from the second step on) of those BK
    and the running BK. Exact: keys of a row are unique except empty ones (< 2^32, which
    rank below every valid key)."""
    if SORTED and BK > 1 and MC > 1:
        return _merge_sorted_partials(part, num_splits, rows, ROWS, BK, MC)
    merged = _step_top(part, 0, num_splits, rows, ROWS, BK, MC, SORTED)
    for s0 in range(MC, num_splits, MC):
        best = _step_top(part, s0, num_splits, rows, ROWS, BK, MC, SORTED)
        merged = _tile_top(tl.reshape(tl.join(merged, best), [ROWS, 2 * BK]), ROWS, BK)
    return merged


@triton.jit
def _runs(a, b):
    """``[ROWS, BK]`` lists a then b as one ``[ROWS, 2 BK]`` row each (concatenated, not
    interleaved as ``tl.join``'s last axis would leave them)."""
    return tl.reshape(tl.permute(tl.join(a, b), (0, 2, 1)), [a.shape[0], 2 * a.shape[1]])


@triton.jit
def _merge_sorted_partials(part, num_splits, rows, ROWS: tl.constexpr, BK: tl.constexpr,
                           MC: tl.constexpr):
    """``merge_partials`` of presorted lists (``store_partial``, MC > 1) when they may
    take more than one step: the first two steps' lists are loaded together (one L2 round
    trip on the critical path, not two: the flat grid's requests have 9-10 lists at the
    model shape, MC 8), each later step's top comes out ascending, so it and the running
    descending top form the two runs of ``_top_of_runs`` (its last stage alone, not a
    whole ``tl.topk`` of the pair)."""
    first = _partial_tile(part, 0, num_splits, rows, ROWS, BK, MC)
    if num_splits > MC:
        second = _partial_tile(part, MC, num_splits, rows, ROWS, BK, MC)
        merged = _top_of_runs(_runs(_top_of_runs(second, BK, 0), _top_of_runs(first, BK, 1)),
                              BK, 1)
        for s0 in range(2 * MC, num_splits, MC):
            best = _top_of_runs(_partial_tile(part, s0, num_splits, rows, ROWS, BK, MC), BK, 0)
            merged = _top_of_runs(_runs(best, merged), BK, 1)
    else:
        merged = _top_of_runs(first, BK, 1)
    return merged


@triton.jit
def _top_of_runs(cand, BK: tl.constexpr, ORDER: tl.constexpr = 1):
    """``tl.topk(cand, BK)`` for ``cand`` ``[ROWS, N]`` whose runs of BK keys are already
    sorted, ascending and descending in turn (run 0 ascending): the bitonic top-k's last
    steps alone (Triton's ``sort_impl`` after its first log2(BK) stages, which sort the
    runs so): per step the larger of each pair of runs, key by key (a bitonic run holding
    the pair's top BK), merged into order: ORDER 1 descending (as ``tl.topk``), 0
    ascending."""
    LOG_K: tl.constexpr = _log2(BK)
    LOG_N: tl.constexpr = _log2(cand.shape[1])
    h = tl.reshape(cand, [2] * _log2(cand.numel))
    for i in tl.static_range(LOG_K + 1, LOG_N + 1):
        h = tl.max(h, axis=_log2(h.numel) - 1 - LOG_K)
        h = _bitonic_merge_hypercube(h, LOG_K, 2 if i < LOG_N else ORDER)
    return tl.reshape(h, [cand.shape[0], BK])


@triton.jit
def store_partial(mine, top, rows, s, MC: tl.constexpr, SORTED: tl.constexpr):
    """Split s's partial list ``top`` ``[ROWS, BK]`` to its workspace slot ``mine`` (int64
    ``[ROWS, BK]``) as ``merge_partials`` reads it: SORTED, in descending order written
    back to front (ascending) for even s when MC > 1, so lists s0 .. s0 + MC - 1 of a
    merge step form ``_top_of_runs``' runs (MC 1: the list is the merge, descending)."""
    BK: tl.constexpr = top.shape[1]
    cols = tl.arange(0, BK)
    if SORTED and BK > 1:
        top = tl.sort(top, descending=True)
        if MC > 1:
            cols = tl.where(s % 2 == 0, BK - 1 - cols, cols)
    tl.store(mine + rows.to(tl.int64)[:, None] * BK + cols[None, :],
             top.to(tl.int64, bitcast=True))


@triton.jit
def write_sorted(top, out_ptr, o_s0, o_s1, o_s2, heads, toks, row_in, topk, BK: tl.constexpr):
    """``write_list`` for a list already in descending key order (``merge_partials``):
    entry i goes to column i."""
    cols = tl.arange(0, BK)
    valid = (top >> 32) != 0
    ids = tl.where(valid, 4294967295 - (top & 0xFFFFFFFF).to(tl.int64), -1).to(tl.int32)
    dst = (out_ptr + heads.to(tl.int64)[:, None] * o_s0 + toks.to(tl.int64)[:, None] * o_s1
           + cols.to(tl.int64)[None, :] * o_s2)
    tl.store(dst, ids, mask=row_in[:, None] & (cols[None, :] < topk))


# ---------------------------------------------------------------------------- host side


#: Triton's largest tensor (elements), also enforced by the interpreter.
MAX_NUMEL = 1 << 20


def pow2_arg(name, v, lo):
    """v as an int when it is a power of two >= lo, else ValueError naming it."""
    if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < lo or v & (v - 1):
        fail(name, f"must be a power of two >= {lo}, got {v!r}")
    return int(v)



def strategy(rows_wanted: int, hi: int, page: int, d: int, blocks: int, topk: int,
             interpreted: bool, block_rows=None, block_n=None, block_d=None,
             blocks_per_step=None, vec=None):
    """(ROWS, BLOCK_N, BLOCK_D, CH, VEC, BK): rows per program, the key sub-block and
    head-dim chunk of one tl.dot, the blocks scored per step, the merge strategy and the
    list width (next_pow2(K)).

    Compiled: ``rows_wanted`` rows (the caller's tl.dot M tile), fp32 tiles of 64 keys x
    32 dims (an FMA dot: small tiles compile in seconds), one block per step, replace-min.
    Interpreted, where every
    device-function call costs milliseconds: whole blocks and whole D, as many blocks per
    step as a program visits (``blocks``, an upper bound) and the vectorised rank merge,
    shrunk (blocks per step first) until every tile fits Triton's 2^20-element limit.
    Explicit arguments override (validated; ValueError naming them)."""
    if vec is None:
        vec = interpreted
    rows_min = max(16, triton.next_power_of_2(hi))
    if block_rows is not None:
        rows = pow2_arg("block_rows", block_rows, 16)
        if rows < hi:
            fail("block_rows", f"must be >= the number of index heads {hi}, got {rows}")
    else:
        rows = max(rows_min, min(triton.next_power_of_2(max(1, rows_wanted)),
                                 1024 if interpreted else 64))
    if block_n is None:
        block_n = page if interpreted else min(page, 64)
    if block_d is None:
        block_d = d if interpreted else min(d, 32)
    for name, v, whole in (("block_n", block_n, page), ("block_d", block_d, d)):
        if pow2_arg(name, v, 16) > whole or whole % v:
            fail(name, f"must be a power of two >= 16 dividing {whole}, got {v!r}")
    bk = triton.next_power_of_2(topk)
    if blocks_per_step is not None:
        ch = pow2_arg("blocks_per_step", blocks_per_step, 1)
    elif vec:
        ch = triton.next_power_of_2(max(1, blocks))
    else:
        ch = 1
    if not vec and ch != 1:
        fail("blocks_per_step", f"must be 1 with the replace-min merge (vec=False), got {ch}")

    def too_big(r, c):
        sizes = [r * c * block_n, c * block_n * block_d, r * block_d]
        if vec:
            sizes += [r * bk * max(bk, c)]
        return max(sizes) > MAX_NUMEL

    if vec and block_rows is None:  # the rank tiles [ROWS, BK, BK] first
        rows = max(rows_min, min(rows, MAX_NUMEL // (bk * bk)))
    while too_big(rows, ch):
        if ch > 1 and blocks_per_step is None:
            ch //= 2
        elif rows > rows_min and block_rows is None:
            rows //= 2
        else:
            fail("block_rows", f"and blocks_per_step give tiles over {MAX_NUMEL} elements "
                               f"(rows {rows}, blocks per step {ch}, K {topk})")
    return rows, int(block_n), int(block_d), ch, bool(vec), bk


def check_index_args(index_q, index_cache, index_fmt, block_table, seq_lens, topk,
                     local_blocks, initial_blocks):
    """Checks shared by both launchers (ValueError naming the argument). Returns
    (num_tokens, hi, d, page, num_pages, fp8, fmt constexpr, hw, K, L_loc, L_init)."""
    if index_fmt not in INDEX_FORMATS:
        fail("index_fmt", f"must be one of {list(INDEX_FORMATS)}, got {index_fmt!r}")
    fp8 = index_fmt not in HALF_FORMATS
    code_dtype = torch.uint8 if fp8 else HALF_FORMATS[index_fmt]
    check_tensor(index_cache, "index_cache", (code_dtype,))
    dev = index_cache.device
    if index_cache.dim() != 3 or index_cache.shape[1] not in PAGE_SIZES \
            or index_cache.shape[2] not in HEAD_DIMS:
        fail("index_cache", f"must have shape [num_pages, P in {list(PAGE_SIZES)}, D in "
                            f"{list(HEAD_DIMS)}] ({code_dtype} for {index_fmt}), got "
                            f"{list(index_cache.shape)}")
    check_last_dim_contiguous(index_cache, "index_cache")
    if any(s < 0 for s in index_cache.stride()):
        fail("index_cache", f"must have non-negative strides, got {list(index_cache.stride())}")
    num_pages, page, d = index_cache.shape
    check_tensor(index_q, "index_q", (code_dtype,), device=dev)
    lo, hi_max = KV_HEADS_RANGE
    if index_q.dim() != 3 or not lo <= index_q.shape[1] <= hi_max or index_q.shape[2] != d:
        fail("index_q", f"must have shape [T, Hi in [{lo}, {hi_max}], D={d}] (index_cache's "
                        f"D), got {list(index_q.shape)}")
    check_last_dim_contiguous(index_q, "index_q")
    if any(s < 0 for s in index_q.stride()):
        fail("index_q", f"must have non-negative strides, got {list(index_q.stride())}")
    check_tensor(block_table, "block_table", INT_DTYPES, device=dev)
    if block_table.dim() != 2:
        fail("block_table", f"must have shape [B, max_blocks], got {list(block_table.shape)}")
    b = block_table.shape[0]
    check_tensor(seq_lens, "seq_lens", INT_DTYPES, (b,), dev)
    k = check_int(topk, "topk", *TOPK_RANGE)
    loc = check_int(local_blocks, "local_blocks", 0)
    ini = check_int(initial_blocks, "initial_blocks", 0)
    code = fmt_code(index_fmt) if fp8 else 0
    hw = fp8 and index_fmt in HW_FORMATS
    return index_q.shape[0], index_q.shape[1], d, page, num_pages, fp8, code, hw, k, loc, ini


def check_out(out, hi, t, k, dev):
    """The output [Hi, T, K] int32, any strides (a transposed token-major buffer too), or
    None: a new head-major buffer."""
    if out is None:
        return torch.empty((hi, t, k), dtype=torch.int32, device=dev)
    check_tensor(out, "out", (torch.int32,), (hi, t, k), dev)
    if any(s < 0 for s in out.stride()):
        fail("out", f"must have non-negative strides, got {list(out.stride())}")
    return out


def validate_block_table(block_table, seq_lens, page, num_pages):
    """``validate=True``: every block-table entry a request uses lies in [0, num_pages) and
    the table is wide enough (host sync)."""
    lens = seq_lens.detach().cpu().to(torch.int64)
    if bool((lens < 0).any()):
        fail("seq_lens", f"must be >= 0, got {int(lens.min())}")
    need = (lens + page - 1) // page
    width = block_table.shape[1]
    if lens.numel() and int(need.max()) > width:
        r = int(torch.argmax(need))
        fail("block_table", f"has {width} columns but request {r} of {int(lens[r])} tokens "
                            f"needs {int(need[r])} blocks of {page}")
    bt = block_table.detach().cpu().to(torch.int64)
    used = torch.arange(width)[None, :] < need[:, None]
    bad = used & ((bt < 0) | (bt >= num_pages))
    if bool(bad.any()):
        r, c = (int(v) for v in bad.nonzero()[0])
        fail("block_table", f"entries used by a request must be in [0, num_pages={num_pages})"
                            f", got block_table[{r}, {c}] = {int(bt[r, c])}")
