"""``merger demo report``: the demo pool's numbers (experts, zero-shot base, each compared method at
its best λ on validation, reported on test) against the targets the demo was built to meet."""
from __future__ import annotations

from merger import methods
from merger.evaluation.session import PoolSession
from merger.methods.basic import TASK_ARITHMETIC

TA_GRID = tuple(round(0.05 * i, 2) for i in range(1, 31))


def compared_methods() -> list[str]:
    """Every method that merges all experts from sliders, task arithmetic aside (it is the λ curve)."""
    return [m.name for m in methods.all_methods()
            if not m.data_driven and m is not TASK_ARITHMETIC and m.num_experts is None]


def demo_numbers(pool, split: str = "test", progress=None, others=None, every_lam: bool = True) -> dict:
    """Chance, base, experts, task arithmetic over its λ grid (the reported λ picked on the
    validation split, never on the split it is reported on) and the ``others`` methods at defaults
    (None: every compared method; the targets need none). ``every_lam=False``: task arithmetic on
    ``split`` at the picked λ only, all the targets read (on "val" it has every λ anyway)."""
    ex = PoolSession(pool)
    classes = {t: len(ex.evaluator.data.classes(t)) for t in pool.tasks}
    others = compared_methods() if others is None else list(dict.fromkeys(others))
    on_split = len(TA_GRID) if every_lam else 1
    total = 2 + len(TA_GRID) + (0 if split == "val" else on_split) + len(others)
    done = {}

    def run(label, step):
        if label in done:  # split="val": its grid is the one λ was picked on
            return
        done[label] = step()
        if progress:
            progress(len(done) / total, label)

    ta_at = lambda lam, s: lambda: ex.preview(ex.spec(TASK_ARITHMETIC.name, lam=lam), s)  # noqa: E731
    run("base", lambda: ex.base(split))
    run("experts", lambda: ex.expert_accuracy(split))
    for lam in TA_GRID:
        run(f"TA λ={lam:g} val", ta_at(lam, "val"))
    val = {lam: done[f"TA λ={lam:g} val"].average_accuracy for lam in TA_GRID}
    best = max(val, key=val.get)
    for lam in TA_GRID if every_lam else (best,):
        run(f"TA λ={lam:g} {split}", ta_at(lam, split))
    for m in others:
        run(m, lambda m=m: ex.preview(ex.spec(m), split))
    base, experts = done["base"], done["experts"]
    ta = {lam: done[f"TA λ={lam:g} {split}"] for lam in TA_GRID if f"TA λ={lam:g} {split}" in done}
    others = {m: done[m] for m in others}
    return {"split": split, "chance": {t: 1.0 / c for t, c in classes.items()}, "base": base,
            "experts": experts, "by_lam": ta, "best_lam": best, "others": others}


def demo_targets(n: dict) -> list[tuple[str, bool, str]]:
    """The demo's targets: (name, met, measured)."""
    mean = lambda d: sum(d.values()) / len(d)  # noqa: E731
    e, b = mean(n["experts"]), n["base"].average_accuracy
    ta, chance = n["by_lam"][n["best_lam"]].average_accuracy, mean(n["chance"])
    return [
        ("experts >= 85 % on their own tasks", e >= 0.85, f"{100 * e:.1f} %"),
        ("base >= 25 points below the experts", e - b >= 0.25, f"{100 * (e - b):.1f} points"),
        ("base well above chance", b - chance >= 0.10, f"{100 * b:.1f} % vs chance {100 * chance:.1f} %"),
        ("best TA >= 10 points below the experts", e - ta >= 0.10, f"{100 * (e - ta):.1f} points"),
        ("best TA >= 10 points above the base", ta - b >= 0.10, f"{100 * (ta - b):.1f} points"),
    ]


def format_demo_report(n: dict) -> str:
    tasks = list(n["experts"])
    best = n["by_lam"][n["best_lam"]]
    cols = ["chance", "base", "expert", f"TA λ={n['best_lam']:g}*"] + list(n["others"])
    widths = [max(13, len(c) + 2) for c in cols]  # a method's whole name (weight_averaging was cut)
    lines = [f"demo pool, {n['split']} split, accuracy %", f"{'task':<12}" + "".join(f"{c:>{w}}" for c, w in zip(cols, widths))]

    def row(name, vals):
        return f"{name:<12}" + "".join(f"{100 * v:{w}.1f}" for v, w in zip(vals, widths))

    for t in tasks:
        lines.append(row(t, [n["chance"][t], n["base"].accuracy[t], n["experts"][t], best.accuracy[t]]
                         + [r.accuracy[t] for r in n["others"].values()]))
    mean = lambda d: sum(d.values()) / len(d)  # noqa: E731
    lines.append(row("average", [mean(n["chance"]), n["base"].average_accuracy, mean(n["experts"]),
                                 best.average_accuracy] + [r.average_accuracy for r in n["others"].values()]))
    lines.append(f"* λ picked on the validation split; the {n['split']} split only reports it")
    lines.append("")
    lines.append("task arithmetic, average accuracy % against λ:")
    lines.append("  " + "  ".join(f"{lam:g}:{100 * r.average_accuracy:.1f}" for lam, r in n["by_lam"].items()))
    lines.append("")
    lines.append("targets:")
    for name, ok, measured in demo_targets(n):
        lines.append(f"  [{'met' if ok else 'MISSED'}] {name}: {measured}")
    return "\n".join(lines)
