"""The Merge tab's listeners as one browser session drives them.

One listener per control (``move``) answers a move with everything that depends on it: the
Merge plots and summary, the data-driven panel and the landscape's live marker, from one merge and
one forward. Each move takes a ticket of its session; one superseded by a newer move of the same
session is dropped before it starts, and shows nothing once superseded (the newer one answers). On
a slow pool a move first shows the linear estimate (a weighted sum of task vectors, once the
experts' forwards are made: no forward of its own) or else a partial answer (the first images of
each task), then the complete one unless a newer move arrived.

A History reload sets the experts, the method and every value at once; the browser then fires a
change event per component, each reading the others as they are at that moment, some not yet
updated. Those in-between specs are no one's request: they are neither computed nor recorded, and
the method change that follows does not reset the values the reload set. The session's pending
reload target is held here (one owner), until its own preview arrives or it expires.
"""
from __future__ import annotations

import threading
import time
from collections import OrderedDict

import gradio as gr

from merger import methods
from merger.errors import MergerError
from merger.evaluation.work_queue import Superseded
from merger.ui.errors import kept, notice, warn

EXPIRY_S = 10.0  # a reload whose target never shows up stops guarding the session after this
CLAMP_S = 2.0  # how long after a refusal the browser's clamp of that box is expected (see move_or_restore)
EVALUATED_PER_SESSION = 4096  # the merges a browser session remembers as its own (Trade-offs' Pareto)


def session_of(request) -> str:
    return getattr(request, "session_hash", None) or "default"


class MergeTabEvents:
    def __init__(self, ctl, initial_method: str, landscape=None, room=None):
        self.ctl = ctl
        self.landscape = landscape  # LandscapeController: the live marker follows each move
        self.room = room  # a workshop Room (app --presenter): the presenter's moves are shown to it
        self.initial_method = initial_method
        # session -> (spec, expiry, arrived, the step its move is: "loaded", "reload" or "shown"; see _reload_step)
        self._targets: dict[str, tuple[object, float, bool, bool]] = {}
        self._methods: dict[str, str] = {}  # the method each session shows (to tell its defaults)
        self._panel: dict[str, int | None] = {}  # the run each session's data-driven panel shows
        self._shown: dict[str, object] = {}  # session -> the spec its Merge tab's controls last set
        self._evaluated: dict[str, OrderedDict] = {}  # session -> the specs its moves and grids evaluated
        self._said: dict[str, str | None] = {}  # session -> the method whose result its summary shows (None: a message)
        self._clamped: dict[str, tuple[int, float, float]] = {}  # session -> (control, value, until): see restore
        self._lock = threading.Lock()

    def forget(self, who: str) -> None:
        """A browser session ended (its page closed): what was kept for it goes."""
        with self._lock:
            for per_session in (self._targets, self._methods, self._panel, self._shown, self._evaluated, self._said,
                                self._clamped):
                per_session.pop(who, None)

    def saw(self, who: str, specs) -> None:
        """Merges a browser session evaluated (its own, for the Trade-offs tab's Pareto front: in a
        workshop nobody sees another person's points)."""
        with self._lock:
            seen = self._evaluated.setdefault(who, OrderedDict())
            for spec in specs:  # snapped: the merges as computed
                seen[spec] = None
                seen.move_to_end(spec)
            while len(seen) > EVALUATED_PER_SESSION:
                seen.popitem(last=False)

    def evaluated(self, who: str) -> list:
        with self._lock:
            return list(self._evaluated.get(who, ()))

    def still_shown(self, who: str, spec) -> bool:
        """Whether the session's controls still describe ``spec`` (as of its last move; yes when it
        made none): a run that ends after they changed must not show its result as theirs."""
        with self._lock:
            return who not in self._shown or self._shown[who] == spec

    def not_on_screen(self, request, experts, method, values) -> str | None:
        """Why Pin or Export must not take the controls' values, or None: they hold a spec the page
        has not computed. A value a box refused is put back in range by the browser (λ 5 → 3; an
        emptied box → 0) when the box loses focus, to the Pin or Export button clicked: that click
        arrives before the move of the new value, and would save a merge nobody saw."""
        spec, who = self.spec_of(experts, method, values), session_of(request)
        if spec is None or self.still_shown(who, spec):
            return None  # on screen (or no move yet), or the controls' own message follows
        with self._lock:
            shown = self._shown.get(who)
        on_screen = f"the merge on screen is `{shown.label()}`" if shown is not None else "no merge is on screen"
        return (f"the controls hold `{spec.label()}`, but {on_screen}: a value a box refused was put back in "
                "range, or its move has not started yet. Set the value again (or wait for its result), then retry")

    def load(self, request: gr.Request, experts, method, *values):
        """The page's first answer (its load event): from then on, what Pin and Export may take."""
        with self._lock:
            self._shown[session_of(request)] = self.spec_of(experts, method, values)
        return self.ctl.preview(experts, method, *values)

    def pin(self, request: gr.Request, pins, experts, method, *values):
        why = self.not_on_screen(request, experts, method, values)
        if why is not None:
            warn(f"Pin: {why}")
            return pins, self.ctl.pins_text(pins)
        return self.ctl.pin(pins, experts, method, *values)

    def export(self, request: gr.Request, experts, method, *values):
        why = self.not_on_screen(request, experts, method, values)
        if why is not None:
            return None, notice(f"export refused: {why}")
        return self.ctl.export(experts, method, *values)

    def panel_shows(self, who: str, run) -> None:
        """The data-driven panel was redrawn outside a move (a run's end): for ``_learned``."""
        with self._lock:
            self._panel[who] = id(run) if run is not None else None

    def _target(self, request):
        with self._lock:
            entry = self._targets.get(session_of(request))
            if entry is not None and entry[1] < time.monotonic():
                self._targets.pop(session_of(request), None)
                return None
            return entry[0] if entry else None

    def _reload_step(self, request, experts, method, values) -> str:
        """What a move is while a History reload is pending: "reload" (the row's own spec: computed,
        not recorded), "loaded" (the spec Start from learned or tuned weights set: computed and
        recorded), "shown" (the room's merge, whose answer the room sent with it: nothing to show),
        "skip" (an in-between spec of the reload) or "move" (a person's move). The
        reload stays pending after its spec arrived, so that its method change, whenever it comes,
        keeps the row's values; the person's next different move ends it."""
        key = session_of(request)
        target = self._target(request)
        if target is None:
            return "move"
        if self.spec_of(experts, method, values) == target:
            with self._lock:
                entry = self._targets.get(key)
                if entry is not None:
                    self._targets[key] = (*entry[:2], True, entry[3])
            return entry[3] if entry is not None else "reload"
        with self._lock:
            matched = key in self._targets and self._targets[key][2]
            if matched:
                self._targets.pop(key, None)
        return "move" if matched else "skip"

    def spec_of(self, experts, method, values):
        """The spec the controls describe, or None where they hold a refused value."""
        try:
            return self.ctl.spec_from_controls(experts, method, *values)
        except MergerError:
            return None

    # Gradio injects the request only among positional parameters: it comes first.
    def reload(self, request: gr.Request, row_id, experts, method, *values):
        """A History row into every Merge-tab input."""
        return self.set_or_warn(request, lambda: self.ctl.reload(row_id, session_of(request)), experts, method, values, record=False)

    def set_to_work(self, request: gr.Request, picked, seen, experts, method, *values):
        """The settings of a run or preparation this page saw under way into every Merge-tab input."""
        return self.set_or_warn(request, lambda: self.ctl.work_updates(picked, seen, session_of(request)),
                                experts, method, values)

    def start_from_learned(self, request: gr.Request, experts, method, *values):
        """The current data-driven run's coefficients into the coefficient sliders (task arithmetic)."""
        return self.set_or_warn(request, lambda: self.ctl.learned_updates(experts, method, *values),
                                 experts, method, values)

    def set_or_warn(self, request, updates, experts, method, values, record: bool = True):
        """``set_inputs`` of updates(), or, where those fail, their message as a warning and every
        input as it was: raised, the error would replace each input it targets by an error badge."""
        try:
            got = updates()
        except gr.Error as exc:
            return kept(exc.message, 2 + len(values))
        except MergerError as exc:
            return kept(exc, 2 + len(values))
        return self.set_inputs(request, got, experts, method, values, record)

    def expect(self, who: str, spec, answered: bool) -> None:
        """The room sets a following page's controls to ``spec``: read the change events that follow
        as one request (as a reload's), not recorded; ``answered``: the room sent its answer along,
        so they show nothing, else they show it (from the cache: the presenter's)."""
        self._expect(who, spec, "shown" if answered else "reload")

    def _expect(self, who: str, spec, step: str) -> None:
        with self._lock:
            self._targets[who] = (spec, time.monotonic() + EXPIRY_S, False, step)

    def drop_expected(self, who: str) -> None:
        """The page stopped following: its next move is its own, never a step of the room's."""
        with self._lock:
            self._targets.pop(who, None)

    def set_inputs(self, request, updates, experts, method, values, record: bool = True):
        """Set every input at once; the change events that follow are read as one request (above),
        its result recorded in the history unless it came from there (``record``)."""
        target = self.spec_of(updates[0]["value"], updates[1]["value"], [u.get("value") for u in updates[2:]])
        if target is None or target == self.spec_of(experts, method, values):
            return tuple(gr.skip() for _ in updates)  # nothing changes: no event will follow
        self._expect(session_of(request), target, "loaded" if record else "reload")
        return updates

    def method_controls(self, request: gr.Request, method, experts, *values):
        with self._lock:
            previous = self._methods.get(session_of(request), self.initial_method)
            self._methods[session_of(request)] = method
        target = self._target(request)
        if target is not None and target.method == methods.get(method).name:
            m = methods.get(target.method)
            values = self.ctl.control_values(m, target.kwargs, len(target.experts))
            previous = None  # the row's values are what was asked for, defaults or not
        return self.ctl.method_controls(method, experts, *values, previous=previous)

    MOVE_OUTPUTS = 8  # accuracy, loss, radar, summary, objective, coefficients, FW, landscape

    def move(self, request: gr.Request, land_state, experts, method, *values):
        """Generator: (Merge plots + summary, data-driven panel, landscape figure) for one move;
        on a slow pool a partial answer first."""
        skip = (gr.skip(),) * self.MOVE_OUTPUTS
        step = self._reload_step(request, experts, method, values)
        if step == "skip":
            yield skip  # a step of a History reload, not a request
            return
        record = step in ("move", "loaded")  # a reloaded row is in the history already
        who = session_of(request)
        with self._lock:
            self._shown[who] = self.spec_of(experts, method, values)
        if step == "shown":  # the room's merge, its answer already on the page
            spec = self._shown[who]
            with self._lock:
                self._said[who] = spec.method
            self.saw(who, [spec])
            marker = self.landscape.move_live(land_state, experts, method, *values) if self.landscape else gr.skip()
            yield (*(gr.skip(),) * 4, *self._learned(who, experts, method, values), marker)
            return
        queue = self.ctl.session.queue
        ticket = queue.ticket(who)
        learned = self._learned(who, experts, method, values)
        skip3 = (gr.skip(),) * 3
        try:
            first = self._first_answer(experts, method, values)
            if first is not None:
                yield (*self.ctl.preview(experts, method, *values, **first), *learned, gr.skip())
                if queue.superseded(who, ticket):
                    return  # a newer move will answer; this one stops at its partial answer
            else:
                computing = self._computing(who, experts, method, values)
                if computing is not None:
                    yield (*skip3, computing, *learned, gr.skip())
                    learned = skip3
            ans = self.ctl.answer(experts, method, *values, record=record, session=who, ticket=ticket)
        except Superseded:
            yield skip
            return
        if queue.superseded(who, ticket):  # a newer move of this page came meanwhile: its answer is the controls'
            yield skip
            return
        if self.room is not None and ans.spec is not None:  # computed: the room's pages find it cached
            self.room.presenter_shows(request, spec=ans.spec)
        with self._lock:
            self._said[who] = ans.spec.method if ans.result is not None else None
        if ans.result is None:  # no merge on screen: the landscape's marker leaves the last one too
            marker = self.landscape.move_live(land_state, experts, method, *values) if self.landscape else gr.skip()
            yield (*self.ctl.no_result(ans.message, ans.why), *learned, marker)
            return
        self.saw(who, [ans.spec])  # answer() without images is complete
        # The numbers first (what a person reads), then the figures, which take the browser longer to draw.
        estimated = first is not None and first.get("estimate", False)
        yield (*skip3, self.ctl.summary(ans.spec, ans.result, ans.cached, estimated), *learned, gr.skip())
        if queue.superseded(who, ticket):  # (the newer move's numbers were sent meanwhile: its figures follow)
            return
        marker = self.landscape.move_live(land_state, experts, method, *values) if self.landscape else gr.skip()
        yield (*self.ctl.figures(ans), gr.skip(), *skip3, marker)

    def move_or_restore(self, request: gr.Request, land_state, experts, method, *values):
        """The app's listener of every Merge-tab control (its values taken as the browser sent them):
        ``move``'s outputs, then one update per value control. A value its control's range refuses
        is one warning, and the box goes back to the value on screen; nothing is computed. The
        browser then puts the refused value in range when the box loses focus (λ 5 → 3, an emptied
        box → 0) and sends that as a move: unless the restored value reached the box first, that
        move is the browser's, not the person's, and is restored the same way, silently."""
        who = session_of(request)
        malformed = _malformed(experts, method)
        if malformed is not None:  # not what the page sends (a client of the queue's own): said, nothing done
            warn(malformed)
            yield (gr.skip(),) * (self.MOVE_OUTPUTS + len(values))
            return
        values = self.ctl.as_entered(method, values)
        refused = self.ctl.out_of_range(experts, method, values)
        if refused is not None:
            position, message, clamped = refused
            warn(message)
            with self._lock:
                self._clamped[who] = (position, clamped, time.monotonic() + CLAMP_S)
        else:
            position = self._clamp_echo(who, experts, method, values)
        controls = [gr.skip()] * len(values)
        if position is not None:
            with self._lock:
                shown = self._shown.get(who)
            restored = self.ctl.values_of(shown, method, len(experts or []))[position]
            controls[position] = gr.update(value=restored)
            yield (gr.skip(),) * self.MOVE_OUTPUTS + tuple(controls)
            return
        for frame in self.move(request, land_state, experts, method, *values):
            yield (*frame, *controls)

    def move_at(self, position: int):
        """``move_or_restore`` as the listener of the value control at ``position``: its frames carry
        the move's outputs and that control alone. Gradio builds every output of every frame, a
        skipped one too, so the other controls would delay each frame (docs/performance.md)."""
        def move_of_control(request: gr.Request, land_state, experts, method, *values):
            for frame in self.move_or_restore(request, land_state, experts, method, *values):
                yield (*frame[:self.MOVE_OUTPUTS], frame[self.MOVE_OUTPUTS + position])
        return move_of_control

    def _clamp_echo(self, who: str, experts, method, values) -> int | None:
        """The control whose value is the browser's putting a refused one in range (see
        ``move_or_restore``), or None. Where that value is the one on screen anyway, the move is
        no one's change and goes on (its answer is cached)."""
        with self._lock:
            entry = self._clamped.pop(who, None)
            shown = self._shown.get(who)
        if entry is None:
            return None
        position, clamped, until = entry
        if time.monotonic() > until or not _same(values[position], clamped):
            return None
        try:
            on_screen = self.ctl.values_of(shown, method, len(experts or []))[position]
        except MergerError:
            return None
        return None if _same(on_screen, clamped) else position

    def _computing(self, who: str, experts, method, values) -> str | None:
        """A status line for the summary while a method prepares for a move, where the summary shows
        another method's result or a message (SLERP's two-expert rule stayed on screen while TSV-M
        prepared); None where the answer comes within one apply."""
        spec = self.spec_of(experts, method, values)
        with self._lock:
            said = self._said.get(who, spec.method if spec is not None else None)
        session = self.ctl.session
        if spec is None or said == spec.method or session.cached(spec) is not None:
            return None
        m = methods.get(spec.method)
        # a data-driven method, or a preparation that goes through Run: the answer is a message at
        # once; a quick preparation, or one apply: it replaces what is shown at once
        if m.data_driven or session.prepare_is_slow(spec) or not m.slow_prepare or session.is_prepared(spec):
            return None
        return f"**{m.display_name}**: preparing and merging `{spec.label()}`, then evaluating it on every task…"

    def _learned(self, who: str, experts, method, values) -> tuple:
        """The data-driven panel, or skips when it would show what it already shows (every move of a
        static method would otherwise redraw three empty figures)."""
        spec = self.spec_of(experts, method, values)
        run = self.ctl.session.cached_run(spec) if spec is not None and methods.get(spec.method).data_driven else None
        shows = id(run) if run is not None else None
        with self._lock:
            same = who in self._panel and self._panel[who] == shows
            self._panel[who] = shows
        return (gr.skip(),) * 3 if same else self.ctl.learned(experts, method, *values)

    def _first_answer(self, experts, method, values) -> dict | None:
        """What a move shows before its complete answer, as ``answer``'s options: only on a slow pool,
        for a result not yet computed: the linear estimate where its forwards are ready, else a
        partial answer for a static method."""
        session = self.ctl.session
        if session.partial_images is None:
            return None
        spec = self.spec_of(experts, method, values)
        if spec is None or session.cached(spec) is not None:
            return None
        if session.linear.ready(spec):
            return {"estimate": True}
        if methods.get(spec.method).data_driven or session.prepare_is_slow(spec):
            return None
        return {"images": session.partial_images}


def _same(a, b) -> bool:
    try:
        return a is not None and b is not None and abs(float(a) - float(b)) <= 1e-9
    except (TypeError, ValueError, OverflowError):
        return False


def _malformed(experts, method) -> str | None:
    """Why the experts or the method are not what the Merge tab sends (a list of names, a name), or
    None: the listener takes the browser's values unchecked by Gradio (``move_or_restore``)."""
    if not isinstance(experts, (list, tuple)) or not all(isinstance(e, str) for e in experts):
        return f"experts: expected a list of expert names, got {str(experts)[:60]!r}"
    if not isinstance(method, str):
        return f"method: expected a method's name, got {str(method)[:60]!r}"
    return None
