"""Markdown tables and PNG plots rendered from a report JSON (never from live results)."""

from __future__ import annotations

from pathlib import Path

from oracle.core.checks import ULP_BINS


def _pct(n, d) -> str:
    return f"{100 * n / d:.2f}%" if d else "-"


def _cell(text: str) -> str:
    """text inside a Markdown table cell (its pipes escaped: test ids hold them)."""
    return text.replace("|", "\\|")


def _suite_lines(suite: dict | None) -> list[str]:
    """A test run's summary (``pytest --suite-report``: oracle/tools/suite.py), when present."""
    if not suite:
        return []
    outcomes = ", ".join(f"{n} {k}" for k, n in sorted(suite["outcomes"].items()))
    lines = [f"Test run: {outcomes} in {suite['wall_seconds']} s wall "
             f"({suite['test_seconds']} s of test time over all workers).", "",
             "| slowest tests | s |", "|---|---:|"]
    lines += [f"| `{_cell(t['test'])}` | {t['seconds']:.1f} |" for t in suite["slowest"][:10]]
    lines += [""] + [f"- FAILED `{t['test']}`: {t.get('message', '')}"
                     for t in suite["failed"]]
    return lines + ([""] if suite["failed"] else [])


def markdown(report: dict) -> str:
    m = report["machine"]
    lines = [
        f"# Tolerance report ({report['created']})",
        "",
        f"Machine: {m.get('device')}, torch {m.get('torch', '-')}, triton "
        f"{m.get('triton', '-')}, numpy {m.get('numpy')}. {report['cases']} cases, "
        f"{report['seconds']} s.",
        "",
        *_suite_lines(report.get("suite")),
        "exact: output equals the nearest rounding of the exact value; ±1: within one code; "
        "adm≠near: admissible but not nearest; width>1: cases where the admissible set holds "
        "more than one code; err/bound: the largest error over its rigorous bound "
        "(1 = at the edge). Indexer rows count selections (exact = the reference's set).",
        "",
        "| op | impl | platform | format | shape | dist | cases | pass | elements | exact | "
        "±1 | adm≠near | violations | width>1 | max err/bound | max abs err | RMSE |",
        "|---|---|---|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for c in report["cells"]:
        wide = c["width_2"] + c["width_more"]
        lines.append(
            f"| {c['op']} | {c['impl']} | {c['platform']} | {c['format']} | {c['shape_class']} "
            f"| {c['dist']} | {c['cases']} | {c['passed']} | {c['elements']:,} "
            f"| {_pct(c['exact'], c['elements'])} | {_pct(c['within_one'], c['elements'])} "
            f"| {c['admissible_not_nearest']:,} | {c['violations']:,} "
            f"| {_pct(wide, c['elements'])} | {c['max_err_over_bound']:.3g} "
            f"| {c['max_abs_err']:.3g} | {c['rmse']:.3g} |")
    reported = [c for c in report["cells"] if c.get("reported")]
    if reported:
        lines += ["", "## Reported, not gating (calibrated in a clean run before they may gate)",
                  "", "fa_ratio: max error over a same-precision baseline's (floor half an "
                  "output ULP); prob_ratio: max error over a probabilistic bound; "
                  "needed_bound: the smallest score bound that admits every selection.", "",
                  "| op | impl | platform | format | shape | dist | statistic | max |",
                  "|---|---|---|---|---|---|---|---:|"]
        for c in reported:
            for name, value in sorted(c["reported"].items()):
                lines.append(f"| {c['op']} | {c['impl']} | {c['platform']} | {c['format']} "
                             f"| {c['shape_class']} | {c['dist']} | {name} | {value:.3g} |")
    if report["failures"]:
        lines += ["", "## Failures", ""]
        for f in report["failures"][:50]:
            lines += ["```", f["summary"], "```"]
    if report.get("skipped"):
        lines += ["", "## Not claimed by an implementation (skipped)", ""]
        lines += [f"- {why}: {n} cases" for why, n in sorted(report["skipped"].items())]
    return "\n".join(lines) + "\n"


def plots(report: dict, out_prefix: Path) -> list[Path]:
    """Two PNGs: the ULP-distance histogram and the max error/bound per case, per (op, impl)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    groups: dict = {}
    for c in report["cells"]:
        g = groups.setdefault((c["op"], c["impl"]), {"hist": {str(b): 0 for b in ULP_BINS},
                                                     "ratios": []})
        for b, n in c["ulp_hist"].items():
            g["hist"][b] += n
        g["ratios"] += [p["max_err_over_bound"] for p in c["per_case"]]
    if not groups:
        return []
    keys = sorted(groups)
    hist_keys = [k for k in keys if sum(groups[k]["hist"].values())]
    paths = []
    fig, axes = plt.subplots(max(len(hist_keys), 1), 1, figsize=(7, 1.6 * len(hist_keys) + 0.6),
                             squeeze=False)
    for ax, key in zip(axes[:, 0], hist_keys):
        hist = groups[key]["hist"]
        total = max(sum(hist.values()), 1)
        ax.bar([int(b) for b in hist], [n / total for n in hist.values()], color="#4477aa")
        ax.set_yscale("log")
        ax.set_ylim(1e-7, 1.5)
        ax.set_title(f"{key[0]} [{key[1]}]: signed distance in codes from the nearest rounding",
                     fontsize=8)
        ax.tick_params(labelsize=7)
    paths.append(_save(fig, out_prefix, "-ulp.png"))
    fig, ax = plt.subplots(figsize=(7, 0.35 * len(keys) + 1.2))
    ax.boxplot([groups[k]["ratios"] or [0.0] for k in keys], vert=False,
               tick_labels=[f"{k[0]} [{k[1]}]" for k in keys])
    ax.axvline(1.0, color="red", lw=1)
    ax.set_xlabel("max |error| / rigorous bound per case (1 = at the edge)")
    ax.tick_params(labelsize=7)
    paths.append(_save(fig, out_prefix, "-err-bound.png"))
    return paths


def _save(fig, out_prefix: Path, suffix: str) -> Path:
    import matplotlib.pyplot as plt

    fig.tight_layout()
    path = out_prefix.with_name(out_prefix.name + suffix)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def render(report: dict, out_prefix: str | Path) -> list[Path]:
    out_prefix = Path(out_prefix)
    out_prefix.parent.mkdir(parents=True, exist_ok=True)
    md = out_prefix.with_suffix(".md")
    md.write_text(markdown(report))
    return [md, *plots(report, out_prefix)]
