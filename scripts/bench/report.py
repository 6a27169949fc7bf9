"""Reporting for the benchmark scripts in ``scripts/`` (not part of the library).

The measuring side (``common.py``, the workers) produces plain JSON-serialisable
dicts; everything here turns them into text: number formatting, and writing a rendered
markdown section into a docs file. A benchmark never edits a committed file unless asked:
``--write-docs [PATH]`` (see :func:`add_write_docs_argument`) updates its marked section
of ``PATH`` (``docs/benchmarks.md`` when no path is given).
"""

from __future__ import annotations

import argparse
import math
import os

from scripts.bench.common import ROOT

DOCS = os.path.join(ROOT, "docs", "benchmarks.md")


# ----------------------------------------------------------------------------- formatting
def fmt_bytes(n: float | None) -> str:
    if n is None or (isinstance(n, float) and math.isnan(n)):
        return "-"
    n = float(n)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} GiB"


def fmt_s(s: float | None) -> str:
    if s is None or (isinstance(s, float) and math.isnan(s)):
        return "-"
    if s < 1e-3:
        return f"{s * 1e6:.0f} us"
    if s < 1:
        return f"{s * 1e3:.1f} ms"
    return f"{s:.2f} s"


# ----------------------------------------------------------------------------- docs
def add_write_docs_argument(parser: argparse.ArgumentParser, section: str) -> None:
    """``--write-docs [PATH]``: opt in to updating the ``section`` of a markdown file."""
    parser.add_argument(
        "--write-docs",
        nargs="?",
        const=DOCS,
        default=None,
        metavar="PATH",
        help=f"update the marked section '{section}' of PATH (default {os.path.relpath(DOCS, ROOT)}) "
        "with the results; without it nothing but --json / --plot-dir output is written",
    )


def add_worker_arguments(parser: argparse.ArgumentParser, section: str) -> None:
    """The flags every worker-launching benchmark shares: ``--launcher``, ``--write-docs``,
    ``--smoke`` and the hidden ``--worker`` (how the launcher starts a measurement)."""
    parser.add_argument("--launcher", choices=["forkserver", "subprocess"], default="forkserver")
    add_write_docs_argument(parser, section)
    parser.add_argument("--smoke", action="store_true", help="tiny settings that test the script (seconds)")
    parser.add_argument("--worker", help=argparse.SUPPRESS)


def refuse_smoke_docs(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """--smoke numbers are a test of the script, not results: never documented."""
    if getattr(args, "smoke", False) and args.write_docs:
        parser.error(
            "--smoke measures tiny policies to test the script; its numbers do not go into "
            "the docs: drop --write-docs, or drop --smoke to measure the real configuration"
        )


def write_section(path: str, name: str, body: str) -> None:
    """Update the section ``name`` of ``path`` (see :func:`update_marked_section`) and say so."""
    update_marked_section(path, name, body)
    print(f"updated section '{name}' of {path}", flush=True)


def update_marked_section(path: str, name: str, body: str) -> None:
    """Replace ``<!-- BEGIN name -->...<!-- END name -->`` in ``path`` (append if absent)."""
    begin, end = f"<!-- BEGIN {name} -->", f"<!-- END {name} -->"
    block = f"{begin}\n{body.rstrip()}\n{end}"
    text = open(path, encoding="utf-8").read() if os.path.exists(path) else ""
    if begin in text and end in text:
        head, rest = text.split(begin, 1)
        _, tail = rest.split(end, 1)
        text = head + block + tail
    else:
        text = text.rstrip() + ("\n\n" if text else "") + block + "\n"
    tmp = path + ".tmp"
    with open(tmp, "w", encoding="utf-8") as fh:
        fh.write(text)
    os.replace(tmp, path)
