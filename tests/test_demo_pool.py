"""The built-in demo pool: the shipped zoo opens (hashes checked) and the reduced configuration,
built from scratch here, meets loose versions of the demo's targets."""

import merger
from merger.reports import demo_numbers, demo_targets


def test_shipped_demo_pool_opens_and_evaluates():
    pool = merger.open_pool("demo")
    assert len(pool.tasks) >= 6
    ex = merger.Explorer(pool)
    res = ex.preview(ex.spec("task_arithmetic", lam=0.3))
    assert len(res.accuracy) == len(pool.tasks) and res.counts[pool.tasks[0]] == 128
    assert all(pool.expert_info[t].get("trajectory") for t in pool.tasks)


def test_demo_targets_on_the_reduced_configuration(tmp_path):
    from merger.demo.build import DemoConfig, build

    out = build(tmp_path / "small", DemoConfig.small(), progress=False)
    n = demo_numbers(merger.open_pool(out / "pool.yaml"))
    experts = sum(n["experts"].values()) / len(n["experts"])
    base = n["base"].average_accuracy
    ta = n["ta"][n["best_lam"]].average_accuracy
    chance = sum(n["chance"].values()) / len(n["chance"])
    assert experts >= 0.75, f"experts {experts:.3f}"
    assert experts - base >= 0.15, f"base {base:.3f} vs experts {experts:.3f}"
    assert base > chance + 0.05
    # measured on the reduced world: TA +3.4 points over the base, 16 below the experts
    assert ta - base >= 0.025 and experts - ta >= 0.05, f"TA {ta:.3f}, base {base:.3f}, experts {experts:.3f}"
    assert len(demo_targets(n)) == 5
