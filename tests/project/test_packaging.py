"""What gets installed: rl_replay with its agents and envs inside it, no top-level packages
named ``agents`` or ``envs``; and a source checkout on PYTHONPATH finds the same modules."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
# What the imports below report: where each module came from, and whether the old names exist.
PROBE = """
import json, sys
import rl_replay.agents.gru, rl_replay.envs, gymnasium
print(json.dumps({"agents": rl_replay.agents.gru.__file__, "envs": rl_replay.envs.__file__,
                  "memory_cue": gymnasium.spec("rl_replay/MemoryCue-v0").entry_point,
                  "old_names": [n for n in ("agents", "envs") if n in sys.modules]}))
"""


def _run(code: str, cwd: Path, pythonpath: str) -> dict:
    env = {**os.environ, "PYTHONPATH": pythonpath}
    out = subprocess.run([sys.executable, "-c", code], cwd=cwd, env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.strip().splitlines()[-1])


def _setuptools_table() -> dict:
    tomllib = pytest.importorskip("tomllib")  # Python >= 3.11
    return tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]


def _package_dirs(package_dir: dict[str, str]) -> dict[str, str]:
    """Every package in the tree, named as installed: ``{name: folder}``."""
    mapped = {folder: name for name, folder in package_dir.items()}
    found = {}
    for init in [
        *REPO.glob("rl_replay/**/__init__.py"),
        *REPO.glob("agents/**/__init__.py"),
        *REPO.glob("envs/**/__init__.py"),
    ]:
        folder = init.parent.relative_to(REPO).as_posix()
        top, _, rest = folder.partition("/")
        name = mapped.get(top, top) + ("." + rest.replace("/", ".") if rest else "")
        found[name] = folder
    return found


def test_every_package_is_installed_and_none_at_the_top_level_but_rl_replay():
    # The list is explicit (package-dir needs it): a new subpackage must be added to it.
    setuptools = _setuptools_table()
    assert sorted(setuptools["packages"]) == sorted(_package_dirs(setuptools["package-dir"]))
    assert {name.split(".")[0] for name in setuptools["packages"]} == {"rl_replay"}


def test_a_checkout_on_pythonpath_finds_the_agents_and_envs_of_the_same_tree(tmp_path):
    found = _run(PROBE, cwd=tmp_path, pythonpath=str(REPO))
    assert found["agents"] == str(REPO / "agents" / "gru.py")
    assert found["envs"] == str(REPO / "envs" / "__init__.py")
    assert found["memory_cue"] == "rl_replay.envs.memory:MemoryCueEnv" and found["old_names"] == []


@pytest.mark.slow
def test_a_regular_install_holds_agents_and_envs_inside_rl_replay(tmp_path):
    # --no-build-isolation: build with this environment's setuptools (no network needed);
    # from a copy, since pip builds in the source tree (build/, *.egg-info).
    pytest.importorskip("setuptools")
    source, target = tmp_path / "source", tmp_path / "site"
    for name in ("rl_replay", "agents", "envs"):
        shutil.copytree(REPO / name, source / name, ignore=shutil.ignore_patterns("__pycache__"))
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(REPO / name, source / name)
    build = subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "install",
            "--no-deps",
            "--no-build-isolation",
            "--target",
            str(target),
            str(source),
        ],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert build.returncode == 0, build.stderr
    top_level = sorted(p.name for p in target.iterdir() if not p.name.endswith((".dist-info", "__pycache__")))
    assert top_level == ["bin", "rl_replay"] or top_level == ["rl_replay"], top_level
    found = _run(PROBE, cwd=tmp_path, pythonpath=str(target))
    assert found["agents"] == str(target / "rl_replay" / "agents" / "gru.py")
    assert found["envs"] == str(target / "rl_replay" / "envs" / "__init__.py")
    assert found["old_names"] == []


def test_the_old_names_go_when_their_version_comes():
    """rl_replay/_compat.py's shims are dropped in REMOVED_IN: this fails once the package's version
    reaches it, so that the shims, their tests and the docs' migration notes are removed with it."""
    import tomllib

    from rl_replay._compat import REMOVED_IN

    version = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["version"]

    def parts(text):
        return tuple(int(x) for x in text.split(".")[:3])

    assert parts(version) < parts(REMOVED_IN), (
        f"rl_replay {version} has reached REMOVED_IN={REMOVED_IN}: remove the old names of rl_replay/_compat.py"
    )


# (how a use looks in the source, the name NOTE [ Private APIs ] lists it under); an attribute of
# the module's own objects (self._handle) is not a dependency's.
