"""Cases: an op, a shape class, a value distribution, a platform, a cache dtype, scales and a
seed; the inputs are a pure function of these, made on the CPU from raw bit-generator
output (``oracle.core.rand``), so a case id replays bit for bit on any machine.

A case id reads ``op:shape_class:dist:platform:kv_cache_dtype:model_dtype:scales:seed``
(``Case.id`` / ``Case.from_id``); ``python -m oracle replay ID`` re-runs it. Every input set
carries the sha256 of its arrays (``input_hash``), recorded in reports and checked on replay.

Shapes are drawn from the seed within the shape class: ``tiny`` (interpreter-sized),
``small`` (the domain of contract.md s.7 at CPU-friendly sizes), ``model`` (the model's
numbers: Hq 64, Hkv 4, D 128, R 64, P 128, K 16; 4 requests with contexts of up to 8k
tokens; a prefill case appends up to 128 new tokens per request, so that its float64
check, which grows with the rows times the selected keys, stays at seconds: the 2,048-token
prefill is the benchmarks' and ``benchmarks/reference_speed.py``'s) and
``sweep`` (insert ops, for compiled kernels: the whole domain of contract.md s.7 -- N 0..16,384
log-uniform, Hkv 1..8, G 1..16, D 64/128/256, any even R <= min(D, 128), P 16..128 -- with
N capped so an input set stays under ``SWEEP_ELEMENTS`` elements, which keeps the float64
reference check to seconds; narrow rows reach N = 16,384) and ``long`` (indexer and
attention, for compiled kernels: 1-3 requests with contexts log-uniform on 2k..128k tokens
for decode and prefixes up to 64k for prefill, not multiples of P; Hkv 1, 3 or 4, G 1, 2, 8
or 16, D 128, P 16/64/128, K 16 or 1..64; the contexts' total times Hkv capped at
``LONG_TOKEN_HEADS`` so the float64 reference stays at seconds, which lets one request with
one KV head reach 128k tokens).

Distributions (values before rounding to their storage dtype):
  normal         N(0, 1); attention queries 2.5 N(0, 1) (the accuracy study's setup)
  outliers       N(0, 1) plus N(0, 10^2) on 0.1% of entries (FlashAttention-3's fp8 setup);
                 insert ops: V also holds -0, +-Inf and NaN on 1% of entries (contract.md s.4);
                 indexer ops: a few visible index keys hold a NaN code (NaN scores)
  near_overflow  V around the fp8 format's max on both sides; K and index keys pushed there
                 by small k scales and large norm weights (the indexer ops: keys and
                 index_q at the index format's max); attention queries N(0, 48^2), so
                 logits reach +-100 and beyond
Attention selections: a quarter of the rows keep only part of their blocks, -1 elsewhere.
  tiny           magnitudes around the fp8 format's min subnormal
  ties           indexer only: blocks whose keys are copies of another block's (exact ties)
                 or copies plus a one-ulp change (near ties)
Content a query must not see (other pages, keys past seq_len, unselected blocks) is
poisoned with NaN codes and max codes, so a leak is catastrophic, not a 2e-4 wobble.

Beyond shapes and values, the cases vary every argument of each op's contract (the audit is
docs/coverage.md): the fused insert's index cache has its own page size and, in two cases of
three, its own ``index_slot_mapping``; its index query heads, RMSNorm epsilon and the
strides of every cache vary; each index array comes as int32 or int64. The index target,
epsilon, index-cache padding and integer widths are drawn after the other inputs.
"""

from __future__ import annotations

import hashlib
from dataclasses import asdict, dataclass, fields

import numpy as np

from oracle.core import rand
from reference.codec import FORMATS, encode
from reference.domain import MODEL, check_choice
from reference.kv_cache import empty_cache, empty_index_cache, quantize
from reference.norm_rope import QKVLayout, rope_table
from reference.platforms import (
    KV_CACHE_DTYPES,
    MODEL_DTYPES,
    PLATFORMS,
    index_cache_format,
    is_fp8,
    kv_cache_format,
)

OPS = (
    "norm_rope_insert",
    "reshape_and_cache",
    "indexer_prefill",
    "indexer_decode",
    "attention_prefill",
    "attention_decode",
)
SHAPE_CLASSES = ("tiny", "small", "model", "sweep", "long")
#: Elements per input set a ``sweep`` case may reach (its token count is capped by it).
SWEEP_ELEMENTS = 1 << 23
#: A ``long`` case's contexts: decode (and the index decode) up to 128k tokens, prefill
#: prefixes up to 64k; the sum of the contexts times the KV heads at most LONG_TOKEN_HEADS.
LONG_DECODE_TOKENS = 1 << 17
LONG_PREFIX_TOKENS = 1 << 16
LONG_TOKEN_HEADS = 1 << 18
DISTRIBUTIONS = ("normal", "outliers", "near_overflow", "tiny", "ties")
SCALES = ("none", "tensor", "slot")


@dataclass(frozen=True)
class Case:
    op: str
    shape_class: str = "small"
    dist: str = "normal"
    platform: str = "cuda"
    kv_cache_dtype: str = "auto"
    model_dtype: str = "bfloat16"
    scales: str = "none"
    seed: int = 0
    #: None: every draw from the case's own stream. An integer: the shapes (heads, head
    #: dim, page size, layout, requests and their lengths, rows, top-k width, token count,
    #: rotary dim, index arrays' integer widths) come from a stream named by (op, shape
    #: class, config) alone, the values and everything else from the case's stream: cases
    #: sharing a config share their kernels' compiled specialisations (``shape_stream``).
    config: int | None = None

    def __post_init__(self):
        check_choice("op", self.op, OPS)
        check_choice("shape_class", self.shape_class, SHAPE_CLASSES)
        check_choice("dist", self.dist, DISTRIBUTIONS)
        check_choice("platform", self.platform, PLATFORMS)
        check_choice("kv_cache_dtype", self.kv_cache_dtype, KV_CACHE_DTYPES)
        check_choice("model_dtype", self.model_dtype, MODEL_DTYPES)
        check_choice("scales", self.scales, SCALES)
        if self.shape_class == "sweep" and self.op not in ("norm_rope_insert",
                                                           "reshape_and_cache"):
            raise ValueError(f"shape_class 'sweep' applies to the insert ops only, not {self.op}")
        if self.shape_class == "long" and self.op in ("norm_rope_insert", "reshape_and_cache"):
            raise ValueError(f"shape_class 'long' applies to the indexer and attention ops "
                             f"only, not {self.op}")
        if self.dist == "ties" and not self.op.startswith("indexer"):
            raise ValueError(f"dist 'ties' applies to the indexer ops only, not {self.op}")
        if self.scales != "none" and not is_fp8(self.kv_fmt):
            raise ValueError(f"scales must be 'none' for a {self.kv_fmt} cache, got {self.scales}")
        if not isinstance(self.seed, int) or self.seed < 0:
            raise ValueError(f"seed must be a non-negative integer, got {self.seed!r}")
        if self.config is not None and (not isinstance(self.config, int) or self.config < 0):
            raise ValueError(f"config must be None or a non-negative integer, got "
                             f"{self.config!r}")

    @property
    def id(self) -> str:
        """op:shape_class:dist:platform:kv_cache_dtype:model_dtype:scales:seed, then
        ``:c<config>`` when the case has a shape config."""
        head = ":".join(str(getattr(self, f.name)) for f in fields(self)
                        if f.name != "config")
        return head if self.config is None else f"{head}:c{self.config}"

    @classmethod
    def from_id(cls, case_id: str) -> Case:
        parts = case_id.split(":")
        names = [f.name for f in fields(cls) if f.name != "config"]
        config = None
        if len(parts) == len(names) + 1 and parts[-1].startswith("c"):
            try:
                config = int(parts.pop()[1:])
            except ValueError:
                raise ValueError(f"config must read c<integer>, got {case_id!r}") from None
        if len(parts) != len(names):
            raise ValueError(f"case id must read {':'.join(names)}[:c<config>], got "
                             f"{case_id!r}")
        try:
            seed = int(parts[-1])
        except ValueError:
            raise ValueError(f"seed must be an integer, got {parts[-1]!r}") from None
        return cls(*parts[:-1], seed=seed, config=config)

    @property
    def kv_fmt(self) -> str:
        return kv_cache_format(self.kv_cache_dtype, self.platform, self.model_dtype)

    @property
    def index_fmt(self) -> str:
        """fp8 KV caches come with an fp8 (the platform's e4m3) index cache."""
        return index_cache_format(is_fp8(self.kv_fmt), self.platform, self.model_dtype)

    def replay_command(self, impl: str | None = None) -> str:
        suffix = f" --impl {impl}" if impl else ""
        return f"python -m oracle replay {self.id}{suffix}"

    def as_dict(self) -> dict:
        return asdict(self)


def input_hash(inputs: dict) -> str:
    """sha256 over every array and scalar of an input set, in key order."""
    h = hashlib.sha256()
    for key in sorted(inputs):
        value = inputs[key]
        h.update(key.encode())
        if isinstance(value, np.ndarray):
            a = np.ascontiguousarray(value)
            h.update(str((a.dtype.str, a.shape)).encode())
            h.update(a.reshape(-1).view(np.uint8))  # its bytes, without tobytes()'s copy
        else:
            h.update(repr(value).encode())
    return h.hexdigest()[:16]


# ---------------------------------------------------------------------------- values


def draw_values(bg, dist: str, shape, fmt: str | None = None, std: float = 1.0) -> np.ndarray:
    """float64 values of a distribution (not yet rounded). ``fmt``: the fp8 format whose
    max / min subnormal the near_overflow / tiny distributions aim at."""
    if dist in ("normal", "ties"):
        return std * rand.normal(bg, shape)
    if dist == "outliers":
        base = std * rand.normal(bg, shape)
        hit = rand.uniform(bg, shape) < 1e-3
        return base + np.where(hit, 10.0 * rand.normal(bg, shape), 0.0)
    f = FORMATS[fmt if fmt is not None and is_fp8(fmt) else "e4m3fn"]
    sign = np.where(rand.integers(bg, 0, 2, shape) == 1, -1.0, 1.0)
    if dist == "near_overflow":
        return sign * f.max_finite * (0.85 + 0.3 * rand.uniform(bg, shape))
    return sign * f.min_subnormal * np.exp2(6 * rand.uniform(bg, shape) - 2)  # tiny


def to_model(values, model_dtype: str) -> np.ndarray:
    """Values rounded to the model dtype, returned as float64 (the reference's activations)."""
    from reference.codec import round_to

    return round_to(values, model_dtype)


def draw_scales(bg, kind: str, fmt: str, num_kv_heads: int, num_slots: int, small=False):
    """None, a random float32 scalar, or a random float32 ``[Hkv, num_slots]`` array. Random
    values, never powers of two: exactly representable scales hide re-rounding errors."""
    if kind == "none":
        return None
    lo, hi = (2.0**-6, 2.0**-3) if small else (0.25, 4.0)
    shape = () if kind == "tensor" else (num_kv_heads, num_slots)
    s = np.exp(np.log(lo) + (np.log(hi) - np.log(lo)) * rand.uniform(bg, shape))
    return np.float32(s) if kind == "tensor" else s.astype(np.float32)


def poison_code(fmt: str) -> int:
    """The NaN code a cache is poisoned with (fp8: 0x7F OCP / 0x80 fnuz; bf16/fp16 qNaN)."""
    return FORMATS[fmt].nan_code


# ------------------------------------------------------------------------------ shapes


def pick(bg, options):
    """One of ``options``, uniformly, from the raw stream ``bg``."""
    return options[int(rand.integers(bg, 0, len(options), ())[()])]


def _between(bg, lo, hi) -> int:
    """Integer uniform on [lo, hi]."""
    return int(rand.integers(bg, lo, hi + 1, ())[()])


def head_shape(bg, shape_class: str) -> dict:
    """Hkv, G (Hq = G * Hkv), D, P for a shape class."""
    if shape_class == "model":
        return dict(num_kv_heads=MODEL.num_kv_heads, group=MODEL.num_q_heads // MODEL.num_kv_heads,
                    head_dim=MODEL.head_dim, page_size=MODEL.page_size)
    if shape_class == "tiny":
        return dict(num_kv_heads=_between(bg, 1, 2), group=pick(bg, (1, 2, 4)), head_dim=64,
                    page_size=16)
    if shape_class == "long":
        return dict(num_kv_heads=pick(bg, (1, 3, 4)), group=pick(bg, (1, 2, 8, 16)),
                    head_dim=MODEL.head_dim, page_size=pick(bg, (16, 64, 128)))
    if shape_class == "sweep":
        return dict(num_kv_heads=_between(bg, 1, 8), group=_between(bg, 1, 16),
                    head_dim=pick(bg, (64, 128, 256)), page_size=pick(bg, (16, 32, 64, 128)))
    return dict(num_kv_heads=_between(bg, 1, 8), group=pick(bg, (1, 2, 3, 8, 16)),
                head_dim=pick(bg, (64, 128, 128, 256)), page_size=pick(bg, (16, 32, 64, 128)))


def _random_pages(bg, num_pages: int, count: int) -> np.ndarray:
    """``count`` distinct physical pages out of ``num_pages``, in random order."""
    return rand.permutation(bg, num_pages)[:count].astype(np.int32)


def _layout(bg, shape_class):
    if shape_class == "model":
        return "HND", 0
    return pick(bg, ("HND", "NHD")), pick(bg, (0, 0, 8))


# -------------------------------------------------------------------------- op inputs


def _token_count(bg, shape_class: str, row_width: int) -> int:
    if shape_class != "sweep":
        return {"tiny": _between(bg, 1, 8), "small": _between(bg, 1, 64), "model": 256}[
            shape_class]
    if rand.uniform(bg, ())[()] < 0.05:
        return 0
    n = int(np.exp2(14 * rand.uniform(bg, ())[()]))  # log-uniform on 1..16,384
    return max(1, min(n, SWEEP_ELEMENTS // row_width))


def _with_specials(bg, v: np.ndarray) -> np.ndarray:
    """v with -0, +Inf, -Inf and NaN on ~1% of its entries (the cache insert must apply
    satfinite to them, contract.md s.4)."""
    v = np.array(v, copy=True)
    hit = rand.uniform(bg, v.shape) < 0.01
    kind = rand.integers(bg, 0, 4, v.shape)
    specials = np.array([-0.0, np.inf, -np.inf, np.nan])
    v[hit] = specials[kind[hit]]
    return v


def _insert_inputs(case: Case, bg, sg, fused: bool) -> dict:
    hs = head_shape(sg, case.shape_class)
    hkv, g, d, page = hs["num_kv_heads"], hs["group"], hs["head_dim"], hs["page_size"]
    n = _token_count(sg, case.shape_class, (g + 3) * hkv * d + 2 * d)
    num_pages = -(-n // page) + 2
    num_slots = num_pages * page
    slots = rand.permutation(bg, num_slots)[:n].astype(np.int64)
    slots[rand.uniform(bg, (n,)) < 0.1] = -1  # padding tokens are skipped
    layout_name, pad = _layout(sg, case.shape_class)
    kv_fmt = case.kv_fmt
    cache = empty_cache(num_pages, hkv, page, d, kv_fmt, layout_name, pad,
                        fill_code=poison_code(kv_fmt))
    out = dict(slot_mapping=slots, kv_cache=cache, kv_fmt=kv_fmt, model_dtype=case.model_dtype,
               cache_layout=layout_name)
    near = case.dist == "near_overflow"
    out["k_scale"] = draw_scales(bg, case.scales, kv_fmt, hkv, num_slots, small=near)
    out["v_scale"] = draw_scales(bg, case.scales, kv_fmt, hkv, num_slots)
    if not fused:
        k = to_model(draw_values(bg, case.dist, (n, hkv, d), kv_fmt), case.model_dtype)
        v = to_model(draw_values(bg, case.dist, (n, hkv, d), kv_fmt), case.model_dtype)
        if case.dist == "outliers":
            v = _with_specials(bg, v)
        out.update(k=k, v=v)
        return out
    dense = case.shape_class != "model" and rand.uniform(sg, ())[()] < 0.2
    hi = 0 if dense else _index_heads(sg, case.shape_class, hkv)
    layout = QKVLayout(g * hkv, hkv, d, num_index_heads=hi, has_index_k=not dense)
    rotary = MODEL.rotary_dim if case.shape_class == "model" else 2 * _between(
        sg, 1, min(d, 128) // 2 if case.shape_class == "sweep" else d // 2)
    # Positions up to 2^14 keep the table cheap to build; large positions are the
    # fp32-angle problem of the table builder, which is an input here.
    max_pos = 1 << 14
    positions = rand.integers(bg, 0, max_pos, (n,))
    # Rows arrive as a column slice of a wider buffer (the server's packed qkv view).
    width = layout.row_width
    values = draw_values(bg, "normal" if case.dist == "near_overflow" else case.dist,
                         (n, width + 16), kv_fmt)
    rows = to_model(values, case.model_dtype)[:, 8 : 8 + width]
    if case.dist == "outliers":
        v_cols = slice((g + 1) * hkv * d, (g + 2) * hkv * d)
        rows[:, v_cols] = _with_specials(bg, rows[:, v_cols])
    w_std = 4.0 if near else 0.3
    weights = {kind: to_model(w_std * rand.normal(bg, (d,)), case.model_dtype)
               for kind in ("q", "k", "index_q", "index_k")}
    index_cache, index_slots = None, None
    if not dense:
        index_cache, index_slots = _index_target(case, bg, sg, n, num_slots, page, d)
    # Drawn last, like the index target: Gemma's 1e-6 mostly, and values a kernel that
    # hard-codes it (or drops it) gets visibly wrong.
    eps = MODEL.eps if case.shape_class == "model" else pick(bg, EPS_CHOICES)
    out.update(rows=rows, positions=positions, num_q_heads=g * hkv, num_kv_heads=hkv,
               head_dim=d, num_index_heads=hi, has_index_k=not dense, rotary_dim=rotary,
               eps=eps, weights_q=weights["q"], weights_k=weights["k"],
               weights_index_q=weights["index_q"], weights_index_k=weights["index_k"],
               rope_table=rope_table(max_pos, rotary, MODEL.rope_base, case.model_dtype),
               index_cache=index_cache, index_fmt=case.index_fmt if not dense else None,
               index_slot_mapping=index_slots)
    return out


def _index_pad(sg, shape_class: str) -> int:
    """Codes of padding after each index-cache row (0: contiguous), as ``_layout`` pads
    the KV cache's."""
    return 0 if shape_class == "model" else pick(sg, (0, 0, 8))


def with_row_padding(cache: np.ndarray, pad: int, fmt: str) -> np.ndarray:
    """``cache`` ([..., D] codes of ``fmt``) as a view of a buffer with ``pad`` poison codes
    after each row: the same contents through non-contiguous strides."""
    if not pad:
        return cache
    phys = np.full(cache.shape[:-1] + (cache.shape[-1] + pad,), poison_code(fmt), cache.dtype)
    phys[..., :cache.shape[-1]] = cache
    return phys[..., :cache.shape[-1]]


#: The RMSNorm epsilons a fused insert case draws (the model's, none, and one as large as
#: the rows' mean square, not a power of two).
EPS_CHOICES = (MODEL.eps, MODEL.eps, 0.0, 0.3)


def _index_heads(sg, shape_class: str, hkv: int) -> int:
    """Index query heads of a fused insert with index_k: the model's, else mostly Hkv (as
    the model), sometimes none (index_k alone) or another count."""
    if shape_class == "model":
        return MODEL.num_index_heads
    return pick(sg, (hkv, hkv, 0, 1, 3))


#: Page sizes an index cache of its own takes (the main cache's P among them, or not).
INDEX_PAGE_SIZES = (16, 32, 64)


def _index_target(case: Case, bg, sg, n: int, num_slots: int, page: int, d: int):
    """(index cache, index_slot_mapping) of a fused insert, drawn after everything else so
    that the other inputs do not depend on it. A third of the cases share the main slots
    (``index_slot_mapping`` None, the default) in an index cache of at least as many slots,
    whose page size may differ from the main cache's, so a slot's page and offset differ
    between the caches; the others give the index cache its own page size, page count and
    a slot mapping of its own (a random permutation of its slots, negative on about 10% of
    the tokens independently of ``slot_mapping``), so index_k written at the main slots,
    or a token skipped on the other mapping's -1, shows. Model shapes keep the main P."""
    own = pick(sg, (False, True, True))
    ic_page = page if case.shape_class == "model" else pick(sg, INDEX_PAGE_SIZES)
    if own:
        ic_pages = -(-n // ic_page) + _between(sg, 1, 3)
    else:
        ic_pages = -(-num_slots // ic_page)
    cache = empty_index_cache(ic_pages, ic_page, d, case.index_fmt,
                              fill_code=poison_code(case.index_fmt))
    cache = with_row_padding(cache, _index_pad(sg, case.shape_class), case.index_fmt)
    if not own:
        return cache, None
    islots = rand.permutation(bg, ic_pages * ic_page)[:n].astype(np.int64)
    islots[rand.uniform(bg, (n,)) < 0.1] = -1
    return cache, islots


def _long_contexts(bg, decode: bool, heads: int) -> np.ndarray:
    """1-3 contexts log-uniform on 2k..128k (decode) or 2k..64k (prefill prefixes), their
    total times ``heads`` capped at LONG_TOKEN_HEADS; never a multiple of 16."""
    b = _between(bg, 1, 3)
    top = LONG_DECODE_TOKENS if decode else LONG_PREFIX_TOKENS
    seq = np.exp2(11 + (np.log2(top) - 11) * rand.uniform(bg, (b,))).astype(np.int64)
    seq = np.minimum(seq, LONG_TOKEN_HEADS // heads // b)
    return (seq - 1) | 1  # odd (not a multiple of any P) and still within the cap


def _requests(bg, shape_class: str, page: int, decode: bool,
              heads: int = 1) -> tuple[np.ndarray, np.ndarray]:
    """(seq_lens, query_lens): contexts not multiples of P; decode rows share one count.
    ``heads``: the KV heads a long case's contexts are capped with."""
    if shape_class == "long":
        seq = _long_contexts(bg, decode, heads)
        b = len(seq)
    else:
        b = {"tiny": _between(bg, 1, 2), "small": _between(bg, 1, 4), "model": 4}[shape_class]
        max_blocks = {"tiny": 4, "small": 24, "model": 64}[shape_class]
        seq = rand.integers(bg, 1, max_blocks * page, (b,))
    if decode:
        rows = _between(bg, 1, 4)
        seq = np.maximum(seq, rows)
        if b > 1 and shape_class != "model":
            pad = rand.uniform(bg, (b,)) < 0.25
            pad[int(rand.integers(bg, 0, b, ())[()])] = False  # at least one real request
            seq[pad] = 0  # graph padding rows
        return seq, np.where(seq > 0, rows, rows)
    new = rand.integers(bg, 1, {"tiny": 24, "small": 96, "model": 128, "long": 128}[
        shape_class] + 1, (b,))
    if shape_class == "long":
        return seq + new, new  # a prefix of seq tokens, then the new ones
    return seq, np.minimum(seq, new)


def _draw_topk(bg, shape_class: str, seq_lens, page: int) -> int:
    """K: the model's 16; otherwise mostly below the visible block count (so the selection
    is a real choice), sometimes anywhere in the domain 1..64."""
    if shape_class == "model" or shape_class == "long" and rand.uniform(bg, ())[()] < 0.5:
        return MODEL.topk
    if shape_class == "long":
        return _between(bg, 1, 64)
    blocks = max(1, -(-int(np.max(seq_lens)) // page))
    if shape_class == "small" and rand.uniform(bg, ())[()] < 0.25:
        return _between(bg, 1, 64)
    return _between(bg, 1, max(1, blocks // 2))


def _paged_layout(bg, seq_lens, page, extra_pages=2):
    """A block table with shuffled distinct pages per request; unused entries -1."""
    blocks = -(-seq_lens // page)
    num_pages = int(blocks.sum()) + extra_pages
    perm = rand.permutation(bg, num_pages).astype(np.int32)
    width = max(1, int(blocks.max()))
    table = np.full((len(seq_lens), width), -1, np.int32)
    used = 0
    for r, nb in enumerate(blocks):
        table[r, :nb] = perm[used : used + nb]
        used += nb
    return table, num_pages


def _index_inputs(case: Case, bg, sg, decode: bool) -> dict:
    hs = head_shape(sg, case.shape_class)
    hi, d, page = hs["num_kv_heads"], hs["head_dim"], hs["page_size"]
    seq, qlens = _requests(sg, case.shape_class, page, decode, heads=1)
    table, num_pages = _paged_layout(bg, seq, page)
    fmt = case.index_fmt
    cache = empty_index_cache(num_pages, page, d, fmt, fill_code=poison_code(fmt))
    keys = draw_values(bg, case.dist, (num_pages, page, d), fmt)
    if case.dist == "ties":
        keys = _with_ties(bg, keys, table, seq, page)
    codes = quantize(to_model(keys, case.model_dtype), fmt)
    # Only visible slots hold keys; everything else stays poisoned.
    for r, s in enumerate(seq):
        pos = np.arange(s)
        pages, offs = table[r, pos // page], pos % page
        cache[pages, offs] = codes[pages, offs]
    total = int(qlens.sum()) if not decode else len(seq) * int(qlens[0])
    q = to_model(draw_values(bg, "normal" if case.dist == "ties" else case.dist,
                             (total, hi, d), fmt), case.model_dtype)
    if is_fp8(fmt):
        from reference.codec import decode as dec

        q = dec(encode(q, fmt, "satfinite"), fmt)
    topk = _draw_topk(sg, case.shape_class, seq, page)
    local = MODEL.local_blocks if case.shape_class == "model" else _between(bg, 0, 2)
    initial = MODEL.initial_blocks if case.shape_class == "model" else _between(bg, 0, 2)
    cache = with_row_padding(cache, _index_pad(sg, case.shape_class), fmt)  # drawn last
    if case.dist == "outliers":
        _with_nan_keys(bg, cache, table, seq, page, fmt)
    out = dict(index_q=q, index_cache=cache, index_fmt=fmt, block_table=table, seq_lens=seq,
               topk=topk, local_blocks=local, initial_blocks=initial,
               model_dtype=case.model_dtype)
    if decode:
        out["rows_per_request"] = int(qlens[0])
    else:
        out["cu_seqlens_q"] = np.concatenate([[0], np.cumsum(qlens)]).astype(np.int32)
    return out


def _with_nan_keys(bg, cache, table, seq, page, fmt):
    """A NaN code in one element of 1 + seq_len // 128 random visible keys of each request
    (in place): their blocks score NaN, which ranks below every number (contract.md s.5)."""
    for r, s in enumerate(seq):
        if s <= 0:
            continue
        count = 1 + int(s) // 128
        pos = rand.integers(bg, 0, int(s), (count,))
        dims = rand.integers(bg, 0, cache.shape[-1], (count,))
        cache[table[r, pos // page], pos % page, dims] = poison_code(fmt)


def _with_ties(bg, keys, table, seq, page):
    """Copy whole blocks onto others (exact ties), some with one element nudged by a relative
    2^-9 (near ties within bf16/e4m3 resolution)."""
    keys = keys.copy()
    for r, s in enumerate(seq):
        nb = -(-int(s) // page)
        if nb < 2:
            continue
        for _ in range(max(1, nb // 2)):
            src, dst = rand.integers(bg, 0, nb, (2,))
            keys[table[r, dst]] = keys[table[r, src]]
            if rand.uniform(bg, ())[()] < 0.5:
                keys[table[r, dst], 0, 0] *= 1 + 2.0**-9
    return keys


def _scale_rows(scale, head, slots):
    """Scale of each slot of one head as a column (or the scalar, or 1.0)."""
    if scale is None:
        return 1.0
    return scale if np.ndim(scale) == 0 else scale[head, slots][:, None].astype(np.float64)


def random_selections(bg, positions, page: int, num_heads: int, k: int, local: int = 1):
    """``[num_heads, T, K]`` selections: for each row at position p (or -1: padding, all -1) a
    random set of n = min(K, p//P + 1) visible blocks, the last ``local`` visible blocks
    always in, in random order with the -1 padding scattered anywhere."""
    positions = np.asarray(positions)
    t = len(positions)
    visible = np.where(positions >= 0, positions // page + 1, 0)
    width = max(1, int(visible.max(initial=0)))
    b = np.arange(width)
    key = rand.uniform(bg, (num_heads, t, width))
    key = np.where(b >= visible[:, None] - local, 2.0, key)  # forced local blocks first
    key = np.where(b < visible[:, None], key, -1.0)  # invisible blocks never
    order = np.argsort(-key, axis=-1, kind="stable")[..., :k]
    if order.shape[-1] < k:
        order = np.concatenate([order, np.full(order.shape[:-1] + (k - order.shape[-1],),
                                               width)], axis=-1)
    n = np.minimum(k, visible)[None, :, None]
    sel = np.where(np.arange(k) < n, order, -1).astype(np.int32)
    shuffle = np.argsort(rand.uniform(bg, sel.shape), axis=-1)
    return np.take_along_axis(sel, shuffle, axis=-1)


#: The std of an attention near_overflow case's queries (keys are N(0, 1)): logits ~ N(0, 48^2).
NEAR_OVERFLOW_Q_STD = 48.0


def _partial_selections(bg, topk, hkv):
    """A quarter of the rows keep a random nonempty part of their selection, the rest -1
    (an attention op takes any set: block 0 is then often absent while -1 entries are
    present, so reading -1 as block 0 changes the output). Drawn after everything else, so
    the other inputs of a case do not depend on it."""
    sel = topk.copy()
    hk, t, k = sel.shape
    cut = rand.uniform(bg, (hk, t)) < 0.25
    keep = rand.uniform(bg, (hk, t, k)) < 0.5
    valid = sel >= 0
    keep |= ~cut[..., None] | ~valid
    # At least one valid entry of a cut row stays (its first).
    first = np.argmax(valid, axis=-1)
    np.put_along_axis(keep, first[..., None], True, axis=-1)
    return np.where(keep, sel, -1).astype(sel.dtype)


def _attention_inputs(case: Case, bg, sg, decode: bool) -> dict:
    hs = head_shape(sg, case.shape_class)
    hkv, g, d, page = hs["num_kv_heads"], hs["group"], hs["head_dim"], hs["page_size"]
    seq, qlens = _requests(sg, case.shape_class, page, decode, heads=hkv)
    table, num_pages = _paged_layout(bg, seq, page)
    fmt = case.kv_fmt
    layout_name, pad = _layout(sg, case.shape_class)
    cache = empty_cache(num_pages, hkv, page, d, fmt, layout_name, pad,
                        fill_code=poison_code(fmt))
    num_slots = num_pages * page
    near = case.dist == "near_overflow"
    k_scale = draw_scales(bg, case.scales, fmt, hkv, num_slots)
    v_scale = draw_scales(bg, case.scales, fmt, hkv, num_slots)
    k_all = draw_values(bg, "normal" if near else case.dist, (num_pages, hkv, page, d), fmt)
    v_all = draw_values(bg, case.dist, (num_pages, hkv, page, d), fmt)
    for r, s in enumerate(seq):
        pos = np.arange(s)
        pages, offs = table[r, pos // page], pos % page
        slots = pages.astype(np.int64) * page + offs
        for h in range(hkv):
            ks = _scale_rows(k_scale, h, slots)
            vs = _scale_rows(v_scale, h, slots)
            # near_overflow: V / v_scale lands around the format's max, as the writer sees it.
            k_vals = to_model(k_all[pages, h, offs], case.model_dtype)
            v_vals = to_model(v_all[pages, h, offs] * (vs if near else 1.0), case.model_dtype)
            cache[pages, h, offs, :d] = quantize(k_vals, fmt, ks)
            cache[pages, h, offs, d:] = quantize(v_vals, fmt, vs)
    if decode:
        rows = int(qlens[0])
        positions = np.concatenate([np.arange(s - rows, s) if s else np.full(rows, -1)
                                    for s in seq])
    else:
        positions = np.concatenate([np.arange(s - n, s) for s, n in zip(seq, qlens)])
    t = len(positions)
    k = _draw_topk(sg, case.shape_class, seq, page)
    topk = random_selections(bg, positions, page, hkv, k)
    # near_overflow: logits of +-100 and more (attention sinks), so a row's log-sum-exp lies
    # past exp2's fp32 range: a split-K merge must subtract the max.
    std = {"normal": 2.5, "near_overflow": NEAR_OVERFLOW_Q_STD}.get(case.dist, 1.0)
    q = to_model(draw_values(bg, case.dist if case.dist != "near_overflow" else "normal",
                             (t, g * hkv, d), fmt, std=std), case.model_dtype)
    topk = _partial_selections(bg, topk, hkv)
    out = dict(q=q, kv_cache=cache, kv_fmt=fmt, block_table=table, seq_lens=seq, topk=topk,
               k_scale=k_scale, v_scale=v_scale, model_dtype=case.model_dtype,
               cache_layout=layout_name)
    if decode:
        out["rows_per_request"] = int(qlens[0])
    else:
        out["cu_seqlens_q"] = np.concatenate([[0], np.cumsum(qlens)]).astype(np.int32)
    return out


def shape_stream(case: Case, bg):
    """Where a case draws its shapes from: its own stream ``bg`` (no config: shapes and
    values interleave in one stream, as they always have), or a stream named by (op,
    shape class, config)."""
    if case.config is None:
        return bg
    return rand.generator(rand.seed_of(f"shape:{case.op}:{case.shape_class}:{case.config}"))


#: The Case fields that pick a kernel's compiled variant beyond its shapes (dtypes,
#: format constexprs, scale kinds): what ``config_formats`` fixes per config.
FORMAT_FIELDS = ("platform", "kv_cache_dtype", "model_dtype", "scales")


def config_formats(op: str, shape_class: str, config: int) -> dict:
    """The format fields (``FORMAT_FIELDS``) of a config, drawn uniformly over the valid
    combinations from a stream named by (op, shape class, config). A fuzz run that pins
    them (``fuzz --pin-formats``) meets one compiled variant per kernel and config instead
    of one per format, scale kind and model dtype as well; the fields stay explicit in
    every case id, so a case replays without knowing its config's origin."""
    bg = rand.generator(rand.seed_of(f"formats:{op}:{shape_class}:{config}"))
    while True:
        fields = dict(platform=pick(bg, PLATFORMS), kv_cache_dtype=pick(bg, KV_CACHE_DTYPES),
                      model_dtype=pick(bg, MODEL_DTYPES), scales=pick(bg, SCALES))
        try:
            Case(op, shape_class, config=config, **fields)
        except ValueError:
            continue
        return fields


#: The index arrays of each op, each drawn int32 or int64 (the kernels take both).
INDEX_ARRAYS = {
    "norm_rope_insert": ("positions", "slot_mapping", "index_slot_mapping"),
    "reshape_and_cache": ("slot_mapping",),
}
_TABLE_ARRAYS = ("block_table", "seq_lens", "cu_seqlens_q")


def _with_index_dtypes(sg, op: str, out: dict) -> dict:
    """``out`` with each index array (slots, positions, block tables, lengths) in int32 or
    int64, drawn per array and last from the shape stream ``sg``, so that the other inputs
    do not depend on it and the cases of one config share the widths (a kernel's compiled
    specialisation holds them) as they share their shapes."""
    for key in INDEX_ARRAYS.get(op, _TABLE_ARRAYS):
        dtype = pick(sg, (np.int64, np.int32))
        if out.get(key) is not None:
            out[key] = np.asarray(out[key]).astype(dtype)
    return out


def make_inputs(case: Case) -> dict:
    """The input set of a case (numpy arrays and scalars), a pure function of the case."""
    bg = rand.generator(rand.seed_of(case.id))
    sg = shape_stream(case, bg)
    makers = {
        "norm_rope_insert": lambda: _insert_inputs(case, bg, sg, fused=True),
        "reshape_and_cache": lambda: _insert_inputs(case, bg, sg, fused=False),
        "indexer_prefill": lambda: _index_inputs(case, bg, sg, decode=False),
        "indexer_decode": lambda: _index_inputs(case, bg, sg, decode=True),
        "attention_prefill": lambda: _attention_inputs(case, bg, sg, decode=False),
        "attention_decode": lambda: _attention_inputs(case, bg, sg, decode=True),
    }
    return _with_index_dtypes(sg, case.op, makers[case.op]())
