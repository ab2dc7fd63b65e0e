"""A content-addressed disk cache of the reference's results (exact values, bounds, the
indexer's scores), so that a run after a kernel change recomputes no float64 reference.

A key is the sha256 of: what is computed (``kind``), the case's input hash, the arguments
beyond the inputs (a schedule, an implementation's declared arithmetic) and the hash of the
sources that compute it (``sources_hash``: the kind's modules and what they import from
reference/ and oracle/core/, the checks' calling code, numpy's and ml_dtypes' versions).
Nothing of a kernel enters a key, so a kernel change hits every entry; a change to a
reference or tolerance-model module misses the entries of the kinds that use it.

Where: ``ORACLE_REFERENCE_CACHE=<dir>``, or ``$XDG_CACHE_HOME/sparse-attn-oracle/reference``
(``~/.cache/...`` without it); ``ORACLE_REFERENCE_CACHE=off`` disables it.

A process keeps the entries it read or wrote last in memory (``MEMORY_BYTES``, least
recently used out first) and hands out copies of them: the implementations of one case run
one after another in one worker and read the same entries, and a model shape's entry takes
0.45 s to read and verify, a copy 0.03 s.

An entry is one ``.npz`` (``allow_pickle=False``: arrays only) holding its key and the sha256
of its arrays (names, dtypes, shapes, bytes). A missing, unreadable, truncated, corrupt or
foreign entry is recomputed and rewritten, never trusted, and counted and reported
(``RefCacheWarning``). Writers write a temporary file in the entry's directory and rename it
over the entry (atomic on POSIX): concurrent workers computing one entry leave one valid
entry, whichever wins.
"""

from __future__ import annotations

import ast
import collections
import functools
import hashlib
import os
import tempfile
import warnings
import zipfile
from collections.abc import Callable
from pathlib import Path

import numpy as np

ENV = "ORACLE_REFERENCE_CACHE"
ROOT = Path(__file__).resolve().parents[2]
#: Per kind of entry, the modules whose functions compute it: an entry depends on them and
#: on everything they import from reference/ and oracle/core/ (``hashed_files``).
KIND_MODULES = {
    "indexer_decode": ("reference.indexer",),
    "indexer_prefill": ("reference.indexer",),
    "attention": ("reference.attention",),
    "attention_exact_baseline": ("reference.attention",),
    "attention_bound": ("oracle.core.attention_bound",),
    # the admissible codes' ordinals of the scheduled output, from the two entries above
    "attention_ordinals": ("reference.attention", "oracle.core.attention_bound",
                           "oracle.core.intervals"),
    "norm_rope": ("reference.norm_rope", "oracle.core.bounds", "oracle.core.intervals"),
    "inputs": ("oracle.core.cases", "oracle.core.inputsets"),  # keyed by case id
}
#: The code between a check and the reference (the calls, the cache): in every key, their
#: imports not followed (checks.py imports the whole tolerance model).
CALLERS = ("oracle.core.checks", "oracle.core.reference_run", "oracle.core.refcache")
_OURS = ("reference", "oracle.core")
#: Bytes of verified entries a process keeps in memory: a model-shape entry (270 MB) with
#: the smaller ones around it; sixteen GPU workers then hold 8 GiB at most.
MEMORY_BYTES = 512 << 20
_KEY = "__key__"
_DIGEST = "__sha256__"


class RefCacheWarning(UserWarning):
    """A cache entry that could not be trusted (recomputed) or written."""


def _file(module: str) -> Path | None:
    path = ROOT.joinpath(*module.split(".")).with_suffix(".py")
    return path if path.is_file() else None


def _imports(path: Path) -> set[str]:
    """The modules of reference/ and oracle/core/ that a source file imports, anywhere in
    it (function-local imports included)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            found.add(node.module)
            found.update(f"{node.module}.{a.name}" for a in node.names)
    return {m for m in found if m.startswith(_OURS) and _file(m) is not None}


def hashed_files(kind: str) -> list[Path]:
    """The source files whose contents key the entries of ``kind``: its modules and what
    they import from reference/ and oracle/core/, transitively, the callers, and their
    packages' ``__init__.py``."""
    if kind not in KIND_MODULES:
        raise ValueError(f"kind must be one of {sorted(KIND_MODULES)}, got {kind!r}")
    seen, todo = set(), list(KIND_MODULES[kind])
    while todo:
        m = todo.pop()
        if m not in seen:
            seen.add(m)
            todo.extend(_imports(_file(m)))
    modules = seen | set(CALLERS)
    packages = {m.rsplit(".", i)[0] for m in modules for i in range(1, m.count(".") + 1)}
    inits = {ROOT.joinpath(*p.split("."), "__init__.py") for p in packages}
    return sorted({_file(m) for m in modules} | {f for f in inits if f.is_file()})


@functools.cache
def sources_hash(kind: str) -> str:
    """sha256 of the sources that compute entries of ``kind`` and of the numeric
    libraries' versions (a new numpy may sum in another order)."""
    import ml_dtypes

    h = hashlib.sha256(f"numpy {np.__version__} ml_dtypes {ml_dtypes.__version__}".encode())
    for f in hashed_files(kind):
        h.update(str(f.relative_to(ROOT)).encode() + b"\0" + f.read_bytes() + b"\0")
    return h.hexdigest()


def payload_digest(arrays: dict) -> str:
    """sha256 over the arrays' names, dtypes, shapes and bytes, in name order."""
    h = hashlib.sha256()
    for name in sorted(arrays):
        a = np.ascontiguousarray(arrays[name])
        h.update(f"{name}\0{a.dtype.str}\0{a.shape}\0".encode())
        h.update(a.reshape(-1).view(np.uint8))  # its bytes, without tobytes()'s copy
    return h.hexdigest()


def user_cache_path(variable: str, name: str, environ=os.environ) -> Path | None:
    """Where the environment variable ``variable`` puts a cached thing: its path, None
    for ``off``, unset ``name`` in the user's cache directory
    (``$XDG_CACHE_HOME/sparse-attn-oracle``, else ``~/.cache/sparse-attn-oracle``)."""
    where = environ.get(variable, "")
    if where.lower() == "off":
        return None
    if where:
        return Path(where)
    base = environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "sparse-attn-oracle" / name


def default_dir(environ=os.environ) -> Path | None:
    """The cache directory the environment asks for (None: disabled)."""
    return user_cache_path(ENV, "reference", environ)


class RefCache:
    """The cache in directory ``root`` (None: every lookup computes). ``source``: one
    sources' hash for every kind (default: each kind's ``sources_hash``). Counts its hits
    (those served from memory apart too), misses and rejected entries."""

    def __init__(self, root: Path | None, source: str | None = None,
                 memory_bytes: int = MEMORY_BYTES):
        self.root = None if root is None else Path(root)
        self.source = source
        self.hits = self.misses = self.rejected = 0
        self.memory_hits = 0  # the hits served from memory, no file read
        self.memory_bytes = memory_bytes
        # key -> (arrays, their bytes), least recently used first
        self._memory: collections.OrderedDict[str, tuple[dict, int]] = collections.OrderedDict()
        self._held = 0  # bytes in _memory

    def key(self, kind: str, input_hash: str, args) -> str:
        source = sources_hash(kind) if self.source is None else self.source
        text = f"{kind}\0{input_hash}\0{args!r}\0{source}"
        return hashlib.sha256(text.encode()).hexdigest()

    def path(self, key: str) -> Path:
        return self.root / key[:2] / f"{key}.npz"

    def get(self, kind: str, input_hash: str, args,
            compute: Callable[[], dict]) -> dict[str, np.ndarray]:
        """The arrays ``compute()`` returns for this key, from the cache when a valid entry
        holds them (bit-identical), else computed and stored."""
        if self.root is None:
            return {k: np.asarray(v) for k, v in compute().items()}
        key = self.key(kind, input_hash, args)
        if key in self._memory:
            self._memory.move_to_end(key)
            self.hits += 1
            self.memory_hits += 1
            return {k: v.copy() for k, v in self._memory[key][0].items()}
        path = self.path(key)
        found = self._read(path, key)
        if found is not None:
            self.hits += 1
        else:
            self.misses += 1
            found = {k: np.asarray(v) for k, v in compute().items()}
            self._write(path, key, found)
        self._remember(key, found)
        return found

    def _remember(self, key: str, arrays: dict) -> None:
        """Keep a copy of the entry's arrays (the caller owns the ones it gets), dropping
        the least recently used entries past ``memory_bytes``."""
        size = sum(a.nbytes for a in arrays.values())
        if size > self.memory_bytes:
            return
        self._memory[key] = ({k: v.copy() for k, v in arrays.items()}, size)
        self._held += size
        while self._held > self.memory_bytes:
            _, (_, dropped) = self._memory.popitem(last=False)
            self._held -= dropped

    def _read(self, path: Path, key: str) -> dict | None:
        """The entry's arrays, or None (absent, or rejected and reported)."""
        try:
            with np.load(path, allow_pickle=False) as z:
                stored = {name: z[name] for name in z.files}
        except FileNotFoundError:
            return None
        except (OSError, ValueError, KeyError, EOFError, zipfile.BadZipFile) as e:
            return self._reject(path, f"unreadable ({type(e).__name__}: {e})")
        if _KEY not in stored or _DIGEST not in stored:
            return self._reject(path, "no key or checksum")
        if str(stored.pop(_KEY)) != key:
            return self._reject(path, "foreign entry (another key)")
        if str(stored.pop(_DIGEST)) != payload_digest(stored):
            return self._reject(path, "checksum mismatch")
        return stored

    def _reject(self, path: Path, why: str) -> None:
        self.rejected += 1
        warnings.warn(f"reference cache entry {path}: {why}; recomputed", RefCacheWarning,
                      stacklevel=4)
        return None

    def _write(self, path: Path, key: str, arrays: dict) -> None:
        """Write the entry atomically: a temporary file beside it, renamed over it."""
        tmp = None
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".tmp-", suffix=".npz")
            with os.fdopen(fd, "wb") as f:
                np.savez(f, **arrays, **{_KEY: np.array(key), _DIGEST: np.array(
                    payload_digest(arrays))})
            os.replace(tmp, path)
        except OSError as e:  # a full or read-only disk costs speed, not results
            if tmp is not None and os.path.exists(tmp):
                os.unlink(tmp)
            warnings.warn(f"reference cache: could not write {path} ({e})", RefCacheWarning,
                          stacklevel=3)


_DEFAULT: list = [None, None]  # [the environment's directory, its RefCache]


def default_cache() -> RefCache:
    """The process's cache for the current environment (``ENV``)."""
    where = default_dir()
    if _DEFAULT[1] is None or _DEFAULT[0] != where:
        _DEFAULT[:] = [where, RefCache(where)]
    return _DEFAULT[1]
