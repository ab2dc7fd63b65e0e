"""kernels/indexer_prefill.py and kernels/indexer_decode.py: every index format, exact and
near ties, ragged lengths not multiples of P, forced blocks, K past the visible blocks,
padded decode rows, token-major output buffers, split-and-merge, prefill/decode agreement,
both merge strategies, the decode kernel's FMA scan (its compiled default) and its knobs,
guarded and validated bad inputs, judged by the oracle
(oracle.core.checks.run_check, tie-aware) against the reference or compared exactly with it
where fp32 scores are exact. Runs the kernels in the (patched) CPU interpreter when no CUDA
device is present, compiled on a GPU otherwise.

"grid" values are small integers times 2^-3: every dot product is exact in fp32 (and in
every fp8 format), so scores are exactly the reference's and the selection, order
included, must equal the reference's bit for bit, ties (duplicated key blocks) too.
"""

from __future__ import annotations

import functools
from dataclasses import replace

import numpy as np
import pytest
import torch

from kernels import indexer_decode as idd
from kernels import indexer_prefill as ipf
from oracle.core import reference_run as ref
from oracle.core.cases import Case, poison_code
from oracle.core.checks import run_check
from oracle.core.registry import implementations
from oracle.impls import triton as triton_impls
from oracle.impls.adapters import index_q_in, indexer_adapter
from oracle.impls.torch_peer import HALF_DTYPES, device
from reference.codec import decode, round_to
from reference.kv_cache import empty_index_cache, quantize

# The interpreter converts 1-element loop bounds with int() (numpy deprecates it; the
# project pins numpy < 2.4, where it still works).
pytestmark = [pytest.mark.interp,
              pytest.mark.filterwarnings("ignore:Conversion of an array:DeprecationWarning")]

FP8 = ("e4m3fn", "e4m3fnuz", "e5m2", "e5m2fnuz")
FORMATS = ("bfloat16", "float16") + FP8


def _values(bg, shape, kind):
    if kind == "grid":
        return bg.integers(-8, 9, shape) * 0.125
    return bg.normal(size=shape)


def _in_format(values, fmt, md):
    """Values as stored: rounded to the model dtype, then (fp8) to the format (satfinite)."""
    v = round_to(values, md)
    return decode(quantize(v, fmt), fmt) if fmt in FP8 else v


def make_index_inputs(fmt="bfloat16", md=None, hi=3, d=64, page=16, seq_lens=(37, 50),
                      qlens=(5, 19), rows=None, topk=4, local=1, initial=0, seed=0,
                      kind="normal", duplicate=(), extra_cols=1):
    """An oracle input set of op indexer_prefill (``qlens``) or indexer_decode (``rows``),
    built by hand. Pages are shuffled, everything a query must not see is poisoned with NaN
    codes, and ``duplicate`` lists (request, src block, dst block): dst gets a copy of src's
    keys (exact ties)."""
    md = md or (fmt if fmt in HALF_DTYPES else "bfloat16")
    bg = np.random.default_rng(seed)
    seq = np.asarray(seq_lens, np.int64)
    blocks = -(-seq // page)
    num_pages = int(blocks.sum()) + 2
    perm = bg.permutation(num_pages).astype(np.int32)
    table = np.full((len(seq), int(blocks.max(initial=0)) + extra_cols), -1, np.int32)
    used = 0
    for r, nb in enumerate(blocks):
        table[r, :nb] = perm[used:used + nb]
        used += nb
    cache = empty_index_cache(num_pages, page, d, fmt, fill_code=poison_code(fmt))
    keys = quantize(round_to(_values(bg, (num_pages, page, d), kind), md), fmt)
    for r, src, dst in duplicate:
        keys[table[r, dst]] = keys[table[r, src]]
    for r, s in enumerate(seq):
        pos = np.arange(s)
        cache[table[r, pos // page], pos % page] = keys[table[r, pos // page], pos % page]
    total = len(seq) * rows if rows is not None else int(np.sum(qlens))
    q = _in_format(_values(bg, (total, hi, d), kind), fmt, md)
    x = dict(index_q=q, index_cache=cache, index_fmt=fmt, block_table=table, seq_lens=seq,
             topk=topk, local_blocks=local, initial_blocks=initial, model_dtype=md)
    if rows is not None:
        x["rows_per_request"] = rows
    else:
        x["cu_seqlens_q"] = np.concatenate([[0], np.cumsum(qlens)]).astype(np.int32)
    return x


def _op(x):
    return "indexer_decode" if "rows_per_request" in x else "indexer_prefill"


def _impl(op):
    (impl,) = implementations(op, ["triton"])
    return impl


def _passes(x, impl=None):
    """The oracle's tie-aware verdict (selection admissible under the fp32 score bound)."""
    op = _op(x)
    case = Case(op, "tiny", "normal", "cuda", "auto", "bfloat16", "none", 0)
    res = run_check(case, impl or _impl(op), inputs=x)
    assert res.passed, res.summary()


def _reference(x):
    return (ref.indexer_decode if "rows_per_request" in x else ref.indexer_prefill)(x)


def _run(x, **kw):
    """The kernel's selection through the oracle adapter, with launcher options."""
    op = _op(x)
    launch = functools.partial(idd.indexer_decode if op == "indexer_decode"
                               else ipf.indexer_prefill, **kw)
    return indexer_adapter(launch, decode=op == "indexer_decode")(x)["topk"]


def _exact(x, **kw):
    """Grid data: the selection equals the reference's, order included."""
    got = _run(x, **kw)
    want = _reference(x)
    assert np.array_equal(got, want), (got, want)
    return got


# ------------------------------------------------------------------------ formats


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("decode_op", [False, True], ids=["prefill", "decode"])
def test_every_index_format_matches_reference(fmt, decode_op):
    """For bf16 and fp16 caches and all four fp8 formats (e4m3fn, e4m3fnuz as platforms
    use; e5m2, e5m2fnuz for emulation), with Hi = 3, prefixes and lengths not multiples
    of P and NaN-poisoned invisible cache content, the selection is admissible (set equal
    up to near-ties within the fp32 score bound)."""
    if decode_op:
        x = make_index_inputs(fmt, seq_lens=(45, 0, 70), rows=3, topk=3, seed=len(fmt))
    else:
        x = make_index_inputs(fmt, seq_lens=(37, 70), qlens=(9, 23), topk=3, seed=len(fmt))
    _passes(x)


@pytest.mark.parametrize("fmt", FP8)
def test_max_codes_decode_in_their_own_format(fmt):
    """A key of the format's max-finite code (0x7F = 240 in e4m3fnuz, NaN in e4m3fn; 0x7E =
    448 in e4m3fn) makes its block the top one: a reader that decodes fnuz bytes as fn (or
    the reverse) turns it into NaN (ranked last) or misreads it. Reading one format as the
    other otherwise just scales every score, which no selection can see."""
    from reference.codec import FORMATS as CODEC

    x = make_index_inputs(fmt, seq_lens=(90,), qlens=(4,), topk=2, local=0, kind="grid",
                          seed=23)
    x["index_q"] = _in_format(np.abs(x["index_q"]) + 0.125, fmt, "bfloat16")
    top = CODEC[fmt].max_finite
    x["index_cache"][x["block_table"][0, 2], 5] = quantize(np.full(64, top), fmt)
    got = _exact(x)
    assert (got[:, :, 0] == 2).all()


@pytest.mark.parametrize("fmt", ["bfloat16", "e4m3fnuz", "e5m2"])
def test_grid_values_select_exactly_the_reference(fmt):
    """With exact fp32 scores (grid values), prefill and decode select exactly the
    reference's blocks in the reference's order (forced first, then descending score, ties
    to the lower id), for every fp8 decode branch too (hardware and software codec)."""
    _exact(make_index_inputs(fmt, seq_lens=(70, 33), qlens=(20, 7), topk=5, initial=1,
                             kind="grid", seed=3))
    _exact(make_index_inputs(fmt, seq_lens=(70, 33), rows=4, topk=5, initial=1, kind="grid",
                             seed=4))


# --------------------------------------------------------------------------- ties


def test_duplicated_key_blocks_tie_to_the_lower_block_id():
    """Blocks whose keys are copies of another block's score bit-equally: the lower block
    id wins (both selected or the lower one), in prefill and in decode, exactly as the
    reference orders them."""
    dup = [(0, 1, 3), (0, 1, 5), (0, 2, 4), (1, 0, 2)]
    kw = dict(kind="grid", topk=3, local=0, duplicate=dup, seed=5)
    _exact(make_index_inputs(seq_lens=(100, 48), qlens=(30, 10), **kw))
    _exact(make_index_inputs(seq_lens=(100, 48), rows=2, **kw))


def test_all_scores_equal_selects_the_lowest_ids():
    """index_q = 0: every score is 0 (some -0), all tie; the selection is the forced
    blocks, then the lowest block ids, in ascending order."""
    x = make_index_inputs(seq_lens=(90,), qlens=(12,), topk=4, local=1, seed=6)
    x["index_q"] = np.zeros_like(x["index_q"])
    got = _exact(x)
    assert got[0, -1].tolist() == [5, 0, 1, 2]  # p = 89: own block 5 forced


@pytest.mark.parametrize("seed", [1, 2])
@pytest.mark.parametrize("op", ["indexer_prefill", "indexer_decode"])
def test_near_ties_distribution(op, seed):
    """The oracle's "ties" distribution (copied blocks, some nudged by 2^-9 relative: near
    ties within bf16/e4m3 resolution) on tiny cases of every platform's e4m3 and bf16
    formats: admissible under the fp32 score bound."""
    for plat, kv in (("cuda", "fp8"), ("rocm-fnuz", "fp8"), ("cuda", "auto")):
        case = Case(op, "tiny", "ties", plat, kv, "bfloat16", "none", 100 + seed)
        res = run_check(case, _impl(op))
        assert res.passed, res.summary()


def test_nan_scores_rank_last():
    """Keys holding NaN codes (inside the visible range) make their blocks' scores NaN:
    those blocks rank below every number (chosen only when nothing else is left, lower id
    first), exactly as the reference."""
    x = make_index_inputs("e4m3fn", seq_lens=(80,), qlens=(16,), topk=5, local=0,
                          kind="grid", seed=8)
    page = x["index_cache"].shape[1]
    for b in (1, 3):
        x["index_cache"][x["block_table"][0, b], 2, 7] = 0x7F  # NaN
    got = _exact(x)
    last = got[:, -1]  # p = 79: 5 blocks visible, K = 5: the NaN blocks come last
    assert page == 16 and (last[:, 3:] == [1, 3]).all()


# ------------------------------------------------------------------ shapes and rows


def test_k_larger_than_the_visible_blocks_pads_with_minus_one():
    """K = 64 with 1..5 visible blocks: n = p//P + 1 valid entries, then -1."""
    x = make_index_inputs(seq_lens=(70, 3), qlens=(70, 3), topk=64, kind="grid", seed=9)
    got = _exact(x)
    n_valid = (got >= 0).sum(-1)
    pos = np.concatenate([np.arange(70), np.arange(3)])
    assert (n_valid == (pos // 16 + 1)[None, :]).all()


@pytest.mark.parametrize("page, d", [(32, 128), (64, 64), (128, 256)])
def test_page_sizes_and_head_dims(page, d):
    """P = 32, 64, 128 with D = 128, 64, 256 and Hi = 5: lengths not multiples of P,
    prefill and decode admissible."""
    lens = (page * 3 + 5, 2 * page - 1)
    _passes(make_index_inputs(page=page, d=d, hi=5, seq_lens=lens, qlens=(page + 3, 4),
                              topk=2, seed=page))
    _passes(make_index_inputs(page=page, d=d, hi=5, seq_lens=lens, rows=2, topk=2,
                              seed=page + 1))


def test_padded_decode_rows_select_nothing():
    """Requests with seq_len 0 (graph padding) get all -1; the others are unaffected."""
    x = make_index_inputs(seq_lens=(0, 40, 0, 33), rows=2, topk=3, kind="grid", seed=10)
    got = _exact(x)
    assert (got[:, [0, 1, 4, 5]] == -1).all()
    assert (got[:, [2, 3, 6, 7]] >= 0).any(-1).all()


def test_prefill_and_decode_agree_on_the_same_positions():
    """The last rows of a prefill request and the decode rows at the same positions (same
    keys, same queries) select identical blocks in identical order, split or not."""
    x = make_index_inputs("e4m3fn", seq_lens=(77, 50), qlens=(4, 4), topk=4, local=1,
                          initial=1, seed=11)
    pre = _run(x)
    dec = dict(x, rows_per_request=4)
    del dec["cu_seqlens_q"]
    for splits in (1, 3):
        assert np.array_equal(_run(dec, num_splits=splits), pre)
    _passes(x)


def test_token_major_output_buffer():
    """A transposed view of a token-major [T, Hi, K] buffer is written through its strides:
    buf[t, h] equals the head-major output's [h, t]; untouched sentinel cells remain only
    where nothing is meant to be written (nowhere)."""
    x = make_index_inputs(seq_lens=(60, 21), qlens=(6, 5), topk=3, seed=12)
    dev = device()
    args = _launch_args(x, dev)
    head_major = ipf.indexer_prefill(*args, topk=3, local_blocks=1, initial_blocks=0)
    buf = torch.full((11, 3, 3), -7, dtype=torch.int32, device=dev)
    out = ipf.indexer_prefill(*args, topk=3, local_blocks=1, initial_blocks=0,
                              out=buf.transpose(0, 1))
    assert out.data_ptr() == buf.data_ptr()
    assert torch.equal(buf.transpose(0, 1), head_major) and not (buf == -7).any()


def test_t_equal_to_hi_is_not_transposed():
    """T = Hi = 3 (so a [T, Hi, K] buffer read as [Hi, T, K] has the right shape: the
    transposition bug class): with a token-major output buffer the selection is exactly the
    reference's, and differs from its transpose."""
    x = make_index_inputs(seq_lens=(64, 40), qlens=(2, 1), topk=3, kind="grid", seed=22)
    got = _exact(x)  # T odd: the adapter passes a transposed token-major buffer
    assert got.shape == (3, 3, 3) and not np.array_equal(got, got.transpose(1, 0, 2))


# ------------------------------------------------------------------- forced blocks


@pytest.mark.parametrize("local, initial", [(0, 0), (1, 0), (3, 0), (0, 2), (2, 2), (5, 4)])
def test_forced_local_and_initial_blocks(local, initial):
    """Forced blocks with contract.md s.5's precedence (initial before local, lower id first
    when they exceed n = min(K, visible)), K = 3 with 1..7 visible blocks, prefill and
    decode: exactly the reference."""
    kw = dict(kind="grid", topk=3, local=local, initial=initial, seed=13 + local)
    _exact(make_index_inputs(seq_lens=(100, 20), qlens=(40, 20), **kw))
    _exact(make_index_inputs(seq_lens=(100, 20), rows=3, **kw))


# ------------------------------------------------- strategies, splits and tilings


@pytest.mark.parametrize("decode_op", [False, True], ids=["prefill", "decode"])
def test_compiled_strategy_runs_interpreted(decode_op):
    """The tl.dot strategy as compiled (the prefill kernel's default; the decode kernel's
    "dot" scan): replace-min, one block per step, fp32 tiles of 32 dims, key sub-blocks
    smaller than P, 16 rows per program; decode with 3 splits merged by bitonic top-k.
    Selects exactly the reference, with forced initial blocks and exact ties (duplicated
    blocks)."""
    kw = dict(page=32, kind="grid", topk=5, initial=1, duplicate=[(0, 0, 2)], seed=14)
    if decode_op:
        x = make_index_inputs(seq_lens=(150, 0, 64), rows=4, **kw)
        _exact(x, scan="dot", vec=False, block_n=16, block_d=32, num_splits=3)
    else:
        x = make_index_inputs(seq_lens=(150, 64), qlens=(9, 3), **kw)
        _exact(x, vec=False, block_n=16, block_d=32, block_rows=16)


@pytest.mark.parametrize("splits", [1, 2, 5, 64])
def test_decode_split_merge_is_exact(splits):
    """Any number of key-block splits (1 = no merge; more splits than blocks) merges the
    partial top-k lists into the same selection: the reference's."""
    x = make_index_inputs(seq_lens=(130, 17, 64), rows=1, topk=6, local=1, kind="grid",
                          duplicate=[(0, 2, 6)], seed=15)
    _exact(x, num_splits=splits)


def test_small_steps_and_tiles_agree():
    """Vectorised merge with one or two blocks per step, small row tiles (several token
    tiles per request) and D chunks: the same selection as the default tiling."""
    x = make_index_inputs(seq_lens=(99, 40), qlens=(30, 8), topk=6, kind="grid", seed=16)
    want = _exact(x)
    for kw in (dict(blocks_per_step=1, vec=True),
               dict(blocks_per_step=2, block_rows=32, block_d=16, vec=True)):
        assert np.array_equal(_run(x, **kw), want), kw


# ------------------------------------------------ the decode kernel's FMA scan (compiled)


def _fma_impl(**kw):
    """The registered decode implementation running the FMA scan (the compiled default)."""
    launch = functools.partial(idd.indexer_decode, scan="fma", **kw)
    return replace(_impl("indexer_decode"), run=indexer_adapter(launch, decode=True))


@pytest.mark.parametrize("fmt", FORMATS)
def test_fma_scan_every_format_exact(fmt):
    """The FMA scan (exact fp32 products in FMA chains, no padded rows; the compiled
    decode default) on every index format, bf16 read as int32 pairs and element-wise, Hi 3
    with 2 rows per request (6 rows, ROWS 8), a padded request, forced initial blocks, exact
    ties (duplicated blocks): exactly the reference, order included; the FMA-chain
    reduction (compiled) and the interpreter's tl.sum agree."""
    x = make_index_inputs(fmt, seq_lens=(150, 0, 64), rows=2, topk=5, initial=1, page=32,
                          kind="grid", duplicate=[(0, 0, 2)], seed=14)
    want = _exact(x, scan="fma", num_splits=3)
    if fmt == "bfloat16":
        assert np.array_equal(_run(x, scan="fma", num_splits=3, pairs=False), want)
    small = make_index_inputs(fmt, seq_lens=(40, 17), rows=1, hi=2, topk=3, kind="grid",
                              seed=24)
    _exact(small, scan="fma", fma_chain=True, num_splits=2)


@pytest.mark.parametrize("kw", [
    dict(lanes_d=1), dict(lanes_d=2, block_n=8), dict(lanes_d=8, block_n=4, num_warps=1),
    dict(block_n=32, num_warps=8), dict(num_stages=1), dict(blocks_per_split=1),
    dict(blocks_per_split=3), dict(blocks_per_split=100), dict(num_splits=64),
    dict(num_splits=64, merge_chunk=2), dict(num_splits=5, merge_chunk=1),
    dict(num_splits=6, merge="topk"), dict(num_splits=6, merge_chunk=2, merge="topk"),
], ids=lambda kw: ",".join(f"{k}={v}" for k, v in kw.items()))
def test_fma_knobs_select_identically(kw):
    """Every FMA-scan knob (lanes along D, keys per tile, warps, pipeline stages, blocks
    per split: at most BK blocks (slots filled directly) or more (replace-min), more splits
    than blocks, merge chunks of 1..16 partial lists, presorted lists or a whole top-k)
    gives exactly the reference's selection."""
    x = make_index_inputs("bfloat16", seq_lens=(300, 64, 7), rows=1, hi=5, d=128, page=32,
                          topk=6, local=1, kind="grid", duplicate=[(0, 2, 6), (0, 3, 8)],
                          seed=25)
    _exact(x, scan="fma", **kw)


@pytest.mark.parametrize("rows, hi", [(1, 1), (1, 4), (3, 3), (4, 2)])
def test_fma_rows_and_heads(rows, hi):
    """1..4 rows per request with 1..4 index heads (1..12 rows per program, powers of two
    and not): each row its own position, causal inside the last block, exactly the
    reference."""
    x = make_index_inputs("e4m3fn", seq_lens=(97, 33), rows=rows, hi=hi, topk=4, local=1,
                          initial=1, kind="grid", seed=26 + rows * hi)
    _exact(x, scan="fma", num_splits=2)


def test_fma_nan_scores_rank_last_and_bad_pages_never_fault():
    """FMA scan: NaN keys on visible positions make their blocks rank last (NaN-propagating
    max), NaN content past the position (the poisoned tail) changes nothing; out-of-range
    block-table entries read nothing, the other request's selection is unaffected."""
    x = make_index_inputs("e4m3fn", seq_lens=(80, 45), rows=1, topk=5, local=0, kind="grid",
                          seed=27)
    for b in (1, 3):
        x["index_cache"][x["block_table"][0, b], 2, 7] = 0x7F  # NaN
    got = _exact(x, scan="fma", num_splits=2)
    assert (got[:, 0, 3:] == [1, 3]).all()
    bad = dict(x, block_table=x["block_table"].copy())
    bad["block_table"][0, 2] = -5
    bad["block_table"][0, 4] = 10**6
    launch = functools.partial(idd.indexer_decode, scan="fma", num_splits=2, validate=False)
    out = indexer_adapter(launch, True)(bad, validate=False)["topk"]
    assert np.array_equal(out[:, 1], _reference(x)[:, 1])
    assert ((out[:, 0] >= -1) & (out[:, 0] < 5)).all()


@pytest.mark.parametrize("seed", [1, 2])
def test_fma_scan_admissible_under_the_oracle(seed):
    """The FMA scan on the oracle's tiny cases (normal values, exact and near ties,
    outliers, tiny magnitudes; every platform's e4m3 and bf16 / fp16 caches): admissible
    under the fp32 score bound (score_rel 0: another fp32 summation order than the
    reference's is inside it)."""
    impl = _fma_impl()
    for dist, plat, kv, md in (("normal", "cuda", "auto", "bfloat16"),
                               ("ties", "cuda", "fp8", "bfloat16"),
                               ("ties", "rocm-fnuz", "fp8", "bfloat16"),
                               ("outliers", "cuda", "auto", "float16"),
                               ("tiny", "cuda", "fp8", "bfloat16")):
        case = Case("indexer_decode", "tiny", dist, plat, kv, md, "none", 200 + seed)
        res = run_check(case, impl)
        assert res.passed, res.summary()


@pytest.mark.parametrize("fmt", FORMATS)
def test_mma_scan_every_format_exact(fmt):
    """The tensor-core scan (``scan="mma"``: whole key blocks by one tl.dot on 16-bit
    operands, fp8 decoded exactly to fp16) on every index format, Hi 3 with 2 rows per
    request (6 rows padded to 16), a padded request, forced initial blocks, exact ties
    (duplicated blocks), NaN keys on visible positions (their blocks rank last):
    exactly the reference, order included."""
    x = make_index_inputs(fmt, seq_lens=(150, 0, 64), rows=2, topk=5, initial=1, page=32,
                          kind="grid", duplicate=[(0, 0, 2)], seed=14)
    if fmt not in ("bfloat16", "float16"):
        x["index_cache"][x["block_table"][0, 3], 2, 7] = 0x7F if "fnuz" not in fmt else 0x80
    got = _exact(x, scan="mma", num_splits=3)
    if fmt not in ("bfloat16", "float16"):
        assert (got[:, 0:2, 4] == 3).all()  # the NaN block: last of the 5 selected


@pytest.mark.parametrize("kw", [dict(num_stages=1), dict(num_warps=8, blocks_per_split=3),
                                dict(blocks_per_split=100), dict(num_splits=64),
                                dict(blocks_per_step=2, blocks_per_split=3),
                                dict(blocks_per_step=4, num_splits=2),
                                dict(num_splits=10, merge_chunk=2)],
                         ids=lambda kw: ",".join(f"{k}={v}" for k, v in kw.items()))
def test_mma_knobs_select_identically(kw):
    """MMA-scan knobs (pipeline stages, warps, at most BK blocks per split (slots filled
    directly) or more (replace-min), more splits than blocks, 2 or 4 blocks per dot with a
    split that is not a multiple of them, a merge of 10 presorted lists in steps of 2:
    the first two steps loaded together, the later ones merged as runs) give exactly the
    reference's selection."""
    x = make_index_inputs("bfloat16", seq_lens=(300, 64, 7), rows=1, hi=5, d=64, page=32,
                          topk=6, local=1, kind="grid", duplicate=[(0, 2, 6), (0, 3, 8)],
                          seed=25)
    _exact(x, scan="mma", **kw)


FLAT_GRIDS = ["flat", "proportional"]


@pytest.mark.parametrize("grid", FLAT_GRIDS)
@pytest.mark.parametrize("fmt", ["bfloat16", "e4m3fn", "e5m2fnuz"])
def test_flat_grid_every_format_exact(fmt, grid):
    """The flat kernel's partitions (``grid="flat"``: the batch's key blocks laid end to
    end, equal ranges per program, ranges straddling requests; ``"proportional"``: each
    request cut into its own programs) on bf16 and fp8 caches, Hi 3 with 2 rows per
    request, padded requests in the middle and at the end, forced initial blocks, exact
    ties, a NaN key on a visible position: exactly the reference, order included."""
    x = make_index_inputs(fmt, seq_lens=(150, 0, 64, 97, 0), rows=2, topk=5, initial=1,
                          page=32, kind="grid", duplicate=[(0, 0, 2)], seed=14)
    if fmt != "bfloat16":
        x["index_cache"][x["block_table"][0, 3], 2, 7] = 0x7F if "fnuz" not in fmt else 0x80
    got = _exact(x, grid=grid)
    if fmt != "bfloat16":
        assert (got[:, 0:2, 4] == 3).all()  # the NaN block: last of the 5 selected
    assert (got[:, 2:4] == -1).all() and (got[:, 8:10] == -1).all()  # padded requests


@pytest.mark.parametrize("kw", [dict(num_programs=1), dict(num_programs=2),
                                dict(num_programs=5), dict(num_programs=64),
                                dict(num_programs=4, merge_chunk=2),
                                dict(num_programs=12, merge_chunk=2),
                                dict(num_programs=3, merge="topk"),
                                dict(num_programs=2, num_stages=1, num_warps=8)],
                         ids=lambda kw: ",".join(f"{k}={v}" for k, v in kw.items()))
@pytest.mark.parametrize("grid", FLAT_GRIDS)
def test_flat_grid_knobs_select_identically(kw, grid):
    """Any number of programs (one for the whole batch, looping over the flat ranges; the
    proportional grid raised to one per request; more than the batch's blocks, the last
    ones idle), merge chunks
    smaller than a request's partial lists, the whole top-k merge, other warps / stages:
    exactly the reference's selection, 1 row of 5 heads and a request of 10 blocks beside
    ones of 1 and 3."""
    x = make_index_inputs("bfloat16", seq_lens=(300, 7, 64, 33), rows=1, hi=5, d=64,
                          page=32, topk=6, local=1, kind="grid",
                          duplicate=[(0, 2, 6), (0, 3, 8)], seed=25)
    _exact(x, grid=grid, **kw)


@pytest.mark.parametrize("grid", ["split"] + FLAT_GRIDS)
def test_a_reused_workspace_stays_exact_across_calls(grid):
    """A ``Workspace`` kept across calls (a server's scratch: no allocation and no counter
    fill per call): batches growing and shrinking, padded requests, every call exactly
    the reference's selection, and the ticket counters all zero after every call (the
    last ticket of a request resets its counter: the next call's merge depends on it)."""
    from kernels._host import Workspace
    from oracle.impls.torch_peer import device

    ws = Workspace()
    knobs = {} if grid == "split" else {"grid": grid, "num_programs": 5}
    for seq_lens, seed in (((150, 64), 40), ((90, 0, 33, 130, 7), 41), ((64,), 42),
                           ((0, 200, 97), 43)):
        x = make_index_inputs("bfloat16", seq_lens=seq_lens, rows=1, hi=2, d=64, page=16,
                              topk=4, local=1, kind="grid", duplicate=[(0, 0, 2)], seed=seed)
        _exact(x, workspace=ws, **({"num_splits": 3} if grid == "split" else knobs))
        held = ws.held("counters", device())
        assert held is not None and held.numel() >= len(seq_lens)
        assert not held.any().item()
    held[0] = 1  # as a launch that died would leave it: validate=True refuses the workspace
    with pytest.raises(ValueError, match="^workspace must hold zero ticket counters"):
        _run(x, workspace=ws, validate=True)


@pytest.mark.parametrize("grid", FLAT_GRIDS)
def test_flat_grid_passes_over_seq_lens_in_tiles(grid, monkeypatch):
    """The flat kernel's running sums over seq_lens in tiles of RB requests (one tile up
    to 64 requests, or 1024 for the proportional grid: the tests' batches fit one)
    carried from tile to tile: tiles of 2 requests over a batch of 7, padding in three
    tiles, give exactly the reference's selection."""
    from kernels import indexer_decode_flat as fg

    monkeypatch.setattr(fg, "tile_requests", lambda batch, proportional: 2)
    x = make_index_inputs("bfloat16", seq_lens=(0, 90, 33, 0, 130, 7, 0), rows=1, hi=2,
                          d=64, page=16, topk=4, local=1, kind="grid",
                          duplicate=[(1, 1, 3)], seed=31)
    _exact(x, grid=grid, num_programs=9)


@pytest.mark.gpu
@pytest.mark.parametrize("grid", ["split"] + FLAT_GRIDS)
def test_programmatic_dependent_launch_selects_exactly(grid):
    """``pdl=True`` (the kernel waits for the stream's previous kernel, then lets the next
    one launch) on every grid, with a workspace, several calls in a row on one stream, each
    right after the inputs were written: exactly the reference's selection every time."""
    from kernels._host import Workspace

    ws = Workspace()
    for seed in (50, 51, 52):
        x = make_index_inputs("e4m3fn", seq_lens=(300, 0, 77, 1000), rows=2, hi=4, d=128,
                              page=64, topk=8, local=1, initial=1, kind="grid",
                              duplicate=[(0, 1, 3)], seed=seed)
        _exact(x, pdl=True, workspace=ws, **({} if grid == "split" else {"grid": grid}))


@pytest.mark.gpu
@pytest.mark.parametrize("grid", FLAT_GRIDS)
@pytest.mark.parametrize("cache,per_sm", [("e4m3", 4), ("bf16", 3)])
def test_flat_grid_default_is_one_full_wave(cache, per_sm, grid):
    """At the benchmark's model shape the flat kernel's default launch (either partition)
    runs one wave of as many programs per SM as the split grid holds (e4m3: 4, shared
    memory and the register cap allowing; bf16: 3, by shared memory): a traced launch
    stamps exactly that many programs x SMs, each starting within the first microseconds
    (no second wave)."""
    from benchmarks import bench_indexer as bix
    from kernels._trace import trace_buffer

    fmt = bix.CACHES[cache]
    t = bix.make_set(bix.BATCH, bix.SEQ_LEN, fmt, 0)
    s = bix.SHAPE
    buf = trace_buffer(4096, t.cache.device)
    idd.indexer_decode(t.index_q, t.cache, fmt, t.table, t.seq_lens, t.rows, topk=s.topk,
                       local_blocks=s.local_blocks, initial_blocks=s.initial_blocks,
                       out=t.out.transpose(0, 1), grid=grid, trace=buf)
    rows = buf.cpu().numpy()
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    stamped = rows[rows[:, 1] > 0]
    assert len(stamped) == per_sm * sms
    assert (stamped[:, 1] - stamped[:, 1].min()).max() < 20_000  # ns: all started at once


def test_flat_grid_ranges_cover_every_block_once():
    """The flat grid's partition (the kernel's arithmetic, redone here): for G programs and
    T blocks, the first G' = max(1, min(G, T // MIN_BLOCKS)) programs take [floor(p T /
    G'), floor((p + 1) T / G')), the rest nothing; each block is covered once, ranges
    differ by at most one block and hold at least MIN_BLOCKS (T >= MIN_BLOCKS), the owner
    formula finds each block's program, and no request is touched by more programs than
    its workspace holds (``workspace_slots``). At the model shape (64 x 256 blocks, 528
    programs) every program reads 31 or 32 blocks."""
    from kernels import indexer_decode_flat as fg

    def ranges(total, g):
        used = max(1, min(g, total // fg.MIN_BLOCKS))
        return used, [(min(p * total // used, total), min((p + 1) * total // used, total))
                      for p in range(g)]

    used, model = ranges(64 * 256, 528)
    assert used == 528 and {hi - lo for lo, hi in model} == {31, 32}
    bg = np.random.default_rng(3)
    for _ in range(300):
        width = int(bg.integers(1, 40))
        nb = bg.integers(0, width + 1, size=int(bg.integers(1, 12)))
        total = int(nb.sum())
        g = int(bg.integers(1, 600))
        used, rs = ranges(total, g)
        seen = np.zeros(total, np.int64)
        for p, (lo, hi) in enumerate(rs):
            seen[lo:hi] += 1
            assert p < used or lo == hi
            if p < used and total >= fg.MIN_BLOCKS:
                assert hi - lo >= fg.MIN_BLOCKS
            for x in range(lo, hi):
                assert ((x + 1) * used + total - 1) // total - 1 == p
        assert (seen == 1).all()
        sizes = [hi - lo for lo, hi in rs[:used]]
        assert max(sizes) - min(sizes) <= 1
        starts = np.concatenate([[0], np.cumsum(nb)[:-1]])
        for s0, n in zip(starts, nb):
            if n:
                first = ((s0 + 1) * used + total - 1) // total - 1
                last = ((s0 + n) * used + total - 1) // total - 1
                assert last - first + 1 <= fg.workspace_slots(width)


def _proportional(nb, g, min_blocks):
    """The proportional grid's partition (the kernel's arithmetic, redone here): the unit
    U and each request's program count."""
    total, busy = int(nb.sum()), int((nb > 0).sum())
    lo = max(-(-total // g), min_blocks)
    hi = max(-(-total // (g - busy)) if g > busy else int(nb.max(initial=1)), lo)
    parts = lambda u: -(-nb // u)  # noqa: E731
    unit = next(u for u in range(lo, hi + 1) if parts(u).sum() <= g or u == hi)
    return unit, parts(unit)


def test_proportional_partition_fits_the_grid_and_bounds_the_work():
    """The proportional grid's unit: the model shape (64 x 256 blocks) on 528 programs
    (e4m3, 4 per SM) gives the split grid's partition, 64 x 8 programs of 32 blocks, and
    on 396 (bf16, 3 per SM) its 64 x 6; ragged 4k-60k contexts fill at most the grid
    with at most U <= cdiv(T, G - B') blocks a program. Random batches: the programs
    number at most G whenever G > B' (else one per request), U is the smallest unit that
    fits, each request's cuts floor(s nb / S) cover its blocks once with pieces differing
    by at most one block, and S never exceeds the workspace (``workspace_slots``)."""
    from benchmarks.bench_indexer import context_lengths
    from kernels import indexer_decode_flat as fg

    unit, parts = _proportional(np.full(64, 256), 528, fg.MIN_BLOCKS)
    assert unit == 32 and set(parts) == {8}
    unit, parts = _proportional(np.full(64, 256), 396, fg.MIN_BLOCKS)
    assert set(parts) == {6} and unit == 43
    nb = -(-np.asarray(context_lengths(64, 32768, ragged=True)) // 128)
    unit, parts = _proportional(nb, 528, fg.MIN_BLOCKS)
    assert parts.sum() <= 528 and unit <= -(-nb.sum() // (528 - 64))
    bg = np.random.default_rng(5)
    for _ in range(300):
        width = int(bg.integers(1, 60))
        nb = bg.integers(0, width + 1, size=int(bg.integers(1, 30)))
        g = int(bg.integers(1, 200))
        unit, parts = _proportional(nb, g, fg.MIN_BLOCKS)
        busy = int((nb > 0).sum())
        if g > busy:
            assert parts.sum() <= g
        else:
            assert (parts == (nb > 0)).all()  # one program each
        if unit > max(-(-int(nb.sum()) // g), fg.MIN_BLOCKS):
            assert (-(-nb // (unit - 1))).sum() > g  # no smaller unit fits
        for n, s in zip(nb, parts):
            cuts = [i * n // s for i in range(s + 1)] if s else [0]
            assert cuts[-1] == n and (s == 0 or max(np.diff(cuts)) - min(np.diff(cuts)) <= 1)
            assert s <= fg.workspace_slots(width)


def test_wave_splits_fill_one_wave():
    """The compiled MMA scan's default split fills the GPU's resident programs in one wave
    (B x S <= slots, as many splits as fit), at least MIN_BLOCKS_PER_SPLIT blocks per split
    and never more splits than blocks: model shape B 64 x 256 blocks on 132 SMs at 3
    (bf16) and 6 (fp8) programs per SM."""
    assert idd.wave_splits(396, 64, 256) == (6, 43)
    assert idd.wave_splits(792, 64, 256) == (12, 22)
    assert idd.wave_splits(396, 1000, 256) == (1, 256)  # more requests than slots
    assert idd.wave_splits(396, 1, 256) == (64, idd.MIN_BLOCKS_PER_SPLIT)
    assert idd.wave_splits(396, 1, 3) == (1, 3)  # fewer blocks than the minimum split
    for slots, b, w in ((396, 64, 256), (792, 8, 100), (264, 7, 33), (132, 1, 1)):
        s, bps = idd.wave_splits(slots, b, w)
        assert (s - 1) * bps < w <= s * bps and (b * s <= slots or s == 1)


def test_fma_strategy_defaults():
    """The FMA scan's defaults: 4 lanes along D, more while the rows' q vectors would need
    more than 128 registers per thread; one key per thread per tile."""
    assert idd.fma_strategy(4, 128, 128, False) == (4, 32, 4, 3)
    assert idd.fma_strategy(16, 128, 128, False) == (16, 8, 4, 3)
    assert idd.fma_strategy(4, 16, 64, True)[:2] == (4, 16)


# ------------------------------------------------------------------ guards and validation


def _launch_args(x, dev):
    fmt = x["index_fmt"]
    q = index_q_in(np.asarray(x["index_q"]), fmt, dev)
    from oracle.impls.io import strided_codes_in

    ic = strided_codes_in(x["index_cache"], dev, HALF_DTYPES.get(fmt))
    bt = torch.from_numpy(np.ascontiguousarray(x["block_table"])).to(dev)
    seq = torch.from_numpy(np.ascontiguousarray(x["seq_lens"])).to(dev)
    if "rows_per_request" in x:
        return q, ic, fmt, bt, seq, x["rows_per_request"]
    cu = torch.from_numpy(np.ascontiguousarray(x["cu_seqlens_q"])).to(dev)
    return q, ic, fmt, bt, cu, seq


def test_bad_block_table_entries_never_fault():
    """validate=False with block-table entries out of range (negative, past the cache) for
    one request: the call completes, and the other request's selection is unaffected."""
    for decode_op in (False, True):
        kw = dict(rows=2) if decode_op else dict(qlens=(5, 7))
        x = make_index_inputs(seq_lens=(70, 40), topk=3, kind="grid", seed=17, **kw)
        want = _reference(x)
        bad = dict(x, block_table=x["block_table"].copy())
        bad["block_table"][0, 1] = -5
        bad["block_table"][0, 3] = 10**6
        launch = functools.partial(idd.indexer_decode if decode_op else ipf.indexer_prefill,
                                   validate=False)
        got = indexer_adapter(launch, decode_op)(bad, validate=False)["topk"]
        first = 2 if decode_op else 5  # the good request's rows
        assert np.array_equal(got[:, first:], want[:, first:])
        assert ((got[:, :first] >= -1) & (got[:, :first] < 5)).all()  # ids or -1


def _good(decode_op=False, fmt="e4m3fn"):
    kw = dict(rows=2) if decode_op else dict(qlens=(3, 4))
    x = make_index_inputs(fmt, seq_lens=(40, 20), topk=3, seed=18, **kw)
    names = (("index_q", "index_cache", "index_fmt", "block_table", "seq_lens",
              "rows_per_request") if decode_op else
             ("index_q", "index_cache", "index_fmt", "block_table", "cu_seqlens_q",
              "seq_lens"))
    args = dict(zip(names, _launch_args(x, device())))
    args.update(topk=3, local_blocks=1, initial_blocks=0)
    return args


def _bad(name, decode_op=False, **changes):
    def make():
        args = _good(decode_op)
        args.update({k: (v(args) if callable(v) else v) for k, v in changes.items()})
        return args
    return pytest.param(make, name, decode_op,
                        id=f"{'decode' if decode_op else 'prefill'}-{name}-{'-'.join(changes)}")


@pytest.mark.parametrize("make, name, decode_op", [
    _bad("index_fmt", index_fmt="fp8"),
    _bad("index_fmt", index_fmt="e4m3"),
    _bad("index_cache", index_cache=lambda a: a["index_cache"].to(torch.int16)),
    _bad("index_cache", index_cache=lambda a: a["index_cache"][:, :8]),
    _bad("index_cache", index_cache=lambda a: a["index_cache"][..., :48]),
    _bad("index_cache", index_cache=lambda a: a["index_cache"].transpose(1, 2)),
    _bad("index_cache", index_cache=[[0]]),
    _bad("index_q", index_q=lambda a: a["index_q"].to(torch.float32)),
    _bad("index_q", index_q=lambda a: a["index_q"][..., :32]),
    _bad("index_q", index_q=lambda a: a["index_q"].new_zeros(7, 9, 64)),
    _bad("index_q", index_q=lambda a: a["index_q"].transpose(0, 2).contiguous().transpose(0, 2)),
    _bad("block_table", block_table=lambda a: a["block_table"].float()),
    _bad("block_table", block_table=lambda a: a["block_table"][0]),
    _bad("seq_lens", seq_lens=lambda a: a["seq_lens"][:1]),
    _bad("seq_lens", seq_lens=lambda a: a["seq_lens"].float()),
    _bad("cu_seqlens_q", cu_seqlens_q=lambda a: a["cu_seqlens_q"][:2]),
    _bad("topk", topk=0),
    _bad("topk", topk=65),
    _bad("topk", topk=2.0),
    _bad("local_blocks", local_blocks=-1),
    _bad("initial_blocks", initial_blocks=None),
    _bad("out", out=lambda a: torch.zeros(3, 7, 3, dtype=torch.int64, device=device())),
    _bad("out", out=lambda a: torch.zeros(3, 7, 4, dtype=torch.int32, device=device())),
    _bad("max_query_len", max_query_len=-1),
    _bad("block_rows", block_rows=24),
    _bad("block_n", block_n=12),
    _bad("block_d", block_d=128),
    _bad("blocks_per_step", blocks_per_step=3),
    _bad("blocks_per_step", blocks_per_step=2, vec=False),
    _bad("rows_per_request", True, rows_per_request=5),
    _bad("rows_per_request", True, rows_per_request=0),
    _bad("index_q", True, rows_per_request=1),
    _bad("num_splits", True, num_splits=0),
    _bad("blocks_per_split", True, blocks_per_split=0),
    _bad("blocks_per_split", True, blocks_per_split=2, num_splits=2),
    _bad("scan", True, scan="tensor"),
    _bad("lanes_d", True, scan="fma", lanes_d=3),
    _bad("lanes_d", True, scan="fma", lanes_d=8),  # e4m3, D 64: 4 vectors of 16 bytes
    _bad("lanes_d", True, scan="dot", lanes_d=4),
    _bad("block_n", True, scan="fma", block_n=32),  # P = 16
    _bad("num_stages", True, scan="fma", num_stages=0),
    _bad("num_warps", True, scan="fma", num_warps=3),
    _bad("vec", True, scan="fma", vec=True),
    _bad("block_d", True, scan="fma", block_d=16),
    _bad("pairs", True, scan="fma", pairs=True),  # an e4m3 cache
    _bad("lanes_d", True, scan="mma", lanes_d=4),
    _bad("block_n", True, scan="mma", block_n=16),
    _bad("blocks_per_step", True, scan="mma", blocks_per_step=8),
    _bad("fma_chain", True, scan="fma", fma_chain="yes"),
    _bad("merge_chunk", True, merge_chunk=3),
    _bad("merge", True, scan="fma", merge="rank"),
    _bad("grid", True, grid="rows"),
    _bad("num_programs", True, num_programs=4),
    _bad("pdl", True, pdl="yes"),
    _bad("workspace", True, workspace={}),
    _bad("num_programs", True, grid="flat", num_programs=0),
    _bad("num_splits", True, grid="flat", num_splits=2),
    _bad("blocks_per_step", True, grid="flat", blocks_per_step=2),
    _bad("scan", True, grid="flat", scan="fma"),
    _bad("num_splits", True, grid="proportional", num_splits=2),
    _bad("scan", True, grid="proportional", scan="dot"),
    _bad("merge", True, scan="dot", vec=True, merge="topk"),
    # A CPU buffer: refused interpreted (no timer) and compiled (another device).
    _bad("trace", True, scan="fma", trace=lambda a: torch.zeros(64, 4, dtype=torch.int64)),
    _bad("trace", True, scan="dot", trace=lambda a: torch.zeros(64, 4, dtype=torch.int64)),
])
def test_bad_host_input_raises_value_error_naming_it(make, name, decode_op):
    """Wrong dtypes, shapes, strides, formats, K / forced-block counts, output buffers and
    tuning knobs raise ValueError whose message starts with the argument's name, before
    any launch."""
    args = make()
    launch = idd.indexer_decode if decode_op else ipf.indexer_prefill
    with pytest.raises(ValueError, match=rf"^{name}\b"):
        launch(**args)


@pytest.mark.parametrize("decode_op, change, match", [
    (False, dict(block_table=(0, 1, 99)), r"^block_table\b.*block_table\[0, 1\] = 99"),
    (True, dict(block_table=(1, 0, -1)), r"^block_table\b.*block_table\[1, 0\] = -1"),
    (False, dict(seq_lens=(3, 99)), r"^block_table\b.*needs 7 blocks"),
    (True, dict(seq_lens=(1, 20)), r"^seq_lens\b.*>= rows_per_request"),
    (True, dict(seq_lens=(-3, 20)), r"^seq_lens\b.*>= rows_per_request"),
    (False, dict(seq_lens=(2, 20)), r"^cu_seqlens_q\b.*request 0 3 new tokens"),
    (False, dict(cu=(0, 3, 6)), r"^cu_seqlens_q\b.*from 0 to T=7"),
    (False, dict(max_query_len=3), r"^max_query_len\b"),
])
def test_validate_rejects_bad_contents(decode_op, change, match):
    """validate=True checks contents on the host: block-table entries used by a request
    out of range, a table too narrow for seq_lens, decode seq_lens neither 0 nor >= rows,
    cu_seqlens_q inconsistent with T or seq_lens, max_query_len too small: ValueError
    naming the argument, nothing written."""
    args = _good(decode_op)
    dev = device()
    if "block_table" in change:
        r, c, v = change["block_table"]
        args["block_table"][r, c] = v
    if "seq_lens" in change:
        args["seq_lens"] = torch.tensor(change["seq_lens"], dtype=torch.int32, device=dev)
    if "cu" in change:
        args["cu_seqlens_q"] = torch.tensor(change["cu"], dtype=torch.int32, device=dev)
    if "max_query_len" in change:
        args["max_query_len"] = change["max_query_len"]
    out = torch.full((3, args["index_q"].shape[0], 3), -7, dtype=torch.int32, device=dev)
    launch = idd.indexer_decode if decode_op else ipf.indexer_prefill
    with pytest.raises(ValueError, match=match):
        launch(**args, out=out, validate=True)
    assert (out == -7).all()


@pytest.mark.parametrize("decode_op", [False, True], ids=["prefill", "decode"])
def test_good_host_input_runs_validated(decode_op):
    """The valid baseline of the validation tests runs with validate=True and returns the
    head-major output it allocated."""
    args = _good(decode_op)
    launch = idd.indexer_decode if decode_op else ipf.indexer_prefill
    out = launch(**args, validate=True)
    assert out.shape == (3, args["index_q"].shape[0], 3) and out.dtype == torch.int32
    assert out.is_contiguous() and (out[:, :, 0] >= 0).all()


def test_no_tokens_launches_nothing(monkeypatch):
    """T = 0 (no new tokens; no decode requests): nothing is launched, the empty output is
    returned."""
    class NoLaunch:
        def __getitem__(self, grid):
            raise AssertionError("launched for T = 0")

    monkeypatch.setattr(ipf, "_indexer_prefill_kernel", NoLaunch())
    monkeypatch.setattr(idd, "_indexer_decode_kernel", NoLaunch())
    x = make_index_inputs(seq_lens=(10,), qlens=(0,), topk=2, seed=19)
    assert _run(x).shape == (3, 0, 2)
    x = make_index_inputs(seq_lens=(), rows=2, topk=2, seed=19, extra_cols=1)
    assert _run(x).shape == (3, 0, 2)


@pytest.mark.parametrize("op", ["indexer_prefill", "indexer_decode"])
def test_registered_for_cpu_and_cuda(op):
    """Registered as implementation "triton" of both indexer ops; model shapes only when
    compiled. Declared score error: 0 (full fp32 accumulation) for prefill and for the
    interpreted decode kernel ("dot" scan); compiled, the decode kernel's MMA scan declares
    its tensor-core accumulation, the fp8 one (hardware formats) wider than the 16-bit one
    (fnuz formats decoded to fp16, bf16 / fp16 caches)."""
    from oracle.core.registry import score_rel_for

    impl = _impl(op)
    assert impl.devices == ("cpu", "cuda")
    interpreted = (ipf if op == "indexer_prefill" else idd).INTERPRETED
    assert ("model" in impl.shape_classes) == (not interpreted)
    rel = {f: score_rel_for(impl, {"index_fmt": f}) for f in FORMATS}
    if op == "indexer_prefill" or interpreted:
        assert set(rel.values()) == {0.0}
    else:
        assert rel["e4m3fn"] == rel["e5m2"] == triton_impls.F8MMA_SCORE_REL
        assert rel["e4m3fnuz"] == rel["bfloat16"] == triton_impls.MMA_SCORE_REL
        assert triton_impls.MMA_SCORE_REL < triton_impls.F8MMA_SCORE_REL


def test_oracle_rejects_a_wrong_selection():
    """The check has power here: the kernel's output with one selected block swapped for an
    unselected, clearly lower-scoring one fails."""
    x = make_index_inputs(seq_lens=(90,), qlens=(3,), topk=2, local=0, seed=20)
    out = _run(x)
    bad = out.copy()
    chosen = set(bad[0, -1].tolist())
    bad[0, -1, 1] = next(b for b in range(6) if b not in chosen)
    impl = replace(_impl("indexer_prefill"), run=lambda _x: {"topk": bad})
    case = Case("indexer_prefill", "tiny", "normal", "cuda", "auto", "bfloat16", "none", 0)
    assert not run_check(case, impl, inputs=x).passed
