"""Plot a run's metrics.jsonl as the panels its wandb dashboard shows (x-axis: env_steps).

    python scripts/plot_metrics.py RUN_DIR OUT.png      # needs: pip install -e ".[bench]"
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

PANELS = (
    ("return", ("rollout/return_mean", "rollout/return_recent")),
    ("loss", ("train/loss_policy", "train/loss_value", "train/entropy")),
    ("memory (MiB)", ("memory/peak_rss_bytes", "memory/rss_bytes", "memory/replay_saved_bytes")),
    ("env steps / s", ("time/steps_per_sec",)),
)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("run_dir")
    parser.add_argument("out")
    args = parser.parse_args(argv)
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from rl_replay.logger import read_metrics

    records = read_metrics(args.run_dir)
    if not records:
        print(f"error: no metrics in {args.run_dir}", file=sys.stderr)
        return 2
    fig, axes = plt.subplots(1, len(PANELS), figsize=(4.2 * len(PANELS), 3.2))
    for ax, (title, keys) in zip(axes, PANELS):
        for key in keys:
            points = [(r["env_steps"], r[key]) for r in records if r.get(key) is not None]
            if not points:
                continue
            x, y = zip(*points)
            if title.startswith("memory"):
                y = [v / 2**20 for v in y]
            ax.plot(x, y, label=key.split("/", 1)[1])
        if title.startswith("memory"):
            ax.set_yscale("log")  # RSS (hundreds of MiB) next to the replay's saved inputs (KiB)
        ax.set_title(title)
        ax.set_xlabel("env_steps")
        ax.legend(fontsize=7)
        ax.grid(alpha=0.3)
    fig.suptitle(f"{Path(args.run_dir).name}: metrics.jsonl (= the wandb rows)", fontsize=9)
    fig.tight_layout()
    fig.savefig(args.out, dpi=110)
    print(args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
