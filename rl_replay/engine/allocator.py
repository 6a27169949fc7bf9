"""Process-wide CPU allocator setting that replay-heavy training benefits from."""

from __future__ import annotations

import ctypes
import sys

__all__ = ["keep_freed_memory"]

# glibc's mallopt parameters (malloc.h).
_M_TRIM_THRESHOLD, _M_TOP_PAD, _M_MMAP_THRESHOLD = -1, -2, -3


def keep_freed_memory(threshold_bytes: int = 1 << 30, top_pad_bytes: int = 256 << 20) -> bool:
    """Ask glibc to keep freed memory in the heap instead of returning it to the OS.

    Every replay block's backward allocates fresh parameter-sized gradient buffers and
    frees them when it is done. With glibc's defaults large buffers are mmapped and
    unmapped each time, and the next block faults the same pages in again: for a
    12.7M-parameter policy that made the replayed backward ~1.5x slower (see
    docs/benchmarks.md). Raising the mmap and trim thresholds lets blocks reuse the
    memory. The cost: peak RSS stays at its high-water mark.

    Returns True if the settings were applied (Linux with glibc), False otherwise.
    """
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL("libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):  # musl or another libc: leave it alone
        return False
    return all(
        mallopt(param, value) == 1
        for param, value in (
            (_M_MMAP_THRESHOLD, threshold_bytes),
            (_M_TRIM_THRESHOLD, threshold_bytes),
            (_M_TOP_PAD, top_pad_bytes),
        )
    )
