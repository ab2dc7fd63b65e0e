"""csrc/ on the CPU and the GPU (issue 6): the CUDA sources compile for sm_90, the build is
cached, the conversions of csrc/fp8_convert.h agree bit for bit with reference/codec.py on
every 16-bit pattern and the float32 sets of oracle/conformance.py (host build with g++;
the device build under the ``gpu`` marker), the ctypes binding matches the C struct and
turns CUDA errors into RuntimeError with CUDA's text, and the CUDA launcher shares the
Triton launcher's signature and host checks. The fused kernel's numerics are judged by the
generic differential test (implementation "cuda", marker gpu) and the gpu tests below.
"""

from __future__ import annotations

import ctypes
import inspect
import shutil
import subprocess
import time

import numpy as np
import pytest
import torch

from kernels import cuda_build
from kernels import cuda_norm_rope_insert as cnri
from oracle import conformance
from reference.codec import FP8_FORMATS, POLICIES, decode, encode, round_dtype
from tests.helpers import same_float

NVCC = cuda_build.find_nvcc()
GXX = shutil.which("g++") or shutil.which("c++")
needs_nvcc = pytest.mark.skipif(NVCC is None, reason="nvcc not found (PATH, $CUDA_HOME, "
                                                     "/usr/local/cuda/bin)")
needs_gxx = pytest.mark.skipif(GXX is None, reason="no host C++ compiler (g++/c++)")
FMT = cnri.FORMAT_CODES
HALF = ("bfloat16", "float16")
P = ctypes.c_void_p


@pytest.fixture(scope="module")
def sets():
    """The conformance source sets as float32 (bf16/fp16 widen exactly)."""
    return {s: np.ascontiguousarray(conformance.source_set(s).astype(np.float32))
            for s in conformance.SOURCE_DTYPES}


# --------------------------------------------------------------------- nvcc and the build


@needs_nvcc
def test_csrc_compiles_for_sm90_without_warnings(tmp_path):
    """Every .cu in csrc/ compiles for sm_90 (nvcc -c, the build's flags) with host and
    device warnings treated as errors."""
    sources = sorted(cuda_build.CSRC.glob("*.cu"))
    assert {s.name for s in sources} >= set(cuda_build.LIB_SOURCES)
    cmds = [[NVCC, *cuda_build.NVCC_FLAGS, f"-I{cuda_build.CSRC}", "-Werror", "all-warnings",
             "-Xcompiler", "-Wall,-Wextra,-Werror", "-c", str(s), "-o",
             str(tmp_path / f"{s.stem}.o")] for s in sources]
    cuda_build._run(cmds)
    assert all((tmp_path / f"{s.stem}.o").stat().st_size > 0 for s in sources)


@pytest.fixture(scope="module")
def lib():
    """The kernels' library from the real build (the user cache: compiled once per machine),
    loaded with its prototypes."""
    if NVCC is None:
        pytest.skip("nvcc not found")
    return cnri.load_library(cuda_build.build())


_TINY = "extern \"C\" int tiny_answer(void) { return 42; }\n"


@needs_nvcc
def test_build_is_cached_by_content(tmp_path, monkeypatch):
    """A second build of the same sources and flags returns the same library without
    running nvcc (a hash of the files only); changing a source or a flag changes the key."""
    src = tmp_path / "tiny.cu"
    src.write_text(_TINY)
    cache = tmp_path / "cache"
    path = cuda_build.build([src], cache_dir=cache, include_dir=None)
    assert ctypes.CDLL(str(path)).tiny_answer() == 42

    def no_nvcc(*a, **k):
        raise AssertionError("nvcc must not run for a cached build")

    monkeypatch.setattr(subprocess, "Popen", no_nvcc)
    t0 = time.perf_counter()
    assert cuda_build.build([src], cache_dir=cache, include_dir=None) == path
    assert time.perf_counter() - t0 < 0.5
    key = cuda_build.build_key([src], cuda_build.NVCC_FLAGS, NVCC, None)
    assert key != cuda_build.build_key([src], cuda_build.NVCC_FLAGS + ("-G",), NVCC, None)
    src.write_text(_TINY + "// changed\n")
    assert key != cuda_build.build_key([src], cuda_build.NVCC_FLAGS, NVCC, None)


@needs_nvcc
def test_failed_build_raises_with_nvcc_stderr(tmp_path):
    """A source that does not compile raises BuildError (a RuntimeError) carrying nvcc's
    error message, and leaves no library in the cache."""
    src = tmp_path / "broken.cu"
    src.write_text("__global__ void k() { undeclared_thing = 1; }\n")
    with pytest.raises(cuda_build.BuildError, match="undeclared_thing") as e:
        cuda_build.build([src], cache_dir=tmp_path / "cache", include_dir=None)
    assert isinstance(e.value, RuntimeError) and "broken.cu" in str(e.value)
    assert not list((tmp_path / "cache").rglob("*.so"))


def test_missing_nvcc_raises(monkeypatch, tmp_path):
    """Without nvcc anywhere, build() raises BuildError saying where it looked."""
    monkeypatch.setattr(cuda_build, "find_nvcc", lambda: None)
    with pytest.raises(cuda_build.BuildError, match="nvcc not found"):
        cuda_build.build(cache_dir=tmp_path)


# ------------------------------------------------------------------------- binding


def test_params_layout_matches_the_library(lib):
    """The ctypes NriParams has the C struct's field names, kinds, order and size (load
    checks it too; here it is asserted explicitly)."""
    desc = lib.nri_params_fields().decode().rstrip(",").split(",")
    assert [f.split(":")[1] for f in desc] == [name for name, _ in cnri.NriParams._fields_]
    assert lib.nri_params_size() == ctypes.sizeof(cnri.NriParams) == 8 * len(desc)


def test_cuda_error_becomes_runtime_error_with_cuda_text(lib):
    """A nonzero cudaError_t raises RuntimeError whose message is cudaGetErrorString's text;
    a failed launch (here without a usable GPU, or with an invalid configuration on one)
    goes the same way."""
    assert lib.csrc_error_string(1) == b"invalid argument"
    with pytest.raises(RuntimeError, match="CUDA error 1: invalid argument"):
        cnri.check_cuda(1, "test", lib)
    cnri.check_cuda(0, "test", lib)  # success: no exception
    code = lib.csrc_test_bad_launch(None)
    assert code != 0
    text = lib.csrc_error_string(code).decode()
    with pytest.raises(RuntimeError, match=rf"CUDA error {code}: {text}$"):
        cnri.check_cuda(code, "test", lib)


def test_launch_rejects_bad_parameters(lib):
    """nri_launch returns cudaErrorInvalidValue (1) for a null parameter block or an
    unsupported head dim / rotary dim, before touching any pointer; N = 0 is a no-op."""
    assert lib.nri_launch(None, None) == 1
    p = cnri.NriParams(n=1, hq=1, hkv=1, head_dim=96, rotary_dim=2, act_fmt=4,
                       heads_per_block=4, page_size=16, ic_page=1, kv_fmt=0, iq_fmt=4,
                       ic_fmt=4)
    assert lib.nri_launch(ctypes.byref(p), None) == 1
    p.head_dim, p.rotary_dim = 128, 130
    assert lib.nri_launch(ctypes.byref(p), None) == 1
    p.rotary_dim, p.n = 64, 0
    assert lib.nri_launch(ctypes.byref(p), None) == 0


# ----------------------------------------------------------------- host codec (g++)


@pytest.fixture(scope="module")
def host_codec(tmp_path_factory):
    """csrc/codec_host.cpp + fp8_convert.h built for the CPU with g++ (warnings as errors)."""
    if GXX is None:
        pytest.skip("no host C++ compiler")
    out = tmp_path_factory.mktemp("codec") / "libcodec_host.so"
    cmd = [GXX, "-O2", "-std=c++17", "-Wall", "-Wextra", "-Werror", "-shared", "-fPIC",
           f"-I{cuda_build.CSRC}", str(cuda_build.CSRC / "codec_host.cpp"), "-o", str(out)]
    r = subprocess.run(cmd, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    return ctypes.CDLL(str(out))


def _host_encode(lib, x, fmt, satfinite):
    out = np.empty(x.size, np.uint8)
    lib.cvt_encode_fp8(P(x.ctypes.data), P(out.ctypes.data), ctypes.c_int64(x.size),
                       FMT[fmt], int(satfinite))
    return out


def _host_decode(lib, codes, fmt):
    out = np.empty(codes.size, np.float32)
    fn = lib.cvt_decode_fp8 if codes.dtype == np.uint8 else lib.cvt_decode_half
    fn(P(codes.ctypes.data), P(out.ctypes.data), ctypes.c_int64(codes.size), FMT[fmt])
    return out


def _host_round(lib, x, fmt):
    out = np.empty(x.size, np.uint16)
    lib.cvt_round_half(P(x.ctypes.data), P(out.ctypes.data), ctypes.c_int64(x.size), FMT[fmt])
    return out


@needs_gxx
@pytest.mark.parametrize("source", conformance.SOURCE_DTYPES)
@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("fmt", FP8_FORMATS)
def test_host_encode_equals_reference_codes(host_codec, sets, fmt, policy, source):
    """fp32 -> fp8 on the CPU gives exactly reference.codec.encode's code (NaN: the
    canonical code, -0: 0x80 OCP / 0x00 fnuz) for every bf16 and fp16 pattern and the
    >= 2M float32 values, every format, both policies."""
    x = sets[source]
    ours, ref = _host_encode(host_codec, x, fmt, policy == "satfinite"), encode(x, fmt, policy)
    bad = np.flatnonzero(ours != ref)
    assert bad.size == 0, (f"{bad.size} mismatches, first: x={x[bad[:4]]} ours="
                           f"{ours[bad[:4]]} reference={ref[bad[:4]]}")


@needs_gxx
@pytest.mark.parametrize("fmt", FP8_FORMATS)
def test_host_decode_every_code(host_codec, fmt):
    """All 256 codes decode on the CPU to exactly the reference value (signed zeros and
    Inf included; NaN codes to NaN)."""
    codes = np.arange(256, dtype=np.uint8)
    assert same_float(_host_decode(host_codec, codes, fmt), decode(codes, fmt)).all()


@needs_gxx
@pytest.mark.parametrize("source", conformance.SOURCE_DTYPES)
@pytest.mark.parametrize("fmt", HALF)
def test_host_round_to_half_equals_reference(host_codec, sets, fmt, source):
    """fp32 -> bf16/fp16 on the CPU is RNE with subnormals and overflow to Inf: the bits
    equal reference.codec.encode(x, fmt, "nonsaturating") (NaN: 0x7FC0 / 0x7E00) and the
    values equal reference.codec.round_dtype, on every pattern and the float32 set."""
    x = sets[source]
    ours = _host_round(host_codec, x, fmt)
    ref = encode(x, fmt, "nonsaturating")
    bad = np.flatnonzero(ours != ref)
    assert bad.size == 0, f"{bad.size} mismatches, first: x={x[bad[:4]]} ours={ours[bad[:4]]}"
    with np.errstate(invalid="ignore"):
        assert same_float(decode(ours, fmt), round_dtype(x.astype(np.float64), fmt)).all()


@needs_gxx
@pytest.mark.parametrize("fmt", HALF)
def test_host_decode_every_half_pattern(host_codec, fmt):
    """All 65,536 bf16/fp16 patterns widen on the CPU to exactly their reference value."""
    codes = np.arange(1 << 16, dtype=np.uint32).astype(np.uint16)
    with np.errstate(invalid="ignore"):  # signalling NaN patterns widen to quiet NaNs
        assert same_float(_host_decode(host_codec, codes, fmt), decode(codes, fmt)).all()


# --------------------------------------------------------------------- the launcher


def test_same_signature_as_the_triton_launcher():
    """The CUDA launcher takes exactly the Triton launcher's arguments (names, kinds,
    defaults) apart from Triton's own tuning knob num_warps, so the two are
    interchangeable."""
    from kernels import norm_rope_insert as nri

    triton_params = [p for name, p in inspect.signature(nri.norm_rope_insert).parameters.items()
                     if name != "num_warps"]
    assert list(inspect.signature(cnri.norm_rope_insert).parameters.values()) == triton_params


def _good_args(**kw):
    from tests.test_kernel_norm_rope_insert import _good_args as good

    return good(**kw)


@pytest.mark.parametrize("name, change", [
    ("rows", lambda a: {"rows": a["rows"].float()}),
    ("rotary_dim", lambda a: {"rotary_dim": 7}),
    ("head_dim", lambda a: {"head_dim": 96}),
    ("kv_cache", lambda a: {"kv_cache": a["kv_cache"][..., :64]}),
    ("kv_fmt", lambda a: {"kv_fmt": "fp8"}),
    ("k_scale", lambda a: {"k_scale": torch.ones(3, device=a["rows"].device)}),
    ("index_fmt", lambda a: {"index_fmt": "e5m2"}),
    ("index_cache", lambda a: {"index_cache": None}),
    ("slot_mapping", lambda a: {"slot_mapping": a["slot_mapping"].new_tensor([4, 4, -1])}),
    ("positions", lambda a: {"positions": a["positions"].new_tensor([0, 16, 1])}),
    ("block_h", lambda a: {"block_h": 3}),
])
def test_bad_host_input_raises_value_error_naming_it(name, change):
    """The shared host checks: bad dtypes, shapes, formats, contents (validate=True) and
    block sizes raise ValueError naming the argument, before any launch."""
    a = _good_args()
    a.update(change(a))
    kv0 = a["kv_cache"].clone()
    with pytest.raises(ValueError, match=rf"^{name}\b"):
        cnri.norm_rope_insert(**a, validate=True)
    assert torch.equal(a["kv_cache"], kv0)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-tensor error")
def test_cpu_tensors_are_rejected():
    """Valid arguments on the CPU raise ValueError naming rows: the kernel needs CUDA."""
    with pytest.raises(ValueError, match=r"^rows must be on a CUDA device"):
        cnri.norm_rope_insert(**_good_args())


def test_registered_only_with_cuda_and_nvcc():
    """Implementation "cuda" of norm_rope_insert exists exactly when a CUDA device and nvcc
    are present; it runs on CUDA only and quantises K from its fp32 value."""
    from oracle.registry import implementations

    impls = {i.name: i for i in implementations("norm_rope_insert")}
    assert ("cuda" in impls) == cnri.available()
    if "cuda" in impls:
        assert impls["cuda"].devices == ("cuda",) and impls["cuda"].quantize_from == "value"


# ------------------------------------------------------------------------------ GPU


@pytest.mark.gpu
def test_bad_launch_raises_runtime_error_and_the_context_survives(lib):
    """A launch with an invalid configuration (4096 threads per block, no memory touched)
    raises RuntimeError carrying CUDA's error number and text (the H200 with CUDA 13 says
    "invalid argument"); the error is not sticky: torch keeps working afterwards."""
    stream = torch.cuda.current_stream().cuda_stream
    with pytest.raises(RuntimeError, match=r"bad launch failed: CUDA error [1-9]\d*: \w+"):
        cnri.check_cuda(lib.csrc_test_bad_launch(P(stream)), "bad launch", lib)
    assert torch.ones(4, device="cuda").sum().item() == 4.0


def _device(lib, op, x, out_dtype, fmt, satfinite=True):
    t_in = torch.from_numpy(x).cuda()
    t_out = torch.empty(x.size, dtype=out_dtype, device="cuda")
    code = lib.cvt_device(op, P(t_in.data_ptr()), P(t_out.data_ptr()), x.size, FMT[fmt],
                          int(satfinite), P(torch.cuda.current_stream().cuda_stream))
    cnri.check_cuda(code, "cvt_device", lib)
    return t_out.cpu().numpy()


@pytest.mark.gpu
@pytest.mark.parametrize("path", ["kernel", "software"])
@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("fmt", FP8_FORMATS)
def test_device_codec_equals_reference(lib, sets, fmt, policy, path):
    """On the GPU, fp32 -> fp8 (the kernels' path: cvt.rn.satfinite for e4m3fn/e5m2
    satfinite; and the software path alone) gives exactly the reference codes on every
    source set, and every code decodes to its reference value."""
    op = 0 if path == "kernel" else 1
    for source, x in sets.items():
        ours = _device(lib, op, x, torch.uint8, fmt, policy == "satfinite")
        ref = encode(x, fmt, policy)
        bad = np.flatnonzero(ours != ref)
        assert bad.size == 0, (f"{source}: {bad.size} mismatches, first: x={x[bad[:4]]} "
                               f"ours={ours[bad[:4]]} reference={ref[bad[:4]]}")
    codes = np.arange(256, dtype=np.uint8)
    assert same_float(_device(lib, 2, codes, torch.float32, fmt), decode(codes, fmt)).all()


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", HALF)
def test_device_half_rounding_equals_reference(lib, sets, fmt):
    """On the GPU, fp32 -> bf16/fp16 (cvt.rn) gives the reference bits (canonical NaN) on
    every source set, and all 65,536 patterns widen to their reference values."""
    for source, x in sets.items():
        ours = _device(lib, 3, x, torch.int16, fmt).view(np.uint16)
        ref = encode(x, fmt, "nonsaturating")
        assert np.array_equal(ours, ref), source
    codes = np.arange(1 << 16, dtype=np.uint32).astype(np.uint16)
    got = _device(lib, 4, codes.view(np.int16), torch.float32, fmt)
    with np.errstate(invalid="ignore"):
        assert same_float(got, decode(codes, fmt)).all()


def _cuda_impl():
    from oracle.registry import implementations

    (impl,) = implementations("norm_rope_insert", ["cuda"])
    return impl


@pytest.mark.gpu
@pytest.mark.parametrize("r, d, kv_fmt, layout, pad, scales, dense", [
    (6, 64, "e4m3fn", "NHD", 0, "slot", False),
    (10, 64, "bfloat16", "HND", 8, "none", False),
    (126, 128, "e4m3fnuz", "HND", 8, "tensor", False),
    (2, 64, "e5m2fnuz", "NHD", 8, "slot", False),
    (62, 64, "e5m2", "HND", 0, "tensor", True),
    (64, 64, "float16", "NHD", 0, "none", False),
    (250, 256, "e4m3fn", "NHD", 8, "slot", False),
    (96, 128, "e5m2", "HND", 0, "none", False),
])
def test_cuda_any_even_rotary_dim_matches_reference(r, d, kv_fmt, layout, pad, scales, dense):
    """Rotary dims whose half is odd or not a power of two, full R = D, D = 64/128/256, every
    cache format, HND/NHD/padded, none/tensor/per-slot scales, indexed and dense rows: the
    CUDA kernel's outputs and cache writes are admitted by the oracle."""
    from oracle.checks import run_check
    from tests.test_kernel_norm_rope_insert import _case, make_case_inputs

    md = "float16" if kv_fmt == "float16" else "bfloat16"
    x = make_case_inputs(d=d, r=r, kv_fmt=kv_fmt, layout=layout, pad=pad, scales=scales,
                         dense=dense, md=md, seed=r, n=7)
    res = run_check(_case(x), _cuda_impl(), inputs=x)
    assert res.passed, res.summary()


@pytest.mark.gpu
def test_cuda_guards_out_of_range_slots_and_positions():
    """A slot past the cache or negative is skipped and a position past the table reads no
    row: nothing outside the valid slots changes, nothing crashes."""
    from tests.test_kernel_norm_rope_insert import MAX_POS, make_case_inputs

    x = make_case_inputs(kv_fmt="e4m3fn", n=4, seed=3)
    num_slots = x["kv_cache"].shape[0] * x["kv_cache"].shape[2]
    x["slot_mapping"] = np.array([3, num_slots + 5, -1, 7], np.int64)
    x["positions"] = np.array([1, MAX_POS + 3, -2, 5], np.int64)
    out = cnri.run(x, validate=False)
    before, after = x["kv_cache"], out["kv_cache"]
    page = before.shape[2]
    mask = np.ones(before.shape, bool)
    for s in (3, 7):
        mask[s // page, :, s % page] = False
    assert np.array_equal(after[mask], before[mask])
    torch.cuda.synchronize()


@pytest.mark.gpu
def test_cuda_in_place_equals_separate_q_out_and_skip_index():
    """q in place and q to a strided q_out give the same bits; v is untouched; with
    skip_index the index columns and the index cache stay as they were."""
    a, b = _good_args(kv_fmt="bfloat16"), _good_args(kv_fmt="bfloat16")
    b["rows"] = a["rows"].clone()
    rows0 = a["rows"].clone()
    q_out = torch.empty(2, 3, 64, dtype=torch.bfloat16, device="cuda").transpose(0, 1)
    out_in = cnri.norm_rope_insert(**a)
    out_sep = cnri.norm_rope_insert(**b, q_out=q_out)
    for key in ("q", "k", "index_k"):
        assert torch.equal(out_in[key].view(torch.int16), out_sep[key].view(torch.int16)), key
    v = slice(3 * 64, 4 * 64)
    assert torch.equal(a["rows"][:, v].view(torch.int16), rows0[:, v].view(torch.int16))
    c = _good_args()
    rows_c, ic0 = c["rows"].clone(), c["index_cache"].clone()
    cnri.norm_rope_insert(**c, skip_index=True)
    idx = slice(4 * 64, 6 * 64)
    assert torch.equal(c["rows"][:, idx].view(torch.int16), rows_c[:, idx].view(torch.int16))
    assert torch.equal(c["index_cache"], ic0)


@pytest.mark.gpu
def test_cuda_64_bit_cache_offsets():
    """A cache of more than 2^32 bytes: K/V of a token in the last page land there with the
    same codes as in a small cache, and the byte where a 32-bit offset would wrap to stays
    untouched."""
    a = _good_args()
    d, page, hkv = 64, 16, 1
    pages = (2**32 // (hkv * page * 2 * d)) + 2  # > 2^32 bytes
    big = torch.zeros(pages, hkv, page, 2 * d, dtype=torch.uint8, device="cuda")
    slot = (pages - 1) * page + 5
    small_slots = a["slot_mapping"].clone()
    a_big = _good_args()
    a_big["rows"] = a["rows"].clone()
    a_big["kv_cache"] = big
    a_big["slot_mapping"] = small_slots.new_tensor([slot, -1, -1])
    a["slot_mapping"] = small_slots.new_tensor([5, -1, -1])
    cnri.norm_rope_insert(**a)
    cnri.norm_rope_insert(**a_big)
    assert torch.equal(big[-1, 0, 5], a["kv_cache"][0, 0, 5])
    wrapped = (slot // page) * big.stride(0) + (slot % page) * big.stride(2)
    assert not big.view(-1)[wrapped % 2**32:wrapped % 2**32 + 2 * d].any()
    del big
    torch.cuda.empty_cache()
