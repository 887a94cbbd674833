"""The static merges' definitions in fp64, written apart from merger/methods: the oracle of the
precision contract (docs/precision.md: every merge within 1e-4 relative Frobenius error per matrix of an
fp64 evaluation of its definition). tests/test_precision.py and ``python -m devtools report
precision`` compare each method with these.

Each definition takes the task vectors as stored, {key: [T, ...]} (bf16 or fp32, read exactly in
fp64), and returns Δ = θ − θ0 {key: fp64}. They follow docs/methods.md, the papers and their authors'
code, with the conventions each registry record states (``Method.conventions``). Plain and slow on
purpose: full SVDs, sorts, loops.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

import torch

from merger.methods.basic import TASK_ARITHMETIC, WEIGHT_AVERAGING
from merger.methods.breadcrumbs import BREADCRUMBS
from merger.methods.cart import CART
from merger.methods.consensus import CONSENSUS_TA
from merger.methods.iso import ISO_C, ISO_CTS
from merger.methods.magmax import MAGMAX
from merger.methods.model_stock import MODEL_STOCK
from merger.methods.slerp import SLERP
from merger.methods.ties import DARE_LINEAR, DARE_TIES, TIES
from merger.methods.tsv_m import TSV_M
from merger.methods.wudi import WUDI
from merger.pool.task_vectors import is_matrix

NULL = 1e-6  # the spectral methods' stated convention: a triplet with σ ≤ NULL · σ1 carries no direction


def _fp64(tau: dict):
    """(key, the stored task vectors in fp64) one tensor at a time (a whole pool in fp64 is 5.6 GB)."""
    return ((k, v.double()) for k, v in tau.items())


def _thin_svd(x: torch.Tensor):
    if x.shape[0] >= x.shape[1]:
        return torch.linalg.svd(x, full_matrices=False)
    v, s, uh = torch.linalg.svd(x.T, full_matrices=False)  # a wide matrix through its transpose: the same SVD
    return uh.T, s, v.T


def _svd(x: torch.Tensor, memo: dict | None = None, name=None):
    """x's thin SVD; with a ``memo``, kept under ``name`` for the next setting of the same task vectors."""
    if memo is None or name is None:
        return _thin_svd(x)
    if name not in memo:
        memo[name] = _thin_svd(x)
    return memo[name]


def _orthogonal(x: torch.Tensor) -> torch.Tensor:
    """U·Vh of x = U S Vh: the nearest matrix with orthonormal columns (rows)."""
    u, _, vh = _svd(x)
    return u @ vh


def _matrices(tau: dict, lam: float, out: dict):
    """(key, fp64 stack) of each matrix; every other tensor gets λ · mean τ in ``out`` (TSV-M and Iso)."""
    for key, v in _fp64(tau):
        if is_matrix(key, v.shape[1:]):
            yield key, v
        else:
            out[key] = lam * v.mean(0)


def weight_averaging(tau: dict, memo=None) -> dict:
    return {k: v.mean(0) for k, v in _fp64(tau)}


def task_arithmetic(tau: dict, lam: float, memo=None) -> dict:
    return {k: lam * v.sum(0) for k, v in _fp64(tau)}


def ties(tau: dict, lam: float, sparsity: float, memo=None) -> dict:
    """Trim each τt to its top ⌊(1 − s)·N⌋ magnitudes over its whole flattened task vector, elect
    sign(Σ trimmed), the mean of the agreeing non-zero entries; λ times that."""
    T = next(iter(tau.values())).shape[0]
    # the stored magnitudes are exact in fp32, and so is a selection among them
    flat = torch.cat([v.reshape(T, -1).float().abs() for v in tau.values()], 1)
    n = flat.shape[1]
    kept = max(1, math.floor((1 - sparsity) * n + 1e-6))
    thresholds = flat.kthvalue(n - kept + 1, dim=1).values.double()  # the kept-th largest
    del flat
    out = {}
    for k, v in _fp64(tau):
        trimmed = torch.where(v.abs() >= thresholds.reshape(-1, *[1] * (v.dim() - 1)), v, 0.0)
        elected = trimmed.sum(0).sign()
        agree = (trimmed.sign() == elected) & (trimmed != 0)
        out[k] = lam * (trimmed * agree).sum(0) / agree.sum(0).clamp(min=1)
    return out


def dare(tau: dict, lam: float, keep: dict, keep_probability: float, elect: bool) -> dict:
    """τ̃t = keep ⊙ τt / P(keep) (the masks drawn by the method's seeded preparation), then their sum
    (dare_linear) or TIES' election and disjoint mean (dare_ties); λ times that."""
    out = {}
    for k, v in _fp64(tau):
        # 1/P(keep) taken out of the sum and the mean (both scale with it): the elected sign is then that of
        # the stored values' exact sum, as in exact arithmetic (a rescaled sum that cancels would round)
        dropped = torch.where(keep[k], v, 0.0)
        if not elect:
            out[k] = lam * dropped.sum(0) / keep_probability
            continue
        elected = dropped.sum(0).sign()
        agree = (dropped.sign() == elected) & (dropped != 0)
        out[k] = lam * (dropped * agree).sum(0) / agree.sum(0).clamp(min=1) / keep_probability
    return out


def cart(tau: dict, lam: float, rank_ratio: float, memo=None) -> dict:
    """τ̄ + λ Σt SVD_k(τt − τ̄) on matrices (k = ⌈γ · min(m, n)⌉), τ̄ elsewhere (CART Eq. 4)."""
    out = {}
    for key, v in _fp64(tau):
        mean = v.mean(0)
        out[key] = mean
        if is_matrix(key, v.shape[1:]):
            r = min(v.shape[1:])
            k = min(r, max(1, math.ceil(rank_ratio * r - 1e-9)))
            for t, x in enumerate(v - mean):
                u, s, vh = _svd(x, memo, ("centred", key, t))
                out[key] = out[key] + lam * (u[:, :k] * s[:k]) @ vh[:k]
    return out


def tsv_m(tau: dict, lam: float, rank_ratio, memo=None) -> dict:
    """Per matrix: each τt's top k triplets (k = ⌊r/T⌋ at "auto", else ⌊γ·r⌋), concatenated, U and V
    replaced by their orthogonal factors, Δ = λ U⊥ S V⊥ᵀ; λ · mean τ elsewhere (the TSV authors' code)."""
    out = {}
    for key, v in _matrices(tau, lam, out):
        T, r = v.shape[0], min(v.shape[1:])
        k = r // T if rank_ratio == "auto" else min(r // T, math.floor(rank_ratio * r + 1e-9))
        us, ss, vs = [], [], []
        for t, x in enumerate(v):
            u, s, vh = _svd(x, memo, ("task", key, t))
            live = s[:k] > NULL * s[0]
            us.append(u[:, :k][:, live])
            ss.append(s[:k][live])
            vs.append(vh[:k][live])
        S = torch.cat(ss)
        if S.numel() == 0:
            out[key] = torch.zeros(v.shape[1:], dtype=torch.float64)
            continue
        out[key] = lam * (_orthogonal(torch.cat(us, 1)) * S) @ _orthogonal(torch.cat(vs, 0))
    return out


def iso_c(tau: dict, lam: float, memo=None) -> dict:
    """Per matrix Σ τt = U Σ Vᵀ, Δ = λ σ̄ U Vᵀ (σ̄ the mean of all r singular values); λ · mean τ elsewhere."""
    out = {}
    for key, v in _matrices(tau, lam, out):
        u, s, vh = _svd(v.sum(0), memo, ("sum", key))
        live = s > NULL * s[0]
        out[key] = lam * s.mean() * u[:, live] @ vh[live]
    return out


def iso_cts(tau: dict, lam: float, common_fraction: float, memo=None) -> dict:
    """The Iso authors' iso_cts (FusionBench's iso_utils.py) in fp64: the common subspace of Σ τ, each
    task's top directions of τt − U_c U_cᵀ τt, both sides orthogonalised, one flat spectrum."""
    out = {}
    for key, v in _matrices(tau, lam, out):
        T, r = v.shape[0], min(v.shape[1:])
        common = int(r * common_fraction)
        per_task = min(r // T, round((r - common) / T))
        common = r - per_task * T
        u, s, vh = _svd(v.sum(0), memo, ("sum", key))
        us, ss, vs = [u[:, :common]], [s[:common]], [vh[:common]]
        if per_task == 0:
            out[key] = iso_c({key: v}, lam, memo)[key]
            continue
        for t, x in enumerate(v):
            ut, st, vt = _svd(x - us[0] @ us[0].T @ x, memo, ("residual", key, t, common))
            us.append(ut[:, :per_task])
            ss.append(st[:per_task])
            vs.append(vt[:per_task])
        S = torch.cat(ss)
        live = S > NULL * S.max()
        out[key] = lam * S.mean() * _orthogonal(torch.cat(us, 1)[:, live]) @ _orthogonal(torch.cat(vs, 0)[live])
    return out


def magmax(tau: dict, lam: float, memo=None) -> dict:
    """Per entry the τt of largest magnitude (the later task on a tie); λ times that."""
    out = {}
    for key, v in _fp64(tau):
        best = v[0]
        for x in v[1:]:
            best = torch.where(x.abs() >= best.abs(), x, best)
        out[key] = lam * best
    return out


def consensus_ta(tau: dict, lam: float, mask_lambda: float, agree: int, memo=None) -> dict:
    """TALL masks mt = |τt| ≥ λ_mask · |τ_MTL − τt| (τ_MTL = Σ τ); entries kept by at least k masks; λ τ_MTL there."""
    out = {}
    for key, v in _fp64(tau):
        total = v.sum(0)
        votes = sum((x.abs() >= mask_lambda * (total - x).abs()).long() for x in v)
        out[key] = lam * torch.where(votes >= agree, total, 0.0)
    return out


def breadcrumbs(tau: dict, lam: float, beta: float, gamma: float, memo=None) -> dict:
    """Per task and row (the last dimension, n entries): drop the ⌊β·n⌋ largest and ⌊(1 − γ)·n⌋ smallest
    magnitudes (an entry tied with a kept bound is kept); λ Σ of what is kept."""
    out = {}
    for key, v in _fp64(tau):
        if v.dim() == 1:  # a scalar parameter: kept whole
            out[key] = lam * v.sum(0)
            continue
        n = v.shape[-1]
        rows = v.reshape(v.shape[0], -1, n)
        top, bottom = math.floor(beta * n + 1e-6), math.floor((1 - gamma) * n + 1e-6)
        if top >= n - bottom:
            out[key] = torch.zeros(v.shape[1:], dtype=torch.float64)
            continue
        if memo is None or ("ranked", key) not in memo:  # the stored magnitudes order exactly in fp32
            ranked = tau[key].float().reshape(rows.shape).abs().sort(dim=-1, descending=True).values.double()
            if memo is not None:
                memo[("ranked", key)] = ranked
        ranked = ranked if memo is None else memo[("ranked", key)]
        hi, lo = ranked[..., top:top + 1], ranked[..., n - bottom - 1:n - bottom]
        kept = (rows.abs() <= hi) & (rows.abs() >= lo)
        out[key] = lam * (rows * kept).sum(0).reshape(v.shape[1:])
    return out


def model_stock(tau: dict, memo=None) -> dict:
    """Per tensor t = k·cos θ / (1 + (k − 1)·cos θ) (cos θ the mean pairwise cosine, clamped to [0, 1]);
    Δ = t · mean τ."""
    out = {}
    for key, v in _fp64(tau):
        T = v.shape[0]
        flat = v.reshape(T, -1)
        if T == 1:
            cos = torch.tensor(1.0, dtype=torch.float64)
        else:
            unit = flat / flat.norm(dim=1, keepdim=True)
            pairs = [float(unit[i] @ unit[j]) for i in range(T) for j in range(T) if i != j]
            cos = torch.tensor(sum(pairs) / len(pairs), dtype=torch.float64)
        cos = cos.clamp(0.0, 1.0)
        out[key] = (T * cos / (1 + (T - 1) * cos)) * v.mean(0)
    return out


def slerp(tau: dict, t: float, memo=None) -> dict:
    """Two experts: sin((1 − t)Ω)/sin Ω · τ1 + sin(tΩ)/sin Ω · τ2 per tensor; linear where |cos Ω| > 0.9995."""
    out = {}
    for key, v in _fp64(tau):
        a, b = v[0].reshape(-1), v[1].reshape(-1)
        cos = float(a @ b / (a.norm() * b.norm())) if a.norm() > 0 and b.norm() > 0 else 1.0
        if abs(cos) > 0.9995:
            out[key] = (1 - t) * v[0] + t * v[1]
            continue
        omega = math.acos(cos)
        out[key] = (math.sin((1 - t) * omega) * v[0] + math.sin(t * omega) * v[1]) / math.sin(omega)
    return out


def wudi(tau: dict, lam: float, steps: int, lr: float = 1e-5, memo=None) -> dict:
    """Per matrix, Adam (lr 1e-5) from Σ τt on Σt ‖(τ − τt) τtᵀ‖² / ‖τt‖², whose gradient is
    2 Σt (τ − τt) Gt with Gt = τtᵀ τt / ‖τt‖², that is 2 (τ Σt Gt − Σt τt Gt); zero elsewhere (the
    authors' code)."""
    out = {}
    for key, v in _fp64(tau):
        if not is_matrix(key, v.shape[1:]):
            out[key] = torch.zeros(v.shape[1:], dtype=torch.float64)
            continue
        grams = [t.T @ t / t.square().sum() for t in v]
        a, b = sum(grams), sum(t @ g for t, g in zip(v, grams))
        x = torch.nn.Parameter(v.sum(0).clone())
        opt = torch.optim.Adam([x], lr=lr)
        for _ in range(steps):
            x.grad = 2 * (x.detach() @ a - b)
            opt.step()
        out[key] = lam * x.detach()
    return out


def dare_masks(tv, sparsity: float, seed: int) -> tuple[dict, float]:
    """The masks DARE's seeded preparation draws (the definition's m ~ Bernoulli(1 − p), p realised as
    round(p · LEVELS)/LEVELS: ties.dare_level), and P(keep)."""
    from merger.methods.ties import dare_level, keep_probability, prepare_dare

    level = dare_level(sparsity)
    keep = {k: d >= level for k, d in prepare_dare(tv, seed)["draws"].items()}
    return keep, keep_probability(level)


@dataclass(frozen=True)
class Definition:
    method: object  # the registry record
    evaluate: Callable  # evaluate(tv, params, memo) -> Δ {key: fp64}; memo: SVDs kept between settings
    settings: Callable  # settings(T) -> [params]: the default first, then others


def _on_stacks(fn: Callable) -> Callable:
    return lambda tv, params, memo=None: fn(tv.stacked, **params, memo=memo)


def _dare(elect: bool) -> Callable:
    def evaluate(tv, params, memo=None):
        keep, probability = dare_masks(tv, params["sparsity"], params["seed"])
        return dare(tv.stacked, params["lam"], keep, probability, elect)
    return evaluate


def _settings(default: dict, *others: dict) -> Callable:
    return lambda T: [default, *others]


DEFINITIONS = (
    Definition(WEIGHT_AVERAGING, _on_stacks(weight_averaging), _settings({})),
    Definition(TASK_ARITHMETIC, _on_stacks(task_arithmetic), _settings({"lam": 0.3}, {"lam": 1.0}, {"lam": -0.5})),
    Definition(TIES, _on_stacks(ties), _settings({"lam": 1.0, "sparsity": 0.8}, {"lam": 1.0, "sparsity": 0.5},
                                                 {"lam": 0.7, "sparsity": 0.95})),
    Definition(DARE_LINEAR, _dare(False), _settings({"lam": 0.3, "sparsity": 0.9, "seed": 0},
                                                    {"lam": 0.5, "sparsity": 0.5, "seed": 1},
                                                    {"lam": 1.0, "sparsity": 0.7, "seed": 0})),
    Definition(DARE_TIES, _dare(True), _settings({"lam": 1.0, "sparsity": 0.9, "seed": 0},
                                                 {"lam": 1.0, "sparsity": 0.5, "seed": 1},
                                                 {"lam": 0.7, "sparsity": 0.7, "seed": 0})),
    Definition(CART, _on_stacks(cart), _settings({"lam": 1.5, "rank_ratio": 0.08}, {"lam": 1.0, "rank_ratio": 0.32},
                                                 {"lam": 2.0, "rank_ratio": 0.75})),
    # the default rank, one well below it, and the slider's last step below 1/T
    Definition(TSV_M, _on_stacks(tsv_m), lambda T: [{"lam": 1.0, "rank_ratio": "auto"},
                                                    {"lam": 1.0, "rank_ratio": 0.05},
                                                    {"lam": 1.5, "rank_ratio": math.floor(100 / T - 1) / 100}]),
    Definition(ISO_C, _on_stacks(iso_c), _settings({"lam": 1.3}, {"lam": 1.0})),
    Definition(ISO_CTS, _on_stacks(iso_cts), _settings({"lam": 1.5, "common_fraction": 0.8},
                                                       {"lam": 1.5, "common_fraction": 0.5},
                                                       {"lam": 1.0, "common_fraction": 0.95})),
    Definition(MAGMAX, _on_stacks(magmax), _settings({"lam": 0.5}, {"lam": 1.0})),
    Definition(CONSENSUS_TA, _on_stacks(consensus_ta), _settings({"lam": 0.3, "mask_lambda": 0.4, "agree": 2},
                                                                 {"lam": 0.5, "mask_lambda": 0.2, "agree": 1},
                                                                 {"lam": 1.0, "mask_lambda": 0.6, "agree": 3})),
    Definition(BREADCRUMBS, _on_stacks(breadcrumbs), _settings({"lam": 0.3, "beta": 0.01, "gamma": 0.16},
                                                               {"lam": 0.5, "beta": 0.0, "gamma": 0.5},
                                                               {"lam": 1.0, "beta": 0.05, "gamma": 0.9})),
    Definition(MODEL_STOCK, _on_stacks(model_stock), _settings({})),
    Definition(SLERP, _on_stacks(slerp), _settings({"t": 0.5}, {"t": 0.2}, {"t": 0.9})),
    Definition(WUDI, _on_stacks(wudi), _settings({"lam": 1.0, "steps": 300}, {"lam": 1.0, "steps": 30},
                                                 {"lam": 0.5, "steps": 100})),
)


def relative_errors(definition: Definition, tv, params: dict, prepared=None, memo: dict | None = None) -> dict:
    """{key: ‖ours − fp64‖F / ‖fp64‖F} of one method's Δ (as the app merges it: prepare, derive, apply)
    against its fp64 definition, per tensor (‖ours‖F where the definition's Δ is zero). ``memo``: one dict
    per method and task vectors, for the definition's SVDs across settings."""
    m = definition.method
    resolved = m.resolve(params, tv.num_tasks)
    if prepared is None:
        prepared = m.prepare(tv, **{k: resolved[k] for k in m.prepare_params})
    ours = m.delta(prepared, **resolved)
    exact = definition.evaluate(tv, resolved, memo)
    out = {}
    for key, ref in exact.items():
        diff = float((ours[key].double().cpu() - ref).norm())
        scale = float(ref.norm())
        out[key] = diff / scale if scale > 0 else diff
    return out
