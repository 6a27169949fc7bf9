"""A transformer actor-critic, big enough that sharding it with FSDP matters.

Each observation is embedded into ``context`` tokens (with learned position embeddings),
run through a stack of ``nn.TransformerEncoderLayer`` s (pre-norm, no dropout), pooled,
and fed to the action head and the value head. The policy is stateless: each timestep is
encoded on its own (a per-step encoder), so ``state`` is the empty TensorDict.

Under FSDP set ``distributed.wrap_modules: [TransformerEncoderLayer]`` so each layer is
its own FSDP unit (see ``configs/fsdp_transformer.yaml``).
"""

from __future__ import annotations

import torch
from tensordict import TensorDict
from torch import nn

from rl_replay.agent import ActionHead, Agent, value_head
from rl_replay.errors import SetupError


class TransformerAgent(Agent):
    """``observation -> context tokens -> TransformerEncoder -> mean pool -> heads``.

    Args:
        d_model: token width.
        num_layers: encoder layers (each a ``TransformerEncoderLayer``).
        num_heads: attention heads; must divide ``d_model``.
        ff_mult: feed-forward width as a multiple of ``d_model``.
        context: tokens per observation (the observation is linearly embedded into
            ``context * d_model`` features and split into tokens).

    Parameters: about ``num_layers * (4 + 2 * ff_mult) * d_model**2``; the defaults
    (256, 4 layers, ff_mult 4) give about 3.2 M.
    """

    def __init__(
        self,
        observation_space,
        action_space,
        d_model: int = 256,
        num_layers: int = 4,
        num_heads: int = 4,
        ff_mult: int = 4,
        context: int = 1,
    ) -> None:
        super().__init__(observation_space, action_space)
        for name, value in (
            ("d_model", d_model),
            ("num_layers", num_layers),
            ("num_heads", num_heads),
            ("ff_mult", ff_mult),
            ("context", context),
        ):
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise SetupError(f"TransformerAgent: {name} must be a positive integer, got {value!r}.")
        if d_model % num_heads:
            raise SetupError(f"TransformerAgent: num_heads ({num_heads}) must divide d_model ({d_model}).")
        self.d_model = d_model
        self.context = context
        self.embed = nn.Linear(self.obs_dim, context * d_model)
        self.position = nn.Parameter(torch.zeros(context, d_model))
        nn.init.normal_(self.position, std=0.02)
        layer = nn.TransformerEncoderLayer(
            d_model,
            num_heads,
            dim_feedforward=ff_mult * d_model,
            dropout=0.0,
            activation="gelu",
            batch_first=True,
            norm_first=True,
        )
        # enable_nested_tensor only matters with padding masks, which a policy never has.
        self.encoder = nn.TransformerEncoder(layer, num_layers, enable_nested_tensor=False)
        self.norm = nn.LayerNorm(d_model)
        self.head = ActionHead(action_space, d_model)
        self.value = value_head(d_model)

    def forward(self, observation: torch.Tensor, state: TensorDict, is_first: torch.Tensor) -> TensorDict:
        x = self.flatten_observation(observation).flatten(0, 1)  # (k * N, obs_dim): each step on its own
        tokens = self.embed(x).view(x.shape[0], self.context, self.d_model) + self.position
        h = self.norm(self.encoder(tokens).mean(dim=1)).unflatten(0, is_first.shape)  # (k, N, d_model)
        return self.output(dist=self.head(h), value=self.value(h).squeeze(-1), state=state)
