"""rl_replay/run/interrupt.py: the first SIGINT/SIGTERM only asks the run to stop.

Covers ``StopOnSignal`` in this process (the signal is remembered and announced, the
default handlers are back for a second one, the previous handlers are restored on exit,
nothing is installed off the main thread), ``TrainingInterrupted``'s exit codes and
message, and ``children_ignore_sigint`` (a child started inside inherits an ignored
SIGINT). The whole path through train.py, with real signals: tests/run/test_signals.py.
"""

from __future__ import annotations

import signal
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from rl_replay.errors import TrainingInterrupted
from rl_replay.run.interrupt import StopOnSignal, children_ignore_sigint


@pytest.fixture
def handlers():
    """Restore SIGINT/SIGTERM handlers whatever a test leaves behind."""
    before = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM, signal.SIGUSR1, signal.SIGUSR2)}
    yield before
    for s, handler in before.items():
        signal.signal(s, handler)


@pytest.mark.parametrize(
    "sig",
    [signal.SIGINT, signal.SIGTERM, signal.SIGUSR1, signal.SIGUSR2],
    ids=["SIGINT", "SIGTERM", "SIGUSR1", "SIGUSR2"],
)
def test_first_signal_is_remembered_announced_and_leaves_the_default_for_a_second(handlers, capfd, sig):
    with StopOnSignal() as stop:
        assert stop.requested() == 0
        signal.raise_signal(sig)  # handled here, not by pytest or the default action
        assert stop.requested() == sig
        for other in (signal.SIGINT, signal.SIGTERM, signal.SIGUSR1, signal.SIGUSR2):
            assert signal.getsignal(other) is signal.SIG_DFL
    assert {s: signal.getsignal(s) for s in handlers} == handlers
    err = capfd.readouterr().err
    assert (
        f"received {sig.name}: finishing this update, then writing a checkpoint (send it again to exit at once)" in err
    )


def test_quiet_and_off_the_main_thread(handlers, capfd):
    with StopOnSignal(announce=False) as stop:
        signal.raise_signal(signal.SIGTERM)
    assert stop.requested() == signal.SIGTERM and capfd.readouterr().err == ""
    seen = []

    def enter():
        with StopOnSignal():
            seen.append(signal.getsignal(signal.SIGTERM))

    thread = threading.Thread(target=enter)
    thread.start()
    thread.join()
    assert seen == [handlers[signal.SIGTERM]]  # signal handlers can only be set on the main thread


@pytest.mark.parametrize(
    "sig, code",
    [(signal.SIGINT, 130), (signal.SIGTERM, 143), (signal.SIGUSR1, 138), (signal.SIGUSR2, 140)],
    ids=["SIGINT", "SIGTERM", "SIGUSR1", "SIGUSR2"],
)
def test_training_interrupted_carries_the_shells_exit_code(sig, code):
    exc = TrainingInterrupted(sig, 12, "runs/x/checkpoint.pt", "runs/x")
    assert exc.exit_code == code and (exc.update, exc.run_dir) == (12, "runs/x")
    assert str(exc) == f"stopped by {sig.name} after update 12; checkpoint runs/x/checkpoint.pt written."


@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="reads /proc/<pid>/status")
def test_children_started_inside_ignore_sigint(handlers):
    def ignores_sigint(pid: int) -> bool:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("SigIgn:"):
                return bool(int(line.split()[1], 16) & (1 << (signal.SIGINT - 1)))
        raise AssertionError("no SigIgn line")

    # Whatever pytest inherited (a background job of a non-interactive shell starts with SIGINT
    # ignored, and children inherit that): start from Python's own handler, which exec resets.
    signal.signal(signal.SIGINT, signal.default_int_handler)
    code = "import sys; print('ready', flush=True); sys.stdin.read()"
    with children_ignore_sigint():
        assert signal.getsignal(signal.SIGINT) is signal.SIG_IGN
        inside = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    outside = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    try:
        for proc in (inside, outside):
            assert proc.stdout.readline() == b"ready\n"
        assert ignores_sigint(inside.pid) and not ignores_sigint(outside.pid)
        assert signal.getsignal(signal.SIGINT) is signal.default_int_handler  # restored on exit
    finally:
        for proc in (inside, outside):
            proc.kill()
            proc.wait(timeout=60)
