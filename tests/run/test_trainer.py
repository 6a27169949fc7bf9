"""Trainer end to end on tiny configs: setup errors before any output, exact resume after a
kill, custom agents through the config, logged metrics and wandb offline output."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import gymnasium as gym
import numpy as np
import pytest
import torch

from rl_replay.config import load_config
from rl_replay.errors import SetupError
from rl_replay.run.setup import build
from rl_replay.rundir.checkpoint import checkpoint_path, load_checkpoint

REPO = Path(__file__).resolve().parents[2]
TESTS = Path(__file__).resolve().parents[1]

TINY = (
    "env.id=CartPole-v1",
    "env.num_envs=2",
    "collector.num_steps=8",
    "agent.kwargs={hidden_sizes: [16, 16]}",
    "log.progress=false",
    "log.wandb_mode=disabled",
)
BATCH = 2 * 8  # env steps per update


def tiny_cfg(run_dir, updates, *extra):
    return load_config(None, [*TINY, f"total_env_steps={updates * BATCH}", f"run_dir={run_dir}", *extra])


def read_metrics(run_dir):
    return [json.loads(line) for line in (Path(run_dir) / "metrics.jsonl").read_text().splitlines()]


def assert_same_training_state(a: dict, b: dict):
    assert a["update"] == b["update"] and a["env_steps"] == b["env_steps"]
    assert a["agent"].keys() == b["agent"].keys()
    for k in a["agent"]:
        assert torch.equal(a["agent"][k], b["agent"][k]), f"agent parameter {k} differs"
    oa, ob = a["optimizer"], b["optimizer"]
    assert oa["param_groups"] == ob["param_groups"]
    assert oa["state"].keys() == ob["state"].keys()
    for i in oa["state"]:
        for k, v in oa["state"][i].items():
            assert torch.equal(v, ob["state"][i][k]), f"optimizer state {i}.{k} differs"


# ------------------------------------------------------------------ setup errors
class DictActionEnv(gym.Env):
    observation_space = gym.spaces.Box(-1.0, 1.0, shape=(2,), dtype=np.float32)
    action_space = gym.spaces.Dict({"move": gym.spaces.Discrete(2), "speed": gym.spaces.Discrete(3)})

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        return np.zeros(2, dtype=np.float32), {}

    def step(self, action):
        return np.zeros(2, dtype=np.float32), 0.0, True, False, {}


DICT_ENV_ID = "test_trainer/DictAction-v0"
if DICT_ENV_ID not in gym.registry:
    gym.register(id=DICT_ENV_ID, entry_point=DictActionEnv, max_episode_steps=10)


@pytest.mark.parametrize(
    "override, match",
    [
        ("env.id=NoSuchEnv-v7", "unknown environment id 'NoSuchEnv-v7'"),
        ("agent.target=no_such_pkg.policies:Agent", "cannot import module 'no_such_pkg.policies'"),
        ("agent.target=rl_replay.agents.mlp:Missing", "has no attribute 'Missing'"),
        (f"env.id={DICT_ENV_ID}", "MLPAgent cannot handle action space Dict"),
        ("distributed.cpu_offload=true", "cpu_offload applies to FSDP runs under torchrun"),
    ],
    ids=["env-id", "agent-module", "agent-attr", "action-space", "cpu-offload"],
)
def test_build_errors_before_run_dir(tmp_path, monkeypatch, override, match):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SetupError, match=match):
        build(tiny_cfg(tmp_path / "run", 2, override))
    assert not (tmp_path / "run").exists()
    assert list(tmp_path.iterdir()) == []  # nothing written anywhere (not even runs/ or wandb/)


@pytest.mark.parametrize("fails", ["contract", "logger", "rng"])
def test_failed_build_closes_envs_and_releases_the_run_dir(tmp_path, monkeypatch, fails):
    """Whatever step of build() fails, the envs made so far are closed and the run
    directory's lock is released; a resume then succeeds in the same process."""
    import fcntl

    import rl_replay.run.setup as trainer_module
    from rl_replay.rundir.lock import LOCK_NAME

    build(tiny_cfg(tmp_path / "run", 1)).train()
    made = []

    def recording_envs_from_config(*args, **kwargs):
        made.append(real_make(*args, **kwargs))
        return made[-1]

    def broken(*args, **kwargs):
        raise SetupError(f"{fails} broken on purpose")

    real_make = trainer_module.envs_from_config
    monkeypatch.setattr(trainer_module, "envs_from_config", recording_envs_from_config)
    target = {"contract": "check_agent", "logger": "RunLogger", "rng": "restore_trainer_rng"}[fails]
    monkeypatch.setattr(trainer_module, target, broken)
    with pytest.raises(SetupError, match=f"{fails} broken on purpose"):
        build(resume=tmp_path / "run", overrides=("total_env_steps=32",))
    assert len(made) == 1 and made[0].closed
    fd = os.open(tmp_path / "run" / LOCK_NAME, os.O_RDWR)
    try:  # a flock of another open file: refused (BlockingIOError) while the failed build holds it
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    finally:
        os.close(fd)
    monkeypatch.undo()
    resumed = build(resume=tmp_path / "run", overrides=("total_env_steps=32",))
    resumed.train()
    assert resumed.update == 2


def test_resume_of_a_missing_run_directory(tmp_path):
    with pytest.raises(SetupError, match=f"cannot resume {re.escape(str(tmp_path / 'nothing'))}: no such directory"):
        build(resume=tmp_path / "nothing")


# ------------------------------------------------------------------ config on disk
def test_resolved_config_saved_and_reloads_equal(tmp_path):
    cfg = tiny_cfg(tmp_path / "run", 2, "optim.lr=3e-4", "env.kwargs={sutton_barto_reward: true}", "seed=5")
    trainer = build(cfg)
    try:
        saved = load_config(tmp_path / "run" / "config.yaml")
        assert saved == trainer.cfg == cfg
        assert saved.optim.lr == 3e-4 and saved.env.kwargs == {"sutton_barto_reward": True}
        assert saved.run_dir == str(tmp_path / "run")
    finally:
        trainer.logger.close()
        trainer.collector.envs.close()


# ------------------------------------------------------------------ resume
def test_kill_and_resume_matches_uninterrupted_run(tmp_path):
    updates = 60
    cfg_file = tmp_path / "tiny.yaml"
    run_b = tmp_path / "b"
    cfg_file.write_text(
        f"total_env_steps: {updates * BATCH}\nrun_dir: {run_b}\nenv: {{id: CartPole-v1, num_envs: 2}}\n"
        "agent: {kwargs: {hidden_sizes: [16, 16]}}\ncollector: {num_steps: 8}\n"
        "log: {progress: false, wandb_mode: disabled}\ncheckpoint: {every: 5}\n"
    )
    proc = subprocess.Popen(
        [sys.executable, str(REPO / "scripts" / "train.py"), "--config", str(cfg_file)],
        cwd=tmp_path,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        env={**os.environ, "OMP_NUM_THREADS": "1"},  # same thread count as this process
    )
    try:
        deadline = time.monotonic() + 120
        while not checkpoint_path(run_b).exists() and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.005)
        proc.send_signal(signal.SIGKILL)  # a no-op if the run already finished (and was reaped)
    finally:
        if proc.poll() is None:
            proc.kill()
        _, err = proc.communicate(timeout=60)
    assert checkpoint_path(run_b).exists(), err.decode()
    killed_at = load_checkpoint(run_b)["update"]
    print(f"subprocess killed after checkpoint at update {killed_at} (returncode {proc.returncode})")
    assert killed_at % 5 == 0 or killed_at == updates

    # Uninterrupted run A of the same length, in this process (checkpointing more often).
    run_a = tmp_path / "a"
    build(load_config(cfg_file, [f"run_dir={run_a}", "checkpoint.every=2"])).train()

    resumed = build(resume=run_b)
    assert resumed.update == killed_at and resumed.env_steps == killed_at * BATCH
    resumed.train()
    assert resumed.update == updates

    assert_same_training_state(load_checkpoint(run_a), load_checkpoint(run_b))
    for name, metrics in (("a", read_metrics(run_a)), ("b", read_metrics(run_b))):
        assert [m["update"] for m in metrics] == list(range(1, updates + 1)), name
        assert [m["env_steps"] for m in metrics] == [u * BATCH for u in range(1, updates + 1)], name
    # Losses logged by the resumed run equal the uninterrupted ones, update by update.
    for ma, mb in zip(read_metrics(run_a), read_metrics(run_b)):
        assert ma["train/loss_policy"] == mb["train/loss_policy"], ma["update"]


def test_resume_in_process_with_more_steps(tmp_path):
    # No lr annealing: its schedule depends on the total, which this resume extends.
    extra = ("collector.num_steps=8", "checkpoint.every=0", "optim.anneal_lr=false")
    build(tiny_cfg(tmp_path / "full", 6, *extra)).train()

    first = build(tiny_cfg(tmp_path / "part", 3, *extra))
    first.train()
    assert first.update == 3
    # Scramble global RNGs: the resume must restore them from the checkpoint.
    torch.manual_seed(12345)
    np.random.seed(12345)
    resumed = build(resume=tmp_path / "part", overrides=(f"total_env_steps={6 * BATCH}",))
    assert resumed.update == 3 and resumed.num_updates == 6
    resumed.train()
    assert resumed.update == 6
    assert_same_training_state(load_checkpoint(tmp_path / "full"), load_checkpoint(tmp_path / "part"))
    assert [m["update"] for m in read_metrics(tmp_path / "part")] == [1, 2, 3, 4, 5, 6]
    assert load_config(tmp_path / "part" / "config.yaml").total_env_steps == 6 * BATCH


def test_state_dict_moved_into_another_trainer_continues_exactly(tmp_path):
    """Trainer.state_dict() -> load_state_dict() on a second trainer, in memory: the next updates
    match the uninterrupted trainer's (weights, optimizer, envs mid-episode and RNG streams)."""
    import copy

    extra = ("checkpoint.every=0", "optim.anneal_lr=false")
    full = build(tiny_cfg(tmp_path / "full", 5, *extra))
    for _ in range(2):
        full.step()
    state = copy.deepcopy(full.state_dict())  # like torch's, the state holds the live tensors
    assert state["update"] == 2 and state["collector"][0]["envs"] is not None
    rows_full = [full.step() for _ in range(3)]

    other = build(tiny_cfg(tmp_path / "other", 5, *extra, "seed=7"))
    torch.manual_seed(999)
    other.load_state_dict(state)
    assert other.update == 2
    rows_other = [other.step() for _ in range(3)]
    for a, b in zip(rows_full, rows_other):
        learned = [k for k in a if not k.startswith(("time/", "memory/"))]
        assert learned and set(learned) == {k for k in b if not k.startswith(("time/", "memory/"))}
        np.testing.assert_equal([a[k] for k in learned], [b[k] for k in learned])  # NaN == NaN here
    after_full, after_other = full.state_dict(), other.state_dict()
    for k in after_full["agent"]:
        assert torch.equal(after_full["agent"][k], after_other["agent"][k]), k
    full.close()
    other.close()


def test_a_run_that_names_its_agent_by_the_old_path_resumes_under_the_short_name(tmp_path):
    # Runs written before the short names hold agent.target: agents.mlp:MLPAgent.
    build(tiny_cfg(tmp_path / "old", 2, "agent.target=agents.mlp:MLPAgent", "checkpoint.every=0")).train()
    with pytest.raises(SetupError, match=r"cannot resume .* with agent\.target='gru'"):
        build(resume=tmp_path / "old", overrides=("agent.target=gru",))
    resumed = build(resume=tmp_path / "old", overrides=("agent.target=mlp", f"total_env_steps={3 * BATCH}"))
    assert type(resumed.model).__name__ == "MLPAgent" and resumed.update == 2
    resumed.train()
    assert [m["update"] for m in read_metrics(tmp_path / "old")] == [1, 2, 3]


# ------------------------------------------------------------------ custom agent
def test_custom_agent_from_config(tmp_path, monkeypatch):
    """TinyAgent is written to the docs from before the one agent shape (a one-step forward): it
    trains, resumes and evaluates through the StepwiseAgent adapter, with a DeprecationWarning."""
    from rl_replay.agent import StepwiseAgent

    monkeypatch.syspath_prepend(str(TESTS))
    cfg = tiny_cfg(tmp_path / "run", 3, "agent.target=custom_agent_module:TinyAgent", "agent.kwargs={hidden: 5}")
    with pytest.warns(DeprecationWarning, match="runs through rl_replay.StepwiseAgent"):
        trainer = build(cfg)
    assert type(trainer.model).__name__ == "TinyAgent" and isinstance(trainer.model, StepwiseAgent)
    assert trainer.model.body[0].out_features == 5
    before = {k: v.clone() for k, v in trainer.model.state_dict().items()}
    trainer.train()
    assert trainer.update == 3
    after = trainer.model.state_dict()
    for k in before:
        assert not torch.equal(before[k], after[k]), f"{k} did not change"
    assert len(read_metrics(tmp_path / "run")) == 3
    # The run's own config (signed with this user's key) names the module: it resumes and evaluates.
    resumed = build(resume=tmp_path / "run", overrides=(f"total_env_steps={4 * BATCH}",))
    assert type(resumed.model).__name__ == "TinyAgent" and resumed.update == 3
    resumed.train()
    assert [r["update"] for r in read_metrics(tmp_path / "run")] == [1, 2, 3, 4]
    from rl_replay.run.cli import evaluate_main

    assert evaluate_main([str(tmp_path / "run"), "--episodes", "1"]) == 0

    with pytest.raises(SetupError, match="not a subclass of rl_replay.Agent"):
        build(tiny_cfg(tmp_path / "bad", 1, "agent.target=custom_agent_module:NotAnAgent"))
    assert not (tmp_path / "bad").exists()


# ------------------------------------------------------------------ smoke + wandb offline
REQUIRED_EVERY_UPDATE = (
    "train/loss_policy",
    "train/loss_value",
    "train/entropy",
    "train/grad_norm",
    "memory/peak_rss_bytes",
    "memory/replay_saved_bytes",
    "time/steps_per_sec",
    "time/replay_backward_sec",
    "env_steps",
    "update",
)
REQUIRED_ONCE = ("rollout/return_mean", "rollout/episode_length")


def test_smoke_training_with_wandb_offline(tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.delenv("WANDB_MODE", raising=False)
    for var in ("WANDB_CONFIG_DIR", "WANDB_CACHE_DIR", "WANDB_DATA_DIR"):
        monkeypatch.setenv(var, str(tmp_path / "wandb_home"))
    run_dir = tmp_path / "run"
    cfg = load_config(
        None,
        [
            "env.num_envs=4",
            "collector.num_steps=16",
            "total_env_steps=2048",
            "agent.kwargs={hidden_sizes: [16, 16]}",
            "log.progress=false",
            "log.wandb_mode=offline",
            f"run_dir={run_dir}",
        ],
    )
    trainer = build(cfg)
    metrics = trainer.train()
    assert trainer.update == 32 and trainer.env_steps == 2048
    assert np.isfinite(metrics["train/loss_policy"])

    lines = read_metrics(run_dir)
    assert [m["update"] for m in lines] == list(range(1, 33))
    assert [m["env_steps"] for m in lines] == [64 * u for u in range(1, 33)]
    for m in lines:
        missing = [k for k in REQUIRED_EVERY_UPDATE if k not in m]
        assert not missing, f"update {m['update']} lacks {missing}"
        # null: nothing to measure (no episode ended, CartPole reports no success); never a loss
        assert all(np.isfinite(v) for k, v in m.items() if not k.startswith("rollout/")), m
        assert all(v is None or np.isfinite(v) for v in m.values()), m
        assert m["memory/replay_saved_bytes"] > 0 and m["memory/peak_rss_bytes"] > 0
        assert m["time/steps_per_sec"] > 0 and m["train/grad_norm"] > 0
    for k in REQUIRED_ONCE:
        assert any(m.get(k) is not None for m in lines), f"{k} never logged"
    returns = [m["rollout/return_mean"] for m in lines if m.get("rollout/return_mean") is not None]
    assert all(r >= 1 for r in returns)  # CartPole pays 1 per step

    offline = sorted((run_dir / "wandb").glob("offline-run-*"))
    assert len(offline) == 1, list((run_dir / "wandb").iterdir()) if (run_dir / "wandb").exists() else None
    assert list(offline[0].glob("*.wandb")), list(offline[0].iterdir())
    assert trainer.logger.wandb_id and trainer.logger.wandb_id in offline[0].name


# ------------------------------------------------------------------ the step budget
def _train_cli(tmp_path, name, *args):
    return subprocess.Popen(
        [
            sys.executable,
            str(REPO / "scripts" / "train.py"),
            *args,
            f"run_dir={tmp_path / name}",
            "log.wandb_mode=disabled",
            "checkpoint.every=0",
        ],
        cwd=tmp_path,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )


def test_total_env_steps_is_reached_in_every_mode_and_the_bar_ends_at_the_steps_taken(tmp_path):
    """Episode mode keeps updating until the budget is reached (an update is as long as its
    longest episode, not the step cap); the last update may overshoot, never fall short,
    and the progress bar's total follows it. The final line shows no NaN."""
    cases = {
        # MemoryCue with delay 4: every episode is 6 steps, 2 envs -> 12 steps an update
        # (not the cap's 40): ceil(100 / 12) = 9 updates, 108 steps.
        "cue": (
            "env.id=rl_replay/MemoryCue-v0",
            "env.kwargs={delay: 4}",
            "collector.mode=episode",
            "collector.num_steps=20",
            "env.num_envs=2",
            "total_env_steps=100",
        ),
        # CartPole episodes of varying length, capped at 50 steps.
        "cartpole": (
            "collector.mode=episode",
            "collector.num_steps=50",
            "env.num_envs=2",
            "agent.kwargs={hidden_sizes: [16]}",
            "total_env_steps=400",
        ),
        # fixed mode, 16 steps an update: 40 steps take 3 updates (48 steps), as before.
        "fixed": ("collector.num_steps=8", "env.num_envs=2", "agent.kwargs={hidden_sizes: [16]}", "total_env_steps=40"),
    }
    procs = {name: _train_cli(tmp_path, name, *args) for name, args in cases.items()}
    for name, proc in procs.items():
        _, err = proc.communicate(timeout=240)
        assert proc.returncode == 0, (name, err)
        rows = read_metrics(tmp_path / name)
        budget = int(cases[name][-1].split("=")[1])
        steps = [r["env_steps"] for r in rows]
        assert steps[-1] >= budget and (len(steps) == 1 or steps[-2] < budget), (name, steps)
        finished = err.strip().splitlines()[-1]
        assert finished.startswith(f"finished {len(rows)} updates, {steps[-1]} env steps: "), (name, finished)
        assert "nan" not in finished, finished
        bar = err.replace("\r", "\n").splitlines()[-2]
        assert f"{steps[-1]}/{steps[-1]} " in bar, (name, bar)
        lrs = [r["train/lr"] for r in rows]
        assert all(a > b > 0 for a, b in zip(lrs, lrs[1:])), (name, lrs)  # annealed, never negative
    cue = read_metrics(tmp_path / "cue")
    assert [r["env_steps"] for r in cue] == [12 * u for u in range(1, 10)]
    assert cue[-1]["train/lr"] == pytest.approx(7e-4 * (1 - 96 / 100))
    assert [r["env_steps"] for r in read_metrics(tmp_path / "fixed")] == [16, 32, 48]


def test_a_custom_agent_target_alone_gets_none_of_the_default_mlp_kwargs(tmp_path):
    """default.yaml's agent.kwargs (hidden_sizes, for the MLP) are not passed to another target."""
    proc = subprocess.run(
        [
            sys.executable,
            str(REPO / "scripts" / "train.py"),
            "agent.target=custom_agent_module:TinyAgent",
            "total_env_steps=16",
            "env.num_envs=2",
            "collector.num_steps=8",
            "log.progress=false",
            "log.wandb_mode=disabled",
            f"run_dir={tmp_path / 'run'}",
        ],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=240,
        env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": os.pathsep.join([str(REPO), str(TESTS)])},
    )
    assert proc.returncode == 0, proc.stderr
    saved = load_config(tmp_path / "run" / "config.yaml")
    assert saved.agent.target == "custom_agent_module:TinyAgent" and saved.agent.kwargs == {}


def test_truncate_metrics_drops_later_and_partial_lines(tmp_path):
    from rl_replay.run.logger import truncate_metrics

    path = tmp_path / "metrics.jsonl"
    path.write_text('{"update": 1, "x": 1}\n{"update": 2, "x": 2}\n{"update": 3, "x": 3}\n{"update": 4, "x"')
    truncate_metrics(path, 2)
    assert [json.loads(line)["update"] for line in path.read_text().splitlines()] == [1, 2]


def test_keep_freed_memory_applies_with_glibc():
    import platform

    from rl_replay.engine import keep_freed_memory

    glibc = platform.libc_ver()[0] == "glibc"
    assert keep_freed_memory() is glibc


# ------------------------------------------------------------------ evaluation during training
def test_eval_every_logs_eval_metrics_and_leaves_training_untouched(tmp_path):
    # Sampled (not greedy) evaluation draws from torch's RNG: the training that follows must
    # still be bit-identical to a run without evaluation (RNG streams and train mode restored).
    extra = ("checkpoint.every=0", "eval.episodes=3", "eval.deterministic=false")
    plain = build(tiny_cfg(tmp_path / "plain", 5, *extra))
    plain.train()
    evald = build(tiny_cfg(tmp_path / "eval", 5, *extra, "eval.every=2"))
    evald.train()
    assert evald.model.training
    assert_same_training_state(load_checkpoint(tmp_path / "plain"), load_checkpoint(tmp_path / "eval"))
    rows = read_metrics(tmp_path / "eval")
    evaluated = [r["update"] for r in rows if r.get("eval/return_mean") is not None]
    assert evaluated == [2, 4, 5]  # every 2 updates and at the end
    for r in rows:
        if r["update"] in evaluated:
            # CartPole returns: one per step survived, at least 1 and at most 500.
            assert 1 <= r["eval/return_mean"] <= 500 and r["eval/episode_length"] >= 1
            assert r["eval/success_rate"] is None  # CartPole reports no success
            assert r["time/eval_sec"] > 0
        else:
            assert "eval/return_mean" not in r or r["eval/return_mean"] is None
    assert all("eval/return_mean" not in r for r in read_metrics(tmp_path / "plain"))


def test_eval_every_on_memory_cue_reports_success(tmp_path):
    cfg = load_config(
        None,
        [
            "env.id=rl_replay/MemoryCue-v0",
            "env.kwargs={delay: 3}",
            "env.num_envs=4",
            "collector.num_steps=5",
            "collector.mode=episode",
            "agent.target=gru",
            "agent.kwargs={hidden_size: 8, encoder_sizes: [8]}",
            "log.progress=false",
            "log.wandb_mode=disabled",
            "total_env_steps=40",
            "eval.every=1",
            "eval.episodes=6",
            f"run_dir={tmp_path / 'run'}",
        ],
    )
    build(cfg).train()
    rows = read_metrics(tmp_path / "run")
    assert len(rows) == 2
    for r in rows:
        # 6 greedy episodes: a success rate in sixths, episodes of delay + 2 steps.
        assert r["eval/episode_length"] == 5
        assert round(r["eval/success_rate"] * 6, 6) == int(round(r["eval/success_rate"] * 6))
        assert r["eval/return_mean"] == pytest.approx(2 * r["eval/success_rate"] - 1)


# ------------------------------------------------------------------ warm start (init_from)
def _close(trainer):
    trainer.close()  # logger and run-directory lock
    trainer.collector.envs.close()


def test_init_from_starts_the_agent_at_another_runs_weights_and_nothing_else(tmp_path):
    build(tiny_cfg(tmp_path / "source", 3, "optim.anneal_lr=false")).train()
    source = load_checkpoint(tmp_path / "source")
    warm = build(tiny_cfg(tmp_path / "warm", 2, f"init_from={tmp_path / 'source'}", "seed=7"))
    cold = build(tiny_cfg(tmp_path / "cold", 2, "seed=7"))
    try:
        weights = warm.model.state_dict()
        assert weights.keys() == source["agent"].keys()
        for k in weights:
            assert torch.equal(weights[k], source["agent"][k]), f"{k} was not taken from the source run"
        # Not the fresh initialisation, and nothing but the weights: counters and optimizer start at zero.
        assert any(not torch.equal(weights[k], v) for k, v in cold.model.state_dict().items())
        assert warm.update == 0 and warm.env_steps == 0 and warm.optimizer.state_dict()["state"] == {}
    finally:
        _close(warm)
        _close(cold)
    # A checkpoint file works as well as a run directory.
    build(tiny_cfg(tmp_path / "from_file", 1, f"init_from={checkpoint_path(tmp_path / 'source')}")).train()


def test_init_from_errors_name_the_source_and_write_nothing(tmp_path):
    build(tiny_cfg(tmp_path / "source", 1)).train()
    with pytest.raises(SetupError, match=r"init_from=.*nothing.*no checkpoint there"):
        build(tiny_cfg(tmp_path / "a", 1, f"init_from={tmp_path / 'nothing'}"))
    with pytest.raises(SetupError, match=r"init_from=.*source.*does not fit this run's agent.*agent\.kwargs"):
        build(tiny_cfg(tmp_path / "b", 1, f"init_from={tmp_path / 'source'}", "agent.kwargs={hidden_sizes: [32, 32]}"))
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()


def test_a_resumed_warm_start_loads_its_own_checkpoint_not_the_source(tmp_path):
    build(tiny_cfg(tmp_path / "source", 1)).train()
    build(tiny_cfg(tmp_path / "warm", 2, f"init_from={tmp_path / 'source'}", "optim.anneal_lr=false")).train()
    own = load_checkpoint(tmp_path / "warm")
    checkpoint_path(tmp_path / "source").unlink()  # the source is gone: a resume must not need it
    resumed = build(resume=tmp_path / "warm", overrides=(f"total_env_steps={3 * BATCH}",))
    try:
        assert resumed.update == 2
        for k, v in resumed.model.state_dict().items():
            assert torch.equal(v, own["agent"][k])
    finally:
        _close(resumed)
