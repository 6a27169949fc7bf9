"""A run's data is never lost or corrupted: run directories, resume, non-finite guards,
signals, checkpoint integrity, command-line refusals and agent contract errors."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import gymnasium as gym
import numpy as np
import pytest
import torch
from _checkpoint_files import write_format2

from rl_replay.config import Config, load_config
from rl_replay.errors import NonFiniteError, RunDirError, SetupError
from rl_replay.run.checkpoint import checkpoint_path, load_checkpoint
from rl_replay.run.setup import build

REPO = Path(__file__).resolve().parents[1]
TESTS = Path(__file__).resolve().parent
TRAIN = str(REPO / "scripts" / "train.py")
EVALUATE = str(REPO / "scripts" / "evaluate.py")
ENV = {
    **os.environ,
    "OMP_NUM_THREADS": "1",
    "WANDB_MODE": "disabled",
    "WANDB_SILENT": "true",
    "PYTHONPATH": os.pathsep.join([str(REPO), str(TESTS)]),
    "PYTHONUNBUFFERED": "1",
}
TINY = (
    "env.num_envs=2",
    "collector.num_steps=8",
    "agent.kwargs={hidden_sizes: [16]}",
    "log.progress=false",
    "log.wandb_mode=disabled",
)
BATCH = 16
TIMEOUT = 240  # generous: a loaded 2-core machine


def tiny(run_dir, updates, *extra):
    return load_config(None, [*TINY, f"total_env_steps={updates * BATCH}", f"run_dir={run_dir}", *extra])


def start(script, *args, cwd):
    return subprocess.Popen(
        [sys.executable, script, *map(str, args)],
        cwd=cwd,
        env=ENV,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def finish(proc, timeout=TIMEOUT):
    out, err = proc.communicate(timeout=timeout)
    return proc.returncode, out, err


def snapshot(run_dir):
    return {p.name: p.read_bytes() for p in Path(run_dir).iterdir() if p.is_file() and p.name != ".lock"}


def one_error_line(err):
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), err
    return lines[0]


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory):
    """A finished 3-update run (checkpoint every update): the run other tests must not harm."""
    run_dir = tmp_path_factory.mktemp("finished") / "run"
    build(tiny(run_dir, 3, "checkpoint.every=1")).train()
    return run_dir


def copy_run(src, dst):
    dst.mkdir()
    for name, data in snapshot(src).items():
        (dst / name).write_bytes(data)
    return dst


# ------------------------------------------------------------------ run directories
def test_fresh_run_refuses_a_directory_holding_a_run(finished_run, tmp_path):
    before = snapshot(finished_run)
    code, out, err = finish(start(TRAIN, *TINY, "total_env_steps=32", f"run_dir={finished_run}", cwd=tmp_path))
    line = one_error_line(err)
    assert code == 2 and str(finished_run) in line
    assert f"--resume {finished_run}" in line and "run_dir=" in line
    assert snapshot(finished_run) == before  # checkpoint, config and metrics untouched
    # An empty directory is fine for a fresh run.
    (tmp_path / "empty").mkdir()
    trainer = build(tiny(tmp_path / "empty", 1))
    trainer.train()
    assert checkpoint_path(tmp_path / "empty").exists()


def test_a_run_killed_before_its_first_checkpoint_restarts_in_place(tmp_path):
    """kill -9 before the first checkpoint: a fresh run there points at --resume, and --resume
    restarts the run from update 0 in the same directory and wandb run, saying how many logged
    updates it redoes. Neither message sends the user back to the other."""
    from rl_replay.run.logger import read_metrics

    run = tmp_path / "run"
    offline = {**ENV, "WANDB_MODE": "offline"}
    proc = subprocess.Popen(
        [sys.executable, TRAIN, *TINY, "total_env_steps=100000000", "checkpoint.every=0", f"run_dir={run}"],
        cwd=tmp_path,
        env=offline,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        _wait_for_metrics(run, proc)
    finally:
        proc.kill()
        proc.wait(timeout=60)
    assert not checkpoint_path(run).exists()
    logged = read_metrics(run)[-1]["update"]
    words = f"{logged} update{'' if logged == 1 else 's'} logged"

    code, _, err = finish(start(TRAIN, *TINY, "total_env_steps=32", f"run_dir={run}", cwd=tmp_path))
    line = one_error_line(err)
    assert code == 2 and line == (
        f"error: run directory {run} holds a run that stopped before its first checkpoint ({words}): "
        f"restart it there from update 0 with --resume {run}, or start a new one with another run_dir=..."
    )

    proc = subprocess.Popen(
        [sys.executable, TRAIN, "--resume", str(run), "total_env_steps=32"],
        cwd=tmp_path,
        env=offline,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    code, _, err = finish(proc)
    assert code == 0, err
    assert err.splitlines()[0] == (
        f"warning: {run} has no checkpoint: the run stopped before its first one "
        f"({words}); restarting it there from update 0 with its config.yaml."
    )
    assert [r["update"] for r in read_metrics(run)] == [1, 2]  # the lost updates were redone, not kept
    assert load_checkpoint(run)["update"] == 2
    ids = {p.name.rsplit("-", 1)[1] for p in (run / "wandb").glob("offline-run-*")}
    assert len(ids) == 1  # one wandb run: the restart continued the one that never got a row


def test_default_run_dirs_are_unique_for_runs_started_together(tmp_path):
    procs = [start(TRAIN, *TINY, "total_env_steps=32", cwd=tmp_path) for _ in range(2)]
    results = [finish(p) for p in procs]
    assert all(code == 0 for code, _, _ in results), [err for _, _, err in results]
    dirs = sorted((tmp_path / "runs").iterdir())
    assert len(dirs) == 2, dirs
    printed = sorted(re.search(r"run directory: (\S+)", err).group(1) for _, _, err in results)
    assert printed == sorted(str(Path("runs") / d.name) for d in dirs)
    for d in dirs:  # each directory holds exactly one complete run
        assert load_checkpoint(d)["update"] == 2
        assert load_config(d / "config.yaml").run_dir == str(Path("runs") / d.name)
        assert [json.loads(x)["update"] for x in (d / "metrics.jsonl").read_text().splitlines()] == [1, 2]


def test_lock_refuses_a_second_writer_and_dies_with_its_process(finished_run, tmp_path):
    run = copy_run(finished_run, tmp_path / "run")
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import sys, time\nfrom rl_replay.run.run_dir import RunLock\n"
            f"lock = RunLock({str(run)!r})\nprint('locked', flush=True)\ntime.sleep(600)",
        ],
        cwd=REPO,
        env=ENV,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout.readline().strip() == "locked"
        before = snapshot(run)
        with pytest.raises(
            RunDirError,
            match=rf"run directory {re.escape(str(run))} is in use by another "
            rf"running process \(pid {holder.pid}\)",
        ):
            build(resume=run)
        assert snapshot(run) == before
    finally:
        holder.kill()  # SIGKILL: no cleanup; the OS drops the flock
        holder.wait(timeout=60)
    assert (run / ".lock").exists()  # the stale lock file stays, and does not matter
    resumed = build(resume=run, overrides=("total_env_steps=64",))
    resumed.train()
    assert load_checkpoint(run)["update"] == 4
    assert not resumed.lock.held  # train() released it


# ------------------------------------------------------------------ resume
def test_resume_with_incompatible_overrides_writes_nothing(finished_run, tmp_path):
    run = copy_run(finished_run, tmp_path / "run")
    before = snapshot(run)
    code, out, err = finish(start(TRAIN, "--resume", run, "env.num_envs=4", cwd=tmp_path))
    line = one_error_line(err)
    assert code == 2 and "start a new run" in line, line
    assert re.search(r"env\.num_envs=4: its checkpoint was written with env\.num_envs=2", line), line
    with pytest.raises(
        SetupError,
        match=r"agent\.kwargs=\{'hidden_sizes': \[32\]\}: its checkpoint was written "
        r"with agent\.kwargs=\{'hidden_sizes': \[16\]\}",
    ):
        build(resume=run, overrides=("agent.kwargs={hidden_sizes: [32]}",))
    assert snapshot(run) == before  # config.yaml and metrics.jsonl untouched
    # The run is intact: a plain resume continues it.
    resumed = build(resume=run, overrides=("total_env_steps=64",))
    resumed.train()
    assert resumed.update == 4


def test_resume_refuses_config_and_run_dir(finished_run, tmp_path, capsys):
    from rl_replay.run.cli import train_main

    other = tmp_path / "c.yaml"
    other.write_text("seed: 3\n")
    before = snapshot(finished_run)
    code, out, err = finish(start(TRAIN, "--resume", finished_run, "--config", other, cwd=tmp_path))
    line = one_error_line(err)
    assert code == 2 and "--config cannot be combined" in line and "key=value overrides" in line, err
    assert train_main(["--resume", str(finished_run), f"run_dir={tmp_path / 'elsewhere'}"]) == 2
    assert "drop run_dir=" in one_error_line(capsys.readouterr().err)
    assert list(tmp_path.iterdir()) == [other] and snapshot(finished_run) == before


def test_resume_falls_back_to_previous_checkpoint_and_removes_stale_temporaries(finished_run, tmp_path, capsys):
    run = copy_run(finished_run, tmp_path / "run")
    latest = checkpoint_path(run)
    latest.write_bytes(latest.read_bytes()[:1000])  # cut off
    stale = run / ".checkpoint.pt.x1y2z3.tmp"
    stale.write_bytes(b"\0" * 4096)
    trainer = build(resume=run, overrides=("total_env_steps=64",))
    assert trainer.update == 2  # the previous checkpoint (update 2 of a run checkpointing every update)
    assert not stale.exists()
    err = capsys.readouterr().err
    assert f"checkpoint {latest} is truncated" in err and "Resuming from the previous checkpoint" in err
    assert [json.loads(x)["update"] for x in (run / "metrics.jsonl").read_text().splitlines()] == [1, 2]
    trainer.train()
    assert load_checkpoint(run)["update"] == 4


def test_evaluate_refuses_damaged_and_non_finite_checkpoints(finished_run, tmp_path, capsys):
    from rl_replay.run.cli import evaluate_main

    truncated = copy_run(finished_run, tmp_path / "truncated")
    checkpoint_path(truncated).write_bytes(checkpoint_path(truncated).read_bytes()[:500])
    nan = copy_run(finished_run, tmp_path / "nan")
    state = load_checkpoint(nan)
    first = next(iter(state["agent"]))
    state["agent"][first] = torch.full_like(state["agent"][first], float("nan"))
    write_format2(state, checkpoint_path(nan))  # bypassing save_checkpoint's refusal
    procs = {
        "nan": (start(EVALUATE, nan, "--episodes", 2, cwd=tmp_path), f"non-finite agent weights \\({first}"),
        "zero": (start(EVALUATE, finished_run, "--episodes", 0, cwd=tmp_path), "--episodes must be a positive"),
    }
    for name, (proc, pattern) in procs.items():
        code, out, err = finish(proc)
        assert code == 2 and out == "" and re.search(pattern, one_error_line(err)), (name, err)
    for args, pattern in (
        ([str(truncated)], f"checkpoint {re.escape(str(checkpoint_path(truncated)))} is truncated"),
        ([str(finished_run), "--episodes", "-3"], "got -3"),
    ):
        assert evaluate_main(args) == 2
        out, err = capsys.readouterr()
        assert out == "" and re.search(pattern, one_error_line(err)), err


# ------------------------------------------------------------------ non-finite guards
def test_divergence_stops_before_the_step_naming_update_term_and_checkpoint(tmp_path):
    run = tmp_path / "run"
    trainer = build(tiny(run, 40, "optim.name=sgd", "optim.lr=1e3", "optim.max_grad_norm=null", "checkpoint.every=1"))
    with pytest.raises(NonFiniteError) as info:
        trainer.train()
    message = str(info.value)
    state = load_checkpoint(run)
    print(message)
    assert re.match(rf"update {state['update'] + 1}: ", message)
    assert re.search(r"(loss term train/\w+|gradient of [\w.]+|parameter [\w.]+) is (nan|inf|-inf)", message)
    assert f"last good checkpoint: {checkpoint_path(run)} (update {state['update']})" in message
    assert all(torch.isfinite(t).all() for t in state["agent"].values())
    assert not trainer.lock.held  # released: the run can be resumed or inspected


def test_trainer_skips_bad_updates_within_budget(tmp_path, capsys):
    trainer = build(
        tiny(
            tmp_path / "run",
            40,
            "optim.name=sgd",
            "optim.lr=1e3",
            "optim.max_grad_norm=null",
            "optim.skip_nonfinite_updates=2",
        )
    )
    with pytest.raises(NonFiniteError):
        trainer.train()
    warnings = [x for x in capsys.readouterr().err.splitlines() if x.startswith("warning: update")]
    assert len(warnings) == 2 and trainer.guard.budget.skipped == 2
    logged = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert logged[-1]["train/skipped_updates"] == 2


def test_ppo_steps_are_guarded_too(tmp_path, capsys):
    # PPO makes several optimizer steps per update: each goes through the same guard, so a
    # skipped minibatch step is counted and the weights never become non-finite.
    trainer = build(
        tiny(
            tmp_path / "run",
            40,
            "loss.algorithm=ppo",
            "ppo.num_minibatches=1",
            "ppo.epochs=2",
            "optim.name=sgd",
            "optim.lr=1e3",
            "optim.max_grad_norm=null",
            "optim.skip_nonfinite_updates=1",
        )
    )
    with pytest.raises(NonFiniteError, match=r"stopped before the optimizer step"):
        trainer.train()
    assert trainer.guard.budget.skipped == 1
    assert all(bool(torch.isfinite(p).all()) for p in trainer.model.parameters())


class NonFiniteEnv(gym.Env):
    """Finite for three steps, then a NaN reward or an infinite observation."""

    observation_space = gym.spaces.Box(-np.inf, np.inf, shape=(3,), dtype=np.float32)
    action_space = gym.spaces.Discrete(2)

    def __init__(self, bad="reward"):
        self.bad, self.t = bad, 0

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        self.t = 0
        return np.zeros(3, dtype=np.float32), {}

    def step(self, action):
        self.t += 1
        obs = np.zeros(3, dtype=np.float32)
        reward = 1.0
        if self.t >= 3:
            if self.bad == "reward":
                reward = float("nan")
            else:
                obs[1] = np.inf
        return obs, reward, False, False, {}


if "test_safety/NonFinite-v0" not in gym.registry:
    gym.register(id="test_safety/NonFinite-v0", entry_point=NonFiniteEnv, max_episode_steps=50)


@pytest.mark.parametrize("bad, what", [("reward", "reward (nan)"), ("observation", "observation")])
def test_env_non_finite_output_is_named(tmp_path, bad, what):
    trainer = build(tiny(tmp_path / "run", 4, "env.id=test_safety/NonFinite-v0", f"env.kwargs={{bad: {bad}}}"))
    with pytest.raises(
        NonFiniteError,
        match=rf"environment 'test_safety/NonFinite-v0' returned a non-finite "
        rf"{re.escape(what)} in sub-env 0",
    ):
        trainer.train()


# ------------------------------------------------------------------ agent contract
@pytest.mark.parametrize(
    "agent, pattern",
    [
        ("WrongKeyAgent", r"distribution\(\) needs key 'dist' but forward\(\) returned keys \['distribution', "),
        ("ColumnValueAgent", r"'value' of shape \(2, 1\); expected \(2,\)"),
        ("WideLogitsAgent", r"has 3 logits but the action space Discrete\(2\) has 2 actions"),
        ("NarrowLogitsAgent", r"has 1 logits but the action space Discrete\(2\) has 2 actions"),
        ("BatchNormAgent", r"forward\(\) changed its buffer 'body.1.running_mean', .*num_batches_tracked.*eval mode"),
        ("WideStateAgent", r"forward\(\) returned state 'h' of shape \(2, 16\) but initial_state\(\) gives \(2, 8\)"),
        (
            "NoResetAgent",
            r"with is_first set .* outputs \[.*'state.h'.*\] depend on the incoming state: .*Agent.reset_state",
        ),
        (
            "DistributionObjectAgent",
            r"forward\(\) returned 'dist' as a torch.distributions Categorical; return its "
            r"parameters instead",
        ),
    ],
)
def test_agent_contract_errors_before_the_run_dir(tmp_path, monkeypatch, agent, pattern):
    monkeypatch.syspath_prepend(str(TESTS))
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SetupError, match=rf"agent safety_agents:{agent}: .*{pattern}") as info:
        build(tiny(tmp_path / "run", 2, f"agent.target=safety_agents:{agent}", "agent.kwargs={}"))
    assert "\n" not in str(info.value)
    assert list(tmp_path.iterdir()) == []


# ------------------------------------------------------------------ signals
class StderrReader:
    """Collects a process's stderr lines in a thread; :meth:`wait_for` a marker line."""

    def __init__(self, proc):
        self.lines: list[str] = []
        self._thread = threading.Thread(target=self._read, args=(proc,), daemon=True)
        self._thread.start()

    def _read(self, proc):
        for line in proc.stderr:
            self.lines.append(line)

    def wait_for(self, needle, proc, timeout=TIMEOUT):
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if any(needle in line for line in self.lines):
                return
            if proc.poll() is not None:
                break
            time.sleep(0.05)
        pytest.fail(f"never saw {needle!r}; stderr so far:\n{''.join(self.lines)}")

    def text(self):
        self._thread.join(timeout=60)
        return "".join(self.lines)


# ------------------------------------------------------------------ disk faults
@pytest.fixture
def small_fs(tmp_path):
    """A real 2 MiB tmpfs (needs root and a kernel that lets this process mount); else skipped."""
    mnt = tmp_path / "fs"
    mnt.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=2m", "tmpfs", str(mnt)], capture_output=True)
    if mounted.returncode:
        pytest.skip(f"cannot mount a tmpfs here: {mounted.stderr.decode().strip()}")
    try:
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=True)


BIG = "agent.kwargs={hidden_sizes: [256, 256]}"  # a 1.1 MB checkpoint: a second one does not fit in 2 MiB


def test_a_full_disk_during_a_checkpoint_is_one_line_and_keeps_the_last_one(small_fs, tmp_path):
    run = small_fs / "run"
    code, out, err = finish(
        start(TRAIN, *TINY, BIG, "checkpoint.every=1", "total_env_steps=64", f"run_dir={run}", cwd=tmp_path)
    )
    line = err.strip().splitlines()[-1]
    assert code == 1 and "Traceback" not in err, err
    assert line == (
        f"error: cannot write {run / 'checkpoint.pt'}: No space left on device (ENOSPC); the last good "
        f"checkpoint is {run / 'checkpoint.pt'} (update 1). Free space or make the file system "
        f"writable, then continue with --resume {run}"
    )
    assert load_checkpoint(run)["update"] == 1  # verified: the failed write left it whole
    # The small env-state file of update 2 was written before the checkpoint failed; update 1's
    # is kept beside it, and the checkpoint names its own by checksum.
    assert sorted(p.name for p in run.iterdir()) == [
        ".lock",
        "checkpoint.pt",
        "config.yaml",
        "env_state.pkl",
        "env_state.prev.pkl",
        "metrics.jsonl",
    ]


def test_resume_and_new_runs_on_a_read_only_file_system_are_one_line(small_fs, tmp_path):
    run = small_fs / "run"
    build(tiny(run, 1)).train()
    before = snapshot(run)
    subprocess.run(["mount", "-o", "remount,ro", str(small_fs)], check=True)
    code, _, err = finish(start(TRAIN, "--resume", run, "total_env_steps=32", cwd=tmp_path))
    assert code == 2 and one_error_line(err) == (
        f"error: cannot write {run / '.lock'}: Read-only file system (EROFS); its last checkpoint "
        f"{run / 'checkpoint.pt'} is unchanged. A run directory must be writable: fix the file system or its "
        "permissions, or use another directory (a run copied there resumes from it)."
    )
    code, _, err = finish(start(TRAIN, *TINY, f"run_dir={small_fs / 'new'}", cwd=tmp_path))
    assert code == 2 and one_error_line(err).startswith(
        f"error: cannot write {small_fs / 'new'}: Read-only file system (EROFS). A run directory must be writable"
    )
    assert snapshot(run) == before


def test_a_file_size_limit_hit_by_the_first_checkpoint_is_one_line(tmp_path):
    """Without mounts: RLIMIT_FSIZE makes the checkpoint write fail (EFBIG) where any user can run it."""
    import resource

    def limit():
        resource.setrlimit(resource.RLIMIT_FSIZE, (256 * 1024, 256 * 1024))

    run = tmp_path / "run"
    proc = subprocess.Popen(
        [sys.executable, TRAIN, *TINY, BIG, "total_env_steps=16", f"run_dir={run}"],
        cwd=tmp_path,
        env=ENV,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        preexec_fn=limit,
    )
    code, _, err = finish(proc)
    assert code == 1 and "Traceback" not in err, err
    assert err.strip().splitlines()[-1] == (
        f"error: cannot write {run / 'checkpoint.pt'}: File too large (EFBIG); no checkpoint was written yet. "
        f"Free space or make the file system writable, then continue with --resume {run}"
    )
    assert not checkpoint_path(run).exists() and not list(run.glob(".checkpoint*"))


def _wait_for_metrics(run_dir, proc, timeout=TIMEOUT):
    deadline = time.monotonic() + timeout
    metrics = Path(run_dir) / "metrics.jsonl"
    while time.monotonic() < deadline and proc.poll() is None:
        if metrics.exists() and metrics.read_text().count("\n") >= 1:
            return
        time.sleep(0.05)
    pytest.fail(f"no metrics line before the deadline (returncode {proc.poll()})")


@pytest.mark.parametrize("sig, code", [(signal.SIGINT, 130), (signal.SIGTERM, 143)], ids=["SIGINT", "SIGTERM"])
def test_signal_finishes_the_update_checkpoints_and_exits(tmp_path, sig, code):
    run = tmp_path / "run"
    proc = start(TRAIN, *TINY, "total_env_steps=100000000", "checkpoint.every=0", f"run_dir={run}", cwd=tmp_path)
    try:
        _wait_for_metrics(run, proc)
        proc.send_signal(sig)
        rc, out, err = finish(proc)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert rc == code, err
    state = load_checkpoint(run)
    logged = [json.loads(x)["update"] for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert logged == list(range(1, state["update"] + 1))  # the checkpoint is the last logged update
    name = signal.Signals(sig).name
    assert f"stopped by {name} after update {state['update']}" in err
    assert f"--resume {run}" in err and "Traceback" not in err
    resumed = build(resume=run, overrides=(f"total_env_steps={(state['update'] + 1) * BATCH}",))
    resumed.train()
    assert load_checkpoint(run)["update"] == state["update"] + 1


def test_ctrl_c_to_the_process_group_with_async_env_workers(tmp_path):
    """A terminal's Ctrl-C reaches every process of the group, env worker processes included."""
    run = tmp_path / "run"
    proc = subprocess.Popen(
        [
            sys.executable,
            TRAIN,
            *TINY,
            "env.vectorization=async",
            "total_env_steps=100000000",
            "checkpoint.every=0",
            f"run_dir={run}",
        ],
        cwd=tmp_path,
        env=ENV,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        _wait_for_metrics(run, proc)
        os.killpg(proc.pid, signal.SIGINT)
        rc, out, err = finish(proc)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert rc == 130, err
    assert "stopped by SIGINT" in err and "Traceback" not in err
    assert load_checkpoint(run)["update"] >= 1
    # Its checkpoint cannot hold the worker processes' envs; the resume says so in one line.
    done = load_checkpoint(run)["env_steps"]  # resume to the same total: builds, restores, trains nothing
    proc = subprocess.run(
        [sys.executable, TRAIN, "--resume", str(run), f"total_env_steps={done}"],
        cwd=tmp_path,
        env=ENV,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert (
        "the checkpoint holds no environment state (env.vectorization=async): the resumed run starts fresh "
        "episodes with the saved wrapper statistics" in proc.stderr
    ), proc.stderr


def test_second_sigint_exits_at_once(tmp_path):
    run = tmp_path / "run"
    proc = subprocess.Popen(
        [
            sys.executable,
            TRAIN,
            *TINY,
            "agent.target=safety_agents:SlowAgent",
            "agent.kwargs={}",
            "collector.num_steps=64",
            "total_env_steps=100000000",
            f"run_dir={run}",
        ],
        cwd=tmp_path,
        env=ENV,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    reader = StderrReader(proc)
    try:
        reader.wait_for("run directory:", proc)
        time.sleep(0.5)  # inside the first update (64 forwards of 50 ms, then 64 recomputes)
        proc.send_signal(signal.SIGINT)
        reader.wait_for("received SIGINT", proc)
        proc.send_signal(signal.SIGINT)
        proc.wait(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == -signal.SIGINT, reader.text()
    assert "stopped by" not in reader.text()
    assert not checkpoint_path(run).exists()


# ------------------------------------------------------------------ command line
def test_cli_refusals_and_intermixed_overrides(tmp_path, monkeypatch, capsys):
    from rl_replay.run.cli import train_main

    cfg = tmp_path / "c.yaml"
    cfg.write_text("collector: {num_steps: 4}\n")
    cases = {
        "lr-inf": (["optim.lr=.inf"], r"error: Non-finite value for config key 'optim\.lr': inf"),
        "contract": (
            ["agent.target=safety_agents:ColumnValueAgent", "agent.kwargs={}"],
            r"error: agent safety_agents:ColumnValueAgent: forward\(\) returned 'value' of shape",
        ),
    }
    procs = {}
    for name, (args, _) in cases.items():
        (tmp_path / name).mkdir()
        procs[name] = start(TRAIN, *TINY, *args, f"run_dir={tmp_path / name / 'run'}", cwd=tmp_path / name)
    mixed = tmp_path / "mixed"
    procs["mixed"] = start(
        TRAIN,
        "env.num_envs=2",
        "log.progress=false",
        "--config",
        cfg,
        "total_env_steps=16",
        "log.wandb_mode=disabled",
        f"run_dir={mixed}",
        cwd=tmp_path,
    )
    for name, (_args, pattern) in cases.items():
        code, out, err = finish(procs[name])
        assert code == 2 and re.match(pattern, one_error_line(err)), (name, err)
        assert list((tmp_path / name).iterdir()) == [], name
    code, out, err = finish(procs["mixed"])
    assert code == 0, err
    monkeypatch.chdir(tmp_path / "lr-inf")
    for args, pattern in (
        (["seed=-1"], r"error: Out of range value for config key 'seed': -1"),
        (["optim.lr=.nan"], r"error: Non-finite value for config key 'optim\.lr': nan"),
    ):
        assert train_main([*TINY, *args]) == 2
        assert re.match(pattern, one_error_line(capsys.readouterr().err)), args
    assert list(Path.cwd().iterdir()) == []
    saved = load_config(mixed / "config.yaml")
    assert (saved.env.num_envs, saved.collector.num_steps, saved.total_env_steps) == (2, 4, 16)


def test_help_lists_every_config_key_with_its_docstring(tmp_path):
    from rl_replay.config.loader import _iter_leaves
    from rl_replay.run.cli import _field_docs

    code, out, err = finish(start(TRAIN, "--help", cwd=tmp_path))
    assert code == 0, err
    lines = out.splitlines()
    for key, _, _ in _iter_leaves(Config()):
        section, _, name = key.rpartition(".")
        cls = type(getattr(Config(), section)) if section else Config
        doc = _field_docs(cls)[name]
        assert doc, key
        row = [x for x in lines if x.split()[:1] == [key]]
        assert len(row) == 1 and row[0].endswith(doc), (key, row)
    for section in ("env", "agent", "collector", "loss", "optim", "log", "checkpoint", "eval", "distributed"):
        assert any(x.startswith(f"{section}: ") for x in lines), section


def test_console_entry_points_resolve(capsys):
    import importlib

    import tomllib

    scripts = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["scripts"]
    assert set(scripts) == {"rl-replay-train", "rl-replay-evaluate"}
    for name, target in scripts.items():
        module, _, attr = target.partition(":")
        assert callable(getattr(importlib.import_module(module), attr)), name
    from rl_replay.run.cli import evaluate_main

    assert evaluate_main(["/nonexistent"]) == 2
    assert one_error_line(capsys.readouterr().err).startswith("error: Config file not found")
