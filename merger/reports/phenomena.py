"""``python -m merger report phenomena``: the papers' phenomena, measured on the demo pool."""
from __future__ import annotations

from typing import Mapping

from merger.analysis import diagnostics as analysis
from merger.analysis.lab import add_expert, finetune, settings_of
from merger.evaluation.session import PoolSession
from merger.methods.adaptive import FW_SOFT
from merger.methods.basic import TASK_ARITHMETIC, WEIGHT_AVERAGING
from merger.methods.cart import CART
from merger.reports.demo import TA_GRID

RANKS = (0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.5, 0.75, 1.0)


def rises_then_falls(curve: Mapping[float, float], margin: float = 0.01) -> bool:
    """The peak lies strictly inside the range and clears both ends by ``margin``."""
    xs = sorted(curve)
    peak = max(xs, key=curve.get)
    return xs[0] < peak < xs[-1] and curve[peak] > max(curve[xs[0]], curve[xs[-1]]) + margin


def bell_at_low_rank(curve: Mapping[float, float], low: float = 0.32, margin: float = 0.01) -> bool:
    """CART's bell (arXiv 2412.12153): rises from the lowest rank, peaks at a rank ratio ≤ ``low``, falls back."""
    return rises_then_falls(curve, margin) and max(curve, key=curve.get) <= low


def full_rank_through_the_arithmetic(ex, lam: float = 1.5, split: str = "test") -> dict:
    """CART at full rank computed through the SVD sum (no shortcut), against weight averaging:
    the largest weight difference and the accuracy difference."""
    from merger.methods.cart import low_rank_sum, prepare_cart

    tv = ex.pool.task_vectors
    prep = prepare_cart(tv)
    delta = dict(prep["mean"])
    for key, basis in prep["basis"].items():
        centred = tv.fp32(key) - prep["mean"][key]
        delta[key] = prep["mean"][key] + lam * low_rank_sum(centred, basis, basis.shape[-1])  # every direction
    with ex.lock:
        full = ex.evaluator.evaluate(delta=delta, split=split)
    wa = ex.preview(ex.spec(WEIGHT_AVERAGING.name), split)
    return {"max_weight_difference": max(float((delta[k] - prep["mean"][k]).abs().max()) for k in delta),
            "accuracy_difference": abs(full.average_accuracy - wa.average_accuracy)}


def _best_ta(ex, experts, split_pick="val", split_report="test"):
    """λ of task arithmetic picked on validation, and the merged tasks' test accuracy there."""
    tasks = [ex.pool.task_of(e) for e in experts]
    val = {}
    for lam in TA_GRID:
        res = ex.preview(ex.spec(TASK_ARITHMETIC.name, experts=experts, lam=lam), split_pick)
        val[lam] = sum(res.accuracy[t] for t in tasks) / len(tasks)
    lam = max(val, key=val.get)
    res = ex.preview(ex.spec(TASK_ARITHMETIC.name, experts=experts, lam=lam), split_report)
    return lam, sum(res.accuracy[t] for t in tasks) / len(tasks)


def _expert_set(ex, label: str, overrides: dict, progress) -> list[str]:
    """Fine-tune one expert per original task with the pool's own hparams changed by ``overrides``."""
    pool = ex.pool
    names = []
    for t in pool.tasks:
        settings = settings_of(pool, t, **overrides)
        name = f"{t}@{label}"
        if name not in pool.expert_info:
            if progress:
                progress(f"  fine-tuning {name} ({settings})")
            sd, traj, hparams = finetune(ex, t, settings)
            add_expert(ex, name, t, sd, hparams, traj)
        names.append(name)
    return names


def phenomena(pool, progress=print) -> dict:
    ex = PoolSession(pool)
    tasks = list(pool.tasks)
    out = {}
    # 1. TA against λ (test curve; λ picked on validation)
    ta = {lam: ex.preview(ex.spec(TASK_ARITHMETIC.name, lam=lam), "test").average_accuracy for lam in TA_GRID}
    picked, _ = _best_ta(ex, tasks)
    out["lam_curve"] = {"curve": ta, "peak": max(ta, key=ta.get), "picked": picked, "rise_then_fall": rises_then_falls(ta)}
    # 2. CART against rank ratio
    wa = ex.preview(ex.spec(WEIGHT_AVERAGING.name), "test").average_accuracy
    cart = {r: ex.preview(ex.spec(CART.name, rank_ratio=r), "test").average_accuracy for r in RANKS}
    out["rank_curve"] = {"curve": cart, "average": wa, "peak": max(cart, key=cart.get),
                   "bell": bell_at_low_rank(cart), "full_rank": full_rank_through_the_arithmetic(ex)}
    # 3./4. expert sets fine-tuned differently, merged with TA at λ chosen on validation
    sets = {"converged (the pool's experts)": tasks}
    sets["one epoch"] = _expert_set(ex, "1ep", {"epochs": 1}, progress)
    base_lr = (pool.expert_info[tasks[0]].get("hparams") or {}).get("lr", 1e-3)
    sets[f"high learning rate (×10: {10 * base_lr:g})"] = _expert_set(ex, "lr10", {"lr": min(1.0, 10 * base_lr)}, progress)
    base_ep = int((pool.expert_info[tasks[0]].get("hparams") or {}).get("epochs", 3))
    sets[f"many steps (×3 epochs: {3 * base_ep})"] = _expert_set(ex, "ep3x", {"epochs": 3 * base_ep}, progress)
    rows = {}
    for label, names in sets.items():
        lam, merged = _best_ta(ex, names)
        own = [ex.expert_task_accuracy(n, "test") for n in names]
        rows[label] = {"experts": sum(own) / len(own), "lam": lam, "merged": merged}
    out["expert_sets"] = rows
    # 5. per-layer cross-task linearity of the TA merge (λ picked on validation) against its baseline
    lam = out["lam_curve"]["picked"]
    ev = ex.evaluator
    x = analysis.probe_images(ev)
    tv = pool.task_vectors
    idx = [tv.tasks.index(t) for t in tasks]
    merged = {k: tv.base[k] + lam * tv.fp32(k)[idx].sum(0) for k in tv.keys}
    experts_w = [tv.expert(i) for i in idx]
    feats = lambda w, xx: analysis.block_features(ev.model.visual, w, xx)  # noqa: E731
    lin = analysis.cross_task_linearity(feats, merged, experts_w, [lam] * len(idx), x, base=tv.base)
    out["linearity"] = {**lin, "lam": lam}
    # 6. FW-soft against TA
    fw = ex.spec(FW_SOFT.name, experts=tasks)
    ex.run(fw)
    res = ex.preview(fw, "test")
    out["fw_vs_ta"] = {"fw": sum(res.accuracy[t] for t in tasks) / len(tasks), "baseline": _best_ta(ex, tasks)[1]}
    return out


def format_phenomena(n: dict) -> str:
    pct = lambda v: f"{100 * v:.1f}"  # noqa: E731
    L = ["Phenomena measured on the demo pool (test split; λ for TA chosen on validation where stated)", ""]
    ta = n["lam_curve"]
    L.append(f"1. TA accuracy against λ (test): peak {pct(ta['curve'][ta['peak']])} % at λ={ta['peak']:g}; "
             f"λ picked on validation {ta['picked']:g} ({pct(ta['curve'][ta['picked']])} %); "
             f"rises then falls: {'yes' if ta['rise_then_fall'] else 'NO'}")
    L.append("   " + "  ".join(f"{lam:g}:{pct(v)}" for lam, v in ta["curve"].items()))
    c = n["rank_curve"]
    fr = c["full_rank"]
    L.append(f"2. CART against rank ratio (λ=1.5): peak {pct(c['curve'][c['peak']])} % at ratio {c['peak']:g}; bell "
             f"peaking at low rank: {'yes' if c['bell'] else 'NO'}; full rank through the SVD sum vs weight "
             f"averaging ({pct(c['average'])} %): largest weight difference {fr['max_weight_difference']:.2g}, "
             f"accuracy difference {100 * fr['accuracy_difference']:.2f} points")
    L.append("   " + "  ".join(f"{r:g}:{pct(v)}" for r, v in c["curve"].items()))
    L.append("3./4. expert sets merged with TA (λ best on validation):")
    for label, r in n["expert_sets"].items():
        L.append(f"   {label:<40} experts {pct(r['experts'])} %  merged {pct(r['merged'])} % (λ={r['lam']:g})")
    lin = n["linearity"]
    L.append(f"5. cross-task linearity of TA (λ={lin['lam']:g}) per block: mean 1 − cos(f(merge), (1 − Σλ) f(θ0) + "
             "Σ λ f(θt)) [q25, q75] over all tokens of the first validation images of every task, vs the baselines "
             "1 − cos(f(θi), f(θj)) over expert pairs and 1 − cos(f(merge), f(endpoint)):")
    for i, (m, a, b, pair, base) in enumerate(zip(lin["mean"], lin["q25"], lin["q75"], lin["pairwise"], lin["baseline"])):
        L.append(f"   block {i}: {m:.4f} [{a:.4f}, {b:.4f}]  baselines {pair:.4f}, {base:.4f}  "
                 f"({'below both' if m < min(pair, base) else 'NOT below both'})")
    fw = n["fw_vs_ta"]
    L.append(f"6. FW-soft {pct(fw['fw'])} % vs TA {pct(fw['baseline'])} %: FW-soft "
             f"{'beats' if fw['fw'] > fw['baseline'] else 'does not beat'} TA")
    return "\n".join(L)
