"""Error types shared by the replay engine and the trainer."""

__all__ = ["ReplayError", "SetupError"]


class ReplayError(RuntimeError):
    """A replay block was used in a way that would give wrong gradients.

    Raised for unsupported setups (FSDP2, ``use_orig_params=False``, ``no_sync``,
    higher-order gradients, ``torch.autograd.grad`` through a block), for models
    that mutate parameters or buffers inside a block, and for reusing a finished
    :class:`~rl_replay.GradientAccumulator`.
    """


class SetupError(ValueError):
    """A run cannot start as configured (unknown env id, agent path, action space...).

    Raised before anything is written to disk; scripts print it as one line.
    """


_PREFIX = "rl_replay.replay: "

DEBUG_TIP = (
    "\nTip: every block recomputes its forward during loss.backward(); anything the "
    "forward changes (buffers, parameters, global state) changes twice."
)


def _internal_assert(condition: bool, message: str) -> None:
    if not condition:
        raise AssertionError(_PREFIX + message + " This is a bug in rl_replay; please report it.")
