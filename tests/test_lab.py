"""The expert lab: settings checked by field, deterministic fine-tuning, experts added to the pool."""
import pytest
import torch

import merger
from merger import lab
from merger.errors import MergerError
from helpers import write_pool


@pytest.fixture(scope="module")
def ex(tmp_path_factory):
    pool = merger.open_pool(write_pool(tmp_path_factory.mktemp("labpool"), n_experts=2, scale=0.1, demo_data=True))
    return merger.Explorer(pool)


@pytest.mark.parametrize("field, value, message", [
    ("epochs", 0, "epochs=0 must be between 1"),
    ("lr", 0, "lr=0.0 must be > 0"),
    ("lr", -1e-3, "lr=-0.001 must be > 0"),
    ("data_fraction", 0, "data_fraction=0.0 must be in \\(0, 1\\]"),
    ("data_fraction", 1.5, "data_fraction=1.5 must be in \\(0, 1\\]"),
    ("epochs", "many", "epochs='many' is not a number"),
])
def test_settings_out_of_range_name_the_field(field, value, message):
    settings = {"lr": 1e-3, "epochs": 1, "batch_size": 64, "data_fraction": 1.0, "seed": 0, field: value}
    with pytest.raises(MergerError, match=message):
        lab.check_settings(**settings)


def test_lab_runs_are_deterministic_and_join_the_pool(ex):
    pool = ex.pool
    t = pool.tasks[0]
    s = lab.check_settings(lr=1e-3, epochs=1, batch_size=64, data_fraction=0.5, seed=3)
    a, traj_a, hp = lab.finetune(pool, t, s)
    b, _, _ = lab.finetune(pool, t, s)
    assert all(torch.equal(a[k], b[k]) for k in a)
    c, _, _ = lab.finetune(pool, t, {**s, "seed": 4})
    assert not all(torch.equal(a[k], c[k]) for k in a)
    assert len(traj_a) == 1 and hp["data_fraction"] == 0.5
    before = ex.preview(ex.spec("task_arithmetic", lam=0.3))
    lab.add_expert(ex, f"{t}@lab", t, a, hp, traj_a)
    assert pool.tasks[-1] == f"{t}@lab" and pool.task_vectors.num_tasks == 3
    res = ex.preview(ex.spec("task_arithmetic", lam=0.3, experts=[t, f"{t}@lab"]))
    assert f"{t}@lab" in res.accuracy and before is not res
    assert ex.experts("live")[f"{t}@lab"] > 0
    with pytest.raises(MergerError, match="already exists"):
        lab.add_expert(ex, f"{t}@lab", t, a)


def test_lab_needs_the_demo_world(tiny_pool):
    pool = merger.open_pool(tiny_pool)
    with pytest.raises(MergerError, match="fine-tunes in the demo world"):
        lab.finetune(pool, pool.tasks[0], lab.check_settings(1e-3, 1, 8, 1.0, 0))


def test_trend_fit_is_a_least_squares_line_in_g():
    fit = lab.fit_trend("lr", [1e-3, 2e-3, 3e-3], [1 + 5e4 * x ** 2 for x in (1e-3, 2e-3, 3e-3)])
    assert fit["a"] == pytest.approx(1.0) and fit["b"] == pytest.approx(5e4, rel=1e-6)
    assert "trend" in fit["label"]


def test_lab_expert_has_its_epoch_dynamics(ex):
    from merger import analysis, trajectories
    from merger.landscape import Landscape

    t = ex.pool.tasks[1]
    sd, traj, hp = lab.finetune(ex.pool, t, lab.check_settings(1e-3, 2, 64, 1.0, 0))
    lab.add_expert(ex, f"{t}@2ep", t, sd, hp, traj)
    path = trajectories.finetune_trajectory(Landscape(ex), f"{t}@2ep")
    d = analysis.epoch_dynamics(path.points)
    assert len(d["shares"]) == 2 and sum(d["shares"]) == pytest.approx(1.0)
