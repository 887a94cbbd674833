"""A new method is one file: a copy of the package plus one file in methods/, with a
parameter no other method has, reaches the CLI, the endpoint, the Merge tab's controls, auto-tune,
sweeps, the registry's effective weights and the spec YAML, with no other edit."""
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

NEW_METHOD = '''
"""Sign-consistent scaling: a toy method for the one-file test."""
from merger.methods.registry import Method, Paper, Param, frange, register, sum_weights


def prepare(tv):
    return {"sum": {k: v.sum(0) for k, v in tv.stacked.items()}}


def apply(prepared, temperature):
    return {k: v * (1.0 / temperature) for k, v in prepared["sum"].items()}


register(Method(
    name="toy_scale", display_name="Toy scale", paper=Paper("A toy", ""),
    description="Σ τt / temperature.",
    params=(Param("temperature", 4.0, 0.5, 20.0, 0.5, label="temperature T", sweep=(1.0, 2.0, 4.0, 8.0),
                  help="divides the summed task vectors"),),
    prepare=prepare, apply=apply, tune_grid={"temperature": frange(1.0, 8.0, 1.0)},
    weights=lambda params, T, state: ([1.0 / params["temperature"]] * T, "1/temperature per task"),
))
'''

PROBE = '''
import gradio as gr, torch, yaml
import merger
from merger import methods
from merger.analysis.coefficients import effective_weights
from merger.cli import build_parser, method_params
from merger.evaluation.tuning import grid_points, sweep_axes
from merger.ui.controls import param_control
from merger.ui.endpoint import endpoint_params, evaluate_endpoint
from merger.ui.merge_tab import Controller

pool = merger.open_pool({pool!r})
m = methods.get("toy_scale")
args = build_parser().parse_args(["merge", "--pool", "p", "--method", "toy_scale", "--temperature", "2", "--out", "o"])
assert method_params(args) == {{"temperature": 2}}  # a number read as one
assert "temperature" in endpoint_params()
with gr.Blocks():
    c = param_control("temperature", len(pool.tasks), m)
assert c.visible and c.label == "temperature T"
assert len(grid_points("toy_scale")) == 8 and "toy_scale" in sweep_axes()["temperature"][1]
ctl = Controller(merger.PoolSession(pool))
out = evaluate_endpoint(ctl)(method="toy_scale", temperature=2.0)
ref = merger.evaluate(pool, merger.merge(pool, "task_arithmetic", lam=0.5), "live")
assert abs(out["average_accuracy"] - ref.average_accuracy) < 1e-9, (out["average_accuracy"], ref.average_accuracy)
spec = ctl.session.spec("toy_scale", temperature=2.0)
assert effective_weights(ctl.session, spec)[0] == [0.5] * len(pool.tasks)
again = yaml.safe_load(yaml.safe_dump(spec.as_dict()))
assert ctl.session.spec(again["method"], **again["params"]) == spec
print("reached every surface")
'''


def test_a_method_with_a_new_parameter_needs_one_new_file_and_nothing_else(tmp_path):
    from helpers import write_pool

    copy = tmp_path / "repo"
    shutil.copytree(REPO / "merger", copy / "merger", ignore=shutil.ignore_patterns("__pycache__"))
    (copy / "merger" / "methods" / "toy_scale.py").write_text(textwrap.dedent(NEW_METHOD))
    pool = write_pool(tmp_path / "pool", n_experts=2, scale=0.2, demo_data=True)
    out = subprocess.run([sys.executable, "-c", PROBE.format(pool=str(pool))], cwd=copy, capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "reached every surface" in out.stdout
