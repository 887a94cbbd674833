"""The built-in demo pool: the shipped zoo opens (hashes checked) and the reduced configuration,
built from scratch here, meets the demo's targets."""

import merger
from merger.reports.demo import demo_numbers, demo_targets


def test_shipped_demo_pool_opens_and_evaluates():
    pool = merger.open_pool("demo")
    assert len(pool.tasks) >= 6
    ex = merger.PoolSession(pool)
    res = ex.preview(ex.spec("task_arithmetic", lam=0.3))
    assert len(res.accuracy) == len(pool.tasks) and res.counts[pool.tasks[0]] == 96
    assert all(pool.expert_info[t].get("trajectory") for t in pool.tasks)


def test_demo_targets_on_the_reduced_configuration(tmp_path):
    from merger.demo.build import DemoConfig, build

    out = build(tmp_path / "small", DemoConfig.small(), progress=False)
    # the targets compare no other method, and read task arithmetic on the test split at the picked λ only
    n = demo_numbers(merger.open_pool(out / "pool.yaml"), others=(), every_lam=False)
    targets = demo_targets(n)
    # measured on the reduced world: experts 90.9 %, base 27.6 points below them, best TA
    # 14.8 points above the base and 12.8 below the experts
    assert len(targets) == 5
    assert all(met for _, met, _ in targets), [(name, measured) for name, met, measured in targets if not met]


def test_demo_export_writes_a_pool_of_files_and_image_folders_that_opens_and_merges(tmp_path, capsys):
    from merger.cli import main

    out = tmp_path / "mine"
    assert main(["demo", "export", "--out", str(out), "--images", "24"]) == 0
    assert f"wrote {out / 'pool.yaml'}" in capsys.readouterr().out
    pool = merger.open_pool(out / "pool.yaml")
    demo = merger.open_pool("demo")
    assert pool.tasks == demo.tasks and pool.preprocess_cfg == demo.preprocess_cfg
    assert all(pool.task_vectors.stacked[k].equal(demo.task_vectors.stacked[k]) for k in demo.task_vectors.keys)
    t = pool.tasks[0]
    pngs = sorted((out / "data" / t / "test").rglob("*.png"))
    assert len(pngs) == 24 and {p.parent.name for p in pngs} <= set(demo.task_info[t]["classes"])
    res = merger.Evaluator(pool).evaluate(None, "test")
    assert set(res.accuracy) == set(pool.tasks) and res.counts[t] == 24
    # an existing folder with files is never written into
    assert main(["demo", "export", "--out", str(out)]) == 2
    assert "exists and is not an empty folder" in capsys.readouterr().err
