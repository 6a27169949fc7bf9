"""Replay on CUDA: plain modules, dropout RNG replay, device memory, FSDP1 CPU offload.

Skipped without CUDA. The FSDP test uses a one-rank process group created in this
process (NCCL when available, else gloo) and destroyed afterwards.
"""

from __future__ import annotations

import copy

import _dist
import pytest
import torch
import torch.nn as nn
from conftest import assert_grads_match
from tensordict import TensorDict

from rl_replay import GradientAccumulator, checkpoint_fsdp_forward, replay

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

# Same float32 bound as on CPU, with a little more absolute slack for GPU kernels
# whose reduction order may differ between the forward and the recompute.
RTOL, ATOL = 1e-5, 1e-5


@pytest.fixture
def device():
    d = torch.device("cuda", 0)
    torch.cuda.set_device(d)
    return d


@pytest.fixture(autouse=True)
def _no_tf32():
    """Keep float32 matmuls in float32 so the 1e-5 bound is meaningful."""
    old = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = old


def _grads(module):
    return {n: p.grad for n, p in module.named_parameters()}


@pytest.mark.parametrize("entry", ["replay", "checkpoint_fsdp_forward"])
def test_cuda_gru_parity(device, entry):
    torch.manual_seed(0)
    policy = _dist.GRUPolicy().to(device)
    ref = copy.deepcopy(policy)
    T, B = 32, 4
    obs = torch.randn(T, B, 5, device=device)
    h0 = torch.randn(B, 12, device=device)
    h_ref, h_rep = h0.clone().requires_grad_(), h0.clone().requires_grad_()

    _dist.gru_loss(ref, obs, h_ref).backward()
    acc = GradientAccumulator()
    if entry == "replay":
        loss = _dist.gru_loss(policy, obs, h_rep, acc)
    else:
        h, loss = h_rep, 0.0
        for t in range(T):
            logits, value, h = checkpoint_fsdp_forward(policy, acc, observation=obs[t], h=h)
            loss = loss + _dist.step_loss(logits, value)
        loss = loss + h.square().sum()
    loss.backward()

    assert_grads_match(policy, ref, "gru", rtol=RTOL, atol=ATOL)
    assert_grads_match({"h0": h_rep.grad}, {"h0": h_ref.grad}, "gru", rtol=RTOL, atol=ATOL)
    assert acc.blocks_replayed == T
    assert all(p.grad.is_cuda for p in policy.parameters())


def test_cuda_dropout_rng(device):
    torch.manual_seed(1)
    policy = _dist.GRUPolicy(dropout=0.4).to(device).train()
    ref = copy.deepcopy(policy)
    T, B = 16, 4
    obs = torch.randn(T, B, 5, device=device)
    h0 = torch.zeros(B, 12, device=device)

    torch.manual_seed(1234)
    _dist.gru_loss(ref, obs, h0).backward()
    after_ref = torch.rand(8, device=device), torch.rand(8)
    torch.manual_seed(1234)
    _dist.gru_loss(policy, obs, h0, GradientAccumulator()).backward()
    after_rep = torch.rand(8, device=device), torch.rand(8)

    assert_grads_match(policy, ref, "dropout", rtol=RTOL, atol=ATOL)
    # The recompute ran inside fork_rng: neither RNG stream of the caller moved.
    assert torch.equal(after_rep[0], after_ref[0]) and torch.equal(after_rep[1], after_ref[1])


class MovesToGPU(nn.Module):
    """Gets host inputs and computes on the GPU (as FSDP with CPU offload does)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(6, 8)
        self.drop = nn.Dropout(0.5)

    def forward(self, observation):
        return self.drop(self.lin(observation.to(self.lin.weight.device)))


def test_cuda_dropout_rng_with_host_inputs(device):
    torch.manual_seed(2)
    policy = MovesToGPU().to(device).train()
    ref = copy.deepcopy(policy)
    obs = torch.randn(10, 3, 6)  # on the host

    torch.manual_seed(77)
    sum(ref(obs[t]).square().sum() for t in range(10)).backward()
    after_ref = torch.rand(8, device=device)
    torch.manual_seed(77)
    acc = GradientAccumulator()
    outs = [checkpoint_fsdp_forward(policy, acc, observation=obs[t]) for t in range(10)]
    sum(o.square().sum() for o in outs).backward()
    after_rep = torch.rand(8, device=device)

    assert_grads_match(policy, ref, "dropout", rtol=RTOL, atol=ATOL)
    assert torch.equal(after_rep, after_ref)


def test_cuda_autocast_bf16(device):
    torch.manual_seed(3)
    policy = _dist.MLPPolicy().to(device)
    ref = copy.deepcopy(policy)
    obs = torch.randn(12, 4, 6, device=device)

    def run(model, acc):
        with torch.autocast("cuda", dtype=torch.bfloat16, cache_enabled=False):
            outs = [
                model(obs[t]) if acc is None else replay(model, acc, TensorDict(observation=obs[t])) for t in range(12)
            ]
        assert all(o[0].dtype == torch.bfloat16 for o in outs)
        sum(_dist.step_loss(lo.float(), v.float()) for lo, v in outs).backward()

    run(ref, None)
    run(policy, GradientAccumulator())
    assert_grads_match(policy, ref, "autocast_bf16", rtol=1.6e-2, atol=1e-2)


class Scorer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(1024, 1)

    def forward(self, observation):
        return self.lin(observation).mean()


@pytest.mark.parametrize("entry", ["replay", "checkpoint_fsdp_forward"])
def test_cuda_block_inputs_leave_the_device(device, entry):
    """Only host copies of the inputs are kept: device memory does not grow with T."""
    torch.manual_seed(4)
    policy = Scorer().to(device)
    acc = GradientAccumulator()
    T, size = 16, (256, 1024)  # 1 MiB of input per block
    # Warm up first: the first matmul allocates the cuBLAS workspace through the
    # caching allocator, which memory_allocated() would count as growth.
    policy(torch.randn(size, device=device)).backward()
    policy.zero_grad(set_to_none=True)
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated(device)
    loss = 0.0
    for _ in range(T):
        x = torch.randn(size, device=device)
        if entry == "replay":
            y = replay(policy, acc, TensorDict(observation=x))
        else:
            y = checkpoint_fsdp_forward(policy, acc, observation=x)
        loss = loss + y
        del x
    torch.cuda.synchronize()
    grown = torch.cuda.memory_allocated(device) - base
    assert grown < 2 * 2**20, f"device memory grew by {grown} bytes over {T} blocks"
    assert acc.saved_bytes == T * 2**20
    loss.backward()
    assert acc.blocks_replayed == T


@pytest.fixture
def one_rank_group(device):
    import torch.distributed as dist

    if not dist.is_available():
        pytest.skip("needs torch.distributed")
    backend = "nccl" if dist.is_nccl_available() else "gloo"
    assert not dist.is_initialized(), "a test left a default process group behind"
    dist.init_process_group(backend, rank=0, world_size=1, init_method=f"tcp://127.0.0.1:{_dist.free_port()}")
    try:
        yield
    finally:
        dist.destroy_process_group()


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_cuda_fsdp_cpu_offload_world_size_1(one_rank_group):
    res = _dist.cuda_fsdp_offload()
    assert res["strategy"] == "NO_SHARD"
    for k in range(2):  # the second rollout adds to the first one's (overwritten) gradient
        assert_grads_match(res[f"grads{k}"], res[f"expected{k}"], "fsdp", rtol=RTOL, atol=ATOL)
        assert_grads_match({"h0": res[f"h0_{k}"]}, {"h0": res[f"h0_ref{k}"]}, "fsdp", rtol=RTOL, atol=ATOL)
        assert torch.equal(res[f"rng{k}"], res[f"rng_ref{k}"])
