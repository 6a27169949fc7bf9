"""Where a run stands (:class:`RunProgress`) and what follows from it: the learning rate
(``optim.anneal_lr``) and the entropy bonus's weight (``loss.entropy_schedule``). The trainer hands an
algorithm the progress; the algorithm reads its schedules here (data flows one way)."""

from __future__ import annotations

from dataclasses import dataclass

from rl_replay.config import Config

__all__ = ["RunProgress", "entropy_coef_at", "learning_rate_at"]


@dataclass(frozen=True)
class RunProgress:
    """The run as the next update starts.

    Attributes:
        update: the 1-based number of the update about to run.
        env_steps: env steps taken so far, over all ranks.
        budget_used: the fraction of the run done, in [0, 1]: the learning rate's clock.
        last_checkpoint: ``"PATH (update N)"`` of the checkpoint written or loaded last (None: none),
            which a refusal of non-finite values names.
    """

    update: int
    env_steps: int
    budget_used: float
    last_checkpoint: str | None = None


def learning_rate_at(cfg: Config, budget_used: float) -> float:
    """``optim.lr``, annealed linearly to 0 over the run when ``optim.anneal_lr``."""
    if not cfg.optim.anneal_lr:
        return cfg.optim.lr
    return cfg.optim.lr * (1.0 - budget_used)


def entropy_coef_at(cfg: Config, env_steps: int) -> float:
    """The entropy bonus's weight after ``env_steps`` env steps (over all ranks) of the run.

    ``loss.entropy_schedule``: ``constant`` keeps ``loss.entropy_coef``; ``linear`` moves it to
    ``loss.entropy_coef_final`` in equal steps per env step, ``exponential`` by an equal factor
    per env step, both over ``loss.entropy_decay_env_steps`` (None: ``total_env_steps``), then
    holds the final weight. A function of the env-step count alone, so a resumed run continues
    the schedule where it stopped.
    """
    loss = cfg.loss
    if loss.entropy_schedule == "constant":
        return loss.entropy_coef
    span = loss.entropy_decay_env_steps or cfg.total_env_steps
    frac = min(max(env_steps / span, 0.0), 1.0)
    start, final = loss.entropy_coef, loss.entropy_coef_final
    if loss.entropy_schedule == "linear":
        return start + (final - start) * frac
    return start * (final / start) ** frac  # exponential (the config allows no other)
