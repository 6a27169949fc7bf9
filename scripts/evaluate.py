"""Evaluate a checkpoint (``python scripts/evaluate.py --help``; the same as ``rl-replay-evaluate``)."""

from __future__ import annotations

import sys

from rl_replay.run.cli import evaluate_main as main

if __name__ == "__main__":
    sys.exit(main())
