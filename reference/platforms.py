"""Which storage format a ``kv_cache_dtype`` string means on each platform (contract.md s.2).

The platforms and which fp8 format each stores are rows of ``reference.formats.FORMATS``
(its ``native`` platforms); a format name here is a key of that table. The unquantised
strings resolve to the model (activation) dtype, ``bfloat16`` or ``float16``.

vLLM's fused insert on MI300 rejects ``fp8_e5m2``; mapping it to e5m2fnuz there is this
project's generalisation (tested by emulation), so ``OPS_FORMATS`` allows it for every op.
Index caches in fp8 always use the platform's e4m3 format.
"""

from __future__ import annotations

from reference.formats import KV_CACHE_FP8_KINDS, MODEL_DTYPES, PLATFORMS, platform_fp8

KV_CACHE_DTYPES = ("auto", *MODEL_DTYPES, *KV_CACHE_FP8_KINDS)

# The platform a machine would run natively; the others are emulated through the
# storage-format argument of the kernels.
NATIVE_PLATFORM = {"cuda": "cuda", "hip-gfx950": "rocm-ocp", "hip-gfx942": "rocm-fnuz"}


def check_platform(platform: str) -> str:
    if platform not in PLATFORMS:
        raise ValueError(f"platform must be one of {list(PLATFORMS)}, got {platform!r}")
    return platform


def check_model_dtype(model_dtype: str) -> str:
    if model_dtype not in MODEL_DTYPES:
        raise ValueError(f"model_dtype must be one of {list(MODEL_DTYPES)}, got {model_dtype!r}")
    return model_dtype


def kv_cache_format(kv_cache_dtype: str, platform: str, model_dtype: str = "bfloat16") -> str:
    """Storage format of the main KV cache: an fp8 format name or the model dtype."""
    check_platform(platform)
    check_model_dtype(model_dtype)
    if kv_cache_dtype not in KV_CACHE_DTYPES:
        raise ValueError(
            f"kv_cache_dtype must be one of {list(KV_CACHE_DTYPES)}, got {kv_cache_dtype!r}"
        )
    if kv_cache_dtype == "auto":
        return model_dtype
    if kv_cache_dtype in MODEL_DTYPES:
        return kv_cache_dtype
    return platform_fp8(KV_CACHE_FP8_KINDS[kv_cache_dtype], platform)


def index_cache_format(fp8: bool, platform: str, model_dtype: str = "bfloat16") -> str:
    """Storage format of the index cache: the platform's e4m3, or the model dtype."""
    check_platform(platform)
    return platform_fp8("e4m3", platform) if fp8 else check_model_dtype(model_dtype)


def platform_formats(platform: str, model_dtype: str = "bfloat16") -> tuple[str, ...]:
    """Every distinct KV storage format a test on this platform must exercise."""
    seen = dict.fromkeys(kv_cache_format(s, platform, model_dtype) for s in KV_CACHE_DTYPES)
    return tuple(seen)


INDEXER_OPS = ("indexer_prefill", "indexer_decode")


def op_formats(op: str, platform: str, model_dtype: str = "bfloat16") -> tuple[str, ...]:
    """Storage formats an op must support on a platform: the indexer reads an index cache in
    the model dtype or the platform's e4m3; every other op (insert, reshape_and_cache,
    attention) every KV format of the platform."""
    if op in INDEXER_OPS:
        return (check_model_dtype(model_dtype), index_cache_format(True, platform))
    return platform_formats(platform, model_dtype)


def is_fp8(fmt: str) -> bool:
    return fmt not in MODEL_DTYPES
