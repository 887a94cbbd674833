"""The process settings the app and the command line make when they start. ``import merger`` makes
none (no environment variable, thread count, allocator or BLAS setting changes); a script that builds
the app itself (``merger.ui.build_app``) calls ``configure()`` first, as ``app.py`` does."""
from __future__ import annotations

import os


def configure() -> None:
    """Gradio sends no usage statistics (nothing leaves the machine unasked); a value the user set stays."""
    os.environ.setdefault("GRADIO_ANALYTICS_ENABLED", "False")
