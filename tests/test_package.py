"""The installed package: ``pip install .`` gives a wheel that holds the product (with its demo pool)
and none of the workshop, and whose ``merger`` and ``merger-app`` commands run outside the checkout."""
import os
import shutil
import subprocess
import sys
import venv
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def wheel(tmp_path_factory):
    out, source = tmp_path_factory.mktemp("wheel"), tmp_path_factory.mktemp("source")
    # a copy: setuptools builds in the source's own build/ folder, which must not land in the checkout
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(REPO / name, source / name)
    shutil.copytree(REPO / "merger", source / "merger", ignore=shutil.ignore_patterns("__pycache__"))
    # no build isolation: the build backend (setuptools) is the one here, so no download is needed
    res = subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", str(source), "--no-deps", "--no-build-isolation",
                          "-w", str(out)], capture_output=True, text=True, timeout=600, cwd=out)
    if res.returncode and "No module named" in res.stderr and "setuptools" in res.stderr:
        pytest.skip("setuptools is not installed here: the wheel cannot be built offline")
    assert res.returncode == 0, res.stderr
    (built,) = out.glob("merger-*.whl")
    return built


def test_the_wheel_holds_the_product_and_its_demo_but_no_workshop(wheel):
    names = zipfile.ZipFile(wheel).namelist()
    tops = {n.split("/")[0] for n in names}
    assert {t for t in tops if not t.endswith(".dist-info")} == {"merger"}  # no devtools, tests, app.py
    assert not [n for n in names if "devtools" in n]
    demo = {n.removeprefix("merger/demo/assets/") for n in names if n.startswith("merger/demo/assets/")}
    assert {"pool.yaml", "manifest.json", "base.safetensors"} <= demo
    assert "merger/pool/clip_tasks.yaml" in names  # the known benchmarks' class names and templates
    entry_points = zipfile.ZipFile(wheel).read(next(n for n in names if n.endswith("entry_points.txt"))).decode()
    assert "merger = merger.cli:run" in entry_points and "merger-app = merger.serve:run" in entry_points


def test_the_installed_commands_run_outside_the_checkout(wheel, tmp_path):
    env_dir = tmp_path / "venv"
    # the dependencies are this interpreter's; the package is the wheel's alone
    venv.EnvBuilder(system_site_packages=True, with_pip=False).create(env_dir)
    bin_dir = env_dir / ("Scripts" if os.name == "nt" else "bin")
    python = bin_dir / ("python.exe" if os.name == "nt" else "python")
    res = subprocess.run([sys.executable, "-m", "pip", "--python", str(python), "install", "-q", "--no-deps",
                          "--no-index", str(wheel)], capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stderr
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    away = tmp_path / "elsewhere"  # not the checkout: `import merger` must find the installed one
    away.mkdir()

    def run(*argv):
        return subprocess.run([str(bin_dir / argv[0]), *argv[1:]], capture_output=True, text=True, timeout=600,
                              cwd=away, env=env)

    where = subprocess.run([str(python), "-c", "import merger; print(merger.__file__)"], capture_output=True,
                           text=True, cwd=away, env=env)
    assert str(env_dir) in where.stdout, where.stdout + where.stderr
    res = run("merger", "--help")
    commands = res.stdout.split("{", 1)[1].split("}", 1)[0].split(",")
    assert res.returncode == 0 and "merge" in commands and "bench" not in commands, res.stderr
    # the demo pool ships in the wheel (its live split: the same files as the test split's, in seconds less)
    res = run("merger", "eval", "--pool", "demo", "--method", "task_arithmetic", "--lam", "0.3", "--split", "live")
    assert res.returncode == 0 and "average" in res.stdout, res.stderr
    res = run("merger-app", "--port", "0")
    assert res.returncode == 2 and "--port" in res.stderr  # the app's own flags, checked before anything opens
    res = run("merger", "app", "--help")
    assert res.returncode == 0 and "--memory-gb" in res.stdout
