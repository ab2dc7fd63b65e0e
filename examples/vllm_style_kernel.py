"""A kernel written in vLLM's conventions, registered with the oracle in one module.

    ORACLE_PLUGINS=examples.vllm_style_kernel oracle report --ops attention_decode \
        --impls vllm_style

``sparse_decode_attention`` is the kernel as a vLLM backend would write it, knowing nothing
of the oracle: block-sparse decode attention over a paged cache held as uint8 storage
(NHD, separate key and value caches), viewed with the torch dtype its ``kv_cache_dtype``
string resolves to on its platform; token-major top-k (valid entries first, -1 padding
last); per-tensor or per-token scales; fp32 math normalised by ``exp2(m - lse)``.
``run`` adapts a case's inputs to those conventions (``oracle.impls.conventions``) and the
output back; the registration declares where the kernel rounds (``schedule``) and its fp32
arithmetic (``arith``: the lse normalisation).
"""

from __future__ import annotations

import math

import numpy as np
import torch

from oracle.core.bounds import Fp32Arith
from oracle.core.registry import Implementation, register
from oracle.impls import conventions as cv
from reference.attention import Schedule, decode_positions


def _dequant(cache: torch.Tensor, dtype: torch.dtype, scale, act: torch.dtype):
    """vLLM's dequantisation: the code converted to act, times the fp32 scale, in act."""
    x = cache.view(torch.uint8).view(dtype).to(act)
    return x if scale is None else (x.float() * scale).to(act)


def _attend(q, k, v, softmax_scale: float) -> torch.Tensor:
    """fp32 attention of q ``[G, D]`` over k, v ``[n, D]``: base-2 logits, running max m,
    ``out = (P @ V) * exp2(m - lse)`` with ``lse = m + log2(l)`` (no division)."""
    s2 = (q.float() @ k.float().T) * (softmax_scale * math.log2(math.e))
    m = s2.amax(dim=-1, keepdim=True)
    p = torch.exp2(s2 - m)
    lse = m + torch.log2(p.sum(dim=-1, keepdim=True))
    return (p @ v.float()) * torch.exp2(m - lse)


def sparse_decode_attention(query, key_cache, value_cache, block_table, seq_lens, positions,
                            requests, topk_indices, kv_cache_dtype: str, platform: str,
                            k_scale=None, v_scale=None, softmax_scale=None) -> torch.Tensor:
    """query ``[T, Hq, D]``; key/value_cache ``[blocks, P, Hkv, D]`` (NHD, 1-byte storage
    for fp8); ``topk_indices`` int32 ``[T, Hkv, K]`` of logical blocks, -1 padding last;
    row t is request ``requests[t]`` at ``positions[t]`` (-1: a padding row, zeros);
    scales None, 0-d, or per token ``[blocks * P, Hkv]``."""
    act = query.dtype
    dtype = cv.resolve_kv_cache_dtype(kv_cache_dtype, platform, str(act).split(".")[-1])
    t_rows, hq, d = query.shape
    page, hkv = key_cache.shape[1], key_cache.shape[2]
    grp = hq // hkv
    scale = softmax_scale or 1.0 / math.sqrt(d)
    out = torch.zeros((t_rows, hq, d), dtype=torch.float32)
    for t in range(t_rows):
        pos, r = int(positions[t]), int(requests[t])
        if pos < 0:
            continue
        for g in range(hkv):
            sel = topk_indices[t, g]
            blocks = torch.unique(sel[(sel >= 0) & (sel <= pos // page)])
            keys = (blocks[:, None] * page + torch.arange(page)).reshape(-1)
            keys = keys[(keys <= pos) & (keys < int(seq_lens[r]))]
            if not keys.numel():
                continue
            slots = block_table[r, keys // page].long() * page + keys % page
            ks = k_scale if k_scale is None or k_scale.ndim == 0 else k_scale[slots, g, None]
            vs = v_scale if v_scale is None or v_scale.ndim == 0 else v_scale[slots, g, None]
            k = _dequant(key_cache[slots // page, slots % page, g], dtype, ks, act)
            v = _dequant(value_cache[slots // page, slots % page, g], dtype, vs, act)
            out[t, g * grp:(g + 1) * grp] = _attend(query[t, g * grp:(g + 1) * grp], k, v,
                                                    scale)
    return out.to(act)


def make_run(platform_of=None):
    """The adapter: a case's inputs in vLLM's conventions, the kernel, the output as codes.
    ``platform_of(fmt)``: the platform the kernel is told it runs on (default: the one
    whose ``kv_cache_dtype`` resolves to the case's storage format)."""

    def run(x: dict) -> dict:
        md, fmt = x["model_dtype"], x["kv_fmt"]
        kv_cache_dtype, platform = cv.vllm_kv_cache_dtype(fmt, md)
        platform = platform_of(fmt) if platform_of else platform
        key_cache, value_cache = cv.split_kv_cache(x["kv_cache"], fmt, "NHD")
        hkv, slots = x["kv_cache"].shape[1], x["kv_cache"].shape[0] * x["kv_cache"].shape[2]
        form = "token" if np.ndim(x["k_scale"]) == 2 else "tensor"
        requests, positions = decode_positions(x["seq_lens"], x["rows_per_request"])
        topk = cv.order_selection(cv.topk_layout(x["topk"], "token"), "valid_first")
        out = sparse_decode_attention(
            torch.from_numpy(np.asarray(x["q"], np.float64)).to(cv.torch_dtype(md)),
            key_cache, value_cache, torch.from_numpy(np.asarray(x["block_table"])),
            np.asarray(x["seq_lens"]), positions, requests, topk, kv_cache_dtype, platform,
            cv.scale_form(x["k_scale"], form, hkv, slots),
            cv.scale_form(x["v_scale"], form, hkv, slots))
        return {"out": cv.output_codes(out, md)}

    return run


def _arith(x: dict) -> Fp32Arith:
    # Declared per case (Implementation.arith may be a callable): the same fp32 functions
    # for every case here; a kernel whose exp2 or log2 differs by format would branch on x.
    return Fp32Arith(normalise="lse")


def implementation(name: str, platform_of=None, notes: str = "") -> Implementation:
    """The registry entry of the kernel under ``name`` (CPU only: plain torch)."""
    return Implementation(
        name, "attention_decode", make_run(platform_of), devices=("cpu",),
        shape_classes=("tiny", "small"), arith=_arith,
        schedule=lambda md, case=None: Schedule(kv_dtype=md, out_dtype=md),
        notes=notes or "vLLM conventions: uint8 caches viewed by kv_cache_dtype, lse "
                       "normalisation (examples/vllm_style_kernel.py)")


register(implementation("vllm_style"))
