"""Sharded checkpoints (rl_replay/rundir/shards.py) as someone else may leave them.

The shard files here are cut by hand from a real one-process run's checkpoint, two ranks' rows of
every weight and optimizer moment, in the documented layout (what FSDP's ranks write under torchrun
is tested in tests/run/test_distributed_train.py). Each hostile variant is what an attacker who
controls the whole run directory can write: they recompute every hash, so only the rules of
docs/checkpoints.md stand between the files and the reader. A refusal is one line naming the file.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import numpy as np
import pytest
import torch
from _checkpoint_files import write_format2
from test_hostile_runs import TINY, copy_run, error_line

from rl_replay.errors import CheckpointError
from rl_replay.run.cli import evaluate_main, train_main
from rl_replay.rundir import files, safe_tree, shards
from rl_replay.rundir.checkpoint import load_checkpoint, read_checkpoint_bytes, save_checkpoint


@pytest.fixture(scope="module")
def whole(tmp_path_factory):
    """A finished run of this user's with its ordinary single-file checkpoint."""
    run_dir = tmp_path_factory.mktemp("sharded") / "run"
    assert train_main([*TINY, "total_env_steps=32", "checkpoint.every=1", f"run_dir={run_dir}"]) == 0
    return run_dir


def shard(run_dir: Path, world: int = 2) -> dict:
    """Rewrite ``run_dir``'s checkpoint as ``world`` ranks would: every weight and optimizer moment
    cut into ``world`` blocks of rows (as torch.chunk cuts them), one shard file per rank, and
    checkpoint.pt the manifest. Returns the whole state it started from."""
    state = load_checkpoint(run_dir)
    original = load_checkpoint(run_dir)
    specs: list = []
    chunks: list[list] = [[] for _ in range(world)]

    def take(tree: dict, path: list) -> None:
        for key, value in list(tree.items()):
            if isinstance(value, torch.Tensor) and value.dim() >= 1:
                del tree[key]
                specs.append({"path": [*path, key], "shape": list(value.shape), "dtype": str(value.dtype)[6:]})
                offset = 0
                for rank, rows in enumerate(torch.chunk(value, world)):
                    chunks[rank].append({"path": [*path, key], "offset": offset, "data": rows.clone()})
                    offset += rows.shape[0]
            elif isinstance(value, dict):
                take(value, [*path, key])

    take(state["agent"], ["agent"])
    take(state["optimizer"]["state"], ["optimizer", "state"])
    with files.Dir.open(run_dir) as d:
        records = [shards.save_shard(d, rank, world, chunks[rank]) for rank in range(world)]
        save_checkpoint({**state, "shards": {"world": world, "files": records, "tensors": specs}}, d)
    return original


def same(a, b) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    if isinstance(a, np.ndarray):
        return isinstance(b, np.ndarray) and a.dtype == b.dtype and np.array_equal(a, b)
    return a == b


def manifest(run_dir: Path) -> dict:
    with files.Dir.open(run_dir) as d:
        return safe_tree.loads(read_checkpoint_bytes(d, "checkpoint.pt"))[0]


def rewrite_manifest(run_dir: Path, change) -> None:
    """What an attacker does: edit the manifest and write it back with a correct header."""
    tree = manifest(run_dir)
    change(tree)
    write_format2(tree, run_dir / "checkpoint.pt")


def rewrite_shard(run_dir: Path, rank: int, change, *, world: int = 2) -> None:
    """Edit rank ``rank``'s shard file, write it with a correct header, and make the manifest name
    its new hash and size (the attacker controls both)."""
    name = shards.shard_name(rank, world)
    with files.Dir.open(run_dir) as d:
        tree = safe_tree.loads(read_checkpoint_bytes(d, name))[0]
    change(tree)
    data = safe_tree.dumps(tree, {"format": shards.SHARD_FORMAT})
    digest = hashlib.sha256(data).hexdigest()
    (run_dir / name).write_bytes(f"RLREPLAY-CHECKPOINT 2 sha256={digest} size={len(data)}\n".encode() + data)

    def rename(m: dict) -> None:
        m["shards"]["files"][rank].update(sha256=digest, size=len(data))

    rewrite_manifest(run_dir, rename)


def test_a_sharded_checkpoint_reads_back_whole_and_evaluates(whole, tmp_path, capsys):
    run_dir = copy_run(whole, tmp_path / "run")
    original = shard(run_dir)
    assert manifest(run_dir)["agent"] == {}  # the weights are only in the shard files
    assert sorted(os.listdir(run_dir)).count("checkpoint.shard-0-of-2.pt") == 1
    assert same(load_checkpoint(run_dir), original)
    assert evaluate_main([str(run_dir), "--episodes", "2"]) == 0
    assert "over 2 episodes (checkpoint update 2, 32 env steps)" in capsys.readouterr().out
    # and resumes, in one process, writing one file again
    assert train_main(["--resume", str(run_dir), "total_env_steps=48"]) == 0
    assert "shards" not in manifest(run_dir) and manifest(run_dir)["update"] == 3


def test_a_shard_file_of_the_next_update_falls_back_to_its_previous_file(whole, tmp_path):
    """A kill after the shards of the next checkpoint were written but before checkpoint.pt named
    them: each shard's previous file holds the payload checkpoint.pt names."""
    run_dir = copy_run(whole, tmp_path / "run")
    original = shard(run_dir)
    with files.Dir.open(run_dir) as d:
        tree = safe_tree.loads(read_checkpoint_bytes(d, "checkpoint.shard-0-of-2.pt"))[0]
        for chunk in tree["chunks"]:
            chunk["data"] = chunk["data"] + 1  # the next update's weights
        shards.save_shard(d, 0, 2, tree["chunks"])  # rotates the named file to its .prev name
    assert (run_dir / "checkpoint.shard-0-of-2.prev.pt").exists()
    assert same(load_checkpoint(run_dir), original)


def _gap(tree):
    tree["chunks"][0]["offset"] += 1


def _past_the_end(tree):
    tree["chunks"][0]["offset"] = 10**6


def _wrong_dtype(tree):
    tree["chunks"][0]["data"] = tree["chunks"][0]["data"].double()


def _wrong_columns(tree):
    chunk = next(c for c in tree["chunks"] if c["data"].dim() == 2)
    chunk["data"] = chunk["data"][:, :1].contiguous()


def _unnamed(tree):
    tree["chunks"][0]["path"] = ["agent", "planted.weight"]


def _other_rank(tree):
    tree["rank"] = 1


def _overlap(tree):
    tree["chunks"].append(dict(tree["chunks"][0]))


@pytest.mark.parametrize(
    ("change", "said"),
    [
        (_gap, "that leave a gap or overlap at row 0"),
        (_overlap, "that leave a gap or overlap at row"),
        (_past_the_end, "that does not fit its shape"),
        (_wrong_dtype, "that does not fit its shape"),
        (_wrong_columns, "that does not fit its shape"),
        (_unnamed, "which its manifest does not name"),
        (_other_rank, "written as rank 1"),
    ],
    ids=["gap", "overlap", "past-the-end", "dtype", "columns", "unnamed", "other-rank"],
)
def test_shard_chunks_that_do_not_tile_their_tensor_are_one_line(whole, tmp_path, capsys, change, said):
    run_dir = copy_run(whole, tmp_path / "run")
    shard(run_dir)
    rewrite_shard(run_dir, 0, change)
    with pytest.raises(CheckpointError, match="not written by rl_replay's trainer") as caught:
        load_checkpoint(run_dir)
    assert said in str(caught.value) and "\n" not in str(caught.value)
    assert evaluate_main([str(run_dir)]) != 0
    assert said in error_line(capsys)


def _escape(m):
    m["shards"]["files"][0]["file"] = "../../checkpoint.pt"


def _huge(m):
    m["shards"]["tensors"][0]["shape"] = [2**39, 1]


def _into_a_number(m):
    m["shards"]["tensors"].append({"path": ["update", "x"], "shape": [0], "dtype": "float32"})


def _world(m):
    m["shards"]["world"] = 3


@pytest.mark.parametrize(
    ("change", "said"),
    [
        (_escape, "names shard file 0 as"),
        (_huge, "more than this process can hold"),
        (_into_a_number, "where its tree holds something else"),
        (_world, "does not name one shard file per rank"),
    ],
    ids=["path-escape", "huge-shape", "into-a-number", "world"],
)
def test_a_hostile_shard_manifest_is_one_line_and_reads_nothing_it_names(whole, tmp_path, capsys, change, said):
    run_dir = copy_run(whole, tmp_path / "run")
    shard(run_dir)
    rewrite_manifest(run_dir, change)
    assert evaluate_main([str(run_dir)]) != 0
    assert said in error_line(capsys)


def test_a_missing_or_swapped_shard_file_is_one_line_naming_it(whole, tmp_path, capsys):
    run_dir = copy_run(whole, tmp_path / "run")
    shard(run_dir)
    (run_dir / "checkpoint.shard-1-of-2.pt").unlink()
    assert evaluate_main([str(run_dir)]) != 0
    line = error_line(capsys)
    assert "needs its shard file" in line and "checkpoint.shard-1-of-2.pt" in line and "no such file" in line
    # rank 0's file put in rank 1's place: another payload than the one named, so not taken
    (run_dir / "checkpoint.shard-1-of-2.pt").write_bytes((run_dir / "checkpoint.shard-0-of-2.pt").read_bytes())
    assert evaluate_main([str(run_dir)]) != 0
    line = error_line(capsys)
    assert "needs its shard file" in line and ("is another update's" in line or "bytes" in line), line


def test_a_shard_file_larger_than_named_is_not_read(whole, tmp_path, capsys):
    """The size named in checkpoint.pt is compared before a byte is read: a sparse multi-GiB file
    in a shard's place costs nothing."""
    run_dir = copy_run(whole, tmp_path / "run")
    shard(run_dir)
    with open(run_dir / "checkpoint.shard-0-of-2.pt", "r+b") as f:
        f.truncate(8 * 2**30)
    assert evaluate_main([str(run_dir)]) != 0
    line = error_line(capsys)
    assert f"checkpoint.shard-0-of-2.pt holds {8 * 2**30} bytes" in line
