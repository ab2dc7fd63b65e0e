"""The float64 reference run on a case's input set: one function per op, in the registry's
calling convention (``run(inputs) -> outputs``, rounded outputs as codes). The checks call
these for the exact values; oracle.impls.reference registers them. Inputs are never
modified: caches are copied first."""

from __future__ import annotations

import numpy as np

from reference import attention, fused, indexer
from reference.codec import encode
from reference.norm_rope import QKVLayout


def model_codes(values, model_dtype: str) -> np.ndarray:
    """bf16/fp16 codes (uint16 bit patterns) of model-dtype values."""
    return encode(values, model_dtype, "nonsaturating")


def layout_of(x: dict) -> QKVLayout:
    return QKVLayout(x["num_q_heads"], x["num_kv_heads"], x["head_dim"],
                     x["num_index_heads"], x["has_index_k"])


def weights_of(x: dict) -> dict:
    return {kind: x[f"weights_{kind}"] for kind in ("q", "k", "index_q", "index_k")}


def _copy(a):
    return None if a is None else a.copy()


def norm_rope_insert(x: dict) -> dict:
    kv, ic = _copy(x["kv_cache"]), _copy(x["index_cache"])
    out = fused.fused_qknorm_rope_insert(
        x["rows"], x["positions"], layout_of(x), weights_of(x), x["rope_table"],
        x["rotary_dim"], x["eps"], x["model_dtype"], kv, x["kv_fmt"], x["slot_mapping"],
        x["k_scale"], x["v_scale"], ic, x["index_fmt"],
        index_slot_mapping=x.get("index_slot_mapping"))
    res = {"q": model_codes(out["q"], x["model_dtype"]),
           "k": model_codes(out["k"], x["model_dtype"]), "kv_cache": kv}
    if "index_q" in out:
        res["index_q"] = out["index_q_codes"]
    if "index_k" in out:
        res.update(index_k=model_codes(out["index_k"], x["model_dtype"]), index_cache=ic)
    return res


def reshape_and_cache(x: dict) -> dict:
    kv = x["kv_cache"].copy()
    fused.reshape_and_cache(x["k"], x["v"], kv, x["kv_fmt"], x["slot_mapping"], x["k_scale"],
                            x["v_scale"], x["model_dtype"])
    return {"kv_cache": kv}


def _indexer_args(x):
    return (x["index_q"], x["index_cache"], x["index_fmt"], x["block_table"])


def indexer_prefill(x: dict, return_scores=False):
    return indexer.indexer_prefill(*_indexer_args(x), x["cu_seqlens_q"], x["seq_lens"],
                                   x["topk"], x["local_blocks"], x["initial_blocks"],
                                   return_scores=return_scores)


def indexer_decode(x: dict, return_scores=False):
    return indexer.indexer_decode(*_indexer_args(x), x["seq_lens"], x["rows_per_request"],
                                  x["topk"], x["local_blocks"], x["initial_blocks"],
                                  return_scores=return_scores)


def attention_call(x: dict, schedule=None, return_details=False, topk=None):
    """The reference attention of a case's inputs (prefill or decode by its keys), with an
    optional schedule and selection (default: the case's own)."""
    sel = x["topk"] if topk is None else topk
    common = dict(k_scale=x["k_scale"], v_scale=x["v_scale"], schedule=schedule,
                  return_details=return_details)
    if "rows_per_request" in x:
        return attention.sparse_attention_decode(
            x["q"], x["kv_cache"], x["kv_fmt"], x["block_table"], x["seq_lens"], sel,
            x["rows_per_request"], **common)
    return attention.sparse_attention_prefill(
        x["q"], x["kv_cache"], x["kv_fmt"], x["block_table"], x["cu_seqlens_q"],
        x["seq_lens"], sel, **common)
