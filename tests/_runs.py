"""Shared helpers of the run-level fault tests: a tiny config, launching the real scripts,
reading their one-line errors, copying run directories."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from rl_replay.config import load_config

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


#: TINY with a constant learning rate: the run-directory tests compare runs update by update.
TINY_CONSTANT_LR = (*TINY, "optim.anneal_lr=false")


def tiny(run_dir, updates, *extra, base=TINY):
    """``base`` (the tiny settings) for ``updates`` updates into ``run_dir``, then ``extra``."""
    return load_config(None, [*base, f"total_env_steps={updates * BATCH}", f"run_dir={run_dir}", *extra])


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


def copy_run(src, dst):
    dst.mkdir()
    for name, data in snapshot(src).items():
        (dst / name).write_bytes(data)
    return dst


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


def wait_for_metrics(run_dir, proc, timeout=TIMEOUT):
    deadline = time.monotonic() + timeout
    metrics = Path(run_dir) / "metrics.jsonl"
    while time.monotonic() < deadline and proc.poll() is None:
        if metrics.exists() and metrics.read_text().count("\n") >= 1:
            return
        time.sleep(0.05)
    pytest.fail(f"no metrics line before the deadline (returncode {proc.poll()})")


def tiny_popgym_run(run_dir, updates: int):
    """Train ``updates`` updates of configs/popgym/repeat_previous_medium.yaml with a small agent
    (8 whole 103-step episodes per update) into ``run_dir``; returns the closed trainer."""
    from rl_replay.run.setup import build

    cfg = load_config(
        REPO / "configs" / "popgym" / "repeat_previous_medium.yaml",
        [
            "log.wandb_mode=disabled",
            "log.progress=false",
            "env.num_envs=8",
            "ppo.num_minibatches=2",
            f"total_env_steps={824 * updates}",
            "agent.kwargs={d_model: 8, num_heads: 2, window: 4, recurrence: gru, recurrent_size: 8}",
            f"run_dir={run_dir}",
        ],
    )
    trainer = build(cfg)
    trainer.train()
    trainer.close()
    return trainer
