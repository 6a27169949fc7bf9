"""The first metrics row of configs, to show a refactoring changed nothing a run learns.

Each config trains one update (``total_env_steps=1``: one update in every collector mode) in a
fresh process on one thread, without checkpoints or wandb, and its first ``metrics.jsonl`` row is
kept without the keys that measure the machine rather than the run (``time/``, ``memory/``,
``perf/``). ``--write FILE`` stores the rows (JSON, one per config); ``--check FILE`` runs the configs
again and says, per config, whether the row is identical to the stored one, value for value (the
JSON round trip of a float is exact), naming the keys that differ. Exit 1 if any differs.

    python scripts/tools/first_rows.py configs/default.yaml configs/ppo_pocartpole_gru.yaml --write rows.json
    python scripts/tools/first_rows.py --check tests/data/first_rows.json        # the configs the file names
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
MACHINE_KEYS = ("time/", "memory/", "perf/")


def first_row(config: str, timeout: float = 1800) -> dict:
    """One update of ``config`` (a path relative to the repository, or absolute); its first row
    without the machine's keys."""
    with tempfile.TemporaryDirectory() as tmp:
        run = Path(tmp) / "run"
        command = [
            sys.executable,
            str(REPO / "scripts" / "train.py"),
            "--config",
            str(REPO / config),
            "total_env_steps=1",
            "torch_threads=1",
            "checkpoint.every=0",
            "log.wandb_mode=disabled",
            "log.progress=false",
            f"run_dir={run}",
        ]
        env = {**os.environ, "OMP_NUM_THREADS": "1", "WANDB_MODE": "disabled"}
        proc = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)
        if proc.returncode != 0:
            raise SystemExit(f"first_rows: {config} failed (exit {proc.returncode}):\n{proc.stderr[-3000:]}")
        line = (run / "metrics.jsonl").read_text().splitlines()[0]
    row = json.loads(line)
    return {k: v for k, v in row.items() if not k.startswith(MACHINE_KEYS)}


def differences(stored: dict, now: dict) -> list[str]:
    keys = sorted(set(stored) | set(now))
    return [k for k in keys if stored.get(k, "<absent>") != now.get(k, "<absent>")]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("configs", nargs="*", help="config paths relative to the repository")
    group = parser.add_mutually_exclusive_group(required=True)
    group.add_argument("--write", metavar="FILE", help="store the configs' first rows in FILE")
    group.add_argument("--check", metavar="FILE", help="compare with the rows stored in FILE")
    args = parser.parse_args(argv)
    if args.write:
        if not args.configs:
            parser.error("--write needs the configs to run")
        rows = {config: first_row(config) for config in args.configs}
        Path(args.write).write_text(json.dumps(rows, indent=1, sort_keys=True) + "\n")
        print(f"wrote the first rows of {len(rows)} configs to {args.write}")
        return 0
    stored = json.loads(Path(args.check).read_text())
    configs = args.configs or sorted(stored)
    unknown = [c for c in configs if c not in stored]
    if unknown:
        parser.error(f"{args.check} has no row of {', '.join(unknown)}")
    failed = 0
    for config in configs:
        diff = differences(stored[config], first_row(config))
        failed += bool(diff)
        print(f"{config}: {'identical' if not diff else 'differs in ' + ', '.join(diff)}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
