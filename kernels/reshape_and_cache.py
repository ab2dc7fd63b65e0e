"""Separate (unfused) paged KV-cache insert, the "two-rounding" path, in one Triton kernel
(contract.md section 4): K and V arrive already rounded to the model dtype (bf16/fp16).

One launch per batch; the grid is ``(N, cdiv(Hkv, BLOCK_H))``: a program writes BLOCK_H KV
heads of one token. For token t with slot s = slot_mapping[t] (negative: skip; past the
cache: skipped too, a guard, since contents are only checked under ``validate=True``),
K/V head j go to ``cache[s // P, j, s % P, 0:D]`` / ``[..., D:2D]``.

- Model-dtype cache: the 16-bit patterns are copied (loaded and stored as int16), so -0,
  Inf and NaN payloads arrive unchanged, interpreted or compiled.
- The other 16-bit dtype (bf16 K/V into an fp16 cache or back; the reference and the fused
  kernel define it, the report's case set has it): widened exactly to fp32, rounded once
  (RNE, overflow to Inf, NaN stays NaN).
- fp8 cache (uint8 codes): ``encode_fp8(value_fp32 / scale)``, satfinite RNE (the hardware
  casts for e4m3fn/e5m2, the software codec for the fnuz formats), i.e. K is quantised from
  its model-dtype value: ``quantize_from="model_dtype"``. The division is Triton's fp32
  ``/`` (declared by the default ``Fp32Arith.div_rel``; exact for the default scale 1).

The cache is addressed through its strides (HND, NHD, padded) with 64-bit offsets; K, V and
slot_mapping through theirs too (only the last dim of K/V must be contiguous).

``reshape_and_cache(...)`` is the host launcher (validates dtypes, shapes, strides, formats
and scales; raises ValueError naming the argument); oracle/impls/triton.py registers it as
implementation ``"triton"`` of op ``"reshape_and_cache"``.
"""

from __future__ import annotations

import numpy as np
import torch

from kernels._host import (
    HALF_FORMATS,
    HEAD_DIMS,
    MODEL_DTYPES,
    SLOT_DTYPES,
    check_kv_cache,
    check_kv_fmt,
    check_last_dim_contiguous,
    check_tensor,
    fail,
    scale_arg,
    validate_slots,
)
from kernels._triton import ensure_ready, is_interpreted, tl, triton
from kernels.fp8 import HW_FORMATS, encode_fp8, fmt_code


# Counts and sizes vary from call to call: not specialised (one compile for every shape).
@triton.jit(do_not_specialize=["num_slots", "hkv"])
def _reshape_and_cache_kernel(
        k_ptr, k_s0, k_s1, v_ptr, v_s0, v_s1, slot_ptr, slot_s0,
        kv_ptr, kv_s0, kv_s1, kv_s2, page_size, num_slots,
        ks_ptr, ks_s0, ks_s1, vs_ptr, vs_s0, vs_s1, hkv,
        D: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
        FP8: tl.constexpr, CONVERT: tl.constexpr, FMT: tl.constexpr, HW: tl.constexpr):
    # FP8 and CONVERT are constexprs, so only one branch is ever compiled: the pointer types
    # (int16 bits vs bf16/fp16 values) may differ between them.
    tok = tl.program_id(0).to(tl.int64)
    heads = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    dims = tl.arange(0, BLOCK_D)
    h64 = heads.to(tl.int64)
    slot = tl.load(slot_ptr + tok * slot_s0).to(tl.int64)
    ok = (slot >= 0) & (slot < num_slots)
    sl = tl.where(ok, slot, 0)  # a skipped token still forms (unused) in-range addresses
    hmask = (heads < hkv) & ok
    mask = hmask[:, None] & (dims < D)[None, :]
    # Skipped tokens read nothing either (masked loads).
    k = tl.load(k_ptr + tok * k_s0 + h64[:, None] * k_s1 + dims[None, :], mask=mask, other=0)
    v = tl.load(v_ptr + tok * v_s0 + h64[:, None] * v_s1 + dims[None, :], mask=mask, other=0)
    dst = (kv_ptr + (sl // page_size) * kv_s0 + h64[:, None] * kv_s1 + (sl % page_size) * kv_s2
           + dims[None, :])
    if FP8:
        ks = tl.load(ks_ptr + h64 * ks_s0 + sl * ks_s1, mask=hmask, other=1.0)
        vs = tl.load(vs_ptr + h64 * vs_s0 + sl * vs_s1, mask=hmask, other=1.0)
        tl.store(dst, encode_fp8(k.to(tl.float32) / ks[:, None], FMT, HW), mask=mask)
        tl.store(dst + D, encode_fp8(v.to(tl.float32) / vs[:, None], FMT, HW), mask=mask)
    elif CONVERT:
        tl.store(dst, k.to(tl.float32).to(kv_ptr.dtype.element_ty), mask=mask)
        tl.store(dst + D, v.to(tl.float32).to(kv_ptr.dtype.element_ty), mask=mask)
    else:
        tl.store(dst, k, mask=mask)
        tl.store(dst + D, v, mask=mask)


#: True when the kernel runs in the (patched) CPU interpreter.
INTERPRETED = is_interpreted(_reshape_and_cache_kernel)


# ---------------------------------------------------------------------------- launcher


def _check_kv(k, v):
    """k and v: the same model dtype, shape ``[N, Hkv, D]`` (D in HEAD_DIMS), device; last
    dim contiguous. Returns (n, hkv, d)."""
    check_tensor(k, "k", tuple(MODEL_DTYPES))
    if k.dim() != 3 or k.shape[1] < 1 or k.shape[2] not in HEAD_DIMS:
        fail("k", f"must have shape [N, Hkv >= 1, D in {list(HEAD_DIMS)}], got "
                  f"{list(k.shape)}")
    check_last_dim_contiguous(k, "k")
    check_tensor(v, "v", (k.dtype,), tuple(k.shape), k.device)
    check_last_dim_contiguous(v, "v")
    return tuple(k.shape)


def _validate_contents(slot_mapping, num_slots, scales):
    """``validate=True``: slot ranges and duplicates, positive finite scales (host sync)."""
    validate_slots(slot_mapping, "slot_mapping", num_slots)
    for name, sc in scales:
        if not bool(torch.isfinite(sc).all() & (sc > 0).all()):
            fail(name, "must hold positive finite values")


def _block_h(block_h, hkv):
    if block_h is None:
        # The interpreter is slow per program and fast on large blocks.
        block_h = 64 if INTERPRETED else 4
    if isinstance(block_h, bool) or not isinstance(block_h, (int, np.integer)) \
            or block_h <= 0 or block_h & (block_h - 1):
        fail("block_h", f"must be a power of two, got {block_h!r}")
    return min(int(block_h), triton.next_power_of_2(hkv))


def reshape_and_cache(k, v, kv_cache, kv_fmt, slot_mapping, k_scale=None, v_scale=None, *,
                      validate=False, block_h=None):
    """Insert ``k``, ``v`` (bf16/fp16 ``[N, Hkv, D]``, any token/head strides, last dim
    contiguous) into the paged ``kv_cache`` (logical ``[num_pages, Hkv, P, 2D]``, any
    non-negative strides, last dim contiguous) in place, and return it.

    kv_fmt: an fp8 format (``kv_cache`` uint8 codes) or a 16-bit dtype's name: k's dtype
    (bits are copied) or the other one (values rounded once, RNE).
    slot_mapping: int32/int64 ``[N]`` (any stride), negative = skip.
    Scales (fp8 only): None (1.0), a float, or float32 tensors, 0-d or ``[Hkv, num_pages*P]``
    (per KV head and physical slot); the code is ``satfinite(value / scale)``.
    ``validate=True``: also check contents on the host (slots in range and not repeated,
    positive finite scales), a device sync. Without it, out-of-range slots write nothing.
    N = 0 launches nothing."""
    n, hkv, d = _check_kv(k, v)
    dev = k.device
    fp8 = check_kv_fmt(kv_fmt)
    convert = not fp8 and HALF_FORMATS[kv_fmt] != k.dtype
    page, num_slots = check_kv_cache(kv_cache, kv_fmt, hkv, d, dev)
    check_tensor(slot_mapping, "slot_mapping", SLOT_DTYPES, (n,), dev)
    ks, ks0, ks1 = scale_arg(k_scale, "k_scale", fp8, hkv, num_slots, dev)
    vs, vs0, vs1 = scale_arg(v_scale, "v_scale", fp8, hkv, num_slots, dev)
    bh = _block_h(block_h, hkv)
    if validate and n:
        _validate_contents(slot_mapping, num_slots, (("k_scale", ks), ("v_scale", vs)))
    if n == 0:
        return kv_cache
    # Model-dtype caches: move 16-bit patterns, never values (no conversion can touch them).
    bits = not fp8 and not convert
    src_k, src_v, dst = (k.view(torch.int16), v.view(torch.int16),
                         kv_cache.view(torch.int16)) if bits else (k, v, kv_cache)
    ensure_ready(_reshape_and_cache_kernel)
    _reshape_and_cache_kernel[(n, triton.cdiv(hkv, bh))](
        src_k, k.stride(0), k.stride(1), src_v, v.stride(0), v.stride(1),
        slot_mapping, slot_mapping.stride(0),
        dst, kv_cache.stride(0), kv_cache.stride(1), kv_cache.stride(2), page, num_slots,
        ks, ks0, ks1, vs, vs0, vs1, hkv,
        D=d, BLOCK_H=bh, BLOCK_D=triton.next_power_of_2(d),
        FP8=fp8, CONVERT=convert, FMT=fmt_code(kv_fmt) if fp8 else 0,
        HW=fp8 and kv_fmt in HW_FORMATS)
    return kv_cache


def compile_signatures():
    """(kernel, signature, constexprs) triples covering the constexpr branches, for the
    sm_90 compile check on the CPU (tests/test_compile_sm90.py)."""
    combos = [  # source, cache, FP8, CONVERT, FMT, HW
        ("bf16", "u8", True, False, 0, True), ("fp16", "u8", True, False, 3, False),
        ("i16", "i16", False, False, 0, False), ("bf16", "fp16", False, True, 0, False)]
    out = []
    for src, dst, fp8, convert, fmt, hw in combos:
        sig = {name: "i64" for name in _reshape_and_cache_kernel.arg_names}
        sig.update(k_ptr=f"*{src}", v_ptr=f"*{src}", slot_ptr="*i64", kv_ptr=f"*{dst}",
                   ks_ptr="*fp32", vs_ptr="*fp32", hkv="i32", page_size="i32")
        const = dict(D=128, BLOCK_H=4, BLOCK_D=128, FP8=fp8, CONVERT=convert, FMT=fmt, HW=hw)
        sig.update(dict.fromkeys(const, "constexpr"))
        out.append((_reshape_and_cache_kernel, sig, const))
    return out
