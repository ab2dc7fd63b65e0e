"""Small assertions shared by several test modules."""

import contextlib
import os
import sys

import numpy as np


def assert_close(a, b, tol=1e-12):
    """Equal up to float64 summation order (relative to the largest magnitude)."""
    a, b = np.asarray(a), np.asarray(b)
    assert a.shape == b.shape
    assert not np.isnan(a).any() and not np.isnan(b).any()
    scale = max(1.0, float(np.max(np.abs(b), initial=0.0)))
    err = float(np.max(np.abs(a - b), initial=0.0))
    assert err <= tol * scale, f"max |a - b| = {err:.3g} > {tol:.1g} * {scale:.3g}"


def same_float(a, b) -> np.ndarray:
    """Bitwise-equal values (so -0 != +0), any two NaNs equal."""
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return (a.view(np.uint64) == b.view(np.uint64)) | (np.isnan(a) & np.isnan(b))


def bad_args(good, name: str, **changes):
    """A pytest.param of (factory, name) for a bad-input test: the factory returns
    ``good()`` with the given arguments replaced (a callable change is applied to the good
    arguments); ``name`` is the argument the error must name."""
    import pytest

    def make():
        args = good()
        args.update({k: (v(args) if callable(v) else v) for k, v in changes.items()})
        return args
    return pytest.param(make, name, id=f"{name}-{'-'.join(changes)}")


def compile_env(tmp_path) -> dict:
    """Environment of a subprocess that compiles Triton kernels for a GPU on this machine:
    TRITON_INTERPRET=0 explicitly (the tests' environment carries the 1 that conftest.py
    sets without CUDA), the repo importable, a private Triton cache."""
    import os
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    return dict(os.environ, TRITON_INTERPRET="0", PYTHONPATH=str(root),
                TRITON_CACHE_DIR=str(tmp_path))


def paged_attention_inputs(positions_of, kv_fmt="bfloat16", md="bfloat16", layout="HND",
                           pad=0, scales="none", hkv=2, group=2, d=64, page=16,
                           seq_lens=(37,), k=2, seed=0) -> dict:
    """The op-independent part of a hand-built attention input set (oracle.core.cases' keys):
    requests' keys on shuffled pages, everything else (other pages, the tail of the last
    page) the format's NaN code; random float32 scales (never powers of two, k != v);
    queries at ``positions_of(seq_lens)``, selections from oracle.core.cases.random_selections
    (random sets, the query's own block always in, -1 anywhere, random order)."""
    from oracle.core import rand
    from oracle.core.cases import _scale_rows, poison_code, random_selections
    from reference.codec import round_to
    from reference.kv_cache import empty_cache, quantize

    bg = np.random.default_rng(seed)
    seq = np.asarray(seq_lens, np.int64)
    blocks = -(-seq // page)
    num_pages = int(blocks.sum()) + 2
    perm = bg.permutation(num_pages).astype(np.int32)
    table = np.full((len(seq), max(1, int(blocks.max(initial=1)))), -1, np.int32)
    used = 0
    for r, nb in enumerate(blocks):
        table[r, :nb] = perm[used:used + nb]
        used += nb
    cache = empty_cache(num_pages, hkv, page, d, kv_fmt, layout, pad,
                        fill_code=poison_code(kv_fmt))

    def scale():
        if scales == "none":
            return None
        shape = () if scales == "tensor" else (hkv, num_pages * page)
        s = np.exp(bg.uniform(np.log(0.25), np.log(4.0), shape)).astype(np.float32)
        return np.float32(s) if scales == "tensor" else s

    k_scale, v_scale = scale(), scale()
    for r, s in enumerate(seq):
        pos = np.arange(s)
        pages, offs = table[r, pos // page], pos % page
        slots = pages.astype(np.int64) * page + offs
        for h in range(hkv):
            kv = round_to(bg.normal(size=(2, s, d)), md)
            cache[pages, h, offs, :d] = quantize(kv[0], kv_fmt, _scale_rows(k_scale, h, slots))
            cache[pages, h, offs, d:] = quantize(kv[1], kv_fmt, _scale_rows(v_scale, h, slots))
    positions = positions_of(seq)
    topk = random_selections(rand.generator(seed), positions, page, hkv, k)
    q = round_to(2.5 * bg.normal(size=(len(positions), group * hkv, d)), md)
    return dict(q=q, kv_cache=cache, kv_fmt=kv_fmt, block_table=table, seq_lens=seq,
                topk=topk, k_scale=k_scale, v_scale=v_scale, model_dtype=md,
                cache_layout=layout)


def shuffled_selections(topk, seed, dup=False):
    """The same selection sets in another order with the -1 entries moved; with ``dup`` a
    valid entry of every row also overwrites one of its -1 entries (a repeat)."""
    bg = np.random.default_rng(seed)
    tk = np.array(topk, copy=True)
    for idx in np.ndindex(tk.shape[:2]):
        row = tk[idx]
        row[:] = row[bg.permutation(row.size)]
        if dup and (row >= 0).any() and (row < 0).any():
            row[np.flatnonzero(row < 0)[0]] = row[np.flatnonzero(row >= 0)[0]]
    return tk


def smallest_codes(x, seed):
    """A copy of fnuz-format attention inputs ``x`` whose key and value codes (every code
    but the NaN poison 0x80) are drawn from the subnormal and smallest normal codes of both
    signs (0x01-0x0F, 0x81-0x8F: e4m3fnuz's subnormals and first binade, e5m2fnuz's
    subnormals and first three binades): where an operand decode that flushed or rounded
    subnormals (in the conversion or in the tensor cores) would show."""
    assert x["kv_fmt"] in ("e4m3fnuz", "e5m2fnuz"), x["kv_fmt"]
    small = np.concatenate([np.arange(0x01, 0x10), np.arange(0x81, 0x90)]).astype(np.uint8)
    cache = np.asarray(x["kv_cache"])
    pick = np.random.default_rng(seed).choice(small, cache.shape)
    return dict(x, kv_cache=np.where(cache == 0x80, cache, pick).astype(np.uint8))


def poison_unselected(x, spans):
    """A copy of attention inputs ``x`` in which every block that no row of a request
    selected (through that KV head) holds NaN codes; ``spans[r]`` = (first, end) of request
    r's rows in ``topk``."""
    from oracle.core.cases import poison_code

    x = dict(x, kv_cache=np.array(x["kv_cache"], copy=True))
    cache, page = x["kv_cache"], x["kv_cache"].shape[2]
    for r, s in enumerate(x["seq_lens"]):
        lo, hi = spans[r]
        for g in range(cache.shape[1]):
            chosen = set(x["topk"][g, lo:hi].ravel().tolist())
            for b in range(-(-int(s) // page)):
                if b not in chosen:
                    cache[x["block_table"][r, b], g] = poison_code(x["kv_fmt"])
    return x


def set_entry(name, value):
    """A bad-contents change: argument ``name`` (a tensor) with ``value = (index, v)``
    written into a clone."""
    def change(a):
        t = a[name].clone()
        idx, v = value
        t[idx] = v
        return t
    return change


#: Bad host arguments both paged-attention launchers reject with a ValueError naming the
#: argument: (name, changes) pairs for ``bad_args`` (changes applied to the launcher's good
#: arguments; the args are those of kernels.attention_decode / attention_prefill).
PAGED_ATTENTION_BAD_ARGS = [
    ("q", dict(q=lambda a: a["q"].float())),
    ("q", dict(q=lambda a: a["q"][0])),
    ("q", dict(q=lambda a: a["q"][..., :48], kv_cache=lambda a: a["kv_cache"][..., :96])),
    ("q", dict(q=lambda a: a["q"].transpose(1, 2).contiguous().transpose(1, 2))),
    ("q", dict(q=lambda a: a["q"][:, :3])),
    ("q", dict(q=lambda a: a["q"].repeat(1, 9, 1))),
    ("q", dict(q=[[0.0]])),
    ("kv_cache", dict(kv_cache=lambda a: a["kv_cache"].to(torch_dtype("bfloat16")))),
    ("kv_cache", dict(kv_cache=lambda a: a["kv_cache"][..., :64])),
    ("kv_cache", dict(kv_cache=lambda a: a["kv_cache"][:, :, :, None, :])),
    ("kv_cache", dict(kv_cache=lambda a: a["kv_cache"].new_zeros(4, 2, 24, 128))),
    ("kv_cache", dict(kv_cache=lambda a: a["kv_cache"].new_zeros(4, 2, 16, 128, 2)[..., 0])),
    ("kv_fmt", dict(kv_fmt="fp8")),
    ("kv_fmt", dict(kv_fmt="e4m3")),
    ("seq_lens", dict(seq_lens=lambda a: a["seq_lens"].float())),
    ("seq_lens", dict(seq_lens=lambda a: a["seq_lens"][None])),
    ("block_table", dict(block_table=lambda a: a["block_table"].float())),
    ("block_table", dict(block_table=lambda a: a["block_table"][:1])),
    ("block_table", dict(block_table=lambda a: a["block_table"][:, :0])),
    # More than MAX_CONTEXT (2^30) tokens wide whatever the page (the kernels' int32
    # positions); a stride-0 view, no memory.
    ("block_table", dict(block_table=lambda a: a["block_table"][:, :1].expand(
        a["block_table"].shape[0], (1 << 30) + 1))),
    ("topk", dict(topk=lambda a: a["topk"].float())),
    ("topk", dict(topk=lambda a: a["topk"][:1])),
    ("topk", dict(topk=lambda a: a["topk"][:, :3])),
    ("topk", dict(topk=lambda a: a["topk"].repeat(1, 1, 33))),
    ("k_scale", dict(k_scale=lambda a: a["q"].new_ones(3, dtype=torch_dtype("float32")))),
    ("k_scale", dict(k_scale=lambda a: a["q"].new_ones((), dtype=torch_dtype("float64")))),
    ("v_scale", dict(v_scale=lambda a: a["q"].new_ones(1, 64, dtype=torch_dtype("float32")))),
    ("softmax_scale", dict(softmax_scale=0.0)),
    ("softmax_scale", dict(softmax_scale=float("nan"))),
    ("out", dict(out=lambda a: a["q"].new_empty(a["q"].shape, dtype=torch_dtype("float16")))),
    ("out", dict(out=lambda a: a["q"].new_empty(a["q"].shape)[:3])),
    ("out", dict(out=lambda a: a["q"].new_empty(a["q"].shape).transpose(1, 2).contiguous()
                 .transpose(1, 2))),
    ("validate", dict(validate=1)),
    ("num_warps", dict(num_warps=2.0)),
    ("num_stages", dict(num_stages=0)),
]


def torch_dtype(name: str):
    import torch

    return getattr(torch, name)


#: (kv_fmt, model dtype, layout, pad, scales) cases both paged-attention kernels are checked
#: on: bf16/fp16 caches, also read by the other activation dtype, the four fp8 formats,
#: HND/NHD and padded layouts, no / tensor / per-slot scales.
PAGED_ATTENTION_FORMATS = [
    ("bfloat16", "bfloat16", "HND", 0, "none"),
    ("float16", "float16", "NHD", 8, "none"),
    ("bfloat16", "float16", "HND", 8, "none"),
    ("float16", "bfloat16", "NHD", 0, "none"),
    ("e4m3fn", "bfloat16", "NHD", 0, "slot"),
    ("e4m3fn", "float16", "HND", 8, "tensor"),
    ("e5m2", "bfloat16", "HND", 8, "slot"),
    ("e5m2", "float16", "NHD", 0, "none"),
    ("e4m3fnuz", "bfloat16", "HND", 0, "slot"),
    ("e4m3fnuz", "float16", "NHD", 8, "tensor"),
    ("e5m2fnuz", "bfloat16", "NHD", 8, "tensor"),
    ("e5m2fnuz", "bfloat16", "HND", 0, "slot"),
]


def register_broken_attention(monkeypatch, name: str = "broken_torch") -> str:
    """Register (for one test) a copy of the torch attention_decode baseline that drops
    every row's first selected block: an implementation the oracle must fail."""
    import dataclasses

    from oracle.core import registry

    (torch_impl,) = registry.implementations("attention_decode", ["torch"])

    def broken(x):
        topk = np.array(x["topk"], copy=True)
        topk[..., 0] = -1
        return torch_impl.run({**x, "topk": topk})

    bad = dataclasses.replace(torch_impl, name=name, run=broken)
    monkeypatch.setitem(registry.REGISTRY["attention_decode"], name, bad)
    return name


@contextlib.contextmanager
def plugins_registered(modules: str):
    """The registry with the project's implementations and the plugin modules ``modules``
    (comma-separated, as ``$ORACLE_PLUGINS`` names them) registered; afterwards the
    registry, the variable and the modules' imports are as they were."""
    from oracle.core import registry
    from oracle.impls import catalog

    before = os.environ.pop(catalog.PLUGINS_ENV, None)
    catalog.load_all()  # the project's implementations alone first: restored as they are
    saved = {op: dict(impls) for op, impls in registry.REGISTRY.items()}
    os.environ[catalog.PLUGINS_ENV] = modules
    try:
        catalog.load_all()
        yield registry
    finally:
        registry.REGISTRY.clear()
        registry.REGISTRY.update(saved)
        if before is None:
            os.environ.pop(catalog.PLUGINS_ENV, None)
        else:
            os.environ[catalog.PLUGINS_ENV] = before
        for name in modules.split(","):
            sys.modules.pop(name.strip(), None)
