"""The documentation a user reads: the methods page is what the registry writes, the README and
ARCHITECTURE stay short, and no document or source points at something outside the repository."""
import re
import subprocess
import sys
from pathlib import Path

from merger.catalogue import methods_markdown

REPO = Path(__file__).resolve().parents[1]


def test_the_methods_page_is_what_the_registry_writes():
    page = (REPO / "docs" / "methods.md").read_text(encoding="utf-8")
    assert page == methods_markdown(), "docs/methods.md is stale: python -m merger methods --markdown > docs/methods.md"


def test_the_methods_command_prints_the_page():
    out = subprocess.run([sys.executable, "-m", "merger", "methods", "--markdown"], capture_output=True, text=True,
                         timeout=120, cwd=REPO)
    assert out.returncode == 0 and out.stdout == methods_markdown()


def test_every_method_is_on_the_page_with_its_paper_and_parameters():
    from merger import methods

    page = methods_markdown()
    for m in methods.all_methods():
        section = page.split(f"## `{m.name}`: ", 1)[1].split("\n## ", 1)[0]
        assert m.description in section and (m.paper.arxiv in section if m.paper.arxiv else True)
        assert all(f"| `{p.name}` | {p.range_text()} |" in section for p in m.params)
        assert m.conventions in section


def test_the_readme_and_the_map_are_short():
    assert len((REPO / "README.md").read_bytes()) <= 12 * 1024
    assert len((REPO / "ARCHITECTURE.md").read_bytes()) <= 12 * 1024


OUTSIDE = re.compile(r"\b[Ii]ssues? \d|\bseed 00\d|\.\./shared|\bMETHODS\.md|\bDESIGN\.md|shared/papers")


def test_nothing_points_outside_the_repository():
    files = subprocess.run(["git", "ls-files", "-co", "--exclude-standard"], capture_output=True, text=True,
                           cwd=REPO).stdout.split()
    if not files:  # not a git checkout (an unpacked archive): every text file under the root
        files = [str(p.relative_to(REPO)) for p in REPO.rglob("*") if p.is_file()]
    found = []
    for name in files:
        if not name.endswith((".py", ".md", ".sh", ".toml", ".yaml", ".txt")) or name == "tests/test_docs.py":
            continue
        for number, line in enumerate((REPO / name).read_text(encoding="utf-8").splitlines(), 1):
            if OUTSIDE.search(line):
                found.append(f"{name}:{number}: {line.strip()[:100]}")
    assert found == []
