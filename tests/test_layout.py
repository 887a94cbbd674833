"""The code's shape: no import cycles, the engine never imports a front end, methods
are named through the registry only, modules stay small. The counter is checked on a small
package with each defect, so a passing count means something."""
import subprocess
import sys

from devtools.layout import MAX_LINES, read_layout


def test_the_code_has_no_cycles_no_front_end_imports_no_method_name_literals():
    layout = read_layout()
    assert layout.cycles() == []
    assert layout.engine_imports_of_front_ends() == []
    assert layout.method_name_literals() == []
    assert layout.long_modules() == []
    assert layout.workshop_imports() == []
    # the counter sees the whole package, lazy imports included
    assert "merger.evaluation.session" in layout.modules and "merger.ui.merge_tab" in layout.modules
    assert "merger.serve" in layout.imports["merger.cli"]  # inside main, for `merger app`


def test_the_counter_finds_each_defect(tmp_path):
    pkg = tmp_path / "merger"
    (pkg / "ui").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "ui" / "__init__.py").write_text("")
    (pkg / "a.py").write_text("def f():\n    from merger import b  # lazy, still a cycle\n")
    (pkg / "b.py").write_text("from merger.a import f\nimport gradio\nNAME = 'ties'\nDOC = 'ties merging'\n")
    (pkg / "c.py").write_text("from merger.ui import tab\n" + "x = 1\n" * MAX_LINES)
    (pkg / "ui" / "tab.py").write_text("METHOD = 'cart'\n")
    (pkg / "d.py").write_text("def bench():\n    from devtools import bench  # not installed\n")
    layout = read_layout(pkg)
    assert layout.cycles() == [["merger.a", "merger.b"]]
    assert ("merger.c", "merger.ui.tab") in layout.engine_imports_of_front_ends()
    assert ("merger.b", "gradio") in layout.engine_imports_of_front_ends()
    assert [(m, v) for m, _, v in layout.method_name_literals()] == [("merger.b", "ties"), ("merger.ui.tab", "cart")]
    assert layout.long_modules() == [("merger.c", MAX_LINES + 1)]
    assert layout.workshop_imports() == ["merger.d"]
    assert not layout.clean()


def test_report_layout_prints_the_counts():
    out = subprocess.run([sys.executable, "-m", "devtools", "report", "layout"], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    assert "import cycles: 0" in out.stdout and "method-name literals outside merger/methods/: 0" in out.stdout
