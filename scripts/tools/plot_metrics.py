"""Read a run's metrics locally: a text table, or the panels its wandb dashboard shows.

    python scripts/tools/plot_metrics.py RUN_DIR                   # a table of the rows (at most ~20) and the summaries
    python scripts/tools/plot_metrics.py RUN_DIR --every 1 --keys rollout/return_mean train/entropy
    python scripts/tools/plot_metrics.py RUN_DIR --source wandb    # the rows of the offline wandb run (what `wandb sync` uploads)
    python scripts/tools/plot_metrics.py RUN_DIR OUT.png           # the panels (x-axis env_steps); needs: pip install -e ".[bench]"

The rows come from RUN_DIR/metrics.jsonl (every logged update), or with --source wandb from
the training run's RUN_DIR/wandb/offline-run-* fragments, read without wandb's servers.
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

PANELS = (
    ("return", ("rollout/return_mean", "rollout/return_recent")),
    ("loss", ("train/loss_policy", "train/loss_value", "train/entropy")),
    ("memory (MiB)", ("memory/peak_rss_bytes", "memory/rss_bytes", "memory/replay_saved_bytes")),
    ("env steps / s", ("time/steps_per_sec",)),
)
TABLE_KEYS = (
    "update",
    "env_steps",
    "rollout/return_mean",
    "rollout/return_recent",
    "train/loss_policy",
    "train/loss_value",
    "train/entropy",
    "time/steps_per_sec",
    "memory/peak_rss_bytes",
)
TABLE_ROWS = 20


def read_rows(run_dir: Path, source: str) -> list[dict]:
    """The run's rows, one per logged update: metrics.jsonl's (null = no value) or wandb's."""
    if source == "wandb":
        sys.path.insert(0, str(Path(__file__).resolve().parent))
        from wandb_offline import training_rows  # (this folder's reader of wandb's offline files)

        return training_rows(run_dir)
    from rl_replay.errors import one_line
    from rl_replay.rundir.door import read_run_metrics

    notes: list[str] = []
    try:
        rows = read_run_metrics(run_dir, notes)  # through the door: no link followed, lines bounded
    except FileNotFoundError:
        return []  # (said as "no rows in RUN_DIR/metrics.jsonl")
    for note in notes:
        print(one_line(note), file=sys.stderr)
    return rows


def _cell(value) -> str:
    if value is None or (isinstance(value, float) and not math.isfinite(value)):
        return "-"
    if isinstance(value, int) or (isinstance(value, float) and value.is_integer() and abs(value) < 1e15):
        return str(int(value))
    return f"{value:.4g}"


def table(rows: list[dict], keys: list[str], every: int) -> str:
    """``keys`` of every ``every``-th row (and the last) as aligned text columns."""
    shown = [r for i, r in enumerate(rows, 1) if i % every == 0 or i == len(rows)]
    from rl_replay.errors import one_line

    # (keys come from the run's file: a control character there would drive the terminal)
    cells = [[one_line(k) for k in keys]] + [[one_line(_cell(r.get(k))) for k in keys] for r in shown]
    widths = [max(len(row[i]) for row in cells) for i in range(len(keys))]
    return "\n".join("  ".join(c.rjust(w) for c, w in zip(row, widths)) for row in cells)


def plot(rows: list[dict], out: str, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(PANELS), figsize=(4.2 * len(PANELS), 3.2))
    for ax, (name, keys) in zip(axes, PANELS):
        for key in keys:
            points = [(r["env_steps"], r[key]) for r in rows if r.get(key) is not None]
            if not points:
                continue
            x, y = zip(*points)
            if name.startswith("memory"):
                y = [v / 2**20 for v in y]
            ax.plot(x, y, label=key.split("/", 1)[1])
        if name.startswith("memory"):
            ax.set_yscale("log")  # RSS (hundreds of MiB) next to the replay's saved inputs (KiB)
        ax.set_title(name)
        ax.set_xlabel("env_steps")
        ax.legend(fontsize=7)
        ax.grid(alpha=0.3)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(out, dpi=110)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("run_dir")
    parser.add_argument("out", nargs="?", default=None, help="write the panels to this image instead of a table")
    parser.add_argument(
        "--source",
        choices=("metrics", "wandb"),
        default="metrics",
        help="metrics: RUN_DIR/metrics.jsonl (default); wandb: the offline wandb run's files",
    )
    parser.add_argument(
        "--keys",
        nargs="+",
        default=None,
        metavar="KEY",
        help=f"table columns (default: those of {', '.join(TABLE_KEYS)} that the run has)",
    )
    parser.add_argument(
        "--every",
        type=int,
        default=None,
        metavar="N",
        help=f"table: every N-th row and the last (default: at most {TABLE_ROWS} rows)",
    )
    args = parser.parse_args(argv)
    if args.every is not None and args.every < 1:
        parser.error(f"--every must be a positive number of rows, got {args.every}")
    if args.out is not None:
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            print(
                'error: plotting needs matplotlib: pip install -e ".[bench]" (without OUT, this script prints '
                "a table and needs nothing else)",
                file=sys.stderr,
            )
            return 2
    from rl_replay.errors import SetupError, one_line

    run_dir = Path(args.run_dir)
    try:
        rows = read_rows(run_dir, args.source)
    except (SetupError, FileNotFoundError) as exc:
        print(f"error: {one_line(str(exc))}", file=sys.stderr)
        return 2
    if not rows:
        where = run_dir / ("wandb/offline-run-*" if args.source == "wandb" else "metrics.jsonl")
        print(f"error: no rows in {one_line(str(where))}", file=sys.stderr)
        return 2
    source = "the offline wandb run" if args.source == "wandb" else "metrics.jsonl"
    if args.out is not None:
        plot(rows, args.out, f"{run_dir.name}: {source} (= the wandb rows)")
        print(args.out)
        return 0
    present = {k for r in rows for k in r}
    keys = args.keys or [k for k in TABLE_KEYS if k in present]
    unknown = [k for k in keys if k not in present]
    if unknown:
        print(
            one_line(f"error: no row of {source} has {', '.join(unknown)}; its keys: {', '.join(sorted(present))}"),
            file=sys.stderr,
        )
        return 2
    from rl_replay.run.logger import summarize

    every = args.every or max(1, math.ceil(len(rows) / TABLE_ROWS))
    print(one_line(f"{run_dir}: {len(rows)} rows from {source}"))
    print(table(rows, keys, every))
    clean = [{k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in r.items()} for r in rows]
    for key, value in summarize(clean).items():
        print(f"{key}: {_cell(value)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
