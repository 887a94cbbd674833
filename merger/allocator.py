"""Keep freed memory in the process for the next slider move (glibc; a no-op elsewhere).

A slider move on a real pool allocates a few hundred MB: one fp32 Δ of ViT-B/32 is 0.35 GB, and
a TIES or DARE move derives another. By default glibc hands a freed block of more than a few MB
back to the kernel, and the next move faults fresh pages in. On a VM, where the host backs guest
pages lazily, that is dear: on the 2-core machine of issue 18, 1.5 s per GB once the process has
grown past its first few GB, against 0.06 s to rewrite memory it holds (``python -m merger bench
merge`` prints the GB each move faulted in). Here glibc serves every allocation from its one main
heap (no per-thread arenas, no mmap'd blocks) and never trims it: a move's Δ reuses the memory of
the Δ it replaced (``Merges.delta`` drops that one first). The price: the resident size stays at
its high-water mark, as with most allocators that cache.

Transparent huge pages (torch's THP_MEM_ALLOC_ENABLE=1) made a fresh GB 16× cheaper to touch
here but moves slower and noisier (direct compaction in the fault path), so they are left to the
user. MERGER_MALLOC=system keeps glibc's defaults."""
from __future__ import annotations

import ctypes
import ctypes.util
import os

_M_TRIM_THRESHOLD, _M_MMAP_MAX, _M_ARENA_MAX = -1, -4, -8
_NEVER = -1  # mallopt takes an int; glibc reads the threshold as a size_t, so -1 is "never trim"
_STATE = {"kept": False}


def _libc():
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c"))
        libc.gnu_get_libc_version  # glibc only: musl and macOS have other knobs
        return libc
    except (OSError, AttributeError, TypeError):
        return None


def configure() -> bool:
    """One main heap that keeps what is freed; True when glibc took the settings. Call before
    threads allocate (a thread's arena is chosen at its first allocation)."""
    libc = None if os.environ.get("MERGER_MALLOC", "").lower() == "system" else _libc()
    if libc is None:
        return False
    mallopt = libc.mallopt
    mallopt.argtypes, mallopt.restype = (ctypes.c_int, ctypes.c_int), ctypes.c_int
    _STATE["kept"] = all(mallopt(opt, value) == 1 for opt, value in
                         ((_M_ARENA_MAX, 1), (_M_MMAP_MAX, 0), (_M_TRIM_THRESHOLD, _NEVER)))
    return _STATE["kept"]


def reserve(sizes: list[int]) -> int:
    """Allocate and touch blocks of these sizes, then free them: the moves after a preparation then
    find that memory in the heap, in blocks the size of theirs (a preparation shows progress; a move
    should be live). Memory the heap holds already is only rewritten (0.1 s per GB here); a
    fragmented heap grows. Only where the heap keeps what is freed (``configure``). Returns the
    bytes touched."""
    if not _STATE["kept"]:
        return 0
    import torch

    blocks = [torch.empty(n, dtype=torch.uint8) for n in sizes]
    for block in blocks:
        block.fill_(0)  # any page fault happens here
    return sum(sizes)
