"""Every implementation module of the project, named here and loaded in one place.

``load_all()`` imports each module of ``MODULES`` and calls its ``register_all()``, then
imports the user's modules named by ``$ORACLE_PLUGINS``. A project module that cannot load
on this machine (no torch, no triton, no CUDA device or nvcc) registers nothing and is
recorded in ``UNAVAILABLE`` with the reason, which ``python -m oracle impls`` shows; a
plugin that does not import is an error. Loading twice registers nothing twice.

Entry points (the CLI, conftest.py, the tools' worker processes, benchmarks) call
``load_all()``; the core registry itself imports nothing above ``oracle.core``.
"""

from __future__ import annotations

import importlib
import os

from kernels import _cuda_available
from oracle.core.registry import REGISTRY

#: The project's implementation modules, in registration order; each has ``register_all()``
#: returning None, or why it registers nothing on this machine.
MODULES = (
    "oracle.impls.reference",
    "oracle.impls.torch_peer",
    "oracle.impls.triton",
    "oracle.impls.flex",
    "oracle.impls.cuda",
)
#: Comma-separated modules, importable from ``sys.path``, that register implementations of
#: their own (a user's kernels: see README "Testing your own kernel"); imported after
#: the project's, so the tests, reports, fuzzing and replays see them like any other.
PLUGINS_ENV = "ORACLE_PLUGINS"
#: The project modules that registered nothing here, and why.
UNAVAILABLE: dict[str, str] = {}
_LOADED: set[str] = set()
# What a module that cannot load on this machine raises besides ImportError (a missing
# package): the CUDA library failing to load or build. Anything else is a bug and raises.
_CANNOT_LOAD = {"oracle.impls.cuda": (OSError, RuntimeError)}


def device_name() -> str:
    """``"cuda"`` when torch sees a CUDA device, else ``"cpu"`` (also without torch)."""
    return "cuda" if _cuda_available() else "cpu"


def _load_module(name: str) -> None:
    try:
        reason = importlib.import_module(name).register_all()
    except ImportError as e:
        reason = f"{e.name or 'a dependency'} not importable: {e}"
    except _CANNOT_LOAD.get(name, ()) as e:
        reason = f"{type(e).__name__}: {e}"
    if reason is None:
        _LOADED.add(name)
        UNAVAILABLE.pop(name, None)
    else:
        UNAVAILABLE[name] = reason


def load_all() -> dict[str, str]:
    """Register every project implementation that loads here and every plugin; returns
    ``UNAVAILABLE`` (module -> why it registered nothing)."""
    for name in MODULES:
        if name not in _LOADED and name not in UNAVAILABLE:
            _load_module(name)
    for name in plugin_modules():
        try:  # a module the user named must import: no silent skip
            importlib.import_module(name)
        except Exception as e:
            raise ImportError(f"{PLUGINS_ENV}: module {name!r} did not import: "
                              f"{type(e).__name__}: {e}") from e
    return UNAVAILABLE


def plugin_modules() -> list[str]:
    """The modules named by ``$ORACLE_PLUGINS`` (comma-separated, blanks ignored)."""
    return [m.strip() for m in os.environ.get(PLUGINS_ENV, "").split(",") if m.strip()]


# ------------------------------------------------------------------------------ the table

_COLUMNS = ("name", "op", "devices", "formats", "platforms", "model dtypes", "shape classes",
            "here")


def _why_not_here(impl, device: str) -> str:
    # A CPU implementation runs on any machine (the reference on a CUDA machine too).
    if device in impl.devices or "cpu" in impl.devices:
        return "runs"
    return "needs a CUDA device" if "cuda" in impl.devices else f"needs {'/'.join(impl.devices)}"


def table_rows(device: str) -> list[tuple[str, ...]]:
    """One row per registered implementation (``_COLUMNS``), then one per project module
    that registered nothing here, its reason in the last column."""
    rows = []
    for op in sorted(REGISTRY):
        for impl in sorted(REGISTRY[op].values(), key=lambda i: i.name):
            rows.append((impl.name, op, ",".join(impl.devices),
                         "all" if impl.formats is None else ",".join(impl.formats),
                         ",".join(impl.platforms), ",".join(impl.model_dtypes),
                         ",".join(impl.shape_classes), _why_not_here(impl, device)))
    for module, reason in sorted(UNAVAILABLE.items()):
        rows.append((module, "-", "-", "-", "-", "-", "-", f"not loaded: {reason}"))
    return rows


def table(device: str) -> str:
    """``table_rows`` as a Markdown table."""
    lines = ["| " + " | ".join(_COLUMNS) + " |", "|" + "---|" * len(_COLUMNS)]
    lines += ["| " + " | ".join(r) + " |" for r in table_rows(device)]
    return "\n".join(lines)
