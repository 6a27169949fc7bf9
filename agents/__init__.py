"""Reference policies built on :class:`rl_replay.Agent`."""
