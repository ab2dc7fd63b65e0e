"""Tuning sweep of the fused insert's launch parameters at the model shape (16,384 tokens):
Triton configurations (``--triton block_h:num_warps:num_stages:programs_per_sm,...``); CUDA
variant x warps per block x heads per warp x program order (variant 0: the first kernel, 32
heads per block), and variant 3 (persistent, cp.async pipeline) as warps per block x heads
per warp x stages (``--stream warps:heads_per_warp:stages,...``), and variant 4 (persistent
warps) as warps per block x heads per warp (``--persist w:h,...``), timed like
bench_insert (graph replay over rotating input sets). Prints a table and writes
``$OUT/tune.json`` (or reports/tune.json): the defaults in the launchers come from here.

Run on the GPU machine: ``python -m benchmarks.tune_insert [--caches bf16,e4m3]``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks import bench_insert as bi  # noqa: E402
from benchmarks import harness  # noqa: E402

TRITON_KNOBS = ("block_h", "num_warps", "num_stages", "programs_per_sm", "max_registers")


def triton_configs(text: str) -> list[dict]:
    """``"16:4:3:4:0,8:2:4:8:96"`` -> block_h:num_warps:num_stages:programs_per_sm:
    max_registers dicts (the last field may be left out: the launcher's default)."""
    return [dict(zip(TRITON_KNOBS, map(int, c.split(":")), strict=False))
            for c in text.split(",") if c]


#: Variant 3's knobs and default sweep at D = 128 (heads per warp 4: 2 head rounds, the
#: only count csrc compiles): the default 4:4:3 first, then warps at 3 stages, then 2 and 4
#: stages.
STREAM_KNOBS = ("warps_per_block", "heads_per_warp", "num_stages")
STREAM_DEFAULT = "4:4:3,2:4:3,8:4:3,1:4:3,4:4:2,4:4:4,8:4:2,8:4:4"


def stream_configs(text: str) -> list[dict]:
    """``"4:4:3,8:2:2"`` -> warps_per_block:heads_per_warp:num_stages dicts (variant 3)."""
    return [dict(zip(STREAM_KNOBS, map(int, c.split(":")), strict=True))
            for c in text.split(",") if c]


#: Variant 4's knobs and default sweep at D = 128 (heads per warp 4: 2 passes per item, the
#: only count csrc compiles): the default 8:4 first.
PERSIST_KNOBS = ("warps_per_block", "heads_per_warp")
PERSIST_DEFAULT = "8:4,4:4,2:4,1:4"


def persist_configs(text: str) -> list[dict]:
    """``"8:4,4:2"`` -> warps_per_block:heads_per_warp dicts (variants 4 and 5)."""
    return [dict(zip(PERSIST_KNOBS, map(int, c.split(":")), strict=True))
            for c in text.split(",") if c]


def configs(args):
    for knobs in args.triton:
        yield "triton", knobs
    for v in args.persist_variants if not args.no_cuda else ():
        for knobs in args.persist:
            yield "cuda", {"variant": v, **knobs}
    for knobs in args.stream if not args.no_cuda else ():
        yield "cuda", {"variant": 3, **knobs}
    for hf in args.heads_fast if not args.no_cuda else ():
        yield "cuda", {"variant": 0, "block_h": 32, "heads_fast": hf}
        for v in args.cuda_variants:
            for w in (1, 2, 4, 8):
                for h in (2, 4, 8):
                    yield "cuda", {"variant": v, "warps_per_block": w, "heads_per_warp": h,
                                   "heads_fast": hf}


def launcher(name, params):
    if name == "triton":
        from kernels import norm_rope_insert as nri

        params = dict(params)
        pps = params.pop("programs_per_sm", None)
        if pps:
            params["programs"] = pps * torch.cuda.get_device_properties(0).multi_processor_count
        launch = nri.norm_rope_insert
    else:
        from kernels.cuda_norm_rope_insert import norm_rope_insert as launch
    return lambda *a, **kw: launch(*a, **kw, **params)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tokens", type=int, default=16384)
    ap.add_argument("--caches", default="bf16,e4m3")
    ap.add_argument("--triton", type=triton_configs, default=triton_configs(
        "8:2:3:0:0,8:2:3:0:96,8:2:3:0:80,8:2:4:0:96,8:2:4:0:80,16:4:3:0:96,4:1:3:0:64"),
        help="block_h:num_warps:num_stages:programs_per_sm[:max_registers],... "
             "(programs_per_sm 0: as many as fit, the launcher's default; max_registers 0: "
             "the compiler's choice)")
    ap.add_argument("--heads-fast", type=lambda s: [bool(int(v)) for v in s.split(",") if v],
                    default=[False, True])
    ap.add_argument("--cuda-variants", type=lambda s: [int(v) for v in s.split(",") if v],
                    default=[1, 2], help="variants swept over warps x heads x grid order "
                                         "(variant 0 always runs; variant 3: --stream)")
    ap.add_argument("--stream", type=stream_configs, default=stream_configs(STREAM_DEFAULT),
                    help="variant 3 configurations warps_per_block:heads_per_warp:num_stages,"
                         "... (heads_per_warp a multiple of 256 / D; empty: none)")
    ap.add_argument("--persist", type=persist_configs,
                    default=persist_configs(PERSIST_DEFAULT),
                    help="variant 4 configurations warps_per_block:heads_per_warp,... "
                         "(heads_per_warp a multiple of 256 / D; empty: none)")
    ap.add_argument("--persist-variants", type=lambda s: [int(v) for v in s.split(",") if v],
                    default=[4], help="the variants --persist's shapes run as: 4 and / or 5 "
                                      "(variant 4 with split q lanes at R = D / 2)")
    ap.add_argument("--no-cuda", action="store_true", help="Triton configurations only")
    ap.add_argument("--out", default=os.path.join(os.environ.get("OUT", "reports"),
                                                  "tune.json"))
    args = ap.parse_args(argv)
    copy = harness.copy_bandwidth()
    rows = []
    for cache in args.caches.split(","):
        kv_fmt, index_fmt = bi.CACHES[cache]
        mb = bi.minimal_bytes(args.tokens, kv_fmt, index_fmt)["total"]
        sets = [bi.make_set(args.tokens, kv_fmt, index_fmt, seed=i)
                for i in range(harness.rotation_count(mb, harness.l2_bytes()))]
        for name, params in configs(args):
            bind = bi.fused_insert(launcher(name, params), kv_fmt, index_fmt)
            try:
                t = harness.time_calls([bind(s) for s in sets], rep_ms=100)
                us = t.median_us
            except Exception as e:  # noqa: BLE001 - a config may not launch
                print(name, params, "failed:", str(e)[:200], flush=True)
                continue
            frac = mb / (us * 1e-6) / copy["bytes_per_s"]
            rows.append({"impl": name, "cache": cache, **params, "median_us": us,
                         "copy_fraction": frac})
            print(f"{cache} {name} {params}: {us:.1f} us {100 * frac:.1f}%", flush=True)
        del sets
        torch.cuda.empty_cache()
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"schema": "tune/1", "copy": copy, "rows": rows},
                                         indent=1))
    for cache in args.caches.split(","):
        for impl in ("triton", "cuda"):
            best = min((r for r in rows if r["cache"] == cache and r["impl"] == impl),
                       key=lambda r: r["median_us"], default=None)
            if best:
                print("best", cache, impl, {k: v for k, v in best.items() if k != "cache"})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
