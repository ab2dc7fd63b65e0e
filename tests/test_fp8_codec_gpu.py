"""kernels/fp8.py on the GPU against reference.codec, exhaustively.

The same checks as tests/test_fp8_codec_interp.py with the full conformance sets on the
device: every bf16 and fp16 pattern and the 2M float32 set, both branches (the software
codec for all four formats, the hardware casts for e4m3fn and e5m2), and all 256 codes of
every format for decode. Run on the GPU machine: ``pytest -m gpu tests/test_fp8_codec_gpu.py``.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kernels import fp8
from oracle.tools import conformance
from reference.codec import FP8_FORMATS, decode, encode
from tests.helpers import same_float

pytestmark = [
    pytest.mark.gpu,
    # (without CUDA, conftest.py's "needs a CUDA device" skip is the one reported)
    pytest.mark.skipif(fp8.INTERPRETED and torch.cuda.is_available(),
                       reason="kernels were decorated for the CPU interpreter "
                              "(TRITON_INTERPRET=1): unset it to run the GPU tests"),
]

BRANCHES = [(f, False) for f in FP8_FORMATS] + [(f, True) for f in fp8.HW_FORMATS]
#: encode's branches: hw "asm" is the hardware cast in encode_fp8's inline assembly.
ENCODE_BRANCHES = BRANCHES + [(f, "asm") for f in fp8.HW_FORMATS]


def to_cuda(x: np.ndarray) -> torch.Tensor:
    if x.dtype.name == "bfloat16":
        return torch.from_numpy(x.view(np.int16).copy()).view(torch.bfloat16).cuda()
    return torch.from_numpy(np.ascontiguousarray(x)).cuda()



@pytest.fixture(scope="module")
def sets() -> dict[str, np.ndarray]:
    return {s: conformance.source_set(s) for s in conformance.SOURCE_DTYPES}


@pytest.fixture(scope="module")
def codes(sets):
    """encode_tensor's codes per (source, fmt, branch), computed once on the device."""
    return {(s, f, hw): fp8.encode_tensor(to_cuda(x), f, bool(hw), asm=hw == "asm")
            .cpu().numpy() for s, x in sets.items() for f, hw in ENCODE_BRANCHES}


@pytest.mark.parametrize("source", conformance.SOURCE_DTYPES)
@pytest.mark.parametrize(("fmt", "hw"), ENCODE_BRANCHES)
def test_encode_equals_reference(sets, codes, source, fmt, hw):
    """On the GPU, encode_fp8 (satfinite, RNE, subnormals, canonical NaN and signed-zero
    codes) equals reference.codec.encode(x, fmt, 'satfinite') byte for byte on the whole
    source set (NaN codes included), in each branch (software, hardware cast, and the
    hardware cast in inline assembly)."""
    want = encode(sets[source], fmt, "satfinite")
    got = codes[source, fmt, hw]
    bad = np.flatnonzero(got != want)
    assert bad.size == 0, (bad.size, sets[source][bad[:5]], got[bad[:5]], want[bad[:5]])


@pytest.mark.parametrize("source", conformance.SOURCE_DTYPES)
@pytest.mark.parametrize("fmt", fp8.HW_FORMATS)
def test_branches_agree_bit_for_bit(codes, source, fmt):
    """On the GPU the software codec, the hardware cvt and its inline-assembly form give
    identical bytes (OCP)."""
    assert np.array_equal(codes[source, fmt, False], codes[source, fmt, True])
    assert np.array_equal(codes[source, fmt, False], codes[source, fmt, "asm"])


@pytest.mark.parametrize(("fmt", "hw"), BRANCHES)
def test_decode_every_code(fmt, hw):
    """On the GPU, decode_fp8 of all 256 codes equals reference.codec.decode exactly (-0
    keeps its sign, NaN as NaN, e5m2 Inf codes as +-Inf, subnormals exact: no flush)."""
    c = np.arange(256, dtype=np.uint8)
    got = fp8.decode_tensor(to_cuda(c), fmt, hw).cpu().numpy()
    assert same_float(got, decode(c, fmt)).all()


@pytest.mark.parametrize(("fmt", "hw"), BRANCHES)
def test_decode_to_fp16_every_code(fmt, hw):
    """On the GPU, decode_fp8_f16 of all 256 codes (its inline assembly for e4m3fn and e5m2
    with hw, and e4m3fnuz: the attention kernels' V path) equals reference.codec.decode in
    fp16 exactly, in every byte position of a 32-bit word (the assembly takes four codes)."""
    c = np.concatenate([np.arange(256, dtype=np.uint8)] * 4)
    c = np.stack([np.roll(c, k) for k in range(4)], axis=1).ravel()
    got = fp8.decode_tensor_f16(to_cuda(c), fmt, hw).cpu().numpy()
    assert got.dtype == np.float16
    assert same_float(got, decode(c, fmt)).all()


@pytest.mark.parametrize(("fmt", "hw"), BRANCHES)
def test_unit_decode_to_fp16_every_code(fmt, hw):
    """On the GPU, the attention kernels' operand decode with scalar scales
    (``decode_fp8_f16(..., UNIT=True)``) of all 256 codes in every byte position, times the
    factor it leaves out (F16_UNIT for e4m3fnuz's bit-placement assembly, BF16_UNIT for
    e5m2fnuz's bf16 operands, else 1), equals reference.codec.decode exactly: the fnuz
    formats' subnormal codes as fp16 / bf16 subnormals, 0x80 a NaN."""
    c = np.concatenate([np.arange(256, dtype=np.uint8)] * 4)
    c = np.stack([np.roll(c, k) for k in range(4)], axis=1).ravel()
    got = fp8.decode_tensor_f16(to_cuda(c), fmt, hw, unit=True)
    assert got.dtype == (torch.bfloat16 if fmt == "e5m2fnuz" else torch.float16)
    got = got.double().cpu().numpy()
    unit = {"e4m3fnuz": float(fp8.F16_UNIT.value) if fp8.asm_f16(fmt, False) else 1.0,
            "e5m2fnuz": float(fp8.BF16_UNIT.value)}.get(fmt, 1.0)
    assert same_float(got * unit, decode(c, fmt)).all()

@pytest.mark.parametrize(("fmt", "hw"), BRANCHES)
def test_decode_inverts_encode_on_fp8_values(fmt, hw):
    """On the GPU every finite value of the format survives encode then decode."""
    c = np.arange(256, dtype=np.uint8)
    v = decode(c, fmt)
    finite = np.isfinite(v)
    back = fp8.encode_tensor(to_cuda(v[finite].astype(np.float32)), fmt, hw)
    assert np.array_equal(back.cpu().numpy(), c[finite])
    again = fp8.decode_tensor(back, fmt, hw).cpu().numpy()
    assert same_float(again, v[finite]).all()
