"""What ``memory.py`` measures: one (policy, T, method) configuration in its own process.

:func:`worker` takes a plain spec dict and returns a plain, JSON-serialisable result dict
(live bytes, peak memory growth, times, gradient differences); rendering those is
``memory_report.py``'s job, running many of them ``memory.py``'s.
"""

from __future__ import annotations

import gc
import os
import time

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

import rl_replay
from scripts.bench.common import LiveTensorCensus, MemoryMeter, grad_diff, grad_snapshot, median, set_threads
from scripts.bench.policies import build_policy

METHODS = ("plain", "checkpoint", "checkpoint_cpu", "rl_replay")


def rollout_loss(policy, cfg, method, T, device, *, acc=None, census=None, data_seed=1234, loss="per-step"):
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
        offload = census.offload_hooks(pin) if census is not None else torch.autograd.graph.save_on_cpu(pin_memory=pin)
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


# ----------------------------------------------------------------------------- one configuration
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
    result: dict = dict(
        policy=spec["policy"],
        T=T,
        method=method,
        device=device.type,
        loss=loss_kind,
        threads=torch.get_num_threads(),
        params=sum(p.numel() for p in params),
        param_bytes=sum(p.numel() * p.element_size() for p in params),
    )

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
        result["skipped"] = (
            f"skipped: would take ~{est:.0f} s for one rollout + backward (budget {spec['budget_s']:.0f} s)"
        )
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
    result.update(
        fwd_s=median(fwds),
        bwd_s=median(bwds),
        total_s=median(totals),
        fwd_all=fwds,
        bwd_all=bwds,
        fwd_rep0=fwd0,
        bwd_rep0=bwd0,
        timing_reps=len(fwds),
    )
    if replay_s:
        result["replay_seconds"] = median(replay_s)
    if method.startswith("rl_replay"):
        # One extra forward: what the recompute costs at the least.
        ng = [run_once(policy, cfg, "nograd", T, device, loss_kind=loss_kind)[2] for _ in range(max(1, reps))]
        result["nograd_fwd_s"] = median(ng)
    return result
