"""One differential check: an implementation's outputs on a case against the reference, by
the op's tolerance model, summarised as a ``CheckResult``.

Only rigorous models decide pass/fail (``passed``):
- rounded outputs (bf16/fp16 values, fp8 codes): the rounding-interval oracle
  (``oracle.core.intervals``) with the fp32 error bound of ``oracle.core.bounds``; the fused
  insert's
  model-dtype K and fp8 K code jointly (one fp32 value must explain both);
- caches: every slot the op must not write is bit-identical to its input (the inputs are
  poisoned with NaN codes, so a stray write or a skipped slot shows);
- selections: set equality up to near-ties within the score-error bound
  (``reference.indexer.selection_admissible``);
- attention: the reference run with the implementation's own rounding schedule plus a
  rigorous bound on what is left (``oracle.core.attention_bound``).
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field, fields

import numpy as np

from oracle.core import refcache
from oracle.core import reference_run as ref_impl
from oracle.core.attention_bound import attention_bound
from oracle.core.bounds import gamma, norm_rope_bound
from oracle.core.cases import Case, input_hash
from oracle.core.inputsets import case_inputs
from oracle.core.intervals import classify, joint_value_exists, preimage, reference_ordinals
from oracle.core.registry import arith_for, implementations, schedule_for, score_rel_for
from reference import norm_rope
from reference.codec import decode, encode, get_format
from reference.indexer import IndexerResult
from reference.kv_cache import scale_at
from reference.platforms import is_fp8

ULP_BINS = (-3, -2, -1, 0, 1, 2, 3)  # signed distance from the nearest rounding; tails clipped


@dataclass
class Tally:
    """Statistics of one tensor's rounded outputs (merged across tensors of a case)."""

    elements: int = 0
    exact: int = 0  # equal to the nearest rounding of the exact value
    within_one: int = 0  # at most one ULP (one code) from it
    admissible_not_nearest: int = 0
    violations: int = 0
    width_1: int = 0  # admissible sets of a single code
    width_2: int = 0
    width_more: int = 0
    ulp_hist: dict = field(default_factory=lambda: {str(b): 0 for b in ULP_BINS})
    max_abs_err: float = 0.0
    max_rel_err: float = 0.0
    max_err_over_bound: float = 0.0  # least pre-rounding error explaining an output / bound
    sum_sq_err: float = 0.0
    worst: dict | None = None

    def add(self, name, got_codes, exact, bound, fmt, scale=None, ordinals=None):
        """``ordinals``: ``intervals.reference_ordinals`` of (exact, bound), from the cache."""
        c = classify(got_codes, exact, bound, fmt, scale, ordinals)
        ok, ulps, width = c["ok"].ravel(), c["ulps"].ravel(), c["width"].ravel()
        got = decode(got_codes, fmt).ravel()
        e = np.asarray(exact, dtype=np.float64).ravel()
        if scale is not None:
            got = got * np.broadcast_to(np.asarray(scale, np.float64), np.shape(exact)).ravel()
        b = np.broadcast_to(np.asarray(bound, np.float64), np.shape(exact)).ravel()
        finite = np.isfinite(e) & np.isfinite(got)
        with np.errstate(invalid="ignore"):
            err = np.where(finite, np.abs(got - e), np.where(ok, 0.0, np.inf))
        self.elements += ok.size
        self.exact += int(np.count_nonzero(ulps == 0))
        self.within_one += int(np.count_nonzero(np.abs(ulps) <= 1))
        self.admissible_not_nearest += int(np.count_nonzero(ok & (ulps != 0)))
        self.violations += int(np.count_nonzero(~ok))
        self.width_1 += int(np.count_nonzero(width == 1))
        self.width_2 += int(np.count_nonzero(width == 2))
        self.width_more += int(np.count_nonzero(width > 2))
        clipped = np.clip(ulps, ULP_BINS[0], ULP_BINS[-1])
        for v, n in zip(*np.unique(clipped, return_counts=True)):
            self.ulp_hist[str(int(v))] += int(n)
        if not ok.size:
            return
        self.max_abs_err = max(self.max_abs_err, float(err.max()))
        # The smallest pre-rounding error that yields this output (0 when the output is
        # the nearest rounding), over the bound: <= 1 exactly when admissible.
        lo, hi = preimage(got_codes, fmt, 1.0 if scale is None else scale)
        lo, hi = np.ravel(lo), np.ravel(hi)
        with np.errstate(divide="ignore", invalid="ignore"):
            need = np.maximum(0.0, np.maximum(lo - e, e - hi))
            over = np.where(finite, np.where(need == 0, 0.0, need / b), np.where(ok, 0.0, np.inf))
            rel = np.where(e != 0, err / np.abs(e), np.where(err == 0, 0.0, np.inf))
        self.max_rel_err = max(self.max_rel_err, float(rel.max()))
        self.sum_sq_err += float(np.sum(np.where(np.isfinite(err), err, 0.0) ** 2))
        # The worst element: a violation if any, else the largest error/bound.
        key = np.where(ok, np.nan_to_num(over, posinf=1e300), 1e308)
        i = int(np.argmax(key))
        if self.worst is None or key[i] > self.worst["key"]:
            self.worst = {"tensor": name, "index": np.unravel_index(i, np.shape(exact)),
                          "got": float(got[i]), "exact": float(e[i]), "bound": float(b[i]),
                          "ulps": int(ulps[i]), "key": float(key[i])}
        if np.any(ok):
            self.max_err_over_bound = max(self.max_err_over_bound, float(np.max(over[ok])))


@dataclass
class CheckResult:
    op: str
    impl: str
    case: str
    input_hash: str
    passed: bool
    replay: str
    seconds: float
    tally: Tally
    failures: list = field(default_factory=list)  # non-numeric failures, one line each
    extra: dict = field(default_factory=dict)  # op-specific statistics

    @property
    def rmse(self) -> float:
        n = max(self.tally.elements, 1)
        return float(np.sqrt(self.tally.sum_sq_err / n))

    def as_dict(self) -> dict:
        d = asdict(self)
        d["rmse"] = self.rmse
        if d["tally"]["worst"] is not None:
            d["tally"]["worst"]["index"] = [int(i) for i in d["tally"]["worst"]["index"]]
        return d

    @classmethod
    def from_dict(cls, d: dict) -> CheckResult:
        """The inverse of ``as_dict`` (the suite report rebuilds its cells from it)."""
        fields_ = {k: v for k, v in d.items() if k not in ("tally", "rmse")}
        return cls(**fields_, tally=Tally(**d["tally"]))

    def summary(self) -> str:
        t = self.tally
        verdict = "PASS" if self.passed else "FAIL"
        head = (f"{verdict} {self.op} [{self.impl}] {self.case} ({_storage(self.case)}): "
                f"{t.elements} elements, {t.violations} violations, max err/bound "
                f"{t.max_err_over_bound:.3g}")
        lines = [head, *self.failures]
        if t.violations and t.worst:
            lines.append(f"worst: {t.worst}")
        if not self.passed:
            lines.append(f"replay: {self.replay}")
        return "\n".join(lines)


# --------------------------------------------------------------------------- helpers


def _storage(case_id: str) -> str:
    """The storage format a case's cache holds, named in every verdict: the case id says
    only ``fp8`` and the platform, and a kernel that reads the wrong format fails there."""
    case = Case.from_id(case_id)
    return f"storage format {case.index_fmt if case.op.startswith('indexer') else case.kv_fmt}"


def written_slots(slot_mapping) -> np.ndarray:
    s = np.asarray(slot_mapping, dtype=np.int64)
    return s[s >= 0]


def untouched_failures(name, before, after, slots, page) -> list[str]:
    """Everything but the written slots must be bit-identical (NaN codes included)."""
    if after.shape != before.shape:
        return [f"{name}: shape {after.shape} != {before.shape}"]
    mask = np.ones(before.shape, bool)
    if before.ndim == 4:  # [num_pages, Hkv, P, 2D]
        mask[slots // page, :, slots % page] = False
    else:  # [num_pages, P, D]
        mask[slots // page, slots % page] = False
    changed = np.count_nonzero((np.asarray(after) != np.asarray(before)) & mask)
    return [f"{name}: {changed} codes outside the written slots changed"] if changed else []


def _scale_columns(scale, head, slots):
    return None if scale is None else np.reshape(scale_at(scale, head, slots), (-1, 1))


# ------------------------------------------------------------------------------ ops


def norm_rope_reference(x, arith) -> dict[str, np.ndarray]:
    """Per output kind of the fused insert: the exact normed and rotated rows
    (``<kind>.exact``), their bound under ``arith`` (``<kind>.bound``) and the admissible
    codes' ordinals in the kind's output format (``<kind>.nearest``, ``.lo``, ``.hi``)."""
    layout = ref_impl.layout_of(x)
    weights = ref_impl.weights_of(x)
    r, eps = x["rotary_dim"], x["eps"]
    parts = layout.split(x["rows"])
    cos_sin = x["rope_table"][np.asarray(x["positions"])]
    got = {}
    for kind in norm_rope.KINDS:
        if kind not in parts:
            continue
        cs = cos_sin if kind == "index_k" else cos_sin[:, None, :]
        w = weights[kind]
        exact = norm_rope.apply_rope_neox(
            norm_rope.rms_norm_gemma(parts[kind], w, eps), x["positions"],
            x["rope_table"], r)
        bound = norm_rope_bound(parts[kind], w, eps, cs, r, arith)
        got[f"{kind}.exact"], got[f"{kind}.bound"] = exact, bound
        for k, v in reference_ordinals(exact, bound, _norm_rope_format(x, kind)).items():
            got[f"{kind}.{k}"] = v
    return got


def _norm_rope_format(x, kind) -> str:
    """The format an output kind is rounded to: the model dtype, or index_q's fp8."""
    if kind == "index_q" and x["index_fmt"] is not None and is_fp8(x["index_fmt"]):
        return x["index_fmt"]
    return x["model_dtype"]


def check_norm_rope_insert(x, out, impl) -> tuple[Tally, list, dict]:
    arith = arith_for(impl, x)
    ref = _cached("norm_rope", x, arith, lambda: norm_rope_reference(x, arith))
    kinds = [k for k in norm_rope.KINDS if f"{k}.exact" in ref]
    exact = {k: ref[f"{k}.exact"] for k in kinds}
    bounds = {k: ref[f"{k}.bound"] for k in kinds}
    t, failures = Tally(), []
    for kind in kinds:
        if kind not in out:
            failures.append(f"output {kind} missing")
            continue
        t.add(kind, out[kind], exact[kind], bounds[kind], _norm_rope_format(x, kind),
              ordinals={k: ref[f"{kind}.{k}"] for k in ("nearest", "lo", "hi")})
    slots = written_slots(x["slot_mapping"])
    page = x["kv_cache"].shape[2]
    failures += untouched_failures("kv_cache", x["kv_cache"], out["kv_cache"], slots, page)
    parts = ref_impl.layout_of(x).split(x["rows"])
    failures += _check_kv_writes(x, out, exact["k"], bounds["k"], parts["v"], impl)
    if x.get("index_cache") is not None and "index_k" in exact:
        failures += untouched_failures("index_cache", x["index_cache"], out["index_cache"],
                                       written_slots(index_slots_of(x)),
                                       x["index_cache"].shape[1])
        failures += _check_index_writes(x, out, exact["index_k"], bounds["index_k"])
    return t, failures, {}


def _division_bound(val, scaled: bool, div_rel: float) -> np.ndarray:
    """The fp32 division by a scale, allowed its declared error: |val| x div_rel, and 0
    where val is +-Inf or NaN (Inf / scale is exactly Inf: a bound of |Inf| x div_rel would
    admit any code, e.g. 240 written for +Inf in e4m3fn)."""
    if not scaled:
        return np.zeros(np.shape(val))
    with np.errstate(invalid="ignore"):
        return np.where(np.isfinite(val), np.abs(val) * div_rel, 0.0)


def _check_kv_writes(x, out, k_exact, k_bound, v, impl) -> list[str]:
    """K codes: one value in k_exact +- bound must explain both the model-dtype K output and
    the cache code (through the fp32 division by the scale). V codes: the rounding of
    v / scale, the fp32 division allowed its declared error."""
    s = np.asarray(x["slot_mapping"], np.int64)
    tok = np.flatnonzero(s >= 0)
    page, d = x["kv_cache"].shape[2], x["kv_cache"].shape[3] // 2
    fmt, cache = x["kv_fmt"], out["kv_cache"]
    div_rel = arith_for(impl, x).div_rel
    bad_k = bad_v = 0
    for h in range(x["num_kv_heads"]):
        slots = s[tok]
        codes = cache[slots // page, h, slots % page]
        ks = _scale_columns(x["k_scale"], h, slots)
        vs = _scale_columns(x["v_scale"], h, slots)
        q_rel = div_rel if x["k_scale"] is not None else 0.0
        ok_k = joint_value_exists(k_exact[tok, h], k_bound[tok, h], out["k"][tok, h],
                                  x["model_dtype"], codes[:, :d], fmt,
                                  1.0 if ks is None else ks, q_rel)
        bad_k += int(np.count_nonzero(~ok_k))
        v_val = v[tok, h] / (1.0 if vs is None else vs)
        v_bound = _division_bound(v_val, vs is not None, div_rel)
        with np.errstate(invalid="ignore"):
            c = classify(codes[:, d:], np.where(np.isinf(v_val), np.sign(v_val) * 1e300, v_val),
                         v_bound, fmt)
        bad_v += int(np.count_nonzero(~c["ok"]))
    out_lines = []
    if bad_k:
        out_lines.append(f"kv_cache K: {bad_k} codes not explained jointly with the K output")
    if bad_v:
        out_lines.append(f"kv_cache V: {bad_v} codes outside the admissible rounding of v/scale")
    return out_lines


def index_slots_of(x) -> np.ndarray:
    """Where a fused insert writes index_k: ``index_slot_mapping``, or ``slot_mapping`` when
    the inputs give none (the op's default)."""
    s = x.get("index_slot_mapping")
    return np.asarray(x["slot_mapping"] if s is None else s, np.int64)


def _check_index_writes(x, out, exact, bound) -> list[str]:
    s = index_slots_of(x)
    tok = np.flatnonzero(s >= 0)
    page = x["index_cache"].shape[1]
    codes = out["index_cache"][s[tok] // page, s[tok] % page]
    ok = joint_value_exists(exact[tok], bound[tok], out["index_k"][tok], x["model_dtype"],
                            codes, x["index_fmt"])
    bad = int(np.count_nonzero(~ok))
    return [f"index_cache: {bad} codes not explained jointly with index_k"] if bad else []


def check_reshape_and_cache(x, out, impl) -> tuple[Tally, list, dict]:
    """The two-rounding path: codes are the rounding of k/scale and v/scale (k, v already
    model-dtype values), the fp32 division allowed its declared error."""
    t = Tally()
    s = np.asarray(x["slot_mapping"], np.int64)
    tok = np.flatnonzero(s >= 0)
    page, d = x["kv_cache"].shape[2], x["kv_cache"].shape[3] // 2
    fmt, div_rel = x["kv_fmt"], arith_for(impl, x).div_rel
    failures = untouched_failures("kv_cache", x["kv_cache"], out["kv_cache"], s[tok], page)
    for h in range(x["kv_cache"].shape[1]):
        slots = s[tok]
        codes = out["kv_cache"][slots // page, h, slots % page]
        for part, values, scale in (("k", x["k"], x["k_scale"]), ("v", x["v"], x["v_scale"])):
            sc = _scale_columns(scale, h, slots)
            val = values[tok, h] / (1.0 if sc is None else sc)
            bound = _division_bound(val, sc is not None, div_rel)
            t.add(f"kv_cache.{part}", codes[:, :d] if part == "k" else codes[:, d:], val,
                  bound, fmt)
    return t, failures, {}


def check_indexer(x, out, impl) -> tuple[Tally, list, dict]:
    """Selections as sets, up to swaps of blocks whose exact scores are within the score
    error bound: fp32 accumulation of D products (gamma(D) * magnitude) plus the
    implementation's declared extra relative error, plus the reference's own float64
    error (D * 2^-53 * magnitude)."""
    res = indexer_reference(x)
    d = x["index_q"].shape[-1]
    bound = res.magnitudes * (gamma(d) + score_rel_for(impl, x) + d * 2.0**-53) * 1.000001
    # A block with a NaN key scores NaN: it ranks by rule (last, lower id first), no tolerance.
    bound = np.nan_to_num(bound, nan=0.0)
    sel = np.asarray(out["topk"])
    if sel.shape != res.topk.shape:
        return Tally(), [f"topk: shape {sel.shape} != {res.topk.shape}"], {}
    ok, details = res.admits(sel, bound)
    t = Tally(elements=details["rows"], violations=details["rows_failed"])
    differing = np.any(np.sort(sel, axis=-1) != np.sort(res.topk, axis=-1), axis=-1)
    t.exact = int(np.count_nonzero(~differing))  # rows selecting the reference's set
    t.admissible_not_nearest = int(np.count_nonzero(differing)) - t.violations
    failures = [] if ok else [f"topk: {details['rows_failed']} rows not admissible, first: "
                              f"{details['failures']}"]
    return t, failures, {"needed_bound": details["needed_bound"]}


#: [the input set under check, its hash once the implementation ran]: the reference
#: lookups of one check key by it instead of rehashing megabytes of inputs each.
_CHECKED: list = [None, None]


def _hash_after_run(x: dict) -> str:
    return _CHECKED[1] if _CHECKED[0] is x else input_hash(x)


def _cached(kind: str, x: dict, args, compute) -> dict:
    """The reference's arrays for ``kind`` on these inputs and ``args``, through the
    reference cache (``oracle.core.refcache``; keyed by the inputs' hash after the
    implementation ran: inputs an implementation modified key their own entry)."""
    return refcache.default_cache().get(kind, _hash_after_run(x), args, compute)


def indexer_reference(x) -> IndexerResult:
    """The reference indexer call on a case's inputs, with its scores (cached)."""
    decode_op = "rows_per_request" in x
    run = ref_impl.indexer_decode if decode_op else ref_impl.indexer_prefill
    names = [f.name for f in fields(IndexerResult)]

    def compute():
        res = run(x, return_scores=True)
        return {name: getattr(res, name) for name in names}

    got = _cached("indexer_decode" if decode_op else "indexer_prefill", x, (), compute)
    return IndexerResult(**{name: got[name] if got[name].ndim else got[name].item()
                            for name in names})


def check_attention(x, out, impl) -> tuple[Tally, list, dict]:
    md = x["model_dtype"]
    try:
        unrounded, bound, ordinals = scheduled_reference(x, impl, out)
    except ValueError as e:
        return Tally(), [str(e)], {}
    got, nan_for_inf = _nan_admitted_for_inf(out["out"], unrounded, md)
    t = Tally()
    t.add("out", got, unrounded, bound, md, ordinals=ordinals)
    stats = reported_attention_stats(x, decode(out["out"], md))
    if nan_for_inf:
        stats["nan_for_inf"] = nan_for_inf
    return t, [], stats


def scheduled_reference(x, impl, out) -> tuple[np.ndarray, np.ndarray, dict]:
    """The reference's unrounded output ``[T, Hq, D]`` under the implementation's declared
    schedule, the bound on the implementation's distance from it
    (``oracle.core.attention_bound``) and the admissible codes' ordinals
    (``intervals.reference_ordinals``). An implementation declaring a tuple of schedules (one per
    kind of row its kernels compute differently; ``oracle.core.registry``) reports in
    ``out["schedule_rows"]`` (int ``[T, Hq]``, default all 0) which one each (token, head)
    row followed: each row is judged against its own, the reference run once per distinct
    schedule in use. A malformed report is a ValueError (a failed check)."""
    declared = schedule_for(impl, x["model_dtype"], x)
    scheds = declared if isinstance(declared, tuple) else (declared,)
    t, hq = np.shape(x["q"])[:2]
    rows = np.asarray(out.get("schedule_rows", np.zeros((t, hq), np.int64)))
    if rows.shape != (t, hq) or not np.issubdtype(rows.dtype, np.integer):
        raise ValueError(f"schedule_rows: must be integers of shape {(t, hq)}, got "
                         f"{rows.dtype} {rows.shape}")
    if rows.size and (rows.min() < 0 or rows.max() >= len(scheds)):
        raise ValueError(f"schedule_rows: entries must lie in [0, {len(scheds)}) (the "
                         f"declared schedules), got [{rows.min()}, {rows.max()}]")
    used: dict = {}  # each distinct schedule in use -> the indices naming it
    for i in np.unique(rows) if rows.size else (0,):
        used.setdefault(scheds[i], []).append(i)
    merged = None
    for sched, indices in used.items():
        run = _scheduled_run(x, sched, arith_for(impl, x), score_rel_for(impl, x))
        if merged is None:
            merged = run
        else:
            mine = np.isin(rows, indices)[..., None]
            merged = {k: np.where(mine, run[k], merged[k]) for k in merged}
    return merged.pop("unrounded"), merged.pop("bound"), merged


def _scheduled_run(x, sched, arith, dot_rel) -> dict[str, np.ndarray]:
    """The reference's unrounded output under one schedule, the bound around it and the
    admissible codes' ordinals in the model dtype (each cached)."""
    ref = _cached("attention", x, sched, lambda: {"unrounded": ref_impl.attention_call(
        x, schedule=sched, return_details=True).unrounded})
    bound = _cached("attention_bound", x, (sched, arith, dot_rel), lambda: {
        "bound": attention_bound(x, sched, arith, dot_rel=dot_rel)})
    ordinals = _cached("attention_ordinals", x, (sched, arith, dot_rel), lambda: (
        reference_ordinals(ref["unrounded"], bound["bound"], x["model_dtype"])))
    return {"unrounded": ref["unrounded"], "bound": bound["bound"], **ordinals}


def _nan_admitted_for_inf(codes, exact, md) -> tuple[np.ndarray, int]:
    """Output codes with NaN replaced by the exact value where that is +-Inf, and how many.

    An infinite exact output means the row sees an infinite V (V x scale overflowing a
    16-bit K/V dtype) with P > 0. A kernel's P is at most fp32: for keys whose logit lies
    more than ~100 below the row's max it underflows to 0, and 0 x Inf = NaN, whatever the
    kernel's care (the false-alarm run met it in the torch and flex baselines on
    near_overflow e5m2 data with per-slot scales and fp16 activations). NaN is admitted
    there, and only there: NaN where the exact output is finite (0 x NaN from content a
    row must not see) stays a violation."""
    with np.errstate(invalid="ignore"):
        admit = np.isinf(exact) & np.isnan(decode(codes, md))
    if not admit.any():
        return codes, 0
    inf_codes = encode(np.asarray(exact, np.float64), md, policy="nonsaturating")
    return np.where(admit, inf_codes, codes), int(np.count_nonzero(admit))


LAMBDA = float(np.sqrt(2 * np.log(2 / 1e-6)))  # Higham-Mary lambda for failure prob. 1e-6


_BASELINES: list = [None, None]  # [the input set, its (exact, baseline) outputs]


def _exact_and_baseline(x) -> tuple[np.ndarray, np.ndarray]:
    """The exact float64 output and the same-precision baseline's, computed once per input
    set (the differential test checks every implementation of a case on one set; at model
    size each costs as much as the checked implementation's own reference)."""
    from reference import attention

    if _BASELINES[0] is not x:
        md = x["model_dtype"]

        def compute():
            exact = ref_impl.attention_call(x, schedule=attention.exact()).astype(np.float64)
            return {"exact": exact, "baseline": ref_impl.attention_call(
                x, schedule=attention.vllm_schedule(md))}

        got = _cached("attention_exact_baseline", x, md, compute)
        _BASELINES[:] = [x, (got["exact"], got["baseline"])]
    return _BASELINES[1]


def reported_attention_stats(x, got) -> dict:
    """Reported, never gating (the false-alarm run calibrates them on clean cases):

    ``fa_ratio``: FlashAttention's test criterion, the implementation's max error against the
    exact float64 output over that of a same-precision baseline (the reference with vLLM's
    act-dtype schedule: K/V, P and output rounded to the model dtype), floored at half an
    output ULP of the largest output.
    ``prob_ratio``: max error over a probabilistic bound (Higham and Mary): half an output ULP
    plus lambda * sqrt(D + K*P) * u * (the row's largest |output|), lambda for a failure
    probability of 1e-6 per element, u the model dtype's unit roundoff (the precision the
    same-precision baseline rounds K/V and P to; with fp32's u, a CPU false-alarm run put
    every bf16-rounding schedule 10^3-10^4 over it, a statistic that could never gate)."""
    md = x["model_dtype"]
    exact, base = _exact_and_baseline(x)
    finite = np.isfinite(exact) & np.isfinite(got)
    if not finite.any():
        return {"fa_ratio": 0.0, "prob_ratio": 0.0}
    err = np.abs(np.where(finite, got, 0.0) - np.where(finite, exact, 0.0))
    # The baseline may itself be NaN where the exact value is finite (0 x Inf, above):
    # those elements say nothing about its precision.
    usable = finite & np.isfinite(base)
    err_base = np.abs(np.where(usable, base, 0.0) - np.where(usable, exact, 0.0))
    man = get_format(md).man_bits
    _, ex = np.frexp(np.abs(exact))
    half_ulp = np.maximum(np.ldexp(0.5, ex - 1 - man), get_format(md).min_subnormal / 2)
    floor = float(half_ulp[finite].max())
    fa = float(err.max() / max(err_base.max(), floor, 1e-300))
    n = x["q"].shape[-1] + np.asarray(x["topk"]).shape[-1] * x["kv_cache"].shape[2]
    row = np.abs(np.where(finite, exact, 0.0)).max(axis=-1, keepdims=True)
    prob = half_ulp + LAMBDA * np.sqrt(n) * 2.0 ** -(man + 1) * row
    with np.errstate(divide="ignore", invalid="ignore"):
        ratio = np.where(err > 0, err / prob, 0.0)
    return {"fa_ratio": fa, "prob_ratio": float(np.nanmax(ratio))}


CHECKS = {
    "norm_rope_insert": check_norm_rope_insert,
    "reshape_and_cache": check_reshape_and_cache,
    "indexer_prefill": check_indexer,
    "indexer_decode": check_indexer,
    "attention_prefill": check_attention,
    "attention_decode": check_attention,
}


def run_check(case: Case, impl, inputs: dict | None = None) -> CheckResult:
    """Run one implementation on one case and judge it."""
    t0 = time.perf_counter()
    x = case_inputs(case) if inputs is None else inputs
    h = input_hash(x)
    failures: list[str] = []
    try:
        out = impl.run(x)
        _CHECKED[:] = [x, input_hash(x)]
        tally, fails, extra = CHECKS[case.op](x, out, impl)
        failures += fails
    except Exception as e:  # a crash is a failed check, reported with its replay
        tally, extra = Tally(), {}
        failures.append(f"raised {type(e).__name__}: {e}")
    after = _hash_after_run(x)
    _CHECKED[:] = [None, None]
    if after != h:
        failures.append("the implementation modified its inputs")
    passed = not failures and tally.violations == 0
    return CheckResult(case.op, impl.name, case.id, h, passed, case.replay_command(impl.name),
                       time.perf_counter() - t0, tally, failures, extra)


def check_claimants(case: Case, impl_names=None, device: str | None = None):
    """(implementation, CheckResult) for each implementation claiming ``case`` (optionally
    only the named ones, or those on ``device``), all judged on one input set, made when
    the first claimant runs (none: no inputs made). A generator: a caller may stop at the
    first failure."""
    x = None
    for impl in implementations(case.op, impl_names, device):
        if impl.supports(case)[0]:
            x = case_inputs(case) if x is None else x
            yield impl, run_check(case, impl, x)
