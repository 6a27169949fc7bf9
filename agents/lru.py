"""A linear recurrent unit (LRU, Orvieto et al., "Resurrecting recurrent neural networks for
long sequences", ICML 2023) as an actor-critic: encoder -> diagonal linear recurrence ->
nonlinear readout -> actor and critic heads.

The recurrence is ``x_t = lambda * x_{t-1} + gamma * (B u_t)`` with a diagonal ``lambda``
(complex, or real when ``max_phase == 0``). Nothing nonlinear sits between ``x_{t-1}`` and
``x_t``, so the gradient from step ``t`` to step ``t - k`` is exactly ``lambda ** k`` per
unit: with ``|lambda|`` drawn close to 1 it neither vanishes nor explodes over thousands of
steps, and it does not depend on what the cell saw in between.
"""

from __future__ import annotations

import math

import torch
from tensordict import TensorDict
from torch import nn

from rl_replay.agent import ActionHead, Agent, value_head
from rl_replay.agents.encoders import make_encoder, takes_raw_observation
from rl_replay.agents.mlp import mlp
from rl_replay.errors import SetupError


class LRUAgent(Agent):
    """Encoder (MLP or CNN) -> LRU (state ``x``, plus ``x_im`` if complex) -> MLP readout -> heads.

    Args:
        hidden_size: number of diagonal recurrent units (complex units when complex).
        encoder_sizes: MLP widths before the recurrence (tanh); the last is its input ``u``.
        readout_sizes: MLP widths after the recurrence; its input is
            ``y = Re(C x) + D * u`` (width of ``u``).
        r_min, r_max: ring initialisation: ``|lambda|**2`` is uniform in
            ``[r_min**2, r_max**2]``. The memory time of a unit is about ``1 / (1 - |lambda|)``
            steps, so ``r_max = 1 - 1/T`` keeps the slowest units for ``T`` steps.
        max_phase: the phases ``arg(lambda)`` are uniform in ``[0, max_phase]``; 0 gives a
            real diagonal recurrence (half the state, no rotation).
        normalize: scale the input by ``gamma = sqrt(1 - |lambda|**2)`` (learned, initialised
            so), which keeps ``E|x|^2`` at the input's for white-noise input. Without it a
            unit with ``|lambda|`` near 1 integrates its inputs into a large state.
        input_scale: multiplies the initial ``B``. At 1 a random ``B`` writes every input
            into the state from the start (a reservoir the readout can learn to read without
            any gradient reaching the write); at 0 nothing is written until ``B`` is learned,
            so remembering an early observation needs gradient that reaches it.
        encoder: ``mlp``, or a convolutional encoder (``nature_cnn``, ``impala_cnn``,
            ``grid_cnn``; :mod:`rl_replay.agents.encoders`) whose linear layers are
            ``encoder_sizes``; uint8 frames are converted inside forward.
        encoder_kwargs: options of a convolutional encoder (``channels``, ``image_key``,
            ``image_scale``; see :class:`~rl_replay.agents.encoders.ConvEncoder`).

    ``encoder_sizes=()`` feeds the observation itself to ``B`` (no bias before the
    recurrence): a zero observation writes nothing, so units with ``|lambda|`` near 1 do not
    integrate a learned constant over a long delay (docs/learning.md, fifth study).

    ``lambda = exp(-exp(nu_log) + i exp(theta_log))``: the exponential parameterisation
    keeps ``|lambda| < 1`` whatever the optimizer does, so the recurrence stays stable.
    """

    def __init__(
        self,
        observation_space,
        action_space,
        hidden_size: int = 128,
        encoder_sizes=(64,),
        readout_sizes=(128,),
        r_min: float = 0.9,
        r_max: float = 0.999,
        max_phase: float = math.pi / 10,
        normalize: bool = True,
        input_scale: float = 1.0,
        encoder: str = "mlp",
        encoder_kwargs: dict | None = None,
    ):
        super().__init__(observation_space, action_space)
        if not (isinstance(hidden_size, int) and hidden_size > 0):
            raise SetupError(f"LRUAgent: hidden_size must be a positive integer, got {hidden_size!r}.")
        if not (0.0 <= r_min <= r_max < 1.0):
            raise SetupError(f"LRUAgent: need 0 <= r_min <= r_max < 1, got r_min={r_min!r}, r_max={r_max!r}.")
        if not (0.0 <= max_phase <= 2 * math.pi):
            raise SetupError(f"LRUAgent: max_phase must be in [0, 2*pi], got {max_phase!r}.")
        if not (isinstance(input_scale, (int, float)) and math.isfinite(input_scale) and input_scale >= 0):
            raise SetupError(f"LRUAgent: input_scale must be a finite number >= 0, got {input_scale!r}.")
        encoder_sizes, readout_sizes = list(encoder_sizes), list(readout_sizes)
        self.hidden_size = hidden_size
        self.complex = max_phase > 0
        self.normalize = bool(normalize)
        self.encoder, width = make_encoder(self, encoder, encoder_sizes, options=encoder_kwargs)

        # Ring init of |lambda|^2 in [r_min^2, r_max^2] (uniform in area, as in the paper).
        u1, u2 = torch.rand(hidden_size, dtype=torch.float64), torch.rand(hidden_size, dtype=torch.float64)
        modulus_sq = u1 * (r_max**2 - r_min**2) + r_min**2
        self.nu_log = nn.Parameter(torch.log(-0.5 * torch.log(modulus_sq)).float())
        if self.complex:
            self.theta_log = nn.Parameter(torch.log(max_phase * u2.clamp_min(1e-4)).float())
        if self.normalize:
            self.gamma_log = nn.Parameter(0.5 * torch.log(1 - modulus_sq).float())
        # Glorot-like scales from the paper: B ~ N(0, 1/(2 width)), C ~ N(0, 1/hidden).
        parts = 2 if self.complex else 1
        B = torch.randn(parts, hidden_size, width) / math.sqrt(parts * width)
        self.B = nn.Parameter(B if input_scale == 1 else B * input_scale)  # 1: bit-identical to before
        self.C = nn.Parameter(torch.randn(parts, width, hidden_size) / math.sqrt(parts * hidden_size))
        self.D = nn.Parameter(torch.randn(width))
        self.readout = mlp(width, readout_sizes)
        features = readout_sizes[-1] if readout_sizes else width
        self.head = ActionHead(action_space, features)
        self.value = value_head(features)

    def eigenvalues(self) -> torch.Tensor:
        """The diagonal ``lambda`` as a complex tensor ``(hidden_size,)``."""
        modulus = torch.exp(-torch.exp(self.nu_log))
        phase = torch.exp(self.theta_log) if self.complex else torch.zeros_like(modulus)
        return torch.polar(modulus, phase)

    def initial_state(self, batch_size: int, device="cpu") -> TensorDict:
        zeros = torch.zeros(batch_size, self.hidden_size, device=device)
        if self.complex:
            return TensorDict(x=zeros, x_im=zeros.clone(), batch_size=[batch_size])
        return TensorDict(x=zeros, batch_size=[batch_size])

    def forward(self, observation: torch.Tensor, state: TensorDict, is_first: torch.Tensor) -> TensorDict:
        # A CNN reads the block's observation itself (uint8 images stay uint8 until its forward).
        u = self.encoder(observation if takes_raw_observation(self.encoder) else observation.flatten(1))  # (N, width)
        modulus = torch.exp(-torch.exp(self.nu_log))  # (H,)
        scale = torch.exp(self.gamma_log) if self.normalize else 1.0
        x = self.reset_state(state["x"], is_first)  # (N, H): the real part
        bu = u @ self.B[0].T * scale
        if self.complex:
            x_im = self.reset_state(state["x_im"], is_first)
            phase = torch.exp(self.theta_log)
            lam_re, lam_im = modulus * torch.cos(phase), modulus * torch.sin(phase)
            x, x_im = (lam_re * x - lam_im * x_im + bu, lam_re * x_im + lam_im * x + u @ self.B[1].T * scale)
            y = x @ self.C[0].T - x_im @ self.C[1].T  # Re(C x)
            next_state = TensorDict(x=x, x_im=x_im, batch_size=x.shape[:1])
        else:
            x = modulus * x + bu
            y = x @ self.C[0].T
            next_state = TensorDict(x=x, batch_size=x.shape[:1])
        h = self.readout(y + self.D * u)
        return TensorDict(
            dist=self.head(h),
            value=self.value(h).squeeze(-1),
            state=next_state,
            batch_size=h.shape[:1],
        )
