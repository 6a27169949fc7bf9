"""FSDP1 FULL_SHARD (use_orig_params=True) with world size 2 on CPU (gloo).

One spawn per session runs every scenario in two worker processes (the
``fsdp_world2`` fixture in conftest.py, scenarios in ``tests/_dist.py``); each rank
sees different data. After ``loss.backward()`` the full
gradients (``summon_full_params(with_grads=True)``) must equal the average over both
ranks of plain single-process autograd gradients, computed inside each rank on an
unwrapped copy with the same initial weights. One ``clip_grad_norm_`` + SGD step is
then compared parameter by parameter.
"""

from __future__ import annotations

import pytest
import torch
from conftest import assert_grads_match, scenario_results


@pytest.fixture
def results(fsdp_world2):
    return fsdp_world2


def _scenario(results, name):
    return scenario_results(results, "parity", name)


@pytest.mark.parametrize("scenario", ["mlp", "mlp_root_only"])
def test_fsdp_mlp_independent_blocks(results, scenario):
    """``mlp``: every Linear its own FSDP unit; ``mlp_root_only``: one unit."""
    for rank, res in enumerate(_scenario(results, scenario)):
        assert res["counters"] == (10, 10, 1), f"rank {rank}"
        assert_grads_match(res["grads"], res["expected"], "fsdp")


@pytest.mark.parametrize("scenario", ["mlp", "mlp_root_only"])
def test_fsdp_mlp_clip_and_sgd_step(results, scenario):
    for res in _scenario(results, scenario):
        # The same total norm, and clipping really happened.
        assert_grads_match({"norm": res["norm"]}, {"norm": res["ref_norm"]}, "fsdp")
        assert res["ref_norm"].item() > 0.05
        assert_grads_match(res["params"], res["ref_params"], "fsdp")
    # Both ranks hold the same model after the step.
    first, second = _scenario(results, scenario)
    for name, p in first["params"].items():
        assert torch.equal(p, second["params"][name])


def test_fsdp_gru_recurrent_state(results):
    for res in _scenario(results, "gru"):
        assert_grads_match(res["grads0"], res["expected0"], "fsdp")
        # The initial state's gradient is the rank's own (not averaged).
        assert_grads_match({"h0": res["h0_0"]}, {"h0": res["h0_ref0"]}, "fsdp")


def test_fsdp_gru_second_rollout_accumulates_into_grad(results):
    for res in _scenario(results, "gru"):
        assert_grads_match(res["grads1"], res["expected1"], "fsdp")
        assert_grads_match({"h0": res["h0_1"]}, {"h0": res["h0_ref1"]}, "fsdp")
        assert not torch.allclose(res["grads1"]["cell.weight_hh"], res["grads0"]["cell.weight_hh"])


def test_fsdp_tensordict_outputs(results):
    """A model returning a TensorDict under plain FSDP1 (units inside and the root)."""
    for res in _scenario(results, "gru_tensordict"):
        assert_grads_match(res["grads"], res["expected"], "fsdp")


def test_fsdp_multi_step_blocks(results):
    """replay_steps blocks under FSDP1 (3 steps per block): the same gradients as plain
    autograd averaged over ranks, in 3 blocks."""
    for res in _scenario(results, "gru_steps"):
        assert res["blocks"] == 3
        assert_grads_match(res["grads"], res["expected"], "fsdp")


def test_fsdp_sequence_blocks_of_the_shipped_agent(results):
    """The skeleton's sequence forward under FSDP1 (core and Linears their own units): one
    call per 3-step block, the gradients of plain autograd over the same calls averaged over
    ranks; called step by step the same blocks agree to float rounding and gather each
    unit's parameters once per step, not once per block. GRU and LSTM: their cores run a block
    through the fused kernel; the windowed transformer: each attention layer a unit."""
    scenarios = ("agent_sequence", "lstm_agent_sequence", "gtrxl_agent_sequence")
    for res in [r for name in scenarios for r in _scenario(results, name)]:
        seq, step = res["sequence"], res["stepwise"]
        assert seq["blocks"] == step["blocks"] == 3
        assert_grads_match(seq["grads"], res["expected"], "fsdp")
        assert_grads_match(step["grads"], res["expected"], "fsdp-stepwise", rtol=1e-4, atol=1e-6)
        assert 0 < seq["gathers"] < step["gathers"] and seq["gathered_bytes"] < step["gathered_bytes"]


def test_fsdp_gru_clip_and_sgd_step(results):
    for res in _scenario(results, "gru"):
        assert_grads_match({"norm": res["norm"]}, {"norm": res["ref_norm"]}, "fsdp")
        assert res["ref_norm"].item() > 0.5
        assert_grads_match(res["params"], res["ref_params"], "fsdp")


# ------------------------------------------------- world size 1, in this process
@pytest.fixture
def single_process_group():
    """A one-rank gloo group in the test process, destroyed afterwards."""
    import _dist
    import torch.distributed as dist

    if not dist.is_available() or not dist.is_gloo_available():
        pytest.skip("needs torch.distributed with gloo")
    assert not dist.is_initialized(), "a test left a default process group behind"
    dist.init_process_group("gloo", rank=0, world_size=1, init_method=f"tcp://127.0.0.1:{_dist.free_port()}")
    try:
        yield
    finally:
        dist.destroy_process_group()


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_fsdp_world_size_1_no_shard(single_process_group):
    """One rank: FSDP1 turns FULL_SHARD into NO_SHARD (the engine accepts it); the
    gradient is then unsharded and accumulated across rollouts in place."""
    import copy

    import _dist
    import torch.nn as nn
    from torch.distributed.fsdp import ShardingStrategy

    from rl_replay import GradientAccumulator

    T, B, H = 12, 3, 12
    torch.manual_seed(3)
    ref = _dist.GRUPolicy()
    model = _dist._fsdp(copy.deepcopy(ref), {nn.Linear, nn.GRUCell})
    assert model.sharding_strategy == ShardingStrategy.NO_SHARD
    for _k in range(2):  # the second rollout adds to the first one's .grad
        obs, h0 = torch.randn(T, B, 5), torch.randn(B, H)
        h_rep, h_ref = h0.clone().requires_grad_(), h0.clone().requires_grad_()
        acc = GradientAccumulator()
        _dist.gru_loss(model, obs, h_rep, acc).backward()
        _dist.gru_loss(ref, obs, h_ref).backward()
        assert acc.blocks_replayed == T
        got = {_dist.clean(n): p.grad for n, p in model.named_parameters()}
        assert_grads_match(got, ref, "fsdp")
        assert_grads_match({"h0": h_rep.grad}, {"h0": h_ref.grad}, "fsdp")
    norm = model.clip_grad_norm_(0.5)
    torch.optim.SGD(model.parameters(), lr=0.2).step()
    ref_norm = _dist._ref_step(ref, 0.5, 0.2)
    assert_grads_match({"norm": norm.reshape(1)}, {"norm": ref_norm.reshape(1)}, "fsdp")
    params = {_dist.clean(n): p.detach() for n, p in model.named_parameters()}
    assert_grads_match(params, {n: p.detach() for n, p in ref.named_parameters()}, "fsdp")


STRATEGIES = ("SHARD_GRAD_OP", "NO_SHARD")


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_every_fsdp1_strategy_gives_plain_autograds_gradients_averaged_over_ranks(results, strategy):
    """gru (two rollouts into .grad, then clip and SGD) and gtrxl (3-step sequence blocks, a reset
    inside one) under each strategy served besides FULL_SHARD."""
    for res in scenario_results(results, "strategies", f"{strategy}/gru"):
        for k in (0, 1):
            assert_grads_match(res[f"grads{k}"], res[f"expected{k}"], "fsdp-strategies")
            assert_grads_match({"h0": res[f"h0_{k}"]}, {"h0": res[f"h0_ref{k}"]}, "fsdp-strategies")
        assert_grads_match(res["params"], res["ref_params"], "fsdp-strategies")
    for res in scenario_results(results, "strategies", f"{strategy}/gtrxl"):
        for call in ("sequence", "stepwise"):
            assert res[call]["blocks"] == 3
            assert_grads_match(res[call]["grads"], res["expected"], "fsdp-strategies", rtol=1e-4, atol=1e-6)
        if strategy == "NO_SHARD":
            assert res["sequence"]["gathers"] == 0  # nothing is sharded, so nothing is gathered
        else:  # gathered by the forward and kept through the backward: once per unit in the rollout
            assert 0 < res["sequence"]["gathers"] <= res["units"]
            assert 0 < res["stepwise"]["gathers"] <= res["units"]
        # Rule 11: the blocks' backwards keep the units gathered and reduce once, after the last
        # block: each unit at most one all-gather in the whole backward and exactly one reduction.
        for call in ("sequence", "stepwise"):
            assert res[call]["backward_gathers"] <= res["units"], (call, res[call]["backward_gathers"])
            assert res[call]["reductions"] == res["units"], (call, res[call]["reductions"])


def test_full_shard_still_reduces_per_block(results):
    """FULL_SHARD frees a unit after each block's backward and reduce-scatters per block (holding
    the unsharded sum would undo the sharding): the control for the counts above."""
    for res in scenario_results(results, "strategies", "FULL_SHARD/gtrxl"):
        assert_grads_match(res["sequence"]["grads"], res["expected"], "fsdp-strategies", rtol=1e-4, atol=1e-6)
        assert res["sequence"]["reductions"] == res["units"] * res["sequence"]["blocks"]
        assert res["sequence"]["backward_gathers"] > res["units"]


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_reducing_once_serves_a_last_block_without_gradient_and_refuses_a_block_never_reached(results, strategy):
    for res in scenario_results(results, "strategies", f"{strategy}/edges"):
        assert_grads_match(res["unused_last"]["grads"], res["unused_last_expected"], "fsdp-strategies")
        assert res["unused_last"]["reductions"] == res["units"]
        assert "1 of the rollout's 3 replay blocks got no backward" in res["missed"], res["missed"]
        assert res["synchronised_after"]
        assert_grads_match(res["after"], res["after_expected"], "fsdp-strategies")
        assert "the last of its rollout, does not run the FSDP unit(s) 'mlp.v'" in res["skipped_unit"], res[
            "skipped_unit"
        ]


def test_hybrid_shard_over_two_nodes_of_two_ranks_gives_plain_autograds_gradients(fsdp_hybrid4):
    """HYBRID_SHARD on a (replicate 2, shard 2) mesh of 4 gloo ranks: gru (two rollouts, clip, SGD)
    and gtrxl (3-step sequence blocks) equal plain autograd averaged over all four ranks. (FSDP1
    itself turns a shard group of one rank into NO_SHARD without the cross-replica average, so the
    run's wrapping needs two ranks per node: rl_replay.distributed.wrap_fsdp.)"""
    for res in scenario_results(fsdp_hybrid4, "hybrid", "gru"):
        for k in (0, 1):
            assert_grads_match(res[f"grads{k}"], res[f"expected{k}"], "fsdp-strategies")
        assert_grads_match(res["params"], res["ref_params"], "fsdp-strategies")
    for res in scenario_results(fsdp_hybrid4, "hybrid", "gtrxl"):
        for call in ("sequence", "stepwise"):
            assert_grads_match(res[call]["grads"], res["expected"], "fsdp-strategies", rtol=1e-4, atol=1e-6)
        assert 0 < res["sequence"]["gathers"] < res["stepwise"]["gathers"]


def test_hybrid_shard_collection_on_parameters_gathered_once(fsdp_hybrid4):
    """Collection's forwards inside rl_replay.gathered.gathered under HYBRID_SHARD (4 ranks as 2 nodes
    x 2): the same values as FSDP's own forward and as the unwrapped agent, bit for bit, with each unit
    gathered at most once instead of once per call."""
    for res in scenario_results(fsdp_hybrid4, "hybrid", "gathered"):
        assert torch.equal(res["gathered"]["values"], res["plain"]["values"])
        assert torch.equal(res["per_step"]["values"], res["plain"]["values"])
        assert 0 < res["gathered"]["gathers"] <= res["units"] < res["per_step"]["gathers"]


@pytest.mark.parametrize("local", ["1", None])
def test_hybrid_shard_with_one_rank_per_node_is_refused_in_one_line(single_process_group, monkeypatch, local):
    """FSDP1 would turn a shard group of one rank into NO_SHARD without averaging the replicas'
    gradients; the run's wrapping refuses it instead, naming what to use."""
    from rl_replay.distributed import wrap_fsdp
    from rl_replay.errors import SetupError

    if local is None:
        monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    else:
        monkeypatch.setenv("LOCAL_WORLD_SIZE", local)
    with pytest.raises(SetupError, match=r"HYBRID_SHARD .*needs at least two ranks per node .*use NO_SHARD"):
        wrap_fsdp(torch.nn.Linear(3, 2), torch.device("cpu"), sharding_strategy="HYBRID_SHARD")
