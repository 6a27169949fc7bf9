"""rl_replay: policy-gradient training on long rollouts with blockwise autograd replay.

The replay engine (:mod:`rl_replay.engine`: :func:`replay`, :func:`checkpoint_fsdp_forward`,
:class:`GradientAccumulator`) is independent of the trainer and can be used alone; its
public names are re-exported here. Everything else (the trainer, the collector, the
algorithms) lives in submodules imported on first use.
"""

import importlib.abc
import importlib.util
import sys
from pathlib import Path

from rl_replay.engine import (
    GradientAccumulator,
    ReplayError,
    StateWatch,
    checkpoint_fsdp_forward,
    keep_freed_memory,
    replay,
    replay_sequence_call,
    replay_steps,
)

__all__ = [
    "Agent",
    "StepwiseAgent",
    "Policy",
    "GradientAccumulator",
    "ReplayError",
    "StateWatch",
    "checkpoint_fsdp_forward",
    "keep_freed_memory",
    "replay",
    "replay_sequence_call",
    "replay_steps",
]
__version__ = "0.1.0"


class _SourceTreeFinder(importlib.abc.MetaPathFinder):
    """Finds ``rl_replay.agents`` and ``rl_replay.envs`` in a source checkout.

    They are the repository's top-level ``agents/`` and ``envs/`` folders: ``pip install .``
    copies them into the package and ``pip install -e .`` maps them there (pyproject.toml's
    ``package-dir``), but a checkout that is only on ``PYTHONPATH`` has no such mapping.
    Their submodules are then found through the package's ``__path__`` as usual.
    """

    FOLDERS = {"rl_replay.agents": "agents", "rl_replay.envs": "envs"}

    def __init__(self, root: Path) -> None:
        self.root = root

    def find_spec(self, fullname, path=None, target=None):
        if fullname not in self.FOLDERS:
            return None
        init = self.root / self.FOLDERS[fullname] / "__init__.py"
        if not init.is_file():
            return None
        return importlib.util.spec_from_file_location(fullname, init, submodule_search_locations=[str(init.parent)])


def _find_source_tree_packages() -> None:
    # An installed copy holds agents/ inside the package; a checkout has pyproject.toml next to it.
    package_dir = Path(__file__).resolve().parent
    if (package_dir / "agents").is_dir() or not (package_dir.parent / "pyproject.toml").is_file():
        return
    if not any(isinstance(f, _SourceTreeFinder) for f in sys.meta_path):
        # First, so the code comes from this tree even when an editable install of another
        # checkout (whose finder maps the same names) is on the path.
        sys.meta_path.insert(0, _SourceTreeFinder(package_dir.parent))


_find_source_tree_packages()


def __getattr__(name: str):
    # rl_replay.Agent is imported on first use, so taking the engine alone does not pull
    # in gymnasium and the trainer side.
    if name in ("Agent", "StepwiseAgent", "Policy"):
        from rl_replay import agent

        return getattr(agent, name)
    raise AttributeError(f"module 'rl_replay' has no attribute {name!r}")
