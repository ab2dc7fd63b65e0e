"""benchmarks/bench_indexer.py, benchmarks/bench_attention_decode.py and
benchmarks/bench_attention_prefill.py: their minimal-bytes counts (hand-derived from the
shape arithmetic), the prefill's useful-work counts, their input sets and selection
distributions, the indexer's torch baseline against the float64 reference, the decode and
prefill checks and tables, their argument parsers (CPU); the kernel bindings in the CPU
interpreter (interp) and the prefill's flex_attention inputs (eager, CPU); one small
end-to-end run of each benchmark (gpu)."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from benchmarks import bench_attention_decode as bad
from benchmarks import bench_attention_prefill as bap
from benchmarks import bench_indexer as bix
from benchmarks import harness, render_bench

B, CTX = 64, 32_768


# ------------------------------------------------------------------------ indexer bytes


def test_indexer_bytes_bf16_model_shape():
    """At the model shape (B 64, 32k contexts, Hi 4, D 128, P 128, K 16, one row) with a
    bf16 index cache every part is its shape product: keys 64*32768*128*2, index_q
    64*4*128*2, block table 64*256 int32 entries, seq_lens 64 int32, output 64*4*16 int32."""
    p = bix.minimal_bytes(B, CTX, "bfloat16")
    assert p["read_index_keys"] == 64 * 32768 * 128 * 2 == 536_870_912
    assert p["read_index_q"] == 64 * 4 * 128 * 2 == 65_536
    assert p["read_block_table"] == 64 * 256 * 4 == 65_536
    assert p["read_seq_lens"] == 64 * 4 == 256
    assert p["write_topk"] == 64 * 4 * 16 * 4 == 16_384
    assert p["total"] == 537_018_624


def test_indexer_bytes_e4m3_model_shape():
    """With an e4m3fn index cache (and e4m3 index_q) keys and index_q take one byte per
    element; the block table, seq_lens and output do not change."""
    p = bix.minimal_bytes(B, CTX, "e4m3fn")
    assert p["read_index_keys"] == 64 * 32768 * 128 * 1 == 268_435_456
    assert p["read_index_q"] == 64 * 4 * 128 * 1 == 32_768
    assert p["total"] == 268_435_456 + 32_768 + 65_536 + 256 + 16_384 == 268_550_400


def test_indexer_bytes_rows_and_partial_pages():
    """Keys are read once per request whatever the rows per request (the last row sees them
    all); index_q and the output scale with the rows; a context that ends inside a page
    still uses that page's table entry: 2 requests of 1000 tokens, P 128 -> 8 entries each."""
    one, four = (bix.minimal_bytes(2, 1000, "bfloat16", rows=r) for r in (1, 4))
    assert four["read_index_keys"] == one["read_index_keys"] == 2 * 1000 * 128 * 2
    assert four["read_index_q"] == 4 * one["read_index_q"] == 2 * 4 * 4 * 128 * 2
    assert four["write_topk"] == 4 * one["write_topk"] == 2 * 4 * 4 * 16 * 4
    assert one["read_block_table"] == 2 * 8 * 4
    for p in (one, four):
        assert p["total"] == sum(v for k, v in p.items() if k != "total")


def test_indexer_for_scale_matches_the_issue():
    """The for_scale entries are vLLM's published numbers, and they are consistent with our
    byte count: each implies a copy bandwidth of 4.32 TB/s (within 1%) at the model shape."""
    fs = {e["cache"]: e for e in bix.FOR_SCALE}
    assert (fs["bf16"]["median_us"], fs["e4m3"]["median_us"]) == (144.5, 85.2)
    for cache, fmt in bix.CACHES.items():
        total = bix.minimal_bytes(B, CTX, fmt)["total"]
        copy_bps = total / (fs[cache]["median_us"] * 1e-6) / fs[cache]["copy_fraction"]
        assert abs(copy_bps / 4.32e12 - 1) < 0.01, cache


# ---------------------------------------------------------------------- attention bytes


def test_attention_bytes_bf16_batch64():
    """Batch 64, bf16 cache: K and V of 16 selected blocks of 128 tokens per (request, KV
    head): 64*4*16*128*(2*128)*2; q and out 64*64*128*2 each; selections 64*4*16 int32;
    seq_lens 64 int32."""
    p = bad.minimal_bytes(64, "bfloat16")
    assert p["read_kv"] == 64 * 4 * 16 * 128 * 256 * 2 == 268_435_456
    assert p["read_q"] == p["write_out"] == 64 * 64 * 128 * 2 == 1_048_576
    assert p["read_topk"] == 64 * 4 * 16 * 4 == 16_384
    assert p["read_seq_lens"] == 256
    assert p["total"] == 270_549_248


def test_attention_bytes_fp8_formats_and_batches():
    """Every fp8 format moves one byte per K/V element (the four formats equal), q and
    out stay bf16; every part is linear in the batch (1, 8, 64, 256)."""
    fp8 = {f: bad.minimal_bytes(64, f) for f in ("e4m3fn", "e4m3fnuz", "e5m2", "e5m2fnuz")}
    assert len({p["total"] for p in fp8.values()}) == 1
    p = fp8["e4m3fn"]
    assert p["read_kv"] == 64 * 4 * 16 * 128 * 256 * 1 == 134_217_728
    assert p["total"] == 134_217_728 + 2 * 1_048_576 + 16_384 + 256 == 136_331_520
    for cache, fmt in bad.CACHES.items():
        one = bad.minimal_bytes(1, fmt)
        for b in bad.BATCHES:
            assert bad.minimal_bytes(b, fmt)["total"] == b * one["total"], (cache, b)


def test_attention_selected_tokens():
    """A row's selection holds K * P tokens when its own block is full (32768 = 256 * 128:
    2048), less the own block's empty tail otherwise (2100 tokens: 15 * 128 + 2100 - 16 *
    128 = 1972), and the whole context when K covers every block (1000 tokens, 8 blocks)."""
    assert bad.selected_tokens(32_768) == 16 * 128 == 2048
    assert bad.selected_tokens(2100) == 15 * 128 + 2100 - 16 * 128 == 1972
    assert bad.selected_tokens(1000) == 1000


# ------------------------------------------------------------------------- input sets


def test_shuffled_block_table():
    """Every entry is a distinct page of the pool (twice the pages used) and the pages are
    not laid out in order."""
    g = torch.Generator().manual_seed(0)
    table, pool = harness.shuffled_block_table(3, 10, g, "cpu")
    assert table.shape == (3, 10) and table.dtype == torch.int32 and pool == 60
    flat = table.flatten()
    assert flat.unique().numel() == 30 and 0 <= int(flat.min()) and int(flat.max()) < 60
    assert not torch.equal(flat, flat.sort().values)


@pytest.mark.parametrize("fmt", ["bfloat16", "e4m3fn", "e4m3fnuz", "e5m2"])
def test_random_cache_is_finite_nonzero(fmt, monkeypatch):
    """Cache content decodes to finite, mostly non-zero N(0, 1)-like values in every format,
    also when filled in several chunks."""
    g = torch.Generator().manual_seed(1)
    monkeypatch.setattr(harness, "FILL_CHUNK_BYTES", 4 * 16 * 8 * 3)  # 3 pages per chunk
    c = harness.random_cache((10, 16, 8), fmt, g, "cpu")
    fp8 = harness.FP8_DTYPES.get(fmt)
    v = (c.view(fp8) if fp8 else c).float()
    assert torch.isfinite(v).all() and (v != 0).float().mean() > 0.9
    assert 0.5 < float(v.std()) < 1.5
    assert not torch.equal(v[0], v[9])  # chunks differ


def test_attention_selections_are_valid():
    """Each (row, KV head) selects its own block, K distinct visible blocks (all of them,
    -1 padded, when fewer are visible), in a non-sorted order somewhere."""
    s = bad.Shape(hq=8, hkv=2, d=64, page=16, topk=4)
    st = bad.make_set(3, "e4m3fn", seed=2, seq_len=100, s=s, dev="cpu")
    assert st.topk.shape == (3, 2, 4) and st.topk.dtype == torch.int32
    own = (100 - 1) // 16
    for row in st.topk.reshape(-1, 4).tolist():
        assert own in row and len(set(row)) == 4 and all(0 <= b <= own for b in row)
    assert any(r != sorted(r) for r in st.topk.reshape(-1, 4).tolist())
    few = bad.make_set(1, "bfloat16", seed=3, seq_len=40, s=s, dev="cpu")  # 3 blocks
    for row in few.topk.reshape(-1, 4).tolist():
        assert sorted(row) == [-1, 0, 1, 2]


def test_attention_hot_pages_fold_the_table_onto_few_pages():
    """--hot-pages N (the L2 diagnostic) leaves the selections and the pool alone and maps
    every block-table entry into [0, N), using more than one of those pages."""
    s = bad.Shape(hq=8, hkv=2, d=64, page=16, topk=4)
    cold = bad.make_set(3, "e4m3fn", seed=2, seq_len=100, s=s, dev="cpu")
    hot = bad.make_set(3, "e4m3fn", seed=2, seq_len=100, s=s, dev="cpu", hot_pages=3)
    assert torch.equal(hot.topk, cold.topk) and hot.kv.shape == cold.kv.shape
    assert torch.equal(hot.table, cold.table % 3) and int(cold.table.max()) >= 3
    assert hot.table.unique().numel() > 1
    assert bad.parse_args(["--hot-pages", "64"]).hot_pages == 64
    assert bad.parse_args([]).hot_pages == 0


def _reference_selection(st: bix.IndexerSet, fmt: str, s: bix.Shape) -> np.ndarray:
    from reference.indexer import indexer_decode

    fp8 = harness.FP8_DTYPES.get(fmt)
    q = (st.index_q.view(fp8) if fp8 else st.index_q).double().numpy()
    codes = st.cache.numpy() if fp8 else st.cache.view(torch.int16).numpy().view(np.uint16)
    return indexer_decode(q, codes, fmt, st.table.numpy(), st.seq_lens.numpy(), st.rows,
                          s.topk, s.local_blocks, s.initial_blocks)


@pytest.mark.parametrize("fmt", list(bix.CACHES.values()))
def test_torch_indexer_selects_the_reference_sets(fmt):
    """The indexer's torch baseline (the speed baseline) selects, on the CPU, the same
    block sets as the float64 reference (reference.indexer) for every row and head: two
    rows per request, a context ending inside a page, K below the visible blocks; so the
    baseline does the op's work and speedups over it mean something."""
    s = bix.Shape(hi=4, d=128, page=16, topk=4)
    st = bix.make_set(3, 100, fmt, seed=4, rows=2, s=s, dev="cpu")
    bix.torch_baseline(fmt, s)(st)()
    want = torch.from_numpy(_reference_selection(st, fmt, s)).transpose(0, 1)
    agree = bix.selection_agreement(st.out, want)
    assert agree == {"sets_equal": 1.0, "blocks_shared": 1.0}


def test_ragged_contexts_bytes_and_set():
    """--ragged: contexts spread evenly from seq_len / 8 to 15 / 8 seq_len (64 requests of
    a 32k mean: 4096 .. 61440 tokens, the mean within a token of 32768); the key bytes and
    table entries are the sums over the requests (a context ending inside a page uses its
    entry); the input set carries those lengths, its table as wide as the longest; and
    its torch baseline still selects the reference's sets."""
    lens = bix.context_lengths(B, CTX, ragged=True)
    assert (lens[0], lens[-1]) == (4096, 61440) and abs(sum(lens) / B - CTX) <= 1
    assert bix.context_lengths(3, 100) == [100, 100, 100]
    p = bix.minimal_bytes(B, CTX, "e4m3fn", ragged=True)
    assert p["read_index_keys"] == sum(lens) * 128
    assert p["read_block_table"] == sum(-(-n // 128) for n in lens) * 4
    s = bix.Shape(hi=4, d=128, page=16, topk=4)
    st = bix.make_set(3, 100, "bfloat16", seed=4, rows=2, s=s, dev="cpu", ragged=True)
    assert st.seq_lens.tolist() == bix.context_lengths(3, 100, ragged=True) == [12, 100, 188]
    assert st.table.shape == (3, 12)
    bix.torch_baseline("bfloat16", s)(st)()
    want = torch.from_numpy(_reference_selection(st, "bfloat16", s)).transpose(0, 1)
    assert bix.selection_agreement(st.out, want) == {"sets_equal": 1.0, "blocks_shared": 1.0}


def test_selection_agreement_counts():
    """Sets are compared regardless of order; blocks_shared counts the shared selected
    blocks over the first selection's valid entries."""
    a = torch.tensor([[[3, 1, 2, -1]], [[0, 1, 2, 3]]])
    b = torch.tensor([[[1, 2, 3, -1]], [[0, 1, 2, 5]]])
    assert bix.selection_agreement(a, b) == {"sets_equal": 0.5, "blocks_shared": 6 / 7}


# ------------------------------------------------------------- decode checks and table


def _decode_doc(times: dict) -> dict:
    results = []
    for (cache, batch), us in times.items():
        r = {"name": "triton", "op": "attention_decode", "cache": cache, "batch": batch,
             "min_bytes": bad.minimal_bytes(batch, bad.CACHES[cache])["total"],
             "median_us": us, "mode": "graph" if us else "error", "note": "boom"}
        if batch == 64 and cache in bad.TARGETS:
            r["targets"] = dict(bad.TARGETS[cache])
        results.append(r)
    doc = {"schema": "bench/1", "device": "NVIDIA H200", "tokens": "B x 32768",
           "copy": {"bytes": 2**31, "bytes_per_s": 4.3e12}, "for_scale": bad.FOR_SCALE,
           "results": results}
    for r, d in zip(results, render_bench.derive(doc)):
        r.update(d)
    doc["checks"] = bad.checks(results)
    return doc


def test_decode_checks():
    """At batch 64: bf16 at 72 us moves 270.5 MB at 3.76 TB/s = 87% of 4.3 TB/s (>= 85%: met);
    e4m3fn at 50 us 2.73 TB/s = 63% (< 70%: missed), but 1.44x faster than bf16; e4m3fnuz
    at 56 us is 12% over e4m3fn (< 15%: ok), e5m2fnuz at 60 us 20% (failed: both fnuz
    formats are held to e4m3fn); e5m2 at 80 us is slower than bf16 (failed). A missing
    median gives None, never a pass."""
    doc = _decode_doc({("bf16", 64): 72.0, ("e4m3fn", 64): 50.0, ("e4m3fnuz", 64): 56.0,
                       ("e5m2fnuz", 64): 60.0, ("e5m2", 64): 80.0, ("bf16", 8): 20.0,
                       ("e4m3fn", 8): None})
    got = {(c["check"], c["cache"], c["batch"]): c["passed"] for c in doc["checks"]}
    assert got == {
        ("fp8 faster than bf16", "e4m3fn", 64): True,
        ("fp8 faster than bf16", "e4m3fnuz", 64): True,
        ("fp8 faster than bf16", "e5m2", 64): False,
        ("fnuz overhead vs e4m3fn", "e4m3fnuz", 64): True,
        ("fp8 faster than bf16", "e5m2fnuz", 64): True,
        ("fnuz overhead vs e4m3fn", "e5m2fnuz", 64): False,
        ("fp8 faster than bf16", "e4m3fn", 8): None,
        ("copy fraction", "bf16", 64): True,
        ("copy fraction", "e4m3fn", 64): False,
    }
    by = {(r["cache"], r["batch"]): r for r in doc["results"]}
    assert by[("e4m3fnuz", 64)]["fnuz_overhead"] == pytest.approx(56 / 50 - 1)
    assert by[("e4m3fn", 64)]["vs_bf16"] == pytest.approx(72 / 50)
    assert by[("bf16", 64)]["copy_fraction"] == pytest.approx(270_549_248 / 72e-6 / 4.3e12)


def test_decode_markdown_rows():
    """The table has one row per (batch, cache) with the derived numbers, the vLLM numbers
    for scale where published, the error of a failed row, and the checks."""
    doc = _decode_doc({("bf16", 64): 72.0, ("e4m3fn", 64): 50.0, ("e4m3fnuz", 64): 56.0,
                       ("e4m3fn", 8): None})
    md = bad.markdown(doc)
    rows = {tuple(c.strip() for c in line.strip("|").split("|")[:2]):
            [c.strip() for c in line.strip("|").split("|")]
            for line in md.splitlines() if line.startswith("| 64") or line.startswith("| 8")}
    bf16 = rows[("64", "bf16")]
    assert bf16[3:] == ["72.0", f"{270_549_248 / 72e-6 / 1e9:.0f}",
                        f"{100 * 270_549_248 / 72e-6 / 4.3e12:.1f}%", "-", "-", "83.8", "yes"]
    fnuz = rows[("64", "e4m3fnuz")]
    assert fnuz[6:9] == ["1.29x", "+12.0%", "-"]
    assert rows[("64", "e4m3fn")][-2:] == ["86.9", "no"]
    assert rows[("8", "e4m3fn")][2] == "error: boom"
    assert "- batch 64 e4m3fnuz: fnuz overhead vs e4m3fn = 0.120 (limit 0.15): yes" in md


def test_decode_markdown_sweep_table():
    """A --knobs sweep renders as one column per knob set (the results' set first, named
    'default' when empty), each cell the median of that (batch, cache, knobs) run, '-'
    where the sweep has no run; no sweep, no table."""
    doc = _decode_doc({("bf16", 64): 72.0, ("e4m3fn", 64): 50.0})
    assert bad.sweep_table(doc) == []
    doc["sweep"] = [{"batch": 64, "cache": "e4m3fn", "knobs": {"num_warps": 8},
                     "median_us": 61.5}]
    lines = bad.sweep_table(doc)
    assert lines[3] == "| batch | cache | default | num_warps=8 |"
    assert "| 64 | e4m3fn | 50.0 | 61.5 |" in lines and "| 64 | bf16 | 72.0 | - |" in lines
    assert "| 64 | e4m3fn | 50.0 | 61.5 |" in bad.markdown(doc)


def test_indexer_markdown_lists_for_scale():
    """The indexer's Markdown lists the published numbers for scale, marked not measured."""
    text = bix.for_scale_lines({"for_scale": bix.FOR_SCALE})
    assert "144.5 us = 86%" in text and "85.2 us = 73%" in text
    assert "not measured here" in text
    assert bix.for_scale_lines({}) == ""


# ------------------------------------------------------------------------------ CLIs


def test_indexer_parser_quick_flags(tmp_path):
    """bench_indexer's parser takes the quick-check flags and defaults to the model run."""
    a = bix.parse_args(["--batch", "2", "--seq-len", "2048", "--rows", "2", "--caches",
                        "e4m3", "--impls", "triton", "--out", str(tmp_path / "x.json"),
                        "--copy-mib", "64", "--warmup-ms", "1", "--rep-ms", "5", "--eager"])
    assert (a.batch, a.seq_len, a.rows, a.caches, a.impls, a.copy_mib, a.eager) == \
        (2, 2048, 2, ["e4m3"], ["triton"], 64, True)
    d = bix.parse_args([])
    assert (d.batch, d.seq_len, d.rows, d.caches) == (64, 32_768, 1, ["bf16", "e4m3"])
    assert d.out.endswith("bench_indexer.json")


def test_attention_parser_quick_flags(tmp_path):
    """bench_attention_decode's parser takes the quick-check flags and defaults to the
    issue's batches and every cache (both fnuz formats included) at 32k contexts."""
    a = bad.parse_args(["--batches", "1", "2", "--seq-len", "4096", "--caches", "bf16",
                        "e4m3fnuz", "--out", str(tmp_path / "y.json"), "--rep-ms", "5"])
    assert (a.batches, a.seq_len, a.caches, a.rep_ms) == ([1, 2], 4096, ["bf16", "e4m3fnuz"],
                                                          5.0)
    d = bad.parse_args([])
    assert d.batches == [1, 8, 64, 256] and d.seq_len == 32_768
    assert d.caches == ["bf16", "e4m3fn", "e4m3fnuz", "e5m2", "e5m2fnuz"]
    assert d.out.endswith("bench_attention_decode.json")


def test_report_path_follows_out(monkeypatch, tmp_path):
    """Reports go to $OUT/<name>.json when OUT is set, else to reports/<name>.json."""
    monkeypatch.setenv("OUT", str(tmp_path))
    assert harness.report_path("bench_indexer") == str(tmp_path / "bench_indexer.json")
    monkeypatch.delenv("OUT")
    assert harness.report_path("x").endswith("reports/x.json")


# ---------------------------------------------------------------- kernel bindings


def _dev() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


@pytest.mark.interp
@pytest.mark.parametrize("fmt", list(bix.CACHES.values()))
def test_indexer_binding_agrees_with_torch(fmt):
    """The benchmark's call of the Triton decode indexer (transposed token-major output,
    shuffled pages, two rows per request) selects the same sets as its torch baseline on a
    small set (interpreted without CUDA, compiled with it)."""
    s = bix.Shape(hi=4, d=128, page=16, topk=4)
    st = bix.make_set(2, 100, fmt, seed=5, rows=2, s=s, dev=_dev())
    bix.triton_indexer(fmt, s)(st)()
    got = st.out.clone()
    bix.torch_baseline(fmt, s)(st)()
    assert bix.selection_agreement(got, st.out) == {"sets_equal": 1.0, "blocks_shared": 1.0}



def _dense_row(q, kv, h, table_row, blocks, pos, s):
    """fp32 softmax attention of one row's query heads ``q`` over KV head h's keys
    ``j <= pos`` of its selected logical ``blocks`` (read through ``table_row``): the
    dense baseline the benchmark bindings are checked against."""
    keys = torch.cat([kv[int(table_row[b]), h] for b in blocks]).float().cpu()
    j = torch.cat([torch.arange(b * s.page, (b + 1) * s.page) for b in blocks])
    keys = keys[j <= pos]
    w = torch.softmax(q.float().cpu() @ keys[:, :s.d].T / s.d ** 0.5, dim=-1)
    return w @ keys[:, s.d:]

def _dense_decode(st: bad.DecodeSet, fmt: str, s: bad.Shape) -> torch.Tensor:
    """fp32 attention of each (row, query head) over its selected blocks' visible keys."""
    fp8 = harness.FP8_DTYPES.get(fmt)
    kv = (st.kv.view(fp8) if fp8 else st.kv).float()
    g = s.hq // s.hkv
    out = torch.zeros(st.q.shape, dtype=torch.float32)
    for r in range(st.q.shape[0]):
        pos = int(st.seq_lens[r]) - 1
        for h in range(s.hkv):
            blocks = sorted(int(b) for b in st.topk[r, h] if b >= 0)
            out[r, h * g:(h + 1) * g] = _dense_row(st.q[r, h * g:(h + 1) * g], kv, h,
                                                   st.table[r], blocks, pos, s)
    return out


@pytest.mark.interp
@pytest.mark.parametrize("fmt", ["bfloat16", "e4m3fnuz"])
def test_attention_binding_computes_sparse_attention(fmt):
    """The benchmark's call of the Triton decode attention (transposed token-major
    selections, scalar fp8 scale, preallocated output) computes attention over each row's
    selected blocks: within bf16 rounding of an fp32 computation on the same inputs."""
    s = bad.Shape(hq=4, hkv=2, d=64, page=16, topk=3)
    st = bad.make_set(2, fmt, seed=6, seq_len=90, s=s, dev=_dev())
    bad.triton_decode(fmt)(st)()
    want = _dense_decode(st, fmt, s)
    torch.testing.assert_close(st.out.float().cpu(), want, atol=2e-2, rtol=2e-2)


# ------------------------------------------------------------------------ GPU runs


@pytest.mark.gpu
def test_bench_indexer_small_run(tmp_path):
    """bench_indexer at 2 x 2048 tokens writes a bench/1 report with both caches' triton and
    torch rows timed (none failed), the selections agreeing, and the Markdown beside it."""
    out = tmp_path / "bench_indexer.json"
    assert bix.main(["--batch", "2", "--seq-len", "2048", "--out", str(out),
                     "--copy-mib", "256", "--warmup-ms", "5", "--rep-ms", "30"]) == 0
    doc = json.loads(out.read_text())
    assert doc["schema"] == "bench/1" and doc["copy"]["bytes_per_s"] > 0
    assert {(r["name"], r["cache"]) for r in doc["results"]} == \
        {(n, c) for n in bix.IMPLS for c in bix.CACHES}
    for r in doc["results"]:
        assert r["median_us"] and r["median_us"] > 0, (r["name"], r["note"])
        assert r["copy_fraction"] is not None
    for cache in bix.CACHES:
        assert doc["agreement"][cache]["blocks_shared"] > 0.99, doc["agreement"]
    assert doc["for_scale"] == bix.FOR_SCALE and (tmp_path / "bench_indexer.md").exists()


@pytest.mark.gpu
def test_bench_attention_decode_small_run(tmp_path):
    """bench_attention_decode at batches 1 and 2 of 4096-token contexts writes a bench/1
    report with every cache timed, finite outputs, the checks of every fp8 cache and the
    Markdown beside it."""
    out = tmp_path / "bench_attention_decode.json"
    assert bad.main(["--batches", "1", "2", "--seq-len", "4096", "--out", str(out),
                     "--copy-mib", "256", "--warmup-ms", "5", "--rep-ms", "30"]) == 0
    doc = json.loads(out.read_text())
    caches = bad.DEFAULT_CACHES
    assert doc["schema"] == "bench/1" and len(doc["results"]) == 2 * len(caches)
    assert {r["cache"] for r in doc["results"]} == set(caches)
    for r in doc["results"]:
        assert r["median_us"] and r["median_us"] > 0, (r["cache"], r["note"])
        assert r["finite_output"], r["cache"]
    fp8 = [c for c in caches if c != "bf16"]
    assert len([c for c in doc["checks"] if c["check"] == "fp8 faster than bf16"]) == 2 * len(fp8)
    assert (tmp_path / "bench_attention_decode.md").exists()


# ------------------------------------------------------------------ attention prefill

# A hand-built selection: page 4, KV heads 2, tokens at positions 10, 11, 12 (own blocks
# 2, 2, 3), K 3, with padding, a repeat (head 0, token 11) and an entry past the own block
# (head 0, token 12: block 5, ignored).
_HAND_TOPK = [[[2, 0, -1], [1, 2, 1], [3, 5, -1]],
              [[-1, -1, 2], [0, 1, 2], [3, 2, 0]]]
_HAND_POS = [10, 11, 12]


def test_prefill_key_counts_hand_example():
    """Keys attended, counted by hand: head 0: token 10 {0, 2}: 4 + 3 (keys 8..10); token 11
    {1, 2}: 4 + 4; token 12 {3}: 1 (key 12) -> 16; head 1: token 10 {2}: 3; token 11 {0, 1,
    2}: 12; token 12 {0, 2, 3}: 4 + 4 + 1 -> 24; total 40. Keys read once: per head blocks 0,
    1 and 2 whole (4 each; block 2 up to key 11 >= its last key) and key 12 of block 3: 13,
    26 in all. Both the torch count and its NumPy twin give these; with G 2 and D 8 the
    useful FLOPs are 4 x 8 x 2 x 40 and the gathered bytes 40 x 16 x 2 (bf16) or x 1 (e4m3)."""
    topk = torch.tensor(_HAND_TOPK, dtype=torch.int32)
    pos = torch.tensor(_HAND_POS)
    assert bap.key_counts(topk, pos, 4) == (40, 26)
    assert bap.key_counts_reference(np.array(_HAND_TOPK), _HAND_POS, 4) == (40, 26)
    # The token-major buffer's transposed view (what the kernel gets) counts the same.
    assert bap.key_counts(topk.transpose(0, 1).contiguous().transpose(0, 1), pos, 4) == (40, 26)
    s = bap.Shape(hq=4, hkv=2, d=8, page=4, topk=3)
    assert bap.useful_flops(40, s) == 4 * 8 * 2 * 40 == 2560
    assert bap.gathered_bytes(40, "bfloat16", s) == 40 * 16 * 2
    assert bap.gathered_bytes(40, "e4m3fn", s) == 40 * 16


def test_prefill_key_counts_agree_with_reference():
    """On random selections with padding, repeats, negative entries other than -1 and
    entries past the own block, the torch count equals the plain-Python one."""
    g = torch.Generator().manual_seed(11)
    topk = torch.randint(-2, 12, (3, 16, 5), generator=g, dtype=torch.int32)
    pos = torch.arange(20, 36)
    assert bap.key_counts(topk, pos, 4) == bap.key_counts_reference(topk.numpy(), pos.numpy(), 4)


@pytest.mark.parametrize("dist", bap.DISTS)
def test_prefill_useful_work_at_model_shape(dist):
    """At the benchmark's shape (8192 new tokens on an 8192-token prefix, K 16, P 128) every
    (token, KV head) of both distributions attends K - 1 full blocks and its own block up to
    itself: 4 x (8192 x 15 x 128 + 64 x (1 + ... + 128)) = 65,028,096 keys, 532,710,162,432
    useful FLOPs (G 16, D 128); random selections read every key of every KV head once
    (4 x 16384), locality ones at least the 75 blocks 53..127 of every head."""
    g = torch.Generator().manual_seed(0)
    pos = torch.arange(8192, 16384)
    sel = bap.SELECTIONS[dist](pos, 4, g, bap.SHAPE)
    attended, read = bap.key_counts(sel.transpose(0, 1), pos, 128)
    assert attended == 4 * (8192 * 15 * 128 + 64 * (128 * 129 // 2)) == 65_028_096
    assert bap.useful_flops(attended) == 532_710_162_432
    if dist == "random":
        assert read == 4 * 16384
    else:
        assert 4 * 75 * 128 <= read <= 4 * 16384


def test_prefill_minimal_bytes_model_shape():
    """Every key of every KV head read once (4 x 16384 keys x 256 elements: 33,554,432 B
    bf16, 16,777,216 B e4m3), q and out 8192 x 64 x 128 x 2 each, selections 8192 x 4 x 16
    int32, the block table 128 int32, seq_lens one int32, cu_seqlens_q two."""
    p = bap.minimal_bytes(8192, 8192, "bfloat16", 4 * 16384)
    assert p["read_kv"] == 4 * 16384 * 256 * 2 == 33_554_432
    assert p["read_q"] == p["write_out"] == 8192 * 64 * 128 * 2 == 134_217_728
    assert p["read_topk"] == 8192 * 4 * 16 * 4 == 2_097_152
    assert (p["read_block_table"], p["read_seq_lens"], p["read_cu_seqlens"]) == (512, 4, 8)
    assert p["total"] == 304_087_564
    assert bap.minimal_bytes(8192, 8192, "e4m3fn", 4 * 16384)["total"] == 304_087_564 - 16_777_216


def _rows(sel: torch.Tensor):
    """(token index, head, list of entries) of a token-major selection buffer."""
    t, h, _ = sel.shape
    return [(i, j, sel[i, j].tolist()) for i in range(t) for j in range(h)]


def _valid_set(row, own, k):
    """-1 only as padding, every other entry a distinct visible block, the own block in."""
    blocks = [b for b in row if b != -1]
    assert len(row) == k and all(0 <= b <= own for b in blocks), row
    assert len(set(blocks)) == len(blocks) and own in blocks, row
    return set(blocks)


def test_prefill_locality_selections_are_valid():
    """Locality selections (page 8, K 8: recent 5, far 2; 48 new tokens on an 80-token
    prefix, tiles of 16 tokens): each (token, head) holds a valid set with its own block
    and the 5 before it; the other 2 entries are shared by every token of its tile (per
    head), differ between heads somewhere, and lie wholly in the prefix before the recent
    window of the tile's first token. With a 16-token prefix (2 blocks) the recent window
    is cut at block 0, no far block exists, and the rest is -1 padding. Entries are not
    sorted somewhere."""
    s = bap.Shape(hq=4, hkv=2, d=16, page=8, topk=8)
    assert bap.locality_split(8) == (5, 2) and bap.locality_split(16) == (11, 4)
    g = torch.Generator().manual_seed(3)
    pos = torch.arange(80, 128)
    sel = bap.locality_selections(pos, 2, g, s, tile=16)
    assert sel.shape == (48, 2, 8) and sel.dtype == torch.int32
    far = {}
    for i, h, row in _rows(sel):
        own = (80 + i) // 8
        blocks = _valid_set(row, own, 8)
        recent = set(range(own - 5, own + 1))
        assert recent <= blocks and -1 not in row
        first_own = (80 + 16 * (i // 16)) // 8
        assert all(b < min(10, first_own - 5) for b in blocks - recent), (i, row)
        far.setdefault((i // 16, h), set()).add(frozenset(blocks - recent))
    assert all(len(v) == 1 and len(next(iter(v))) == 2 for v in far.values())
    assert any(far[(t, 0)] != far[(t, 1)] for t in range(3))
    assert any(row != sorted(row) for _, _, row in _rows(sel))
    short = bap.locality_selections(torch.arange(16, 48), 2, g, s, tile=16)
    for i, _, row in _rows(short):
        own = (16 + i) // 8
        assert _valid_set(row, own, 8) == set(range(max(0, own - 5), own + 1)), row


def test_prefill_random_selections_are_valid():
    """Random selections of a set (page 16, K 4; 20 new tokens on a 100-token prefix): each
    (token, head) holds K distinct visible blocks with its own block, unsorted somewhere;
    the same seed gives the same selections for both caches; with fewer visible blocks than
    K (8 tokens from position 0) every visible block, -1 padded."""
    s = bap.Shape(hq=4, hkv=2, d=64, page=16, topk=4)
    st = bap.make_set("bfloat16", "random", 2, new_tokens=20, prefix=100, s=s, dev="cpu")
    assert st.topk.shape == (20, 2, 4) and st.topk.dtype == torch.int32
    assert st.positions.tolist() == list(range(100, 120)) and st.seq_lens.tolist() == [120]
    assert st.cu_seqlens.tolist() == [0, 20] and st.table.shape == (1, 8)
    for i, _, row in _rows(st.topk):
        assert len(_valid_set(row, (100 + i) // 16, 4)) == 4
    assert any(row != sorted(row) for _, _, row in _rows(st.topk))
    e4m3 = bap.make_set("e4m3fn", "random", 2, new_tokens=20, prefix=100, s=s, dev="cpu")
    assert torch.equal(e4m3.topk, st.topk) and e4m3.kv.dtype == torch.uint8
    assert e4m3.scale.dim() == 0 and float(e4m3.scale) == 1.0 and st.scale is None
    few = bap.make_set("bfloat16", "random", 3, new_tokens=8, prefix=0, s=s, dev="cpu")
    for _, _, row in _rows(few.topk):
        assert sorted(row) == [-1, -1, -1, 0]


def _prefill_result(cache, dist, us, flex_us, **extra):
    attended = 65_028_096
    return {"name": "triton", "op": "attention_prefill", "cache": cache, "dist": dist,
            "min_bytes": 304_087_564, "median_us": us, "mode": "graph" if us else "error",
            "note": "" if us else "boom", "useful_flops": bap.useful_flops(attended),
            "gathered_bytes": bap.gathered_bytes(attended, bap.CACHES[cache]),
            "flex": None if flex_us is False else
            {"name": "flex", "median_us": flex_us, "mode": "graph", "note": ""}, **extra}


def _prefill_doc(results) -> dict:
    doc = {"schema": "bench/1", "device": "NVIDIA H200", "tokens": "8192 new + 8192 prefix",
           "copy": {"bytes": 2**31, "bytes_per_s": 4.3e12}, "for_scale": bap.FOR_SCALE,
           "results": results, "sweep": []}
    doc["checks"] = bap.checks(results)
    return doc


def _fabricated_prefill_doc() -> dict:
    return _prefill_doc([_prefill_result("bf16", "locality", 1700.0, 1800.0),
                         _prefill_result("bf16", "random", 3000.0, 41000.0),
                         _prefill_result("e4m3fn", "locality", 1900.0, 1800.0),
                         _prefill_result("e4m3fn", "random", None, 41000.0)])


def test_prefill_checks():
    """bf16 locality at 1700 us vs flex 1800 us: 1.06x (>= 1: met); e4m3 locality at 1900 us:
    0.95x flex (missed) and slower than bf16 (1700 / 1900 < 1: failed); bf16 random at 3000 us
    does 532.7 GFLOP in 3 ms = 177.6 TFLOP/s (>= 150: met); a failed e4m3 random run gives
    None for its checks, never a pass; without flex (--no-flex) the locality check is None."""
    doc = _fabricated_prefill_doc()
    got = {(c["check"], c["dist"], c["cache"]): c["passed"] for c in doc["checks"]}
    assert got == {
        ("locality vs flex", "locality", "bf16"): True,
        ("random useful TFLOP/s", "random", "bf16"): True,
        ("locality vs flex", "locality", "e4m3fn"): False,
        ("e4m3 at least as fast as bf16", "locality", "e4m3fn"): False,
        ("random useful TFLOP/s", "random", "e4m3fn"): None,
        ("e4m3 at least as fast as bf16", "random", "e4m3fn"): None,
    }
    by = {(r["cache"], r["dist"]): r for r in doc["results"]}
    assert by[("bf16", "random")]["useful_tflops"] == pytest.approx(532_710_162_432 / 3e-3 / 1e12)
    assert by[("bf16", "random")]["gathered_bytes_per_s"] == pytest.approx(33_294_385_152 / 3e-3)
    assert by[("bf16", "random")]["flex_useful_tflops"] == pytest.approx(532.710162432 / 41)
    assert by[("bf16", "locality")]["vs_flex"] == pytest.approx(1800 / 1700)
    assert by[("e4m3fn", "locality")]["vs_bf16"] == pytest.approx(1700 / 1900)
    alone = _prefill_doc([_prefill_result("bf16", "locality", 1700.0, False)])
    assert alone["checks"] == [{"check": "locality vs flex", "dist": "locality",
                                "cache": "bf16", "value": None, "limit": 1.0, "passed": None}]


def _round(bf16_loc, e4m3_loc, flex_loc=1800.0):
    return ([_prefill_result("bf16", "locality", bf16_loc, flex_loc),
             _prefill_result("e4m3fn", "locality", e4m3_loc, flex_loc)], [])


def test_prefill_rounds_pair_ratios_within_a_round():
    """``merge_rounds`` over three rounds (bf16 / e4m3fn locality 1700 / 1710, 1600 / 1590,
    1800 / 1790 us; flex 1800): each median is the median of the rounds' (1700, 1710), and
    ``e4m3 >= bf16`` is the median of the per-round ratios (0.994, 1.006, 1.006: met)
    where the ratio of the medians (1700 / 1710 = 0.994) would miss it: a slow round
    slows both caches alike. A round without a time gives None, never a pass; one round
    is ``checks`` as it was (no round values)."""
    rounds = [_round(1700.0, 1710.0), _round(1600.0, 1590.0), _round(1800.0, 1790.0)]
    results, sweep, checks = bap.merge_rounds(rounds)
    assert [r["median_us"] for r in results] == [1700.0, 1710.0]
    assert results[1]["round_medians_us"] == [1710.0, 1590.0, 1790.0]
    assert results[0]["flex"]["round_medians_us"] == [1800.0] * 3 and sweep == []
    got = {(c["check"], c["cache"]): c for c in checks}
    ratio = got[("e4m3 at least as fast as bf16", "e4m3fn")]
    assert ratio["round_values"] == pytest.approx([1700 / 1710, 1600 / 1590, 1800 / 1790])
    assert ratio["value"] == pytest.approx(1800 / 1790) and ratio["passed"] is True
    assert results[1]["vs_bf16"] == pytest.approx(1800 / 1790)
    assert got[("locality vs flex", "bf16")]["value"] == pytest.approx(1800 / 1700)
    failed = bap.merge_rounds([_round(1700.0, 1710.0), _round(1600.0, None)])[2]
    assert [c["passed"] for c in failed if c["cache"] == "e4m3fn"] == [None, None]
    one = bap.merge_rounds([_round(1700.0, 1710.0)])
    assert one[2] == bap.checks(_round(1700.0, 1710.0)[0])
    assert "round_values" not in one[2][0] and "round_medians_us" not in one[0][0]


def test_prefill_markdown_lists_round_values_and_parser_takes_rounds():
    """A merged check's line lists its per-round values, and the table's ratios are the
    paired ones (x vs bf16 1.01x, the median round's, not 1700 / 1710 = 0.99x of the
    medians; x vs flex 1.05x); ``--rounds`` defaults to 1 and must be at least 1."""
    rounds = [_round(1700.0, 1710.0), _round(1600.0, 1590.0), _round(1800.0, 1790.0)]
    doc = _prefill_doc([])
    doc["results"], doc["sweep"], doc["checks"] = bap.merge_rounds(rounds)
    md = bap.markdown(doc)
    assert ("- locality e4m3fn: e4m3 at least as fast as bf16 = 1.006 (rounds: 0.994, "
            "1.006, 1.006) (limit 1.0): yes") in md
    row = next(line for line in md.splitlines() if line.startswith("| e4m3fn | locality"))
    assert row.split("|")[9:11] == [" 1.05x ", " 1.01x "]  # x vs bf16 of the medians: 0.99x
    assert bap.parse_args([]).rounds == 1 and bap.parse_args(["--rounds", "5"]).rounds == 5
    with pytest.raises(SystemExit):
        bap.parse_args(["--rounds", "0"])


def test_prefill_markdown_rows(tmp_path):
    """The table has one row per (cache, distribution) with useful TFLOP/s, gathered GB/s,
    flex's time and TFLOP/s, the ratios, the published vLLM / flex numbers for scale and
    whether its checks held; a failed row shows its error; the checks, the for-scale list
    (matmul included) follow. render_bench's CLI renders the same table from the JSON."""
    doc = _fabricated_prefill_doc()
    md = bap.markdown(doc)
    rows = {tuple(c.strip() for c in line.strip("|").split("|")[:2]):
            [c.strip() for c in line.strip("|").split("|")]
            for line in md.splitlines() if line.startswith(("| bf16", "| e4m3fn"))}
    assert rows[("bf16", "random")] == [
        "bf16", "random", "graph", "3000.0", f"{532.710162432 / 3e-3 / 1e3:.1f}",
        f"{33_294_385_152 / 3e-3 / 1e9:.0f}", "41000.0", f"{532.710162432 / 41:.1f}",
        f"{41000 / 3000:.2f}x", "-", "123 / 13", "yes"]
    assert rows[("e4m3fn", "locality")][8:] == ["0.95x", "0.89x", "67 / 296", "no"]
    assert rows[("e4m3fn", "random")][2] == "error: boom"
    assert "- locality bf16: locality vs flex = 1.059 (limit 1.0): yes" in md
    assert "- bf16 matmul (bf16, - selections): 700 TFLOP/s" in md
    src = tmp_path / "bench_attention_prefill.json"
    src.write_text(json.dumps(doc))
    assert render_bench.main([str(src)]) == 0
    assert (tmp_path / "bench_attention_prefill.md").read_text() == md


def test_phase_rows_split_the_launches_into_calls():
    """harness.phase_rows: kernels in launch order over calls of one launch sequence give
    one row per step with the median over the calls (three calls: the middle time); a
    count that does not split into the calls, or calls that launch different kernels at a
    step, are errors, never a misattributed table."""
    seq = [("fill", 1.0), ("tier", 4.0), ("prefill", 1600.0)]
    times = [(0.0, 0.0, 10.0), (1.0, -1.0, 5.0), (2.0, 1.0, -5.0)]
    kernels = [(name, t + dt[i]) for dt in times for i, (name, t) in enumerate(seq)]
    assert harness.phase_rows(kernels, 3) == [
        {"step": 0, "kernel": "fill", "us": 2.0}, {"step": 1, "kernel": "tier", "us": 4.0},
        {"step": 2, "kernel": "prefill", "us": 1605.0}]
    with pytest.raises(ValueError, match="split"):
        harness.phase_rows(kernels[:-1], 3)
    with pytest.raises(ValueError, match="step 1"):
        harness.phase_rows(kernels[:4] + [("predecode", 3.0)] + kernels[5:], 3)


def test_prefill_markdown_lists_launches_when_asked():
    """``--phases`` results add a launches-per-call table (step, kernel, us), with a
    failed breakdown's error in its row; without them the report has no such table."""
    doc = _fabricated_prefill_doc()
    assert "Launches per call" not in bap.markdown(doc)
    doc["results"][0]["phases"] = [{"step": 0, "kernel": "_tier_kernel", "us": 4.25},
                                   {"step": 1, "kernel": "_prefill_kernel", "us": 1600.0}]
    doc["results"][1]["phases_error"] = "profiler unavailable"
    md = bap.markdown(doc)
    assert "| bf16 | locality | defaults | 0 | _tier_kernel | 4.2 |" in md
    assert "| bf16 | locality | defaults | 1 | _prefill_kernel | 1600.0 |" in md
    assert "| bf16 | random | defaults | - | error: profiler unavailable | - |" in md
    assert bap.parse_args(["--phases"]).phases and not bap.parse_args([]).phases


def test_prefill_parser_quick_flags(tmp_path):
    """bench_attention_prefill's parser takes the quick-check flags and defaults to the
    target run: 8192 new tokens on an 8192-token prefix, both caches and distributions,
    flex timed with its own kernel options."""
    a = bap.parse_args(["--new-tokens", "1024", "--prefix", "2048", "--caches", "e4m3fn",
                        "--dists", "random", "--knobs", "block_rows=32", "block_rows=16",
                        "--flex-knobs", "BLOCK_M=64", "--no-flex", "--out",
                        str(tmp_path / "p.json"), "--rep-ms", "5"])
    assert (a.new_tokens, a.prefix, a.caches, a.dists, a.no_flex, a.rep_ms) == \
        (1024, 2048, ["e4m3fn"], ["random"], True, 5.0)
    assert a.knobs == [{"block_rows": 32}, {"block_rows": 16}] and a.flex_knobs == {"BLOCK_M": 64}
    d = bap.parse_args([])
    assert (d.new_tokens, d.prefix, d.caches, d.dists) == \
        (8192, 8192, ["bf16", "e4m3fn"], ["locality", "random"])
    assert (d.knobs, d.flex_knobs, d.no_flex) == ([], {}, False)
    assert d.out.endswith("bench_attention_prefill.json")
    with pytest.raises(SystemExit):
        bap.parse_args(["--new-tokens", "0"])


def _dense_prefill(st: bap.PrefillSet, fmt: str, s: bap.Shape) -> torch.Tensor:
    """fp32 attention of each (token, query head) over its selected blocks' keys j <= p."""
    fp8 = harness.FP8_DTYPES.get(fmt)
    kv = (st.kv.view(fp8) if fp8 else st.kv).float().cpu()
    g = s.hq // s.hkv
    out = torch.zeros(st.q.shape, dtype=torch.float32)
    for i, p in enumerate(st.positions.tolist()):
        for h in range(s.hkv):
            blocks = sorted({int(b) for b in st.topk[i, h] if 0 <= b <= p // s.page})
            out[i, h * g:(h + 1) * g] = _dense_row(st.q[i, h * g:(h + 1) * g], kv, h,
                                                   st.table[0], blocks, p, s)
    return out


_PREFILL_TINY = bap.Shape(hq=4, hkv=2, d=64, page=16, topk=4)


@pytest.mark.interp
@pytest.mark.parametrize("dist", bap.DISTS)
@pytest.mark.parametrize("fmt", ["bfloat16", "e4m3fn"])
def test_prefill_binding_computes_sparse_attention(fmt, dist):
    """The benchmark's call of the Triton prefill attention (one request, transposed
    token-major selections, scalar fp8 scale, preallocated output) computes attention over
    each token's selected blocks, causal in its own: within bf16 rounding of an fp32
    computation on the same inputs (24 new tokens on a 128-token prefix, K 4)."""
    st = bap.make_set(fmt, dist, 4, new_tokens=24, prefix=128, s=_PREFILL_TINY, dev=_dev())
    bap.triton_prefill(fmt)(st)()
    want = _dense_prefill(st, fmt, _PREFILL_TINY)
    torch.testing.assert_close(st.out.float().cpu(), want, atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("fmt", ["bfloat16", "e4m3fn"])
def test_prefill_flex_inputs_compute_the_same_attention(fmt):
    """flex_attention on the benchmark's flex inputs (the pages gathered and dequantised to
    contiguous K/V, the BlockMask of the selections; run eagerly in fp32 here) computes the
    same sparse attention as an fp32 computation on the paged cache, for both distributions:
    the peer is timed on the same work."""
    from oracle.impls import flex as impl_flex

    s = _PREFILL_TINY
    for dist in bap.DISTS:
        st = bap.make_set(fmt, dist, 5, new_tokens=24, prefix=128, s=s, dev=_dev())
        f = bap.flex_inputs(st, fmt, s)
        assert f.q.shape == (1, 4, 24, 64) and f.k.shape == f.v.shape == (1, 2, 160, 64)
        o = impl_flex.attend(f.q.float(), f.k.float(), f.v.float(), f.block_mask, f.scale,
                             s.page, compiled=False)
        want = _dense_prefill(st, fmt, s)
        torch.testing.assert_close(o[0].transpose(0, 1).float().cpu(), want, atol=2e-2,
                                   rtol=2e-2)


def test_prefill_flex_full_blocks_compute_the_same_attention():
    """The peer's BlockMask with full blocks (the benchmark's default) on
    256 new tokens, two query blocks of 128: locality selections give full blocks (each
    query block's shared far block) and flex (eager, fp32) still computes the sparse
    attention of the fp32 computation on the paged cache; random ones give none."""
    from oracle.impls import flex as impl_flex

    s, fmt = _PREFILL_TINY, "bfloat16"
    for dist, has_full in (("locality", True), ("random", False)):
        st = bap.make_set(fmt, dist, 6, new_tokens=256, prefix=128, s=s, dev=_dev())
        f = bap.flex_inputs(st, fmt, s)
        assert (int(f.block_mask.full_kv_num_blocks.sum()) > 0) == has_full
        o = impl_flex.attend(f.q.float(), f.k.float(), f.v.float(), f.block_mask, f.scale,
                             s.page, compiled=False)
        torch.testing.assert_close(o[0].transpose(0, 1).float().cpu(),
                                   _dense_prefill(st, fmt, s), atol=2e-2, rtol=2e-2)


@pytest.mark.gpu
def test_bench_attention_prefill_small_run(tmp_path):
    """bench_attention_prefill at 1024 new tokens on a 2048-token prefix, two knob sets,
    writes a bench/1 report with every (cache, distribution) timed, finite outputs agreeing
    with flex_attention's, flex timed on both distributions, the six checks decided, a
    sweep of the second knob set, and the Markdown beside it."""
    out = tmp_path / "bench_attention_prefill.json"
    assert bap.main(["--new-tokens", "1024", "--prefix", "2048", "--out", str(out),
                     "--knobs", "block_rows=64", "block_rows=32", "--copy-mib", "256",
                     "--warmup-ms", "5", "--rep-ms", "30"]) == 0
    doc = json.loads(out.read_text())
    assert doc["schema"] == "bench/1" and len(doc["results"]) == 4 and len(doc["sweep"]) == 4
    for r in doc["results"]:
        assert r["median_us"] and r["median_us"] > 0, (r["cache"], r["dist"], r["note"])
        assert r["finite_output"] and r["useful_tflops"] > 0, (r["cache"], r["dist"])
        assert r["flex"]["median_us"] > 0, r["flex"]["note"]
        assert r["max_abs_diff_vs_flex"] < 5e-2 and r["vs_flex"] > 0
    assert len(doc["checks"]) == 6 and all(c["passed"] is not None for c in doc["checks"])
    assert doc["for_scale"] == bap.FOR_SCALE and (tmp_path / "bench_attention_prefill.md").exists()


@pytest.mark.gpu
def test_bench_attention_prefill_rounds_run(tmp_path):
    """``--rounds 2`` (1024 new tokens on a 2048-token prefix, locality, no flex): both
    caches timed in each round, their medians over the two rounds, the e4m3 >= bf16 check
    decided from its two per-round ratios, and the note saying so."""
    out = tmp_path / "bench_attention_prefill.json"
    assert bap.main(["--new-tokens", "1024", "--prefix", "2048", "--out", str(out),
                     "--dists", "locality", "--no-flex", "--rounds", "2", "--copy-mib",
                     "256", "--warmup-ms", "5", "--rep-ms", "30"]) == 0
    doc = json.loads(out.read_text())
    for r in doc["results"]:
        assert len(r["round_medians_us"]) == 2 and all(t > 0 for t in r["round_medians_us"])
        assert r["median_us"] == pytest.approx(sum(r["round_medians_us"]) / 2)
    ratio = next(c for c in doc["checks"] if c["check"] == "e4m3 at least as fast as bf16")
    assert len(ratio["round_values"]) == 2 and ratio["passed"] is not None
    assert any("2 rounds" in n for n in doc["notes"])


@pytest.mark.gpu
def test_kernel_times_lists_each_kernel_per_call():
    """profile_launch.kernel_times over 3 calls of a function launching two kinds of
    kernel (a fill and a matmul): the wall line, the fill's row, and for each row a
    positive time and a whole number of launches per call."""
    from benchmarks.profile_launch import kernel_times

    a = torch.empty(512, 512, device="cuda")

    def fn():
        a.fill_(1.0)
        return a @ a

    text = kernel_times(fn, 3)
    lines = text.splitlines()
    assert lines[0].startswith("wall ") and "GPU kernels" in lines[0]
    rows = [ln.split("|") for ln in lines[3:]]
    assert len(rows) >= 2 and any("Fill" in row[3] for row in rows), text
    for row in rows:
        assert float(row[1]) > 0 and float(row[2]) >= 1 and float(row[2]).is_integer(), text
