"""Agent contract errors surface at setup, in one line, before the run directory is created."""

from __future__ import annotations

import pytest
from _runs import (
    TESTS,
    tiny,
)

from rl_replay.errors import SetupError
from rl_replay.run.setup import build


@pytest.mark.parametrize(
    "agent, pattern",
    [
        ("WrongKeyAgent", r"distribution\(\) needs key 'dist' but forward\(\) returned outputs \['distribution', "),
        ("ColumnValueAgent", r"'value' of shape \(1, 2, 1\); expected \(1, 2\)"),
        ("WideLogitsAgent", r"has 3 logits but the action space Discrete\(2\) has 2 actions"),
        ("NarrowLogitsAgent", r"has 1 logits but the action space Discrete\(2\) has 2 actions"),
        ("BatchNormAgent", r"forward\(\) changed its buffer 'body.1.running_mean', .*num_batches_tracked.*eval mode"),
        ("WideStateAgent", r"forward\(\) returned state 'h' of shape \(2, 16\) but initial_state\(\) gives \(2, 8\)"),
        (
            "NoResetAgent",
            r"with is_first set .* outputs \[.*'state.h'.*\] depend on the incoming state: .*Agent.reset_state",
        ),
        (
            "DistributionObjectAgent",
            r"forward\(\) returned 'dist' as a torch.distributions Categorical; return its "
            r"parameters instead",
        ),
    ],
)
def test_agent_contract_errors_before_the_run_dir(tmp_path, monkeypatch, agent, pattern):
    monkeypatch.syspath_prepend(str(TESTS))
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SetupError, match=rf"agent safety_agents:{agent}: .*{pattern}") as info:
        build(tiny(tmp_path / "run", 2, f"agent.target=safety_agents:{agent}", "agent.kwargs={}"))
    assert "\n" not in str(info.value)
    assert list(tmp_path.iterdir()) == []
