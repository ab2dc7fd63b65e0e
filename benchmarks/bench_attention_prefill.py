"""Speed of the block-sparse GQA prefill attention:
kernels.attention_prefill.sparse_attention_prefill at the model shape, against compiled
flex_attention on the same selections.

Shape: Hq 64, Hkv 4 (G 16), D 128, P 128, K 16 selected blocks per (token, KV head)
(reference.domain.MODEL); one request of 8,192 new tokens on an 8,192-token prefix
(``seq_lens [16384]``, ``cu_seqlens_q [0, 8192]``: positions 8192 .. 16383, own blocks
64 .. 127, 65 .. 128 visible blocks); bf16 model dtype (q ``[T, Hq, D]``, out). Caches
(logical ``[pages, Hkv, P, 2D]``, contiguous, the HND layout): ``bf16`` and ``e4m3fn``
(uint8 codes with a scalar scale 1.0, a 0-d float32 tensor, as bench_attention_decode).
Content N(0, 1) (torch's cast for fp8). The request's 128 pages are drawn at random from a
pool twice the size needed (harness.shuffled_block_table). Selections are held in a
token-major ``[T, Hkv, K]`` int32 buffer passed as its transposed ``[Hkv, T, K]`` view, as
servers keep it, entries in random order, -1 only as padding (where fewer blocks exist):
- ``random`` (``random_selections``, bench_attention_decode's): per (token, KV head) the
  token's own block plus K - 1 distinct random earlier (visible) blocks;
- ``locality`` (``locality_selections``): per (token, KV head) the own block, the
  ``recent`` = 11 blocks before it, and ``far`` = 4 distinct blocks shared by every token
  of a 128-token tile (``FAR_TILE``, counted from the first new token) and drawn per (tile,
  KV head) uniformly among the blocks wholly inside the prefix that lie before the recent
  window of the tile's first token (blocks ``< min(prefix // P, own_first - recent)``: never
  a repeat of a recent block of any token of the tile). ``locality_split``: far = K // 4 (at
  least 1), recent = K - 1 - far; fewer blocks where fewer exist (-1 padding).
Selections depend only on the seed and the distribution, not on the cache, so both caches
see the same selections. At the model shape both distributions select exactly K full
blocks per (token, KV head), the own one cut causally.

Work counted (``key_counts``, exactly, from the selections, on the device; the NumPy twin
``key_counts_reference`` is checked by tests/test_bench_sparse.py):
- keys attended: per (token, KV head) the keys ``j <= p`` of the token's valid selected
  blocks (a set: negative entries, entries past ``p // P`` and repeats dropped), summed;
  at the model shape 4 x (8192 x 15 x 128 + 64 x (1 + ... + 128)) = 65,028,096 for both
  distributions;
- useful FLOPs = 4 x D x G x keys attended (= 4 Hq D keys per token, QK^T and PV, summed
  over tokens): 532,710,162,432 at the model shape; ``useful_tflops`` = that / median;
- gathered bytes = keys attended x 2D x element bytes (the K and V rows the attention of
  every (token, KV head) reads, whatever the kernel shares between tokens): 33.3 GB bf16,
  16.6 GB e4m3 at the model shape; ``gathered_bytes_per_s`` = that / median;
- minimal bytes (``minimal_bytes``, every input byte read once, every output byte written
  once; ``min_bytes``, what sizes the input rotation): K and V of every key some token
  attends, once per KV head (all 4 x 16,384 keys for random selections, nearly all for
  locality), q and out T x Hq x D x 2, selections T x Hkv x K x 4, the block table, seq_lens
  and cu_seqlens_q. The kernel is compute bound: the table shows no copy fraction.

Peer: flex_attention (``torch.compile(flex_attention)``, static shapes; flex's own kernel
options unless ``--flex-knobs``) on the same selections, its inputs built with
oracle/impls/flex.py: ``gather_kv`` (the request's pages dequantised to bf16 into
contiguous K, V ``[1, Hkv, S, D]``, keys no token sees zeroed), ``selection_mask`` and
``build_block_mask`` (query blocks of 128 tokens, key blocks of P; ``mask_mod`` = selection
& causal; the blocks where it holds for every row and key marked "full", so flex skips
``mask_mod`` there: its fastest correct form; ``--flex-partial`` gives the all-partial
mask of the registered implementation, much slower); q copied to a contiguous
``[1, Hq, T, D]``. Flex's time EXCLUDES its compile
time (a warm-up call first; ``compile_s`` records it), the paged-to-contiguous gather and
dequantisation, and the BlockMask build: it is timed on K/V already gathered and a mask
already built (said in every result's ``flex.excluded`` and in the report's notes). Flex
reads bf16 K/V for both caches. ``vs_flex`` = flex median / Triton median (> 1: Triton is
faster); ``max_abs_diff_vs_flex``: the largest |difference| of the two outputs on the
first input set.

Timing: harness.py (CUDA-graph replay over rotating input sets touching > 2 x L2: one set
at the model shape; a call that cannot be captured is timed eagerly and says so in its
``mode``/``note``), for both the kernel and flex; the copy bandwidth measured in the same
run. Each result records whether the first set's output is finite (``finite_output``).
``--rounds N`` times every configuration N times in turn (round-robin) and merges them
(``merge_rounds``): medians over the rounds, and each check the median of its per-round
values, so that a ratio compares two times of one round. Why: the wide pass's run-to-run
spread (a few percent) exceeds the e4m3fn / bf16 gap at locality, and a slow round
slows both caches alike.

Targets and checks (``checks``):
- locality selections at least as fast as flex_attention (``vs_flex`` >= 1), each cache;
- random selections at least 150 TFLOP/s useful, each cache;
- e4m3fn at least as fast as bf16 on both distributions (``vs_bf16`` = bf16 median / e4m3
  median >= 1).
For scale (the published numbers on the H200 at this shape, NOT measured here; ``for_scale``
in the JSON and a column of the table): vLLM 0.33's per-token Triton prefill 123 TFLOP/s
useful with bf16 and 67 with e4m3, whatever the selections; compiled flex_attention 296 on
locality selections, 13 on random ones; the bf16 matmul rate about 700 TFLOP/s.

Writes a ``bench/1`` JSON (default ``$OUT/bench_attention_prefill.json`` when OUT is set,
else reports/bench_attention_prefill.json; ``--out``) and the Markdown table beside it
(``markdown``; render_bench.py renders it from the JSON with this module's table).

Run on the GPU machine: ``python -m benchmarks.bench_attention_prefill``; ``--new-tokens
1024 --prefix 1024`` for a quick check; ``--knobs block_rows=32 block_rows=16`` sweeps the
launcher's keywords (the first set makes the results); ``--no-flex`` skips the peer;
``--phases`` adds each launch's device time per call (``harness.kernel_phases``).
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks import harness, render_bench  # noqa: E402
from benchmarks.bench_attention_decode import Shape, random_selections  # noqa: E402

NAME = "bench_attention_prefill"
OP = "attention_prefill"
IMPL = "triton"
NEW_TOKENS = 8192
PREFIX = 8192
CACHES = {"bf16": "bfloat16", "e4m3fn": "e4m3fn"}
DISTS = ("locality", "random")
FAR_TILE = 128  # tokens sharing their far blocks in locality selections
RANDOM_TFLOPS_MIN = 150.0
LOCALITY_VS_FLEX_MIN = 1.0
FLEX_EXCLUDED = ("compile time (a warm-up call first), the paged-to-contiguous gather and "
                 "dequantisation of K/V, and the BlockMask build are excluded: timed on K/V "
                 "already gathered to contiguous [1, Hkv, S, D] bf16 and a prebuilt BlockMask")
FOR_SCALE = [  # published numbers on the H200 at this shape, not measured by this benchmark
    {"name": "vllm", "cache": "bf16", "dist": "any", "useful_tflops": 123.0},
    {"name": "vllm", "cache": "e4m3fn", "dist": "any", "useful_tflops": 67.0},
    {"name": "flex", "cache": "any", "dist": "locality", "useful_tflops": 296.0},
    {"name": "flex", "cache": "any", "dist": "random", "useful_tflops": 13.0},
    {"name": "bf16 matmul", "cache": "bf16", "dist": "-", "useful_tflops": 700.0},
]

SHAPE = Shape()


# ---------------------------------------------------------------------------- counts


def key_counts(topk: torch.Tensor, positions: torch.Tensor, page: int) -> tuple[int, int]:
    """(keys attended, keys read once) of selections ``topk [Hkv, T, K]`` (any strides) for
    tokens at ``positions [T]`` of one request, with torch ops on their device. A token's
    selection is the set of its entries in ``[0, p // P]`` (the kernel's contract); keys
    attended: per (token, KV head) every key ``j <= p`` of those blocks, summed; keys read
    once: per (KV head, selected block) its keys up to the last position of a token
    selecting it, summed (what ``minimal_bytes`` counts)."""
    dev = topk.device
    pos = positions.to(device=dev, dtype=torch.int64)
    own = pos // page
    e = topk.to(torch.int64).sort(dim=-1).values  # [Hkv, T, K], repeats adjacent
    fresh = torch.ones_like(e, dtype=torch.bool)
    fresh[..., 1:] = e[..., 1:] != e[..., :-1]
    ok = fresh & (e >= 0) & (e <= own[None, :, None])
    p = pos[None, :, None].expand_as(e)
    keys = (p - e * page + 1).clamp(max=page)
    attended = int(torch.where(ok, keys, 0).sum())
    hkv, nb = e.shape[0], int(own.max()) + 1 if pos.numel() else 0
    lim = torch.full((hkv * nb,), -1, dtype=torch.int64, device=dev)
    flat = torch.arange(hkv, device=dev)[:, None, None] * nb + e.clamp(0, max(nb - 1, 0))
    lim.scatter_reduce_(0, flat[ok], p[ok], reduce="amax")
    first = (torch.arange(nb, device=dev) * page).repeat(hkv)
    read = int((lim - first + 1).clamp(0, page).sum())
    return attended, read


def key_counts_reference(topk, positions, page: int) -> tuple[int, int]:
    """``key_counts`` in plain Python over NumPy arrays (sets per (token, KV head)): the
    independent twin the tests compare against."""
    topk = np.asarray(topk)
    attended, last = 0, {}
    for h in range(topk.shape[0]):
        for i, p in enumerate(int(x) for x in np.asarray(positions)):
            for b in {int(x) for x in topk[h, i]}:
                if 0 <= b <= p // page:
                    attended += min(page, p - b * page + 1)
                    last[h, b] = max(last.get((h, b), -1), p)
    read = sum(min(page, p - b * page + 1) for (_, b), p in last.items())
    return attended, read


def useful_flops(attended: float, s: Shape = SHAPE) -> float:
    """4 x D x G x keys attended per (token, KV head): QK^T and PV of every query head."""
    return 4 * s.d * (s.hq // s.hkv) * attended


def gathered_bytes(attended: float, kv_fmt: str, s: Shape = SHAPE) -> float:
    """K and V rows of every key attended, per (token, KV head): keys x 2D x element bytes."""
    return attended * 2 * s.d * harness.element_bytes(kv_fmt)


def minimal_bytes(new_tokens: int, prefix: int, kv_fmt: str, read_keys: float,
                  s: Shape = SHAPE) -> dict:
    """Bytes one prefill call must move, by part (see the module docstring): ``read_keys``
    keys read once (``key_counts``), bf16 q and out, int32 selections, block table,
    seq_lens and cu_seqlens_q of one request."""
    c = harness.element_bytes(kv_fmt)
    nb = -(-(prefix + new_tokens) // s.page)
    parts = {"read_kv": int(round(read_keys * 2 * s.d * c)),
             "read_q": new_tokens * s.hq * s.d * 2,
             "read_topk": new_tokens * s.hkv * s.topk * 4,
             "read_block_table": nb * 4,
             "read_seq_lens": 4,
             "read_cu_seqlens": 2 * 4,
             "write_out": new_tokens * s.hq * s.d * 2}
    parts["total"] = sum(parts.values())
    return parts


# ---------------------------------------------------------------------------- inputs


def locality_split(k: int) -> tuple[int, int]:
    """(recent, far) blocks of a locality selection of K: far = K // 4 (at least 1),
    recent = K - 1 - far (the own block is the remaining one): (11, 4) at K 16."""
    far = max(1, k // 4)
    return max(0, k - 1 - far), far


def locality_selections(positions: torch.Tensor, heads: int, g: torch.Generator,
                        s: Shape = SHAPE, tile: int = FAR_TILE) -> torch.Tensor:
    """Token-major ``[T, heads, K]`` int32 for the consecutive new tokens of one request at
    ``positions`` (on their device): per (token, head) the own block, the ``recent`` blocks
    before it (``locality_split``), and ``far`` distinct blocks shared by the ``tile``
    tokens of a tile (tiles counted from the first token), drawn per (tile, head) among the
    blocks ``< min(prefix // P, own_first - recent)`` (wholly in the prefix, before every
    recent block of the tile); entries in random order, -1 padding where fewer exist."""
    dev = positions.device
    t = positions.numel()
    recent, far = locality_split(s.topk)
    own = positions.to(torch.int64) // s.page
    rec = own[:, None] - torch.arange(recent + 1, device=dev)  # own block first
    rec = torch.where(rec >= 0, rec, -1)
    prefix_blocks = int(positions.min()) // s.page
    first = own[::tile]  # own block of each tile's first token
    n_cand = (first - recent).clamp(min=0, max=prefix_blocks)
    width = max(1, int(n_cand.max()))
    key = torch.rand((first.numel(), heads, width), generator=g, device=dev)
    key = torch.where(torch.arange(width, device=dev) < n_cand[:, None, None], key, -1.0)
    n = min(far, width)
    val, idx = key.topk(n, dim=-1)
    far_blocks = torch.where(val >= 0, idx, -1).repeat_interleave(tile, dim=0)[:t]
    sel = torch.full((t, heads, s.topk), -1, dtype=torch.int64, device=dev)
    sel[..., :recent + 1] = rec[:, None, :]
    sel[..., recent + 1:recent + 1 + n] = far_blocks
    order = torch.rand(sel.shape, generator=g, device=dev).argsort(-1)
    return sel.gather(-1, order).to(torch.int32)


SELECTIONS = {"locality": locality_selections, "random": random_selections}


@dataclass
class PrefillSet:
    q: torch.Tensor  # [T, Hq, D] bf16
    kv: torch.Tensor  # [pool pages, Hkv, P, 2D]: bf16 or uint8 codes
    table: torch.Tensor  # int32 [1, ceil(seq_len / P)]
    cu_seqlens: torch.Tensor  # int32 [0, T]
    seq_lens: torch.Tensor  # int32 [prefix + T]
    positions: torch.Tensor  # int64 [T]: prefix .. prefix + T - 1
    topk: torch.Tensor  # int32 token-major [T, Hkv, K]; pass topk.transpose(0, 1)
    scale: torch.Tensor | None  # 0-d float32 1.0 for fp8 caches
    out: torch.Tensor  # [T, Hq, D] bf16


def make_set(kv_fmt: str, dist: str, seed: int, new_tokens: int = NEW_TOKENS,
             prefix: int = PREFIX, s: Shape = SHAPE, dev: str = "cuda") -> PrefillSet:
    """Random q and cache (N(0, 1)), one request of ``new_tokens`` on a ``prefix`` on its
    own shuffled pages of a pool twice the size needed, selections of distribution
    ``dist`` (their own generator: the same for every cache)."""
    dev = torch.device(dev)
    g = torch.Generator(device=dev).manual_seed(2 * seed + 1)
    seq_len = prefix + new_tokens
    table, pool = harness.shuffled_block_table(1, -(-seq_len // s.page), g, dev)
    kv = harness.random_cache((pool, s.hkv, s.page, 2 * s.d), kv_fmt, g, dev)
    q = harness.random_cache((new_tokens, s.hq, s.d), "bfloat16", g, dev)
    positions = torch.arange(prefix, seq_len, device=dev)
    gs = torch.Generator(device=dev).manual_seed(2 * seed)
    topk = SELECTIONS[dist](positions, s.hkv, gs, s)
    scale = torch.ones((), dtype=torch.float32, device=dev) \
        if kv_fmt in harness.FP8_DTYPES else None
    return PrefillSet(q, kv, table, torch.tensor([0, new_tokens], dtype=torch.int32, device=dev),
                      torch.tensor([seq_len], dtype=torch.int32, device=dev), positions, topk,
                      scale, torch.empty_like(q))


def triton_prefill(kv_fmt: str, knobs: dict | None = None):
    """A factory: PrefillSet -> zero-argument call of the Triton prefill attention (with
    the launcher's tuning keywords ``knobs``)."""
    from kernels.attention_prefill import sparse_attention_prefill

    knobs = knobs or {}

    def bind(t: PrefillSet):
        topk = t.topk.transpose(0, 1)
        return lambda: sparse_attention_prefill(t.q, t.kv, kv_fmt, t.table, t.cu_seqlens,
                                                t.seq_lens, topk, t.scale, t.scale,
                                                out=t.out, **knobs)

    return bind


# ---------------------------------------------------------------------------- flex


@dataclass
class FlexInputs:
    q: torch.Tensor  # [1, Hq, T, D] bf16, contiguous
    k: torch.Tensor  # [1, Hkv, S, D] bf16, gathered and dequantised
    v: torch.Tensor
    block_mask: object  # torch.nn.attention.flex_attention.BlockMask
    scale: float


def flex_inputs(t: PrefillSet, kv_fmt: str, s: Shape = SHAPE,
                full_blocks: bool = True) -> FlexInputs:
    """flex_attention's inputs for a set, built with oracle/impls/flex.py (not timed);
    full_blocks: the BlockMask's blocks where the mask holds everywhere marked "full" (flex
    skips mask_mod there: the peer at its fastest; False: every block partial, as the
    registered implementation the oracle checks)."""
    from oracle.impls import flex as impl_flex

    seq = t.seq_lens.cpu().numpy().astype(np.int64)
    pos = t.positions.cpu().numpy()
    req = np.zeros(pos.shape, np.int64)
    sel, qend = impl_flex.selection_mask(t.topk.transpose(0, 1).cpu().numpy(), req, pos, seq,
                                         s.page)
    fp8 = kv_fmt in harness.FP8_DTYPES
    codes = t.kv if fp8 else t.kv.view(torch.int16)
    scale = np.float32(float(t.scale)) if fp8 else None
    k, v = impl_flex.gather_kv(codes, kv_fmt, t.table.cpu().numpy(), seq, scale, scale,
                               t.q.dtype, impl_flex.seen_keys(sel, qend, s.page))
    dev = t.q.device
    bm = impl_flex.build_block_mask(torch.from_numpy(sel).to(dev), torch.from_numpy(qend).to(dev),
                                    s.hq // s.hkv, s.page, k.shape[2], full=full_blocks)
    q = t.q.permute(1, 0, 2).contiguous()[None]
    return FlexInputs(q, k, v, bm, 1.0 / math.sqrt(s.d))


def compiled_flex():
    """``torch.compile(flex_attention)`` with static shapes (the benchmark's are fixed),
    the one the oracle's flex implementation uses (oracle.impls.flex.compiled_flex: dynamo's
    recompile limit raised, since every BlockMask brings a new mask_mod closure and past the
    limit torch would silently run flex eagerly)."""
    from oracle.impls.flex import compiled_flex as flex

    return flex()


def flex_call(f: FlexInputs, options: dict | None = None):
    """A zero-argument call of compiled flex_attention on prepared inputs (GQA); returns
    ``[1, Hq, T, D]``. ``options``: flex's kernel_options (None: its defaults)."""
    fn = compiled_flex()
    return lambda: fn(f.q, f.k, f.v, block_mask=f.block_mask, scale=f.scale, enable_gqa=True,
                      kernel_options=options or None)


# ---------------------------------------------------------------------------- checks


def derive(r: dict) -> dict:
    """Derived numbers of one result from its raw fields (None where a time is missing):
    useful TFLOP/s and gathered bytes/s of the kernel, flex's useful TFLOP/s, and
    ``vs_flex`` = flex median / this median."""
    us = r.get("median_us")
    fl = (r.get("flex") or {}).get("median_us")
    return {"useful_tflops": None if us is None else r["useful_flops"] / (us * 1e-6) / 1e12,
            "gathered_bytes_per_s": None if us is None else r["gathered_bytes"] / (us * 1e-6),
            "flex_useful_tflops": None if fl is None else r["useful_flops"] / (fl * 1e-6) / 1e12,
            "vs_flex": None if us is None or fl is None else fl / us}


def checks(results: list[dict]) -> list[dict]:
    """The targets (None where a median is missing, never a pass), and each
    result's derived numbers (``derive``, ``vs_bf16`` for fp8 caches) set on it."""
    out = []
    for r in results:
        r.update(derive(r))
        if r["dist"] == "locality":
            out.append(harness.check("locality vs flex", r["vs_flex"], LOCALITY_VS_FLEX_MIN,
                                     lambda v: v >= LOCALITY_VS_FLEX_MIN, dist=r["dist"],
                                     cache=r["cache"]))
        if r["dist"] == "random":
            out.append(harness.check("random useful TFLOP/s", r["useful_tflops"],
                                     RANDOM_TFLOPS_MIN, lambda v: v >= RANDOM_TFLOPS_MIN,
                                     dist=r["dist"], cache=r["cache"]))
        if r["cache"] != "bf16":
            us = r.get("median_us")
            base = harness.median_of(results, cache="bf16", dist=r["dist"])
            r["vs_bf16"] = None if us is None or base is None else base / us
            out.append(harness.check("e4m3 at least as fast as bf16", r["vs_bf16"], 1.0,
                                     lambda v: v >= 1.0, dist=r["dist"], cache=r["cache"]))
    return out


# ----------------------------------------------------------------------------- bench


def _finite(t: PrefillSet) -> bool:
    return bool(torch.isfinite(t.out).all())


def bench_flex(sets, fmt: str, cache: str, min_bytes: int, args):
    """(flex's record, its output on the first set or None): inputs prepared, one warm-up
    call (compiles; ``compile_s``), then harness timing of the calls alone."""
    extra = {"kernel_options": args.flex_knobs or {}, "excluded": FLEX_EXCLUDED,
             "block_mask": "partial" if args.flex_partial else "full"}
    try:
        t0 = time.perf_counter()
        prepared = [flex_inputs(st, fmt, full_blocks=not args.flex_partial) for st in sets]
        torch.cuda.synchronize()
        prep_s = time.perf_counter() - t0
        calls = [flex_call(f, args.flex_knobs) for f in prepared]
        t0 = time.perf_counter()
        first = calls[0]()
        torch.cuda.synchronize()
        compile_s = time.perf_counter() - t0
    except Exception as e:  # noqa: BLE001 - record the failure, bench the rest
        return harness.record("flex", OP, cache, min_bytes,
                              error=harness.error_text(e), **extra), None
    r = harness.timed_record("flex", OP, cache, min_bytes, calls, args, prepare_s=prep_s,
                             compile_s=compile_s, **extra)
    print(f"flex {cache}: {r['mode']} {r['median_us']} us (compile {compile_s:.1f} s)",
          flush=True)
    del calls, prepared
    return r, first


def bench_case(cache: str, dist: str, args, knob_sets) -> list[dict]:
    """One result per knob set: the kernel at one cache and distribution over its rotating
    input sets, each with flex's record on the same sets (timed once)."""
    fmt = CACHES[cache]
    page = SHAPE.page
    sets = [make_set(fmt, dist, 0, args.new_tokens, args.prefix)]
    counts = [key_counts(sets[0].topk.transpose(0, 1), sets[0].positions, page)]
    n_sets = harness.rotation_count(
        minimal_bytes(args.new_tokens, args.prefix, fmt, counts[0][1])["total"],
        harness.l2_bytes())
    for i in range(1, n_sets):
        sets.append(make_set(fmt, dist, i, args.new_tokens, args.prefix))
        counts.append(key_counts(sets[i].topk.transpose(0, 1), sets[i].positions, page))
    attended = sum(c[0] for c in counts) / n_sets  # per call, over the rotation
    read = sum(c[1] for c in counts) / n_sets
    parts = minimal_bytes(args.new_tokens, args.prefix, fmt, read)
    extra = {"dist": dist, "kv_fmt": fmt, "new_tokens": args.new_tokens, "prefix": args.prefix,
             "attended_keys": attended, "read_keys": read, "useful_flops": useful_flops(attended),
             "gathered_bytes": gathered_bytes(attended, fmt), "bytes_parts": parts}
    flex, flex_out = (None, None) if args.no_flex else \
        bench_flex(sets, fmt, cache, parts["total"], args)
    out = []
    for knobs in knob_sets:
        try:
            calls = [triton_prefill(fmt, knobs)(st) for st in sets]
        except Exception as e:  # noqa: BLE001 - e.g. the kernel module fails to import
            r = harness.record(IMPL, OP, cache, parts["total"],
                               error=harness.error_text(e), knobs=knobs, **extra)
        else:
            r = harness.timed_record(IMPL, OP, cache, parts["total"], calls, args,
                                     knobs=knobs, **extra)
        if r["median_us"] is not None:
            r["finite_output"] = _finite(sets[0])
            if flex_out is not None:
                diff = flex_out[0].transpose(0, 1).float() - sets[0].out.float()
                r["max_abs_diff_vs_flex"] = float(diff.abs().max())
        if args.phases and r["median_us"] is not None:
            try:
                r["phases"] = harness.kernel_phases(calls)
            except Exception as e:  # noqa: BLE001 - a diagnostic: keep the timing
                r["phases_error"] = harness.error_text(e)
        r["flex"] = flex
        print(f"{cache} {dist} {knobs or ''}: {r['mode']} {r['median_us']} us", flush=True)
        out.append(r)
    del sets, flex_out
    torch.cuda.empty_cache()
    return out


def parse_args(argv):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--new-tokens", type=int, default=NEW_TOKENS, help="new tokens (T)")
    ap.add_argument("--prefix", type=int, default=PREFIX, help="tokens before them")
    ap.add_argument("--caches", nargs="+", default=list(CACHES), choices=list(CACHES))
    ap.add_argument("--dists", nargs="+", default=list(DISTS), choices=list(DISTS),
                    help="selection distributions")
    ap.add_argument("--knobs", nargs="*", type=harness.parse_knobs, default=[],
                    help="launcher tuning keywords, one set per argument (k=v,...): the "
                         "first set makes the results, the others a 'sweep' list beside them")
    ap.add_argument("--flex-knobs", type=harness.parse_knobs, default={},
                    help="flex_attention kernel_options (k=v,..., integers; default: flex's)")
    ap.add_argument("--no-flex", action="store_true", help="do not time flex_attention")
    ap.add_argument("--phases", action="store_true",
                    help="also each launch's device time per call (torch.profiler, eager; "
                         "a breakdown beside the timing, not part of it)")
    ap.add_argument("--flex-partial", action="store_true",
                    help="flex's BlockMask with every block partial (mask_mod everywhere), "
                         "as the oracle's flex")
    ap.add_argument("--rounds", type=int, default=1,
                    help="time every (cache, distribution, knob set) this many times, one "
                         "after the other in turn (round-robin): the medians are over the "
                         "rounds and each check is the median of its per-round values, "
                         "ratios paired within a round (merge_rounds)")
    harness.add_timing_args(ap, NAME)
    args = ap.parse_args(argv)
    if args.new_tokens < 1 or args.prefix < 0:
        ap.error("--new-tokens must be >= 1 and --prefix >= 0")
    if args.rounds < 1:
        ap.error("--rounds must be >= 1")
    return args


def build_report(args) -> dict:
    doc = harness.report_base(render_bench.SCHEMA, "block-sparse GQA prefill attention",
                              args)
    mask = ("every block of its BlockMask partial (mask_mod everywhere)" if args.flex_partial
            else "the blocks where the mask holds everywhere marked full (no mask_mod there)")
    flex_note = ("flex: not timed (--no-flex)." if args.no_flex else
                 f"flex: torch.compile(flex_attention), kernel options "
                 f"{args.flex_knobs or 'flex defaults'}, on the same selections, {mask}; "
                 f"its {FLEX_EXCLUDED}; it reads bf16 K/V whatever the cache.")
    doc.update(tokens=f"{args.new_tokens} new + {args.prefix} prefix",
               new_tokens=args.new_tokens, prefix=args.prefix, far_tile=FAR_TILE,
               locality_split=dict(zip(("recent", "far"), locality_split(SHAPE.topk))),
               shape={**asdict(SHAPE), "model_dtype": "bfloat16", "layout": "HND"},
               notes=[f"one request, {args.new_tokens} new tokens on a {args.prefix}-token "
                      f"prefix; K {SHAPE.topk} selected blocks per (token, KV head), the own "
                      f"block always in; scalar fp8 scale 1.0.",
                      "useful TFLOP/s = 4 x D x keys attended (summed over tokens and query "
                      "heads) / median; gathered GB/s = keys attended (summed over tokens and "
                      "KV heads) x 2D x element bytes / median.",
                      flex_note,
                      "for scale: the published numbers (vLLM / flex TFLOP/s), not measured "
                      "here."],
               for_scale=FOR_SCALE, results=[])
    knob_sets = args.knobs or [{}]
    rounds = []
    doc["sweep"] = []
    for i in range(args.rounds):
        # The first round's lists are the tracked report's: a run stopped later still
        # writes them (harness.main).
        results, sweep = (doc["results"], doc["sweep"]) if i == 0 else ([], [])
        for cache in args.caches:
            for dist in args.dists:
                rs = bench_case(cache, dist, args, knob_sets)
                results.append(rs[0])
                sweep.extend(rs[1:])
        rounds.append((results, sweep))
    if args.rounds > 1:
        doc["notes"].append(f"{args.rounds} rounds, every configuration once per round in "
                            "turn: each median (us) is the median of the rounds' medians; "
                            "each check the median of its per-round values (a ratio within "
                            "one round); the other fields are the first round's.")
    doc["results"], doc["sweep"], doc["checks"] = merge_rounds(rounds)
    return doc


def merge_rounds(rounds: list[tuple[list[dict], list[dict]]]):
    """``(results, sweep, checks)`` from each round's ``(results, sweep)`` (the same
    configurations in the same order): a configuration's record is its first round's with
    ``median_us`` (and flex's) the median over the rounds and ``round_medians_us`` beside
    it (None where a round has none); a check's value is the median of its values in the
    rounds (``checks`` per round: ``vs_bf16`` and ``vs_flex`` pair times of one round),
    ``round_values`` beside it, None where a round has none (never a pass)."""
    per_round = [checks(results) for results, _ in rounds]
    results = [_merged(rs) for rs in zip(*(r for r, _ in rounds))]
    sweep = [_merged(rs) for rs in zip(*(w for _, w in rounds))]
    for r in sweep:
        r.update(derive(r))
    if len(rounds) == 1:
        return results, sweep, per_round[0]
    merged = []
    for cs in zip(*per_round):
        vals = [c["value"] for c in cs]
        value = _median(vals)
        # Every check of ``checks`` holds when its value is at least its limit.
        merged.append({**cs[0], "value": value, "round_values": vals,
                       "passed": None if value is None else bool(value >= cs[0]["limit"])})
    return results, sweep, merged


def _median(values):
    return None if any(v is None for v in values) else float(np.median(values))


def _merged(rs: tuple[dict, ...]) -> dict:
    """One configuration's record over the rounds (``merge_rounds``)."""
    if len(rs) == 1:
        return rs[0]
    out = dict(rs[0])
    us = [r.get("median_us") for r in rs]
    out.update(median_us=_median(us), round_medians_us=us)
    if out.get("flex"):
        fl = [(r.get("flex") or {}).get("median_us") for r in rs]
        out["flex"] = {**out["flex"], "median_us": _median(fl), "round_medians_us": fl}
    out.update(derive(out))
    for key in ("vs_flex", "vs_bf16"):  # paired within each round (``checks``)
        if any(key in r for r in rs):
            out[key] = _median([r.get(key) for r in rs])
    return out


# -------------------------------------------------------------------------- markdown

COLUMNS = ("cache", "selections", "mode", "median (us)", "useful TFLOP/s", "gathered GB/s",
           "flex (us)", "flex TFLOP/s", "x vs flex", "x vs bf16",
           "vLLM / flex TFLOP/s (for scale)", "checks met")


def _for_scale(doc: dict, name: str, cache: str, dist: str):
    e = next((e for e in doc.get("for_scale", ()) if e["name"] == name
              and e["cache"] in (cache, "any") and e["dist"] in (dist, "any")), None)
    return None if e is None else e["useful_tflops"]


def _checks_met(doc: dict, r: dict):
    got = [c["passed"] for c in doc.get("checks", ())
           if c["cache"] == r["cache"] and c["dist"] == r["dist"]]
    if not got or all(p is None for p in got):
        return None
    return all(p is True for p in got)


def table_row(doc: dict, r: dict) -> str:
    """One row, its numbers derived here from the raw fields (``derive``), but for a merge
    of rounds' its ratios, the medians of the per-round ones (``merge_rounds``)."""
    f = render_bench._fmt
    d = derive(r)
    gbps = None if d["gathered_bytes_per_s"] is None else d["gathered_bytes_per_s"] / 1e9
    mode = r.get("mode", "?") if r.get("median_us") is not None else f"error: {r.get('note')}"
    flex = r.get("flex") or {}
    flex_us = flex.get("median_us")
    flex_cell = f(flex_us, ".1f") if flex_us is not None or not flex else \
        f"error: {flex.get('note')}"
    base = harness.median_of(doc["results"], cache="bf16", dist=r["dist"]) \
        if r["cache"] != "bf16" else None
    vs_bf16 = None if base is None or r.get("median_us") is None else base / r["median_us"]
    if "round_medians_us" in r:  # rounds: the ratios paired within a round (merge_rounds)
        d["vs_flex"], vs_bf16 = r.get("vs_flex"), r.get("vs_bf16")
    scale = (f"{f(_for_scale(doc, 'vllm', r['cache'], r['dist']), '.0f')} / "
             f"{f(_for_scale(doc, 'flex', r['cache'], r['dist']), '.0f')}")
    cells = (r["cache"], r["dist"], mode, f(r.get("median_us"), ".1f"),
             f(d["useful_tflops"], ".1f"), f(gbps, ".0f"), flex_cell,
             f(d["flex_useful_tflops"], ".1f"), f(d["vs_flex"], ".2f", "x"),
             f(vs_bf16, ".2f", "x"), scale, render_bench._yes_no(_checks_met(doc, r)))
    return "| " + " | ".join(cells) + " |"


def sweep_lines(doc: dict) -> list[str]:
    """The knob sweep as a Markdown table (nothing when there is none), fastest first per
    (cache, distribution)."""
    rows = sorted(doc.get("sweep", ()),
                  key=lambda r: (r["cache"], r["dist"], r.get("median_us") or 1e30))
    if not rows:
        return []
    f = render_bench._fmt
    lines = ["", "Knob sweep (triton; flex as in the results):", "",
             "| cache | selections | knobs | median (us) | useful TFLOP/s | x vs flex |",
             "|---|---|---|---:|---:|---:|"]
    for r in rows:
        d = derive(r)
        lines.append(f"| {r['cache']} | {r['dist']} | {r.get('knobs') or 'defaults'} | "
                     f"{f(r.get('median_us'), '.1f')} | {f(d['useful_tflops'], '.1f')} | "
                     f"{f(d['vs_flex'], '.2f', 'x')} |")
    return lines


def phase_lines(doc: dict) -> list[str]:
    """Each result's launches (``--phases``) as a Markdown table; nothing without them."""
    rows = [r for r in (*doc.get("results", ()), *doc.get("sweep", ()))
            if r.get("phases") or r.get("phases_error")]
    if not rows:
        return []
    lines = ["", "Launches per call (torch.profiler, eager, median over the calls; the "
                 "gaps between launches not counted):", "",
             "| cache | selections | knobs | step | kernel | us |", "|---|---|---|---:|---|---:|"]
    for r in rows:
        where = f"| {r['cache']} | {r['dist']} | {r.get('knobs') or 'defaults'} |"
        if r.get("phases_error"):
            lines.append(f"{where} - | error: {r['phases_error'][:80]} | - |")
        for p in r.get("phases") or ():
            lines.append(f"{where} {p['step']} | {p['kernel'][:60]} | {p['us']:.1f} |")
    return lines


def markdown(doc: dict) -> str:
    """The header of render_bench, one row per (cache, distribution), the checks, the
    published numbers for scale, the knob sweep, then the launches per call."""
    if doc.get("schema") != render_bench.SCHEMA:
        raise ValueError(f"schema must be {render_bench.SCHEMA!r}, got {doc.get('schema')!r}")
    lines = render_bench.header(doc)
    lines.append("| " + " | ".join(COLUMNS) + " |")
    lines.append("|---|---|---|" + "---:|" * 8 + "---|")
    for r in doc["results"]:
        lines.append(table_row(doc, r))
    lines += ["", "Checks:", ""]
    for c in doc.get("checks", ()):
        val = "-" if c["value"] is None else f"{c['value']:.3f}"
        rounds = "" if not c.get("round_values") else " (rounds: " + ", ".join(
            "-" if v is None else f"{v:.3f}" for v in c["round_values"]) + ")"
        lines.append(f"- {c['dist']} {c['cache']}: {c['check']} = {val}{rounds} (limit "
                     f"{c['limit']}): {render_bench._yes_no(c['passed'])}")
    if doc.get("for_scale"):
        lines += ["", "For scale (the published numbers on the H200 at this shape, not measured "
                      "here):", ""]
        lines += [f"- {e['name']} ({e['cache']}, {e['dist']} selections): "
                  f"{e['useful_tflops']:.0f} TFLOP/s" for e in doc["for_scale"]]
    lines += sweep_lines(doc)
    lines += phase_lines(doc)
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    return harness.main(NAME, argv, parse_args, build_report, markdown)


if __name__ == "__main__":
    sys.exit(main())
