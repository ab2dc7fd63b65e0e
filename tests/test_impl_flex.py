"""oracle/impls/flex.py: PyTorch's flex_attention as a peer implementation of the sparse
attention ops, judged by the same oracle as the kernels (formats, scales, ragged batches,
decode rows and padding, selections as sets, NaN content no row may see), and the pieces
it is made of (the gather, the selection mask, the BlockMask). On the CPU flex_attention
runs eagerly in fp32; on a GPU compiled, with its own declared schedule.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

pytest.importorskip("torch.nn.attention.flex_attention")

from torch.nn.attention.flex_attention import flex_attention  # noqa: E402

from oracle.core import rand
from oracle.core.cases import Case  # noqa: E402
from oracle.core.checks import run_check  # noqa: E402
from oracle.core.registry import implementations  # noqa: E402
from oracle.impls import flex as impl_flex  # noqa: E402
from oracle.impls.io import HALF_DTYPES, device  # noqa: E402
from oracle.impls.io import codes_in as _codes_in  # noqa: E402
from reference.attention import prefill_positions  # noqa: E402
from reference.codec import decode  # noqa: E402
from tests.helpers import (  # noqa: E402
    PAGED_ATTENTION_FORMATS,
    poison_unselected,
    shuffled_selections,
)
from tests.test_kernel_attention_prefill import _KV_DTYPE, make_inputs  # noqa: E402


def _impl(op="attention_prefill"):
    (impl,) = implementations(op, ["flex"])
    return impl


def _passes(x, op="attention_prefill"):
    fmt = x["kv_fmt"]
    sc = "none" if x["k_scale"] is None else ("tensor" if np.ndim(x["k_scale"]) == 0 else "slot")
    case = Case(op, "tiny", "normal", "rocm-fnuz" if "fnuz" in fmt else "cuda", _KV_DTYPE[fmt],
                x["model_dtype"], sc, 0)
    res = run_check(case, _impl(op), inputs=x)
    assert res.passed, res.summary()
    assert res.tally.elements == np.asarray(x["q"]).size
    return res


def _decode_inputs(seq_lens, rows, **kw):
    """An attention_decode input set: the prefill inputs of requests with ``rows`` new tokens
    each, padding requests (seq_len 0) given ``rows`` rows of zeros and -1 selections."""
    seq = np.asarray(seq_lens)
    live = seq > 0
    x = make_inputs(seq_lens=tuple(seq[live]), qlens=(rows,) * int(live.sum()), **kw)
    hkv, _, k = x["topk"].shape
    q = np.zeros((seq.size * rows,) + x["q"].shape[1:])
    topk = np.full((hkv, seq.size * rows, k), -1, np.int32)
    table = np.full((seq.size, x["block_table"].shape[1]), -1, np.int32)
    dst = np.repeat(live, rows)
    q[dst], topk[:, dst], table[live] = x["q"], x["topk"], x["block_table"]
    x.pop("cu_seqlens_q")
    return dict(x, q=q, topk=topk, block_table=table, seq_lens=seq, rows_per_request=rows)


# ------------------------------------------------------------------------ the oracle


def test_registered_for_both_ops_with_the_schedule_it_computes():
    """Registered as "flex" of attention_prefill and attention_decode for cpu and cuda; the
    schedule is the compiled kernel's (act K/V and P, running max over one block per tile,
    ascending) on CUDA, the eager fp32 path's (act K/V, fp32 P, act output) elsewhere."""
    for op in ("attention_prefill", "attention_decode"):
        impl = _impl(op)
        assert impl.devices == ("cpu", "cuda")
        s = impl.schedule("bfloat16")
        assert (s.kv_dtype, s.out_dtype, s.blocks_per_split) == ("bfloat16", "bfloat16", None)
        if torch.cuda.is_available():
            assert (s.p_dtype, s.p_max, s.blocks_per_tile, s.order) == (
                "bfloat16", "running", 1, "ascending")
        else:
            assert s.p_dtype == "float64" and impl.shape_classes == ("tiny",)


# The kernels' format/layout/scale cases, one per cache format (flex's CPU path is slow).
FLEX_FORMATS = [PAGED_ATTENTION_FORMATS[i] for i in (0, 1, 4, 7, 8, 10)]


@pytest.mark.parametrize("kv_fmt, md, layout, pad, scales", FLEX_FORMATS)
def test_prefill_matches_reference(kv_fmt, md, layout, pad, scales):
    """Every cache format, layouts, random scalar and per-slot scales (k_scale != v_scale),
    Hkv = 3, G = 2, a ragged batch of three requests with prefixes 31, 0 and 43 in one flex
    call: admitted by the oracle for the declared schedule."""
    x = make_inputs(kv_fmt, md, layout, pad, scales, hkv=3, seq_lens=(37, 9, 50),
                    qlens=(6, 9, 7), k=3, seed=len(kv_fmt) + pad)
    _passes(x)


@pytest.mark.parametrize("group, hkv, kv_fmt", [(1, 3, "e4m3fn"), (8, 2, "bfloat16"),
                                                (3, 1, "e5m2fnuz")])
def test_prefill_groups_match_reference(group, hkv, kv_fmt):
    """GQA groups 1, 3 and 8 (enable_gqa: query head qh reads KV head qh // G), Hkv not a
    power of two, four requests: admitted by the oracle."""
    x = make_inputs(kv_fmt, "bfloat16", "NHD", 8, "slot" if kv_fmt.startswith("e") else "none",
                    hkv=hkv, group=group, seq_lens=(61, 23, 44, 80), qlens=(9, 3, 12, 7), k=4,
                    seed=group)
    _passes(x)


@pytest.mark.parametrize("rows, kv_fmt", [(1, "e4m3fn"), (3, "bfloat16")])
def test_decode_matches_reference_and_pads_with_zeros(rows, kv_fmt):
    """attention_decode: 1 or 3 rows per request (each with its own selection and causal
    position) and a padding request (seq_len 0) in the middle, whose rows are zeros."""
    x = _decode_inputs((37, 0, 50), rows, kv_fmt=kv_fmt, scales="slot" if kv_fmt != "bfloat16"
                       else "none", hkv=2, group=2, k=3, seed=rows)
    _passes(x, "attention_decode")
    out = decode(impl_flex.run(x)["out"], "bfloat16")
    assert not out[rows:2 * rows].any()


def test_nan_content_no_row_sees_does_not_leak():
    """Blocks no token selected hold NaN codes, as do keys past seq_len and other pages:
    the gather zeroes every key no row sees, so the output is admitted and finite."""
    x = make_inputs("e4m3fnuz", "bfloat16", scales="slot", seq_lens=(90, 47), qlens=(6, 11),
                    k=3, seed=4)
    cu = x["cu_seqlens_q"]
    x = poison_unselected(x, [(cu[r], cu[r + 1]) for r in range(2)])
    _passes(x)
    assert np.isfinite(decode(impl_flex.run(x)["out"], "bfloat16")).all()


def test_selection_is_a_set():
    """Permuted entries, -1 entries moved anywhere and a repeated entry give bit-identical
    outputs: the mask is built from each row's set of valid entries."""
    x = make_inputs("e5m2", "bfloat16", scales="tensor", seq_lens=(70, 33), qlens=(10, 6), k=6,
                    seed=9)
    base = impl_flex.run(x)["out"]
    for seed, dup in ((1, False), (2, True)):
        topk = shuffled_selections(x["topk"], seed, dup)
        assert np.array_equal(impl_flex.run(dict(x, topk=topk))["out"], base)


# ------------------------------------------------------------------------- the pieces


def _pieces(x):
    seq = np.asarray(x["seq_lens"])
    page = x["kv_cache"].shape[2]
    req, pos = prefill_positions(x["cu_seqlens_q"], seq, x["q"].shape[0])
    sel, qend = impl_flex.selection_mask(x["topk"], req, pos, seq, page)
    return seq, page, req, pos, sel, qend


def test_mask_mod_is_the_selection_with_the_causal_cut():
    """The BlockMask's mask_mod, evaluated on every (head, row, key), is exactly "the key's
    block is in the row's selection (through KV head h // G), the key at or before the
    row's position, in the row's request"; the block lists are the per-query-block unions
    of the selections in ascending order, and no block is "full"."""
    x = make_inputs("bfloat16", hkv=2, group=3, seq_lens=(40, 70), qlens=(9, 20), k=3, seed=2)
    seq, page, req, pos, sel, qend = _pieces(x)
    blk0 = impl_flex.block_offsets(seq, page)
    bm = impl_flex.build_block_mask(torch.from_numpy(sel), torch.from_numpy(qend), 3, page,
                                    sel.shape[2] * page)
    t, length = x["q"].shape[0], int(blk0[-1]) * page
    h, qi, kv = np.meshgrid(np.arange(6), np.arange(t), np.arange(length), indexing="ij")
    got = bm.mask_mod(0, torch.from_numpy(h), torch.from_numpy(qi), torch.from_numpy(kv))
    want = np.zeros((6, t, length), bool)
    for head in range(6):
        for row in range(t):
            r, p = req[row], pos[row]
            for e in x["topk"][head // 3, row]:
                if 0 <= e <= p // page:
                    j = np.arange(e * page, min((e + 1) * page, p + 1))
                    want[head, row, blk0[r] * page + j] = True
    assert np.array_equal(got.numpy(), want)
    assert bm.full_kv_num_blocks is None
    num, idx = bm.kv_num_blocks[0].numpy(), bm.kv_indices[0].numpy()
    for head in range(6):
        rows = sel[head // 3]
        union = np.flatnonzero(rows[:128].any(0))
        assert num[head, 0] == union.size
        assert np.array_equal(idx[head, 0, :union.size], union)


def _synthetic_selection(t=300, nb=48, page=8, seed=5):
    """A selection over ``nb`` key blocks for ``t`` rows at positions 160.. (2 KV heads):
    each (row, block) selected with probability 7/8, and per KV head some blocks selected
    by every row, so whole query blocks hold full and partial blocks alike."""
    g = rand.generator(seed)
    sel = rand.uniform(g, (2, t, nb)) < 0.875
    sel[0, :, 3] = sel[1, :, 5:9] = True
    sel[1, :, 30] = sel[0, :, 40] = True  # past query block 0's first row; 40 past all
    qend = 160 + np.arange(t)
    qend[290] = -1  # a row that sees nothing
    return torch.from_numpy(sel), torch.from_numpy(qend), page


def test_full_blocks_are_exactly_those_whose_mask_holds_everywhere():
    """full_blocks marks (KV head, query block, key block) full iff the query block's 128
    rows are all in the batch and mask_mod holds for every (row, key) of the pair (brute
    force over the mask); the case has full and non-full pairs, and a row seeing nothing."""
    sel, qend, page = _synthetic_selection()
    got = impl_flex.full_blocks(sel, qend, page).numpy()
    hkv, t, nb = sel.shape
    q = impl_flex.Q_BLOCK
    want = np.zeros((hkv, -(-t // q), nb), bool)
    for g in range(hkv):
        for qb in range(want.shape[1]):
            rows = np.arange(qb * q, (qb + 1) * q)
            if rows[-1] >= t:
                continue
            for kb in range(nb):
                keys = np.arange(kb * page, (kb + 1) * page)
                want[g, qb, kb] = bool((sel[g, rows, kb].numpy()[:, None]
                                        & (keys[None, :] <= qend[rows].numpy()[:, None])).all())
    assert np.array_equal(got, want)
    assert want[1, 1, 30] and not want[1, 0, 30] and not want[0, :, 40].any()
    assert want.sum() >= 10 and (~want[:, :2]).sum() > 0


def test_full_block_mask_lists_partial_and_full_apart_with_the_same_attention():
    """With full=True the BlockMask's partial and full lists are disjoint, ascending, and
    together the unions of full=False; flex_attention (eager, fp32) gives the same output
    with either mask (to fp32 rounding: the online order differs)."""
    sel, qend, page = _synthetic_selection()
    hkv, t, nb = sel.shape
    group, num_keys = 2, nb * page
    part = impl_flex.build_block_mask(sel, qend, group, page, num_keys)
    full = impl_flex.build_block_mask(sel, qend, group, page, num_keys, full=True)
    for h in range(hkv * group):
        for qb in range(part.kv_num_blocks.shape[2]):
            union = part.kv_indices[0, h, qb, :part.kv_num_blocks[0, h, qb]].tolist()
            p_ids = full.kv_indices[0, h, qb, :full.kv_num_blocks[0, h, qb]].tolist()
            f_ids = full.full_kv_indices[0, h, qb, :full.full_kv_num_blocks[0, h, qb]].tolist()
            assert p_ids == sorted(p_ids) and f_ids == sorted(f_ids)
            assert not set(p_ids) & set(f_ids) and sorted(p_ids + f_ids) == union
    assert int(full.full_kv_num_blocks.sum()) > 0
    g = rand.generator(9)
    q, k, v = (torch.from_numpy(rand.normal(g, (1, n, length, 16)).astype(np.float32))
               for n, length in ((hkv * group, t), (hkv, num_keys), (hkv, num_keys)))
    a = flex_attention(q, k, v, block_mask=part, enable_gqa=True)
    b = flex_attention(q, k, v, block_mask=full, enable_gqa=True)
    live = qend.numpy() >= 0
    torch.testing.assert_close(b[:, :, live], a[:, :, live], rtol=1e-5, atol=1e-6)


def test_gather_dequantises_and_zeroes_what_no_row_sees():
    """The gathered K/V hold act(fp32(decode(code) * scale)) for every key some row sees
    and exact zeros elsewhere (keys past seq_len, blocks nobody selected, keys past the
    last position of the rows selecting their block), whatever the cache holds there."""
    from oracle.core.attention_bound import scheduled_kv

    x = make_inputs("e4m3fn", "bfloat16", "NHD", 8, "slot", hkv=2, seq_lens=(40, 70),
                    qlens=(3, 5), k=2, seed=3)
    seq, page, req, pos, sel, qend = _pieces(x)
    seen = impl_flex.seen_keys(sel, qend, page)
    assert not seen.all() and seen.any()
    k, v = impl_flex.gather_kv(_codes_in(x["kv_cache"], device()), "e4m3fn", x["block_table"],
                               seq, x["k_scale"], x["v_scale"], HALF_DTYPES["bfloat16"], seen)
    k, v = k.cpu(), v.cpu()
    blk0 = impl_flex.block_offsets(seq, page)
    for r in range(seq.size):
        j = np.arange(int(seq[r]))
        pages = x["block_table"][r, j // page].astype(np.int64)
        slots = pages * page + j % page
        for g in range(2):
            codes = x["kv_cache"][pages, g, j % page]
            want_k = scheduled_kv(codes[:, :64], "e4m3fn", x["k_scale"][g, slots][:, None],
                                  "bfloat16")
            want_v = scheduled_kv(codes[:, 64:], "e4m3fn", x["v_scale"][g, slots][:, None],
                                  "bfloat16")
            cols = blk0[r] * page + j
            vis = seen[g, cols][:, None]
            assert np.array_equal(k[0, g, cols].float().numpy(), np.where(vis, want_k, 0.0))
            assert np.array_equal(v[0, g, cols].float().numpy(), np.where(vis, want_v, 0.0))
    tail = np.setdiff1d(np.arange(k.shape[2]), np.concatenate(
        [blk0[r] * page + np.arange(int(seq[r])) for r in range(seq.size)]))
    assert tail.size and not k[0, :, tail].any() and not v[0, :, tail].any()


@pytest.mark.parametrize("page, d, smaller", [(16, 64, False), (64, 256, True),
                                              (128, 128, True), (128, 256, True)])
def test_compiled_options_keep_the_schedule_and_shrink_large_tiles(page, d, smaller):
    """The compiled flex kernel's options keep what the declared schedule assumes (the
    attention template, ``BLOCK_N = P``) and, where flex's default tiles asked for more
    shared memory than the H200 has (P x D >= 128 x 128: 228 KiB on 2026-11-30), take
    64-row query tiles and fewer stages (1 past 128 x 128)."""
    from oracle.impls.flex import default_kernel_options

    opts = default_kernel_options(page, d)
    assert opts["FORCE_USE_FLEX_ATTENTION"] is True and opts["BLOCK_N"] == page
    assert ("BLOCK_M" in opts) == smaller
    if smaller:
        assert opts["BLOCK_M"] == 64
        assert opts["num_stages"] == (2 if page * d == 128 * 128 else 1)
