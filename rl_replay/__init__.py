"""rl_replay: policy-gradient training on long rollouts with blockwise autograd replay.

The replay engine (:mod:`rl_replay.engine`: :func:`replay`, :func:`checkpoint_fsdp_forward`,
:class:`GradientAccumulator`) is independent of the trainer and can be used alone; its
public names are re-exported here. Everything else (the trainer, the collector, the
algorithms) lives in submodules imported on first use.
"""

from rl_replay.engine import (GradientAccumulator, ReplayError, StateWatch, checkpoint_fsdp_forward,
                              keep_freed_memory, replay)

__all__ = ["Agent", "GradientAccumulator", "ReplayError", "StateWatch", "checkpoint_fsdp_forward",
           "keep_freed_memory", "replay"]
__version__ = "0.1.0"


def __getattr__(name: str):
    # rl_replay.Agent is imported on first use, so taking the engine alone does not pull
    # in gymnasium and the trainer side.
    if name == "Agent":
        from rl_replay.agent import Agent

        return Agent
    raise AttributeError(f"module 'rl_replay' has no attribute {name!r}")
