"""Recurrent PPO on replay blocks: whole-sequence minibatches whose memory does not grow with T.

Collection runs the policy without a graph and keeps what the update needs (see
:meth:`rl_replay.rollout.collector.Collector.collect` without a ``forward``). GAE is computed once
per rollout. Each epoch shuffles the environments and splits them into
``num_minibatches`` groups; a minibatch is the whole T-step sequence of its envs. Its
steps are re-run as replay blocks from the envs' stored start state
(:func:`rl_replay.algorithms.stored.replay_sequence`), the recurrent state
flowing from block to block (agents reset it inside the block at ``is_first``, exactly as
in collection), so the gradient spans the whole sequence while only the blocks' inputs
are kept: peak memory is the minibatch's saved block inputs plus one block's activations.

Under FSDP every rank minibatches its own envs; all ranks run the same number of
minibatches and blocks, and the ``target_kl`` early stop is decided on the KL averaged
over ranks so no rank leaves the epoch loop alone.
"""

from __future__ import annotations

import time

import torch
from tensordict import TensorDict

from rl_replay import distributed as dist_utils
from rl_replay.algorithms.base import Algorithm
from rl_replay.algorithms.common import UpdateResult, optimizer_step
from rl_replay.algorithms.losses import gae_targets, ppo_loss
from rl_replay.algorithms.stored import replay_sequence
from rl_replay.config import Config
from rl_replay.engine import GradientAccumulator
from rl_replay.rollout.collector import Rollout

__all__ = ["PPO"]


class PPO(Algorithm):
    """PPO with clipped surrogate, optional value clipping and ``target_kl`` early stop.

    Advantages are normalised per minibatch unless ``loss.normalize_advantages`` is false.
    """

    normalizes_advantages_by_default = True

    @classmethod
    def loss(cls, batch: TensorDict, cfg: Config, entropy_coef: float | None = None) -> TensorDict:
        """The named loss terms of one minibatch: the replayed ``log_prob`` / ``entropy`` /
        ``value`` with the stored ``old_log_prob``, ``old_value``, ``advantage``, ``return``
        and ``valid`` (:func:`rl_replay.algorithms.losses.ppo_loss` with the run's settings)."""
        return ppo_loss(
            batch,
            clip_coef=cfg.ppo.clip_coef,
            clip_vloss=cfg.ppo.clip_vloss,
            **cls.loss_weights(cfg, entropy_coef),
        )

    def _update(self) -> UpdateResult:
        t0 = time.perf_counter()
        rollout = self.collector.collect()
        t1 = time.perf_counter()
        metrics, grad_norm = self.optimize(rollout)
        t2 = time.perf_counter()
        return UpdateResult(rollout, metrics, grad_norm, collect_sec=t1 - t0, optimize_sec=t2 - t1)

    def optimize(self, rollout: Rollout) -> tuple[dict[str, float], float]:
        """All epochs and minibatches on one collected rollout; returns (metrics, mean grad norm)."""
        cfg, p = self.cfg, self.cfg.ppo
        data = rollout.data
        T, N = data.batch_size
        advantages, returns, explained_variance = gae_targets(
            data, gamma=cfg.loss.gamma, gae_lambda=cfg.loss.gae_lambda
        )
        stored = TensorDict(
            observation=data["observation"],
            is_first=data["is_first"],
            action=data["action"],
            old_log_prob=data["log_prob"],
            old_value=data["value"],
            advantage=advantages,
            **{"return": returns},  # type: ignore[arg-type]
            valid=data["valid"],
            batch_size=[T, N],
        )
        per_mb = N // p.num_minibatches  # config validation guarantees it divides
        sums: dict[str, float] = {}
        grad_norms: list[float] = []
        saved_bytes = 0
        replay_sec = 0.0
        epochs_run = 0
        for _ in range(p.epochs):
            order = torch.randperm(N)
            for k in range(p.num_minibatches):
                envs = order[k * per_mb : (k + 1) * per_mb]
                terms, grad_norm, mb_saved, mb_replay_sec = self._minibatch(stored[:, envs], rollout.start_state[envs])
                grad_norms.append(float(grad_norm))
                saved_bytes = max(saved_bytes, mb_saved)
                replay_sec += mb_replay_sec
                for key, value in terms.items():
                    sums[key] = sums.get(key, 0.0) + float(value)
            epochs_run += 1
            # CleanRL: stop after an epoch whose last minibatch moved the policy too far.
            if p.target_kl is not None and self._mean_over_ranks(float(terms["approx_kl"])) > p.target_kl:
                break
        steps = len(grad_norms)
        metrics = {"train/" + key: value / steps for key, value in sums.items()}
        metrics.update(
            {
                "train/explained_variance": float(explained_variance),
                "train/epochs_run": float(epochs_run),
                "memory/replay_saved_bytes": float(saved_bytes),
                "time/replay_recompute_sec": replay_sec,
            }
        )
        return metrics, sum(grad_norms) / steps

    def _minibatch(self, mb: TensorDict, start_state: TensorDict):
        """One optimizer step on one minibatch; its graph and saved inputs die with it.

        Returns (detached loss terms, pre-clip grad norm, saved block-input bytes, replay seconds).
        """
        acc = GradientAccumulator()
        new = replay_sequence(
            self.policy,
            mb,
            start_state,
            acc,
            self.bptt_truncate,
            block_steps=self.cfg.replay.block_steps,
        )
        batch = mb.select("old_log_prob", "old_value", "advantage", "return", "valid").update(new)
        terms = self.loss(batch, self.cfg, self.entropy_coef)
        grad_norm = optimizer_step(terms, self.model, self.optimizer, self.cfg.optim.max_grad_norm, self.guard)
        return terms.detach(), grad_norm, acc.saved_bytes, acc.replay_seconds

    def _mean_over_ranks(self, value: float) -> float:
        return dist_utils.reduce_mean({"x": value}, self.device, self.info)["x"]
