"""Env steps at which a run's rolling return first reaches a threshold, from metrics.jsonl.

    python scripts/learning_curve.py runs/ppo_cartpole_s1 runs/ppo_cartpole_s2 --threshold 475

For each run directory (or metrics.jsonl path) prints the first ``env_steps`` whose
``rollout/return_recent`` (the trainer's mean of the last 100 episodes) is >= threshold,
the wall time and env steps/s up to that point (summed ``time/update_sec``), the best
rolling return and the final one; then the median over the runs of the steps to threshold
(a run that never reaches it counts as infinity).
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
from pathlib import Path


def read_metrics(path: Path) -> list[dict]:
    path = path / "metrics.jsonl" if path.is_dir() else path
    if not path.is_file():
        raise SystemExit(f"error: no metrics.jsonl at {path}")
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def first_reach(lines: list[dict], key: str, threshold: float) -> dict:
    """{steps, seconds, sps, best, final} for one run; steps is inf when never reached."""
    seconds, best, final = 0.0, -math.inf, math.nan
    for m in lines:
        seconds += m.get("time/update_sec", 0.0)
        value = m.get(key)
        if value is None or math.isnan(value):
            continue
        best, final = max(best, value), value
        if value >= threshold:
            return {"steps": m["env_steps"], "seconds": seconds, "sps": m["env_steps"] / seconds,
                    "best": best, "final": lines[-1].get(key, math.nan)}
    steps = lines[-1]["env_steps"] if lines else 0
    return {"steps": math.inf, "seconds": seconds, "sps": steps / seconds if seconds else math.nan,
            "best": best, "final": final}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("runs", nargs="+", type=Path, help="run directories or metrics.jsonl files")
    parser.add_argument("--threshold", type=float, required=True)
    parser.add_argument("--key", default="rollout/return_recent")
    args = parser.parse_args(argv)
    reached = []
    for run in args.runs:
        r = first_reach(read_metrics(run), args.key, args.threshold)
        reached.append(r["steps"])
        where = "never" if math.isinf(r["steps"]) else f"{r['steps']:.0f} env steps"
        print(f"{run}: {args.key} >= {args.threshold:g} at {where}; {r['seconds']:.0f} s, "
              f"{r['sps']:.0f} env steps/s; best {r['best']:.3f}, final {r['final']:.3f}")
    print(f"median env steps to {args.threshold:g} over {len(reached)} runs: {statistics.median(reached):.0f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
