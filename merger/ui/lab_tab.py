"""The Expert lab tab (demo world): fine-tune experts with chosen settings, presets, Cancel, and
the scaling view of Li et al. (arXiv 2601.21690)."""
from __future__ import annotations

import traceback

import gradio as gr

from merger import plots
from merger.analysis.lab import (GRADIENT_DESCENT, OPTIMIZERS, SCHEDULES, SETTING_LABELS, TRENDS, VARIABLE_LABELS,
                                 add_expert, check_name, check_settings, describe_settings, finetune, scaling_view,
                                 unused_name)
from merger.errors import Cancelled, MergerError
from merger.landscape.trajectories import has_trajectory
from merger.ui.errors import notice
from merger.ui.merge_events import session_of
from merger.ui.scheduling import BATCH_EVENT, CancelFlags, as_batch


class LabController:
    """Lab runs per browser session, each with its own Cancel flag."""

    def __init__(self, ctl):
        self.ctl = ctl
        self.pool = ctl.pool
        self._cancel = CancelFlags()

    def _guarded(self, request, work, cancelled: str):
        """work(cancel flag) with this session's Cancel flag set up: (result, None), or (None, the
        status line saying why it stopped: ``cancelled``, or bad input as a notice, the outputs
        shown staying as they were). The flag is gone afterwards."""
        with self._cancel.job(session_of(request)) as flag:
            try:
                return work(flag), None
            except Cancelled:
                return None, cancelled
            except (MergerError, ValueError) as exc:
                if not isinstance(exc, MergerError):  # maybe no fault of the input: the log keeps where it arose
                    traceback.print_exc()
                return None, notice(exc)

    def cancel(self, request: gr.Request = None) -> str:
        if not self._cancel.cancel(session_of(request)):  # the status line keeps the finished run's summary
            gr.Info("No lab run in progress: nothing to cancel.")
            return gr.skip()
        return "Cancelling… (the run stops at its next step; the expert in training is not added)"

    def choices(self, request):
        """(experts to merge, epoch-dynamics experts) updates for this session."""
        names = self.ctl.offered.to(session_of(request))
        traced = [e for e in names if has_trajectory(self.pool, e)]
        return gr.update(choices=names), gr.update(choices=traced or names)

    def opt_in(self, request: gr.Request, everyone):
        """Include (or not) the lab experts other sessions made."""
        self.ctl.offered.opt_in(session_of(request), bool(everyone))
        return self.choices(request)

    def free_name(self, task, request) -> str:
        """A name left blank: TASK-lab-<this session>, numbered past the ones taken (names are
        shared by every session, so one default for all would refuse everyone's second run)."""
        return unused_name(self.pool, f"{task}-lab-{session_of(request)[:6]}")

    def _train(self, task, name, settings, progress, flag, request):
        sd, traj, hp = finetune(self.ctl.session, task, settings, progress=lambda f, m: progress(f, desc=m),
                                cancel=flag.is_set)
        add_expert(self.ctl.session, name, task, sd, hp, traj, owner=session_of(request))
        return hp

    # Gradio injects the request and the progress tracker only among positional parameters,
    # so the settings are spelled out (in SETTING_KEYS order) instead of *values.
    def run(self, request: gr.Request, task, name, lr, epochs, batch_size, data_fraction, seed, optimizer, momentum,
            weight_decay, schedule, progress=gr.Progress()):
        name = str(name or "").strip() or self.free_name(task, request)
        settings = (lr, epochs, batch_size, data_fraction, seed, optimizer, momentum, weight_decay, schedule)
        def train(flag):
            check_name(self.pool, name)  # before the fine-tune, not after its minutes
            return self._train(task, name, check_settings(*settings), progress, flag, request)

        hp, stopped = self._guarded(request, train, "Cancelled: no expert was added.")
        if stopped:
            return stopped, gr.skip(), gr.skip()
        return (f"Added expert **{name}** ({describe_settings(hp)}); it is yours: other sessions see it only if "
                "they opt in.",
                *self.choices(request))

    def one_epoch_set(self, request: gr.Request, lr, epochs, batch_size, data_fraction, seed, optimizer, momentum,
                      weight_decay, schedule, progress=gr.Progress()):
        """One-epoch experts for every original task (the settings above, epochs = 1)."""
        added = []

        def work(flag):
            settings = check_settings(lr, 1, batch_size, data_fraction, seed, optimizer, momentum, weight_decay,
                                      schedule)
            for t in self.pool.tasks:
                name = f"{t}@1ep-{session_of(request)[:6]}"
                if name not in self.pool.expert_info:
                    self._train(t, name, settings, progress, flag, request)
                    added.append(name)

        _, stopped = self._guarded(request, work, "Cancelled before the rest.")
        if stopped and not added:
            return stopped, gr.skip(), gr.skip()
        note = f"Added one-epoch experts: {', '.join(added) or 'none (each exists already)'}."
        return note + (f" {stopped}" if stopped else ""), *self.choices(request)

    @staticmethod
    def gradient_descent_preset():
        """Controls set to one step of full-batch gradient descent (cos(τ(1), −∇L(θ0)) = 1)."""
        g = GRADIENT_DESCENT
        return (g["lr"], g["epochs"], g["batch_size"], 1.0, g["optimizer"], g["momentum"], g["weight_decay"],
                g["schedule"], "Preset set: SGD, momentum 0, weight decay 0, constant schedule, one epoch, full batch "
                "(batch size 0). Press **Fine-tune and add**, then Analysis → Epoch dynamics.")

    def scaling(self, request: gr.Request, param, values, lr, epochs, batch_size, data_fraction, seed, optimizer,
                momentum, weight_decay, schedule, progress=gr.Progress()):
        settings = (lr, epochs, batch_size, data_fraction, seed, optimizer, momentum, weight_decay, schedule)

        def work(flag):
            try:
                vals = [float(v) for v in str(values).split(",") if v.strip()]
            except ValueError as exc:
                raise MergerError(f"lab: scaling values {str(values)[:60]!r}: not comma-separated numbers ({exc})") from None
            return scaling_view(self.ctl.session, param, vals, check_settings(*settings), self.pool.tasks,
                                progress=lambda f, m: progress(f, desc=m), cancel=flag.is_set, owner=session_of(request))

        r, stopped = self._guarded(request, work, "Cancelled.")
        if stopped:
            return gr.skip(), gr.skip(), gr.skip(), gr.skip(), stopped
        log_x, label = param == "lr", VARIABLE_LABELS[param]
        acc = plots.lines({f"merged accuracy ({r['merge']})": (r["values"], [100 * a for a in r["accuracy"]])},
                          label, "accuracy %", f"Merged accuracy against {label}", log_x=log_x)
        loss = plots.lines({"merged loss": (r["values"], r["loss"]), r["trend"]["label"]: (r["trend"]["x"], r["trend"]["y"])},
                           label, "loss", f"Merged loss against {label} (dotted: a trend, not a prediction)",
                           log_x=log_x, dashed=[r["trend"]["label"]])
        used = check_settings(*settings)  # the hidden settings a preset left behind, said (SGD, the full batch)
        return acc, loss, *self.choices(request), (f"Merged with {r['merge']}. Each expert fine-tuned with "
                                                   f"{describe_settings({k: v for k, v in used.items() if k != param})}"
                                                   f", {VARIABLE_LABELS[param]} as plotted.")


def build_lab_tab(ctl, experts_box, dynamics_task) -> LabController:
    lc = LabController(ctl)
    pool = ctl.pool
    with gr.Tab("Expert lab", id="lab"):
        gr.Markdown("Fine-tune new experts from the demo base (image tower, frozen head), add them to the pool, "
                    "merge and compare as usual.")
        with gr.Row():
            task = gr.Dropdown(pool.tasks, value=pool.tasks[0], label="task")
            name = gr.Textbox(label="name of the new expert", value="",
                              placeholder="blank: TASK-lab-… (numbered for you)")
        with gr.Row():
            label = SETTING_LABELS
            lr = gr.Number(value=1e-3, label=label["lr"])
            epochs = gr.Number(value=1, precision=0, label=label["epochs"])
            bs = gr.Number(value=128, precision=0, label=f"{label['batch_size']} (0: full batch)")
            frac = gr.Number(value=1.0, label=label["data_fraction"])
            seed = gr.Number(value=0, precision=0, label=label["seed"])
        with gr.Row():
            opt = gr.Dropdown(list(OPTIMIZERS), value="adamw", label=label["optimizer"])
            momentum = gr.Number(value=0.9, label=f"{label['momentum']} (SGD)")
            wd = gr.Number(value=0.1, label=label["weight_decay"])
            schedule = gr.Dropdown(list(SCHEDULES), value="cosine", label=label["schedule"],
                                   info="cosine: short linear warm-up, then cosine decay")
        settings = [lr, epochs, bs, frac, seed, opt, momentum, wd, schedule]
        with gr.Row():
            run_btn = gr.Button("Fine-tune and add", variant="primary")
            one_btn = gr.Button("Preset: one-epoch experts for every task")
            gd_btn = gr.Button("Preset: gradient descent, one epoch, full batch")
            cancel_btn = gr.Button("Cancel", elem_id="lab-cancel")
        status = gr.Markdown()
        everyone = gr.Checkbox(False, label="also offer the lab experts other sessions made",
                               info="lab experts belong to the session that made them; the pool's tasks never change")
        gr.Markdown("### Scaling view (Li et al., arXiv 2601.21690)\nExpert sets merged by weight averaging (Σλ = 1, as the theory "
                    "assumes); the paper's trend is fitted to the merged loss with its signs (every term ≥ 0). The "
                    "settings hold the epochs: a sweep of the data fraction or the batch size changes the steps too, "
                    "which the paper holds. `num_tasks` merges random subsets of the pool's experts.")
        with gr.Row():
            sc_param = gr.Dropdown([(VARIABLE_LABELS[k], k) for k in TRENDS], value="lr", label="variable")
            sc_values = gr.Textbox(value="0.0003, 0.001, 0.003", label="values (comma-separated)")
        sc_btn = gr.Button("Fine-tune expert sets and merge (slow: one expert per task and value)")
        with gr.Row():
            sc_acc, sc_loss = gr.Plot(), gr.Plot()

        everyone.change(lc.opt_in, everyone, [experts_box, dynamics_task], api_visibility="private")
        gd_btn.click(lc.gradient_descent_preset, None, [lr, epochs, bs, frac, opt, momentum, wd, schedule, status],
                     queue=False, api_visibility="private")
        run_btn.click(as_batch(ctl.session, lc.run), [task, name, *settings], [status, experts_box, dynamics_task], **BATCH_EVENT,
                      api_visibility="private")
        one_btn.click(as_batch(ctl.session, lc.one_epoch_set), settings, [status, experts_box, dynamics_task], **BATCH_EVENT,
                      api_visibility="private")
        sc_btn.click(as_batch(ctl.session, lc.scaling), [sc_param, sc_values, *settings], [sc_acc, sc_loss, experts_box, dynamics_task, status],
                     **BATCH_EVENT, api_visibility="private")
        # Queued (so the request carries the browser session), in its own queue: never behind a run.
        cancel_btn.click(lc.cancel, None, status, concurrency_id="cancel", concurrency_limit=None,
                         api_visibility="private")
    return lc
