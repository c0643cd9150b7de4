"""`fix_mmap_threshold` reaches glibc's mallopt on this platform: large frees go back, the heap's top stays."""

from __future__ import annotations

import ctypes.util
import subprocess
import sys

import pytest

from specwire.heap import fix_mmap_threshold


@pytest.mark.skipif(not ctypes.util.find_library("c"), reason="no C library to load")
def test_large_frees_go_back_to_the_system():
    # In a child process: the setting is process-wide. After freeing a 16 MB block and allocating
    # 2 MB blocks, glibc's adjusted threshold would serve them from the heap; a fixed 1 MiB threshold
    # keeps mmap-ing them, so the resident size falls back once they are freed.
    code = """
import torch
from specwire.heap import fix_mmap_threshold
assert fix_mmap_threshold()
def rss():
    return int(next(l for l in open('/proc/self/status') if l.startswith('VmRSS')).split()[1])
big = torch.ones(4 * 2**20); del big  # 16 MB
base = rss()
blocks, small = [], []
for _ in range(100):  # 100 x 2 MB, each followed by a small live tensor (so the heap cannot shrink)
    blocks.append(torch.ones(2**19))
    small.append(torch.ones(64))
del blocks
print(rss() - base)
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert int(out.stdout.strip()) < 20_000, out.stdout  # KiB: the 200 MB went back (without: ~205 000)


@pytest.mark.skipif(not ctypes.util.find_library("c"), reason="no C library to load")
def test_freed_activations_are_reused_without_page_faults():
    # A forward's activations (here 16 blocks of 900 KB, under the mmap threshold) are freed at its
    # end. With the trim threshold at its 128 KiB default the heap's top went back to the system every
    # time and the next forward faulted all its pages in again (~35 000 faults over 10 forwards here).
    code = """
import ctypes, ctypes.util, resource
from specwire.heap import fix_mmap_threshold
assert fix_mmap_threshold()
libc = ctypes.CDLL(ctypes.util.find_library("c"))
libc.malloc.restype, libc.malloc.argtypes, libc.free.argtypes = ctypes.c_void_p, [ctypes.c_size_t], [ctypes.c_void_p]
def forward():
    blocks = [libc.malloc(900_000) for _ in range(16)]
    for block in blocks:
        ctypes.memset(block, 1, 900_000)
    for block in reversed(blocks):
        libc.free(block)
forward()
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(10):
    forward()
print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert int(out.stdout.strip()) < 1_000, out.stdout  # minor page faults over 10 forwards


def test_is_callable_in_process():
    assert fix_mmap_threshold() in (True, False)
