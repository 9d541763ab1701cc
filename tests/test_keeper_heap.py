"""The allocator settings a worker makes (keeper.heap), seen through glibc's own counts;
the child also trims, as the keeper does once it has loaded."""

from __future__ import annotations

import ctypes
import subprocess
import sys

import pytest

# In a child: the setting is process-wide and lasts. A freed 4 MiB block raises glibc's
# own threshold to 4 MiB, after which 512 KiB blocks come from the heap, unless the
# threshold is fixed; `hblks` counts the blocks that have a mapping of their own.
CHILD = """
import ctypes, sys
from keeper import heap
class Info(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in (
        "arena ordblks smblks hblks hblkhd usmblks fsmblks uordblks fordblks keepcost"
    ).split()]
libc = ctypes.CDLL(None)
libc.mallinfo2.restype = Info
fixed = sys.argv[1] == "fixed" and heap.map_large_blocks()
big = bytearray(4 << 20)
del big
before = libc.mallinfo2().hblks
blocks = [bytearray(512 << 10) for _ in range(4)]
print(int(fixed), libc.mallinfo2().hblks - before)
heap.trim()
"""


def mapped_blocks(mode: str) -> tuple[int, int]:
    done = subprocess.run(
        [sys.executable, "-c", CHILD, mode], capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr
    fixed, mapped = done.stdout.split()
    return int(fixed), int(mapped)


def test_with_the_threshold_fixed_large_blocks_keep_mappings_of_their_own() -> None:
    if not hasattr(ctypes.CDLL(None), "mallinfo2"):
        pytest.skip("not glibc 2.33 or later: no mallinfo2 to count mapped blocks")
    assert mapped_blocks("fixed") == (1, 4)
    assert mapped_blocks("default") == (0, 0)  # the threshold rose: all four in the heap
