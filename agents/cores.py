"""Recurrent cores: the part of an agent that carries state from one step to the next.

A core takes the encoded observations ``u`` of shape ``(k, N, in_features)`` (k steps of
N envs), its state before the first of them (a tuple of ``(N, *state_shape(key))`` tensors, in
:attr:`Core.state_keys` order, ``(N, hidden)`` for the cores here) and ``keep`` ``(k, N, 1)``: 0 where step ``t`` starts an
episode, 1 elsewhere. Before step ``t`` reads the state, the state is multiplied by
``keep[t]`` (:meth:`rl_replay.Agent.reset_state`), so no memory or gradient crosses an
episode boundary, also inside a sequence. It returns the outputs ``y`` ``(k, N,
out_features)`` and the state after the last step.

A core is called as a module, ``core(u, state, keep)`` (so FSDP's hooks run when it is a
unit of its own); the GRU and LSTM cores subclass ``nn.GRUCell`` / ``nn.LSTMCell`` for their
parameters and initialisation, and their ``forward`` takes this sequence form instead of
the cell's one-step one.

One step is a sequence of length 1, so acting (one step at a time) and replaying a block
(k steps at once) run the same code. Each core computes what does not depend on the state
once for all k steps (the input projections, the gates of minGRU, the LRU's readout) and
only the recurrence itself step by step; those batched products differ from k separate
ones by float rounding only. The GRU and LSTM cores run a block of k > 1 steps through the
fused multi-step kernel of ``nn.GRU`` / ``nn.LSTM`` instead (oneDNN on the CPU, cuDNN on a GPU:
one call for the whole recurrence), on their own cell parameters, split where an episode starts
inside the block (:func:`segments`): a segment's state is reset once at its first row, never
stepped row by row. One step (acting) keeps the step loop, which is the cell's arithmetic. The loops walk ``unbind(0)`` views, not ``x[t]``: the backward of
one unbind is one stack, where each ``x[t]`` would write its gradient into a zero tensor of
the whole block (k times the block's size per block).
"""

from __future__ import annotations

import math

import torch
from torch import nn
from torch.nn import functional as F

from rl_replay.agents.chrono import check_t_max, chrono_bias
from rl_replay.errors import SetupError

__all__ = ["Core", "GRUCore", "LSTMCore", "LRUCore", "MinGRUCore", "segments"]

State = tuple[torch.Tensor, ...]


def _fused(kernel, u: torch.Tensor, hx, params: tuple[torch.Tensor, ...], training: bool):
    """``kernel`` (``torch._VF.gru`` / ``lstm``, what ``nn.GRU`` / ``nn.LSTM`` call) over ``u``.

    Without grad, oneDNN's LSTM takes an inference kernel whose floats differ from the training
    kernel that the backward's recompute (and plain autograd) runs; so a call without grad runs the
    training kernel on detached tensors instead, building no graph, and a replay block's outputs are
    bit-identical to its recompute's.
    """
    if torch.is_grad_enabled():
        return kernel(u, hx, params, True, 1, 0.0, training, False, False)
    hx = tuple(t.detach() for t in hx) if isinstance(hx, tuple) else hx.detach()
    with torch.enable_grad():
        return kernel(u.detach(), hx, tuple(p.detach() for p in params), True, 1, 0.0, training, False, False)


def segments(keep: torch.Tensor) -> list[tuple[int, int]]:
    """``[(start, stop), ...]`` rows of a block of ``keep`` ``(k, N, 1)`` between episode starts:
    a segment begins at row 0 and at every later row where some env starts an episode, so within
    a segment only its first row resets a state (fused kernels take no per-row reset)."""
    k = keep.shape[0]
    starts = (keep[1:].reshape(k - 1, -1) == 0).any(1).nonzero().flatten().add(1).tolist() if k > 1 else []
    bounds = [0, *starts, k]
    return list(zip(bounds[:-1], bounds[1:]))


class Core(nn.Module):
    """The interface of a recurrent core (see the module docstring)."""

    #: names of the state tensors, in the order of the state tuple
    state_keys: tuple[str, ...] = ()
    #: width of ``y``
    out_features: int
    #: width of each state tensor (unless :meth:`state_shape` says otherwise)
    hidden_size: int

    def state_shape(self, key: str) -> tuple[int, ...]:
        """The shape of state tensor ``key`` without its batch dimension: ``(hidden_size,)`` unless a
        core keeps more (the attention cores of :mod:`rl_replay.agents.attention` keep windows)."""
        return (self.hidden_size,)

    def forward(self, u: torch.Tensor, state: State, keep: torch.Tensor) -> tuple[torch.Tensor, State]:
        """``(y, state)`` after the k steps of ``u`` ``(k, N, in_features)``."""
        raise NotImplementedError(f"{type(self).__name__} must implement forward()")


class GRUCore(nn.GRUCell, Core):
    """A ``GRUCell`` (its parameters, init and arithmetic) run over a sequence: the input
    projection ``W_ih u + b_ih`` is one product for the k steps, the rest step by step in
    the order of ATen's ``gru_cell``."""

    state_keys = ("h",)

    def __init__(
        self, in_features: int, hidden_size: int, update_gate_bias: float = 0.0, chrono_t_max: float | None = None
    ):
        super().__init__(in_features, hidden_size)
        H = hidden_size
        self.out_features = H
        if chrono_t_max is not None:
            t_max = check_t_max(chrono_t_max, type(self).__name__)
            with torch.no_grad():  # z = sigmoid(b_iz + b_hz + ...) is the keep gate in torch
                self.bias_ih[H : 2 * H].copy_(chrono_bias(H, t_max))
                self.bias_hh[H : 2 * H].zero_()
        elif update_gate_bias:
            # Gates are ordered (reset, update, new); a positive update-gate bias makes the cell
            # keep its state by default, so gradient survives long delays (the GRU analogue of
            # an LSTM forget-gate bias of 1).
            with torch.no_grad():
                self.bias_hh[H : 2 * H].fill_(update_gate_bias)

    def forward(self, u, state, keep):
        return self._fused(u, state, keep) if u.shape[0] > 1 else self._steps(u, state, keep)

    def _steps(self, u, state, keep):
        """The steps one by one in the cell's arithmetic, the input projection batched (acting: k = 1)."""
        gi = F.linear(u, self.weight_ih, self.bias_ih)  # (k, N, 3H)
        h = state[0]
        ys = []
        for gi_t, keep_t in zip(gi.unbind(0), keep.unbind(0)):
            h = h * keep_t
            hr, hz, hn = F.linear(h, self.weight_hh, self.bias_hh).chunk(3, -1)
            ir, iz, in_ = gi_t.chunk(3, -1)
            r = torch.sigmoid(hr + ir)
            z = torch.sigmoid(hz + iz)
            n = torch.tanh(in_ + hn * r)
            h = (h - n) * z + n
            ys.append(h)
        return torch.stack(ys), (h,)

    def _fused(self, u, state, keep):
        """k > 1 steps through ``nn.GRU``'s fused kernel, segment by segment (see :func:`segments`)."""
        params = (self.weight_ih, self.weight_hh, self.bias_ih, self.bias_hh)
        h, ys = state[0], []
        for start, stop in segments(keep):
            h0 = (h * keep[start]).unsqueeze(0)
            y, hn = _fused(torch._VF.gru, u[start:stop], h0, params, self.training)
            ys.append(y)
            h = hn[0]
        return (ys[0] if len(ys) == 1 else torch.cat(ys)), (h,)


class LSTMCore(nn.LSTMCell, Core):
    """An ``LSTMCell`` run over a sequence (state ``h``, ``c``; output ``h``), the input
    projection batched over the k steps."""

    state_keys = ("h", "c")

    def __init__(self, in_features: int, hidden_size: int, forget_bias: float = 1.0, chrono_t_max: float | None = None):
        super().__init__(in_features, hidden_size)
        H = hidden_size
        self.out_features = H
        with torch.no_grad():  # gates are ordered (input, forget, cell, output)
            self.bias_ih[H : 2 * H].fill_(forget_bias)
            self.bias_hh[H : 2 * H].zero_()
            if chrono_t_max is not None:
                forget = chrono_bias(H, check_t_max(chrono_t_max, type(self).__name__))
                self.bias_ih[H : 2 * H].copy_(forget)
                self.bias_ih[:H].copy_(-forget)
                self.bias_hh[:H].zero_()

    def forward(self, u, state, keep):
        return self._fused(u, state, keep) if u.shape[0] > 1 else self._steps(u, state, keep)

    def _steps(self, u, state, keep):
        """The steps one by one in the cell's arithmetic, the input projection batched (acting: k = 1)."""
        gi = F.linear(u, self.weight_ih, self.bias_ih)  # (k, N, 4H)
        h, c = state
        ys = []
        for gi_t, keep_t in zip(gi.unbind(0), keep.unbind(0)):
            h, c = h * keep_t, c * keep_t
            i, f, g, o = (F.linear(h, self.weight_hh, self.bias_hh) + gi_t).chunk(4, -1)
            c = torch.sigmoid(f) * c + torch.sigmoid(i) * torch.tanh(g)
            h = torch.sigmoid(o) * torch.tanh(c)
            ys.append(h)
        return torch.stack(ys), (h, c)

    def _fused(self, u, state, keep):
        """k > 1 steps through ``nn.LSTM``'s fused kernel, segment by segment (see :func:`segments`)."""
        params = (self.weight_ih, self.weight_hh, self.bias_ih, self.bias_hh)
        (h, c), ys = state, []
        for start, stop in segments(keep):
            hx = ((h * keep[start]).unsqueeze(0), (c * keep[start]).unsqueeze(0))
            y, hn, cn = _fused(torch._VF.lstm, u[start:stop], hx, params, self.training)
            ys.append(y)
            h, c = hn[0], cn[0]
        return (ys[0] if len(ys) == 1 else torch.cat(ys)), (h, c)


class LRUCore(Core):
    """A linear recurrent unit (Orvieto et al. 2023): ``x_t = lambda * x_{t-1} + gamma * B u_t``,
    ``y_t = Re(C x_t) + D * u_t``, with a diagonal ``lambda`` (complex, or real when
    ``max_phase == 0``). See :class:`~rl_replay.agents.lru.LRUAgent` for the arguments.

    Over a sequence the input term ``gamma * B u`` and the readout ``C x`` are one product
    each; what remains per step is one multiply-add, ``x = (lambda * keep_t) * x + b_t``.
    """

    def __init__(
        self,
        in_features: int,
        hidden_size: int,
        r_min: float = 0.9,
        r_max: float = 0.999,
        max_phase: float = math.pi / 10,
        normalize: bool = True,
        input_scale: float = 1.0,
    ):
        super().__init__()
        if not (isinstance(hidden_size, int) and hidden_size > 0):
            raise SetupError(f"{type(self).__name__}: hidden_size must be a positive integer, got {hidden_size!r}.")
        if not (0.0 <= r_min <= r_max < 1.0):
            raise SetupError(
                f"{type(self).__name__}: need 0 <= r_min <= r_max < 1, got r_min={r_min!r}, r_max={r_max!r}."
            )
        if not (0.0 <= max_phase <= 2 * math.pi):
            raise SetupError(f"{type(self).__name__}: max_phase must be in [0, 2*pi], got {max_phase!r}.")
        if not (isinstance(input_scale, (int, float)) and math.isfinite(input_scale) and input_scale >= 0):
            raise SetupError(f"{type(self).__name__}: input_scale must be a finite number >= 0, got {input_scale!r}.")
        self.hidden_size = hidden_size
        self.out_features = in_features
        self.complex = max_phase > 0
        self.normalize = bool(normalize)
        self.state_keys = ("x", "x_im") if self.complex else ("x",)
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
        B = torch.randn(parts, hidden_size, in_features) / math.sqrt(parts * in_features)
        self.B = nn.Parameter(B if input_scale == 1 else B * input_scale)
        self.C = nn.Parameter(torch.randn(parts, in_features, hidden_size) / math.sqrt(parts * hidden_size))
        self.D = nn.Parameter(torch.randn(in_features))

    def eigenvalues(self) -> torch.Tensor:
        """The diagonal ``lambda`` as a complex tensor ``(hidden_size,)``."""
        modulus = torch.exp(-torch.exp(self.nu_log))
        phase = torch.exp(self.theta_log) if self.complex else torch.zeros_like(modulus)
        return torch.polar(modulus, phase)

    def forward(self, u, state, keep):
        modulus = torch.exp(-torch.exp(self.nu_log))  # (H,)
        scale = torch.exp(self.gamma_log) if self.normalize else 1.0
        bu = u @ self.B[0].T * scale  # (k, N, H)
        if self.complex:
            phase = torch.exp(self.theta_log)
            lam = torch.complex(modulus * torch.cos(phase), modulus * torch.sin(phase))
            b = torch.complex(bu, u @ self.B[1].T * scale)
            x = torch.complex(*state)
        else:
            lam, b, x = modulus, bu, state[0]
        a = lam * keep  # (k, N, H): keep is 0 or 1, so a * x is exactly lambda * (keep * x)
        xs = []
        for a_t, b_t in zip(a.unbind(0), b.unbind(0)):
            x = torch.addcmul(b_t, a_t, x)
            xs.append(x)
        X = torch.stack(xs)
        if self.complex:
            y = X.real @ self.C[0].T - X.imag @ self.C[1].T  # Re(C x)
            return y + self.D * u, (x.real.contiguous(), x.imag.contiguous())
        return X @ self.C[0].T + self.D * u, (x,)


class MinGRUCore(Core):
    """minGRU (Feng et al. 2024): ``h_t = (1 - z_t) * h_{t-1} + z_t * h~_t`` with the gate
    ``z_t`` and the candidate ``h~_t`` functions of ``u_t`` only, so both are one product
    over the k steps and each step is one ``lerp``. The gate's bias is chrono-initialised."""

    state_keys = ("h",)

    def __init__(self, in_features: int, hidden_size: int, chrono_t_max: float = 1024):
        super().__init__()
        if not (isinstance(hidden_size, int) and hidden_size > 0):
            raise SetupError(f"{type(self).__name__}: hidden_size must be a positive integer, got {hidden_size!r}.")
        self.hidden_size = self.out_features = hidden_size
        self.gate = nn.Linear(in_features, hidden_size)
        self.candidate = nn.Linear(in_features, hidden_size)
        with torch.no_grad():
            # z = sigmoid(b) is the write gate; 1 - z = sigmoid(-b) keeps, so -b gets the chrono bias.
            self.gate.bias.copy_(-chrono_bias(hidden_size, check_t_max(chrono_t_max, type(self).__name__)))

    def forward(self, u, state, keep):
        z = torch.sigmoid(self.gate(u))  # (k, N, H)
        candidate = self.candidate(u)
        h = state[0]
        hs = []
        for keep_t, candidate_t, z_t in zip(keep.unbind(0), candidate.unbind(0), z.unbind(0)):
            h = torch.lerp(h * keep_t, candidate_t, z_t)  # (1 - z) * h + z * h~
            hs.append(h)
        return torch.stack(hs), (h,)
