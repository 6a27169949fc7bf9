"""The import arrows of docs/architecture.md hold: no module of rl_replay imports a package
above its own, and the collector hands rollouts to the algorithms without importing the
engine. Read from the source (every import statement, those inside functions too), so a
lazy import cannot hide an arrow that runs back up."""

from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
# Floors from the top (docs/architecture.md): a module may import its own floor and those below.
FLOORS = {"run": 6, "rundir": 5, "algorithms": 4, "rollout": 3, "engine": 1}
SHARED = 2  # the top-level modules, config/, and the reference agents and envs


def floor(module: str) -> int:
    """The floor of ``rl_replay.<package>...`` (a shared module when the package is not named)."""
    parts = module.split(".")
    return FLOORS.get(parts[1], SHARED) if len(parts) > 1 else SHARED


def source_files() -> dict[str, Path]:
    """Module name -> file, for rl_replay and the agents and envs installed inside it."""
    files = {}
    for root, package in (
        (REPO / "rl_replay", "rl_replay"),
        (REPO / "agents", "rl_replay.agents"),
        (REPO / "envs", "rl_replay.envs"),
    ):
        for path in root.rglob("*.py"):
            parts = path.relative_to(root).with_suffix("").parts
            if parts[-1] == "__init__":
                parts = parts[:-1]
            files[".".join((package, *parts))] = path
    return files


def imports_of(module: str, path: Path) -> set[str]:
    """The rl_replay modules ``path`` imports (relative imports resolved against ``module``)."""
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                name = ".".join([*base, node.module] if node.module else base)
            else:
                name = node.module or ""
            found.add(name)
    return {name for name in found if name == "rl_replay" or name.startswith("rl_replay.")}


FILES = source_files()


def test_the_tree_is_read():
    # The checks below would pass on an empty tree: the modules they rely on must be there.
    assert {
        "rl_replay.run.trainer",
        "rl_replay.rollout.collector",
        "rl_replay.engine.replay",
        "rl_replay.agents.gru",
    } <= set(FILES)
    assert "rl_replay.engine" in imports_of("rl_replay.algorithms.stored", FILES["rl_replay.algorithms.stored"])


def test_no_arrow_runs_back_up():
    # rl_replay/__init__.py re-exports the public API from every floor: it is the door, not a floor.
    upward = {
        module: sorted(name for name in imports_of(module, path) if name != "rl_replay" and floor(name) > floor(module))
        for module, path in FILES.items()
        if module != "rl_replay"
    }
    assert {module: names for module, names in upward.items() if names} == {}


def test_the_rollout_does_not_import_the_engine():
    # A rollout is data: the algorithm that wants a graph passes its own forward in, and
    # re-running a stored rollout as replay blocks is the algorithms' (rl_replay.algorithms.stored).
    rollout = [module for module in FILES if module.startswith("rl_replay.rollout")]
    assert "rl_replay.rollout.collector" in rollout
    for module in rollout:
        imported = imports_of(module, FILES[module])
        assert not [name for name in imported if name.startswith("rl_replay.engine") or name == "rl_replay"], module


def test_the_check_sees_an_upward_arrow(tmp_path):
    # The rule above is not vacuous: a shared module importing the trainer is caught.
    bad = tmp_path / "bad.py"
    bad.write_text("def f():\n    from rl_replay.run.trainer import Trainer\n")
    upward = [name for name in imports_of("rl_replay.bad", bad) if floor(name) > floor("rl_replay.bad")]
    assert upward == ["rl_replay.run.trainer"]
