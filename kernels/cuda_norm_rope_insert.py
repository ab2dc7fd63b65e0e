"""The CUDA fused Gemma RMSNorm + partial NeoX RoPE + paged KV / index-cache insert
(csrc/norm_rope_insert.cu), bound with ctypes: no torch headers, no extension build.

``norm_rope_insert(...)`` has the signature and contract of the Triton launcher
``kernels.norm_rope_insert.norm_rope_insert`` (plus its own launch knobs ``variant``,
``warps_per_block``, ``heads_per_warp``, ``heads_fast``, and ``num_stages`` like Triton's:
kernels computing the same function, for tuning sweeps; ``DEFAULT_VARIANT`` by default);
its host checks are the shared
``kernels._host.plan_norm_rope_insert`` (ValueError naming the argument), then the launch
knobs (``launch_shape``), then the tensors must be on a CUDA device. The kernel runs on
``torch.cuda.current_stream()``; a nonzero cudaError_t from the launch raises RuntimeError
with cudaGetErrorString's text.

The library is built by ``kernels.cuda_build.build()`` on first use (nvcc -O3 -arch=sm_90,
cached by a hash of the sources) and loaded once per process. oracle/impls/cuda.py
registers it (through the Triton kernel's adapter, the launchers sharing a signature) as
implementation ``"cuda"`` of op ``"norm_rope_insert"`` when a CUDA device and nvcc are
present.

The kernel variants (``variant=``; ``VARIANTS`` lists them, ``DEFAULT_VARIANT`` the
default) are described in docs/kernels/norm_rope_insert_cuda.md.

Numerics (declared to the oracle with the default ``Fp32Arith``; every variant): fp32 sums
of squares in warp-shuffle order, ``rsqrtf`` (2 ulp), the division by a K/V scale as two
multiplications by its reciprocal parts (``cvt::scale_reciprocal``: within one ulp), FMA
contraction; variants 1-4 give identical bits (variant 0 sums the squares in another order,
variant 5 every head's at R = D / 2); outputs rounded once (RNE); K quantised from its fp32
value (``quantize_from="value"``), fp8 satfinite via cvt.rn.satfinite (e4m3fn, e5m2) or the
software codec (fnuz), csrc/fp8_convert.h.
"""

from __future__ import annotations

import ctypes
import threading

import numpy as np
import torch

from kernels import cuda_build
from kernels._host import fail, plan_norm_rope_insert
from reference.formats import FORMATS

#: cvt::Format codes of csrc/fp8_convert.h: the table's kernel codes.
FORMAT_CODES = {name: f.kernel_code for name, f in FORMATS.items()}

_C_TYPES = {"void*": ctypes.c_void_p, "const void*": ctypes.c_void_p,
            "const float*": ctypes.c_void_p, "int64_t": ctypes.c_int64,
            "double": ctypes.c_double}


class NriParams(ctypes.Structure):
    """Mirror of csrc/norm_rope_insert.h NriParams (checked against the library at load)."""

    _fields_ = [
        ("rows", ctypes.c_void_p), ("row_stride", ctypes.c_int64),
        ("positions", ctypes.c_void_p), ("pos_stride", ctypes.c_int64),
        ("pos_is64", ctypes.c_int64),
        ("table", ctypes.c_void_p), ("table_stride", ctypes.c_int64),
        ("max_pos", ctypes.c_int64),
        ("w_q", ctypes.c_void_p), ("w_k", ctypes.c_void_p), ("w_iq", ctypes.c_void_p),
        ("w_ik", ctypes.c_void_p),
        ("q_out", ctypes.c_void_p), ("q_s0", ctypes.c_int64), ("q_s1", ctypes.c_int64),
        ("iq_out", ctypes.c_void_p), ("iq_s0", ctypes.c_int64), ("iq_s1", ctypes.c_int64),
        ("iq_fmt", ctypes.c_int64),
        ("kv", ctypes.c_void_p), ("kv_s0", ctypes.c_int64), ("kv_s1", ctypes.c_int64),
        ("kv_s2", ctypes.c_int64), ("page_size", ctypes.c_int64),
        ("num_slots", ctypes.c_int64), ("kv_fmt", ctypes.c_int64),
        ("slots", ctypes.c_void_p), ("slot_stride", ctypes.c_int64),
        ("slots_is64", ctypes.c_int64),
        ("k_scale", ctypes.c_void_p), ("ks_s0", ctypes.c_int64), ("ks_s1", ctypes.c_int64),
        ("v_scale", ctypes.c_void_p), ("vs_s0", ctypes.c_int64), ("vs_s1", ctypes.c_int64),
        ("ic", ctypes.c_void_p), ("ic_s0", ctypes.c_int64), ("ic_s1", ctypes.c_int64),
        ("ic_page", ctypes.c_int64), ("ic_num_slots", ctypes.c_int64),
        ("ic_fmt", ctypes.c_int64),
        ("islots", ctypes.c_void_p), ("islot_stride", ctypes.c_int64),
        ("islots_is64", ctypes.c_int64),
        ("n", ctypes.c_int64), ("hq", ctypes.c_int64), ("hkv", ctypes.c_int64),
        ("hi", ctypes.c_int64), ("write_ik", ctypes.c_int64), ("ik_col", ctypes.c_int64),
        ("head_dim", ctypes.c_int64), ("rotary_dim", ctypes.c_int64),
        ("act_fmt", ctypes.c_int64), ("heads_per_block", ctypes.c_int64),
        ("variant", ctypes.c_int64), ("warps_per_block", ctypes.c_int64),
        ("heads_per_warp", ctypes.c_int64), ("heads_fast", ctypes.c_int64),
        ("stages", ctypes.c_int64), ("eps", ctypes.c_double),
    ]


# ------------------------------------------------------------------------------ library

_LIB = None
_LOCK = threading.Lock()


def available() -> bool:
    """A CUDA device (torch) and nvcc to build the library with."""
    return torch.cuda.is_available() and cuda_build.find_nvcc() is not None


def _check_layout(lib) -> None:
    """NriParams here == NriParams in the library (names, kinds, order, size)."""
    desc = lib.nri_params_fields().decode().rstrip(",").split(",")
    theirs = [tuple(f.split(":")) for f in desc]
    ours = [(name, ctype) for name, ctype in NriParams._fields_]
    mismatch = len(theirs) != len(ours) or any(
        name != n2 or _C_TYPES.get(t) is not c for (t, name), (n2, c) in zip(theirs, ours))
    if mismatch or lib.nri_params_size() != ctypes.sizeof(NriParams):
        raise RuntimeError(
            "NriParams in kernels/cuda_norm_rope_insert.py does not match "
            f"csrc/norm_rope_insert.h: library has {desc} ({lib.nri_params_size()} bytes)")


def load_library(path=None) -> ctypes.CDLL:
    """The kernels' shared library (built on first use), with its prototypes declared."""
    global _LIB
    with _LOCK:
        if _LIB is not None and path is None:
            return _LIB
        lib = ctypes.CDLL(str(path or cuda_build.build()))
        lib.nri_launch.argtypes = [ctypes.POINTER(NriParams), ctypes.c_void_p]
        lib.nri_launch.restype = ctypes.c_int
        lib.nri_params_fields.argtypes = []
        lib.nri_params_fields.restype = ctypes.c_char_p
        lib.nri_params_size.argtypes = []
        lib.nri_params_size.restype = ctypes.c_int64
        lib.csrc_error_string.argtypes = [ctypes.c_int]
        lib.csrc_error_string.restype = ctypes.c_char_p
        lib.csrc_test_bad_launch.argtypes = [ctypes.c_void_p]
        lib.csrc_test_bad_launch.restype = ctypes.c_int
        lib.cvt_device.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p,
                                   ctypes.c_int64, ctypes.c_int, ctypes.c_int, ctypes.c_void_p]
        lib.cvt_device.restype = ctypes.c_int
        lib.nri_stream_smem_bytes.argtypes = [ctypes.POINTER(NriParams)]
        lib.nri_stream_smem_bytes.restype = ctypes.c_int64
        lib.nri_device_smem_optin.argtypes = [ctypes.POINTER(ctypes.c_int64)]
        lib.nri_device_smem_optin.restype = ctypes.c_int
        _check_layout(lib)
        if path is None:
            _LIB = lib
        return lib


def check_cuda(code: int, what: str, lib=None) -> None:
    """Raises RuntimeError with cudaGetErrorString's text for a nonzero cudaError_t."""
    if code:
        lib = lib or load_library()
        text = lib.csrc_error_string(int(code)).decode(errors="replace")
        raise RuntimeError(f"{what} failed: CUDA error {int(code)}: {text}")


def _stream(dev: torch.device) -> int:
    return torch.cuda.current_stream(dev).cuda_stream


# ----------------------------------------------------------------------------- launcher


#: The kernel variants (csrc/norm_rope_insert.cu, csrc/nri_vec.cuh, csrc/nri_stream.cuh):
#: 0 the original warp per head (the verified fallback), 1 16-byte lanes with shuffled RoPE
#: partners, 2 16-byte lanes with partners re-read from global memory, 3 persistent blocks
#: with the rows pipelined through shared memory by cp.async (the lanes of 1 and 2), 4
#: persistent warps over (token, head chunk) items, q heads apart (csrc/nri_persist.cuh), 5
#: variant 4 with every head in split lanes when R = D / 2 (a lane holds both halves of
#: its RoPE pairs: no partner shuffles; other R run variant 4).
VARIANTS = (0, 1, 2, 3, 4, 5)
#: The default: variant 5, the fastest at the model shape for bf16 and e4m3 caches.
DEFAULT_VARIANT = 5
#: Variant 0's launch shape: 4 warps per block, one head per warp at a time, 32 heads per
#: block (the fastest of benchmarks/tune_insert.py's sweep).
V0_WARPS, V0_BLOCK_H = 4, 32
#: Variants 1 and 2 by default: 2 warps per block, 2 passes of 256 / D heads per warp.
VEC_WARPS, VEC_ROUNDS = 2, 2
VEC_WARP_CHOICES = (1, 2, 4, 8)
VEC_ROUND_CHOICES = (1, 2, 4)
#: Variant 3 by default: 4 warps per block, 2 rounds of 256 / D heads per warp and pass (the
#: only choice: csrc compiles one), 3 pipeline stages (fewer when the row is too wide for the
#: shared memory: see ``norm_rope_insert``); 2 .. 8 stages may be asked for.
STREAM_WARPS, STREAM_ROUNDS, STREAM_STAGES = 4, 2, 3
STREAM_ROUND_CHOICES = (2,)
STREAM_STAGE_CHOICES = tuple(range(2, 9))
#: Variants 4 and 5 by default (csrc/nri_device.cuh's kPersistDefaultWarps, kPersistRounds):
#: 8 warps per block, 2 passes of 256 / D heads per warp and item.
PERSIST_WARPS, PERSIST_ROUNDS = 8, 2
#: Their passes per item: 2 only, the fastest; variants 3-5 compile one pass count each
#: so that the cold build of csrc/ stays short.
PERSIST_ROUND_CHOICES = (2,)


def _is_int(v) -> bool:
    return isinstance(v, (int, np.integer)) and not isinstance(v, bool)


def launch_shape(head_dim, variant=DEFAULT_VARIANT, block_h=None, warps_per_block=None,
                 heads_per_warp=None, num_stages=None, heads_fast=False):
    """(variant, warps_per_block, heads_per_warp, heads_per_block, stages) of a launch,
    defaults filled in (stages 0: variant 3's automatic choice, or not variant 3);
    ValueError naming the argument for an unsupported combination.

    Launch knobs (every combination computes the same function; for tuning sweeps):

    - ``variant``: 5 (default, ``DEFAULT_VARIANT``) or 0-4
      (docs/kernels/norm_rope_insert_cuda.md).
    - ``block_h``: heads per CUDA block. Variant 0: a power of two (default 32, tuned; the
      4 warps loop over them). Variants 1-4: must be ``warps_per_block * heads_per_warp``
      (the default; variant 3: heads per block and pass over a token).
    - ``num_stages``: variant 3 only: shared-memory stages of the pipeline, 2 .. 8 (default
      None: 3, or fewer when the row is too wide); a count whose stages do not fit the
      device's shared memory per block raises ValueError. As Triton's knob.
    - ``heads_fast``: grid order (variants 0-2; 3 and 4 are persistent). False (default):
      grid (N, head blocks), one head block's tokens adjacent in launch order; True: a 1-D
      grid with a token's head blocks adjacent (the rows walked in memory order; needs
      N * head blocks < 2^31).
    - ``warps_per_block``: variant 0: 4 only; variants 1, 2: 1, 2, 4 or 8 (default 2);
      variant 3: 1, 2, 4 or 8 (default 4); variants 4, 5: 1, 2, 4 or 8 (default 8).
    - ``heads_per_warp``: variant 0: 1 only; variants 1, 2: (256 / D) x {1, 2, 4} passes;
      variants 3-5: (256 / D) x 2 passes only (csrc compiles one count for them). Default
      2 passes (4 heads at D = 128, 8 at 64, 2 at 256); variant 3 processes them together
      in each pass over a token; variant 4: the heads of one item, whose loads are issued
      together."""
    if not _is_int(variant) or variant not in VARIANTS:
        fail("variant", f"must be one of {list(VARIANTS)}, got {variant!r}")
    if heads_fast not in (False, True, 0, 1):
        fail("heads_fast", f"must be a bool, got {heads_fast!r}")
    if variant >= 3 and heads_fast:
        fail("heads_fast", f"must be False for variant {variant} (a persistent grid), got "
                           f"{heads_fast!r}")
    if variant == 3:
        if num_stages is not None and (not _is_int(num_stages)
                                       or num_stages not in STREAM_STAGE_CHOICES):
            fail("num_stages", f"must be one of {list(STREAM_STAGE_CHOICES)} (or None) for "
                               f"variant 3, got {num_stages!r}")
    elif num_stages is not None:
        fail("num_stages", f"must be None for variant {variant} (variant 3's pipeline "
                           f"stages), got {num_stages!r}")
    stages = 0 if num_stages is None else int(num_stages)
    if variant == 0:
        if warps_per_block not in (None, V0_WARPS):
            fail("warps_per_block", f"must be {V0_WARPS} (or None) for variant 0, got "
                                    f"{warps_per_block!r}")
        if heads_per_warp not in (None, 1):
            fail("heads_per_warp", f"must be 1 (or None) for variant 0, got {heads_per_warp!r}")
        if block_h is None:
            block_h = V0_BLOCK_H
        if not _is_int(block_h) or block_h <= 0 or block_h & (block_h - 1):
            fail("block_h", f"must be a power of two, got {block_h!r}")
        return 0, V0_WARPS, 1, int(block_h), 0
    g = 256 // head_dim  # heads per 16-byte pass of a warp
    default_wpb = {3: STREAM_WARPS, 4: PERSIST_WARPS, 5: PERSIST_WARPS}.get(variant, VEC_WARPS)
    wpb = default_wpb if warps_per_block is None else warps_per_block
    if not _is_int(wpb) or wpb not in VEC_WARP_CHOICES:
        fail("warps_per_block", f"must be one of {list(VEC_WARP_CHOICES)} for variant "
                                f"{variant}, got {warps_per_block!r}")
    default_rounds = {3: STREAM_ROUNDS, 4: PERSIST_ROUNDS, 5: PERSIST_ROUNDS}.get(variant,
                                                                               VEC_ROUNDS)
    hpw = g * default_rounds if heads_per_warp is None else heads_per_warp
    rounds = {3: STREAM_ROUND_CHOICES, 4: PERSIST_ROUND_CHOICES,
              5: PERSIST_ROUND_CHOICES}.get(variant, VEC_ROUND_CHOICES)
    choices = [g * r for r in rounds]
    if not _is_int(hpw) or hpw not in choices:
        fail("heads_per_warp", f"must be one of {choices} (256 / head_dim = {g} heads per "
                               f"16-byte pass, {', '.join(map(str, rounds))} passes) for "
                               f"variant {variant}, got {heads_per_warp!r}")
    if block_h is not None and block_h != wpb * hpw:
        fail("block_h", f"must be warps_per_block * heads_per_warp = {wpb * hpw} (or None) "
                        f"for variant {variant}, got {block_h!r}")
    return int(variant), int(wpb), int(hpw), int(wpb * hpw), stages


def norm_rope_insert(rows, positions, rope_table, w_q, w_k, *, num_q_heads, num_kv_heads,
                     head_dim, rotary_dim, eps, kv_cache, slot_mapping, kv_fmt=None,
                     kv_cache_dtype=None, platform="cuda",
                     num_index_heads=0, has_index_k=False, w_index_q=None, w_index_k=None,
                     k_scale=None, v_scale=None, index_cache=None, index_fmt=None,
                     index_slot_mapping=None, q_out=None, index_q_out=None,
                     skip_index=False, validate=False, block_h=None, num_stages=None,
                     heads_fast=False, variant=DEFAULT_VARIANT, warps_per_block=None,
                     heads_per_warp=None):
    """Fused norm + RoPE + insert of packed rows ``[N, q | k | v | index_q | index_k]`` on
    the GPU: the contract of ``kernels.norm_rope_insert.norm_rope_insert`` (see there).

    Launch knobs (variant, block_h, num_stages, heads_fast, warps_per_block,
    heads_per_warp; every combination computes the same function): ``launch_shape``.

    Raises ValueError (naming the argument) for bad arguments, including tensors that are
    not on a CUDA device, and RuntimeError with the CUDA error text if the launch fails."""
    out, p = launch_params(
        rows, positions, rope_table, w_q, w_k, num_q_heads=num_q_heads,
        num_kv_heads=num_kv_heads, head_dim=head_dim, rotary_dim=rotary_dim, eps=eps,
        kv_cache=kv_cache, slot_mapping=slot_mapping, kv_fmt=kv_fmt,
        kv_cache_dtype=kv_cache_dtype, platform=platform, num_index_heads=num_index_heads,
        has_index_k=has_index_k, w_index_q=w_index_q, w_index_k=w_index_k, k_scale=k_scale,
        v_scale=v_scale, index_cache=index_cache, index_fmt=index_fmt,
        index_slot_mapping=index_slot_mapping, q_out=q_out, index_q_out=index_q_out,
        skip_index=skip_index, validate=validate, block_h=block_h, num_stages=num_stages,
        heads_fast=heads_fast, variant=variant, warps_per_block=warps_per_block,
        heads_per_warp=heads_per_warp)
    if p is None:
        return out
    dev = rows.device
    lib = load_library()
    with torch.cuda.device(dev):
        if p.variant == 3 and p.stages:
            check_stream_smem(p, lib)
        code = lib.nri_launch(ctypes.byref(p), ctypes.c_void_p(_stream(dev)))
    check_cuda(code, "norm_rope_insert (CUDA) launch", lib)
    return out


def check_stream_smem(p, lib=None) -> None:
    """ValueError naming num_stages when variant 3's explicit stages do not fit the current
    device's shared memory per block (nri_launch would return cudaErrorInvalidValue)."""
    lib = lib or load_library()
    need, limit = lib.nri_stream_smem_bytes(ctypes.byref(p)), ctypes.c_int64(0)
    check_cuda(lib.nri_device_smem_optin(ctypes.byref(limit)), "shared memory query", lib)
    if need > limit.value:
        fail("num_stages", f"{p.stages} stages of a {p.head_dim}-dim row of "
                           f"{p.hq} + 2 x {p.hkv} + {p.hi} + {p.write_ik} heads need {need} "
                           f"bytes of shared memory per block, the device allows "
                           f"{limit.value}: ask for fewer stages (or None)")


def launch_params(rows, positions, rope_table, w_q, w_k, *, block_h=None, num_stages=None,
                  heads_fast=False, variant=DEFAULT_VARIANT, warps_per_block=None,
                  heads_per_warp=None, device_type="cuda", **kwargs):
    """Every host check of ``norm_rope_insert`` (the shared plan, then the launch knobs, then
    the device: ``device_type``), and the kernel's parameters: ``(outputs, NriParams)``, or
    ``(outputs, None)`` for N = 0. ``kwargs`` are the other arguments of
    ``norm_rope_insert``. The CPU tests pass ``device_type="cpu"`` to run the kernels'
    source on the host (csrc/nri_vec_host.cpp: variants 1, 2; csrc/nri_stream_host.cpp:
    variant 3; csrc/nri_persist_host.cpp: variant 4) with these very parameters."""
    plan = plan_norm_rope_insert(rows, positions, rope_table, w_q, w_k, **kwargs)
    variant, wpb, hpw, block_h, stages = launch_shape(plan.d, variant, block_h,
                                                      warps_per_block, heads_per_warp,
                                                      num_stages, heads_fast)
    dev = rows.device
    if dev.type != device_type:
        where = "a CUDA device" if device_type == "cuda" else f"device type {device_type}"
        fail("rows", f"must be on {where} for the CUDA kernel, got {dev}")
    out, n, d = plan.out, plan.n, plan.d
    if n == 0:
        return out, None
    if n > 2**31 - 1:
        fail("rows", f"must have at most 2^31 - 1 rows, got {n}")
    heads = plan.hq + plan.hkv + (plan.hi if plan.transform_iq else 0) + int(plan.write_ik)
    blocks = -(-heads // block_h)
    if heads_fast and n * blocks > 2**31 - 1:
        fail("heads_fast", f"needs N * head blocks < 2^31, got {n} * {blocks}")
    if not heads_fast and variant != 3 and blocks > 65535:
        fail("block_h", f"gives {blocks} head blocks, more than the grid's 65535")
    act_code = FORMAT_CODES[plan.md]
    iq = out.get("index_q")
    kv_cache, slot_mapping = kwargs["kv_cache"], kwargs["slot_mapping"]
    w_index_q, w_index_k = kwargs.get("w_index_q"), kwargs.get("w_index_k")
    p = NriParams(
        rows=rows.data_ptr(), row_stride=rows.stride(0),
        positions=positions.data_ptr(), pos_stride=positions.stride(0),
        pos_is64=int(positions.dtype == torch.int64),
        table=rope_table.data_ptr(), table_stride=rope_table.stride(0),
        max_pos=rope_table.shape[0],
        w_q=w_q.data_ptr(), w_k=w_k.data_ptr(),
        w_iq=(w_index_q if plan.transform_iq else w_q).data_ptr(),
        w_ik=(w_index_k if plan.write_ik else w_q).data_ptr(),
        q_out=out["q"].data_ptr(), q_s0=out["q"].stride(0), q_s1=out["q"].stride(1),
        iq_out=(iq if iq is not None else rows).data_ptr(),
        iq_s0=iq.stride(0) if iq is not None else 0,
        iq_s1=iq.stride(1) if iq is not None else 0,
        iq_fmt=FORMAT_CODES[plan.index_fmt] if plan.idx_fp8 else act_code,
        kv=kv_cache.data_ptr(), kv_s0=kv_cache.stride(0), kv_s1=kv_cache.stride(1),
        kv_s2=kv_cache.stride(2), page_size=plan.page, num_slots=plan.num_slots,
        kv_fmt=FORMAT_CODES[plan.kv_fmt],
        slots=slot_mapping.data_ptr(), slot_stride=slot_mapping.stride(0),
        slots_is64=int(slot_mapping.dtype == torch.int64),
        k_scale=plan.ks.data_ptr(), ks_s0=plan.ks_strides[0], ks_s1=plan.ks_strides[1],
        v_scale=plan.vs.data_ptr(), vs_s0=plan.vs_strides[0], vs_s1=plan.vs_strides[1],
        ic=plan.ic.data_ptr(), ic_s0=plan.ic_strides[0], ic_s1=plan.ic_strides[1],
        ic_page=plan.ic_page, ic_num_slots=plan.ic_slots,
        ic_fmt=FORMAT_CODES[plan.index_fmt] if plan.idx_fp8 else act_code,
        islots=plan.islots.data_ptr(), islot_stride=plan.islots.stride(0),
        islots_is64=int(plan.islots.dtype == torch.int64),
        n=n, hq=plan.hq, hkv=plan.hkv, hi=plan.hi if plan.transform_iq else 0,
        write_ik=int(plan.write_ik), ik_col=plan.width - d, head_dim=d,
        rotary_dim=int(kwargs["rotary_dim"]), act_fmt=act_code, heads_per_block=block_h,
        variant=variant, warps_per_block=wpb, heads_per_warp=hpw, heads_fast=int(heads_fast),
        stages=stages, eps=float(np.float32(kwargs["eps"])))
    return out, p
