"""Pieces shared by the block-sparse attention kernels (SPEC.md section 6): a device
function for ``P @ V`` over a tile whose rows do not all see the same keys, and the host's
``validate=True`` content checks of the paged inputs.

``guarded_pv`` is the algorithm of ``kernels.attention_decode``'s private ``_guarded_pv``
(issue 8), made public here so that both attention kernels can share one copy.
"""

from __future__ import annotations

import torch

from kernels._host import fail
from kernels._triton import tl, triton


@triton.jit
def guarded_pv(p_act, v, vis, bad):
    """``P @ V`` for a tile whose rows do not all see the same keys and whose V holds
    non-finite values (``bad``: the non-finite elements of ``v``, ``[N, D]``; ``vis``: the
    ``[M, N]`` keys each row sees; ``p_act``: P rounded to V's dtype, 0 where not seen).
    The finite part is one dot on V with its non-finite elements zeroed; the non-finite
    contributions of the keys each row sees are added from exact 0/1 counts (NaN; +-Inf
    where the row's rounded P > 0; NaN for an Inf where it is 0, as 0 * Inf; +Inf and -Inf
    together give NaN), so a row never meets V it cannot see through ``0 * NaN``. The
    counts are bf16 MMAs (exact: see below). At most 255 keys per tile (``N <= 128`` in
    the prefill and decode kernels that use it)."""
    vf = v.to(tl.float32)
    finite_part = tl.dot(p_act, tl.where(bad, 0.0, vf).to(v.dtype))
    flags = tl.where(vf != vf, 1.0, tl.where(vf == float("inf"), 256.0,
                                             tl.where(vf == float("-inf"), 65536.0, 0.0)))
    # Counts by bf16 MMAs: 0/1 and powers of two are exact in bf16, the products are exact
    # and the fp32 sums are integers below 2^24 (at most 128 keys * 65536), so exact in
    # any order; cheaper to run and to compile than fp32 "ieee" dots.
    cnt = tl.dot(vis.to(tl.bfloat16), flags.to(tl.bfloat16)).to(tl.int32)
    zero_p = (vis & (p_act == 0)).to(tl.bfloat16)
    is_inf = (tl.abs(vf) == float("inf")).to(tl.bfloat16)
    inf_at_zero = tl.dot(zero_p, is_inf)
    n_nan = cnt & 255
    n_pos = (cnt >> 8) & 255
    n_neg = cnt >> 16
    nan_hit = (n_nan > 0) | (inf_at_zero > 0) | ((n_pos > 0) & (n_neg > 0))
    special = tl.where(nan_hit, float("nan"), tl.where(n_pos > 0, float("inf"),
                                                       tl.where(n_neg > 0, float("-inf"), 0.0)))
    return finite_part + special


# ------------------------------------------------------------------ host content checks


def validate_block_table(block_table, seq_lens, page: int, num_pages: int) -> None:
    """The table is wide enough for every request, and every entry a request uses (blocks
    ``0 .. ceil(seq_len / P) - 1``) is a page in ``[0, num_pages)``. Host sync."""
    seq = seq_lens.detach().to("cpu", torch.int64)
    need = (seq + page - 1) // page
    width = block_table.shape[1]
    if seq.numel() and int(need.max()) > width:
        r = int(need.argmax())
        fail("block_table", f"has {width} columns, too few for request {r} (seq_len "
                            f"{int(seq[r])} needs {int(need[r])} pages of {page})")
    bt = block_table.detach().to("cpu", torch.int64)
    used = torch.arange(width)[None, :] < need[:, None]
    bad = used & ((bt < 0) | (bt >= num_pages))
    if bool(bad.any()):
        r, c = (int(i) for i in bad.nonzero()[0])
        fail("block_table", f"[{r}, {c}] = {int(bt[r, c])} must be a page in [0, "
                            f"{num_pages - 1}] (request {r} uses that block)")


def validate_selections(topk, row_pos: torch.Tensor, page: int) -> None:
    """Every non-negative entry of ``topk[g, row, :]`` is at most the row's last visible
    block ``p // P`` and no row repeats a block (rows with ``p < 0`` are not checked: they
    see nothing). ``row_pos``: int64 CPU ``[T]``. Host sync."""
    tk = topk.detach().to("cpu", torch.int64)
    live = row_pos >= 0
    last = torch.where(live, row_pos, -1).div(page, rounding_mode="floor")
    past = live[None, :, None] & (tk >= 0) & (tk > last[None, :, None])
    if bool(past.any()):
        g, t, k = (int(i) for i in past.nonzero()[0])
        fail("topk", f"[{g}, {t}, {k}] = {int(tk[g, t, k])} selects a block past the row's "
                     f"last visible block p // P = {int(row_pos[t])} // {page} = "
                     f"{int(last[t])}; entries must be in [0, p // P] or negative (unused)")
    srt = torch.sort(torch.where(tk >= 0, tk, -1), dim=2).values
    dup = (srt[..., 1:] == srt[..., :-1]) & (srt[..., 1:] >= 0) & live[None, :, None]
    if bool(dup.any()):
        g, t, k = (int(i) for i in dup.nonzero()[0])
        fail("topk", f"[{g}, {t}, :] selects block {int(srt[g, t, k + 1])} more than once; "
                     f"a row's selection must not repeat a block")


def validate_scales(scales) -> None:
    """Every scale ``(name, tensor)`` is positive and finite. Host sync."""
    for name, sc in scales:
        if not bool(torch.isfinite(sc).all() & (sc > 0).all()):
            fail(name, "must hold positive finite values")
