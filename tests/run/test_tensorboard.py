"""log.tensorboard: the rows of metrics.jsonl as TensorBoard scalars stepped by env_steps, behind the
gate wandb has (a row goes out once a checkpoint covers it), read back from the event files."""

from __future__ import annotations

import json
import math
import sys

import pytest
from test_hostile_runs import TINY

from rl_replay.errors import SetupError
from rl_replay.run.cli import train_main
from rl_replay.run.logger import RunLogger


def scalars(run_dir) -> dict[str, list[tuple[int, float]]]:
    """Every scalar tag of the run's event files: ``[(step, value), ...]`` in order."""
    pytest.importorskip("tensorboard", reason="needs the tensorboard extra: pip install -e '.[tensorboard]'")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(run_dir / "tensorboard"), size_guidance={"scalars": 0})
    events.Reload()
    return {tag: [(e.step, e.value) for e in events.Scalars(tag)] for tag in events.Tags()["scalars"]}


def test_a_run_and_its_resume_write_every_row_once_stepped_by_env_steps(tmp_path):
    pytest.importorskip("tensorboard", reason="needs the tensorboard extra: pip install -e '.[tensorboard]'")
    run = tmp_path / "run"
    assert (
        train_main([*TINY, "total_env_steps=32", "checkpoint.every=1", "log.tensorboard=true", f"run_dir={run}"]) == 0
    )
    assert train_main(["--resume", str(run), "total_env_steps=48"]) == 0  # the flag is in its config.yaml
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    got = scalars(run)
    assert [step for step, _ in got["train/loss_policy"]] == [16, 32, 48] == [r["env_steps"] for r in rows]
    assert [value for _, value in got["update"]] == [1, 2, 3]
    for key in {k for r in rows for k in r} - {"env_steps"}:
        expected = [(r["env_steps"], r[key]) for r in rows if r.get(key) is not None]
        assert [step for step, _ in got.get(key, [])] == [step for step, _ in expected], key
        assert all(
            math.isclose(v, w, rel_tol=1e-6, abs_tol=1e-6) for (_, v), (_, w) in zip(got.get(key, []), expected)
        ), key
    assert json.loads((run / "tensorboard_logged.json").read_text()) == {"update": 3}


def test_rows_no_checkpoint_covers_stay_out_and_a_resume_writes_no_step_twice(tmp_path):
    pytest.importorskip("tensorboard", reason="needs the tensorboard extra: pip install -e '.[tensorboard]'")
    run = tmp_path / "run"
    run.mkdir()
    (run / "metrics.jsonl").touch()
    logger = RunLogger(run, config={}, wandb_mode="disabled", progress=False, tensorboard=True)
    for update in (1, 2, 3):
        logger.log({"loss": float(update)}, update=update, env_steps=10 * update)
    logger.checkpointed(2)
    with pytest.warns(UserWarning, match="updates 3-3 were not sent to TensorBoard"):
        logger.close()
    assert scalars(run)["loss"] == [(10, 1.0), (20, 2.0)]
    # The run resumes from its previous checkpoint (update 1): rows 2 and 3 come again, with other
    # values; TensorBoard keeps the row 2 it holds and gets only row 3.
    lines = (run / "metrics.jsonl").read_text().splitlines()[:1]
    (run / "metrics.jsonl").write_text("".join(line + "\n" for line in lines))
    logger = RunLogger(run, config={}, wandb_mode="disabled", progress=False, tensorboard=True, start_update=1)
    for update in (2, 3):
        logger.log({"loss": 10.0 * update}, update=update, env_steps=10 * update)
    logger.checkpointed(3)
    logger.close()
    assert scalars(run)["loss"] == [(10, 1.0), (20, 2.0), (30, 30.0)]


def test_without_the_package_log_tensorboard_is_one_line_before_anything_is_written(tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)  # as if tensorboard were not installed
    run = tmp_path / "run"
    assert train_main([*TINY, "total_env_steps=16", "log.tensorboard=true", f"run_dir={run}"]) == 2
    err = capsys.readouterr().err
    assert "error: log.tensorboard=true needs the tensorboard package" in err and "[tensorboard]" in err
    assert not run.exists()
    with pytest.raises(SetupError, match="needs the tensorboard package"):
        from rl_replay.run.logger import tensorboard_preflight

        tensorboard_preflight(True)
