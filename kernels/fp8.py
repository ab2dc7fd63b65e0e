"""The fp8 codec in Triton: encode (satfinite, RNE, correct subnormals) and decode of the four
fp8 formats of contract.md section 1, as @triton.jit device functions, plus host launchers.

The format is a constexpr int (``FMT_E4M3FN``, ``FMT_E5M2``, ``FMT_E4M3FNUZ``,
``FMT_E5M2FNUZ``; ``FMT_CODES`` maps reference.codec's names to them) and so is the branch:

``HW=True``   the hardware casts ``.to(tl.float8e4nv)`` / ``.to(tl.float8e5)`` (satfinite and
              RNE-exact on sm_90, reports/probe-h200.json) and the hardware fp8 -> fp32
              conversion. Only for the OCP formats: NVIDIA rejects the fnuz Triton types.
              A NaN input is mapped to the canonical NaN code 0x7F explicitly, so the byte
              does not depend on which NaN the hardware emits.
``HW=False``  an integer software codec on the fp32 bits, for all four formats (the only
              path for fnuz on NVIDIA). Encoding never forms an fp32 subnormal (no
              flush-to-zero hazard) and agrees bit for bit with the hardware branch on the
              OCP formats; the fnuz decode rebiases with one fp32 multiply, through fp32
              subnormals for the format's subnormals (``mul.f32`` keeps them on NVIDIA).

Encoding is of fp32 values (bf16/fp16 inputs are widened exactly first): round to nearest
even onto the format's grid, subnormals included; finite overflow and +-Inf become +-max
finite; NaN becomes 0x7F (OCP) / 0x80 (fnuz); -0 becomes 0x80 (OCP) / 0x00 (fnuz), as does
any negative value that rounds to zero. Decoding is exact (NaN codes -> NaN, e5m2's Inf
codes -> +-Inf).
"""

from __future__ import annotations

import torch

from kernels._triton import ensure_ready, is_interpreted, tl, triton
from reference.formats import FORMATS, FP8_FORMATS, native_fp8

FMT_E4M3FN: tl.constexpr = tl.constexpr(0)
FMT_E5M2: tl.constexpr = tl.constexpr(1)
FMT_E4M3FNUZ: tl.constexpr = tl.constexpr(2)
FMT_E5M2FNUZ: tl.constexpr = tl.constexpr(3)

#: format name -> the constexpr int the device functions take (the table's kernel code).
FMT_CODES = {name: FORMATS[name].kernel_code for name in FP8_FORMATS}
#: formats the hardware branch supports (NVIDIA converts only the OCP formats).
HW_FORMATS = native_fp8("cuda")

# Specials conventions (reference.codec.FloatFormat.specials) as constexpr ints.
_FN: tl.constexpr = tl.constexpr(0)  # no Inf, 0x7F/0xFF NaN
_IEEE: tl.constexpr = tl.constexpr(1)  # top exponent: Inf (mantissa 0) or NaN
_FNUZ: tl.constexpr = tl.constexpr(2)  # no Inf, no -0, 0x80 NaN


@triton.jit
def _encode_sw(x, M: tl.constexpr, BIAS: tl.constexpr, MAX_CODE: tl.constexpr,
               SPECIALS: tl.constexpr):
    """fp32 -> code of a sign/exponent/mantissa format with M mantissa bits and bias BIAS,
    by integer arithmetic on the fp32 bits (RNE, subnormals, satfinite)."""
    bits = x.to(tl.uint32, bitcast=True)
    sign = bits >> 31
    a = bits & 0x7FFFFFFF  # |x|; > 0x7F800000 is NaN
    e32 = (a >> 23).to(tl.int32)
    # Normal range: round the 23-bit fp32 mantissa to M bits, ties to even; a carry ripples
    # into the exponent field, as it must. Then rebias. (Wraps for tiny |x|: not selected.)
    lsb = (a >> (23 - M)) & 1
    rounded = (a + ((1 << (22 - M)) - 1) + lsb) >> (23 - M)
    normal = rounded - ((127 - BIAS) << M)
    # Subnormal range (|x| < 2^(1-BIAS)): the code is |x| in units of the smallest
    # subnormal 2^(1-BIAS-M), i.e. the 24-bit significand shifted right, ties to even.
    # Rounding up from the largest subnormal gives the smallest normal code, as it must.
    sig = (a & 0x7FFFFF) | 0x800000
    shift = tl.minimum(tl.maximum(151 - BIAS - M - e32, 1), 31).to(tl.uint32)
    q = sig >> shift
    rem = sig & ((1 << shift) - 1)
    half = 1 << (shift - 1)
    up = (rem > half) | ((rem == half) & ((q & 1) == 1))
    sub = q + up.to(tl.uint32)
    mag = tl.where(e32 < 128 - BIAS, sub, normal)
    mag = tl.minimum(mag, MAX_CODE)  # satfinite: finite overflow and +-Inf -> max finite
    if SPECIALS == _FNUZ:
        code = tl.where(mag == 0, 0, mag | (sign << 7))  # no -0
        code = tl.where(a > 0x7F800000, 0x80, code)
    else:
        code = mag | (sign << 7)
        code = tl.where(a > 0x7F800000, 0x7F, code)
    return code.to(tl.uint8)


@triton.jit
def _decode_sw(c, M: tl.constexpr, BIAS: tl.constexpr, SPECIALS: tl.constexpr,
               SUB_SCALE: tl.constexpr):
    """code -> exact fp32 value; SUB_SCALE = 2^(1-BIAS-M), the smallest subnormal."""
    c32 = c.to(tl.uint32)
    sign = (c32 >> 7) << 31
    mag = c32 & 0x7F
    e = mag >> M
    m = mag & ((1 << M) - 1)
    # Normal codes: shift the bits into fp32 position and rebias the exponent field.
    normal = (mag << (23 - M)) + ((127 - BIAS) << 23)
    # Subnormal codes: m * 2^(1-BIAS-M), exact (small integer times a power of two, normal
    # in fp32).
    sub = (m.to(tl.float32) * SUB_SCALE).to(tl.uint32, bitcast=True)
    bits = tl.where(e == 0, sub, normal) | sign
    if SPECIALS == _FN:
        bits = tl.where(mag == 0x7F, 0x7FC00000, bits)
    else:  # _IEEE (the fnuz formats decode in _decode_fnuz)
        top = e == (1 << (7 - M)) - 1
        bits = tl.where(top & (m == 0), 0x7F800000 | sign, bits)
        bits = tl.where(top & (m != 0), 0x7FC00000, bits)
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def _decode_fnuz(c, M: tl.constexpr, SCALE: tl.constexpr):
    """fnuz code -> exact fp32 value in five integer/float operations (the fnuz formats have
    no Inf and one NaN, 0x80): the code's sign, exponent and mantissa placed in the fp32
    fields as they stand (exponent bias 127 instead of the format's), then one multiply by
    SCALE = 2^(127 - BIAS) rebiases; codes with exponent 0 are fp32 subnormals there and the
    multiply (``mul.f32``, no flush to zero on NVIDIA) makes them the format's subnormals
    exactly. About half the instructions of ``_decode_sw`` in the attention kernels."""
    c32 = c.to(tl.uint32)
    bits = ((c32 & 0x80) << 24) | ((c32 & 0x7F) << (23 - M))
    v = bits.to(tl.float32, bitcast=True) * SCALE
    return tl.where(c32 == 0x80, float("nan"), v)


@triton.jit
def _decode_e4m3fnuz_f16(c):
    """e4m3fnuz code -> exact fp16 value, with no fp32 step: e4m3fnuz's fields fit fp16's
    (the 4-bit exponent in the low bits of fp16's 5, the 3 mantissa bits on top of its
    10), so the code's sign at bit 15 and its other 7 bits at bits 13..7 make the value
    times 2^-7 (fp16 bias 15 vs 8), its subnormals fp16 subnormals; one exact fp16 multiply
    by 2^7 rescales (at most 240). 0x80 (-0 so built) is the NaN. e5m2fnuz has no such
    form: its top binade is fp16's Inf/NaN exponent."""
    c16 = c.to(tl.uint16)
    bits = ((c16 & 0x80) << 8) | ((c16 & 0x7F) << 7)
    v = bits.to(tl.float16, bitcast=True) * tl.full((), 128.0, tl.float16)
    return tl.where(c16 == 0x80, float("nan"), v)


@triton.jit
def scale_reciprocal(s):
    """(a, b) such that ``x * a * b`` is ``x / s`` within one fp32 ulp (2^-23 relative; the
    oracle allows the division by a KV scale Fp32Arith.div_ulp = 2.5) for every fp32 s,
    as two multiplications per value instead of a correctly rounded division (~10 SASS
    per value on sm_90: it was a third of the fp8 insert's KV loop).

    b is a power of two (1 unless s lies outside [2^-100, 2^100]) that keeps a = RN(1 / (s
    b)) a normal number, so (x a) b rounds once more only where x / s is far outside
    every fp8 range. s = +-0, +-Inf or NaN give what x / s gives (+-Inf, NaN or +-0)."""
    s = s.to(tl.float32)
    b = tl.where(s < 7.888609052210118e-31, 1.8446744073709552e+19,  # 2^-100, 2^64
                 tl.where(s > 1.2676506002282294e+30, 5.421010862427522e-20, 1.0))  # 2^100, 2^-64
    return 1.0 / (s * b), b


#: Four fp32 values ($1..$4) -> their four e4m3fn codes in one 32-bit register ($0, value
#: k in byte k): the ``cvt.rn.satfinite.e4m3x2.f32`` Triton's own cast emits (two values
#: per instruction), then every NaN code made the canonical 0x7F without a compare per
#: value: per byte (no carries across bytes), low 7 bits 0x7F (the only NaN codes) + 1
#: sets bit 7 in s; m = s - (s >> 7) is 0x7F there; the byte becomes (c & ~(s | m)) | m.
_F32X4_E4M3FN: tl.constexpr = tl.constexpr(
    "{ .reg .b16 lo, hi; .reg .b32 c, s, m; "
    "cvt.rn.satfinite.e4m3x2.f32 lo, $2, $1; cvt.rn.satfinite.e4m3x2.f32 hi, $4, $3; "
    "mov.b32 c, {lo, hi}; and.b32 s, c, 0x7F7F7F7F; add.u32 s, s, 0x01010101; "
    "and.b32 s, s, 0x80808080; shr.b32 m, s, 7; sub.u32 m, s, m; or.b32 s, s, m; "
    "not.b32 s, s; and.b32 c, c, s; or.b32 $0, c, m; }")

#: As _F32X4_E4M3FN for e5m2, whose NaN codes are 0x7D-0x7F (and signed): low 7 bits + 3
#: set bit 7 exactly for them (0x7C, Inf, is not produced by the satfinite cast).
_F32X4_E5M2: tl.constexpr = tl.constexpr(
    "{ .reg .b16 lo, hi; .reg .b32 c, s, m; "
    "cvt.rn.satfinite.e5m2x2.f32 lo, $2, $1; cvt.rn.satfinite.e5m2x2.f32 hi, $4, $3; "
    "mov.b32 c, {lo, hi}; and.b32 s, c, 0x7F7F7F7F; add.u32 s, s, 0x03030303; "
    "and.b32 s, s, 0x80808080; shr.b32 m, s, 7; sub.u32 m, s, m; or.b32 s, s, m; "
    "not.b32 s, s; and.b32 c, c, s; or.b32 $0, c, m; }")


@triton.jit
def _encode_hw(x, FMT: tl.constexpr):
    """fp32 -> e4m3fn / e5m2 codes by the hardware cast, NaN as the canonical 0x7F."""
    if FMT == FMT_E4M3FN:
        code = x.to(tl.float8e4nv).to(tl.uint8, bitcast=True)
    else:
        code = x.to(tl.float8e5).to(tl.uint8, bitcast=True)
    return tl.where(x != x, 0x7F, code)  # the canonical NaN code, whatever the hardware's


@triton.jit
def encode_fp8(x, FMT: tl.constexpr, HW: tl.constexpr, ASM: tl.constexpr = False):
    """fp32 values -> uint8 codes of format FMT (satfinite, RNE); HW picks the branch. ASM
    (compiled only, with HW): the hardware cast in inline assembly, four values per call,
    with the canonical NaN made by byte-parallel integer ops (``_F32X4_E4M3FN``): the same
    bytes as the HW branch in fewer instructions (a tensor of fewer than four, or not a
    multiple of four, values takes the HW branch: the assembly's pack is four)."""
    tl.static_assert(FMT >= 0 and FMT <= 3, "FMT must be one of the FMT_* constants")
    tl.static_assert(not HW or FMT <= 1, "HW=True exists only for e4m3fn and e5m2")
    tl.static_assert(not ASM or HW, "ASM=True is a form of the hardware branch (HW=True)")
    x = x.to(tl.float32)
    if HW:
        if ASM and x.numel % 4 == 0:
            if FMT == FMT_E4M3FN:
                asm: tl.constexpr = _F32X4_E4M3FN
            else:
                asm: tl.constexpr = _F32X4_E5M2
            code = tl.inline_asm_elementwise(asm, "=r,f,f,f,f", [x], dtype=tl.uint8,
                                             is_pure=True, pack=4)
        else:
            code = _encode_hw(x, FMT)
    else:
        if FMT == FMT_E4M3FN:
            code = _encode_sw(x, 3, 7, 0x7E, _FN)
        elif FMT == FMT_E5M2:
            code = _encode_sw(x, 2, 15, 0x7B, _IEEE)
        elif FMT == FMT_E4M3FNUZ:
            code = _encode_sw(x, 3, 8, 0x7F, _FNUZ)
        else:
            code = _encode_sw(x, 2, 16, 0x7F, _FNUZ)
    return code


@triton.jit
def decode_fp8(c, FMT: tl.constexpr, HW: tl.constexpr):
    """uint8 codes of format FMT -> exact fp32 values; HW picks the branch."""
    tl.static_assert(FMT >= 0 and FMT <= 3, "FMT must be one of the FMT_* constants")
    tl.static_assert(not HW or FMT <= 1, "HW=True exists only for e4m3fn and e5m2")
    c = c.to(tl.uint8)
    if HW:
        if FMT == FMT_E4M3FN:
            v = c.to(tl.float8e4nv, bitcast=True).to(tl.float32)
        else:
            v = c.to(tl.float8e5, bitcast=True).to(tl.float32)
    else:
        if FMT == FMT_E4M3FN:
            v = _decode_sw(c, 3, 7, _FN, 0.001953125)  # 2^-9
        elif FMT == FMT_E5M2:
            v = _decode_sw(c, 2, 15, _IEEE, 1.52587890625e-05)  # 2^-16
        elif FMT == FMT_E4M3FNUZ:
            v = _decode_fnuz(c, 3, 6.64613997892458e+35)  # 2^119
        else:
            v = _decode_fnuz(c, 2, 2.596148429267414e+33)  # 2^111
    return v


@triton.jit
def decode_fp8_to(c, FMT: tl.constexpr, HW: tl.constexpr, DTYPE: tl.constexpr):
    """uint8 codes of format FMT -> their exact values in DTYPE (bf16 or fp16: every value
    of the four formats, subnormals, Inf and NaN included, is representable in both). The
    hardware branch converts the fp8 type to fp16 (``cvt`` e4m3x2 -> f16x2; e5m2 is the
    top byte of its fp16) and that to DTYPE, with no fp32 step and no scale (the attention
    kernels' operands when the scales are applied outside the products). Not the direct
    ``.to(tl.bfloat16)``: Triton 3.6 lowers e5m2 -> bf16 by bit arithmetic (shift, rebias
    multiply) that turns the Inf and NaN codes into finite values on sm_90, while the
    fp16 -> bf16 ``cvt`` keeps them."""
    tl.static_assert(DTYPE == tl.bfloat16 or DTYPE == tl.float16, "DTYPE: bf16 or fp16")
    if HW:
        c = c.to(tl.uint8)
        if FMT == FMT_E4M3FN:
            v = c.to(tl.float8e4nv, bitcast=True).to(tl.float16)
        else:
            v = c.to(tl.float8e5, bitcast=True).to(tl.float16)
        v = v.to(DTYPE)
    elif FMT == FMT_E4M3FNUZ and DTYPE == tl.float16:
        v = _decode_e4m3fnuz_f16(c)
    else:
        v = decode_fp8(c, FMT, HW).to(DTYPE)
    return v


#: Four e4m3fnuz codes ($2) -> two f16x2 registers ($0: codes 0, 1; $1: codes 2, 3) on the
#: hardware e4m3fn conversion. An e4m3fnuz code's value is half its e4m3fn value (bias 8,
#: not 7; subnormals too) except for three codes: 0x80 is NaN (e4m3fn: -0), and 0x7F /
#: 0xFF are +-240 where e4m3fn has NaN. Per byte, without carries across bytes: s marks
#: the +-240 codes (low 7 bits 0x7F: + 1 sets bit 7), z the 0x80 code (bit 7 set, low 7
#: bits 0: + 0x7F leaves bit 7 clear). The +-240 codes go one below (+-448 in e4m3fn, fp16
#: 0x5F00), 0x80 to 0xFF (e4m3fn NaN); after ``cvt`` the +-240 lanes get bit 7 or'ed in
#: (0x5F80 = 480), and every lane is halved (``mul.f16x2`` by 0.5, exact: the doubled
#: values are fp16 normals or NaN). 19 instructions for four codes where building the
#: fp16 bits from the code's fields took 28.
_E4M3FNUZ_F16X4: tl.constexpr = tl.constexpr(
    "{ .reg .b32 m, s, t, z, w, p, k; .reg .b16 lo, hi; "
    "and.b32 m, $2, 0x7F7F7F7F; add.u32 s, m, 0x01010101; and.b32 s, s, 0x80808080; "
    "add.u32 t, m, 0x7F7F7F7F; not.b32 t, t; and.b32 z, $2, t; and.b32 z, z, 0x80808080; "
    "shr.b32 p, s, 7; sub.u32 w, $2, p; "
    "shr.b32 p, z, 7; sub.u32 p, z, p; or.b32 w, w, p; "
    "mov.b32 {lo, hi}, w; cvt.rn.f16x2.e4m3x2 $0, lo; cvt.rn.f16x2.e4m3x2 $1, hi; "
    "prmt.b32 p, s, 0, 0x4140; or.b32 $0, $0, p; "
    "prmt.b32 p, s, 0, 0x4342; or.b32 $1, $1, p; "
    "mov.b32 k, 0x38003800; mul.rn.f16x2 $0, $0, k; mul.rn.f16x2 $1, $1, k; }")



#: Four e4m3fnuz codes ($2) -> two f16x2 registers holding each code's value / 128
#: (``F16_UNIT``), by bit placement alone: an e4m3fnuz code s|eeee|mmm placed as the fp16
#: s|0eeee|mmm0000000 has the value / 2^7 (the biases 15 and 8 differ by 7; the code's
#: subnormals land on fp16 subnormals with the same scaling), so every code but 0x80
#: needs no arithmetic. Per 32-bit word: m the magnitudes, z 0x80 in the 0x80 bytes (bit 7
#: set, low 7 bits 0: + 0x7F leaves bit 7 clear), r 0xFF in those bytes (``prmt``'s
#: sign-replicating selectors on z's bit 7), v the sign bytes or r; per half, the magnitude
#: byte (prmt) times 128 plus v one byte up and r in the low byte (prmt):
#: s|0eeee|mmm0000000, and 0xFFFF (a NaN) for 0x80 (r is 0 elsewhere). 11 instructions for
#: four codes, no conversion (``_E4M3FNUZ_F16X4``: 19).
_E4M3FNUZ_F16X4_UNIT: tl.constexpr = tl.constexpr(
    "{ .reg .b32 m, t, z, r, v, a, b; "
    "and.b32 m, $2, 0x7F7F7F7F; add.u32 t, m, 0x7F7F7F7F; not.b32 t, t; "
    "and.b32 z, $2, t; and.b32 z, z, 0x80808080; prmt.b32 r, z, 0, 0xBA98; "
    "and.b32 v, $2, 0x80808080; or.b32 v, v, r; "
    "prmt.b32 a, m, 0, 0x4140; prmt.b32 b, v, r, 0x1504; mad.lo.u32 $0, a, 128, b; "
    "prmt.b32 a, m, 0, 0x4342; prmt.b32 b, v, r, 0x3726; mad.lo.u32 $1, a, 128, b; }")

#: What ``decode_fp8_f16(..., UNIT=True)`` returns: the code's value / F16_UNIT (e4m3fnuz in
#: assembly; 1 for every other format and branch: ``times_f16_unit``).
F16_UNIT: tl.constexpr = tl.constexpr(128.0)

#: Four e5m2fnuz codes ($2) -> two f16x2 registers, as _E4M3FNUZ_F16X4 but with no
#: conversion instruction at all: an e5m2 code is the high byte of its fp16 value (prmt
#: places it), and an e5m2fnuz code's value is half that (bias 16, not 15; subnormals too)
#: except for 0x80 (NaN; e5m2: -0) and the exponent-31 codes (0x7C-0x7F, 0xFC-0xFF:
#: finite 2^15 x (1 + m/4), where e5m2 has Inf/NaN and twice the value overflows fp16).
#: Per byte: s marks exponent 31 ((c & 0x7C) + 4 sets bit 7), z the 0x80 code; those
#: codes go 8 below (exponent 29) before the placement; every lane is halved (exact); then
#: the exponent-31 lanes get bit 11 or'ed in (exponent 28 -> 30: the value) and the 0x80
#: lanes 0x7F00 (-0 -> NaN), both from one prmt of (s >> 4) | (z - (z >> 7)).
#: Used by the attention kernels (``asm_f16``); simulator-tested on the CPU
#: (tests/test_fp8_asm.py) and on the GPU on every code (tests/test_fp8_codec_gpu.py).
_E5M2FNUZ_F16X4: tl.constexpr = tl.constexpr(
    "{ .reg .b32 s, t, z, p, q, w, k; "
    "and.b32 s, $2, 0x7C7C7C7C; add.u32 s, s, 0x04040404; and.b32 s, s, 0x80808080; "
    "shr.b32 p, s, 4; sub.u32 w, $2, p; "
    "and.b32 t, $2, 0x7F7F7F7F; add.u32 t, t, 0x7F7F7F7F; not.b32 t, t; "
    "and.b32 z, $2, t; and.b32 z, z, 0x80808080; "
    "shr.b32 q, z, 7; sub.u32 q, z, q; or.b32 q, q, p; mov.b32 k, 0x38003800; "
    "prmt.b32 t, w, 0, 0x1404; mul.rn.f16x2 t, t, k; prmt.b32 p, q, 0, 0x1404; "
    "or.b32 $0, t, p; "
    "prmt.b32 t, w, 0, 0x3424; mul.rn.f16x2 t, t, k; prmt.b32 p, q, 0, 0x3424; "
    "or.b32 $1, t, p; }")


#: Four e5m2fnuz codes ($2) -> two bf16x2 registers holding each code's value / 2^111
#: (``BF16_UNIT``), by bit placement alone: the code s|eeeee|mm placed as the bf16
#: s|000eeeee|mm00000 has the value / 2^111 (biases 127 and 16; the code's subnormals land
#: on bf16 subnormals with the same scaling, and the top binade, which overflows fp16 at
#: twice its value, is an ordinary bf16 exponent), so only 0x80 (NaN; placed: -0) needs a
#: patch: as ``_E4M3FNUZ_F16X4_UNIT`` with 32 for 128 (0x80 -> 0xFFFF, a bf16 NaN; no
#: carry crosses a half: at most 0xFE0 + 0x8000). 11 instructions for four codes
#: (``_E5M2FNUZ_F16X4``: 19).
_E5M2FNUZ_BF16X4_UNIT: tl.constexpr = tl.constexpr(
    "{ .reg .b32 m, t, z, r, v, a, b; "
    "and.b32 m, $2, 0x7F7F7F7F; add.u32 t, m, 0x7F7F7F7F; not.b32 t, t; "
    "and.b32 z, $2, t; and.b32 z, z, 0x80808080; prmt.b32 r, z, 0, 0xBA98; "
    "and.b32 v, $2, 0x80808080; or.b32 v, v, r; "
    "prmt.b32 a, m, 0, 0x4140; prmt.b32 b, v, r, 0x1504; mad.lo.u32 $0, a, 32, b; "
    "prmt.b32 a, m, 0, 0x4342; prmt.b32 b, v, r, 0x3726; mad.lo.u32 $1, a, 32, b; }")

#: What ``decode_fp8_f16(..., UNIT=True)`` returns for e5m2fnuz: bf16, the code's value /
#: BF16_UNIT (assembly and interpreter alike, so the declared schedule is one: ``kernels.
#: _attention.operand_dtypes``); the logits are multiplied back in fp32 and P by it before
#: its bf16 rounding (``kernels._attention.p_operand``), which cancels the factor in ``P @ V``.
BF16_UNIT: tl.constexpr = tl.constexpr(2.0 ** 111)
BF16_UNIT_INV: tl.constexpr = tl.constexpr(2.0 ** -111)


def asm_f16(fmt: str, interpreted: bool) -> bool:
    """Whether the attention kernels decode with ``decode_fp8_f16``'s inline assembly (its
    ``ASM``; V, and the fnuz formats' K too): compiled, and a format it has assembly for:
    all four. e5m2fnuz's assembly (``_E5M2FNUZ_F16X4``; static sm_90 at the model shape:
    decode, 3 stages, 3,480 SASS, no spills, against 5,824 and 136 B of spills on the fp32
    software path it replaced; prefill 7,912 against 9,504)."""
    return not interpreted and fmt in FP8_FORMATS


@triton.jit
def decode_fp8_f16(c, FMT: tl.constexpr, HW: tl.constexpr, ASM: tl.constexpr,
                   PURE: tl.constexpr = False, UNIT: tl.constexpr = False):
    """uint8 codes of format FMT -> their exact values in fp16 (every value of the four
    formats, subnormals, Inf and NaN included, is an fp16 value). ASM (compiled, hardware
    formats): ``cvt.rn.f16x2.{e4m3,e5m2}x2`` in inline assembly marked impure, four codes
    per call. The mark is the point: Triton moves a pure elementwise conversion past the
    shared-memory load of a ``tl.dot`` operand; for the B operand of ``P @ V`` (V's
    contraction dimension, keys, is strided) it then gathers the 8-bit codes byte by byte
    (``LDS.U8``: sm_90 has no 8-bit transposing ``ldmatrix``); behind the opaque
    conversion it stores fp16 to shared memory and reads it with ``ldmatrix.trans``. (For
    K, a K-major operand, the pure conversion in registers is the better one: staging K
    as well removed ~110 register moves per decode block but its shared-memory round trip
    costs more.) e4m3fnuz (no conversion of its own on NVIDIA) likewise in
    assembly, through the e4m3fn ``cvt`` with its three differing codes patched and the
    result halved (``_E4M3FNUZ_F16X4``; sm_89+, as the hardware formats); PURE marks it
    pure, for e4m3fnuz's K (kernels._attention.kv_tiles: converted in registers like the
    hardware formats' K; staged through shared memory it is slower).
    Otherwise (interpreter, other software formats): ``decode_fp8_to(c, FMT, HW, fp16)``.
    UNIT: the value / ``times_f16_unit``'s factor instead (e4m3fnuz in assembly: by bit placement,
    ``_E4M3FNUZ_F16X4_UNIT``; its subnormals become fp16 subnormals); the caller multiplies
    the factor back in fp32 (``times_f16_unit``), where it is exact. e5m2fnuz with UNIT
    returns bf16, not fp16: its values / BF16_UNIT (``_E5M2FNUZ_BF16X4_UNIT`` compiled, the
    same values computed in fp32 interpreted)."""
    if UNIT and FMT == FMT_E5M2FNUZ:
        if ASM:
            v = tl.inline_asm_elementwise(_E5M2FNUZ_BF16X4_UNIT, "=r,=r,r", [c.to(tl.uint8)],
                                          dtype=tl.bfloat16, is_pure=PURE, pack=4)
        else:  # exact: every value / 2^111 is an fp32 number (subnormal below 2^-126)
            v = (decode_fp8(c, FMT, HW) * BF16_UNIT_INV).to(tl.bfloat16)
    elif ASM:
        tl.static_assert((HW and FMT <= 1) or FMT >= FMT_E4M3FNUZ,
                         "ASM: a hardware format (HW) or a fnuz format")
        if FMT == FMT_E4M3FNUZ and UNIT:
            asm: tl.constexpr = _E4M3FNUZ_F16X4_UNIT
        elif FMT == FMT_E4M3FNUZ:
            asm: tl.constexpr = _E4M3FNUZ_F16X4
        elif FMT == FMT_E5M2FNUZ:
            asm: tl.constexpr = _E5M2FNUZ_F16X4
        elif FMT == FMT_E4M3FN:
            asm: tl.constexpr = ("{ .reg .b16 lo, hi; mov.b32 {lo, hi}, $2; "
                                 "cvt.rn.f16x2.e4m3x2 $0, lo; cvt.rn.f16x2.e4m3x2 $1, hi; }")
        else:
            asm: tl.constexpr = ("{ .reg .b16 lo, hi; mov.b32 {lo, hi}, $2; "
                                 "cvt.rn.f16x2.e5m2x2 $0, lo; cvt.rn.f16x2.e5m2x2 $1, hi; }")
        v = tl.inline_asm_elementwise(asm, "=r,=r,r", [c.to(tl.uint8)], dtype=tl.float16,
                                      is_pure=PURE, pack=4)
    else:
        v = decode_fp8_to(c, FMT, HW, tl.float16)
    return v



@triton.jit
def times_f16_unit(x, FMT: tl.constexpr, ASM: tl.constexpr):
    """x times the factor ``decode_fp8_f16(..., UNIT=True)`` left out of its values
    (F16_UNIT for e4m3fnuz in assembly, BF16_UNIT for e5m2fnuz: exact in fp32, powers of
    two), x itself otherwise."""
    if ASM and FMT == FMT_E4M3FNUZ:
        x = x * F16_UNIT
    elif FMT == FMT_E5M2FNUZ:
        x = x * BF16_UNIT
    return x

def encode_asm(fmt: str, hw: bool, interpreted: bool) -> bool:
    """Whether kernels encode ``fmt`` with ``encode_fp8``'s inline assembly (ASM): the
    hardware branch of a hardware format, compiled (the interpreter runs no assembly)."""
    return bool(hw) and fmt in HW_FORMATS and not interpreted


@triton.jit
def _encode_kernel(x_ptr, out_ptr, n, FMT: tl.constexpr, HW: tl.constexpr,
                   BLOCK: tl.constexpr, ASM: tl.constexpr = False):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    x = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + offs, encode_fp8(x, FMT, HW, ASM), mask=mask)


@triton.jit
def _decode_kernel(c_ptr, out_ptr, n, FMT: tl.constexpr, HW: tl.constexpr,
                   BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    c = tl.load(c_ptr + offs, mask=mask, other=0)
    tl.store(out_ptr + offs, decode_fp8(c, FMT, HW), mask=mask)


@triton.jit
def _decode_f16_kernel(c_ptr, out_ptr, n, FMT: tl.constexpr, HW: tl.constexpr,
                       ASM: tl.constexpr, BLOCK: tl.constexpr, UNIT: tl.constexpr = False):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    c = tl.load(c_ptr + offs, mask=mask, other=0)
    tl.store(out_ptr + offs, decode_fp8_f16(c, FMT, HW, ASM, False, UNIT), mask=mask)


#: True when this module's kernels run in the (patched) CPU interpreter.
INTERPRETED = is_interpreted(_encode_kernel)

_SOURCE_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def fmt_code(fmt: str, hw: bool = False) -> int:
    """The FMT constexpr for a reference.codec format name; validates the branch too."""
    if fmt not in FMT_CODES:
        raise ValueError(f"fmt must be one of {sorted(FMT_CODES)}, got {fmt!r}")
    if hw and fmt not in HW_FORMATS:
        raise ValueError(
            f"hw=True uses NVIDIA's hardware casts, which exist only for {list(HW_FORMATS)}; "
            f"{fmt} needs the software codec (hw=False)")
    return FMT_CODES[fmt]


def _block(n: int, block: int | None) -> int:
    if block is not None:
        if block <= 0 or block & (block - 1):
            raise ValueError(f"block must be a power of two, got {block}")
        return block
    if INTERPRETED:  # the interpreter is fast on large blocks, slow per program
        return min(triton.next_power_of_2(max(n, 1)), 1 << 18)
    return 1024


def encode_tensor(x: torch.Tensor, fmt: str, hw: bool = False,
                  block: int | None = None, asm: bool = False) -> torch.Tensor:
    """uint8 codes of ``x`` (float32, bfloat16 or float16; any shape) in format ``fmt``,
    satfinite, on x's device; ``asm``: the hardware branch in inline assembly (needs
    ``hw`` and a compiled kernel: ``encode_asm``)."""
    code = fmt_code(fmt, hw)
    if not isinstance(x, torch.Tensor) or x.dtype not in _SOURCE_DTYPES:
        raise ValueError(f"x must be a torch tensor of dtype {_SOURCE_DTYPES}, got "
                         f"{getattr(x, 'dtype', type(x))}")
    if asm and not encode_asm(fmt, hw, INTERPRETED):
        raise ValueError(f"asm=True needs hw=True, a hardware format {list(HW_FORMATS)} and "
                         f"compiled kernels (not the interpreter), got fmt={fmt!r}, hw={hw}")
    return _elementwise(_encode_kernel, x, torch.uint8, code, hw, block, ASM=asm)


def decode_tensor(codes: torch.Tensor, fmt: str, hw: bool = False,
                  block: int | None = None) -> torch.Tensor:
    """float32 values of uint8 ``codes`` (any shape) in format ``fmt``, on codes' device."""
    code = fmt_code(fmt, hw)
    if not isinstance(codes, torch.Tensor) or codes.dtype != torch.uint8:
        raise ValueError(f"codes must be a torch uint8 tensor, got "
                         f"{getattr(codes, 'dtype', type(codes))}")
    return _elementwise(_decode_kernel, codes, torch.float32, code, hw, block)


def f16_operand_dtype(fmt: str, unit: bool) -> torch.dtype:
    """The torch dtype ``decode_fp8_f16`` returns for format ``fmt``: bfloat16 for
    e5m2fnuz with ``UNIT`` (its values / BF16_UNIT), float16 otherwise."""
    return torch.bfloat16 if unit and fmt == "e5m2fnuz" else torch.float16


def decode_tensor_f16(codes: torch.Tensor, fmt: str, hw: bool = False,
                      block: int | None = None, unit: bool = False) -> torch.Tensor:
    """float16 values of uint8 ``codes`` through ``decode_fp8_f16``, the attention kernels'
    V operand path (its inline assembly where ``asm_f16`` says the kernels use it); ``unit``:
    its ``UNIT=True`` form, the kernels' operands with scalar scales (e4m3fnuz in assembly:
    the values / F16_UNIT; e5m2fnuz: bfloat16 values / BF16_UNIT)."""
    code = fmt_code(fmt, hw)
    if not isinstance(codes, torch.Tensor) or codes.dtype != torch.uint8:
        raise ValueError(f"codes must be a torch uint8 tensor, got "
                         f"{getattr(codes, 'dtype', type(codes))}")
    asm = asm_f16(fmt, INTERPRETED) and (hw or fmt not in HW_FORMATS)
    return _elementwise(_decode_f16_kernel, codes, f16_operand_dtype(fmt, unit), code, hw,
                        block, ASM=asm, UNIT=unit)


def _elementwise(kernel, x, out_dtype, code, hw, block, **consts):
    """One launch of a 1-D codec kernel over x (any shape), output in x's shape."""
    flat = x.contiguous().reshape(-1)
    out = torch.empty(flat.numel(), dtype=out_dtype, device=x.device)
    if flat.numel():
        ensure_ready(kernel)
        blk = _block(flat.numel(), block)
        kernel[(triton.cdiv(flat.numel(), blk),)](
            flat, out, flat.numel(), FMT=code, HW=bool(hw), BLOCK=blk, **consts)
    return out.reshape(x.shape)

