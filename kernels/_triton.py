"""The one place kernel modules import Triton from.

``from kernels._triton import triton, tl`` in every kernel module guarantees that, when
``TRITON_INTERPRET=1`` is set, Triton's CPU interpreter is patched to be numerically
faithful (kernels/interpreter.py) before any kernel runs. ``triton.jit`` reads
``TRITON_INTERPRET`` when a kernel is decorated, i.e. when its module is imported: the
variable must be set before that (entry points call
``kernels.use_interpreter_without_gpu()``, which sets it when no CUDA device is present;
or set it in the environment of the process).
"""

from __future__ import annotations

import functools
import time

import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from kernels._host import fail
from kernels.interpreter import patch_interpreter

INTERPRET: bool = bool(triton.knobs.runtime.interpret)
if INTERPRET:
    patch_interpreter()


def hash_callees_first() -> None:
    """Make a kernel's JIT cache key (its source hash, part of every compile's disk-cache
    key) the same in every process. Triton 3.6 merges a callee's constexpr globals into the
    caller's key before it has hashed the callee, so a helper first hashed through one
    kernel leaves another kernel's key short of them: each xdist worker keyed a kernel by
    whichever kernel it launched first, and a warm run rebuilt what another worker had
    cached. Hashing the callee first gives every kernel its full key (as upstream Triton
    does since PR 10494). Idempotent."""
    from triton.runtime.jit import DependenciesFinder

    merge = DependenciesFinder._update_hash
    if getattr(merge, "_callees_first", False):
        return

    def update_hash(self, func):
        _ = func.cache_key  # computes the callee's globals before the caller merges them
        return merge(self, func)

    update_hash._callees_first = True
    DependenciesFinder._update_hash = update_hash


hash_callees_first()


def is_interpreted(kernel) -> bool:
    """True when ``kernel`` (a decorated function) runs in the CPU interpreter."""
    from triton.runtime.interpreter import InterpretedFunction

    return isinstance(kernel, InterpretedFunction)


def ensure_ready(kernel) -> None:
    """Call from launchers: an interpreted kernel needs the patched interpreter (in case the
    variable was set after this module was imported)."""
    if is_interpreted(kernel):
        patch_interpreter()


_RESIDENT: dict = {}


def _arg_key(a):
    """What of one argument Triton specialises a compile on: a tensor's dtype and 16-byte
    alignment; an integer's width, ``== 1`` and divisibility by 16 (a few states, so the
    planners' caches stay small however many shapes a server meets); a bool's value."""
    if hasattr(a, "data_ptr"):
        return str(a.dtype), a.data_ptr() % 16 == 0
    if isinstance(a, bool):
        return "bool", a
    if isinstance(a, int):
        width = "i32" if -2**31 <= a < 2**31 else "i64" if a < 2**63 else "u64"
        return width, a == 1, a % 16 == 0
    return type(a).__name__


def _spec_key(kernel, args, kwargs) -> tuple:
    """A key at least as fine as Triton's own compile key: the planners' answers depend on
    the arguments alone, never on which case a process met first (that would pick kernel
    variants per worker history and miss the disk cache from run to run)."""
    return kernel, tuple(_arg_key(a) for a in args), tuple(sorted(kwargs.items()))


def resident_programs(kernel, args, kwargs, device) -> int:
    """How many programs of ``kernel`` (compiled for these arguments and launch options)
    the whole GPU holds at once: SMs x the per-SM occupancy from the compiled kernel's
    registers and shared memory (as Triton's fused-softmax tutorial sizes its persistent
    grid). A persistent grid larger than this runs its last programs as a second wave, a
    long tail. Compiles the kernel on the first call for a key (``_spec_key``) and caches
    the answer."""
    key = _spec_key(kernel, args, kwargs)
    if key not in _RESIDENT:
        regs, smem, props = _resources(kernel, args, kwargs, device)
        per_sm = programs_per_sm(regs, smem, kwargs.get("num_warps", 4), props["max_num_regs"],
                                 props["max_shared_mem"])
        _RESIDENT[key] = per_sm * props["multiprocessor_count"]
    return _RESIDENT[key]


def programs_per_sm(regs: int, smem: int, warps: int, max_regs: int, max_shared: int) -> int:
    """Programs one SM holds at once (at least 1): the fewest of what its registers
    (``max_regs`` per SM), its shared memory (``max_shared`` per SM as the device reports
    it), its 64 warps and its 32 blocks allow; registers are allocated per warp in units
    of 256 (8 per thread)."""
    regs = -(-regs // 8) * 8
    return max(1, min(max_regs // max(regs * 32 * warps, 1),
                      max_shared // smem if smem else 32, 32, 64 // warps))


def _resources(kernel, args, kwargs, device) -> tuple[int, int, dict]:
    """(registers per thread, shared memory bytes per program, device properties) of the
    kernel compiled for these arguments (compiles it on the first call for a key)."""
    compiled = kernel.warmup(*args, grid=(1,), **kwargs)
    compiled._init_handles()
    return compiled.n_regs, compiled.metadata.shared, device_properties(device.index or 0)


_CAPS: dict = {}


def register_cap(kernel, args, kwargs, device, most_per_sm: int) -> int | None:
    """A ptxas register cap (the ``maxnreg`` launch option) under which as many programs
    fit on an SM as its shared memory holds, at most ``most_per_sm``; None when the kernel
    compiled without one already fits (a cap then only risks spills). For a grid sized to
    one wave, where a few registers over a boundary lose a whole program per SM (the
    decode indexer's flat grid with its scan inlined in a loop: e4m3 132 registers, 3
    programs per SM instead of 4). Compiles on the first call for a key and caches the
    answer, as ``resident_programs``."""
    key = _spec_key(kernel, args, kwargs) + (most_per_sm,)
    if key not in _CAPS:
        regs, smem, props = _resources(kernel, args, kwargs, device)
        warps = kwargs.get("num_warps", 4)
        want = min(most_per_sm, props["max_shared_mem"] // smem if smem else most_per_sm)
        cap = min(255, props["max_num_regs"] // (max(want, 1) * 32 * warps) // 8 * 8)
        _CAPS[key] = cap if regs > cap else None
    return _CAPS[key]


_STAGES: dict = {}


@functools.cache
def device_properties(index: int) -> dict:
    """The driver's properties of GPU ``index`` (SMs, registers, shared memory), asked once
    per process: the query costs about 10 ms and the planners ask on every new key."""
    return triton.runtime.driver.active.utils.get_device_properties(index)


def _max_shared_mem(device) -> int:
    """Shared memory one block may use on ``device`` (bytes; 227 KiB on sm_90)."""
    return device_properties(device.index or 0)["max_shared_mem"]


def fitting_stages(kernel, args, kwargs, device, deepest: int = 3) -> int:
    """The deepest software pipeline (``num_stages`` from ``deepest`` down to 1) whose
    compiled kernel fits the device's shared memory per block. Triton keeps every stage's
    tiles in shared memory and fails the launch (OutOfResources) when they do not fit; how
    much a stage takes depends on the constexprs (e.g. the decode kernel's q tile grows with
    rows x heads), so the launchers ask the compiler instead of guessing. Compiles on the
    first call for a key (as ``resident_programs``) and caches the answer; interpreted
    kernels take ``deepest``."""
    if is_interpreted(kernel):
        return deepest
    key = _spec_key(kernel, args, kwargs) + (deepest,)
    if key not in _STAGES:
        limit = _max_shared_mem(device)
        stages = deepest
        while stages > 1:
            compiled = kernel.warmup(*args, grid=(1,), **kwargs, num_stages=stages)
            if compiled.metadata.shared <= limit:
                break
            stages -= 1
        _STAGES[key] = stages
    return _STAGES[key]


class CompileClock:
    """Counts Triton's JIT compiles in this process and their seconds: every miss of a
    kernel's in-memory cache (a new specialisation: constexprs, dtypes, the divisibility of
    the integer arguments Triton specialises on), whether the disk cache then holds it or
    the compiler builds it. ``install()`` sets Triton's ``jit_cache_hook`` /
    ``jit_post_compile_hook`` (one clock per process; the interpreter never compiles, so
    it counts nothing there). ``oracle fuzz`` reports it: on a GPU a random-shape search
    is compile-bound when most of its cases meet a new specialisation."""

    def __init__(self):
        self.count = 0
        self.seconds = 0.0
        self._started: float | None = None

    def install(self) -> CompileClock:
        triton.knobs.runtime.jit_cache_hook = self.started
        triton.knobs.runtime.jit_post_compile_hook = self.finished
        return self

    def started(self, **_) -> bool:
        self._started = time.perf_counter()
        return False  # go on compiling

    def finished(self, **_) -> None:
        if self._started is not None:
            self.count += 1
            self.seconds += time.perf_counter() - self._started
            self._started = None


__all__ = ["INTERPRET", "CompileClock", "ensure_ready", "fitting_stages", "is_interpreted",
           "patch_interpreter", "resident_programs", "tl", "triton"]


@triton.jit
def await_previous_kernel(PDL: tl.constexpr):
    """Programmatic dependent launch (sm_90; a launch with ``launch_pdl=True``, the decode
    launchers' ``pdl`` knob): first wait until the stream's previous kernel has completed
    and its writes are visible (``griddepcontrol.wait``; before this program reads or writes
    anything, so the semantics stay those of a plain launch), then let the stream's next
    kernel be scheduled onto SMs as this one's programs finish
    (``griddepcontrol.launch_dependents``; it too waits before touching memory). What it
    saves: the gap between two launches (the next one's launch and set-up overlap this
    one's tail). Nothing when PDL is False (the interpreter, a plain launch)."""
    if PDL:
        gdc_wait()
        gdc_launch_dependents()


def pdl_options(pdl: bool, interpreted: bool) -> dict:
    """The constexpr and launch option of ``await_previous_kernel`` for a launch asked for
    ``pdl`` (bool; a no-op interpreted: the CPU has no programmatic launch)."""
    if not isinstance(pdl, bool):
        fail("pdl", f"must be True or False, got {pdl!r}")
    on = pdl and not interpreted
    return {"PDL": True, "launch_pdl": True} if on else {}
