"""Old names that still resolve, gathered in one place with the version that drops them.

The one migration story (docs/checkpoints.md, "Migration from format 1"):

* **Checkpoint format 1** (a pickle) is no longer read by any command: it is refused with the
  command that converts a trusted file (``scripts/convert_checkpoint.py --trust``), which is
  the only code that knows the old layouts (:func:`rl_replay.run.checkpoint.convert_legacy`).
* **Module names inside pickled environments** (``env_state.pkl``, and the env pickles of a
  converted format-1 checkpoint) and **import paths in an older run's config.yaml**: the
  reference agents and envs were the top-level packages ``agents`` / ``envs`` before 0.1.0, and
  the flat modules of ``rl_replay`` moved into ``rl_replay.rollout`` / ``rl_replay.run`` in
  0.2.0. :func:`current_module_name` maps the old names. Removed in 0.3.0.
* **``ppo.norm_adv``** in an older config is read as ``loss.normalize_advantages``
  (``rl_replay.config``); removed in 0.3.0.
"""

from __future__ import annotations

import importlib.util

__all__ = ["RENAMED_PACKAGES", "RENAMED_MODULES", "current_module_name", "REMOVED_IN"]

REMOVED_IN = "0.3.0"

# old top-level package -> where it lives now (a prefix: its submodules follow)
RENAMED_PACKAGES = {"agents": "rl_replay.agents", "envs": "rl_replay.envs"}

# old module -> new module (exact names); only what pickles or configs can name
RENAMED_MODULES = {
    "rl_replay.env_state": "rl_replay.rollout.env_state",
    "rl_replay.environment": "rl_replay.rollout.environment",
    "rl_replay.collector": "rl_replay.rollout.collector",
}


def current_module_name(module: str) -> str:
    """``module``, or its new name if it is an old one.

    ``agents.gru`` becomes ``rl_replay.agents.gru`` only where that module exists, so a
    user's own package that happens to be called ``agents`` keeps resolving to itself.
    """
    if module in RENAMED_MODULES:
        return RENAMED_MODULES[module]
    top, dot, rest = module.partition(".")
    if top not in RENAMED_PACKAGES:
        return module
    renamed = RENAMED_PACKAGES[top] + dot + rest
    try:
        found = importlib.util.find_spec(renamed) is not None
    except ImportError:  # a parent of ``renamed`` does not exist
        found = False
    return renamed if found else module
