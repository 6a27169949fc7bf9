"""What a run learns does not change under a refactoring: the first metrics row of shipped configs,
one update each, is the one stored in tests/data/first_rows.json value for value (the machine's
time/, memory/ and perf/ keys left out). Rewrite the file only for a change meant to alter learning:
python scripts/tools/first_rows.py CONFIGS... --write tests/data/first_rows.json"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
STORED = json.loads((ROOT / "tests" / "data" / "first_rows.json").read_text())
spec = importlib.util.spec_from_file_location("first_rows", ROOT / "scripts" / "tools" / "first_rows.py")
assert spec and spec.loader
first_rows = importlib.util.module_from_spec(spec)
spec.loader.exec_module(first_rows)

# The quick ones run here (a few seconds each); the file also holds memory_4096 and minigrid_memory_s7,
# which scripts/tools/first_rows.py --check runs.
QUICK = ("configs/default.yaml", "configs/ppo_pocartpole_gru.yaml", "configs/ppo_memory_256_gtrxl.yaml")


@pytest.mark.parametrize("config", QUICK)
def test_the_first_row_is_the_stored_one(config):
    now = first_rows.first_row(config)
    assert first_rows.differences(STORED[config], now) == [], (config, now)


def test_a_changed_value_is_named():
    stored = STORED["configs/default.yaml"]
    changed = {**stored, "train/loss_value": stored["train/loss_value"] + 1e-9}
    assert first_rows.differences(stored, changed) == ["train/loss_value"]
    assert set(STORED) >= {
        *QUICK,
        "configs/memory_256.yaml",
        "configs/memory_4096.yaml",
        "configs/minigrid_memory_s7.yaml",
    }
