"""Every compiled kernel's JIT cache key (its source hash, part of each compile's disk-cache
key) is the same in every process, whatever kernels the process met first: otherwise each
pytest-xdist worker keys a kernel by its own history, and a warm run rebuilds kernels that
another worker of the cold run had cached. Kernels are decorated for the GPU in a
subprocess (TRITON_INTERPRET=0; hashing needs no GPU)."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

from oracle.impls.triton import KERNEL_MODULES
from tests.helpers import compile_env

ROOT = Path(__file__).resolve().parents[1]

# Imports the named modules in the given order and hashes their kernels in that order; prints
# each kernel's key and the constexpr globals (name, value) its key holds.
_KEYS = textwrap.dedent("""
    import importlib, json, sys
    from triton.language.core import constexpr
    from triton.runtime.jit import JITFunction
    keys, globals_ = {}, {}
    for name in sys.argv[1:]:
        module = importlib.import_module(name)
        for attr, fn in vars(module).items():
            if isinstance(fn, JITFunction) and fn.__module__ == name:
                keys[f"{name}.{attr}"] = fn.cache_key
                globals_[f"{name}.{attr}"] = sorted(
                    [n, repr(v.value)] for (n, _), (v, _) in fn.used_global_vals.items()
                    if isinstance(v, constexpr))
    print(json.dumps(dict(keys=keys, globals=globals_)))
""")


def _kernel_keys(modules, tmp_path) -> dict:
    r = subprocess.run([sys.executable, "-c", _KEYS, *modules], cwd=ROOT,
                       env=compile_env(tmp_path), capture_output=True, text=True)
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(r.stdout.splitlines()[-1])


def test_kernel_keys_do_not_depend_on_which_kernel_a_process_hashes_first(tmp_path):
    """Two processes hash the kernel modules in opposite orders (helpers shared across
    modules are then first hashed through different kernels) and get the same key for
    every kernel; on Triton 3.6 unpatched, the decode attention, prefill attention and
    decode indexer kernels differ."""
    modules = ("kernels.indexer_decode_flat", *KERNEL_MODULES)
    forward = _kernel_keys(modules, tmp_path)
    backward = _kernel_keys(modules[::-1], tmp_path)
    assert len(forward["keys"]) >= len(KERNEL_MODULES)
    differ = sorted(k for k in forward["keys"] if forward["keys"][k] != backward["keys"][k])
    assert not differ, f"keys depend on the hashing order: {differ}"


def test_no_kernel_key_holds_one_global_name_with_two_values(tmp_path):
    """Triton orders a key's constexpr globals by name, then by the address of the module
    dict holding them: one name bound to two values in two modules would order (and key)
    differently from process to process. A name a module re-exports (one value) is
    harmless; every kernel's names have one value each."""
    got = _kernel_keys(("kernels.indexer_decode_flat", *KERNEL_MODULES), tmp_path)
    assert any(got["globals"].values())
    clashes = {k: sorted({n for n, _ in pairs if len({v for m, v in pairs if m == n}) > 1})
               for k, pairs in got["globals"].items()}
    assert not any(clashes.values()), clashes
