"""Run directories left by an attacker: nothing they name is imported, nothing outside them is
written, nothing in them hangs a command or exhausts its memory, and every refusal is one line.

Each test plants one kind of hostile file in a copy of a real run of this user's and runs the
command a user would (``evaluate.py RUN``, ``train.py init_from=RUN``, ``train.py --resume
RUN``), in process, as the scripts do. A marker file proves that code did not run, a file
outside the run is compared before and after, a FIFO is opened for writing by a watchdog if a
command blocks on it (and the test then fails), and the memory cases run under an address-space
limit a few GiB above what the process already maps.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import resource
import threading
from pathlib import Path

import psutil
import pytest
import torch
from _checkpoint_files import write_format2
from _runs import BATCH
from _runs import TINY_CONSTANT_LR as TINY

from rl_replay.config import dump_config, load_config
from rl_replay.run.cli import evaluate_main, train_main
from rl_replay.rundir import safe_tree, trust
from rl_replay.rundir.checkpoint import checkpoint_path, load_checkpoint
from rl_replay.rundir.env_state_file import ENV_STATE_NAME

PLANT = "rl_replay_hostile_plant"  # a module planted in the run directory: importing it leaves a marker


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """A finished 2-update run of this user's (checkpoint, env state, signed config, metrics)."""
    run_dir = tmp_path_factory.mktemp("hostile") / "run"
    assert train_main([*TINY, f"total_env_steps={2 * BATCH}", "checkpoint.every=1", f"run_dir={run_dir}"]) == 0
    return run_dir


def files_of(directory: Path) -> dict[str, bytes]:
    """Every regular file under ``directory`` (the lock included) by relative path."""
    return {
        str(p.relative_to(directory)): p.read_bytes()
        for p in sorted(directory.rglob("*"))
        if p.is_file() and not p.is_symlink()
    }


def copy_run(src: Path, dst: Path) -> Path:
    dst.mkdir(parents=True)
    for name, data in files_of(src).items():
        (dst / name).parent.mkdir(parents=True, exist_ok=True)
        (dst / name).write_bytes(data)
    return dst


def error_line(capsys) -> str:
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.startswith("error: ")]
    assert len(lines) == 1, err
    return lines[0]


def resume(run_dir: Path, *args: str) -> int:
    return train_main(["--resume", str(run_dir), *args])


def warm_start(source: Path, new: Path) -> int:
    return train_main([*TINY, f"total_env_steps={BATCH}", f"init_from={source}", f"run_dir={new}"])


def write_foreign_config(run_dir: Path, *overrides: str) -> None:
    """The run's config with ``overrides``, written unsigned (as another user's tool would)."""
    (run_dir / "config.yaml").write_text(dump_config(load_config(run_dir / "config.yaml", overrides)))


def plant_module(directory: Path, marker: Path) -> None:
    (directory / f"{PLANT}.py").write_text(f"open({str(marker)!r}, 'w').close()\nclass W: pass\n")


@contextlib.contextmanager
def address_space_limit(extra: int = 3 << 30):
    """``RLIMIT_AS`` at what this process maps now plus ``extra`` bytes, restored afterwards."""
    soft, hard = resource.getrlimit(resource.RLIMIT_AS)
    limit = psutil.Process().memory_info().vms + extra
    resource.setrlimit(resource.RLIMIT_AS, (limit if hard == resource.RLIM_INFINITY else min(limit, hard), hard))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_AS, (soft, hard))


@contextlib.contextmanager
def fifo_watchdog(fifo: Path, seconds: float = 30.0):
    """Fail the test if something is still blocked reading ``fifo`` after ``seconds``: the
    watchdog then opens it for writing, which lets a blocked reader go on (and the test fail)."""
    done, fired = threading.Event(), []

    def watch():
        if not done.wait(seconds):
            fired.append(True)
            with contextlib.suppress(OSError):
                os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))

    thread = threading.Thread(target=watch, daemon=True)
    thread.start()
    try:
        yield
    finally:
        done.set()
        thread.join()
        assert not fired, f"a command blocked on the FIFO {fifo}"


def reseal(path: Path, payload: bytes, magic: bytes = b"RLREPLAY-CHECKPOINT 2 ") -> None:
    """A headed file around ``payload`` with its sha256 and size recomputed (what an attacker can do)."""
    path.write_bytes(magic + f"sha256={hashlib.sha256(payload).hexdigest()} size={len(payload)}\n".encode() + payload)


# ---------------------------------------------------------------- a foreign config imports nothing
@pytest.mark.parametrize(
    "override, key",
    [
        (f"agent.target={PLANT}:W", "agent.target"),
        (f"env.wrappers=[{{target: '{PLANT}:W'}}]", r"env\.wrappers\[0\]\.target"),
        (f"env.imports=[{PLANT}]", r"env\.imports\[0\]"),
        (f"env.id={PLANT}:CartPole-v1", "env.id"),
        ("env.imports=[this]", r"env\.imports\[0\]"),  # a standard-library module that acts when imported
        ("agent.target=__main__:Agent", "agent.target"),
    ],
)
def test_a_foreign_config_imports_nothing_outside_rl_replay_and_gymnasium(
    run, tmp_path, monkeypatch, capsys, override, key
):
    victim = copy_run(run, tmp_path / "victim")
    marker = tmp_path / "pwned"
    plant_module(victim, marker)
    monkeypatch.syspath_prepend(str(victim))  # the planted module is importable: only the rule keeps it out
    monkeypatch.chdir(victim)
    write_foreign_config(victim, override)
    module = re.search(r"(rl_replay_hostile_plant|this|__main__)", override).group(1)
    refusal = rf"error: {key} .*names module '{module}', which is not part of rl_replay or gymnasium; .*--trust-config$"
    before = files_of(victim)

    assert evaluate_main([str(victim), "--episodes", "1"]) == 2
    line = error_line(capsys)
    assert re.fullmatch(refusal, line) and "is not this user's (it carries no signature" in line, line
    assert resume(victim) == 2
    assert re.fullmatch(refusal, error_line(capsys))
    assert capsys.readouterr().out == ""  # `this` prints the Zen of Python when it is imported
    assert not marker.exists() and files_of(victim) == before


def test_the_trust_flag_imports_what_a_foreign_config_names(run, tmp_path, monkeypatch, capsys):
    victim = copy_run(run, tmp_path / "victim")
    marker = tmp_path / "pwned"
    plant_module(victim, marker)
    monkeypatch.syspath_prepend(str(victim))
    write_foreign_config(victim, f"env.imports=[{PLANT}]")
    assert evaluate_main([str(victim), "--episodes", "1", "--trust-config"]) == 0
    assert marker.exists()  # trusted: the module named was imported
    assert resume(victim, "--trust-config", f"total_env_steps={3 * BATCH}") == 0
    assert evaluate_main([str(victim), "--episodes", "1"]) == 0  # the resume signed the config as this user's


def test_an_own_config_edited_or_signed_by_another_key_is_foreign(run, tmp_path, monkeypatch, capsys):
    victim = copy_run(run, tmp_path / "victim")
    text = (victim / "config.yaml").read_text()
    assert text.startswith("# rl_replay config signature: key=")
    (victim / "config.yaml").write_text(text.replace("imports: []", f"imports: [{PLANT}]"))
    assert evaluate_main([str(victim), "--episodes", "1"]) == 2
    assert "(it was changed after it was written)" in error_line(capsys)
    monkeypatch.setenv("RL_REPLAY_CONFIG_DIR", str(tmp_path / "other_user"))
    (victim / "config.yaml").write_text(text)
    trust.user_secret()
    write_foreign_config(victim)  # unsigned: only shipped names, which this config uses
    assert evaluate_main([str(victim), "--episodes", "1"]) == 0


def test_a_foreign_config_may_not_name_a_wrapper_that_writes_files(run, tmp_path, capsys):
    victim = copy_run(run, tmp_path / "victim")
    outside = tmp_path / "outside"
    write_foreign_config(
        victim, f"env.wrappers=[{{target: 'gymnasium.wrappers:RecordVideo', kwargs: {{video_folder: '{outside}'}}}}]"
    )
    assert evaluate_main([str(victim), "--episodes", "1"]) == 2
    assert "writes files or opens windows where its kwargs say" in error_line(capsys)
    assert not outside.exists()


# --------------------------------------------------------------- nothing outside the run is written
def test_a_symlinked_or_hard_linked_lock_is_refused_and_its_target_unchanged(run, tmp_path, capsys):
    for link in (os.symlink, os.link):
        victim = copy_run(run, tmp_path / f"victim_{link.__name__}")
        outside = tmp_path / f"bashrc_{link.__name__}"
        outside.write_text("export PATH=$PATH:~/bin\n")
        (victim / ".lock").unlink()
        link(outside, victim / ".lock")
        before = files_of(victim)
        assert resume(victim) == 2
        line = error_line(capsys)
        kind = "is a symbolic link" if link is os.symlink else "has 2 hard links"
        assert f"lock file {victim / '.lock'} {kind}" in line, line
        assert outside.read_text() == "export PATH=$PATH:~/bin\n" and files_of(victim) == before


@pytest.mark.parametrize("existing", [False, True])
def test_a_symlinked_metrics_file_is_neither_created_nor_read_nor_appended(run, tmp_path, capsys, existing):
    victim = copy_run(run, tmp_path / "victim")
    outside = tmp_path / "elsewhere.jsonl"
    if existing:
        outside.write_text('{"update": 99, "env_steps": 1}\n')
    (victim / "metrics.jsonl").unlink()
    (victim / "metrics.jsonl").symlink_to(outside)
    assert resume(victim, f"total_env_steps={3 * BATCH}") == 2
    assert f"metrics file {victim / 'metrics.jsonl'} is a symbolic link" in error_line(capsys)
    assert outside.exists() == existing and (not existing or outside.read_text() == '{"update": 99, "env_steps": 1}\n')


@pytest.mark.parametrize("name", ["checkpoint.pt", "config.yaml", "env_state.pkl"])
def test_a_symlink_in_place_of_a_run_file_is_one_line_naming_it(run, tmp_path, capsys, name):
    victim = copy_run(run, tmp_path / "victim")
    (tmp_path / "real").write_bytes((victim / name).read_bytes())
    (victim / name).unlink()
    (victim / name).symlink_to(tmp_path / "real")
    assert resume(victim) == 2
    assert f"{victim / name} is a symbolic link, not a regular file" in error_line(capsys)
    if name != "env_state.pkl":  # evaluation does not read the env state
        assert evaluate_main([str(victim), "--episodes", "1"]) == 2
        assert f"{victim / name} is a symbolic link" in error_line(capsys)


def test_a_wandb_directory_linked_elsewhere_is_refused(run, tmp_path, capsys, monkeypatch):
    victim = copy_run(run, tmp_path / "victim")
    (tmp_path / "elsewhere").mkdir()
    (victim / "wandb").symlink_to(tmp_path / "elsewhere")
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    assert resume(victim, f"total_env_steps={3 * BATCH}") == 2
    assert f"wandb directory {victim / 'wandb'} is a symbolic link" in error_line(capsys)
    assert list((tmp_path / "elsewhere").iterdir()) == []


# ------------------------------------------------------------------- nothing hangs or blows up
@pytest.mark.parametrize("name", ["env_state.pkl", "checkpoint.pt", "metrics.jsonl", "config.yaml"])
def test_a_fifo_in_place_of_a_run_file_hangs_nothing(run, tmp_path, capsys, name):
    victim = copy_run(run, tmp_path / "victim")
    (victim / name).unlink()
    os.mkfifo(victim / name)
    with fifo_watchdog(victim / name):
        assert resume(victim) == 2
    assert f"{victim / name} is a FIFO (named pipe), not a regular file" in error_line(capsys)
    if name in ("checkpoint.pt", "config.yaml"):
        with fifo_watchdog(victim / name):
            assert evaluate_main([str(victim), "--episodes", "1"]) == 2
        assert "is a FIFO" in error_line(capsys)


def test_a_checkpoint_padded_by_a_sparse_hole_is_refused_before_it_is_read(run, tmp_path, capsys):
    victim = copy_run(run, tmp_path / "victim")
    (victim / "checkpoint.prev.pt").unlink()
    with open(checkpoint_path(victim), "r+b") as f:
        f.truncate(16 << 30)  # 16 GiB that cost nothing on disk
    with address_space_limit():
        assert evaluate_main([str(victim), "--episodes", "1"]) == 2
        assert "is truncated or padded" in error_line(capsys)
        assert warm_start(victim, tmp_path / "warm") == 2
        assert "is truncated or padded" in error_line(capsys)


def test_a_checkpoint_declaring_more_than_memory_is_refused(run, tmp_path, capsys):
    victim = copy_run(run, tmp_path / "victim")
    (victim / "checkpoint.prev.pt").unlink()
    size = 16 << 30
    header = f"RLREPLAY-CHECKPOINT 2 sha256={'0' * 64} size={size}\n".encode()
    with open(checkpoint_path(victim), "wb") as f:
        f.write(header)
        f.truncate(len(header) + size)
    with address_space_limit():
        assert evaluate_main([str(victim), "--episodes", "1"]) == 2
    assert f"declares {size} bytes, more than this process can hold" in error_line(capsys)


def test_a_dtype_declaring_a_huge_array_is_refused(run, tmp_path, capsys):
    victim = copy_run(run, tmp_path / "victim")
    (victim / "checkpoint.prev.pt").unlink()
    state = load_checkpoint(victim)
    payload = safe_tree.dumps({**state, "bomb": torch.zeros(8, dtype=torch.float64)})
    meta_len = int.from_bytes(payload[:8], "little")
    header = json.loads(payload[8 : 8 + meta_len])
    tree = json.loads(header["__metadata__"][safe_tree.TREE_KEY])
    tree["bomb"] = {"$np": tree["bomb"]["$t"], "dtype": "(2000000000,)f8", "scalar": False}  # 64 bytes as 16 GB
    header["__metadata__"][safe_tree.TREE_KEY] = json.dumps(tree)
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    reseal(checkpoint_path(victim), len(text).to_bytes(8, "little") + text + payload[8 + meta_len :])
    with address_space_limit():
        assert evaluate_main([str(victim), "--episodes", "1"]) == 2
    assert "is not a plain numeric or bool dtype" in error_line(capsys)


def test_a_yaml_alias_bomb_is_refused_when_parsed(run, tmp_path, capsys):
    victim = copy_run(run, tmp_path / "victim")
    lines = ["a0: &a0 [x, x, x, x, x, x, x, x, x]"]
    lines += [f"a{i}: &a{i} [{', '.join([f'*a{i - 1}'] * 9)}]" for i in range(1, 10)]
    text = (
        (victim / "config.yaml")
        .read_text()
        .replace("  kwargs: {}\n", "  kwargs:\n" + "".join(f"    {line}\n" for line in lines), 1)
    )
    (victim / "config.yaml").write_text(text)
    assert len(text) < 4096
    with address_space_limit():
        assert evaluate_main([str(victim), "--episodes", "1"]) == 2
    assert "YAML anchors and aliases (&name, *name) are not accepted in a config" in error_line(capsys)


# ------------------------------------------------------------------- one line, not a traceback
def test_a_tree_nested_very_deep_is_one_line(run, tmp_path, capsys):
    victim = copy_run(run, tmp_path / "victim")
    (victim / "checkpoint.prev.pt").unlink()
    from safetensors.torch import save

    deep = "[" * 100_000 + "]" * 100_000
    reseal(checkpoint_path(victim), save({"x": torch.zeros(1)}, metadata={safe_tree.TREE_KEY: deep}))
    assert evaluate_main([str(victim), "--episodes", "1"]) == 2
    assert "its tree nests deeper than 64 levels" in error_line(capsys)
    assert warm_start(victim, tmp_path / "warm") == 2
    assert "nests deeper" in error_line(capsys)


def test_a_non_ascii_mac_is_a_mac_that_does_not_verify(run, tmp_path, capsys):
    victim = copy_run(run, tmp_path / "victim")
    path = victim / ENV_STATE_NAME
    raw = path.read_bytes()
    path.write_bytes(re.sub(rb"hmac-sha256=[0-9a-f]{64}", "hmac-sha256=é".encode() * 1, raw))
    with pytest.warns(UserWarning, match="or changed since"):
        assert resume(victim, f"total_env_steps={3 * BATCH}") == 0


def test_wrapper_statistics_that_do_not_fit_are_one_line_under_evaluate(run, tmp_path, capsys):
    victim = copy_run(run, tmp_path / "victim")
    (victim / "checkpoint.prev.pt").unlink()
    state = load_checkpoint(victim)
    stats = [
        {"wrapper": None, "attr": "obs_rms", "mean": torch.zeros(4).numpy(), "var": torch.ones(4).numpy(), "count": 1.0}
    ]
    for collector in state["collector"]:
        collector["env_statistics"] = [stats, stats]
    write_format2(state, checkpoint_path(victim))
    assert evaluate_main([str(victim), "--episodes", "1"]) == 2
    assert "do not fit the wrappers of the environment as configured" in error_line(capsys)


def test_a_metrics_row_without_update_refuses_the_resume_and_changes_nothing(run, tmp_path, capsys):
    victim = copy_run(run, tmp_path / "victim")
    with open(victim / "metrics.jsonl", "a") as f:
        f.write('{"env_steps": 48}\n')
    before = files_of(victim)
    assert resume(victim) == 2
    assert re.search(r"metrics\.jsonl line 3 is not a metrics row .*\{'env_steps': 48\}", error_line(capsys))
    assert files_of(victim) == before


def test_non_finite_weights_refuse_a_warm_start(run, tmp_path, capsys):
    victim = copy_run(run, tmp_path / "victim")
    (victim / "checkpoint.prev.pt").unlink()
    state = load_checkpoint(victim)
    name = next(iter(state["agent"]))
    state["agent"][name] = torch.full_like(state["agent"][name], float("nan"))
    write_format2(state, checkpoint_path(victim))
    assert warm_start(victim, tmp_path / "warm") == 2
    assert re.fullmatch(
        rf"error: init_from='.*': checkpoint .* holds non-finite agent weights \({re.escape(name)}\): a diverged run.*",
        error_line(capsys),
    )
    assert not (tmp_path / "warm").exists()


@pytest.mark.parametrize(
    "damage",
    [
        lambda s: s["rng"][0].update(torch=torch.zeros(3, dtype=torch.uint8)),
        lambda s: s["rng"][0].update(numpy=("MT19937", [1, 2, 3], 0, 0, 0.0)),
        lambda s: s["rng"][0].update(python=(3, (1, 2), None)),
        lambda s: s.update(rng=["not a table"]),
        lambda s: s.update(wandb_id="../../outside"),
        lambda s: s.update(update="7\x1b[2J"),
        lambda s: s.update(recent_returns=[["x"]]),
    ],
    ids=["torch", "numpy", "python", "table", "wandb_id", "update", "returns"],
)
def test_a_refused_resume_leaves_every_file_of_the_run_byte_identical(run, tmp_path, capsys, damage):
    victim = copy_run(run, tmp_path / "victim")
    (victim / "checkpoint.prev.pt").unlink()
    state = load_checkpoint(victim)
    damage(state)
    write_format2(state, checkpoint_path(victim))
    with open(victim / "metrics.jsonl", "a") as f:  # a row after the checkpoint: a resume would cut it
        f.write('{"update": 3, "env_steps": 48}\n')
    (victim / ".config.yaml.stale.tmp").write_text("left by a kill")  # a resume would remove it
    before = files_of(victim)
    assert resume(victim) == 2
    line = error_line(capsys)
    assert "\x1b" not in line, line
    assert files_of(victim) == before


def test_control_characters_from_a_foreign_env_id_are_escaped(run, tmp_path, capsys):
    victim = copy_run(run, tmp_path / "victim")
    text = (victim / "config.yaml").read_text().replace("id: CartPole-v1", r'id: "Evil\e]0;owned\a\e[2J-v0"')
    (victim / "config.yaml").write_text(text)  # (YAML's escapes: the parsed id holds the control characters)
    assert evaluate_main([str(victim), "--episodes", "1"]) == 2
    line = error_line(capsys)
    assert not any(ord(c) < 32 for c in line) and r"Evil\x1b]0;owned\x07\x1b[2J-v0" in line, line


def test_duplicate_yaml_keys_are_refused_naming_the_key_and_both_lines(tmp_path, capsys):
    path = tmp_path / "twice.yaml"
    path.write_text("optim:\n  lr: 0.1\nseed: 3\noptim:\n  lr: 0.2\n")
    with pytest.raises(ValueError, match=r"key 'optim' is given twice in one mapping \(lines 1 and 4\)"):
        load_config(path)
    path.write_text("env: {id: CartPole-v1, num_envs: 2, num_envs: 4}\n")
    with pytest.raises(ValueError, match=r"key 'num_envs' is given twice .*line 1, columns 24 and 37\)"):
        load_config(path)
    assert train_main(["--config", str(path)]) == 2
    assert "is given twice" in error_line(capsys)
    with pytest.raises(ValueError, match=r"key 'a' is given twice"):
        load_config(None, ["env.kwargs={a: 1, a: 2}"])
