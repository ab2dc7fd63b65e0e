"""Speed of the float64 reference (indexer + sparse attention) at the model's shape.

Model shape (reference.domain.MODEL): Hq 64, Hkv 4, D 128, P 128, K 16, Hi 4, L_loc 1,
L_init 0. Two parts, each timed as the best of ``--repeat`` (default 3) wall times:

1. DECODE: 64 requests with 32,768-token contexts, one row each: ``indexer_decode``, then
   ``sparse_attention_decode`` on the indexer's selections. Target: <= 2 s together.
2. PREFILL: one request, 2,048 new tokens on a 6,144-token prefix (8,192 tokens, 64 blocks;
   each token selects 16 of its 49..64 visible blocks): ``indexer_prefill``, then
   ``sparse_attention_prefill`` on its selections. Target: <= 30 s together.

Inputs (oracle/core/rand.py raw bits, no distribution methods):
- Caches hold valid codes drawn directly (random sign and mantissa, a biased exponent in
  an 8-value band: magnitudes in [2^-6, 4)), never NaN/Inf, in any format.
- Decode index cache: every page of every request (64 x 256 pages, 537 MB in bf16), pages
  shuffled. Decode KV cache: only the pages of the blocks some KV head of the request
  selected (at most 64 of 256 per request; ~1 GB in bf16 instead of 4.3 GB for all pages),
  shuffled; every unselected block of the block table points at one page of NaN codes, so
  a read outside the selection would turn the output into NaN (checked: outputs are
  finite). Building the KV cache is not timed.
- Prefill caches: all 64 pages drawn, shuffled.
- q and index_q: N(0, 1) rounded to bf16; with an fp8 index cache, index_q is decoded
  e4m3 (what the fused op emits). No KV scales (1.0). Attention under the EXACT schedule
  with ``validate=True`` (the reference's defaults).

``--fmt`` picks the KV cache format (bfloat16 default; e4m3fn, e5m2, e4m3fnuz, e5m2fnuz,
float16), several allowed; the index cache is the model dtype for 16-bit formats and the
platform's e4m3 for fp8 ones (e4m3fnuz for the fnuz formats, else e4m3fn). The Markdown
table of results is printed last; the same numbers go as JSON to ``--out``.
``--profile`` adds a cProfile of one attention call per part (KV heads in one thread, the
top functions by own time) to find what dominates.

Run: ``.venv/bin/python benchmarks/reference_speed.py [--fmt bfloat16 e4m3fn]``.
"""

from __future__ import annotations

import os

os.environ["OPENBLAS_NUM_THREADS"] = "1"  # before NumPy is imported: one BLAS thread

import argparse  # noqa: E402
import cProfile  # noqa: E402
import io  # noqa: E402
import json  # noqa: E402
import platform  # noqa: E402
import pstats  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

import numpy as np  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from oracle.core import rand  # noqa: E402
from reference import attention  # noqa: E402
from reference.codec import FORMATS, decode, encode, round_to  # noqa: E402
from reference.domain import MODEL  # noqa: E402
from reference.formats import FP8_FORMATS, MODEL_DTYPES, platform_fp8  # noqa: E402
from reference.indexer import indexer_decode, indexer_prefill  # noqa: E402

KV_FORMATS = (*MODEL_DTYPES, *FP8_FORMATS)
DECODE_BATCH, DECODE_CONTEXT = 64, 32_768
PREFILL_NEW, PREFILL_PREFIX = 2_048, 6_144
TARGETS = {"decode": 2.0, "prefill": 30.0}
_CHUNK_CODES = 1 << 25  # codes drawn per chunk (bounds the temporaries)


def index_format(kv_fmt: str) -> str:
    if FORMATS[kv_fmt].bits == 16:
        return kv_fmt
    return platform_fp8("e4m3", FORMATS[kv_fmt].native[0])


def model_dtype(kv_fmt: str) -> str:
    return kv_fmt if kv_fmt == "float16" else "bfloat16"


def fill_valid_codes(bg, out: np.ndarray, fmt: str) -> np.ndarray:
    """Fill a C-contiguous code array with valid finite codes: random sign and mantissa,
    biased exponent ``bias - 6 + U{0..7}`` (magnitudes in [2^-6, 4)); chunked."""
    f = FORMATS[fmt]
    assert out.flags.c_contiguous
    flat = out.reshape(-1)
    dt = f.code_dtype
    man_mask = (1 << f.man_bits) - 1
    for c0 in range(0, flat.size, _CHUNK_CODES):
        n = min(_CHUNK_CODES, flat.size - c0)
        words = -(-n * np.dtype(dt).itemsize // 8)
        r = bg.random_raw(words).view(dt)[:n]
        e = ((r >> dt(f.man_bits)) & dt(7)) + dt(f.bias - 6)
        flat[c0:c0 + n] = (r & dt(f.sign_bit | man_mask)) | (e << dt(f.man_bits))
    return out


def bf16_normal(bg, shape, dtype="bfloat16"):
    return round_to(rand.normal(bg, shape), dtype)


def index_query(bg, shape, kv_fmt):
    """index_q as the fused op emits it: model-dtype values, or decoded e4m3."""
    ifmt = index_format(kv_fmt)
    if FORMATS[ifmt].bits == 8:
        return decode(encode(rand.normal(bg, shape), ifmt, "satfinite"), ifmt)
    return bf16_normal(bg, shape, model_dtype(kv_fmt))


def best_of(fn, repeat):
    times, result = [], None
    for _ in range(repeat):
        t0 = time.perf_counter()
        result = fn()
        times.append(time.perf_counter() - t0)
    return min(times), times, result


def profile_top(fn, n=14) -> str:
    """cProfile of one call, KV heads in one thread (so that the profiler sees the work:
    it only follows the calling thread), top n functions by own time."""
    threads, attention.THREADS = attention.THREADS, 1
    prof = cProfile.Profile()
    try:
        prof.enable()
        fn()
        prof.disable()
    finally:
        attention.THREADS = threads
    buf = io.StringIO()
    pstats.Stats(prof, stream=buf).sort_stats("tottime").print_stats(n)
    return buf.getvalue()


# ----------------------------------------------------------------------------- decode


def bench_decode(kv_fmt, seed, repeat, profile):
    m = MODEL
    bg = rand.generator(seed)
    ifmt = index_format(kv_fmt)
    nb = DECODE_CONTEXT // m.page_size
    t0 = time.perf_counter()
    index_cache = np.empty((DECODE_BATCH * nb, m.page_size, m.head_dim),
                           FORMATS[ifmt].code_dtype)
    fill_valid_codes(bg, index_cache, ifmt)
    index_bt = rand.permutation(bg, DECODE_BATCH * nb).reshape(DECODE_BATCH, nb)
    seq_lens = np.full(DECODE_BATCH, DECODE_CONTEXT, np.int64)
    index_q = index_query(bg, (DECODE_BATCH, m.num_index_heads, m.head_dim), kv_fmt)
    q = bf16_normal(bg, (DECODE_BATCH, m.num_q_heads, m.head_dim), model_dtype(kv_fmt))
    setup_index = time.perf_counter() - t0

    def run_indexer():
        return indexer_decode(index_q, index_cache, ifmt, index_bt, seq_lens, 1, m.topk,
                              m.local_blocks, m.initial_blocks)

    t_idx, idx_times, topk = best_of(run_indexer, repeat)

    # KV pages for the selected blocks only; every other block -> one NaN page (page 0).
    t0 = time.perf_counter()
    sel = np.zeros((DECODE_BATCH, nb), bool)
    for h in range(m.num_kv_heads):
        rows = np.repeat(np.arange(DECODE_BATCH), m.topk)
        blocks = topk[h].reshape(-1)
        sel[rows[blocks >= 0], blocks[blocks >= 0]] = True
    n_sel = int(sel.sum())
    kv_pages = n_sel + 1
    f = FORMATS[kv_fmt]
    kv = np.empty((kv_pages, m.num_kv_heads, m.page_size, 2 * m.head_dim), f.code_dtype)
    fill_valid_codes(bg, kv[1:], kv_fmt)
    kv[0] = f.nan_code
    bt = np.zeros((DECODE_BATCH, nb), np.int64)
    bt[sel] = 1 + rand.permutation(bg, n_sel)
    setup_kv = time.perf_counter() - t0

    def run_attention():
        return attention.sparse_attention_decode(q, kv, kv_fmt, bt, seq_lens, topk, 1)

    t_att, att_times, out = best_of(run_attention, repeat)
    assert np.isfinite(out).all(), "decode attention read outside its selection"
    prof = profile_top(run_attention) if profile else None
    return dict(part="decode", fmt=kv_fmt, index_fmt=ifmt,
                shape=dict(batch=DECODE_BATCH, context=DECODE_CONTEXT, rows_per_request=1),
                indexer_s=t_idx, attention_s=t_att, total_s=t_idx + t_att,
                indexer_runs_s=idx_times, attention_runs_s=att_times,
                setup_s=dict(index=setup_index, kv=setup_kv),
                cache_bytes=dict(index=DECODE_BATCH * nb * m.page_size * m.head_dim
                                 * np.dtype(FORMATS[ifmt].code_dtype).itemsize,
                                 kv=kv.nbytes),
                kv_pages=dict(drawn=n_sel, of=DECODE_BATCH * nb),
                profile=prof)


# ----------------------------------------------------------------------------- prefill


def bench_prefill(kv_fmt, seed, repeat, profile):
    m = MODEL
    bg = rand.generator(seed)
    ifmt = index_format(kv_fmt)
    seq = PREFILL_PREFIX + PREFILL_NEW
    nb = seq // m.page_size
    f = FORMATS[kv_fmt]
    index_cache = fill_valid_codes(
        bg, np.empty((nb, m.page_size, m.head_dim), FORMATS[ifmt].code_dtype), ifmt)
    kv = fill_valid_codes(
        bg, np.empty((nb, m.num_kv_heads, m.page_size, 2 * m.head_dim), f.code_dtype), kv_fmt)
    index_bt = rand.permutation(bg, nb)[None, :]
    bt = rand.permutation(bg, nb)[None, :]
    cu = np.array([0, PREFILL_NEW], np.int64)
    seq_lens = np.array([seq], np.int64)
    index_q = index_query(bg, (PREFILL_NEW, m.num_index_heads, m.head_dim), kv_fmt)
    q = bf16_normal(bg, (PREFILL_NEW, m.num_q_heads, m.head_dim), model_dtype(kv_fmt))

    def run_indexer():
        return indexer_prefill(index_q, index_cache, ifmt, index_bt, cu, seq_lens, m.topk,
                               m.local_blocks, m.initial_blocks)

    t_idx, idx_times, topk = best_of(run_indexer, repeat)
    assert ((topk >= 0).sum(axis=2) == m.topk).all()  # 16 of 49..64 blocks everywhere

    def run_attention():
        return attention.sparse_attention_prefill(q, kv, kv_fmt, bt, cu, seq_lens, topk)

    t_att, att_times, out = best_of(run_attention, repeat)
    assert np.isfinite(out).all()
    prof = profile_top(run_attention) if profile else None
    return dict(part="prefill", fmt=kv_fmt, index_fmt=ifmt,
                shape=dict(new_tokens=PREFILL_NEW, prefix=PREFILL_PREFIX, blocks=nb),
                indexer_s=t_idx, attention_s=t_att, total_s=t_idx + t_att,
                indexer_runs_s=idx_times, attention_runs_s=att_times, profile=prof)


# ----------------------------------------------------------------------------- report


def source_state() -> dict:
    """The commit measured and whether the reference's files differ from it."""
    root = Path(__file__).resolve().parents[1]

    def git(*cmd):
        try:
            return subprocess.run(["git", *cmd], cwd=root, capture_output=True, text=True,
                                  timeout=10).stdout.strip()
        except OSError:
            return ""

    return dict(commit=git("rev-parse", "HEAD"),
                modified=git("status", "--porcelain", "--", "reference").splitlines())


def markdown(results) -> str:
    lines = ["| part | KV / index format | indexer (s) | attention (s) | total (s) | "
             "target (s) | verdict |",
             "|---|---|---:|---:|---:|---:|---|"]
    for r in results:
        lines.append(f"| {r['part']} | {r['fmt']} / {r['index_fmt']} | {r['indexer_s']:.2f} "
                     f"| {r['attention_s']:.2f} | {r['total_s']:.2f} | {r['target_s']:g} | "
                     f"{r['verdict']} |")
    return "\n".join(lines)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--fmt", nargs="+", default=["bfloat16"], choices=KV_FORMATS,
                    help="KV cache format(s); fp8 ones use the platform's e4m3 index cache")
    ap.add_argument("--parts", nargs="+", default=["decode", "prefill"],
                    choices=["decode", "prefill"])
    ap.add_argument("--repeat", type=int, default=3, help="best of this many runs")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--profile", action="store_true",
                    help="also cProfile one attention call per part and print the top")
    ap.add_argument("--out", default="reports/reference-speed.json")
    args = ap.parse_args(argv)

    results = []
    for fmt in args.fmt:
        for part in args.parts:
            bench = bench_decode if part == "decode" else bench_prefill
            r = bench(fmt, args.seed, args.repeat, args.profile)
            r["target_s"] = TARGETS[part]
            r["verdict"] = "pass" if r["total_s"] <= TARGETS[part] else "MISS"
            print(f"{part} {fmt}: indexer {r['indexer_s']:.2f} s, attention "
                  f"{r['attention_s']:.2f} s (runs: "
                  f"{', '.join(f'{t:.2f}' for t in r['attention_runs_s'])})", flush=True)
            if r["profile"]:
                print(r["profile"], flush=True)
            results.append(r)

    report = dict(
        what="float64 reference speed at the model shape (best of "
             f"{args.repeat} wall times)",
        model=dict(num_q_heads=MODEL.num_q_heads, num_kv_heads=MODEL.num_kv_heads,
                   head_dim=MODEL.head_dim, page_size=MODEL.page_size, topk=MODEL.topk,
                   num_index_heads=MODEL.num_index_heads, local_blocks=MODEL.local_blocks,
                   initial_blocks=MODEL.initial_blocks),
        source=source_state(),
        machine=dict(cpus=os.cpu_count(), platform=platform.platform(),
                     processor=platform.processor(), python=platform.python_version(),
                     numpy=np.__version__, openblas_threads=os.environ["OPENBLAS_NUM_THREADS"],
                     attention_threads=attention.THREADS),
        results=results,
    )
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2) + "\n")
    print(f"\nwrote {out}\n")
    print(markdown(results))
    return 0 if all(r["verdict"] == "pass" for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
