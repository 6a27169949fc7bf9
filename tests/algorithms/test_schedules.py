"""The entropy weight's schedule: its values along a run, the config's refusals, and a real run
whose logged loss uses the scheduled weight and whose resume continues the schedule exactly."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
from _runs import tiny

from rl_replay.algorithms.schedules import entropy_coef_at
from rl_replay.config import load_config
from rl_replay.run.setup import build


def cfg_of(*overrides):
    return load_config(None, ["total_env_steps=1000", *overrides])


def test_constant_keeps_the_weight():
    cfg = cfg_of("loss.entropy_coef=0.02")
    assert [entropy_coef_at(cfg, s) for s in (0, 500, 5000)] == [0.02, 0.02, 0.02]


def test_linear_moves_to_the_final_weight_then_holds_it():
    cfg = cfg_of("loss.entropy_coef=0.04", "loss.entropy_schedule=linear", "loss.entropy_coef_final=0.01")
    got = [entropy_coef_at(cfg, s) for s in (0, 250, 500, 1000, 4000)]
    assert got == pytest.approx([0.04, 0.0325, 0.025, 0.01, 0.01], abs=1e-15)
    # over a span shorter than the run
    short = cfg_of("loss.entropy_coef=0.04", "loss.entropy_schedule=linear", "loss.entropy_decay_env_steps=100")
    assert [entropy_coef_at(short, s) for s in (0, 50, 100, 900)] == pytest.approx([0.04, 0.02, 0.0, 0.0], abs=1e-15)


def test_exponential_falls_by_one_factor_per_env_step():
    cfg = cfg_of("loss.entropy_coef=0.1", "loss.entropy_schedule=exponential", "loss.entropy_coef_final=0.001")
    got = [entropy_coef_at(cfg, s) for s in (0, 250, 500, 750, 1000, 2000)]
    assert got == pytest.approx([0.1, 0.1 * 10**-0.5, 0.01, 0.001 * 10**0.5, 0.001, 0.001], rel=1e-12)
    ratios = [b / a for a, b in zip(got[:4], got[1:5])]
    assert max(ratios) - min(ratios) < 1e-12  # geometric: the same factor per quarter


@pytest.mark.parametrize(
    "overrides, match",
    [
        (["loss.entropy_schedule=cosine"], r"loss\.entropy_schedule.*Allowed: constant, linear, exponential"),
        (["loss.entropy_schedule=exponential", "loss.entropy_coef=0.01"], r"both be > 0 \(use linear to decay to 0\)"),
        (["loss.entropy_coef=-0.01"], r"loss\.entropy_coef.*must be 0 <="),
        (["loss.entropy_coef_final=-1"], r"loss\.entropy_coef_final"),
        (["loss.entropy_decay_env_steps=0"], r"loss\.entropy_decay_env_steps"),
    ],
)
def test_a_schedule_that_cannot_run_is_refused_naming_the_key(overrides, match):
    with pytest.raises(ValueError, match=match):
        cfg_of(*overrides)


SCHEDULE = (
    "checkpoint.every=0",
    "optim.anneal_lr=false",
    "loss.entropy_coef=0.05",
    "loss.entropy_schedule=linear",
    "loss.entropy_coef_final=0.01",
    "loss.entropy_decay_env_steps=64",
)


def rows(run_dir):
    return [json.loads(line) for line in (Path(run_dir) / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.parametrize("algorithm", ["a2c", "ppo"])
def test_a_run_trains_with_the_scheduled_weight_and_a_resume_continues_it(tmp_path, algorithm):
    extra = (f"loss.algorithm={algorithm}", "ppo.num_minibatches=1")
    build(tiny(tmp_path / "full", 6, *SCHEDULE, *extra)).train()
    full = rows(tmp_path / "full")
    # the weight of update u is the schedule's at the env steps before it (16 per update)
    expected = [0.05 + (0.01 - 0.05) * min(16 * u / 64, 1.0) for u in range(6)]
    assert [r["train/entropy_coef"] for r in full] == pytest.approx(expected, abs=1e-12)
    for r in full:  # the loss's entropy term is -weight x the mean entropy: the weight was used
        assert math.isclose(r["train/loss_entropy"], -r["train/entropy_coef"] * r["train/entropy"], rel_tol=1e-5)

    part = tmp_path / "part"
    build(tiny(part, 3, *SCHEDULE, *extra)).train()
    build(resume=part, overrides=("total_env_steps=96",)).train()
    resumed = rows(part)
    assert [r["update"] for r in resumed] == [1, 2, 3, 4, 5, 6]
    for a, b in zip(full, resumed):
        assert (a["train/entropy_coef"], a["train/loss_policy"]) == (b["train/entropy_coef"], b["train/loss_policy"])


def test_the_algorithm_sets_its_schedules_from_the_progress_it_is_given(tmp_path):
    """Data flows one way: the trainer hands the algorithm a RunProgress; the learning rate, the
    entropy weight and the update the guard names follow from it, and None leaves them alone."""
    from rl_replay.algorithms.schedules import RunProgress, learning_rate_at

    trainer = build(
        load_config(
            None,
            [
                f"run_dir={tmp_path / 'run'}",
                "total_env_steps=1000",
                "env.num_envs=2",
                "collector.num_steps=4",
                "optim.anneal_lr=true",
                "loss.entropy_schedule=linear",
                "loss.entropy_coef=0.04",
                "loss.entropy_coef_final=0.0",
                "log.progress=false",
                "log.wandb_mode=disabled",
            ],
        )
    )
    try:
        algorithm = trainer.algorithm
        algorithm.update(RunProgress(update=3, env_steps=500, budget_used=0.25, last_checkpoint="R (update 2)"))
        assert [g["lr"] for g in algorithm.optimizer.param_groups] == [learning_rate_at(trainer.cfg, 0.25)] * len(
            algorithm.optimizer.param_groups
        )
        assert learning_rate_at(trainer.cfg, 0.25) == trainer.cfg.optim.lr * 0.75
        assert algorithm.entropy_coef == pytest.approx(0.02)
        assert (algorithm.guard.update, algorithm.guard.last_checkpoint) == (3, "R (update 2)")
        algorithm.update()  # no progress: nothing moves
        assert algorithm.entropy_coef == pytest.approx(0.02) and algorithm.guard.update == 3
    finally:
        trainer.close()
