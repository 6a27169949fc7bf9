"""The Agent contract: one call over ``(k, N)`` rows, what a replay block calls.

An agent has one call, ``forward(observation, state, is_first)``, over ``k`` consecutive steps
of ``N`` environments (acting is ``k = 1``; a replay block of a stored rollout is ``k`` up to
``replay.block_steps``):

==============  ===============================================================
``observation``  ``(k, N, *obs_shape)`` float32 (uint8 for uint8 images; one-hot
                 float32 for Discrete/MultiDiscrete), or a nested TensorDict ``[k, N]``
                 for Dict/Tuple spaces (see :mod:`rl_replay.spaces`)
``state``        TensorDict ``[N]``: the recurrent state before row 0 (empty if stateless)
``is_first``     ``(k, N)`` ``torch.bool`` on the policy's device: the row's observation
                 starts a new episode. Recurrent agents zero their state there,
                 *inside* the call (:meth:`Agent.reset_state`), so collection and
                 replay run the same code and no gradient crosses episodes.
==============  ===============================================================

``forward`` returns ``TensorDict(outputs=..., state=..., batch_size=[])``
(:meth:`Agent.output` builds it): ``outputs`` a TensorDict ``[k, N]`` with ``dist`` (the
action distribution's *parameters* as tensors, e.g. a TensorDict with ``logits``: not a
``torch.distributions`` object, since a replay block's outputs must be tensors) and ``value``
``(k, N)``; ``state`` the state after the last row (the keys, shapes and dtypes of
:meth:`Agent.initial_state`'s). :meth:`Agent.distribution` turns ``dist`` into a
``torch.distributions`` object. An agent written one step at a time subclasses
:class:`StepwiseAgent` instead. :func:`rl_replay.contract.check_agent` checks all of this once
before a run starts.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import gymnasium as gym
import numpy as np
import torch
from tensordict import TensorDict
from torch import nn

from rl_replay import _compat
from rl_replay.errors import SetupError, one_line, shown
from rl_replay.registry import AGENTS
from rl_replay.spaces import (
    check_observation_space,
    flat_size,
    flatten,
    leaf_event_dims,
    leaf_keys,
    leaf_scales,
    obs_converter,
)
from rl_replay.targets import OWN, Importer, canonical_target

__all__ = [
    "Agent",
    "StepwiseAgent",
    "Policy",
    "ActionHead",
    "MultiCategorical",
    "value_head",
    "AGENTS",
    "load_agent_class",
    "canonical_agent_target",
    "build_agent",
]


class MultiCategorical(torch.distributions.Distribution):
    """Independent categoricals for a MultiDiscrete action space (log-probs add up)."""

    arg_constraints: dict = {}

    def __init__(self, logits: torch.Tensor, nvec: tuple[int, ...]) -> None:
        self.nvec = nvec
        self.parts = [
            torch.distributions.Categorical(logits=part, validate_args=False) for part in logits.split(nvec, dim=-1)
        ]
        super().__init__(batch_shape=logits.shape[:-1], validate_args=False)

    def sample(self, sample_shape=torch.Size()) -> torch.Tensor:  # noqa: B008 (immutable, as in torch.distributions)
        return torch.stack([d.sample(sample_shape) for d in self.parts], dim=-1)

    @property
    def mode(self) -> torch.Tensor:
        return torch.stack([d.probs.argmax(-1) for d in self.parts], dim=-1)

    def log_prob(self, value: torch.Tensor) -> torch.Tensor:
        return sum(d.log_prob(v) for d, v in zip(self.parts, value.unbind(-1)))

    def entropy(self) -> torch.Tensor:
        return sum(d.entropy() for d in self.parts)


class ActionHead(nn.Module):
    """Maps features to the distribution parameters of a gymnasium action space.

    * ``Discrete(n)`` → ``logits`` ``(N, n)``, a Categorical;
    * ``MultiDiscrete(nvec)`` → ``logits`` ``(N, sum(nvec))``, independent Categoricals;
    * ``Box(shape)`` → ``loc`` and ``scale`` ``(N, prod(shape))``, a diagonal Normal with
      a state-independent learned log-std (computed inside forward, so FSDP sees it).
    """

    def __init__(self, action_space: gym.Space, in_features: int, init_std: float = 0.01) -> None:
        super().__init__()
        check_action_space(action_space)
        self.action_space = action_space
        if isinstance(action_space, gym.spaces.Discrete):
            out = int(action_space.n)
        elif isinstance(action_space, gym.spaces.MultiDiscrete):
            out = int(np.sum(action_space.nvec))
        else:
            out = int(math.prod(action_space.shape or ()))
            self.log_std = nn.Parameter(torch.zeros(out))
        self.linear = nn.Linear(in_features, out)
        nn.init.orthogonal_(self.linear.weight, gain=init_std)
        nn.init.zeros_(self.linear.bias)

    def forward(self, features: torch.Tensor) -> TensorDict:
        x = self.linear(features)
        n = features.shape[:-1]
        if isinstance(self.action_space, gym.spaces.Box):
            return TensorDict(loc=x, scale=self.log_std.exp().expand_as(x), batch_size=n)
        return TensorDict(logits=x, batch_size=n)

    def distribution(self, dist: TensorDict) -> torch.distributions.Distribution:
        # Parameters come straight from the network, so argument validation (a per-step
        # cost in the collector's hot loop) checks nothing useful.
        space = self.action_space
        if isinstance(space, gym.spaces.Discrete):
            return torch.distributions.Categorical(logits=dist["logits"], validate_args=False)
        if isinstance(space, gym.spaces.MultiDiscrete):
            return MultiCategorical(dist["logits"], tuple(int(n) for n in space.nvec.reshape(-1)))
        normal = torch.distributions.Normal(dist["loc"], dist["scale"], validate_args=False)
        return torch.distributions.Independent(normal, 1, validate_args=False)


def value_head(in_features: int) -> nn.Linear:
    """A critic output layer: ``Linear(in_features, 1)``, orthogonal init (gain 1), zero bias."""
    linear = nn.Linear(in_features, 1)
    nn.init.orthogonal_(linear.weight, gain=1.0)
    nn.init.zeros_(linear.bias)
    return linear


def check_action_space(space: gym.Space, agent_name: str = "Agent") -> None:
    """Raise SetupError unless ``space`` is Discrete, MultiDiscrete or a flat-able Box."""
    if isinstance(space, gym.spaces.MultiDiscrete) and space.nvec.ndim != 1:
        raise SetupError(f"{agent_name} supports 1-D MultiDiscrete action spaces, got {space}.")
    if not isinstance(space, (gym.spaces.Discrete, gym.spaces.MultiDiscrete, gym.spaces.Box)):
        raise SetupError(
            f"{agent_name} cannot handle action space {space}: supported are Discrete, "
            "MultiDiscrete and Box. Wrap the environment (e.g. gymnasium.wrappers.FlattenObservation "
            "for observations, or a custom ActionWrapper) or write an Agent with its own head."
        )


class Agent(nn.Module):
    """Base class for policies trained by rl_replay: one call over ``(k, N)`` rows.

    Subclass it, build your network in ``__init__`` (call ``super().__init__(observation_space,
    action_space)`` first) and implement :meth:`forward`. Override :meth:`initial_state` for a
    recurrent policy. ``self.head`` (an :class:`ActionHead`) and :meth:`distribution` handle the
    action space for you. A policy written for one step at a time subclasses
    :class:`StepwiseAgent` and implements ``step`` instead.

    Example::

        class MyAgent(rl_replay.Agent):
            def __init__(self, observation_space, action_space, hidden: int = 64):
                super().__init__(observation_space, action_space)
                self.body = nn.Sequential(nn.Linear(self.obs_dim, hidden), nn.Tanh())
                self.head = ActionHead(action_space, hidden)
                self.critic = nn.Linear(hidden, 1)

            def forward(self, observation, state, is_first):  # (k, N, ...) rows
                x = self.body(self.flatten_observation(observation))  # (k, N, hidden)
                return self.output(dist=self.head(x), value=self.critic(x).squeeze(-1), state=state)

    Any observation space of :mod:`rl_replay.spaces` works: ``self.obs_dim`` is the width of
    :meth:`flatten_observation`'s output; an agent that wants the keys of a Dict observation
    (e.g. an image encoder plus a vector) reads them from the TensorDict instead.

    Select it from a config with ``agent.target=my_pkg.policies:MyAgent`` (the reference
    agents have short names, :data:`AGENTS`).
    """

    #: The block-input keys this agent's forward takes as keyword arguments.
    in_keys: tuple[str, ...] = ("observation", "state", "is_first")
    #: The action head :meth:`distribution` asks (set by the subclass's ``__init__``).
    head: ActionHead

    def __init__(self, observation_space: gym.Space, action_space: gym.Space) -> None:
        super().__init__()
        check_observation_space(observation_space, type(self).__name__)
        check_action_space(action_space, type(self).__name__)
        self.observation_space = observation_space
        self.action_space = action_space
        self.obs_dim = flat_size(observation_space)
        nested = isinstance(observation_space, (gym.spaces.Dict, gym.spaces.Tuple))
        self._obs_keys = leaf_keys(observation_space) if nested else None
        self._obs_scales = leaf_scales(observation_space)
        self._obs_event_dims = leaf_event_dims(observation_space)

    def flatten_observation(self, observation: torch.Tensor | TensorDict) -> torch.Tensor:
        """``(*batch, obs_dim)`` float32 (``batch`` is ``(k, N)`` in :meth:`forward`, ``(N,)`` in a
        :class:`StepwiseAgent`'s step): the leaves in the space's fixed key order, flattened and
        concatenated; uint8 images become floats in ``[0, 1]`` here, not in the saved inputs."""
        return flatten(observation, self._obs_keys, self._obs_scales, self._obs_event_dims)

    def initial_state(self, batch_size: int, device: torch.device | str = "cpu") -> TensorDict:
        """The recurrent state at the start of an episode: empty for stateless agents."""
        return TensorDict({}, batch_size=[batch_size], device=None)

    def forward(self, observation: torch.Tensor, state: TensorDict, is_first: torch.Tensor) -> TensorDict:
        """k consecutive steps of the policy for ``N`` envs (one replay block; acting is k = 1).

        Args:
            observation: ``(k, N, *obs_shape)`` (float32; uint8 images stay uint8, Discrete
                observations are one-hot float32), or a TensorDict ``[k, N]`` for Dict/Tuple spaces.
            state: TensorDict ``[N]``, the state before row 0 (at an episode's start:
                :meth:`initial_state`).
            is_first: ``(k, N)`` ``torch.bool`` on the policy's device, True where the row's
                observation starts a new episode. A recurrent agent must reset its state
                there before row t uses it (:meth:`reset_state`), or memory and gradient
                cross episode boundaries.

        Returns:
            ``TensorDict(outputs=..., state=..., batch_size=[])`` (:meth:`output`):

            * ``outputs``: a TensorDict ``[k, N]``, row t for step t, with ``dist``, the action
              distribution's parameters as tensors, e.g. ``self.head(x)`` (a TensorDict with
              ``logits``, or ``loc`` and ``scale``; never a ``torch.distributions`` object:
              :meth:`distribution` builds that), and ``value``, ``(k, N)`` float;
            * ``state``: the state after the last row, with the keys, shapes and dtypes of
              :meth:`initial_state` (an empty TensorDict ``[N]`` for a stateless agent).

        It must not modify parameters or buffers (a block's forward runs twice: once to
        collect, once again in backward), and a call over k rows must agree with k calls over
        one row each to float rounding, resets inside the rows included.
        """
        raise NotImplementedError(f"{type(self).__name__} must implement forward()")

    @staticmethod
    def output(dist: TensorDict, value: torch.Tensor, state: TensorDict, **extra: Any) -> TensorDict:
        """What :meth:`forward` returns: ``dist`` and ``value`` (and any ``extra`` outputs) over the
        ``(k, N)`` rows, and the ``state`` after the last row."""
        outputs = TensorDict(dist=dist, value=value, **extra, batch_size=value.shape)
        return TensorDict(outputs=outputs, state=state, batch_size=[])

    def distribution(self, outputs: TensorDict) -> torch.distributions.Distribution:
        """The action distribution for ``outputs`` (of any batch size): :meth:`forward`'s ``outputs``."""
        return self.head.distribution(outputs["dist"])

    @staticmethod
    def reset_state(state: torch.Tensor, is_first: torch.Tensor) -> torch.Tensor:
        """Zero ``state`` rows where an episode starts (the gradient to the old state is 0).

        ``state`` is ``(N, ...)``, ``is_first`` one row's ``(N,)`` bool (``is_first[t]``).
        """
        keep = (~is_first).to(state.dtype)
        return state * keep.view(-1, *([1] * (state.dim() - 1)))


class StepwiseAgent(Agent):
    """An agent written one step at a time: implement :meth:`step`; :meth:`forward` is its loop.

    The adapter for a policy that has no call over several steps (a one-step ``forward`` as
    written for rl_replay before the one agent shape). It owns the step loop: :meth:`forward`
    runs :meth:`step` row by row and stacks the outputs but the state; and a replay block of k
    stored steps calls the agent one step at a time (``rl_replay.algorithms.stored``), so the
    block's backward recomputes and back-propagates step by step, as plain autograd runs the loop.

    Example::

        class MyAgent(rl_replay.StepwiseAgent):
            def step(self, observation, state, is_first):  # (N, ...) rows
                x = self.body(self.flatten_observation(observation))
                return TensorDict(dist=self.head(x), value=self.critic(x).squeeze(-1),
                                  state=state, batch_size=is_first.shape)
    """

    def step(self, observation: torch.Tensor, state: TensorDict, is_first: torch.Tensor) -> TensorDict:
        """One step for ``N`` envs: ``observation`` ``(N, *obs_shape)`` (or a TensorDict ``[N]``),
        ``state`` ``[N]``, ``is_first`` ``(N,)``; returns a TensorDict ``[N]`` with ``dist``,
        ``value`` ``(N,)`` and the next ``state`` (reset where ``is_first`` is set first)."""
        raise NotImplementedError(f"{type(self).__name__} must implement step()")

    def forward(self, observation, state: TensorDict, is_first: torch.Tensor) -> TensorDict:
        return step_loop(self.step, observation, state, is_first)


def step_loop(step: Any, observation, state: TensorDict, is_first: torch.Tensor) -> TensorDict:
    """The one step loop: ``step`` (a :meth:`StepwiseAgent.step`) on each of the ``(k, N)`` rows in
    turn, the state flowing from row to row; returns :meth:`Agent.forward`'s ``outputs`` (each
    row's outputs but the state, stacked) and the last ``state``."""
    steps = []
    for t in range(is_first.shape[0]):
        out = step(observation[t], state, is_first[t])
        state = out["state"]
        steps.append(out.exclude("state"))
    return TensorDict(outputs=torch.stack(steps), state=state, batch_size=[])


@dataclass(frozen=True)
class Policy:
    """One handle on a policy: the :class:`Agent` and the module that runs it.

    ``module`` is what the engine and the collector call (under FSDP the wrapper, whose hooks
    gather the parameters; otherwise the agent itself); ``agent`` is the :class:`Agent` inside it,
    asked for what is not a forward (``initial_state``, ``distribution``). Code that needs both
    passes one ``Policy`` instead of the pair.
    """

    module: nn.Module
    agent: Agent

    @classmethod
    def of(cls, module: nn.Module | Policy) -> Policy:
        """The handle of ``module`` (an agent, or a wrapper holding it as ``.module``)."""
        if isinstance(module, Policy):
            return module
        agent = getattr(module, "module", module)
        if not isinstance(agent, Agent):
            raise TypeError(f"{type(agent).__name__} is not an rl_replay.Agent (nor a wrapper holding one as .module)")
        return cls(module, agent)


def load_agent_class(target: str, importer: Importer = OWN) -> type[Agent]:
    """The :class:`Agent` subclass named by ``target``: a short name of :data:`AGENTS`
    (``gru``) or an import path ``package.module:ClassName``, imported through ``importer``."""
    cls = importer.resolve(target, "agent.target", AGENTS)
    if not (isinstance(cls, type) and issubclass(cls, Agent)):
        raise SetupError(f"agent.target {shown(target)} is {shown(cls)}, not a subclass of rl_replay.Agent.")
    return cls


def canonical_agent_target(target: str) -> str:
    """``module:Class`` of the class ``target`` names, so that ``gru``, ``agents.gru:GRUAgent``
    and ``rl_replay.agents.gru:GRUAgent`` compare equal (a resume checks the agent is unchanged)."""
    return canonical_target(target, AGENTS)


def build_agent(
    target: str, kwargs: dict[str, Any], observation_space, action_space, importer: Importer = OWN
) -> Agent:
    """Instantiate the agent named by ``target`` (imported through ``importer``) for the given spaces."""
    cls = load_agent_class(target, importer)
    try:
        agent = cls(observation_space, action_space, **kwargs)
    except SetupError:
        raise
    except (TypeError, ValueError, RuntimeError, OverflowError) as exc:
        # (a negative or absurd size reaches torch as "negative dimension" or an allocator error)
        raise SetupError(
            f"agent.target {shown(target)} rejected agent.kwargs {shown(kwargs)}: {one_line(str(exc))[:300]}"
        ) from None
    # An agent written to the docs before the one agent shape (a one-step forward) runs
    # through the StepwiseAgent adapter, with a DeprecationWarning, until _compat.REMOVED_IN.
    return _compat.one_step_agent(agent, StepwiseAgent, step_loop, _two_rows(observation_space))


def _two_rows(space: gym.Space) -> torch.Tensor | TensorDict | None:
    """Two observations of ``space`` (a seeded sample), converted as the collector converts them."""
    try:
        batched = gym.vector.utils.batch_space(space, 2)
        batched.seed(0)
        return obs_converter(space)(batched.sample())
    except Exception:  # a space the agent refuses reaches the user through check_agent
        return None
