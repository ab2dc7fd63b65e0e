"""Host-side argument checks shared by the kernel launchers (Triton and CUDA), and the
adapter helpers that move the oracle's numpy inputs onto the device.

Every check raises ``ValueError`` whose message starts with the argument's name and says
the valid range, before anything is launched (SPEC.md section 7, "value checks"): shapes,
dtypes and strides always; tensor *contents* (slot ranges, duplicate slots) only under
``validate=True``, because reading them back is a host sync.
"""

from __future__ import annotations

import numpy as np
import torch

MODEL_DTYPES = {torch.bfloat16: "bfloat16", torch.float16: "float16"}
HALF_FORMATS = {name: dt for dt, name in MODEL_DTYPES.items()}
KV_FP8_FORMATS = ("e4m3fn", "e5m2", "e4m3fnuz", "e5m2fnuz")
INDEX_FP8_FORMATS = ("e4m3fn", "e4m3fnuz")
HEAD_DIMS = (64, 128, 256)
SLOT_DTYPES = (torch.int32, torch.int64)


def fail(name: str, msg: str):
    raise ValueError(f"{name} {msg}")


def check_tensor(t, name, dtypes, shape=None, device=None) -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        fail(name, f"must be a torch tensor, got {type(t).__name__}")
    if t.dtype not in dtypes:
        fail(name, f"must have dtype in {[str(d) for d in dtypes]}, got {t.dtype}")
    if shape is not None and tuple(t.shape) != tuple(shape):
        fail(name, f"must have shape {list(shape)}, got {list(t.shape)}")
    if device is not None and t.device != device:
        fail(name, f"must be on {device}, got {t.device}")
    return t


def check_int(value, name: str, lo: int, hi: int | None = None) -> int:
    """An integer in [lo, hi] (hi None: unbounded)."""
    ok = isinstance(value, (int, np.integer)) and not isinstance(value, bool) and value >= lo \
        and (hi is None or value <= hi)
    if not ok:
        rng = f">= {lo}" if hi is None else f"in [{lo}, {hi}]"
        fail(name, f"must be an integer {rng}, got {value!r}")
    return int(value)


def check_last_dim_contiguous(t: torch.Tensor, name: str) -> None:
    if t.dim() and t.shape[-1] > 1 and t.stride(-1) != 1:
        fail(name, "must have a contiguous last dim (stride 1)")


def check_kv_fmt(kv_fmt) -> bool:
    """True for an fp8 format; the valid names otherwise raise."""
    valid = KV_FP8_FORMATS + tuple(HALF_FORMATS)
    if kv_fmt not in valid:
        fail("kv_fmt", f"must be one of {list(valid)}, got {kv_fmt!r}")
    return kv_fmt in KV_FP8_FORMATS


def check_kv_cache(kv_cache, kv_fmt, hkv: int, d: int, dev) -> tuple[int, int]:
    """The main cache: logical ``[num_pages, Hkv, P, 2D]``, any strides with the last dim
    contiguous, uint8 codes of an fp8 ``kv_fmt`` or the bf16/fp16 dtype it names. Returns
    (P, num_slots)."""
    fp8 = check_kv_fmt(kv_fmt)
    check_tensor(kv_cache, "kv_cache", (torch.uint8,) if fp8 else (HALF_FORMATS[kv_fmt],),
                 device=dev)
    if kv_cache.dim() != 4 or kv_cache.shape[1] != hkv or kv_cache.shape[3] != 2 * d:
        fail("kv_cache", f"must have logical shape [num_pages, Hkv={hkv}, P, 2D={2 * d}], got "
                         f"{list(kv_cache.shape)}")
    if kv_cache.shape[2] not in (16, 32, 64, 128):
        fail("kv_cache", f"must have a page size P in [16, 32, 64, 128], got {kv_cache.shape[2]}")
    check_last_dim_contiguous(kv_cache, "kv_cache")
    if any(s < 0 for s in kv_cache.stride()):
        fail("kv_cache", f"must have non-negative strides, got {list(kv_cache.stride())}")
    return kv_cache.shape[2], kv_cache.shape[0] * kv_cache.shape[2]


def scale_arg(scale, name, fp8, hkv, num_slots, dev):
    """(tensor, stride over heads, stride over slots) of a None / scalar / ``[Hkv, slots]``
    float32 scale; model-dtype caches take no scale (None or 1.0)."""
    if scale is None:
        return torch.ones(1, dtype=torch.float32, device=dev), 0, 0
    if isinstance(scale, (float, int, np.floating, np.integer)) and not isinstance(scale, bool):
        scale = torch.tensor(float(np.float32(scale)), dtype=torch.float32, device=dev)
    check_tensor(scale, name, (torch.float32,), device=dev)
    if scale.dim() == 0 or (scale.dim() == 1 and scale.numel() == 1):
        if not fp8 and float(scale.reshape(())) != 1.0:
            fail(name, "applies to fp8 caches only; model-dtype caches take no scale")
        return scale.reshape(1), 0, 0
    if scale.shape != (hkv, num_slots):
        fail(name, f"must be a scalar or of shape [Hkv, num_pages*P] = [{hkv}, {num_slots}], "
                   f"got {list(scale.shape)}")
    if not fp8:
        fail(name, "applies to fp8 caches only; model-dtype caches take no scale")
    return scale, scale.stride(0), scale.stride(1)


def validate_slots(slots: torch.Tensor, name: str, num_slots: int) -> None:
    """``validate=True`` content check (a host sync): every slot is -1..num_slots-1 (any
    negative value means skip) and no non-negative slot appears twice."""
    s = slots.detach().to("cpu", torch.int64)
    bad = s >= num_slots
    if bool(bad.any()):
        i = int(bad.nonzero()[0, 0])
        fail(name, f"must hold slots in [0, {num_slots - 1}] or negative (skip); "
                   f"entry {i} is {int(s[i])}")
    used = s[s >= 0]
    uniq, counts = torch.unique(used, return_counts=True)
    if bool((counts > 1).any()):
        dup = int(uniq[counts > 1][0])
        fail(name, f"must not repeat a non-negative slot in one call; slot {dup} appears "
                   f"{int(counts[counts > 1][0])} times")


# ------------------------------------------------------------------- adapter helpers


def strided_codes_in(codes: np.ndarray, dev, torch_dtype=None) -> torch.Tensor:
    """A COPY of a code array on the device with the same element strides (so HND, NHD and
    padded layouts reach the kernel as they are), viewed as ``torch_dtype`` if given."""
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


def codes_of(t: torch.Tensor) -> np.ndarray:
    """A device tensor's codes as numpy (uint8, or uint16 bits of bf16/fp16)."""
    from oracle.impl_torch import _codes_out

    return _codes_out(t if t.dtype == torch.uint8 else t.view(torch.int16))


def resolve_formats(kv_fmt, kv_cache_dtype, platform, model_dtype, index_cache=None,
                    index_fmt=None) -> tuple[str, str | None]:
    """(kv_fmt, index_fmt) from either explicit format names or vLLM's ``kv_cache_dtype``
    string read on ``platform`` (SPEC.md s.2: "fp8" is e4m3fn on cuda, e4m3fnuz on
    rocm-fnuz). An index cache without ``index_fmt`` is read by its dtype: uint8 means the
    platform's e4m3, otherwise the model dtype."""
    from reference.platforms import PLATFORMS, index_cache_format, kv_cache_format

    if platform not in PLATFORMS:
        fail("platform", f"must be one of {list(PLATFORMS)}, got {platform!r}")
    if (kv_fmt is None) == (kv_cache_dtype is None):
        fail("kv_fmt", "or kv_cache_dtype: give exactly one of them")
    if kv_fmt is None:
        try:
            kv_fmt = kv_cache_format(kv_cache_dtype, platform, model_dtype)
        except ValueError as e:
            fail("kv_cache_dtype", str(e).split(" ", 1)[1])
    if index_fmt is None and index_cache is not None and isinstance(index_cache, torch.Tensor):
        index_fmt = index_cache_format(index_cache.dtype == torch.uint8, platform, model_dtype)
    return kv_fmt, index_fmt
