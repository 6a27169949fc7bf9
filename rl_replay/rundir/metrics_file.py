"""A run's ``metrics.jsonl`` read back, and the mark of what wandb was sent: one row per update,
read as a stream, each line bounded, a line cut short by a kill skipped.

:class:`rl_replay.run.logger.RunLogger` writes them; resume, evaluate and the tools read them here.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from typing import Any

from rl_replay.errors import RunDirError, shown
from rl_replay.rundir import files

__all__ = [
    "METRICS_NAME",
    "WANDB_MARK_NAME",
    "TENSORBOARD_MARK_NAME",
    "MAX_ROW_BYTES",
    "iter_metrics",
    "read_metrics",
    "truncate_metrics",
    "unsent_wandb_id",
    "read_mark",
    "rows_named",
    "is_count",
]

METRICS_NAME = "metrics.jsonl"
#: Last update handed to wandb (see RunLogger): on resume, rows after it are sent again.
WANDB_MARK_NAME = "wandb_logged.json"
#: Last update written to TensorBoard's event files, for the same reason.
TENSORBOARD_MARK_NAME = "tensorboard_logged.json"
# A metrics row is a few KiB; a longer line is not one (a sparse hole reads as an endless line).
MAX_ROW_BYTES = 1 << 20


def iter_metrics(where: files.Dir | str | os.PathLike, notes: list[str] | None = None) -> Iterator[dict[str, Any]]:
    """The rows of a ``metrics.jsonl`` (a run directory, held or by path, or the file), read as a stream.

    A line that is not JSON (the last one cut short by a kill) is skipped; ``notes`` gets one line
    saying so. Raises :class:`~rl_replay.errors.RunDirError` (one line) for a row that is JSON but
    not a metrics row, and :class:`~rl_replay.rundir.files.UnsafeFileError` for a file that is not
    a regular file (a link included) or holds a line longer than a row can be.
    """
    with files.located(where, METRICS_NAME) as (d, name, _):
        for _, record in _rows(d, name, notes):
            yield record


def _rows(d: files.Dir, name: str, notes: list[str] | None = None) -> Iterator[tuple[bytes, dict[str, Any]]]:
    """``(line, row)`` of each row of :func:`iter_metrics`."""
    if not d.exists(name):
        return
    path = d.shown(name)
    for number, line in d.iter_lines(name, "metrics file", max_line=MAX_ROW_BYTES):
        try:
            record = json.loads(line)
        except (ValueError, RecursionError):
            if notes is not None:
                notes.append(f"note: {path} line {number} is not a whole row (cut short by a kill?); skipped.")
            continue
        if not (isinstance(record, dict) and is_count(record.get("update")) and is_count(record.get("env_steps", 0))):
            raise RunDirError(
                f"metrics file {path} line {number} is not a metrics row (a JSON object with an integer 'update' and "
                f"'env_steps'): {shown(record)}. Remove that line (or the file) to use the run."
            )
        yield line, record


def rows_named(d: files.Dir, name: str, notes: list[str] | None = None) -> Iterator[dict[str, Any]]:
    """The rows of the metrics file ``name`` in the held directory ``d`` (see :func:`iter_metrics`)."""
    for _, record in _rows(d, name, notes):
        yield record


def is_count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def read_metrics(where: files.Dir | str | os.PathLike, notes: list[str] | None = None) -> list[dict[str, Any]]:
    """The rows of a ``metrics.jsonl``: :func:`iter_metrics` as a list."""
    return list(iter_metrics(where, notes))


def read_mark(where: files.Dir | str | os.PathLike, name: str = WANDB_MARK_NAME) -> dict[str, Any]:
    """The wandb mark of a run (``{"update", "wandb_id"}``; or the TensorBoard mark ``name``,
    ``{"update"}``), or ``{}`` if it has none that reads."""
    try:
        with files.held(where) as d:
            mark = json.loads(d.read_regular(name, "logging mark", limit=4096))
    except (OSError, ValueError, RecursionError):
        return {}
    return mark if isinstance(mark, dict) else {}


def unsent_wandb_id(d: files.Dir | str | os.PathLike) -> str | None:
    """The wandb id of the run in ``d`` that never sent a row (None if there is none).

    A run restarted from update 0 (stopped before its first checkpoint) continues that
    wandb run instead of leaving an empty one beside a new one.
    """
    mark = read_mark(d)
    wandb_id = mark.get("wandb_id")
    ok = isinstance(wandb_id, str) and wandb_id.isalnum() and len(wandb_id) <= 64
    return wandb_id if ok and mark.get("update") == 0 else None


def truncate_metrics(where: files.Dir | str | os.PathLike, last_update: int) -> None:
    """Drop lines logged after ``last_update`` (written by a run killed after its checkpoint).

    ``where`` is a held run directory, or the path of a run directory or of its metrics file.
    The kept rows go to a new file that replaces the old one (a symlink in its place is
    replaced, not written through).
    """
    with files.located(where, METRICS_NAME) as (d, name, _):
        if not d.exists(name):
            return
        fd, tmp = d.create_exclusive(name)
        try:
            with os.fdopen(fd, "w", encoding="utf-8") as out:
                for line, record in _rows(d, name):
                    if record["update"] <= last_update:
                        out.write(line.decode("utf-8", errors="replace") + "\n")
                out.flush()
                os.fsync(out.fileno())
            d.replace(tmp, name)
        except BaseException:
            d.unlink(tmp, missing_ok=True)
            raise
