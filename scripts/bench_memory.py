"""Memory and time of one rollout's gradient: plain autograd vs checkpointing vs rl_replay.

For each policy and rollout length T this runs a T-step rollout (the policy called once
per timestep, an A2C-style loss, one ``backward``) four ways, each configuration in a
fresh process. The loss (``--loss``) is built from one small graph per step by default;
``--loss stacked`` computes the same terms once on the stacked ``(T, B)`` outputs, as the
trainer's losses do (O(1) graph nodes instead of ~10 per step):

1. ``plain``           plain autograd, the whole graph kept until backward;
2. ``checkpoint``      ``torch.utils.checkpoint.checkpoint(policy, ..., use_reentrant=False)``
                       per timestep;
3. ``checkpoint_cpu``  the same inside ``torch.autograd.graph.save_on_cpu`` (on a CPU
                       machine ``save_on_cpu`` keeps tensors where they are);
4. ``rl_replay``       ``rl_replay.checkpoint_fsdp_forward`` per timestep (small_gru also
                       runs ``rl_replay_td``: ``rl_replay.replay`` with a TensorDict, the
                       trainer's code path).

Measured per configuration: live tensor bytes held for backward at the end of the rollout
forward (see ``LiveTensorCensus`` in ``_bench_common.py``), peak RSS growth (CPU) or
``torch.cuda.max_memory_allocated`` growth (CUDA), rollout-forward time, backward time,
and the gradients of methods 2-4 against method 1.

Time and memory budgets: a worker times a short warm-up rollout and, against
``--max-config-seconds`` (and what is left of ``--budget-seconds``), runs the full
configuration with fewer timing repetitions, or only the forward (memory, no backward),
or skips it, saying why; a configuration whose memory estimate (from the same method at
a smaller T) exceeds ``--mem-budget-gib`` is skipped before it starts. Within each T the
methods run in the order plain, rl_replay, checkpoint_cpu, checkpoint, so a budget cut
drops the baselines first. ``--json`` keeps every result; ``--merge`` adds a later run to
them and ``--render-only`` redraws tables, plots and the docs section from them.

Usage::

    python scripts/bench_memory.py --smoke
    python scripts/bench_memory.py --policy gru
    python scripts/bench_memory.py --policy mlp --T 1024 --methods plain rl_replay --merge --json r.json
    python scripts/bench_memory.py --policy small_gru --profile   # cProfile of rl_replay
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch import nn  # noqa: E402
from torch.utils.checkpoint import checkpoint  # noqa: E402

import rl_replay  # noqa: E402
from _bench_common import (  # noqa: E402
    GLIBC_NOTE, LiveTensorCensus, MemoryMeter, describe_machine, load_line, fmt_bytes, fmt_s, grad_diff,
    grad_snapshot, median, run_isolated, set_threads, update_marked_section, worker_cli,
)

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
METHODS = ("plain", "checkpoint", "checkpoint_cpu", "rl_replay")
PRELOAD = ["torch", "torch.utils.checkpoint", "tensordict", "rl_replay", "_bench_common"]

# kind: gru (recurrent: obs -> MLP encoder -> GRUCell -> heads) or mlp (stateless)
POLICIES: dict[str, dict] = {
    "gru": dict(kind="gru", obs=64, width=1024, layers=3, hidden=512, actions=8, batch=32),
    "mlp": dict(kind="mlp", obs=64, width=1024, layers=6, actions=8, batch=64),
    "wide": dict(kind="mlp", obs=256, width=4096, layers=4, actions=8, batch=16),
    "small_gru": dict(kind="gru", obs=32, width=256, layers=1, hidden=256, actions=8, batch=16),
    # --smoke
    "tiny_gru": dict(kind="gru", obs=8, width=32, layers=2, hidden=16, actions=4, batch=4),
    "tiny_mlp": dict(kind="mlp", obs=8, width=32, layers=3, actions=4, batch=4),
}
DEFAULT_TS = (64, 256, 1024, 4096)


# ============================================================================ policies
def encoder(obs: int, width: int, layers: int) -> nn.Sequential:
    mods: list[nn.Module] = []
    for _ in range(layers):
        mods += [nn.Linear(obs, width), nn.Tanh()]
        obs = width
    return nn.Sequential(*mods)


class GRUPolicy(nn.Module):
    """obs -> tanh MLP encoder -> GRUCell -> (logits, value, next hidden state)."""

    def __init__(self, obs, width, layers, hidden, actions, **_):
        super().__init__()
        self.encoder = encoder(obs, width, layers)
        self.cell = nn.GRUCell(width, hidden)
        self.actor = nn.Linear(hidden, actions)
        self.critic = nn.Linear(hidden, 1)

    def forward(self, obs, h):
        h = self.cell(self.encoder(obs), h)
        return self.actor(h), self.critic(h).squeeze(-1), h


class MLPPolicy(nn.Module):
    """obs -> deep tanh MLP -> (logits, value); no recurrence."""

    def __init__(self, obs, width, layers, actions, **_):
        super().__init__()
        self.trunk = encoder(obs, width, layers)
        self.actor = nn.Linear(width, actions)
        self.critic = nn.Linear(width, 1)

    def forward(self, obs):
        x = self.trunk(obs)
        return self.actor(x), self.critic(x).squeeze(-1)


def build_policy(cfg: dict, seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return GRUPolicy(**cfg) if cfg["kind"] == "gru" else MLPPolicy(**cfg)


def count_params(cfg: dict) -> int:
    with torch.device("meta"):
        m = GRUPolicy(**cfg) if cfg["kind"] == "gru" else MLPPolicy(**cfg)
    return sum(p.numel() for p in m.parameters())


# ============================================================================ rollout
def rollout_loss(policy, cfg, method, T, device, *, acc=None, census=None, data_seed=1234,
                 loss="per-step"):
    """One rollout of T policy calls; returns the scalar loss (attached to autograd).

    The per-step data (observation, action, advantage, return) comes from a private
    generator, so every method and process sees the same numbers and the global RNG
    (which checkpoint and rl_replay snapshot per block) is left alone. With
    ``loss="stacked"`` the observations are still drawn (fresh tensors) step by step,
    the actions, advantages and returns as (T, B) tensors from a second generator.
    """
    g = torch.Generator().manual_seed(data_seed)
    stacked = loss == "stacked"
    if stacked:
        g2 = torch.Generator().manual_seed(data_seed + 1)
        B = cfg["batch"]
        actions = torch.randint(cfg["actions"], (T, B, 1), generator=g2).to(device)
        advs = torch.randn(T, B, generator=g2).to(device)
        rets = torch.randn(T, B, generator=g2).to(device)
        logits_t, values_t = [], []
    elif loss != "per-step":
        raise ValueError(f"unknown loss {loss!r}")
    B, recurrent = cfg["batch"], cfg["kind"] == "gru"
    h = torch.zeros(B, cfg["hidden"], device=device) if recurrent else None
    offload = None
    if method == "checkpoint_cpu":
        pin = device.type == "cuda"
        offload = (census.offload_hooks(pin) if census is not None
                   else torch.autograd.graph.save_on_cpu(pin_memory=pin))
        offload.__enter__()
    hooks = census.hooks() if (census is not None and offload is None) else None
    if hooks is not None:
        hooks.__enter__()
    try:
        terms = []
        for _ in range(T):
            obs = torch.randn(B, cfg["obs"], generator=g).to(device)
            if not stacked:
                action = torch.randint(cfg["actions"], (B, 1), generator=g).to(device)
                adv = torch.randn(B, generator=g).to(device)
                ret = torch.randn(B, generator=g).to(device)
            args = (obs, h) if recurrent else (obs,)
            if method == "plain" or method == "nograd":
                out = policy(*args)
            elif method in ("checkpoint", "checkpoint_cpu"):
                out = checkpoint(policy, *args, use_reentrant=False)
            elif method == "rl_replay":
                kw = dict(obs=obs, h=h) if recurrent else dict(obs=obs)
                out = rl_replay.checkpoint_fsdp_forward(policy, acc, **kw)
            elif method == "rl_replay_td":
                from tensordict import TensorDict

                td = TensorDict(obs=obs, h=h) if recurrent else TensorDict(obs=obs)
                out = rl_replay.replay(policy, acc, td)
            else:
                raise ValueError(f"unknown method {method!r}")
            logits, value = out[0], out[1]
            if recurrent:
                h = out[2]
            if stacked:
                logits_t.append(logits)
                values_t.append(value)
                continue
            logp = F.log_softmax(logits, dim=-1).gather(1, action).squeeze(1)
            terms.append(-(logp * adv).mean() + 0.5 * (value - ret).square().mean())
        if stacked:
            L, V = torch.stack(logits_t), torch.stack(values_t)
            del logits_t, values_t
            logp = F.log_softmax(L, dim=-1).gather(2, actions).squeeze(2)
            per_step = -(logp * advs).mean(1) + 0.5 * (V - rets).square().mean(1)
            total = per_step.sum() / T
        else:
            total = torch.stack(terms).sum() / T
    finally:
        if hooks is not None:
            hooks.__exit__(None, None, None)
        if offload is not None:
            offload.__exit__(None, None, None)
    return total


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def run_once(policy, cfg, method, T, device, census=None, loss_kind="per-step"):
    """(loss, acc, forward seconds) of one rollout forward."""
    acc = rl_replay.GradientAccumulator() if method.startswith("rl_replay") else None
    _sync(device)
    t0 = time.perf_counter()
    if method == "nograd":
        with torch.no_grad():
            loss = rollout_loss(policy, cfg, "plain", T, device, loss=loss_kind)
    else:
        loss = rollout_loss(policy, cfg, method, T, device, acc=acc, census=census, loss=loss_kind)
    _sync(device)
    return loss, acc, time.perf_counter() - t0


def backward_s(loss, device) -> float:
    _sync(device)
    t0 = time.perf_counter()
    loss.backward()
    _sync(device)
    return time.perf_counter() - t0


# ============================================================================ worker
def plan_reps(spec: dict, fwd_step: float, full_step: float) -> tuple[str, int, float]:
    """("full", reps, est) / ("memory_only", 0, est) / ("skip", 0, est) for this budget.

    ``fwd_step`` / ``full_step``: seconds per timestep of a rollout forward / forward +
    backward, from the warm-up rollout (an overestimate: it includes first-call costs).
    """
    T, budget, replay = spec["T"], spec["budget_s"], spec["method"].startswith("rl_replay")
    for reps in range(spec["reps"], -1, -1):
        est = full_step * T * (1 + reps) + (fwd_step * T * max(1, reps) if replay else 0.0)
        if est <= budget:
            return "full", reps, est
    est_full = full_step * T
    if spec.get("memory_only_ok", True) and fwd_step * T <= budget:
        return "memory_only", 0, fwd_step * T
    return "skip", 0, est_full


def worker(spec: dict) -> dict:
    """One (policy, T, method) configuration, in its own process."""
    # Objects that exist before the configuration (modules, torch internals) go to the
    # permanent generation: the census scans and gc.collect() then skip them.
    gc.collect()
    gc.freeze()
    set_threads(spec["threads"])
    device = torch.device(spec["device"])
    cfg, T, method = spec["cfg"], spec["T"], spec["method"]
    loss_kind = spec.get("loss", "per-step")
    policy = build_policy(cfg, seed=spec.get("seed", 0)).to(device)
    params = list(policy.parameters())
    result: dict = dict(policy=spec["policy"], T=T, method=method, device=device.type, loss=loss_kind,
                        threads=torch.get_num_threads(),
                        params=sum(p.numel() for p in params),
                        param_bytes=sum(p.numel() * p.element_size() for p in params))

    # Warm-up (lazy kernel/allocator initialisation must not count as this method's
    # memory); the second, timed one tells how long this configuration would take.
    for warm_T in (2, min(T, 6)):
        loss, _, f = run_once(policy, cfg, method, warm_T, device, loss_kind=loss_kind)
        b = backward_s(loss, device)
        policy.zero_grad(set_to_none=True)
        del loss
    mode, reps, est = plan_reps(spec, f / warm_T, (f + b) / warm_T)
    result.update(mode=mode, estimate_s=est)
    if mode == "skip":
        result["skipped"] = (f"skipped: would take ~{est:.0f} s for one rollout + backward "
                             f"(budget {spec['budget_s']:.0f} s)")
        return result
    gc.collect()

    # Rep 0: memory census, peak memory and the gradient check.
    meter = MemoryMeter(device)
    census = LiveTensorCensus()
    census.snapshot_before(params)
    meter.start()
    loss, acc, fwd0 = run_once(policy, cfg, method, T, device, census=census, loss_kind=loss_kind)
    live = census.live_bytes(slab_used=acc.slabs.used_bytes() if acc is not None else None)
    result["live_bytes"] = sum(live.values())
    result["live_bytes_by_device"] = live
    result["saved_tensor_calls"] = census.saved_calls
    del census
    if acc is not None:
        result["block_input_bytes"] = acc.saved_bytes
        result["slab_bytes"] = acc.slab_bytes
    if mode == "memory_only":  # too slow for a backward within the budget
        result["rss_growth"] = meter.peak_rss_growth()
        result["rss_method"] = meter.method
        result["cuda_peak_growth"] = meter.peak_cuda_growth()
        result.update(fwd_rep0=fwd0, fwd_s=fwd0, timing_reps=0)
        return result
    bwd0 = backward_s(loss, device)
    result["rss_growth"] = meter.peak_rss_growth()
    result["rss_method"] = meter.method
    result["cuda_peak_growth"] = meter.peak_cuda_growth()
    if acc is not None:
        result["replay_seconds_rep0"] = acc.replay_seconds
    del loss, acc
    grads = grad_snapshot(policy)
    if spec.get("grad_out"):
        torch.save(grads, spec["grad_out"])
    if spec.get("grad_ref") and os.path.exists(spec["grad_ref"]):
        ref = torch.load(spec["grad_ref"])
        result["grad_abs"], result["grad_rel"] = grad_diff(grads, ref)
        result["grad_ref_method"] = spec.get("grad_ref_method")
    del grads
    policy.zero_grad(set_to_none=True)

    # Reps 1..R: timing only (no census hooks). The reported times are the median over
    # all 1 + R rollouts (the census rep included: its hooks cost microseconds per saved
    # tensor, and being the first full-length rollout it is rarely the median).
    fwds, bwds = [fwd0], [bwd0]
    replay_s = [result["replay_seconds_rep0"]] if "replay_seconds_rep0" in result else []
    for _ in range(reps):
        loss, acc, f = run_once(policy, cfg, method, T, device, loss_kind=loss_kind)
        b = backward_s(loss, device)
        fwds.append(f)
        bwds.append(b)
        if acc is not None:
            replay_s.append(acc.replay_seconds)
        del loss, acc
        policy.zero_grad(set_to_none=True)
    totals = [f + b for f, b in zip(fwds, bwds)]
    result.update(fwd_s=median(fwds), bwd_s=median(bwds), total_s=median(totals),
                  fwd_all=fwds, bwd_all=bwds, fwd_rep0=fwd0, bwd_rep0=bwd0, timing_reps=len(fwds))
    if replay_s:
        result["replay_seconds"] = median(replay_s)
    if method.startswith("rl_replay"):
        # One extra forward: what the recompute costs at the least.
        ng = [run_once(policy, cfg, "nograd", T, device, loss_kind=loss_kind)[2]
              for _ in range(max(1, reps))]
        result["nograd_fwd_s"] = median(ng)
    return result


# ============================================================================ orchestration
RUN_ORDER = ("plain", "rl_replay", "checkpoint_cpu", "checkpoint", "rl_replay_td")


def methods_for(policy: str, requested: list[str] | None) -> list[str]:
    """Methods in run order: plain first (the gradient reference), then rl_replay, so a
    run that hits its time budget loses the checkpoint baselines first."""
    methods = requested or (list(METHODS) + (["rl_replay_td"] if policy in ("small_gru", "tiny_gru") else []))
    return sorted(methods, key=RUN_ORDER.index)


def estimate_plain_bytes(prev: dict | None, T: int) -> float | None:
    """Peak estimate for T from the same method at a smaller T: the live bytes scale with
    T; the rest of the measured RSS growth (gradients, one block's transients, heap kept
    by glibc) is taken as fixed."""
    if not prev or "live_bytes" not in prev:
        return None
    fixed = max(0, prev.get("rss_growth", 0) - prev["live_bytes"])
    return prev["live_bytes"] / prev["T"] * T + fixed + prev["param_bytes"]


def run_policy(policy: str, args, tmpdir: str, log, deadline: float) -> list[dict]:
    cfg = POLICIES[policy]
    Ts = args.T or ([8] if args.smoke else list(DEFAULT_TS))
    methods = methods_for(policy, args.methods)
    results: list[dict] = []
    prev: dict[str, dict] = {}
    too_slow: set[str] = set()  # skipped at some T: skipped at every larger T
    log(f"\n== policy {policy}: {cfg} ({count_params(cfg) / 1e6:.2f} M parameters)")
    for T in Ts:
        ref_file, ref_method = None, None
        for method in methods:
            tag = f"{policy:<9} T={T:<5} {method:<14}"
            skipped = None
            est_b = estimate_plain_bytes(prev.get(method), T)
            remaining = deadline - time.perf_counter()
            if est_b is not None and est_b > args.mem_budget_gib * 2**30:
                skipped = (f"skipped: would need {est_b / 2**30:.1f} GiB "
                           f"(budget {args.mem_budget_gib:g} GiB)")
            elif method in too_slow:
                skipped = "skipped: over the time budget at a smaller T already"
            elif remaining < 10:
                skipped = "skipped: --budget-seconds for the whole run used up"
            if skipped:
                log(f"{tag} {skipped}")
                results.append(dict(policy=policy, T=T, method=method, skipped=skipped))
                continue
            budget = min(args.max_config_seconds, remaining)
            spec = dict(policy=policy, cfg=cfg, T=T, method=method, reps=args.reps,
                        threads=args.threads, device=args.device, seed=0, budget_s=budget,
                        memory_only_ok=not args.smoke, loss=args.loss)
            if ref_file is None:
                spec["grad_out"] = os.path.join(tmpdir, f"{policy}_{T}_{method}.pt")
            else:
                spec["grad_ref"], spec["grad_ref_method"] = ref_file, ref_method
            r = run_isolated(worker, spec, script=os.path.abspath(__file__),
                             launcher=args.launcher, timeout=max(180.0, 4 * budget), preload=PRELOAD)
            r.setdefault("policy", policy)
            r.setdefault("T", T)
            r.setdefault("method", method)
            results.append(r)
            if "error" in r:
                log(f"{tag} ERROR {r['error']}")
                if args.verbose and r.get("traceback"):
                    log(r["traceback"])
                continue
            if "skipped" in r:
                too_slow.add(method)
                log(f"{tag} {r['skipped']}")
                continue
            if r["mode"] == "memory_only":
                too_slow.add(method)  # larger T: not even a forward fits
            if ref_file is None and r["mode"] == "full":
                ref_file, ref_method = spec["grad_out"], method
            prev[method] = r
            log(f"{tag} {line(r)}")
    return results


def line(r: dict) -> str:
    parts = [f"live {fmt_bytes(r['live_bytes']):>10}", f"rss+ {fmt_bytes(r['rss_growth']):>10}"]
    if r.get("cuda_peak_growth") is not None:
        parts.append(f"cuda+ {fmt_bytes(r['cuda_peak_growth'])}")
    parts.append(f"fwd {fmt_s(r['fwd_s']):>9}")
    if r["mode"] == "memory_only":
        parts.append("bwd  (memory only: no backward within the time budget)")
    else:
        parts.append(f"bwd {fmt_s(r['bwd_s']):>9}")
    if "block_input_bytes" in r:
        parts.append(f"inputs {fmt_bytes(r['block_input_bytes'])}")
    if "grad_abs" in r:
        parts.append(f"grad vs {r['grad_ref_method']}: abs {r['grad_abs']:.1e} rel {r['grad_rel']:.1e}")
    if r["mode"] == "full":
        parts.append(f"(median of {r['timing_reps']}, {r['process_s']:.0f} s)")
    else:
        parts.append(f"({r['process_s']:.0f} s)")
    return "  ".join(parts)


# ============================================================================ analysis
def ok(r):
    """Measured (memory at least)."""
    return r is not None and "error" not in r and "skipped" not in r


def timed(r):
    """Measured with backward and timings."""
    return ok(r) and r.get("mode") == "full"


def find(results, policy, T, method):
    for r in results:
        if r["policy"] == policy and r["T"] == T and r["method"] == method:
            return r
    return None


TARGETS = {
    "slope": 1.25,        # rl_replay live-memory growth per step / block-input bytes per step
    "mem_ratio": 0.10,    # rl_replay / plain live memory at T = 1024
    "time_ratio": 1.4,    # rl_replay / plain total time at T = 256 (deep MLP)
    "fixed_cost": 0.2e-3, # seconds per block, small GRU at T = 1024
}


def analyse(results: list[dict], policy: str) -> dict:
    """Derived numbers and target verdicts for one policy."""
    out: dict = {"policy": policy, "targets": []}
    Ts = sorted({r["T"] for r in results if r["policy"] == policy})
    rep = [r for r in (find(results, policy, T, "rl_replay") for T in Ts) if ok(r)]
    if len(rep) >= 2:
        a, b = rep[0], rep[-1]
        slope = (b["live_bytes"] - a["live_bytes"]) / (b["T"] - a["T"])
        inputs_per_step = b["block_input_bytes"] / b["T"]
        out.update(slope_bytes_per_step=slope, inputs_per_step=inputs_per_step,
                   slope_ratio=slope / inputs_per_step, slope_T=(a["T"], b["T"]),
                   rss_slope_ratio=(b["rss_growth"] - a["rss_growth"]) / (b["T"] - a["T"]) / inputs_per_step)
    for T in Ts:
        p, r = find(results, policy, T, "plain"), find(results, policy, T, "rl_replay")
        c = find(results, policy, T, "checkpoint_cpu")
        td = find(results, policy, T, "rl_replay_td")
        if ok(p) and ok(r):
            out.setdefault("mem_ratio", {})[T] = r["live_bytes"] / p["live_bytes"]
            out.setdefault("rss_ratio", {})[T] = r["rss_growth"] / max(1, p["rss_growth"])
        if timed(p) and timed(r):
            out.setdefault("time_ratio", {})[T] = r["total_s"] / p["total_s"]
            out.setdefault("fixed_cost", {})[T] = (r["total_s"] - p["total_s"] - r["nograd_fwd_s"]) / T
        if timed(c) and timed(r):
            out.setdefault("time_vs_ckpt_cpu", {})[T] = r["total_s"] / c["total_s"]
        if timed(p) and timed(td):
            out.setdefault("fixed_cost_td", {})[T] = (td["total_s"] - p["total_s"] - td["nograd_fwd_s"]) / T
    worst = [(r["grad_abs"], r["grad_rel"]) for r in results
             if r["policy"] == policy and ok(r) and "grad_abs" in r]
    if worst:
        out["grad_abs"] = max(w[0] for w in worst)
        out["grad_rel"] = max(w[1] for w in worst)

    def verdict(name, value, limit, text, missing):
        if value is None:
            out["targets"].append(f"target {name} [{policy}]: NOT MEASURED ({missing})")
        else:
            met = value <= limit
            out["targets"].append(f"target {name} [{policy}]: {'MET' if met else 'MISSED'} ({text})")

    if policy in ("gru", "mlp"):
        v = out.get("slope_ratio")
        verdict("memory growth <= 1.25x block inputs/step", v, TARGETS["slope"],
                v is not None and f"{v:.3f}x: {fmt_bytes(out['slope_bytes_per_step'])}/step vs inputs "
                f"{fmt_bytes(out['inputs_per_step'])}/step, T {out['slope_T'][0]}->{out['slope_T'][1]}",
                "rl_replay needs two T values")
        v = out.get("mem_ratio", {}).get(1024)
        verdict("live memory at T=1024 <= 10% of plain", v, TARGETS["mem_ratio"],
                v is not None and f"{100 * v:.1f}% ({fmt_bytes(find(results, policy, 1024, 'rl_replay')['live_bytes'])}"
                f" vs {fmt_bytes(find(results, policy, 1024, 'plain')['live_bytes'])}; peak RSS growth "
                f"{100 * out['rss_ratio'][1024]:.1f}%)", "plain or rl_replay not measured at T=1024")
    if policy == "mlp":
        v = out.get("time_ratio", {}).get(256)
        verdict("total time at T=256 <= 1.4x plain", v, TARGETS["time_ratio"],
                v is not None and f"{v:.3f}x", "plain or rl_replay not timed at T=256")
        v = out.get("time_vs_ckpt_cpu", {}).get(256)
        verdict("total time at T=256 no slower than checkpoint+save_on_cpu", v, 1.0,
                v is not None and f"{v:.3f}x of method 3", "not timed at T=256")
    if policy == "small_gru":
        v = out.get("fixed_cost", {}).get(1024)
        verdict("fixed cost per block <= 0.2 ms", v, TARGETS["fixed_cost"],
                v is not None and f"{v * 1e3:.3f} ms/block", "not timed at T=1024")
    return out


def summary_line(a: dict) -> str:
    parts = [f"summary {a['policy']}:"]
    if "slope_ratio" in a:
        parts.append(f"rl_replay live memory grows {fmt_bytes(a['slope_bytes_per_step'])}/step = "
                     f"{a['slope_ratio']:.2f}x block inputs ({fmt_bytes(a['inputs_per_step'])}/step, "
                     f"T {a['slope_T'][0]}->{a['slope_T'][1]});")
    if a.get("mem_ratio"):
        T = 1024 if 1024 in a["mem_ratio"] else max(a["mem_ratio"])
        parts.append(f"live memory rl_replay/plain at T={T}: {a['mem_ratio'][T]:.3f} "
                     f"(peak RSS growth {a['rss_ratio'][T]:.3f});")
    if a.get("time_ratio"):
        T = 256 if 256 in a["time_ratio"] else max(a["time_ratio"])
        s = f"total time rl_replay/plain at T={T}: {a['time_ratio'][T]:.3f}x"
        if T in a.get("time_vs_ckpt_cpu", {}):
            s += f", vs checkpoint+save_on_cpu {a['time_vs_ckpt_cpu'][T]:.3f}x"
        parts.append(s + ";")
    if a.get("fixed_cost"):
        T = 1024 if 1024 in a["fixed_cost"] else max(a["fixed_cost"])
        s = f"replay fixed cost {a['fixed_cost'][T] * 1e3:.3f} ms/block at T={T}"
        if T in a.get("fixed_cost_td", {}):
            s += f" (TensorDict path {a['fixed_cost_td'][T] * 1e3:.3f} ms)"
        parts.append(s + ";")
    if "grad_abs" in a:
        parts.append(f"grad worst abs {a['grad_abs']:.1e} rel {a['grad_rel']:.1e}")
    return " ".join(parts)


def markdown_table(results: list[dict], policy: str) -> str:
    cfg = POLICIES[policy]
    head = (f"**{policy}** ({count_params(cfg) / 1e6:.2f} M parameters; "
            + ", ".join(f"{k}={v}" for k, v in cfg.items()) + ")\n\n"
            "| T | method | live bytes for backward | peak RSS growth | rollout fwd | backward "
            "| total | vs plain | grad max abs / rel diff | timed runs (median) |\n"
            "|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|\n")
    rows = []
    order = list(METHODS) + ["rl_replay_td"]
    for r in sorted((r for r in results if r["policy"] == policy),
                    key=lambda r: (r["T"], order.index(r["method"]))):
        if not ok(r):
            why = r.get("skipped") or r.get("error")
            rows.append(f"| {r['T']} | {r['method']} | {why} | | | | | | | |")
            continue
        p = find(results, policy, r["T"], "plain")
        if r["mode"] == "memory_only":
            rows.append(f"| {r['T']} | {r['method']} | {fmt_bytes(r['live_bytes'])} | "
                        f"{fmt_bytes(r['rss_growth'])} (fwd only) | {fmt_s(r['fwd_s'])} | "
                        f"memory only: no backward in the time budget | | | | 1 (forward) |")
            continue
        vs = f"{r['total_s'] / p['total_s']:.2f}x" if timed(p) else "-"
        g = f"{r['grad_abs']:.1e} / {r['grad_rel']:.1e}" if "grad_abs" in r else "(reference)"
        reps = r["timing_reps"]
        rows.append(f"| {r['T']} | {r['method']} | {fmt_bytes(r['live_bytes'])} | "
                    f"{fmt_bytes(r['rss_growth'])} | {fmt_s(r['fwd_s'])} | {fmt_s(r['bwd_s'])} | "
                    f"{fmt_s(r['total_s'])} | {vs} | {g} | {reps} |")
    return head + "\n".join(rows) + "\n"


def plot(results: list[dict], policy: str, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_m, ax_t) = plt.subplots(1, 2, figsize=(11, 4.2))
    styles = {"plain": ("C0", "o"), "checkpoint": ("C1", "s"), "checkpoint_cpu": ("C2", "^"),
              "rl_replay": ("C3", "D"), "rl_replay_td": ("C4", "v")}
    for method, (color, marker) in styles.items():
        rs = sorted((r for r in results if r["policy"] == policy and r["method"] == method and ok(r)),
                    key=lambda r: r["T"])
        if not rs:
            continue
        Ts = [r["T"] for r in rs]
        ax_m.plot(Ts, [r["live_bytes"] / 2**20 for r in rs], "-", marker=marker, color=color,
                  label=f"{method} live", alpha=0.85)
        ax_m.plot(Ts, [max(r["rss_growth"], 1) / 2**20 for r in rs], ":", marker=marker, color=color,
                  alpha=0.45, mfc="none", label=f"{method} peak RSS growth")
        tt = [r for r in rs if timed(r)]
        if tt:
            ax_t.plot([r["T"] for r in tt], [r["total_s"] for r in tt], "-", marker=marker, color=color,
                      label=method, alpha=0.85)
    for ax in (ax_m, ax_t):
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("rollout length T (policy calls)")
        ax.grid(True, which="both", alpha=0.3)
    ax_m.set_ylabel("MiB")
    ax_m.set_title(f"{policy}: memory held for backward (end of rollout forward)", fontsize=10)
    ax_t.set_ylabel("seconds (rollout forward + backward)")
    ax_t.set_title(f"{policy}: time (rollout forward + backward, median)", fontsize=10)
    ax_m.legend(fontsize=6.5, ncol=2)
    ax_t.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


# ============================================================================ profile
def profile_replay(args) -> None:
    """cProfile of the rl_replay rollout + backward of one policy (in this process)."""
    import cProfile
    import pstats

    set_threads(args.threads)
    policy_name = args.policy[0]
    cfg = POLICIES[policy_name]
    T = (args.T or [1024])[0]
    device = torch.device(args.device)
    policy = build_policy(cfg).to(device)
    method = (args.methods or ["rl_replay"])[0]
    loss, _, _ = run_once(policy, cfg, method, 8, device)
    loss.backward()
    prof = cProfile.Profile()
    prof.enable()
    loss, acc, _ = run_once(policy, cfg, method, T, device)
    loss.backward()
    prof.disable()
    print(f"cProfile: {policy_name} T={T} {method}, forward + backward, sorted by own time")
    pstats.Stats(prof).sort_stats("tottime").print_stats(25)


# ============================================================================ main
def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--policy", nargs="+", default=["gru"], choices=sorted(POLICIES))
    ap.add_argument("--T", type=int, nargs="+", help=f"rollout lengths (default {DEFAULT_TS})")
    ap.add_argument("--methods", nargs="+", choices=list(METHODS) + ["rl_replay_td"])
    ap.add_argument("--reps", type=int, default=2,
                    help="rollouts after the census rollout; times are the median of all 1 + reps")
    ap.add_argument("--threads", type=int, default=1, help="torch intra-op threads per worker")
    ap.add_argument("--loss", choices=["per-step", "stacked"], default="per-step",
                    help="per-step: A2C terms from one small graph per step (the tables' loss); "
                         "stacked: the same terms on the stacked (T, B) outputs")
    ap.add_argument("--device", default="auto", help="cpu | cuda | auto")
    ap.add_argument("--mem-budget-gib", type=float, default=6.0,
                    help="skip a configuration whose estimated peak exceeds this")
    ap.add_argument("--max-config-seconds", type=float, default=150.0,
                    help="per configuration: fewer timing reps, then forward-only memory, then "
                         "skip, when it is estimated to take longer")
    ap.add_argument("--budget-seconds", type=float, default=float("inf"),
                    help="wall-time budget of the whole run; later configurations get what is left")
    ap.add_argument("--launcher", choices=["forkserver", "subprocess"], default="forkserver")
    ap.add_argument("--docs", default=os.path.join(ROOT, "docs", "benchmarks.md"),
                    help="markdown file whose marked section gets the tables ('' = none)")
    ap.add_argument("--plot-dir", default=os.path.join(ROOT, "docs"))
    ap.add_argument("--json", help="also write all results to this JSON file")
    ap.add_argument("--merge", action="store_true",
                    help="with --json: start from the results already in that file; configurations "
                         "measured now replace the same (policy, T, method) there, skipped ones do not")
    ap.add_argument("--render-only", action="store_true",
                    help="measure nothing: tables, plots and docs from the results in --json")
    ap.add_argument("--smoke", action="store_true", help="tiny policies, T=8, a few seconds")
    ap.add_argument("--profile", action="store_true", help="cProfile rl_replay for the first --policy")
    ap.add_argument("--verbose", action="store_true")
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker:
        return worker_cli(worker, args.worker)
    if args.device == "auto":
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    if args.profile:
        profile_replay(args)
        return 0
    if args.smoke:
        args.policy = ["tiny_gru", "tiny_mlp"]
        args.reps = min(args.reps, 1)
    print(describe_machine(), f"| device {args.device}, {args.threads} thread(s) per worker, "
          f"launcher {args.launcher}", flush=True)
    if args.device == "cpu":
        print("CUDA column: not measured (no CUDA device); the torch.cuda.max_memory_allocated "
              "path runs with --device cuda.")
    print(GLIBC_NOTE, flush=True)

    def log(msg):
        print(msg, flush=True)

    all_results: list[dict] = []
    t_start = time.perf_counter()
    deadline = t_start + args.budget_seconds
    with tempfile.TemporaryDirectory(prefix="bench_memory_") as tmpdir:
        for policy in args.policy:
            if not args.render_only:
                all_results += run_policy(policy, args, tmpdir, log, deadline)
        if (args.merge or args.render_only) and args.json and os.path.exists(args.json):
            with open(args.json) as fh:
                earlier = json.load(fh)["results"]
            key = lambda r: (r["policy"], r["T"], r["method"])  # noqa: E731
            fresh = {key(r): r for r in all_results if ok(r)}
            merged = {key(r): r for r in earlier}
            for r in all_results:
                if key(r) in fresh or key(r) not in merged or not ok(merged[key(r)]):
                    merged[key(r)] = r
            all_results = list(merged.values())
            print(f"merged with {len(earlier)} earlier results from {args.json}")
        plot_dir = tmpdir if args.smoke else args.plot_dir
        analyses = [analyse(all_results, p) for p in args.policy]
        print()
        for p in args.policy:
            print(markdown_table(all_results, p))
            try:
                path = os.path.join(plot_dir, f"bench_memory_{p}.png")
                plot(all_results, p, path)
                print(f"plot: {path}" + (" (temporary, --smoke)" if args.smoke else ""))
            except Exception as exc:  # matplotlib missing or headless trouble
                print(f"plot failed: {exc}")
        for a in analyses:
            print(summary_line(a))
        for a in analyses:
            for t in a["targets"]:
                print(t)
    worst = [(r["grad_abs"], r["grad_rel"]) for r in all_results if ok(r) and "grad_abs" in r]
    if worst:
        print(f"gradient check: worst abs diff {max(w[0] for w in worst):.3e}, "
              f"worst rel diff {max(w[1] for w in worst):.3e} "
              f"({len(worst)} configurations of checkpoint / checkpoint_cpu / rl_replay vs plain)")
    else:
        print("gradient check: nothing compared")
    errors = [r for r in all_results if "error" in r]
    print(GLIBC_NOTE)
    print(f"wall time {time.perf_counter() - t_start:.0f} s; {load_line()}")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"machine": describe_machine(), "args": vars(args), "results": all_results,
                       "analysis": analyses}, fh, indent=1, default=str)
    if not args.smoke and args.docs:
        body = "\n".join(markdown_table(all_results, p) for p in args.policy)
        body += "\n" + "\n".join("    " + summary_line(a) for a in analyses)
        body += "\n" + "\n".join("    " + t for a in analyses for t in a["targets"]) + "\n"
        update_marked_section(args.docs, "bench_memory " + " ".join(args.policy), body)
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
