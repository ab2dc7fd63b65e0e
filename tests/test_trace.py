"""The timeline diagnostic (kernels/_trace.py): its summary, its argument checks, and on the
GPU a traced index decode and decode attention: every program stamped in order, the
output unchanged."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kernels._trace import TRACE_SLOTS, check_trace, persistence, summary, trace_buffer


def _rows(sm, *stamps):
    """Trace rows ``[programs, TRACE_SLOTS]`` (ns) from per-program lists of SM ids and of
    times in us per slot (None: not stamped), the later slots zero."""
    ns = np.array([[0 if t is None else t * 1e3 + 5e9 for t in slot] for slot in stamps]).T
    rows = np.zeros((len(sm), TRACE_SLOTS), np.int64)
    rows[:, 0] = sm
    rows[:, 1:1 + len(stamps)] = ns.astype(np.int64)
    return rows


def test_summary_reports_quantiles_span_and_sm_busy():
    """Times are read from the earliest start; the span is the last end; an SM whose two
    programs cover [0, 10] of a 20 us span is busy 50%, the other 100%; never-stamped rows
    (zeros) are dropped."""
    rows = _rows([0, 0, 1], [0.0, 2.0, 0.0], [4.0, 8.0, 15.0], [5.0, 10.0, 20.0])
    rows = np.vstack([rows, np.zeros((2, TRACE_SLOTS), np.int64)])
    text = summary(rows, ("start", "scan", "end"))
    assert text.startswith("3 programs on 2 SMs; span 20.0 us")
    end = next(line for line in text.splitlines() if line.startswith("| end |"))
    assert end.split("|")[2].strip() == "5.0" and end.split("|")[-2].strip() == "20.0"
    assert "mean 75.0%, min 50.0%" in text
    assert "end by programs per SM: 1: median 20.0 us (1), 2: median 7.5 us (2)" in text
    assert "| start -> scan |" in text and "| scan -> end |" in text


def test_summary_of_some_programs_stamped_slots():
    """A view over slots that only some programs stamp (the index decode's merge stamps,
    slots 4 and 5) counts those programs alone, times from their earliest start, in the
    order the view names the slots."""
    rows = _rows([0, 1, 2], [0.0, 1.0, 2.0], [4.0, 8.0, 9.0], [5.0, 14.0, 10.0],
                 [None, 9.0, None], [None, 12.0, None])
    text = summary(rows, ("start", "scan", "ticket", "written", "end"), (1, 2, 4, 5, 3))
    assert text.startswith("1 programs on 1 SMs; span 13.0 us")
    gaps = {line.split("|")[1].strip(): line.split("|")[2].strip()
            for line in text.splitlines() if "->" in line}
    assert gaps == {"start -> scan": "7.0", "scan -> ticket": "1.0",
                    "ticket -> written": "3.0", "written -> end": "2.0"}
    with pytest.raises(ValueError, match="slots"):
        summary(rows, ("start", "end"), (1, 2, 3))


def _calls(seed, sm_slow, program_slow, noise, calls=3, programs=512, sms=132):
    """Traced calls of equal-work programs placed on SMs afresh each call: each end is 60
    us plus a fixed per-SM delay (sm_slow x a draw per SM), a fixed per-program delay
    (program_slow x a draw per program) and fresh noise."""
    rng = np.random.default_rng(seed)
    sm_delay, prog_delay = rng.random(sms), rng.random(programs)
    out = []
    for _ in range(calls):
        sm = rng.integers(0, sms, programs)
        end = 60 + sm_slow * sm_delay[sm] + program_slow * prog_delay + noise * rng.random(
            programs)
        out.append(_rows(sm, np.zeros(programs), end - 1, end))
    return out


@pytest.mark.parametrize("sm_slow, program_slow, want_sm, want_program", [
    (8.0, 0.0, "high", "low"), (0.0, 8.0, "low", "high"), (0.0, 0.0, "low", "low")])
def test_persistence_tells_slow_sms_from_slow_work_from_noise(sm_slow, program_slow,
                                                              want_sm, want_program):
    """Slow SMs (a delay per SM, programs placed at random each call) correlate by SM and
    not by program; slow work (a delay per program) the other way round; noise alone
    neither (rho above 0.6 counts high, below 0.3 low; 512 programs on 132 SMs)."""
    text = persistence(_calls(7, sm_slow, program_slow, 1.0))
    prog = float(text.split("by program ")[1].split(",")[0])
    sm = float(text.split("by SM ")[1])
    for rho, want in ((sm, want_sm), (prog, want_program)):
        assert (rho > 0.6) if want == "high" else (abs(rho) < 0.3), text


def test_persistence_needs_two_calls():
    """One call has nothing to correlate with: said so, no exception."""
    assert "needs 2" in persistence(_calls(1, 1.0, 0.0, 1.0, calls=1))


def test_profile_launch_ragged_is_for_the_indexer_only(capsys):
    """``--ragged`` (the index decode's ragged contexts) with another benchmark is a usage
    error naming the flag, before anything runs on a GPU."""
    from benchmarks.profile_launch import main

    with pytest.raises(SystemExit) as e:
        main(["--bench", "attention_decode", "--ragged", "--timeline", "1"])
    assert e.value.code == 2 and "--ragged" in capsys.readouterr().err


def test_profile_launch_hot_pages_is_for_the_decode_attention_only(capsys):
    """``--hot-pages`` (the decode attention's L2-resident blocks) with another benchmark is
    a usage error naming the flag, before anything runs on a GPU."""
    from benchmarks.profile_launch import main

    with pytest.raises(SystemExit) as e:
        main(["--bench", "indexer", "--hot-pages", "64", "--timeline", "1"])
    assert e.value.code == 2 and "--hot-pages" in capsys.readouterr().err


def test_profile_launch_dist_is_for_the_prefill_only(capsys):
    """``--dist`` (the prefill's selection distribution) with another benchmark is a usage
    error naming the flag, before anything runs on a GPU."""
    from benchmarks.profile_launch import main

    with pytest.raises(SystemExit) as e:
        main(["--bench", "attention_decode", "--dist", "locality", "--kernel-times", "1"])
    assert e.value.code == 2 and "--dist" in capsys.readouterr().err


def test_summary_of_nothing_stamped():
    """A buffer no program wrote says so instead of dividing by zero."""
    assert summary(np.zeros((4, TRACE_SLOTS), np.int64), ("a", "b", "c")) == \
        "no program was stamped"


def test_check_trace_refuses_the_interpreter_and_bad_buffers():
    """``trace=`` is refused where there is no timer (interpreter, CPU tensors) and when the
    buffer is too small, of another dtype or shape; the error names the argument."""
    cpu = torch.device("cpu")
    with pytest.raises(ValueError, match="trace"):
        check_trace(trace_buffer(4, cpu), 4, True, cpu)
    with pytest.raises(ValueError, match="trace"):
        check_trace(trace_buffer(4, cpu), 4, False, cpu)
    check_trace(None, 4, True, cpu)  # no trace: nothing to check
    if torch.cuda.is_available():
        dev = torch.device("cuda")
        for bad in (trace_buffer(3, dev), trace_buffer(4, dev).int(),
                    torch.zeros((4, TRACE_SLOTS + 1), dtype=torch.int64, device=dev)):
            with pytest.raises(ValueError, match="trace"):
                check_trace(bad, 4, False, dev)
        check_trace(trace_buffer(5, dev), 4, False, dev)


@pytest.mark.gpu
@pytest.mark.parametrize("cache", ["bf16", "e4m3"])
def test_traced_index_decode_stamps_every_program_in_order(cache):
    """At a small benchmark shape every program of the launch writes its row: a valid SM id,
    start <= scan <= end, and one program per request its merge stamps in order; the
    selection is the same as the untraced launch's."""
    from benchmarks import bench_indexer as bix
    from kernels import indexer_decode as idx

    fmt = bix.CACHES[cache]
    t = bix.make_set(8, 4096, fmt, 0)
    out = t.out.transpose(0, 1)
    s = bix.SHAPE

    def launch(**kw):
        out.fill_(-2)
        idx.indexer_decode(t.index_q, t.cache, fmt, t.table, t.seq_lens, t.rows, topk=s.topk,
                           local_blocks=s.local_blocks, initial_blocks=s.initial_blocks,
                           out=out, num_splits=4, **kw)
        return out.clone()

    plain = launch()
    buf = trace_buffer(64, t.cache.device)
    traced = launch(trace=buf)
    assert torch.equal(plain, traced)
    rows = buf.cpu().numpy()
    _stamped_in_order(rows, 8 * 4)
    # One program per request (rows r * 4 + s) merges: scan <= ticket <= written <= end.
    merging = np.nonzero(rows[:32, 4])[0]
    assert np.array_equal(merging // 4, np.arange(8))
    m = rows[merging]
    assert ((m[:, 2] <= m[:, 4]) & (m[:, 4] <= m[:, 5]) & (m[:, 5] <= m[:, 3])).all()


def _stamped_in_order(rows: np.ndarray, programs: int) -> None:
    used, rest = rows[:programs], rows[programs:]
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    assert (used[:, 1] > 0).all() and (rest == 0).all()
    assert ((used[:, 0] >= 0) & (used[:, 0] < sms)).all()
    assert (used[:, 1] <= used[:, 2]).all() and (used[:, 2] <= used[:, 3]).all()


@pytest.mark.gpu
@pytest.mark.parametrize("cache", ["bf16", "e4m3fn"])
def test_traced_decode_attention_stamps_every_program_in_order(cache):
    """Batch 4 at the benchmark's shape, 4 blocks per split (4 splits, 64 programs): every
    program writes its row in order (its plan's stamp, slot 4, between its start and its
    block loop's end); the output is bit-identical to the untraced one."""
    from benchmarks import bench_attention_decode as bad
    from kernels import attention_decode as ad

    fmt = bad.CACHES[cache]
    t = bad.make_set(4, fmt, seed=0, seq_len=4096)

    def launch(**kw):
        t.out.fill_(0)
        ad.sparse_attention_decode(t.q, t.kv, fmt, t.table, t.seq_lens, t.topk.transpose(0, 1),
                                   1, t.scale, t.scale, out=t.out, blocks_per_split=4, **kw)
        return t.out.clone()

    plain = launch()
    buf = trace_buffer(128, t.q.device)
    assert torch.equal(plain, launch(trace=buf))
    rows = buf.cpu().numpy()
    _stamped_in_order(rows, 4 * bad.SHAPE.hkv * 4)
    used = rows[:4 * bad.SHAPE.hkv * 4]
    assert (used[:, 1] <= used[:, 4]).all() and (used[:, 4] <= used[:, 2]).all()


@pytest.mark.gpu
@pytest.mark.parametrize("bench, hot_pages", [("indexer", 0), ("attention_decode", 0),
                                             ("attention_decode", 64)])
def test_profile_launch_timeline_summarises_a_model_shape_launch(bench, hot_pages):
    """profile_launch --timeline's text for two traced model-shape calls (the decode also
    with its blocks folded onto 64 pages, ``--hot-pages``): the whole grid stamped (the
    index decode's one wave, the decode's B x Hkv x splits programs), the quantile table,
    the SM busy line, and the end-time persistence line with two correlations in [-1, 1]
    (real traces: ties, SMs with one program)."""
    from benchmarks.profile_launch import timeline

    cache = "e4m3" if bench == "indexer" else "e4m3fn"
    text = timeline(bench, cache, {}, 2, hot_pages=hot_pages)
    head = text.splitlines()[1]
    assert head.split(" programs on ")[0].isdigit() and int(head.split()[0]) >= 256, text
    assert "| start |" in text and "| end |" in text and "SM busy" in text
    last = text.splitlines()[-1]
    assert last.startswith("end-time persistence over 2 calls"), text
    rhos = [float(last.split("by program ")[1].split(",")[0]), float(last.split("by SM ")[1])]
    assert all(-1 <= r <= 1 for r in rhos), last
