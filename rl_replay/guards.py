"""Non-finite guards: NaN or infinity never reaches an optimizer step or a checkpoint.

Every optimizer step (:func:`rl_replay.algorithms.common.optimizer_step`) runs two checks
through the run's :class:`StepGuard`:

* :func:`check_update` after backward and clipping, before ``optimizer.step()``: the loss
  terms and the (global) gradient norm must be finite. Otherwise it raises
  :class:`~rl_replay.errors.NonFiniteError`, or, while the run's skip budget lasts, tells the caller to skip
  the step (and prints one line about it).
* :func:`check_parameters` after the step: every parameter must be finite.

The collector checks each vector-env step output with :func:`non_finite_env_step` (one vectorised
``np.isfinite`` per array). Every check reduces to one flag per update or step; the
offending names are searched for only on the error path.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass

import numpy as np
import torch

from rl_replay.errors import NonFiniteError

__all__ = ["SkipBudget", "StepGuard", "check_update", "check_parameters", "non_finite_env_step"]


@dataclass
class SkipBudget:
    """How many more updates with a non-finite loss or gradient may be skipped."""

    left: int = 0
    skipped: int = 0


def _local(t: torch.Tensor) -> torch.Tensor:
    """This rank's part of ``t`` (an FSDP2 parameter or gradient is a DTensor; every check here
    reduces its flag over the ranks itself)."""
    return t.to_local() if hasattr(t, "to_local") else t


def _first_bad(values: Mapping[str, torch.Tensor]) -> tuple[str, float] | None:
    for name, value in values.items():
        v = value.detach()
        if not bool(torch.isfinite(v).all()):
            bad = v[~torch.isfinite(v)].flatten()[0]
            return name, float(bad)
    return None


def _where(last_checkpoint: str | None) -> str:
    return f"last good checkpoint: {last_checkpoint}" if last_checkpoint else "no checkpoint written yet"


def check_update(
    terms: Mapping[str, torch.Tensor],
    grad_norm: torch.Tensor,
    params: Callable[[], Iterable],
    *,
    update: int,
    last_checkpoint: str | None,
    budget: SkipBudget,
    any_rank: Callable[[bool], bool] = bool,
) -> bool:
    """True if the optimizer may step; False if this update is to be skipped.

    ``terms`` are this rank's loss terms, ``grad_norm`` the total norm returned by
    gradient clipping (global over ranks under FSDP). ``params`` yields ``(name, parameter)``
    pairs and is only called to name a parameter on the error path. ``any_rank`` turns a
    local flag into "true on some rank" (an all-reduce under torchrun), so every rank
    takes the same decision.
    """
    scalars = [t.detach().float().reshape(()) for t in terms.values() if isinstance(t, torch.Tensor) and t.numel() == 1]
    # Under FSDP with CPUOffload the loss terms live on the GPU while the gradients, and so
    # the clipped norm, live on the host: bring the norm to the terms' device (one sync).
    norm = grad_norm.detach().float().reshape(())
    finite = bool(torch.isfinite(torch.stack([*scalars, norm.to(scalars[0].device) if scalars else norm])).all())
    bad = any_rank(not finite)
    if not bad:
        return True
    culprit = _first_bad({f"train/{k}": v for k, v in terms.items() if isinstance(v, torch.Tensor)})
    if culprit is not None:
        what = f"loss term {culprit[0]} is {culprit[1]}"
    else:
        grads = {f"gradient of {n}": _local(p.grad) for n, p in params() if p.grad is not None}
        culprit = _first_bad(grads)
        what = (
            f"{culprit[0]} is {culprit[1]} (gradient norm {float(grad_norm)})"
            if culprit
            else f"gradient norm is {float(grad_norm)} (on another rank)"
        )
    if budget.left > 0:
        budget.left -= 1
        budget.skipped += 1
        print(
            f"warning: update {update}: {what}; skipped this update without an optimizer step "
            f"({budget.left} more may be skipped).",
            file=sys.stderr,
            flush=True,
        )
        return False
    raise NonFiniteError(
        f"update {update}: {what}; stopped before the optimizer step ({_where(last_checkpoint)}). "
        "Lower optim.lr, set optim.max_grad_norm, or allow optim.skip_nonfinite_updates."
    )


def check_parameters(
    named_params: Iterable, *, update: int, last_checkpoint: str | None, any_rank: Callable[[bool], bool] = bool
) -> None:
    """Raise :class:`NonFiniteError` if any parameter (on any rank) holds NaN or infinity."""
    named = [(n, p) for n, p in ((n, _local(p)) for n, p in named_params) if p.numel()]
    flags = (
        torch.stack([torch.isfinite(p.detach()).all() for _, p in named]) if named else torch.ones(1, dtype=torch.bool)
    )
    if not any_rank(not bool(flags.all())):
        return
    culprit = _first_bad(dict(named))
    what = f"parameter {culprit[0]} is {culprit[1]}" if culprit else "a parameter is not finite (on another rank)"
    raise NonFiniteError(
        f"update {update}: after the optimizer step {what} ({_where(last_checkpoint)}). "
        "Lower optim.lr or set optim.max_grad_norm."
    )


def non_finite_env_step(env_id: str, observation, reward: np.ndarray) -> str | None:
    """The one-line error for a step that returned a NaN/inf reward or observation, else None."""
    if not np.isfinite(reward).all():
        i = int(np.flatnonzero(~np.isfinite(reward))[0])
        return (
            f"environment '{env_id}' returned a non-finite reward ({reward[i]}) in sub-env {i}; "
            "fix the environment or wrap it to sanitise its rewards."
        )
    leaves = observation.values() if isinstance(observation, Mapping) else (observation,)
    for leaf in leaves:
        if isinstance(leaf, np.ndarray) and leaf.dtype.kind == "f" and not np.isfinite(leaf).all():
            i = int(np.flatnonzero(~np.isfinite(leaf).reshape(len(leaf), -1).all(axis=1))[0])
            return (
                f"environment '{env_id}' returned a non-finite observation in sub-env {i}; "
                "fix the environment or wrap it to sanitise its observations."
            )
    return None


class StepGuard:
    """The checks around one optimizer step, for the update the trainer is making.

    :meth:`begin` gives it the 1-based number of the update in progress and the last checkpoint
    (what a refusal names), from the run's progress the algorithm is given; an algorithm hands the guard to
    :func:`rl_replay.algorithms.common.optimizer_step`, which calls :meth:`allows_step`
    after clipping and :meth:`after_step` after ``optimizer.step()``.
    """

    def __init__(self, model: torch.nn.Module, budget: SkipBudget, any_rank: Callable[[bool], bool] = bool) -> None:
        self.model = model
        self.budget = budget
        self.any_rank = any_rank
        self.update = 0
        self.last_checkpoint: str | None = None

    def begin(self, update: int, last_checkpoint: str | None) -> None:
        """The update about to run (1-based) and ``"PATH (update N)"`` of the last checkpoint."""
        self.update, self.last_checkpoint = update, last_checkpoint

    def allows_step(self, terms: Mapping[str, torch.Tensor], grad_norm: torch.Tensor) -> bool:
        """See :func:`check_update`: False means skip this step (budget), raises when spent."""
        return check_update(
            terms,
            grad_norm,
            self.model.named_parameters,
            update=self.update,
            last_checkpoint=self.last_checkpoint,
            budget=self.budget,
            any_rank=self.any_rank,
        )

    def after_step(self) -> None:
        """See :func:`check_parameters`."""
        check_parameters(
            self.model.named_parameters(),
            update=self.update,
            last_checkpoint=self.last_checkpoint,
            any_rank=self.any_rank,
        )
