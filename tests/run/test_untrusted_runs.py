"""A run directory from someone else runs no code when it is loaded.

Each attack plants an object whose unpickling creates a file (it could call any function):
in a legacy checkpoint (format 1 with a recomputed header, and a bare ``torch.save``), and in
the env-state pickle with its checksum recomputed. Evaluating, warm-starting from and
resuming such a run creates no file: the legacy checkpoint is one line naming the convert
command, and the env state, whose MAC does not verify with this user's key, is not unpickled
(the resume keeps weights, optimizer and counters, starts fresh episodes and says why).
A run copied to another user's key resumes the same way; ``--trust-env-state`` unpickles it
and then continues exactly. Foreign config targets are checked before anything is called.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import stat
import subprocess
import sys
import warnings
from pathlib import Path

import _runs
import pytest
import torch
from _checkpoint_files import write_format2, write_headed_pickle
from _runs import BATCH
from _runs import TINY_CONSTANT_LR as TINY

from rl_replay.config import load_config
from rl_replay.errors import SetupError
from rl_replay.run.cli import convert_main, evaluate_main
from rl_replay.run.setup import build
from rl_replay.rundir import env_state_file, safe_tree, trust
from rl_replay.rundir.checkpoint import checkpoint_path, load_checkpoint
from rl_replay.rundir.env_state_file import ENV_STATE_NAME, read_env_state, run_binding
from rl_replay.rundir.files import Dir

REPO = Path(__file__).resolve().parents[2]
TESTS = Path(__file__).resolve().parents[1]


def tiny(run_dir, updates, *extra):
    return _runs.tiny(run_dir, updates, *extra, base=TINY)


class Plant:
    """Unpickling this calls ``open(path, "w")``: the file appears if anything unpickles it."""

    def __init__(self, path):
        self.path = str(path)

    def __reduce__(self):
        return (open, (self.path, "w"))


def _close(trainer):
    trainer.close()
    trainer.collector.envs.close()


def _metrics(run_dir):
    rows = [json.loads(line) for line in (Path(run_dir) / "metrics.jsonl").read_text().splitlines()]
    return [{k: v for k, v in row.items() if k.startswith("train/") or k in ("update", "env_steps")} for row in rows]


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """A finished 2-update run of this user's, with env state."""
    run_dir = tmp_path_factory.mktemp("untrusted") / "run"
    build(tiny(run_dir, 2, "checkpoint.every=1")).train()
    return run_dir


def copy_run(src: Path, dst: Path) -> Path:
    dst.mkdir(parents=True)
    for p in src.iterdir():
        if p.is_file() and p.name != ".lock":
            (dst / p.name).write_bytes(p.read_bytes())
    return dst


def _legacy_state(run_dir: Path, marker: Path) -> dict:
    """The run's checkpoint as the old pickled layout held it, plus the attacker's entry."""
    state = load_checkpoint(run_dir)
    state["x"] = Plant(marker)
    return state


# ------------------------------------------------------------------------ legacy pickles
@pytest.mark.parametrize("layout", ["headed", "bare"])
def test_a_planted_legacy_checkpoint_runs_nothing_under_evaluate_init_from_and_resume(run, tmp_path, layout, capsys):
    victim = copy_run(run, tmp_path / "victim")
    marker = tmp_path / "pwned"
    state = _legacy_state(run, marker)
    if layout == "headed":
        write_headed_pickle(state, checkpoint_path(victim))
    else:
        torch.save(state, checkpoint_path(victim))
    (victim / "checkpoint.prev.pt").unlink()  # a fallback would hide what the latest file does
    kind = "in the format-1 layout" if layout == "headed" else r"a bare torch.save file \(no header\)"
    refusal = (
        rf"checkpoint {re.escape(str(checkpoint_path(victim)))} is {kind}: a pickle, which can run any "
        rf"code when loaded, so it is not loaded\. If you trust where it came from, convert it: python "
        rf"scripts/convert_checkpoint\.py {re.escape(str(checkpoint_path(victim)))} --trust$"
    )

    assert evaluate_main([str(victim), "--episodes", "1"]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and re.fullmatch("error: " + refusal, err), err
    with pytest.raises(SetupError, match="init_from=.*" + refusal):
        build(tiny(tmp_path / "warm", 1, f"init_from={victim}"))
    with pytest.raises(SetupError, match=refusal):
        build(resume=victim)
    assert not marker.exists()
    assert not (tmp_path / "warm").exists()


def test_the_scripts_refuse_a_planted_checkpoint_in_one_line_with_exit_code_2(run, tmp_path):
    victim = copy_run(run, tmp_path / "victim")
    marker = tmp_path / "pwned"
    write_headed_pickle(_legacy_state(run, marker), checkpoint_path(victim))
    (victim / "checkpoint.prev.pt").unlink()
    env = {**os.environ, "OMP_NUM_THREADS": "1", "WANDB_MODE": "disabled", "PYTHONPATH": f"{REPO}{os.pathsep}{TESTS}"}
    commands = {
        "evaluate": [REPO / "scripts" / "evaluate.py", victim, "--episodes", "1"],
        "init_from": [
            REPO / "scripts" / "train.py",
            *TINY,
            f"total_env_steps={BATCH}",
            f"init_from={victim}",
            f"run_dir={tmp_path / 'warm'}",
        ],
        "resume": [REPO / "scripts" / "train.py", "--resume", victim],
    }
    for name, args in commands.items():
        proc = subprocess.run(
            [sys.executable, *map(str, args)], env=env, cwd=tmp_path, capture_output=True, text=True, timeout=240
        )
        lines = proc.stderr.strip().splitlines()
        assert proc.returncode == 2 and len(lines) == 1 and "convert_checkpoint.py" in lines[0], (name, proc.stderr)
    assert not marker.exists()


def test_convert_needs_trust_and_then_gives_a_checkpoint_that_resumes_with_its_envs(run, tmp_path, capsys):
    victim = copy_run(run, tmp_path / "old")
    state = load_checkpoint(run)
    found = read_env_state(run, state["env_state"], trust.user_secret(), run_binding(run))
    for rank, collector in enumerate(state["collector"]):  # the old layout: env pickles inside
        collector["envs"] = found.pickles[rank]
    del state["env_state"]
    (victim / ENV_STATE_NAME).unlink()
    (victim / "env_state.prev.pkl").unlink()
    write_headed_pickle(state, checkpoint_path(victim))

    assert convert_main([str(victim)]) == 2
    assert "pass --trust if you trust where it came from" in capsys.readouterr().err
    assert convert_main([str(victim), "--trust"]) == 0
    assert "converted" in capsys.readouterr().out
    assert (victim / "checkpoint.pt.legacy").exists() and load_checkpoint(victim)["update"] == 2
    assert convert_main([str(victim), "--trust"]) == 0  # already converted: left alone
    assert "already in the current format" in capsys.readouterr().out
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*environment state.*")  # the envs come back
        resumed = build(resume=victim, overrides=(f"total_env_steps={3 * BATCH}",))
    try:
        assert resumed.update == 2
    finally:
        _close(resumed)


# --------------------------------------------------------------------- the env-state pickle
def _plant_env_state(victim: Path, marker: Path, key: bytes | None) -> None:
    """Replace the env pickles with the attacker's, recompute the checksums and point the
    checkpoint at them; sign with ``key`` (an attacker's own), or keep the old MAC (None)."""
    path = victim / ENV_STATE_NAME
    header, _, _ = path.read_bytes().partition(b"\n")
    fields = dict(part.split("=", 1) for part in header.decode().split()[2:])
    data = safe_tree.dumps([__import__("pickle").dumps(Plant(marker))])
    fields["sha256"], fields["size"] = hashlib.sha256(data).hexdigest(), str(len(data))
    if key is not None:
        bound = env_state_file._bound(run_binding(victim), data)  # the MAC as a signer would make it
        fields["key"], fields["hmac-sha256"] = trust.fingerprint(key), trust.sign(bound, key)
    path.write_bytes(("RLREPLAY-ENVSTATE 2 " + " ".join(f"{k}={v}" for k, v in fields.items()) + "\n").encode() + data)
    state = load_checkpoint(victim)
    state["env_state"] = fields["sha256"]
    write_format2(state, checkpoint_path(victim))


@pytest.mark.parametrize("signer", ["tampered", "attacker_key"])
def test_a_planted_env_state_is_never_unpickled_and_the_resume_starts_fresh_episodes(run, tmp_path, signer):
    victim = copy_run(run, tmp_path / "victim")
    marker = tmp_path / "pwned"
    _plant_env_state(victim, marker, None if signer == "tampered" else os.urandom(32))
    assert evaluate_main([str(victim), "--episodes", "1"]) == 0  # evaluation never reads it
    build(tiny(tmp_path / "warm", 1, f"init_from={victim}")).train()  # nor does a warm start
    with pytest.warns(UserWarning) as caught:
        resumed = build(resume=victim, overrides=(f"total_env_steps={3 * BATCH}",))
    try:
        why = "or changed since" if signer == "tampered" else "written by another user or machine"
        messages = [str(w.message) for w in caught if "environment state is not used" in str(w.message)]
        assert len(messages) == 1 and why in messages[0] and "--trust-env-state" in messages[0], messages
        assert "\n" not in messages[0]
        assert resumed.update == 2 and not marker.exists()
        assert (resumed.collector.episodes.ep_length == 0).all()  # fresh episodes
        resumed.train()
    finally:
        _close(resumed)
    assert not marker.exists()


def test_a_run_copied_to_another_user_resumes_with_fresh_envs_or_exactly_with_the_trust_flag(tmp_path, monkeypatch):
    build(tiny(tmp_path / "full", 4)).train()
    build(tiny(tmp_path / "part", 2)).train()
    for name in ("fresh", "trusted"):
        copy_run(tmp_path / "part", tmp_path / name)
    own = load_checkpoint(tmp_path / "part")
    monkeypatch.setenv("RL_REPLAY_CONFIG_DIR", str(tmp_path / "other_user"))  # another account's secret

    with pytest.warns(UserWarning, match="written by another user or machine .*--trust-env-state"):
        fresh = build(resume=tmp_path / "fresh", overrides=(f"total_env_steps={4 * BATCH}",))
    try:  # weights, optimizer and counters resumed; episodes start afresh
        assert fresh.update == 2 and fresh.env_steps == 2 * BATCH
        assert all(torch.equal(v, own["agent"][k]) for k, v in fresh.model.state_dict().items())
        assert fresh.optimizer.state_dict()["state"]
        assert (fresh.collector.episodes.ep_length == 0).all()
    finally:
        _close(fresh)
    assert (tmp_path / "other_user" / "secret.key").exists()

    trusted = build(resume=tmp_path / "trusted", overrides=(f"total_env_steps={4 * BATCH}",), trust_env_state=True)
    trusted.train()
    assert _metrics(tmp_path / "trusted") == _metrics(tmp_path / "full")  # exact, as if never copied


def test_the_trust_flag_names_the_risk_and_needs_resume(run, tmp_path):
    victim = copy_run(run, tmp_path / "victim")
    env = {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        "WANDB_MODE": "disabled",
        "RL_REPLAY_CONFIG_DIR": str(tmp_path / "other_user"),
    }
    train = str(REPO / "scripts" / "train.py")
    proc = subprocess.run(
        [sys.executable, train, "--resume", str(victim), "--trust-env-state", f"total_env_steps={3 * BATCH}"],
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert proc.returncode == 0, proc.stderr
    assert re.search(
        r"warning: --trust-env-state: unpickling .*env_state\.pkl, which was written by another user "
        r"or machine .*a pickle can run any code",
        proc.stderr,
    ), proc.stderr
    proc = subprocess.run(
        [sys.executable, train, "--trust-env-state"], env=env, capture_output=True, text=True, timeout=240
    )
    assert proc.returncode == 2 and "--trust-env-state applies to --resume" in proc.stderr


def test_env_state_is_found_by_the_checksum_its_checkpoint_names(run, tmp_path):
    """A kill between the env-state write and the checkpoint write leaves the checkpoint's own
    env state as env_state.prev.pkl: it is found there, and a stray one is never used."""
    victim = copy_run(run, tmp_path / "victim")
    key = trust.user_secret()
    digest = load_checkpoint(victim)["env_state"]
    (victim / ENV_STATE_NAME).rename(victim / "env_state.prev.pkl")
    from rl_replay.rundir.env_state_file import save_env_state

    (tmp_path / "elsewhere").mkdir()
    with Dir.open(tmp_path / "elsewhere") as elsewhere:
        save_env_state([b"not the checkpoint's"], elsewhere, key, run_binding(victim))
    (tmp_path / "elsewhere" / ENV_STATE_NAME).rename(victim / ENV_STATE_NAME)
    found = read_env_state(victim, digest, key, run_binding(victim))
    assert found.pickles is not None and found.note is None
    (victim / "env_state.prev.pkl").unlink()
    found = read_env_state(victim, digest, key, run_binding(victim))
    assert found.pickles is None and "no env-state file of this checkpoint" in found.note


# -------------------------------------------------------------- what a checkpoint must hold
def test_a_checkpoint_lacking_what_the_command_needs_is_one_line(run, tmp_path, capsys):
    victim = copy_run(run, tmp_path / "victim")
    (victim / "checkpoint.prev.pt").unlink()
    write_format2({"agent": {"bogus": torch.zeros(2)}, "update": 1, "env_steps": 16}, checkpoint_path(victim))
    assert evaluate_main([str(victim), "--episodes", "1"]) == 2
    err = capsys.readouterr().err.strip()
    assert re.fullmatch(
        rf"error: checkpoint {re.escape(str(checkpoint_path(victim)))} does not fit the agent its "
        r"config\.yaml builds \(missing .*; unexpected bogus\): .*",
        err,
    ), err
    with pytest.raises(
        SetupError,
        match=rf"checkpoint {re.escape(str(checkpoint_path(victim)))} lacks 'optimizer', "
        r"'collector', 'rng', 'recent_returns', 'config', 'world_size', which "
        r"--resume needs",
    ):
        build(resume=victim)
    write_format2({"agent": {}}, checkpoint_path(victim))
    assert evaluate_main([str(victim), "--episodes", "1"]) == 2
    assert "lacks 'update', 'env_steps', which evaluation needs" in capsys.readouterr().err


# ----------------------------------------------------------------- foreign config targets
@pytest.mark.parametrize(
    "override, message",
    [
        (
            "agent.target=custom_agent_module:plant_marker",
            r"agent\.target 'custom_agent_module:plant_marker' is "
            r"<function plant_marker .*>, not a subclass of rl_replay\.Agent",
        ),
        (
            "env.wrappers=[{target: 'custom_agent_module:plant_marker'}]",
            r"env\.wrappers\[0\]\.target 'custom_agent_module:plant_marker' is <function .*>, not a gymnasium\.Wrapper "
            r"subclass",
        ),
        ("env.id=custom_agent_module:plant_marker", r"unknown environment id 'plant_marker'"),
    ],
)
def test_a_foreign_config_calls_nothing_but_agents_wrappers_and_registered_envs(
    run, tmp_path, override, message, capsys, monkeypatch
):
    """Without --trust-config the module is not even imported (tests/run/test_hostile_runs.py);
    trusted, what it names is still only called if it is an agent, a wrapper or a registered id."""
    import custom_agent_module

    victim = copy_run(run, tmp_path / "victim")
    marker = tmp_path / "pwned"
    monkeypatch.setattr(custom_agent_module, "MARKER", str(marker))
    cfg = load_config(victim / "config.yaml", [override])
    from rl_replay.config import dump_config

    (victim / "config.yaml").write_text(dump_config(cfg))
    assert evaluate_main([str(victim), "--episodes", "1"]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "names module 'custom_agent_module'" in err and "--trust-config" in err, err
    assert evaluate_main([str(victim), "--episodes", "1", "--trust-config"]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and re.search(message, err), err
    assert not marker.exists()


# ------------------------------------------------------------------------- the secret
def test_the_secret_is_made_private_on_first_use_and_refused_when_others_can_read_it(tmp_path, monkeypatch):
    monkeypatch.setenv("RL_REPLAY_CONFIG_DIR", str(tmp_path / "cfg"))
    key = trust.user_secret()
    path = tmp_path / "cfg" / "secret.key"
    assert len(key) == 32 and trust.user_secret() == key
    assert stat.S_IMODE(path.stat().st_mode) == 0o600 and stat.S_IMODE(path.parent.stat().st_mode) == 0o700
    path.chmod(0o644)
    with pytest.raises(
        SetupError,
        match=rf"{re.escape(str(path))} is readable by other users \(mode 0644\).*"
        rf"chmod 600 {re.escape(str(path))}$",
    ):
        trust.user_secret()
    monkeypatch.delenv("RL_REPLAY_CONFIG_DIR")
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "xdg"))
    assert trust.secret_path() == tmp_path / "xdg" / "rl_replay" / "secret.key"
    assert trust.user_secret() != key
    assert trust.verify(b"data", trust.sign(b"data", key), key) and not trust.verify(
        b"data!", trust.sign(b"data", key), key
    )
