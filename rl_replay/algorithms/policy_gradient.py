"""What A2C and REINFORCE share: the rollout's outputs as replay blocks, one backward, one step."""

from __future__ import annotations

import dataclasses
import functools
import time

from rl_replay.algorithms.base import Algorithm
from rl_replay.algorithms.common import UpdateResult, optimizer_step
from rl_replay.algorithms.stored import replay_sequence
from rl_replay.engine import GradientAccumulator, replay
from rl_replay.rollout.collector import Rollout

__all__ = ["PolicyGradient"]


class PolicyGradient(Algorithm):
    """An on-policy update whose rollout outputs carry the graph; subclasses give :meth:`loss`.

    With ``replay.block_steps`` 1 collection records one replay block per step. With k > 1
    the rollout is collected under ``no_grad`` and its stored rows are replayed from the
    rollout's start state in blocks of k steps (:func:`rl_replay.algorithms.stored.replay_sequence`,
    PPO's path): the same outputs and gradients for a deterministic agent, an extra forward
    per step, and the per-block machinery paid once per k steps instead of every step.
    Either way the loss over the whole rollout is back-propagated once, which replays every
    block newest-first.
    """

    def collect(self) -> tuple[Rollout, GradientAccumulator]:
        """One rollout whose ``log_prob``, ``entropy`` and ``value`` are attached to autograd
        through replay blocks, by ``replay.block_steps``, and the accumulator those blocks
        share."""
        accumulator = GradientAccumulator()
        block_steps = self.cfg.replay.block_steps
        if block_steps == 1:
            return self.collector.collect(functools.partial(replay, self.model, accumulator)), accumulator
        stored = self.collector.collect()
        outputs = replay_sequence(
            self.policy,
            stored.data,
            stored.start_state,
            accumulator,
            self.bptt_truncate,
            block_steps=block_steps,
        )
        # A new rollout: the collected one stays as the collector made it. next_value stays
        # the collection's (detached; the same numbers).
        return dataclasses.replace(stored, data=stored.data.copy().update(outputs)), accumulator

    def _update(self) -> UpdateResult:
        t0 = time.perf_counter()
        rollout, acc = self.collect()
        t1 = time.perf_counter()
        terms = self.loss(rollout.data, self.cfg, self.entropy_coef)
        grad_norm = optimizer_step(terms, self.model, self.optimizer, self.cfg.optim.max_grad_norm, self.guard)
        t2 = time.perf_counter()
        metrics = {
            "memory/replay_saved_bytes": float(acc.saved_bytes),
            "time/replay_backward_sec": t2 - t1,
            "time/replay_recompute_sec": acc.replay_seconds,
        }
        for key, value in terms.items():
            metrics["train/" + key] = float(value.detach())  # type: ignore[arg-type]
        return UpdateResult(rollout, metrics, float(grad_norm), collect_sec=t1 - t0, optimize_sec=t2 - t1)
