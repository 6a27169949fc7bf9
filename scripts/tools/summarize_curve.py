"""Summarise learning curves from ``metrics.jsonl`` files (the trainer's or compare_peers.py's).

For each run directory (or metrics file) prints: env steps at which the mean of
``--key`` over the last ``--window`` records first reached ``--threshold``, the update
time to that record, that windowed mean at the end, the median env steps/s and the peak RSS.

The update time is each record's env steps over its ``time/steps_per_sec``, summed: the
trainer's rows and compare_peers.py's rows both give their iteration's rate, so the two
are read on one clock (process start-up and the trainer's evaluation episodes left out).

    python scripts/tools/summarize_curve.py runs/probe_lru128 runs/peer_memory128
    python scripts/tools/summarize_curve.py RUN1 RUN2 RUN3 --key rollout/return_recent --threshold 475 --window 1

``rollout/return_recent`` is already the trainer's mean of the last 100 episodes, hence
``--window 1`` for returns. With several runs it also prints the median of the env steps to
the threshold (a run that never reaches it counts as infinity). ``--plot OUT.png`` draws the
windowed curves of all runs on one axis, with the threshold (needs ``pip install -e ".[bench]"``).
``--rliable`` adds rliable's IQM over the runs with a 95 % bootstrap interval, of the final value and
of the env steps to the threshold (the ``[rliable]`` extra).
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
from pathlib import Path


def load(path: str | Path) -> list[dict]:
    """The records of a run directory's ``metrics.jsonl`` (or of that file itself), read as a run
    from someone else is (no link followed, lines bounded); a cut last line is skipped with a note."""
    from rl_replay.errors import SetupError, one_line
    from rl_replay.rundir.door import read_run_metrics

    notes: list[str] = []
    try:
        records = read_run_metrics(path, notes)
    except (SetupError, FileNotFoundError) as exc:
        raise SystemExit(f"summarize_curve: {one_line(str(exc))}") from None
    for note in notes:
        print(one_line(note), file=sys.stderr)
    return records


def summarize(
    records: list[dict], key: str = "rollout/success_rate", threshold: float = 0.95, window: int = 10
) -> dict:
    """``steps_to_threshold`` and ``seconds_to_threshold`` (None if never), ``final`` windowed
    mean, ``env_steps``, ``steps_per_sec`` (median) and ``peak_rss_mib``."""
    values, reached, final = [], None, None
    seconds, reached_seconds, last_steps = 0.0, None, 0
    for r in records:
        if r.get("time/steps_per_sec"):  # this record's env steps at its own rate
            seconds += (r["env_steps"] - last_steps) / r["time/steps_per_sec"]
            last_steps = r["env_steps"]
        if r.get(key) is None:  # absent, or null (no episode ended in that update)
            continue
        values.append(r[key])
        if len(values) >= window:
            final = sum(values[-window:]) / window
            if reached is None and final >= threshold:
                reached, reached_seconds = r["env_steps"], seconds
    sps = [r["time/steps_per_sec"] for r in records if "time/steps_per_sec" in r]
    rss = [r["memory/peak_rss_bytes"] for r in records if "memory/peak_rss_bytes" in r]
    return {
        "steps_to_threshold": reached,
        "seconds_to_threshold": reached_seconds if last_steps else None,  # None: no record had a rate
        "final": final,
        "env_steps": records[-1]["env_steps"] if records else 0,
        "steps_per_sec": statistics.median(sps) if sps else None,
        "peak_rss_mib": max(rss) / 2**20 if rss else None,
    }


def rliable_summary(finals: list[float], steps: list[float], reps: int = 20_000) -> list[str]:
    """rliable's IQM over runs (seeds) with its 95 % bootstrap interval: of the final windowed
    value, and of the env steps to the threshold when every run reached it."""
    import warnings

    import numpy as np
    from rliable import library, metrics

    def interval(values: list[float]) -> tuple[float, float, float]:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*random_state is deprecated.*", category=FutureWarning)
            point, cis = library.get_interval_estimates(
                {"x": np.asarray(values, dtype=np.float64)[:, None]},  # runs x 1 task
                lambda scores: np.array([metrics.aggregate_iqm(scores)]),
                reps=reps,
                random_state=np.random.RandomState(0),
            )
        return float(point["x"][0]), float(cis["x"][0, 0]), float(cis["x"][1, 0])

    lines = []
    if finals:
        iqm, lo, hi = interval(finals)
        lines.append(f"rliable over {len(finals)} runs: final IQM {iqm:.3f} (95 % CI {lo:.3f} to {hi:.3f})")
    if steps and all(math.isfinite(x) for x in steps):
        iqm, lo, hi = interval(steps)
        lines.append(
            f"rliable over {len(steps)} runs: env steps to threshold IQM {iqm:,.0f} (95 % CI {lo:,.0f} to {hi:,.0f})"
        )
    elif steps:
        lines.append(
            f"rliable: no interval of env steps to threshold ({sum(not math.isfinite(x) for x in steps)} runs never reached it)"
        )
    return lines


def windowed_curve(records: list[dict], key: str, window: int) -> tuple[list[int], list[float]]:
    """(env_steps, mean of ``key`` over the last ``window`` non-null records) per record."""
    xs, ys, values = [], [], []
    for r in records:
        if r.get(key) is None:
            continue
        values.append(r[key])
        if len(values) >= window:
            xs.append(r["env_steps"])
            ys.append(sum(values[-window:]) / window)
    return xs, ys


def plot(
    runs: list[str], out: str, key: str, threshold: float | None, window: int, title: str | None, log_y: bool = False
) -> None:
    """One PNG: each run's windowed ``key`` against env steps, and the threshold line (none if
    ``threshold`` is None)."""
    try:
        import matplotlib
    except ImportError:
        raise SystemExit('summarize_curve: --plot needs matplotlib: pip install -e ".[bench]"') from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for run in runs:
        xs, ys = windowed_curve(load(run), key, window)
        ax.plot(xs, ys, label=Path(run).name, linewidth=1.2)
    if threshold is not None:
        ax.axhline(threshold, color="grey", linestyle="--", linewidth=0.8, label=f"threshold {threshold:g}")
    if log_y:
        ax.set_yscale("log")  # e.g. horizon/grad_first_obs, which spans orders of magnitude
    ax.set_xlabel("env steps")
    ax.set_ylabel(key if window == 1 else f"{key} (mean of {window})")
    if title:
        ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)
    print(f"wrote {out}")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("runs", nargs="+", help="run directories or metrics.jsonl files")
    parser.add_argument("--key", default="rollout/success_rate")
    parser.add_argument("--threshold", type=float, default=0.95)
    parser.add_argument("--window", type=int, default=10, help="records averaged (default 10)")
    parser.add_argument("--plot", metavar="OUT.png", help="also draw the curves into this PNG")
    parser.add_argument("--title", help="title of the --plot figure")
    parser.add_argument("--log-y", action="store_true", help="logarithmic y axis in the --plot figure")
    parser.add_argument(
        "--rliable",
        action="store_true",
        help="also rliable's IQM over the runs (seeds) with a 95 %% bootstrap interval, of the final value and of "
        "the env steps to the threshold (needs the rliable extra: pip install -e '.[rliable]')",
    )
    parser.add_argument(
        "--no-threshold-line",
        action="store_true",
        help="leave the threshold out of the --plot figure (a metric with no target, e.g. horizon/grad_first_obs)",
    )
    args = parser.parse_args(argv)
    from rl_replay.errors import one_line

    if args.window < 1:
        parser.error("--window must be >= 1")
    if args.rliable:
        try:
            import rliable.library  # noqa: F401
        except ImportError:
            parser.error("--rliable needs rliable: pip install -e '.[rliable]'")
    print(
        f"| run | env steps to {args.key} >= {args.threshold} (mean of {args.window}) | update time to it | "
        "final | env steps run | env steps/s | peak RSS MiB |"
    )
    print("|---|---|---|---|---|---|---|")
    reached, finals = [], []
    for run in args.runs:
        s = summarize(load(run), args.key, args.threshold, args.window)
        reached.append(s["steps_to_threshold"] or math.inf)
        if s["final"] is not None:
            finals.append(s["final"])
        fmt = lambda x, f: "n/a" if x is None else format(x, f)  # noqa: E731
        print(
            f"| {one_line(run)} | {fmt(s['steps_to_threshold'], ',') if s['steps_to_threshold'] else 'not reached'} | "
            f"{'n/a' if s['seconds_to_threshold'] is None else format(s['seconds_to_threshold'] / 60, '.1f') + ' min'} | "
            f"{fmt(s['final'], '.3f')} | {s['env_steps']:,} | {fmt(s['steps_per_sec'], '.0f')} | "
            f"{fmt(s['peak_rss_mib'], '.0f')} |"
        )
    if len(reached) > 1:  # a run that never reaches the threshold counts as infinity
        print(f"median env steps to threshold over {len(reached)} runs: {statistics.median(reached):,}")
    if args.rliable:
        for line in rliable_summary(finals, reached):
            print(line)
    if args.plot:
        plot(
            args.runs,
            args.plot,
            args.key,
            None if args.no_threshold_line else args.threshold,
            args.window,
            args.title,
            args.log_y,
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
