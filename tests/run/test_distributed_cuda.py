"""FSDP1 with CPUOffload(offload_params=True) on CUDA: gradient parity of one update.

World size 1 (one spawned process, NCCL): FSDP1 keeps the parameters and their
gradients in pinned host memory and reuses one gradient buffer per backward, which is
the case the GradientAccumulator must absorb between replay blocks. The gradient of one
collector rollout must equal the plain single-process gradient of an unwrapped copy of
the agent on the GPU (rtol 1e-5, atol 1e-6). Skipped without CUDA.
"""

from __future__ import annotations

import copy
import sys
from pathlib import Path

import pytest
import torch
from _dist import run_ranks
from conftest import assert_grads_match, collect_replayed
from test_distributed_train import clean_name, plain_rollout_grads

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

AGENTS = {
    "mlp": ("mlp", {"hidden_sizes": [32, 32]}, ["Linear"]),
    "gru": ("gru", {"hidden_size": 24, "encoder_sizes": [24]}, ["Linear"]),
}
STEPS, ENVS = 24, 4


def offload_parity_worker(
    rank: int, world_size: int, out_dir: str, device_type: str = "cuda", cpu_offload: bool = True
) -> None:
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    from rl_replay.agent import build_agent
    from rl_replay.algorithms.a2c import A2C
    from rl_replay.algorithms.losses import total_loss
    from rl_replay.config import Config
    from rl_replay.distributed import init_from_env, wrap_fsdp
    from rl_replay.rollout.collector import Collector
    from rl_replay.rollout.environment import make_vector_env

    backend = "nccl" if device_type == "cuda" else "gloo"
    info, device = init_from_env(device_type, backend)
    assert info.world_size == 1
    if not torch.distributed.is_initialized():  # init_from_env joins a group only for > 1 rank
        torch.distributed.init_process_group(backend)
    cfg = Config()
    results = {}
    for name, (target, kwargs, wrap) in AGENTS.items():
        envs = make_vector_env("CartPole-v1", ENVS)
        torch.manual_seed(0)
        agent = build_agent(target, kwargs, envs.single_observation_space, envs.single_action_space).to(device)
        reference = copy.deepcopy(agent)
        model = wrap_fsdp(agent, device, wrap_modules=wrap, cpu_offload=cpu_offload)
        assert isinstance(model, FSDP) and model._use_orig_params
        assert model.cpu_offload.offload_params is cpu_offload
        torch.manual_seed(1)
        collector = Collector(envs, model, num_steps=STEPS, device=device, seed=100)
        rollout, accumulator = collect_replayed(collector)
        total_loss(A2C.loss(rollout.data, cfg)).backward()
        assert accumulator.blocks_replayed == STEPS
        # One rank (NO_SHARD): the original parameters' .grad hold the full gradients
        # (in host memory under CPU offload).
        fsdp = {
            clean_name(n): None if p.grad is None else p.grad.detach().cpu().clone()
            for n, p in model.named_parameters()
        }
        if any(g is None for g in fsdp.values()):
            with FSDP.summon_full_params(model, with_grads=True):
                fsdp = {clean_name(n): p.grad.detach().cpu().clone() for n, p in model.named_parameters()}
        data = rollout.data.detach()
        plain = plain_rollout_grads(reference, data, collector._obs, collector._is_first, cfg)
        results[name] = {"fsdp": fsdp, "plain": {k: v.cpu() for k, v in plain.items()}}
        envs.close()
    torch.save(results, Path(out_dir) / "offload_parity.pt")


@pytest.fixture(scope="module")
def offload_results(tmp_path_factory):
    out = tmp_path_factory.mktemp("offload")
    run_ranks(offload_parity_worker, str(out), world_size=1)
    return torch.load(out / "offload_parity.pt", weights_only=False)


@pytest.mark.parametrize("agent", list(AGENTS))
def test_cpu_offload_gradient_matches_single_process(offload_results, agent):
    r = offload_results[agent]
    assert_grads_match(r["fsdp"], r["plain"], f"offload-{agent}", rtol=1e-5, atol=1e-6)


def test_torchrun_cpu_offload_trains_resumes_and_evaluates(tmp_path):
    """The CLI path the gradient test above does not take: ``scripts/train.py`` under torchrun
    with FSDP1 + CPUOffload, then ``--resume`` and ``scripts/evaluate.py``. Under offload the
    loss terms live on the GPU and the clipped gradient norm on the host; the non-finite guard
    compares both, and a first GPU run failed there in update 1."""
    import json
    import math

    from test_distributed_train import MLP_CPU_CONFIG, _run

    run_dir = tmp_path / "run"
    launch = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=1", "scripts/train.py"]
    cuda = [
        "device=cuda",
        "distributed.backend=nccl",
        "distributed.cpu_offload=true",
        "log.progress=false",
        "log.wandb_mode=disabled",
        "checkpoint.every=1",
    ]
    first = _run([*launch, "--config", str(MLP_CPU_CONFIG), f"run_dir={run_dir}", "total_env_steps=256", *cuda])
    assert "finished 2 updates, 256 env steps" in first.stderr
    second = _run([*launch, "--resume", str(run_dir), "total_env_steps=384"])
    assert "finished 3 updates, 384 env steps" in second.stderr
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["update"] for r in rows] == [1, 2, 3]
    assert all(math.isfinite(r["train/grad_norm"]) and r["train/grad_norm"] > 0 for r in rows)
    evaluation = _run([sys.executable, "scripts/evaluate.py", str(run_dir), "--episodes", "2"])
    assert "(checkpoint update 3, 384 env steps)" in evaluation.stdout
