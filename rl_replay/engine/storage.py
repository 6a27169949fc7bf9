"""Host storage for saved block inputs: per-rollout slabs.

A :class:`SlabStore` belongs to one rollout's GradientAccumulator (NOTE [ Replay blocks ]
in replay.py, Rule 1). What a block puts here:

* its host inputs, copied in before the model runs (so an in-place change by the forward
  cannot reach the copy); CUDA inputs go to pinned chunks and are copied back with
  non-blocking copies in the backward;
* a CPU block's outputs (the recurrent state, the logits...). The recurrent state a block
  returns is then already here when the next block saves it: it is kept as a detached
  alias (same storage and version counter, no autograd metadata), not copied again.

What a block does not copy: host inputs that are slices of a larger buffer (``obs[t]`` of
a preallocated rollout tensor) are kept as that buffer plus the slice's offset, sizes and
strides, and leaves that require grad are kept as they are; their memory is held anyway,
so a copy would only add bytes. Unlike copies, those see later in-place writes, so the
engine checks their versions before the recompute.

Why: what survives a block (its saved inputs and its outputs) is the only memory that
grows with T. Left where the model allocated it, among the block's freed activations, it
splits the heap's free space, which then can neither be reused compactly nor returned
(docs/benchmarks.md has the measurement). In slabs the heap grows per step by the bytes in
use, and a chunk goes back to the OS (or the pinned cache) in one piece as soon as no
tensor uses it, e.g. once the backward has replayed its blocks (the store holds chunks
weakly; a tensor the caller keeps holds its chunk).

A store hands out host tensors carved from large contiguous chunks ("slabs"):

* pageable chunks are anonymous ``mmap`` regions, outside the C heap: their pages are
  faulted in only as inputs are copied in, they are not interleaved with the blocks'
  transient activations, and they go back to the OS in one piece (``munmap``) when the
  last tensor viewing them is freed, whatever glibc's trim and mmap thresholds are;
* pinned chunks (for inputs that come from CUDA) come from PyTorch's pinned host
  allocator, so copies back to the device can be asynchronous; the allocator keeps
  freed pinned blocks for reuse and waits for pending copies before reusing one.

Tensors go into chunk *series*: saved input copies share one series per kind (pageable,
pinned), and each output position of a block (``out[0]``, ``out[1]``, ...) has a pageable
series of its own. Outputs in one position play one role from block to block (the
recurrent state, which the next block saves; the logits, which a loss stacks and drops),
so they die together, and their chunks go back to the OS as soon as they do, instead of
being held by a neighbour that lives until the backward. Each series' chunks grow
geometrically (1 MiB, doubling, up to 4 MiB each; a larger tensor gets a chunk of its own
size), so a rollout needs few of them and wastes at most the unused tail of each series'
last chunk (untouched, hence not resident, for pageable chunks). Every tensor starts on a
64-byte boundary, PyTorch's own CPU alignment, so kernels see the same alignment they
would for a fresh tensor.
"""

from __future__ import annotations

import mmap
import weakref

import torch
from torch.multiprocessing.reductions import StorageWeakRef

__all__ = ["SlabStore"]

_ALIGN = 64
_FIRST_CHUNK = 1 << 20
_MAX_CHUNK = 4 << 20


class _Chunk:
    """One contiguous host region that tensors are carved from, front to back.

    The chunk does not keep its memory alive: its tensors do (they share its storage).
    It remembers the last tensor carved, weakly, to carve the next one from the same
    storage; once that tensor is gone the chunk takes no more (its tail is never
    touched, so it costs address space, not memory).
    """

    __slots__ = ("size", "used", "last", "storage_ref", "data_ptr", "_first")

    def __init__(self, nbytes: int, pinned: bool) -> None:
        if pinned:
            buffer = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
        else:
            # The storage keeps the mmap object alive; the region is unmapped when the
            # last tensor using it is freed.
            buffer = torch.frombuffer(mmap.mmap(-1, nbytes), dtype=torch.uint8)
        self.size = nbytes
        self.used = 0
        self.last: weakref.ref | None = None
        self.storage_ref = StorageWeakRef(buffer.untyped_storage())
        self.data_ptr = buffer.data_ptr()
        self._first = buffer

    def take(self, like: torch.Tensor) -> torch.Tensor | None:
        """A tensor with ``like``'s dtype, sizes and strides in the next free bytes (not
        filled in), or None if the chunk is full or can no longer be reached."""
        nbytes = like.numel() * like.element_size()
        start = -(-self.used // _ALIGN) * _ALIGN
        if start + nbytes > self.size:
            return None
        if self.last is None:
            storage = self._first.untyped_storage()
        else:
            last = self.last()
            if last is None:
                return None
            storage = last.untyped_storage()
        # A tensor of its own over the chunk's storage (no ``_base``, its own version
        # counter); same strides as the source: dense tensors are a permutation of a
        # contiguous layout over exactly numel elements, and kernels may depend on it.
        out = torch.empty(0, dtype=like.dtype).set_(storage, start // like.element_size(), like.shape, like.stride())
        self.used = start + nbytes
        self.last = weakref.ref(out)
        self._first = None  # type: ignore[assignment]
        return out


class SlabStore:
    """Copies of tensors in per-rollout host chunks (one store per GradientAccumulator).

    Attributes:
        reserved_bytes: bytes of all chunks allocated so far (pageable + pinned).
        copied_bytes: bytes of the tensors copied in (saved inputs and outputs).
    """

    def __init__(self) -> None:
        # series -> chunk being filled; a series is True (pinned inputs), False (pageable
        # inputs) or ("output", position) (pageable).
        self._open: dict[object, _Chunk] = {}
        # Every chunk of the rollout, weakly: a chunk is freed as soon as no tensor uses
        # it (e.g. while the backward goes through its blocks), not kept by the store.
        self._chunks: dict[int, _Chunk] = {}
        self._next_size: dict[object, int] = {}
        self.reserved_bytes = 0
        self.copied_bytes = 0

    def copy(self, t: torch.Tensor, *, pinned: bool, series: object = None) -> torch.Tensor:
        """A host copy of dense ``t`` with its sizes and strides, inside a chunk of
        ``series`` (default: the inputs' series, ``pinned``), as a tensor of its own."""
        if series is None:
            series = pinned
        chunk = self._open.get(series)
        out = chunk.take(t) if chunk is not None else None
        if out is None:
            nbytes = t.numel() * t.element_size()
            next_size = self._next_size.get(series, _FIRST_CHUNK)
            size = max(next_size, -(-nbytes // _ALIGN) * _ALIGN)
            self._next_size[series] = min(2 * next_size, _MAX_CHUNK)
            chunk = self._open[series] = _Chunk(size, pinned)
            self._forget_freed()
            self._chunks[chunk.data_ptr] = chunk
            self.reserved_bytes += size
            out = chunk.take(t)
        assert out is not None  # a fresh chunk holds at least the tensor
        # Blocking, as save_on_cpu's: the copy is done before the caller can touch t.
        out.copy_(t)
        self.copied_bytes += t.numel() * t.element_size()
        return out

    def place(self, t: torch.Tensor, position: int) -> torch.Tensor:
        """A copy of dense host ``t`` in a pageable chunk, for a block's output number
        ``position`` (each position fills chunks of its own)."""
        return self.copy(t, pinned=False, series=("output", position))

    def owns(self, t: torch.Tensor) -> bool:
        """Whether ``t`` lives in one of this store's chunks."""
        chunk = self._chunks.get(t.untyped_storage().data_ptr())
        return chunk is not None and not chunk.storage_ref.expired()

    def _forget_freed(self) -> None:
        for key in [k for k, c in self._chunks.items() if c.storage_ref.expired()]:
            del self._chunks[key]

    def used_bytes(self) -> dict[int, int]:
        """``{chunk data_ptr: bytes handed out}`` for the chunks of this rollout still in use."""
        return {k: c.used for k, c in self._chunks.items() if not c.storage_ref.expired()}

    def release(self) -> None:
        """Forget the rollout's chunks: they are freed as soon as no tensor uses them
        (at once, unless a retained graph still holds its blocks)."""
        self._open.clear()
        self._chunks.clear()
