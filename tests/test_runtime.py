"""``import merger`` changes nothing in the process: no environment variable, no thread, no torch or
BLAS thread count, no allocator setting (glibc's mallopt); the app and the command line make their
settings at start-up (merger/runtime.py). Checked in a fresh interpreter."""
import json
import os
import subprocess
import sys

CHECK = r"""
import ctypes, ctypes.util, json, os, threading
import torch

class MallInfo2(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks",
                                                "fsmblks", "uordblks", "fordblks", "keepcost")]

def large_allocations_are_mapped():
    # glibc serves an allocation of 64 MB from mmap unless mallopt (M_MMAP_MAX = 0) turned that off
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c"))
        info = libc.mallinfo2
    except (OSError, AttributeError, TypeError):
        return None  # not glibc: nothing of this kind to change
    info.restype = MallInfo2
    libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
    libc.free.argtypes = [ctypes.c_void_p]
    before = info().hblks
    block = libc.malloc(64 << 20)
    mapped = info().hblks > before
    libc.free(block)
    return mapped

def state():
    return {"env": dict(os.environ), "threads": sorted(t.name for t in threading.enumerate()),
            "torch": [torch.get_num_threads(), torch.get_num_interop_threads()],
            "mapped": large_allocations_are_mapped()}

before = state()
import merger, merger.accel, merger.methods, merger.runtime
after = state()
print(json.dumps({"before": before, "after": after, "scipy": "scipy" in __import__("sys").modules}))
"""


def test_import_merger_changes_nothing_in_the_process():
    env = {k: v for k, v in os.environ.items() if k != "GRADIO_ANALYTICS_ENABLED"}
    out = subprocess.run([sys.executable, "-c", CHECK], capture_output=True, text=True, env=env, timeout=300)
    assert out.returncode == 0, out.stderr
    seen = json.loads(out.stdout.strip().splitlines()[-1])
    before, after = seen["before"], seen["after"]
    assert after["env"] == before["env"]
    assert after["threads"] == before["threads"]
    assert after["torch"] == before["torch"]
    assert after["mapped"] == before["mapped"]
    assert before["mapped"] in (True, None)  # glibc maps a large block unless told otherwise
    assert not seen["scipy"]  # nothing loads SciPy's own BLAS behind the user's back


def test_the_command_line_makes_its_settings_at_start_up():
    env = {k: v for k, v in os.environ.items() if k != "GRADIO_ANALYTICS_ENABLED"}
    code = ("import os, sys; from merger.cli import main; code = main(['methods']); "
            "print('GRADIO_ANALYTICS_ENABLED=' + os.environ.get('GRADIO_ANALYTICS_ENABLED', '-'), file=sys.stderr)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert out.returncode == 0, out.stderr
    assert "GRADIO_ANALYTICS_ENABLED=False" in out.stderr
