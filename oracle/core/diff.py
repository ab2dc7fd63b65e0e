"""Compare two reports over the same seeded case set and flag every cell that got worse.

Same code and same inputs give the same bits, so a report's numbers move only when the
code (or a library it calls) computes something else. A cell is judged on its paired
cases: the cases present in both reports with the same input hash. It got worse when, over
those cases:
- a case failed that passed, or the violations rose;
- the exactly rounded outputs fell, the admissible-but-not-nearest outputs rose or the
  outputs within one code fell (any count, however small: one code is a real change);
- its largest error/bound rose by more than ERR_BOUND_REL of itself.
Float summaries (RMSE, largest absolute and relative error) are context, never a verdict:
an RMSE moves with every output code, also when the admissibility counts got better.
Cases whose inputs differ between the reports (the input generator or a reference table
changed) are not compared: they are listed apart with their count, and a cell with no
paired case is listed as not compared, so a regeneration of inputs does not read as
hundreds of regressions. Cells present in one report only are listed, not judged. Exit
status of ``oracle diff``: 1 on a regression.
"""

from __future__ import annotations

#: A rise of the largest error/bound up to this, relative, is the float64 reference's own
#: rounding (its bound and exact value summed in another order), not a change of the outputs.
ERR_BOUND_REL = 1e-6
#: Cells with changed inputs named in the diff at most (the rest counted).
SHOWN = 30
#: The per-case admissibility counts judged, with the direction that is worse
#: (+1: worse when it rises). Reports written before the counts were per case hold the
#: exact rate only; the other counts are then judged where both reports have them.
COUNTS = (("exact", -1), ("admissible_not_nearest", +1), ("within_one", -1),
          ("violations", +1))  # counts are integers, rates deterministic: no noise to allow
KEY_FIELDS = ("op", "impl", "platform", "format", "shape_class", "dist")


def cell_key(c: dict) -> tuple:
    """A report cell's identity: (op, impl, platform, format, shape class, distribution)."""
    return tuple(c[k] for k in KEY_FIELDS)


def changed_inputs(old: dict, new: dict) -> list[str]:
    """The cases of a cell present in both reports whose input hashes differ."""
    old_hash = {p["case"]: p["hash"] for p in old["per_case"]}
    return [p["case"] for p in new["per_case"]
            if p["case"] in old_hash and old_hash[p["case"]] != p["hash"]]


def paired_cases(old: dict, new: dict) -> list[tuple[dict, dict]]:
    """(old row, new row) of every case in both cells with the same input hash."""
    old_cases = {p["case"]: p for p in old["per_case"]}
    return [(old_cases[p["case"]], p) for p in new["per_case"]
            if p["case"] in old_cases and old_cases[p["case"]]["hash"] == p["hash"]]


def _summed(pairs, name: str) -> tuple[str, float, float] | None:
    """The count summed over the paired cases, old and new, with its label; for ``exact``,
    the mean exact rate where a report predates the per-case counts (None: not in both)."""
    if name == "exact" and not all(name in r for pair in pairs for r in pair):
        rates = [[r["exact_rate"] for r in rows] for rows in zip(*pairs)]
        return "exact rate", sum(rates[0]) / len(pairs), sum(rates[1]) / len(pairs)
    if not all(name in r for pair in pairs for r in pair):
        return None
    return (name.replace("_", " "), sum(o[name] for o, _ in pairs),
            sum(n[name] for _, n in pairs))


def compare_cells(old: dict, new: dict) -> list[str]:
    """Reasons the new cell is worse than the old one on their paired cases (empty: not
    worse, or no case to compare)."""
    pairs = paired_cases(old, new)
    if not pairs:
        return []
    reasons = []
    failed = [sum(not r["passed"] for r in rows) for rows in zip(*pairs)]
    if failed[1] > failed[0]:
        reasons.append(f"failed cases {failed[0]} -> {failed[1]}")
    for name, sign in COUNTS:
        got = _summed(pairs, name)
        if got and sign * (got[2] - got[1]) > 1e-12 * max(abs(got[1]), 1.0):
            reasons.append(f"{got[0]} {_fmt(got[1])} -> {_fmt(got[2])}")
    a = max(o["max_err_over_bound"] for o, _ in pairs)
    b = max(n["max_err_over_bound"] for _, n in pairs)
    if b > a * (1 + ERR_BOUND_REL) and b - a > 1e-12:
        reasons.append(f"max err/bound {a:.6g} -> {b:.6g}")
    return reasons


def _fmt(x: float) -> str:
    """A count as an integer, a rate with enough digits to show one element's change."""
    return f"{x:.0f}" if x == round(x) else f"{x:.8g}"


def _rmse_note(old: dict, new: dict) -> str:
    """The cell's RMSE, old -> new, as context for a reviewer."""
    return f"(RMSE {old.get('rmse', float('nan')):.6g} -> {new.get('rmse', float('nan')):.6g})"


def diff_reports(old: dict, new: dict) -> tuple[str, bool]:
    """Markdown fit for a pull-request comment, and whether anything regressed."""
    olds = {cell_key(c): c for c in old["cells"]}
    news = {cell_key(c): c for c in new["cells"]}
    worse, better, changed, unpaired = [], [], [], []
    for key in sorted(set(olds) & set(news)):
        if not paired_cases(olds[key], news[key]):
            unpaired.append(key)
        reasons = compare_cells(olds[key], news[key])
        if reasons:
            worse.append((key, reasons + [_rmse_note(olds[key], news[key])]))
        elif compare_cells(news[key], olds[key]):
            better.append(key)
        moved = changed_inputs(olds[key], news[key])
        if moved:
            changed.append((key, moved))
    lines = ["## Numerics diff", "",
             f"{len(set(olds) & set(news))} cells in both reports; {len(worse)} worse, "
             f"{len(better)} better; {len(changed)} with changed inputs "
             f"({sum(len(m) for _, m in changed)} cases, compared on the others only); "
             f"{len(unpaired)} without a case in common."]
    if worse:
        lines += ["", "| op | impl | platform | format | shape | dist | what got worse |",
                  "|---|---|---|---|---|---|---|"]
        lines += [f"| {' | '.join(k)} | {'; '.join(r)} |" for k, r in worse]
    if changed:
        shown = ", ".join(f"{'/'.join(k)} ({len(m)}: {m[0]})" for k, m in changed[:SHOWN])
        more = f", and {len(changed) - SHOWN} more cells" if len(changed) > SHOWN else ""
        lines += ["", f"Cases with changed inputs (not the same case set; not compared): "
                      f"{shown}{more}"]
    for title, keys in (("No case in common (not compared)", unpaired),
                        ("Only in the old report", set(olds) - set(news)),
                        ("Only in the new report", set(news) - set(olds))):
        if keys:
            lines += ["", f"{title}: " + _names(sorted(keys))]
    return "\n".join(lines) + "\n", bool(worse)


def _names(keys: list[tuple]) -> str:
    """Cell names joined, at most SHOWN of them (the rest counted)."""
    more = f", and {len(keys) - SHOWN} more" if len(keys) > SHOWN else ""
    return ", ".join("/".join(k) for k in keys[:SHOWN]) + more
