"""A self-contained HTML report of an EvalResult: metrics, comparisons, plots, every example.

Plots are drawn with matplotlib's object API (no pyplot global state, safe off the main thread) and
inlined as SVG, so the file opens anywhere without network access or sidecar files.
"""

from __future__ import annotations

import html
import io
from collections.abc import Mapping, Sequence
from typing import Any

from kiln.evals.compare import adapter_label, compare_runs
from kiln.evals.summary import example_ids, representative, run_row, scorer_rows, tag_rows

_CSS = """
body{font-family:system-ui,-apple-system,Segoe UI,sans-serif;margin:2rem auto;max-width:1200px;color:#1d1d1f;
padding:0 1rem}
h1{font-size:1.6rem}h2{margin-top:2.2rem;border-bottom:1px solid #ddd;padding-bottom:.3rem}
table{border-collapse:collapse;margin:.6rem 0;font-size:.9rem}
th,td{border:1px solid #ddd;padding:.3rem .55rem;text-align:left;vertical-align:top}
th{background:#f4f4f6}.pass{color:#137333;font-weight:600}.fail{color:#b3261e;font-weight:600}
.invalid{color:#a15c00;font-weight:600}.error{color:#6e3fb5;font-weight:600}
pre{white-space:pre-wrap;word-break:break-word;margin:.2rem 0;font-size:.82rem;max-width:520px}
.plots{display:flex;flex-wrap:wrap;gap:1.2rem}.plots figure{margin:0}.muted{color:#666;font-size:.85rem}
"""
_COLORS = ["#3366cc", "#dc3912", "#ff9900", "#109618", "#990099", "#0099c6", "#dd4477", "#66aa00"]


def _e(text: Any) -> str:
    return html.escape(str(text), quote=True)


def _table(rows: Sequence[Mapping[str, str]]) -> str:
    if not rows:
        return '<p class="muted">none</p>'
    head = "".join(f"<th>{_e(k)}</th>" for k in rows[0])
    body = "".join("<tr>" + "".join(f"<td>{_e(v)}</td>" for v in row.values()) + "</tr>" for row in rows)
    return f"<table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>"


# ---- plots -----------------------------------------------------------------------------------------

def _svg(fig: Any) -> str:
    import matplotlib

    buf = io.StringIO()
    # Text stays text (small files); a fixed hash salt keeps ids stable between renders.
    with matplotlib.rc_context({"svg.fonttype": "none", "svg.hashsalt": "kiln"}):
        fig.savefig(buf, format="svg", bbox_inches="tight")
    text = buf.getvalue()
    return text[text.find("<svg"):]


def _figure(width: float, height: float) -> Any:
    from matplotlib.figure import Figure

    return Figure(figsize=(width, height), dpi=100)


def _errorbar(ax: Any, x: Sequence[float], rates: Sequence[float], cis: Sequence[Mapping[str, float]],
              color: str, label: str | None = None, width: float = 0.6) -> None:
    lower = [max(0.0, r - ci["lower"]) for r, ci in zip(rates, cis, strict=True)]
    upper = [max(0.0, ci["upper"] - r) for r, ci in zip(rates, cis, strict=True)]
    ax.bar(x, rates, width=width, color=color, alpha=0.75, label=label)
    ax.errorbar(x, rates, yerr=[lower, upper], fmt="none", ecolor="#222", capsize=4, linewidth=1)


def accuracy_plot(runs: Sequence[Mapping[str, Any]]) -> str:
    """Accuracy of each run with its 95% Wilson interval."""
    fig = _figure(max(4.0, 1.1 * len(runs) + 2), 3.4)
    ax = fig.add_subplot()
    rates = [r["metrics"]["accuracy"] for r in runs]
    cis = [r["metrics"]["accuracy_confidence_interval"] for r in runs]
    for i, (rate, ci) in enumerate(zip(rates, cis, strict=True)):
        _errorbar(ax, [i], [rate], [ci], _COLORS[i % len(_COLORS)])
    ax.set_xticks(range(len(runs)), [f"{i}: {adapter_label(r.get('adapter'))}" for i, r in enumerate(runs)],
                  rotation=20, ha="right")
    ax.set_ylim(0, 1)
    ax.set_ylabel("accuracy")
    ax.set_title("Accuracy per run (95% Wilson interval)")
    return _svg(fig)


def tag_plot(runs: Sequence[Mapping[str, Any]]) -> str | None:
    """Per-tag accuracy, one bar group per tag and one bar per run, with intervals."""
    tags = sorted({t for r in runs for t in (r["metrics"].get("tag_breakdown") or {})})
    if not tags:
        return None
    fig = _figure(max(5.0, 0.9 * len(tags) * max(1, len(runs)) + 2), 3.6)
    ax = fig.add_subplot()
    width = 0.8 / len(runs)
    for i, run in enumerate(runs):
        breakdown = run["metrics"].get("tag_breakdown") or {}
        empty = {"pass_rate": 0.0, "confidence_interval": {"lower": 0.0, "upper": 0.0}}
        rows = [breakdown.get(t, empty) for t in tags]
        xs = [j + (i - (len(runs) - 1) / 2) * width for j in range(len(tags))]
        _errorbar(ax, xs, [b["pass_rate"] for b in rows], [b["confidence_interval"] for b in rows],
                  _COLORS[i % len(_COLORS)], label=f"{i}: {adapter_label(run.get('adapter'))}", width=width)
    ax.set_xticks(range(len(tags)), tags, rotation=20, ha="right")
    ax.set_ylim(0, 1)
    ax.set_ylabel("accuracy")
    ax.set_title("Accuracy per tag (95% Wilson interval)")
    ax.legend(fontsize="small")
    return _svg(fig)


def latency_plot(runs: Sequence[Mapping[str, Any]]) -> str | None:
    """Histogram of per-completion latency, one layer per run."""
    series = [[o["latency_ms"] for o in r["outcomes"]] for r in runs]
    if not any(series):
        return None
    fig = _figure(5.5, 3.4)
    ax = fig.add_subplot()
    for i, values in enumerate(series):
        if values:
            ax.hist(values, bins=min(30, max(5, len(values) // 2)), alpha=0.55, color=_COLORS[i % len(_COLORS)],
                    label=f"{i}: {adapter_label(runs[i].get('adapter'))}")
    ax.set_xlabel("latency per completion (ms)")
    ax.set_ylabel("completions")
    ax.set_title("Latency")
    ax.legend(fontsize="small")
    return _svg(fig)


# ---- sections --------------------------------------------------------------------------------------

def _header(result: Mapping[str, Any], title: str) -> str:
    runs = result.get("runs", [])
    facts = [("job", result.get("job_id")), ("state", result.get("state")),
             ("suite", runs[0]["suite_name"] if runs else "-"),
             ("effective seed", result.get("effective_seed", "-")),
             ("seed derivation", result.get("seed_derivation", "-")),
             ("adapters", ", ".join(adapter_label(r.get("adapter")) for r in runs) or "-")]
    if runs:
        facts += [("started", runs[0]["started_at"]), ("finished", runs[-1]["finished_at"])]
    if result.get("error"):
        facts.append(("error", result["error"]))
    verdict = result.get("replay_verdict")
    if verdict:
        facts.append(("replay verdict", f"{verdict['status']}: {verdict['message']}"))
    rows = "".join(f"<tr><th>{_e(k)}</th><td>{_e(v)}</td></tr>" for k, v in facts)
    return f"<h1>{_e(title)}</h1><table>{rows}</table>"


def _comparisons(runs: Sequence[Mapping[str, Any]]) -> str:
    if len(runs) < 2:
        return ""
    rows = []
    for c in compare_runs(runs):
        rows.append({"baseline": f"{c.baseline_run}: {c.baseline}", "candidate": f"{c.candidate_run}: {c.candidate}",
                     "paired": str(c.num_paired), "both pass": str(c.both_pass), "improved": str(c.improved),
                     "regressed": str(c.regressed), "both fail": str(c.both_fail),
                     "sign test p": f"{c.p_value:.4g}", "significant (p < 0.05)": "yes" if c.significant else "no"})
    return "<h2>Paired comparison</h2>" + _table(rows)


def _examples(runs: Sequence[Mapping[str, Any]]) -> str:
    head = "<th>example</th><th>tags</th>" + "".join(
        f"<th>{_e(f'{i}: ' + adapter_label(r.get('adapter')))}</th>" for i, r in enumerate(runs))
    body = []
    for example_id in example_ids(list(runs)):
        cells = []
        tags: list[str] = []
        for run in runs:
            agg = next((a for a in run["aggregated_outcomes"] if a["example_id"] == example_id), None)
            rep = representative(run, example_id)
            if agg is None or rep is None:
                cells.append('<td class="muted">not run</td>')
                continue
            tags = agg.get("tags", tags)
            cells.append(
                f'<td><span class="{_e(agg["kind"])}">{_e(agg["kind"])}</span> {agg["score"]:.2f} '
                f'<span class="muted">({agg["num_pass"]}/{len(agg["completion_indices"])} pass)</span>'
                f'<pre>{_e(rep["completion_text"])}</pre><div class="muted">{_e(rep.get("detail", ""))}</div></td>')
        body.append(f"<tr><td>{_e(example_id)}</td><td>{_e(', '.join(tags))}</td>{''.join(cells)}</tr>")
    return f"<h2>Examples</h2><table><thead><tr>{head}</tr></thead><tbody>{''.join(body)}</tbody></table>"


class ReportDependencyError(RuntimeError):
    """matplotlib, which draws the plots, is an optional dependency (the `reports` extra)."""


def require_matplotlib() -> Any:
    try:
        import matplotlib
    except ImportError:
        raise ReportDependencyError(
            "HTML eval reports draw their plots with matplotlib, which is not installed; "
            "install it with: pip install 'kiln[reports]' (or pip install matplotlib)") from None
    return matplotlib


def render_report(result: Mapping[str, Any], *, title: str | None = None) -> str:
    """The whole report as one HTML document (raises ReportDependencyError without matplotlib)."""
    matplotlib = require_matplotlib()

    runs = list(result.get("runs", []))
    title = title or f"Kiln eval report: {result.get('job_id', '')}"
    parts = [_header(result, title)]
    if runs:
        parts.append("<h2>Metrics</h2>" + _table([run_row(i, r) for i, r in enumerate(runs)]))
        parts.append(_comparisons(runs))
        plots = [p for p in (accuracy_plot(runs), tag_plot(runs), latency_plot(runs)) if p]
        parts.append("<h2>Plots</h2><div class='plots'>" + "".join(f"<figure>{p}</figure>" for p in plots) + "</div>")
        for i, run in enumerate(runs):
            label = f"Run {i}: {adapter_label(run.get('adapter'))}"
            parts.append(f"<h2>{_e(label)}: per tag and per scorer</h2>" + _table(tag_rows(run))
                         + _table(scorer_rows(run)))
        parts.append(_examples(runs))
    else:
        parts.append('<p class="muted">This job has no finished runs yet.</p>')
    parts.append(f'<p class="muted">Generated by Kiln; plots drawn with matplotlib {_e(matplotlib.__version__)}.</p>')
    return (f'<!DOCTYPE html><html lang="en"><head><meta charset="utf-8"><title>{_e(title)}</title>'
            f"<style>{_CSS}</style></head><body>{''.join(parts)}</body></html>\n")
