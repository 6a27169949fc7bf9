"""One rollout's gradient sink: parameter gradients summed over all replay blocks."""

from __future__ import annotations

import time
from collections.abc import Iterable

import torch

from rl_replay.engine.errors import _PREFIX, ReplayError
from rl_replay.engine.storage import SlabStore

__all__ = ["GradientAccumulator"]

# Where checkpoint_fsdp_forward keeps the accumulator of a plain ``accumulated`` dict
# during its rollout; removed when the backward finishes, so that the dict then maps
# exactly each parameter to its gradient.
_ACCUMULATOR_KEY = "__rl_replay_accumulator__"


class GradientAccumulator:
    r"""Collects the parameter gradients of every replay block of one rollout.

    Create one per rollout, pass it to every :func:`rl_replay.replay` (or
    :func:`rl_replay.checkpoint_fsdp_forward`) call of that rollout, then call
    ``loss.backward()`` once. When ``backward`` returns, each parameter's ``.grad``
    holds its previous value plus the sum over all blocks, exactly as plain autograd
    would leave it, ready for clipping and ``optimizer.step()``.

    How the sum is kept depends on who owns ``.grad``:

    * plain modules (and FSDP1 without CPU offload) accumulate into ``.grad`` by
      themselves, so the accumulator leaves autograd's own in-place
      ``AccumulateGrad`` alone: no copies, no extra memory;
    * under FSDP1 each block's backward may *overwrite* ``.grad`` (CPU offload
      reuses one pinned buffer), so before each block the accumulator takes the
      gradient out of the parameter into its own running sum (the first block's
      gradient is copied once, later ones are one in-place ``add_``) and, once the
      whole backward is done, adds the sum back into ``.grad`` in place. That
      finalisation runs once per backward, from a callback queued on the autograd
      engine.

    Counters for dashboards (cumulative over the rollout):

    Attributes:
        num_blocks: replay blocks recorded in the forward pass.
        saved_bytes: bytes of block inputs kept for backward (on the host), whether
            copied into the rollout's slabs or kept as views of the caller's tensors.
        slab_bytes: host bytes reserved for the copied inputs (the rollout's slabs;
            see NOTE [ Replay blocks ], Rule 1). They are freed in one piece per
            chunk when the backward is done (or when the rollout's graph is dropped).
        blocks_replayed: blocks recomputed during backward.
        replay_seconds: wall time spent recomputing and back-propagating blocks.
        backward_passes: finished backward passes through this accumulator.
        slabs: the rollout's :class:`~rl_replay.engine.storage.SlabStore`, for reading
            its statistics (``used_bytes()``, ``copied_bytes``, ``owns(t)``); the engine
            alone writes to it.

    .. warning::
        An accumulator belongs to one rollout. Recording a new block after its
        backward finished raises :class:`~rl_replay.ReplayError`; create a new one.
    """

    def __init__(self) -> None:
        self.num_blocks = 0
        self.saved_bytes = 0
        self.blocks_replayed = 0
        self.replay_seconds = 0.0
        self.backward_passes = 0
        self.slab_bytes = 0
        # The saved inputs' host chunks (replay._save_inputs copies into them).
        self.slabs = SlabStore()
        # Per model (keyed by id) facts computed once per rollout: see replay._ModelPlan.
        self._plans: dict[int, object] = {}
        # Running sums for parameters whose .grad FSDP may overwrite between blocks.
        self._sums: dict[torch.Tensor, torch.Tensor] = {}
        self._absorbed: list[torch.nn.Parameter] = []
        self._absorbed_ids: set[int] = set()
        self._in_backward = False
        # The seed API passes a plain dict: finalised gradients are mirrored into it.
        self._mirror: dict | None = None

    # ---------------------------------------------------------------- forward side
    def _check_open(self) -> None:
        if self.backward_passes:
            raise ReplayError(
                _PREFIX + "this GradientAccumulator already finished a backward pass; "
                "its rollout is over. Create a fresh GradientAccumulator for each rollout."
            )

    def _record_block(self, saved_bytes: int) -> None:
        self.num_blocks += 1
        self.saved_bytes += saved_bytes
        self.slab_bytes = self.slabs.reserved_bytes

    # --------------------------------------------------------------- backward side
    def _enter_backward(self) -> None:
        """Called by every block's backward; the first one schedules finalisation."""
        if not self._in_backward:
            self._in_backward = True
            # Runs after the *outer* backward (the user's loss.backward()) completes,
            # not after the nested per-block backward a block is about to start.
            torch.autograd.Variable._execution_engine.queue_callback(self._finalise)

    def _begin_block(self, params: Iterable[torch.nn.Parameter], absorb: bool) -> float:
        """Called by a block's backward before it recomputes; returns a start time."""
        if absorb:
            self._absorb(params)
        return time.perf_counter()

    def _end_block(self, start: float) -> None:
        self.blocks_replayed += 1
        self.replay_seconds += time.perf_counter() - start

    @torch.no_grad()
    def _absorb(self, params: Iterable[torch.nn.Parameter]) -> None:
        """Move whatever sits in ``.grad`` into the running sums and clear it."""
        for p in params:
            g = p.grad
            if g is None:
                continue
            key = id(p)
            if key not in self._absorbed_ids:
                self._absorbed_ids.add(key)
                self._absorbed.append(p)
            total = self._sums.get(p)
            if total is None:
                # A view (FSDP's flat-gradient shards) aliases storage FSDP reuses for
                # the next block, so it must be copied; a plain tensor is ours to keep.
                self._sums[p] = g.clone() if g._base is not None else g
            else:
                total.add_(g)
            p.grad = None

    @torch.no_grad()
    def _finalise(self, failed: bool = False) -> None:
        """Put the kept sums back into ``.grad`` and close the backward (``failed``: a block's
        backward raised, and its error is the one to report)."""
        missed = []
        try:
            for plan in self._plans.values():
                missed.append(plan.end_backward())  # type: ignore[attr-defined]
            for p in self._absorbed:
                total = self._sums.pop(p, None)
                if total is None:
                    continue
                g = p.grad
                if g is None:
                    p.grad = total
                else:
                    # Add in place so FSDP's flat gradient (which g views) stays the
                    # single source of truth for clip_grad_norm_ and state dicts.
                    g.add_(total)
            if self._mirror is not None:
                self._mirror.pop(_ACCUMULATOR_KEY, None)
                for plan in self._plans.values():
                    for p in plan.params:  # type: ignore[attr-defined]
                        if p.grad is not None:
                            self._mirror[p] = p.grad
        finally:
            # The blocks' saved tensors hold their chunks until autograd frees them
            # (after each block's backward, or with the graph under retain_graph).
            self.slabs.release()
            self._sums.clear()
            self._absorbed.clear()
            self._absorbed_ids.clear()
            self._in_backward = False
            self.backward_passes += 1
        if any(missed) and not failed:
            raise ReplayError(
                _PREFIX + f"{'; '.join(m for m in missed if m)}. Under FSDP's SHARD_GRAD_OP and "
                "NO_SHARD the engine reduces the gradient once, in the backward of the rollout's "
                "last block, so the reduction never ran and the "
                "parameters' gradients are not averaged over ranks: do not step on them. Make "
                "every block's outputs part of the loss (multiply unused ones by zero), or use "
                "FULL_SHARD."
            )

    def stats(self) -> dict[str, float]:
        """The counters as a flat dict (for logging)."""
        return {
            "blocks": self.num_blocks,
            "saved_bytes": self.saved_bytes,
            "slab_bytes": self.slab_bytes,
            "blocks_replayed": self.blocks_replayed,
            "replay_seconds": self.replay_seconds,
        }

    def __repr__(self) -> str:
        return (
            f"GradientAccumulator(blocks={self.num_blocks}, saved_bytes={self.saved_bytes}, "
            f"replayed={self.blocks_replayed}, replay_seconds={self.replay_seconds:.3f}, "
            f"backward_passes={self.backward_passes})"
        )
