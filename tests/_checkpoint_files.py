"""Checkpoint files written by hand from the documented format, bypassing save_checkpoint's checks
(non-finite weights, an attacker's payload) the way someone else's tool could."""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any

from rl_replay.rundir import safe_tree


def write_format2(state: dict[str, Any], path: Path) -> None:
    """``RLREPLAY-CHECKPOINT 2 sha256=... size=...`` + the safetensors tree, with nothing checked."""
    data = safe_tree.dumps(state)
    path.write_bytes(
        f"RLREPLAY-CHECKPOINT 2 sha256={hashlib.sha256(data).hexdigest()} size={len(data)}\n".encode() + data
    )


def write_headed_pickle(obj: Any, path: Path) -> None:
    """A format-1 file: the old header over a ``torch.save`` pickle (checksum recomputed)."""
    import io

    import torch

    buffer = io.BytesIO()
    torch.save(obj, buffer)
    body = buffer.getvalue()
    path.write_bytes(
        f"RLREPLAY-CHECKPOINT 1 sha256={hashlib.sha256(body).hexdigest()} size={len(body)}\n".encode() + body
    )
