"""fp8 codec conformance: the reference codec against ml_dtypes, and torch's casts classified.

The test sets are exhaustive for the 16-bit source dtypes (every bf16 and fp16 pattern)
and, for float32, at least 2 million values: random bit patterns, log-uniform magnitudes
over every fp8 exponent range, every fp8 value, every midpoint between neighbouring fp8
values with its float32 neighbours, +-0, +-Inf and NaN.

ml_dtypes' ``astype`` is the non-saturating reference; satfinite is clip-to-max then cast.
Codes are compared exactly (so -0 vs +0 counts), except that two NaN codes agree.
"""

from __future__ import annotations

from dataclasses import dataclass

import ml_dtypes
import numpy as np

from oracle.core import rand
from reference.codec import FORMATS, FP8_FORMATS, POLICIES, decode, encode

ML_DTYPES = {name: getattr(ml_dtypes, "float8_" + name) for name in FP8_FORMATS}
SOURCE_DTYPES = ("bfloat16", "float16", "float32")


def all_patterns(dtype_name: str) -> np.ndarray:
    """Every bit pattern of a 16-bit float dtype."""
    dtype = ml_dtypes.bfloat16 if dtype_name == "bfloat16" else np.float16
    return np.arange(1 << 16, dtype=np.uint32).astype(np.uint16).view(dtype)


def fp8_edges() -> np.ndarray:
    """Every finite fp8 value of every format, the midpoints between neighbours, and the
    float32 neighbours of both (where rounding decisions flip)."""
    pieces = []
    for name in FP8_FORMATS:
        v = FORMATS[name].values
        v = np.unique(np.abs(v[np.isfinite(v)]))
        pieces += [v, (v[1:] + v[:-1]) / 2, [2 * v[-1] - v[-2], 1.5 * v[-1] - 0.5 * v[-2]]]
    mags = np.concatenate([np.asarray(p, dtype=np.float64) for p in pieces]).astype(np.float32)
    near = [mags, np.nextafter(mags, np.float32(np.inf)), np.nextafter(mags, np.float32(0))]
    m = np.concatenate(near)
    return np.concatenate([m, -m])


def float32_set(seed: int = 0, n_random: int = 1_200_000, n_log: int = 800_000) -> np.ndarray:
    bg = rand.generator(seed)
    random_bits = rand.raw_u32(bg, (n_random,)).view(np.float32)
    log_uniform = rand.log_uniform(bg, -20.0, 18.0, (n_log,)).astype(np.float32)
    specials = np.array([0.0, -0.0, np.inf, -np.inf, np.nan], dtype=np.float32)
    return np.concatenate([random_bits, log_uniform, fp8_edges(), specials])


def source_set(source: str) -> np.ndarray:
    return float32_set() if source == "float32" else all_patterns(source)


def ml_dtypes_encode(x: np.ndarray, fmt: str, policy: str) -> np.ndarray:
    """The cross-check: ml_dtypes' cast (non-saturating), or clip-to-max then cast."""
    if policy == "satfinite":
        m = FORMATS[fmt].max_finite
        with np.errstate(invalid="ignore"):
            x = np.clip(x.astype(np.float32), -m, m)
    with np.errstate(invalid="ignore", over="ignore"):
        return x.astype(ML_DTYPES[fmt]).view(np.uint8)


def count_mismatches(a: np.ndarray, b: np.ndarray, fmt: str) -> int:
    """Codes that differ, two NaN codes counting as equal."""
    both_nan = np.isnan(decode(a, fmt)) & np.isnan(decode(b, fmt))
    return int(np.count_nonzero((a != b) & ~both_nan))


@dataclass(frozen=True)
class Row:
    fmt: str
    policy: str
    source: str
    n: int
    mismatches: int
    against: str = "ml_dtypes"


def reference_rows(sets: dict[str, np.ndarray] | None = None) -> list[Row]:
    """The reference codec against ml_dtypes: every format x policy x source dtype."""
    sets = sets or {s: source_set(s) for s in SOURCE_DTYPES}
    rows = []
    for fmt in FP8_FORMATS:
        for policy in POLICIES:
            for source, x in sets.items():
                ours = encode(x, fmt, policy)
                theirs = ml_dtypes_encode(x, fmt, policy)
                rows.append(Row(fmt, policy, source, x.size, count_mismatches(ours, theirs, fmt)))
    return rows


def torch_cast_codes(x: np.ndarray, fmt: str, device: str) -> np.ndarray:
    import torch

    half = {"bfloat16": torch.bfloat16, "float16": torch.float16}.get(x.dtype.name)
    t = torch.from_numpy(x) if half is None else torch.from_numpy(x.view(np.int16)).view(half)
    out = t.to(device).to(getattr(torch, "float8_" + fmt)).view(torch.uint8)
    return out.cpu().numpy()


@dataclass(frozen=True)
class TorchRow:
    fmt: str
    source: str
    device: str
    mismatches: dict  # policy -> count

    @property
    def policy(self) -> str:
        """The policy torch's cast follows, or 'neither'/'both' when that is ambiguous."""
        matching = [p for p, n in self.mismatches.items() if n == 0]
        return matching[0] if len(matching) == 1 else ("both" if matching else "neither")


def torch_rows(sets: dict[str, np.ndarray] | None = None, devices=None) -> list[TorchRow]:
    """Which policy the installed torch's ``.to(float8_*)`` follows, per format and device."""
    import torch

    sets = sets or {s: source_set(s) for s in SOURCE_DTYPES}
    devices = devices or (["cpu", "cuda"] if torch.cuda.is_available() else ["cpu"])
    rows = []
    for device in devices:
        for fmt in FP8_FORMATS:
            for source, x in sets.items():
                got = torch_cast_codes(x, fmt, device)
                counts = {p: count_mismatches(got, encode(x, fmt, p), fmt) for p in POLICIES}
                rows.append(TorchRow(fmt, source, device, counts))
    return rows


def summary_markdown(rows: list[Row], trows: list[TorchRow], torch_version: str) -> str:
    lines = [
        "## fp8 codec conformance (reference codec vs ml_dtypes)",
        "",
        "| format | policy | source | values | mismatches |",
        "|---|---|---|---:|---:|",
    ]
    lines += [f"| {r.fmt} | {r.policy} | {r.source} | {r.n:,} | {r.mismatches} |" for r in rows]
    lines += [
        "",
        f"## torch {torch_version} casts `.to(torch.float8_*)`: which policy they follow",
        "",
        "| format | source | device | mismatches satfinite | mismatches nonsaturating | policy |",
        "|---|---|---|---:|---:|---|",
    ]
    lines += [
        f"| {r.fmt} | {r.source} | {r.device} | {r.mismatches['satfinite']:,} "
        f"| {r.mismatches['nonsaturating']:,} | {r.policy} |"
        for r in trows
    ]
    return "\n".join(lines)
