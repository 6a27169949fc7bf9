"""Signals: SIGINT/SIGTERM/SIGUSR1/SIGUSR2 finish the update, checkpoint and exit; Ctrl-C to a process group with async env workers; a second SIGINT exits at once."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest
from _runs import (
    BATCH,
    ENV,
    TINY,
    TRAIN,
    StderrReader,
    finish,
    start,
    wait_for_metrics,
)

from rl_replay.run.setup import build
from rl_replay.rundir.checkpoint import checkpoint_path, load_checkpoint


@pytest.mark.parametrize(
    "sig, code",
    [(signal.SIGINT, 130), (signal.SIGTERM, 143), (signal.SIGUSR1, 138)],
    ids=["SIGINT", "SIGTERM", "SIGUSR1"],
)
def test_signal_finishes_the_update_checkpoints_and_exits(tmp_path, sig, code):
    """SIGUSR1 is a scheduler's pre-emption notice (Slurm's --signal=USR1@90): the same stop. (SIGUSR2
    takes the same handler: tests/run/test_interrupt.py.)"""
    run = tmp_path / "run"
    proc = start(TRAIN, *TINY, "total_env_steps=100000000", "checkpoint.every=0", f"run_dir={run}", cwd=tmp_path)
    try:
        wait_for_metrics(run, proc)
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
        wait_for_metrics(run, proc)
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
