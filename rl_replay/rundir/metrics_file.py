"""A run's ``metrics.jsonl`` read back, and the mark of what wandb was sent: one row per update,
read as a stream, each line bounded, a line cut short by a kill skipped.

:class:`rl_replay.run.logger.RunLogger` writes them; resume, evaluate and the tools read them here.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from rl_replay.errors import RunDirError, shown
from rl_replay.rundir import files

__all__ = [
    "METRICS_NAME",
    "WANDB_MARK_NAME",
    "MAX_ROW_BYTES",
    "iter_metrics",
    "read_metrics",
    "truncate_metrics",
    "unsent_wandb_id",
    "read_mark",
    "is_count",
]

METRICS_NAME = "metrics.jsonl"
#: Last update handed to wandb (see RunLogger): on resume, rows after it are sent again.
WANDB_MARK_NAME = "wandb_logged.json"
# A metrics row is a few KiB; a longer line is not one (a sparse hole reads as an endless line).
MAX_ROW_BYTES = 1 << 20


def iter_metrics(path: str | os.PathLike) -> Iterator[dict[str, Any]]:
    """The rows of a ``metrics.jsonl`` (a run directory or the file), read as a stream.

    A line that is not JSON (one cut short by a kill) is skipped. Raises
    :class:`~rl_replay.errors.RunDirError` (one line) for a row that is JSON but not a metrics
    row, and :class:`~rl_replay.rundir.files.UnsafeFileError` for a file that is not a regular file
    or holds a line longer than a row can be.
    """
    for _, record in _rows(Path(path)):
        yield record


def _rows(path: Path) -> Iterator[tuple[bytes, dict[str, Any]]]:
    """``(line, row)`` of each row of :func:`iter_metrics`."""
    if path.is_dir():
        path = path / METRICS_NAME
    if not os.path.lexists(path):
        return
    for number, line in files.iter_lines(path, "metrics file", max_line=MAX_ROW_BYTES):
        try:
            record = json.loads(line)
        except (ValueError, RecursionError):
            continue  # a line cut short by a kill
        if not (isinstance(record, dict) and is_count(record.get("update")) and is_count(record.get("env_steps", 0))):
            raise RunDirError(
                f"metrics file {path} line {number} is not a metrics row (a JSON object with an integer 'update' and "
                f"'env_steps'): {shown(record)}. Remove that line (or the file) to use the run."
            )
        yield line, record


def is_count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def read_metrics(path: str | os.PathLike) -> list[dict[str, Any]]:
    """The rows of a ``metrics.jsonl`` (a run directory or the file): :func:`iter_metrics` as a list."""
    return list(iter_metrics(path))


def read_mark(run_dir: str | os.PathLike) -> dict[str, Any]:
    """The wandb mark of a run (``{"update", "wandb_id"}``), or ``{}`` if it has none that reads."""
    try:
        mark = json.loads(files.read_regular(Path(run_dir) / WANDB_MARK_NAME, "wandb mark", limit=4096))
    except (OSError, ValueError, RecursionError):
        return {}
    return mark if isinstance(mark, dict) else {}


def unsent_wandb_id(run_dir: str | os.PathLike) -> str | None:
    """The wandb id of a run in ``run_dir`` that never sent a row (None if there is none).

    A run restarted from update 0 (stopped before its first checkpoint) continues that
    wandb run instead of leaving an empty one beside a new one.
    """
    mark = read_mark(run_dir)
    wandb_id = mark.get("wandb_id")
    ok = isinstance(wandb_id, str) and wandb_id.isalnum() and len(wandb_id) <= 64
    return wandb_id if ok and mark.get("update") == 0 else None


def truncate_metrics(path: str | os.PathLike, last_update: int) -> None:
    """Drop lines logged after ``last_update`` (written by a run killed after its checkpoint).

    The kept rows go to a new file that replaces the old one (a symlink in its place is
    replaced, not written through).
    """
    path = Path(path)
    if not os.path.lexists(path):
        return
    fd, tmp = files.create_exclusive(path.parent, path.name)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as out:
            for line, record in _rows(path):
                if record["update"] <= last_update:
                    out.write(line.decode("utf-8", errors="replace") + "\n")
            out.flush()
            os.fsync(out.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.lexists(tmp):
            os.unlink(tmp)
        raise
