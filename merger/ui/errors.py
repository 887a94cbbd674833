"""The one way the UI reports a problem. ``kept`` (or a handler marked ``keeps_outputs``) for a
button's refused request: the message as a toast, and what the outputs showed stays in view (a
landscape that took minutes, a comparison, the inputs a reload sets); ``notice`` where a result
would be shown instead (a slider move, a run's status line: a toast per move would bury the page);
``fail`` inside those, or where an error is the answer (the scripting endpoint; Gradio would cover
each output with an error badge until closed).
Each carries the engine's message, which names the file, field or parameter and the reason."""
from __future__ import annotations

import functools
import inspect
from typing import NoReturn

import gradio as gr

from merger.errors import MergerError


def notice(problem) -> str:
    """The message shown in place of a result."""
    return f"⚠️ {problem}"


def fail(problem) -> NoReturn:
    """Stop a listener with a message for the person who pressed the button. Gradio would also print
    a traceback to the server's log for it: not for a person's input, which is no fault of the app."""
    raise gr.Error(str(problem), print_exception=False)


def warn(problem) -> None:
    """A message that does not stop the listener (part of the job was done)."""
    gr.Warning(str(problem))


def kept(problem, outputs: int) -> tuple:
    """A refused request whose outputs must stay as they were: its message as a warning, and a skip
    for each output. Raised as an error, it would cover each output (a landscape, every input a
    reload sets) with an error badge until closed."""
    warn(problem)
    # a listener of one output takes its return value as that output: a 1-tuple would be the value
    return gr.skip() if outputs == 1 else tuple(gr.skip() for _ in range(outputs))


def keeps_outputs(outputs: int):
    """Mark a handler of ``outputs`` outputs whose refusal (a MergerError, or a ``fail`` inside it)
    is a warning with every output kept (``kept``)."""
    def mark(fn):
        assert not inspect.isgeneratorfunction(fn), "a generator yields kept(...) itself"

        @functools.wraps(fn)  # Gradio reads the request and progress parameters off the signature
        def handler(*args, **kwargs):
            try:
                return fn(*args, **kwargs)
            except MergerError as exc:
                return kept(exc, outputs)
            except gr.Error as exc:
                return kept(exc.message, outputs)
        handler.keeps_outputs = outputs  # for the test that checks it against the listener's wiring
        return handler
    return mark
