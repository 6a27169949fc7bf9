"""One door to a run directory: every command and tool that reads or writes a run goes through it.

A run directory may come from someone else (docs/checkpoints.md). :class:`RunDirectory` opens it
once, as a directory and without following a link, and holds it by that descriptor: every file
is read and written relative to it (:class:`~rl_replay.rundir.files.Dir`). What it offers is
checked before it is handed out:

* :meth:`RunDirectory.config`: ``config.yaml`` as data, with whether it is this user's (its
  signature verifies, or :class:`Trust` says so) and the :class:`~rl_replay.targets.Importer` that
  may build from it; a foreign config's targets are checked before anything is imported.
* :meth:`RunDirectory.checkpoint`: the latest verified checkpoint (numbers only; nothing runs).
* :meth:`RunDirectory.agent`: the agent built from the config, its weights loaded and finite.
* :meth:`RunDirectory.env_state`: the env pickles a checkpoint names, given only when this user's
  MAC verifies them for this run and its env config (or :class:`Trust` says so).
* :meth:`RunDirectory.metrics`: the rows of ``metrics.jsonl``, a cut last line skipped with a note.

:meth:`RunDirectory.create` makes a new run's directory and locks it; a resume opens with
``lock=True``. The run's own writes (config, checkpoint, env state, metrics) go through the same
descriptor. Trust is explicit: :class:`Trust` is what the user passed (``--trust-config``,
``--trust-env-state``), and nothing else widens what a run directory may do.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rl_replay.rundir import files
from rl_replay.rundir.checkpoint import (
    CHECKPOINT_NAME,
    finite_weights,
    load_checkpoint,
    load_latest,
    require,
    require_counts,
)
from rl_replay.rundir.config_file import CONFIG_NAME, RunConfig, check_imports, read_run_config
from rl_replay.rundir.env_state_file import EnvState, read_env_state
from rl_replay.rundir.lock import RunLock, claim_default, claim_fresh, resume_kind
from rl_replay.rundir.metrics_file import METRICS_NAME, rows_named
from rl_replay.targets import Importer

__all__ = ["Trust", "RunDirectory", "read_run_metrics", "convert_run"]


@dataclass(frozen=True)
class Trust:
    """What the user trusts of a run directory beyond its signatures, as they said it.

    ``config``: its ``config.yaml`` may import what it names even if this user did not sign it
    (``--trust-config``). ``env_state``: its ``env_state.pkl`` may be unpickled even if this
    user's MAC does not verify it for this run (``--trust-env-state``). ``flag`` is how the
    command says the first, quoted in refusals.
    """

    config: bool = False
    env_state: bool = False
    flag: str = "--trust-config"


class RunDirectory:
    """A run directory held open by its descriptor: read (and, for the run itself, written) through it.

    Make one with :meth:`open` (an existing run) or :meth:`create` (a new run); :meth:`close`
    releases the descriptor and the lock.
    """

    def __init__(self, d: files.Dir, *, trust: Trust = Trust(), lock: RunLock | None = None) -> None:
        self.dir = d
        self.trust = trust
        self.lock = lock

    # ------------------------------------------------------------------ opening
    @classmethod
    def open(cls, path: str | os.PathLike, *, trust: Trust = Trust(), lock: bool = False) -> RunDirectory:
        """Open the run directory ``path`` (not through a link); ``lock``: take its lock, as a
        resume does, without writing the pid until :meth:`record_pid`.

        Raises FileNotFoundError (one line) if there is no such directory, and
        :class:`~rl_replay.rundir.files.UnsafeFileError` if it is a link or not a directory.
        """
        try:
            d = files.Dir.open(path)
        except FileNotFoundError:
            raise FileNotFoundError(
                f"no run directory {os.fspath(path)}: give the directory of a run (it holds config.yaml and "
                "checkpoint.pt)"
            ) from None
        run = cls(d, trust=trust)
        try:
            if lock:
                run.take_lock()
        except BaseException:
            d.close()
            raise
        return run

    @classmethod
    def create(cls, path: str | os.PathLike | None, *, parent: str | os.PathLike = "runs", name: str) -> RunDirectory:
        """A new run's directory, created (``path``, which must be absent or empty; or a free
        ``parent/name[-N]``) and locked with this process's pid."""
        d, lock = claim_fresh(path) if path else claim_default(parent, name)
        return cls(d, lock=lock)

    @property
    def path(self) -> Path:
        return self.dir.path

    def close(self) -> None:
        if self.lock is not None:
            self.lock.release()
        self.dir.close()

    def __enter__(self) -> RunDirectory:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def take_lock(self) -> None:
        """Take the run's lock without writing the pid (a resume: nothing changes until
        :meth:`record_pid`); refused (one line) while another process holds it."""
        if self.lock is None:
            self.lock = RunLock(self.dir, record=False)

    def record_pid(self) -> None:
        """Write this process's pid into the held lock (a resume, once all it read is checked)."""
        if self.lock is not None:
            self.lock.record_pid()

    def resume_kind(self) -> str:
        """``"checkpoint"`` or ``"restart"`` (stopped before its first checkpoint); see :func:`resume_kind`."""
        return resume_kind(self.dir)

    # ------------------------------------------------------------------ what it offers
    def config(self, overrides: Sequence[str] = (), *, build: bool = True) -> RunConfig:
        """``config.yaml`` with ``overrides``, read as data. With ``build`` (something will be built
        from it), a foreign one's targets are checked here, before anything is imported
        (:func:`~rl_replay.rundir.config_file.check_imports`); a tool that only reads its values
        passes False."""
        if not self.dir.exists(CONFIG_NAME):
            raise FileNotFoundError(f"{self.path} is not a run directory with a checkpoint (it holds no {CONFIG_NAME})")
        run_config = read_run_config(self.dir, overrides, trust_config=self.trust.config, flag=self.trust.flag)
        if build:
            check_imports(run_config)
        return run_config

    @staticmethod
    def importer(run_config: RunConfig) -> Importer:
        """What may be imported while building from ``run_config``: anything for this user's own (or
        a trusted) config, only rl_replay and gymnasium for a foreign one."""
        return Importer(run_config.foreign)

    def checkpoint(self, needed_for: str = "evaluation") -> dict[str, Any]:
        """The run's latest checkpoint (verified, numbers only), with its counters checked."""
        state = load_checkpoint(self.dir, CHECKPOINT_NAME)
        ckpt = self.dir.shown(CHECKPOINT_NAME)
        require(state, ckpt, ("update", "env_steps"), needed_for)
        require_counts(state, ckpt, ("update", "env_steps"))
        return state

    def latest(self) -> tuple[dict[str, Any], Path, str | None]:
        """The latest readable checkpoint, falling back to the previous one (:func:`load_latest`)."""
        return load_latest(self.dir)

    def weights(self, state: dict[str, Any], path: Path | None = None) -> dict[str, Any]:
        """``state``'s agent weights, refused (one line) unless every one is finite."""
        return finite_weights(state, path or self.dir.shown(CHECKPOINT_NAME))

    def agent(self, run_config: RunConfig, state: dict[str, Any]) -> Any:
        """The agent ``run_config`` names, built for its env's spaces (through its importer), with
        ``state``'s weights loaded once they are checked finite and fit it."""
        from rl_replay.agent import build_agent
        from rl_replay.rollout.environment import envs_from_config
        from rl_replay.rundir.checkpoint import load_agent_weights
        from rl_replay.rundir.footprint import check_fits

        cfg, importer = run_config.cfg, self.importer(run_config)
        weights = self.weights(state)
        probe = envs_from_config(cfg.env, 1, importer=importer)
        try:
            spaces = probe.single_observation_space, probe.single_action_space
        finally:
            probe.close()
        check_fits(cfg, *spaces, train=False, importer=importer)
        agent = build_agent(cfg.agent.target, cfg.agent.kwargs, *spaces, importer)
        load_agent_weights(agent, weights, self.dir.shown(CHECKPOINT_NAME))
        return agent

    def env_state(self, digest: str, key: bytes, binding: bytes) -> EnvState:
        """The env pickles the checkpoint names by ``digest`` if this user's MAC verifies them for
        ``binding`` (or :class:`Trust` says so); see :func:`~rl_replay.rundir.env_state_file.read_env_state`."""
        return read_env_state(self.dir, digest, key, binding, trust_file=self.trust.env_state)

    def metrics(self, notes: list[str] | None = None, name: str = METRICS_NAME) -> list[dict[str, Any]]:
        """The rows of ``metrics.jsonl`` (none if it is absent); ``notes`` gets a line for a cut one."""
        return list(rows_named(self.dir, name, notes))


def convert_run(path: str | os.PathLike, *, trust_file: bool, key: bytes) -> tuple[Path, Path | None]:
    """Rewrite a legacy (pickled) checkpoint in the current format: a run directory's (through its
    door, holding its lock while its files change) or a checkpoint file's
    (:func:`~rl_replay.rundir.legacy.convert_legacy`)."""
    from rl_replay.rundir.legacy import convert_in, convert_legacy

    if not Path(path).is_dir():
        return convert_legacy(path, trust_file=trust_file, key=key)
    with RunDirectory.open(path, lock=True) as run:
        return convert_in(run.dir, CHECKPOINT_NAME, trust_file=trust_file, key=key)


def read_run_metrics(path: str | os.PathLike, notes: list[str] | None = None) -> list[dict[str, Any]]:
    """The metrics rows of a run directory, or of a metrics file named by its path (a peer's run
    written by ``compare_peers.py``), read through the door: no link followed, each line bounded,
    a cut line skipped with a note in ``notes``. Raises FileNotFoundError (one line) if there are none."""
    path = Path(path)
    directory, name = (path, METRICS_NAME) if path.is_dir() else (path.parent, path.name)
    with RunDirectory.open(directory) as run:
        if not run.dir.exists(name):
            raise FileNotFoundError(f"{path} holds no {METRICS_NAME}: pass a run directory or a metrics file")
        return run.metrics(notes, name)
