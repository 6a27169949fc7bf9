"""The names configs use for the shipped classes, in one place: name -> ``"module:Class"``.

Strings, not classes, so that reading or validating a config imports nothing heavy (no torch);
the classes are imported when a run is built (:func:`rl_replay.agent.load_agent_class`,
:data:`rl_replay.algorithms.REGISTRY`). Adding a shipped agent or update rule is one line here.
"""

from __future__ import annotations

__all__ = ["AGENTS", "ALGORITHMS"]

#: Short names of the reference agents for ``agent.target`` (as SB3 names its policies).
AGENTS = {
    "mlp": "rl_replay.agents.mlp:MLPAgent",
    "gru": "rl_replay.agents.gru:GRUAgent",
    "lstm": "rl_replay.agents.lstm:LSTMAgent",
    "lru": "rl_replay.agents.lru:LRUAgent",
    "mingru": "rl_replay.agents.mingru:MinGRUAgent",
    "transformer": "rl_replay.agents.transformer:TransformerAgent",
    "gtrxl": "rl_replay.agents.gtrxl:WindowTransformerAgent",
}

#: ``loss.algorithm`` -> its :class:`~rl_replay.algorithms.base.Algorithm`.
ALGORITHMS = {
    "a2c": "rl_replay.algorithms.a2c:A2C",
    "reinforce": "rl_replay.algorithms.reinforce:REINFORCE",
    "ppo": "rl_replay.algorithms.ppo:PPO",
}
