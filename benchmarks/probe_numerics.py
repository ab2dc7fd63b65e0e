"""Measure the GPU's conversions and fp32 special functions, once per platform.

The oracle's bounds depend on what the hardware does, so this is measured, not assumed:
- Triton 3.6 ``.to(tl.float8e4nv)`` / ``.to(tl.float8e5)`` from fp32, bf16 and fp16,
  exhaustively on the conformance sets, against the reference codec's two policies;
- the fp32 rsqrt, sqrt, division, exp2 and exp that kernels use, in units of the fp32 ulp of
  the exact (float64) result, over several million random arguments.

Run on the GPU machine: ``python benchmarks/probe_numerics.py --out $OUT/probe.json``.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np
import torch
import triton
import triton.language as tl

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from oracle.core import rand
from oracle.tools import conformance  # noqa: E402
from reference.codec import POLICIES, encode  # noqa: E402

BLOCK = 1024


@triton.jit
def _cast_kernel(x_ptr, out_ptr, n, FP8: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    x = tl.load(x_ptr + offs, mask=mask)
    tl.store(out_ptr + offs, x.to(FP8).to(tl.uint8, bitcast=True), mask=mask)


@triton.jit
def _special_kernel(x_ptr, y_ptr, out_ptr, n, OP: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    x = tl.load(x_ptr + offs, mask=mask, other=1.0)
    y = tl.load(y_ptr + offs, mask=mask, other=1.0)
    if OP == "rsqrt":
        r = tl.math.rsqrt(x)
    elif OP == "sqrt":
        r = tl.sqrt(x)
    elif OP == "sqrt_rn":
        r = tl.sqrt_rn(x)
    elif OP == "div":
        r = x / y
    elif OP == "div_rn":
        r = tl.div_rn(x, y)
    elif OP == "exp2":
        r = tl.math.exp2(x)
    else:
        r = tl.exp(x)
    tl.store(out_ptr + offs, r, mask=mask)


TRITON_FP8 = {"e4m3fn": tl.float8e4nv, "e5m2": tl.float8e5}
TORCH_SRC = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


def triton_cast(x: np.ndarray, fmt: str) -> np.ndarray:
    half = {"bfloat16": torch.bfloat16, "float16": torch.float16}.get(x.dtype.name)
    t = torch.from_numpy(x) if half is None else torch.from_numpy(x.view(np.int16)).view(half)
    t = t.cuda()
    out = torch.empty(t.numel(), dtype=torch.uint8, device="cuda")
    _cast_kernel[(triton.cdiv(t.numel(), BLOCK),)](t, out, t.numel(), TRITON_FP8[fmt], BLOCK)
    return out.cpu().numpy()


def cast_rows(sets) -> list[dict]:
    rows = []
    for fmt in TRITON_FP8:
        for source, x in sets.items():
            got = triton_cast(x, fmt)
            counts = {p: conformance.count_mismatches(got, encode(x, fmt, p), fmt)
                      for p in POLICIES}
            rows.append({"fmt": fmt, "source": source, "n": int(x.size), "mismatches": counts})
    return rows


def _ulp32(v: np.ndarray) -> np.ndarray:
    """The fp32 ulp at each (float64) value, subnormal range included."""
    a = np.abs(v).astype(np.float32)
    return np.spacing(np.maximum(a, np.float32(np.finfo(np.float32).tiny))).astype(np.float64)


def special_rows(n: int = 1 << 24) -> list[dict]:
    bg = rand.generator(1)
    pos = rand.log_uniform(bg, -60.0, 60.0, (n,))
    pos = np.abs(pos).astype(np.float32)
    other = np.abs(rand.log_uniform(bg, -60.0, 60.0, (n,))).astype(np.float32)
    expo = (rand.uniform(bg, (n,)) * 250.0 - 125.0).astype(np.float32)
    cases = {
        "rsqrt": (pos, other, lambda x, y: 1.0 / np.sqrt(x)),
        "sqrt": (pos, other, lambda x, y: np.sqrt(x)),
        "sqrt_rn": (pos, other, lambda x, y: np.sqrt(x)),
        "div": (pos, other, lambda x, y: x / y),
        "div_rn": (pos, other, lambda x, y: x / y),
        "exp2": (expo, other, lambda x, y: np.exp2(x)),
        "exp": ((expo * 0.69).astype(np.float32), other, lambda x, y: np.exp(x)),
    }
    rows = []
    for op, (x, y, exact) in cases.items():
        xt, yt = torch.from_numpy(x).cuda(), torch.from_numpy(y).cuda()
        out = torch.empty_like(xt)
        _special_kernel[(triton.cdiv(n, BLOCK),)](xt, yt, out, n, op, BLOCK)
        got = out.cpu().numpy().astype(np.float64)
        want = exact(x.astype(np.float64), y.astype(np.float64))
        ok = np.isfinite(want) & (np.abs(want) < 3e38) & (np.abs(want) > 1.2e-38)
        err_ulp = np.abs(got[ok] - want[ok]) / _ulp32(want[ok])
        rel = np.abs(got[ok] - want[ok]) / np.abs(want[ok])
        rows.append({"op": op, "n": int(ok.sum()), "max_ulp": float(err_ulp.max()),
                     "mean_ulp": float(err_ulp.mean()), "max_rel": float(rel.max()),
                     "correctly_rounded_share": float(np.mean(err_ulp <= 0.5))})
    return rows


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True)
    args = p.parse_args()
    sets = {s: conformance.source_set(s) for s in conformance.SOURCE_DTYPES}
    doc = {
        "schema": "probe/1",
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "triton_casts": cast_rows(sets),
        "special_functions": special_rows(),
    }
    Path(args.out).write_text(json.dumps(doc, indent=1))
    print("| fmt | source | satfinite mismatches | nonsaturating mismatches |")
    for r in doc["triton_casts"]:
        m = r["mismatches"]
        print(f"| {r['fmt']} | {r['source']} | {m['satfinite']} | {m['nonsaturating']} |")
    print("| op | max ulp | mean ulp | correctly rounded |")
    for r in doc["special_functions"]:
        print(f"| {r['op']} | {r['max_ulp']:.3f} | {r['mean_ulp']:.4f} "
              f"| {r['correctly_rounded_share']:.5f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
