"""The Merge tab's coefficients panel: a weight slider per expert and per block group of the
image tower, presets, and Start from learned. Every slider is a Merge-tab input: a move of one
is a move like λ's (one apply, one forward)."""
from __future__ import annotations

import gradio as gr

from merger.errors import MergerError
from merger.spec import WEIGHT_RANGE, WEIGHT_STEP
from merger.ui.errors import warn

PRESETS = ("flat", "deeper blocks more", "shallower blocks more", "last k only")


def preset_values(name: str, blocks: list[str], k: int = 1) -> list[float]:
    """Block weights of a preset: flat (all 1), a linear ramp 0.5 → 1.5 with depth (or 1.5 → 0.5),
    or 1 on the last k groups and 0 before them."""
    n = len(blocks)
    ramp = [round(0.5 + i / (n - 1), 2) if n > 1 else 1.0 for i in range(n)]
    if name == "flat":
        return [1.0] * n
    if name == "deeper blocks more":
        return ramp
    if name == "shallower blocks more":
        return ramp[::-1]
    if name == "last k only":
        if k is None:  # the box left empty
            raise MergerError(f"last k only: k is empty; type a whole number between 1 and {n} (the block groups)")
        try:
            whole = float(k) % 1 == 0
        except (TypeError, ValueError):
            whole = False
        if not whole:
            raise MergerError(f"last k only: k must be a whole number, got {k!r}")
        k = int(k)
        if not 1 <= k <= n:
            raise MergerError(f"last k only: k must be between 1 and {n} (the block groups), got {k}")
        return [0.0] * (n - k) + [1.0] * k
    raise MergerError(f"preset: unknown '{name}'; one of {', '.join(PRESETS)}")


class CoefficientsPanel:
    def __init__(self, ctl):
        self.ctl = ctl

    def preset(self, name, k):
        """The preset's block weights; a bad k is a warning and every slider keeps its value (an
        error would mark each slider as failed)."""
        try:
            values = preset_values(name, self.ctl.weight_blocks, k)
        except MergerError as exc:
            warn(exc)
            return tuple(gr.skip() for _ in self.ctl.weight_blocks)
        return tuple(gr.update(value=v) for v in values)

    @staticmethod
    def k_shown(name):
        """k only matters to "last k only"."""
        return gr.update(visible=name == "last k only")

    def reset_tasks(self):
        return tuple(gr.update(value=1.0) for _ in self.ctl.weight_experts)

    def shown_for(self, experts):
        """A task's slider shows while its expert is ticked."""
        ticked = set(experts or [])
        return tuple(gr.update(visible=e in ticked) for e in self.ctl.weight_experts)


def build_coefficients_panel(ctl) -> dict:
    lo, hi = WEIGHT_RANGE
    with gr.Accordion("Coefficients: per-task and per-block weights", open=False, elem_id="coefficients"):
        gr.Markdown("Each expert's task vector is multiplied by its weight wₜ before the method combines them "
                    "(TIES/DARE: the trimmed vector, as mergekit); each block weight b_g multiplies the merge's Δ "
                    "in that block of the image tower. 1 everywhere is the plain method. Data-driven methods "
                    "learn their own coefficients: these sliders apply to static methods; **Start from learned** "
                    "loads what a run learned into them.")
        labels = ctl.weight_labels()  # the experts' sliders, then the blocks'
        tasks = [gr.Slider(lo, hi, value=1.0, step=WEIGHT_STEP, label=labels[i], elem_id=f"w-task-{i}")
                 for i in range(len(ctl.weight_experts))]
        with gr.Row():
            reset = gr.Button("Reset task weights", size="sm")
            learned = gr.Button("Start from learned", size="sm", elem_id="start-learned")
        blocks = [gr.Slider(lo, hi, value=1.0, step=WEIGHT_STEP, label=label, elem_id=f"w-block-{b}")
                  for b, label in zip(ctl.weight_blocks, labels[len(ctl.weight_experts):])]
        with gr.Row():
            preset = gr.Dropdown(list(PRESETS), value="flat", label="preset to apply to the block sliders",
                                 info="a chooser, not the sliders' state: Apply sets them")
            # no bounds on the box: a k out of range gets preset_values' message as a warning
            k = gr.Number(value=1, precision=0, visible=False,
                          label="k (last k only)")
            apply = gr.Button("Apply preset", size="sm")
    return {"tasks": tasks, "blocks": blocks, "reset": reset, "learned": learned, "preset": preset, "k": k,
            "apply": apply}


def wire_coefficients_panel(panel: dict, ctl, events, experts, inputs, outputs_all) -> None:
    """Listeners of the panel; ``outputs_all``: every Merge-tab input (what Start from learned sets)."""
    cp = CoefficientsPanel(ctl)
    # no progress overlay: a k the box refuses (2.5) is then a toast, not an error badge on every slider
    panel["apply"].click(cp.preset, [panel["preset"], panel["k"]], panel["blocks"], api_visibility="private",
                         show_progress="hidden")
    panel["preset"].change(cp.k_shown, panel["preset"], panel["k"], queue=False, api_visibility="private")
    panel["reset"].click(cp.reset_tasks, None, panel["tasks"], api_visibility="private")
    experts.change(cp.shown_for, experts, panel["tasks"], queue=False, api_visibility="private")
    panel["learned"].click(events.start_from_learned, inputs, outputs_all, api_visibility="private")
