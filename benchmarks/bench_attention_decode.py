"""Speed of the block-sparse GQA decode attention:
kernels.attention_decode.sparse_attention_decode at the model shape.

Shape: Hq 64, Hkv 4 (G 16), D 128, P 128, K 16 selected blocks per (request, KV head)
(reference.domain.MODEL), one query row per request, every request a 32,768-token
context (256 blocks), batch sizes 1, 8, 64, 256; bf16 model dtype (q, out). Caches
(logical ``[pages, Hkv, P, 2D]``, contiguous, i.e. the HND layout): ``bf16``, ``e4m3fn``,
``e4m3fnuz`` (the e4m3fn conversion, patched), ``e5m2``, ``e5m2fnuz`` (no conversion on
NVIDIA: its own assembly); fp8 caches as uint8 codes with a
scalar scale 1.0 (a 0-d float32 tensor: no per-call fill). Content N(0, 1) (torch's cast
for fp8). Each request's 256 pages are drawn at random from a pool twice the size needed
(harness.shuffled_block_table). Selections (``random_selections``): per (row, KV head) the
row's own (last) block plus K - 1 distinct random earlier blocks, in random order, held in
a token-major ``[T, Hkv, K]`` int32 buffer passed as its transposed ``[Hkv, T, K]`` view,
as servers keep it. Output into a preallocated ``[T, Hq, D]`` bf16 buffer; the launcher's
split-K partials (four splits of four blocks) are allocated per call, inside the measured
call, as a server would call it.

Timing: harness.py (CUDA-graph replay over rotating input sets touching > 2 x L2; at
batch 1 about 30 sets), the copy bandwidth measured in the same run. After timing, each
row records whether the first set's output is finite (``finite_output``).

Minimal bytes (``minimal_bytes``: every input byte read once, every output byte written
once): per (request, KV head) the K selected blocks' K and V, K * P tokens x 2D x c (the
own block holds seq_len - (nb - 1) P visible tokens: all P at 32k), q and out B x Hq x D x 2,
the selections B x Hkv x K x 4 and seq_lens B x 4. Block-table entries are not counted
(how many distinct entries a request needs depends on how its heads' selections overlap:
at most Hkv K x 4 = 256 B per request, under 0.02% at any batch). Batch 64: bf16 268,435,456
+ 1,048,576 + 1,048,576 + 16,384 + 256 = 270,549,248 B; fp8 134,217,728 + the same
2,113,792 = 136,331,520 B. tests/test_bench_sparse.py checks the counts.

Targets and checks (``checks``; each result carries the ones that concern it):
- batch 64: e4m3fn >= 70% of the copy bandwidth, bf16 >= 85% (result ``targets``);
- every fp8 cache faster than bf16 at every batch (``vs_bf16`` = bf16 median / this > 1);
- each fnuz format's overhead over e4m3fn below 15% (``fnuz_overhead`` = fnuz / e4m3fn -
  1).
For scale (vLLM's published numbers, NOT measured here; ``for_scale`` in the JSON and a
column of the table): batch 64 86.9 us e4m3, 83.8 us bf16; batch 8 22.6 us e4m3.
No torch baseline is timed (the targets are against the copy bandwidth and between
caches; vLLM's numbers are quoted for scale instead).

Writes a ``bench/1`` JSON (default ``$OUT/bench_attention_decode.json`` when OUT is set,
else reports/bench_attention_decode.json; ``--out``) and the Markdown table beside it.

Run on the GPU machine: ``python -m benchmarks.bench_attention_decode``; ``--batches 2
--seq-len 4096`` for a quick check.
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

NAME = "bench_attention_decode"
OP = "attention_decode"
IMPL = "triton"
BATCHES = (1, 8, 64, 256)
SEQ_LEN = 32_768
CACHES = {"bf16": "bfloat16", "e4m3fn": "e4m3fn", "e4m3fnuz": "e4m3fnuz", "e5m2": "e5m2",
          "e5m2fnuz": "e5m2fnuz"}
#: Every cache by default.
DEFAULT_CACHES = tuple(CACHES)
FNUZ_CACHES = ("e4m3fnuz", "e5m2fnuz")
TARGET_BATCH = 64
TARGETS = {"bf16": {"copy_fraction": 0.85}, "e4m3fn": {"copy_fraction": 0.70}}
FNUZ_OVERHEAD_MAX = 0.15
FOR_SCALE = [  # vLLM's published numbers, not measured by this benchmark
    {"name": "vllm", "cache": "e4m3fn", "batch": 64, "median_us": 86.9},
    {"name": "vllm", "cache": "bf16", "batch": 64, "median_us": 83.8},
    {"name": "vllm", "cache": "e4m3fn", "batch": 8, "median_us": 22.6},
]


@dataclass(frozen=True)
class Shape:
    hq: int = MODEL.num_q_heads
    hkv: int = MODEL.num_kv_heads
    d: int = MODEL.head_dim
    page: int = MODEL.page_size
    topk: int = MODEL.topk


SHAPE = Shape()


def selected_tokens(seq_len: int, s: Shape = SHAPE) -> int:
    """Visible tokens in the K blocks one row selects (its own block always in): K full
    blocks less the unfilled tail of the own block, or all seq_len when K covers every
    block."""
    nb = -(-seq_len // s.page)
    if s.topk >= nb:
        return seq_len
    return (s.topk - 1) * s.page + seq_len - (nb - 1) * s.page


def minimal_bytes(batch: int, kv_fmt: str, seq_len: int = SEQ_LEN, s: Shape = SHAPE) -> dict:
    """Bytes one decode call must move, by part (see the module docstring); one row per
    request, bf16 q and out, int32 selections and seq_lens."""
    c = harness.element_bytes(kv_fmt)
    parts = {"read_kv": batch * s.hkv * selected_tokens(seq_len, s) * 2 * s.d * c,
             "read_q": batch * s.hq * s.d * 2,
             "read_topk": batch * s.hkv * s.topk * 4,
             "read_seq_lens": batch * 4,
             "write_out": batch * s.hq * s.d * 2}
    parts["total"] = sum(parts.values())
    return parts


# ---------------------------------------------------------------------------- inputs


@dataclass
class DecodeSet:
    q: torch.Tensor  # [B, Hq, D] bf16
    kv: torch.Tensor  # [pool pages, Hkv, P, 2D]: bf16 or uint8 codes
    table: torch.Tensor  # int32 [B, ceil(seq_len / P)]
    seq_lens: torch.Tensor  # int32 [B]
    topk: torch.Tensor  # int32 token-major [B, Hkv, K]; pass topk.transpose(0, 1)
    scale: torch.Tensor | None  # 0-d float32 1.0 for fp8 caches
    out: torch.Tensor  # [B, Hq, D] bf16


def random_selections(positions: torch.Tensor, heads: int, g: torch.Generator,
                      s: Shape = SHAPE) -> torch.Tensor:
    """Token-major ``[T, heads, K]`` int32: per row and head the row's own block and
    min(K, visible) - 1 distinct random earlier blocks, in random order, -1 padding (the
    device twin of oracle.core.cases.random_selections with one local block)."""
    dev = positions.device
    visible = (positions // s.page + 1)[:, None, None]
    width = int(visible.max())
    b = torch.arange(width, device=dev)
    key = torch.rand((positions.numel(), heads, width), generator=g, device=dev)
    key = torch.where(b == visible - 1, 2.0, key)  # the own block first
    key = torch.where(b < visible, key, -1.0)  # invisible blocks never
    k = min(s.topk, width)
    val, idx = key.topk(k, dim=-1)
    sel = torch.full((positions.numel(), heads, s.topk), -1, dtype=torch.int64, device=dev)
    sel[..., :k] = torch.where(val >= 0, idx, -1)
    order = torch.rand(sel.shape, generator=g, device=dev).argsort(-1)
    return sel.gather(-1, order).to(torch.int32)


def make_set(batch: int, kv_fmt: str, seed: int, seq_len: int = SEQ_LEN, s: Shape = SHAPE,
             dev: str = "cuda", hot_pages: int = 0) -> DecodeSet:
    """Random q and cache (N(0, 1)), every request seq_len tokens on its own shuffled pages
    of a pool twice the size needed, random selections with the own block in.
    ``hot_pages`` > 0 (a diagnostic, not the target's measure): every block-table entry
    taken modulo hot_pages, so all requests read the same few pages and the blocks come
    from L2 after their first touch: the kernel's time without DRAM latency and bandwidth
    (what is left is its own instruction and dependency chain)."""
    dev = torch.device(dev)
    g = torch.Generator(device=dev).manual_seed(seed)
    table, pool = harness.shuffled_block_table(batch, -(-seq_len // s.page), g, dev)
    if hot_pages:
        table %= hot_pages
    kv = harness.random_cache((pool, s.hkv, s.page, 2 * s.d), kv_fmt, g, dev)
    q = harness.random_cache((batch, s.hq, s.d), "bfloat16", g, dev)
    seq = torch.full((batch,), seq_len, dtype=torch.int32, device=dev)
    topk = random_selections(seq.long() - 1, s.hkv, g, s)
    scale = torch.ones((), dtype=torch.float32, device=dev) \
        if kv_fmt in harness.FP8_DTYPES else None
    return DecodeSet(q, kv, table, seq, topk, scale, torch.empty_like(q))


def triton_decode(kv_fmt: str, knobs: dict | None = None):
    """A factory: DecodeSet -> zero-argument call of the Triton decode attention (with the
    launcher's tuning keywords ``knobs``; the calls share one workspace unless
    ``workspace=none``, ``harness.split_workspace``)."""
    from kernels.attention_decode import sparse_attention_decode

    knobs, ws = harness.split_workspace(knobs)

    def bind(t: DecodeSet):
        topk = t.topk.transpose(0, 1)
        return lambda: sparse_attention_decode(t.q, t.kv, kv_fmt, t.table, t.seq_lens, topk,
                                               1, t.scale, t.scale, out=t.out, workspace=ws,
                                               **knobs)

    return bind


# ---------------------------------------------------------------------------- checks


def checks(results: list[dict]) -> list[dict]:
    """The cross-cache checks of every batch (None where a median is missing), and each
    result's own numbers (``vs_bf16``, ``fnuz_overhead``) set on it."""
    out = []
    for r in results:
        us, b = r.get("median_us"), r["batch"]
        if r["cache"] != "bf16":
            base = harness.median_of(results, cache="bf16", batch=b)
            r["vs_bf16"] = None if us is None or base is None else base / us
            out.append(harness.check("fp8 faster than bf16", r["vs_bf16"], 1.0,
                                     lambda v: v > 1.0, batch=b, cache=r["cache"]))
        if r["cache"] in FNUZ_CACHES:
            ref = harness.median_of(results, cache="e4m3fn", batch=b)
            r["fnuz_overhead"] = None if us is None or ref is None else us / ref - 1
            out.append(harness.check("fnuz overhead vs e4m3fn", r["fnuz_overhead"],
                                     FNUZ_OVERHEAD_MAX, lambda v: v < FNUZ_OVERHEAD_MAX,
                                     batch=b, cache=r["cache"]))
    for r in results:
        if r.get("targets"):
            t = r["targets"]["copy_fraction"]
            out.append(harness.check("copy fraction", r.get("copy_fraction"), t,
                                     lambda v, t=t: v >= t, batch=r["batch"], cache=r["cache"]))
    return out


# ----------------------------------------------------------------------------- bench


def _finite(t: DecodeSet) -> bool:
    return bool(torch.isfinite(t.out).all())


def bench_one(cache: str, batch: int, args, knobs: dict | None = None) -> dict:
    """One result: the kernel at one cache and batch over its rotating input sets."""
    fmt = CACHES[cache]
    parts = minimal_bytes(batch, fmt, args.seq_len)
    n_sets = harness.rotation_count(parts["total"], harness.l2_bytes())
    sets = [make_set(batch, fmt, seed=i, seq_len=args.seq_len, hot_pages=args.hot_pages)
            for i in range(n_sets)]
    extra = {"kv_fmt": fmt, "batch": batch, "bytes_parts": parts, "knobs": knobs or {}}
    if args.hot_pages:
        extra["hot_pages"] = args.hot_pages
    elif batch == TARGET_BATCH and cache in TARGETS:
        extra["targets"] = dict(TARGETS[cache])
    try:
        calls = [triton_decode(fmt, knobs)(st) for st in sets]
    except Exception as e:  # noqa: BLE001 - e.g. the kernel module fails to import
        return harness.record(IMPL, OP, cache, parts["total"],
                              error=harness.error_text(e), **extra)
    r = harness.timed_record(IMPL, OP, cache, parts["total"], calls, args, **extra)
    if r["median_us"] is not None:
        r["finite_output"] = _finite(sets[0])
    print(f"{cache} batch {batch} {knobs or ''}: {r['mode']} {r['median_us']} us", flush=True)
    del sets, calls
    torch.cuda.empty_cache()
    return r


def parse_args(argv):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batches", type=int, nargs="+", default=list(BATCHES))
    ap.add_argument("--seq-len", type=int, default=SEQ_LEN, help="tokens of every context")
    ap.add_argument("--caches", nargs="+", default=list(DEFAULT_CACHES), choices=list(CACHES))
    ap.add_argument("--knobs", nargs="*", type=harness.parse_knobs, default=[],
                    help="launcher tuning keywords, one set per argument (k=v,...): the "
                         "first set makes the results, the others a 'sweep' list beside them")
    ap.add_argument("--hot-pages", type=int, default=0,
                    help="diagnostic: block-table entries modulo N, so the blocks come from "
                         "L2 (the kernel's time without DRAM; no targets judged)")
    harness.add_timing_args(ap, NAME)
    return ap.parse_args(argv)


def build_report(args) -> dict:
    doc = harness.report_base(render_bench.SCHEMA, "block-sparse GQA decode attention",
                              args)
    doc.update(tokens=f"B x {args.seq_len}", batches=list(args.batches),
               seq_len=args.seq_len, rows_per_request=1,
               shape={**asdict(SHAPE), "model_dtype": "bfloat16", "layout": "HND"},
               notes=["one query row per request; K 16 selected blocks per (row, KV head), "
                      "the own block always in; scalar fp8 scale 1.0.",
                      "triton: one workspace kept across the calls (knob workspace=none: "
                      "fresh buffers and a counter fill per call).",
                      "vLLM column: the published numbers, for scale, not measured here."]
               + ([f"DIAGNOSTIC --hot-pages {args.hot_pages}: block-table entries modulo "
                   f"{args.hot_pages}, blocks read from L2; bandwidth columns are not DRAM "
                   "numbers and no target is judged."] if args.hot_pages else []),
               for_scale=FOR_SCALE, results=[], sweep=[])
    knob_sets = args.knobs or [{}]
    for batch in args.batches:
        for cache in args.caches:
            doc["results"].append(bench_one(cache, batch, args, knob_sets[0]))
    for k in knob_sets[1:]:  # appended one by one: a stopped run keeps them (harness.main)
        for batch in args.batches:
            for cache in args.caches:
                doc["sweep"].append(bench_one(cache, batch, args, k))
    for r, derived in zip(doc["results"], render_bench.derive(doc)):
        r.update(derived)
    doc["checks"] = checks(doc["results"])
    return doc


# -------------------------------------------------------------------------- markdown

COLUMNS = ("batch", "cache", "mode", "median (us)", "GB/s", "% of copy BW", "x vs bf16",
           "fnuz overhead", "vLLM us (for scale)", "target met")


def _for_scale(doc: dict, r: dict):
    e = next((e for e in doc.get("for_scale", ())
              if e["cache"] == r["cache"] and e["batch"] == r["batch"]), None)
    return None if e is None else e["median_us"]


def table_row(doc: dict, r: dict, d: dict) -> str:
    """One row; the derived numbers ``d`` come from render_bench.derive_one."""
    f = render_bench._fmt
    gbps = None if d["bytes_per_s"] is None else d["bytes_per_s"] / 1e9
    pct = None if d["copy_fraction"] is None else 100 * d["copy_fraction"]
    over = r.get("fnuz_overhead")
    mode = r.get("mode", "?") if r.get("median_us") is not None else f"error: {r.get('note')}"
    cells = (str(r["batch"]), r["cache"], mode, f(r.get("median_us"), ".1f"), f(gbps, ".0f"),
             f(pct, ".1f", "%"), f(r.get("vs_bf16"), ".2f", "x"),
             f(None if over is None else 100 * over, "+.1f", "%"),
             f(_for_scale(doc, r), ".1f"), render_bench._yes_no(d["target_met"]))
    return "| " + " | ".join(cells) + " |"


def sweep_table(doc: dict) -> list[str]:
    """The ``--knobs`` sweep beside the results: median us per (batch, cache), one column
    per knob set, the results' own set first (empty without a sweep)."""
    if not doc.get("sweep"):
        return []
    def knobs(r):
        return render_bench.knob_label(r.get("knobs")) or "default"

    rows = doc["results"] + doc["sweep"]
    sets = list(dict.fromkeys(knobs(r) for r in rows))
    cell = {(r["batch"], r["cache"], knobs(r)): r.get("median_us") for r in rows}
    lines = ["", "Knob sweep, median us:", "",
             "| batch | cache | " + " | ".join(sets) + " |",
             "|---:|---|" + "---:|" * len(sets)]
    for b, c in dict.fromkeys((r["batch"], r["cache"]) for r in doc["results"]):
        lines.append(f"| {b} | {c} | " + " | ".join(
            render_bench._fmt(cell.get((b, c, k)), ".1f") for k in sets) + " |")
    return lines


def markdown(doc: dict) -> str:
    """The header of render_bench, one row per (batch, cache), then the checks."""
    lines = render_bench.header(doc)
    lines.append("| " + " | ".join(COLUMNS) + " |")
    lines.append("|---:|---|---|" + "---:|" * 6 + "---|")
    for r, d in zip(doc["results"], render_bench.derive(doc)):
        lines.append(table_row(doc, r, d))
    lines += sweep_table(doc)
    lines += ["", "Checks:", ""]
    for c in doc.get("checks", ()):
        val = "-" if c["value"] is None else f"{c['value']:.3f}"
        lines.append(f"- batch {c['batch']} {c['cache']}: {c['check']} = {val} (limit "
                     f"{c['limit']}): {render_bench._yes_no(c['passed'])}")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    return harness.main(NAME, argv, parse_args, build_report, markdown)


if __name__ == "__main__":
    sys.exit(main())
