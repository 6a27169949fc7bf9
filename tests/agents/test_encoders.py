"""Convolutional encoders (agents/encoders.py) behind the GRU, LSTM and LRU cores: image layouts,
Dict observations, replay-vs-plain parity (bit-identical) and the saved bytes of an image step."""

from __future__ import annotations

import gymnasium as gym
import numpy as np
import pytest
import torch
from _reference import plain_sequence
from conftest import assert_grads_match
from tensordict import TensorDict

from rl_replay.agent import Policy
from rl_replay.agents.encoders import ConvEncoder, resolve_image_layout
from rl_replay.agents.gru import GRUAgent
from rl_replay.agents.lru import LRUAgent
from rl_replay.agents.lstm import LSTMAgent
from rl_replay.algorithms.stored import replay_sequence
from rl_replay.engine import GradientAccumulator, replay
from rl_replay.errors import SetupError
from rl_replay.rollout.sequence import step_inputs
from rl_replay.spaces import obs_converter

ACT = gym.spaces.Discrete(3)
T, N = 6, 2
CORES = {
    "gru": lambda obs, **kw: GRUAgent(obs, ACT, hidden_size=8, **kw),
    "lstm": lambda obs, **kw: LSTMAgent(obs, ACT, hidden_size=8, **kw),
    "lru": lambda obs, **kw: LRUAgent(obs, ACT, hidden_size=8, readout_sizes=(8,), **kw),
}
IMAGE_36 = gym.spaces.Box(0, 255, (36, 36, 3), np.uint8)  # the smallest frame nature_cnn takes
GRID = gym.spaces.Dict({"image": gym.spaces.Box(0, 255, (7, 7, 3), np.uint8), "direction": gym.spaces.Discrete(4)})
#: encoder -> (observation space, agent kwargs); narrow channels keep the tests fast.
ENCODERS = {
    "nature_cnn": (IMAGE_36, {"encoder_sizes": (16,), "encoder_kwargs": {"channels": (4, 8, 8)}}),
    "impala_cnn": (
        gym.spaces.Box(0, 255, (12, 12, 3), np.uint8),
        {"encoder_sizes": (16,), "encoder_kwargs": {"channels": (4, 8)}},
    ),
    "grid_cnn": (GRID, {"encoder_sizes": (), "encoder_kwargs": {"image_scale": 0.1}}),
}


def batch(space: gym.Space, n: int, seed: int = 0):
    """``n`` observations of ``space`` as the collector converts them (uint8 images stay uint8)."""
    space.seed(seed)
    samples = [space.sample() for _ in range(n)]
    if isinstance(space, gym.spaces.Dict):
        stacked = {k: np.stack([s[k] for s in samples]) for k in space.spaces}
    else:
        stacked = np.stack(samples)
    return obs_converter(space)(stacked)


def sequence(space: gym.Space, seed: int = 0) -> TensorDict:
    """(T, N) stored rows; env 0 starts an episode at row 3."""
    obs = torch.stack([batch(space, N, seed * 100 + t) for t in range(T)])
    is_first = torch.zeros(T, N, dtype=torch.bool)
    is_first[3, 0] = True
    action = torch.randint(0, 3, (T, N), generator=torch.Generator().manual_seed(seed))
    return TensorDict(observation=obs, is_first=is_first, action=action, batch_size=[T, N])


def gradients(agent, data, start_state, run):
    """Outputs and gradients (parameters and start state) of a loss on every head."""
    agent.zero_grad(set_to_none=True)
    start = start_state.clone().apply(lambda x: x.requires_grad_(True))
    out = run(data, start)
    w = torch.linspace(-1.0, 1.0, T * N).view(T, N)
    (w * out["log_prob"] + 0.1 * out["entropy"] + out["value"].square()).sum().backward()
    grads = {n: p.grad.clone() for n, p in agent.named_parameters()}
    grads.update({f"start.{k}": v.grad for k, v in start.items()})
    return out.detach(), grads


@pytest.mark.parametrize("core", sorted(CORES))
@pytest.mark.parametrize("encoder", sorted(ENCODERS))
def test_replay_equals_plain_autograd_bit_for_bit(encoder, core):
    torch.manual_seed(0)
    space, kwargs = ENCODERS[encoder]
    agent = CORES[core](space, encoder=encoder, **kwargs)
    data = sequence(space)
    image = data["observation"] if isinstance(data["observation"], torch.Tensor) else data["observation", "image"]
    assert image.dtype == torch.uint8  # what the blocks save
    start_state = agent.initial_state(N).apply(lambda x: torch.randn_like(x))
    acc = GradientAccumulator()
    replayed, got = gradients(agent, data, start_state, lambda d, s: replay_sequence(Policy.of(agent), d, s, acc))
    assert acc.blocks_replayed == T
    plain, want = gradients(agent, data, start_state, lambda d, s: plain_sequence(agent, d, s)[0])
    for key in ("log_prob", "entropy", "value"):
        assert torch.equal(replayed[key], plain[key]), key
    convs = [k for k in want if k.startswith("encoder.convs.") and k.endswith("weight")]
    assert convs and all(want[k].abs().sum() > 0 for k in convs), "the convolutions got no gradient"
    assert all(g.abs().sum() > 0 for k, g in want.items() if k.startswith("start."))
    assert_grads_match(got, want, f"encoder-{encoder}-{core}", rtol=0, atol=0)


def _plain_saved_bytes(agent, inputs) -> int:
    """Bytes of the unique storages plain autograd keeps for one step's backward (no parameters)."""
    params = {p.untyped_storage().data_ptr() for p in agent.parameters()}
    storages: dict[int, int] = {}

    def pack(t):
        s = t.untyped_storage()
        if s.data_ptr() not in params:
            storages[s.data_ptr()] = s.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        agent(**inputs)
    return sum(storages.values())


def test_an_image_step_saves_the_uint8_frame_and_the_state():
    torch.manual_seed(0)
    space = gym.spaces.Box(0, 255, (84, 84, 3), np.uint8)
    agent = GRUAgent(
        space, gym.spaces.Discrete(4), encoder="nature_cnn", encoder_sizes=(256,), hidden_size=256, activation="relu"
    )
    n = 4
    state = agent.initial_state(n).apply(lambda x: torch.randn_like(x).requires_grad_(True))
    inputs = step_inputs(batch(space, n), state, torch.zeros(n, dtype=torch.bool))
    acc = GradientAccumulator()
    out = replay(agent, acc, inputs)
    frame, h, is_first = n * 84 * 84 * 3, n * 256 * 4, n
    assert acc.saved_bytes == frame + h + is_first
    out["outputs", "value"].sum().backward()  # the saved uint8 frame replays
    assert acc.blocks_replayed == 1 and agent.encoder.convs[0].weight.grad.abs().sum() > 0
    # Plain autograd keeps the float frame and every activation instead: several times more.
    assert _plain_saved_bytes(agent, inputs) > 5 * acc.saved_bytes


# ------------------------------------------------------------------ image layouts
@pytest.mark.parametrize(
    "shape, layout, chw",
    [
        ((84, 84), "hw", (1, 84, 84)),  # grayscale
        ((84, 84, 3), "hwc", (3, 84, 84)),  # channel-last colour
        ((7, 7, 3), "hwc", (3, 7, 7)),  # MiniGrid's view
        ((4, 84, 84), "chw", (4, 84, 84)),  # FrameStackObservation of grayscale frames
        ((4, 84, 84, 3), "shwc", (12, 84, 84)),  # stacked colour frames
    ],
)
def test_image_layouts(shape, layout, chw):
    assert resolve_image_layout(shape) == (layout, chw)


def test_image_layout_override_for_channel_last_views_with_many_channels():
    # MiniGrid's one-hot view (OneHotPartialObsWrapper) is (7, 7, 20): channel-last, which the
    # shape alone would read as 7 stacked 7x20 frames.
    assert resolve_image_layout((7, 7, 20)) == ("chw", (7, 7, 20))
    assert resolve_image_layout((7, 7, 20), "hwc") == ("hwc", (20, 7, 7))
    assert resolve_image_layout((84, 84, 3), "chw") == ("chw", (84, 84, 3))
    space = gym.spaces.Box(0, 1, (7, 7, 20), np.uint8)
    encoder = ConvEncoder(space, "grid_cnn", [], torch.nn.ReLU, image_scale=1.0, image_layout="hwc")
    assert encoder.convs[0].in_channels == 20
    frame = torch.zeros(2, 7, 7, 20, dtype=torch.uint8)
    frame[0, 3, 6, 5] = 1  # one channel of one cell set: a different output than all zeros
    out = encoder(frame)
    assert out.shape == (2, encoder.out_features) and not torch.equal(out[0], out[1])
    for bad_shape, bad in (((7, 7, 20), "whc"), ((84, 84), "hwc"), ((2, 40, 40, 3), "chw")):
        with pytest.raises(SetupError, match="image_layout"):
            ConvEncoder(gym.spaces.Box(0, 255, bad_shape, np.uint8), "grid_cnn", [], torch.nn.ReLU, image_layout=bad)


@pytest.mark.parametrize("shape", [(40, 40), (40, 40, 3), (4, 40, 40), (2, 40, 40, 3)])
def test_encoder_converts_each_layout_to_channels_first(shape):
    """The encoder's convolutions see the frame as (N, C, H, W) floats in [0, 1]."""
    torch.manual_seed(0)
    space = gym.spaces.Box(0, 255, shape, np.uint8)
    encoder = ConvEncoder(space, "nature_cnn", (), torch.nn.ReLU, channels=(4, 8, 8))
    x = batch(space, 2)
    f = x.to(torch.float32) / 255.0
    if len(shape) == 2:
        chw = f.unsqueeze(1)
    elif len(shape) == 3 and shape[0] < shape[-1]:
        chw = f
    elif len(shape) == 3:
        chw = f.permute(0, 3, 1, 2)
    else:
        chw = f.permute(0, 1, 4, 2, 3).reshape(2, shape[0] * shape[3], shape[1], shape[2])
    torch.testing.assert_close(encoder(x), encoder.convs(chw.contiguous()).flatten(1))


def test_dict_observation_concatenates_the_vector_keys():
    torch.manual_seed(0)
    space = gym.spaces.Dict(
        {
            "image": GRID["image"],
            "direction": gym.spaces.Discrete(4),
            "speed": gym.spaces.Box(-1.0, 1.0, (2,), np.float32),
        }
    )
    encoder = ConvEncoder(space, "grid_cnn", (), torch.nn.ReLU, image_scale=0.1)
    assert encoder.out_features == 64 + 4 + 2
    x = batch(space, 3)
    out = encoder(x)
    conv = encoder.convs(x["image"].to(torch.float32).mul(0.1).permute(0, 3, 1, 2)).flatten(1)
    torch.testing.assert_close(out, torch.cat([conv, x["direction"], x["speed"]], dim=-1))


def test_separate_critic_and_skip_with_a_cnn():
    space, kwargs = ENCODERS["grid_cnn"]
    agent = GRUAgent(space, ACT, hidden_size=8, separate_critic=True, skip=True, encoder="grid_cnn", **kwargs)
    assert isinstance(agent.critic_encoder, ConvEncoder) and agent.actor_mlp is not None
    out = agent(**step_inputs(batch(space, N), agent.initial_state(N), torch.ones(N, dtype=torch.bool)))
    assert out["outputs", "value"].shape == (1, N) and set(out["state"].keys()) == {"h", "h_critic"}


# ------------------------------------------------------------------ refused setups
@pytest.mark.parametrize(
    "space, kwargs, message",
    [
        (
            gym.spaces.Box(0, 255, (20, 20, 3), np.uint8),
            {"encoder": "nature_cnn"},
            r"too small for its convolutions; use grid_cnn",
        ),
        (
            gym.spaces.Box(-1.0, 1.0, (4,), np.float32),
            {"encoder": "nature_cnn"},
            r"needs an image observation .* Use encoder: mlp",
        ),
        (
            gym.spaces.Dict({"a": GRID["image"], "b": GRID["image"]}),
            {"encoder": "grid_cnn"},
            r"exactly one image key .*\['a', 'b'\].*encoder_kwargs.image_key",
        ),
        (
            GRID,
            {"encoder": "grid_cnn", "encoder_kwargs": {"image_key": "direction"}},
            r"image_key 'direction' is not an image subspace",
        ),
        (IMAGE_36, {"encoder": "resnet"}, r"encoder must be mlp or one of \['grid_cnn', 'impala_cnn', 'nature_cnn'\]"),
        (IMAGE_36, {"encoder_kwargs": {"image_scale": 0.1}}, r"encoder_kwargs .* are for the convolutional encoders"),
        (IMAGE_36, {"encoder": "nature_cnn", "encoder_kwargs": {"image_scale": -1}}, r"image_scale must be a positive"),
        (IMAGE_36, {"encoder": "nature_cnn", "encoder_kwargs": {"colour": 1}}, r"bad encoder_kwargs .*colour"),
    ],
    ids=[
        "too_small",
        "not_an_image",
        "two_images",
        "bad_image_key",
        "unknown",
        "kwargs_for_mlp",
        "bad_scale",
        "unknown_kwarg",
    ],
)
@pytest.mark.parametrize("core", sorted(CORES))
def test_bad_encoder_setups_are_one_line_errors(core, space, kwargs, message):
    with pytest.raises(SetupError, match=message) as info:
        CORES[core](space, **kwargs)
    assert "\n" not in str(info.value)
