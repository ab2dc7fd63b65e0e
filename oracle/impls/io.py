"""How every implementation's adapter moves a case's numpy inputs onto its device and its
outputs back: values in a torch dtype, integer arrays, code arrays (fp8 uint8, bf16/fp16
uint16 bits) with or without their strides, scales; the device itself."""

from __future__ import annotations

import numpy as np
import torch

from oracle.impls.catalog import device_name
from reference.formats import FORMATS, FP8_FORMATS, MODEL_DTYPES

#: Storage format -> the torch dtype that views it (fp8 caches: uint8 codes), from the one
#: format table; its fp8 and 16-bit parts.
TORCH_DTYPES = {name: getattr(torch, f.torch_dtype) for name, f in FORMATS.items()}
FP8_DTYPES = {name: TORCH_DTYPES[name] for name in FP8_FORMATS}
HALF_DTYPES = {name: TORCH_DTYPES[name] for name in MODEL_DTYPES}


def device() -> torch.device:
    """The device the torch-based implementations run on: cuda when available."""
    return torch.device(device_name())


def values(a, dtype, dev) -> torch.Tensor:
    """float64 numpy values (already representable in dtype) as a torch tensor."""
    return torch.from_numpy(np.asarray(a, np.float64)).to(device=dev, dtype=dtype)


def ints(a, dev) -> torch.Tensor:
    """An integer array as an int64 tensor on the device."""
    return torch.from_numpy(np.ascontiguousarray(np.asarray(a), dtype=np.int64)).to(dev)


def ints_in(a, dev) -> torch.Tensor:
    """A case's index array (slots, positions, block table, lengths) on the device in its own
    dtype, int32 or int64 (any other integer type as int64): the cases draw both, as servers
    pass both."""
    a = np.asarray(a)
    dtype = a.dtype if a.dtype in (np.int32, np.int64) else np.int64
    return torch.from_numpy(np.ascontiguousarray(a, dtype)).to(dev)


def codes_in(codes: np.ndarray, dev) -> torch.Tensor:
    """A contiguous COPY of a code array (any strides) on the device: uint8, or int16 bits
    of uint16 codes (torch's uint16 supports too few ops)."""
    c = np.array(codes, copy=True, order="C")
    if c.dtype == np.uint16:
        c = c.view(np.int16)
    return torch.from_numpy(c).to(dev)


def codes_out(t: torch.Tensor) -> np.ndarray:
    """A tensor of codes back as numpy (int16 bits read as uint16 codes)."""
    a = t.detach().cpu().contiguous().numpy()
    return a.view(np.uint16) if a.dtype == np.int16 else a


def strided_codes_in(codes: np.ndarray, dev, torch_dtype=None) -> torch.Tensor:
    """A COPY of a code array on the device with the same element strides (so HND, NHD and
    padded layouts reach the kernel as they are), viewed as ``torch_dtype`` if given."""
    c = np.asarray(codes)
    item = c.itemsize
    strides = tuple(s // item for s in c.strides)
    if c.size == 0 or any(s < 0 for s in strides):
        t = codes_in(c, dev)
    else:
        extent = 1 + sum((n - 1) * s for n, s in zip(c.shape, strides))
        buf = codes_in(np.zeros(extent, c.dtype), dev)
        t = torch.as_strided(buf, c.shape, strides)
        t.copy_(codes_in(c, dev))
    return t if torch_dtype is None else t.view(torch_dtype)


def scale_in(s, dev):
    """A case's scale (None, a float32 scalar or array) as a float32 tensor."""
    if s is None:
        return None
    return torch.from_numpy(np.ascontiguousarray(np.asarray(s, np.float32))).to(dev)


def codes_of(t: torch.Tensor) -> np.ndarray:
    """A device tensor's codes as numpy (uint8, or uint16 bits of bf16/fp16)."""
    return codes_out(t if t.dtype == torch.uint8 else t.view(torch.int16))
