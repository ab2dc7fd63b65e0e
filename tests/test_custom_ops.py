"""The kernels as torch custom ops: ``torch.library.opcheck`` passes (schema mutations
declared and real, fake kernels consistent, functionalization / aot dispatch equal to
eager), and the op writes exactly what the Python launcher writes."""

from __future__ import annotations

import pytest
import torch

from kernels import norm_rope_insert as nri
from kernels import ops
from oracle.impl_torch import device
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
