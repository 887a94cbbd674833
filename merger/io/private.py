"""Folders only this user can write, and files read from them without following links or waiting
on a FIFO. What merger keeps between runs (computed entries, zero-shot heads, the secret that signs
them, torch.compile's generated code) is read, and compiled code is loaded, only from such a folder:
anyone else who can write there could hand us their tensors or their code."""
from __future__ import annotations

import os
import stat
from pathlib import Path


def why_not_private(folder: Path, create: bool = True) -> str | None:
    """None when ``folder`` (made with mode 700 if absent and ``create``) is a real folder owned by
    this user that no one else can write, and so is every folder above it (a folder above may be
    root's, or others' with the sticky bit, as /tmp is); else what is wrong, to say."""
    folder = Path(os.path.abspath(folder))
    if create:
        try:
            folder.mkdir(mode=0o700, parents=True, exist_ok=True)
        except OSError as exc:
            return f"cannot be made ({exc.strerror or exc})"
    try:
        st = os.lstat(folder)
    except OSError as exc:
        return f"cannot be read ({exc.strerror or exc})"
    if stat.S_ISLNK(st.st_mode):
        return "is a symbolic link (give the folder it points to)"
    if not stat.S_ISDIR(st.st_mode):
        return "is not a folder"
    if not hasattr(os, "getuid"):  # Windows: a user's folders are private by their ACLs
        return None
    me = os.getuid()
    if st.st_uid != me:
        return f"belongs to another user (uid {st.st_uid})"
    if st.st_mode & 0o022:
        return f"others can write to it (mode {stat.S_IMODE(st.st_mode):o}; chmod go-w {folder})"
    for above in folder.parents:
        try:
            up = os.stat(above)
        except OSError as exc:
            return f"{above} cannot be read ({exc.strerror or exc})"
        if up.st_uid not in (me, 0):
            return f"{above} belongs to another user (uid {up.st_uid})"
        if up.st_mode & 0o002 and not up.st_mode & stat.S_ISVTX:
            return f"anyone can rename it: {above} is writable by all without the sticky bit"
    return None


def is_regular(path: Path) -> bool:
    """A regular file, not a link to one (a link could point anywhere; a FIFO would never end)."""
    try:
        return stat.S_ISREG(os.lstat(path).st_mode)
    except OSError:
        return False


def read_regular(path: Path, limit: int = 1 << 20) -> bytes | None:
    """The bytes of a regular file of at most ``limit`` bytes, else None: a link, a FIFO or a device
    are not followed, read or waited on."""
    flags = os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_BINARY", 0)
    try:
        fd = os.open(path, flags)
    except OSError:
        return None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_size > limit:
            return None
        with os.fdopen(fd, "rb", closefd=False) as fh:
            return fh.read(limit + 1)[:limit]
    except OSError:
        return None
    finally:
        os.close(fd)
