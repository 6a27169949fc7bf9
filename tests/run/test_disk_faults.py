"""Disk faults during checkpoints and resume: a full disk, a read-only file system, a file size limit; each is one line and keeps the last checkpoint."""

from __future__ import annotations

import subprocess
import sys

import pytest
from _runs import (
    ENV,
    TINY,
    TRAIN,
    finish,
    one_error_line,
    snapshot,
    start,
    tiny,
)

from rl_replay.run.setup import build
from rl_replay.rundir.checkpoint import checkpoint_path, load_checkpoint


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
