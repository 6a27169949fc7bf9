"""Train an agent. One process:

    python scripts/train.py                                   # CartPole-v1, configs/default.yaml
    python scripts/train.py --config configs/memory_gru.yaml optim.lr=3e-4
    python scripts/train.py --resume runs/CartPole-v1-20261130-101500

Several processes (FSDP1, one replay engine per rank):

    torchrun --nproc_per_node=2 scripts/train.py --config configs/fsdp_transformer.yaml
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without install

from rl_replay.config import load_config  # noqa: E402
from rl_replay.errors import SetupError  # noqa: E402

DEFAULT_CONFIG = Path(__file__).resolve().parents[1] / "configs" / "default.yaml"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default=None, help=f"YAML config (default: {DEFAULT_CONFIG.name})")
    parser.add_argument("--resume", default=None, metavar="RUN_DIR", help="continue the run in RUN_DIR")
    parser.add_argument("overrides", nargs="*", help="section.key=value overrides, e.g. optim.lr=3e-4")
    args = parser.parse_args(argv)
    try:
        from rl_replay.trainer import build

        if args.resume:
            trainer = build(resume=args.resume, overrides=tuple(args.overrides))
        else:
            cfg = load_config(args.config or DEFAULT_CONFIG, args.overrides)
            trainer = build(cfg)
    except (SetupError, ValueError, FileNotFoundError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if trainer.info.is_main:
        print(f"run directory: {trainer.run_dir}", file=sys.stderr)
    metrics = trainer.train()
    if trainer.info.is_main and metrics:
        shown = {k: round(v, 3) for k, v in metrics.items() if k.startswith(("rollout/return", "train/loss"))}
        print(f"finished {trainer.update} updates, {trainer.env_steps} env steps: {shown}", file=sys.stderr)
    if trainer.info.distributed:
        from rl_replay.distributed import shutdown

        shutdown(trainer.info)
        # Skip interpreter finalisation: with gloo, destroying the process group's C++
        # worker state during Python's teardown aborts the process now and then
        # ("terminate called without an active exception") after all work is done.
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)
    return 0


if __name__ == "__main__":
    sys.exit(main())
