"""Host storage for saved block inputs: per-rollout slabs.

See NOTE [ Replay blocks ] in replay.py (Rule 1) for why saved inputs live here. A
:class:`SlabStore` belongs to one rollout's GradientAccumulator. It hands out host
tensors carved from large contiguous chunks ("slabs"):

* pageable chunks are anonymous ``mmap`` regions, outside the C heap: their pages are
  faulted in only as inputs are copied in, they are not interleaved with the blocks'
  transient activations, and they go back to the OS in one piece (``munmap``) when the
  last tensor viewing them is freed, whatever glibc's trim and mmap thresholds are;
* pinned chunks (for inputs that come from CUDA) come from PyTorch's pinned host
  allocator, so copies back to the device can be asynchronous; the allocator keeps
  freed pinned blocks for reuse and waits for pending copies before reusing one.

Chunks grow geometrically (1 MiB, doubling, up to 4 MiB each; a larger tensor gets a
chunk of its own size), so a rollout needs few of them and wastes at most the unused
tail of its last chunk (untouched, hence not resident, for pageable chunks). Every
tensor starts on a 64-byte boundary, PyTorch's own CPU alignment, so kernels see the
same alignment they would for a fresh tensor.
"""

from __future__ import annotations

import mmap

import torch
from torch.multiprocessing.reductions import StorageWeakRef

__all__ = ["SlabStore"]

_ALIGN = 64
_FIRST_CHUNK = 1 << 20
_MAX_CHUNK = 4 << 20


class _Chunk:
    __slots__ = ("buffer", "used")

    def __init__(self, nbytes: int, pinned: bool) -> None:
        if pinned:
            self.buffer = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
        else:
            # The tensor keeps the mmap object alive; the region is unmapped when the
            # last tensor viewing it is freed.
            self.buffer = torch.frombuffer(mmap.mmap(-1, nbytes), dtype=torch.uint8)
        self.used = 0

    def take(self, nbytes: int) -> torch.Tensor | None:
        start = -(-self.used // _ALIGN) * _ALIGN
        if start + nbytes > self.buffer.numel():
            return None
        self.used = start + nbytes
        return self.buffer[start:start + nbytes]


class SlabStore:
    """Copies of tensors in per-rollout host chunks (one store per GradientAccumulator).

    Attributes:
        reserved_bytes: bytes of all chunks allocated so far (pageable + pinned).
        copied_bytes: bytes of the tensors copied in (saved inputs and outputs).
    """

    def __init__(self) -> None:
        self._open: dict[bool, _Chunk] = {}  # pinned? -> chunk being filled
        # Every chunk of the rollout, weakly: a chunk is freed as soon as no tensor views
        # it (e.g. while the backward goes through its blocks), not kept by the store.
        self._chunks: dict[int, tuple[StorageWeakRef, _Chunk]] = {}
        self._next_size = {False: _FIRST_CHUNK, True: _FIRST_CHUNK}
        self.reserved_bytes = 0
        self.copied_bytes = 0

    def copy(self, t: torch.Tensor, *, pinned: bool) -> torch.Tensor:
        """A host copy of dense ``t`` with its sizes and strides, inside a chunk."""
        nbytes = t.numel() * t.element_size()
        chunk = self._open.get(pinned)
        raw = chunk.take(nbytes) if chunk is not None else None
        if raw is None:
            size = max(self._next_size[pinned], -(-nbytes // _ALIGN) * _ALIGN)
            self._next_size[pinned] = min(2 * self._next_size[pinned], _MAX_CHUNK)
            if chunk is not None:
                chunk.buffer = None  # full: its tensors alone keep it now
            chunk = self._open[pinned] = _Chunk(size, pinned)
            self._forget_freed()
            self._chunks[chunk.buffer.data_ptr()] = (StorageWeakRef(chunk.buffer.untyped_storage()), chunk)
            self.reserved_bytes += size
            raw = chunk.take(nbytes)
        # Same strides as the source: dense tensors are a permutation of a contiguous
        # layout over exactly numel elements, and kernels may depend on the layout.
        out = raw.view(t.dtype).as_strided(t.shape, t.stride())
        # Blocking, as save_on_cpu's: the copy is done before the caller can touch t.
        out.copy_(t)
        self.copied_bytes += nbytes
        return out

    def place(self, t: torch.Tensor) -> torch.Tensor:
        """A copy of dense host ``t`` in a pageable chunk that is a tensor of its own (no
        ``_base``, its own version counter), for a block's outputs."""
        view = self.copy(t, pinned=False)
        out = torch.empty(0, dtype=t.dtype)
        return out.set_(view.untyped_storage(), view.storage_offset(), t.shape, t.stride())

    def owns(self, t: torch.Tensor) -> bool:
        """Whether ``t`` lives in one of this store's chunks."""
        entry = self._chunks.get(t.untyped_storage().data_ptr())
        return entry is not None and not entry[0].expired()

    def _forget_freed(self) -> None:
        for ptr in [p for p, (ref, _) in self._chunks.items() if ref.expired()]:
            del self._chunks[ptr]

    def used_bytes(self) -> dict[int, int]:
        """``{chunk data_ptr: bytes handed out}`` for the chunks of this rollout."""
        return {ptr: c.used for ptr, (ref, c) in self._chunks.items() if not ref.expired()}

    def release(self) -> None:
        """Drop the open chunks: from now on every chunk is freed as soon as no tensor
        views it any more (at once, unless a retained graph still holds its blocks)."""
        for chunk in self._open.values():
            chunk.buffer = None
        self._open.clear()
        self._chunks.clear()
