"""PyTorch's flex_attention as a peer implementation of the block-sparse attention ops
(contract.md section 6), registered as implementation ``"flex"`` of ``attention_prefill`` and
``attention_decode`` and judged by the same oracle as the kernels.

How the paged, selected attention becomes a flex_attention call (one call per batch):
1. Gather (``gather_kv``): every request's pages, in logical block order, are dequantised
   into one contiguous K and V ``[1, Hkv, L, D]`` (request r's logical block b at global key
   block ``blk0[r] + b``, ``L = P * sum_r ceil(seq_len_r / P)``), as vLLM does:
   ``act(fp32(decode(code) * scale))`` for fp8 (one fp32 multiply by the scalar or per-slot
   scale, RNE to the activation dtype "act"), the value converted to act for bf16/fp16
   caches. Keys no row sees (past seq_len: the tail of the last page; blocks no row
   selected through that KV head; keys past the last position of the rows selecting their
   block), which may hold NaN, are zeroed, so no invisible content is ever gathered. This
   gather is NOT part of what flex_attention computes: benchmarks time ``attend`` only
   and say so.
2. Masks (``selection_mask``): the tokens of all requests form one query sequence of T
   rows; ``sel[g, t, B]`` is True when token t selected (through KV head g) the global key
   block B (the set of its valid entries: negative ones, entries past ``p // P`` and repeats
   dropped). ``mask_mod(b, h, q, kv) = sel[h // G, q, kv // P] & (kv <= qend[q])`` with
   ``qend[q]`` the global key index of the token's own position (causal inside the current
   block; keys of other requests are never selected). The ``BlockMask`` is built directly
   from the selections (``BlockMask.from_kv_blocks``, query blocks of 128 tokens, key
   blocks of P): a query block's key blocks are the union of its tokens' selections, in
   ascending order, all "partial" (no full blocks), so every block applies ``mask_mod``
   and the blocks are visited in ascending order. (The benchmark's peer marks the blocks
   where the mask holds everywhere "full", ``build_block_mask(full=True)``: flex's fastest
   correct configuration, whose block order the declared schedule does not describe.)
3. ``attend``: ``flex_attention(q, K, V, block_mask, scale, enable_gqa=True)``.

Where it runs and what it computes (the declared schedule, ``SCHEDULE(model_dtype)``):
- CUDA: ``torch.compile``'d flex_attention (Inductor's Triton template, forced to the
  attention kernel rather than the decoding one, ``BLOCK_N = P``) on act q/K/V: scores from
  act operands with fp32 accumulation, online softmax with exp2 over one P-key block per
  tile in ascending order, P rounded to act for ``P @ V``, fp32 accumulation, output act:
  ``Schedule(kv_dtype=act, p_dtype=act, p_max="running", blocks_per_tile=1,
  order="ascending", out_dtype=act)``. Compiled with static shapes (one compile per
  shape: with ``dynamic=True`` the H200 run of 2026-11-30 gave wrong outputs on two small
  prefill cases with G = 1 and D = 64, cause not isolated yet; shape-specialised kernels
  remove dynamic shapes as a suspect) and a raised recompile limit, so that the oracle's many
  shapes never fall back to eager (which computes differently). Where flex's default
  tiles do not fit shared memory (P x D >= 128 x 128: 228 KiB asked, 227 KiB there),
  ``BLOCK_M = 64`` and 2 stages (1 past 128 x 128); neither changes the schedule.
- CPU: flex_attention's eager path (``torch 2.13``: an unfused "math" implementation that
  materialises the full score matrix; compiling flex on the CPU needs a C++ toolchain).
  It is run on fp32 copies of the act q/K/V (act values are exact in fp32), so it
  computes fp32 scores, an fp32 softmax over the whole row and fp32 ``P @ V`` (with act
  inputs it would round the *normalised* P to act, which no Schedule models), output
  rounded to act: ``Schedule(kv_dtype=act, out_dtype=act)``, the torch baseline's.
A device's schedule is fixed at import (CUDA present or not), as the device is.

Limitation (a peer's, documented, not gated by the oracle's cases): flex multiplies whole
tiles in ``P @ V``, so a non-finite V in a key some rows of a tile see would reach the
other rows through ``0 * NaN``; the oracle's attention cases hold finite values in every
visible key. Invisible content never reaches it (step 1).
"""

from __future__ import annotations

import inspect
import math
from dataclasses import dataclass

import numpy as np
import torch
from torch.nn.attention.flex_attention import BlockMask, flex_attention

from oracle.core.bounds import TENSOR_CORE_DOT_REL
from oracle.core.registry import Implementation, register
from oracle.impls.io import HALF_DTYPES, codes_in, codes_out, device, ints, values
from oracle.impls.torch_peer import _full_fp32_matmul, decode
from reference.attention import Schedule
from reference.platforms import is_fp8

Q_BLOCK = 128  # flex_attention's default sparse query block
_FROM_KV_BLOCKS = inspect.signature(BlockMask.from_kv_blocks).parameters


# ------------------------------------------------------------------------- schedule


@dataclass(frozen=True)
class FlexSchedule:
    """flex_attention's rounding schedule for a model dtype: compiled (CUDA) or eager fp32
    (CPU); see the module docstring."""

    compiled: bool

    def __call__(self, model_dtype: str, case: dict | None = None) -> Schedule:
        if self.compiled:
            return Schedule(kv_dtype=model_dtype, p_dtype=model_dtype, p_max="running",
                            blocks_per_tile=1, order="ascending", out_dtype=model_dtype)
        return Schedule(kv_dtype=model_dtype, out_dtype=model_dtype)


# --------------------------------------------------------------------------- pieces


def request_rows(x: dict) -> tuple[np.ndarray, np.ndarray]:
    """(request, position) of every query row of a case's inputs (prefill or decode by its
    keys); position -1 for decode padding rows (seq_len 0)."""
    from reference.attention import decode_positions, prefill_positions

    seq = np.asarray(x["seq_lens"], np.int64)
    if "rows_per_request" in x:
        return decode_positions(seq, int(x["rows_per_request"]))
    return prefill_positions(x["cu_seqlens_q"], seq, np.asarray(x["q"]).shape[0])


def block_offsets(seq_lens: np.ndarray, page: int) -> np.ndarray:
    """``blk0 [B + 1]``: request r's logical blocks sit at global key blocks
    ``blk0[r] .. blk0[r+1] - 1`` of the gathered K/V."""
    blocks = -(-np.asarray(seq_lens, np.int64) // page)
    return np.concatenate([[0], np.cumsum(blocks)]).astype(np.int64)


def gather_kv(cache: torch.Tensor, fmt: str, block_table: np.ndarray, seq_lens: np.ndarray,
              k_scale, v_scale, act: torch.dtype, seen=None) -> tuple[torch.Tensor, torch.Tensor]:
    """Dequantised contiguous K and V ``[1, Hkv, L, D]`` (act) of every request's pages in
    logical order (``block_offsets``). cache: the logical ``[num_pages, Hkv, P, 2D]`` codes
    (uint8 fp8 codes or int16 bf16/fp16 bits); scales: None, a scalar or ``[Hkv,
    num_pages*P]`` (numpy float32). Keys past seq_len are zero, and so is every key
    ``seen`` (bool ``[Hkv, L]``, optional) marks as seen by no row: content no query may
    see (possibly NaN) never enters flex_attention's products."""
    dev = cache.device
    _, hkv, page, two_d = cache.shape
    d = two_d // 2
    seq = np.asarray(seq_lens, np.int64)
    blk0 = block_offsets(seq, page)
    nb = np.diff(blk0)
    pages_np = np.concatenate([np.asarray(block_table[r, :nb[r]], np.int64)
                               for r in range(seq.size)]) if seq.size else np.zeros(0, np.int64)
    pages = ints(pages_np, dev)
    length = int(blk0[-1]) * page
    codes = cache[pages].permute(1, 0, 2, 3).reshape(hkv, length, two_d)  # [Hkv, L, 2D]
    req = np.repeat(np.arange(seq.size), nb * page)
    j = np.arange(length) - np.repeat(blk0[:-1] * page, nb * page)  # position in its request
    keep_np = np.broadcast_to(j < seq[req], (hkv, length))
    if seen is not None:
        keep_np = keep_np & seen
    keep = torch.from_numpy(np.ascontiguousarray(keep_np)).to(dev)[..., None]
    slots = (pages[:, None] * page + torch.arange(page, device=dev)).reshape(-1)

    def part(c, scale):
        val = decode(c, fmt)  # exact fp32 values of the codes
        if is_fp8(fmt) and scale is not None:
            s = np.asarray(scale, np.float32)
            if s.ndim == 0:
                val = val * float(s)
            else:
                st = torch.from_numpy(np.ascontiguousarray(s)).to(dev)
                val = val * st[:, slots][..., None]
        val = torch.where(keep, val, torch.zeros_like(val))  # 0 * NaN never happens later
        return val.to(act)[None]

    return part(codes[..., :d], k_scale), part(codes[..., d:], v_scale)


def seen_keys(sel: np.ndarray, qend: np.ndarray, page: int) -> np.ndarray:
    """``[Hkv, L]`` bool: key j (global index) is seen by some row through KV head g, i.e.
    some row selecting its block sits at or after it (the kernel's per-block ``lim``)."""
    lim = np.where(sel, qend[None, :, None], -1).max(axis=1, initial=-1)  # [Hkv, NB]
    j = np.arange(sel.shape[2] * page)
    return j[None, :] <= np.repeat(lim, page, axis=1)


def selection_mask(topk: np.ndarray, req: np.ndarray, pos: np.ndarray, seq_lens: np.ndarray,
                   page: int) -> tuple[np.ndarray, np.ndarray]:
    """``sel [Hkv, T, NB]`` bool over the gathered global key blocks (each row's valid
    selection as a set) and ``qend [T]``: the global key index of each row's position (-1
    for rows that see nothing)."""
    blk0 = block_offsets(seq_lens, page)
    hkv, t, _ = topk.shape
    sel = np.zeros((hkv, t, max(1, int(blk0[-1]))), bool)
    e = np.asarray(topk, np.int64)
    live = pos >= 0
    ok = live[None, :, None] & (e >= 0) & (e <= (np.maximum(pos, 0) // page)[None, :, None])
    g, i, k = np.nonzero(ok)
    sel[g, i, blk0[req[i]] + e[g, i, k]] = True
    qend = np.where(live, blk0[np.minimum(req, blk0.size - 2)] * page + pos, -1)
    return sel, qend


def full_blocks(sel: torch.Tensor, qend: torch.Tensor, page: int) -> torch.Tensor:
    """``[Hkv, nqb, NB]`` bool: the (query block, key block) pairs where ``mask_mod`` holds
    for every (row, key): a query block of ``Q_BLOCK`` rows all in the batch, each of them
    selecting the key block, whose last key is at or before every row's position."""
    nb = sel.shape[2]
    last_seen = _query_blocks(qend, -1).min(-1).values  # [nqb]; padding rows see nothing
    block_end = torch.arange(1, nb + 1, device=sel.device) * page - 1
    visible = block_end[None, :] <= last_seen[:, None]
    return _query_blocks(sel.transpose(1, 2), False).all(-1).transpose(1, 2) & visible[None]


def _query_blocks(x: torch.Tensor, fill) -> torch.Tensor:
    """``x [..., T]`` padded with ``fill`` to whole query blocks: ``[..., nqb, Q_BLOCK]``."""
    t = x.shape[-1]
    nqb = -(-t // Q_BLOCK)
    padded = torch.full((*x.shape[:-1], nqb * Q_BLOCK), fill, dtype=x.dtype, device=x.device)
    padded[..., :t] = x
    return padded.view(*x.shape[:-1], nqb, Q_BLOCK)


def _block_lists(blocks: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``[Hkv, nqb, NB]`` bool -> (counts ``[1, Hq, nqb]``, ascending block ids ``[1, Hq,
    nqb, NB]``, the chosen ones first), int32, for ``BlockMask.from_kv_blocks``."""
    blocks = blocks.repeat_interleave(group, dim=0)
    num = blocks.sum(-1, dtype=torch.int32)[None]
    idx = torch.argsort((~blocks).to(torch.int8), dim=-1, stable=True).to(torch.int32)[None]
    return num, idx.contiguous()


def build_block_mask(sel: torch.Tensor, qend: torch.Tensor, group: int, page: int,
                     num_keys: int, full: bool = False) -> BlockMask:
    """The BlockMask of ``selection_mask``'s outputs (on their device): query blocks of
    ``Q_BLOCK`` rows, key blocks of P; a query block's key blocks are the union of its rows'
    selections, ascending; ``mask_mod`` applies the exact per-row mask. ``full=False`` (the
    registered implementation: its declared schedule visits the blocks in ascending order):
    no block is "full". ``full=True`` (the benchmark's peer at its fastest): the blocks of
    ``full_blocks`` are marked full, so flex skips ``mask_mod`` on them; flex's kernel then
    visits a query block's partial blocks first and its full ones after, each list
    ascending (a different online-softmax order, same attention)."""
    t = sel.shape[1]
    union = _query_blocks(sel.transpose(1, 2), False).any(-1).transpose(1, 2)

    def mask_mod(b, h, q_idx, kv_idx):
        return sel[h // group, q_idx, kv_idx // page] & (kv_idx <= qend[q_idx])

    kwargs = dict(BLOCK_SIZE=(Q_BLOCK, page), mask_mod=mask_mod)
    if full:
        whole = full_blocks(sel, qend, page)
        union = union & ~whole
        kwargs["full_kv_num_blocks"], kwargs["full_kv_indices"] = _block_lists(whole, group)
    if "seq_lengths" in _FROM_KV_BLOCKS:
        kwargs["seq_lengths"] = (t, num_keys)
    if "compute_q_blocks" in _FROM_KV_BLOCKS:
        kwargs["compute_q_blocks"] = False  # forward only
    return BlockMask.from_kv_blocks(*_block_lists(union, group), **kwargs)


_COMPILED = None


def compiled_flex():
    """flex_attention compiled once per process and shape (static shapes; a recompile
    limit high enough that the oracle's shapes never drop it to eager, which computes
    differently)."""
    global _COMPILED
    if _COMPILED is None:
        import torch._dynamo

        cfg = torch._dynamo.config
        for name in ("recompile_limit", "cache_size_limit"):
            if hasattr(cfg, name):
                setattr(cfg, name, max(getattr(cfg, name), 256))
        _COMPILED = torch.compile(flex_attention, dynamic=False)
    return _COMPILED


def default_kernel_options(page: int, d: int) -> dict:
    """The compiled flex kernel's options for the declared schedule (the attention kernel,
    ``BLOCK_N = P``), with smaller query tiles and fewer stages where flex's defaults ask
    for more shared memory than the H200 has (P x D >= 128 x 128)."""
    opts = {"FORCE_USE_FLEX_ATTENTION": True, "BLOCK_N": page}
    if page * d >= 128 * 128:
        opts.update(BLOCK_M=64, num_stages=2 if page * d == 128 * 128 else 1)
    return opts


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, block_mask: BlockMask,
           softmax_scale: float, page: int, compiled: bool,
           kernel_options: dict | None = None) -> torch.Tensor:
    """flex_attention of q ``[1, Hq, T, D]`` over K/V ``[1, Hkv, L, D]`` (GQA) under the
    block mask: compiled, or eager. Returns ``[1, Hq, T, D]`` in q's dtype. Compiled, the
    kernel options default to what the declared schedule assumes (``BLOCK_N = P``: one
    block per online-softmax tile; the attention kernel, never the split-K decoding one);
    a benchmark may pass others (then the schedule no longer describes the result)."""
    if compiled:
        opts = default_kernel_options(page, q.shape[-1]) if kernel_options is None \
            else kernel_options
        return compiled_flex()(q, k, v, block_mask=block_mask, scale=softmax_scale,
                                enable_gqa=True, kernel_options=opts)
    # Eager: flex_attention traces its higher-order op with dynamo (backend "eager") on
    # every new shape (seconds per oracle case); its debug switch calls the op directly,
    # the same unfused computation without the tracing. Restored afterwards.
    import warnings

    import torch.nn.attention.flex_attention as fa

    debug = getattr(fa, "_FLEX_ATTENTION_DISABLE_COMPILE_DEBUG", None)
    try:
        if debug is not None:
            fa._FLEX_ATTENTION_DISABLE_COMPILE_DEBUG = True
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*flex_attention called without")
            return flex_attention(q, k, v, block_mask=block_mask, scale=softmax_scale,
                                  enable_gqa=True)
    finally:
        if debug is not None:
            fa._FLEX_ATTENTION_DISABLE_COMPILE_DEBUG = debug


# --------------------------------------------------------------------------- adapter


def run(x: dict) -> dict:
    """Oracle adapter (ops ``attention_prefill`` / ``attention_decode``): impl_torch's
    input/output conventions; numpy codes out; inputs never modified."""
    dev = device()
    compiled = dev.type == "cuda"
    md = x["model_dtype"]
    act = HALF_DTYPES[md]
    q_np = np.asarray(x["q"])
    t, hq, d = q_np.shape
    cache = codes_in(x["kv_cache"], dev)
    hkv, page = cache.shape[1], cache.shape[2]
    seq = np.asarray(x["seq_lens"], np.int64)
    req, pos = request_rows(x)
    out = torch.zeros((t, hq, d), dtype=act, device=dev)
    if t and (pos >= 0).any():
        sel, qend = selection_mask(np.asarray(x["topk"]), req, pos, seq, page)
        k, v = gather_kv(cache, x["kv_fmt"], np.asarray(x["block_table"]), seq, x["k_scale"],
                         x["v_scale"], act, seen_keys(sel, qend, page))
        bm = build_block_mask(torch.from_numpy(sel).to(dev), ints(qend, dev), hq // hkv,
                              page, k.shape[2])
        q = values(q_np, act, dev).permute(1, 0, 2)[None]  # [1, Hq, T, D]
        work = act if compiled else torch.float32
        with _full_fp32_matmul():
            o = attend(q.to(work), k.to(work), v.to(work), bm, 1.0 / math.sqrt(d), page,
                       compiled)
        out = o[0].permute(1, 0, 2).to(act)
        out = torch.where(ints(pos, dev)[:, None, None] >= 0, out, torch.zeros_like(out))
    return {"out": codes_out(out.contiguous().view(torch.int16))}


SCHEDULE = FlexSchedule(compiled=torch.cuda.is_available())


def register_all() -> None:
    """Register flex_attention as a peer of both attention ops."""
    how = ("torch.compile'd flex_attention (BLOCK_N = P, act P)" if SCHEDULE.compiled
           else "eager flex_attention in fp32 (unfused math path)")
    for op in ("attention_prefill", "attention_decode"):
        # On the CPU the eager path materialises every score and the float64 check of a
        # small case costs seconds: tiny shapes only there.
        classes = ("tiny", "small", "model") if SCHEDULE.compiled else ("tiny",)
        register(Implementation(
            "flex", op, run, devices=("cpu", "cuda"), shape_classes=classes,
            schedule=SCHEDULE,
            # Compiled: Triton templates, both products on tensor cores.
            score_rel=TENSOR_CORE_DOT_REL if SCHEDULE.compiled else 0.0,
            notes=f"{how} on K/V gathered from the pages and dequantised to act (gather "
                  f"not timed); BlockMask from the selections, mask_mod = selection & "
                  f"causal"))

