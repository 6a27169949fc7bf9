"""The run's records: metrics.jsonl (non-finite as null), wandb (mode precedence, online
preflight, what an offline run holds, resume), and the per-update memory metrics."""

from __future__ import annotations

import importlib.util
import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from rl_replay.config import load_config
from rl_replay.errors import SetupError
from rl_replay.run.logger import RunLogger, read_metrics, resolve_wandb_mode, summarize
from rl_replay.run.setup import build

ROOT = Path(__file__).resolve().parents[2]

# The reader of wandb's offline files is a tool (scripts/tools), not part of the library.
_spec = importlib.util.spec_from_file_location("wandb_offline", ROOT / "scripts" / "tools" / "wandb_offline.py")
assert _spec and _spec.loader
_wandb_offline = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_wandb_offline)
read_offline_run = _wandb_offline.read_offline_run


@pytest.fixture
def wandb_env(tmp_path, monkeypatch):
    """wandb offline-capable and isolated: no WANDB_MODE, its home dirs under tmp_path."""
    monkeypatch.setenv("WANDB_SILENT", "true")
    for var in ("WANDB_MODE", "WANDB_DISABLED", "WANDB_BASE_URL"):
        monkeypatch.delenv(var, raising=False)
    for var in ("WANDB_CONFIG_DIR", "WANDB_CACHE_DIR", "WANDB_DATA_DIR"):
        monkeypatch.setenv(var, str(tmp_path / "wandb_home"))
    return monkeypatch


def cfg_for(run_dir, *overrides):
    return load_config(
        None,
        [
            "env.id=rl_replay/MemoryCue-v0",
            "env.kwargs={delay: 2}",
            "env.num_envs=4",
            "collector.num_steps=8",
            "total_env_steps=256",
            "agent.kwargs={hidden_sizes: [8]}",
            "log.progress=false",
            "checkpoint.every=2",
            f"run_dir={run_dir}",
            *overrides,
        ],
    )


# ------------------------------------------------------------------ metrics.jsonl
def test_non_finite_values_are_kept_as_null(tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "disabled")  # it would win over the logger's argument
    logger = RunLogger(tmp_path, config={}, wandb_mode="disabled", progress=False)
    logger.log({"a": math.nan, "b": math.inf, "c": -math.inf, "d": 1.5}, update=1, env_steps=8)
    logger.close()
    text = (tmp_path / "metrics.jsonl").read_text()
    assert "NaN" not in text and "Infinity" not in text  # strict JSON
    (record,) = [json.loads(line) for line in text.splitlines()]
    assert record == {"update": 1, "env_steps": 8, "a": None, "b": None, "c": None, "d": 1.5}


# ------------------------------------------------------------------ mode precedence
@pytest.mark.parametrize(
    "env, config, expected",
    [
        ({"WANDB_MODE": "disabled"}, "offline", "disabled"),
        ({"WANDB_MODE": "offline"}, "disabled", "offline"),
        ({"WANDB_MODE": "dryrun"}, "online", "offline"),
        ({"WANDB_DISABLED": "true"}, "offline", "disabled"),
        ({}, "offline", "offline"),
    ],
)
def test_wandb_mode_environment_variable_wins(wandb_env, env, config, expected):
    for key, value in env.items():
        wandb_env.setenv(key, value)
    assert resolve_wandb_mode(config) == expected


def test_wandb_mode_precedence_in_a_run(wandb_env, tmp_path):
    wandb_env.setenv("WANDB_MODE", "disabled")
    build(cfg_for(tmp_path / "a", "total_env_steps=32", "log.wandb_mode=offline")).train()
    assert not (tmp_path / "a" / "wandb").exists()
    wandb_env.setenv("WANDB_MODE", "offline")
    build(cfg_for(tmp_path / "b", "total_env_steps=32", "log.wandb_mode=disabled")).train()
    assert list((tmp_path / "b" / "wandb").glob("offline-run-*"))
    wandb_env.setenv("WANDB_MODE", "cloud")
    with pytest.raises(SetupError, match="WANDB_MODE='cloud' is not one of online, offline, disabled"):
        build(cfg_for(tmp_path / "c"))
    assert not (tmp_path / "c").exists()


def test_online_without_network_fails_fast_on_the_cli(wandb_env, tmp_path):
    # A closed local port: the server cannot be reached (deterministic with or without network).
    env = {**os.environ, "WANDB_BASE_URL": "http://127.0.0.1:9", "OMP_NUM_THREADS": "1"}
    run_dir = tmp_path / "run"
    start = time.monotonic()
    proc = subprocess.run(
        [
            sys.executable,
            str(ROOT / "scripts" / "train.py"),
            "log.wandb_mode=online",
            f"run_dir={run_dir}",
            "log.progress=false",
        ],
        capture_output=True,
        text=True,
        env=env,
        cwd=tmp_path,
        timeout=120,
    )
    elapsed = time.monotonic() - start
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "127.0.0.1:9 cannot be reached" in lines[0], proc.stderr
    assert "log.wandb_mode=offline" in lines[0]
    # Fast means no wait for wandb's own retries (minutes): the bound leaves room for a slow,
    # loaded machine's interpreter start (18 s seen beside another test worker).
    assert elapsed < 60
    assert list(tmp_path.iterdir()) == [], list(tmp_path.iterdir())  # no run dir, no wandb dir


# ------------------------------------------------------------------ what an offline run holds
def offline_runs(run_dir):
    return sorted((Path(run_dir) / "wandb").glob("offline-run-*"), key=lambda p: p.name)


def test_offline_run_has_summary_config_group_tags_and_step_metric(wandb_env, tmp_path):
    run_dir = tmp_path / "run"
    trainer = build(cfg_for(run_dir, "log.wandb_mode=offline", "log.group=sweep-1", "log.tags=[memory, a2c]"))
    trainer.train()
    (fragment,) = offline_runs(run_dir)
    run = read_offline_run(fragment)
    assert run["id"] == trainer.logger.wandb_id
    assert run["group"] == "sweep-1" and run["tags"] == ["memory", "a2c"] and run["job_type"] == "train"
    extras = run["config"]["run"]
    assert extras == {
        "num_params": sum(p.numel() for p in trainer.model.parameters()),
        "world_size": 1,
        "device": "cpu",
        "batch_size_per_rank": 32,
        "batch_size": 32,
        "num_updates": 8,
    }
    assert run["config"]["log"]["group"] == "sweep-1" and run["config"]["env"]["imports"] == []
    # env_steps is the x-axis of every metric.
    assert any(m.glob_name == "*" and m.step_metric == "env_steps" for m in run["metrics"])
    records = read_metrics(run_dir)
    summary = run["summary"]
    expected = summarize(records)
    for key in ("summary/best_return", "summary/last_success_rate", "summary/mean_steps_per_sec"):
        assert summary[key] == pytest.approx(expected[key]), key
    assert summary["summary/best_return"] == max(
        r["rollout/return_mean"] for r in records if r["rollout/return_mean"] is not None
    )
    assert_history_matches(run["history"], records)


def assert_history_matches(history, records):
    """wandb rows == metrics.jsonl rows: same updates (wandb's _step) once each, same values."""
    by_step = {}
    for row in history:
        assert row["_step"] not in by_step or strip(by_step[row["_step"]]) == strip(row), row["_step"]
        by_step[row["_step"]] = row
    assert sorted(by_step) == [r["update"] for r in records]
    for record in records:
        row = by_step[record["update"]]
        for key, value in record.items():
            if value is None:
                assert key not in row or not math.isfinite(row[key]), key
            else:
                assert row[key] == pytest.approx(value), key


def strip(row):
    return {k: v for k, v in row.items() if not k.startswith("_")}


def test_offline_resume_after_a_crash_keeps_wandb_and_jsonl_in_agreement(wandb_env, tmp_path):
    run_dir = tmp_path / "run"
    trainer = build(cfg_for(run_dir, "log.wandb_mode=offline"))
    # Crash after update 5: checkpoints at 2 and 4; update 5 reached metrics.jsonl only.
    for _ in range(5):
        metrics = trainer.step()
        trainer.logger.log(metrics, update=trainer.update, env_steps=trainer.env_steps)
        if trainer.update % 2 == 0:
            trainer.save()
    with pytest.warns(UserWarning, match="updates 5-5 were not sent to wandb"):
        trainer.logger.close()
    assert [r["update"] for r in read_metrics(run_dir)] == [1, 2, 3, 4, 5]

    resumed = build(resume=run_dir)
    assert resumed.update == 4 and resumed.logger.wandb_id == trainer.logger.wandb_id
    resumed.train()
    records = read_metrics(run_dir)
    assert [r["update"] for r in records] == list(range(1, 9))
    fragments = offline_runs(run_dir)
    assert len(fragments) == 2  # wandb offline cannot resume: a second fragment with the same id
    runs = [read_offline_run(f) for f in fragments]
    assert {r["id"] for r in runs} == {trainer.logger.wandb_id}
    assert [row["_step"] for row in runs[0]["history"]] == [1, 2, 3, 4]
    assert [row["_step"] for row in runs[1]["history"]] == [5, 6, 7, 8]
    assert_history_matches(runs[0]["history"] + runs[1]["history"], records)
    # The second fragment's summary covers the whole run (seeded from metrics.jsonl).
    assert runs[1]["summary"]["summary/best_return"] == pytest.approx(summarize(records)["summary/best_return"])


def test_resume_resends_rows_wandb_may_have_missed(wandb_env, tmp_path):
    run_dir = tmp_path / "run"
    build(cfg_for(run_dir, "log.wandb_mode=offline", "total_env_steps=128")).train()  # 4 updates
    # As if killed between writing the checkpoint of update 4 and handing rows 3-4 to wandb.
    (run_dir / "wandb_logged.json").write_text(json.dumps({"update": 2}))
    build(resume=run_dir, overrides=("total_env_steps=192",)).train()
    fragments = offline_runs(run_dir)
    runs = [read_offline_run(f) for f in fragments]
    assert [row["_step"] for row in runs[1]["history"]] == [3, 4, 5, 6], (
        [f.name for f in fragments],
        [[row["_step"] for row in r["history"]] for r in runs],
    )
    assert_history_matches(runs[0]["history"] + runs[1]["history"], read_metrics(run_dir))


# ------------------------------------------------------------------ memory per update
MEMORY_SCRIPT = r"""
import json, numpy as np
from rl_replay.run.memory_stats import begin_update, update_memory
out = []
for size in (400_000_000, 4_000_000):  # a large update, then a small one
    begin_update("cpu")
    block = np.ones(size // 8)  # touched: resident
    del block
    out.append(update_memory("cpu"))
print(json.dumps(out))
"""


def test_peak_rss_is_per_update_and_falls_after_a_large_update():
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(
        [sys.executable, "-c", MEMORY_SCRIPT], capture_output=True, text=True, env=env, timeout=120, check=True
    )
    large, small = json.loads(proc.stdout)
    if large.get("memory/peak_rss_is_lifetime"):
        pytest.skip("this system cannot reset the peak RSS (/proc/self/clear_refs)")
    assert large["memory/peak_rss_bytes"] >= large["memory/rss_bytes"] + 350e6
    assert small["memory/peak_rss_bytes"] < large["memory/peak_rss_bytes"] - 350e6
    assert small["memory/peak_rss_bytes"] >= small["memory/rss_bytes"]


def test_evaluate_logs_to_the_training_runs_project(wandb_env, tmp_path):
    run_dir = tmp_path / "run"
    trainer = build(cfg_for(run_dir, "log.wandb_mode=disabled", "total_env_steps=64", "log.group=g1"))
    trainer.train()
    env = {**os.environ, "WANDB_MODE": "offline", "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "evaluate.py"), str(run_dir), "--episodes", "3", "--wandb"],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    (fragment,) = offline_runs(run_dir)
    run = read_offline_run(fragment)
    assert run["job_type"] == "eval" and run["group"] == "g1"
    assert run["config"]["checkpoint_update"] == 2 and run["config"]["checkpoint_env_steps"] == 64
    assert run["summary"]["eval/return_mean"] == pytest.approx(result["return_mean"])
    assert run["history"][0]["env_steps"] == 64


@pytest.mark.cuda
def test_cuda_peak_is_reset_per_update():
    import torch

    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    from rl_replay.run.memory_stats import begin_update, update_memory

    out = []
    for numel in (64 * 2**20, 2**20):  # 256 MiB, then 4 MiB of float32
        begin_update("cuda")
        block = torch.ones(numel, device="cuda")
        del block
        out.append(update_memory("cuda"))
    large, small = out
    assert large["memory/peak_device_bytes"] >= 256 * 2**20
    assert small["memory/peak_device_bytes"] < large["memory/peak_device_bytes"] - 200 * 2**20
    assert small["memory/device_bytes"] <= small["memory/peak_device_bytes"]


def test_logging_keeps_no_rows_in_memory(tmp_path):
    # A million-update run must not grow with its rows (it kept ~2 KiB per row before).
    import tracemalloc

    logger = RunLogger(tmp_path, config={}, wandb_mode="disabled", progress=False)
    row = {f"train/metric_{i}": float(i) for i in range(25)}
    for update in range(1, 201):  # warm-up: file buffers, interned keys
        logger.log(row, update=update, env_steps=update)
    tracemalloc.start()
    before = tracemalloc.get_traced_memory()[0]
    for update in range(201, 2201):
        logger.log({k: v + update for k, v in row.items()}, update=update, env_steps=update)
        if update % 50 == 0:
            logger.checkpointed(update)
    grown = tracemalloc.get_traced_memory()[0] - before
    tracemalloc.stop()
    logger.close()
    assert grown < 64 * 1024, f"{grown / 1024:.0f} KiB retained by 2000 logged rows"


def test_progress_in_a_log_file_is_one_plain_line_every_interval_and_one_at_the_end():
    import io

    from rl_replay.run.logger import ProgressLines

    now = [0.0]
    out = io.StringIO()
    lines = ProgressLines(1000, 0, every=30.0, stream=out, clock=lambda: now[0])
    for update in range(1, 11):  # 100 env steps every 10 s
        now[0] += 10.0
        lines.update(update, 100 * update, 5.0 * update)
    lines.close()
    written = out.getvalue().splitlines()
    assert "\r" not in out.getvalue()
    assert written == [
        "progress: update 3, 300/1000 env steps (30.0%), 10 env steps/s, return 15.0, ETA 1m10s",
        "progress: update 6, 600/1000 env steps (60.0%), 10 env steps/s, return 30.0, ETA 0m40s",
        "progress: update 9, 900/1000 env steps (90.0%), 10 env steps/s, return 45.0, ETA 0m10s",
        "progress: update 10, 1000/1000 env steps (100.0%), 10 env steps/s, return 50.0",
    ]
