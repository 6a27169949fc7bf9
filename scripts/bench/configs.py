"""Env steps per second of shipped configs, trained as a user runs them (``scripts/train.py``).

Each config trains ``--updates`` updates in a fresh process (``checkpoint.every=0``, no
evaluation, wandb disabled; everything else as shipped, ``torch_threads`` included). The
first update is a warm-up; the table gives, over the others, env steps per second of the
whole update (collection and optimisation), the median seconds of collection and of
optimisation per update. ``--checkout DIR`` runs another checkout's ``scripts/train.py``
on its own configs (``PYTHONPATH=DIR``), so a before/after pair is measured in one sitting::

    git worktree add /tmp/before <commit>
    python -m scripts.bench configs --checkout /tmp/before --configs memory_4096 --updates 2
    python -m scripts.bench configs --configs memory_4096 --updates 2
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def batch_size(config: Path, overrides: list[str]) -> int:
    """Env steps per update of ``config`` (num_envs x num_steps), read with this checkout's loader."""
    from rl_replay.config import load_config

    cfg = load_config(config, overrides)
    return cfg.env.num_envs * cfg.collector.num_steps


def run(checkout: Path, config: str, updates: int, overrides: list[str], timeout: float) -> dict:
    path = checkout / "configs" / f"{config}.yaml"
    steps = updates * batch_size(path, overrides)
    with tempfile.TemporaryDirectory() as tmp:
        cmd = [
            sys.executable,
            str(checkout / "scripts" / "train.py"),
            "--config",
            str(path),
            f"total_env_steps={steps}",
            "checkpoint.every=0",
            "eval.every=0",
            "log.progress=false",
            "log.wandb_mode=disabled",
            f"run_dir={tmp}/run",
            *overrides,
        ]
        env = dict(os.environ, PYTHONPATH=str(checkout), WANDB_MODE="disabled", WANDB_SILENT="true")
        start = time.perf_counter()
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
        wall = time.perf_counter() - start
        if proc.returncode:
            return {"config": config, "error": proc.stderr.strip().splitlines()[-1:]}
        rows = [json.loads(line) for line in Path(tmp, "run", "metrics.jsonl").read_text().splitlines()]
    timed = rows[1:] or rows
    env_steps = rows[-1]["env_steps"] - (rows[0]["env_steps"] if len(rows) > 1 else 0)
    seconds = sum(r["time/update_sec"] for r in timed)
    return {
        "config": config,
        "updates": len(rows),
        "env_steps_per_sec": env_steps / seconds,
        "collect_sec": statistics.median(r["time/collect_sec"] for r in timed),
        "optimize_sec": statistics.median(r["time/optimize_sec"] for r in timed),
        "process_sec": wall,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--checkout", type=Path, default=ROOT, help="the checkout whose train.py and configs run")
    parser.add_argument("--configs", nargs="+", default=["default"], help="config names (configs/NAME.yaml)")
    parser.add_argument("--updates", type=int, default=3, help="updates per config; the first is a warm-up")
    parser.add_argument("--set", nargs="*", default=[], help="config overrides for every run")
    parser.add_argument("--timeout", type=float, default=1800)
    parser.add_argument("--json", type=Path, help="also write the rows here")
    args = parser.parse_args()
    results = []
    print(f"checkout {args.checkout}; {args.updates} updates each (the first a warm-up)")
    print("| config | env steps/s | collect s | optimize s | process s |")
    print("|---|---|---|---|---|")
    for config in args.configs:
        r = run(args.checkout.resolve(), config, args.updates, args.set, args.timeout)
        results.append(r)
        if "error" in r:
            print(f"| {config} | error: {r['error']} | | | |", flush=True)
            continue
        print(
            f"| {config} | {r['env_steps_per_sec']:.0f} | {r['collect_sec']:.3g} | {r['optimize_sec']:.3g} "
            f"| {r['process_sec']:.0f} |",
            flush=True,
        )
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))
    return 1 if any("error" in r for r in results) else 0


if __name__ == "__main__":
    sys.exit(main())
