"""GPU timing harness: CUDA-graph replay over rotating input sets, timed with device
events, and the machine's copy bandwidth (the roofline kernels are measured against).

Method (NOTES.md "Timing"; .library METHOD.md):
- A call is given as one zero-argument callable per input set. The sets rotate so that
  one replay touches more than 2 x L2 (``rotation_count``); ``time_calls`` captures ONE
  CUDA graph holding the call once per set and reports the median of
  ``triton.testing.do_bench(graph.replay, return_mode="median")`` divided by the calls per
  replay. do_bench also flushes L2 before each replay. Graph replay removes the host's
  launch gaps, which dominate short calls and wander between runs.
- Every callable is first run eagerly (compilation, autotuning, lazy initialisation stay
  out of capture and out of the numbers). A callable that cannot be captured (a host
  sync, a host-to-device copy, a recompilation) is timed eagerly by do_bench over the same
  rotation: its Timing says ``mode="eager"`` and why.
- ``copy_bandwidth`` times a large device-to-device copy EAGERLY: a copy captured in a
  graph runs on a copy engine at ~2.8 TB/s instead of ~4.3 TB/s through the SMs.
"""

from __future__ import annotations

import math
import subprocess
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import triton
from triton.testing import do_bench

L2_FALLBACK_BYTES = 50 * 2**20  # H100/H200 L2, when the device properties lack it
COPY_BYTES = 2 * 2**30


@dataclass
class Timing:
    median_us: float  # per call
    mode: str  # "graph" or "eager"
    calls_per_replay: int
    note: str = ""  # why a callable was timed eagerly

    def as_dict(self) -> dict:
        return asdict(self)


def l2_bytes() -> int:
    props = torch.cuda.get_device_properties(torch.cuda.current_device())
    return int(getattr(props, "L2_cache_size", 0) or L2_FALLBACK_BYTES)


def rotation_count(bytes_per_call: int, l2: int, factor: float = 2.0) -> int:
    """Input sets needed so that one pass over them touches more than factor x L2."""
    if bytes_per_call <= 0:
        raise ValueError(f"bytes_per_call must be positive, got {bytes_per_call}")
    return max(1, math.floor(factor * l2 / bytes_per_call) + 1)


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
            note = f"graph capture failed: {type(e).__name__}: {e}"[:400]
        else:
            us = _bench_us(g.replay, warmup_ms, rep_ms)
            del g
            return Timing(us / len(calls), "graph", len(calls))
    us = _bench_us(lambda: _run_all(calls), warmup_ms, rep_ms)
    return Timing(us / len(calls), "eager", len(calls), note)


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
