"""The benchmark scripts' ``--smoke`` modes run, agree on gradients and print their numbers.

No timing assertions: these only check that the scripts work end to end (each
configuration in its own process, gradient check against plain autograd below 1e-4).
"""

from __future__ import annotations

import importlib.util
import json
import math
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
GRAD_LINE = re.compile(r"gradient check: worst abs diff (\S+), worst rel diff (\S+)")


def run_script(name: str, *args: str, timeout: float = 600) -> str:
    env = dict(os.environ, PYTHONUNBUFFERED="1", MPLBACKEND="Agg")
    proc = subprocess.run(
        [sys.executable, "-m", "scripts.bench", name, *args],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, f"{name} {' '.join(args)} exited {proc.returncode}:\n{out[-6000:]}"
    return out


def assert_grad_line(out: str) -> None:
    m = GRAD_LINE.search(out)
    assert m, f"no gradient-check line in:\n{out[-4000:]}"
    worst_abs, worst_rel = float(m.group(1).rstrip(",")), float(m.group(2))
    assert worst_abs < 1e-4 and worst_rel < 1e-4, m.group(0)


@pytest.mark.slow
def test_bench_memory_smoke():
    out = run_script("memory", "--smoke")
    assert_grad_line(out)
    # every method ran for both tiny policies, none skipped or failed
    for policy in ("tiny_gru", "tiny_mlp"):
        for method in ("plain", "checkpoint", "checkpoint_cpu", "rl_replay"):
            assert re.search(rf"{policy}\s+T=8\s+{method}\s+live", out), (policy, method, out[-4000:])
    assert "ERROR" not in out
    assert "summary tiny_gru:" in out and "summary tiny_mlp:" in out
    assert "glibc" in out


@pytest.mark.slow
def test_bench_memory_worker_mode_prints_json():
    from_cfg = {"kind": "mlp", "obs": 4, "width": 8, "layers": 2, "actions": 3, "batch": 2}
    spec = dict(
        policy="tiny_mlp", cfg=from_cfg, T=4, method="rl_replay", reps=1, threads=1, device="cpu", seed=0, budget_s=60
    )
    out = run_script("memory", "--worker", json.dumps(spec))
    line = next(x for x in out.splitlines() if x.startswith("BENCH_RESULT "))
    result = json.loads(line[len("BENCH_RESULT ") :])
    assert result["mode"] == "full"
    assert result["live_bytes"] > 0 and result["block_input_bytes"] == 4 * 2 * 4 * 4


@pytest.mark.slow
def test_bench_ppo_smoke():
    out = run_script("ppo", "--smoke")
    assert_grad_line(out)
    for T in (8, 16):
        for method in ("plain", "rl_replay"):
            assert re.search(rf"T={T}\s+{method}\s+peak RSS growth", out), (T, method, out[-4000:])
    assert "ERROR" not in out
    assert "summary T=16: time rl_replay/plain" in out and "summary memory slope rl_replay" in out


@pytest.mark.slow
def test_bench_ppo_with_a_shipped_config():
    # The delay-1024 config's LRU agent, 32 envs, 2 minibatches; T short for speed.
    out = run_script("ppo", "--config", "configs/memory_1024_fast.yaml", "--T", "8", "16", "--epochs", "1")
    assert_grad_line(out)
    for T in (8, 16):
        for method in ("plain", "rl_replay"):
            assert re.search(rf"T={T}\s+{method}\s+peak RSS growth", out), (T, method, out[-4000:])
    assert "ERROR" not in out and "summary T=16: time rl_replay/plain" in out


def docs_bytes() -> dict[str, bytes]:
    """The committed docs/ files a benchmark could write (the markdown and its plots)."""
    return {p.name: p.read_bytes() for p in sorted((ROOT / "docs").iterdir()) if p.is_file()}


@pytest.mark.slow
def test_plain_runs_leave_the_committed_docs_alone(tmp_path):
    """Without --write-docs a (non-smoke) run prints its tables and writes nothing into docs/."""
    before = docs_bytes()
    out = run_script("memory", "--policy", "tiny_gru", "--T", "8", "--methods", "plain", "rl_replay", "--reps", "0")
    assert "| 8 | rl_replay |" in out and "updated section" not in out
    assert docs_bytes() == before


@pytest.mark.slow
def test_write_docs_updates_only_its_marked_section(tmp_path):
    docs = tmp_path / "bench.md"
    docs.write_text("intro\n\n<!-- BEGIN bench_memory tiny_gru -->\nold\n<!-- END bench_memory tiny_gru -->\n\nafter\n")
    before = docs_bytes()
    out = run_script(
        "memory",
        "--policy",
        "tiny_gru",
        "--T",
        "8",
        "--methods",
        "plain",
        "rl_replay",
        "--reps",
        "0",
        "--write-docs",
        str(docs),
    )
    assert f"updated section 'bench_memory tiny_gru' of {docs}" in out
    text = docs.read_text()
    assert text.startswith("intro\n\n<!-- BEGIN bench_memory tiny_gru -->\n**tiny_gru**") and "old" not in text
    assert text.endswith("<!-- END bench_memory tiny_gru -->\n\nafter\n")
    assert "| 8 | rl_replay |" in text and "summary tiny_gru:" in text
    assert docs_bytes() == before


def test_smoke_results_are_never_written_to_the_docs():
    proc = subprocess.run(
        [sys.executable, "-m", "scripts.bench", "memory", "--smoke", "--write-docs"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2 and "drop --write-docs" in proc.stderr


@pytest.mark.parametrize("config", ["configs/memory_gru.yaml", "configs/default.yaml"])  # GRU; stateless MLP
def test_bench_overhead_rows_hold_identical_gradients(config):
    # one-step blocks (rl_replay.replay) and 3-step blocks (one call per block), each against plain autograd
    out = run_script(
        "overhead",
        "--config",
        config,
        "--T",
        "7",
        "--batch",
        "2",
        "--repeats",
        "1",
        "--block-steps",
        "1",
        "3",
        "--json",
    )
    rows = json.loads(out[out.index("[") :])
    assert [r["block_steps"] for r in rows] == [1, 3] and all(r["identical_grads"] for r in rows)
    assert all(r["replay_ms_per_step"] > 0 and math.isfinite(r["overhead_ms_per_block"]) for r in rows)
    assert rows[1]["sequence"] and rows[1]["plain_steps_ms_per_step"] > 0


def test_bench_ppo_pixels_refuses_cuda_without_a_gpu_and_other_workloads_options(capsys):
    """``scripts/bench/ppo.py --pixels``' refusals (argparse's, before anything runs: in this process). Its
    --smoke run (the CNN + GRU update on uint8 frames both ways, gradients against plain autograd, the
    summary lines) is checked in test_gpu_check.py's dry run, which runs it as one of the GPU
    validation's steps."""
    import torch

    from scripts.bench import ppo

    refusals = [
        (["--pixels", "--smoke", "--config", "configs/memory_4096.yaml"], "takes no --config"),
        (["--smoke", "--device", "cuda"], "--device applies to --pixels"),
    ]
    if not torch.cuda.is_available():
        refusals.append((["--pixels", "--smoke", "--device", "cuda"], "no CUDA device here"))
    for argv, message in refusals:
        with pytest.raises(SystemExit) as exit_:
            ppo.main(argv)
        assert exit_.value.code == 2 and message in capsys.readouterr().err, argv


def test_bench_cores_smoke():
    """The fused cores against their step loop: a table row per core, gradients within float rounding."""
    out = run_script("cores", "--smoke")
    rows = [line for line in out.splitlines() if line.startswith(("| gru |", "| lstm |"))]
    assert len(rows) == 2, out
    for row in rows:
        assert float(row.rstrip(" |").rsplit("|", 1)[1]) < 1e-4, row


@pytest.mark.slow
def test_bench_torchrl_smoke():
    """The peer benchmark's rl_replay sides (and TorchRL's where installed): the GRU row, each side's
    gradients within float rounding of plain autograd (episode starts inside the rows). The LSTM row
    is run and checked by tests/scripts/test_gpu_check.py's dry run (one run serves both)."""
    out = run_script("torchrl", "--smoke", "--kinds", "gru")
    checks = re.findall(r"^(gru|lstm): largest relative gradient difference .*?: (.*)$", out, re.M)
    assert [kind for kind, _ in checks] == ["gru"], out
    for _, line in checks:
        sides = dict(part.split() for part in line.split(", "))
        assert {"rl_replay", "steps"} <= set(sides), line
        assert all(float(d) < 1e-4 for d in sides.values()), line
        assert ("torchrl" in sides) == (importlib.util.find_spec("torchrl") is not None), line
    rows = [line for line in out.splitlines() if line.startswith("| gru | 66 |")]
    assert len(rows) == 1, out


@pytest.mark.slow
def test_bench_sharded_smoke():
    """The sharded memory transformer's update on 2 real gloo ranks (torch.distributed.run), both methods."""
    out = run_script("sharded", "--smoke")
    for method in ("rl_replay", "plain"):
        row = re.search(rf"^\| 18 \| {method} \| (.*) \| (.*) \| (.*) \| (.*) \|$", out, re.M)
        assert row, out
        assert all(re.match(r"[\d.]+ [KMG]?i?B, [\d.]+ s", cell) for cell in row.groups()[:2]), row.group(0)
    # rl_replay's row: the block inputs saved and FSDP's all-gathers (FULL_SHARD: some per block)
    gathers = re.search(r"^\| 18 \| rl_replay \| .* \| [\d.]+ KiB \| (\d+) \|$", out, re.M)
    assert gathers and int(gathers.group(1)) > 0, out


def test_bench_collect_sharded_smoke():
    """Collection on 2 real gloo ranks (gathered once per rollout) against one process; the per-step
    setting is the same launch with distributed.collect_gathered=false (its runs: test_distributed_train.py)."""
    out = run_script("collect_sharded", "--smoke")
    rows = dict(re.findall(r"^\| ([\w ,]+) \| ([\d.]+) \| [\d.]+ \| [\d.]+ \| [\d.]+x \| [\d.]+ \|$", out, re.M))
    assert set(rows) == {"one process", "2 ranks, gathered"}, out
    assert all(float(seconds) > 0 for seconds in rows.values()), out
