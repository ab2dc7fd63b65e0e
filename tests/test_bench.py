"""benchmarks/: the minimal-bytes count of the fused insert, the torch baseline the
benchmark times, the Markdown rendering of a bench/1 report, the rotation of input sets
(CPU); and one small end-to-end run of benchmarks/bench_insert.py (gpu)."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from benchmarks import bench_insert, harness, render_bench
from oracle.core import rand
from oracle.impls.torch_peer import _Flags, _fused

N = 16_384


def test_minimal_bytes_match_the_issue():
    """At the model shape and 16,384 tokens the analytic count is the commonly quoted ~669 MB
    (bf16 caches) and, counting index_q at 2 B as that figure does, ~650 MB (e4m3 caches),
    each within 1%; the count used for e4m3 (index_q as e4m3 codes, contract.md s.4) is exactly
    Hi * D bytes per token below that convention."""
    bf16 = bench_insert.minimal_bytes(N, "bfloat16", "bfloat16")
    e4m3_issue = bench_insert.minimal_bytes(N, "e4m3fn", "e4m3fn", index_q_bytes=2)
    e4m3 = bench_insert.minimal_bytes(N, "e4m3fn", "e4m3fn")
    assert abs(bf16["total"] / 669e6 - 1) < 0.01
    assert abs(e4m3_issue["total"] / 650e6 - 1) < 0.01
    s = bench_insert.SHAPE
    assert e4m3_issue["total"] - e4m3["total"] == N * s.hi * s.d
    for parts in (bf16, e4m3):
        assert parts["total"] == sum(v for k, v in parts.items() if k != "total")


def test_reshape_and_cache_bytes():
    """The K/V-only insert moves K and V (bf16) in, the slot, and the cache entries out."""
    s = bench_insert.SHAPE
    kv = 2 * s.hkv * s.d
    assert bench_insert.minimal_bytes_reshape_and_cache(N, "bfloat16") == N * (4 * kv + 8)
    assert bench_insert.minimal_bytes_reshape_and_cache(N, "e4m3fn") == N * (3 * kv + 8)


def _codes(t: torch.Tensor) -> np.ndarray:
    a = t.cpu().contiguous()
    return a.view(torch.int16).numpy().view(np.uint16) if a.dtype == torch.bfloat16 \
        else a.numpy()


def _oracle_inputs(st: bench_insert.InsertSet, kv_fmt: str, index_fmt: str) -> dict:
    """The benchmark's input set in oracle.core.cases' numpy conventions."""
    s = bench_insert.SHAPE

    def vals(t):
        return t.double().numpy()

    return dict(
        model_dtype="bfloat16", num_q_heads=s.hq, num_kv_heads=s.hkv, head_dim=s.d,
        num_index_heads=s.hi, has_index_k=True, rows=vals(st.rows),
        positions=st.positions.numpy(), rotary_dim=s.rotary, rope_table=vals(st.table),
        eps=s.eps, **{f"weights_{k}": vals(w) for k, w in st.w.items()},
        kv_cache=_codes(st.kv), kv_fmt=kv_fmt, slot_mapping=st.slots.numpy(), k_scale=None,
        v_scale=None, index_fmt=index_fmt, index_cache=_codes(st.ic))


@pytest.mark.parametrize("cache", list(bench_insert.CACHES))
def test_composition_computes_the_op(cache):
    """The benchmark's eager torch composition (the speed baseline) produces, on the CPU at
    the model shape, the same codes as the oracle's registered torch baseline
    (oracle.impls.torch_peer), which the oracle checks against the float64 reference: the
    baseline does all the work of the op, so speedups over it are meaningful."""
    kv_fmt, index_fmt = bench_insert.CACHES[cache]
    n, s = 6, bench_insert.SHAPE
    st = bench_insert.make_set(n, kv_fmt, index_fmt, seed=3, dev="cpu")
    want = _fused(_oracle_inputs(st, kv_fmt, index_fmt), _Flags())
    bench_insert.composition(kv_fmt, index_fmt, compiled=False)(st)()
    x, iq0 = st.rows.view(n, -1, s.d), s.hq + 2 * s.hkv
    got = {"q": x[:, :s.hq], "k": x[:, s.hq:s.hq + s.hkv], "kv_cache": st.kv,
           "index_k": x[:, -1], "index_cache": st.ic,
           "index_q": st.iq_out if st.iq_out is not None else x[:, iq0:iq0 + s.hi]}
    assert set(want) == set(got)
    for key, t in got.items():
        np.testing.assert_array_equal(_codes(t), want[key], err_msg=key)


@pytest.mark.interp
@pytest.mark.parametrize("cache", list(bench_insert.CACHES))
def test_kernel_binding_agrees_with_composition(cache):
    """The benchmark's call of the Triton kernel (its arguments, in-place q, the fp8
    index_q buffer) writes the same codes as its torch composition on identical inputs at
    the model shape (3 tokens; the CPU interpreter without CUDA, compiled with it)."""
    kv_fmt, index_fmt = bench_insert.CACHES[cache]
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    agree = bench_insert.agreement(kv_fmt, index_fmt, 3, dev=dev)
    shares = {k: v for k, v in agree.items() if k.endswith("mismatch")}
    assert len(shares) == (4 if cache == "e4m3" else 3)
    # fp32 rsqrt/FMA differences may move a rare code on the GPU; none on the CPU.
    assert all(v <= (0.01 if dev == "cuda" else 0.0) for v in shares.values()), agree


def test_rotation_count_exceeds_twice_l2():
    """k input sets of b bytes make k * b > 2 * L2, with the fewest sets that do, and never
    fewer than two (one set would meet its own bytes in L2 on the next call)."""
    l2 = 50 * 2**20
    for b in (1, 10 * 2**20, 50 * 2**20, 2 * l2, 669_000_000):
        k = harness.rotation_count(b, l2)
        assert k * b > 2 * l2 and k >= harness.MIN_SETS == 2
        assert k == harness.MIN_SETS or (k - 1) * b <= 2 * l2


def test_replay_repeats_make_a_replay_last_the_minimum():
    """The rotation is repeated the fewest whole times that make a replay last at least
    the minimum; a rotation already that long is replayed once; no time is an error."""
    for us in (0.5, 14.0, 147.8, 999.0, 1000.0, 5300.0):
        n = harness.replay_repeats(us, 1000.0)
        assert n * us >= 1000.0 and (n == 1 or (n - 1) * us < 1000.0)
    assert harness.replay_repeats(5300.0) == 1
    with pytest.raises(ValueError, match="rotation_us"):
        harness.replay_repeats(0.0)


@pytest.mark.gpu
def test_time_calls_times_back_to_back_calls():
    """A rotation of two ~microsecond calls is replayed repeated until the replay lasts
    MIN_REPLAY_US (calls_per_replay counts the repeats, a multiple of the rotation) with
    the one-call replay beside it; a rotation longer than that is replayed once, without."""
    x = torch.zeros(2**20, device="cuda")
    short = harness.time_calls([lambda: x.add_(1), lambda: x.mul_(1)], 1, 10)
    assert short.mode == "graph" and short.calls_per_replay % 2 == 0
    assert short.calls_per_replay * short.median_us >= 0.9 * harness.MIN_REPLAY_US
    assert short.one_call_us is not None and short.one_call_us > 0 < short.median_us
    big = torch.zeros(2**28, device="cuda")  # 1 GiB: each fill ~0.25 ms, eight of them
    long = harness.time_calls([lambda: big.fill_(1.0), lambda: big.fill_(2.0)] * 4, 1, 20)
    assert long.calls_per_replay == 8 and long.one_call_us is None


def _synthetic_report() -> dict:
    copy_bps = 4.3e12
    mb = 669_254_656

    def res(name, us, **extra):
        return {"name": name, "op": "norm_rope_insert", "cache": "bf16", "min_bytes": mb,
                "median_us": us, "mode": "graph", **extra}

    return {"schema": "bench/1", "device": "NVIDIA H200", "torch": "2.11", "triton": "3.6",
            "tokens": N, "copy": {"bytes": 2**31, "bytes_per_s": copy_bps},
            "results": [
                res("triton", 190.0, baselines=["torch_compiled", "torch_eager"],
                    targets={"copy_fraction": 0.8, "torch_compiled": 5.0}),
                res("torch_compiled", 1040.0), res("torch_eager", 3870.0),
                {**res("triton", 250.0, baselines=["torch_compiled", "torch_eager"],
                       targets={"copy_fraction": 0.8, "torch_compiled": 5.0}),
                 "cache": "e4m3"},
                {**res("torch_compiled", 1000.0), "cache": "e4m3"},
                {**res("torch_eager", None), "cache": "e4m3", "mode": "error",
                 "note": "boom"}]}


def test_decode_benchmarks_share_a_workspace_unless_told_not_to():
    """The decode benchmarks' calls share one ``Workspace`` (a server's way) by default; the
    knob ``workspace=none`` gives the launcher's fresh buffers; other knobs pass through and
    a bad value is refused."""
    from kernels._host import Workspace

    knobs, ws = harness.split_workspace(harness.parse_knobs("num_warps=8"))
    assert knobs == {"num_warps": 8} and isinstance(ws, Workspace)
    knobs, ws = harness.split_workspace(harness.parse_knobs("workspace=none,grid=flat"))
    assert knobs == {"grid": "flat"} and ws is None
    with pytest.raises(ValueError, match="workspace"):
        harness.split_workspace({"workspace": "fresh"})


def test_render_table_numbers():
    """The rendered table holds, for each kernel row, GB/s, % of copy bandwidth and the
    speedups vs the compiled and eager compositions of the same cache as computed here from
    the raw medians, and 'target met' is yes only when both targets hold."""
    doc = _synthetic_report()
    md = render_bench.markdown(doc)
    rows = [line for line in md.splitlines() if line.startswith("| triton")]
    assert len(rows) == 2
    mb, bps = 669_254_656, 4.3e12
    gbps = mb / 190e-6
    bf16 = [c.strip() for c in rows[0].strip("|").split("|")]
    assert bf16 == ["triton", "bf16", "graph", "190.0", f"{gbps / 1e9:.0f}",
                    f"{100 * gbps / bps:.1f}%", f"{1040 / 190:.2f}x", f"{3870 / 190:.2f}x",
                    "yes"]
    e4m3 = [c.strip() for c in rows[1].strip("|").split("|")]
    # 1000 / 250 = 4x < 5x, and the eager baseline failed: no ratio, target missed.
    assert e4m3[6:] == [f"{1000 / 250:.2f}x", "-", "no"]
    assert "error: boom" in md


def test_render_cli_writes_markdown(tmp_path):
    """render_bench's CLI reads a bench/1 JSON and writes the table beside it."""
    src = tmp_path / "bench.json"
    src.write_text(json.dumps(_synthetic_report()))
    assert render_bench.main([str(src)]) == 0
    assert "| triton | bf16 |" in (tmp_path / "bench.md").read_text()


def test_render_keeps_the_index_decode_knob_sweep(tmp_path):
    """An index-decode report is rendered by bench_indexer's own table: its knob sweep
    (the rows a GPU run measured besides the defaults) is in the Markdown, fastest first,
    with each row's share of the copy bandwidth."""
    doc = _synthetic_report()
    for r in doc["results"]:
        r["op"] = "indexer_decode"
    doc["sweep"] = [{"cache": "e4m3", "knobs": {"grid": "flat"}, "median_us": 80.0,
                     "copy_fraction": 0.8},
                    {"cache": "e4m3", "knobs": {"grid": "proportional"}, "median_us": 75.0,
                     "copy_fraction": 0.85}]
    src = tmp_path / "bench.json"
    src.write_text(json.dumps(doc))
    assert render_bench.main([str(src)]) == 0
    md = (tmp_path / "bench.md").read_text()
    sweep = md[md.index("Knob sweep"):].splitlines()
    rows = [ln for ln in sweep if ln.startswith("| e4m3")]
    assert rows == ["| e4m3 | {'grid': 'proportional'} | 75.0 | 85.0% |",
                    "| e4m3 | {'grid': 'flat'} | 80.0 | 80.0% |"]


def test_render_states_the_timing_method():
    """The report's timing method (how many calls a replay holds) is in the Markdown."""
    doc = {**_synthetic_report(), "timing": {"method": "replays of at least 1000 us"}}
    assert "Timing: replays of at least 1000 us." in render_bench.markdown(doc)


def test_render_rejects_other_schemas():
    """A report of another schema is refused rather than misread."""
    with pytest.raises(ValueError, match="schema"):
        render_bench.markdown({**_synthetic_report(), "schema": "bench/0"})


RESULT_FIELDS = {"name", "op", "cache", "kv_fmt", "index_fmt", "min_bytes", "median_us",
                 "mode", "calls_per_replay", "note", "bytes_per_s", "copy_fraction", "ratios",
                 "target_met"}


@pytest.mark.gpu
def test_bench_insert_small_run(tmp_path):
    """bench_insert at 256 tokens (triton and both compositions) writes a bench/1 report
    with every top-level and per-result field, every implementation timed (none failed),
    the kernel rows carrying their ratios and targets, and the Markdown beside it."""
    out = tmp_path / "bench.json"
    assert bench_insert.main(["--tokens", "256", "--out", str(out), "--copy-mib", "256",
                              "--warmup-ms", "5", "--rep-ms", "30", "--impls", "triton",
                              "torch_compiled", "torch_eager"]) == 0
    doc = json.loads(out.read_text())
    assert {"schema", "device", "torch", "triton", "cuda", "l2_bytes", "tokens", "shape",
            "copy", "timing", "source", "results", "agreement"} <= set(doc)
    assert doc["schema"] == "bench/1" and doc["copy"]["bytes_per_s"] > 0
    names = {(r["name"], r["cache"]) for r in doc["results"]}
    for cache in bench_insert.CACHES:
        assert {(n, cache) for n in ("triton", "torch_compiled", "torch_eager")} <= names
    for r in doc["results"]:
        assert RESULT_FIELDS <= set(r), r["name"]
        assert r["median_us"] and r["median_us"] > 0, (r["name"], r["note"])
        if r["name"] in bench_insert.FUSED_KERNELS:
            assert set(r["ratios"]) == set(bench_insert.BASELINES)
            assert r["target_met"] in (True, False)
            assert r["targets"] == bench_insert.TARGETS[r["name"]]
    assert (tmp_path / "bench.md").exists()


def test_a_failed_rows_note_keeps_the_errors_start_and_end():
    """A long error (a build failure: nvcc's command line first, the cause last) keeps its
    first and last characters in the row's note; a short one is kept whole."""
    long = RuntimeError("nvcc failed: $ nvcc " + "x.o " * 500 + "multiple definition of f")
    note = harness.error_text(long)
    assert note.startswith("RuntimeError: nvcc failed") and note.endswith("definition of f")
    assert len(note) < 900
    assert harness.error_text(ValueError("bad")) == "ValueError: bad"


def test_each_fused_kernel_is_judged_by_its_own_issue_target():
    """The insert benchmark's kernel rows carry their own copy-bandwidth target (the
    Triton kernel's 80%, the CUDA kernel's 85%): at 83% of the copy
    bandwidth and 6x torch.compile the Triton row meets its targets and the CUDA row does
    not."""
    assert set(bench_insert.FUSED_KERNELS) == {"triton", "cuda"}
    ratios = {"torch_compiled": 6.0}
    assert render_bench._target_met(bench_insert.TARGETS["triton"], 0.83, ratios) is True
    assert render_bench._target_met(bench_insert.TARGETS["cuda"], 0.83, ratios) is False
    assert render_bench._target_met(bench_insert.TARGETS["cuda"], 0.86, ratios) is True


def _run_main(tmp_path, monkeypatch, stop_after: int | None):
    """harness.main on a fake benchmark measuring the synthetic report's results one by
    one, sending itself SIGTERM (what ``timeout`` sends) after ``stop_after`` of them."""
    import argparse
    import os
    import signal

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    full = _synthetic_report()
    out = tmp_path / "bench.json"

    def build(args):
        doc = harness.track({**full, "results": []})
        for i, r in enumerate(full["results"]):
            if i == stop_after:
                os.kill(os.getpid(), signal.SIGTERM)
            doc["results"].append(r)
        return doc

    code = harness.main("fake", [], lambda argv: argparse.Namespace(out=out), build,
                        render_bench.markdown)
    return code, json.loads(out.read_text()), out.with_suffix(".md").read_text()


def test_a_benchmark_stopped_by_sigterm_writes_what_it_measured(tmp_path, monkeypatch):
    """SIGTERM while measuring (a time limit): the JSON still comes out, holding exactly the
    results finished before it, marked partial (and said so above the table); exit 124."""
    code, doc, md = _run_main(tmp_path, monkeypatch, stop_after=2)
    assert code == 124
    assert doc["results"] == _synthetic_report()["results"][:2]
    assert doc["partial"] == harness.PARTIAL_NOTE and "Partial report" in md
    code, doc, md = _run_main(tmp_path, monkeypatch, stop_after=None)
    assert code == 0 and "partial" not in doc and "Partial report" not in md
    assert doc["results"] == _synthetic_report()["results"]


# ------------------------------------------------------------- gathered-read bandwidth


@pytest.mark.interp
def test_gather_xor_reads_exactly_the_indexed_chunks():
    """The L2 probe's kernel (benchmarks/l2_bandwidth.py) XORs, per visit, exactly the
    chunk its index names, all of it, so every byte it is credited with is
    loaded: checked against NumPy on distinct random words, chunks of two load blocks."""
    from benchmarks import l2_bandwidth as l2b

    dev = "cuda" if torch.cuda.is_available() else "cpu"
    words, chunks, visits = 64, 5, 9
    src = rand.raw_u32(rand.generator(1), (chunks * words,)).view(np.int32)
    idx = l2b.chunk_indices(7, visits, chunks)
    assert set(idx.tolist()) <= set(range(chunks)) and len(set(idx.tolist())) > 1
    got = l2b.gather_xor(torch.from_numpy(src).to(dev), torch.from_numpy(idx).to(dev),
                         words, block_words=32)
    want = np.bitwise_xor.reduce(src.reshape(chunks, words)[idx], axis=1)
    np.testing.assert_array_equal(got.cpu().numpy(), want)


def test_gather_xor_rejects_a_chunk_not_a_multiple_of_the_load_block():
    """A chunk the load block does not divide is refused, naming chunk_words."""
    from benchmarks import l2_bandwidth as l2b

    with pytest.raises(ValueError, match="chunk_words"):
        l2b.gather_xor(torch.zeros(64, dtype=torch.int32), torch.zeros(1, dtype=torch.int32),
                       48, block_words=32)


@pytest.mark.gpu
def test_l2_bandwidth_report(tmp_path):
    """A small run of the probe writes its JSON and Markdown with a positive bandwidth per
    (working set, chunk), and L2-resident reads no slower than HBM-sized ones."""
    from benchmarks import l2_bandwidth as l2b

    out = tmp_path / "l2.json"
    assert l2b.main(["--working-sets", "8", "1024", "--chunks", "32", "--rep-ms", "20",
                     "--copy-mib", "64", "--out", str(out)]) == 0
    doc = json.loads(out.read_text())
    rates = {r["working_set_mib"]: r["tb_per_s"] for r in doc["results"]}
    assert set(rates) == {8, 1024} and min(rates.values()) > 0
    assert rates[8] >= rates[1024]
    assert "| 8 | 32 |" in out.with_suffix(".md").read_text()
