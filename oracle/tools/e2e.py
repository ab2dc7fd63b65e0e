"""End-to-end accuracy cost of fp8 KV caches: the float64 reference pipeline, and beside it
the same step through a registered implementation of each op (the project's kernels).

One sparse-attention step (``reference.pipeline.sparse_step``: fused norm + RoPE + insert
-> indexer -> block-sparse attention) runs on a batch whose prefixes are already cached,
once per cache configuration, and is compared with the same step computed WITHOUT any
cache quantisation. The reference pipeline's numbers (the row's top-level metrics) are
what the cache format alone costs, before any kernel rounding. With ``impl`` (``python -m
oracle e2e --impl triton``) the same step also runs through that name's registered
implementations (``kernel_step``; the row's ``"kernel"`` columns, see "The kernel
pipeline" below). The command's default ``--impl reference`` runs the reference's own
registered ops that way (the plumbing check); ``run(impl=None)``, the reference alone.

Choices (each one deliberate; the JSON records the configuration):

- Inputs. Per (mode, distribution, seed) one input set, shared by every cache
  configuration, so the rows of one (mode, distribution) compare formats on identical
  data. Its generator is ``oracle.core.rand.generator(case_seed(mode, dist, seed))`` (sha256 of
  ``"e2e:MODE:DIST:SEED"``, as ``oracle.core.cases`` derives its seeds), and all values come
  from ``oracle.core.cases.draw_values`` rounded to bf16: a seed gives the same bits on any
  machine up to the rare last-ulp differences of libm (``oracle.core.rand``) and of NumPy's
  float32 cos/sin in the RoPE table (``reference.norm_rope.rope_table``), and float64
  summation order (BLAS) moves the last digits and may flip a near-tie selection: the
  H200 machine's reference columns differ from this CPU's in the last digits and, in a
  few rows, by one selection. Within one report both pipelines read identical inputs.
  Packed rows ``[q | k | v | index_q | index_k]`` for every token of every request (prefix
  and new tokens), the four norm weights, and the shuffled block tables (the KV cache and
  the index cache each with its own) are drawn from it, in that order.
- Distributions of the packed rows (values before bf16 rounding; ``draw_values``):
  ``normal`` N(0, 1); ``outliers`` N(0, 1) plus N(0, 10^2) on 0.1% of entries (no Inf/NaN:
  an output error is meaningless with them); ``near_overflow`` +-448 x U(0.85, 1.15) (around
  e4m3fn's max, so above e4m3fnuz's 240 and far below e5m2's 57344) with norm weights
  4 N(0, 1) instead of 0.3 N(0, 1) (large post-norm K, as in ``oracle.core.cases``); ``tiny``
  +-2^-9 x 2^U(-2, 4) (around e4m3fn's min subnormal). q, k and the index parts go through
  RMSNorm, which removes their overall magnitude; V is stored as drawn, so the magnitude
  distributions act mostly on V (and the outliers on K's shape as well).
- Shapes (``DEFAULT``; ``QUICK`` is smaller, ``TINY`` interpreter-sized): Hkv 2, G 4
  (Hq 8), Hi = Hkv, D 128, R 64, P 64, K 8, one forced local block, no initial block,
  RoPE base 5e6, eps 1e-6, bf16 activations. Prefill: 3 requests with cached prefixes
  997, 2411, 3290 and 160, 96, 224 new tokens. Decode: 8 requests of 777 .. 4001 tokens,
  2 rows each (16 rows: its selection-change fractions are counts out of 32). No length
  is a multiple of P; K = 8 of up to 63 visible blocks, so the selection is a real choice.
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
- The kernel pipeline (``kernel_step``, ``measure_kernel``): on the same inputs, the same
  poisoned caches holding the same prefixes (written by ``write_prefixes``, as for the
  reference pipeline: the prefixes are not the implementation's writes), the
  implementation's ``norm_rope_insert`` of the step's rows, its ``indexer_{mode}`` on the
  index cache and the index_q it wrote, and its ``attention_{mode}`` of the q it returned
  on the KV cache it wrote with the selection its indexer made. Each op gets the input
  dict ``oracle.core.cases.make_inputs`` builds for it (same keys and conventions:
  ``insert_inputs``, ``indexer_inputs``, ``attention_inputs``) and returns what
  ``oracle.core.registry`` describes; outputs in codes are decoded. The registered insert op
  takes one slot mapping for both caches while the case gives the index cache its own
  block table: the insert gets the index cache with its pages relabelled in the KV
  cache's page order (``kv_to_index_pages``), and the pages go back afterwards (the keys
  land where ``index_block_table`` says; every byte as in ``sparse_step``, tested).
- Which implementations run: ``resolve_impls`` takes the name's implementation of each of
  the step's three ops that runs on this machine (a CPU one runs anywhere). Each row's
  three ops are judged by ``Implementation.supports`` on the nearest ``oracle.core.cases.Case``
  (``nearest_case``: the row's op, platform, kv_cache_dtype, model dtype, distribution,
  seed, scales ``tensor`` for amax and ``none`` for unit, and ``nearest_shape_class``: the
  smallest class whose per-request context and new tokens cover the step: ``TINY`` is
  tiny, ``QUICK`` small, ``DEFAULT`` model). A row with an op missing or unclaimed is
  reported as skipped with every reason, never dropped. So on a CPU machine, where the
  interpreted Triton prefill attention claims tiny only, ``--impl triton --quick`` skips
  the prefill rows (``--tiny`` runs them); compiled (CUDA) every class up to model runs.
- Kernel metrics (``measure_kernel``): rel RMSE, max error and top-k changes against the
  exact step, as for the reference; ``topk_vs_reference``: the fraction of selections
  that differ from the reference pipeline's (same quantised caches); and the output
  against the reference pipeline's rounded once to the model dtype (what the reference's
  attention op returns; ``rel_rmse_ref_rounded`` / ``max_abs_rel_ref_rounded`` are its
  own metrics): ``rel_rmse_vs_reference`` over every (row, head), ``..._same_selection``
  over those whose selection agrees (the kernels' arithmetic without selection flips).
  The ops return model-dtype outputs, so a kernel's numbers include that rounding (at
  most 2^-9 of each element in bf16); with ``impl="reference"`` the kernel columns are the
  rounded reference's exactly (tests/test_e2e.py).
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

from oracle.core import rand
from oracle.core.cases import Case, draw_values, poison_code, to_model
from oracle.impls.catalog import device_name, load_all
from reference.attention import (
    decode_positions,
    prefill_positions,
    sparse_attention_decode,
    sparse_attention_prefill,
)
from reference.codec import FORMATS, decode, round_to
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
from reference.pipeline import new_token_slots, sparse_step
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
#: Interpreter-sized (every context within 4 pages of 16 tokens: shape class ``tiny``, which
#: every registered implementation claims); K = 2 of up to 4 visible blocks, one forced.
TINY = Config(2, 2, 64, 32, 16, 2, (29, 45), (11, 17), (37, 64, 50), 2)
CONFIGS = {"default": DEFAULT, "quick": QUICK, "tiny": TINY}


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


# ------------------------------------------------------------------------------ kernels


#: (largest context, largest new tokens per request) of each shape class of
#: ``oracle.core.cases`` (tiny: 4 pages of 16, up to 24 new tokens; small: 24 pages of up to 128,
#: up to 96; model: 64 pages of 128, up to 256), smallest first; beyond them: ``long``
#: (``sweep`` for the insert op, its class for compiled kernels).
SHAPE_LIMITS = (("tiny", 64, 24), ("small", 24 * 128, 96), ("model", 64 * 128, 256))


def pipeline_ops(mode: str) -> tuple[str, str, str]:
    """The registry ops of one step, in order: insert, indexer, attention."""
    return ("norm_rope_insert", f"indexer_{mode}", f"attention_{mode}")


def nearest_shape_class(cfg: Config, mode: str, op: str = "attention_decode") -> str:
    """The shape class of the nearest ``oracle.core.cases.Case`` to a configuration's step: the
    smallest class (``SHAPE_LIMITS``) whose largest context and new tokens per request
    cover the step's (decode: its rows per request), the same for the step's three ops
    (``long`` becomes ``sweep`` for the insert op). Requests, heads, D and P do not enter:
    the classes' limits are per request, and every class spans the shapes of ``Config``."""
    if mode == "prefill":
        ctx = max(p + n for p, n in zip(cfg.prefixes, cfg.new_tokens))
        new = max(cfg.new_tokens)
    else:
        ctx, new = max(cfg.contexts), cfg.rows_per_request
    for name, max_ctx, max_new in SHAPE_LIMITS:
        if ctx <= max_ctx and new <= max_new:
            return name
    return "sweep" if op == "norm_rope_insert" else "long"


def nearest_case(op: str, mode: str, dist: str, seed: int, cfg: Config, dtype: str,
                 plat: str, kind: str) -> Case:
    """The ``Case`` an implementation's ``supports`` judges one (op, configuration) by: the
    configuration's op, platform, kv_cache_dtype, model dtype, distribution and seed,
    ``nearest_shape_class``, and scales ``tensor`` for ``amax`` (one float32 scalar each
    for K and V) or ``none`` (``unit`` passes no scale, as the reference pipeline does)."""
    return Case(op, nearest_shape_class(cfg, mode, op), dist, plat, dtype, MODEL_DTYPE,
                "tensor" if kind == "amax" else "none", seed)


def resolve_impls(name: str, modes=MODES, device: str = "cpu") -> dict:
    """op -> the registered implementation ``name`` of every op the modes' steps call that
    runs on this machine (``device`` among its devices, or a CPU implementation: those run
    on any machine), or a string saying why there is none (reported as a skip).
    ValueError if no op has an implementation of that name
    (``oracle.core.registry.implementations``)."""
    from oracle.core.registry import implementations

    found = {}
    for op in dict.fromkeys(op for m in modes for op in pipeline_ops(m)):
        impls = implementations(op, [name])
        here = [i for i in impls if device in i.devices or "cpu" in i.devices]
        found[op] = (here[0] if here else
                     f"{op} {name!r} needs {'/'.join(impls[0].devices)}, not {device}"
                     if impls else f"no implementation {name!r} of {op}")
    return found


def unclaimed(impls: dict, case, conf) -> str | None:
    """Why the implementations ``impls`` (``resolve_impls``) do not run a configuration's
    step, or None: every op of the step must have an implementation that claims its
    ``nearest_case``; every refusal is named (op, implementation, its reason)."""
    dtype, plat, _, _, kind = conf
    why = []
    for op in pipeline_ops(case["mode"]):
        impl = impls.get(op, f"no implementation of {op}")
        if isinstance(impl, str):
            why.append(impl)
            continue
        c = nearest_case(op, case["mode"], case["dist"], case["seed"], case["cfg"], dtype,
                         plat, kind)
        ok, reason = impl.supports(c)
        if not ok:
            why.append(f"{op} {impl.name!r} does not claim {reason}")
    return "; ".join(why) or None


def kv_to_index_pages(case) -> np.ndarray:
    """``perm[kv_page]``: the index-cache page that holds what the KV cache's page holds
    (the two block tables side by side; the spare pages paired in order). The insert op
    of the registry takes one slot mapping for both caches, so the kernel pipeline passes
    it ``index_cache[perm]`` (the same cache, its pages relabelled in the KV cache's
    order) and puts the pages back afterwards: the index keys land where
    ``index_block_table`` says, as in ``sparse_step``."""
    n = case["num_pages"]
    kv_pages, index_pages = case["block_table"].ravel(), case["index_block_table"].ravel()
    perm = np.empty(n, np.int64)
    perm[kv_pages] = index_pages
    perm[np.setdiff1d(np.arange(n), kv_pages)] = np.setdiff1d(np.arange(n), index_pages)
    return perm


def _step_args(case) -> dict:
    step = case["step"]
    if case["mode"] == "prefill":
        return dict(seq_lens=step["seq_lens"], cu_seqlens_q=step["cu_seqlens_q"])
    return dict(seq_lens=step["seq_lens"], rows_per_request=step["rows_per_request"])


def insert_inputs(case, kv, kv_fmt, index_cache, index_fmt, k_scale, v_scale) -> dict:
    """The ``norm_rope_insert`` input dict (``oracle.core.cases``' keys) of the step's rows: KV
    slots from ``block_table`` (``new_token_slots``), ``index_cache`` already in the KV
    cache's page order (``kv_to_index_pages``)."""
    cfg, layout, w = case["cfg"], case["layout"], case["weights"]
    req, pos = step_positions(case)
    slots = new_token_slots(case["block_table"], req, pos, cfg.page, case["num_pages"])
    return dict(rows=case["step"]["rows"], positions=np.maximum(pos, 0), slot_mapping=slots,
                kv_cache=kv, kv_fmt=kv_fmt, model_dtype=MODEL_DTYPE, cache_layout="HND",
                k_scale=k_scale, v_scale=v_scale, num_q_heads=layout.num_q_heads,
                num_kv_heads=layout.num_kv_heads, head_dim=layout.head_dim,
                num_index_heads=layout.num_index_heads, has_index_k=layout.has_index_k,
                rotary_dim=cfg.rotary_dim, eps=MODEL.eps, weights_q=w["q"], weights_k=w["k"],
                weights_index_q=w["index_q"], weights_index_k=w["index_k"],
                rope_table=case["table"], index_cache=index_cache, index_fmt=index_fmt)


def indexer_inputs(case, index_q, index_cache, index_fmt) -> dict:
    """The ``indexer_{mode}`` input dict: index_q as values, the index cache's codes, its
    own block table."""
    return dict(index_q=index_q, index_cache=index_cache, index_fmt=index_fmt,
                block_table=case["index_block_table"], topk=case["cfg"].topk,
                local_blocks=LOCAL_BLOCKS, initial_blocks=INITIAL_BLOCKS,
                model_dtype=MODEL_DTYPE, **_step_args(case))


def attention_inputs(case, q, kv, kv_fmt, topk, k_scale, v_scale) -> dict:
    """The ``attention_{mode}`` input dict: q as model-dtype values, the KV cache's codes."""
    return dict(q=q, kv_cache=kv, kv_fmt=kv_fmt, block_table=case["block_table"], topk=topk,
                k_scale=k_scale, v_scale=v_scale, model_dtype=MODEL_DTYPE,
                cache_layout="HND", **_step_args(case))


def kernel_step(case, exact, kv_fmt, index_fmt, impls: dict, k_scale=None,
                v_scale=None) -> dict:
    """The step through registered implementations (``impls``: op -> Implementation): the
    same poisoned caches holding the same prefixes as ``run_cached`` (``write_prefixes``:
    the prefixes are not the implementation's writes), then its insert of the step's rows,
    its indexer on the index cache and index_q it wrote, and its attention of the q it
    returned on the KV cache it wrote and the selection its indexer made. Returns ``out``
    (the attention's model-dtype codes as values), ``topk``, ``q``, ``index_q`` and both
    caches."""
    mode, md = case["mode"], MODEL_DTYPE
    kv, ic = empty_caches(case, kv_fmt, index_fmt)
    write_prefixes(case, exact, kv, kv_fmt, ic, index_fmt, k_scale, v_scale)
    perm = kv_to_index_pages(case)
    ins = impls["norm_rope_insert"].run(
        insert_inputs(case, kv, kv_fmt, ic[perm], index_fmt, k_scale, v_scale))
    kv = ins["kv_cache"]
    ic = np.empty_like(ic)
    ic[perm] = ins["index_cache"]
    q, index_q = decode(ins["q"], md), decode(ins["index_q"], index_fmt)
    topk = np.asarray(impls[f"indexer_{mode}"].run(
        indexer_inputs(case, index_q, ic, index_fmt))["topk"])
    out = impls[f"attention_{mode}"].run(
        attention_inputs(case, q, kv, kv_fmt, topk, k_scale, v_scale))["out"]
    return dict(out=decode(out, md), topk=topk, q=q, index_q=index_q, kv_cache=kv,
                index_cache=ic)


def same_selection_heads(topk, ref_topk, group: int) -> np.ndarray:
    """bool ``[T, Hq]``: query head h of row t reads the same block set in both selections
    (those of its KV head h // G)."""
    same = np.all(np.sort(topk, axis=-1) == np.sort(ref_topk, axis=-1), axis=-1)  # [Hi, T]
    return np.repeat(same.T, group, axis=1)


def measure_kernel(case, exact, res, conf, impls: dict, name: str) -> dict:
    """The kernel pipeline's columns of one row (``res``: the reference pipeline's run of
    the same configuration): status ``ran`` with the row's metrics against the exact step
    (rel_rmse, max_abs_rel, topk_changed), its selection against the reference
    pipeline's (topk_vs_reference), its output against the reference pipeline's output
    rounded once to the model dtype (what the reference's attention op returns:
    rel_rmse_vs_reference over every (row, head), ..._same_selection over those whose
    selection agrees, None if none), and that rounded output's own metrics
    (rel_rmse_ref_rounded, max_abs_rel_ref_rounded); or status ``skipped`` with the reason
    (``unclaimed``)."""
    why = unclaimed(impls, case, conf)
    if why is not None:
        return dict(impl=name, status="skipped", reason=why)
    dtype, plat, fmt, ifmt, kind = conf
    ks, vs = case_scales(exact, fmt, kind)
    t0 = time.perf_counter()
    k = kernel_step(case, exact, fmt, ifmt, impls, ks, vs)
    seconds = time.perf_counter() - t0
    ref = round_to(res.out, MODEL_DTYPE)
    same = same_selection_heads(k["topk"], res.topk, case["cfg"].group)
    return dict(impl=name, status="ran", rel_rmse=rel_rmse(k["out"], exact["out"]),
                max_abs_rel=max_abs_rel(k["out"], exact["out"]),
                topk_changed=selection_change_fraction(k["topk"], exact["topk"]),
                topk_vs_reference=selection_change_fraction(k["topk"], res.topk),
                rel_rmse_vs_reference=rel_rmse(k["out"], ref),
                rel_rmse_vs_reference_same_selection=(
                    rel_rmse(k["out"][same], ref[same]) if same.any() else None),
                rel_rmse_ref_rounded=rel_rmse(ref, exact["out"]),
                max_abs_rel_ref_rounded=max_abs_rel(ref, exact["out"]),
                seconds=round(seconds, 3))


# ------------------------------------------------------------------------------ driver


def configurations(scale_kinds=SCALE_KINDS, caches=CACHES):
    """(kv_cache_dtype, platform, kv format, index format, scale kind) of every run."""
    for dtype, plat in caches:
        fmt = kv_cache_format(dtype, plat, MODEL_DTYPE)
        ifmt = index_cache_format(is_fp8(fmt), plat, MODEL_DTYPE)
        for kind in (scale_kinds if is_fp8(fmt) else ("none",)):
            yield dtype, plat, fmt, ifmt, kind


def measure(case, exact: dict, dtype, plat, fmt, ifmt, kind, impls: dict | None = None,
            impl_name: str | None = None) -> dict:
    """One row of the report: a cached run of the case against the exact step (``exact``:
    its ``exact_values`` plus ``out`` and ``topk``); with ``impls`` (op ->
    Implementation, ``resolve_impls``) also the kernel pipeline's columns under
    ``"kernel"`` (``measure_kernel``)."""
    ks, vs = case_scales(exact, fmt, kind)
    res = run_cached(case, exact, fmt, ifmt, ks, vs)
    same_sel = attention_with_selection(case, res, fmt, ks, vs, exact["topk"])
    row = dict(mode=case["mode"], dist=case["dist"], seed=case["seed"],
               kv_cache_dtype=dtype, platform=plat, kv_fmt=fmt, index_fmt=ifmt, scales=kind,
               k_scale=None if ks is None else float(ks),
               v_scale=None if vs is None else float(vs),
               rel_rmse=rel_rmse(res.out, exact["out"]),
               max_abs_rel=max_abs_rel(res.out, exact["out"]),
               topk_changed=selection_change_fraction(res.topk, exact["topk"]),
               rel_rmse_exact_selection=rel_rmse(same_sel, exact["out"]),
               rows=int(res.out.shape[0]), selections=int(np.prod(res.topk.shape[:2])))
    if impls is not None:
        row["kernel"] = measure_kernel(case, exact, res, (dtype, plat, fmt, ifmt, kind),
                                       impls, impl_name)
    return row


def exact_step(case) -> dict:
    """The case's ``exact_values`` plus the exact step's ``out`` and ``topk``."""
    exact = exact_values(case)
    exact["out"], exact["topk"] = value_step(case, exact)
    return exact


def _progress_line(r, t0) -> str:
    line = (f"{r['mode']:7s} {r['dist']:13s} {r['kv_fmt']:9s} {r['scales']:4s} "
            f"rel RMSE {r['rel_rmse']:.3e}  top-k changed {r['topk_changed']:.3f}")
    k = r.get("kernel")
    if k is not None:
        line += (f"  | {k['impl']}: rel RMSE {k['rel_rmse']:.3e}  top-k changed "
                 f"{k['topk_changed']:.3f}" if k["status"] == "ran" else
                 f"  | {k['impl']}: skipped")
    return f"{line}  ({time.perf_counter() - t0:.0f} s)"


def pair_rows(mode, dist, seed, cfg, impls=None, impl_name=None, caches=CACHES,
              scale_kinds=SCALE_KINDS, progress=True, t0=None) -> list[dict]:
    """The rows of one (mode, distribution): its input set, its exact step, one row per
    configuration."""
    t0 = time.perf_counter() if t0 is None else t0
    case = make_case(mode, dist, seed, cfg)
    exact = exact_step(case)
    rows = []
    for conf in configurations(scale_kinds, caches):
        rows.append(measure(case, exact, *conf, impls=impls, impl_name=impl_name))
        if progress:
            print(_progress_line(rows[-1], t0), file=sys.stderr, flush=True)
    return rows


def _pair_rows_named(mode, dist, seed, cfg, impl, device, caches, scale_kinds, progress):
    """``pair_rows`` in a worker process: the implementations registered and resolved
    there by name."""
    load_all()
    impls = None if impl is None else resolve_impls(impl, (mode,), device)
    return pair_rows(mode, dist, seed, cfg, impls, impl, caches, scale_kinds, progress)


def run(quick=False, seed=0, modes=MODES, dists=DISTS, progress=True, impl=None,
        impls=None, config=None, caches=CACHES, scale_kinds=SCALE_KINDS, workers=1,
        device=None) -> dict:
    """Every (mode, distribution, configuration) row; the report document.

    config      a ``Config`` (default ``QUICK`` if ``quick`` else ``DEFAULT``).
    impl        None: the reference pipeline alone (the rows as they always were); a
                registered implementation name: also the kernel pipeline through that
                name's implementations of the step's ops on ``device`` (default: cuda
                where torch sees one, else cpu), each row's columns under ``"kernel"``.
    impls       op -> Implementation (or a string: why there is none), instead of the
                registry's (a wrapped or deliberately broken implementation); ``impl``
                names it in the report (default "custom"). Not with ``workers`` > 1.
    workers     processes, one (mode, distribution) each at a time (spawned; each
                resolves ``impl`` itself); rows in the same order as with one.
    caches, scale_kinds: the configurations measured (default: all).
    """
    cfg = config if config is not None else QUICK if quick else DEFAULT
    with_kernels = impl is not None or impls is not None
    if impls is not None and workers > 1:
        raise ValueError("impls (implementation objects) run in this process: workers must "
                         "be 1")
    if workers < 1:
        raise ValueError(f"workers must be >= 1, got {workers}")
    device = device or (device_name() if with_kernels else "cpu")
    name = impl if impl is not None else "custom"
    if impl is not None and impls is None:
        impls = resolve_impls(impl, modes, device)  # ValueError for an unknown name, here
    t0, pairs = time.perf_counter(), [(m, d) for m in modes for d in dists]
    if workers == 1:
        rows = [r for m, d in pairs for r in pair_rows(
            m, d, seed, cfg, impls, name if with_kernels else None, caches, scale_kinds,
            progress, t0)]
    else:
        import multiprocessing
        from concurrent.futures import ProcessPoolExecutor

        with ProcessPoolExecutor(min(workers, len(pairs)),
                                 mp_context=multiprocessing.get_context("spawn")) as pool:
            futures = [pool.submit(_pair_rows_named, m, d, seed, cfg, impl, device, caches,
                                   scale_kinds, progress) for m, d in pairs]
            rows = [r for f in futures for r in f.result()]
    doc = dict(schema=SCHEMA, quick=quick, seed=seed, config=asdict(cfg),
               model_dtype=MODEL_DTYPE, target_fmt=TARGET_FMT, local_blocks=LOCAL_BLOCKS,
               initial_blocks=INITIAL_BLOCKS, seconds=round(time.perf_counter() - t0, 1),
               numpy=np.__version__, python=_platform.python_version(), rows=rows)
    if with_kernels:
        from oracle.core.report import machine_info

        doc.update(impl=name, device=device, machine=machine_info(),
                   config_name=next((k for k, v in CONFIGS.items() if v == cfg), "custom"),
                   shape_classes={m: nearest_shape_class(cfg, m) for m in modes},
                   interpreted=device == "cpu" and _interpreted(impls), workers=workers,
                   kernel_seconds=round(sum(r["kernel"].get("seconds", 0.0)
                                            for r in rows), 1))
    return doc


def _interpreted(impls: dict) -> bool:
    """Whether any of the implementations is one of the project's kernels (their adapters:
    ``oracle.impls.adapters``) running under the Triton interpreter."""
    import os

    ours = any(getattr(i.run, "__module__", "") == "oracle.impls.adapters"
               for i in impls.values() if not isinstance(i, str))
    return ours and os.environ.get("TRITON_INTERPRET") == "1"


def _config_line(doc) -> str:
    c = doc["config"]
    label = doc.get("config_name", "quick" if doc["quick"] else "default")
    return (f"Hkv {c['kv_heads']}, G {c['group']}, D {c['head_dim']}, R {c['rotary_dim']}, "
            f"P {c['page']}, K {c['topk']}; prefill: prefixes {list(c['prefixes'])} + "
            f"{list(c['new_tokens'])} new tokens; decode: contexts {list(c['contexts'])}, "
            f"{c['rows_per_request']} rows each. Seed {doc['seed']}"
            f"{f' ({label})' if label != 'default' else ''}; {doc['seconds']} s.")


_READING = [
    "fp8 KV caches come with the platform's e4m3 index cache, so rows sharing an index "
    "format share their selections. Random data: block scores are close to one another "
    "(selection changes are frequent) and outputs are averages of many random V rows, "
    "so absolute numbers are no prediction of a trained model's accuracy; compare rows.",
]


def markdown(doc) -> str:
    """The report as Markdown: one table line per row; with a kernel pipeline (``impl`` in
    the document) each metric as ``reference / kernel``."""
    if "impl" in doc:
        return _markdown_both(doc)
    lines = [
        "# End-to-end accuracy cost of the KV cache format (float64 reference, CPU)",
        "",
        f"One sparse-attention step (fused norm + RoPE + insert -> indexer -> block-sparse "
        f"attention, exact schedule) against the same step without quantisation "
        f"(oracle/tools/e2e.py). {_config_line(doc)}",
        "",
        "rel RMSE = ||out - exact|| / ||exact||; max err = max |out - exact| / max |exact|; "
        "top-k changed = fraction of (row, head) selections whose block set differs from "
        "the exact step's; rel RMSE (exact sel.) = the same cache read with the exact "
        "step's selection. Scales: amax = max|x| / fmt_max per tensor (K and V), unit = 1.0.",
        *_READING,
        "",
        "| mode | dist | cache | platform | index | scales | rel RMSE | max err | "
        "top-k changed | rel RMSE (exact sel.) |",
        "|---|---|---|---|---|---|---:|---:|---:|---:|",
    ]
    for r in doc["rows"]:
        lines.append(f"{_row_head(r)} {r['rel_rmse']:.2e} | {r['max_abs_rel']:.2e} | "
                     f"{r['topk_changed']:.3f} | {r['rel_rmse_exact_selection']:.2e} |")
    return "\n".join(lines) + "\n"


def _row_head(r) -> str:
    plat = "any" if r["scales"] == "none" else r["platform"]
    return (f"| {r['mode']} | {r['dist']} | {r['kv_fmt']} | {plat} | {r['index_fmt']} | "
            f"{r['scales']} |")


def _markdown_both(doc) -> str:
    name = doc["impl"]
    where = doc["device"] + (" (Triton interpreter)" if doc.get("interpreted") else "")
    classes = ", ".join(f"{m} {c}" for m, c in doc["shape_classes"].items())
    lines = [
        f"# End-to-end accuracy cost of the KV cache format: float64 reference and the "
        f"`{name}` implementations ({where})",
        "",
        f"One sparse-attention step (fused norm + RoPE + insert -> indexer -> block-sparse "
        f"attention) against the same step without quantisation (oracle/tools/e2e.py), twice "
        f"per row on the same inputs: the float64 reference pipeline (exact schedule, "
        f"unrounded output: the cache's cost alone) and the registered `{name}` "
        f"implementations of the three ops (insert of the step's rows, indexer, attention; "
        f"the prefixes are written by the reference writer, bit-identical to its fused "
        f"op). {_config_line(doc)} Each row's ops are checked against the nearest case "
        f"(shape classes: {classes}); a row no implementation claims is skipped, with the "
        f"reason below. The `{name}` pipelines took {doc['kernel_seconds']} s in all "
        f"(summed over the rows, first calls' compilation included; "
        f"{doc.get('workers', 1)} worker(s)).",
        "",
        f"rel RMSE = ||out - exact|| / ||exact||; max err = max |out - exact| / max "
        f"|exact|; top-k changed = fraction of (row, head) selections whose block set "
        f"differs from the exact step's; each as reference / `{name}`. The ops return "
        f"{doc['model_dtype']} outputs, so `{name}`'s numbers include that one rounding "
        f"(at most 2^-9 relative per element). sel. vs ref = fraction of `{name}`'s "
        f"selections that differ from the reference pipeline's (same caches' formats); vs "
        f"ref (same sel.) = rel RMSE of `{name}`'s output against the reference pipeline's "
        f"rounded once to {doc['model_dtype']}, over the (row, head)s whose selections "
        f"agree; rel RMSE (exact sel.) = the reference on the same cache with the exact "
        f"step's selection. Scales: amax = max|x| / fmt_max per tensor (K and V), unit = "
        f"1.0.",
        *_READING,
        "",
        f"| mode | dist | cache | platform | index | scales | rel RMSE ref / {name} | "
        f"max err ref / {name} | top-k changed ref / {name} | sel. vs ref | "
        f"vs ref (same sel.) | rel RMSE (exact sel.) |",
        "|---|---|---|---|---|---|---:|---:|---:|---:|---:|---:|",
    ]
    skipped: dict[str, dict[str, int]] = {}  # reason -> mode -> rows
    for r in doc["rows"]:
        k = r["kernel"]
        if k["status"] == "ran":
            same = k["rel_rmse_vs_reference_same_selection"]
            cells = (f"{r['rel_rmse']:.2e} / {k['rel_rmse']:.2e} | "
                     f"{r['max_abs_rel']:.2e} / {k['max_abs_rel']:.2e} | "
                     f"{r['topk_changed']:.3f} / {k['topk_changed']:.3f} | "
                     f"{k['topk_vs_reference']:.3f} | "
                     f"{'-' if same is None else f'{same:.2e}'} |")
        else:
            note = skipped.setdefault(k["reason"], {})
            note[r["mode"]] = note.get(r["mode"], 0) + 1
            cells = (f"{r['rel_rmse']:.2e} / skipped | {r['max_abs_rel']:.2e} / skipped | "
                     f"{r['topk_changed']:.3f} / skipped | - | - |")
        lines.append(f"{_row_head(r)} {cells} {r['rel_rmse_exact_selection']:.2e} |")
    if skipped:
        lines += ["", f"Skipped (`{name}` does not run these rows):", ""]
        for reason, modes in skipped.items():
            counts = ", ".join(f"{m} ({n} row{'s' if n > 1 else ''})" for m, n in modes.items())
            lines.append(f"- {counts}: {reason}")
    return "\n".join(lines) + "\n"


def write(doc, out) -> tuple[Path, Path]:
    """OUT.json and OUT.md beside it."""
    from oracle.core.report import write_json

    out = write_json(doc, Path(out).with_suffix(".json"))
    md = out.with_suffix(".md")
    md.write_text(markdown(doc))
    return out, md
