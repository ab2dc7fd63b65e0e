"""Compare two reports over the same seeded case set and flag every cell that got worse.

The case set is seeded, so the inputs of a case are identical in both reports (their input
hashes are compared) and any change in the numbers is real. A cell got worse when:
- it has new violations or failed cases;
- its max error/bound rose (relative rise > 1e-9, to ignore float formatting);
- its per-case exact rate fell or its per-case RMSE rose (by more than RMSE_REL of
  itself: float64 arithmetic in another order, e.g. BLAS kernels picked by the CPU, moves
  an RMSE by ~1e-14 relative, and a consistent 1e-14 drift is not a regression), judged on
  the paired per-case differences with a bootstrap over cases (elements within a case
  are correlated, cases are not): worse when the 95% bootstrap interval of the mean
  difference excludes zero, or, with fewer than 3 cases, when every case moved the same
  way.
Cases whose inputs differ between the reports (the input generator or a reference table
changed, e.g. a correctly rounded RoPE table) are not compared case by case:
their cell is judged on its unchanged cases alone (plus violations, failures and max
error/bound, which do not pair cases), and listed apart with its count of changed cases,
so a regeneration of inputs does not read as hundreds of regressions. Cells present in
one report only are listed, not judged. Exit status: 1 on a regression.
"""

from __future__ import annotations

import numpy as np

from oracle.core import rand

BOOTSTRAP = 2000
#: Relative RMSE changes per case at most this are noise, not change (see the docstring;
#: per-case RMSEs move by ~1e-14 relative between machines).
RMSE_REL = 1e-9
#: Cells with changed inputs named in the diff at most (the rest counted).
SHOWN = 30


def _key(c) -> tuple:
    return (c["op"], c["impl"], c["platform"], c["format"], c["shape_class"], c["dist"])


def bootstrap_interval(diffs: np.ndarray, seed: int = 0) -> tuple[float, float]:
    """95% percentile-bootstrap interval of the mean of paired differences."""
    bg = rand.generator(seed)
    idx = rand.integers(bg, 0, len(diffs), (BOOTSTRAP, len(diffs)))
    means = diffs[idx].mean(axis=1)
    return float(np.quantile(means, 0.025)), float(np.quantile(means, 0.975))


def _worse_by_cases(diffs: np.ndarray) -> bool:
    """True when the paired differences (positive = worse) say the cell got worse."""
    if not diffs.size or np.all(diffs == 0):
        return False
    if diffs.size < 3:
        return bool(np.all(diffs >= 0) and np.any(diffs > 0))
    lo, _ = bootstrap_interval(diffs)
    return lo > 0


def changed_inputs(old: dict, new: dict) -> list[str]:
    """The cases of a cell present in both reports whose input hashes differ."""
    old_hash = {p["case"]: p["hash"] for p in old["per_case"]}
    return [p["case"] for p in new["per_case"]
            if p["case"] in old_hash and old_hash[p["case"]] != p["hash"]]


def compare_cells(old: dict, new: dict) -> list[str]:
    """Reasons the new cell is worse than the old one (empty: not worse); cases whose
    inputs differ are left out of the paired comparisons (``changed_inputs``)."""
    reasons = []
    if new["violations"] > old["violations"]:
        reasons.append(f"violations {old['violations']} -> {new['violations']}")
    if new["cases"] - new["passed"] > old["cases"] - old["passed"]:
        reasons.append(f"failed cases {old['cases'] - old['passed']} -> "
                       f"{new['cases'] - new['passed']}")
    a, b = old["max_err_over_bound"], new["max_err_over_bound"]
    if b > a * (1 + 1e-9) and b - a > 1e-12:
        reasons.append(f"max err/bound {a:.4g} -> {b:.4g}")
    old_cases = {p["case"]: p for p in old["per_case"]}
    pairs = [(old_cases[p["case"]], p) for p in new["per_case"]
             if p["case"] in old_cases and old_cases[p["case"]]["hash"] == p["hash"]]
    if pairs:
        exact_drop = np.array([o["exact_rate"] - n["exact_rate"] for o, n in pairs])
        rmse_rise = np.array([n["rmse"] - o["rmse"] for o, n in pairs])
        scale = np.array([max(o["rmse"], n["rmse"]) for o, n in pairs])
        rmse_rise[np.abs(rmse_rise) <= RMSE_REL * scale] = 0.0
        if _worse_by_cases(exact_drop):
            reasons.append(f"exact rate {np.mean([o['exact_rate'] for o, _ in pairs]):.4%} -> "
                           f"{np.mean([n['exact_rate'] for _, n in pairs]):.4%}")
        if _worse_by_cases(rmse_rise):
            reasons.append(f"RMSE {np.mean([o['rmse'] for o, _ in pairs]):.4g} -> "
                           f"{np.mean([n['rmse'] for _, n in pairs]):.4g}")
    return reasons


def diff_reports(old: dict, new: dict) -> tuple[str, bool]:
    """Markdown fit for a pull-request comment, and whether anything regressed."""
    olds = {_key(c): c for c in old["cells"]}
    news = {_key(c): c for c in new["cells"]}
    worse, better, changed = [], [], []
    for key in sorted(set(olds) & set(news)):
        reasons = compare_cells(olds[key], news[key])
        if reasons:
            worse.append((key, reasons))
        elif compare_cells(news[key], olds[key]):
            better.append(key)
        moved = changed_inputs(olds[key], news[key])
        if moved:
            changed.append((key, moved))
    lines = ["## Numerics diff", "",
             f"{len(set(olds) & set(news))} cells compared; {len(worse)} worse, "
             f"{len(better)} better; {len(changed)} with changed inputs "
             f"({sum(len(m) for _, m in changed)} cases, compared on the others only)."]
    if worse:
        lines += ["", "| op | impl | platform | format | shape | dist | what got worse |",
                  "|---|---|---|---|---|---|---|"]
        lines += [f"| {' | '.join(k)} | {'; '.join(r)} |" for k, r in worse]
    if changed:
        shown = ", ".join(f"{'/'.join(k)} ({len(m)}: {m[0]})" for k, m in changed[:SHOWN])
        more = f", and {len(changed) - SHOWN} more cells" if len(changed) > SHOWN else ""
        lines += ["", f"Cases with changed inputs (not the same case set; not compared): "
                      f"{shown}{more}"]
    for title, keys in (("Only in the old report", set(olds) - set(news)),
                        ("Only in the new report", set(news) - set(olds))):
        if keys:
            lines += ["", f"{title}: " + ", ".join("/".join(k) for k in sorted(keys))]
    return "\n".join(lines) + "\n", bool(worse)
