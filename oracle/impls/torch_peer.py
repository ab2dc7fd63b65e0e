"""The plain torch baseline of every op: what a user would write with stock torch ops, in
the model dtype, on ``cuda`` when available, else on the CPU.

Registered as implementation ``"torch"`` of each op in ``oracle.core.cases.OPS``. ``run(inputs)``
takes the numpy input set of a case (``oracle.core.cases.make_inputs``) and returns numpy
outputs in exactly ``oracle.core.reference_run``'s format: rounded outputs as codes (uint16
bf16/fp16 bit patterns, uint8 fp8 codes), caches as full logical arrays after the call
(copies: the inputs are never modified), topk as int32 ``[Hi, T, K]``.

Numerics (what the oracle judges it by):
- fp8 encode: satfinite = clamp to +-max (NaN kept), ``.to(torch.float8_*)`` (RNE), then
  NaN replaced by the format's canonical NaN code (torch writes 0xFF for -NaN in the OCP
  formats; bf16/fp16 NaN likewise becomes the canonical quiet NaN). torch's own overflow
  behaviour is never relied on (it changed between torch 2.11 and 2.13). fp8 decode:
  ``codes.view(torch.float8_*).float()`` (exact, every format, CPU and CUDA).
- norm_rope_insert: fp32 arithmetic, ``rsqrt(mean(x^2) + eps)``, ``x * r * (1 + w)``,
  partial NeoX RoPE from the table rows as given; q/k/index_k rounded once to the model
  dtype; index_q in the index cache's format (e4m3 codes of the fp32 value when the index
  cache is fp8). K is quantised from its fp32 value (``quantize_from="value"``: one
  rounding), V from its model-dtype value, both ``satfinite(value / scale)`` with an fp32
  division. Negative slots are skipped.
- reshape_and_cache: K and V from their model-dtype values (``quantize_from="model_dtype"``).
- indexer_*: block scores ``q.float() @ k.float().T`` (fp32 accumulation, ``score_rel=0``;
  TF32 is switched off for the call), causal mask, max per block, forced blocks, then a
  stable descending sort on score (bit-equal scores keep the lower block id), NaN lowest.
- attention_*: K/V dequantised as vLLM does, ``(decode(code) * scale).to(act)`` (just the
  value converted to act for bf16/fp16 caches), fp32 scores, fp32 softmax, fp32 ``P @ V``,
  output rounded to act. The declared schedule is therefore
  ``Schedule(kv_dtype=act, out_dtype=act)`` where act is the case's model dtype. Because a
  registry entry serves both model dtypes, the entry's ``schedule`` is a ``PerModelDtype``:
  call it with the model dtype (``oracle.core.registry.schedule_for(impl, model_dtype)`` does
  that and also accepts plain ``Schedule`` entries). Content a row must not see is zeroed with
  ``torch.where`` before any matmul and masked out of the logits (0 * NaN = NaN otherwise).

Broken variants for the oracle's power tests: ``make_torch_impl(op, bug)`` returns an
unregistered ``Implementation`` named ``torch[<bug>]`` with one realistic bug from ``BUGS``
(contract.md s.8).
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass

import numpy as np
import torch

from oracle.core.registry import Implementation, register
from oracle.impls.io import FP8_DTYPES, HALF_DTYPES, codes_in, codes_out, device, ints, values
from reference.attention import Schedule
from reference.codec import FORMATS
from reference.platforms import is_fp8

FN_OF_FNUZ = {"e4m3fnuz": "e4m3fn", "e5m2fnuz": "e5m2"}  # the fnuz-read-as-fn bug's mix-up


# ------------------------------------------------------------------------------ bugs


@dataclass(frozen=True)
class Bug:
    ops: tuple[str, ...]
    incident: str


_INSERT = ("norm_rope_insert", "reshape_and_cache")
_ATTN = ("attention_prefill", "attention_decode")
_IDX = ("indexer_prefill", "indexer_decode")

BUGS: dict[str, Bug] = {
    "interleaved_rope": Bug(
        ("norm_rope_insert",),
        "GPT-J style interleaved RoPE pairs (2i, 2i+1) used for a NeoX rotate-half model"),
    "plain_w": Bug(
        ("norm_rope_insert",),
        "Gemma RMSNorm weight applied as w instead of (1 + w) (a ported LLaMA RMSNorm)"),
    "fnuz_as_fn": Bug(
        _ATTN + _IDX,
        "MI300 sparse attention read its e4m3fnuz KV cache as e4m3fn (values doubled, "
        "+-240 -> NaN; GSM8K 0.967 -> 0.010 with no error)"),
    "no_causal_in_block": Bug(
        _ATTN,
        "causal mask dropped inside the query's own block (block-level masking only), "
        "so prefill/multi-row decode tokens see later keys"),
    "scales_ignored": Bug(
        _INSERT + _ATTN,
        "k/v scales not applied: the writer stores value (not value/scale), the reader "
        "decodes code (not code*scale)"),
    "k_from_model_dtype": Bug(
        ("norm_rope_insert",),
        "fused insert quantises K from its rounded bf16/fp16 output instead of the fp32 "
        "value (two roundings: one e4m3 code off on ~3% of elements)"),
}


@dataclass(frozen=True)
class _Flags:
    interleaved_rope: bool = False
    plain_w: bool = False
    fnuz_as_fn: bool = False
    no_causal_in_block: bool = False
    scales_ignored: bool = False
    k_from_model_dtype: bool = False


# --------------------------------------------------------------------------- schedule


@dataclass(frozen=True)
class PerModelDtype:
    """A rounding schedule stated in terms of the model dtype ("act"): calling it with a
    model dtype returns the ``reference.attention.Schedule`` for that dtype, with every
    field named in ``act_fields`` set to it (the others keep Schedule's defaults)."""

    act_fields: tuple[str, ...]

    def __call__(self, model_dtype: str, case: dict | None = None) -> Schedule:
        return Schedule(**{name: model_dtype for name in self.act_fields})


ATTENTION_SCHEDULE = PerModelDtype(("kv_dtype", "out_dtype"))


# ---------------------------------------------------------------------------- helpers



@contextlib.contextmanager
def _full_fp32_matmul():
    """fp32 matmuls really in fp32 (no TF32) for the duration of a call."""
    old = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("highest")
    try:
        yield
    finally:
        torch.set_float32_matmul_precision(old)






def _scalar_scale(s):
    return None if s is None else float(np.float32(s))


def decode(codes: torch.Tensor, fmt: str) -> torch.Tensor:
    """float32 values of codes (uint8 fp8 codes or int16 bf16/fp16 bits), exact."""
    if is_fp8(fmt):
        return codes.view(FP8_DTYPES[fmt]).float()
    return codes.view(HALF_DTYPES[fmt]).float()


def encode(x: torch.Tensor, fmt: str) -> torch.Tensor:
    """Codes of float values: fp8 satfinite RNE (uint8) or bf16/fp16 RNE bits (int16).
    NaN becomes the format's canonical NaN code."""
    f = FORMATS[fmt]
    if is_fp8(fmt):
        mx = f.max_finite
        codes = x.float().clamp(-mx, mx).to(FP8_DTYPES[fmt]).view(torch.uint8)
        nan = torch.tensor(f.nan_code, dtype=torch.uint8, device=x.device)
    else:
        codes = x.to(HALF_DTYPES[fmt]).view(torch.int16)
        nan = torch.tensor(f.nan_code - (1 << 16) * (f.nan_code >> 15), dtype=torch.int16,
                           device=x.device)
    return torch.where(torch.isnan(x), nan, codes)


def _slot_scale(scale, slots: torch.Tensor, dev):
    """Scale of each (token, head) as ``[n, Hkv, 1]`` float32, a Python float, or None."""
    if scale is None:
        return None
    s = np.asarray(scale)
    if s.ndim == 0:
        return _scalar_scale(s)
    st = torch.from_numpy(np.ascontiguousarray(s, np.float32)).to(dev)
    return st[:, slots].T.unsqueeze(-1)


def _quantize(x32: torch.Tensor, fmt: str, scale) -> torch.Tensor:
    """Codes of x / scale (fp32 division) in a cache format; bf16/fp16 take no scale."""
    if scale is not None and is_fp8(fmt):
        x32 = x32 / scale
    return encode(x32, fmt)


# ----------------------------------------------------------------------- norm + rope


def _norm_rope(x: torch.Tensor, w: torch.Tensor, eps: float, cs: torch.Tensor, rotary: int,
               flags: _Flags) -> torch.Tensor:
    """fp32 Gemma RMSNorm + partial NeoX RoPE of x ``[N, H, D]`` (fp32), cs ``[N, R]``."""
    r = torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    n = x * r * (w.float() if flags.plain_w else 1 + w.float())
    h = rotary // 2
    c, s = cs[:, None, :h], cs[:, None, h:rotary]
    if flags.interleaved_rope:
        first, second = n[..., 0:rotary:2], n[..., 1:rotary:2]
        rot = torch.stack([first * c - second * s, second * c + first * s], dim=-1)
        return torch.cat([rot.flatten(-2), n[..., rotary:]], dim=-1)
    first, second = n[..., :h], n[..., h:rotary]
    return torch.cat([first * c - second * s, second * c + first * s, n[..., rotary:]], dim=-1)


def _write_kv(cache: torch.Tensor, fmt: str, k32, v32, slots_np, k_scale, v_scale,
              flags: _Flags):
    """K/V codes of the tokens with a non-negative slot into the logical cache
    ``[num_pages, Hkv, P, 2D]`` (in place)."""
    page = cache.shape[2]
    dev = cache.device
    keep = np.flatnonzero(np.asarray(slots_np) >= 0)
    if not keep.size:
        return
    slots = ints(np.asarray(slots_np)[keep], dev)
    kt = ints(keep, dev)
    if flags.scales_ignored:
        k_scale = v_scale = None
    kc = _quantize(k32[kt], fmt, _slot_scale(k_scale, slots, dev))
    vc = _quantize(v32[kt], fmt, _slot_scale(v_scale, slots, dev))
    by_slot = cache.permute(0, 2, 1, 3)  # [num_pages, P, Hkv, 2D] view
    by_slot[slots // page, slots % page] = torch.cat([kc, vc], dim=-1)


def _fused(x: dict, flags: _Flags) -> dict:
    dev = device()
    md = x["model_dtype"]
    act = HALF_DTYPES[md]
    hq, hkv, d = x["num_q_heads"], x["num_kv_heads"], x["head_dim"]
    hi, has_ik = x["num_index_heads"], x["has_index_k"]
    rows = values(x["rows"], act, dev).float()  # [N, W]
    n = rows.shape[0]
    pos = ints(x["positions"], dev)
    rotary = x["rotary_dim"]
    cs = values(x["rope_table"], act, dev)[pos].float()
    widths = {"q": (hq, hq * d), "k": (hkv, hkv * d), "v": (hkv, hkv * d),
              "index_q": (hi, hi * d), "index_k": (1, d if has_ik else 0)}
    parts, start = {}, 0
    for name, (heads, width) in widths.items():
        if width:
            parts[name] = rows[:, start:start + width].reshape(n, heads, d)
        start += width
    y = {}
    for kind in ("q", "k", "index_q", "index_k"):
        if kind in parts:
            w = values(x[f"weights_{kind}"], act, dev)
            y[kind] = _norm_rope(parts[kind], w, x["eps"], cs, rotary, flags)
    res = {kind: encode(y[kind].to(act), md) for kind in ("q", "k")}
    kv = codes_in(x["kv_cache"], dev)
    k_src = y["k"].to(act).float() if flags.k_from_model_dtype else y["k"]
    _write_kv(kv, x["kv_fmt"], k_src, parts["v"].to(act).float(), x["slot_mapping"],
              x["k_scale"], x["v_scale"], flags)
    res["kv_cache"] = kv
    index_fmt = x["index_fmt"]
    if "index_q" in y:
        q_fmt = index_fmt if index_fmt is not None and is_fp8(index_fmt) else md
        res["index_q"] = encode(y["index_q"] if is_fp8(q_fmt) else y["index_q"].to(act), q_fmt)
    if "index_k" in y:
        ik = y["index_k"][:, 0]  # [N, D]
        res["index_k"] = encode(ik.to(act), md)
        ic = codes_in(x["index_cache"], dev)
        islots = x.get("index_slot_mapping")
        slots_np = np.asarray(x["slot_mapping"] if islots is None else islots)
        keep = np.flatnonzero(slots_np >= 0)
        if keep.size:
            codes = encode(ik[ints(keep, dev)], index_fmt)
            ic.view(-1, d)[ints(slots_np[keep], dev)] = codes
        res["index_cache"] = ic
    return {key: codes_out(val) for key, val in res.items()}


def _reshape_and_cache(x: dict, flags: _Flags) -> dict:
    dev = device()
    act = HALF_DTYPES[x["model_dtype"]]
    kv = codes_in(x["kv_cache"], dev)
    k = values(x["k"], act, dev).float()
    v = values(x["v"], act, dev).float()
    _write_kv(kv, x["kv_fmt"], k, v, x["slot_mapping"], x["k_scale"], x["v_scale"], flags)
    return {"kv_cache": codes_out(kv)}


# ---------------------------------------------------------------------------- indexer


_CHUNK_ELEMS = 1 << 25  # fp32 elements of one row chunk's score / logit array


def _row_chunks(start, count, per_row: int):
    """Slices of a request's rows, each chunk's score array at most _CHUNK_ELEMS."""
    step = max(1, _CHUNK_ELEMS // max(1, per_row))
    for a in range(int(start), int(start + count), step):
        yield slice(a, min(int(start + count), a + step))


def _rows_of(x: dict, num_rows: int):
    """(start, count, seq_len) per request and the position of every row (-1: padding)."""
    seq = np.asarray(x["seq_lens"], np.int64)
    if "rows_per_request" in x:
        rows = int(x["rows_per_request"])
        starts = np.arange(seq.size, dtype=np.int64) * rows
        counts = np.where(seq > 0, rows, 0)
    else:
        cu = np.asarray(x["cu_seqlens_q"], np.int64)
        starts, counts = cu[:-1], np.diff(cu)
    pos = np.full(num_rows, -1, np.int64)
    for r in np.flatnonzero(counts > 0):
        pos[starts[r]:starts[r] + counts[r]] = seq[r] - counts[r] + np.arange(counts[r])
    return starts, counts, seq, pos


def select_blocks(scores: torch.Tensor, num_visible: torch.Tensor, topk: int, local: int,
                  initial: int) -> torch.Tensor:
    """``[T, Hi, K]`` int32 selection from fp32 block scores ``[T, Hi, NB]``: forced blocks
    (ascending id: initial before local), then descending score (stable: bit-equal scores
    keep the lower id), then NaN scores by id; n = min(K, visible) entries, then -1."""
    t, hi, nb = scores.shape
    dev = scores.device
    b = torch.arange(nb, device=dev)
    nv = num_visible[:, None]
    visible = b[None] < nv
    forced = visible & ((b[None] < initial) | (b[None] >= nv - local))
    nan = torch.isnan(scores)
    cls = torch.where(forced[:, None], 0, torch.where(nan, 2, 1))
    cls = torch.where(visible[:, None], cls, 3)
    key = torch.where(cls == 1, scores, torch.zeros_like(scores))
    by_score = torch.sort(key, dim=-1, descending=True, stable=True).indices
    by_cls = torch.sort(cls.gather(-1, by_score), dim=-1, stable=True).indices
    order = by_score.gather(-1, by_cls)[..., :topk]
    if order.shape[-1] < topk:
        order = torch.cat([order, order.new_full((t, hi, topk - order.shape[-1]), -1)], -1)
    n = torch.minimum(num_visible, torch.tensor(topk, device=dev))
    keep = torch.arange(topk, device=dev)[None, :] < n[:, None]
    return torch.where(keep[:, None], order, -1).to(torch.int32)


def _indexer(x: dict, flags: _Flags) -> dict:
    dev = device()
    fmt = x["index_fmt"]
    read_fmt = FN_OF_FNUZ.get(fmt, fmt) if flags.fnuz_as_fn else fmt
    q = values(x["index_q"], torch.float32, dev)  # values as given (exact in fp32)
    t, hi, d = q.shape
    cache = codes_in(x["index_cache"], dev)
    page = cache.shape[1]
    keys_all = decode(cache, read_fmt)  # [num_pages, P, D]
    bt = np.asarray(x["block_table"], np.int64)
    k = int(x["topk"])
    starts, counts, seq, pos = _rows_of(x, t)
    out = torch.full((t, hi, k), -1, dtype=torch.int32, device=dev)
    with _full_fp32_matmul():
        for r in np.flatnonzero(counts > 0):
            nb = -(-int(seq[r]) // page)
            keys = keys_all[ints(bt[r, :nb], dev)].reshape(nb * page, d)
            for rows in _row_chunks(starts[r], counts[r], hi * nb * page):
                qr = q[rows]
                n = qr.shape[0]
                s = (qr.reshape(n * hi, d) @ keys.T).reshape(n, hi, nb * page)
                p = ints(pos[rows], dev)
                seen = torch.arange(nb * page, device=dev)[None, :] <= p[:, None]
                s = torch.where(seen[:, None], s, -math.inf)
                block = s.reshape(n, hi, nb, page).amax(-1)
                out[rows] = select_blocks(block, p // page + 1, k, int(x["local_blocks"]),
                                          int(x["initial_blocks"]))
    return {"topk": codes_out(out.permute(1, 0, 2))}


# -------------------------------------------------------------------------- attention


def _dequant(codes: torch.Tensor, fmt: str, scale, act) -> torch.Tensor:
    """vLLM-style dequantisation to act: ``(decode(code) * scale).to(act)``."""
    x = decode(codes, fmt)
    if scale is not None and is_fp8(fmt):
        x = x * scale
    return x.to(act)


def _visible(sel: torch.Tensor, nb: int, page: int, in_seq, p, flags: _Flags):
    """``[n, L]`` mask of the keys each row sees: in a selected block (the set of the
    row's non-negative entries), before seq_len, at or before the row's position."""
    n = sel.shape[0]
    chosen = torch.zeros((n, nb + 1), dtype=torch.bool, device=sel.device)
    chosen.scatter_(1, torch.where((sel >= 0) & (sel < nb), sel, nb), True)
    vis = chosen[:, :nb].repeat_interleave(page, dim=1) & in_seq[None]
    if not flags.no_causal_in_block:
        vis &= torch.arange(nb * page, device=sel.device)[None] <= p[:, None]
    return vis


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, vis: torch.Tensor,
            softmax_scale: float) -> torch.Tensor:
    """fp32 softmax attention of q ``[n, G, D]`` over keys ``[L, D]`` under the mask
    ``[n, L]``; rows that see no key give zeros. Keys no row sees are zeroed before any
    matmul; non-finite V seen by some rows is kept away from the others row by row."""
    used = vis.any(0)[:, None]
    k = torch.where(used, k, torch.zeros_like(k)).float()
    v = torch.where(used, v, torch.zeros_like(v)).float()
    logits = (q.float() @ k.T) * softmax_scale  # [n, G, L]
    logits = torch.where(vis[:, None], logits, -math.inf)
    prob = torch.softmax(logits, dim=-1)
    prob = torch.where(vis.any(-1)[:, None, None], prob, 0.0)
    if bool(torch.isfinite(v).all()):
        return prob @ v
    return torch.stack([prob[i] @ torch.where(vis[i][:, None], v, 0.0)
                        for i in range(prob.shape[0])])


def _attention(x: dict, flags: _Flags) -> dict:
    dev = device()
    md = x["model_dtype"]
    act = HALF_DTYPES[md]
    fmt = x["kv_fmt"]
    read_fmt = FN_OF_FNUZ.get(fmt, fmt) if flags.fnuz_as_fn else fmt
    q = values(x["q"], act, dev)  # [T, Hq, D]
    t, hq, d = q.shape
    cache = codes_in(x["kv_cache"], dev)  # [num_pages, Hkv, P, 2D]
    hkv, page = cache.shape[1], cache.shape[2]
    grp = hq // hkv
    topk = ints(x["topk"], dev)  # [Hkv, T, K]
    k_scale, v_scale = (None, None) if flags.scales_ignored else (x["k_scale"], x["v_scale"])
    ks_t = vs_t = None
    if k_scale is not None and np.ndim(k_scale) == 2:
        ks_t = torch.from_numpy(np.ascontiguousarray(k_scale, np.float32)).to(dev)
    if v_scale is not None and np.ndim(v_scale) == 2:
        vs_t = torch.from_numpy(np.ascontiguousarray(v_scale, np.float32)).to(dev)
    bt = np.asarray(x["block_table"], np.int64)
    softmax_scale = 1.0 / math.sqrt(d)
    starts, counts, seq, pos = _rows_of(x, t)
    out = torch.zeros((t, hq, d), dtype=act, device=dev)  # padding rows stay zero
    with _full_fp32_matmul():
        for r in np.flatnonzero(counts > 0):
            nb = -(-int(seq[r]) // page)
            length = nb * page
            pages = ints(bt[r, :nb], dev)
            slots = (pages[:, None] * page + torch.arange(page, device=dev)).reshape(-1)
            j = torch.arange(length, device=dev)
            in_seq = j < int(seq[r])
            for g in range(hkv):
                codes = cache[pages, g].reshape(length, 2 * d)
                ks = _scalar_scale(k_scale) if ks_t is None else ks_t[g, slots][:, None]
                vs = _scalar_scale(v_scale) if vs_t is None else vs_t[g, slots][:, None]
                k_all = _dequant(codes[:, :d], read_fmt, ks, act)
                v_all = _dequant(codes[:, d:], read_fmt, vs, act)
                heads = slice(g * grp, (g + 1) * grp)
                for rows in _row_chunks(starts[r], counts[r], grp * length):
                    vis = _visible(topk[g, rows], nb, page, in_seq, ints(pos[rows], dev),
                                   flags)
                    out[rows, heads] = _attend(q[rows, heads], k_all, v_all, vis,
                                               softmax_scale).to(act)
    return {"out": codes_out(out.view(torch.int16))}


# --------------------------------------------------------------------------- registry

_RUNNERS = {
    "norm_rope_insert": _fused,
    "reshape_and_cache": _reshape_and_cache,
    "indexer_prefill": _indexer,
    "indexer_decode": _indexer,
    "attention_prefill": _attention,
    "attention_decode": _attention,
}
_NOTES = "plain torch composition in the model dtype (fp32 math); cuda if available, else cpu"


def make_torch_impl(op: str, bug: str | None = None) -> Implementation:
    """The torch baseline of an op (``bug=None``), or a deliberately broken variant named
    ``torch[<bug>]`` (not registered) with one bug of ``BUGS`` that applies to the op."""
    if op not in _RUNNERS:
        raise ValueError(f"op must be one of {sorted(_RUNNERS)}, got {op!r}")
    if bug is not None:
        if bug not in BUGS:
            raise ValueError(f"bug must be one of {sorted(BUGS)}, got {bug!r}")
        if op not in BUGS[bug].ops:
            raise ValueError(f"bug {bug!r} applies to {list(BUGS[bug].ops)}, not {op!r}")
    flags = _Flags(**({bug: True} if bug else {}))
    runner = _RUNNERS[op]

    def run(inputs: dict) -> dict:
        return runner(inputs, flags)

    notes = _NOTES if bug is None else f"{_NOTES}; BROKEN: {BUGS[bug].incident}"
    return Implementation(
        "torch" if bug is None else f"torch[{bug}]", op, run, devices=("cpu", "cuda"),
        schedule=ATTENTION_SCHEDULE if op in _ATTN else None,
        quantize_from="model_dtype" if op == "reshape_and_cache" else "value", notes=notes)


def register_all() -> None:
    """Register the baseline of every op."""
    for op in _RUNNERS:
        register(make_torch_impl(op))
