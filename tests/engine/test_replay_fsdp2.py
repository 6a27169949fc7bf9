"""A policy the user wrapped with FSDP2's ``fully_shard``, replayed on 2 gloo ranks: its public hooks
gather each unit in the block's forward and recompute and reduce-scatter every nested backward into
the sharded ``.grad``, so the gradients equal plain autograd's averaged over the ranks, for the shipped
GRU agent (one-step blocks and 3-step sequence calls with a reset inside a block,
``reshard_after_forward`` True and False), the LSTM, LRU and windowed-attention agents (3-step blocks,
a window shorter than the block) and the reference helper ``checkpoint_fsdp_forward``.
Scenarios in tests/_dist.py (``fsdp2_parity``), run by the session's one spawn."""

from __future__ import annotations

import pytest
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
