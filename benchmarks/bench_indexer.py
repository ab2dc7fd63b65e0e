"""Speed of the decode indexer: block scores and top-k block selection of
kernels.indexer_decode.indexer_decode at the model shape.

Shape: Hi 4 index heads, D 128, P 128, topk K 16, local_blocks 1 and initial_blocks 0
(reference.domain.MODEL), batch 64, every request a 32,768-token context (256 key
blocks), rows_per_request 1 (the row at position seq_len - 1 sees every key). Two index
caches: ``bf16`` (cache and index_q bf16) and ``e4m3`` (cache and index_q uint8 e4m3fn
codes). Block tables: each request's 256 pages drawn at random from a pool twice the size
needed (harness.shuffled_block_table); cache content N(0, 1) (torch's cast for fp8).
The output is a token-major ``[T, Hi, K]`` int32 buffer passed as its transposed
``[Hi, T, K]`` view, as servers keep it (contract.md s.5).

Implementations, on the same input sets (harness.py: graph replay, rotating sets > 2 x L2;
at the model shape one set already moves 0.5 / 0.27 GB):
- ``triton``: kernels.indexer_decode.indexer_decode with its default split (the launcher's
  per-call workspace allocation and counter fill are part of the measured call).
- ``torch_eager``: ``torch_indexer`` below, plain torch ops (gather the keys through the
  block table, widen to fp32, one batched matmul per request, causal mask, max per block,
  forced local/initial blocks, topk); its kernels are replayed from a graph, so host launch
  overhead is not counted (a conservative baseline). No NaN handling nor the lower-id tie
  rule: acceptable in a speed baseline, never as a reference. fp32 scores (TF32 off, torch's
  default), so its selection should equal the kernel's up to fp32 near-ties: ``agreement``
  runs both on one fresh set (min(B, 8) requests) and reports the shares of equal
  selections.

Minimal bytes (``minimal_bytes``: every input byte read once, every output byte written
once): index keys once per request B * seq_len * D * c (every key is visible to the last
row), index_q B * rows * Hi * D * c, the block-table entries used B * ceil(seq_len / P) * 4,
seq_lens B * 4, output B * rows * Hi * K * 4 (c = 2 for bf16, 1 for e4m3). At the model
shape: bf16 536,870,912 + 65,536 + 65,536 + 256 + 16,384 = 537,018,624 B; e4m3
268,435,456 + 32,768 + 65,536 + 256 + 16,384 = 268,550,400 B. tests/test_bench_sparse.py
checks both.

Target (triton rows): >= 90% of the copy bandwidth measured in the same run. For scale (the
published numbers, NOT measured here; ``for_scale`` in the JSON): vLLM 0.33's Triton index
decode, 144.5 us bf16 = 86% of copy bandwidth, 85.2 us e4m3 = 73%.

Writes a ``bench/1`` JSON (default ``$OUT/bench_indexer.json`` when OUT is set, else
reports/bench_indexer.json; ``--out``) and the Markdown table beside it (render_bench.py).

Run on the GPU machine: ``python -m benchmarks.bench_indexer``; ``--batch 2 --seq-len 2048``
for a quick check. Tuning: ``--knobs "blocks_per_split=8" "lanes_d=8,num_warps=8" ...`` (the
first set makes the results, the others a ``sweep`` list, all in one call), or ``--tune``
for the TUNE list (the launcher's knobs: kernels/indexer_decode.py).
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks import harness, render_bench  # noqa: E402
from reference.domain import MODEL  # noqa: E402

NAME = "bench_indexer"
OP = "indexer_decode"
BATCH = 64
SEQ_LEN = 32_768
ROWS = 1
CACHES = {"bf16": "bfloat16", "e4m3": "e4m3fn"}  # cache name -> index format
IMPLS = ("triton", "torch_eager")
TARGETS = {"copy_fraction": 0.90}
BASELINES = ("torch_eager",)
CHECK_BATCH = 8
FOR_SCALE = [  # vLLM's published numbers, not measured by this benchmark
    {"name": "vllm_0.33_triton", "cache": "bf16", "median_us": 144.5, "copy_fraction": 0.86,
     "source": "published vLLM figure (not measured here)"},
    {"name": "vllm_0.33_triton", "cache": "e4m3", "median_us": 85.2, "copy_fraction": 0.73,
     "source": "published vLLM figure (not measured here)"},
]


@dataclass(frozen=True)
class Shape:
    hi: int = MODEL.num_index_heads
    d: int = MODEL.head_dim
    page: int = MODEL.page_size
    topk: int = MODEL.topk
    local_blocks: int = MODEL.local_blocks
    initial_blocks: int = MODEL.initial_blocks


SHAPE = Shape()


def context_lengths(batch: int, seq_len: int, ragged: bool = False) -> list[int]:
    """Every request's context: seq_len each, or (ragged) spread evenly from seq_len / 8 to
    15 / 8 seq_len in request order (the same mean up to rounding): a batch whose
    requests' key blocks differ up to 15x, as in serving."""
    if not ragged or batch == 1:
        return [seq_len] * batch
    lo, hi = seq_len / 8, seq_len * 15 / 8
    return [max(1, round(lo + (hi - lo) * i / (batch - 1))) for i in range(batch)]


def minimal_bytes(batch: int, seq_len: int, index_fmt: str, rows: int = ROWS,
                  s: Shape = SHAPE, table_bytes: int = 4, ragged: bool = False) -> dict:
    """Bytes the decode indexer must move, by part (see the module docstring); index_q in
    the index cache's format, int32 block table and seq_lens, int32 output; the contexts
    of ``context_lengths``."""
    c = harness.element_bytes(index_fmt)
    lens = context_lengths(batch, seq_len, ragged)
    parts = {"read_index_keys": sum(lens) * s.d * c,
             "read_index_q": batch * rows * s.hi * s.d * c,
             "read_block_table": sum(-(-n // s.page) for n in lens) * table_bytes,
             "read_seq_lens": batch * 4,
             "write_topk": batch * rows * s.hi * s.topk * 4}
    parts["total"] = sum(parts.values())
    return parts


# ---------------------------------------------------------------------------- inputs


@dataclass
class IndexerSet:
    index_q: torch.Tensor  # [B * rows, Hi, D]: bf16 or uint8 codes
    cache: torch.Tensor  # [pool pages, P, D]: bf16 or uint8 codes
    table: torch.Tensor  # int32 [B, ceil(seq_len / P)]
    seq_lens: torch.Tensor  # int32 [B]
    out: torch.Tensor  # int32 token-major [B * rows, Hi, K]; pass out.transpose(0, 1)
    rows: int


def make_set(batch: int, seq_len: int, index_fmt: str, seed: int, rows: int = ROWS,
             s: Shape = SHAPE, dev: str = "cuda", ragged: bool = False) -> IndexerSet:
    """Random index_q and cache (N(0, 1) in the index format), the requests' contexts
    (``context_lengths``) on their own shuffled pages of a pool twice the size of the
    table (as wide as the longest context)."""
    dev = torch.device(dev)
    g = torch.Generator(device=dev).manual_seed(seed)
    lens = context_lengths(batch, seq_len, ragged)
    blocks = -(-max(lens) // s.page)
    table, pool = harness.shuffled_block_table(batch, blocks, g, dev)
    cache = harness.random_cache((pool, s.page, s.d), index_fmt, g, dev)
    q = harness.random_cache((batch * rows, s.hi, s.d), index_fmt, g, dev)
    seq = torch.tensor(lens, dtype=torch.int32, device=dev)
    out = torch.full((batch * rows, s.hi, s.topk), -1, dtype=torch.int32, device=dev)
    return IndexerSet(q, cache, table, seq, out, rows)


# ----------------------------------------------------------------------- the callables


def triton_indexer(index_fmt: str, s: Shape = SHAPE, knobs: dict | None = None):
    """A factory: IndexerSet -> zero-argument call of the Triton decode indexer (with the
    launcher's tuning keywords ``knobs``; the calls share one workspace unless
    ``workspace=none``, ``harness.split_workspace``)."""
    from kernels.indexer_decode import indexer_decode

    knobs, ws = harness.split_workspace(knobs)

    def bind(t: IndexerSet):
        out = t.out.transpose(0, 1)
        return lambda: indexer_decode(t.index_q, t.cache, index_fmt, t.table, t.seq_lens,
                                      t.rows, topk=s.topk, local_blocks=s.local_blocks,
                                      initial_blocks=s.initial_blocks, out=out, workspace=ws,
                                      **knobs)

    return bind


def _fp32(x: torch.Tensor, index_fmt: str) -> torch.Tensor:
    fp8 = harness.FP8_DTYPES.get(index_fmt)
    return (x.view(fp8) if fp8 else x).float()


def torch_indexer(q, cache, table, seq_lens, out, *, rows: int, index_fmt: str,
                  s: Shape = SHAPE) -> None:
    """The decode indexer as plain torch ops, writing the token-major ``out [T, Hi, K]``:
    fp32 scores of every key through the block table, keys past the row's position masked,
    max per block, forced local/initial blocks first, then topk (-1 where nothing is left).
    """
    b, nb = table.shape
    keys = _fp32(cache[table.long()], index_fmt).view(b, nb * s.page, s.d)
    qf = _fp32(q, index_fmt).view(b, rows * s.hi, s.d)
    scores = torch.bmm(qf, keys.transpose(1, 2)).view(b, rows, s.hi, nb * s.page)
    pos = seq_lens.long()[:, None] - rows + torch.arange(rows, device=q.device)  # [B, rows]
    j = torch.arange(nb * s.page, device=q.device)
    scores = scores.masked_fill(j > pos[:, :, None, None], float("-inf"))
    blk = scores.view(b, rows, s.hi, nb, s.page).amax(-1)  # [B, rows, Hi, nb]
    own = (pos // s.page)[:, :, None, None]
    bi = torch.arange(nb, device=q.device)
    forced = (((bi > own - s.local_blocks) | (bi < s.initial_blocks)) & (bi <= own))
    blk = blk.masked_fill(forced, float("inf"))
    k = min(s.topk, nb)
    val, idx = blk.topk(k, dim=-1)
    idx = torch.where(val == float("-inf"), -1, idx).to(torch.int32)
    out[:, :, :k] = idx.view(b * rows, s.hi, k)


def torch_baseline(index_fmt: str, s: Shape = SHAPE):
    """A factory: IndexerSet -> zero-argument call of ``torch_indexer``."""

    def bind(t: IndexerSet):
        return lambda: torch_indexer(t.index_q, t.cache, t.table, t.seq_lens, t.out,
                                     rows=t.rows, index_fmt=index_fmt, s=s)

    return bind


# ------------------------------------------------------------------------- agreement


def selection_agreement(a: torch.Tensor, b: torch.Tensor) -> dict:
    """Two ``[T, Hi, K]`` selections compared as sets per (row, head): the share of equal
    sets and the share of selected blocks (non-negative entries of ``a``) also in ``b``."""
    sa, sb = a.sort(-1).values, b.sort(-1).values
    same = (sa == sb).all(-1)
    hit = (a[..., :, None] == b[..., None, :]).any(-1) & (a >= 0)
    return {"sets_equal": float(same.float().mean()),
            "blocks_shared": int(hit.sum()) / max(1, int((a >= 0).sum()))}


def agreement(index_fmt: str, batch: int, seq_len: int, rows: int = ROWS,
              dev: str = "cuda", knobs: dict | None = None, ragged: bool = False) -> dict:
    """The kernel and the torch composition on one fresh set: equal selections expected
    except for fp32 near-ties (different summation orders)."""
    a = make_set(batch, seq_len, index_fmt, seed=12345, rows=rows, dev=dev, ragged=ragged)
    triton_indexer(index_fmt, knobs=knobs)(a)()
    got = a.out.clone()
    torch_baseline(index_fmt)(a)()
    return {"batch": batch, "seq_len": seq_len, **selection_agreement(got, a.out)}


# ----------------------------------------------------------------------------- bench


def _binders(index_fmt: str, impls, knobs: dict | None = None) -> dict:
    make = {"triton": lambda: triton_indexer(index_fmt, knobs=knobs),
            "torch_eager": lambda: torch_baseline(index_fmt)}
    return {name: make[name]() for name in impls}


#: ``--tune``: the knob sets a GPU tuning run times (the launcher's defaults first; see
#: kernels/indexer_decode.py). Static numbers (sm_90, model shape, per thread and key
#: block): defaults (4 lanes along D, 32-key tiles, 4 warps, 3 stages, 16 blocks per split)
#: 233 / 226 registers (bf16 / e4m3: 2 programs per SM), 897 / 945 SASS instructions;
#: lanes_d=8: 128 / 122 registers (3-4 programs per SM), 1083 / 1139 instructions;
#: num_warps=8 (64-key tiles): 230 / 220 registers, 504 / 529 instructions per warp.
TUNE = [
    {},
    {"blocks_per_split": 8}, {"blocks_per_split": 32}, {"blocks_per_split": 64},
    {"num_stages": 2}, {"num_stages": 4},
    {"lanes_d": 8}, {"lanes_d": 8, "num_stages": 2}, {"lanes_d": 8, "num_stages": 4},
    {"lanes_d": 8, "blocks_per_split": 8},
    {"num_warps": 8}, {"num_warps": 8, "num_stages": 2}, {"num_warps": 8, "lanes_d": 8},
    {"num_warps": 2}, {"merge_chunk": 4},
    {"scan": "dot"},
]


def bench_cache(cache: str, args) -> tuple[list[dict], dict, list[dict]]:
    """Results of every implementation for one cache (triton with the first knob set), the
    agreement check, and the triton results of the other knob sets (the sweep)."""
    fmt = CACHES[cache]
    knob_sets = knob_list(args)
    parts = minimal_bytes(args.batch, args.seq_len, fmt, args.rows, ragged=args.ragged)
    n_sets = harness.rotation_count(parts["total"], harness.l2_bytes())
    sets = [make_set(args.batch, args.seq_len, fmt, seed=i, rows=args.rows,
                     ragged=args.ragged) for i in range(n_sets)]
    try:
        agree = agreement(fmt, min(args.batch, CHECK_BATCH), args.seq_len, args.rows,
                          knobs=knob_sets[0], ragged=args.ragged)
    except Exception as e:  # noqa: BLE001 - the timings are still worth having
        agree = {"error": harness.error_text(e)}

    def one(name, bind, extra):
        try:
            calls = [bind(st) for st in sets]
        except Exception as e:  # noqa: BLE001 - e.g. the kernel module fails to import
            return harness.record(name, OP, cache, parts["total"],
                                  error=harness.error_text(e), **extra)
        r = harness.timed_record(name, OP, cache, parts["total"], calls, args, **extra)
        print(f"{cache} {name} {extra.get('knobs', '')}: {r['mode']} {r['median_us']} us",
              flush=True)
        return r

    results = []
    for name, bind in _binders(fmt, args.impls, knob_sets[0]).items():
        extra = {"index_fmt": fmt, "bytes_parts": parts}
        if name == "triton":
            extra.update(baselines=list(BASELINES), targets=dict(TARGETS),
                         knobs=knob_sets[0])
        results.append(one(name, bind, extra))
    sweep = [one("triton", triton_indexer(fmt, knobs=k),
                 {"index_fmt": fmt, "bytes_parts": parts, "knobs": k})
             for k in knob_sets[1:]]
    sets.clear()
    torch.cuda.empty_cache()
    return results, agree, sweep


def knob_list(args) -> list[dict]:
    """The knob sets of a run: ``--tune``'s list, else ``--knobs`` (one set per argument),
    else the defaults."""
    if getattr(args, "tune", False):
        return [dict(k) for k in TUNE]
    return list(getattr(args, "knobs", None) or [{}])


def parse_args(argv):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=BATCH)
    ap.add_argument("--seq-len", type=int, default=SEQ_LEN, help="tokens of every context")
    ap.add_argument("--rows", type=int, default=ROWS, help="query rows per request (1..4)")
    ap.add_argument("--ragged", action="store_true",
                    help="contexts spread evenly from seq_len / 8 to 15 / 8 seq_len "
                         "(context_lengths) instead of seq_len each")
    ap.add_argument("--caches", nargs="+", default=list(CACHES), choices=list(CACHES))
    ap.add_argument("--impls", nargs="+", default=list(IMPLS), choices=list(IMPLS))
    ap.add_argument("--knobs", nargs="*", type=harness.parse_knobs, default=[],
                    help="decode-indexer launcher knobs, one set per argument (k=v,...): the "
                         "first set makes the triton results, the others a 'sweep' list "
                         "beside them (one GPU call times them all)")
    ap.add_argument("--tune", action="store_true",
                    help="time the TUNE knob sets (the first, the defaults, makes the "
                         "results); overrides --knobs")
    harness.add_timing_args(ap, NAME)
    return ap.parse_args(argv)


def build_report(args) -> dict:
    doc = harness.report_base(render_bench.SCHEMA, "decode indexer: block scores + top-k "
                              "block selection", args)
    lens = context_lengths(args.batch, args.seq_len, args.ragged)
    tokens = (f"{args.batch} x {args.seq_len}" if not args.ragged else
              f"{args.batch} requests of {min(lens)}..{max(lens)} tokens (ragged, mean "
              f"{sum(lens) / len(lens):.0f})")
    doc.update(tokens=tokens, ragged=args.ragged, batch=args.batch,
               seq_len=args.seq_len, rows_per_request=args.rows, shape=asdict(SHAPE),
               notes=["triton: default split, output into a transposed token-major buffer, one "
                      "workspace kept across the calls (knob workspace=none: fresh "
                      "buffers and a counter fill per call).",
                      "torch_eager: plain torch ops (fp32 scores) replayed from a graph "
                      "(no launch overhead counted).",
                      "for_scale: vLLM 0.33 Triton index decode, the published numbers, "
                      "not measured here."],
               for_scale=FOR_SCALE, results=[], agreement={}, sweep=[])
    for cache in args.caches:
        results, agree, sweep = bench_cache(cache, args)
        doc["results"] += results
        doc["agreement"][cache] = agree
        doc["sweep"] += sweep
    for r, derived in zip(doc["results"], render_bench.derive(doc)):
        r.update(derived)
    copy_bps = doc["copy"]["bytes_per_s"]
    for r in doc["sweep"]:
        r.update(render_bench.derive_one(r, doc["sweep"], copy_bps))
    return doc


def sweep_lines(doc: dict) -> str:
    """The knob sweep as a Markdown table (empty when there is none), fastest first per
    cache."""
    rows = sorted(doc.get("sweep", ()), key=lambda r: (r["cache"], r.get("median_us") or 1e30))
    if not rows:
        return ""
    lines = ["", "Knob sweep (triton):", "", "| cache | knobs | median us | copy BW |",
             "|---|---|---|---|"]
    for r in rows:
        us, frac = r.get("median_us"), r.get("copy_fraction")
        lines.append(f"| {r['cache']} | {r.get('knobs') or 'defaults'} | "
                     f"{'-' if us is None else f'{us:.1f}'} | "
                     f"{'-' if frac is None else f'{100 * frac:.1f}%'} |")
    return "\n".join(lines) + "\n"


def for_scale_lines(doc: dict) -> str:
    """The for_scale entries as Markdown bullet lines (empty when there are none)."""
    lines = [f"- {e['name']} ({e['cache']}): {e['median_us']} us = "
             f"{100 * e['copy_fraction']:.0f}% of copy BW; {e['source']}"
             for e in doc.get("for_scale", ())]
    return "\nFor scale:\n\n" + "\n".join(lines) + "\n" if lines else ""


def markdown(doc: dict) -> str:
    """The generic table, the for-scale numbers and the knob sweep."""
    return render_bench.markdown(doc) + for_scale_lines(doc) + sweep_lines(doc)


def main(argv=None) -> int:
    return harness.main(NAME, argv, parse_args, build_report, markdown)


if __name__ == "__main__":
    sys.exit(main())
