"""The one-way layers of the package (.importlinter): benchmarks > oracle.tools >
oracle.impls > (kernels | oracle.core, independent of each other) > reference, checked by
import-linter over every import, function-local ones included; and no import-time side
effects where entry points are meant to decide (``import kernels``)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CONTRACTS = ROOT / ".importlinter"
LINT_IMPORTS = Path(sys.executable).parent / "lint-imports"


def lint_imports(root: Path) -> subprocess.CompletedProcess:
    """The repository's contracts checked over the packages under ``root`` (no cache
    written)."""
    env = dict(os.environ, PYTHONPATH=str(root))
    return subprocess.run([str(LINT_IMPORTS), "--no-cache", "--no-logo", str(CONTRACTS)],
                          cwd=root, env=env, capture_output=True, text=True, timeout=300)


def broken_contracts(result: subprocess.CompletedProcess) -> str:
    """The report's broken-contract section (empty when every contract is kept)."""
    out = result.stdout + result.stderr
    return out[out.index("Broken contracts"):] if "Broken contracts" in out else ""


def test_the_packages_keep_every_import_contract():
    """Every import in reference/, kernels/, oracle/ and benchmarks/ (module-level or
    inside a function) points down the layers; a failure lists each broken contract and
    the imports that break it."""
    result = lint_imports(ROOT)
    assert result.returncode == 0, broken_contracts(result) or result.stdout + result.stderr
    assert "0 broken" in result.stdout


def _tree(root: Path, files: dict[str, str]) -> None:
    packages = ("reference", "kernels", "oracle", "oracle/core", "oracle/impls",
                "oracle/tools", "benchmarks")
    for pkg in packages:
        (root / pkg).mkdir(parents=True, exist_ok=True)
        (root / pkg / "__init__.py").write_text("")
    for name, src in files.items():
        (root / name).write_text(textwrap.dedent(src))


def test_the_contracts_report_an_upward_import_inside_a_function(tmp_path):
    """The same contracts over a throwaway tree whose kernel imports the oracle's registry
    inside a function (the way a hidden cycle looks) and whose core imports a kernel: both
    imports are reported broken, by module and line."""
    _tree(tmp_path, {
        "reference/codec.py": "X = 1\n",
        "oracle/core/registry.py": "from reference import codec\n\nfrom kernels import ops\n",
        "kernels/ops.py": """\
            from reference import codec


            def register():
                from oracle.core.registry import codec as c
                return c
            """,
    })
    result = lint_imports(tmp_path)
    report = broken_contracts(result)
    assert result.returncode != 0 and report, result.stdout + result.stderr
    assert "kernels is not allowed to import oracle.core" in report
    assert "kernels.ops -> oracle.core.registry (l.5)" in report
    assert "oracle.core is not allowed to import kernels" in report
    assert "oracle.core.registry -> kernels.ops (l.3)" in report


def test_importing_kernels_leaves_the_interpreter_setting_alone():
    """``import kernels`` sets nothing: TRITON_INTERPRET stays unset until an entry point
    calls ``kernels.use_interpreter_without_gpu()``, which sets it on a machine without a
    CUDA device and keeps an explicit value."""
    code = textwrap.dedent("""
        import os
        import kernels
        before = os.environ.get("TRITON_INTERPRET")
        kernels.use_interpreter_without_gpu()
        after = os.environ.get("TRITON_INTERPRET")
        os.environ["TRITON_INTERPRET"] = "0"
        kernels.use_interpreter_without_gpu()
        print(before, after, kernels._cuda_available(), os.environ["TRITON_INTERPRET"])
    """)
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = str(ROOT)
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                         text=True, timeout=300, check=True).stdout.split()
    before, after, cuda, explicit = out
    assert before == "None"
    assert after == ("None" if cuda == "True" else "1")
    assert explicit == "0"
