"""kernels/fp8.py under the corrected CPU interpreter, against reference.codec.

Both branches: the software codec for all four formats, the hardware casts (through the
patched interpreter, which emulates what the H200 measured) for e4m3fn and e5m2. Sets:
every bf16 and fp16 pattern and the full 2M float32 conformance set (every fp8 value of
every format, the midpoints and their float32 neighbours, +-0, +-Inf, NaN, random bits,
log-uniform magnitudes), one launch per check. TRITON_INTERPRET=1 comes from conftest.py
(no CUDA device) or the environment; the module skips itself when kernels were built for a
GPU (run TRITON_INTERPRET=1 pytest -m interp there).
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
import torch

from kernels import fp8
from oracle.tools import conformance
from reference.codec import FP8_FORMATS, decode, encode
from tests.helpers import compile_env, same_float

pytestmark = [
    pytest.mark.interp,
    pytest.mark.skipif(not fp8.INTERPRETED,
                       reason="Triton kernels are compiled for a GPU in this process; "
                              "run TRITON_INTERPRET=1 pytest -m interp"),
]

BRANCHES = [(f, False) for f in FP8_FORMATS] + [(f, True) for f in fp8.HW_FORMATS]
ROOT = Path(__file__).resolve().parents[1]


def to_torch(x: np.ndarray) -> torch.Tensor:
    if x.dtype.name == "bfloat16":
        return torch.from_numpy(x.view(np.int16).copy()).view(torch.bfloat16)
    return torch.from_numpy(np.ascontiguousarray(x))



@pytest.fixture(scope="module")
def sets() -> dict[str, np.ndarray]:
    return {s: conformance.source_set(s) for s in conformance.SOURCE_DTYPES}


@pytest.fixture(scope="module")
def codes(sets):
    """encode_tensor's codes per (source, fmt, hw), computed once."""
    return {(s, f, hw): fp8.encode_tensor(to_torch(x), f, hw).numpy()
            for s, x in sets.items() for f, hw in BRANCHES}


@pytest.mark.parametrize("source", conformance.SOURCE_DTYPES)
@pytest.mark.parametrize(("fmt", "hw"), BRANCHES)
def test_encode_equals_reference(sets, codes, source, fmt, hw):
    """encode_fp8 (satfinite, RNE, subnormals, NaN -> 0x7F OCP / 0x80 fnuz, -0 -> 0x80 OCP /
    0x00 fnuz) equals reference.codec.encode(x, fmt, 'satfinite') byte for byte -- NaN
    codes included, which is stricter than NaN-as-NaN -- on the whole source set."""
    want = encode(sets[source], fmt, "satfinite")
    got = codes[source, fmt, hw]
    assert got.dtype == np.uint8 and got.shape == want.shape
    bad = np.flatnonzero(got != want)
    assert bad.size == 0, (sets[source][bad[:5]], got[bad[:5]], want[bad[:5]])


@pytest.mark.parametrize("source", conformance.SOURCE_DTYPES)
@pytest.mark.parametrize("fmt", fp8.HW_FORMATS)
def test_branches_agree_bit_for_bit(codes, source, fmt):
    """On the OCP formats the software and hardware branches give identical bytes."""
    assert np.array_equal(codes[source, fmt, False], codes[source, fmt, True])


@pytest.mark.parametrize(("fmt", "hw"), BRANCHES)
def test_decode_every_code(fmt, hw):
    """decode_fp8 of all 256 codes equals reference.codec.decode exactly: -0 keeps its sign,
    NaN codes give NaN, e5m2's 0x7C/0xFC give +-Inf, subnormals are exact."""
    c = np.arange(256, dtype=np.uint8)
    got = fp8.decode_tensor(torch.from_numpy(c), fmt, hw).numpy()
    assert got.dtype == np.float32
    assert same_float(got, decode(c, fmt)).all()


@pytest.mark.parametrize(("fmt", "hw"), BRANCHES)
def test_decode_to_fp16_every_code(fmt, hw):
    """decode_fp8_f16 (the attention kernels' fp16 operand path: e4m3fnuz built as fp16 bits
    directly, the others through fp32) of all 256 codes equals reference.codec.decode in
    fp16 exactly (every fp8 value is an fp16 value; -0, NaN, Inf and subnormals kept)."""
    c = np.arange(256, dtype=np.uint8)
    got = fp8.decode_tensor_f16(torch.from_numpy(c), fmt, hw).numpy()
    assert got.dtype == np.float16
    assert same_float(got, decode(c, fmt)).all()


@pytest.mark.parametrize(("fmt", "hw"), BRANCHES)
def test_decode_inverts_encode_on_fp8_values(fmt, hw):
    """Every finite value of the format survives encode then decode (a roundtrip), and each
    finite code is what encoding its own value gives (fnuz: +0 for 0x00)."""
    c = np.arange(256, dtype=np.uint8)
    v = decode(c, fmt)
    finite = np.isfinite(v)
    back = fp8.encode_tensor(torch.from_numpy(v[finite].astype(np.float32)), fmt, hw).numpy()
    assert np.array_equal(back, c[finite])
    again = fp8.decode_tensor(torch.from_numpy(back), fmt, hw).numpy()
    assert same_float(again, v[finite]).all()


def test_launchers_keep_shape_and_handle_empty():
    """Launchers accept any shape (output has the input's shape) and empty tensors, and an
    explicit block size gives the same bytes as the default one."""
    x = torch.linspace(-500, 500, 3 * 37, dtype=torch.float32).reshape(3, 37)
    c = fp8.encode_tensor(x, "e4m3fn")
    assert c.shape == (3, 37) and c.dtype == torch.uint8
    assert np.array_equal(c.numpy(), encode(x.numpy(), "e4m3fn"))
    assert torch.equal(fp8.encode_tensor(x, "e4m3fn", block=16), c)
    assert fp8.decode_tensor(c, "e4m3fn").shape == (3, 37)
    assert fp8.encode_tensor(torch.empty(0), "e5m2").shape == (0,)
    assert fp8.decode_tensor(torch.empty(0, dtype=torch.uint8), "e5m2").shape == (0,)


def test_host_validation():
    """Bad input is rejected on the host with a message: unknown format names (listing the
    valid ones), hw=True for fnuz, wrong dtypes, non-power-of-two blocks."""
    x = torch.zeros(4)
    with pytest.raises(ValueError, match="e4m3fn.*e4m3fnuz.*e5m2.*e5m2fnuz"):
        fp8.encode_tensor(x, "fp8")
    with pytest.raises(ValueError, match="e4m3fn"):
        fp8.decode_tensor(torch.zeros(4, dtype=torch.uint8), "float8_e4m3fn")
    for fmt in ("e4m3fnuz", "e5m2fnuz"):
        with pytest.raises(ValueError, match="software codec"):
            fp8.encode_tensor(x, fmt, hw=True)
        with pytest.raises(ValueError, match="software codec"):
            fp8.decode_tensor(torch.zeros(4, dtype=torch.uint8), fmt, hw=True)
    with pytest.raises(ValueError, match="dtype"):
        fp8.encode_tensor(torch.zeros(4, dtype=torch.float64), "e4m3fn")
    with pytest.raises(ValueError, match="uint8"):
        fp8.decode_tensor(torch.zeros(4, dtype=torch.int8), "e4m3fn")
    with pytest.raises(ValueError, match="power of two"):
        fp8.encode_tensor(x, "e4m3fn", block=100)
    assert fp8.FMT_CODES == {"e4m3fn": 0, "e5m2": 1, "e4m3fnuz": 2, "e5m2fnuz": 3}
    assert [fp8.FMT_E4M3FN, fp8.FMT_E5M2, fp8.FMT_E4M3FNUZ, fp8.FMT_E5M2FNUZ] == [0, 1, 2, 3]


_COMPILE = textwrap.dedent("""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from kernels import fp8
    assert not fp8.INTERPRETED
    target = GPUTarget("cuda", 90, 32)
    for kernel, src, dst, arg in ((fp8._encode_kernel, "*fp32", "*u8", "x_ptr"),
                                  (fp8._decode_kernel, "*u8", "*fp32", "c_ptr")):
        for fmt in range(4):
            for hw in ((False, True) if fmt < 2 else (False,)):
                sig = {arg: src, "out_ptr": dst, "n": "i32", "FMT": "constexpr",
                       "HW": "constexpr", "BLOCK": "constexpr"}
                ast = ASTSource(fn=kernel, signature=sig,
                                constexprs={"FMT": fmt, "HW": hw, "BLOCK": 1024})
                ptx = triton.compile(ast, target=target).asm["ptx"]
                fp8_cvt = "satfinite.e4m3x2" in ptx or "satfinite.e5m2x2" in ptx
                if kernel is fp8._encode_kernel:
                    assert fp8_cvt == hw, (fmt, hw)
                print(kernel.fn.__name__, fmt, hw, "ok")
""")


def test_gpu_kernels_compile_for_sm90(tmp_path):
    """The codec kernels (both branches, every format) compile for sm_90 with the real Triton
    compiler -- no GPU needed -- and only the hardware branch emits the satfinite fp8 cvt.
    Runs in a subprocess with TRITON_INTERPRET=0, so kernels are decorated for the GPU."""
    env = compile_env(tmp_path)
    r = subprocess.run([sys.executable, "-c", _COMPILE], cwd=ROOT, env=env,
                       capture_output=True, text=True, timeout=300)
    if r.returncode and ("ptxas" in r.stderr and "not found" in r.stderr):
        pytest.skip(f"no CUDA compiler toolchain in this Triton install: {r.stderr[-300:]}")
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout.count(" ok") == 12
