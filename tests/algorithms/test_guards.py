"""rl_replay/guards.py: NaN or infinity never reaches an optimizer step or a checkpoint.

Covers ``check_update`` (the skip budget, then a one-line stop naming the update, the
offending loss term or gradient and the last checkpoint; the decision of another rank;
parameters are only looked at on the error path), ``check_parameters``, ``StepGuard``
(the same checks on a model for the update in progress) and ``non_finite_env_step``.
Through the trainer (skipped updates in the metrics, PPO's steps): tests/run/test_nonfinite_guards.py.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from rl_replay.errors import NonFiniteError
from rl_replay.guards import SkipBudget, StepGuard, check_parameters, check_update, non_finite_env_step


def test_skip_budget_skips_then_stops(capsys):
    w = torch.nn.Parameter(torch.ones(2))
    w.grad = torch.tensor([1.0, float("inf")])
    terms = {"loss_policy": torch.tensor(1.0), "loss_value": torch.tensor(2.0)}
    budget = SkipBudget(2)
    kwargs = {"last_checkpoint": "R/checkpoint.pt (update 4)", "budget": budget}
    norm = torch.tensor(float("inf"))
    params = lambda: [("actor.w", w)]  # noqa: E731
    assert check_update(terms, torch.tensor(1.0), params, update=5, **kwargs) is True
    assert check_update(terms, norm, params, update=5, **kwargs) is False
    assert (
        check_update({**terms, "loss_value": torch.tensor(float("nan"))}, torch.tensor(1.0), params, update=6, **kwargs)
        is False
    )
    err = capsys.readouterr().err.splitlines()
    assert err[0].startswith("warning: update 5: gradient of actor.w is inf") and "1 more may be skipped" in err[0]
    assert err[1].startswith("warning: update 6: loss term train/loss_value is nan")
    with pytest.raises(
        NonFiniteError,
        match=r"^update 7: gradient of actor.w is inf .*last good checkpoint: "
        r"R/checkpoint.pt \(update 4\)",
    ):
        check_update(terms, norm, params, update=7, **kwargs)
    assert budget.skipped == 2
    with pytest.raises(NonFiniteError, match=r"update 8: after the optimizer step parameter b is -inf"):
        check_parameters(
            [("a", torch.ones(2)), ("b", torch.tensor([0.0, -float("inf")]))], update=8, last_checkpoint=None
        )


def test_parameters_are_only_read_on_the_error_path():
    def params():
        raise AssertionError("read the parameters although everything was finite")

    terms = {"loss_policy": torch.tensor(0.5), "entropy": torch.tensor([1.0, 2.0])}  # non-scalars not checked
    assert check_update(terms, torch.tensor(3.0), params, update=1, last_checkpoint=None, budget=SkipBudget()) is True
    check_parameters([("w", torch.ones(3)), ("empty", torch.ones(0))], update=1, last_checkpoint=None)


def test_another_ranks_non_finite_values_stop_this_rank_too():
    w = torch.nn.Parameter(torch.ones(2))
    w.grad = torch.ones(2)
    everywhere = lambda local_bad: True  # noqa: E731 - an all-reduce that saw a bad flag elsewhere
    with pytest.raises(
        NonFiniteError,
        match=r"^update 3: gradient norm is 1\.5 \(on another rank\); stopped "
        r"before the optimizer step \(no checkpoint written yet\)\.",
    ):
        check_update(
            {"loss": torch.tensor(1.0)},
            torch.tensor(1.5),
            lambda: [("w", w)],
            update=3,
            last_checkpoint=None,
            budget=SkipBudget(),
            any_rank=everywhere,
        )
    with pytest.raises(
        NonFiniteError,
        match=r"^update 3: after the optimizer step a parameter is not finite "
        r"\(on another rank\) \(no checkpoint written yet\)\. Lower optim\.lr",
    ):
        check_parameters([("w", w)], update=3, last_checkpoint=None, any_rank=everywhere)


def test_step_guard_checks_the_model_for_the_update_in_progress(capsys):
    model = torch.nn.Linear(2, 1)
    guard = StepGuard(model, SkipBudget(1))
    guard.begin(9, "R/checkpoint.pt (update 8)")
    model(torch.ones(1, 2)).sum().backward()
    assert guard.allows_step({"loss": torch.tensor(1.0)}, torch.tensor(1.0)) is True
    model.bias.grad.fill_(float("nan"))
    assert guard.allows_step({"loss": torch.tensor(1.0)}, torch.tensor(float("nan"))) is False
    assert capsys.readouterr().err.startswith("warning: update 9: gradient of bias is nan")
    assert guard.budget.skipped == 1 and guard.budget.left == 0
    with torch.no_grad():
        model.weight[0, 1] = float("inf")
    with pytest.raises(
        NonFiniteError,
        match=r"^update 9: after the optimizer step parameter weight is inf "
        r"\(last good checkpoint: R/checkpoint.pt \(update 8\)\)",
    ):
        guard.after_step()


def test_env_step_errors_name_the_env_and_the_first_bad_sub_env():
    obs, reward = np.zeros((3, 2), np.float32), np.ones(3)
    assert non_finite_env_step("E-v0", obs, reward) is None
    assert non_finite_env_step("E-v0", {"pos": obs, "id": np.arange(3)}, reward) is None
    bad_reward = reward.copy()
    bad_reward[1] = np.nan
    assert non_finite_env_step("E-v0", obs, bad_reward) == (
        "environment 'E-v0' returned a non-finite reward (nan) in sub-env 1; fix the environment or wrap it "
        "to sanitise its rewards."
    )
    bad_obs = obs.copy()
    bad_obs[2, 1] = -np.inf
    expected = (
        "environment 'E-v0' returned a non-finite observation in sub-env 2; fix the environment or "
        "wrap it to sanitise its observations."
    )
    assert non_finite_env_step("E-v0", bad_obs, reward) == expected
    assert non_finite_env_step("E-v0", {"id": np.arange(3), "pos": bad_obs}, reward) == expected
