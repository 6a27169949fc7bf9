"""Peak memory and time of one recurrent PPO update: rl_replay vs plain autograd.

One update = ``epochs`` x ``num_minibatches`` optimizer steps on one stored rollout of T
steps x N envs; each minibatch holds the whole T-step sequences of N / M envs. Two ways:

1. ``plain``      the CleanRL LSTM recipe: each minibatch's sequence is re-run with grad
                  from its stored start state, the graph of all T steps kept until backward;
2. ``rl_replay``  :meth:`rl_replay.algorithms.ppo.PPO.optimize`, the trainer's code path:
                  each step of the sequence is a replay block.

Both run the same sequence loop (:func:`rl_replay.algorithms.stored.replay_sequence`, without and
with a gradient accumulator) and use the same loss (``PPO.loss``), the same minibatch order
and ``optimizer_step``. The policy is the ``gru`` agent with a 3 x 1024 tanh encoder
(hidden 512, 64-dim observations, 8 actions), 16 envs, 4 epochs, 4 minibatches; the
rollout is synthetic (seeded observations, episode starts, actions; log-probs and values
from a no-grad pass), so every method and process sees the same numbers.

Each configuration runs in a fresh process: a warm-up update at T = 2 (Adam state,
allocator), then the measured update. Memory: peak RSS growth of the measured update
(Linux ``VmHWM``, see ``common.MemoryMeter``); ``block inputs`` is the largest
minibatch's saved block-input bytes (``memory/replay_saved_bytes``). The gradient of the
first minibatch is compared between the two methods at the smallest T.

Usage::

    python -m scripts.bench ppo --smoke
    python -m scripts.bench ppo                     # T = 128, 512, 2048
    python -m scripts.bench ppo --T 128 512 --write-docs
    python -m scripts.bench ppo --T 2048 --methods rl_replay --epochs 1   # memory at long T, 1/4 the time
    python -m scripts.bench ppo --config configs/memory_4096.yaml --epochs 1  # a shipped config's update
    python -m scripts.bench ppo --config configs/memory_1024.yaml --epochs 1 --set replay.block_steps=16
    python -m scripts.bench ppo --pixels --smoke          # the pixel workload (pixels.py)
    python -m scripts.bench ppo --pixels --device cuda    # T = 512, 2048, 8192 on a GPU

``--pixels`` runs the workload where flat memory is decisive instead: a CNN + GRU agent on 84x84x3
uint8 frames (``scripts/bench/pixels.py`` says what, and what its summary lines report), on the
CPU or a CUDA device (``--device``).

``--config CONFIG`` takes the agent, ``env.num_envs``, the PPO and loss settings and T
(``collector.num_steps``, unless ``--T`` is given) from a shipped config, and the observation
and action spaces from its env (one env is made to read them; a flat ``Box`` observation and a
``Discrete`` action space are needed); the rollout is synthetic as above.
"""

from __future__ import annotations

import argparse
import sys
import time

import gymnasium as gym
import torch

from scripts.bench.common import (
    GLIBC_NOTE,
    MemoryMeter,
    describe_machine,
    grad_diff,
    run_isolated,
    set_threads,
    worker_cli,
)
from scripts.bench.ppo_update import bench_config, run_update, stored_rollout
from scripts.bench.report import add_write_docs_argument, fmt_bytes, fmt_s, refuse_smoke_docs, write_section

PRELOAD = ["torch", "tensordict", "gymnasium", "rl_replay", "scripts.bench.common", "scripts.bench.ppo_update"]
FULL = dict(obs=64, encoder=[1024, 1024, 1024], hidden=512, actions=8, envs=16, epochs=4, minibatches=4)
SMOKE = dict(obs=8, encoder=[32, 32], hidden=16, actions=4, envs=8, epochs=2, minibatches=2)


# ============================================================================ setup
def build(spec: dict, T: int):
    """(cfg, agent, optimizer, rollout) for one configuration, all seeded."""
    from rl_replay.agent import build_agent

    if spec.get("config"):
        return build_from_config(spec, T)
    p = spec["policy"]
    cfg = bench_config(p, T, spec.get("epochs") or p["epochs"], spec.get("minibatches", p["minibatches"]))
    obs_space = gym.spaces.Box(-10.0, 10.0, shape=(p["obs"],))
    torch.manual_seed(spec.get("seed", 0))
    agent = build_agent(
        "gru", {"hidden_size": p["hidden"], "encoder_sizes": p["encoder"]}, obs_space, gym.spaces.Discrete(p["actions"])
    )
    optimizer = torch.optim.Adam(agent.parameters(), lr=cfg.optim.lr, eps=cfg.optim.eps)
    return cfg, agent, optimizer, synthetic_rollout(agent, T, p["envs"], p["obs"])


def build_from_config(spec: dict, T: int):
    """(cfg, agent, optimizer, rollout) with a shipped config's agent, envs and PPO settings."""
    from rl_replay.agent import build_agent
    from rl_replay.config import load_config
    from rl_replay.rollout.environment import envs_from_config
    from rl_replay.run.setup import make_optimizer

    overrides = [f"collector.num_steps={T}", "log.wandb_mode=disabled"]
    if spec.get("epochs"):
        overrides.append(f"ppo.epochs={spec['epochs']}")
    overrides += spec.get("overrides", [])
    cfg = load_config(spec["config"], overrides)
    if cfg.loss.algorithm != "ppo":
        raise SystemExit(f"bench_ppo: {spec['config']} trains with {cfg.loss.algorithm!r}, not ppo")
    probe = envs_from_config(cfg.env, 1)
    obs_space, act_space = probe.single_observation_space, probe.single_action_space
    probe.close()
    if not (
        isinstance(obs_space, gym.spaces.Box)
        and len(obs_space.shape) == 1
        and isinstance(act_space, gym.spaces.Discrete)
    ):
        raise SystemExit(
            f"bench_ppo: --config needs a flat Box observation and a Discrete action space; "
            f"{cfg.env.id} has {obs_space} and {act_space}"
        )
    torch.manual_seed(spec.get("seed", 0))
    agent = build_agent(cfg.agent.target, cfg.agent.kwargs, obs_space, act_space)
    optimizer = make_optimizer(agent.parameters(), cfg.optim)
    return cfg, agent, optimizer, synthetic_rollout(agent, T, cfg.env.num_envs, obs_space.shape[0])


def synthetic_rollout(agent, T: int, N: int, obs_dim: int):
    """A stored rollout as ``Collector.collect()`` returns it, from seeded data."""
    g = torch.Generator().manual_seed(1234)
    return stored_rollout(agent, torch.randn(T, N, obs_dim, generator=g), g)


def _record_minibatch_forwards(records: list) -> None:
    """Wrap PPO's replay_sequence: per minibatch, what its forward left in use (the slab's
    bytes handed out, glibc heap in use, RSS) once its T blocks have run."""
    from rl_replay.algorithms import ppo as ppo_module
    from rl_replay.run.memory_stats import heap_in_use
    from scripts.bench.common import current_rss

    real = ppo_module.replay_sequence

    def recording(policy, data, start_state, accumulator, bptt_truncate=None, **kwargs):
        heap0, rss0 = heap_in_use(), current_rss()
        out = real(policy, data, start_state, accumulator, bptt_truncate, **kwargs)
        heap1 = heap_in_use()
        records.append(
            dict(
                slab=sum(accumulator.slabs.used_bytes().values()),
                heap=None if heap0 is None else heap1 - heap0,
                rss=current_rss() - rss0,
                saved=accumulator.saved_bytes,
            )
        )
        return out

    ppo_module.replay_sequence = recording


def worker(spec: dict) -> dict:
    if spec.get("pixels"):
        from scripts.bench.pixels import worker as pixel_worker

        return pixel_worker(spec)
    return _worker(spec)


def _worker(spec: dict) -> dict:
    set_threads(spec.get("threads", 1))
    torch.manual_seed(0)
    cfg, agent, optimizer, rollout = build(spec, spec["T"])
    _, _, _, warm = build(spec, 2)
    run_update(spec["method"], cfg, agent, optimizer, warm)  # Adam state, allocator warm-up
    records: list = []
    if spec["method"] == "rl_replay":
        _record_minibatch_forwards(records)
    meter = MemoryMeter(torch.device("cpu"))
    torch.manual_seed(1)  # the same minibatch order for both methods
    meter.start()
    t0 = time.perf_counter()
    metrics = run_update(spec["method"], cfg, agent, optimizer, rollout)
    seconds = time.perf_counter() - t0
    out = {
        "peak_rss_growth": meter.peak_rss_growth(),
        "seconds": seconds,
        "block_input_bytes": metrics.get("memory/replay_saved_bytes"),
    }
    if records:
        out["minibatch_forward"] = {
            k: max((r[k] for r in records if r[k] is not None), default=None) for k in ("slab", "heap", "rss", "saved")
        }
    return out


class GradRecorder(torch.optim.Optimizer):
    """Records each step's gradients and leaves the parameters unchanged."""

    def __init__(self, params):
        super().__init__(params, {})
        self.grads = []

    @torch.no_grad()
    def step(self, closure=None):
        self.grads.append([p.grad.detach().clone() for g in self.param_groups for p in g["params"]])


def sweep(
    worker,
    spec: dict,
    Ts,
    methods,
    *,
    script: str,
    timeout: float,
    preload,
    memory: str = "peak RSS growth",
    memory_key: str = "peak_rss_growth",
):
    """Run ``worker`` once per (T, method), each in a fresh process; print a line per run.

    Returns ``{(T, method): result}``; a result holds ``error`` where the run failed.
    """
    results = {}
    for T in Ts:
        for method in methods:
            r = run_isolated(
                worker,
                {**spec, "T": T, "method": method},
                script=script,
                launcher="forkserver",
                timeout=timeout,
                preload=preload,
            )
            results[(T, method)] = r
            if "error" in r:
                print(f"T={T} {method}: ERROR {r['error']}\n{r.get('traceback', '')}")
                continue
            line = f"T={T:<5d} {method:<10s} {memory} {fmt_bytes(r[memory_key]):>10s}  update {fmt_s(r['seconds']):>9s}"
            if r["block_input_bytes"]:
                line += f"  block inputs {fmt_bytes(r['block_input_bytes'])}"
            mf = r.get("minibatch_forward")
            if mf:
                line += (
                    f"  largest minibatch forward: slab {fmt_bytes(mf['slab'])}, heap +"
                    f"{fmt_bytes(mf['heap'] or 0)}, RSS +{fmt_bytes(mf['rss'])}"
                )
            print(line, flush=True)
    return results


def grad_check(spec: dict, T: int, build=None, run_update=None) -> tuple[float, float]:
    """Worst (abs, rel) difference of every minibatch gradient of one epoch between the methods.

    ``build`` / ``run_update``: this script's by default; ``--pixels`` passes its own (``pixels.build``).
    """
    build = build or globals()["build"]
    run_update = run_update or globals()["run_update"]
    grads = {}
    for method in ("plain", "rl_replay"):
        cfg, agent, _, rollout = build({**spec, "epochs": 1}, T)
        recorder = GradRecorder(agent.parameters())
        torch.manual_seed(1)
        run_update(method, cfg, agent, recorder, rollout)
        names = [n for n, _ in agent.named_parameters()]
        grads[method] = [dict(zip(names, g)) for g in recorder.grads]
    if not grads["plain"] or not all(any(g.abs().sum() > 0 for g in step.values()) for step in grads["plain"]):
        raise RuntimeError("gradient check is vacuous: the reference gradient is zero")
    worst = (0.0, 0.0)
    for a, b in zip(grads["rl_replay"], grads["plain"]):
        d = grad_diff(a, b)
        worst = (max(worst[0], d[0]), max(worst[1], d[1]))
    return worst


# ============================================================================ report
def docs_section(rows: list[tuple[int, dict, dict]], check_T: int, worst: tuple[float, float]) -> str:
    """The marked docs section: one row per T (plain and rl_replay results) and the gradient check."""
    body = [
        "| T | plain peak RSS growth | rl_replay peak RSS growth | rl_replay block inputs "
        "| plain update | rl_replay update | time ratio |",
        "|---|---|---|---|---|---|---|",
    ]
    for T, plain, rep in rows:
        body.append(
            f"| {T} | {fmt_bytes(plain['peak_rss_growth'])} | {fmt_bytes(rep['peak_rss_growth'])} | "
            f"{fmt_bytes(rep['block_input_bytes'])} | {fmt_s(plain['seconds'])} | "
            f"{fmt_s(rep['seconds'])} | {rep['seconds'] / plain['seconds']:.2f}x |"
        )
    body.append("")
    body.append(
        f"Gradient check (every minibatch of one epoch, T={check_T}): worst abs diff "
        f"{worst[0]:.1e}, worst rel diff {worst[1]:.1e}. {describe_machine()}"
    )
    return "\n".join(body)


# ============================================================================ main
def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--smoke", action="store_true", help="tiny policy, T = 8 and 16 (for tests)")
    parser.add_argument("--T", type=int, nargs="+", help="default: 128 512 2048 (with --config: its num_steps)")
    parser.add_argument("--config", help="a shipped PPO config: its agent, envs and PPO settings (see above)")
    parser.add_argument("--methods", nargs="+", default=["plain", "rl_replay"])
    parser.add_argument("--epochs", type=int, help="override the 4 epochs (peak memory is one minibatch's)")
    parser.add_argument(
        "--set",
        nargs="+",
        default=[],
        metavar="KEY=VALUE",
        help="with --config: config overrides, e.g. replay.block_steps=16",
    )
    parser.add_argument("--timeout", type=float, help="seconds per configuration (default 1800; --pixels 7200)")
    parser.add_argument(
        "--pixels", action="store_true", help="the pixel workload: CNN + GRU on 84x84x3 uint8 frames (see above)"
    )
    parser.add_argument("--device", default="cpu", help="with --pixels: cpu or cuda")
    add_write_docs_argument(parser, "bench_ppo")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        return worker_cli(worker, args.worker)
    if args.pixels:
        return pixels_main(parser, args)
    if args.device != "cpu":
        parser.error("--device applies to --pixels (the GRU workload runs on the CPU)")
    args.timeout = args.timeout or 1800
    if args.write_docs and args.config:
        parser.error("--write-docs updates the GRU table of docs/benchmarks.md; it does not take --config")
    refuse_smoke_docs(parser, args)
    policy = SMOKE if args.smoke else FULL
    if args.smoke:
        Ts = [8, 16]
    elif args.T:
        Ts = args.T
    elif args.config:
        from rl_replay.config import load_config

        Ts = [load_config(args.config).collector.num_steps]
    else:
        Ts = [128, 512, 2048]
    if args.set and not args.config:
        parser.error("--set overrides a shipped config's keys: give --config too")
    spec = {"policy": policy, "threads": 1, "config": args.config, "overrides": args.set}
    if args.epochs:
        spec["epochs"] = args.epochs
    set_threads(1)
    print(describe_machine())
    check_T = min(min(Ts), 128)  # the gradient check costs two extra updates
    worst = grad_check(spec, check_T)
    print(f"gradient check: worst abs diff {worst[0]:.3e}, worst rel diff {worst[1]:.3e}")
    rows: list = []
    results = sweep(worker, spec, Ts, args.methods, script=__spec__.name, timeout=args.timeout, preload=PRELOAD)
    ok = [T for T in Ts if all("error" not in results[(T, m)] for m in args.methods)]
    for T in ok:
        plain, rep = results.get((T, "plain")), results.get((T, "rl_replay"))
        if plain and rep:
            rows.append((T, plain, rep))
            print(
                f"summary T={T}: time rl_replay/plain {rep['seconds'] / plain['seconds']:.2f}x, "
                f"memory rl_replay/plain {rep['peak_rss_growth'] / max(plain['peak_rss_growth'], 1):.2f}x"
            )
    reps = [(T, results[(T, "rl_replay")]) for T in ok if (T, "rl_replay") in results]
    if len(reps) >= 2:
        (t0, a), (t1, b) = reps[0], reps[-1]
        slope = (b["peak_rss_growth"] - a["peak_rss_growth"]) / (t1 - t0)
        per_step = b["block_input_bytes"] / t1
        print(
            f"summary memory slope rl_replay: {fmt_bytes(slope)} per step between T={t0} and T={t1}; "
            f"block inputs {fmt_bytes(per_step)} per step; ratio {slope / per_step:.2f}"
        )
        if a.get("minibatch_forward") and b.get("minibatch_forward"):
            fa, fb = a["minibatch_forward"], b["minibatch_forward"]
            for key in ("slab", "heap", "rss"):
                if fa[key] is not None and fb[key] is not None:
                    d = (fb[key] - fa[key]) / (t1 - t0)
                    print(
                        f"summary minibatch forward {key}: {fmt_bytes(d)} per step "
                        f"({d / per_step:.2f}x the block inputs)"
                    )
    print(GLIBC_NOTE)
    if args.write_docs and rows:
        write_section(args.write_docs, "bench_ppo", docs_section(rows, check_T, worst))
    return 0 if all("error" not in r for r in results.values()) else 1


def pixels_main(parser: argparse.ArgumentParser, args: argparse.Namespace) -> int:
    """``--pixels``: the CNN + GRU update on uint8 frames, T = 512, 2048, 8192 by default."""
    import scripts.bench.pixels as pixels

    if args.config or args.set or args.write_docs:
        parser.error("--pixels runs its own agent and frames: it takes no --config, --set or --write-docs")
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        parser.error("--device cuda: no CUDA device here")
    Ts = [8, 16] if args.smoke else (args.T or [512, 2048, 8192])
    spec = {
        "pixels": True,
        "policy": pixels.SMOKE if args.smoke else pixels.FULL,
        "threads": 1,
        "device": args.device,
        "epochs": args.epochs,
    }
    memory = "peak device memory growth" if args.device.startswith("cuda") else "peak RSS growth"
    set_threads(1)
    print(describe_machine())
    worst = grad_check(spec, 8, build=pixels.build, run_update=run_update)
    print(f"gradient check: worst abs diff {worst[0]:.3e}, worst rel diff {worst[1]:.3e}")
    results = sweep(
        worker,
        spec,
        Ts,
        args.methods,
        script=__spec__.name,
        timeout=args.timeout or 7200,
        preload=pixels.PRELOAD,
        memory=memory,
        memory_key="peak_growth",
    )
    for line in pixels.summarize(results, Ts, memory):
        print(line)
    return 0 if all("error" not in r for r in results.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
