"""Block-sparse GQA attention prefill over a paged KV cache (contract.md section 6), in
one Triton kernel.

Contract. A ragged batch of new tokens: request r owns tokens ``cu_seqlens_q[r] ..
cu_seqlens_q[r+1] - 1``; its prefix is ``seq_lens[r] - query_len[r]`` (any length, not only
multiples of P) and its i-th new token sits at position ``p = prefix + i``. Query head
``qh`` reads KV head ``g = qh // G``. A token's selection is the SET of non-negative
entries of ``topk[g, token, :]`` (negative entries ignored wherever they stand, any order,
read through strides; entries past ``p // P`` hold no visible key; a repeated entry counts
once). Its keys: every ``j`` of a selected block with ``j <= p`` (causal inside the
current block) and ``j < seq_len``, read through ``block_table[r, j // P]`` from the cache
``[num_pages, Hkv, P, 2D]`` (K the first D, V the second D of the last dim; any strides,
last dim contiguous). ``out = softmax(softmax_scale * q . K) @ V``, softmax_scale
``1/sqrt(D)`` by default.

Design (docs/kernels/attention_prefill.md): one program per (query tile, KV head) walks
the union of its tokens' selections, so tokens that share blocks share KV reads; two
tiers (wide tiles, and per-token narrow tiles for tiles whose union is large) are
chosen per tile on the device. Numerics: the rounding schedule declared in the registry
(``PrefillSchedule``; with ``predecode``, a second schedule for the wide tier's rows).
NaN content a row must not see never reaches it (a repair pass); bad contents are
guarded, never an illegal access.

``sparse_attention_prefill(...)`` is the host launcher (validates dtypes, shapes, strides,
formats and scales; raises ValueError naming the argument);
oracle/impls/triton.py registers it as implementation ``"triton"`` of op ``"attention_prefill"``.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np
import torch

from kernels import kv_predecode
from kernels._attention import (
    MAX_CONTEXT,
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
    q_operand,
    repair_pv,
    scales_outside,
    softmax_step,
    topk_width,
    unit_back,
    validate_block_table,
    validate_scales,
    validate_selections,
)
from kernels._host import (
    check_int,
    fail,
)
from kernels._triton import (
    await_previous_kernel,
    ensure_ready,
    fitting_stages,
    is_interpreted,
    pdl_options,
    resident_programs,
    tl,
    triton,
)
from kernels.fp8 import HW_FORMATS, asm_f16, fmt_code
from kernels.kv_predecode import predecode_options, predecode_pages
from reference.platforms import is_fp8

#: Query rows (tokens x padded heads) per program by default; see the
#: docs/kernels/attention_prefill.md: 128 rows (8 tokens x 16 heads) beat 64 on both local and
#: random selections.
BLOCK_ROWS = 128
#: The narrow tier (docs/kernels/attention_prefill.md, Tiers): rows per program, and per cache
#: kind its warps, stages (16-bit: ``_num_stages``'s guess, fitted) and the most keys per
#: online-softmax tile (``NARROW_KEYS*``; fewer when the page or ``block_keys`` is smaller:
#: ``narrow_keys``). One warp: no cross-warp reduction or barrier in the block loop; short key
#: tiles keep the registers (fp8: 64 keys, 1 stage; 16-bit: 16 keys, 3 stages).
NARROW_ROWS = 16
NARROW_WARPS = 1
NARROW_KEYS = 16
NARROW_FP8 = {"num_warps": 1, "num_stages": 1}
NARROW_KEYS_FP8 = 64
#: A wide tile is handed to the narrow tier when ``U * DELEGATE_RATIO`` exceeds its valid
#: entries: one block iteration of the 128-row, 8-warp program costs about three of the
#: 16-row, 4-warp program's.
DELEGATE_RATIO = 3
#: A delegate_ratio that hands every wide tile with a selection to the narrow tier (the
#: registered implementation ``triton_narrow`` runs with it).
ALL_NARROW = 2**20
#: Entries per warp of ``_tier_kernel``'s programs (16 per thread; warps: 1 to 8): a
#: [BLOCK_T, KP] tile of entries and two reductions per union block, many programs per
#: SM (model shape: 8 x 16 entries, one warp).
TIER_ENTRIES_PER_WARP = 512
#: Default warps per program. sm_90, model shape (static, compiled on the CPU): the main
#: pass needs 255 registers per thread either way; with 4 warps ptxas spills 344 bytes per
#: thread (bf16), with 8 none, and shared memory (144 KiB) allows one program per SM
#: anyway.
NUM_WARPS = 8
#: ``predecode=None`` (the default) predecodes an fp8 cache with scalar (or no) scales when
#: the batch has at least ``PREDECODE_MIN_TOKENS`` new tokens and its block table's token
#: capacity (``B x W x P``) is at most ``PREDECODE_TABLE_RATIO`` times them: the scratch
#: (``B x W`` pages, 2 bytes per value) and the decoding pass then stay proportional to the
#: new tokens, whose wide tiles re-read the shared blocks many times. A server whose block
#: table spans the model's whole context (W = max_model_len / P) falls outside the rule
#: and passes ``predecode=True`` to spend the B x W pages of scratch. With the tiers, the
#: predecode kernel decodes only if ``_tier_kernel`` kept a wide tile with a block (a
#: device flag).
PREDECODE_MIN_TOKENS = 1024
PREDECODE_TABLE_RATIO = 4
LOG2E = 1.4426950408889634


NONE_ENTRY: tl.constexpr = tl.constexpr(2147483647)


@triton.jit
def _tile_request(tile, cu_ptr, cu_s0, num_reqs, search_steps, BLOCK_T: tl.constexpr):
    """Program ``tile``'s request r (the largest with ``cu[r] // BLOCK_T + r <= tile``: tiles
    never straddle requests), the request's first new token, its query length, and the
    tile's first token within the request (>= the length: a surplus program)."""
    lo = tile * 0
    hi = lo + num_reqs
    for _ in range(search_steps):
        mid = (lo + hi) // 2
        first = tl.load(cu_ptr + mid.to(tl.int64) * cu_s0).to(tl.int32) // BLOCK_T + mid
        ok = first <= tile
        lo = tl.where(ok, mid, lo)
        hi = tl.where(ok, hi, mid)
    r64 = lo.to(tl.int64)
    cu0 = tl.load(cu_ptr + r64 * cu_s0).to(tl.int64)
    qlen = tl.load(cu_ptr + (r64 + 1) * cu_s0).to(tl.int64) - cu0
    local = (tile - (cu0 // BLOCK_T + r64)) * BLOCK_T
    return r64, cu0, qlen, local


@triton.jit
def _tile_entries(local, cu0, qlen, prefix, g64, num_tokens, tk_ptr, tk_s0, tk_s1, tk_s2,
                  topk_k, bt_cols, BLOCK_T: tl.constexpr, KP: tl.constexpr, P: tl.constexpr):
    """The tile's tokens (in range, positions) and their entries ``[BLOCK_T, KP]``: valid
    ones (non-negative, at most ``p // P``, inside the block table) and as int32 with the
    invalid ones replaced by ``NONE_ENTRY``."""
    ti = tl.arange(0, BLOCK_T)
    t_loc = local + ti
    t_glob = cu0 + t_loc
    t_ok = (t_loc < qlen) & (t_glob >= 0) & (t_glob < num_tokens)
    t_pos = prefix + t_loc  # < 0: no key (a bad seq_len)
    kk = tl.arange(0, KP)
    e = tl.load(tk_ptr + g64 * tk_s0 + t_glob[:, None] * tk_s1
                + kk[None, :].to(tl.int64) * tk_s2,
                mask=t_ok[:, None] & (kk < topk_k)[None, :], other=-1).to(tl.int64)
    valid = t_ok[:, None] & (e >= 0) & (e * P <= t_pos[:, None]) & (e < bt_cols)
    return t_ok, t_pos, valid, tl.where(valid, e, NONE_ENTRY).to(tl.int32)


@triton.jit
def _valid_count(valid):
    """The number of valid entries of a tile (``valid``: ``[BLOCK_T, KP]``)."""
    return tl.sum(tl.sum(valid.to(tl.int32), axis=1), axis=0)


@triton.jit
def _next_entry(es, cur):
    """The smallest entry of ``es`` above ``cur`` (NONE_ENTRY when there is none)."""
    return tl.min(tl.min(tl.where(es > cur, es, NONE_ENTRY), axis=1), axis=0)


@triton.jit
def _table_entry(bt_row, bt_s1, blk):
    """Block ``blk``'s block-table entry in the request's row (-1 for NONE_ENTRY)."""
    return tl.load(bt_row + blk.to(tl.int64) * bt_s1, mask=blk < NONE_ENTRY, other=-1)


@triton.jit
def _union_size(es, cap):
    """The number of distinct entries of ``es`` below NONE_ENTRY, by the chain "next = min
    entry > current" (no loads); the count stops at ``cap + 1``."""
    n = cap * 0
    nxt = _next_entry(es, n - 1)
    while (nxt < NONE_ENTRY) & (n <= cap):
        n += 1
        nxt = _next_entry(es, nxt)
    return n


@triton.jit(do_not_specialize=[
    "num_tokens", "bt_cols", "num_reqs", "search_steps", "topk_k", "delegate_ratio"])
def _tier_kernel(cu_ptr, cu_s0, seq_ptr, seq_s0, num_reqs, search_steps, num_tokens,
                 tk_ptr, tk_s0, tk_s1, tk_s2, topk_k, bt_cols, tier_ptr, delegate_ratio,
                 list_ptr, count_ptr, wide_ptr,
                 BLOCK_T: tl.constexpr, KP: tl.constexpr, P: tl.constexpr,
                 PDL: tl.constexpr = False):
    """The tiers' switch (docs/kernels/attention_prefill.md, Tiers), one small program per (wide
    tile, KV head): 1 at the tile's slot of ``tier_ptr`` when its union U has ``U *
    delegate_ratio`` > its valid entries (counting stops there), else 0 (surplus programs too);
    a handed tile's slot is also appended to the narrow pass's list at ``list_ptr``
    (``count_ptr[0]`` entries, in no particular order); a tile kept with a block in its union
    sets ``wide_ptr[0]`` to 1 (the wide pass reads pages: a predecode is needed). PDL:
    ``kernels._triton.await_previous_kernel`` first (the launcher's ``pdl``)."""
    await_previous_kernel(PDL)
    tile = tl.program_id(0)
    g64 = tl.program_id(1).to(tl.int64)
    r64, cu0, qlen, local = _tile_request(tile, cu_ptr, cu_s0, num_reqs, search_steps,
                                          BLOCK_T)
    handed = tile * 0
    if local < qlen:
        prefix = tl.load(seq_ptr + r64 * seq_s0).to(tl.int64) - qlen
        t_ok, t_pos, valid, es = _tile_entries(local, cu0, qlen, prefix, g64, num_tokens,
                                               tk_ptr, tk_s0, tk_s1, tk_s2, topk_k, bt_cols,
                                               BLOCK_T, KP, P)
        cap = _valid_count(valid) // delegate_ratio
        n = _union_size(es, cap)
        handed = (n > cap).to(tl.int32)
        if (n > 0) & (handed == 0):  # the wide pass will read pages: mark it
            tl.store(wide_ptr, 1)
    slot = tile * tl.num_programs(1) + tl.program_id(1)
    tl.store(tier_ptr + slot, handed)
    if handed != 0:
        tl.store(list_ptr + tl.atomic_add(count_ptr, 1), slot)


# Counts and sizes vary from call to call: not specialised (one compile for every shape).
@triton.jit(do_not_specialize=[
    "num_tokens", "num_pages", "bt_cols", "num_reqs", "search_steps", "topk_k", "group",
    "num_heads"])
def _prefill_kernel(
        q_ptr, q_s0, q_s1, num_tokens,
        kv_ptr, kv_s0, kv_s1, kv_s2, num_pages,
        bt_ptr, bt_s0, bt_s1, bt_cols,
        cu_ptr, cu_s0, seq_ptr, seq_s0, num_reqs, search_steps,
        tk_ptr, tk_s0, tk_s1, tk_s2, topk_k,
        ks_ptr, ks_s0, ks_s1, vs_ptr, vs_s0, vs_s1,
        out_ptr, out_s0, out_s1, qk_scale, group,
        tier_ptr, list_ptr, count_ptr, push_ptr, push_count_ptr, num_heads,
        BLOCK_T: tl.constexpr, G_P: tl.constexpr, D: tl.constexpr, P: tl.constexpr,
        KP: tl.constexpr, FP8: tl.constexpr, FMT: tl.constexpr, HW: tl.constexpr,
        SCALAR: tl.constexpr, SAME: tl.constexpr, ASM: tl.constexpr, REPAIR: tl.constexpr,
        BN: tl.constexpr, TIER: tl.constexpr = 0,
        WIDE_T: tl.constexpr = 1, PRE: tl.constexpr = False, LISTED: tl.constexpr = False,
        PDL: tl.constexpr = False):
    """One pass over tiles, each a (tile slot, KV head) item ``e = slot * SUBS + sub``
    (``slot = wide tile * num_heads + KV head``; ``sub``: the ``BLOCK_T``-token tile within
    a ``WIDE_T``-token wide tile, ``SUBS = WIDE_T // BLOCK_T`` of them in the narrow tier,
    else 1). Not LISTED (the first pass of the wide tier): one program per (wide tile, KV
    head) of the grid. LISTED (the narrow tier's first pass, every repair pass): a grid of
    about one wave of programs striding over the items of the list at ``list_ptr`` (int32,
    ``count_ptr[0]`` of them, each expanded to SUBS items in the narrow tier's first pass,
    whose list holds wide slots): a tier or a repair with nothing to do costs one wave of
    programs that read a zero count, not a grid of empty programs. A first pass appends each tile
    it flags for repair (docs/kernels/attention_prefill.md, Masking) to the list at
    ``push_ptr``. TIER (docs/kernels/attention_prefill.md, Tiers): 0 every tile here; 1 the wide
    pass, which leaves the tiles
    ``_tier_kernel`` marked at ``tier_ptr`` to 2, the narrow pass (``BLOCK_T`` tokens
    nested in the wide tiles' ``WIDE_T``). PDL: ``kernels._triton.await_previous_kernel``
    first (the launcher's ``pdl``)."""
    await_previous_kernel(PDL)
    NONE: tl.constexpr = NONE_ENTRY
    # The fp8 operand forms (q row-scaled, K/V decoded, their units): not on predecoded
    # pages, which hold the exact values in act and take the 16-bit path, scales outside.
    OPS: tl.constexpr = FP8 and not PRE
    ROWS: tl.constexpr = BLOCK_T * G_P
    SUB: tl.constexpr = P // BN  # online-softmax tiles of BN keys per block, in key order
    WT: tl.constexpr = WIDE_T if TIER == 2 else BLOCK_T  # the slot's tile size
    SUBS: tl.constexpr = WIDE_T // BLOCK_T if TIER == 2 else 1
    EXPAND: tl.constexpr = SUBS if (TIER == 2 and not REPAIR) else 1
    if LISTED:
        first, n, step = tl.program_id(0), tl.load(count_ptr) * EXPAND, tl.num_programs(0)
    else:  # one item: a loop of one trip, which the compiler removes
        first, n, step = 0, 1, 1
    for i in range(first, n, step):
        if LISTED:
            e = tl.load(list_ptr + i // EXPAND) * EXPAND + i % EXPAND
        else:
            e = tl.program_id(0) * num_heads + tl.program_id(1)
        slot = e // SUBS
        wide_tile = slot // num_heads
        g64 = (slot % num_heads).to(tl.int64)
        r64, cu0, qlen, local = _tile_request(wide_tile, cu_ptr, cu_s0, num_reqs, search_steps,
                                              WT)
        local += (e % SUBS) * BLOCK_T
        work = local < qlen
        if TIER == 1:  # not the tiles handed to the narrow pass
            work = work & (tl.load(tier_ptr + slot) == 0)
        needs_repair = e * 0
        if work:
            seq = tl.load(seq_ptr + r64 * seq_s0).to(tl.int64)
            prefix = seq - qlen

            # ---- the tile's tokens and their entries (invalid ones: NONE), and the union's
            # size (the main loop's trip count).
            t_ok, t_pos, valid, es = _tile_entries(local, cu0, qlen, prefix, g64, num_tokens,
                                                   tk_ptr, tk_s0, tk_s1, tk_s2, topk_k, bt_cols,
                                                   BLOCK_T, KP, P)
            if BLOCK_T == 1:
                # One token: its valid entries bound its union without the min-reduction
                # chain (a repeated entry makes the walk's last trips find no block: they
                # load nothing and change nothing).
                n_union = _valid_count(valid)
            else:
                n_union = _union_size(es, e * 0 + NONE)

            # ---- the (token, head) rows: m = token * G_P + head.
            mm = tl.arange(0, ROWS)
            m_tok = mm // G_P
            m_head = mm % G_P
            m_loc = local + m_tok
            m_glob = cu0 + m_loc
            m_ok = (m_loc < qlen) & (m_glob >= 0) & (m_glob < num_tokens) & (m_head < group)
            # Positions in int32 inside the block loop (as the decode: its 64-bit compares of
            # every key against every row were ~9% of the decode loop's stall samples); the
            # host caps block tables at MAX_CONTEXT tokens, so a valid position is unchanged
            # and -1 still means "no key".
            m_pos = tl.minimum(tl.maximum(prefix + m_loc, -1), MAX_CONTEXT).to(tl.int32)
            t_pos32 = tl.minimum(tl.maximum(t_pos, -1), MAX_CONTEXT).to(tl.int32)
            m_hq = g64 * group + m_head
            dd = tl.arange(0, D)
            q = tl.load(q_ptr + m_glob[:, None] * q_s0 + m_hq[:, None] * q_s1 + dd[None, :],
                        mask=m_ok[:, None], other=0.0)

            m_i = tl.full((ROWS,), float("-inf"), tl.float32)
            l_i = tl.zeros((ROWS,), tl.float32)
            acc = tl.zeros((ROWS, D), tl.float32)
            jj = tl.arange(0, BN)
            logit_scale = qk_scale
            if FP8 and SCALAR:  # the scales outside the products (_attention.scales_outside)
                logit_scale = qk_scale * tl.load(ks_ptr)
            q, row_scale = q_operand(q, logit_scale, OPS and SCALAR, FMT)
            # The union's next block and its page, one block ahead: the min-reduction over
            # the entries and the block-table load then overlap the current block's work
            # instead of heading its chain (K/V addresses wait for the page).
            bt_row = bt_ptr + r64 * bt_s0
            nb = _next_entry(es, e * 0 - 1)
            n_page = _table_entry(bt_row, bt_s1, nb)
            blk = nb
            page = n_page.to(tl.int64)
            for it in range(n_union * SUB):
                off = (it % SUB) * BN  # the tile's first key in its block
                new_block = off == 0  # a block's first tile: the next union block
                blk = tl.where(new_block, nb, blk)
                page = tl.where(new_block, n_page.to(tl.int64), page)
                if BLOCK_T == 1:  # the union is the token's own selection: it takes blk
                    takes = tl.full((BLOCK_T,), 1, tl.int32)
                else:
                    takes = tl.max((es == blk).to(tl.int32), axis=1)  # [BLOCK_T]: 1 if selected
                m_takes = tl.reshape(tl.broadcast_to(takes[:, None], (BLOCK_T, G_P)), (ROWS,)) > 0
                lim = tl.max(tl.where(takes > 0, t_pos32, -1), axis=0)  # the last key any row sees
                blk64 = blk.to(tl.int64)
                page_ok = (page >= 0) & (page < num_pages)
                pg = tl.where(page_ok, page, 0)
                first_key = blk * P + off
                key = first_key + jj
                kmask = (key <= lim) & page_ok
                src = (kv_ptr + pg * kv_s0 + g64 * kv_s1 + (off + jj)[:, None].to(tl.int64) * kv_s2
                       + dd[None, :])
                k, v = kv_tiles(src, (pg * P + off + jj)[:, None], kmask[:, None], ks_ptr, ks_s0,
                                ks_s1, vs_ptr, vs_s0, vs_s1, g64, q_ptr.dtype.element_ty, D, FP8,
                                FMT, HW, SCALAR, SAME, ASM, PRE)
                # The next block and its page (after K/V's loads are issued: off their path).
                nb = _next_entry(es, blk)
                n_page = _table_entry(bt_row, bt_s1, nb)
                # [ROWS, BN], fp32 accumulation
                s = unit_back(tl.dot(q, tl.trans(k)), OPS, FMT, SCALAR, ASM)
                # A row sees the tile's keys up to its own position when its token takes
                # the block on a valid page: one compare per logit against a row threshold
                # (m_pos <= lim for those rows, so kmask adds nothing).
                last = tl.where(m_takes & page_ok, m_pos - first_key, -1)
                vis = jj[None, :] <= last[:, None]
                # A tile every token of which takes the block and sees all its keys (most
                # blocks below the tile's own) needs no mask: a uniform branch (as the
                # decode's one-row programs), ~130 of ~890 loop instructions per thread
                # (static sm_90, wide tier, model shape). At every pipeline depth: with the
                # page loaded a block ahead the branch no longer keeps Triton's pipeliner to
                # one K/V buffer at 3 stages (static sm_90, tests/test_static_sm90.py), and
                # it is no slower than a branchless loop (docs/tuning.md).
                seen = (takes > 0) & (t_pos32 >= first_key + BN - 1)
                whole = (tl.min((seen | (t_ok == 0)).to(tl.int32), axis=0) > 0) & page_ok
                if whole:
                    s2 = s
                else:
                    s2 = tl.where(vis, s, float("-inf"))
                m_new, alpha, p_act, pv, l_i = softmax_step(s2, m_i, l_i, v, OPS, FMT, SCALAR,
                                                            row_scale)
                if REPAIR and BLOCK_T > 1:
                    # Rows that do not all see the loaded keys: guard non-finite V (docstring).
                    last = tl.minimum(lim, blk64 * P + off + BN - 1)
                    short = tl.sum((t_ok & ((takes == 0) | (t_pos32 < last))).to(tl.int32),
                                   axis=0)
                    if short > 0:
                        pv = repair_pv(pv, p_act, v, vis)
                acc = acc * alpha[:, None] + pv
                m_i = m_new

            empty = l_i == 0.0  # no key (NaN sums are not empty: they propagate)
            o = tl.where(empty[:, None], 0.0, acc / tl.where(empty, 1.0, l_i)[:, None])
            if FP8 and SCALAR:
                o = out_unit_back(o, OPS, FMT, SCALAR, ASM) * tl.load(vs_ptr)
            dst = out_ptr + m_glob[:, None] * out_s0 + m_hq[:, None] * out_s1 + dd[None, :]
            tl.store(dst, o.to(out_ptr.dtype.element_ty), mask=m_ok[:, None])
            if BLOCK_T > 1:  # one token's rows all see the same keys: nothing to repair
                needs_repair = not_finite(acc)
        if (not REPAIR) and (BLOCK_T > 1):
            if needs_repair != 0:
                tl.store(push_ptr + tl.atomic_add(push_count_ptr, 1), e)


#: True when the kernel runs in the (patched) CPU interpreter.
INTERPRETED = is_interpreted(_prefill_kernel)


# ---------------------------------------------------------------------------- schedule


@dataclass(frozen=True)
class PrefillSchedule:
    """The kernel's rounding schedule for a model dtype and a case's inputs (what the oracle
    calls ``schedule_for(impl, model_dtype, case)``); see docs/kernels/attention_prefill.md.
    ``block_keys`` / ``narrow_block_keys``: the launch knobs' tiles (``Schedule.tile_keys``;
    None or the page size: whole blocks; ``narrow_block_keys`` None: ``narrow_tile_keys``,
    the launcher's default)."""

    block_keys: int | None = None
    narrow_block_keys: int | None = None

    def __call__(self, model_dtype: str, case: dict | None = None):
        """The schedules of the three kinds of rows, indexed as the adapter's
        ``schedule_rows`` names them (``oracle.core.registry``): 0 the wide tier on the cache,
        1 the wide tier on predecoded pages (fp8 with scalar scales: K/V exact, q as given,
        P in act), 2 the narrow tier (its own key tiles); equal where they agree (the
        oracle runs the reference once per distinct schedule)."""
        from reference.attention import Schedule

        kv, p_dtype, q_dtype = operand_dtypes(model_dtype, case)
        wide = Schedule(kv_dtype=kv, p_dtype=p_dtype, p_max="running",
                        blocks_per_tile=1, blocks_per_split=None, out_dtype=model_dtype,
                        order="ascending", q_dtype=q_dtype,
                        tile_keys=declared_tile_keys(self.block_keys, case))
        pre = replace(wide, p_dtype=model_dtype, q_dtype="given") if scales_outside(case) \
            else wide
        narrow_keys = self.narrow_block_keys
        if narrow_keys is None and case is not None:
            narrow_keys = narrow_tile_keys(self.block_keys, case["kv_cache"].shape[2],
                                           is_fp8(case["kv_fmt"]))
        narrow = replace(wide, tile_keys=declared_tile_keys(narrow_keys, case))
        return wide, pre, narrow


SCHEDULE = PrefillSchedule()


# ---------------------------------------------------------------------------- launcher


@dataclass
class PrefillPlan:
    """What ``plan_attention_prefill`` checked and derived."""

    t: int
    hq: int
    hkv: int
    d: int
    page: int
    num_pages: int
    batch: int
    topk_k: int
    fp8: bool
    ks: torch.Tensor
    ks_strides: tuple[int, int]
    vs: torch.Tensor
    vs_strides: tuple[int, int]
    softmax_scale: float
    out: torch.Tensor


def _row_positions(cu_seqlens_q, seq_lens, t: int) -> torch.Tensor:
    """``validate=True``: cu_seqlens_q starts at 0, never decreases, ends at T, and no
    request has more new tokens than seq_len; returns each token's position (int64 CPU)."""
    cu = cu_seqlens_q.detach().to("cpu", torch.int64)
    seq = seq_lens.detach().to("cpu", torch.int64)
    qlen = cu[1:] - cu[:-1]
    if int(cu[0]) != 0 or bool((qlen < 0).any()) or int(cu[-1]) != t:
        fail("cu_seqlens_q", f"must start at 0, never decrease and end at T = {t}, got "
                             f"{cu.tolist()[:8]}{'...' if cu.numel() > 8 else ''}")
    if bool((seq < 0).any()):
        r = int((seq < 0).nonzero()[0, 0])
        fail("seq_lens", f"must be >= 0; entry {r} is {int(seq[r])}")
    if bool((qlen > seq).any()):
        r = int((qlen > seq).nonzero()[0, 0])
        fail("seq_lens", f"[{r}] = {int(seq[r])} is less than request {r}'s query length "
                         f"{int(qlen[r])} (seq_lens counts the new tokens too)")
    req = torch.repeat_interleave(torch.arange(seq.numel()), qlen)
    return torch.arange(t) - cu[req] + (seq - qlen)[req]


def plan_attention_prefill(q, kv_cache, kv_fmt, block_table, cu_seqlens_q, seq_lens, topk,
                           k_scale=None, v_scale=None, softmax_scale=None, out=None,
                           validate=False) -> PrefillPlan:
    """Every host check of ``sparse_attention_prefill`` (shapes, dtypes, strides, formats,
    scales; contents under ``validate=True``) and the output tensor."""
    a = check_q_and_cache(q, kv_cache, kv_fmt)
    dev = q.device
    batch = check_index_tensor(seq_lens, "seq_lens", dev, 1).shape[0]
    if batch == 0 and a.t:
        fail("seq_lens", f"must name at least one request for T = {a.t} tokens, got B = 0")
    check_index_tensor(cu_seqlens_q, "cu_seqlens_q", dev, 1)
    if cu_seqlens_q.shape[0] != batch + 1:
        fail("cu_seqlens_q", f"must have shape [B + 1] = [{batch + 1}], got "
                             f"{list(cu_seqlens_q.shape)}")
    topk_k = check_table_and_selections(block_table, topk, a, batch, dev)
    ks, ks_strides, vs, vs_strides, softmax_scale, out = check_scales_and_out(
        q, a, k_scale, v_scale, softmax_scale, out, validate)
    if validate and batch:
        pos = _row_positions(cu_seqlens_q, seq_lens, a.t)
        validate_block_table(block_table, seq_lens, a.page, a.num_pages)
        validate_selections(topk, pos, a.page)
        validate_scales((("k_scale", ks), ("v_scale", vs)))
    return PrefillPlan(a.t, a.hq, a.hkv, a.d, a.page, a.num_pages, batch, topk_k, a.fp8,
                       ks, ks_strides, vs, vs_strides, softmax_scale, out)


def narrow_tile_keys(block_keys, page: int, fp8: bool) -> int:
    """The narrow tier's keys per tile when ``narrow_block_keys`` is not given: the wide
    tier's (``block_keys``, None: the page) capped at ``NARROW_KEYS_FP8`` (an fp8 cache) or
    ``NARROW_KEYS``."""
    return min(page if block_keys is None else block_keys,
               NARROW_KEYS_FP8 if fp8 else NARROW_KEYS)


def _block_t(block_rows, g_p: int, name: str = "block_rows") -> int:
    """Tokens per tile: ``block_rows // G_P`` (rows = tokens x padded heads), at least 16
    rows (tl.dot's minimum M); errors name the knob ``name``."""
    rows = BLOCK_ROWS if block_rows is None else check_int(block_rows, name, 1, 1024)
    if rows & (rows - 1):
        fail(name, f"must be a power of two, got {rows}")
    return max(1, rows // g_p, 16 // g_p)


def _num_stages(page: int, d: int, fp8: bool) -> int:
    """The deepest software pipeline tried by default: the K and V tiles of one block
    (``2 P D`` codes, P here the keys of one tile: ``block_keys``) per stage must leave
    shared memory for the dequantised operands and q (3 stages up to 32 KiB per stage, 2
    up to 64 KiB, else 1). The launcher lowers it
    until the compiled kernel fits (``fitting_stages``): with D = 256, P = 64, a 16-bit
    cache and 16 heads per group, 2 stages ask for 240 KiB where sm_90 has 227."""
    per_stage = 2 * page * d * (1 if fp8 else 2)
    return 3 if per_stage <= 32768 else 2 if per_stage <= 65536 else 1


def sparse_attention_prefill(q, kv_cache, kv_fmt, block_table, cu_seqlens_q, seq_lens, topk,
                             k_scale=None, v_scale=None, softmax_scale=None, out=None, *,
                             validate=False, block_rows=None, num_warps=None,
                             num_stages=None, delegate_ratio=None, narrow_warps=None,
                             narrow_stages=None, narrow_max_registers=None, block_keys=None,
                             narrow_block_keys=None, predecode=None, predecode_rows=None,
                             predecode_warps=None, pdl=False, narrow_rows=None,
                             schedule_rows=None):
    """Block-sparse GQA prefill attention; returns ``out`` ``[T, Hq, D]`` (model dtype).

    q: bf16/fp16 ``[T, Hq, D]`` (D in 64/128/256; any token/head strides, last dim
    contiguous), the new tokens of all requests, request-major. kv_cache: logical
    ``[num_pages, Hkv, P, 2D]`` (K in the first D, V in the second; any non-negative
    strides, last dim contiguous): uint8 codes of the fp8 format ``kv_fmt``, or bf16/fp16
    (``kv_fmt`` its name). block_table: int32/int64 ``[B, max_blocks]``; cu_seqlens_q:
    int32/int64 ``[B + 1]``; seq_lens: int32/int64 ``[B]`` (total length including the new
    tokens); topk: int32/int64 ``[Hkv, T, K]`` logical block ids (any strides, e.g. a
    transposed token-major buffer; negative = unused). Scales (fp8 only): None (1.0), a
    float, or float32 tensors, 0-d or ``[Hkv, num_pages*P]`` (per KV head and physical
    slot); K/V are ``decode(code) * scale``. softmax_scale: default ``1/sqrt(D)``. out:
    optional preallocated output (model dtype, any token/head strides, last dim
    contiguous), written and returned. ``validate=True``: also check contents on the host
    (a sync): cu_seqlens_q against T and seq_lens, block-table entries of used blocks,
    selections in range without repeats, positive finite scales. Without it, bad contents
    are guarded in the kernel (never an illegal access; see docs/kernels/attention_prefill.md).
    Launch knobs (speed only): block_rows, num_warps, num_stages, delegate_ratio,
    narrow_rows, narrow_warps, narrow_stages, narrow_max_registers, block_keys,
    narrow_block_keys, predecode_rows, predecode_warps (``_prefill_knobs``).
    predecode: True (an fp8 cache with scalar (or no) scales only): the batch's pages
    decoded once to their exact values in the model dtype (``kernels.kv_predecode``; a
    scratch of ``B x max_blocks`` pages of 2-byte values) and the wide tier run on them as
    on a 16-bit cache in act, the scales in fp32 outside the products: q as given and P in
    act (docs/kernels/attention_prefill.md's second schedule, ``PrefillSchedule``), where the
    fp8 path row-scales q to fp16 and rounds P to fp16; the narrow tier reads the fp8 codes on
    the fp8 path. None (default): True where ``default_predecode`` says so, else False. pdl:
    programmatic dependent launch of every kernel of the call (compiled, sm_90; a no-op
    interpreted): each launch may be scheduled while the stream's previous kernel finishes, its
    programs waiting for that kernel's completion before touching memory
    (``kernels._triton.await_previous_kernel``), so the results are a plain launch's.
    schedule_rows: None, or an integer tensor ``[T, Hq]`` on q's device that the call fills (no
    sync) with each (token, head) row's schedule, the index into ``PrefillSchedule``'s
    schedules: 0 the wide tier on the cache, 1 on predecoded pages, 2 the narrow tier."""
    p = plan_attention_prefill(q, kv_cache, kv_fmt, block_table, cu_seqlens_q, seq_lens, topk,
                               k_scale, v_scale, softmax_scale, out, validate)
    if p.t == 0:
        return p.out
    kn = _prefill_knobs(p, block_rows, num_warps, num_stages, delegate_ratio, narrow_rows,
                        narrow_warps, narrow_stages, narrow_max_registers, block_keys,
                        narrow_block_keys, predecode_rows, predecode_warps)
    pdl_kw = pdl_options(pdl, INTERPRETED)
    ensure_ready(_prefill_kernel)
    tiers = kn.ratio > 0 and kn.narrow_t < kn.block_t
    const = _prefill_const(p, q, kv_cache, kv_fmt, kn)
    # The lists' counts (handed wide tiles; flagged wide and narrow tiles) and whether a
    # wide tile reads pages (set by ``_tier_kernel``): one fill.
    counts = torch.zeros(4, dtype=torch.int32, device=q.device)
    tier = handed = None
    if tiers:
        tier, handed = _switch_tiers(p, kn, const, cu_seqlens_q, seq_lens, topk, block_table,
                                     counts, pdl_kw)
    if predecode is None:
        predecode = default_predecode(p, const["SCALAR"], block_table.shape[1])
    if not isinstance(predecode, bool):
        fail("predecode", f"must be True, False or None, got {predecode!r}")
    _wide_pass(p, kn, const, predecode, tiers, tier, counts, q, kv_cache, block_table,
               cu_seqlens_q, seq_lens, topk, num_stages, pdl_kw)
    if tiers:
        _prefill_pass(p, q, kv_cache, block_table, cu_seqlens_q, seq_lens, topk, kn.grp,
                      tier, handed, counts[2:3], {**const, "BLOCK_T": kn.narrow_t, "TIER": 2,
                                                  "WIDE_T": kn.block_t, "BN": kn.bn_narrow,
                                                  **kn.narrow, **pdl_kw},
                      "num_stages" not in kn.narrow)
    if schedule_rows is not None:
        schedule_rows.copy_(_row_schedules(p, cu_seqlens_q, tier, kn.block_t, kn.grp,
                                           predecode))
    return p.out


@dataclass(frozen=True)
class _PrefillKnobs:
    """The launch knobs checked and defaulted (``_prefill_knobs``)."""

    grp: int
    g_p: int
    block_t: int  # tokens per wide tile
    narrow_t: int  # tokens per narrow tile
    ratio: int
    opts: dict  # the wide tier's launch options
    narrow: dict  # the narrow tier's launch options
    bn: int
    bn_narrow: int
    pre_rows: int
    pre_warps: int


def _prefill_knobs(p, block_rows, num_warps, num_stages, delegate_ratio, narrow_rows,
                   narrow_warps, narrow_stages, narrow_max_registers, block_keys,
                   narrow_block_keys, predecode_rows, predecode_warps) -> _PrefillKnobs:
    """The launch knobs, speed only (ValueError naming them when invalid).

    block_rows      query rows (tokens x padded heads) per program of the wide tier, a power
                    of two (default ``BLOCK_ROWS``).
    num_warps, num_stages
                    its Triton launch options (default ``NUM_WARPS``, and ``_num_stages``);
                    a given num_stages is the first pass's, the repair pass taking the
                    deepest up to it that fits.
    delegate_ratio  the tiers' switch (docs/kernels/attention_prefill.md, Tiers; default
    ``DELEGATE_RATIO``;
                    0: every tile in the wide tier; a huge value: every tile with a
                    selection in the narrow tier).
    narrow_rows     rows per program of the narrow tier (a power of two, default
                    ``NARROW_ROWS``: one token at G 16; more rows walk the union of a few
                    tokens' selections, reading a block once for the tokens that share it)
                    when they are fewer than the wide tier's (else the tiers are off).
    narrow_warps, narrow_stages
                    its launch options (default: ``NARROW_FP8`` with an fp8 cache, else
                    ``NARROW_WARPS`` and, as the wide tier, ``_num_stages`` lowered until
                    it fits; at least a warp per ``NARROW_ROWS`` rows).
    narrow_max_registers
                    its ptxas register cap (``maxnreg``; default the compiler's choice).
    block_keys      keys per online-softmax tile in both tiers, a power of two dividing P,
                    >= 16 (default P: one tile per block, faster than smaller tiles;
                    declared as ``Schedule.tile_keys`` through
                    ``PrefillSchedule(block_keys=...)``); smaller tiles take less shared
                    memory per pipeline stage and fewer registers.
    narrow_block_keys
                    the narrow tier's own key tiles (default: ``narrow_tile_keys``;
                    declared as ``PrefillSchedule(narrow_block_keys=...)``).
    predecode_rows, predecode_warps
                    the predecode's rows of a page per program (a power of two dividing P)
                    and warps per program (default ``kv_predecode.PREDECODE_ROWS`` and
                    ``PREDECODE_WARPS``; checked whether or not the predecode runs)."""
    grp = p.hq // p.hkv
    g_p = triton.next_power_of_2(grp)
    block_t = _block_t(block_rows, g_p)
    narrow_t = _block_t(NARROW_ROWS if narrow_rows is None else narrow_rows, g_p,
                        "narrow_rows")
    ratio = DELEGATE_RATIO if delegate_ratio is None else check_int(
        delegate_ratio, "delegate_ratio", 0, 2**20)
    opts = {} if num_stages is None else {"num_stages": check_int(num_stages, "num_stages",
                                                                  1, 8)}
    opts["num_warps"] = NUM_WARPS if num_warps is None else check_int(num_warps, "num_warps",
                                                                      1, 16)
    narrow = dict(NARROW_FP8) if p.fp8 else {"num_warps": NARROW_WARPS}
    # Wider narrow tiles (``narrow_rows``): at least a warp per 16 rows, as the default's
    # one-token tiles have (two tokens on one warp spill).
    narrow["num_warps"] = max(narrow["num_warps"], narrow_t * g_p // NARROW_ROWS)
    if narrow_warps is not None:
        narrow["num_warps"] = check_int(narrow_warps, "narrow_warps", 1, 16)
    if narrow_stages is not None:
        narrow["num_stages"] = check_int(narrow_stages, "narrow_stages", 1, 8)
    if narrow_max_registers is not None:
        narrow["maxnreg"] = check_int(narrow_max_registers, "narrow_max_registers", 24, 255)
    bn = check_block_keys(block_keys, p.page)
    bn_narrow = narrow_tile_keys(bn, p.page, p.fp8) if narrow_block_keys is None else \
        check_block_keys(narrow_block_keys, p.page, "narrow_block_keys")
    pre_rows, pre_warps = predecode_options(predecode_rows, predecode_warps, p.page)
    return _PrefillKnobs(grp, g_p, block_t, narrow_t, ratio, opts, narrow, bn, bn_narrow,
                         pre_rows, pre_warps)


def _prefill_const(p, q, kv_cache, kv_fmt, kn) -> dict:
    """The constexprs both tiers share."""
    return dict(G_P=kn.g_p, D=p.d, P=p.page, KP=topk_width(p.topk_k), FP8=p.fp8,
                FMT=fmt_code(kv_fmt) if p.fp8 else 0, HW=p.fp8 and kv_fmt in HW_FORMATS,
                SCALAR=p.ks_strides == (0, 0) and p.vs_strides == (0, 0),
                SAME=not p.fp8 and kv_cache.dtype == q.dtype,
                ASM=p.fp8 and asm_f16(kv_fmt, INTERPRETED), BN=kn.bn)


def _switch_tiers(p, kn, const, cu_seqlens_q, seq_lens, topk, block_table, counts, pdl_kw):
    """The tier switch (``_tier_kernel``): each wide tile's slot and the list of tiles it
    hands to the narrow tier. Returns (tier, handed)."""
    tier = _program_slots(p, kn.block_t, counts.device)
    handed = _item_list(tier.numel(), counts[0:1])
    _tier_kernel[_grid(p, kn.block_t)](
        cu_seqlens_q, cu_seqlens_q.stride(0), seq_lens, seq_lens.stride(0),
        p.batch, binary_search_steps(p.batch), p.t,
        topk, topk.stride(0), topk.stride(1), topk.stride(2), p.topk_k,
        block_table.shape[1], tier, kn.ratio, *handed, counts[3:4],
        BLOCK_T=kn.block_t, KP=const["KP"], P=p.page,
        num_warps=max(1, min(8, kn.block_t * const["KP"] // TIER_ENTRIES_PER_WARP)),
        **pdl_kw)
    return tier, handed


def _wide_pass(p, kn, const, predecode, tiers, tier, counts, q, kv_cache, block_table,
               cu_seqlens_q, seq_lens, topk, num_stages, pdl_kw):
    """The wide tier's passes, on the cache or (``predecode``) on its predecoded pages."""
    wide_p, wide_kv, wide_bt, wide_const = p, kv_cache, block_table, const
    if predecode:
        if not (p.fp8 and const["SCALAR"]):
            fail("predecode", "needs an fp8 cache with scalar (or no) scales")
        wide_kv, wide_bt = predecode_pages(kv_cache, block_table, seq_lens, const["FMT"],
                                           const["HW"], const["ASM"], q.dtype,
                                           counts[3:4] if tiers else None, kn.pre_rows,
                                           kn.pre_warps, pdl=bool(pdl_kw))
        wide_p = replace(p, num_pages=wide_kv.shape[0])
        wide_const = {**const, "PRE": True}
    _prefill_pass(wide_p, q, wide_kv, wide_bt, cu_seqlens_q, seq_lens, topk, kn.grp,
                  tier, None, counts[1:2],
                  {**wide_const, "BLOCK_T": kn.block_t, "TIER": int(tiers), **kn.opts,
                   **pdl_kw},
                  num_stages is None)


def _row_schedules(p: PrefillPlan, cu_seqlens_q, tier, block_t: int, grp: int,
                   predecode: bool):
    """``[T, Hq]`` int32 on the device: each (token, head) row's index into
    ``PrefillSchedule``'s schedules: 2 where the narrow tier ran it (its wide tile, module
    docstring Tiling, handed over: ``tier``, one int32 per (wide tile, KV head), None with
    the tiers off), else 1 on predecoded pages, 0 on the cache."""
    dev = cu_seqlens_q.device
    narrow = torch.zeros((p.t, p.hkv), dtype=torch.bool, device=dev)
    if tier is not None:
        tok = torch.arange(p.t, device=dev)
        cu = cu_seqlens_q.to(torch.int64)
        r = torch.searchsorted(cu[1:], tok, right=True).clamp(max=p.batch - 1)
        tile = cu[r] // block_t + r + (tok - cu[r]) // block_t
        slots = tier.view(-1, p.hkv)
        narrow = slots[tile.clamp(0, slots.shape[0] - 1)] != 0
    rows = torch.where(narrow, 2, int(predecode)).to(torch.int32)
    return rows.repeat_interleave(grp, dim=1)


def default_predecode(p: PrefillPlan, scalar: bool, width: int) -> bool:
    """``predecode=None``'s choice (``PREDECODE_MIN_TOKENS``, ``PREDECODE_TABLE_RATIO``): an
    fp8 cache with scalar (or no) scales, at least the minimum of new tokens, and a block
    table holding at most the ratio times as many tokens; host values only (no sync)."""
    return (p.fp8 and scalar and p.t >= PREDECODE_MIN_TOKENS
            and p.batch * width * p.page <= PREDECODE_TABLE_RATIO * p.t)


def binary_search_steps(batch: int) -> int:
    """``_tile_request``'s binary-search steps over ``batch`` requests: ceil(log2(B)), 0 for
    one request, whose tiles need no search (each step is a dependent load at the head of
    every program's chain)."""
    return (batch - 1).bit_length()


def _grid(p: PrefillPlan, block_t: int) -> tuple[int, int]:
    """Programs of a pass with ``block_t`` tokens per tile: (tiles, KV heads); tiles never
    straddle requests, hence up to one surplus per request (docs/kernels/attention_prefill.md)."""
    return p.t // block_t + p.batch, p.hkv


def _program_slots(p: PrefillPlan, block_t: int, device) -> torch.Tensor:
    """One int32 per program of such a pass (the tiers' switch)."""
    g = _grid(p, block_t)
    return torch.empty(g[0] * g[1], dtype=torch.int32, device=device)


def _item_list(capacity: int, count: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """An empty list of a pass's items (``_prefill_kernel``): room for ``capacity`` int32
    entries, and ``count`` (one int32, zero: kernels append with an atomic add)."""
    return torch.empty(max(capacity, 1), dtype=torch.int32, device=count.device), count


#: Programs of a LISTED pass in the interpreter (compiled: one wave, ``resident_programs``).
INTERPRETED_LISTED_PROGRAMS = 3


def _prefill_pass(p, q, kv_cache, block_table, cu_seqlens_q, seq_lens, topk, grp, tier,
                  items, count, const, fit_stages):
    """One tier's launches: the main pass (over the grid of wide tiles, or LISTED over
    ``items``, the list of handed wide slots ``_tier_kernel`` wrote: the narrow tier), then
    the repair pass, LISTED over the tiles the main pass appended to its repair list, whose
    count is ``count`` (one zero int32; docs/kernels/attention_prefill.md; tiles of one token
    never need it). fit_stages: num_stages is ``_num_stages``'s guess lowered until both passes
    fit shared memory; else the first pass takes ``const["num_stages"]`` as given and the repair
    pass the deepest up to it that fits (a caller's ``num_stages=3`` at the model shape: 3 for
    the first pass, 2 for the repair pass)."""
    block_t = const["BLOCK_T"]
    wide_t = const["WIDE_T"] if const.get("TIER") == 2 else block_t  # the slots' tile
    slots = _grid(p, wide_t)
    flagged = _item_list(slots[0] * slots[1] * (wide_t // block_t), count)
    # The first pass's list (the wide pass has none: any buffer, never read).
    listed = flagged if items is None else items

    def args(repair: bool):
        entries, n_entries = flagged if repair else listed
        return (q, q.stride(0), q.stride(1), p.t,
                kv_cache, kv_cache.stride(0), kv_cache.stride(1), kv_cache.stride(2),
                p.num_pages,
                block_table, block_table.stride(0), block_table.stride(1),
                block_table.shape[1],
                cu_seqlens_q, cu_seqlens_q.stride(0), seq_lens, seq_lens.stride(0), p.batch,
                binary_search_steps(p.batch),
                topk, topk.stride(0), topk.stride(1), topk.stride(2), p.topk_k,
                p.ks, *p.ks_strides, p.vs, *p.vs_strides,
                p.out, p.out.stride(0), p.out.stride(1),
                float(np.float32(p.softmax_scale * LOG2E)), grp,
                flagged[0] if tier is None else tier, entries, n_entries, *flagged, p.hkv)

    passes = [(False, items is not None)] + ([(True, True)] if block_t > 1 else [])
    pre = const.get("PRE", False)  # a 16-bit (predecoded) cache: its stage depth
    depth = const.pop("num_stages", None)
    deepest = _num_stages(const["BN"], p.d, p.fp8 and not pre) if fit_stages else depth
    if fit_stages:  # the guess, lowered until both passes fit shared memory
        # The repair pass (the hungrier) is probed first and the first pass from its depth
        # down: the same depth as probing both from the guess, without compiling the first
        # pass at a depth it will not launch with.
        depth = deepest
        for r, li in reversed(passes):
            depth = fitting_stages(_prefill_kernel, args(r), {**const, "REPAIR": r,
                                                              "LISTED": li},
                                   q.device, deepest=depth)
    # Two passes (docs/kernels/attention_prefill.md): the tiles whose P @ V met a non-finite V
    # that some of their rows must not see are listed by the first and recomputed by the second.
    for repair, li in passes:
        kw = {**const, "REPAIR": repair, "LISTED": li}
        # A caller's depth is the first pass's; the repair pass's guarded P @ V takes more
        # shared memory (sm_90, model shape, bf16, 3 stages: first pass 229,408 B, repair
        # 294,912), so it takes the deepest up to it that fits.
        kw["num_stages"] = (fitting_stages(_prefill_kernel, args(repair), kw, q.device,
                                           deepest=depth) if repair else depth)
        grid = slots
        if li:
            grid = (INTERPRETED_LISTED_PROGRAMS if INTERPRETED else
                    resident_programs(_prefill_kernel, args(repair), kw, q.device),)
        _prefill_kernel[grid](*args(repair), **kw)


def compile_signatures():
    """(kernel, signature, constexprs) triples covering the constexpr branches, for the
    sm_90 compile check on the CPU (tests/test_compile_sm90.py)."""
    combos = [  # act, cache, G, FMT, HW, K, P, D
        ("bf16", "u8", 16, 0, True, 16, 128, 128),
        ("fp16", "u8", 8, 1, True, 64, 64, 128),
        ("bf16", "u8", 3, 2, False, 5, 32, 64),
        ("fp16", "u8", 2, 3, False, 16, 16, 64),
        ("bf16", "bf16", 16, 0, False, 16, 128, 128),
        ("fp16", "fp16", 1, 0, False, 3, 16, 256),
        ("bf16", "fp16", 2, 0, False, 16, 64, 64),
    ]
    out = []
    for i, (act, cache, grp, fmt, hw, k, page, d) in enumerate(combos):
        sig = {name: "i64" for name in _prefill_kernel.arg_names}
        sig.update(q_ptr=f"*{act}", kv_ptr=f"*{cache}", bt_ptr="*i32", cu_ptr="*i32",
                   seq_ptr="*i64", tk_ptr="*i32", ks_ptr="*fp32", vs_ptr="*fp32",
                   out_ptr=f"*{act}", tier_ptr="*i32", list_ptr="*i32", count_ptr="*i32",
                   push_ptr="*i32", push_count_ptr="*i32", num_heads="i32", qk_scale="fp32",
                   group="i32", topk_k="i32",
                   bt_cols="i32", num_reqs="i32", search_steps="i32", num_tokens="i64",
                   num_pages="i64")
        g_p = triton.next_power_of_2(grp)
        const = dict(BLOCK_T=_block_t(None, g_p), G_P=g_p, D=d, P=page,
                     KP=topk_width(k), FP8=cache == "u8", FMT=fmt, HW=hw,
                     SCALAR=i % 2 == 0, SAME=cache == act, ASM=hw or fmt == 2, REPAIR=i % 3 == 1,
                     TIER=i % 3, WIDE_T=_block_t(None, g_p), BN=page // 2 if i == 1 else page,
                     PRE=False)
        if const["TIER"] == 2:
            const["BLOCK_T"] = _block_t(NARROW_ROWS, g_p)
        const["LISTED"] = const["TIER"] == 2 or const["REPAIR"]
        sig.update(dict.fromkeys(const, "constexpr"))
        out.append((_prefill_kernel, sig, const))
        if const["TIER"] == 1:
            tsig = {name: sig.get(name, "i32") for name in _tier_kernel.arg_names}
            tsig.update(tier_ptr="*i32", wide_ptr="*i32", delegate_ratio="i32", BLOCK_T="constexpr",
                        KP="constexpr", P="constexpr")
            out.append((_tier_kernel, tsig, dict(BLOCK_T=const["WIDE_T"], KP=const["KP"],
                                                 P=page)))
    # The wide tier on predecoded pages (``predecode``; the model combo with its scratch
    # cache in act), the narrow tier's one-token tiles at the model's group, and the
    # predecode kernel itself (kernels.kv_predecode).
    kernel, sig, const = out[0]
    out.append((kernel, {**sig, "kv_ptr": sig["q_ptr"], "PRE": "constexpr"},
                {**const, "TIER": 1, "PRE": True}))
    out.append((kernel, sig, {**const, "TIER": 2, "BLOCK_T": 1, "WIDE_T": 8, "LISTED": True}))
    # Programmatic dependent launch (the ``pdl`` knob): the wide pass and the tier switch.
    out.append((kernel, {**sig, "PDL": "constexpr"}, {**const, "TIER": 1, "PDL": True}))
    tk, tsig, tconst = next(c for c in out if c[0] is _tier_kernel)
    out.append((tk, {**tsig, "PDL": "constexpr"}, {**tconst, "PDL": True}))
    return out + kv_predecode.compile_signatures()
