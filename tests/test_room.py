"""The workshop room (app --presenter): followers mirror the presenter from the cache (one forward per
presenter move, whatever their number), detach and re-attach, presenter away, the question, and
what the room refuses. Pages are driven through the listeners the browser calls, in-process; the
browser's own run of it is in test_room_browser.py."""
from types import SimpleNamespace

import pytest
from helpers import controls, ui_controller

from merger.ui.merge_events import MergeTabEvents
from merger.ui.room import Room
from merger.ui.room_panel import RoomPanel, _moved

PRESENTER, ATTENDEE = "host", "workshop"


@pytest.fixture(scope="module")
def ctl(tmp_path_factory):
    return ui_controller(tmp_path_factory.mktemp("room"))


class Page:
    """A browser page: its login, its Merge-tab inputs, what its listeners showed."""

    def __init__(self, ctl, name, user=ATTENDEE):
        self.request = SimpleNamespace(session_hash=name, username=user)
        self.inputs = controls(ctl) + [1.0] * len(ctl.weight_labels())  # the coefficient sliders at 1
        self.summary = None
        self.pins = []

    def set(self, updates):
        """The browser applies a listener's updates (a skip leaves the value)."""
        for i, u in enumerate(updates):
            if isinstance(u, dict) and "value" in u:
                self.inputs[i] = u["value"]


def lam(page):
    return page.inputs[2]


@pytest.fixture
def room(ctl):
    room = Room(PRESENTER)
    events = MergeTabEvents(ctl, "task_arithmetic", None, room)
    panel = RoomPanel(room, ctl, events)

    def move(page):
        """Its controls' change event: the move listener, to its last frame."""
        for frame in events.move_or_restore(page.request, None, *page.inputs):
            if isinstance(frame[3], str):
                page.summary = frame[3]  # the numbers come first, then the figures

    def sync(page):
        """One look of the page's follow stream at the room; the change events of its controls."""
        pending = room.to_apply(page.request.session_hash)
        if pending is None:
            return False
        before, now = pending
        answer = panel._answer_of(now) if _moved(before, now) else None
        controls, _, summary = panel._merge_frame(page.request.session_hash, before, now, answer)
        before_inputs = list(page.inputs)
        page.set(controls[3:])
        if isinstance(controls[1], list):
            page.pins = controls[1]
        if isinstance(summary, str):
            page.summary = summary  # the room sent the answer along
        if page.inputs != before_inputs:
            for out in events.move(page.request, None, *page.inputs):
                assert not isinstance(out[3], str) or answer is None  # shown already: nothing again
                if isinstance(out[3], str):
                    page.summary = out[3]
        return True
    return SimpleNamespace(room=room, events=events, panel=panel, move=move, sync=sync)


def enter(room, ctl, *attendees):
    """The presenter's page and the attendees' pages, each loaded (arrived in the room)."""
    pages = [Page(ctl, "p", PRESENTER)] + [Page(ctl, name) for name in attendees]
    for page in pages:
        room.panel.arrive(page.request, *page.inputs)
    return pages


def average(summary):
    return float(summary.split("title='")[1].split("'")[0])


def work(ctl):
    return ctl.session.evaluator.forwards, ctl.session.counts["applies"]


@pytest.mark.parametrize("followers", [1, 10])
def test_a_presenter_move_is_computed_once_for_the_whole_room(ctl, room, followers):
    presenter, *pages = enter(room, ctl, *[f"f{i}" for i in range(followers)])
    for page in pages:
        room.sync(page)  # each page starts where the room is
    room.move(presenter)  # the base, experts' accuracies: made before counting
    for value in ((0.45, 0.55) if followers == 1 else (0.65, 0.75)):  # on the slider's step
        presenter.inputs[2] = value
        before = work(ctl)
        room.move(presenter)
        assert all(room.sync(p) for p in pages)
        assert work(ctl) == (before[0] + 1, before[1] + 1)  # one forward, one apply for 1 + N pages
        assert all(lam(p) == value for p in pages)
        assert {average(p.summary) for p in pages} == {average(presenter.summary)}
        assert not any(room.sync(p) for p in pages)  # up to date: nothing more is sent
    assert room.room.followers() == followers


def test_a_follower_that_switches_off_stays_and_jumps_back_when_on(ctl, room):
    presenter, page = enter(room, ctl, "a")
    presenter.inputs[2] = 0.6
    room.move(presenter)
    room.sync(page)
    assert lam(page) == 0.6
    room.panel.switch(page.request, False, [], *page.inputs)
    presenter.inputs[2] = 0.7
    room.move(presenter)
    assert not room.sync(page) and lam(page) == 0.6  # detached: still where it was
    page.inputs[2] = 0.25  # its own exploring: its own move, not the room's
    room.move(page)
    assert "lam=0.25" in page.summary
    room.panel.switch(page.request, True, [], *page.inputs)
    assert room.sync(page) and lam(page) == 0.7  # re-attached: the presenter's merge now
    assert average(page.summary) == average(presenter.summary)


def test_taking_a_control_detaches_and_keeps_the_attendees_own_pins(ctl, room):
    presenter, page = enter(room, ctl, "a")
    mine = ctl.spec_from_controls(*controls(ctl, lam=0.9))
    room.panel.switch(page.request, False, [], *page.inputs)
    kept, _ = room.panel.switch(page.request, True, [mine], *page.inputs)  # its pin is set aside
    assert kept == [mine]
    theirs = ctl.spec_from_controls(*controls(ctl, lam=0.8))
    room.panel.pins_shown(presenter.request, [theirs])
    room.sync(page)
    assert page.pins == [theirs]
    follow, kept, text = room.panel.took_controls(page.request, page.pins)
    assert follow["value"] is False and kept == [mine, theirs] and "lam=0.9" in text  # nothing pinned is lost
    assert room.room.page("a").following is False


def test_only_the_presenter_drives_the_room(ctl, room):
    presenter, page = enter(room, ctl, "a")
    page.inputs[2] = 0.35
    room.move(page)  # an attendee's move is theirs alone
    version = room.room.shown.version
    room.panel.pins_shown(page.request, [ctl.spec_from_controls(*page.inputs)])
    room.panel.tab_selected(page.request, SimpleNamespace(value="Compare"))
    assert "only the presenter" in room.panel.ask(page.request, "", 1.0, *page.inputs)
    assert "only the presenter" in room.panel.reveal(page.request, *page.inputs)[0]
    assert room.room.shown.version == version and room.room.question is None  # unchanged
    room.panel.tab_ids = {"Compare": "compare"}
    room.panel.tab_selected(presenter.request, SimpleNamespace(value="Compare"))
    assert room.room.shown.tab == "compare"


def test_a_question_takes_guesses_and_reveals_the_answer_as_a_histogram(ctl, room):
    presenter, page, other = enter(room, ctl, "a", "b")
    assert "not asked" in room.panel.guess(page.request, "50")
    said = room.panel.ask(presenter.request, "", 1.0, *presenter.inputs)
    assert "Question 1" in said and "lam=1" in said
    for bad, why in (("about half", "is not a number"), ("", "is not a number"), ("150", "not an accuracy"),
                     ("nan", "not an accuracy"), (True, "is not a number")):
        assert why in room.panel.guess(page.request, bad)
    assert room.room.question.guesses == {}  # nothing refused was counted
    assert "62.5 %" in room.panel.guess(page.request, "62.5 %")
    room.panel.guess(other.request, 40)
    talk = room.panel._talk_updates("a", False, room.panel._talk("a", False))
    assert "Question 1" in talk[2] and "62.5" in talk[2] and talk[3]["visible"]  # the guess box stays open
    said, *updates = room.panel.reveal(presenter.request, *presenter.inputs)
    subject = room.room.question.subject
    expected = 100 * ctl.session.preview(subject).average_accuracy
    assert f"{expected:.1f} %" in said and room.room.question.answer == pytest.approx(expected)
    presenter.set(updates)
    assert lam(presenter) == 1.0  # the presenter's controls (so the room) move to the question's merge
    assert "answer is out" in room.panel.guess(page.request, "10")
    talk = room.panel._talk_updates("a", False, room.panel._talk("a", False))
    figure = talk[4]["value"]
    assert sorted(figure.data[0].x) == [40, 62.5] and f"{expected:.1f}" in talk[2]


def test_followers_see_the_presenter_away_and_a_reloaded_presenter_resumes(ctl, room):
    presenter, page = enter(room, ctl, "a")
    presenter.inputs[2] = 0.45
    room.move(presenter)
    banner = room.panel._talk_updates("a", False, room.panel._talk("a", False))[0]["value"]
    assert "Following the presenter" in banner
    room.room.left("p")  # the presenter's page closed (Gradio's unload)
    banner = room.panel._talk_updates("a", False, room.panel._talk("a", False))[0]["value"]
    assert "Presenter away" in banner
    again = Page(ctl, "p2", PRESENTER)  # reloaded: a new page, with the app's first values
    got = room.panel.arrive(again.request, *again.inputs)
    again.set(got[5:])
    assert lam(again) == 0.45 and room.room.present  # it resumes what the room shows


def test_presenter_flags_are_checked_before_the_pool_opens(capsys):
    from merger.serve import main

    assert main(["--presenter", "host:pw"]) == 2
    assert "--presenter: needs --auth" in capsys.readouterr().err
    assert main(["--auth", "host:a", "--presenter", "host:b"]) == 2
    assert "must differ from --auth's" in capsys.readouterr().err


def test_the_login_takes_both_the_room_and_the_presenter():
    from merger.ui.login import LoginGate

    gate = LoginGate({"workshop": "pw", "host": "pw2"}, sleep=lambda s: None)
    assert gate("workshop", "pw") and gate("host", "pw2")
    assert not gate("host", "pw") and not gate("workshop", "pw2")


def test_the_room_endpoint_streams_the_room_and_bounds_its_watchers(ctl, room):
    import asyncio

    import gradio as gr

    from merger.ui.room_panel import MAX_WATCHERS

    presenter, _ = enter(room, ctl, "a")
    presenter.inputs[2] = 0.65
    room.move(presenter)

    async def first(since):
        stream = room.panel.watch(since)
        try:
            return await stream.__anext__()
        finally:
            await stream.aclose()

    state = asyncio.run(first(-1))
    assert state["merge"].endswith("(lam=0.65)") and state["followers"] == 1 and state["present"]
    assert state["average_accuracy"] == ctl.session.cached(room.room.shown.spec).average_accuracy
    with pytest.raises(gr.Error, match="not a|whole number"):
        asyncio.run(first("soon"))
    room.panel._watchers = MAX_WATCHERS
    with pytest.raises(gr.Error, match=f"{MAX_WATCHERS} watchers"):
        asyncio.run(first(-1))
    room.panel._watchers = 0
