"""Host-side argument checks shared by the kernel launchers (Triton and CUDA), and the
decode kernels' kept workspace.

Every check raises ``ValueError`` whose message starts with the argument's name and says
the valid range, before anything is launched (contract.md section 7, "value checks"): shapes,
dtypes and strides always; tensor *contents* (slot ranges, duplicate slots) only under
``validate=True``, because reading them back is a host sync.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from reference.formats import FORMATS, FP8_FORMATS, INDEX_FP8_FORMATS
from reference.formats import MODEL_DTYPES as MODEL_FORMATS

MODEL_DTYPES = {getattr(torch, FORMATS[name].torch_dtype): name for name in MODEL_FORMATS}
HALF_FORMATS = {name: dt for dt, name in MODEL_DTYPES.items()}
KV_FP8_FORMATS = FP8_FORMATS
HEAD_DIMS = (64, 128, 256)
SLOT_DTYPES = (torch.int32, torch.int64)


def fail(name: str, msg: str):
    raise ValueError(f"{name} {msg}")


def check_tensor(t, name, dtypes, shape=None, device=None) -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        fail(name, f"must be a torch tensor, got {type(t).__name__}")
    if t.dtype not in dtypes:
        fail(name, f"must have dtype in {[str(d) for d in dtypes]}, got {t.dtype}")
    if shape is not None and tuple(t.shape) != tuple(shape):
        fail(name, f"must have shape {list(shape)}, got {list(t.shape)}")
    if device is not None and t.device != device:
        fail(name, f"must be on {device}, got {t.device}")
    return t


def check_int(value, name: str, lo: int, hi: int | None = None) -> int:
    """An integer in [lo, hi] (hi None: unbounded)."""
    ok = isinstance(value, (int, np.integer)) and not isinstance(value, bool) and value >= lo \
        and (hi is None or value <= hi)
    if not ok:
        rng = f">= {lo}" if hi is None else f"in [{lo}, {hi}]"
        fail(name, f"must be an integer {rng}, got {value!r}")
    return int(value)


def check_last_dim_contiguous(t: torch.Tensor, name: str) -> None:
    if t.dim() and t.shape[-1] > 1 and t.stride(-1) != 1:
        fail(name, "must have a contiguous last dim (stride 1)")


def check_kv_fmt(kv_fmt) -> bool:
    """True for an fp8 format; the valid names otherwise raise."""
    valid = KV_FP8_FORMATS + tuple(HALF_FORMATS)
    if kv_fmt not in valid:
        fail("kv_fmt", f"must be one of {list(valid)}, got {kv_fmt!r}")
    return kv_fmt in KV_FP8_FORMATS


def check_kv_cache(kv_cache, kv_fmt, hkv: int, d: int, dev) -> tuple[int, int]:
    """The main cache: logical ``[num_pages, Hkv, P, 2D]``, any strides with the last dim
    contiguous, uint8 codes of an fp8 ``kv_fmt`` or the bf16/fp16 dtype it names. Returns
    (P, num_slots)."""
    fp8 = check_kv_fmt(kv_fmt)
    check_tensor(kv_cache, "kv_cache", (torch.uint8,) if fp8 else (HALF_FORMATS[kv_fmt],),
                 device=dev)
    if kv_cache.dim() != 4 or kv_cache.shape[1] != hkv or kv_cache.shape[3] != 2 * d:
        fail("kv_cache", f"must have logical shape [num_pages, Hkv={hkv}, P, 2D={2 * d}], got "
                         f"{list(kv_cache.shape)}")
    if kv_cache.shape[2] not in (16, 32, 64, 128):
        fail("kv_cache", f"must have a page size P in [16, 32, 64, 128], got {kv_cache.shape[2]}")
    check_last_dim_contiguous(kv_cache, "kv_cache")
    if any(s < 0 for s in kv_cache.stride()):
        fail("kv_cache", f"must have non-negative strides, got {list(kv_cache.stride())}")
    return kv_cache.shape[2], kv_cache.shape[0] * kv_cache.shape[2]


_UNIT_SCALES: dict = {}


def unit_scale(dev) -> torch.Tensor:
    """A read-only float32 1.0 on ``dev``, made once per device (a fill kernel per call
    would be a measurable share of a short insert); never cached while a CUDA graph is
    being captured, since the tensor would then live in the graph's private pool."""
    key = str(dev)
    if key not in _UNIT_SCALES:
        one = torch.ones(1, dtype=torch.float32, device=dev)
        if torch.device(dev).type == "cuda" and torch.cuda.is_current_stream_capturing():
            return one
        _UNIT_SCALES[key] = one
    return _UNIT_SCALES[key]


def scale_arg(scale, name, fp8, hkv, num_slots, dev):
    """(tensor, stride over heads, stride over slots) of a None / scalar / ``[Hkv, slots]``
    float32 scale; model-dtype caches take no scale (None or 1.0)."""
    if scale is None:
        return unit_scale(dev), 0, 0
    if isinstance(scale, (float, int, np.floating, np.integer)) and not isinstance(scale, bool):
        scale = torch.tensor(float(np.float32(scale)), dtype=torch.float32, device=dev)
    check_tensor(scale, name, (torch.float32,), device=dev)
    if scale.dim() == 0 or (scale.dim() == 1 and scale.numel() == 1):
        if not fp8 and float(scale.reshape(())) != 1.0:
            fail(name, "applies to fp8 caches only; model-dtype caches take no scale")
        return scale.reshape(1), 0, 0
    if scale.shape != (hkv, num_slots):
        fail(name, f"must be a scalar or of shape [Hkv, num_pages*P] = [{hkv}, {num_slots}], "
                   f"got {list(scale.shape)}")
    if not fp8:
        fail(name, "applies to fp8 caches only; model-dtype caches take no scale")
    return scale, scale.stride(0), scale.stride(1)


def validate_slots(slots: torch.Tensor, name: str, num_slots: int) -> None:
    """``validate=True`` content check (a host sync): every slot is -1..num_slots-1 (any
    negative value means skip) and no non-negative slot appears twice."""
    s = slots.detach().to("cpu", torch.int64)
    bad = s >= num_slots
    if bool(bad.any()):
        i = int(bad.nonzero()[0, 0])
        fail(name, f"must hold slots in [0, {num_slots - 1}] or negative (skip); "
                   f"entry {i} is {int(s[i])}")
    used = s[s >= 0]
    uniq, counts = torch.unique(used, return_counts=True)
    if bool((counts > 1).any()):
        dup = int(uniq[counts > 1][0])
        fail(name, f"must not repeat a non-negative slot in one call; slot {dup} appears "
                   f"{int(counts[counts > 1][0])} times")


def resolve_formats(kv_fmt, kv_cache_dtype, platform, model_dtype, index_cache=None,
                    index_fmt=None) -> tuple[str, str | None]:
    """(kv_fmt, index_fmt) from either explicit format names or vLLM's ``kv_cache_dtype``
    string read on ``platform`` (contract.md s.2: "fp8" is e4m3fn on cuda, e4m3fnuz on
    rocm-fnuz). An index cache without ``index_fmt`` is read by its dtype: uint8 means the
    platform's e4m3, otherwise the model dtype."""
    from reference.platforms import PLATFORMS, index_cache_format, kv_cache_format

    if platform not in PLATFORMS:
        fail("platform", f"must be one of {list(PLATFORMS)}, got {platform!r}")
    if (kv_fmt is None) == (kv_cache_dtype is None):
        fail("kv_fmt", "or kv_cache_dtype: give exactly one of them")
    if kv_fmt is None:
        try:
            kv_fmt = kv_cache_format(kv_cache_dtype, platform, model_dtype)
        except ValueError as e:
            fail("kv_cache_dtype", str(e).split(" ", 1)[1])
    if index_fmt is None and index_cache is not None and isinstance(index_cache, torch.Tensor):
        index_fmt = index_cache_format(index_cache.dtype == torch.uint8, platform, model_dtype)
    return kv_fmt, index_fmt


# ------------------------------------------------ the fused insert's whole host check


def _check_out(t, name, dtype, n, heads, d, dev):
    check_tensor(t, name, (dtype,), (n, heads, d), dev)
    check_last_dim_contiguous(t, name)
    return t


@dataclass
class InsertPlan:
    """What ``plan_norm_rope_insert`` checked and derived: sizes, resolved formats, the
    scale tensors and their strides, the index cache (a 1-element dummy when not written),
    the index slot mapping, and the output views ``out``."""

    n: int
    hq: int
    hkv: int
    hi: int  # index heads in the layout
    d: int
    width: int
    act: torch.dtype
    md: str
    kv_fmt: str
    kv_fp8: bool
    page: int
    num_slots: int
    ks: torch.Tensor
    ks_strides: tuple[int, int]
    vs: torch.Tensor
    vs_strides: tuple[int, int]
    write_ik: bool
    transform_iq: bool
    index_fmt: str | None
    idx_fp8: bool
    ic: torch.Tensor
    ic_strides: tuple[int, int]
    ic_page: int
    ic_slots: int
    islots: torch.Tensor
    out: dict


def plan_norm_rope_insert(rows, positions, rope_table, w_q, w_k, *, num_q_heads, num_kv_heads,
                          head_dim, rotary_dim, eps, kv_cache, slot_mapping, kv_fmt=None,
                          kv_cache_dtype=None, platform="cuda", num_index_heads=0,
                          has_index_k=False, w_index_q=None, w_index_k=None, k_scale=None,
                          v_scale=None, index_cache=None, index_fmt=None,
                          index_slot_mapping=None, q_out=None, index_q_out=None,
                          skip_index=False, validate=False) -> InsertPlan:
    """Every host check of the fused insert (``kernels.norm_rope_insert.norm_rope_insert``'s
    contract, in the same order with the same messages: shapes, dtypes, strides, formats,
    scales; contents under ``validate=True``), and the output views (index_q allocated when
    it is fp8 and no ``index_q_out`` is given). Shared by the Triton and CUDA launchers."""
    n, hq, hkv, hi, d, width, md = _check_rows(rows, positions, rope_table, num_q_heads,
                                               num_kv_heads, num_index_heads, head_dim,
                                               rotary_dim, eps, has_index_k)
    dev, act = rows.device, rows.dtype
    write_ik = not skip_index and bool(has_index_k)
    transform_iq = not skip_index and hi > 0
    for name, w, needed in (("w_q", w_q, True), ("w_k", w_k, True),
                            ("w_index_q", w_index_q, transform_iq),
                            ("w_index_k", w_index_k, write_ik)):
        if needed:
            check_tensor(w, name, (act,), (d,), dev)
            check_last_dim_contiguous(w, name)
    kv_fmt, index_fmt = resolve_formats(kv_fmt, kv_cache_dtype, platform, md, index_cache,
                                        index_fmt)
    kv_fp8 = check_kv_fmt(kv_fmt)
    page, num_slots = check_kv_cache(kv_cache, kv_fmt, hkv, d, dev)
    check_tensor(slot_mapping, "slot_mapping", SLOT_DTYPES, (n,), dev)
    check_last_dim_contiguous(slot_mapping, "slot_mapping")
    ks, ks0, ks1 = scale_arg(k_scale, "k_scale", kv_fp8, hkv, num_slots, dev)
    vs, vs0, vs1 = scale_arg(v_scale, "v_scale", kv_fp8, hkv, num_slots, dev)
    idx_fp8, ic, ic_strides, ic_page, ic_slots, islots = _check_index_cache(
        rows, d, md, write_ik, transform_iq, skip_index, index_cache, index_fmt,
        index_slot_mapping, slot_mapping)
    out = _insert_outputs(rows, n, hq, hkv, hi, d, width, idx_fp8, transform_iq, write_ik,
                          q_out, index_q_out)
    if validate and n:
        validate_slots(slot_mapping, "slot_mapping", num_slots)
        if write_ik:
            validate_slots(islots, "index_slot_mapping" if index_slot_mapping is not None
                           else "slot_mapping", ic_slots)
        _validate_positions_and_scales(positions, rope_table, ks, vs)
    return InsertPlan(n, hq, hkv, hi, d, width, act, md, kv_fmt, kv_fp8, page, num_slots,
                      ks, (ks0, ks1), vs, (vs0, vs1), write_ik, transform_iq, index_fmt,
                      idx_fp8, ic, ic_strides, ic_page, ic_slots, islots, out)


def _check_rows(rows, positions, rope_table, num_q_heads, num_kv_heads, num_index_heads,
                head_dim, rotary_dim, eps, has_index_k):
    """The packed rows' layout, positions and RoPE table: (N, Hq, Hkv, Hi, D, row width,
    model dtype name)."""
    check_tensor(rows, "rows", tuple(MODEL_DTYPES))
    dev, act = rows.device, rows.dtype
    hq = check_int(num_q_heads, "num_q_heads", 1)
    hkv = check_int(num_kv_heads, "num_kv_heads", 1)
    hi = check_int(num_index_heads, "num_index_heads", 0)
    if hq % hkv:
        fail("num_q_heads", f"must be a multiple of num_kv_heads={hkv}, got {hq}")
    if head_dim not in HEAD_DIMS:
        fail("head_dim", f"must be one of {list(HEAD_DIMS)}, got {head_dim!r}")
    d = int(head_dim)
    if not isinstance(rotary_dim, (int, np.integer)) or isinstance(rotary_dim, bool) \
            or rotary_dim < 2 or rotary_dim % 2 or rotary_dim > d:
        fail("rotary_dim", f"must be an even integer with 2 <= rotary_dim <= head_dim={d}, "
                           f"got {rotary_dim!r}")
    if not (isinstance(eps, (float, int, np.floating)) and np.isfinite(eps) and eps >= 0):
        fail("eps", f"must be a finite number >= 0, got {eps!r}")
    width = (hq + 2 * hkv + hi) * d + (d if has_index_k else 0)
    if rows.dim() != 2 or rows.shape[1] != width:
        fail("rows", f"must have shape [N, row_width={width}], got {list(rows.shape)}")
    check_last_dim_contiguous(rows, "rows")
    n = rows.shape[0]
    check_tensor(positions, "positions", SLOT_DTYPES, (n,), dev)
    check_last_dim_contiguous(positions, "positions")
    check_tensor(rope_table, "rope_table", (act,), device=dev)
    if rope_table.dim() != 2 or rope_table.shape[1] != rotary_dim or rope_table.shape[0] < 1:
        fail("rope_table", f"must have shape [max_positions, rotary_dim={rotary_dim}], got "
                           f"{list(rope_table.shape)}")
    check_last_dim_contiguous(rope_table, "rope_table")
    return n, hq, hkv, hi, d, width, MODEL_DTYPES[act]


def _check_index_cache(rows, d, md, write_ik, transform_iq, skip_index, index_cache,
                       index_fmt, index_slot_mapping, slot_mapping):
    """The index cache and its format: (index fp8, cache, its page / row strides, page
    size, slots, index slot mapping); a dummy cache when index_k is not written."""
    n, dev, act = rows.shape[0], rows.device, rows.dtype
    formats = INDEX_FP8_FORMATS + (md,)
    if not write_ik:
        if index_cache is not None and not skip_index:
            fail("index_cache", "given but the layout has no index_k (dense rows)")
        if index_fmt is not None and index_fmt not in formats:
            fail("index_fmt", f"must be one of {list(formats)} or None, got {index_fmt!r}")
        idx_fp8 = transform_iq and index_fmt is not None and index_fmt in INDEX_FP8_FORMATS
        return idx_fp8, torch.empty(1, dtype=act, device=dev), (0, 0), 1, 0, slot_mapping
    if index_fmt not in formats:
        fail("index_fmt", f"must be one of {list(formats)}, got {index_fmt!r}")
    idx_fp8 = index_fmt in INDEX_FP8_FORMATS
    if index_cache is None:
        fail("index_cache", "is required when the layout has index_k (or pass "
                            "skip_index=True)")
    check_tensor(index_cache, "index_cache", (torch.uint8,) if idx_fp8 else (act,),
                 device=dev)
    if index_cache.dim() != 3 or index_cache.shape[2] != d:
        fail("index_cache", f"must have shape [num_pages, P, D={d}], got "
                            f"{list(index_cache.shape)}")
    check_last_dim_contiguous(index_cache, "index_cache")
    islots = slot_mapping
    if index_slot_mapping is not None:
        islots = check_tensor(index_slot_mapping, "index_slot_mapping", SLOT_DTYPES, (n,),
                              dev)
        check_last_dim_contiguous(islots, "index_slot_mapping")
    ic_page = index_cache.shape[1]
    return (idx_fp8, index_cache, (index_cache.stride(0), index_cache.stride(1)), ic_page,
            index_cache.shape[0] * ic_page, islots)


def _insert_outputs(rows, n, hq, hkv, hi, d, width, idx_fp8, transform_iq, write_ik, q_out,
                    index_q_out) -> dict:
    """The outputs: views of the rows, or the given q_out / index_q_out (checked); an fp8
    index_q is allocated when no index_q_out is given."""
    dev, act = rows.device, rows.dtype
    view = rows.unflatten(1, (width // d, d)) if n else rows.reshape(0, width // d, d)
    out = {"q": view[:, :hq], "k": view[:, hq:hq + hkv]}
    if q_out is not None:
        out["q"] = _check_out(q_out, "q_out", act, n, hq, d, dev)
    if transform_iq:
        if index_q_out is not None:
            out["index_q"] = _check_out(index_q_out, "index_q_out",
                                        torch.uint8 if idx_fp8 else act, n, hi, d, dev)
        elif idx_fp8:
            out["index_q"] = torch.empty((n, hi, d), dtype=torch.uint8, device=dev)
        else:
            out["index_q"] = view[:, hq + 2 * hkv:hq + 2 * hkv + hi]
    if write_ik:
        out["index_k"] = view[:, -1]
    return out


def _validate_positions_and_scales(positions, rope_table, ks, vs):
    """``validate=True``: positions are rows of the RoPE table; scales positive and finite."""
    p = positions.detach().cpu()
    if bool(((p < 0) | (p >= rope_table.shape[0])).any()):
        fail("positions", f"must lie in [0, {rope_table.shape[0] - 1}] (rows of "
                          f"rope_table), got {int(p.min())}..{int(p.max())}")
    for name, sc in (("k_scale", ks), ("v_scale", vs)):
        if not bool(torch.isfinite(sc).all() & (sc > 0).all()):
            fail(name, "must hold positive finite values")


class Workspace:
    """Scratch memory of the decode kernels kept across calls (``workspace=`` of
    ``indexer_decode`` and ``sparse_attention_decode``), so a call neither allocates nor
    zeroes anything: what a server holds per stream, as vLLM and FlashInfer keep their
    workspace buffers.

    Two kinds of buffer, by name: ``counters`` (int32 ticket counters, zeroed when made or
    grown; every launch leaves them zero again, because the program that draws a counter's
    last ticket stores 0 to it) and ``scratch`` (partial results, no initial value). A
    fresh per-call counter buffer costs a fill kernel before every launch (a node of its
    own in a CUDA graph). Buffers only grow (a larger request replaces the buffer; the
    caching allocator keeps the old one alive until the work queued on it is done).

    One workspace per stream of concurrent launches: two launches in flight on one
    workspace race on its counters and partials. Calls in order on one stream (eager, or
    replays of graphs captured with it) may share one, across kernels too. A launch that
    dies mid-way (a CUDA error, which poisons the context anyway) may leave counters
    non-zero: make a new workspace then."""

    def __init__(self):
        self._bufs: dict[tuple, torch.Tensor] = {}

    @staticmethod
    def device_key(device) -> torch.device:
        """``device`` as the tensors made on it name theirs: "cuda" is the current CUDA
        device, "cuda:N" (a launcher passes its tensors' device, a caller may pass
        "cuda": both must find the same buffers)."""
        d = torch.device(device)
        if d.type == "cuda" and d.index is None:
            d = torch.device("cuda", torch.cuda.current_device())
        return d

    def _take(self, name: str, numel: int, dtype, device, zero: bool) -> torch.Tensor:
        key = (name, dtype, self.device_key(device))
        buf = self._bufs.get(key)
        if buf is None or buf.numel() < numel:
            make = torch.zeros if zero else torch.empty
            buf = self._bufs[key] = make(max(numel, 1), dtype=dtype, device=device)
        return buf[:numel]

    def held(self, name: str, device) -> torch.Tensor | None:
        """The whole buffer ``name`` ("counters" or a scratch name) on ``device`` as it is
        now, or None: for checks (unlike ``counters``, never grows or zeroes it)."""
        dev = self.device_key(device)
        return next((b for (n, _, d), b in self._bufs.items() if n == name and d == dev),
                    None)

    def check_counters(self):
        """ValueError naming ``workspace`` when any of its counters is not zero (a host
        sync: the launchers call it under ``validate=True``): a launch on it died, or ran
        concurrently with another on the same workspace, and the next merge would go
        wrong silently."""
        for (name, _, dev), buf in self._bufs.items():
            if name == "counters" and bool(buf.any()):
                bad = int(buf.nonzero()[0, 0])
                fail("workspace", f"must hold zero ticket counters between launches, got "
                                  f"{int(buf[bad])} at counter {bad} on {dev} (a launch on it "
                                  f"died or ran concurrently on another stream): make a new "
                                  f"Workspace")

    def counters(self, n: int, device) -> torch.Tensor:
        """``n`` int32 counters, all zero (kept zero by the kernels between calls)."""
        return self._take("counters", n, torch.int32, device, zero=True)

    def scratch(self, name: str, shape, dtype, device) -> torch.Tensor:
        """An uninitialised buffer of ``shape`` (a view of the named buffer)."""
        numel = int(np.prod(shape)) if len(shape) else 1
        return self._take(name, numel, dtype, device, zero=False).view(tuple(shape))


#: The workspace of every call of the registered ``triton_workspace`` implementations (both
#: decode ops): the oracle's cases one after another in a process, as a server's steps, so
#: a counter some case's launch left non-zero would spoil a later case's merge.
ORACLE_WORKSPACE = Workspace()
ORACLE_WORKSPACE_NOTES = ("the default launch with kernels._host.ORACLE_WORKSPACE kept across "
                          "every case of both decode ops (no counter fill per call; the "
                          "kernels leave the counters zero)")


def check_workspace(workspace) -> Workspace | None:
    """``workspace`` as given (None or a ``Workspace``), else ValueError naming it."""
    if workspace is not None and not isinstance(workspace, Workspace):
        fail("workspace", f"must be None or a kernels._host.Workspace, got "
                          f"{type(workspace).__name__}")
    return workspace


def take_counters(workspace: Workspace | None, n: int, device) -> torch.Tensor:
    """``n`` zeroed int32 ticket counters: the workspace's, or fresh (a fill per call)."""
    if workspace is None:
        return torch.zeros(max(n, 1), dtype=torch.int32, device=device)
    return workspace.counters(max(n, 1), device)


def take_scratch(workspace: Workspace | None, name: str, shape, dtype, device
                 ) -> torch.Tensor:
    """An uninitialised ``shape`` buffer: the workspace's ``name`` buffer, or fresh."""
    if workspace is None:
        return torch.empty(tuple(shape), dtype=dtype, device=device)
    return workspace.scratch(name, shape, dtype, device)
