"""Gemma RMSNorm, the RoPE table and partial NeoX RoPE over packed qkv rows (contract.md s.3)."""

import math

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from oracle.core import rand
from reference.codec import FORMATS, encode, round_to
from reference.norm_rope import (
    KINDS,
    QKVLayout,
    apply_rope_neox,
    rms_norm_gemma,
    rope_table,
    transform_qkv_rows,
)

MODEL_DTYPES = ("bfloat16", "float16")


def model_values(bg, shape, model_dtype="bfloat16", scale=1.0):
    """Normal values rounded to the model dtype (activations as the kernels see them)."""
    return round_to(scale * rand.normal(bg, shape), model_dtype)


def make_weights(bg, head_dim, model_dtype="bfloat16"):
    return {kind: model_values(bg, (head_dim,), model_dtype, 0.3) for kind in KINDS}


def unit_roundoff(fmt):
    return 2.0 ** -(FORMATS[fmt].man_bits + 1)


def rope_interleaved(x, positions, table, rotary_dim):
    """The wrong pairing (2i, 2i+1), as GPT-J style kernels do: a mutant for the tests."""
    h = rotary_dim // 2
    c, s = table[positions, None, :h], table[positions, None, h:]
    y = x.copy()
    even, odd = x[..., 0:rotary_dim:2], x[..., 1:rotary_dim:2]
    y[..., 0:rotary_dim:2] = even * c - odd * s
    y[..., 1:rotary_dim:2] = odd * c + even * s
    return y


def literal_norm_rope(x, w, eps, position, table, rotary_dim):
    """contract.md s.3 as plain loops over one head vector (a list of D floats)."""
    dim = len(x)
    total = 0.0
    for d in range(dim):
        total += x[d] * x[d]
    inv_rms = 1.0 / math.sqrt(total / dim + eps)
    n = [x[d] * inv_rms * (1.0 + w[d]) for d in range(dim)]
    y = list(n)
    h = rotary_dim // 2
    for i in range(h):
        c, s = table[position][i], table[position][h + i]
        y[i] = n[i] * c - n[i + h] * s
        y[i + h] = n[i + h] * c + n[i] * s
    return y, n


# --- the table ---------------------------------------------------------------------------


@pytest.mark.parametrize("model_dtype", MODEL_DTYPES)
@pytest.mark.parametrize("rotary_dim,base", [(64, 5e6), (128, 1e4), (6, 1e4)])
def test_table_matches_vllms_float32_torch_recipe(model_dtype, rotary_dim, base):
    """rope_table equals the float32 recipe as vLLM writes it in torch (inv_freq, angle and
    cos/sin in float32, then cast to the model dtype), except where the two libms' float32
    cos/sin straddle a rounding boundary: there one model-dtype ulp, on < 1e-4 of entries."""
    positions = 8192
    ours = rope_table(positions, rotary_dim, base, model_dtype)
    inv_freq = 1.0 / (base ** (torch.arange(0, rotary_dim, 2, dtype=torch.float) / rotary_dim))
    freqs = torch.einsum("i,j -> ij", torch.arange(positions, dtype=torch.float), inv_freq)
    torch_dtype = getattr(torch, model_dtype)
    theirs = torch.cat((freqs.cos(), freqs.sin()), -1).to(torch_dtype).double().numpy()
    assert ours.shape == theirs.shape == (positions, rotary_dim)
    differ = ours != theirs
    assert differ.mean() < 1e-4
    a, b = encode(ours[differ], model_dtype), encode(theirs[differ], model_dtype)
    same_sign = (a & 0x8000) == (b & 0x8000)
    assert np.all(same_sign & (np.abs(a.astype(np.int64) - b.astype(np.int64)) == 1))


def test_table_row_zero_and_exact_table():
    """Row 0 is cos 1 / sin 0 in both tables; the exact table is cos/sin of p*base^(-2j/R)
    in float64, and the rounded table holds model-dtype values only."""
    exact = rope_table(100, 10, 1e4, exact=True)
    rounded = rope_table(100, 10, 1e4, "float16")
    for table in (exact, rounded):
        assert np.array_equal(table[0], [1.0] * 5 + [0.0] * 5)
    p, j = 37, 3
    angle = p * 1e4 ** (-2 * j / 10)
    assert exact[p, j] == pytest.approx(math.cos(angle), rel=1e-14)
    assert exact[p, 5 + j] == pytest.approx(math.sin(angle), rel=1e-14)
    assert np.array_equal(round_to(rounded, "float16"), rounded)


# --- RoPE properties ---------------------------------------------------------------------


@pytest.mark.parametrize("exact", [False, True])
def test_rope_is_identity_at_position_zero(exact):
    """At position 0 (cos 1, sin 0) RoPE returns its input bit for bit."""
    bg = rand.generator(1)
    table = rope_table(16, 24, 5e6, "bfloat16", exact=exact)
    x = rand.normal(bg, (3, 4, 32))
    assert np.array_equal(apply_rope_neox(x, np.zeros(3, np.int64), table, 24), x)


@pytest.mark.parametrize("model_dtype", MODEL_DTYPES)
def test_rope_preserves_pair_norms_up_to_the_table_rounding(model_dtype):
    """Each rotated pair (i, i+R/2) keeps its Euclidean norm times sqrt(c^2+s^2) of the
    table entry (to float64 precision), and that factor is within the model dtype's unit
    roundoff u of 1 (c, s each carry relative error <= u, float32 cos/sin ~1e-7 more)."""
    bg = rand.generator(2)
    rotary_dim, h = 20, 10
    table = rope_table(4096, rotary_dim, 1e4, model_dtype)
    positions = rand.integers(bg, 0, 4096, (64,))
    x = rand.normal(bg, (64, 3, 32))
    y = apply_rope_neox(x, positions, table, rotary_dim)
    norm_in = np.hypot(x[..., :h], x[..., h:rotary_dim])
    norm_out = np.hypot(y[..., :h], y[..., h:rotary_dim])
    c, s = table[positions, None, :h], table[positions, None, h:]
    factor = np.sqrt(c * c + s * s)
    assert np.allclose(norm_out, norm_in * factor, rtol=1e-14, atol=0)
    deviation = np.abs(factor - 1)
    assert deviation.max() <= unit_roundoff(model_dtype) + 1e-6
    assert deviation.max() > unit_roundoff(model_dtype) / 8  # the bound is not vacuous


def test_exact_table_dot_products_depend_only_on_relative_position():
    """With the exact table, rope(q, m) . rope(k, n) depends only on m - n (R < D, so
    the pass-through dims add a constant), and changes when m - n changes."""
    bg = rand.generator(3)
    dim, rotary_dim = 64, 34
    table = rope_table(4096, rotary_dim, 1e4, exact=True)
    q, k = rand.normal(bg, (1, dim)), rand.normal(bg, (1, dim))

    def dot(m, n):
        qm = apply_rope_neox(q, np.array([m]), table, rotary_dim)
        kn = apply_rope_neox(k, np.array([n]), table, rotary_dim)
        return float(qm[0] @ kn[0])

    scale = float(np.linalg.norm(q) * np.linalg.norm(k))
    m, n = rand.integers(bg, 0, 2000, (2, 20))
    shifts = rand.integers(bg, 1, 2000, (20,))
    for mi, ni, t in zip(m, n, shifts, strict=True):
        assert abs(dot(mi, ni) - dot(mi + t, ni + t)) <= 1e-10 * scale
        assert abs(dot(mi, ni) - dot(mi, ni + 1)) > 1e-6 * scale


def test_rotate_half_is_not_interleaved():
    """The NeoX pairing (i, i+R/2) differs from the interleaved (2i, 2i+1) one: a kernel
    with the wrong pairing would be caught on random input at a nonzero position."""
    bg = rand.generator(4)
    table = rope_table(64, 16, 1e4, "bfloat16")
    x = rand.normal(bg, (4, 2, 16))
    positions = np.array([1, 5, 17, 63])
    ours = apply_rope_neox(x, positions, table, 16)
    mutant = rope_interleaved(x, positions, table, 16)
    assert not np.allclose(ours, mutant, rtol=1e-3, atol=1e-3)
    # Both rotations agree at position 0, so the difference comes from the pairing alone.
    zero = np.zeros(4, np.int64)
    assert np.array_equal(apply_rope_neox(x, zero, table, 16), rope_interleaved(x, zero, table,
                                                                                16))


@pytest.mark.parametrize("dim,rotary_dim", [(16, 16), (16, 4), (12, 10), (128, 64), (130, 6),
                                            (6, 2), (64, 18)])
def test_partial_rope_pairs_and_pass_through(dim, rotary_dim):
    """R = D, R < D and R/2 odd (10, 6, 2 give R/2 = 5, 3, 1; 18 gives 9): dims >= R are
    returned bit for bit; dims < R equal the literal per-element formula (partner i+R/2)."""
    bg = rand.generator(5)
    table = rope_table(256, rotary_dim, 1e4, "bfloat16")
    x = rand.normal(bg, (5, 2, dim))
    positions = rand.integers(bg, 0, 256, (5,))
    y = apply_rope_neox(x, positions, table, rotary_dim)
    assert np.array_equal(y[..., rotary_dim:], x[..., rotary_dim:])
    h = rotary_dim // 2
    for t in range(5):
        for head in range(2):
            for i in range(h):
                c, s = table[positions[t], i], table[positions[t], h + i]
                a, b = x[t, head, i], x[t, head, i + h]
                assert y[t, head, i] == pytest.approx(a * c - b * s, rel=1e-15, abs=1e-300)
                assert y[t, head, i + h] == pytest.approx(b * c + a * s, rel=1e-15, abs=1e-300)


# --- RMSNorm -----------------------------------------------------------------------------


def test_rms_norm_is_invariant_to_scaling_x():
    """With eps = 0, norm(a x) = norm(x) for any a > 0 (exactly for powers of two); with
    eps > 0 the relative change is at most eps / mean(x^2) (eps aside, invariant)."""
    bg = rand.generator(6)
    x = rand.normal(bg, (8, 96))
    w = rand.normal(bg, (96,))
    base = rms_norm_gemma(x, w, 0.0)
    for a in rand.uniform(bg, (5,)) * 100:
        assert np.allclose(rms_norm_gemma(a * x, w, 0.0), base, rtol=1e-13, atol=0)
    assert np.array_equal(rms_norm_gemma(8.0 * x, w, 0.0), base)
    eps = 1e-3
    mean_square = np.mean(x * x, axis=-1, keepdims=True)
    change = np.abs(rms_norm_gemma(4.0 * x, w, eps) / rms_norm_gemma(x, w, eps) - 1)
    assert np.all(change <= eps / mean_square)
    assert change.max() > 0


def test_rms_norm_scales_by_one_plus_w():
    """The weight enters as (1 + w): w = 0 gives unit RMS output (a `* w` kernel outputs
    zeros), and for random w, output / (1 + w) has unit RMS."""
    bg = rand.generator(7)
    x = rand.normal(bg, (6, 64))
    n0 = rms_norm_gemma(x, np.zeros(64), 0.0)
    assert np.allclose(np.sqrt(np.mean(n0 * n0, axis=-1)), 1.0, rtol=1e-14)
    w = rand.normal(bg, (64,)) * 0.5
    n = rms_norm_gemma(x, w, 0.0)
    unweighted = n / (1 + w)
    assert np.allclose(np.sqrt(np.mean(unweighted * unweighted, axis=-1)), 1.0, rtol=1e-13)
    mutant = x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True)) * w
    assert not np.allclose(n, mutant, rtol=1e-2)


# --- the whole transform -----------------------------------------------------------------


@st.composite
def norm_rope_cases(draw):
    half = draw(st.integers(1, 128))
    dim = 2 * half
    rotary_dim = 2 * draw(st.integers(1, half))
    kv_heads = draw(st.integers(1, 2))
    layout = QKVLayout(kv_heads * draw(st.integers(1, 2)), kv_heads, dim,
                       num_index_heads=draw(st.integers(0, 2)), has_index_k=draw(st.booleans()))
    return dict(
        layout=layout,
        rotary_dim=rotary_dim,
        max_positions=draw(st.integers(1, 1024)),
        base=draw(st.sampled_from([1e4, 5e6])),
        eps=draw(st.sampled_from([0.0, 1e-6, 1e-5])),
        model_dtype=draw(st.sampled_from(MODEL_DTYPES)),
        n_tokens=draw(st.integers(1, 3)),
        seed=draw(st.integers(0, 2**32 - 1)),
    )


@given(norm_rope_cases())
def test_vectorised_transform_matches_the_literal_loops(case):
    """On random cases over the domain (even D <= 256, any even R <= D, positions within
    the table), every transformed head of transform_qkv_rows equals the plain-loop form of
    contract.md s.3 to 1e-12 of the magnitudes summed in each output element."""
    layout, rotary_dim, dtype = case["layout"], case["rotary_dim"], case["model_dtype"]
    bg = rand.generator(case["seed"])
    n, dim = case["n_tokens"], layout.head_dim
    rows = model_values(bg, (n, layout.row_width), dtype)
    weights = make_weights(bg, dim, dtype)
    positions = rand.integers(bg, 0, case["max_positions"], (n,))
    table = rope_table(case["max_positions"], rotary_dim, case["base"], dtype)
    out = transform_qkv_rows(rows, positions, layout, weights, table, rotary_dim, case["eps"],
                             dtype)
    h = rotary_dim // 2
    for kind, sl in layout.slices.items():
        if kind == "v":
            continue
        heads = rows[:, sl].reshape(n, -1, dim)
        got = out[f"{kind}_exact"].reshape(n, -1, dim)
        for t in range(n):
            for head in range(heads.shape[1]):
                y, nrm = literal_norm_rope(list(heads[t, head]), list(weights[kind]),
                                           case["eps"], int(positions[t]), table, rotary_dim)
                c, s = np.abs(table[positions[t], :h]), np.abs(table[positions[t], h:])
                nrm = np.abs(nrm)
                magnitude = nrm.copy()
                magnitude[:h] = nrm[:h] * c + nrm[h:rotary_dim] * s
                magnitude[h:rotary_dim] = nrm[h:rotary_dim] * c + nrm[:h] * s
                assert np.all(np.abs(got[t, head] - y) <= 1e-12 * magnitude)


def _layout_case(seed, layout, n=6, rotary_dim=10, model_dtype="bfloat16"):
    bg = rand.generator(seed)
    rows = model_values(bg, (n, layout.row_width), model_dtype)
    weights = make_weights(bg, layout.head_dim, model_dtype)
    table = rope_table(128, rotary_dim, 5e6, model_dtype)
    positions = rand.integers(bg, 0, 128, (n,))
    return rows, positions, weights, table


def test_transform_outputs_are_the_rounded_composition_and_v_is_untouched():
    """q/k/index_q/index_k_exact equal RoPE(RMSNorm(head)) per kind with its own weight, the
    outputs are those values rounded once to the model dtype, and v comes back bit for bit
    (including -0, Inf, NaN), with no influence on the other outputs."""
    layout = QKVLayout(4, 2, 16, num_index_heads=2, has_index_k=True)
    rows, positions, weights, table = _layout_case(8, layout)
    v = layout.slices["v"]
    specials = np.array([-0.0, np.inf, -np.inf, np.nan])
    rows[:, v.start:v.start + 4] = specials
    out = transform_qkv_rows(rows, positions, layout, weights, table, 10, 1e-6, "bfloat16")
    expected_v = rows[:, v].reshape(6, 2, 16)
    assert out["v"].shape == (6, 2, 16)
    assert np.array_equal(out["v"].view(np.uint64), expected_v.view(np.uint64))
    starts = {"q": 0, "k": 64, "index_q": 128, "index_k": 160}
    counts = {"q": 4, "k": 2, "index_q": 2, "index_k": 1}
    for kind in KINDS:
        part = rows[:, starts[kind]:starts[kind] + 16 * counts[kind]].reshape(6, -1, 16)
        exact = apply_rope_neox(rms_norm_gemma(part, weights[kind], 1e-6), positions, table, 10)
        exact = exact[:, 0] if kind == "index_k" else exact
        assert np.array_equal(out[f"{kind}_exact"], exact)
        assert np.array_equal(out[kind], round_to(exact, "bfloat16"))
    clean = rows.copy()
    clean[:, v] = 0.0
    out_clean = transform_qkv_rows(clean, positions, layout, weights, table, 10, 1e-6,
                                   "bfloat16")
    for kind in KINDS:
        assert np.array_equal(out[kind], out_clean[kind])


def test_dense_rows_have_no_index_outputs_and_same_q_k():
    """Dense rows (q|k|v only) give q, k, v and no index outputs; q, k equal those of the
    same heads inside an indexed row."""
    dense = QKVLayout(4, 2, 16)
    indexed = QKVLayout(4, 2, 16, num_index_heads=2, has_index_k=True)
    rows, positions, weights, table = _layout_case(9, indexed)
    d = transform_qkv_rows(rows[:, :dense.row_width], positions, dense, weights, table, 10,
                           1e-6, "bfloat16")
    i = transform_qkv_rows(rows, positions, indexed, weights, table, 10, 1e-6, "bfloat16")
    assert set(d) == {"q", "q_exact", "k", "k_exact", "v"}
    for key in d:
        assert np.array_equal(d[key], i[key], equal_nan=True)


def test_rows_may_be_a_strided_view():
    """Rows given as a view (every other row of a wider buffer, starting mid-row) give the
    same outputs as a contiguous copy, and the buffer is not modified."""
    layout = QKVLayout(2, 1, 32, num_index_heads=1, has_index_k=True)
    bg = rand.generator(10)
    wide = model_values(bg, (12, layout.row_width + 7))
    before = wide.copy()
    view = wide[::2, 3:3 + layout.row_width]
    _, positions, weights, table = _layout_case(10, layout)
    args = (positions, layout, weights, table, 10, 1e-6, "bfloat16")
    a = transform_qkv_rows(view, *args)
    b = transform_qkv_rows(np.ascontiguousarray(view), *args)
    assert set(a) == set(b)
    for key in a:
        assert np.array_equal(a[key], b[key])
    assert np.array_equal(wide, before)


def test_n_zero_gives_empty_outputs():
    """N = 0 rows give empty outputs of the right shapes."""
    layout = QKVLayout(4, 2, 8, num_index_heads=2, has_index_k=True)
    table = rope_table(4, 8, 1e4, "bfloat16")
    weights = {kind: np.zeros(8) for kind in KINDS}
    out = transform_qkv_rows(np.zeros((0, layout.row_width)), np.zeros(0, np.int64), layout,
                             weights, table, 8, 1e-6, "bfloat16")
    assert out["q"].shape == (0, 4, 8) and out["index_k"].shape == (0, 8)


# --- bad input ---------------------------------------------------------------------------

_L = QKVLayout(4, 2, 16, num_index_heads=2, has_index_k=True)
_ROWS, _POS, _W, _TABLE = _layout_case(11, _L, n=3, rotary_dim=8)


def _transform(rows=_ROWS, positions=_POS, layout=_L, weights=_W, table=_TABLE, rotary_dim=8,
               eps=1e-6, model_dtype="bfloat16"):
    return transform_qkv_rows(rows, positions, layout, weights, table, rotary_dim, eps,
                              model_dtype)


@pytest.mark.parametrize(
    "call, argument",
    [
        (lambda: _transform(rotary_dim=7), "rotary_dim"),
        (lambda: _transform(rotary_dim=18, table=rope_table(8, 18, 1e4, "bfloat16")),
         "rotary_dim"),
        (lambda: _transform(rotary_dim=0), "rotary_dim"),
        (lambda: _transform(positions=np.array([0, 1, 128])), "positions"),
        (lambda: _transform(positions=np.array([0, -1, 2])), "positions"),
        (lambda: _transform(positions=np.array([0.0, 1.0, 2.0])), "positions"),
        (lambda: _transform(positions=np.array([0, 1])), "positions"),
        (lambda: QKVLayout(6, 4, 16), "num_q_heads"),
        (lambda: QKVLayout(4, 2, 15), "head_dim"),
        (lambda: _transform(rows=_ROWS[:, :-16]), "rows"),
        (lambda: _transform(rows=_ROWS.astype(np.int64)), "rows"),
        (lambda: _transform(rows=_ROWS + 1e-3), "rows"),
        (lambda: _transform(table=_TABLE[:, :6]), "table"),
        (lambda: _transform(weights={"q": _W["q"], "k": _W["k"]}), "weights"),
        (lambda: _transform(weights={**_W, "k": _W["k"][:8]}), "weights"),
        (lambda: _transform(eps=-1e-6), "eps"),
        (lambda: _transform(model_dtype="float32"), "model_dtype"),
        (lambda: _transform(layout="qkv"), "layout"),
        (lambda: apply_rope_neox(np.zeros((2, 16)), np.array([0, 200]), _TABLE, 8),
         "positions"),
        (lambda: rms_norm_gemma(np.zeros((2, 16)), np.zeros(8), 1e-6), "w"),
        (lambda: rope_table(0, 8, 1e4, "bfloat16"), "max_positions"),
        (lambda: rope_table(8, 5, 1e4, "bfloat16"), "rotary_dim"),
        (lambda: rope_table(8, 8, 1.0, "bfloat16"), "base"),
    ],
)
def test_bad_input_names_the_argument(call, argument):
    """Bad input (odd R, R > D, positions past the table, Hq not divisible by Hkv, wrong row
    width, int dtype, values not in the model dtype, ...) raises ValueError whose message
    starts with the argument's name."""
    with pytest.raises(ValueError, match=rf"^{argument}\b"):
        call()
