"""The README and docs/ cite only what exists: every relative link resolves to a file, every
repository path in backticks is a file or folder of the repository, every ``section.key=value``
override names a key of the config schema, and no page cites a file the repository never had."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import pytest

from rl_replay.config import Config

REPO = Path(__file__).resolve().parents[2]
PAGES = [REPO / "README.md", *sorted((REPO / "docs").rglob("*.md"))]
LINK = re.compile(r"\]\(([^)\s]+)\)")
PATH = re.compile(r"`((?:configs|scripts|docs|tests|rl_replay|agents|envs)/[\w./*-]+)`")
ENV_ID = re.compile(r"-v\d+$")  # rl_replay/MemoryCue-v0 is an env id, not a path
OVERRIDE = re.compile(r"(?<![\w./-])([a-z_]+\.[a-z_.]+)=")
FREE = ("env.kwargs.", "agent.kwargs.")  # the env's and the agent's own arguments


def _keys(cls: type, prefix: str = "") -> set[str]:
    keys = set()
    for f in dataclasses.fields(cls):
        default = f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
        keys.add(prefix + f.name)
        if dataclasses.is_dataclass(default):
            keys |= _keys(type(default), f"{prefix}{f.name}.")
    return keys


KEYS = _keys(Config)
SECTIONS = {key.split(".")[0] for key in KEYS if "." in key}


def test_the_pages_are_read():
    # the checks below pass on no pages at all: the pages they read must be there
    assert len(PAGES) > 10 and any(p.name == "learning.md" for p in PAGES)
    assert {"replay.block_steps", "loss.gamma", "env.id"} <= KEYS


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(REPO)))
def test_a_page_cites_only_what_exists(page):
    text = page.read_text()
    missing = []
    for target in LINK.findall(text):
        path = target.split("#")[0]
        if path and not target.startswith(("http:", "https:", "mailto:")) and not (page.parent / path).exists():
            missing.append(f"link {target}")
    for path in PATH.findall(text):
        path = path.rstrip(".")
        if "*" not in path and not ENV_ID.search(path) and not (REPO / path).exists():
            missing.append(f"path {path}")
    for key in OVERRIDE.findall(text):
        if key.split(".")[0] in SECTIONS and key not in KEYS and not key.startswith(FREE):
            missing.append(f"config key {key}")
    if "MEASUREMENTS.md" in text:
        missing.append("MEASUREMENTS.md (not a file of the repository)")
    assert missing == []
