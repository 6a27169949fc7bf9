"""rl_replay/rundir/lock.py: one run directory belongs to one run, written by one process.

Covers ``claim_fresh`` (creates or accepts an empty directory, refuses one holding files or
a file in its place, in one line naming both ways out), ``claim_default`` (``name``,
``name-2``, ...), ``default_name``, and ``RunLock`` (the holder's pid in ``.lock``, refusal
while another process holds it, gone when that process is killed, taken over within one
process, ``release``). End-to-end refusals through train.py and ``--resume`` are in
tests/run/test_run_dir_faults.py.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time

import pytest

from rl_replay.errors import RunDirError, SetupError
from rl_replay.rundir.lock import (
    LOCK_NAME,
    RunLock,
    claim_default,
    claim_fresh,
    default_name,
    logged_updates,
    resume_kind,
)

# Holds an flock on DIR/.lock with its pid in it, as a run in another process does (no torch
# import, so it starts fast).
HOLDER = """
import fcntl, os, sys, time
fd = os.open(os.path.join(sys.argv[1], ".lock"), os.O_RDWR | os.O_CREAT, 0o644)
fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
os.ftruncate(fd, 0)
os.pwrite(fd, f"{os.getpid()}\\n".encode(), 0)
print("locked", flush=True)
time.sleep(600)
"""


@pytest.fixture
def holder(tmp_path):
    """Start a process that locks a directory; yields a function taking the directory."""
    procs = []

    def hold(run_dir):
        proc = subprocess.Popen([sys.executable, "-c", HOLDER, str(run_dir)], stdout=subprocess.PIPE, text=True)
        procs.append(proc)
        assert proc.stdout.readline().strip() == "locked"
        return proc

    yield hold
    for proc in procs:
        proc.kill()
        proc.wait(timeout=60)


# ------------------------------------------------------------------ claim_fresh
def test_claim_fresh_creates_the_directory_and_locks_it(tmp_path):
    run_dir = tmp_path / "a" / "b" / "run"
    held, lock = claim_fresh(run_dir)
    try:
        assert held.path == run_dir and run_dir.is_dir() and lock.held and lock.path == run_dir / LOCK_NAME
        assert (run_dir / LOCK_NAME).read_text() == f"{os.getpid()}\n"
        assert os.listdir(run_dir) == [LOCK_NAME]
    finally:
        lock.release()
        held.close()


def test_claim_fresh_accepts_an_empty_directory_and_one_holding_only_a_stale_lock(tmp_path):
    empty, stale = tmp_path / "empty", tmp_path / "stale"
    empty.mkdir()
    stale.mkdir()
    (stale / LOCK_NAME).write_text("12345\n")  # left by a killed run
    for run_dir in (empty, stale):
        held, lock = claim_fresh(run_dir)
        assert lock.held and (run_dir / LOCK_NAME).read_text() == f"{os.getpid()}\n"
        lock.release()
        held.close()


def test_claim_fresh_refuses_a_directory_holding_files_naming_both_ways_out(tmp_path):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    for name in ("metrics.jsonl", "config.yaml", "checkpoint.pt", "a.txt", "b.txt"):
        (run_dir / name).write_text("x")
    before = sorted(os.listdir(run_dir))
    with pytest.raises(RunDirError) as info:
        claim_fresh(run_dir)
    assert str(info.value) == (
        f"run directory {run_dir} is not empty (a.txt, b.txt, checkpoint.pt, config.yaml ...): "
        f"continue that run with --resume {run_dir}, or start a new one with another run_dir=..."
    )
    assert isinstance(info.value, SetupError)  # exit code 2, one line
    assert sorted(os.listdir(run_dir)) == before  # not even a lock file


def test_a_directory_without_a_run_points_neither_to_resume_nor_in_a_circle(tmp_path):
    stray, empty = tmp_path / "stray", tmp_path / "empty"
    stray.mkdir()
    empty.mkdir()
    (stray / "notes.txt").write_text("x")
    with pytest.raises(RunDirError) as info:
        claim_fresh(stray)
    assert str(info.value) == (
        f"run directory {stray} is not empty (notes.txt) and holds no run (no config.yaml): "
        "start the new run with another run_dir=..."
    )
    with pytest.raises(
        RunDirError,
        match=rf"^cannot resume {re.escape(str(stray))}: it holds no run \(no "
        r"config\.yaml\)\. Start a new run with another run_dir=\.\.\.$",
    ):
        resume_kind(stray)
    with pytest.raises(RunDirError, match=rf"Start a new run with run_dir={re.escape(str(empty))}$"):
        resume_kind(empty)
    with pytest.raises(RunDirError, match=rf"^cannot resume {re.escape(str(tmp_path / 'none'))}: no such directory"):
        resume_kind(tmp_path / "none")
    assert os.listdir(stray) == ["notes.txt"] and os.listdir(empty) == []


def test_resume_kind_tells_a_checkpoint_from_a_restart(tmp_path):
    (tmp_path / "config.yaml").write_text("seed: 1\n")
    (tmp_path / "metrics.jsonl").write_text('{"update": 1}\n{"update": 2}\n{"upd')  # killed mid-line
    assert resume_kind(tmp_path) == "restart" and logged_updates(tmp_path) == "2 updates logged"
    with pytest.raises(
        RunDirError,
        match=r"stopped before its first checkpoint \(2 updates logged\): restart it "
        rf"there from update 0 with --resume {re.escape(str(tmp_path))},",
    ):
        claim_fresh(tmp_path)
    (tmp_path / "checkpoint.prev.pt").write_text("x")
    assert resume_kind(tmp_path) == "checkpoint"


def test_claim_fresh_refuses_a_file_in_place_of_the_directory(tmp_path):
    path = tmp_path / "run"
    path.write_text("x")
    with pytest.raises(RunDirError, match=rf"^run directory {re.escape(str(path))} exists and is not a directory"):
        claim_fresh(path)


def test_claim_fresh_refuses_an_empty_directory_another_process_holds(tmp_path, holder):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    proc = holder(run_dir)
    with pytest.raises(
        RunDirError,
        match=rf"run directory {re.escape(str(run_dir))} is in use by another "
        rf"running process \(pid {proc.pid}\)",
    ):
        claim_fresh(run_dir)


# ------------------------------------------------------------------ default names
def test_default_name_is_one_path_component_with_the_start_time():
    name = default_name("ALE/Pong-v5")
    assert re.fullmatch(r"ALE_Pong-v5-\d{8}-\d{6}", name), name
    assert default_name("mod:Env-v0").startswith("mod_Env-v0-")
    assert abs(time.mktime(time.strptime(name[-15:], "%Y%m%d-%H%M%S")) - time.time()) < 5


def test_claim_default_suffixes_a_taken_name(tmp_path):
    (tmp_path / "runs" / "env-1").mkdir(parents=True)  # taken, e.g. by a run started this second
    claimed = [claim_default(tmp_path / "runs", "env-1") for _ in range(2)]
    try:
        assert [d.path.name for d, _ in claimed] == ["env-1-2", "env-1-3"]
        assert all(lock.held and lock.run_dir == d.path for d, lock in claimed)
        assert os.listdir(tmp_path / "runs" / "env-1") == []  # the taken one is left alone
    finally:
        for d, lock in claimed:
            lock.release()
            d.close()


# ------------------------------------------------------------------ the lock
def test_lock_is_refused_while_another_process_holds_it_and_free_once_it_is_killed(tmp_path, holder):
    proc = holder(tmp_path)
    with pytest.raises(
        RunDirError,
        match=rf"^run directory {re.escape(str(tmp_path))} is in use by another running "
        rf"process \(pid {proc.pid}\); wait for it to finish or stop it, or "
        r"choose another run_dir\.$",
    ):
        RunLock(tmp_path)
    proc.kill()  # SIGKILL: no cleanup; the OS drops the flock
    proc.wait(timeout=60)
    assert (tmp_path / LOCK_NAME).read_text() == f"{proc.pid}\n"  # the stale file stays
    lock = RunLock(tmp_path)
    assert lock.held and (tmp_path / LOCK_NAME).read_text() == f"{os.getpid()}\n"
    lock.release()


def test_a_second_lock_in_the_same_process_takes_over_and_release_frees_it(tmp_path, holder):
    first = RunLock(tmp_path)
    second = RunLock(tmp_path / ".." / tmp_path.name)  # the same directory by another path
    assert second.held and not first.held
    first.release()  # already released: nothing happens
    assert second.held
    second.release()
    second.release()
    assert not second.held
    # Released for real: another process can take it now.
    proc = holder(tmp_path)
    with pytest.raises(RunDirError, match=rf"pid {proc.pid}"):
        RunLock(tmp_path)
