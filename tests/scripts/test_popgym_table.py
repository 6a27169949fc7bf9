"""scripts/tools/popgym_table.py: MMER read the paper's way from metrics.jsonl, rliable's IQM and its
stratified-bootstrap interval and performance profile, and the whole table from real runs of the
shipped POPGym configs."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from rl_replay.config import load_config

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "tools" / "popgym_table.py"
spec = importlib.util.spec_from_file_location("popgym_table", SCRIPT)
assert spec and spec.loader
table_mod = importlib.util.module_from_spec(spec)
spec.loader.exec_module(table_mod)


def run_main(capsys, *argv: str) -> tuple[int, str]:
    """The tool's ``main`` in this process (its refusals come before anything heavy): exit code, stderr."""
    try:
        code = table_mod.main(list(argv))
    except SystemExit as exc:  # argparse's error (exit 2), or sys.exit(message): the message, exit 1
        if isinstance(exc.code, str):
            print(exc.code, file=sys.stderr)
        code = 1 if isinstance(exc.code, str) else exc.code
    return code, capsys.readouterr().err


TABLE_CONFIGS = sorted(p for p in (ROOT / "configs" / "popgym").glob("*.yaml") if p.name != "base.yaml")


def rows(*pairs):
    return [{"env_steps": 100 * i, "rollout/episodes": e, "rollout/return_recent": r} for i, (e, r) in enumerate(pairs)]


def test_mmer_is_the_best_mean_of_100_episodes_counted_once_100_have_ended():
    # 60 episodes at 0.9 (a lucky start) do not count; from 100 on the best mean does
    every = {"report_every": 0}  # every record is a report
    assert table_mod.mmer(rows((60, 0.9), (30, 0.2), (20, 0.5), (50, 0.4), (50, None)), **every) == 0.5
    assert table_mod.mmer(rows((60, 0.9), (30, 0.2)), **every) is None  # never 100 episodes
    assert table_mod.mmer([], **every) is None


def test_mmer_reads_the_mean_once_per_report_interval_as_rllib_reports_it():
    # a record every 100 env steps, a report every 250: read at the first record at or past 250,
    # 500 and 750, i.e. at 300, 500 and 800; the 0.95 at 400 falls between reports
    runs = rows((100, 0.1), (10, 0.2), (10, 0.3), (10, 0.4), (10, 0.95), (10, 0.5), (10, 0.6), (10, 0.55), (10, 0.7))
    assert [r["env_steps"] for r in runs] == [0, 100, 200, 300, 400, 500, 600, 700, 800]
    assert table_mod.mmer(runs, report_every=250) == 0.7
    assert table_mod.mmer(runs[:8], report_every=250) == 0.5  # 700 is short of 750: reports at 300, 500
    assert table_mod.mmer(runs, report_every=0) == 0.95
    assert table_mod.REPORT_EVERY == 65_536  # the paper's train batch, the default
    # a record past several multiples (a long update) is one report; the next is the multiple after it
    jumpy = [
        {"env_steps": s, "rollout/episodes": 100, "rollout/return_recent": v}
        for s, v in [(0, 0.0), (900, 0.3), (950, 0.9), (1000, 0.4)]
    ]
    assert table_mod.mmer(jumpy, report_every=250) == 0.4  # reads 900 and 1000, not 0 (< 250) or 950


def test_the_aggregate_is_rliables_and_reproduces_the_shipped_table():
    """docs/popgym_table.json's runs give the IQM and interval the docs print (0.692, 0.663-0.720)."""
    pytest.importorskip("rliable.library", reason="needs the rliable extra: pip install -e '.[rliable]'")
    shipped = json.loads((ROOT / "docs" / "popgym_table.json").read_text())
    agg = table_mod.aggregate(shipped["envs"])
    assert (round(agg["iqm"], 3), [round(x, 3) for x in agg["ci95"]]) == (0.692, [0.663, 0.72])
    assert agg["iqm"] == pytest.approx(shipped["aggregate"]["iqm"])
    assert agg["ci95"] == pytest.approx(shipped["aggregate"]["ci95"], abs=1e-3)
    assert (round(agg["paper_gru_iqm"], 3), round(agg["paper_best_iqm"], 3)) == (0.337, 0.623)


def test_the_iqm_is_rliables():
    metrics = pytest.importorskip("rliable.metrics", reason="needs the rliable extra: pip install -e '.[rliable]'")
    rng = np.random.default_rng(0)
    for _ in range(500):
        m = rng.normal(size=(int(rng.integers(1, 6)), int(rng.integers(1, 10))))
        m = np.round(m, 1) if rng.random() < 0.3 else m  # ties
        assert table_mod.iqm(m) == metrics.aggregate_iqm(m)  # bit for bit


def test_the_bootstrap_resamples_runs_within_each_env():
    pytest.importorskip("rliable.library", reason="needs the rliable extra: pip install -e '.[rliable]'")
    # each env's runs all equal: every resample holds three runs of each env, so its IQM is always
    # 0.25 (a bootstrap over the pooled runs would draw e.g. five 0.5s and spread the interval)
    same = table_mod.score_matrix([np.array([0.5, 0.5, 0.5]), np.array([0.0, 0.0, 0.0])])
    assert table_mod.iqm_interval(same, reps=2000) == (0.25, (0.25, 0.25))
    varied = table_mod.score_matrix([np.array([0.1, 0.5, 0.9]), np.array([-0.2, 0.0, 0.3])])
    point, (lo, hi) = table_mod.iqm_interval(varied, reps=4000)
    assert lo < point < hi
    # seeded whatever numpy's global generator holds (rliable resamples from it), which is put back
    for draws in range(1, 9):
        np.random.seed(draws)
        outside = np.random.get_state()[1].copy()
        assert table_mod.iqm_interval(varied, reps=4000) == (point, (lo, hi))
        assert (np.random.get_state()[1] == outside).all()


def test_without_rliable_or_with_unequal_runs_there_is_no_aggregate_and_the_table_says_why(monkeypatch):
    with pytest.raises(ValueError, match="the same number of runs of every env .* have 3, 2 runs"):
        table_mod.score_matrix([np.zeros(3), np.zeros(2)])
    monkeypatch.setattr(table_mod, "_rliable", lambda: None)
    envs = [{"env": "popgym-HigherLowerEasy-v0", "mmer": 0.5, "greedy": None, "runs": [{"run": "r", "mmer": 0.5}]}]
    agg = table_mod.aggregate(envs)
    assert agg == {"note": "the aggregate needs rliable: pip install -e '.[rliable]'"}
    text = table_mod.markdown({"envs": [], "aggregate": agg, "report_every": 65_536})
    assert "no aggregate: the aggregate needs rliable" in text


def test_a_config_per_env_of_the_papers_table():
    ids = {load_config(p).env.id for p in TABLE_CONFIGS}
    assert ids == set(table_mod.PAPER)
    for path in TABLE_CONFIGS:
        cfg = load_config(path)
        assert cfg.collector.mode == "episode" and cfg.collector.bptt_truncate is None
        assert cfg.total_env_steps <= 15_000_000  # the paper's budget
        assert [w["target"] for w in cfg.env.wrappers] == ["rl_replay.envs.wrappers:PreviousAction"]


def test_two_updates_of_a_shipped_popgym_config_and_its_table_row(tmp_path):
    pytest.importorskip("popgym")
    from _runs import tiny_popgym_run

    run = tmp_path / "run"
    trainer = tiny_popgym_run(run, updates=2)
    assert set(trainer.collector.envs.single_observation_space.spaces) == {"obs", "prev_action", "is_first"}
    assert trainer.update == 2
    out = subprocess.run(
        [sys.executable, str(SCRIPT), str(run), "--greedy-episodes", "4", "--json", str(tmp_path / "t.json")],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=ROOT,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    result = json.loads((tmp_path / "t.json").read_text())
    (env,) = result["envs"]
    assert env["env"] == "popgym-RepeatPreviousMedium-v0" and env["paper_best"] == 0.789
    assert env["mmer"] is None  # 16 episodes, not 100, and short of the first report at 65,536 env steps
    assert -1.0 <= env["greedy"] <= 1.0
    assert "| RepeatPreviousMedium | 1 | - |" in out.stdout
    assert "MMER read every 65,536 env steps" in out.stdout and result["report_every"] == 65_536


def test_not_a_run_directory_is_one_line(tmp_path):
    out = subprocess.run([sys.executable, str(SCRIPT), str(tmp_path)], capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and "is not a run directory" in out.stderr


def test_runs_of_one_env_with_different_recipes_are_refused_before_anything_runs(tmp_path, capsys):
    # a row's mean is over one recipe's seeds: two recipes on one env would be averaged into one row
    from rl_replay.config import dump_config

    base = load_config(ROOT / "configs" / "popgym" / "repeat_previous_medium.yaml")
    runs = {}
    for name, overrides in {
        "a": ["seed=1"],
        "b": ["seed=2", "total_env_steps=1000", "log.wandb_mode=disabled"],  # per-run keys may differ
        "c": ["seed=3", "loss.entropy_coef=0.01"],
    }.items():
        run = tmp_path / name
        run.mkdir()
        cfg = load_config(ROOT / "configs" / "popgym" / "repeat_previous_medium.yaml", overrides)
        assert cfg.env.id == base.env.id
        (run / "config.yaml").write_text(dump_config(cfg))
        (run / "metrics.jsonl").write_text("")
        runs[name] = run
    table_mod.check_one_recipe_per_env([runs["a"], runs["b"]])  # seeds, budget and logging differ: one recipe
    with pytest.raises(SystemExit, match=r"are both popgym-RepeatPreviousMedium-v0.*differ in loss\.entropy_coef"):
        table_mod.check_one_recipe_per_env([runs["a"], runs["b"], runs["c"]])
    code, err = run_main(capsys, str(runs["a"]), str(runs["c"]), "--greedy-episodes", "3")
    assert code != 0 and "Run the tool once per recipe" in err


def _fake_run(tmp_path, name, config, seed, score):
    from rl_replay.config import dump_config

    d = tmp_path / name
    d.mkdir()
    (d / "config.yaml").write_text(dump_config(load_config(ROOT / "configs" / "popgym" / config, [f"seed={seed}"])))
    d.joinpath("metrics.jsonl").write_text(
        json.dumps({"update": 1, "env_steps": 65_536, "rollout/episodes": 100, "rollout/return_recent": score}) + "\n"
    )
    return d


def test_the_aggregate_says_when_envs_have_one_run_the_bootstrap_cannot_resample(tmp_path):
    pytest.importorskip("rliable.library", reason="needs the rliable extra: pip install -e '.[rliable]'")

    def run(name, config, seed, score):
        return _fake_run(tmp_path, name, config, seed, score)

    ones = [run("a1", "higher_lower_easy.yaml", 1, 0.50), run("b1", "autoencode_easy.yaml", 1, -0.40)]
    result = table_mod.table(ones, reps=1000)
    assert [e["mmer"] for e in result["envs"]] == [pytest.approx(-0.40), pytest.approx(0.50)]
    assert result["aggregate"]["single_run_envs"] == 2
    assert "2 of the 2 envs have one run" in table_mod.markdown(result)
    twos = [*ones, run("a2", "higher_lower_easy.yaml", 2, 0.30), run("b2", "autoencode_easy.yaml", 2, -0.20)]
    both = table_mod.table(twos, reps=1000)
    assert both["aggregate"]["single_run_envs"] == 0
    assert "have one run" not in table_mod.markdown(both)
    # one env with a run more than the other: rliable's runs x envs matrix has no shape for it
    uneven = table_mod.table([*twos, run("a3", "higher_lower_easy.yaml", 3, 0.10)], reps=1000)
    assert "no aggregate: the aggregate needs the same number of runs of every env" in table_mod.markdown(uneven)


def test_an_earlier_tables_rows_join_for_envs_not_run_again_and_the_aggregate_covers_all(tmp_path, capsys):
    hl = [_fake_run(tmp_path, f"h{s}", "higher_lower_easy.yaml", s, x) for s, x in [(1, 0.5), (2, 0.3)]]
    ae = [_fake_run(tmp_path, f"a{s}", "autoencode_easy.yaml", s, x) for s, x in [(1, -0.4), (2, -0.2)]]
    earlier = tmp_path / "earlier.json"
    code, err = run_main(capsys, *map(str, hl + ae), "--json", str(earlier), "--reps", "1000")
    assert code == 0, err
    # HigherLower run again with new seeds: its new row replaces the earlier one, AutoencodeEasy's stays
    new_hl = [_fake_run(tmp_path, f"n{s}", "higher_lower_easy.yaml", s, x) for s, x in [(1, 0.9), (2, 0.7)]]
    merged = tmp_path / "merged.json"
    code, err = run_main(capsys, *map(str, new_hl), "--with", str(earlier), "--json", str(merged), "--reps", "1000")
    assert code == 0, err
    result = json.loads(merged.read_text())
    rows = {e["env"]: e for e in result["envs"]}
    assert rows["popgym-HigherLowerEasy-v0"]["mmer"] == pytest.approx(0.8)
    assert [r["run"] for r in rows["popgym-HigherLowerEasy-v0"]["runs"]] == [str(d) for d in new_hl]
    assert rows["popgym-AutoencodeEasy-v0"]["mmer"] == pytest.approx(-0.3)
    # the aggregate is over all four runs, as if they had been given together
    direct = table_mod.table(new_hl + ae, reps=1000)
    if "note" in direct["aggregate"]:  # rliable not installed: both say so
        assert result["aggregate"] == direct["aggregate"]
    else:
        assert result["aggregate"]["iqm"] == pytest.approx(direct["aggregate"]["iqm"])
        assert result["aggregate"]["ci95"] == pytest.approx(list(direct["aggregate"]["ci95"]))


@pytest.mark.parametrize(
    ("content", "message"),
    [
        ("not json", "not a table this tool wrote"),
        (json.dumps({"envs": [{"env": "x"}], "report_every": 65_536}), "no 'envs' list"),
        (json.dumps({"envs": [{"env": "x", "runs": [{"mmer": "high"}]}], "report_every": 65_536}), "no numeric 'mmer'"),
        (json.dumps({"envs": [], "report_every": 0}), "read every 0 env steps, this table's every 65536"),
    ],
)
def test_an_earlier_table_that_is_not_one_is_refused_naming_why(tmp_path, capsys, content, message):
    bad = tmp_path / "t.json"
    bad.write_text(content)
    code, err = run_main(capsys, "--with", str(bad), "--json", str(tmp_path / "out.json"))
    assert code != 0 and message in err and err.count("\n") == 1
    assert not (tmp_path / "out.json").exists()


def test_two_earlier_tables_with_a_row_of_one_env_are_refused(tmp_path, capsys):
    row = {"env": "popgym-HigherLowerEasy-v0", "runs": [{"run": "r", "mmer": 0.5, "greedy": None}], "greedy": None}
    for name in ("a.json", "b.json"):
        (tmp_path / name).write_text(json.dumps({"envs": [row], "report_every": 65_536}))
    code, err = run_main(capsys, "--with", str(tmp_path / "a.json"), "--with", str(tmp_path / "b.json"))
    assert code == 2 and "popgym-HigherLowerEasy-v0 more than once" in err


def test_plot_without_matplotlib_is_refused_before_anything_is_evaluated(tmp_path):
    run = _fake_run(tmp_path, "r", "higher_lower_easy.yaml", 1, 0.5)
    shadow = tmp_path / "shadow"
    shadow.mkdir()
    (shadow / "matplotlib.py").write_text("raise ImportError('matplotlib is not installed here')\n")
    out = subprocess.run(
        [sys.executable, str(SCRIPT), str(run), "--json", str(tmp_path / "t.json"), "--plot", str(tmp_path / "t.png")],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "PYTHONPATH": f"{shadow}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"},
    )
    assert out.returncode == 2 and "--plot needs matplotlib" in out.stderr
    assert not (tmp_path / "t.json").exists()


def test_the_performance_profile_is_drawn_or_refused_in_one_line(tmp_path):
    shipped = ROOT / "docs" / "popgym_table.json"
    out = subprocess.run(
        [sys.executable, str(SCRIPT), "--with", str(shipped), "--profile", str(tmp_path / "p.png")],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
    )
    if importlib.util.find_spec("rliable") is None:
        assert out.returncode == 2 and "--profile needs rliable: pip install -e '.[rliable]'" in out.stderr
        assert not (tmp_path / "p.png").exists()
    else:
        assert out.returncode == 0, out.stderr[-2000:]
        assert (tmp_path / "p.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        assert "IQM of MMER over 9 envs: 0.692 (95 % CI 0.663 to 0.720" in out.stdout
