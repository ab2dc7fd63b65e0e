"""``pytest -m gpu`` typed plainly uses the whole machine.

On a CUDA machine with pytest-xdist installed, a run that selects the ``gpu`` tests and
names no worker count gets as many xdist workers as the cores, the host memory and the
GPUs' memory allow, ``--dist loadgroup`` (the cases of one shape config share a worker),
and with several GPUs one GPU per worker (``ORACLE_GPUS``, read by ``pin_worker_gpu`` in
each worker). A ``-n``/``--tx``/``--dist`` the user gives wins, ``-n 0`` and
``-p no:xdist`` included. Without pytest-xdist the run stays in one process and its header
says once how to go faster. The CPU run (``-m "not gpu ..."``) is never touched. After
each test a worker returns what its CUDA allocator caches beyond half its share of the GPU.

Such a run also sends its slowest work first: the controller keeps every test's seconds
(``ORACLE_TEST_SECONDS``, default ``test-seconds.json`` in the user's cache directory;
``off`` disables it), and the next run orders its groups by them, the slowest first, so
that the workers finish together instead of one running a long test alone at the end.

The root conftest.py registers this module as a plugin; its ``pytest_configure`` runs
before xdist's (which is ``trylast`` and creates the distributed session from
``config.option.dist`` and ``config.option.tx``).
"""

from __future__ import annotations

import importlib.util
import json
import os
import sys
import tempfile
from pathlib import Path

import pytest
from _pytest.mark.expression import Expression

from oracle.core.refcache import user_cache_path
from oracle.tools.gpus import gpu_memories

GIB = 1 << 30
# Room for a worker's float64 reference, its model-shape cases and its imports (torch,
# Triton); erring large: fewer workers beat swapping.
HOST_BYTES_PER_WORKER = 4 * GIB
# A CUDA context plus the largest test's tensors and Triton's workspace.
GPU_BYTES_PER_WORKER = 4 * GIB
# What a worker's caching allocator may keep reserved between tests: half its share, so
# sixteen idle workers leave room for the one test that needs several GB (large caches).
KEPT_RESERVED_BYTES = GPU_BYTES_PER_WORKER // 2

SECONDS_ENV = "ORACLE_TEST_SECONDS"  # where the tests' last seconds live (a path, or off)
_ORDER_ENV = "ORACLE_SLOWEST_FIRST"  # set by the controller: workers order by that file

FASTER = ("sparse-attn-oracle: `pytest -m gpu` runs in one process; install pytest-xdist "
          "to spread it over every core and GPU")
_ADVICE = pytest.StashKey[str]()  # the header line of a run that could go faster


def worker_count(cores: int, host_bytes: int, gpu_bytes: list[int]) -> int:
    """Workers for a ``-m gpu`` run: the fewest that the cores, the host memory and the
    GPUs allow (workers go round-robin over the GPUs, so the smallest GPU sets each one's
    share); 0 (stay in one process) with no GPU or room for fewer than two workers."""
    if cores < 1 or host_bytes < 0 or any(b < 0 for b in gpu_bytes):
        raise ValueError(f"cores must be >= 1 and memory sizes >= 0, got cores={cores}, "
                         f"host_bytes={host_bytes}, gpu_bytes={gpu_bytes}")
    if not gpu_bytes:
        return 0
    by_gpu = min(gpu_bytes) // GPU_BYTES_PER_WORKER * len(gpu_bytes)
    n = min(cores, host_bytes // HOST_BYTES_PER_WORKER, by_gpu)
    return n if n >= 2 else 0


def selects_gpu_tests(markexpr: str) -> bool:
    """Whether the ``-m`` expression selects a test marked ``gpu`` alone."""
    if not markexpr:
        return False
    return Expression.compile(markexpr).evaluate(lambda name, **_: name == "gpu")


def user_chose_workers(option) -> bool:
    """Whether the command line (or PYTEST_ADDOPTS) already says how to distribute, or
    debugs in this process (--pdb, --trace)."""
    return (getattr(option, "numprocesses", None) is not None
            or getattr(option, "usepdb", False) or getattr(option, "trace", False)
            or bool(getattr(option, "tx", None)) or getattr(option, "dist", "no") != "no")


def xdist_installed() -> bool:
    """Whether pytest-xdist can be imported (loaded as a plugin or not)."""
    return importlib.util.find_spec("xdist") is not None


def host_memory() -> int:
    """Bytes of host memory available now (MemAvailable), or the total where unknown."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def usable_cores() -> int:
    """Cores this process may run on."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()


def distribute(option, workers: int, gpus: int, environ=os.environ) -> Path | None:
    """Set xdist's options as ``-n workers --dist loadgroup`` would, and with several GPUs
    put each worker on its own (``ORACLE_GPUS``, inherited by the workers). With the
    tests' seconds of an earlier run at hand, the workers (inheriting ``_ORDER_ENV``) order
    the groups by them and xdist keeps that order instead of its own by group size.
    Returns the seconds file this run keeps (None: off)."""
    option.numprocesses = workers
    option.dist = "loadgroup"
    option.tx = ["popen"] * workers
    if gpus > 1 and "CUDA_VISIBLE_DEVICES" not in environ:
        environ.setdefault("ORACLE_GPUS", str(gpus))
    path = seconds_path(environ)
    if path is not None and read_seconds(path):
        option.loadscopereorder = False
        environ[_ORDER_ENV] = str(path)
    return path


def seconds_path(environ=os.environ) -> Path | None:
    """The file of the tests' last seconds the environment asks for (None: off)."""
    return user_cache_path(SECONDS_ENV, "test-seconds.json", environ)


def read_seconds(path: Path) -> dict[str, float]:
    """{node id: seconds} from ``path``; empty when absent or unreadable (an order hint,
    never worth failing a run for)."""
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, ValueError):
        return {}
    if not isinstance(data, dict):
        return {}
    return {k: float(v) for k, v in data.items() if isinstance(v, (int, float))}


def write_seconds(path: Path, seconds: dict[str, float]) -> None:
    """Merge ``seconds`` into the file (tests not run this time keep their entries),
    atomically: a temporary file beside it, renamed over it."""
    merged = {**read_seconds(path), **{k: round(v, 3) for k, v in seconds.items()}}
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".tmp-", suffix=".json")
        with os.fdopen(fd, "w") as f:
            json.dump(merged, f, sort_keys=True)
        os.replace(tmp, path)
    except OSError:  # a read-only or full disk costs the order, not the run
        pass


def slowest_first(nodeids: list[str], groups: list[str | None],
                  seconds: dict[str, float]) -> list[int]:
    """The order (indices into ``nodeids``) that sends the slowest work first: a group's
    tests (``groups[i]``: its xdist_group, None: the test is its own) stay together,
    groups go by their summed seconds, the most first; a group with a test never timed
    goes before every timed one (a new test may compile kernels); ties keep the
    collection order."""
    scope = [g if g is not None else f"\0{n}" for n, g in zip(nodeids, groups)]
    total: dict[str, float] = {}
    first: dict[str, int] = {}
    for i, (n, sc) in enumerate(zip(nodeids, scope)):
        total[sc] = total.get(sc, 0.0) + seconds.get(n, float("inf"))
        first.setdefault(sc, i)
    return sorted(range(len(nodeids)), key=lambda i: (-total[scope[i]], first[scope[i]], i))


def _group(item) -> str | None:
    mark = item.get_closest_marker("xdist_group")
    if mark is None:
        return None
    return str(mark.args[0] if mark.args else mark.kwargs.get("name", "default"))


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(session, config, items):
    path = os.environ.get(_ORDER_ENV)
    if not path or not hasattr(config, "workerinput"):
        return
    order = slowest_first([i.nodeid for i in items], [_group(i) for i in items],
                          read_seconds(Path(path)))
    items[:] = [items[i] for i in order]


class SecondsRecorder:
    """On the controller of a distributed run: every test's seconds (setup, call and
    teardown), written at the end for the next run's order."""

    def __init__(self, path: Path):
        self.path = path
        self.seconds: dict[str, float] = {}

    def pytest_runtest_logreport(self, report):
        self.seconds[report.nodeid] = self.seconds.get(report.nodeid, 0.0) + report.duration

    def pytest_sessionfinish(self, session):
        if self.seconds:
            write_seconds(self.path, self.seconds)


@pytest.hookimpl(tryfirst=True)
def pytest_configure(config):
    option = config.option
    if (hasattr(config, "workerinput") or option.collectonly
            or not selects_gpu_tests(option.markexpr) or user_chose_workers(option)):
        return
    gpu_bytes = gpu_memories()
    if not gpu_bytes:
        return
    if not config.pluginmanager.hasplugin("xdist"):
        if not xdist_installed():  # absent, not switched off with -p no:xdist
            config.stash[_ADVICE] = FASTER
        return
    workers = worker_count(usable_cores(), host_memory(), gpu_bytes)
    if workers:
        path = distribute(option, workers, len(gpu_bytes))
        if path is not None:
            config.pluginmanager.register(SecondsRecorder(path), "test_seconds")


def release_cached_gpu_memory(cuda, kept: int = KEPT_RESERVED_BYTES) -> bool:
    """Return the blocks ``cuda`` (``torch.cuda``) holds cached beyond ``kept`` bytes to
    the device; whether it did. A worker's allocator otherwise keeps the peak of every test
    it ran (9.5 GiB seen), and a neighbour's large test then runs out of memory."""
    if not cuda.is_initialized() or cuda.memory_reserved() <= kept:
        return False
    cuda.empty_cache()
    return True


@pytest.hookimpl(trylast=True)
def pytest_runtest_teardown(item):
    if hasattr(item.config, "workerinput") and "torch" in sys.modules:
        release_cached_gpu_memory(sys.modules["torch"].cuda)


def pytest_report_header(config):
    return config.stash.get(_ADVICE, None)
