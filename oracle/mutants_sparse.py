"""Mutants of the indexer and attention kernels (``oracle.mutants``): each a bug class of
shared/SPEC.md section 8 on the project's Triton kernels, with the incident it models."""

from __future__ import annotations

import numpy as np

from oracle.mutants import Mutant, patch, register, wrap_inputs

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
