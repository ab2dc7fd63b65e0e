"""Gemma RMSNorm and partial NeoX RoPE over packed qkv rows (contract.md section 3).

Everything is computed in float64 from model-dtype inputs. ``transform_qkv_rows`` returns
both the exact post-RoPE value of every head (``"<kind>_exact"``: norm and RoPE in float64,
no intermediate rounding, as production kernels keep the norm result in fp32) and that
value rounded once (RNE) to the model dtype (``"<kind>"``), which is what a kernel writes.

The cos/sin table is an INPUT: it is built once (``rope_table``) and its exact bits are
what every implementation reads. The reference never recomputes cos/sin from an angle.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from reference.codec import as_float64, round_to
from reference.domain import check_gqa, check_rotary_dim
from reference.platforms import check_model_dtype

KINDS = ("q", "k", "index_q", "index_k")  # the transformed tensor kinds, each with own weight


def rms_norm_gemma(x, w, eps):
    """Gemma RMSNorm over the last dim: ``x / sqrt(mean(x^2) + eps) * (1 + w)``.

    x: float ``[..., D]``; w: ``[D]``; eps >= 0. Note (1 + w): a zero weight is the identity
    scale, not zero."""
    x = as_float64(x, "x")
    w = as_float64(w, "w")
    if x.ndim < 1 or w.shape != x.shape[-1:]:
        raise ValueError(f"w must have shape [D] = {x.shape[-1:]}, got {w.shape}")
    eps = _check_eps(eps)
    mean_square = np.mean(x * x, axis=-1, keepdims=True)
    return x / np.sqrt(mean_square + eps) * (1.0 + w)


def rope_table(max_positions, rotary_dim, base, model_dtype="bfloat16", *, exact=False):
    """The cos/sin table, float64 ``[max_positions, R]``; row p is
    ``[cos_0 .. cos_{R/2-1} | sin_0 .. sin_{R/2-1}]`` of the angles ``p * inv_freq_j``.

    Default: the float32 recipe of contract.md s.3 (vLLM's ``RotaryEmbedding`` cache):
    ``inv_freq_j = 1 / base^(2j/R)`` with the exponent, the power and the reciprocal in
    float32; ``angle = float32(p) * inv_freq_j`` rounded to float32; cos/sin of that float32
    angle in float32; then rounded (RNE) to the model dtype. Every float32 step is
    correctly rounded (``_f32``); torch's float32 cos/sin may differ from that in the last
    float32 ulp, so a rare entry may differ by one model-dtype ulp from a table torch
    builds. That is harmless by
    design: the table is an input, built once, and its exact bits are what every
    implementation (reference included) reads.

    ``exact=True``: float64 angles and cos/sin, no rounding at all (``model_dtype`` is then
    unused). Only for tests of RoPE's mathematical properties (e.g. relative position)."""
    if not isinstance(max_positions, (int, np.integer)) or max_positions < 1:
        raise ValueError(f"max_positions must be a positive integer, got {max_positions!r}")
    check_rotary_dim(rotary_dim, rotary_dim)
    if not (np.isfinite(base) and base > 1):
        raise ValueError(f"base must be a finite number > 1, got {base!r}")
    if exact:
        inv_freq = float(base) ** (-np.arange(0, rotary_dim, 2) / rotary_dim)
        angle = np.arange(max_positions, dtype=np.float64)[:, None] * inv_freq
        return np.concatenate([np.cos(angle), np.sin(angle)], axis=1)
    check_model_dtype(model_dtype)
    exponent = _f32(np.arange(0, rotary_dim, 2) / rotary_dim)
    inv_freq = _f32(1.0 / _f32(np.power(_f32(base), exponent)))
    angle = _f32(np.arange(max_positions)[:, None] * inv_freq)  # exact product, one rounding
    table = _f32(np.concatenate([np.cos(angle), np.sin(angle)], axis=1))
    return round_to(table, model_dtype)


def _f32(x):
    """x rounded (RNE) to float32 and held in float64: each float32 step of the table
    computed in float64 and rounded once, i.e. correctly rounded float32 arithmetic (up to
    a double rounding within a few float64 ulps of a float32 tie, ~1e-8 of values). Not
    NumPy's float32 kernels: on AVX512 CPUs its float32 pow is off by an ulp for ~1 in 6
    exponents (numpy 2.3), which moved whole columns of the table away from
    torch's float32 recipe, and a table must not depend on the CPU it was built on."""
    return np.asarray(x, np.float64).astype(np.float32).astype(np.float64)


def apply_rope_neox(x, positions, table, rotary_dim):
    """Partial NeoX ("rotate half") RoPE of ``x [N, ..., D]`` at ``positions [N]``.

    With h = R/2, c = table[p, :h], s = table[p, h:R]: for i < h
    ``y_i = x_i c_i - x_{i+h} s_i`` and ``y_{i+h} = x_{i+h} c_i + x_i s_i``; dims R..D-1
    pass through. The pairing is (i, i+h), not interleaved (2i, 2i+1)."""
    x = as_float64(x, "x")
    if x.ndim < 2:
        raise ValueError(f"x must have shape [N, ..., D], got {x.shape}")
    check_rotary_dim(rotary_dim, x.shape[-1])
    table = _check_table(table, rotary_dim)
    positions = _check_positions(positions, x.shape[0], table.shape[0])
    h = rotary_dim // 2
    # One table row per token, broadcast over any head axes between N and D.
    row = table[positions].reshape((x.shape[0],) + (1,) * (x.ndim - 2) + (rotary_dim,))
    c, s = row[..., :h], row[..., h:]
    first, second = x[..., :h], x[..., h:rotary_dim]
    return np.concatenate(
        [first * c - second * s, second * c + first * s, x[..., rotary_dim:]], axis=-1
    )


@dataclass(frozen=True)
class QKVLayout:
    """Where each tensor sits in a packed row
    ``[q (Hq*D) | k (Hkv*D) | v (Hkv*D) | index_q (Hi*D) | index_k (D)]``.

    Dense layers have ``num_index_heads=0`` and ``has_index_k=False`` (rows are q|k|v).
    The two index parts are independent flags here; the model has both or neither."""

    num_q_heads: int
    num_kv_heads: int
    head_dim: int
    num_index_heads: int = 0
    has_index_k: bool = False

    def __post_init__(self):
        for name in ("num_q_heads", "num_kv_heads", "head_dim"):
            value = getattr(self, name)
            if not isinstance(value, (int, np.integer)) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if self.head_dim % 2:
            raise ValueError(f"head_dim must be even, got {self.head_dim}")
        if not isinstance(self.num_index_heads, (int, np.integer)) or self.num_index_heads < 0:
            raise ValueError(
                f"num_index_heads must be a non-negative integer, got {self.num_index_heads!r}"
            )
        check_gqa(self.num_q_heads, self.num_kv_heads)

    @property
    def widths(self) -> dict[str, int]:
        """Width of each part of the row, in row order; absent parts have width 0."""
        d = self.head_dim
        return {
            "q": self.num_q_heads * d,
            "k": self.num_kv_heads * d,
            "v": self.num_kv_heads * d,
            "index_q": self.num_index_heads * d,
            "index_k": d if self.has_index_k else 0,
        }

    @property
    def row_width(self) -> int:
        return sum(self.widths.values())

    @property
    def slices(self) -> dict[str, slice]:
        """Column slice of each part present in the row."""
        out, start = {}, 0
        for name, width in self.widths.items():
            if width:
                out[name] = slice(start, start + width)
            start += width
        return out

    @property
    def heads(self) -> dict[str, int | None]:
        """Head count of each present part; index_k is a single vector (None: no head axis)."""
        counts = {"q": self.num_q_heads, "k": self.num_kv_heads, "v": self.num_kv_heads,
                  "index_q": self.num_index_heads, "index_k": None}
        return {name: counts[name] for name in self.slices}

    def split(self, rows) -> dict[str, np.ndarray]:
        """Views of the parts of ``rows [N, row_width]``: ``[N, H, D]``, index_k ``[N, D]``."""
        n, d = rows.shape[0], self.head_dim
        return {
            name: rows[:, self.slices[name]].reshape((n, d) if h is None else (n, h, d))
            for name, h in self.heads.items()
        }


def transform_qkv_rows(rows, positions, layout, weights, table, rotary_dim, eps, model_dtype):
    """Norm + RoPE of every q, k, index_q, index_k head of packed rows; v unchanged.

    rows: float ``[N, layout.row_width]`` of model-dtype values, any strides (a column slice
    of a wider array, as servers pass it, is fine). weights: ``{kind: [D]}`` for every kind
    present in the layout (model-dtype values, like the checkpoint's). Returns, for each
    present kind, ``kind_exact`` (float64 post-RoPE value) and ``kind`` (rounded once to the
    model dtype), plus ``v`` (a copy of the v part, ``[N, Hkv, D]``). q, k, index_q are
    ``[N, H, D]``, index_k is ``[N, D]``. Choices where contract.md is silent: rows and weights
    must hold model-dtype values (ValueError otherwise); eps must be finite and >= 0."""
    if not isinstance(layout, QKVLayout):
        raise ValueError(f"layout must be a QKVLayout, got {type(layout).__name__}")
    model_dtype = check_model_dtype(model_dtype)
    rows = as_float64(rows, "rows")
    if rows.ndim != 2 or rows.shape[1] != layout.row_width:
        raise ValueError(f"rows must have shape [N, row_width] = [N, {layout.row_width}], "
                         f"got {rows.shape}")
    check_representable(rows, "rows", model_dtype)
    d = layout.head_dim
    check_rotary_dim(rotary_dim, d)
    table = _check_table(table, rotary_dim)
    positions = _check_positions(positions, rows.shape[0], table.shape[0])
    eps = _check_eps(eps)
    parts = layout.split(rows)
    out = {"v": parts["v"].copy()}
    for kind in KINDS:
        if kind not in parts:
            continue
        w = _check_weight(weights, kind, d, model_dtype)
        exact = apply_rope_neox(rms_norm_gemma(parts[kind], w, eps), positions, table,
                                rotary_dim)
        out[f"{kind}_exact"] = exact
        out[kind] = round_to(exact, model_dtype)
    return out


def _check_eps(eps) -> float:
    if not (np.isscalar(eps) and np.isfinite(eps) and eps >= 0):
        raise ValueError(f"eps must be a finite number >= 0, got {eps!r}")
    return float(eps)


def _check_table(table, rotary_dim) -> np.ndarray:
    table = as_float64(table, "table")
    if table.ndim != 2 or table.shape[1] != rotary_dim or table.shape[0] < 1:
        raise ValueError(f"table must have shape [max_positions, rotary_dim={rotary_dim}], "
                         f"got {table.shape}")
    return table


def _check_positions(positions, n_tokens, max_positions) -> np.ndarray:
    p = np.asarray(positions)
    if p.dtype.kind not in "iu" or p.shape != (n_tokens,):
        raise ValueError(f"positions must be an integer array of shape [{n_tokens}], "
                         f"got {p.dtype} {p.shape}")
    if p.size and (p.min() < 0 or p.max() >= max_positions):
        raise ValueError(f"positions must lie in [0, {max_positions}) (the table's rows), "
                         f"got range [{p.min()}, {p.max()}]")
    return p.astype(np.int64)


def check_representable(x, name, model_dtype):
    """Raise unless every non-NaN element of x is a value of the model dtype."""
    with np.errstate(invalid="ignore"):
        same = (round_to(x, model_dtype) == x) | np.isnan(x)
    if not np.all(same):
        raise ValueError(f"{name} must hold {model_dtype} values (round them first)")


def _check_weight(weights, kind, head_dim, model_dtype) -> np.ndarray:
    if not isinstance(weights, dict) or kind not in weights:
        raise ValueError(f"weights must map each of the layout's kinds to a [D] vector; "
                         f"missing {kind!r}")
    w = as_float64(weights[kind], f"weights[{kind!r}]")
    if w.shape != (head_dim,) or not np.all(np.isfinite(w)):
        raise ValueError(f"weights[{kind!r}] must be a finite vector of shape [{head_dim}], "
                         f"got {w.shape}")
    check_representable(w, f"weights[{kind!r}]", model_dtype)
    return w
