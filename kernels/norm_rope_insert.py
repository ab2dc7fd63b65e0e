"""Fused Gemma RMSNorm + partial NeoX RoPE + paged KV / index-cache insert in ONE Triton
kernel (SPEC.md sections 3, 4; issue 5).

One launch per batch. The grid is ``(N, blocks)``: axis 1 enumerates blocks of BLOCK_H heads
of q, then of k (each k program also inserts its K and V heads into the paged cache), then
of index_q, then (when present) the single index_k head (which also goes into the index
cache). Per head: ``n = x * rsqrt(mean(x^2) + eps) * (1 + w)`` in fp32, then rotate-half
RoPE with the table row of the token's position, as given. Any even R <= D: a head is
loaded as three contiguous segments, the rotated halves [0, R/2) and [R/2, R) (each other's
RoPE partners, element by element) and the pass-through dims [R, D), each padded to a power
of two and masked, so R/2 need not be a power of two and every load is a vector load (a
gathered partner load made the first version instruction-bound on the H200).

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
def _norm_rope_head(row_ptr, col0, head0, n_heads, w_ptr, cs_ptr, pos_ok, eps,
                    D: tl.constexpr, HALF: tl.constexpr, BLOCK_H: tl.constexpr,
                    BLOCK_HALF: tl.constexpr, BLOCK_REST: tl.constexpr):
    """fp32 norm + RoPE of heads head0.. of one kind (starting at column col0 of the row),
    in three segments of a head: the rotated halves [0, HALF) and [HALF, 2 HALF), and the
    pass-through dims [2 HALF, D). Each segment is a contiguous (vectorised) load: no
    gathered partner lanes, and any even R works (a segment's tail is masked). Returns the
    three fp32 segments, the heads and their mask."""
    heads = head0 + tl.arange(0, BLOCK_H)
    hmask = heads < n_heads
    a = tl.arange(0, BLOCK_HALF)
    amask = hmask[:, None] & (a < HALF)[None, :]
    base = row_ptr + col0 + heads[:, None].to(tl.int64) * D
    x1 = tl.load(base + a[None, :], mask=amask, other=0.0).to(tl.float32)
    x2 = tl.load(base + HALF + a[None, :], mask=amask, other=0.0).to(tl.float32)
    ss = tl.sum(x1 * x1, axis=1) + tl.sum(x2 * x2, axis=1)
    if 2 * HALF < D:
        p = 2 * HALF + tl.arange(0, BLOCK_REST)
        pmask = p < D
        x3 = tl.load(base + p[None, :], mask=hmask[:, None] & pmask[None, :],
                     other=0.0).to(tl.float32)
        ss += tl.sum(x3 * x3, axis=1)
        w3 = 1.0 + tl.load(w_ptr + p, mask=pmask, other=0.0).to(tl.float32)
    r = tl.math.rsqrt(ss / D + eps)[:, None]
    w1 = 1.0 + tl.load(w_ptr + a, mask=a < HALF, other=0.0).to(tl.float32)
    w2 = 1.0 + tl.load(w_ptr + HALF + a, mask=a < HALF, other=0.0).to(tl.float32)
    n1 = x1 * r * w1[None, :]
    n2 = x2 * r * w2[None, :]
    cmask = (a < HALF) & pos_ok
    c = tl.load(cs_ptr + a, mask=cmask, other=0.0).to(tl.float32)[None, :]
    s = tl.load(cs_ptr + HALF + a, mask=cmask, other=0.0).to(tl.float32)[None, :]
    y1 = n1 * c - n2 * s
    y2 = n2 * c + n1 * s
    if 2 * HALF < D:
        y3 = x3 * r * w3[None, :]
    else:
        y3 = tl.zeros((BLOCK_H, BLOCK_REST), tl.float32)
    return y1, y2, y3, heads, hmask


@triton.jit
def _store_head(dst, y1, y2, y3, hmask, D: tl.constexpr, HALF: tl.constexpr,
                BLOCK_HALF: tl.constexpr, BLOCK_REST: tl.constexpr):
    """Store the three segments of heads (dst: [BLOCK_H, 1] pointers to their dim 0)."""
    a = tl.arange(0, BLOCK_HALF)
    amask = hmask[:, None] & (a < HALF)[None, :]
    tl.store(dst + a[None, :], y1, mask=amask)
    tl.store(dst + HALF + a[None, :], y2, mask=amask)
    if 2 * HALF < D:
        p = 2 * HALF + tl.arange(0, BLOCK_REST)
        tl.store(dst + p[None, :], y3, mask=hmask[:, None] & (p < D)[None, :])


@triton.jit
def _norm_rope_insert_kernel(
        rows_ptr, row_stride, pos_ptr, table_ptr, table_stride, max_pos,
        wq_ptr, wk_ptr, wiq_ptr, wik_ptr,
        q_out, q_s0, q_s1, k_out, iq_out, iq_s0, iq_s1, ik_out,
        kv_ptr, kv_s0, kv_s1, kv_s2, page_size, num_slots, slot_ptr,
        ks_ptr, ks_s0, ks_s1, vs_ptr, vs_s0, vs_s1,
        ic_ptr, ic_s0, ic_s1, ic_page, ic_num_slots, islot_ptr,
        hq, hkv, hi, eps,
        D: tl.constexpr, HALF: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
        BLOCK_HALF: tl.constexpr, BLOCK_REST: tl.constexpr,
        KV_FP8: tl.constexpr, KV_FMT: tl.constexpr, KV_HW: tl.constexpr,
        IDX_FP8: tl.constexpr, IDX_FMT: tl.constexpr, IDX_HW: tl.constexpr,
        HAS_IK: tl.constexpr, HEADS_FAST: tl.constexpr):
    # k and index_k are written back into the row (k_out / ik_out: the row's k and index_k
    # columns, row stride row_stride); q and index_q go to (s0, s1)-strided outputs, which
    # may be the row itself. A program owns whole heads and loads a head (all segments)
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
        y1, y2, y3, heads, hmask = _norm_rope_head(
            row, 0, b * BLOCK_H, hq, wq_ptr, cs, pos_ok, eps, D, HALF, BLOCK_H, BLOCK_HALF,
            BLOCK_REST)
        # Names differ per branch: compiled Triton merges same-named values across branches.
        q_dst = q_out + tok * q_s0 + heads[:, None].to(tl.int64) * q_s1
        qt = q_out.dtype.element_ty
        _store_head(q_dst, y1.to(qt), y2.to(qt), y3.to(qt), hmask, D, HALF, BLOCK_HALF,
                    BLOCK_REST)
    elif b < nqb + nkb:
        y1, y2, y3, heads, hmask = _norm_rope_head(
            row, hq * D, (b - nqb) * BLOCK_H, hkv, wk_ptr, cs, pos_ok, eps, D, HALF, BLOCK_H,
            BLOCK_HALF, BLOCK_REST)
        h64 = heads.to(tl.int64)
        dims = tl.arange(0, BLOCK_D)
        vmask = hmask[:, None] & (dims < D)[None, :]
        v = tl.load(row + (hq + hkv) * D + h64[:, None] * D + dims[None, :], mask=vmask,
                    other=0.0)
        kt = k_out.dtype.element_ty
        _store_head(k_out + tok * row_stride + h64[:, None] * D, y1.to(kt), y2.to(kt),
                    y3.to(kt), hmask, D, HALF, BLOCK_HALF, BLOCK_REST)
        slot = tl.load(slot_ptr + tok).to(tl.int64)
        ok = (slot >= 0) & (slot < num_slots)
        sl = tl.where(ok, slot, 0)
        kv = kv_ptr + (sl // page_size) * kv_s0 + h64[:, None] * kv_s1 + (sl % page_size) * kv_s2
        wmask = hmask & ok
        if KV_FP8:
            ks = tl.load(ks_ptr + h64 * ks_s0 + sl * ks_s1, mask=hmask, other=1.0)[:, None]
            vs = tl.load(vs_ptr + h64 * vs_s0 + sl * vs_s1, mask=hmask, other=1.0)[:, None]
            _store_head(kv, encode_fp8(y1 / ks, KV_FMT, KV_HW),
                        encode_fp8(y2 / ks, KV_FMT, KV_HW), encode_fp8(y3 / ks, KV_FMT, KV_HW),
                        wmask, D, HALF, BLOCK_HALF, BLOCK_REST)
            tl.store(kv + D + dims[None, :], encode_fp8(v.to(tl.float32) / vs, KV_FMT, KV_HW),
                     mask=vmask & ok)
        else:
            ct = kv_ptr.dtype.element_ty
            _store_head(kv, y1.to(ct), y2.to(ct), y3.to(ct), wmask, D, HALF, BLOCK_HALF,
                        BLOCK_REST)
            tl.store(kv + D + dims[None, :], v.to(ct), mask=vmask & ok)
    elif b < nqb + nkb + nib:
        y1, y2, y3, heads, hmask = _norm_rope_head(
            row, (hq + 2 * hkv) * D, (b - nqb - nkb) * BLOCK_H, hi, wiq_ptr, cs, pos_ok, eps,
            D, HALF, BLOCK_H, BLOCK_HALF, BLOCK_REST)
        iq_dst = iq_out + tok * iq_s0 + heads[:, None].to(tl.int64) * iq_s1
        if IDX_FP8:
            _store_head(iq_dst, encode_fp8(y1, IDX_FMT, IDX_HW), encode_fp8(y2, IDX_FMT, IDX_HW),
                        encode_fp8(y3, IDX_FMT, IDX_HW), hmask, D, HALF, BLOCK_HALF,
                        BLOCK_REST)
        else:
            it = iq_out.dtype.element_ty
            _store_head(iq_dst, y1.to(it), y2.to(it), y3.to(it), hmask, D, HALF, BLOCK_HALF,
                        BLOCK_REST)
    elif HAS_IK:
        y1, y2, y3, heads, hmask = _norm_rope_head(
            row, (hq + 2 * hkv + hi) * D, 0, 1, wik_ptr, cs, pos_ok, eps, D, HALF, BLOCK_H,
            BLOCK_HALF, BLOCK_REST)
        ikt = ik_out.dtype.element_ty
        _store_head(ik_out + tok * row_stride + heads[:, None].to(tl.int64) * D, y1.to(ikt),
                    y2.to(ikt), y3.to(ikt), hmask, D, HALF, BLOCK_HALF, BLOCK_REST)
        islot = tl.load(islot_ptr + tok).to(tl.int64)
        iok = (islot >= 0) & (islot < ic_num_slots)
        isl = tl.where(iok, islot, 0)
        ic = (ic_ptr + (isl // ic_page) * ic_s0 + (isl % ic_page) * ic_s1
              + heads[:, None].to(tl.int64) * 0)
        if IDX_FP8:
            _store_head(ic, encode_fp8(y1, IDX_FMT, IDX_HW), encode_fp8(y2, IDX_FMT, IDX_HW),
                        encode_fp8(y3, IDX_FMT, IDX_HW), hmask & iok, D, HALF, BLOCK_HALF,
                        BLOCK_REST)
        else:
            ict = ic_ptr.dtype.element_ty
            _store_head(ic, y1.to(ict), y2.to(ict), y3.to(ict), hmask & iok, D, HALF,
                        BLOCK_HALF, BLOCK_REST)


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
        hq, hkv, hi if p.transform_iq else 0, float(eps),
        D=d, HALF=rotary_dim // 2, BLOCK_H=block_h, BLOCK_D=triton.next_power_of_2(d),
        BLOCK_HALF=triton.next_power_of_2(max(rotary_dim // 2, 1)),
        BLOCK_REST=triton.next_power_of_2(max(d - rotary_dim, 1)),
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
                   hq="i32", hkv="i32", hi="i32", eps="fp32")
        half = 32 if kv_fmt != 3 else 24  # R 64, and R 48 (segments not powers of two)
        const = dict(D=128, HALF=half, BLOCK_H=4, BLOCK_D=128, BLOCK_HALF=32,
                     BLOCK_REST=triton.next_power_of_2(128 - 2 * half), KV_FP8=kv == "u8",
                     KV_FMT=kv_fmt, KV_HW=kv_hw, IDX_FP8=idx == "u8", IDX_FMT=idx_fmt,
                     IDX_HW=idx_hw, HAS_IK=has_ik, HEADS_FAST=kv_fmt == 1)
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
        notes="one Triton launch: fp32 Gemma RMSNorm + partial NeoX RoPE (three contiguous "
              "segments per head, any even R), K from its fp32 value, fp8 via "
              "kernels.fp8.encode_fp8"))


_register()
