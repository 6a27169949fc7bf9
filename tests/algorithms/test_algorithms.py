"""rl_replay.algorithms: one constructor and ``update()`` for every registered algorithm,
the registry behind ``loss.algorithm``, the advantage-normalisation default of each
algorithm, and old configs' ``ppo.norm_adv`` read as ``loss.normalize_advantages``."""

from __future__ import annotations

import inspect
import math
from pathlib import Path

import pytest
import torch
import yaml
from tensordict import TensorDict

from rl_replay import config as config_module
from rl_replay.agent import build_agent
from rl_replay.algorithms import A2C, PPO, REGISTRY, REINFORCE, Algorithm, UpdateResult, make_algorithm
from rl_replay.algorithms.stored import block_spans
from rl_replay.config import Config, LossConfig, load_config
from rl_replay.distributed import DistInfo
from rl_replay.rollout.collector import Collector
from rl_replay.rollout.environment import make_vector_env

ROOT = Path(__file__).resolve().parents[2]
TINY = [
    "env.num_envs=2",
    "collector.num_steps=6",
    "ppo.num_minibatches=2",
    "ppo.epochs=1",
    "agent.target=gru",
    "agent.kwargs={hidden_size: 8, encoder_sizes: [8]}",
    "optim.name=adam",
    "log.wandb_mode=disabled",
]


# ------------------------------------------------------------------ registry and interface
def test_config_validation_lists_exactly_the_registered_names():
    # Validating a config reads the names from rl_replay.registry without importing torch.
    assert config_module.ALGORITHM_NAMES == tuple(REGISTRY)  # both read rl_replay.registry.ALGORITHMS
    assert all(issubclass(cls, Algorithm) for cls in REGISTRY.values())
    assert all(issubclass(cls, Algorithm) and not inspect.isabstract(cls) for cls in REGISTRY.values())
    assert (REGISTRY["a2c"], REGISTRY["reinforce"], REGISTRY["ppo"]) == (A2C, REINFORCE, PPO)


def test_every_algorithm_takes_the_one_constructor_signature():
    for cls in REGISTRY.values():
        assert inspect.signature(cls.__init__) == inspect.signature(Algorithm.__init__), cls


@pytest.mark.parametrize("name", sorted(REGISTRY))
def test_every_registered_algorithm_builds_and_updates_once(name):
    cfg = load_config(None, [*TINY, f"loss.algorithm={name}"])
    envs = make_vector_env("CartPole-v1", cfg.env.num_envs)
    torch.manual_seed(0)
    model = build_agent(cfg.agent.target, cfg.agent.kwargs, envs.single_observation_space, envs.single_action_space)
    collector = Collector(envs, model, num_steps=cfg.collector.num_steps, seed=cfg.seed)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    algorithm = make_algorithm(cfg, collector, model, optimizer, DistInfo(), torch.device("cpu"))
    assert type(algorithm) is REGISTRY[name]
    before = [p.detach().clone() for p in model.parameters()]
    result = algorithm.update()
    assert isinstance(result, UpdateResult) and result.rollout.env_steps == 2 * 6
    assert math.isfinite(result.grad_norm) and result.grad_norm > 0
    assert all(math.isfinite(v) for v in result.metrics.values())
    assert "train/loss_policy" in result.metrics and result.metrics["memory/replay_saved_bytes"] > 0
    assert any(not torch.equal(a, b) for a, b in zip(before, model.parameters()))
    envs.close()


def test_an_unknown_algorithm_is_refused_with_the_registered_names():
    with pytest.raises(ValueError, match=r"'loss\.algorithm': 'sac'\. Allowed: a2c, reinforce, ppo"):
        load_config(None, ["loss.algorithm=sac"])
    unvalidated = Config(loss=LossConfig(algorithm="sac"))  # built by hand, never validated
    with pytest.raises(ValueError, match=r"'sac'\. Registered: a2c, reinforce, ppo"):
        make_algorithm(unvalidated, None, None, None, DistInfo(), torch.device("cpu"))


# ------------------------------------------------------------------ advantage normalisation
def test_each_algorithm_has_its_own_normalisation_default():
    unset = LossConfig()
    assert unset.normalize_advantages is None
    assert (
        A2C.normalize_advantages(unset),
        REINFORCE.normalize_advantages(unset),
        PPO.normalize_advantages(unset),
    ) == (False, False, True)
    for value in (True, False):
        given = LossConfig(normalize_advantages=value)
        assert all(cls.normalize_advantages(given) is value for cls in REGISTRY.values())


def test_ppo_reads_loss_normalize_advantages():
    # Formerly refused under PPO; now it turns the per-minibatch normalisation off or on.
    g = torch.Generator().manual_seed(0)
    T, n = 5, 4
    keys = ("log_prob", "old_log_prob", "value", "old_value", "advantage", "return", "entropy")
    batch = TensorDict({k: torch.randn(T, n, generator=g) for k in keys}, batch_size=[T, n])
    batch["valid"] = torch.ones(T, n, dtype=torch.bool)
    policy = {}
    for value in ("true", "false", "null"):
        cfg = load_config(None, ["loss.algorithm=ppo", f"loss.normalize_advantages={value}"])
        policy[value] = float(PPO.loss(batch, cfg)["loss_policy"])
    assert policy["true"] == policy["null"] != policy["false"]


def test_shipped_ppo_configs_still_normalise_advantages():
    ppo_configs = [p for p in sorted((ROOT / "configs").glob("*.yaml")) if load_config(p).loss.algorithm == "ppo"]
    assert len(ppo_configs) >= 5
    for path in ppo_configs:
        assert "norm_adv" not in path.read_text(), path
        assert PPO.normalize_advantages(load_config(path).loss) is True, path


# ------------------------------------------------------------------ ppo.norm_adv in old configs
def old_saved_config(tmp_path, algorithm: str, normalize_advantages: bool, norm_adv: bool) -> Path:
    """A RUN_DIR/config.yaml as written before ppo.norm_adv was retired: every key, both
    normalisation keys with their old meanings."""
    data = config_module.config_to_dict(Config())
    data["loss"].update(algorithm=algorithm, normalize_advantages=normalize_advantages)
    data["ppo"]["norm_adv"] = norm_adv
    path = tmp_path / f"{algorithm}-{normalize_advantages}-{norm_adv}.yaml"
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


@pytest.mark.parametrize("norm_adv", [True, False])
def test_an_old_ppo_run_config_keeps_its_normalisation(tmp_path, norm_adv):
    # Old PPO configs hold loss.normalize_advantages: false (then required under PPO) and
    # the choice in ppo.norm_adv.
    cfg = load_config(old_saved_config(tmp_path, "ppo", False, norm_adv))
    assert cfg.loss.normalize_advantages is norm_adv and PPO.normalize_advantages(cfg.loss) is norm_adv
    assert not hasattr(cfg.ppo, "norm_adv")
    # Overrides still come last (a resume's override of the new key wins).
    again = load_config(
        old_saved_config(tmp_path, "ppo", False, norm_adv), [f"loss.normalize_advantages={not norm_adv}"]
    )
    assert again.loss.normalize_advantages is (not norm_adv)


@pytest.mark.parametrize("algorithm", ["a2c", "reinforce"])
@pytest.mark.parametrize("normalize", [True, False])
def test_an_old_a2c_or_reinforce_config_ignores_ppo_norm_adv(tmp_path, algorithm, normalize):
    # PPO alone read ppo.norm_adv; a2c / reinforce keep loss.normalize_advantages as saved.
    for norm_adv in (True, False):
        cfg = load_config(old_saved_config(tmp_path, algorithm, normalize, norm_adv))
        assert cfg.loss.normalize_advantages is normalize


def test_an_old_user_yaml_and_overrides_with_ppo_norm_adv(tmp_path):
    path = tmp_path / "mine.yaml"
    path.write_text("loss: {algorithm: ppo}\nppo: {epochs: 2, norm_adv: false}\n")
    cfg = load_config(path)
    assert (cfg.ppo.epochs, cfg.loss.normalize_advantages) == (2, False)
    assert load_config(None, ["loss.algorithm=ppo", "ppo.norm_adv=false"]).loss.normalize_advantages is False
    assert load_config(None, ["loss.algorithm=ppo", "ppo={norm_adv: false}"]).loss.normalize_advantages is False
    assert load_config(None, ["ppo.norm_adv=false"]).loss.normalize_advantages is None  # a2c never read it
    with pytest.raises(ValueError, match=r"'ppo\.norm_adv': expected bool, got int 1"):
        load_config(None, ["loss.algorithm=ppo", "ppo.norm_adv=1"])


def test_contradicting_ppo_norm_adv_and_loss_normalize_advantages_are_refused(tmp_path):
    path = tmp_path / "both.yaml"
    path.write_text("loss: {algorithm: ppo, normalize_advantages: true}\nppo: {norm_adv: false}\n")
    with pytest.raises(
        ValueError,
        match=r"'ppo\.norm_adv: false' and 'loss\.normalize_advantages: true'.*"
        r"remove ppo\.norm_adv",
    ):
        load_config(path)
    path.write_text("loss: {algorithm: ppo, normalize_advantages: true}\nppo: {norm_adv: true}\n")
    assert load_config(path).loss.normalize_advantages is True


# ------------------------------------------------- A2C / REINFORCE: replay.block_steps
def _one_update(name: str, block_steps: int, extra: list[str]):
    """One A2C / REINFORCE update on CartPole collected with ``block_steps``: its result, the
    gradients it stepped with and the accumulator its replay blocks shared."""
    cfg = load_config(None, [*TINY, f"loss.algorithm={name}", f"replay.block_steps={block_steps}", *extra])
    envs = make_vector_env("CartPole-v1", cfg.env.num_envs)
    torch.manual_seed(0)
    model = build_agent(cfg.agent.target, cfg.agent.kwargs, envs.single_observation_space, envs.single_action_space)
    collector = Collector(
        envs,
        model,
        num_steps=cfg.collector.num_steps,
        seed=cfg.seed,
        bptt_truncate=cfg.collector.bptt_truncate,
        mode=cfg.collector.mode,
    )
    grads: dict[str, torch.Tensor] = {}

    class Recording(torch.optim.SGD):
        """Keeps the (clipped) gradients it steps with; the update zeroes .grad afterwards."""

        def step(self, closure=None):
            grads.update({n: p.grad.clone() for n, p in model.named_parameters()})
            return super().step(closure)

    optimizer = Recording(model.parameters(), lr=1e-3)
    algorithm = make_algorithm(cfg, collector, model, optimizer, DistInfo(), torch.device("cpu"))
    accumulators = []
    collect = algorithm.collect

    def collect_and_keep():
        rollout, accumulator = collect()
        accumulators.append(accumulator)
        return rollout, accumulator

    algorithm.collect = collect_and_keep
    result = algorithm.update()
    envs.close()
    (accumulator,) = accumulators
    return result, grads, accumulator


@pytest.mark.parametrize("name", ["a2c", "reinforce"])
@pytest.mark.parametrize(
    "extra",
    [
        [],  # 24 rows in blocks of 5 (the last one 4)
        ["collector.bptt_truncate=7"],  # cuts inside blocks
        ["collector.mode=episode", "collector.num_steps=40"],  # rows past an episode's end
    ],
)
@pytest.mark.parametrize("agent", ["custom_agent_module:StepwiseGRUAgent", "gru"])
def test_stored_rollout_blocks_give_the_one_step_collection_gradients(name, extra, agent):
    # A GRU whose forward draws no random numbers, replayed from the stored rows in 5-step
    # blocks. Called step by step, the blocks give bit-identical outputs and gradients to one
    # replay block per collected step; the shipped agent runs each block as one sequence call
    # (its input projection, readout and heads over the 5 * 3 rows at once): float rounding.
    extra = ["collector.num_steps=24", "env.num_envs=3", f"agent.target={agent}", *extra]
    one, g1, acc1 = _one_update(name, 1, extra)
    five, g5, acc5 = _one_update(name, 5, extra)
    same = torch.equal if agent != "gru" else lambda a, b: torch.allclose(a, b, rtol=1e-4, atol=1e-6)
    assert torch.equal(one.rollout.data["action"], five.rollout.data["action"])
    for key in ("log_prob", "entropy", "value", "next_value"):
        assert same(one.rollout.data[key].detach(), five.rollout.data[key].detach()), key
    assert set(g1) == set(g5) and all(g.abs().sum() > 0 for g in g1.values())
    for n in g1:
        assert same(g1[n], g5[n]), n
    losses = [{k: v for k, v in r.metrics.items() if k.startswith("train/")} for r in (one, five)]
    assert losses[0] and losses[0].keys() == losses[1].keys()
    if agent != "gru":
        assert losses[0] == losses[1]
    else:
        assert losses[0] == pytest.approx(losses[1], rel=1e-4, abs=1e-6)
    # Fewer blocks, so fewer saved bytes per step: the k steps' inputs and one start state.
    assert 0 < five.metrics["memory/replay_saved_bytes"] < one.metrics["memory/replay_saved_bytes"]
    assert acc1.num_blocks == one.rollout.data.batch_size[0]
    cut = 7 if "collector.bptt_truncate=7" in extra else None
    assert acc5.num_blocks == len(block_spans(five.rollout.data.batch_size[0], 5, cut))


def test_stored_rollout_blocks_of_a_stateless_agent_are_one_call_each():
    # An MLP has no state: a block's 5 * 3 rows go through the agent in one call (the batched
    # recompute), so the gradient equals the per-step one up to float rounding, not bit for bit.
    extra = ["collector.num_steps=24", "env.num_envs=3", "agent.target=mlp", "agent.kwargs={hidden_sizes: [8]}"]
    _, g1, acc1 = _one_update("a2c", 1, extra)
    _, g5, acc5 = _one_update("a2c", 5, extra)
    assert acc5.num_blocks == 5 and acc1.num_blocks == 24
    for n in g1:
        torch.testing.assert_close(g5[n], g1[n], rtol=1e-5, atol=1e-6)
