"""The kernels' adapters: each wraps a launcher (a Triton kernel's, the CUDA kernel's, or a
patched copy's for the mutants) as ``run(inputs) -> outputs`` over a case's numpy inputs,
with impl_torch's input/output conventions (oracle/impls/torch_peer.py): numpy codes out,
the inputs never modified. The tensors reach the launchers the way servers hold them
(padded strides, transposed views, int32 tables), so the differential cases exercise the
launchers' stride handling too.
"""

from __future__ import annotations

import numpy as np
import torch

from oracle.impls.io import (
    HALF_DTYPES,
    codes_of,
    device,
    ints_in,
    scale_in,
    strided_codes_in,
    values,
)
from reference.codec import encode

# ------------------------------------------------------------------------- insert ops


def insert_adapter(launch):
    """The adapter of op ``norm_rope_insert`` for a launcher with the signature of
    ``kernels.norm_rope_insert.norm_rope_insert`` (Triton and CUDA share it). The rows
    arrive as a column slice of a wider buffer (as servers pass them); q goes to a separate
    strided output when N is odd and stays in place otherwise."""

    def run(inputs: dict, validate: bool = True) -> dict:
        x = inputs
        dev = device()
        md = x["model_dtype"]
        act = HALF_DTYPES[md]
        d = x["head_dim"]
        rows_np = x["rows"]
        n, width = rows_np.shape
        buf = torch.zeros((n, width + 16), dtype=act, device=dev)
        rows = buf[:, 8:8 + width]
        rows.copy_(values(rows_np, act, dev))
        q_out = None
        if n % 2:
            q_out = torch.zeros((x["num_q_heads"], n, d), dtype=act, device=dev).transpose(0, 1)
        kv_fmt, index_fmt = x["kv_fmt"], x["index_fmt"]
        kv = strided_codes_in(x["kv_cache"], dev, HALF_DTYPES.get(kv_fmt))
        ic = None
        if x.get("index_cache") is not None:
            ic = strided_codes_in(x["index_cache"], dev, act if index_fmt == md else None)

        w = {kind: values(x[f"weights_{kind}"], act, dev)
             for kind in ("q", "k", "index_q", "index_k")}
        islots = x.get("index_slot_mapping")
        out = launch(
            rows, ints_in(x["positions"], dev), values(x["rope_table"], act, dev), w["q"],
            w["k"], num_q_heads=x["num_q_heads"], num_kv_heads=x["num_kv_heads"], head_dim=d,
            rotary_dim=x["rotary_dim"], eps=x["eps"], kv_cache=kv, kv_fmt=kv_fmt,
            slot_mapping=ints_in(x["slot_mapping"], dev), num_index_heads=x["num_index_heads"],
            has_index_k=x["has_index_k"], w_index_q=w["index_q"], w_index_k=w["index_k"],
            k_scale=scale_in(x["k_scale"], dev), v_scale=scale_in(x["v_scale"], dev),
            index_cache=ic, index_fmt=index_fmt if ic is not None else None, q_out=q_out,
            index_slot_mapping=None if islots is None else ints_in(islots, dev),
            validate=validate)
        res = {key: codes_of(t) for key, t in out.items()}
        res["kv_cache"] = codes_of(kv)
        if ic is not None:
            res["index_cache"] = codes_of(ic)
        return res

    return run


def _strided_heads(vals, act, dev, transposed):
    """K or V on the device with non-trivial strides, as servers pass them: a head-major
    buffer seen token-major (``transposed``), or heads padded by 8 elements."""
    n, hkv, d = vals.shape
    t = values(vals, act, dev)
    if transposed:
        out = torch.zeros((hkv, n, d), dtype=act, device=dev).transpose(0, 1)
    else:
        out = torch.zeros((n, hkv, d + 8), dtype=act, device=dev)[..., 4:4 + d]
    out.copy_(t)
    return out


def reshape_and_cache_adapter(launch):
    """The adapter of op ``reshape_and_cache`` for a launcher with the signature of
    ``kernels.reshape_and_cache.reshape_and_cache``. K has padded head strides; V is
    head-major when N is odd, padded otherwise."""

    def run(inputs: dict, validate: bool = True) -> dict:
        x = inputs
        dev = device()
        act = HALF_DTYPES[x["model_dtype"]]
        k = _strided_heads(np.asarray(x["k"]), act, dev, transposed=False)
        v = _strided_heads(np.asarray(x["v"]), act, dev, transposed=k.shape[0] % 2 == 1)
        kv_fmt = x["kv_fmt"]
        kv = strided_codes_in(x["kv_cache"], dev, HALF_DTYPES.get(kv_fmt))
        launch(k, v, kv, kv_fmt, ints_in(x["slot_mapping"], dev),
               scale_in(x["k_scale"], dev), scale_in(x["v_scale"], dev), validate=validate)
        return {"kv_cache": codes_of(kv)}

    return run


# ----------------------------------------------------------------------------- indexers


def index_q_in(vals: np.ndarray, fmt: str, dev) -> torch.Tensor:
    """index_q values (float64, exactly representable in fmt) as the kernels take them:
    uint8 fp8 codes, or the bf16/fp16 tensor; rows arrive with a padded head stride."""
    t, hi, d = vals.shape
    if fmt in HALF_DTYPES:
        src = values(vals, HALF_DTYPES[fmt], dev)
    else:
        src = torch.from_numpy(np.ascontiguousarray(encode(vals, fmt, "satfinite"))).to(dev)
    buf = torch.zeros((t, hi, d + 16), dtype=src.dtype, device=dev)[..., 8:8 + d]
    buf.copy_(src)
    return buf


def out_buffer(hi, t, k, dev, token_major: bool) -> torch.Tensor:
    """A [Hi, T, K] int32 output prefilled with a sentinel (-7: never a valid entry), either
    head-major or a transposed view of a token-major [T, Hi, K] buffer (as servers pass)."""
    if token_major:
        return torch.full((t, hi, k), -7, dtype=torch.int32, device=dev).transpose(0, 1)
    return torch.full((hi, t, k), -7, dtype=torch.int32, device=dev)


def indexer_adapter(launch, decode: bool):
    """The adapter of op ``indexer_prefill`` / ``indexer_decode`` (index_q as values; codes
    for the cache), returning ``{"topk": int32 [Hi, T, K]}``. The output is a transposed
    token-major buffer when T is odd and head-major otherwise."""

    def run(inputs: dict, validate: bool = True) -> dict:
        x = inputs
        dev = device()
        fmt = x["index_fmt"]
        q = index_q_in(np.asarray(x["index_q"], np.float64), fmt, dev)
        ic = strided_codes_in(x["index_cache"], dev, HALF_DTYPES.get(fmt))
        bt, seq = ints_in(x["block_table"], dev), ints_in(x["seq_lens"], dev)
        t, hi, _ = q.shape
        k = int(x["topk"])
        out = out_buffer(hi, t, k, dev, token_major=t % 2 == 1)
        common = dict(topk=k, local_blocks=int(x["local_blocks"]),
                      initial_blocks=int(x["initial_blocks"]), out=out, validate=validate)
        if decode:
            launch(q, ic, fmt, bt, seq, int(x["rows_per_request"]), **common)
        else:
            cu_np = np.asarray(x["cu_seqlens_q"], np.int64)
            cu = ints_in(x["cu_seqlens_q"], dev)
            launch(q, ic, fmt, bt, cu, seq, max_query_len=int(np.diff(cu_np).max(initial=0)),
                   **common)
        return {"topk": out.cpu().numpy().astype(np.int32)}

    return run


# ---------------------------------------------------------------------------- attention


def adapter_tensors(x: dict):
    """A case's inputs as the attention kernels take them, the way servers hold them: q
    with padded head strides, the cache in its format's storage (through strides), topk as
    the transposed view of a token-major ``[T, Hkv, K]`` int32 buffer, the block table as
    int32, the scales, and a zeroed output seen token-major through a head-major buffer.
    Returns ``(q, kv, topk, block_table, k_scale, v_scale, out, dev)``."""
    dev = device()
    act = HALF_DTYPES[x["model_dtype"]]
    q_np = np.asarray(x["q"])
    t, hq, d = q_np.shape
    q = torch.zeros((t, hq, d + 8), dtype=act, device=dev)[..., 4:4 + d]
    q.copy_(values(q_np, act, dev))
    kv = strided_codes_in(x["kv_cache"], dev, HALF_DTYPES.get(x["kv_fmt"]))
    tk_np = np.asarray(x["topk"])
    topk = torch.from_numpy(np.ascontiguousarray(tk_np.transpose(1, 0, 2), np.int32)).to(dev)
    bt = ints_in(x["block_table"], dev)
    out = torch.zeros((hq, t, d), dtype=act, device=dev).transpose(0, 1)
    return (q, kv, topk.permute(1, 0, 2), bt, scale_in(x["k_scale"], dev),
            scale_in(x["v_scale"], dev), out, dev)


def attention_decode_adapter(launch):
    """The adapter of op ``attention_decode`` for a launcher with the signature of
    ``kernels.attention_decode.sparse_attention_decode``: q with padded head strides, topk
    as the transposed view of a token-major buffer, the block table as int32 and the output
    through a padded strided view; ``workspace`` and the knobs as the launcher's."""

    def run(inputs: dict, validate: bool = True, blocks_per_split: int | None = None,
            workspace=None, block_keys: int | None = None,
            key_streams: int | None = None) -> dict:
        q, kv, topk, bt, ks, vs, out, dev = adapter_tensors(inputs)
        launch(q, kv, inputs["kv_fmt"], bt, ints_in(inputs["seq_lens"], dev), topk,
               int(inputs["rows_per_request"]), ks, vs, out=out,
               blocks_per_split=blocks_per_split, validate=validate, block_keys=block_keys,
               key_streams=key_streams, workspace=workspace)
        return {"out": codes_of(out)}

    return run


def attention_prefill_adapter(launch):
    """The adapter of op ``attention_prefill`` for a launcher with the signature of
    ``kernels.attention_prefill.sparse_attention_prefill``: as the decode's, cu_seqlens_q
    as int32, seq_lens as int64, the output through a head-major buffer seen token-major,
    and the kernel's ``schedule_rows``; knobs: the launcher's tuning keywords."""

    def run(inputs: dict, validate: bool = True, **knobs) -> dict:
        q, kv, topk, bt, ks, vs, out, dev = adapter_tensors(inputs)
        cu = ints_in(inputs["cu_seqlens_q"], dev)
        rows = torch.zeros(q.shape[:2], dtype=torch.int32, device=dev)
        launch(q, kv, inputs["kv_fmt"], bt, cu, ints_in(inputs["seq_lens"], dev), topk, ks, vs,
               out=out, validate=validate, schedule_rows=rows, **knobs)
        return {"out": codes_of(out), "schedule_rows": rows.cpu().numpy()}

    return run
