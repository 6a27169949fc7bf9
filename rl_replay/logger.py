"""All run output in one place: progress bar, ``metrics.jsonl`` and wandb (main rank only)."""

from __future__ import annotations

import json
import math
import os
import resource
from pathlib import Path
from typing import Any

import torch

__all__ = ["RunLogger", "peak_memory", "truncate_metrics"]

METRICS_NAME = "metrics.jsonl"


def peak_memory(device: torch.device) -> dict[str, float]:
    """Peak resident set size of this process and, on CUDA, peak allocated device bytes."""
    out = {"memory/peak_rss_bytes": float(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)}
    if device.type == "cuda":
        out["memory/peak_device_bytes"] = float(torch.cuda.max_memory_allocated(device))
    return out


def truncate_metrics(path: str | os.PathLike, last_update: int) -> None:
    """Drop lines logged after ``last_update`` (written by a run killed after its checkpoint)."""
    path = Path(path)
    if not path.exists():
        return
    kept = []
    for line in path.read_text().splitlines():
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            continue  # a line cut short by the kill
        if record["update"] <= last_update:
            kept.append(line)
    tmp = path.with_suffix(".jsonl.tmp")
    tmp.write_text("".join(line + "\n" for line in kept))
    os.replace(tmp, path)


class RunLogger:
    """Writes each update's metrics to ``metrics.jsonl``, wandb and the progress bar.

    Only the main rank writes; other ranks get a logger that does nothing, so the trainer
    never needs to ask which rank it is on.

    Args:
        run_dir: the run directory (already created).
        config: the resolved config as a dict (sent to wandb).
        is_main: whether this process writes anything.
        wandb_mode: ``offline`` (default; sync later with ``wandb sync``), ``online`` or
            ``disabled``.
        wandb_id: resume this wandb run (from the checkpoint) instead of starting one.
        total_env_steps, start_env_steps: for the progress bar.
    """

    def __init__(
        self,
        run_dir: str | os.PathLike,
        *,
        config: dict[str, Any],
        is_main: bool = True,
        wandb_mode: str = "offline",
        wandb_project: str = "rl_replay",
        wandb_entity: str | None = None,
        run_name: str | None = None,
        wandb_id: str | None = None,
        progress: bool = True,
        total_env_steps: int = 0,
        start_env_steps: int = 0,
    ) -> None:
        self.is_main = is_main
        self.run_dir = Path(run_dir)
        self._file = None
        self._wandb = None
        self._bar = None
        self.wandb_id = wandb_id
        if not is_main:
            return
        self._file = open(self.run_dir / METRICS_NAME, "a", buffering=1)
        if wandb_mode != "disabled":
            import wandb  # lazy: the engine and the tests of other parts never need it

            self._wandb = wandb.init(
                project=wandb_project, entity=wandb_entity, name=run_name, dir=str(self.run_dir),
                mode=wandb_mode, config=config, id=wandb_id, resume="allow" if wandb_id else None,
            )
            self.wandb_id = self._wandb.id
        if progress:
            from tqdm import tqdm

            self._bar = tqdm(total=total_env_steps, initial=start_env_steps, unit="step",
                             dynamic_ncols=True, smoothing=0.1)
        self._last_steps = start_env_steps

    def log(self, metrics: dict[str, float], *, update: int, env_steps: int) -> None:
        """Record one update's metrics (NaNs are dropped: no episode finished, etc.)."""
        if not self.is_main:
            return
        clean = {k: float(v) for k, v in metrics.items() if not (isinstance(v, float) and math.isnan(v))}
        record = {"update": update, "env_steps": env_steps, **clean}
        self._file.write(json.dumps(record) + "\n")
        if self._wandb is not None:
            self._wandb.log(record, step=env_steps)
        if self._bar is not None:
            self._bar.update(env_steps - self._last_steps)
            post = {}
            if "rollout/return_recent" in clean:
                post["return"] = f"{clean['rollout/return_recent']:.1f}"
            if "time/steps_per_sec" in clean:
                post["sps"] = f"{clean['time/steps_per_sec']:.0f}"
            self._bar.set_postfix(post, refresh=False)
        self._last_steps = env_steps

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
        if self._file is not None:
            self._file.close()
        if self._wandb is not None:
            self._wandb.finish()
