"""FSDP1 training on CPU with gloo: gradient parity, build(), checkpoints, torchrun.

Two ranks are spawned inside pytest (``torch.multiprocessing``) with the torchrun
environment variables set, so :func:`rl_replay.distributed.init_from_env` joins the group
exactly as under torchrun; a worker's exception fails the test with its traceback. The
end-to-end tests launch ``python -m torch.distributed.run`` on ``scripts/train.py``.

Gradient parity: each rank collects one rollout through the FSDP-wrapped agent and runs
one backward (replay blocks); the full FSDP gradient must equal the average over ranks of
the plain single-process gradient, recomputed with plain autograd on an unwrapped copy of
the agent from the same rollout (rtol 1e-5, atol 1e-6).
"""

from __future__ import annotations

import copy
import json
import os
import subprocess
import sys
from pathlib import Path

import gymnasium as gym
import numpy as np
import pytest
import torch
from _dist import _CountGathers, free_port, run_ranks
from conftest import assert_grads_match, collect_replayed
from tensordict import TensorDict

ROOT = Path(__file__).resolve().parents[2]
MLP_CPU_CONFIG = ROOT / "configs" / "fsdp_mlp_cpu.yaml"

if not torch.distributed.is_available():  # pragma: no cover
    pytest.skip("torch.distributed is not available", allow_module_level=True)


# --------------------------------------------------------------- plain-autograd reference
def plain_rollout_grads(
    agent: torch.nn.Module, data: TensorDict, final_obs: torch.Tensor, final_is_first: torch.Tensor, cfg
) -> dict[str, torch.Tensor]:
    """Gradients of the collector's loss recomputed with plain autograd on ``agent``.

    Replays the recorded rollout (observations, is_first flags, the sampled actions)
    through ``agent`` from its initial state, rebuilds log_prob / entropy / value and the
    bootstrap ``next_value`` exactly as :class:`rl_replay.rollout.collector.Collector` does, and
    backpropagates the same loss.
    """
    from _reference import plain_sequence

    from rl_replay.algorithms.a2c import A2C
    from rl_replay.algorithms.losses import total_loss
    from rl_replay.rollout.sequence import step_inputs

    T, N = data.batch_size
    agent.zero_grad(set_to_none=True)
    heads, state = plain_sequence(agent, data, agent.initial_state(N, final_obs.device))
    with torch.no_grad():
        bootstrap = agent(**step_inputs(final_obs, state, final_is_first))["outputs", "value"][0]
    plain = data.exclude("next_value").update(heads)
    plain.set("next_value", torch.cat([heads["value"][1:].detach(), bootstrap.unsqueeze(0)]))
    total_loss(A2C.loss(plain, cfg)).backward()
    return {name: p.grad.detach().clone() for name, p in agent.named_parameters()}


def clean_name(name: str) -> str:
    return name.replace("_fsdp_wrapped_module.", "")


# --------------------------------------------------------------------- gradient parity
PARITY_AGENTS = {
    "mlp": ("mlp", {"hidden_sizes": [32, 32]}, ["Linear"], "FULL_SHARD", False),
    "gru": ("gru", {"hidden_size": 24, "encoder_sizes": [24]}, ["Linear"], "FULL_SHARD", False),
    "transformer": (
        "transformer",
        {"d_model": 16, "num_layers": 2, "num_heads": 2, "ff_mult": 2, "context": 2},
        ["TransformerEncoderLayer"],
        "FULL_SHARD",
        False,
    ),
    # distributed.sharding_strategy: the parameters kept gathered between forward and backward,
    # or never sharded (gradients all-reduced)
    "gru-SHARD_GRAD_OP": ("gru", {"hidden_size": 24, "encoder_sizes": [24]}, ["Linear"], "SHARD_GRAD_OP", False),
    "gtrxl-SHARD_GRAD_OP": (
        "gtrxl",
        {"d_model": 16, "num_layers": 2, "num_heads": 2, "window": 4, "encoder_sizes": [16]},
        ["WindowLayer"],
        "SHARD_GRAD_OP",
        False,
    ),
    "gru-NO_SHARD": ("gru", {"hidden_size": 24, "encoder_sizes": [24]}, ["Linear"], "NO_SHARD", False),
    # distributed.collect_gathered: the replay blocks' forwards run on parameters gathered once for
    # the rollout; their backwards recompute through FSDP's own forward
    "gru-gathered": ("gru", {"hidden_size": 24, "encoder_sizes": [24]}, ["Linear"], "FULL_SHARD", True),
    "gtrxl-gathered": (
        "gtrxl",
        {"d_model": 16, "num_layers": 2, "num_heads": 2, "window": 4, "encoder_sizes": [16]},
        ["WindowLayer"],
        "FULL_SHARD",
        True,
    ),
    "gru-SHARD_GRAD_OP-gathered": (
        "gru",
        {"hidden_size": 24, "encoder_sizes": [24]},
        ["Linear"],
        "SHARD_GRAD_OP",
        True,
    ),
}
PARITY_STEPS, PARITY_ENVS = 24, 4


def _parity_worker(rank: int, world_size: int, out_dir: str) -> None:
    import torch.distributed as dist
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    from torch.distributed.fsdp import ShardingStrategy

    from rl_replay.agent import build_agent
    from rl_replay.algorithms.a2c import A2C
    from rl_replay.algorithms.losses import total_loss
    from rl_replay.config import Config
    from rl_replay.distributed import init_from_env, wrap_fsdp
    from rl_replay.rollout.collector import Collector
    from rl_replay.rollout.environment import make_vector_env

    info, device = init_from_env("cpu", "gloo")
    assert (info.rank, info.world_size) == (rank, world_size)
    cfg = Config()
    results = {}
    for name, (target, kwargs, wrap, strategy, gather_once) in PARITY_AGENTS.items():
        envs = make_vector_env("CartPole-v1", PARITY_ENVS)
        torch.manual_seed(0)  # identical initialisation on every rank
        agent = build_agent(target, kwargs, envs.single_observation_space, envs.single_action_space)
        reference = copy.deepcopy(agent)
        model = wrap_fsdp(agent, device, wrap_modules=wrap, sharding_strategy=strategy)
        assert isinstance(model, FSDP) and model._use_orig_params
        assert model.sharding_strategy is ShardingStrategy[strategy]
        assert len(FSDP.fsdp_modules(model)) > 1, "auto-wrap made no inner units"
        torch.manual_seed(1 + rank)  # action sampling differs per rank
        collector = Collector(envs, model, num_steps=PARITY_STEPS, seed=100 + 1000 * rank, gather_once=gather_once)
        with _CountGathers() as collection:
            rollout, accumulator = collect_replayed(collector)
        total_loss(A2C.loss(rollout.data, cfg)).backward()
        assert accumulator.blocks_replayed == PARITY_STEPS
        with FSDP.summon_full_params(model, with_grads=True):
            fsdp = {clean_name(n): p.grad.detach().clone() for n, p in model.named_parameters()}
        data = rollout.data.detach()
        # The collector's state after the rollout: what it bootstrapped next_value from.
        local = plain_rollout_grads(reference, data, collector._obs, collector._is_first, cfg)
        mean = {}
        per_rank = {}
        for key, grad in local.items():
            both = [torch.empty_like(grad) for _ in range(world_size)]
            dist.all_gather(both, grad)
            per_rank[key] = both
            mean[key] = torch.stack(both).sum(0) / world_size
        first_obs = [torch.empty_like(data["observation"][0]) for _ in range(world_size)]
        dist.all_gather(first_obs, data["observation"][0].contiguous())
        episodes_started = int(data["is_first"][1:].sum())
        envs.close()
        if rank == 0:
            results[name] = {
                "fsdp": fsdp,
                "mean": mean,
                "per_rank": per_rank,
                "first_obs": first_obs,
                "episodes_started": episodes_started,
                "collection_gathers": collection.calls,
                "units": sum(unit._handle is not None for unit in FSDP.fsdp_modules(model)),  # with parameters
            }
    # PPO's collection (no graph, rows stored): the same rollout whether the parameters are gathered
    # per step or once for the rollout, from the same seeds.
    envs = make_vector_env("CartPole-v1", PARITY_ENVS)
    target, kwargs, wrap, _, _ = PARITY_AGENTS["gtrxl-gathered"]
    torch.manual_seed(0)
    agent = build_agent(target, kwargs, envs.single_observation_space, envs.single_action_space)
    model = wrap_fsdp(agent, device, wrap_modules=wrap)
    stored = {}
    for gather_once in (False, True):
        collector = Collector(envs, model, num_steps=PARITY_STEPS, seed=7 + 1000 * rank, gather_once=gather_once)
        torch.manual_seed(3 + rank)
        with _CountGathers() as collection:
            rollout = collector.collect()
        stored[gather_once] = (rollout.data, collection.calls)
    envs.close()
    results["stored"] = {
        "equal": all(
            torch.equal(stored[False][0][k], stored[True][0][k])
            for k in stored[False][0].keys(include_nested=True, leaves_only=True)
        ),
        "gathers": (stored[False][1], stored[True][1]),
        "units": sum(unit._handle is not None for unit in FSDP.fsdp_modules(model)),
        "forward_restored": all("forward" not in vars(unit) for unit in FSDP.fsdp_modules(model)),
    }
    if rank == 0:
        torch.save(results, Path(out_dir) / "parity.pt")


@pytest.fixture(scope="module")
def parity_results(tmp_path_factory):
    out = tmp_path_factory.mktemp("parity")
    run_ranks(_parity_worker, str(out))
    return torch.load(out / "parity.pt", weights_only=False)


@pytest.mark.parametrize("agent", list(PARITY_AGENTS))
def test_fsdp_gradient_is_the_mean_of_single_process_gradients(parity_results, agent):
    r = parity_results[agent]
    # The ranks collected different experience, so the average is not either rank's.
    assert not torch.equal(r["first_obs"][0], r["first_obs"][1])
    differs = any(not torch.allclose(a, b, rtol=1e-3, atol=1e-5) for a, b in r["per_rank"].values())
    assert differs, "both ranks produced the same gradient: the parity check would be vacuous"
    assert r["episodes_started"] > 0, "no episode boundary inside the rollout"
    assert_grads_match(r["fsdp"], r["mean"], f"fsdp-{agent}", rtol=1e-5, atol=1e-6)
    if PARITY_AGENTS[agent][4]:
        # one all-gather per unit for the whole rollout (the replay blocks' forwards and the bootstrap value)
        assert r["collection_gathers"] == r["units"]
    elif PARITY_AGENTS[agent][3] == "FULL_SHARD":
        # the control: every forward gathers again (PARITY_STEPS blocks and the bootstrap value; FSDP
        # keeps only the root unit gathered after its forward)
        assert r["collection_gathers"] >= (r["units"] - 1) * (PARITY_STEPS + 1) + 1 > r["units"]


def test_stored_collection_gathered_once_is_the_same_rollout(parity_results):
    r = parity_results["stored"]
    assert r["equal"], "collection on parameters gathered once gave another rollout than per-step gathers"
    per_step, once = r["gathers"]
    # at most once per unit (FSDP may have left the root unit gathered after the earlier rollout)
    assert 0 < once <= r["units"] and per_step >= (r["units"] - 1) * (PARITY_STEPS + 1)
    assert r["forward_restored"], "a unit kept the collection's forward after the rollout"


# ------------------------------------------------------- build(), checkpoint, exact resume
def _build_worker(rank: int, world_size: int, run_dir: str) -> None:
    from dataclasses import replace

    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    from torch.distributed.fsdp import ShardingStrategy

    from rl_replay.agent import Agent
    from rl_replay.config import load_config
    from rl_replay.errors import SetupError
    from rl_replay.run.setup import build
    from rl_replay.rundir.checkpoint import load_checkpoint
    from rl_replay.rundir.env_state_file import read_env_state, run_binding
    from rl_replay.rundir.trust import user_secret

    overrides = [
        f"run_dir={run_dir}",
        "log.progress=false",
        "log.wandb_mode=disabled",
        "total_env_steps=1024",
        "checkpoint.every=0",
    ]
    cfg = load_config(MLP_CPU_CONFIG, overrides)

    # CPU offload on a CPU-only device fails at start-up, before the run exists.
    offload = replace(cfg, run_dir=run_dir + "-offload", distributed=replace(cfg.distributed, cpu_offload=True))
    with pytest.raises(SetupError, match="cpu_offload=true needs CUDA"):
        build(offload)
    assert not Path(run_dir + "-offload").exists()
    # So does evaluation during training (FSDP's forward is collective).
    evaluating = replace(cfg, run_dir=run_dir + "-eval", eval=replace(cfg.eval, every=1))
    with pytest.raises(SetupError, match="eval.every is not supported under torchrun.*scripts/evaluate.py"):
        build(evaluating)
    assert not Path(run_dir + "-eval").exists()
    # And the horizon metric (it replays one rank's episode alone).
    horizon = replace(cfg, run_dir=run_dir + "-horizon", log=replace(cfg.log, horizon_every=1))
    with pytest.raises(SetupError, match="log.horizon_every is not supported under torchrun.*grad_horizon.py"):
        build(horizon)
    assert not Path(run_dir + "-horizon").exists()

    trainer = build(cfg)
    model = trainer.model
    assert isinstance(model, FSDP) and model._use_orig_params
    assert model.sharding_strategy is ShardingStrategy.FULL_SHARD
    inner = [m for m in FSDP.fsdp_modules(model) if m is not model]
    assert len(inner) == 6 and all(type(m.module) is torch.nn.Linear for m in inner)
    assert isinstance(trainer.collector.policy.agent, Agent) and trainer.collector.policy.agent is model.module
    assert trainer.collector.policy.module is model
    assert trainer.num_updates == 4  # 1024 steps / (2 ranks x 4 envs x 32 steps)
    # Every rank starts from rank 0's initialisation although the ranks seed differently.
    with FSDP.summon_full_params(model):
        init = {clean_name(n): p.detach().clone() for n, p in model.named_parameters()}
    gathered = [None] * world_size
    torch.distributed.all_gather_object(gathered, init)
    for key in init:
        assert torch.equal(gathered[0][key], gathered[1][key]), key

    # Two updates, a checkpoint, two more updates: the uninterrupted reference.
    trainer.step()
    trainer.step()
    trainer.save()
    if rank == 0:
        saved = load_checkpoint(run_dir)
        single = {
            "update",
            "env_steps",
            "agent",
            "optimizer",
            "collector",
            "rng",
            "recent_returns",
            "wandb_id",
            "config",
            "config_sha256",
            "env_state",
        }
        assert set(saved) == single | {"world_size"} and saved["world_size"] == world_size
        # Each rank's sub-envs are in the signed env_state.pkl that the checkpoint names.
        found = read_env_state(run_dir, saved["env_state"], user_secret(), run_binding(run_dir))
        assert found.note is None and len(found.pickles) == world_size and found.pickles[0] != found.pickles[1]
        assert saved["update"] == 2 and saved["env_steps"] == 2 * 256
        assert set(saved["agent"]) == set(init)  # the plain agent's names (it has no buffers)
        assert len(saved["collector"]) == len(saved["rng"]) == len(saved["recent_returns"]) == world_size
        assert not torch.equal(saved["collector"][0]["obs"], saved["collector"][1]["obs"])
    trainer.step()
    trainer.step()
    with FSDP.summon_full_params(model):
        expected = {clean_name(n): p.detach().clone() for n, p in model.named_parameters()}
    trainer.logger.close()

    resumed = build(resume=run_dir)
    assert resumed.update == 2 and resumed.env_steps == 2 * 256
    resumed.train()
    assert resumed.update == 4
    with FSDP.summon_full_params(resumed.model):
        got = {clean_name(n): p.detach().clone() for n, p in resumed.model.named_parameters()}
    for key in expected:
        torch.testing.assert_close(got[key], expected[key], rtol=0, atol=0, msg=lambda m, k=key: f"{k}: {m}")


def test_build_wraps_full_shard_and_resume_continues_exactly(tmp_path):
    run_ranks(_build_worker, str(tmp_path / "run"))
    lines = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [x["update"] for x in lines] == [3, 4]  # only the resumed train() logged, once each


def test_cpu_offload_on_cpu_is_a_setup_error(tmp_path):
    from rl_replay.config import load_config
    from rl_replay.distributed import wrap_fsdp
    from rl_replay.errors import SetupError
    from rl_replay.run.setup import build

    with pytest.raises(SetupError, match="distributed.cpu_offload=true needs CUDA.*cpu_offload=false"):
        wrap_fsdp(torch.nn.Linear(2, 2), torch.device("cpu"), cpu_offload=True)
    run_dir = tmp_path / "run"
    cfg = load_config(
        MLP_CPU_CONFIG,
        [f"run_dir={run_dir}", "distributed.cpu_offload=true", "log.wandb_mode=disabled", "log.progress=false"],
    )
    with pytest.raises(SetupError, match="cpu_offload"):
        build(cfg)  # one process: not an FSDP run at all
    assert not run_dir.exists()


# ------------------------------------------------------- episode mode: ranks stop together
def _episode_worker(rank: int, world_size: int, run_dir: str) -> None:
    from rl_replay.config import load_config
    from rl_replay.rollout.collector import EPISODE_SYNC_STEPS
    from rl_replay.run.setup import build

    # One CartPole env per rank, seeded per rank: the ranks' episodes end at different
    # steps. A rank that stopped collecting alone would leave the other waiting inside
    # FSDP's all-gather (the test's timeout would fire), or in the update's collectives.
    for gather_once in ("false", "true"):
        cfg = load_config(
            MLP_CPU_CONFIG,
            [
                f"run_dir={run_dir}-{gather_once}",
                "log.progress=false",
                "log.wandb_mode=disabled",
                "env.num_envs=1",
                "collector.mode=episode",
                "collector.num_steps=500",
                "checkpoint.every=0",
                "loss.algorithm=ppo",
                "ppo.num_minibatches=1",
                "ppo.epochs=1",
                f"distributed.collect_gathered={gather_once}",
            ],
        )
        trainer = build(cfg)
        try:
            seen = []
            for _ in range(3):
                rollout = trainer.algorithm.update().rollout
                T, lengths = rollout.data.batch_size[0], rollout.episode_lengths
                gathered = [None] * world_size
                torch.distributed.all_gather_object(gathered, (T, lengths))
                # Same number of steps everywhere: the longest episode over all ranks (per-step
                # gathers: the ranks agree at every step), or the first sync step at or after its
                # end (parameters gathered once: the ranks agree every EPISODE_SYNC_STEPS steps).
                assert len({t for t, _ in gathered}) == 1, gathered
                longest = max(length for _, ls in gathered for length in ls)
                if gather_once == "true":
                    assert T == min(500, -(-longest // EPISODE_SYNC_STEPS) * EPISODE_SYNC_STEPS), gathered
                else:
                    assert T == longest, gathered
                # Rows after a rank's own episode ended are padding, not transitions.
                assert int(rollout.data["valid"].sum()) == sum(lengths)
                seen.append([ls[0] for _, ls in gathered])
            assert any(a != b for a, b in seen), f"vacuous: the ranks' episodes had equal lengths {seen}"
        finally:
            trainer.close()
            trainer.collector.envs.close()


def test_episode_mode_ranks_collect_the_same_number_of_steps(tmp_path):
    run_ranks(_episode_worker, str(tmp_path / "run"))


# ------------------------------------------- non-finite env output on one rank stops every rank
class _NaNOnRankOne(gym.Env):
    """Finite everywhere except on rank 1, whose envs are seeded from 1000 up: NaN reward at step 3."""

    observation_space = gym.spaces.Box(-1.0, 1.0, (4,), np.float32)
    action_space = gym.spaces.Discrete(2)

    def __init__(self):
        self.bad, self.t = False, 0

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        if seed is not None:
            self.bad = seed >= 1000
        self.t = 0
        return np.zeros(4, np.float32), {}

    def step(self, action):
        self.t += 1
        return np.zeros(4, np.float32), float("nan") if self.bad and self.t == 3 else 1.0, False, False, {}


if "test_dist/NaNOnRankOne-v0" not in gym.registry:
    gym.register(id="test_dist/NaNOnRankOne-v0", entry_point=_NaNOnRankOne, max_episode_steps=20)


def _nan_worker(rank: int, world_size: int, run_dir: str, out_dir: str, mode: str) -> None:
    from rl_replay.config import load_config
    from rl_replay.errors import NonFiniteError
    from rl_replay.run.setup import build

    cfg = load_config(
        MLP_CPU_CONFIG,
        [
            f"run_dir={run_dir}",
            "log.progress=false",
            "log.wandb_mode=disabled",
            "env.id=test_dist/NaNOnRankOne-v0",
            f"collector.mode={mode}",
            "collector.num_steps=8",
            "checkpoint.every=0",
        ],
    )
    trainer = build(cfg)
    try:
        trainer.train()
        message = None
    except NonFiniteError as exc:
        message = str(exc)
    Path(out_dir, f"rank{rank}.txt").write_text(repr(message))


@pytest.mark.parametrize("mode", ["fixed", "episode"])
def test_non_finite_env_output_on_one_rank_stops_every_rank(tmp_path, mode):
    # Before, rank 1 raised alone and rank 0 waited in its next forward's all-gather until
    # the collective timed out; now both stop at the same step (else run_ranks times out).
    run_ranks(_nan_worker, str(tmp_path / "run"), str(tmp_path), mode, timeout=120)
    zero, one = (eval((tmp_path / f"rank{r}.txt").read_text()) for r in range(2))
    assert one == (
        "environment 'test_dist/NaNOnRankOne-v0' returned a non-finite reward (nan) in sub-env 0; "
        "fix the environment or wrap it to sanitise its rewards."
    ), one
    assert zero is not None and "non-finite value on another rank" in zero, zero


# --------------------------------------------------------------------- torchrun end to end
def _run(cmd: list[str], timeout: float = 300, extra_path: Path | None = None) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", "WANDB_MODE": "disabled"}
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(key, None)
    if extra_path is not None:
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(extra_path), env.get("PYTHONPATH")]))
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, (
        f"{' '.join(cmd)} failed ({proc.returncode}):\n{proc.stdout[-4000:]}\n{proc.stderr[-8000:]}"
    )
    return proc


def _torchrun(*args: str, nproc: int = 2) -> subprocess.CompletedProcess:
    return _run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            f"--nproc_per_node={nproc}",
            f"--master_port={free_port()}",
            "scripts/train.py",
            *args,
        ]
    )


def _updates(run_dir: Path) -> list[dict]:
    return [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]


def _full_optimizer_state(model, optimizer) -> dict:
    """``optimizer``'s state keyed by clean parameter name, whole (gathered under FSDP)."""
    from rl_replay.distributed import fsdp_version_of
    from rl_replay.run.trainer_state import _full_state_dict_type, _is_fsdp

    if fsdp_version_of(model) == 2:
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

        return get_optimizer_state_dict(model, optimizer, options=StateDictOptions(full_state_dict=True))["state"]
    if _is_fsdp(model):
        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

        with _full_state_dict_type(model, torch.device("cpu"), rank0_only=False):
            return FSDP.optim_state_dict(model, optimizer)["state"]
    names = [clean_name(n) for n, _ in model.named_parameters()]
    return {names[i]: entry for i, entry in optimizer.state_dict()["state"].items()}


def _check_loaded(trainer, checkpoint: dict) -> None:
    """The resumed weights and optimizer state equal the checkpoint's, parameter by parameter."""
    from rl_replay.run.trainer_state import _is_fsdp, _optimizer_state_by_name

    model = trainer.model
    if _is_fsdp(model):
        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

        with FSDP.summon_full_params(model):
            weights = {clean_name(n): p.detach().clone() for n, p in model.named_parameters()}
    elif any(hasattr(p, "full_tensor") for p in model.parameters()):  # FSDP2: DTensors
        weights = {n: p.full_tensor().detach().clone() for n, p in model.named_parameters()}
    else:
        weights = {n: p.detach().clone() for n, p in model.named_parameters()}
    assert weights and all(torch.equal(w, checkpoint["agent"][n]) for n, w in weights.items())
    loaded = _full_optimizer_state(model, trainer.optimizer)
    saved = _optimizer_state_by_name(model, checkpoint["optimizer"])["state"]
    assert sorted(loaded) == sorted(saved) == sorted(weights)
    for name, entry in saved.items():
        for key, value in entry.items():
            assert torch.equal(torch.as_tensor(loaded[name][key]).cpu(), torch.as_tensor(value)), (name, key)


def _manifest(run_dir: Path) -> dict:
    """``checkpoint.pt`` as written, its shard files not read."""
    from rl_replay.rundir import files, safe_tree
    from rl_replay.rundir.checkpoint import read_checkpoint_bytes

    with files.Dir.open(run_dir) as d:
        return safe_tree.loads(read_checkpoint_bytes(d, "checkpoint.pt"))[0]


def _resume_worker(rank: int, world_size: int, run_dir: str, total: int, *overrides: str) -> None:
    """Resume a run on ``world_size`` ranks: the loaded state is checked, then it trains to ``total``."""
    from rl_replay.run.setup import build
    from rl_replay.rundir.checkpoint import load_checkpoint

    trainer = build(resume=run_dir, overrides=[f"total_env_steps={total}", *overrides])
    _check_loaded(trainer, load_checkpoint(Path(run_dir)))
    trainer.train()


@pytest.mark.slow
def test_runs_resume_on_another_number_of_ranks(tmp_path, capsys):
    """2 ranks -> one process -> 2 ranks -> 3 ranks, one run: each resume loads the weights and
    optimizer state resharded, says what changed, and training reaches total_env_steps."""
    from rl_replay.run.setup import build
    from rl_replay.rundir.checkpoint import load_checkpoint

    run_dir = tmp_path / "run"
    common = ["log.progress=false", "log.wandb_mode=disabled"]
    first = _torchrun("--config", str(MLP_CPU_CONFIG), f"run_dir={run_dir}", "total_env_steps=1024", *common)
    assert first.stderr.count("run directory:") == 1  # only rank 0 prints
    assert first.stdout.count("collection: parameters gathered once per rollout") == 1
    lines = _updates(run_dir)
    assert [x["update"] for x in lines] == [1, 2, 3, 4]  # one writer: one line per update
    assert [x["env_steps"] for x in lines] == [256, 512, 768, 1024]  # summed over both ranks
    state = load_checkpoint(run_dir)
    assert (state["update"], state["env_steps"], state["world_size"]) == (4, 1024, 2)
    # written by both ranks: each its rows of the weights and optimizer state, checkpoint.pt naming them
    manifest = _manifest(run_dir)
    assert manifest["agent"] == {} and [f["file"] for f in manifest["shards"]["files"]] == [
        "checkpoint.shard-0-of-2.pt",
        "checkpoint.shard-1-of-2.pt",
    ]
    assert sorted(n for *_, n in (s["path"] for s in manifest["shards"]["tensors"]) if _ == ["agent"]) == sorted(
        state["agent"]
    )

    # 2 ranks -> one process: the weights and optimizer state are the checkpoint's, whole
    trainer = build(resume=run_dir, overrides=["total_env_steps=1536"])
    try:
        _check_loaded(trainer, state)
        assert trainer.budget_used() == pytest.approx(1024 / 1536)  # the lr clock keeps its place
    finally:
        trainer.close()
    said = capsys.readouterr().out
    assert f"resuming {run_dir} on one process; its checkpoint was written by 2 ranks" in said
    assert "rank 1's envs end here" in said
    from rl_replay.run.cli import evaluate_main, train_main

    assert train_main(["--resume", str(run_dir), "total_env_steps=1536"]) == 0  # in this process: one rank
    assert "finished 8 updates, 1536 env steps" in capsys.readouterr().err
    assert "shards" not in _manifest(run_dir)  # one process: one file
    # one process -> 2 ranks (in processes of this test, the loaded state checked on every rank), writing
    # the single file rank 0 gathers (checkpoint.sharded=false), as every multi-rank run did before
    run_ranks(_resume_worker, str(run_dir), 2048, "checkpoint.sharded=false")
    assert "shards" not in _manifest(run_dir) and _manifest(run_dir)["world_size"] == 2
    # 2 ranks (from that single file) -> 3 ranks, sharded again
    third = _torchrun("--resume", str(run_dir), "total_env_steps=2816", "checkpoint.sharded=true", nproc=3)
    assert "on 3 ranks; its checkpoint was written by 2 ranks" in third.stdout
    assert "rank 2 starts fresh episodes with RNG streams from the run's seed and its rank" in third.stdout
    lines = _updates(run_dir)
    assert [x["update"] for x in lines] == list(range(1, 13))  # no row lost or written twice
    assert [x["env_steps"] for x in lines] == [256, 512, 768, 1024, 1152, 1280, 1408, 1536, 1792, 2048, 2432, 2816]
    assert [x["run/world_size"] for x in lines] == [2] * 4 + [1] * 4 + [2] * 2 + [3] * 2
    assert load_checkpoint(run_dir)["world_size"] == 3
    assert [f["file"] for f in _manifest(run_dir)["shards"]["files"]] == [
        f"checkpoint.shard-{r}-of-3.pt" for r in range(3)
    ]

    assert evaluate_main([str(run_dir), "--episodes", "3"]) == 0
    assert "over 3 episodes (checkpoint update 12, 2816 env steps)" in capsys.readouterr().out


@pytest.mark.slow
def test_fsdp2_runs_resume_on_one_and_three_ranks_and_under_fsdp1(tmp_path, capsys):
    """A 2-rank FSDP2 run (distributed.fsdp_version=2) writes its rows of the weights and optimizer state
    from every rank; copies of it resume in one process, on 3 FSDP2 ranks and on 2 FSDP1 ranks, each with
    the checkpoint's weights and optimizer state after the load, and train on."""
    import shutil

    from rl_replay.run.setup import build
    from rl_replay.rundir.checkpoint import load_checkpoint

    run_dir = tmp_path / "run"
    common = ["log.progress=false", "log.wandb_mode=disabled", "distributed.fsdp_version=2"]
    first = _torchrun("--config", str(MLP_CPU_CONFIG), f"run_dir={run_dir}", "total_env_steps=1024", *common)
    assert "fsdp: FSDP2 fully_shard over 2 ranks; reshard_after_forward=True (as FSDP1's FULL_SHARD)" in first.stdout
    assert first.stdout.count("collection: parameters gathered once per rollout") == 1
    assert [x["update"] for x in _updates(run_dir)] == [1, 2, 3, 4]
    state = load_checkpoint(run_dir)
    assert (state["update"], state["world_size"]) == (4, 2)
    manifest = _manifest(run_dir)
    assert manifest["agent"] == {} and [f["file"] for f in manifest["shards"]["files"]] == [
        "checkpoint.shard-0-of-2.pt",
        "checkpoint.shard-1-of-2.pt",
    ]
    copies = {n: tmp_path / f"copy{n}" for n in ("one", "three", "fsdp1")}
    for copy_dir in copies.values():
        shutil.copytree(run_dir, copy_dir)

    trainer = build(resume=copies["one"], overrides=["total_env_steps=1536"])
    try:
        _check_loaded(trainer, state)
    finally:
        trainer.close()
    assert f"resuming {copies['one']} on one process; its checkpoint was written by 2 ranks" in capsys.readouterr().out

    run_ranks(_resume_worker, str(copies["three"]), 1792, world_size=3)
    assert load_checkpoint(copies["three"])["world_size"] == 3
    assert [f["file"] for f in _manifest(copies["three"])["shards"]["files"]] == [
        f"checkpoint.shard-{r}-of-3.pt" for r in range(3)
    ]

    switched = _torchrun("--resume", str(copies["fsdp1"]), "total_env_steps=1536", "distributed.fsdp_version=1")
    assert "its checkpoint was written under FSDP2" in switched.stdout and "fsdp: FULL_SHARD" in switched.stdout
    run_ranks(_resume_worker, str(copies["fsdp1"]), 2048, "distributed.fsdp_version=2")  # and back
    assert [x["update"] for x in _updates(copies["fsdp1"])] == list(range(1, 9))


@pytest.mark.slow
def test_a_job_restarts_itself_after_a_rank_is_killed(tmp_path):
    """torchrun --max-restarts 1 with --resume auto: rank 1 is SIGKILLed in the middle of update 4
    (its 100th env step; the last checkpoint is update 2's). The restarted workers continue from
    that checkpoint in the same run directory, with no metrics row lost or written twice."""
    run_dir = tmp_path / "run"
    config = tmp_path / "killed.yaml"
    config.write_text(
        f"base: {MLP_CPU_CONFIG}\n"
        "env:\n  wrappers:\n    - {target: '_restart_killer:KillOnFirstAttempt', kwargs: {at: 100, rank: 1}}\n"
    )
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc_per_node=2",
        "--max-restarts=1",
        f"--master_port={free_port()}",
        "scripts/train.py",
        "--config",
        str(config),
        "--resume",
        "auto",
        f"run_dir={run_dir}",
        "total_env_steps=2048",
        "log.progress=false",
        "log.wandb_mode=disabled",
    ]
    job = _run(command, extra_path=ROOT / "tests")
    assert f"--resume auto: {run_dir} holds no run: starting it there" in job.stderr
    assert f"--resume auto: {run_dir} resuming the run there" in job.stderr  # the restarted attempt
    assert "exitcode  : -9" in job.stderr or "Signal 9" in job.stderr or "(exitcode: -9)" in job.stderr
    lines = _updates(run_dir)
    assert [x["update"] for x in lines] == list(range(1, 9))  # strictly increasing, none twice
    assert [x["env_steps"] for x in lines] == [256 * u for u in range(1, 9)]
    assert "finished 8 updates, 2048 env steps" in job.stderr


@pytest.mark.slow
@pytest.mark.parametrize("fsdp_version", [1, 2])
def test_two_nodes_of_two_ranks_train_with_hybrid_shard(tmp_path, fsdp_version):
    """Two torchrun launchers (--nnodes 2, a c10d rendezvous on localhost), two gloo ranks each:
    HYBRID_SHARD shards within a launcher's ranks and replicates across the launchers (under FSDP2 a
    (replicate, shard) device mesh)."""
    run_dir = tmp_path / "run"
    port = free_port()
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", "WANDB_MODE": "disabled"}
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(key, None)
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nnodes=2",
        "--nproc_per_node=2",
        "--rdzv-backend=c10d",
        f"--rdzv-endpoint=localhost:{port}",
        "--rdzv-id=two-nodes",
        "scripts/train.py",
        "--config",
        str(MLP_CPU_CONFIG),
        f"run_dir={run_dir}",
        "total_env_steps=1024",
        "distributed.sharding_strategy=HYBRID_SHARD",
        f"distributed.fsdp_version={fsdp_version}",
        "log.progress=false",
        "log.wandb_mode=disabled",
    ]
    nodes = [
        subprocess.Popen(command, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        for _ in range(2)
    ]
    try:
        outputs = [node.communicate(timeout=300) for node in nodes]
    finally:
        for node in nodes:
            node.kill()
    for node, (out, err) in zip(nodes, outputs):
        assert node.returncode == 0, f"a launcher failed ({node.returncode}):\n{out[-3000:]}\n{err[-6000:]}"
    said = "".join(out for out, _ in outputs)
    line = {
        1: "fsdp: HYBRID_SHARD over 2 nodes of 2 ranks: sharded within a node, replicated across nodes",
        2: "fsdp: FSDP2 fully_shard over a (2, 2) (replicate, shard) mesh: sharded within a node, replicated across nodes",
    }[fsdp_version]
    assert said.count(line) == 1
    lines = _updates(run_dir)
    assert [x["update"] for x in lines] == [1, 2]  # 4 ranks x 4 envs x 32 steps = 512 per update
    assert [x["run/world_size"] for x in lines] == [4, 4]
    from rl_replay.rundir.checkpoint import load_checkpoint

    state = load_checkpoint(run_dir)
    assert (state["world_size"], state["env_steps"]) == (4, 1024)
    assert state["config"]["distributed"]["sharding_strategy"] == "HYBRID_SHARD"
    # sharded checkpoint: the first node's ranks wrote the rows, the second node's (replicas) none
    from rl_replay.rundir import files, safe_tree
    from rl_replay.rundir.checkpoint import read_checkpoint_bytes

    specs = _manifest(run_dir)["shards"]["tensors"]
    with files.Dir.open(run_dir) as d:
        chunks = [
            len(safe_tree.loads(read_checkpoint_bytes(d, f"checkpoint.shard-{r}-of-4.pt"))[0]["chunks"])
            for r in range(4)
        ]
    assert chunks[0] == chunks[1] == len(specs) and chunks[2:] == [0, 0]
    agent = {tuple(x["path"][1:]): x["shape"] for x in specs if x["path"][0] == "agent"}
    assert {name: list(t.shape) for name, t in state["agent"].items()} == {k[0]: v for k, v in agent.items()}


# ------------------------------------------------------------- signals under torchrun
def _signal_worker(rank: int, world_size: int, run_dir: str, out_dir: str) -> None:
    import signal

    from rl_replay.config import load_config
    from rl_replay.errors import TrainingInterrupted
    from rl_replay.run.setup import build
    from rl_replay.rundir.checkpoint import load_checkpoint

    cfg = load_config(
        MLP_CPU_CONFIG,
        [
            f"run_dir={run_dir}",
            "log.progress=false",
            "log.wandb_mode=disabled",
            "total_env_steps=4096",
            "checkpoint.every=0",
        ],
    )
    trainer = build(cfg)
    step = trainer.step

    def step_and_signal():
        metrics = step()
        if rank == 1 and trainer.update == 2:
            os.kill(os.getpid(), signal.SIGTERM)  # only rank 1 is signalled, in update 2
        return metrics

    trainer.step = step_and_signal
    try:
        trainer.train()
        stopped = None
    except TrainingInterrupted as exc:
        stopped = (exc.signum, exc.update, exc.exit_code)
    torch.distributed.barrier()
    saved = load_checkpoint(run_dir)["update"]
    torch.save({"stopped": stopped, "update": trainer.update, "saved": saved}, Path(out_dir) / f"rank{rank}.pt")


def test_signal_on_one_rank_stops_every_rank_at_the_same_update(tmp_path):
    run_ranks(_signal_worker, str(tmp_path / "run"), str(tmp_path))
    results = [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in range(2)]
    import signal

    for r in results:  # rank 0 was never signalled, yet stops with rank 1 after update 2
        assert r["stopped"] == (signal.SIGTERM, 2, 143) and r["update"] == 2 and r["saved"] == 2, results
    lines = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [x["update"] for x in lines] == [1, 2]
