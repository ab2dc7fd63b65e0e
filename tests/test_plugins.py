"""External implementations through ``$ORACLE_PLUGINS`` (oracle/impls/catalog.py): a module
the user names registers its kernels and the oracle judges them like the project's own."""

from __future__ import annotations

import textwrap

import pytest

from oracle.core import registry
from oracle.core.cases import Case
from oracle.core.checks import run_check
from oracle.impls import catalog
from tests.helpers import plugins_registered

# A user's module: an "external kernel" for attention_decode (here the reference's float64
# attention rounded to the model dtype, or a broken copy that drops the last selected block)
# with the schedule it declares.
PLUGIN = textwrap.dedent("""
    import numpy as np
    from oracle.core.reference_run import attention_call, model_codes
    from oracle.core.registry import Implementation, register
    from reference.attention import exact

    def run(x):
        return {"out": model_codes(attention_call(x, schedule=exact()), x["model_dtype"])}

    def run_broken(x):
        topk = np.array(x["topk"], copy=True)
        topk[..., -1] = -1  # forgets one selected block per row
        return {"out": model_codes(attention_call(x, schedule=exact(), topk=topk),
                                   x["model_dtype"])}

    for name, fn in (("plugin_exact", run), ("plugin_broken", run_broken)):
        register(Implementation(name, "attention_decode", fn, devices=("cpu", "cuda"),
                                shape_classes=("tiny",),
                                schedule=lambda md, case=None: exact(md)))
""")


@pytest.fixture
def plugin_registry(tmp_path, monkeypatch):
    """The registry loaded with $ORACLE_PLUGINS naming a module in tmp_path; the project's
    registry is restored afterwards."""
    (tmp_path / "my_kernels.py").write_text(PLUGIN)
    monkeypatch.syspath_prepend(str(tmp_path))
    with plugins_registered(" my_kernels , ") as reg:
        yield reg


def test_a_plugin_is_registered_and_judged_like_the_projects_kernels(plugin_registry):
    """The modules named by $ORACLE_PLUGINS register next to the project's kernels; the
    oracle passes the plugin that computes the op and fails the one that drops a block."""
    impls = {i.name: i for i in plugin_registry.implementations("attention_decode")}
    assert {"plugin_exact", "plugin_broken", "reference"} <= set(impls)
    case = Case("attention_decode", "tiny", "normal", "cuda", "fp8", "bfloat16", "tensor", 3)
    assert run_check(case, impls["plugin_exact"]).passed
    assert not run_check(case, impls["plugin_broken"]).passed


def test_a_plugin_that_does_not_import_is_an_error_naming_it(tmp_path, monkeypatch):
    """A named module that cannot be imported raises ImportError naming $ORACLE_PLUGINS and
    the module (never a silent skip: its kernels would go unchecked)."""
    monkeypatch.setenv(catalog.PLUGINS_ENV, "no_such_kernels_module")
    with pytest.raises(ImportError, match=r"ORACLE_PLUGINS: module 'no_such_kernels_module'"):
        catalog.load_all()


def test_loading_twice_registers_nothing_twice(plugin_registry):
    """A second ``load_all`` (entry points and workers may each call it) leaves the registry
    as the first left it: the same implementation objects, none added, none dropped."""
    before = {op: dict(impls) for op, impls in plugin_registry.REGISTRY.items()}
    catalog.load_all()
    after = {op: dict(impls) for op, impls in plugin_registry.REGISTRY.items()}
    assert after.keys() == before.keys()
    for op, impls in before.items():
        assert after[op].keys() == impls.keys()
        assert all(after[op][name] is impl for name, impl in impls.items())


def test_a_project_module_that_cannot_load_is_recorded_with_its_reason(monkeypatch):
    """A project module whose import fails on this machine (a missing package) registers
    nothing and is named in ``UNAVAILABLE`` with the missing package: never dropped
    silently. ``python -m oracle impls`` lists it with that reason."""
    monkeypatch.setattr(catalog, "MODULES", catalog.MODULES + ("no_such_impls_module",))
    monkeypatch.setattr(catalog, "UNAVAILABLE", dict(catalog.UNAVAILABLE))
    before = {op: dict(impls) for op, impls in registry.REGISTRY.items()}
    unavailable = catalog.load_all()
    assert unavailable["no_such_impls_module"].startswith("no_such_impls_module not importable")
    assert {op: dict(i) for op, i in registry.REGISTRY.items()} == before
    row = [r for r in catalog.table_rows("cpu") if r[0] == "no_such_impls_module"]
    assert row and row[0][-1].startswith("not loaded: no_such_impls_module not importable")
