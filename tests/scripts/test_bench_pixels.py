"""scripts/bench/bench_pixels.py: its refusals. Its --smoke run (the CNN + GRU update on uint8 frames
both ways, gradients against plain autograd, the summary lines) is checked in test_gpu_check.py's
dry run, which runs it as one of the GPU validation's steps."""

from __future__ import annotations

import pytest
from test_benchmarks import run_script


def test_bench_pixels_refuses_cuda_without_a_gpu():
    torch = pytest.importorskip("torch")
    if torch.cuda.is_available():
        pytest.skip("a CUDA device is present")
    with pytest.raises(AssertionError, match="no CUDA device here"):
        run_script("bench_pixels.py", "--smoke", "--device", "cuda")
