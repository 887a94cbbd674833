"""The one way the UI reports a problem: ``fail`` for a button's job (Gradio shows the message
as a toast, the app stays up, the outputs keep what they showed), ``notice`` where a result would
be shown instead (a slider move, a run's status line: a toast per move would bury the page).
Both carry the engine's message, which names the file, field or parameter and the reason."""
from __future__ import annotations

from typing import NoReturn

import gradio as gr


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
