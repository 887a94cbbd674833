"""RegMean (Jin et al., arXiv 2212.09849): per linear layer, the weights that best reproduce every
expert's outputs on its own inputs, W = (Σt G̃t)⁻¹ Σt G̃t Wt with Gt = XtᵀXt the Gram matrix of the
layer's inputs on task t's validation images and G̃t = α·Gt + (1 − α)·diag(Gt); other tensors averaged.

The Gram matrices are the data statistics (one forward per expert, kept per expert subset): a
change of α re-solves without a forward. The task-vector form Δᵀ = (Σ G̃t)⁻¹ Σ G̃t τtᵀ is the
same solve as in full weights (θ0 cancels)."""
from __future__ import annotations

import time

import torch
import torch.nn.functional as F
from torch.func import functional_call

from merger.errors import Cancelled, MethodError
from merger.methods.data import DRAW_SEED, VISUAL, Run, calibration_set, static_unused
from merger.methods.registry import (FUSIONBENCH, MATRICES_NOTE, SAMPLES, Method, Paper, Param, Published, register,
                                     with_default)

ALPHA = Param("alpha", 0.9, 0.0, 1.0, 0.05, label="α (Gram off-diagonal scale)",
              help="RegMean: the off-diagonal entries of each Gram matrix are scaled by α (1: the exact least-squares "
                   "merge; 0: a per-input-feature weighted mean)")


def attention_context(mha: torch.nn.MultiheadAttention, query, key, value, attn_mask=None) -> torch.Tensor:
    """The attention's output before out_proj [tokens, width]: nn.MultiheadAttention hands it to
    out_proj's weight directly, so no hook can see it; it is recomputed from the inputs here."""
    if not mha.batch_first:
        query, key, value = (z.transpose(0, 1) for z in (query, key, value))
    N, L, D = query.shape
    h = mha.num_heads
    wq, wk, wv = mha.in_proj_weight.chunk(3)
    bq, bk, bv = mha.in_proj_bias.chunk(3) if mha.in_proj_bias is not None else (None,) * 3
    q, k, v = (F.linear(z, w, b).view(N, -1, h, D // h).transpose(1, 2)
               for z, w, b in ((query, wq, bq), (key, wk, bk), (value, wv, bv)))
    if attn_mask is not None and attn_mask.dtype == torch.bool:
        attn_mask = ~attn_mask  # MultiheadAttention: True = masked out; SDPA: True = attend
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask)
    return out.transpose(1, 2).reshape(N * L, D)


class GramRecorder:
    """Forward hooks that add each merged matrix's input Gram XᵀX (fp64, summed over tokens) while a
    model runs; ``grams()`` gives them divided by the token count (a mean, as the authors' code)."""

    def __init__(self, model: torch.nn.Module, keys):
        self.sums: dict[str, torch.Tensor] = {}
        self.tokens: dict[str, int] = {}
        self.handles = []
        keys = set(keys)
        for name, mod in model.named_modules():
            prefix = VISUAL + name + "."
            if isinstance(mod, torch.nn.MultiheadAttention) and prefix + "in_proj_weight" in keys:
                self.handles.append(mod.register_forward_hook(self._attention(prefix), with_kwargs=True))
            elif isinstance(mod, torch.nn.Linear) and prefix + "weight" in keys and not name.endswith("out_proj"):
                self.handles.append(mod.register_forward_pre_hook(self._linear(prefix + "weight")))

    def add(self, key: str, x: torch.Tensor) -> None:
        x = x.detach().reshape(-1, x.shape[-1]).double()
        self.sums[key] = self.sums.get(key, 0) + x.T @ x
        self.tokens[key] = self.tokens.get(key, 0) + x.shape[0]

    def _linear(self, key):
        def hook(mod, args):
            self.add(key, args[0])
        return hook

    def _attention(self, prefix):
        def hook(mod, args, kwargs, output):
            names = ("query", "key", "value")
            q, k, v = (args[i] if len(args) > i else kwargs[n] for i, n in enumerate(names))
            context = attention_context(mod, q, k, v, kwargs.get("attn_mask"))
            got = output[0] if isinstance(output, tuple) else output
            redo = F.linear(context, mod.out_proj.weight, mod.out_proj.bias).reshape(got.shape if mod.batch_first
                                                                                       else got.transpose(0, 1).shape)
            ref = got if mod.batch_first else got.transpose(0, 1)
            if float((redo - ref).norm()) > 1e-3 * float(ref.norm()) + 1e-6:
                raise MethodError(f"regmean: {prefix}attn is an attention RegMean cannot read (its recomputed output "
                                  "differs from the module's)")
            self.add(prefix + "in_proj_weight", q)
            self.add(prefix + "out_proj.weight", context)
        return hook

    def grams(self) -> dict[str, torch.Tensor]:
        return {k: s / self.tokens[k] for k, s in self.sums.items()}

    def close(self) -> None:
        for h in self.handles:
            h.remove()


def add_expert(stats: dict, grams: dict, taus: dict) -> None:
    """Add one expert's Grams Gt (fp64) and task vectors τt to (S, P, Q) per matrix. S and P stay fp64:
    at α = 1 the solve divides P by S's small eigenvalues (inputs that share a few directions, as
    LayerNorm and GELU outputs do), and P rounded to fp32 then lost the merge. Q, weighted by 1 − α,
    which keeps S̃ well conditioned, is kept in fp32: it is as large as a weight."""
    for k, g in grams.items():
        tau = taus[k].double()
        s, p, q = stats.get(k, (0, 0, 0))
        stats[k] = (s + g, p + g @ tau.T, q + (g.diagonal()[:, None] * tau.T).float())


def gram_statistics(ctx, samples: int, seed: int, progress=None, cancel=None) -> dict:
    """Per matrix, (S = Σt Gt, P = Σt Gt τtᵀ, Q = Σt diag(Gt) τtᵀ): everything α needs, linear in each Gt."""
    batches = calibration_set(ctx, samples, seed)
    tv = ctx.tv
    stats: dict[str, tuple] = {}
    for i in range(tv.num_tasks):
        if cancel is not None and cancel():
            raise Cancelled("run cancelled; nothing was cached")
        recorder = GramRecorder(ctx.model, tv.matrices)
        params = ctx.expert_params(i)
        dtype = next(iter(params.values())).dtype
        try:
            with torch.no_grad():
                for x, _ in ctx.expert_batches(batches, i):
                    functional_call(ctx.model, params, (x.to(dtype),))
        finally:
            recorder.close()
        grams = recorder.grams()
        missing = [k for k in tv.matrices if k not in grams]
        if missing:
            raise MethodError(f"regmean: no inputs reached {missing[0]} (the image tower never called it)")
        add_expert(stats, grams, {k: tv.row(k, i) for k in tv.matrices})
        if progress:
            progress((i + 1) / tv.num_tasks, f"Gram matrices of expert {i + 1}/{tv.num_tasks}")
    return stats


def regmean_delta(tv, stats: dict, alpha: float) -> dict[str, torch.Tensor]:
    delta = {k: v.mean(0) for k, v in tv.items32()}  # off the matrices: the mean, as the authors' code
    for k, (s, p, q) in stats.items():
        lhs = alpha * s + (1 - alpha) * torch.diag(s.diagonal())
        rhs = (alpha * p + (1 - alpha) * q).double()
        solved, info = torch.linalg.solve_ex(lhs, rhs)
        if int(info) != 0:  # singular (inputs that never vary): the least-norm solution
            solved = torch.linalg.pinv(lhs, hermitian=True) @ rhs
        delta[k] = solved.T.float()
    return delta


def run_regmean(ctx, progress=None, cancel=None, *, alpha: float, samples: int, seed: int) -> Run:
    t0 = time.perf_counter()
    stats = ctx.statistic(("regmean grams", samples, seed),
                          lambda: gram_statistics(ctx, samples, seed, progress, cancel))
    T = ctx.tv.num_tasks
    return Run("", ctx.tasks, ["all layers"], torch.full((T, 1), 1.0 / T), regmean_delta(ctx.tv, stats, alpha),
               {"objective": []}, [], time.perf_counter() - t0)


def regmean_weights(params, num_experts: int, run) -> tuple[list[float], str]:
    return run.coefficients.mean(1).tolist(), "1/T per task (RegMean weighs input directions, not tasks)"


REGMEAN = register(Method(
    name="regmean",
    display_name="RegMean",
    paper=Paper("Dataless knowledge fusion by merging weights of language models", "2212.09849"),
    description="Per attention/MLP matrix, W = (Σt G̃t)⁻¹ Σt G̃t Wt, Gt the Gram matrix of the layer's inputs on task "
                "t's validation images, off-diagonals scaled by α; the average elsewhere.",
    params=(ALPHA, with_default(SAMPLES, 256), DRAW_SEED),
    prepare=static_unused, apply=static_unused,
    run=run_regmean,
    objective="least-squares fit of the experts' layer outputs",
    iterate="solve",
    weights=regmean_weights,
    conventions=MATRICES_NOTE + " Gt is the mean of xxᵀ over the tokens of `samples` validation images per task "
                "(the authors' code and FusionBench normalise the same way); in_proj's q, k and v share their input, "
                "so the fused solve equals FusionBench's three. α = 0.9 by default (FusionBench's CLIP config: "
                "0.6). Everything else: the mean of the experts.",
    published=(Published("ViT-B-32", 82.4, FUSIONBENCH),),
))
