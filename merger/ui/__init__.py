"""The Gradio app: layout and callbacks only (no merging math, no plotting math)."""
from merger.ui.app import build_app

__all__ = ["build_app"]
