"""Prefill indexer in ONE Triton kernel (contract.md section 5): block scores and the
top-k block selection of every new token of a ragged batch, per index head.

Grid ``(token tiles, B)``: program (j, r) owns tokens ``j*TT .. (j+1)*TT - 1`` of request r
(TT = ROWS // Hi tokens, all Hi heads: ROWS rows, see kernels/_indexer.py), at positions
``seq_lens[r] - query_len[r] + i``. It walks the request's key blocks 0 .. (its last
token's position) // P once, reading each key block through the request's block-table row
once for all its rows, and keeps each row's running top-k list of 64-bit keys that encode
forced class, score, NaN and the lower-id tie rule (replace-min insertion compiled, a
vectorised rank merge interpreted; both exact); at the end each list is written in rank
order. Scoring and selection are fused: no score buffer. Scores: exact fp32 widening of q
and k (fp8 via ``kernels.fp8.decode_fp8``, all four formats; the software codec for fnuz),
``tl.dot(..., input_precision="ieee")``: fp32 accumulation, declared ``score_rel = 0``.

Token tiles past a request's new tokens do nothing: the grid's first axis is
``cdiv(max_query_len, TT)``, where ``max_query_len`` defaults to T (an upper bound known
without a host sync); pass the batch's real maximum to launch fewer programs.

``indexer_prefill(...)`` is the host launcher (checks dtypes, shapes, strides, ranges;
ValueError naming the argument; contents under ``validate=True``); oracle/impls/triton.py
registers it as implementation ``"triton"`` of op ``"indexer_prefill"``.
"""

from __future__ import annotations

import torch

from kernels import _indexer as ix
from kernels._host import check_int, check_tensor, fail
from kernels._triton import ensure_ready, is_interpreted, tl, triton


# Counts and sizes vary from call to call: not specialised (one compile for every shape).
@triton.jit(do_not_specialize=[
    "num_pages", "width", "num_tokens", "hi", "tile_tokens", "topk", "local_blocks",
    "initial_blocks"])
def _indexer_prefill_kernel(
        q_ptr, q_s0, q_s1, ic_ptr, ic_s0, ic_s1, num_pages,
        bt_ptr, bt_s0, bt_s1, width, cu_ptr, seq_ptr, num_tokens,
        out_ptr, o_s0, o_s1, o_s2,
        hi, tile_tokens, topk, local_blocks, initial_blocks,
        P: tl.constexpr, D: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
        ROWS: tl.constexpr, BK: tl.constexpr, CH: tl.constexpr, VEC: tl.constexpr,
        FP8: tl.constexpr, FMT: tl.constexpr, HW: tl.constexpr):
    tile = tl.program_id(0)
    r = tl.program_id(1)
    start = tl.load(cu_ptr + r).to(tl.int32)
    qlen = tl.load(cu_ptr + r + 1).to(tl.int32) - start
    seq = tl.load(seq_ptr + r).to(tl.int32)
    rows = tl.arange(0, ROWS)
    local = tile * tile_tokens + rows // hi  # token index within the request's new tokens
    heads = rows % hi
    toks = start + local
    row_in = (rows < tile_tokens * hi) & (local < qlen) & (toks >= 0) & (toks < num_tokens)
    pos = seq - qlen + local
    live = row_in & (pos >= 0)
    q_rows = q_ptr + toks.to(tl.int64) * q_s0 + heads.to(tl.int64) * q_s1
    last = tl.max(tl.where(live, pos, -1), axis=0)
    nb = tl.minimum(tl.where(last >= 0, last // P + 1, 0), width)
    top = ix.empty_list(ROWS, BK)
    top = ix.scan_blocks(top, q_rows, pos, live, bt_ptr + r.to(tl.int64) * bt_s0, bt_s1, 0, nb,
                         ic_ptr, ic_s0, ic_s1, num_pages, local_blocks, initial_blocks,
                         P, D, BLOCK_N, BLOCK_D, ROWS, CH, VEC, FP8, FMT, HW)
    ix.write_list(top, out_ptr, o_s0, o_s1, o_s2, heads, toks, row_in, topk, BK, VEC)


#: True when the kernel runs in the (patched) CPU interpreter.
INTERPRETED = is_interpreted(_indexer_prefill_kernel)


# ---------------------------------------------------------------------------- launcher


def indexer_prefill(index_q, index_cache, index_fmt, block_table, cu_seqlens_q, seq_lens, *,
                    topk, local_blocks=1, initial_blocks=0, out=None, max_query_len=None,
                    validate=False, block_rows=None, block_n=None, block_d=None,
                    blocks_per_step=None, vec=None, num_warps=None):
    """Top-k key blocks of every new token of a ragged prefill batch (contract.md s.5).

    index_q        ``[T, Hi, D]`` in the index cache's format: bf16/fp16 (the cache's
                   dtype) or uint8 fp8 codes; any token/head strides, last dim contiguous.
    index_cache    ``[num_pages, P, D]`` (P in 16..128, D in 64/128/256): uint8 codes of an
                   fp8 ``index_fmt`` (e4m3fn, e4m3fnuz; e5m2, e5m2fnuz for emulation) or
                   bf16/fp16 (``index_fmt`` = its name); any non-negative strides, last dim
                   contiguous.
    block_table    int32/int64 ``[B, max_blocks]``: logical block -> page of the index cache.
    cu_seqlens_q   int32/int64 ``[B+1]``; seq_lens int32/int64 ``[B]`` (incl. new tokens):
                   token i of request r is at position seq_lens[r] - query_len[r] + i.
    topk (1..64), local_blocks, initial_blocks (>= 0): contract.md s.5.
    out            int32 ``[Hi, T, K]`` with any strides (e.g. ``buf.transpose(0, 1)`` of a
                   token-major ``[T, Hi, K]`` buffer); allocated head-major when None.
    max_query_len  an upper bound of the requests' new-token counts (default T: no sync).
    validate=True  checks contents on the host (a sync): cu_seqlens_q from 0 to T,
                   non-decreasing; query lengths within seq_lens and max_query_len; block-table
                   entries used in range and the table wide enough. Without it, bad contents
                   never fault (see kernels/_indexer.py's guards) but their rows are
                   unspecified.
    Returns ``out``: the n = min(K, p//P + 1) selected logical block ids first (forced blocks
    ascending, then descending score, bit-equal scores to the lower id, NaN scores last),
    then -1. Tuning knobs (kernels/_indexer.py ``strategy``): block_rows (ROWS), block_n /
    block_d (tl.dot tile), blocks_per_step, vec (merge strategy), num_warps."""
    t, hi, d, page, num_pages, fp8, code, hw, k, loc, ini = ix.check_index_args(
        index_q, index_cache, index_fmt, block_table, seq_lens, topk, local_blocks,
        initial_blocks)
    dev = index_cache.device
    b = block_table.shape[0]
    check_tensor(cu_seqlens_q, "cu_seqlens_q", ix.INT_DTYPES, (b + 1,), dev)
    mql = t if max_query_len is None else check_int(max_query_len, "max_query_len", 0)
    out = ix.check_out(out, hi, t, k, dev)
    rows, bn, bd, ch, vec, bk = ix.strategy(
        t * hi, hi, page, d, block_table.shape[1], k, INTERPRETED, block_rows, block_n, block_d,
        blocks_per_step, vec)
    if validate:
        _validate(cu_seqlens_q, seq_lens, t, mql)
        ix.validate_block_table(block_table, seq_lens, page, num_pages)
    if t == 0 or b == 0:
        return out
    tile_tokens = rows // hi
    grid = (triton.cdiv(max(mql, 1), tile_tokens), b)
    ensure_ready(_indexer_prefill_kernel)
    _indexer_prefill_kernel[grid](
        index_q, index_q.stride(0), index_q.stride(1),
        index_cache, index_cache.stride(0), index_cache.stride(1), num_pages,
        block_table, block_table.stride(0), block_table.stride(1), block_table.shape[1],
        cu_seqlens_q, seq_lens, t, out, out.stride(0), out.stride(1), out.stride(2),
        hi, tile_tokens, k, loc, ini,
        P=page, D=d, BLOCK_N=bn, BLOCK_D=bd, ROWS=rows, BK=bk, CH=ch, VEC=vec,
        FP8=fp8, FMT=code, HW=hw, num_warps=num_warps or 4)
    return out


def _validate(cu_seqlens_q, seq_lens, t, max_query_len):
    cu = cu_seqlens_q.detach().cpu().to(torch.int64)
    lens = seq_lens.detach().cpu().to(torch.int64)
    if int(cu[0]) != 0 or int(cu[-1]) != t or bool((cu[1:] < cu[:-1]).any()):
        fail("cu_seqlens_q", f"must be non-decreasing from 0 to T={t}, got "
                             f"{cu.tolist()[:16]}")
    qlens = cu[1:] - cu[:-1]
    if bool((qlens > lens).any()):
        r = int(torch.nonzero(qlens > lens)[0, 0])
        fail("cu_seqlens_q", f"gives request {r} {int(qlens[r])} new tokens but seq_lens[{r}]"
                             f" = {int(lens[r])}")
    if qlens.numel() and int(qlens.max()) > max_query_len:
        fail("max_query_len", f"must be >= every request's new tokens ({int(qlens.max())}), "
                              f"got {max_query_len}")


def compile_signatures():
    """(kernel, signature, constexprs) triples covering the constexpr branches, for the
    sm_90 compile check on the CPU (tests/test_compile_sm90.py)."""
    combos = [  # q/cache, P, D, BK, FP8, FMT, HW, index dtype
        ("bf16", 128, 128, 16, False, 0, False, "i32"),
        ("fp16", 16, 64, 1, False, 0, False, "i64"),
        ("u8", 64, 256, 64, True, 0, True, "i32"),
        ("u8", 32, 128, 8, True, 2, False, "i64"),
    ]
    out = []
    for qt, page, d, bk, fp8, fmt, hw, it in combos:
        sig = {name: "i32" for name in _indexer_prefill_kernel.arg_names}
        for name in ("q_s0", "q_s1", "ic_s0", "ic_s1", "bt_s0", "bt_s1", "o_s0", "o_s1",
                     "o_s2"):
            sig[name] = "i64"
        sig.update(q_ptr=f"*{qt}", ic_ptr=f"*{qt}", bt_ptr=f"*{it}", cu_ptr=f"*{it}",
                   seq_ptr=f"*{it}", out_ptr="*i32")
        _, bn, bd, ch, vec, _ = ix.strategy(64, 1, page, d, 1, bk, False)
        const = dict(P=page, D=d, BLOCK_N=bn, BLOCK_D=bd, ROWS=64, BK=bk, CH=ch, VEC=vec,
                     FP8=fp8, FMT=fmt, HW=hw)
        sig.update(dict.fromkeys(const, "constexpr"))
        out.append((_indexer_prefill_kernel, sig, const))
    return out
