"""The table of storage formats (the four fp8 formats, bf16, fp16) every module reads.

One row per format: its bit split, bias and special-value convention (from which the
codec, the extremes and the special codes are derived), the integer code the kernels take
as a constexpr / ``cvt::Format``, torch's dtype name (a string: the reference has no torch),
the fp8 kind vLLM's ``kv_cache_dtype`` names, and the platforms that convert it natively.

Platforms: ``cuda`` (NVIDIA sm89+), ``rocm-ocp`` (gfx950) and ``rocm-fnuz`` (gfx942, MI300).
The OCP platforms store fp8 as e4m3fn / e5m2; MI300 stores e4m3fnuz / e5m2fnuz, so vLLM's
"fp8" and "fp8_e4m3" resolve to e4m3fnuz there, as vLLM's platform code does.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import numpy as np

PLATFORMS = ("cuda", "rocm-ocp", "rocm-fnuz")
#: vLLM's fp8 ``kv_cache_dtype`` strings -> the fp8 kind each names.
KV_CACHE_FP8_KINDS = {"fp8": "e4m3", "fp8_e4m3": "e4m3", "fp8_e5m2": "e5m2"}

@dataclass(frozen=True)
class FloatFormat:
    """A binary floating-point format of at most 16 bits.

    ``specials`` names the convention of the special values:
      ``ieee``  top exponent reserved: mantissa 0 is +-Inf, others NaN (e5m2, bf16, fp16)
      ``fn``    no Inf; only the all-ones code (both signs) is NaN (e4m3fn)
      ``fnuz``  no Inf, no -0; the single code 1000...0 is NaN (e4m3fnuz, e5m2fnuz)
    """

    name: str
    exp_bits: int
    man_bits: int
    bias: int
    specials: str
    nan_code: int  # the canonical NaN a writer emits
    kernel_code: int  # the kernels' FMT constexpr and csrc's cvt::Format value
    torch_dtype: str  # the name of torch's dtype for the format (uint8 codes hold fp8)
    kind: str | None  # the fp8 kind a kv_cache_dtype string names; None for 16-bit formats
    native: tuple[str, ...]  # platforms whose hardware converts the format

    @property
    def bits(self) -> int:
        return 1 + self.exp_bits + self.man_bits

    @property
    def sign_bit(self) -> int:
        return 1 << (self.bits - 1)

    @property
    def code_dtype(self):
        return np.uint8 if self.bits == 8 else np.uint16

    @property
    def max_code(self) -> int:
        """The positive code of the largest finite value."""
        top = self.sign_bit - 1
        if self.specials == "ieee":
            return ((1 << self.exp_bits) - 1 << self.man_bits) - 1
        return top - 1 if self.specials == "fn" else top

    @property
    def inf_code(self) -> int | None:
        return ((1 << self.exp_bits) - 1) << self.man_bits if self.specials == "ieee" else None

    @property
    def negative_zero_code(self) -> int | None:
        return None if self.specials == "fnuz" else self.sign_bit

    @cached_property
    def values(self) -> np.ndarray:
        """float64 value of every code 0 .. 2^bits - 1 (the decode table)."""
        code = np.arange(1 << self.bits, dtype=np.int64)
        sign = np.where(code & self.sign_bit, -1.0, 1.0)
        e = (code >> self.man_bits) & ((1 << self.exp_bits) - 1)
        f = code & ((1 << self.man_bits) - 1)
        frac = f / float(1 << self.man_bits)
        magnitude = np.where(
            e == 0,
            np.ldexp(frac, 1 - self.bias),
            np.ldexp(1.0 + frac, (e - self.bias).astype(np.int32)),
        )
        value = sign * magnitude
        top_e = e == (1 << self.exp_bits) - 1
        if self.specials == "ieee":
            value = np.where(top_e & (f == 0), sign * np.inf, value)
            value = np.where(top_e & (f != 0), np.nan, value)
        elif self.specials == "fn":
            value = np.where(top_e & (f == (1 << self.man_bits) - 1), np.nan, value)
        else:
            value = np.where(code == self.sign_bit, np.nan, value)
        return value

    @property
    def max_finite(self) -> float:
        return float(self.values[self.max_code])

    @property
    def min_normal(self) -> float:
        return float(self.values[1 << self.man_bits])

    @property
    def min_subnormal(self) -> float:
        return float(self.values[1])

    @cached_property
    def _grid(self) -> np.ndarray:
        """Finite magnitudes of codes 0..max_code, plus the first value past max (what the
        code max_code + 1 would be worth if the exponent range went on): the overflow
        threshold is the midpoint to it, and tie-to-even decides that midpoint."""
        finite = self.values[: self.max_code + 1]
        return np.append(finite, 2 * finite[-1] - finite[-2])


FORMATS: dict[str, FloatFormat] = {
    f.name: f
    for f in (
        FloatFormat("e4m3fn", 4, 3, 7, "fn", 0x7F, 0, "float8_e4m3fn", "e4m3",
                    ("cuda", "rocm-ocp")),
        FloatFormat("e5m2", 5, 2, 15, "ieee", 0x7F, 1, "float8_e5m2", "e5m2",
                    ("cuda", "rocm-ocp")),
        FloatFormat("e4m3fnuz", 4, 3, 8, "fnuz", 0x80, 2, "float8_e4m3fnuz", "e4m3",
                    ("rocm-fnuz",)),
        FloatFormat("e5m2fnuz", 5, 2, 16, "fnuz", 0x80, 3, "float8_e5m2fnuz", "e5m2",
                    ("rocm-fnuz",)),
        FloatFormat("bfloat16", 8, 7, 127, "ieee", 0x7FC0, 4, "bfloat16", None, PLATFORMS),
        FloatFormat("float16", 5, 10, 15, "ieee", 0x7E00, 5, "float16", None, PLATFORMS),
    )
}
FP8_FORMATS = tuple(name for name, f in FORMATS.items() if f.kind is not None)
MODEL_DTYPES = tuple(name for name, f in FORMATS.items() if f.kind is None)


def get_format(fmt: str | FloatFormat) -> FloatFormat:
    if isinstance(fmt, FloatFormat):
        return fmt
    try:
        return FORMATS[fmt]
    except (KeyError, TypeError):
        raise ValueError(f"fmt must be one of {sorted(FORMATS)}, got {fmt!r}") from None


def platform_fp8(kind: str, platform: str) -> str:
    """The fp8 format a platform stores for a kind ("e4m3" or "e5m2"): the one it converts."""
    if platform not in PLATFORMS:
        raise ValueError(f"platform must be one of {list(PLATFORMS)}, got {platform!r}")
    for name in FP8_FORMATS:
        if FORMATS[name].kind == kind and platform in FORMATS[name].native:
            return name
    raise ValueError(f"kind must be 'e4m3' or 'e5m2', got {kind!r}")


def native_fp8(platform: str) -> tuple[str, ...]:
    """The fp8 formats a platform's hardware converts (on cuda: e4m3fn, e5m2)."""
    return tuple(name for name in FP8_FORMATS if platform in FORMATS[name].native)


#: The index cache's fp8 formats: every platform's e4m3.
INDEX_FP8_FORMATS = tuple(dict.fromkeys(platform_fp8("e4m3", p) for p in PLATFORMS))
