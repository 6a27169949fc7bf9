"""Observation spaces: batched numpy observations -> the tensors a replay block takes.

==================  ===========================================================
``Box`` (uint8)     ``(N, *shape)`` uint8: images stay a quarter of float32's
                    bytes in every saved block input; the agent converts them
``Box`` (other)     ``(N, *shape)`` float32
``MultiBinary``     ``(N, *shape)`` float32
``Discrete(n)``     ``(N, n)`` float32 one-hot
``MultiDiscrete``   ``(N, sum(nvec))`` float32, the one-hots concatenated
``Dict``            a TensorDict ``[N]`` with the space's keys, each converted
``Tuple``           a TensorDict ``[N]`` with keys ``"0"``, ``"1"``, ...
==================  ===========================================================

:func:`flat_size` is the length of an observation once :func:`flatten` has
concatenated its leaves (the reference agents' input width).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import gymnasium as gym
import numpy as np
import torch
from tensordict import TensorDict

from rl_replay.errors import SetupError

__all__ = [
    "obs_converter",
    "flat_size",
    "flatten",
    "check_observation_space",
    "leaf_keys",
    "leaf_scales",
    "leaf_event_dims",
    "usable_keys",
]

Converter = Callable[[Any], "torch.Tensor | TensorDict"]


def _children(space: gym.Space) -> list[tuple[str, gym.Space]]:
    """(key, subspace) in the fixed order used everywhere: Dict order, Tuple index."""
    if isinstance(space, gym.spaces.Dict):
        return [(str(k), s) for k, s in space.spaces.items()]
    assert isinstance(space, gym.spaces.Tuple), space
    return [(str(i), s) for i, s in enumerate(space.spaces)]


def check_observation_space(space: gym.Space, who: str = "rl_replay") -> None:
    """Raise SetupError for observation spaces the converter cannot handle."""
    if isinstance(space, (gym.spaces.Dict, gym.spaces.Tuple)):
        if not _children(space):
            raise SetupError(f"{who}: empty {type(space).__name__} observation space {space}.")
        for _, sub in _children(space):
            check_observation_space(sub, who)
        return
    if not isinstance(space, (gym.spaces.Box, gym.spaces.Discrete, gym.spaces.MultiDiscrete, gym.spaces.MultiBinary)):
        raise SetupError(
            f"{who} cannot handle observation space {space}: supported are Box, Discrete, "
            "MultiDiscrete, MultiBinary and Dict/Tuple of those. Add a wrapper in env.wrappers that "
            f"makes arrays of it ({_WRAPPER_HINT}) or one of your own."
        )


# Wrappers named when an observation space holds nothing a tensor can carry.
_WRAPPER_HINT = (
    "for MiniGrid {target: minigrid.wrappers:ImgObsWrapper}; a Dict's non-tensor keys are dropped "
    "by themselves, or chosen with env.observation_keys"
)


def _is_usable(space: gym.Space) -> bool:
    try:
        check_observation_space(space)
    except SetupError:
        return False
    return True


def usable_keys(space: gym.Space, selected: list[str] | None = None) -> tuple[list[str], list[str]] | None:
    """The top-level Dict keys to keep, and those dropped: ``(kept, dropped)``.

    ``selected`` (``env.observation_keys``) keeps exactly those keys; without it every key
    whose subspace converts to tensors is kept and the others (MiniGrid's ``mission`` text)
    are dropped. None when the space needs no selection. SetupError for a selection of keys
    the space lacks or cannot convert, a selection on a space that is not a Dict, and a space
    with nothing usable.
    """
    if selected:
        if not isinstance(space, gym.spaces.Dict):
            raise SetupError(
                f"env.observation_keys {selected} selects keys of a Dict observation, but the "
                f"observation space is {space}; remove env.observation_keys."
            )
        keys = [str(k) for k in space.spaces]
        missing = [k for k in selected if k not in keys]
        if missing:
            raise SetupError(f"env.observation_keys: {missing} not in the observation space's keys {keys}.")
        bad = [k for k in selected if not _is_usable(space.spaces[k])]
        if bad:
            raise SetupError(
                f"env.observation_keys: {bad} are not tensor spaces ({space.spaces[bad[0]]}); "
                f"choose among {[k for k in keys if _is_usable(space.spaces[k])]}."
            )
        return list(selected), [k for k in keys if k not in selected]
    if _is_usable(space):
        return None
    if isinstance(space, gym.spaces.Dict):
        kept = [str(k) for k, sub in space.spaces.items() if _is_usable(sub)]
        dropped = [str(k) for k in space.spaces if str(k) not in kept]
        if kept:
            return kept, dropped
    raise SetupError(
        f"the observation space {space} holds nothing rl_replay can turn into tensors; add a wrapper "
        f"in env.wrappers that makes arrays of it ({_WRAPPER_HINT})."
    )


def obs_converter(space: gym.Space, device: torch.device | str = "cpu") -> Converter:
    """A function turning a batch of observations of ``space`` (leading dim N) into tensors.

    The function is built once per space so the collector's per-step cost is one
    ``as_tensor`` (plus a one-hot for discrete spaces) per leaf.
    """
    check_observation_space(space)
    device = torch.device(device)
    if isinstance(space, (gym.spaces.Dict, gym.spaces.Tuple)):
        parts = [(key, obs_converter(sub, device)) for key, sub in _children(space)]
        is_dict = isinstance(space, gym.spaces.Dict)

        def convert_nested(obs):
            leaves = {key: fn(obs[key] if is_dict else obs[int(key)]) for key, fn in parts}
            n = next(iter(leaves.values())).shape[0]
            return TensorDict(leaves, batch_size=[n], device=None)

        return convert_nested
    if isinstance(space, gym.spaces.Discrete):
        n, start = int(space.n), int(space.start)

        def convert_discrete(obs):
            index = torch.as_tensor(np.asarray(obs), dtype=torch.int64, device=device) - start
            return torch.nn.functional.one_hot(index, n).to(torch.float32)

        return convert_discrete
    if isinstance(space, gym.spaces.MultiDiscrete):
        nvec = space.nvec.reshape(-1)
        offsets = torch.as_tensor(np.concatenate([[0], np.cumsum(nvec)[:-1]]), device=device)
        start = torch.as_tensor(space.start.reshape(-1), device=device)  # type: ignore[assignment]
        total = int(nvec.sum())

        def convert_multi(obs):
            index = torch.as_tensor(np.asarray(obs), dtype=torch.int64, device=device)
            index = index.reshape(index.shape[0], -1) - start + offsets  # (N, k) positions
            out = torch.zeros(index.shape[0], total, device=device)
            return out.scatter_(1, index, 1.0)

        return convert_multi
    dtype = torch.uint8 if isinstance(space, gym.spaces.Box) and space.dtype == np.uint8 else torch.float32

    def convert_box(obs):
        return torch.as_tensor(np.asarray(obs), dtype=dtype, device=device)

    return convert_box


def flat_size(space: gym.Space) -> int:
    """Number of features of one observation after conversion and :func:`flatten`."""
    check_observation_space(space)
    if isinstance(space, (gym.spaces.Dict, gym.spaces.Tuple)):
        return sum(flat_size(sub) for _, sub in _children(space))
    if isinstance(space, gym.spaces.Discrete):
        return int(space.n)
    if isinstance(space, gym.spaces.MultiDiscrete):
        return int(space.nvec.sum())
    return int(math.prod(space.shape or ()))


def leaf_keys(space: gym.Space) -> list[tuple[str, ...]]:
    """The nested keys of a Dict/Tuple space's leaves, in flattening order (``[()]`` otherwise)."""
    if isinstance(space, (gym.spaces.Dict, gym.spaces.Tuple)):
        return [(key, *rest) for key, sub in _children(space) for rest in leaf_keys(sub)]
    return [()]


def leaf_scales(space: gym.Space) -> list[float]:
    """Per leaf (in :func:`leaf_keys` order): ``1/255`` for a uint8 image Box (high 255), else 1."""
    if isinstance(space, (gym.spaces.Dict, gym.spaces.Tuple)):
        return [scale for _, sub in _children(space) for scale in leaf_scales(sub)]
    image = isinstance(space, gym.spaces.Box) and space.dtype == np.uint8 and bool(np.all(space.high == 255))
    return [1.0 / 255.0 if image else 1.0]


def leaf_event_dims(space: gym.Space) -> list[int]:
    """Per leaf (in :func:`leaf_keys` order): how many trailing dimensions one observation of it
    has once converted (1 for a one-hot, the shape's length for a Box); the dimensions before
    them are batch dimensions, ``(N,)`` or ``(k, N)``."""
    if isinstance(space, (gym.spaces.Dict, gym.spaces.Tuple)):
        return [d for _, sub in _children(space) for d in leaf_event_dims(sub)]
    if isinstance(space, (gym.spaces.Discrete, gym.spaces.MultiDiscrete)):
        return [1]
    return [len(space.shape or ())]


def flatten(
    observation: torch.Tensor | TensorDict,
    keys: list[tuple[str, ...]] | None = None,
    scales: list[float] | None = None,
    event_dims: list[int] | None = None,
) -> torch.Tensor:
    """``(*batch, features)`` float32: the observation's leaves flattened and concatenated.

    ``keys`` (from :func:`leaf_keys`) fixes the order of a nested observation's leaves;
    without it the TensorDict's own key order is used. Leaves become float32 here, inside
    the agent, so uint8 images stay uint8 in the saved block inputs; ``scales`` (from
    :func:`leaf_scales`) multiplies each leaf, e.g. ``1/255`` for images. ``event_dims`` (from
    :func:`leaf_event_dims`) tells the batch dimensions, ``(N,)`` or ``(k, N)``, from one
    observation's; without it the first dimension is the only batch dimension.
    """
    if isinstance(observation, torch.Tensor):
        leaves = [observation]
    elif keys is None:
        leaves = [observation.get(k) for k in observation.keys(include_nested=True, leaves_only=True)]
    else:
        leaves = [observation.get(k) for k in keys]
    flat = []
    for i, leaf in enumerate(leaves):
        batch = leaf.shape[:1] if event_dims is None else leaf.shape[: leaf.dim() - event_dims[i]]
        x = leaf.reshape(*batch, -1).to(torch.float32)
        if scales is not None and scales[i] != 1.0:
            x = x * scales[i]
        flat.append(x)
    return flat[0] if len(flat) == 1 else torch.cat(flat, dim=-1)
