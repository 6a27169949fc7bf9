"""Results are data: docs/results/configs.json names every shipped config once, each config's header
is at most two lines rendered from it (what it is and reaches, then its command), and the tables in
docs/learning.md and the README are its rendering (scripts/tools/render_results.py --check)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
CONFIGS = sorted(p.relative_to(REPO).as_posix() for p in (REPO / "configs").rglob("*.yaml"))


def _render():
    spec = importlib.util.spec_from_file_location("render_results", REPO / "scripts" / "tools" / "render_results.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_every_shipped_config_has_one_entry():
    entries = _render().load()
    names = [e["config"] for e in entries]
    assert len(CONFIGS) > 30 and sorted(names) == CONFIGS
    for e in entries:
        assert e["what"] and e["reaches"] and (REPO / e["study"]).is_file(), e["config"]
        assert not e["command"] or f"--config {e['config']}" in e["command"] or e["config"].endswith("default.yaml")


def test_headers_and_tables_are_the_rendering_of_the_data():
    render = _render()
    entries = render.load()
    for path, text in render.rendered(entries).items():
        assert path.read_text() == text, f"{path.relative_to(REPO)}: run scripts/tools/render_results.py"
    for name in CONFIGS:
        lines = (REPO / name).read_text().splitlines()
        header = next(i for i, line in enumerate(lines) if not line.startswith("#"))
        assert 1 <= header <= 2, name


def test_a_change_to_the_data_is_seen():
    # the check above would pass if rendering ignored the data: a changed entry changes the files
    render = _render()
    entries = render.load()
    changed = [dict(e) for e in entries]
    changed[0]["reaches"] = "something else"
    before, after = render.rendered(entries), render.rendered(changed)
    differ = [p for p in before if before[p] != after[p]]
    assert REPO / changed[0]["config"] in differ and REPO / "docs" / "learning.md" in differ
