"""Sliders and number boxes whose out-of-range values are refused with the field's own name.

Gradio checks a Slider's or Number's bounds before any listener runs, with a message that names
no field ("Value 5 is greater than maximum value 3.0."): with a dozen weight boxes on screen a
person cannot tell which one. ``named_range`` makes that check's message name the label and the
range. It wraps the instance's preprocess rather than subclassing: Gradio writes a ``.pyi`` stub
beside the source of every component subclass, and the package must not write into itself."""
from __future__ import annotations

import math

import gradio as gr


def _check(label: str, value, minimum, maximum) -> None:
    if value is None:
        return
    number = float(value)
    below = minimum is not None and number < minimum
    above = maximum is not None and number > maximum
    if not math.isfinite(number) or below or above:
        lo = "-∞" if minimum is None else f"{minimum:g}"
        hi = "∞" if maximum is None else f"{maximum:g}"
        raise gr.Error(f"{label or 'value'}: {number:g} is outside [{lo}, {hi}]")


def named_range(component):
    """The component, its out-of-range values refused with its label (Slider or Number)."""
    original = component.preprocess

    def preprocess(payload):
        _check(component.label, payload, component.minimum, component.maximum)
        return original(payload)

    component.preprocess = preprocess
    return component


def RangedSlider(*args, **kwargs) -> gr.Slider:  # noqa: N802  (reads like the component it makes)
    return named_range(gr.Slider(*args, **kwargs))


def RangedNumber(*args, **kwargs) -> gr.Number:  # noqa: N802
    return named_range(gr.Number(*args, **kwargs))
