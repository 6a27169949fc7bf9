"""Check an agent against the Agent contract with one forward, before a run exists.

:func:`check_agent` runs the agent's forward once (without grad) on the first step of a fresh
env reset, a one-row call (``(1, N)`` rows), and checks what the collector and the losses rely
on: ``outputs`` of batch size ``[1, N]`` with ``value`` of shape ``(1, N)``, a ``state`` TensorDict of batch size ``[N]`` with the keys, shapes and dtypes of
``initial_state`` (the next block takes it as its input), ``dist`` a TensorDict of
distribution parameters (not a ``torch.distributions`` object), a distribution that
:meth:`~rl_replay.Agent.distribution` can build whose samples fit the action space, no
change to the agent's buffers or parameters (the replay engine's own check, which catches
BatchNorm in training mode), and the reset: the same first block (``is_first`` set) run
again on a perturbed incoming state must give the same outputs, else the agent carries
memory (and gradient) across episode boundaries. Every violation is a one-line
:class:`~rl_replay.errors.SetupError`.
"""

from __future__ import annotations

import re

import gymnasium as gym
import numpy as np
import torch
from tensordict import TensorDictBase

from rl_replay.engine import StateWatch
from rl_replay.errors import SetupError

__all__ = ["check_agent"]


# The reset check: the incoming state is moved by standard normal noise (O(1), where a
# recurrent state lives), and an output counts as depending on it if it moves by more than
# this. A reset agent computes on the same reset state both times (the same RNG state too),
# so its outputs agree to the bit or to rounding; 1e-4 is far above rounding in float32
# and far below what an O(1) change of a state that is used does to the next state.
RESET_TOLERANCE = 1e-4


def _shape(t) -> str:
    return str(tuple(t.shape)) if isinstance(t, torch.Tensor) else type(t).__name__


def _leaves(td: TensorDictBase) -> dict[str, torch.Tensor]:
    return {".".join(k) if isinstance(k, tuple) else k: v for k, v in td.items(include_nested=True, leaves_only=True)}  # type: ignore[misc]


def check_agent(model: torch.nn.Module, agent, inputs: TensorDictBase, action_space: gym.Space, target: str) -> None:
    """Raise SetupError if ``agent``'s outputs on ``inputs`` (a one-row call) break the Agent contract.

    ``model`` is what the collector calls (the FSDP wrapper under FSDP, else ``agent``).
    The RNG streams are left as they were.
    """
    n = inputs["is_first"].shape[-1]
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
        if "outputs" not in keys or "state" not in keys:
            raise SetupError(
                f"{where}: forward() returned keys {keys}; expected 'outputs' (the (k, N) rows' 'dist' and "
                "'value') and 'state' (the state after the last row): return Agent.output(dist=..., value=..., "
                "state=...), or subclass rl_replay.StepwiseAgent for a forward of one step."
            )
        outputs, state = out["outputs"], out["state"]
        if not isinstance(outputs, TensorDictBase) or tuple(outputs.batch_size) != (1, n):
            shown = tuple(outputs.batch_size) if isinstance(outputs, TensorDictBase) else type(outputs).__name__
            raise SetupError(
                f"{where}: forward() returned 'outputs' {shown} for one row of {n} envs; expected a "
                f"TensorDict of batch size [1, {n}] (the (k, N) rows of the call)."
            )
        keys = sorted(outputs.keys())
        if "value" not in keys:
            raise SetupError(
                f"{where}: forward() returned outputs {keys} without 'value' (expected 'dist' and 'value')."
            )
        value = outputs["value"]
        if not isinstance(value, torch.Tensor) or tuple(value.shape) != (1, n):
            raise SetupError(
                f"{where}: forward() returned 'value' of shape {_shape(value)}; expected (1, {n}), "
                "one value per row and env (e.g. critic(x).squeeze(-1))."
            )
        if not isinstance(state, TensorDictBase) or tuple(state.batch_size) != (n,):
            shown = tuple(state.batch_size) if isinstance(state, TensorDictBase) else type(state).__name__
            raise SetupError(
                f"{where}: forward() returned 'state' {shown}; expected a TensorDict of "
                f"batch size [{n}] (an empty one for a stateless agent)."
            )
        if "dist" in keys and isinstance(outputs["dist"], torch.distributions.Distribution):
            raise SetupError(
                f"{where}: forward() returned 'dist' as a torch.distributions {type(outputs['dist']).__name__}; "
                "return its parameters instead (a TensorDict such as self.head(x), e.g. TensorDict(logits=...)) and "
                "let distribution() build the object: a replay block's outputs must be tensors."
            )
        _check_state_structure(state, inputs["state"], where, wrapped=model is not agent)
        try:
            dist = agent.distribution(outputs)
        except KeyError as exc:
            # TensorDict's message is 'key "dist" not found in TensorDict with keys [...]'.
            found = re.search(r'key "([^"]+)"', str(exc))
            missing = repr(found.group(1)) if found else str(exc)
            raise SetupError(
                f"{where}: distribution() needs key {missing} but forward() returned outputs {keys}."
            ) from None
        _check_distribution(dist, action_space, n, where)
        _check_reset(model, inputs, where)


def _check_state_structure(state: TensorDictBase, initial: TensorDictBase, where: str, wrapped: bool) -> None:
    """The returned state has the keys, shapes and dtypes of ``initial_state`` (FSDP's mixed
    precision may cast a floating state to another floating dtype)."""
    ours, theirs = _leaves(state), _leaves(initial)
    if sorted(ours) != sorted(theirs):
        raise SetupError(
            f"{where}: forward() returned 'state' with keys {sorted(ours)} but initial_state() has "
            f"{sorted(theirs)}; the next block takes the returned state as its input, so return the "
            "same keys."
        )
    for key, value in ours.items():
        first = theirs[key]
        if value.shape != first.shape:
            raise SetupError(
                f"{where}: forward() returned state '{key}' of shape {_shape(value)} but initial_state() "
                f"gives {_shape(first)}; the next block takes the returned state as its input, so "
                "return the shapes of initial_state (or change initial_state)."
            )
        floats = value.is_floating_point() and first.is_floating_point()
        if value.dtype != first.dtype and not (wrapped and floats):
            raise SetupError(
                f"{where}: forward() returned state '{key}' of dtype {value.dtype} but initial_state() "
                f"gives {first.dtype}; return the dtypes of initial_state (or change initial_state)."
            )


def _check_reset(model: torch.nn.Module, inputs: TensorDictBase, where: str) -> None:
    """With ``is_first`` set everywhere, outputs must not depend on the incoming state."""
    state = inputs["state"]
    floats = [(k, v) for k, v in state.items(include_nested=True, leaves_only=True) if v.is_floating_point()]
    if not floats or not bool(inputs["is_first"].all()):
        return
    generator = torch.Generator().manual_seed(0)
    perturbed = state.clone()
    for key, value in floats:
        noise = torch.randn(value.shape, generator=generator, dtype=torch.float32)
        perturbed[key] = value + noise.to(value.device, value.dtype)
    outputs = []
    for incoming in (state, perturbed):
        torch.manual_seed(0)  # the same random numbers for both (dropout, noisy layers)
        outputs.append(_leaves(model(**inputs.clone(False).update({"state": incoming}))))
    moved = sorted(
        key
        for key, value in outputs[0].items()
        if value.is_floating_point()
        and not torch.allclose(value, outputs[1][key], rtol=RESET_TOLERANCE, atol=RESET_TOLERANCE)
    )
    if moved:
        raise SetupError(
            f"{where}: with is_first set (every env starts an episode), forward()'s outputs {moved} depend on the "
            "incoming state: reset it before using it, state = Agent.reset_state(state, is_first) (zeros where an "
            "episode starts), or memory and gradient cross episode boundaries."
        )


def _check_distribution(dist, space: gym.Space, n: int, where: str) -> None:
    if isinstance(space, gym.spaces.Discrete):
        logits = getattr(dist, "logits", None)
        if logits is not None and logits.shape[-1] != int(space.n):
            raise SetupError(
                f"{where}: its action distribution has {logits.shape[-1]} logits but the action "
                f"space {space} has {int(space.n)} actions."
            )
    elif isinstance(space, gym.spaces.MultiDiscrete):
        parts = getattr(dist, "parts", None)
        if parts is not None:
            widths = [int(p.logits.shape[-1]) for p in parts]
            nvec = [int(k) for k in np.asarray(space.nvec).reshape(-1)]
            if widths != nvec:
                raise SetupError(
                    f"{where}: its action distribution has logits of widths {widths} but the "
                    f"action space {space} needs {nvec}."
                )
    action = dist.sample()
    if action.shape[:2] != (1, n):
        raise SetupError(
            f"{where}: actions sampled from its distribution have shape {_shape(action)}; "
            f"expected one per row and env (1, {n}, ...)."
        )
    per_env = tuple(action.shape[2:])
    if isinstance(space, gym.spaces.Box):
        ok = per_env in (tuple(space.shape), (int(np.prod(space.shape)),))
    elif isinstance(space, gym.spaces.MultiDiscrete):
        ok = per_env == (int(np.prod(space.nvec.shape)),)
    elif isinstance(space, gym.spaces.Discrete):
        ok = per_env == ()
    else:
        ok = True
    if not ok:
        raise SetupError(f"{where}: sampled actions of shape {_shape(action)} do not fit the action space {space}.")
    for name in ("log_prob", "entropy"):
        value = dist.log_prob(action) if name == "log_prob" else dist.entropy()
        if tuple(value.shape) != (1, n):
            raise SetupError(f"{where}: its distribution's {name} has shape {_shape(value)}; expected (1, {n}).")
