"""One fused-insert launch at the model shape, to be profiled by Nsight Compute (ncu) on
the GPU machine: the launch is made twice (the first compiles / warms), ncu is told to
skip the first (``--launch-skip 1 --launch-count 1``).

    ncu --clock-control none --section SpeedOfLight ... \\
        python -m benchmarks.profile_insert --impl cuda --cache e4m3 --knobs variant=1

``--knobs`` are the launcher's tuning keywords (``k=v,...``, ints).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks import bench_insert as bi  # noqa: E402
from benchmarks import harness  # noqa: E402
from benchmarks.tune_insert import launcher  # noqa: E402


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--impl", choices=("triton", "cuda"), default="triton")
    ap.add_argument("--cache", choices=tuple(bi.CACHES), default="bf16")
    ap.add_argument("--tokens", type=int, default=bi.TOKENS)
    ap.add_argument("--knobs", type=harness.parse_knobs, default={})
    args = ap.parse_args(argv)
    kv_fmt, index_fmt = bi.CACHES[args.cache]
    call = bi.fused_insert(launcher(args.impl, args.knobs), kv_fmt, index_fmt)(
        bi.make_set(args.tokens, kv_fmt, index_fmt, seed=0))
    for _ in range(2):
        call()
        torch.cuda.synchronize()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
