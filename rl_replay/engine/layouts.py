"""How a block's saved tensors become a model call again, and how its outputs are flattened.

A block saves a flat list of tensors (Rule 1). Its :class:`Layout` turns that list back into the
model's call: :class:`TDSpec` for a plain TensorDict (interned: blocks of one structure share
one object), :class:`TreeLayout` for any other TensorDict (pytree), :class:`KwargsLayout` for
``checkpoint_fsdp_forward``'s keyword arguments, and the multi-step layout of
:mod:`rl_replay.engine.steps`, which also brings its own backward.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any, ClassVar

import torch
import torch.utils._pytree as pytree
from tensordict import TensorDict, TensorDictBase

from rl_replay.engine.errors import _PREFIX

__all__ = [
    "Layout",
    "Recompute",
    "TDSpec",
    "TreeLayout",
    "KwargsLayout",
    "flatten_td",
    "intern_spec",
    "flatten_inputs",
    "flatten_outputs",
    "unflatten_outputs",
]


class Recompute(enum.Enum):
    """How a block's backward recomputes its forward: every layout names one."""

    ONE_CALL = "one call"
    """the block's one model call, recomputed with grad and back-propagated by one nested
    backward (:func:`rl_replay.engine.replay.recompute_and_backward`)"""
    ONE_CALL_CONTINUING_SUMS = "one call, continuing the running sums"
    """the same, with each parameter's gradient so far fed into the nested backward, so a
    parameter used at every step of a k-step call sums in plain autograd's order"""
    STEPS = "the layout's own steps"
    """k model calls, one nested backward per step newest first: the layout's own
    ``recompute_and_backward(block, saved, requires_grad, grads)`` (engine/steps.py)"""


class Layout:
    """How a block's saved tensors become its model call (the protocol every layout follows).

    ``call(model, tensors)`` runs the block's forward (and its recompute) from the flat list
    of tensors the block saved. The one-step layouts below rebuild the keyword arguments
    (:meth:`rebuild`) and call the model once. :attr:`recompute` says how the block's
    backward recomputes it; a layout whose recompute is :attr:`Recompute.STEPS` (a multi-step
    layout, engine/steps.py) overrides :meth:`call` and defines ``recompute_and_backward``.
    """

    __slots__ = ()

    #: How the block's backward recomputes this layout's call.
    recompute: ClassVar[Recompute] = Recompute.ONE_CALL

    def call(self, model: Callable, tensors: Sequence[torch.Tensor]) -> Any:
        return model(**self.rebuild(tensors))

    def rebuild(self, tensors: Sequence[torch.Tensor]) -> dict:
        raise NotImplementedError


# ------------------------------------------------------------------------------ blocks
class KwargsLayout(Layout):
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
            isinstance(other, KwargsLayout)
            and self.keys == other.keys
            and self.positions == other.positions
            and all(_same_value(a, b) for a, b in zip(self.values, other.values))
        )

    __hash__ = None  # type: ignore[assignment]  # mutable-free but compared structurally; never a dict key


def _same_value(a: Any, b: Any) -> bool:
    """Whether metadata ``b`` can stand in for ``a`` in a recompute: the same object, or an
    equal value of the same plain type (``1``, ``1.0`` and ``True`` compare equal but are
    not interchangeable; neither are ``0.0`` and ``-0.0``)."""
    if a is b:
        return True
    if type(a) is not type(b) or type(a) not in (int, str, bytes, float):
        return False
    return a == b and (type(a) is not float or repr(a) == repr(b))


class TDSpec(Layout):
    """The structure of a plain TensorDict: its keys, which entries are nested TensorDicts
    (with their own specs), its batch size and device.

    Specs are interned (:func:`flatten_td`): blocks whose inputs (or outputs) have the
    same structure share one spec object, so a site compares layouts by identity and a
    block keeps no per-block structure. Flattening and rebuilding through a spec is a
    plain loop over the TensorDict's entries, about 10x cheaper per block than the
    generic pytree path, which :class:`TreeLayout` keeps for everything else
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


_SPECS: dict[tuple, TDSpec] = {}


def flatten_td(td: Any, leaves: list) -> TDSpec | None:
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
            child = flatten_td(value, leaves)
            if child is None:
                return None
            entries.append((key, child))  # type: ignore[arg-type]
    return intern_spec(tuple(entries), td.batch_size, td.device)


def intern_spec(entries: tuple, batch_size: torch.Size, device) -> TDSpec:
    """The one :class:`TDSpec` of this structure."""
    signature = (entries, batch_size, device)
    spec = _SPECS.get(signature)
    if spec is None:
        if len(_SPECS) >= 1024:  # structures that change every block: do not grow
            _SPECS.clear()
        spec = _SPECS[signature] = TDSpec(entries, batch_size, device)
    return spec


def flatten_inputs(td: TensorDictBase) -> tuple[list[torch.Tensor], Any]:
    """The leaves of a block's input TensorDict and the layout that rebuilds the kwargs."""
    leaves: list[torch.Tensor] = []
    spec = flatten_td(td, leaves)
    if spec is not None:
        return leaves, spec
    leaves, tree = pytree.tree_flatten(td)
    return leaves, TreeLayout(tree)


class TreeLayout(Layout):
    """How ``replay`` turns a block's tensors back into the model's keyword arguments
    when the input TensorDict is not a plain one (:class:`TDSpec`): its pytree spec
    (top-level keys become keywords)."""

    __slots__ = ("spec",)

    def __init__(self, spec: Any) -> None:
        self.spec = spec

    def rebuild(self, tensors: Sequence[torch.Tensor]) -> dict:
        td = pytree.tree_unflatten(list(tensors), self.spec)
        return {key: td.get(key) for key in td.keys()}

    def __eq__(self, other: object) -> bool:
        return isinstance(other, TreeLayout) and self.spec == other.spec

    __hash__ = None  # type: ignore[assignment]


def flatten_outputs(outputs: Any, model: Callable) -> tuple[tuple[torch.Tensor, ...], Any]:
    """A block's outputs as a flat tuple of tensors and the spec that rebuilds them (``model`` for the error)."""
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
        spec = flatten_td(outputs, leaves)
        if spec is not None:
            return tuple(leaves), spec
        leaves, spec = pytree.tree_flatten(outputs)  # type: ignore[assignment]
        if all(isinstance(leaf, torch.Tensor) for leaf in leaves):
            return tuple(leaves), spec
    name = type(model).__name__
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


def unflatten_outputs(flat: Sequence[torch.Tensor], spec: Any):
    if spec is None:
        return flat[0]
    if isinstance(spec, int):
        return tuple(flat)
    if type(spec) is TDSpec:
        return spec.build(iter(flat))
    return pytree.tree_unflatten(list(flat), spec)
