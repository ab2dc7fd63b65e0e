"""Decode indexer in ONE Triton kernel (SPEC.md section 5; issue 7): block scores and top-k
selection for 1..4 query rows per request, fused, split over key blocks with an exact merge
of the partial top-k lists in the same launch.

Grid ``(B, S)``: program (r, s) owns all ``rows_per_request * Hi`` rows of request r (row j
of the request at position ``seq_lens[r] - rows_per_request + j``; all index heads) and
the key blocks ``s*BPS .. (s+1)*BPS - 1`` (BPS blocks per split), so every key block is read
once per request and shared by all its rows and heads. Selection keys: 64-bit order keys
(forced class, score, NaN, lower-id tie rule in one unsigned integer; kernels/_indexer.py).

Three scans (``scan=``):
- "mma", compiled default (``kernels._indexer.scan_blocks_mma``): each key block's scores
  by one tensor-core ``tl.dot`` of its whole tile ``[P, D]`` (keys along M: on sm_90 the
  tile goes from cp.async straight into ``wgmma``) by the rows' q padded to 16 rows; bf16 /
  fp16 as stored, the hardware fp8 formats on the fp8 tensor cores (``fp8_mma``), the fnuz
  formats decoded exactly to fp16. The MMA accumulation is not an IEEE fp32 sum: the
  registry declares ``score_rel`` per format (``MMA_SCORE_REL``, ``F8MMA_SCORE_REL``).
  Default grid: one wave of programs (``wave_splits``).
- "fma" (``kernels._indexer.scan_blocks_fma``): exact fp32 products in one FMA chain per
  key and thread over 16-byte-vector key tiles ``[LANES, BLOCK_N, M, V]`` pipelined by
  cp.async, q hoisted into registers (``fma_strategy`` widens the lanes along D until it
  fits 128 registers per thread); ``score_rel = 0``. A split of at most BK blocks puts each block's
  key into its own list column (no min-reduction per block); longer splits use
  replace-min.
- "dot" (interpreted default; the prefill kernel's strategy): tl.dot ieee tiles with ROWS
  >= 16 rows, replace-min compiled, rank merges interpreted (fast there).

Merge, in the same kernel (always for "fma", S > 1 for "dot"): each program stores its
lists to a workspace ``[B, S, ROWS, BK]`` int64, then takes a ticket from a per-request
counter (``atomic_add``, acq_rel, after a CTA barrier); the program that draws the last
ticket reads the S partial lists (L2 loads, ``.cg``), merges them (compiled: bitonic
``tl.topk`` of MC lists per step, ``kernels._indexer.merge_partials``; interpreted "dot":
rank merges), writes the selection in order and resets the counter to 0. Exact: valid
keys are unique per row, so the BK largest keys of the union of the partial lists are the
BK largest of the whole request, whatever the split or the order of arrival.

Rows of padded requests (seq_lens 0) select nothing: all -1. Scores ("fma", "dot"):
exact fp32 widening (fp8 via ``kernels.fp8.decode_fp8``), exact products, fp32
accumulation in another order than the reference's, inside the oracle's fp32 bound
(gamma(D) |q||k|, any order); "mma": exact products, the MMA's accumulation (declared).

Design numbers (model shape: Hi 4, 1 row, D 128, P 128, K 16; B 64 x 32k tokens; sm_90
static numbers from ``benchmarks/static_sm90.py``; H200 times from graph replay, copy
bandwidth 4.27 TB/s, ``reports/bench_indexer.json``), per key block and thread of 4 warps:

    =================  ===========================  =========================================
                       "fma" (LANES 4, BLOCK_N 32)  "mma" (whole blocks, STAGES 3)
    =================  ===========================  =========================================
    registers          bf16 233, e4m3 226           bf16 128, e4m3 (fp8 wgmma) 78
    shared memory      bf16 64 KB, e4m3 32 KB       bf16 68 KB, e4m3 35 KB (2 tiles)
    SASS per block     bf16 897, e4m3 945           bf16 296 (16 HGMMA), e4m3 269 (8 QGMMA)
    H200, B 64         bf16 281 us, e4m3 192 us     bf16 144 us (87%), e4m3 86.5 us (73%)
    =================  ===========================  =========================================

The knobs (``num_splits`` / ``blocks_per_split``, ``lanes_d``, ``block_n``, ``num_warps``,
``num_stages``, ``merge_chunk``, ``scan``) are for the GPU tuning run
(``python -m benchmarks.bench_indexer --tune``).

``indexer_decode(...)`` is the host launcher (ValueError naming the argument; contents
under ``validate=True``); ``run(inputs)`` is the oracle adapter registered as
implementation ``"triton"`` of op ``"indexer_decode"``.
"""

from __future__ import annotations

import functools

import torch

from kernels import _indexer as ix
from kernels import indexer_decode_flat as flat_grid
from kernels._host import (
    ORACLE_WORKSPACE,
    ORACLE_WORKSPACE_NOTES,
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
    is_interpreted,
    pdl_options,
    register_cap,
    resident_programs,
    tl,
    triton,
)
from kernels.fp8 import HW_FORMATS
from oracle.core.bounds import TENSOR_CORE_DOT_REL
from reference.domain import DECODE_ROWS_RANGE


# Counts and sizes vary from call to call: not specialised (one compile for every shape).
@triton.jit(do_not_specialize=[
    "num_pages", "width", "num_tokens", "hi", "q_rows", "topk", "local_blocks",
    "initial_blocks", "blocks_per_split", "num_splits"])
def _indexer_decode_kernel(
        q_ptr, q_s0, q_s1, ic_ptr, ic_s0, ic_s1, num_pages,
        bt_ptr, bt_s0, bt_s1, width, seq_ptr, num_tokens,
        out_ptr, o_s0, o_s1, o_s2, part_ptr, cnt_ptr, trace_ptr,
        hi, q_rows, topk, local_blocks, initial_blocks, blocks_per_split, num_splits,
        P: tl.constexpr, D: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
        ROWS: tl.constexpr, BK: tl.constexpr, CH: tl.constexpr, VEC: tl.constexpr,
        SPLIT: tl.constexpr, FP8: tl.constexpr, FMT: tl.constexpr, HW: tl.constexpr,
        FMA: tl.constexpr, HI: tl.constexpr, QR: tl.constexpr, LANES: tl.constexpr,
        STAGES: tl.constexpr, MC: tl.constexpr, PAIRS: tl.constexpr, DIRECT: tl.constexpr,
        CHAIN: tl.constexpr, MMA: tl.constexpr, F8MMA: tl.constexpr, MR: tl.constexpr,
        SORTED: tl.constexpr = False, TRACE: tl.constexpr = False, PDL: tl.constexpr = False):
    await_previous_kernel(PDL)
    r = tl.program_id(0)
    s = tl.program_id(1)
    trace_row = r * num_splits + s
    if TRACE:
        stamp(trace_ptr, trace_row, 1)
    seq = tl.load(seq_ptr + r).to(tl.int32)
    rows = tl.arange(0, ROWS)
    qr = rows // hi
    heads = rows % hi
    toks = r * q_rows + qr
    row_in = (rows < q_rows * hi) & (toks < num_tokens)
    pos = seq - q_rows + qr
    live = row_in & (seq > 0) & (pos >= 0)
    nb = tl.minimum(tl.where(seq > 0, (seq - 1) // P + 1, 0), width)
    b_lo = s * blocks_per_split
    b_hi = tl.minimum(b_lo + blocks_per_split, nb)
    if TRACE:
        stamp(trace_ptr, trace_row, 6)
    bt_row = bt_ptr + r.to(tl.int64) * bt_s0
    top = ix.empty_list(ROWS, BK)
    cols = tl.arange(0, BK)
    tile = rows.to(tl.int64)[:, None] * BK + cols[None, :]
    mine = part_ptr + (r * num_splits + s).to(tl.int64) * (ROWS * BK)
    if FMA or MMA:  # compiled (HI == hi, QR == q_rows); always through the workspace
        q_req = q_ptr + (r * QR).to(tl.int64) * q_s0
        if MMA:
            top = ix.scan_blocks_mma(top, q_req, q_s0, q_s1, r * QR, num_tokens, seq, bt_row,
                                     bt_s1, b_lo, b_hi, ic_ptr, ic_s0, ic_s1, num_pages,
                                     local_blocks, initial_blocks, P, D, HI, QR, ROWS, MR, CH,
                                     STAGES, FP8, FMT, HW, DIRECT, F8MMA)
        else:
            top = ix.scan_blocks_fma(top, q_req, q_s0, q_s1, r * QR, num_tokens, seq, bt_row,
                                     bt_s1, b_lo, b_hi, ic_ptr, ic_s0, ic_s1, num_pages,
                                     local_blocks, initial_blocks, P, D, HI, QR, ROWS, LANES,
                                     BLOCK_N, STAGES, FP8, FMT, HW, PAIRS, DIRECT, CHAIN)
        ix.store_partial(mine, top, rows, s, MC, SORTED)
        if TRACE:
            stamp(trace_ptr, trace_row, 2)
    else:
        q_ptrs = q_ptr + toks.to(tl.int64) * q_s0 + heads.to(tl.int64) * q_s1
        top = ix.scan_blocks(top, q_ptrs, pos, live, bt_row, bt_s1, b_lo, b_hi, ic_ptr, ic_s0,
                             ic_s1, num_pages, local_blocks, initial_blocks, P, D, BLOCK_N,
                             BLOCK_D, ROWS, CH, VEC, FP8, FMT, HW)
        if SPLIT:
            ix.store_partial(mine, top, rows, s, MC, SORTED and not VEC)
    if SPLIT or FMA or MMA:
        tl.debug_barrier()  # every thread's partial list is stored before the ticket
        ticket = tl.atomic_add(cnt_ptr + r, 1, sem="acq_rel")
        if ticket == num_splits - 1:  # the last split of this request merges
            first = part_ptr + (r * num_splits).to(tl.int64) * (ROWS * BK)
            if VEC:  # interpreted: rank merges, one partial list per step
                merged = ix.empty_list(ROWS, BK)
                for s2 in range(0, num_splits):
                    part = tl.load(first + s2 * (ROWS * BK) + tile,
                                   cache_modifier=".cg").to(tl.uint64, bitcast=True)
                    merged = ix.rank_merge(merged, part, BK)
                ix.write_list(merged, out_ptr, o_s0, o_s1, o_s2, heads, toks, row_in, topk,
                              BK, VEC)
            else:  # bitonic top-k of MC partial lists per step, written in order
                if TRACE:
                    stamp(trace_ptr, trace_row, 4)
                merged = ix.merge_partials(first, num_splits, rows, ROWS, BK, MC, SORTED)
                ix.write_sorted(merged, out_ptr, o_s0, o_s1, o_s2, heads, toks, row_in, topk,
                                BK)
                if TRACE:
                    stamp(trace_ptr, trace_row, 5)
            # Ready for the next launch: every ticket of this one is drawn, so a plain store
            # (no atomic round trip at the end of the critical path).
            tl.store(cnt_ptr + r, 0)
    else:
        ix.write_list(top, out_ptr, o_s0, o_s1, o_s2, heads, toks, row_in, topk, BK, VEC)
    if TRACE:
        stamp(trace_ptr, trace_row, 3)


#: True when the kernel runs in the (patched) CPU interpreter.
INTERPRETED = is_interpreted(_indexer_decode_kernel)


# ---------------------------------------------------------------------------- launcher


@functools.cache
def _sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


#: Default split (compiled): about this many programs per SM in total (several waves of
#: the ~2 programs an SM holds, so a short tail), never fewer than MIN_BLOCKS_PER_SPLIT
#: key blocks per program.
PROGRAMS_PER_SM = 8
MIN_BLOCKS_PER_SPLIT = 4
#: Default pipeline depth of the MMA scan's key tiles (``scan="mma"``).
MMA_STAGES = 3
#: The MMA scan's default grid: one wave of at most this many programs per SM
#: (``wave_splits``; more, though resident, made the H200 slower).
MAX_PROGRAMS_PER_SM = 4
#: Declared score error of the MMA scan beyond an IEEE fp32 sum (``score_rel``, relative to
#: sum |q_i k_i|): the tensor cores' truncating accumulation of 16-bit products
#: (``oracle.core.bounds.TENSOR_CORE_DOT_REL``, D <= 256).
MMA_SCORE_REL = TENSOR_CORE_DOT_REL
#: The same for the fp8 tensor-core products of the hardware formats (``fp8_mma``): Triton's
#: default fp8 ``wgmma`` accumulates in about 14 bits (DeepSeek-V3 measured ~14 on the
#: H800), ~2^-13 per k-step of 32, at most 8 steps at D 256: 2^-10, declared with a
#: factor 2 margin.
F8MMA_SCORE_REL = 2.0**-9


def fp8_mma(index_fmt: str) -> bool:
    """Whether the compiled MMA scan multiplies fp8 codes of this format directly (the
    hardware formats e4m3fn / e5m2) rather than their fp16 values."""
    return index_fmt in HW_FORMATS and not INTERPRETED


def score_rel(case) -> float:
    """The registered implementation's declared block-score error for a case (registry
    ``score_rel_for``): 0 interpreted (fp32 ieee dots), else the MMA scan's, fp8 or 16-bit
    by the case's index format."""
    if INTERPRETED:
        return 0.0
    if case is not None and fp8_mma(case["index_fmt"]):
        return F8MMA_SCORE_REL
    return MMA_SCORE_REL


def _splits(num_splits, blocks_per_split, b: int, width: int, dev, cap: int = 0
            ) -> tuple[int, int]:
    """(S, blocks per split). Either knob may be given, not both. Default: compiled,
    ``cdiv(B * width, PROGRAMS_PER_SM * SMs)`` blocks per split, at most ``cap`` (the FMA
    scan passes BK: a split of at most BK blocks keeps no running list) unless that is below
    MIN_BLOCKS_PER_SPLIT, at least MIN_BLOCKS_PER_SPLIT (model shape, B 64 x 256 blocks on
    132 SMs: 16 blocks, S = 16, 1024 programs); interpreted, S = 2 (so the merge runs in
    CI)."""
    w = max(width, 1)
    if num_splits is not None and blocks_per_split is not None:
        fail("blocks_per_split", "and num_splits are alternatives: pass one of them")
    if blocks_per_split is not None:
        bps = check_int(blocks_per_split, "blocks_per_split", 1)
    else:
        if num_splits is None:
            if INTERPRETED or dev.type != "cuda":
                num_splits = 2
            else:
                bps = triton.cdiv(max(b, 1) * w, PROGRAMS_PER_SM * _sm_count(dev.index or 0))
                if cap >= MIN_BLOCKS_PER_SPLIT:
                    bps = min(bps, cap)
                num_splits = triton.cdiv(w, max(bps, MIN_BLOCKS_PER_SPLIT))
        s = check_int(num_splits, "num_splits", 1)
        bps = triton.cdiv(w, min(s, w))
    return triton.cdiv(w, bps), bps


def wave_splits(slots: int, b: int, width: int) -> tuple[int, int]:
    """(S, blocks per split) of the compiled MMA scan's default: as many splits per request
    as fill ``slots`` programs in ONE wave (B x S <= slots: a second, partial wave is a tail
    that costs more than it hides), at least MIN_BLOCKS_PER_SPLIT blocks per split. The
    launcher passes the GPU's resident programs, at most MAX_PROGRAMS_PER_SM per SM. H200,
    model shape, B 64 (``reports/gpu-out/s6run*``): bf16 (3 resident per SM) S 2 / 4 / 6 /
    8 / 12 / 16: 202 / 147 / 144 / 173 / 153 / 159 us; e4m3 on fp8 tensor cores (6
    resident per SM) S 4 / 8 / 12 / 16: 106 / 86.5 / 109 / 102 us."""
    w = max(width, 1)
    s = max(1, min(slots // max(b, 1), w))
    bps = max(triton.cdiv(w, s), min(MIN_BLOCKS_PER_SPLIT, w))
    return triton.cdiv(w, bps), bps


def _fma_lanes(nr: int, d: int, v: int) -> int:
    """Default lanes along D: 4 (a warp then reads 64 contiguous bytes per key), more while
    the rows' q vectors would need more than 128 fp32 registers per thread (nr * d / lanes),
    at most d / v (one 16-byte vector per lane)."""
    lanes = 4
    while lanes < 32 and nr * d // lanes > 128:
        lanes *= 2
    return max(1, min(lanes, d // v))


def fma_strategy(nr: int, page: int, d: int, fp8: bool, lanes_d=None, block_n=None,
                 num_warps=None, num_stages=None):
    """(LANES, BLOCK_N, num_warps, STAGES) of the FMA scan (kernels/_indexer.py
    ``scan_blocks_fma``) for nr = rows_per_request * Hi rows; explicit values validated
    (ValueError naming them). BLOCK_N default: one key per thread per tile,
    (32 / LANES) * num_warps, at most P."""
    v = 16 if fp8 else 8
    warps = 4 if num_warps is None else ix.pow2_arg("num_warps", num_warps, 1)
    if lanes_d is None:
        lanes = _fma_lanes(nr, d, v)
    else:
        lanes = ix.pow2_arg("lanes_d", lanes_d, 1)
        if lanes > 32 or lanes * v > d:
            fail("lanes_d", f"must be a power of two <= min(32, D / {v} elements per 16-byte "
                            f"vector = {d // v}), got {lanes_d!r}")
    if block_n is None:
        bn = min(page, (32 // lanes) * warps)
    else:
        bn = ix.pow2_arg("block_n", block_n, 1)
        if bn > page:
            fail("block_n", f"must be a power of two <= P = {page}, got {block_n!r}")
    stages = 3 if num_stages is None else check_int(num_stages, "num_stages", 1)
    return lanes, bn, warps, stages


def _check_grid(grid, num_programs, scan, num_splits, blocks_per_split, blocks_per_step
                ) -> bool:
    """Whether the launch uses the flat kernel (grid "flat" or "proportional"); its knobs
    checked (ValueError naming them)."""
    if grid not in (None, "split", "flat", "proportional"):
        fail("grid", f"must be 'split', 'flat' or 'proportional', got {grid!r}")
    if grid in (None, "split"):
        if num_programs is not None:
            fail("num_programs", "applies to grid='flat' or 'proportional' only")
        return False
    for name, v in (("num_splits", num_splits), ("blocks_per_split", blocks_per_split),
                    ("blocks_per_step", blocks_per_step)):
        if v is not None:
            fail(name, f"does not apply to grid={grid!r} (its programs share out the whole "
                       f"batch's blocks)")
    if scan not in (None, "mma"):
        fail("scan", f"grid={grid!r} runs the 'mma' scan only, got {scan!r}")
    if num_programs is not None:
        check_int(num_programs, "num_programs", 1)
    return True


def _launch_flat(num_programs, index_q, index_cache, block_table, seq_lens, out, k, loc, ini,
                 trace, dev, merge_chunk, workspace, const):
    """The flat grid's launch: G programs (default: one wave of resident programs,
    compiled, under a register cap when needed so that as many programs share an SM as
    its shared memory allows, at most MAX_PROGRAMS_PER_SM (sm_90, model shape: e4m3 114
    registers, 4 per SM, bf16 133, 3 per SM, as the split grid: no cap); 3 interpreted, so
    ranges straddle requests in CI), the merge chunk (default min(next_pow2(workspace
    slots), flat_grid.MERGE_CHUNK, 256 / BK))."""
    kernel = flat_grid._indexer_decode_flat_kernel
    bk = const["BK"]
    if merge_chunk is None:
        const["MC"] = min(triton.next_power_of_2(flat_grid.workspace_slots(
            block_table.shape[1])), flat_grid.MERGE_CHUNK, max(1, 256 // bk))
    else:
        const["MC"] = ix.pow2_arg("merge_chunk", merge_chunk, 1)
    ensure_ready(kernel)
    g = num_programs
    if g is None:
        if INTERPRETED or dev.type != "cuda":
            g = 3
        else:
            probe = torch.empty(1, dtype=torch.int64, device=dev)
            args = flat_grid.kernel_args(index_q, index_cache, block_table, seq_lens, out,
                                         probe, probe.int(), None, k, loc, ini, 2)
            cap = register_cap(kernel, args, const, dev, MAX_PROGRAMS_PER_SM)
            if cap is not None:
                const["maxnreg"] = cap
            g = min(resident_programs(kernel, args, const, dev),
                    MAX_PROGRAMS_PER_SM * _sm_count(dev.index or 0))
    if const["PROP"]:  # one assignment per program at most (the kernel does not loop)
        g = max(g, block_table.shape[0])
    check_trace(trace, g, INTERPRETED, dev)
    if index_q.shape[0] == 0:
        return out
    return flat_grid.launch(g, index_q, index_cache, block_table, seq_lens, out, k, loc, ini,
                            const, trace, workspace)


def indexer_decode(index_q, index_cache, index_fmt, block_table, seq_lens, rows_per_request,
                   *, topk, local_blocks=1, initial_blocks=0, out=None, num_splits=None,
                   blocks_per_split=None, validate=False, scan=None, lanes_d=None,
                   block_n=None, num_warps=None, num_stages=None, merge_chunk=None, merge=None,
                   pairs=None, fma_chain=None, block_d=None, blocks_per_step=None, vec=None,
                   grid=None, num_programs=None, trace=None, workspace=None, pdl=False):
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
    num_splits / blocks_per_split
                      key-block split of each request (one of them; default: see
                      ``_splits``); S > 1 uses a workspace of B * S * ROWS * BK int64 and B
                      int32 counters.
    validate=True     host checks of contents (a sync): seq_lens 0 or >= rows_per_request,
                      block-table entries used in range, table wide enough, a workspace's
                      counters all zero.
    Returns ``out``.

    Tuning knobs (ValueError naming them when invalid):
    scan              "mma" (compiled default: ``kernels._indexer.scan_blocks_mma``, one
                      tensor-core dot per key block; its knobs num_warps, num_stages and
                      blocks_per_step 1, 2 or 4: blocks stacked in one dot), "fma"
                      (``scan_blocks_fma``, exact fp32 FMA chains, no padded rows,
                      cp.async-pipelined key tiles) or "dot" (interpreted default:
                      ``scan_blocks``, the prefill kernel's strategy; its knobs block_n,
                      block_d, blocks_per_step, vec as there).
    lanes_d, block_n, num_warps, num_stages
                      "fma": lanes along D, keys per tile, warps, pipeline stages of the
                      block loop (see ``fma_strategy``).
    pairs             "fma", bf16 cache: read keys as int32 pairs (default: when the cache's
                      address and page / row strides allow 4-byte words).
    fma_chain         "fma": each thread's products of a key as one FMA chain (a tuple
                      reduction; default compiled) or ``tl.sum`` of products (default
                      interpreted, where the chain's combine runs element by element).
    merge_chunk       partial lists merged per step by the last split (power of two;
                      default min(next_pow2(S), 256 / BK)); not with vec.
    merge             the partial lists' merge (compiled): "sorted" (default: each split
                      sorts its list, ``kernels._indexer.store_partial``, and the last one
                      runs the bitonic top-k's last steps alone) or "topk" (the whole
                      ``tl.topk`` of unsorted lists).
    grid              "split" (default: program (r, s) per request and key-block split) or
                      "flat" (``kernels/indexer_decode_flat.py``: the batch's key blocks
                      laid end to end and shared out evenly over ``num_programs`` programs,
                      default one wave; the "mma" scan; not with num_splits,
                      blocks_per_split, blocks_per_step). For batches of mixed lengths:
                      the split grid sizes its splits by the table's width, so a short
                      request's programs idle (H200, batch 64, e4m3, contexts 4k-60k:
                      flat 77.5 us, split 97.0); on uniform lengths the split grid is
                      faster (71.0 against 78.9 at 32k). Not chosen automatically: the
                      lengths are on the device (a host sync to look).
                      "proportional" (the same kernel): each request cut into its own
                      programs, cdiv(nb_r, U) of them with U the fewest blocks per program
                      that fit the grid (searched in the kernel), so no program straddles
                      two requests and the uniform model shape gets the split grid's
                      partition (64 x 8 programs of 32 blocks); at least B programs
                      (``num_programs`` raised to B), so each program scans one segment,
                      inlined. H200 (session 23): ragged e4m3 78.1 us, bf16 136.8 (as the
                      flat grid); uniform 32k 75.1 / 135.7, ~6% behind the split grid (a
                      1.6 us set-up over seq_lens, ~2 us slower scans).
    trace             a diagnostic (``kernels._trace``, compiled "mma" / "fma" scans): an
                      int64 buffer ``[>= B * S, TRACE_SLOTS]``; program (r, s) writes row
                      r * S + s: its SM, then the timer at its start (slot 1), when it
                      knows its key blocks (6; the flat kernel: after its partition's
                      arithmetic over seq_lens), after its scan (partial list stored, 2)
                      and at its end (3; after the merge, if it drew the last ticket); the
                      merging program also when it drew the ticket (4) and when the merged
                      list was written (5).
    workspace         a ``kernels._host.Workspace`` kept across calls (its ticket counters
                      stay zero between launches, its partial lists are reused): no
                      allocation and no counter fill per call, as a server runs; one per
                      stream of concurrent calls. None (default): fresh buffers per call.
    pdl               programmatic dependent launch (``kernels._triton.
                      await_previous_kernel``; compiled, sm_90): the launch may start
                      while the stream's previous kernel finishes, its programs waiting
                      for it before touching memory. A no-op interpreted."""
    workspace = check_workspace(workspace)
    pdl_kw = pdl_options(pdl, INTERPRETED)
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
    flat = _check_grid(grid, num_programs, scan, num_splits, blocks_per_split,
                       blocks_per_step)
    if scan is None:
        scan = "mma" if flat else "dot" if INTERPRETED or vec else "mma"
    if scan not in ("fma", "dot", "mma"):
        fail("scan", f"must be 'fma', 'mma' or 'dot', got {scan!r}")
    nr = q_rows * hi
    fma = scan == "fma"
    mma = scan == "mma"
    bk = triton.next_power_of_2(k)
    wave = mma and num_splits is None and blocks_per_split is None and not INTERPRETED \
        and dev.type == "cuda" and not flat
    # The flat grid sizes its ranges itself (_launch_flat); the wave grid after compiling.
    splits, bps = (0, 0) if wave or flat else _splits(num_splits, blocks_per_split, b, width,
                                                      dev, bk if fma or mma else 0)
    chain = False
    if mma:
        for name, v in (("block_d", block_d), ("vec", vec), ("lanes_d", lanes_d),
                        ("block_n", block_n), ("pairs", pairs), ("fma_chain", fma_chain)):
            if v is not None:
                fail(name, "does not apply to scan='mma' (whole key blocks per tl.dot)")
        warps = 4 if num_warps is None else ix.pow2_arg("num_warps", num_warps, 1)
        stages = MMA_STAGES if num_stages is None else check_int(num_stages, "num_stages", 1)
        ch = 1 if blocks_per_step is None else ix.pow2_arg("blocks_per_step",
                                                            blocks_per_step, 1)
        if ch > 4:
            fail("blocks_per_step", f"must be 1, 2 or 4 with scan='mma', got {ch}")
        rows, bn, bd, vec, lanes = triton.next_power_of_2(nr), page, d, False, 1
    elif fma:
        for name, v in (("block_d", block_d), ("blocks_per_step", blocks_per_step)):
            if v is not None:
                fail(name, "applies to scan='dot' only")
        if vec:
            fail("vec", "applies to scan='dot' only (the FMA scan's lists merge by bitonic "
                        "top-k)")
        lanes, bn, warps, stages = fma_strategy(nr, page, d, fp8, lanes_d, block_n, num_warps,
                                                num_stages)
        rows, bd, ch, vec = triton.next_power_of_2(nr), d, 1, False
        words = (index_fmt == "bfloat16" and index_cache.data_ptr() % 4 == 0
                 and index_cache.stride(0) % 2 == 0 and index_cache.stride(1) % 2 == 0)
        chain = not INTERPRETED if fma_chain is None else fma_chain
        if chain not in (True, False):
            fail("fma_chain", f"must be a bool, got {fma_chain!r}")
        if pairs is None:
            pairs = words
        elif pairs not in (True, False) or (pairs and not words):
            fail("pairs", f"must be a bool, True only for a bf16 cache with a 4-byte aligned "
                          f"address and even page / row strides, got {pairs!r}")
    else:
        for name, v in (("lanes_d", lanes_d), ("num_stages", num_stages), ("pairs", pairs),
                        ("fma_chain", fma_chain)):
            if v is not None:
                fail(name, "applies to scan='fma' only")
        rows, bn, bd, ch, vec, bk = ix.strategy(
            nr, hi, page, d, bps, k, INTERPRETED, None, block_n, block_d, blocks_per_step, vec)
        if rows < nr:
            fail("blocks_per_step", f"leaves {rows} rows per program, fewer than "
                                    f"rows_per_request * Hi = {nr}")
        lanes, stages = 1, 1
        warps = 4 if num_warps is None else ix.pow2_arg("num_warps", num_warps, 1)
    if merge_chunk is None:
        mc = min(triton.next_power_of_2(max(splits, 1)), max(1, 256 // bk))
    else:
        mc = ix.pow2_arg("merge_chunk", merge_chunk, 1)
        if vec:
            fail("merge_chunk", "does not apply with vec=True (rank merges)")
    if merge not in (None, "sorted", "topk"):
        fail("merge", f"must be 'sorted' or 'topk', got {merge!r}")
    if merge is not None and vec:
        fail("merge", "does not apply with vec=True (rank merges)")
    sort = merge != "topk"
    if validate:
        lens = seq_lens.detach().cpu()
        short = (lens != 0) & (lens < q_rows)
        if bool(short.any()):
            r = int(short.nonzero()[0, 0])
            fail("seq_lens", f"must be 0 (padding) or >= rows_per_request ({q_rows}), got "
                             f"seq_lens[{r}] = {int(lens[r])}")
        ix.validate_block_table(block_table, seq_lens, page, num_pages)
        if workspace is not None:
            workspace.check_counters()
    if t == 0:
        return out

    def call(splits, bps, part, cnt, trace=None):
        args = (index_q, index_q.stride(0), index_q.stride(1),
                index_cache, index_cache.stride(0), index_cache.stride(1), num_pages,
                block_table, block_table.stride(0), block_table.stride(1), width, seq_lens, t,
                out, out.stride(0), out.stride(1), out.stride(2), part, cnt,
                cnt if trace is None else trace, hi, q_rows, k, loc, ini, bps, splits)
        const = dict(P=page, D=d, BLOCK_N=bn, BLOCK_D=bd, ROWS=rows, BK=bk, CH=ch, VEC=vec,
                     SPLIT=splits > 1, FP8=fp8, FMT=code, HW=hw, FMA=fma,
                     HI=hi if fma or mma else 1, QR=q_rows if fma or mma else 1, LANES=lanes,
                     STAGES=stages, MC=mc, PAIRS=bool(fma and pairs),
                     DIRECT=(fma or mma) and bps <= bk, CHAIN=chain, MMA=mma,
                     F8MMA=mma and fp8_mma(index_fmt), MR=max(16, rows), SORTED=sort,
                     num_warps=warps)
        if trace is not None:
            const["TRACE"] = True
        return args, const

    if flat:
        return _launch_flat(num_programs, index_q, index_cache, block_table, seq_lens, out, k,
                            loc, ini, trace, dev, merge_chunk, workspace,
                            dict(P=page, D=d, ROWS=rows, BK=bk, FP8=fp8, FMT=code, HW=hw,
                                 HI=hi, QR=q_rows, STAGES=stages, F8MMA=fp8_mma(index_fmt),
                                 MR=max(16, rows), MIN_BLOCKS=flat_grid.MIN_BLOCKS,
                                 RB=flat_grid.tile_requests(b, grid == "proportional"),
                                 SORTED=sort, PROP=grid == "proportional",
                                 num_warps=warps, **pdl_kw))
    ensure_ready(_indexer_decode_kernel)
    if wave:  # one full wave of programs (``wave_splits``), sized from the compiled kernel
        cap = MAX_PROGRAMS_PER_SM * _sm_count(dev.index or 0)
        # Probe with the split the cap alone gives: the launch's own constexprs (MC, DIRECT,
        # SPLIT) unless the occupancy lowers the split, so one compile per shape, not two.
        splits, bps = wave_splits(cap, b, width)
        if merge_chunk is None:
            mc = min(triton.next_power_of_2(splits), max(1, 256 // bk))
        tmpl = call(splits, bps, torch.empty(1, dtype=torch.int64, device=dev),
                    torch.empty(1, dtype=torch.int32, device=dev))
        slots = min(resident_programs(_indexer_decode_kernel, tmpl[0], {**tmpl[1], **pdl_kw},
                                      dev), cap)
        splits, bps = wave_splits(slots, b, width)
        if merge_chunk is None:
            mc = min(triton.next_power_of_2(splits), max(1, 256 // bk))
    ws = splits > 1 or fma or mma  # the FMA/MMA scans always merge through the workspace
    if trace is not None and not (fma or mma):
        fail("trace", "applies to the compiled 'mma' and 'fma' scans only")
    check_trace(trace, b * splits, INTERPRETED, dev)
    part = take_scratch(workspace, "index_partials", (b, splits, rows, bk) if ws else (1,),
                        torch.int64, dev)
    cnt = take_counters(workspace, b if ws else 1, dev)
    args, const = call(splits, bps, part, cnt, trace)
    _indexer_decode_kernel[(b, splits)](*args, **const, **pdl_kw)
    return out


def _signature(kernel, qt: str, it: str) -> dict:
    """The runtime arguments' types of the split or flat kernel: q / cache elements qt,
    block table and seq_lens it, 64-bit strides, the rest int32."""
    sig = {name: "i32" for name in kernel.arg_names}
    for name in ("q_s0", "q_s1", "ic_s0", "ic_s1", "bt_s0", "bt_s1", "o_s0", "o_s1", "o_s2"):
        sig[name] = "i64"
    sig.update(q_ptr=f"*{qt}", ic_ptr=f"*{qt}", bt_ptr=f"*{it}", seq_ptr=f"*{it}",
               out_ptr="*i32", part_ptr="*i64", cnt_ptr="*i32", trace_ptr="*i64")
    return sig


#: Compiled cases whose tensor-core dots ptxas serialises (C7510; checked by
#: tests/test_compile_sm90.py): the flat grid's ranges call their segments (a loop of
#: segments inlined costs ~100 registers), the call serialises the scan's wgmma.
SERIALISED_WGMMA = (("_indexer_decode_flat_kernel", {"PROP": False}),)


def compile_signatures():
    """(kernel, signature, constexprs) triples covering the constexpr branches, for the
    sm_90 compile check on the CPU (tests/test_compile_sm90.py)."""
    # BK 1 merges 2 lists (tl.topk of k = 1 on one row broke the compiled merge once).
    combos = [  # q/cache, P, D, BK, rows (Hi x rows/request), SPLIT, FP8, FMT, HW, index, scan
        ("bf16", 128, 128, 16, (4, 1), True, False, 0, False, "i32", "fma"),  # model shape
        ("u8", 128, 128, 16, (4, 1), True, True, 0, True, "i32", "fma"),  # model, e4m3
        ("fp16", 16, 64, 1, (3, 4), False, False, 0, False, "i64", "fma"),
        ("u8", 16, 64, 1, (1, 1), True, True, 0, True, "i64", "fma"),  # one row, K = 1
        ("u8", 32, 256, 64, (8, 1), True, True, 2, False, "i64", "fma"),
        ("bf16", 128, 128, 16, (4, 1), True, False, 0, False, "i32", "mma"),  # model shape
        ("u8", 128, 128, 16, (4, 1), True, True, 0, True, "i32", "mma"),  # model, e4m3
        ("fp16", 16, 64, 1, (3, 4), False, False, 0, False, "i64", "mma"),
        ("u8", 32, 256, 64, (8, 1), True, True, 3, False, "i64", "mma"),
        ("bf16", 128, 128, 16, (16, 1), True, False, 0, False, "i32", "dot"),
        ("fp16", 16, 64, 1, (32, 1), False, False, 0, False, "i64", "dot"),
        ("u8", 64, 256, 64, (32, 1), True, True, 0, True, "i32", "dot"),
        ("u8", 32, 128, 8, (16, 1), True, True, 2, False, "i64", "dot"),
    ]
    out = []
    for qt, page, d, bk, (hi, qr), split, fp8, fmt, hw, it, scan in combos:
        sig = _signature(_indexer_decode_kernel, qt, it)
        fma, mma = scan == "fma", scan == "mma"
        if fma:
            lanes, bn, _, stages = fma_strategy(hi * qr, page, d, fp8)
            rows, bd, ch, vec = triton.next_power_of_2(hi * qr), d, 1, False
        elif mma:
            lanes, bn, stages = 1, page, MMA_STAGES
            rows, bd, ch, vec = triton.next_power_of_2(hi * qr), d, 1, False
        else:
            rows, bn, bd, ch, vec, _ = ix.strategy(hi, 1, page, d, 1, bk, False)
            lanes, stages, hi, qr = 1, 1, 1, 1
        const = dict(P=page, D=d, BLOCK_N=bn, BLOCK_D=bd, ROWS=rows, BK=bk, CH=ch, VEC=vec,
                     SPLIT=split, FP8=fp8, FMT=fmt, HW=hw, FMA=fma, HI=hi, QR=qr, LANES=lanes,
                     STAGES=stages, MC=2 if bk == 1 else 256 // bk, PAIRS=fma and qt == "bf16",
                     DIRECT=(fma or mma) and split, CHAIN=fma, MMA=mma,
                     F8MMA=mma and fp8 and hw, MR=max(16, rows), SORTED=True, TRACE=False)
        sig.update(dict.fromkeys(const, "constexpr"))
        out.append((_indexer_decode_kernel, sig, const))
    # The timeline diagnostic (kernels._trace) on the model shape's e4m3 MMA scan.
    kernel, sig, const = out[6]
    out.append((kernel, sig, {**const, "TRACE": True}))
    out += _flat_signatures()
    # Programmatic dependent launch (the ``pdl`` knob) on the model shape's e4m3 split and
    # proportional kernels (last, so the picks above keep their numbers).
    return out + [(k, s, {**c, "PDL": True}) for k, s, c in (out[6], out[19])]


def _flat_signatures():
    """The flat grid's kernel (``kernels/indexer_decode_flat.py``): the model shape in
    bf16 and e4m3 (fp8 tensor cores, traced too), an fnuz cache (fp16 operands) with 8
    rows, K 64 and 64-bit tables; the proportional partition at the model shape (batch 64
    in one tile) and with a 1024-request tile."""
    kernel = flat_grid._indexer_decode_flat_kernel
    combos = [  # q/cache, P, D, BK, Hi, rows, FP8, FMT, HW, index, trace, proportional RB
        ("bf16", 128, 128, 16, 4, 1, False, 0, False, "i32", False, 0),
        ("u8", 128, 128, 16, 4, 1, True, 0, True, "i32", False, 0),
        ("u8", 128, 128, 16, 4, 1, True, 0, True, "i32", True, 0),
        ("u8", 32, 256, 64, 2, 4, True, 3, False, "i64", False, 0),
        ("bf16", 128, 128, 16, 4, 1, False, 0, False, "i32", False, 64),
        ("u8", 128, 128, 16, 4, 1, True, 0, True, "i32", False, 64),
        ("u8", 128, 128, 16, 4, 1, True, 0, True, "i32", True, 64),
        ("u8", 128, 128, 16, 4, 1, True, 0, True, "i32", False, 1024),
    ]
    out = []
    for qt, page, d, bk, hi, qr, fp8, fmt, hw, it, trace, prop in combos:
        sig = _signature(kernel, qt, it)
        rows = triton.next_power_of_2(hi * qr)
        const = dict(P=page, D=d, ROWS=rows, BK=bk, FP8=fp8, FMT=fmt, HW=hw, HI=hi, QR=qr,
                     STAGES=MMA_STAGES, MC=min(flat_grid.MERGE_CHUNK, 256 // bk),
                     F8MMA=fp8 and hw,
                     MR=max(16, rows), MIN_BLOCKS=flat_grid.MIN_BLOCKS,
                     RB=prop or flat_grid.RB, SORTED=True, PROP=bool(prop), TRACE=trace)
        sig.update(dict.fromkeys(const, "constexpr"))
        out.append((kernel, sig, const))
    return out


# ----------------------------------------------------------------------------- adapter


run = ix.adapter(indexer_decode, decode=True)
run_flat = ix.adapter(functools.partial(indexer_decode, grid="flat"), decode=True)
run_proportional = ix.adapter(functools.partial(indexer_decode, grid="proportional"),
                              decode=True)
run_workspace = ix.adapter(functools.partial(indexer_decode, workspace=ORACLE_WORKSPACE),
                           decode=True)


def _register():
    from oracle.core.registry import Implementation, register

    classes = ("tiny", "small") if INTERPRETED else ("tiny", "small", "model", "long")
    register(Implementation(
        "triton", "indexer_decode", run, devices=("cpu", "cuda"), shape_classes=classes,
        score_rel=score_rel,
        notes="one Triton launch: (request x key-block split) per program, all rows and "
              "heads of a request share each key block; compiled: one tensor-core tl.dot "
              "per key block on 16-bit operands (fp8 decoded exactly to fp16), fp32 MMA "
              "accumulation (score_rel declared), cp.async-pipelined key tiles; "
              "interpreted: fp32 ieee tl.dot; 64-bit order keys per block, the last split "
              "merges the partial lists by bitonic top-k (atomic ticket)"))
    # The flat kernel's partitions on the GPU (the interpreter tests cover them on the
    # CPU): the same kernel arithmetic over other partitions of the key blocks.
    for name, fn, notes in (
            ("triton_flat", run_flat,
             "indexer_decode(grid='flat'): the batch's key blocks laid end to end and shared "
             "out evenly over one wave of programs (ranges straddle requests), the MMA scan "
             "per request segment, the last program of a request merges"),
            ("triton_proportional", run_proportional,
             "indexer_decode(grid='proportional'): one wave of programs, each request cut "
             "into cdiv(blocks, U) of them (U searched in the kernel so they fit), the MMA "
             "scan per program, the last program of a request merges")):
        register(Implementation(name, "indexer_decode", fn, devices=("cuda",),
                                shape_classes=("tiny", "small", "model", "long"),
                                score_rel=score_rel, notes=notes))
    register(Implementation(
        "triton_workspace", "indexer_decode", run_workspace, devices=("cuda",),
        shape_classes=("tiny", "small"), score_rel=score_rel,
        notes=ORACLE_WORKSPACE_NOTES))


_register()
