"""Read an offline wandb run back from its ``run-<id>.wandb`` file (for the tests).

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

_BLOCK = 32 * 1024
_FULL, _FIRST, _MIDDLE, _LAST = 1, 2, 3, 4


def _records(path: Path):
    from wandb.proto import wandb_internal_pb2 as pb

    data = path.read_bytes()
    assert data[:4] == b":W&B", path
    pos, pending = 7, b""
    while pos + 7 <= len(data):
        left = _BLOCK - pos % _BLOCK
        if left < 7:  # block trailer padding
            pos += left
            continue
        _, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        pos += 7
        chunk, pos = data[pos:pos + length], pos + length
        if kind == 0:
            break
        if kind == _FULL:
            yield pb.Record.FromString(chunk)
        elif kind == _FIRST:
            pending = chunk
        elif kind == _MIDDLE:
            pending += chunk
        elif kind == _LAST:
            yield pb.Record.FromString(pending + chunk)
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
    (path,) = run_dir.glob("run-*.wandb")
    deadline = time.monotonic() + wait
    while True:
        try:
            records = list(_records(path))
        except Exception:  # a record cut short while being written
            records = []
        if any(r.WhichOneof("record_type") == "exit" for r in records) or time.monotonic() > deadline:
            break
        time.sleep(0.25)
    out: dict[str, Any] = {"config": {}, "summary": {}, "history": [], "metrics": [],
                           "complete": any(r.WhichOneof("record_type") == "exit" for r in records)}
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
