"""Fused Gemma RMSNorm + partial NeoX RoPE + paged KV / index-cache insert in ONE Triton
kernel (contract.md sections 3, 4).

One launch per batch, a persistent grid: every program strides over the work items
(token, block of BLOCK_H heads) of q, then those of k (a k item also inserts its K and V
heads into the paged cache), of index_q, and (when present) of the single index_k head
(which also goes into the index cache); the kinds with fewer than BLOCK_H heads take
several tokens per item (TB tokens x HB heads, BLOCK_H rows, ``_rows``), so that no loop
pays a q item's per-item work for a fraction of its bytes. Each loop's loads are
software-pipelined through shared memory (``num_stages``). Per head:
``n = x * rsqrt(mean(x^2) + eps) * (1 + w)``
in fp32, then rotate-half RoPE with the table row of the token's position, as given. Any
even R <= D: a head is loaded as three contiguous segments, the rotated halves [0, R/2) and
[R/2, R) (each other's RoPE partners, element by element) and the pass-through dims [R, D),
each padded to a power of two and masked, so R/2 need not be a power of two and every load
is a vector load (a gathered partner load costs instructions). ``half`` = R/2 is
a runtime argument, not a constexpr: one compile serves every R with the same padded
segment widths (a constexpr R/2 compiled the kernel anew for each of the D/2 values, which
kept a random-shape fuzz run compiling). Triton specialises it by divisibility as any
integer argument, so at R/2 = 32 (the model) the segments' loads are the same 8-byte
vectors as with the constexpr (same global/shared load instructions in the sm_90 SASS,
``benchmarks/static_sm90.py --divisible half``; 96 registers instead of 123); an R/2 that
16 does not divide loads its second segment element-wise.

Outputs: q, k, index_k rounded once (RNE) to the model dtype; index_q in the index cache's
format (e4m3 codes of the fp32 value when the index cache is fp8). K goes into the cache
from its fp32 value (``quantize_from="value"``: one rounding), divided by its scale; V from
its model-dtype value divided by its scale (as two multiplications, ``scale_reciprocal``:
within one fp32 ulp of the division), fp8 caches through ``encode_fp8`` satfinite
(compiled: the hardware cast in inline assembly, four values per call, for e4m3fn/e5m2;
the software codec for the fnuz formats). Caches are addressed
through their strides (HND, NHD, padded) with 64-bit offsets; negative (and, defensively,
out-of-range) slots are skipped; out-of-range positions read no table row.

``norm_rope_insert(...)`` is the host launcher (validates dtypes, shapes, strides and
formats; raises ValueError naming the argument); oracle/impls/triton.py registers it as
implementation ``"triton"`` of op ``"norm_rope_insert"``.
"""

from __future__ import annotations

from kernels._host import check_int, fail, plan_norm_rope_insert
from kernels._triton import ensure_ready, is_interpreted, resident_programs, tl, triton
from kernels.fp8 import HW_FORMATS, encode_asm, encode_fp8, fmt_code, scale_reciprocal


@triton.jit
def _weights(w_ptr, D: tl.constexpr, half, BLOCK_HALF: tl.constexpr,
             BLOCK_REST: tl.constexpr):
    """1 + w (fp32) of the three segments of a head: loaded once per program."""
    a = tl.arange(0, BLOCK_HALF)
    w1 = 1.0 + tl.load(w_ptr + a, mask=a < half, other=0.0).to(tl.float32)
    w2 = 1.0 + tl.load(w_ptr + half + a, mask=a < half, other=0.0).to(tl.float32)
    p = 2 * half + tl.arange(0, BLOCK_REST)
    w3 = 1.0 + tl.load(w_ptr + p, mask=p < D, other=0.0).to(tl.float32)
    return w1, w2, w3


@triton.jit
def _first_item(pid, nprog, nblocks):
    """A program's first work item (token block, head block) and its stride (token blocks,
    head blocks): items ``pid, pid + nprog, ...`` of the token-major order, stepped by
    ``_next_item`` without a division per item (two integer divisions were ~13% of the q
    loop's SASS)."""
    return pid // nblocks, pid % nblocks, nprog // nblocks, nprog % nblocks


@triton.jit
def _next_item(tb, b, step_t, step_b, nblocks):
    """The item after (tb, b) in a program's stride."""
    nb = b + step_b
    carry = nb >= nblocks
    return tb + step_t + carry.to(tb.dtype), tl.where(carry, nb - nblocks, nb)


@triton.jit
def _table_row(pos, table_ptr, table_stride, max_pos):
    """The RoPE table row of position(s) pos and whether pos lies in the table (outside:
    row 0, masked off by that flag)."""
    pos_ok = (pos >= 0) & (pos < max_pos)
    return table_ptr + tl.where(pos_ok, pos, 0) * table_stride, pos_ok


@triton.jit
def _token(tok, rows_ptr, row_stride, pos_ptr, table_ptr, table_stride, max_pos):
    """A q item's token (a scalar): its row, its RoPE table row and the position's validity
    (``_table_row``)."""
    t64 = tl.cast(tok, tl.int64)
    cs, pos_ok = _table_row(tl.load(pos_ptr + t64).to(tl.int64), table_ptr, table_stride,
                            max_pos)
    return t64, rows_ptr + t64 * row_stride, cs, pos_ok


@triton.jit
def _rows(tb, b, n, n_heads, rows_ptr, row_stride, pos_ptr, table_ptr, table_stride,
          max_pos, TB: tl.constexpr, HB: tl.constexpr):
    """The TB x HB rows (token, head) of item (token block tb, head block b) of a kind with
    few heads per token (k, index_q, index_k): the tokens' int64 indices, the heads, the
    row mask (token < n, head < n_heads), the tokens' rows, and their RoPE table rows
    ``[TB x HB, 1]`` with the positions' validity (``_table_row``)."""
    r = tl.arange(0, TB * HB)
    t = tb * TB + r // HB
    h = b * HB + r % HB
    ok = (t < n) & (h < n_heads)
    t64 = t.to(tl.int64)
    cs, pos_ok = _table_row(tl.load(pos_ptr + t64, mask=ok, other=-1).to(tl.int64), table_ptr,
                            table_stride, max_pos)
    return t64, h, ok, rows_ptr + t64 * row_stride, cs[:, None], pos_ok[:, None]


@triton.jit
def _norm_rope_head(base, rmask, w1, w2, w3, cs_ptr, pos_ok, eps, D: tl.constexpr, half,
                    BLOCK_HALF: tl.constexpr, BLOCK_REST: tl.constexpr,
                    HAS_REST: tl.constexpr):
    """fp32 norm + RoPE of the heads at ``base`` (``[rows, 1]`` pointers to their dim 0;
    rows masked by ``rmask``), in three segments of a head: the rotated halves [0, half)
    and [half, 2 half), and the pass-through dims [2 half, D). Each segment is a
    contiguous load (vectorised, and pipelined through shared memory by the caller's
    loop): no gathered partner lanes, and any even R works (a segment's tail is masked).
    ``cs_ptr`` / ``pos_ok``: the table row of all rows (scalars, a q item's one token) or
    of each (``[rows, 1]``). Returns the three fp32 segments."""
    a = tl.arange(0, BLOCK_HALF)
    amask = rmask[:, None] & (a < half)[None, :]
    x1 = tl.load(base + a[None, :], mask=amask, other=0.0).to(tl.float32)
    x2 = tl.load(base + half + a[None, :], mask=amask, other=0.0).to(tl.float32)
    ss = tl.sum(x1 * x1, axis=1) + tl.sum(x2 * x2, axis=1)
    if HAS_REST:
        p = 2 * half + tl.arange(0, BLOCK_REST)
        x3 = tl.load(base + p[None, :], mask=rmask[:, None] & (p < D)[None, :],
                     other=0.0).to(tl.float32)
        ss += tl.sum(x3 * x3, axis=1)
    r = tl.math.rsqrt(ss / D + eps)[:, None]
    cmask = (a < half)[None, :] & pos_ok
    c = tl.load(cs_ptr + a[None, :], mask=cmask, other=0.0).to(tl.float32)
    s = tl.load(cs_ptr + half + a[None, :], mask=cmask, other=0.0).to(tl.float32)
    n1 = x1 * r * w1[None, :]
    n2 = x2 * r * w2[None, :]
    y1 = n1 * c - n2 * s
    y2 = n2 * c + n1 * s
    if HAS_REST:
        y3 = x3 * r * w3[None, :]
    else:
        y3 = tl.zeros((1, BLOCK_REST), tl.float32)
    return y1, y2, y3


@triton.jit
def _store_head(dst, y1, y2, y3, rmask, D: tl.constexpr, half,
                BLOCK_HALF: tl.constexpr, BLOCK_REST: tl.constexpr, HAS_REST: tl.constexpr):
    """Store the three segments of heads (dst: ``[rows, 1]`` pointers to their dim 0)."""
    a = tl.arange(0, BLOCK_HALF)
    amask = rmask[:, None] & (a < half)[None, :]
    tl.store(dst + a[None, :], y1, mask=amask)
    tl.store(dst + half + a[None, :], y2, mask=amask)
    if HAS_REST:
        p = 2 * half + tl.arange(0, BLOCK_REST)
        tl.store(dst + p[None, :], y3, mask=rmask[:, None] & (p < D)[None, :])


# Counts and sizes vary from call to call: not specialised (one compile for every shape).
@triton.jit(do_not_specialize=["max_pos", "n", "num_slots", "ic_num_slots", "hq", "hkv", "hi"])
def _norm_rope_insert_kernel(
        rows_ptr, row_stride, pos_ptr, table_ptr, table_stride, max_pos, n,
        wq_ptr, wk_ptr, wiq_ptr, wik_ptr,
        q_out, q_s0, q_s1, iq_out, iq_s0, iq_s1,
        kv_ptr, kv_s0, kv_s1, kv_s2, page_size, num_slots, slot_ptr,
        ks_ptr, ks_s0, ks_s1, vs_ptr, vs_s0, vs_s1,
        ic_ptr, ic_s0, ic_s1, ic_page, ic_num_slots, islot_ptr,
        hq, hkv, hi, eps, half,
        D: tl.constexpr, BLOCK_H: tl.constexpr, KV_TB: tl.constexpr, KV_HB: tl.constexpr,
        IQ_TB: tl.constexpr, IQ_HB: tl.constexpr, IK_TB: tl.constexpr,
        BLOCK_D: tl.constexpr, BLOCK_HALF: tl.constexpr,
        BLOCK_REST: tl.constexpr, HAS_REST: tl.constexpr, NUM_STAGES: tl.constexpr,
        KV_FP8: tl.constexpr, KV_FMT: tl.constexpr, KV_HW: tl.constexpr,
        IDX_FP8: tl.constexpr, IDX_FMT: tl.constexpr, IDX_HW: tl.constexpr,
        HAS_IK: tl.constexpr, SCALAR_SCALES: tl.constexpr = False,
        KV_ASM: tl.constexpr = False):
    # A persistent grid: each program strides over the work items of four loops, one per
    # head kind (q, k + V + KV insert, index_q, index_k + index insert). A q item is one
    # token's block of BLOCK_H q heads; the kinds with few heads per token take TB tokens x
    # HB heads per item (HB = their head count, at most BLOCK_H; TB x HB = BLOCK_H rows):
    # one token's 4 k heads (or its one index_k head) per item left those loops
    # issue-bound on per-item work (address, mask and pipeline instructions for a quarter
    # or an eighth of a q item's bytes). Blocks are no wider than the kind's head count,
    # so no lanes compute masked-off heads. A loop body has no branches, so Triton
    # pipelines its loads through shared memory NUM_STAGES deep: loads in flight no
    # longer cost registers (the first, one-program-per-item kernel was register-bound at
    # ~30 KB in flight per SM, ~60% of the copy bandwidth). k and index_k are written
    # back in place into the row (row stride row_stride); q and index_q go to (s0,
    # s1)-strided outputs, which may be the row itself. An item's heads are read only by
    # that item, so prefetching later items cannot see a half-written head.
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    nqb = tl.cdiv(hq, BLOCK_H)
    w1, w2, w3 = _weights(wq_ptr, D, half, BLOCK_HALF, BLOCK_REST)
    q_tok, q_b, st, sb = _first_item(pid, nprog, nqb)
    for _ in tl.range(pid, n * nqb, nprog, num_stages=NUM_STAGES):
        tok, row, cs, pos_ok = _token(q_tok, rows_ptr, row_stride, pos_ptr, table_ptr,
                                      table_stride, max_pos)
        heads = q_b * BLOCK_H + tl.arange(0, BLOCK_H)
        q_tok, q_b = _next_item(q_tok, q_b, st, sb, nqb)
        hmask = heads < hq
        h64 = heads[:, None].to(tl.int64)
        y1, y2, y3 = _norm_rope_head(row + h64 * D, hmask, w1, w2, w3, cs, pos_ok, eps, D,
                                     half, BLOCK_HALF, BLOCK_REST, HAS_REST)
        qt = q_out.dtype.element_ty
        _store_head(q_out + tok * q_s0 + h64 * q_s1, y1.to(qt), y2.to(qt), y3.to(qt),
                    hmask, D, half, BLOCK_HALF, BLOCK_REST, HAS_REST)

    nkb = tl.cdiv(hkv, KV_HB)
    dims = tl.arange(0, BLOCK_D)
    kw1, kw2, kw3 = _weights(wk_ptr, D, half, BLOCK_HALF, BLOCK_REST)
    k_tb, k_b, st, sb = _first_item(pid, nprog, nkb)
    if SCALAR_SCALES:
        # Loaded once: per item, the two scale loads were pipelined through shared memory
        # like the rows, ~600 SASS of (mostly uniform-datapath) address and pipeline work
        # in an issue-bound loop (static sm_90, 2 warps: e4m3 cache 2,864 SASS vs bf16
        # 2,240; loaded once 2,584, at 128 registers instead of 96).
        ks_all = tl.load(ks_ptr)
        vs_all = tl.load(vs_ptr)
    for _ in tl.range(pid, tl.cdiv(n, KV_TB) * nkb, nprog, num_stages=NUM_STAGES):
        tok, kheads, kok, row, cs, pos_ok = _rows(
            k_tb, k_b, n, hkv, rows_ptr, row_stride, pos_ptr, table_ptr, table_stride,
            max_pos, KV_TB, KV_HB)
        k_tb, k_b = _next_item(k_tb, k_b, st, sb, nkb)
        h64 = kheads.to(tl.int64)
        kbase = row[:, None] + hq * D + h64[:, None] * D
        ky1, ky2, ky3 = _norm_rope_head(kbase, kok, kw1, kw2, kw3, cs, pos_ok, eps, D, half,
                                        BLOCK_HALF, BLOCK_REST, HAS_REST)
        vmask = kok[:, None] & (dims < D)[None, :]
        v = tl.load(kbase + hkv * D + dims[None, :], mask=vmask, other=0.0)
        kt = rows_ptr.dtype.element_ty
        _store_head(kbase, ky1.to(kt), ky2.to(kt), ky3.to(kt), kok, D, half, BLOCK_HALF,
                    BLOCK_REST, HAS_REST)
        slot = tl.load(slot_ptr + tok, mask=kok, other=-1).to(tl.int64)
        ok = (slot >= 0) & (slot < num_slots)
        sl = tl.where(ok, slot, 0)
        kv = (kv_ptr + (sl // page_size) * kv_s0 + h64 * kv_s1
              + (sl % page_size) * kv_s2)[:, None]
        if KV_FP8:
            if SCALAR_SCALES:
                ks = ks_all
                vs = vs_all
            else:
                ks = tl.load(ks_ptr + h64 * ks_s0 + sl * ks_s1, mask=ok, other=1.0)[:, None]
                vs = tl.load(vs_ptr + h64 * vs_s0 + sl * vs_s1, mask=ok, other=1.0)[:, None]
            ka, kb = scale_reciprocal(ks)
            va, vb = scale_reciprocal(vs)
            _store_head(kv, encode_fp8(ky1 * ka * kb, KV_FMT, KV_HW, KV_ASM),
                        encode_fp8(ky2 * ka * kb, KV_FMT, KV_HW, KV_ASM),
                        encode_fp8(ky3 * ka * kb, KV_FMT, KV_HW, KV_ASM),
                        ok, D, half, BLOCK_HALF, BLOCK_REST, HAS_REST)
            tl.store(kv + D + dims[None, :],
                     encode_fp8(v.to(tl.float32) * va * vb, KV_FMT, KV_HW, KV_ASM),
                     mask=vmask & ok[:, None])
        else:
            ct = kv_ptr.dtype.element_ty
            _store_head(kv, ky1.to(ct), ky2.to(ct), ky3.to(ct), ok, D, half,
                        BLOCK_HALF, BLOCK_REST, HAS_REST)
            tl.store(kv + D + dims[None, :], v.to(ct), mask=vmask & ok[:, None])

    nib = tl.cdiv(hi, IQ_HB)
    iw1, iw2, iw3 = _weights(wiq_ptr, D, half, BLOCK_HALF, BLOCK_REST)
    i_tb, i_b, st, sb = _first_item(pid, nprog, nib)
    for _ in tl.range(pid, tl.cdiv(n, IQ_TB) * nib, nprog, num_stages=NUM_STAGES):
        tok, iheads, iok, row, cs, pos_ok = _rows(
            i_tb, i_b, n, hi, rows_ptr, row_stride, pos_ptr, table_ptr, table_stride,
            max_pos, IQ_TB, IQ_HB)
        i_tb, i_b = _next_item(i_tb, i_b, st, sb, nib)
        ih64 = iheads[:, None].to(tl.int64)
        iy1, iy2, iy3 = _norm_rope_head(row[:, None] + (hq + 2 * hkv) * D + ih64 * D, iok,
                                        iw1, iw2, iw3, cs, pos_ok, eps, D, half, BLOCK_HALF,
                                        BLOCK_REST, HAS_REST)
        iq_dst = iq_out + tok[:, None] * iq_s0 + ih64 * iq_s1
        if IDX_FP8:
            _store_head(iq_dst, encode_fp8(iy1, IDX_FMT, IDX_HW),
                        encode_fp8(iy2, IDX_FMT, IDX_HW), encode_fp8(iy3, IDX_FMT, IDX_HW),
                        iok, D, half, BLOCK_HALF, BLOCK_REST, HAS_REST)
        else:
            it = iq_out.dtype.element_ty
            _store_head(iq_dst, iy1.to(it), iy2.to(it), iy3.to(it), iok, D, half,
                        BLOCK_HALF, BLOCK_REST, HAS_REST)

    if HAS_IK:
        jw1, jw2, jw3 = _weights(wik_ptr, D, half, BLOCK_HALF, BLOCK_REST)
        for j in tl.range(pid, tl.cdiv(n, IK_TB), nprog, num_stages=NUM_STAGES):
            tok, _h, jok, row, cs, pos_ok = _rows(
                j, 0, n, 1, rows_ptr, row_stride, pos_ptr, table_ptr, table_stride,
                max_pos, IK_TB, 1)
            jbase = row[:, None] + (hq + 2 * hkv + hi) * D
            jy1, jy2, jy3 = _norm_rope_head(jbase, jok, jw1, jw2, jw3, cs, pos_ok, eps, D,
                                            half, BLOCK_HALF, BLOCK_REST, HAS_REST)
            ikt = rows_ptr.dtype.element_ty
            _store_head(jbase, jy1.to(ikt), jy2.to(ikt), jy3.to(ikt), jok, D, half,
                        BLOCK_HALF, BLOCK_REST, HAS_REST)
            islot = tl.load(islot_ptr + tok, mask=jok, other=-1).to(tl.int64)
            iok = (islot >= 0) & (islot < ic_num_slots)
            isl = tl.where(iok, islot, 0)
            ic = (ic_ptr + (isl // ic_page) * ic_s0 + (isl % ic_page) * ic_s1)[:, None]
            if IDX_FP8:
                _store_head(ic, encode_fp8(jy1, IDX_FMT, IDX_HW),
                            encode_fp8(jy2, IDX_FMT, IDX_HW), encode_fp8(jy3, IDX_FMT, IDX_HW),
                            iok, D, half, BLOCK_HALF, BLOCK_REST, HAS_REST)
            else:
                ict = ic_ptr.dtype.element_ty
                _store_head(ic, jy1.to(ict), jy2.to(ict), jy3.to(ict), iok, D, half,
                            BLOCK_HALF, BLOCK_REST, HAS_REST)


#: True when the kernel runs in the (patched) CPU interpreter.
INTERPRETED = is_interpreted(_norm_rope_insert_kernel)


# ---------------------------------------------------------------------------- launcher

#: Launch defaults: the fastest of benchmarks/tune_insert.py's sweep (docs/tuning.md).
BLOCK_H, NUM_WARPS, NUM_STAGES = 8, 2, 3
#: Registers per thread (ptxas maxnreg; 0: the compiler's choice): 128 fits more programs
#: per SM without spilling at D <= 128.
MAX_REGISTERS = 128


def _token_blocks(kind: str, block_h: int, heads: int) -> dict:
    """A few-heads kind's item: HB heads (all of them, at most block_h) of TB tokens, TB x
    HB = block_h rows (as a q item)."""
    hb = min(block_h, triton.next_power_of_2(heads))
    return {f"{kind}_TB": block_h // hb, f"{kind}_HB": hb}


def norm_rope_insert(rows, positions, rope_table, w_q, w_k, *, num_q_heads, num_kv_heads,
                     head_dim, rotary_dim, eps, kv_cache, slot_mapping, kv_fmt=None,
                     kv_cache_dtype=None, platform="cuda",
                     num_index_heads=0, has_index_k=False, w_index_q=None, w_index_k=None,
                     k_scale=None, v_scale=None, index_cache=None, index_fmt=None,
                     index_slot_mapping=None, q_out=None, index_q_out=None,
                     skip_index=False, validate=False, block_h=None, num_warps=None,
                     num_stages=None, programs=None, max_registers=None):
    """Fused norm + RoPE + insert of packed rows ``[N, q | k | v | index_q | index_k]``.

    rows: bf16/fp16 ``[N, row_width]``, last dim contiguous, any row stride (a column slice
    of the server's packed buffer). k and index_k are transformed IN PLACE in ``rows``; q
    in place too unless ``q_out`` (``[N, Hq, D]`` model dtype, any head/token strides) is
    given; index_q in place when the index cache has the model dtype and ``index_q_out`` is
    None, else into ``index_q_out`` (allocated when None: uint8 e4m3 codes for an fp8
    index cache). v is never changed.
    positions: int32/int64 ``[N]``. rope_table: model dtype ``[max_pos, R]`` (cos | sin),
    used as given. kv_cache: logical ``[num_pages, Hkv, P, 2D]`` (any non-negative strides,
    last dim contiguous): uint8 codes of ``kv_fmt`` (an fp8 format), or bf16/fp16
    (``kv_fmt`` = its name); instead of ``kv_fmt``, vLLM's ``kv_cache_dtype`` string may be
    given, read on ``platform`` (cuda / rocm-ocp / rocm-fnuz). slot_mapping: int32/int64
    ``[N]``, negative = skip. Scales: None, a float, or float32 tensors (0-d or
    ``[Hkv, num_pages*P]``), fp8 caches only.
    index_cache ``[num_pages', P', D]``: uint8 e4m3fn/e4m3fnuz codes or the model dtype,
    written at ``index_slot_mapping`` (default: slot_mapping); ``index_fmt`` defaults to
    the platform's e4m3 for a uint8 index cache, the model dtype otherwise.
    ``skip_index=True``: the index heads are neither transformed nor inserted (rows keep
    them as they are; no index cache is needed).
    Tuning knobs (defaults: the module's tuned constants): ``block_h`` rows (heads x
    tokens) per work item, ``num_warps``, ``num_stages`` (depth of the loads' shared-memory
    pipeline), ``programs`` (the persistent grid; default: as many as the GPU holds at once,
    ``kernels._triton.resident_programs``; never more than the work items),
    ``max_registers`` (ptxas ``maxnreg``; default MAX_REGISTERS for D <= 128, else 0: the
    compiler's choice).
    ``validate=True``: also check tensor contents on the host (slot ranges, duplicate
    slots, positions within the table, positive finite scales) -- a device sync. Without
    it, bad contents are guarded in the kernel: out-of-range or negative slots write
    nothing, out-of-range positions read no table row (their rotated dims are then 0).

    Returns views ``{"q", "k"}`` (``[N, H, D]``), plus ``"index_q"`` ``[N, Hi, D]`` and
    ``"index_k"`` ``[N, D]`` when transformed. The caches are written in place."""
    p = plan_norm_rope_insert(
        rows, positions, rope_table, w_q, w_k, num_q_heads=num_q_heads,
        num_kv_heads=num_kv_heads, head_dim=head_dim, rotary_dim=rotary_dim, eps=eps,
        kv_cache=kv_cache, slot_mapping=slot_mapping, kv_fmt=kv_fmt,
        kv_cache_dtype=kv_cache_dtype, platform=platform, num_index_heads=num_index_heads,
        has_index_k=has_index_k, w_index_q=w_index_q, w_index_k=w_index_k, k_scale=k_scale,
        v_scale=v_scale, index_cache=index_cache, index_fmt=index_fmt,
        index_slot_mapping=index_slot_mapping, q_out=q_out, index_q_out=index_q_out,
        skip_index=skip_index, validate=validate)
    if p.n == 0:
        return p.out
    block_h, items = _work_items(p, block_h)
    ensure_ready(_norm_rope_insert_kernel)
    args = _insert_args(p, rows, positions, rope_table, w_q, w_k, w_index_q, w_index_k,
                        kv_cache, slot_mapping, eps, rotary_dim)
    kwargs = _insert_const(p, block_h, rotary_dim, num_stages, num_warps, max_registers)
    if programs is None:
        programs = 4 if INTERPRETED else resident_programs(_norm_rope_insert_kernel, args,
                                                           kwargs, rows.device)
    check_int(programs, "programs", 1, 2**31 - 1)
    _norm_rope_insert_kernel[(min(programs, items),)](*args, **kwargs)
    return p.out


def _work_items(p, block_h) -> tuple[int, int]:
    """(rows per work item, work items): block_h (default ``BLOCK_H``, 64 interpreted) capped
    at the largest head count; the items of the longest loop, q's."""
    hq, hkv, hi, n = p.hq, p.hkv, p.hi, p.n
    if block_h is None:
        block_h = 64 if INTERPRETED else BLOCK_H
    if block_h <= 0 or block_h & (block_h - 1):
        fail("block_h", f"must be a power of two, got {block_h}")
    block_h = min(block_h, triton.next_power_of_2(max(hq, hkv, hi, 1)))
    items = n * max(triton.cdiv(hq, block_h), 1)  # the longest loop: q
    if n * triton.cdiv(max(hq, hkv, hi, 1), block_h) >= 2**31:
        fail("rows", f"N x head blocks must stay below 2^31 (int32 work items), got N = {n}")
    return block_h, items


def _insert_args(p, rows, positions, rope_table, w_q, w_k, w_index_q, w_index_k, kv_cache,
                 slot_mapping, eps, rotary_dim) -> tuple:
    """The kernel's runtime arguments (unused weights and index_q strides as placeholders)."""
    out = p.out
    iq = out.get("index_q", rows)
    iq_s = (iq.stride(0), iq.stride(1)) if "index_q" in out else (0, 0)
    return (
        rows, rows.stride(0), positions, rope_table, rope_table.stride(0), rope_table.shape[0],
        p.n, w_q, w_k, w_index_q if p.transform_iq else w_q,
        w_index_k if p.write_ik else w_q,
        out["q"], out["q"].stride(0), out["q"].stride(1), iq, iq_s[0], iq_s[1],
        kv_cache, kv_cache.stride(0), kv_cache.stride(1), kv_cache.stride(2), p.page,
        p.num_slots, slot_mapping, p.ks, *p.ks_strides, p.vs, *p.vs_strides,
        p.ic, *p.ic_strides, p.ic_page, p.ic_slots, p.islots,
        p.hq, p.hkv, p.hi if p.transform_iq else 0, float(eps), rotary_dim // 2)


def _insert_const(p, block_h, rotary_dim, num_stages, num_warps, max_registers) -> dict:
    """The kernel's constexprs and launch options."""
    d = p.d
    kwargs = dict(
        D=d, BLOCK_H=block_h, **_token_blocks("KV", block_h, p.hkv),
        **_token_blocks("IQ", block_h, max(p.hi, 1)), IK_TB=block_h,
        BLOCK_D=triton.next_power_of_2(d),
        BLOCK_HALF=triton.next_power_of_2(max(rotary_dim // 2, 1)),
        BLOCK_REST=triton.next_power_of_2(max(d - rotary_dim, 1)), HAS_REST=rotary_dim < d,
        KV_FP8=p.kv_fp8, KV_FMT=fmt_code(p.kv_fmt) if p.kv_fp8 else 0,
        KV_HW=p.kv_fp8 and p.kv_fmt in HW_FORMATS,
        IDX_FP8=p.idx_fp8, IDX_FMT=fmt_code(p.index_fmt) if p.idx_fp8 else 0,
        IDX_HW=p.idx_fp8 and p.index_fmt in HW_FORMATS, HAS_IK=p.write_ik,
        KV_ASM=p.kv_fp8 and encode_asm(p.kv_fmt, True, INTERPRETED),
        SCALAR_SCALES=p.kv_fp8 and not any((*p.ks_strides, *p.vs_strides)),
        NUM_STAGES=num_stages or NUM_STAGES, num_warps=num_warps or NUM_WARPS)
    if max_registers is None:  # the cap holds at D <= 128; at D 256 it spills
        max_registers = MAX_REGISTERS if d <= 128 else 0
    if check_int(max_registers, "max_registers", 0, 255) and not INTERPRETED:
        kwargs["maxnreg"] = max_registers
    return kwargs


def compile_signatures():
    """(kernel, signature, constexprs) triples covering the constexpr branches, for the
    sm_90 compile check that runs on the CPU (tests/test_compile_sm90.py): compiled Triton
    rejects some code the interpreter accepts."""
    combos = [  # act, kv, kv fmt, hw, index, index fmt, hw, has index_k
        ("bf16", "u8", 0, True, "u8", 0, True, True),
        ("fp16", "fp16", 0, False, "fp16", 0, False, True),
        ("bf16", "u8", 3, False, "u8", 2, False, True),
        ("bf16", "u8", 1, True, "bf16", 0, False, False),
    ]
    out = []
    for act, kv, kv_fmt, kv_hw, idx, idx_fmt, idx_hw, has_ik in combos:
        sig = {name: "i64" for name in _norm_rope_insert_kernel.arg_names}
        for name in ("rows_ptr", "table_ptr", "wq_ptr", "wk_ptr", "wiq_ptr", "wik_ptr",
                     "q_out"):
            sig[name] = f"*{act}"
        sig.update(n="i32", pos_ptr="*i64", slot_ptr="*i32", islot_ptr="*i64", ks_ptr="*fp32",
                   vs_ptr="*fp32", kv_ptr=f"*{kv}", ic_ptr=f"*{idx}", iq_out=f"*{idx}",
                   hq="i32", hkv="i32", hi="i32", eps="fp32", half="i32")
        half = 32 if kv_fmt != 3 else 24  # R 64, and R 48 (segments not powers of two)
        const = dict(D=128, BLOCK_H=8, KV_TB=2, KV_HB=4, IQ_TB=2, IQ_HB=4, IK_TB=8,
                     BLOCK_D=128,
                     BLOCK_HALF=32, BLOCK_REST=triton.next_power_of_2(128 - 2 * half),
                     HAS_REST=True, KV_FP8=kv == "u8",
                     KV_FMT=kv_fmt, KV_HW=kv_hw, IDX_FP8=idx == "u8", IDX_FMT=idx_fmt,
                     IDX_HW=idx_hw, HAS_IK=has_ik, NUM_STAGES=3 if kv_fmt != 1 else 1,
                     SCALAR_SCALES=kv == "u8" and kv_fmt == 0, KV_ASM=kv == "u8" and kv_hw)
        sig.update(dict.fromkeys(const, "constexpr"))
        out.append((_norm_rope_insert_kernel, sig, const))
    return out
