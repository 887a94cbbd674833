"""Data-driven merges: AdaMerging (task-/layer-wise, and on CART's low-rank parts) and
Frank–Wolfe merging (hard and soft).

The merged image tower is a differentiable function of a few coefficients; the resident model
is never written: ``torch.func.functional_call`` runs it with the merged tensors, so gradients
reach the coefficients and a cancelled run leaves nothing half-written. Data: the evaluator's
device-resident *validation* split (never the test split).
"""
from __future__ import annotations

import time
from typing import Callable

import torch

from merger.errors import Cancelled
from merger.methods.data import (DRAW_SEED, VISUAL, Context, Run, calibration_set, cross_entropy_objective,  # noqa: F401
                                 entropy_objective, static_unused, subset_of)
from merger.methods.cart import cart_task_parts, prepare_cart
from merger.methods.registry import (ADAMERGING_LOGS, CART_README, INIT, LAM, LR, RANK_RATIO, SAMPLES, STEP_SIZE, STEPS,
                                     TOP_K, Method, Paper, Published, get, register, with_default)

class Combination:
    """θ(c) = θ0 + offset + Σt c[t, g(key)] · parts[key][t] over the merged keys (visual.* names); the
    offset is AdaMerging+CART's θavg − θ0, none for θ0 + Σ c·τ."""

    def __init__(self, base: dict, parts: dict, groups: list[list[str]], dtype=torch.float32,
                 offset: dict | None = None):
        self.around_base = offset is None  # θ0 + Σ c·τ: the coefficients are task weights (start from learned)
        self.base = {k: v.to(dtype) for k, v in base.items()}  # the pool's own tensors where already in dtype
        self.offset = {k: v.to(dtype) for k, v in (offset or {}).items()}
        self.parts = {k: v.to(dtype) for k, v in parts.items()}
        self.group_of = {k: gi for gi, keys in enumerate(groups) for k in keys}

    def _step(self, coef: torch.Tensor, k: str) -> torch.Tensor:
        return torch.tensordot(coef[:, self.group_of[k]], self.parts[k], dims=1)

    def params(self, coef: torch.Tensor) -> dict[str, torch.Tensor]:
        out = {}
        for k, a in self.base.items():
            if k in self.offset:
                a = a + self.offset[k]
            if k in self.parts:
                a = a + self._step(coef, k)
            out[k[len(VISUAL):]] = a
        return out

    def delta(self, coef: torch.Tensor, base: dict) -> dict[str, torch.Tensor]:
        """θ(c) − θ0, summed apart from θ0: formed as θ(c) minus θ0 in fp32 it lost eps·|θ0|, 1e-3 of a
        layer's Δ whose coefficient is 0.01 on a base a thousand times its task vectors."""
        coef = coef.to(next(iter(self.base.values())).dtype)
        out = {}
        with torch.no_grad():
            for k in self.base:
                d = self.offset[k].clone() if k in self.offset else torch.zeros_like(self.base[k])  # a Δ of its own
                if k in self.parts:
                    d += self._step(coef, k)
                out[k] = d.to(base[k].dtype)
        return out


def _check(cancel):
    if cancel is not None and cancel():
        raise Cancelled("run cancelled; nothing was cached")


def _combination(ctx: Context, granularity: str, rank_ratio: float | None):
    tv = ctx.tv
    if rank_ratio is None:  # AdaMerging: θ0 + Σ λ τ
        parts, offset = dict(tv.items32()), None
    else:  # AdaMerging+CART: θavg + Σ λ SVD_k(θt − θavg) on matrices, θavg elsewhere
        prep = prepare_cart(tv)
        offset = {k: prep["mean"][k] for k in tv.keys}
        parts = cart_task_parts(prep, rank_ratio)
    keys = [k for k in tv.keys if k in parts]
    groups = [keys] if granularity == "task" else [[k] for k in keys]
    names = ["all layers"] if granularity == "task" else [k[len(VISUAL):] for k in keys]
    return Combination(tv.base, parts, groups, offset=offset), names


def run_adamerging(ctx: Context, progress=None, cancel=None, *, granularity: str, steps: int, lr: float,
                   init: float, samples: int, seed: int, rank_ratio: float | None = None,
                   bounds: tuple[float, float] = (0.0, 1.0)) -> Run:
    t0 = time.perf_counter()
    comb, names = _combination(ctx, granularity, rank_ratio)
    groups = ctx.groups("val")
    coef = torch.full((ctx.tv.num_tasks, len(names)), float(init), device=ctx.tv.device, requires_grad=True)
    opt = torch.optim.Adam([coef], lr=lr)
    g = torch.Generator().manual_seed(int(seed))
    trace, iterates = {"objective": []}, [coef.detach().clone()]
    every = max(1, steps // 25)
    for step in range(steps):
        _check(cancel)
        batch = subset_of(groups, lambda n: torch.randperm(n, generator=g)[: min(samples, n)].to(ctx.device))
        loss = entropy_objective(ctx, comb.params(coef), batch)
        opt.zero_grad()
        loss.backward()
        opt.step()
        with torch.no_grad():
            coef.clamp_(*bounds)
        trace["objective"].append(float(loss.detach()))
        if (step + 1) % every == 0 or step == steps - 1:
            iterates.append(coef.detach().clone())
        if progress:
            progress((step + 1) / steps, f"step {step + 1}/{steps}: entropy {trace['objective'][-1]:.4f}",
                     trace["objective"][-1])
    final = coef.detach()
    return Run("", ctx.tasks, names, final.cpu(), comb.delta(final, ctx.tv.base), trace,
               [c.cpu() for c in iterates], time.perf_counter() - t0, comb)


# ---- Frank–Wolfe --------------------------------------------------------------------------

def project_simplex(v: torch.Tensor) -> torch.Tensor:
    """Euclidean projection onto the probability simplex {λ ≥ 0, Σ λ = 1} (sort-based)."""
    u, _ = torch.sort(v, descending=True)
    css = u.cumsum(0) - 1
    ks = torch.arange(1, len(v) + 1, dtype=v.dtype, device=v.device)
    rho = int((u - css / ks > 0).nonzero().max())
    return (v - css[rho] / (rho + 1)).clamp(min=0)


def simplex_argmin(value_and_grad: Callable, k: int, iters: int = 25, tol: float = 1e-5):
    """min over the k-simplex of a smooth f by projected gradient with backtracking (Armijo);
    ``value_and_grad(λ, need_grad) -> (f, ∇f or None)``. Returns (best λ, its f, evaluations):
    the best point seen, not the last, so a noisy tail cannot lose the minimum."""
    lam = torch.full((k,), 1.0 / k, dtype=torch.float64)
    val, grad = value_and_grad(lam, True)
    best, best_val, evals = lam, val, 1
    step = 1.0 / (float(grad.abs().max()) + 1e-12)
    for _ in range(iters):
        while True:
            cand = project_simplex(lam - step * grad)
            moved = cand - lam
            if float(moved.abs().max()) < tol:
                return best, best_val, evals
            cand_val, _ = value_and_grad(cand, False)
            evals += 1
            if cand_val <= val + 1e-4 * float(grad @ moved) or step < 1e-8:
                break
            step *= 0.5
        if cand_val < best_val:
            best, best_val = cand, cand_val
        lam = cand
        val, grad = value_and_grad(lam, True)
        evals += 1
        step *= 2.0  # let the step grow back after a backtrack
    return best, best_val, evals


def run_fw(ctx: Context, progress=None, cancel=None, *, soft: bool, steps: int, lam: float, samples: int,
           k: int, seed: int, step_size: float = 1.0) -> Run:
    """Frank–Wolfe over the convex hull of the experts θ1..θT (arXiv 2503.12649), from θ(0) = θ0 + lam Σ τ.

    The LMO picks the expert minimising ⟨∇ℓ(θ(i)), θt⟩. Hard: θ(i+1) = (1 − γi) θ(i) + γi s(i),
    γi = step_size · 2/(i + 2). Soft: λ* = argmin over the k-simplex of ℓ(Σj λj s̃j) over the
    top-k LMO vertices, θ(i+1) = θ(i) + Σj λ*j (s̃j − θ(i)); the result is its best iterate.
    Iterates are barycentric weights w over [start, θ1..θT]."""
    t0 = time.perf_counter()
    tv = ctx.tv
    T = tv.num_tasks
    comb = Combination(tv.base, dict(tv.items32()), [list(tv.keys)])
    # Coefficients on the task vectors of [start, θ1..θT]; the start is not a vertex of the hull.
    points = torch.cat([torch.full((1, T), float(lam)), torch.eye(T)]).to(tv.device)
    labels = ["start"] + ctx.tasks
    w = torch.zeros(T + 1, device=tv.device, dtype=torch.float64)
    w[0] = 1.0
    calib = calibration_set(ctx, samples, seed)
    trace = {"loss": [], "gap": [], "chosen": [], "weights": [w.tolist()], "objective": [], "lambda": []}
    iterates = [(w.float() @ points)[:, None].clone()]
    best = (float("inf"), w.clone())
    solved: dict[tuple, tuple] = {}  # soft: λ* per vertex set (same calibration set, same answer)

    def loss_at(c):
        return cross_entropy_objective(ctx, comb.params(c[:, None]), calib)

    for i in range(steps):
        _check(cancel)
        c = (w.float() @ points).detach().requires_grad_(True)
        loss = loss_at(c)
        (grad_c,) = torch.autograd.grad(loss, c)  # ⟨∇θℓ, τt⟩ for every t, by the chain rule
        scores = grad_c  # ⟨∇ℓ, θt⟩ − ⟨∇ℓ, θ0⟩ for every expert: the LMO's argmin is the same
        current = c.detach() @ grad_c
        order = torch.argsort(scores)
        gap = float(current - scores[order[0]])
        value = float(loss.detach())
        if value < best[0]:
            best = (value, w.clone())
        if not soft:
            gamma = step_size * 2.0 / (i + 2)
            w = (1 - gamma) * w
            w[1 + int(order[0])] += gamma
            chosen = [labels[1 + int(order[0])]]
            trace["lambda"].append([gamma])
        else:
            top = order[: min(k, T)]
            vertices = torch.eye(T, device=tv.device)[top]

            def value_and_grad(lam_v, need_grad, vertices=vertices):
                lam_v = lam_v.to(tv.device, torch.float32).requires_grad_(need_grad)
                with torch.set_grad_enabled(need_grad):
                    f = loss_at(lam_v @ vertices)  # θ + Σ λj (s̃j − θ) = Σ λj s̃j on the simplex
                if not need_grad:
                    return float(f), None
                (g,) = torch.autograd.grad(f, lam_v)
                return float(f.detach()), g.double().cpu()

            key = tuple(int(j) for j in top)
            if key not in solved:
                solved[key] = simplex_argmin(value_and_grad, len(top))[:2]
            lam_star, inner = solved[key]
            w = torch.zeros_like(w)
            w[1 + top.cpu()] = lam_star.to(w)
            chosen = [f"{labels[1 + int(j)]}:{float(x):.2f}" for j, x in zip(top, lam_star)]
            trace["lambda"].append(lam_star.tolist())
            if inner < best[0]:
                best = (inner, w.clone())
        trace["loss"].append(value)
        trace["objective"].append(value)
        trace["gap"].append(gap)
        trace["chosen"].append(", ".join(chosen))
        trace["weights"].append(w.tolist())
        iterates.append((w.float() @ points)[:, None].clone())
        if progress:
            progress((i + 1) / steps, f"iteration {i + 1}/{steps}: loss {value:.4f}, gap {gap:.4f}", value)
    if soft:  # the iterate with the lowest calibration loss (the simplex step may overshoot)
        w = best[1]
        trace["best_loss"] = best[0]
    final = (w.float() @ points)[:, None]
    trace["vertices"] = labels
    return Run("", ctx.tasks, ["all layers"], final.cpu(), comb.delta(final, tv.base), trace,
               [c.cpu() for c in iterates], time.perf_counter() - t0, comb)


# ---- registry -----------------------------------------------------------------------------

ADA_PAPER = Paper("AdaMerging: adaptive model merging for multi-task learning", "2310.02575")
ADA_CART_PAPER = Paper("Revisiting weight averaging for model merging (AdaMerging+CART)", "2412.12153")
FW_PAPER = Paper("FW-Merging: scaling model merging with Frank-Wolfe optimization", "2503.12649")
ADA_PARAMS = (STEPS, LR, INIT, SAMPLES, DRAW_SEED)
ADA_NOTE = ("Entropy on the unlabeled validation images (the paper adapts on unlabeled test images; the test split "
            "is kept for reporting here). Layer-wise: one coefficient per tensor of the image tower.")


def _ada(granularity: str, cart: bool = False) -> Callable:
    def run(ctx, progress=None, cancel=None, *, steps, lr, init, samples, seed, rank_ratio=None):
        return run_adamerging(ctx, progress, cancel, granularity=granularity, steps=steps, lr=lr, init=init,
                              samples=samples, seed=seed, rank_ratio=rank_ratio if cart else None,
                              bounds=(0.0, 3.0) if cart else (0.0, 1.0))
    return run


def learned_weights(params, num_experts: int, run) -> tuple[list[float], str]:
    return run.coefficients.mean(1).tolist(), "learned (mean over layers)"


for name, display, gran, paper, avg in (("adamerging_task", "AdaMerging (task-wise)", "task", ADA_PAPER, 71.1),
                                        ("adamerging_layer", "AdaMerging (layer-wise)", "layer", ADA_PAPER, 80.1)):
    register(Method(
        name=name, display_name=display, paper=paper, objective="entropy", iterate="snapshot",
        weights=learned_weights, weighted_sum=gran == "task",
        description=f"θ0 + Σt λt{'' if gran == 'task' else ',l'} τt{'' if gran == 'task' else ',l'}, λ learned by "
                    "minimising prediction entropy on unlabeled validation images (Adam, clamp [0, 1]).",
        params=ADA_PARAMS, prepare=static_unused, apply=static_unused, run=_ada(gran),
        conventions=ADA_NOTE, published=(Published("ViT-B-32", avg, ADAMERGING_LOGS),)))
ADAMERGING_TASK = get("adamerging_task")  # the handle other modules name it by

register(Method(
    name="adamerging_cart", display_name="AdaMerging + CART", paper=ADA_CART_PAPER, objective="entropy", iterate="snapshot",
    weights=learned_weights,
    description="θavg + Σt λt,l SVD_k(θt − θavg), layer-wise λ learned by entropy minimisation (clamp [0, 3]).",
    params=(RANK_RATIO, with_default(STEPS, 300), LR, with_default(INIT, 1.0), SAMPLES, DRAW_SEED),
    prepare=static_unused, apply=static_unused, run=_ada("layer", cart=True),
    conventions=ADA_NOTE + " Low rank k = ⌈rank_ratio · r⌉ per attention/MLP matrix, as CART.",
    published=(Published("ViT-B-32", 85.8, CART_README),)))


def _fw(soft: bool) -> Callable:
    def run(ctx, progress=None, cancel=None, *, steps, lam, samples, seed, k=1, step_size=1.0):
        return run_fw(ctx, progress, cancel, soft=soft, steps=steps, lam=lam, samples=samples, k=k, seed=seed,
                      step_size=step_size)
    return run



register(Method(
    name="fw_hard", display_name="FW-Merging (hard)", paper=FW_PAPER, objective="calibration loss",
    iterate="iteration", weights=learned_weights, weighted_sum=True,
    description="Frank–Wolfe over the convex hull of the experts, from the start θ0 + lam Σ τ (TA; 0: the base): "
                "each iteration moves γi = step_size · 2/(i+2) of the way to the expert the linearised "
                "calibration loss prefers (the LMO).",
    params=(with_default(LAM, 0.0), with_default(STEPS, 10), with_default(SAMPLES, 100),
            with_default(STEP_SIZE, 0.5), DRAW_SEED),
    prepare=static_unused, apply=static_unused, run=_fw(False),
    conventions="LMO by the inner product ⟨∇ℓ, θt⟩ (the textbook rule; the authors' code scores per-tensor "
                "cosines against full weights). Cross-entropy on a labelled calibration set from validation."))
FW_SOFT = register(Method(
    name="fw_soft", display_name="FW-Merging (soft)", paper=FW_PAPER, objective="calibration loss",
    iterate="iteration", weights=learned_weights, weighted_sum=True,
    description="Frank–Wolfe with the top-k LMO vertices: λ* = argmin over the k-simplex of the calibration loss "
                "of Σj λj s̃j (projected gradient with backtracking), θ ← θ + Σj λ*j (s̃j − θ); start = TA with "
                "λ = lam (0: the base); the result is the iterate with the lowest calibration loss.",
    params=(with_default(LAM, 0.0), with_default(STEPS, 15), with_default(SAMPLES, 100), with_default(TOP_K, None),
            DRAW_SEED),
    prepare=static_unused, apply=static_unused, run=_fw(True), defaults_for=lambda T: {"k": min(T, TOP_K.max)},
    conventions="λ* on the simplex Σλ = 1 as the paper's Theorem 1 (the authors' code learns unconstrained "
                "layer-wise AdaMerging coefficients instead); k defaults to the number of experts, as the authors' "
                "code does (max_num_models)."))
