"""The implementation registry: op -> every implementation of it, with its capabilities and
its declared numerics. Tests and reports iterate over the registry; they never name kernels.

An implementation is a function ``run(inputs) -> outputs`` over the numpy input set of a case
(``oracle.core.cases.make_inputs``); it moves data to its device itself and returns numpy.
Outputs, per op (rounded outputs as *codes* of their format, so comparisons are exact):

  norm_rope_insert   q [N,Hq,D], k [N,Hkv,D], index_k [N,D] (model-dtype codes), index_q
                     [N,Hi,D] (codes in the index cache's format), kv_cache and index_cache
                     (logical views of the caches after the call)
  reshape_and_cache  kv_cache
  indexer_*          topk int32 [Hi,T,K]
  attention_*        out [T,Hq,D] (model-dtype codes)

Declared numerics: ``arith`` (fp32 special-function errors and the attention output's
normalisation, ``oracle.core.bounds.Fp32Arith``, or a callable ``(case) -> Fp32Arith`` where
they depend on the case's inputs: ``arith_for``);
``schedule`` (attention: where it rounds, a ``reference.attention.Schedule``, or a callable
``(model_dtype, case)`` returning one, ``case`` being the case's inputs or None: an
implementation whose rounding depends on the cache format or the kind of scales says so
there; ``schedule_for``; or a tuple of them, one per kind of row the implementation computes
differently, its outputs then naming each (token, head) row's in ``schedule_rows``, int
``[T, Hq]`` indices into the tuple, absent: all 0: ``oracle.core.checks.scheduled_reference``);
``score_rel``
(relative error of its dot products beyond IEEE fp32 summation, relative to the sum of the
terms' magnitudes: tensor-core accumulation, ``oracle.core.bounds.TENSOR_CORE_DOT_REL`` for
16-bit operands, more for fp8 MMA; the indexer's block scores, attention's ``q . K`` and
(per tile of keys) ``P @ V``; a float, or a callable ``(case) -> float`` where it depends
on the index format: ``score_rel_for``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from oracle.core.bounds import Fp32Arith
from reference.platforms import PLATFORMS


def schedule_for(impl, model_dtype: str, case: dict | None = None):
    """The rounding schedule an implementation declares for a model dtype and, where it
    depends on them, a case's inputs (plain ``Schedule`` entries as is)."""
    s = impl.schedule
    return s(model_dtype, case) if callable(s) else s


def arith_for(impl, case: dict | None = None) -> Fp32Arith:
    """The fp32 arithmetic an implementation declares for a case's inputs (a plain
    ``Fp32Arith`` as is)."""
    a = impl.arith
    return a(case) if callable(a) else a


def score_rel_for(impl, case: dict | None = None) -> float:
    """The block-score error an indexer implementation declares for a case's inputs (plain
    floats as is)."""
    r = impl.score_rel
    return float(r(case) if callable(r) else r)


@dataclass(frozen=True)
class Implementation:
    name: str
    op: str
    run: Callable[[dict], dict]
    devices: tuple[str, ...] = ("cpu",)
    platforms: tuple[str, ...] = PLATFORMS
    formats: tuple[str, ...] | None = None  # storage formats it handles; None: all
    model_dtypes: tuple[str, ...] = ("bfloat16", "float16")
    shape_classes: tuple[str, ...] = ("tiny", "small", "model")
    arith: object = field(default_factory=Fp32Arith)  # or (case) -> Fp32Arith
    schedule: object = None
    score_rel: object = 0.0
    quantize_from: str = "value"
    notes: str = ""

    @property
    def needs_cuda(self) -> bool:
        return "cpu" not in self.devices

    def supports(self, case) -> tuple[bool, str]:
        """Whether this implementation claims the case, and if not, why."""
        if case.platform not in self.platforms:
            return False, f"platform {case.platform}"
        fmt = case.kv_fmt if not case.op.startswith("indexer") else case.index_fmt
        if self.formats is not None and fmt not in self.formats:
            return False, f"format {fmt}"
        if case.model_dtype not in self.model_dtypes:
            return False, f"model dtype {case.model_dtype}"
        if case.shape_class not in self.shape_classes:
            return False, f"shape class {case.shape_class}"
        return True, ""


REGISTRY: dict[str, dict[str, Implementation]] = {}


def register(impl: Implementation) -> Implementation:
    """Add ``impl`` under its op and name (the same name again replaces it: registering
    twice adds nothing)."""
    REGISTRY.setdefault(impl.op, {})[impl.name] = impl
    return impl


def implementations(op: str, names=None, device: str | None = None) -> list[Implementation]:
    """Registered implementations of an op, optionally only the named ones or those that
    run on a device (entry points register them first: ``oracle.impls.catalog.load_all``)."""
    if not REGISTRY:  # a new entry point that forgot to load: say so, not "must be among []"
        raise RuntimeError("no implementation is registered: call "
                           "oracle.impls.catalog.load_all() first")
    found = list(REGISTRY.get(op, {}).values())
    if names:
        unknown = set(names) - {i.name for impls in REGISTRY.values() for i in impls.values()}
        if unknown:
            raise ValueError(f"impls must be among {sorted(known_names())}, got {sorted(unknown)}")
        found = [i for i in found if i.name in names]
    if device is not None:
        found = [i for i in found if device in i.devices]
    return found


def known_names() -> set[str]:
    """The names of every registered implementation, of any op."""
    return {i.name for impls in REGISTRY.values() for i in impls.values()}
