"""Sharded checkpoints: every rank writes its own piece of the weights and optimizer state.

Under FSDP with more than one rank (``checkpoint.sharded``, on by default), rank ``r`` of ``N``
writes ``checkpoint.shard-<r>-of-<N>.pt`` beside ``checkpoint.pt``, all ranks at once, instead of
rank 0 gathering the whole agent and optimizer state. Each shard file has the checkpoint's own
format (header line, sha256, a :mod:`~rl_replay.rundir.safe_tree` payload: numbers only) and holds
*chunks*: a block of rows of one tensor, named by its path in the state tree
(``["agent", "core.weight"]``, ``["optimizer", "state", "core.weight", "exp_avg"]``) with its row
offset. ``checkpoint.pt`` is then the manifest: everything else, plus ``shards``::

    {"world": N,
     "files": [{"file": "checkpoint.shard-0-of-2.pt", "sha256": <payload sha256>, "size": <payload bytes>}, ...],
     "tensors": [{"path": [...], "shape": [...], "dtype": "float32"}, ...]}

Writing (:func:`split`, :func:`save_shard`): the shards first, each atomically with the old file
kept as its previous one (``checkpoint.shard-0-of-2.prev.pt``), then the manifest naming their
hashes. Reading (:func:`assemble`, called by :func:`rl_replay.rundir.checkpoint.load_checkpoint`):
each named file is looked for under its name and its previous name and taken only if its payload's
sha256 is the one named, so a kill between the shards and the manifest never mixes two updates; its
size is checked against the manifest before it is read, and the full tensors are allocated only
once every chunk is read and checked (dtype, bounds, rows covering the tensor exactly once). The
state that comes back is the one a single-file checkpoint holds: full weights and the full
optimizer state, which a resume on any number of ranks loads.
"""

from __future__ import annotations

import hashlib
import math
import re
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from rl_replay.errors import CheckpointError, shown
from rl_replay.rundir import files, safe_tree

__all__ = ["shard_name", "split", "save_shard", "assemble", "SHARD_FORMAT"]

SHARD_FORMAT = "rl_replay-checkpoint-shard-2"
_NAME = re.compile(r"checkpoint\.shard-(\d{1,6})-of-(\d{1,6})\.pt")
_HEX = re.compile(r"[0-9a-f]{64}")
#: The dtypes a sharded tensor may have (what agents and optimizers hold).
_DTYPES = {
    str(d).removeprefix("torch."): d
    for d in (torch.float64, torch.float32, torch.float16, torch.bfloat16, torch.int64, torch.int32, torch.uint8)
}


def shard_name(rank: int, world: int) -> str:
    """The file rank ``rank`` of ``world`` writes."""
    return f"checkpoint.shard-{rank}-of-{world}.pt"


# --------------------------------------------------------------------------------- writing
def _chunk_of(value: Any) -> tuple[torch.Tensor, list[int]] | None | bool:
    """``(rows, offsets)`` of this rank's piece of a sharded tensor, ``None`` where another rank
    writes it (a replica), ``False`` for a tensor that is not sharded."""
    from torch.distributed.tensor import DTensor, Replicate, Shard

    if isinstance(value, DTensor):
        coordinate = value.device_mesh.get_coordinate()
        if coordinate is None:
            return None
        offsets = [0] * value.dim()
        sharded = 0
        for dim, placement in enumerate(value.placements):
            if isinstance(placement, Replicate):
                if coordinate[dim] != 0:
                    return None  # the replica of mesh coordinate 0 writes it
            elif isinstance(placement, Shard) and placement.dim == 0 and not sharded:
                sharded += 1
                # Shard(0) splits as torch.chunk does: ceil(n / k) rows per rank, the last ones fewer.
                rows = math.ceil(value.shape[0] / value.device_mesh.size(dim))
                offsets[0] = min(coordinate[dim] * rows, value.shape[0])
            else:
                raise ValueError(f"a DTensor placed as {value.placements} (only Replicate and one Shard(0) are saved)")
        return value.to_local(), offsets
    if type(value).__name__ == "ShardedTensor" and hasattr(value, "local_shards"):
        shards = value.local_shards()
        if len(shards) > 1:
            raise ValueError("a ShardedTensor with several local shards")
        if not shards:
            return None
        return shards[0].tensor, list(shards[0].metadata.shard_offsets)
    return False


def split(tree: dict[str, Any], *, rank: int) -> tuple[dict[str, Any], list[dict[str, Any]], list[dict[str, Any]]]:
    """``tree`` (a state tree of dicts holding FSDP's sharded state-dict tensors) cut in three:
    the tree without its sharded tensors, this rank's chunks of them, and what each one is
    (path, shape, dtype: the manifest's ``tensors``)."""
    chunks: list[dict[str, Any]] = []
    specs: list[dict[str, Any]] = []

    def walk(node: Any, path: list) -> Any:
        if not isinstance(node, dict):
            return node
        out = {}
        for key, value in node.items():
            here = [*path, key]
            piece = _chunk_of(value) if isinstance(value, torch.Tensor) else False
            if piece is False:
                out[key] = walk(value, here)
                continue
            if value.dim() == 0 or str(value.dtype).removeprefix("torch.") not in _DTYPES:
                raise ValueError(f"sharded tensor {here} of shape {tuple(value.shape)} and dtype {value.dtype}")
            specs.append({"path": here, "shape": list(value.shape), "dtype": str(value.dtype).removeprefix("torch.")})
            if isinstance(piece, tuple):
                local, offsets = piece
                chunks.append({"path": here, "offset": int(offsets[0]), "data": local.detach().cpu().contiguous()})
        return out

    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*ShardedTensor.*", category=FutureWarning)  # FSDP1's own type
        skeleton = walk(tree, [])
    return skeleton, chunks, specs


def non_finite_chunks(chunks: list[dict[str, Any]]) -> list[str]:
    """The agent weights among ``chunks`` holding NaN or infinity (their names)."""
    return [
        str(c["path"][-1])
        for c in chunks
        if c["path"][0] == "agent" and c["data"].is_floating_point() and not bool(torch.isfinite(c["data"]).all())
    ]


def save_shard(d: files.Dir, rank: int, world: int, chunks: list[dict[str, Any]]) -> dict[str, Any]:
    """Write this rank's chunks atomically (the old file kept as its previous one); returns the
    manifest's record of it."""
    from rl_replay.rundir.checkpoint import FORMAT, MAGIC, read_checkpoint_bytes

    name = shard_name(rank, world)
    data = safe_tree.dumps({"rank": rank, "world": world, "chunks": chunks}, {"format": SHARD_FORMAT})
    digest = hashlib.sha256(data).hexdigest()
    header = MAGIC + f"{FORMAT} sha256={digest} size={len(data)}\n".encode()
    d.write_atomic(name, header, data, lambda tmp: read_checkpoint_bytes(d, tmp, display=d.shown(name)))
    return {"file": name, "sha256": digest, "size": len(data)}


# --------------------------------------------------------------------------------- reading
def _bad(path: Path, what: str) -> CheckpointError:
    return CheckpointError(f"checkpoint {path} {what}; it was not written by rl_replay's trainer.")


def _manifest(shards: Any, path: Path) -> tuple[int, list[dict[str, Any]], list[dict[str, Any]]]:
    if not isinstance(shards, dict) or set(shards) != {"world", "files", "tensors"}:
        raise _bad(path, "holds a 'shards' entry that is not a shard manifest")
    world, records, specs = shards["world"], shards["files"], shards["tensors"]
    if not (isinstance(world, int) and not isinstance(world, bool) and 1 <= world <= 65_536):
        raise _bad(path, f"names shards of {shown(world)} ranks")
    if not (isinstance(records, list) and len(records) == world and isinstance(specs, list)):
        raise _bad(path, f"does not name one shard file per rank of its {world}")
    for rank, record in enumerate(records):
        if not (
            isinstance(record, dict)
            and set(record) == {"file", "sha256", "size"}
            and record["file"] == shard_name(rank, world)
            and isinstance(record["sha256"], str)
            and _HEX.fullmatch(record["sha256"])
            and isinstance(record["size"], int)
            and not isinstance(record["size"], bool)
            and record["size"] >= 0
        ):
            raise _bad(
                path, f"names shard file {rank} as {shown(record)}, not {shard_name(rank, world)!r} with its hash"
            )
    for spec in specs:
        if not (
            isinstance(spec, dict)
            and set(spec) == {"path", "shape", "dtype"}
            and isinstance(spec["path"], list)
            and len(spec["path"]) >= 2
            and all(isinstance(k, (str, int)) and not isinstance(k, bool) for k in spec["path"])
            and isinstance(spec["shape"], list)
            and spec["shape"]
            and all(isinstance(n, int) and not isinstance(n, bool) and 0 <= n < 2**40 for n in spec["shape"])
            and spec["dtype"] in _DTYPES
        ):
            raise _bad(path, f"names a sharded tensor as {shown(spec)}")
    return world, records, specs


def _read_shard(d: files.Dir, record: dict[str, Any], path: Path) -> dict[str, Any]:
    """The shard ``record`` names: its file or the previous one, whichever holds that payload."""
    from rl_replay.rundir.checkpoint import read_checkpoint_bytes

    name = record["file"]
    seen = []
    for candidate in (name, files.previous_name(name)):
        if not d.exists(candidate):
            continue
        size = d.lstat(candidate).st_size  # type: ignore[union-attr]
        if size < record["size"] or size > record["size"] + files.HEADER_MAX + 32:
            seen.append(f"{candidate} holds {size} bytes")
            continue  # another update's shard: not read at all
        try:
            data = read_checkpoint_bytes(d, candidate)
        except CheckpointError as exc:
            seen.append(str(exc))
            continue
        if hashlib.sha256(data).hexdigest() != record["sha256"]:
            seen.append(f"{candidate} is another update's")
            continue
        try:
            tree, meta = safe_tree.loads(data, budget=files.memory_left() // 2)
        except ValueError as exc:
            raise CheckpointError(f"checkpoint shard {d.shown(candidate)} cannot be read: {exc}.") from None
        if meta.get("format") != SHARD_FORMAT or not isinstance(tree, dict) or not isinstance(tree.get("chunks"), list):
            raise CheckpointError(f"{d.shown(candidate)} is not an rl_replay checkpoint shard.")
        return tree
    raise CheckpointError(
        f"checkpoint {path} needs its shard file {d.shown(name)} (sha256 {record['sha256'][:12]}...), which is "
        f"missing or replaced ({'; '.join(seen) or 'no such file'}): copy the run directory whole, shard files "
        "included."
    )


def _chunks(trees: list[dict[str, Any]], specs: list[dict[str, Any]], path: Path) -> Iterator[tuple[int, list]]:
    """Per spec (by index), its chunks ``(offset, rows)``, every one checked against the spec."""
    index = {tuple(spec["path"]): i for i, spec in enumerate(specs)}
    found: list[list] = [[] for _ in specs]
    for tree in trees:
        for chunk in tree["chunks"]:
            if not (isinstance(chunk, dict) and set(chunk) == {"path", "offset", "data"}):
                raise _bad(path, "has a shard entry that is not a chunk")
            key = tuple(chunk["path"]) if isinstance(chunk["path"], list) else None
            if key not in index:
                raise _bad(path, f"has a shard chunk of {shown(chunk['path'])}, which its manifest does not name")
            spec = specs[index[key]]
            rows, offset = chunk["data"], chunk["offset"]
            shape = spec["shape"]
            if not (
                isinstance(rows, torch.Tensor)
                and str(rows.dtype).removeprefix("torch.") == spec["dtype"]
                and list(rows.shape[1:]) == shape[1:]
                and rows.dim() == len(shape)
                and isinstance(offset, int)
                and not isinstance(offset, bool)
                and 0 <= offset <= shape[0] - rows.shape[0]
            ):
                raise _bad(path, f"has a shard chunk of {shown(spec['path'])} that does not fit its shape {shape}")
            found[index[key]].append((offset, rows))
    yield from enumerate(found)


def assemble(d: files.Dir, state: dict[str, Any], path: Path) -> dict[str, Any]:
    """``state`` (a checkpoint read from ``d``) with the tensors of its shard files put back in
    place, as a single-file checkpoint holds them; ``state`` itself if it names no shards."""
    if "shards" not in state:
        return state
    world, records, specs = _manifest(state.pop("shards"), path)
    declared = sum(math.prod(s["shape"]) * _DTYPES[s["dtype"]].itemsize for s in specs)
    files.check_affordable(declared + sum(r["size"] for r in records), path, "checkpoint (with its shards)")
    trees = [_read_shard(d, record, path) for record in records]
    for rank, tree in enumerate(trees):
        if tree.get("rank") != rank or tree.get("world") != world:
            raise _bad(path, f"has shard file {records[rank]['file']} written as rank {shown(tree.get('rank'))}")
    for i, pieces in _chunks(trees, specs, path):
        spec = specs[i]
        shape = spec["shape"]
        pieces.sort(key=lambda p: p[0])
        at = 0
        for offset, rows in pieces:
            if offset != at:
                raise _bad(path, f"has shard chunks of {shown(spec['path'])} that leave a gap or overlap at row {at}")
            at += rows.shape[0]
        if at != shape[0]:
            raise _bad(path, f"has shard chunks of {shown(spec['path'])} covering {at} of its {shape[0]} rows")
        full = torch.cat([rows for _, rows in pieces]) if pieces else torch.empty(shape, dtype=_DTYPES[spec["dtype"]])
        _put(state, spec["path"], full.reshape(shape), path)
    return state


def _put(state: dict[str, Any], keys: list, value: torch.Tensor, path: Path) -> None:
    node: Any = state
    for key in keys[:-1]:
        node = node.get(key) if isinstance(node, dict) else None
        if node is None:
            raise _bad(path, f"names a sharded tensor at {shown(keys)}, where its tree has no table")
    if not isinstance(node, dict) or keys[-1] in node:
        raise _bad(path, f"names a sharded tensor at {shown(keys)}, where its tree holds something else")
    node[keys[-1]] = value
