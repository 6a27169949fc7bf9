"""Train an agent (``python scripts/train.py --help``; the same as ``rl-replay-train``)."""

from __future__ import annotations

import sys

from rl_replay.run.cli import train_main as main

if __name__ == "__main__":
    sys.exit(main())
