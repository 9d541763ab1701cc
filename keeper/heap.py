"""The C allocator, where a keeper's memory goes back to the OS (glibc; no-ops elsewhere).

A keeper holds a few large buffers that grow while it loads (the key arena, the slot
records, the index) among many small objects that come and go. glibc serves a
request under its mmap threshold from the heap, and that threshold rises on its own
(up to 32 MiB) as large blocks are freed, so a growing buffer ends up reallocated
inside the heap, leaving holes the small objects then pin: resident memory the
process can no longer use or return.
"""

from __future__ import annotations

import ctypes
import functools

M_MMAP_THRESHOLD = -3  # mallopt's parameter number (malloc.h)
LARGE_BLOCK_BYTES = 256 * 1024


@functools.cache
def _libc() -> ctypes.CDLL:
    return ctypes.CDLL(None)


def map_large_blocks(threshold: int = LARGE_BLOCK_BYTES) -> bool:
    """Serve every block of `threshold` bytes or more with its own mapping, fixed: a
    growing buffer is remapped rather than copied within the heap, and a freed one goes
    straight back to the OS. True when the allocator took the setting."""
    mallopt = getattr(_libc(), "mallopt", None)
    return mallopt is not None and bool(mallopt(M_MMAP_THRESHOLD, threshold))


def trim() -> None:
    """Return the heap's free pages to the OS: glibc gives back only the heap's top on
    free, and what a load freed below its live objects stays resident without this."""
    malloc_trim = getattr(_libc(), "malloc_trim", None)
    if malloc_trim is not None:
        malloc_trim(0)
