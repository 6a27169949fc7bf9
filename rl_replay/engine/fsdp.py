"""FSDP checks and hooks of the replay engine.

A replay block serves FSDP1 with ``use_orig_params=True`` under ``FULL_SHARD``, ``SHARD_GRAD_OP``,
``HYBRID_SHARD`` or ``NO_SHARD`` (NOTE [ Replay
blocks ], Rule 8, in :mod:`rl_replay.engine.replay`): :func:`fsdp_units` finds the units of a model
and rejects every other FSDP1 setup with a :class:`~rl_replay.engine.ReplayError`; it also gives tensors
inside TensorDict outputs the pre-backward hook FSDP1 gives plain tensors. A module wrapped with
FSDP2's ``fully_shard`` needs none of this: its public hooks serve the blocks as they are, and
:class:`FSDP2Deferral` puts its gradient reduction off to the last block where
:func:`fsdp2_reduces_once` says the units stay gathered (Rule 11).
"""

from __future__ import annotations

import sys
from collections.abc import Mapping
from typing import Any

import torch
from tensordict import TensorDictBase

from rl_replay.engine.errors import _PREFIX, ReplayError

__all__ = ["fsdp_units", "has_fsdp", "fsdp2_reduces_once", "FSDP2Deferral"]


def has_fsdp(module: torch.nn.Module) -> bool:
    if "torch.distributed.fsdp" not in sys.modules:
        return False  # nobody imported FSDP, so nothing can be wrapped in it
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    return any(isinstance(sub, FSDP) for sub in module.modules())


def fsdp2_reduces_once(module: torch.nn.Module) -> bool:
    """Whether ``module`` is an FSDP2 root that :func:`rl_replay.distributed.wrap_fsdp2` wrapped with
    its units' parameters kept gathered from forward to backward and no CPU offload (its marker
    ``_rl_replay_reduce_once``): then the blocks' gradients are summed unreduced and reduced once, in
    the last block's backward (Rule 11). A module the user wrapped with ``fully_shard`` reduces in
    every block's backward: FSDP2's public API does not say whether it keeps its parameters gathered."""
    return bool(getattr(module, "_rl_replay_reduce_once", False))


class FSDP2Deferral:
    """FSDP2's gradient reduction put off, through its public setters: the blocks' backwards
    accumulate the unsharded gradient and keep the parameters gathered until :meth:`__exit__`, after
    which the next backward reduce-scatters the sum and reshards (FSDP1's ``no_sync()``)."""

    __slots__ = ("root",)

    def __init__(self, root: Any) -> None:
        self.root = root
        root.set_requires_gradient_sync(False)
        root.set_reshard_after_backward(False)

    def __exit__(self, *exc: object) -> None:
        self.root.set_requires_gradient_sync(True)
        self.root.set_reshard_after_backward(True)


def _served() -> tuple:
    from torch.distributed.fsdp import ShardingStrategy

    return (
        ShardingStrategy.FULL_SHARD,
        ShardingStrategy.SHARD_GRAD_OP,
        ShardingStrategy.HYBRID_SHARD,
        ShardingStrategy.NO_SHARD,
    )


def fsdp_units(module: torch.nn.Module) -> list[torch.nn.Module]:
    """The FSDP1 units inside ``module``, after rejecting setups replay cannot serve.

    A module wrapped with FSDP2's ``fully_shard`` has none: its public hooks gather a unit's
    parameters in the block's forward and in its recompute, and reduce-scatter each nested
    backward's gradient into the sharded ``.grad``, which sums the blocks (Rule 8)."""
    if "torch.distributed.fsdp" not in sys.modules:
        return []  # nobody imported FSDP, so nothing can be wrapped in it
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    served = _served()
    units = []
    for name, sub in module.named_modules():
        where = f"module '{name}'" if name else f"the root module ({type(sub).__name__})"
        if not isinstance(sub, FSDP):
            continue
        if not sub._use_orig_params:
            raise ReplayError(
                _PREFIX + f"{where} uses FullyShardedDataParallel(use_orig_params=False); replay "
                "needs use_orig_params=True so recomputed forwards stay visible to autograd "
                "and to FSDP's post-backward hooks. Pass use_orig_params=True."
            )
        strategy = sub.sharding_strategy
        if strategy not in served:
            raise ReplayError(
                _PREFIX + f"{where} uses sharding strategy {strategy.name}; replay serves FULL_SHARD, "
                "SHARD_GRAD_OP, HYBRID_SHARD or NO_SHARD. Pass one of those as sharding_strategy."
            )
        units.append(sub)
    _hook_tensordict_outputs(units)  # type: ignore[arg-type]
    return units  # type: ignore[return-value]


def _tensordict_leaves(value: Any, out: list[torch.Tensor]) -> None:
    """The tensors inside TensorDicts in ``value``, however nested in dicts, lists and
    tuples (FSDP1's own traversal finds every other tensor but skips these)."""
    if isinstance(value, TensorDictBase):
        out.extend(t for t in value.values(include_nested=True, leaves_only=True) if isinstance(t, torch.Tensor))
    elif isinstance(value, Mapping):
        for v in value.values():
            _tensordict_leaves(v, out)
    elif isinstance(value, (list, tuple)):
        for v in value:
            _tensordict_leaves(v, out)


def _hook_tensordict_outputs(units: list[torch.nn.Module]) -> None:
    """Give tensors inside TensorDict outputs of FSDP1 units FSDP's pre-backward hook.

    FSDP1's post-forward registers that hook only on tensors it finds in plain
    containers (tensor, dict, list, tuple, dataclass), so for a model returning a
    TensorDict the recomputed forward's backward would never unshard the unit nor
    queue the root's post-backward callback ("expected to be in states
    FORWARD_BACKWARD"). The hook is idempotent per backward, so registering it on
    every leaf is safe; installed once per unit.
    """
    import functools

    from torch.distributed.fsdp import _runtime_utils

    def post_forward(unit: torch.nn.Module, args: Any, output: Any) -> None:
        if not torch.is_grad_enabled() or isinstance(output, torch.Tensor):
            return
        leaves: list[torch.Tensor] = []
        _tensordict_leaves(output, leaves)  # plain tensors in containers are FSDP's own
        handle = unit._handle
        hook = functools.partial(_runtime_utils._pre_backward_hook, unit, unit, handle)
        for t in leaves:
            if t.requires_grad:
                t.register_hook(torch.utils.hooks.unserializable_hook(hook))
                if handle:
                    handle._needs_pre_backward_unshard = True  # type: ignore[union-attr]

    for unit in units:
        if not getattr(unit, "_rl_replay_tensordict_hook", False):
            unit.register_forward_hook(post_forward)
            unit._rl_replay_tensordict_hook = True  # type: ignore[assignment]
