"""Checkpoint size and save / load time of a trained run's state; with ``--sharded``, one checkpoint
written under FSDP on 2 gloo ranks: every rank its shard, or rank 0 the whole state.

    python -m scripts.bench checkpoint --config configs/memory_4096.yaml --repeats 5
    python -m scripts.bench checkpoint --config configs/default.yaml --repeats 20
    python -m scripts.bench checkpoint --sharded [--fsdp-version 2]   # fsdp_gtrxl_memory_1024.yaml
    python -m scripts.bench checkpoint --sharded --smoke                # the MLP config

One process: builds the config's trainer, trains it for ``--updates`` updates so that the optimizer
and collector hold real state, then writes the checkpoint ``--repeats`` times (``save_trainer``:
gather, serialize, fsync, verify, rename) and reads it back as many times (``read_trainer_state`` +
``load_trainer``: what ``--resume`` does before training). Prints one JSON line: the files the
checkpoint consists of with their sizes, and the median / min / max seconds of each. Uses only the
functions both checkpoint formats share, so the same script measures a checkout before and after a
format change.

``--sharded``: the trainer (default ``configs/fsdp_gtrxl_memory_1024.yaml``: 14.4M parameters) built
on 2 ranks, its optimizer given its moments by one Adam step on zero gradients, writes one checkpoint
with ``checkpoint.sharded=true`` (each rank its rows, at once) or ``false`` (rank 0 gathers the whole
state and writes ``checkpoint.pt`` alone), each setting in fresh processes. Printed per rank: seconds
of the write, growth of the process's peak RSS during it, and the bytes of the files it wrote.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

from scripts.bench.common import ROOT, launch_ranks, rank_result


def sharded_worker(spec: dict) -> None:
    """One rank of ``--sharded``: write one checkpoint, report seconds, peak RSS growth and bytes."""
    import torch
    import torch.distributed as dist

    from rl_replay.run.trainer_state import save_trainer
    from scripts.bench.common import MemoryMeter, quiet_trainer

    rank = int(os.environ.get("RANK", "0"))
    overrides = [f"checkpoint.sharded={spec['sharded']}", f"distributed.fsdp_version={spec['fsdp_version']}"]
    trainer = quiet_trainer(spec["config"], spec["run_dir"], *overrides)
    try:
        for p in trainer.model.parameters():
            p.grad = torch.zeros_like(p)
        trainer.optimizer.step()  # the state a checkpoint of a trained run holds
        trainer.optimizer.zero_grad(set_to_none=True)
        dist.barrier()
        meter = MemoryMeter(torch.device("cpu"))
        meter.start()
        t0 = time.perf_counter()
        save_trainer(trainer.algorithm, trainer.progress, trainer.place)
        seconds = time.perf_counter() - t0
        growth = meter.peak_rss_growth()
    finally:
        trainer.close()
    mine = f"checkpoint.shard-{rank}-of-2.pt" if spec["sharded"] == "true" else None
    written = sum(
        os.path.getsize(os.path.join(spec["run_dir"], name))
        for name in os.listdir(spec["run_dir"])
        if name == mine or (rank == 0 and name in ("checkpoint.pt", "env_state.pkl"))
    )
    rank_result(spec, {"seconds": seconds, "peak_growth": growth, "bytes": written})


def sharded(config: str, fsdp_version: int) -> int:
    print(f"config: {os.path.relpath(config, ROOT)}, 2 gloo ranks, FSDP{fsdp_version}, one write per setting")
    print("| checkpoint.sharded | rank | seconds | peak RSS growth | bytes written by the rank |")
    print("|---|---:|---:|---:|---:|")
    with tempfile.TemporaryDirectory() as tmp:
        for setting in ("true", "false"):
            spec = {"config": config, "sharded": setting, "fsdp_version": fsdp_version}
            spec.update(run_dir=os.path.join(tmp, f"{setting}-run"), out=os.path.join(tmp, setting))
            rows = launch_ranks(__spec__.name, spec, 2, timeout=1800)
            if isinstance(rows, str):
                sys.exit(f"checkpoint.sharded={setting} failed: {rows}")
            for rank, row in enumerate(rows):
                growth = row["peak_growth"] / 2**20
                print(f"| {setting} | {rank} | {row['seconds']:.2f} s | {growth:.1f} MiB | {row['bytes']:,} |")
            print(
                f"summary sharded={setting}: slowest rank {max(r['seconds'] for r in rows):.2f} s, "
                f"largest peak RSS growth {max(r['peak_growth'] for r in rows) / 2**20:.1f} MiB"
            )
    return 0


def one_process(args: argparse.Namespace) -> int:
    import torch

    from rl_replay.run.trainer_state import load_trainer, read_trainer_state, save_trainer
    from rl_replay.rundir.door import RunDirectory
    from rl_replay.rundir.env_state_file import run_binding
    from scripts.bench.common import quiet_trainer

    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        run_dir = Path(tmp) / "run"
        trainer = quiet_trainer(args.config, str(run_dir), *args.overrides, "eval.every=0", "log.horizon_every=0")
        try:
            for _ in range(args.updates):
                trainer.step()
            saves, loads = [], []
            for _ in range(args.repeats):
                start = time.perf_counter()
                save_trainer(trainer.algorithm, trainer.progress, trainer.place)
                saves.append(time.perf_counter() - start)
            skip = ("config.yaml", "metrics.jsonl")
            files = {
                p.name: p.stat().st_size
                for p in sorted(run_dir.iterdir())
                if p.is_file() and not p.name.startswith(".") and "prev" not in p.name and p.name not in skip
            }
            for _ in range(args.repeats):
                start = time.perf_counter()
                with RunDirectory.open(run_dir) as run:
                    state, _, _ = read_trainer_state(run, trainer.info, run_binding(run.dir))
                load_trainer(trainer.algorithm, state, trainer.place)
                loads.append(time.perf_counter() - start)
        finally:
            trainer.close()
            trainer.collector.envs.close()

    def summary(xs):
        return {"median_s": round(statistics.median(xs), 4), "min_s": round(min(xs), 4), "max_s": round(max(xs), 4)}

    total = sum(files.values())
    result = {"config": args.config, "files": files, "total_bytes": total, "repeats": args.repeats}
    print(json.dumps({**result, "save": summary(saves), "load": summary(loads)}))
    return 0


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--config", default=None, help="default: configs/default.yaml (--sharded: the 14.4M agent)")
    parser.add_argument("--updates", type=int, default=1, help="updates trained before measuring")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--sharded", action="store_true", help="2 FSDP ranks: sharded against gathered writes")
    parser.add_argument("--fsdp-version", type=int, default=1, choices=[1, 2], help="with --sharded")
    parser.add_argument("--smoke", action="store_true", help="with --sharded: the MLP config")
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args(argv)
    if args.worker:
        sharded_worker(json.loads(args.worker))
        return 0
    if args.sharded:
        name = "fsdp_mlp_cpu.yaml" if args.smoke else "fsdp_gtrxl_memory_1024.yaml"
        return sharded(args.config or os.path.join(ROOT, "configs", name), args.fsdp_version)
    args.config = args.config or "configs/default.yaml"
    return one_process(args)


if __name__ == "__main__":
    sys.exit(main())
