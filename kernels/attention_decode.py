"""Block-sparse GQA attention decode over a paged KV cache (contract.md section 6), in
two Triton kernels: a split-K attention kernel and a log-sum-exp merge.

Contract. ``rows_per_request`` (1..4) query rows per request, request-major; row j of
request r sits at position ``p = seq_lens[r] - rows + j``; requests with ``seq_lens[r] == 0``
are graph padding and output zeros. Query head ``qh`` reads KV head ``g = qh // G``. A row's
selection is the SET of non-negative entries of ``topk[g, row, :]`` (negative entries
ignored wherever they stand, any order, read through strides; entries past ``p // P`` hold
no visible key; a repeated entry counts once). Its keys: every ``j`` of a selected block
with ``j <= p`` (causal inside the current block) and ``j < seq_len``, read through
``block_table[r, j // P]``. ``out = softmax(softmax_scale * q . K) @ V``, softmax_scale
``1/sqrt(D)`` by default.

Design (docs/kernels/attention_decode.md): one program per (request, KV head, split)
owns the G query heads of every row of the request, so each selected KV block is read
once and shared by all of them; split-K chunks merge by log-sum-exp (in the last split
or a merge kernel). Numerics: the rounding schedule declared in the registry
(``DecodeSchedule``). NaN content a row must not see never reaches it (a repair pass
recomputes tiles whose shared ``P @ V`` met a non-finite V); bad contents are guarded,
never an illegal access.

``sparse_attention_decode(...)`` is the host launcher (validates dtypes, shapes, strides,
formats and scales; raises ValueError naming the argument);
oracle/impls/triton.py registers it as implementation ``"triton"`` of op ``"attention_decode"``.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from kernels._attention import (
    MAX_CONTEXT,
    MAX_TOPK,
    check_block_keys,
    check_index_tensor,
    check_q_and_cache,
    check_scales_and_out,
    check_table_and_selections,
    declared_tile_keys,
    kv_tiles,
    not_finite,
    operand_dtypes,
    out_unit_back,
    p_operand,
    q_operand,
    repair_pv,
    softmax_step,
    topk_width,
    unit_back,
    validate_block_table,
    validate_scales,
    validate_selections,
)
from kernels._host import (
    check_int,
    check_workspace,
    fail,
    take_counters,
    take_scratch,
)
from kernels._trace import check_trace, stamp
from kernels._triton import (
    await_previous_kernel,
    ensure_ready,
    fitting_stages,
    is_interpreted,
    pdl_options,
    tl,
    triton,
)
from kernels.fp8 import HW_FORMATS, asm_f16, fmt_code

#: Blocks per split-K chunk for small grids, and the grid size beyond which
#: ``auto_blocks_per_split`` makes chunks longer: short splits fill the GPU at small
#: batches; past TARGET_PROGRAMS a program's start costs more than its blocks.
BLOCKS_PER_SPLIT = 1
TARGET_PROGRAMS = 256
#: Default K/V pipeline depth: 2 stages let 16-bit caches hold two programs per SM; the
#: 1-byte fp8 tiles leave room for a third stage.
DEFAULT_STAGES = 2
DEFAULT_STAGES_FP8 = 3
#: Small grids (one query row per request, ``batch * Hkv <= SMALL_GRID``, D <= 128): each
#: program walks 1-2 blocks, so twice the warps (capped at 128 registers) shorten its
#: fixed chain; at larger batches the 4-warp default is faster.
SMALL_GRID = 32
SMALL_GRID_LAUNCH = {"num_warps": 8, "maxnreg": 128, "num_stages": 2}
#: Domain limit (contract.md s.7); MAX_GROUP and MAX_TOPK: kernels._attention.
MAX_ROWS = 4
LOG2E = 1.4426950408889634


@triton.jit
def _stream_loop(q, row_scale, u_rank, u_key, u_page, n_iter, seq32, g64, kv_ptr, kv_s0, kv_s1,
                 kv_s2, ks_ptr, ks_s0, ks_s1, vs_ptr, vs_s0, vs_s1, ROWS: tl.constexpr,
                 BLOCK_M: tl.constexpr, D: tl.constexpr, P: tl.constexpr, WS: tl.constexpr,
                 FP8: tl.constexpr, FMT: tl.constexpr, HW: tl.constexpr, SCALAR: tl.constexpr,
                 SAME: tl.constexpr, ASM: tl.constexpr):
    """The block loop of a one-row program as ``WS`` key streams (the ``key_streams`` knob):
    each union block's keys are cut into ``WS`` tiles of ``P / WS`` consecutive keys, tile
    w of every block goes to stream w, and each stream is its own online softmax (running
    max, sum, accumulator) over its tiles in ascending block order, computed by 3-D
    ``tl.dot`` whose leading (stream) dimension Triton lays out over the warps: a warp's
    softmax needs no other warp (no shared-memory exchange of maxima and P per block, the
    2-D loop's barriers). The streams merge once at the end, exactly in fp32:
    ``m = max_w m_w``, ``l = sum_w l_w 2^(m_w - m)``, ``acc = sum_w acc_w 2^(m_w - m)``.
    Declared as ``Schedule(tile_keys=P / WS, key_streams=WS)``. Returns (m, l, acc) as the
    2-D loop leaves them."""
    BQ: tl.constexpr = P // WS
    tl.static_assert(ROWS == 1, "key streams: one row per request")
    ww = tl.arange(0, WS)
    kin = ww[:, None] * BQ + tl.arange(0, BQ)[None, :]  # [WS, BQ]: key within the block
    dd = tl.arange(0, D)
    q3 = tl.broadcast_to(q[None, :, :], (WS, BLOCK_M, D))
    scale3 = row_scale[None, :, None]
    m_i = tl.full((WS, BLOCK_M), float("-inf"), tl.float32)
    l_i = tl.zeros((WS, BLOCK_M), tl.float32)
    acc = tl.zeros((WS, BLOCK_M, D), tl.float32)
    lim = seq32 - 1  # the row's position: the last key it sees
    for it in range(n_iter):
        blk = tl.max(tl.where(u_rank == it, u_key, -1), axis=0) >> 4
        page = tl.max(tl.where(u_rank == it, u_page, -1), axis=0)  # -1: a bad entry
        page_ok = page >= 0
        pg = tl.where(page_ok, page, 0).to(tl.int64)
        key = blk * P + kin
        kmask = page_ok & (key <= lim)  # [WS, BQ]
        src = (kv_ptr + pg * kv_s0 + g64 * kv_s1 + kin[:, :, None].to(tl.int64) * kv_s2
               + dd[None, None, :])
        k, v = kv_tiles(src, (pg * P + kin)[:, :, None], kmask[:, :, None], ks_ptr, ks_s0,
                        ks_s1, vs_ptr, vs_s0, vs_s1, g64, q.dtype, D, FP8, FMT, HW, SCALAR,
                        SAME, ASM)
        s = unit_back(tl.dot(q3, tl.trans(k, (0, 2, 1))), FP8, FMT, SCALAR, ASM)
        s2 = tl.where(kmask[:, None, :], s * scale3, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s2, axis=2))
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m_i - m_use)
        p = tl.exp2(s2 - m_use[:, :, None])
        l_i = l_i * alpha + tl.sum(p, axis=2)
        acc = acc * alpha[:, :, None] + tl.dot(p_operand(p, v, FP8, FMT, SCALAR), v)
        m_i = m_new
    m = tl.max(m_i, axis=0)
    m_use = tl.where(m == float("-inf"), 0.0, m)
    sc = tl.exp2(m_i - m_use[None, :])
    return m, tl.sum(l_i * sc, axis=0), tl.sum(acc * sc[:, :, None], axis=0)


# Counts and sizes vary from call to call: not specialised (one compile for every shape).
@triton.jit(do_not_specialize=[
    "num_pages", "bt_cols", "topk_k", "group", "num_q_heads", "num_splits"])
def _decode_split_kernel(
        q_ptr, q_s0, q_s1,
        kv_ptr, kv_s0, kv_s1, kv_s2, num_pages,
        bt_ptr, bt_s0, bt_s1, bt_cols,
        seq_ptr, seq_s0,
        tk_ptr, tk_s0, tk_s1, tk_s2, topk_k,
        ks_ptr, ks_s0, ks_s1, vs_ptr, vs_s0, vs_s1,
        out_ptr, out_s0, out_s1, part_ptr, lse_ptr, flag_ptr, cnt_ptr, trace_ptr,
        qk_scale, group, num_q_heads, num_splits,
        ROWS: tl.constexpr, ROWS_P: tl.constexpr, G_P: tl.constexpr, BLOCK_M: tl.constexpr,
        D: tl.constexpr, P: tl.constexpr, KP: tl.constexpr, NB: tl.constexpr,
        NBP: tl.constexpr, FP8: tl.constexpr, FMT: tl.constexpr, HW: tl.constexpr,
        SCALAR: tl.constexpr, SAME: tl.constexpr, ASM: tl.constexpr, DIRECT: tl.constexpr,
        REPAIR: tl.constexpr, SP: tl.constexpr, BN: tl.constexpr, TRACE: tl.constexpr = False,
        PDL: tl.constexpr = False, WS: tl.constexpr = 1):
    await_previous_kernel(PDL)
    r64 = tl.program_id(0).to(tl.int64)
    g64 = tl.program_id(1).to(tl.int64)
    c = tl.program_id(2)
    trace_row = (tl.program_id(0) * tl.num_programs(1) + tl.program_id(1)) * num_splits + c
    if TRACE:
        stamp(trace_ptr, trace_row, 1)
    seq = tl.load(seq_ptr + r64 * seq_s0).to(tl.int64)
    # Several rows: the flag of this program for the repair pass (docs/kernels/attention_decode.md).
    flag = flag_ptr + (r64 * tl.num_programs(1) + g64) * tl.num_programs(2) + c
    go = True
    if REPAIR:
        go = tl.load(flag) != 0

    # ---- the plan: each row's valid blocks, their ascending ranks, this split's union.
    ri = tl.arange(0, ROWS_P)
    kk = tl.arange(0, KP)
    pos = seq - ROWS + ri  # int64 [ROWS_P]; < 0: no key (padding, or seq_len < rows)
    row_ok = (ri < ROWS) & (pos >= 0)
    rows64 = r64 * ROWS + ri
    # Masked by shape only (not by row_ok): the load then does not wait for seq_lens (one
    # global round trip less before the first K/V byte); in_range drops the rows without a
    # position.
    e = tl.load(tk_ptr + g64 * tk_s0 + rows64[:, None] * tk_s1 + kk[None, :].to(tl.int64) * tk_s2,
                mask=(ri < ROWS)[:, None] & (kk < topk_k)[None, :], other=-1).to(tl.int64)
    # ---- the (row, head) tile of queries: m = row * G_P + head; loaded before the plan
    # below so that its latency overlaps the plan's (the first K/V loads wait for both).
    mm = tl.arange(0, BLOCK_M)
    m_row = mm // G_P
    m_head = mm % G_P
    m_ok = (m_row < ROWS) & (m_head < group)
    m_t = r64 * ROWS + m_row
    m_hq = g64 * group + m_head
    dd = tl.arange(0, D)
    q = tl.load(q_ptr + m_t[:, None] * q_s0 + m_hq[:, None] * q_s1 + dd[None, :],
                mask=m_ok[:, None], other=0.0)
    logit_scale = qk_scale
    if FP8 and SCALAR:  # the scales outside the products (kernels._attention.scales_outside)
        logit_scale = qk_scale * tl.load(ks_ptr)
    if ROWS_P == 1:  # every entry's page, gathered while the plan below is computed
        e1 = tl.reshape(e, (KP,))
        entry_page = tl.load(bt_ptr + r64 * bt_s0 + e1 * bt_s1,
                             mask=(e1 >= 0) & (e1 < bt_cols), other=-1)
    in_range = row_ok[:, None] & (e >= 0) & (e * P <= pos[:, None])  # 0 <= e <= p // P
    e32 = tl.where(in_range, e, -1).to(tl.int32)
    same = e32[:, :, None] == e32[:, None, :]  # [row, k', k]
    earlier = (kk[:, None] < kk[None, :])[None, :, :]
    repeat = tl.max((same & earlier & in_range[:, :, None]).to(tl.int32), axis=1)
    valid = in_range & (repeat == 0)  # a repeated block counts once
    below = (e32[:, :, None] < e32[:, None, :]) & valid[:, :, None]
    rank = tl.sum(below.to(tl.int32), axis=1)  # ascending rank among the row's blocks
    if ROWS_P == 1:
        # One row: its chunk is the union. Over its KP entries: the valid ones ranked in
        # this split's range, in ascending order (u_rank), without the rows' merge below.
        uni = tl.reshape(e32, (KP,))
        u_rank = tl.reshape(rank, (KP,)) - c * NB
        first = tl.reshape(valid, (KP,)) & (u_rank >= 0) & (u_rank < NB)
        u_rank = tl.where(first, u_rank, -1)
        n_iter = tl.sum(first.to(tl.int32), axis=0)
        u_key = tl.where(first, uni * 16 + 1, -1)  # row 0's bit
    else:
        tt = tl.arange(0, NBP)
        want = c * NB + tt
        pick = (valid[:, None, :] & (rank[:, None, :] == want[None, :, None])
                & (tt < NB)[None, :, None])
        chunk = tl.max(tl.where(pick, e32[:, None, :], -1), axis=2)  # [ROWS_P, NBP]
        S: tl.constexpr = ROWS_P * NBP
        uni = tl.reshape(chunk, (S,))
        ubit = tl.reshape(tl.where(chunk >= 0, 1 << ri[:, None], 0), (S,))
        ss = tl.arange(0, S)
        same_u = uni[:, None] == uni[None, :]
        u_rep = tl.max((same_u & (ss[:, None] < ss[None, :])).to(tl.int32), axis=0)
        first = (uni >= 0) & (u_rep == 0)
        u_rank = tl.sum(((uni[:, None] < uni[None, :]) & first[:, None]).to(tl.int32),
                        axis=0)
        n_iter = tl.sum(first.to(tl.int32), axis=0)
        # Per union block: block * 16 + the bit mask of the rows whose chunk holds it (a
        # row's chunk holds a block once), so one reduction per step yields both.
        rmask = tl.sum(tl.where(same_u, ubit[:, None], 0), axis=0)
        u_key = tl.where(first, uni * 16 + rmask, -1)
    live = tl.sum(tl.where(row_ok, 1 << ri, 0), axis=0)  # rows with a position >= 0
    # Positions inside the block loop in int32: its 64-bit compares of every key against
    # every row's position are a measurable share of the loop's stalls. The host
    # caps contexts at MAX_CONTEXT (2^30) tokens, so the clamp changes nothing for valid
    # seq_lens and keeps bad ones from wrapping.
    seq32 = tl.minimum(tl.maximum(seq, -8), MAX_CONTEXT).to(tl.int32)
    m_pos = seq32 - ROWS + m_row


    # The union blocks' pages in one gather before the loop: the loop's K/V addresses then
    # depend on registers only, not on a block-table load per block (one global round trip
    # less on each block's path, and nothing for the pipeliner to chain).
    if ROWS_P == 1:
        u_page = tl.where(first, entry_page, -1).to(tl.int64)
    else:
        u_blk64 = tl.where(first, uni, 0).to(tl.int64)
        u_page = tl.load(bt_ptr + r64 * bt_s0 + u_blk64 * bt_s1,
                         mask=first & (u_blk64 < bt_cols), other=-1).to(tl.int64)
    # -1 for a bad entry (negative, or past num_pages), then int32 for the loop's reduction.
    u_page = tl.where((u_page >= 0) & (u_page < num_pages), u_page, -1).to(tl.int32)

    m_i = tl.full((BLOCK_M,), float("-inf"), tl.float32)
    l_i = tl.zeros((BLOCK_M,), tl.float32)
    acc = tl.zeros((BLOCK_M, D), tl.float32)
    SUB: tl.constexpr = P // BN  # tiles per block (BN keys each, in key order)
    jj = tl.arange(0, BN)
    q, row_scale = q_operand(q, logit_scale, FP8 and SCALAR, FMT)
    if REPAIR:
        n_iter = tl.where(go, n_iter, 0)
    if TRACE:
        stamp(trace_ptr, trace_row, 4)
    if WS > 1:  # one row: key streams, one per warp (``_stream_loop``)
        m_i, l_i, acc = _stream_loop(
            q, row_scale, u_rank, u_key, u_page, n_iter, seq32, g64, kv_ptr, kv_s0, kv_s1,
            kv_s2, ks_ptr, ks_s0, ks_s1, vs_ptr, vs_s0, vs_s1, ROWS, BLOCK_M, D, P, WS, FP8,
            FMT, HW, SCALAR, SAME, ASM)
    else:
        for it in range(n_iter * SUB):
            ub = it // SUB
            off = (it % SUB) * BN  # the tile's first key in its block
            step = tl.max(tl.where(u_rank == ub, u_key, -1), axis=0)
            blk = step >> 4
            takes = step & 15  # bit i: row i's chunk holds the block
            m_takes = (takes >> m_row) & 1
            hi = tl.where(takes >= 8, 3, tl.where(takes >= 4, 2, tl.where(takes >= 2, 1, 0)))
            lim = seq32 - ROWS + hi  # the last key any taking row sees (the highest row's)
            blk64 = blk.to(tl.int64)
            page = tl.max(tl.where(u_rank == ub, u_page, -1), axis=0)  # -1: a bad entry
            page_ok = page >= 0
            pg = tl.where(page_ok, page, 0).to(tl.int64)
            key = blk * P + off + jj
            kmask = (key <= lim) & page_ok
            src = (kv_ptr + pg * kv_s0 + g64 * kv_s1
                   + (off + jj)[:, None].to(tl.int64) * kv_s2 + dd[None, :])
            k, v = kv_tiles(src, (pg * P + off + jj)[:, None], kmask[:, None], ks_ptr, ks_s0,
                            ks_s1, vs_ptr, vs_s0, vs_s1, g64, q_ptr.dtype.element_ty, D, FP8, FMT,
                            HW, SCALAR, SAME, ASM)
            # [BLOCK_M, BN], fp32 accumulation
            s = unit_back(tl.dot(q, tl.trans(k)), FP8, FMT, SCALAR, ASM)
            vis = (m_takes[:, None] > 0) & (key[None, :] <= m_pos[:, None]) & kmask[None, :]
            s2 = tl.where(vis, s * row_scale[:, None], float("-inf"))
            m_new, alpha, p_act, pv, l_i = softmax_step(s2, m_i, l_i, v, FP8, FMT, SCALAR)
            if ROWS > 1 and REPAIR:
                # Rows that do not all see the loaded keys: guard non-finite V (see docstring).
                lo = tl.where((takes & 1) != 0, 0, tl.where((takes & 2) != 0, 1,
                                                            tl.where((takes & 4) != 0, 2, 3)))
                last = tl.minimum(lim, blk64 * P + off + BN - 1)
                if (takes != live) | (seq32 - ROWS + lo < last):
                    pv = repair_pv(pv, p_act, v, vis)
            acc = acc * alpha[:, None] + pv
            m_i = m_new

    if TRACE:
        stamp(trace_ptr, trace_row, 2)
    empty = l_i == 0.0  # no key in this split (NaN sums are not empty: they propagate)
    l_safe = tl.where(empty, 1.0, l_i)
    o = tl.where(empty[:, None], 0.0, acc / l_safe[:, None])
    if FP8 and SCALAR:
        o = out_unit_back(o, FP8, FMT, SCALAR, ASM) * tl.load(vs_ptr)
    m_out = m_ok & go
    if DIRECT:
        dst = out_ptr + m_t[:, None] * out_s0 + m_hq[:, None] * out_s1 + dd[None, :]
        tl.store(dst, o.to(out_ptr.dtype.element_ty), mask=m_out[:, None])
    else:
        lse = tl.where(empty, float("-inf"), m_i + tl.log2(l_safe))
        row = (m_t * num_q_heads + m_hq) * num_splits + c
        tl.store(part_ptr + row[:, None] * D + dd[None, :], o, mask=m_out[:, None])
        tl.store(lse_ptr + row, lse, mask=m_out)
        if ROWS == 1:  # no repair pass: the last split of (request, KV head) merges
            tl.debug_barrier()  # every thread's partial is stored before the ticket
            cnt = cnt_ptr + r64 * tl.num_programs(1) + g64
            ticket = tl.atomic_add(cnt, 1, sem="acq_rel")
            if ticket == num_splits - 1:
                _merge_rows(part_ptr, lse_ptr, out_ptr, out_s0, out_s1, m_t, m_hq, m_ok,
                            num_q_heads, num_splits, D, SP)
                # Ready for the next launch: every ticket of this one is drawn, so a plain store
                # (no atomic round trip at the end of the critical path).
                tl.store(cnt, 0)
    if ROWS > 1 and not REPAIR:
        tl.store(flag, not_finite(acc))
    if TRACE:
        stamp(trace_ptr, trace_row, 3)


@triton.jit
def _merge_rows(part_ptr, lse_ptr, out_ptr, out_s0, out_s1, m_t, m_hq, m_ok, num_q_heads,
                num_splits, D: tl.constexpr, SP: tl.constexpr):
    """The exact split-K merge of the (token m_t, query head m_hq) rows of ``m_ok``:
    ``out = sum_c w_c o_c / sum_c w_c``, ``w_c = exp2(lse_c - max_c lse_c)``; rows with no
    key in any split give zeros. Partials are read from L2 (``.cg``): in the fused merge
    other programs wrote them."""
    row = (m_t.to(tl.int64) * num_q_heads + m_hq) * num_splits
    sp = tl.arange(0, SP)
    lse = tl.load(lse_ptr + row[:, None] + sp[None, :],
                  mask=m_ok[:, None] & (sp < num_splits)[None, :], other=float("-inf"),
                  cache_modifier=".cg")
    top = tl.max(lse, axis=1)
    top = tl.where(top == float("-inf"), 0.0, top)
    wsum = tl.sum(tl.exp2(lse - top[:, None]), axis=1)
    dd = tl.arange(0, D)
    acc = tl.zeros((m_ok.shape[0], D), tl.float32)
    for c in range(num_splits):
        w = tl.exp2(tl.load(lse_ptr + row + c, mask=m_ok, other=float("-inf"),
                            cache_modifier=".cg") - top)
        o = tl.load(part_ptr + (row + c)[:, None] * D + dd[None, :], mask=m_ok[:, None],
                    other=0.0, cache_modifier=".cg")
        acc += w[:, None] * o
    none = wsum == 0.0
    out = tl.where(none[:, None], 0.0, acc / tl.where(none, 1.0, wsum)[:, None])
    dst = out_ptr + m_t.to(tl.int64)[:, None] * out_s0 + m_hq[:, None].to(tl.int64) * out_s1 \
        + dd[None, :]
    tl.store(dst, out.to(out_ptr.dtype.element_ty), mask=m_ok[:, None])


@triton.jit
def _decode_merge_kernel(part_ptr, lse_ptr, out_ptr, out_s0, out_s1, num_q_heads, num_splits,
                         D: tl.constexpr, BLOCK_H: tl.constexpr, SP: tl.constexpr):
    """The merge as its own launch (several rows per request: after the repair pass)."""
    heads = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    toks = tl.zeros((BLOCK_H,), tl.int64) + tl.program_id(0)
    _merge_rows(part_ptr, lse_ptr, out_ptr, out_s0, out_s1, toks, heads.to(tl.int64),
                heads < num_q_heads, num_q_heads, num_splits, D, SP)


#: True when the kernels run in the (patched) CPU interpreter.
INTERPRETED = is_interpreted(_decode_split_kernel)


# ---------------------------------------------------------------------------- schedule


def auto_blocks_per_split(batch: int, hkv: int, topk_k: int) -> int:
    """The default split size (docs/kernels/attention_decode.md): ``BLOCKS_PER_SPLIT`` times the
    factor that brings the grid ``batch * hkv * splits`` down to about ``TARGET_PROGRAMS`` (1
    for small batches; model shape: batch 64 and up -> one split of 16 blocks)."""
    max_splits = _max_splits(topk_k)
    splits = max(1, min(max_splits, TARGET_PROGRAMS // max(1, batch * hkv)))
    return BLOCKS_PER_SPLIT * -(-max_splits // splits)


def invariant_batch(hkv: int, topk_k: int) -> int:
    """The largest batch up to which the defaults keep a request's output bit-identical
    whatever the batch (docs/kernels/attention_decode.md): the split size stays
    ``BLOCKS_PER_SPLIT``, and ``launch_defaults`` picks one launch for every batch up to it
    (model shape: 4)."""
    return TARGET_PROGRAMS // (hkv * _max_splits(topk_k))


def _max_splits(topk_k: int) -> int:
    """Splits of a row's K selected blocks at ``BLOCKS_PER_SPLIT`` blocks each."""
    return -(-topk_k // BLOCKS_PER_SPLIT)


def launch_defaults(rows: int, d: int, batch: int, hkv: int, topk_k: int,
                    fixed_split: bool = False) -> dict:
    """Launch options that replace the defaults: ``SMALL_GRID_LAUNCH`` on small grids of
    one row per request and D <= 128, empty otherwise. Speed only (the rounding schedule is
    the same), but the warps change the fp32 row sums' reduction order, so the choice never
    splits a batch-invariant range: not with a fixed ``blocks_per_split`` (invariant at any
    size), and with the default split only where every batch up to ``invariant_batch`` is
    small too (model shape: batches 1-4 are, so 1-8 take it)."""
    small = batch * hkv <= SMALL_GRID and invariant_batch(hkv, topk_k) * hkv <= SMALL_GRID
    return dict(SMALL_GRID_LAUNCH) if small and rows == 1 and d <= 128 and not fixed_split \
        else {}


#: Key streams (``_stream_loop``) by default for the fnuz formats' one-row programs outside
#: the small-grid launch: their software decode makes the block loop issue-bound, and per-
#: warp streams drop its cross-warp exchanges; the OCP and 16-bit formats wait on DRAM.
DEFAULT_KEY_STREAMS = 4
KEY_STREAM_FORMATS = ("e4m3fnuz", "e5m2fnuz")


def default_key_streams(kv_fmt: str, rows: int, d: int, page: int, batch: int, hkv: int,
                        topk_k: int, fixed_split: bool, block_keys) -> int:
    """The launcher's key streams for a call (1: the 2-D loop): ``DEFAULT_KEY_STREAMS`` for
    ``KEY_STREAM_FORMATS`` with one row per request, whole-block tiles, at least 16 keys
    per stream tile, where ``launch_defaults`` keeps the plain launch (whatever launch
    knobs are given, so the declared schedule follows the case alone)."""
    small = launch_defaults(rows, d, batch, hkv, topk_k, fixed_split)
    ok = (kv_fmt in KEY_STREAM_FORMATS and rows == 1 and block_keys is None and not small
          and page % DEFAULT_KEY_STREAMS == 0 and page // DEFAULT_KEY_STREAMS >= 16)
    return DEFAULT_KEY_STREAMS if ok else 1


@dataclass(frozen=True)
class DecodeSchedule:
    """The kernel's rounding schedule for a model dtype and a case's inputs (what the oracle
    calls ``schedule_for(impl, model_dtype, case)``); see docs/kernels/attention_decode.md.
    ``blocks_per_split`` None: the launcher's default for the case's batch
    (``auto_blocks_per_split``; ``BLOCKS_PER_SPLIT`` without a case). ``block_keys``: the
    launch knob's tiles (``Schedule.tile_keys``; None or the page size: whole blocks).
    ``key_streams`` None: the launcher's default for the case (``default_key_streams``);
    an integer: the knob's (``Schedule.key_streams`` with ``tile_keys = P / key_streams``)."""

    blocks_per_split: int | None = None
    block_keys: int | None = None
    key_streams: int | None = None

    def __call__(self, model_dtype: str, case: dict | None = None):
        from reference.attention import Schedule

        kv, p_dtype, q_dtype = operand_dtypes(model_dtype, case)
        bps = self.blocks_per_split
        if bps is None:
            bps = BLOCKS_PER_SPLIT if case is None else auto_blocks_per_split(
                len(case["seq_lens"]), case["kv_cache"].shape[1], case["topk"].shape[-1])
        ws = self.key_streams
        if ws is None:
            ws = 1 if case is None else default_key_streams(
                case["kv_fmt"], int(case["rows_per_request"]), case["q"].shape[-1],
                case["kv_cache"].shape[2], len(case["seq_lens"]), case["kv_cache"].shape[1],
                case["topk"].shape[-1], self.blocks_per_split is not None, self.block_keys)
        tile_keys = declared_tile_keys(self.block_keys, case)
        if ws > 1:
            tile_keys = case["kv_cache"].shape[2] // ws
        return Schedule(kv_dtype=kv, p_dtype=p_dtype, p_max="running",
                        blocks_per_tile=1, blocks_per_split=bps,
                        partial_dtype="float32", lse_dtype="float32", out_dtype=model_dtype,
                        order="ascending", q_dtype=q_dtype, tile_keys=tile_keys,
                        key_streams=ws)


# ---------------------------------------------------------------------------- launcher


@dataclass
class DecodePlan:
    """What ``plan_attention_decode`` checked and derived."""

    t: int
    hq: int
    hkv: int
    d: int
    page: int
    num_pages: int
    batch: int
    rows: int
    topk_k: int
    fp8: bool
    ks: torch.Tensor
    ks_strides: tuple[int, int]
    vs: torch.Tensor
    vs_strides: tuple[int, int]
    softmax_scale: float
    blocks_per_split: int
    out: torch.Tensor


def check_key_streams(key_streams, page: int, rows: int, block_keys) -> int:
    """The ``key_streams`` knob (None: 1): a power of two with ``page / key_streams >= 16``
    keys per stream tile, for one row per request and whole-block tiles."""
    if key_streams is None:
        return 1
    ws = check_int(key_streams, "key_streams", 1, max(1, page // 16))
    if ws & (ws - 1):
        fail("key_streams", f"must be a power of two, got {ws}")
    if ws > 1 and rows != 1:
        fail("key_streams", f"needs rows_per_request 1, got {rows}")
    if ws > 1 and block_keys is not None:
        fail("key_streams", "cannot be combined with block_keys")
    return ws


def _validate_contents(block_table, seq_lens, topk, rows, page, num_pages, scales):
    """``validate=True`` content checks (a host sync), each a ValueError naming the
    argument: seq_lens 0 or >= rows; the block table wide enough and its used entries
    pages in range; selections in range (negative = unused, else <= p // P) and without
    repeats; scales positive and finite."""
    seq = seq_lens.detach().to("cpu", torch.int64)
    bad = (seq < 0) | ((seq > 0) & (seq < rows))
    if bool(bad.any()):
        r = int(bad.nonzero()[0, 0])
        fail("seq_lens", f"must be 0 (padding) or >= rows_per_request = {rows}; entry {r} "
                         f"is {int(seq[r])}")
    validate_block_table(block_table, seq_lens, page, num_pages)
    row_seq = seq.repeat_interleave(rows)
    pos = torch.where(row_seq > 0, row_seq - rows + torch.arange(rows).repeat(seq.numel()), -1)
    validate_selections(topk, pos, page)
    validate_scales(scales)


def plan_attention_decode(q, kv_cache, kv_fmt, block_table, seq_lens, topk, rows_per_request,
                          k_scale=None, v_scale=None, softmax_scale=None, out=None,
                          blocks_per_split=None, validate=False) -> DecodePlan:
    """Every host check of ``sparse_attention_decode`` (shapes, dtypes, strides, formats,
    scales; contents under ``validate=True``) and the output tensor."""
    a = check_q_and_cache(q, kv_cache, kv_fmt)
    dev = q.device
    rows = check_int(rows_per_request, "rows_per_request", 1, MAX_ROWS)
    batch = check_index_tensor(seq_lens, "seq_lens", dev, 1).shape[0]
    if a.t != batch * rows:
        fail("q", f"must have len(seq_lens) * rows_per_request = {batch * rows} rows, got "
                  f"{a.t}")
    topk_k = check_table_and_selections(block_table, topk, a, batch, dev)
    ks, ks_strides, vs, vs_strides, softmax_scale, out = check_scales_and_out(
        q, a, k_scale, v_scale, softmax_scale, out, validate)
    bps = auto_blocks_per_split(batch, a.hkv, topk_k) if blocks_per_split is None else \
        check_int(blocks_per_split, "blocks_per_split", 1, MAX_TOPK)
    if validate and batch:
        _validate_contents(block_table, seq_lens, topk, rows, a.page, a.num_pages,
                           (("k_scale", ks), ("v_scale", vs)))
    return DecodePlan(a.t, a.hq, a.hkv, a.d, a.page, a.num_pages, batch, rows, topk_k, a.fp8,
                      ks, ks_strides, vs, vs_strides, softmax_scale, bps, out)


def sparse_attention_decode(q, kv_cache, kv_fmt, block_table, seq_lens, topk, rows_per_request,
                            k_scale=None, v_scale=None, softmax_scale=None, out=None, *,
                            blocks_per_split=None, validate=False,
                            num_warps=None, num_stages=None, max_registers=None,
                            block_keys=None, trace=None, workspace=None, pdl=False,
                            key_streams=None):
    """Block-sparse GQA decode attention; returns ``out`` ``[T, Hq, D]`` (model dtype).

    q: bf16/fp16 ``[T, Hq, D]`` (D in 64/128/256; any token/head strides, last dim
    contiguous), T = B * rows_per_request, rows request-major. kv_cache: logical
    ``[num_pages, Hkv, P, 2D]`` (K in the first D, V in the second; any non-negative strides,
    last dim contiguous): uint8 codes of the fp8 format ``kv_fmt``, or bf16/fp16 (``kv_fmt``
    its name). block_table: int32/int64 ``[B, max_blocks]``; seq_lens: int32/int64 ``[B]``
    (0 = padding request: its rows output zeros); topk: int32/int64 ``[Hkv, T, K]`` logical
    block ids (any strides, e.g. a transposed token-major buffer; negative = unused).
    Scales (fp8 only): None (1.0), a float, or float32 tensors, 0-d or ``[Hkv,
    num_pages*P]`` (per KV head and physical slot); K/V are ``decode(code) * scale``.
    softmax_scale: default ``1/sqrt(D)``. out: optional preallocated output (model dtype,
    any token/head strides, last dim contiguous), written and returned.
    blocks_per_split: blocks per split-K chunk (None: ``auto_blocks_per_split`` of the
    batch size, what the registered implementation uses; an int: fixed, batch-invariant).
    ``validate=True``: also check contents on the host (a sync):
    seq_lens, block-table entries of used blocks, selections in range without repeats,
    positive finite scales, a workspace's counters all zero. Without it, bad contents are
    guarded in the kernel (never an illegal access; see docs/kernels/attention_decode.md).
    Launch knobs (speed only): num_warps, num_stages, max_registers, block_keys,
    key_streams (``_launch_knobs``). ``trace``: a diagnostic (``kernels._trace``, compiled
    only) written by the first pass (``_launch_decode``). ``workspace``: a
    ``kernels._host.Workspace`` kept across calls (the merge's ticket counters stay zero
    between launches, the partials are reused; one per stream of concurrent calls; None:
    fresh buffers). ``pdl``: programmatic dependent launch of the first pass
    (``kernels._triton.await_previous_kernel``; compiled, sm_90; a no-op interpreted)."""
    workspace = check_workspace(workspace)
    pdl_kw = pdl_options(pdl, INTERPRETED)
    p = plan_attention_decode(q, kv_cache, kv_fmt, block_table, seq_lens, topk,
                              rows_per_request, k_scale, v_scale, softmax_scale, out,
                              blocks_per_split, validate)
    if validate and workspace is not None:
        workspace.check_counters()
    if p.t == 0:
        return p.out
    knobs = _launch_knobs(p, kv_fmt, blocks_per_split, num_warps, num_stages, max_registers,
                          block_keys, key_streams)
    return _launch_decode(p, knobs, q, kv_cache, kv_fmt, block_table, seq_lens, topk, trace,
                          workspace, pdl_kw)


@dataclass(frozen=True)
class _Knobs:
    """The launch knobs checked and defaulted (``_launch_knobs``)."""

    bn: int  # keys per online-softmax tile
    ws: int  # key streams
    opts: dict  # num_warps, and num_stages / maxnreg when set
    deepest: int | None  # launch_defaults' stages, else None (DEFAULT_STAGES*)
    stages_given: bool


def _launch_knobs(p, kv_fmt, blocks_per_split, num_warps, num_stages, max_registers,
                  block_keys, key_streams) -> _Knobs:
    """The launch knobs, speed only. All None: the defaults (``launch_defaults``' on small
    grids); any of them given: the others keep the plain defaults below.

    num_warps      default 4.
    num_stages     depth of the K/V loads' shared-memory pipeline across blocks; default
                   ``DEFAULT_STAGES`` (16-bit caches) or ``DEFAULT_STAGES_FP8``, or the
                   deepest below that fits the GPU's shared memory
                   (``kernels._triton.fitting_stages``).
    max_registers  ptxas maxnreg; default the compiler's choice.
    block_keys     keys per tile of the online softmax, a power of two dividing P, >= 16;
                   default P (one tile per block: smaller tiles fit more programs per SM but
                   their per-tile work costs more than that gains); declared to the oracle
                   as ``Schedule.tile_keys`` through ``DecodeSchedule(block_keys=...)``.
    key_streams    one query row per request only; the block loop as that many key streams
                   (``_stream_loop``: a power of two, ``P / key_streams >= 16``; 1: the 2-D
                   loop; None: ``default_key_streams``), declared as
                   ``DecodeSchedule(key_streams=...)``."""
    bn = check_block_keys(block_keys, p.page)
    ws = check_key_streams(key_streams, p.page, p.rows, block_keys)
    if key_streams is None:
        ws = default_key_streams(kv_fmt, p.rows, p.d, p.page, p.batch, p.hkv, p.topk_k,
                                 blocks_per_split is not None, block_keys)
    tuned = (num_warps, num_stages, max_registers, block_keys) != (None,) * 4
    auto = {} if tuned else launch_defaults(p.rows, p.d, p.batch, p.hkv, p.topk_k,
                                            fixed_split=blocks_per_split is not None)
    warps = check_int(num_warps or auto.get("num_warps", 4), "num_warps", 1, 16)
    opts = {"num_warps": warps}
    if num_stages is not None:
        opts["num_stages"] = check_int(num_stages, "num_stages", 1, 8)
    if max_registers is not None:
        check_int(max_registers, "max_registers", 24, 255)
    regs = max_registers or auto.get("maxnreg")
    if regs is not None and not INTERPRETED:
        opts["maxnreg"] = regs
    return _Knobs(bn, ws, opts, auto.get("num_stages"), num_stages is not None)


def _decode_args(p, q, kv_cache, block_table, seq_lens, topk, splits, part, lse, flags,
                 counters, trace):
    """The split kernel's runtime arguments."""
    return (q, q.stride(0), q.stride(1),
            kv_cache, kv_cache.stride(0), kv_cache.stride(1), kv_cache.stride(2), p.num_pages,
            block_table, block_table.stride(0), block_table.stride(1), block_table.shape[1],
            seq_lens, seq_lens.stride(0),
            topk, topk.stride(0), topk.stride(1), topk.stride(2), p.topk_k,
            p.ks, *p.ks_strides, p.vs, *p.vs_strides,
            p.out, p.out.stride(0), p.out.stride(1), part, lse, flags, counters,
            counters if trace is None else trace,
            float(np.float32(p.softmax_scale * LOG2E)), p.hq // p.hkv, p.hq, splits)


def _decode_const(p, knobs, q, kv_cache, kv_fmt, splits) -> dict:
    """The split kernel's constexprs and launch options (num_stages added by the caller
    when defaulted)."""
    rows_p = triton.next_power_of_2(p.rows)
    g_p = triton.next_power_of_2(p.hq // p.hkv)
    return dict(ROWS=p.rows, ROWS_P=rows_p, G_P=g_p, BLOCK_M=max(16, rows_p * g_p), D=p.d,
                P=p.page, KP=topk_width(p.topk_k), NB=p.blocks_per_split,
                NBP=triton.next_power_of_2(p.blocks_per_split), FP8=p.fp8,
                FMT=fmt_code(kv_fmt) if p.fp8 else 0, HW=p.fp8 and kv_fmt in HW_FORMATS,
                SCALAR=p.ks_strides == (0, 0) and p.vs_strides == (0, 0),
                SAME=not p.fp8 and kv_cache.dtype == q.dtype,
                ASM=p.fp8 and asm_f16(kv_fmt, INTERPRETED), DIRECT=splits == 1,
                SP=triton.next_power_of_2(splits), BN=knobs.bn, WS=knobs.ws, **knobs.opts)


def _launch_decode(p, knobs, q, kv_cache, kv_fmt, block_table, seq_lens, topk, trace,
                   workspace, pdl_kw):
    """The first pass (grid ``(B, Hkv, splits)``), its repair pass when rows share tiles,
    and the merge kernel when the splits are not merged in place. ``trace``: an int64
    buffer ``[>= B * Hkv * splits, TRACE_SLOTS]``; program (r, g, c) of the first pass
    writes row (r * Hkv + g) * splits + c: its SM, then the timer at its start (slot 1),
    after its block loop (2), at its end (3; after the merge, if it drew the last ticket)
    and when its plan was ready (4: the union's blocks and pages known, q scaled)."""
    dev = q.device
    splits = triton.cdiv(p.topk_k, p.blocks_per_split)
    direct = splits == 1
    if direct:
        part = lse = torch.empty(1, dtype=torch.float32, device=dev)
    else:
        part = take_scratch(workspace, "attention_partials", (p.t, p.hq, splits, p.d),
                            torch.float32, dev)
        lse = take_scratch(workspace, "attention_lse", (p.t, p.hq, splits), torch.float32,
                           dev)
    ensure_ready(_decode_split_kernel)
    grid = (p.batch, p.hkv, splits)
    check_trace(trace, p.batch * p.hkv * splits, INTERPRETED, dev)
    flags = take_scratch(workspace, "attention_flags",
                         (p.batch * p.hkv * splits if p.rows > 1 else 1,), torch.int32, dev)
    fused = not direct and p.rows == 1  # the last split merges (ticket counter)
    counters = take_counters(workspace, p.batch * p.hkv if fused else 1, dev)
    args = _decode_args(p, q, kv_cache, block_table, seq_lens, topk, splits, part, lse, flags,
                        counters, trace)
    const = _decode_const(p, knobs, q, kv_cache, kv_fmt, splits)
    if not knobs.stages_given:  # the default, lowered until every pass fits shared memory
        # (the repair pass can take more than the first: fp8, fp16 q, G 16, 4 rows); the
        # repair pass is probed first and the first pass from its depth down, so that the
        # first pass never compiles at a depth it will not launch with
        depth = knobs.deepest or (DEFAULT_STAGES_FP8 if p.fp8 else DEFAULT_STAGES)
        for r in ((True, False) if p.rows > 1 else (False,)):
            depth = fitting_stages(_decode_split_kernel, args, {**const, "REPAIR": r}, dev,
                                   deepest=depth)
        const["num_stages"] = depth
    _decode_split_kernel[grid](*args, REPAIR=False, TRACE=trace is not None, **const,
                               **pdl_kw)
    if p.rows > 1:  # the programs flagged by the first pass, recomputed with the guard
        _decode_split_kernel[grid](*args, REPAIR=True, **const)
    if not direct and not fused:
        block_h = min(16, triton.next_power_of_2(p.hq))
        ensure_ready(_decode_merge_kernel)
        _decode_merge_kernel[(p.t, triton.cdiv(p.hq, block_h))](
            part, lse, p.out, p.out.stride(0), p.out.stride(1), p.hq, splits,
            D=p.d, BLOCK_H=block_h, SP=triton.next_power_of_2(splits),
            num_warps=knobs.opts["num_warps"])
    return p.out


def compile_signatures():
    """(kernel, signature, constexprs) triples covering the constexpr branches, for the
    sm_90 compile check on the CPU (tests/test_compile_sm90.py)."""
    combos = [  # act, cache, ROWS, G, FMT, HW, DIRECT, K, NB
        ("bf16", "u8", 1, 16, 0, True, False, 16, 4),  # the model, one row: split-K
        ("bf16", "u8", 2, 16, 1, True, False, 64, 4),  # rows share tiles: the guarded path
        ("fp16", "u8", 4, 4, 2, False, True, 4, 4),  # e4m3fnuz (unit assembly), direct output
        ("bf16", "fp16", 3, 1, 0, False, False, 16, 1),  # 16-bit cache converted to act
    ]
    out = []
    for i, (act, cache, rows, grp, fmt, hw, direct, k, nb) in enumerate(combos):
        sig = {name: "i64" for name in _decode_split_kernel.arg_names}
        sig.update(q_ptr=f"*{act}", kv_ptr=f"*{cache}", bt_ptr="*i32", seq_ptr="*i64",
                   tk_ptr="*i32", ks_ptr="*fp32", vs_ptr="*fp32", out_ptr=f"*{act}",
                   part_ptr="*fp32", lse_ptr="*fp32", flag_ptr="*i32", cnt_ptr="*i32",
                   trace_ptr="*i64", qk_scale="fp32",
                   group="i32",
                   num_q_heads="i32", num_splits="i32", topk_k="i32", bt_cols="i32",
                   num_pages="i64")
        rows_p = triton.next_power_of_2(rows)
        g_p = triton.next_power_of_2(grp)
        const = dict(ROWS=rows, ROWS_P=rows_p, G_P=g_p, BLOCK_M=max(16, rows_p * g_p), D=128,
                     P=128 if cache == "u8" else 64, KP=topk_width(k), NB=nb,
                     NBP=triton.next_power_of_2(nb), FP8=cache == "u8", FMT=fmt, HW=hw,
                     SCALAR=i % 2 == 0, SAME=cache == act, ASM=hw or fmt == 2, DIRECT=direct,
                     REPAIR=rows > 1 and i % 2 == 1,
                     SP=triton.next_power_of_2(triton.cdiv(k, nb)), TRACE=i == 0,
                     BN=(128 if cache == "u8" else 64) // (2 if i == 1 else 1), WS=1)
        sig.update(dict.fromkeys(const, "constexpr"))
        out.append((_decode_split_kernel, sig, const))
    for act in ("bf16",):
        sig = {name: "i64" for name in _decode_merge_kernel.arg_names}
        sig.update(part_ptr="*fp32", lse_ptr="*fp32", out_ptr=f"*{act}", num_q_heads="i32",
                   num_splits="i32")
        const = dict(D=128, BLOCK_H=16, SP=4)
        sig.update(dict.fromkeys(const, "constexpr"))
        out.append((_decode_merge_kernel, sig, const))
    # Programmatic dependent launch (the ``pdl`` knob) on the first combo, and e5m2fnuz's
    # key streams (last, so the picks above keep their numbers).
    kernel, sig, const = out[0]
    return out + [(kernel, sig, {**const, "TRACE": False, "PDL": True}),
                  (kernel, sig, {**const, "TRACE": False, "FMT": 3, "HW": False, "WS": 4})]


SCHEDULE = DecodeSchedule()

