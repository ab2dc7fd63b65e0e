"""The fused norm + RoPE + KV insert op and the separate reshape_and_cache path (contract.md s.4).

Both write into the given (possibly strided) caches in place, as the kernels do. The two
differ in how K reaches the cache: the fused op quantises K from its exact post-RoPE value
(one rounding), ``reshape_and_cache`` from the already-rounded model-dtype K (two
roundings); on e4m3 they disagree by one code on about 3% of elements.
"""

from __future__ import annotations

import numpy as np

from reference.codec import as_float64, decode, encode, get_format
from reference.formats import INDEX_FP8_FORMATS
from reference.kv_cache import check_slots, insert_index_k, insert_kv
from reference.norm_rope import check_representable, transform_qkv_rows
from reference.platforms import check_model_dtype, is_fp8


def fused_qknorm_rope_insert(rows, positions, layout, weights, table, rotary_dim, eps,
                             model_dtype, kv_cache, kv_fmt, slot_mapping, k_scale=None,
                             v_scale=None, index_cache=None, index_fmt=None,
                             index_slot_mapping=None, skip_index=False):
    """Reference of the fused op: Gemma RMSNorm + partial NeoX RoPE of q, k, index_q and
    index_k of packed rows (``transform_qkv_rows``), then K/V into the paged KV cache and
    index_k into the index cache.

    - K is quantised from its exact post-RoPE value (``insert_kv(quantize_from="value")``),
      V from its (unchanged, model-dtype) value, each ``encode_satfinite(value / scale)``.
      A kernel evaluates K in fp32 and writes two things from it: the model-dtype K output
      and the fp8 K code. Both must be explained by ONE fp32 value (one that rounds to the
      output and encodes to the code); the oracle checks that jointly from ``k_exact`` and
      its error bound. The reference only provides ``k_exact`` and the codes of its exact
      value (``kv_cache``).
    - index_k is written at ``index_slot_mapping`` (default: ``slot_mapping``; negative
      slots skipped) in ``index_fmt``: the model dtype, or the platform's e4m3 (unit scale,
      satfinite, from the exact value). A layout with index_k needs an index cache (unless
      ``skip_index``); a layout without one (dense rows) takes none.
    - index_q is produced in the index cache's format: its model-dtype value when the index
      cache is in the model dtype, else e4m3 codes (unit scale, satfinite, from the exact
      value) and their decoded values. This follows ``index_fmt`` even with
      ``skip_index``, which only suppresses the index cache write (the cache is left
      untouched; index_q/index_k are still computed and returned).
    - N = 0 is a no-op: both caches unchanged.

    Returns a dict: everything ``transform_qkv_rows`` returns (``q``, ``k``, ``v``,
    ``index_q``, ``index_k`` rounded to the model dtype, and the ``*_exact`` values), plus
    ``index_q_fmt``, ``index_q_codes`` and ``index_q_values`` (index_q in the format the
    kernel emits it: codes and their float64 values) when the layout has index_q, and
    ``kv_cache`` / ``index_cache`` (the same arrays, written in place)."""
    model_dtype = check_model_dtype(model_dtype)
    out = transform_qkv_rows(rows, positions, layout, weights, table, rotary_dim, eps,
                             model_dtype)
    index_fmt = _check_index_fmt(index_fmt, index_cache, layout, model_dtype, skip_index)
    index_slots = slot_mapping if index_slot_mapping is None else index_slot_mapping
    if index_cache is not None and not skip_index:
        # Validate before the KV write so that bad input leaves both caches untouched.
        num_pages, page, _ = index_cache.shape
        name = "slot_mapping" if index_slot_mapping is None else "index_slot_mapping"
        check_slots(index_slots, num_pages * page, len(out["v"]), name)
    insert_kv(kv_cache, kv_fmt, out["k_exact"], out["v"], slot_mapping, k_scale, v_scale,
              quantize_from="value", model_dtype=model_dtype)
    if index_cache is not None and not skip_index:
        insert_index_k(index_cache, index_fmt, out["index_k_exact"], index_slots)
    if "index_q" in out:
        q_fmt = index_fmt if index_fmt is not None and is_fp8(index_fmt) else model_dtype
        source = out["index_q_exact"] if is_fp8(q_fmt) else out["index_q"]
        codes = encode(source, q_fmt, "satfinite" if is_fp8(q_fmt) else "nonsaturating")
        out.update(index_q_fmt=q_fmt, index_q_codes=codes, index_q_values=decode(codes, q_fmt))
    out.update(kv_cache=kv_cache, index_cache=index_cache)
    return out


def reshape_and_cache(k, v, kv_cache, kv_fmt, slot_mapping, k_scale, v_scale, model_dtype):
    """The separate (unfused) insert: k, v ``[N, Hkv, D]`` already rounded to the model
    dtype (two roundings for K: to the model dtype before, to fp8 here). Writes in place
    and returns the cache. k and v must hold model-dtype values (NaN/Inf allowed in v)."""
    model_dtype = check_model_dtype(model_dtype)
    k, v = as_float64(k, "k"), as_float64(v, "v")
    check_representable(k, "k", model_dtype)
    check_representable(v, "v", model_dtype)
    return insert_kv(kv_cache, kv_fmt, k, v, slot_mapping, k_scale, v_scale,
                     quantize_from="model_dtype", model_dtype=model_dtype)


def _check_index_fmt(index_fmt, index_cache, layout, model_dtype, skip_index):
    """The index cache's format: the model dtype or an e4m3 format (contract.md s.2, s.4)."""
    if index_cache is None and layout.has_index_k and not skip_index:
        raise ValueError("index_cache is required when the layout has index_k "
                         "(unless skip_index)")
    if index_cache is None and index_fmt is None:
        return None
    allowed = (model_dtype,) + INDEX_FP8_FORMATS
    if index_fmt not in allowed:
        raise ValueError(f"index_fmt must be one of {list(allowed)}, got {index_fmt!r}")
    if index_cache is not None:
        if not layout.has_index_k:
            raise ValueError("index_cache given but the layout has no index_k (dense rows)")
        shape = np.shape(index_cache)
        if len(shape) != 3 or shape[2] != layout.head_dim:
            raise ValueError(f"index_cache must have shape [num_pages, P, D={layout.head_dim}], "
                             f"got {shape}")
        if np.asarray(index_cache).dtype != get_format(index_fmt).code_dtype:
            raise ValueError(f"index_cache must hold {get_format(index_fmt).code_dtype.__name__}"
                             f" codes for {index_fmt}, got {np.asarray(index_cache).dtype}")
    return index_fmt
