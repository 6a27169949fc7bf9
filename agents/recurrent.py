"""What the GRU and LSTM agents share: encoder (MLP or CNN) -> cell -> actor and critic heads,
with an optional critic of its own (second encoder and cell) and an optional skip path."""

from __future__ import annotations

from collections.abc import Callable

import torch
from tensordict import TensorDict
from torch import nn

from rl_replay.agent import ActionHead, Agent, value_head
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
    """Encoder (MLP or CNN) -> recurrent cell -> ``actor_mlp`` / ``critic_mlp`` -> ``head`` / ``value``.

    A subclass names its cell's state tensors in :attr:`state_keys` (the first is the
    cell's output, read by the heads), passes a ``make_cell(in_features, hidden_size)``
    factory to ``__init__`` and implements :meth:`cell_step`. Every state tensor is zeroed
    inside forward where ``is_first`` is set, so no gradient crosses an episode boundary.

    Args:
        separate_critic: the value comes from a second encoder and cell (sb3-contrib's
            ``enable_critic_lstm``) whose state (``state_keys`` with a ``_critic`` suffix)
            flows alongside.
        head_sizes: hidden layers between the cell and each of the actor and critic outputs
            (sb3's ``net_arch`` after the LSTM); empty: the outputs read the cell's output directly.
        activation: ``"tanh"`` or ``"relu"``, for the encoder and the head layers.
        skip: the actor and critic read the encoded observation next to the cell's output.
            A gated cell's state is a leaky average of past inputs, so without the skip a
            reactive task sees the present only through that lag; with it the state only
            has to carry what the present observation lacks.
        encoder: ``mlp`` (the flattened observation through ``encoder_sizes``) or a
            convolutional encoder, ``nature_cnn``, ``impala_cnn`` or ``grid_cnn``
            (:mod:`rl_replay.agents.encoders`): the image through the convolutions, then the
            linear layers ``encoder_sizes``; uint8 frames are converted inside forward.
        encoder_kwargs: options of a convolutional encoder (``channels``, ``image_key``,
            ``image_scale``; see :class:`~rl_replay.agents.encoders.ConvEncoder`).
    """

    #: the cell's state tensors in ``state``; the first is its output
    state_keys: tuple[str, ...] = ()

    def __init__(
        self,
        observation_space,
        action_space,
        *,
        hidden_size: int,
        encoder_sizes,
        separate_critic: bool,
        head_sizes,
        activation: str,
        skip: bool,
        make_cell: Callable[[int, int], nn.Module],
        encoder: str = "mlp",
        encoder_kwargs: dict | None = None,
    ):
        super().__init__(observation_space, action_space)
        self.activation = activation_class(activation, type(self).__name__)
        self.hidden_size = hidden_size
        self.separate_critic = separate_critic
        self.skip = skip
        encoder_sizes = list(encoder_sizes)
        self.encoder, self.cell, width = self._trunk(encoder, encoder_sizes, encoder_kwargs, make_cell)
        features = width if skip else 0
        if separate_critic:
            # The critic's own encoder and cell: the value loss, large while returns are
            # unnormalised, then cannot drown the policy's gradient in a shared trunk.
            self.critic_encoder, self.critic_cell, _ = self._trunk(encoder, encoder_sizes, encoder_kwargs, make_cell)
        head_sizes = list(head_sizes)
        in_features = hidden_size + features
        last = head_sizes[-1] if head_sizes else in_features
        self.actor_mlp = mlp(in_features, head_sizes, self.activation)
        self.critic_mlp = mlp(in_features, head_sizes, self.activation)
        self.head = ActionHead(action_space, last)
        self.value = value_head(last)

    def _trunk(self, name: str, encoder_sizes, options: dict | None, make_cell) -> tuple[nn.Module, nn.Module, int]:
        """``(encoder, cell, encoder output width)``."""
        encoder, width = make_encoder(self, name, encoder_sizes, self.activation, options)
        return encoder, make_cell(width, self.hidden_size), width

    def cell_step(
        self, cell: nn.Module, inputs: torch.Tensor, state: tuple[torch.Tensor, ...]
    ) -> tuple[torch.Tensor, ...]:
        """One step of ``cell``: the new state tensors, in :attr:`state_keys` order."""
        raise NotImplementedError(f"{type(self).__name__} must implement cell_step()")

    def initial_state(self, batch_size: int, device="cpu") -> TensorDict:
        keys = [*self.state_keys, *(k + "_critic" for k in self.state_keys if self.separate_critic)]
        zeros = torch.zeros(batch_size, self.hidden_size, device=device)
        return TensorDict({k: zeros.clone() for k in keys}, batch_size=[batch_size])

    def _run(self, encoder, cell, x, state: TensorDict, is_first, suffix: str, next_state: dict) -> torch.Tensor:
        """Encode ``x``, step ``cell`` from the (reset) state, store the new state in
        ``next_state``; returns what the heads read."""
        old = tuple(self.reset_state(state[k + suffix], is_first) for k in self.state_keys)  # (N, H) each
        e = encoder(x)
        new = self.cell_step(cell, e, old)
        next_state.update((k + suffix, v) for k, v in zip(self.state_keys, new))
        return torch.cat([new[0], e], dim=-1) if self.skip else new[0]

    def forward(self, observation: torch.Tensor, state: TensorDict, is_first: torch.Tensor) -> TensorDict:
        # A CNN reads the block's observation itself (uint8 images stay uint8 until its forward).
        x = observation if takes_raw_observation(self.encoder) else self.flatten_observation(observation)
        next_state: dict[str, torch.Tensor] = {}
        actor_in = self._run(self.encoder, self.cell, x, state, is_first, "", next_state)
        if self.separate_critic:
            critic_in = self._run(self.critic_encoder, self.critic_cell, x, state, is_first, "_critic", next_state)
        else:
            critic_in = actor_in
        n = actor_in.shape[:1]
        return TensorDict(
            dist=self.head(self.actor_mlp(actor_in)),
            value=self.value(self.critic_mlp(critic_in)).squeeze(-1),
            state=TensorDict(next_state, batch_size=n),
            batch_size=n,
        )
