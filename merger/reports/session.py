"""A session's merges as one self-contained HTML file: ``merger report session`` and the Compare tab's
Export report. plotly.js is inlined once and nothing is fetched, so the file opens offline and sends
no request. It holds the pool (base and experts with their hashes or Hub commits), the merges side by
side (table, grouped bars, radar), and per merge its per-task table with ± intervals, its bars, and
the command and spec that reproduce it."""
from __future__ import annotations

import html
import math
from pathlib import Path

import yaml

from merger import methods, plots
from merger.errors import MergerError

MAX_MERGES = 64  # a report past this many merges is no longer read (the page would load for minutes)

STYLE = """body{font-family:system-ui,sans-serif;max-width:1100px;margin:2em auto;padding:0 1em;color:#222}
table{border-collapse:collapse;margin:.5em 0 1.5em}td,th{border:1px solid #ccc;padding:.25em .6em;text-align:right}
td:first-child,th:first-child{text-align:left}pre{background:#f6f6f6;padding:.6em;overflow-x:auto}
h2{border-bottom:1px solid #ddd;padding-bottom:.2em}.note{color:#666}"""


def parse_specs(pool, texts) -> list:
    """Specs written as the landscape's points are: METHOD:param=value:param=value (ta = task_arithmetic)."""
    from merger.spec import assignments

    specs = []
    for text in texts:
        method, *given = text.strip().split(":")
        specs.append(pool.make_spec(method, assignments(given, f"--specs '{text}'")))
    return specs


def session_report(session, specs, split: str = "test", title: str = "", views=None) -> str:
    """The report's HTML. Every merge is evaluated on ``split`` (the session's caches answer the ones
    already computed). ``views``: heading -> a figure the session showed (its sweeps, landscape,
    trajectories, trade-off maps), drawn after the merges as they were."""
    pool = session.pool
    if len(specs) > MAX_MERGES:
        raise MergerError(f"report: {len(specs)} merges (at most {MAX_MERGES})")
    figures = _Figures()
    parts = [f"<h1>{html.escape(title or f'{pool.name}: merges')}</h1>", _pool_section(pool)]
    if not specs:
        parts.append("<p class='note'>This session pinned no merges: pin merges in the Merge tab (or name them "
                     "with --specs) to report them.</p>")
    parts += _merge_sections(session, specs, split, figures)
    if views:
        parts.append("<h2>What the session showed</h2>")
        for heading, fig in views.items():
            parts += [f"<h3>{html.escape(heading)}</h3>", figures.add(fig)]
    return _page(title or pool.name, parts)


def _merge_sections(session, specs, split: str, figures) -> list[str]:
    pool, parts = session.pool, []
    if not specs:
        return parts
    with session.batch():
        results = {_name(s, i): (s, session.preview(s, split)) for i, s in enumerate(specs)}
        base, experts = session.base(split), session.expert_accuracy(split)
    named = {k: r for k, (_, r) in results.items()}
    parts += [f"<h2>The merges side by side ({split} split)</h2>", _summary(results),
              figures.add(plots.grouped_bars(named, f"Accuracy per task ({split} split)")),
              figures.add(plots.radar(named, f"Normalised accuracy (merged ÷ expert), {split} split"))]
    for label, (spec, result) in results.items():
        parts += [f"<h2>{html.escape(label)}</h2>", _task_table(result),
                  figures.add(plots.accuracy_bars(result, base, experts, title=f"{label}: accuracy per task")),
                  "<p>Replay it:</p>", f"<pre>{html.escape(_command(pool, spec))}</pre>",
                  "<p>Its spec:</p>", f"<pre>{html.escape(yaml.safe_dump(spec.as_dict(), sort_keys=False))}</pre>"]
    return parts


def history_sweeps(history, pool, limit: int = 5000) -> dict:
    """The λ sweeps a history holds for this pool: per split, one curve of average accuracy against λ
    for each setting (method, experts, other parameters) evaluated at 3 or more λ values."""
    import json

    from merger.io.export import pool_reference

    curves: dict = {}
    for row in history.rows(pool=pool_reference(pool), limit=limit):
        params = json.loads(row["params"])
        lam = params.pop("lam", None)
        if isinstance(lam, (int, float)) and row["average_accuracy"] is not None:
            rest = ", ".join(f"{k}={v}" for k, v in sorted(params.items()))
            experts = "" if row["experts"] == ",".join(pool.tasks) else f" [{row['experts']}]"
            precision = "" if row["forward"] == "fp32" else f" ({row['forward'] or 'unrecorded'} forwards)"
            label = f"{row['method']}({rest}){experts}{precision}"
            curves.setdefault(row["split"], {}).setdefault(label, {})[float(lam)] = row["average_accuracy"]
    views = {}
    for split, per_label in sorted(curves.items()):
        swept = {label: (sorted(points), [points[x] for x in sorted(points)])
                 for label, points in per_label.items() if len(points) >= 3}
        if swept:
            views[f"λ sweeps in the history ({split} split)"] = plots.sweep_curves(
                swept, "λ", f"Average accuracy against λ, {split} split (from the history)")
    return views


class _Figures:
    """Each figure as a div; plotly.js inlined with the first one only."""

    def __init__(self):
        self.count = 0

    def add(self, fig) -> str:
        self.count += 1
        return fig.to_html(full_html=False, include_plotlyjs=self.count == 1, config={"displaylogo": False})


def _name(spec, i: int) -> str:
    return f"{i + 1}. {spec.label()}"


def _page(title: str, parts) -> str:
    return (f"<!DOCTYPE html><html><head><meta charset='utf-8'><title>{html.escape(title)}</title>"
            f"<style>{STYLE}</style></head><body>" + "\n".join(parts) + "</body></html>")


def _pool_section(pool) -> str:
    from merger import __version__

    hashes = pool.file_hashes()
    rows = [("base", "base")] + [(f"expert {t}", t) for t in pool.tasks]
    cells = []
    for role, key in rows:
        hub = pool.hub_sources.get("base" if key == "base" else f"experts.{key}")
        path = pool.base_path if key == "base" else pool.expert_info[key]["path"]
        where = f"{hub['hub']} @ {hub['revision'][:12]}" if hub else str(Path(path).name)
        cells.append(f"<tr><td>{html.escape(role)}</td><td>{html.escape(where)}</td><td><code>{hashes[key]}</code>"
                     "</td></tr>")
    return (f"<p>Pool <b>{html.escape(pool.name)}</b> ({html.escape(pool.source)}), {pool.architecture_name}, "
            f"{len(pool.tasks)} tasks; written by merger {__version__}.</p>"
            "<table><tr><th>role</th><th>file or repository</th><th>sha256</th></tr>" + "".join(cells) + "</table>")


def _summary(results) -> str:
    head = "<tr><th>merge</th><th>method</th><th>avg acc %</th><th>± 95 %</th><th>normalised %</th><th>loss</th></tr>"
    rows = [f"<tr><td>{html.escape(label)}</td><td>{html.escape(methods.get(s.method).display_name)}</td>"
            f"<td>{100 * r.average_accuracy:.1f}</td><td>{100 * r.average_margin():.1f}</td>"
            f"<td>{_pct(r.normalized_accuracy)}</td><td>{r.average_loss:.3f}</td></tr>" for label, (s, r) in results.items()]
    return "<table>" + head + "".join(rows) + "</table>"


def _task_table(result) -> str:
    margins = result.margins()
    head = "<tr><th>task</th><th>accuracy %</th><th>± 95 %</th><th>loss</th><th>normalised %</th><th>images</th></tr>"
    rows = [f"<tr><td>{html.escape(t)}</td><td>{100 * result.accuracy[t]:.1f}</td><td>{100 * margins[t]:.1f}</td>"
            f"<td>{result.loss[t]:.3f}</td><td>{_pct(result.normalized[t])}</td><td>{result.counts[t]}</td></tr>"
            for t in result.tasks]
    return "<table>" + head + "".join(rows) + "</table>"


def _pct(value: float) -> str:
    return f"{100 * value:.1f}" if math.isfinite(value) else "n/a"


def _command(pool, spec) -> str:
    from merger.io.export import pool_reference

    flags = [f"--{k.replace('_', '-')} {v}" for k, v in spec.kwargs.items()]
    if list(spec.experts) != list(pool.tasks):
        flags.append(f"--experts {','.join(spec.experts)}")
    for key in ("task_weights", "block_weights"):
        weights = spec.as_dict().get(key)
        if weights:
            flags.append(f"--{key.replace('_', '-')} " + ",".join(f"{n}={w:g}" for n, w in weights.items()))
    return " ".join(["merger merge --pool", pool_reference(pool), "--method", spec.method, *flags,
                     "--out merged.safetensors"])


def write_report(path, text: str) -> Path:
    from merger.io.checkpoints import write_text_atomic

    return write_text_atomic(path, text)
