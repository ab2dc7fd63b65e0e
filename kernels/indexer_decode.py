"""Decode indexer in ONE Triton kernel (SPEC.md section 5; issue 7): block scores and top-k
selection for 1..4 query rows per request, fused, split over key blocks with an exact merge
of the partial top-k lists in the same launch.

Grid ``(B, S)``: program (r, s) owns all ``rows_per_request * Hi`` rows of request r (row j
of the request at position ``seq_lens[r] - rows_per_request + j``; all index heads: ROWS
rows, see kernels/_indexer.py) and the key blocks ``s*BPS .. (s+1)*BPS - 1`` (BPS blocks
per split), so every key block is read once per request and shared by all its rows and
heads. Each program keeps each row's running top-k list of 64-bit order keys (forced
class, score, NaN, lower-id tie rule in one unsigned integer), exactly as the prefill
kernel does (kernels/_indexer.py: replace-min compiled, rank merge interpreted).

Split merge (S > 1), in the same kernel: each program stores its lists to a workspace
``[B, S, ROWS, BK]`` int64, then takes a ticket from a per-request counter (``atomic_add``,
acq_rel, after a CTA barrier); the program that draws the last ticket reads the S partial
lists (L2 loads, ``.cg``), merges them into one list (inserting every valid key of every
partial list; rank merges interpreted), writes the selection and resets the counter to
0. The merge is exact: the order keys are unique per row, so the BK largest keys
of the union of the partial lists are the BK largest keys of the whole request, whatever
the split or the order of arrival. S = 1 writes directly (no workspace).

Rows of padded requests (seq_lens 0) select nothing: all -1. Scores as in the prefill
kernel: exact fp32 widening (fp8 via ``kernels.fp8.decode_fp8``), ``tl.dot(...,
input_precision="ieee")``, fp32 accumulation: ``score_rel = 0``.

``indexer_decode(...)`` is the host launcher (ValueError naming the argument; contents
under ``validate=True``); ``run(inputs)`` is the oracle adapter registered as
implementation ``"triton"`` of op ``"indexer_decode"``.
"""

from __future__ import annotations

import functools

import torch

from kernels import _indexer as ix
from kernels._host import check_int, fail
from kernels._triton import ensure_ready, is_interpreted, tl, triton
from reference.domain import DECODE_ROWS_RANGE


@triton.jit
def _indexer_decode_kernel(
        q_ptr, q_s0, q_s1, ic_ptr, ic_s0, ic_s1, num_pages,
        bt_ptr, bt_s0, bt_s1, width, seq_ptr, num_tokens,
        out_ptr, o_s0, o_s1, o_s2, part_ptr, cnt_ptr,
        hi, q_rows, topk, local_blocks, initial_blocks, blocks_per_split, num_splits,
        P: tl.constexpr, D: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
        ROWS: tl.constexpr, BK: tl.constexpr, CH: tl.constexpr, VEC: tl.constexpr,
        SPLIT: tl.constexpr, FP8: tl.constexpr, FMT: tl.constexpr, HW: tl.constexpr):
    r = tl.program_id(0)
    s = tl.program_id(1)
    seq = tl.load(seq_ptr + r).to(tl.int32)
    rows = tl.arange(0, ROWS)
    qr = rows // hi
    heads = rows % hi
    toks = r * q_rows + qr
    row_in = (rows < q_rows * hi) & (toks < num_tokens)
    pos = seq - q_rows + qr
    live = row_in & (seq > 0) & (pos >= 0)
    q_ptrs = q_ptr + toks.to(tl.int64) * q_s0 + heads.to(tl.int64) * q_s1
    nb = tl.minimum(tl.where(seq > 0, (seq - 1) // P + 1, 0), width)
    b_lo = s * blocks_per_split
    b_hi = tl.minimum(b_lo + blocks_per_split, nb)
    top = ix.empty_list(ROWS, BK)
    top = ix.scan_blocks(top, q_ptrs, pos, live, bt_ptr + r.to(tl.int64) * bt_s0, bt_s1,
                         b_lo, b_hi, ic_ptr, ic_s0, ic_s1, num_pages, local_blocks,
                         initial_blocks, P, D, BLOCK_N, BLOCK_D, ROWS, CH, VEC, FP8, FMT, HW)
    if SPLIT:
        cols = tl.arange(0, BK)
        tile = rows.to(tl.int64)[:, None] * BK + cols[None, :]
        mine = part_ptr + (r * num_splits + s).to(tl.int64) * (ROWS * BK)
        tl.store(mine + tile, top.to(tl.int64, bitcast=True))
        tl.debug_barrier()  # every thread's partial list is stored before the ticket
        ticket = tl.atomic_add(cnt_ptr + r, 1, sem="acq_rel")
        if ticket == num_splits - 1:  # the last split of this request merges
            merged = ix.empty_list(ROWS, BK)
            for s2 in range(0, num_splits):
                theirs = part_ptr + (r * num_splits + s2).to(tl.int64) * (ROWS * BK)
                if VEC:
                    part = tl.load(theirs + tile, cache_modifier=".cg").to(tl.uint64,
                                                                           bitcast=True)
                    merged = ix.rank_merge(merged, part, BK)
                else:
                    for j in range(0, BK):
                        cand = tl.load(theirs + rows.to(tl.int64) * BK + j,
                                       cache_modifier=".cg").to(tl.uint64, bitcast=True)
                        merged = ix.insert(merged, cand, (cand >> 32) != 0)
            ix.write_list(merged, out_ptr, o_s0, o_s1, o_s2, heads, toks, row_in, topk, BK,
                          VEC)
            tl.atomic_xchg(cnt_ptr + r, 0)  # ready for the next call
    else:
        ix.write_list(top, out_ptr, o_s0, o_s1, o_s2, heads, toks, row_in, topk, BK, VEC)


#: True when the kernel runs in the (patched) CPU interpreter.
INTERPRETED = is_interpreted(_indexer_decode_kernel)


# ---------------------------------------------------------------------------- launcher


@functools.cache
def _sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def _splits(num_splits, b: int, width: int, dev) -> tuple[int, int]:
    """(S, blocks per split). Default: compiled, enough programs for two waves of the GPU's
    SMs with at least 8 blocks per split; interpreted, 2 (so the merge runs in CI)."""
    if num_splits is None:
        if INTERPRETED or dev.type != "cuda":
            num_splits = 2
        else:
            num_splits = triton.cdiv(2 * _sm_count(dev.index or 0), max(b, 1))
            num_splits = max(1, min(num_splits, triton.cdiv(width, 8)))
    s = check_int(num_splits, "num_splits", 1)
    bps = triton.cdiv(max(width, 1), min(s, max(width, 1)))
    return triton.cdiv(max(width, 1), bps), bps


def indexer_decode(index_q, index_cache, index_fmt, block_table, seq_lens, rows_per_request,
                   *, topk, local_blocks=1, initial_blocks=0, out=None, num_splits=None,
                   validate=False, block_n=None, block_d=None, blocks_per_step=None,
                   vec=None, num_warps=None):
    """Top-k key blocks of decode rows (SPEC.md s.5).

    index_q           ``[B * rows_per_request, Hi, D]`` request-major, in the index cache's
                      format (bf16/fp16, or uint8 fp8 codes); last dim contiguous.
    index_cache       ``[num_pages, P, D]``; index_fmt; block_table int32/int64 ``[B, W]``: as
                      ``kernels.indexer_prefill.indexer_prefill``.
    seq_lens          int32/int64 ``[B]``; row j of request r is at position
                      seq_lens[r] - rows_per_request + j; seq_lens[r] == 0 pads (all -1).
    rows_per_request  1..4.   topk 1..64, local_blocks, initial_blocks >= 0.
    out               int32 ``[Hi, B * rows, K]``, any strides (a transposed token-major
                      buffer too); allocated head-major when None.
    num_splits        key-block splits per request (default: see ``_splits``); S > 1 uses
                      a workspace of B * S * ROWS * BK int64 and B int32 counters.
    validate=True     host checks of contents (a sync): seq_lens 0 or >= rows_per_request,
                      block-table entries used in range, table wide enough.
    Returns ``out``. Tuning knobs as the prefill launcher's (no block_rows: a program
    always holds one request's rows)."""
    t, hi, d, page, num_pages, fp8, code, hw, k, loc, ini = ix.check_index_args(
        index_q, index_cache, index_fmt, block_table, seq_lens, topk, local_blocks,
        initial_blocks)
    dev = index_cache.device
    q_rows = check_int(rows_per_request, "rows_per_request", *DECODE_ROWS_RANGE)
    b, width = block_table.shape
    if t != b * q_rows:
        fail("index_q", f"must have B * rows_per_request = {b} * {q_rows} = {b * q_rows} rows "
                        f"(B from block_table / seq_lens), got {t}")
    out = ix.check_out(out, hi, t, k, dev)
    splits, bps = _splits(num_splits, b, width, dev)
    rows, bn, bd, ch, vec, bk = ix.strategy(
        q_rows * hi, hi, page, d, bps, k, INTERPRETED, None, block_n, block_d,
        blocks_per_step, vec)
    if rows < q_rows * hi:
        fail("blocks_per_step", f"leaves {rows} rows per program, fewer than "
                                f"rows_per_request * Hi = {q_rows * hi}")
    if validate:
        lens = seq_lens.detach().cpu()
        short = (lens != 0) & (lens < q_rows)
        if bool(short.any()):
            r = int(short.nonzero()[0, 0])
            fail("seq_lens", f"must be 0 (padding) or >= rows_per_request ({q_rows}), got "
                             f"seq_lens[{r}] = {int(lens[r])}")
        ix.validate_block_table(block_table, seq_lens, page, num_pages)
    if t == 0:
        return out
    split = splits > 1
    part = torch.empty((b, splits, rows, bk) if split else (1,), dtype=torch.int64,
                       device=dev)
    cnt = torch.zeros((b if split else 1,), dtype=torch.int32, device=dev)
    ensure_ready(_indexer_decode_kernel)
    _indexer_decode_kernel[(b, splits)](
        index_q, index_q.stride(0), index_q.stride(1),
        index_cache, index_cache.stride(0), index_cache.stride(1), num_pages,
        block_table, block_table.stride(0), block_table.stride(1), width, seq_lens, t,
        out, out.stride(0), out.stride(1), out.stride(2), part, cnt,
        hi, q_rows, k, loc, ini, bps, splits,
        P=page, D=d, BLOCK_N=bn, BLOCK_D=bd, ROWS=rows, BK=bk, CH=ch, VEC=vec, SPLIT=split,
        FP8=fp8, FMT=code, HW=hw, num_warps=num_warps or 4)
    return out


def compile_signatures():
    """(kernel, signature, constexprs) triples covering the constexpr branches, for the
    sm_90 compile check on the CPU (tests/test_compile_sm90.py)."""
    combos = [  # q/cache, P, D, BK, ROWS, SPLIT, FP8, FMT, HW, index dtype
        ("bf16", 128, 128, 16, 16, True, False, 0, False, "i32"),
        ("fp16", 16, 64, 1, 32, False, False, 0, False, "i64"),
        ("u8", 64, 256, 64, 32, True, True, 0, True, "i32"),
        ("u8", 32, 128, 8, 16, True, True, 2, False, "i64"),
    ]
    out = []
    for qt, page, d, bk, rows, split, fp8, fmt, hw, it in combos:
        sig = {name: "i32" for name in _indexer_decode_kernel.arg_names}
        for name in ("q_s0", "q_s1", "ic_s0", "ic_s1", "bt_s0", "bt_s1", "o_s0", "o_s1",
                     "o_s2"):
            sig[name] = "i64"
        sig.update(q_ptr=f"*{qt}", ic_ptr=f"*{qt}", bt_ptr=f"*{it}", seq_ptr=f"*{it}",
                   out_ptr="*i32", part_ptr="*i64", cnt_ptr="*i32")
        _, bn, bd, ch, vec, _ = ix.strategy(rows, 1, page, d, 1, bk, False)
        const = dict(P=page, D=d, BLOCK_N=bn, BLOCK_D=bd, ROWS=rows, BK=bk, CH=ch, VEC=vec,
                     SPLIT=split, FP8=fp8, FMT=fmt, HW=hw)
        sig.update(dict.fromkeys(const, "constexpr"))
        out.append((_indexer_decode_kernel, sig, const))
    return out


# ----------------------------------------------------------------------------- adapter


run = ix.adapter(indexer_decode, decode=True)


def _register():
    from oracle.registry import Implementation, register

    classes = ("tiny", "small") if INTERPRETED else ("tiny", "small", "model")
    register(Implementation(
        "triton", "indexer_decode", run, devices=("cpu", "cuda"), shape_classes=classes,
        score_rel=0.0,
        notes="one Triton launch: (request x key-block split) per program, all rows and "
              "heads of a request share each key block, fp32 ieee tl.dot on exactly widened "
              "q/k, running top-k by replace-min of 64-bit order keys, last split merges the "
              "partial lists (atomic ticket)"))


_register()
