"""Render the measured results kept as data into the places that quote them.

``docs/results/configs.json`` holds, per shipped config, what it is, what it reaches (one line,
with the time it takes), its study, its command and the measurement as it was written down
(per seed). From it this script writes, and with ``--check`` compares:

* each config's header: two comment lines, what it is and what it reaches (with its study), then
  its command;
* the table between ``<!-- results:configs -->`` and ``<!-- /results:configs -->`` in
  docs/learning.md (every config, what it reaches, the measurement);
* the table between the same markers in the README (the configs by group).

Results flow one way: edit the JSON, then run this script; a test runs ``--check``.

    python scripts/tools/render_results.py            # rewrite the headers and the two tables
    python scripts/tools/render_results.py --check    # exit 1 naming what is out of date
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
DATA = REPO / "docs" / "results" / "configs.json"
BEGIN, END = "<!-- results:configs -->", "<!-- /results:configs -->"


def load(path: Path = DATA) -> list[dict]:
    """The entries of ``configs.json``, in its order."""
    return json.loads(path.read_text())["configs"]


def header(entry: dict) -> list[str]:
    """A config's header: at most two comment lines."""
    what = entry["what"][:1].upper() + entry["what"][1:]
    lines = [f"# {what}: {entry['reaches']}. Study: {entry['study']}."]
    if entry["command"]:
        lines.append(f"#   {entry['command']}")
    return lines


def with_header(text: str, entry: dict) -> str:
    """``text`` (a config file) with its leading comment lines replaced by :func:`header`."""
    body = text.splitlines(keepends=True)
    while body and body[0].startswith("#"):
        body.pop(0)
    return "\n".join(header(entry)) + "\n" + "".join(body)


def learning_table(entries: list[dict]) -> str:
    rows = ["| config | what it is | what it reaches | measured | study |", "|---|---|---|---|---|"]
    for e in entries:
        name = e["config"].removeprefix("configs/")
        cells = [f"`{name}`", e["what"], e["reaches"], e["measured"] or "-", e["study"].removeprefix("docs/")]
        rows.append("| " + " | ".join(c.replace("|", "/") for c in cells) + " |")
    return "\n".join(rows)


def readme_table(entries: list[dict]) -> str:
    groups: dict[str, list[str]] = {}
    for e in entries:
        groups.setdefault(e["group"], []).append(f"`{e['config'].removeprefix('configs/')}`")
    rows = ["| what it trains | configs |", "|---|---|"]
    rows += [f"| {group} | {', '.join(names)} |" for group, names in groups.items()]
    return "\n".join(rows)


def with_section(text: str, table: str, where: Path) -> str:
    """``text`` with the part between the markers replaced by ``table``."""
    if BEGIN not in text or END not in text:
        raise SystemExit(f"render_results: {where} has no {BEGIN} ... {END} section")
    head, rest = text.split(BEGIN, 1)
    _, tail = rest.split(END, 1)
    return f"{head}{BEGIN}\n{table}\n{END}{tail}"


def rendered(entries: list[dict], repo: Path = REPO) -> dict[Path, str]:
    """Every file this script writes, with the text it should hold."""
    out = {}
    for e in entries:
        path = repo / e["config"]
        out[path] = with_header(path.read_text(), e)
    learning, readme = repo / "docs" / "learning.md", repo / "README.md"
    out[learning] = with_section(learning.read_text(), learning_table(entries), learning)
    out[readme] = with_section(readme.read_text(), readme_table(entries), readme)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--check", action="store_true", help="write nothing; exit 1 naming the files out of date")
    args = ap.parse_args(argv)
    entries = load()
    stale = []
    for path, text in rendered(entries).items():
        if path.read_text() != text:
            stale.append(str(path.relative_to(REPO)))
            if not args.check:
                path.write_text(text)
    if args.check and stale:
        print(f"out of date with {DATA.relative_to(REPO)}: {', '.join(stale)}; run scripts/tools/render_results.py")
        return 1
    print(
        f"{'checked' if args.check else 'rendered'} {len(entries)} configs"
        + (f", rewrote {len(stale)} files" if stale and not args.check else "")
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
