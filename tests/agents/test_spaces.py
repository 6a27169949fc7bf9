"""rl_replay/spaces.py: batched gymnasium observations -> the tensors a replay block takes.

Covers the conversion of each space kind (one-hot for Discrete and MultiDiscrete, with
their ``start``; uint8 Boxes kept uint8; other Boxes and MultiBinary as float32; Dict and
Tuple as nested TensorDicts), ``flat_size``, ``leaf_keys`` and ``leaf_scales``, ``flatten``
(key order, per-leaf scales), their agreement on batches a vector env produces, and the
SetupError for spaces the converter cannot handle.
"""

from __future__ import annotations

import gymnasium as gym
import numpy as np
import pytest
import torch
from gymnasium.vector.utils import batch_space, concatenate, create_empty_array
from tensordict import TensorDict

from rl_replay.errors import SetupError
from rl_replay.spaces import check_observation_space, flat_size, flatten, leaf_keys, leaf_scales, obs_converter

Box, Discrete, MultiDiscrete, MultiBinary = (
    gym.spaces.Box,
    gym.spaces.Discrete,
    gym.spaces.MultiDiscrete,
    gym.spaces.MultiBinary,
)


# ------------------------------------------------------------------ leaves
def test_discrete_is_one_hot_from_its_start():
    out = obs_converter(Discrete(3, start=-1))(np.array([-1, 1, 0]))
    assert out.dtype == torch.float32
    assert torch.equal(out, torch.tensor([[1.0, 0, 0], [0, 0, 1], [0, 1, 0]]))


def test_multi_discrete_is_the_one_hots_of_its_parts_concatenated():
    out = obs_converter(MultiDiscrete([3, 2], start=[1, -1]))(np.array([[1, -1], [3, 0]]))
    assert torch.equal(out, torch.tensor([[1.0, 0, 0, 1, 0], [0, 0, 1, 0, 1]]))
    # A 2-D nvec is taken row-major: widths 2, 3, 4, 5.
    out = obs_converter(MultiDiscrete(np.array([[2, 3], [4, 5]])))(np.array([[[1, 2], [3, 0]]]))
    expected = torch.zeros(1, 14)
    expected[0, [1, 2 + 2, 5 + 3, 9 + 0]] = 1
    assert torch.equal(out, expected)


def test_uint8_box_stays_uint8_and_other_boxes_become_float32():
    image = np.arange(2 * 2 * 2 * 3, dtype=np.uint8).reshape(2, 2, 2, 3) * 10
    out = obs_converter(Box(0, 255, (2, 2, 3), np.uint8))(image)
    assert out.dtype == torch.uint8 and torch.equal(out, torch.from_numpy(image))  # not scaled here
    for dtype in (np.float64, np.int32):
        batch = np.array([[1.5, -2.0], [0.25, 3.0]]).astype(dtype)
        out = obs_converter(Box(-5, 5, (2,), dtype))(batch)
        assert out.dtype == torch.float32 and torch.equal(out, torch.tensor(batch, dtype=torch.float32))
    out = obs_converter(MultiBinary([2, 2]))(np.array([[[1, 0], [0, 1]]], np.int8))
    assert out.dtype == torch.float32 and torch.equal(out, torch.tensor([[[1.0, 0], [0, 1]]]))


# ------------------------------------------------------------------ nested spaces
def test_dict_and_tuple_become_nested_tensordicts_of_batch_n():
    space = gym.spaces.Dict(
        {
            "pos": Box(-1, 1, (2,), np.float32),
            "inner": gym.spaces.Tuple((Discrete(2), gym.spaces.Dict({"img": Box(0, 255, (1, 2), np.uint8)}))),
        }
    )
    batch = {
        "pos": np.array([[0.5, -0.5]] * 3, np.float32),
        "inner": (np.array([1, 0, 1]), {"img": np.array([[[7, 255]]] * 3, np.uint8)}),
    }
    out = obs_converter(space)(batch)
    assert isinstance(out, TensorDict) and out.batch_size == torch.Size([3])
    assert out["inner"].batch_size == torch.Size([3]) and set(out["inner"].keys()) == {"0", "1"}
    assert torch.equal(out["inner", "0"], torch.tensor([[0.0, 1], [1, 0], [0, 1]]))
    assert out["inner", "1", "img"].dtype == torch.uint8 and out["inner", "1", "img"][2, 0, 1] == 255
    assert torch.equal(out["pos"], torch.tensor([[0.5, -0.5]] * 3))


def test_leaf_keys_and_scales_follow_the_spaces_order():
    space = gym.spaces.Tuple(
        (
            Box(0, 255, (4,), np.uint8),
            gym.spaces.Dict({"b": Box(0, 1, (1,), np.uint8), "a": Box(0, 255, (1,), np.float32)}),
        )
    )
    assert leaf_keys(space) == [("0",), ("1", "a"), ("1", "b")]  # gymnasium sorts a dict's keys
    # Only a uint8 Box reaching 255 is an image to scale; a uint8 flag or a float are not.
    assert leaf_scales(space) == [1 / 255, 1.0, 1.0]
    assert leaf_keys(Box(0, 1, (3,))) == [()] and leaf_scales(Box(0, 255, (3,), np.uint8)) == [1 / 255]


def test_flatten_orders_leaves_by_the_given_keys_and_scales_them():
    td = TensorDict(
        {"z": torch.tensor([[1.0, 2.0]]), "a": {"img": torch.tensor([[[255, 51]]], dtype=torch.uint8)}}, batch_size=[1]
    )
    keys, scales = [("a", "img"), ("z",)], [1 / 255, 1.0]
    flat = flatten(td, keys, scales)
    assert flat.dtype == torch.float32 and flat.shape == (1, 4)
    torch.testing.assert_close(flat, torch.tensor([[1.0, 0.2, 1.0, 2.0]]))
    # Without keys: the TensorDict's own order, unscaled.
    assert torch.equal(flatten(td), torch.tensor([[1.0, 2.0, 255.0, 51.0]]))
    # A plain tensor: its features flattened, as float32.
    x = torch.arange(12, dtype=torch.uint8).reshape(2, 3, 2)
    assert torch.equal(flatten(x), x.reshape(2, 6).float())
    assert torch.equal(flatten(x, scales=[0.5]), x.reshape(2, 6).float() * 0.5)


SPACES = {  # id: (space, features of one flattened observation)
    "box": (Box(-1, 1, (2, 3), np.float32), 6),
    "image": (Box(0, 255, (4, 4, 3), np.uint8), 48),
    "discrete": (Discrete(5, start=2), 5),
    "multi_discrete": (MultiDiscrete([2, 3, 4]), 9),
    "multi_binary": (MultiBinary(3), 3),
    "dict": (
        gym.spaces.Dict(
            {
                "d": Discrete(3),
                "m": MultiDiscrete([2, 2]),
                "t": gym.spaces.Tuple((MultiBinary(2), Box(0, 255, (2, 2), np.uint8))),
            }
        ),
        3 + 4 + 2 + 4,
    ),
}


@pytest.mark.parametrize("space, width", SPACES.values(), ids=SPACES.keys())
def test_flat_size_is_the_width_flatten_gives_a_vector_envs_batch(space, width):
    space.seed(0)
    n = 4
    batch = concatenate(space, [space.sample() for _ in range(n)], create_empty_array(space, n))
    assert batch_space(space, n).contains(batch)
    out = obs_converter(space)(batch)
    assert out.shape[0] == n
    flat = flatten(out, leaf_keys(space) if isinstance(out, TensorDict) else None, leaf_scales(space))
    assert flat_size(space) == width and flat.shape == (n, width) and flat.dtype == torch.float32
    if isinstance(space, (Discrete, MultiDiscrete)):  # one 1 per part in every row
        assert torch.equal(flat.sum(-1), torch.full((n,), float(np.size(getattr(space, "nvec", 1)))))


# ------------------------------------------------------------------ unsupported spaces
@pytest.mark.parametrize(
    "space, message",
    [
        (
            gym.spaces.Text(4),
            r"^MyAgent cannot handle observation space Text\(1, 4, .*\): supported are Box, "
            r"Discrete, MultiDiscrete, MultiBinary and Dict/Tuple of those\. Add a wrapper in "
            r"env\.wrappers",
        ),
        (
            gym.spaces.Tuple((Discrete(2), gym.spaces.Dict({"t": gym.spaces.Text(4)}))),
            r"^MyAgent cannot handle observation space Text",
        ),
        (gym.spaces.Dict({}), r"^MyAgent: empty Dict observation space Dict\(\)\.$"),
        (gym.spaces.Tuple(()), r"^MyAgent: empty Tuple observation space"),
    ],
    ids=["text", "text_nested", "empty_dict", "empty_tuple"],
)
def test_unsupported_spaces_are_one_line_setup_errors(space, message):
    with pytest.raises(SetupError, match=message) as info:
        check_observation_space(space, "MyAgent")
    assert "\n" not in str(info.value)
    for build in (obs_converter, flat_size):  # both check first
        with pytest.raises(SetupError, match=r"^rl_replay"):
            build(space)
