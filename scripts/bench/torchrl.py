"""One recurrent PPO update beside TorchRL's: rl_replay's replay blocks, plain autograd, TorchRL's fused path.

The workload: the shipped ``lstm`` / ``gru`` agent (8-dim observations -> Linear 128 + tanh ->
core of ``--hidden`` units -> 4-action and value heads), one PPO epoch on one minibatch of ``--N``
envs, each a whole episode of T steps (``--episode-steps L`` adds episode starts inside, about
one per L steps), a synthetic stored rollout (seeded observations and actions; log-probs and
values from a no-grad pass). The same minibatch, loss (``PPO.loss``: clipped policy and value
terms, entropy bonus), gradient clipping and Adam step on every side; only the policy's
forward differs:

1. ``rl_replay``  the trainer's ``PPO.optimize``: replay blocks of ``--block-steps`` steps, each
                  a fused ``nn.LSTM`` / ``nn.GRU`` kernel call (``agents/cores.py``);
2. ``steps``      the same with the cores' step loop instead of the fused kernel (``cores.py``'s
                  ``step_loop``: what a block ran before, and what acting runs);
3. ``plain``      plain autograd over rl_replay's calls (every block's graph kept);
4. ``torchrl``    TorchRL's ``LSTMModule`` / ``GRUModule`` in recurrent mode (``nn.LSTM`` /
                  ``nn.GRU`` over the whole ``(N, T)`` batch, trajectories split and padded at
                  episode starts), between the agent's own encoder and heads
                  (``tensordict.nn.TensorDictSequential``), every activation kept.

Each (side, T) runs in a fresh ``python`` process, one torch thread: a warm-up update on the
first 34 steps (Adam's state, lazy initialisation), then the measured update; reported are its
seconds and its peak RSS growth (``VmHWM`` reset before it; with ``--device cuda`` the device's
peak allocation growth, the rollout stored on the device). The sides run in ABBA order, so a
drift of the machine hits each alike; ratios are taken pair by pair. First, in one process, the
gradients of the first minibatch's loss on the three sides are compared (float rounding: the
kernels sum in different orders).

TorchRL is an optional extra (``pip install -e ".[torchrl]"``); it pins tensordict below 0.15,
so a virtual environment of its own keeps the project's: ``python -m venv --system-site-packages
VENV && VENV/bin/pip install torchrl==0.14.1 tensordict==0.14.3`` and run this script with
``VENV/bin/python`` (every side then runs on that tensordict).
Where torchrl is missing (or does not import) the ``torchrl`` side is left out and said so.

Usage::

    python -m scripts.bench torchrl                             # lstm and gru, T = 1026 4098 16386
    python -m scripts.bench torchrl --kinds lstm --T 4098 --block-steps 64 --repeats 3
    python -m scripts.bench torchrl --smoke
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import statistics
import sys
import time

import gymnasium as gym
import torch
from tensordict import TensorDict

from scripts.bench.common import MemoryMeter, describe_machine, run_isolated, set_threads, worker_cli
from scripts.bench.cores import step_loop
from scripts.bench.ppo_update import bench_config, plain_calls, plain_optimize, run_update
from scripts.bench.report import fmt_bytes

PRELOAD = ["torch", "tensordict", "rl_replay", "scripts.bench.common", "scripts.bench.ppo_update"]

SIDES = ("rl_replay", "steps", "plain", "torchrl")
WARM_STEPS = 34
OBS, ACTIONS = 8, 4


def torchrl_missing() -> str | None:
    """Why TorchRL's side cannot run here (not installed, or its import fails), or None."""
    if importlib.util.find_spec("torchrl") is None:
        return "torchrl is not installed here"
    try:
        import torchrl.modules  # noqa: F401
    except Exception as exc:  # e.g. its compiled extension built for another torch
        return f"torchrl does not import here ({type(exc).__name__}: {exc})"
    return None


# ============================================================================ setup
def build(spec: dict, T: int):
    """(cfg, agent, optimizer, rollout) of one configuration, all seeded."""
    from rl_replay.agents.gru import GRUAgent
    from rl_replay.agents.lstm import LSTMAgent

    cfg = bench_config({"envs": spec["N"]}, T, epochs=1, minibatches=1)
    cfg.replay.block_steps = spec["block_steps"]
    torch.manual_seed(spec.get("seed", 0))
    agent_class = {"lstm": LSTMAgent, "gru": GRUAgent}[spec["kind"]]
    agent = agent_class(gym.spaces.Box(-1.0, 1.0, (OBS,)), gym.spaces.Discrete(ACTIONS), hidden_size=spec["hidden"])
    device = torch.device(spec.get("device", "cpu"))
    agent = agent.to(device)
    optimizer = torch.optim.Adam(agent.parameters(), lr=cfg.optim.lr, eps=cfg.optim.eps)
    return cfg, agent, optimizer, episodes_rollout(agent, T, spec["N"], spec.get("episode_steps", 0), device)


def episodes_rollout(agent, T: int, N: int, episode_steps: int, device: torch.device, seed: int = 1234):
    """A stored rollout of ``N`` envs x ``T`` steps: one episode per env from row 0, plus an
    episode start with probability ``1 / episode_steps`` at every later row if it is > 0."""
    from rl_replay.rollout.collector import Rollout

    g = torch.Generator().manual_seed(seed)
    observation = torch.randn(T, N, OBS, generator=g)
    is_first = torch.zeros(T, N, dtype=torch.bool)
    if episode_steps:
        is_first = torch.rand(T, N, generator=g) < 1.0 / episode_steps
    is_first[0] = True
    action = torch.randint(ACTIONS, (T, N), generator=g)
    observation, is_first, action = observation.to(device), is_first.to(device), action.to(device)
    start_state = agent.initial_state(N, device)
    with torch.no_grad():  # (T, N) inputs: one call over the whole rollout
        out = agent(observation=observation, state=start_state, is_first=is_first)["outputs"]
    dist = agent.distribution(out)
    value = out["value"]
    data = TensorDict(
        observation=observation,
        is_first=is_first,
        action=action,
        log_prob=dist.log_prob(action),
        entropy=dist.entropy(),
        value=value,
        reward=torch.randn(T, N, generator=g).to(device),
        terminated=torch.cat([is_first[1:], torch.zeros_like(is_first[:1])]),
        truncated=torch.zeros_like(is_first),
        valid=torch.ones_like(is_first),
        next_value=torch.cat([value[1:], torch.zeros_like(value[:1])]),
        batch_size=[T, N],
    )
    return Rollout(data, start_state, T * N)


class TorchRLPolicy(torch.nn.Module):
    """The agent's encoder and heads around TorchRL's ``LSTMModule`` / ``GRUModule`` (recurrent
    mode), whose ``nn.LSTM`` / ``nn.GRU`` starts from the agent's core's weights."""

    def __init__(self, agent):
        super().__init__()
        from tensordict.nn import TensorDictModule, TensorDictSequential
        from torchrl.modules import GRUModule, LSTMModule

        cell = agent.core
        self.lstm = "c" in agent.state_keys
        rnn_class = torch.nn.LSTM if self.lstm else torch.nn.GRU
        rnn = rnn_class(cell.input_size, cell.hidden_size, batch_first=True, device=cell.weight_ih.device)
        with torch.no_grad():
            for ours, theirs in PARAMETER_NAMES.items():
                getattr(rnn, theirs).copy_(getattr(cell, ours))
        state_keys = ["recurrent_state_h", "recurrent_state_c"] if self.lstm else ["recurrent_state"]
        module_class = LSTMModule if self.lstm else GRUModule
        core = module_class(
            in_keys=["embed", *state_keys],
            out_keys=["features", *(("next", k) for k in state_keys)],
            default_recurrent_mode=True,
            **{"lstm" if self.lstm else "gru": rnn},
        )
        self.state_keys = state_keys
        self.distribution = agent.distribution  # a bound method: the agent is not a submodule here
        self.sequence = TensorDictSequential(
            TensorDictModule(agent.encoder, in_keys=["observation"], out_keys=["embed"]),
            core,
            TensorDictModule(_Heads(agent), in_keys=["features"], out_keys=["logits", "value"]),
        )

    def forward(self, data: TensorDict, start_state: TensorDict) -> TensorDict:
        """``log_prob``, ``entropy``, ``value`` ``(T, n)`` over the stored ``(T, n)`` minibatch."""
        T, n = data.batch_size
        td = TensorDict(
            observation=data["observation"].transpose(0, 1),
            is_init=data["is_first"].transpose(0, 1).unsqueeze(-1),
            batch_size=[n, T],
        )
        for ours, key in zip(("h", "c"), self.state_keys):
            # TorchRL keeps a state per step, (n, T, layers, H); recurrent mode reads step 0's.
            td[key] = start_state[ours][:, None, None, :].expand(n, T, 1, start_state[ours].shape[-1])
        out = self.sequence(td)
        outputs = TensorDict(
            dist=TensorDict(logits=out["logits"].transpose(0, 1), batch_size=[T, n]),
            value=out["value"].transpose(0, 1),
            batch_size=[T, n],
        )
        dist = self.distribution(outputs)
        return TensorDict(
            log_prob=dist.log_prob(data["action"]), entropy=dist.entropy(), value=outputs["value"], batch_size=[T, n]
        )


# the cell's parameters and their names in nn.LSTM / nn.GRU (the same gate order)
PARAMETER_NAMES = {
    "weight_ih": "weight_ih_l0",
    "weight_hh": "weight_hh_l0",
    "bias_ih": "bias_ih_l0",
    "bias_hh": "bias_hh_l0",
}


class _Heads(torch.nn.Module):
    """The agent's readout, actor and critic heads (what follows its core), sharing its modules."""

    def __init__(self, agent):
        super().__init__()
        assert not agent.skip and not agent.separate_critic, "the shipped agents' defaults"
        self.readout, self.actor_mlp, self.critic_mlp = agent.readout, agent.actor_mlp, agent.critic_mlp
        self.head, self.value = agent.head, agent.value

    def forward(self, features: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        x = self.readout(features)
        return self.head(self.actor_mlp(x))["logits"], self.value(self.critic_mlp(x)).squeeze(-1)


def torchrl_model(agent) -> tuple[TorchRLPolicy, torch.nn.Module]:
    """The TorchRL policy and the module whose parameters it trains (the agent's encoder and
    heads, TorchRL's recurrent module; not the agent's core)."""
    policy = TorchRLPolicy(agent)
    return policy, policy.sequence


# ============================================================================ worker
def update(side: str, cfg, agent, optimizer, rollout, trl=None) -> None:
    if side == "rl_replay":
        run_update("rl_replay", cfg, agent, optimizer, rollout)
    elif side == "steps":
        with step_loop():
            run_update("rl_replay", cfg, agent, optimizer, rollout)
    elif side == "plain":
        plain_optimize(cfg, agent, optimizer, rollout)
    else:
        policy, model = trl
        plain_optimize(cfg, model, optimizer, rollout, calls=lambda _m, data, start, _k: policy(data, start))


def worker(spec: dict) -> dict:
    set_threads(1)
    cfg, agent, optimizer, rollout = build(spec, spec["T"])
    trl = None
    if spec["side"] == "torchrl":
        trl = torchrl_model(agent)
        optimizer = torch.optim.Adam(trl[1].parameters(), lr=cfg.optim.lr, eps=cfg.optim.eps)
    warm = type(rollout)(rollout.data[:WARM_STEPS], rollout.start_state, WARM_STEPS * spec["N"])
    update(spec["side"], cfg, agent, optimizer, warm, trl)
    device = torch.device(spec.get("device", "cpu"))
    meter = MemoryMeter(device)
    torch.manual_seed(1)
    meter.start()
    t0 = time.perf_counter()
    update(spec["side"], cfg, agent, optimizer, rollout, trl)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    seconds = time.perf_counter() - t0
    peak = meter.peak_cuda_growth() if device.type == "cuda" else meter.peak_rss_growth()
    return {"seconds": seconds, "peak_growth": peak}


def gradients(spec: dict) -> dict[str, float]:
    """Largest relative gradient difference of each side from plain autograd, one process."""
    from rl_replay.algorithms.common import total_loss
    from rl_replay.algorithms.losses import gae_targets
    from rl_replay.algorithms.ppo import PPO

    set_threads(1)
    cfg, agent, _, rollout = build(spec, spec["T"])
    data = rollout.data
    adv, ret, _ = gae_targets(data, gamma=cfg.loss.gamma, gae_lambda=cfg.loss.gae_lambda)
    stored = TensorDict(old_log_prob=data["log_prob"], old_value=data["value"], advantage=adv, valid=data["valid"])
    stored["return"] = ret

    def grads(batch: TensorDict, model: torch.nn.Module) -> dict[str, torch.Tensor]:
        model.zero_grad(set_to_none=True)
        total_loss(PPO.loss(stored.clone(False).update(batch), cfg)).backward()
        return {n: p.grad.clone() for n, p in model.named_parameters()}

    reference = grads(plain_calls(agent, data, rollout.start_state, spec["block_steps"]), agent)
    sides = {"rl_replay": grads(_replay_calls(agent, data, rollout.start_state, spec["block_steps"]), agent)}
    with step_loop():
        sides["steps"] = grads(_replay_calls(agent, data, rollout.start_state, spec["block_steps"]), agent)
    if spec.get("torchrl"):
        policy, model = torchrl_model(agent)
        theirs = grads(policy(data, rollout.start_state), model)
        prefix = "module.1.lstm." if policy.lstm else "module.1.gru."
        renamed = {}
        for name, g in theirs.items():
            name = name.removeprefix("module.0.module.").removeprefix("module.2.module.")
            for ours, their in PARAMETER_NAMES.items():
                if name == prefix + their:
                    name = "core." + ours
            renamed["encoder." + name if name[0].isdigit() else name] = g
        sides["torchrl"] = renamed
    out = {}
    for side, got in sides.items():
        assert set(got) == set(reference), (side, sorted(set(got) ^ set(reference)))
        out[side] = max(float((got[n] - r).abs().max() / r.abs().max().clamp_min(1e-30)) for n, r in reference.items())
    return out


def _replay_calls(agent, data, start_state, block_steps):
    from rl_replay.agent import Policy
    from rl_replay.algorithms.stored import replay_sequence
    from rl_replay.engine import GradientAccumulator

    return replay_sequence(Policy.of(agent), data, start_state, GradientAccumulator(), None, block_steps)


# ============================================================================ report
def _s(xs: list[float]) -> str:
    return f"{statistics.median(xs):.2f} s ({min(xs):.2f}-{max(xs):.2f})"


def _ratio(xs: list[float]) -> str:
    return f"{statistics.median(xs):.2f}x ({min(xs):.2f}-{max(xs):.2f})"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--kinds", nargs="+", default=["lstm", "gru"], choices=["lstm", "gru"])
    parser.add_argument("--T", type=int, nargs="+", default=[1026, 4098, 16386])
    parser.add_argument("--N", type=int, default=16, help="envs in the minibatch")
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--block-steps", type=int, default=16, help="rl_replay's replay.block_steps")
    parser.add_argument("--episode-steps", type=int, default=0, help="about one episode start per this many steps")
    parser.add_argument("--sides", nargs="+", default=list(SIDES), choices=SIDES)
    parser.add_argument("--repeats", type=int, default=3, help="ABBA pairs of fresh processes per T")
    parser.add_argument("--device", default="cpu", help="cpu or cuda")
    parser.add_argument("--check-T", type=int, default=258, help="T of the gradient comparison")
    parser.add_argument("--json", help="write every measurement here")
    parser.add_argument("--smoke", action="store_true", help="T = 66, N = 4, hidden 16, 1 repeat")
    args = parser.parse_args(argv)
    if args.worker:
        return worker_cli(worker, args.worker)
    if args.smoke:
        args.T, args.N, args.hidden, args.repeats, args.check_T = [66], 4, 16, 1, 66
        args.episode_steps = args.episode_steps or 20
    missing = torchrl_missing() if "torchrl" in args.sides else None
    sides = [s for s in args.sides if s != "torchrl" or missing is None]
    if missing:
        print(f"{missing}: its side is left out (see the docstring)")
    print(describe_machine())
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        parser.error("--device cuda: no CUDA device here")
    memory = "peak CUDA allocation growth" if args.device.startswith("cuda") else "peak RSS growth"
    print(f"each cell: the update's seconds, median (min-max) of {args.repeats}, and its median {memory}")
    base = dict(
        N=args.N, hidden=args.hidden, block_steps=args.block_steps, episode_steps=args.episode_steps, device=args.device
    )
    records = []
    for kind in args.kinds:
        check = gradients(dict(base, kind=kind, T=args.check_T, torchrl="torchrl" in sides))
        print(
            f"{kind}: largest relative gradient difference from plain autograd at T = {args.check_T}: "
            + ", ".join(f"{s} {d:.1e}" for s, d in check.items())
        )
        print(f"| core | T | {' | '.join(sides)} | rl_replay / torchrl time | torchrl / rl_replay memory |")
        print("|---|---:|" + "---:|" * (len(sides) + 2))
        for T in args.T:
            runs: dict[str, list[dict]] = {s: [] for s in sides}
            for rep in range(args.repeats):
                for side in sides if rep % 2 == 0 else reversed(sides):
                    spec = dict(base, kind=kind, T=T, side=side)
                    # each measurement in a fresh interpreter (no side's imports in another's RSS); a
                    # smoke run measures nothing and forks its processes from one that imported once
                    launcher = "forkserver" if args.smoke else "subprocess"
                    r = run_isolated(
                        worker, spec, script=__spec__.name, launcher=launcher, timeout=3600, preload=PRELOAD
                    )
                    if "error" in r:
                        print(f"{kind} T={T} {side}: {r['error']}\n{r.get('traceback', '')}", file=sys.stderr)
                        return 1
                    runs[side].append(r)
                    records.append(dict(spec, **r))
            cells = [
                f"{_s([r['seconds'] for r in runs[s]])}, {fmt_bytes(statistics.median(r['peak_growth'] for r in runs[s]))}"
                for s in sides
            ]
            time_ratio = memory_ratio = "-"
            if "torchrl" in runs and "rl_replay" in runs:
                pairs = list(zip(runs["rl_replay"], runs["torchrl"]))
                time_ratio = _ratio([a["seconds"] / b["seconds"] for a, b in pairs])
                memory_ratio = _ratio([b["peak_growth"] / max(a["peak_growth"], 1) for a, b in pairs])
            print(f"| {kind} | {T} | {' | '.join(cells)} | {time_ratio} | {memory_ratio} |", flush=True)
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(records, fh, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
