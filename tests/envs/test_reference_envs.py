"""The reference gymnasium environments (repository folder envs/, installed as rl_replay.envs)."""

import importlib
import pickle
import warnings

import gymnasium
import numpy as np
import pytest
from gymnasium.envs.classic_control.cartpole import CartPoleEnv
from gymnasium.utils.env_checker import check_env

import rl_replay.envs as envs
from rl_replay.envs import ChainEnv, MemoryCueEnv, PartialObsCartPole, make_po_cartpole

IDS = ("rl_replay/MemoryCue-v0", "rl_replay/POCartPole-v0", "rl_replay/Chain-v0")


def run_episode(env, actions, seed=None):
    """Roll out `actions` (callable obs -> action) until the episode ends."""
    obs, _ = env.reset(seed=seed)
    observations, rewards, infos = [obs], [], []
    while True:
        obs, reward, terminated, truncated, info = env.step(actions(obs))
        observations.append(obs)
        rewards.append(reward)
        infos.append(info)
        if terminated or truncated:
            return observations, rewards, infos, terminated, truncated


# --------------------------------------------------------------------------- registration


def test_ids_registered():
    for env_id in IDS:
        assert env_id in gymnasium.registry


def test_import_twice_is_harmless():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        import rl_replay.envs as again  # noqa: F401  (cached import)

        importlib.reload(envs)  # re-runs the registration code
    for env_id in IDS:
        assert env_id in gymnasium.registry


def test_registered_time_limits():
    assert gymnasium.spec("rl_replay/MemoryCue-v0").max_episode_steps is None
    assert gymnasium.spec("rl_replay/Chain-v0").max_episode_steps is None
    assert gymnasium.make("rl_replay/POCartPole-v0").spec.max_episode_steps == 500


# --------------------------------------------------------------------------- env_checker


@pytest.mark.parametrize(
    "env",
    [
        MemoryCueEnv(delay=3),
        MemoryCueEnv(delay=0, num_cues=4, noise_dims=2),
        ChainEnv(length=4, obs_dim=2),
    ],
    ids=["memory", "memory-noise", "chain"],
)
def test_check_env_raw(env):
    # The envs have no render modes; without a spec the render check can only warn.
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        check_env(env, skip_render_check=True)


def test_check_env_po_cartpole():
    # The wrapper is the env under test, so it cannot be unwrapped; only the
    # checker's "this is a wrapper" notice is expected.
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        check_env(make_po_cartpole(), skip_render_check=True)
    unexpected = [w for w in caught if "different from the unwrapped" not in str(w.message)]
    assert not unexpected, [str(w.message) for w in unexpected]


def test_check_env_via_make():
    for env_id in ("rl_replay/MemoryCue-v0", "rl_replay/Chain-v0"):
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            check_env(gymnasium.make(env_id).unwrapped)


# --------------------------------------------------------------------------- MemoryCue


def test_memory_spaces():
    env = MemoryCueEnv(delay=2, num_cues=3, noise_dims=4)
    assert env.observation_space.shape == (3 + 2 + 4,)
    assert env.observation_space.dtype == np.float32
    assert env.action_space == gymnasium.spaces.Discrete(3)


@pytest.mark.parametrize("delay", [0, 1, 5])
def test_memory_timeline(delay):
    env = MemoryCueEnv(delay=delay, num_cues=3, noise_dims=2)
    obs0, _ = env.reset(seed=0)
    cue = int(np.argmax(obs0[:3]))
    # Same seed again, so the episode replays the cue peeked at above.
    observations, rewards, infos, terminated, truncated = run_episode(env, lambda o: cue, seed=0)
    np.testing.assert_array_equal(observations[0], obs0)

    # delay + 2 actions: cue step, `delay` distractors, query.
    assert len(rewards) == delay + 2
    assert terminated and not truncated
    assert rewards[:-1] == [0.0] * (delay + 1)

    acted_on = observations[:-1]  # the last one is the terminal observation
    cue_flag = [o[3] for o in acted_on]
    query_flag = [o[4] for o in acted_on]
    cue_visible = [o[:3].any() for o in acted_on]
    assert cue_visible == [True] + [False] * (delay + 1)
    assert cue_flag == [1.0] + [0.0] * (delay + 1)
    assert query_flag == [0.0] * (delay + 1) + [1.0]
    assert observations[-1][4] == 0.0

    # Noise only on distractors; cue and query carry zeros there.
    assert not acted_on[0][5:].any() and not acted_on[-1][5:].any()
    for o in acted_on[1:-1]:
        assert o[5:].any()
    for o in observations:
        assert env.observation_space.contains(o)


def test_memory_correct_and_wrong_action():
    env = MemoryCueEnv(delay=3, num_cues=2, wrong_reward=-0.5)
    for correct in (True, False):
        obs0, _ = env.reset(seed=1)
        cue = int(np.argmax(obs0[:2]))
        answer = cue if correct else 1 - cue
        _, rewards, infos, terminated, _ = run_episode(env, lambda o, answer=answer: answer, seed=1)
        assert terminated
        assert rewards[-1] == (1.0 if correct else -0.5)
        assert infos[-1]["success"] is correct


def test_memory_seed_reproduces_cue():
    env = MemoryCueEnv(delay=1, num_cues=5, noise_dims=3)
    first = run_episode(env, lambda o: 0, seed=123)[0]
    second = run_episode(env, lambda o: 0, seed=123)[0]
    for a, b in zip(first, second):
        np.testing.assert_array_equal(a, b)
    cues = {int(np.argmax(env.reset(seed=s)[0][:5])) for s in range(30)}
    assert len(cues) > 1  # the cue actually varies with the seed


def test_memory_via_make_has_no_time_limit():
    env = gymnasium.make("rl_replay/MemoryCue-v0", delay=200)
    _, rewards, _, terminated, truncated = run_episode(env, lambda o: 0, seed=0)
    assert len(rewards) == 202 and terminated and not truncated


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"delay": -1}, "delay"),
        ({"delay": 2.5}, "delay"),
        ({"num_cues": 1}, "num_cues"),
        ({"noise_dims": -3}, "noise_dims"),
        ({"wrong_reward": "bad"}, "wrong_reward"),
        ({"wrong_reward": float("nan")}, "wrong_reward"),
    ],
)
def test_memory_bad_kwargs(kwargs, match):
    with pytest.raises(ValueError, match=match):
        MemoryCueEnv(**kwargs)


def test_memory_bad_kwargs_via_make():
    with pytest.raises(ValueError, match="delay"):
        gymnasium.make("rl_replay/MemoryCue-v0", delay=-5)


# --------------------------------------------------------------------------- POCartPole


def test_po_cartpole_space():
    env = gymnasium.make("rl_replay/POCartPole-v0")
    full = CartPoleEnv().observation_space
    assert env.observation_space.shape == (2,)
    assert env.observation_space.dtype == np.float32
    np.testing.assert_array_equal(env.observation_space.low, full.low[[0, 2]])
    np.testing.assert_array_equal(env.observation_space.high, full.high[[0, 2]])
    assert isinstance(make_po_cartpole(), PartialObsCartPole)


def test_po_cartpole_matches_cartpole():
    po = gymnasium.make("rl_replay/POCartPole-v0")
    full = CartPoleEnv()
    po_obs, _ = po.reset(seed=7)
    full_obs, _ = full.reset(seed=7)
    actions = [0, 1, 1, 0, 1, 0, 0, 1] * 3
    for action in actions:
        assert po_obs.shape == (2,)
        np.testing.assert_array_equal(po_obs, full_obs[[0, 2]])
        po_obs, po_r, po_term, po_trunc, _ = po.step(action)
        full_obs, full_r, full_term, _, _ = full.step(action)
        assert po_r == full_r and po_term == full_term and not po_trunc
        if po_term:
            break


# --------------------------------------------------------------------------- Chain


@pytest.mark.parametrize("length", [1, 5])
def test_chain_rewards_and_termination(length):
    env = ChainEnv(length=length, obs_dim=3)
    observations, rewards, _, terminated, truncated = run_episode(env, lambda o: 1)
    assert rewards == [float(t + 1) for t in range(length)]
    assert terminated and not truncated
    assert [o[0] for o in observations] == pytest.approx([t / length for t in range(length + 1)])
    assert all(not o[1:].any() for o in observations)


def test_chain_time_limit_truncates():
    env = gymnasium.wrappers.TimeLimit(ChainEnv(length=5), max_episode_steps=3)
    _, rewards, _, terminated, truncated = run_episode(env, lambda o: 0)
    assert rewards == [1.0, 2.0, 3.0]
    assert truncated and not terminated


@pytest.mark.parametrize(
    "kwargs, match",
    [({"length": 0}, "length"), ({"obs_dim": 0}, "obs_dim"), ({"length": "5"}, "length")],
)
def test_chain_bad_kwargs(kwargs, match):
    with pytest.raises(ValueError, match=match):
        ChainEnv(**kwargs)


def test_chain_sync_vector_env():
    vec = gymnasium.vector.SyncVectorEnv([lambda: ChainEnv(length=3)] * 2)
    obs, _ = vec.reset(seed=0)
    assert obs.shape == (2, 3)
    total = np.zeros(2)
    for _ in range(3):
        obs, reward, terminated, truncated, _ = vec.step(np.array([0, 1]))
        total += reward
    np.testing.assert_array_equal(total, [6.0, 6.0])
    assert terminated.all() and not truncated.any()
    vec.close()


def test_chain_make_vec():
    vec = gymnasium.make_vec("rl_replay/Chain-v0", num_envs=2, vectorization_mode="sync", length=2)
    obs, _ = vec.reset(seed=0)
    assert obs.shape == (2, 3)
    _, reward, terminated, _, _ = vec.step(np.array([0, 0]))
    np.testing.assert_array_equal(reward, [1.0, 1.0])
    _, reward, terminated, _, _ = vec.step(np.array([0, 0]))
    np.testing.assert_array_equal(reward, [2.0, 2.0])
    assert terminated.all()
    vec.close()


def test_envs_pickled_under_the_old_package_name_still_load():
    # Checkpoints written before the envs became rl_replay.envs pickle 'envs.memory.MemoryCueEnv'.
    from rl_replay.targets import unpickle

    env = MemoryCueEnv(delay=3)
    env.reset(seed=5)
    new = pickle.dumps(env, protocol=0)
    old = new.replace(b"crl_replay.envs.memory\nMemoryCueEnv", b"cenvs.memory\nMemoryCueEnv")
    assert old != new
    loaded = unpickle(old)
    assert type(loaded) is MemoryCueEnv
    assert [loaded.step(0)[0].tolist() for _ in range(4)] == [env.step(0)[0].tolist() for _ in range(4)]
