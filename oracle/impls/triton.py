"""The Triton kernels (kernels/) as implementations: their adapters, their claims (devices,
shape classes) and their declared numerics (schedules, ``score_rel``).

Interpreted (CPU), model shapes take too long: they are left to CUDA. Compiled, the
kernels' products run on tensor cores (truncating accumulation: ``TENSOR_CORE_DOT_REL``
for 16-bit operands, more for fp8 MMA); the interpreter's dots are IEEE fp32.
"""

from __future__ import annotations

import functools

from kernels import (
    attention_decode,
    attention_prefill,
    indexer_decode,
    indexer_prefill,
    norm_rope_insert,
    reshape_and_cache,
)
from kernels._host import ORACLE_WORKSPACE, ORACLE_WORKSPACE_NOTES
from oracle.core.bounds import TENSOR_CORE_DOT_REL
from oracle.core.registry import Implementation, register
from oracle.impls.adapters import (
    attention_decode_adapter,
    attention_prefill_adapter,
    indexer_adapter,
    insert_adapter,
    reshape_and_cache_adapter,
)

#: The Triton kernel modules (one per op), registered here.
KERNEL_MODULES = ("kernels.norm_rope_insert", "kernels.reshape_and_cache",
                  "kernels.indexer_prefill", "kernels.indexer_decode",
                  "kernels.attention_decode", "kernels.attention_prefill")

#: Each kernel module's adapter, built from the module (the real one, or a mutant's patched
#: copy: oracle/tools/mutants.py).
ADAPTERS = {
    "kernels.norm_rope_insert": lambda m: insert_adapter(m.norm_rope_insert),
    "kernels.reshape_and_cache": lambda m: reshape_and_cache_adapter(m.reshape_and_cache),
    "kernels.indexer_prefill": lambda m: indexer_adapter(m.indexer_prefill, decode=False),
    "kernels.indexer_decode": lambda m: indexer_adapter(m.indexer_decode, decode=True),
    "kernels.attention_decode": lambda m: attention_decode_adapter(m.sparse_attention_decode),
    "kernels.attention_prefill": lambda m: attention_prefill_adapter(
        m.sparse_attention_prefill),
}

run_norm_rope_insert = insert_adapter(norm_rope_insert.norm_rope_insert)
run_reshape_and_cache = reshape_and_cache_adapter(reshape_and_cache.reshape_and_cache)
run_indexer_prefill = indexer_adapter(indexer_prefill.indexer_prefill, decode=False)
run_indexer_decode = indexer_adapter(indexer_decode.indexer_decode, decode=True)
run_indexer_decode_flat = indexer_adapter(
    functools.partial(indexer_decode.indexer_decode, grid="flat"), decode=True)
run_indexer_decode_proportional = indexer_adapter(
    functools.partial(indexer_decode.indexer_decode, grid="proportional"), decode=True)
run_indexer_decode_workspace = indexer_adapter(
    functools.partial(indexer_decode.indexer_decode, workspace=ORACLE_WORKSPACE), decode=True)
run_attention_decode = attention_decode_adapter(attention_decode.sparse_attention_decode)
run_attention_prefill = attention_prefill_adapter(attention_prefill.sparse_attention_prefill)

# ------------------------------------------------------------------------ declared numerics

#: Declared score error of the decode indexer's MMA scan beyond an IEEE fp32 sum (relative
#: to sum |q_i k_i|): the tensor cores' truncating accumulation of 16-bit products (D <= 256).
MMA_SCORE_REL = TENSOR_CORE_DOT_REL
#: The same for the fp8 tensor-core products of the hardware formats
#: (``kernels.indexer_decode.fp8_mma``): Triton's default fp8 ``wgmma`` accumulates in
#: about 14 bits (DeepSeek-V3 measured ~14 on the H800), ~2^-13 per k-step of 32, at most
#: 8 steps at D 256: 2^-10, declared with a factor 2 margin.
F8MMA_SCORE_REL = 2.0**-9


def indexer_decode_score_rel(case) -> float:
    """The decode indexer's declared block-score error for a case (registry
    ``score_rel_for``): 0 interpreted (fp32 ieee dots), else the MMA scan's, fp8 or 16-bit
    by the case's index format."""
    if indexer_decode.INTERPRETED:
        return 0.0
    if case is not None and indexer_decode.fp8_mma(case["index_fmt"]):
        return F8MMA_SCORE_REL
    return MMA_SCORE_REL


def _classes(interpreted: bool, compiled: tuple[str, ...]) -> tuple[str, ...]:
    return ("tiny", "small") if interpreted else compiled


def _dot_rel(interpreted: bool) -> float:
    return 0.0 if interpreted else TENSOR_CORE_DOT_REL


# ---------------------------------------------------------------------------- registration


def register_inserts() -> None:
    """The fused insert and reshape_and_cache."""
    register(Implementation(
        "triton", "norm_rope_insert", run_norm_rope_insert, devices=("cpu", "cuda"),
        shape_classes=_classes(norm_rope_insert.INTERPRETED,
                               ("tiny", "small", "model", "sweep")),
        quantize_from="value",
        notes="one Triton launch: fp32 Gemma RMSNorm + partial NeoX RoPE (three contiguous "
              "segments per head, any even R), K from its fp32 value, fp8 via "
              "kernels.fp8.encode_fp8"))
    register(Implementation(
        "triton", "reshape_and_cache", run_reshape_and_cache, devices=("cpu", "cuda"),
        shape_classes=_classes(reshape_and_cache.INTERPRETED,
                               ("tiny", "small", "model", "sweep")),
        quantize_from="model_dtype",
        notes="one Triton launch: K and V from their model-dtype values (two roundings for "
              "K), fp8 via kernels.fp8.encode_fp8, bf16/fp16 caches get the bits copied"))


def register_indexers() -> None:
    """Both indexers, and the decode indexer's other grids and its kept workspace."""
    register(Implementation(
        "triton", "indexer_prefill", run_indexer_prefill, devices=("cpu", "cuda"),
        shape_classes=_classes(indexer_prefill.INTERPRETED, ("tiny", "small", "model", "long")),
        score_rel=0.0,
        notes="one Triton launch: (token tile x all index heads) per program, key blocks read "
              "once per tile, fp32 ieee tl.dot on exactly widened q/k (fp8 via decode_fp8), "
              "running top-k of 64-bit order keys (replace-min compiled, rank merge "
              "interpreted), written by rank"))
    rel = indexer_decode_score_rel
    register(Implementation(
        "triton", "indexer_decode", run_indexer_decode, devices=("cpu", "cuda"),
        shape_classes=_classes(indexer_decode.INTERPRETED, ("tiny", "small", "model", "long")),
        score_rel=rel,
        notes="one Triton launch: (request x key-block split) per program, all rows and "
              "heads of a request share each key block; compiled: one tensor-core tl.dot "
              "per key block on 16-bit operands (fp8 decoded exactly to fp16), fp32 MMA "
              "accumulation (score_rel declared), cp.async-pipelined key tiles; "
              "interpreted: fp32 ieee tl.dot; 64-bit order keys per block, the last split "
              "merges the partial lists by bitonic top-k (atomic ticket)"))
    # The flat kernel's partitions on the GPU (the interpreter tests cover them on the
    # CPU): the same kernel arithmetic over other partitions of the key blocks.
    for name, fn, notes in (
            ("triton_flat", run_indexer_decode_flat,
             "indexer_decode(grid='flat'): the batch's key blocks laid end to end and shared "
             "out evenly over one wave of programs (ranges straddle requests), the MMA scan "
             "per request segment, the last program of a request merges"),
            ("triton_proportional", run_indexer_decode_proportional,
             "indexer_decode(grid='proportional'): one wave of programs, each request cut "
             "into cdiv(blocks, U) of them (U searched in the kernel so they fit), the MMA "
             "scan per program, the last program of a request merges")):
        register(Implementation(name, "indexer_decode", fn, devices=("cuda",),
                                shape_classes=("tiny", "small", "model", "long"),
                                score_rel=rel, notes=notes))
    register(Implementation(
        "triton_workspace", "indexer_decode", run_indexer_decode_workspace, devices=("cuda",),
        shape_classes=("tiny", "small"), score_rel=rel, notes=ORACLE_WORKSPACE_NOTES))


def register_attention_decode() -> None:
    """The split-K decode, and the same with its workspace kept across cases."""
    ad = attention_decode
    register(Implementation(
        "triton", "attention_decode", run_attention_decode, devices=("cpu", "cuda"),
        shape_classes=_classes(ad.INTERPRETED, ("tiny", "small", "model", "long")),
        schedule=ad.SCHEDULE, score_rel=_dot_rel(ad.INTERPRETED),
        notes=f"split-K Triton decode: one program per (request, KV head, split of "
              f"{ad.BLOCKS_PER_SPLIT} blocks, longer beyond {ad.TARGET_PROGRAMS} programs), G "
              f"heads x rows share each K/V tile; fp8 K/V "
              f"exact in act with scalar scales outside the products (per-slot: "
              f"dequantised to act), bf16/fp16 P, fp32 partials, exact LSE merge"))
    register(Implementation(
        "triton_workspace", "attention_decode",
        functools.partial(run_attention_decode, workspace=ORACLE_WORKSPACE), devices=("cuda",),
        shape_classes=("tiny", "small"), schedule=ad.SCHEDULE, score_rel=TENSOR_CORE_DOT_REL,
        notes=ORACLE_WORKSPACE_NOTES))


def register_attention_prefill() -> None:
    """The prefill, and the same with every tile handed to its narrow tier."""
    ap = attention_prefill
    # Interpreted: tiny shapes only (the small class costs seconds per case in the
    # interpreter and the float64 checker).
    classes = ("tiny",) if ap.INTERPRETED else ("tiny", "small", "model", "long")
    register(Implementation(
        "triton", "attention_prefill", run_attention_prefill, devices=("cpu", "cuda"),
        shape_classes=classes, schedule=ap.SCHEDULE, score_rel=_dot_rel(ap.INTERPRETED),
        notes=f"Triton prefill: one program per (tile of {ap.BLOCK_ROWS} tokens x heads rows, "
              f"KV head) walking the union of the tile's selected blocks in ascending order, "
              f"each block read once per tile; a tile whose union is {ap.DELEGATE_RATIO}x its "
              f"entries or more goes to a {ap.NARROW_ROWS}-row pass instead; fp8 K/V exact in "
              f"act with scalar scales outside the products (per-slot: dequantised to act), "
              f"bf16/fp16 P, no split-K"))
    # The narrow tier on every case: with the default ratio most small cases never reach it.
    register(Implementation(
        "triton_narrow", "attention_prefill",
        functools.partial(run_attention_prefill, delegate_ratio=ap.ALL_NARROW),
        devices=("cpu", "cuda"), shape_classes=classes, schedule=ap.SCHEDULE,
        score_rel=_dot_rel(ap.INTERPRETED),
        notes=f"the Triton prefill with every tile handed to its narrow tier "
              f"(delegate_ratio {ap.ALL_NARROW}: {ap.NARROW_ROWS}-row programs; the union walk "
              f"of a tile's tokens where G < 16)"))


def register_all() -> None:
    """Register every Triton kernel's implementations."""
    register_inserts()
    register_indexers()
    register_attention_decode()
    register_attention_prefill()
