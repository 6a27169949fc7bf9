"""The replay engine's error type and the wording its messages share."""

__all__ = ["ReplayError"]


class ReplayError(RuntimeError):
    """A replay block was used in a way that would give wrong gradients.

    Raised for unsupported setups (FSDP1 with ``use_orig_params=False``, ``no_sync``,
    higher-order gradients, ``torch.autograd.grad`` through a block), for models
    that mutate parameters or buffers inside a block, and for reusing a finished
    :class:`~rl_replay.engine.GradientAccumulator`.
    """


_PREFIX = "rl_replay.replay: "

DEBUG_TIP = (
    "\nTip: every block recomputes its forward during loss.backward(); anything the "
    "forward changes (buffers, parameters, global state) changes twice."
)
