"""Soundness and power of the tolerance models, measured.

Soundness: an adversarial fp32 emulation of an op (``oracle.tools.emulate``: random summation
order, FMA on or off, special functions at the edge of their declared error) must always
be admitted. Power: of the outputs one step (one code) away from the nearest rounding of
the exact value, the share the model rejects; 1.0 means the model accepts nothing but the
nearest output, 0.0 that it cannot see a one-code error at all.
"""

from __future__ import annotations

import numpy as np

from oracle.core import rand
from oracle.core.bounds import Fp32Arith, gamma, norm_rope_bound
from oracle.core.intervals import classify, ordinal, round_codes
from oracle.tools.emulate import indexer_scores_fp32, norm_rope_fp32
from reference.codec import get_format, round_to
from reference.norm_rope import apply_rope_neox, rms_norm_gemma, rope_table

_TABLES: dict = {}


def _table(rotary_dim: int, model_dtype: str) -> np.ndarray:
    key = (rotary_dim, model_dtype)
    if key not in _TABLES:
        _TABLES[key] = rope_table(1 << 12, rotary_dim, 5e6, model_dtype)
    return _TABLES[key]


def norm_rope_problem(bg, rows: int):
    """A random batch of head vectors: D, R, model dtype, magnitude and weight scale drawn
    from the domain; returns (x, w, eps, cos_sin, R, model_dtype)."""
    d = 2 * int(rand.integers(bg, 1, 129, ())[()])
    r = 2 * int(rand.integers(bg, 1, d // 2 + 1, ())[()])
    md = ("bfloat16", "float16")[int(rand.integers(bg, 0, 2, ())[()])]
    lo, hi = (-10, 10) if md == "float16" else (-40, 40)
    mag = np.exp2(rand.integers(bg, lo, hi, (rows, 1)))
    x = round_to(rand.normal(bg, (rows, d)) * mag, md)
    w = round_to(rand.normal(bg, (d,)) * (0.3, 3.0)[int(rand.integers(bg, 0, 2, ())[()])], md)
    eps = (1e-6, 0.0, 1e-2)[int(rand.integers(bg, 0, 3, ())[()])]
    pos = rand.integers(bg, 0, 1 << 12, (rows,))
    return x, w, eps, _table(r, md)[pos], r, md


def exact_norm_rope(x, w, eps, cos_sin, rotary_dim):
    """The reference's norm + RoPE of rows x, given each row's table entries."""
    positions = np.arange(x.shape[0])
    return apply_rope_neox(rms_norm_gemma(x, w, eps), positions, cos_sin, rotary_dim)


def norm_rope_soundness(cases: int = 10_000, seed: int = 0, arith: Fp32Arith | None = None,
                        rows_per_problem: int = 50) -> dict:
    """Emulate ``cases`` head vectors adversarially; count inadmissible outputs."""
    arith = arith or Fp32Arith()
    bg = rand.generator(seed)
    done = violations = elements = 0
    worst = 0.0
    while done < cases:
        x, w, eps, cs, r, md = norm_rope_problem(bg, rows_per_problem)
        y = exact_norm_rope(x, w, eps, cs, r)
        bound = norm_rope_bound(x, w, eps, cs, r, arith)
        got = norm_rope_fp32(x, w, eps, cs, r, arith, bg)
        with np.errstate(invalid="ignore", divide="ignore"):
            worst = max(worst, float(np.nanmax(np.abs(got - y) / bound)))
        c = classify(round_codes(got, md), y, bound, md)
        violations += int(np.count_nonzero(~c["ok"]))
        elements += c["ok"].size
        done += x.shape[0]
    return {"cases": done, "elements": elements, "violations": violations,
            "max_err_over_bound": worst}


def one_step_power(exact, bound, fmt) -> float:
    """Share of the two one-code neighbours of the nearest output that the model rejects
    (neighbours that do not exist, past the largest code, are skipped)."""
    f = get_format(fmt)
    nearest = round_codes(exact, fmt).astype(np.int64)
    rejected = total = 0
    for step in (-1, 1):
        o = ordinal(nearest, fmt) + step
        valid = np.abs(o) <= f.max_code
        codes = np.where(o < 0, f.sign_bit | -o, o).astype(f.code_dtype)  # sign-magnitude
        c = classify(codes, exact, bound, fmt)
        rejected += int(np.count_nonzero(~c["ok"] & valid))
        total += int(np.count_nonzero(valid))
    return rejected / total if total else float("nan")


def norm_rope_power(cases: int = 2_000, seed: int = 1, arith: Fp32Arith | None = None) -> dict:
    """One-step power of the norm + RoPE model (bf16 and fp16 outputs)."""
    arith = arith or Fp32Arith()
    bg = rand.generator(seed)
    shares, done = [], 0
    while done < cases:
        x, w, eps, cs, r, md = norm_rope_problem(bg, 50)
        y = exact_norm_rope(x, w, eps, cs, r)
        shares.append(one_step_power(y, norm_rope_bound(x, w, eps, cs, r, arith), md))
        done += x.shape[0]
    return {"cases": done, "power": float(np.mean(shares))}



def indexer_soundness(cases: int = 10_000, seed: int = 0) -> dict:
    """Selections made from adversarial fp32 block scores (random summation order per dot
    product) of seeded small indexer prefill cases (``ties`` and ``normal``, every index
    format) must all be admissible under the fp32 score bound; ``cases`` counts rows."""
    from oracle.core.cases import Case, make_inputs
    from oracle.core.reference_run import indexer_prefill
    from reference.indexer import select_blocks
    from reference.kv_cache import gather_index_keys

    bg = rand.generator(seed)
    rows = failed = i = 0
    while rows < cases:
        i += 1
        case = Case("indexer_prefill", "small", ("ties", "normal")[i % 2],
                    ("cuda", "rocm-fnuz")[i % 3 == 0], ("auto", "fp8")[i % 2 == 0],
                    seed=seed * 100_000 + i)
        x = make_inputs(case)
        res = indexer_prefill(x, return_scores=True)
        page = x["index_cache"].shape[1]
        cu, seq = x["cu_seqlens_q"], x["seq_lens"]
        scores = np.full(res.scores.shape, -np.inf)
        for r in range(len(seq)):
            t0, t1 = int(cu[r]), int(cu[r + 1])
            if t0 == t1:
                continue
            pos = np.arange(seq[r] - (t1 - t0), seq[r])
            keys = gather_index_keys(x["index_cache"], x["index_fmt"], x["block_table"][r],
                                     np.arange(seq[r]))
            s = indexer_scores_fp32(x["index_q"][t0:t1], keys, pos, page, bg)
            scores[:, t0:t1, : s.shape[-1]] = s
        sel = select_blocks(scores, res.num_visible, x["topk"], x["local_blocks"],
                            x["initial_blocks"])
        d = x["index_q"].shape[-1]
        bound = res.magnitudes * (gamma(d) + d * 2.0**-53) * 1.000001
        ok, details = res.admits(sel, bound)
        failed += details["rows_failed"]
        rows += details["rows"]
    return {"cases": rows, "violations": failed}


def indexer_power(cases: int = 2_000, seed: int = 1) -> dict:
    """Share of rows whose smallest selection change (the weakest selected non-forced block
    swapped for the strongest unselected visible one) the tie-aware model rejects, over
    seeded small indexer prefill cases (normal and ties); rows with no possible swap are
    skipped."""
    from oracle.core.cases import Case, make_inputs
    from oracle.core.reference_run import indexer_prefill
    from reference.indexer import required_blocks

    rejected = total = i = 0
    while total < cases:
        i += 1
        case = Case("indexer_prefill", "small", ("normal", "ties")[i % 2], seed=seed * 7919 + i)
        x = make_inputs(case)
        res = indexer_prefill(x, return_scores=True)
        d = x["index_q"].shape[-1]
        bound = res.magnitudes * (gamma(d) + d * 2.0**-53) * 1.000001
        hi, t, nb = res.scores.shape
        req = required_blocks(res.num_visible, nb, x["topk"], x["local_blocks"],
                              x["initial_blocks"])
        for h in range(hi):
            for row in range(t):
                nv = int(res.num_visible[row])
                sel = res.topk[h, row]
                chosen = [b for b in sel if b >= 0 and not req[row, b]]
                others = [b for b in range(nv) if b not in set(sel.tolist())]
                if not chosen or not others:
                    continue
                s = res.scores[h, row]
                weak = min(chosen, key=lambda b: (s[b], -b))
                strong = max(others, key=lambda b: (s[b], -b))
                bad = res.topk.copy()
                bad[h, row][bad[h, row] == weak] = strong
                one = bad[h:h + 1, row:row + 1]
                ok, _ = _admits_row(res, one, bound, h, row)
                rejected += not ok
                total += 1
    return {"cases": total, "power": rejected / total}


def _admits_row(res, sel, bound, h, row):
    from reference.indexer import selection_admissible

    return selection_admissible(sel, res.scores[h:h + 1, row:row + 1],
                                bound[h:h + 1, row:row + 1], res.num_visible[row:row + 1],
                                res.local_blocks, res.initial_blocks)


def attention_soundness(cases: int = 10_000, seed: int = 0, schedules=None,
                        dot_rel: float = 0.0) -> dict:
    """Adversarial fp32 evaluations (``oracle.tools.emulate.attention_row_fp32``) of seeded tiny
    and small attention cases under several schedules (exact, vLLM-like with running tiles,
    split-K with bf16 partials; ``schedules`` to choose, a callable taking the case's page
    size and returning one): every rounded output must be admissible. ``cases`` counts
    (row, query head) pairs. ``dot_rel`` > 0: both products on emulated tensor cores
    (``tensor_core_sum``), judged by the bound with that declared ``score_rel``; the
    schedules then keep K/V in the model dtype (16-bit MMA operands)."""
    from oracle.core.attention_bound import _row_keys, attention_bound
    from oracle.core.cases import Case, make_inputs
    from oracle.core.reference_run import attention_call
    from oracle.tools.emulate import attention_row_fp32
    from reference import attention as att
    from reference.attention import decode_positions, prefill_positions, scheduled_q

    arith = Fp32Arith()
    bg = rand.generator(seed)
    done = violations = i = 0
    worst = 0.0
    while done < cases:
        i += 1
        md = ("bfloat16", "float16")[i % 2]
        sched = (schedules or [
            att.Schedule(kv_dtype=md, out_dtype=md),
            att.vllm_schedule(md),
            att.vllm_schedule(md, blocks_per_split=2),
        ])[i % 3]
        case = Case(("attention_prefill", "attention_decode")[i % 2], ("tiny", "small")[i % 4 == 0],
                    ("normal", "outliers", "near_overflow", "tiny")[(i // 2) % 4],
                    ("cuda", "rocm-fnuz")[i % 5 == 0], ("auto", "fp8", "fp8_e5m2")[i % 3],
                    md, ("none", "slot")[i % 3 != 0 and i % 7 == 0] if i % 3 else "none",
                    seed=seed * 100_000 + i)
        x = make_inputs(case)
        if callable(sched):  # a schedule of the case's page size (key streams)
            sched = sched(x["kv_cache"].shape[2])
        exact = attention_call(x, schedule=sched, return_details=True).unrounded
        bound = attention_bound(x, sched, arith, dot_rel=dot_rel)
        seq = np.asarray(x["seq_lens"], np.int64)
        if "rows_per_request" in x:
            req, pos = decode_positions(seq, x["rows_per_request"])
        else:
            req, pos = prefill_positions(x["cu_seqlens_q"], seq, len(x["q"]))
        hkv = x["kv_cache"].shape[1]
        grp = x["q"].shape[1] // hkv
        sigma = 1.0 / np.sqrt(x["q"].shape[-1])
        with np.errstate(invalid="ignore", over="ignore", divide="ignore"):
            for t in np.flatnonzero(pos >= 0):
                for g in range(hkv):
                    keys = _row_keys(x, int(req[t]), int(pos[t]), g, x["topk"][g, t], seq,
                                     sched)
                    if keys is None:
                        continue
                    heads = slice(g * grp, (g + 1) * grp)
                    got = attention_row_fp32(scheduled_q(x["q"][t, heads], sched.q_dtype),
                                             *keys, sched, arith, sigma, bg, mma=dot_rel > 0)
                    c = classify(round_codes(got, md), exact[t, heads], bound[t, heads], md)
                    violations += int(np.count_nonzero(~c["ok"]))
                    ratio = np.abs(got - exact[t, heads]) / bound[t, heads]
                    worst = max(worst, float(np.nanmax(np.where(np.isfinite(ratio), ratio,
                                                                0.0))))
                    done += grp
    return {"cases": done, "violations": violations, "max_err_over_bound": worst}


def attention_power(cases: int = 2_000, seed: int = 2) -> dict:
    """One-step power of the attention model (against the torch baseline's declared
    schedule and the vLLM schedule), over seeded tiny and small cases; ``cases`` counts
    output elements / D."""
    from oracle.core.attention_bound import attention_bound
    from oracle.core.cases import Case, make_inputs
    from oracle.core.reference_run import attention_call
    from reference import attention as att

    arith = Fp32Arith()
    shares, done, i = [], 0, 0
    while done < cases:
        i += 1
        md = ("bfloat16", "float16")[i % 2]
        sched = (att.Schedule(kv_dtype=md, out_dtype=md), att.vllm_schedule(md))[i % 2]
        case = Case(("attention_prefill", "attention_decode")[i % 2], ("tiny", "small")[i % 3 == 0],
                    ("normal", "outliers")[i % 4 == 0], "cuda", ("auto", "fp8")[i % 3 == 1], md,
                    seed=seed * 100_000 + i)
        x = make_inputs(case)
        exact = attention_call(x, schedule=sched, return_details=True).unrounded
        bound = attention_bound(x, sched, arith)
        shares.append(one_step_power(exact, bound, md))
        done += exact.shape[0] * exact.shape[1]
    return {"cases": done, "power": float(np.mean(shares))}
