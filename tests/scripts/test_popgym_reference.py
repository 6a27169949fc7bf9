"""scripts/tools/popgym_reference.py: hand-written policies on popgym's envs and the MMER noise term."""

import importlib.util
import json
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[2]
spec = importlib.util.spec_from_file_location("popgym_reference", ROOT / "scripts" / "tools" / "popgym_reference.py")
ref = importlib.util.module_from_spec(spec)
spec.loader.exec_module(ref)
table_spec = importlib.util.spec_from_file_location("popgym_table", ROOT / "scripts" / "tools" / "popgym_table.py")
table_mod = importlib.util.module_from_spec(table_spec)
table_spec.loader.exec_module(table_mod)


def test_the_expected_maximum_of_normals():
    assert ref.expected_max_of_normals(0) == 0.0
    assert abs(ref.expected_max_of_normals(1)) < 0.03
    assert ref.expected_max_of_normals(2) == pytest.approx(1 / np.sqrt(np.pi), abs=0.03)


@pytest.mark.parametrize(
    ("env_steps", "length"), [(1_000, 51), (70_000, 51), (300_000, 51), (190_000, 831), (600_000, 831)]
)
def test_reports_counts_what_the_table_reads(env_steps, length):
    # one record per 51- or 831-step episode of one env; the table's MMER reads a report where
    # 100 episodes have ended, at the first record at or past each multiple of 65,536 env steps
    records = [
        {"env_steps": (i + 1) * length, "rollout/episodes": 1, "rollout/return_recent": float(i)}
        for i in range(env_steps // length)
    ]
    read = []
    ended, next_report = 0, table_mod.REPORT_EVERY
    for r in records:
        ended += 1
        if r["env_steps"] >= next_report:
            next_report = (r["env_steps"] // table_mod.REPORT_EVERY + 1) * table_mod.REPORT_EVERY
            if ended >= table_mod.WINDOW:
                read.append(r)
    assert ref.reports(records[-1]["env_steps"], length) == len(read)
    if read:  # the table's maximum is the last report's value here (returns rise)
        assert table_mod.mmer(records) == read[-1]["rollout/return_recent"]


def test_the_reference_policies_on_popgyms_envs(tmp_path):
    pytest.importorskip("popgym")
    out = tmp_path / "ref.json"
    assert ref.main(["--episodes", "40", "--env-steps", "1260000", "--json", str(out)]) == 0
    rows = {(r["env"], r["policy"]): r for r in json.loads(out.read_text())}
    assert set(rows) == {
        ("HigherLowerEasy", "memoryless"),
        ("HigherLowerEasy", "counting"),
        ("MultiarmedBanditEasy", "random"),
        ("MultiarmedBanditEasy", "explore_then_greedy"),
        ("MultiarmedBanditEasy", "thompson"),
        ("MultiarmedBanditEasy", "oracle"),
    }
    for r in rows.values():
        assert -1.0 <= r["mean"] <= 1.0 and r["std"] > 0
        assert r["mmer_if_fixed"]["1260000"] > r["mean"]  # a maximum over 19 reports
    bandit = {p: rows[("MultiarmedBanditEasy", p)]["mean"] for p in ("random", "thompson", "oracle")}
    assert bandit["random"] < 0.2 < 0.5 < bandit["thompson"] < bandit["oracle"]  # far apart at 40 episodes
    assert rows[("HigherLowerEasy", "memoryless")]["mean"] > 0.3  # the rule is right most of the time


def test_bad_arguments_are_one_line(capsys):
    with pytest.raises(SystemExit):
        ref.main(["--episodes", "1"])
    assert "--episodes must be >= 2" in capsys.readouterr().err
