"""The float64 reference registered as an implementation of every op (CPU).

It is the contract, so checking it against itself is exact by construction; it is
registered so that reports show the reference's own rows and the CLI can run any case on
a machine without torch."""

from oracle.core.reference_run import (
    attention_call,
    indexer_decode,
    indexer_prefill,
    model_codes,
    norm_rope_insert,
    reshape_and_cache,
)
from oracle.core.registry import Implementation, register
from reference import attention


def _attention(x: dict) -> dict:
    out = attention_call(x, schedule=attention.exact(x["model_dtype"]))
    return {"out": model_codes(out, x["model_dtype"])}


_RUNS = {
    "norm_rope_insert": norm_rope_insert,
    "reshape_and_cache": reshape_and_cache,
    "indexer_prefill": lambda x: {"topk": indexer_prefill(x)},
    "indexer_decode": lambda x: {"topk": indexer_decode(x)},
    "attention_prefill": _attention,
    "attention_decode": _attention,
}


def register_all() -> None:
    """Register the reference as an implementation of every op."""
    for op, run in _RUNS.items():
        register(Implementation("reference", op, run, devices=("cpu",),
                                schedule=attention.exact() if op.startswith("attention") else None,
                                notes="float64 NumPy; the contract"))
