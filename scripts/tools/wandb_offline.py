"""Read offline wandb runs back from their ``run-<id>.wandb`` files, without a network (a tool: the
library never imports it; ``wandb sync`` uploads such runs, and ``log.tensorboard`` gives a local
dashboard).

:func:`read_offline_run` reads one ``RUN_DIR/wandb/offline-run-*`` directory;
:func:`training_rows` the rows of a training run over all its fragments (a resumed offline
run writes one fragment per start), what ``wandb sync`` would upload.
``scripts/tools/plot_metrics.py RUN_DIR --source wandb`` shows them; the tests check the logger with them.

wandb 0.31 has no Python reader; the file is a LevelDB-style log (a 7-byte header, then
32 KiB blocks of records, each ``crc32c(4) length(2) type(1) data``) of protobuf
``wandb.proto.wandb_internal_pb2.Record`` messages.
"""

from __future__ import annotations

import json
import struct
import time
from pathlib import Path
from typing import Any

__all__ = ["read_offline_run", "training_rows"]

_BLOCK = 32 * 1024
_FULL, _FIRST, _MIDDLE, _LAST = 1, 2, 3, 4


def _records(path: Path):
    from wandb.proto import wandb_internal_pb2 as pb

    data = path.read_bytes()
    if data[:4] != b":W&B":
        raise ValueError(f"{path} is not a wandb run file")
    pos, pending = 7, b""
    while pos + 7 <= len(data):
        left = _BLOCK - pos % _BLOCK
        if left < 7:  # block trailer padding
            pos += left
            continue
        _, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        pos += 7
        chunk, pos = data[pos : pos + length], pos + length
        if kind == 0:
            break
        if kind == _FULL:
            yield pb.Record.FromString(chunk)  # type: ignore[attr-defined]
        elif kind == _FIRST:
            pending = chunk
        elif kind == _MIDDLE:
            pending += chunk
        elif kind == _LAST:
            yield pb.Record.FromString(pending + chunk)  # type: ignore[attr-defined]
            pending = b""


def _set(target: dict, item) -> None:
    keys = list(item.nested_key) or [item.key]
    node = target
    for k in keys[:-1]:
        node = node.setdefault(k, {})
    node[keys[-1]] = json.loads(item.value_json)


def read_offline_run(run_dir: str | Path, wait: float = 60.0) -> dict[str, Any]:
    """``{"id", "group", "tags", "job_type", "config", "summary", "history", "metrics"}`` of one run.

    wandb's service process writes the file; on a loaded machine it may still be writing
    after ``finish()`` returned, so this waits (up to ``wait`` s) for the final ``exit`` record.
    """
    run_dir = Path(run_dir)
    found = sorted(run_dir.glob("run-*.wandb"))
    if len(found) != 1:
        raise FileNotFoundError(f"no single run-*.wandb file in {run_dir} (found {len(found)})")
    path = found[0]
    deadline = time.monotonic() + wait
    while True:
        try:
            records = list(_records(path))
        except Exception:  # a record cut short while being written
            records = []
        if any(r.WhichOneof("record_type") == "exit" for r in records) or time.monotonic() > deadline:
            break
        time.sleep(0.25)
    out: dict[str, Any] = {
        "config": {},
        "summary": {},
        "history": [],
        "metrics": [],
        "complete": any(r.WhichOneof("record_type") == "exit" for r in records),
    }
    for record in records:
        kind = record.WhichOneof("record_type")
        if kind == "run":
            run = record.run
            out.update(id=run.run_id, group=run.run_group, tags=list(run.tags), job_type=run.job_type)
            for item in run.config.update:
                _set(out["config"], item)
        elif kind == "config":
            for item in record.config.update:
                _set(out["config"], item)
        elif kind == "summary":
            for item in record.summary.update:
                _set(out["summary"], item)
        elif kind == "history":
            row: dict = {}
            for item in record.history.item:
                _set(row, item)
            out["history"].append(row)
        elif kind == "metric":
            out["metrics"].append(record.metric)
    return out


def training_rows(run_dir: str | Path, wait: float = 0.0) -> list[dict[str, Any]]:
    """The history rows of the training run in ``run_dir`` (its ``wandb/offline-run-*``
    fragments of ``job_type`` train, in order of start time), one per update, as wandb got them.

    A fragment cut short by a kill is read as far as it goes (``wait`` seconds for a final
    record, as :func:`read_offline_run`). Rows a later fragment repeats replace the earlier ones.
    """
    fragments = sorted((Path(run_dir) / "wandb").glob("offline-run-*"))  # named offline-run-<time>-<id>
    rows: dict[int, dict[str, Any]] = {}
    for fragment in fragments:
        run = read_offline_run(fragment, wait=wait)
        if run.get("job_type") != "train":
            continue
        for row in run["history"]:
            if "update" in row:
                rows[int(row["update"])] = row
    return [rows[u] for u in sorted(rows)]
