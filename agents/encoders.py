"""Convolutional observation encoders for the recurrent agents (``encoder: nature_cnn``,
``impala_cnn`` or ``grid_cnn``).

An encoder takes the observation as the replay block holds it, so a uint8 image stays uint8
in every saved block input (a quarter of float32's bytes) and becomes floats here, inside the
agent's forward. It accepts

* an image ``Box`` of rank 2 ``(H, W)`` (grayscale), rank 3 ``(H, W, C)`` channel-last, or
  ``(C, H, W)`` when the first dimension is the smaller of the outer two (a stack of grayscale
  frames from ``FrameStackObservation``), or rank 4 ``(S, H, W, C)`` (stacked colour frames,
  merged into ``S * C`` channels);
* a ``Dict`` holding one such image (``image_key`` names it when there are several) next to
  vector keys: the image goes through the convolutions, the other leaves are flattened (one-hot
  for discrete spaces) and concatenated to the convolutions' output before the linear layers.

The convolutional stacks:

* ``nature_cnn``: Mnih et al. 2015, 32 8x8/4, 64 4x4/2, 64 3x3/1 (ReLU); with
  ``encoder_sizes: [512]`` the linear layer of the paper follows.
* ``impala_cnn``: Espeholt et al. 2018, per stack of ``channels`` (16, 32, 32) a 3x3
  convolution, a 3x3/2 max-pool and two residual blocks; ReLU before the linear layers.
* ``grid_cnn``: for MiniGrid-size views (7x7), as in the MiniGrid baselines: 16 2x2, 2x2
  max-pool, 32 2x2, 64 2x2 (ReLU).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import gymnasium as gym
import numpy as np
import torch
from tensordict import TensorDict
from torch import nn

from rl_replay.agents.mlp import mlp
from rl_replay.errors import SetupError
from rl_replay.spaces import flat_size, flatten, leaf_keys, leaf_scales

__all__ = ["ENCODERS", "ConvEncoder", "make_encoder", "resolve_image_layout", "takes_raw_observation"]


def _orthogonal(module: nn.Module) -> nn.Module:
    """Orthogonal init with gain sqrt(2) and zero bias (CleanRL's Atari agents)."""
    nn.init.orthogonal_(module.weight, gain=2**0.5)
    nn.init.zeros_(module.bias)
    return module


def nature_cnn(in_channels: int, channels: Sequence[int] = (32, 64, 64)) -> nn.Sequential:
    """The convolutions of the DQN Nature paper (8x8/4, 4x4/2, 3x3/1, ReLU)."""
    c1, c2, c3 = channels
    return nn.Sequential(
        _orthogonal(nn.Conv2d(in_channels, c1, 8, stride=4)),
        nn.ReLU(),
        _orthogonal(nn.Conv2d(c1, c2, 4, stride=2)),
        nn.ReLU(),
        _orthogonal(nn.Conv2d(c2, c3, 3, stride=1)),
        nn.ReLU(),
    )


class _Residual(nn.Module):
    """IMPALA's residual block: ``x + conv(relu(conv(relu(x))))``."""

    def __init__(self, channels: int):
        super().__init__()
        self.conv0 = _orthogonal(nn.Conv2d(channels, channels, 3, padding=1))
        self.conv1 = _orthogonal(nn.Conv2d(channels, channels, 3, padding=1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.conv1(torch.relu(self.conv0(torch.relu(x))))


def impala_cnn(in_channels: int, channels: Sequence[int] = (16, 32, 32)) -> nn.Sequential:
    """IMPALA's residual stacks (conv 3x3, max-pool 3x3/2, two residual blocks each), then ReLU."""
    layers: list[nn.Module] = []
    for out in channels:
        layers += [
            _orthogonal(nn.Conv2d(in_channels, out, 3, padding=1)),
            nn.MaxPool2d(3, stride=2, padding=1),
            _Residual(out),
            _Residual(out),
        ]
        in_channels = out
    return nn.Sequential(*layers, nn.ReLU())


def grid_cnn(in_channels: int, channels: Sequence[int] = (16, 32, 64)) -> nn.Sequential:
    """Small 2x2 convolutions for MiniGrid's partial views (16 2x2, max-pool 2x2, 32 2x2, 64 2x2)."""
    c1, c2, c3 = channels
    return nn.Sequential(
        _orthogonal(nn.Conv2d(in_channels, c1, 2)),
        nn.ReLU(),
        nn.MaxPool2d(2),
        _orthogonal(nn.Conv2d(c1, c2, 2)),
        nn.ReLU(),
        _orthogonal(nn.Conv2d(c2, c3, 2)),
        nn.ReLU(),
    )


#: ``encoder`` values of the recurrent agents besides ``mlp``.
ENCODERS = {"nature_cnn": nature_cnn, "impala_cnn": impala_cnn, "grid_cnn": grid_cnn}


def resolve_image_layout(shape: Sequence[int], layout: str | None = None) -> tuple[str, tuple[int, int, int]]:
    """How an image of ``shape`` becomes ``(C, H, W)``: ``(layout, (C, H, W))`` with layout
    ``"hw"``, ``"hwc"``, ``"chw"`` or ``"shwc"``; SetupError for other ranks.

    A rank-3 image is ``(C, H, W)`` when its first dimension is the smaller of the outer two
    (a stack of grayscale frames), else ``(H, W, C)``; ``layout`` (``"hwc"`` or ``"chw"``)
    overrides that guess, e.g. for MiniGrid's one-hot views ``(7, 7, 20)``, channel-last with
    more channels than pixels a side."""
    shape = tuple(int(s) for s in shape)
    if layout is not None and (layout not in ("hwc", "chw") or len(shape) != 3):
        raise SetupError(
            f"encoder image_layout {layout!r} needs a rank-3 image and one of 'hwc' (channel-last) "
            f"or 'chw' (channel-first); the image has shape {shape}."
        )
    if len(shape) == 2:
        return "hw", (1, *shape)
    if len(shape) == 3:
        if layout == "chw" or (layout is None and shape[0] < shape[-1]):
            return "chw", shape  # (stack, H, W): FrameStackObservation of grayscale frames
        return "hwc", (shape[2], shape[0], shape[1])
    if len(shape) == 4:
        s, h, w, c = shape
        return "shwc", (s * c, h, w)
    raise SetupError(
        f"an image observation must have 2 to 4 dimensions ((H, W), (H, W, C), (C, H, W) or "
        f"(S, H, W, C)), got shape {shape}."
    )


def _is_image(space: gym.Space) -> bool:
    return isinstance(space, gym.spaces.Box) and len(space.shape) >= 2


def _to_chw(image: torch.Tensor, layout: str, scale: float) -> torch.Tensor:
    """``(N, C, H, W)`` float32 from a batch of images in ``layout``, times ``scale``."""
    x = image.to(torch.float32)
    if scale != 1.0:
        x = x * scale
    if layout == "hw":
        return x.unsqueeze(1)
    if layout == "hwc":
        return x.permute(0, 3, 1, 2)
    if layout == "shwc":
        n, s, h, w, c = x.shape
        return x.permute(0, 1, 4, 2, 3).reshape(n, s * c, h, w)
    return x


class ConvEncoder(nn.Module):
    """Image (and vector keys) -> convolutions -> flatten -> concatenated vector -> MLP.

    Args:
        observation_space: an image ``Box`` or a ``Dict`` with one image (see the module doc).
        name: ``nature_cnn``, ``impala_cnn`` or ``grid_cnn``.
        sizes: widths of the linear layers after the convolutions (``activation`` after
            each); empty: the flattened convolutions (and vector keys) are the output.
        activation: the linear layers' activation class.
        channels: output channels of the convolutions (three for nature_cnn and grid_cnn,
            one per residual stack for impala_cnn); None: the published ones.
        image_key: the Dict key of the image; None: the Dict's only image subspace.
        image_scale: multiplies the image; None: ``1/255`` for a uint8 image, 1 otherwise.
            MiniGrid's uint8 views hold small object, colour and state indices (0-10), for
            which 1 (or 0.1) suits better than ``1/255``.
        image_layout: ``"hwc"`` or ``"chw"`` for a rank-3 image whose layout the shape does
            not tell (see :func:`resolve_image_layout`); None: guessed from the shape.

    Attributes:
        out_features: width of the output.
    """

    def __init__(
        self,
        observation_space: gym.Space,
        name: str,
        sizes: Sequence[int],
        activation: type[nn.Module],
        channels: Sequence[int] | None = None,
        image_key: str | None = None,
        image_scale: float | None = None,
        image_layout: str | None = None,
    ):
        super().__init__()
        if name not in ENCODERS:
            raise SetupError(f"encoder must be mlp or one of {sorted(ENCODERS)}, got {name!r}.")
        self.image_key, image_space, vector_space = self._split(observation_space, image_key)
        self.layout, (c, h, w) = resolve_image_layout(image_space.shape, image_layout)
        if image_scale is None:
            image_scale = 1.0 / 255.0 if image_space.dtype == np.uint8 else 1.0
        if not (isinstance(image_scale, (int, float)) and math.isfinite(image_scale) and image_scale > 0):
            raise SetupError(f"encoder image_scale must be a positive number, got {image_scale!r}.")
        self.image_scale = float(image_scale)
        self.convs = ENCODERS[name](c, *(() if channels is None else (tuple(channels),)))
        try:
            with torch.no_grad():
                conv_features = self.convs(torch.zeros(1, c, h, w)).flatten(1).shape[1]
        except RuntimeError:
            raise SetupError(
                f"encoder {name}: the image of shape {tuple(image_space.shape)} (channels {c}, "
                f"{h}x{w}) is too small for its convolutions; use grid_cnn for small views "
                "or resize the frames (gymnasium.wrappers:ResizeObservation)."
            ) from None
        # The vector keys: their leaves in the space's order, one-hot / scaled as flatten() does.
        if vector_space is not None:
            keys, scales = leaf_keys(observation_space), leaf_scales(observation_space)
            kept = [(k, s) for k, s in zip(keys, scales) if k[0] != self.image_key]
            self._vector_keys, self._vector_scales = [k for k, _ in kept], [s for _, s in kept]
            vector_features = flat_size(vector_space)
        else:
            self._vector_keys, self._vector_scales, vector_features = [], [], 0
        sizes = list(sizes)
        self.mlp = mlp(conv_features + vector_features, sizes, activation)
        self.out_features = sizes[-1] if sizes else conv_features + vector_features

    @staticmethod
    def _split(space: gym.Space, image_key: str | None):
        """``(image key or None, image space, Dict of the other keys or None)``."""
        if _is_image(space):
            if image_key is not None:
                raise SetupError(
                    f"encoder image_key {image_key!r} given, but the observation space is the image "
                    f"{space} itself, not a Dict; drop image_key."
                )
            return None, space, None
        if not isinstance(space, gym.spaces.Dict):
            raise SetupError(
                f"a convolutional encoder needs an image observation (a Box of shape (H, W), (H, W, C) "
                f"or (S, H, W, C)) or a Dict holding one; got {space}. Use encoder: mlp, or a wrapper "
                "that makes an image."
            )
        images = [str(k) for k, s in space.spaces.items() if _is_image(s)]
        if image_key is None:
            if len(images) != 1:
                raise SetupError(
                    f"a convolutional encoder needs exactly one image key in the Dict observation, found "
                    f"{images or 'none'} in {space}; name it with encoder_kwargs.image_key."
                )
            image_key = images[0]
        elif image_key not in images:
            raise SetupError(
                f"encoder image_key {image_key!r} is not an image subspace of {space}; image keys: {images or 'none'}."
            )
        rest = {k: s for k, s in space.spaces.items() if str(k) != image_key}
        return image_key, space.spaces[image_key], gym.spaces.Dict(rest) if rest else None

    def forward(self, observation: torch.Tensor | TensorDict) -> torch.Tensor:
        image = observation if self.image_key is None else observation.get(self.image_key)
        x = self.convs(_to_chw(image, self.layout, self.image_scale)).flatten(1)
        if self._vector_keys:
            x = torch.cat([x, flatten(observation, self._vector_keys, self._vector_scales)], dim=-1)
        return self.mlp(x)


def make_encoder(
    agent, name: str, sizes: Sequence[int], activation: type[nn.Module] = nn.Tanh, options: dict | None = None
) -> tuple[nn.Module, int]:
    """``(encoder, out_features)`` for ``agent`` (an :class:`~rl_replay.Agent`): ``mlp``, the
    flattened observation through ``sizes``, or a :class:`ConvEncoder` built with ``options``
    (the agent's ``encoder_kwargs``). An ``mlp`` encoder reads ``agent.flatten_observation``'s
    output, a convolutional one the observation itself (:func:`takes_raw_observation`)."""
    sizes = list(sizes)
    if name == "mlp":
        if options:
            raise SetupError(
                f"{type(agent).__name__}: encoder_kwargs {options} are for the convolutional encoders "
                f"({', '.join(sorted(ENCODERS))}); the mlp encoder takes encoder_sizes only."
            )
        return mlp(agent.obs_dim, sizes, activation), sizes[-1] if sizes else agent.obs_dim
    if name not in ENCODERS:
        raise SetupError(f"{type(agent).__name__}: encoder must be mlp or one of {sorted(ENCODERS)}, got {name!r}.")
    try:
        encoder = ConvEncoder(agent.observation_space, name, sizes, activation, **dict(options or {}))
    except TypeError as exc:
        raise SetupError(f"{type(agent).__name__}: bad encoder_kwargs {options}: {exc}") from None
    return encoder, encoder.out_features


def takes_raw_observation(encoder: nn.Module) -> bool:
    """Whether ``encoder`` reads the block's observation as it is (a :class:`ConvEncoder`)."""
    return isinstance(encoder, ConvEncoder)
