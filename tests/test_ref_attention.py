"""The block-sparse GQA attention reference (reference/attention.py, contract.md s.6).

Cross-checks: the literal per-row form (reference.attention.attention_literal: loops over
rows, heads, split chunks and tiles), and dense causal attention by torch's float64
scaled_dot_product_attention on the CPU. Invariances: layouts, page tables, selection order,
invisible content (NaN-filled), decode vs prefill. The rounding schedule against its
definition and its expected effect on the result. Bad input raises ValueError naming the
argument.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from oracle.core import rand
from reference import attention as attn
from reference.attention import (
    EXACT,
    Schedule,
    exact,
    sparse_attention_decode,
    sparse_attention_prefill,
    vllm_schedule,
)
from reference.codec import (
    FORMATS,
    FP8_FORMATS,
    decode,
    round_by_table,
    round_dtype,
    round_to,
)
from reference.domain import (
    ACTIVATION_DTYPES,
    DECODE_ROWS_RANGE,
    GQA_GROUP_RANGE,
    KV_HEADS_RANGE,
    PAGE_SIZES,
    TOPK_RANGE,
)
from reference.kv_cache import empty_cache, gather_kv, quantize, scale_at, token_slots
from tests.helpers import assert_close

ALL_FORMATS = (*FP8_FORMATS, "bfloat16", "float16")
JUNK = 10**9  # block-table entries no request uses, and topk of padding rows


# ----------------------------------------------------------------------------- cases


@dataclass
class Case:
    mode: str  # "prefill" or "decode"
    q: np.ndarray
    cache: np.ndarray
    fmt: str
    block_table: np.ndarray
    seq_lens: np.ndarray
    topk: np.ndarray  # [Hkv, T, K] view of a token-major [T, Hkv, K] buffer
    k_scale: object
    v_scale: object
    cu_seqlens_q: np.ndarray | None = None
    rows: int | None = None

    @property
    def page(self):
        return self.cache.shape[2]

    def rows_and_positions(self):
        """(request, position) of every query row, written out from contract.md s.6."""
        req, pos = [], []
        if self.mode == "prefill":
            for r in range(self.seq_lens.size):
                qlen = int(self.cu_seqlens_q[r + 1] - self.cu_seqlens_q[r])
                for i in range(qlen):
                    req.append(r)
                    pos.append(int(self.seq_lens[r]) - qlen + i)
        else:
            for r in range(self.seq_lens.size):
                for j in range(self.rows):
                    req.append(r)
                    s = int(self.seq_lens[r])
                    pos.append(s - self.rows + j if s > 0 else -1)
        return np.array(req, dtype=np.int64), np.array(pos, dtype=np.int64)

    def call(self, **kw):
        args = dict(k_scale=self.k_scale, v_scale=self.v_scale)
        args.update(kw)
        if self.mode == "prefill":
            return sparse_attention_prefill(self.q, self.cache, self.fmt, self.block_table,
                                            self.cu_seqlens_q, self.seq_lens, self.topk,
                                            **args)
        return sparse_attention_decode(self.q, self.cache, self.fmt, self.block_table,
                                       self.seq_lens, self.topk, self.rows, **args)

    def with_(self, **kw):
        return replace(self, **kw)


def _scale(bg, kind, hkv, num_slots):
    if kind == "none":
        return None
    if kind == "scalar":
        return float(np.float32(np.exp2(rand.uniform(bg, ()) * 4 - 2)))
    return np.exp2(rand.uniform(bg, (hkv, num_slots)) * 4 - 2).astype(np.float32)


def make_case(seed, *, mode="prefill", page=16, topk=4, group=2, kv_heads=2, head_dim=8,
              fmt="e4m3fn", scales="slot", rows=1, n_req=2, max_blocks=4, layout="HND",
              pad=0, act="bfloat16", select="random", padding_requests=0, fill="nan"):
    """A random case. Everything no row may see (pages past seq_len, the tail of the last
    page, unused pages) holds NaN codes (``fill="nan"``) or max codes (``"max"``); the
    topk buffer is token-major, passed as its [Hkv, T, K] transpose, -1 in random places."""
    bg = rand.generator(seed)
    f = FORMATS[fmt]
    if f.bits == 16:
        scales = "none"
    seq = []
    qlens = []
    for _ in range(n_req):
        s = int(rand.integers(bg, max(1, rows), max_blocks * page + 1, ()))
        seq.append(s)
        qlens.append(int(rand.integers(bg, 0, min(s, 6) + 1, ())))
    if mode == "decode":
        seq = seq + [0] * padding_requests
        order = rand.permutation(bg, len(seq))
        seq = [seq[i] for i in order]
    seq = np.array(seq, dtype=np.int64)
    need = -(-seq // page)
    num_pages = int(need.sum()) + 2
    phys = rand.permutation(bg, num_pages)
    width = int(need.max(initial=0)) + 1
    bt = np.full((seq.size, width), JUNK, dtype=np.int32)
    used = 0
    for r in range(seq.size):
        bt[r, : need[r]] = phys[used: used + need[r]]
        used += need[r]
    fill_code = f.nan_code if fill == "nan" else f.max_code
    cache = empty_cache(num_pages, kv_heads, page, head_dim, fmt, layout, pad, fill_code)
    ks = _scale(bg, scales, kv_heads, num_pages * page)
    vs = _scale(bg, scales, kv_heads, num_pages * page)
    for r in range(seq.size):
        if not seq[r]:
            continue
        slots = token_slots(bt[r], np.arange(seq[r]), page)
        for g in range(kv_heads):
            for half, s in ((0, ks), (1, vs)):
                vals = rand.normal(bg, (seq[r], head_dim))
                sc = 1.0 if s is None else np.reshape(scale_at(s, g, slots), (-1, 1))
                codes = quantize(vals * sc, fmt, sc)
                cache[slots // page, g, slots % page, half * head_dim:(half + 1) * head_dim] = codes
    if mode == "prefill":
        cu = np.concatenate([[0], np.cumsum(qlens)]).astype(np.int32)
        case = Case(mode, None, cache, fmt, bt, seq, None, ks, vs, cu_seqlens_q=cu)
    else:
        case = Case(mode, None, cache, fmt, bt, seq, None, ks, vs, rows=rows)
    req, pos = case.rows_and_positions()
    n_rows = req.size
    hq = group * kv_heads
    q = round_to(2.0 * rand.normal(bg, (n_rows, hq, head_dim)), act)
    buf = np.full((n_rows, kv_heads, topk), -1, dtype=np.int32)
    for t in range(n_rows):
        for g in range(kv_heads):
            if pos[t] < 0:
                buf[t, g] = rand.integers(bg, -3, JUNK, (topk,))
                continue
            nvis = int(pos[t] // page + 1)
            if select == "all":
                assert topk >= nvis
                chosen = np.arange(nvis)
            else:
                n = int(rand.integers(bg, 1, min(topk, nvis) + 1, ()))
                chosen = rand.permutation(bg, nvis)[:n]
            slots_k = rand.permutation(bg, topk)[: chosen.size]
            buf[t, g, slots_k] = chosen
    case.q = q
    case.topk = buf.transpose(1, 0, 2)
    return case


# ----------------------------------------------------------------------------- literal form


def literal_attention(case, schedule=EXACT, softmax_scale=None):
    """The reference's literal per-row form on a case (rows and positions written out here
    from contract.md s.6). Returns (unrounded output, lse)."""
    return attn.attention_literal(case.q, case.cache, case.fmt, case.block_table,
                                  case.seq_lens, case.topk, *case.rows_and_positions(),
                                  k_scale=case.k_scale, v_scale=case.v_scale,
                                  schedule=schedule, softmax_scale=softmax_scale)


# ----------------------------------------------------------------------------- rounding


@pytest.mark.parametrize("dtype", ["bfloat16", "float16", "float32"])
def test_fast_rounding_matches_the_codec(dtype):
    """codec.round_dtype (bit tricks / NumPy casts) rounds exactly as the reference codec:
    random float64 values over the whole range, subnormals, values one float64 ulp around
    every midpoint of the target grid near 1, overflow, +-Inf and NaN."""
    bg = rand.generator(11)
    x = rand.log_uniform(bg, -140, 130, (200_000,))
    grid = decode(np.arange(0x3F00, 0x4100, dtype=np.uint16),
                  "bfloat16" if dtype == "bfloat16" else "float16")
    mids = (grid[1:] + grid[:-1]) / 2
    x = np.concatenate([x, mids, np.nextafter(mids, 0), np.nextafter(mids, 2),
                        -mids, [0.0, -0.0, np.inf, -np.inf, np.nan, 1e300, -1e300,
                                2.0**-149, 2.0**-134, 3 * 2.0**-135, 65520.0, 65519.99]])
    with np.errstate(over="ignore"):
        ours = round_dtype(x, dtype)
    theirs = round_by_table(x, dtype)
    same = (ours == theirs) | (np.isnan(ours) & np.isnan(theirs))
    assert same.all(), x[~same][:5]
    grid_2d = x[:1000].reshape(50, 20)[:, ::-1]  # any shape and strides, 0-d too
    assert np.array_equal(round_dtype(grid_2d, dtype), round_by_table(grid_2d, dtype),
                          equal_nan=True)
    assert np.shape(round_dtype(np.float64(1 + 2.0**-8 + 2.0**-30), dtype)) == ()


# ----------------------------------------------------------------------------- dense check


def _dense_torch(case):
    """Dense causal attention per request by torch's float64 SDPA on the CPU, from K/V
    gathered and dequantised by reference.kv_cache.gather_kv (heads repeated G times)."""
    req, pos = case.rows_and_positions()
    t_rows, hq, d = case.q.shape
    hkv = case.cache.shape[1]
    out = np.zeros((t_rows, hq, d))
    for r in range(case.seq_lens.size):
        mine = np.flatnonzero((req == r) & (pos >= 0))
        if not mine.size:
            continue
        keys = np.arange(case.seq_lens[r])
        kv = [gather_kv(case.cache, case.fmt, case.block_table[r], keys, g, case.k_scale,
                        case.v_scale) for g in range(hkv)]
        k = torch.tensor(np.stack([x[0] for x in kv])).repeat_interleave(hq // hkv, 0)
        v = torch.tensor(np.stack([x[1] for x in kv])).repeat_interleave(hq // hkv, 0)
        q = torch.tensor(case.q[mine]).transpose(0, 1)  # [Hq, n, D]
        mask = torch.tensor(keys[None, :] <= pos[mine][:, None])
        o = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        out[mine] = o.transpose(0, 1).numpy()
    return out


@pytest.mark.parametrize("fmt,scales", [("bfloat16", "none"), ("float16", "none"),
                                        ("e4m3fn", "slot"), ("e5m2fnuz", "scalar")])
@pytest.mark.parametrize("mode", ["prefill", "decode"])
def test_all_blocks_selected_equals_dense_causal_attention(mode, fmt, scales):
    """Selecting every visible block gives dense causal attention (torch SDPA, float64),
    GQA heads mapped qh -> qh // G; decode padding rows are zeros in both."""
    case = make_case(1, mode=mode, fmt=fmt, scales=scales, page=16, topk=6, group=3,
                     kv_heads=3, head_dim=16, rows=3, n_req=3, max_blocks=6, select="all",
                     padding_requests=1)
    assert_close(case.call(), _dense_torch(case))


# ----------------------------------------------------------------------------- fast vs literal


@st.composite
def schedules(draw):
    if draw(st.booleans()):
        return draw(st.sampled_from([EXACT, exact("bfloat16"), vllm_schedule("bfloat16"),
                                     vllm_schedule("float16", blocks_per_split=2)]))
    dt = st.sampled_from(attn.ROUNDING_DTYPES)
    tile_keys = draw(st.none() | st.sampled_from([1, 2, 4, 8, 16]))  # divides every P
    return Schedule(kv_dtype=draw(dt), p_dtype=draw(dt),
                    p_max=draw(st.sampled_from(["row", "running"])),
                    blocks_per_tile=1 if tile_keys else draw(st.integers(1, 3)),
                    blocks_per_split=draw(st.none() | st.integers(1, 4)),
                    partial_dtype=draw(dt), lse_dtype=draw(dt), out_dtype=draw(dt),
                    order="ascending" if tile_keys else draw(st.sampled_from(["ascending",
                                                                              "given"])),
                    tile_keys=tile_keys)


@st.composite
def domain_cases(draw):
    """Small cases over the whole domain of contract.md s.7 (shapes, formats, scales, modes)."""
    page = draw(st.sampled_from(PAGE_SIZES))
    kw = dict(
        mode=draw(st.sampled_from(["prefill", "decode"])),
        page=page,
        topk=draw(st.integers(*TOPK_RANGE)),
        group=draw(st.integers(*GQA_GROUP_RANGE)),
        kv_heads=draw(st.integers(*KV_HEADS_RANGE)),
        head_dim=2 * draw(st.integers(1, 12)),
        fmt=draw(st.sampled_from(ALL_FORMATS)),
        scales=draw(st.sampled_from(["none", "scalar", "slot"])),
        rows=draw(st.integers(*DECODE_ROWS_RANGE)),
        n_req=draw(st.integers(1, 2)),
        max_blocks=draw(st.integers(1, 4 if page <= 32 else 2)),
        layout=draw(st.sampled_from(["HND", "NHD"])),
        pad=draw(st.sampled_from([0, 3])),
        act=draw(st.sampled_from(ACTIVATION_DTYPES)),
        padding_requests=draw(st.integers(0, 1)),
    )
    if kw["group"] * kw["kv_heads"] > 24:  # keeps the literal form fast
        kw["group"] = max(1, 24 // kw["kv_heads"])
    return make_case(draw(st.integers(0, 2**32 - 1)), **kw), draw(schedules())


@settings(deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(domain_cases())
def test_fast_form_equals_literal_form(case_schedule):
    """The block-centric form equals the literal per-row form on random cases over the
    domain (P, K, G, Hkv incl. non powers of two, even D, all six cache formats, scalar and
    per-slot scales, HND/NHD/padded layouts, decode rows 1..4 with padding requests,
    random schedules): unrounded output, LSE, and the output rounded to out_dtype."""
    case, sched = case_schedule
    res = case.call(schedule=sched, return_details=True)
    out, lse = literal_attention(case, sched)
    assert_close(res.unrounded, out)
    finite = np.isfinite(lse)
    assert np.array_equal(finite, np.isfinite(res.lse))
    assert_close(res.lse[finite], lse[finite])
    assert np.array_equal(res.out, round_by_table(res.unrounded, sched.out_dtype), equal_nan=True)


def test_lse_is_the_log_sum_exp_of_the_scaled_logits():
    """return_details' lse is log(sum_j exp(scale * q . K_j)) over the row's keys, and the
    output does not depend on softmax_scale being passed as its default value."""
    case = make_case(3, topk=3, head_dim=8, select="random")
    res = case.call(return_details=True)
    _, lse = literal_attention(case)
    assert_close(res.lse, lse)
    assert np.array_equal(case.call(softmax_scale=1 / math.sqrt(8)), res.out)
    other = case.call(softmax_scale=0.05, return_details=True)
    assert_close(other.unrounded, literal_attention(case, softmax_scale=0.05)[0])


# ----------------------------------------------------------------------------- invariances


def test_decode_row_equals_prefill_row_at_the_same_position():
    """A decode row gives the same output as the prefill token at the same position with
    the same selection (rows_per_request 1..4)."""
    for rows in range(1, 5):
        dec = make_case(20 + rows, mode="decode", rows=rows, n_req=3, topk=5, page=16,
                        max_blocks=5, group=4)
        cu = np.arange(dec.seq_lens.size + 1, dtype=np.int32) * rows
        pre = dec.with_(mode="prefill", cu_seqlens_q=cu, rows=None)
        assert_close(dec.call(), pre.call())
        assert np.array_equal(dec.rows_and_positions()[1], pre.rows_and_positions()[1])


@pytest.mark.parametrize("fmt", ["e4m3fnuz", "bfloat16"])
def test_layouts_give_identical_results(fmt):
    """HND, NHD and padded-stride views of the same cache give bit-identical outputs."""
    base = make_case(5, fmt=fmt, page=32, max_blocks=3, kv_heads=3)
    want = base.call()
    for layout in ("HND", "NHD"):
        for pad in (0, 5):
            other = empty_cache(*base.cache.shape[:3], base.cache.shape[3] // 2, fmt, layout,
                                pad, FORMATS[fmt].nan_code)
            other[...] = base.cache
            assert np.array_equal(base.with_(cache=other).call(), want)


@pytest.mark.parametrize("mode", ["prefill", "decode"])
def test_shuffled_page_tables_give_identical_results(mode):
    """Moving pages to other physical places (cache, per-slot scales and block table
    permuted together) changes no output bit."""
    case = make_case(6, mode=mode, rows=2, n_req=3, max_blocks=4)
    num_pages, page = case.cache.shape[0], case.page
    perm = rand.permutation(rand.generator(7), num_pages)  # page i moves to perm[i]
    cache = np.empty_like(case.cache)
    cache[perm] = case.cache
    slots_old = np.arange(num_pages * page)
    slots_new = perm[slots_old // page] * page + slots_old % page

    def move(s):
        if s is None or np.ndim(s) == 0:
            return s
        out = np.empty_like(s)
        out[:, slots_new] = s
        return out

    bt = np.where(case.block_table == JUNK, JUNK, perm[np.minimum(case.block_table,
                                                                   num_pages - 1)])
    moved = case.with_(cache=cache, block_table=bt, k_scale=move(case.k_scale),
                       v_scale=move(case.v_scale))
    assert np.array_equal(moved.call(), case.call())


@pytest.mark.parametrize("sched", [EXACT, vllm_schedule("bfloat16", order="ascending",
                                                        blocks_per_split=2)])
def test_selection_order_and_minus_one_placement_do_not_matter(sched):
    """Permuting each row's topk entries (-1 entries included, so -1 lands anywhere) gives
    bit-identical results under the exact schedule and any ascending-order schedule."""
    case = make_case(8, topk=6, max_blocks=6, n_req=3)
    want = case.call(schedule=sched)
    bg = rand.generator(9)
    buf = case.topk.transpose(1, 0, 2).copy()
    for t in range(buf.shape[0]):
        for g in range(buf.shape[1]):
            buf[t, g] = buf[t, g, rand.permutation(bg, buf.shape[2])]
    assert np.array_equal(case.with_(topk=buf.transpose(1, 0, 2)).call(schedule=sched), want)
    head_major = np.ascontiguousarray(case.topk)  # same values, other strides
    assert np.array_equal(case.with_(topk=head_major).call(schedule=sched), want)


def test_given_order_schedule_follows_the_entry_order():
    """With order="given", tiles and split chunks follow the topk entry order: reversing
    each row's entries equals the literal form on the reversed entries, and differs from
    the unreversed result (the rounding points moved)."""
    case = make_case(10, topk=6, max_blocks=6, n_req=2, fmt="e4m3fn")
    sched = vllm_schedule("bfloat16", blocks_per_split=2)
    rev = case.with_(topk=case.topk[:, :, ::-1])
    got = rev.call(schedule=sched, return_details=True).unrounded
    assert_close(got, literal_attention(rev, sched)[0])
    assert not np.array_equal(got, case.call(schedule=sched, return_details=True).unrounded)


def _visible(case, only_row=None):
    """(page, head, offset) of every slot some query row (or only_row) may read."""
    req, pos = case.rows_and_positions()
    hkv, page = case.cache.shape[1], case.page
    seen = np.zeros(case.cache.shape[:3], dtype=bool)
    for t in range(req.size):
        if pos[t] < 0 or (only_row is not None and t != only_row):
            continue
        r = req[t]
        for g in range(hkv):
            for b in case.topk[g, t]:
                if b < 0:
                    continue
                keys = np.arange(b * page, min((b + 1) * page, pos[t] + 1, case.seq_lens[r]))
                slots = token_slots(case.block_table[r], keys, page)
                seen[slots // page, g, slots % page] = True
    return seen


@pytest.mark.parametrize("fill", ["nan", "max"])
@pytest.mark.parametrize("mode", ["prefill", "decode"])
@pytest.mark.parametrize("fmt", ["e4m3fn", "e5m2", "e4m3fnuz", "bfloat16"])
def test_content_no_query_may_see_changes_nothing(fmt, mode, fill):
    """Filling every slot no row may read (unselected blocks, keys past p or seq_len, unused
    pages, the tail of the last page) with NaN or max codes changes no output bit, under
    the exact and vLLM's schedules."""
    case = make_case(12, mode=mode, fmt=fmt, rows=3, n_req=3, max_blocks=4, topk=2,
                     padding_requests=1)
    code = FORMATS[fmt].nan_code if fill == "nan" else FORMATS[fmt].max_code
    poisoned = case.cache.copy()
    poisoned[~_visible(case)] = code
    for sched in (EXACT, vllm_schedule("bfloat16", blocks_per_split=1)):
        want = case.call(schedule=sched)
        got = case.with_(cache=poisoned).call(schedule=sched)
        assert np.isfinite(got).all()
        assert np.array_equal(got, want)


@pytest.mark.parametrize("mode", ["prefill", "decode"])
def test_keys_past_the_row_position_never_reach_it(mode):
    """For a row whose own block holds later keys (visible to later rows), NaN in every slot
    that row may not read leaves its output bit-identical; the later rows that do read
    them become NaN (so the poison was really there)."""
    case = make_case(13, mode=mode, rows=4, n_req=1, max_blocks=3, topk=3, page=16,
                     select="all")
    req, pos = case.rows_and_positions()
    t = 0
    assert pos[t] % case.page < case.page - 1 and pos[t] + 1 < case.seq_lens[req[t]]
    poisoned = case.cache.copy()
    poisoned[~_visible(case, only_row=t)] = FORMATS[case.fmt].nan_code
    want = case.call()
    got = case.with_(cache=poisoned).call()
    assert np.array_equal(got[t], want[t])
    assert np.isnan(got[-1]).any()


def test_padding_decode_rows_are_zero():
    """Decode requests with seq_len 0 give exactly zero rows (never NaN), whatever their
    topk and block-table rows hold, and do not change the other rows."""
    case = make_case(14, mode="decode", rows=2, n_req=2, padding_requests=2)
    req, pos = case.rows_and_positions()
    pad = pos < 0
    assert pad.sum() == 4
    bt = case.block_table.copy()
    bt[case.seq_lens == 0] = -7
    real = case.seq_lens > 0
    alone = case.with_(q=case.q[~pad], block_table=case.block_table[real],
                       seq_lens=case.seq_lens[real], topk=case.topk[:, ~pad])
    for sched in (EXACT, vllm_schedule("float16", blocks_per_split=2)):
        out = case.with_(block_table=bt).call(schedule=sched)
        assert np.array_equal(out[pad], np.zeros_like(out[pad]))
        assert not np.signbit(out[pad]).any()
        assert np.isfinite(out).all()
        assert np.array_equal(out[~pad], alone.call(schedule=sched))
    no_rows = make_case(15, mode="decode", rows=1, n_req=0, padding_requests=3)
    assert np.array_equal(no_rows.call(), np.zeros_like(no_rows.q))


def test_visible_nan_propagates_instead_of_reading_as_an_empty_row():
    """A NaN code in a key a row does see makes that row's heads of that KV head NaN
    (a NaN-aware empty-row check must not turn it into zeros)."""
    case = make_case(16, mode="decode", rows=1, n_req=1, kv_heads=2, group=2)
    t, g = 0, 1
    req, pos = case.rows_and_positions()
    b = int(case.topk[g, t][case.topk[g, t] >= 0][0])
    slot = token_slots(case.block_table[req[t]], [b * case.page], case.page)[0]
    cache = case.cache.copy()
    cache[slot // case.page, g, slot % case.page, 0] = FORMATS[case.fmt].nan_code
    out = case.with_(cache=cache).call()
    assert np.isnan(out[t, 2:4]).all() and np.isfinite(out[t, 0:2]).all()


# ----------------------------------------------------------------------------- schedule


def test_bf16_p_rounding_matches_a_loop_that_rounds_p_and_stays_within_its_ulp():
    """Rounding P to bf16 (row max) equals a plain per-row loop that rounds P before P @ V
    and sums unrounded P; it differs from exact math, by at most 2^-9 max|V| (each P has
    relative error <= 2^-9 and the output is a convex-weighted sum of V)."""
    case = make_case(17, fmt="bfloat16", topk=4, max_blocks=4, n_req=2, head_dim=16)
    sched = Schedule(p_dtype="bfloat16")
    got = case.call(schedule=sched)
    req, pos = case.rows_and_positions()
    hkv = case.cache.shape[1]
    grp = case.q.shape[1] // hkv
    want = np.zeros_like(got)
    vmax = 0.0
    for t in range(req.size):
        for qh in range(case.q.shape[1]):
            g = qh // grp
            keys = [j for b in case.topk[g, t] if b >= 0
                    for j in range(b * case.page, min((b + 1) * case.page, pos[t] + 1))]
            k, v = gather_kv(case.cache, case.fmt, case.block_table[req[t]], keys, g)
            s = (k @ case.q[t, qh]) / math.sqrt(case.q.shape[2])
            p = np.exp(s - s.max())
            want[t, qh] = (round_to(p, "bfloat16") @ v) / p.sum()
            vmax = max(vmax, float(np.abs(v).max()))
    assert_close(got, want)
    diff = np.abs(got - case.call())
    assert diff.max() > 0
    assert diff.max() <= 2.0**-9 * vmax


def test_split_k_with_one_split_equals_no_split():
    """blocks_per_split >= K (one chunk per row) equals no split: exactly with float64
    partials, and after the output rounding when partials and output share a dtype."""
    case = make_case(18, topk=4, max_blocks=4, n_req=3)
    for p_max in ("row", "running"):
        base = Schedule(p_dtype="bfloat16", p_max=p_max)
        one = replace(base, blocks_per_split=4)
        assert_close(case.call(schedule=one), case.call(schedule=base))
        b16 = replace(base, out_dtype="bfloat16")
        assert np.array_equal(case.call(schedule=replace(b16, blocks_per_split=64,
                                                         partial_dtype="bfloat16")),
                              case.call(schedule=b16))


@pytest.mark.parametrize("partial,half_ulp", [("bfloat16", 2.0**-9), ("float16", 2.0**-11),
                                              ("float32", 2.0**-24)])
def test_partial_rounding_moves_results_only_within_its_ulp(partial, half_ulp):
    """Rounding split-K partials changes the merged output by at most half an ulp of the
    partial dtype relative to max|V| (the merge is a convex combination of partials whose
    weights do not depend on the rounding), and does change it."""
    case = make_case(19, topk=6, max_blocks=6, n_req=2, head_dim=16)
    base = Schedule(blocks_per_split=2)
    a = case.call(schedule=base)
    b = case.call(schedule=replace(base, partial_dtype=partial))
    d = case.q.shape[2]
    vmax = np.abs(decode(case.cache[..., d:][_visible(case)], case.fmt)).max()
    vmax *= np.max(case.v_scale)
    subnormal = 2.0**-25  # half the fp16 subnormal step (bf16's and fp32's are smaller)
    assert 0 < np.abs(a - b).max() <= half_ulp * vmax * (1 + 1e-9) + subnormal


def test_split_k_merge_equals_unsplit_math():
    """With float64 partials and LSE, split-K (any chunk size) equals no split up to
    float64 rounding: the LSE merge is exact."""
    case = make_case(23, topk=6, max_blocks=6, n_req=2)
    want = case.call()
    for bps in (1, 2, 3, 5):
        got = case.call(schedule=Schedule(blocks_per_split=bps, lse_dtype="float64"))
        assert_close(got, want)


def test_running_max_with_one_tile_equals_row_max():
    """p_max="running" with tiles spanning the whole selection equals p_max="row", and
    with one-block tiles it equals the literal online-softmax loop."""
    case = make_case(24, topk=5, max_blocks=5, n_req=2)
    row = Schedule(p_dtype="bfloat16")
    wide = replace(row, p_max="running", blocks_per_tile=64)
    assert np.array_equal(case.call(schedule=wide), case.call(schedule=row))
    narrow = replace(row, p_max="running", blocks_per_tile=1)
    assert_close(case.call(schedule=narrow), literal_attention(case, narrow)[0])


def test_tiles_of_keys_follow_the_literal_loop_and_a_whole_block_tile_is_the_block():
    """tile_keys = P is the one-block tile; smaller tiles round P against the running max
    of each key tile (the literal loop over blocks' key tiles), which moves results of a
    bf16-P schedule (not a vacuous knob), per-slot scales and split-K included."""
    case = make_case(26, topk=5, max_blocks=5, n_req=2, page=32, scales="slot")
    block = Schedule(p_dtype="bfloat16", p_max="running", blocks_per_split=2)
    assert np.array_equal(case.call(schedule=replace(block, tile_keys=32)),
                          case.call(schedule=block))
    tiles = replace(block, tile_keys=8)
    got = case.call(schedule=tiles)
    assert_close(got, literal_attention(case, tiles)[0])
    assert not np.array_equal(got, case.call(schedule=block))


def test_key_streams_follow_the_literal_loop_and_move_rounded_results():
    """key_streams = S with tile_keys = P / S: tile i of every block in stream i, P rounded
    against the stream's own running max (the literal loop), split-K and per-slot scales
    included; it moves results of a bf16-P schedule (not a vacuous knob), changes nothing
    with unrounded P, and a schedule that does not tile P into its streams is refused."""
    case = make_case(27, topk=5, max_blocks=5, n_req=2, page=32, scales="slot")
    tiles = Schedule(p_dtype="bfloat16", p_max="running", blocks_per_split=2, tile_keys=8)
    streams = replace(tiles, key_streams=4)
    got = case.call(schedule=streams)
    assert_close(got, literal_attention(case, streams)[0])
    assert not np.array_equal(got, case.call(schedule=tiles))
    exact_p = replace(streams, p_dtype="float64")
    assert_close(case.call(schedule=exact_p), case.call(schedule=replace(exact_p,
                                                                         key_streams=1)))
    with pytest.raises(ValueError, match="key_streams"):
        case.call(schedule=replace(streams, key_streams=2))
    with pytest.raises(ValueError, match="key_streams"):
        Schedule(key_streams=2)


def test_key_tiles_with_no_query_tokens_give_an_empty_output():
    """A batch of no new tokens (hypothesis's find: an empty topk) under tile_keys: an
    empty output, not a reshape error."""
    cache = np.full((3, 1, 16, 4), 127, np.uint8)
    out = attn.sparse_attention_prefill(
        np.zeros((0, 1, 2)), cache, "e4m3fn", np.array([[2, 0]], np.int32),
        np.array([0, 0], np.int32), np.array([1]), np.zeros((1, 0, 1), np.int32),
        schedule=Schedule(tile_keys=4))
    assert out.shape == (0, 1, 2)


def test_act_dequantisation_is_exact_for_power_of_two_scales_only():
    """vLLM's K/V path (act(f32(act(code) * f32(scale)))) adds nothing for a scalar
    power-of-two scale (exact multiply) but changes results with random per-slot scales
    (the re-rounding to act that triples vLLM's error, contract.md s.6)."""
    kv_act = Schedule(kv_dtype="bfloat16")
    pow2 = make_case(25, fmt="e4m3fn", scales="none").with_(k_scale=0.5, v_scale=2.0)
    assert np.array_equal(pow2.call(schedule=kv_act), pow2.call())
    slot = make_case(25, fmt="e4m3fn", scales="slot")
    assert not np.array_equal(slot.call(schedule=kv_act), slot.call())
    assert_close(slot.call(schedule=kv_act), literal_attention(slot, kv_act)[0])


def test_schedule_constructors():
    """EXACT is all float64 with no split; exact(dt) rounds only the output; vllm_schedule
    rounds K/V, P, partials and output to act with fp32 LSE."""
    assert EXACT == Schedule() and EXACT.out_dtype == "float64"
    assert exact("float16") == Schedule(out_dtype="float16")
    v = vllm_schedule("float16", blocks_per_split=4)
    assert (v.kv_dtype, v.p_dtype, v.partial_dtype, v.out_dtype, v.lse_dtype) == (
        "float16", "float16", "float16", "float16", "float32")
    assert v.blocks_per_split == 4


# ----------------------------------------------------------------------------- validation


def _bad_calls():
    case = make_case(30, topk=3, n_req=2, max_blocks=3)
    dec = make_case(31, mode="decode", rows=2, n_req=2, max_blocks=3)
    hkv = case.cache.shape[1]
    num_pages = case.cache.shape[0]

    def topk_with(c, t, g, values):
        buf = c.topk.transpose(1, 0, 2).copy()
        buf[t, g, : len(values)] = values
        return buf.transpose(1, 0, 2)

    req, pos = case.rows_and_positions()
    last = int(pos[0] // case.page)
    bt_bad = case.block_table.copy()
    bt_bad[req[0], 0] = num_pages
    cu = case.cu_seqlens_q
    yield "q", lambda: case.with_(q=case.q[:, :-1]).call()  # Hq not a multiple of Hkv
    yield "q", lambda: case.with_(q=case.q[..., :-2]).call()
    yield "q", lambda: case.with_(q=case.q.astype(np.int64)).call()
    yield "q", lambda: dec.with_(q=dec.q[:-1], topk=dec.topk[:, :-1]).call()
    yield "kv_cache", lambda: case.with_(cache=case.cache.astype(np.uint16)).call()
    yield "kv_cache", lambda: case.with_(cache=case.cache[0]).call()
    yield "kv_fmt", lambda: case.with_(fmt="e4m3").call()
    yield "block_table", lambda: case.with_(block_table=bt_bad).call()
    yield "block_table", lambda: case.with_(block_table=case.block_table[:, :0]).call()
    yield "block_table", lambda: case.with_(block_table=case.block_table[:1]).call()
    yield "topk", lambda: case.with_(topk=topk_with(case, 0, 0, [last + 1])).call()
    yield "topk", lambda: case.with_(topk=topk_with(case, 0, hkv - 1, [last, last])).call()
    yield "topk", lambda: case.with_(topk=case.topk[:, :, :0]).call()
    yield "topk", lambda: case.with_(topk=case.topk[:, 1:]).call()
    yield "topk", lambda: case.with_(topk=case.topk.astype(np.float32)).call()
    yield "cu_seqlens_q", lambda: case.with_(cu_seqlens_q=cu + 1).call()
    yield "cu_seqlens_q", lambda: case.with_(cu_seqlens_q=cu[::-1].copy()).call()
    yield "cu_seqlens_q", lambda: case.with_(cu_seqlens_q=cu[:-1]).call()
    yield "seq_lens", lambda: case.with_(seq_lens=np.minimum(case.seq_lens,
                                                             np.diff(cu) - 1)).call()
    yield "seq_lens", lambda: case.with_(seq_lens=-case.seq_lens).call()
    yield "seq_lens", lambda: dec.with_(seq_lens=np.array([1, dec.seq_lens[1]])).call()
    yield "rows_per_request", lambda: dec.with_(rows=0).call()
    yield "rows_per_request", lambda: dec.with_(rows=5).call()
    yield "k_scale", lambda: case.call(k_scale=np.ones((hkv, 3), np.float32))
    yield "v_scale", lambda: case.call(v_scale=-1.0)
    yield "k_scale", lambda: case.with_(fmt="bfloat16", cache=case.cache.astype(np.uint16)
                                        ).call(k_scale=0.5, v_scale=None)
    yield "softmax_scale", lambda: case.call(softmax_scale=float("nan"))
    yield "softmax_scale", lambda: case.call(softmax_scale=-1.0)
    yield "schedule", lambda: case.call(schedule="vllm")
    yield "validate", lambda: case.call(validate="yes")
    yield "kv_dtype", lambda: Schedule(kv_dtype="e4m3fn")
    yield "p_max", lambda: Schedule(p_max="online")
    yield "blocks_per_split", lambda: Schedule(blocks_per_split=0)
    yield "blocks_per_tile", lambda: Schedule(blocks_per_tile=0)
    yield "order", lambda: Schedule(order="descending")
    yield "tile_keys", lambda: Schedule(tile_keys=0)
    yield "tile_keys", lambda: Schedule(tile_keys=8, order="given")
    yield "tile_keys", lambda: Schedule(tile_keys=8, blocks_per_tile=2)
    yield "tile_keys", lambda: case.call(schedule=Schedule(tile_keys=3 * case.page // 4))
    yield "act", lambda: vllm_schedule("float32")


BAD_CALLS = list(_bad_calls())


@pytest.mark.parametrize("argument,call", BAD_CALLS,
                         ids=[f"{a}-{i}" for i, (a, _) in enumerate(BAD_CALLS)])
def test_bad_input_names_the_argument(argument, call):
    """Bad input raises ValueError whose message starts with the argument's name."""
    with pytest.raises(ValueError, match=rf"^{argument}\b"):
        call()


def test_validate_false_trusts_contents():
    """validate=False skips the content checks: a repeated block counts once (the selection
    is a set), so the result equals the valid call's."""
    case = make_case(32, topk=4, n_req=1, max_blocks=3)
    buf = case.topk.transpose(1, 0, 2).copy()
    for t in range(buf.shape[0]):
        for g in range(buf.shape[1]):
            first = buf[t, g][buf[t, g] >= 0][0]
            buf[t, g] = np.where(buf[t, g] < 0, first, buf[t, g])
    dup = case.with_(topk=buf.transpose(1, 0, 2))
    with pytest.raises(ValueError, match=r"^topk\b"):
        dup.call()
    assert np.array_equal(dup.call(validate=False), case.call())


def test_act_dequantisation_rounds_through_fp32_first():
    """vLLM's scaled V is act(f32(act(code) * f32(scale))), not act(code * scale): with a
    product that fp32 rounds onto a bf16 midpoint (1 + 2^-8) while the exact product lies
    above it, the schedule's value is the even neighbour 1.0, exact math's is above."""
    mid = 1 + 2.0**-8
    x = 1.125  # e4m3fn code 0x39
    cands = np.float32(mid / x) + np.arange(-8, 9) * np.spacing(np.float32(mid / x))
    s = next(float(c) for c in cands.astype(np.float64)
             if x * c != mid and np.float32(x * c) == mid and x * c > mid)
    cache = empty_cache(1, 1, 16, 2, "e4m3fn")
    cache[0, 0, 0] = [0x39, 0x00, 0x39, 0x00]  # K = V = [1.125, 0] at slot 0
    v_scale = np.ones((1, 16), np.float32)
    v_scale[0, 0] = s
    args = (np.zeros((1, 1, 2)), cache, "e4m3fn", np.array([[0]]), np.array([0, 1]),
            np.array([1]), np.zeros((1, 1, 1), np.int32))
    sched = vllm_schedule("bfloat16")
    out = sparse_attention_prefill(*args, v_scale=v_scale, schedule=sched)
    assert out[0, 0, 0] == 1.0
    assert sparse_attention_prefill(*args, v_scale=v_scale)[0, 0, 0] == x * s
    f32 = replace(EXACT, kv_dtype="float32")
    assert sparse_attention_prefill(*args, v_scale=v_scale, schedule=f32)[0, 0, 0] == mid


@pytest.mark.parametrize("mode", ["prefill", "decode"])
def test_work_partition_does_not_change_results(mode, monkeypatch):
    """How the fast form splits its work (row chunks, unit batches, one matmul per block vs
    batched per-pair products, KV heads in threads) changes nothing beyond float64
    rounding; threads change no bit."""
    case = make_case(26, mode=mode, rows=3, n_req=3, max_blocks=5, topk=4, kv_heads=3,
                     fmt="e5m2", padding_requests=1)
    sched = vllm_schedule("bfloat16", blocks_per_split=2)
    want = case.call(schedule=sched, return_details=True).unrounded
    for chunk, unit, heavy in [(1, 1, 1), (1 << 10, 1 << 11, 1), (1 << 12, 1, 10**6)]:
        monkeypatch.setattr(attn, "_CHUNK_ELEMS", chunk)
        monkeypatch.setattr(attn, "_UNIT_ELEMS", unit)
        monkeypatch.setattr(attn, "_HEAVY_PAIRS", heavy)
        got = case.call(schedule=sched, return_details=True).unrounded
        assert_close(got, want)
        monkeypatch.setattr(attn, "_THREADED_ELEMS", 0)
        monkeypatch.setattr(attn, "THREADS", 3)
        assert np.array_equal(case.call(schedule=sched, return_details=True).unrounded, got)
        monkeypatch.setattr(attn, "THREADS", 1)


def test_fp16_q_schedule_rounds_only_far_below_the_row_max():
    """``Schedule.q_dtype = "float16"`` (``scheduled_q``): bf16 rows whose elements lie
    within 2^31 of the row's largest are unchanged (row scaling by 2^s puts the largest in
    [2^14, 2^15), where fp16's 11 bits hold bf16's 8); an element 2^40 below the largest
    vanishes, 3 x 2^-40 rounds up to fp16's subnormal grid; zero rows stay zero, a
    non-finite row keeps its Inf / NaN; the exponent is clipped so 2^s stays normal."""
    from reference.attention import Schedule, q_row_exponent, scheduled_q

    bg = np.random.default_rng(3)
    q = round_dtype(bg.normal(size=(5, 3, 64)) * np.exp2(bg.integers(-20, 20, (5, 3, 1))),
                    "bfloat16")
    q[0, 0, 1] = np.abs(q[0, 0]).max() * 2.0**-30  # 30 binades below the largest: exact
    q = round_dtype(q, "bfloat16")
    assert np.array_equal(scheduled_q(q, "float16"), q)
    assert scheduled_q(q, "given") is not None and np.array_equal(scheduled_q(q), q)
    row = np.array([[1.0, 2.0**-40, 3 * 2.0**-40, 0.0]])  # scaled by 2^14: 0.25 and 0.75
    assert np.array_equal(scheduled_q(row, "float16"), [[1.0, 0.0, 2.0**-38, 0.0]])
    assert np.array_equal(scheduled_q(np.zeros((1, 4)), "float16"), np.zeros((1, 4)))
    odd = scheduled_q(np.array([[np.inf, 1.0], [np.nan, 1.0]]), "float16")
    assert odd[0, 0] == np.inf and np.isnan(odd[1, 0])
    assert list(q_row_exponent(np.array([[2.0**-133], [2.0**127], [1.0]]))) == [126, -113, 14]
    with pytest.raises(ValueError, match="q_dtype"):
        Schedule(q_dtype="float32")


def test_bf16_q_schedule_keeps_bf16_rows_and_rounds_fp16_ones():
    """``Schedule.q_dtype = "bfloat16"`` (e5m2fnuz's operands): bf16 rows are unchanged
    (their largest scaled into [2^100, 2^101) and back, exactly), fp16 values are rounded to
    bf16's 8 significant bits (RNE: 1 + 2^-8 to 1, 1 + 3 x 2^-8 to 1 + 2^-6), and the
    row exponent targets 2^100, clipped so 2^s stays normal."""
    from reference.attention import q_row_exponent, scheduled_q

    bg = np.random.default_rng(4)
    q = round_dtype(bg.normal(size=(4, 2, 64)) * np.exp2(bg.integers(-30, 30, (4, 2, 1))),
                    "bfloat16")
    assert np.array_equal(scheduled_q(q, "bfloat16"), q)
    row = np.array([[1.0 + 2.0**-8, 1.0 + 3 * 2.0**-8, -(2.0**-20), 0.0]])
    assert np.array_equal(scheduled_q(row, "bfloat16"), [[1.0, 1.0 + 2.0**-6, -(2.0**-20), 0.0]])
    assert list(q_row_exponent(np.array([[2.0**-133], [2.0**127], [1.0]]), "bfloat16")) == [
        126, -27, 100]
