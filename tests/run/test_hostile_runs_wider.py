"""A wider hostile round: what a careful attacker tries once the obvious holes are closed.

Each test is one class of attack on a real run of this user's (or on this user's secret), run
through the command a user would, in process. As in :mod:`test_hostile_runs`, a refusal is one
``error:`` line, nothing outside the run changes, and the memory cases run under an
address-space limit a few GiB above what the process already maps.
"""

from __future__ import annotations

import json
import os
import re
import stat
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from _checkpoint_files import write_format2
from safetensors.torch import load
from test_hostile_runs import (
    TINY,
    address_space_limit,
    copy_run,
    error_line,
    fifo_watchdog,
    files_of,
    reseal,
    resume,
    warm_start,
)

from rl_replay.errors import SetupError
from rl_replay.run import safe_tree, trust
from rl_replay.run.checkpoint import checkpoint_path, load_checkpoint
from rl_replay.run.cli import evaluate_main, train_main
from rl_replay.run.env_state_file import ENV_STATE_NAME


# --------------------------------------------------------------------------- the secret's folder
@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """A finished 2-update run of this user's (checkpoint, env state, signed config, metrics)."""
    run_dir = tmp_path_factory.mktemp("wider") / "run"
    assert train_main([*TINY, "total_env_steps=32", "checkpoint.every=1", f"run_dir={run_dir}"]) == 0
    return run_dir


@pytest.fixture
def secret_dir(tmp_path, monkeypatch):
    folder = tmp_path / "cfg"
    monkeypatch.setenv("RL_REPLAY_CONFIG_DIR", str(folder))
    return folder


@pytest.mark.parametrize("mode", [0o770, 0o707, 0o777])
def test_a_secret_folder_others_can_write_is_refused_naming_it_and_the_fix(secret_dir, mode):
    trust.user_secret()
    secret_dir.chmod(mode)
    with pytest.raises(
        SetupError,
        match=rf"^the folder of the per-user secret {secret_dir} is writable by other users.*chmod 700 {secret_dir}$",
    ):
        trust.user_secret()
    with pytest.raises(SetupError, match="is writable by other users"):
        trust.existing_secret()


def test_a_new_run_is_refused_before_its_directory_exists_when_the_secret_folder_is_open(secret_dir, tmp_path, capsys):
    secret_dir.mkdir(mode=0o777)
    secret_dir.chmod(0o777)
    run_dir = tmp_path / "run"
    assert train_main([*TINY, "total_env_steps=16", f"run_dir={run_dir}"]) == 2
    assert "is writable by other users" in error_line(capsys)
    assert not run_dir.exists()


def test_a_secret_folder_that_is_a_symlink_is_refused(secret_dir, tmp_path):
    real = tmp_path / "real"
    real.mkdir(mode=0o700)
    secret_dir.symlink_to(real)
    with pytest.raises(SetupError, match="is a symbolic link"):
        trust.user_secret()
    assert not any(real.iterdir())


def test_a_symlinked_secret_is_refused_even_to_a_private_file_of_this_user(secret_dir, tmp_path):
    secret_dir.mkdir(mode=0o700)
    chosen = tmp_path / "chosen.key"
    chosen.write_text("ab" * 32 + "\n")
    chosen.chmod(0o600)
    (secret_dir / "secret.key").symlink_to(chosen)
    with pytest.raises(SetupError, match=r"secret\.key is a symbolic link"):
        trust.user_secret()


def test_a_fifo_in_place_of_the_secret_hangs_nothing(secret_dir):
    secret_dir.mkdir(mode=0o700)
    fifo = secret_dir / "secret.key"
    os.mkfifo(fifo, 0o600)
    with fifo_watchdog(fifo), pytest.raises(SetupError, match="is not a regular file"):
        trust.user_secret()


def test_a_huge_sparse_secret_is_refused_before_it_is_read(secret_dir):
    secret_dir.mkdir(mode=0o700)
    path = secret_dir / "secret.key"
    with open(path, "wb") as f:
        f.truncate(4 << 30)
    path.chmod(0o600)
    with pytest.raises(SetupError, match=rf"is {4 << 30} bytes, not a secret"):
        trust.user_secret()


def test_the_secret_is_never_written_through_a_path_that_exists(secret_dir, tmp_path, monkeypatch):
    """Every name the secret's creation writes is new: a link planted at the old fixed temporary name
    (or any other) is left alone, and the file it points to is unchanged."""
    secret_dir.mkdir(mode=0o700)
    outside = tmp_path / "outside"
    outside.write_text("untouched\n")
    (secret_dir / f".secret.key.{os.getpid()}.tmp").symlink_to(outside)
    key = trust.user_secret()
    assert outside.read_text() == "untouched\n"
    path = secret_dir / "secret.key"
    assert not path.is_symlink() and stat.S_IMODE(path.stat().st_mode) == 0o600
    assert bytes.fromhex(path.read_text().strip()) == key


# ------------------------------------------------------ decoding counted on what it decodes to
def forge_checkpoint(victim: Path, edit: Callable[[dict, dict], None]) -> None:
    """Rewrite ``victim``'s checkpoint with ``edit(tree, tensors)`` applied to its stored tree (the
    JSON with ``$t`` / ``$np`` / ``$b`` references) and its tensors, resealed as anyone can."""
    from safetensors.torch import save

    (victim / "checkpoint.prev.pt").unlink(missing_ok=True)
    payload = checkpoint_path(victim).read_bytes().partition(b"\n")[2]
    meta_len = int.from_bytes(payload[:8], "little")
    meta = json.loads(payload[8 : 8 + meta_len])["__metadata__"]
    tensors = dict(load(payload))
    tree = json.loads(meta[safe_tree.TREE_KEY])
    edit(tree, tensors)
    meta[safe_tree.TREE_KEY] = json.dumps(tree, separators=(",", ":"))
    reseal(checkpoint_path(victim), save(tensors, metadata=meta))


def test_a_tree_of_millions_of_empty_objects_is_refused_before_it_is_parsed(run, tmp_path, capsys):
    victim = copy_run(run, tmp_path / "victim")
    forge_checkpoint(victim, lambda tree, _: tree.update(bomb=[{}] * 30_000_000))  # 90 MB of JSON
    with address_space_limit():
        assert evaluate_main([str(victim), "--episodes", "1"]) == 2
    assert re.search(r"its tree holds over [\d,]+ values", error_line(capsys))


def test_one_tensor_referenced_thousands_of_times_is_refused_under_evaluate(run, tmp_path, capsys):
    def edit(tree, tensors):
        tensors["bomb"] = torch.zeros(8 << 20, dtype=torch.uint8)
        tree["agent"].update({f"bomb{i}": {"$b": "bomb"} for i in range(4000)})  # 32 GB as bytes

    victim = copy_run(run, tmp_path / "victim")
    forge_checkpoint(victim, edit)
    with address_space_limit():
        assert evaluate_main([str(victim), "--episodes", "1"]) == 2
    assert "is referenced more than once" in error_line(capsys)


def test_complex128_views_of_small_tensors_are_counted_under_init_from(run, tmp_path, capsys):
    def edit(tree, tensors):
        for i in range(4):  # 4 x 64 MB of bytes, each 16x its size as complex128: 4 GB
            tensors[f"bomb{i}"] = torch.zeros(64 << 20, dtype=torch.uint8)
            tree[f"bomb{i}"] = {"$np": f"bomb{i}", "dtype": "<c16", "scalar": False}

    victim = copy_run(run, tmp_path / "victim")
    forge_checkpoint(victim, edit)
    with address_space_limit():
        assert warm_start(victim, tmp_path / "warm") == 2
    assert "decodes to" in error_line(capsys)
    assert not (tmp_path / "warm").exists()


# ------------------------------------------------------------------ env state bound to its run
def _graft_env_state(victim: Path, donor: Path) -> None:
    """``donor``'s signed env state put in ``victim``, whose checkpoint is edited (unsigned, as
    anyone can) to name it."""
    (victim / "env_state.prev.pkl").unlink(missing_ok=True)
    (victim / "checkpoint.prev.pt").unlink(missing_ok=True)
    (victim / ENV_STATE_NAME).write_bytes((donor / ENV_STATE_NAME).read_bytes())
    state = load_checkpoint(victim)
    state["env_state"] = load_checkpoint(donor)["env_state"]
    write_format2(state, checkpoint_path(victim))


def _resumed_with_fresh_envs(victim: Path) -> None:
    with pytest.warns(UserWarning) as caught:
        assert resume(victim, "total_env_steps=48") == 0
    notes = [str(w.message) for w in caught if "environment state is not used" in str(w.message)]
    assert len(notes) == 1 and "written for another run or env config" in notes[0], [str(w.message) for w in caught]


def test_an_env_state_of_another_run_of_this_user_is_not_taken_when_a_checkpoint_names_it(run, tmp_path):
    other = tmp_path / "other"
    assert train_main([*TINY, "total_env_steps=32", "seed=7", f"run_dir={other}"]) == 0
    victim = copy_run(run, tmp_path / "victim")
    _graft_env_state(victim, other)
    _resumed_with_fresh_envs(victim)


def test_an_env_state_of_other_env_kwargs_is_not_taken(run, tmp_path):
    other = tmp_path / "other"
    assert train_main([*TINY, "total_env_steps=32", "env.kwargs={sutton_barto_reward: true}", f"run_dir={other}"]) == 0
    victim = copy_run(run, tmp_path / "victim")
    _graft_env_state(victim, other)
    _resumed_with_fresh_envs(victim)


def test_a_run_resumes_its_own_env_state_exactly_after_the_binding(run, tmp_path, recwarn):
    victim = copy_run(run, tmp_path / "victim")
    assert resume(victim, "total_env_steps=48") == 0
    assert not [w for w in recwarn if "environment state is not used" in str(w.message)]


# ------------------------------------------------------- validate before write, for all a resume loads
def _refused_resume_changes_nothing(victim: Path, capsys, *args: str) -> str:
    with open(victim / "metrics.jsonl", "a") as f:  # a row after the checkpoint: a resume would cut it
        f.write('{"update": 3, "env_steps": 48}\n')
    before = files_of(victim)
    assert resume(victim, "total_env_steps=48", *args) == 2
    line = error_line(capsys)
    assert files_of(victim) == before
    return line


@pytest.mark.parametrize(
    "damage, words",
    [
        (lambda o: o["state"][0].update(exp_avg=torch.zeros(3, 3)), "exp_avg of shape (3, 3)"),
        (lambda o: o["state"][0].update(exp_avg=[1.0, 2.0]), "exp_avg is a list"),
        (
            lambda o: o["state"][0].update({k: v.long() for k, v in o["state"][0].items() if k != "step"}),
            "of dtype torch.int64",
        ),
        (lambda o: o["state"][0].update(step="7"), "step is a str"),
        (lambda o: o["param_groups"][0].update(lr="fast"), "lr is a str"),
        (lambda o: o.update(state="none"), "state is a str"),
    ],
    ids=["shape", "type", "dtype", "step", "lr", "table"],
)
def test_optimizer_state_that_does_not_fit_its_parameters_refuses_the_resume_changing_nothing(
    run, tmp_path, capsys, damage, words
):
    victim = copy_run(run, tmp_path / "victim")
    (victim / "checkpoint.prev.pt").unlink()
    state = load_checkpoint(victim)
    damage(state["optimizer"])
    write_format2(state, checkpoint_path(victim))
    line = _refused_resume_changes_nothing(victim, capsys)
    assert "optimizer state" in line and words in line, line


def test_an_env_state_of_another_env_refuses_a_trusted_resume_changing_nothing(run, tmp_path, capsys):
    other = tmp_path / "other"
    assert train_main([*TINY, "total_env_steps=32", "env.id=Acrobot-v1", f"run_dir={other}"]) == 0
    victim = copy_run(run, tmp_path / "victim")
    _graft_env_state(victim, other)
    line = _refused_resume_changes_nothing(victim, capsys, "--trust-env-state")
    assert "env state" in line and "observation space" in line, line
