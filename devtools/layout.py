"""``python -m devtools report layout``: the code's shape, counted from its source.

- import cycles among merger's modules (every import statement, lazy ones included);
- engine modules that import a front end (the UI, the CLI, the server) or Gradio;
- any module of the package that imports the workshop (``devtools``, which is not installed);
- method-name string literals outside ``merger/methods/`` (a method is named through its
  registry record, so a new method is one file);
- modules over the size limit.
"""
from __future__ import annotations

import ast
import io
import tokenize
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

from merger import methods

ROOT = Path(methods.__file__).resolve().parents[1]  # the merger package
FRONT_ENDS = ("merger.ui", "merger.cli", "merger.cli_jobs", "merger.cli_reports", "merger.serve", "merger.__main__")
WORKSHOP = "devtools"
FOREIGN_UI = ("gradio", "gradio_client", "playwright")
MAX_LINES = 400


@dataclass
class Layout:
    modules: dict[str, Path]
    imports: dict[str, set[str]]  # module -> merger modules it imports
    external: dict[str, set[str]]  # module -> top-level names of other packages it imports

    def cycles(self) -> list[list[str]]:
        """Strongly connected components of more than one module (Tarjan)."""
        index, low, stack, on, out, counter = {}, {}, [], set(), [], [0]

        def visit(v):
            index[v] = low[v] = counter[0]
            counter[0] += 1
            stack.append(v)
            on.add(v)
            for w in sorted(self.imports[v]):
                if w not in index:
                    visit(w)
                    low[v] = min(low[v], low[w])
                elif w in on:
                    low[v] = min(low[v], index[w])
            if low[v] == index[v]:
                comp = []
                while True:
                    w = stack.pop()
                    on.discard(w)
                    comp.append(w)
                    if w == v:
                        break
                if len(comp) > 1:
                    out.append(sorted(comp))

        for v in sorted(self.modules):
            if v not in index:
                visit(v)
        return out

    def engine(self) -> list[str]:
        return [m for m in self.modules if not is_front_end(m)]

    def engine_imports_of_front_ends(self) -> list[tuple[str, str]]:
        bad = [(m, t) for m in self.engine() for t in sorted(self.imports[m]) if is_front_end(t)]
        bad += [(m, t) for m in self.engine() for t in sorted(self.external[m]) if t in FOREIGN_UI]
        return bad

    def workshop_imports(self) -> list[str]:
        """Modules of the package that import ``devtools``: an installed merger would fail there."""
        return sorted(m for m in self.modules if WORKSHOP in self.external[m])

    def clean(self) -> bool:
        return not (self.cycles() or self.engine_imports_of_front_ends() or self.workshop_imports()
                    or self.method_name_literals())

    def method_name_literals(self, outside: str = "merger.methods") -> list[tuple[str, int, str]]:
        """(module, line, literal) for every string literal equal to a method's name or alias."""
        named = set(methods.names()) | {a for m in methods.all_methods() for a in m.aliases}
        found = []
        for mod, path in sorted(self.modules.items()):
            if mod == outside or mod.startswith(outside + "."):
                continue
            tokens = tokenize.generate_tokens(io.StringIO(path.read_text(encoding="utf-8")).readline)
            for tok in tokens:
                if tok.type != tokenize.STRING:
                    continue
                try:
                    value = ast.literal_eval(tok.string)
                except (ValueError, SyntaxError):  # f-strings with fields
                    continue
                if isinstance(value, str) and value in named:
                    found.append((mod, tok.start[0], value))
        return found

    def long_modules(self, limit: int = MAX_LINES) -> list[tuple[str, int]]:
        sizes = ((m, len(p.read_text(encoding="utf-8").splitlines())) for m, p in self.modules.items())
        return sorted(((m, n) for m, n in sizes if n > limit), key=lambda x: -x[1])


def is_front_end(module: str) -> bool:
    return any(module == f or module.startswith(f + ".") for f in FRONT_ENDS)


def read_layout(root: Path = ROOT) -> Layout:
    modules = {}
    for path in root.rglob("*.py"):
        parts = ("merger",) + path.relative_to(root).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        modules[name] = path
    imports, external = defaultdict(set), defaultdict(set)
    for mod, path in modules.items():
        package = mod if path.name == "__init__.py" else mod.rsplit(".", 1)[0]
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            targets = []
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    parts = package.split(".")
                    base = ".".join(parts[: len(parts) - node.level + 1] + ([node.module] if node.module else []))
                subs = [f"{base}.{a.name}" for a in node.names if f"{base}.{a.name}" in modules]
                # "from package import submodule" depends on the submodule, not on the package
                targets = subs if len(subs) == len(node.names) else subs + [base]
            for t in targets:
                if not t.startswith("merger"):
                    external[mod].add(t.split(".")[0])
                    continue
                while t not in modules and "." in t:
                    t = t.rsplit(".", 1)[0]
                if t in modules and t != mod:
                    imports[mod].add(t)
    return Layout(modules, imports, external)


def format_layout(layout: Layout) -> str:
    cycles = layout.cycles()
    bad = layout.engine_imports_of_front_ends()
    literals = layout.method_name_literals()
    long = layout.long_modules()
    lines = [f"modules: {len(layout.modules)} ({len(layout.engine())} engine, "
             f"{len(layout.modules) - len(layout.engine())} front end: {', '.join(FRONT_ENDS)})",
             f"import cycles: {len(cycles)}"]
    lines += [f"  {' <-> '.join(c)}" for c in cycles]
    lines.append(f"engine imports of a front end or a UI library: {len(bad)}")
    lines += [f"  {m} imports {t}" for m, t in bad]
    workshop = layout.workshop_imports()
    lines.append(f"package modules importing {WORKSHOP}: {len(workshop)}")
    lines += [f"  {m}" for m in workshop]
    lines.append(f"method-name literals outside merger/methods/: {len(literals)}")
    lines += [f"  {m}:{line}: {v!r}" for m, line, v in literals]
    lines.append(f"modules over {MAX_LINES} lines: {len(long)}")
    lines += [f"  {m}: {n}" for m, n in long]
    return "\n".join(lines)
