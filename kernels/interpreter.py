"""A small, explicit patch that makes Triton 3.6's CPU interpreter numerically faithful.

Under ``TRITON_INTERPRET=1`` Triton runs kernels in NumPy (``triton/runtime/interpreter.py``).
It stores bf16 as uint16 and fp8 as uint8 and converts through a hand-written bit routine
(``_convert_float``). Measured wrong in Triton 3.6.0 (see tests/test_interpreter_patch.py):

- fp32 -> bf16 truncates instead of rounding to nearest even; fp64/int -> bf16 store the
  value converted to an integer as the bf16 bits (``astype(uint16)``), bf16 -> int convert
  the bits, not the value;
- bf16 + - *, comparisons, fma and ``tl.sum`` operate on the raw uint16 bits (1.0 + 1.0 is
  not 2.0; -1 < 1 is False). (/, %, min/max, clamp, cumsum and the max/min reductions
  promote bf16 to fp32 in triton.language first, so they only needed the casts fixed);
- every fp8 cast: ties round away from zero, a mantissa carry is OR-ed into the exponent
  (1.97 -> 1.0 in e4m3fn), subnormals are wrong, overflow/Inf/NaN give garbage, and the
  special codes decode wrongly;
- ``tl.dot`` on bf16 operands multiplies the uint16 bits; on fp8 operands it decodes them
  with the broken routine (into fp16).

``patch_interpreter()`` replaces these entry points on the interpreter's classes (all
instances, including the module-level ``interpreter_builder``, see them through the class):

``InterpreterBuilder.cast_impl``
    Reached from the aliases ``create_fp_ext``, ``create_fp_trunc``, ``create_si_to_fp``,
    ``create_ui_to_fp``, ``create_fp_to_si``, ``create_fp_to_ui`` and ``create_int_cast``.
    In 3.6 these are ``lambda self, ...: self.cast_impl(...)``: they look ``cast_impl`` up on
    the instance at call time (unlike Triton 3.9, where they captured it), so replacing
    ``cast_impl`` alone fixes them all. New behaviour: any cast with bf16 on either side goes
    through ml_dtypes (exact upcast, RNE downcast with correct subnormals/Inf/NaN, a single
    rounding also from fp64 and integers below 2^53); all other casts are the original's.
``InterpreterBuilder.create_fp_to_fp``
    Every cast with an fp8 type on either side (encode and decode), and standard float
    downcasts with a non-default rounding mode (``rtz``). Encode = exact widening to fp32
    (fp64 via round-to-odd, so the final rounding is the only one), clip to +-max finite
    (satfinite), ml_dtypes RNE cast, NaN -> the canonical NaN code 0x7F. Satfinite is what
    ``.to(tl.float8e4nv)`` and ``.to(tl.float8e5)`` do on sm_90
    (reports/probe-h200.json, 0 mismatches on every conformance set). ``float8e4b15`` (no
    ml_dtypes twin) keeps the original routine. The fnuz Triton types (``float8e4b8``,
    ``float8e5b16``) need nothing: 3.6's interpreter rejects them ("fail to convert fp8e4b8
    to ir type"), as NVIDIA's compiler does, so fnuz is software-only everywhere.
``InterpreterBuilder.binary_op``, ``create_fma``
    With bf16 operands: decode to fp32 (exact), operate in fp32, round the result to bf16
    (RNE). For + - * this single fp32 step followed by the bf16 rounding equals the
    correctly rounded bf16 result (24 >= 2*8+2 bits: double rounding is innocuous); fma is
    evaluated in fp64 (the product is exact there) and rounded once. Comparisons return the
    boolean handles typed int1. Other dtypes: the original.
``InterpreterBuilder.get_bf16``
    Missing in 3.6, so ``tl.full(shape, v, tl.bfloat16)`` with v != 0 failed; added (RNE).
``InterpreterBuilder.create_dot``
    With float operands: both decoded exactly to fp32, multiplied and summed over K in
    index order in fp32 (``fixed_order_matmul``: the same bits on every CPU and thread
    count, unlike ``np.matmul``'s BLAS), plus the accumulator, stored in the accumulator's
    dtype; integer and fp64 operands: the original. Not emulated (as before): the tf32
    rounding of fp32 operands and the reduced-precision accumulation of fp8 MMAs on sm_90
    (``max_num_imprecise_acc``): kernels whose results depend on them must say so, and
    the GPU tests judge those.
``GridExecutor.__call__``
    The launch runs under ``np.errstate(all="ignore")``: the interpreter computes masked-off
    lanes too (an integer division by a zero that the mask discards) and IEEE Inf/NaN
    results, which the GPU never reports; NumPy's RuntimeWarnings there are noise to a user.
``_get_np_dtype`` (a function of the interpreter module)
    The storage dtype of a Triton type: 3.6 builds a dict of seventeen NumPy dtypes on every
    call (hundreds of thousands per launch); the replacement looks the scalar type up in a
    table filled from the original.
``InterpretedFunction.__call__``
    A ``@triton.jit`` helper called from a kernel: 3.6 re-patches the language modules on
    every such call (``_patch_lang``: ``inspect.getmembers`` of four modules), a third of an
    interpreted decode launch's time; the replacement skips it when the launch has patched
    them already, and otherwise is the original.
``tuple_type.name``, ``block_type.name``, ``tuple.type`` (``triton.language.core``)
    Built on first read instead of at construction (every interpreted op builds type
    objects and 3.6 formats their names eagerly: a quarter of an interpreted decode
    launch); the same values. ``unpatch_interpreter`` leaves them.
``ReduceOps.apply_impl``
    bf16 inputs (in practice ``tl.sum``: max/min promote to fp32) take the interpreter's own
    generic combine-function path, whose adds go through the patched ``binary_op``, instead
    of ``np.sum`` on the uint16 bits. Each step rounds to bf16, as a bf16 combine does on
    the GPU (in sequential order; the GPU's tree order differs, so a bf16 sum is
    order-dependent and kernels that need reproducible sums accumulate in fp32).

The patch touches private internals, hence ``patch_interpreter`` refuses any Triton but
3.6.0, and tests/test_interpreter_patch.py checks it against reference.codec.

How kernels get interpreted: ``triton.jit`` reads ``TRITON_INTERPRET`` when a kernel is
*decorated* (module import), not when it runs. The entry points (conftest.py, the ``oracle``
CLI) call ``kernels.use_interpreter_without_gpu()``, which sets ``TRITON_INTERPRET=1``
(unless already set) when torch sees no CUDA device, before any kernel module is imported;
kernel modules import Triton through ``kernels._triton``, which
calls ``patch_interpreter()`` when interpretation is on. On a CUDA machine run the
interpreter tests separately: ``TRITON_INTERPRET=1 pytest -m interp``.
"""

from __future__ import annotations

import functools

import ml_dtypes
import numpy as np

from reference.formats import FORMATS

TRITON_VERSION = "3.6.0"

# Saved originals, keyed by (class name, attribute): the patch is idempotent and testable.
ORIGINALS: dict[tuple[str, str], object] = {}
_MARK = "_sparse_attn_numerics_patch"


def _types():
    """Triton type -> (ml_dtypes type, satfinite max, canonical NaN code) for the fp8 types
    the interpreter accepts and ml_dtypes mirrors."""
    import triton.language as tl

    e4m3fn, e5m2 = FORMATS["e4m3fn"], FORMATS["e5m2"]
    return {
        tl.float8e4nv: (ml_dtypes.float8_e4m3fn, e4m3fn.max_finite, e4m3fn.nan_code),
        tl.float8e5: (ml_dtypes.float8_e5m2, e5m2.max_finite, e5m2.nan_code),
    }


def _to_float(data: np.ndarray, dtype) -> np.ndarray:
    """Exact float values (float32, or float64 for fp64 and integer sources) of stored data."""
    import triton.language as tl

    fp8 = _types()
    with np.errstate(invalid="ignore"):  # signalling NaNs convert to quiet NaNs, as meant
        if dtype in fp8:
            return data.view(np.uint8).view(fp8[dtype][0]).astype(np.float32)
        if dtype == tl.bfloat16:
            return data.view(np.uint16).view(ml_dtypes.bfloat16).astype(np.float32)
    if data.dtype.kind in "iub":
        return data.astype(np.float64)  # exact below 2^53
    return data


def _round_to_odd_f32(x: np.ndarray) -> np.ndarray:
    """float64 -> float32 rounded to odd: a later RNE rounding to <= 22 significant bits is
    then the correct single rounding of x (ml_dtypes rounds float64 through float32 RNE,
    which double-rounds)."""
    if x.dtype != np.float64:
        return x.astype(np.float32)
    with np.errstate(over="ignore", invalid="ignore"):
        y = x.astype(np.float32)
        finite = np.isfinite(x)
        away = finite & (np.abs(y.astype(np.float64)) > np.abs(x))
        y = np.where(away, np.nextafter(y, np.float32(0)), y)
        inexact = finite & (y.astype(np.float64) != x)
        return (y.view(np.uint32) | inexact.astype(np.uint32)).view(np.float32)


def _from_float(x: np.ndarray, dtype, rtz: bool = False) -> np.ndarray:
    """Store float values x in Triton dtype ``dtype`` (storage: uint16 bf16, uint8 fp8)."""
    import triton.language as tl
    from triton.runtime.interpreter import _get_np_dtype

    fp8 = _types()
    with np.errstate(over="ignore", invalid="ignore"):
        if dtype in fp8:
            ml, max_finite, nan_code = fp8[dtype]
            x32 = np.clip(_round_to_odd_f32(x), -max_finite, max_finite)
            out = x32.astype(ml).view(np.uint8)
            out = np.where(np.isnan(x32), np.uint8(nan_code), out)
        elif dtype == tl.bfloat16:
            out = _round_to_odd_f32(x).astype(ml_dtypes.bfloat16).view(np.uint16)
        else:
            out = x.astype(_get_np_dtype(dtype))
        if rtz:
            out = _toward_zero(x, out, dtype)
    return out


def _toward_zero(x: np.ndarray, codes: np.ndarray, dtype) -> np.ndarray:
    """Turn round-to-nearest codes into round-toward-zero ones: step the magnitude down by
    one where the rounded value lies farther from zero than x (codes are sign-magnitude)."""
    got = _to_float(codes, dtype).astype(np.float64)
    past = np.isfinite(x) & (np.abs(got) > np.abs(x.astype(np.float64)))
    u = codes.view(f"u{codes.itemsize}")
    return (u - past.astype(u.dtype)).view(codes.dtype)


def _is_bf16(*handles) -> bool:
    import triton.language as tl

    return any(h.dtype.scalar == tl.bfloat16 for h in handles)


def _bf16_handle(values: np.ndarray):
    import triton.language as tl
    from triton.runtime.interpreter import TensorHandle

    return TensorHandle(_from_float(values, tl.bfloat16), tl.bfloat16)


# ---- the replacements (signatures as in Triton 3.6's InterpreterBuilder) -------------------


def _cast_impl(self, src, dst_type):
    import triton.language as tl
    from triton.runtime.interpreter import TensorHandle, _get_np_dtype

    s, d = src.dtype.scalar, dst_type.scalar
    if tl.bfloat16 not in (s, d):
        return ORIGINALS["InterpreterBuilder", "cast_impl"](self, src, dst_type)
    x = _to_float(src.data, s)
    if d.is_floating():
        return TensorHandle(_from_float(x, d), d)
    with np.errstate(invalid="ignore"):  # bf16 -> int truncates toward zero, as fptosi does
        return TensorHandle(x.astype(_get_np_dtype(d)), d)


def _create_fp_to_fp(self, src, dst_type, rounding_mode):
    import triton.language as tl
    from triton._C.libtriton import ir
    from triton.runtime.interpreter import TensorHandle

    s, d = src.dtype.scalar, dst_type.scalar
    if tl.float8e4b15 in (s, d):
        original = ORIGINALS["InterpreterBuilder", "create_fp_to_fp"]
        return original(self, src, dst_type, rounding_mode)
    rtz = rounding_mode == ir.ROUNDING_MODE.RTZ
    return TensorHandle(_from_float(_to_float(src.data, s), d, rtz=rtz), d)


def _binary_op(self, lhs, rhs, op):
    import triton.language as tl
    from triton.runtime.interpreter import TensorHandle

    if not _is_bf16(lhs, rhs):
        return ORIGINALS["InterpreterBuilder", "binary_op"](self, lhs, rhs, op)
    with np.errstate(all="ignore"):  # IEEE results (Inf, NaN), as on the GPU: no warnings
        out = op(_to_float(lhs.data, lhs.dtype.scalar), _to_float(rhs.data, rhs.dtype.scalar))
    if out.dtype == np.bool_:  # comparisons: typed int1 (the original kept bf16, which
        return TensorHandle(out, tl.int1)  # would make a later cast misread the bools)
    return _bf16_handle(out)


def _create_fma(self, x, y, z):
    if not _is_bf16(x, y, z):
        return ORIGINALS["InterpreterBuilder", "create_fma"](self, x, y, z)
    a, b, c = (_to_float(h.data, h.dtype.scalar).astype(np.float64) for h in (x, y, z))
    with np.errstate(all="ignore"):
        return _bf16_handle(a * b + c)  # exact product, one rounding of the sum (round-to-odd)


def _get_bf16(self, value):
    return _bf16_handle(np.array([value], dtype=np.float64))


def _create_dot(self, a, b, d, input_precision, max_num_imprecise_acc):
    from triton.runtime.interpreter import TensorHandle

    kinds = (a.dtype.scalar, b.dtype.scalar)
    if not any(t.is_floating() for t in kinds) or any(t.is_fp64() for t in kinds):
        return ORIGINALS["InterpreterBuilder", "create_dot"](
            self, a, b, d, input_precision, max_num_imprecise_acc)
    a32 = _to_float(a.data, a.dtype.scalar).astype(np.float32)
    b32 = _to_float(b.data, b.dtype.scalar).astype(np.float32)
    acc = _to_float(d.data, d.dtype.scalar).astype(np.float32)
    with np.errstate(all="ignore"):
        out = fixed_order_matmul(a32, b32) + acc
    return TensorHandle(_from_float(out, d.dtype.scalar), d.dtype.scalar)


def fixed_order_matmul(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """``a @ b`` in fp32 (batched over leading axes) summed over K in index order. BLAS
    picks its summation order by CPU, build and thread count, so its fp32 bits vary by
    machine; this order does not (the products of bf16/fp8 operands are exact in fp32)."""
    # One rank-1 update per k into a reused buffer: the [..., M, K, N] products at once
    # would be 512 MB for a 1024 x 128 x 1024 dot, and 20x slower.
    out = a[..., :, 0, None] * b[..., None, 0, :]
    term = np.empty_like(out)
    for k in range(1, a.shape[-1]):
        np.multiply(a[..., :, k, None], b[..., None, k, :], out=term)
        out += term
    return out


def _reduce_apply_impl(self, input):
    if any(_is_bf16(t.handle) for t in input):
        return self.generic_reduce(input)
    return ORIGINALS["ReduceOps", "apply_impl"](self, input)


def _grid_call(self, *args, **kwargs):
    with np.errstate(all="ignore"):
        return ORIGINALS["GridExecutor", "__call__"](self, *args, **kwargs)


def _device_call(self, *args, **kwargs):
    from triton.runtime import interpreter

    if not _language_patched(self.fn):
        interpreter._patch_lang(self.fn)
    fn = self.rewrite()
    try:
        return fn(*args, **kwargs)
    except Exception as e:
        raise interpreter.InterpreterError(repr(e)) from e


def _language_patched(fn) -> bool:
    """Whether every Triton language module ``fn`` sees is already patched for the
    interpreter (inside a launch: ``tl.load`` is no longer the compiler's builtin)."""
    import triton.language as tl

    return all(not tl.core.is_builtin(v.load) for v in fn.__globals__.values()
               if v is tl or v is tl.core)


def _np_dtype(tt_dtype):
    import triton.language as tl

    scalar = tt_dtype.element_ty if isinstance(tt_dtype, tl.block_type) else tt_dtype
    if isinstance(scalar, tl.pointer_type):
        return _U64
    return _scalar_np_dtype(scalar)


_U64 = np.dtype(np.uint64)


@functools.cache
def _scalar_np_dtype(scalar):
    """The storage dtype of a scalar Triton type (hashed by name), as 3.6 gives it."""
    return ORIGINALS["module", "_get_np_dtype"](scalar)


_REPLACEMENTS = {
    ("module", "_get_np_dtype"): _np_dtype,
    ("GridExecutor", "__call__"): _grid_call,
    ("InterpretedFunction", "__call__"): _device_call,
    ("InterpreterBuilder", "cast_impl"): _cast_impl,
    ("InterpreterBuilder", "create_fp_to_fp"): _create_fp_to_fp,
    ("InterpreterBuilder", "binary_op"): _binary_op,
    ("InterpreterBuilder", "create_fma"): _create_fma,
    ("InterpreterBuilder", "get_bf16"): _get_bf16,
    ("InterpreterBuilder", "create_dot"): _create_dot,
    ("ReduceOps", "apply_impl"): _reduce_apply_impl,
}


def _build_type_fields_lazily() -> None:
    """Every interpreted op builds Triton type objects, and 3.6 formats each one's name (and
    each shape tuple's type) at construction, which nothing on the interpreter's path reads:
    a quarter of an interpreted decode launch. ``tuple_type.name``, ``block_type.name`` and
    ``tuple.type`` become the same values built on first read. No value changes, and objects
    made meanwhile need them, so ``unpatch_interpreter`` leaves them (idempotent)."""
    from triton.language import core

    if getattr(core.tuple_type, _MARK, False):
        return

    def tuple_type_init(self, types, fields=None):
        self.types = types
        self.fields = fields or [""] * len(types)

    def tuple_type_name(self):
        return "[" + ",".join([f"{k}:{v}" for k, v in zip(self.fields, self.types)]) + "]"

    def tuple_init(self, args, type=None):
        self.values = [i for i in args]
        if type is not None and not isinstance(type, core.tuple_type):
            type = core.tuple_type(type)  # a list or tuple of types, as 3.6 accepts
        self._type = type

    def tuple_type_get(self):
        d = self.__dict__
        t = d.get("_type")
        if t is None:  # not built yet, or built eagerly before the patch (as "type")
            t = d.get("type") or core._type_for_tuple_values(self.values)
            d["_type"] = t
        return t

    def tuple_type_set(self, t):
        self._type = t

    def block_type_init(self, element_ty, shape):
        self.element_ty = element_ty
        assert isinstance(shape, (list, core.tuple))
        self.shape = core.tuple(core._unwrap_shape(shape))
        if not self.shape:
            raise TypeError("0d block_type is forbidden")
        self.numel = core.validate_block_shape(self.shape)

    def block_type_name(self):
        return f"<{self.shape}, {self.element_ty}>"

    core.tuple_type.__init__ = tuple_type_init
    core.tuple_type.name = property(tuple_type_name)
    core.tuple.__init__ = tuple_init
    core.tuple.type = property(tuple_type_get, tuple_type_set)
    core.block_type.__init__ = block_type_init
    core.block_type.name = property(block_type_name)
    setattr(core.tuple_type, _MARK, True)


def _owner(interpreter, name: str):
    """Where a replacement goes: a class of the interpreter module, or ("module") the
    module itself (its functions look each other up there at call time)."""
    return interpreter if name == "module" else getattr(interpreter, name)


def is_patched() -> bool:
    from triton.runtime import interpreter

    return bool(getattr(interpreter.InterpreterBuilder, _MARK, False))


def patch_interpreter() -> None:
    """Install the replacements above into Triton's CPU interpreter (idempotent).

    Raises RuntimeError for any Triton other than 3.6.0: the patch replaces private
    internals whose names and signatures are only known for that version."""
    import triton

    if triton.__version__ != TRITON_VERSION:
        raise RuntimeError(
            f"kernels.interpreter patches Triton {TRITON_VERSION}'s CPU interpreter, but Triton "
            f"{triton.__version__} is installed: re-check triton/runtime/interpreter.py against "
            "the entry points documented in kernels/interpreter.py and update the pin")
    from triton.runtime import interpreter

    if is_patched():
        return
    for (owner, attr), fn in _REPLACEMENTS.items():
        target = _owner(interpreter, owner)
        ORIGINALS[owner, attr] = target.__dict__.get(attr)
        setattr(target, attr, fn)
    _build_type_fields_lazily()
    setattr(interpreter.InterpreterBuilder, _MARK, True)


def unpatch_interpreter() -> None:
    """Restore the original entry points (for tests that show the patch matters)."""
    from triton.runtime import interpreter

    if not is_patched():
        return
    for owner, attr in _REPLACEMENTS:
        target = _owner(interpreter, owner)
        original = ORIGINALS[owner, attr]
        if original is None:
            delattr(target, attr)
        else:
            setattr(target, attr, original)
    setattr(interpreter.InterpreterBuilder, _MARK, False)
