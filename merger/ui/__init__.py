"""The Gradio app: layout and callbacks only (no merging math, no plotting math)."""
from merger.ui.app import build_app
from merger.ui.ranged import name_out_of_range_values

name_out_of_range_values()

__all__ = ["build_app"]
