"""Stop a run cleanly on SIGINT, SIGTERM, SIGUSR1 or SIGUSR2: finish the update, checkpoint, exit non-zero.

:class:`StopOnSignal` installs handlers for the duration of training (main thread only).
The first of those signals only sets a flag and restores the default handlers, so a
second one kills the process at once. SIGUSR1 / SIGUSR2 are what cluster schedulers send
ahead of a pre-emption or a time limit (Slurm's ``--signal=USR1@90``); the exit code,
128 + the signal's number, tells the job script to requeue (docs/operations.md). The trainer asks :meth:`StopOnSignal.requested`
once per update; under torchrun the flag is all-reduced there, so every rank stops at
the same update even if only one of them received the signal. The trainer then raises
:class:`~rl_replay.errors.TrainingInterrupted`.
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading

import torch

__all__ = ["StopOnSignal", "children_ignore_sigint"]

SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGUSR1, signal.SIGUSR2)


class StopOnSignal:
    """Context manager: remembers the first SIGINT, SIGTERM, SIGUSR1 or SIGUSR2 instead of dying on it."""

    def __init__(self, *, announce: bool = True) -> None:
        self.signum = 0
        self._announce = announce
        self._previous: dict[int, object] = {}

    def _on_signal(self, signum, frame) -> None:  # noqa: ARG002
        self.signum = signum
        for s in SIGNALS:  # a second signal takes the default action: exit at once
            signal.signal(s, signal.SIG_DFL)
        if self._announce:
            # os.write: print() from a handler can re-enter a stream the main code is writing.
            os.write(
                2,
                f"\nreceived {signal.Signals(signum).name}: finishing this update, then writing a "
                "checkpoint (send it again to exit at once)\n".encode(),
            )

    def __enter__(self) -> StopOnSignal:
        if threading.current_thread() is threading.main_thread():
            for s in SIGNALS:
                self._previous[s] = signal.signal(s, self._on_signal)
        return self

    def __exit__(self, *exc) -> None:
        for s, handler in self._previous.items():
            signal.signal(s, handler)  # type: ignore[arg-type]
        self._previous.clear()

    def requested(self, info=None, device: torch.device | None = None) -> int:
        """The signal to stop on (0 = keep going); agreed over all ranks under torchrun."""
        if info is None or not info.distributed:
            return self.signum
        import torch.distributed as dist

        flag = torch.tensor([self.signum], dtype=torch.int64, device=device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return int(flag.item())


@contextlib.contextmanager
def children_ignore_sigint():
    """Processes started inside (async vector env workers) ignore SIGINT.

    Ctrl-C in a terminal signals the whole process group. A worker that died of it would
    break the env under the trainer before it can finish the update; ignoring it there
    leaves the stop to the trainer, which closes the envs. (An ignored SIGINT is inherited
    across fork and exec, and Python then installs no KeyboardInterrupt handler.)
    """
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)
