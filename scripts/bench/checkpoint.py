"""Checkpoint size and save / load time of a trained run's state.

    python -m scripts.bench checkpoint --config configs/memory_4096.yaml --repeats 5
    python -m scripts.bench checkpoint --config configs/default.yaml --repeats 20

Builds the config's trainer (one process), trains it for ``--updates`` updates so that the
optimizer and collector hold real state, then writes the checkpoint ``--repeats`` times
(``save_trainer``: gather, serialize, fsync, verify, rename) and reads it back as many times
(``read_trainer_state`` + ``load_trainer``: what ``--resume`` does before training). Prints
one JSON line: the files the checkpoint consists of with their sizes, and the median / min /
max seconds of each. Uses only the functions both checkpoint formats share, so the same
script measures a checkout before and after a format change.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default="configs/default.yaml")
    parser.add_argument("--updates", type=int, default=1, help="updates trained before measuring")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args()

    import torch

    from rl_replay.config import load_config
    from rl_replay.run.setup import build
    from rl_replay.run.trainer_state import load_trainer, read_trainer_state, save_trainer
    from rl_replay.rundir.door import RunDirectory
    from rl_replay.rundir.env_state_file import run_binding

    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        run_dir = Path(tmp) / "run"
        cfg = load_config(
            args.config,
            [
                *args.overrides,
                f"run_dir={run_dir}",
                "log.progress=false",
                "log.wandb_mode=disabled",
                "checkpoint.every=0",
                "eval.every=0",
                "log.horizon_every=0",
            ],
        )
        trainer = build(cfg)
        try:
            for _ in range(args.updates):
                trainer.step()
            saves, loads = [], []
            for _ in range(args.repeats):
                start = time.perf_counter()
                save_trainer(trainer.algorithm, trainer.progress, trainer.place)
                saves.append(time.perf_counter() - start)
            files = {
                p.name: p.stat().st_size
                for p in sorted(run_dir.iterdir())
                if p.is_file()
                and not p.name.startswith(".")
                and "prev" not in p.name
                and p.name not in ("config.yaml", "metrics.jsonl")
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

    print(
        json.dumps(
            {
                "config": args.config,
                "files": files,
                "total_bytes": sum(files.values()),
                "save": summary(saves),
                "load": summary(loads),
                "repeats": args.repeats,
            }
        )
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
