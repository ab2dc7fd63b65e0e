"""The end-to-end reference of one attention step of a sparse layer (contract.md s.3-s.6).

A batch of requests whose prefixes are already in the caches brings new tokens as packed
qkv rows ``[q | k | v | index_q | index_k]``. One step is three calls, in this order:

1. ``reference.fused.fused_qknorm_rope_insert``: Gemma RMSNorm + partial NeoX RoPE of q,
   k, index_q and index_k; K/V of every new token into the paged KV cache and its index_k
   into the index cache, at the slots the block tables give (see ``new_token_slots``).
2. the indexer (``indexer_prefill`` / ``indexer_decode``) on the index cache just written,
   with index_q as the fused op emits it in the index cache's format (``index_q_values``:
   the model-dtype value for a model-dtype index cache, ``dec(e4m3(index_q_exact))`` for
   an e4m3 one).
3. block-sparse attention (``sparse_attention_prefill`` / ``sparse_attention_decode``) of
   the model-dtype q the fused op returns (``fused["q"]``, what the kernel writes) on the
   indexer's selection ``[Hi, T, K]`` (Hi = Hkv), reading the KV cache just written.
   Always with the EXACT schedule (float64, unrounded output); with ``schedule`` given, a
   second time under that schedule (what a kernel declaring it is judged against).

Choices where contract.md is silent (all checked, ValueError naming the argument):

- Positions: prefill token i of request r is at ``seq_lens[r] - query_len[r] + i``;
  decode row j at ``seq_lens[r] - rows_per_request + j`` (as in the indexer and attention).
- Slots of the new tokens come from the block tables: position p of request r goes to
  ``block_table[r, p // P] * P + p % P`` in the KV cache and to the same formula with
  ``index_block_table`` (default: ``block_table``) in the index cache. Both caches must
  have the same page size P (a page is a sparse block of both); the index cache may have
  a different number of pages. Every block-table entry a new token writes through must be
  a page of its cache, and two new tokens may not share a slot (the fused op's rule).
- Decode padding requests (``seq_lens[r] == 0``): their rows are padding everywhere. They
  are transformed at position 0 (their fused outputs are computed but meaningless), get
  slot -1 (nothing is written), all -1 selections and zero attention outputs; their
  block-table rows are never read.
- Hi must equal Hkv and the layout must have both index parts (a dense layer has no
  indexer and is not a sparse-attention step).
- The cos/sin table must cover every position written (``table.shape[0] > max p``).
- Scales ``k_scale`` / ``v_scale`` go to both the writer and the reader (one agreed value:
  a writer/reader disagreement is a bug class the pipeline cannot express by design).
- ``validate`` is attention's content validation (block-table ranges, selection
  validity); the fused op and the indexer always validate. Bad shapes, slots, ``topk``
  and ``schedule`` are rejected before anything is written; an argument only a later
  stage checks (e.g. ``local_blocks``, ``softmax_scale``) raises after the caches were
  written.

The result (``PipelineResult``) holds every intermediate, so an implementation of any one
stage can be judged on the reference's inputs to that stage.
"""

from __future__ import annotations

import numbers
from dataclasses import dataclass

import numpy as np

from reference.attention import (
    AttentionResult,
    Schedule,
    decode_positions,
    prefill_positions,
    sparse_attention_decode,
    sparse_attention_prefill,
)
from reference.domain import DECODE_ROWS_RANGE, TOPK_RANGE, check_in_range
from reference.fused import fused_qknorm_rope_insert
from reference.indexer import IndexerResult, indexer_decode, indexer_prefill
from reference.norm_rope import QKVLayout

MODES = ("prefill", "decode")


@dataclass(frozen=True)
class PipelineResult:
    """Everything one step computed.

    mode:               "prefill" or "decode".
    requests:           int64 ``[T]``, the request of each row.
    positions:          int64 ``[T]``, the absolute position of each row, -1 for padding.
    slot_mapping:       int64 ``[T]``, the KV-cache slot written for each row (-1: none).
    index_slot_mapping: int64 ``[T]``, the same for the index cache.
    fused:              the dict ``fused_qknorm_rope_insert`` returned (q, k, v, index_q,
                        index_k and their ``*_exact`` values, index_q_fmt/codes/values,
                        and the caches, written in place).
    indexer:            the ``IndexerResult`` (topk ``[Hi, T, K]``, scores, magnitudes).
    attention:          ``AttentionResult`` under the EXACT schedule (``out`` float64,
                        unrounded; ``lse``).
    scheduled:          ``AttentionResult`` under the given schedule, or None.
    """

    mode: str
    requests: np.ndarray
    positions: np.ndarray
    slot_mapping: np.ndarray
    index_slot_mapping: np.ndarray
    fused: dict
    indexer: IndexerResult
    attention: AttentionResult
    scheduled: AttentionResult | None

    @property
    def topk(self) -> np.ndarray:
        return self.indexer.topk

    @property
    def out(self) -> np.ndarray:
        """The exact attention output ``[T, Hq, D]`` (float64)."""
        return self.attention.out


def new_token_slots(block_table, requests, positions, page_size, num_pages,
                    name="block_table") -> np.ndarray:
    """Physical slot of each row: ``block_table[r, p // P] * P + p % P`` for the row's
    request r and position p, -1 where p < 0 (padding). The block-table entries used must
    lie in ``[0, num_pages)`` (ValueError naming ``name`` otherwise). int64 ``[T]``."""
    bt = np.asarray(block_table)
    if bt.dtype.kind not in "iu" or bt.ndim != 2:
        raise ValueError(f"{name} must be a 2-D integer array, got {bt.dtype} of shape "
                         f"{bt.shape}")
    requests = np.asarray(requests, np.int64)
    positions = np.asarray(positions, np.int64)
    live = positions >= 0
    blocks = np.where(live, positions // page_size, 0)
    if live.any() and blocks[live].max() >= bt.shape[1]:
        raise ValueError(f"{name} has {bt.shape[1]} columns, too few for position "
                         f"{positions[live].max()} (page size {page_size})")
    pages = np.where(live, bt.astype(np.int64)[np.where(live, requests, 0), blocks], 0)
    bad = live & ((pages < 0) | (pages >= num_pages))
    if bad.any():
        i = int(np.argmax(bad))
        raise ValueError(f"{name}[{requests[i]}, {blocks[i]}] = {pages[i]} is not a page in "
                         f"[0, {num_pages}) but new token {i} (position {positions[i]}) is "
                         f"written there")
    return np.where(live, pages * page_size + positions % page_size, -1)


def pipeline_prefill(rows, cu_seqlens_q, seq_lens, **kwargs) -> PipelineResult:
    """``sparse_step(mode="prefill", ...)``: a ragged batch of new tokens."""
    return sparse_step("prefill", rows, seq_lens, cu_seqlens_q=cu_seqlens_q, **kwargs)


def pipeline_decode(rows, seq_lens, rows_per_request, **kwargs) -> PipelineResult:
    """``sparse_step(mode="decode", ...)``: ``rows_per_request`` (1..4) rows per request."""
    return sparse_step("decode", rows, seq_lens, rows_per_request=rows_per_request, **kwargs)


def sparse_step(mode, rows, seq_lens, *, layout, weights, table, rotary_dim, eps,
                model_dtype, kv_cache, kv_fmt, index_cache, index_fmt, block_table, topk,
                cu_seqlens_q=None, rows_per_request=None, index_block_table=None,
                k_scale=None, v_scale=None, local_blocks=1, initial_blocks=0,
                softmax_scale=None, schedule=None, validate=True) -> PipelineResult:
    """One step: fused insert -> indexer -> sparse attention (see the module docstring).

    rows               float ``[T, layout.row_width]`` packed rows (model-dtype values,
                       any strides); prefill: ragged, request-major by ``cu_seqlens_q``;
                       decode: ``[B * rows_per_request, ...]``, request-major.
    seq_lens           int ``[B]``, total tokens per request including this step's.
    layout, weights, table, rotary_dim, eps, model_dtype: as ``transform_qkv_rows``.
    kv_cache, kv_fmt   logical ``[num_pages, Hkv, P, 2*D]`` codes and their format.
    index_cache, index_fmt: ``[num_index_pages, P, D]`` codes, the model dtype or the
                       platform's e4m3.
    block_table        int ``[B, max_blocks]`` (KV cache); ``index_block_table`` the index
                       cache's own (default: ``block_table``).
    topk               K (1..64); local_blocks / initial_blocks as the indexer's.
    k_scale, v_scale   None, a scalar or ``[Hkv, num_pages*P]`` (writer and reader).
    softmax_scale, schedule, validate: as the attention's.
    cu_seqlens_q       prefill only, int ``[B+1]``; rows_per_request: decode only.

    Both caches are written in place (the prefix content is left as it was). Returns a
    ``PipelineResult``.
    """
    page = _check_step(mode, layout, topk, schedule, kv_cache, index_cache)
    seq, rows_per_request, requests, positions = _step_rows(
        mode, rows, seq_lens, cu_seqlens_q, rows_per_request)
    index_bt = block_table if index_block_table is None else index_block_table
    slots = new_token_slots(block_table, requests, positions, page, np.shape(kv_cache)[0])
    index_slots = new_token_slots(index_bt, requests, positions, page,
                                  np.shape(index_cache)[0], "index_block_table")
    fused = fused_qknorm_rope_insert(
        rows, np.maximum(positions, 0), layout, weights, table, rotary_dim, eps, model_dtype,
        kv_cache, kv_fmt, slots, k_scale=k_scale, v_scale=v_scale, index_cache=index_cache,
        index_fmt=index_fmt, index_slot_mapping=index_slots)
    index_q = fused["index_q_values"]
    if mode == "prefill":
        idx = indexer_prefill(index_q, index_cache, index_fmt, index_bt, cu_seqlens_q, seq,
                              topk, local_blocks, initial_blocks, return_scores=True)
    else:
        idx = indexer_decode(index_q, index_cache, index_fmt, index_bt, seq, rows_per_request,
                             topk, local_blocks, initial_blocks, return_scores=True)

    def attend(sched):
        common = dict(k_scale=k_scale, v_scale=v_scale, softmax_scale=softmax_scale,
                      schedule=sched, validate=validate, return_details=True)
        if mode == "prefill":
            return sparse_attention_prefill(fused["q"], kv_cache, kv_fmt, block_table,
                                            cu_seqlens_q, seq, idx.topk, **common)
        return sparse_attention_decode(fused["q"], kv_cache, kv_fmt, block_table, seq,
                                       idx.topk, rows_per_request, **common)

    exact = attend(None)
    scheduled = None if schedule is None else attend(schedule)
    return PipelineResult(mode, requests, positions, slots, index_slots, fused, idx, exact,
                          scheduled)


def _check_step(mode, layout, topk, schedule, kv_cache, index_cache) -> int:
    """The arguments the later stages would only see after the caches were written, checked
    before anything is; returns the page size."""
    if mode not in MODES:
        raise ValueError(f"mode must be one of {list(MODES)}, got {mode!r}")
    if not isinstance(layout, QKVLayout):
        raise ValueError(f"layout must be a QKVLayout, got {type(layout).__name__}")
    if not layout.has_index_k or layout.num_index_heads != layout.num_kv_heads:
        raise ValueError(f"layout must have index_k and Hi = Hkv index heads (sparse "
                         f"attention reads topk[g] for KV head g), got Hi = "
                         f"{layout.num_index_heads}, Hkv = {layout.num_kv_heads}, has_index_k"
                         f" = {layout.has_index_k}")
    if isinstance(topk, bool) or not isinstance(topk, numbers.Integral) or not (
            TOPK_RANGE[0] <= topk <= TOPK_RANGE[1]):
        raise ValueError(f"topk must be an integer in {list(TOPK_RANGE)}, got {topk!r}")
    if schedule is not None and not isinstance(schedule, Schedule):
        raise ValueError(f"schedule must be a Schedule or None, got {type(schedule).__name__}")
    kv_shape, ic_shape = np.shape(kv_cache), np.shape(index_cache)
    if len(kv_shape) != 4 or len(ic_shape) != 3:
        raise ValueError(f"kv_cache must be [num_pages, Hkv, P, 2*D] and index_cache "
                         f"[num_pages, P, D], got {kv_shape} and {ic_shape}")
    page = kv_shape[2]
    if ic_shape[1] != page:
        raise ValueError(f"index_cache page size {ic_shape[1]} must equal the KV cache's "
                         f"P = {page} (a page is a sparse block of both)")
    return page


def _step_rows(mode, rows, seq_lens, cu_seqlens_q, rows_per_request):
    """(seq_lens array, rows_per_request, request and position of each row), checked."""
    n_rows = np.shape(rows)[0] if np.ndim(rows) else 0
    seq = np.asarray(seq_lens)
    if seq.dtype.kind not in "iu" or seq.ndim != 1:
        raise ValueError(f"seq_lens must be a 1-D integer array, got {seq.dtype} of shape "
                         f"{seq.shape}")
    if seq.size and seq.min() < 0:
        raise ValueError(f"seq_lens must be >= 0, got {seq.min()}")
    if mode == "prefill":
        if rows_per_request is not None:
            raise ValueError("rows_per_request is for decode; prefill takes cu_seqlens_q")
        if cu_seqlens_q is None:
            raise ValueError("cu_seqlens_q is required in prefill")
        return (seq, rows_per_request, *prefill_positions(cu_seqlens_q, seq, n_rows))
    if cu_seqlens_q is not None:
        raise ValueError("cu_seqlens_q is for prefill; decode takes rows_per_request")
    if isinstance(rows_per_request, np.integer):
        rows_per_request = int(rows_per_request)
    check_in_range("rows_per_request", rows_per_request, *DECODE_ROWS_RANGE)
    if n_rows != seq.size * rows_per_request:
        raise ValueError(f"rows must have len(seq_lens) * rows_per_request = "
                         f"{seq.size * rows_per_request} rows, got {n_rows}")
    return (seq, rows_per_request, *decode_positions(seq, rows_per_request))
