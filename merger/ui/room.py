"""A workshop room (``app --presenter USER:PASSWORD``): the one owner of what the presenter shows
(the merge on their controls, their tab, their pins), of who follows it, and of the question they
hand the room. Plain state under one lock, no Gradio: ``room_panel.py`` draws it on each page.

The presenter's merge is computed by the presenter's own move and only then shown to the room, so
every follower's page asks for a result that is cached: one merge and one forward per presenter
move, whatever the number of followers.
"""
from __future__ import annotations

import math
import threading
from dataclasses import dataclass, field, replace

MAX_PAGES = 1000  # pages a room keeps a record of (followers and presenter pages); more are refused
GUESS_RANGE = (0.0, 100.0)  # a guess is an average accuracy in %


@dataclass(frozen=True)
class Shown:
    """What the presenter shows, as of one version: the merge on their controls (a Spec, or None
    before their first move), the tab they are on, their pins."""
    version: int = 0
    spec: object = None
    tab: str = "merge"
    pins: tuple = ()


@dataclass
class Question:
    """A question the presenter handed the room: predict the average accuracy of ``subject``."""
    number: int
    subject: object  # the Spec whose average accuracy is asked
    guesses: dict = field(default_factory=dict)  # page -> guess in %, the last one counts
    answer: float | None = None  # in %, once revealed


@dataclass
class Page:
    """A page in the room: whether it follows, what the room last sent it, its own pins (kept
    while it mirrors the presenter's, given back when it stops following)."""
    following: bool = True
    applied: Shown | None = None
    own_pins: tuple = ()
    stream: int = 0  # the newest follow stream of the page (an older one ends)


class RoomError(ValueError):
    """An action the room refuses; the message says why, and nothing changed."""


class Room:
    def __init__(self, presenter: str):
        self.presenter = presenter  # the login name that drives the room
        self._lock = threading.Lock()
        self._shown = Shown()
        self._pages: dict[str, Page] = {}
        self._presenter_pages: set[str] = set()
        self._question: Question | None = None
        self._streams = 0

    # ---- who is who ---------------------------------------------------------------------
    def is_presenter(self, request) -> bool:
        return getattr(request, "username", None) == self.presenter

    def refuse_unless_presenter(self, request, action: str) -> None:
        if not self.is_presenter(request):
            raise RoomError(f"{action}: only the presenter (signed in as {self.presenter!r}) can do this; the room "
                            "is unchanged")

    def arrived(self, who: str, presenter: bool) -> None:
        with self._lock:
            if presenter:
                self._presenter_pages.add(who)
            elif who not in self._pages:
                if len(self._pages) >= MAX_PAGES:
                    raise RoomError(f"the room is full ({MAX_PAGES} pages); this page explores on its own")
                self._pages[who] = Page()

    def left(self, who: str) -> None:
        """A page closed (or reloaded: it arrives again as a new page)."""
        with self._lock:
            self._presenter_pages.discard(who)
            self._pages.pop(who, None)

    @property
    def present(self) -> bool:
        """Whether a presenter page is open."""
        with self._lock:
            return bool(self._presenter_pages)

    def followers(self) -> int:
        with self._lock:
            return sum(p.following for p in self._pages.values())

    # ---- what the presenter shows ---------------------------------------------------------
    @property
    def shown(self) -> Shown:
        with self._lock:
            return self._shown

    def presenter_shows(self, request, spec=None, tab: str | None = None, pins=None) -> bool:
        """The presenter's page shows a new merge, tab or pins (another page's call changes nothing);
        whether the room's version moved."""
        if not self.is_presenter(request):
            return False
        changes = {k: v for k, v in (("spec", spec), ("tab", tab), ("pins", None if pins is None else tuple(pins)))
                   if v is not None}
        with self._lock:
            new = replace(self._shown, **changes)
            if new == self._shown:
                return False
            self._shown = replace(new, version=new.version + 1)
            return True

    # ---- following ------------------------------------------------------------------------
    def page(self, who: str) -> Page | None:
        with self._lock:
            return self._pages.get(who)

    def follow(self, who: str, on: bool, pins=(), on_screen=None) -> tuple:
        """Switch a page's following on (it jumps to what the presenter shows now; its pins are
        kept aside) or off (it stays as it is). Returns the pins the page holds from then on: off,
        its own pins before the presenter's it showed, so nothing the attendee pinned is lost."""
        with self._lock:
            page = self._pages.setdefault(who, Page())
            if on == page.following:
                return tuple(pins or ())
            page.following = on
            if on:
                page.own_pins = tuple(pins or ())
                page.applied = Shown(-1, on_screen, "", tuple(pins or ()))  # what the page shows: only changes go
                return tuple(pins or ())
            mine = page.own_pins
            page.own_pins = ()
            return mine + tuple(p for p in (pins or ()) if p not in mine)

    def to_apply(self, who: str) -> tuple[Shown | None, Shown] | None:
        """(what the page last got, what it must show now) for a following page behind the room;
        None when it is up to date or not following. The caller sends the difference, then calls
        ``applied``."""
        with self._lock:
            page = self._pages.get(who)
            if page is None or not page.following:
                return None
            if page.applied is not None and page.applied.version == self._shown.version:
                return None
            return page.applied, self._shown

    def applied(self, who: str, shown: Shown) -> None:
        with self._lock:
            page = self._pages.get(who)
            if page is not None:
                page.applied = shown

    def new_stream(self, who: str) -> int:
        """A page's follow stream starts: it replaces the page's earlier one."""
        with self._lock:
            self._streams += 1
            page = self._pages.get(who)
            if page is not None:
                page.stream = self._streams
            return self._streams

    def streaming(self, who: str, stream: int, presenter: bool) -> bool:
        """Whether a follow stream should go on: its page is open and this is its newest stream."""
        with self._lock:
            if presenter:
                return who in self._presenter_pages
            page = self._pages.get(who)
            return page is not None and page.stream == stream

    # ---- the question -----------------------------------------------------------------------
    @property
    def question(self) -> Question | None:
        with self._lock:
            return self._question

    def ask(self, request, subject) -> Question:
        self.refuse_unless_presenter(request, "ask the room")
        with self._lock:
            number = self._question.number + 1 if self._question else 1
            self._question = Question(number, subject)
            return self._question

    def guess(self, who: str, value) -> float:
        """A page's guess (in %), checked; the last one of a page counts."""
        lo, hi = GUESS_RANGE
        try:
            if isinstance(value, bool):
                raise TypeError
            number = float(str(value).strip().rstrip("%")) if isinstance(value, str) else float(value)
        except (TypeError, ValueError, OverflowError):
            raise RoomError(f"your guess: {str(value)[:40]!r} is not a number; type an average accuracy in % "
                            f"({lo:g}-{hi:g})") from None
        if not (math.isfinite(number) and lo <= number <= hi):
            raise RoomError(f"your guess: {number:g} is not an accuracy in % ({lo:g}-{hi:g})")
        with self._lock:
            q = self._question
            if q is None:
                raise RoomError("your guess: the presenter has not asked a question")
            if q.answer is not None:
                raise RoomError("your guess: the answer is out already; wait for the next question")
            if who not in q.guesses and len(q.guesses) >= MAX_PAGES:
                raise RoomError(f"your guess: the question has {MAX_PAGES} guesses already")
            q.guesses[who] = number
        return number

    def to_reveal(self, request) -> Question:
        """The question whose answer the presenter may reveal."""
        self.refuse_unless_presenter(request, "reveal the answer")
        q = self.question
        if q is None:
            raise RoomError("reveal the answer: ask the room a question first")
        return q

    def reveal(self, request, answer_pct: float) -> Question:
        q = self.to_reveal(request)
        with self._lock:
            q.answer = float(answer_pct)
        return q
