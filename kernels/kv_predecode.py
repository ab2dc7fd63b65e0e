"""The pages a prefill batch reads, decoded once from fp8 to their exact values in the model
dtype, in one Triton kernel.

Why. The prefill's wide tier multiplies each union block with 128 query rows on the tensor
cores, whose operands must sit in shared memory as 16-bit values: an fp8 block is loaded,
converted in registers and staged again, once per tile that uses it, and a block shared
by many tiles (locality selections) is converted many times. Decoding every page of the
batch once beforehand costs one read of the fp8 bytes and one write of twice as many, and
leaves the wide tier the 16-bit cache's path (``kernels.attention_prefill``'s
``predecode``): q as given, the only operand computed in registers being P, where the fp8
path's row-scaled fp16 q sat in registers for the whole loop (sm_90: ``HGMMA`` with its A
operand in registers, 32 of them per thread, at 255 registers; from shared memory on the
16-bit path).

What. For request r, block j of its block table and KV head g: when ``j * P < seq_lens[r]``
and the entry is a page in ``[0, num_pages)``, the page's ``[P, 2D]`` codes of head g as
their exact values (``kernels.fp8.decode_fp8_f16``: every value of the four formats,
subnormals, Inf and NaN included, is an fp16 and a bf16 value) in the scratch's dtype, at
scratch page ``r * W + j`` (W the table's width), and ``out_table[r, j] = r * W + j``;
otherwise nothing is decoded and ``out_table[r, j] = -1``, which the attention kernels
read as a bad entry (no key), as they would the original. Scalar scales only (the kernels
apply them in fp32 outside the products): per-slot scales are applied before the rounding
to act, per key.
"""

from __future__ import annotations

import torch

from kernels._host import check_int, fail
from kernels._triton import (
    await_previous_kernel,
    ensure_ready,
    is_interpreted,
    pdl_options,
    tl,
    triton,
)
from kernels.fp8 import decode_fp8_f16


@triton.jit
def _predecode_kernel(kv_ptr, kv_s0, kv_s1, kv_s2, num_pages, bt_ptr, bt_s0, bt_s1, width,
                      seq_ptr, seq_s0, out_ptr, tab_ptr, need_ptr, FMT: tl.constexpr,
                      HW: tl.constexpr, ASM: tl.constexpr, P: tl.constexpr, D2: tl.constexpr,
                      R: tl.constexpr, PDL: tl.constexpr = False):
    """Program (r * width + j, g, c): rows ``[c * R, (c + 1) * R)`` of KV head g of request
    r's block j; the (g, c) = (0, 0) program writes the table entry. PDL:
    ``kernels._triton.await_previous_kernel`` first."""
    await_previous_kernel(PDL)
    if tl.load(need_ptr) == 0:  # no wide tile reads pages (the prefill's tiers)
        return
    rj = tl.program_id(0).to(tl.int64)  # r * width + j
    g = tl.program_id(1).to(tl.int64)
    c = tl.program_id(2)
    r = rj // width
    j = rj % width
    page = tl.load(bt_ptr + r * bt_s0 + j * bt_s1).to(tl.int64)
    used = (j * P < tl.load(seq_ptr + r * seq_s0)) & (page >= 0) & (page < num_pages)
    if (g == 0) & (c == 0):
        tl.store(tab_ptr + rj, tl.where(used, rj, -1).to(tl.int32))
    if used:
        tt = (c * R + tl.arange(0, R)).to(tl.int64)
        cc = tl.arange(0, D2)
        codes = tl.load(kv_ptr + page * kv_s0 + g * kv_s1 + tt[:, None] * kv_s2 + cc[None, :])
        vals = decode_fp8_f16(codes, FMT, HW, ASM).to(out_ptr.dtype.element_ty)  # exact
        tl.store(out_ptr + ((rj * tl.num_programs(1) + g) * P + tt[:, None]) * D2 + cc[None, :],
                 vals)


INTERPRETED = is_interpreted(_predecode_kernel)


#: Rows of a page per program (None: the whole page, one program per page and KV head) and
#: warps per program (``sparse_attention_prefill``'s ``predecode_rows`` /
#: ``predecode_warps`` knobs): small programs of 16 rows and one warp reach the copy
#: bandwidth.
PREDECODE_ROWS = 16
PREDECODE_WARPS = 1


def predecode_options(rows, num_warps, page: int) -> tuple[int, int]:
    """(rows per program, warps per program) of the knobs ``predecode_rows`` /
    ``predecode_warps`` (None: the defaults) for pages of ``page`` rows; errors name them."""
    rows = rows if rows is not None else PREDECODE_ROWS
    rows = page if rows is None else check_int(rows, "predecode_rows", 1, page)
    if page % rows or rows & (rows - 1):
        fail("predecode_rows", f"must be a power of two dividing the page size {page}, "
             f"got {rows}")
    return rows, check_int(PREDECODE_WARPS if num_warps is None else num_warps,
                           "predecode_warps", 1, 16)


def predecode_pages(kv_cache, block_table, seq_lens, fmt: int, hw: bool, asm: bool,
                    dtype: torch.dtype, need: torch.Tensor | None = None, rows=None,
                    num_warps=None, pdl: bool = False):
    """``(scratch cache [B * W, Hkv, P, 2D] of dtype, int32 table [B, W])`` for checked
    launcher arguments (``kernels.attention_prefill``: kv_cache uint8 codes of format code
    ``fmt``, block_table ``[B, W]``, seq_lens ``[B]``); ``dtype``: the scratch's, float16
    or bfloat16 (the model dtype). ``need``: an int32 ``[1]`` on the device; 0 there (the
    prefill's tier switch found no wide tile that reads a page) skips the decoding and
    leaves both outputs unwritten (None: always decode). ``rows``: a page's rows per
    program, a power of two dividing P (None: ``PREDECODE_ROWS``, P where that is None);
    ``num_warps``: per program (None: ``PREDECODE_WARPS``); errors name ``predecode_rows`` /
    ``predecode_warps``, the prefill launcher's knobs. ``pdl``: a programmatic dependent
    launch (``kernels._triton.pdl_options``)."""
    b, width = block_table.shape
    num_pages, hkv, page, d2 = kv_cache.shape
    rows, warps = predecode_options(rows, num_warps, page)
    out = torch.empty((b * width, hkv, page, d2), dtype=dtype, device=kv_cache.device)
    table = torch.empty((b, width), dtype=torch.int32, device=kv_cache.device)
    if b * width:
        ensure_ready(_predecode_kernel)
        _predecode_kernel[(b * width, hkv, page // rows)](
            kv_cache, kv_cache.stride(0), kv_cache.stride(1), kv_cache.stride(2), num_pages,
            block_table, block_table.stride(0), block_table.stride(1), width,
            seq_lens, seq_lens.stride(0), out, table,
            torch.ones(1, dtype=torch.int32, device=kv_cache.device) if need is None else need,
            FMT=fmt, HW=hw, ASM=asm, P=page, D2=d2, R=rows, num_warps=warps,
            **pdl_options(pdl, INTERPRETED))
    return out, table


def compile_signatures():
    """(kernel, signature, constexprs) for the sm_90 compile check (tests/test_compile_sm90.py):
    e4m3fn in assembly to fp16 (the default rows per program) and e5m2fnuz in assembly to
    bf16 (whole pages), P 128, D 128."""
    sig = {name: "i64" for name in _predecode_kernel.arg_names}
    sig.update(kv_ptr="*u8", bt_ptr="*i32", seq_ptr="*i32", tab_ptr="*i32", need_ptr="*i32",
               width="i32")
    out = []
    for fmt, hw, dtype, rows in ((0, True, "*fp16", PREDECODE_ROWS), (3, False, "*bf16", 128)):
        const = dict(FMT=fmt, HW=hw, ASM=True, P=128, D2=256, R=rows)
        out.append((_predecode_kernel, {**sig, "out_ptr": dtype,
                                        **dict.fromkeys(const, "constexpr")}, const))
    return out
