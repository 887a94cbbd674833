"""The Gradio app: layout and callbacks only (no merging math, no plotting math)."""
from .app import build_app

__all__ = ["build_app"]
