"""The expert lab: settings checked by field, deterministic fine-tuning, experts added to the pool."""
import pytest
import torch
from helpers import write_pool

import merger
from merger.analysis import lab
from merger.ui import lab_tab
from merger.errors import MergerError


@pytest.fixture(scope="module")
def ex(tmp_path_factory):
    pool = merger.open_pool(write_pool(tmp_path_factory.mktemp("labpool"), n_experts=2, scale=0.1, demo_data=True))
    return merger.PoolSession(pool)


@pytest.mark.parametrize("field, value, message", [
    ("optimizer", "lion", "optimiser 'lion' must be one of adamw, sgd"),
    ("schedule", "step", "schedule 'step' must be one of cosine, constant"),
    ("momentum", 1.0, "momentum 1.0 must be in \\[0, 1\\)"),
    ("weight_decay", -0.1, "weight decay -0.1 must be in \\[0, 10\\]"),
    ("batch_size", -1, "batch size -1 must be between 1 and 100000 \\(or 0"),
    ("epochs", 0, "epochs 0 must be between 1"),
    ("lr", 0, "learning rate 0.0 must be > 0"),
    ("lr", -1e-3, "learning rate -0.001 must be > 0"),
    ("data_fraction", 0, "data fraction 0.0 must be in \\(0, 1\\]"),
    ("data_fraction", 1.5, "data fraction 1.5 must be in \\(0, 1\\]"),
    ("epochs", "many", "epochs 'many' is not a number"),
    ("seed", 1e30, "seed 1000000000000000019884624838656 must be between 0 and 2147483647"),
    ("seed", -4, "seed -4 must be between 0 and 2147483647"),
])
def test_settings_out_of_range_name_the_field(field, value, message):
    settings = {"lr": 1e-3, "epochs": 1, "batch_size": 64, "data_fraction": 1.0, "seed": 0, field: value}
    with pytest.raises(MergerError, match=message):
        lab.check_settings(**settings)


def test_lab_runs_are_deterministic_and_join_the_pool(ex, tmp_path):
    pool = ex.pool
    t = pool.tasks[0]
    s = lab.check_settings(lr=1e-3, epochs=1, batch_size=64, data_fraction=0.5, seed=3)
    a, traj_a, hp = lab.finetune(merger.session_for(pool), t, s)
    b, _, _ = lab.finetune(merger.session_for(pool), t, s)
    assert all(torch.equal(a[k], b[k]) for k in a)
    c, _, _ = lab.finetune(merger.session_for(pool), t, {**s, "seed": 4})
    assert not all(torch.equal(a[k], c[k]) for k in a)
    assert len(traj_a) == 1 and hp["data_fraction"] == 0.5
    tasks = list(pool.tasks)
    before = ex.preview(ex.spec("task_arithmetic", lam=0.3))
    lab.add_expert(ex, f"{t}@lab", t, a, hp, traj_a, owner="person-a")
    # an expert joins, the tasks do not: results stay over the pool's tasks
    assert pool.tasks == tasks and pool.experts[-1] == f"{t}@lab" and pool.task_vectors.num_tasks == 3
    assert ex.preview(ex.spec("task_arithmetic", lam=0.3)) is before  # nothing cached was thrown away
    res = ex.preview(ex.spec("task_arithmetic", lam=0.3, experts=[t, f"{t}@lab"]))
    assert list(res.accuracy) == tasks and res is not before
    assert ex.expert_accuracy("live") == before.expert_accuracy  # the reference marks are the pool's experts
    assert ex.expert_task_accuracy(f"{t}@lab", "live") > 0
    from merger.ui.merge_tab import Controller

    spec = ex.spec("task_arithmetic", lam=0.3, experts=[t, f"{t}@lab"]).snap()  # as the controls make it
    assert "over 2 experts (1 from the lab)" in Controller(ex).summary(spec, res, False)  # it read "2 of 2"
    assert lab.lab_experts(pool, owner="person-a") == [f"{t}@lab"] and lab.lab_experts(pool, owner="person-b") == []
    with pytest.raises(MergerError, match="already exists"):
        lab.add_expert(ex, f"{t}@lab", t, a)
    # a merge with it exports (it crashed on the lab expert's missing file), saying what the expert was
    import yaml
    from safetensors.torch import load_file

    from merger.io.export import export_merge

    spec = ex.spec("task_arithmetic", lam=0.3, experts=[t, f"{t}@lab"]).snap()  # as the controls make it
    weights, spec_yaml = export_merge(pool, spec, tmp_path / "m.safetensors")
    record = yaml.safe_load(spec_yaml.read_text())
    assert "expert lab" in record["expert_files"][f"{t}@lab"]["lab"] and "sha256" in record["expert_files"][t]
    merged = merger.merge(pool, "task_arithmetic", lam=0.3, experts=[t, f"{t}@lab"])
    assert all(torch.equal(load_file(weights)[k], merged[k]) for k in merged)


def test_lab_needs_the_demo_world(tiny_pool):
    pool = merger.open_pool(tiny_pool)
    with pytest.raises(MergerError, match="fine-tunes in the demo world"):
        lab.finetune(merger.session_for(pool), pool.tasks[0], lab.check_settings(1e-3, 1, 8, 1.0, 0))


def test_trend_fit_is_a_least_squares_line_in_g():
    fit = lab.fit_trend("lr", [1e-3, 2e-3, 3e-3], [1 + 5e4 * x ** 2 for x in (1e-3, 2e-3, 3e-3)])
    assert fit["a"] == pytest.approx(1.0) and fit["b"][0] == pytest.approx(5e4, rel=1e-6)
    assert "trend" in fit["label"]


def test_steps_and_tasks_trends_are_trade_offs_not_lines():
    ks = [1, 2, 4, 8, 16]
    fit = lab.fit_trend("epochs", ks, [0.5 + 0.02 * k + 0.8 / k for k in ks])  # U-shaped in K
    assert fit["a"] == pytest.approx(0.5) and fit["b"] == pytest.approx([0.02, 0.8], rel=1e-6)
    ys = fit["y"]
    low = ys.index(min(ys))
    assert 0 < low < len(ys) - 1  # the fitted trend has its minimum inside: a trade-off
    ns = [1, 2, 3, 5, 7]
    fit = lab.fit_trend("num_tasks", ns, [0.3 + 0.05 * n + 0.2 / n ** 0.5 for n in ns])
    assert fit["b"] == pytest.approx([0.05, 0.2], rel=1e-6)
    with pytest.raises(MergerError, match="at least 3 values"):
        lab.fit_trend("epochs", [1, 2], [0.5, 0.4])


def test_a_trend_keeps_the_papers_signs_and_names_the_term_the_points_run_against():
    """Every term of the paper's bound is ≥ 0. Points that fall with N get b = 0, not the negative b
    an unconstrained fit drew under the label "heterogeneity accumulates"; the fit is still optimal
    under the signs (KKT: no gradient on the free constants, none downhill on the one held at 0)."""
    ns = [1, 2, 3, 5, 7]
    ys = [0.5 - 0.02 * n + 0.1 / n ** 0.5 for n in ns]
    fit = lab.fit_trend("num_tasks", ns, ys)
    A = torch.tensor([[1.0, n, n ** -0.5] for n in ns], dtype=torch.float64)
    y = torch.tensor(ys, dtype=torch.float64)
    assert torch.linalg.lstsq(A, y[:, None]).solution[1, 0] < 0  # what was drawn before
    assert fit["b"][0] == 0 and fit["b"][1] > 0 and fit["against"] == ["b·N"]
    assert "R² 0." in fit["label"] and "the points run against b·N (fitted 0)" in fit["label"]
    coef = torch.tensor([fit["a"], *fit["b"]], dtype=torch.float64, requires_grad=True)
    ((A @ coef - y) ** 2).sum().backward()
    assert abs(coef.grad[0]) < 1e-10 and abs(coef.grad[2]) < 1e-10 and coef.grad[1] > 0
    flat = lab.fit_trend("batch_size", [32, 64, 128], [0.30, 0.35, 0.37])  # rises with B: against b/B
    assert flat["b"] == [0.0] and flat["a"] == pytest.approx(0.34) and flat["against"] == ["b/B"]
    exact = lab.fit_trend("epochs", [1, 2, 4], [1.3, 0.94, 0.78])
    assert exact["r2"] == pytest.approx(1.0) and "passes through them" in exact["label"]


def test_lab_expert_has_its_epoch_dynamics(ex):
    from merger.analysis import diagnostics as analysis
    from merger.landscape import trajectories

    t = ex.pool.tasks[1]
    sd, traj, hp = lab.finetune(ex, t, lab.check_settings(1e-3, 2, 64, 1.0, 0))
    lab.add_expert(ex, f"{t}@2ep", t, sd, hp, traj)
    path = trajectories.finetune_trajectory(ex.landscape, f"{t}@2ep")
    d = analysis.epoch_dynamics(path.points)
    assert len(d["shares"]) == 2 and sum(d["shares"]) == pytest.approx(1.0)


def test_scaling_view_merges_by_weight_averaging_with_its_default_names(ex):
    t = ex.pool.tasks[0]
    base = lab.check_settings(1e-3, 1, 64, 0.5, 0)
    r = lab.scaling_view(ex, "lr", [1e-3, 2e-3], base, [t])
    made = [n for n in ex.pool.experts if n.startswith(f"{t}@lr=")]
    assert [n.rsplit("-", 1)[0] for n in made] == [f"{t}@lr=0.001", f"{t}@lr=0.002"]
    wa = ex.preview(ex.spec("weight_averaging", experts=made[:1]), "test")
    assert r["accuracy"][0] == pytest.approx(wa.accuracy[t]) and "weight averaging" in r["merge"]
    assert lab.scaling_view(ex, "lr", [1e-3, 2e-3], base, [t])["loss"] == r["loss"]  # the same settings: reused
    assert len([n for n in ex.pool.experts if n.startswith(f"{t}@lr=")]) == 2
    # other settings are other experts (a view run again with another optimiser showed the first one's)
    other = lab.scaling_view(ex, "lr", [1e-3, 2e-3], {**base, "seed": 1}, [t])
    assert len([n for n in ex.pool.experts if n.startswith(f"{t}@lr=")]) == 4 and other["loss"] != r["loss"]
    with pytest.raises(MergerError, match="batch size 0 \\(the full batch\\) has no place on the a \\+ b/B trend"):
        lab.scaling_view(ex, "batch_size", [0, 64], base, [t])  # said before any fine-tune (it crashed after)


def test_scaling_view_over_the_number_of_tasks(tmp_path):
    ex3 = merger.PoolSession(merger.open_pool(write_pool(tmp_path, n_experts=3, scale=0.1, demo_data=True)))
    tasks = list(ex3.pool.tasks)
    r = lab.scaling_view(ex3, "num_tasks", [1, 2, 3], {}, tasks)
    full = ex3.preview(ex3.spec("weight_averaging"), "test")
    assert r["loss"][2] == pytest.approx(full.average_loss) and len(r["trend"]["y"]) == 50
    with pytest.raises(MergerError, match="number of tasks merged 4 must be a whole number between 1 and 3"):
        lab.scaling_view(ex3, "num_tasks", [1, 4], {}, tasks)


def test_cancel_stops_a_lab_run_and_adds_nothing(ex):
    from types import SimpleNamespace

    import gradio as gr

    from merger.ui.lab_tab import LabController
    from merger.ui.offered import OfferedExperts

    lc = LabController(SimpleNamespace(pool=ex.pool, session=ex, offered=OfferedExperts(ex.pool)))
    request = SimpleNamespace(session_hash="person-a")
    before = list(ex.pool.tasks)
    assert lc.cancel(request) == gr.skip()  # the status line keeps what it said (a toast says why)
    msg = lc.run(request, ex.pool.tasks[0], "cancelled-one", 1e-3, 2, 64, 1.0, 0, "adamw", 0.9, 0.1, "cosine",
                 progress=lambda f, desc=None: lc.cancel(request))
    assert msg[0].startswith("Cancelled") and ex.pool.tasks == before


def test_refused_lab_settings_say_why_in_the_status_and_keep_the_plots(ex, monkeypatch):
    from types import SimpleNamespace

    import gradio as gr

    from merger.ui.lab_tab import LabController
    from merger.ui.offered import OfferedExperts

    lc = LabController(SimpleNamespace(pool=ex.pool, session=ex, offered=OfferedExperts(ex.pool)))
    request = SimpleNamespace(session_hash="person-a")
    before = list(ex.pool.tasks)
    status, *choices = lc.run(request, ex.pool.tasks[0], "x", -1.0, 1, 64, 1.0, 0, "adamw", 0.9, 0.1, "cosine",
                              progress=lambda f, desc=None: None)
    assert status.startswith("⚠️") and "learning rate -1.0" in status and choices == [gr.skip()] * 2
    # a taken or bad name is refused before the fine-tune (it was refused after its minutes of training)
    trained = []
    monkeypatch.setattr(lab_tab, "finetune", lambda *a, **k: trained.append(1))
    for name, message in ((ex.pool.tasks[0], "already exists"), ("bad name!", "use 1-40 letters")):
        status, *_ = lc.run(request, ex.pool.tasks[0], name, 1e-3, 1, 64, 1.0, 0, "adamw", 0.9, 0.1, "cosine",
                            progress=lambda f, desc=None: None)
        assert status.startswith("⚠️ lab:") and message in status
    assert trained == []
    monkeypatch.undo()
    for values, message in (("0.001, abc", "'0.001, abc': not comma-separated numbers"),
                            ("0.001, nan", "every value must be a finite number")):
        *plots, status = lc.scaling(request, "lr", values, 1e-3, 1, 64, 1.0, 0, "adamw", 0.9, 0.1, "cosine",
                                    progress=lambda f, desc=None: None)
        assert plots == [gr.skip()] * 4 and status.startswith("⚠️") and message in status, status
    status, *choices = lc.one_epoch_set(request, 1e-3, 1, -3, 1.0, 0, "adamw", 0.9, 0.1, "cosine",
                                        progress=lambda f, desc=None: None)
    assert status.startswith("⚠️ lab: batch size -3") and choices == [gr.skip()] * 2  # nothing was added
    assert ex.pool.tasks == before


def test_a_blank_name_gives_each_session_its_own_numbered_expert(ex):
    from types import SimpleNamespace

    from merger.ui.lab_tab import LabController
    from merger.ui.offered import OfferedExperts

    lc = LabController(SimpleNamespace(pool=ex.pool, session=ex, offered=OfferedExperts(ex.pool)))
    task = ex.pool.tasks[0]
    added = []
    for who in ("aaaaaa-1", "aaaaaa-1", "bbbbbb-2"):
        msg = lc.run(SimpleNamespace(session_hash=who), task, "  ", 1e-3, 1, 64, 0.25, 0, "adamw", 0.9, 0.1,
                     "constant", progress=lambda f, desc=None: None)
        assert msg[0].startswith("Added expert") and "(learning rate 0.001, epochs 1, batch size 64, data fraction 0.25, seed 0," in msg[0], msg[0]
        added.append(msg[0].split("**")[1])
    assert added == [f"{task}-lab-aaaaaa", f"{task}-lab-aaaaaa-2", f"{task}-lab-bbbbbb"]


def test_gradio_gives_every_lab_and_run_callback_the_browser_session():
    """Gradio injects gr.Request (and gr.Progress) only among positional parameters: a request
    after *values is silently None, and Cancel then never finds the run it should stop."""
    from types import SimpleNamespace

    from gradio.helpers import special_args

    from merger.ui.lab_tab import LabController
    from merger.ui.runs import RunController

    lc = LabController(SimpleNamespace(pool=None, session=None))
    rc = RunController(SimpleNamespace())
    marker = object()
    for fn, n_inputs in ((lc.run, 11), (lc.one_epoch_set, 9), (lc.scaling, 11), (lc.cancel, 0),
                         (rc.run, 12), (rc.cancel, 0)):
        inputs, progress_index, _, _ = special_args(fn, [None] * n_inputs, marker)
        assert inputs[0] is marker, fn.__name__
        if fn.__name__ in ("run", "one_epoch_set", "scaling") and fn.__self__ is lc:
            assert progress_index is not None, fn.__name__
    # a handler marked keeps_outputs still shows Gradio its request and progress parameters; the
    # Compare and Landscape jobs take the request so that their Cancel finds them
    from merger.ui.compare_tab import CompareTab
    from merger.ui.landscape_tab import LandscapeController

    tab = CompareTab(None)
    land = LandscapeController(SimpleNamespace(session=SimpleNamespace(landscape=None), pool=None))
    for fn, n_inputs, progress_at in ((tab.auto_tune, 2, 3), (tab.sweep, 4, 5), (tab.cancel, 0, None),
                                      (land.compute, 10 + 12, None), (land.cancel, 0, None),
                                      (land.restyle, 4 + 12, None)):
        inputs, progress_index, _, _ = special_args(fn, [None] * n_inputs, marker)
        assert inputs[0] is marker and progress_index == progress_at, fn.__name__


def test_the_scaling_view_offers_its_experts_to_merge_and_to_epoch_dynamics(ex):
    """Its experts are this session's lab experts: both expert lists offer them (the Epoch dynamics
    list was left as it was), and its plots name the variable by the control's label."""
    from types import SimpleNamespace

    from merger.ui.lab_tab import LabController
    from merger.ui.offered import OfferedExperts

    lc = LabController(SimpleNamespace(pool=ex.pool, session=ex, offered=OfferedExperts(ex.pool)))
    request = SimpleNamespace(session_hash="dddddd-4")
    acc, loss, to_merge, to_trace, status = lc.scaling(request, "lr", "0.001, 0.004", 1e-3, 1, 64, 0.5, 7, "adamw",
                                                       0.9, 0.1, "cosine", progress=lambda f, desc=None: None)
    made = [e for e in ex.pool.experts if "@lr=0.004-" in e and ex.pool.expert_info[e]["owner"] == "dddddd-4"]
    assert len(made) == len(ex.pool.tasks) and status == (
        "Merged with weight averaging (Σλ = 1). Each expert fine-tuned with epochs 1, batch size 64, data fraction "
        "0.5, seed 7, optimiser adamw, momentum 0.9, weight decay 0.1, schedule cosine, learning rate as plotted.")
    assert set(made) <= set(to_merge["choices"]) and set(made) <= set(to_trace["choices"])
    assert acc.layout.xaxis.title.text == "learning rate" and loss.layout.title.text.startswith("Merged loss against learning rate")
    assert list(acc.layout.xaxis.ticktext) == ["0.001", "0.004"]  # a log axis ticked at the values run


def test_a_data_fraction_under_one_batch_trains_on_that_fraction(ex):
    """0.02 of the train split is fewer images than a batch of 128: it used to be topped up to 128,
    so a scaling view over small fractions trained on the same images at each."""
    t = ex.pool.tasks[0]
    _, _, whole = lab.finetune(merger.session_for(ex.pool), t, lab.check_settings(1e-3, 1, 128, 1.0, 0))
    _, _, small = lab.finetune(merger.session_for(ex.pool), t, lab.check_settings(1e-3, 1, 128, 0.02, 0))
    assert small["images"] == round(0.02 * whole["images"]) < 128
    assert "train images %d" % small["images"] in lab.describe_settings(small)


def test_a_pages_lab_experts_are_bounded_and_go_when_the_page_closes(tmp_path, monkeypatch):
    """Lab experts were never freed (744 → 1,792 MB after 130) and a scaling view took 2,000 values."""
    from types import SimpleNamespace

    from merger.ui.app import session_ended
    from merger.ui.merge_events import MergeTabEvents
    from merger.ui.merge_tab import Controller

    session = merger.PoolSession(merger.open_pool(write_pool(tmp_path, n_experts=2, scale=0.1, demo_data=True)))
    pool, t = session.pool, session.pool.tasks[0]
    weights = {k: pool.base[k] + pool.task_vectors.row(k, 0) for k in pool.task_vectors.keys}
    settings = lab.check_settings(1e-3, 1, 64, 0.5, 0)
    with pytest.raises(MergerError, match=f"lab: 2000 scaling values: at most {lab.MAX_SCALING_VALUES}"):
        lab.scaling_view(session, "lr", [1e-3] * 2000, settings, [t])
    monkeypatch.setattr(lab, "MAX_LAB_EXPERTS", 2)
    lab.add_expert(session, "a1", t, weights, owner="page-a")
    lab.add_expert(session, "a2", t, weights, owner="page-a")
    lab.add_expert(session, "b1", t, weights, owner="page-b")
    with pytest.raises(MergerError, match="this page holds 2 lab expert\\(s\\) and this run adds 1: at most 2 per page"):
        lab.add_expert(session, "a3", t, weights, owner="page-a")
    with pytest.raises(MergerError, match="this page holds 0 lab expert\\(s\\) and this run adds 4"):
        lab.scaling_view(session, "lr", [1e-3, 2e-3], settings, pool.tasks, owner="page-c")  # before fine-tuning
    stack = pool.task_vectors.nbytes()
    ctl = Controller(session)
    session_ended(ctl, MergeTabEvents(ctl, "task_arithmetic", None), SimpleNamespace(session_hash="page-a"))
    assert pool.experts == [*pool.tasks, "b1"] and pool.task_vectors.nbytes() == stack * 3 // 5
    assert session.preview(session.spec("task_arithmetic", experts=[t, "b1"])).accuracy  # the rest still merge
    with pytest.raises(MergerError, match="'a1' named an expert freed with the page that made it"):
        lab.add_expert(session, "a1", t, weights, owner="page-b")
    assert lab.unused_name(pool, "a1") == "a1-2"
