"""Paged KV cache and index cache: layouts, insert by slot mapping, gather and dequantise.

Representation (shared by every reference op):
- A cache holds *codes*: uint8 for fp8 formats, uint16 bit patterns for bf16/fp16, with
  its storage format named separately (a key of ``reference.codec.FORMATS``), exactly as
  the project's kernels take uint8 codes plus an explicit format.
- Main cache, logical shape ``[num_pages, Hkv, P, 2*D]`` (K in ``[..., :D]``, V in
  ``[..., D:]``). Physically HND (that shape), NHD (``[num_pages, P, Hkv, 2*D]`` seen
  through a transpose) or either with padded strides; the reference only ever indexes the
  logical view, so every layout gives the same results.
- Index cache, ``[num_pages, P, D]``; slot = page * P + offset.
- Activations are float64 arrays of values already representable in the model dtype.
- Scales are float32 values: a scalar per tensor, or an array ``[Hkv, num_pages * P]`` per
  (KV head, physical slot). fp8 writes encode ``value / scale`` (satfinite, RNE); reads
  decode ``code * scale``. Model-dtype caches take no scale (a non-unit scale is an error).

Insert writes in place into the given (possibly strided) array, as the kernels do, and
returns it.
"""

from __future__ import annotations

import numpy as np

from reference.codec import as_float64, check_scale, decode, encode, get_format, round_to
from reference.platforms import is_fp8

LAYOUTS = ("HND", "NHD")


def empty_cache(num_pages, num_kv_heads, page_size, head_dim, fmt, layout="HND", pad=0,
                fill_code=0):
    """A logical ``[num_pages, Hkv, P, 2*D]`` view of codes filled with ``fill_code``.

    ``layout`` picks the physical order; ``pad`` extra codes at the end of each physical
    row give non-contiguous strides (the last dim stays contiguous)."""
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
    dtype = get_format(fmt).code_dtype
    width = 2 * head_dim + pad
    if layout == "HND":
        phys = np.full((num_pages, num_kv_heads, page_size, width), fill_code, dtype)
        return phys[..., : 2 * head_dim]
    phys = np.full((num_pages, page_size, num_kv_heads, width), fill_code, dtype)
    return phys.transpose(0, 2, 1, 3)[..., : 2 * head_dim]


def empty_index_cache(num_pages, page_size, head_dim, fmt, fill_code=0):
    return np.full((num_pages, page_size, head_dim), fill_code, get_format(fmt).code_dtype)


def scale_at(scale, head, slots) -> np.ndarray | float:
    """The scale of (KV head, physical slot): a scalar, or ``scale[head, slots]``."""
    s = np.asarray(scale, dtype=np.float64)
    return float(s) if s.ndim == 0 else s[head, slots]


def check_scales(scale, name, fmt, num_kv_heads, num_slots):
    """Validate a per-tensor or per-(head, slot) scale for a cache of storage format fmt."""
    s = check_scale(1.0 if scale is None else scale, name)
    if not is_fp8(fmt) and not np.all(s == 1.0):
        raise ValueError(f"{name} applies to fp8 caches only; {fmt} caches take no scale")
    if s.ndim not in (0, 2) or (s.ndim == 2 and s.shape != (num_kv_heads, num_slots)):
        raise ValueError(
            f"{name} must be a scalar or of shape [Hkv, num_pages*P] = "
            f"[{num_kv_heads}, {num_slots}], got shape {s.shape}"
        )
    return s


def check_slots(slot_mapping, num_slots, n_tokens, name="slot_mapping"):
    slots = np.asarray(slot_mapping)
    if slots.dtype.kind not in "iu" or slots.shape != (n_tokens,):
        raise ValueError(f"{name} must be an integer array of shape [{n_tokens}], "
                         f"got {slots.dtype} {slots.shape}")
    slots = slots.astype(np.int64)
    valid = slots[slots >= 0]
    if valid.size and valid.max() >= num_slots:
        raise ValueError(f"{name} entries must be < num_pages*P = {num_slots} (or negative "
                         f"to skip), got {valid.max()}")
    if np.unique(valid).size != valid.size:
        raise ValueError(f"{name} must not repeat a non-negative slot")
    return slots


def quantize(values, fmt, scale=1.0) -> np.ndarray:
    """Codes of values in a storage format: fp8 satfinite of value/scale, or RNE bf16/fp16."""
    if is_fp8(fmt):
        return encode(values, fmt, "satfinite", scale=scale)
    return encode(values, fmt, "nonsaturating")


def dequantize(codes, fmt, scale=1.0) -> np.ndarray:
    return decode(codes, fmt) * np.asarray(scale, dtype=np.float64)


def insert_kv(cache, fmt, k, v, slot_mapping, k_scale=None, v_scale=None,
              quantize_from="value", model_dtype="bfloat16"):
    """Write K/V heads of each token at its slot; negative slots are skipped.

    k, v: float64 ``[N, Hkv, D]``. ``quantize_from="value"`` encodes k as given (the fused
    kernel: K's fp32 post-RoPE value, one rounding); ``"model_dtype"`` first rounds k to the
    model dtype (reshape_and_cache: two roundings). V is always model-dtype valued already.
    """
    num_pages, hkv, page, two_d = cache.shape
    k, v = as_float64(k, "k"), as_float64(v, "v")
    n = k.shape[0] if k.ndim else 0
    if k.shape != (n, hkv, two_d // 2) or v.shape != k.shape:
        raise ValueError(f"k and v must have shape [N, Hkv, D] = [{n}, {hkv}, {two_d // 2}], "
                         f"got {k.shape} and {v.shape}")
    if quantize_from not in ("value", "model_dtype"):
        raise ValueError(f"quantize_from must be 'value' or 'model_dtype', got {quantize_from!r}")
    if cache.dtype != get_format(fmt).code_dtype:
        raise ValueError(f"cache must hold {get_format(fmt).code_dtype.__name__} codes for {fmt}")
    num_slots = num_pages * page
    slots = check_slots(slot_mapping, num_slots, n)
    ks = check_scales(k_scale, "k_scale", fmt, hkv, num_slots)
    vs = check_scales(v_scale, "v_scale", fmt, hkv, num_slots)
    if quantize_from == "model_dtype":
        k = round_to(k, model_dtype)
    d = two_d // 2
    for t in np.flatnonzero(slots >= 0):
        pg, off = divmod(int(slots[t]), page)
        for h in range(hkv):
            cache[pg, h, off, :d] = quantize(k[t, h], fmt, scale_at(ks, h, slots[t]))
            cache[pg, h, off, d:] = quantize(v[t, h], fmt, scale_at(vs, h, slots[t]))
    return cache


def insert_index_k(index_cache, fmt, index_k, index_slot_mapping):
    """Write each token's index key ``[N, D]`` (float64 values) at its slot (unit scale)."""
    num_pages, page, d = index_cache.shape
    if index_cache.dtype != get_format(fmt).code_dtype:
        raise ValueError(f"index_cache must hold {get_format(fmt).code_dtype.__name__} codes "
                         f"for {fmt}, got {index_cache.dtype}")
    index_k = as_float64(index_k, "index_k")
    n = index_k.shape[0] if index_k.ndim else 0
    if index_k.shape != (n, d):
        raise ValueError(f"index_k must have shape [N, D] = [{n}, {d}], got {index_k.shape}")
    slots = check_slots(index_slot_mapping, num_pages * page, n, "index_slot_mapping")
    keep = slots >= 0
    index_cache[slots[keep] // page, slots[keep] % page] = quantize(index_k[keep], fmt)
    return index_cache


def token_slots(block_table_row, positions, page_size) -> np.ndarray:
    """Physical slot of each logical token position of one request."""
    positions = np.asarray(positions, dtype=np.int64)
    pages = np.asarray(block_table_row, dtype=np.int64)[positions // page_size]
    return pages * page_size + positions % page_size


def gather_kv(cache, fmt, block_table_row, positions, head, k_scale=None, v_scale=None):
    """Dequantised K and V (float64 ``[n, D]``) of one KV head at the given positions."""
    _, _, page, two_d = cache.shape
    slots = token_slots(block_table_row, positions, page)
    rows = cache[slots // page, head, slots % page]
    ks = 1.0 if k_scale is None else scale_at(k_scale, head, slots)
    vs = 1.0 if v_scale is None else scale_at(v_scale, head, slots)
    d = two_d // 2
    return (dequantize(rows[:, :d], fmt, np.reshape(ks, (-1, 1))),
            dequantize(rows[:, d:], fmt, np.reshape(vs, (-1, 1))))


def gather_index_keys(index_cache, fmt, block_table_row, positions) -> np.ndarray:
    """Decoded index keys (float64 ``[n, D]``) at the given logical positions."""
    page = index_cache.shape[1]
    slots = token_slots(block_table_row, positions, page)
    return decode(index_cache[slots // page, slots % page], fmt)
