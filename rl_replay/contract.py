"""Check an agent against the Agent contract with one forward, before a run exists.

:func:`check_agent` runs the agent's forward once (without grad) on the block inputs of a fresh
env reset and checks what the collector and the losses rely on: ``value`` of shape
``(N,)``, a ``state`` TensorDict of batch size ``[N]``, a distribution that
:meth:`~rl_replay.Agent.distribution` can build whose samples fit the action space, and
no change to the agent's buffers or parameters (the replay engine's own check, which
catches BatchNorm in training mode). Every violation is a one-line
:class:`~rl_replay.errors.SetupError`.
"""

from __future__ import annotations

import re

import gymnasium as gym
import numpy as np
import torch
from tensordict import TensorDictBase

from rl_replay.errors import SetupError
from rl_replay.engine import StateWatch

__all__ = ["check_agent"]


def _shape(t) -> str:
    return str(tuple(t.shape)) if isinstance(t, torch.Tensor) else type(t).__name__


def check_agent(model: torch.nn.Module, policy, inputs: TensorDictBase, action_space: gym.Space,
                target: str) -> None:
    """Raise SetupError if ``policy``'s outputs on ``inputs`` break the Agent contract.

    ``model`` is what the collector calls (the FSDP wrapper under FSDP, else ``policy``).
    The RNG streams are left as they were.
    """
    n = inputs.batch_size[0]
    where = f"agent {target}"
    devices = [torch.cuda.current_device()] if torch.cuda.is_available() and torch.cuda.is_initialized() else []
    # The replay engine's own check of what a block must not change (buffers, and
    # parameters of a plain module). No grad: nothing is recorded, and FSDP expects no backward.
    watch = StateWatch(model)
    with torch.random.fork_rng(devices=devices), torch.no_grad():
        before = watch.versions()
        out = model(**inputs)
        changed = watch.changed(before)
        if changed:
            raise SetupError(
                f"{where}: forward() changed its {', '.join(changed)}; a replay block runs the forward "
                "twice, so it must not modify parameters or buffers (put BatchNorm in eval mode or use "
                "LayerNorm)."
            )
        if not isinstance(out, TensorDictBase):
            raise SetupError(f"{where}: forward() must return a TensorDict, got {type(out).__name__}.")
        keys = sorted(out.keys())
        for key in ("value", "state"):
            if key not in keys:
                raise SetupError(f"{where}: forward() returned keys {keys} without '{key}' "
                                 "(expected 'dist', 'value' and 'state').")
        value = out["value"]
        if not isinstance(value, torch.Tensor) or tuple(value.shape) != (n,):
            raise SetupError(f"{where}: forward() returned 'value' of shape {_shape(value)}; expected ({n},), "
                             "one value per env (e.g. critic(x).squeeze(-1)).")
        state = out["state"]
        if not isinstance(state, TensorDictBase) or tuple(state.batch_size) != (n,):
            shown = tuple(state.batch_size) if isinstance(state, TensorDictBase) else type(state).__name__
            raise SetupError(f"{where}: forward() returned 'state' {shown}; expected a TensorDict of "
                             f"batch size [{n}] (an empty one for a stateless agent).")
        try:
            dist = policy.distribution(out)
        except KeyError as exc:
            # TensorDict's message is 'key "dist" not found in TensorDict with keys [...]'.
            found = re.search(r'key "([^"]+)"', str(exc))
            missing = repr(found.group(1)) if found else str(exc)
            raise SetupError(f"{where}: distribution() needs key {missing} but forward() returned keys "
                             f"{keys}.") from None
        _check_distribution(dist, action_space, n, where)


def _check_distribution(dist, space: gym.Space, n: int, where: str) -> None:
    if isinstance(space, gym.spaces.Discrete):
        logits = getattr(dist, "logits", None)
        if logits is not None and logits.shape[-1] != int(space.n):
            raise SetupError(f"{where}: its action distribution has {logits.shape[-1]} logits but the action "
                             f"space {space} has {int(space.n)} actions.")
    elif isinstance(space, gym.spaces.MultiDiscrete):
        parts = getattr(dist, "parts", None)
        if parts is not None:
            widths = [int(p.logits.shape[-1]) for p in parts]
            nvec = [int(k) for k in np.asarray(space.nvec).reshape(-1)]
            if widths != nvec:
                raise SetupError(f"{where}: its action distribution has logits of widths {widths} but the "
                                 f"action space {space} needs {nvec}.")
    action = dist.sample()
    if action.shape[:1] != (n,):
        raise SetupError(f"{where}: actions sampled from its distribution have shape {_shape(action)}; "
                         f"expected one row per env ({n}, ...).")
    per_env = tuple(action.shape[1:])
    if isinstance(space, gym.spaces.Box):
        ok = per_env in (tuple(space.shape), (int(np.prod(space.shape)),))
    elif isinstance(space, gym.spaces.MultiDiscrete):
        ok = per_env == (int(np.prod(space.nvec.shape)),)
    elif isinstance(space, gym.spaces.Discrete):
        ok = per_env == ()
    else:
        ok = True
    if not ok:
        raise SetupError(f"{where}: sampled actions of shape {_shape(action)} do not fit the action space "
                         f"{space}.")
    for name in ("log_prob", "entropy"):
        value = dist.log_prob(action) if name == "log_prob" else dist.entropy()
        if tuple(value.shape) != (n,):
            raise SetupError(f"{where}: its distribution's {name} has shape {_shape(value)}; expected ({n},).")
