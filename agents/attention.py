"""Attention cores: a transformer whose recent past is its recurrent state.

:class:`WindowAttentionCore` is a stack of gated transformer layers in the GTrXL manner (Parisotto
et al. 2020: pre-norm, GRU-type gates in place of the residual sums). Each layer keeps the last
``window`` inputs of its own stream, and which of them belong to the current episode, as state
(``memory`` ``(N, layers, window, d_model)``, ``valid`` ``(N, window)``); a step attends over that
window and itself, causally, with a learned bias per head and relative offset (0 = itself,
``window`` = the oldest entry). ``is_first`` empties the window.

Unlike Transformer-XL and GTrXL, nothing stops the gradient at the window: the window is state
like a GRU's ``h``, so under replay the gradient of a late step reaches every earlier step through
the windows it passed through, across blocks, back to the episode's start, and memory stays the
block inputs plus one state per block.

A replay block of k steps is one call: per layer, the k queries attend over ``[window; block]``
(``window + k`` keys) under a banded causal mask that gives each step exactly the keys the
one-step call would have given it (the ``window`` before it, those since the last episode start,
and itself), so the sequence call equals k one-step calls within float rounding.

What a windowed stack can recall is bounded: information moves back at most ``window`` steps per
layer. :class:`RecurrentWindowCore` puts the window on top of a linear recurrence
(:class:`~rl_replay.agents.cores.LRUCore`, or a GRU): the recurrence carries what is older than
the window (the LRU recalls across 16,384 steps in this project), the attention reads the recent
past exactly. docs/memory_transformers.md says why this and not memory tokens.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from rl_replay.agents.cores import Core, GRUCore, LRUCore
from rl_replay.errors import SetupError

__all__ = ["WindowAttentionCore", "RecurrentWindowCore", "attention_mask"]


def attention_mask(valid: torch.Tensor, keep: torch.Tensor, window: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Which of the ``window + k`` keys each of a block's k steps may attend to.

    Args:
        valid: ``(N, window)`` 1 where the window entry belongs to the current episode.
        keep: ``(k, N)`` 0 where step t starts an episode.
        window: W.

    Returns:
        ``allowed`` ``(N, k, W + k)`` bool: key j (j < W: the window, oldest first; j = W + s:
        block step s) is visible to step t iff it is within the W keys before t or t itself
        (``t <= j <= W + t``), and no episode starts after it up to t; and ``next_valid``
        ``(N, W)``: the validity of the window after the block (keys k .. W + k - 1 as the
        block's last step sees them).
    """
    k = keep.shape[0]
    resets = (keep == 0).to(torch.int32).cumsum(0).transpose(0, 1)  # (N, k): starts in steps 0..t
    after = resets[:, :, None]  # (N, k, 1) for step t
    window_ok = (valid[:, None, :] > 0) & (after == 0)  # no start in 0..t: the old window still counts
    block_ok = after == resets[:, None, :]  # no start in s+1..t (start at s itself keeps s)
    t = torch.arange(k, device=keep.device)
    j = torch.arange(window + k, device=keep.device)
    band = (j[None, :] >= t[:, None]) & (j[None, :] <= window + t[:, None])  # (k, W + k)
    allowed = torch.cat([window_ok, block_ok], dim=2) & band
    # The window after the block: the last step's view, one step further (key k - 1 drops out).
    next_valid = torch.cat([window_ok[:, -1], block_ok[:, -1]], dim=1)[:, k:]  # (N, W): keys k .. W + k - 1
    return allowed, next_valid


class GRUGate(nn.Module):
    """GTrXL's gate ``g(x, y)``: a GRU step with ``x`` as the state and ``y`` as the input; the
    update gate's bias starts at ``-bias`` so the layer starts near the identity."""

    def __init__(self, d: int, bias: float):
        super().__init__()
        self.from_y = nn.Linear(d, 3 * d, bias=False)
        self.from_x = nn.Linear(d, 2 * d, bias=False)
        self.candidate_x = nn.Linear(d, d, bias=False)
        self.bias = nn.Parameter(torch.full((d,), float(bias)))

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        yr, yz, yg = self.from_y(y).chunk(3, -1)
        xr, xz = self.from_x(x).chunk(2, -1)
        r = torch.sigmoid(yr + xr)
        z = torch.sigmoid(yz + xz - self.bias)
        h = torch.tanh(yg + self.candidate_x(r * x))
        return torch.lerp(x, h, z)  # (1 - z) * x + z * h


class WindowLayer(nn.Module):
    """One pre-norm, gated layer: windowed self-attention, then a feed-forward block."""

    def __init__(self, d_model: int, num_heads: int, window: int, ff_mult: int, gate_bias: float):
        super().__init__()
        self.num_heads, self.window = num_heads, window
        self.norm_attention = nn.LayerNorm(d_model)
        self.query = nn.Linear(d_model, d_model)
        self.key_value = nn.Linear(d_model, 2 * d_model)
        self.out = nn.Linear(d_model, d_model)
        # one learned bias per head and relative offset 0 (itself) .. window (the oldest key)
        self.position_bias = nn.Parameter(torch.zeros(num_heads, window + 1))
        self.gate_attention = GRUGate(d_model, gate_bias)
        self.norm_ff = nn.LayerNorm(d_model)
        self.ff = nn.Sequential(nn.Linear(d_model, ff_mult * d_model), nn.ReLU(), nn.Linear(ff_mult * d_model, d_model))
        self.gate_ff = GRUGate(d_model, gate_bias)

    def forward(self, x: torch.Tensor, memory: torch.Tensor, allowed: torch.Tensor) -> torch.Tensor:
        """``x`` ``(k, N, d)``, ``memory`` ``(N, W, d)`` (this layer's past inputs), ``allowed``
        ``(N, k, W + k)``; returns the layer's output ``(k, N, d)``."""
        k, N, d = x.shape
        H, W = self.num_heads, self.window
        # One norm over [window; block] (not one for each): each parameter used once per call, so the
        # order in which the backward sums its gradient is the same under replay and plain autograd
        # whatever the block size.
        context = self.norm_attention(torch.cat([memory, x.transpose(0, 1)], dim=1))  # (N, W + k, d)
        h = context[:, W:]  # (N, k, d)
        q = self.query(h).unflatten(-1, (H, d // H)).transpose(1, 2)  # (N, H, k, dh)
        key, value = (t.unflatten(-1, (H, d // H)).transpose(1, 2) for t in self.key_value(context).chunk(2, -1))
        t = torch.arange(k, device=x.device)
        j = torch.arange(W + k, device=x.device)
        offset = (W + t[:, None] - j[None, :]).clamp(0, W)  # (k, W + k): 0 = itself
        bias = self.position_bias[:, offset]  # (H, k, W + k)
        bias = bias.unsqueeze(0).masked_fill(~allowed.unsqueeze(1), float("-inf"))  # (N, H, k, W + k)
        # Written out, not F.scaled_dot_product_attention: that picks its kernel by whether grad is
        # on, so a replay block's no-graph forward and its recompute would round differently.
        scores = q @ key.transpose(-1, -2) * (d // H) ** -0.5 + bias
        attended = torch.softmax(scores, dim=-1) @ value  # (N, H, k, dh)
        y = self.out(attended.transpose(1, 2).flatten(2)).transpose(0, 1)  # (k, N, d)
        x = self.gate_attention(x, y)
        return self.gate_ff(x, self.ff(self.norm_ff(x)))


def _positive_int(value, name: str, owner: str) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise SetupError(f"{owner}: {name} must be a positive integer, got {value!r}.")
    return value


class WindowAttentionCore(Core):
    """A GTrXL-style stack over a window of each layer's past inputs (see the module docstring).

    Args:
        in_features: width of the encoded observations (projected to ``d_model`` if different).
        d_model: width of every layer.
        num_layers: layers; each keeps its own window.
        num_heads: attention heads; must divide ``d_model``.
        window: past steps each layer attends over (besides the current one).
        ff_mult: feed-forward width as a multiple of ``d_model``.
        gate_bias: the gates' initial bias towards the identity (GTrXL: 2).
    """

    state_keys = ("memory", "valid")

    def __init__(
        self,
        in_features: int,
        d_model: int = 128,
        num_layers: int = 2,
        num_heads: int = 4,
        window: int = 64,
        ff_mult: int = 4,
        gate_bias: float = 2.0,
        owner: str = "WindowAttentionCore",
    ):
        super().__init__()
        for name, value in (
            ("d_model", d_model),
            ("num_layers", num_layers),
            ("num_heads", num_heads),
            ("window", window),
            ("ff_mult", ff_mult),
        ):
            _positive_int(value, name, owner)
        if d_model % num_heads:
            raise SetupError(f"{owner}: num_heads ({num_heads}) must divide d_model ({d_model}).")
        if not (isinstance(gate_bias, (int, float)) and math.isfinite(gate_bias)):
            raise SetupError(f"{owner}: gate_bias must be a finite number, got {gate_bias!r}.")
        self.d_model, self.num_layers, self.window = d_model, num_layers, window
        self.hidden_size = self.out_features = d_model
        self.project = nn.Linear(in_features, d_model) if in_features != d_model else nn.Identity()
        self.layers = nn.ModuleList(
            WindowLayer(d_model, num_heads, window, ff_mult, gate_bias) for _ in range(num_layers)
        )
        self.norm = nn.LayerNorm(d_model)

    def state_shape(self, key: str) -> tuple[int, ...]:
        return (self.num_layers, self.window, self.d_model) if key == "memory" else (self.window,)

    def forward(self, u, state, keep):
        memory, valid = state
        x = self.project(u)  # (k, N, d)
        k = x.shape[0]
        allowed, next_valid = attention_mask(valid, keep[..., 0], self.window)
        windows = []
        for i, layer in enumerate(self.layers):
            past = memory[:, i]  # (N, W, d)
            # the window after the block: this layer's last W inputs of [window; block], zero where
            # they are not of the current episode (what the one-step calls leave there)
            stream = torch.cat([past, x.transpose(0, 1)], dim=1)[:, k:]
            windows.append(stream * next_valid.unsqueeze(-1).to(stream.dtype))
            x = layer(x, past, allowed)
        return self.norm(x), (torch.stack(windows, dim=1), next_valid.to(valid.dtype))


class RecurrentWindowCore(Core):
    """A linear recurrence (LRU) or a GRU, then a :class:`WindowAttentionCore` over its outputs:
    memory beyond the window comes through the recurrence (see the module docstring).

    Args:
        in_features: width of the encoded observations.
        recurrence: ``"lru"`` or ``"gru"``.
        recurrent_size: the recurrence's state width.
        recurrent_kwargs: further arguments of :class:`~rl_replay.agents.cores.LRUCore` /
            :class:`~rl_replay.agents.cores.GRUCore`.
        **attention: the arguments of :class:`WindowAttentionCore`.
    """

    def __init__(
        self,
        in_features: int,
        recurrence: str = "lru",
        recurrent_size: int = 128,
        recurrent_kwargs: dict | None = None,
        owner: str = "RecurrentWindowCore",
        **attention,
    ):
        super().__init__()
        cores = {"lru": LRUCore, "gru": GRUCore}
        if recurrence not in cores:
            raise SetupError(f"{owner}: recurrence must be one of {sorted(cores)}, got {recurrence!r}.")
        self.recurrent = cores[recurrence](in_features, recurrent_size, **(recurrent_kwargs or {}))
        self.attention = WindowAttentionCore(self.recurrent.out_features, owner=owner, **attention)
        self.hidden_size = self.attention.hidden_size
        self.out_features = self.attention.out_features
        self._split = len(self.recurrent.state_keys)
        self.state_keys = (*self.recurrent.state_keys, *self.attention.state_keys)

    def state_shape(self, key: str) -> tuple[int, ...]:
        if key in self.attention.state_keys:
            return self.attention.state_shape(key)
        return (self.recurrent.hidden_size,)

    def forward(self, u, state, keep):
        y, recurrent_state = self.recurrent(u, state[: self._split], keep)
        y, attention_state = self.attention(y, state[self._split :], keep)
        return y, (*recurrent_state, *attention_state)
