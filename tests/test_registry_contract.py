"""Every registered method reaches every surface through the registry alone: the
Merge tab's controls, CLI flags, the evaluate endpoint, auto-tune, sweeps, effective weights,
determinism and the spec YAML. Model Stock against its formula."""
import inspect
import math
from types import SimpleNamespace

import gradio as gr
import pytest
import torch
import yaml
from helpers import ui_controller

import merger
from merger import methods
from merger.analysis.coefficients import effective_weights
from merger.cli import build_parser, method_params
from merger.evaluation.tuning import grid_points, sweep_axes, tunable_methods
from merger.methods import PARAM_NAMES
from merger.methods.model_stock import interpolation_ratio
from merger.ui.controls import param_control
from merger.ui.endpoint import endpoint_params, evaluate_endpoint

ALL = methods.names()


@pytest.fixture(scope="module")
def ctl(tmp_path_factory):
    return ui_controller(tmp_path_factory.mktemp("contract"))


def _flag_value(v):
    return "auto" if v == "auto" else str(v)


@pytest.mark.parametrize("name", ALL)
def test_method_reaches_every_surface(name, ctl):
    m = methods.get(name)
    experts = m.experts_for(ctl.pool.tasks)  # SLERP: two
    T = len(experts)
    # controls: one per parameter name, shown exactly when the method takes it, labelled
    with gr.Blocks():
        built = {n: param_control(n, T, m) for n in PARAM_NAMES}
    for n, c in built.items():
        assert c.visible == (n in m.param_names), (name, n)
        assert c.label and c.label != "", n
    # CLI flags parse, every parameter by its own flag
    defaults = ctl.default_params(m, T)
    argv = ["merge", "--pool", "p.yaml", "--method", name, "--out", "o.safetensors"]
    for n, v in defaults.items():
        argv += ["--" + n.replace("_", "-"), _flag_value(v)]
    args = build_parser().parse_args(argv)
    assert set(method_params(args)) == set(m.param_names)
    spec = ctl.session.spec(name, experts=experts, **method_params(args))
    assert spec.method == name
    # the endpoint takes every slider parameter by name
    endpoint = evaluate_endpoint(ctl)
    assert set(inspect.signature(endpoint).parameters) >= {"method", "experts", "split", *endpoint_params()}
    # effective weights: one per expert
    state = SimpleNamespace(coefficients=torch.full((T, 2), 0.5))
    if m.data_driven:
        assert m.tune_grid is None and name not in tunable_methods() and m.objective
        with pytest.raises(merger.MergerError, match="learns its coefficients"):
            grid_points(name)
        with pytest.raises(gr.Error, match="learns from data"):
            endpoint(name)
        weights, how = m.weights(defaults, T, state)
        assert weights == [0.5] * T and how
        return
    # auto-tune: a grid of valid points; sweeps: every parameter with sweep values is an axis
    points = grid_points(name)
    assert points and name in tunable_methods()
    for p in points:
        m.resolve(p, T)
    for n in m.param_names:
        if m.param(n).sweep:
            assert name in sweep_axes()[n][1]
    # the endpoint evaluates it with its parameters by name, equal to the public API
    kwargs = {k: v for k, v in defaults.items() if k in endpoint_params()}
    out = endpoint(method=name, split="live", experts=experts, **kwargs)
    ref = merger.evaluate(ctl.pool, merger.merge(ctl.pool, name, experts=experts, **kwargs), "live")
    assert out["average_accuracy"] == pytest.approx(ref.average_accuracy)
    weights, how = effective_weights(ctl.session, spec)
    assert len(weights) == T and all(math.isfinite(w) for w in weights) and how
    # determinism: a fresh session gives the same Δ
    d1 = ctl.session.delta(spec.snap())
    d2 = merger.PoolSession(ctl.pool).delta(spec.snap())
    assert all(torch.equal(d1[k], d2[k]) for k in d1)
    # spec YAML round trip
    again = yaml.safe_load(yaml.safe_dump(spec.snap().as_dict()))
    assert ctl.session.spec(again["method"], experts=again["experts"], **(again.get("params") or {})).snap() \
        == spec.snap()


def test_registering_a_method_without_its_surfaces_fails_at_import():
    from merger.methods.registry import Method, Paper, register

    bare = Method(name="bare", display_name="Bare", paper=Paper("x", "0"), description="d", params=(),
                  prepare=lambda tv: None, apply=lambda s: {})
    with pytest.raises(ValueError, match="weights.*tune_grid"):
        register(bare)
    assert "bare" not in methods.names()


def test_model_stock_ratio_formula():
    k = 4
    assert float(interpolation_ratio(torch.tensor(1.0), k)) == pytest.approx(1.0)  # cos θ = 1: θavg
    assert float(interpolation_ratio(torch.tensor(0.0), k)) == pytest.approx(0.0)  # cos θ = 0: θ0
    c = 0.3
    assert float(interpolation_ratio(torch.tensor(c), k)) == pytest.approx(k * c / (1 + (k - 1) * c))
    assert float(interpolation_ratio(torch.tensor(-0.5), k)) == 0.0  # clamped: t stays a ratio


def test_model_stock_on_random_state_dicts():
    g = torch.Generator().manual_seed(0)
    base = {"visual.a": torch.randn(6, 5, generator=g), "visual.b": torch.randn(7, generator=g)}
    experts = [{k: v + torch.randn(v.shape, generator=g) for k, v in base.items()} for _ in range(3)]
    merged = merger.merge_state_dicts(base, experts, "model_stock")
    for key in base:
        taus = torch.stack([e[key] - base[key] for e in experts]).reshape(3, -1)
        unit = taus / taus.norm(dim=1, keepdim=True)
        cos = float(sum(unit[i] @ unit[j] for i in range(3) for j in range(3) if i != j) / 6)
        t = 3 * max(cos, 0.0) / (1 + 2 * max(cos, 0.0))
        avg = sum(e[key] for e in experts) / 3
        assert torch.allclose(merged[key], t * avg + (1 - t) * base[key], atol=1e-5)
    # identical experts: cos θ = 1, t = 1, the average (= each expert)
    same = merger.merge_state_dicts(base, [experts[0]] * 3, "model_stock")
    assert all(torch.allclose(same[k], experts[0][k], atol=1e-5) for k in base)
    # orthogonal task vectors: cos θ = 0, t = 0, the base
    ortho = [{"visual.a": base["visual.a"] + _basis(i), "visual.b": base["visual.b"]} for i in range(2)]
    out = merger.merge_state_dicts(base, ortho, "model_stock")
    assert torch.allclose(out["visual.a"], base["visual.a"], atol=1e-6)


def _basis(i):
    e = torch.zeros(6, 5)
    e[i, i] = 1.0
    return e


def test_model_stock_says_where_its_merge_lies(ctl):
    from helpers import controls

    summary = ctl.preview(*controls(ctl, "model_stock"))[3]
    spec = ctl.session.spec("model_stock")
    ratio = ctl.session.prepared_state(spec)["ratio"]
    t = sum(ratio.values()) / len(ratio)
    assert f"t averages {t:.2f} over tensors" in summary and f"{100 * t:.0f} % of the way" in summary
