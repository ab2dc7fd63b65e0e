"""Decode indexer in ONE Triton kernel (contract.md section 5): block scores and top-k
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
  registry declares ``score_rel`` per format (oracle/impls/triton.py).
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

The MMA scan is the compiled default: at the model shape it takes about half the FMA
scan's registers and a third of its instructions per key block (docs/tuning.md).

The knobs (``num_splits`` / ``blocks_per_split``, ``lanes_d``, ``block_n``, ``num_warps``,
``num_stages``, ``merge_chunk``, ``scan``) are for the GPU tuning run
(``python -m benchmarks.bench_indexer --tune``).

``indexer_decode(...)`` is the host launcher (ValueError naming the argument; contents
under ``validate=True``); oracle/impls/triton.py registers it as implementation
``"triton"`` of op ``"indexer_decode"``, with its declared ``score_rel``.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from kernels import _indexer as ix
from kernels import indexer_decode_flat as flat_grid
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
    is_interpreted,
    pdl_options,
    register_cap,
    resident_programs,
    tl,
    triton,
)
from kernels.fp8 import HW_FORMATS
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
#: (``wave_splits``; more, though resident, are slower).
MAX_PROGRAMS_PER_SM = 4


def fp8_mma(index_fmt: str) -> bool:
    """Whether the compiled MMA scan multiplies fp8 codes of this format directly (the
    hardware formats e4m3fn / e5m2) rather than their fp16 values."""
    return index_fmt in HW_FORMATS and not INTERPRETED


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
    launcher passes the GPU's resident programs, at most MAX_PROGRAMS_PER_SM per SM."""
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


@dataclass
class _DecodePlan:
    """The decode launch's checked shapes and chosen strategy: every constexpr but those
    that depend on the split (``_decode_const`` adds them)."""

    t: int
    hi: int
    d: int
    page: int
    num_pages: int
    fp8: bool
    code: int
    hw: bool
    k: int
    loc: int
    ini: int
    q_rows: int
    b: int
    width: int
    scan: str = "dot"
    rows: int = 0
    bn: int = 0
    bd: int = 0
    ch: int = 1
    vec: bool = False
    lanes: int = 1
    warps: int = 4
    stages: int = 1
    chain: bool = False
    pairs: bool = False
    bk: int = 0
    splits: int = 0
    bps: int = 0
    mc: int = 1
    sort: bool = True

    @property
    def fma(self) -> bool:
        return self.scan == "fma"

    @property
    def mma(self) -> bool:
        return self.scan == "mma"


def indexer_decode(index_q, index_cache, index_fmt, block_table, seq_lens, rows_per_request,
                   *, topk, local_blocks=1, initial_blocks=0, out=None, num_splits=None,
                   blocks_per_split=None, validate=False, scan=None, lanes_d=None,
                   block_n=None, num_warps=None, num_stages=None, merge_chunk=None, merge=None,
                   pairs=None, fma_chain=None, block_d=None, blocks_per_step=None, vec=None,
                   grid=None, num_programs=None, trace=None, workspace=None, pdl=False):
    """Top-k key blocks of decode rows (contract.md s.5).

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

    Tuning knobs (ValueError naming them when invalid): the scan and its knobs (scan,
    lanes_d, block_n, block_d, num_warps, num_stages, blocks_per_step, vec, pairs,
    fma_chain: ``_plan_scan``), the merge (merge_chunk, merge: ``_plan_merge``), the grid
    (grid, num_programs: ``_check_grid``), ``trace`` (``kernels._trace``), ``workspace``
    (``_launch_split``) and ``pdl`` (``kernels._triton.pdl_options``)."""
    workspace = check_workspace(workspace)
    pdl_kw = pdl_options(pdl, INTERPRETED)
    p, out = _check_decode_args(index_q, index_cache, index_fmt, block_table, seq_lens,
                                rows_per_request, topk, local_blocks, initial_blocks, out)
    dev = index_cache.device
    flat = _check_grid(grid, num_programs, scan, num_splits, blocks_per_split,
                       blocks_per_step)
    if scan is None:
        scan = "mma" if flat else "dot" if INTERPRETED or vec else "mma"
    if scan not in ("fma", "dot", "mma"):
        fail("scan", f"must be 'fma', 'mma' or 'dot', got {scan!r}")
    p.scan, p.bk = scan, triton.next_power_of_2(p.k)
    wave = p.mma and num_splits is None and blocks_per_split is None and not INTERPRETED \
        and dev.type == "cuda" and not flat
    # The flat grid sizes its ranges itself (_launch_flat); the wave grid after compiling.
    p.splits, p.bps = (0, 0) if wave or flat else _splits(
        num_splits, blocks_per_split, p.b, p.width, dev, p.bk if p.fma or p.mma else 0)
    _plan_scan(p, index_fmt, index_cache, lanes_d, block_n, block_d, num_warps, num_stages,
               blocks_per_step, vec, pairs, fma_chain)
    _plan_merge(p, merge_chunk, merge)
    if validate:
        _validate_decode(p, block_table, seq_lens, workspace)
    if p.t == 0:
        return out
    if flat:
        const = _flat_const(p, index_fmt, grid)
        return _launch_flat(num_programs, index_q, index_cache, block_table, seq_lens, out,
                            p.k, p.loc, p.ini, trace, dev, merge_chunk, workspace,
                            dict(const, **pdl_kw))
    return _launch_split(p, wave, merge_chunk, index_q, index_cache, index_fmt, block_table,
                         seq_lens, out, trace, workspace, pdl_kw)


def _check_decode_args(index_q, index_cache, index_fmt, block_table, seq_lens,
                       rows_per_request, topk, local_blocks, initial_blocks, out):
    """(plan with the checked shapes, out): the indexer's common checks, then
    rows_per_request and index_q's row count against the batch."""
    t, hi, d, page, num_pages, fp8, code, hw, k, loc, ini = ix.check_index_args(
        index_q, index_cache, index_fmt, block_table, seq_lens, topk, local_blocks,
        initial_blocks)
    q_rows = check_int(rows_per_request, "rows_per_request", *DECODE_ROWS_RANGE)
    b, width = block_table.shape
    if t != b * q_rows:
        fail("index_q", f"must have B * rows_per_request = {b} * {q_rows} = {b * q_rows} rows "
                        f"(B from block_table / seq_lens), got {t}")
    out = ix.check_out(out, hi, t, k, index_cache.device)
    return _DecodePlan(t, hi, d, page, num_pages, fp8, code, hw, k, loc, ini, q_rows, b,
                       width), out


def _plan_scan(p, index_fmt, index_cache, lanes_d, block_n, block_d, num_warps, num_stages,
               blocks_per_step, vec, pairs, fma_chain):
    """The scan's tiles and knobs, each knob checked against the scan it applies to.

    "mma"  whole key blocks per ``tl.dot``: num_warps, num_stages (default ``MMA_STAGES``),
           blocks_per_step 1, 2 or 4 (blocks stacked in one dot).
    "fma"  exact fp32 FMA chains (``fma_strategy``: lanes_d, block_n, num_warps,
           num_stages); pairs: a bf16 cache read as int32 pairs (default: when the address
           and page / row strides allow 4-byte words); fma_chain: each thread's products
           as one FMA chain (default compiled) or ``tl.sum`` (default interpreted, where
           the chain's combine runs element by element).
    "dot"  the prefill kernel's strategy (``kernels._indexer.strategy``: block_n, block_d,
           blocks_per_step, vec), num_warps."""
    nr = p.q_rows * p.hi
    if p.mma:
        for name, v in (("block_d", block_d), ("vec", vec), ("lanes_d", lanes_d),
                        ("block_n", block_n), ("pairs", pairs), ("fma_chain", fma_chain)):
            if v is not None:
                fail(name, "does not apply to scan='mma' (whole key blocks per tl.dot)")
        p.warps = 4 if num_warps is None else ix.pow2_arg("num_warps", num_warps, 1)
        p.stages = MMA_STAGES if num_stages is None else check_int(num_stages, "num_stages", 1)
        p.ch = 1 if blocks_per_step is None else ix.pow2_arg("blocks_per_step",
                                                              blocks_per_step, 1)
        if p.ch > 4:
            fail("blocks_per_step", f"must be 1, 2 or 4 with scan='mma', got {p.ch}")
        p.rows, p.bn, p.bd, p.vec, p.lanes = triton.next_power_of_2(nr), p.page, p.d, False, 1
    elif p.fma:
        _plan_fma(p, nr, index_fmt, index_cache, lanes_d, block_n, block_d, num_warps,
                  num_stages, blocks_per_step, vec, pairs, fma_chain)
    else:
        for name, v in (("lanes_d", lanes_d), ("num_stages", num_stages), ("pairs", pairs),
                        ("fma_chain", fma_chain)):
            if v is not None:
                fail(name, "applies to scan='fma' only")
        p.rows, p.bn, p.bd, p.ch, p.vec, p.bk = ix.strategy(
            nr, p.hi, p.page, p.d, p.bps, p.k, INTERPRETED, None, block_n, block_d,
            blocks_per_step, vec)
        if p.rows < nr:
            fail("blocks_per_step", f"leaves {p.rows} rows per program, fewer than "
                                    f"rows_per_request * Hi = {nr}")
        p.lanes, p.stages = 1, 1
        p.warps = 4 if num_warps is None else ix.pow2_arg("num_warps", num_warps, 1)


def _plan_fma(p, nr, index_fmt, index_cache, lanes_d, block_n, block_d, num_warps,
              num_stages, blocks_per_step, vec, pairs, fma_chain):
    """The FMA scan's part of ``_plan_scan``."""
    for name, v in (("block_d", block_d), ("blocks_per_step", blocks_per_step)):
        if v is not None:
            fail(name, "applies to scan='dot' only")
    if vec:
        fail("vec", "applies to scan='dot' only (the FMA scan's lists merge by bitonic "
                    "top-k)")
    p.lanes, p.bn, p.warps, p.stages = fma_strategy(nr, p.page, p.d, p.fp8, lanes_d, block_n,
                                                    num_warps, num_stages)
    p.rows, p.bd, p.ch, p.vec = triton.next_power_of_2(nr), p.d, 1, False
    words = (index_fmt == "bfloat16" and index_cache.data_ptr() % 4 == 0
             and index_cache.stride(0) % 2 == 0 and index_cache.stride(1) % 2 == 0)
    p.chain = not INTERPRETED if fma_chain is None else fma_chain
    if p.chain not in (True, False):
        fail("fma_chain", f"must be a bool, got {fma_chain!r}")
    if pairs is None:
        pairs = words
    elif pairs not in (True, False) or (pairs and not words):
        fail("pairs", f"must be a bool, True only for a bf16 cache with a 4-byte aligned "
                      f"address and even page / row strides, got {pairs!r}")
    p.pairs = pairs


def _plan_merge(p, merge_chunk, merge):
    """The partial lists' merge. merge_chunk: lists merged per step by the last split (a
    power of two; default min(next_pow2(S), 256 / BK)); not with vec. merge (compiled):
    "sorted" (default: each split sorts its list, ``kernels._indexer.store_partial``, and
    the last one runs the bitonic top-k's last steps alone) or "topk" (the whole
    ``tl.topk`` of unsorted lists)."""
    if merge_chunk is None:
        p.mc = min(triton.next_power_of_2(max(p.splits, 1)), max(1, 256 // p.bk))
    else:
        p.mc = ix.pow2_arg("merge_chunk", merge_chunk, 1)
        if p.vec:
            fail("merge_chunk", "does not apply with vec=True (rank merges)")
    if merge not in (None, "sorted", "topk"):
        fail("merge", f"must be 'sorted' or 'topk', got {merge!r}")
    if merge is not None and p.vec:
        fail("merge", "does not apply with vec=True (rank merges)")
    p.sort = merge != "topk"


def _validate_decode(p, block_table, seq_lens, workspace):
    """``validate=True``'s content checks (a host sync)."""
    lens = seq_lens.detach().cpu()
    short = (lens != 0) & (lens < p.q_rows)
    if bool(short.any()):
        r = int(short.nonzero()[0, 0])
        fail("seq_lens", f"must be 0 (padding) or >= rows_per_request ({p.q_rows}), got "
                         f"seq_lens[{r}] = {int(lens[r])}")
    ix.validate_block_table(block_table, seq_lens, p.page, p.num_pages)
    if workspace is not None:
        workspace.check_counters()


def _flat_const(p, index_fmt, grid):
    """The flat kernel's constexprs (its merge chunk is ``_launch_flat``'s)."""
    return dict(P=p.page, D=p.d, ROWS=p.rows, BK=p.bk, FP8=p.fp8, FMT=p.code, HW=p.hw,
                HI=p.hi, QR=p.q_rows, STAGES=p.stages, F8MMA=fp8_mma(index_fmt),
                MR=max(16, p.rows), MIN_BLOCKS=flat_grid.MIN_BLOCKS,
                RB=flat_grid.tile_requests(p.b, grid == "proportional"),
                SORTED=p.sort, PROP=grid == "proportional", num_warps=p.warps)


def _split_args(p, index_fmt, index_q, index_cache, block_table, seq_lens, out, splits, bps,
                part, cnt, trace=None):
    """(args, constexprs) of the split kernel for S splits of bps blocks."""
    args = (index_q, index_q.stride(0), index_q.stride(1),
            index_cache, index_cache.stride(0), index_cache.stride(1), p.num_pages,
            block_table, block_table.stride(0), block_table.stride(1), p.width, seq_lens, p.t,
            out, out.stride(0), out.stride(1), out.stride(2), part, cnt,
            cnt if trace is None else trace, p.hi, p.q_rows, p.k, p.loc, p.ini, bps, splits)
    fma, mma = p.fma, p.mma
    const = dict(P=p.page, D=p.d, BLOCK_N=p.bn, BLOCK_D=p.bd, ROWS=p.rows, BK=p.bk, CH=p.ch,
                 VEC=p.vec, SPLIT=splits > 1, FP8=p.fp8, FMT=p.code, HW=p.hw, FMA=fma,
                 HI=p.hi if fma or mma else 1, QR=p.q_rows if fma or mma else 1,
                 LANES=p.lanes, STAGES=p.stages, MC=p.mc, PAIRS=bool(fma and p.pairs),
                 DIRECT=(fma or mma) and bps <= p.bk, CHAIN=p.chain, MMA=mma,
                 F8MMA=mma and fp8_mma(index_fmt), MR=max(16, p.rows), SORTED=p.sort,
                 num_warps=p.warps)
    if trace is not None:
        const["TRACE"] = True
    return args, const


def _launch_split(p, wave, merge_chunk, index_q, index_cache, index_fmt, block_table,
                  seq_lens, out, trace, workspace, pdl_kw):
    """The split grid's launch ``(B, S)``. The wave grid (``wave_splits``) sizes S from the
    compiled kernel's resident programs first. ``workspace``: a ``kernels._host.Workspace``
    kept across calls (counters stay zero between launches, partial lists reused: no
    allocation nor counter fill per call); None: fresh buffers per call."""
    dev = index_cache.device
    tensors = (index_q, index_cache, block_table, seq_lens, out)
    ensure_ready(_indexer_decode_kernel)
    if wave:  # one full wave of programs (``wave_splits``), sized from the compiled kernel
        cap = MAX_PROGRAMS_PER_SM * _sm_count(dev.index or 0)
        # Probe with the split the cap alone gives: the launch's own constexprs (MC, DIRECT,
        # SPLIT) unless the occupancy lowers the split, so one compile per shape, not two.
        p.splits, p.bps = wave_splits(cap, p.b, p.width)
        if merge_chunk is None:
            p.mc = min(triton.next_power_of_2(p.splits), max(1, 256 // p.bk))
        args, const = _split_args(p, index_fmt, *tensors, p.splits, p.bps,
                                  torch.empty(1, dtype=torch.int64, device=dev),
                                  torch.empty(1, dtype=torch.int32, device=dev))
        slots = min(resident_programs(_indexer_decode_kernel, args, {**const, **pdl_kw}, dev),
                    cap)
        p.splits, p.bps = wave_splits(slots, p.b, p.width)
        if merge_chunk is None:
            p.mc = min(triton.next_power_of_2(p.splits), max(1, 256 // p.bk))
    ws = p.splits > 1 or p.fma or p.mma  # the FMA/MMA scans always merge through the workspace
    if trace is not None and not (p.fma or p.mma):
        fail("trace", "applies to the compiled 'mma' and 'fma' scans only")
    check_trace(trace, p.b * p.splits, INTERPRETED, dev)
    part = take_scratch(workspace, "index_partials",
                        (p.b, p.splits, p.rows, p.bk) if ws else (1,), torch.int64, dev)
    cnt = take_counters(workspace, p.b if ws else 1, dev)
    args, const = _split_args(p, index_fmt, *tensors, p.splits, p.bps, part, cnt, trace)
    _indexer_decode_kernel[(p.b, p.splits)](*args, **const, **pdl_kw)
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
