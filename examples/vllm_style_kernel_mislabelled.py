"""The kernel of examples/vllm_style_kernel.py with its cache format mislabelled as the ROCm
bug did: the ``kv_cache_dtype`` string resolved as on CUDA whatever the platform, so MI300's
e4m3fnuz / e5m2fnuz bytes are viewed as float8_e4m3fn / float8_e5m2 (every value doubled,
the fnuz maxima read as NaN or Inf). The oracle fails it on the rocm-fnuz fp8 cases and
names the storage format in the verdict.

    ORACLE_PLUGINS=examples.vllm_style_kernel_mislabelled oracle report \
        --ops attention_decode --impls vllm_style_mislabelled
"""

from __future__ import annotations

from examples.vllm_style_kernel import implementation
from oracle.core.registry import register

register(implementation("vllm_style_mislabelled", platform_of=lambda fmt: "cuda",
                        notes="BROKEN on purpose: kv_cache_dtype resolved as on CUDA on "
                              "every platform (fnuz bytes viewed as OCP fp8)"))
