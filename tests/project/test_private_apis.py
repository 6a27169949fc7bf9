"""NOTE [ Private APIs ] (rl_replay/private_apis.py) against the code: every private use of a
dependency that the syntax trees of rl_replay/, agents/ and envs/ show is listed, and every listed use
is still there. Derived from the code, not from a list of known names: a new private use fails here."""

from __future__ import annotations

import ast
from pathlib import Path

from rl_replay.private_apis import PRIVATE_APIS, fsdp1_only

REPO = Path(__file__).resolve().parents[2]
ROOTS = ("rl_replay", "agents", "envs")
ACCESSORS = {"getattr", "setattr", "hasattr", "delattr"}
#: Names that look private but are documented public API.
DOCUMENTED = {"._exit": "os._exit"}


def private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__") and not name.startswith("_rl_replay")


def own_names(trees) -> set[str]:
    """What the project defines itself: functions, classes, module and local names, arguments,
    attributes it sets on ``self`` / ``cls``, and ``__slots__`` entries."""
    own: set[str] = set()
    for tree in trees:
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                own.add(node.name)
            elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
                if isinstance(node.value, ast.Name) and node.value.id in ("self", "cls"):
                    own.add(node.attr)
            elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
                own.add(node.id)
            elif isinstance(node, ast.arg):
                own.add(node.arg)
            elif isinstance(node, ast.Assign) and any(
                isinstance(t, ast.Name) and t.id == "__slots__" for t in node.targets
            ):
                own |= {
                    c.value for c in ast.walk(node.value) if isinstance(c, ast.Constant) and isinstance(c.value, str)
                }
    return own


def private_uses() -> dict[tuple[str, str], int]:
    """``{(name, file): line}`` of every private use of another package's name."""
    files = [f for root in ROOTS for f in sorted((REPO / root).rglob("*.py"))]
    trees = {str(f.relative_to(REPO)): ast.parse(f.read_text()) for f in files}
    own = own_names(trees.values())
    found: dict[tuple[str, str], int] = {}
    for path, tree in trees.items():
        for node in ast.walk(tree):
            names: list[str] = []
            if isinstance(node, ast.Attribute) and private(node.attr) and node.attr not in own:
                if not (isinstance(node.value, ast.Name) and node.value.id in ("self", "cls")):
                    names.append("." + node.attr)
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                if node.module == "__future__" or node.module.split(".")[0] == "rl_replay":
                    continue
                if any(private(part) for part in node.module.split(".")):
                    names.append(node.module)
                names += [f"{node.module}.{a.name}" for a in node.names if private(a.name)]
            elif isinstance(node, ast.Import):
                names += [a.name for a in node.names if any(private(part) for part in a.name.split("."))]
            elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in ACCESSORS:
                if (
                    len(node.args) >= 2
                    and isinstance(node.args[1], ast.Constant)
                    and isinstance(node.args[1].value, str)
                ):
                    if private(node.args[1].value) and node.args[1].value not in own:
                        names.append("." + node.args[1].value)
            for name in names:
                if name not in DOCUMENTED:
                    found.setdefault((name, path), node.lineno)
    return found


def test_every_private_use_is_listed_and_every_listed_use_is_there():
    found = private_uses()
    listed = {(use.name, use.path) for use in PRIVATE_APIS}
    unlisted = sorted(
        f"{path}:{line} uses {name}" for (name, path), line in found.items() if (name, path) not in listed
    )
    assert not unlisted, "list these in NOTE [ Private APIs ] (rl_replay/private_apis.py): " + "; ".join(unlisted)
    gone = sorted(f"{name} in {path}" for name, path in listed if (name, path) not in found)
    assert not gone, "NOTE [ Private APIs ] lists uses that are gone: " + "; ".join(gone)
    assert len(listed) == len(PRIVATE_APIS)  # one entry per use


def test_the_scan_sees_each_kind_of_private_use(tmp_path, monkeypatch):
    """The scan is not vacuous: a planted file with each kind of use is found, names the project
    defines itself and its own markers are not."""
    planted = REPO / "rl_replay" / "_scan_probe_for_tests.py"
    planted.write_text(
        "import torch._dynamo\n"
        "from torch.nn.modules.conv import _ConvNd\n"
        "from torch._C import _get_tracing_state\n"
        "def f(t, m):\n"
        "    m._rl_replay_marker = True\n"
        "    getattr(m, '_forward_pre_hooks')\n"
        "    return t._cdata, f._own_attr\n"
        "f._own_attr = 1\n"
    )
    try:
        found = {name for name, path in private_uses() if path == "rl_replay/_scan_probe_for_tests.py"}
    finally:
        planted.unlink()
    assert found == {
        "torch._dynamo",
        "torch.nn.modules.conv._ConvNd",
        "torch._C",
        "torch._C._get_tracing_state",
        "._forward_pre_hooks",
        "._cdata",
        "._own_attr",
    }


def test_the_fsdp1_only_uses_are_the_fsdp1_paths():
    assert {use.path for use in fsdp1_only()} == {
        "rl_replay/engine/fsdp.py",
        "rl_replay/gathered.py",
        "rl_replay/engine/plan.py",
    }
    assert all(use.why and use.owner for use in PRIVATE_APIS)
