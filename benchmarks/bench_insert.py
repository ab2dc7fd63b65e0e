"""Speed of the fused norm + RoPE + KV/index-cache insert at the model shape.

Shape: Hq 64, Hkv 4, Hi 4 with index_k, D 128, R 64, P 128, bf16 model dtype, 16,384
tokens (one prefill batch: positions 0..N-1, slots in shuffled pages of a pool twice the
size needed). Two caches: ``bf16`` (KV and index caches bf16) and ``e4m3`` (KV and index
caches e4m3fn codes; index_q emitted as e4m3 codes, contract.md s.4). No KV scales (1.0).

Implementations, all on the same input sets (harness.py: graph replay, rotating sets):
- ``triton``: kernels.norm_rope_insert.norm_rope_insert; q, k, index_k (and bf16 index_q)
  IN PLACE in the packed rows, as servers call it (a separate q_out moves the same bytes);
  an fp8 index_q into a preallocated uint8 ``[N, Hi, D]`` buffer. With a bf16 cache the
  launcher's scale placeholders (``torch.ones(1)`` x 2) are two tiny fills in the graph.
- ``torch_eager``: ``compose`` below, plain torch ops of contract.md s.3/4 (fp32 Gemma RMSNorm
  with (1 + w), rotate-half partial RoPE from the table, ``satfinite`` fp8 by clamp + torch's
  fp8 cast: acceptable in a speed baseline, never as a reference). Its kernels are replayed
  from a graph, so host launch overhead is not counted: a conservative baseline. It
  assumes every slot is valid (no skip logic), which also flatters it.
- ``torch_compiled``: ``torch.compile(compose)``, also replayed from a graph.
- ``cuda``: kernels.cuda_norm_rope_insert (csrc/), same calls, when that module
  exists and can be built (nvcc present); skipped otherwise.
- ``reshape_and_cache``: kernels.reshape_and_cache (K/V insert only, no norm/RoPE/index)
  when that module exists: what the unfused insert alone costs. Its own minimal bytes.
Before timing, the triton kernel and the eager composition run on identical fresh inputs
(min(N, 1024) tokens) and their outputs are compared (``agreement``): a baseline that
computes something else would make the speedups meaningless.

Minimal bytes (``minimal_bytes``: every input byte read once, every output written once),
per token: read the row (Hq + 2 Hkv + Hi + 1) D x 2 = 19,712 B, position and slot (int64)
16 B, one RoPE table row R x 2 = 128 B; write q Hq D x 2 = 16,384, k Hkv D x 2 = 1,024,
K/V 2 Hkv D x c = 2,048 (bf16) / 1,024 (e4m3), index_q Hi D x c = 1,024 / 512, index_k
D x 2 = 256, index cache D x c = 256 / 128; plus the four norm weights once (1 KiB).
bf16: 40,848 B/token -> 669.3 MB at 16,384 tokens (the commonly quoted ~669 MB). e4m3: 39,184
B/token -> 642.0 MB. The commonly quoted ~650 MB (650.4) counts index_q at 2 B (bf16);
contract.md s.4 and the kernel emit e4m3 index_q codes (1 B), so 8.4 MB fewer must move;
642.0 MB is the figure used (the lower count makes the bandwidth fraction conservative).
tests/test_bench.py checks both counts.

Targets (triton and cuda rows): >= 80% of the measured copy bandwidth, >= 5x the compiled
composition. Writes a ``bench/1`` JSON (default ``$OUT/bench.json`` when OUT is set, else
reports/bench.json; ``--out``) and the Markdown table beside it (render_bench.py).

Run on the GPU machine: ``python benchmarks/bench_insert.py`` (or ``python -m
benchmarks.bench_insert``); ``--tokens 256`` for a quick check.
"""

from __future__ import annotations

import argparse
import functools
import os
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks import harness, render_bench  # noqa: E402
from reference.domain import MODEL  # noqa: E402

TOKENS = 16_384
ISSUE_MB = {"bf16": 669, "e4m3": 650}  # the commonly quoted counts (e4m3: index_q at 2 B)
CACHES = {"bf16": ("bfloat16", "bfloat16"), "e4m3": ("e4m3fn", "e4m3fn")}  # kv, index fmt
FP8 = {"e4m3fn": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2}
#: Each fused kernel's targets: the Triton kernel 80% of the copy bandwidth,
#: the CUDA kernel 85%; both at least 5x the torch.compile composition.
TARGETS = {"triton": {"copy_fraction": 0.80, "torch_compiled": 5.0},
           "cuda": {"copy_fraction": 0.85, "torch_compiled": 5.0}}
BASELINES = ("torch_compiled", "torch_eager")
IMPLS = ("triton", "cuda", "torch_compiled", "torch_eager", "reshape_and_cache")
FUSED_KERNELS = tuple(TARGETS)  # the rows the targets apply to
CHECK_TOKENS = 1024


@dataclass(frozen=True)
class Shape:
    hq: int = MODEL.num_q_heads
    hkv: int = MODEL.num_kv_heads
    hi: int = MODEL.num_index_heads
    d: int = MODEL.head_dim
    rotary: int = MODEL.rotary_dim
    page: int = MODEL.page_size
    eps: float = MODEL.eps
    rope_base: float = MODEL.rope_base

    @property
    def heads(self) -> int:  # heads per packed row: q | k | v | index_q | index_k
        return self.hq + 2 * self.hkv + self.hi + 1


SHAPE = Shape()


def _bytes_of(fmt: str) -> int:
    return 1 if fmt in FP8 else 2


def minimal_bytes(n: int, kv_fmt: str, index_fmt: str, index_q_bytes: int | None = None,
                  s: Shape = SHAPE) -> dict:
    """Bytes the fused insert must move at N tokens, by part (see the module docstring).
    ``index_q_bytes``: bytes per index_q element (default: the index cache's)."""
    kv, ic = _bytes_of(kv_fmt), _bytes_of(index_fmt)
    iq = ic if index_q_bytes is None else index_q_bytes
    per_token = {
        "read_rows": s.heads * s.d * 2, "read_position_slot": 2 * 8,
        "read_rope_row": s.rotary * 2, "write_q": s.hq * s.d * 2, "write_k": s.hkv * s.d * 2,
        "write_kv_cache": 2 * s.hkv * s.d * kv, "write_index_q": s.hi * s.d * iq,
        "write_index_k": s.d * 2, "write_index_cache": s.d * ic,
    }
    parts = {k: n * v for k, v in per_token.items()}
    parts["read_weights"] = 4 * s.d * 2
    parts["total"] = sum(parts.values())
    return parts


def minimal_bytes_reshape_and_cache(n: int, kv_fmt: str, s: Shape = SHAPE) -> int:
    """K/V insert alone: read K and V (bf16) and the slot, write the K/V cache entries."""
    return n * (2 * s.hkv * s.d * 2 + 8 + 2 * s.hkv * s.d * _bytes_of(kv_fmt))


# ---------------------------------------------------------------------------- inputs


@dataclass
class InsertSet:
    rows: torch.Tensor  # [N, heads * D] bf16, packed q | k | v | index_q | index_k
    positions: torch.Tensor
    table: torch.Tensor
    w: dict
    kv: torch.Tensor  # [pages, Hkv, P, 2D]: uint8 codes or bf16
    slots: torch.Tensor
    ic: torch.Tensor  # [pages, P, D]: uint8 codes or bf16
    iq_out: torch.Tensor | None  # uint8 [N, Hi, D] for an fp8 index cache
    scale: torch.Tensor | None  # 0-d 1.0 for fp8 caches (None: the launcher's default)


def rope_table(max_pos: int, s: Shape, dev) -> torch.Tensor:
    """contract.md s.3's table: fp32 angles and cos/sin, rounded to bf16."""
    j = torch.arange(0, s.rotary, 2, dtype=torch.float32, device=dev)
    inv_freq = 1.0 / s.rope_base ** (j / s.rotary)
    ang = torch.arange(max_pos, dtype=torch.float32, device=dev)[:, None] * inv_freq[None]
    return torch.cat([ang.cos(), ang.sin()], dim=-1).to(torch.bfloat16)


def make_set(n: int, kv_fmt: str, index_fmt: str, seed: int, s: Shape = SHAPE,
             dev: str = "cuda") -> InsertSet:
    """Random bf16 rows and weights (never zeros), positions 0..N-1, slots in shuffled
    pages of a pool twice the size needed, zeroed caches."""
    dev = torch.device(dev)
    g = torch.Generator(device=dev).manual_seed(seed)
    rows = torch.randn((n, s.heads * s.d), generator=g, device=dev).to(torch.bfloat16)
    w = {k: (0.3 * torch.randn(s.d, generator=g, device=dev)).to(torch.bfloat16)
         for k in ("q", "k", "index_q", "index_k")}
    used = -(-n // s.page)
    pages = torch.randperm(2 * used, generator=g, device=dev)[:used]
    t = torch.arange(n, device=dev)
    slots = pages[t // s.page] * s.page + t % s.page
    kv_dt = torch.uint8 if kv_fmt in FP8 else torch.bfloat16
    ic_dt = torch.uint8 if index_fmt in FP8 else torch.bfloat16
    # Caches are outputs only; zeros let the agreement check compare whole caches.
    kv = torch.zeros((2 * used, s.hkv, s.page, 2 * s.d), dtype=kv_dt, device=dev)
    ic = torch.zeros((2 * used, s.page, s.d), dtype=ic_dt, device=dev)
    iq_out = torch.zeros((n, s.hi, s.d), dtype=torch.uint8, device=dev) \
        if index_fmt in FP8 else None
    scale = torch.ones((), dtype=torch.float32, device=dev) if kv_fmt in FP8 else None
    return InsertSet(rows, t, rope_table(n, s, dev), w, kv, slots, ic, iq_out, scale)


# ----------------------------------------------------------------------- composition


def _norm_rope(x, w, c, sn, eps: float, rotary: int):
    """fp32 Gemma RMSNorm (1 + w) and rotate-half RoPE of x [N, H, D]; c, sn [N, 1, R/2]."""
    x = x.float()
    n = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * (1 + w.float())
    h = rotary // 2
    a, b = n[..., :h], n[..., h:rotary]
    return torch.cat([a * c - b * sn, b * c + a * sn, n[..., rotary:]], dim=-1)


def _cache_codes(y, fp8):
    """y as cache entries: uint8 codes of satfinite fp8 (clamp to +-max, then torch's RNE
    cast), or bf16 values when fp8 is None."""
    if fp8 is None:
        return y.to(torch.bfloat16)
    m = torch.finfo(fp8).max
    return y.float().clamp(-m, m).to(fp8).view(torch.uint8)


def compose(rows, positions, table, w_q, w_k, w_iq, w_ik, kv, slots, ic, iq_out, *,
            hq: int, hkv: int, hi: int, d: int, rotary: int, eps: float, kv_fp8, idx_fp8):
    """The fused insert as plain torch ops (all slots valid). kv / ic / iq_out: uint8 codes
    when kv_fp8 / idx_fp8 (a torch fp8 dtype) is given, else bf16; iq_out None: index_q in
    place in the rows."""
    n = rows.shape[0]
    x = rows.view(n, -1, d)
    cs = table[positions].float()
    c, sn = cs[:, None, :rotary // 2], cs[:, None, rotary // 2:rotary]
    iq0 = hq + 2 * hkv
    yq = _norm_rope(x[:, :hq], w_q, c, sn, eps, rotary)
    yk = _norm_rope(x[:, hq:hq + hkv], w_k, c, sn, eps, rotary)
    yiq = _norm_rope(x[:, iq0:iq0 + hi], w_iq, c, sn, eps, rotary)
    yik = _norm_rope(x[:, -1:], w_ik, c, sn, eps, rotary)
    v = x[:, hq + hkv:iq0]
    page = kv.shape[2]
    entry = torch.cat([_cache_codes(yk, kv_fp8), _cache_codes(v, kv_fp8)], dim=-1)
    kv.permute(0, 2, 1, 3)[slots // page, slots % page] = entry
    ic.view(-1, d)[slots] = _cache_codes(yik[:, 0], idx_fp8)
    x[:, :hq] = yq.to(rows.dtype)
    x[:, hq:hq + hkv] = yk.to(rows.dtype)
    x[:, -1:] = yik.to(rows.dtype)
    if iq_out is None:
        x[:, iq0:iq0 + hi] = yiq.to(rows.dtype)
    else:
        iq_out.copy_(_cache_codes(yiq, idx_fp8))


def composition(kv_fmt: str, index_fmt: str, compiled: bool, s: Shape = SHAPE):
    """A factory: InsertSet -> zero-argument call of the (compiled) composition."""
    fn = functools.partial(compose, hq=s.hq, hkv=s.hkv, hi=s.hi, d=s.d, rotary=s.rotary,
                           eps=s.eps, kv_fp8=FP8.get(kv_fmt), idx_fp8=FP8.get(index_fmt))
    if compiled:
        fn = torch.compile(fn, dynamic=False)

    def bind(t: InsertSet):
        args = (t.rows, t.positions, t.table, t.w["q"], t.w["k"], t.w["index_q"],
                t.w["index_k"], t.kv, t.slots, t.ic, t.iq_out)
        return lambda: fn(*args)

    return bind


# --------------------------------------------------------------------------- kernels


def triton_insert(kv_fmt: str, index_fmt: str, s: Shape = SHAPE):
    from kernels.norm_rope_insert import norm_rope_insert

    return fused_insert(norm_rope_insert, kv_fmt, index_fmt, s)


def cuda_insert(kv_fmt: str, index_fmt: str, s: Shape = SHAPE):
    """The CUDA kernel (same launcher contract), or None when its module is absent or it
    cannot be built here (no nvcc)."""
    try:
        from kernels import cuda_norm_rope_insert as cu
    except ImportError:
        return None
    return fused_insert(cu.norm_rope_insert, kv_fmt, index_fmt, s) if cu.available() else None


def fused_insert(launch, kv_fmt: str, index_fmt: str, s: Shape = SHAPE):
    """A factory: InsertSet -> zero-argument call of a fused-insert launcher."""

    def bind(t: InsertSet):
        return lambda: launch(
            t.rows, t.positions, t.table, t.w["q"], t.w["k"], num_q_heads=s.hq,
            num_kv_heads=s.hkv, head_dim=s.d, rotary_dim=s.rotary, eps=s.eps,
            kv_cache=t.kv, kv_fmt=kv_fmt, slot_mapping=t.slots, num_index_heads=s.hi,
            has_index_k=True, w_index_q=t.w["index_q"], w_index_k=t.w["index_k"],
            k_scale=t.scale, v_scale=t.scale, index_cache=t.ic, index_fmt=index_fmt,
            index_q_out=t.iq_out)

    return bind


def reshape_and_cache_insert(kv_fmt: str, s: Shape = SHAPE):
    """K/V insert alone from the rows' k and v heads (strided views), or None when
    kernels.reshape_and_cache does not exist."""
    try:
        from kernels.reshape_and_cache import reshape_and_cache
    except ImportError:
        return None

    def bind(t: InsertSet):
        x = t.rows.view(t.rows.shape[0], -1, s.d)
        k, v = x[:, s.hq:s.hq + s.hkv], x[:, s.hq + s.hkv:s.hq + 2 * s.hkv]
        return lambda: reshape_and_cache(k, v, t.kv, kv_fmt, t.slots, t.scale, t.scale)

    return bind


# ------------------------------------------------------------------------- agreement


def _mismatch(a: torch.Tensor, b: torch.Tensor) -> float:
    """Share of differing elements (bit patterns; bf16 compared as int16)."""
    if a.dtype != torch.uint8:
        a, b = a.view(torch.int16), b.view(torch.int16)
    return float((a != b).float().mean())


def agreement(kv_fmt: str, index_fmt: str, n: int, dev: str = "cuda") -> dict:
    """Run the kernel and the eager composition on identical fresh inputs; the share of
    differing codes per output (0 where both round the same fp32 values)."""
    a, b = (make_set(n, kv_fmt, index_fmt, seed=12345, dev=dev) for _ in range(2))
    triton_insert(kv_fmt, index_fmt)(a)()
    composition(kv_fmt, index_fmt, compiled=False)(b)()
    out = {"tokens": n,
           "rows_max_abs_diff": float((a.rows.float() - b.rows.float()).abs().max()),
           "rows_mismatch": _mismatch(a.rows, b.rows), "kv_mismatch": _mismatch(a.kv, b.kv),
           "index_cache_mismatch": _mismatch(a.ic, b.ic)}
    if a.iq_out is not None:
        out["index_q_mismatch"] = _mismatch(a.iq_out, b.iq_out)
    return out


# ----------------------------------------------------------------------------- bench


def _record(name, op, cache, min_bytes, timing=None, error=None, **extra) -> dict:
    r = {"name": name, "op": op, "cache": cache, "kv_fmt": CACHES[cache][0],
         "index_fmt": CACHES[cache][1], "min_bytes": int(min_bytes),
         "median_us": None, "mode": "error", "calls_per_replay": None, "note": error or ""}
    if timing is not None:
        r.update(timing.as_dict())
    r.update(extra)
    return r


def _binders(cache: str, impls) -> dict:
    kv_fmt, index_fmt = CACHES[cache]
    make = {"triton": lambda: triton_insert(kv_fmt, index_fmt),
            "cuda": lambda: cuda_insert(kv_fmt, index_fmt),
            "torch_compiled": lambda: composition(kv_fmt, index_fmt, compiled=True),
            "torch_eager": lambda: composition(kv_fmt, index_fmt, compiled=False),
            "reshape_and_cache": lambda: reshape_and_cache_insert(kv_fmt)}
    return {name: make[name]() for name in impls}


def bench_cache(cache: str, n: int, args) -> tuple[list[dict], dict]:
    """Results of every implementation for one cache, and the agreement check."""
    kv_fmt, index_fmt = CACHES[cache]
    fused = minimal_bytes(n, kv_fmt, index_fmt)
    insert_only = minimal_bytes_reshape_and_cache(n, kv_fmt)
    smallest = insert_only if "reshape_and_cache" in args.impls else fused["total"]
    sets = [make_set(n, kv_fmt, index_fmt, seed=i)
            for i in range(harness.rotation_count(smallest, harness.l2_bytes()))]
    try:
        agree = agreement(kv_fmt, index_fmt, min(n, CHECK_TOKENS))
    except Exception as e:  # noqa: BLE001 - the timings are still worth having
        agree = {"error": harness.error_text(e)}
    results = []
    for name, bind in _binders(cache, args.impls).items():
        if bind is None:
            continue  # an optional kernel that is not present here
        op = "reshape_and_cache" if name == "reshape_and_cache" else "norm_rope_insert"
        extra = {"bytes_parts": fused} if op == "norm_rope_insert" else {}
        if name in FUSED_KERNELS:
            extra.update(baselines=list(BASELINES), targets=dict(TARGETS[name]))
        mb = fused["total"] if op == "norm_rope_insert" else insert_only
        try:
            t = harness.time_calls([bind(s) for s in sets], args.warmup_ms, args.rep_ms,
                                   graph=not args.eager)
            results.append(_record(name, op, cache, mb, t, **extra))
        except Exception as e:  # noqa: BLE001 - record the failure, bench the rest
            results.append(_record(name, op, cache, mb, error=harness.error_text(e), **extra))
        r = results[-1]
        print(f"{cache} {name}: {r['mode']} {r['median_us']} us"
              + (f" ({r['note']})" if r["mode"] == "error" else ""), flush=True)
    del sets
    torch.cuda.empty_cache()
    return results, agree


def default_out() -> str:
    """$OUT/bench.json on the device machine (OUT is what comes back), else reports/."""
    if os.environ.get("OUT"):
        return str(Path(os.environ["OUT"]) / "bench.json")
    return str(Path(__file__).resolve().parents[1] / "reports" / "bench.json")


def parse_args(argv):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=TOKENS)
    ap.add_argument("--caches", nargs="+", default=list(CACHES), choices=list(CACHES))
    ap.add_argument("--impls", nargs="+", default=list(IMPLS), choices=list(IMPLS))
    ap.add_argument("--out", default=default_out(), help="JSON path (Markdown beside it)")
    ap.add_argument("--warmup-ms", type=float, default=25)
    ap.add_argument("--rep-ms", type=float, default=300)
    ap.add_argument("--copy-mib", type=int, default=harness.COPY_BYTES // 2**20,
                    help="size of the copy that measures the bandwidth ceiling")
    ap.add_argument("--eager", action="store_true", help="time eagerly (no CUDA graphs)")
    return ap.parse_args(argv)


def build_report(args) -> dict:
    doc = harness.track({"schema": render_bench.SCHEMA,
           "what": "fused Gemma RMSNorm + partial NeoX RoPE + paged KV/index insert",
           **harness.device_info(), "tokens": args.tokens,
           "shape": {**asdict(SHAPE), "has_index_k": True, "model_dtype": "bfloat16"},
           "q_output": "in place (packed rows)",
           "timing": harness.timing_info(args),
           "source": harness.source_state(),
           "copy": harness.copy_bandwidth(args.copy_mib * 2**20, args.warmup_ms, args.rep_ms),
           "notes": ["triton/cuda: q/k/index_k in place in the rows; e4m3 index_q to a "
                     "buffer.",
                     "torch_eager/compiled: the composition's kernels replayed from a "
                     "graph (no launch overhead counted).",
                     "e4m3 minimal bytes count index_q as e4m3 (642 MB at 16k tokens; the "
                     "650 MB often quoted counts it as bf16)."],
           "results": [], "agreement": {}})
    for cache in args.caches:
        results, agree = bench_cache(cache, args.tokens, args)
        doc["results"] += results
        doc["agreement"][cache] = agree
    for r, derived in zip(doc["results"], render_bench.derive(doc)):
        r.update(derived)
    return doc


def main(argv=None) -> int:
    return harness.main("bench_insert", argv, parse_args, build_report, render_bench.markdown)


if __name__ == "__main__":
    sys.exit(main())
