"""A wider hostile round: what a careful attacker tries once the obvious holes are closed.

Each test is one class of attack on a real run of this user's (or on this user's secret), run
through the command a user would, in process. As in :mod:`test_hostile_runs`, a refusal is one
``error:`` line, nothing outside the run changes, and the memory cases run under an
address-space limit a few GiB above what the process already maps.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import stat
import subprocess
import sys
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
    write_foreign_config,
)

from rl_replay.errors import SetupError
from rl_replay.run.cli import evaluate_main, train_main
from rl_replay.rundir import safe_tree, trust
from rl_replay.rundir.checkpoint import checkpoint_path, load_checkpoint, save_checkpoint
from rl_replay.rundir.env_state_file import ENV_STATE_NAME

REPO = Path(__file__).resolve().parents[2]


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


@pytest.mark.parametrize(
    "other_run",
    [("seed=7",), ("env.kwargs={sutton_barto_reward: true}",)],
    ids=["another-run-of-this-user", "other-env-kwargs"],
)
def test_an_env_state_of_another_run_or_other_envs_is_not_taken_when_a_checkpoint_names_it(run, tmp_path, other_run):
    other = tmp_path / "other"
    assert train_main([*TINY, "total_env_steps=32", *other_run, f"run_dir={other}"]) == 0
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


# ------------------------------------------------------- config values checked as data before building
def _edited(run: Path, tmp_path: Path, *overrides: str) -> Path:
    """A copy of ``run`` whose config.yaml is edited (unsigned now: a foreign config)."""
    victim = copy_run(run, tmp_path / "victim")
    write_foreign_config(victim, *overrides)
    return victim


def _edited_text(run: Path, tmp_path: Path, line: str) -> Path:
    """A copy of ``run`` whose config.yaml gets ``line`` at its top level, as a text editor would
    (no validation on the way: what a hand-made file can hold)."""
    victim = copy_run(run, tmp_path / "victim")
    body = (victim / "config.yaml").read_text().partition("\n")[2]  # without its signature
    key = line.partition(":")[0]
    (victim / "config.yaml").write_text(re.sub(rf"(?m)^{key}:.*$", line, body))
    return victim


def test_a_huge_thread_count_is_one_line_not_an_allocator_abort(run, tmp_path):
    victim = _edited_text(run, tmp_path, "torch_threads: 100000")
    for command in (
        ["scripts/evaluate.py", str(victim), "--episodes", "1"],
        ["scripts/train.py", "--resume", str(victim)],
    ):
        done = subprocess.run([sys.executable, *command], cwd=REPO, capture_output=True, text=True, timeout=300)
        assert done.returncode == 2, done.stderr[-2000:]
        assert (
            done.stderr.strip().splitlines()[-1].startswith("error: Out of range value for config key 'torch_threads'")
        )


@pytest.mark.parametrize(
    "override, words",
    [
        ("agent.kwargs={hidden_sizes: [-4]}", "negative dimension"),
        ("agent.kwargs={hidden_sizes: [100000, 100000]}", "more than this process can have"),
        ("env.wrappers=[{target: 'gymnasium.wrappers:TransformReward', kwargs: {func: 1}}]", "in TransformReward"),
    ],
    ids=["negative", "huge-agent", "wrapper-when-stepped"],
)
def test_bad_sizes_and_wrappers_are_one_line_under_evaluate_and_resume(run, tmp_path, capsys, override, words):
    victim = _edited(run, tmp_path, override)
    with address_space_limit():
        assert evaluate_main([str(victim), "--episodes", "1"]) == 2
        assert words in error_line(capsys)
        before = files_of(victim)
        assert resume(victim, "total_env_steps=48") == 2
        line = error_line(capsys)
        assert words in line or "its checkpoint was written with" in line  # (a resume keeps its agent)
    assert files_of(victim) == before


def test_a_billion_step_rollout_on_resume_is_refused_before_it_grows(run, tmp_path, capsys):
    victim = copy_run(run, tmp_path / "victim")
    before = files_of(victim)
    with address_space_limit():
        assert resume(victim, "collector.num_steps=1000000000", "total_env_steps=4000000000") == 2
    assert "collector.num_steps" in error_line(capsys)
    assert files_of(victim) == before


def test_a_rollout_larger_than_memory_is_one_line_before_building(run, tmp_path, capsys):
    with address_space_limit():
        code = train_main([*TINY, "env.num_envs=64", "collector.num_steps=16000000", f"run_dir={tmp_path / 'new'}"])
    assert code == 2 and "a rollout of 64 envs x 16000000 steps" in error_line(capsys)
    assert not (tmp_path / "new").exists()


def test_a_missing_optional_dependency_is_one_line_naming_what_to_install(run, tmp_path, capsys):
    pytest.importorskip("gymnasium")
    if importlib.util.find_spec("Box2D") is not None:
        pytest.skip("Box2D is installed here")
    victim = _edited(run, tmp_path, "env.id=LunarLander-v3")
    assert evaluate_main([str(victim), "--episodes", "1"]) == 2
    line = error_line(capsys)
    assert "needs an optional dependency" in line and "pip install" in line and "box2d" in line


@pytest.mark.parametrize(
    "overrides, module",
    [
        (("env.id=GymV26Environment-v0", "env.kwargs={env_id: 'os:system'}"), "os"),
        (
            ("env.wrappers=[{target: 'gymnasium.wrappers:TransformReward', kwargs: {func: 'subprocess:call'}}]",),
            "subprocess",
        ),
    ],
    ids=["env-kwargs", "wrapper-kwargs"],
)
def test_a_module_named_in_kwargs_counts_as_a_foreign_target(run, tmp_path, capsys, overrides, module):
    victim = _edited(run, tmp_path, *overrides)
    assert evaluate_main([str(victim), "--episodes", "1"]) == 2
    line = error_line(capsys)
    assert f"names module '{module}', which is not part of rl_replay or gymnasium" in line and "--trust-config" in line


def test_an_id_registered_by_another_package_counts_as_a_foreign_target(run, tmp_path, capsys):
    import gymnasium as gym

    gym.register("RlReplayElsewhere-v0", entry_point="json.decoder:JSONDecoder")  # registered by someone else
    try:
        victim = _edited(run, tmp_path, "env.id=RlReplayElsewhere-v0")
        assert evaluate_main([str(victim), "--episodes", "1"]) == 2
        assert "names module 'json.decoder'" in error_line(capsys)
    finally:
        gym.registry.pop("RlReplayElsewhere-v0")


def test_a_config_accepted_is_a_config_that_writes_back_readable(tmp_path):
    """A value nested past what a checkpoint's tree reads back is refused when the config is read,
    not after a resume wrote a checkpoint no later resume can read (it would fall back silently)."""
    from rl_replay.config import config_to_dict, loads_config

    def nested(depth):
        return "{a: " * depth + "1" + "}" * depth

    with pytest.raises(ValueError, match=r"'env.kwargs' nests deeper than 16 levels"):
        loads_config("", [f"env.kwargs={nested(60)}"])  # (a checkpoint's tree reads 64 levels, the config sits 3 deep)
    deepest = loads_config("", [f"env.kwargs={nested(16)}"])
    path = tmp_path / "checkpoint.pt"
    save_checkpoint({"agent": {}, "config": config_to_dict(deepest)}, path)  # as a trainer's checkpoint nests it
    assert load_checkpoint(path)["config"]["env"]["kwargs"] == config_to_dict(deepest)["env"]["kwargs"]


# ------------------------------------------------------------ a run directory held by its descriptor
def test_a_directory_swapped_for_a_link_mid_resume_writes_nothing_into_the_other_run(run, tmp_path):
    from rl_replay.run.setup import build

    victim, other = copy_run(run, tmp_path / "victim"), copy_run(run, tmp_path / "other")
    before = files_of(other)
    trainer = build(resume=victim, overrides=("total_env_steps=48",))
    try:
        victim.rename(tmp_path / "opened")  # the directory the resume opened, under another name now
        victim.symlink_to(other)  # and the path it was given points into another run
        trainer.train()
    finally:
        trainer.close()
    assert files_of(other) == before
    assert load_checkpoint(tmp_path / "opened")["update"] == 3  # the checkpoint went where the run is


def test_a_run_directory_that_is_a_link_is_refused_in_one_line(run, tmp_path, capsys):
    link = tmp_path / "link"
    link.symlink_to(run)
    assert evaluate_main([str(link), "--episodes", "1"]) == 2
    assert "is a symbolic link" in error_line(capsys)
    assert resume(link) == 2
    assert "is a symbolic link" in error_line(capsys)


@pytest.mark.parametrize("kind", ["directory", "fifo"])
def test_a_stale_temporary_that_is_not_a_file_is_refused_by_name(run, tmp_path, capsys, kind):
    victim = copy_run(run, tmp_path / "victim")
    odd = victim / ".checkpoint.pt.abc123.tmp"
    odd.mkdir() if kind == "directory" else os.mkfifo(odd)
    before = files_of(victim)
    assert resume(victim, "total_env_steps=48") == 2
    line = error_line(capsys)
    assert ".checkpoint.pt.abc123.tmp has the name of a temporary file" in line and "remove it" in line, line
    assert files_of(victim) == before and odd.exists()


# --------------------------------------------------------------------- every quoted value shortened
def test_a_resume_refusal_quotes_a_huge_value_shortened(run, tmp_path, capsys):
    victim = copy_run(run, tmp_path / "victim")
    assert resume(victim, "agent.kwargs={hidden_sizes: [16], note: '" + "A" * 600_000 + "'}") == 2
    line = error_line(capsys)
    assert "its checkpoint was written with" in line and len(line) < 2000, len(line)


# -------------------------------------------------------------------------- tools through the door
def _tool(script: str, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, str(REPO / "scripts" / script), *args], capture_output=True, text=True, timeout=300
    )


def test_the_tools_skip_a_cut_last_metrics_line_with_a_note(run, tmp_path):
    victim = copy_run(run, tmp_path / "victim")
    with open(victim / "metrics.jsonl", "ab") as f:
        f.write(b'{"update": 3, "env_st')  # a row cut short by a kill
    for script, extra in (
        ("tools/summarize_curve.py", ["--key", "rollout/return_mean"]),
        ("tools/plot_metrics.py", []),
    ):
        done = _tool(script, str(victim), *extra)
        assert done.returncode == 0, done.stderr
        assert "line 3 is not a whole row" in done.stderr and "skipped" in done.stderr, (script, done.stderr)


@pytest.mark.parametrize("script", ["tools/summarize_curve.py", "tools/plot_metrics.py"])
def test_the_tools_follow_no_link_and_check_sizes_before_reading(run, tmp_path, script):
    secret = tmp_path / "private.jsonl"
    secret.write_text('{"update": 1, "env_steps": 1, "rollout/return_mean": 42}\n')
    linked = copy_run(run, tmp_path / "linked")
    (linked / "metrics.jsonl").unlink()
    (linked / "metrics.jsonl").symlink_to(secret)
    done = _tool(script, str(linked))
    assert done.returncode != 0 and "is a symbolic link" in done.stderr and "42" not in done.stdout, done
    huge = copy_run(run, tmp_path / "huge")
    with open(huge / "metrics.jsonl", "wb") as f:  # one endless line (a sparse hole reads as zeros)
        f.truncate(1 << 31)
    done = _tool(script, str(huge))
    assert done.returncode != 0 and "is longer than" in done.stderr, done.stderr[-2000:]
    assert len(done.stderr.strip().splitlines()) == 1, done.stderr[-2000:]


def test_popgym_table_escapes_what_a_run_says(tmp_path):
    from rl_replay.config import dump_config, load_config

    d = tmp_path / "run"
    d.mkdir()
    (d / "config.yaml").write_text(dump_config(load_config(REPO / "configs" / "popgym" / "higher_lower_easy.yaml")))
    text = (d / "config.yaml").read_text()  # an env id that drives the terminal (YAML's escapes)
    (d / "config.yaml").write_text(re.sub(r"(?m)^  id: .*$", lambda _: '  id: "popgym-Evil\\e]0;owned\\a-v0"', text))
    (d / "metrics.jsonl").write_text(
        json.dumps({"update": 1, "env_steps": 65_536, "rollout/episodes": 100, "rollout/return_recent": 0.5}) + "\n"
    )
    done = _tool("tools/popgym_table.py", str(d))
    assert "\x1b" not in done.stdout + done.stderr and "\x07" not in done.stdout + done.stderr, done
    assert "Evil\\x1b]0;owned\\x07" in done.stdout + done.stderr, done


def test_non_finite_weights_are_one_line_for_the_tools_that_load_an_agent(tmp_path):
    run_dir = tmp_path / "cue"
    code = train_main(
        [
            "env.id=rl_replay/MemoryCue-v0",
            "env.kwargs={delay: 4}",
            "agent.target=gru",
            "agent.kwargs={hidden_size: 8}",
            "env.num_envs=2",
            "collector.num_steps=8",
            "total_env_steps=16",
            "log.progress=false",
            f"run_dir={run_dir}",
        ]
    )
    assert code == 0
    state = load_checkpoint(run_dir)
    name = next(iter(state["agent"]))
    state["agent"][name] = torch.full_like(state["agent"][name], float("nan"))
    write_format2(state, checkpoint_path(run_dir))
    done = _tool("grad_horizon.py", "--run", str(run_dir), "--delays", "4")
    assert done.returncode != 0 and "non-finite agent weights" in done.stderr, done.stderr[-2000:]
    assert len(done.stderr.strip().splitlines()) == 1, done.stderr[-2000:]


def test_a_wrapper_failing_mid_episode_is_one_line_naming_it_under_evaluate_and_resume(tmp_path, capsys):
    run_dir = tmp_path / "run"
    wrapper = "env.wrappers=[{target: 'obs_envs:FailsLater', kwargs: {after: 17}}]"
    assert train_main([*TINY, wrapper, "total_env_steps=32", f"run_dir={run_dir}"]) == 0  # 16 steps per env
    assert evaluate_main([str(run_dir), "--episodes", "5", "--num-envs", "1"]) == 2
    line = error_line(capsys)
    assert "failed when stepped, in FailsLater (ZeroDivisionError: a reward scale of 0)" in line, line
    assert resume(run_dir, "total_env_steps=64") == 1  # mid-run: the run stops, its last checkpoint kept
    line = error_line(capsys)
    assert "failed when stepped, in FailsLater (ZeroDivisionError: a reward scale of 0)" in line, line
    assert load_checkpoint(run_dir)["update"] == 2
