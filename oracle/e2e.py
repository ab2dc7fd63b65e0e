"""End-to-end accuracy cost of fp8 KV caches, measured with the float64 reference only.

One sparse-attention step (``reference.pipeline.sparse_step``: fused norm + RoPE + insert
-> indexer -> block-sparse attention) runs on a batch whose prefixes are already cached,
once per cache configuration, and is compared with the same step computed WITHOUT any
cache quantisation. No GPU and no kernel is involved: every number here is what the cache
format alone costs, before any kernel rounding.

Choices (each one deliberate; the JSON records the configuration):

- Inputs. Per (mode, distribution, seed) one input set, shared by every cache
  configuration, so the rows of one (mode, distribution) compare formats on identical
  data. Its generator is ``oracle.rand.generator(case_seed(mode, dist, seed))`` (sha256 of
  ``"e2e:MODE:DIST:SEED"``, as ``oracle.cases`` derives its seeds), and all values come
  from ``oracle.cases.draw_values`` rounded to bf16: a seed gives the same bits anywhere.
  Packed rows ``[q | k | v | index_q | index_k]`` for every token of every request (prefix
  and new tokens), the four norm weights, and the shuffled block tables (the KV cache and
  the index cache each with its own) are drawn from it, in that order.
- Distributions of the packed rows (values before bf16 rounding; ``draw_values``):
  ``normal`` N(0, 1); ``outliers`` N(0, 1) plus N(0, 10^2) on 0.1% of entries (no Inf/NaN:
  an output error is meaningless with them); ``near_overflow`` +-448 x U(0.85, 1.15) (around
  e4m3fn's max, so above e4m3fnuz's 240 and far below e5m2's 57344) with norm weights
  4 N(0, 1) instead of 0.3 N(0, 1) (large post-norm K, as in ``oracle.cases``); ``tiny``
  +-2^-9 x 2^U(-2, 4) (around e4m3fn's min subnormal). q, k and the index parts go through
  RMSNorm, which removes their overall magnitude; V is stored as drawn, so the magnitude
  distributions act mostly on V (and the outliers on K's shape as well).
- Shapes (``DEFAULT``; ``QUICK`` is smaller): Hkv 2, G 4 (Hq 8), Hi = Hkv, D 128, R 64,
  P 64, K 8, one forced local block, no initial block, RoPE base 5e6, eps 1e-6, bf16
  activations. Prefill: 3 requests with cached prefixes 997, 2411, 3290 and 160, 96, 224
  new tokens. Decode: 8 requests of 777 .. 4001 tokens, 2 rows each (16 rows: its
  selection-change fractions are counts out of 32). No length is a multiple of P; K = 8
  of up to 63 visible blocks, so the selection is a real choice.
- Cache configurations: ``kv_cache_dtype`` on a platform, resolved by
  ``reference.platforms``: bfloat16 (the baseline users compare against; index cache bf16,
  index_q bf16), fp8_e4m3 / fp8_e5m2 on ``cuda`` (e4m3fn / e5m2) and on ``rocm-fnuz``
  (e4m3fnuz / e5m2fnuz). fp8 KV caches come with the platform's e4m3 index cache (unit
  scale, as the pipeline supports), and index_q in e4m3 (``dec(e4m3(index_q))``).
- Scales (fp8 only; one float32 scalar each for K and V, given to writer and reader):
  ``amax``: ``float32(max|K| / fmt_max)`` and ``float32(max|V| / fmt_max)`` over every K/V
  value the step and its prefix write (post-RoPE K before rounding, V as stored). This is
  the per-tensor scale a server calibrates, here with perfect knowledge of the data (the
  best case). Where float32 rounding puts ``max / scale`` a hair above fmt_max, satfinite
  maps it to fmt_max (a relative error of ~2^-24). ``unit``: 1.0, what vLLM's fused
  writer uses.
- The prefixes are in the caches before the step, written as the fused op writes them
  (``write_prefixes``: its element-wise encode of the exact K, V and exact index_k,
  vectorised; bit-identical to calling ``fused_qknorm_rope_insert`` on the prefix rows,
  which tests/test_e2e.py checks). Every slot nothing writes holds the format's NaN
  code, so a leak would show as NaN. The step itself is ``sparse_step`` unchanged.
- Attention runs under the EXACT schedule (float64 math on the dequantised cache,
  unrounded output): the numbers are the cache's cost, not a kernel's.
- The exact ("no quantisation") step. The codec has no float64 storage format and every
  reference op reads codes, so the exact step is computed from VALUES by the same
  semantics (``value_step``): K = the exact post-RoPE value (float64), V = the row's
  value, index_k and index_q = their exact post-RoPE values; block scores are
  ``max_{j in b, j <= p} index_q . index_k_j`` and the selection is
  ``reference.indexer.select_blocks`` (the reference's own ranking and forced blocks); the
  attention is ``softmax(q . K_j / sqrt(D)) V`` over the selected blocks' keys j <= p.
  q is the bf16 q the fused op emits in every run, exact included: its rounding is the
  same whatever the cache, so it is not part of the cache's cost. ``value_step`` on the
  values decoded from a bf16 pipeline's caches reproduces that pipeline's selection and
  output (tests/test_e2e.py), so the exact step differs from the cached ones only in the
  values it reads.
- Metrics per (mode, distribution, cache, scale), over every (row, query head): the
  relative RMSE ``||out - exact||_2 / ||exact||_2``; the max abs error over max |exact|;
  the fraction of (row, index head) selections whose SET differs from the exact step's;
  and the relative RMSE of attention on the same quantised cache with the EXACT step's
  selection (what the KV values alone cost, without selection changes).
- Reading the numbers: the data are random, without a real model's structure. Block
  scores of random keys are close to one another, so a small score error swaps blocks
  often (a worst case for the selection), and an output is an average of many random V
  vectors, small against each of them, so a swapped block moves it by a large fraction of
  its norm. The absolute numbers are therefore no prediction of a trained model's
  accuracy (most likely pessimistic; not measured here); the comparisons between
  formats, scales and distributions on identical inputs are what this measures.
"""

from __future__ import annotations

import platform as _platform
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from oracle import rand
from oracle.cases import draw_values, poison_code, to_model
from reference.attention import (
    decode_positions,
    prefill_positions,
    sparse_attention_decode,
    sparse_attention_prefill,
)
from reference.codec import FORMATS
from reference.domain import MODEL
from reference.indexer import select_blocks
from reference.kv_cache import (
    empty_cache,
    empty_index_cache,
    gather_index_keys,
    gather_kv,
    quantize,
    token_slots,
)
from reference.norm_rope import KINDS, QKVLayout, rope_table, transform_qkv_rows
from reference.pipeline import sparse_step
from reference.platforms import index_cache_format, is_fp8, kv_cache_format

SCHEMA = "e2e-accuracy/1"
MODES = ("prefill", "decode")
DISTS = ("normal", "outliers", "near_overflow", "tiny")
#: (kv_cache_dtype, platform) of each measured cache configuration.
CACHES = (("bfloat16", "cuda"), ("fp8_e4m3", "cuda"), ("fp8_e5m2", "cuda"),
          ("fp8_e4m3", "rocm-fnuz"), ("fp8_e5m2", "rocm-fnuz"))
SCALE_KINDS = ("amax", "unit")
MODEL_DTYPE = "bfloat16"
TARGET_FMT = "e4m3fn"  # the format whose max / min subnormal near_overflow / tiny aim at
LOCAL_BLOCKS, INITIAL_BLOCKS = MODEL.local_blocks, MODEL.initial_blocks


@dataclass(frozen=True)
class Config:
    """Shapes of one measurement (see the module docstring)."""

    kv_heads: int
    group: int
    head_dim: int
    rotary_dim: int
    page: int
    topk: int
    prefixes: tuple[int, ...]  # prefill: cached tokens per request before the step
    new_tokens: tuple[int, ...]  # prefill: new tokens per request
    contexts: tuple[int, ...]  # decode: seq_len per request, this step's rows included
    rows_per_request: int  # decode


DEFAULT = Config(2, 4, 128, 64, 64, 8, (997, 2411, 3290), (160, 96, 224),
                 (1203, 2050, 3333, 4001, 777, 2900, 1555, 3711), 2)
QUICK = Config(2, 2, 64, 32, 16, 4, (203, 390), (48, 40), (150, 333, 261, 197, 420, 88), 2)


# ------------------------------------------------------------------------------ inputs


def case_seed(mode: str, dist: str, seed: int) -> int:
    """The generator seed of one input set: ``rand.seed_of("e2e:MODE:DIST:SEED")``."""
    return rand.seed_of(f"e2e:{mode}:{dist}:{seed}")


def make_case(mode: str, dist: str, seed: int, cfg: Config) -> dict:
    """The input set of one (mode, distribution, seed): everything a step needs except the
    caches (made per configuration by ``run_cached``)."""
    if mode not in MODES or dist not in DISTS:
        raise ValueError(f"mode must be in {MODES} and dist in {DISTS}, got {mode}, {dist}")
    bg = rand.generator(case_seed(mode, dist, seed))
    hkv, d, page = cfg.kv_heads, cfg.head_dim, cfg.page
    layout = QKVLayout(cfg.group * hkv, hkv, d, num_index_heads=hkv, has_index_k=True)
    if mode == "prefill":
        qlens = np.array(cfg.new_tokens, np.int64)
        seq = np.array(cfg.prefixes, np.int64) + qlens
    else:
        seq = np.array(cfg.contexts, np.int64)
        qlens = np.full(seq.size, cfg.rows_per_request, np.int64)
    n_req, width = seq.size, -(-int(seq.max()) // page)
    num_pages = n_req * width + 2  # two spare pages that stay poisoned
    tables = [rand.permutation(bg, num_pages)[:n_req * width].reshape(n_req, width)
              .astype(np.int32) for _ in range(2)]
    w_std = 4.0 if dist == "near_overflow" else 0.3
    weights = {kind: to_model(w_std * rand.normal(bg, (d,)), MODEL_DTYPE) for kind in KINDS}
    rows = to_model(draw_values(bg, dist, (int(seq.sum()), layout.row_width), TARGET_FMT),
                    MODEL_DTYPE)
    starts = np.concatenate([[0], np.cumsum(seq)])
    # Row i of request r is the token at position i; the last qlens[r] are this step's.
    prefix = [np.arange(starts[r], starts[r + 1] - qlens[r]) for r in range(n_req)]
    new = np.concatenate([np.arange(starts[r + 1] - qlens[r], starts[r + 1])
                          for r in range(n_req)])
    step = dict(rows=rows[new], seq_lens=seq)
    if mode == "prefill":
        step["cu_seqlens_q"] = np.concatenate([[0], np.cumsum(qlens)]).astype(np.int32)
    else:
        step["rows_per_request"] = cfg.rows_per_request
    return dict(mode=mode, dist=dist, seed=seed, cfg=cfg, layout=layout, weights=weights,
                table=rope_table(int(seq.max()), cfg.rotary_dim, MODEL.rope_base,
                                 MODEL_DTYPE),
                rows=rows, starts=starts, prefix_rows=prefix, qlens=qlens,
                num_pages=num_pages, block_table=tables[0], index_block_table=tables[1],
                step=step)


def _transform(case, rows, positions) -> dict:
    return transform_qkv_rows(rows, positions, case["layout"], case["weights"], case["table"],
                              case["cfg"].rotary_dim, MODEL.eps, MODEL_DTYPE)


def step_positions(case) -> tuple[np.ndarray, np.ndarray]:
    """(request, position) of each row of the step, as the pipeline computes them."""
    step = case["step"]
    if case["mode"] == "prefill":
        return prefill_positions(step["cu_seqlens_q"], step["seq_lens"], len(step["rows"]))
    return decode_positions(step["seq_lens"], step["rows_per_request"])


# ------------------------------------------------------------------------------ scales


def amax_scale(values, fmt: str) -> np.float32:
    """The per-tensor scale a server would use: ``float32(max |values| / fmt_max)``."""
    return np.float32(np.max(np.abs(values)) / FORMATS[fmt].max_finite)


def case_scales(exact: dict, kv_fmt: str, kind: str) -> tuple:
    """(k_scale, v_scale) of one configuration: None (1.0) for bf16 and ``unit``, else the
    amax scales of every K (exact post-RoPE) and V value the prefixes and the step write
    (``exact``: the case's ``exact_values``)."""
    if not is_fp8(kv_fmt) or kind == "unit":
        return None, None
    return (amax_scale(np.concatenate(exact["k"]), kv_fmt),
            amax_scale(np.concatenate(exact["v"]), kv_fmt))


# ------------------------------------------------------------------------------ runs


def empty_caches(case, kv_fmt: str, index_fmt: str) -> tuple[np.ndarray, np.ndarray]:
    """KV and index caches of the case's size, every code the format's NaN code."""
    cfg = case["cfg"]
    kv = empty_cache(case["num_pages"], cfg.kv_heads, cfg.page, cfg.head_dim, kv_fmt,
                     fill_code=poison_code(kv_fmt))
    ic = empty_index_cache(case["num_pages"], cfg.page, cfg.head_dim, index_fmt,
                           fill_code=poison_code(index_fmt))
    return kv, ic


def write_prefixes(case, exact, kv, kv_fmt, ic, index_fmt, k_scale=None, v_scale=None):
    """The prefixes' codes as the fused op writes them, vectorised over tokens: its
    ``insert_kv`` / ``insert_index_k`` encode each token's exact post-RoPE K, its V and its
    exact index_k element by element (``kv_cache.quantize``: satfinite of value / scale
    for fp8, RNE for bf16), which is what this does for all tokens at once (bit-identical
    caches: tests/test_e2e.py)."""
    cfg, page, d = case["cfg"], case["cfg"].page, case["cfg"].head_dim
    ks = 1.0 if k_scale is None else k_scale
    vs = 1.0 if v_scale is None else v_scale
    for r, idx in enumerate(case["prefix_rows"]):
        pos = np.arange(idx.size)
        slots = token_slots(case["block_table"][r], pos, page)
        for h in range(cfg.kv_heads):
            kv[slots // page, h, slots % page, :d] = quantize(exact["k"][r][pos, h], kv_fmt, ks)
            kv[slots // page, h, slots % page, d:] = quantize(exact["v"][r][pos, h], kv_fmt, vs)
        slots = token_slots(case["index_block_table"][r], pos, page)
        ic[slots // page, slots % page] = quantize(exact["index_k"][r][pos], index_fmt)


def run_cached(case, exact, kv_fmt: str, index_fmt: str, k_scale=None, v_scale=None):
    """The reference pipeline on caches of the given formats: poisoned caches holding the
    prefixes (``write_prefixes``), then ``sparse_step`` on the step's rows."""
    kv, ic = empty_caches(case, kv_fmt, index_fmt)
    write_prefixes(case, exact, kv, kv_fmt, ic, index_fmt, k_scale, v_scale)
    cfg = case["cfg"]
    return sparse_step(case["mode"], **case["step"], layout=case["layout"],
                       weights=case["weights"], table=case["table"],
                       rotary_dim=cfg.rotary_dim, eps=MODEL.eps, model_dtype=MODEL_DTYPE,
                       kv_cache=kv, kv_fmt=kv_fmt, index_cache=ic, index_fmt=index_fmt,
                       block_table=case["block_table"],
                       index_block_table=case["index_block_table"], topk=cfg.topk,
                       k_scale=k_scale, v_scale=v_scale, local_blocks=LOCAL_BLOCKS,
                       initial_blocks=INITIAL_BLOCKS)


def attention_with_selection(case, res, kv_fmt, k_scale, v_scale, topk) -> np.ndarray:
    """Exact-schedule attention of a pipeline run's q on its own (quantised) KV cache with
    another selection (the exact step's): the KV values' cost without selection changes."""
    f, step = res.fused, case["step"]
    args = dict(k_scale=k_scale, v_scale=v_scale)
    if case["mode"] == "prefill":
        return sparse_attention_prefill(f["q"], f["kv_cache"], kv_fmt, case["block_table"],
                                        step["cu_seqlens_q"], step["seq_lens"], topk, **args)
    return sparse_attention_decode(f["q"], f["kv_cache"], kv_fmt, case["block_table"],
                                   step["seq_lens"], topk, step["rows_per_request"], **args)


def exact_values(case) -> dict:
    """Unquantised values: per request, K (exact post-RoPE), V and index_k (exact) of every
    position ``[seq, ...]``; for the step's rows, q (bf16, as the fused op emits it) and
    index_q (exact)."""
    out = {"k": [], "v": [], "index_k": []}
    starts = case["starts"]
    for r in range(len(starts) - 1):
        t = _transform(case, case["rows"][starts[r]:starts[r + 1]],
                       np.arange(starts[r + 1] - starts[r]))
        out["k"].append(t["k_exact"])
        out["v"].append(t["v"])
        out["index_k"].append(t["index_k_exact"])
    _, pos = step_positions(case)
    t = _transform(case, case["step"]["rows"], pos)
    out.update(q=t["q"], index_q=t["index_q_exact"])
    return out


def value_selection(case, index_q, index_k) -> np.ndarray:
    """``[Hi, T, K]`` selection from values: block scores ``max_{j in b, j <= p} index_q .
    index_k_j`` (float64), ranked by ``reference.indexer.select_blocks``."""
    req, pos = step_positions(case)
    page, hi = case["cfg"].page, index_q.shape[1]
    nvis = pos // page + 1
    nb = int(nvis.max())
    scores = np.full((len(pos), hi, nb), -np.inf)
    for r, keys in enumerate(index_k):
        rows = np.flatnonzero(req == r)
        n = -(-len(keys) // page) * page
        dots = np.full((rows.size, hi, n), -np.inf)
        dots[..., :len(keys)] = index_q[rows] @ keys.T
        past = np.arange(n)[None, :] > pos[rows][:, None]  # keys past p
        dots = np.where(past[:, None, :], -np.inf, dots)
        blocks = dots.reshape(rows.size, hi, n // page, page).max(axis=-1)
        scores[rows, :, :blocks.shape[2]] = blocks
    return select_blocks(scores.transpose(1, 0, 2), nvis, case["cfg"].topk, LOCAL_BLOCKS,
                         INITIAL_BLOCKS)


def value_attention(case, q, k, v, topk) -> np.ndarray:
    """``[T, Hq, D]`` block-sparse GQA attention from values: query head h of a row at
    position p reads KV head h // G over the keys j <= p of its selected blocks."""
    req, pos = step_positions(case)
    page, grp = case["cfg"].page, case["cfg"].group
    out = np.zeros(q.shape)
    scale = 1.0 / np.sqrt(q.shape[2])
    for r in range(len(k)):
        rows = np.flatnonzero(req == r)
        j = np.arange(len(k[r]))
        for g in range(k[r].shape[1]):
            chosen = np.zeros((rows.size, j[-1] // page + 2), bool)  # last column: -1
            np.put_along_axis(chosen, np.where(topk[g, rows] >= 0, topk[g, rows], -1), True,
                              axis=1)
            sees = chosen[:, j // page] & (j[None, :] <= pos[rows][:, None])
            heads = slice(g * grp, (g + 1) * grp)
            logits = scale * q[rows, heads] @ k[r][:, g].T  # [n, G, seq]
            logits = np.where(sees[:, None, :], logits, -np.inf)
            p = np.exp(logits - logits.max(axis=-1, keepdims=True))
            out[rows, heads] = (p @ v[r][:, g]) / p.sum(axis=-1)[..., None]
    return out


def value_step(case, values) -> tuple[np.ndarray, np.ndarray]:
    """(out, topk) of the step computed from values (``exact_values`` gives the exact
    step)."""
    topk = value_selection(case, values["index_q"], values["index_k"])
    return value_attention(case, values["q"], values["k"], values["v"], topk), topk


def cached_values(case, res, kv_fmt, index_fmt, k_scale=None, v_scale=None) -> dict:
    """The values a pipeline run's caches hold (decoded, scales applied) in the layout of
    ``exact_values``, with the run's q and index_q: ``value_step`` of them is that run's
    step computed from values."""
    f, out = res.fused, {"k": [], "v": [], "index_k": []}
    for r, n in enumerate(case["step"]["seq_lens"]):
        pos = np.arange(n)
        kh, vh = zip(*(gather_kv(f["kv_cache"], kv_fmt, case["block_table"][r], pos, g,
                                 k_scale, v_scale) for g in range(case["cfg"].kv_heads)))
        out["k"].append(np.stack(kh, axis=1))
        out["v"].append(np.stack(vh, axis=1))
        out["index_k"].append(gather_index_keys(f["index_cache"], index_fmt,
                                                case["index_block_table"][r], pos))
    out.update(q=f["q"], index_q=f["index_q_values"])
    return out


# ------------------------------------------------------------------------------ metrics


def rel_rmse(out, ref) -> float:
    """``||out - ref||_2 / ||ref||_2`` over every element."""
    return float(np.linalg.norm((out - ref).ravel()) / np.linalg.norm(ref.ravel()))


def max_abs_rel(out, ref) -> float:
    """``max |out - ref| / max |ref|``."""
    return float(np.max(np.abs(out - ref)) / np.max(np.abs(ref)))


def selection_change_fraction(topk, ref_topk) -> float:
    """Fraction of (index head, row) selections whose set of blocks differs (-1 ignored:
    both sides select min(K, visible blocks) blocks, so sorted rows compare as sets)."""
    a, b = np.sort(topk, axis=-1), np.sort(ref_topk, axis=-1)
    return float(np.mean(np.any(a != b, axis=-1)))


# ------------------------------------------------------------------------------ driver


def configurations(scale_kinds=SCALE_KINDS):
    """(kv_cache_dtype, platform, kv format, index format, scale kind) of every run."""
    for dtype, plat in CACHES:
        fmt = kv_cache_format(dtype, plat, MODEL_DTYPE)
        ifmt = index_cache_format(is_fp8(fmt), plat, MODEL_DTYPE)
        for kind in (scale_kinds if is_fp8(fmt) else ("none",)):
            yield dtype, plat, fmt, ifmt, kind


def measure(case, exact: dict, dtype, plat, fmt, ifmt, kind) -> dict:
    """One row of the report: a cached run of the case against the exact step (``exact``:
    its ``exact_values`` plus ``out`` and ``topk``)."""
    ks, vs = case_scales(exact, fmt, kind)
    res = run_cached(case, exact, fmt, ifmt, ks, vs)
    same_sel = attention_with_selection(case, res, fmt, ks, vs, exact["topk"])
    return dict(mode=case["mode"], dist=case["dist"], seed=case["seed"],
                kv_cache_dtype=dtype, platform=plat, kv_fmt=fmt, index_fmt=ifmt, scales=kind,
                k_scale=None if ks is None else float(ks),
                v_scale=None if vs is None else float(vs),
                rel_rmse=rel_rmse(res.out, exact["out"]),
                max_abs_rel=max_abs_rel(res.out, exact["out"]),
                topk_changed=selection_change_fraction(res.topk, exact["topk"]),
                rel_rmse_exact_selection=rel_rmse(same_sel, exact["out"]),
                rows=int(res.out.shape[0]), selections=int(np.prod(res.topk.shape[:2])))


def exact_step(case) -> dict:
    """The case's ``exact_values`` plus the exact step's ``out`` and ``topk``."""
    exact = exact_values(case)
    exact["out"], exact["topk"] = value_step(case, exact)
    return exact


def run(quick=False, seed=0, modes=MODES, dists=DISTS, progress=True) -> dict:
    """Every (mode, distribution, configuration) row; the report document."""
    cfg = QUICK if quick else DEFAULT
    t0, rows = time.perf_counter(), []
    for mode in modes:
        for dist in dists:
            case = make_case(mode, dist, seed, cfg)
            exact = exact_step(case)
            for conf in configurations():
                rows.append(measure(case, exact, *conf))
                if progress:
                    r = rows[-1]
                    print(f"{mode:7s} {dist:13s} {r['kv_fmt']:9s} {r['scales']:4s} "
                          f"rel RMSE {r['rel_rmse']:.3e}  top-k changed "
                          f"{r['topk_changed']:.3f}  ({time.perf_counter() - t0:.0f} s)",
                          file=sys.stderr, flush=True)
    return dict(schema=SCHEMA, quick=quick, seed=seed, config=asdict(cfg),
                model_dtype=MODEL_DTYPE, target_fmt=TARGET_FMT, local_blocks=LOCAL_BLOCKS,
                initial_blocks=INITIAL_BLOCKS, seconds=round(time.perf_counter() - t0, 1),
                numpy=np.__version__, python=_platform.python_version(), rows=rows)


def markdown(doc) -> str:
    c = doc["config"]
    lines = [
        "# End-to-end accuracy cost of the KV cache format (float64 reference, CPU)",
        "",
        f"One sparse-attention step (fused norm + RoPE + insert -> indexer -> block-sparse "
        f"attention, exact schedule) against the same step without quantisation "
        f"(oracle/e2e.py). Hkv {c['kv_heads']}, G {c['group']}, D {c['head_dim']}, "
        f"R {c['rotary_dim']}, P {c['page']}, K {c['topk']}; prefill: prefixes "
        f"{list(c['prefixes'])} + {list(c['new_tokens'])} new tokens; decode: contexts "
        f"{list(c['contexts'])}, {c['rows_per_request']} rows each. Seed {doc['seed']}"
        f"{' (quick)' if doc['quick'] else ''}; {doc['seconds']} s.",
        "",
        "rel RMSE = ||out - exact|| / ||exact||; max err = max |out - exact| / max |exact|; "
        "top-k changed = fraction of (row, head) selections whose block set differs from "
        "the exact step's; rel RMSE (exact sel.) = the same cache read with the exact "
        "step's selection. Scales: amax = max|x| / fmt_max per tensor (K and V), unit = 1.0.",
        "fp8 KV caches come with the platform's e4m3 index cache, so rows sharing an index "
        "format share their selections. Random data: block scores are close to one another "
        "(selection changes are frequent) and outputs are averages of many random V rows, "
        "so absolute numbers are no prediction of a trained model's accuracy; compare rows.",
        "",
        "| mode | dist | cache | platform | index | scales | rel RMSE | max err | "
        "top-k changed | rel RMSE (exact sel.) |",
        "|---|---|---|---|---|---|---:|---:|---:|---:|",
    ]
    for r in doc["rows"]:
        plat = "any" if r["scales"] == "none" else r["platform"]
        lines.append(f"| {r['mode']} | {r['dist']} | {r['kv_fmt']} | {plat} | "
                     f"{r['index_fmt']} | {r['scales']} | {r['rel_rmse']:.2e} | "
                     f"{r['max_abs_rel']:.2e} | {r['topk_changed']:.3f} | "
                     f"{r['rel_rmse_exact_selection']:.2e} |")
    return "\n".join(lines) + "\n"


def write(doc, out) -> tuple[Path, Path]:
    """OUT.json and OUT.md beside it."""
    from oracle.report import write_json

    out = write_json(doc, Path(out).with_suffix(".json"))
    md = out.with_suffix(".md")
    md.write_text(markdown(doc))
    return out, md
