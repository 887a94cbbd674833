"""merger/allocator.py: a freed Δ's memory serves the next one without fresh page faults."""
import os
import subprocess
import sys

REUSE = """
import resource
import merger, torch
from merger import allocator
blocks = [torch.ones(2_400_000) for _ in range(40)]  # 40 tensors of 9.6 MB: a ViT-B/32 Δ's largest
del blocks
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
blocks = [torch.ones(2_400_000) for _ in range(40)]
print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before, allocator.configure())
"""


def faults_of_a_second_allocation(malloc: str) -> tuple[int, str]:
    env = {**os.environ, "MERGER_MALLOC": malloc, "HF_HUB_OFFLINE": "1"}
    out = subprocess.run([sys.executable, "-c", REUSE], env=env, capture_output=True, text=True, check=True)
    faults, took = out.stdout.split()
    return int(faults), took


def test_freed_memory_is_reused_without_faulting_pages_in():
    kept, took = faults_of_a_second_allocation("")
    system, opted_out = faults_of_a_second_allocation("system")
    if sys.platform != "linux" or took != "True":
        return  # not glibc: nothing was set, nothing to compare
    assert opted_out == "False"
    assert system > 50_000  # glibc's default: 384 MB handed back and faulted in again, 4 KB at a time
    assert kept < system / 20
