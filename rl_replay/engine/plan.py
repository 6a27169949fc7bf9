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
from rl_replay.engine.fsdp import FSDP2Deferral, fsdp2_reduces_once, fsdp_units, has_fsdp

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

    __slots__ = (
        "params",
        "absorb",
        "fsdp_units",
        "fsdp2_root",
        "site",
        "reduce_once",
        "recorded",
        "visited",
        "reduce_now",
        "_deferred",
        "_ran",
        "_watching",
    )

    def __init__(self, model: Callable) -> None:
        module = module_of(model)
        self.fsdp_units = fsdp_units(module) if module is not None else []
        self.absorb = bool(self.fsdp_units)
        # NOTE [ Replay blocks ], Rule 11: one gradient reduction per backward where the units
        # keep their parameters gathered anyway.
        self.reduce_once = reduces_once(self.fsdp_units)
        # FSDP2 (Rule 8): the same put-off reduction through set_requires_gradient_sync, for a root
        # that rl_replay.distributed.wrap_fsdp2 wrapped with its parameters kept gathered.
        self.fsdp2_root = module if module is not None and fsdp2_reduces_once(module) else None
        self.reduce_once = self.reduce_once or self.fsdp2_root is not None
        self.recorded = 0  # blocks of this model recorded in the rollout
        self.visited = 0  # of them, blocks whose backward has started in the current backward
        self.reduce_now = False  # the last block's backward must reach FSDP, to reduce the sum
        self._deferred: list = []  # the entered no_sync() contexts while the reduction waits
        self._ran: set[int] = set()  # ids of the units the reducing block's recompute ran
        self._watching: list = []  # the forward hooks that record them
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

    def enter_block_backward(self) -> bool:
        """Called as each block's backward starts; True for the first block (whose backward takes
        the gradients already in ``.grad`` aside), and, under ``reduce_once``, FSDP's gradient
        reduction put off until the last block: the others run under the roots' ``no_sync()``."""
        self.visited += 1
        first = self.visited == 1
        if self.reduce_once:
            last = self.visited >= self.recorded
            if first and not last:
                if self.fsdp2_root is not None:
                    self._deferred.append(FSDP2Deferral(self.fsdp2_root))
                for root in fsdp_roots(self.fsdp_units):
                    context = root.no_sync()  # type: ignore[operator]
                    context.__enter__()
                    self._deferred.append(context)
            elif last and self._deferred:
                self.reduce_now = True  # its (last) nested backward leaves no_sync(): replay.backward_from
                self._watch_units()
        return first

    def _watch_units(self) -> None:
        def ran(unit: torch.nn.Module, *_) -> None:
            self._ran.add(id(unit))

        self._ran.clear()
        self._watching = [unit.register_forward_hook(ran) for unit in self.fsdp_units]

    def units_left_unreduced(self) -> list[str]:
        """Before the reducing backward: the units holding an unreduced gradient that the last
        block's recompute did not run (FSDP reduces only the units a backward reaches)."""
        for hook in self._watching:
            hook.remove()
        self._watching = []
        modules = self.module.named_modules() if self.module is not None else ()
        names = {id(m): n.replace("_fsdp_wrapped_module.", "") for n, m in modules}
        units = {id(unit) for unit in self.fsdp_units}
        left = []
        for unit in self.fsdp_units:
            if id(unit) in self._ran:
                continue
            inner = {id(p) for sub in unit.modules() if sub is not unit and id(sub) in units for p in sub.parameters()}
            if any(p.grad is not None for p in unit.parameters() if id(p) not in inner):
                left.append(names.get(id(unit)) or type(unit).__name__)
        return left

    @property
    def reduction_pending(self) -> bool:
        """True while a backward's blocks accumulate unreduced gradients."""
        return bool(self._deferred)

    def end_deferral(self) -> None:
        """Leave the ``no_sync()`` contexts: the next block's backward reduces every block's sum."""
        while self._deferred:
            self._deferred.pop().__exit__(None, None, None)

    def end_backward(self) -> str:
        """Called once the whole backward is done: why the put-off reduction never ran ('' if it
        ran or nothing was put off)."""
        missed = ""
        if self._deferred:
            unvisited = self.recorded - self.visited
            missed = (
                f"{unvisited} of the rollout's {self.recorded} replay blocks got no backward"
                if unvisited
                else "the rollout's last replay block gave FSDP no gradient to reduce"
            )
        self.end_deferral()
        for hook in self._watching:
            hook.remove()
        self._watching = []
        self.visited = 0
        self.reduce_now = False
        return missed

    def check_fsdp_sync(self) -> None:
        if self._deferred:
            return  # the engine's own no_sync(), not the user's
        for unit in self.fsdp_units:
            if not getattr(unit, "_sync_gradients", True):
                raise ReplayError(
                    _PREFIX + "backward under FullyShardedDataParallel.no_sync() is not supported: "
                    "each replay block runs its own nested backward, so FSDP must reduce-scatter "
                    "every block's gradient. Accumulate over rollouts by keeping one "
                    "GradientAccumulator per rollout and stepping after each, or average losses "
                    "before a single backward."
                )


def reduces_once(units: list[torch.nn.Module]) -> bool:
    """Whether a backward through ``units`` reduces its gradient once, after the last block.

    Under ``SHARD_GRAD_OP`` and ``NO_SHARD`` a unit keeps its parameters gathered from the
    forward on; FSDP1 frees them after a backward only when it reduces the gradient (the
    heuristic of its ``no_sync()``), so blocks run under ``no_sync()`` and the last one reduces
    the sum: one gather and one reduction per unit per backward instead of one per block.
    ``FULL_SHARD`` and ``HYBRID_SHARD`` keep reducing per block: holding every block's unsharded
    gradient would undo the sharding they are chosen for; so does CPU offload.
    """
    if not units:
        return False
    from torch.distributed.fsdp import ShardingStrategy

    keep = (ShardingStrategy.SHARD_GRAD_OP, ShardingStrategy.NO_SHARD)
    # Not under CPU offload: there FSDP would keep the unreduced sum on the GPU until the last
    # block, and the accumulator's per-block path is the one validated on a GPU.
    return all(
        unit.sharding_strategy in keep and not unit.cpu_offload.offload_params  # type: ignore[union-attr]
        for unit in units
    )


def fsdp_roots(units: list[torch.nn.Module]) -> list[torch.nn.Module]:
    """The units no other unit contains (where ``no_sync()`` is entered)."""
    inner = {id(sub) for unit in units for sub in unit.modules() if sub is not unit}
    return [unit for unit in units if id(unit) not in inner]


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
    # One plan per module, whatever callable reaches it (the module, a bound method, a per-step
    # caller): Rule 11's one reduction counts the module's blocks, not the callable's.
    module = module_of(model)
    key = id(model if module is None else module)
    plan = accumulator._plans.get(key)
    if not isinstance(plan, ModelPlan) or plan.module is not module:
        plan = accumulator._plans[key] = ModelPlan(model)
    return plan


def module_of(model: Callable) -> torch.nn.Module | None:
    if isinstance(model, torch.nn.Module):
        return model
    owner = getattr(model, "__self__", None)
    return owner if isinstance(owner, torch.nn.Module) else None
