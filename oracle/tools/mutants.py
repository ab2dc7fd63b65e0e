"""Mutants: realistic bugs (shared/contract.md section 8) applied to the project's real kernels,
and the kill matrix that shows which part of the standard budget catches each.

A ``Mutant`` names the registered implementation it corrupts (``base``: e.g. the Triton
``attention_decode``), the bug class, and the real incident it models, and builds the
corrupted ``run`` in one of two ways:

- ``wrap_inputs(fn)`` / ``wrap_outputs(fn)``: the real kernel called with corrupted
  arguments (a scale dropped, a format string swapped, a top-k buffer transposed) or its
  outputs corrupted the way a caller would (a stray write). ``fn`` gets a shallow copy of
  the input dict and must copy any array it changes (the oracle checks that inputs stay
  untouched).
- ``patch(module, (old, new), ...)``: a copy of the kernel's source with textual
  replacements, written to a temporary file and imported under a new name (Triton reads a
  kernel's source through ``inspect``, so the copy must live in a file). Each ``old`` must
  occur exactly once: a kernel refactor that removes the pattern fails the mutant's build
  loudly (``MutantError``) instead of silently testing the unmutated kernel. ``deps``
  patches a module the kernel imports from (``kernels._attention``, ``kernels.fp8``) and
  points the copy's imports at the patched dependency. The copy's launcher runs through
  the kernel's own adapter (``oracle.impls.triton.ADAPTERS``).

The mutated implementation keeps everything the base declares (schedule, ``score_rel``,
claims), so the oracle judges it exactly as it judges the real kernel.

Kill matrix (``kill_matrix``; ``python -m oracle mutants``): for each mutant and each test
class of the standard budget (the differential test's cases of the mutant's op, by shape
class: ``tiny``, ``small`` and, on CUDA, ``model``, ``sweep``, ``long``; then ``fuzz``, a
hypothesis search of the same op), the cases run until the first failing check and the
seconds it took; a mutant no class kills is a hole in the suite.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import importlib.util
import re
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from oracle.core.cases import SHAPE_CLASSES, make_inputs
from oracle.core.checks import run_check
from oracle.core.registry import Implementation, implementations

CPU_CLASSES = ("tiny", "small")
GPU_CLASSES = ("large", "model", "sweep", "long")  # cheapest first: large is 3 tiny cases
LARGE_CASES = 3  # tiny cases run behind a 2^31-element prefix in the ``large`` class


class MutantError(RuntimeError):
    """A mutant that cannot be built (its patch no longer matches the kernel)."""


@dataclass(frozen=True)
class Mutant:
    name: str
    op: str
    base: str  # the registered implementation it corrupts
    bug: str  # the bug class of contract.md section 8
    incident: str  # one line: the real-world incident it models
    build: Callable[[Implementation], Callable[[dict], dict]]  # base -> corrupted run
    gpu_only: bool = False  # only a CUDA run can show it (e.g. 64-bit offsets)

    def implementation(self, device: str | None = None) -> Implementation:
        """The corrupted implementation, declaring what its base declares."""
        found = implementations(self.op, [self.base], device)
        if not found:
            raise MutantError(f"mutant {self.name}: no implementation {self.base!r} of "
                              f"{self.op} runs on {device or 'this machine'}")
        base = found[0]
        return dataclasses.replace(base, name=f"mutant:{self.name}", run=self.build(base))


# ------------------------------------------------------------------------------- builders


def wrap_inputs(fn: Callable[[dict], dict]):
    """The base kernel called on ``fn(copy of the inputs)``."""
    def build(base: Implementation):
        return lambda x: base.run(fn(dict(x)))
    return build


def wrap_outputs(fn: Callable[[dict, dict], dict]):
    """The base kernel's outputs passed through ``fn(inputs, outputs)``."""
    def build(base: Implementation):
        return lambda x: fn(x, base.run(x))
    return build


def patch(module: str, *replacements: tuple[str, str],
          deps: dict[str, tuple[tuple[str, str], ...]] | None = None):
    """The adapter of a patched copy of the kernel module ``module`` (module docstring)."""
    frozen = tuple(replacements)
    frozen_deps = tuple(sorted((deps or {}).items()))

    def build(base: Implementation):
        return adapter_of(module, patched_module(module, frozen, frozen_deps))
    return build


def adapter_of(module: str, copy):
    """The registered adapter of kernel module ``module`` built on its patched ``copy``."""
    from oracle.impls.triton import ADAPTERS  # imports every kernel: only once one is built

    return ADAPTERS[module](copy)


_DIR: list[Path] = []


def _module_dir() -> Path:
    if not _DIR:
        _DIR.append(Path(tempfile.mkdtemp(prefix="oracle-mutants-")))
        sys.path.insert(0, str(_DIR[0]))
    return _DIR[0]


@functools.cache
def patched_module(module: str, replacements: tuple[tuple[str, str], ...],
                   deps: tuple[tuple[str, tuple[tuple[str, str], ...]], ...] = ()):
    """A copy of ``module`` with each ``(old, new)`` applied (each ``old`` exactly once),
    its dependencies in ``deps`` patched likewise and imported from their copies."""
    spec = importlib.util.find_spec(module)
    if spec is None or spec.origin is None:
        raise MutantError(f"no module {module!r} to patch")
    src = Path(spec.origin).read_text()
    for dep, dep_repl in deps:
        copy = patched_module(dep, dep_repl).__name__
        pattern = re.compile(rf"^(\s*from ){re.escape(dep)}( import )", re.M)
        src, n = pattern.subn(rf"\g<1>{copy}\g<2>", src)
        if n == 0:
            raise MutantError(f"{module} does not import from {dep}: cannot patch it")
    for old, new in replacements:
        n = src.count(old)
        if n != 1:
            raise MutantError(f"{module}: the pattern {old!r} occurs {n} times, not once "
                              f"(the kernel changed: update the mutant)")
        src = src.replace(old, new)
    key = hashlib.sha256(repr((module, replacements, deps)).encode()).hexdigest()[:12]
    name = f"{module.replace('.', '_')}__mutant_{key}"
    path = _module_dir() / f"{name}.py"
    path.write_text(src)
    mod_spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(mod_spec)
    sys.modules[name] = mod
    mod_spec.loader.exec_module(mod)
    return mod


# --------------------------------------------------------------------------- the catalog

#: Every mutant, by name (``register``; the catalog modules fill it on import).
CATALOG: dict[str, Mutant] = {}
CATALOG_MODULES = ("oracle.tools.mutants_insert", "oracle.tools.mutants_sparse")


def register(m: Mutant) -> Mutant:
    if m.name in CATALOG:
        raise ValueError(f"mutant {m.name!r} registered twice")
    CATALOG[m.name] = m
    return m


def catalog() -> dict[str, Mutant]:
    for name in CATALOG_MODULES:
        if importlib.util.find_spec(name) is not None:
            importlib.import_module(name)
    return CATALOG


# ---------------------------------------------------------------------------- kill matrix


def class_cases(op: str, test_class: str, gpu: bool) -> list:
    """The standard budget's cases of ``op`` in one shape class (the differential test's);
    ``large``: the first tiny ones, run with the caches past 2^31 elements."""
    from oracle.core.report import differential_cases

    shape_class = "tiny" if test_class == "large" else test_class
    cases = [c for c in differential_cases(op, gpu=gpu) if c.shape_class == shape_class]
    return cases[:LARGE_CASES] if test_class == "large" else cases


def first_kill(impl: Implementation, cases, limit_s: float | None = None) -> dict:
    """Run ``impl`` on the cases it claims, in order, until a check fails. Returns the
    cases run, the seconds, and the killing case and its first failure line (or None)."""
    t0 = time.perf_counter()
    run = 0
    for case in cases:
        if not impl.supports(case)[0]:
            continue
        if limit_s is not None and time.perf_counter() - t0 > limit_s:
            break
        run += 1
        r = run_check(case, impl, make_inputs(case))
        if not r.passed:
            return {"killed": True, "cases": run, "seconds": time.perf_counter() - t0,
                    "case": case.id, "why": r.summary().splitlines()[0][:300],
                    "replay": r.replay}
    return {"killed": False, "cases": run, "seconds": time.perf_counter() - t0}


def fuzz_kill(impl: Implementation, seconds: float, shape_classes=CPU_CLASSES,
              device: str = "cpu") -> dict:
    """A hypothesis search of the mutant's op (``oracle.tools.fuzz``), the mutant registered as
    the only implementation checked, for at most ``seconds``."""
    from oracle.core import registry
    from oracle.tools import fuzz

    t0 = time.perf_counter()
    registry.register(impl)
    try:
        with tempfile.TemporaryDirectory() as out:
            stats = fuzz.run_stats(seconds, [impl.op], [impl.name], Path(out), device,
                                   db=None, progress=False, shape_classes=shape_classes,
                                   shrink=False)
    finally:
        registry.REGISTRY[impl.op].pop(impl.name, None)
    f = stats["failure"]
    row = {"killed": f is not None, "cases": stats["cases"],
           "seconds": time.perf_counter() - t0}
    if f:
        row.update(case=f["case"], why=f.get("summary", "").splitlines()[0][:300]
                   if f.get("summary") else "", replay=f["replay"])
    return row


def kill_matrix(mutants, gpu: bool = False, fuzz_seconds: float = 60.0,
                full: bool = False, progress=print, partial=None) -> dict:
    """Each mutant against the test classes in order (``CPU_CLASSES``, on CUDA also
    ``GPU_CLASSES``, then ``fuzz``), each class run to its first kill; a mutant stops at
    its first killing class unless ``full``; ``partial(doc)`` receives the report after
    each mutant (a run cut short still leaves its rows). The ``large`` class (CUDA) runs
    the tiny cases with every cache behind a prefix past 2^31 elements (``oracle.tools.large``),
    where 32-bit offsets wrap. The mutants that only CUDA shows run last (a wrapped offset
    may fault and leave the process's CUDA context unusable), ``GPU_CLASSES`` first: their
    bug cannot show in the CPU classes, which on CUDA cost a compile per case."""
    from oracle.core.report import machine_info
    from oracle.tools.large import behind_large_prefix

    machine = machine_info()
    mutants = sorted(mutants, key=lambda m: m.gpu_only)
    classes = [*CPU_CLASSES, *(GPU_CLASSES if gpu else ()), "fuzz"]
    device = "cuda" if gpu else "cpu"
    rows, t0 = [], time.perf_counter()
    for m in mutants:
        rows.append(_kill_row(m, classes, gpu, device, fuzz_seconds, full, progress,
                              behind_large_prefix))
        if partial is not None:
            partial(_matrix_doc(rows, [m.name for m in mutants], machine, device, classes,
                                fuzz_seconds, full, t0))
    return _matrix_doc(rows, [m.name for m in mutants], machine, device, classes, fuzz_seconds,
                       full, t0)


def _kill_row(m, classes, gpu, device, fuzz_seconds, full, progress, large) -> dict:
    """One mutant through the classes in order (``kill_matrix``)."""
    row = {"mutant": m.name, "op": m.op, "base": m.base, "bug": m.bug,
           "incident": m.incident, "classes": {}}
    if m.gpu_only and not gpu:
        return dict(row, skipped="shows only on CUDA")
    try:
        impl = m.implementation(device)
    except MutantError as e:
        return dict(row, error=str(e))
    if m.gpu_only:  # its bug shows only where CUDA's classes reach (past 2^31 elements)
        classes = [c for c in classes if c in GPU_CLASSES] + \
            [c for c in classes if c not in GPU_CLASSES]
    for cls in classes:
        if cls == "fuzz":
            shapes = [c for c in classes if c in SHAPE_CLASSES]
            res = fuzz_kill(impl, fuzz_seconds, tuple(shapes), device)
        elif cls == "large":
            res = first_kill(large(impl), class_cases(m.op, cls, gpu))
        else:
            res = first_kill(impl, class_cases(m.op, cls, gpu))
        row["classes"][cls] = res
        progress(f"{m.name} [{cls}]: {'killed' if res['killed'] else 'survived'} after "
                 f"{res['cases']} cases, {res['seconds']:.1f} s")
        if res["killed"] and not full:
            break
    row["killed"] = any(r["killed"] for r in row["classes"].values())
    return row


def _matrix_doc(rows, planned, machine, device, classes, fuzz_seconds, full, t0) -> dict:
    ran = {r["mutant"] for r in rows}
    return {"schema": "mutants/1", "machine": machine, "device": device,
            "planned": len(planned), "not_run": [n for n in planned if n not in ran],
            "classes": classes, "fuzz_seconds": fuzz_seconds, "full": full,
            "seconds": round(time.perf_counter() - t0, 2), "mutants": rows,
            "killed": sum(bool(r.get("killed")) for r in rows),
            "survivors": [r["mutant"] for r in rows if r.get("killed") is False],
            "errors": [r["mutant"] for r in rows if "error" in r],
            "skipped": [r["mutant"] for r in rows if "skipped" in r]}


def merge(docs: list[dict], planned: list[str]) -> dict:
    """One kill matrix from several runs' reports (a catalog split over device calls):
    each mutant's row from the last report holding it, seconds summed, ``planned`` the
    catalog's names (the Markdown names those no run reached); the last report's class
    order."""
    rows: dict = {}
    for d in docs:
        if d.get("schema") != "mutants/1" or d.get("device") != docs[0].get("device"):
            raise ValueError("merge takes mutants/1 reports of one device, got "
                             f"{d.get('schema')!r} on {d.get('device')!r}")
        rows.update((r["mutant"], r) for r in d["mutants"])
    doc = _matrix_doc(list(rows.values()), planned, docs[0]["machine"], docs[0]["device"],
                      docs[-1]["classes"] + [c for d in docs for c in d["classes"]
                                             if c not in docs[-1]["classes"]],
                      docs[0]["fuzz_seconds"],
                      any(d["full"] for d in docs), time.perf_counter())
    doc["seconds"] = round(sum(d["seconds"] for d in docs), 2)
    doc["merged_from"] = len(docs)
    return doc


def _cut_short(doc: dict) -> str:
    left = doc.get("not_run") or []
    return f"; cut short, not run: {', '.join(left)}" if left else ""


def markdown(doc: dict) -> str:
    """The kill matrix: per mutant and test class, cases and seconds to the first kill."""
    classes = doc["classes"]
    lines = [f"# Mutant kill matrix ({doc['device']}, {doc['machine'].get('device')})", "",
             f"{doc['killed']} of {len(doc['mutants'])} mutants killed in {doc['seconds']} s"
             f"; survivors: {', '.join(doc['survivors']) or 'none'}; not built: "
             f"{', '.join(doc['errors']) or 'none'}; left to CUDA: "
             f"{', '.join(doc['skipped']) or 'none'}"
             f"{_cut_short(doc)}. A cell: cases run to the first "
             f"failing check / seconds (x = killed there, - = survived it, blank = not run"
             f": a mutant stops at its first kill).", "",
             "| mutant | op | bug | " + " | ".join(classes) + " |",
             "|---|---|---|" + "---|" * len(classes)]
    for r in doc["mutants"]:
        cells = []
        for c in classes:
            res = r["classes"].get(c)
            cells.append("" if res is None else
                         f"{'x' if res['killed'] else '-'} {res['cases']} / "
                         f"{res['seconds']:.1f} s")
        lines.append(f"| {r['mutant']} | {r['op']} | {r['bug']} | " + " | ".join(cells) + " |")
    lines += ["", "| mutant | incident it models | killing case |", "|---|---|---|"]
    for r in doc["mutants"]:
        kill = next((res for res in r["classes"].values() if res["killed"]), None)
        why = r.get("error") or r.get("skipped") or (kill and f"`{kill['case']}`") or "-"
        lines.append(f"| {r['mutant']} | {r['incident']} | {why} |")
    return "\n".join(lines) + "\n"
