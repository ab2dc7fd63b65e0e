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

import numpy as np
import torch

from kernels._triton import ensure_ready, is_interpreted, tl, triton
from kernels.fp8 import HW_FORMATS, encode_fp8, fmt_code

MODEL_DTYPES = {torch.bfloat16: "bfloat16", torch.float16: "float16"}
KV_FP8_FORMATS = ("e4m3fn", "e5m2", "e4m3fnuz", "e5m2fnuz")
INDEX_FP8_FORMATS = ("e4m3fn", "e4m3fnuz")
HEAD_DIMS = (64, 128, 256)


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
        q_out, k_out, iq_out, ik_out,
        kv_ptr, kv_s0, kv_s1, kv_s2, page_size, num_slots, slot_ptr,
        ks_ptr, ks_s0, ks_s1, vs_ptr, vs_s0, vs_s1,
        ic_ptr, ic_s0, ic_s1, ic_page, ic_num_slots, islot_ptr,
        hq, hkv, hi, half, eps,
        D: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
        KV_FP8: tl.constexpr, KV_FMT: tl.constexpr, KV_HW: tl.constexpr,
        IDX_FP8: tl.constexpr, IDX_FMT: tl.constexpr, IDX_HW: tl.constexpr,
        WRITE_INDEX: tl.constexpr):
    tok = tl.program_id(0).to(tl.int64)
    b = tl.program_id(1)
    nqb = tl.cdiv(hq, BLOCK_H)
    nkb = tl.cdiv(hkv, BLOCK_H)
    nib = tl.cdiv(hi, BLOCK_H)
    row = rows_ptr + tok * row_stride
    pos = tl.load(pos_ptr + tok).to(tl.int64)
    pos_ok = (pos >= 0) & (pos < max_pos)
    cs = table_ptr + tl.where(pos_ok, pos, 0) * table_stride
    if b < nqb:
        y, heads, dims, mask = _norm_rope_tile(row, 0, b * BLOCK_H, hq, wq_ptr, cs, pos_ok,
                                               half, eps, D, BLOCK_H, BLOCK_D)
        # Names differ per branch: compiled Triton merges same-named values across branches.
        q_dst = q_out + (tok * hq + heads[:, None].to(tl.int64)) * D + dims[None, :]
        tl.store(q_dst, y.to(q_out.dtype.element_ty), mask=mask)
    elif b < nqb + nkb:
        y, heads, dims, mask = _norm_rope_tile(row, hq * D, (b - nqb) * BLOCK_H, hkv, wk_ptr,
                                               cs, pos_ok, half, eps, D, BLOCK_H, BLOCK_D)
        h64 = heads.to(tl.int64)
        k_dst = k_out + (tok * hkv + h64[:, None]) * D + dims[None, :]
        tl.store(k_dst, y.to(k_out.dtype.element_ty), mask=mask)
        v = tl.load(row + (hq + hkv) * D + h64[:, None] * D + dims[None, :], mask=mask,
                    other=0.0)
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
        iq_dst = iq_out + (tok * hi + heads[:, None].to(tl.int64)) * D + dims[None, :]
        if IDX_FP8:
            tl.store(iq_dst, encode_fp8(y, IDX_FMT, IDX_HW), mask=mask)
        else:
            tl.store(iq_dst, y.to(iq_out.dtype.element_ty), mask=mask)
    else:
        y, heads, dims, mask = _norm_rope_tile(row, (hq + 2 * hkv + hi) * D, 0, 1, wik_ptr, cs,
                                               pos_ok, half, eps, D, BLOCK_H, BLOCK_D)
        ik_dst = ik_out + tok * D + heads[:, None].to(tl.int64) * D + dims[None, :]
        tl.store(ik_dst, y.to(ik_out.dtype.element_ty), mask=mask)
        if WRITE_INDEX:
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


def _fail(name, msg):
    raise ValueError(f"{name} {msg}")


def _check_tensor(t, name, dtypes, shape=None, device=None):
    if not isinstance(t, torch.Tensor):
        _fail(name, f"must be a torch tensor, got {type(t).__name__}")
    if t.dtype not in dtypes:
        _fail(name, f"must have dtype in {[str(d) for d in dtypes]}, got {t.dtype}")
    if shape is not None and tuple(t.shape) != tuple(shape):
        _fail(name, f"must have shape {list(shape)}, got {list(t.shape)}")
    if device is not None and t.device != device:
        _fail(name, f"must be on {device}, got {t.device}")
    return t


def _scale_arg(scale, name, fp8, hkv, num_slots, dev):
    """(tensor, stride over heads, stride over slots) of a None / scalar / [Hkv, slots]
    float32 scale; model-dtype caches take no scale (None or 1.0)."""
    if scale is None:
        return torch.ones(1, dtype=torch.float32, device=dev), 0, 0
    if isinstance(scale, (float, int, np.floating, np.integer)) and not isinstance(scale, bool):
        scale = torch.tensor(float(np.float32(scale)), dtype=torch.float32, device=dev)
    _check_tensor(scale, name, (torch.float32,), device=dev)
    if scale.dim() == 0 or (scale.dim() == 1 and scale.numel() == 1):
        if not fp8 and float(scale.reshape(())) != 1.0:
            _fail(name, "applies to fp8 caches only; model-dtype caches take no scale")
        return scale.reshape(1), 0, 0
    if scale.shape != (hkv, num_slots):
        _fail(name, f"must be a scalar or of shape [Hkv, num_pages*P] = [{hkv}, {num_slots}], "
                    f"got {list(scale.shape)}")
    if not fp8:
        _fail(name, "applies to fp8 caches only; model-dtype caches take no scale")
    return scale, scale.stride(0), scale.stride(1)


def norm_rope_insert(rows, positions, rope_table, w_q, w_k, *, num_q_heads, num_kv_heads,
                     head_dim, rotary_dim, eps, kv_cache, kv_fmt, slot_mapping,
                     num_index_heads=0, has_index_k=False, w_index_q=None, w_index_k=None,
                     k_scale=None, v_scale=None, index_cache=None, index_fmt=None,
                     index_slot_mapping=None, block_h=None):
    """Fused norm + RoPE + insert of packed rows ``[N, q | k | v | index_q | index_k]``.

    rows: bf16/fp16 ``[N, row_width]``, last dim contiguous, any row stride (a column slice
    of the server's packed buffer). positions: int32/int64 ``[N]``. rope_table: model dtype
    ``[max_pos, R]`` (cos | sin), used as given. kv_cache: logical ``[num_pages, Hkv, P, 2D]``
    (any strides, last dim contiguous): uint8 codes of ``kv_fmt`` (an fp8 format), or
    bf16/fp16 (``kv_fmt`` = its name, normally the model dtype). slot_mapping: int32/int64
    ``[N]``, negative = skip. Scales: None, a float, or float32 tensors (0-d or
    ``[Hkv, num_pages*P]``).
    index_cache ``[num_pages', P', D]``: uint8 e4m3fn/e4m3fnuz codes or the model dtype,
    written at ``index_slot_mapping`` (default: slot_mapping).

    Returns ``{"q", "k"}`` (model dtype ``[N, H, D]``), plus ``"index_q"`` ``[N, Hi, D]``
    (uint8 codes when the index cache is fp8, else model dtype) and ``"index_k"`` ``[N, D]``
    when the layout has them. The caches are written in place."""
    _check_tensor(rows, "rows", tuple(MODEL_DTYPES))
    dev, act = rows.device, rows.dtype
    md = MODEL_DTYPES[act]
    for name, value in (("num_q_heads", num_q_heads), ("num_kv_heads", num_kv_heads),
                        ("num_index_heads", num_index_heads)):
        if not isinstance(value, (int, np.integer)) or isinstance(value, bool) or value < 0 \
                or (value == 0 and name != "num_index_heads"):
            _fail(name, f"must be a {'non-negative' if name == 'num_index_heads' else 'positive'}"
                        f" integer, got {value!r}")
    hq, hkv, hi = int(num_q_heads), int(num_kv_heads), int(num_index_heads)
    if hq % hkv:
        _fail("num_q_heads", f"must be a multiple of num_kv_heads={hkv}, got {hq}")
    if head_dim not in HEAD_DIMS:
        _fail("head_dim", f"must be one of {list(HEAD_DIMS)}, got {head_dim!r}")
    d = int(head_dim)
    if not isinstance(rotary_dim, (int, np.integer)) or isinstance(rotary_dim, bool) \
            or rotary_dim < 2 or rotary_dim % 2 or rotary_dim > d:
        _fail("rotary_dim", f"must be an even integer with 2 <= rotary_dim <= head_dim={d}, "
                            f"got {rotary_dim!r}")
    if not (isinstance(eps, (float, int, np.floating)) and np.isfinite(eps) and eps >= 0):
        _fail("eps", f"must be a finite number >= 0, got {eps!r}")
    has_ik = bool(has_index_k)
    width = (hq + 2 * hkv + hi) * d + (d if has_ik else 0)
    if rows.dim() != 2 or rows.shape[1] != width:
        _fail("rows", f"must have shape [N, row_width={width}], got {list(rows.shape)}")
    if rows.shape[1] and rows.stride(1) != 1:
        _fail("rows", "must have a contiguous last dim (stride 1)")
    n = rows.shape[0]
    _check_tensor(positions, "positions", (torch.int32, torch.int64), (n,), dev)
    _check_tensor(rope_table, "rope_table", (act,), device=dev)
    if rope_table.dim() != 2 or rope_table.shape[1] != rotary_dim or rope_table.shape[0] < 1:
        _fail("rope_table", f"must have shape [max_positions, rotary_dim={rotary_dim}], got "
                            f"{list(rope_table.shape)}")
    if rope_table.stride(1) != 1:
        _fail("rope_table", "must have a contiguous last dim (stride 1)")
    weights = {"w_q": w_q, "w_k": w_k, "w_index_q": w_index_q, "w_index_k": w_index_k}
    needed = {"w_q": True, "w_k": True, "w_index_q": hi > 0, "w_index_k": has_ik}
    for name, w in weights.items():
        if needed[name]:
            _check_tensor(w, name, (act,), (d,), dev)
            if w.stride(0) != 1:
                _fail(name, "must be contiguous")
    # --- main cache
    half_fmts = {name: dt for dt, name in MODEL_DTYPES.items()}
    if kv_fmt not in KV_FP8_FORMATS + tuple(half_fmts):
        _fail("kv_fmt", f"must be one of {list(KV_FP8_FORMATS + tuple(half_fmts))}, got "
                        f"{kv_fmt!r}")
    kv_fp8 = kv_fmt in KV_FP8_FORMATS
    _check_tensor(kv_cache, "kv_cache", (torch.uint8,) if kv_fp8 else (half_fmts[kv_fmt],),
                  device=dev)
    if kv_cache.dim() != 4 or kv_cache.shape[1] != hkv or kv_cache.shape[3] != 2 * d:
        _fail("kv_cache", f"must have logical shape [num_pages, Hkv={hkv}, P, 2D={2 * d}], got "
                          f"{list(kv_cache.shape)}")
    if kv_cache.stride(3) != 1:
        _fail("kv_cache", "must have a contiguous last dim (stride 1)")
    num_pages, _, page, _ = kv_cache.shape
    num_slots = num_pages * page
    _check_tensor(slot_mapping, "slot_mapping", (torch.int32, torch.int64), (n,), dev)
    ks, ks0, ks1 = _scale_arg(k_scale, "k_scale", kv_fp8, hkv, num_slots, dev)
    vs, vs0, vs1 = _scale_arg(v_scale, "v_scale", kv_fp8, hkv, num_slots, dev)
    # --- index cache
    if index_fmt is not None and index_fmt not in INDEX_FP8_FORMATS + (md,):
        _fail("index_fmt", f"must be one of {list(INDEX_FP8_FORMATS + (md,))} or None, got "
                           f"{index_fmt!r}")
    idx_fp8 = index_fmt in INDEX_FP8_FORMATS
    if index_cache is None:
        if has_ik:
            _fail("index_cache", "is required when the layout has index_k")
        ic, ic_s0, ic_s1, ic_page, ic_slots = torch.empty(1, dtype=act, device=dev), 0, 0, 1, 0
    else:
        if not has_ik:
            _fail("index_cache", "given but the layout has no index_k (dense rows)")
        if index_fmt is None:
            _fail("index_fmt", "must name the index cache's format")
        _check_tensor(index_cache, "index_cache", (torch.uint8,) if idx_fp8 else (act,),
                      device=dev)
        if index_cache.dim() != 3 or index_cache.shape[2] != d:
            _fail("index_cache", f"must have shape [num_pages, P, D={d}], got "
                                 f"{list(index_cache.shape)}")
        if index_cache.stride(2) != 1:
            _fail("index_cache", "must have a contiguous last dim (stride 1)")
        ic = index_cache
        ic_s0, ic_s1 = index_cache.stride(0), index_cache.stride(1)
        ic_page = index_cache.shape[1]
        ic_slots = index_cache.shape[0] * ic_page
    if index_slot_mapping is None:
        islots = slot_mapping
    else:
        islots = _check_tensor(index_slot_mapping, "index_slot_mapping",
                               (torch.int32, torch.int64), (n,), dev)
    # --- outputs
    out = {"q": torch.empty((n, hq, d), dtype=act, device=dev),
           "k": torch.empty((n, hkv, d), dtype=act, device=dev)}
    dummy = torch.empty(1, dtype=act, device=dev)
    if hi:
        out["index_q"] = torch.empty((n, hi, d), dtype=torch.uint8 if idx_fp8 else act,
                                     device=dev)
    if has_ik:
        out["index_k"] = torch.empty((n, d), dtype=act, device=dev)
    if n == 0:
        return out
    if block_h is None:
        block_h = 64 if INTERPRETED else 4
    if block_h <= 0 or block_h & (block_h - 1):
        _fail("block_h", f"must be a power of two, got {block_h}")
    block_h = min(block_h, triton.next_power_of_2(max(hq, hkv, hi, 1)))
    blocks = (triton.cdiv(hq, block_h) + triton.cdiv(hkv, block_h) + triton.cdiv(hi, block_h)
              + int(has_ik))
    kv_code = fmt_code(kv_fmt) if kv_fp8 else 0
    idx_code = fmt_code(index_fmt) if idx_fp8 else 0
    w_iq = w_index_q if hi else w_q
    w_ik = w_index_k if has_ik else w_q
    ensure_ready(_norm_rope_insert_kernel)
    _norm_rope_insert_kernel[(n, blocks)](
        rows, rows.stride(0), positions, rope_table, rope_table.stride(0), rope_table.shape[0],
        w_q, w_k, w_iq, w_ik,
        out["q"], out["k"], out.get("index_q", dummy), out.get("index_k", dummy),
        kv_cache, kv_cache.stride(0), kv_cache.stride(1), kv_cache.stride(2), page, num_slots,
        slot_mapping, ks, ks0, ks1, vs, vs0, vs1,
        ic, ic_s0, ic_s1, ic_page, ic_slots, islots,
        hq, hkv, hi, rotary_dim // 2, float(eps),
        D=d, BLOCK_H=block_h, BLOCK_D=triton.next_power_of_2(d),
        KV_FP8=kv_fp8, KV_FMT=kv_code, KV_HW=kv_fp8 and kv_fmt in HW_FORMATS,
        IDX_FP8=idx_fp8, IDX_FMT=idx_code, IDX_HW=idx_fp8 and index_fmt in HW_FORMATS,
        WRITE_INDEX=index_cache is not None)
    return out


# ----------------------------------------------------------------------------- adapter


def _strided_codes_in(codes: np.ndarray, dev, torch_dtype=None) -> torch.Tensor:
    """A COPY of a code array on the device with the same element strides (so HND, NHD and
    padded layouts reach the kernel as they are), viewed as torch_dtype if given."""
    from oracle.impl_torch import _codes_in

    c = np.asarray(codes)
    item = c.itemsize
    strides = tuple(s // item for s in c.strides)
    if c.size == 0 or any(s < 0 for s in strides):
        t = _codes_in(c, dev)
    else:
        extent = 1 + sum((n - 1) * s for n, s in zip(c.shape, strides))
        buf = _codes_in(np.zeros(extent, c.dtype), dev)
        t = torch.as_strided(buf, c.shape, strides)
        t.copy_(_codes_in(c, dev))
    return t if torch_dtype is None else t.view(torch_dtype)


def run(inputs: dict) -> dict:
    """Oracle adapter (op ``norm_rope_insert``): impl_torch's input/output conventions;
    returns numpy codes; never modifies its inputs."""
    from oracle.impl_torch import HALF_DTYPES, _codes_out, _ints, _values, device

    x = inputs
    dev = device()
    md = x["model_dtype"]
    act = HALF_DTYPES[md]
    d = x["head_dim"]
    rows_np = x["rows"]
    n, width = rows_np.shape
    # The rows as a column slice of a wider buffer, as servers pass them.
    buf = torch.zeros((n, width + 16), dtype=act, device=dev)
    rows = buf[:, 8:8 + width]
    rows.copy_(_values(rows_np, act, dev))
    kv_fmt, index_fmt = x["kv_fmt"], x["index_fmt"]
    kv_dtype = HALF_DTYPES.get(kv_fmt)
    kv = _strided_codes_in(x["kv_cache"], dev, kv_dtype)
    ic = None
    if x.get("index_cache") is not None:
        ic = _strided_codes_in(x["index_cache"], dev, act if index_fmt == md else None)

    def scale(s):
        if s is None:
            return None
        s = np.asarray(s, np.float32)
        return torch.from_numpy(np.ascontiguousarray(s)).to(dev)

    w = {kind: _values(x[f"weights_{kind}"], act, dev)
         for kind in ("q", "k", "index_q", "index_k")}
    out = norm_rope_insert(
        rows, _ints(x["positions"], dev), _values(x["rope_table"], act, dev), w["q"], w["k"],
        num_q_heads=x["num_q_heads"], num_kv_heads=x["num_kv_heads"], head_dim=d,
        rotary_dim=x["rotary_dim"], eps=x["eps"], kv_cache=kv, kv_fmt=kv_fmt,
        slot_mapping=_ints(x["slot_mapping"], dev), num_index_heads=x["num_index_heads"],
        has_index_k=x["has_index_k"], w_index_q=w["index_q"], w_index_k=w["index_k"],
        k_scale=scale(x["k_scale"]), v_scale=scale(x["v_scale"]), index_cache=ic,
        index_fmt=index_fmt if ic is not None else None)
    res = {}
    for key, t in out.items():
        res[key] = _codes_out(t if t.dtype == torch.uint8 else t.view(torch.int16))
    res["kv_cache"] = _codes_out(kv if kv.dtype == torch.uint8 else kv.view(torch.int16))
    if ic is not None:
        res["index_cache"] = _codes_out(ic if ic.dtype == torch.uint8 else ic.view(torch.int16))
    return res


def _register():
    from oracle.registry import Implementation, register

    # Interpreted (CPU), a small case takes a few seconds: model shapes are left to CUDA.
    classes = ("tiny", "small") if INTERPRETED else ("tiny", "small", "model")
    register(Implementation(
        "triton", "norm_rope_insert", run, devices=("cpu", "cuda"), shape_classes=classes,
        quantize_from="value",
        notes="one Triton launch: fp32 Gemma RMSNorm + partial NeoX RoPE (gathered partner "
              "lanes, any even R), K from its fp32 value, fp8 via kernels.fp8.encode_fp8"))


_register()
