"""The end-to-end reference step (reference/pipeline.py): fused insert -> indexer -> sparse
attention on the caches just written.

Cases: a few requests with prefixes already cached (written by an earlier fused call at the
prefix positions), new tokens as packed bf16 rows, KV and index caches in shuffled pages
(the index cache with its own block table), every slot no step writes filled with the
format's NaN code, so content a row must not see would show up as NaN. fp8 KV caches carry
random per-(head, slot) scales. Inputs come from oracle/core/rand.py.
"""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch

from oracle.core import rand
from reference.attention import (
    sparse_attention_decode,
    sparse_attention_prefill,
    vllm_schedule,
)
from reference.codec import FORMATS, decode, encode, round_to
from reference.fused import fused_qknorm_rope_insert
from reference.indexer import indexer_decode, indexer_prefill
from reference.kv_cache import empty_cache, empty_index_cache, token_slots
from reference.norm_rope import KINDS, QKVLayout, rope_table
from reference.pipeline import new_token_slots, pipeline_decode, pipeline_prefill, sparse_step
from tests.helpers import assert_close

HKV, GROUP, DIM, ROT, PAGE = 2, 2, 32, 12, 16
LAYOUT = QKVLayout(HKV * GROUP, HKV, DIM, num_index_heads=HKV, has_index_k=True)
EPS = 1e-6
TABLE = rope_table(256, ROT, 5e6, "bfloat16")
# (KV format, index format) pairs: bf16, and fp8 on the OCP and fnuz platforms.
FORMAT_PAIRS = [("bfloat16", "bfloat16"), ("e4m3fn", "e4m3fn"), ("e5m2fnuz", "e4m3fnuz")]


def _rows(bg, n):
    return round_to(3.0 * rand.normal(bg, (n, LAYOUT.row_width)), "bfloat16")


def _slots(bt, seq_lens, qlens):
    """Slots of the last qlens[r] positions of each request, by kv_cache.token_slots."""
    parts = [token_slots(bt[r], np.arange(s - q, s), PAGE)
             for r, (s, q) in enumerate(zip(seq_lens, qlens, strict=True))]
    return np.concatenate(parts).astype(np.int64) if parts else np.zeros(0, np.int64)


def make_state(seed, kv_fmt, index_fmt, prefixes, max_len):
    """Caches holding the prefixes (NaN codes everywhere else) and everything a step needs
    besides its rows and lengths. Each request owns ceil(max_len / P) pages of each cache,
    shuffled, the index cache through its own block table; two spare pages stay NaN."""
    bg = rand.generator(seed)
    n_req = len(prefixes)
    width = -(-max_len // PAGE)
    num_pages = n_req * width + 2
    bt = rand.permutation(bg, num_pages)[:n_req * width].reshape(n_req, width).astype(np.int32)
    ibt = rand.permutation(bg, num_pages)[:n_req * width].reshape(n_req, width).astype(np.int32)
    kv = empty_cache(num_pages, HKV, PAGE, DIM, kv_fmt, fill_code=FORMATS[kv_fmt].nan_code)
    ic = empty_index_cache(num_pages, PAGE, DIM, index_fmt,
                           fill_code=FORMATS[index_fmt].nan_code)
    fp8 = FORMATS[kv_fmt].bits == 8
    ks = vs = None
    if fp8:
        ks = np.float32(0.5 + rand.uniform(bg, (HKV, num_pages * PAGE)))
        vs = np.float32(0.5 + rand.uniform(bg, (HKV, num_pages * PAGE)))
    weights = {kind: round_to(0.3 * rand.normal(bg, (DIM,)), "bfloat16") for kind in KINDS}
    state = dict(layout=LAYOUT, weights=weights, table=TABLE, rotary_dim=ROT, eps=EPS,
                 model_dtype="bfloat16", kv_cache=kv, kv_fmt=kv_fmt, index_cache=ic,
                 index_fmt=index_fmt, block_table=bt, index_block_table=ibt, k_scale=ks,
                 v_scale=vs)
    prefixes = np.asarray(prefixes)
    pos = np.concatenate([np.arange(p) for p in prefixes]).astype(np.int64)
    fused_qknorm_rope_insert(_rows(bg, pos.size), pos, LAYOUT, weights, TABLE, ROT, EPS,
                             "bfloat16", kv, kv_fmt, _slots(bt, prefixes, prefixes), ks, vs,
                             ic, index_fmt, _slots(ibt, prefixes, prefixes))
    return state


def fresh(state):
    """A deep copy (caches included) so that two runs start from the same content."""
    return copy.deepcopy(state)


PREFIXES, QLENS = [37, 0, 70, 16], [5, 9, 3, 1]
DEC_PREFIXES, DEC_PADDING = [41, 0, 69, 19], 1  # request 1 is a padding request


def prefill_case(seed, kv_fmt, index_fmt):
    state = make_state(seed, kv_fmt, index_fmt, PREFIXES, 80)
    seq = np.array(PREFIXES) + QLENS
    cu = np.concatenate([[0], np.cumsum(QLENS)]).astype(np.int32)
    rows = _rows(rand.generator(seed + 1000), int(cu[-1]))
    return state, dict(rows=rows, cu_seqlens_q=cu, seq_lens=seq)


def decode_case(seed, kv_fmt, index_fmt, rows_per_request):
    state = make_state(seed, kv_fmt, index_fmt, DEC_PREFIXES, 80)
    seq = np.array(DEC_PREFIXES) + rows_per_request
    seq[DEC_PADDING] = 0
    rows = _rows(rand.generator(seed + 1000), seq.size * rows_per_request)
    return state, dict(rows=rows, seq_lens=seq, rows_per_request=rows_per_request)


def _same(a, b):
    a, b = np.asarray(a), np.asarray(b)
    return a.shape == b.shape and np.array_equal(a, b, equal_nan=a.dtype.kind == "f")


# ----------------------------------------------------------------------------- composition


@pytest.mark.parametrize("kv_fmt,index_fmt", FORMAT_PAIRS)
@pytest.mark.parametrize("mode", ["prefill", "decode"])
def test_pipeline_equals_the_composition_of_the_three_calls(mode, kv_fmt, index_fmt):
    """The pipeline equals, bit for bit, the explicit composition: the fused op at the
    slots kv_cache.token_slots gives for the new positions (KV and index block tables
    separately; decode padding rows at slot -1), then the indexer on the index cache just
    written with the fused op's index_q_values, then attention of the fused q on that
    selection (EXACT, and the vLLM schedule when one is passed): same caches, fused
    outputs, selections, scores, magnitudes, outputs and LSEs."""
    rows_per_request = 3
    if mode == "prefill":
        state, step = prefill_case(1, kv_fmt, index_fmt)
    else:
        state, step = decode_case(1, kv_fmt, index_fmt, rows_per_request)
    sched = vllm_schedule("bfloat16", blocks_per_split=2 if mode == "decode" else None)
    mine = fresh(state)
    run = pipeline_prefill if mode == "prefill" else pipeline_decode
    res = run(**step, **mine, topk=3, schedule=sched)

    s = fresh(state)
    seq = step["seq_lens"]
    qlens = np.diff(step["cu_seqlens_q"]) if mode == "prefill" else np.where(
        seq > 0, rows_per_request, 0)
    live = np.repeat(qlens > 0, rows_per_request) if mode == "decode" else None
    slots, islots = _slots(s["block_table"], seq, qlens), _slots(s["index_block_table"], seq,
                                                                 qlens)
    pos = np.concatenate([np.arange(n - q, n) for n, q in zip(seq, qlens, strict=True)])
    if mode == "decode":  # padding rows: position 0, slot -1
        full = [np.full(rows_per_request, -1, np.int64)] * seq.size
        sl, isl, ps = [x.copy() for x in full], [x.copy() for x in full], [
            np.zeros(rows_per_request, np.int64) for _ in full]
        live_req = np.flatnonzero(qlens > 0)
        for i, r in enumerate(live_req):
            part = slice(i * rows_per_request, (i + 1) * rows_per_request)
            sl[r], isl[r], ps[r] = slots[part], islots[part], pos[part]
        slots, islots, pos = np.concatenate(sl), np.concatenate(isl), np.concatenate(ps)
        assert np.array_equal(res.positions >= 0, live)
    fused = fused_qknorm_rope_insert(
        step["rows"], pos, LAYOUT, s["weights"], TABLE, ROT, EPS, "bfloat16", s["kv_cache"],
        kv_fmt, slots, s["k_scale"], s["v_scale"], s["index_cache"], index_fmt, islots)
    common = dict(k_scale=s["k_scale"], v_scale=s["v_scale"], return_details=True)
    if mode == "prefill":
        idx = indexer_prefill(fused["index_q_values"], s["index_cache"], index_fmt,
                              s["index_block_table"], step["cu_seqlens_q"], seq, 3,
                              return_scores=True)
        att = [sparse_attention_prefill(fused["q"], s["kv_cache"], kv_fmt, s["block_table"],
                                        step["cu_seqlens_q"], seq, idx.topk, schedule=sc,
                                        **common) for sc in (None, sched)]
    else:
        idx = indexer_decode(fused["index_q_values"], s["index_cache"], index_fmt,
                             s["index_block_table"], seq, rows_per_request, 3,
                             return_scores=True)
        att = [sparse_attention_decode(fused["q"], s["kv_cache"], kv_fmt, s["block_table"],
                                       seq, idx.topk, rows_per_request, schedule=sc, **common)
               for sc in (None, sched)]

    assert np.array_equal(res.slot_mapping, slots)
    assert np.array_equal(res.index_slot_mapping, islots)
    assert np.array_equal(mine["kv_cache"], s["kv_cache"])
    assert np.array_equal(mine["index_cache"], s["index_cache"])
    assert res.fused["kv_cache"] is mine["kv_cache"]
    for key, value in fused.items():
        if isinstance(value, np.ndarray) and key not in ("kv_cache", "index_cache"):
            assert _same(res.fused[key], value), key
    for field in ("topk", "scores", "magnitudes", "num_visible", "positions"):
        assert _same(getattr(res.indexer, field), getattr(idx, field)), field
    assert (res.topk[:, res.positions >= 0, 0] >= 0).all()  # every live row selected
    for got, want in ((res.attention, att[0]), (res.scheduled, att[1])):
        for field in ("out", "unrounded", "lse"):
            assert _same(getattr(got, field), getattr(want, field)), field
    assert np.isfinite(res.out).all()


# ----------------------------------------------------------------------------- dense check


def _dense_torch(state, seq_lens, requests, positions, q):
    """Dense causal attention per request: torch's float64 SDPA on the CPU over the
    dequantised KV cache (keys 0..seq_len-1 read through the block table and decoded by
    the codec times their scales; GQA heads repeated G times); zeros for padding rows."""
    kv, fmt, bt = state["kv_cache"], state["kv_fmt"], state["block_table"]
    out = np.zeros(q.shape)
    for r, n in enumerate(seq_lens):
        mine = np.flatnonzero((requests == r) & (positions >= 0))
        if not mine.size:
            continue
        keys = np.arange(n)
        slots = token_slots(bt[r], keys, PAGE)
        codes = kv[slots // PAGE, :, slots % PAGE]  # [n, Hkv, 2D]
        x = decode(codes, fmt)
        ks = 1.0 if state["k_scale"] is None else state["k_scale"][:, slots].T[..., None]
        vs = 1.0 if state["v_scale"] is None else state["v_scale"][:, slots].T[..., None]
        k = torch.tensor((x[..., :DIM] * ks).transpose(1, 0, 2)).repeat_interleave(GROUP, 0)
        v = torch.tensor((x[..., DIM:] * vs).transpose(1, 0, 2)).repeat_interleave(GROUP, 0)
        qt = torch.tensor(q[mine]).transpose(0, 1)
        mask = torch.tensor(keys[None, :] <= positions[mine][:, None])
        o = torch.nn.functional.scaled_dot_product_attention(qt, k, v, attn_mask=mask)
        out[mine] = o.transpose(0, 1).numpy()
    return out


@pytest.mark.parametrize("kv_fmt,index_fmt", FORMAT_PAIRS)
@pytest.mark.parametrize("mode", ["prefill", "decode"])
def test_topk_covering_every_visible_block_is_dense_causal_attention(mode, kv_fmt, index_fmt):
    """With topk >= the number of visible blocks, the indexer selects every visible block
    (0 .. p//P, no -1 among the first p//P + 1 entries) and the pipeline's attention equals
    dense causal attention computed independently (torch float64 SDPA over the dequantised
    cache the fused op wrote), although every unwritten slot holds NaN codes."""
    if mode == "prefill":
        state, step = prefill_case(2, kv_fmt, index_fmt)
    else:
        state, step = decode_case(2, kv_fmt, index_fmt, 2)
    run = pipeline_prefill if mode == "prefill" else pipeline_decode
    res = run(**step, **state, topk=6)  # the longest request has 73 tokens: 5 blocks
    nv = res.indexer.num_visible
    for t in range(nv.size):
        for h in range(HKV):
            sel = res.topk[h, t]
            assert sorted(sel[:nv[t]]) == list(range(nv[t])) and (sel[nv[t]:] == -1).all()
    dense = _dense_torch(state, step["seq_lens"], res.requests, res.positions,
                         res.fused["q"])
    assert_close(res.out, dense)
    if mode == "decode":
        assert (res.out[res.positions < 0] == 0).all()


# ----------------------------------------------------------------------------- decode = prefill


@pytest.mark.parametrize("rows_per_request", [1, 2, 3, 4])
@pytest.mark.parametrize("kv_fmt,index_fmt", FORMAT_PAIRS[:2])
def test_decode_of_the_last_tokens_equals_their_prefill(kv_fmt, index_fmt, rows_per_request):
    """Prefilling every request's new tokens in one step, and prefilling all but the last
    rows_per_request of them then decoding those, leave bit-identical caches, and the
    decode rows get the same fused outputs (bit-equal), the same selections and the same
    scores and attention outputs (up to float64 summation order) as the prefill's rows at
    the same positions (the prefill's other tokens being causally invisible to them)."""
    n = rows_per_request
    qlens = np.array([5, 4, 6, 4])
    state = make_state(3, kv_fmt, index_fmt, PREFIXES, 80)
    seq = np.array(PREFIXES) + qlens
    rows = _rows(rand.generator(7), int(qlens.sum()))
    cu = np.concatenate([[0], np.cumsum(qlens)]).astype(np.int32)
    whole = fresh(state)
    pre = pipeline_prefill(rows, cu, seq, **whole, topk=3)

    split = fresh(state)
    first = np.concatenate([np.arange(cu[r], cu[r + 1] - n) for r in range(seq.size)])
    last = np.concatenate([np.arange(cu[r + 1] - n, cu[r + 1]) for r in range(seq.size)])
    cu1 = np.concatenate([[0], np.cumsum(qlens - n)]).astype(np.int32)
    pipeline_prefill(rows[first], cu1, seq - n, **split, topk=3)
    dec = pipeline_decode(rows[last], seq, n, **split, topk=3)

    assert np.array_equal(split["kv_cache"], whole["kv_cache"])
    assert np.array_equal(split["index_cache"], whole["index_cache"])
    assert np.array_equal(dec.positions, pre.positions[last])
    assert np.array_equal(dec.slot_mapping, pre.slot_mapping[last])
    for key in ("q", "k", "v", "index_q", "index_k", "index_q_values", "k_exact"):
        assert np.array_equal(dec.fused[key], pre.fused[key][last]), key
    assert np.array_equal(dec.topk, pre.topk[:, last])
    nv = dec.indexer.num_visible
    for i, t in enumerate(last):
        assert_close(dec.indexer.scores[:, i, :nv[i]], pre.indexer.scores[:, t, :nv[i]])
    assert_close(dec.out, pre.out[last])
    assert_close(dec.attention.lse, pre.attention.lse[last])


# ----------------------------------------------------------------------------- formats


@pytest.mark.parametrize("kv_fmt,index_fmt", [("bfloat16", "bfloat16"), ("bfloat16", "e4m3fn"),
                                              ("e4m3fn", "bfloat16"), ("e4m3fn", "e4m3fn"),
                                              ("e5m2", "e4m3fn"), ("e4m3fnuz", "e4m3fnuz")])
def test_bf16_and_fp8_caches_both_run_and_write_only_the_new_slots(kv_fmt, index_fmt):
    """bf16 and fp8 caches (any mix of KV and index format) run end to end: the new tokens'
    slots hold the codes of the fused K (from its exact value over the slot's scale), V and
    index_k; every other slot is unchanged; index_q reaches the indexer in the index
    cache's format; outputs are finite (no NaN from unwritten slots)."""
    state, step = prefill_case(4, kv_fmt, index_fmt)
    before = fresh(state)
    res = pipeline_prefill(**step, **state, topk=2)
    kv, ic = state["kv_cache"], state["index_cache"]
    slots, islots = res.slot_mapping, res.index_slot_mapping
    pg, off = slots // PAGE, slots % PAGE
    fp8 = FORMATS[kv_fmt].bits == 8
    for g in range(HKV):
        ks = state["k_scale"][g, slots] if fp8 else 1.0
        vs = state["v_scale"][g, slots] if fp8 else 1.0
        k_want = encode(res.fused["k_exact"][:, g] / np.reshape(ks, (-1, 1)), kv_fmt,
                        "satfinite" if fp8 else "nonsaturating")
        v_want = encode(res.fused["v"][:, g] / np.reshape(vs, (-1, 1)), kv_fmt,
                        "satfinite" if fp8 else "nonsaturating")
        assert np.array_equal(kv[pg, g, off, :DIM], k_want)
        assert np.array_equal(kv[pg, g, off, DIM:], v_want)
    i_fp8 = FORMATS[index_fmt].bits == 8
    assert np.array_equal(ic[islots // PAGE, islots % PAGE],
                          encode(res.fused["index_k_exact"], index_fmt,
                                 "satfinite" if i_fp8 else "nonsaturating"))
    assert res.fused["index_q_fmt"] == (index_fmt if i_fp8 else "bfloat16")
    kv_mask = np.ones(kv.shape[:3], bool)
    kv_mask[pg, :, off] = False
    assert np.array_equal(kv[kv_mask], before["kv_cache"][kv_mask])
    ic_mask = np.ones(ic.shape[:2], bool)
    ic_mask[islots // PAGE, islots % PAGE] = False
    assert np.array_equal(ic[ic_mask], before["index_cache"][ic_mask])
    assert np.isfinite(res.out).all()
    nv = res.indexer.num_visible
    assert all(np.isfinite(res.indexer.scores[:, t, :nv[t]]).all() for t in range(nv.size))


# ----------------------------------------------------------------------------- slots, errors


def test_new_token_slots_follow_the_block_table():
    """new_token_slots gives block_table[r, p // P] * P + p % P (kv_cache.token_slots of
    the row's request) and -1 for padding rows (position -1)."""
    bg = rand.generator(9)
    bt = rand.permutation(bg, 12).reshape(3, 4)
    req = np.array([0, 0, 1, 2, 2, 1])
    pos = np.array([0, 63, 17, -1, 40, 5])
    got = new_token_slots(bt, req, pos, 16, 12)
    want = [token_slots(bt[r], [p], 16)[0] if p >= 0 else -1 for r, p in zip(req, pos,
                                                                            strict=True)]
    assert got.tolist() == want


def _bad_steps():
    state, step = prefill_case(5, "e4m3fn", "e4m3fn")
    bt = state["block_table"].copy()
    bt[0, 2] = 999  # request 0 writes positions 37..41: block 2
    small = empty_index_cache(state["index_cache"].shape[0], 2 * PAGE, DIM, "e4m3fn")
    wide = QKVLayout(HKV * GROUP, HKV, DIM, num_index_heads=1, has_index_k=True)
    return state, step, [
        (dict(block_table=bt), "block_table"),
        (dict(index_cache=small), "index_cache"),
        (dict(layout=wide), "layout"),
        (dict(topk=0), "topk"),
        (dict(topk=65), "topk"),
        (dict(schedule="vllm"), "schedule"),
        (dict(seq_lens=step["seq_lens"] - 1), "seq_lens"),
    ]


@pytest.mark.parametrize("case", range(7))
def test_bad_input_raises_before_anything_is_written(case):
    """Bad block tables, a page-size mismatch between the caches, Hi != Hkv, topk out of
    1..64, a non-Schedule schedule and seq_lens shorter than the new tokens raise
    ValueError naming the argument, and neither cache changes."""
    state, step, bad = _bad_steps()
    change, name = bad[case]
    args = {**fresh(state), "topk": 2, **step, **change}
    kv, ic = args["kv_cache"].copy(), args["index_cache"].copy()
    with pytest.raises(ValueError, match=name):
        sparse_step("prefill", **args)
    assert np.array_equal(args["kv_cache"], kv) and np.array_equal(args["index_cache"], ic)


def test_mode_arguments_are_checked():
    """Prefill needs cu_seqlens_q and refuses rows_per_request; decode the reverse; an
    unknown mode is refused."""
    state, step = prefill_case(6, "bfloat16", "bfloat16")
    with pytest.raises(ValueError, match="cu_seqlens_q"):
        sparse_step("prefill", step["rows"], step["seq_lens"], **state, topk=2)
    with pytest.raises(ValueError, match="rows_per_request"):
        sparse_step("prefill", **step, **state, topk=2, rows_per_request=1)
    with pytest.raises(ValueError, match="mode"):
        sparse_step("verify", step["rows"], step["seq_lens"], **state, topk=2)
    with pytest.raises(ValueError, match="rows_per_request"):
        sparse_step("decode", step["rows"], step["seq_lens"], **state, topk=2,
                    rows_per_request=5)
