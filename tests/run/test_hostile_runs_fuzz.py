"""Byte-level mutations of a real run's files, run through the three commands that load a run.

Hypothesis flips, inserts, deletes and truncates bytes of ``checkpoint.pt``, ``env_state.pkl``,
``config.yaml`` or ``metrics.jsonl`` of a finished run, and for the two headed files also
"reseals" the mutated payload (sha256 and size recomputed, as anyone who edits a file can), so
that the parsers behind the checksum are reached. Then ``evaluate.py RUN``, ``train.py
init_from=RUN`` and ``train.py --resume RUN`` run in process, under an address-space limit a few
GiB above what the process maps and within a per-example deadline. Each must finish with exit
code 0 or a single ``error:`` line (never a traceback, never a control character), and nothing
outside the run directory (and the warm start's own new run) may appear or change.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import os
import shutil
import tempfile
import warnings
from datetime import timedelta
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_hostile_runs import BATCH, TINY, address_space_limit, copy_run, files_of

from rl_replay.run.cli import evaluate_main, train_main

FILES = ("checkpoint.pt", "env_state.pkl", "config.yaml", "metrics.jsonl")

MUTATION = st.one_of(
    st.tuples(st.just("flip"), st.integers(0, 1 << 30), st.integers(1, 255)),
    st.tuples(st.just("insert"), st.integers(0, 1 << 30), st.binary(min_size=1, max_size=16)),
    st.tuples(st.just("delete"), st.integers(0, 1 << 30), st.integers(1, 64)),
    st.tuples(st.just("truncate"), st.integers(0, 1 << 30)),
)


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("fuzzed") / "run"
    assert train_main([*TINY, f"total_env_steps={2 * BATCH}", "checkpoint.every=1", f"run_dir={run_dir}"]) == 0
    return run_dir


def mutate(data: bytes, mutations) -> bytes:
    out = bytearray(data)
    for kind, at, *arg in mutations:
        at = at % (len(out) + 1)
        if kind == "flip" and out:
            out[min(at, len(out) - 1)] ^= arg[0]
        elif kind == "insert":
            out[at:at] = arg[0]
        elif kind == "delete":
            del out[at : at + arg[0]]
        elif kind == "truncate":
            del out[at:]
    return bytes(out)


def damage(path: Path, mutations, reseal: bool) -> None:
    data = path.read_bytes()
    if reseal and path.suffix in (".pt", ".pkl"):
        line, _, payload = data.partition(b"\n")
        payload = mutate(payload, mutations)
        fields = [f for f in line.split(b" ") if not f.startswith((b"sha256=", b"size="))]
        fields.insert(2, f"sha256={hashlib.sha256(payload).hexdigest()} size={len(payload)}".encode())
        path.write_bytes(b" ".join(fields) + b"\n" + payload)
    else:
        path.write_bytes(mutate(data, mutations))


def check(code: int, err: str, what: str) -> None:
    errors = [line for line in err.splitlines() if line.startswith("error: ")]
    assert "Traceback" not in err, (what, err)
    if code:
        assert code in (1, 2) and len(errors) == 1, (what, code, err)
        assert not any(ord(c) < 32 for c in errors[0]), (what, errors[0])


@contextlib.contextmanager
def sandbox(run: Path):
    """``(home, victim)``: a copy of ``run`` in a fresh folder beside the user's file ``keep.txt``,
    the folder the current directory (a relative write would land there) and wandb disabled (a
    config cut short falls back to log.wandb_mode: offline); all put back and removed afterwards."""
    home = Path(tempfile.mkdtemp(prefix="fuzz_"))
    cwd, wandb_mode = os.getcwd(), os.environ.get("WANDB_MODE")
    os.environ["WANDB_MODE"] = "disabled"
    try:
        victim = copy_run(run, home / "victim")
        (home / "keep.txt").write_text("the user's file")
        os.chdir(home)
        yield home, victim
    finally:
        os.chdir(cwd)
        if wandb_mode is None:
            del os.environ["WANDB_MODE"]
        else:
            os.environ["WANDB_MODE"] = wandb_mode
        shutil.rmtree(home, ignore_errors=True)


def quietly(command) -> tuple[int, str]:
    """``(exit code, stderr)`` of ``command()`` run under the address-space limit, its output captured."""
    out, err = io.StringIO(), io.StringIO()
    with (
        address_space_limit(),
        warnings.catch_warnings(),
        contextlib.redirect_stdout(out),
        contextlib.redirect_stderr(err),
    ):
        warnings.simplefilter("ignore")
        code = command()
    return code, err.getvalue()


def commands(home: Path, victim: Path, *resume_overrides: str) -> dict:
    """The three commands that load a run, as a user would run them."""
    return {
        "evaluate": lambda: evaluate_main([str(victim), "--episodes", "1", "--num-envs", "1"]),
        "init_from": lambda: train_main(
            [*TINY, f"total_env_steps={BATCH}", f"init_from={victim}", f"run_dir={home / 'warm'}"]
        ),
        "resume": lambda: train_main(["--resume", str(victim), *resume_overrides]),
    }


def check_nothing_outside(home: Path) -> None:
    assert sorted(p.name for p in home.iterdir()) in (["keep.txt", "victim"], ["keep.txt", "victim", "warm"])
    assert (home / "keep.txt").read_text() == "the user's file"
    assert all(not p.is_symlink() for p in home.rglob("*"))


@pytest.mark.parametrize("name", FILES)
@settings(
    max_examples=15,
    deadline=timedelta(seconds=90),
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.too_slow],
)
@given(mutations=st.lists(MUTATION, min_size=1, max_size=3), reseal=st.booleans())
def test_mutated_run_files_never_give_a_traceback_a_write_outside_or_unbounded_memory(run, name, mutations, reseal):
    with sandbox(run) as (home, victim):
        for fallback in ("checkpoint.prev.pt", "env_state.prev.pkl"):  # the damaged file is the one read
            (victim / fallback).unlink()
        damage(victim / name, mutations, reseal)
        for what, command in commands(home, victim).items():
            code, err = quietly(command)
            check(code, err, what)
        check_nothing_outside(home)
        assert set(files_of(victim)) <= set(files_of(run)) | {".lock", "wandb_logged.json"}


# ------------------------------------------------------------------------- hostile config values
#: Real keys of a run's config.yaml, and values an attacker would try in them.
KEYS = (
    "seed",
    "torch_threads",
    "env.num_envs",
    "env.max_episode_steps",
    "env.kwargs",
    "env.wrappers",
    "env.observation_keys",
    "collector.num_steps",
    "collector.bptt_truncate",
    "agent.kwargs",
    "agent.kwargs.hidden_sizes",
    "optim.lr",
    "optim.max_grad_norm",
    "loss.gamma",
    "ppo.epochs",
    "replay.block_steps",
    "eval.episodes",
    "log.log_every",
)


def _nested(depth: int):
    value: object = 1
    for _ in range(depth):
        value = [value]
    return value


HOSTILE = st.one_of(
    st.integers(-(2**70), -1),
    st.integers(-8, -1),
    st.lists(st.integers(-8, -1), min_size=1, max_size=2),
    st.just(0),
    st.integers(10**9, 2**70),
    st.sampled_from([float("nan"), float("inf"), -float("inf"), 1e300, -1e-300]),
    st.text(max_size=20),
    st.lists(st.integers(-(2**40), 2**40), max_size=4),
    st.dictionaries(st.text(max_size=8), st.integers(-5, 5), max_size=3),
    st.integers(10, 200).map(_nested),
    st.none(),
    st.booleans(),
)


def _set(data: dict, dotted: str, value: object) -> None:
    *head, last = dotted.split(".")
    for part in head:
        if not isinstance(data.get(part), dict):
            data[part] = {}
        data = data[part]
    data[last] = value


@settings(
    max_examples=int(os.environ.get("RL_REPLAY_FUZZ_EXAMPLES", "60")),
    deadline=timedelta(seconds=120),
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)
@given(key=st.sampled_from(KEYS), value=HOSTILE)
def test_hostile_config_values_give_exit_0_or_one_line_and_change_nothing_outside(run, key, value):
    import yaml

    with sandbox(run) as (home, victim):
        data = yaml.safe_load((victim / "config.yaml").read_text().partition("\n")[2])
        _set(data, key, value)
        (victim / "config.yaml").write_text(yaml.safe_dump(data, sort_keys=False))  # a foreign config now
        # (the budget pinned: a resume that is accepted trains one update, not for ever)
        for what, command in commands(home, victim, f"total_env_steps={3 * BATCH}").items():
            before = files_of(victim)
            code, err = quietly(command)
            check(code, err, f"{what} with {key}={value!r:.80}")
            if what == "resume" and code:
                assert files_of(victim) == before, (key, value)  # a refused resume changes nothing
        check_nothing_outside(home)
