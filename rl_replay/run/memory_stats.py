"""Per-update memory numbers: what one update costs, not the process's lifetime peak.

The trainer calls :func:`begin_update` right before an update and :func:`update_memory`
right after it:

* ``memory/peak_rss_bytes``: the peak resident set size *during this update*. On Linux,
  writing ``5`` to ``/proc/self/clear_refs`` resets the kernel's high-water mark (VmHWM)
  to the current RSS, and ``/proc/self/status`` reports it afterwards. Where that is not
  available the lifetime peak (``ru_maxrss``) is reported instead and
  ``memory/peak_rss_is_lifetime`` is 1.
* ``memory/rss_bytes``: the resident set size after the update.
* ``memory/peak_device_bytes`` / ``memory/device_bytes`` (CUDA only): the peak allocated
  device memory during the update (the peak is reset in :func:`begin_update`) and the
  allocated bytes after it.
"""

from __future__ import annotations

import resource
import sys

import torch

__all__ = ["begin_update", "heap_in_use", "update_memory"]

_STATUS = "/proc/self/status"
_CLEAR_REFS = "/proc/self/clear_refs"
_can_reset: bool | None = None  # decided on the first begin_update()


def _status_kb(*names: str) -> dict[str, int]:
    out = {}
    with open(_STATUS) as fh:
        for line in fh:
            key, _, rest = line.partition(":")
            if key in names:
                out[key] = int(rest.split()[0])
    return out


def _reset_peak_rss(verify: bool) -> bool:
    try:
        with open(_CLEAR_REFS, "w") as fh:
            fh.write("5")
        # Reading /proc/self/status costs ~0.1 ms: check that VmHWM exists once, not every update.
        return "VmHWM" in _status_kb("VmHWM") if verify else True
    except OSError:  # not Linux, or /proc not writable (some sandboxes)
        return False


def _lifetime_peak_bytes() -> float:
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return float(peak if sys.platform == "darwin" else peak * 1024)  # macOS reports bytes


def _current_rss_bytes() -> float:
    try:
        return float(_status_kb("VmRSS")["VmRSS"] * 1024)
    except (OSError, KeyError):
        import psutil

        return float(psutil.Process().memory_info().rss)


def begin_update(device: torch.device | str) -> None:
    """Reset the peak RSS and (on CUDA) the peak allocated device memory."""
    global _can_reset
    ok = _reset_peak_rss(verify=_can_reset is None)
    _can_reset = ok if _can_reset is None else (_can_reset and ok)
    device = torch.device(device)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)


def update_memory(device: torch.device | str) -> dict[str, float]:
    """The memory metrics of the update since :func:`begin_update` (see the module doc)."""
    device = torch.device(device)
    if _can_reset:
        kb = _status_kb("VmRSS", "VmHWM")  # one read of /proc/self/status for both
        out: dict[str, float] = {
            "memory/rss_bytes": float(kb["VmRSS"] * 1024),
            "memory/peak_rss_bytes": float(kb["VmHWM"] * 1024),
        }
    else:
        out = {"memory/rss_bytes": _current_rss_bytes()}
        out["memory/peak_rss_bytes"] = _lifetime_peak_bytes()
        out["memory/peak_rss_is_lifetime"] = 1.0
    if device.type == "cuda":
        out["memory/peak_device_bytes"] = float(torch.cuda.max_memory_allocated(device))
        out["memory/device_bytes"] = float(torch.cuda.memory_allocated(device))
    return out


def heap_in_use() -> int | None:
    """glibc's bytes in use in the main heap (``mallinfo2().uordblks``); None without
    glibc >= 2.33. It sees neither mmapped chunks (the slabs) nor Python's small objects."""
    import ctypes

    class MallInfo2(ctypes.Structure):
        _fields_ = [
            (n, ctypes.c_size_t)
            for n in (
                "arena",
                "ordblks",
                "smblks",
                "hblks",
                "hblkhd",
                "usmblks",
                "fsmblks",
                "uordblks",
                "fordblks",
                "keepcost",
            )
        ]

    try:
        libc = ctypes.CDLL("libc.so.6")
        libc.mallinfo2.restype = MallInfo2
        return int(libc.mallinfo2().uordblks)
    except (OSError, AttributeError):
        return None
