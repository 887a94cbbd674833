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


RESERVED = """
import resource
import merger, torch
from merger import allocator
sizes = [9_600_000] * 40
touched = allocator.reserve(sizes)
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
blocks = [torch.empty(n // 4).fill_(1) for n in sizes]  # what the moves after a preparation allocate
print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before, touched)
"""


def test_a_reserve_is_what_the_next_moves_allocate_without_faults():
    env = {**os.environ, "MERGER_MALLOC": "", "HF_HUB_OFFLINE": "1"}
    out = subprocess.run([sys.executable, "-c", RESERVED], env=env, capture_output=True, text=True, check=True)
    faults, touched = map(int, out.stdout.split())
    if touched == 0:
        return  # not glibc: no reserve is made
    assert touched == 40 * 9_600_000
    assert faults < 9_400  # a tenth of 384 MB in 4 KB pages (94 000 faults)


def test_a_large_pool_reserves_what_its_moves_keep_with_the_preparation(tmp_path):
    """Merges touches (derived states kept + Δs kept) × one fp32 Δ after a preparation whose moves
    derive, on a pool above its inline size; nothing for a method without a derive step."""
    from helpers import ui_controller

    from merger import allocator

    session = ui_controller(tmp_path).session
    merges = session.merges
    merges.inline_entries = 0  # this small pool counts as large
    merges.delta(session.spec("task_arithmetic", lam=0.3))
    assert merges.counts["reserved bytes"] == 0
    merges.delta(session.spec("ties", lam=0.3, sparsity=0.5))
    one_delta = 4 * session.pool.task_vectors.numel()
    expected = (merges._derived_size() + merges.delta_size) * one_delta if allocator._STATE["kept"] else 0
    assert merges.counts["reserved bytes"] == expected
