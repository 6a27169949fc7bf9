"""rl_replay/rundir/checkpoint.py: checkpoint files written atomically, verified on load, never lost.

Covers the file format (a header with the payload's sha256 and size, then a safetensors
file), verified loading and the one-line error for an empty, truncated, corrupt, unreadable,
foreign or legacy (pickled) file, the
fallback to ``checkpoint.prev.pt``, a failed write that leaves the old checkpoint and no
temporary file, the refusal to save non-finite weights, the removal of stale temporaries,
and RNG capture/restore of every stream.
"""

from __future__ import annotations

import hashlib
import os
import re

import numpy as np
import pytest
import torch

import rl_replay.rundir.files as files_module
from rl_replay.errors import CheckpointError, SetupError
from rl_replay.rundir.checkpoint import (
    checkpoint_path,
    load_checkpoint,
    load_latest,
    non_finite_tensors,
    previous_checkpoint_path,
    remove_stale_temporaries,
    save_checkpoint,
)


# ------------------------------------------------------------------ checkpoint integrity
def _payload(value):
    return {"agent": {"w": torch.full((3,), float(value))}, "update": 1 if value != value else int(value)}


def test_checkpoint_checksum_truncation_and_previous(tmp_path):
    path = tmp_path / "checkpoint.pt"
    save_checkpoint(_payload(1), path)
    save_checkpoint(_payload(2), path)
    assert load_checkpoint(path)["update"] == 2
    assert load_checkpoint(previous_checkpoint_path(tmp_path))["update"] == 1  # kept
    assert list(tmp_path.glob(".*")) == []  # no temporary left behind

    good = path.read_bytes()
    flipped = bytearray(good)
    flipped[-20] ^= 0x01  # one bit inside the payload
    for name, data, message in (
        ("flipped", bytes(flipped), "is corrupt: its sha256 checksum does not match"),
        ("truncated", good[: len(good) // 2], "is truncated"),
        ("empty", b"", r"is empty \(0 bytes\)"),
    ):
        path.write_bytes(data)
        with pytest.raises(CheckpointError, match=rf"checkpoint {re.escape(str(path))} {message}") as info:
            load_checkpoint(path)
        assert "\n" not in str(info.value), name
        state, used, warning = load_latest(tmp_path)  # falls back to the previous one
        assert state["update"] == 1 and used == previous_checkpoint_path(tmp_path)
        assert str(path) in warning and "previous checkpoint" in warning


def test_save_refuses_non_finite_weights(tmp_path):
    path = tmp_path / "checkpoint.pt"
    save_checkpoint(_payload(1), path)
    before = path.read_bytes()
    with pytest.raises(CheckpointError, match=r"refusing to write .*agent weights w are not finite"):
        save_checkpoint(_payload(float("nan")), path)
    assert path.read_bytes() == before and not previous_checkpoint_path(tmp_path).exists()


def test_file_is_a_header_with_the_payloads_checksum_and_size_then_the_payload(tmp_path):
    payload = {**_payload(3), "rng": {"numpy": np.random.get_state()}, "nested": [1, (2, "x")]}
    path = tmp_path / "checkpoint.pt"
    save_checkpoint(payload, path)
    header, body = path.read_bytes().split(b"\n", 1)
    match = re.fullmatch(rb"RLREPLAY-CHECKPOINT 2 sha256=([0-9a-f]{64}) size=(\d+)", header)
    assert match, header
    assert match.group(1).decode() == hashlib.sha256(body).hexdigest() and int(match.group(2)) == len(body)
    # The payload is a plain safetensors file: any safetensors reader gets the tensors.
    from safetensors.torch import load

    assert any(torch.equal(t, payload["agent"]["w"]) for t in load(body).values())
    state = load_checkpoint(tmp_path)  # a run directory: its checkpoint.pt
    assert state["update"] == 3 and state["nested"] == [1, (2, "x")]
    assert torch.equal(state["agent"]["w"], payload["agent"]["w"])
    assert np.array_equal(state["rng"]["numpy"][1], payload["rng"]["numpy"][1])


def test_other_names_keep_their_previous_file_beside_them(tmp_path):
    path = tmp_path / "best.pt"
    save_checkpoint(_payload(1), path)
    save_checkpoint(_payload(2), path)
    assert load_checkpoint(tmp_path / "best.prev.pt")["update"] == 1
    assert sorted(p.name for p in tmp_path.iterdir()) == ["best.prev.pt", "best.pt"]


@pytest.mark.parametrize(
    "data, message",
    [
        (b"RLREPLAY-CHECKPOINT 2 sha256=abc\n" + b"x" * 10, r"is corrupt: its header is unreadable"),
        (b"RLREPLAY-CHECKPOINT 2 sha256=abc size=ten\n", r"is corrupt: its header is unreadable"),
        (
            b"RLREPLAY-CHECKPOINT 2 sha256=" + hashlib.sha256(b"junk").hexdigest().encode() + b" size=4\njunk",
            r"cannot be read: not a stored tree \(\w+: .+\)\.$",
        ),
        (
            b"RLREPLAY-CHECKPOINT 9 sha256=abc size=1\nx",
            r"has format '9', which this version of rl_replay does not read",
        ),
    ],
    ids=["header_without_size", "size_not_a_number", "payload_not_safetensors", "future_format"],
)
def test_unreadable_files_are_one_line_errors_naming_them(tmp_path, data, message):
    path = tmp_path / "checkpoint.pt"
    path.write_bytes(data)
    with pytest.raises(CheckpointError, match=rf"checkpoint {re.escape(str(path))} {message}") as info:
        load_checkpoint(path)
    assert "\n" not in str(info.value)
    assert isinstance(info.value, SetupError)  # the scripts print it as one line, exit code 2


def test_legacy_pickles_are_refused_with_the_convert_command_and_foreign_files_are_refused(tmp_path):
    legacy = tmp_path / "legacy.pt"
    torch.save(_payload(4), legacy)  # a bare torch.save, from before the header
    with pytest.raises(
        CheckpointError,
        match=rf"^checkpoint {re.escape(str(legacy))} is a bare torch.save file "
        r"\(no header\): a pickle, which can run any code when loaded, so it is not loaded\. If you "
        rf"trust where it came from, convert it: python scripts/convert_checkpoint\.py "
        rf"{re.escape(str(legacy))} --trust$",
    ):
        load_checkpoint(legacy)
    headed = tmp_path / "v1.pt"
    body = legacy.read_bytes()
    headed.write_bytes(
        f"RLREPLAY-CHECKPOINT 1 sha256={hashlib.sha256(body).hexdigest()} size={len(body)}\n".encode() + body
    )
    with pytest.raises(CheckpointError, match=r"is in the format-1 layout: a pickle, .* --trust$"):
        load_checkpoint(headed)
    foreign = tmp_path / "foreign.pt"
    save_checkpoint({"model": {"w": torch.zeros(1)}}, foreign)
    with pytest.raises(
        CheckpointError,
        match=rf"^{re.escape(str(foreign))} is not an rl_replay checkpoint "
        r"\(it holds no agent weights\)\.$",
    ):
        load_checkpoint(foreign)
    save_checkpoint({"agent": {"w": "text"}}, foreign)
    with pytest.raises(CheckpointError, match=r"its agent entries 'w' are not tensors"):
        load_checkpoint(foreign)
    other = tmp_path / "notes.txt"
    other.write_text("hello")
    with pytest.raises(
        CheckpointError,
        match=rf"^{re.escape(str(other))} is not an rl_replay checkpoint \(it does "
        r"not start with its header\)\.$",
    ):
        load_checkpoint(other)
    with pytest.raises(FileNotFoundError, match=rf"no checkpoint at {re.escape(str(tmp_path / 'missing.pt'))}"):
        load_checkpoint(tmp_path / "missing.pt")


def test_load_latest_prefers_the_latest_and_falls_back_only_when_it_is_missing_or_damaged(tmp_path):
    save_checkpoint(_payload(1), checkpoint_path(tmp_path))
    save_checkpoint(_payload(2), checkpoint_path(tmp_path))
    state, used, warning = load_latest(tmp_path)
    assert (state["update"], used, warning) == (2, checkpoint_path(tmp_path), None)

    checkpoint_path(tmp_path).unlink()
    state, used, warning = load_latest(tmp_path)
    assert state["update"] == 1 and used == previous_checkpoint_path(tmp_path)
    assert warning == (
        f"no checkpoint at {checkpoint_path(tmp_path)} Resuming from the previous checkpoint "
        f"{previous_checkpoint_path(tmp_path)} (update 1)."
    )

    # Both damaged: the latest file's error, not the previous one's.
    checkpoint_path(tmp_path).write_bytes(b"")
    previous_checkpoint_path(tmp_path).write_bytes(b"junk")
    with pytest.raises(CheckpointError, match=rf"checkpoint {re.escape(str(checkpoint_path(tmp_path)))} is empty"):
        load_latest(tmp_path)
    previous_checkpoint_path(tmp_path).unlink()
    with pytest.raises(CheckpointError, match=r"is empty"):
        load_latest(tmp_path)


def test_a_failed_write_keeps_the_old_checkpoint_and_leaves_no_temporary(tmp_path, monkeypatch):
    path = checkpoint_path(tmp_path)
    save_checkpoint(_payload(1), path)
    before = path.read_bytes()
    real_replace = os.replace

    def replace(src, dst, **dir_fds):
        if os.fspath(dst) == path.name:
            raise OSError("disk full")  # the rename of the new file fails
        real_replace(src, dst, **dir_fds)

    monkeypatch.setattr(files_module.os, "replace", replace)
    with pytest.raises(OSError, match="disk full"):
        save_checkpoint(_payload(2), path)
    assert path.read_bytes() == before and load_checkpoint(path)["update"] == 1
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoint.prev.pt", "checkpoint.pt"]


def test_non_finite_tensors_names_floating_tensors_holding_nan_or_inf():
    state = {
        "ok": torch.ones(2),
        "nan": torch.tensor([0.0, float("nan")]),
        "int": torch.tensor([1, 2]),
        "inf": torch.tensor([float("-inf")], dtype=torch.float64),
        "step": 3,
    }
    assert non_finite_tensors(state) == ["nan", "inf"]


def test_save_names_at_most_four_non_finite_weights(tmp_path):
    agent = {f"w{i}": torch.tensor([float("inf")]) for i in range(6)}
    with pytest.raises(
        CheckpointError,
        match=r"agent weights w0, w1, w2, w3 \.\.\. are not finite; the previous "
        r"checkpoint is kept\.$",
    ):
        save_checkpoint({"agent": agent, "update": 1}, tmp_path / "checkpoint.pt")
    assert list(tmp_path.iterdir()) == []


def test_remove_stale_temporaries_removes_only_temporaries(tmp_path):
    stale = [".checkpoint.pt.abc123.tmp", ".checkpoint.pt.abc123.tmp.prev", ".config.yaml.x1.tmp", "metrics.jsonl.tmp"]
    kept = ["checkpoint.pt", "checkpoint.prev.pt", "config.yaml", "metrics.jsonl", ".lock"]
    for name in stale + kept:
        (tmp_path / name).write_bytes(b"x")
    removed = remove_stale_temporaries(tmp_path)
    assert sorted(p.name for p in removed) == sorted(stale)
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(kept)


# ------------------------------------------------------------------ RNG capture / restore
def _draws(device):
    import random

    return (random.random(), float(np.random.rand()), torch.rand(3).tolist(), torch.rand(3, device=device).tolist())


@pytest.mark.parametrize(
    "device",
    [
        "cpu",
        pytest.param(
            "cuda", marks=[pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]
        ),
    ],
)
def test_one_rng_helper_restores_every_stream(device):
    from rl_replay.run.trainer_state import capture_rng, restore_rng

    rng = capture_rng(device)
    assert ("cuda" in rng) == (device == "cuda")
    expected = _draws(device)
    _draws(device)  # move every stream on
    restore_rng(rng, device)
    assert _draws(device) == expected


@pytest.mark.parametrize(
    "target, older",
    [
        ("lru", "bare"),  # before the recurrence moved into the skeleton's core: nu_log
        ("mingru", "bare"),  # gate.weight
        ("lru", "cell"),  # before the core was named core: cell.nu_log
        ("gru", "cell"),  # cell.weight_ih, critic_cell.* with a separate critic
    ],
)
def test_weights_saved_under_older_names_still_load(target, older):
    """Recurrent agents' weights named as older checkpoints name them (``nu_log``, ``cell.nu_log``,
    ``critic_cell.weight_ih``) load under the skeleton's names (``core.nu_log``, ...), values unchanged."""
    import gymnasium as gym

    from rl_replay.agent import build_agent
    from rl_replay.run.trainer_state import load_agent_weights

    space, actions = gym.spaces.Box(-1, 1, (4,)), gym.spaces.Discrete(2)
    kwargs = {"separate_critic": True} if target == "gru" else {}
    torch.manual_seed(0)
    source = build_agent(target, kwargs, space, actions)
    if older == "bare":
        old = {k.removeprefix("core."): v for k, v in source.state_dict().items()}
        assert any(k in old for k in ("nu_log", "gate.weight"))
    else:
        old = {
            k.replace("core.", "cell.", 1) if k.startswith(("core.", "critic_core.")) else k: v
            for k, v in source.state_dict().items()
        }
        old = {k.replace("critic_core.", "critic_cell.", 1): v for k, v in old.items()}
        assert any(k.startswith("cell.") for k in old) and not any(k.startswith("core.") for k in old)
    torch.manual_seed(1)
    agent = build_agent(target, kwargs, space, actions)
    load_agent_weights(agent, old, "old.pt")
    for k, v in source.state_dict().items():
        assert torch.equal(agent.state_dict()[k], v), k


def test_an_optimizer_state_keyed_by_older_names_loads_by_index():
    """An FSDP run's optimizer state is keyed by parameter name; one written before the core was
    named core (``cell.weight_ih``) maps onto this agent's parameters as the weights do."""
    import gymnasium as gym

    from rl_replay.agent import build_agent
    from rl_replay.run.trainer_state import _optimizer_state_by_index, _parameter_names, _renamed

    agent = build_agent("gru", {"separate_critic": True}, gym.spaces.Box(-1, 1, (4,)), gym.spaces.Discrete(2))
    optimizer = torch.optim.Adam(agent.parameters())
    sum(p.sum() for p in agent.parameters()).backward()
    optimizer.step()
    own = optimizer.state_dict()
    names = {i: n.replace("core.", "cell.", 1) for i, n in enumerate(_parameter_names(agent))}
    assert any(n.startswith("critic_cell.") for n in names.values())
    by_old_name = _renamed(own, names)
    again = _optimizer_state_by_index(agent, by_old_name)
    assert again["param_groups"] == own["param_groups"] and sorted(again["state"]) == sorted(own["state"])
    assert all(torch.equal(again["state"][i]["exp_avg"], own["state"][i]["exp_avg"]) for i in own["state"])
