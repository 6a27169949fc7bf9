"""Training throughput on CartPole-v1 (MLP agent): rl_replay's trainer vs the usual recipe.

* ``rl_replay``: ``rl_replay.run.setup.build(load_config('configs/default.yaml', overrides))``
  and ``trainer.step()`` -- the rollout's policy calls as replay blocks (``replay.block_steps``:
  16 by default, the stored rollout replayed in 16-step blocks, one batched call each for this
  stateless MLP; 1, a block per collected step: ``--set replay.block_steps=1``), one backward.
* ``batched``: what most PPO/A2C code does -- collect the rollout under ``torch.no_grad``,
  then one batched forward of the policy over the ``T * N`` stored observations for
  ``log_prob`` / ``value`` / ``entropy``, the same A2C loss (the trainer's algorithm's ``loss``),
  backward, gradient clipping, optimizer step. Same agent class, env, N, T, optimizer.

Both run in fresh processes, a fixed number of updates after one warm-up update, and the
env steps per second (collection + update) are compared. Before timing, one rollout's
gradient is computed both ways on the same data (replayed blocks vs a batched recompute)
and compared.

Usage::

    python -m scripts.bench learning                 # N = 8, T = 32 (configs/default.yaml)
    python -m scripts.bench learning --write-docs    # the same, and update docs/benchmarks.md
    python -m scripts.bench learning --smoke
    python -m scripts.bench learning --set replay.block_steps=1   # a replay block per collected step
"""

from __future__ import annotations

import argparse
import gc
import os
import sys
import tempfile
import time

import numpy as np
import torch
from tensordict import TensorDict

from rl_replay.rollout.sequence import step_inputs
from scripts.bench.common import (
    ROOT,
    describe_machine,
    grad_diff,
    grad_snapshot,
    load_line,
    run_isolated,
    set_threads,
    worker_cli,
)
from scripts.bench.report import add_worker_arguments, refuse_smoke_docs, write_section

CONFIG = os.path.join(ROOT, "configs", "default.yaml")
PRELOAD = ["torch", "tensordict", "gymnasium", "rl_replay", "rl_replay.run.setup", "scripts.bench.common"]


def build_trainer(spec: dict, run_dir: str):
    from rl_replay.config import load_config
    from rl_replay.run.setup import build

    overrides = [
        f"env.num_envs={spec['num_envs']}",
        f"collector.num_steps={spec['num_steps']}",
        f"seed={spec['seed']}",
        "device=cpu",
        "log.wandb_mode=disabled",
        "log.progress=false",
        "checkpoint.every=0",
        f"run_dir={run_dir}",
        *spec.get("set", []),
    ]
    return build(load_config(CONFIG, overrides))


class BatchedA2C:
    """No-grad collection, then one batched recompute over the stored rollout (CleanRL style).

    Uses the trainer's envs, agent, optimizer and loss config, so only the way the
    gradient is obtained differs. Autoreset handling matches rl_replay's Collector: the
    step after an episode end is gymnasium's autoreset step, marked ``valid=False``.
    """

    def __init__(self, trainer) -> None:
        self.cfg = trainer.cfg
        self.envs = trainer.collector.envs
        self.agent = trainer.model
        self.optimizer = trainer.optimizer
        self.trainer = trainer
        self.num_envs = self.envs.num_envs
        self.num_steps = self.cfg.collector.num_steps
        obs, _ = self.envs.reset(seed=self.cfg.seed)
        self.obs = torch.as_tensor(np.asarray(obs), dtype=torch.float32)
        self.is_first = torch.ones(self.num_envs, dtype=torch.bool)
        self.autoreset = np.zeros(self.num_envs, dtype=bool)

    def _state(self, n: int) -> TensorDict:
        return self.agent.initial_state(n)

    @torch.no_grad()
    def collect(self) -> tuple[TensorDict, torch.Tensor]:
        N = self.num_envs
        rows = []
        for _ in range(self.num_steps):
            out = self.agent(**step_inputs(self.obs, self._state(N), self.is_first))
            action = self.agent.distribution(out["outputs"]).sample()[0]
            valid = ~self.autoreset
            obs, reward, term, trunc, _ = self.envs.step(action.numpy())
            rows.append(
                TensorDict(
                    observation=self.obs,
                    is_first=self.is_first,
                    action=action,
                    reward=torch.as_tensor(reward, dtype=torch.float32),
                    terminated=torch.as_tensor(term & valid),
                    truncated=torch.as_tensor(trunc & valid),
                    valid=torch.as_tensor(valid),
                    batch_size=[N],
                )
            )
            self.is_first = torch.as_tensor(self.autoreset)
            self.autoreset = term | trunc
            self.obs = torch.as_tensor(np.asarray(obs), dtype=torch.float32)
        bootstrap = self.agent(**step_inputs(self.obs, self._state(N), self.is_first))["outputs", "value"][0]
        return torch.stack(rows), bootstrap  # [T, N], [N]

    def attach(self, data: TensorDict, bootstrap: torch.Tensor) -> TensorDict:
        """One forward over the (T, N) stored observations -> log_prob, entropy, value."""
        T, N = data.batch_size
        out = self.agent(observation=data["observation"], state=self._state(N), is_first=data["is_first"])["outputs"]
        dist = self.agent.distribution(out)
        data = data.clone(False)
        data.set("log_prob", dist.log_prob(data["action"]))
        data.set("entropy", dist.entropy())
        value = out["value"]
        data.set("value", value)
        data.set("next_value", torch.cat([value[1:].detach(), bootstrap.view(1, N)]))
        return data

    def step(self) -> None:
        from rl_replay.algorithms import optimizer_step

        data = self.attach(*self.collect())
        optimizer_step(
            self.trainer.algorithm.loss(data, self.cfg),
            self.trainer.model,
            self.optimizer,
            self.cfg.optim.max_grad_norm,
            self.trainer.guard,
        )


def gradient_check(trainer) -> tuple[float, float]:
    """One rl_replay rollout's gradient vs a batched recompute on the same rollout data."""
    from rl_replay.algorithms.losses import total_loss

    loss = trainer.algorithm.loss
    model = trainer.model
    model.zero_grad(set_to_none=True)
    rollout, _ = trainer.algorithm.collect()  # as the trainer's update attaches it (replay.block_steps)
    total_loss(loss(rollout.data, trainer.cfg)).backward()
    replayed = grad_snapshot(model)
    model.zero_grad(set_to_none=True)
    data = rollout.data.exclude("log_prob", "entropy", "value", "next_value").detach()
    bootstrap = rollout.data["next_value"][-1].detach()
    batched = BatchedA2C.__new__(BatchedA2C)
    batched.agent = model
    total_loss(loss(batched.attach(data, bootstrap), trainer.cfg)).backward()
    result = grad_diff(replayed, grad_snapshot(model))
    model.zero_grad(set_to_none=True)
    return result


def worker(spec: dict) -> dict:
    gc.collect()
    gc.freeze()
    set_threads(spec["threads"])
    with tempfile.TemporaryDirectory(prefix="bench_learning_") as run_dir:
        trainer = build_trainer(spec, run_dir)
        try:
            result: dict = {"method": spec["method"]}
            if spec["method"] == "rl_replay":
                result["grad_abs"], result["grad_rel"] = gradient_check(trainer)
                step = trainer.step
            else:
                step = BatchedA2C(trainer).step
            step()  # warm-up update
            per_update = spec["num_envs"] * spec["num_steps"]
            times = []
            t0 = time.perf_counter()
            for _ in range(spec["updates"]):
                t = time.perf_counter()
                step()
                times.append(time.perf_counter() - t)
            elapsed = time.perf_counter() - t0
            result.update(
                env_steps=per_update * spec["updates"],
                seconds=elapsed,
                steps_per_s=per_update * spec["updates"] / elapsed,
                median_update_s=float(np.median(times)),
            )
            if spec["method"] == "rl_replay":
                result["recent_return"] = float(np.mean(trainer.recent_returns)) if trainer.recent_returns else None
            return result
        finally:
            trainer.collector.envs.close()
            trainer.logger.close()


def docs_section(args, rep: dict, bat: dict, summary: str, grad_line: str) -> str:
    """The marked docs section: the settings, a table of both methods and the summary lines."""
    table = "| method | env steps/s | median update | env steps timed |\n|---|---:|---:|---:|\n" + "".join(
        f"| {m} | {r['steps_per_s']:.0f} | {r['median_update_s'] * 1e3:.1f} ms | {r['env_steps']} |\n"
        for m, r in (("rl_replay trainer", rep), ("batched (no-grad rollout + batched recompute)", bat))
    )
    head = (
        f"CartPole-v1, MLPAgent (hidden 64, 64), N = {args.num_envs}, T = {args.num_steps}, "
        f"{args.updates} timed updates after 1 warm-up\n\n"
    )
    return head + table + f"\n    {summary}\n    {grad_line}\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--num-envs", type=int, default=8)
    ap.add_argument("--num-steps", type=int, default=32)
    ap.add_argument("--updates", type=int, default=40)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="config override for both methods, e.g. --set replay.block_steps=1 (repeatable)",
    )
    add_worker_arguments(ap, "bench_learning")
    args = ap.parse_args(argv)
    if args.worker:
        return worker_cli(worker, args.worker)
    refuse_smoke_docs(ap, args)
    if args.smoke:
        args.num_envs, args.num_steps, args.updates = 2, 8, 3
    print(describe_machine(), f"| {args.threads} thread(s), launcher {args.launcher}", flush=True)
    print(
        f"CartPole-v1, agents.mlp:MLPAgent (configs/default.yaml), N = {args.num_envs} envs, "
        f"T = {args.num_steps} steps, {args.updates} timed updates after 1 warm-up, "
        "each method in a fresh process",
        flush=True,
    )
    t_start = time.perf_counter()
    results = {}
    for method in ("rl_replay", "batched"):
        spec = dict(
            method=method,
            num_envs=args.num_envs,
            num_steps=args.num_steps,
            updates=args.updates,
            threads=args.threads,
            seed=args.seed,
            set=args.set,
        )
        r = run_isolated(worker, spec, script=__spec__.name, launcher=args.launcher, timeout=1800, preload=PRELOAD)
        if "error" in r:
            print(f"{method}: ERROR {r['error']}\n{r.get('traceback', '')}")
            return 1
        results[method] = r
        print(
            f"{method:<10} {r['steps_per_s']:.0f} env steps/s  ({r['env_steps']} steps in "
            f"{r['seconds']:.2f} s, median update {r['median_update_s'] * 1e3:.1f} ms)",
            flush=True,
        )
    rep, bat = results["rl_replay"], results["batched"]
    grad_line = (
        f"gradient check: worst abs diff {rep['grad_abs']:.3e}, worst rel diff {rep['grad_rel']:.3e} "
        "(one rollout: replayed blocks vs batched recompute on the same data)"
    )
    summary = (
        f"summary learning: rl_replay {rep['steps_per_s']:.0f} steps/s, batched no-grad + recompute "
        f"{bat['steps_per_s']:.0f} steps/s, ratio rl_replay/batched = "
        f"{rep['steps_per_s'] / bat['steps_per_s']:.2f}"
    )
    print(grad_line)
    print(summary)
    if args.write_docs:
        write_section(args.write_docs, "bench_learning", docs_section(args, rep, bat, summary, grad_line))
    print(f"wall time {time.perf_counter() - t_start:.0f} s; {load_line()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
