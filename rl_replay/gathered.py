"""FSDP parameters gathered once for a stretch of no-grad forwards (a rollout's collection).

Every forward of an FSDP unit all-gathers its parameters and, under ``FULL_SHARD`` and
``HYBRID_SHARD`` (FSDP2: ``reshard_after_forward=True``), frees them again afterwards. Collection
runs the policy once per env step, so a rollout of T steps gathers every unit T times, though the
parameters do not change until the update. :func:`gathered` gathers each unit once and, while it is
entered, no forward gathers again: under FSDP1 through ``FSDP.summon_full_params``, calling every
unit's wrapped module directly; under FSDP2 through its public ``unshard()``, with
``set_reshard_after_forward(False)`` until the exit puts each unit's own setting back. Nothing is
written back and the full parameters are freed on exit. Only forwards without a graph belong
inside: a replay block's forward is one (its backward, later, recomputes through FSDP's own
forward); an update's forward is not.

:func:`collection_plan` decides whether a run collects this way (``distributed.collect_gathered``):
``auto`` gathers when the full parameters fit the budget; every rank takes the same decision,
since gathering is collective.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from rl_replay.distributed import splits_parameters
from rl_replay.errors import SetupError

__all__ = ["CollectionPlan", "collection_plan", "gathered", "full_parameter_bytes"]


def _units(model: nn.Module) -> list[Any]:
    """The FSDP1 units inside ``model`` (itself included); empty when nothing is wrapped."""
    import sys

    if "torch.distributed.fsdp" not in sys.modules:
        return []  # nobody imported FSDP, so nothing can be wrapped in it
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    return FSDP.fsdp_modules(model)


def _fsdp2_units(model: nn.Module) -> list[Any]:
    """The modules of ``model`` that FSDP2's ``fully_shard`` made units (itself included)."""
    import sys

    if "torch.distributed.fsdp" not in sys.modules:
        return []
    from torch.distributed.fsdp import FSDPModule

    return [m for m in model.modules() if isinstance(m, FSDPModule)]


def full_parameter_bytes(model: nn.Module) -> int:
    """Bytes of an FSDP-wrapped ``model``'s parameters when every unit is gathered."""
    if _fsdp2_units(model):
        return sum(p.numel() * p.element_size() for p in model.parameters())  # a DTensor's numel is global
    flats = [unit._handle.flat_param for unit in _units(model) if unit._handle is not None]
    return sum(sum(flat._numels) * flat.element_size() for flat in flats)


def _whole_on_every_rank(model: nn.Module) -> bool:
    """True when no parameter of ``model`` is split over ranks (FSDP1 NO_SHARD, FSDP2 on a mesh
    whose shard dimension is one rank)."""
    if _fsdp2_units(model):
        return not splits_parameters(model)
    from torch.distributed.fsdp import ShardingStrategy

    return all(unit.sharding_strategy == ShardingStrategy.NO_SHARD for unit in _units(model))


@contextlib.contextmanager
def _gathered_fsdp2(model: nn.Module, units: list[Any]) -> Iterator[None]:
    for unit in units:
        unit.set_reshard_after_forward(False, recurse=False)
    try:
        for unit in units:
            unit.unshard()
        yield
    finally:
        for unit in units:
            unit.reshard()
            # What wrap_fsdp2 chose for the unit; FSDP2's defaults for a module wrapped elsewhere.
            unit.set_reshard_after_forward(
                getattr(unit, "_rl_replay_reshard_after_forward", unit is not model), recurse=False
            )


@contextlib.contextmanager
def gathered(model: nn.Module) -> Iterator[None]:
    """Gather every FSDP unit of ``model`` once; inside, no forward gathers again.

    For forwards under ``torch.no_grad`` (or inside a replay block's forward). The module's own
    hooks still run; FSDP's per-forward gather does not. Collective: enter it on every rank.
    Outside FSDP it does nothing.
    """
    units2 = _fsdp2_units(model)
    if units2:
        with _gathered_fsdp2(model, units2):
            yield
        return
    units = _units(model)
    if not units:
        yield
        return
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    with FSDP.summon_full_params(model, writeback=False, recurse=True):
        for unit in units:
            # An instance attribute shadows FSDP.forward for this unit only; nn.Module's call
            # (and its hooks) still wraps it, and the wrapped module's own call runs its hooks.
            # Set past nn.Module.__setattr__, which would register a module as a child.
            # Removed below, whatever happens inside.
            object.__setattr__(unit, "forward", unit._fsdp_wrapped_module.__call__)
        try:
            yield
        finally:
            for unit in units:
                vars(unit).pop("forward", None)


@dataclass(frozen=True)
class CollectionPlan:
    """How a run's collection reaches the parameters, and the one line that says so."""

    gathered: bool
    line: str


def _budget(device: torch.device) -> tuple[int, str]:
    """Half the memory this rank can still have: free GPU memory on CUDA, else the machine's
    available memory shared by the ranks on this node."""
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return free // 2, "half the free GPU memory"
    import psutil

    local = max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
    return psutil.virtual_memory().available // (2 * local), "half this rank's share of the available memory"


def collection_plan(
    model: nn.Module,
    setting: str,
    *,
    device: torch.device,
    mixed_precision: str | None = None,
    cpu_offload: bool = False,
    agree: Callable[[bool], bool] = lambda ok: ok,
) -> CollectionPlan:
    """Decide ``distributed.collect_gathered`` (``auto``, ``true`` or ``false``) for ``model``.

    ``true`` where it cannot be served raises a :class:`~rl_replay.errors.SetupError` (one line
    saying why); ``auto`` gathers when the full parameters fit :func:`_budget`. ``agree`` turns
    this rank's answer into every rank's (true only if true on all), so no rank gathers alone.
    """
    fsdp2 = bool(_fsdp2_units(model))
    if not fsdp2 and not _units(model):
        return CollectionPlan(False, "collection: one process, the parameters are whole")
    if _whole_on_every_rank(model):
        return CollectionPlan(False, "collection: NO_SHARD keeps the parameters whole on every rank, nothing to gather")
    refusal = None
    # FSDP2's unshard() gathers in the MixedPrecisionPolicy's dtype, as its forward does: the same log-probs.
    if mixed_precision and not fsdp2:
        refusal = (
            f"distributed.mixed_precision={mixed_precision} casts the parameters in FSDP's own forward, "
            "which gathered collection skips (its log-probs would not be the update's)"
        )
    elif cpu_offload:
        refusal = "distributed.cpu_offload keeps the full parameters off the GPU"
    if refusal:
        if setting == "true":
            raise SetupError(f"distributed.collect_gathered=true is not served: {refusal}. Use auto or false.")
        return CollectionPlan(False, f"collection: each unit gathered per step ({refusal})")
    if setting == "false":
        return CollectionPlan(False, "collection: each unit gathered per step (distributed.collect_gathered=false)")
    need = full_parameter_bytes(model)
    mib = need / 2**20
    if setting == "true":
        return CollectionPlan(True, f"collection: parameters gathered once per rollout ({mib:.1f} MiB in full)")
    budget, what = _budget(device)
    ok = agree(need <= budget)
    if ok:
        return CollectionPlan(
            True, f"collection: parameters gathered once per rollout ({mib:.1f} MiB in full, within {what})"
        )
    return CollectionPlan(
        False, f"collection: each unit gathered per step (the full parameters, {mib:.1f} MiB, exceed {what} on a rank)"
    )
