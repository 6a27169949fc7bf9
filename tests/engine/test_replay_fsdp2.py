"""A policy the user wrapped with FSDP2's ``fully_shard``, replayed on 2 gloo ranks: its public hooks
gather each unit in the block's forward and recompute and reduce-scatter every nested backward into
the sharded ``.grad``, so the gradients equal plain autograd's averaged over the ranks, for the shipped
GRU agent (one-step blocks and 3-step sequence calls with a reset inside a block,
``reshard_after_forward`` True and False), the LSTM, LRU and windowed-attention agents (3-step blocks,
a window shorter than the block) and the reference helper ``checkpoint_fsdp_forward``.
Scenarios in tests/_dist.py (``fsdp2_parity``), run by the session's one spawn."""

from __future__ import annotations

import pytest
import torch
from conftest import assert_grads_match, scenario_results


@pytest.mark.parametrize(
    "scenario, blocks",
    [
        ("gru_reshard_steps1", 8),
        ("gru_reshard_steps3", 3),
        ("gru_keep_steps3", 3),
        ("lstm_reshard_steps3", 3),
        ("lru_keep_steps3", 3),
        ("gtrxl_reshard_steps3", 3),
        ("helper_mlp", 10),
    ],
)
def test_fsdp2_gives_plain_autograds_gradients_averaged_over_ranks(fsdp_world2, scenario, blocks):
    results = scenario_results(fsdp_world2, "fsdp2", scenario)
    assert len(results) == 2
    for res in results:
        assert res["blocks"] == blocks
        assert set(res["grads"]) == set(res["expected"]) and res["grads"]
        assert all(g.abs().sum() > 0 for g in res["expected"].values())
        assert_grads_match(res["grads"], res["expected"], "fsdp2")


VERSION_CASES = [
    (kind, strategy) for kind in ("mlp", "gru", "lstm", "lru", "gtrxl") for strategy in ("FULL_SHARD", "SHARD_GRAD_OP")
]


@pytest.mark.parametrize("kind, strategy", [*VERSION_CASES, ("gru", "NO_SHARD"), ("gru", "size_rule")])
def test_fsdp2_equals_fsdp1_and_plain_autograd_with_the_trainers_wrapping(fsdp_world2, kind, strategy):
    """``wrap_fsdp2`` (the trainer's FSDP2: every unit, then the root) against ``wrap_fsdp`` (FSDP1) with
    the same units and strategy, 3 blocks of 3 steps with resets inside two of them: the same gradients,
    both equal to plain autograd's averaged over the ranks. Where the units keep their parameters gathered
    (SHARD_GRAD_OP, NO_SHARD) the blocks' gradient is reduced once per backward, else once per block."""
    results = scenario_results(fsdp_world2, "fsdp2", f"{kind}_{strategy}")
    assert len(results) == 2
    for res in results:
        assert res["blocks"] == 3 and res["units"] >= 3  # at least two units besides the root
        # the same units under both versions (distributed.min_num_params: FSDP1's size rule)
        assert res["unit_names"][1] == res["unit_names"][2], res["unit_names"]
        assert set(res["grads"]) == set(res["expected"]) == set(res["fsdp1"]) and res["grads"]
        assert all(g.abs().sum() > 0 for g in res["expected"].values())
        assert_grads_match(res["grads"], res["expected"], "fsdp2")
        assert_grads_match(res["grads"], res["fsdp1"], "fsdp2-vs-fsdp1")
        if strategy in ("FULL_SHARD", "size_rule"):
            # every block's backward reduces each unit it ran
            assert res["reductions"] == res["blocks"] * res["holders"]
        else:
            assert res["reductions"] == res["holders"], "the blocks' gradient was not reduced once per unit"


def test_fsdp2_collection_gathers_once_per_rollout_with_the_same_rollout_and_gradients(fsdp_world2):
    """distributed.collect_gathered under FSDP2: ``unshard()`` once for the rollout gives the rollout and
    (for replayed blocks, whose backward recomputes through FSDP2's own forward) the gradients that a
    gather at every step gives, with one all-gather per unit instead of one per unit and step."""
    for res in scenario_results(fsdp_world2, "fsdp2", "collection"):
        (per_step, per_step_gathers), (once, once_gathers) = res["stored_False"], res["stored_True"]
        keys = list(per_step.keys(include_nested=True, leaves_only=True))
        assert keys and all(torch.equal(per_step[k], once[k]) for k in keys)
        assert once_gathers <= res["units"] < per_step_gathers
        assert per_step_gathers >= (res["units"] - 1) * res["steps"]
        grads_step, gathers_step, resets = res["replayed_False"]
        grads_once, gathers_once, _ = res["replayed_True"]
        assert resets > 0, "no episode boundary inside the rollout"
        assert gathers_once <= res["units"] < gathers_step
        assert set(grads_once) == set(grads_step) and all(torch.equal(grads_once[n], grads_step[n]) for n in grads_step)
