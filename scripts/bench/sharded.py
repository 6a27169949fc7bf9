"""A large memory transformer sharded with FSDP1 or FSDP2 on 2 gloo ranks: one update's memory per rank, rl_replay vs plain autograd.

The agent of ``configs/fsdp_gtrxl_memory_1024.yaml`` (``gtrxl``: MemoryCue's 4-dim observations ->
Linear 384 -> LRU 128 -> 4 GTrXL layers of width 384 with windows of 32 steps, 6 heads; about
14.4M parameters), FSDP1 ``FULL_SHARD`` with ``use_orig_params=True``, each attention layer its own
unit (``wrap_modules: [WindowLayer]``), launched with ``torch.distributed.run`` on 2 CPU ranks
(gloo). Each rank holds a stored rollout of ``--envs`` episodes of T steps (one episode per env from
row 0, seeded observations and actions) and runs one minibatch's forward and backward over the
whole sequences, in ``--block-steps`` blocks:

1. ``rl_replay``  :func:`rl_replay.algorithms.stored.replay_sequence` (replay blocks: each keeps
                  its k steps' inputs and one state; the parameters are gathered per unit and block);
2. ``plain``      plain autograd over the same sequence calls (every block's graph kept until the
                  backward), of the agent unwrapped on each rank: FSDP1's backward hooks do not see the
                  agent's TensorDict outputs (the replay engine registers them itself), so plain
                  autograd cannot run the FSDP module; unsharded it also holds the full parameters
                  and gradients (about 115 MiB here), small beside its activations.

The loss is an A2C-like sum over the (T, envs) outputs (``log_prob * w + value ** 2``, w fixed). Each
(method, T) is a fresh ``torch.distributed.run`` of 2 processes after a warm-up on 8 steps; per rank:
peak RSS growth of the measured forward + backward (``VmHWM`` reset before it), seconds, and for
rl_replay the bytes its blocks saved. A run that passes ``--limit-gib`` per rank, or dies, is
reported as such. The gradients are compared in the tests (``tests/engine/test_replay_fsdp.py``:
the gtrxl agent under FSDP1 on 2 ranks against plain autograd averaged over ranks).

Usage::

    python -m scripts.bench sharded                     # T = 258 1026 4098
    python -m scripts.bench sharded --T 1026 --envs 8 --methods rl_replay
    python -m scripts.bench sharded --smoke             # a small agent, T = 18
    python -m scripts.bench sharded --T 1026 --methods rl_replay \
        --strategies FULL_SHARD SHARD_GRAD_OP NO_SHARD           # one row per sharding strategy
    python -m scripts.bench sharded --T 1026 4098 --methods rl_replay --fsdp-versions 1 2   # FSDP2 beside FSDP1

Each rl_replay row also counts the parameter all-gathers during the measured forward and backward
(``all-gathers``, per rank; FSDP2 counts one per unit gather). ``--fsdp-versions 2`` wraps with
:func:`rl_replay.distributed.wrap_fsdp2` (the trainer's ``distributed.fsdp_version: 2``), the strategy
names mapped as there.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

from scripts.bench.common import launch_ranks, rank_result

FULL = dict(d_model=384, num_layers=4, num_heads=6, window=32, recurrent_size=128, encoder=384)
SMOKE = dict(d_model=16, num_layers=2, num_heads=2, window=4, recurrent_size=8, encoder=16)


def worker(spec: dict) -> dict:
    """One rank of one measurement (under torch.distributed.run)."""
    import gymnasium as gym
    import torch
    from tensordict import TensorDict

    from rl_replay.agent import Policy
    from rl_replay.agents.gtrxl import WindowTransformerAgent
    from rl_replay.algorithms.stored import replay_sequence
    from rl_replay.distributed import init_from_env, wrap_fsdp, wrap_fsdp2
    from rl_replay.engine import GradientAccumulator
    from scripts.bench.common import MemoryMeter, set_threads

    set_threads(1)
    info, device = init_from_env("cpu", "gloo")
    p = spec["policy"]
    torch.manual_seed(0)
    agent = WindowTransformerAgent(
        gym.spaces.Box(-1.0, 1.0, (4,)),
        gym.spaces.Discrete(2),
        d_model=p["d_model"],
        num_layers=p["num_layers"],
        num_heads=p["num_heads"],
        window=p["window"],
        recurrence="lru",
        recurrent_size=p["recurrent_size"],
        encoder_sizes=(p["encoder"],),
    )
    num_params = sum(t.numel() for t in agent.parameters())
    # Plain autograd cannot run this FSDP1 module: the agent's TensorDict outputs bypass FSDP1's
    # backward hooks (the replay engine registers them itself), so its row is the unwrapped agent.
    wrap = wrap_fsdp2 if spec.get("fsdp_version") == 2 else wrap_fsdp
    model = (
        wrap(agent, device, wrap_modules=["WindowLayer"], sharding_strategy=spec["strategy"])
        if spec["method"] == "rl_replay"
        else agent
    )
    policy = Policy.of(model)
    T, B, k = spec["T"], spec["envs"], spec["block_steps"]

    def rollout(T: int) -> TensorDict:
        g = torch.Generator().manual_seed(100 + info.rank)
        is_first = torch.zeros(T, B, dtype=torch.bool)
        is_first[0] = True
        return TensorDict(
            observation=torch.randn(T, B, 4, generator=g),
            is_first=is_first,
            action=torch.randint(0, 2, (T, B), generator=g),
            batch_size=[T, B],
        )

    def calls(data: TensorDict, method: str, acc) -> TensorDict:
        start = agent.initial_state(B)
        if method == "rl_replay":
            return replay_sequence(policy, data, start, acc, None, k)
        state, outs = start, []
        for t0 in range(0, data.batch_size[0], k):
            out = model(
                observation=data["observation"][t0 : t0 + k], state=state, is_first=data["is_first"][t0 : t0 + k]
            )
            outs.append(out["outputs"])
            state = out["state"]
        stacked = torch.cat(outs)
        dist = agent.distribution(stacked)
        return TensorDict(log_prob=dist.log_prob(data["action"]), value=stacked["value"], batch_size=data.batch_size)

    def step(data: TensorDict, method: str) -> GradientAccumulator:
        acc = GradientAccumulator()
        out = calls(data, method, acc)
        w = torch.linspace(-1.0, 1.0, out.numel()).view(out.batch_size)
        ((w * out["log_prob"]).sum() + out["value"].square().sum()).backward()
        return acc

    step(rollout(8), spec["method"])  # warm-up: lazy initialisation, gradient buffers
    model.zero_grad(set_to_none=True)
    data = rollout(T)
    meter = MemoryMeter(device)
    meter.start()
    gathers = count_gathers(spec.get("fsdp_version", 1))
    t0 = time.perf_counter()
    acc = step(data, spec["method"])
    seconds = time.perf_counter() - t0
    peak = meter.peak_rss_growth()
    gathers.stop()
    return {
        "rank": info.rank,
        "seconds": seconds,
        "peak_growth": peak,
        "saved_bytes": acc.saved_bytes if spec["method"] == "rl_replay" else None,
        "num_params": num_params,
        "all_gathers": gathers.calls,
    }


class count_gathers:
    """Counts the parameter all-gathers of FSDP ``version`` until :meth:`stop`."""

    def __init__(self, version: int = 1) -> None:
        if version == 2:
            from torch.distributed.fsdp._fully_shard import _fsdp_param_group as owner

            self._owner, self._name = owner, "foreach_all_gather"
        else:
            from torch.distributed.fsdp._flat_param import FlatParamHandle as owner  # type: ignore[assignment]

            self._owner, self._name = owner, "_all_gather_flat_param"
        self.calls, self._real = 0, getattr(self._owner, self._name)
        counter = self

        def counting(*args, **kwargs):
            counter.calls += 1
            return counter._real(*args, **kwargs)

        setattr(self._owner, self._name, counting)

    def stop(self) -> None:
        setattr(self._owner, self._name, self._real)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--T", type=int, nargs="+", default=[258, 1026, 4098])
    parser.add_argument("--envs", type=int, default=8, help="episodes per rank")
    parser.add_argument("--block-steps", type=int, default=64)
    parser.add_argument("--methods", nargs="+", default=["rl_replay", "plain"], choices=["rl_replay", "plain"])
    parser.add_argument("--limit-gib", type=float, default=9.0, help="skip plain past a T whose estimate passes this")
    parser.add_argument("--timeout", type=float, default=1800)
    parser.add_argument("--smoke", action="store_true", help="a small agent, T = 18, 2 envs, 4-step blocks")
    parser.add_argument(
        "--strategies",
        nargs="+",
        default=["FULL_SHARD"],
        choices=["FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD"],
        help="FSDP1 sharding strategies of the rl_replay rows (HYBRID_SHARD needs two nodes: docs/scaling.md)",
    )
    parser.add_argument(
        "--fsdp-versions",
        nargs="+",
        type=int,
        default=[1],
        choices=[1, 2],
        help="FSDP1, FSDP2 or both (rl_replay rows)",
    )
    args = parser.parse_args(argv)
    if args.worker:
        spec = json.loads(args.worker)
        rank_result(spec, worker(spec))
    policy = SMOKE if args.smoke else FULL
    if args.smoke:
        args.T, args.envs, args.block_steps = [18], 2, 4
    from scripts.bench.common import describe_machine
    from scripts.bench.report import fmt_bytes

    print(describe_machine())
    print(
        f"2 gloo ranks, {args.envs} episodes of T steps per rank, {args.block_steps}-step blocks; per rank: "
        "peak RSS growth of one forward + backward, seconds"
    )
    print("| T | method | rank 0 | rank 1 | block inputs saved (rank 0) | all-gathers per rank |")
    print("|---:|---|---:|---:|---:|---:|")
    import tempfile

    results = tempfile.mkdtemp(prefix="bench_sharded_")
    plain_per_step, rows = None, []
    runs = [
        (m, s, v)
        for m in args.methods
        for s in (args.strategies if m == "rl_replay" else [None])
        for v in (args.fsdp_versions if m == "rl_replay" else [None])
    ]
    for T in args.T:
        for method, strategy, version in runs:
            name = f"{method} {strategy}" if strategy and args.strategies != ["FULL_SHARD"] else method
            name += f" FSDP{version}" if version and args.fsdp_versions != [1] else ""
            if method == "plain" and plain_per_step and plain_per_step * T > args.limit_gib * 2**30:
                est = plain_per_step * T / 2**30
                print(f"| {T} | plain | not run: about {est:.1f} GiB per rank (from the smaller T) | | | |", flush=True)
                continue
            out = os.path.join(results, f"{method}_{strategy}_{version}_T{T}")
            spec = dict(
                policy=policy,
                T=T,
                envs=args.envs,
                block_steps=args.block_steps,
                method=method,
                strategy=strategy,
                fsdp_version=version,
                out=out,
            )
            rows = launch_ranks(__spec__.name, spec, 2, args.timeout)
            if isinstance(rows, str):
                print(f"| {T} | {name} | failed | | | |", flush=True)
                print(rows, file=sys.stderr)
                continue
            cells = [f"{fmt_bytes(r['peak_growth'])}, {r['seconds']:.1f} s" for r in rows]
            saved = fmt_bytes(rows[0]["saved_bytes"]) if rows[0]["saved_bytes"] is not None else "-"
            gathers = rows[0]["all_gathers"] if method == "rl_replay" else "-"
            print(f"| {T} | {name} | {cells[0]} | {cells[1]} | {saved} | {gathers} |", flush=True)
            if method == "plain":
                plain_per_step = max(r["peak_growth"] for r in rows) / T
    print(f"parameters: {rows[0].get('num_params', '?'):,}" if rows and "num_params" in rows[0] else "")
    return 0


if __name__ == "__main__":
    sys.exit(main())
