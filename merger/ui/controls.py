"""The Merge tab's method controls, one per parameter of the registry, mapped by name.

Every control exists once (one slider per parameter name, shared by the methods that take it);
a method shows the ones it uses and hides the rest. Values travel in ``PARAM_NAMES`` order.
"""
from __future__ import annotations

import json
import math

import gradio as gr

from merger import methods
from merger.errors import MergerError, MethodError
from merger.io.export import pool_reference
from merger.spec import WEIGHT_RANGE, arguments_text
from merger.ui.ranged import refusal
from merger.methods import PARAM_NAMES
from merger.methods.registry import param_record


def ticked(experts) -> list[str]:
    """The experts ticked in a tab; none is refused (every tab that merges or analyses needs one)."""
    experts = list(experts or [])
    if not experts:
        raise MergerError("experts: empty subset, tick at least one expert")
    return experts


def by_name(values) -> dict:
    """The controls' values keyed by parameter name."""
    return dict(zip(PARAM_NAMES, values))


def param_control(name: str, num_experts: int, method=None):
    """The control of one parameter: its range, step, label and help from the registry; its value
    the default of ``method`` (or of the first method that takes it); shown only if ``method``
    takes it."""
    owner, p = param_record(name)
    m = method if method is not None and name in method.param_names else owner
    p = m.param(name)
    value = (m.defaults_for(num_experts) if m.defaults_for else {}).get(name, p.default)
    if value == "auto":  # the slider's auto position: the top of its range for this many experts
        value = slider_top(m, name, num_experts)
    visible = method is None or name in method.param_names
    label = p.label or name
    if p.kind == "int":
        return gr.Number(value=value, label=label, precision=0, minimum=p.min, maximum=p.max,
                         elem_id=f"ctl-{name}", info=p.help, visible=visible)
    return gr.Slider(minimum=p.min, maximum=p.max, step=p.step, value=value, label=label,
                     elem_id=f"ctl-{name}", info=p.help, visible=visible)


def slider_top(method, name: str, num_experts: int) -> float:
    """The top of a control's range as the page shows it: the T-dependent cap (TSV-M's 1/T) to four
    decimals, rounded down (in range), so that the box reads 0.1428 and not 0.14285714285714285;
    a spec reads it as the auto position (``_at_auto``)."""
    return _four_places(method.bounds(name, num_experts)[1])


def control_range(method, name: str, num_experts: int) -> tuple[float, float]:
    """(minimum, maximum) of a parameter's control for this many experts, as the page shows it."""
    return method.bounds(name, num_experts)[0], slider_top(method, name, num_experts)


def _four_places(x: float) -> float:
    return math.floor(x * 1e4 + 1e-6) / 1e4


def _at_auto(method, name: str, value, num_experts: int) -> bool:
    """A slider sits at a parameter's auto position: the top of its T-dependent range (TSV-M:
    1/T, shown as ``slider_top``), or a value the app set for another T (1/n to four places, off
    the slider's grid: no drag lands there)."""
    try:
        v = float(value)
    except (TypeError, ValueError):
        return False
    hi = method.bounds(name, num_experts)[1]
    if abs(v - hi) < 1e-9 or abs(v - _four_places(hi)) < 1e-9:
        return True
    step = method.param(name).step
    if v <= 0 or abs(v / step - round(v / step)) <= 1e-6:
        return False
    n = round(1 / v)
    return n >= 1 and (abs(1 / v - n) < 1e-6 or abs(v - _four_places(1 / n)) < 1e-9)


def _fits(param, value, hi: float = math.inf) -> bool:
    """A control's value is a valid value of this parameter (its own check), under a cap that
    depends on T (so a method change may keep it)."""
    try:
        v = param.check(value, "")
    except MethodError:
        return False
    return isinstance(v, str) or v <= hi + 1e-12


def default_params(method, num_experts: int) -> dict:
    auto = method.defaults_for(num_experts) if method.defaults_for else {}
    return {p.name: auto.get(p.name, p.default) for p in method.params}


def control_values(method, params: dict, num_experts: int) -> list:
    """One value per control (PARAM_NAMES order; None where the method has no such parameter):
    "auto" becomes its slider position for this many experts; one ``params`` lacks (a History row
    written before the method took it) its default."""
    defaults = default_params(method, max(1, num_experts))
    out = []
    for name in PARAM_NAMES:
        value = params.get(name, defaults.get(name)) if name in method.param_names else None
        if value == "auto":
            value = slider_top(method, name, max(1, num_experts))
        out.append(value)
    return out


def shown(method, name: str, **changes):
    """A control update for ``method``: shown with the changes if it takes the parameter, else hidden."""
    if name in method.param_names:
        return gr.update(visible=True, **changes)
    return gr.update(visible=False)


class ControlPanel:
    """Controls → specs, and the control updates a method change or an expert change needs."""

    def __init__(self, session, history=None):
        self.session = session
        self.pool = session.pool
        self.history = history  # History (SQLite) of evaluated specs, or None
        self.pool_ref = pool_reference(self.pool)
        # The coefficient sliders after the parameter controls: one per expert the pool had when
        # the app was built (a lab expert added later merges with weight 1), one per block group.
        self.weight_experts: list[str] = list(self.pool.experts)
        self.weight_blocks: list[str] = list(self.pool.blocks)

    def weights_from_controls(self, experts, values) -> tuple[dict, dict]:
        """(task weights of the ticked experts, block weights) from the values after the parameter
        controls (absent: every weight 1)."""
        rest = list(values[len(PARAM_NAMES):])
        tw = dict(zip(self.weight_experts, rest[:len(self.weight_experts)]))
        bw = dict(zip(self.weight_blocks, rest[len(self.weight_experts):]))
        ticked = set(experts or [])
        return ({e: w for e, w in tw.items() if e in ticked and w is not None},
                {b: w for b, w in bw.items() if w is not None})

    def spec_from_controls(self, experts, method, *values):
        """The spec the controls describe (values in PARAM_NAMES order, then the coefficient
        sliders), on its sliders' steps (``SnappedSpec``: what a move computes; ``snapping()`` says
        what a typed value became); only the parameters the method uses are read, and the weights of
        the ticked experts. A parameter with an "auto" rule reads "auto" where the slider sits at its
        auto position (see ``_at_auto``), so snapping to the slider step cannot change it."""
        m = methods.get(method)
        tw, bw = self.weights_from_controls(experts, values)
        values = by_name(values)
        experts = ticked(experts)
        params = {k: values.get(k) for k in m.param_names}
        for k, v in params.items():
            if v is None:  # an emptied box: never its default (or an earlier value) unseen
                p = m.param(k)
                raise MethodError(f"{p.label or k}: empty; type a {'whole ' if p.kind == 'int' else ''}number in "
                                  f"{p.range_text(m.bounds(k, len(experts)))}", param=k)
            if m.param(k).auto and _at_auto(m, k, v, len(experts)):
                params[k] = "auto"
        if m.data_driven:  # it learns its own coefficients: the sliders are for static methods (panel says so)
            tw, bw = {}, {}
        try:
            return self.session.spec(m.name, experts=list(experts), task_weights=tw or None,
                                     block_weights=bw or None, **params).snap()
        except MethodError as exc:  # a value refused: named by its control's label, as the page shows it
            if exc.param is None or exc.reason is None:
                raise
            raise MethodError(f"{m.param(exc.param).label or exc.param}: {exc.reason}", param=exc.param,
                              reason=exc.reason) from None

    def weight_labels(self) -> list[str]:
        """The weight sliders' labels, in the order of the values after the parameter controls."""
        return [f"w · {e}" for e in self.weight_experts] + [f"b · {b}" for b in self.weight_blocks]

    @staticmethod
    def as_entered(method, values) -> list:
        """``values`` as a listener gets them from Gradio's checks, for one that takes the browser's
        own: a whole-number parameter's 5.0 as 5 (what a box of precision 0 hands on)."""
        try:
            m = methods.get(method)
        except MethodError:
            return list(values)
        out = list(values)
        for i, name in enumerate(PARAM_NAMES[:len(out)]):
            v = out[i]
            if name in m.param_names and m.param(name).kind == "int" and isinstance(v, float) and v.is_integer():
                out[i] = int(v)
        return out

    def out_of_range(self, experts, method, values) -> tuple[int, str, float] | None:
        """(position among ``values``, the refusal naming the control, the value the browser puts
        in the box when it loses focus) of the first shown control whose range refuses its value,
        ranges as the page shows them; None when every value is in range (or the method is unknown:
        the spec's own check says so)."""
        try:
            m = methods.get(method)
        except MethodError:
            return None
        n = max(1, len(experts or []))
        ranges = []
        for name in PARAM_NAMES:
            if name in m.param_names:
                p = m.param(name)
                ranges.append((p.label or name, *control_range(m, name, n), p.kind != "int", (p.min_open, p.max_open)))
            else:
                ranges.append(None)
        ranges += [(label, *WEIGHT_RANGE, True, (False, False)) for label in self.weight_labels()]
        for i, (value, limits) in enumerate(zip(values, ranges)):
            if limits is None:
                continue
            label, lo, hi, required, open_ends = limits
            message = refusal(label, value, lo, hi, required, open_ends)
            if message is not None:
                try:
                    number = float(value) if value is not None else 0.0  # an emptied box reads 0
                except (TypeError, ValueError, OverflowError):
                    number = 0.0
                return i, message, min(max(number, lo), hi) if math.isfinite(number) else lo
        return None

    def values_of(self, spec, method, num_experts: int) -> list:
        """The controls' values (PARAM_NAMES order, then the weight sliders) that show ``spec``, or
        the method's defaults where ``spec`` is None or of another method."""
        m = methods.get(method)
        shows = spec is not None and spec.method == m.name
        params = spec.kwargs if shows else default_params(m, max(1, num_experts))
        tw = dict(spec.task_weights) if shows else {}
        bw = dict(spec.block_weights) if shows else {}
        return (control_values(m, params, num_experts) + [tw.get(e, 1.0) for e in self.weight_experts]
                + [bw.get(b, 1.0) for b in self.weight_blocks])

    def method_controls(self, method, experts, *values, previous: str | None = None):
        """Control updates for a method: its parameters shown with their ranges, the others hidden.
        A value the person set in the ``previous`` method (a parameter both share, moved from that
        method's default) is kept where it fits; every other parameter starts at the new method's
        default. Without ``previous`` (a reload), every value that fits is kept."""
        m = methods.get(method)
        n = max(1, len(experts or self.pool.tasks))
        current = by_name(values)
        set_by_person = set(m.param_names)
        if previous:
            before = methods.get(previous)
            old = by_name(control_values(before, default_params(before, n), n))
            set_by_person = {k for k in before.param_names if _fits(before.param(k), current.get(k))
                             and abs(float(current[k]) - float(old[k])) > 1e-9}
        defaults = control_values(m, default_params(m, n), n)
        updates = []
        for name, default in zip(PARAM_NAMES, defaults):
            if name not in m.param_names:
                updates.append(shown(m, name))
                continue
            p = m.param(name)
            lo, hi = control_range(m, name, n)
            value = current.get(name)
            if name not in set_by_person or not _fits(p, value, hi):
                value = default
            updates.append(shown(m, name, value=value, minimum=lo, maximum=hi, step=p.step, info=p.help,
                                 label=p.label or name))
        about = f"**{m.display_name}**: {m.description}  \n*{m.paper}*"
        if m.conventions:
            about += f"  \nConventions: {m.conventions}"
        if not m.params:
            about += "  \nThis method has no parameters: the merge is fixed by the experts."
        return (*updates, about + self.best_known(m, experts))

    def best_known(self, m, experts) -> str:
        """This pool's own best setting of a method for these experts on the validation split, as the
        history holds it (Auto-tune, sweeps), or "": a paper's value (TA's λ ≈ 0.3 for 8 ViT tasks) is
        no one pool's."""
        if self.history is None or not m.params:
            return ""
        found = self.history.best(self.pool_ref, m.name, ticked(experts or self.pool.tasks),
                                  self.session.evaluator.forward_precision)
        if found is None:
            return "  \nThis pool's best setting is not known yet: **Auto-tune** (Compare tab) finds it on val."
        row, n = found
        params = arguments_text(json.loads(row["params"]).items())
        return (f"  \nBest on this pool's val split so far: `{params}`, {100 * row['average_accuracy']:.1f} % "
                f"(of {n} val evaluation{'s' if n != 1 else ''} in the History tab).")

    def refresh_limits(self, experts, method, *values):
        """The expert subset changed: ranges that depend on T follow it (TSV-M's rank ratio ≤ 1/T),
        and a slider at its auto position moves to the new one."""
        m = methods.get(method)
        n = max(1, len(experts or []))
        values = by_name(values)
        limits = m.limits_for(n) if m.limits_for else {}
        updates = []
        for name in PARAM_NAMES:
            if name not in limits or name not in m.param_names:
                updates.append(gr.skip())
                continue
            lo, hi = control_range(m, name, n)
            v = values.get(name)
            if v is None or v > hi or (m.param(name).auto and _at_auto(m, name, v, n)):
                v = hi
            updates.append(gr.update(minimum=lo, maximum=hi, value=v))
        return tuple(updates)

    @staticmethod
    def default_params(method, num_experts: int) -> dict:
        return default_params(method, num_experts)

    @staticmethod
    def control_values(method, params: dict, num_experts: int) -> list:
        return control_values(method, params, num_experts)
