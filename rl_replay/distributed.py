"""Process group from the torchrun environment, FSDP1 and FSDP2 wrapping and cross-rank reductions."""

from __future__ import annotations

import functools
import os
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from rl_replay.errors import SetupError

__all__ = [
    "DistInfo",
    "init_from_env",
    "wrap_fsdp",
    "wrap_fsdp2",
    "fsdp_version_of",
    "splits_parameters",
    "sharding_line",
    "broadcast_module_states",
    "broadcast_from_main",
    "on_main",
    "any_rank",
    "reduce_mean",
    "reduce_sums",
    "barrier",
    "shutdown",
]


@dataclass(frozen=True)
class DistInfo:
    """Where this process sits in the job (rank 0 of 1 outside torchrun)."""

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    launched: bool = False
    """started by torchrun: a distributed (FSDP) job even with one process, e.g.
    ``torchrun --nproc_per_node=1`` for FSDP's CPU offload on one GPU"""

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return self.world_size > 1 or self.launched


def init_from_env(device: str, backend: str = "auto") -> tuple[DistInfo, torch.device]:
    """Join the process group described by torchrun's environment variables, if any.

    Returns the rank info and this rank's device (``cuda:LOCAL_RANK`` on CUDA).
    """
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cuda" and not torch.cuda.is_available():
        raise SetupError("device 'cuda' requested but CUDA is not available; use device=cpu.")
    torch_device = torch.device(device, local_rank) if device == "cuda" else torch.device("cpu")
    if torch_device.type == "cuda":
        torch.cuda.set_device(torch_device)
    # torchrun's elastic agent sets TORCHELASTIC_RUN_ID in every worker it starts.
    info = DistInfo(rank, world_size, local_rank, launched="TORCHELASTIC_RUN_ID" in os.environ)
    if info.distributed and not dist.is_initialized():
        if backend == "auto":
            backend = "nccl" if torch_device.type == "cuda" else "gloo"
        attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT")
        if attempt is None:
            dist.init_process_group(backend=backend)
        else:
            # Under torchrun the store outlives a restart (it is the elastic agent's), and so do the
            # keys a process group's ranks publish their addresses under: a restarted rank could read
            # a dead predecessor's address and fail to connect ("Gloo connectFullMesh failed ...
            # Connection refused", pytorch/pytorch#167288). Each attempt gets keys of its own.
            store, rank, world_size = next(dist.rendezvous("env://"))
            store = dist.PrefixStore(f"rl_replay/attempt-{attempt}/", store)
            dist.init_process_group(backend=backend, store=store, rank=rank, world_size=world_size)
    return info, torch_device


def _auto_wrap_policy(model: nn.Module, wrap_modules: list[str], min_num_params: int | None):
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy, size_based_auto_wrap_policy

    if min_num_params:
        return functools.partial(size_based_auto_wrap_policy, min_num_params=min_num_params)
    if not wrap_modules:
        return None
    classes = {type(m) for m in model.modules() if type(m).__name__ in wrap_modules}
    missing = set(wrap_modules) - {c.__name__ for c in classes}
    if missing:
        names = sorted({type(m).__name__ for m in model.modules()})
        raise SetupError(
            f"distributed.wrap_modules names {sorted(missing)}, which the agent does not contain. "
            f"Module classes in the agent: {', '.join(names)}."
        )
    return ModuleWrapPolicy(classes)


def wrap_fsdp(
    model: nn.Module,
    device: torch.device,
    *,
    wrap_modules: list[str] = (),  # type: ignore[assignment]
    min_num_params: int | None = None,
    cpu_offload: bool = False,
    mixed_precision: str | None = None,
    sharding_strategy: str = "FULL_SHARD",
) -> nn.Module:
    """Wrap ``model`` in FSDP1 with ``use_orig_params=True`` (what replay needs) and
    ``sharding_strategy`` (``FULL_SHARD``, ``SHARD_GRAD_OP``, ``HYBRID_SHARD`` or ``NO_SHARD``: FSDP1's
    own names; HYBRID_SHARD's node is torchrun's ``LOCAL_WORLD_SIZE`` ranks, :func:`hybrid_mesh`).

    * Every rank starts from rank 0's parameters and buffers (broadcast before sharding:
      ranks seed differently, and FSDP1's ``sync_module_states`` refuses CPU modules).
    * ``device`` is passed as FSDP's ``device_id``, also on CPU (FSDP1 otherwise looks
      for an accelerator and fails on CPU-only machines).
    * Agents return TensorDicts, which FSDP1's own output traversal does not see; the
      replay engine registers FSDP's pre-backward hooks on their leaves itself (see
      ``rl_replay.engine.fsdp._hook_tensordict_outputs``).
    """
    from torch.distributed.fsdp import CPUOffload, MixedPrecision, ShardingStrategy
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    if cpu_offload and device.type != "cuda":
        raise SetupError(
            "distributed.cpu_offload=true needs CUDA: FSDP1 CPUOffload pins host memory through "
            "an accelerator and cannot run on a CPU-only device. Set distributed.cpu_offload=false "
            "(parameters are already in host memory on CPU)."
        )
    mp = None
    if mixed_precision is not None:
        dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}[mixed_precision]
        mp = MixedPrecision(param_dtype=dtype, reduce_dtype=dtype, buffer_dtype=dtype)
    policy = _auto_wrap_policy(model, list(wrap_modules), min_num_params)
    mesh = {"device_mesh": hybrid_mesh(device)} if sharding_strategy == "HYBRID_SHARD" else {}
    broadcast_module_states(model, device)
    with warnings.catch_warnings():
        # FSDP warns that it falls back to NO_SHARD in a world of one rank; that is fine.
        warnings.filterwarnings("ignore", message=".*NO_SHARD.*")
        wrapped = FSDP(
            model,
            sharding_strategy=ShardingStrategy[sharding_strategy],
            use_orig_params=True,
            auto_wrap_policy=policy,
            cpu_offload=CPUOffload(offload_params=True) if cpu_offload else None,
            mixed_precision=mp,
            device_id=device,
            **mesh,
        )
    return wrapped


def _fsdp2_units(model: nn.Module, wrap_modules: list[str], min_num_params: int | None) -> list[nn.Module]:
    """The submodules that become FSDP2 units of their own, innermost first (``fully_shard`` wants
    children before parents): the instances of ``wrap_modules``, or, by size, each module whose
    parameters not already in a unit below it number at least ``min_num_params`` (the rule of
    FSDP1's ``size_based_auto_wrap_policy``); never the root, which is wrapped last."""
    if min_num_params:
        units: list[nn.Module] = []
        taken: set[int] = set()

        def visit(module: nn.Module) -> None:
            for child in module.children():
                visit(child)
            if module is model:
                return
            own = [p for p in module.parameters() if id(p) not in taken]
            if sum(p.numel() for p in own) >= min_num_params:
                units.append(module)
                taken.update(id(p) for p in own)

        visit(model)
        return units
    if wrap_modules:
        _auto_wrap_policy(model, list(wrap_modules), None)  # the same one-line refusal of unknown names
    wanted = set(wrap_modules)
    found = [m for m in model.modules() if m is not model and type(m).__name__ in wanted]
    return found[::-1]  # modules() is pre-order: reversed, every child comes before its parent


def fsdp2_mesh(device: torch.device, sharding_strategy: str):
    """FSDP2's device mesh for an FSDP1 strategy name: one dimension over all ranks, or
    (replicate, shard) for HYBRID_SHARD (:func:`hybrid_mesh`) and for NO_SHARD (shard groups of one
    rank: whole parameters on every rank, gradients all-reduced)."""
    from torch.distributed.device_mesh import init_device_mesh

    world = dist.get_world_size()
    if sharding_strategy == "HYBRID_SHARD":
        return hybrid_mesh(device)
    if sharding_strategy == "NO_SHARD":
        return init_device_mesh(device.type, (world, 1), mesh_dim_names=("replicate", "shard"))
    return init_device_mesh(device.type, (world,), mesh_dim_names=("shard",))


def wrap_fsdp2(
    model: nn.Module,
    device: torch.device,
    *,
    wrap_modules: Sequence[str] = (),
    min_num_params: int | None = None,
    cpu_offload: bool = False,
    mixed_precision: str | None = None,
    sharding_strategy: str = "FULL_SHARD",
) -> nn.Module:
    """Shard ``model`` with FSDP2: ``fully_shard`` on each unit (:func:`_fsdp2_units`), then on the
    root. Returns ``model`` itself (FSDP2 changes its class in place, names stay the agent's).

    FSDP1's strategy names map onto FSDP2's own settings: ``FULL_SHARD`` and ``HYBRID_SHARD`` reshard
    after forward, ``SHARD_GRAD_OP`` and ``NO_SHARD`` keep the parameters gathered from forward to
    backward; the mesh is :func:`fsdp2_mesh`'s. ``cpu_offload`` is ``CPUOffloadPolicy`` (CUDA only,
    as under FSDP1), ``mixed_precision`` a ``MixedPrecisionPolicy`` with that parameter and reduction
    dtype. Every rank starts from rank 0's parameters and buffers (broadcast before sharding). Each
    unit remembers its ``reshard_after_forward`` (``_rl_replay_reshard_after_forward``) for
    :func:`rl_replay.gathered.gathered`, which changes it for a rollout's collection and back.
    """
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard

    if cpu_offload and device.type != "cuda":
        raise SetupError(
            "distributed.cpu_offload=true needs CUDA: FSDP2's CPUOffloadPolicy pins host memory through "
            "an accelerator. Set distributed.cpu_offload=false (parameters are already in host memory on CPU)."
        )
    mp = MixedPrecisionPolicy()
    if mixed_precision is not None:
        dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}[mixed_precision]
        mp = MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=dtype)
    units = _fsdp2_units(model, list(wrap_modules), min_num_params)
    mesh = fsdp2_mesh(device, sharding_strategy)
    reshard = sharding_strategy in ("FULL_SHARD", "HYBRID_SHARD")
    broadcast_module_states(model, device)
    # FSDP2 warns on every unit call whose output is a view (an in-place op on it would skip the
    # unit's pre-backward hook); once per process says it, the replay parity tests check the agents.
    warnings.filterwarnings("once", message=r"FSDP2-wrapped module .* returned a view tensor")
    offload = CPUOffloadPolicy() if cpu_offload else OffloadPolicy()
    for unit in units:
        fully_shard(unit, mesh=mesh, reshard_after_forward=reshard, mp_policy=mp, offload_policy=offload)
        object.__setattr__(unit, "_rl_replay_reshard_after_forward", reshard)  # a marker, not a submodule
    # None: FSDP2's own choice for a root, which keeps its parameters gathered after forward
    # (its backward starts right after it).
    fully_shard(model, mesh=mesh, reshard_after_forward=None, mp_policy=mp, offload_policy=offload)
    object.__setattr__(model, "_rl_replay_reshard_after_forward", False)
    # Parameters kept gathered from forward to backward: the replay engine reduces the blocks'
    # gradient once per backward (rl_replay.engine.fsdp.fsdp2_reduces_once); not under CPU offload,
    # where the unreduced sum would be held on the GPU (as under FSDP1).
    object.__setattr__(model, "_rl_replay_reduce_once", not reshard and not cpu_offload)
    return model


def fsdp_version_of(model: nn.Module) -> int:
    """1 if ``model`` is an FSDP1 ``FullyShardedDataParallel``, 2 if FSDP2's ``fully_shard`` made it an
    ``FSDPModule``, else 0 (a plain module)."""
    import sys

    if "torch.distributed.fsdp" not in sys.modules:
        return 0  # nobody imported FSDP, so nothing can be wrapped in it
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    return 1 if isinstance(model, FSDP) else 2 if isinstance(model, FSDPModule) else 0


def splits_parameters(model: nn.Module) -> bool:
    """Whether some parameter of an FSDP2-wrapped ``model`` is split over ranks (a DTensor holding
    fewer elements here than in whole): not so on a mesh whose shard groups are one rank (NO_SHARD)."""
    return any(hasattr(p, "to_local") and p.to_local().numel() < p.numel() for p in model.parameters())


def sharding_line(strategy: str, info: DistInfo, fsdp_version: int = 1) -> str:
    """How ``strategy`` spreads the parameters over this job's ranks, in words (printed once)."""
    if fsdp_version == 2:
        local = int(os.environ.get("LOCAL_WORLD_SIZE", info.world_size))
        mesh = {
            "HYBRID_SHARD": f"a ({info.world_size // max(local, 1)}, {local}) (replicate, shard) mesh: sharded within a node, replicated across nodes",
            "NO_SHARD": f"a ({info.world_size}, 1) (replicate, shard) mesh: whole on each rank, gradients all-reduced",
        }.get(strategy, f"{info.world_size} ranks")
        reshard = strategy in ("FULL_SHARD", "HYBRID_SHARD")
        return f"FSDP2 fully_shard over {mesh}; reshard_after_forward={reshard} (as FSDP1's {strategy})"
    if strategy == "HYBRID_SHARD":
        local = int(os.environ.get("LOCAL_WORLD_SIZE", info.world_size))
        nodes = info.world_size // local
        return f"HYBRID_SHARD over {nodes} nodes of {local} ranks: sharded within a node, replicated across nodes"
    if strategy == "NO_SHARD":
        return f"NO_SHARD, whole on each of {info.world_size} ranks, gradients all-reduced"
    kept = " (gathered from forward to backward)" if strategy == "SHARD_GRAD_OP" else ""
    return f"{strategy}, sharded over {info.world_size} ranks{kept}"


def hybrid_mesh(device: torch.device):
    """The (replicate, shard) device mesh of HYBRID_SHARD: shard within a node (torchrun's
    ``LOCAL_WORLD_SIZE`` ranks), replicate across nodes. Refused (one line) with fewer than two
    ranks per node: FSDP1 turns a shard group of one rank into NO_SHARD over that rank alone, and
    the replicas' gradients are then not averaged."""
    from torch.distributed.device_mesh import init_device_mesh

    world = dist.get_world_size()
    local = int(os.environ.get("LOCAL_WORLD_SIZE", world))
    if local < 2 or world % local:
        raise SetupError(
            f"distributed.sharding_strategy=HYBRID_SHARD shards within a node and needs at least two ranks "
            f"per node (LOCAL_WORLD_SIZE={local}, world size {world}); use NO_SHARD (one rank per node) or FULL_SHARD."
        )
    return init_device_mesh(device.type, (world // local, local), mesh_dim_names=("replicate", "shard"))


@torch.no_grad()
def broadcast_module_states(model: nn.Module, device: torch.device | None = None, src: int = 0) -> None:
    """Copy rank ``src``'s parameters and buffers into every rank's ``model`` (in place).

    With NCCL, tensors not on a GPU travel through ``device`` (default: the current GPU).
    """
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return
    nccl = dist.get_backend() == "nccl"
    for tensor in [*model.parameters(), *model.buffers()]:
        if nccl and tensor.device.type != "cuda":
            staged = tensor.detach().to(device if device is not None and device.type == "cuda" else "cuda")
            dist.broadcast(staged, src=src)
            tensor.data.copy_(staged)
        else:
            dist.broadcast(tensor.data, src=src)


def reduce_mean(values: dict[str, float], device: torch.device, info: DistInfo) -> dict[str, float]:
    """Average scalar metrics over ranks (NaN-aware: a rank without a value does not count)."""
    if not info.distributed or not values:
        return values
    keys = sorted(values)
    x = torch.tensor([values[k] for k in keys], dtype=torch.float64, device=device)
    present = (~torch.isnan(x)).to(torch.float64)
    both = torch.stack([torch.nan_to_num(x), present])
    dist.all_reduce(both)
    mean = both[0] / both[1]  # NaN where no rank had a value
    return dict(zip(keys, mean.tolist()))


def reduce_sums(values: dict[str, float], device: torch.device, info: DistInfo) -> dict[str, float]:
    """Sum scalar counters over ranks (one all-reduce for all of them)."""
    if not info.distributed or not values:
        return values
    keys = sorted(values)
    x = torch.tensor([float(values[k]) for k in keys], dtype=torch.float64, device=device)
    dist.all_reduce(x)
    return dict(zip(keys, x.tolist()))


def any_rank(flag: bool, device: torch.device, info: DistInfo) -> bool:
    """True if ``flag`` is set on some rank (one all-reduce under torchrun)."""
    return bool(reduce_sums({"flag": float(flag)}, device, info)["flag"])


def broadcast_from_main(value: Any, info: DistInfo) -> Any:
    """Rank 0's ``value`` on every rank (``value`` itself in one process); any picklable object."""
    if not info.distributed:
        return value
    import torch.distributed as dist

    box = [value if info.is_main else None]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def on_main(fn: Callable[[], Any], info: DistInfo) -> Any:
    """Run ``fn`` on rank 0 only and return its result there (None on other ranks).

    A :class:`~rl_replay.errors.SetupError` it raises is raised on every rank, so no rank waits
    for a failed peer.
    """
    result, error = None, None
    if info.is_main:
        try:
            result = fn()
        except SetupError as exc:
            if not info.distributed:
                raise
            error = str(exc)
    if info.distributed:
        error = broadcast_from_main(error, info)
        if error is not None:
            raise SetupError(error)
    return result


def barrier(info: DistInfo) -> None:
    if info.distributed:
        dist.barrier()


def shutdown(info: DistInfo) -> None:
    if info.distributed and dist.is_initialized():
        dist.barrier()  # no rank tears gloo/nccl down while a peer still talks to it
        dist.destroy_process_group()
