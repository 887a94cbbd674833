"""Analysis tab (the papers' diagnostics) and the expert lab."""
from __future__ import annotations

import math

import gradio as gr

from merger import methods, plots
from merger.analysis import diagnostics as analysis
from merger.analysis.coefficients import effective_weights
from merger.errors import MergerError
from merger.landscape import trajectories
from merger.ui.controls import ticked
from merger.ui.errors import keeps_outputs
from merger.ui.lab_tab import build_lab_tab
from merger.ui.scheduling import BATCH_EVENT, as_batch

KS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)


class AnalysisController:
    def __init__(self, ctl):
        self.ctl = ctl
        self.ex = ctl.session
        self.pool = ctl.pool

    # Each Compute is marked keeps_outputs: a refused one (a MergerError) is a warning, and the
    # plots shown stay in view.

    def _tv(self, experts):
        """The ticked experts' task vectors (all of them for None: a call that names none)."""
        chosen = self.pool.tasks if experts is None else ticked(experts)
        return self.pool.task_vectors.subset([e for e in self.pool.experts if e in chosen])

    @keeps_outputs(5)
    def weights(self, experts, method, *values):
        """Norms, cosines, sign conflicts, mass kept at the current sparsity."""
        tv = self._tv(experts)
        # the method's own sparsity as its merge reads it (checked, on the slider's step), else 0.8
        # (a hidden control keeps a value no merge on screen uses)
        own = "sparsity" in methods.get(method).param_names
        sparsity = self.ctl.spec_from_controls(experts, method, *values).kwargs["sparsity"] if own else 0.8
        n = analysis.task_vector_norms(tv)
        norms = plots.bars({"‖τt‖ / ‖θ0‖": n["relative"]}, tv.tasks, "Task-vector norms (relative to the base)",
                           "‖τt‖ / ‖θ0‖")
        layers = plots.heatmap([n["layers"][name] for name in n["layers"]], tv.tasks, list(n["layers"]),
                               "‖τt,l‖ per layer", fmt=".2g")
        cos = plots.heatmap(n["cosine"], tv.tasks, tv.tasks, "Cosine similarity of task vectors", zmid=0)
        sc = plots.heatmap(analysis.sign_conflicts(tv), tv.tasks, tv.tasks, "Sign-conflict rate (both non-zero)")
        shown = methods.get(method).display_name.split(" (")[0]  # "CART", not "CART (centred low-rank)": one line
        setting = f"sparsity {sparsity:g}" if own else f"default sparsity {sparsity:g} ({shown} has none)"
        kept = plots.bars({f"sparsity {sparsity:g}": analysis.mass_kept(tv, float(sparsity))}, tv.tasks,
                          f"‖τt‖² kept by the top {1 - float(sparsity):.0%} by magnitude<br><sub>{setting}</sub><br><sub>a "
                          f"random drop (DARE) keeps about {1 - float(sparsity):.0%} of it</sub>", "share of ‖τt‖²")
        return norms, layers, cos, sc, kept

    @keeps_outputs(2)
    def lowrank(self, experts, layer):
        tv = self._tv(experts)
        keys = tv.matrices if layer in (None, "", "all matrices (summed)") else [layer]
        spec_key = keys[0]
        sp = analysis.spectra(tv, spec_key)
        curves = {}
        for i, t in enumerate(tv.tasks):
            curves[f"τ {t}"] = (list(range(1, len(sp["uncentred"][i]) + 1)), sp["uncentred"][i])
        for i, t in enumerate(tv.tasks):
            curves[f"θ−θavg {t}"] = (list(range(1, len(sp["centred"][i]) + 1)), sp["centred"][i])
        title = f"Spectra of {spec_key}" + ("<br><sub>the first matrix: a spectrum is one matrix's; R(k) and I(k) "
                                            "beside it are summed over all</sub>" if len(keys) > 1 else "")
        spectra = plots.lines(curves, "index", "singular value", title,
                              dashed=[f"θ−θavg {t}" for t in tv.tasks])
        rmax = min(min(tv.base[k].shape) for k in keys)
        ks = [k for k in KS if k <= rmax] + ([rmax] if rmax not in KS else [])
        c = analysis.reconstruction_and_interference(tv, ks, True, keys)
        u = analysis.reconstruction_and_interference(tv, ks, False, keys)
        ri = plots.lines({"R(k) centred": (ks, c["sum"]["R"]), "R(k) uncentred": (ks, u["sum"]["R"]),
                          "I(k) centred": (ks, c["sum"]["I"]), "I(k) uncentred": (ks, u["sum"]["I"])},
                         "k (kept rank)", "R(k): reconstruction error", "Reconstruction error R(k) and interference I(k)"
                         + ("" if len(keys) == 1 else " (summed over matrices)"), log_x=True,
                         dashed=["R(k) uncentred", "I(k) uncentred"], right=["I(k) centred", "I(k) uncentred"],
                         right_title="I(k): interference")
        return spectra, ri

    @keeps_outputs(2)
    def heterogeneity(self, experts, method, *values):
        spec = self._current(experts, method, values)
        tv = self._tv(spec.experts)
        v = spec.kwargs
        name = spec.method
        lam, how = effective_weights(self.ex, spec)
        mask = name if name in analysis.masking_methods() else None
        h = analysis.heterogeneity(tv, lam, mask, task_weights=dict(spec.task_weights), **v)
        series = {"ζt²": h["zeta2"]}
        if "delta" in h:
            setting = ", ".join(f"{k} {x:g}" for k, x in v.items() if k != "lam" and isinstance(x, (int, float)))
            series[f"δt(M): {name} mask{f' ({setting})' if setting else ''}, over the dropped entries"] = h["delta"]
            series["ζ̂t² = ζt² − δt(M)"] = h["zeta2_hat"]
        # the spec in the title: the Merge tab's settings may have moved on since
        fig = plots.bars(series, tv.tasks, f"Heterogeneity ζt² ∝ ‖τt − Σ λk τk‖² and its reduction by the mask<br>"
                                           f"<sub>{spec.label()}</sub>", "squared norm")
        text = f"Effective coefficients ({how}) λ = [{', '.join(f'{x:.3g}' for x in lam)}] · χ²(p‖λ) = {h['chi2']:.4g}"
        if h["warnings"]:
            text += "\n\n" + "\n\n".join(f"⚠️ **{w}**" for w in h["warnings"])
        return fig, text

    @keeps_outputs(4)
    def dynamics(self, task):
        land = self.ex.landscape
        try:
            traj = trajectories.finetune_trajectory(land, task)
        except MergerError as exc:
            raise MergerError(f"{exc}: epoch dynamics need per-epoch checkpoints (a trajectory)") from exc
        if len(traj.points) >= 3:
            d = analysis.epoch_dynamics(traj.points)
            epochs = [f"epoch {s}" for s in traj.steps[1:]]
            shares = plots.bars({"share of Σ‖update‖": d["shares"]}, epochs, f"{task}: update-norm share per epoch",
                                "share of Σ‖update‖")
            cos = plots.heatmap(d["cosine"], epochs, epochs, "Cosine between epoch updates", zmid=0)
            first = plots.lines({"cos(τ(k), τ(1))": (traj.steps[1:], d["cos_to_first"])}, "epoch k", "cosine",
                                "cos(τ(k), τ(1))")
        else:  # a one-epoch expert: nothing to compare across epochs, the gradient check still holds
            shares = cos = first = plots.empty(f"{task} has one epoch: the per-epoch views need two or more.")
        with self.ex.lock:  # functional_call on the resident model (see _features)
            grad = analysis.gradient_at_base(self.ex.evaluator, self.pool.task_of(task))
        tau1 = traj.points[1] - traj.points[0]
        g = land.space.flatten(grad)
        text = f"cos(τ(1), −∇L(θ0)) = **{analysis.gradient_alignment(tau1, g):.4f}** (1 exactly for one epoch of full-batch gradient descent)"
        return shares, cos, first, text

    def _current(self, experts, method, values):
        """The Merge tab's spec, whose merge a view computes: a data-driven one only where its run is
        cached (the one on screen), never run here unseen, without progress or Cancel."""
        spec = self.ctl.spec_from_controls(experts, method, *values)
        self.ctl.run_on_screen(spec)
        return spec

    def _features(self, weights: dict, x):
        """Per-block features at ``weights``, holding the resident model: functional_call swaps its
        parameters for the call, which a forward beside it (a move, another job) would run on, and
        a load beside it would write into the tensors swapped in (the pool's own base among them)."""
        with self.ex.lock:
            return analysis.block_features(self.ex.evaluator.model.visual, weights, x)

    @keeps_outputs(1)
    def linearity(self, experts, method, *values):
        spec = self._current(experts, method, values)
        tv = self.pool.task_vectors
        idx = [tv.tasks.index(t) for t in spec.experts]
        delta = self.ex.delta(spec)
        merged = {k: tv.base[k] + delta[k] for k in tv.keys}
        w, _ = effective_weights(self.ex, spec)
        x = analysis.probe_images(self.ex.evaluator)
        lin = analysis.cross_task_linearity(self._features, merged, [tv.expert(i) for i in idx], w, x, base=tv.base)
        blocks = [f"block {i}" for i in range(len(lin["mean"]))]
        pred = "1 − cos(merge, (1 − Σw) f(θ0) + Σ wt f(θt))"
        err = [[m - a for m, a in zip(lin["mean"], lin["q25"])], [b - m for m, b in zip(lin["mean"], lin["q75"])]]
        has_pairs = not all(math.isnan(v) for v in lin["pairwise"])  # two experts weighted at least
        pairs = {"baseline: 1 − cos(θi, θj), expert pairs": lin["pairwise"]} if has_pairs else {}
        fig = plots.bars({pred: lin["mean"], **pairs, "baseline: 1 − cos(merge, each endpoint)": lin["baseline"]},
                         blocks, f"Cross-task linearity of {spec.label()} (weights {', '.join(f'{v:.2g}' for v in w)}; "
                         f"{len(x)} validation images, the first of every task, all tokens)", "1 − cos (0: linear)",
                         errors={pred: err})
        return fig

    @keeps_outputs(1)
    def interpolation(self, endpoints, experts, method, *values):
        """Loss, accuracy and linearity along base → merge, or between the first two ticked experts."""
        spec = self.ctl.spec_from_controls(experts, method, *values)
        land = self.ex.landscape
        if endpoints == "base → current merge":
            self.ctl.run_on_screen(spec)  # the merge's run on screen (two experts' path needs none)
            a, b, title = land.base_point(), land.spec_point(spec), f"base → {spec.label()}"
        else:
            if len(spec.experts) < 2:
                raise MergerError("tick at least two experts for an expert-to-expert path")
            a, b = land.expert_point(spec.experts[0]), land.expert_point(spec.experts[1])
            title = f"{spec.experts[0]} → {spec.experts[1]}"
        ev = self.ex.evaluator
        p = analysis.interpolation_path(ev, land.space, a, b, self._features, analysis.probe_images(ev), lock=self.ex.lock)
        return plots.stacked_lines({"accuracy % (avg)": {"accuracy": (p["alpha"], [100 * a for a in p["accuracy"]])},
                                    "loss (avg)": {"loss": (p["alpha"], p["loss"])},
                                    "1 − cos (mean over blocks)": {"1 − cos": (p["alpha"], p["linearity"])}},
                                   "α", f"Interpolation {title}<br><sub>accuracy and loss: the live split of every task; "
                                        "1 − cos: the first validation images of every task</sub>")

    @keeps_outputs(1)
    def ensemble(self, experts, method, *values):
        """The merged model's accuracy next to the logit ensemble of its experts with the same weights."""
        spec = self._current(experts, method, values)
        w, how = effective_weights(self.ex, spec)
        tv = self.pool.task_vectors
        experts_w = [tv.expert(tv.tasks.index(t)) for t in spec.experts]
        ens = analysis.logit_ensemble_accuracy(self.ex.evaluator, experts_w, w, "test", lock=self.ex.lock,
                                               base=tv.base)
        merged = self.ex.preview(spec, "test")
        # per task: results are keyed by task, and a lab expert shares its task with the pool's expert
        tasks = list(dict.fromkeys(self.pool.task_of(e) for e in spec.experts))
        return plots.bars({"merged": [100 * merged.accuracy[t] for t in tasks],
                           f"logit ensemble (1 − Σw) f(θ0) + Σ wt f(θt), w {how}": [100 * ens[t] for t in tasks]},
                          tasks, f"{spec.label()}: merged vs logit ensemble (test split)", "accuracy %")


def build_analysis_tabs(ctl, inputs, experts_box):
    """The Analysis tab and the Expert lab."""
    ac = AnalysisController(ctl)
    pool = ctl.pool
    with gr.Tab("Analysis", id="analysis"):
        gr.Markdown("Diagnostics from the papers for the current experts and Merge-tab settings.")
        with gr.Accordion("Weights: norms, cosines, sign conflicts, mass kept", open=True):
            w_btn = gr.Button("Compute")
            with gr.Row():
                w_norms, w_layers = gr.Plot(), gr.Plot()
            with gr.Row():
                w_cos, w_sc, w_kept = gr.Plot(), gr.Plot(), gr.Plot()
            w_btn.click(ac.weights, inputs, [w_norms, w_layers, w_cos, w_sc, w_kept], api_visibility="private")
        with gr.Accordion("Low rank (CART): spectra, R(k) and I(k)", open=False):
            layer = gr.Dropdown(["all matrices (summed)"] + pool.task_vectors.matrices, value="all matrices (summed)",
                                label="matrix")
            lr_btn = gr.Button("Compute")
            with gr.Row():
                lr_spec, lr_ri = gr.Plot(), gr.Plot()
            lr_btn.click(ac.lowrank, [experts_box, layer], [lr_spec, lr_ri], api_visibility="private")
        with gr.Accordion("Heterogeneity (Li et al., arXiv 2601.21690): ζ², δ(M), χ²", open=False):
            h_btn = gr.Button("Compute")
            h_plot, h_text = gr.Plot(), gr.Markdown()
            h_btn.click(ac.heterogeneity, inputs, [h_plot, h_text], api_visibility="private")
        with gr.Accordion("Epoch dynamics (Zhou et al., arXiv 2508.16082)", open=False):
            has = [t for t in pool.tasks if trajectories.has_trajectory(pool, t)]
            d_task = gr.Dropdown(has or pool.tasks, value=(has or pool.tasks)[0], label="expert")
            d_btn = gr.Button("Compute")
            with gr.Row():
                d_shares, d_cos, d_first = gr.Plot(), gr.Plot(), gr.Plot()
            d_text = gr.Markdown()
            d_btn.click(as_batch(ctl.session, ac.dynamics), d_task, [d_shares, d_cos, d_first, d_text], **BATCH_EVENT,
                        api_visibility="private")
        with gr.Accordion("Cross-task linearity (Zhou et al., arXiv 2402.03660)", open=False):
            l_btn = gr.Button("Compute for the current merge")
            l_plot = gr.Plot()
            l_btn.click(as_batch(ctl.session, ac.linearity), inputs, l_plot, **BATCH_EVENT, api_visibility="private")
            with gr.Row():
                i_ends = gr.Radio(["base → current merge", "first two ticked experts"], value="base → current merge",
                                  label="interpolation path")
                i_btn = gr.Button("Interpolate")
                e_btn = gr.Button("Merged vs logit ensemble")
            with gr.Row():
                i_plot, e_plot = gr.Plot(), gr.Plot()
            i_btn.click(as_batch(ctl.session, ac.interpolation), [i_ends, *inputs], i_plot, **BATCH_EVENT, api_visibility="private")
            e_btn.click(as_batch(ctl.session, ac.ensemble), inputs, e_plot, **BATCH_EVENT, api_visibility="private")
    build_lab_tab(ctl, experts_box, d_task)
    return ac
