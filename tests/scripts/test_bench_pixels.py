"""scripts/bench/bench_pixels.py --smoke: the CNN + GRU update on uint8 frames runs both ways, agrees on
gradients with plain autograd and prints its summary lines (no timing or memory assertions)."""

from __future__ import annotations

import re

import pytest
from test_benchmarks import assert_grad_line, run_script


@pytest.mark.slow
def test_bench_pixels_smoke():
    out = run_script("bench_pixels.py", "--smoke")
    assert_grad_line(out)
    assert "worst abs diff 0.000e+00, worst rel diff 0.000e+00" in out  # replay is bit-identical here
    for T in (8, 16):
        for method in ("plain", "rl_replay"):
            assert re.search(rf"T={T}\s+{method}\s+peak RSS growth", out), (T, method, out[-4000:])
        assert f"summary T={T}: peak RSS growth rl_replay/plain" in out
    assert "ERROR" not in out
    assert re.search(r"summary rl_replay memory: .* per step .*; block inputs .* per step; ratio", out)
    assert re.search(r"summary plain autograd: .* would pass 16 GiB at T=\d+ \(extrapolated", out)


def test_bench_pixels_refuses_cuda_without_a_gpu():
    torch = pytest.importorskip("torch")
    if torch.cuda.is_available():
        pytest.skip("a CUDA device is present")
    with pytest.raises(AssertionError, match="no CUDA device here"):
        run_script("bench_pixels.py", "--smoke", "--device", "cuda")
