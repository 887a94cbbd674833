"""The papers' diagnostics, each beside its paper's arXiv id and equation. Weights-only ones take
TaskVectors; feature-space ones take an evaluator. Plain numbers out: plots.py draws them."""
from __future__ import annotations

import math
from typing import Sequence

import torch
import torch.nn.functional as F

from merger import longsum, methods
from merger.errors import MergerError
from merger.methods.ties import kept_count


def _flat(tv, i: int) -> torch.Tensor:
    return torch.cat([tv.row(k, i).reshape(-1) for k in tv.keys])


def _layer_of(key: str) -> str:
    """'visual.transformer.resblocks.3.mlp.c_fc.weight' -> 'block 3'; other tensors by their module."""
    parts = key.split(".")
    if "resblocks" in parts:
        return f"block {parts[parts.index('resblocks') + 1]}"
    return parts[1] if len(parts) > 2 else parts[-1]


# ---- weights only -------------------------------------------------------------------------

def _grams(tv) -> dict[str, torch.Tensor]:
    """Per tensor, the fp64 Gram ⟨τi, τj⟩ of the task vectors (``longsum``: fp32 sums over a whole
    tower were 1e-3 off)."""
    return {k: longsum.gram(tv.fp32(k)) for k in tv.keys}


def task_vector_norms(tv) -> dict:
    """Global ‖τt‖ and per-layer ‖τt,l‖ (layers = transformer blocks and the other modules); relative:
    ‖τt‖ / ‖θ0‖ (infinite for a zero base); the cosine matrix, from the same sums."""
    grams = _grams(tv)
    layers: dict[str, list[str]] = {}
    for k in tv.keys:
        layers.setdefault(_layer_of(k), []).append(k)
    per_layer = {name: sum(grams[k].diagonal() for k in keys).sqrt().tolist() for name, keys in layers.items()}
    glob = sum(grams.values()).diagonal().sqrt().tolist()
    base = math.sqrt(sum(longsum.inner(v, v) for v in tv.base.values()))
    return {"tasks": tv.tasks, "global": glob, "relative": [g / base if base else math.inf for g in glob],
            "layers": per_layer, "cosine": cosine_matrix(tv, grams)}


def cosine_matrix(tv, grams: dict[str, torch.Tensor] | None = None) -> list[list[float]]:
    """cos(τi, τj) over every merged tensor; ``grams``: ``_grams(tv)`` where already made."""
    return longsum.cosines(sum((grams or _grams(tv)).values())).tolist()


def sign_conflicts(tv) -> list[list[float]]:
    """Fraction of entries, among those where both task vectors are non-zero, with opposite signs."""
    signs = torch.stack([_flat(tv, i).sign() for i in range(tv.num_tasks)])
    T = tv.num_tasks
    out = [[0.0] * T for _ in range(T)]
    for i in range(T):
        for j in range(T):
            both = (signs[i] != 0) & (signs[j] != 0)
            out[i][j] = float(((signs[i] != signs[j]) & both).sum()) / max(1, int(both.sum()))
    return out


def mass_kept(tv, sparsity: float) -> list[float]:
    """Per task, the share of ‖τt‖² kept by its top (1 − sparsity) entries by magnitude; 1 for a
    task vector of zeros (an expert equal to the base loses nothing: 0/0 was NaN)."""
    out = []
    for i in range(tv.num_tasks):
        sq = _flat(tv, i).pow(2)
        n, total = sq.numel(), sq.sum()
        kept = sq.topk(kept_count(n, sparsity)).values.sum() if sparsity > 0 else total
        out.append(float(kept / total) if total > 0 else 1.0)
    return out


def spectra(tv, key: str) -> dict:
    """Singular values of every τt and of every centred θt − θavg for one matrix."""
    if key not in tv.matrices:
        raise MergerError(f"{key} is not an attention/MLP matrix")
    x = tv.fp32(key)
    return {"uncentred": torch.linalg.svdvals(x).tolist(), "centred": torch.linalg.svdvals(x - x.mean(0)).tolist()}


def _sv(x):
    u, s, vh = torch.linalg.svd(x, full_matrices=False)
    return s, vh


def reconstruction_and_interference(tv, ks: Sequence[int], centred: bool, keys: Sequence[str] | None = None) -> dict:
    """R(k) = Σt ‖τ̄t − SVD_k(τ̄t)‖²F and I(k) = Σ_{i≠j} ‖Σ̃i (Ṽiᵀ Ṽj) Σ̃j‖F per matrix and summed,
    Ṽ the top-k right singular vectors, Σ̃ the top-k singular values divided by ‖τ̄t‖F."""
    keys = list(keys or tv.matrices)
    per = {k: {"R": [], "I": []} for k in keys}
    for key in keys:
        x = tv.fp32(key)
        if centred:
            x = x - x.mean(0)
        s, vh = _sv(x)  # [T, r], [T, r, n]
        norms = longsum.gram(x).diagonal().sqrt().float().clamp(min=1e-30)
        for k in ks:
            k = min(k, s.shape[1])
            per[key]["R"].append(float(s[:, k:].pow(2).sum()))
            st = s[:, :k] / norms[:, None]
            total = 0.0
            for i in range(x.shape[0]):
                for j in range(x.shape[0]):
                    if i != j:
                        m = st[i][:, None] * (vh[i, :k] @ vh[j, :k].T) * st[j][None, :]
                        total += longsum.norm(m)
            per[key]["I"].append(total)
    summed = {"R": [sum(per[k]["R"][n] for k in keys) for n in range(len(ks))],
              "I": [sum(per[k]["I"][n] for k in keys) for n in range(len(ks))]}
    return {"k": list(ks), "per_layer": per, "sum": summed, "centred": centred}


def masking_methods() -> list[str]:
    """The methods whose merge keeps only some entries of each τ (their sparsifying operator M)."""
    return [m.name for m in methods.all_methods() if m.mask is not None]


def merge_mask(tv, method: str, sparsity: float | None = None, seed: int | None = None, **params) -> torch.Tensor:
    """Per task, the entries a method's merge keeps, [T, P] bool (the method's own ``mask``), at its
    parameters (those it does not take are ignored; the ones left out at their defaults)."""
    m = methods.get(method)
    if m.mask is None:
        raise MergerError(f"mask '{method}' unknown; one of {', '.join(masking_methods())}")
    given = {**params, "sparsity": sparsity, "seed": int(seed or 0)}
    resolved = m.resolve({k: v for k, v in given.items() if k in m.param_names}, tv.num_tasks)
    return m.mask(tv, **resolved)


def heterogeneity(tv, coefficients: Sequence[float], mask: str | None = None, sparsity: float | None = None,
                  seed: int | None = None, task_weights: dict | None = None, **params) -> dict:
    """ζt² ∝ ‖τt − τ̄‖², τ̄ = Σk λk τk, per task; with a merge's mask M its reduction (arXiv 2601.21690, Eq. 10)
    δt(M) = Σ_{j dropped from τt} [(τt,j − τ̄j)² − (0 − τ̄~j)²], τ̄~ = Σk λk M(τk) the masked consensus,
    and ζ̂t² = ζt² − δt(M); χ² of the coefficients and simplex warnings. ``task_weights``: the merge's
    wₜ, whose mask is taken on the wₜτₜ it merges (MagMax's largest entry, TIES' elected sign)."""
    T = tv.num_tasks
    given = [float(c) for c in coefficients]
    if len(given) != T:
        raise MergerError(f"heterogeneity: {len(given)} coefficients for {T} tasks")
    lam = torch.tensor(given)
    flat = torch.stack([_flat(tv, i) for i in range(T)])
    consensus = lam @ flat
    zeta = ((flat - consensus) ** 2).sum(1)
    out = {"tasks": tv.tasks, "zeta2": zeta.tolist(), "coefficients": given, **chi_square(given)}
    # sparsity 0 keeps every entry (TIES, DARE): no reduction to show
    if mask is not None and (sparsity or "sparsity" not in methods.get(mask).param_names):
        keep = merge_mask(tv.scaled(task_weights) if task_weights else tv, mask, sparsity, seed, **params)
        masked_consensus = lam @ torch.where(keep, flat, 0.0)
        delta = torch.where(~keep, (flat - consensus) ** 2 - masked_consensus ** 2, 0.0).sum(1)
        out["delta"] = delta.tolist()
        out["zeta2_hat"] = (zeta - delta).tolist()
        out["dropped"] = (~keep).float().mean(1).tolist()
        out["mask"] = mask
    return out


def chi_square(coefficients: Sequence[float]) -> dict:
    """χ²(p‖λ) = Σt (1/T − λt)² / λt² as the paper prints it, and whether λ leaves the simplex."""
    T = len(coefficients)
    chi = sum((1 / T - c) ** 2 / c ** 2 if c != 0 else math.inf for c in coefficients)
    total = sum(coefficients)
    warnings = []
    if abs(total - 1) > 1e-6:
        warnings.append(f"Σλ = {total:.3g} ≠ 1: the coefficients leave the simplex the theory assumes")
    if any(c < 0 for c in coefficients):
        warnings.append("some λ < 0: outside the simplex the theory assumes")
    return {"chi2": chi, "sum": total, "warnings": warnings}


# ---- checkpoints over epochs (arXiv 2508.16082) ---------------------------------------------------

def epoch_dynamics(points: Sequence[torch.Tensor]) -> dict:
    """points = [θ0, θ(1), …, θ(E)] flattened. Update-norm shares, the epoch × epoch cosine matrix
    of updates, and cos(τ(k), τ(1)) with τ(k) = θ(k) − θ0."""
    if len(points) < 3:
        raise MergerError("epoch dynamics need a trajectory with at least two epochs after the base")
    update_gram = longsum.gram(torch.stack([points[e] - points[e - 1] for e in range(1, len(points))]))
    norms = update_gram.diagonal().sqrt()
    tau_cosines = longsum.cosines(longsum.gram(torch.stack([p - points[0] for p in points[1:]])))
    return {"shares": (norms / norms.sum()).tolist(), "cosine": longsum.cosines(update_gram).tolist(),
            "cos_to_first": tau_cosines[:, 0].tolist()}


# ---- features on a probe batch (arXiv 2402.03660) -------------------------------------------------

def probe_images(evaluator, split: str = "val", per_task: int = 16) -> torch.Tensor:
    """A probe batch with images of every task: the first ``per_task`` of each image source."""
    return torch.cat([x[:per_task] for x, _ in evaluator.inputs(split)])


def block_features(model_visual, weights: dict, x: torch.Tensor) -> list[torch.Tensor]:
    """Per transformer block, its output over all tokens, flattened to [N, tokens × width] (arXiv 2402.03660,
    B.1.2: the cosine is taken over the whole token × hidden feature, not the class token)."""
    from torch.func import functional_call

    feats = []
    hooks = [blk.register_forward_hook(lambda m, i, o: feats.append((o[0] if isinstance(o, tuple) else o)))
             for blk in model_visual.transformer.resblocks]
    try:
        with torch.no_grad():
            functional_call(model_visual, {k[len("visual."):]: v for k, v in weights.items()}, (x,))
    finally:
        for h in hooks:
            h.remove()
    if not getattr(model_visual.transformer, "batch_first", True):
        feats = [f.transpose(0, 1) for f in feats]  # [L, N, D] -> [N, L, D]
    return [f.reshape(f.shape[0], -1).float() for f in feats]


def _distance(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """1 − cos per row, in fp64: where a merge is nearly linear little of it is left, and an fp32 cosine
    over a ViT-L/14 block's 263 k features put that 1e-3 (relative) off."""
    return 1 - F.cosine_similarity(a.double(), b.double(), dim=-1)


def _mean_pairwise_distance(features: Sequence[torch.Tensor], budget: int = 64 << 20) -> float:
    """The mean over pairs i < j and over rows of 1 − cos(features[i], features[j]) in fp64 (NaN for
    fewer than two): each row normalised once and one Gram of the k rows per sample, over slices of
    rows whose fp64 copies fit ``budget`` bytes (a ViT-L/14 block's row is 263 k features)."""
    k = len(features)
    if k < 2:
        return float("nan")
    i, j = torch.triu_indices(k, k, 1)
    n, width = features[0].shape
    step = max(1, budget // (8 * k * width))
    total = 0.0
    for start in range(0, n, step):
        unit = torch.stack([F.normalize(f[start: start + step].double(), dim=-1) for f in features], 1)
        total += float((1 - torch.bmm(unit, unit.transpose(1, 2))[:, i, j]).sum())
    return total / (n * len(i))


def cross_task_linearity(features, merged: dict, experts: Sequence[dict], weights: Sequence[float],
                         x: torch.Tensor, base: dict | None = None) -> dict:
    """Per layer: 1 − cos(f(θmerged; x), prediction) (mean and quartiles over x), against two
    baselines of arXiv 2402.03660: ``pairwise``, the mean over pairs of experts i < j of
    1 − cos(f(θi; x), f(θj; x)) (its Fig. 2: the experts' features differ, so a small gap means
    something), and ``baseline``, the mean over the endpoints e of 1 − cos(f(θmerged; x), f(e; x))
    (its Eq. 1 for k models: the merge against each one).

    The prediction is the affine form (1 − Σ wt) f(θ0) + Σ wt f(θt) when ``base`` is given (the
    paper's Eq. 2 for task arithmetic: θ0 + Σ wt τt = (1 − Σ wt) θ0 + Σ wt θt), else Σ wt f(θt).
    The endpoints are the models the prediction combines with a non-zero weight; the pairs, those
    of the experts among them (none for fewer than two: NaN).
    ``features(weights, x)`` returns one [N, D] feature tensor per layer (e.g. block_features)."""
    fm = features(merged, x)
    fe = [features(e, x) for e in experts]
    w0 = 1.0 - sum(weights)
    fb = features(base, x) if base is not None and abs(w0) > 1e-9 else None
    out = {"mean": [], "q25": [], "q75": [], "baseline": [], "pairwise": [],
           "base_weight": w0 if base is not None else 0.0}
    for layer in range(len(fm)):
        pred = sum(w * f[layer] for w, f in zip(weights, fe))
        weighted = [f[layer] for w, f in zip(weights, fe) if w != 0]
        out["pairwise"].append(_mean_pairwise_distance(weighted))
        ends = weighted
        if fb is not None:
            pred = pred + w0 * fb[layer]
            ends = weighted + [fb[layer]]
        d = _distance(fm[layer], pred)
        out["mean"].append(float(d.mean()))
        out["q25"].append(float(d.quantile(0.25)))
        out["q75"].append(float(d.quantile(0.75)))
        gaps = [float(_distance(fm[layer], e).mean()) for e in ends]
        out["baseline"].append(sum(gaps) / len(gaps) if gaps else float("nan"))
    return out


def gradient_at_base(evaluator, task: str, split: str = "train") -> dict[str, torch.Tensor]:
    """∇θ of the task's mean cross-entropy (frozen head) at the base, over the whole split."""
    from torch.func import functional_call

    tv = evaluator.pool.task_vectors
    params = {k: tv.base[k].clone().requires_grad_(True) for k in tv.keys}
    d = evaluator.data.split(task, split)
    from merger.data.tasks import preprocess

    x = preprocess(d.images, evaluator.pool.preprocess_cfg).to(evaluator.device)
    y = d.labels.to(evaluator.device)
    total = 0.0
    for i in range(0, len(y), 512):
        f = F.normalize(functional_call(evaluator.model.visual, {k[7:]: v for k, v in params.items()},
                                        (x[i:i + 512],)).float(), dim=-1)
        logits = evaluator.logit_scale * f @ evaluator.heads[task].T
        total = total + F.cross_entropy(logits, y[i:i + 512], reduction="sum")
    grads = torch.autograd.grad(total / len(y), list(params.values()))
    return dict(zip(params, grads))


def gradient_alignment(tau1: torch.Tensor, grad: torch.Tensor) -> float:
    """cos(τ(1), −∇L(θ0)): exactly 1 for one epoch of full-batch gradient descent."""
    return -longsum.inner(tau1, grad) / max(longsum.norm(tau1) * longsum.norm(grad), 1e-300)


def interpolation_path(evaluator, space, a: torch.Tensor, b: torch.Tensor, features, x: torch.Tensor,
                       alphas: Sequence[float] = tuple(i / 10 for i in range(11)), split: str = "live",
                       lock=None) -> dict:
    """Along θ(α) = (1 − α) a + α b: average loss and accuracy, and the mean over layers of
    1 − cos(f(θ(α); x), (1 − α) f(a; x) + α f(b; x)) (zero at both ends by construction)."""
    import contextlib

    fa, fb = features(space.unflatten(a), x), features(space.unflatten(b), x)
    out = {"alpha": list(alphas), "loss": [], "accuracy": [], "linearity": []}
    for alpha in alphas:
        point = (1 - alpha) * a + alpha * b
        with lock or contextlib.nullcontext():
            evaluator.load(space.unflatten(point))
            acc, loss, _ = evaluator.forward(split)
        out["accuracy"].append(sum(acc.values()) / len(acc))
        out["loss"].append(sum(loss.values()) / len(loss))
        fp = features(space.unflatten(point), x)
        gaps = [float(_distance(p, (1 - alpha) * u + alpha * v).mean()) for p, u, v in zip(fp, fa, fb)]
        out["linearity"].append(sum(gaps) / len(gaps))
    return out


def logit_ensemble_accuracy(evaluator, experts: Sequence[dict], weights: Sequence[float], split: str = "test",
                            lock=None, base: dict | None = None) -> dict[str, float]:
    """Per task, the accuracy of (1 − Σw) logits(θ0; x) + Σt wt logits(θt; x): the outputs a merge
    θ0 + Σ wt τt would have were the model linear in its weights (cross-task linearity's prediction).
    Without the base term a task-arithmetic λ only scaled the logits (no argmax moved), and λ = 0
    summed nothing. ``base``: θ0 (its term left out where Σw = 1, or base is None)."""
    import contextlib

    summed: dict[str, torch.Tensor] = {}
    labels: dict[str, torch.Tensor] = {}
    rest = 1.0 - float(sum(weights))
    members = list(zip(weights, experts)) + ([(rest, base)] if base is not None and abs(rest) > 1e-12 else [])
    for w, expert in members:
        with lock or contextlib.nullcontext():
            evaluator.load(expert)
            with torch.inference_mode():
                for x, members in evaluator.inputs(split):
                    f = F.normalize(evaluator.encode(x), dim=-1)
                    for t, y in members:
                        logits = evaluator.logit_scale * f @ evaluator.heads[t].T
                        summed[t] = summed.get(t, 0) + w * logits
                        labels[t] = y
    return {t: float((summed[t].argmax(-1) == labels[t].to(summed[t].device)).float().mean()) for t in summed}
