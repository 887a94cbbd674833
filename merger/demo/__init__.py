"""The built-in demo world: a synthetic multi-task image world and its tiny CLIP zoo."""
