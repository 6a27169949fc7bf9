"""RSS of one long training run: does the resident memory level off or keep growing?

Builds the trainer from a config (``configs/default.yaml`` unless ``--config``) exactly as
``scripts/train.py`` does (metrics.jsonl, checkpoints every ``checkpoint.every`` updates,
wandb in the config's mode) in a temporary run directory, sets ``total_env_steps`` so that
the run takes ``--updates`` updates, and every ``--every`` updates records the process's
``VmRSS``, glibc's bytes in use (``mallinfo2``) and the number of objects Python's garbage
collector tracks. The progress bar is off (its output is not measured here).

The slope is a least-squares fit of RSS against the update number over the second half of
the run (the first half holds the allocator's and the caches' warm-up), in KiB per update;
the same for the heap in use and the tracked objects (a steady growth of objects per update
points at a Python container that is appended to every update).

Usage::

    OMP_NUM_THREADS=1 python -m scripts.bench soak                       # 20,000 updates
    python -m scripts.bench soak --updates 200 --every 20                 # a quick look
    python -m scripts.bench soak --updates 40000 --json soak.json log.wandb_mode=disabled
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import shutil
import sys
import tempfile
import time
from dataclasses import replace

from scripts.bench.common import ROOT, current_rss


def fit_slope(xs: list[float], ys: list[float]) -> float:
    """Least-squares slope of ``ys`` against ``xs`` (nan for fewer than two points)."""
    n = len(xs)
    if n < 2:
        return float("nan")
    mx, my = sum(xs) / n, sum(ys) / n
    sxx = sum((x - mx) ** 2 for x in xs)
    return sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sxx if sxx else float("nan")


def second_half_slopes(samples: list[dict], updates: int) -> dict[str, float]:
    """KiB (and objects) per update over the samples of the run's second half."""
    late = [s for s in samples if s["update"] >= updates / 2]
    xs = [s["update"] for s in late]
    out = {
        "rss_kib_per_update": fit_slope(xs, [s["rss_kib"] for s in late]),
        "objects_per_update": fit_slope(xs, [s["gc_objects"] for s in late]),
    }
    if all(s["heap_kib"] is not None for s in late):
        out["heap_kib_per_update"] = fit_slope(xs, [s["heap_kib"] for s in late])
    return out


def soak(config: str, overrides: list[str], updates: int, every: int, run_dir: str) -> list[dict]:
    """Train ``updates`` updates of ``config`` into ``run_dir``; the RSS samples."""
    from rl_replay.config import batch_size_per_rank, load_config
    from rl_replay.run.memory_stats import heap_in_use
    from rl_replay.run.setup import build

    cfg = load_config(config, overrides)
    cfg = replace(
        cfg, total_env_steps=updates * batch_size_per_rank(cfg), run_dir=run_dir, log=replace(cfg.log, progress=False)
    )
    trainer = build(cfg)
    samples: list[dict] = []
    t0 = time.perf_counter()
    inner = trainer.step

    def sample() -> None:
        heap = heap_in_use()
        samples.append(
            {
                "update": trainer.update,
                "seconds": round(time.perf_counter() - t0, 2),
                "rss_kib": current_rss() // 1024,
                "heap_kib": None if heap is None else heap // 1024,
                "gc_objects": len(gc.get_objects()),
            }
        )

    def step():
        # The trainer's own step, sampled after every ``every``-th update (and the first).
        metrics = inner()
        if trainer.update == 1 or trainer.update % every == 0:
            sample()
        return metrics

    trainer.step = step
    trainer.train()
    return samples


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", default=os.path.join(ROOT, "configs", "default.yaml"))
    ap.add_argument("--updates", type=int, default=20000, help="updates to train (default 20000)")
    ap.add_argument("--every", type=int, default=250, help="record RSS every N updates (default 250)")
    ap.add_argument("--json", help="write the samples and slopes here")
    ap.add_argument("--keep-run", metavar="DIR", help="train into DIR (must not exist) and keep it")
    ap.add_argument("overrides", nargs="*", help="section.key=value config overrides")
    args = ap.parse_args(argv)
    if args.updates < 2 or args.every < 1:
        ap.error("--updates must be >= 2 and --every >= 1")
    tmp = None
    if args.keep_run:
        run_dir = args.keep_run
    else:
        tmp = tempfile.mkdtemp(prefix="bench_soak-")
        run_dir = os.path.join(tmp, "run")
    try:
        samples = soak(args.config, args.overrides, args.updates, args.every, run_dir)
    finally:
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)
    slopes = second_half_slopes(samples, args.updates)
    print("| update | seconds | RSS (MiB) | heap in use (MiB) | gc-tracked objects |")
    print("|---:|---:|---:|---:|---:|")
    shown = max(1, len(samples) // 10)
    for i, s in enumerate(samples):
        if i % shown == 0 or i == len(samples) - 1:
            heap = "n/a" if s["heap_kib"] is None else f"{s['heap_kib'] / 1024:.1f}"
            print(f"| {s['update']} | {s['seconds']:.0f} | {s['rss_kib'] / 1024:.1f} | {heap} | {s['gc_objects']} |")
    first, last = samples[0], samples[-1]
    heap = slopes.get("heap_kib_per_update")
    print(
        f"\nRSS {first['rss_kib'] / 1024:.1f} MiB at update {first['update']} -> "
        f"{last['rss_kib'] / 1024:.1f} MiB at update {last['update']} "
        f"({last['seconds'] / max(last['update'], 1) * 100:.2f} s per 100 updates); second half: "
        f"RSS {slopes['rss_kib_per_update']:+.3f} KiB/update, "
        f"heap in use {'n/a' if heap is None else f'{heap:+.3f}'} KiB/update, "
        f"{slopes['objects_per_update']:+.3f} gc-tracked objects/update"
    )
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(
                {
                    "config": args.config,
                    "overrides": args.overrides,
                    "updates": args.updates,
                    "every": args.every,
                    "samples": samples,
                    "second_half": slopes,
                },
                fh,
                indent=1,
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
