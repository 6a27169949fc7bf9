"""Run directories and resume never lose or corrupt a run: refusals, locks, stale temporaries, damaged checkpoints."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from _checkpoint_files import write_format2
from _runs import (
    ENV,
    EVALUATE,
    REPO,
    TINY,
    TRAIN,
    copy_run,
    finish,
    one_error_line,
    snapshot,
    start,
    tiny,
    wait_for_metrics,
)

from rl_replay.config import load_config
from rl_replay.errors import RunDirError, SetupError
from rl_replay.run.setup import build
from rl_replay.rundir.checkpoint import checkpoint_path, load_checkpoint


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
        wait_for_metrics(run, proc)
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
            "import sys, time\nfrom rl_replay.rundir.lock import RunLock\n"
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
        ([str(finished_run), "--num-envs", "0"], "--num-envs must be a positive number of envs, got 0"),
    ):
        assert evaluate_main(args) == 2
        out, err = capsys.readouterr()
        assert out == "" and re.search(pattern, one_error_line(err)), err
