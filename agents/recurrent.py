"""The one skeleton of the recurrent agents: encoder -> core -> readout -> actor and critic heads.

Every shipped recurrent agent (GRU, LSTM, LRU, minGRU) is this class with its own core
(:mod:`rl_replay.agents.cores`); the encoders (an MLP over :meth:`~rl_replay.Agent.flatten_observation`,
or a CNN of :mod:`rl_replay.agents.encoders`) and so every observation space (Box, Dict,
Discrete, uint8 images) work with every core.

Its one call runs k steps (:meth:`RecurrentAgent.forward`): the encoder, the readout and the
heads see the ``k * N`` rows at once, and only the core's recurrence goes step by step. Acting
is the same code with k = 1.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from tensordict import TensorDict
from torch import nn

from rl_replay.agent import ActionHead, Agent, value_head
from rl_replay.agents.cores import Core
from rl_replay.agents.encoders import make_encoder, takes_raw_observation
from rl_replay.agents.mlp import mlp
from rl_replay.errors import SetupError

ACTIVATIONS = {"tanh": nn.Tanh, "relu": nn.ReLU}


def activation_class(name: str, agent_name: str) -> type[nn.Module]:
    """The module class for ``name`` ("tanh" or "relu"); SetupError otherwise."""
    if name not in ACTIVATIONS:
        raise SetupError(f"{agent_name}: activation must be one of {sorted(ACTIVATIONS)}, got {name!r}.")
    return ACTIVATIONS[name]


class RecurrentAgent(Agent):
    """Encoder -> core (``self.core``) -> readout -> ``actor_mlp`` / ``critic_mlp`` -> ``head`` / ``value``.

    A subclass passes ``make_core(in_features) -> Core``. Every state tensor is zeroed where
    ``is_first`` is set, before the step reads it, so no gradient crosses an episode boundary.

    Args:
        encoder: ``mlp`` (the flattened observation through ``encoder_sizes``) or a
            convolutional encoder, ``nature_cnn``, ``impala_cnn`` or ``grid_cnn``
            (:mod:`rl_replay.agents.encoders`): the image through the convolutions, then the
            linear layers ``encoder_sizes``; uint8 frames are converted inside forward.
        encoder_sizes: widths of the encoder's linear layers; the last is the core's input.
        encoder_kwargs: options of a convolutional encoder (``channels``, ``image_key``,
            ``image_scale``; see :class:`~rl_replay.agents.encoders.ConvEncoder`).
        activation: ``"tanh"`` or ``"relu"``, for the encoder, readout and head layers.
        skip: the readout reads the encoded observation next to the core's output. A gated
            core's state is a leaky average of past inputs, so without the skip a reactive
            task sees the present only through that lag; with it the state only has to carry
            what the present observation lacks.
        readout_sizes: a shared MLP after the core (and skip), read by both heads.
        head_sizes: hidden layers of each of the actor and critic after the readout (sb3's
            ``net_arch`` after the LSTM); empty: the outputs read the readout directly.
        separate_critic: the value comes from a second encoder and core (sb3-contrib's
            ``enable_critic_lstm``) whose state (the core's state keys with a ``_critic``
            suffix) flows alongside.
    """

    def __init__(
        self,
        observation_space,
        action_space,
        *,
        make_core: Callable[[int], Core],
        encoder: str = "mlp",
        encoder_sizes=(),
        encoder_kwargs: dict | None = None,
        activation: str = "tanh",
        skip: bool = False,
        readout_sizes=(),
        head_sizes=(),
        separate_critic: bool = False,
    ):
        super().__init__(observation_space, action_space)
        self.activation = activation_class(activation, type(self).__name__)
        self.skip = skip
        self.separate_critic = separate_critic
        encoder_sizes = list(encoder_sizes)
        self.encoder, width = make_encoder(self, encoder, encoder_sizes, self.activation, encoder_kwargs)
        self.core = make_core(width)
        self.state_keys = tuple(self.core.state_keys)
        if separate_critic:
            # The critic's own encoder and core: the value loss, large while returns are
            # unnormalised, then cannot drown the policy's gradient in a shared trunk.
            self.critic_encoder, _ = make_encoder(self, encoder, encoder_sizes, self.activation, encoder_kwargs)
            self.critic_core = make_core(width)
        features = self.core.out_features + (width if skip else 0)
        readout_sizes, head_sizes = list(readout_sizes), list(head_sizes)
        self.readout = mlp(features, readout_sizes, self.activation)
        features = readout_sizes[-1] if readout_sizes else features
        last = head_sizes[-1] if head_sizes else features
        self.actor_mlp = mlp(features, head_sizes, self.activation)
        self.critic_mlp = mlp(features, head_sizes, self.activation)
        self.head = ActionHead(action_space, last)
        self.value = value_head(last)

    def initial_state(self, batch_size: int, device="cpu") -> TensorDict:
        state = {k: torch.zeros(batch_size, *self.core.state_shape(k), device=device) for k in self.state_keys}
        if self.separate_critic:
            state.update({k + "_critic": torch.zeros_like(v) for k, v in state.items()})
        return TensorDict(state, batch_size=[batch_size])

    def _trunk(self, encoder, core, x, k: int, n: int, state: TensorDict, keep, suffix: str, next_state: dict):
        """Encode the ``k * n`` rows ``x``, run ``core`` over the k steps from ``state``, put
        its last state in ``next_state``; returns what the readout reads, ``(k, n, features)``."""
        e = encoder(x).unflatten(0, (k, n))
        y, last = core(e, tuple(state[key + suffix] for key in self.state_keys), keep)
        next_state.update((key + suffix, v) for key, v in zip(self.state_keys, last))
        return torch.cat([y, e], dim=-1) if self.skip else y

    def _features(self, observation, state: TensorDict, is_first: torch.Tensor):
        """What the actor and the critic MLPs read, ``(k, n, features)`` each, and the last
        state, for ``(k, n, ...)`` inputs."""
        k, n = is_first.shape
        rows = observation.flatten(0, 1)
        # A CNN reads the observation itself (uint8 images stay uint8 until its forward).
        x = rows if takes_raw_observation(self.encoder) else self.flatten_observation(rows)
        keep = (~is_first).to(torch.float32).unsqueeze(-1)  # (k, n, 1)
        next_state: dict[str, torch.Tensor] = {}
        actor_in = self.readout(self._trunk(self.encoder, self.core, x, k, n, state, keep, "", next_state))
        critic_in = actor_in
        if self.separate_critic:
            critic_in = self.readout(
                self._trunk(self.critic_encoder, self.critic_core, x, k, n, state, keep, "_critic", next_state)
            )
        return actor_in, critic_in, TensorDict(next_state, batch_size=[n])

    def _heads(self, actor_in: torch.Tensor, critic_in: torch.Tensor) -> tuple[TensorDict, torch.Tensor]:
        return self.head(self.actor_mlp(actor_in)), self.value(self.critic_mlp(critic_in)).squeeze(-1)

    def forward(self, observation, state: TensorDict, is_first: torch.Tensor) -> TensorDict:
        actor_in, critic_in, next_state = self._features(observation, state, is_first)
        dist, value = self._heads(actor_in, critic_in)
        return self.output(dist=dist, value=value, state=next_state)
