"""One kernel call of a benchmark at its model shape, to be profiled by Nsight Compute (ncu)
on the GPU machine: the call is made twice (the first compiles / warms); ncu is told to
skip the first launches of the kernel it profiles (``--launch-skip 1 --launch-count 1``).

    ncu --clock-control none --section SpeedOfLight ... \\
        python -m benchmarks.profile_launch --bench attention_decode --cache e4m3fn \\
        --knobs num_warps=8

``--bench``: insert (``--impl`` triton or cuda), indexer (the decode indexer), or
attention_decode / attention_prefill (Triton; prefill on ``--dist`` selections, random by
default). ``--cache``:
the benchmark's cache names (bench_*.CACHES). ``--knobs``: the launcher's tuning keywords
(``k=v,...``). The inputs are the benchmark's own (its ``make_set`` with seed 0).

``--kernel-times N``: no ncu; the call's wall time (mean of N synchronized calls) and, from
torch.profiler over N more, each GPU kernel's time per call, longest first: where a
multi-kernel launcher (a host plan, passes, a merge) spends its time.

``--timeline N`` (indexer, attention_decode; with ``--hot-pages N`` the decode attention's
blocks come from L2, as in its benchmark): no ncu; N traced calls (``kernels._trace``:
each program's SM and its start, scan-end and end times), after one traced warm-up call,
summarised per call: when programs start and finish, how long their scans take, how much
of the launch the SMs hold a program.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks import harness  # noqa: E402

BENCHES = ("insert", "indexer", "attention_decode", "attention_prefill")


def call(bench: str, cache: str, impl: str, knobs: dict, ragged: bool = False,
         hot_pages: int = 0, dist: str = "random"):
    """The benchmark's zero-argument kernel call on its first input set (``ragged``: the
    index decode's ragged contexts, ``bench_indexer --ragged``; ``hot_pages``: the decode
    attention's block tables folded onto that many pages, ``bench_attention_decode
    --hot-pages``; ``dist``: the prefill's selection distribution)."""
    if bench == "insert":
        from benchmarks import bench_insert as bi
        from benchmarks.tune_insert import launcher

        kv_fmt, index_fmt = bi.CACHES[cache]
        return bi.fused_insert(launcher(impl, knobs), kv_fmt, index_fmt)(
            bi.make_set(bi.TOKENS, kv_fmt, index_fmt, seed=0))
    if bench == "indexer":
        from benchmarks import bench_indexer as bix

        fmt = bix.CACHES[cache]
        return bix.triton_indexer(fmt, knobs=knobs)(
            bix.make_set(bix.BATCH, bix.SEQ_LEN, fmt, 0, ragged=ragged))
    if bench == "attention_decode":
        from benchmarks import bench_attention_decode as bad

        fmt = bad.CACHES[cache]
        return bad.triton_decode(fmt, knobs)(bad.make_set(bad.TARGET_BATCH, fmt, seed=0,
                                                          hot_pages=hot_pages))
    from benchmarks import bench_attention_prefill as bap

    fmt = bap.CACHES[cache]
    return bap.triton_prefill(fmt, knobs)(bap.make_set(fmt, dist, seed=0))


def kernel_times(fn, reps: int) -> str:
    """The call's wall time and its GPU kernels' times per call (module docstring)."""
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(reps):
        fn()
    torch.cuda.synchronize()
    wall = (time.perf_counter() - t0) / reps * 1e6
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            fn()
        torch.cuda.synchronize()
    rows = sorted(((e.self_device_time_total / reps, e.count / reps, e.key)
                   for e in prof.key_averages() if e.self_device_time_total > 0), reverse=True)
    lines = [f"wall {wall:.1f} us per call; GPU kernels {sum(r[0] for r in rows):.1f} us",
             "| us per call | launches | kernel |", "|---:|---:|---|"]
    lines += [f"| {us:.1f} | {n:g} | {key[:90]} |" for us, n, key in rows[:25]]
    return "\n".join(lines)


TIMELINE_BENCHES = {"indexer": ("start", "scan", "end"),
                    "attention_decode": ("start", "blocks", "end")}
#: Further views of a bench's trace rows: (title, stamp names, their slots).
TIMELINE_VIEWS = {"indexer": [("the set-up (ready: the program knows its key blocks)",
                              ("start", "ready", "scan", "end"), (1, 6, 2, 3)),
                             ("the merging programs", ("start", "scan", "ticket", "written",
                                                       "end"), (1, 2, 4, 5, 3))],
                  "attention_decode": [("the plan (planned: the union's blocks and pages "
                                        "known, q scaled; the block loop's loads wait on it)",
                                        ("start", "planned", "blocks", "end"), (1, 4, 2, 3))]}


def timeline(bench: str, cache: str, knobs: dict, calls: int, ragged: bool = False,
             hot_pages: int = 0) -> str:
    """The summaries of ``calls`` traced launches (module docstring)."""
    from kernels._trace import persistence, summary, trace_buffer

    if bench not in TIMELINE_BENCHES:
        raise SystemExit(f"--timeline supports {sorted(TIMELINE_BENCHES)}, not {bench}")
    buf = trace_buffer(1 << 16, torch.device("cuda"))
    traced = call(bench, cache, "triton", {**knobs, "trace": buf}, ragged, hot_pages)
    traced()  # compiles; one set of inputs, as every other mode here
    out, runs = [], []
    for i in range(calls):
        buf.zero_()
        traced()
        torch.cuda.synchronize()
        rows = buf.cpu().numpy()
        runs.append(rows)
        out.append(f"### call {i + 1}\n" + summary(rows, TIMELINE_BENCHES[bench]))
        for title, names, slots in TIMELINE_VIEWS.get(bench, ()):
            out.append(f"#### call {i + 1}, {title}\n" + summary(rows, names, slots))
    out.append(persistence(runs))
    return "\n\n".join(out)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--bench", choices=BENCHES, default="insert")
    ap.add_argument("--impl", choices=("triton", "cuda"), default="triton",
                    help="insert only: the Triton or the CUDA kernel")
    ap.add_argument("--cache", default="bf16")
    ap.add_argument("--knobs", type=harness.parse_knobs, default={})
    ap.add_argument("--kernel-times", type=int, default=0, metavar="N",
                    help="print the wall and per-kernel GPU times over N calls (no ncu)")
    ap.add_argument("--timeline", type=int, default=0, metavar="N",
                    help="print N traced calls' per-program timelines (no ncu; indexer, "
                         "attention_decode)")
    ap.add_argument("--ragged", action="store_true",
                    help="indexer only: ragged contexts (bench_indexer --ragged)")
    ap.add_argument("--hot-pages", type=int, default=0, metavar="N",
                    help="attention_decode only: block tables folded onto N pages, the "
                         "blocks read from L2 (bench_attention_decode --hot-pages)")
    ap.add_argument("--dist", default=None, choices=("locality", "random"),
                    help="attention_prefill only: the selection distribution (default random)")
    args = ap.parse_args(argv)
    if args.dist and args.bench != "attention_prefill":
        ap.error("--dist applies to --bench attention_prefill only")
    if args.ragged and args.bench != "indexer":
        ap.error("--ragged applies to --bench indexer only")
    if args.hot_pages and args.bench != "attention_decode":
        ap.error("--hot-pages applies to --bench attention_decode only")
    if args.timeline:
        print(timeline(args.bench, args.cache, args.knobs, args.timeline, args.ragged,
                       args.hot_pages))
        return 0
    fn = call(args.bench, args.cache, args.impl, args.knobs, args.ragged, args.hot_pages,
              args.dist or "random")
    if args.kernel_times:
        print(kernel_times(fn, args.kernel_times))
        return 0
    for _ in range(2):
        fn()
        torch.cuda.synchronize()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
