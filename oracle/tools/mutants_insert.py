"""Mutants of the KV insert kernels (``oracle.tools.mutants``): the fused Gemma RMSNorm + partial
NeoX RoPE + paged insert (``kernels.norm_rope_insert``, op ``norm_rope_insert``) and the
separate insert (``kernels.reshape_and_cache``, op ``reshape_and_cache``), both Triton, and
the fp8 codec they share (``kernels.fp8``). Each is a bug class of shared/contract.md section 8
with the kind of real incident it models. Kernel-internal bugs are patches of the kernel's
(or the codec's) source; caller-side bugs (a scale not plumbed, a format string resolved on
the wrong platform, a config value dropped) wrap the kernel's arguments."""

from __future__ import annotations

import functools
import math

import numpy as np

from oracle.tools.mutants import Mutant, patch, register, wrap_inputs
from reference.domain import MODEL

FUSED = "kernels.norm_rope_insert"
RESHAPE = "kernels.reshape_and_cache"
FP8 = "kernels.fp8"
_OCP_OF = {"e4m3fnuz": "e4m3fn", "e5m2fnuz": "e5m2"}


def _m(name, op, bug, incident, build, gpu_only=False):
    register(Mutant(name, op, "triton", bug, incident, build, gpu_only=gpu_only))


# ------------------------------------------------------------------ fp8 formats and codec

_m("insert_fnuz_written_as_fn", "norm_rope_insert",
   "fnuz bytes written as fn",
   "on MI300 (fnuz) the fused insert picked its fp8 encoder from the cache dtype's kind "
   "(e4m3 / e5m2) without the platform's fnuz flag, so KV and index caches held OCP bytes "
   "that the fnuz reader decodes at a different exponent bias",
   patch(FUSED,
         ("KV_FMT=fmt_code(p.kv_fmt) if p.kv_fp8 else 0,",
          f"KV_FMT=fmt_code({_OCP_OF!r}.get(p.kv_fmt, p.kv_fmt)) if p.kv_fp8 else 0,"),
         ("IDX_FMT=fmt_code(p.index_fmt) if p.idx_fp8 else 0,",
          f"IDX_FMT=fmt_code({_OCP_OF!r}.get(p.index_fmt, p.index_fmt)) if p.idx_fp8 "
          "else 0,")))


def _fnuz_as_ocp(x: dict) -> dict:
    x["kv_fmt"] = _OCP_OF.get(x["kv_fmt"], x["kv_fmt"])
    return x


_m("reshape_fnuz_written_as_fn", "reshape_and_cache",
   "fnuz bytes written as fn",
   "the caller resolved kv_cache_dtype 'fp8' to the OCP e4m3fn (and fp8_e5m2 to e5m2) on a "
   "gfx942 (fnuz) machine, the platform check being wrong, so the cache got fn bytes",
   wrap_inputs(_fnuz_as_ocp))

_m("insert_e5m2_missing_from_fp8_list", "norm_rope_insert",
   "fp8 path skipped: a format missing from a dtype list",
   "the launcher's list of fp8 cache formats lacked the OCP e5m2 (kv_cache_dtype "
   "fp8_e5m2), so that cache fell through to the 16-bit store path, which casts the "
   "values to the cache's element type (uint8) instead of encoding them",
   patch(FUSED, ("KV_FP8=p.kv_fp8,",
                 'KV_FP8=p.kv_fmt in ("e4m3fn", "e4m3fnuz", "e5m2fnuz"),')))

_m("reshape_e5m2_encoded_as_e4m3", "reshape_and_cache",
   "fp8 path with the wrong format: e5m2 encoded by e4m3's encoder",
   "a copy-pasted format dispatch converted both OCP formats with the e4m3 cast, so "
   "fp8_e5m2 caches held e4m3 bytes (values read back wrong by up to 2^7 in scale)",
   patch(RESHAPE, deps={FP8: (
       ("        code = x.to(tl.float8e5).to(tl.uint8, bitcast=True)\n",
        "        code = x.to(tl.float8e4nv).to(tl.uint8, bitcast=True)\n"),)}))

# Satfinite missing: a non-saturating conversion (torch's .to(float8_e4m3fn), cvt without
# .satfinite): finite overflow and +-Inf become NaN (e4m3fn: 0x7F | sign) or Inf (e5m2), and
# the software codec (fnuz) loses its clamp, so an overflowing magnitude runs into the
# sign bit (the fnuz NaN 0x80 first, then garbage).
_NO_SATFINITE_HW = (
    ("    if FMT == FMT_E4M3FN:\n"
     "        code = x.to(tl.float8e4nv).to(tl.uint8, bitcast=True)\n"
     "    else:\n"
     "        code = x.to(tl.float8e5).to(tl.uint8, bitcast=True)\n",
     "    neg = (x < 0).to(tl.uint8) << 7\n"
     "    if FMT == FMT_E4M3FN:\n"
     "        code = x.to(tl.float8e4nv).to(tl.uint8, bitcast=True)\n"
     "        code = tl.where(tl.abs(x) >= 464.0, 0x7F | neg, code)\n"
     "    else:\n"
     "        code = x.to(tl.float8e5).to(tl.uint8, bitcast=True)\n"
     "        code = tl.where(tl.abs(x) >= 61440.0, 0x7C | neg, code)\n"),)
# The same on the inline-assembly form of the hardware cast (the fused insert's KV writes
# when compiled): the codes of overflowing values replaced as a plain cast would write them.
_NO_SATFINITE_ASM = (
    ("            code = tl.inline_asm_elementwise(asm, \"=r,f,f,f,f\", [x], dtype=tl.uint8,\n"
     "                                             is_pure=True, pack=4)\n",
     "            code = tl.inline_asm_elementwise(asm, \"=r,f,f,f,f\", [x], dtype=tl.uint8,\n"
     "                                             is_pure=True, pack=4)\n"
     "            neg = (x < 0).to(tl.uint8) << 7\n"
     "            if FMT == FMT_E4M3FN:\n"
     "                code = tl.where(tl.abs(x) >= 464.0, 0x7F | neg, code)\n"
     "            else:\n"
     "                code = tl.where(tl.abs(x) >= 61440.0, 0x7C | neg, code)\n"),)
_NO_SATFINITE_SW = (
    ("    mag = tl.minimum(mag, MAX_CODE)  # satfinite: finite overflow and +-Inf -> max finite\n",
     ""),)

_m("insert_satfinite_missing", "norm_rope_insert",
   "fp8 saturation missing (NaN/Inf on overflow)",
   "an fp8 KV write used a plain (torch-style, non-satfinite) conversion, so K/V beyond "
   "the format's max, and Inf activations, were stored as NaN/Inf codes that poison "
   "every later attention over the page",
   patch(FUSED, deps={FP8: _NO_SATFINITE_HW + _NO_SATFINITE_ASM + _NO_SATFINITE_SW}))

_m("reshape_satfinite_missing_fnuz", "reshape_and_cache",
   "fp8 saturation missing (software fnuz codec)",
   "a hand-written fnuz encoder (no hardware cast on the platform) dropped the clamp to "
   "the max code, so overflowing values wrapped into the sign bit: the fnuz NaN 0x80 "
   "or a wrong-signed value instead of +-240 / +-57344",
   patch(RESHAPE, deps={FP8: _NO_SATFINITE_SW}))

_m("insert_clamp_240_on_e4m3fn", "norm_rope_insert",
   "clamping to the wrong max (240 instead of 448 on e4m3fn)",
   "a shared fp8 helper clamped to the e4m3fnuz max (240) before the e4m3fn cast, e.g. "
   "an FP8_MAX constant taken from the ROCm path, so OCP caches lost every value in "
   "(240, 448]",
   patch(FUSED, deps={FP8: (
       ("        code = x.to(tl.float8e4nv).to(tl.uint8, bitcast=True)\n",
        "        code = tl.minimum(tl.maximum(x, -240.0), 240.0).to(tl.float8e4nv).to("
        "tl.uint8, bitcast=True)\n"),
       ("                asm: tl.constexpr = _F32X4_E4M3FN\n",
        "                asm: tl.constexpr = _F32X4_E4M3FN\n"
        "                x = tl.minimum(tl.maximum(x, -240.0), 240.0)\n"))}))

# ------------------------------------------------------------------------------- scales


def _scales_dropped(x: dict) -> dict:
    x["k_scale"] = None
    x["v_scale"] = None
    return x


_m("insert_scales_not_passed", "norm_rope_insert",
   "k/v scales not applied",
   "the fused norm+rope+insert path was wired up without the layer's k_scale/v_scale "
   "(left at their 1.0 default), so calibrated fp8 caches were written unscaled while "
   "the attention reader divided them back out",
   wrap_inputs(_scales_dropped))

_m("reshape_scales_ignored", "reshape_and_cache",
   "k/v scales not applied",
   "the fp8 insert kernel loaded the scales but encoded K and V without dividing by "
   "them (a refactor dropped the division), so only unit-scale models were right",
   patch(RESHAPE,
         ("encode_fp8(k.to(tl.float32) / ks[:, None], FMT, HW)",
          "encode_fp8(k.to(tl.float32), FMT, HW)"),
         ("encode_fp8(v.to(tl.float32) / vs[:, None], FMT, HW)",
          "encode_fp8(v.to(tl.float32), FMT, HW)")))

_m("insert_scale_multiplied", "norm_rope_insert",
   "scale applied as multiply instead of divide",
   "the writer multiplied by the scale (the dequantisation convention) instead of "
   "dividing by it, so codes were off by scale^2 and saturated for large scales",
   patch(FUSED,
         ("            ka, kb = scale_reciprocal(ks)\n", "            ka, kb = ks, 1.0\n"),
         ("            va, vb = scale_reciprocal(vs)\n", "            va, vb = vs, 1.0\n")))

_m("insert_v_quantised_with_k_scale", "norm_rope_insert",
   "k/v scales disagreeing between writer and reader (V written with k_scale)",
   "a copy-paste in the V store divided V by k_scale; with per-tensor scales that "
   "differ, the reader's v_scale no longer undoes it",
   patch(FUSED, ("            va, vb = scale_reciprocal(vs)\n",
                 "            va, vb = scale_reciprocal(ks)\n")))

_m("insert_k_quantised_from_bf16", "norm_rope_insert",
   "K quantised from bf16 where the contract says fp32",
   "a fused kernel encoded K from its model-dtype rounding (the value it had just stored "
   "to q/k) instead of the fp32 value, a second rounding that the reader's contract "
   "(quantize_from='value') does not allow",
   patch(FUSED,
         ("encode_fp8(ky1 * ka * kb,", "encode_fp8(ky1.to(kt).to(tl.float32) * ka * kb,"),
         ("encode_fp8(ky2 * ka * kb,", "encode_fp8(ky2.to(kt).to(tl.float32) * ka * kb,"),
         ("encode_fp8(ky3 * ka * kb,", "encode_fp8(ky3.to(kt).to(tl.float32) * ka * kb,")))

# ------------------------------------------------------------------------ norm and RoPE

_m("insert_gemma_w_instead_of_1_plus_w", "norm_rope_insert",
   "(w) instead of (1+w) in the Gemma norm",
   "a generic RMSNorm (x * w) used for a Gemma-style checkpoint whose weights are "
   "stored as w - 1 (the norm is x * (1 + w)), shrinking every head",
   patch(FUSED,
         ("w1 = 1.0 + tl.load(w_ptr + a,", "w1 = tl.load(w_ptr + a,"),
         ("w2 = 1.0 + tl.load(w_ptr + half + a,", "w2 = tl.load(w_ptr + half + a,"),
         ("w3 = 1.0 + tl.load(w_ptr + p,", "w3 = tl.load(w_ptr + p,")))

_m("insert_rope_interleaved", "norm_rope_insert",
   "interleaved RoPE instead of NeoX rotate-half",
   "a GPT-J style (is_neox_style=False) rotary kernel used for a NeoX-style model: pairs "
   "(2i, 2i+1) rotated instead of (i, i + R/2)",
   patch(FUSED,
         # the rotated part of a head read and written as pairs (2i, 2i+1), weights too
         ("w1 = 1.0 + tl.load(w_ptr + a,", "w1 = 1.0 + tl.load(w_ptr + 2 * a,"),
         ("w2 = 1.0 + tl.load(w_ptr + half + a,", "w2 = 1.0 + tl.load(w_ptr + 2 * a + 1,"),
         ("x1 = tl.load(base + a[None, :], mask=amask",
          "x1 = tl.load(base + 2 * a[None, :], mask=amask"),
         ("x2 = tl.load(base + half + a[None, :], mask=amask",
          "x2 = tl.load(base + 2 * a[None, :] + 1, mask=amask"),
         ("tl.store(dst + a[None, :], y1, mask=amask)",
          "tl.store(dst + 2 * a[None, :], y1, mask=amask)"),
         ("tl.store(dst + half + a[None, :], y2, mask=amask)",
          "tl.store(dst + 2 * a[None, :] + 1, y2, mask=amask)")))


@functools.cache
def _full_table(max_pos: int, head_dim: int, model_dtype: str) -> np.ndarray:
    from reference.norm_rope import rope_table

    return rope_table(max_pos, head_dim, MODEL.rope_base, model_dtype)


def _full_rope(x: dict) -> dict:
    d = x["head_dim"]
    x["rotary_dim"] = d
    x["rope_table"] = _full_table(int(np.shape(x["rope_table"])[0]), d, x["model_dtype"])
    return x


_m("insert_full_rope", "norm_rope_insert",
   "R treated as D (full RoPE instead of partial)",
   "the model config's partial_rotary_factor was not read, so rotary_dim defaulted to "
   "head_dim and the cos/sin cache was built for D dims: every dim rotated",
   wrap_inputs(_full_rope))

_m("insert_rope_partner_pow2", "norm_rope_insert",
   "wrong RoPE partner when R/2 is not a power of two",
   "a rotary kernel located the second rotated half at the padded block offset "
   "(next_power_of_2(R/2)) instead of R/2, right for R = 64/128 and wrong for "
   "partial-rotary models with other R",
   patch(FUSED, ("x2 = tl.load(base + half + a[None, :], mask=amask",
                 "x2 = tl.load(base + BLOCK_HALF + a[None, :], mask=amask")))

_LOG2_BASE = math.log2(MODEL.rope_base)
_m("insert_rope_table_recomputed", "norm_rope_insert",
   "RoPE table recomputed instead of read",
   "a fused kernel computed cos/sin on the fly in fp32 (exp2/cos/sin of position x "
   "inv_freq, theta hard-coded) instead of reading the model-dtype cos/sin cache the "
   "rest of the model uses, so its keys differ from the reference in the last bits",
   patch(FUSED,
         # pos_ok carries the position (-1 outside the table) to the head's computation
         ("    return table_ptr + tl.where(pos_ok, pos, 0) * table_stride, pos_ok\n",
          "    return table_ptr + tl.where(pos_ok, pos, 0) * table_stride, "
          "tl.where(pos_ok, pos, -1)\n"),
         ("    cmask = (a < half)[None, :] & pos_ok\n"
          "    c = tl.load(cs_ptr + a[None, :], mask=cmask, other=0.0).to(tl.float32)\n"
          "    s = tl.load(cs_ptr + half + a[None, :], mask=cmask, other=0.0).to(tl.float32)\n",
          "    cmask = (a < half)[None, :] & (pos_ok >= 0)\n"
          "    inv_freq = tl.exp2(-(a.to(tl.float32) / half) * " + repr(_LOG2_BASE) + ")\n"
          "    ang = pos_ok.to(tl.float32) * inv_freq[None, :]\n"
          "    c = tl.where(cmask, tl.cos(ang), 0.0)\n"
          "    s = tl.where(cmask, tl.sin(ang), 0.0)\n")))

_m("insert_index_k_with_k_weights", "norm_rope_insert",
   "index_k normed with the wrong head's weights",
   "the launcher passed the K head's norm weight for the indexer's key head (two "
   "weights of the same shape, easy to swap), so the index cache held keys normed "
   "with w_k",
   patch(FUSED, ("w_index_k if p.write_ik else w_q,", "w_k if p.write_ik else w_q,")))

# ------------------------------------------------------------------ slots and addressing

_m("insert_negative_slot_wraps", "norm_rope_insert",
   "negative slots written",
   "padding tokens (slot -1) were written Python/torch-index style: slot -1 wrapped to "
   "the cache's last slot, overwriting another request's K/V there",
   patch(FUSED, ("        ok = (slot >= 0) & (slot < num_slots)\n",
                 "        slot = tl.where(slot < 0, slot + num_slots, slot)\n"
                 "        ok = (slot >= 0) & (slot < num_slots)\n")))

_m("reshape_negative_slot_wraps", "reshape_and_cache",
   "negative slots written",
   "a cache-insert path indexed the flattened cache with slot_mapping directly "
   "(cache.view(-1, ...)[slots] = kv), so padding tokens' -1 wrote the last slot",
   patch(RESHAPE, ("    ok = (slot >= 0) & (slot < num_slots)\n",
                   "    slot = tl.where(slot < 0, slot + num_slots, slot)\n"
                   "    ok = (slot >= 0) & (slot < num_slots)\n")))

_m("insert_skipped_token_writes_slot0", "norm_rope_insert",
   "stray writes outside the target slots (V of skipped tokens into slot 0)",
   "a skipped token's address was clamped to slot 0 to stay in range, but the V store "
   "kept only the head/dim mask, so padding tokens overwrote slot 0 of page 0 with "
   "their V",
   patch(FUSED,
         ("                     mask=vmask & ok[:, None])\n", "                     mask=vmask)\n"),
         ("tl.store(kv + D + dims[None, :], v.to(ct), mask=vmask & ok[:, None])",
          "tl.store(kv + D + dims[None, :], v.to(ct), mask=vmask)")))

_m("reshape_strides_ignored", "reshape_and_cache",
   "stray writes outside the target slots (cache strides ignored)",
   "the insert computed page/head/slot offsets from the cache's logical shape "
   "(contiguous HND) instead of its strides, so NHD and padded caches were written at "
   "the wrong slots and heads",
   patch(RESHAPE,
         ("dst, kv_cache.stride(0), kv_cache.stride(1), kv_cache.stride(2), page, num_slots,",
          "dst, hkv * page * 2 * d, page * 2 * d, 2 * d, page, num_slots,")))

_m("reshape_int32_offsets", "reshape_and_cache",
   "32-bit offset overflow on large caches",
   "the insert computed token/slot/head offsets in int32, which overflows once the cache "
   "passes 2^31 elements (long-context servers with large KV pools)",
   patch(RESHAPE,
         ("tok = tl.program_id(0).to(tl.int64)", "tok = tl.program_id(0)"),
         ("h64 = heads.to(tl.int64)", "h64 = heads"),
         ("slot = tl.load(slot_ptr + tok * slot_s0).to(tl.int64)",
          "slot = tl.load(slot_ptr + tok * slot_s0).to(tl.int32)")),
   gpu_only=True)

_m("insert_int32_offsets", "norm_rope_insert",
   "32-bit offset overflow on large caches",
   "the fused insert formed the cache address from an int32 slot and head index, so "
   "page * page_stride overflowed on caches over 2^31 elements",
   patch(FUSED,
         ("        slot = tl.load(slot_ptr + tok, mask=kok, other=-1).to(tl.int64)\n",
          "        slot = tl.load(slot_ptr + tok, mask=kok, other=-1).to(tl.int32)\n"),
         ("        h64 = kheads.to(tl.int64)\n", "        h64 = kheads.to(tl.int32)\n")),
   gpu_only=True)
