"""The decode indexer's flat grid (``indexer_decode(..., grid="flat")``): the same
selection as the split grid of ``kernels/indexer_decode.py``, with the key blocks of the
whole batch shared out evenly over a fixed number of programs instead of request by request.

Why: the split grid gives every request S programs of equal size, B x S of them in one
wave; when B x S is not a multiple of the SM count some SMs hold one program more than
others and finish later, which bounds the launch. In a ragged batch the
imbalance is the requests' lengths themselves. Here the batch's T key blocks are laid end
to end (request by request, ``nb_r = min(cdiv(seq_r, P), W)`` each) and program p of the
first G' = min(G, T // MIN_BLOCKS) (at least 1) takes blocks ``floor(p T / G') ..
floor((p + 1) T / G') - 1``: every program reads the same bytes to within one key block,
whatever the lengths (equal ranges of cdiv(T, G) blocks would leave G - T / cdiv(T, G)
programs idle: 16 of 528 at the model shape, the split grid's imbalance again).

A program's range covers the tail of one request and the head of the next ones (each a
*segment*); per segment it scans the request's blocks (``kernels._indexer.
scan_blocks_mma``: one tensor-core dot per key block, the request's rows and heads sharing
it), stores its partial list to slot ``p - first(r)`` of the request's workspace (first(r)
= the program holding the request's first block; ranges of at least MIN_BLOCKS blocks
bound any request's count by ``cdiv(W, MIN_BLOCKS) + 1`` slots), and draws a ticket from
the request's counter; the program that draws the last of the request's ``count(r)``
tickets merges its lists (``merge_partials``) and writes the selection, as in the split
grid. Each program computes the batch's block offsets itself (a running sum over seq_lens
in tiles of RB requests: no host sync, the launch stays capturable). Requests with no key
block (seq_lens 0: padding) are written as all -1 by program ``r mod G``.

The proportional partition (``PROP``; ``indexer_decode(..., grid="proportional")``): the
same kernel with each request cut into its own ``S_r = cdiv(nb_r, U)`` programs, blocks
``floor(s nb_r / S_r) .. floor((s + 1) nb_r / S_r) - 1`` for program s of request r, U the
fewest blocks per program (at least MIN_BLOCKS) with which sum S_r <= G (a binary search
between cdiv(T, G) and cdiv(T, G - B'), B' the requests with blocks, where the sum always
fits: sum cdiv(nb_r, U) <= T / U + B'); the assignments numbered request by request, q
handled by program q mod G. No program straddles two requests (one scan, one partial
list, one ticket each), a request's partial lists number S_r, and the uniform model shape
gets the split grid's partition (64 x 8 programs of 32 blocks). The launch gives it at
least B programs, so a program has one assignment at most and scans it inlined: the ranges'
segments, in a loop, are a called function, and ptxas serialises the tensor-core dots of a
scan across a call (C7510: each wgmma waits for the one before).

On mixed lengths the flat grid is faster than the split grid, whose short requests'
programs idle; on uniform lengths the split grid is faster (docs/tuning.md). Not chosen
automatically: the lengths are on the device.

The launch (``launch``) is called by ``indexer_decode`` after its argument checks; the
grid size G defaults to one wave of resident programs (at most
``indexer_decode.MAX_PROGRAMS_PER_SM`` per SM; ``num_programs`` overrides it)."""

from __future__ import annotations

import torch

from kernels import _indexer as ix
from kernels._host import take_counters, take_scratch
from kernels._trace import stamp
from kernels._triton import await_previous_kernel, tl, triton

#: Key blocks per program at least (a shorter range would cost more in its merge than it
#: reads); also bounds the workspace: cdiv(W, MIN_BLOCKS) + 1 partial lists per request.
MIN_BLOCKS = 4
#: Requests per tile of the in-kernel running sum over seq_lens.
RB = 64
#: Partial lists per merge step at most: the merge's tile sets the kernel's registers
#: (sm_90, model shape, e4m3: 16 lists 161 registers, 3 programs per SM; 8 lists 128, the
#: 4 per SM of the split grid; 4 lists 118).
MERGE_CHUNK = 8


@triton.jit
def _blocks_of(seq, width, P: tl.constexpr):
    """Key blocks of requests of these lengths: cdiv(seq, P), at most the table's width."""
    return tl.where(seq > 0, tl.minimum((seq - 1) // P + 1, width), 0)


@triton.jit
def _tile_seq(seq_ptr, c0, batch, RB: tl.constexpr):
    """seq_lens[c0 .. c0 + RB - 1] (0 past the batch) and their request ids."""
    rr = c0 + tl.arange(0, RB)
    return tl.load(seq_ptr + rr, mask=rr < batch, other=0).to(tl.int32), rr


@triton.jit
def _batch_offsets(seq_ptr, batch, width, lo, P: tl.constexpr, RB: tl.constexpr):
    """(total key blocks of the batch, the first request whose blocks end after flat block
    lo, the flat offset of that request's first block)."""
    total = 0
    first = 0
    start = 0
    for c0 in range(0, batch, RB):
        seq, rr = _tile_seq(seq_ptr, c0, batch, RB)
        nb = _blocks_of(seq, width, P)
        ends = total + tl.cumsum(nb, 0)
        before = (ends <= lo) & (rr < batch)  # a prefix of the batch: ends never decrease
        first += tl.sum(before.to(tl.int32))
        start += tl.sum(tl.where(before, nb, 0))
        total += tl.sum(nb)
    return total, first, start


@triton.jit
def _parts(nb, unit):
    """Programs of requests of nb key blocks at most ``unit`` blocks each (0 for none)."""
    return (nb + unit - 1) // unit


@triton.jit
def _count_parts(seq0, seq_ptr, batch, width, unit, P: tl.constexpr, RB: tl.constexpr):
    """The proportional grid's assignments at ``unit``: sum over requests of
    ``_parts(nb_r, unit)``; seq0 the first tile, held (the other tiles loaded)."""
    n = tl.sum(_parts(_blocks_of(seq0, width, P), unit))
    for c0 in range(RB, batch, RB):
        seq, _ = _tile_seq(seq_ptr, c0, batch, RB)
        n += tl.sum(_parts(_blocks_of(seq, width, P), unit))
    return n


@triton.jit(noinline=True)
def _proportional_unit(seq_ptr, batch, width, g, P: tl.constexpr, RB: tl.constexpr,
                       MIN_BLOCKS: tl.constexpr):
    """The fewest blocks per program U (>= MIN_BLOCKS) with which the requests' programs
    ``cdiv(nb_r, U)`` number at most g: cdiv(T, g) when it fits (a uniform batch), else
    searched up to cdiv(T, g - B') (B' requests with blocks: sum cdiv(nb_r, U) <= T / U +
    B' <= g there), or the widest request when g <= B' (one program each). Returns (U,
    count). Every program runs this before it can read a key (the memory idle meanwhile):
    one pass in the common case, reductions packed (total and B' in one int64 sum).
    A function of its own (a call, not in the scan's wgmma pipeline): inlined, its vector
    arithmetic added ~20 registers to the kernel's."""
    seq0, _ = _tile_seq(seq_ptr, 0, batch, RB)
    nb0 = _blocks_of(seq0, width, P)
    both = tl.sum(nb0.to(tl.int64) + ((nb0 > 0).to(tl.int64) << 32))
    for c0 in range(RB, batch, RB):
        seq, _ = _tile_seq(seq_ptr, c0, batch, RB)
        nb = _blocks_of(seq, width, P)
        both += tl.sum(nb.to(tl.int64) + ((nb > 0).to(tl.int64) << 32))
    total = (both & 0xFFFFFFFF).to(tl.int32)
    busy = (both >> 32).to(tl.int32)
    lo = tl.maximum((total + g - 1) // g, MIN_BLOCKS)
    hi = tl.maximum(tl.where(g > busy, (total + g - busy - 1) // tl.maximum(g - busy, 1),
                             width), lo)
    count = _count_parts(seq0, seq_ptr, batch, width, lo, P, RB)
    if count > g:  # lo does not fit: the smallest U in (lo, hi] that does
        lo = tl.minimum(lo + 1, hi)
        while lo < hi:
            mid = (lo + hi) // 2
            if _count_parts(seq0, seq_ptr, batch, width, mid, P, RB) <= g:
                hi = mid
            else:
                lo = mid + 1
        count = _count_parts(seq0, seq_ptr, batch, width, lo, P, RB)
    return lo, count


@triton.jit(noinline=True)
def _assignment(seq_ptr, batch, width, unit, q, P: tl.constexpr, RB: tl.constexpr):
    """Assignment q of the proportional grid (requests in order, each cut into
    ``_parts(nb_r, unit)`` programs, q below their count): (request r, its seq_len, its
    blocks nb, its program count S, q's index s among them). r is the number of requests
    whose programs end at or before q (their running ends never decrease), and its first
    program the largest such end."""
    r = 0
    first = 0
    base = 0
    for c0 in range(0, batch, RB):
        seq, _ = _tile_seq(seq_ptr, c0, batch, RB)
        parts = _parts(_blocks_of(seq, width, P), unit)
        ends = base + tl.cumsum(parts, 0)
        done = ends <= q
        r += tl.sum(done.to(tl.int32))
        first = tl.maximum(first, tl.max(tl.where(done, ends, 0)))
        base += tl.sum(parts)
    seq_r = tl.load(seq_ptr + tl.minimum(r, batch - 1)).to(tl.int32)  # r < batch for q < count
    nb_r = _blocks_of(seq_r, width, P)
    return r, seq_r, nb_r, _parts(nb_r, unit), q - first


@triton.jit
def _owner(x, used, total):
    """The program whose range holds flat key block x: ranges [floor(p T / G'), floor((p
    + 1) T / G')), so p = ceil((x + 1) G' / T) - 1."""
    return (((x + 1).to(tl.int64) * used + total - 1) // total - 1).to(tl.int32)


@triton.jit
def _segment(q_ptr, q_s0, q_s1, ic_ptr, ic_s0, ic_s1, num_pages, bt_ptr, bt_s0, bt_s1,
             seq_ptr, num_tokens, out_ptr, o_s0, o_s1, o_s2, part_ptr, cnt_ptr,
             trace_ptr, topk, local_blocks, initial_blocks, slots, p, r, seq, b_lo, b_hi,
             slot, count, P: tl.constexpr, D: tl.constexpr, ROWS: tl.constexpr,
             BK: tl.constexpr, FP8: tl.constexpr, FMT: tl.constexpr, HW: tl.constexpr,
             HI: tl.constexpr, QR: tl.constexpr, STAGES: tl.constexpr, MC: tl.constexpr,
             F8MMA: tl.constexpr, MR: tl.constexpr, SORTED: tl.constexpr,
             TRACE: tl.constexpr):
    """Request r's key blocks b_lo .. b_hi - 1: scan them, store the partial list to the
    request's slot ``slot`` (of ``count`` partial lists) and draw its ticket; the last of
    the request's programs merges and writes."""
    rows = tl.arange(0, ROWS)
    heads = rows % HI
    row_in = rows < QR * HI
    list_size: tl.constexpr = ROWS * BK
    top = ix.scan_blocks_mma(
        ix.empty_list(ROWS, BK), q_ptr + (r * QR).to(tl.int64) * q_s0, q_s0, q_s1,
        r * QR, num_tokens, seq, bt_ptr + r.to(tl.int64) * bt_s0, bt_s1, b_lo, b_hi,
        ic_ptr, ic_s0, ic_s1, num_pages, local_blocks, initial_blocks, P, D, HI, QR,
        ROWS, MR, 1, STAGES, FP8, FMT, HW, False, F8MMA)
    mine = part_ptr + (r.to(tl.int64) * slots + slot) * list_size
    ix.store_partial(mine, top, rows, slot, MC, SORTED)
    if TRACE:
        stamp(trace_ptr, p, 2)
    tl.debug_barrier()  # every thread's partial list is stored before the ticket
    ticket = tl.atomic_add(cnt_ptr + r, 1, sem="acq_rel")
    if ticket == count - 1:  # the last of the request's programs merges
        if TRACE:
            stamp(trace_ptr, p, 4)
        merged = ix.merge_partials(part_ptr + r.to(tl.int64) * slots * list_size,
                                   count, rows, ROWS, BK, MC, SORTED)
        toks = r * QR + rows // HI
        ix.write_sorted(merged, out_ptr, o_s0, o_s1, o_s2, heads, toks,
                        row_in & (toks < num_tokens), topk, BK)
        if TRACE:
            stamp(trace_ptr, p, 5)
        tl.store(cnt_ptr + r, 0)  # every ticket drawn: ready for the next launch


# The ranges' segments, a function of their own (a call in the PTX, registers allocated
# apart): the scan inlined into the kernel's segment loop took ~100 registers more than the
# same scan outside a loop (sm_90, model shape: bf16 241 against 122, e4m3 132 against 70;
# the TTGIR is the same, ptxas's allocation across the loop is not); called, bf16 133 and
# e4m3 114. The call costs the tensor-core pipeline: ptxas serialises the wgmma of a scan
# across a call boundary (C7510), each dot waiting for the one before it; the proportional
# partition, one segment per program and no call, keeps the pipeline.
@triton.jit(noinline=True)
def _segment_called(q_ptr, q_s0, q_s1, ic_ptr, ic_s0, ic_s1, num_pages, bt_ptr, bt_s0,
                    bt_s1, seq_ptr, num_tokens, out_ptr, o_s0, o_s1, o_s2, part_ptr,
                    cnt_ptr, trace_ptr, topk, local_blocks, initial_blocks, slots, p, r, seq,
                    b_lo, b_hi, slot, count, P: tl.constexpr, D: tl.constexpr,
                    ROWS: tl.constexpr, BK: tl.constexpr, FP8: tl.constexpr,
                    FMT: tl.constexpr, HW: tl.constexpr, HI: tl.constexpr,
                    QR: tl.constexpr, STAGES: tl.constexpr, MC: tl.constexpr,
                    F8MMA: tl.constexpr, MR: tl.constexpr, SORTED: tl.constexpr,
                    TRACE: tl.constexpr):
    _segment(q_ptr, q_s0, q_s1, ic_ptr, ic_s0, ic_s1, num_pages, bt_ptr, bt_s0, bt_s1,
             seq_ptr, num_tokens, out_ptr, o_s0, o_s1, o_s2, part_ptr, cnt_ptr, trace_ptr,
             topk, local_blocks, initial_blocks, slots, p, r, seq, b_lo, b_hi, slot, count,
             P, D, ROWS, BK, FP8, FMT, HW, HI, QR, STAGES, MC, F8MMA, MR, SORTED, TRACE)


# Counts and sizes vary from call to call: not specialised (one compile for every shape).
@triton.jit(do_not_specialize=[
    "num_pages", "width", "num_tokens", "batch", "topk", "local_blocks", "initial_blocks",
    "slots"])
def _indexer_decode_flat_kernel(
        q_ptr, q_s0, q_s1, ic_ptr, ic_s0, ic_s1, num_pages,
        bt_ptr, bt_s0, bt_s1, width, seq_ptr, num_tokens, batch,
        out_ptr, o_s0, o_s1, o_s2, part_ptr, cnt_ptr, trace_ptr,
        topk, local_blocks, initial_blocks, slots,
        P: tl.constexpr, D: tl.constexpr, ROWS: tl.constexpr, BK: tl.constexpr,
        FP8: tl.constexpr, FMT: tl.constexpr, HW: tl.constexpr, HI: tl.constexpr,
        QR: tl.constexpr, STAGES: tl.constexpr, MC: tl.constexpr, F8MMA: tl.constexpr,
        MR: tl.constexpr, MIN_BLOCKS: tl.constexpr, RB: tl.constexpr,
        SORTED: tl.constexpr, PROP: tl.constexpr = False, TRACE: tl.constexpr = False,
        PDL: tl.constexpr = False):
    await_previous_kernel(PDL)
    p = tl.program_id(0)
    g = tl.num_programs(0)
    if TRACE:
        stamp(trace_ptr, p, 1)
    rows = tl.arange(0, ROWS)
    heads = rows % HI
    row_in = rows < QR * HI
    if PROP:  # each request cut into its own programs: no range straddles two
        unit, assigned = _proportional_unit(seq_ptr, batch, width, g, P, RB, MIN_BLOCKS)
        if p < assigned:  # G >= B (the launch's): one assignment per program at most
            r, seq, nb, parts, s = _assignment(seq_ptr, batch, width, unit, p, P, RB)
            if TRACE:
                stamp(trace_ptr, p, 6)
            _segment(q_ptr, q_s0, q_s1, ic_ptr, ic_s0, ic_s1, num_pages, bt_ptr, bt_s0, bt_s1,
                     seq_ptr, num_tokens, out_ptr, o_s0, o_s1, o_s2, part_ptr, cnt_ptr,
                     trace_ptr, topk, local_blocks, initial_blocks, slots, p, r, seq,
                     s * nb // parts, (s + 1) * nb // parts, s, parts, P, D, ROWS, BK, FP8,
                     FMT, HW, HI, QR, STAGES, MC, F8MMA, MR, SORTED, TRACE)
    else:  # ranges of the batch's blocks laid end to end
        total, _, _ = _batch_offsets(seq_ptr, batch, width, 0, P, RB)
        t64 = total.to(tl.int64)
        used = tl.maximum(tl.minimum(g, total // MIN_BLOCKS), 1).to(tl.int64)  # G'
        lo = tl.minimum(p * t64 // used, t64).to(tl.int32)  # programs past G': lo = hi = T
        hi = tl.minimum((p + 1) * t64 // used, t64).to(tl.int32)
        _, r, start = _batch_offsets(seq_ptr, batch, width, lo, P, RB)
        if TRACE:
            stamp(trace_ptr, p, 6)
        while (r < batch) & (start < hi):
            seq = tl.load(seq_ptr + r).to(tl.int32)
            nb = _blocks_of(seq, width, P)
            if nb > 0:  # blocks start .. start + nb - 1 of the batch: this request's
                first = _owner(start, used, t64)
                _segment_called(
                    q_ptr, q_s0, q_s1, ic_ptr, ic_s0, ic_s1, num_pages, bt_ptr, bt_s0, bt_s1,
                    seq_ptr, num_tokens, out_ptr, o_s0, o_s1, o_s2, part_ptr, cnt_ptr,
                    trace_ptr, topk, local_blocks, initial_blocks, slots, p, r, seq,
                    tl.maximum(lo, start) - start, tl.minimum(hi, start + nb) - start,
                    p - first, _owner(start + nb - 1, used, t64) - first + 1, P, D, ROWS, BK,
                    FP8, FMT, HW, HI, QR, STAGES, MC, F8MMA, MR, SORTED, TRACE)
            start += nb
            r += 1
    for r2 in range(p, batch, g):  # requests without key blocks select nothing
        if _blocks_of(tl.load(seq_ptr + r2).to(tl.int32), width, P) == 0:
            toks = r2 * QR + rows // HI
            ix.write_sorted(ix.empty_list(ROWS, BK), out_ptr, o_s0, o_s1, o_s2, heads, toks,
                            row_in & (toks < num_tokens), topk, BK)
    if TRACE:
        stamp(trace_ptr, p, 3)


def tile_requests(batch: int, proportional: bool) -> int:
    """RB, the requests per tile of the kernel's passes over seq_lens: RB (64) for the
    ranges; for the proportional grid the whole batch in one tile up to 1024 requests (its
    search for the unit passes over the lengths several times: held in registers, not
    reloaded), so one compile per power-of-two batch size from 64 up."""
    if not proportional:
        return RB
    return max(RB, min(triton.next_power_of_2(max(batch, 1)), 1024))


def workspace_slots(width: int) -> int:
    """Partial lists a request can have at most: its blocks (<= W) over ranges of at least
    MIN_BLOCKS, plus one for a range boundary before its first full range."""
    return triton.cdiv(max(width, 1), MIN_BLOCKS) + 1


def kernel_args(index_q, index_cache, block_table, seq_lens, out, part, cnt, trace, k, loc,
                ini, slots):
    """The flat kernel's positional arguments (shared by the launch and its residency
    estimate)."""
    t = index_q.shape[0]
    return (index_q, index_q.stride(0), index_q.stride(1),
            index_cache, index_cache.stride(0), index_cache.stride(1), index_cache.shape[0],
            block_table, block_table.stride(0), block_table.stride(1), block_table.shape[1],
            seq_lens, t, block_table.shape[0], out, out.stride(0), out.stride(1),
            out.stride(2), part, cnt, cnt if trace is None else trace, k, loc, ini, slots)


def launch(programs: int, index_q, index_cache, block_table, seq_lens, out, k, loc, ini,
           const: dict, trace=None, workspace=None):
    """Run the flat kernel on ``programs`` programs (``const``: its constexprs and launch
    options, from ``indexer_decode``; ``workspace``: its ``kernels._host.Workspace`` or
    None); returns ``out``."""
    b, width = block_table.shape
    dev = index_cache.device
    slots = workspace_slots(width)
    part = take_scratch(workspace, "index_partials", (b, slots, const["ROWS"], const["BK"]),
                        torch.int64, dev)
    cnt = take_counters(workspace, b, dev)
    args = kernel_args(index_q, index_cache, block_table, seq_lens, out, part, cnt, trace, k,
                       loc, ini, slots)
    if trace is not None:
        const = {**const, "TRACE": True}
    _indexer_decode_flat_kernel[(programs,)](*args, **const)
    return out
