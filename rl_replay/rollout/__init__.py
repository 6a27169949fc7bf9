"""Collecting experience: the vector env, the collector, stored rollouts
re-run as replay blocks, and the environments' state in checkpoints.

Imports the engine and the shared modules (agent, errors, guards, targets), never :mod:`rl_replay.run`.
"""
