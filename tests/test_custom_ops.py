"""The kernels as torch custom ops: ``torch.library.opcheck`` passes (schema mutations
declared and real, fake kernels consistent, functionalization / aot dispatch equal to
eager), and the op writes exactly what the Python launcher writes."""

from __future__ import annotations

import pytest
import torch

from kernels import norm_rope_insert as nri
from kernels import ops
from oracle.impls.torch_peer import device
from tests.test_kernel_norm_rope_insert import _good_args

pytestmark = pytest.mark.interp

_OP_ORDER = ("rows", "positions", "rope_table", "w_q", "w_k", "w_index_q", "w_index_k",
             "kv_cache", "slot_mapping", "k_scale", "v_scale", "index_cache",
             "index_slot_mapping", "q_out", "index_q_out", "num_q_heads", "num_kv_heads",
             "num_index_heads", "has_index_k", "head_dim", "rotary_dim", "eps", "kv_fmt",
             "index_fmt")


def _op_args(kv_fmt, q_out, scales):
    a = _good_args(kv_fmt=kv_fmt)
    n, dev = a["rows"].shape[0], a["rows"].device
    a.update(k_scale=None, v_scale=None, index_slot_mapping=None, q_out=None, index_q_out=None)
    if scales:
        a["k_scale"] = torch.tensor(0.37, device=dev)
        a["v_scale"] = torch.full((1, a["kv_cache"].shape[0] * a["kv_cache"].shape[2]), 1.7,
                                  device=dev)
    if q_out:
        a["q_out"] = torch.zeros(a["num_q_heads"], n, 64, dtype=a["rows"].dtype,
                                 device=dev).transpose(0, 1)
    if a["index_fmt"] == "e4m3fn":
        a["index_q_out"] = torch.zeros(n, 1, 64, dtype=torch.uint8, device=dev)
    return tuple(a[k] for k in _OP_ORDER)


@pytest.mark.parametrize("kv_fmt, q_out, scales", [
    ("e4m3fn", False, True), ("bfloat16", True, False), ("e5m2fnuz", True, True)])
def test_norm_rope_insert_passes_opcheck(kv_fmt, q_out, scales):
    """opcheck's schema, autograd-registration, fake-tensor and aot-dispatch tests pass for
    fp8 and bf16 caches, q in place and to a strided q_out, with and without scales."""
    torch.library.opcheck(ops.norm_rope_insert, _op_args(kv_fmt, q_out, scales))


def test_op_writes_what_the_launcher_writes():
    """The custom op and the Python launcher, on copies of the same inputs, leave
    bit-identical rows, caches and index_q."""
    args = _op_args("e4m3fn", True, True)
    copy = [a.clone() if isinstance(a, torch.Tensor) else a for a in args]
    torch.ops.attn_oracle.norm_rope_insert(*args)
    kw = dict(zip(_OP_ORDER, copy))
    pos = [kw.pop(k) for k in ("rows", "positions", "rope_table", "w_q", "w_k")]
    nri.norm_rope_insert(*pos, **kw)
    for name, a, b in zip(_OP_ORDER, args, [pos[0], *copy[1:]]):
        if isinstance(a, torch.Tensor):
            a8, b8 = (t.reshape(-1).view(torch.uint8) for t in (a, b))
            assert torch.equal(a8, b8), name


def test_op_requires_index_q_out_for_an_fp8_index_cache():
    """The op cannot return a buffer it allocates: with an fp8 index cache and no
    index_q_out it raises ValueError naming index_q_out."""
    args = list(_op_args("e4m3fn", False, False))
    args[_OP_ORDER.index("index_q_out")] = None
    with pytest.raises(ValueError, match=r"^index_q_out\b"):
        ops.norm_rope_insert(*args)


@pytest.mark.parametrize("kv_fmt, scales", [("e4m3fn", True), ("bfloat16", False),
                                            ("e4m3fnuz", True)])
def test_reshape_and_cache_passes_opcheck(kv_fmt, scales):
    """opcheck passes for the two-rounding insert (fp8 native and fnuz, bf16 cache)."""
    dev = device()
    n, hkv, d, page, pages = 5, 2, 64, 16, 3
    k = torch.randn(n, hkv, d).to(torch.bfloat16).to(dev)
    v = torch.randn(n, hkv, d).to(torch.bfloat16).to(dev)
    dtype = torch.bfloat16 if kv_fmt == "bfloat16" else torch.uint8
    cache = torch.zeros(pages, hkv, page, 2 * d, dtype=dtype, device=dev)
    slots = torch.tensor([3, -1, 17, 40, 8], device=dev)
    ks = torch.tensor(0.5, device=dev) if scales else None
    vs = torch.full((hkv, pages * page), 2.0, device=dev) if scales else None
    torch.library.opcheck(ops.reshape_and_cache, (k, v, cache, kv_fmt, slots, ks, vs))


def _decode_op_args(kv_fmt, scales, bps):
    from tests.test_kernel_attention_decode import _good_args as decode_args

    a = decode_args(kv_fmt)
    dev = a["q"].device
    n_slots = a["kv_cache"].shape[0] * a["kv_cache"].shape[2]
    ks = vs = None
    if scales:
        ks = torch.tensor(0.37, device=dev)
        vs = torch.rand(a["kv_cache"].shape[1], n_slots, device=dev) + 0.5
    out = torch.zeros(a["q"].shape[1], a["q"].shape[0], a["q"].shape[2], dtype=a["q"].dtype,
                      device=dev).transpose(0, 1)
    return (a["q"], a["kv_cache"], a["block_table"], a["seq_lens"], a["topk"], out, ks, vs,
            kv_fmt, a["rows_per_request"], None, bps)


@pytest.mark.parametrize("kv_fmt, scales, bps", [("e4m3fn", True, 1), ("bfloat16", False, 4),
                                                 ("e5m2fnuz", True, 2)])
def test_attention_decode_passes_opcheck(kv_fmt, scales, bps):
    """opcheck passes for decode attention into a preallocated strided output: fp8 native
    and fnuz with per-slot and scalar scales, a bf16 cache, split-K (merged) and direct."""
    torch.library.opcheck(ops.attention_decode, _decode_op_args(kv_fmt, scales, bps))


def test_attention_decode_op_writes_what_the_launcher_returns():
    """The custom op writes into ``out`` exactly what the Python launcher returns."""
    from kernels import attention_decode as ad

    args = _decode_op_args("e4m3fn", True, 1)
    torch.ops.attn_oracle.attention_decode(*args)
    q, kv, bt, seq, tk, out, ks, vs, fmt, rows, _, bps = args
    want = ad.sparse_attention_decode(q, kv, fmt, bt, seq, tk, rows, ks, vs,
                                      blocks_per_split=bps)
    assert torch.equal(out.view(torch.int16), want.view(torch.int16))


def _indexer_op_args(decode_op, fmt, token_major):
    from tests.test_kernel_indexer import _launch_args, make_index_inputs

    kw = dict(rows=2) if decode_op else dict(qlens=(3, 4))
    x = make_index_inputs(fmt, seq_lens=(40, 20), topk=3, local=1, initial=1, seed=21, **kw)
    args = _launch_args(x, device())
    t, hi = args[0].shape[:2]
    if token_major:
        out = torch.full((t, hi, 3), -7, dtype=torch.int32, device=device()).transpose(0, 1)
    else:
        out = torch.full((hi, t, 3), -7, dtype=torch.int32, device=device())
    if decode_op:  # (q, cache, fmt, table, seq_lens, rows) -> the op's order
        q, ic, f, bt, seq, rows = args
        return (q, ic, f, bt, seq, out, rows, 3, 1, 1, 2)
    return (*args, out, 3, 1, 1, 4)


@pytest.mark.parametrize("decode_op, fmt, token_major", [
    (False, "e4m3fn", True), (False, "bfloat16", False), (True, "e4m3fnuz", True),
    (True, "float16", False)])
def test_indexer_ops_pass_opcheck(decode_op, fmt, token_major):
    """opcheck passes for the prefill and decode indexers (fp8 and 16-bit index caches,
    a head-major or a transposed token-major topk_out; decode with two key-block splits)."""
    op = ops.indexer_decode if decode_op else ops.indexer_prefill
    torch.library.opcheck(op, _indexer_op_args(decode_op, fmt, token_major))


def test_indexer_ops_write_what_the_launchers_write():
    """Each indexer op and its Python launcher, on the same inputs, write identical
    selections into their outputs (every cell written)."""
    from kernels import indexer_decode as idd
    from kernels import indexer_prefill as ipf

    for decode_op in (False, True):
        args = _indexer_op_args(decode_op, "e4m3fn", True)
        (torch.ops.attn_oracle.indexer_decode if decode_op
         else torch.ops.attn_oracle.indexer_prefill)(*args)
        if decode_op:
            q, ic, f, bt, seq, out, rows = args[:7]
            want = idd.indexer_decode(q, ic, f, bt, seq, rows, topk=3, local_blocks=1,
                                      initial_blocks=1, num_splits=2)
        else:
            out = args[6]
            want = ipf.indexer_prefill(*args[:6], topk=3, local_blocks=1, initial_blocks=1)
        assert torch.equal(out, want) and not (out == -7).any()


def _prefill_op_args(kv_fmt, scales, strided_out):
    from tests.test_kernel_attention_prefill import _good_args as prefill_args

    a = prefill_args(kv_fmt)
    dev = a["q"].device
    n_slots = a["kv_cache"].shape[0] * a["kv_cache"].shape[2]
    ks = vs = None
    if scales:
        ks = torch.tensor(0.37, device=dev)
        vs = torch.rand(a["kv_cache"].shape[1], n_slots, device=dev) + 0.5
    t, hq, d = a["q"].shape
    out = (torch.zeros(hq, t, d, dtype=a["q"].dtype, device=dev).transpose(0, 1)
           if strided_out else torch.zeros(t, hq, d, dtype=a["q"].dtype, device=dev))
    return (a["q"], a["kv_cache"], a["block_table"], a["cu_seqlens_q"], a["seq_lens"],
            a["topk"], out, ks, vs, kv_fmt, None)


@pytest.mark.parametrize("kv_fmt, scales, strided_out", [("e4m3fn", True, True),
                                                         ("bfloat16", False, False),
                                                         ("e5m2fnuz", True, False)])
def test_attention_prefill_passes_opcheck(kv_fmt, scales, strided_out):
    """opcheck passes for prefill attention into a preallocated output (contiguous or a
    head-major buffer seen token-major): fp8 native and fnuz with scalar and per-slot
    scales, and a bf16 cache."""
    torch.library.opcheck(ops.attention_prefill, _prefill_op_args(kv_fmt, scales, strided_out))


def test_attention_prefill_op_writes_what_the_launcher_returns():
    """The custom op writes into ``out`` exactly what the Python launcher returns."""
    from kernels import attention_prefill as apf

    args = _prefill_op_args("e4m3fn", True, True)
    torch.ops.attn_oracle.attention_prefill(*args)
    q, kv, bt, cu, seq, tk, out, ks, vs, fmt, _ = args
    want = apf.sparse_attention_prefill(q, kv, fmt, bt, cu, seq, tk, ks, vs)
    assert torch.equal(out.view(torch.int16), want.view(torch.int16))


def test_attention_prefill_op_passes_predecode_through():
    """The op's ``predecode`` reaches the launcher: True with scalar scales writes what the
    launcher returns with it, and True with per-slot scales is refused with a ValueError
    naming it."""
    from kernels import attention_prefill as apf

    args = list(_prefill_op_args("e4m3fn", True, False))
    with pytest.raises(ValueError, match="predecode"):
        torch.ops.attn_oracle.attention_prefill(*args, False, True)
    args[8] = torch.tensor(0.61, device=args[0].device)  # a scalar v_scale
    torch.ops.attn_oracle.attention_prefill(*args, False, True)
    q, kv, bt, cu, seq, tk, out, ks, vs, fmt, _ = args
    want = apf.sparse_attention_prefill(q, kv, fmt, bt, cu, seq, tk, ks, vs, predecode=True)
    assert torch.equal(out.view(torch.int16), want.view(torch.int16))
