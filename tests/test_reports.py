"""The printed reports' checks on synthetic curves, and what the reports pick and measure."""
import pytest
from helpers import write_pool

import merger
from merger.reports.phenomena import bell_at_low_rank, full_rank_through_the_arithmetic, rises_then_falls
from merger.reports.demo import TA_GRID, demo_numbers


@pytest.mark.parametrize("curve, expected", [
    ({0.1: 0.5, 0.3: 0.7, 0.5: 0.8, 1.0: 0.6}, True),       # rises, then falls
    ({0.1: 0.5, 0.3: 0.6, 0.5: 0.7, 1.0: 0.8}, False),      # only rises: the peak is at the end
    ({0.1: 0.8, 0.3: 0.7, 0.5: 0.6, 1.0: 0.5}, False),      # only falls
    ({0.1: 0.70, 0.3: 0.705, 1.0: 0.70}, False),            # a bump within the margin is no peak
])
def test_rises_then_falls(curve, expected):
    assert rises_then_falls(curve) is expected


@pytest.mark.parametrize("curve, expected", [
    ({0.01: 0.6, 0.04: 0.75, 0.08: 0.8, 0.32: 0.72, 1.0: 0.65}, True),   # the CART bell near 8 %
    ({0.01: 0.6, 0.08: 0.7, 0.5: 0.8, 1.0: 0.65}, False),                 # peaks at a high rank
    ({0.01: 0.8, 0.08: 0.7, 1.0: 0.65}, False),                           # no rise from the lowest rank
])
def test_bell_at_low_rank(curve, expected):
    assert bell_at_low_rank(curve) is expected


@pytest.fixture(scope="module")
def pool(tmp_path_factory):
    return merger.open_pool(write_pool(tmp_path_factory.mktemp("reports"), n_experts=3, scale=0.2, demo_data=True))


def test_full_rank_cart_is_weight_averaging_through_the_arithmetic(pool):
    out = full_rank_through_the_arithmetic(merger.PoolSession(pool))
    assert out["max_weight_difference"] < 1e-4 and out["accuracy_difference"] == pytest.approx(0.0, abs=1e-9)


def test_demo_report_picks_lambda_on_validation(pool):
    n = demo_numbers(pool, split="test")
    ex = merger.PoolSession(pool)
    val = {lam: ex.preview(ex.spec("task_arithmetic", lam=lam), "val").average_accuracy for lam in TA_GRID}
    assert n["best_lam"] == max(val, key=val.get)
    # at the picked λ only (what the demo's targets read): the same pick and numbers, progress to the end
    seen = []
    best = demo_numbers(pool, split="test", others=(), every_lam=False, progress=lambda f, label: seen.append(f))
    assert best["best_lam"] == n["best_lam"] and list(best["by_lam"]) == [n["best_lam"]]
    assert best["by_lam"][n["best_lam"]].accuracy == n["by_lam"][n["best_lam"]].accuracy
    assert seen[-1] == 1.0 and len(seen) == 2 + len(TA_GRID) + 1


def test_methods_report_tunes_on_validation_and_times_each_method(pool):
    from merger.reports.methods import format_methods, method_rows

    rows = method_rows(pool, ["task_arithmetic", "magmax", "slerp", "regmean"], progress=None)
    by = {r["method"]: r for r in rows}
    # the tuned setting is the grid point with the best validation accuracy, then reported on test
    session = merger.PoolSession(pool)
    val = {lam: session.preview(session.spec("magmax", lam=lam), "val").average_accuracy
           for lam in merger.methods.get("magmax").tune_grid["lam"]}
    assert by["magmax"]["spec"].kwargs["lam"] == max(val, key=val.get)
    assert by["magmax"]["test"] == pytest.approx(
        session.preview(by["magmax"]["spec"], "test").average_accuracy)
    assert by["slerp"]["experts"] == pool.tasks[:2] and by["slerp"]["ta_same"] is not None
    assert by["regmean"]["grid"] == 0 and by["regmean"]["move_ms"] is None and by["regmean"]["prepare_s"] > 0
    text = format_methods(rows, pool.tasks)
    assert "slerp*" in text and "task arithmetic tuned on the same experts" in text
    assert "beat task arithmetic" in text


def test_the_adaptive_report_prints_each_methods_whole_settings():
    from merger.reports.adaptive import format_adaptive

    long = "adamerging_cart (init=1, lr=0.001, rank_ratio=0.08, samples=64, seed=0, steps=300, extra=1)"
    text = format_adaptive([{"method": "task_arithmetic (lam=0.3)", "test": 0.8, "normalized": 0.9, "seconds": 1.0},
                            {"method": long, "test": 0.85, "normalized": 0.95, "seconds": 60.0}])
    row = text.splitlines()[2]
    assert row.startswith(long + " ") and row.split()[-3:] == ["85.0", "95.0", "60.0"]  # it was cut at 77 characters
