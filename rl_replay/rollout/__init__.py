"""Collecting experience as data: the vector env, the collector, the steps and episodes of a
sequence, and the environments' state in checkpoints.

Imports the shared modules (agent, errors, guards, targets) and nothing of the engine or of
:mod:`rl_replay.run`: re-running a stored rollout as replay blocks is :mod:`rl_replay.algorithms.stored`'s.
"""
