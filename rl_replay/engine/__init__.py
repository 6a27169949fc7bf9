"""The replay engine: blockwise autograd replay with one gradient accumulator per rollout.

Depends on torch and tensordict only; nothing here knows about environments, configs,
logging or the trainer, so it can be used alone::

    from rl_replay.engine import GradientAccumulator, replay

==========================  ================================================================
:func:`replay`              run ``model(**inputs)`` (a TensorDict) as one replay block
:func:`checkpoint_fsdp_forward`  the same with keyword inputs (the API of the reference helper the project started from)
:func:`replay_sequence_call`  one call of a model over k consecutive steps as one block
:func:`replay_steps`        k consecutive steps, the model called once per step, as one block
:class:`GradientAccumulator`  one rollout's parameter-gradient sum, counters and slabs
:class:`StateWatch`         the "a block must not change its module" check, for reuse
:class:`ReplayError`        misuse that would give wrong gradients
:func:`keep_freed_memory`   glibc setting that lets blocks reuse freed gradient buffers
==========================  ================================================================

Modules: ``replay`` (the autograd Function, the block driver and :func:`replay`; its NOTE
[ Replay blocks ] states the rules), ``steps`` (multi-step blocks), ``layouts`` (saved tensors
back into a model call; the ``Layout`` protocol), ``saving`` (what a block saves of its inputs),
``plan`` (what the engine knows about a model), ``fsdp`` (FSDP1 checks and hooks),
``fsdp_forward`` (the reference helper's ``checkpoint_fsdp_forward``), ``accumulator``, ``storage`` (the
slabs that hold saved inputs), ``allocator``, ``errors``.
"""

from rl_replay.engine.accumulator import GradientAccumulator
from rl_replay.engine.allocator import keep_freed_memory
from rl_replay.engine.errors import ReplayError
from rl_replay.engine.fsdp_forward import checkpoint_fsdp_forward
from rl_replay.engine.plan import StateWatch
from rl_replay.engine.replay import replay
from rl_replay.engine.steps import replay_sequence_call, replay_steps

__all__ = [
    "GradientAccumulator",
    "ReplayError",
    "StateWatch",
    "checkpoint_fsdp_forward",
    "keep_freed_memory",
    "replay",
    "replay_sequence_call",
    "replay_steps",
]
