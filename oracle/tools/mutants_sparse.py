"""Mutants of the indexer and attention kernels (``oracle.tools.mutants``): each a bug class of
shared/contract.md section 8 on the project's Triton kernels, with the incident it models."""

from __future__ import annotations

import numpy as np

from oracle.tools.mutants import (
    Mutant,
    adapter_of,
    patch,
    patched_module,
    register,
    wrap_inputs,
)

register(Mutant(
    "decode_gqa_modulo", "attention_decode", "triton",
    "GQA head mapping qh % Hkv instead of qh // G",
    "a GQA port mapped query head h to KV head h % Hkv (the MQA/MHA-era formula), so most "
    "heads attended to another head's keys",
    patch("kernels.attention_decode",
          ("    m_hq = g64 * group + m_head\n",
           "    m_hq = m_head * (num_q_heads // group) + g64\n"))))


def _scale_ignored(x: dict) -> dict:
    if x.get("k_scale") is not None:
        x["k_scale"] = np.ones_like(np.asarray(x["k_scale"], np.float32))
    return x


register(Mutant(
    "decode_k_scale_ignored", "attention_decode", "triton",
    "k scale not applied by the reader",
    "an fp8 KV path read the codes without the per-tensor k scale (scale plumbed as 1.0), "
    "so logits were off by the scale whenever calibration set one",
    wrap_inputs(_scale_ignored)))


# --------------------------------------------------------------- fp8 scales and formats


def _k_reads_v_scale(x: dict) -> dict:
    if x.get("v_scale") is not None:
        x["k_scale"] = x["v_scale"]
    return x


register(Mutant(
    "decode_k_reads_v_scale", "attention_decode", "triton",
    "k/v scales disagreeing between writer and reader (reader dequantises K with v_scale)",
    "a reader's scale arguments were wired from the wrong layer attribute (v_scale passed "
    "where k_scale belongs), so K was dequantised with a scale the writer never used",
    wrap_inputs(_k_reads_v_scale)))

register(Mutant(
    "prefill_slot_scale_by_position", "attention_prefill", "triton",
    "k/v scales disagreeing between writer and reader (per-slot scales indexed by the "
    "logical token position, not the physical slot the writer used)",
    "a per-(head, slot) scale lookup indexed by the token's position in its sequence "
    "instead of page * P + offset; correct only while the block table is the identity",
    patch("kernels.attention_prefill",
          ("                k, v = kv_tiles(src, (pg * P + off + jj)[:, None], kmask[:, None],",
           "                k, v = kv_tiles(src, key[:, None], kmask[:, None],"))))


def _fnuz_as_fn(x: dict) -> dict:
    if str(x.get("kv_fmt", "")).endswith("fnuz"):
        x["kv_fmt"] = x["kv_fmt"][:-2]  # e4m3fnuz -> e4m3fn, e5m2fnuz -> e5m2
    return x


register(Mutant(
    "decode_fnuz_read_as_fn", "attention_decode", "triton",
    "fnuz bytes read as fn (rocm-fnuz KV cache decoded as OCP e4m3fn / e5m2)",
    "sparse attention on MI300 read its e4m3fnuz KV cache through an e4m3fn-labelled view: "
    "every value doubled and +-240 turned into NaN, with no error raised (contract.md s.1)",
    wrap_inputs(_fnuz_as_fn)))


# ------------------------------------------------------------------------------ masking


register(Mutant(
    "prefill_no_causal_in_block", "attention_prefill", "triton",
    "missing causal mask inside the current block",
    "a block-sparse prefill masked keys only at block granularity (and the tile's load "
    "bound), so a new token saw the later new tokens of its own block",
    patch("kernels.attention_prefill",
          ("                last = tl.where(m_takes & page_ok, m_pos - first_key, -1)\n",
           "                last = tl.where(m_takes & page_ok, lim - first_key, -1)\n"))))

register(Mutant(
    "decode_full_pages", "attention_decode", "triton",
    "keys past seq_len leaking in (the tail of the last page read)",
    "a paged decode kernel treated every selected page as full (P valid keys), so the "
    "unwritten tail of the request's last page entered the softmax",
    patch("kernels.attention_decode",
          ("            kmask = (key <= lim) & page_ok\n", "            kmask = page_ok\n"),
          ("            vis = (m_takes[:, None] > 0) & (key[None, :] <= m_pos[:, None]) & "
           "kmask[None, :]\n",
           "            vis = (m_takes[:, None] > 0) & kmask[None, :]\n"))))

register(Mutant(
    "decode_unmasked_loads_0nan", "attention_decode", "triton",
    "NaN from masked content leaking through 0 * NaN",
    "a kernel masked invisible keys only in the logits (P = 0 there) but loaded the whole "
    "page unmasked, so NaN garbage in V past seq_len reached P @ V as 0 * NaN",
    patch("kernels.attention_decode",
          ("            kmask = (key <= lim) & page_ok\n", "            kmask = page_ok\n"))))


def _topk_token_major(x: dict) -> dict:
    tk = np.asarray(x["topk"])
    h, t, k = tk.shape
    # the server's token-major [T, Hkv, K] buffer handed over as if head-major [Hkv, T, K]
    x["topk"] = np.ascontiguousarray(tk.transpose(1, 0, 2)).reshape(h, t, k)
    return x


# ------------------------------------------------------------------------ the selection


register(Mutant(
    "decode_topk_token_major", "attention_decode", "triton",
    "top-k buffer read token-major vs head-major",
    "the indexer's token-major [T, Hkv, K] selection buffer was passed by data pointer to "
    "a reader expecting head-major [Hkv, T, K] (a reshape where a transpose was needed)",
    wrap_inputs(_topk_token_major)))

register(Mutant(
    "decode_union_double_count", "attention_decode", "triton",
    "duplicated blocks double-counted",
    "a multi-row decode walked the concatenation of its rows' selections instead of their "
    "set: a block selected by several rows was accumulated once per selecting row into "
    "every row that holds it",
    patch("kernels.attention_decode",
          ("        first = (uni >= 0) & (u_rep == 0)\n", "        first = uni >= 0\n"),
          ("        u_rank = tl.sum(((uni[:, None] < uni[None, :]) & first[:, None])"
           ".to(tl.int32),\n                        axis=0)\n",
           "        u_rank = tl.sum((((uni[:, None] < uni[None, :]) | ((uni[:, None] == "
           "uni[None, :]) & (ss[:, None] < ss[None, :]))) & first[:, None]).to(tl.int32), "
           "axis=0)\n"))))

# The clamp shows through the padding lanes of a K that is not a power of two, and through
# the rows of a partial selection (-1 entries, block 0 absent: the attention cases' quarter
# of cut rows, added after this mutant survived them); the next mutant has only the latter.
register(Mutant(
    "decode_minus1_as_block0", "attention_decode", "triton",
    "-1 entries read as block 0",
    "selection ids clamped with max(id, 0) for a safe gather, which turned the -1 padding "
    "(and the tile's padding lanes) into reads of block 0",
    patch("kernels.attention_decode",
          ("    in_range = row_ok[:, None] & (e >= 0) &",
           "    e = tl.maximum(e, 0)\n    in_range = row_ok[:, None] & (e >= 0) &"))))

register(Mutant(
    "decode_minus1_entries_as_block0", "attention_decode", "triton",
    "-1 entries read as block 0",
    "the same clamp applied to the K real entries only (the padding lanes past K kept "
    "apart): shown by the rows whose selection holds -1 but not block 0 (the attention "
    "cases' partial selections)",
    patch("kernels.attention_decode",
          ("    in_range = row_ok[:, None] & (e >= 0) &",
           "    e = tl.where((kk < topk_k)[None, :], tl.maximum(e, 0), e)\n"
           "    in_range = row_ok[:, None] & (e >= 0) &"))))

register(Mutant(
    "prefill_diag_block_assumed_last", "attention_prefill", "triton",
    "block order assumed ascending",
    "a sparse kernel applied the in-block causal mask only to the block it took for the "
    "query's own: the last valid entry of a selection list it assumed sorted ascending "
    "(the indexer emits score order)",
    patch("kernels.attention_prefill",
          ("            # ---- the (token, head) rows: m = token * G_P + head.\n",
           "            kk = tl.arange(0, KP)\n"
           "            last_k = tl.max(tl.where(valid, kk[None, :], -1), axis=1)\n"
           "            diag = tl.max(tl.where(kk[None, :] == last_k[:, None], es, -1), "
           "axis=1)\n"
           "            # ---- the (token, head) rows: m = token * G_P + head.\n"),
          ("            m_hq = g64 * group + m_head\n",
           "            m_hq = g64 * group + m_head\n"
           "            m_diag = tl.reshape(tl.broadcast_to(diag[:, None], (BLOCK_T, G_P)), "
           "(ROWS,))\n"),
          ("                last = tl.where(m_takes & page_ok, m_pos - first_key, -1)\n",
           "                last = tl.where(m_takes & page_ok, tl.where(m_diag != blk, lim, m_pos) "
           "- first_key, -1)\n"))))


# ------------------------------------------------------------------ split-K and empties


register(Mutant(
    "decode_merge_plain_average", "attention_decode", "triton",
    "split-K merge errors (partials averaged instead of LSE-weighted)",
    "a split-K decode merged its partial outputs with equal weights (the mean of the "
    "non-empty splits) instead of weighting each by exp(lse_c - max lse)",
    patch("kernels.attention_decode",
          ("    wsum = tl.sum(tl.exp2(lse - top[:, None]), axis=1)\n",
           "    wsum = tl.sum((lse > float(\"-inf\")).to(tl.float32), axis=1)\n"),
          ("        acc += w[:, None] * o\n",
           "        acc += tl.where(w[:, None] > 0.0, o, 0.0)\n"))))

register(Mutant(
    "decode_empty_rows_nan", "attention_decode", "triton",
    "NaN for rows with no keys",
    "a decode kernel normalised acc / l without guarding l = 0, so CUDA-graph padding rows "
    "(seq_len 0) and empty splits produced 0/0 = NaN (vLLM's kernel returns NaN there)",
    patch("kernels.attention_decode",
          ("    o = tl.where(empty[:, None], 0.0, acc / l_safe[:, None])\n",
           "    o = acc / l_i[:, None]\n"))))


# ---------------------------------------------------------------------------- indexers


def _on_helpers(module: str, helpers, *replacements):
    """A patched copy of an indexer module importing the patched copy ``helpers`` of
    kernels._indexer (it imports the helpers as a module, ``from kernels import _indexer
    as ix``, which ``patch(deps=...)`` does not rewrite), with ``replacements`` too."""
    return patched_module(module, (
        ("from kernels import _indexer as ix\n", f"import {helpers.__name__} as ix\n"),
        *replacements))


def _tie_to_higher_id(base):
    """The prefill indexer built on a copy of kernels._indexer whose selection keys rank
    bit-equal scores (and forced blocks) to the HIGHER block id; the decode indexer keeps
    the lower-id rule (``_on_helpers``)."""
    helpers = patched_module("kernels._indexer", (
        ("    low = (4294967295 - b.to(tl.int64)).to(tl.uint64)\n",
         "    low = b.to(tl.int64).to(tl.uint64)\n"),
        ("    ids = tl.where(valid, 4294967295 - (top & 0xFFFFFFFF).to(tl.int64), -1)"
         ".to(tl.int32)\n    dst = (out_ptr + heads.to(tl.int64)[:, None] * o_s0 + "
         "toks.to(tl.int64)[:, None] * o_s1\n           + rank.to(tl.int64) * o_s2)",
         "    ids = tl.where(valid, (top & 0xFFFFFFFF).to(tl.int64), -1).to(tl.int32)\n"
         "    dst = (out_ptr + heads.to(tl.int64)[:, None] * o_s0 + "
         "toks.to(tl.int64)[:, None] * o_s1\n           + rank.to(tl.int64) * o_s2)"),
    ))
    return adapter_of("kernels.indexer_prefill", _on_helpers("kernels.indexer_prefill", helpers))


def _rows_at_last_position(base):
    """The decode indexer with every row of a request at the request's last position, in
    each of its scans: the interpreted one (kernels/indexer_decode.py) and the compiled
    tensor-core and FMA ones (kernels/_indexer.py, ``_on_helpers``). Patching only the
    interpreted scan left the GPU's kernel unmutated: the H200 kill matrix saw it survive
    every class."""
    last = "    pos = seq - 1 + tq * 0\n    live = (rows < NR) & (tok0 + tq < num_tokens)"
    helpers = patched_module("kernels._indexer", (
        ("    pos = seq - QR + tq\n    live = (rows < NR) & (tok0 + tq < num_tokens) & "
         "(seq > 0) & (pos >= 0)\n    own = pos // P  # each row's last visible block\n",
         f"{last} & (seq > 0) & (pos >= 0)\n    own = pos // P\n"),
        ("                p_i = seq - QR + i // HI\n", "                p_i = seq - 1\n"),
        ("    pos = seq - QR + tq\n    live = (rows < NR) & (tok0 + tq < num_tokens) & "
         "(seq > 0) & (pos >= 0)\n    own = pos // P\n    dd",
         f"{last} & (seq > 0) & (pos >= 0)\n    own = pos // P\n    dd"),
        ("    m_pos = seq - QR + mq\n", "    m_pos = seq - 1 + mq * 0\n"),
    ))
    return adapter_of("kernels.indexer_decode", _on_helpers(
        "kernels.indexer_decode", helpers,
        ("    pos = seq - q_rows + qr\n", "    pos = seq - 1 + qr * 0\n")))


# The checker admits any order among exactly tied scores (a set up to near-ties), so this
# dies through the forced blocks (initial vs local when they exceed n), not score ties.
register(Mutant(
    "index_prefill_ties_to_higher_id", "indexer_prefill", "triton",
    "inconsistent tie-breaking between prefill and decode (prefill prefers the higher "
    "block id on bit-equal keys)",
    "two indexer kernels of one server encoded the tie rule differently (one packed the "
    "block id, the other its complement), so prefill and decode disagreed on equal scores "
    "and, when forced blocks exceed K, kept local instead of initial blocks",
    _tie_to_higher_id))

register(Mutant(
    "index_decode_rows_at_last_position", "indexer_decode", "triton",
    "missing causal mask inside the current block (multi-row decode indexer)",
    "a multi-token (speculative / MTP) decode indexer gave every row of a request the "
    "request's last position, so earlier rows scored keys of later rows and could select "
    "a block past their own",
    _rows_at_last_position))

register(Mutant(
    "index_decode_topk_off_by_one", "indexer_decode", "triton",
    "K = top-k off by one (K - 1 blocks written)",
    "an inclusive/exclusive mix-up passed K - 1 as the selection width, so the last column "
    "of every row kept the buffer's stale content",
    patch("kernels.indexer_decode",
          ("            cnt if trace is None else trace, p.hi, p.q_rows, p.k, p.loc, p.ini, bps, "
           "splits)\n",
           "            cnt if trace is None else trace, p.hi, p.q_rows, p.k - 1, p.loc, p.ini, "
           "bps, splits)\n"))))
