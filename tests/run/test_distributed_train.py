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
from _dist import free_port, run_ranks
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

    T, N = data.batch_size
    agent.zero_grad(set_to_none=True)
    heads, state = plain_sequence(agent, data, agent.initial_state(N, final_obs.device))
    with torch.no_grad():
        bootstrap = agent(observation=final_obs, state=state, is_first=final_is_first)["value"]
    plain = data.exclude("next_value").update(heads)
    plain.set("next_value", torch.cat([heads["value"][1:].detach(), bootstrap.unsqueeze(0)]))
    total_loss(A2C.loss(plain, cfg)).backward()
    return {name: p.grad.detach().clone() for name, p in agent.named_parameters()}


def clean_name(name: str) -> str:
    return name.replace("_fsdp_wrapped_module.", "")


# --------------------------------------------------------------------- gradient parity
PARITY_AGENTS = {
    "mlp": ("mlp", {"hidden_sizes": [32, 32]}, ["Linear"], "FULL_SHARD"),
    "gru": ("gru", {"hidden_size": 24, "encoder_sizes": [24]}, ["Linear"], "FULL_SHARD"),
    "transformer": (
        "transformer",
        {"d_model": 16, "num_layers": 2, "num_heads": 2, "ff_mult": 2, "context": 2},
        ["TransformerEncoderLayer"],
        "FULL_SHARD",
    ),
    # distributed.sharding_strategy: the parameters kept gathered between forward and backward,
    # or never sharded (gradients all-reduced)
    "gru-SHARD_GRAD_OP": ("gru", {"hidden_size": 24, "encoder_sizes": [24]}, ["Linear"], "SHARD_GRAD_OP"),
    "gtrxl-SHARD_GRAD_OP": (
        "gtrxl",
        {"d_model": 16, "num_layers": 2, "num_heads": 2, "window": 4, "encoder_sizes": [16]},
        ["WindowLayer"],
        "SHARD_GRAD_OP",
    ),
    "gru-NO_SHARD": ("gru", {"hidden_size": 24, "encoder_sizes": [24]}, ["Linear"], "NO_SHARD"),
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
    for name, (target, kwargs, wrap, strategy) in PARITY_AGENTS.items():
        envs = make_vector_env("CartPole-v1", PARITY_ENVS)
        torch.manual_seed(0)  # identical initialisation on every rank
        agent = build_agent(target, kwargs, envs.single_observation_space, envs.single_action_space)
        reference = copy.deepcopy(agent)
        model = wrap_fsdp(agent, device, wrap_modules=wrap, sharding_strategy=strategy)
        assert isinstance(model, FSDP) and model._use_orig_params
        assert model.sharding_strategy is ShardingStrategy[strategy]
        assert len(FSDP.fsdp_modules(model)) > 1, "auto-wrap made no inner units"
        torch.manual_seed(1 + rank)  # action sampling differs per rank
        collector = Collector(envs, model, num_steps=PARITY_STEPS, seed=100 + 1000 * rank)
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
    from rl_replay.run.setup import build

    # One CartPole env per rank, seeded per rank: the ranks' episodes end at different
    # steps. A rank that stopped collecting alone would leave the other waiting inside
    # FSDP's all-gather (the test's timeout would fire).
    cfg = load_config(
        MLP_CPU_CONFIG,
        [
            f"run_dir={run_dir}",
            "log.progress=false",
            "log.wandb_mode=disabled",
            "env.num_envs=1",
            "collector.mode=episode",
            "collector.num_steps=500",
            "checkpoint.every=0",
            "loss.algorithm=ppo",
            "ppo.num_minibatches=1",
            "ppo.epochs=1",
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
            # Same number of steps everywhere: the longest episode over all ranks.
            assert len({t for t, _ in gathered}) == 1, gathered
            assert T == max(length for _, ls in gathered for length in ls), gathered
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
def _run(cmd: list[str], timeout: float = 300) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", "WANDB_MODE": "disabled"}
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(key, None)
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, (
        f"{' '.join(cmd)} failed ({proc.returncode}):\n{proc.stdout[-4000:]}\n{proc.stderr[-8000:]}"
    )
    return proc


def _torchrun(*args: str) -> subprocess.CompletedProcess:
    return _run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nproc_per_node=2",
            f"--master_port={free_port()}",
            "scripts/train.py",
            *args,
        ]
    )


def _updates(run_dir: Path) -> list[dict]:
    return [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.slow
def test_torchrun_train_resume_evaluate(tmp_path):
    from rl_replay.errors import SetupError
    from rl_replay.run.setup import build
    from rl_replay.rundir.checkpoint import load_checkpoint

    run_dir = tmp_path / "run"
    common = ["log.progress=false", "log.wandb_mode=disabled"]
    first = _torchrun("--config", str(MLP_CPU_CONFIG), f"run_dir={run_dir}", "total_env_steps=1024", *common)
    assert first.stderr.count("run directory:") == 1  # only rank 0 prints
    lines = _updates(run_dir)
    assert [x["update"] for x in lines] == [1, 2, 3, 4]  # one writer: one line per update
    assert [x["env_steps"] for x in lines] == [256, 512, 768, 1024]  # summed over both ranks
    state = load_checkpoint(run_dir)
    assert (state["update"], state["env_steps"], state["world_size"]) == (4, 1024, 2)

    # A checkpoint of 2 processes cannot be resumed by 1: a clear error naming both sizes.
    with pytest.raises(SetupError, match="world size 2 .* world size 1"):
        build(resume=run_dir)

    second = _torchrun("--resume", str(run_dir), "total_env_steps=1536")
    assert "finished 6 updates, 1536 env steps" in second.stderr
    lines = _updates(run_dir)
    assert [x["update"] for x in lines] == [1, 2, 3, 4, 5, 6]
    assert load_checkpoint(run_dir)["update"] == 6

    evaluation = _run([sys.executable, "scripts/evaluate.py", str(run_dir), "--episodes", "3"])
    assert "over 3 episodes (checkpoint update 6, 1536 env steps)" in evaluation.stdout


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
