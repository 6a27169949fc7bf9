"""Schedules of loss weights over a run (the learning rate's is the trainer's ``optim.anneal_lr``)."""

from __future__ import annotations

from rl_replay.config import Config

__all__ = ["entropy_coef_at"]


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
