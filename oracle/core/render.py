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


def _groups(report: dict) -> dict:
    """(op, impl) -> its summed ULP histogram and its cases' max error/bound ratios."""
    groups: dict = {}
    for c in report["cells"]:
        g = groups.setdefault((c["op"], c["impl"]), {"hist": {str(b): 0 for b in ULP_BINS},
                                                     "ratios": []})
        for b, n in c["ulp_hist"].items():
            g["hist"][b] += n
        g["ratios"] += [p["max_err_over_bound"] for p in c["per_case"]]
    return groups


def ulp_labels() -> list[str]:
    """The histogram's bin labels: the outer bins hold the clipped tails (``<=-3``,
    ``>=3``), never a single value."""
    labels = [str(b) for b in ULP_BINS]
    return [f"<={labels[0]}", *labels[1:-1], f">={labels[-1]}"]


#: Panels per row of the ULP histogram's small multiples (readable at a 1100 px width).
HIST_COLUMNS = 4
#: Error/bound ratios below this are drawn at it on the log axis (an exact output's ratio
#: is 0, which a log axis cannot place).
RATIO_FLOOR = 1e-4


def _ulp_figure(groups: dict, keys: list):
    """Small multiples, one panel per (op, impl), shared axes: the share of outputs at
    each signed code distance from the nearest rounding."""
    import matplotlib.pyplot as plt

    cols = min(HIST_COLUMNS, len(keys))
    rows = -(-len(keys) // cols)
    fig, axes = plt.subplots(rows, cols, figsize=(2.5 * cols + 0.6, 2.0 * rows + 0.8),
                             sharex=True, sharey=True, squeeze=False)
    for ax, key in zip(axes.flat, keys):
        hist = groups[key]["hist"]
        total = max(sum(hist.values()), 1)
        ax.bar(range(len(ULP_BINS)), [hist[str(b)] / total for b in ULP_BINS],
               color=["#cc6677" if b else "#4477aa" for b in ULP_BINS])
        ax.set_title(f"{key[0]}\n{key[1]}", fontsize=8)
        ax.set_yscale("log")
        ax.set_ylim(1e-7, 1.5)
        ax.tick_params(labelsize=7)
    for ax in axes.flat[len(keys):]:
        ax.set_visible(False)
    axes[0, 0].set_xticks(range(len(ULP_BINS)), ulp_labels())
    for ax in axes[:, 0]:
        ax.set_ylabel("share of outputs", fontsize=8)
    for ax in axes[-1, :]:
        ax.set_xlabel("codes from nearest", fontsize=8)
        ax.xaxis.set_tick_params(labelbottom=True)
    fig.suptitle("Signed distance of each output from the nearest rounding of the exact "
                 "value (outer bins: the tails)", fontsize=9)
    return fig


def _ratio_figure(groups: dict, keys: list):
    """Each (op, impl)'s per-case max error over its bound, on a log axis (a ratio of 0.01
    and one of 0.17 stay apart); 1, the bound, is the red line."""
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7.5, 0.32 * len(keys) + 1.3))
    data = [[max(r, RATIO_FLOOR) for r in groups[k]["ratios"]] or [RATIO_FLOOR] for k in keys]
    ax.boxplot(data, orientation="horizontal", tick_labels=[f"{k[0]} [{k[1]}]" for k in keys],
               flierprops={"markersize": 3})
    ax.set_xscale("log")
    top = max(2.0, 1.5 * max(max(d) for d in data))
    ax.set_xlim(RATIO_FLOOR / 2, top)
    ax.axvline(1.0, color="red", lw=1)
    ax.invert_yaxis()
    ax.grid(axis="x", which="major", lw=0.4, alpha=0.5)
    ax.set_xlabel(f"max |error| / rigorous bound per case (log; 1 = at the bound; below "
                  f"{RATIO_FLOOR:g} drawn at {RATIO_FLOOR:g})", fontsize=8)
    ax.tick_params(labelsize=7)
    return fig


def plots(report: dict, out_prefix: Path) -> list[Path]:
    """Two PNGs: the ULP-distance histograms and the max error/bound per case, per
    (op, impl)."""
    import matplotlib

    matplotlib.use("Agg")
    groups = _groups(report)
    if not groups:
        return []
    keys = sorted(groups)
    hist_keys = [k for k in keys if sum(groups[k]["hist"].values())] or keys
    return [_save(_ulp_figure(groups, hist_keys), out_prefix, "-ulp.png"),
            _save(_ratio_figure(groups, keys), out_prefix, "-err-bound.png")]


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
