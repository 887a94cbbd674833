"""The workshop room on each page (state in ``room.py``): a banner, the *Follow the presenter* switch,
the presenter's *Ask the room* box and the question everyone sees.

Each page holds one follow stream (an async generator on the event loop, no thread) that looks at
the room every ``POLL_S`` and sends what changed: to a following page, the presenter's tab, merge
and pins; to every page, the banner and the question. A merge reaches a follower as its controls'
values; the controls' own change events then show it, from the cache (the presenter's move computed
it), exactly as a History reload does (``MergeTabEvents.expect``).
"""
from __future__ import annotations

import asyncio
import threading

import gradio as gr

from merger import methods, plots
from merger.errors import MergerError
from merger.ui.errors import notice, warn
from merger.ui.merge_events import session_of
from merger.ui.merge_tab import Answer
from merger.ui.room import Room, RoomError

POLL_S = 0.1  # how often a page's stream looks at the room (a dict lookup: no request, no thread)
WATCH_S = 600.0  # an HTTP watcher's stream (the `room` endpoint) ends after this; it calls again
MAX_WATCHERS = 200  # `room` endpoint streams at once; more are refused
ON_SCREEN = ""  # the Ask box's method choice: the presenter's own


class RoomPanel:
    def __init__(self, room: Room, ctl, events):
        self.room, self.ctl, self.events = room, ctl, events
        self.tab_ids: dict[str, str] = {}  # a tab's label -> its id (Tabs.select names the label)
        self.n_inputs = 2 + len(methods.PARAM_NAMES) + len(ctl.weight_labels())  # the Merge tab's inputs
        self._render_lock = threading.Lock()
        self._rendered: tuple[int, tuple | None] = (-1, None)  # (room version, its answer drawn)
        self._watchers = 0  # `room` endpoint streams going on
        self._watchers_lock = threading.Lock()  # not the render lock: the event loop must never wait on a drawing

    # ---- the page -------------------------------------------------------------------------
    def build(self) -> dict:
        """The room's components, above the tabs; shown per page when it loads (``arrive``)."""
        with gr.Row():
            banner = gr.Markdown(elem_id="room-banner")
            follow = gr.Checkbox(True, label="Follow the presenter", elem_id="follow", visible=False, scale=0,
                                 min_width=220)
        with gr.Accordion("Ask the room", open=False, visible=False, elem_id="ask-box") as ask_box:
            with gr.Row():
                static = [m for m in methods.all_methods() if not m.data_driven]
                q_method = gr.Dropdown([("the method on screen", ON_SCREEN), *[(m.display_name, m.name) for m in static]],
                                       value=ON_SCREEN, label="predict the average accuracy of", elem_id="ask-method")
                q_lam = gr.Number(1.0, label="at λ (blank: as on screen)", elem_id="ask-lam")
            with gr.Row():
                ask_btn = gr.Button("Ask", elem_id="ask")
                reveal_btn = gr.Button("Reveal the answer", elem_id="reveal")
            ask_status = gr.Markdown()
        with gr.Group(visible=False) as question_box:
            question = gr.Markdown(elem_id="question")
            with gr.Row(visible=False) as guess_row:
                guess = gr.Textbox(label="your guess: average accuracy in %", elem_id="guess")
                guess_btn = gr.Button("Guess", elem_id="guess-btn", scale=0)
            guess_status = gr.Markdown(elem_id="guess-status")
            histogram = gr.Plot(visible=False, elem_id="guess-histogram")
        return {"banner": banner, "follow": follow, "ask_box": ask_box, "q_method": q_method, "q_lam": q_lam,
                "ask": ask_btn, "reveal": reveal_btn, "ask_status": ask_status, "question_box": question_box,
                "question": question, "guess_row": guess_row, "guess": guess, "guess_btn": guess_btn,
                "guess_status": guess_status, "histogram": histogram}

    def wire(self, app, c: dict, tabs, tab_ids: dict, merge: dict) -> None:
        inputs, pins = merge["inputs"], merge["pins"]
        pins_md = merge["pins_md"]
        private = {"api_visibility": "private"}
        app.load(self.arrive, inputs, [c["follow"], c["ask_box"], tabs, pins, pins_md, *inputs], **private)
        stream_out = [tabs, pins, pins_md, *inputs, *merge["outputs"], c["banner"], c["question_box"], c["question"], c["guess_row"],
                      c["histogram"]]
        app.load(self.stream, None, stream_out, concurrency_id="room", concurrency_limit=None, show_progress="hidden",
                 **private)
        c["follow"].input(self.switch, [c["follow"], pins, *inputs], [pins, pins_md], queue=False, **private)
        for control in inputs:  # an attendee who takes a control explores on their own from then on
            control.input(self.took_controls, [pins], [c["follow"], pins, pins_md], queue=False, **private)
        self.tab_ids = tab_ids
        tabs.select(self.tab_selected, None, None, queue=False, **private)
        pins.change(self.pins_shown, pins, None, queue=False, **private)
        c["ask"].click(self.ask, [c["q_method"], c["q_lam"], *inputs], c["ask_status"], **private)
        c["reveal"].click(self.reveal, inputs, [c["ask_status"], *inputs], **private)
        for event in (c["guess_btn"].click, c["guess"].submit):
            event(self.guess, c["guess"], c["guess_status"], queue=False, **private)
        gr.api(self.watch, api_name="room", concurrency_id="room", concurrency_limit=None)

    def arrive(self, request: gr.Request, experts, method, *values):
        """A page loads: the presenter's gets the Ask box and, after a reload, what it was showing
        (it resumes driving); an attendee's gets the Follow switch (on)."""
        who, presenter = session_of(request), self.room.is_presenter(request)
        skips = (gr.skip(),) * (2 + len(values))
        try:
            self.room.arrived(who, presenter)
        except RoomError as exc:
            warn(str(exc))
            return gr.update(visible=False), gr.update(visible=False), gr.skip(), gr.skip(), gr.skip(), *skips
        if not presenter:
            return gr.update(visible=True, value=True), gr.update(visible=False), gr.skip(), gr.skip(), gr.skip(), *skips
        shown = self.room.shown
        updates = skips
        if shown.spec is not None:
            updates = self.events.set_inputs(request, self.ctl.updates_of(shown.spec), experts, method, values, record=False)
        return (gr.update(visible=False), gr.update(visible=True), gr.update(selected=shown.tab), list(shown.pins),
                self.ctl.pins_text(list(shown.pins)), *updates)

    async def stream(self, request: gr.Request):
        """Generator: the page's room updates, for as long as the page is open."""
        who, presenter = session_of(request), self.room.is_presenter(request)
        try:
            self.room.arrived(who, presenter)
        except RoomError:
            return
        stream = self.room.new_stream(who)
        said = None  # (banner, question) as last sent
        while self.room.streaming(who, stream, presenter):
            merge = None
            pending = None if presenter else self.room.to_apply(who)
            if pending is not None:
                before, now = pending
                answer = await asyncio.to_thread(self._answer_of, now) if _moved(before, now) else None
                merge = self._merge_frame(who, before, now, answer)
            talk = self._talk(who, presenter)
            if merge is not None or talk != said:
                updates = self._talk_updates(who, presenter, talk) if talk != said else (gr.skip(),) * 5
                said = talk
                controls, figures, summary = merge or ((gr.skip(),) * (3 + self.n_inputs), None, gr.skip())
                # the numbers first, then the figures (the browser takes longer to draw them), as a move does
                yield (*controls, *(gr.skip(),) * 3, summary, *updates)
                if figures is not None:
                    yield (*(gr.skip(),) * (3 + self.n_inputs), *figures, gr.skip(), *(gr.skip(),) * 5)
            await asyncio.sleep(POLL_S)

    def _answer_of(self, shown) -> tuple | None:
        """(accuracy, loss, radar, summary) of the presenter's merge from the cache, drawn once per
        version for every page; None where it has no cached result (a message: the page's own move
        shows it)."""
        with self._render_lock:
            if self._rendered[0] != shown.version:
                result = self.ctl.session.cached(shown.spec) if shown.spec is not None else None
                answer = None
                if result is not None:
                    ans = Answer(shown.spec, result, True)
                    answer = (*self.ctl.figures(ans), self.ctl.summary(shown.spec, result, True))
                self._rendered = (shown.version, answer)
            return self._rendered[1]

    def _merge_frame(self, who: str, before, now, answer) -> tuple:
        """((tab, pins, pins text, *Merge inputs), the three figures or None, the summary) updates that
        bring a following page to what the presenter shows, only what differs."""
        tab = gr.update(selected=now.tab) if before is None or before.tab != now.tab else gr.skip()
        pins = (list(now.pins), self.ctl.pins_text(list(now.pins))) if before is None or before.pins != now.pins \
            else (gr.skip(), gr.skip())
        inputs, figures, summary = (gr.skip(),) * self.n_inputs, None, gr.skip()
        if _moved(before, now):
            offered = self.ctl.offered.to(who)
            if all(e in offered for e in now.spec.experts):  # a lab expert this page is not offered: not shown
                inputs = self._input_updates(who, before.spec if before is not None else None, now.spec,
                                             answer is not None)
                if answer is not None:
                    *figures, summary = answer
        self.room.applied(who, now)
        return (tab, *pins, *inputs), figures, summary

    def _input_updates(self, who: str, before, spec, answered: bool) -> tuple:
        """Merge-input updates from ``before`` (the merge the page shows) to ``spec``: the changed
        values alone where method and experts stay (no event for the others)."""
        full = self.ctl.updates_of(spec)
        if before is not None and before.method == spec.method and before.experts == spec.experts:
            n = len(spec.experts)
            old, new = self.ctl.values_of(before, spec.method, n), self.ctl.values_of(spec, spec.method, n)
            full = (gr.skip(), gr.skip(), *[u if a != b else gr.skip() for u, a, b in zip(full[2:], old, new)])
        if before != spec:
            self.events.expect(who, spec, answered)
        return full

    def _talk(self, who: str, presenter: bool) -> tuple:
        """What the banner and the question say to this page now (compared, then sent if changed)."""
        page = self.room.page(who)
        following = page is not None and page.following
        q = self.room.question
        question = None if q is None else (q.number, q.answer, len(q.guesses) if presenter else None,
                                           q.guesses.get(who))
        followers = self.room.followers() if presenter else None
        return presenter, following, self.room.present, followers, question

    def _talk_updates(self, who: str, presenter: bool, talk: tuple) -> tuple:
        _, following, present, followers, _ = talk
        if presenter:
            banner = (f"**You are presenting**: {followers} page{' follows' if followers == 1 else 's follow'} you. Your "
                      "merge, tab and pins show on their screens, computed once here for all of them.")
        elif not following:
            banner = "**Exploring on your own**: switch *Follow the presenter* on to jump to their merge."
        elif present:
            banner = ("**Following the presenter**: their merge, tab and pins show here. Move a control (or switch "
                      "*Follow the presenter* off) to explore on your own.")
        else:
            banner = ("**Presenter away**: this page stays as it is and follows again when they are back; switch "
                      "*Follow the presenter* off to explore meanwhile.")
        q = self.room.question
        if q is None:
            return gr.update(value=banner), gr.update(visible=False), gr.skip(), gr.skip(), gr.update(visible=False)
        ask = (f"**Question {q.number}**: predict the average accuracy of `{q.subject.label()}` over "
               f"{len(q.subject.experts)} experts (live split).")
        if q.answer is None:
            count = f" {len(q.guesses)} guess{'es' * (len(q.guesses) != 1)} so far." if presenter else ""
            mine = q.guesses.get(who)
            text = ask + count + (f" Your guess: **{mine:g} %** (you can change it until the answer is out)."
                                  if mine is not None else "")
            return (gr.update(value=banner), gr.update(visible=True), text, gr.update(visible=not presenter),
                    gr.update(visible=False))
        mine = q.guesses.get(who)
        text = (f"{ask} **Answer: {q.answer:.1f} %**; {len(q.guesses)} guess{'es' * (len(q.guesses) != 1)}"
                + (f", yours {mine:g} % ({mine - q.answer:+.1f} points)." if mine is not None else "."))
        figure = plots.guesses_histogram(list(q.guesses.values()), q.answer, mine)
        return (gr.update(value=banner), gr.update(visible=True), text, gr.update(visible=False),
                gr.update(visible=True, value=figure))

    def tab_selected(self, request: gr.Request, evt: gr.SelectData):
        self.room.presenter_shows(request, tab=self.tab_ids.get(evt.value, str(evt.value)))

    def pins_shown(self, request: gr.Request, pins):
        self.room.presenter_shows(request, pins=pins or [])

    # ---- an attendee's own moves --------------------------------------------------------
    def switch(self, request: gr.Request, on, pins, experts, method, *values):
        """The Follow switch: on, the page jumps to the presenter's merge; off, it stays as it is."""
        who = session_of(request)
        if self.room.is_presenter(request):
            return gr.skip(), gr.skip()
        if not on:
            self.events.drop_expected(who)
        kept = list(self.room.follow(who, bool(on), pins or [], self.events.spec_of(experts, method, values)))
        return kept, self.ctl.pins_text(kept)

    def took_controls(self, request: gr.Request, pins):
        who = session_of(request)
        page = self.room.page(who)
        if self.room.is_presenter(request) or page is None or not page.following:
            return gr.skip(), gr.skip(), gr.skip()
        self.events.drop_expected(who)
        kept = list(self.room.follow(who, False, pins or []))
        gr.Info("You moved a control: this page explores on its own now. Switch Follow the presenter on to rejoin.")
        return gr.update(value=False), kept, self.ctl.pins_text(kept)

    def guess(self, request: gr.Request, value):
        try:
            number = self.room.guess(session_of(request), value)
        except RoomError as exc:
            return notice(exc)
        return f"Your guess, **{number:g} %**, is in."

    # ---- the presenter's question ---------------------------------------------------------
    def ask(self, request: gr.Request, method_choice, lam, experts, method, *values):
        """The question's subject: the presenter's merge, with the method and λ the Ask box names."""
        try:
            self.room.refuse_unless_presenter(request, "ask the room")
            spec = self.ctl.spec_from_controls(experts, method, *values)
            m = methods.get(method_choice or spec.method)
            params = dict(spec.kwargs) if m.name == spec.method else {}
            if lam is not None and lam != "" and "lam" in m.param_names:
                params["lam"] = float(lam)
            subject = self.ctl.session.spec(m.name, experts=list(spec.experts), task_weights=dict(spec.task_weights)
                                            or None, block_weights=dict(spec.block_weights) or None, **params).snap()
            q = self.room.ask(request, subject)
        except (RoomError, MergerError) as exc:
            return notice(exc)
        return f"Question {q.number} is on every screen: `{subject.label()}`. Press *Reveal the answer* when ready."

    def reveal(self, request: gr.Request, experts, method, *values):
        """The answer (one forward unless cached) and the guesses as a histogram; the presenter's
        controls (and so the room) move to the question's merge."""
        skips = (gr.skip(),) * (2 + len(values))
        try:
            q = self.room.to_reveal(request)
            answer = 100 * self.ctl.session.preview(q.subject).average_accuracy
            self.room.reveal(request, answer)
        except (RoomError, MergerError) as exc:
            return notice(exc), *skips
        updates = self.events.set_inputs(request, self.ctl.updates_of(q.subject), experts, method, values)
        return f"Answer {answer:.1f} %: {len(q.guesses)} guesses on every screen.", *updates

    # ---- the HTTP endpoint ---------------------------------------------------------------------
    def state(self) -> dict:
        """The room now, as JSON: what the presenter shows, its numbers (from the cache: no forward),
        the pages, the server's forwards so far (a benchmark counts them per move)."""
        shown, session = self.room.shown, self.ctl.session
        result = session.cached(shown.spec) if shown.spec is not None else None
        return {"version": shown.version, "present": self.room.present, "followers": self.room.followers(),
                "tab": shown.tab, "merge": shown.spec.label() if shown.spec is not None else None,
                "pins": [p.label() for p in shown.pins],
                "average_accuracy": None if result is None else result.average_accuracy,
                "accuracy": None if result is None else dict(result.accuracy),
                "forwards": session.evaluator.forwards}

    async def watch(self, since: int = -1) -> dict:
        """The room as JSON (``state``) each time it changes (its version passes ``since``) and
        carries the numbers, for ``WATCH_S`` seconds; then the stream ends and the client calls again."""
        try:
            seen = int(since)
        except (TypeError, ValueError, OverflowError):
            raise gr.Error(f"since: expected a room version (a whole number), got {str(since)[:40]!r}") from None
        with self._watchers_lock:
            if self._watchers >= MAX_WATCHERS:
                raise gr.Error(f"the room has {MAX_WATCHERS} watchers already; try again later")
            self._watchers += 1
        try:
            loop = asyncio.get_running_loop()
            end = loop.time() + WATCH_S
            while loop.time() < end:
                state = self.state()
                if state["version"] > seen and (state["merge"] is None or state["average_accuracy"] is not None):
                    seen = state["version"]
                    yield state
                await asyncio.sleep(POLL_S)
        finally:
            with self._watchers_lock:
                self._watchers -= 1


def _moved(before, now) -> bool:
    """Whether the presenter shows a merge the page has not been sent."""
    return now.spec is not None and (before is None or before.spec != now.spec)
