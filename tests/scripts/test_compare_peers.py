"""scripts/tools/compare_peers.py: RecurrentPPO curves in the trainer's metrics.jsonl format.

Skipped when the optional extra ``[compare]`` (sb3-contrib) is not installed.
"""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "tools" / "compare_peers.py"
TINY = ["--num-envs", "2", "--algo-kwargs", "{n_steps: 16, batch_size: 32, n_epochs: 1}"]


def run(*args, timeout=180):
    return subprocess.run(
        [sys.executable, str(SCRIPT), *args], cwd=ROOT, capture_output=True, text=True, timeout=timeout
    )


def read_metrics(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def test_memory_cue_curve_in_trainer_format(tmp_path):
    pytest.importorskip("sb3_contrib")
    out = tmp_path / "peer"
    proc = run(
        "--env",
        "rl_replay/MemoryCue-v0",
        "--env-kwargs",
        "{delay: 4}",
        "--total-env-steps",
        "128",
        "--out",
        str(out),
        *TINY,
    )
    assert proc.returncode == 0, proc.stderr
    rows = read_metrics(out)
    # 128 env steps / (2 envs * 16 steps) = 4 iterations, one record each.
    assert [r["update"] for r in rows] == [1, 2, 3, 4]
    assert [r["env_steps"] for r in rows] == [32, 64, 96, 128]
    for r in rows:
        for key in ("rollout/return_recent", "rollout/success_rate", "memory/peak_rss_bytes", "time/steps_per_sec"):
            assert key in r, key
        assert 0 <= r["rollout/success_rate"] <= 1 and r["memory/peak_rss_bytes"] > 0
    # 6-step episodes (cue, 4 distractors, query): each env finishes 64 // 6 = 10 in 64 steps.
    assert sum(r["rollout/episodes"] for r in rows) == 20
    # Returns are +1 / -1 per episode, so the rolling mean over all episodes so far ties to
    # the success rates: mean return = 2 * success - 1.
    total = sum(r["rollout/episodes"] for r in rows)
    wins = sum(r["rollout/success_rate"] * r["rollout/episodes"] for r in rows)
    assert abs(rows[-1]["rollout/return_recent"] - (2 * wins / total - 1)) < 1e-9
    settings = json.loads((out / "peer.json").read_text())
    assert settings["env_kwargs"] == {"delay": 4} and settings["n_steps"] == 16
    # An existing result is never overwritten.
    again = run("--env", "rl_replay/MemoryCue-v0", "--total-env-steps", "32", "--out", str(out), *TINY)
    assert again.returncode != 0 and "is not empty" in again.stderr
    assert len(read_metrics(out)) == 4


def test_sigint_stops_cleanly_and_keeps_the_metrics(tmp_path):
    """`timeout -s INT` is how a peer run gets its budget: exit 130 with a line, no traceback."""
    pytest.importorskip("sb3_contrib")
    import signal
    import time

    out = tmp_path / "peer"
    proc = subprocess.Popen(
        [
            sys.executable,
            str(SCRIPT),
            "--env",
            "rl_replay/MemoryCue-v0",
            "--env-kwargs",
            "{delay: 4}",
            "--total-env-steps",
            "10000000",
            "--out",
            str(out),
            *TINY,
        ],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            if (out / "metrics.jsonl").exists() and len(read_metrics(out)) >= 2:
                break
            time.sleep(0.2)
        else:
            pytest.fail("no metrics rows within 120 s")
        proc.send_signal(signal.SIGINT)
        stdout, stderr = proc.communicate(timeout=180)  # a loaded 2-core machine: the current iteration finishes first
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 130, stderr
    assert "Traceback" not in stderr and "KeyboardInterrupt" not in stderr, stderr
    assert "stopped by SIGINT after" in stdout
    rows = read_metrics(out)
    assert len(rows) >= 2 and [r["update"] for r in rows] == list(range(1, len(rows) + 1))


def test_popgym_discrete_observations_are_one_hot(tmp_path):
    pytest.importorskip("sb3_contrib")
    pytest.importorskip("popgym")
    out = tmp_path / "popgym"
    proc = run("--env", "popgym-RepeatPreviousEasy-v0", "--total-env-steps", "64", "--out", str(out), *TINY)
    assert proc.returncode == 0, proc.stderr
    assert json.loads((out / "peer.json").read_text())["observation_space"].startswith("Box(0, 1, (4,)")
    assert read_metrics(out)[-1]["env_steps"] == 64


def test_config_env_with_the_grid_cnn_extractor(tmp_path):
    # The MiniGrid config's env as the trainer builds it (three actions, image + direction, the
    # mission dropped), with the project's grid_cnn in front of RecurrentPPO's LSTM.
    pytest.importorskip("sb3_contrib")
    pytest.importorskip("minigrid")
    out = tmp_path / "grid"
    proc = run(
        "--config",
        "configs/minigrid_memory_s7.yaml",
        "--policy",
        "MultiInputLstmPolicy",
        "--grid-cnn",
        "1.0",
        "--grid-cnn-layout",
        "hwc",
        "--total-env-steps",
        "64",
        "--out",
        str(out),
        *TINY,
    )
    assert proc.returncode == 0, proc.stderr
    settings = json.loads((out / "peer.json").read_text())
    assert (
        settings["env"] == "MiniGrid-MemoryS7-v0"
        and settings["grid_cnn_image_scale"] == 1.0
        and settings["grid_cnn_layout"] == "hwc"
    )
    assert "'image'" in settings["observation_space"] and "mission" not in settings["observation_space"]
    assert read_metrics(out)[-1]["env_steps"] == 64
    bad = run(
        "--config",
        "configs/minigrid_memory_s7.yaml",
        "--grid-cnn",
        "0",
        "--total-env-steps",
        "8",
        "--out",
        str(tmp_path / "bad"),
    )
    assert bad.returncode != 0 and "--grid-cnn SCALE must be positive" in bad.stderr


def test_bad_arguments(tmp_path):
    pytest.importorskip("sb3_contrib")
    proc = run("--env", "NoSuchEnv-v0", "--total-env-steps", "10", "--out", str(tmp_path / "x"))
    assert proc.returncode != 0 and "--env NoSuchEnv-v0" in proc.stderr
    proc = run(
        "--env", "CartPole-v1", "--env-kwargs", "[1, 2]", "--total-env-steps", "10", "--out", str(tmp_path / "y")
    )
    assert proc.returncode != 0 and "--env-kwargs must be a YAML mapping" in proc.stderr
    assert not (tmp_path / "x").exists() and not (tmp_path / "y").exists()


def test_summarize_curve_steps_to_threshold(tmp_path):
    sys.path.insert(0, str(ROOT / "scripts" / "tools"))
    from summarize_curve import load, summarize

    success = [0.5, 0.5, 1.0, 1.0, 0.8, 1.0, 1.0]
    lines = [
        {
            "update": i + 1,
            "env_steps": 100 * (i + 1),
            "rollout/success_rate": s,
            "time/steps_per_sec": 10.0 * (i + 1),
            "memory/peak_rss_bytes": 2**20 * (i + 1),
        }
        for i, s in enumerate(success)
    ]
    lines.insert(3, {"update": 0, "env_steps": 350})  # a record without the key is skipped
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines))
    s = summarize(load(tmp_path), window=2, threshold=0.95)
    # Windowed means: 0.5, 0.75, 1.0 (at 400 steps) ... 0.9, 0.9, 1.0
    assert s["steps_to_threshold"] == 400 and s["final"] == 1.0 and s["env_steps"] == 700
    assert s["peak_rss_mib"] == 7 and s["steps_per_sec"] == 40.0
    # Update time to it: 100 steps at 10, 20, 30 and 40 steps/s (the record without a rate adds nothing).
    assert s["seconds_to_threshold"] == pytest.approx(10 + 5 + 100 / 30 + 2.5)
    never = summarize(load(tmp_path), window=2, threshold=1.1)
    assert never["steps_to_threshold"] is None and never["seconds_to_threshold"] is None


def test_summarize_curve_skips_null_values_and_prints_the_median(tmp_path, capsys):
    sys.path.insert(0, str(ROOT / "scripts" / "tools"))
    from summarize_curve import main

    runs = []
    for name, values in (("a", [None, 200.0, 480.0]), ("b", [100.0, None, 490.0]), ("c", [50.0, 60.0, 70.0])):
        run = tmp_path / name
        run.mkdir()
        lines = [
            json.dumps({"update": i + 1, "env_steps": 1000 * (i + 1), "rollout/return_recent": v})
            for i, v in enumerate(values)
        ]
        (run / "metrics.jsonl").write_text("\n".join(lines) + "\n")
        runs.append(str(run))
    assert main([*runs, "--key", "rollout/return_recent", "--threshold", "475", "--window", "1"]) == 0
    out = capsys.readouterr().out
    assert "| 3,000 | n/a |" in out and "not reached" in out  # no time/steps_per_sec: no update time
    assert "median env steps to threshold over 3 runs: 3,000" in out


def test_summarize_curve_rliable_gives_the_iqm_over_seeds_with_an_interval(tmp_path, capsys):
    sys.path.insert(0, str(ROOT / "scripts" / "tools"))
    from summarize_curve import main

    runs = []
    for seed, (final, reached_at) in enumerate([(0.96, 3), (0.97, 2), (0.99, 4), (0.95, 5)]):
        run = tmp_path / f"seed{seed}"
        run.mkdir()
        values = [0.1] * (reached_at - 1) + [final] * (6 - reached_at)
        rows = [{"update": i + 1, "env_steps": 1000 * (i + 1), "rollout/success_rate": v} for i, v in enumerate(values)]
        (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
        runs.append(str(run))
    if importlib.util.find_spec("rliable") is None:
        with pytest.raises(SystemExit):
            main([*runs, "--window", "1", "--rliable"])
        assert "--rliable needs rliable: pip install -e '.[rliable]'" in capsys.readouterr().err
        return
    assert main([*runs, "--window", "1", "--rliable"]) == 0
    out = capsys.readouterr().out
    # finals 0.95, 0.96, 0.97, 0.99: the IQM is the mean of the middle two
    assert "rliable over 4 runs: final IQM 0.965 (95 % CI " in out
    lo, hi = (float(x) for x in out.split("final IQM 0.965 (95 % CI ")[1].split(")")[0].split(" to "))
    assert 0.95 <= lo <= 0.965 <= hi <= 0.99
    # reached at 2,000 3,000 4,000 5,000 env steps: IQM 3,500
    assert "env steps to threshold IQM 3,500 (95 % CI " in out


def test_summarize_curve_windowed_curve_and_plot(tmp_path):
    sys.path.insert(0, str(ROOT / "scripts" / "tools"))
    from summarize_curve import main, windowed_curve

    records = [{"update": i + 1, "env_steps": 10 * (i + 1), "k": v} for i, v in enumerate([0.0, None, 1.0, 0.5])]
    assert windowed_curve(records, "k", 2) == ([30, 40], [0.5, 0.75])
    pytest.importorskip("matplotlib")
    run = tmp_path / "run"
    run.mkdir()
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    out = tmp_path / "curve.png"
    assert main([str(run), "--key", "k", "--window", "1", "--plot", str(out)]) == 0
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # --log-y draws the same curve on a logarithmic axis: another picture.
    log_out = tmp_path / "curve_log.png"
    records = [{"update": i + 1, "env_steps": 10 * (i + 1), "k": v} for i, v in enumerate([1e-6, 1e-3, 1.0])]
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    assert main([str(run), "--key", "k", "--window", "1", "--plot", str(out)]) == 0
    assert main([str(run), "--key", "k", "--window", "1", "--log-y", "--plot", str(log_out)]) == 0
    assert log_out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and log_out.read_bytes() != out.read_bytes()
    # --no-threshold-line leaves the dashed line (and its legend entry) out: another picture.
    bare_out = tmp_path / "curve_bare.png"
    assert (
        main([str(run), "--key", "k", "--window", "1", "--log-y", "--no-threshold-line", "--plot", str(bare_out)]) == 0
    )
    assert bare_out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and bare_out.read_bytes() != log_out.read_bytes()
