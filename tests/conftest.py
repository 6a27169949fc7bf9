"""Shared test helpers.

``assert_grads_match`` compares gradients (or any named tensors) against a reference
computed with plain autograd, and records the worst absolute and relative difference
per test family; ``pytest_terminal_summary`` prints them as a table at the end of the
run, so the numbers can be quoted.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Mapping
from typing import Any

import pytest
import torch

# The per-user secret that signs env-state files (rl_replay.rundir.trust): the tests, and the
# processes they start, use one of their own instead of the account's ~/.config/rl_replay
# (setdefault: a spawned worker that imports this module keeps its parent's).
os.environ.setdefault("RL_REPLAY_CONFIG_DIR", tempfile.mkdtemp(prefix="rl_replay_test_config_"))

# family -> {"abs": worst |actual - expected|, "rel": worst relative difference,
#            "tensors": tensors compared, "checks": assert_grads_match calls}
GRAD_DIFFS: dict[str, dict[str, float]] = {}


def _named(obj: Any) -> dict[str, torch.Tensor | None]:
    """``{name: tensor}`` from a module (its parameters' ``.grad``), a mapping, or a sequence."""
    if isinstance(obj, torch.nn.Module):
        return {name: p.grad for name, p in obj.named_parameters()}
    if isinstance(obj, Mapping):
        return dict(obj)
    if isinstance(obj, torch.Tensor):
        return {"tensor": obj}
    return {str(i): t for i, t in enumerate(obj)}


def _record(family: str, abs_diff: float, rel_diff: float, tensors: int) -> None:
    entry = GRAD_DIFFS.setdefault(family, {"abs": 0.0, "rel": 0.0, "tensors": 0, "checks": 0})
    entry["abs"] = max(entry["abs"], abs_diff)
    entry["rel"] = max(entry["rel"], rel_diff)
    entry["tensors"] += tensors
    entry["checks"] += 1


def assert_grads_match(
    model_or_named_grads: Any,
    expected: Any,
    family: str,
    *,
    rtol: float = 1e-5,
    atol: float = 1e-6,
) -> None:
    """Assert that gradients match the plain-autograd reference; record the worst diffs.

    Both arguments are a module (compared through its parameters' ``.grad``), a
    mapping ``name -> tensor``, or a sequence of tensors. Names must agree; a ``None``
    gradient must be ``None`` on both sides. The absolute difference recorded is the
    largest ``|actual - expected|``; the relative one is the largest
    ``|actual - expected| / |expected|`` over the elements where ``|expected| > atol``
    (where the relative tolerance is what the check relies on).
    """
    actual = _named(model_or_named_grads)
    reference = _named(expected)
    assert actual.keys() == reference.keys(), (
        f"[{family}] compared different tensors: {sorted(actual)} vs {sorted(reference)}"
    )
    worst_abs = worst_rel = 0.0
    compared = 0
    for name, ref in reference.items():
        got = actual[name]
        if ref is None or got is None:
            assert got is None and ref is None, (
                f"[{family}] {name}: gradient is {'None' if got is None else 'set'} but the "
                f"reference is {'None' if ref is None else 'set'}"
            )
            continue
        compared += 1
        assert got.shape == ref.shape and got.dtype == ref.dtype, (
            f"[{family}] {name}: {tuple(got.shape)}/{got.dtype} vs {tuple(ref.shape)}/{ref.dtype}"
        )
        diff = (got.detach().double() - ref.detach().double()).abs()
        mag = ref.detach().double().abs()
        if diff.numel():
            worst_abs = max(worst_abs, diff.max().item())
            big = mag > atol
            if big.any():
                worst_rel = max(worst_rel, (diff[big] / mag[big]).max().item())
    _record(family, worst_abs, worst_rel, compared)
    assert compared > 0, f"[{family}] nothing to compare: every gradient is None"
    for name, ref in reference.items():
        if ref is not None:
            torch.testing.assert_close(
                actual[name], ref, rtol=rtol, atol=atol, msg=lambda m, n=name: f"[{family}] {n}: {m}"
            )


def collect_replayed(collector):
    """One rollout of ``collector`` with one replay block per step (what A2C and REINFORCE do
    with ``replay.block_steps`` 1): ``(rollout, accumulator)``, the outputs attached."""
    from rl_replay.engine import GradientAccumulator, replay

    accumulator = GradientAccumulator()
    return collector.collect(lambda inputs: replay(collector.policy.module, accumulator, inputs)), accumulator


def pytest_collection_modifyitems(config, items):  # noqa: ARG001
    """The modules holding ``slow`` tests first, each module kept whole (its fixtures set up once).

    pytest-xdist hands tests to its workers in this order: a minute-long test collected last would
    run alone at the end while the other worker idles."""
    slow_modules = {item.module for item in items if item.get_closest_marker("slow")}
    items.sort(key=lambda item: item.module not in slow_modules)


def pytest_terminal_summary(terminalreporter, exitstatus, config):  # noqa: ARG001
    if not GRAD_DIFFS:
        return
    tr = terminalreporter
    tr.write_sep("=", "worst gradient difference per family")
    tr.write_line(f"{'family':<24}{'max abs diff':>14}{'max rel diff':>14}{'tensors':>9}{'checks':>8}")
    for family in sorted(GRAD_DIFFS):
        e = GRAD_DIFFS[family]
        tr.write_line(f"{family:<24}{e['abs']:>14.3e}{e['rel']:>14.3e}{int(e['tensors']):>9}{int(e['checks']):>8}")


@pytest.fixture(scope="module", autouse=True)
def single_thread():
    """One intra-op thread for every test module, restored afterwards.

    The tests run many tiny ops; on a small shared machine a second OpenMP thread only
    spins (it made test_replay.py three times slower and tiny updates ~10x slower).
    """
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


# ------------------------------------------------------------ distributed scenarios


@pytest.fixture(scope="session")
def fsdp_world2(tmp_path_factory):
    """Results of every world-size-2 FSDP scenario (tests/_dist.py ``fsdp_all``).

    One ``torch.multiprocessing.spawn`` of two gloo workers per session, shared by
    test_replay_fsdp.py (parity) and test_replay_errors.py (setup errors): starting
    the workers (importing torch twice) costs far more than the scenarios.
    Returns ``[rank0_results, rank1_results]``.
    """
    import torch.distributed as dist

    if not dist.is_available() or not dist.is_gloo_available():
        pytest.skip("needs torch.distributed with the gloo backend")
    import _dist

    return _dist.run_workers("fsdp_all", 2, tmp_path_factory.mktemp("fsdp_world2"))


@pytest.fixture(scope="session")
def fsdp_hybrid4(tmp_path_factory):
    """Results of the HYBRID_SHARD scenarios over 4 gloo ranks as 2 "nodes" x 2 (tests/_dist.py
    ``fsdp_hybrid4``): sharded within a node, replicated across nodes."""
    import torch.distributed as dist

    if not dist.is_available() or not dist.is_gloo_available():
        pytest.skip("needs torch.distributed with the gloo backend")
    import _dist

    return [{"hybrid": r} for r in _dist.run_workers("fsdp_hybrid4", 4, tmp_path_factory.mktemp("fsdp_hybrid4"))]


def scenario_results(per_rank: list, group: str, name: str) -> list:
    """One scenario's per-rank results; fails the test with a worker's traceback."""
    results = [r[group][name] for r in per_rank]
    for rank, res in enumerate(results):
        if isinstance(res, dict) and "error" in res:
            pytest.fail(f"rank {rank} failed in scenario {name!r}:\n{res['error']}", pytrace=False)
    return results


@pytest.fixture
def policy():
    """A seeded one-layer policy (``_policies.LinearPolicy``) for engine tests."""
    from _policies import LinearPolicy

    torch.manual_seed(0)
    return LinearPolicy()


@pytest.fixture
def x():
    """A (2, 4) observation for ``policy``."""
    return torch.randn(2, 4)


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory):
    """A finished 3-update run (checkpoint every update): the run other tests must not harm."""
    from _runs import tiny

    from rl_replay.run.setup import build

    run_dir = tmp_path_factory.mktemp("finished") / "run"
    build(tiny(run_dir, 3, "checkpoint.every=1")).train()
    return run_dir
