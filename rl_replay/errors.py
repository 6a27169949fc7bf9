"""Every error type rl_replay raises, importable from one place.

The trainer side's errors are defined here; the engine's own
(:class:`~rl_replay.engine.ReplayError`) lives in :mod:`rl_replay.engine.errors`, since the
engine does not import the trainer side, and is re-exported here.

The command-line entry points (:mod:`rl_replay.run.cli`) print each of them as one line and
exit with the code the table in docs/operations.md gives for it.
"""

from __future__ import annotations

import errno
import os
import reprlib
import signal

from rl_replay.engine.errors import ReplayError

__all__ = [
    "ReplayError",
    "SetupError",
    "RunDirError",
    "CheckpointError",
    "NonFiniteError",
    "RunWriteError",
    "EnvStepError",
    "TrainingInterrupted",
    "one_line",
    "shown",
]

# Bidirectional-text controls reorder what a terminal shows (U+202E turns text around).
_BIDI = {*range(0x202A, 0x202F), *range(0x2066, 0x206A)}


def one_line(text: str) -> str:
    """``text`` with control characters escaped (``\\n``, ``\\x1b``...): one line that a
    terminal prints as it is. Text from a run directory can carry escape sequences that
    would recolour, retitle or overwrite the user's terminal."""
    out = []
    for ch in text:
        code = ord(ch)
        if code < 0x20 or 0x7F <= code < 0xA0 or code in _BIDI:
            out.append(ch.encode("unicode_escape").decode("ascii") if code < 0x100 else f"\\u{code:04x}")
        else:
            out.append(ch)
    return "".join(out)


_REPR = reprlib.Repr()
_REPR.maxlevel, _REPR.maxdict, _REPR.maxlist, _REPR.maxtuple = 3, 6, 6, 6
_REPR.maxstring, _REPR.maxother, _REPR.maxlong = 80, 80, 40
_SHOWN_MAX = 240


def shown(value: object) -> str:
    """``repr(value)`` shortened and on one line, for error messages that quote foreign values.

    Bounded whatever ``value`` is: a nested structure that shares its parts (a YAML alias bomb)
    is cut at a few levels and items instead of being expanded.
    """
    text = one_line(_REPR.repr(value))
    return text if len(text) <= _SHOWN_MAX else text[: _SHOWN_MAX - 3] + "..."


class SetupError(ValueError):
    """A run cannot start as configured (unknown env id, agent path, action space...).

    Raised before anything is written to disk; scripts print it as one line.
    """


class RunDirError(SetupError):
    """The run directory cannot be used as asked (not empty, or in use by another process).

    Raised by :mod:`rl_replay.rundir.lock`.
    """


class CheckpointError(SetupError):
    """A checkpoint file is missing, empty, truncated, corrupt, or would hold non-finite weights.

    Raised by :mod:`rl_replay.rundir.checkpoint` and :mod:`rl_replay.rundir.env_state_file`.
    """


class NonFiniteError(RuntimeError):
    """Training produced (or an environment returned) NaN or infinity; the message is one line.

    Raised by the guards of :mod:`rl_replay.guards` and by the collector.
    """


class EnvStepError(RuntimeError):
    """An environment or one of its wrappers raised while it was stepped; the message is one line
    naming the env and the innermost wrapper the exception passed through.

    Raised by the collector and by evaluation (:func:`rl_replay.rollout.environment.step_envs`).
    """


class RunWriteError(RuntimeError):
    """Writing the run directory failed (disk full, read-only file system, quota, I/O error).

    Raised by :class:`rl_replay.run.trainer.Trainer` for the ``OSError`` of a checkpoint or
    metrics write; the message names the file, the reason and the last good checkpoint
    (a failed checkpoint write never replaces it).
    """

    def __init__(self, exc: OSError, path: str | os.PathLike, last_checkpoint: str | None, run_dir: str) -> None:
        self.path = exc.filename or os.fspath(path)  # a failed write() does not name its file
        if not os.path.isabs(self.path):  # a name within the run directory (written through its descriptor)
            self.path = os.path.join(run_dir, self.path)
        code = errno.errorcode.get(exc.errno or 0)
        reason = f"{exc.strerror or exc}{f' ({code})' if code else ''}"
        kept = f"the last good checkpoint is {last_checkpoint}" if last_checkpoint else "no checkpoint was written yet"
        super().__init__(
            f"cannot write {self.path}: {reason}; {kept}. Free space or make the file system writable, "
            f"then continue with --resume {run_dir}"
        )


class TrainingInterrupted(Exception):
    """Training stopped on a signal after writing a checkpoint.

    Raised by :meth:`rl_replay.run.trainer.Trainer.train` (see :mod:`rl_replay.run.interrupt`).
    ``exit_code`` is the shell's convention, 128 + signal number (130 SIGINT, 143 SIGTERM, 138
    SIGUSR1, 140 SIGUSR2).
    """

    def __init__(self, signum: int, update: int, checkpoint: str | None, run_dir: str) -> None:
        self.signum, self.update, self.checkpoint, self.run_dir = signum, update, checkpoint, run_dir
        self.exit_code = 128 + signum
        super().__init__(
            f"stopped by {signal.Signals(signum).name} after update {update}; checkpoint {checkpoint} written."
        )
