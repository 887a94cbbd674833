"""Files the app offers for download, in a folder only this user can read."""
from __future__ import annotations

import shutil
import tempfile
import uuid
import weakref
from pathlib import Path


class Downloads:
    """Files offered for download (exports, the history's CSV), each in a fresh folder under this app's
    own temporary folder (mkdtemp: only this user can read or write it). Gradio copies a file into
    its cache when the callback returns, so only the newest KEEP are kept here; the folder goes with
    the app (Gradio's copies go with its ``delete_cache``)."""

    KEEP = 2

    def __init__(self):
        self.root = Path(tempfile.mkdtemp(prefix="merger-downloads-"))
        self._remove = weakref.finalize(self, shutil.rmtree, self.root, True)

    def fresh(self, name: str) -> Path:
        """A path named ``name`` in a new folder, the older folders beyond the newest KEEP deleted."""
        folders = sorted((p for p in self.root.iterdir() if p.is_dir() and not p.is_symlink()),
                         key=lambda p: p.stat().st_mtime)
        for old in folders[:max(0, len(folders) - self.KEEP + 1)]:
            shutil.rmtree(old, ignore_errors=True)
        folder = self.root / uuid.uuid4().hex
        folder.mkdir()
        return folder / name
