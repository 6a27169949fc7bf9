"""Replay blocks: run a policy forward without a graph, recompute it in backward.

:func:`replay` (TensorDict inputs) and :func:`checkpoint_fsdp_forward` (keyword inputs)
run one block; :class:`StateWatch` is the check that a block left its module's
parameters and buffers alone, public so that other code can run the same check.
See NOTE [ Replay blocks ] below for the rules every block follows.
"""

from __future__ import annotations

import sys
import weakref
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import ExitStack, nullcontext
from typing import Any

import torch
import torch.utils._pytree as pytree
from tensordict import TensorDict, TensorDictBase
from torch.autograd.graph import _engine_run_backward

from rl_replay.engine.accumulator import _ACCUMULATOR_KEY, GradientAccumulator
from rl_replay.engine.errors import _PREFIX, DEBUG_TIP, ReplayError

__all__ = ["StateWatch", "checkpoint_fsdp_forward", "replay"]

# NOTE [ Replay blocks ]
#
# A rollout of T timesteps calls the policy T times. Plain autograd keeps every
# activation of every call until ``loss.backward()``, so memory grows with T times the
# policy's activation size. A replay block keeps only what it was called with.
#
# Rule 1. A block is one call of the model. Its tensor inputs (the kwargs, or the
#         leaves of the input TensorDict) are the only tensors it saves, on the host,
#         in the rollout's slabs (rl_replay/engine/storage.py says how). Its outputs
#         are attached to autograd through one ``_ReplayFunction`` node.
# Rule 2. Per-block bookkeeping grows with T too, so a block keeps little besides its
#         saved tensors: its own state in the node's slots (``_ReplayCtx``), what its
#         neighbours share (model, plan, argument layout, accumulator) in one ``_Site``.
# Rule 3. Nothing crosses a block boundary except through inputs and outputs. The
#         recompute detaches the saved inputs into fresh leaves, so the nested backward
#         stops at the block's edge; the input gradients go back to the outer backward,
#         which carries them into the previous block (how recurrent state gets gradient
#         through the whole episode). A tensor that reaches the model any other way (a
#         closure, a global) is not replayed correctly: pass it as an input.
# Rule 4. The recompute sees the same world as the forward: CPU (and CUDA) RNG state
#         and autocast state are captured at the forward and restored inside
#         ``fork_rng``, so the caller's RNG stream is not disturbed. A forward that drew
#         no random numbers keeps no snapshot and recomputes without ``fork_rng``.
#         ``context_fn`` lets the user snapshot any other mutable state.
# Rule 5. Saved inputs kept as they are (not copied) must not change before the
#         recompute: their versions are recorded and checked.
# Rule 6. The model must not change its parameters or buffers: the forward and the
#         recompute would each apply the change. Versions are compared around the
#         forward, between forward and recompute, and around the recompute; a change
#         raises ReplayError naming the tensor.
# Rule 7. Recomputed activations live only during that block's nested backward: peak
#         memory is one block's activations plus the saved inputs of all blocks.
# Rule 8. Parameter gradients go through the GradientAccumulator shared by all blocks
#         of the rollout (accumulator.py: how FSDP's overwriting of ``.grad`` is
#         handled). The nested backward is a real ``torch.autograd.backward``, so FSDP1's
#         pre/post-backward hooks run for every block, as in FSDP's own reentrant
#         activation checkpointing.
# Rule 9. A block whose outputs receive no gradient is not recomputed at all.
# Rule 10. Only a full ``backward()`` may run through a block: ``torch.autograd.grad``
#         and ``backward(inputs=...)`` must leave parameter ``.grad`` alone, but the
#         nested backward accumulates into it, so they raise ReplayError (as reentrant
#         ``torch.utils.checkpoint`` does).

ContextFn = Callable[[], "tuple[Any, Any]"]

# One anchor leaf per device: it gives every block an input that requires grad,
# so outputs are attached to autograd even when no block input requires grad.
# Its gradient is always None, so sharing it is safe.
_ANCHORS: dict[torch.device, torch.Tensor] = {}

_SUPPORTED_DEVICE_TYPES = ("cpu", "cuda")
_CPU = torch.device("cpu")

# Per-block state kept until backward is shared where it is the same for every block.
_NO_CONTEXT = nullcontext()  # reusable and reentrant
_AUTOCAST_STATES: dict[tuple, tuple] = {}
_NONES: dict[int, tuple] = {}


def _anchor(device: torch.device) -> torch.Tensor:
    anchor = _ANCHORS.get(device)
    if anchor is None:
        anchor = _ANCHORS[device] = torch.empty(0, device=device, requires_grad=True)
    return anchor


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
        self.module = _module_of(model)
        self.watched_names, self.watched = self._watched()
        self.last: list[int] | None = None

    def _watched(self) -> tuple[tuple[str, ...], tuple[torch.Tensor, ...]]:
        if self.module is None:
            return (), ()
        named = [(f"buffer '{n}'", b) for n, b in self.module.named_buffers()]
        if not _has_fsdp(self.module):
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


class _ModelPlan(StateWatch):
    """Facts about one model computed once per rollout (cached on the accumulator)."""

    __slots__ = ("params", "absorb", "fsdp_units", "site")

    def __init__(self, model: Callable) -> None:
        module = _module_of(model)
        self.fsdp_units = _fsdp_units(module) if module is not None else []
        self.absorb = bool(self.fsdp_units)
        super().__init__(model)
        self.params: tuple[torch.nn.Parameter, ...] = (
            () if module is None else tuple(p for p in module.parameters() if p.requires_grad)
        )
        self.site: weakref.ref | None = None  # the last block's site, weakly (see _Site)

    def check_versions(self, before: list[int], when: str, block: _ReplayCtx) -> list[int]:
        """``before`` if nothing watched changed since; raises ReplayError otherwise."""
        changed = self.changed(before)
        if not changed:
            return before  # blocks keep it until backward: one list, not one per block
        raise ReplayError(
            _PREFIX + f"{when} changed {', '.join(changed)} of {type(self.module).__name__} "
            f"(block {block.index}). A replay block must not modify its module's parameters "
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


def _has_fsdp(module: torch.nn.Module) -> bool:
    if "torch.distributed.fsdp" not in sys.modules:
        return False  # nobody imported FSDP, so nothing can be wrapped in it
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    return any(isinstance(sub, FSDP) for sub in module.modules())


def _fsdp_units(module: torch.nn.Module) -> list[torch.nn.Module]:
    """The FSDP1 units inside ``module``, after rejecting setups replay cannot serve."""
    if "torch.distributed.fsdp" not in sys.modules:
        return []  # nobody imported FSDP, so nothing can be wrapped in it
    from torch.distributed.fsdp import FSDPModule, ShardingStrategy
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    units = []
    for name, sub in module.named_modules():
        where = f"module '{name}'" if name else f"the root module ({type(sub).__name__})"
        if isinstance(sub, FSDPModule):
            raise ReplayError(
                _PREFIX + f"{where} is wrapped with FSDP2 fully_shard, which replay does not "
                "support. Wrap the policy with FSDP1 FullyShardedDataParallel("
                "sharding_strategy=FULL_SHARD, use_orig_params=True) instead."
            )
        if not isinstance(sub, FSDP):
            continue
        if not sub._use_orig_params:
            raise ReplayError(
                _PREFIX + f"{where} uses FullyShardedDataParallel(use_orig_params=False); replay "
                "needs use_orig_params=True so recomputed forwards stay visible to autograd "
                "and to FSDP's post-backward hooks. Pass use_orig_params=True."
            )
        strategy = sub.sharding_strategy
        # FSDP1 itself turns FULL_SHARD into NO_SHARD when the world has one rank.
        single_rank = getattr(sub, "world_size", None) == 1
        if strategy != ShardingStrategy.FULL_SHARD and not (single_rank and strategy == ShardingStrategy.NO_SHARD):
            raise ReplayError(
                _PREFIX + f"{where} uses sharding strategy {strategy.name}; replay supports "
                "FULL_SHARD only. Pass sharding_strategy=ShardingStrategy.FULL_SHARD."
            )
        units.append(sub)
    _hook_tensordict_outputs(units)
    return units


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
                    handle._needs_pre_backward_unshard = True

    for unit in units:
        if not getattr(unit, "_rl_replay_tensordict_hook", False):
            unit.register_forward_hook(post_forward)
            unit._rl_replay_tensordict_hook = True


def _plan_for(accumulator: GradientAccumulator, model: Callable) -> _ModelPlan:
    plan = accumulator._plans.get(id(model))
    if plan is None or plan.module is not _module_of(model):
        plan = accumulator._plans[id(model)] = _ModelPlan(model)
    return plan  # type: ignore[return-value]


def _module_of(model: Callable) -> torch.nn.Module | None:
    if isinstance(model, torch.nn.Module):
        return model
    owner = getattr(model, "__self__", None)
    return owner if isinstance(owner, torch.nn.Module) else None


# ------------------------------------------------------------------------------ blocks
class _KwargsLayout:
    """How ``checkpoint_fsdp_forward`` turns a block's tensors back into the model's
    keyword arguments: the keys, where the tensors go, and the metadata values."""

    __slots__ = ("keys", "positions", "values")

    def __init__(self, keys: tuple, positions: tuple, values: tuple) -> None:
        self.keys = keys
        self.positions = positions
        self.values = values  # None where a tensor goes: the layout must not hold inputs

    def rebuild(self, tensors: Sequence[torch.Tensor]) -> dict:
        args = list(self.values)
        for i, t in zip(self.positions, tensors):
            args[i] = t
        return dict(zip(self.keys, args))

    def __eq__(self, other: object) -> bool:
        return (
            isinstance(other, _KwargsLayout)
            and self.keys == other.keys
            and self.positions == other.positions
            and all(_same_value(a, b) for a, b in zip(self.values, other.values))
        )

    __hash__ = None  # mutable-free but compared structurally; never a dict key


def _same_value(a: Any, b: Any) -> bool:
    """Whether metadata ``b`` can stand in for ``a`` in a recompute: the same object, or an
    equal value of the same plain type (``1``, ``1.0`` and ``True`` compare equal but are
    not interchangeable; neither are ``0.0`` and ``-0.0``)."""
    if a is b:
        return True
    if type(a) is not type(b) or type(a) not in (int, str, bytes, float):
        return False
    return a == b and (type(a) is not float or repr(a) == repr(b))


class _TDSpec:
    """The structure of a plain TensorDict: its keys, which entries are nested TensorDicts
    (with their own specs), its batch size and device.

    Specs are interned (:func:`_flatten_td`): blocks whose inputs (or outputs) have the
    same structure share one spec object, so a site compares layouts by identity and a
    block keeps no per-block structure. Flattening and rebuilding through a spec is a
    plain loop over the TensorDict's entries, about 10x cheaper per block than the
    generic pytree path, which :class:`_TreeLayout` keeps for everything else
    (TensorDict subclasses, named dimensions, non-tensor entries).
    """

    __slots__ = ("entries", "batch_size", "device")

    def __init__(self, entries: tuple, batch_size: torch.Size, device) -> None:
        self.entries = entries  # ((key, child spec or None for a tensor), ...)
        self.batch_size = batch_size
        self.device = device

    def build(self, leaves: Iterator[torch.Tensor]) -> TensorDict:
        """The TensorDict of this structure holding the next leaves of ``leaves``."""
        source = {key: next(leaves) if child is None else child.build(leaves) for key, child in self.entries}
        device = self.device
        if device is not None and any(v.device != device for v in source.values()):
            device = None  # as the pytree path: a device only if every entry is on it
        return TensorDict._new_unsafe(source, batch_size=self.batch_size, device=device)

    def rebuild(self, tensors: Sequence[torch.Tensor]) -> dict:
        """The model's keyword arguments: top-level entries, nested ones as TensorDicts."""
        leaves = iter(tensors)
        return {key: next(leaves) if child is None else child.build(leaves) for key, child in self.entries}


_SPECS: dict[tuple, _TDSpec] = {}


def _flatten_td(td: Any, leaves: list) -> _TDSpec | None:
    """Append the tensors of a plain TensorDict to ``leaves`` (depth first, in key order,
    as pytree does) and return its interned spec; None if ``td`` needs the pytree path."""
    if type(td) is not TensorDict or td._has_names():
        return None
    entries = []
    for key, value in td._tensordict.items():
        if type(value) is torch.Tensor or isinstance(value, torch.nn.Parameter):
            leaves.append(value)
            entries.append((key, None))
        else:
            child = _flatten_td(value, leaves)
            if child is None:
                return None
            entries.append((key, child))
    return _intern_spec(tuple(entries), td.batch_size, td.device)


def _intern_spec(entries: tuple, batch_size: torch.Size, device) -> _TDSpec:
    """The one :class:`_TDSpec` of this structure."""
    signature = (entries, batch_size, device)
    spec = _SPECS.get(signature)
    if spec is None:
        if len(_SPECS) >= 1024:  # structures that change every block: do not grow
            _SPECS.clear()
        spec = _SPECS[signature] = _TDSpec(entries, batch_size, device)
    return spec


def _flatten_inputs(td: TensorDictBase) -> tuple[list[torch.Tensor], Any]:
    """The leaves of a block's input TensorDict and the layout that rebuilds the kwargs."""
    leaves: list[torch.Tensor] = []
    spec = _flatten_td(td, leaves)
    if spec is not None:
        return leaves, spec
    leaves, tree = pytree.tree_flatten(td)
    return leaves, _TreeLayout(tree)


class _TreeLayout:
    """How ``replay`` turns a block's tensors back into the model's keyword arguments
    when the input TensorDict is not a plain one (:class:`_TDSpec`): its pytree spec
    (top-level keys become keywords)."""

    __slots__ = ("spec",)

    def __init__(self, spec: Any) -> None:
        self.spec = spec

    def rebuild(self, tensors: Sequence[torch.Tensor]) -> dict:
        td = pytree.tree_unflatten(list(tensors), self.spec)
        return {key: td.get(key) for key in td.keys()}

    def __eq__(self, other: object) -> bool:
        return isinstance(other, _TreeLayout) and self.spec == other.spec

    __hash__ = None


class _Site:
    """What consecutive blocks of one rollout share: the model and its plan, the
    accumulator, the argument layout, ``context_fn`` and the device.

    One object for all of them, not one per block: every object a block keeps lives
    until the backward, so per-block bookkeeping is memory that grows with T. The
    plan keeps the last site, weakly (the blocks' nodes hold it; a strong reference
    would make a cycle through the accumulator, freed only by the cycle collector),
    and a block reuses it when nothing differs.
    """

    __slots__ = (
        "model",
        "plan",
        "accumulator",
        "layout",
        "context_fn",
        "device",
        "out_spec",
        "last",
        "interned",
        "__weakref__",
    )

    def __init__(self, model, plan, accumulator, layout, context_fn, device) -> None:
        self.model = model
        self.plan = plan
        self.accumulator = accumulator
        self.layout = layout
        self.context_fn = context_fn
        self.device = device
        self.out_spec = None  # the last block's, read by _apply right after the forward
        self.last: tuple = ()  # the last block's input versions, shared when equal
        self.interned: dict = {}

    def call(self, tensors: Sequence[torch.Tensor]):
        layout = self.layout
        if type(layout) is _TDSpec or type(layout) is _KwargsLayout or type(layout) is _TreeLayout:
            return self.model(**layout.rebuild(tensors))
        return layout.call(self.model, tensors)  # a multi-step block (engine/steps.py)

    def matches(self, model, accumulator, layout, context_fn, device) -> bool:
        return (
            self.model is model
            and self.accumulator is accumulator
            and self.context_fn is context_fn
            and self.device == device
            and self.layout == layout
        )

    def intern_last(self, versions: tuple) -> tuple:
        """``versions``, or the equal tuple the previous block keeps."""
        if versions == self.last:
            return self.last
        self.last = versions
        return versions

    def intern(self, value: tuple) -> tuple:
        """One shared object per distinct (hashable) ``value`` among this site's blocks."""
        shared = self.interned.get(value)
        if shared is None:
            if len(self.interned) >= 256:  # shapes that change every block: do not grow
                self.interned.clear()
            shared = self.interned[value] = value
        return shared


class _RestoredState:
    """Enters exactly what differs from now: forked RNG (only if the forward drew random
    numbers) and autocast (only if it was on at the forward or is on now)."""

    __slots__ = ("block", "stack")

    def __init__(self, block: _ReplayCtx) -> None:
        self.block = block
        self.stack = None

    def __enter__(self):
        block = self.block
        rng = block.cpu_rng is not None or block.cuda_rng is not None
        autocast = [a for a in block.autocast if a[1] or torch.is_autocast_enabled(a[0])]
        if not rng and not autocast:
            return self
        stack = self.stack = ExitStack()
        if rng:
            devices = [block.cuda_device.index or 0] if block.cuda_rng is not None else []
            stack.enter_context(torch.random.fork_rng(devices=devices))
            if block.cpu_rng is not None:
                torch.set_rng_state(block.cpu_rng)
            if block.cuda_rng is not None:
                torch.cuda.set_rng_state(block.cuda_rng, block.cuda_device)
        for device_type, enabled, dtype in autocast:
            stack.enter_context(torch.autocast(device_type, enabled=enabled, dtype=dtype))
        return self

    def __exit__(self, *exc):
        return None if self.stack is None else self.stack.__exit__(*exc)


def _same(t):
    return t


def _save_inputs(tensors: Sequence[torch.Tensor], site: _Site):
    """What a block saves of its inputs (Rule 1): ``(saved, devices, versions, slices)``.

    ``devices[i]`` is the CUDA device to restore input i to (None: it stays on the
    host); ``versions[i]`` the version of an input kept as it is (None: copied);
    ``slices[i]`` is ``(storage_offset, (dtype, shape, stride))`` when input i is a
    slice of a caller's buffer and ``saved[i]`` that buffer (None otherwise).
    """
    slabs = site.accumulator.slabs
    # devices, versions, slices: tuples, shared when not all None
    saved, devices, versions, slices = [], [], [], []
    for t in tensors:
        slice_of = None
        if t.is_cuda:
            # Device memory is what replay saves; contiguous unless dense (as save_on_cpu).
            src = t if _dense(t) else t.contiguous()
            saved.append(slabs.copy(src, pinned=True))
            devices.append(t.device)
            versions.append(None)
        else:
            how = _how_to_save(t, slabs)
            if how is _COPY:
                saved.append(slabs.copy(t, pinned=False))
                versions.append(None)
            elif how is _ALIAS:
                # Sharing its storage and version counter, without its autograd metadata
                # (grad_fn, output number): ~0.5 KiB less per block until backward.
                saved.append(t.detach())
                versions.append(t._version)
            elif how is _SLICE:
                # The buffer, one tensor for all blocks, and where the slice lies in it:
                # a view per block would keep a tensor (~0.7 KiB) per block until backward.
                base = t._base
                saved.append(base)
                versions.append(base._version)  # a view shares its base's version counter
                slice_of = (t.storage_offset(), site.intern((t.dtype, tuple(t.shape), t.stride())))
            else:
                saved.append(t)
                versions.append(t._version)
            devices.append(None)
        slices.append(slice_of)
    return saved, _compact(devices), _compact(versions), _compact(slices)


def _compact(values: list) -> tuple:
    """``values`` as a tuple, one shared tuple when all are None (the usual case)."""
    if all(v is None for v in values):
        nones = _NONES.get(len(values))
        if nones is None:
            nones = _NONES[len(values)] = (None,) * len(values)
        return nones
    return tuple(values)


_COPY, _KEEP, _ALIAS, _SLICE = "copy", "keep", "alias", "slice"


def _how_to_save(t: torch.Tensor, slabs) -> str:
    """How a host input is saved: copied into a slab, kept as itself, kept as a detached
    alias, or kept as its place in the buffer it is a slice of.

    Kept: a previous block's output (already in the rollout's slab; as an alias, which
    shares its storage and version counter but not its autograd metadata); a leaf that
    requires grad (the graph holds it anyway); and anything the slab cannot hold
    faithfully (sparse, subclasses, overlapping or gappy strides, empty, conjugate or
    negative views). A slice of a larger buffer (``obs[t]`` of a preallocated rollout
    tensor) is kept as the buffer (the caller's, alive anyway, so a copy would only add
    bytes) and the slice's offset, sizes and strides. Everything else, e.g. a fresh
    observation, is copied, so the tensor itself can be freed.
    """
    if type(t) is not torch.Tensor or t.layout != torch.strided or t.numel() == 0:
        return _KEEP
    if t.requires_grad and t.is_leaf:
        return _KEEP
    if not _dense(t):
        return _KEEP
    if slabs.owns(t):
        # A previous block's output, already in this rollout's slab.
        return _ALIAS if t.grad_fn is not None else _KEEP
    base = t._base
    if base is None or t.untyped_storage().nbytes() <= t.numel() * t.element_size():
        return _COPY
    if t.is_conj() or t.is_neg() or type(base) is not torch.Tensor:
        return _KEEP
    return _SLICE


def _unslice(saved: Sequence[torch.Tensor], slices: Sequence[tuple | None]):
    """The saved inputs with each buffer replaced by the block's slice of it."""
    if all(s is None for s in slices):
        return saved
    out = []
    for t, where in zip(saved, slices):
        if where is not None:
            offset, (dtype, shape, stride) = where
            t = torch.empty(0, dtype=dtype).set_(t.untyped_storage(), offset, shape, stride)
        out.append(t)
    return out


def _place_outputs(flat: tuple, inputs: Sequence[torch.Tensor], slabs) -> tuple:
    """A CPU block's outputs, moved into the rollout's slab (Rule 1).

    The outputs are what survives a block's forward (the next block's state, the
    loss's inputs); left where the model allocated them, among the block's freed
    activations, they fragment the heap exactly as saved inputs would. An output that
    shares storage with an input (a pass-through) is returned as it is.
    """
    inputs_storage = {t.untyped_storage().data_ptr() for t in inputs}
    placed: dict[int, torch.Tensor] = {}
    out = []
    for position, o in enumerate(flat):
        if (
            type(o) is not torch.Tensor
            or o.is_cuda
            or o.layout != torch.strided
            or o.numel() == 0
            or not _dense(o)
            or o.untyped_storage().data_ptr() in inputs_storage
        ):
            out.append(o)
            continue
        p = placed.get(id(o))
        if p is None:
            p = placed[id(o)] = slabs.place(o, position)
        out.append(p)
    return tuple(out)


def _dense(t: torch.Tensor) -> bool:
    """Non-overlapping and dense: its strides lay out exactly numel elements."""
    if t.is_contiguous():
        return True
    expected = 1
    for stride, size in sorted((st, sz) for st, sz in zip(t.stride(), t.size()) if sz != 1):
        if stride != expected:
            return False
        expected *= size
    return True


def _restore_inputs(saved: Sequence[torch.Tensor], devices: Sequence[torch.device | None]):
    """The saved inputs where the block got them: CUDA ones are copied back from pinned
    memory asynchronously (ordered on the current stream before the recompute)."""
    if all(d is None for d in devices):
        return saved
    return [t if d is None else t.to(d, non_blocking=True) for t, d in zip(saved, devices)]


def _check_inputs_unchanged(saved: Sequence[torch.Tensor], block: _ReplayCtx) -> None:
    for i, (t, version, where) in enumerate(zip(saved, block.input_versions, block.input_slices)):
        if version is not None and t._version != version:
            shape = tuple(t.shape) if where is None else where[1][1]
            raise ReplayError(
                _PREFIX + f"input {i} of block {block.index} (a {shape} host tensor) was "
                "modified in place after the block ran; the recompute would see the new values. "
                "Pass a fresh tensor to each block (e.g. .clone() a reused observation buffer)."
            )


def _flatten_outputs(outputs: Any, site: _Site) -> tuple[tuple[torch.Tensor, ...], Any]:
    if isinstance(outputs, torch.Tensor):
        return (outputs,), None
    if isinstance(outputs, tuple) and all(isinstance(o, torch.Tensor) for o in outputs):
        return outputs, len(outputs)
    if isinstance(outputs, Mapping) and not isinstance(outputs, TensorDictBase):
        bad = [k for k, v in outputs.items() if not isinstance(v, (torch.Tensor, Mapping))]
        if not bad:
            outputs = TensorDict(dict(outputs), batch_size=[])
    if isinstance(outputs, TensorDictBase):
        leaves: list = []
        spec = _flatten_td(outputs, leaves)
        if spec is not None:
            return tuple(leaves), spec
        leaves, spec = pytree.tree_flatten(outputs)
        if all(isinstance(leaf, torch.Tensor) for leaf in leaves):
            return tuple(leaves), spec
    name = type(site.model).__name__
    raise TypeError(
        _PREFIX + f"{name} returned {_describe(outputs)}; a replay block must return a tensor, "
        "a tuple of tensors, a TensorDict or a mapping of tensors. Wrap other values "
        "(numbers, lists) into tensors, or return them from outside the block."
    )


def _describe(value: Any) -> str:
    if isinstance(value, (tuple, list)):
        inner = ", ".join(type(v).__name__ for v in value[:4])
        return f"a {type(value).__name__} of ({inner}{', ...' if len(value) > 4 else ''})"
    return f"a {type(value).__name__}"


def _unflatten_outputs(flat: Sequence[torch.Tensor], spec: Any):
    if spec is None:
        return flat[0]
    if isinstance(spec, int):
        return tuple(flat)
    if type(spec) is _TDSpec:
        return spec.build(iter(flat))
    return pytree.tree_unflatten(list(flat), spec)


class _ReplayFunction(torch.autograd.Function):
    """The autograd node of one block. See NOTE [ Replay blocks ].

    Its ``ctx`` is a :class:`_ReplayCtx`: the block's own state lives in the node's
    slots, everything its blocks share in one :class:`_Site`.
    """

    @staticmethod
    def forward(ctx, site: _Site, anchor: torch.Tensor | None, *tensors: torch.Tensor):
        ctx.site = site
        ctx.index = site.accumulator.num_blocks
        ctx.set_materialize_grads(False)
        # Rule 1: copied into the rollout's slabs before the model runs (so an in-place
        # change by the forward cannot reach the copy), or kept as they are. Saved
        # through identity saved-tensor hooks (see _apply), which skip autograd's
        # in-place check: a kept tensor's version is remembered and checked before the
        # recompute instead.
        saved, ctx.input_devices, versions, ctx.input_slices = _save_inputs(tensors, site)
        ctx.input_versions = site.intern_last(versions)
        ctx.save_for_backward(*saved)
        ctx.capture_state()
        if site.context_fn is None:
            forward_context = ctx.recompute_context = _NO_CONTEXT
        else:
            forward_context, ctx.recompute_context = site.context_fn()
        plan = site.plan
        before = plan.versions()
        with forward_context:
            outputs = site.call(tensors)
        ctx.versions = plan.check_versions(before, "the forward", ctx)
        ctx.forget_unused_rng()
        flat, site.out_spec = _flatten_outputs(outputs, site)
        ctx.num_outputs = len(flat)
        if site.device.type == "cpu":
            flat = _place_outputs(flat, tensors, site.accumulator.slabs)
        return flat

    @staticmethod
    def backward(ctx, *grads: torch.Tensor | None):
        if torch.is_grad_enabled():
            raise ReplayError(
                _PREFIX + "higher-order gradients (backward with create_graph=True) through a "
                "replay block are not supported: the block's parameter gradients are "
                "accumulated, not differentiable. Use plain autograd for this computation."
            )
        if not torch.autograd._is_checkpoint_valid():
            raise ReplayError(
                _PREFIX + "torch.autograd.grad() and backward(inputs=...) through a replay block "
                "are not supported: the block's nested backward accumulates into every "
                "parameter's .grad, which those calls must leave untouched. Call "
                "loss.backward() without inputs, or use plain autograd for this computation."
            )
        site = ctx.site
        plan = site.plan
        plan.check_fsdp_sync()
        accumulator = site.accumulator
        accumulator._enter_backward()
        requires_grad = ctx.needs_input_grad[2:]  # the block's tensors (after site, anchor)
        if all(g is None for g in grads):
            # Rule 9: no output of this block reaches the loss (and nothing is unpacked).
            return (None, None) + (None,) * len(requires_grad)
        saved = ctx.saved_tensors
        _check_inputs_unchanged(saved, ctx)
        saved = _restore_inputs(_unslice(saved, ctx.input_slices), ctx.input_devices)
        plan.check_versions(ctx.versions, "something between the forward and the backward", ctx)
        start = accumulator._begin_block(plan.params, plan.absorb)
        try:
            recompute = getattr(site.layout, "recompute_and_backward", _recompute_and_backward)
            input_grads = recompute(ctx, saved, requires_grad, grads)
        except BaseException:
            # The engine drops queued callbacks when a backward fails: put the gradients
            # already moved out of .grad (FSDP path) back now, so none is lost.
            accumulator._finalise()
            raise
        accumulator._end_block(start)
        return (None, None) + input_grads


class _ReplayCtx(_ReplayFunction._backward_cls):  # type: ignore[misc, name-defined]
    """The ``ctx`` (and graph node) of one block: its state until backward, in slots.

    Slots instead of attributes: a ``ctx`` attribute creates a per-node ``__dict__``
    (~340 B), and there used to be a separate per-block object besides. Whatever the
    blocks of a rollout share lives in ``site``; ``needs_input_grad`` (which autograd
    keeps anyway) says which inputs get gradients.
    """

    __slots__ = (
        "site",
        "index",
        "cpu_rng",
        "cuda_device",
        "cuda_rng",
        "autocast",
        "recompute_context",
        "num_outputs",
        "versions",
        "input_versions",
        "input_devices",
        "input_slices",
    )

    def capture_state(self) -> None:
        self.cpu_rng = torch.get_rng_state()
        device = self.site.device
        cuda_device = device if device.type == "cuda" else None
        if cuda_device is None and torch.cuda.is_initialized():
            # CPU inputs, but the model may still compute on the GPU (FSDP with CPU
            # offload moves its inputs to the compute device): replay the current
            # GPU's RNG and autocast state too, or dropout masks would differ.
            cuda_device = torch.device("cuda", torch.cuda.current_device())
        self.cuda_device = cuda_device
        self.cuda_rng = None if cuda_device is None else torch.cuda.get_rng_state(cuda_device)
        types = ("cpu",) if cuda_device is None else ("cpu", "cuda")
        autocast = tuple((t, torch.is_autocast_enabled(t), torch.get_autocast_dtype(t)) for t in types)
        # Interned: every block of a rollout usually has the same state (kept until backward).
        self.autocast = _AUTOCAST_STATES.setdefault(autocast, autocast)

    def forget_unused_rng(self) -> None:
        """Drop the RNG snapshots the forward did not consume (most policies draw none).

        A snapshot is 5 KB per block on the CPU, a third of a small policy's inputs,
        and restoring it is the costliest part of a recompute. A forward that drew no
        random numbers recomputes without them, so nothing needs restoring.
        """
        if torch.equal(torch.get_rng_state(), self.cpu_rng):
            self.cpu_rng = None
        if self.cuda_rng is not None and torch.equal(torch.cuda.get_rng_state(self.cuda_device), self.cuda_rng):
            self.cuda_rng = None

    def recompute_state(self):
        """Context that restores the forward's RNG and autocast state."""
        return _RestoredState(self)


# Autograd creates a Function's ctx from ``_backward_cls`` on every apply.
_ReplayFunction._backward_cls = _ReplayCtx


def _recompute_and_backward(
    block: _ReplayCtx, saved: Sequence[torch.Tensor], requires_grad: Sequence[bool], grads
) -> tuple:
    """Recompute one block with grad enabled and back-propagate ``grads`` through it;
    returns the gradients of its inputs (None where an input does not require grad)."""
    inputs = [t.detach().requires_grad_(rg) for t, rg in zip(saved, requires_grad)]
    site = block.site
    with torch.enable_grad(), block.recompute_state(), block.recompute_context:
        outputs = site.call(inputs)
    site.plan.check_versions(block.versions, "the recompute", block)
    flat, _ = _flatten_outputs(outputs, site)
    if len(flat) != block.num_outputs:
        raise ReplayError(
            _PREFIX + f"block {block.index} returned {len(flat)} tensors when recomputed but "
            f"{block.num_outputs} in the forward; the model must be deterministic given its "
            "inputs, RNG and autocast state." + DEBUG_TIP
        )
    _backward_from(block, flat, grads)
    return tuple(t.grad if rg else None for t, rg in zip(inputs, requires_grad))


def _backward_from(block: _ReplayCtx, flat: Sequence[torch.Tensor], grads: Sequence) -> None:
    """Back-propagate ``grads`` from the recomputed outputs ``flat`` (one nested backward)."""
    roots, root_grads = [], []
    for out, grad in zip(flat, grads):
        if grad is not None and out.requires_grad:
            if out.shape != grad.shape:
                raise ReplayError(
                    _PREFIX + f"block {block.index} returned a tensor of shape {tuple(out.shape)} when "
                    f"recomputed where the forward's had shape {tuple(grad.shape)}; the model must be "
                    "deterministic given its inputs, RNG and autocast state." + DEBUG_TIP
                )
            roots.append(out)
            root_grads.append(grad)
    if roots:
        # The engine directly, outside enable_grad (the nested backward must not build a
        # graph itself): ``torch.autograd.backward`` would only re-check what autograd
        # already guarantees for ``grads`` (one per output, of its dtype and device) and
        # the shapes compared above.
        _engine_run_backward(
            tuple(roots), tuple(root_grads), False, False, (), allow_unreachable=True, accumulate_grad=True
        )


# ----------------------------------------------------------------------- shared driver
def _input_device(tensors: Sequence[torch.Tensor], what: Callable[[int], str]) -> torch.device:
    device = None
    for i, t in enumerate(tensors):
        if t.device.type not in _SUPPORTED_DEVICE_TYPES:
            raise ValueError(
                _PREFIX + f"{what(i)} is on device '{t.device}'; replay supports CPU and CUDA "
                "tensors. Move it with .to('cpu') or .to('cuda')."
            )
        if t.is_cuda:
            if device is None:
                device = t.device
            elif t.device != device:
                raise ValueError(
                    _PREFIX + f"{what(i)} is on {t.device} but other inputs are on {device}; "
                    "all CUDA inputs of a block must be on one device."
                )
    return device if device is not None else _CPU


def _site_for(plan: _ModelPlan, model, accumulator, layout, context_fn, device) -> _Site:
    site = plan.site() if plan.site is not None else None
    if site is None or not site.matches(model, accumulator, layout, context_fn, device):
        site = _Site(model, plan, accumulator, layout, context_fn, device)
        plan.site = weakref.ref(site)
    return site


def _apply(model, accumulator, tensors, layout, context_fn, what):
    if not callable(model):
        raise TypeError(_PREFIX + f"model must be callable, got {type(model).__name__}.")
    if not isinstance(accumulator, GradientAccumulator):
        raise TypeError(
            _PREFIX + f"accumulator must be a GradientAccumulator (or a dict for "
            f"checkpoint_fsdp_forward), got {type(accumulator).__name__}."
        )
    device = _input_device(tensors, what)
    accumulator._check_open()
    plan = _plan_for(accumulator, model)
    if plan.fsdp_units:
        plan.check_fsdp_sync()
    site = _site_for(plan, model, accumulator, layout, context_fn, device)
    # The anchor only when no input attaches the outputs to autograd: an input costs
    # the node an edge and its metadata until the backward.
    anchor = None if any(t.requires_grad for t in tensors) else _anchor(device)
    with torch.autograd.graph.saved_tensors_hooks(_same, _same):
        flat = _ReplayFunction.apply(site, anchor, *tensors)
    accumulator._record_block(sum(t.numel() * t.element_size() for t in tensors))
    return _unflatten_outputs(flat, site.out_spec)


# --------------------------------------------------------------------- public entries
def replay(
    model: Callable[..., Any],
    accumulator: GradientAccumulator,
    inputs: TensorDictBase,
    *,
    context_fn: ContextFn | None = None,
):
    r"""Run ``model(**inputs)`` as one replay block of a rollout.

    The forward runs without building a graph; only the leaves of ``inputs`` are kept
    (on the host) for the backward, where the block is recomputed with grad enabled
    under the same RNG and autocast state. Parameter gradients go to ``accumulator``;
    gradients for input tensors that require grad are returned to autograd, so a
    recurrent state passed from block to block carries gradient through the rollout.

    Args:
        model: an ``nn.Module`` (or a bound method of one) called as ``model(**inputs)``.
            Under FSDP1 pass the FSDP-wrapped root module.
        accumulator: the :class:`GradientAccumulator` shared by every block of this
            rollout.
        inputs: the block's keyword inputs. Top-level keys become keyword arguments;
            nested TensorDicts reach the model as TensorDicts.

    Keyword args:
        context_fn: optional callable returning ``(forward_context, recompute_context)``,
            entered around the forward and the recompute respectively (as in
            ``torch.utils.checkpoint``).

    Returns:
        The model's outputs, attached to autograd: a TensorDict when the model returns
        a TensorDict or a mapping of tensors, otherwise the tensor or tuple it returned.

    Example::

        acc = rl_replay.GradientAccumulator()
        state = policy.initial_state(batch)
        for t in range(T):
            out = rl_replay.replay(policy, acc, TensorDict(observation=obs[t], state=state))
            state = out["state"]
            losses.append(out["value"].square().mean())
        torch.stack(losses).sum().backward()   # one backward, all blocks replayed
        optimizer.step()

    .. warning::
        If ``torch.is_grad_enabled()`` is False (e.g. evaluation under ``no_grad``)
        the model is simply called: nothing is recorded.

    .. warning::
        The model must not modify its parameters or buffers and must be
        deterministic given its inputs, RNG and autocast state; otherwise the
        recomputed forward differs from the one that produced the outputs.
        Parameter and buffer changes raise :class:`ReplayError`.
    """
    if not isinstance(inputs, TensorDictBase):
        raise TypeError(
            _PREFIX + f"replay() takes its inputs as a TensorDict, got {type(inputs).__name__}. "
            "Use TensorDict(observation=obs, ...) or checkpoint_fsdp_forward(model, acc, **kwargs)."
        )
    if not torch.is_grad_enabled():
        outputs = model(**inputs)
        if isinstance(outputs, Mapping) and not isinstance(outputs, TensorDictBase):
            outputs = TensorDict(dict(outputs), batch_size=[])  # as with grad enabled
        return outputs
    leaves, layout = _flatten_inputs(inputs)
    if not leaves:
        raise ValueError(
            _PREFIX + f"replay() needs at least one tensor input; the TensorDict has keys "
            f"{list(inputs.keys(include_nested=True))} but no tensors."
        )
    paths = None

    def what(i: int) -> str:
        nonlocal paths
        if paths is None:
            paths = [k for k, _ in inputs.items(include_nested=True, leaves_only=True)]
        return f"input {paths[i]!r}"

    return _apply(model, accumulator, leaves, layout, context_fn, what)


def checkpoint_fsdp_forward(
    model: Callable[..., Any],
    accumulated: GradientAccumulator | dict,
    *,
    context_fn: ContextFn | None = None,
    **kwargs: Any,
):
    r"""Replay independent model forwards and accumulate parameter gradients.

    Keyword-argument form of :func:`replay`, compatible with code written for the
    original ``checkpoint_fsdp_forward`` helper: share a fresh ``accumulated``
    (a :class:`GradientAccumulator`, or a plain ``dict``) across all blocks of one
    rollout, call ``loss.backward()`` once, then clip gradients and step.

    Args:
        model: the module to run, called as ``model(**kwargs)``.
        accumulated: a fresh :class:`GradientAccumulator`, or an empty ``dict``; after
            backward the dict maps each parameter to its final gradient.

    Keyword args:
        context_fn: optional ``() -> (forward_context, recompute_context)``.
        **kwargs: the model's inputs: tensors, or immutable metadata (numbers,
            strings, tuples, dtypes...). Tensors must be passed directly, not inside
            containers. All CUDA tensors must be on one device.

    Returns:
        The model's output (a tensor or a tuple of tensors), attached to autograd.

    Distributed use requires FSDP1 ``FULL_SHARD`` with ``use_orig_params=True``
    (``CPUOffload`` optional) and gradient synchronisation enabled. FSDP2,
    ``no_sync``, higher-order gradients and ``torch.autograd.grad`` /
    ``backward(inputs=...)`` are rejected with a clear error.
    """
    accumulator = _accumulator_from(accumulated)
    if not torch.is_grad_enabled():
        return model(**kwargs)
    keys = tuple(kwargs)
    values = list(kwargs.values())
    positions = []
    for i, (key, value) in enumerate(kwargs.items()):
        if isinstance(value, torch.Tensor):
            positions.append(i)
        else:
            _check_metadata(key, value)
    if not positions:
        raise ValueError(
            _PREFIX
            + "checkpoint_fsdp_forward needs at least one tensor keyword input; got "
            + (", ".join(f"{k}={type(v).__name__}" for k, v in kwargs.items()) or "no inputs")
            + ". Pass the observation (or another tensor) as a keyword argument."
        )
    tensors = [values[i] for i in positions]
    for i in positions:
        # The layout lives until the backward: it must not hold the inputs themselves
        # (the block saves their host copies), or CUDA inputs would stay on the device
        # for the whole rollout.
        values[i] = None
    layout = _KwargsLayout(keys, tuple(positions), tuple(values))

    def what(i: int) -> str:
        return f"keyword '{keys[positions[i]]}'"

    return _apply(model, accumulator, tensors, layout, context_fn, what)


def _accumulator_from(accumulated: GradientAccumulator | dict) -> GradientAccumulator:
    if isinstance(accumulated, GradientAccumulator):
        return accumulated
    if isinstance(accumulated, dict):
        accumulator = accumulated.get(_ACCUMULATOR_KEY)
        if accumulator is None:
            if accumulated:
                raise ReplayError(
                    _PREFIX + "the accumulated dict is not empty: it already finished a backward "
                    "pass (it now maps parameters to their gradients), so its rollout is over. "
                    "Pass a fresh empty dict (or GradientAccumulator) for each rollout."
                )
            accumulator = accumulated[_ACCUMULATOR_KEY] = GradientAccumulator()
            accumulator._mirror = accumulated
        return accumulator
    raise TypeError(
        _PREFIX + f"accumulated must be a GradientAccumulator or a dict, got "
        f"{type(accumulated).__name__}. Create one with rl_replay.GradientAccumulator()."
    )


def _check_metadata(key: str, value: Any) -> None:
    if (
        isinstance(value, (list, tuple, dict, set, frozenset, TensorDictBase))
        and any(isinstance(leaf, torch.Tensor) for leaf in pytree.tree_leaves(value))
        or isinstance(value, TensorDictBase)
    ):
        raise ValueError(
            _PREFIX + f"keyword '{key}' is a {type(value).__name__} containing tensors; tensors "
            "must be passed directly as keyword arguments so they can be saved and get "
            "gradients. Pass each tensor as its own keyword, or use rl_replay.replay() with a "
            "(nested) TensorDict."
        )
    try:
        hash(value)
    except TypeError:
        raise ValueError(
            _PREFIX + f"keyword '{key}' is a mutable {type(value).__name__}; non-tensor inputs "
            "are reused unchanged by the recompute, so they must be immutable metadata. "
            "Pass a tuple (or another hashable value) instead."
        ) from None
