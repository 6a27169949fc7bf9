"""Convert a legacy (pickled) checkpoint you trust into the current format (``--help``)."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without install

from rl_replay.run.cli import convert_main as main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
