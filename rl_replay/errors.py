"""Error types of the trainer side (the engine's own is :class:`rl_replay.engine.ReplayError`)."""

from rl_replay.engine.errors import ReplayError

__all__ = ["ReplayError", "SetupError"]


class SetupError(ValueError):
    """A run cannot start as configured (unknown env id, agent path, action space...).

    Raised before anything is written to disk; scripts print it as one line.
    """
