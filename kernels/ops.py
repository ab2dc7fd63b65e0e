"""The kernels as torch custom ops (``torch.ops.attn_oracle.*``), so they compose with
torch.compile, CUDA graphs and functionalization like any aten op.

Schemas return nothing: every result is written into a tensor the caller owns and the
schema declares as mutated (the rows, whose k / index_k heads are transformed in place;
the caches; the optional q / index_q outputs; the indexers' ``topk_out``). That keeps the
ops alias-free for the compiler. Differences from the Python launchers, forced by the
schema language: scales are optional float32 tensors (no Python floats), and when the
index cache is fp8 the caller passes ``index_q_out`` (uint8 ``[N, Hi, D]``), since an op
cannot hand back a buffer it allocated while also mutating its inputs. Fake (meta) kernels
do nothing: no op allocates.
"""

from __future__ import annotations

import torch
from torch import Tensor

from kernels import attention_decode as _ad
from kernels import attention_prefill as _ap
from kernels import indexer_decode as _ixd
from kernels import indexer_prefill as _ixp
from kernels import norm_rope_insert as _nri
from kernels import reshape_and_cache as _rac
from kernels._host import INDEX_FP8_FORMATS, fail

LIB = "attn_oracle"


@torch.library.custom_op(f"{LIB}::norm_rope_insert",
                         mutates_args=("rows", "kv_cache", "index_cache", "q_out",
                                       "index_q_out"))
def norm_rope_insert(
        rows: Tensor, positions: Tensor, rope_table: Tensor, w_q: Tensor, w_k: Tensor,
        w_index_q: Tensor | None, w_index_k: Tensor | None, kv_cache: Tensor,
        slot_mapping: Tensor, k_scale: Tensor | None, v_scale: Tensor | None,
        index_cache: Tensor | None, index_slot_mapping: Tensor | None, q_out: Tensor | None,
        index_q_out: Tensor | None, num_q_heads: int, num_kv_heads: int, num_index_heads: int,
        has_index_k: bool, head_dim: int, rotary_dim: int, eps: float, kv_fmt: str,
        index_fmt: str | None, skip_index: bool = False, validate: bool = False) -> None:
    """kernels.norm_rope_insert.norm_rope_insert as a custom op (see the module docstring
    for the two differences)."""
    if (not skip_index and num_index_heads and index_fmt in INDEX_FP8_FORMATS
            and index_q_out is None):
        fail("index_q_out", "is required by the custom op when the index cache is fp8 "
                            "(uint8 [N, Hi, D])")
    _nri.norm_rope_insert(
        rows, positions, rope_table, w_q, w_k, num_q_heads=num_q_heads,
        num_kv_heads=num_kv_heads, head_dim=head_dim, rotary_dim=rotary_dim, eps=eps,
        kv_cache=kv_cache, kv_fmt=kv_fmt, slot_mapping=slot_mapping,
        num_index_heads=num_index_heads, has_index_k=has_index_k, w_index_q=w_index_q,
        w_index_k=w_index_k, k_scale=k_scale, v_scale=v_scale, index_cache=index_cache,
        index_fmt=index_fmt, index_slot_mapping=index_slot_mapping, q_out=q_out,
        index_q_out=index_q_out, skip_index=skip_index, validate=validate)


@norm_rope_insert.register_fake
def _(*args, **kwargs) -> None:
    return None


@torch.library.custom_op(f"{LIB}::reshape_and_cache", mutates_args=("kv_cache",))
def reshape_and_cache(k: Tensor, v: Tensor, kv_cache: Tensor, kv_fmt: str, slot_mapping: Tensor,
                      k_scale: Tensor | None, v_scale: Tensor | None,
                      validate: bool = False) -> None:
    """kernels.reshape_and_cache.reshape_and_cache as a custom op."""
    _rac.reshape_and_cache(k, v, kv_cache, kv_fmt, slot_mapping, k_scale, v_scale,
                           validate=validate)


@reshape_and_cache.register_fake
def _(*args, **kwargs) -> None:
    return None


@torch.library.custom_op(f"{LIB}::attention_decode", mutates_args=("out",))
def attention_decode(q: Tensor, kv_cache: Tensor, block_table: Tensor, seq_lens: Tensor,
                     topk: Tensor, out: Tensor, k_scale: Tensor | None, v_scale: Tensor | None,
                     kv_fmt: str, rows_per_request: int, softmax_scale: float | None = None,
                     blocks_per_split: int | None = None,
                     validate: bool = False) -> None:
    """kernels.attention_decode.sparse_attention_decode as a custom op writing into the
    caller's ``out`` ``[T, Hq, D]`` (its split-K workspace is allocated per call)."""
    _ad.sparse_attention_decode(q, kv_cache, kv_fmt, block_table, seq_lens, topk,
                                rows_per_request, k_scale, v_scale, softmax_scale, out,
                                blocks_per_split=blocks_per_split, validate=validate)


@attention_decode.register_fake
def _(*args, **kwargs) -> None:
    return None


@torch.library.custom_op(f"{LIB}::indexer_prefill", mutates_args=("topk_out",))
def indexer_prefill(index_q: Tensor, index_cache: Tensor, index_fmt: str, block_table: Tensor,
                    cu_seqlens_q: Tensor, seq_lens: Tensor, topk_out: Tensor, topk: int,
                    local_blocks: int = 1, initial_blocks: int = 0,
                    max_query_len: int | None = None, validate: bool = False) -> None:
    """kernels.indexer_prefill.indexer_prefill as a custom op: the selection is written into
    ``topk_out`` (int32 ``[Hi, T, K]``, any strides, e.g. a transposed token-major buffer)."""
    _ixp.indexer_prefill(index_q, index_cache, index_fmt, block_table, cu_seqlens_q, seq_lens,
                         topk=topk, local_blocks=local_blocks, initial_blocks=initial_blocks,
                         out=topk_out, max_query_len=max_query_len, validate=validate)


@indexer_prefill.register_fake
def _(*args, **kwargs) -> None:
    return None


@torch.library.custom_op(f"{LIB}::indexer_decode", mutates_args=("topk_out",))
def indexer_decode(index_q: Tensor, index_cache: Tensor, index_fmt: str, block_table: Tensor,
                   seq_lens: Tensor, topk_out: Tensor, rows_per_request: int, topk: int,
                   local_blocks: int = 1, initial_blocks: int = 0,
                   num_splits: int | None = None, validate: bool = False) -> None:
    """kernels.indexer_decode.indexer_decode as a custom op (selection into ``topk_out``)."""
    _ixd.indexer_decode(index_q, index_cache, index_fmt, block_table, seq_lens,
                        rows_per_request, topk=topk, local_blocks=local_blocks,
                        initial_blocks=initial_blocks, out=topk_out, num_splits=num_splits,
                        validate=validate)


@indexer_decode.register_fake
def _(*args, **kwargs) -> None:
    return None


@torch.library.custom_op(f"{LIB}::attention_prefill", mutates_args=("out",))
def attention_prefill(q: Tensor, kv_cache: Tensor, block_table: Tensor, cu_seqlens_q: Tensor,
                      seq_lens: Tensor, topk: Tensor, out: Tensor, k_scale: Tensor | None,
                      v_scale: Tensor | None, kv_fmt: str, softmax_scale: float | None = None,
                      validate: bool = False, predecode: bool | None = None) -> None:
    """kernels.attention_prefill.sparse_attention_prefill as a custom op writing into the
    caller's ``out`` ``[T, Hq, D]`` (model dtype, any token/head strides); ``predecode``
    as the launcher's (None: its ``default_predecode``; True: a server whose block table
    spans the whole context opts in)."""
    _ap.sparse_attention_prefill(q, kv_cache, kv_fmt, block_table, cu_seqlens_q, seq_lens,
                                 topk, k_scale, v_scale, softmax_scale, out, validate=validate,
                                 predecode=predecode)


@attention_prefill.register_fake
def _(*args, **kwargs) -> None:
    return None
