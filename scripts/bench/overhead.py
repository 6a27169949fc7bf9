"""Per-block overhead of the replay engine: what a replayed step costs beyond plain autograd.

For an agent as a shipped config builds it, steps T timesteps of batch B three ways on the
same inputs (recurrent state flowing step to step, one ``backward()`` of the summed values
and log-probabilities at the end):

* ``plain``:   plain autograd (every activation kept), one backward;
* ``replay``:  the public loop, ``rl_replay.replay(agent, acc, TensorDict(...))`` per step,
  one backward (which recomputes every block); with ``--block-steps k`` (k > 1) the same
  loop in blocks of k stored steps (``rl_replay.replay_sequence_call``; ``replay_steps`` for a
  StepwiseAgent);
* ``nograd``:  the forward alone under ``torch.no_grad`` (the cost of the extra forward a
  replay does in its backward).

With ``--block-steps k`` an agent (a StepwiseAgent excepted) runs each block as one call: ``plain`` and ``nograd`` then make the same calls (plain
autograd over the sequence forward: the floor of the agent's own arithmetic), and the last
column times the per-step plain loop beside them.

The floor for replay is ``plain + nograd`` (one extra forward per step); ``overhead`` is
what replay spends beyond that floor per block: the engine's own machinery. Gradients of
plain and replay are compared (bit-identical expected). Times are medians over
``--repeats`` runs, each run timing all three in turn, so the ratios pair run by run.

    python -m scripts.bench overhead                      # LRU of memory_1024.yaml, T 1026, B 16
    python -m scripts.bench overhead --config configs/memory_256.yaml --T 258 --batch 16
    python -m scripts.bench overhead --all                # the shipped agents, as a table
    python -m scripts.bench overhead --all --block-steps 1 16   # one-step and 16-step blocks
    python -m scripts.bench overhead --all --block-steps 1 16 --device cuda   # on a GPU (scripts/tools/gpu_check.sh)

The ``--bare`` (a bare replay Function beside replay) and ``--compile`` (the agent under
``torch.compile``) studies of docs/benchmarks.md are retired: see its "Retired workloads".

On CUDA every timing is bracketed by ``torch.cuda.synchronize()``; replay still moves each
block's saved inputs to host memory, so its rows include those copies.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch
from tensordict import TensorDict

from rl_replay.rollout.sequence import step_inputs
from scripts.bench.common import ROOT

# The shipped agents, each as a config builds it: (label, config, T).
SHIPPED = (
    ("MLP (default.yaml)", "configs/default.yaml", 512),
    ("GRU (memory_gru.yaml)", "configs/memory_gru.yaml", 512),
    ("LSTM (ppo_pocartpole_gru.yaml, lstm)", "configs/ppo_pocartpole_gru.yaml", 512),
    ("LRU (memory_1024.yaml)", "configs/memory_1024.yaml", 1026),
    ("GTrXL, window 260 (ppo_memory_256_gtrxl.yaml)", "configs/ppo_memory_256_gtrxl.yaml", 258),
    ("GTrXL over LRU (memory_1024_gtrxl_lru.yaml)", "configs/memory_1024_gtrxl_lru.yaml", 1026),
)


def build(config: str, overrides: tuple[str, ...] = (), device: str = "cpu"):
    """The agent, observation sampler and action space of a config (one env built to read spaces)."""
    from rl_replay.agent import build_agent
    from rl_replay.config import load_config
    from rl_replay.rollout.environment import envs_from_config
    from rl_replay.spaces import obs_converter

    cfg = load_config(os.path.join(ROOT, config), overrides)
    envs = envs_from_config(cfg.env, 1)
    torch.manual_seed(0)
    agent = build_agent(cfg.agent.target, cfg.agent.kwargs, envs.single_observation_space, envs.single_action_space).to(
        device
    )
    convert = obs_converter(envs.single_observation_space, device)
    space = envs.single_observation_space
    envs.close()
    return agent, convert, space


def make_inputs(convert, space, T: int, B: int, seed: int = 0):
    space.seed(seed)
    import numpy as np

    return [convert(np.stack([space.sample() for _ in range(B)])) for _ in range(T)]


def _rollout(agent, obs, B: int, k: int, call) -> torch.Tensor:
    """The summed per-step loss of the rollout stepped in blocks of ``k`` stored steps, through
    ``call(inputs, state) -> (outputs of the block's rows, state)`` per block. One-step blocks get
    the public loop's inputs (``step_inputs``: one TensorDict holding the state, ``state`` None),
    longer blocks the ``(k, N)`` rows beside the state, as the engine's block calls take them."""
    dev = obs[0].device
    state = agent.initial_state(B, dev)
    stacked = torch.stack(obs)
    is_first = torch.zeros(len(obs), B, dtype=torch.bool, device=dev)
    action = torch.zeros(B, dtype=torch.long, device=dev)
    total = torch.zeros((), device=dev)
    for t0 in range(0, len(obs), k):
        t1 = min(len(obs), t0 + k)
        if k == 1:
            outputs, state = call(step_inputs(obs[t0], state, is_first[t0]), None)
        else:
            steps = TensorDict(observation=stacked[t0:t1], is_first=is_first[t0:t1], batch_size=[t1 - t0, B])
            outputs, state = call(steps, state)
        for i in range(t1 - t0):  # the same per-step loss terms in every loop
            total = total + outputs[i]["value"].sum() + agent.distribution(outputs[i]).log_prob(action).sum()
    return total


def run(agent, obs, B: int, k: int, method: str) -> None:
    """One timed loop: ``plain`` (the agent called on each block, one backward), ``nograd`` (the same
    calls without a graph), ``replay`` (each block a replay block: ``rl_replay.replay`` for one-step
    blocks, else ``replay_sequence_call``, or ``replay_steps`` for a StepwiseAgent)."""
    import rl_replay
    from rl_replay.agent import StepwiseAgent
    from rl_replay.algorithms.stored import OneStep

    def plain(inputs, state):
        out = agent(**inputs) if state is None else agent(**inputs, state=state)
        return out["outputs"], out["state"]

    acc = rl_replay.GradientAccumulator()

    def replay(inputs, state):
        if state is None:
            out = rl_replay.replay(agent, acc, inputs)
            return out["outputs"], out["state"]
        if isinstance(agent, StepwiseAgent):
            return rl_replay.replay_steps(OneStep(agent), acc, inputs, state)
        return rl_replay.replay_sequence_call(agent, acc, inputs, state)

    if method == "nograd":
        with torch.no_grad():
            _rollout(agent, obs, B, k, plain)
    else:
        _rollout(agent, obs, B, k, replay if method == "replay" else plain).backward()


def grads(agent):
    return [None if p.grad is None else p.grad.clone() for p in agent.parameters()]


def measure(config: str, T: int, B: int, repeats: int, overrides=(), block_steps: int = 1, device: str = "cpu") -> dict:
    from rl_replay.agent import StepwiseAgent

    agent, convert, space = build(config, tuple(overrides), device)
    sync = torch.cuda.synchronize if torch.device(device).type == "cuda" else (lambda: None)
    obs = make_inputs(convert, space, T, B)
    # An agent runs a block as one call (a StepwiseAgent one call per step): plain autograd and the
    # no-grad forward then make the same calls (the floor of the agent's own arithmetic), and the
    # per-step plain loop is timed beside them.
    sequence = block_steps > 1 and not isinstance(agent, StepwiseAgent)
    loops = [("plain", block_steps), ("replay", block_steps), ("nograd", block_steps)]
    loops += [("plain_steps", 1)] if sequence else []
    got = {}
    for name, k in loops:  # parity first (and warm-up)
        run(agent, obs, B, k, name.split("_")[0])
        got[name] = grads(agent)
        agent.zero_grad(set_to_none=True)
    identical = all(
        (a is None and b is None) or (a is not None and b is not None and torch.equal(a, b))
        for a, b in zip(got["plain"], got["replay"])
    )
    times: dict[str, list[float]] = {name: [] for name, _ in loops}
    for _ in range(repeats):
        for name, k in loops:
            sync()
            t0 = time.perf_counter()
            run(agent, obs, B, k, name.split("_")[0])
            sync()
            times[name].append(time.perf_counter() - t0)
            agent.zero_grad(set_to_none=True)
    ms = {k: 1e3 * statistics.median(v) / T for k, v in times.items()}
    ratios = [r / p for r, p in zip(times["replay"], times["plain"])]
    overheads = [1e3 * (r - p - n) / T for r, p, n in zip(times["replay"], times["plain"], times["nograd"])]
    return {
        "sequence": sequence,
        **({"plain_steps_ms_per_step": ms["plain_steps"]} if sequence else {}),
        "config": config,
        "device": device,
        "T": T,
        "batch": B,
        "block_steps": block_steps,
        "repeats": repeats,
        "identical_grads": identical,
        "plain_ms_per_step": ms["plain"],
        "replay_ms_per_step": ms["replay"],
        "nograd_ms_per_step": ms["nograd"],
        "replay_over_plain": statistics.median(ratios),
        "replay_over_plain_min": min(ratios),
        "replay_over_plain_max": max(ratios),
        "floor_over_plain": (ms["plain"] + ms["nograd"]) / ms["plain"],
        "overhead_ms_per_block": statistics.median(overheads),
    }


def table(rows: list[dict], labels: list[str]) -> str:
    lines = [
        "| agent | T | batch | steps per block | plain ms/step | replay ms/step | no-grad fwd ms/step | replay / plain "
        "(median, min-max) | floor / plain | overhead ms/block | grads identical | plain step loop ms/step |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for label, r in zip(labels, rows):
        lines.append(
            f"| {label} | {r['T']} | {r['batch']} | {r['block_steps']} | {r['plain_ms_per_step']:.3f} | "
            f"{r['replay_ms_per_step']:.3f} | {r['nograd_ms_per_step']:.3f} | {r['replay_over_plain']:.2f}x "
            f"({r['replay_over_plain_min']:.2f}-{r['replay_over_plain_max']:.2f}) | {r['floor_over_plain']:.2f}x | "
            f"{r['overhead_ms_per_block']:.3f} | {'yes' if r['identical_grads'] else 'NO'} | "
            f"{format(r['plain_steps_ms_per_step'], '.3f') if r.get('sequence') else '-'} |"
        )
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", default="configs/memory_1024.yaml")
    ap.add_argument("--T", type=int, default=1026)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--device", default="cpu", help="cpu or cuda")
    ap.add_argument(
        "--block-steps",
        type=int,
        nargs="+",
        default=[1],
        help="steps per replay block (1: rl_replay.replay per step; k > 1: one replay block per k steps)",
    )
    ap.add_argument("--all", action="store_true", help="every shipped agent (SHIPPED), as a markdown table")
    ap.add_argument("--json", action="store_true", help="print the rows as JSON")
    ap.add_argument("overrides", nargs="*", help="config overrides, e.g. agent.kwargs.hidden_size=64")
    args = ap.parse_args(argv)
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        ap.error(f"--device {args.device}: this torch sees no CUDA device; use --device cpu")
    if args.T < 1 or args.batch < 1 or args.repeats < 1 or min(args.block_steps) < 1:
        ap.error("--T, --batch, --repeats and --block-steps must be positive")
    torch.set_num_threads(args.threads)
    if args.all:
        specs = [(label, cfg, T) for label, cfg, T in SHIPPED]
    else:
        specs = [(args.config, args.config, args.T)]
    rows, labels = [], []
    for label, cfg, T in specs:
        overrides = list(args.overrides)
        if "lstm" in label.lower():
            overrides.append("agent.target=lstm")
        for k in args.block_steps:
            rows.append(measure(cfg, T, args.batch, args.repeats, overrides, block_steps=k, device=args.device))
            labels.append(label)
    print(json.dumps(rows, indent=1) if args.json else table(rows, labels))
    return 0 if all(r["identical_grads"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
