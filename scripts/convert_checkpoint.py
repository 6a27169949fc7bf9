"""Convert a legacy (pickled) checkpoint you trust into the current format (``--help``)."""

from __future__ import annotations

import sys

from rl_replay.run.cli import convert_main as main

if __name__ == "__main__":
    sys.exit(main())
