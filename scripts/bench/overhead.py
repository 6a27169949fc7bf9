"""Per-block overhead of the replay engine: what a replayed step costs beyond plain autograd.

For an agent as a shipped config builds it, steps T timesteps of batch B three ways on the
same inputs (recurrent state flowing step to step, one ``backward()`` of the summed values
and log-probabilities at the end):

* ``plain``:   plain autograd (every activation kept), one backward;
* ``replay``:  the public loop, ``rl_replay.replay(agent, acc, TensorDict(...))`` per step,
  one backward (which recomputes every block); with ``--block-steps k`` (k > 1) the same
  loop in multi-step blocks, ``rl_replay.replay_steps`` over k stored steps at a time;
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
    python -m scripts.bench overhead --block-steps 1 16 --compile   # the agent under torch.compile (inductor)
    python -m scripts.bench overhead --all --bare         # next to a bare Function: the design's own floor

``--compile`` wraps the agent in ``torch.compile(agent, dynamic=False)`` for all three loops (the
parity run compiles it, before any timing), so plain and replay are compared on the same
compiled code; its gradients are compared with the compiled plain loop's.

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


def _loss(agent, out, actions):
    dist = agent.distribution(out)
    return out["value"].sum() + dist.log_prob(actions).sum()


def _device(obs):
    return obs[0].device


def run_plain(agent, obs, B):
    dev = _device(obs)
    state = agent.initial_state(B, dev)
    is_first = torch.zeros(B, dtype=torch.bool, device=dev)
    total = 0.0
    for _t, o in enumerate(obs):
        out = agent(**step_inputs(o, state, is_first))
        total = total + _loss(agent, out["outputs"][0], torch.zeros(B, dtype=torch.long, device=dev))
        state = out["state"]
    total.backward()


def run_replay(agent, obs, B):
    import rl_replay

    dev = _device(obs)
    acc = rl_replay.GradientAccumulator()
    state = agent.initial_state(B, dev)
    is_first = torch.zeros(B, dtype=torch.bool, device=dev)
    total = 0.0
    for _t, o in enumerate(obs):
        out = rl_replay.replay(agent, acc, step_inputs(o, state, is_first))
        total = total + _loss(agent, out["outputs"][0], torch.zeros(B, dtype=torch.long, device=dev))
        state = out["state"]
    total.backward()


def _blocks(agent, obs, B, k, call):
    """The loop in blocks of k stored steps, ``call(steps, state) -> (heads, state)`` per block."""
    dev = _device(obs)
    state = agent.initial_state(B, dev)
    stacked = torch.stack(obs)
    is_first = torch.zeros(len(obs), B, dtype=torch.bool, device=dev)
    total = 0.0
    for t0 in range(0, len(obs), k):
        t1 = min(len(obs), t0 + k)
        heads, state = call(
            TensorDict(observation=stacked[t0:t1], is_first=is_first[t0:t1], batch_size=[t1 - t0, B]), state
        )
        for i in range(t1 - t0):  # the same per-step loss terms as the other loops
            total = total + _loss(agent, heads[i], torch.zeros(B, dtype=torch.long, device=dev))
    return total


def run_plain_blocks(agent, obs, B, k):
    """Plain autograd over the agent's sequence forward, one call per block of k steps: the
    floor of the agent's own arithmetic when it runs blocks as sequences."""

    def call(steps, state):
        out = agent(**steps, state=state)
        return out["outputs"], out["state"]

    _blocks(agent, obs, B, k, call).backward()


@torch.no_grad()
def run_nograd_blocks(agent, obs, B, k):
    _blocks(agent, obs, B, k, lambda steps, state: (lambda o: (o["outputs"], o["state"]))(agent(**steps, state=state)))


def run_replay_steps(agent, obs, B, k, sequence=False):
    """The same loop in multi-step blocks of k steps; ``sequence``: each block one call of the
    agent (rl_replay.replay_sequence_call), else one call per step (rl_replay.replay_steps)."""
    import rl_replay
    from rl_replay.algorithms.stored import OneStep

    if sequence:
        acc = rl_replay.GradientAccumulator()
        _blocks(
            agent, obs, B, k, lambda steps, state: rl_replay.replay_sequence_call(agent, acc, steps, state)
        ).backward()
        return
    dev = _device(obs)
    acc = rl_replay.GradientAccumulator()
    state = agent.initial_state(B, dev)
    stacked = torch.stack(obs)
    is_first = torch.zeros(len(obs), B, dtype=torch.bool, device=dev)
    total = 0.0
    for t0 in range(0, len(obs), k):
        t1 = min(len(obs), t0 + k)
        heads, state = rl_replay.replay_steps(
            OneStep(agent),
            acc,
            TensorDict(observation=stacked[t0:t1], is_first=is_first[t0:t1], batch_size=[t1 - t0, B]),
            state,
        )
        for i in range(t1 - t0):  # the same per-step loss terms as the other loops
            total = total + _loss(agent, heads[i], torch.zeros(B, dtype=torch.long, device=dev))
    total.backward()


class _BareBlock(torch.autograd.Function):
    """The least a replay block can be (``--bare``): the model run without a graph, its inputs
    kept as they are, recomputed with grad and back-propagated in one nested backward. No
    slabs, no RNG or autocast replay, no version checks, no accumulator: a reference for how
    much of replay's cost per block is the design (a custom Function and a nested backward
    per block) rather than the engine's checks and bookkeeping. Not exact for dropout."""

    @staticmethod
    def forward(ctx, agent, state_keys, out_keys, anchor, observation, is_first, *state):
        ctx.agent, ctx.state_keys, ctx.out_keys = agent, state_keys, out_keys
        ctx.save_for_backward(observation, is_first, *state)
        B = is_first.shape[0]
        out = agent(**step_inputs(observation, TensorDict(dict(zip(state_keys, state)), batch_size=[B]), is_first))
        if not out_keys:
            out_keys.extend(out.keys(include_nested=True, leaves_only=True))
        return tuple(out.get(k) for k in out_keys)

    @staticmethod
    def backward(ctx, *grads):
        observation, is_first, *state = ctx.saved_tensors
        state = [t.detach().requires_grad_(True) for t in state]
        with torch.enable_grad():
            state_td = TensorDict(dict(zip(ctx.state_keys, state)), batch_size=[is_first.shape[0]])
            out = ctx.agent(**step_inputs(observation, state_td, is_first))
        pairs = [(out.get(k), g) for k, g in zip(ctx.out_keys, grads) if g is not None]
        pairs = [(o, g) for o, g in pairs if o.requires_grad]
        torch.autograd.backward([o for o, _ in pairs], [g for _, g in pairs])
        return (None, None, None, None, None, None, *[t.grad for t in state])


def run_bare(agent, obs, B):
    """The public loop's work through :class:`_BareBlock` instead of ``rl_replay.replay``."""
    dev = _device(obs)
    state = agent.initial_state(B, dev)
    state_keys = list(state.keys())
    is_first = torch.zeros(B, dtype=torch.bool, device=dev)
    anchor = torch.empty(0, device=dev, requires_grad=True)
    out_keys: list = []
    total = 0.0
    for o in obs:
        leaves = _BareBlock.apply(agent, state_keys, out_keys, anchor, o, is_first, *[state.get(k) for k in state_keys])
        out = TensorDict({}, batch_size=[])
        for k, v in zip(out_keys, leaves):
            out.set(k, v)
        step = out["outputs"].apply(lambda x: x[0])  # the one row
        total = total + _loss(agent, step, torch.zeros(B, dtype=torch.long, device=dev))
        if state_keys:  # a stateless agent's empty state has no leaf to carry
            state = out["state"]
    total.backward()


@torch.no_grad()
def run_nograd(agent, obs, B):
    dev = _device(obs)
    state = agent.initial_state(B, dev)
    is_first = torch.zeros(B, dtype=torch.bool, device=dev)
    for o in obs:
        state = agent(**step_inputs(o, state, is_first))["state"]


def grads(agent):
    return [None if p.grad is None else p.grad.clone() for p in agent.parameters()]


def measure(
    config: str,
    T: int,
    B: int,
    repeats: int,
    overrides=(),
    block_steps: int = 1,
    device: str = "cpu",
    compile: bool = False,
    bare: bool = False,
) -> dict:
    module, convert, space = build(config, tuple(overrides), device)
    # The compiled wrapper shares the module's parameters; gradients are read from the module.
    agent = torch.compile(module, dynamic=False) if compile else module
    sync = torch.cuda.synchronize if torch.device(device).type == "cuda" else (lambda: None)
    obs = make_inputs(convert, space, T, B)
    # An agent runs a block as one call (a StepwiseAgent one call per step): plain autograd and
    # the no-grad forward then make the same calls (the floor of the agent's own arithmetic),
    # and the per-step plain loop is timed beside them.
    from rl_replay.agent import StepwiseAgent

    sequence = block_steps > 1 and not isinstance(module, StepwiseAgent)
    replayed = run_replay if block_steps == 1 else (lambda a, o, b: run_replay_steps(a, o, b, block_steps, sequence))
    plain = (lambda a, o, b: run_plain_blocks(a, o, b, block_steps)) if sequence else run_plain
    nograd = (lambda a, o, b: run_nograd_blocks(a, o, b, block_steps)) if sequence else run_nograd
    # Parity first (and warm-up).
    plain(agent, obs, B)
    g_plain = grads(module)
    agent.zero_grad(set_to_none=True)
    replayed(agent, obs, B)
    g_replay = grads(module)
    agent.zero_grad(set_to_none=True)
    identical = all(
        (a is None and b is None) or (a is not None and b is not None and torch.equal(a, b))
        for a, b in zip(g_plain, g_replay)
    )
    loops = [("plain", plain), ("replay", replayed), ("nograd", nograd)]
    if sequence:
        run_plain(agent, obs, B)  # warm-up
        agent.zero_grad(set_to_none=True)
        loops.append(("plain_steps", run_plain))
    if bare:
        run_bare(agent, obs, B)  # warm-up
        g_bare = grads(module)
        agent.zero_grad(set_to_none=True)
        bare_identical = all(
            (a is None and b is None) or (a is not None and b is not None and torch.equal(a, b))
            for a, b in zip(g_plain, g_bare)
        )
        loops.append(("bare", run_bare))
    times = {name: [] for name, _ in loops}
    for _ in range(repeats):
        for name, fn in loops:
            sync()
            t0 = time.perf_counter()
            fn(agent, obs, B)
            sync()
            times[name].append(time.perf_counter() - t0)
            agent.zero_grad(set_to_none=True)
    ms = {k: 1e3 * statistics.median(v) / T for k, v in times.items()}
    ratios = [r / p for r, p in zip(times["replay"], times["plain"])]
    overheads = [1e3 * (r - p - n) / T for r, p, n in zip(times["replay"], times["plain"], times["nograd"])]
    extra = {"sequence": sequence}
    if sequence:
        extra["plain_steps_ms_per_step"] = ms["plain_steps"]
    if bare:
        extra |= {
            "bare_ms_per_step": ms["bare"],
            "bare_identical_grads": bare_identical,
            "bare_over_plain": statistics.median(b / p for b, p in zip(times["bare"], times["plain"])),
        }
    return {
        **extra,
        "config": config,
        "device": device,
        "compiled": compile,
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


def bare_table(rows: list[dict], labels: list[str]) -> str:
    """``--bare``: replay next to the least a replay block can be, both against plain autograd."""
    lines = [
        "| agent | T | batch | plain ms/step | bare Function ms/step | replay ms/step | bare / plain | "
        "replay / plain | floor / plain |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for label, r in zip(labels, rows):
        lines.append(
            f"| {label} | {r['T']} | {r['batch']} | {r['plain_ms_per_step']:.3f} | {r['bare_ms_per_step']:.3f} | "
            f"{r['replay_ms_per_step']:.3f} | {r['bare_over_plain']:.2f}x | {r['replay_over_plain']:.2f}x | "
            f"{r['floor_over_plain']:.2f}x |"
        )
    return "\n".join(lines)


def table(rows: list[dict], labels: list[str]) -> str:
    lines = [
        "| agent | T | batch | steps per block | plain ms/step | replay ms/step | no-grad fwd ms/step | replay / plain "
        "(median, min-max) | floor / plain | overhead ms/block | grads identical | plain step loop ms/step |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for label, r in zip(labels, rows):
        lines.append(
            f"| {label}{' (compiled)' if r.get('compiled') else ''} | {r['T']} | {r['batch']} | {r['block_steps']} | {r['plain_ms_per_step']:.3f} | {r['replay_ms_per_step']:.3f} | "
            f"{r['nograd_ms_per_step']:.3f} | {r['replay_over_plain']:.2f}x ({r['replay_over_plain_min']:.2f}-"
            f"{r['replay_over_plain_max']:.2f}) | {r['floor_over_plain']:.2f}x | {r['overhead_ms_per_block']:.3f} | "
            f"{'yes' if r['identical_grads'] else 'NO'} | "
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
    ap.add_argument("--compile", action="store_true", help="run the agent under torch.compile (inductor)")
    ap.add_argument(
        "--block-steps",
        type=int,
        nargs="+",
        default=[1],
        help="steps per replay block (1: rl_replay.replay per step; k > 1: rl_replay.replay_steps)",
    )
    ap.add_argument("--all", action="store_true", help="every shipped agent (SHIPPED), as a markdown table")
    ap.add_argument(
        "--bare",
        action="store_true",
        help="also time a bare replay Function (no checks, no slabs, one nested backward per block): "
        "what the design itself costs per one-step block",
    )
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
            rows.append(
                measure(
                    cfg,
                    T,
                    args.batch,
                    args.repeats,
                    overrides,
                    block_steps=k,
                    device=args.device,
                    compile=args.compile,
                    bare=args.bare and k == 1,
                )
            )
            labels.append(label)
    print(json.dumps(rows, indent=1) if args.json else table(rows, labels))
    bare_rows = [(r, label) for r, label in zip(rows, labels) if "bare_ms_per_step" in r]
    if bare_rows and not args.json:
        print()
        print(bare_table([r for r, _ in bare_rows], [label for _, label in bare_rows]))
    return 0 if all(r["identical_grads"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
