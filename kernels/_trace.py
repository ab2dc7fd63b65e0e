"""Per-program timelines of a compiled kernel: a diagnostic for the speed work (where a
launch loses its time: late starts, uneven scans, the merge tail), not a result.

A kernel built with ``TRACE=True`` stamps, per program, the SM it runs on and the GPU's
``%globaltimer`` (ns, shared by all SMs) at ``TRACE_SLOTS - 1`` points of its life into a
row of an int64 buffer: ``[smid, t_0, t_1, ...]``. Nsight Compute reports how busy the SMs
were on average; the rows say
when each program started and finished and what came between.

``stamp`` is a ``@triton.jit`` helper for the kernels; ``trace_buffer`` / ``check_trace``
are for their launchers (``trace=`` keyword), ``summary`` for the reader
(``python -m benchmarks.profile_launch --timeline``). The interpreter has no timer: the
launchers refuse ``trace`` there (ValueError).
"""

from __future__ import annotations

import numpy as np
import torch

from kernels._host import fail
from kernels._triton import tl, triton

#: int64 per program row: the SM id, then up to this many minus one timestamps (a kernel
#: may stamp some slots in some programs only: the index decode's merge stamps, 4 and 5,
#: in the programs that merge).
TRACE_SLOTS = 7
_SLOTS = tl.constexpr(TRACE_SLOTS)


@triton.jit
def stamp(trace_ptr, row, slot: tl.constexpr):
    """Write ``%globaltimer`` to ``trace_ptr[row, slot]`` (slot 1..TRACE_SLOTS-1) and, at
    slot 1, ``%smid`` to ``trace_ptr[row, 0]``. ``row`` (the program's int32 index) also
    feeds the assembly an operand it ignores (the helper needs a value to broadcast to).
    The timer is read after every thread of the program got here."""
    tl.debug_barrier()
    row_ptr = trace_ptr + row.to(tl.int64) * _SLOTS
    t = tl.inline_asm_elementwise("mov.u64 $0, %globaltimer;", "=l,r", [row],
                                  dtype=tl.int64, is_pure=False, pack=1)
    tl.store(row_ptr + slot, t)
    if slot == 1:
        sm = tl.inline_asm_elementwise("mov.u32 $0, %smid;", "=r,r", [row], dtype=tl.int32,
                                       is_pure=False, pack=1)
        tl.store(row_ptr, sm.to(tl.int64))


def trace_buffer(programs: int, device) -> torch.Tensor:
    """A zeroed ``[programs, TRACE_SLOTS]`` int64 buffer for a launch of that many
    programs."""
    return torch.zeros((programs, TRACE_SLOTS), dtype=torch.int64, device=device)


def check_trace(trace, programs: int, interpreted: bool, device) -> None:
    """The ``trace=`` keyword of a launcher: None, or an int64 CUDA tensor of at least
    ``[programs, TRACE_SLOTS]`` (contiguous) on the kernel's device; compiled kernels
    only."""
    if trace is None:
        return
    if interpreted or device.type != "cuda":
        fail("trace", "needs the compiled kernel on a CUDA device (the interpreter has no "
                      "timer)")
    if (not isinstance(trace, torch.Tensor) or trace.dtype != torch.int64
            or trace.device != device or not trace.is_contiguous() or trace.dim() != 2
            or trace.shape[1] != TRACE_SLOTS or trace.shape[0] < programs):
        fail("trace", f"must be a contiguous int64 tensor [>= {programs} programs, "
                      f"{TRACE_SLOTS}] on {device} (kernels._trace.trace_buffer), got "
                      f"{getattr(trace, 'dtype', type(trace).__name__)} "
                      f"{tuple(getattr(trace, 'shape', ()))}")


def summary(rows: np.ndarray, names: tuple[str, ...], slots: tuple[int, ...] = ()
            ) -> str:
    """A Markdown timeline of traced programs: ``rows`` ``[programs, TRACE_SLOTS]`` from a
    traced launch, ``names`` the stamps' names in time order, ``slots`` their slots
    (default 1, 2, ...; the first is the start, the last the end). Only rows with every
    one of those slots stamped count (a subset of the programs when some slots are
    stamped by some programs only). Times in us from the earliest start: quantiles of each
    stamp and of the gaps between consecutive ones, the span (the last end), the median end
    of programs grouped by how many programs shared their SM (does a fuller SM finish
    later?), and how much of the span the SMs held a program (the union of their
    programs' [start, end], per SM)."""
    rows = np.asarray(rows, np.int64)
    k = len(names)
    cols = np.asarray(slots or range(1, k + 1))
    if len(cols) != k:
        raise ValueError(f"slots must name one slot per stamp name ({k}), got {slots}")
    rows = rows[(rows[:, cols] > 0).all(axis=1)]
    if not len(rows):
        return "no program was stamped"
    t = (rows[:, cols] - rows[:, cols[0]].min()) / 1e3
    span = t[:, k - 1].max()
    qs = (0, 10, 50, 90, 100)
    lines = [f"{len(rows)} programs on {len(np.unique(rows[:, 0]))} SMs; span {span:.1f} us",
             "| stamp (us from the first start) | " + " | ".join(f"p{q}" for q in qs) + " |",
             "|---|" + "---:|" * len(qs)]
    for j, name in enumerate(names):
        lines.append(f"| {name} | " + " | ".join(f"{np.percentile(t[:, j], q):.1f}"
                                                 for q in qs) + " |")
    for j in range(1, k):
        d = t[:, j] - t[:, j - 1]
        lines.append(f"| {names[j - 1]} -> {names[j]} | "
                     + " | ".join(f"{np.percentile(d, q):.1f}" for q in qs) + " |")
    per_sm = np.unique(rows[:, 0], return_inverse=True, return_counts=True)
    load = per_sm[2][per_sm[1]]  # each program's count of programs on its SM
    lines.append(f"{names[k - 1]} by programs per SM: " + ", ".join(
        f"{n}: median {np.median(t[load == n, k - 1]):.1f} us ({int((load == n).sum())})"
        for n in np.unique(load)))
    busy = []
    for sm in np.unique(rows[:, 0]):
        mine = t[rows[:, 0] == sm]
        busy.append(mine[:, k - 1].max() - mine[:, 0].min())
    lines.append(f"SM busy (first start to last end per SM) / span: mean "
                 f"{np.mean(busy) / span:.1%}, min {np.min(busy) / span:.1%}")
    return "\n".join(lines)


def persistence(calls: list[np.ndarray], start: int = 1, end: int = 3) -> str:
    """Whether the late programs of a launch are late again in the next one: Spearman's
    rank correlation (``scipy.stats.spearmanr``) of the end times (slot ``end`` less the
    call's earliest slot ``start``) between consecutive traced calls, by program (row:
    the same work each call) and by SM (the mean end of the programs it ran). Near 1 by
    SM: some SMs are slow every call (their place on the chip; work placed by SM would
    pay); near 1 by program: some work is slow (its pages); near 0 both: the spread is
    noise, which only finer-grained balancing at run time evens out. Rows not stamped at
    both slots are left out of that pair."""
    from scipy.stats import spearmanr

    if len(calls) < 2:
        return "end-time persistence: needs 2 or more calls"
    by_program, by_sm = [], []
    for a, b in zip(calls, calls[1:]):
        a, b = np.asarray(a, np.int64), np.asarray(b, np.int64)
        ok = (a[:, [start, end]] > 0).all(axis=1) & (b[:, [start, end]] > 0).all(axis=1)
        ends = [(x[ok, end] - x[ok, start].min()) / 1e3 for x in (a, b)]
        by_program.append(spearmanr(ends[0], ends[1]).statistic)
        sms = [x[ok, 0] for x in (a, b)]
        common = np.intersect1d(sms[0], sms[1])
        means = [[e[s == sm].mean() for sm in common] for e, s in zip(ends, sms)]
        by_sm.append(spearmanr(means[0], means[1]).statistic)
    return (f"end-time persistence over {len(calls)} calls (Spearman rho of consecutive "
            f"calls): by program {np.mean(by_program):.2f}, by SM {np.mean(by_sm):.2f}")

