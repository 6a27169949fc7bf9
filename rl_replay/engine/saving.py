"""What a block saves of its inputs, and how they come back for the recompute (Rules 1 and 5).

Host inputs are copied into the rollout's slabs, kept as they are (with their version
recorded), kept as a detached alias, or kept as their place in the buffer they slice; CUDA
inputs are copied to pinned host memory. :mod:`rl_replay.engine.storage` holds the slabs.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from rl_replay.engine.errors import _PREFIX, ReplayError

__all__ = [
    "save_inputs",
    "unslice",
    "restore_inputs",
    "place_outputs",
    "check_inputs_unchanged",
    "dense",
]

_NONES: dict[int, tuple] = {}


def save_inputs(tensors: Sequence[torch.Tensor], slabs, intern: Callable[[tuple], tuple]):
    """What a block saves of its inputs (Rule 1): ``(saved, devices, versions, slices)``.

    ``devices[i]`` is the CUDA device to restore input i to (None: it stays on the
    host); ``versions[i]`` the version of an input kept as it is (None: copied);
    ``slices[i]`` is ``(storage_offset, (dtype, shape, stride))`` when input i is a
    slice of a caller's buffer and ``saved[i]`` that buffer (None otherwise).
    """
    # devices, versions, slices: tuples, shared when not all None
    saved: list[torch.Tensor | None] = []
    devices: list[torch.device | None] = []
    versions: list[int | None] = []
    slices: list[tuple | None] = []
    for t in tensors:
        slice_of = None
        if t.is_cuda:
            # Device memory is what replay saves; contiguous unless dense (as save_on_cpu).
            src = t if dense(t) else t.contiguous()
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
                versions.append(base._version)  # type: ignore[union-attr]  # a view shares its base's version counter
                slice_of = (
                    t.storage_offset(),
                    intern((t.dtype, tuple(t.shape), t.stride())),
                )
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
    if not dense(t):
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


def unslice(saved: Sequence[torch.Tensor], slices: Sequence[tuple | None]):
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


def place_outputs(flat: tuple, inputs: Sequence[torch.Tensor], slabs) -> tuple:
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
            or not dense(o)
            or o.untyped_storage().data_ptr() in inputs_storage
        ):
            out.append(o)
            continue
        p = placed.get(id(o))
        if p is None:
            p = placed[id(o)] = slabs.place(o, position)
        out.append(p)
    return tuple(out)


def dense(t: torch.Tensor) -> bool:
    """Non-overlapping and dense: its strides lay out exactly numel elements."""
    if t.is_contiguous():
        return True
    expected = 1
    for stride, size in sorted((st, sz) for st, sz in zip(t.stride(), t.size()) if sz != 1):
        if stride != expected:
            return False
        expected *= size
    return True


def restore_inputs(saved: Sequence[torch.Tensor], devices: Sequence[torch.device | None]):
    """The saved inputs where the block got them: CUDA ones are copied back from pinned
    memory asynchronously (ordered on the current stream before the recompute)."""
    if all(d is None for d in devices):
        return saved
    return [t if d is None else t.to(d, non_blocking=True) for t, d in zip(saved, devices)]


def check_inputs_unchanged(saved: Sequence[torch.Tensor], versions: Sequence, slices: Sequence, index: int) -> None:
    for i, (t, version, where) in enumerate(zip(saved, versions, slices)):
        if version is not None and t._version != version:
            shape = tuple(t.shape) if where is None else where[1][1]
            raise ReplayError(
                _PREFIX + f"input {i} of block {index} (a {shape} host tensor) was "
                "modified in place after the block ran; the recompute would see the new values. "
                "Pass a fresh tensor to each block (e.g. .clone() a reused observation buffer)."
            )
