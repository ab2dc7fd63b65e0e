"""Gathered-read bandwidth from L2 and from HBM: the ceiling of a kernel that re-reads K/V
blocks chosen at random from a working set, one whole block per visit.

Why (prefill with random selections): the prefill's narrow tier reads each (token, KV head)'s
K selected blocks itself, ``K x P x 2D`` bytes per visit (model shape: 16 x 32 KiB with an
fp8 cache, 16 x 64 KiB with bf16), and the benchmark's 8k-on-8k batch makes 8192 x 4 x 16
visits over a cache of 16.8 MB (fp8) / 33.5 MB (bf16), which fits the 50 MB L2. At the
150 TFLOP/s target (3.66 ms for the batch's 549 useful GFLOP) that is 4.6 TB/s (fp8) or
9.2 TB/s (bf16) of block reads: whether a design that reads per token can reach the target
at all is this bandwidth, measured here on the chip.

What: ``_gather_xor_kernel``, one program per visit, reads one chunk (``CHUNK`` int32
words, contiguous, chosen by an index array) and stores their XOR, so no load can be
dropped; chunk indices uniform on the working set (``oracle.core.rand``, seeded). Timed
by ``triton.testing.do_bench`` (median; its L2 flush before each call costs the first touch
of the working set, under 1% of the reads here); bytes = visits x chunk bytes (the index
and output words, 8 bytes per visit, left out). Working sets from 8 MiB (in L2) to 1 GiB
(HBM), chunks of 32 and 64 KiB (one block of one KV head, fp8 and bf16).

    python -m benchmarks.l2_bandwidth --out reports/l2_bandwidth.json
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks import harness  # noqa: E402
from kernels._triton import tl, triton  # noqa: E402
from oracle.core import rand  # noqa: E402

WORKING_SETS_MIB = (8, 16, 24, 32, 40, 1024)
CHUNKS_KIB = (32, 64)
#: Bytes read per timed call (visits x chunk); 2 GiB: ~0.3-1 ms per call.
READ_BYTES = 2 * 2**30
#: int32 words per load of a program: 8 KiB, 16 per thread of its 4 warps.
BLOCK_WORDS = 2048
SEED = 20261205


@triton.jit
def _gather_xor_kernel(src_ptr, idx_ptr, out_ptr, CHUNK: tl.constexpr, BLOCK: tl.constexpr):
    i = tl.program_id(0)
    base = src_ptr + tl.load(idx_ptr + i).to(tl.int64) * CHUNK
    acc = tl.zeros([BLOCK], dtype=tl.int32)
    for off in tl.static_range(0, CHUNK, BLOCK):
        acc ^= tl.load(base + off + tl.arange(0, BLOCK))
    tl.store(out_ptr + i, tl.xor_sum(acc, axis=0))


def gather_xor(src: torch.Tensor, idx: torch.Tensor, chunk_words: int,
               block_words: int = BLOCK_WORDS) -> torch.Tensor:
    """``out[i]`` = the XOR of ``src[idx[i] * chunk_words:][:chunk_words]``, one program
    per ``i``; src int32 contiguous, idx int32/int64 in ``[0, src.numel() //
    chunk_words)`` (not checked: a probe, not a kernel of the project's API)."""
    if chunk_words % block_words:
        raise ValueError(f"chunk_words must be a multiple of {block_words}, got {chunk_words}")
    out = torch.empty(idx.numel(), dtype=torch.int32, device=src.device)
    _gather_xor_kernel[(idx.numel(),)](src, idx, out, CHUNK=chunk_words, BLOCK=block_words,
                                       num_warps=4)
    return out


def chunk_indices(seed: int, visits: int, chunks: int) -> np.ndarray:
    """int32 ``[visits]`` uniform on ``[0, chunks)`` from the seeded raw stream."""
    return rand.integers(rand.generator(seed), 0, chunks, (visits,)).astype(np.int32)


def measure(working_mib: int, chunk_kib: int, dev) -> dict:
    words = chunk_kib * 256
    chunks = working_mib * 1024 // chunk_kib
    visits = READ_BYTES // (chunk_kib * 1024)
    src = torch.arange(chunks * words, dtype=torch.int32, device=dev)
    idx = torch.from_numpy(chunk_indices(SEED, visits, chunks)).to(dev)
    gather_xor(src, idx, words)
    us = triton.testing.do_bench(lambda: gather_xor(src, idx, words),
                                 return_mode="median") * 1e3
    return {"working_set_mib": working_mib, "chunk_kib": chunk_kib, "visits": visits,
            "median_us": us, "tb_per_s": visits * chunk_kib * 1024 / us / 1e6}


def build_report(args) -> dict:
    dev = torch.device("cuda")
    doc = harness.report_base("l2_bandwidth/1", "gathered chunk reads by working set", args)
    doc["timing"] = {"method": "median of triton.testing.do_bench over eager calls (L2 "
                               "flushed before each)", "read_bytes": READ_BYTES}
    doc["results"] = []
    for w in args.working_sets:
        for c in args.chunks:
            r = measure(w, c, dev)
            doc["results"].append(r)
            print(f"{w} MiB, {c} KiB chunks: {r['median_us']:.1f} us, "
                  f"{r['tb_per_s']:.2f} TB/s", flush=True)
    return doc


def markdown(doc: dict) -> str:
    lines = ["# Gathered-read bandwidth (benchmarks/l2_bandwidth.py)", "",
             f"Device {doc['device']}; copy bandwidth "
             f"{doc['copy']['bytes_per_s'] / 1e12:.2f} TB/s (eager, same run); "
             f"{READ_BYTES // 2**30} GiB of chunk reads per call, do_bench median.", "",
             "| working set (MiB) | chunk (KiB) | median (us) | TB/s |",
             "|---:|---:|---:|---:|"]
    for r in doc["results"]:
        lines.append(f"| {r['working_set_mib']} | {r['chunk_kib']} | {r['median_us']:.1f} "
                     f"| {r['tb_per_s']:.2f} |")
    return "\n".join(lines) + "\n"


def parse_args(argv):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--working-sets", type=int, nargs="+", default=list(WORKING_SETS_MIB),
                    metavar="MIB")
    ap.add_argument("--chunks", type=int, nargs="+", default=list(CHUNKS_KIB), metavar="KIB",
                    choices=(8, 16, 32, 64))
    harness.add_timing_args(ap, "l2_bandwidth")
    return ap.parse_args(argv)


def main(argv=None) -> int:
    return harness.main("l2_bandwidth", sys.argv[1:] if argv is None else argv, parse_args,
                        build_report, markdown)


if __name__ == "__main__":
    raise SystemExit(main())
