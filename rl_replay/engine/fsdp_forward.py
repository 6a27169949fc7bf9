"""``checkpoint_fsdp_forward``: the reference helper's entry point, keyword tensors in, the same engine.

The reference API this project started from (``checkpoint_fsdp_forward(model, accumulated,
**kwargs)`` with ``accumulated`` a plain dict or a :class:`~rl_replay.engine.GradientAccumulator`);
it builds a :class:`~rl_replay.engine.layouts.KwargsLayout` and runs one block through
:func:`~rl_replay.engine.replay.apply_block`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.utils._pytree as pytree
from tensordict import TensorDictBase

from rl_replay.engine.accumulator import _ACCUMULATOR_KEY, GradientAccumulator
from rl_replay.engine.errors import _PREFIX, ReplayError
from rl_replay.engine.layouts import KwargsLayout
from rl_replay.engine.replay import ContextFn, apply_block

__all__ = ["checkpoint_fsdp_forward"]


def checkpoint_fsdp_forward(
    model: Callable[..., Any],
    accumulated: GradientAccumulator | dict,
    *,
    context_fn: ContextFn | None = None,
    **kwargs: Any,
):
    r"""Replay independent model forwards and accumulate parameter gradients.

    Keyword-argument form of :func:`replay`, compatible with code written for the
    original ``checkpoint_fsdp_forward`` helper: share a fresh ``accumulated``
    (a :class:`GradientAccumulator`, or a plain ``dict``) across all blocks of one
    rollout, call ``loss.backward()`` once, then clip gradients and step.

    Args:
        model: the module to run, called as ``model(**kwargs)``.
        accumulated: a fresh :class:`GradientAccumulator`, or an empty ``dict``; after
            backward the dict maps each parameter to its final gradient.

    Keyword args:
        context_fn: optional ``() -> (forward_context, recompute_context)``.
        **kwargs: the model's inputs: tensors, or immutable metadata (numbers,
            strings, tuples, dtypes...). Tensors must be passed directly, not inside
            containers. All CUDA tensors must be on one device.

    Returns:
        The model's output (a tensor or a tuple of tensors), attached to autograd.

    Distributed use requires FSDP1 (``FULL_SHARD``, ``SHARD_GRAD_OP``, ``HYBRID_SHARD`` or ``NO_SHARD``) with ``use_orig_params=True``
    (``CPUOffload`` optional) and gradient synchronisation enabled, or a module wrapped with FSDP2's
    ``fully_shard``. ``no_sync``, higher-order gradients and ``torch.autograd.grad`` /
    ``backward(inputs=...)`` are rejected with a clear error.
    """
    accumulator = _accumulator_from(accumulated)
    if not torch.is_grad_enabled():
        return model(**kwargs)
    keys = tuple(kwargs)
    values = list(kwargs.values())
    positions = []
    for i, (key, value) in enumerate(kwargs.items()):
        if isinstance(value, torch.Tensor):
            positions.append(i)
        else:
            _check_metadata(key, value)
    if not positions:
        raise ValueError(
            _PREFIX
            + "checkpoint_fsdp_forward needs at least one tensor keyword input; got "
            + (", ".join(f"{k}={type(v).__name__}" for k, v in kwargs.items()) or "no inputs")
            + ". Pass the observation (or another tensor) as a keyword argument."
        )
    tensors = [values[i] for i in positions]
    for i in positions:
        # The layout lives until the backward: it must not hold the inputs themselves
        # (the block saves their host copies), or CUDA inputs would stay on the device
        # for the whole rollout.
        values[i] = None
    layout = KwargsLayout(keys, tuple(positions), tuple(values))

    def what(i: int) -> str:
        return f"keyword '{keys[positions[i]]}'"

    return apply_block(model, accumulator, tensors, layout, context_fn, what)


def _accumulator_from(accumulated: GradientAccumulator | dict) -> GradientAccumulator:
    if isinstance(accumulated, GradientAccumulator):
        return accumulated
    if isinstance(accumulated, dict):
        accumulator = accumulated.get(_ACCUMULATOR_KEY)
        if accumulator is None:
            if accumulated:
                raise ReplayError(
                    _PREFIX + "the accumulated dict is not empty: it already finished a backward "
                    "pass (it now maps parameters to their gradients), so its rollout is over. "
                    "Pass a fresh empty dict (or GradientAccumulator) for each rollout."
                )
            accumulator = accumulated[_ACCUMULATOR_KEY] = GradientAccumulator()
            accumulator._mirror = accumulated
        return accumulator
    raise TypeError(
        _PREFIX + f"accumulated must be a GradientAccumulator or a dict, got "
        f"{type(accumulated).__name__}. Create one with rl_replay.GradientAccumulator()."
    )


def _check_metadata(key: str, value: Any) -> None:
    if (
        isinstance(value, (list, tuple, dict, set, frozenset, TensorDictBase))
        and any(isinstance(leaf, torch.Tensor) for leaf in pytree.tree_leaves(value))
        or isinstance(value, TensorDictBase)
    ):
        raise ValueError(
            _PREFIX + f"keyword '{key}' is a {type(value).__name__} containing tensors; tensors "
            "must be passed directly as keyword arguments so they can be saved and get "
            "gradients. Pass each tensor as its own keyword, or use rl_replay.replay() with a "
            "(nested) TensorDict."
        )
    try:
        hash(value)
    except TypeError:
        raise ValueError(
            _PREFIX + f"keyword '{key}' is a mutable {type(value).__name__}; non-tensor inputs "
            "are reused unchanged by the recompute, so they must be immutable metadata. "
            "Pass a tuple (or another hashable value) instead."
        ) from None
