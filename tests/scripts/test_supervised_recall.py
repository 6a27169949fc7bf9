"""scripts/tools/supervised_recall.py: the supervised recall probe learns what it should and not what it cannot."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "tools" / "supervised_recall.py"


def accuracy(*args: str) -> float:
    proc = subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return float(re.findall(r"accuracy ([\d.]+)", proc.stdout)[-1])


def test_a_window_that_reaches_the_cue_learns_it_and_one_that_does_not_stays_at_chance():
    agent = "{d_model: 16, num_layers: 1, num_heads: 2, encoder_sizes: [16], window: %d}"
    assert accuracy("--delay", "6", "--steps", "101", "gtrxl", agent % 8) == 1.0
    # the cue is 7 steps before the query; a window of 6 (one layer) cannot see it
    assert accuracy("--delay", "6", "--steps", "101", "--batch", "256", "gtrxl", agent % 6) < 0.65
