"""An env wrapper that SIGKILLs one torchrun worker in the middle of an update, on the job's first
attempt only: what a lost node or an out-of-memory kill does to a rank (the restart test of
tests/run/test_distributed_train.py)."""

from __future__ import annotations

import os
import signal

import gymnasium as gym


class KillOnFirstAttempt(gym.Wrapper):
    """Kill this process with SIGKILL at its ``at``-th env step if it is rank ``rank`` of the
    first attempt (``TORCHELASTIC_RESTART_COUNT`` 0): the restarted workers run on."""

    def __init__(self, env: gym.Env, at: int = 100, rank: int = 1) -> None:
        super().__init__(env)
        self.at, self.rank, self.steps = at, rank, 0

    def step(self, action):
        self.steps += 1
        first_attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT") == "0"
        if first_attempt and os.environ.get("RANK") == str(self.rank) and self.steps == self.at:
            os.kill(os.getpid(), signal.SIGKILL)
        return self.env.step(action)
