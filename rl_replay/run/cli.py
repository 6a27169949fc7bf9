"""Command-line entry points: ``rl-replay-train`` / ``scripts/train.py`` and
``rl-replay-evaluate`` / ``scripts/evaluate.py``.

Exit codes: 0 done; 1 training stopped on an error (non-finite values); 2 bad input
(nothing was written); 128 + signal (130 SIGINT, 143 SIGTERM, 138 SIGUSR1, 140 SIGUSR2) stopped on a signal after
writing a checkpoint.
"""

from __future__ import annotations

import argparse
import ast
import contextlib
import dataclasses
import difflib
import inspect
import json
import math
import os
import sys
from pathlib import Path

__all__ = ["train_main", "evaluate_main", "convert_main", "config_help"]

DEFAULT_CONFIG = Path(__file__).resolve().parents[2] / "configs" / "default.yaml"

TRAIN_USAGE = """Train an agent. One process:

    {prog}                                         # CartPole-v1, configs/default.yaml
    {prog} --config configs/memory_gru.yaml optim.lr=3e-4
    {prog} optim.lr=3e-4 --config configs/memory_gru.yaml env.num_envs=16
    {prog} --resume runs/CartPole-v1-20261130-101500 total_env_steps=1000000

Several processes (FSDP1, one replay engine per rank):

    torchrun --nproc_per_node=2 scripts/train.py --config configs/fsdp_transformer.yaml

Overrides are section.key=value (values parsed as YAML) and may come before or after
--config. Ctrl-C, SIGTERM or SIGUSR1/2 (a scheduler's pre-emption notice) finishes the current
update, writes a checkpoint and exits with 128 + the signal (130 / 143 / 138 / 140); a second one
exits at once.
"""


def _error(exc: BaseException | str) -> None:
    """Print ``error: <message>`` as one line, control characters escaped: a message may quote
    text from someone else's run directory (an env id with terminal escape sequences)."""
    from rl_replay.errors import one_line

    print(f"error: {one_line(str(exc))}", file=sys.stderr)


# ------------------------------------------------------------------------- config --help
def _field_docs(cls: type) -> dict[str, str]:
    """``{field: docstring}`` from the string literal under each field of a dataclass."""
    tree = ast.parse(inspect.getsource(cls))
    body = tree.body[0].body  # type: ignore[attr-defined]
    docs = {}
    for node, after in zip(body, body[1:]):
        if (
            isinstance(node, ast.AnnAssign)
            and isinstance(node.target, ast.Name)
            and isinstance(after, ast.Expr)
            and isinstance(after.value, ast.Constant)
            and isinstance(after.value.value, str)
        ):
            docs[node.target.id] = " ".join(after.value.value.split())
    return docs


def config_help() -> str:
    """Every config key with its type, default and one line of documentation, by section."""
    import typing

    from rl_replay import config as config_module

    root = config_module.Config
    defaults = config_module.config_to_dict(root())
    lines = ["config keys (override with section.key=value, or key=value at top level):"]

    def describe(cls, prefix, values):
        hints, docs = typing.get_type_hints(cls), _field_docs(cls)
        rows, sections = [], []
        for f in dataclasses.fields(cls):
            tp = hints[f.name]
            if dataclasses.is_dataclass(tp):
                sections.append((f.name, tp, docs.get(f.name, "")))
                continue
            key = f"{prefix}{f.name}"
            rows.append(f"  {key:<34} {config_module.type_name(tp)} = {values[f.name]!r}: {docs.get(f.name, '')}")
        return rows, sections

    rows, sections = describe(root, "", defaults)
    lines += ["", "(top level)", *rows]
    for name, cls, doc in sections:
        sub, _ = describe(cls, f"{name}.", defaults[name])
        lines += ["", f"{name}: {doc}", *sub]
    return "\n".join(lines)


# -------------------------------------------------------------------------------- train
def _override_key(override: str) -> str:
    return override.split("=", 1)[0].strip()


def _missing_config(path: str) -> str:
    """One line for a ``--config`` file that does not exist: the nearest name, and the configs
    in its directory and in the shipped ``configs/``."""
    given, shipped = Path(path), DEFAULT_CONFIG.parent
    with contextlib.suppress(ValueError):
        shipped = shipped.relative_to(Path.cwd())
    dirs: list[Path] = []
    for d in (given.parent, shipped):
        if d.is_dir() and any(d.glob("*.yaml")) and all(d.resolve() != o.resolve() for o in dirs):
            dirs.append(d)
    files = [f for d in dirs for f in sorted(d.glob("*.yaml"))]
    if not files:
        return f"Config file not found: {path}"
    close = difflib.get_close_matches(given.name, [f.name for f in files], n=1, cutoff=0.6)
    hint = f" (did you mean {next(f for f in files if f.name == close[0])}?)" if close else ""
    listing = "; ".join(f"{d}/: {', '.join(f.name for f in files if f.parent == d)}" for d in dirs)
    return f"Config file not found: {path}{hint}. Configs in {listing}"


def _resume_command(run_dir: Path, info) -> str:
    script = sys.argv[0] if sys.argv and sys.argv[0].endswith(".py") else None
    if info.distributed:
        return f"torchrun --nproc_per_node=... {script or 'scripts/train.py'} --resume {run_dir}  (same number of processes)"
    return f"{'python ' + script if script else 'rl-replay-train'} --resume {run_dir}"


def _resume_auto(args: argparse.Namespace) -> tuple[str | None, list[str]]:
    """``--resume auto``: ``(the run directory to resume, its overrides)`` when ``run_dir`` holds a
    run, else ``(None, the overrides)``: a new run from the config. Said in one line on stderr. A
    requeued job (Slurm ``--requeue``) runs the same command every time and continues where it stopped.

    Every rank decides before any of them writes (a new run's directory is claimed only after
    the collective wrapping of the agent), so all ranks take the same branch.
    """
    from rl_replay.config import load_config

    if args.config and not Path(args.config).is_file():
        raise FileNotFoundError(_missing_config(args.config))
    default = DEFAULT_CONFIG if DEFAULT_CONFIG.exists() else None
    cfg = load_config(args.config or default, args.overrides)  # (a bad config fails here, before anything)
    if not cfg.run_dir:
        raise ValueError(
            "--resume auto needs the run directory: pass run_dir=... (it resumes the run there, or starts it)."
        )
    rest = [o for o in args.overrides if _override_key(o) != "run_dir"]
    holds_run = os.path.isdir(cfg.run_dir) and os.path.lexists(os.path.join(cfg.run_dir, "config.yaml"))
    if os.environ.get("RANK", "0") == "0":
        what = "resuming the run there (its own config.yaml" + (", --config ignored)" if args.config else ")")
        print(
            f"--resume auto: {cfg.run_dir} {what if holds_run else 'holds no run: starting it there'}",
            file=sys.stderr,
            flush=True,
        )
    return (cfg.run_dir if holds_run else None), (rest if holds_run else list(args.overrides))


def train_main(argv: list[str] | None = None) -> int:
    """``rl-replay-train``: train, or resume a run; returns the exit code."""
    prog = "rl-replay-train" if argv is None and not sys.argv[0].endswith(".py") else "python scripts/train.py"
    parser = argparse.ArgumentParser(
        prog=prog if prog == "rl-replay-train" else None,
        description=TRAIN_USAGE.format(prog=prog),
        epilog=config_help(),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--config", default=None, help=f"YAML config (default: configs/{DEFAULT_CONFIG.name})")
    parser.add_argument(
        "--resume",
        default=None,
        metavar="RUN_DIR",
        help="continue the run in RUN_DIR with its own config.yaml (overrides allowed); 'auto': continue "
        "the run in run_dir=... if it holds one, else start it there from --config (a job that is "
        "requeued runs the same command every time)",
    )
    parser.add_argument(
        "--trust-env-state",
        action="store_true",
        help="with --resume: unpickle the run's env_state.pkl even if it was not written by this "
        "user on this machine (a pickle can run any code: only for runs you trust)",
    )
    parser.add_argument(
        "--trust-config",
        action="store_true",
        help="with --resume: let the run's config.yaml import the modules it names even if it was not "
        "written by this user (importing a module runs it: only for runs whose author you trust)",
    )
    parser.add_argument(
        "overrides",
        nargs="*",
        metavar="section.key=value",
        help="config overrides, e.g. optim.lr=3e-4 (see the keys below)",
    )
    args = parser.parse_intermixed_args(argv)

    from rl_replay.config import load_config
    from rl_replay.errors import (
        CheckpointError,
        EnvStepError,
        NonFiniteError,
        RunWriteError,
        SetupError,
        TrainingInterrupted,
    )

    auto = args.resume == "auto"
    if args.resume and args.config and not auto:
        print(
            f"error: --resume {args.resume} continues that run with its own config.yaml, so --config "
            "cannot be combined with it: pass changes as key=value overrides, or drop --resume to "
            "start a new run from the config file.",
            file=sys.stderr,
        )
        return 2
    if args.trust_env_state and not args.resume:
        print(
            "error: --trust-env-state applies to --resume RUN_DIR only (a new run, or init_from=, reads "
            "weights and unpickles nothing).",
            file=sys.stderr,
        )
        return 2
    if args.trust_config and not args.resume:
        print(
            "error: --trust-config applies to --resume RUN_DIR only (a config given with --config is "
            "yours, and init_from= reads weights only).",
            file=sys.stderr,
        )
        return 2
    if args.resume and not auto and any(_override_key(o) == "run_dir" for o in args.overrides):
        print(
            f"error: --resume {args.resume} already names the run directory: drop run_dir=... (to "
            "start a new run elsewhere, drop --resume instead).",
            file=sys.stderr,
        )
        return 2
    try:
        from rl_replay.run.setup import build

        if auto:
            resume, overrides = _resume_auto(args)
        else:
            resume, overrides = args.resume, args.overrides
        if resume:
            trainer = build(
                resume=resume,
                overrides=tuple(overrides),
                trust_env_state=args.trust_env_state,
                trust_config=args.trust_config,
            )
        else:
            if args.config and not Path(args.config).is_file():
                raise FileNotFoundError(_missing_config(args.config))
            default = DEFAULT_CONFIG if DEFAULT_CONFIG.exists() else None
            cfg = load_config(args.config or default, args.overrides)
            trainer = build(cfg)
    except (SetupError, ValueError, FileNotFoundError) as exc:
        _error(exc)
        return 2
    except RunWriteError as exc:  # the run directory was claimed, but its first files could not be written
        _error(exc)
        return 1
    except KeyboardInterrupt:
        print("error: interrupted while starting; no training happened.", file=sys.stderr)
        return 130
    info = trainer.info
    if info.is_main:
        print(f"run directory: {trainer.run_dir}", file=sys.stderr)
    code = 0
    try:
        metrics = trainer.train()
        if info.is_main and metrics:
            # A NaN here only means that no episode ended in the last update: leave it out.
            shown = {
                k: round(v, 3)
                for k, v in metrics.items()
                if k.startswith(("rollout/return", "train/loss")) and math.isfinite(v)
            }
            print(f"finished {trainer.update} updates, {trainer.env_steps} env steps: {shown}", file=sys.stderr)
    except TrainingInterrupted as exc:
        code = exc.exit_code
        if info.is_main:
            print(f"{exc}\nto continue: {_resume_command(trainer.run_dir, info)}", file=sys.stderr)
    except (NonFiniteError, CheckpointError, RunWriteError, EnvStepError) as exc:
        if info.is_main or info.distributed:
            _error(exc)
        code = 1
    if info.distributed:
        from rl_replay.distributed import shutdown

        if code in (0, 130, 143) or code > 128:
            shutdown(info)  # every rank stopped at the same update
        # Skip interpreter finalisation: with gloo, destroying the process group's C++
        # worker state during Python's teardown aborts the process now and then
        # ("terminate called without an active exception") after all work is done.
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    return code


# ----------------------------------------------------------------------------- evaluate
EVALUATE_USAGE = """Evaluate a checkpoint: run N episodes and print the mean and std of the return.

    {prog} runs/CartPole-v1-20261130-101500 --episodes 100
    {prog} RUN_DIR --video videos/   # needs: pip install -e ".[video]"
    {prog} RUN_DIR --wandb           # also log the result to the run's wandb project
    {prog} RUN_DIR env.kwargs.delay=4096   # a changed environment (env.kwargs.*, env.max_episode_steps)

Works for checkpoints written by one process or by several (FSDP) processes. A run's
config.yaml that you did not write (another user's run, an edited file) imports nothing outside
rl_replay and gymnasium; --trust-config lets it import what it names.
"""


def evaluate_main(argv: list[str] | None = None) -> int:
    """``rl-replay-evaluate``: evaluate a run's checkpoint; returns the exit code."""
    prog = "rl-replay-evaluate" if argv is None and not sys.argv[0].endswith(".py") else "python scripts/evaluate.py"
    parser = argparse.ArgumentParser(
        prog=prog if prog == "rl-replay-evaluate" else None,
        description=EVALUATE_USAGE.format(prog=prog),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("run_dir", help="run directory (with config.yaml and checkpoint.pt)")
    parser.add_argument("--episodes", type=int, default=None, help="default: eval.episodes of the run's config")
    parser.add_argument("--stochastic", action="store_true", help="sample actions instead of the mode")
    parser.add_argument("--seed", type=int, default=12345)
    parser.add_argument(
        "--num-envs",
        type=int,
        default=8,
        help="episodes played side by side (default 8); long episodes evaluate faster with more",
    )
    parser.add_argument(
        "env_overrides",
        nargs="*",
        metavar="env.kwargs.KEY=VALUE",
        help="evaluate on a changed environment: env.kwargs.* or env.max_episode_steps "
        "(the agent's architecture comes from the run and cannot change)",
    )
    parser.add_argument("--video", default=None, metavar="DIR", help="record videos into DIR")
    parser.add_argument(
        "--wandb",
        action="store_true",
        help="log the result (and video) to the training run's wandb project, as an eval run "
        "in its group (mode: WANDB_MODE, else the run's log.wandb_mode)",
    )
    parser.add_argument(
        "--trust-config",
        action="store_true",
        help="let the run's config.yaml import the modules it names even if it was not written by this "
        "user (importing a module runs it: only for runs whose author you trust)",
    )
    args = parser.parse_intermixed_args(argv)
    if args.episodes is not None and args.episodes < 1:
        print(f"error: --episodes must be a positive number of episodes, got {args.episodes}.", file=sys.stderr)
        return 2
    if args.num_envs < 1:
        print(f"error: --num-envs must be a positive number of envs, got {args.num_envs}.", file=sys.stderr)
        return 2
    from rl_replay.errors import shown

    for ov in args.env_overrides:
        key = _override_key(ov)
        if not (key.startswith("env.kwargs.") or key in ("env.kwargs", "env.max_episode_steps")):
            _error(
                f"evaluate accepts only env.kwargs.* and env.max_episode_steps overrides, got {shown(ov)}; "
                "the agent and everything else come from the run's config.yaml."
            )
            return 2

    from rl_replay.errors import EnvStepError, SetupError
    from rl_replay.rundir.door import RunDirectory, Trust

    try:
        with RunDirectory.open(args.run_dir, trust=Trust(config=args.trust_config)) as run:
            return _evaluate(args, run)
    except (SetupError, ValueError, FileNotFoundError, EnvStepError) as exc:
        _error(exc)
        return 2


def _evaluate(args: argparse.Namespace, run) -> int:
    """``evaluate_main`` once the run directory is open: every bad input raises (SetupError...)."""
    from rl_replay.errors import SetupError
    from rl_replay.rollout.env_state import training_statistics
    from rl_replay.run.evaluate import evaluate

    run_config = run.config(args.env_overrides)  # a foreign config's targets are checked here
    cfg, importer = run_config.cfg, run.importer(run_config)
    if cfg.torch_threads is not None:
        # As in training: a small policy on an oversubscribed thread pool is many times slower.
        import torch

        torch.set_num_threads(cfg.torch_threads)
    state = run.checkpoint("evaluation")  # numbers only: runs nothing from the file
    ckpt = run.path / "checkpoint.pt"
    agent = run.agent(run_config, state)  # built through the config's importer, weights finite and fitting
    if args.wandb:
        from rl_replay.run.logger import wandb_preflight

        wandb_preflight(cfg.log.wandb_mode)  # fail before evaluating, not after
        run.dir.check_directory("wandb", "wandb directory")  # wandb writes there: not through a link
    collectors = state.get("collector")
    env_statistics = None
    if isinstance(collectors, list) and all(isinstance(c, dict) for c in collectors):
        try:  # NormalizeObservation's scale, as in training
            env_statistics = training_statistics(collectors)
        except (ValueError, KeyError, TypeError, IndexError) as exc:
            raise SetupError(
                f"checkpoint {ckpt} holds wrapper statistics that cannot be used ({type(exc).__name__}: "
                f"{str(exc)[:160]}); evaluate a checkpoint of this run's own environments."
            ) from None
    if args.video and cfg.env.vectorization == "envpool":
        raise SetupError(
            "--video records a gymnasium env, which would not have the EnvPool preprocessing this run was "
            "trained on (env.vectorization=envpool); evaluate without --video."
        )
    if args.video:
        try:
            import moviepy  # noqa: F401
        except ImportError:
            raise SetupError("--video needs the optional video dependency: pip install -e '.[video]'") from None
    result = evaluate(
        agent,
        cfg.env.id,
        episodes=args.episodes or cfg.eval.episodes,
        num_envs=args.num_envs,
        deterministic=cfg.eval.deterministic and not args.stochastic,
        seed=args.seed,
        env_kwargs=cfg.env.kwargs,
        max_episode_steps=cfg.env.max_episode_steps,
        video_dir=args.video,
        env_imports=cfg.env.imports,
        env_wrappers=cfg.env.wrappers,
        env_statistics=env_statistics,
        env_observation_keys=cfg.env.observation_keys,
        vectorization=cfg.env.vectorization,
        importer=importer,
    )
    print(
        f"return {result['return_mean']:.2f} +- {result['return_std']:.2f} over "
        f"{int(result['episodes'])} episodes (checkpoint update {state['update']}, "
        f"{state['env_steps']} env steps)"
    )
    print(json.dumps(result))
    if args.wandb:
        from rl_replay.run.evaluate import log_evaluation

        mode = log_evaluation(
            run.path,
            cfg,
            result,
            checkpoint=state,
            video_dir=args.video,
            deterministic=cfg.eval.deterministic and not args.stochastic,
            seed=args.seed,
        )
        print(f"wandb: evaluation logged ({mode}) to project {cfg.log.wandb_project}", file=sys.stderr)
    return 0


def convert_main(argv: list[str] | None = None) -> int:
    """``scripts/convert_checkpoint.py``: rewrite a legacy (pickled) checkpoint in the current format."""
    parser = argparse.ArgumentParser(
        description="Convert a checkpoint written before format 2 (a pickle) into format 2 (numbers that run no "
        "code when loaded, plus env_state.pkl signed with your key). Loading the old file unpickles "
        "it, which runs any code it names: do it only for files you trust, and say so with --trust."
    )
    parser.add_argument("path", help="a run directory (its checkpoint.pt) or a checkpoint file")
    parser.add_argument("--trust", action="store_true", help="I trust where this file came from; unpickle it")
    args = parser.parse_args(argv)

    from rl_replay.errors import SetupError
    from rl_replay.rundir import trust
    from rl_replay.rundir.door import convert_run

    try:
        path, kept = convert_run(args.path, trust_file=args.trust, key=trust.user_secret())
    except (SetupError, FileNotFoundError) as exc:
        _error(exc)
        return 2
    if kept is None:
        print(f"{path} is already in the current format; nothing to do.")
    else:
        print(f"converted {path} (the original is kept as {kept}).")
    return 0
