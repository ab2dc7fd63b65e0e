"""GPU timing harness: CUDA-graph replay over rotating input sets, timed with device
events, and the machine's copy bandwidth (the roofline kernels are measured against).

Method:
- A call is given as one zero-argument callable per input set. The sets rotate so that
  one pass over them touches more than 2 x L2, and there are at least two of them
  (``rotation_count``: a set read again finds none of its bytes in L2); ``time_calls``
  captures ONE CUDA graph holding the rotation, repeated until a replay lasts at least
  ``MIN_REPLAY_US`` (``replay_repeats``, from a first timing of the rotation alone), and
  reports the median of ``triton.testing.do_bench(graph.replay, return_mode="median")``
  divided by the calls per replay. do_bench also flushes L2 before each replay. Graph
  replay removes the host's launch gaps, which dominate short calls and wander between
  runs; a replay's own cost (the graph's launch, the write-back of the L2 lines the flush
  left dirty: ~10 us on the H200, below) is shared by the calls of a replay, as by the
  back-to-back kernels of a serving step's graph, and stays under ~1% of it, as in the
  2 GiB copy that gives the roofline. Where the rotation was repeated, the Timing also
  carries ``one_call_us``: a replay of one call alone (the method behind the published
  for-scale numbers).
- Every callable is first run eagerly (compilation, autotuning, lazy initialisation stay
  out of capture and out of the numbers). A callable that cannot be captured (a host
  sync, a host-to-device copy, a recompilation) is timed eagerly by do_bench over the same
  rotation: its Timing says ``mode="eager"`` and why.
- ``copy_bandwidth`` times a large device-to-device copy EAGERLY: a copy captured in a
  graph runs on a copy engine at ~2.8 TB/s instead of ~4.3 TB/s through the SMs.
"""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import triton
from triton.testing import do_bench

from oracle.impls.io import FP8_DTYPES, HALF_DTYPES

L2_FALLBACK_BYTES = 50 * 2**20  # H100/H200 L2, when the device properties lack it
COPY_BYTES = 2 * 2**30
#: A replay holding ONE call also times the graph's launch and the write-back of the L2
#: lines do_bench's flush left dirty (~10 us on the H200). The copy
#: ceiling (2 GiB, ~1 ms, eager) carries ~1% of such costs, so replays last as long.
MIN_REPLAY_US = 1000.0
#: Replays timed at most to size one (the first estimate from a one-rotation replay, then
#: from the repeated replay itself; a ~2 us call needs three).
REPLAY_ESTIMATES = 4
#: Input sets at least: with one set, each call would re-read what the previous call left
#: in L2.
MIN_SETS = 2


@dataclass
class Timing:
    median_us: float  # per call
    mode: str  # "graph" or "eager"
    calls_per_replay: int
    note: str = ""  # why a callable was timed eagerly
    one_call_us: float | None = None  # a replay of one call alone (module docstring)

    def as_dict(self) -> dict:
        return asdict(self)


def error_text(e: Exception, head: int = 150, tail: int = 650) -> str:
    """An exception as one note: its start and its end (a build error's cause, the
    compiler's last lines, comes after its long command line)."""
    text = f"{type(e).__name__}: {e}"
    return text if len(text) <= head + tail else f"{text[:head]} ... {text[-tail:]}"


def l2_bytes() -> int:
    props = torch.cuda.get_device_properties(torch.cuda.current_device())
    return int(getattr(props, "L2_cache_size", 0) or L2_FALLBACK_BYTES)


def rotation_count(bytes_per_call: int, l2: int, factor: float = 2.0) -> int:
    """Input sets needed so that one pass over them touches more than factor x L2, at least
    ``MIN_SETS``."""
    if bytes_per_call <= 0:
        raise ValueError(f"bytes_per_call must be positive, got {bytes_per_call}")
    return max(MIN_SETS, math.floor(factor * l2 / bytes_per_call) + 1)


def replay_repeats(rotation_us: float, min_replay_us: float = MIN_REPLAY_US) -> int:
    """How often a replay holds the whole rotation: the fewest times that make it last at
    least min_replay_us, given one pass over the rotation takes rotation_us."""
    if not rotation_us > 0:
        raise ValueError(f"rotation_us must be positive, got {rotation_us}")
    return max(1, math.ceil(min_replay_us / rotation_us))


def _run_all(calls) -> None:
    for call in calls:
        call()


def capture(calls) -> torch.cuda.CUDAGraph:
    """One graph replaying every call once, in order (raises if any cannot be captured)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # torch's recipe: warm up on a side stream first
        _run_all(calls)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    # A fresh capture stream: a failed capture then leaves nothing routed to a stream that
    # a later capture (the next implementation) would use again.
    with torch.cuda.graph(graph, stream=torch.cuda.Stream()):
        _run_all(calls)
    graph.replay()
    torch.cuda.synchronize()  # a replay that faults fails here, not inside do_bench
    return graph


def _bench_us(fn, warmup_ms: float, rep_ms: float) -> float:
    return 1e3 * do_bench(fn, warmup=warmup_ms, rep=rep_ms, return_mode="median")


def time_calls(calls, warmup_ms: float = 25, rep_ms: float = 200,
               graph: bool = True) -> Timing:
    """Median device time of one call (see the module docstring). Errors of the calls
    themselves propagate; only a failed capture falls back to eager timing."""
    calls = list(calls)
    _run_all(calls)
    torch.cuda.synchronize()
    note = "graph capture not asked for"
    if graph:
        stream = torch.cuda.current_stream()
        try:
            g = capture(calls)
        except Exception as e:  # noqa: BLE001 - any capture failure means: time eagerly
            # A failure inside capture_end skips torch.cuda.graph's stream restore.
            torch.cuda.set_stream(stream)
            torch.cuda.synchronize()
            note = f"graph capture failed: {error_text(e)}"
        else:
            us = _bench_us(g.replay, warmup_ms, rep_ms)
            reps = replay_repeats(us)
            one = None
            if reps > 1:
                del g
                one = _bench_us(capture(calls[:1]).replay, warmup_ms, rep_ms)
                # The one-rotation replay overstates a rotation by the graph launch (several
                # us, most of a tiny call's replay), and tiny calls run faster the longer
                # the replay: estimates from the repeated replay's own time, until it lasts
                # MIN_REPLAY_US (within 10%; at most REPLAY_ESTIMATES of them).
                for attempt in range(REPLAY_ESTIMATES):
                    g = capture(calls * reps)
                    us = _bench_us(g.replay, warmup_ms, rep_ms)
                    if attempt == REPLAY_ESTIMATES - 1 or us >= 0.9 * MIN_REPLAY_US:
                        break
                    del g
                    reps = replay_repeats(us / reps)
            del g
            return Timing(us / (len(calls) * reps), "graph", len(calls) * reps,
                          one_call_us=one)
    us = _bench_us(lambda: _run_all(calls), warmup_ms, rep_ms)
    return Timing(us / len(calls), "eager", len(calls), note)


def phase_rows(kernels, n_calls: int) -> list[dict]:
    """Per step of a call's launch sequence, from ``kernels``: (name, device us) of every
    kernel in launch order over ``n_calls`` calls that launch the same sequence (a
    launcher whose launches do not depend on device data): ``{"step", "kernel", "us"}``,
    the median over the calls. ValueError where the kernels do not split into such
    calls."""
    kernels = list(kernels)
    if n_calls < 1 or not kernels or len(kernels) % n_calls:
        raise ValueError(f"{len(kernels)} kernels do not split into {n_calls} calls")
    per = len(kernels) // n_calls
    rows = []
    for i in range(per):
        seq = kernels[i::per]
        names = sorted({name for name, _ in seq})
        if len(names) != 1:
            raise ValueError(f"the calls launch different kernels at step {i}: {names}")
        us = sorted(t for _, t in seq)
        rows.append({"step": i, "kernel": names[0], "us": us[len(us) // 2]})
    return rows


def kernel_phases(calls, repeats: int = 2) -> list[dict]:
    """``phase_rows`` of eager passes over ``calls`` under torch.profiler (after one
    untimed pass): where a call's device time goes, kernel by kernel. Not the timing
    method (graph replay): the steps' sum leaves out the gaps between launches."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    calls = list(calls)
    _run_all(calls)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(repeats):
            _run_all(calls)
        torch.cuda.synchronize()
    events = sorted((e for e in prof.events() if e.device_type == DeviceType.CUDA),
                    key=lambda e: e.time_range.start)
    return phase_rows(((e.name, e.time_range.elapsed_us()) for e in events),
                      repeats * len(calls))


def copy_bandwidth(nbytes: int = COPY_BYTES, warmup_ms: float = 25,
                   rep_ms: float = 200) -> dict:
    """Eager device-to-device copy of nbytes: bytes read + bytes written per second."""
    src = torch.randn(nbytes // 4, device="cuda")  # random data: zeros can run faster
    dst = torch.empty_like(src)
    us = _bench_us(lambda: dst.copy_(src), warmup_ms, rep_ms)
    moved = 2 * src.numel() * src.element_size()
    return {"bytes": moved // 2, "moved_bytes": moved, "median_us": us,
            "bytes_per_s": moved / (us * 1e-6), "mode": "eager"}


def device_info() -> dict:
    props = torch.cuda.get_device_properties(torch.cuda.current_device())
    return {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
            "triton": triton.__version__, "cuda": torch.version.cuda,
            "capability": f"{props.major}.{props.minor}",
            "sms": props.multi_processor_count, "l2_bytes": l2_bytes()}


def source_state(paths=("kernels", "benchmarks")) -> dict:
    """The commit measured and the files under paths that differ from it ('' if no git)."""
    root = Path(__file__).resolve().parents[1]

    def git(*cmd):
        try:
            return subprocess.run(["git", *cmd], cwd=root, capture_output=True, text=True,
                                  timeout=10).stdout.strip()
        except (OSError, subprocess.SubprocessError):
            return ""

    return {"commit": git("rev-parse", "HEAD"),
            "modified": git("status", "--porcelain", "--", *paths).splitlines()}


# ------------------------------------------------------------------- shared by benches
# Helpers of the paged-attention benchmarks (bench_indexer.py, bench_attention_decode.py):
# their inputs, their result records and their report files.

FILL_CHUNK_BYTES = 2**28


def element_bytes(fmt: str) -> int:
    """Bytes per cache element: 1 for an fp8 format (uint8 codes), 2 for bf16/fp16."""
    return 1 if fmt in FP8_DTYPES else 2


def shuffled_block_table(batch: int, blocks: int, g: torch.Generator, dev,
                         pool_factor: int = 2) -> tuple[torch.Tensor, int]:
    """(int32 block table ``[batch, blocks]``, pool pages): every request's pages are
    distinct pages drawn at random from a pool ``pool_factor`` times the pages used, as
    bench_insert.make_set places its slots (no request reads contiguous memory)."""
    used = batch * blocks
    pool = max(1, pool_factor * used)
    pages = torch.randperm(pool, generator=g, device=dev)[:used]
    return pages.view(batch, blocks).to(torch.int32), pool


def random_cache(shape, fmt: str, g: torch.Generator, dev) -> torch.Tensor:
    """N(0, 1) values stored in a cache format: bf16/fp16 values, or uint8 codes of an fp8
    format (torch's cast; never NaN, never zero as a whole). Filled in chunks along dim 0
    so that the fp32 temporaries stay small for caches of tens of GiB."""
    fp8 = FP8_DTYPES.get(fmt)
    out = torch.empty(shape, dtype=torch.uint8 if fp8 else HALF_DTYPES[fmt], device=dev)
    row = max(1, out[0].numel() * 4) if out.numel() else 1
    step = max(1, FILL_CHUNK_BYTES // row)
    for i in range(0, out.shape[0], step):
        x = torch.randn(out[i:i + step].shape, generator=g, device=dev)
        out[i:i + step] = x.to(fp8).view(torch.uint8) if fp8 else x
    return out


def record(name: str, op: str, cache: str, min_bytes: int, timing: Timing | None = None,
           error: str | None = None, **extra) -> dict:
    """One bench/1 result: the raw measurement (or the error, on one line so that it fits
    a Markdown table cell) and ``extra`` fields."""
    note = " ".join((error or "").split())
    r = {"name": name, "op": op, "cache": cache, "min_bytes": int(min_bytes),
         "median_us": None, "mode": "error", "calls_per_replay": None, "note": note}
    if timing is not None:
        r.update(timing.as_dict())
    r.update(extra)
    return r


def timed_record(name: str, op: str, cache: str, min_bytes: int, calls, args,
                 **extra) -> dict:
    """``record`` of ``time_calls(calls)`` with args' warmup_ms / rep_ms / eager; a failure
    of the calls is recorded as the result's error (the other results are still worth
    having)."""
    try:
        t = time_calls(calls, args.warmup_ms, args.rep_ms, graph=not args.eager)
    except Exception as e:  # noqa: BLE001 - record the failure, bench the rest
        return record(name, op, cache, min_bytes, error=error_text(e),
                      **extra)
    return record(name, op, cache, min_bytes, t, **extra)


def report_path(name: str) -> str:
    """$OUT/<name>.json on the device machine (OUT is what comes back), else
    reports/<name>.json."""
    if os.environ.get("OUT"):
        return str(Path(os.environ["OUT"]) / f"{name}.json")
    return str(Path(__file__).resolve().parents[1] / "reports" / f"{name}.json")


def add_timing_args(ap, name: str) -> None:
    """The flags every benchmark shares: output path and timing settings."""
    ap.add_argument("--out", default=report_path(name), help="JSON path (Markdown beside it)")
    ap.add_argument("--warmup-ms", type=float, default=25)
    ap.add_argument("--rep-ms", type=float, default=300)
    ap.add_argument("--copy-mib", type=int, default=COPY_BYTES // 2**20,
                    help="size of the copy that measures the bandwidth ceiling")
    ap.add_argument("--eager", action="store_true", help="time eagerly (no CUDA graphs)")


def timing_info(args) -> dict:
    """The timing method of a report (module docstring) and its settings."""
    return {"method": "median of triton.testing.do_bench over CUDA-graph replays of the "
                      f"rotating input sets (at least {MIN_SETS}) repeated until a replay "
                      f"lasts at least {MIN_REPLAY_US:g} us, divided by its calls (L2 "
                      "flushed per replay); one_call_us: a replay of one call alone",
            "min_replay_us": MIN_REPLAY_US, "warmup_ms": args.warmup_ms,
            "rep_ms": args.rep_ms}


def report_base(schema: str, what: str, args) -> dict:
    """A report's measured context: device, timing method, source state, copy bandwidth
    (measured in this run, eagerly: the roofline the results are compared against); the
    report ``track``ed, so a stopped run still writes what it measured."""
    return track({"schema": schema, "what": what, **device_info(),
                  "timing": timing_info(args),
                  "source": source_state(),
                  "copy": copy_bandwidth(args.copy_mib * 2**20, args.warmup_ms,
                                         args.rep_ms)})


class Stopped(BaseException):
    """SIGTERM arrived while a benchmark measured (``timeout`` ran out, or the device
    tool's call limit). A BaseException, so no ``except Exception`` in between keeps it."""


#: The report being measured (``track``): what ``main`` writes when the run is stopped.
_TRACKED: list[dict] = []

#: The ``partial`` field of a stopped run's report (render_bench states it above the table).
PARTIAL_NOTE = ("stopped by SIGTERM before the end (a time limit): the results measured "
                "until then, and no checks")


def track(doc: dict) -> dict:
    """Make ``doc`` the report a stopped run writes (its results so far); returns it."""
    _TRACKED[:] = [doc]
    return doc


def _stop(signum, frame):
    raise Stopped()


def write_report(doc: dict, out, md: str) -> None:
    """The JSON at ``out`` and the Markdown ``md`` beside it (.md)."""
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(doc, indent=1) + "\n")
    out.with_suffix(".md").write_text(md)
    print(f"wrote {out} and {out.with_suffix('.md')}\n")


def median_of(results, **match):
    """The median (us) of the first result whose fields equal ``match``, or None."""
    r = next((r for r in results if all(r.get(k) == v for k, v in match.items())), None)
    return None if r is None else r.get("median_us")


def check(name: str, value, limit: float, ok, **where) -> dict:
    """A benchmark check: ``passed`` None when the value is missing (never a pass)."""
    return {"check": name, **where, "value": value, "limit": limit,
            "passed": None if value is None else bool(ok(value))}


def main(name: str, argv, parse_args, build_report, markdown) -> int:
    """A benchmark's command line: parse, build the report on the GPU (exit 2 without
    one), write the JSON and its Markdown (``markdown(doc)``) and print the Markdown.
    Stopped by SIGTERM (a ``timeout``) while measuring: the tracked report as it stands,
    marked ``partial``, and exit 124 (what ``timeout`` itself returns), so a run cut by a
    time limit still brings back every result it finished."""
    import sys

    args = parse_args(argv)
    if not torch.cuda.is_available():
        print(f"{name} needs a CUDA device", file=sys.stderr)
        return 2
    _TRACKED.clear()
    previous = signal.signal(signal.SIGTERM, _stop)
    try:
        doc, code = build_report(args), 0
    except Stopped:
        if not _TRACKED:
            return 124
        doc, code = _TRACKED[0], 124
        doc["partial"] = PARTIAL_NOTE
    finally:
        signal.signal(signal.SIGTERM, previous)
    md = markdown(doc)
    write_report(doc, args.out, md)
    print(md)
    return code


def split_workspace(knobs: dict | None) -> tuple[dict, object]:
    """A decode benchmark's launcher knobs without ``workspace``, and the workspace its calls
    share: a ``kernels._host.Workspace`` kept across the calls (default: how a server runs
    the decode kernels, no allocation and no counter fill per call), or None for
    ``workspace=none`` (fresh buffers per call: the launcher's own default)."""
    from kernels._host import Workspace

    knobs = dict(knobs or {})
    mode = knobs.pop("workspace", "reuse")
    if mode not in ("reuse", "none"):
        raise ValueError(f"workspace knob must be 'reuse' or 'none', got {mode!r}")
    return knobs, (Workspace() if mode == "reuse" else None)


def parse_knobs(text: str) -> dict:
    """A launcher's tuning keywords from the command line: ``"num_warps=8,scan=dot,
    pairs=false"`` -> ``{"num_warps": 8, "scan": "dot", "pairs": False}`` (integers, true /
    false, else strings)."""
    def value(v: str):
        if v.lower() in ("true", "false"):
            return v.lower() == "true"
        try:
            return int(v)
        except ValueError:
            return v

    return {k: value(v) for k, v in (kv.split("=", 1) for kv in text.split(",") if kv)}
