"""Pieces shared by the block-sparse attention kernels (contract.md section 6): the device
functions that load a block's K/V operands (``kv_tiles``, with ``dequantize`` for per-slot
scales) and that find and recompute ``P @ V`` over a tile whose rows do not all see the
same keys (``not_finite``, ``repair_pv``, ``guarded_pv``); which fp8 schedule a case gets
(``scales_outside``); the host checks both launchers make (q and the paged cache, block
table and selections, scales, softmax scale and output) and the host's ``validate=True``
content checks of the paged inputs.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch

from kernels._host import (
    HEAD_DIMS,
    MODEL_DTYPES,
    SLOT_DTYPES,
    check_int,
    check_kv_cache,
    check_kv_fmt,
    check_last_dim_contiguous,
    check_tensor,
    fail,
    scale_arg,
)
from kernels._triton import tl, triton
from kernels.fp8 import BF16_UNIT, FMT_E5M2FNUZ, decode_fp8, decode_fp8_f16, times_f16_unit
from reference.attention import Q_TOP
from reference.platforms import is_fp8

#: Domain limits (contract.md s.7).
MAX_GROUP = 16
MAX_TOPK = 64

#: The longest context a request may have (the block table's width x P), in tokens: the
#: attention kernels' block loops compare key positions in int32.
MAX_CONTEXT: tl.constexpr = tl.constexpr(1 << 30)


@triton.jit
def dequantize(raw, scale_ptr, s0, s1, g64, slot, kmask, FMT: tl.constexpr,
               HW: tl.constexpr):
    """fp32 ``decode(code) * scale`` of a ``[..., keys, D]`` tile of fp8 codes with per-slot
    scales (each key's scale at ``scale_ptr + g64 s0 + slot s1``, ``slot`` and ``kmask``
    shaped ``[..., keys, 1]``; one fp32 multiply, the
    caller rounds to act). Scalar scales take the other path (``scales_outside``)."""
    sc = tl.load(scale_ptr + g64 * s0 + slot * s1, mask=kmask, other=1.0)
    return decode_fp8(raw, FMT, HW) * sc


@triton.jit
def unit_back(x, FP8: tl.constexpr, FMT: tl.constexpr, SCALAR: tl.constexpr,
              ASM: tl.constexpr):
    """Logits (q . K) or an output (P @ V / l) of ``kv_tiles``' operands times the factor
    its fp8 decode with scalar scales left out (``kernels.fp8.times_f16_unit``: 128 for
    e4m3fnuz in assembly, a power of two, so the product is the value the exact operands
    give, bit for bit); x itself otherwise."""
    if FP8 and SCALAR:
        x = times_f16_unit(x, FMT, ASM)
    return x


@triton.jit
def out_unit_back(o, FP8: tl.constexpr, FMT: tl.constexpr, SCALAR: tl.constexpr,
                  ASM: tl.constexpr):
    """An output (P @ V / l) of ``kv_tiles``' V and ``p_operand``'s P times the factor the
    two together left out: ``unit_back``'s, except for e5m2fnuz, whose P carries BF16_UNIT
    and V 1 / BF16_UNIT (1: o itself)."""
    if FP8 and SCALAR and FMT != FMT_E5M2FNUZ:
        o = times_f16_unit(o, FMT, ASM)
    return o


@triton.jit
def p_operand(p, v, FP8: tl.constexpr, FMT: tl.constexpr, SCALAR: tl.constexpr):
    """The fp32 probabilities ``p`` as the ``P @ V`` operand for ``kv_tiles``' V: rounded to
    V's dtype (RNE), except e5m2fnuz with scalar scales (V bf16 values / 2^111): ``p *
    2^111`` rounded to bf16, which is P's bf16 rounding times 2^111 exactly (no overflow at
    p <= 1, and more precise than bf16 only below p = 2^-126), so the products are
    ``P V`` at their own scale: no fp32 underflow for small V, nothing to multiply back."""
    if FP8 and SCALAR and FMT == FMT_E5M2FNUZ:
        p = p * BF16_UNIT
    return p.to(v.dtype)

@triton.jit
def softmax_step(s2, m_i, l_i, v, FP8: tl.constexpr, FMT: tl.constexpr, SCALAR: tl.constexpr,
                 scale=None):
    """One tile of the online softmax (both attention kernels' 2-D loops): logits ``s2``
    ``[M, N]`` in log2 units (-inf where a row does not see the key), the running max
    ``m_i`` and sum ``l_i`` ``[M]``, V ``[N, D]`` -> ``(m_new, alpha, P operand, P @ V,
    l_new)``; the caller rescales its accumulator by alpha. The sum takes the unrounded
    fp32 P; a row with no key so far keeps max -inf and adds nothing. ``scale`` (``[M]``,
    positive): ``s2`` is unscaled and its log2 units are ``s2 * scale``; the max is taken
    before the product (the same value: fp32 rounding is monotonic) and ``P = exp2(s2 *
    scale - max)``, one fused multiply-add per logit where a product then a subtraction
    took two (the logit no longer rounded on its own: an fp32 rounding fewer)."""
    if scale is None:
        m_new = tl.maximum(m_i, tl.max(s2, axis=1))
    else:
        m_new = tl.maximum(m_i, tl.max(s2, axis=1) * scale)
    m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp2(m_i - m_use)
    if scale is None:
        p = tl.exp2(s2 - m_use[:, None])
    else:
        p = tl.exp2(s2 * scale[:, None] - m_use[:, None])
    l_new = l_i * alpha + tl.sum(p, axis=1)
    p_act = p_operand(p, v, FP8, FMT, SCALAR)
    return m_new, alpha, p_act, tl.dot(p_act, v), l_new


@triton.jit
def kv_tiles(src, slot, kmask, ks_ptr, ks_s0, ks_s1, vs_ptr, vs_s0, vs_s1, g64,
             ACT: tl.constexpr, D: tl.constexpr, FP8: tl.constexpr, FMT: tl.constexpr,
             HW: tl.constexpr, SCALAR: tl.constexpr, SAME: tl.constexpr, ASM: tl.constexpr,
             PRE: tl.constexpr = False):
    """One block's K and V operands ``[..., keys, D]``: the codes at ``src`` (K) and ``src +
    D`` (V) loaded where ``kmask`` (``[..., keys, 1]``, as ``slot``; 0 elsewhere), then
    fp8 with scalar scales as their exact values in fp16 (``scales_outside``: the caller
    applies the scales to the logits and the output; q is fp16 too, ``q_operand``; e5m2fnuz
    bf16 values / 2^111), fp8 with per-slot scales dequantised at ``slot`` and rounded to
    ACT, a cache in ACT as loaded (SAME), the other 16-bit dtype rounded to ACT (exact
    widening, one RNE rounding). PRE: the cache at ``src`` holds a scalar-scale fp8 cache's
    exact values in ACT (``kernels.kv_predecode``): used as loaded."""
    # V's load first: without a pipeline (num_stages=1: the fp8 narrow prefill tier)
    # Triton converts K's codes to the dot layout through shared memory right after K's
    # load, and a global load cannot be hoisted above that conversion's barriers, so a
    # later V load waits for K's data: two L2 round trips per block instead of one
    # (static sm_90, ``benchmarks.static_sm90 --sequence``; tests/test_static_sm90.py).
    v_raw = tl.load(src + D, mask=kmask, other=0)
    k_raw = tl.load(src, mask=kmask, other=0)
    if PRE:
        k = k_raw
        v = v_raw
    elif FP8 and SCALAR:  # fp16 operands (``operand_dtypes``)
        # K in registers by a pure conversion (one cvt per two codes where the hardware
        # converts; e4m3fnuz's assembly marked pure). e4m3fnuz in assembly: the values /
        # F16_UNIT (bit placement, no conversion); the kernels multiply the logits and the
        # output back (``unit_back``), the fastest of the fnuz decodes (docs/tuning.md).
        k = decode_fp8_f16(k_raw, FMT, HW, ASM and not HW, True, True)
        v = decode_fp8_f16(v_raw, FMT, HW, ASM, False, True)
    elif FP8:
        k = dequantize(k_raw, ks_ptr, ks_s0, ks_s1, g64, slot, kmask, FMT, HW).to(ACT)
        v = dequantize(v_raw, vs_ptr, vs_s0, vs_s1, g64, slot, kmask, FMT, HW).to(ACT)
    elif SAME:
        k = k_raw
        v = v_raw
    else:
        k = k_raw.to(tl.float32).to(ACT)
        v = v_raw.to(tl.float32).to(ACT)
    return k, v


#: The narrowest padded top-k width (``KP``) the attention kernels compile.
MIN_TOPK_WIDTH = 16


def topk_width(k: int) -> int:
    """``KP``, the padded width of a row's top-k list: a power of two of at least
    ``MIN_TOPK_WIDTH`` (the model's K), so that the small K of random shapes (1..15) share
    one compile instead of five; the padding is masked (``kk < topk_k``)."""
    return max(MIN_TOPK_WIDTH, triton.next_power_of_2(max(k, 1)))


def scales_outside(case) -> bool:
    """Whether the attention kernels take their scalar-scale fp8 path for a case's inputs
    (an fp8 cache, k_scale and v_scale each None or one value): K and V then enter the
    products as their exact decoded values in act (``kernels.fp8.decode_fp8_to``: every
    fp8 value is a bf16 and an fp16 value) and the scales are applied in fp32 outside
    them, to the logits and to the output, so the schedule's ``kv_dtype`` is ``"float64"``
    (the bound allows those two fp32 roundings). With per-slot scales each key's scale is
    multiplied into K/V and the product rounded to act (``kv_dtype`` = act), as vLLM does."""
    if case is None or not is_fp8(case["kv_fmt"]):
        return False
    return all(s is None or (np.ndim(s) <= 1 and np.size(s) == 1)
               for s in (case["k_scale"], case["v_scale"]))


def operand_dtypes(model_dtype: str, case) -> tuple[str, str, str]:
    """The schedule's ``(kv_dtype, p_dtype, q_dtype)`` for a case. On the scalar-scale fp8
    path (``scales_outside``) both products run on fp16 operands whatever the model dtype:
    K and V as their exact values ("float64": every fp8 value is an fp16 value; V decoded
    by ``kernels.fp8.decode_fp8_f16``), P rounded to fp16 (3 more bits than bf16, flushed
    below 2^-24) and q per row scaled by a power of two and rounded to fp16 (``q_operand``;
    exact unless an element is 2^31 below its row's largest). e5m2fnuz there: bf16
    operands instead (its values / 2^111 by bit placement, ``kernels.fp8.
    _E5M2FNUZ_BF16X4_UNIT``: 11 instructions per four codes against 19 for fp16, whose
    range its top binade overflows at the placed scale), so P and q round to bf16 (q per
    row scaled by a power of two: exact unless an element is 2^226 below its row's
    largest; a bf16 q is never rounded). Otherwise the model dtype throughout, q as given."""
    if scales_outside(case) and case["kv_fmt"] == "e5m2fnuz":
        return "float64", "bfloat16", "bfloat16"
    if scales_outside(case):
        return "float64", "float16", "float16"
    return model_dtype, model_dtype, "given"


#: ``q_operand``'s target exponents, the reference's (``reference.attention.Q_TOP``): a
#: row's largest |q| lands in [2^(T-127), 2^(T-126)) (fp16 operands: 2^14, below fp16's
#: largest; bf16 operands of e5m2fnuz: 2^100, so the products with K's values / 2^111 stay
#: fp32 normal numbers).
Q_TOP_F16: tl.constexpr = tl.constexpr(Q_TOP["float16"])
Q_TOP_BF16: tl.constexpr = tl.constexpr(Q_TOP["bfloat16"])


@triton.jit
def q_operand(q, logit_scale, F16: tl.constexpr, FMT: tl.constexpr = 0):
    """``(q as the operand of S = q K^T, [M] per-row logit scale)`` for a ``[M, D]`` q tile.
    F16 (``reference.attention.Schedule.q_dtype = "float16"``): each row times ``2^s``,
    ``s = clamp(141 - E, -113, 126)`` with E the biased exponent of the row's largest
    ``|q|`` as an integer bit pattern (``reference.attention.q_row_exponent``), rounded to
    fp16 (RNE), and its logit scale times ``2^-s``: the products then run on fp16
    operands (fp8 K decoded to fp16 by one ``cvt`` per two codes, where a bf16 q needed
    three more instructions per element to bring K to bf16). e5m2fnuz (FMT; K as bf16
    values / 2^111, ``kernels.fp8.BF16_UNIT``): the same with ``s = clamp(227 - E, -113,
    126)``, rounded to bf16 (``q_dtype = "bfloat16"``). Else q as loaded and the scale for
    every row."""
    if F16:
        qf = q.to(tl.float32)
        top = tl.max(tl.abs(qf).to(tl.int32, bitcast=True), axis=1)
        T: tl.constexpr = Q_TOP_BF16 if FMT == FMT_E5M2FNUZ else Q_TOP_F16
        s = tl.minimum(tl.maximum(T - (top >> 23), -113), 126)
        up = ((s + 127) << 23).to(tl.float32, bitcast=True)
        down = ((127 - s) << 23).to(tl.float32, bitcast=True)
        QT: tl.constexpr = tl.bfloat16 if FMT == FMT_E5M2FNUZ else tl.float16
        return (qf * up[:, None]).to(QT), logit_scale * down
    else:
        return q, tl.zeros([q.shape[0]], tl.float32) + logit_scale


@triton.jit
def not_finite(acc):
    """1 (int32) when the ``[M, D]`` accumulator of a program holds a NaN or an Inf, else 0.

    The first pass of both attention kernels uses it once, after its loop, to flag the
    programs the second pass recomputes. A tile whose rows do not all see the same keys
    lets a non-finite V that some rows must not see reach them through ``0 * NaN`` /
    ``0 * Inf`` in the shared ``P @ V``: that always leaves a NaN in those rows' partial
    sums, and a NaN (or Inf) in ``acc`` survives every later ``acc * alpha + pv``, so one
    sum at the end finds it (false alarms, e.g. a row that legitimately sees a NaN, only
    cost a recomputation). Checking each block's ``P @ V`` instead cost a reduction and a
    branch per block in the main loop."""
    tot = tl.sum(tl.sum(acc, axis=1), axis=0)
    return ((tot != tot) | (tl.abs(tot) == float("inf"))).to(tl.int32)


@triton.jit
def repair_pv(pv, p_act, v, vis):
    """The second (repair) pass's ``P @ V`` of a tile whose rows do not all see the same
    keys: ``pv`` as computed when it is finite (a non-finite V that some rows must not see
    always shows in it: the rows that do not see its key multiply it by 0, NaN), else
    recomputed with ``guarded_pv`` (its ``[N, D]`` temporaries would make ptxas spill if
    the first pass carried them)."""
    tot = tl.sum(tl.sum(pv, axis=1), axis=0)
    if (tot != tot) | (tl.abs(tot) == float("inf")):
        vf = v.to(tl.float32)
        pv = guarded_pv(p_act, v, vis, (vf != vf) | (tl.abs(vf) == float("inf")))
    return pv


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


def check_block_keys(block_keys, page: int, name: str = "block_keys") -> int:
    """The keys per online-softmax tile of a ``block_keys`` launch knob (None: the page
    size P, whole blocks): a divisor of P (a power of two, so the tile is one too), at
    least 16 (``tl.dot``'s smallest side); errors name the argument ``name``."""
    if block_keys is None:
        return page
    bn = check_int(block_keys, name, 16, page)
    if page % bn:
        fail(name, f"must divide the page size {page}, got {bn}")
    return bn


def declared_tile_keys(block_keys, case: dict | None):
    """``Schedule.tile_keys`` of a launch with ``block_keys`` on a case's inputs: None for
    whole blocks (None, or at least the case's page size)."""
    if block_keys is not None and case is not None and block_keys >= case["kv_cache"].shape[2]:
        return None
    return block_keys


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


# ------------------------------------------------------------------------ host checks


@dataclass
class PagedArgs:
    """What ``check_q_and_cache`` found: q ``[T, Hq, D]`` over a paged cache of Hkv heads."""

    t: int
    hq: int
    hkv: int
    d: int
    page: int
    num_pages: int
    num_slots: int
    fp8: bool


def check_q_and_cache(q, kv_cache, kv_fmt) -> PagedArgs:
    """q: model dtype ``[T, Hq, D]`` (D in HEAD_DIMS, last dim contiguous); kv_cache:
    logical ``[num_pages, Hkv, P, 2D]`` in ``kv_fmt``; Hq = G * Hkv with G <= MAX_GROUP."""
    check_tensor(q, "q", tuple(MODEL_DTYPES))
    if q.dim() != 3 or q.shape[1] < 1 or q.shape[2] not in HEAD_DIMS:
        fail("q", f"must have shape [T, Hq >= 1, D in {list(HEAD_DIMS)}], got {list(q.shape)}")
    check_last_dim_contiguous(q, "q")
    t, hq, d = q.shape
    fp8 = check_kv_fmt(kv_fmt)
    if not isinstance(kv_cache, torch.Tensor) or kv_cache.dim() != 4:
        fail("kv_cache", f"must be a 4-D tensor [num_pages, Hkv, P, 2D={2 * d}], got "
                         f"{getattr(kv_cache, 'shape', type(kv_cache).__name__)}")
    hkv = kv_cache.shape[1]
    if hkv < 1:
        fail("kv_cache", f"must have Hkv >= 1 heads, got shape {list(kv_cache.shape)}")
    page, num_slots = check_kv_cache(kv_cache, kv_fmt, hkv, d, q.device)
    if hq % hkv or not 1 <= hq // hkv <= MAX_GROUP:
        fail("q", f"must have Hq = G * Hkv heads with Hkv = {hkv} (kv_cache) and G in "
                  f"[1, {MAX_GROUP}], got Hq = {hq}")
    return PagedArgs(t, hq, hkv, d, page, kv_cache.shape[0], num_slots, fp8)


def check_index_tensor(t, name: str, dev, dims: int):
    """An int32/int64 tensor of ``dims`` dimensions on ``dev`` with non-negative strides."""
    check_tensor(t, name, SLOT_DTYPES, device=dev)
    if t.dim() != dims:
        fail(name, f"must be {dims}-D, got shape {list(t.shape)}")
    if any(s < 0 for s in t.stride()):
        fail(name, "must have non-negative strides")
    return t


def check_table_and_selections(block_table, topk, a: PagedArgs, batch: int, dev) -> int:
    """block_table ``[B, max_blocks >= 1]``, at most MAX_CONTEXT tokens wide; topk ``[Hkv,
    T, K]`` with K <= MAX_TOPK (any strides: a transposed token-major buffer too). Returns
    K."""
    check_index_tensor(block_table, "block_table", dev, 2)
    if block_table.shape[0] != batch or block_table.shape[1] < 1:
        fail("block_table", f"must have shape [B={batch}, max_blocks >= 1], got "
                            f"{list(block_table.shape)}")
    if block_table.shape[1] * a.page > MAX_CONTEXT.value:
        fail("block_table", f"covers {block_table.shape[1]} blocks x page {a.page} tokens; at "
                            f"most {MAX_CONTEXT.value} (2^30) tokens per request")
    check_index_tensor(topk, "topk", dev, 3)
    if topk.shape[0] != a.hkv or topk.shape[1] != a.t or not 1 <= topk.shape[2] <= MAX_TOPK:
        fail("topk", f"must have shape [Hkv={a.hkv}, T={a.t}, K in [1, {MAX_TOPK}]], got "
                     f"{list(topk.shape)}")
    return topk.shape[2]


def check_scales_and_out(q, a: PagedArgs, k_scale, v_scale, softmax_scale, out, validate):
    """Scales (fp8 caches only: None, a float, 0-d or ``[Hkv, slots]`` float32), softmax
    scale (None: 1/sqrt(D); else finite > 0), ``out`` (allocated when None; else q's dtype
    and shape, last dim contiguous) and ``validate`` (a bool). Returns
    ``(ks, ks_strides, vs, vs_strides, softmax_scale, out)``."""
    dev = q.device
    ks, ks0, ks1 = scale_arg(k_scale, "k_scale", a.fp8, a.hkv, a.num_slots, dev)
    vs, vs0, vs1 = scale_arg(v_scale, "v_scale", a.fp8, a.hkv, a.num_slots, dev)
    if softmax_scale is None:
        softmax_scale = 1.0 / math.sqrt(a.d)
    elif isinstance(softmax_scale, bool) or not isinstance(
            softmax_scale, (int, float, np.integer, np.floating)) \
            or not (math.isfinite(softmax_scale) and softmax_scale > 0):
        fail("softmax_scale", f"must be None or a finite number > 0, got {softmax_scale!r}")
    if out is None:
        out = torch.empty((a.t, a.hq, a.d), dtype=q.dtype, device=dev)
    else:
        check_tensor(out, "out", (q.dtype,), (a.t, a.hq, a.d), dev)
        check_last_dim_contiguous(out, "out")
    if not isinstance(validate, (bool, np.bool_)):
        fail("validate", f"must be True or False, got {validate!r}")
    return ks, (ks0, ks1), vs, (vs0, vs1), float(softmax_scale), out
