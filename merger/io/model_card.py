"""A model card for exported merged weights: ``README.md`` beside the safetensors, with the Hugging
Face front matter (base model, tags, library), the method and its parameters, the base and experts
with their hashes (or Hub commits), the per-task accuracy table with the split it was measured on,
and the command that replays the merge. The folder can then be pushed to the Hub as it is.

A README.md that merger did not write (a user's own) is never replaced: the card then goes to
``<weights stem>.README.md`` beside it.
"""
from __future__ import annotations

import math
from pathlib import Path

from merger.io import checkpoints

MARK = "<!-- written by merger: a model card of exported merged weights -->"
PRECISIONS = {"fp32": "fp32", "bf16": "bf16 autocast (bf16 products, fp32 sums)"}


def card_text(pool, spec, record: dict, result, no_result: str = "") -> str:
    """The card of one export: ``record`` is its spec record (io/export.spec_record), ``result`` the
    merge's evaluation (any split; the table names it), or None with ``no_result`` saying why."""
    from merger import __version__, methods

    m = methods.get(spec.method)
    base_repo = (pool.hub_sources.get("base") or {}).get("hub")
    front = ["---", *([f"base_model: {base_repo}"] if base_repo else []), "library_name: open_clip",
             "tags:", "- merger", "- model-merging", "- clip", f"- {m.name}", "---"]
    params = ", ".join(f"{k} = {v}" for k, v in spec.kwargs.items()) or "none"
    lines = [*front, MARK, "", f"# {pool.name}: {spec.label()}", "",
             f"The image tower of a CLIP {_architecture(pool)} merged by merger {__version__} with "
             f"{m.display_name} (*{m.paper.title}*" + (f", arXiv:{m.paper.arxiv}" if m.paper.arxiv else "") + ").",
             "", "## Merge", "", "| method | parameters | experts |", "| --- | --- | --- |",
             f"| `{m.name}` | {params} | {', '.join(spec.experts)} |", ""]
    for key in ("task_weights", "block_weights"):
        if record.get(key):
            lines += [f"{key.replace('_', ' ').capitalize()}: " + ", ".join(f"{k} = {v}" for k, v in record[key].items()),
                      ""]
    lines += ["## Sources", "", "| role | file or repository | sha256 or commit |", "| --- | --- | --- |"]
    lines.append(_source_row("base", "base", record["base"], pool.hub_sources))
    lines += [_source_row(f"expert {t}", f"experts.{t}", v, pool.hub_sources) for t, v in record["expert_files"].items()]
    if result is None:
        lines += ["", "## Accuracy", "", f"Not measured: {no_result}", ""]
        return "\n".join(lines + _reproduce(record))
    lines += ["", f"## Accuracy ({result.split} split)", "",
              "| task | accuracy % | ± 95 % | loss | images |", "| --- | --- | --- | --- | --- |"]
    margins = result.margins()
    for t in result.tasks:
        lines.append(f"| {t} | {100 * result.accuracy[t]:.1f} | {100 * margins[t]:.1f} | {result.loss[t]:.3f} | "
                     f"{result.counts[t]} |")
    average_loss = result.average_loss if math.isfinite(result.average_loss) else float("nan")
    lines += [f"| average | {100 * result.average_accuracy:.1f} | {100 * result.average_margin():.1f} | "
              f"{average_loss:.3f} | |", "",
              "Every task of the pool is evaluated, merged or not, with its zero-shot head (the class names and "
              f"templates of the pool); the forwards in {PRECISIONS.get(result.forward, result.forward)}, the merge "
              "in fp32.", ""]
    return "\n".join(lines + _reproduce(record))


def _reproduce(record: dict) -> list[str]:
    return ["## Reproduce", "", "```bash",
            f"merger merge --spec {Path(record['weights']).with_suffix('.yaml').name} --out {record['weights']}", "```", ""]


def _source_row(role: str, key: str, entry: dict, hub_sources: dict) -> str:
    hub = hub_sources.get(key)
    if hub:
        return f"| {role} | `{hub['hub']}` | {hub['revision']} |"
    if "lab" in entry:
        return f"| {role} | fine-tuned in the app's expert lab (in memory) | |"
    return f"| {role} | `{Path(entry['path']).name}` | {entry['sha256']} |"


def write_card(weights: Path, text: str) -> Path:
    """README.md beside the weights, unless one is there that merger did not write for these weights
    (a person's notes, or the card of another merge in the same folder): then ``<stem>.README.md``.
    Written to a temporary file and renamed."""
    readme = weights.with_name("README.md")
    names = f"<!-- weights: {weights.name} -->"
    if readme.exists() and (readme.is_symlink() or not readme.is_file() or MARK not in (head := _head(readme))
                            or names not in head):
        readme = weights.with_name(f"{weights.stem}.README.md")
    return checkpoints.write_text_atomic(readme, text.replace(MARK, f"{MARK}\n{names}", 1))


def _architecture(pool) -> str:
    """'ViT-B-32', or for a pool whose YAML gives the model's config itself, 'model (its config in the pool)'."""
    return pool.architecture.get("model") or "model (its configuration given in the pool)"


def _head(path: Path) -> str:
    with open(path, encoding="utf-8", errors="replace") as fh:
        return fh.read(4096)
