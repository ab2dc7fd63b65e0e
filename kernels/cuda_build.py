"""Builds csrc/ into a shared library with nvcc, cached by content.

``build()`` compiles every source (``nvcc -O3 -arch=sm_90 -Xcompiler -fPIC,-Wall,-Wextra
-c``, one process per source, in parallel; what they print is kept beside the library,
``build_warnings``), links them with ``nvcc -shared`` and returns the path of the .so.
The library lives under ``<cache>/<key>/`` where the key is a sha256 of the sources, every
header in csrc/ (``.h`` and ``.cuh``), the flags and the nvcc path: a cached build costs a
hash of a few files and no process. The cache root is ``$CSRC_CACHE_DIR``, else
``$XDG_CACHE_HOME`` (or ``~/.cache``) ``/sparse-attn-oracle/csrc``, else the temp directory
when that is not writable. Builds are atomic (a finished library is moved into place), so
concurrent test processes are safe.

A failed build raises ``BuildError`` (a RuntimeError) carrying nvcc's command and stderr.
No torch headers are involved: the libraries are loaded with ctypes
(kernels/cuda_norm_rope_insert.py).
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

CSRC = Path(__file__).resolve().parent.parent / "csrc"
#: the sources of the kernels' library, one translation unit per kernel family, activation
#: dtype (and head dim where the kernel is large) so that they compile in parallel: variant
#: 5's split loops, variants 1 and 2, variant 3, variant 0 and the launcher, variant 4, the
#: GPU test entry points. Slowest first (docs/tuning.md): ``_run`` starts them in this
#: order, as many at a time as there are CPUs.
LIB_SOURCES = (*(f"nri_split_{a}_d{d}.cu" for a in ("bf16", "f16") for d in (128, 256, 64)),
               "nri_vec_shfl_bf16.cu", "nri_vec_shfl_f16.cu",
               "nri_vec_global_bf16.cu", "nri_vec_global_f16.cu",
               *(f"nri_stream_{a}_d{d}.cu" for a in ("bf16", "f16") for d in (128, 256, 64)),
               "norm_rope_insert.cu",
               *(f"nri_persist_{a}_d{d}.cu" for a in ("bf16", "f16") for d in (128, 256, 64)),
               "test_support.cu")
#: headers hashed into the build key (every one in the include directory).
HEADER_GLOBS = ("*.h", "*.cuh")
ARCH = "sm_90"
#: compile flags (each source, and the link, which adds ``-shared``).
NVCC_FLAGS = ("-O3", f"-arch={ARCH}", "-std=c++17", "-Xcompiler", "-fPIC,-Wall,-Wextra")
#: what nvcc and the host compiler printed while compiling (warnings), beside the library
WARNINGS_NAME = "warnings.txt"
LIB_NAME = "libcsrc.so"
_TIMEOUT_S = 600


class BuildError(RuntimeError):
    """nvcc failed (or is missing); the message holds the command and nvcc's output."""


def find_nvcc() -> str | None:
    """nvcc on PATH, else under $CUDA_HOME / $CUDA_PATH, else /usr/local/cuda/bin."""
    found = shutil.which("nvcc")
    if found:
        return found
    for root in (os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH"), "/usr/local/cuda"):
        if root and os.access(Path(root) / "bin" / "nvcc", os.X_OK):
            return str(Path(root) / "bin" / "nvcc")
    return None


def cache_root() -> Path:
    env = os.environ.get("CSRC_CACHE_DIR")
    if env:
        return Path(env)
    base = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    root = base / "sparse-attn-oracle" / "csrc"
    try:
        root.mkdir(parents=True, exist_ok=True)
        if os.access(root, os.W_OK):
            return root
    except OSError:
        pass
    return Path(tempfile.gettempdir()) / "sparse-attn-oracle-csrc"


def build_key(sources, flags, nvcc: str, include_dir: Path = CSRC) -> str:
    """sha256 over the flags, the nvcc path, and the name and bytes of every source and of
    every header (``*.h``, ``*.cuh``) in ``include_dir`` (hashed whether included or not)."""
    h = hashlib.sha256()
    h.update(("\0".join(flags) + "\0" + nvcc + "\0").encode())
    headers = sorted(p for g in HEADER_GLOBS for p in Path(include_dir).glob(g)) \
        if include_dir else []
    for p in [Path(s) for s in sources] + headers:
        h.update(p.name.encode() + b"\0" + p.read_bytes() + b"\0")
    return h.hexdigest()[:32]


def _cpus() -> int:
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # not Linux
        return max(1, os.cpu_count() or 1)


def _run(cmds: list[list[str]], jobs: int | None = None) -> str:
    """Runs the commands in parallel, at most ``jobs`` (default: the CPUs this process may
    use) at a time, started in the given order as slots free up (callers list the slowest
    first: more processes than cores slow the cold build down);
    raises BuildError with the failures' output, else returns what they printed
    (warnings), each under its command. Output goes to temporary files (no pipe to fill)."""
    jobs = jobs or _cpus()
    pending = list(enumerate(cmds))
    running: dict[int, tuple[subprocess.Popen, float, object]] = {}
    results: dict[int, tuple[int, str, str]] = {}
    while pending or running:
        while pending and len(running) < jobs:
            i, c = pending.pop(0)
            log = tempfile.TemporaryFile(mode="w+")
            running[i] = (subprocess.Popen(c, stdout=log, stderr=subprocess.STDOUT, text=True),
                          time.monotonic(), log)
        done = [i for i, (p, t0, _) in running.items()
                if p.poll() is not None or time.monotonic() - t0 > _TIMEOUT_S]
        if not done:
            time.sleep(0.02)
            continue
        for i in done:
            p, t0, log = running.pop(i)
            note = ""
            if p.poll() is None:
                p.kill()
                p.wait()
                note = f"\n(killed after {_TIMEOUT_S} s)"
            log.seek(0)
            results[i] = (p.returncode, "", log.read() + note)
            log.close()
    failures, printed = [], []
    for i, cmd in enumerate(cmds):
        code, out, err = results[i]
        if code:
            failures.append(f"$ {' '.join(cmd)}\n{err.strip() or out.strip()}")
        elif (err or "").strip():
            printed.append(f"$ {' '.join(cmd)}\n{err.strip()}")
    if failures:
        raise BuildError("nvcc failed:\n" + "\n\n".join(failures))
    return "\n\n".join(printed)


def build(sources=None, flags=NVCC_FLAGS, name: str = LIB_NAME, cache_dir=None,
          nvcc: str | None = None, include_dir: Path = CSRC) -> Path:
    """The path of the shared library built from ``sources`` (default: LIB_SOURCES in csrc/),
    building it first unless the cache has it."""
    nvcc = nvcc or find_nvcc()
    if nvcc is None:
        raise BuildError("nvcc not found (looked on PATH, $CUDA_HOME, $CUDA_PATH, "
                         "/usr/local/cuda/bin)")
    srcs = [Path(s) if Path(s).is_absolute() else CSRC / s for s in (sources or LIB_SOURCES)]
    flags = tuple(flags)
    root = Path(cache_dir) if cache_dir is not None else cache_root()
    out_dir = root / build_key(srcs, flags, nvcc, include_dir)
    lib = out_dir / name
    if lib.is_file():
        return lib
    out_dir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=out_dir, prefix=".build-") as tmp:
        inc = [f"-I{include_dir}"] if include_dir else []
        objs = [Path(tmp) / f"{i}_{s.stem}.o" for i, s in enumerate(srcs)]
        printed = _run([[nvcc, *flags, *inc, "-c", str(s), "-o", str(o)]
                        for s, o in zip(srcs, objs)])
        tmp_lib = Path(tmp) / name
        _run([[nvcc, "-shared", *flags, *map(str, objs), "-o", str(tmp_lib)]])
        (out_dir / WARNINGS_NAME).write_text(printed)
        os.replace(tmp_lib, lib)
    return lib


def prebuild() -> None:
    """On a CUDA machine, build the library once in this process before it starts workers
    (pytest-xdist, fuzz, falsealarm): each would otherwise build it at its first CUDA-kernel
    call, all at once, each far slower than one build alone. A failed build is left to the calls
    that need the library, which report it."""
    from kernels import _cuda_available

    if not _cuda_available():
        return
    try:
        build()
    except BuildError:
        pass


def build_warnings(lib: Path) -> str:
    """What the compile of the library at ``lib`` printed (empty: no warning)."""
    return (Path(lib).parent / WARNINGS_NAME).read_text()


def main(argv=None) -> int:
    """``python -m kernels.cuda_build [--cold]``: build (or find) the library and print the
    seconds it took; ``--cold`` builds into an empty cache directory (the cold build
    time), then finds it there again (the cached time)."""
    import argparse
    import time

    ap = argparse.ArgumentParser(description="build csrc/ and time it")
    ap.add_argument("--cold", action="store_true", help="build into an empty cache")
    args = ap.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        cache = tmp if args.cold else None
        for what in ("build", "cached"):
            t0 = time.perf_counter()
            lib = build(cache_dir=cache)
            print(f"{what}: {time.perf_counter() - t0:.2f} s ({lib}, {os.cpu_count()} CPUs)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
