"""What the engine knows about a model, computed once per rollout: its watched state and its plan.

:class:`StateWatch` is the "a block must not change its module" check (Rule 6), public so that
the trainer's agent check runs the same comparison; :class:`ModelPlan` adds the parameters a
block's backward accumulates, the FSDP1 units and the last block's site, cached on the
accumulator (:func:`plan_for`).
"""

from __future__ import annotations

import weakref
from collections.abc import Callable

import torch

from rl_replay.engine.accumulator import GradientAccumulator
from rl_replay.engine.errors import _PREFIX, DEBUG_TIP, ReplayError
from rl_replay.engine.fsdp import fsdp_units, has_fsdp

__all__ = ["StateWatch", "ModelPlan", "plan_for", "module_of"]


# --------------------------------------------------------------------------- model plan
class StateWatch:
    """The parameters and buffers of a module that a replay block must not change.

    A block runs its forward twice (forward and recompute), so a change to its module's
    state would be applied twice (NOTE [ Replay blocks ], Rule 6). The engine compares
    :meth:`versions` around every forward and recompute; the trainer's agent check runs
    the same comparison once before a run starts.

    Args:
        model: an ``nn.Module``, a bound method of one, or any callable (nothing to watch).

    Example::

        watch = StateWatch(agent)
        before = watch.versions()
        agent(**inputs)
        if watch.changed(before):
            ...  # e.g. a BatchNorm in training mode updated its running statistics
    """

    __slots__ = ("module", "watched_names", "watched", "last")

    def __init__(self, model: Callable) -> None:
        self.module = module_of(model)
        self.watched_names, self.watched = self._watched()
        self.last: list[int] | None = None

    def _watched(self) -> tuple[tuple[str, ...], tuple[torch.Tensor, ...]]:
        if self.module is None:
            return (), ()
        named = [(f"buffer '{n}'", b) for n, b in self.module.named_buffers()]
        if not has_fsdp(self.module):
            # FSDP swaps parameter tensors in and out around every forward, so only a
            # plain module's parameters can have their versions watched.
            named += [(f"parameter '{n}'", p) for n, p in self.module.named_parameters()]
        return tuple(n for n, _ in named), tuple(t for _, t in named)

    def versions(self) -> list[int]:
        """The watched tensors' version counters; the previous call's list when unchanged,
        so the blocks of a rollout (which keep it until backward) share one list."""
        now = [t._version for t in self.watched]
        if now == self.last:
            return self.last
        self.last = now
        return now

    def changed(self, before: list[int]) -> list[str]:
        """Names of the watched tensors whose version differs from ``before`` (empty if
        none), with the BatchNorm running statistics that changed silently."""
        after = self.versions()
        if after is before or after == before:
            return []
        names = [n for n, a, b in zip(self.watched_names, after, before) if a != b]
        return _with_silent_stat_updates(self.module, names)


class ModelPlan(StateWatch):
    """Facts about one model computed once per rollout (cached on the accumulator)."""

    __slots__ = ("params", "absorb", "fsdp_units", "site")

    def __init__(self, model: Callable) -> None:
        module = module_of(model)
        self.fsdp_units = fsdp_units(module) if module is not None else []
        self.absorb = bool(self.fsdp_units)
        super().__init__(model)
        self.params: tuple[torch.nn.Parameter, ...] = (
            () if module is None else tuple(p for p in module.parameters() if p.requires_grad)
        )
        self.site: weakref.ref | None = None  # the last block's site, weakly (see Site)

    def check_versions(self, before: list[int], when: str, index: int) -> list[int]:
        """``before`` if nothing watched changed since; raises ReplayError otherwise."""
        changed = self.changed(before)
        if not changed:
            return before  # blocks keep it until backward: one list, not one per block
        raise ReplayError(
            _PREFIX + f"{when} changed {', '.join(changed)} of {type(self.module).__name__} "
            f"(block {index}). A replay block must not modify its module's parameters "
            "or buffers: the forward and the recompute would each apply the change. "
            "Put layers such as BatchNorm in eval mode (or use LayerNorm), update running "
            "statistics outside the block, and call optimizer.step() only after "
            "loss.backward()." + DEBUG_TIP
        )

    def check_fsdp_sync(self) -> None:
        for unit in self.fsdp_units:
            if not getattr(unit, "_sync_gradients", True):
                raise ReplayError(
                    _PREFIX + "backward under FullyShardedDataParallel.no_sync() is not supported: "
                    "each replay block runs its own nested backward, so FSDP must reduce-scatter "
                    "every block's gradient. Accumulate over rollouts by keeping one "
                    "GradientAccumulator per rollout and stepping after each, or average losses "
                    "before a single backward."
                )


def _with_silent_stat_updates(module: torch.nn.Module | None, changed: list[str]) -> list[str]:
    """``changed`` plus the running statistics that BatchNorm updated without a trace.

    Error path only. The native batch-norm kernel updates ``running_mean`` and
    ``running_var`` in place without bumping their version counters (at least on
    CPU), so only the Python-side ``num_batches_tracked += 1`` is seen; name the
    statistics too, since they are what the user needs to hear about.
    """
    if module is None:
        return changed
    from torch.nn.modules.batchnorm import _BatchNorm

    out = list(changed)
    for prefix, sub in module.named_modules():
        if not (isinstance(sub, _BatchNorm) and sub.training and sub.track_running_stats):
            continue
        dot = f"{prefix}." if prefix else ""
        counter = f"buffer '{dot}num_batches_tracked'"
        if counter not in out:
            continue
        stats = [f"buffer '{dot}{n}'" for n in ("running_mean", "running_var")]
        at = out.index(counter)
        out[at:at] = [s for s in stats if s not in out]
    return out


def plan_for(accumulator: GradientAccumulator, model: Callable) -> ModelPlan:
    plan = accumulator._plans.get(id(model))
    if plan is None or plan.module is not module_of(model):  # type: ignore[attr-defined]
        plan = accumulator._plans[id(model)] = ModelPlan(model)
    return plan  # type: ignore[return-value]


def module_of(model: Callable) -> torch.nn.Module | None:
    if isinstance(model, torch.nn.Module):
        return model
    owner = getattr(model, "__self__", None)
    return owner if isinstance(owner, torch.nn.Module) else None
