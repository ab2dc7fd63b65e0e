"""The CUDA kernel of csrc/ (through kernels.cuda_norm_rope_insert, ctypes) as an
implementation of ``norm_rope_insert``: registered only where it can run (a CUDA device and
nvcc to build it with)."""

from __future__ import annotations

from kernels import cuda_norm_rope_insert as cnri
from oracle.core.registry import Implementation, register
from oracle.impls.adapters import insert_adapter

run = insert_adapter(cnri.norm_rope_insert)


def register_all() -> str | None:
    """Register the CUDA insert; where it cannot run, why (nothing registered)."""
    if not cnri.available():
        return "needs a CUDA device and nvcc"
    register(Implementation(
        "cuda", "norm_rope_insert", run, devices=("cuda",),
        shape_classes=("tiny", "small", "model", "sweep"), quantize_from="value",
        notes="csrc/norm_rope_insert.cu via ctypes: one launch (variant 0 by default), a warp "
              "per head, fp32 Gemma RMSNorm + partial NeoX RoPE (partners through shared "
              "memory, any even R), "
              "K from its fp32 value, fp8 satfinite via cvt.rn.satfinite / software fnuz"))
    return None
