"""kernels/attention_prefill.py: every cache format, layouts, scales, GQA groups, ragged
multi-request batches with prefixes that are not multiples of P, tiles of several tokens,
selections as sets, NaN/Inf content a row must not see, guarded bad contents and host
validation, judged by the oracle (oracle.core.checks.run_check) against the reference run with
the kernel's declared schedule. Runs the kernel in the (patched) CPU interpreter when no
CUDA device is present (conftest.py sets TRITON_INTERPRET=1), compiled on a GPU otherwise.
"""

from __future__ import annotations

import functools
from dataclasses import replace

import numpy as np
import pytest
import torch

from kernels import attention_prefill as ap
from oracle.core.cases import Case
from oracle.core.checks import Tally, run_check
from oracle.core.registry import implementations
from oracle.impls.torch_peer import HALF_DTYPES, device
from oracle.impls.triton import run_attention_prefill as run_prefill
from reference import attention
from reference.codec import FORMATS, decode
from tests.helpers import (
    PAGED_ATTENTION_BAD_ARGS,
    PAGED_ATTENTION_FORMATS,
    bad_args,
    paged_attention_inputs,
    poison_unselected,
    set_entry,
    shuffled_selections,
    smallest_codes,
)

pytestmark = pytest.mark.interp

_KV_DTYPE = {"bfloat16": "bfloat16", "float16": "float16", "e4m3fn": "fp8",
             "e4m3fnuz": "fp8", "e5m2": "fp8_e5m2", "e5m2fnuz": "fp8_e5m2"}


def make_inputs(kv_fmt="bfloat16", md="bfloat16", layout="HND", pad=0, scales="none", hkv=2,
                group=2, d=64, page=16, seq_lens=(37,), qlens=(5,), k=2, seed=0):
    """An oracle input set of op attention_prefill (oracle.core.cases' keys), built by hand so
    the format, layout, scales, shape and the ragged batch (seq_lens, query lengths) can be
    chosen. Everything but the keys of the requests (other pages, the tail of the last
    page) holds the format's NaN code; selections come from oracle.core.cases.random_selections
    (random sets, the token's own block always in, -1 entries scattered anywhere, random
    order). Scales: random float32 (never powers of two), k_scale != v_scale."""
    seq = np.asarray(seq_lens, np.int64)
    qlen = np.asarray(qlens, np.int64)
    assert seq.shape == qlen.shape and (qlen <= seq).all()

    def positions_of(seq):
        return np.concatenate([np.arange(s - n, s) for s, n in zip(seq, qlen)]
                              + [np.zeros(0, np.int64)])

    x = paged_attention_inputs(positions_of, kv_fmt, md, layout, pad, scales, hkv, group, d,
                               page, seq_lens, k, seed)
    return dict(x, cu_seqlens_q=np.concatenate([[0], np.cumsum(qlen)]).astype(np.int32))



def _case(x):
    fmt = x["kv_fmt"]
    sc = "none" if x["k_scale"] is None else ("tensor" if np.ndim(x["k_scale"]) == 0 else "slot")
    return Case("attention_prefill", "tiny", "normal", "rocm-fnuz" if "fnuz" in fmt else "cuda",
                _KV_DTYPE[fmt], x["model_dtype"], sc, 0)


def _impl(**knobs):
    """The registered implementation, run with the launcher's ``knobs`` (block_rows,
    delegate_ratio)."""
    (impl,) = implementations("attention_prefill", ["triton"])
    knobs = {k: v for k, v in knobs.items() if v is not None}
    if not knobs:
        return impl
    return replace(impl, run=functools.partial(run_prefill, **knobs))


def _passes(x, block_rows=None, **knobs):
    res = run_check(_case(x), _impl(block_rows=block_rows, **knobs), inputs=x)
    assert res.passed, res.summary()
    assert res.tally.elements == np.asarray(x["q"]).size
    return res


def _out(x, block_rows=None, validate=True, **knobs):
    """The kernel's output values (float64) for an input set."""
    return decode(run_prefill(x, validate=validate, block_rows=block_rows, **knobs)["out"],
                  x["model_dtype"])


# ----------------------------------------------------------------- formats and shapes


@pytest.mark.parametrize("kv_fmt, md, layout, pad, scales", PAGED_ATTENTION_FORMATS)
def test_every_format_layout_and_scale_matches_reference(kv_fmt, md, layout, pad, scales):
    """For every cache format (bf16 and fp16, also read by the other activation dtype, and
    the four fp8 formats), HND/NHD and padded layouts, none/tensor/per-slot scales (random,
    k_scale != v_scale), Hkv = 3, a ragged batch of three requests with prefixes 31, 0 (a
    whole prompt) and 43 (not multiples of P) whose new tokens straddle block boundaries,
    the output is what the oracle admits for the declared schedule."""
    x = make_inputs(kv_fmt, md, layout, pad, scales, hkv=3, seq_lens=(37, 9, 50),
                    qlens=(6, 9, 7), k=3, seed=len(kv_fmt) + pad + len(md))
    _passes(x)


@pytest.mark.parametrize("md", ["bfloat16", "float16"])
@pytest.mark.parametrize("fmt", ["e4m3fnuz", "e5m2fnuz"])
def test_fnuz_subnormal_codes_match_reference(md, fmt):
    """A fnuz cache of subnormal and smallest normal codes only, scalar scales (the 16-bit
    operand path: fp16 for e4m3fnuz, bf16 values / 2^111 for e5m2fnuz, bf16 subnormals in
    the tensor cores): the output is what the oracle admits, i.e. the smallest operands
    are neither flushed nor rounded on their way into the products."""
    x = make_inputs(fmt, md, "HND", 0, "tensor", hkv=2, seq_lens=(37, 50),
                    qlens=(5, 9), k=3, seed=11)
    _passes(smallest_codes(x, 11))


@pytest.mark.parametrize("group, hkv, block_rows, kv_fmt", [
    (1, 3, 16, "e4m3fn"),
    (1, 1, 64, "bfloat16"),
    (2, 3, 16, "e5m2fnuz"),
    (2, 2, 32, "float16"),
    (8, 3, 32, "e4m3fnuz"),
    (8, 2, 64, "e4m3fn"),
    (3, 1, 16, "e5m2"),
])
def test_groups_and_tiles_match_reference(group, hkv, block_rows, kv_fmt):
    """GQA groups G in {1, 2, 3, 8} (query head qh reads KV head qh // G; G = 3 padded to
    4 heads per token), Hkv not a power of two, tiles of 4..64 tokens (16..64 rows) that
    start mid-request (cu_seqlens_q not multiples of the tile) and requests spanning
    several tiles: the output is admitted by the oracle."""
    x = make_inputs(kv_fmt, "bfloat16", "NHD", 8, "slot" if kv_fmt.startswith("e") else "none",
                    hkv=hkv, group=group, seq_lens=(61, 23, 44, 80), qlens=(9, 3, 12, 7),
                    k=4, seed=group * 10 + hkv)
    _passes(x, block_rows)


def test_model_head_shape():
    """The model's head shape (G 16, D 128, P 128, K 16) on a 1000-token prefix with 24 new
    tokens crossing a block boundary, an e4m3fn cache with per-slot scales."""
    x = make_inputs("e4m3fn", "bfloat16", "HND", 0, "slot", hkv=1, group=16, d=128, page=128,
                    seq_lens=(1024,), qlens=(24,), k=16, seed=5)
    _passes(x)


@pytest.mark.gpu
@pytest.mark.parametrize("kv_fmt, md, d, page", [
    ("float16", "float16", 256, 64),  # the H200 fuzz run's case: 2 stages took 240 KiB
    ("bfloat16", "bfloat16", 256, 128),
    ("e4m3fn", "bfloat16", 256, 128),
    ("e5m2fnuz", "float16", 256, 64),
    ("bfloat16", "bfloat16", 128, 128),
])
def test_widest_tiles_fit_shared_memory(kv_fmt, md, d, page):
    """D = 256 with 16 query heads per KV head and large pages, where the default
    pipeline depth's K/V stages and the q tile outgrow the H200's 227 KiB of shared memory
    per block: the launcher lowers num_stages until the kernel fits, and the output is
    admitted by the oracle (found by the H200 fuzz run:
    attention_prefill:small:near_overflow:rocm-ocp:auto:float16:none:442 raised
    OutOfResources)."""
    x = make_inputs(kv_fmt, md, "HND", 0, "none", hkv=1, group=16, d=d, page=page,
                    seq_lens=(3 * page + 5,), qlens=(12,), k=3, seed=d + page)
    _passes(x)


def test_dense_selection_is_causal_attention():
    """Selections covering every visible block make this dense causal attention: the output
    is admitted by the oracle and, as an independent cross-check, within bf16 rounding of
    torch's scaled_dot_product_attention (fp32, causal with the prefix offset) on the same
    dequantised keys."""
    x = make_inputs("e4m3fn", "bfloat16", scales="slot", hkv=1, group=2, seq_lens=(45,),
                    qlens=(12,), k=3, seed=17)
    pos = np.arange(33, 45)
    x["topk"] = np.where(np.arange(3)[None, None, :] <= (pos // 16)[None, :, None],
                         np.arange(3)[None, None, :], -1).astype(np.int32)
    _passes(x)
    got = _out(x)
    cache, d, bt = x["kv_cache"], 64, x["block_table"][0]
    j = np.arange(45)
    codes = cache[bt[j // 16], 0, j % 16]
    slots = bt[j // 16].astype(np.int64) * 16 + j % 16
    k = decode(codes[:, :d], "e4m3fn") * x["k_scale"][0, slots][:, None]
    v = decode(codes[:, d:], "e4m3fn") * x["v_scale"][0, slots][:, None]
    mask = torch.from_numpy(j[None, :] <= pos[:, None])
    want = torch.nn.functional.scaled_dot_product_attention(
        torch.from_numpy(x["q"]).float().permute(1, 0, 2), torch.from_numpy(k).float()[None],
        torch.from_numpy(v).float()[None], attn_mask=mask).permute(1, 0, 2).numpy()
    assert np.abs(got - want).max() <= 2e-2 * np.abs(want).max()


# -------------------------------------------------------------- selections are sets


@pytest.mark.parametrize("ratio", [None, ap.ALL_NARROW])
def test_selection_is_a_set(ratio):
    """The output depends only on each token's SET of blocks: permuting the entries (so they
    are unsorted), moving the -1 entries anywhere and (with validate=False) repeating an
    entry give bit-identical outputs, in the default tiers and with every tile in the
    narrow tier (whose one-token trip count is the valid entries: a repeat adds trips that
    find no block)."""
    x = make_inputs("e5m2", "bfloat16", scales="tensor", seq_lens=(70, 33), qlens=(10, 6), k=6,
                    seed=9)
    res = run_prefill(x, delegate_ratio=ratio)
    base = res["out"]
    if ratio is not None:
        assert (res["schedule_rows"] == 2).all()
    perm = dict(x, topk=shuffled_selections(x["topk"], 1))
    assert np.array_equal(run_prefill(perm, delegate_ratio=ratio)["out"], base)
    rep = dict(x, topk=shuffled_selections(x["topk"], 2, dup=True))
    assert (np.sort(rep["topk"], -1) != np.sort(x["topk"], -1)).any()
    assert np.array_equal(run_prefill(rep, validate=False, delegate_ratio=ratio)["out"], base)


# ----------------------------------------------------- content a row must not see


@pytest.mark.parametrize("kv_fmt", ["bfloat16", "e4m3fnuz"])
def test_unselected_blocks_full_of_nan_do_not_leak(kv_fmt):
    """Blocks no token selected hold NaN codes (keys past seq_len, other pages and the tail
    of the last page already do): the output is still admitted and finite."""
    x = make_inputs(kv_fmt, "bfloat16", scales="slot" if "e" in kv_fmt else "none",
                    seq_lens=(90, 47), qlens=(6, 11), k=3, seed=4)
    cu = x["cu_seqlens_q"]
    x = poison_unselected(x, [(cu[r], cu[r + 1]) for r in range(2)])
    _passes(x)
    assert np.isfinite(_out(x)).all()


def _specials_case(kv_fmt):
    """One request of 40 keys, its last 3 tokens new (positions 37, 38, 39, all in block 2;
    one tile), G = 2, Hkv = 1: token 0 selects {0, 2}, token 1 {1, 2}, token 2 {0, 1, 2}.
    V holds NaN (column 5) and +Inf (column 7, bf16 only) at key 39 (seen by token 2 only,
    the causal cut) and -Inf (column 9, bf16 only) at key 20 of block 1 (seen by tokens 1
    and 2, not by token 0, which did not select the block)."""
    x = make_inputs(kv_fmt, "bfloat16", hkv=1, group=2, seq_lens=(40,), qlens=(3,), k=4,
                    seed=8)
    x["topk"] = np.array([[[2, -1, 0, -1], [-1, 1, 2, -1], [0, 2, -1, 1]]], np.int32)
    cache, page, d = x["kv_cache"], 16, 64
    bt = x["block_table"][0]
    cache[bt[39 // page], 0, 39 % page, d + 5] = FORMATS[kv_fmt].nan_code
    if kv_fmt == "bfloat16":
        cache[bt[39 // page], 0, 39 % page, d + 7] = 0x7F80  # +Inf
        cache[bt[20 // page], 0, 20 % page, d + 9] = 0xFF80  # -Inf
    return x


@pytest.mark.parametrize("ratio", [None, 0, 2**20])
@pytest.mark.parametrize("kv_fmt", ["bfloat16", "e4m3fn"])
def test_nonfinite_values_reach_only_the_tokens_that_see_them(kv_fmt, ratio):
    """Tokens of one tile share each K/V tile, but a NaN/Inf in V reaches only the tokens
    that see that key (not through 0 * NaN in the shared P @ V): token 2 gets NaN in column
    5 (and +Inf in 7), tokens 1 and 2 get -Inf in column 9, token 0 stays finite; the oracle
    admits every element (a non-finite exact value admits only itself). In either tier
    (the default switch, every tile wide, every tile narrow: the narrow tier's 8-token
    tiles at G 2 share K/V too, and its repair pass takes the tiles its first pass
    listed)."""
    x = _specials_case(kv_fmt)
    _passes(x, delegate_ratio=ratio)
    out = _out(x, delegate_ratio=ratio)
    assert np.isfinite(out[0]).all()
    assert np.isnan(out[2, :, 5]).all() and np.isfinite(out[1, :, 5]).all()
    if kv_fmt == "bfloat16":
        assert (out[2, :, 7] == np.inf).all() and (out[1:, :, 9] == -np.inf).all()
        assert np.isfinite(np.delete(out[1], 9, axis=-1)).all()


def test_nan_key_reaches_only_the_tokens_that_see_it():
    """A NaN in K at key 38 (seen by tokens 1 and 2, not by token 0 at position 37) makes
    exactly those tokens' outputs NaN."""
    x = _specials_case("e5m2")
    page, bt = 16, x["block_table"][0]
    x["kv_cache"][bt[38 // page], 0, 38 % page, 3] = FORMATS["e5m2"].nan_code
    _passes(x)
    out = _out(x)
    assert np.isfinite(out[0]).all() and np.isnan(out[1:]).all()


# -------------------------------------------------------------------------- tiers

ALL_NARROW = ap.ALL_NARROW


@pytest.mark.parametrize("ratio", [0, ALL_NARROW])
@pytest.mark.parametrize("kv_fmt, group", [("e4m3fn", 2), ("bfloat16", 16), ("e5m2fnuz", 3)])
def test_either_tier_alone_matches_reference(kv_fmt, group, ratio):
    """Every tile in the wide tier (delegate_ratio 0) or every tile handed to the narrow
    tier (one token per program at G 16, 8 / 4 tokens at G 2 / 3, nested in 64- / 32-token
    wide tiles): a ragged batch with tiles starting mid-request gives an output the oracle
    admits, so the narrow pass computes every handed token and the wide pass stores none
    of them."""
    x = make_inputs(kv_fmt, "bfloat16", "NHD", 0, "tensor" if kv_fmt[0] == "e" else "none",
                    hkv=2, group=group, seq_lens=(61, 23, 90), qlens=(19, 3, 37), k=3,
                    seed=group + ratio % 7)
    _passes(x, delegate_ratio=ratio)


@pytest.mark.parametrize("kv_fmt, narrow_rows, tokens", [
    ("bfloat16", 32, 2), ("e4m3fn", 64, 4), ("bfloat16", 128, None)])
def test_narrow_rows_sets_the_narrow_tiles_tokens(kv_fmt, narrow_rows, tokens):
    """``narrow_rows`` (G 16): every tile handed to the narrow tier, which runs tiles of
    ``narrow_rows / 16`` tokens walking the union of their selections (the repair pass
    after it: more than one token) on as many warps (a warp per 16 rows by default), on a
    ragged batch with tiles starting mid-request:
    the output is admitted, each row under the narrow schedule; as many rows as the wide
    tiles' turn the tiers off (every row the wide tier's)."""
    x = make_inputs(kv_fmt, "bfloat16", "NHD", 0, "tensor" if kv_fmt[0] == "e" else "none",
                    hkv=1, group=16, seq_lens=(61, 23, 90), qlens=(19, 3, 37), k=3, seed=9)
    launches = _Launches(ap._prefill_kernel)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(ap, "_prefill_kernel", launches)
        mp.setattr(ap, "fitting_stages", lambda kernel, args, kw, device, deepest: deepest)
        _passes(x, 128, delegate_ratio=ALL_NARROW, narrow_rows=narrow_rows)
    narrow = {(repair, block_t, warps) for tier, repair, _, block_t, warps in launches.seen
              if tier == 2}
    assert narrow == ({(False, tokens, tokens), (True, tokens, tokens)} if tokens else set())
    rows = run_prefill(x, block_rows=128, delegate_ratio=ALL_NARROW,
                  narrow_rows=narrow_rows)["schedule_rows"]
    assert set(np.unique(rows)) == ({2} if tokens else {0})


@pytest.mark.parametrize("ratio", [0, ALL_NARROW])
@pytest.mark.parametrize("kv_fmt, group, block_keys, scales", [
    ("e4m3fn", 2, 16, "tensor"),
    ("bfloat16", 16, 32, "none"),
    ("e5m2fnuz", 3, 16, "slot"),
])
def test_key_tiles_match_reference_under_their_schedule(kv_fmt, group, block_keys, scales,
                                                        ratio):
    """Online-softmax tiles of ``block_keys`` keys (the launch knob, P 64) in either tier
    alone: a ragged batch (prefixes cut anywhere, tiles past a token's position) passes the
    oracle under the schedule it declares (``Schedule.tile_keys``), and the whole-block
    schedule rejects the bf16 output (the declaration has teeth)."""
    x = make_inputs(kv_fmt, "bfloat16", "NHD", 0, scales, hkv=2, group=group, page=64,
                    seq_lens=(61, 150, 200), qlens=(19, 3, 37), k=3, seed=group + ratio % 7)
    run = functools.partial(run_prefill, delegate_ratio=ratio, block_keys=block_keys)
    (impl,) = implementations("attention_prefill", ["triton"])
    tiled = replace(impl, run=run, schedule=ap.PrefillSchedule(block_keys))
    res = run_check(_case(x), tiled, inputs=x)
    assert res.passed, res.summary()
    if kv_fmt == "bfloat16":  # whole blocks (P 64) in both tiers
        whole = ap.PrefillSchedule(narrow_block_keys=64)
        assert not run_check(_case(x), replace(tiled, schedule=whole), inputs=x).passed


@pytest.mark.parametrize("kv_fmt", ["bfloat16", "e4m3fn"])
def test_narrow_key_tiles_are_declared_for_the_narrow_rows_only(kv_fmt):
    """The narrow tier's own key tiles (``narrow_block_keys`` 16, P 64, the wide tier on
    whole blocks): on a ragged batch whose tiles go to both tiers (32-row wide tiles,
    delegate_ratio 16) the output passes the oracle under
    ``PrefillSchedule(narrow_block_keys=16)``, the adapter names the narrow rows (2) and
    the wide ones (0), and for bf16 the undeclared tiles are rejected (the wide tier's
    schedule for every row)."""
    x = make_inputs(kv_fmt, "bfloat16", "NHD", 0, "tensor" if kv_fmt != "bfloat16" else
                    "none", hkv=2, group=2, page=64, seq_lens=(61, 150, 200),
                    qlens=(19, 3, 37), k=3, seed=5)
    run = functools.partial(run_prefill, narrow_block_keys=16, block_rows=32, delegate_ratio=16)
    (impl,) = implementations("attention_prefill", ["triton"])
    tiled = replace(impl, run=run, schedule=ap.PrefillSchedule(narrow_block_keys=16))
    res = run_check(_case(x), tiled, inputs=x)
    assert res.passed, res.summary()
    rows = run(x)["schedule_rows"]
    assert set(np.unique(rows)) == {0, 2}
    if kv_fmt == "bfloat16":  # whole blocks (P 64) in both tiers
        whole = ap.PrefillSchedule(narrow_block_keys=64)
        assert not run_check(_case(x), replace(tiled, schedule=whole), inputs=x).passed


@pytest.mark.parametrize("block_keys", [8, 48, 128])
def test_block_keys_must_be_a_power_of_two_tile_of_the_page(block_keys):
    """block_keys below 16, not dividing the page size (64), or past it is refused with a
    ValueError naming it."""
    x = make_inputs("e4m3fn", "bfloat16", scales="tensor", page=64, seq_lens=(70,),
                    qlens=(5,), k=2)
    with pytest.raises(ValueError, match="block_keys"):
        run_prefill(x, block_keys=block_keys)


def _mixed_tiles_case(cache="e4m3fn"):
    """32 new tokens (positions 288..319, blocks 18 and 19) in two wide tiles of 16 tokens
    (block_rows 32 at G 2): the first tile's tokens all select blocks {0, 18} (U = 2, 32
    entries), the second's {j, 19} with a different j each (U = 17)."""
    scales = "none" if cache == "bfloat16" else "tensor"
    x = make_inputs(cache, "bfloat16", scales=scales, hkv=1, group=2, seq_lens=(320,),
                    qlens=(32,), k=2, seed=21)
    t = np.arange(32)
    x["topk"] = np.stack([np.where(t < 16, 0, t - 15), np.where(t < 16, 18, 19)],
                         -1)[None].astype(np.int32)
    return x


def test_each_wide_tile_picks_its_tier_by_its_union(monkeypatch):
    """With the default ratio the tile with U = 2 against 32 entries stays in the wide
    tier and the tile with U = 17 (3 x 17 > 32) is handed over (the int32 per wide
    program the launcher passes both tiers); the output is admitted by the oracle, and
    the adapter names the rows of the second tile's tokens the narrow tier's (2), the
    first tile's the wide tier's (1 on predecoded pages, else 0)."""
    seen = []
    orig = ap._prefill_pass

    def spy(*args):
        orig(*args)
        seen.append((args[-2]["TIER"], args[8]))

    monkeypatch.setattr(ap, "_prefill_pass", spy)
    x = _mixed_tiles_case()
    _passes(x, 32)
    tiers = [tier for tier, _ in seen]
    assert tiers == [1, 2]
    assert seen[0][1][:2].tolist() == [0, 1]
    second = (np.arange(32) >= 16)[:, None]
    for predecode, wide in ((False, 0), (True, 1)):
        rows = run_prefill(x, block_rows=32, predecode=predecode)["schedule_rows"]
        assert np.array_equal(rows, np.where(second, 2, wide) + 0 * rows)


@pytest.mark.parametrize("batch", [1, 2, 4, 5])
def test_each_tile_finds_its_request_in_the_fewest_search_steps(batch):
    """The tiles' binary search over cu_seqlens_q takes ceil(log2(B)) steps (none for one
    request): ragged batches of 1, 2, 4 and 5 requests, in 16-token wide tiles (G 2) and
    8-token narrow ones, give outputs the oracle admits in either tier, so every tile found
    its own request."""
    assert ap.binary_search_steps(batch) == int(np.ceil(np.log2(batch)))
    qlens = (5, 13, 1, 9, 7)[:batch]
    seqs = (40, 13, 30, 64, 21)[:batch]
    x = make_inputs("bfloat16", "bfloat16", hkv=2, group=2, seq_lens=seqs, qlens=qlens, k=3,
                    seed=batch)
    _passes(x, 32, delegate_ratio=0)
    _passes(x, 32, delegate_ratio=ALL_NARROW)


def test_tiers_agree_with_one_tier():
    """The mixed case's output with the tiers is admitted, and so is each of its tiles
    computed by one tier alone; the wide tile's tokens are bit-identical with and without
    the tiers (the same wide program ran them)."""
    x = _mixed_tiles_case()
    both = _out(x, 32)
    wide = _out(x, 32, delegate_ratio=0)
    _passes(x, 32, delegate_ratio=ALL_NARROW)
    assert np.array_equal(both[:16], wide[:16])


@pytest.mark.parametrize("knob, value", [("delegate_ratio", -1), ("narrow_warps", 0),
                                         ("narrow_stages", 9), ("narrow_max_registers", 8),
                                         ("narrow_block_keys", 48), ("predecode_rows", 0),
                                         ("predecode_rows", 12), ("predecode_warps", 17),
                                         ("pdl", 1), ("narrow_rows", 24),
                                         ("narrow_rows", 0)])
def test_bad_tier_knob_raises_value_error_naming_it(knob, value):
    """A tier or predecode knob out of its range is rejected on the host, naming the
    argument (the predecode's whether or not it would run)."""
    with pytest.raises(ValueError, match=knob):
        ap.sparse_attention_prefill(**_good_args("bfloat16"), **{knob: value})


@pytest.mark.parametrize("cache, knobs, want", [
    ("e4m3fn", {}, ap.NARROW_FP8),
    ("e4m3fn", {"narrow_warps": 8, "narrow_stages": 2}, {"num_warps": 8, "num_stages": 2}),
    ("bfloat16", {}, {"num_warps": ap.NARROW_WARPS}),
    ("bfloat16", {"narrow_warps": 2, "narrow_stages": 1}, {"num_warps": 2, "num_stages": 1}),
    ("e4m3fn", {"narrow_max_registers": 200},
     {"num_warps": ap.NARROW_FP8["num_warps"], "maxnreg": 200}),
])
def test_narrow_launch_options_are_applied_and_admitted(cache, knobs, want):
    """The narrow tier's launch options (the per-cache defaults, or the knobs) reach its
    launch, and its output on the mixed case, every tile with a selection handed over, is
    admitted."""
    seen = []
    orig = ap._prefill_pass

    def spy(*args):
        seen.append(dict(args[-2]))
        orig(*args)

    x = _mixed_tiles_case(cache)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(ap, "_prefill_pass", spy)
        _passes(x, 32, delegate_ratio=ALL_NARROW, **knobs)
    narrow = [c for c in seen if c["TIER"] == 2]
    assert narrow and all(c["num_warps"] == want["num_warps"] for c in narrow)
    for opt in ("num_stages", "maxnreg"):
        if opt in want:
            assert all(c[opt] == want[opt] for c in narrow)


@pytest.mark.parametrize("cache, page, knobs, want", [
    ("bfloat16", 64, {}, ap.NARROW_KEYS),        # capped
    ("e4m3fn", 128, {}, ap.NARROW_KEYS_FP8),      # capped
    ("e4m3fn", 32, {}, 32),                       # the page is smaller
    ("bfloat16", 64, {"block_keys": 32}, 16),     # the wide tier's tiles, capped
    ("e4m3fn", 128, {"block_keys": 32}, 32),      # the wide tier's tiles
    ("e4m3fn", 128, {"narrow_block_keys": 128}, 128),  # given: as given
])
def test_narrow_tiles_default_to_the_capped_wide_tiles_and_are_declared(cache, page, knobs,
                                                                         want):
    """Without ``narrow_block_keys`` the narrow tier's key tiles are the wide tier's
    (``block_keys``, else the page) capped per cache kind (``narrow_tile_keys``); the
    launch uses them and the registered schedule declares them for the narrow rows (whole
    blocks: ``tile_keys`` None)."""
    seen = []
    orig = ap._prefill_pass

    def spy(*args):
        seen.append(dict(args[-2]))
        orig(*args)

    x = make_inputs(cache, scales="none" if cache == "bfloat16" else "tensor", hkv=1,
                    group=16, page=page, seq_lens=(2 * page + 5,), qlens=(3,), k=2, seed=3)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(ap, "_prefill_pass", spy)
        run_prefill(x, delegate_ratio=ALL_NARROW, **knobs)
    assert [c["BN"] for c in seen if c["TIER"] == 2] == [want]
    schedule = ap.PrefillSchedule(knobs.get("block_keys"), knobs.get("narrow_block_keys"))
    narrow = schedule("bfloat16", x)[2]
    assert narrow.tile_keys == (None if want >= page else want)


@pytest.mark.parametrize("cache, knobs, wide, narrow", [
    ("bfloat16", {"narrow_stages": 3, "num_stages": 2}, 2, 3),
    ("e4m3fn", {"narrow_stages": 4, "narrow_warps": 4, "num_stages": 1}, 1, 4),
    ("e4m3fn", {"num_stages": 3}, 3, ap.NARROW_FP8["num_stages"]),
    ("bfloat16", {"narrow_stages": 2, "num_stages": 3}, 3, 2),
])
def test_each_tier_s_first_pass_runs_its_given_depth(cache, knobs, wide, narrow):
    """A given depth reaches its tier's first pass (``num_stages`` the wide tier's,
    ``narrow_stages`` the narrow tier's; the fp8 narrow tier's default NARROW_FP8's), and at
    every depth, 3+ stages included, the fully seen tiles skip the mask in a branch: the
    output on random selections (G 16, wide tiles of 2 tokens, the current block cut by
    the causal mask, a prefix not a multiple of P) is admitted. The fit is stood in (every
    depth fits)."""
    x = make_inputs(cache, scales="none" if cache == "bfloat16" else "tensor", hkv=1,
                    group=16, page=32, seq_lens=(75,), qlens=(11,), k=2, seed=5)
    launches = _Launches(ap._prefill_kernel)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(ap, "_prefill_kernel", launches)
        mp.setattr(ap, "fitting_stages", lambda kernel, args, kw, device, deepest: deepest)
        _passes(x, 32, **knobs)
    firsts = {tier: depth for tier, repair, depth, *_ in launches.seen if not repair}
    assert firsts == {1: wide, 2: narrow}


class _Launches:
    """Stands in for ``_prefill_kernel``: records each launch's (TIER, REPAIR, num_stages,
    BLOCK_T, num_warps) and launches the real kernel."""

    def __init__(self, kernel):
        self.kernel, self.seen = kernel, []

    def __getattr__(self, name):
        return getattr(self.kernel, name)

    def __getitem__(self, grid):
        def launch(*args, **kw):
            self.seen.append((kw["TIER"], kw["REPAIR"], kw["num_stages"], kw["BLOCK_T"],
                              kw["num_warps"]))
            return self.kernel[grid](*args, **kw)
        return launch


@pytest.mark.parametrize("knobs, first, repair", [
    ({"num_stages": 3}, 3, 2),  # the caller's depth for the first pass, fitted for repair
    ({"num_stages": 1}, 1, 1),
    ({}, None, None),  # the guess (_num_stages), lowered until both passes fit
])
def test_a_given_pipeline_depth_is_the_first_pass_s(knobs, first, repair):
    """The wide tier's (tiers off) first pass runs a caller's num_stages as given and its
    repair pass the deepest up to it that fits (sm_90, model shape: 3 stages fit the first
    pass, not the repair pass's guarded P @ V); without the knob both passes take the
    guess lowered until both fit. Shared memory is stood in by a fit of at most 3 stages
    for the first pass and 2 for the repair pass; the output is admitted either way."""
    x = _mixed_tiles_case("bfloat16")
    launches = _Launches(ap._prefill_kernel)

    def fits(kernel, args, kw, device, deepest):
        return min(deepest, 2 if kw["REPAIR"] else 3)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(ap, "_prefill_kernel", launches)
        mp.setattr(ap, "fitting_stages", fits)
        _passes(x, 32, delegate_ratio=0, **knobs)
    guess = ap._num_stages(x["kv_cache"].shape[2], x["q"].shape[2], False)
    first = min(guess, 2) if first is None else first
    repair = min(guess, 2) if repair is None else repair
    seen = [launch[:3] for launch in launches.seen]
    assert seen == [(0, False, first), (0, True, repair)]  # tiers off: TIER 0


# ------------------------------------------------------------------ other properties


def test_batch_invariance():
    """A request's output is bit-identical whether it runs alone or inside a batch with
    other requests (an empty one included): tiles never straddle requests."""
    x = make_inputs("e4m3fn", "bfloat16", scales="slot", seq_lens=(20, 75, 130, 9),
                    qlens=(0, 13, 21, 9), k=5, seed=12)
    full = run_prefill(x)["out"]
    cu, r = x["cu_seqlens_q"], 2
    rows = slice(cu[r], cu[r + 1])
    alone = dict(x, q=x["q"][rows], seq_lens=x["seq_lens"][r:r + 1],
                 block_table=x["block_table"][r:r + 1], topk=x["topk"][:, rows],
                 cu_seqlens_q=np.array([0, cu[r + 1] - cu[r]], np.int32))
    assert np.array_equal(run_prefill(alone)["out"], full[rows])


def test_softmax_scale_is_applied():
    """An explicit softmax_scale (here 0.3, not 1/sqrt(D)) is the one used: the output is
    admitted by the schedule's reference and bound computed with that scale."""
    from oracle.core.attention_bound import attention_bound

    x = make_inputs("e4m3fn", "float16", scales="slot", seq_lens=(50, 21), qlens=(4, 5), k=3,
                    seed=6)
    dev = device()
    act = HALF_DTYPES["float16"]

    def t(a):
        return torch.from_numpy(np.ascontiguousarray(a)).to(dev)

    got = ap.sparse_attention_prefill(
        torch.from_numpy(x["q"]).to(act).to(dev), t(x["kv_cache"]), "e4m3fn",
        t(x["block_table"]), t(x["cu_seqlens_q"]), t(x["seq_lens"]), t(x["topk"]),
        t(x["k_scale"]), t(x["v_scale"]), softmax_scale=0.3)
    sched = ap.SCHEDULE("float16")[0]
    res = attention.sparse_attention_prefill(
        x["q"], x["kv_cache"], "e4m3fn", x["block_table"], x["cu_seqlens_q"], x["seq_lens"],
        x["topk"], x["k_scale"], x["v_scale"], softmax_scale=0.3, schedule=sched,
        return_details=True)
    tally = Tally()
    tally.add("out", got.view(torch.int16).cpu().numpy().view(np.uint16), res.unrounded,
              attention_bound(x, sched, _impl().arith, softmax_scale=0.3), "float16")
    assert tally.violations == 0 and tally.elements == x["q"].size


@pytest.mark.parametrize("kv_fmt, md, scales, ratio", [
    ("e4m3fn", "bfloat16", "tensor", None), ("e5m2", "float16", "none", 0),
    ("e4m3fnuz", "float16", "tensor", None), ("e5m2fnuz", "bfloat16", "tensor", 0)])
def test_predecoded_pages_are_admitted_under_their_own_schedule_and_guarded(kv_fmt, md,
                                                                          scales, ratio):
    """``predecode`` (the batch's pages decoded once to their exact values in act, the wide
    tier run on them as on a 16-bit cache): on a ragged batch whose invisible content is
    NaN-poisoned, with the tiers (mixed tiles) or every tile wide, the output is admitted
    by the oracle, each row under the schedule the adapter reports for it
    (``schedule_rows``: 1, the predecoded schedule, for every row of the wide tier, 2 for
    the narrow tier's, 0 for the wide tier of the plain launch), and with the tiers both
    tiers ran. With a block-table entry past the cache and validate=False (the
    scratch table marks it bad), the output equals the predecoded launch's without the
    selections of that block."""
    x = make_inputs(kv_fmt, md, scales=scales, hkv=2, group=4, d=64, page=16,
                    seq_lens=(37, 70, 20), qlens=(9, 16, 20), k=3, seed=17)
    knobs = dict(block_rows=32, delegate_ratio=ratio, predecode=True)
    _passes(x, **knobs)
    rows = run_prefill(x, **knobs)["schedule_rows"]
    assert rows.shape == x["q"].shape[:2]
    assert set(np.unique(rows)) == ({1} if ratio == 0 else {1, 2})
    plain = run_prefill(x, **dict(knobs, predecode=False))["schedule_rows"]
    assert np.array_equal(plain, np.where(rows == 1, 0, rows))
    bt = np.array(x["block_table"], copy=True)
    bt[1, 2] = 10**6  # request 1 (tokens 9 to 24), block 2
    token = np.arange(x["topk"].shape[1])
    mine = (token >= 9) & (token < 25)
    assert (x["topk"][:, mine] == 2).any()
    sel = np.where(mine[None, :, None] & (x["topk"] == 2), -1, x["topk"])
    assert np.array_equal(run_prefill(dict(x, block_table=bt), validate=False, **knobs)["out"],
                          run_prefill(dict(x, topk=sel), **knobs)["out"])


@pytest.mark.parametrize("kv_fmt, md", [("e4m3fn", "bfloat16"), ("e5m2", "float16"),
                                        ("e4m3fnuz", "float16"), ("e5m2fnuz", "bfloat16")])
@pytest.mark.parametrize("rows, warps", [(None, None), (4, 1), (1, 2)])
def test_predecode_writes_every_code_exactly_and_marks_unused_blocks(kv_fmt, md, rows, warps):
    """``predecode_pages``, whatever its rows and warps per program: each used block's page
    (inside seq_len, entry in the cache) holds its codes' exact values (the reference
    codec's, all 256 codes with NaN and Inf, per KV head) in the model dtype at scratch page
    ``r * W + j``, which the table names; blocks past seq_len or with an entry outside the
    cache get -1."""
    from kernels.fp8 import HW_FORMATS, asm_f16, fmt_code
    from kernels.kv_predecode import INTERPRETED, predecode_pages

    dev = device()
    g = np.random.Generator(np.random.PCG64(31))
    codes = np.stack([g.permutation(256).reshape(16, 16) for _ in range(5 * 2)])
    codes = codes.reshape(5, 2, 16, 16).astype(np.uint8)  # [pages, Hkv, P, 2D]
    table = np.array([[3, 0, 7], [1, -1, 4]], np.int32)  # 7: past the cache
    seq_lens = np.array([40, 20], np.int32)  # request 1's block 2 past its seq_len
    out, tab = predecode_pages(torch.from_numpy(codes).to(dev), torch.from_numpy(table).to(dev),
                               torch.from_numpy(seq_lens).to(dev), fmt_code(kv_fmt),
                               kv_fmt in HW_FORMATS, asm_f16(kv_fmt, INTERPRETED),
                               getattr(torch, md), rows=rows, num_warps=warps)
    assert tab.cpu().tolist() == [[0, 1, -1], [3, -1, -1]]
    got = out.float().cpu().numpy()
    for scratch, page in ((0, 3), (1, 0), (3, 1)):
        assert np.array_equal(got[scratch], decode(codes[page], kv_fmt), equal_nan=True)


def test_the_predecode_runs_only_when_a_wide_tile_reads_pages(monkeypatch):
    """``_tier_kernel`` sets the need flag exactly when a tile it keeps wide has a block in
    its union, and ``predecode_pages`` decodes only under that flag: with every tile handed
    to the narrow tier (random-like selections spread over many blocks, a huge
    delegate_ratio) the scratch table keeps its fill; with the tiers off (every tile wide)
    it is the table of used pages. The outputs are the same either way (the narrow tier
    reads the codes)."""
    tables = []
    real_empty, predecode_pages = torch.empty, ap.predecode_pages

    def filled_empty(shape, dtype=None, device=None):
        return real_empty(shape, dtype=dtype, device=device).fill_(
            -7 if dtype == torch.int32 else float("nan"))

    def spy(*args, **kwargs):  # the scratch and its table start filled, not empty
        with monkeypatch.context() as m:
            m.setattr(torch, "empty", filled_empty)
            out, table = predecode_pages(*args, **kwargs)
        tables.append(table)
        return out, table

    monkeypatch.setattr(ap, "predecode_pages", spy)
    x = make_inputs("e4m3fn", "bfloat16", scales="tensor", hkv=2, group=4, d=64, page=16,
                    seq_lens=(70, 64), qlens=(9, 16), k=3, seed=23)
    narrow = run_prefill(x, block_rows=32, delegate_ratio=ap.ALL_NARROW, predecode=True)
    assert len(tables) == 1 and (tables[0] == -7).all()
    wide = run_prefill(x, block_rows=32, delegate_ratio=0, predecode=True)
    assert len(tables) == 2 and not (tables[1] == -7).any()
    assert set(np.unique(narrow["schedule_rows"])) == {2}
    assert set(np.unique(wide["schedule_rows"])) == {1}
    _passes(x, block_rows=32, delegate_ratio=ap.ALL_NARROW, predecode=True)


@pytest.mark.gpu
@pytest.mark.parametrize("pdl", [False, True])
@pytest.mark.parametrize("kv_fmt", ["e4m3fn", "e5m2fnuz"])
def test_default_predecode_on_a_long_ragged_batch_is_admitted(kv_fmt, pdl):
    """A batch large enough for ``default_predecode`` (1,324 new tokens, two requests on
    prefixes of 800 and 1,024 tokens, not multiples of P; the model's group of 16, D 128,
    P 128): the launcher predecodes without being asked, and the output, with the
    invisible content NaN-poisoned, is admitted by the oracle (the default path at the
    benchmark's scale; the interpreter is too slow for it). With ``pdl`` (every launch of
    the call programmatically dependent on the one before: the tier switch, the
    predecode, both tiers' passes) it is admitted too and bit-identical to plain launches:
    each kernel still reads only what the previous ones finished writing."""
    x = make_inputs(kv_fmt, "bfloat16", scales="tensor", hkv=1, group=16, d=128, page=128,
                    seq_lens=(1100, 2048), qlens=(300, 1024), k=8, seed=28)
    calls = []
    predecode = ap.predecode_pages

    def spy(*args, **kwargs):
        calls.append(kwargs["pdl"])
        return predecode(*args, **kwargs)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(ap, "predecode_pages", spy)
        _passes(x, pdl=pdl)
    assert calls and all(c == pdl for c in calls)
    if pdl:
        assert np.array_equal(_out(x, pdl=True), _out(x), equal_nan=True)


@pytest.mark.parametrize("kv_fmt, scales, value", [("e4m3fn", "slot", True),
                                                   ("bfloat16", "none", True),
                                                   ("e4m3fn", "tensor", 1)])
def test_predecode_needs_scalar_scale_fp8(kv_fmt, scales, value):
    """predecode with per-slot scales or a 16-bit cache, or not a bool, is refused with a
    ValueError naming it."""
    x = make_inputs(kv_fmt, "bfloat16", scales=scales, seq_lens=(37,), qlens=(5,), k=2)
    with pytest.raises(ValueError, match="predecode"):
        run_prefill(x, predecode=value)


@pytest.mark.parametrize("fp8, scalar, t, batch, width, want", [
    (True, True, 8192, 1, 128, True),  # the benchmark's shape: 8k new tokens, 16k-token table
    (True, True, 1024, 2, 16, True),  # at both limits
    (True, True, 1023, 1, 8, False),  # too few new tokens
    (True, True, 8192, 4, 128, False),  # a table wider than 4x the new tokens
    (True, False, 8192, 1, 128, False),  # per-slot scales
    (False, True, 8192, 1, 128, False)])  # a 16-bit cache
def test_default_predecode_follows_the_scales_and_the_batch_size(fp8, scalar, t, batch, width,
                                                                 want):
    """``predecode=None`` predecodes exactly an fp8 cache with scalar (or no) scales, with
    at least PREDECODE_MIN_TOKENS new tokens and a block table of at most
    PREDECODE_TABLE_RATIO times as many tokens (P 128), from host values alone."""
    plan = ap.PrefillPlan(t=t, hq=64, hkv=4, d=128, page=128, num_pages=4096, batch=batch,
                          topk_k=16, fp8=fp8, ks=None, ks_strides=(0, 0), vs=None,
                          vs_strides=(0, 0), softmax_scale=1.0, out=None)
    assert ap.default_predecode(plan, scalar, width) is want


def test_out_of_range_contents_are_guarded():
    """With validate=False, entries past a token's last visible block, huge or negative
    entries are ignored, and a block whose block-table entry is out of range reads nothing:
    the output equals (bit for bit) the output without those entries / that block."""
    x = make_inputs("e5m2fnuz", "bfloat16", scales="slot", seq_lens=(70, 40), qlens=(8, 5),
                    k=5, seed=13)
    base = run_prefill(x)["out"]
    tk = np.array(x["topk"], copy=True)
    free = np.argwhere(tk < 0)
    for n, (g, t, k) in enumerate(free):
        tk[g, t, k] = (10**6, -7, 5 + t // 2)[n % 3]  # huge, negative, past p // P
    assert np.array_equal(run_prefill(dict(x, topk=tk), validate=False)["out"], base)
    # Block 1 of request 0 points past the cache: as if no token had selected it.
    assert (x["topk"][:, :8] == 1).any()
    bt = np.array(x["block_table"], copy=True)
    bt[0, 1] = 10**6
    sel = np.where(np.arange(tk.shape[1])[None, :, None] < 8,
                   np.where(x["topk"] == 1, -1, x["topk"]), x["topk"])
    want = run_prefill(dict(x, topk=sel))["out"]
    got = run_prefill(dict(x, block_table=bt), validate=False)["out"]
    assert np.array_equal(got, want)


def test_inconsistent_lengths_are_guarded():
    """With validate=False, a request whose seq_len is below its query length gives zeros
    for the tokens at negative positions (they see no key) and the same output as before
    for the others, and a cu_seqlens_q that runs past T reads and writes no token outside
    the call (the other requests are unchanged)."""
    x = make_inputs("bfloat16", seq_lens=(20, 30), qlens=(6, 4), k=2, seed=14)
    base = decode(run_prefill(x)["out"], "bfloat16")
    short = dict(x, seq_lens=np.array([3, 30]))  # request 0: positions -3 .. 2
    short["topk"] = np.where(np.arange(10)[None, :, None] < 6, np.minimum(x["topk"], 0), x["topk"])
    out = decode(run_prefill(short, validate=False)["out"], "bfloat16")
    assert not out[:3].any() and np.isfinite(out).all()
    assert np.array_equal(out[6:], base[6:])
    long = dict(x, cu_seqlens_q=np.array([0, 6, 40], np.int32))
    out = decode(run_prefill(long, validate=False)["out"], "bfloat16")
    assert np.array_equal(out[:6], base[:6]) and np.isfinite(out).all()


def test_no_tokens_is_a_no_op(monkeypatch):
    """T = 0 (no request, or requests without new tokens): nothing is launched and the
    (empty) output is returned."""

    class NoLaunch:
        def __getitem__(self, grid):
            raise AssertionError("launched for T = 0")

    monkeypatch.setattr(ap, "_prefill_kernel", NoLaunch())
    assert run_prefill(make_inputs(seq_lens=(), qlens=()))["out"].shape == (0, 4, 64)
    assert run_prefill(make_inputs(seq_lens=(5, 9), qlens=(0, 0)))["out"].shape == (0, 4, 64)


def test_writes_into_a_preallocated_strided_output():
    """``out`` given (a head-major buffer seen token-major): the kernel writes it and
    returns it, with the values it returns when it allocates the output itself."""
    a = _good_args("e4m3fn")
    out = torch.zeros(a["q"].shape[1], a["q"].shape[0], 64, dtype=torch.bfloat16,
                      device=a["q"].device).transpose(0, 1)
    res = ap.sparse_attention_prefill(**a, out=out)
    assert res is out and bool(out.abs().sum() > 0)
    own = ap.sparse_attention_prefill(**a)
    assert torch.equal(own.view(torch.int16), out.view(torch.int16))


# ------------------------------------------------------------------ host validation


def _good_args(kv_fmt="e4m3fn"):
    """Two requests (seq_lens 20 and 5, 3 and 2 new tokens), Hkv 2, G 2, D 64, P 16."""
    dev = device()
    hkv, grp, d, page, pages = 2, 2, 64, 16, 4
    fp8 = kv_fmt not in HALF_DTYPES
    cache = torch.randint(0, 0x70, (pages, hkv, page, 2 * d), dtype=torch.uint8) if fp8 \
        else torch.randn(pages, hkv, page, 2 * d).to(HALF_DTYPES[kv_fmt])
    # token positions: 17, 18, 19 (request 0, blocks 0..1), 3, 4 (request 1, block 0)
    sel = [[1, 0], [-1, 1], [0, 1], [0, -1], [-1, 0]]
    return dict(
        q=torch.randn(5, hkv * grp, d).to(torch.bfloat16).to(dev),
        kv_cache=cache.to(dev), kv_fmt=kv_fmt,
        block_table=torch.tensor([[0, 1], [2, -1]], dtype=torch.int32, device=dev),
        cu_seqlens_q=torch.tensor([0, 3, 5], dtype=torch.int32, device=dev),
        seq_lens=torch.tensor([20, 5], device=dev),
        topk=torch.tensor([sel] * hkv, dtype=torch.int32, device=dev))


def _bad(name, **changes):
    return bad_args(_good_args, name, **changes)


@pytest.mark.parametrize("make, name", [
    *(_bad(name, **changes) for name, changes in PAGED_ATTENTION_BAD_ARGS),
    _bad("seq_lens", seq_lens=lambda a: a["seq_lens"][:0], cu_seqlens_q=lambda a:
         a["cu_seqlens_q"][:1], block_table=lambda a: a["block_table"][:0]),
    _bad("cu_seqlens_q", cu_seqlens_q=lambda a: a["cu_seqlens_q"][:2]),
    _bad("cu_seqlens_q", cu_seqlens_q=lambda a: a["cu_seqlens_q"].float()),
    _bad("cu_seqlens_q", cu_seqlens_q=lambda a: a["cu_seqlens_q"][None]),
    _bad("block_rows", block_rows=48),
    _bad("block_rows", block_rows=0),
])
def test_bad_host_input_raises_value_error_naming_it(make, name):
    """Wrong dtypes, shapes (Hq not G * Hkv with G <= 16, K outside 1..64, cu_seqlens_q not
    [B + 1], no request for T > 0), head dims, strides, cache dtypes and page sizes, unknown
    format strings, bad scales, softmax_scale, out, block_rows, validate and the launch
    options raise
    ValueError whose message starts with the argument's name, before any launch."""
    args = make()
    with pytest.raises(ValueError, match=rf"^{name}\b"):
        ap.sparse_attention_prefill(**args)


def test_model_dtype_cache_rejects_a_scale():
    """A bf16/fp16 cache takes no (non-unit) scale: ValueError naming k_scale / v_scale."""
    args = _good_args("bfloat16")
    with pytest.raises(ValueError, match=r"^k_scale\b"):
        ap.sparse_attention_prefill(**args, k_scale=0.5)
    with pytest.raises(ValueError, match=r"^v_scale\b"):
        ap.sparse_attention_prefill(**args, v_scale=torch.full((), 2.0, device=device()))


@pytest.mark.parametrize("changes, match", [
    ({"cu_seqlens_q": set_entry("cu_seqlens_q", (0, 1))}, r"^cu_seqlens_q\b.*start at 0"),
    ({"cu_seqlens_q": set_entry("cu_seqlens_q", (1, 6))}, r"^cu_seqlens_q\b.*never decrease"),
    ({"cu_seqlens_q": set_entry("cu_seqlens_q", (2, 4))}, r"^cu_seqlens_q\b.*end at T"),
    ({"seq_lens": set_entry("seq_lens", (1, 1))}, r"^seq_lens\b.*query length"),
    ({"seq_lens": set_entry("seq_lens", (1, -1))}, r"^seq_lens\b.*>= 0"),
    ({"seq_lens": set_entry("seq_lens", (1, 40))}, r"^block_table\b.*too few"),
    ({"block_table": set_entry("block_table", ((0, 1), 4))}, r"^block_table\b.*\[0, 1\]"),
    ({"block_table": set_entry("block_table", ((1, 0), -1))}, r"^block_table\b.*\[1, 0\]"),
    ({"topk": set_entry("topk", ((0, 3, 1), 1))}, r"^topk\b.*past"),
    ({"topk": set_entry("topk", ((1, 0, 1), 1))}, r"^topk\b.*more than once"),
    ({"k_scale": lambda a: torch.tensor(0.0, device=device())}, r"^k_scale\b.*positive"),
    ({"v_scale": lambda a: torch.full((2, 64), float("inf"), device=device())},
     r"^v_scale\b.*positive"),
])
def test_validate_rejects_bad_contents(changes, match):
    """validate=True checks contents on the host: cu_seqlens_q not starting at 0,
    decreasing or not ending at T, a seq_len below its query length or negative, a block
    table too narrow or with a used entry outside the cache, a selection past the token's
    last visible block or repeating a block, a zero or infinite scale raise ValueError
    naming the argument; the unused -1 entries are accepted."""
    args = _good_args()
    ap.sparse_attention_prefill(**args, validate=True)  # the baseline is valid
    args.update({k: v(args) for k, v in changes.items()})
    with pytest.raises(ValueError, match=match):
        ap.sparse_attention_prefill(**args, validate=True)


def test_registered_with_its_schedule():
    """Registered as implementation "triton" of attention_prefill for cpu and cuda, tiny
    shapes only when interpreted and model shapes when compiled; its schedules (the three
    kinds of rows, all alike for a 16-bit cache): K/V and P in the model dtype,
    running-max tiles of one block, ascending block order, no split-K, output in the
    model dtype."""
    impl = _impl()
    assert impl.devices == ("cpu", "cuda")
    assert ("model" in impl.shape_classes) == (not ap.INTERPRETED)
    assert ("small" in impl.shape_classes) == (not ap.INTERPRETED)
    scheds = impl.schedule("float16")
    assert len(scheds) == 3 and len(set(scheds)) == 1
    s = scheds[0]
    assert (s.kv_dtype, s.p_dtype, s.out_dtype) == ("float16",) * 3
    assert (s.p_max, s.blocks_per_tile, s.order) == ("running", 1, "ascending")
    assert s.blocks_per_split is None
