"""Environments from the config (module:EnvId, env.imports, env.wrappers) and every
observation space the converter supports, trained end to end with the reference agents."""

from __future__ import annotations

import pickle

import gymnasium as gym
import numpy as np
import obs_envs  # noqa: F401  (registers test/DictObs-v0, test/TupleObs-v0, test/ImageObs-v0)
import pytest
import torch
from conftest import assert_grads_match, collect_replayed
from tensordict import TensorDict
from test_collector import plain_autograd_update

from rl_replay.agents.gru import GRUAgent
from rl_replay.agents.mlp import MLPAgent
from rl_replay.algorithms.a2c import A2C
from rl_replay.algorithms.losses import total_loss
from rl_replay.config import Config, load_config
from rl_replay.errors import SetupError
from rl_replay.rollout.collector import Collector
from rl_replay.rollout.environment import make_vector_env
from rl_replay.run.setup import build
from rl_replay.spaces import flat_size, obs_converter

AGENTS = {"mlp": ("mlp", "{hidden_sizes: [16]}"), "gru": ("gru", "{hidden_size: 8, encoder_sizes: [8]}")}

USER_MODULE = '''
import gymnasium as gym
import numpy as np


class Blink(gym.Env):
    """Observation Discrete(3); two-step episodes."""

    observation_space = gym.spaces.Discrete(3)
    action_space = gym.spaces.Discrete(2)

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        self.t = 0
        return 0, {}

    def step(self, action):
        self.t += 1
        return self.t % 3, float(action), self.t >= 2, False, {}


class Tag(gym.ObservationWrapper):
    """Records the order in which wrappers were applied (innermost first)."""

    def __init__(self, env, name):
        super().__init__(env)
        self.order = getattr(env, "order", []) + [name]

    def observation(self, obs):
        return obs


gym.register(id="{env_id}", entry_point="{module}:Blink")
'''


@pytest.fixture
def user_module(tmp_path, monkeypatch):
    """A module written by the test that registers an env on import; returns (module, env id)."""
    module, env_id = f"user_envs_{tmp_path.name[-12:].replace('-', '_')}", f"UserBlink{abs(hash(tmp_path)) % 10**6}-v0"
    (tmp_path / f"{module}.py").write_text(USER_MODULE.replace("{env_id}", env_id).replace("{module}", module))
    monkeypatch.syspath_prepend(str(tmp_path))
    yield module, env_id
    gym.registry.pop(env_id, None)


def small_cfg(run_dir, *overrides, agent="mlp"):
    target, kwargs = AGENTS[agent]
    return load_config(
        None,
        [
            "env.num_envs=2",
            "collector.num_steps=6",
            "total_env_steps=24",
            "log.wandb_mode=disabled",
            "log.progress=false",
            f"agent.target={target}",
            f"agent.kwargs={kwargs}",
            f"run_dir={run_dir}",
            *overrides,
        ],
    )


def train_two_updates_in_process(cfg):
    trainer = build(cfg)
    before = [p.detach().clone() for p in trainer.model.parameters()]
    metrics = trainer.train()
    assert trainer.update == 2
    assert np.isfinite(metrics["train/loss_policy"])
    assert any(not torch.equal(a, b) for a, b in zip(before, trainer.model.parameters()))
    return trainer


# ------------------------------------------------------------------ ids, imports, wrappers
def test_env_id_in_module_form_imports_the_module(user_module, tmp_path):
    module, env_id = user_module
    assert env_id not in gym.registry
    envs = make_vector_env(f"{module}:{env_id}", 2)
    assert envs.single_observation_space == gym.spaces.Discrete(3)
    envs.close()
    train_two_updates_in_process(small_cfg(tmp_path / "run", f"env.id={module}:{env_id}"))


def test_env_imports_register_a_bare_id(user_module, tmp_path):
    module, env_id = user_module
    with pytest.raises(SetupError, match=rf"unknown environment id '{env_id}'.*env.imports"):
        build(small_cfg(tmp_path / "no", f"env.id={env_id}"))
    assert not (tmp_path / "no").exists()
    train_two_updates_in_process(small_cfg(tmp_path / "run", f"env.id={env_id}", f"env.imports=[{module}]"))


def test_unknown_id_keeps_similar_ids_and_says_how_to_register():
    with pytest.raises(SetupError) as info:
        make_vector_env("CartPol-v1", 1)
    message = str(info.value)
    assert "Similar ids: CartPole-v0, CartPole-v1" in message
    assert "gymnasium.register" in message and "env.imports" in message and "\n" not in message


@pytest.mark.parametrize(
    "env_id, imports, match",
    [
        ("no_such_module_xyz:Env-v0", [], "cannot import module 'no_such_module_xyz'"),
        ("CartPole-v1", ["no_such_module_xyz"], r"env.imports: cannot import module 'no_such_module_xyz'"),
    ],
)
def test_bad_imports_are_one_line(env_id, imports, match):
    with pytest.raises(SetupError, match=match):
        make_vector_env(env_id, 1, imports=imports)


def test_wrappers_from_config_apply_in_order(user_module, tmp_path):
    module, env_id = user_module
    wrappers = (
        f"env.wrappers=[{{target: '{module}:Tag', kwargs: {{name: a}}}}, "
        f"{{target: '{module}.Tag', kwargs: {{name: b}}}}, "
        "{target: 'gymnasium.wrappers:TimeLimit', kwargs: {max_episode_steps: 1}}]"
    )
    trainer = train_two_updates_in_process(
        small_cfg(tmp_path / "run", f"env.id={env_id}", f"env.imports=[{module}]", wrappers)
    )
    env = trainer.collector.envs.envs[0]
    assert isinstance(env, gym.wrappers.TimeLimit) and env._max_episode_steps == 1  # applied last: outermost
    assert env.env.order == ["a", "b"]
    # TimeLimit(1) truncates every episode after one step.
    assert trainer.recent_returns and len(trainer.recent_returns) >= 2 * 2


@pytest.mark.parametrize(
    "spec, match",
    [
        ("{target: 'gymnasium.wrappers:NoSuchWrapper'}", "has no attribute 'NoSuchWrapper'"),
        ("{target: 'gymnasium.wrappers:TimeLimit', kwargs: {bogus: 1}}", r"env.wrappers\[0\] .* failed"),
    ],
)
def test_bad_wrappers_fail_before_the_run_dir(tmp_path, spec, match):
    with pytest.raises(SetupError, match=match):
        build(small_cfg(tmp_path / "run", f"env.wrappers=[{spec}]"))
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize(
    "value, match",
    [
        ("[{kwargs: {}}]", r"env.wrappers\[0\].target"),
        ("[{target: x:Y, extra: 1}]", "Unknown key 'extra'"),
        ("[gymnasium.wrappers:TimeLimit]", r"env.wrappers\[0\]"),
    ],
)
def test_wrapper_config_is_validated(value, match):
    with pytest.raises(ValueError, match=match):
        load_config(None, [f"env.wrappers={value}"])


# ------------------------------------------------------------------ observation conversion
def test_converter_one_hot_nested_and_uint8():
    space = gym.spaces.Dict(
        {
            "d": gym.spaces.Discrete(3, start=1),
            "m": gym.spaces.MultiDiscrete([2, 3]),
            "img": gym.spaces.Box(0, 255, (2, 2), np.uint8),
            "t": gym.spaces.Tuple((gym.spaces.Box(-1, 1, (1,)), gym.spaces.MultiBinary(2))),
        }
    )
    batch = {
        "d": np.array([1, 3]),
        "m": np.array([[0, 2], [1, 0]]),
        "img": np.array([[[0, 255], [1, 2]]] * 2, np.uint8),
        "t": (np.array([[0.5], [-0.5]], np.float32), np.array([[1, 0], [0, 1]], np.int8)),
    }
    out = obs_converter(space)(batch)
    assert isinstance(out, TensorDict) and out.batch_size == torch.Size([2])
    assert torch.equal(out["d"], torch.tensor([[1.0, 0, 0], [0, 0, 1]]))
    assert torch.equal(out["m"], torch.tensor([[1.0, 0, 0, 0, 1], [0, 1, 1, 0, 0]]))
    assert out["img"].dtype == torch.uint8 and out["img"][0, 0, 1] == 255
    assert torch.equal(out["t", "1"], torch.tensor([[1.0, 0], [0, 1]]))
    assert flat_size(space) == 3 + 5 + 4 + 1 + 2

    agent = MLPAgent(space, gym.spaces.Discrete(2), hidden_sizes=(4,))
    flat = agent.flatten_observation(out)
    assert flat.shape == (2, agent.obs_dim) and flat.dtype == torch.float32
    # Fixed key order (the space's: gymnasium sorts a plain dict), images scaled to [0, 1] in the agent.
    assert list(space.spaces) == ["d", "img", "m", "t"]
    torch.testing.assert_close(flat[0, :3], out["d"][0])
    torch.testing.assert_close(flat[0, 3:7], torch.tensor([0, 1, 1 / 255, 2 / 255]))
    torch.testing.assert_close(flat[0, 7:12], out["m"][0])
    torch.testing.assert_close(flat[0, 12:], torch.tensor([0.5, 1, 0]))


def test_unsupported_observation_space_is_one_line():
    with pytest.raises(SetupError, match="cannot handle observation space Text.*env.wrappers"):
        MLPAgent(gym.spaces.Text(5), gym.spaces.Discrete(2))


# ------------------------------------------------------------------ training on each space
@pytest.mark.parametrize("agent", ["mlp", "gru"])
@pytest.mark.parametrize("env_id", ["test/DictObs-v0", "FrozenLake-v1", "test/TupleObs-v0"])
def test_dict_and_discrete_observations_train_two_updates(tmp_path, env_id, agent):
    trainer = train_two_updates_in_process(
        small_cfg(tmp_path / "run", f"env.id={env_id}", "env.imports=[obs_envs]", agent=agent)
    )
    obs = trainer.collector._obs
    if env_id == "FrozenLake-v1":
        assert obs.shape == (2, 16) and obs.sum(-1).eq(1).all()  # one-hot of the cell
    else:
        assert isinstance(obs, TensorDict)


def test_replay_parity_with_dict_observation():
    torch.manual_seed(5)
    envs = make_vector_env("test/DictObs-v0", 3)
    agent = GRUAgent(envs.single_observation_space, envs.single_action_space, hidden_size=16, encoder_sizes=(16,))
    collector = Collector(envs, agent, num_steps=8, seed=2)
    collector.collect()  # start the measured rollout mid-episode with a carried state
    start_state = collector._state.clone()
    rollout, _ = collect_replayed(collector)
    d = rollout.data
    assert isinstance(d["observation"], TensorDict) and d["observation"].batch_size == torch.Size([8, 3])
    assert d["observation", "nested", "code"].shape == (8, 3, 5)
    assert d["is_first"][1:].any()
    cfg = Config()
    total_loss(A2C.loss(d, cfg)).backward()
    replay_grads = {n: p.grad.clone() for n, p in agent.named_parameters()}
    agent.zero_grad(set_to_none=True)
    plain_autograd_update(agent, d.detach(), start_state, cfg)
    assert_grads_match(
        replay_grads, {n: p.grad for n, p in agent.named_parameters()}, "parity_dict_obs", rtol=1e-5, atol=1e-6
    )


def test_uint8_images_are_saved_as_uint8():
    T, N = 6, 2
    saved = {}
    for dtype in ("uint8", "float32"):
        torch.manual_seed(0)
        envs = make_vector_env("test/ImageObs-v0", N, kwargs={"dtype": dtype})
        agent = MLPAgent(envs.single_observation_space, envs.single_action_space, hidden_sizes=(8,))
        rollout, accumulator = collect_replayed(Collector(envs, agent, num_steps=T, seed=0))
        assert rollout.data["observation"].dtype == getattr(torch, dtype)
        saved[dtype] = accumulator.saved_bytes
        envs.close()
    pixels = T * N * 8 * 8 * 3
    # Same blocks except the observation: 1 byte per pixel instead of 4.
    assert saved["float32"] - saved["uint8"] == pixels * 3
    assert saved["uint8"] >= pixels


def test_uint8_images_train(tmp_path):
    train_two_updates_in_process(
        small_cfg(tmp_path / "run", "env.id=test/ImageObs-v0", "env.imports=[obs_envs]", agent="gru")
    )


def test_returns_are_the_envs_own_under_a_reward_wrapper(tmp_path):
    """NormalizeReward rescales the rewards the agent learns from; rollout and evaluation
    returns stay the env's own (CartPole pays 1 per step, so a return is the episode length)."""
    from rl_replay.run.evaluate import evaluate

    wrappers = ["gymnasium.wrappers:NormalizeObservation", "gymnasium.wrappers:NormalizeReward"]
    envs = make_vector_env("CartPole-v1", 3, wrappers=[{"target": t} for t in wrappers])
    agent = MLPAgent(envs.single_observation_space, envs.single_action_space, hidden_sizes=[8])
    collector = Collector(envs, agent, num_steps=40, seed=0)
    rollout = collector.collect()
    assert rollout.episode_returns, "40 random steps end some CartPole episode"
    assert rollout.episode_returns == [float(n) for n in rollout.episode_lengths]
    # The rewards the loss sees are rescaled: without the raw statistics the returns would differ.
    assert not torch.allclose(rollout.data["reward"][rollout.data["valid"]], torch.tensor(1.0))
    result = evaluate(
        agent,
        "CartPole-v1",
        episodes=4,
        num_envs=2,
        deterministic=False,
        env_wrappers=[{"target": t} for t in wrappers],
    )
    assert result["return_mean"] == result["episode_length"]


# ------------------------------------------------------------------ Dict keys without tensors
@pytest.fixture
def fresh_warnings(monkeypatch):
    """The drop warning is printed once per process; each test starts with none printed."""
    from rl_replay.rollout import environment

    monkeypatch.setattr(environment, "_WARNED", set())


def test_text_keys_are_dropped_with_one_warning_line(fresh_warnings, capsys):
    for _ in range(2):  # a run makes its envs again for every evaluation: still one line
        envs = make_vector_env("test/MissionObs-v0", 2)
        assert list(envs.single_observation_space.spaces) == ["direction", "image"]  # Dict sorts its keys
        obs, _ = envs.reset(seed=0)
        assert set(obs) == {"image", "direction"} and obs["image"].dtype == np.uint8
        envs.close()
    lines = capsys.readouterr().err.strip().splitlines()
    assert lines == [
        "warning: dropping the observation keys ['mission'] (mission: Text), which hold no tensors; "
        "keeping ['direction', 'image']. Set env.observation_keys to choose the keys."
    ]


def test_observation_keys_select_without_a_warning(fresh_warnings, capsys):
    envs = make_vector_env("test/MissionObs-v0", 2, observation_keys=["image"])
    assert list(envs.single_observation_space.spaces) == ["image"]
    assert set(envs.reset(seed=0)[0]) == {"image"}
    # The selection pickles (gymnasium's FilterObservation holds a lambda): checkpoints keep the envs.
    assert list(pickle.loads(pickle.dumps(envs.envs[0])).observation_space.spaces) == ["image"]
    envs.close()
    assert capsys.readouterr().err == ""


@pytest.mark.parametrize(
    "env_id, kwargs, keys, message",
    [
        (
            "test/MissionObs-v0",
            {},
            ["image", "nope"],
            r"^env.observation_keys: \['nope'\] not in the observation "
            r"space's keys \['direction', 'image', 'mission'\]\.$",
        ),
        (
            "test/MissionObs-v0",
            {},
            ["mission"],
            r"^env.observation_keys: \['mission'\] are not tensor spaces "
            r".*choose among \['direction', 'image'\]\.$",
        ),
        ("CartPole-v1", {}, ["image"], r"^env.observation_keys \['image'\] selects keys of a Dict observation.*remove"),
        (
            "test/MissionObs-v0",
            {"text_only": True},
            [],
            r"holds nothing rl_replay can turn into tensors; add a wrapper "
            r"in env.wrappers .*minigrid.wrappers:ImgObsWrapper",
        ),
    ],
    ids=["unknown_key", "text_key", "not_a_dict", "nothing_usable"],
)
def test_bad_observation_keys_are_refused_before_the_run(tmp_path, env_id, kwargs, keys, message):
    with pytest.raises(SetupError, match=message) as info:
        make_vector_env(env_id, 1, observation_keys=keys, kwargs=kwargs)
    assert "\n" not in str(info.value)
    overrides = [f"env.id={env_id}", "env.imports=[obs_envs]", f"env.observation_keys=[{', '.join(keys)}]"]
    if kwargs:
        overrides.append("env.kwargs={text_only: true}")
    with pytest.raises(SetupError, match=message):
        build(small_cfg(tmp_path / "run", *overrides))
    assert not (tmp_path / "run").exists()


def test_observation_keys_must_be_strings():
    with pytest.raises(ValueError, match=r"config key 'env.observation_keys\[0\]'"):
        load_config(None, ["env.observation_keys=[1]"])


@pytest.mark.parametrize("encoder", ["grid_cnn", "mlp"])
def test_minigrid_like_dict_trains_with_the_text_dropped(tmp_path, fresh_warnings, encoder):
    kwargs = (
        "{hidden_size: 8, encoder: grid_cnn, encoder_sizes: [], encoder_kwargs: {image_scale: 0.1}}"
        if encoder == "grid_cnn"
        else "{hidden_size: 8, encoder_sizes: [8]}"
    )
    trainer = train_two_updates_in_process(
        small_cfg(
            tmp_path / "run",
            "env.id=test/MissionObs-v0",
            "env.imports=[obs_envs]",
            "agent.target=gru",
            f"agent.kwargs={kwargs}",
            "eval.every=1",
            "eval.episodes=2",
        )
    )
    obs = trainer.collector._obs
    assert set(obs.keys()) == {"image", "direction"} and obs["image"].dtype == torch.uint8


def test_observation_keys_cannot_change_on_resume_and_older_checkpoints_resume(tmp_path):
    from rl_replay.config import config_to_dict
    from rl_replay.run.setup import _check_resume_config

    run = tmp_path / "run"
    build(
        small_cfg(
            run,
            "env.id=test/MissionObs-v0",
            "env.imports=[obs_envs]",
            "env.observation_keys=[image, direction]",
            "checkpoint.every=0",
        )
    ).train()
    with pytest.raises(SetupError, match=r"cannot resume .* with env.observation_keys=\['image'\]"):
        build(resume=run, overrides=("env.observation_keys=[image]",))
    # A checkpoint written before env.observation_keys existed holds no such key: it means the default.
    cfg = small_cfg(run, "env.id=test/MissionObs-v0")
    saved = config_to_dict(cfg)
    del saved["env"]["observation_keys"]
    _check_resume_config(cfg, saved, run)
    with pytest.raises(SetupError, match="env.observation_keys"):
        _check_resume_config(small_cfg(run, "env.id=test/MissionObs-v0", "env.observation_keys=[image]"), saved, run)
