"""The usual conventions of kernels written for vLLM, and converters between them and the
oracle's case inputs, so a kernel in those conventions registers with a short adapter.

The oracle's attention inputs (``oracle.core.cases.make_inputs``): ``kv_cache`` codes
``[num_pages, Hkv, P, 2D]`` (K in the first D columns, V in the last D), ``kv_fmt`` the
storage format's name (``reference.codec.FORMATS``), ``topk`` head-major ``[Hkv, T, K]``
with -1 for no block, ``k_scale`` / ``v_scale`` None, a scalar or ``[Hkv, num_slots]``.
vLLM's conventions, and the helper converting to each:

- fp8 caches are uint8 storage viewed with a torch fp8 dtype, the kernel's only signal of
  the format: ``torch_dtype`` / ``oracle_format`` (one table, ``oracle.impls.io.TORCH_DTYPES``),
  ``cache_view``;
- ``kv_cache_dtype`` strings ("auto", "fp8", "fp8_e4m3", "fp8_e5m2", "bfloat16", "float16")
  resolved per platform
  (e4m3fn on CUDA and gfx950, e4m3fnuz on MI300): ``resolve_kv_cache_dtype``, and the
  string and platform a case's storage format stands for: ``vllm_kv_cache_dtype``;
- separate key and value caches, NHD ``[blocks, P, Hkv, D]`` or HND ``[blocks, Hkv, P, D]``:
  ``split_kv_cache``;
- top-k buffers token-major ``[T, Hkv, K]`` or head-major ``[Hkv, T, K]``: ``topk_layout``;
- selections listed valid entries first with -1 padding last, or sorted ascending with the
  padding last: ``order_selection`` (attention reads a row's selection as a set, so either
  order computes the same attention);
- scales per tensor (a scalar), per head ``[Hkv]`` or per token ``[num_slots, Hkv]``:
  ``scale_form``;
- outputs in the model dtype back to the codes the oracle compares: ``output_codes``.
"""

from __future__ import annotations

import numpy as np
import torch

from oracle.impls.io import FP8_DTYPES, HALF_DTYPES, TORCH_DTYPES
from reference.platforms import MODEL_DTYPES, PLATFORMS, kv_cache_format

#: vLLM's fp8 ``kv_cache_dtype`` strings, each naming a kind the platform resolves.
VLLM_KV_CACHE_DTYPES = ("auto", "bfloat16", "float16", "fp8", "fp8_e4m3", "fp8_e5m2")
LAYOUTS = ("NHD", "HND")
TOPK_LAYOUTS = ("head", "token")
ORDERINGS = ("valid_first", "sorted")
SCALE_FORMS = ("tensor", "head", "token")


def torch_dtype(fmt: str) -> torch.dtype:
    """The torch dtype of a storage format (``"e4m3fnuz"`` -> ``torch.float8_e4m3fnuz``)."""
    if fmt not in TORCH_DTYPES:
        raise ValueError(f"fmt must be one of {sorted(TORCH_DTYPES)}, got {fmt!r}")
    return TORCH_DTYPES[fmt]


def oracle_format(dtype: torch.dtype) -> str:
    """The storage format a torch dtype stands for (the inverse of ``torch_dtype``)."""
    for fmt, d in TORCH_DTYPES.items():
        if d == dtype:
            return fmt
    raise ValueError(f"dtype must be one of {list(TORCH_DTYPES.values())}, got {dtype}")


def resolve_kv_cache_dtype(kv_cache_dtype: str, platform: str,
                           model_dtype: str = "bfloat16") -> torch.dtype:
    """The torch dtype vLLM gives a ``kv_cache_dtype`` string on a platform: "auto" the
    model dtype; "fp8" and "fp8_e4m3" e4m3fn on cuda and rocm-ocp, e4m3fnuz on rocm-fnuz
    (MI300); "fp8_e5m2" e5m2, e5m2fnuz on rocm-fnuz."""
    if kv_cache_dtype not in VLLM_KV_CACHE_DTYPES:
        raise ValueError(f"kv_cache_dtype must be one of {list(VLLM_KV_CACHE_DTYPES)}, got "
                         f"{kv_cache_dtype!r}")
    return torch_dtype(kv_cache_format(kv_cache_dtype, platform, model_dtype))


def vllm_kv_cache_dtype(fmt: str, model_dtype: str = "bfloat16") -> tuple[str, str]:
    """(kv_cache_dtype, platform) a vLLM deployment would name a storage format by (the
    first platform, in ``PLATFORMS`` order, that resolves the string to it)."""
    for platform in PLATFORMS:
        for name in ("fp8_e4m3", "fp8_e5m2", "auto", "bfloat16", "float16"):
            if kv_cache_format(name, platform, model_dtype) == fmt:
                return name, platform
    raise ValueError(f"fmt must be an fp8 format or the model dtype {model_dtype!r}, got "
                     f"{fmt!r}")


def cache_view(codes, fmt: str) -> torch.Tensor:
    """Cache codes as a torch tensor of the format's dtype, sharing the bytes: uint8 fp8
    codes viewed as the fp8 dtype, uint16 half bits as bfloat16 / float16."""
    t = torch.from_numpy(np.ascontiguousarray(codes)) if isinstance(codes, np.ndarray) \
        else codes
    want = 1 if fmt in FP8_DTYPES else 2
    if t.element_size() != want:
        raise ValueError(f"codes of {fmt} must have {want}-byte elements, got {t.dtype}")
    if t.dtype == torch.uint16:  # torch's uint16 cannot be viewed; its bits as int16 can
        t = torch.from_numpy(np.ascontiguousarray(codes).view(np.int16))
    return t.view(torch_dtype(fmt))


def split_kv_cache(kv_cache, fmt: str, layout: str = "NHD") -> tuple[torch.Tensor,
                                                                      torch.Tensor]:
    """(key_cache, value_cache) of the oracle's combined ``[pages, Hkv, P, 2D]`` codes as
    vLLM lays them out (``"NHD"``: ``[pages, P, Hkv, D]``; ``"HND"``: ``[pages, Hkv, P,
    D]``), contiguous copies viewed with the format's torch dtype."""
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {list(LAYOUTS)}, got {layout!r}")
    codes = np.asarray(kv_cache)
    d = codes.shape[-1] // 2
    halves = (codes[..., :d], codes[..., d:])
    if layout == "NHD":
        halves = tuple(h.transpose(0, 2, 1, 3) for h in halves)
    return tuple(cache_view(np.ascontiguousarray(h), fmt) for h in halves)


def topk_layout(topk, layout: str = "token") -> torch.Tensor:
    """The oracle's head-major ``[Hkv, T, K]`` selection as int32 ``"token"``-major
    ``[T, Hkv, K]`` or ``"head"``-major (as is)."""
    if layout not in TOPK_LAYOUTS:
        raise ValueError(f"layout must be one of {list(TOPK_LAYOUTS)}, got {layout!r}")
    t = torch.from_numpy(np.ascontiguousarray(topk, np.int32))
    return t.permute(1, 0, 2).contiguous() if layout == "token" else t


def order_selection(topk: torch.Tensor, ordering: str = "valid_first") -> torch.Tensor:
    """Each row's entries (last axis) with the -1 padding moved last: ``"valid_first"``
    keeps the valid entries' order, ``"sorted"`` sorts them ascending."""
    if ordering not in ORDERINGS:
        raise ValueError(f"ordering must be one of {list(ORDERINGS)}, got {ordering!r}")
    big = torch.iinfo(torch.int64).max
    if ordering == "sorted":
        key = torch.where(topk >= 0, topk.long(), big)
    else:  # stable: padding after every valid entry, each group in its own order
        key = (topk < 0).long()
    return torch.gather(topk, -1, torch.sort(key, dim=-1, stable=True).indices)


def scale_form(scale, form: str, num_kv_heads: int, num_slots: int) -> torch.Tensor | None:
    """A case's scale (None, a scalar, or ``[Hkv, num_slots]``) as a float32 tensor of
    vLLM's ``form``: ``"tensor"`` a 0-d scalar, ``"head"`` ``[Hkv]``, ``"token"``
    ``[num_slots, Hkv]``. None stays None. ValueError when the case's scales vary where
    the form cannot (per-slot scales asked for per head)."""
    if form not in SCALE_FORMS:
        raise ValueError(f"form must be one of {list(SCALE_FORMS)}, got {form!r}")
    if scale is None:
        return None
    s = np.broadcast_to(np.asarray(scale, np.float32), (num_kv_heads, num_slots))
    if form == "token":
        return torch.from_numpy(np.array(s.T, order="C"))
    per_head = s[:, :1] if s.size else np.ones((num_kv_heads, 1), np.float32)
    if not np.array_equal(s, np.broadcast_to(per_head, s.shape)):
        raise ValueError(f"form {form!r} needs one scale per head, but the scales vary "
                         f"across slots")
    if form == "head":
        return torch.from_numpy(np.array(per_head[:, 0]))
    if not np.all(per_head == per_head[0]):
        raise ValueError("form 'tensor' needs one scale, but the scales vary across heads")
    return torch.tensor(float(per_head[0, 0]), dtype=torch.float32)


def output_codes(out: torch.Tensor, model_dtype: str) -> np.ndarray:
    """An output in the model dtype as the uint16 codes the oracle compares (the values
    rounded to the model dtype first when computed wider)."""
    if model_dtype not in MODEL_DTYPES:
        raise ValueError(f"model_dtype must be one of {list(MODEL_DTYPES)}, got "
                         f"{model_dtype!r}")
    half = out.to(HALF_DTYPES[model_dtype]).detach().cpu().contiguous()
    return half.view(torch.int16).numpy().view(np.uint16)
