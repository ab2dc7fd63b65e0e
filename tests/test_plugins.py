"""External implementations through ``$ORACLE_PLUGINS`` (oracle/core/registry.py): a module the
user names registers its kernels and the oracle judges them like the project's own."""

from __future__ import annotations

import sys
import textwrap

import pytest

from oracle.core import registry
from oracle.core.cases import Case
from oracle.core.checks import run_check

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
    """A fresh registry loaded with $ORACLE_PLUGINS naming a module in tmp_path; the
    project's registry is restored afterwards."""
    (tmp_path / "my_kernels.py").write_text(PLUGIN)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setenv(registry.PLUGINS_ENV, " my_kernels , ")
    registry.load_all()  # the project's implementations first: restored as they are
    saved = {op: dict(impls) for op, impls in registry.REGISTRY.items()}
    monkeypatch.setattr(registry, "_LOADED", False)
    yield registry
    registry.REGISTRY.clear()
    registry.REGISTRY.update(saved)
    sys.modules.pop("my_kernels", None)


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
    monkeypatch.setenv(registry.PLUGINS_ENV, "no_such_kernels_module")
    monkeypatch.setattr(registry, "_LOADED", False)
    with pytest.raises(ImportError, match=r"ORACLE_PLUGINS: module 'no_such_kernels_module'"):
        registry.load_all()
