"""The reference indexer (contract.md s.5) against a literal per-row form, and its properties.

The literal form (reference.indexer.indexer_literal) reads like the math: for every
request, token, head and visible block, the max over visible keys of an exactly rounded dot
product (math.fsum of exact products), keys fetched one by one through the block table and
decoded by the codec; the selection is the forced blocks followed by a Python sort. It
shares no code with the fast block-centric form beyond the codec.

Random inputs come from oracle/core/rand.py (raw bits through the project's transforms). Two
value kinds: "grid" (small integers times powers of two: every float64 sum is exact, so
both forms give bit-identical scores and ties are frequent) and "normal" (normals rounded
to the format: generic values).
"""


import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from oracle.core import rand
from reference.codec import FORMATS, FP8_FORMATS, decode, encode
from reference.domain import PAGE_SIZES
from reference.indexer import (
    decode_keys,
    indexer_decode,
    indexer_literal,
    indexer_prefill,
    required_blocks,
    select_blocks,
    select_literal,
    selection_admissible,
    selections_equivalent,
)

CACHE_FORMATS = ("bfloat16", "float16") + FP8_FORMATS


# ----------------------------------------------------------------------- random inputs


def values(bg, shape, fmt, kind):
    """Values representable in fmt: 'grid' = m * 2^e with |m| < 8 (4 for e5m2) and
    e in [-2, 2] (sums of D <= 128 products exact in float64); 'normal' = N(0, 1) rounded."""
    if kind == "grid":
        top = 4 if fmt.startswith("e5m2") else 8
        m = rand.integers(bg, -top + 1, top, shape)
        return np.ldexp(m.astype(np.float64), rand.integers(bg, -2, 3, shape).astype(np.int32))
    return decode(encode(rand.normal(bg, shape), fmt, "satfinite"), fmt)


def make_batch(seed, page, fmt, kind, seq_lens, hi, d, spare_pages=2):
    """A shuffled index cache holding every request's keys; block tables point into it;
    spare pages and the tail of each last page hold NaN codes (must never be read)."""
    bg = rand.generator(seed)
    f = FORMATS[fmt]
    pages_per = [-(-int(s) // page) for s in seq_lens]
    num_pages = sum(pages_per) + spare_pages
    cache = np.full((num_pages, page, d), f.nan_code, f.code_dtype)
    perm = rand.permutation(bg, num_pages)
    width = max(pages_per + [1])
    block_table = np.full((len(seq_lens), width + 1), -7, np.int64)  # unused columns: junk
    used = 0
    for r, s in enumerate(seq_lens):
        pages = perm[used:used + pages_per[r]]
        used += pages_per[r]
        block_table[r, :len(pages)] = pages
        j = np.arange(int(s))
        cache[pages[j // page], j % page] = encode(values(bg, (int(s), d), fmt, kind), fmt)
    return cache, block_table, bg


# --------------------------------------------------------------------------- strategies


@st.composite
def prefill_cases(draw):
    page = draw(st.sampled_from(PAGE_SIZES))
    max_blocks = max(2, 384 // page)
    batch = draw(st.integers(1, 3))
    seq_lens, qlens = [], []
    for _ in range(batch):
        s = draw(st.integers(0, max_blocks * page))
        seq_lens.append(s)
        qlens.append(draw(st.integers(0, min(s, 4))))
    return dict(
        page=page, seq_lens=seq_lens, qlens=qlens,
        fmt=draw(st.sampled_from(CACHE_FORMATS)),
        kind=draw(st.sampled_from(["grid", "normal"])),
        hi=draw(st.integers(1, 8)), d=draw(st.sampled_from([2, 4, 6, 8])),
        topk=draw(st.one_of(st.integers(1, 6), st.integers(1, 64))),
        local=draw(st.integers(0, 3)), initial=draw(st.integers(0, 3)),
        seed=draw(st.integers(0, 2**32)),
    )


def run_prefill_case(c, **kw):
    cache, bt, bg = make_batch(c["seed"], c["page"], c["fmt"], c["kind"], c["seq_lens"],
                               c["hi"], c["d"])
    cu = np.concatenate([[0], np.cumsum(c["qlens"])]).astype(np.int64)
    q = values(bg, (int(cu[-1]), c["hi"], c["d"]), c["fmt"], c["kind"])
    res = indexer_prefill(q, cache, c["fmt"], bt, cu, np.array(c["seq_lens"]), c["topk"],
                          c["local"], c["initial"], return_scores=True, **kw)
    return res, (q, cache, bt, cu)


# -------------------------------------------------------------------------------- tests


@given(prefill_cases())
def test_prefill_equals_the_literal_loops(c):
    """On random ragged batches over the domain (every P, K 1..64, Hi 1..8, bf16/fp16 and
    all four fp8 cache formats, L_loc/L_init 0..3 incl. forced blocks exceeding n), the
    fast form's selection equals the literal per-row loops exactly (on generic values up to
    swaps within float64 summation error, which in practice never occur), its scores equal
    the literal max of exact dots (bit-equal on grid data), and so do its magnitudes."""
    res, (q, cache, bt, cu) = run_prefill_case(c)
    lit, lit_s, lit_m = indexer_literal(q, cache, c["fmt"], bt, cu[:-1], np.diff(cu),
                                        c["seq_lens"], c["topk"], c["local"], c["initial"])
    assert res.topk.dtype == np.int32 and res.topk.shape == lit.shape
    if c["kind"] == "grid" or np.array_equal(res.topk, lit):
        np.testing.assert_array_equal(res.topk, lit)
    else:  # generic values: BLAS's float64 sums may differ from fsum by D ulps of |q||k|
        exact = np.full(res.scores.shape, -np.inf)
        for (h, t), row in lit_s.items():
            exact[h, t, :len(row)] = row
        ok, det = selections_equivalent(res.topk, lit, exact, c["d"] * 2.0**-52 *
                                        res.magnitudes, res.num_visible, c["local"],
                                        c["initial"])
        assert ok, det
    tol = 0 if c["kind"] == "grid" else 1e-13
    for (h, t), row in lit_s.items():
        assert res.num_visible[t] == len(row)
        np.testing.assert_allclose(res.scores[h, t, :len(row)], row, rtol=tol, atol=0)
        np.testing.assert_allclose(res.magnitudes[h, t, :len(row)], lit_m[(h, t)], rtol=tol)
        assert np.all(res.scores[h, t, len(row):] == -np.inf)


@pytest.mark.slow
def test_model_shape_decode_equals_the_literal_loops():
    """At the model shape (Hi 4, D 128, P 128, K 16, L_loc 1, L_init 0), a decode batch of
    contexts spanning 1..17 blocks (incl. K < visible blocks, a padding request and 2 rows)
    equals the literal loops, for a bf16 and an e4m3fn index cache."""
    seq_lens = [2120, 7, 0, 129]
    for fmt in ("bfloat16", "e4m3fn"):
        cache, bt, bg = make_batch(11, 128, fmt, "normal", seq_lens, 4, 128)
        q = values(bg, (2 * len(seq_lens), 4, 128), fmt, "normal")
        got = indexer_decode(q, cache, fmt, bt, np.array(seq_lens), 2, 16)
        starts = np.arange(len(seq_lens)) * 2
        counts = [2 if s else 0 for s in seq_lens]
        lit, _, _ = indexer_literal(q, cache, fmt, bt, starts, counts, seq_lens, 16, 1, 0,
                                    magnitudes=False)
        np.testing.assert_array_equal(got, lit)


@given(prefill_cases())
def test_count_padding_and_forced_blocks(c):
    """Stated directly (not through the literal form): n = min(K, p//P + 1) valid distinct
    ids in [0, p//P] come first, then -1; the forced blocks are all present when they fit,
    and otherwise the selection is exactly the first n of initial-then-local (contract.md s.5:
    initial blocks win); the forced blocks come first among the entries."""
    res, _ = run_prefill_case(c)
    page, k = c["page"], c["topk"]
    for h in range(c["hi"]):
        for t, p in enumerate(res.positions):
            nvis = p // page + 1
            n = min(k, nvis)
            row = res.topk[h, t]
            assert np.all(row[n:] == -1) and np.all((row[:n] >= 0) & (row[:n] < nvis))
            assert len(set(row[:n].tolist())) == n
            initial = [b for b in range(min(c["initial"], nvis))]
            local = [b for b in range(max(0, nvis - c["local"]), nvis) if b not in initial]
            forced = initial + local
            if len(forced) <= n:
                assert sorted(row[:len(forced)].tolist()) == forced
            else:
                assert row.tolist()[:n] == forced[:n]


@pytest.mark.parametrize("nvis, k, local, initial, expected", [
    (6, 2, 3, 3, [0, 1]),  # initial blocks win over local ones
    (6, 3, 3, 1, [0, 3, 4]),  # then local blocks in ascending id: the current block drops
    (6, 2, 3, 0, [3, 4]),
    (6, 4, 3, 1, [0, 3, 4, 5]),  # all forced blocks fit exactly
    (2, 4, 3, 3, [0, 1, -1, -1]),  # forced ranges overlap and exceed the visible blocks
    (5, 3, 0, 0, [4, 3, 2]),  # nothing forced: highest scores (ascending in this row)
])
def test_forced_block_precedence_when_they_do_not_fit(nvis, k, local, initial, expected):
    """contract.md s.5 precedence written out by hand: forced blocks fill the selection in the
    order initial blocks, then local blocks by ascending id, then the rest by score; the
    fast selection and the literal one agree with the hand-written rows."""
    scores = np.arange(nvis, dtype=np.float64)[None, None]  # later blocks score higher
    got = select_blocks(scores, np.array([nvis]), k, local, initial)
    assert got[0, 0].tolist() == expected
    assert select_literal(scores[0, 0].tolist(), k, local, initial) == expected


def test_tied_blocks_resolve_to_the_lower_id():
    """Two blocks with identical keys (one page copied onto another) tie bit-exactly; with
    one free slot left after the forced block the lower id wins, for every head and for
    both orders of the pages in the physical cache."""
    page, d, hi = 16, 8, 3
    seq_lens = [page * 6]
    for fmt in ("bfloat16", "e4m3fn", "e5m2fnuz"):
        cache, bt, bg = make_batch(5, page, fmt, "grid", seq_lens, hi, d)
        q = np.abs(values(bg, (1, hi, d), fmt, "grid")) + 1.0  # all positive
        big = encode(np.full(d, 192.0), fmt)  # far above every grid key (|k| <= 28)
        for a, b in ((1, 3), (3, 1)):
            cache[bt[0, a], 5] = big
            cache[bt[0, b]] = cache[bt[0, a]]
            got = indexer_decode(q, cache, fmt, bt, np.array(seq_lens), 1, topk=2,
                                 local_blocks=1, initial_blocks=0)
            assert np.all(got[:, 0, 0] == 5) and np.all(got[:, 0, 1] == min(a, b))


@given(prefill_cases())
def test_duplicated_blocks_never_lose_to_a_higher_copy(c):
    """Copying one visible block's page onto another (both fully visible) makes their
    scores equal bit for bit; then no row selects the higher copy without the lower one,
    unless forced-block rules put the higher one in."""
    _, (q, cache, bt, cu) = run_prefill_case(dict(c, kind="grid"))
    page = c["page"]
    for r, s in enumerate(c["seq_lens"]):
        full_blocks = (s - c["qlens"][r]) // page  # fully visible to every new token
        if full_blocks < 2:
            continue
        cache[bt[r, full_blocks - 1]] = cache[bt[r, 0]]
    res = indexer_prefill(q, cache, c["fmt"], bt, cu, np.array(c["seq_lens"]), c["topk"],
                          c["local"], c["initial"], return_scores=True)
    for r, s in enumerate(c["seq_lens"]):
        hi_b = (s - c["qlens"][r]) // page - 1
        if hi_b < 1:
            continue
        for t in range(cu[r], cu[r + 1]):
            nvis = res.num_visible[t]
            forced = required_blocks(res.num_visible[t:t + 1], nvis, c["topk"], c["local"],
                                     c["initial"])[0]
            for h in range(c["hi"]):
                assert res.scores[h, t, 0] == res.scores[h, t, hi_b] or np.isnan(
                    res.scores[h, t, 0])
                sel = set(res.topk[h, t].tolist())
                if hi_b in sel and 0 not in sel:
                    assert forced[hi_b]


def test_nan_scores_rank_lowest():
    """A block whose score is NaN ranks below every other visible block, even -inf and
    very negative scores: in select_blocks on given scores, and end to end through a NaN
    key code in the cache (NaN codes of each format, bf16 and fp8)."""
    s = np.array([[[-1e300, np.nan, -np.inf, 3.0, np.nan, -5.0]]])
    got = select_blocks(s, np.array([6]), topk=6, local_blocks=0, initial_blocks=0)
    assert got[0, 0].tolist() == [3, 5, 0, 2, 1, 4]
    got = select_blocks(s, np.array([6]), topk=4, local_blocks=0, initial_blocks=0)
    assert got[0, 0].tolist() == [3, 5, 0, 2]
    page, d = 16, 4
    for fmt in ("bfloat16", "e4m3fn", "e4m3fnuz", "e5m2"):
        cache, bt, bg = make_batch(3, page, fmt, "grid", [page * 5], 2, d)
        q = np.ones((1, 2, d))
        cache[bt[0, :4]] = encode(np.full(d, -4.0), fmt)  # every score very negative
        cache[bt[0, 2], 7, 1] = FORMATS[fmt].nan_code
        res = indexer_decode(q, cache, fmt, bt, np.array([page * 5]), 1, topk=5,
                             return_scores=True)
        assert np.all(np.isnan(res.scores[:, 0, 2]))
        assert np.all(res.topk[:, 0, -1] == 2)
        assert np.all(np.sort(res.topk[:, 0, 1:4], axis=-1) == [0, 1, 3])


@given(prefill_cases(), st.integers(1, 4), st.data())
def test_decode_rows_equal_prefill_rows(c, rows, data):
    """A decode row at position p equals the prefill row at the same position of the same
    request and cache (both in topk and scores); padding requests (seq_len 0) give all -1."""
    seq_lens = [s if s >= rows else 0 for s in c["seq_lens"]] + [0]
    qlens = [s for s in seq_lens]  # prefill every position
    res_p, (q_p, cache, bt, cu) = run_prefill_case(dict(c, seq_lens=seq_lens, qlens=qlens))
    dec_lens = [data.draw(st.integers(rows, s)) if s else 0 for s in seq_lens]
    q_d = np.zeros((rows * len(seq_lens), c["hi"], c["d"]))
    want = []
    for r, s in enumerate(dec_lens):
        for j in range(rows):
            if s:
                p = s - rows + j
                q_d[r * rows + j] = q_p[cu[r] + p]
                want.append(cu[r] + p)
            else:
                want.append(-1)
    res_d = indexer_decode(q_d, cache, c["fmt"], bt, np.array(dec_lens), rows, c["topk"],
                           c["local"], c["initial"], return_scores=True)
    for i, t in enumerate(want):
        if t < 0:
            assert np.all(res_d.topk[:, i] == -1) and res_d.num_visible[i] == 0
            continue
        np.testing.assert_array_equal(res_d.topk[:, i], res_p.topk[:, t])
        nv = res_p.num_visible[t]
        np.testing.assert_array_equal(res_d.scores[:, i, :nv], res_p.scores[:, t, :nv])


@given(prefill_cases())
def test_shuffled_page_tables_give_identical_results(c):
    """Moving every physical page elsewhere (and the block table with it) changes nothing:
    selections and scores are bit-identical."""
    res, (q, cache, bt, cu) = run_prefill_case(c)
    perm = rand.permutation(rand.generator(c["seed"] + 1), cache.shape[0])
    moved = np.empty_like(cache)
    moved[perm] = cache
    bt2 = np.where((bt >= 0) & (bt < cache.shape[0]), perm[np.clip(bt, 0, None)
                                                           % cache.shape[0]], bt)
    res2 = indexer_prefill(q, moved, c["fmt"], bt2, cu, np.array(c["seq_lens"]), c["topk"],
                           c["local"], c["initial"], return_scores=True)
    np.testing.assert_array_equal(res2.topk, res.topk)
    np.testing.assert_array_equal(res2.scores, res.scores)


@pytest.mark.parametrize("fmt", CACHE_FORMATS)
def test_fast_key_decode_equals_the_codec(fmt):
    """The fast decode (bf16 shift, table lookups) gives the codec's value for every code
    (NaN codes decode to NaN, -0 to -0)."""
    codes = np.arange(1 << FORMATS[fmt].bits).astype(FORMATS[fmt].code_dtype)
    fast, ref = decode_keys(codes, fmt), decode(codes, fmt)
    same = (fast == ref) & (np.signbit(fast) == np.signbit(ref))
    assert np.all(same | (np.isnan(fast) & np.isnan(ref)))


# ------------------------------------------------------------------ the tie-aware helper


def one_row(scores):
    return np.array(scores, np.float64)[None, None, :]


def sel_row(ids, k):
    return np.array([ids + [-1] * (k - len(ids))], np.int32)[None]


def test_helper_accepts_near_tie_swaps_within_the_bound_only():
    """Swapping a selected block for an unselected one whose exact score is 1e-4 lower is
    admissible under bound 1e-4 (per block: 1e-4 <= e_a + e_u) and not under 1e-6; a swap
    with a block far below is rejected; a per-block bound array works the same way."""
    s = one_row([0.0, 5.0, 3.0, 1.0, 2.9999, 2.0])  # block 5 is the local (forced) block
    nv = np.array([6])
    ref = select_blocks(s, nv, topk=3)
    assert sorted(ref[0, 0].tolist()) == [1, 2, 5]
    swap = sel_row([5, 1, 4], 3)
    assert selections_equivalent(swap, ref, s, 1e-4, nv)[0]
    ok, det = selections_equivalent(swap, ref, s, 1e-6, nv)
    assert not ok and det["a"]["failures"][0][2] == "swap beyond bound"
    assert det["rows_differing"] == 1 and det["blocks_swapped"] == 1
    assert abs(det["a"]["needed_bound"] - 0.5e-4) < 1e-12
    assert not selections_equivalent(sel_row([5, 1, 3], 3), ref, s, 1e-3, nv)[0]
    per_block = np.array([0, 0, 0.6e-4, 0, 0.6e-4, 0])[None, None]
    assert selection_admissible(swap, s, per_block, nv)[0]
    assert not selection_admissible(swap, s, per_block / 2, nv)[0]


def test_helper_is_a_threshold_not_a_pairing():
    """Admissibility is about one threshold between selected and unselected blocks, not
    about each swapped block being near some dropped one: with scores [10, 5, 4.75, 4.5]
    and bound 0.25, replacing 5 by 4.75 or 4.5 is admissible, but replacing both 10 and 5
    by 4.75 and 4.5 is not (each is within 2 * bound of the dropped 5, yet no scores
    within the bound make them beat 10)."""
    s = one_row([10.0, 5.0, 4.75, 4.5])
    nv = np.array([4])
    ref = select_blocks(s, nv, topk=2, local_blocks=0)
    assert sorted(ref[0, 0].tolist()) == [0, 1]
    for ids, ok in (([1, 0], True), ([0, 2], True), ([3, 0], True), ([2, 3], False)):
        assert selection_admissible(sel_row(ids, 2), s, 0.25, nv, local_blocks=0)[0] == ok
    assert not selection_admissible(sel_row([0, 3], 2), s, 0.2, nv, local_blocks=0)[0]


def test_helper_rejects_structural_errors_whatever_the_bound():
    """Missing forced blocks, too few valid entries, -1 before a valid entry, duplicates
    and ids past the visible blocks are rejected even with a huge bound; entry order is
    not significant; fewer visible blocks than K means exactly num_visible entries."""
    s = one_row([1.0, 2.0, 3.0, 4.0, 5.0])
    nv = np.array([5])
    big = 1e9
    ref = select_blocks(s, nv, topk=3, local_blocks=1, initial_blocks=1)
    assert ref[0, 0].tolist() == [0, 4, 3]
    for ids in ([4, 3, 0], [3, 0, 4], [0, 4, 1]):
        assert selection_admissible(sel_row(ids, 3), s, big, nv, 1, 1)[0]
    for bad, reason in [([1, 2, 3], "missing forced block"), ([0, 4], "entries"),
                        ([4, -1, 0], "entries"), ([0, 4, 4], "duplicate ids"),
                        ([0, 4, 5], "entries"), ([0, 4, -2], "entries")]:
        ok, det = selection_admissible(sel_row(bad, 3), s, big, nv, 1, 1)
        assert not ok and any(reason in f[2] for f in det["failures"]), (bad, det)
    short = np.array([2])  # two visible blocks, K = 3: n = 2
    assert selection_admissible(sel_row([1, 0], 3), s, 0.0, short, 1, 1)[0]
    assert not selection_admissible(sel_row([1], 3), s, big, short, 1, 1)[0]
    assert not selection_admissible(sel_row([1, 0, 2], 3), s, big, short, 1, 1)[0]


@given(prefill_cases())
def test_reference_output_is_admissible_and_transposed_buffers_compare_equal(c):
    """The reference's own selection passes the helper with bound 0; written into a
    token-major [T, Hi, K] buffer and read back through np.transpose it is equal and still
    admissible."""
    res, _ = run_prefill_case(c)
    ok, det = res.admits(res.topk, 0.0)
    assert ok, det
    buf = np.empty((res.topk.shape[1], res.topk.shape[0], res.topk.shape[2]), np.int32)
    view = np.transpose(buf, (1, 0, 2))
    view[...] = res.topk
    np.testing.assert_array_equal(np.transpose(buf, (1, 0, 2)), res.topk)
    assert res.admits(view, 0.0)[0]


def test_token_major_buffer_read_as_head_major_is_rejected():
    """Reading a token-major [T, Hi, K] buffer as if it were head-major (a real bug class)
    is rejected by the helper, at bound 0 and at a bound below the score gaps; the correct
    transposed view is accepted."""
    hi, t, nb, k = 3, 4, 9, 3
    s = rand.uniform(rand.generator(7), (hi, t, nb))  # distinct scores: unique top sets
    nv = np.full(t, nb)
    ref = select_blocks(s, nv, k)
    buf = np.ascontiguousarray(np.transpose(ref, (1, 0, 2)))  # token-major storage
    assert selections_equivalent(np.transpose(buf, (1, 0, 2)), ref, s, 0.0, nv)[0]
    gaps = np.diff(np.sort(s.ravel()))
    for bound in (0.0, gaps.min() / 4):
        ok, det = selections_equivalent(buf.reshape(hi, t, k), ref, s, bound, nv)
        assert not ok and det["rows_differing"] > 0


# ------------------------------------------------------------------------- validation


def _good():
    page, d = 16, 4
    cache, bt, bg = make_batch(1, page, "bfloat16", "grid", [40, 20], 2, d)
    q = values(bg, (5, 2, d), "bfloat16", "grid")
    return dict(index_q=q, index_cache=cache, index_fmt="bfloat16", block_table=bt,
                cu_seqlens_q=np.array([0, 3, 5]), seq_lens=np.array([40, 20]), topk=4)


def _bad_prefill_cases():
    g = _good()
    bt_out = g["block_table"].copy()
    bt_out[1, 1] = g["index_cache"].shape[0]
    c = g["index_cache"]
    return [
        (dict(topk=0), "topk"), (dict(topk=65), "topk"), (dict(topk=2.0), "topk"),
        (dict(index_cache=np.zeros((4, 24, 4), np.uint16)), "index_cache"),
        (dict(index_cache=c.astype(np.uint8)), "index_cache"),
        (dict(index_cache=c[..., None]), "index_cache"),
        (dict(index_fmt="fp8"), "index_fmt"),
        (dict(index_q=g["index_q"][..., :3]), "index_q"),
        (dict(index_q=g["index_q"].astype(np.int32)), "index_q"),
        (dict(index_q=g["index_q"][:, 0]), "index_q"),
        (dict(block_table=bt_out), "block_table"),
        (dict(block_table=-g["block_table"]), "block_table"),
        (dict(block_table=g["block_table"][:1]), "block_table"),
        (dict(block_table=g["block_table"][:, :1]), "block_table"),
        (dict(block_table=g["block_table"].astype(np.float64)), "block_table"),
        (dict(cu_seqlens_q=np.array([0, 4, 3])), "cu_seqlens_q"),
        (dict(cu_seqlens_q=np.array([1, 3, 5])), "cu_seqlens_q"),
        (dict(cu_seqlens_q=np.array([0, 3, 6])), "cu_seqlens_q"),
        (dict(cu_seqlens_q=np.array([0, 5])), "cu_seqlens_q"),
        (dict(seq_lens=np.array([40, 1])), "cu_seqlens_q"),
        (dict(seq_lens=np.array([40, -1])), "seq_lens"),
        (dict(seq_lens=np.array([40, 20, 3])), "block_table"),
        (dict(local_blocks=-1), "local_blocks"), (dict(initial_blocks=-2), "initial_blocks"),
    ]


@pytest.mark.parametrize("change, argument", _bad_prefill_cases())
def test_bad_prefill_input_names_the_argument(change, argument):
    """Bad input to indexer_prefill raises ValueError whose message starts with the name
    of the offending argument; the unchanged input is accepted."""
    indexer_prefill(**_good())
    with pytest.raises(ValueError, match=rf"^{argument} "):
        indexer_prefill(**{**_good(), **change})


@pytest.mark.parametrize("change, argument", [
    (dict(rows_per_request=0), "rows_per_request"),
    (dict(rows_per_request=5), "rows_per_request"),
    (dict(seq_lens=np.array([40, 1])), "seq_lens"),
    (dict(index_q=np.zeros((3, 2, 4))), "index_q"),
    (dict(topk=100), "topk"),
])
def test_bad_decode_input_names_the_argument(change, argument):
    """Bad input to indexer_decode (rows out of 1..4, 0 < seq_len < rows, row count not
    B * rows, K out of range) raises ValueError naming the argument."""
    g = _good()
    kw = dict(index_q=g["index_q"][:4], index_cache=g["index_cache"], index_fmt="bfloat16",
              block_table=g["block_table"], seq_lens=np.array([40, 0]), rows_per_request=2,
              topk=4)
    indexer_decode(**kw)
    with pytest.raises(ValueError, match=rf"^{argument} "):
        indexer_decode(**{**kw, **change})
