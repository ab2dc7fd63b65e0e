"""The fused norm + RoPE + KV insert reference and reshape_and_cache (contract.md s.3, s.4)."""

import numpy as np
import pytest

from oracle.core import rand
from reference.codec import FP8_FORMATS, decode, encode, round_to
from reference.fused import fused_qknorm_rope_insert, reshape_and_cache
from reference.kv_cache import empty_cache, empty_index_cache, insert_index_k, insert_kv
from reference.norm_rope import KINDS, QKVLayout, rope_table, transform_qkv_rows

HKV, HQ, HI, DIM, ROT, PAGE, PAGES = 2, 4, 2, 32, 12, 16, 6
INDEXED = QKVLayout(HQ, HKV, DIM, num_index_heads=HI, has_index_k=True)
DENSE = QKVLayout(HQ, HKV, DIM)
EPS = 1e-6
SENTINEL = {np.dtype(np.uint8): 0x7F, np.dtype(np.uint16): 0x7FC0}


def make_inputs(seed, layout, n, model_dtype="bfloat16", scale=3.0):
    """Packed rows (model-dtype values), positions, weights and the table of one case."""
    bg = rand.generator(seed)
    rows = round_to(scale * rand.normal(bg, (n, layout.row_width)), model_dtype)
    weights = {kind: round_to(0.3 * rand.normal(bg, (DIM,)), model_dtype) for kind in KINDS}
    table = rope_table(512, ROT, 5e6, model_dtype)
    positions = rand.integers(bg, 0, 512, (n,))
    return dict(rows=rows, positions=positions, layout=layout, weights=weights, table=table,
                rotary_dim=ROT, eps=EPS, model_dtype=model_dtype)


def kv_cache(fmt):
    cache = empty_cache(PAGES, HKV, PAGE, DIM, fmt)
    cache[...] = SENTINEL[cache.dtype]
    return cache


def index_cache(fmt):
    cache = empty_index_cache(PAGES, PAGE, DIM, fmt)
    cache[...] = SENTINEL[cache.dtype]
    return cache


def distinct_slots(seed, n, n_negative):
    bg = rand.generator(seed)
    slots = rand.permutation(bg, PAGES * PAGE)[:n].astype(np.int64)
    slots[rand.permutation(bg, n)[:n_negative]] = -1
    return slots


@pytest.mark.parametrize("kv_fmt", FP8_FORMATS + ("bfloat16",))
@pytest.mark.parametrize("index_fmt", ["bfloat16", "e4m3fn", "e4m3fnuz"])
@pytest.mark.parametrize("own_index_slots", [False, True])
def test_fused_equals_the_composition_of_its_parts(kv_fmt, index_fmt, own_index_slots):
    """The fused reference equals transform_qkv_rows, then insert_kv of the exact K and
    the v part (quantize_from="value", per-(head, slot) scales on fp8), then
    insert_index_k of the exact index_k at index_slot_mapping (default: slot_mapping)."""
    n = 20
    inputs = make_inputs(1, INDEXED, n)
    slots = distinct_slots(2, n, 4)
    index_slots = distinct_slots(3, n, 6) if own_index_slots else None
    bg = rand.generator(4)
    fp8 = kv_fmt in FP8_FORMATS
    ks = np.float32(0.1 + rand.uniform(bg, (HKV, PAGES * PAGE))) if fp8 else None
    vs = np.float32(0.1 + rand.uniform(bg, (HKV, PAGES * PAGE))) if fp8 else None
    kv, ic = kv_cache(kv_fmt), index_cache(index_fmt)
    out = fused_qknorm_rope_insert(**inputs, kv_cache=kv, kv_fmt=kv_fmt, slot_mapping=slots,
                                   k_scale=ks, v_scale=vs, index_cache=ic, index_fmt=index_fmt,
                                   index_slot_mapping=index_slots)
    parts = transform_qkv_rows(**inputs)
    kv_expected, ic_expected = kv_cache(kv_fmt), index_cache(index_fmt)
    insert_kv(kv_expected, kv_fmt, parts["k_exact"], parts["v"], slots, ks, vs,
              quantize_from="value", model_dtype="bfloat16")
    insert_index_k(ic_expected, index_fmt, parts["index_k_exact"],
                   slots if index_slots is None else index_slots)
    assert out["kv_cache"] is kv and out["index_cache"] is ic
    assert np.array_equal(kv, kv_expected)
    assert np.array_equal(ic, ic_expected)
    for key, value in parts.items():
        assert np.array_equal(out[key], value)


@pytest.mark.parametrize("kv_fmt", ["e4m3fn", "e4m3fnuz"])
def test_fused_k_is_quantised_from_the_exact_value(kv_fmt):
    """The fused op writes encode(k_exact) (one rounding) while reshape_and_cache of the
    rounded K writes encode(k) (two roundings): they differ on some elements (~3% on
    e4m3), V is identical, and the fused cache never equals the two-rounding one."""
    n = 48
    inputs = make_inputs(5, INDEXED, n)
    slots = np.arange(n)
    fused_kv = kv_cache(kv_fmt)
    out = fused_qknorm_rope_insert(**inputs, kv_cache=fused_kv, kv_fmt=kv_fmt,
                                   slot_mapping=slots, index_cache=index_cache("bfloat16"),
                                   index_fmt="bfloat16")
    separate_kv = reshape_and_cache(out["k"], out["v"], kv_cache(kv_fmt), kv_fmt, slots, None,
                                    None, "bfloat16")
    fused_k = fused_kv[:, :, :, :DIM].transpose(0, 2, 1, 3).reshape(-1, HKV, DIM)[:n]
    separate_k = separate_kv[:, :, :, :DIM].transpose(0, 2, 1, 3).reshape(-1, HKV, DIM)[:n]
    assert np.array_equal(fused_k, encode(out["k_exact"], kv_fmt, "satfinite"))
    assert np.array_equal(separate_k, encode(out["k"], kv_fmt, "satfinite"))
    assert 0.005 < np.mean(fused_k != separate_k) < 0.1
    assert np.array_equal(fused_kv[..., DIM:], separate_kv[..., DIM:])


@pytest.mark.parametrize("index_fmt", ["e4m3fn", "e4m3fnuz"])
def test_fp8_index_cache_makes_index_q_fp8_from_the_exact_value(index_fmt):
    """With an e4m3 index cache, index_q comes out as e4m3 codes of its exact value (unit
    scale, satfinite) with their decoded values, the index cache holds e4m3 of the exact
    index_k, and both differ somewhere from encoding the model-dtype-rounded values."""
    n = 64
    inputs = make_inputs(6, INDEXED, n, scale=1.0)
    inputs["weights"]["index_q"] = round_to(inputs["weights"]["index_q"] + 200.0, "bfloat16")
    slots = np.arange(n)
    ic = index_cache(index_fmt)
    out = fused_qknorm_rope_insert(**inputs, kv_cache=kv_cache("bfloat16"), kv_fmt="bfloat16",
                                   slot_mapping=slots, index_cache=ic, index_fmt=index_fmt)
    codes = encode(out["index_q_exact"], index_fmt, "satfinite")
    assert out["index_q_fmt"] == index_fmt
    assert out["index_q_codes"].dtype == np.uint8
    assert np.array_equal(out["index_q_codes"], codes)
    assert np.array_equal(out["index_q_values"], decode(codes, index_fmt))
    assert np.abs(out["index_q_exact"]).max() > 448  # weights of 200 push past e4m3's max
    assert np.all(np.isfinite(out["index_q_values"]))  # saturated, not NaN
    assert np.any(codes != encode(out["index_q"], index_fmt, "satfinite"))
    keys = ic.reshape(-1, DIM)[:n]
    assert np.array_equal(keys, encode(out["index_k_exact"], index_fmt, "satfinite"))
    assert np.any(keys != encode(out["index_k"], index_fmt, "satfinite"))


def test_model_dtype_index_cache_keeps_index_q_in_the_model_dtype():
    """With a bf16 index cache, index_q is emitted in bf16: its codes decode to the rounded
    index_q, and the index cache holds the rounded index_k."""
    inputs = make_inputs(7, INDEXED, 10)
    ic = index_cache("bfloat16")
    out = fused_qknorm_rope_insert(**inputs, kv_cache=kv_cache("e4m3fn"), kv_fmt="e4m3fn",
                                   slot_mapping=np.arange(10), index_cache=ic,
                                   index_fmt="bfloat16")
    assert out["index_q_fmt"] == "bfloat16"
    assert np.array_equal(out["index_q_values"], out["index_q"])
    assert np.array_equal(decode(ic.reshape(-1, DIM)[:10], "bfloat16"), out["index_k"])


def test_skip_index_leaves_the_index_cache_untouched():
    """skip_index=True writes K/V but not a single index cache element; index_q still
    follows the index format."""
    n = 12
    inputs = make_inputs(8, INDEXED, n)
    slots = distinct_slots(9, n, 2)
    ic, kv = index_cache("e4m3fn"), kv_cache("e4m3fn")
    before = ic.copy()
    out = fused_qknorm_rope_insert(**inputs, kv_cache=kv, kv_fmt="e4m3fn", slot_mapping=slots,
                                   index_cache=ic, index_fmt="e4m3fn", skip_index=True)
    assert np.array_equal(ic, before)
    assert np.any(kv != 0x7F)
    assert out["index_q_fmt"] == "e4m3fn"


def test_dense_rows_write_kv_and_need_no_index_cache():
    """Dense rows (q|k|v) need no index cache, return no index outputs, and write the same
    KV cache as the q|k|v part of an indexed row."""
    n = 10
    inputs = make_inputs(10, INDEXED, n)
    slots = distinct_slots(11, n, 3)
    kv_indexed = kv_cache("e5m2")
    fused_qknorm_rope_insert(**inputs, kv_cache=kv_indexed, kv_fmt="e5m2", slot_mapping=slots,
                             index_cache=index_cache("bfloat16"), index_fmt="bfloat16")
    inputs.update(rows=inputs["rows"][:, :DENSE.row_width], layout=DENSE)
    kv_dense = kv_cache("e5m2")
    out = fused_qknorm_rope_insert(**inputs, kv_cache=kv_dense, kv_fmt="e5m2",
                                   slot_mapping=slots)
    assert not any(key.startswith("index_q") or key.startswith("index_k") for key in out)
    assert out["index_cache"] is None
    assert np.array_equal(kv_dense, kv_indexed)


def test_no_tokens_is_a_no_op():
    """N = 0 leaves both caches unchanged and returns empty outputs."""
    inputs = make_inputs(12, INDEXED, 0)
    kv, ic = kv_cache("e4m3fnuz"), index_cache("e4m3fnuz")
    kv_before, ic_before = kv.copy(), ic.copy()
    out = fused_qknorm_rope_insert(**inputs, kv_cache=kv, kv_fmt="e4m3fnuz",
                                   slot_mapping=np.zeros(0, np.int64), index_cache=ic,
                                   index_fmt="e4m3fnuz")
    assert np.array_equal(kv, kv_before) and np.array_equal(ic, ic_before)
    assert out["q"].shape == (0, HQ, DIM) and out["index_q_codes"].shape == (0, HI, DIM)
    reshape_and_cache(np.zeros((0, HKV, DIM)), np.zeros((0, HKV, DIM)), kv, "e4m3fnuz",
                      np.zeros(0, np.int64), None, None, "bfloat16")
    assert np.array_equal(kv, kv_before)


def test_reshape_and_cache_is_insert_from_the_model_dtype():
    """reshape_and_cache of model-dtype K/V equals insert_kv with
    quantize_from="model_dtype" (and, K being representable, with "value" too)."""
    bg = rand.generator(13)
    n = 16
    k = round_to(rand.normal(bg, (n, HKV, DIM)), "float16")
    v = round_to(rand.normal(bg, (n, HKV, DIM)), "float16")
    slots = distinct_slots(14, n, 3)
    ours = reshape_and_cache(k, v, kv_cache("e5m2fnuz"), "e5m2fnuz", slots, 0.5, 2.0,
                             "float16")
    for mode in ("model_dtype", "value"):
        theirs = insert_kv(kv_cache("e5m2fnuz"), "e5m2fnuz", k, v, slots, 0.5, 2.0,
                           quantize_from=mode, model_dtype="float16")
        assert np.array_equal(ours, theirs)


def _fused(**changes):
    inputs = make_inputs(15, INDEXED, 4)
    args = dict(inputs, kv_cache=kv_cache("e4m3fn"), kv_fmt="e4m3fn",
                slot_mapping=np.arange(4), index_cache=index_cache("e4m3fn"),
                index_fmt="e4m3fn")
    args.update(changes)
    if args["layout"] is DENSE:
        args["rows"] = args["rows"][:, :DENSE.row_width]
    return fused_qknorm_rope_insert(**args)


@pytest.mark.parametrize(
    "call, argument",
    [
        (lambda: _fused(index_fmt="e5m2"), "index_fmt"),
        (lambda: _fused(index_fmt="float16"), "index_fmt"),
        (lambda: _fused(index_cache=None, index_fmt=None), "index_cache"),
        (lambda: _fused(layout=DENSE), "index_cache"),
        (lambda: _fused(index_cache=index_cache("bfloat16")), "index_cache"),
        (lambda: _fused(slot_mapping=np.array([0, 1, 1, 2])), "slot_mapping"),
        (lambda: _fused(index_slot_mapping=np.array([0, 1, 2, PAGES * PAGE])),
         "index_slot_mapping"),
        (lambda: _fused(rotary_dim=DIM + 2), "rotary_dim"),
        (lambda: _fused(model_dtype="float32"), "model_dtype"),
        (lambda: reshape_and_cache(np.full((1, HKV, DIM), 0.1), np.zeros((1, HKV, DIM)),
                                   kv_cache("e4m3fn"), "e4m3fn", np.array([0]), None, None,
                                   "bfloat16"), "k"),
    ],
)
def test_bad_input_names_the_argument(call, argument):
    """Bad input raises ValueError whose message starts with the argument's name."""
    with pytest.raises(ValueError, match=rf"^{argument}\b"):
        call()


def test_rejected_call_writes_neither_cache():
    """A call rejected for a bad index slot leaves the KV cache untouched too (all
    arguments are checked before the first write)."""
    kv, ic = kv_cache("e4m3fn"), index_cache("e4m3fn")
    with pytest.raises(ValueError, match="^index_slot_mapping"):
        _fused(kv_cache=kv, index_cache=ic, index_slot_mapping=np.array([0, 0, 1, 2]))
    assert np.all(kv == 0x7F) and np.all(ic == 0x7F)
