"""kernels/fp8.py's e4m3fnuz -> f16x2 inline assembly, run on the CPU by a small simulator
of the PTX instructions it uses (the GPU test runs the real thing: test_fp8_codec_gpu.py).
"""

from __future__ import annotations

import numpy as np
import pytest

from kernels import fp8
from reference.codec import decode, encode
from tests.helpers import same_float

M32 = 0xFFFFFFFF


def _f16x2_mul(a: int, b: int) -> int:
    x = np.array([a & 0xFFFF, a >> 16], np.uint16).view(np.float16)
    y = np.array([b & 0xFFFF, b >> 16], np.uint16).view(np.float16)
    with np.errstate(all="ignore"):
        z = (x * y).view(np.uint16)  # one fp16 RNE product per lane, as mul.rn.f16x2
    return int(z[0]) | int(z[1]) << 16


def _prmt(a: int, b: int, sel: int) -> int:
    """``prmt.b32`` (default mode): output byte i is byte ``n & 7`` of {b, a} for selector
    nibble n, or with n's bit 3 set that byte's sign bit replicated (0xFF / 0x00)."""
    src = (a | b << 32).to_bytes(8, "little")

    def pick(n):
        byte = src[n & 7]
        return (0xFF if byte & 0x80 else 0x00) if n & 8 else byte

    return int.from_bytes(bytes(pick((sel >> 4 * i) & 15) for i in range(4)), "little")


OPS = {
    "mov.b32": lambda a: a,
    "prmt.b32": _prmt,
    "shr.b32": lambda a, n: a >> n,
    "and.b32": lambda a, b: a & b,
    "or.b32": lambda a, b: a | b,
    "xor.b32": lambda a, b: a ^ b,
    "add.u32": lambda a, b: (a + b) & M32,
    "mul.lo.u32": lambda a, b: (a * b) & M32,
    "mad.lo.u32": lambda a, b, c: (a * b + c) & M32,
    "mul.rn.f16x2": _f16x2_mul,
    "not.b32": lambda a: ~a,
    "sub.u32": lambda a, b: (a - b) & M32,
    "cvt.rn.f16x2.e4m3x2": lambda a: _e4m3x2_to_f16x2(a),
}


def _e4m3x2_to_f16x2(a: int) -> int:
    """``cvt.rn.f16x2.e4m3x2``: the low byte to the low half, by the reference codec's
    e4m3fn decode (the hardware conversion equals it on every code: an exhaustive
    H200 run, and tests/test_fp8_codec_gpu.py), NaN as fp16's canonical 0x7FFF."""
    v = decode(np.array([a & 0xFF, (a >> 8) & 0xFF], np.uint8), "e4m3fn").astype(np.float16)
    bits = np.where(np.isnan(v), np.uint16(0x7FFF), v.view(np.uint16))
    return int(bits[0]) | int(bits[1]) << 16


def _f32x2_to_fp8x2(fmt: str, nan_code: int):
    """``cvt.rn.satfinite.{fmt}x2.f32 d, a, b``: b (fp32 bits) to the low byte and a to the
    high byte by the reference codec's satfinite encode (the hardware cast equals it on
    every non-NaN input: an exhaustive H200 run), NaN as ``nan_code`` (the encode
    test tries each code the hardware might write)."""
    def cvt(a: int, b: int) -> int:
        x = np.array([b, a], np.uint32).view(np.float32)
        c = np.where(np.isnan(x), nan_code, encode(x, fmt, "satfinite"))
        return int(c[0]) | int(c[1]) << 8
    return cvt


def run_ptx(text: str, inputs: dict[str, int], ops: dict = OPS) -> dict[str, int]:
    """Registers after running ``text`` (``{ .reg ...; op d, a, b; ... }``) from
    ``inputs``; an instruction outside ``ops`` is an error, so the test cannot pass on a
    program it does not understand."""
    regs = dict(inputs)
    body = text.strip().removeprefix("{").removesuffix("}")
    for stmt in filter(None, (s.strip() for s in body.split(";"))):
        if stmt.startswith(".reg"):
            continue
        op, args = stmt.split(None, 1)
        if op == "mov.b32" and args.startswith("{"):  # split into 16-bit halves
            halves, src = args[1:].split("}")
            lo, hi = (h.strip() for h in halves.split(","))
            word = regs[src.strip(" ,")]
            regs[lo], regs[hi] = word & 0xFFFF, word >> 16
            continue
        if op == "mov.b32" and "{" in args:  # pack two 16-bit halves
            dst, halves = args.split(",", 1)
            lo, hi = (h.strip(" {}") for h in halves.split(","))
            regs[dst.strip()] = (regs[lo] & 0xFFFF) | (regs[hi] & 0xFFFF) << 16
            continue
        dst, *src = (a.strip() for a in args.split(","))
        vals = [regs[a] if a in regs else int(a, 0) for a in src]
        regs[dst] = ops[op](*vals) & M32
    return regs


@pytest.mark.parametrize("fmt, asm", [("e4m3fnuz", fp8._E4M3FNUZ_F16X4),
                                      ("e5m2fnuz", fp8._E5M2FNUZ_F16X4)])
@pytest.mark.parametrize("position", range(4))
def test_fnuz_assembly_decodes_every_code_in_every_byte(fmt, asm, position):
    """The assembly turns each of the four codes of its 32-bit input into the exact fp16
    value of reference.codec.decode (0x80 NaN, subnormals exact, e5m2fnuz's top binade up
    to 57344), code k into half (k % 2) of output register k // 2, for every code in every
    byte position."""
    rng = np.random.default_rng(position)
    for code in range(256):
        word = rng.integers(0, 256, 4, dtype=np.uint8)
        word[position] = code
        out = run_ptx(asm.value, {"$2": int(word.view(np.uint32)[0])})
        lanes = np.array([out["$0"], out["$1"]], np.uint32).view(np.uint16).view(np.float16)
        assert same_float(lanes, decode(word, fmt)).all(), (code, word, lanes)


def test_prmt_simulation_copies_or_sign_replicates_bytes():
    """The simulator's prmt: nibble k (0-7) copies byte k of {b, a}; with bit 3 set it
    writes 0xFF for a byte whose bit 7 is set, 0x00 otherwise (PTX ISA, prmt default mode)."""
    a, b = 0x80_7F_01_FE, 0x00_81_40_C3
    assert _prmt(a, b, 0x7654) == b and _prmt(a, b, 0x3210) == a
    assert _prmt(a, b, 0xBA98) == 0xFF_00_00_FF
    assert _prmt(a, b, 0xFEDC) == 0x00_FF_00_FF
    assert _prmt(a, 0, 0x4140) == 0x00_01_00_FE


@pytest.mark.parametrize("position", range(4))
def test_fnuz_unit_assembly_decodes_every_code_to_its_value_over_the_unit(position):
    """The attention kernels' e4m3fnuz operand assembly (``decode_fp8_f16(..., UNIT=True)``)
    gives each code's reference value divided by F16_UNIT exactly (subnormal codes as fp16
    subnormals, 0x80 a NaN, +-240 / 128), code k into half (k % 2) of output register k // 2,
    for every code in every byte position (no carry crosses bytes)."""
    rng = np.random.default_rng(10 + position)
    for code in range(256):
        word = rng.integers(0, 256, 4, dtype=np.uint8)
        word[position] = code
        out = run_ptx(fp8._E4M3FNUZ_F16X4_UNIT.value, {"$2": int(word.view(np.uint32)[0])})
        lanes = np.array([out["$0"], out["$1"]], np.uint32).view(np.uint16).view(np.float16)
        want = decode(word, "e4m3fnuz") / float(fp8.F16_UNIT.value)
        assert same_float(lanes.astype(np.float64), want).all(), (code, word, lanes)

def _encode_inputs(rng) -> np.ndarray:
    """fp32 values for the encode assembly: both NaN signs and payloads, +-Inf, +-0, the
    formats' overflow and rounding boundaries, subnormals, and random magnitudes."""
    special = np.array([np.nan, -np.nan, np.inf, -np.inf, 0.0, -0.0, 448.0, 464.0, 480.0,
                        -464.0, 57344.0, 61440.0, -61440.0, 1e30, -1e30, 2.0**-9, 2.0**-10,
                        3 * 2.0**-11, 2.0**-16, 2.0**-17, 1e-40], np.float32)
    payload_nan = np.array([0x7FC00001, 0xFF800001, 0x7F800002], np.uint32).view(np.float32)
    rand = (rng.standard_normal(2000) * np.exp2(rng.integers(-20, 18, 2000))).astype(np.float32)
    return np.concatenate([special, payload_nan, rand])


@pytest.mark.parametrize("fmt, asm, nan_codes", [
    ("e4m3fn", fp8._F32X4_E4M3FN, (0x7F, 0xFF)),
    ("e5m2", fp8._F32X4_E5M2, (0x7F, 0xFF, 0x7E, 0xFE, 0x7D, 0xFD))])
def test_encode_assembly_equals_reference_whatever_nan_the_cast_writes(fmt, asm, nan_codes):
    """encode_fp8's inline assembly (ASM) gives reference.codec.encode(x, fmt, 'satfinite')
    for four fp32 values per call, value k in byte k, in every byte position, and the
    canonical NaN code 0x7F whichever NaN code the hardware cast writes (the assembly
    rewrites NaN codes by byte-parallel integer ops; carries must not cross bytes)."""
    rng = np.random.default_rng(7)
    x = _encode_inputs(rng)
    want = encode(x, fmt, "satfinite")
    assert (want[np.isnan(x)] == 0x7F).all()
    cvt = f"cvt.rn.satfinite.{fmt}x2.f32".replace("e4m3fn", "e4m3")
    for nan_code in nan_codes:
        ops = {**OPS, cvt: _f32x2_to_fp8x2(fmt, nan_code)}
        for shift in range(4):  # every value in every byte position
            xs = np.roll(x, shift)[: len(x) // 4 * 4].reshape(-1, 4)
            ws = np.roll(want, shift)[: len(x) // 4 * 4].reshape(-1, 4)
            for quad, w in zip(xs, ws):
                bits = quad.view(np.uint32)
                out = run_ptx(asm.value, {f"${k + 1}": int(bits[k]) for k in range(4)}, ops)
                got = np.array([out["$0"]], np.uint32).view(np.uint8)
                assert np.array_equal(got, w), (nan_code, quad, got, w)


@pytest.mark.parametrize("position", range(4))
def test_e5m2fnuz_bf16_unit_assembly_decodes_every_code_to_its_value_over_the_unit(position):
    """The attention kernels' e5m2fnuz operand assembly (``decode_fp8_f16(..., UNIT=True)``)
    gives each code's reference value divided by BF16_UNIT (2^111) exactly as bf16
    (subnormal codes as bf16 subnormals, the top binade up to 57344 / 2^111, 0x80 a NaN),
    code k into half (k % 2) of output register k // 2, for every code in every byte
    position (no carry crosses bytes or halves)."""
    rng = np.random.default_rng(20 + position)
    for code in range(256):
        word = rng.integers(0, 256, 4, dtype=np.uint8)
        word[position] = code
        out = run_ptx(fp8._E5M2FNUZ_BF16X4_UNIT.value, {"$2": int(word.view(np.uint32)[0])})
        halves = np.array([out["$0"], out["$1"]], np.uint32).view(np.uint16)
        lanes = (halves.astype(np.uint32) << 16).view(np.float32)  # bf16 bits -> fp32
        want = decode(word, "e5m2fnuz") / float(fp8.BF16_UNIT.value)
        assert same_float(lanes.astype(np.float64), want).all(), (code, word, halves)
