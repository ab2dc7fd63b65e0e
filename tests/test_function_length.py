"""Functions small enough to read: no Python function of the repository outside a
``@triton.jit`` body is over 100 lines (a kernel body is one GPU program; a launcher is
split into validate / plan / launch)."""

from __future__ import annotations

import ast
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MAX_LINES = 100
SOURCES = ("reference", "kernels", "oracle", "benchmarks", "tests", "examples")


def _is_triton_kernel(fn: ast.FunctionDef | ast.AsyncFunctionDef) -> bool:
    return any(ast.unparse(d).startswith("triton.jit") for d in fn.decorator_list)


def long_functions(paths, root: Path) -> list[str]:
    """``path:line name (N lines)`` for each function over ``MAX_LINES`` lines, decorators
    excluded, that is not a Triton kernel."""
    found = []
    for path in paths:
        tree = ast.parse((root / path).read_text(), filename=str(path))
        for fn in ast.walk(tree):
            if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            lines = fn.end_lineno - fn.lineno + 1
            if lines > MAX_LINES and not _is_triton_kernel(fn):
                found.append(f"{path}:{fn.lineno} {fn.name} ({lines} lines)")
    return found


def test_no_function_outside_a_triton_kernel_is_over_100_lines():
    """Every Python file's functions, the Triton kernels' bodies aside, fit in
    ``MAX_LINES`` lines."""
    files = [p.relative_to(ROOT) for d in SOURCES for p in sorted((ROOT / d).rglob("*.py"))]
    assert len(files) > 100
    assert long_functions(files, ROOT) == []


def test_a_long_function_is_reported_and_a_long_kernel_is_not(tmp_path):
    """The check finds a 101-line function (nested in a class too) and passes a 150-line
    ``@triton.jit`` body and a 100-line function."""
    def body(n):
        return "".join(f"    x{i} = {i}\n" for i in range(n - 1))

    src = ("import triton\n\n\n@triton.jit(noinline=True)\ndef kernel():\n" + body(150)
           + "\n\ndef fits():\n" + body(100)
           + "\n\nclass C:\n" + textwrap.indent("def method():\n" + body(101), "    "))
    (tmp_path / "m.py").write_text(src)
    (found,) = long_functions(["m.py"], tmp_path)
    assert "method (101 lines)" in found
