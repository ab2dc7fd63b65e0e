"""One GPU per pytest-xdist worker: ``ORACLE_GPUS=N pytest -m gpu -n N`` gives
worker ``gwK`` the GPU ``K mod N`` alone, by setting ``CUDA_VISIBLE_DEVICES`` before anything
initialises CUDA (conftest.py calls ``pin_worker_gpu`` first thing). Unset, or N <= 1, or a
``CUDA_VISIBLE_DEVICES`` the user set: nothing changes (every worker shares the visible
GPUs, as on the one-GPU machine). A plain ``pytest -m gpu`` sets ORACLE_GPUS to the number
of visible GPUs itself (oracle/tools/pytest_workers.py). xdist shards the test ids
deterministically (the differential test's parameters are a pure function of the registry
and ORACLE_SEED).
"""

from __future__ import annotations

import os


def worker_gpu(worker: str | None, gpus: int) -> int | None:
    """The GPU of xdist worker ``worker`` ("gw3") among ``gpus`` GPUs, or None (not a
    worker, or fewer than two GPUs)."""
    if not worker or not worker.startswith("gw") or gpus <= 1:
        return None
    return int(worker[2:]) % gpus


def pin_gpu(index: int, gpus: int, environ=os.environ) -> int | None:
    """Put worker ``index`` of a process pool (``oracle fuzz``, ``oracle falsealarm``) on
    GPU ``index mod gpus`` alone, unless the user set CUDA_VISIBLE_DEVICES or there are
    fewer than two GPUs; returns the GPU index chosen, or None. Call it before CUDA is
    initialised."""
    if "CUDA_VISIBLE_DEVICES" in environ or gpus <= 1:
        return None
    environ["CUDA_VISIBLE_DEVICES"] = str(index % gpus)
    return index % gpus


def pin_worker_gpu(environ=os.environ) -> int | None:
    """Set CUDA_VISIBLE_DEVICES for this xdist worker from ORACLE_GPUS (see the module
    docstring); returns the GPU index chosen, or None."""
    if "CUDA_VISIBLE_DEVICES" in environ:
        return None
    try:
        gpus = int(environ.get("ORACLE_GPUS", "0"))
    except ValueError:
        raise ValueError(f"ORACLE_GPUS must be an integer, got "
                         f"{environ['ORACLE_GPUS']!r}") from None
    worker = environ.get("PYTEST_XDIST_WORKER")
    if worker_gpu(worker, gpus) is None:
        return None
    return pin_gpu(int(worker[2:]), gpus, environ)


def gpu_memories() -> list[int]:
    """Total memory in bytes of each visible CUDA GPU; empty without torch or CUDA."""
    try:
        import torch
    except ImportError:
        return []
    if not torch.cuda.is_available():
        return []
    return [torch.cuda.get_device_properties(i).total_memory
            for i in range(torch.cuda.device_count())]
