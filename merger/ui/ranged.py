"""Sliders and number boxes whose out-of-range values are refused with the field's own name.

Gradio checks a Slider's or Number's bounds before any listener runs, with a message that names
no field ("Value 5 is greater than maximum value 3.0."): with a dozen weight boxes on screen a
person cannot tell which one. Here that check names the label and the range, and a slider's box
left empty (or holding text) is refused by name, where Gradio's own check failed on it unnamed. A
box of whole numbers (precision 0) passes 2.5 on as it is, where Gradio rounded it to 2 unseen: the
listener refuses it by name (a method's parameter check, the lab's, Trade-offs', a preset's) and,
refusing there, keeps its outputs (a refusal here put an error badge on each of them).

The check sits on the classes' ``preprocess``, not on each instance: when a listener updates a
component's props (a method switch shows, hides and relabels the controls), Gradio rebuilds the
component for that browser session from its class and constructor arguments, which drops any
attribute set on the instance. Subclassing is no way out either: Gradio writes a ``.pyi`` stub
beside the source of every component subclass, and the package must not write into itself."""
from __future__ import annotations

import math

import gradio as gr

from merger.errors import MethodError, shown_value
from merger.methods.registry import param_record
from merger.ui.errors import fail


def refusal(label: str, value, minimum, maximum, required: bool = False, open_ends=(False, False)) -> str | None:
    """Why a control's range refuses ``value``, naming its label and range, or None."""
    label = label or "value"
    lo = "-∞" if minimum is None else f"{minimum:g}"
    hi = "∞" if maximum is None else f"{maximum:g}"
    span = f"{'(' if open_ends[0] else '['}{lo}, {hi}{')' if open_ends[1] else ']'}"
    if value is None:
        # a slider's box cleared, or text typed in it (the browser sends no number)
        return f"{label}: empty or not a number; type a number in {span}" if required else None
    try:
        number = float(value)
    except (TypeError, ValueError, OverflowError):  # through the API: a string, a 10**400
        return f"{label}: {shown_value(value)} is not a number"
    if not math.isfinite(number) and minimum is None and maximum is None:
        return f"{label}: {number:g} is not a finite number"
    # an open end itself (the rank ratio's 0) goes on to the listener, whose check refuses it and
    # keeps the outputs (a refusal here puts an error badge on each); the range reads as the method's
    below = minimum is not None and number < minimum
    above = maximum is not None and number > maximum
    if not math.isfinite(number) or below or above:
        return f"{label}: {number:g} is outside {span}"
    return None


def _check(label: str, value, minimum, maximum, required: bool = False, open_ends=(False, False)) -> None:
    message = refusal(label, value, minimum, maximum, required, open_ends)
    if message is not None:
        fail(message)


def _open_ends(component) -> tuple[bool, bool]:
    """Whether a method parameter's control (elem_id ctl-<name>) refuses its bounds themselves (the
    rank ratio's 0): its range then reads (0, 1], as the method's own check says."""
    elem_id = getattr(component, "elem_id", None) or ""
    if not elem_id.startswith("ctl-"):
        return False, False
    try:
        _, param = param_record(elem_id[len("ctl-"):])
    except MethodError:  # a control of another panel named alike
        return False, False
    return param.min_open, param.max_open


def _naming(preprocess):
    def named(self, payload):
        _check(self.label, payload, self.minimum, self.maximum, required=isinstance(self, gr.Slider),
               open_ends=_open_ends(self))
        if getattr(self, "precision", None) == 0 and payload is not None and float(payload) % 1:
            return float(payload)  # not rounded: the listener's own check names it, its outputs kept
        return preprocess(self, payload)

    named.names_its_field = True
    return named


def name_out_of_range_values() -> None:
    """Make every Slider's and Number's range check name its label (once; ``merger.ui`` does it)."""
    for cls in (gr.Slider, gr.Number):
        if not getattr(cls.preprocess, "names_its_field", False):
            cls.preprocess = _naming(cls.preprocess)
