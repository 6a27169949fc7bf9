"""scripts/tools/gpu_check.sh: its --dry-run on this CPU machine, and its wheel installation.

The dry run exercises every step of the GPU validation except CUDA itself: installing
wheels from a folder into a temporary site directory, collecting the CUDA tests,
training runs through scripts/train.py under torchrun (FSDP1 and FSDP2 at one rank, gloo),
bench_ppo --pixels --smoke (its checks live here: one run of it serves both), bench_memory at a
tiny size, and the results file those steps write.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "tools" / "gpu_check.sh"
WHEELS = ROOT / "scripts" / "tools" / "gpu_wheels.py"


def make_wheel(directory: Path, name: str, version: str, body: str = "") -> Path:
    """A minimal valid pure-Python wheel holding one module ``name``."""
    dist = f"{name}-{version}.dist-info"
    path = directory / f"{name}-{version}-py3-none-any.whl"
    files = {
        f"{name}.py": body,
        f"{dist}/METADATA": f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n",
        f"{dist}/WHEEL": "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n",
    }
    record = "".join(f"{n},,\n" for n in files) + f"{dist}/RECORD,,\n"
    with zipfile.ZipFile(path, "w") as z:
        for n, text in files.items():
            z.writestr(n, text)
        z.writestr(f"{dist}/RECORD", record)
    return path


def run(*args: str, env_add: dict | None = None, timeout: float = 170) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "OUT"}
    env.update(PYTHON=sys.executable, OMP_NUM_THREADS="1", **(env_add or {}))
    return subprocess.run(
        ["bash", str(SCRIPT), *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout
    )


def test_install_takes_only_the_missing_wheels(tmp_path):
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    make_wheel(wheels, "rlr_probe_wheel", "1.2.3", "VALUE = 42\n")
    make_wheel(wheels, "pytest", "0.0.1")  # installed here already: must be left alone
    site = tmp_path / "site"
    proc = subprocess.run(
        [sys.executable, str(WHEELS), "install", str(wheels), str(site)], capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stderr
    assert "installed into" in proc.stdout and "rlr_probe_wheel 1.2.3" in proc.stdout
    assert "already installed (kept): pytest" in proc.stdout
    assert (site / "rlr_probe_wheel.py").read_text() == "VALUE = 42\n"
    assert not (site / "pytest.py").exists()
    probe = subprocess.run(
        [sys.executable, "-c", "import rlr_probe_wheel; print(rlr_probe_wheel.VALUE)"],
        env={**os.environ, "PYTHONPATH": str(site)},
        capture_output=True,
        text=True,
    )
    assert probe.stdout.strip() == "42"


def test_bad_arguments_are_one_line_exit_2(tmp_path):
    for args, message in (
        (["--wheels", str(tmp_path / "none")], "wheel directory"),
        (["--bogus"], "unknown argument '--bogus'"),
    ):
        proc = run(*args, "--out", str(tmp_path / "out"))
        assert proc.returncode == 2, proc.stderr
        assert proc.stderr.count("\n") == 1 and message in proc.stderr
        assert not (tmp_path / "out").exists()


@pytest.mark.slow
def test_dry_run(tmp_path):
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    make_wheel(wheels, "rlr_probe_wheel", "1.2.3")
    out = tmp_path / "out"
    proc = run("--dry-run", "--wheels", str(wheels), env_add={"OUT": str(out)})
    log = (out / "gpu_check.log").read_text()
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    assert "all steps passed" in proc.stdout
    assert "installed into" in log and "rlr_probe_wheel 1.2.3" in log
    # The CUDA tests are collected, FSDP CPU offload parity among them.
    assert "test_cpu_offload_gradient_matches_single_process" in log
    results = (out / "gpu_results.md").read_text()
    assert "DRY RUN on CPU" in results
    assert "- training run: finished 2 updates, 256 env steps" in results
    assert "- FSDP2 training run: finished 2 updates, 256 env steps" in results
    assert "| 8 | rl_replay |" in results and "<!-- BEGIN bench_memory tiny_gru -->" in results
    for step in (
        "install wheels: ok",
        "imports: ok",
        "cuda tests (collected only): ok",
        "train (CPU, gloo): ok",
        "train (CPU, gloo, FSDP2): ok",
        "bench_memory (CPU, tiny): ok",
        "bench_overhead (CPU, tiny): ok",
        "bench_torchrl (CPU, smoke): ok",
    ):
        assert step in results, results
    assert (out / "bench_memory.json").exists()
    # bench_ppo --pixels --smoke (the CNN + GRU update on uint8 frames) ran both ways, bit-identical to plain
    # autograd, and printed its summary lines (no timing or memory assertions).
    pixels = (out / "bench_pixels.txt").read_text()
    assert "gradient check: worst abs diff 0.000e+00, worst rel diff 0.000e+00" in pixels, pixels
    for T in (8, 16):
        for method in ("plain", "rl_replay"):
            assert re.search(rf"T={T}\s+{method}\s+peak RSS growth", pixels), (T, method, pixels)
        assert f"summary T={T}: peak RSS growth rl_replay/plain" in pixels
    assert "ERROR" not in pixels
    assert re.search(r"summary rl_replay memory: .* per step .*; block inputs .* per step; ratio", pixels)
    assert re.search(r"summary plain autograd: .* would pass 16 GiB at T=\d+ \(extrapolated", pixels)
    # The recurrent update beside TorchRL's (its side only where torchrl imports): the LSTM row.
    cores = (out / "bench_torchrl.txt").read_text()
    assert "lstm: largest relative gradient difference from plain autograd at T = 66: rl_replay 0.0e+00" in cores
    assert "| lstm | 66 |" in cores and "Recurrent PPO update against TorchRL" in results
    # The overhead table, with gradients identical in both block sizes.
    assert "Per-block overhead (scripts/bench/overhead.py, CPU, tiny)" in results
    assert results.count("| configs/memory_1024.yaml | 8 | 16 |") == 2 and "| NO |" not in results
