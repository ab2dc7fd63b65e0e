"""Fused Gemma RMSNorm + partial NeoX RoPE + paged KV / index-cache insert in ONE Triton
kernel (SPEC.md sections 3, 4; issue 5).

One launch per batch. The grid is ``(N, blocks)``: axis 1 enumerates blocks of BLOCK_H heads
of q, then of k (each k program also inserts its K and V heads into the paged cache), then
of index_q, then (when present) the single index_k head (which also goes into the index
cache). Per head: ``n = x * rsqrt(mean(x^2) + eps) * (1 + w)`` in fp32, then rotate-half
RoPE with the table row of the token's position, as given. Any even R <= D: every lane d
loads its partner lane (d + R/2 for d < R/2, d - R/2 for R/2 <= d < R, itself beyond R)
with a second, gathered load, so R/2 need not be a power of two and no reshuffle is needed.

Outputs: q, k, index_k rounded once (RNE) to the model dtype; index_q in the index cache's
format (e4m3 codes of the fp32 value when the index cache is fp8). K goes into the cache
from its fp32 value (``quantize_from="value"``: one rounding), divided by its scale; V from
its model-dtype value divided by its scale (fp8 caches: ``encode_fp8`` satfinite, hardware
casts for e4m3fn/e5m2, the software codec for the fnuz formats). Caches are addressed
through their strides (HND, NHD, padded) with 64-bit offsets; negative (and, defensively,
out-of-range) slots are skipped; out-of-range positions read no table row.

``norm_rope_insert(...)`` is the host launcher (validates dtypes, shapes, strides and
formats; raises ValueError naming the argument); ``run(inputs)`` is the oracle adapter
registered as implementation ``"triton"`` of op ``"norm_rope_insert"``.
"""

from __future__ import annotations

from kernels._host import fail, insert_adapter, plan_norm_rope_insert
from kernels._triton import ensure_ready, is_interpreted, tl, triton
from kernels.fp8 import HW_FORMATS, encode_fp8, fmt_code


@triton.jit
def _norm_rope_tile(row_ptr, col0, head0, n_heads, w_ptr, cs_ptr, pos_ok, half, eps,
                    D: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr):
    """fp32 norm + RoPE of heads head0.. of one kind (starting at column col0 of the row):
    returns y [BLOCK_H, BLOCK_D], the head and dim indices and the valid-lane mask."""
    heads = head0 + tl.arange(0, BLOCK_H)
    dims = tl.arange(0, BLOCK_D)
    hmask = heads < n_heads
    dmask = dims < D
    mask = hmask[:, None] & dmask[None, :]
    first = dims < half
    rot = dims < 2 * half
    partner = tl.where(first, dims + half, tl.where(rot, dims - half, dims))
    base = row_ptr + col0 + heads[:, None].to(tl.int64) * D
    x = tl.load(base + dims[None, :], mask=mask, other=0.0).to(tl.float32)
    xp = tl.load(base + partner[None, :], mask=mask, other=0.0).to(tl.float32)
    w1 = 1.0 + tl.load(w_ptr + dims, mask=dmask, other=0.0).to(tl.float32)
    wp1 = 1.0 + tl.load(w_ptr + partner, mask=dmask, other=0.0).to(tl.float32)
    r = tl.math.rsqrt(tl.sum(x * x, axis=1) / D + eps)
    n = x * r[:, None] * w1[None, :]
    n_partner = xp * r[:, None] * wp1[None, :]
    j = tl.where(first, dims, dims - half)
    cmask = rot & pos_ok
    c = tl.load(cs_ptr + j, mask=cmask, other=0.0).to(tl.float32)
    s = tl.load(cs_ptr + half + j, mask=cmask, other=0.0).to(tl.float32)
    sign = tl.where(first, -1.0, 1.0)
    y = tl.where(rot[None, :], n * c[None, :] + (sign[None, :] * n_partner) * s[None, :], n)
    return y, heads, dims, mask


@triton.jit
def _norm_rope_insert_kernel(
        rows_ptr, row_stride, pos_ptr, table_ptr, table_stride, max_pos,
        wq_ptr, wk_ptr, wiq_ptr, wik_ptr,
        q_out, q_s0, q_s1, k_out, iq_out, iq_s0, iq_s1, ik_out,
        kv_ptr, kv_s0, kv_s1, kv_s2, page_size, num_slots, slot_ptr,
        ks_ptr, ks_s0, ks_s1, vs_ptr, vs_s0, vs_s1,
        ic_ptr, ic_s0, ic_s1, ic_page, ic_num_slots, islot_ptr,
        hq, hkv, hi, half, eps,
        D: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
        KV_FP8: tl.constexpr, KV_FMT: tl.constexpr, KV_HW: tl.constexpr,
        IDX_FP8: tl.constexpr, IDX_FMT: tl.constexpr, IDX_HW: tl.constexpr,
        HAS_IK: tl.constexpr, HEADS_FAST: tl.constexpr):
    # k and index_k are written back into the row (k_out / ik_out: the row's k and index_k
    # columns, row stride row_stride); q and index_q go to (s0, s1)-strided outputs, which
    # may be the row itself. A program owns whole heads and loads a head (both halves)
    # before storing it, so the in-place writes cannot race.
    nqb = tl.cdiv(hq, BLOCK_H)
    nkb = tl.cdiv(hkv, BLOCK_H)
    nib = tl.cdiv(hi, BLOCK_H)
    if HEADS_FAST:  # 1-D grid, a token's head blocks adjacent (axis 1 would cap N at 65,535)
        pid = tl.program_id(0).to(tl.int64)
        nblocks = nqb + nkb + nib + (1 if HAS_IK else 0)
        tok = pid // nblocks
        b = (pid % nblocks).to(tl.int32)
    else:  # grid (N, head blocks): one block kind's programs for consecutive tokens adjacent
        tok = tl.program_id(0).to(tl.int64)
        b = tl.program_id(1)
    row = rows_ptr + tok * row_stride
    pos = tl.load(pos_ptr + tok).to(tl.int64)
    pos_ok = (pos >= 0) & (pos < max_pos)
    cs = table_ptr + tl.where(pos_ok, pos, 0) * table_stride
    if b < nqb:
        y, heads, dims, mask = _norm_rope_tile(row, 0, b * BLOCK_H, hq, wq_ptr, cs, pos_ok,
                                               half, eps, D, BLOCK_H, BLOCK_D)
        # Names differ per branch: compiled Triton merges same-named values across branches.
        q_dst = q_out + tok * q_s0 + heads[:, None].to(tl.int64) * q_s1 + dims[None, :]
        tl.store(q_dst, y.to(q_out.dtype.element_ty), mask=mask)
    elif b < nqb + nkb:
        y, heads, dims, mask = _norm_rope_tile(row, hq * D, (b - nqb) * BLOCK_H, hkv, wk_ptr,
                                               cs, pos_ok, half, eps, D, BLOCK_H, BLOCK_D)
        h64 = heads.to(tl.int64)
        v = tl.load(row + (hq + hkv) * D + h64[:, None] * D + dims[None, :], mask=mask,
                    other=0.0)
        k_dst = k_out + tok * row_stride + h64[:, None] * D + dims[None, :]
        tl.store(k_dst, y.to(k_out.dtype.element_ty), mask=mask)
        slot = tl.load(slot_ptr + tok).to(tl.int64)
        ok = (slot >= 0) & (slot < num_slots)
        sl = tl.where(ok, slot, 0)
        page = sl // page_size
        off = sl % page_size
        kv = kv_ptr + page * kv_s0 + h64[:, None] * kv_s1 + off * kv_s2 + dims[None, :]
        wmask = mask & ok
        if KV_FP8:
            hmask = heads < hkv
            ks = tl.load(ks_ptr + h64 * ks_s0 + sl * ks_s1, mask=hmask, other=1.0)
            vs = tl.load(vs_ptr + h64 * vs_s0 + sl * vs_s1, mask=hmask, other=1.0)
            tl.store(kv, encode_fp8(y / ks[:, None], KV_FMT, KV_HW), mask=wmask)
            tl.store(kv + D, encode_fp8(v.to(tl.float32) / vs[:, None], KV_FMT, KV_HW),
                     mask=wmask)
        else:
            tl.store(kv, y.to(kv_ptr.dtype.element_ty), mask=wmask)
            tl.store(kv + D, v.to(kv_ptr.dtype.element_ty), mask=wmask)
    elif b < nqb + nkb + nib:
        y, heads, dims, mask = _norm_rope_tile(row, (hq + 2 * hkv) * D, (b - nqb - nkb) * BLOCK_H,
                                               hi, wiq_ptr, cs, pos_ok, half, eps, D, BLOCK_H,
                                               BLOCK_D)
        iq_dst = iq_out + tok * iq_s0 + heads[:, None].to(tl.int64) * iq_s1 + dims[None, :]
        if IDX_FP8:
            tl.store(iq_dst, encode_fp8(y, IDX_FMT, IDX_HW), mask=mask)
        else:
            tl.store(iq_dst, y.to(iq_out.dtype.element_ty), mask=mask)
    elif HAS_IK:
        y, heads, dims, mask = _norm_rope_tile(row, (hq + 2 * hkv + hi) * D, 0, 1, wik_ptr, cs,
                                               pos_ok, half, eps, D, BLOCK_H, BLOCK_D)
        ik_dst = ik_out + tok * row_stride + heads[:, None].to(tl.int64) * D + dims[None, :]
        tl.store(ik_dst, y.to(ik_out.dtype.element_ty), mask=mask)
        islot = tl.load(islot_ptr + tok).to(tl.int64)
        iok = (islot >= 0) & (islot < ic_num_slots)
        isl = tl.where(iok, islot, 0)
        ic = (ic_ptr + (isl // ic_page) * ic_s0 + (isl % ic_page) * ic_s1
              + heads[:, None].to(tl.int64) * 0 + dims[None, :])
        if IDX_FP8:
            tl.store(ic, encode_fp8(y, IDX_FMT, IDX_HW), mask=mask & iok)
        else:
            tl.store(ic, y.to(ic_ptr.dtype.element_ty), mask=mask & iok)


#: True when the kernel runs in the (patched) CPU interpreter.
INTERPRETED = is_interpreted(_norm_rope_insert_kernel)


# ---------------------------------------------------------------------------- launcher


def norm_rope_insert(rows, positions, rope_table, w_q, w_k, *, num_q_heads, num_kv_heads,
                     head_dim, rotary_dim, eps, kv_cache, slot_mapping, kv_fmt=None,
                     kv_cache_dtype=None, platform="cuda",
                     num_index_heads=0, has_index_k=False, w_index_q=None, w_index_k=None,
                     k_scale=None, v_scale=None, index_cache=None, index_fmt=None,
                     index_slot_mapping=None, q_out=None, index_q_out=None,
                     skip_index=False, validate=False, block_h=None, num_warps=None,
                     heads_fast=False):
    """Fused norm + RoPE + insert of packed rows ``[N, q | k | v | index_q | index_k]``.

    rows: bf16/fp16 ``[N, row_width]``, last dim contiguous, any row stride (a column slice
    of the server's packed buffer). k and index_k are transformed IN PLACE in ``rows``; q
    in place too unless ``q_out`` (``[N, Hq, D]`` model dtype, any head/token strides) is
    given; index_q in place when the index cache has the model dtype and ``index_q_out`` is
    None, else into ``index_q_out`` (allocated when None: uint8 e4m3 codes for an fp8
    index cache). v is never changed.
    positions: int32/int64 ``[N]``. rope_table: model dtype ``[max_pos, R]`` (cos | sin),
    used as given. kv_cache: logical ``[num_pages, Hkv, P, 2D]`` (any non-negative strides,
    last dim contiguous): uint8 codes of ``kv_fmt`` (an fp8 format), or bf16/fp16
    (``kv_fmt`` = its name); instead of ``kv_fmt``, vLLM's ``kv_cache_dtype`` string may be
    given, read on ``platform`` (cuda / rocm-ocp / rocm-fnuz). slot_mapping: int32/int64
    ``[N]``, negative = skip. Scales: None, a float, or float32 tensors (0-d or
    ``[Hkv, num_pages*P]``), fp8 caches only.
    index_cache ``[num_pages', P', D]``: uint8 e4m3fn/e4m3fnuz codes or the model dtype,
    written at ``index_slot_mapping`` (default: slot_mapping); ``index_fmt`` defaults to
    the platform's e4m3 for a uint8 index cache, the model dtype otherwise.
    ``skip_index=True``: the index heads are neither transformed nor inserted (rows keep
    them as they are; no index cache is needed).
    Tuning knobs (defaults from benchmarks/tune_insert.py on the H200): ``block_h`` heads
    per program, ``num_warps``, ``heads_fast`` (program order: a token's head blocks
    adjacent, instead of one head block's tokens adjacent).
    ``validate=True``: also check tensor contents on the host (slot ranges, duplicate
    slots, positions within the table, positive finite scales) -- a device sync. Without
    it, bad contents are guarded in the kernel: out-of-range or negative slots write
    nothing, out-of-range positions read no table row (their rotated dims are then 0).

    Returns views ``{"q", "k"}`` (``[N, H, D]``), plus ``"index_q"`` ``[N, Hi, D]`` and
    ``"index_k"`` ``[N, D]`` when transformed. The caches are written in place."""
    p = plan_norm_rope_insert(
        rows, positions, rope_table, w_q, w_k, num_q_heads=num_q_heads,
        num_kv_heads=num_kv_heads, head_dim=head_dim, rotary_dim=rotary_dim, eps=eps,
        kv_cache=kv_cache, slot_mapping=slot_mapping, kv_fmt=kv_fmt,
        kv_cache_dtype=kv_cache_dtype, platform=platform, num_index_heads=num_index_heads,
        has_index_k=has_index_k, w_index_q=w_index_q, w_index_k=w_index_k, k_scale=k_scale,
        v_scale=v_scale, index_cache=index_cache, index_fmt=index_fmt,
        index_slot_mapping=index_slot_mapping, q_out=q_out, index_q_out=index_q_out,
        skip_index=skip_index, validate=validate)
    n, hq, hkv, hi, d, out = p.n, p.hq, p.hkv, p.hi, p.d, p.out
    if n == 0:
        return out
    if block_h is None:
        block_h = 64 if INTERPRETED else 4  # tuned: benchmarks/tune_insert.py
    if block_h <= 0 or block_h & (block_h - 1):
        fail("block_h", f"must be a power of two, got {block_h}")
    block_h = min(block_h, triton.next_power_of_2(max(hq, hkv, hi, 1)))
    blocks = (triton.cdiv(hq, block_h) + triton.cdiv(hkv, block_h)
              + (triton.cdiv(hi, block_h) if p.transform_iq else 0) + int(p.write_ik))
    iq = out.get("index_q", rows)
    iq_s = (iq.stride(0), iq.stride(1)) if "index_q" in out else (0, 0)
    ensure_ready(_norm_rope_insert_kernel)
    grid = (n * blocks,) if heads_fast else (n, blocks)
    _norm_rope_insert_kernel[grid](
        rows, rows.stride(0), positions, rope_table, rope_table.stride(0), rope_table.shape[0],
        w_q, w_k, w_index_q if p.transform_iq else w_q, w_index_k if p.write_ik else w_q,
        out["q"], out["q"].stride(0), out["q"].stride(1), rows[:, hq * d:],
        iq, iq_s[0], iq_s[1], rows[:, p.width - d:],
        kv_cache, kv_cache.stride(0), kv_cache.stride(1), kv_cache.stride(2), p.page,
        p.num_slots, slot_mapping, p.ks, *p.ks_strides, p.vs, *p.vs_strides,
        p.ic, *p.ic_strides, p.ic_page, p.ic_slots, p.islots,
        hq, hkv, hi if p.transform_iq else 0, rotary_dim // 2, float(eps),
        D=d, BLOCK_H=block_h, BLOCK_D=triton.next_power_of_2(d),
        KV_FP8=p.kv_fp8, KV_FMT=fmt_code(p.kv_fmt) if p.kv_fp8 else 0,
        KV_HW=p.kv_fp8 and p.kv_fmt in HW_FORMATS,
        IDX_FP8=p.idx_fp8, IDX_FMT=fmt_code(p.index_fmt) if p.idx_fp8 else 0,
        IDX_HW=p.idx_fp8 and p.index_fmt in HW_FORMATS, HAS_IK=p.write_ik,
        HEADS_FAST=bool(heads_fast), num_warps=num_warps or (4 if INTERPRETED else 1))
    return out


def compile_signatures():
    """(kernel, signature, constexprs) triples covering the constexpr branches, for the
    sm_90 compile check that runs on the CPU (tests/test_compile_sm90.py): compiled Triton
    rejects some code the interpreter accepts."""
    combos = [  # act, kv, kv fmt, hw, index, index fmt, hw, has index_k
        ("bf16", "u8", 0, True, "u8", 0, True, True),
        ("fp16", "fp16", 0, False, "fp16", 0, False, True),
        ("bf16", "u8", 3, False, "u8", 2, False, True),
        ("bf16", "u8", 1, True, "bf16", 0, False, False),
    ]
    out = []
    for act, kv, kv_fmt, kv_hw, idx, idx_fmt, idx_hw, has_ik in combos:
        sig = {name: "i64" for name in _norm_rope_insert_kernel.arg_names}
        for name in ("rows_ptr", "table_ptr", "wq_ptr", "wk_ptr", "wiq_ptr", "wik_ptr",
                     "q_out", "k_out", "ik_out"):
            sig[name] = f"*{act}"
        sig.update(pos_ptr="*i64", slot_ptr="*i32", islot_ptr="*i64", ks_ptr="*fp32",
                   vs_ptr="*fp32", kv_ptr=f"*{kv}", ic_ptr=f"*{idx}", iq_out=f"*{idx}",
                   hq="i32", hkv="i32", hi="i32", half="i32", eps="fp32")
        const = dict(D=128, BLOCK_H=4, BLOCK_D=128, KV_FP8=kv == "u8", KV_FMT=kv_fmt,
                     KV_HW=kv_hw, IDX_FP8=idx == "u8", IDX_FMT=idx_fmt, IDX_HW=idx_hw,
                     HAS_IK=has_ik, HEADS_FAST=kv_fmt == 1)
        sig.update(dict.fromkeys(const, "constexpr"))
        out.append((_norm_rope_insert_kernel, sig, const))
    return out


# ----------------------------------------------------------------------------- adapter


run = insert_adapter(norm_rope_insert)


def _register():
    from oracle.registry import Implementation, register

    # Interpreted (CPU), a small case takes a few seconds: model shapes are left to CUDA.
    classes = ("tiny", "small") if INTERPRETED else ("tiny", "small", "model", "sweep")
    register(Implementation(
        "triton", "norm_rope_insert", run, devices=("cpu", "cuda"), shape_classes=classes,
        quantize_from="value",
        notes="one Triton launch: fp32 Gemma RMSNorm + partial NeoX RoPE (gathered partner "
              "lanes, any even R), K from its fp32 value, fp8 via kernels.fp8.encode_fp8"))


_register()
