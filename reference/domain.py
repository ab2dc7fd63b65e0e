"""The supported domain (contract.md section 7) and the model's numbers (contract.md preamble).

Validators, hypothesis strategies and docs read these constants; no other module
restates them.
"""

from __future__ import annotations

from dataclasses import dataclass

PAGE_SIZES = (16, 32, 64, 128)  # page size P = sparse block size
TOPK_RANGE = (1, 64)  # K, inclusive
GQA_GROUP_RANGE = (1, 16)  # G = Hq / Hkv, inclusive
KV_HEADS_RANGE = (1, 8)  # Hkv, inclusive, not only powers of two
DECODE_ROWS_RANGE = (1, 4)  # query rows per request in decode, inclusive
MAX_TOKENS = 65_536  # N per call
MAX_CONTEXT = 1 << 20
KERNEL_HEAD_DIMS = (128,)  # kernels: 128 required; 64 and 256 where declared
ACTIVATION_DTYPES = ("bfloat16", "float16")


@dataclass(frozen=True)
class ModelShape:
    """MiniMax-M3-style attention at TP=1."""

    num_q_heads: int = 64
    num_kv_heads: int = 4
    head_dim: int = 128
    rotary_dim: int = 64
    rope_base: float = 5e6
    eps: float = 1e-6
    num_index_heads: int = 4
    page_size: int = 128
    topk: int = 16
    local_blocks: int = 1
    initial_blocks: int = 0


MODEL = ModelShape()


def check_in_range(name: str, value: int, lo: int, hi: int) -> int:
    if not isinstance(value, int) or not lo <= value <= hi:
        raise ValueError(f"{name} must be an integer in [{lo}, {hi}], got {value!r}")
    return value


def check_choice(name: str, value, choices) -> object:
    if value not in choices:
        raise ValueError(f"{name} must be one of {list(choices)}, got {value!r}")
    return value


def check_rotary_dim(rotary_dim: int, head_dim: int) -> int:
    """R must be even with 2 <= R <= D (R/2 odd included)."""
    if not isinstance(rotary_dim, int) or rotary_dim % 2 or not 2 <= rotary_dim <= head_dim:
        raise ValueError(
            f"rotary_dim must be even and in [2, head_dim={head_dim}], got {rotary_dim!r}"
        )
    return rotary_dim


def check_gqa(num_q_heads: int, num_kv_heads: int) -> int:
    """G = Hq / Hkv; Hq must be divisible by Hkv."""
    if num_kv_heads < 1 or num_q_heads % num_kv_heads:
        raise ValueError(
            f"num_q_heads ({num_q_heads}) must be a positive multiple of num_kv_heads "
            f"({num_kv_heads})"
        )
    return num_q_heads // num_kv_heads
