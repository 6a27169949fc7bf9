"""rl_replay: policy-gradient training on long rollouts with blockwise autograd replay.

The replay engine (:func:`replay`, :func:`checkpoint_fsdp_forward`,
:class:`GradientAccumulator`) is independent of the trainer and can be used alone.
"""

from rl_replay.accumulator import GradientAccumulator
from rl_replay.errors import ReplayError
from rl_replay.replay import checkpoint_fsdp_forward, replay

__all__ = ["GradientAccumulator", "ReplayError", "checkpoint_fsdp_forward", "replay"]
__version__ = "0.1.0"
