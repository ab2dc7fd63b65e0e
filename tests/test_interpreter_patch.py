"""The patched Triton CPU interpreter (kernels/interpreter.py) against reference.codec.

Sets: every bf16 and fp16 pattern, the 2M float32 conformance set (oracle/tools/conformance.py),
every fp8 code. One launch over a large 1-D tensor per check (the interpreter is fast on
large blocks and slow per program). TRITON_INTERPRET=1 comes from conftest.py (no CUDA
device) or the environment; the module skips itself when kernels were built for a GPU.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest
import torch

from kernels import _triton
from kernels import interpreter as interp
from kernels._triton import tl, triton
from oracle.tools import conformance
from reference.codec import decode, encode
from tests.helpers import compile_env, same_float

TL_FP8 = {"e4m3fn": tl.float8e4nv, "e5m2": tl.float8e5}
TL_FNUZ = {"e4m3fnuz": tl.float8e4b8, "e5m2fnuz": tl.float8e5b16}
TL_SRC = {"float32": tl.float32, "bfloat16": tl.bfloat16, "float16": tl.float16}
TORCH = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16,
         "uint8": torch.uint8, "uint16": torch.uint16, "int32": torch.int32}
BLOCK = 1 << 18


@triton.jit
def _cast_kernel(x_ptr, out_ptr, n, DST: tl.constexpr, FROM_BITS: tl.constexpr,
                 TO_BITS: tl.constexpr, BLOCK: tl.constexpr):
    """out = x.to(DST); FROM_BITS: x holds uint8 codes of DST's fp8 source type (a decode);
    TO_BITS: store the result's bits (fp8 -> uint8, bf16 -> uint16)."""
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    x = tl.load(x_ptr + offs, mask=mask)
    if FROM_BITS is not None:
        x = x.to(FROM_BITS, bitcast=True)
    y = x.to(DST)
    if TO_BITS is not None:
        y = y.to(TO_BITS, bitcast=True)
    tl.store(out_ptr + offs, y, mask=mask)


@triton.jit
def _rtz_kernel(x_ptr, out_ptr, n, BLOCK: tl.constexpr):
    """out = bits of x.to(tl.bfloat16, fp_downcast_rounding='rtz')."""
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    x = tl.load(x_ptr + offs, mask=mask)
    y = x.to(tl.bfloat16, fp_downcast_rounding="rtz").to(tl.uint16, bitcast=True)
    tl.store(out_ptr + offs, y, mask=mask)


@triton.jit
def _bf16_ops_kernel(a_ptr, b_ptr, c_ptr, out_ptr, cmp_ptr, n, BLOCK: tl.constexpr):
    """bf16 a, b, c (as uint16 bits) -> a+b, a-b, a*b, a/b, fma(a,b,c), max(a,b) as bf16 bits
    and (a < b) as int8."""
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    a = tl.load(a_ptr + offs, mask=mask).to(tl.bfloat16, bitcast=True)
    b = tl.load(b_ptr + offs, mask=mask).to(tl.bfloat16, bitcast=True)
    c = tl.load(c_ptr + offs, mask=mask).to(tl.bfloat16, bitcast=True)
    tl.store(out_ptr + 0 * n + offs, (a + b).to(tl.uint16, bitcast=True), mask=mask)
    tl.store(out_ptr + 1 * n + offs, (a - b).to(tl.uint16, bitcast=True), mask=mask)
    tl.store(out_ptr + 2 * n + offs, (a * b).to(tl.uint16, bitcast=True), mask=mask)
    # bf16 / bf16 divides in fp32 (Triton's promotion); rounded back to bf16 here.
    tl.store(out_ptr + 3 * n + offs, (a / b).to(tl.bfloat16).to(tl.uint16, bitcast=True),
             mask=mask)
    tl.store(out_ptr + 4 * n + offs, tl.fma(a, b, c).to(tl.uint16, bitcast=True), mask=mask)
    # tl.maximum promotes bf16 to fp32 (exact); rounded back (exact too).
    tl.store(out_ptr + 5 * n + offs, tl.maximum(a, b).to(tl.bfloat16).to(tl.uint16, bitcast=True),
             mask=mask)
    tl.store(cmp_ptr + offs, (a < b).to(tl.int8), mask=mask)


@triton.jit
def _dot_kernel(a_ptr, b_ptr, out_ptr, SRC: tl.constexpr, M: tl.constexpr, N: tl.constexpr,
                K: tl.constexpr):
    """out (fp32, M x N) = dot(a, b) with a, b stored as SRC bits (uint8 fp8 / uint16 bf16)."""
    rm, rn, rk = tl.arange(0, M), tl.arange(0, N), tl.arange(0, K)
    a = tl.load(a_ptr + rm[:, None] * K + rk[None, :]).to(SRC, bitcast=True)
    b = tl.load(b_ptr + rk[:, None] * N + rn[None, :]).to(SRC, bitcast=True)
    acc = tl.dot(a, b, out_dtype=tl.float32)
    tl.store(out_ptr + rm[:, None] * N + rn[None, :], acc)


@triton.jit
def _bf16_reduce_kernel(x_ptr, out_ptr, BLOCK: tl.constexpr):
    """bf16 max, min and (sequential, bf16-rounded) sum of one block, and the sum of a
    tl.full bf16 block, as fp32."""
    x = tl.load(x_ptr + tl.arange(0, BLOCK)).to(tl.bfloat16, bitcast=True)
    tl.store(out_ptr + 0, tl.max(x, axis=0).to(tl.float32))
    tl.store(out_ptr + 1, tl.min(x, axis=0).to(tl.float32))
    tl.store(out_ptr + 2, tl.sum(x, axis=0).to(tl.float32))
    tl.store(out_ptr + 3, tl.sum(tl.full([BLOCK], 1.5, tl.bfloat16), axis=0).to(tl.float32))


pytestmark = [
    pytest.mark.interp,
    # NumPy's overflow/invalid warnings from the interpreter's (and the reference's) IEEE
    # arithmetic on Inf/NaN/huge inputs, which the sets contain on purpose.
    pytest.mark.filterwarnings("ignore:.*encountered in:RuntimeWarning"),
    pytest.mark.skipif(not _triton.is_interpreted(_cast_kernel),
                       reason="Triton kernels are compiled for a GPU in this process; "
                              "run TRITON_INTERPRET=1 pytest -m interp"),
]


def _to_torch(a: np.ndarray) -> torch.Tensor:
    if a.dtype == ml_dtypes.bfloat16:
        return torch.from_numpy(a.view(np.uint16).copy()).view(torch.bfloat16)
    return torch.from_numpy(np.ascontiguousarray(a))


def cast(x: np.ndarray, dst, out_np, from_bits=None, to_bits=None) -> np.ndarray:
    """One launch of _cast_kernel over all of x; returns the output as numpy ``out_np``."""
    xt = _to_torch(x)
    out = torch.empty(x.size, dtype=TORCH[np.dtype(out_np).name])
    _cast_kernel[(triton.cdiv(x.size, BLOCK),)](xt, out, x.size, dst, from_bits, to_bits, BLOCK)
    return out.numpy()



@pytest.fixture(scope="module")
def sets() -> dict[str, np.ndarray]:
    return {s: conformance.source_set(s) for s in conformance.SOURCE_DTYPES}


@pytest.mark.parametrize("source", ["float32", "float16"])
def test_to_bf16_rounds_to_nearest_even(sets, source):
    """x.to(tl.bfloat16) (fp32: create_fp_trunc -> cast_impl; fp16 goes through fp32) is the
    RNE, non-saturating bf16 rounding of x on the whole set, Inf/NaN/subnormals included."""
    x = sets[source]
    got = cast(x, tl.bfloat16, np.uint16, to_bits=tl.uint16)
    want = encode(x, "bfloat16", "nonsaturating")
    assert conformance.count_mismatches(got, want, "bfloat16") == 0


@pytest.mark.parametrize("dst", ["float32", "float16"])
def test_from_bf16_is_exact(sets, dst):
    """bf16 -> fp32 (create_fp_ext) is exact and bf16 -> fp16 is the RNE fp16 rounding, on
    every bf16 pattern (signed zeros, subnormals, Inf, NaN)."""
    x = sets["bfloat16"]
    got = cast(x, TL_SRC[dst], getattr(np, dst))
    want = decode(x.view(np.uint16), "bfloat16")
    if dst == "float16":
        want = decode(encode(want, "float16", "nonsaturating"), "float16")
    assert same_float(got, want).all()


def test_rtz_downcast_truncates(sets):
    """x.to(tl.bfloat16, fp_downcast_rounding='rtz') (create_fp_to_fp with RTZ) keeps the top
    16 bits of every non-NaN float32 of the set (bf16 is a prefix of fp32, so that is
    round-toward-zero, overflow and subnormals included)."""
    x = sets["float32"][~np.isnan(sets["float32"])]
    out = torch.empty(x.size, dtype=torch.uint16)
    _rtz_kernel[(triton.cdiv(x.size, BLOCK),)](_to_torch(x), out, x.size, BLOCK)
    assert np.array_equal(out.numpy(), (x.view(np.uint32) >> 16).astype(np.uint16))


def test_float64_and_int_to_bf16_round_once():
    """fp64 -> bf16 is one RNE rounding (no double rounding through fp32), and int -> bf16 /
    bf16 -> int convert values, not bits."""
    x = np.array([1 + 2.0**-8 + 2.0**-30, -(1 + 2.0**-8 + 2.0**-30), 3.0, 1e300, 2.0**-140])
    got = cast(x, tl.bfloat16, np.uint16, to_bits=tl.uint16)
    assert conformance.count_mismatches(got, encode(x, "bfloat16", "nonsaturating"),
                                        "bfloat16") == 0
    ints = np.array([0, 1, -3, 257, 1000, -(2**20) - 1], dtype=np.int32)
    got = cast(ints, tl.bfloat16, np.uint16, to_bits=tl.uint16)
    assert (got == encode(ints.astype(np.float64), "bfloat16", "nonsaturating")).all()
    back = cast(np.array([2.5, -7.75, 300.0], dtype=ml_dtypes.bfloat16), tl.int32, np.int32)
    assert back.tolist() == [2, -7, 300]


@pytest.mark.parametrize("fmt", list(TL_FP8))
@pytest.mark.parametrize("source", conformance.SOURCE_DTYPES)
def test_fp8_cast_is_satfinite_rne(sets, fmt, source):
    """x.to(tl.float8e4nv / tl.float8e5) (create_fp_to_fp) equals
    reference.codec.encode(x, fmt, 'satfinite') -- what the H200 measured -- on every
    bf16/fp16 pattern and the 2M float32 set, NaN codes compared as NaN."""
    x = sets[source]
    got = cast(x, TL_FP8[fmt], np.uint8, to_bits=tl.uint8)
    assert conformance.count_mismatches(got, encode(x, fmt, "satfinite"), fmt) == 0


@pytest.mark.parametrize("fmt", list(TL_FP8))
@pytest.mark.parametrize("dst", ["float32", "bfloat16", "float16"])
def test_fp8_decode_every_code(fmt, dst):
    """<fp8>.to(fp32/bf16/fp16) of all 256 codes equals reference.codec.decode (exact, -0
    kept, NaN as NaN, e5m2's Inf codes as Inf)."""
    codes = np.arange(256, dtype=np.uint8)
    to_bits = tl.uint16 if dst == "bfloat16" else None
    got = cast(codes, TL_SRC[dst], np.uint16 if to_bits else getattr(np, dst),
               from_bits=TL_FP8[fmt], to_bits=to_bits)
    if to_bits is not None:
        got = got.view(ml_dtypes.bfloat16)
    assert same_float(got, decode(codes, fmt)).all()


def test_bf16_arithmetic_rounds_once(sets):
    """bf16 + - * / fma max and < (binary_op, create_fma) equal the exact result rounded
    once to bf16 (RNE, non-saturating; float64 arithmetic rounded to bf16 is that, since
    53 >= 2*8+2), on every bf16 pattern against shuffled partners."""
    a = sets["bfloat16"]
    rng = np.random.default_rng(0)
    b, c = a[rng.permutation(a.size)], a[rng.permutation(a.size)]
    n = a.size
    out = torch.empty(6 * n, dtype=torch.uint16)
    lt = torch.empty(n, dtype=torch.int8)
    _bf16_ops_kernel[(triton.cdiv(n, BLOCK),)](
        *(_to_torch(v.view(np.uint16)) for v in (a, b, c)), out, lt, n, BLOCK)
    got = out.numpy().reshape(6, n)
    fa, fb, fc = (v.astype(np.float64) for v in (a, b, c))
    with np.errstate(all="ignore"):
        exact = [fa + fb, fa - fb, fa * fb, fa / fb, fa * fb + fc, np.maximum(fa, fb)]
    for i, e in enumerate(exact):
        want = encode(e, "bfloat16", "nonsaturating")
        assert conformance.count_mismatches(got[i], want, "bfloat16") == 0, i
    with np.errstate(invalid="ignore"):
        assert (lt.numpy() == (fa < fb)).all()


@pytest.mark.parametrize("fmt", list(TL_FNUZ))
def test_fnuz_triton_types_are_rejected(fmt):
    """The fnuz Triton types fail loudly in the interpreter, as on NVIDIA: a kernel cannot
    pass the CPU tests through a cast that the GPU would refuse (fnuz is software-only)."""
    with pytest.raises(Exception, match="fp8e4b8|fp8e5b16"):
        cast(np.ones(4, np.float32), TL_FNUZ[fmt], np.uint8, to_bits=tl.uint8)


@pytest.mark.parametrize("src", ["e4m3fn", "e5m2", "bfloat16"])
def test_dot_decodes_operands_and_accumulates_in_fp32(src):
    """tl.dot on fp8/bf16 operands (create_dot) equals the float64 product of the correctly
    decoded operands within fp32 accumulation error (K * 2^-23 * sum|a||b|). The operands
    avoid NaN/Inf codes and include subnormals, the max code and codes the old decoder
    got wrong."""
    m_, n_, k_ = 16, 16, 32
    rng = np.random.default_rng(1)
    bits = 8 if src != "bfloat16" else 16
    values = decode(np.arange(1 << bits), src)
    ok = np.flatnonzero(np.isfinite(values) & (np.abs(values) < 2.0**40))
    a = rng.choice(ok, (m_, k_)).astype(np.uint8 if bits == 8 else np.uint16)
    b = rng.choice(ok, (k_, n_)).astype(a.dtype)
    out = torch.empty(m_ * n_, dtype=torch.float32)
    tl_src = tl.bfloat16 if src == "bfloat16" else TL_FP8[src]
    _dot_kernel[(1,)](_to_torch(a.ravel()), _to_torch(b.ravel()), out, tl_src, m_, n_, k_)
    da, db = decode(a, src), decode(b, src)
    want = da @ db
    bound = k_ * 2.0**-23 * (np.abs(da) @ np.abs(db))
    assert (np.abs(out.numpy().reshape(m_, n_) - want) <= bound).all()


def test_bf16_reductions():
    """tl.sum over bf16 (ReduceOps' np.sum fast path bypassed) adds values, not uint16 bits
    (here every partial sum is exact in bf16); tl.max/tl.min (promoted to fp32 by
    triton.language) stay exact; tl.full with a bf16 dtype works (get_bf16)."""
    x = np.array([-3.0, 1.5, -0.25, 2.0, -7.0, 0.5, 4.0, -1.0], dtype=ml_dtypes.bfloat16)
    out = torch.empty(4, dtype=torch.float32)
    _bf16_reduce_kernel[(1,)](_to_torch(x.view(np.uint16)), out, x.size)
    assert out.tolist() == [4.0, -7.0, float(x.astype(np.float64).sum()), 12.0]


def test_unpatched_interpreter_is_wrong():
    """The patch matters: with the original entry points restored, 1.97 -> e4m3fn gives
    0x38 (1.0: the carry bug), 1+2^-8+2^-9 -> bf16 truncates, and bf16 1 + 1 is not 2;
    after re-patching all three are right. (Restored in a finally: no state leaks.)"""
    x = np.array([1.97], dtype=np.float32)
    y = np.array([1 + 2.0**-8 + 2.0**-9], dtype=np.float32)
    one = np.array([1.0, 1.0], dtype=ml_dtypes.bfloat16)
    out = torch.empty(6, dtype=torch.uint16)
    lt = torch.empty(2, dtype=torch.int8)

    def run():
        fp8 = cast(x, tl.float8e4nv, np.uint8, to_bits=tl.uint8)[0]
        bf16 = cast(y, tl.bfloat16, np.uint16, to_bits=tl.uint16)[0]
        t = _to_torch(one.view(np.uint16))
        _bf16_ops_kernel[(1,)](t, t, t, out, lt, 1, 2)
        return int(fp8), int(bf16), float(np.uint16(out[0].item()).view(ml_dtypes.bfloat16))

    assert interp.is_patched()
    interp.unpatch_interpreter()
    try:
        assert not interp.is_patched()
        fp8, bf16, two = run()
    finally:
        interp.patch_interpreter()
    assert interp.is_patched()
    assert fp8 == 0x38 and encode(x, "e4m3fn")[0] == 0x40
    assert bf16 == 0x3F80 and encode(y, "bfloat16")[0] == 0x3F81
    assert two != 2.0
    assert run() == (0x40, 0x3F81, 2.0)


@triton.jit
def _twice(x):
    return x * 2


@triton.jit
def _helper_loop_kernel(out_ptr, STEPS: tl.constexpr):
    """out[pid] = 2^STEPS + pid, through STEPS calls of a @triton.jit helper."""
    y = tl.program_id(0) * 0 + 1
    for _ in tl.static_range(STEPS):
        y = _twice(y)
    tl.store(out_ptr + tl.program_id(0), y + tl.program_id(0))


def test_helper_calls_inside_a_launch_do_not_repatch_the_language(monkeypatch):
    """A launch patches Triton's language modules once; its programs' helper calls (here
    3 programs x 5 calls) reuse that patch instead of re-patching per call (3.6's
    _patch_lang, a third of an interpreted decode's time), and compute the same values."""
    from triton.runtime import interpreter as ti

    calls = []
    patch = ti._patch_lang
    monkeypatch.setattr(ti, "_patch_lang", lambda fn: calls.append(fn) or patch(fn))
    out = torch.zeros(3, dtype=torch.int32)
    _helper_loop_kernel[(3,)](out, STEPS=5)
    assert out.tolist() == [32, 33, 34]
    assert len(calls) == 1


def test_storage_dtypes_are_the_originals():
    """The interpreter's storage dtype of every scalar type, of blocks of them and of
    pointers (the table-backed replacement of _get_np_dtype) is what 3.6's function
    gives, asked twice (the second from the table)."""
    from triton.runtime import interpreter as ti

    original = interp.ORIGINALS["module", "_get_np_dtype"]
    scalars = [tl.int1, tl.int8, tl.uint8, tl.int16, tl.uint16, tl.int32, tl.uint32,
               tl.int64, tl.uint64, tl.float16, tl.bfloat16, tl.float32, tl.float64,
               tl.float8e5, tl.float8e5b16, tl.float8e4nv, tl.float8e4b8, tl.float8e4b15]
    types = [*scalars, *(tl.block_type(t, [4, 2]) for t in scalars),
             tl.pointer_type(tl.float32), tl.block_type(tl.pointer_type(tl.bfloat16), [8])]
    assert ti._get_np_dtype is interp._np_dtype
    for _ in range(2):
        assert [ti._get_np_dtype(t) for t in types] == [original(t) for t in types]


def test_patch_is_idempotent_and_pinned(monkeypatch):
    """patch_interpreter() twice keeps the saved originals the originals, and it refuses a
    Triton version other than the pinned 3.6.0 with a clear error."""
    from triton.runtime import interpreter as ti

    saved = dict(interp.ORIGINALS)
    interp.patch_interpreter()
    interp.patch_interpreter()
    assert interp.ORIGINALS == saved
    assert ti.InterpreterBuilder.cast_impl is interp._cast_impl
    assert all(getattr(f, "__module__", "") != interp.__name__
               for f in interp.ORIGINALS.values() if f is not None)
    monkeypatch.setattr(triton, "__version__", "3.9.0")
    with pytest.raises(RuntimeError, match="3.6.0.*3.9.0"):
        interp.patch_interpreter()


def test_planner_answers_do_not_depend_on_the_first_case_a_process_met(monkeypatch):
    """The launch planners' cache (kernels._triton._spec_key) holds what Triton specialises
    on: two launches whose integer arguments differ in divisibility by 16 get each its own
    compiled kernel's answer, in either order; a worker's history never picks the
    constexprs of a later case (which would compile variants the disk cache lacks).
    Integers Triton compiles alike (48 and 64) share a key; 1, and 32-bit against 64-bit
    values, do not."""
    from types import SimpleNamespace

    from kernels import _triton as kt

    class Fake:  # an integer divisible by 16 compiles to a kernel with less shared memory
        def warmup(self, n, grid, num_stages, **kw):
            shared = 100000 * num_stages if n % 16 == 0 else 150000 * num_stages
            return SimpleNamespace(metadata=SimpleNamespace(shared=shared))

    monkeypatch.setattr(kt, "_max_shared_mem", lambda device: 232448)
    dev, kernel = SimpleNamespace(index=0), Fake()
    answers = []
    for order in ((32, 33), (33, 32)):
        monkeypatch.setattr(kt, "_STAGES", {})
        answers.append({n: kt.fitting_stages(kernel, (n,), {"D": 128}, dev) for n in order})
    assert answers[0] == answers[1] == {32: 2, 33: 1}
    # Integers alike to Triton's specialisation share an answer: the caches stay small.
    assert kt._spec_key(kernel, (48,), {}) == kt._spec_key(kernel, (64,), {})
    assert kt._spec_key(kernel, (1,), {}) != kt._spec_key(kernel, (2,), {})
    assert kt._spec_key(kernel, (2**31,), {}) != kt._spec_key(kernel, (2**31 - 16,), {})


def test_fitting_stages_picks_the_deepest_pipeline_that_fits(monkeypatch):
    """kernels._triton.fitting_stages compiles from ``deepest`` down and keeps the first
    depth whose shared memory fits the device (the decode kernel's 4 rows x 16 heads at
    P = D = 128 need 256 KiB at 3 stages, 192 KiB at 2: 2 on a 227 KiB H200), never below
    1, and asks the compiler once per key."""
    from types import SimpleNamespace

    from kernels import _triton as kt

    smem = {3: 262144, 2: 196608, 1: 131072}
    calls = []

    class Fake:
        def warmup(self, *args, grid, num_stages, **kw):
            calls.append(num_stages)
            return SimpleNamespace(metadata=SimpleNamespace(shared=smem[num_stages]))

    monkeypatch.setattr(kt, "_max_shared_mem", lambda device: 232448)
    monkeypatch.setattr(kt, "_STAGES", {})
    dev = SimpleNamespace(index=0)
    fake = Fake()
    assert kt.fitting_stages(fake, (1,), {"D": 128}, dev) == 2
    assert kt.fitting_stages(fake, (1,), {"D": 128}, dev) == 2
    assert calls == [3, 2]  # cached: the second call compiles nothing
    monkeypatch.setattr(kt, "_max_shared_mem", lambda device: 100000)
    assert kt.fitting_stages(fake, (1,), {"D": 64}, dev) == 1  # nothing fits: 1 stage
    assert kt.fitting_stages(fake, (1,), {"D": 256}, dev, deepest=2) == 1


_TYPE_FIELDS = textwrap.dedent("""
    import triton.language as tl

    def type_fields():
        named = tl.tuple([tl.constexpr(3), tl.constexpr(5)],
                         tl.tuple_type([tl.constexpr_type(3), tl.constexpr_type(5)], ["x", "y"]))
        grown = tl.tuple([tl.constexpr(1), tl.constexpr(2)])
        grown._setitem(1, tl.constexpr(7))
        blocks = [tl.block_type(tl.float32, [4, 2]), tl.block_type(tl.bfloat16, [16]),
                  tl.block_type(tl.pointer_type(tl.float16), [8, 1, 2])]
        return ([(b.name, str(b), str(b.shape), b.numel, b == b.with_element_ty(tl.float32))
                 for b in blocks]
                + [(str(t.type), t.type.name, t.type.fields, str(t)) for t in (named, grown)]
                + [named.y.value, str(tl.tuple_type([tl.int32, tl.float16]))])
""")


def test_type_objects_read_the_fields_unpatched_triton_builds(tmp_path):
    """The type fields the patch builds on first read (``tuple_type.name``,
    ``block_type.name``, ``tuple.type``) equal what Triton 3.6 builds at construction: the
    same objects described here and in a process that never patched the interpreter."""
    here: dict = {}
    exec(_TYPE_FIELDS, here)
    assert interp.is_patched()
    script = _TYPE_FIELDS + "\nimport kernels.interpreter as i\nassert not i.is_patched()\n" \
                            "print(repr(type_fields()))"
    r = subprocess.run([sys.executable, "-c", script], env=compile_env(tmp_path),
                       capture_output=True, text=True, cwd=Path(__file__).resolve().parents[1])
    assert r.returncode == 0, r.stderr[-2000:]
    assert repr(here["type_fields"]()) == r.stdout.strip()


def test_a_tuple_built_before_the_patch_keeps_its_type():
    """A ``tl.tuple`` whose type 3.6 built eagerly (an object made before the patch, its
    type in the instance's ``type``) reads that type, not a rebuilt one."""
    eager = tl.tuple_type([tl.constexpr_type(3)], ["x"])
    t = object.__new__(tl.tuple)
    t.__dict__.update(values=[tl.constexpr(3)], type=eager)
    assert t.type is eager and t.x.value == 3
