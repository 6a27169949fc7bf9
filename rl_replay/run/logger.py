"""All run output in one place: progress bar, ``metrics.jsonl``, wandb and TensorBoard (main rank only).

``metrics.jsonl`` is the record of a run: one JSON line per logged update, every metric
kept; a non-finite value (no episode finished, a diverged loss) is written as ``null``. It is
appended to without following a symlink and read as a stream of bounded lines
(:mod:`rl_replay.rundir.files`); a line that parses but is not a row (no integer ``update`` and
``env_steps``) is one line naming it.

wandb gets the same rows, with ``step=update`` and ``env_steps`` declared as the x-axis
of every metric (``define_metric``). A row reaches wandb only once a checkpoint covers
its update (:meth:`RunLogger.checkpointed`): after a crash the run resumes from that
checkpoint and logs the following updates again, and wandb, whose history cannot be
rewritten, then never holds rows of the abandoned continuation. So wandb's history and
``metrics.jsonl`` (truncated to the checkpoint on resume) agree row for row, online and
offline. The cost: the dashboard trails the run by up to ``checkpoint.every`` updates.

TensorBoard (``log.tensorboard``) gets the same rows through the same gate, each metric a scalar
stepped by ``env_steps``, in event files under ``RUN_DIR/tensorboard``; its own mark
(``tensorboard_logged.json``) says which update it holds last, so a resume writes no step twice.

Mode: the ``WANDB_MODE`` environment variable (``online``, ``offline``, ``disabled``;
``WANDB_DISABLED=true`` means disabled) wins over ``log.wandb_mode``, as wandb users
expect. :func:`wandb_preflight` resolves it and, for ``online``, checks within seconds
that the wandb server can be reached, before the trainer creates the run directory.
"""

from __future__ import annotations

import json
import math
import os
import socket
import sys
import threading
import time
import warnings
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

from rl_replay.errors import SetupError
from rl_replay.rundir import files
from rl_replay.rundir.metrics_file import (
    METRICS_NAME,
    TENSORBOARD_MARK_NAME,
    WANDB_MARK_NAME,
    is_count,
    iter_metrics,
    read_mark,
    read_metrics,
    truncate_metrics,
    unsent_wandb_id,
)

__all__ = [
    "ProgressLines",
    "RunLogger",
    "RunSummary",
    "truncate_metrics",
    "read_metrics",
    "iter_metrics",
    "unsent_wandb_id",
    "resolve_wandb_mode",
    "wandb_preflight",
    "tensorboard_preflight",
    "summarize",
]

WANDB_MODES = ("online", "offline", "disabled")
# wandb's own aliases for its modes
_MODE_ALIASES = {"run": "online", "dryrun": "offline"}
ONLINE_CHECK_SECONDS = 10.0


def resolve_wandb_mode(config_mode: str) -> str:
    """The wandb mode to use: ``WANDB_MODE`` (or ``WANDB_DISABLED``) if set, else the config's."""
    disabled = os.environ.get("WANDB_DISABLED", "").strip().lower()
    if disabled in ("true", "1", "yes"):
        return "disabled"
    env = os.environ.get("WANDB_MODE", "").strip().lower()
    if not env:
        return config_mode
    env = _MODE_ALIASES.get(env, env)
    if env not in WANDB_MODES:
        raise SetupError(
            f"environment variable WANDB_MODE={os.environ['WANDB_MODE']!r} is not one of "
            f"{', '.join(WANDB_MODES)}: fix it or unset it to use log.wandb_mode."
        )
    return env


def _wandb_address() -> tuple[str, int]:
    url = urlparse(os.environ.get("WANDB_BASE_URL") or "https://api.wandb.ai")
    return url.hostname or "api.wandb.ai", url.port or (80 if url.scheme == "http" else 443)


def _reachable(host: str, port: int, timeout: float) -> str | None:
    """None if a TCP connection to host:port opens within ``timeout`` s, else why not.

    Name resolution has no timeout of its own, so the attempt runs in a daemon thread.
    """
    result: list[str | None] = []

    def attempt():
        try:
            socket.create_connection((host, port), timeout=timeout).close()
            result.append(None)
        except OSError as exc:
            result.append(str(exc) or type(exc).__name__)

    thread = threading.Thread(target=attempt, daemon=True)
    thread.start()
    thread.join(timeout)
    return result[0] if result else f"no answer within {timeout:.0f} s"


def wandb_preflight(config_mode: str) -> str:
    """Resolve the mode; for ``online``, fail in seconds if the wandb server is unreachable.

    Call it before anything is written: it raises :class:`SetupError` with one line
    that suggests ``log.wandb_mode=offline``.
    """
    mode = resolve_wandb_mode(config_mode)
    if mode == "online":
        host, port = _wandb_address()
        why = _reachable(host, port, ONLINE_CHECK_SECONDS)
        if why is not None:
            source = "WANDB_MODE=online" if os.environ.get("WANDB_MODE") else "log.wandb_mode=online"
            raise SetupError(
                f"{source} but the wandb server {host}:{port} cannot be reached ({why}): "
                "train with log.wandb_mode=offline (or WANDB_MODE=offline) and upload later "
                "with `wandb sync`, or fix the network."
            )
    return mode


TENSORBOARD_DIR = "tensorboard"


def tensorboard_preflight(enabled: bool) -> None:
    """Refuse ``log.tensorboard`` in one line, before anything is written, when the tensorboard
    package is not installed."""
    if not enabled:
        return
    try:
        from torch.utils.tensorboard import SummaryWriter  # noqa: F401  (needs the tensorboard package)
    except ImportError:
        raise SetupError(
            "log.tensorboard=true needs the tensorboard package, which is not installed: "
            "pip install -e '.[tensorboard]' (or set log.tensorboard=false)."
        ) from None


def _jsonable(value: Any) -> Any:
    """Floats as JSON numbers; NaN and +-inf as null (JSON has no non-finite numbers)."""
    value = float(value)
    return value if math.isfinite(value) else None


class RunSummary:
    """:func:`summarize` of the records added so far, in constant memory: a run of a million
    updates keeps no list of its rows (keeping them grew the trainer ~2 KiB per update)."""

    def __init__(self) -> None:
        self._best: float | None = None
        self._success: float | None = None
        self._sps_sum, self._sps_count = 0.0, 0
        self._last: dict[str, Any] | None = None

    def add(self, record: dict[str, Any]) -> None:
        def finite(key):
            value = record.get(key)
            return value if isinstance(value, (int, float)) and math.isfinite(value) else None

        ret, success, sps = finite("rollout/return_mean"), finite("rollout/success_rate"), finite("time/steps_per_sec")
        if ret is not None:
            self._best = ret if self._best is None else max(self._best, ret)
        if success is not None:
            self._success = success
        if sps is not None:
            self._sps_sum += sps
            self._sps_count += 1
        self._last = record

    def value(self) -> dict[str, float]:
        out: dict[str, float] = {}
        if self._best is not None:
            out["summary/best_return"] = self._best
        if self._success is not None:
            out["summary/last_success_rate"] = self._success
        if self._sps_count:
            out["summary/mean_steps_per_sec"] = self._sps_sum / self._sps_count
        if self._last is not None:
            out["summary/updates"] = self._last["update"]
            out["summary/env_steps"] = self._last.get("env_steps", 0)
        return out


def summarize(records: list[dict[str, Any]]) -> dict[str, float]:
    """Run summaries from metrics records: best return, last success rate, mean steps/s."""
    summary = RunSummary()
    for record in records:
        summary.add(record)
    return summary.value()


class ProgressLines:
    """Progress for a log file: one plain line every ``every`` seconds and a last one at the end.

    ``progress: update 120, 61440/500000 env steps (12.3%), 2113 env steps/s, return 87.4, ETA 3m28s``
    (the rate is the average since this process started logging).
    """

    def __init__(self, total: int, start: int, *, every: float = 30.0, stream=None, clock=time.monotonic) -> None:
        self.total, self.start, self.every = total, start, every
        self.stream, self.clock = stream, clock
        self._t0 = self._last = clock()
        self._pending: tuple[int, int, float | None] | None = None

    def update(self, update: int, env_steps: int, ret: float | None) -> None:
        self._pending = (update, env_steps, ret)
        if self.clock() - self._last >= self.every:
            self._write()

    def close(self) -> None:
        if self._pending is not None:
            self._write()

    def _write(self) -> None:
        assert self._pending is not None
        update, steps, ret = self._pending
        self.total = max(self.total, steps)  # the last update may overshoot the budget
        now = self.clock()
        rate = (steps - self.start) / max(now - self._t0, 1e-9)
        parts = [
            f"update {update}",
            f"{steps}/{self.total} env steps ({100.0 * steps / max(self.total, 1):.1f}%)",
            f"{rate:.0f} env steps/s",
        ]
        if ret is not None:
            parts.append(f"return {ret:.1f}")
        if rate > 0 and steps < self.total:
            eta = int((self.total - steps) / rate)
            parts.append(
                f"ETA {eta // 3600}h{eta % 3600 // 60:02d}m" if eta >= 3600 else f"ETA {eta // 60}m{eta % 60:02d}s"
            )
        print("progress: " + ", ".join(parts), file=self.stream or sys.stderr, flush=True)
        self._last, self._pending = now, None


class RunLogger:
    """Writes each update's metrics to ``metrics.jsonl``, wandb and the progress bar.

    Only the main rank writes; other ranks get a logger that does nothing, so the trainer
    never needs to ask which rank it is on.

    Args:
        run_dir: the run directory (already created): held by the caller (a
            :class:`~rl_replay.rundir.files.Dir`), or a path this logger opens and closes.
        config: the resolved config as a dict (sent to wandb).
        is_main: whether this process writes anything.
        wandb_mode: ``offline`` (default; sync later with ``wandb sync``), ``online`` or
            ``disabled``; the ``WANDB_MODE`` environment variable wins over it.
        wandb_id: resume this wandb run (from the checkpoint) instead of starting one.
        group, tags: the wandb run's group and tags.
        extras: facts about the run for wandb's config under ``run`` (parameter count,
            world size, device, batch sizes).
        total_env_steps, start_env_steps: for the progress bar.
        start_update: the update the run resumes after (0 for a fresh run).
    """

    def __init__(
        self,
        run_dir: files.Dir | str | os.PathLike,
        *,
        config: dict[str, Any],
        is_main: bool = True,
        wandb_mode: str = "offline",
        wandb_project: str = "rl_replay",
        wandb_entity: str | None = None,
        run_name: str | None = None,
        wandb_id: str | None = None,
        group: str | None = None,
        tags: list[str] | tuple[str, ...] = (),
        extras: dict[str, Any] | None = None,
        progress: bool = True,
        progress_every: float = 30.0,
        total_env_steps: int = 0,
        start_env_steps: int = 0,
        start_update: int = 0,
        tensorboard: bool = False,
    ) -> None:
        self.is_main = is_main
        self._owned = not isinstance(run_dir, files.Dir)
        self._dir: files.Dir | None = None
        self.run_dir = run_dir.path if isinstance(run_dir, files.Dir) else Path(run_dir)
        self._file = None
        self._wandb = None
        self._tb = None
        self._tb_mark = 0  # the last update TensorBoard holds
        self._bar = None
        self._lines: ProgressLines | None = None
        self._pending: list[dict[str, Any]] = []  # rows not yet covered by a checkpoint
        self.wandb_id = wandb_id
        if not is_main:
            return
        self._dir = files.Dir.open(run_dir) if isinstance(run_dir, (str, os.PathLike)) else run_dir
        d = self._dir
        # The run's history so far (truncated to the checkpoint on resume) seeds the summaries;
        # the rows after wandb's mark, up to the checkpoint, are kept to be sent again (_resend).
        mark = self._mark(WANDB_MARK_NAME)
        tb_mark = self._tb_mark = self._mark(TENSORBOARD_MARK_NAME)
        self._summary = RunSummary()  # of the rows handed to wandb, i.e. covered by a checkpoint
        history, tb_history = [], []
        for record in iter_metrics(d):
            if record["update"] <= start_update:
                self._summary.add(record)
                if record["update"] > mark:
                    history.append(record)
                if record["update"] > tb_mark:
                    tb_history.append(record)
        fd = d.open_in_place(METRICS_NAME, os.O_WRONLY | os.O_APPEND, "metrics file")
        self._file = os.fdopen(fd, "a", buffering=1, encoding="utf-8")
        mode = resolve_wandb_mode(wandb_mode)
        if mode != "disabled":
            d.check_directory("wandb", "wandb directory")
            import wandb  # lazy: the engine and the tests of other parts never need it

            settings = wandb.Settings(init_timeout=15) if mode == "online" else None
            self._wandb = wandb.init(
                project=wandb_project,
                entity=wandb_entity,
                name=run_name,
                # (a path: wandb's service process writes there; the check above refused a link)
                dir=str(self.run_dir),
                mode=mode,  # type: ignore[arg-type]
                config={**config, "run": dict(extras or {})},
                id=wandb_id,
                resume="allow" if wandb_id else None,
                group=group,
                tags=list(tags) or None,
                job_type="train",
                settings=settings,
            )
            self.wandb_id = self._wandb.id
            if not d.exists(WANDB_MARK_NAME):
                self._write_mark(0)  # the run's id, so that a restart before any row keeps it
            # Every metric is plotted against env_steps (summed over ranks), not wandb's _step.
            self._wandb.define_metric("env_steps")
            self._wandb.define_metric("*", step_metric="env_steps")
            self._resend(history)
        if tensorboard:
            d.check_directory(TENSORBOARD_DIR, "tensorboard directory")
            from torch.utils.tensorboard import SummaryWriter

            # (a path: TensorBoard's writer opens its event files itself; the check above refused a link)
            self._tb = SummaryWriter(log_dir=str(self.run_dir / TENSORBOARD_DIR))
            self._send_tensorboard([{k: (math.nan if v is None else v) for k, v in r.items()} for r in tb_history])
        if progress and not sys.stderr.isatty():
            # A log file: redrawing a bar ~10 times a second would fill it with carriage returns.
            self._lines = ProgressLines(total_env_steps, start_env_steps, every=progress_every)
        elif progress:
            from tqdm import tqdm

            self._bar = tqdm(
                total=total_env_steps, initial=start_env_steps, unit="step", dynamic_ncols=True, smoothing=0.1
            )
        self._last_steps = start_env_steps

    # ------------------------------------------------------------------ wandb rows
    def _mark(self, name: str) -> int:
        assert self._dir is not None
        update = read_mark(self._dir, name).get("update")
        return update if isinstance(update, int) and is_count(update) else 0

    def _send_tensorboard(self, rows: list[dict[str, Any]]) -> None:
        """Each row's metrics as scalars at step ``env_steps`` (a NaN is no point, as for wandb). A row
        TensorBoard holds already (a resume from the previous checkpoint) is not written again."""
        rows = [row for row in rows if row["update"] > self._tb_mark]
        if self._tb is None or not rows:
            return
        for row in rows:
            step = int(row["env_steps"])
            for key, value in row.items():
                if key != "env_steps" and not (isinstance(value, float) and math.isnan(value)):
                    self._tb.add_scalar(key, value, global_step=step)
        self._tb.flush()
        assert self._dir is not None
        self._tb_mark = int(rows[-1]["update"])
        self._dir.replace_with_text(TENSORBOARD_MARK_NAME, json.dumps({"update": self._tb_mark}))

    def _send(self, rows: list[dict[str, Any]]) -> None:
        run = self._wandb
        assert run is not None  # rows are sent only to an open wandb run
        for row in rows:
            # NaN is "no point" on a wandb chart, as null is in metrics.jsonl; dropping it
            # keeps wandb's last-value summary of, e.g., the return meaningful.
            sent = {k: v for k, v in row.items() if not (isinstance(v, float) and math.isnan(v))}
            run.log(sent, step=int(row["update"]))
        if rows:
            run.summary.update(self._summary.value())
            self._write_mark(int(rows[-1]["update"]))

    def _write_mark(self, update: int) -> None:
        assert self._dir is not None
        self._dir.replace_with_text(WANDB_MARK_NAME, json.dumps({"update": update, "wandb_id": self.wandb_id}))

    def _resend(self, rows: list[dict[str, Any]]) -> None:
        """On resume: the rows after wandb's mark up to the checkpoint, which wandb may not have (a
        kill right after a checkpoint was written and before its rows were handed over). A row wandb
        already holds has the same step and values, and wandb ignores it."""
        self._send([{k: (math.nan if v is None else v) for k, v in r.items()} for r in rows])

    def checkpointed(self, update: int) -> None:
        """A checkpoint of ``update`` is on disk: send the rows it covers to wandb and TensorBoard."""
        if self._wandb is None and self._tb is None:
            self._pending.clear()
            return
        ready = [row for row in self._pending if row["update"] <= update]
        self._pending = [row for row in self._pending if row["update"] > update]
        if self._wandb is not None:
            for row in ready:
                self._summary.add(row)
            self._send(ready)
        self._send_tensorboard(ready)

    # ------------------------------------------------------------------ logging
    def log(self, metrics: dict[str, float], *, update: int, env_steps: int) -> None:
        """Record one update's metrics; non-finite values become null in ``metrics.jsonl``."""
        if not self.is_main:
            return
        values = {k: float(v) for k, v in metrics.items()}
        row = {"update": update, "env_steps": env_steps, **values}
        record = {"update": update, "env_steps": env_steps, **{k: _jsonable(v) for k, v in values.items()}}
        self._file.write(json.dumps(record, allow_nan=False) + "\n")  # type: ignore[union-attr]
        if self._wandb is not None or self._tb is not None:
            self._pending.append(row)
        if self._bar is not None:
            if env_steps > self._bar.total:  # the last update overshoots; tqdm drops a total it passed
                self._bar.total = env_steps
            self._bar.update(env_steps - self._last_steps)
            post = {}
            if record.get("rollout/return_recent") is not None:
                post["return"] = f"{record['rollout/return_recent']:.1f}"
            if record.get("time/steps_per_sec") is not None:
                post["sps"] = f"{record['time/steps_per_sec']:.0f}"
            self._bar.set_postfix(post, refresh=False)
        if self._lines is not None:
            self._lines.update(update, env_steps, record.get("rollout/return_recent"))
        self._last_steps = env_steps

    def close(self) -> None:
        """Close the file and wandb. Rows after the last checkpoint stay out of wandb."""
        if self._bar is not None:
            self._bar.close()
        if self._lines is not None:
            self._lines.close()
        if self._file is not None:
            try:
                self._file.close()
            except OSError:  # only after a failed write (lines are flushed as written), reported already
                pass
            self._file = None
        if self._pending:
            sinks = " and ".join(
                n for n, sink in (("wandb", self._wandb), ("TensorBoard", self._tb)) if sink is not None
            )
            warnings.warn(
                f"updates {self._pending[0]['update']}-{self._pending[-1]['update']} were not sent to "
                f"{sinks}: no checkpoint covers them (a resume continues from the last checkpoint and "
                "logs them again); metrics.jsonl has them until then.",
                stacklevel=2,
            )
            self._pending.clear()
        if self._wandb is not None:
            self._wandb.finish()
            self._wandb = None
        if self._tb is not None:
            self._tb.close()
            self._tb = None
        if self._owned and self._dir is not None:
            self._dir.close()
            self._dir = None
