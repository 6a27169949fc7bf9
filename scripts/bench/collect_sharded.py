"""Collection under FSDP: per-rank seconds of one rollout on 2 gloo ranks against one process.

The trainer of a config (default ``configs/fsdp_gtrxl_memory_1024.yaml``: 14.4M parameters, 8 envs per
rank) is built as ``scripts/train.py`` builds it, and its collector collects ``--repeats`` rollouts after
a warm-up one; each rollout's wall time is taken on every rank. Three settings, each in fresh processes:

1. ``one process``: ``python``, the same per-rank work (the config's envs and steps);
2. ``2 ranks, per step``: ``torch.distributed.run --nproc_per_node=2`` with
   ``distributed.collect_gathered=false`` (each FSDP unit gathered at every env step);
3. ``2 ranks, gathered``: ``distributed.collect_gathered=true`` (once per rollout);
4. ``FSDP2, per step`` and ``FSDP2, gathered``: the same under ``distributed.fsdp_version=2``
   (``unshard()`` once per rollout).

The settings take turns (``--rounds`` times, one launch each per round), so a drift of the machine's
speed falls on all of them. Printed: median, min and max of the seconds per rollout (over rounds,
repeats and ranks), the ratio of each median to one process's, and the median of the untimed first
rollouts (a run's first rollout pays lazy initialisation).

Usage::

    python -m scripts.bench collect_sharded                       # 400-step rollouts, 3 rounds x 2 repeats
    python -m scripts.bench collect_sharded --steps 1026 --repeats 1 --settings "2 ranks, gathered"
    python -m scripts.bench collect_sharded --steps 1026 --settings "2 ranks, gathered" "FSDP2, gathered"
    python -m scripts.bench collect_sharded --smoke               # the MLP config, 32 steps
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

from scripts.bench.common import ROOT, launch_ranks, rank_result

#: setting -> (processes, distributed.collect_gathered, distributed.fsdp_version)
SETTINGS = {
    "one process": (1, "auto", 1),
    "2 ranks, per step": (2, "false", 1),
    "2 ranks, gathered": (2, "true", 1),
    "FSDP2, per step": (2, "false", 2),
    "FSDP2, gathered": (2, "true", 2),
}


def worker(spec: dict) -> None:
    """One process (or one rank) of one launch: build the trainer, time its rollouts."""
    from scripts.bench.common import quiet_trainer

    overrides = [
        f"collector.num_steps={spec['steps']}",
        f"distributed.collect_gathered={spec['gathered']}",
        f"distributed.fsdp_version={spec['fsdp_version']}",
    ]
    if spec["mode"]:
        overrides.append(f"collector.mode={spec['mode']}")
    trainer = quiet_trainer(spec["config"], spec["run_dir"], *overrides)
    try:
        t0 = time.perf_counter()
        trainer.collector.collect()  # warm-up: lazy initialisation, first allocations
        first = time.perf_counter() - t0
        seconds = []
        for _ in range(spec["repeats"]):
            t0 = time.perf_counter()
            trainer.collector.collect()
            seconds.append(time.perf_counter() - t0)
    finally:
        trainer.close()
    rank_result(spec, {"first": first, "seconds": seconds})


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--config", default=os.path.join(ROOT, "configs", "fsdp_gtrxl_memory_1024.yaml"))
    parser.add_argument("--steps", type=int, default=400, help="steps per rollout (collector.num_steps)")
    parser.add_argument(
        "--mode", choices=["fixed", "episode"], default=None, help="collector.mode (default: the config's)"
    )
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=2, help="timed rollouts per launch, after a warm-up one")
    parser.add_argument("--timeout", type=float, default=1800)
    parser.add_argument(
        "--settings",
        nargs="+",
        choices=list(SETTINGS),
        help="which settings (one process always; default the first three, --smoke '2 ranks, gathered')",
    )
    parser.add_argument(
        "--smoke", action="store_true", help="configs/fsdp_mlp_cpu.yaml, 32 steps, 1 round, 2 ranks gathered"
    )
    args = parser.parse_args(argv)
    if args.worker:
        worker(json.loads(args.worker))
        return 0
    if args.smoke:
        args.config, args.steps, args.rounds, args.repeats = (
            os.path.join(ROOT, "configs", "fsdp_mlp_cpu.yaml"),
            32,
            1,
            1,
        )
        args.settings = args.settings or ["2 ranks, gathered"]  # one launch of 2 ranks beside one process
    from scripts.bench.common import describe_machine

    print(describe_machine())
    print(
        f"{os.path.relpath(args.config, ROOT)}, {args.steps}-step rollouts"
        f"{f', collector.mode={args.mode}' if args.mode else ''}; {args.rounds} rounds x {args.repeats} timed "
        "rollouts per launch; seconds per rollout per rank"
    )
    results = tempfile.mkdtemp(prefix="bench_collect_")
    wanted = args.settings or list(SETTINGS)[:3]
    chosen = {name: SETTINGS[name] for name in SETTINGS if name in wanted or name == "one process"}
    seconds: dict[str, list[float]] = {name: [] for name in chosen}
    firsts: dict[str, list[float]] = {name: [] for name in chosen}
    for round_ in range(args.rounds):
        for i, (name, (nproc, gathered, version)) in enumerate(chosen.items()):
            out = os.path.join(results, f"r{round_}s{i}")
            spec = dict(
                config=args.config,
                steps=args.steps,
                mode=args.mode,
                repeats=args.repeats,
                gathered=gathered,
                fsdp_version=version,
                run_dir=out + "-run",
                out=out,
            )
            rows = launch_ranks(__spec__.name, spec, nproc, args.timeout)
            if isinstance(rows, str):
                raise SystemExit(f"{name} failed: {rows}")
            seconds[name] += [s for row in rows for s in row["seconds"]]
            firsts[name] += [row["first"] for row in rows]
    base = statistics.median(seconds["one process"])
    print("| setting | median s | min s | max s | median vs one process | first rollout, median s |")
    print("|---|---:|---:|---:|---:|---:|")
    for name, xs in seconds.items():
        mid = statistics.median(xs)
        print(
            f"| {name} | {mid:.2f} | {min(xs):.2f} | {max(xs):.2f} | {mid / base:.2f}x "
            f"| {statistics.median(firsts[name]):.2f} |",
            flush=True,
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
