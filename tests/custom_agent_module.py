"""A user-defined agent living outside the package, loaded through ``agent.target``.

Used by tests/run/test_trainer.py as ``custom_agent_module:TinyAgent`` (tests/ on sys.path).
TinyAgent is written to the docs from before the one agent shape (a one-step ``forward``): it
must keep training, resuming and evaluating through the StepwiseAgent adapter.
"""

from __future__ import annotations

from tensordict import TensorDict
from torch import nn

from rl_replay.agent import ActionHead, Agent, StepwiseAgent
from rl_replay.agents.gru import GRUAgent


class TinyAgent(Agent):
    """One hidden layer shared by the actor and the critic."""

    def __init__(self, observation_space, action_space, hidden: int = 8):
        super().__init__(observation_space, action_space)
        self.body = nn.Sequential(nn.Linear(self.obs_dim, hidden), nn.Tanh())
        self.head = ActionHead(action_space, hidden, init_std=1.0)
        self.critic = nn.Linear(hidden, 1)

    def forward(self, observation, state, is_first):
        x = self.body(observation.flatten(1))
        return TensorDict(
            dist=self.head(x), value=self.critic(x).squeeze(-1), state=state, batch_size=observation.shape[:1]
        )


class NotAnAgent(nn.Module):
    """Looks like a policy but does not subclass rl_replay.Agent."""


MARKER = "/nonexistent/rl_replay_plant_marker"


def plant_marker(*args, **kwargs):
    """What a hostile config would name as a target: calling it leaves a file at MARKER."""
    open(MARKER, "w").close()


class StepwiseGRUAgent(StepwiseAgent, GRUAgent):
    """The shipped GRU agent as a step-only agent: replay blocks call it step by step."""

    def step(self, observation, state, is_first):
        out = GRUAgent.forward(self, observation.unsqueeze(0), state, is_first.unsqueeze(0))
        step = out["outputs"][0]
        step["state"] = out["state"]
        return step
