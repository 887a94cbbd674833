"""The Merge tab's listeners as one browser session drives them.

A History reload sets the experts, the method and every value at once; the browser then fires a
change event per component, each reading the others as they are at that moment, some not yet
updated. Those in-between specs are no one's request: they are neither computed nor recorded, and
the method change that follows does not reset the values the reload set. The session's pending
reload target is held here (one owner), until its own preview arrives or it expires.
"""
from __future__ import annotations

import threading
import time

import gradio as gr

from .. import methods
from ..errors import MergerError

EXPIRY_S = 10.0  # a reload whose target never shows up stops guarding the session after this


def session_of(request) -> str:
    return getattr(request, "session_hash", None) or "default"


class MergeTabEvents:
    def __init__(self, ctl, initial_method: str):
        self.ctl = ctl
        self.initial_method = initial_method
        self._targets: dict[str, tuple[object, float]] = {}
        self._methods: dict[str, str] = {}  # the method each session shows (to tell its defaults)
        self._lock = threading.Lock()

    def _target(self, request):
        with self._lock:
            entry = self._targets.get(session_of(request))
            if entry is not None and entry[1] < time.monotonic():
                self._targets.pop(session_of(request), None)
                return None
            return entry[0] if entry else None

    def _spec(self, experts, method, values):
        try:
            return self.ctl.spec_from_controls(experts, method, *values).rounded()
        except MergerError:
            return None

    # Gradio injects the request only among positional parameters: it comes first.
    def reload(self, request: gr.Request, row_id, experts, method, *values):
        updates = self.ctl.reload(row_id)
        target = self._spec(updates[0]["value"], updates[1]["value"], [u.get("value") for u in updates[2:]])
        if target is None or target == self._spec(experts, method, values):
            return tuple(gr.skip() for _ in updates)  # nothing changes: no event will follow
        with self._lock:
            self._targets[session_of(request)] = (target, time.monotonic() + EXPIRY_S)
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

    def preview(self, request: gr.Request, experts, method, *values):
        target = self._target(request)
        if target is None:
            return self.ctl.preview(experts, method, *values)
        if self._spec(experts, method, values) != target:
            return gr.skip(), gr.skip(), gr.skip(), gr.skip()  # a step of the reload, not a request
        with self._lock:
            self._targets.pop(session_of(request), None)
        return self.ctl.preview(experts, method, *values, record=False)  # the row is in the history already
