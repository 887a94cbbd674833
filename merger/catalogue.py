"""The methods page (docs/methods.md), written from the registry alone, so it cannot drift from
the code: ``merger methods --markdown``. tests/test_docs.py checks the page in the repository
equals what this writes."""
from __future__ import annotations

from merger.methods.registry import Method, Param, all_methods

HEADER = """\
# Methods

Every method merger offers, written from its registry record by `merger methods --markdown`
(`merger/catalogue.py`); edit the method's file in `merger/methods/`, not this page.
`tests/test_docs.py` fails when the two differ.

θ0 is the base, θt expert t's weights, τt = θt − θ0 its task vector, T the number of merged
experts, r = min(m, n) for an m × n matrix. *Matrices* are the 2-D attention and MLP weights of
the image tower (in_proj, out_proj, c_fc, c_proj). Every static merge equals an fp64 evaluation of
its definition within 1e-4 relative Frobenius error per matrix at real-size shapes
(`docs/precision.md`).

Parameters are named the same in the Python API, the command line (`--rank-ratio` for
`rank_ratio`), spec files, the `evaluate` endpoint and the app. Every static method also takes
per-task weights wₜ (`task_weights`, each τt times wₜ before the method combines them) and
per-block weights (`block_weights`, the merge's Δ times b_g in a block group), each in [-3, 3],
default 1; all ones is the plain method, bit for bit.

*Published* numbers are the average absolute accuracy (%) over the 8-task CLIP suite (SUN397,
Cars, RESISC45, EuroSAT, SVHN, GTSRB, MNIST, DTD); the app draws them as guide lines on real pools.
"""


def _default(p: Param, m: Method) -> str:
    if p.default is None:
        return "depends on T"
    if p.default == "auto":
        return f"auto ({p.auto})"
    return f"{p.default:g}" if isinstance(p.default, (int, float)) else str(p.default)


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def _kind(m: Method) -> str:
    if m.data_driven:
        return f"data-driven (a Run, minimising {m.objective})" if m.objective else "data-driven (a Run)"
    return "static (sliders)"


def _published(m: Method) -> str:
    return "; ".join(f"{p.architecture} {p.accuracy:g}{'' if p.verified else ' (unverified)'}" for p in m.published)


def method_section(m: Method) -> str:
    lines = [f"## `{m.name}`: {m.display_name}", "",
             f"*{m.paper.title}*" + (f", arXiv:{m.paper.arxiv}" if m.paper.arxiv else "") + ". "
             + _kind(m)[:1].upper() + _kind(m)[1:] + "." + (f" Also named {', '.join(f'`{a}`' for a in m.aliases)}." if m.aliases else "")
             + (f" Merges exactly {m.num_experts} experts." if m.num_experts else ""), "",
             f"**Merged weights.** {m.description}", ""]
    if m.params:
        lines += ["| parameter | range | step | default | meaning |", "| --- | --- | --- | --- | --- |"]
        lines += [f"| `{p.name}` | {p.range_text()} | {p.step:g} | {_cell(_default(p, m))} | {_cell(p.help)} |"
                  for p in m.params]
    else:
        lines.append("No parameters.")
    lines.append("")
    if m.conventions:
        lines += [f"**Conventions** (where the authors' code, FusionBench or mergekit differ). {m.conventions}", ""]
    for p in m.published:
        lines.append(f"- Published: {p.architecture} {p.accuracy:g} %, {p.source}"
                     + ("" if p.verified else " (not found in the authors' repository: unverified)") + ".")
    if m.published:
        lines.append("")
    return "\n".join(lines)


def methods_markdown() -> str:
    rows = ["| name | method | kind | paper | published |", "| --- | --- | --- | --- | --- |"]
    rows += [f"| `{m.name}` | {m.display_name} | {_kind(m).split(' (')[0]} | "
             f"{f'arXiv:{m.paper.arxiv}' if m.paper.arxiv else m.paper.title} | {_published(m)} |"
             for m in all_methods()]
    return "\n".join([HEADER, *rows, "", *(method_section(m) for m in all_methods())]).rstrip() + "\n"
