"""Misuse of the replay engine raises a clear error and records / changes nothing."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
from conftest import scenario_results
from tensordict import TensorDict

from rl_replay import GradientAccumulator, ReplayError, checkpoint_fsdp_forward, replay


def grads_of(module):
    return [None if p.grad is None else p.grad.clone() for p in module.parameters()]


def same_grads(module, before) -> bool:
    after = grads_of(module)
    return all(
        (a is None and b is None) or (a is not None and b is not None and torch.equal(a, b))
        for a, b in zip(after, before)
    )


def test_misuse_raises_the_engines_replay_error_with_its_prefix(x):
    """What the engine refuses in the forward and in the backward (where autograd re-raises
    what a block's backward raised) reaches the caller as the engine's ReplayError, one
    message that starts with the engine's prefix; ``except RuntimeError`` and the trainer
    side's ``rl_replay.errors.ReplayError`` catch it too."""
    import rl_replay.errors
    from rl_replay.engine import ReplayError as EngineReplayError

    with pytest.raises(
        RuntimeError, match=r"^rl_replay\.replay: the forward changed parameter 'lin\.weight'"
    ) as in_forward:
        checkpoint_fsdp_forward(ScalesItsWeight(), GradientAccumulator(), observation=x)
    (y,) = checkpoint_fsdp_forward(Nondeterministic(), GradientAccumulator(), observation=x)
    with pytest.raises(
        RuntimeError, match=r"^rl_replay\.replay: block 0 returned 2 tensors when recomputed"
    ) as in_backward:
        y.sum().backward()
    for info in (in_forward, in_backward):
        assert type(info.value) is EngineReplayError is ReplayError is rl_replay.errors.ReplayError


# ------------------------------------------------------------------------ inputs
def test_no_tensor_input(policy):
    acc = GradientAccumulator()
    with pytest.raises(ValueError, match=r"at least one tensor keyword input.*n=int"):
        checkpoint_fsdp_forward(policy, acc, n=3)
    with pytest.raises(ValueError, match=r"at least one tensor keyword input.*no inputs"):
        checkpoint_fsdp_forward(policy, acc)
    with pytest.raises(ValueError, match=r"needs at least one tensor input"):
        replay(policy, acc, TensorDict())
    assert acc.num_blocks == 0 and acc.saved_bytes == 0


@pytest.mark.parametrize(
    "container",
    [lambda t: [t], lambda t: (1, t), lambda t: {"a": {"b": t}}],
    ids=["list", "tuple", "dict"],
)
def test_tensor_hidden_in_a_container(policy, x, container):
    acc = GradientAccumulator()
    with pytest.raises(ValueError, match=r"keyword 'extras' is a (list|tuple|dict) containing tensors"):
        checkpoint_fsdp_forward(policy, acc, observation=x, extras=container(x))
    assert acc.num_blocks == 0


@pytest.mark.parametrize("value", [[1, 2], {"k": 1}, (1, [2])], ids=["list", "dict", "tuple_of_list"])
def test_mutable_metadata(policy, x, value):
    acc = GradientAccumulator()
    with pytest.raises(ValueError, match=r"keyword 'sizes' is a mutable (list|dict|tuple)"):
        checkpoint_fsdp_forward(policy, acc, observation=x, sizes=value)
    assert acc.num_blocks == 0


def test_unsupported_device(policy):
    acc = GradientAccumulator()
    meta = torch.empty(2, device="meta")
    with pytest.raises(ValueError, match=r"keyword 'observation' is on device 'meta'"):
        checkpoint_fsdp_forward(policy, acc, observation=meta)
    with pytest.raises(ValueError, match=r"input 'observation' is on device 'meta'"):
        replay(policy, acc, TensorDict(observation=meta))
    assert acc.num_blocks == 0


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices")
def test_inputs_on_two_cuda_devices(policy):
    acc = GradientAccumulator()
    a, b = torch.randn(2, 4, device="cuda:0"), torch.randn(2, 4, device="cuda:1")
    with pytest.raises(ValueError, match=r"keyword 'other' is on cuda:1 but other inputs are on cuda:0"):
        checkpoint_fsdp_forward(policy.cuda(0), acc, observation=a, other=b)
    assert acc.num_blocks == 0


def test_replay_takes_a_tensordict(policy, x):
    acc = GradientAccumulator()
    with pytest.raises(TypeError, match=r"takes its inputs as a TensorDict, got dict"):
        replay(policy, acc, {"observation": x})
    assert acc.num_blocks == 0


def test_bad_accumulator_type(policy, x):
    with pytest.raises(TypeError, match=r"accumulator must be a GradientAccumulator.*got str"):
        replay(policy, "acc", TensorDict(observation=x))
    with pytest.raises(TypeError, match=r"accumulated must be a GradientAccumulator or a dict, got list"):
        checkpoint_fsdp_forward(policy, [], observation=x)


def test_model_not_callable(x):
    with pytest.raises(TypeError, match=r"model must be callable, got int"):
        checkpoint_fsdp_forward(3, GradientAccumulator(), observation=x)


# ----------------------------------------------------------------------- outputs
class Returns(nn.Module):
    def __init__(self, make) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 3)
        self.make = make

    def forward(self, observation):
        return self.make(self.lin(observation))


@pytest.mark.parametrize(
    "make, pattern",
    [
        (lambda y: [y, y], r"returned a list of \(Tensor, Tensor\)"),
        (lambda y: 3, r"returned a int"),
        (lambda y: (y, 1.5), r"returned a tuple of \(Tensor, float\)"),
        (lambda y: {"y": y, "n": 2}, r"returned a TensorDict|returned a dict"),
    ],
    ids=["list", "int", "tuple_with_float", "dict_with_int"],
)
def test_output_not_tensor_tuple_or_tensordict(x, make, pattern):
    model = Returns(make)
    acc = GradientAccumulator()
    with pytest.raises(TypeError, match=pattern):
        checkpoint_fsdp_forward(model, acc, observation=x)
    with pytest.raises(TypeError, match=pattern):
        replay(model, acc, TensorDict(observation=x))
    assert acc.num_blocks == 0 and acc.saved_bytes == 0


class Nondeterministic(nn.Module):
    """Returns one more tensor on every call (so the recompute disagrees)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 3)
        self.calls = 0

    def forward(self, observation):
        self.calls += 1
        y = self.lin(observation)
        return (y,) * self.calls


def test_recompute_with_a_different_structure(x):
    model = Nondeterministic()
    acc = GradientAccumulator()
    (y,) = checkpoint_fsdp_forward(model, acc, observation=x)
    with pytest.raises(ReplayError, match=r"returned 2 tensors when recomputed but 1 in the forward"):
        y.sum().backward()


# ---------------------------------------------------------------------- backward
@pytest.mark.filterwarnings("ignore:Using backward\\(\\) with create_graph=True")
def test_create_graph_backward(policy, x):
    acc = GradientAccumulator()
    y = checkpoint_fsdp_forward(policy, acc, observation=x)
    before = grads_of(policy)
    with pytest.raises(ReplayError, match=r"higher-order gradients \(backward with create_graph=True\)"):
        y.square().sum().backward(create_graph=True)
    assert same_grads(policy, before)
    assert acc.blocks_replayed == 0


def test_autograd_grad_and_backward_inputs(policy, x):
    """Both would leave parameter .grad untouched with plain autograd, but the nested
    backward of a block accumulates into it: rejected, nothing written."""
    h0 = torch.randn(2, 4, requires_grad=True)
    acc = GradientAccumulator()
    y = checkpoint_fsdp_forward(policy, acc, observation=h0)
    with pytest.raises(ReplayError, match=r"torch\.autograd\.grad\(\) and backward\(inputs=\.\.\.\)"):
        torch.autograd.grad(y.sum(), h0)
    y = checkpoint_fsdp_forward(policy, acc, observation=h0)
    with pytest.raises(ReplayError, match=r"torch\.autograd\.grad\(\) and backward\(inputs=\.\.\.\)"):
        y.sum().backward(inputs=[h0])
    assert all(p.grad is None for p in policy.parameters())
    assert h0.grad is None and acc.blocks_replayed == 0


def test_input_modified_in_place_after_the_block(policy):
    """A slice of the caller's observation buffer is saved as that view, not copied, so
    a write into the buffer after the block would reach the recompute. Plain autograd
    raises on backward (Linear saved its input); so must replay."""
    buf = torch.randn(3, 2, 4)  # a rollout's observation buffer
    acc = GradientAccumulator()
    y = checkpoint_fsdp_forward(policy, acc, observation=buf[0])
    buf[0].copy_(torch.randn(2, 4))  # the env writes into the buffer in place
    with pytest.raises(ReplayError, match=r"input 0 of block 0 \(a \(2, 4\) host tensor\) was modified"):
        y.sum().backward()
    assert all(p.grad is None for p in policy.parameters())
    assert acc.blocks_replayed == 0
    # Same through replay(), and a clone per step is fine.
    acc = GradientAccumulator()
    y0 = replay(policy, acc, TensorDict(observation=buf[1]))
    y1 = replay(policy, acc, TensorDict(observation=buf[2].clone()))
    buf.mul_(2)
    with pytest.raises(ReplayError, match=r"input 0 of block 0 .* was modified in place"):
        (y0.sum() + y1.sum()).backward()
    acc = GradientAccumulator()
    checkpoint_fsdp_forward(policy, acc, observation=buf[0].clone()).sum().backward()
    assert acc.blocks_replayed == 1


def test_copied_input_modified_in_place_after_the_block_is_harmless(policy):
    """Any other host input is copied into the rollout's slabs before the model runs:
    writing into the caller's tensor afterwards (a reused buffer) does not reach the
    recompute, and the gradient is the one of the values the block saw."""
    buf, seen = torch.randn(2, 4), []
    acc = GradientAccumulator()
    loss = 0
    for _ in range(3):
        seen.append(buf.clone())
        loss = loss + checkpoint_fsdp_forward(policy, acc, observation=buf).square().sum()
        buf.copy_(torch.randn(2, 4))  # the env writes the next observation in place
    loss.backward()
    got = grads_of(policy)
    policy.zero_grad(set_to_none=True)
    sum(policy(observation=o).square().sum() for o in seen).backward()
    assert all(torch.equal(a, b) for a, b in zip(got, grads_of(policy)))
    assert acc.slab_bytes > 0 and acc.blocks_replayed == 3


# ------------------------------------------------------- mutating the module
def test_buffer_changed_in_forward(x):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 3), nn.BatchNorm1d(3)).train()
    acc = GradientAccumulator()
    names = r"buffer '1\.running_mean', buffer '1\.running_var', buffer '1\.num_batches_tracked'"
    with pytest.raises(ReplayError, match=rf"the forward changed {names} of Sequential \(block 0\)"):
        checkpoint_fsdp_forward(model, acc, input=x)
    with pytest.raises(ReplayError, match=r"running_mean"):
        replay(model, acc, TensorDict(input=x))
    assert acc.num_blocks == 0
    # Eval mode reads the running statistics without changing them: fine.
    model.eval()
    checkpoint_fsdp_forward(model, acc, input=x).sum().backward()
    assert acc.num_blocks == 1 and acc.blocks_replayed == 1


class ScalesItsWeight(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 3)

    def forward(self, observation):
        with torch.no_grad():
            self.lin.weight.mul_(0.5)
        return self.lin(observation)


def test_parameter_changed_in_forward(x):
    model = ScalesItsWeight()
    acc = GradientAccumulator()
    with pytest.raises(ReplayError, match=r"the forward changed parameter 'lin\.weight'"):
        checkpoint_fsdp_forward(model, acc, observation=x)
    assert acc.num_blocks == 0


@pytest.mark.parametrize("opt", ["sgd", "adam"])
def test_optimizer_step_between_forward_and_backward(policy, x, opt):
    params = list(policy.parameters())
    optimizer = torch.optim.SGD(params, lr=0.1) if opt == "sgd" else torch.optim.Adam(params, lr=0.1)
    acc = GradientAccumulator()
    loss = sum(checkpoint_fsdp_forward(policy, acc, observation=x * t).sum() for t in range(3))
    for p in params:
        p.grad = torch.ones_like(p)  # stale gradients from somewhere else
    optimizer.step()
    before = grads_of(policy)
    with pytest.raises(
        ReplayError,
        match=r"something between the forward and the backward changed parameter 'lin\.weight'",
    ):
        loss.backward()
    assert same_grads(policy, before)
    assert acc.blocks_replayed == 0


# --------------------------------------------------------- FSDP setup errors
@pytest.mark.parametrize("scenario", ["use_orig_params_false", "shard_grad_op", "no_sync"])
def test_fsdp_setup_errors(fsdp_world2, scenario):
    """Run in the two gloo workers of ``fsdp_world2`` (each asserts with pytest.raises)."""
    assert scenario_results(fsdp_world2, "errors", scenario) == ["ok", "ok"]
